"""The PPOW trainer: window-level RL of an EAGLE-3 drafter against its frozen target (METHODS.md section 3).

The pure losses live in :mod:`lemon_rl.losses.ppow`; this module turns them into a training loop for an
:class:`~lemon_rl.models.drafter.EagleHead` whose target stays frozen. The data are the target's own
sequences (``data/distill.npz`` of ``experiments/train_speculative.py``: ``tokens [N, T]``, ``mask``).

Notation. A *prefix* is ``x_0..x_P`` of a data row (``P`` = ``prefix_end``); as in the engine, the prompt
``x_0..x_{P-1}`` is prefilled (the target's cache and features, the drafter's entries ``0..P-2``) and
``x_P`` is the pending last token; the window ``d_1..d_K`` proposes the tokens at positions
``P+1..P+K``. ``B`` prefixes, ``G = G_roll`` windows each, ``N = B G`` windows (window ``i`` belongs to
prefix ``i // G``), ``V`` the vocabulary.

One PPOW step (:func:`collect` then ``num_iterations`` times :func:`update`):

1. Prefixes. A pool of ``R`` data rows (host side, seeded by the step) is run through the target (one
   forward: features, logits ``P_t``) and the drafter's first drafting step (``Q_t``, :meth:`EagleHead.unroll`
   with one step: the entry ``(g_{t-2}, x_{t-1})`` predicts ``x_t``). The token criticality and the score
   of the window drafted after prefix ``P`` are::

       v_t = (1 - H(P_t) / log V) KL(P_t || Q_t)          s_P = (1/K) sum_{j=1..K} v_{P+j}

   A window is valid when its ``K`` tokens are real and ``P >= min_prefix``. ``B`` (row, ``P``) pairs are
   drawn with replacement from ``pi = floor / n + (1 - floor) s / sum s`` over the ``n`` valid windows
   (ADAW, :func:`lemon_rl.losses.ppow.adaw_probabilities`); ``ppow.adaw = False`` is ``floor = 1``, the
   uniform distribution over the same windows.
2. Drafting. The engine's own calls (``Transformer.prefill`` with ``feature_layers``,
   ``EagleDrafter.prefill`` / ``propose``) draft ``G`` chains per prefix at temperature 1 in one batch of
   ``N`` rows: ``d_j ~ Q_j = softmax(q_j)``, ``q_j`` the drafter's logits, recorded as the old policy
   (``old_logp_ij = log Q_j(d_ij)``). A window is cut after a drafted EOS (``mask_ij = 0`` past it).
3. Scoring. The target extends its prefix cache by ``[x_P, d_1..d_K]`` (the engine's verification pass):
   ``p_ij`` = its logits after ``x, d_<j``; its greedy window ``g_1..g_K`` (``K`` cached greedy steps from
   the same cache) gives ``log P(g_j | x, g_<j)``.
4. Rewards and advantages (:mod:`lemon_rl.losses.ppow`), per window ``i`` of prefix ``b``::

       k_i   = accepted length under ppow.verification (greedy | sampling | expected)
       R_i   = k_i / (k_i gamma + 1) + eta 1{k_i = 0} 1{Delta_i < eps}          (eta = 0 without R_dist)
       Delta_i = (1/K) sum_j [log P(g_j | x, g_<j) - log P(d_ij | x, d_i<j)]
       A_i   = (R_i - mean_{i' in b} R_i') / (std_{i' in b} R_i' + 1e-6)       (GRPO over the G windows)

5. Update. The drafter's logits of the same windows are recomputed teacher-forced with the current
   parameters (:func:`window_logits`, the exact computation of ``propose`` along the drafted tokens) and::

       L(theta) = -(1/N) sum_i (1/|M_i|) sum_{j in M_i} [min(r_ij A_i, clip(r_ij, 1 - c, 1 + c) A_i)
                                                         - beta KL(Q_theta,ij || P_ij)]
       r_ij = exp(log Q_theta(d_ij) - old_logp_ij),  KL exact over the vocabulary

   (:func:`lemon_rl.losses.ppow.ppow_loss`), differentiated with respect to the head's parameters only
   (the target's parameters are a non-differentiated argument, its embedding and LM head stay frozen), one
   optax step per iteration.

Metrics per step: ``tau = 1 + mean k`` under the chosen verification (and ``tau_greedy``,
``tau_expected`` always), per-position acceptance, reward parts, ``kl``, the criticality histogram of the
pool (``crit_frac_*``) and ADAW's mean selected vs pool window score (with ADAW only: without it the pool is
not scored, step 1 draws from the mask alone), the loss and its parts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from ml_collections import config_dict

from lemon_rl import ops
from lemon_rl.losses import ppow
from lemon_rl.models.drafter import EagleDrafter, EagleHead
from lemon_rl.models.transformer import KVCache, Transformer
from lemon_rl.sampling.speculative import draft_noise
from lemon_rl.training import drafter_training as dt
from lemon_rl.training import state as state_lib
from lemon_rl.training.state import TrainState

Array = jax.Array

# Edges of the criticality histogram (nats; v_t <= KL(P || Q)): 4 bins, log-spaced.
CRITICALITY_EDGES = (0.01, 0.1, 1.0)


@dataclasses.dataclass(frozen=True)
class PPOWConfig:
  """Static hyperparameters of a PPOW step (hashable: a static argument of the jitted pieces).

  Attributes:
    num_draft: ``K``, tokens per window.
    group_size: ``G_roll``, windows per prefix (>= 2 for a group-relative advantage).
    num_prefixes: ``B``, prefixes per step.
    pool_rows: data rows scored per step to choose the prefixes from (``>= 1``).
    verification: ``"greedy"``, ``"sampling"`` or ``"expected"`` (the reward's accepted length).
    gamma: drafter / target cost ratio of ``R_speedup`` (0.12, or measured).
    use_dist_reward: ``R_dist`` on (``eta``) or off (``eta = 0``).
    eta, eps: ``R_dist``'s value and per-token threshold (nats).
    beta: weight of ``KL(Q || P)``.
    clip_eps: the ratio's clip range ``c`` (symmetric).
    estimator: group-relative advantage estimator (``lemon_rl.losses.ADVANTAGE_ESTIMATORS``, outcome).
    aggregation: ``lemon_rl.losses.AGGREGATIONS`` mode of the loss.
    adaw: ADAW prefix sampling (else uniform over the valid windows).
    adaw_floor: ADAW's uniform mixture weight.
    min_prefix: smallest ``P`` (``>= 1``: the prompt ``x_0..x_{P-1}`` is not empty).
    num_iterations: optimizer steps on each collected batch (PPO epochs).
    eos_id: a drafted EOS ends its window (``None``: no cut).
  """

  num_draft: int = 4
  group_size: int = 8
  num_prefixes: int = 8
  pool_rows: int = 16
  verification: str = "greedy"
  gamma: float = ppow.DEFAULT_GAMMA
  use_dist_reward: bool = True
  eta: float = ppow.DEFAULT_ETA
  eps: float = ppow.DEFAULT_EPS
  beta: float = ppow.DEFAULT_BETA
  clip_eps: float = 0.2
  estimator: str = "grpo"
  aggregation: str = ppow.DEFAULT_AGGREGATION
  adaw: bool = True
  adaw_floor: float = ppow.DEFAULT_FLOOR
  min_prefix: int = 1
  num_iterations: int = 1
  eos_id: int | None = None

  def __post_init__(self):
    if self.verification not in ppow.VERIFICATIONS:
      raise ValueError(f"verification must be one of {ppow.VERIFICATIONS}, got {self.verification!r}")
    if self.num_draft < 1 or self.group_size < 1 or self.num_prefixes < 1 or self.pool_rows < 1:
      raise ValueError(f"num_draft, group_size, num_prefixes and pool_rows must be >= 1: {self}")
    if self.min_prefix < 1:
      raise ValueError(f"min_prefix must be >= 1, got {self.min_prefix}")
    if self.num_iterations < 1:
      raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")


# -- the pieces: pure functions of the models ------------------------------------------------------------


def _repeat(tree: Any, group_size: int) -> Any:
  """Each row of every leaf repeated ``group_size`` times (row ``i`` of the result is row ``i // G``)."""
  return jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0), tree)


