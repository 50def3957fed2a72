"""PPOW: window-level RL for a speculative-decoding drafter, and ADAW window sampling (METHODS.md section 3).

Reference implementation of PPOW (Jiang, Sun et al., "Performance-Driven Policy Optimization for Speculative
Decoding with Adaptive Windowing"), which has no public code. Pure functions of arrays (jit / vmap / pmap
friendly; strings static), each loss an unreduced :class:`~lemon_rl.ops.WeightedMetric` ``(sum, den)``.

Layout. ``N`` windows, flat: row ``i`` holds the ``K`` tokens ``d_1..d_K`` the drafter drew after prefix
``x_i``; ``group_ids [N]`` in ``[0, P)`` name the prefix, so the ``G_roll`` windows of a prefix share an id
(the group of the group-relative advantage). Two teacher-forced forwards over ``[x_i, d_1..d_K]`` give

- ``target_logits [N, K, V]``: position ``j`` (0-based) is the target's next-token logits after
  ``x, d_1..d_j``, i.e. the distribution ``d_{j+1}`` is verified against (the engine's ``p_j``,
  :func:`lemon_rl.sampling.speculative.verify`, without its bonus position ``K``);
- ``drafter_logits [N, K, V]``: the drafter's logits ``d_{j+1}`` was drawn from;
- ``mask [N, K]``: 1 on the window's real positions, left-aligned (a window cut by EOS or the end of the
  text is shorter). Padded positions may hold any logits (``-inf`` or NaN included).

Pipeline of one PPOW step (each piece below is independent):

1. :func:`accepted_length` -- ``k`` under ``"greedy"`` or ``"sampling"`` verification, or its expectation
   over the verification uniforms (``"expected"``), with the distribution of ``k``;
2. :func:`window_rewards` -- ``R = R_speedup + R_dist``;
3. :func:`window_advantages` -- group-relative advantages over the windows of a prefix (the registered
   estimators of :mod:`lemon_rl.losses.advantages`);
4. :func:`ppow_loss` -- the drafter's clipped token-ratio surrogate plus ``beta KL(Q || P)``, exact per
   position, gradient through the drafter only;
5. ADAW: :func:`criticality`, :func:`window_scores` / :func:`sliding_window_scores`,
   :func:`adaw_probabilities` (proportional with a uniform floor) and :func:`adaw_sample`.

Distributions (*Decision*, one convention throughout): verification (``k``) uses the *sampling*
distributions, ``p = softmax(sampling_logits(target_logits, T, top_k, top_p))`` and ``q`` likewise from the
drafter's logits with the same ``(T, top_k, top_p)``, exactly as the engine verifies; greedy verification
compares with ``argmax`` of the raw target logits, as the engine does. Everything else (the log-likelihood
gap of ``R_dist``, the KL term, ADAW's criticality) uses the models' own *temperature-1, unfiltered*
distributions ``P = softmax(target_logits)``, ``Q = softmax(drafter_logits)``: they are what the drafter is
anchored to, independent of the deployment temperature, and finite everywhere (a top-k/top-p-filtered
``P`` would make ``KL(Q || P)`` infinite).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from lemon_rl import ops
from lemon_rl.losses import advantages as adv_lib
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.sampling import distribution

Array = jax.Array
WeightedMetric = ops.WeightedMetric
Metrics = dict[str, ops.Metric]

# METHODS.md section 3 (paper values and *Decisions*).
DEFAULT_GAMMA = 0.12  # drafter / target cost ratio of R_speedup (the paper's value)
DEFAULT_ETA = 0.2  # R_dist (*Decision*)
DEFAULT_EPS = 1.0  # R_dist threshold on the per-token log-likelihood gap, nats (*Decision*)
DEFAULT_BETA = 0.01  # weight of KL(Q || P) (*Decision*)
# *Decision*: the paper's J averages tokens within a window, then windows: (1/G) sum_i (1/K) sum_t.
DEFAULT_AGGREGATION = "seq_mean_token_mean"
# *Decision*: ADAW mixes the proportional distribution with the uniform one, weight 0.1 on the uniform, so
# every valid window keeps probability >= 0.1 / N (a window the drafter already fits is still revisited).
DEFAULT_FLOOR = 0.1

VERIFICATIONS = ("greedy", "sampling", "expected")


def _concrete(x) -> float | None:
  if x is None or isinstance(x, jax.core.Tracer):
    return None
  return float(np.asarray(x))


def _valid(mask: Array | None, shape: tuple[int, ...]) -> Array:
  """``mask != 0`` as bool of ``shape`` (all True when ``mask`` is None)."""
  if mask is None:
    return jnp.ones(shape, bool)
  chex.assert_shape(mask, shape)
  return jnp.asarray(mask) != 0


def _zero_masked_logits(logits: Array, valid: Array) -> Array:
  """float32 logits with every entry of a padded position set to 0 (no inf / NaN can reach a gradient)."""
  return jnp.where(valid[..., None], logits.astype(jnp.float32), 0.0)


# ---------------------------------------------------------------------------------------------------------
# Exact divergences and criticality.
# ---------------------------------------------------------------------------------------------------------


def exact_kl(logits_a: Array, logits_b: Array) -> Array:
  """``KL(A || B) = sum_v a_v (log a_v - log b_v)`` per position, summed over the whole vocabulary.

  ``A = softmax(logits_a)``, ``B = softmax(logits_b)`` (temperature 1, float32). Terms with ``a_v = 0``
  (a ``-inf`` logit) are 0 in value and gradient; ``b_v = 0 < a_v`` gives ``+inf``.

  Args:
    logits_a, logits_b: ``[..., V]``.

  Returns:
    ``[...]`` float32, ``>= 0``.
  """
  chex.assert_equal_shape([logits_a, logits_b])
  log_a = jax.nn.log_softmax(logits_a.astype(jnp.float32), axis=-1)
  log_b = jax.nn.log_softmax(logits_b.astype(jnp.float32), axis=-1)
  a = jnp.exp(log_a)
  support = a > 0
  # Both logs are zeroed off A's support *before* the difference (0 * -inf would be NaN, also in the VJP).
  diff = jnp.where(support, log_a, 0.0) - jnp.where(support, log_b, 0.0)
  return jnp.sum(a * diff, axis=-1)


def criticality(target_logits: Array, drafter_logits: Array) -> Array:
  """ADAW's token criticality ``v_t = (1 - H(P_t) / log|V|) * KL(P_t || Q_t)``.

  The first factor is the target's confidence (1 for a one-hot ``P_t``, 0 for a uniform one), the second
  how far the drafter is from it; ``v_t`` is large where the target is sure and the drafter disagrees.
  ``P``, ``Q``: temperature-1 distributions of the raw logits (module docstring). No gradient.

  Args:
    target_logits: ``[B, T, V]`` (``V >= 2``).
    drafter_logits: ``[B, T, V]``.

  Returns:
    ``[B, T]`` float32, ``>= 0`` (``+inf`` where ``Q_t`` gives 0 to a token ``P_t`` supports).
  """
  chex.assert_rank([target_logits, drafter_logits], 3)
  chex.assert_equal_shape([target_logits, drafter_logits])
  vocab = target_logits.shape[-1]
  if vocab < 2:
    raise ValueError(f"criticality needs a vocabulary of at least 2 tokens, got {vocab}")
  target_logits = jax.lax.stop_gradient(target_logits)
  drafter_logits = jax.lax.stop_gradient(drafter_logits)
  # Clipped at 0: the entropy of a uniform P can exceed log|V| by float rounding.
  confidence = jnp.maximum(1.0 - ops.entropy_from_logits(target_logits) / np.log(vocab), 0.0)
  # A uniform P (confidence 0) scores 0 even against a Q with zeros (0 * inf would be NaN).
  return jnp.where(confidence > 0, exact_kl(target_logits, drafter_logits) * confidence, 0.0)


# ---------------------------------------------------------------------------------------------------------
# Accepted length.
# ---------------------------------------------------------------------------------------------------------


class Acceptance(NamedTuple):
  """The verification outcome of ``N`` windows of ``K`` drafts (no gradient).

  With ``c_j`` the (probability of the) acceptance of draft position ``j`` and all before it:

  Attributes:
    length: ``[N]`` float32, ``k = sum_j c_j`` (``greedy`` / ``sampling``) or ``E[k]`` (``expected``).
    per_position: ``[N, K]`` float32 ``c_j``: ``1{j < k}`` (0-based ``j``), or for ``expected``
      ``prod_{i <= j} a_i``.
    length_probs: ``[N, K + 1]`` float32 ``P(k = m) = c_m - c_{m+1}`` (``c_0 = 1``, ``c_{K+1} = 0``):
      one-hot at ``k`` for a realised length; the distribution of ``k`` over the verification uniforms
      for ``expected``.
  """

  length: Array
  per_position: Array
  length_probs: Array


def accepted_length(drafts: Array, target_logits: Array, drafter_logits: Array | None = None,
                    mask: Array | None = None, *, verification: str = "greedy",
                    uniforms: Array | None = None, temperature: Any = 1.0, top_k: Any = 0,
                    top_p: Any = 1.0) -> Acceptance:
  """The accepted length ``k`` of each window: the number of leading drafts the target accepts.

  ``k = sum_{j=1..K} prod_{i<=j} acc_i`` with, per verification (``p_i``, ``q_i``: the target's and the
  drafter's *sampling* distributions at window position ``i``, same ``temperature, top_k, top_p``, as
  :func:`lemon_rl.sampling.speculative.verify` builds them):

  - ``"greedy"``: ``acc_i = 1{d_i = argmax target_logits_i}`` (the engine at temperature 0);
  - ``"sampling"``: ``acc_i = 1{u_i < min(1, p_i(d_i) / q_i(d_i))}``, tested as the engine does,
    ``log u_i < log p_i(d_i) - log q_i(d_i)``; ``u_i`` are the given uniforms. Fed the engine's uniforms
    (``jax.random.uniform(jax.random.split(key)[0], drafts.shape)`` for ``verify``'s ``key``) it gives the
    engine's ``num_accepted``. The rule is lossless only if ``d_i`` was drawn from ``q_i``;
  - ``"expected"``: the expectation over the uniforms given the drafts, a lower-variance reward,
    ``E[k] = sum_{j=1..K} prod_{i<=j} a_i`` with ``a_i = min(1, p_i(d_i) / q_i(d_i))``.

  Padded positions (``mask = 0``) count as rejected, so ``k`` never exceeds the window's length.

  Args:
    drafts: ``[N, K]`` int, the drafted tokens.
    target_logits: ``[N, K, V]`` (module docstring).
    drafter_logits: ``[N, K, V]``; unused (may be None) for ``"greedy"``.
    mask: ``[N, K]`` or None (all valid).
    verification: ``"greedy"``, ``"sampling"`` or ``"expected"`` (static).
    uniforms: ``[N, K]`` in ``[0, 1)``, required for ``"sampling"``.
    temperature, top_k, top_p: the sampling distribution (may be traced); unused for ``"greedy"``.

  Returns:
    An :class:`Acceptance`.
  """
  if verification not in VERIFICATIONS:
    raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
  chex.assert_rank(drafts, 2)
  chex.assert_type(drafts, int)
  chex.assert_rank(target_logits, 3)
  chex.assert_equal_shape_prefix([drafts, target_logits], 2)
  valid = _valid(mask, drafts.shape)
  target_logits = jax.lax.stop_gradient(target_logits)
  index = drafts.astype(jnp.int32)[..., None]
  if verification == "greedy":
    step = (drafts == jnp.argmax(target_logits, axis=-1)) & valid
    step = step.astype(jnp.float32)
  else:
    if drafter_logits is None:
      raise ValueError(f"verification={verification!r} needs drafter_logits")
    chex.assert_equal_shape([target_logits, drafter_logits])
    drafter_logits = jax.lax.stop_gradient(drafter_logits)
    logp = jax.nn.log_softmax(distribution.sampling_logits(target_logits, temperature, top_k, top_p), -1)
    logq = jax.nn.log_softmax(distribution.sampling_logits(drafter_logits, temperature, top_k, top_p), -1)
    log_ratio = (jnp.take_along_axis(logp, index, axis=-1)[..., 0]
                 - jnp.take_along_axis(logq, index, axis=-1)[..., 0])
    # Padded positions, and a draft neither model can emit (NaN = -inf - -inf), are rejections.
    log_ratio = jnp.where(valid & ~jnp.isnan(log_ratio), log_ratio, -jnp.inf)
    if verification == "sampling":
      if uniforms is None:
        raise ValueError("verification='sampling' needs uniforms [N, K] (e.g. jax.random.uniform)")
      chex.assert_equal_shape([uniforms, drafts])
      step = (jnp.log(jnp.asarray(uniforms, jnp.float32)) < log_ratio).astype(jnp.float32)
    else:
      step = jnp.exp(jnp.minimum(log_ratio, 0.0))
  per_position = jnp.cumprod(step, axis=-1)
  ones = jnp.ones(per_position.shape[:1] + (1,), jnp.float32)
  zeros = jnp.zeros_like(ones)
  length_probs = jnp.concatenate([ones, per_position], -1) - jnp.concatenate([per_position, zeros], -1)
  return jax.tree.map(jax.lax.stop_gradient,
                      Acceptance(jnp.sum(per_position, axis=-1), per_position, length_probs))


# ---------------------------------------------------------------------------------------------------------
# Rewards and advantages.
# ---------------------------------------------------------------------------------------------------------


def speedup_reward(k: Array, gamma: Any = DEFAULT_GAMMA) -> Array:
  """The paper's cost-aware speedup reward ``R_speedup(k) = k / (k gamma + 1)``, elementwise, float32.

  ``gamma``: the drafter/target cost ratio, the paper's 0.12 by default, or the measured one
  (:func:`measured_cost_ratio`); may be traced. ``R_speedup`` rises with ``k`` and saturates at
  ``1 / gamma``.
  """
  g = _concrete(gamma)
  if g is not None and not g >= 0:
    raise ValueError(f"gamma must be >= 0, got {gamma}")
  k = jnp.asarray(k, jnp.float32)
  return k / (k * gamma + 1.0)


def measured_cost_ratio(drafter_seconds: float, target_seconds: float) -> float:
  """``gamma`` from timings: the seconds of one drafter step over the seconds of one target forward.

  Both should be measured on the deployment batch and hardware (the target forward being the ``K + 1``-token
  verification pass); the result replaces the paper's 0.12 in :func:`speedup_reward`.
  """
  if not (np.isfinite(drafter_seconds) and drafter_seconds >= 0):
    raise ValueError(f"drafter_seconds must be finite and >= 0, got {drafter_seconds}")
  if not (np.isfinite(target_seconds) and target_seconds > 0):
    raise ValueError(f"target_seconds must be finite and > 0, got {target_seconds}")
  return float(drafter_seconds) / float(target_seconds)


class WindowRewards(NamedTuple):
  """Per-window rewards (``[N]`` float32, no gradient).

  Attributes:
    total: ``R = R_speedup + R_dist``.
    speedup: ``R_speedup``, ``E[k / (k gamma + 1)]`` under ``length_probs``.
    dist: ``R_dist = eta * P(k = 0) * 1{gap < eps}``.
    gap: the per-token log-likelihood gap ``Delta`` (see :func:`window_rewards`).
  """

  total: Array
  speedup: Array
  dist: Array
  gap: Array


def window_rewards(acceptance: Acceptance, target_draft_logp: Array, target_greedy_logp: Array,
                   mask: Array | None = None, *, gamma: Any = DEFAULT_GAMMA, eta: Any = DEFAULT_ETA,
                   eps: Any = DEFAULT_EPS) -> WindowRewards:
  """``R = R_speedup + R_dist`` per window (METHODS.md section 3).

  - ``R_speedup = sum_m P(k = m) m / (m gamma + 1)``: for a realised ``k`` (``length_probs`` one-hot) the
    paper's ``k / (k gamma + 1)``; for ``"expected"`` verification its exact expectation over the
    verification uniforms (*Decision*: the reward's expectation, not ``R_speedup(E[k])``, which Jensen's
    inequality biases upwards; with ``gamma = 0`` both are ``E[k]``).
  - ``Delta`` (*Decision*, per token): the target's log-likelihood of its own greedy ``K``-token
    continuation of the prefix minus that of the drafted window, over the window's valid positions ``M``::

        Delta = (1/|M|) sum_{j in M} [log P(g_j | x, g_<j) - log P(d_j | x, d_<j)]

    with temperature-1 unfiltered log-probs (``ops.token_log_probs``; ``generate`` at temperature 0 reports
    exactly these for ``g``). ``Delta`` may be negative (greedy decoding does not maximise the window's
    likelihood); an empty window has ``Delta = 0``.
  - ``R_dist = eta * P(k = 0) * 1{Delta < eps}`` (strict): the paper's ``eta 1{k = 0, Delta < eps}`` for a
    realised ``k``, its expectation over the uniforms for ``"expected"``.

  Args:
    acceptance: from :func:`accepted_length`.
    target_draft_logp: ``[N, K]`` ``log P(d_j | x, d_<j)``.
    target_greedy_logp: ``[N, K]`` ``log P(g_j | x, g_<j)``; computed once per prefix and gathered per
      window (``greedy_logp[group_ids]``).
    mask: ``[N, K]`` or None.
    gamma, eta, eps: as in METHODS.md (may be traced).

  Returns:
    A :class:`WindowRewards`.
  """
  chex.assert_rank([target_draft_logp, target_greedy_logp], 2)
  chex.assert_equal_shape([target_draft_logp, target_greedy_logp, acceptance.per_position])
  n, k = target_draft_logp.shape
  chex.assert_shape(acceptance.length_probs, (n, k + 1))
  e = _concrete(eta)
  if e is not None and not e >= 0:
    raise ValueError(f"eta must be >= 0, got {eta}")
  valid = _valid(mask, (n, k))
  # Padded positions are zeroed before the difference (they may hold -inf).
  greedy = jnp.where(valid, jnp.asarray(target_greedy_logp, jnp.float32), 0.0)
  draft = jnp.where(valid, jnp.asarray(target_draft_logp, jnp.float32), 0.0)
  gap = ops.masked_mean(greedy - draft, valid, axis=-1)
  speedup = jnp.sum(acceptance.length_probs * speedup_reward(jnp.arange(k + 1), gamma), axis=-1)
  dist = eta * acceptance.length_probs[:, 0] * (gap < eps).astype(jnp.float32)
  return jax.tree.map(jax.lax.stop_gradient, WindowRewards(speedup + dist, speedup, dist, gap))


def window_advantages(rewards: Array, group_ids: Array, num_groups: int, *, estimator: str = "grpo",
                      valid: Array | None = None, axis_name=None, **options) -> Array:
  """Group-relative advantages over the windows of each prefix, ``[N] -> [N]``.

  A registered outcome estimator of :data:`lemon_rl.losses.ADVANTAGE_ESTIMATORS` (default ``grpo``:
  ``A_i = (R_i - mean_g R) / (std_g R + 1e-6)``, the paper's normalisation within the group) with the
  prefix as the group; ``num_groups`` static under jit.
  """
  if estimator == "gigpo":
    raise ValueError("window advantages take an outcome estimator (grpo, dr_grpo, rloo, ...), not gigpo")
  fn = adv_lib.ADVANTAGE_ESTIMATORS.get(estimator)
  return fn(rewards, group_ids, num_groups, valid=valid, axis_name=axis_name, **options)


# ---------------------------------------------------------------------------------------------------------
# The window objective.
# ---------------------------------------------------------------------------------------------------------


def ppow_loss(
    drafter_logits: Array,
    drafts: Array,
    old_logp: Array,
    advantages: Array,
    target_logits: Array,
    mask: Array,
    *,
    beta: Any = DEFAULT_BETA,
    eps_low: Any = None,
    eps_high: Any = None,
    aggregation: str | None = None,
    max_len: int | None = None,
    temperature: Any = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
) -> tuple[WeightedMetric, Metrics]:
  """The PPOW window objective as a loss ``-J``, a ``(sum, denominator)`` pair.

  ::

    J = (1/G) sum_i (1/K) sum_t [ min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
                                  - beta KL(Q_it || P_it) ]
    r_it = exp(log q_theta(d_it) - log q_old(d_it))
    KL(Q || P) = sum_v Q(v) (log Q(v) - log P(v))   (exact, over the whole vocabulary)

  per token ``l_it = surrogate_it + beta KL_it`` (the surrogate from
  :func:`lemon_rl.losses.clipped_surrogate_loss`, token ratios), aggregated with ``aggregation`` (default
  ``seq_mean_token_mean``, the paper's ``(1/G) sum_i (1/K) sum_t``; any mode of
  :data:`lemon_rl.losses.AGGREGATIONS`), both terms with one mask and denominator.

  ``log q_theta(d)``: the drafter's log-prob under the distribution the windows were drawn from
  (:func:`lemon_rl.sampling.sampling_log_probs` with ``temperature, top_k, top_p``; temperature 1 and no
  filter by default, as PPOW drafts). ``KL``: temperature-1 unfiltered ``Q = softmax(drafter_logits)`` and
  ``P = softmax(target_logits)``. Gradient flows through ``drafter_logits`` only: ``target_logits``,
  ``old_logp`` and ``advantages`` are ``stop_gradient``-ed. Padded positions may hold any values.

  Args:
    drafter_logits: ``[N, K, V]`` the current drafter's logits (differentiated).
    drafts: ``[N, K]`` int, the drafted tokens.
    old_logp: ``[N, K]`` log-probs of ``drafts`` under the drafter that drew them.
    advantages: ``[N]`` per window (or ``[N, K]`` per token).
    target_logits: ``[N, K, V]`` the frozen target's logits.
    mask: ``[N, K]``.
    beta: KL weight (0.01; may be traced).
    eps_low, eps_high: clip range (``None``: 0.2 / 0.2, METHODS.md's clip 0.2; may be traced).
    aggregation: a name in :data:`lemon_rl.losses.AGGREGATIONS` (static).
    max_len: for ``seq_mean_token_sum_norm`` (static).
    temperature, top_k, top_p: the drafting distribution of the ratio.

  Returns:
    ``(loss, metrics)``: the surrogate's metrics plus ``pg_loss`` and ``kl`` (pairs under
    ``aggregation``, no gradient).
  """
  chex.assert_rank([drafter_logits, target_logits], 3)
  chex.assert_equal_shape([drafter_logits, target_logits])
  chex.assert_rank([drafts, old_logp, mask], 2)
  chex.assert_equal_shape([drafts, old_logp, mask])
  chex.assert_equal_shape_prefix([drafts, drafter_logits], 2)
  chex.assert_type(drafts, int)
  b = _concrete(beta)
  if b is not None and not b >= 0:
    raise ValueError(f"beta must be >= 0, got {beta}")
  aggregation = DEFAULT_AGGREGATION if aggregation is None else pg.AGGREGATIONS.validate(aggregation)
  eps_low, eps_high, _ = pg.resolve_surrogate_options("ppo_clip", eps_low=eps_low, eps_high=eps_high,
                                                     aggregation=aggregation)
  valid = jnp.asarray(mask) != 0
  drafter_logits = _zero_masked_logits(drafter_logits, valid)
  target_logits = _zero_masked_logits(jax.lax.stop_gradient(target_logits), valid)
  logp = distribution.sampling_log_probs(drafter_logits, jnp.where(valid, drafts, 0), temperature, top_k,
                                         top_p)
  surrogate, metrics = pg.clipped_surrogate_loss(
      logp, jax.lax.stop_gradient(old_logp), jax.lax.stop_gradient(advantages), mask, eps_low=eps_low,
      eps_high=eps_high, aggregation=aggregation, max_len=max_len)
  kl = pg.aggregate(exact_kl(drafter_logits, target_logits), mask, aggregation, max_len=max_len)
  total = WeightedMetric(surrogate.sum + beta * kl.sum, surrogate.denominator)
  metrics["pg_loss"] = jax.lax.stop_gradient(surrogate)
  metrics["kl"] = jax.lax.stop_gradient(kl)
  return total, metrics


def window_metrics(acceptance: Acceptance, rewards: WindowRewards, valid: Array | None = None, *,
                   eps: Any = DEFAULT_EPS) -> Metrics:
  """Additive per-window metrics (means over the valid windows, as :class:`WeightedMetric` pairs).

  ``accepted_length`` (``k``), ``tau = k + 1`` (tokens per target forward, the correction / bonus token
  included, as :class:`lemon_rl.sampling.SpeculativeStats` counts it), ``acceptance_rate_{j}`` for every
  window position ``j`` (0-based), ``reward``, ``reward_speedup``, ``reward_dist``, ``zero_accept`` (share
  of windows with ``k = 0``, in expectation for ``"expected"``), ``near_miss`` (share with ``Delta < eps``)
  and ``gap``.
  """
  n = acceptance.length.shape[0]
  w = _valid(valid, (n,))
  metrics: Metrics = {
      "accepted_length": ops.weighted_metric(acceptance.length, w),
      "tau": ops.weighted_metric(acceptance.length + 1.0, w),
      "reward": ops.weighted_metric(rewards.total, w),
      "reward_speedup": ops.weighted_metric(rewards.speedup, w),
      "reward_dist": ops.weighted_metric(rewards.dist, w),
      "zero_accept": ops.weighted_metric(acceptance.length_probs[:, 0], w),
      "near_miss": ops.weighted_metric((rewards.gap < eps).astype(jnp.float32), w),
      "gap": ops.weighted_metric(rewards.gap, w),
  }
  for j in range(acceptance.per_position.shape[1]):
    metrics[f"acceptance_rate_{j}"] = ops.weighted_metric(acceptance.per_position[:, j], w)
  return metrics


# ---------------------------------------------------------------------------------------------------------
# ADAW: adaptive divergence-aware window sampling.
# ---------------------------------------------------------------------------------------------------------


def window_scores(v: Array, mask: Array | None = None) -> Array:
  """ADAW window score ``s_i = mean_{t in window i} v_t`` over the valid positions, ``[N, K] -> [N]``.

  0 for an empty window.
  """
  chex.assert_rank(v, 2)
  return ops.masked_mean(v.astype(jnp.float32), _valid(mask, v.shape), axis=-1)


def sliding_window_scores(v: Array, mask: Array, window: int) -> tuple[Array, Array]:
  """The score of the ``window``-token window starting at every position of a text, for prefix sampling.

  ``s[b, t] = (1/K) sum_{j=t}^{t+K-1} v[b, j]`` with ``K = window``: the window drafted after the prefix
  ``tokens[b, :t]`` covers tokens ``t..t+K-1``, and ``v[b, j]`` is the criticality of predicting token
  ``j`` (:func:`criticality` of the logits that predict it).

  Args:
    v: ``[B, T]`` criticality.
    mask: ``[B, T]`` valid tokens (left-aligned rows).
    window: ``K >= 1`` (static).

  Returns:
    ``(scores [B, T], valid [B, T] bool)``: a window is valid iff all its ``K`` tokens are; invalid
    windows score 0.
  """
  chex.assert_rank([v, mask], 2)
  chex.assert_equal_shape([v, mask])
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  length = v.shape[1]
  ok = jnp.asarray(mask) != 0
  x = jnp.where(ok, v.astype(jnp.float32), 0.0)
  pad = ((0, 0), (0, window - 1))
  x, okp = jnp.pad(x, pad), jnp.pad(ok, pad)
  total = sum(x[:, j:j + length] for j in range(window))
  full = jnp.all(jnp.stack([okp[:, j:j + length] for j in range(window)]), axis=0)
  return jnp.where(full, total / window, 0.0), full


def adaw_probabilities(scores: Array, valid: Array | None = None, *, floor: Any = DEFAULT_FLOOR) -> Array:
  """ADAW sampling probabilities: proportional to the scores, mixed with a uniform floor.

  Exactly (*Decision*, a mixture), over the ``n`` valid entries::

    pi_i = floor / n + (1 - floor) * s_i / sum_valid s

  so every valid window has ``pi_i >= floor / n``, the rest of the mass is shared in proportion to the
  scores, and ``floor = 1`` is uniform sampling (ADAW off). Invalid entries get 0; if no valid score is
  positive the valid entries are uniform; with no valid entry all are 0.

  Args:
    scores: ``[N]`` float, ``>= 0`` (window scores; a negative one is treated as 0).
    valid: ``[N]`` or None.
    floor: in ``[0, 1]`` (may be traced).

  Returns:
    ``[N]`` float32 probabilities, summing to 1 over the valid entries.
  """
  chex.assert_rank(scores, 1)
  f = _concrete(floor)
  if f is not None and not 0 <= f <= 1:
    raise ValueError(f"floor must be in [0, 1], got {floor}")
  ok = _valid(valid, scores.shape)
  s = jnp.where(ok, jnp.maximum(jnp.asarray(scores, jnp.float32), 0.0), 0.0)
  count = jnp.sum(ok.astype(jnp.float32))
  uniform = ops.safe_divide(ok.astype(jnp.float32), count)
  total = jnp.sum(s)
  proportional = jnp.where(total > 0, s / jnp.where(total > 0, total, 1.0), uniform)
  return jax.lax.stop_gradient(jnp.where(ok, floor * uniform + (1.0 - floor) * proportional, 0.0))


def adaw_sample(key: Array, probs: Array, num_samples: int, *, replace: bool = True) -> Array:
  """Draws ``num_samples`` window indices from :func:`adaw_probabilities`, seeded by ``key``.

  ``replace=True``: independent draws, index ``i`` with probability ``probs[i]``. ``replace=False``:
  distinct indices by successive draws renormalised over the rest (``jax.random.choice``; the first draw
  has ``probs``, inclusion probabilities are not proportional); needs ``num_samples`` entries of positive
  probability. ``num_samples`` and ``replace`` are static.

  Returns:
    ``[num_samples]`` int32 indices into ``probs``.
  """
  chex.assert_rank(probs, 1)
  return jax.random.choice(key, probs.shape[0], (num_samples,), replace=replace, p=probs).astype(jnp.int32)
