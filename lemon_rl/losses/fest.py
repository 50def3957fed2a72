"""FEST: few-shot expert guidance for RLVR (METHODS.md section 2).

Pairs, not prompts, are the unit: every rollout ``y-_i`` of a ``D_E`` prompt is
paired with that prompt's expert solution ``y+`` (*Decision*), so every array
below is per pair, ``[N]`` (or ``[N, T]`` for tokens). Compute the expert's
log-probs once per prompt and gather them per pair with the group ids
(``pos_logp[group_ids]``); the gather is differentiable.

Sequence log-probs are *sums* over the completion tokens; ``pi_ref`` is the
frozen initial policy (*Decision*). Implicit rewards:
``r+ = log pi(y+|x) - log pi_ref(y+|x)``, ``r- = log pi(y-|x) - log pi_ref(y-|x)``.

- :func:`semi_online_dpo_loss`: ``L_E = -mean_i log sigmoid(beta_i (r+ - r-_i))``.
- :func:`decaying_weight`: ``w = beta sigmoid(beta (r- - r+))``; by the gradient identity
  ``grad L_E = -mean_i w_i (grad log pi(y+) - grad log pi(y-_i))``.
- :func:`adaptive_beta`: ``beta1 / beta2 / beta3`` by the correctness of the group.
- :func:`fest_dpo_loss`: ``c L_E + L_I``; :func:`fest_grpo_sft_term` and
  :func:`fest_grpo_loss`: ``c L_SFT(sg[w]) + L_GRPO``.

Like every loss here, each returns an unreduced ``WeightedMetric(sum, denominator)``. The two combiners add
means with different denominators, so their pair is ``(sum_k c_k S_k / D_k, share)``: the terms divided by
their (global) denominators and the piece's share of the batch (1 for the whole batch; e.g. ``1 / M`` for
each of ``M`` micro-batches), so that the pieces add up to ``(L, 1)``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from lemon_rl import ops
from lemon_rl.losses import policy_gradient as pg

Array = jax.Array
WeightedMetric = ops.WeightedMetric

# beta1 (all rollouts wrong), beta2 (this one wrong, some right), beta3 (this one right): the paper's preset
# for chains of thousands of tokens, and the weight c of L_E. *Decision* (METHODS.md section 2, revised): a
# task sets its betas from a pilot of the margin z = r+ - r- so that beta1 * z reaches order 1, with
# beta1 >= beta2 >= beta3 (configs/fest_math.py records its pilot).
DEFAULT_BETA1 = 0.005
DEFAULT_BETA2 = 0.02
DEFAULT_BETA3 = 0.1
DEFAULT_C = 1.0


def adaptive_beta(correct: Array, group_ids: Array, num_groups: int, *,
                  beta1: float = DEFAULT_BETA1, beta2: float = DEFAULT_BETA2,
                  beta3: float = DEFAULT_BETA3, valid: Array | None = None) -> Array:
  """The per-pair DPO temperature by difficulty.

    beta_i = beta1  if no rollout of the prompt is correct,
             beta2  if rollout i is wrong but another rollout of the prompt is right,
             beta3  if rollout i is right.

  Args:
    correct: ``[N]`` bool (or 0/1), the verifier's verdict on rollout ``i``.
    group_ids: ``[N]`` int in ``[0, num_groups)``, the prompt of each rollout.
    num_groups: static number of prompts.
    beta1, beta2, beta3: the three temperatures.
    valid: optional ``[N]`` mask; padding rows neither make a group solvable nor
      matter (they get ``beta1``).

  Returns:
    ``[N]`` float32.
  """
  chex.assert_rank([correct, group_ids], 1)
  chex.assert_equal_shape([correct, group_ids])
  chex.assert_type(group_ids, int)
  ops.check_segment_ids(group_ids, num_groups, name="group_ids")
  ok = jnp.asarray(correct) != 0
  if valid is not None:
    chex.assert_equal_shape([correct, valid])
    ok = ok & (jnp.asarray(valid) != 0)
  solved = ops.segment_sum(ok.astype(jnp.float32), group_ids, num_groups) > 0
  return jnp.where(ok, beta3, jnp.where(solved[group_ids], beta2, beta1)).astype(jnp.float32)


def _check_pairs(*arrays: Array) -> None:
  chex.assert_rank(arrays, 1)
  chex.assert_equal_shape(arrays)
  chex.assert_type(arrays, float)


def _beta(beta, n: int) -> Array:
  beta = jnp.asarray(beta, jnp.float32)
  chex.assert_rank(beta, {0, 1})
  if beta.ndim == 1:
    chex.assert_shape(beta, (n,))
  return jnp.broadcast_to(beta, (n,))


def _pair_weights(n: int, valid: Array | None) -> Array:
  if valid is None:
    return jnp.ones((n,), jnp.float32)
  chex.assert_shape(valid, (n,))
  return (jnp.asarray(valid) != 0).astype(jnp.float32)


def decaying_weight(r_pos: Array, r_neg: Array, beta) -> Array:
  """``w = beta * sigmoid(beta (r- - r+))``, ``[N]``: decays as the expert becomes likely."""
  beta = _beta(beta, r_pos.shape[0])
  return beta * jax.nn.sigmoid(beta * (r_neg - r_pos))


def semi_online_dpo_loss(policy_logp_pos: Array, ref_logp_pos: Array, policy_logp_neg: Array,
                         ref_logp_neg: Array, beta, *, valid: Array | None = None
                         ) -> tuple[WeightedMetric, dict[str, ops.Metric]]:
  """FEST-DPO's ``L_E = -mean_i log sigmoid(beta_i (r+_i - r-_i))`` as a ``(sum, count)`` pair.

  Args:
    policy_logp_pos: ``[N]`` ``log pi(y+|x)`` (sequence sum) of each pair's expert solution.
    ref_logp_pos: ``[N]`` ``log pi_ref(y+|x)`` (no gradient).
    policy_logp_neg: ``[N]`` ``log pi(y-_i|x)`` of the rollout.
    ref_logp_neg: ``[N]`` ``log pi_ref(y-_i|x)`` (no gradient).
    beta: scalar or ``[N]`` (e.g. :func:`adaptive_beta`).
    valid: optional ``[N]`` mask of real pairs.

  Returns:
    ``(loss, metrics)``: ``loss = (sum_i v_i l_i, sum_i v_i)``; metrics (pair
    means): ``reward_pos``, ``reward_neg``, ``reward_margin`` (``r+ - r-``),
    ``reward_accuracy`` (share with ``r+ > r-``), ``decaying_weight``, ``beta``.
  """
  _check_pairs(policy_logp_pos, ref_logp_pos, policy_logp_neg, ref_logp_neg)
  n = policy_logp_pos.shape[0]
  beta = _beta(beta, n)
  v = _pair_weights(n, valid)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  r_pos = f32(policy_logp_pos) - jax.lax.stop_gradient(f32(ref_logp_pos))
  r_neg = f32(policy_logp_neg) - jax.lax.stop_gradient(f32(ref_logp_neg))
  margin = r_pos - r_neg
  per_pair = -jax.nn.log_sigmoid(beta * margin)
  sg = jax.lax.stop_gradient
  metrics = {
      "reward_pos": ops.weighted_metric(sg(r_pos), v),
      "reward_neg": ops.weighted_metric(sg(r_neg), v),
      "reward_margin": ops.weighted_metric(sg(margin), v),
      "reward_accuracy": ops.weighted_metric((sg(margin) > 0).astype(jnp.float32), v),
      "decaying_weight": ops.weighted_metric(sg(decaying_weight(r_pos, r_neg, beta)), v),
      "beta": ops.weighted_metric(beta, v),
  }
  return ops.weighted_metric(per_pair, v), metrics


def fest_dpo_loss(expert: WeightedMetric, rl: WeightedMetric, *, c: float = DEFAULT_C,
                  expert_denominator: Array | None = None,
                  rl_denominator: Array | None = None, share=1.0) -> WeightedMetric:
  """FEST-DPO total ``L = c * L_E + L_I``.

  Args:
    expert: ``L_E`` from :func:`semi_online_dpo_loss`.
    rl: ``L_I``, the GRPO loss on ``D_I`` (e.g. :func:`lemon_rl.losses.grpo_loss`;
      the paper: no KL, no std normalisation, asymmetric clip).
    c: weight of ``L_E``.
    expert_denominator, rl_denominator: the *global* denominators when ``expert``
      and ``rl`` are micro-batch pieces (see :func:`lemon_rl.ops.sum_of_means`).
    share: this piece's share of the batch, the returned denominator (1 for the
      whole batch; shares of the pieces add up to 1).

  Returns:
    ``WeightedMetric(c * S_E / D_E + S_I / D_I, share)``; its ``value`` is ``L``
    for the whole batch, and the pieces of a batch add up to ``(L, 1)``.
  """
  return _combine(expert, rl, c, expert_denominator, rl_denominator, share)


def weighted_log_likelihood_loss(token_logp: Array, mask: Array, weight: Array, *,
                                 aggregation: str = "seq_mean_token_sum",
                                 max_len: int | None = None,
                                 valid: Array | None = None) -> WeightedMetric:
  """``-sg[w_i] log pi(y_i)`` per sequence, aggregated: a weighted SFT (or REINFORCE) loss.

  Per token ``l[i, t] = -sg[w_i] * logp[i, t]``; with the default
  ``seq_mean_token_sum`` aggregation the loss is ``-mean_i sg[w_i] log pi(y_i)``
  with sequence-sum log-probs, the scale of the DPO gradient identity. It is
  REINFORCE with reward ``weight``: ``weight = w`` on ``y+`` is the weighted SFT
  half of the DPO gradient, ``weight = -w`` on ``y-`` its on-policy half.

  Args:
    token_logp: ``[N, T]`` log-probs of the sequence's tokens (differentiated).
    mask: ``[N, T]`` 0/1 completion mask.
    weight: ``[N]`` per-sequence weight (gradient stopped).
    aggregation: a name in :data:`lemon_rl.losses.AGGREGATIONS`.
    max_len: see :func:`lemon_rl.losses.seq_mean_token_sum_norm`.
    valid: optional ``[N]`` mask of real rows.
  """
  chex.assert_rank([token_logp, mask], 2)
  chex.assert_equal_shape([token_logp, mask])
  chex.assert_shape(weight, token_logp.shape[:1])
  w = jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))
  m = (jnp.asarray(mask) != 0).astype(jnp.float32)
  if valid is not None:
    m = m * _pair_weights(token_logp.shape[0], valid)[:, None]
  per_token = -w[:, None] * jnp.asarray(token_logp, jnp.float32)
  return pg.aggregate(per_token, m, aggregation, max_len=max_len)


def fest_grpo_sft_term(pos_token_logp: Array, pos_mask: Array, ref_logp_pos: Array,
                       policy_logp_neg: Array, ref_logp_neg: Array, beta, *,
                       aggregation: str = "seq_mean_token_sum", max_len: int | None = None,
                       valid: Array | None = None, fixed_weight: bool = False
                       ) -> tuple[WeightedMetric, dict[str, ops.Metric]]:
  """FEST-GRPO's weighted SFT term on the expert: ``L_SFT = -mean_i sg[w_i] log pi(y+_i)``.

  ``w_i = beta_i sigmoid(beta_i (r-_i - r+_i))`` is the DPO decaying weight,
  computed here from the current log-probs and stopped from the gradient; the
  REINFORCE-on-``y-`` half of the DPO gradient is replaced by GRPO on the same
  rollouts (verifier reward), so the caller adds a :func:`grpo_loss` over them.

  *Decision*: the default aggregation ``seq_mean_token_sum`` (sequence-sum
  log-probs, mean over pairs) reproduces the supervised half of the DPO
  gradient exactly; ``token_mean`` etc. rescale it to the token level of GRPO.

  ``fixed_weight=True`` is the ablation that holds ``w_i`` at its value when
  the policy is the reference (``r+ = r- = 0``): ``w_i = beta_i / 2``, so the
  weight never decays as the expert becomes likely.

  Args:
    pos_token_logp: ``[N, T]`` per-token ``log pi`` of the expert solution of each pair.
    pos_mask: ``[N, T]`` the expert completion's mask.
    ref_logp_pos: ``[N]`` ``log pi_ref(y+|x)`` (sequence sum).
    policy_logp_neg: ``[N]`` ``log pi(y-_i|x)`` (sequence sum; only used for ``w``).
    ref_logp_neg: ``[N]`` ``log pi_ref(y-_i|x)``.
    beta: scalar or ``[N]``.
    aggregation, max_len: how the per-token loss is aggregated.
    valid: optional ``[N]`` mask of real pairs.
    fixed_weight: hold ``w_i = beta_i / 2`` (the ablation above).

  Returns:
    ``(loss, metrics)`` with metrics ``decaying_weight`` and ``reward_margin`` (pair means).
  """
  chex.assert_rank([pos_token_logp, pos_mask], 2)
  _check_pairs(ref_logp_pos, policy_logp_neg, ref_logp_neg)
  chex.assert_shape(ref_logp_pos, pos_token_logp.shape[:1])
  n = pos_token_logp.shape[0]
  sg = jax.lax.stop_gradient
  beta = _beta(beta, n)
  v = _pair_weights(n, valid)
  policy_logp_pos = ops.masked_sum(sg(pos_token_logp), pos_mask, axis=-1)
  r_pos = policy_logp_pos - sg(jnp.asarray(ref_logp_pos, jnp.float32))
  r_neg = sg(jnp.asarray(policy_logp_neg, jnp.float32)) - sg(jnp.asarray(ref_logp_neg, jnp.float32))
  w = beta / 2 if fixed_weight else sg(decaying_weight(r_pos, r_neg, beta))
  loss = weighted_log_likelihood_loss(pos_token_logp, pos_mask, w, aggregation=aggregation,
                                      max_len=max_len, valid=valid)
  metrics = {
      "decaying_weight": ops.weighted_metric(w, v),
      "reward_margin": ops.weighted_metric(r_pos - r_neg, v),
  }
  return loss, metrics


def fest_grpo_loss(sft: WeightedMetric, rl: WeightedMetric, *, c: float = DEFAULT_C,
                   sft_denominator: Array | None = None,
                   rl_denominator: Array | None = None, share=1.0) -> WeightedMetric:
  """FEST-GRPO total ``L = c * L_SFT + L_GRPO``.

  Args:
    sft: from :func:`fest_grpo_sft_term`.
    rl: the GRPO loss over the rollouts of ``D_I`` *and* ``D_E`` (verifier
      rewards), one clipped token-level objective for both.
    c: weight of the SFT term.
    sft_denominator, rl_denominator: global denominators under micro-batching.
    share: this piece's share of the batch (see :func:`fest_dpo_loss`).

  Returns:
    ``WeightedMetric(c * S_SFT / D_SFT + S_GRPO / D_GRPO, share)``.
  """
  return _combine(sft, rl, c, sft_denominator, rl_denominator, share)


def _combine(first: WeightedMetric, second: WeightedMetric, c: float, den1, den2, share) -> WeightedMetric:
  if (den1 is None) != (den2 is None):
    raise ValueError("pass both global denominators or neither")
  dens = None if den1 is None else (den1, den2)
  total = ops.sum_of_means([first, second], [c, 1.0], dens)
  return WeightedMetric(total, jnp.asarray(share, jnp.float32))