def _embed(target: Transformer, tokens: Array) -> Array:
  return target.embed_tokens(tokens).reshape(*tokens.shape, -1)


def _prompt_mask(tokens: Array, prefix_end: Array) -> Array:
  """``[B, T]`` int32, 1 on the prompt ``x_0..x_{P-1}``."""
  return (jnp.arange(tokens.shape[1])[None] < prefix_end[:, None]).astype(jnp.int32)


def _num_slots(tokens: Array, num_draft: int) -> int:
  """Cache slots for a prompt of at most ``T`` tokens plus a verified window of ``K + 1``."""
  return tokens.shape[1] + num_draft + 1


def sequence_criticality(target_logits: Array, drafter_logits: Array, mask: Array) -> tuple[Array, Array]:
  """ADAW's ``v_t`` along whole sequences, from the target's and the drafter's first-step logits.

  Args:
    target_logits: ``[B, T, V]``, position ``t`` predicts ``x_{t+1}`` (a full forward).
    drafter_logits: ``[B, T, V]``, the drafter's first drafting step at position ``t`` (entry
      ``(g_t, x_{t+1})``), which predicts ``x_{t+2}``.
    mask: ``[B, T]`` real tokens (right padding).

  Returns:
    ``(v [B, T], valid [B, T])``: ``v[:, t]`` the criticality of predicting token ``t``,
    ``criticality(target_logits[t - 1], drafter_logits[t - 2])`` for ``t >= 2`` where token ``t`` is real;
    0 and invalid elsewhere.
  """
  b, t = mask.shape
  inner = ppow.criticality(target_logits[:, 1:-1], drafter_logits[:, :-2])  # predicts tokens 2..T-1
  v = jnp.concatenate([jnp.zeros((b, 2), jnp.float32), inner], axis=1)
  valid = (mask != 0) & (jnp.arange(t)[None] >= 2)
  return jnp.where(valid, v, 0.0), valid


def prefix_scores(v: Array, valid: Array, mask: Array, num_draft: int, min_prefix: int) -> tuple[Array, Array]:
  """ADAW score of the window after each prefix end ``P``: ``s[b, P] = (1/K) sum_{j=1..K} v[b, P + j]``.

  Returns ``(scores [B, T], ok [B, T])``; ``ok`` iff tokens ``P+1..P+K`` are real and ``P >= min_prefix``.
  """
  t = mask.shape[1]
  scores, full = ppow.sliding_window_scores(v, valid & (mask != 0), num_draft)  # window starting at t
  pad = jnp.zeros((mask.shape[0], 1), scores.dtype)
  scores = jnp.concatenate([scores[:, 1:], pad], axis=1)
  full = jnp.concatenate([full[:, 1:], jnp.zeros_like(full[:, :1])], axis=1)
  ok = full & (jnp.arange(t)[None] >= min_prefix)
  return jnp.where(ok, scores, 0.0), ok


def draft_windows(target: Transformer, head: EagleHead, tokens: Array, prefix_end: Array, features: Array,
                  key: Array, num_draft: int, group_size: int, temperature: Any = 1.0):
  """``G`` windows per prefix drafted by the engine's :class:`EagleDrafter` (``prefill`` + ``propose``).

  Args:
    target, head: the frozen target and the drafter's head.
    tokens: ``[B, T]`` rows holding the prefixes ``x_0..x_P``.
    prefix_end: ``[B]`` ``P`` (``1 <= P < T``).
    features: ``[B, T, F]`` the target's features of ``head.feature_layers`` (positions ``< P`` are read).
    key: PRNG key.
    num_draft, group_size: ``K``, ``G``.
    temperature: drafting temperature (the Python number 0 = greedy, as the engine).

  Returns:
    ``(drafts [B G, K] int32, q [B G, K, V] | None)``: the chains and the sampling logits each token was
    drawn from (``None`` for greedy); row ``i`` drafts after prefix ``i // G``.
  """
  drafter = EagleDrafter(target, head)
  state = drafter.prefill(tokens, _prompt_mask(tokens, prefix_end), _num_slots(tokens, num_draft),
                          target_features=features, num_draft=num_draft)
  last = jnp.take_along_axis(tokens, prefix_end[:, None], axis=1)[:, 0]
  state, last = _repeat((state, last), group_size)
  noise = draft_noise(key, last.shape[0], num_draft, drafter.vocab_size, temperature)
  drafts, q, _ = drafter.propose(state, last, noise, num_draft, temperature, 0, 1.0)
  return drafts, q


def window_logits(target: Transformer, head: EagleHead, tokens: Array, prefix_end: Array, features: Array,
                  drafts: Array) -> Array:
  """The drafter's logits of given windows, teacher-forced: ``propose``'s computation along ``drafts``.

  Differentiable in the head's parameters (the loss's ``Q_theta``).

  Args:
    tokens, prefix_end, features: as :func:`draft_windows` (``B`` prefixes).
    drafts: ``[B G, K]`` windows, row ``i`` after prefix ``i // G``.

  Returns:
    ``[B G, K, V]`` float32; position ``j`` gives the distribution ``drafts[:, j]`` is drawn from.
  """
  n, k = drafts.shape
  group_size = n // tokens.shape[0]
  drafter = EagleDrafter(target, head)
  state = drafter.prefill(tokens, _prompt_mask(tokens, prefix_end), _num_slots(tokens, k),
                          target_features=features, num_draft=k)
  last = jnp.take_along_axis(tokens, prefix_end[:, None], axis=1)[:, 0]
  state, last = _repeat((state, last), group_size)
  # The pending entry (g_{P-1}, x_P) in a K + 1-wide extend (num_pending = 1), as propose runs it.
  pending = jnp.concatenate([last[:, None], jnp.zeros((n, k), jnp.int32)], axis=1)
  out, cache = head.extend(state.features, _embed(target, pending), state.cache, num_new=state.num_pending)
  hidden = out[:, 0]

  def step(carry, token):
    cache, hidden = carry
    out, cache = head.extend(hidden[:, None], _embed(target, token[:, None]), cache)
    return (cache, out[:, 0]), out[:, 0]

  _, rest = jax.lax.scan(step, (cache, hidden), drafts[:, :-1].T)
  hiddens = jnp.concatenate([hidden[:, None], rest.transpose(1, 0, 2)], axis=1)
  return target.logits_from_hidden(head.normed(hiddens))


def target_prefix(target: Transformer, tokens: Array, prefix_end: Array, num_draft: int,
                  feature_layers: tuple[int, ...]) -> tuple[KVCache, Array]:
  """The engine's target prefill of the prompts ``x_0..x_{P-1}``: ``(cache, features [B, T, F])``."""
  _, cache, features = target.prefill(tokens, _prompt_mask(tokens, prefix_end), _num_slots(tokens, num_draft),
                                      feature_layers=feature_layers)
  return cache, features


def score_windows(target: Transformer, cache: KVCache, last: Array, drafts: Array) -> Array:
  """The target's logits over the windows: one ``extend`` of ``[x_P, d_1..d_K]`` (the verification pass).

  Args:
    cache: the prefix cache of ``B`` prompts (:func:`target_prefix`).
    last: ``[B]`` ``x_P``.
    drafts: ``[B G, K]``.

  Returns:
    ``[B G, K, V]`` float32: position ``j`` is ``P(. | x, d_1..d_j)``, the distribution ``d_{j+1}`` is
    verified against.
  """
  n, k = drafts.shape
  group_size = n // last.shape[0]
  cache, last = _repeat((cache, last), group_size)
  hidden, _ = target.extend(jnp.concatenate([last[:, None], drafts], axis=1), cache)
  return target.logits_from_hidden(hidden[:, :k])


def greedy_window(target: Transformer, cache: KVCache, last: Array, num_draft: int) -> tuple[Array, Array]:
  """The target's own greedy ``K``-token continuation of each prefix and its temperature-1 log-probs.

  Returns ``(g [B, K] int32, log P(g_j | x, g_<j) [B, K] float32)``.
  """

  def step(carry, _):
    cache, token = carry
    hidden, cache = target.extend(token[:, None], cache)
    logp = jax.nn.log_softmax(target.logits_from_hidden(hidden[:, 0]), axis=-1)
    nxt = jnp.argmax(logp, axis=-1).astype(jnp.int32)
    return (cache, nxt), (nxt, jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0])

  _, (g, logp) = jax.lax.scan(step, (cache, last.astype(jnp.int32)), None, length=num_draft)
  return g.T, logp.T


def eos_window_mask(drafts: Array, eos_id: int | None) -> Array:
  """``[N, K]`` int32: 1 up to and including the first drafted EOS (all ones without ``eos_id``)."""
  if eos_id is None:
    return jnp.ones(drafts.shape, jnp.int32)
  eos = (drafts == eos_id).astype(jnp.int32)
  before = jnp.cumsum(eos, axis=1) - eos  # EOS strictly before position j
  return (before == 0).astype(jnp.int32)


def criticality_histogram(v: Array, valid: Array) -> dict[str, ops.Metric]:
  """Shares of the valid positions in the bins of :data:`CRITICALITY_EDGES`, and the mean ``v``."""
  edges = (0.0,) + CRITICALITY_EDGES + (np.inf,)
  names = ["lt_0.01", "0.01_0.1", "0.1_1", "ge_1"]
  out = {"crit_mean": ops.weighted_metric(v, valid)}
  for name, lo, hi in zip(names, edges[:-1], edges[1:]):
    inside = ((v >= lo) & (v < hi)).astype(jnp.float32)
    out[f"crit_frac_{name}"] = ops.weighted_metric(inside, valid)
  return out


# -- one step -------------------------------------------------------------------------------------------


class Prefixes(NamedTuple):
  """The prefixes of one step and ADAW's view of the pool (:func:`choose_prefixes`).

  Attributes:
    rows: ``[B]`` pool rows; ``prefix_end``: ``[B]`` ``P``.
    scores, ok: ``[R, T]`` window scores ``s_P`` and validity of every prefix end of the pool.
    v, v_valid: ``[R, T]`` token criticality.
    probs: ``[R T]`` the sampling distribution over ``(row, P)`` (flattened row-major).
  """

  rows: Array
  prefix_end: Array
  scores: Array
  ok: Array
  v: Array
  v_valid: Array
  probs: Array


def choose_prefixes(head: EagleHead, target: Transformer, pool_tokens: Array, pool_mask: Array, key: Array,
                    cfg: PPOWConfig) -> Prefixes:
  """Step 1: criticality of the current drafter along the pool rows, then ADAW (or uniform) sampling of
  ``cfg.num_prefixes`` ``(row, P)`` pairs with replacement."""
  pool_mask = pool_mask.astype(bool)
  features, _, target_logits, embeds = dt.teacher(target, pool_tokens, pool_mask, head.feature_layers)
  first_step = target.logits_from_hidden(head.normed(head.unroll(features, embeds, pool_mask, 1)[0]))
  v, v_valid = sequence_criticality(target_logits, first_step, pool_mask)
  scores, ok = prefix_scores(v, v_valid, pool_mask, cfg.num_draft, cfg.min_prefix)
  probs = ppow.adaw_probabilities(scores.reshape(-1), ok.reshape(-1), floor=cfg.adaw_floor if cfg.adaw else 1.0)
  index = ppow.adaw_sample(key, probs, cfg.num_prefixes)
  width = pool_tokens.shape[1]
  return jax.lax.stop_gradient(Prefixes(index // width, index % width, scores, ok, v, v_valid, probs))


def uniform_prefixes(pool_tokens: Array, pool_mask: Array, key: Array, cfg: PPOWConfig) -> tuple[Array, Array]:
  """Step 1 without ADAW: ``(rows [B], prefix_end [B])`` drawn uniformly over the valid windows.

  The same draw as :func:`choose_prefixes` with ``floor = 1`` (bit for bit: the validity of a window depends
  on the mask only, and ``adaw_probabilities`` at ``floor = 1`` is the uniform distribution over the valid
  windows whatever the scores), without scoring the pool: no target forward over the ``R`` rows.
  """
  pool_mask = pool_mask.astype(bool)
  valid = pool_mask & (jnp.arange(pool_mask.shape[1])[None] >= 2)  # sequence_criticality's validity
  scores, ok = prefix_scores(jnp.zeros(pool_mask.shape, jnp.float32), valid, pool_mask, cfg.num_draft,
                             cfg.min_prefix)
  probs = ppow.adaw_probabilities(scores.reshape(-1), ok.reshape(-1), floor=1.0)
  index = ppow.adaw_sample(key, probs, cfg.num_prefixes)
  width = pool_tokens.shape[1]
  return index // width, index % width


def _collect(head: EagleHead, target: Transformer, pool_tokens: Array, pool_mask: Array, key: Array,
             cfg: PPOWConfig):
  """Step 1-4 of the module docstring: ``(batch, metrics)`` (everything under ``stop_gradient``).

  Without ADAW the pool is not scored (:func:`uniform_prefixes`): the step computes the same batch, and its
  metrics lack the pool's criticality histogram and ADAW scores.
  """
  k, g, b = cfg.num_draft, cfg.group_size, cfg.num_prefixes
  key_prefix, key_draft, key_verify = jax.random.split(key, 3)
  if cfg.adaw:
    chosen = choose_prefixes(head, target, pool_tokens, pool_mask, key_prefix, cfg)
    rows, prefix_end = chosen.rows, chosen.prefix_end
  else:
    chosen = None
    rows, prefix_end = uniform_prefixes(pool_tokens, pool_mask, key_prefix, cfg)
  tokens = pool_tokens[rows]
  # 2. Drafting, the engine's calls; 3. the target's verification pass and greedy window.
  cache, feats = target_prefix(target, tokens, prefix_end, k, head.feature_layers)
  drafts, q = draft_windows(target, head, tokens, prefix_end, feats, key_draft, k, g)
  last = jnp.take_along_axis(tokens, prefix_end[:, None], axis=1)[:, 0]
  p = score_windows(target, cache, last, drafts)
  _, greedy_logp = greedy_window(target, cache, last, k)
  # 4. Accepted length, rewards, group-relative advantages.
  mask = eos_window_mask(drafts, cfg.eos_id)
  uniforms = jax.random.uniform(key_verify, drafts.shape) if cfg.verification == "sampling" else None
  acceptance = ppow.accepted_length(drafts, p, q, mask, verification=cfg.verification, uniforms=uniforms)
  draft_logp = jnp.take_along_axis(jax.nn.log_softmax(p, axis=-1), drafts[..., None], axis=-1)[..., 0]
  rewards = ppow.window_rewards(acceptance, draft_logp, jnp.repeat(greedy_logp, g, axis=0), mask,
                                gamma=cfg.gamma, eta=cfg.eta if cfg.use_dist_reward else 0.0, eps=cfg.eps)
  group_ids = jnp.arange(b * g) // g
  advantages = ppow.window_advantages(rewards.total, group_ids, b, estimator=cfg.estimator)
  old_logp = jnp.take_along_axis(jax.nn.log_softmax(q, axis=-1), drafts[..., None], axis=-1)[..., 0]
  # Metrics.
  metrics = ppow.window_metrics(acceptance, rewards, eps=cfg.eps)
  for name in ("greedy", "expected"):
    other = ppow.accepted_length(drafts, p, q, mask, verification=name)
    metrics[f"tau_{name}"] = ops.weighted_metric(other.length + 1.0, jnp.ones_like(other.length))
  if chosen is not None:
    metrics.update(criticality_histogram(chosen.v, chosen.v_valid))
    metrics["adaw_pool_score"] = ops.weighted_metric(chosen.scores, chosen.ok)
    selected = chosen.scores[rows, prefix_end]
    metrics["adaw_selected_score"] = ops.weighted_metric(selected, jnp.ones_like(selected))
  metrics["prefix_end"] = ops.weighted_metric(prefix_end.astype(jnp.float32), jnp.ones((b,), jnp.float32))
  batch = {"tokens": tokens, "prefix_end": prefix_end, "features": feats, "drafts": drafts, "old_logp": old_logp,
           "target_logits": p, "mask": mask, "advantages": advantages}
  return jax.lax.stop_gradient(batch), metrics


@functools.partial(jax.jit, static_argnames=("head_def", "target_def", "cfg"))
def collect(head_def, head_params, target_def, target_params, pool_tokens: Array, pool_mask: Array, key: Array, *,
            cfg: PPOWConfig):
  """Steps 1-4 (no gradient): ``(batch, metrics)``.

  ``batch``: ``tokens [B, T]``, ``prefix_end [B]``, ``features [B, T, F]`` (the target's prefill features),
  ``drafts [N, K]``, ``old_logp [N, K]``, ``target_logits [N, K, V]``, ``mask [N, K]``, ``advantages
  [N]``; ``metrics``: unreduced pairs (``ops.metric_values``).
  """
  head, target = nnx.merge(head_def, head_params), nnx.merge(target_def, target_params)
  return _collect(head, target, pool_tokens, pool_mask, key, cfg)


def ppow_objective(head: EagleHead, target: Transformer, batch: Mapping[str, Array], cfg: PPOWConfig):
  """Step 5's loss on a collected batch: ``(WeightedMetric, metrics)`` of :func:`ppow.ppow_loss`."""
  logits = window_logits(target, head, batch["tokens"], batch["prefix_end"], batch["features"], batch["drafts"])
  return ppow.ppow_loss(logits, batch["drafts"], batch["old_logp"], batch["advantages"], batch["target_logits"],
                        batch["mask"], beta=cfg.beta, eps_low=cfg.clip_eps, eps_high=cfg.clip_eps,
                        aggregation=cfg.aggregation)


@functools.partial(jax.jit, static_argnames=("head_def", "target_def", "cfg", "optimizer"),
                   donate_argnames=("state",))
def update(head_def, state: TrainState, target_def, target_params, batch: Mapping[str, Array], *, cfg: PPOWConfig,
           optimizer: optax.GradientTransformation):
  """One optimizer step of the head's parameters on ``batch``; ``state.step`` is not advanced.

  Returns ``(state, {name: scalar})``: the loss, its ``pg_loss`` and ``kl`` parts, the surrogate's metrics
  and ``grad_norm``.
  """
  target = nnx.merge(target_def, target_params)

  def loss_fn(params):
    loss, metrics = ppow_objective(nnx.merge(head_def, params), target, batch, cfg)
    return loss.sum, (loss, metrics)

  grad_sum, (loss, metrics) = jax.grad(loss_fn, has_aux=True)(state.params)
  grads = jax.tree.map(lambda x: x / jnp.maximum(loss.denominator, 1e-9), grad_sum)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  values = ops.metric_values(metrics)
  values["loss"] = loss.value
  values["grad_norm"] = optax.tree.norm(grads)
  return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state), values


def pool_indices(num_rows: int, pool_rows: int, step: int, seed: int) -> np.ndarray:
  """The data rows scored at (1-based) ``step``: a seeded draw without replacement (resumable)."""
  rng = np.random.default_rng([seed, 7, step])
  return np.sort(rng.choice(num_rows, size=min(pool_rows, num_rows), replace=False))


class PPOWTrainer:
  """PPOW on a frozen ``target`` and a drafter ``head`` over the target's sequences ``tokens, mask [N, T]``.

  ``init_state()`` holds the head's parameters, the optimizer state and the step; ``step(state, step)``
  runs PPOW step ``step`` (1-based): the pool rows and the PRNG key depend only on ``(seed, step)`` and
  the state, so a resumed run repeats an uninterrupted one. ``head()`` of a state is the drafter. Pools are
  drawn from the rows that hold at least one valid window.
  """

  def __init__(self, target: Transformer, head: EagleHead, tokens: np.ndarray, mask: np.ndarray, cfg: PPOWConfig,
               optimizer: optax.GradientTransformation, seed: int = 0):
    if tokens.shape != mask.shape or tokens.ndim != 2:
      raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be equal [N, T]")
    # Rows (left-aligned) with at least one valid window: P >= min_prefix and tokens P+1..P+K real.
    self.usable_rows = np.flatnonzero(np.asarray(mask).sum(axis=1) >= cfg.min_prefix + cfg.num_draft + 1)
    if not len(self.usable_rows):
      raise ValueError(f"no row holds a window of {cfg.num_draft} tokens after a prefix of {cfg.min_prefix + 1}")
    self.cfg, self.optimizer, self.seed = cfg, optimizer, seed
    self.tokens, self.mask = np.asarray(tokens, np.int32), np.asarray(mask, np.int32)
    self.target_def, self.target_params = nnx.split(target)
    self._head = head
    self.head_def = nnx.split(head, nnx.Param)[0]

  def init_state(self) -> TrainState:
    """The head's initial parameters (those of the ``head`` given), a fresh optimizer state, step 0.

    Committed to their devices, as a state restored from a checkpoint is: the jitted steps then compile
    once for both (an uncommitted and a committed argument are different compilations).
    """
    state = state_lib.create_train_state(self._head, self.optimizer, self.seed)[1]
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)

  def head(self, state: TrainState) -> EagleHead:
    return nnx.merge(self.head_def, state.params)

  def collect(self, state: TrainState, step: int):
    rows = self.usable_rows[pool_indices(len(self.usable_rows), self.cfg.pool_rows, step, self.seed)]
    key = state_lib.step_key(state, 0)
    return collect(self.head_def, state.params, self.target_def, self.target_params, jnp.asarray(self.tokens[rows]),
                   jnp.asarray(self.mask[rows]), key, cfg=self.cfg)

  def step(self, state: TrainState, step: int) -> tuple[TrainState, dict[str, float]]:
    batch, metrics = self.collect(state, step)
    values = {}
    for _ in range(self.cfg.num_iterations):
      state, values = update(self.head_def, state, self.target_def, self.target_params, batch, cfg=self.cfg,
                             optimizer=self.optimizer)
    values = {**ops.metric_values(metrics), **values}
    return state.replace(step=state.step + 1), values


def train(trainer: PPOWTrainer, workdir: str, steps: int, *, writer=None, checkpoint_every: int = 50,
          phase: str = "ppow") -> tuple[TrainState, float]:
  """Runs ``trainer`` to ``steps`` steps as a phase of the shared runner
  (:func:`lemon_rl.training.experiment.run_phase`): checkpoints in ``workdir/checkpoints/<phase>``, resumed
  from the latest one, and on SIGTERM; metrics to ``writer`` (default ``workdir/metrics.jsonl``). Returns
  ``(state, seconds spent in steps)``."""
  from lemon_rl.training import experiment, phases  # pylint: disable=g-import-not-at-top  (they import this module)
  built = phases.numbered_phase(trainer.init_state(), trainer.step, steps, progress_keys=("tau", "reward", "kl"))
  return experiment.run_phase(phase, built, workdir, config_dict.ConfigDict(
      {"every": checkpoint_every, "max_to_keep": 2, "async_save": False}), writer)


# -- configuration --------------------------------------------------------------------------------------


def ppow_config_from_config(c: config_dict.ConfigDict, eos_id: int | None = None, gamma: float | None = None,
                            min_prefix: int | None = None) -> PPOWConfig:
  """A :class:`PPOWConfig` from the ``ppow`` section; ``gamma`` (e.g. measured) and ``min_prefix`` override
  the section's values when given."""
  return PPOWConfig(num_draft=int(c.num_draft), group_size=int(c.group_size), num_prefixes=int(c.num_prefixes),
                    pool_rows=int(c.pool_rows), verification=str(c.verification),
                    gamma=float(c.gamma if gamma is None else gamma), use_dist_reward=bool(c.use_dist_reward),
                    eta=float(c.eta), eps=float(c.eps), beta=float(c.beta), clip_eps=float(c.clip_eps),
                    estimator=str(c.estimator), aggregation=str(c.aggregation), adaw=bool(c.adaw),
                    adaw_floor=float(c.adaw_floor),
                    min_prefix=int(c.min_prefix if min_prefix is None else min_prefix),
                    num_iterations=int(c.num_iterations), eos_id=eos_id)


def optimizer_from_config(c: config_dict.ConfigDict) -> optax.GradientTransformation:
  """AdamW + clipping + warmup/cosine (``state_lib.make_optimizer``) from the ``ppow`` section; the schedule
  counts optimizer updates, ``steps * num_iterations``."""
  return state_lib.make_optimizer(c.learning_rate, c.steps * c.num_iterations, warmup_steps=c.warmup_steps,
                                  weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm)


def load_start(init_from: str):
  """What a finished ``experiments/train_speculative.py`` workdir gives PPOW: ``(target, head, spec_config dict,
  tokenizer, distill tokens, distill mask, test rows)`` (``checkpoints/speculative``, its tokenizer,
  ``data/distill.npz``, ``data/test.npy``)."""
  from lemon_rl.data import stdlib_corpus  # pylint: disable=g-import-not-at-top

  target, head, meta = dt.load_speculative(os.path.join(init_from, "checkpoints", "speculative"))
  spec_config = json.loads(meta["config"]) if "config" in meta else {}
  tokenizer = stdlib_corpus.load_tokenizer(os.path.join(init_from, meta.get("tokenizer", "tokenizer")))
  distill = np.load(os.path.join(init_from, "data", "distill.npz"))
  test_rows = np.load(os.path.join(init_from, "data", "test.npy"))
  return target, head, spec_config, tokenizer, distill["tokens"], distill["mask"], test_rows
