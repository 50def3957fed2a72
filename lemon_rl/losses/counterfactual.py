"""LEMON's counterfactual span credit (METHODS.md section 4): the span-local loss and the edit-family sampler.

For a valid orchestration spec, one local edit (an *edit family*: drop a dependency edge, reset an agent's
duty to its base role, lower an agent's capacity by one level) is applied and the edited spec is re-executed;
the contrast ``dc = r(original) - r(edited)`` is the advantage of an extra clipped policy-gradient term on the
tokens of the edited field of the *original* spec only:

  L_cf = agg_{span}( -min(rho dc, clip(rho, 1 - eps_low, 1 + eps_high) dc) ),
  L    = L_GRPO + mu * L_cf                                  (*Decision*: mu = 1, :data:`DEFAULT_MU`)

``dc > 0`` (the original field beats its edit) raises the field's probability, ``dc < 0`` lowers it, and the
size of the push is ``|dc|`` (*Decision*, METHODS.md: the paper weights its span preference by ``|dc|``).

- :func:`counterfactual_loss`: ``L_cf`` as a ``(sum, denominator)`` pair plus metrics; the per-token
  surrogate is :func:`lemon_rl.losses.clipped_surrogate_loss` itself, with the span as its mask.
- :func:`combined_loss`: ``L_GRPO + mu L_cf`` from the two ``(loss, metrics)`` pairs, each term divided by
  its own (global, under micro-batching) denominator, as :func:`lemon_rl.losses.fest_grpo_loss` does.
- :class:`EditFamilySampler` (host-side NumPy): which edit family to apply to a spec, with probabilities
  proportional to a running mean of each family's ``|dc|`` and a floor; :func:`floored_proportional` is
  its probability rule.

Both losses are pure functions of arrays (jit, vmap and pmap friendly; strings and ``max_len`` static).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from lemon_rl import ops
from lemon_rl.losses import policy_gradient as pg

Array = jax.Array
WeightedMetric = ops.WeightedMetric
Metrics = dict[str, ops.Metric]
LossAndMetrics = tuple[WeightedMetric, Metrics]

# *Decision* (METHODS.md section 4): the weight of L_cf in L_GRPO + mu L_cf.
DEFAULT_MU = 1.0

# The edit families of METHODS.md section 4, in the order of the sampler's arrays.
EDIT_FAMILIES = ("drop_edge", "reset_duty", "lower_capacity")

# *Decision*: each applicable family keeps at least 10% of the draws, so a family whose |dc| looked small
# early (e.g. before SFT taught the orchestrator to use duties) is still measured as the policy changes.
DEFAULT_FLOOR = 0.1
# *Decision*: the running mean's step size is max(1/n, rate): the exact mean of the first 1/rate = 20
# observations of a family, then an exponential moving average over roughly the last 20 (|dc| drifts as
# the orchestrator learns, so old contrasts should fade).
DEFAULT_RATE = 0.05

# ---------------------------------------------------------------------------------------------------
# The span-local loss.
# ---------------------------------------------------------------------------------------------------


def counterfactual_loss(
    logp: Array,
    old_logp: Array,
    dc: Array,
    span_mask: Array,
    *,
    completion_mask: Array | None = None,
    eps_low: float | Array | None = None,
    eps_high: float | Array | None = None,
    dual_clip: float | Array | None = None,
    sampler_logp: Array | None = None,
    tis_cap: float | Array | None = None,
    aggregation: str | None = None,
    max_len: int | None = None,
) -> LossAndMetrics:
  """The span-local clipped policy-gradient term ``L_cf`` with advantage ``dc``.

  Per token ``l[i,t] = -min(rho dc_i, clip(rho, 1 - eps_low, 1 + eps_high) dc_i)`` on the span
  ``s[i,t] = 1`` (:func:`lemon_rl.losses.clipped_surrogate_loss` with ``mask = s``, token ratios), then
  aggregated over the span tokens. Positions outside the span get neither loss nor gradient (exactly 0),
  whatever their log-probs (``-inf`` included), and ``dc_i`` of a row without an edit is never read.

  Denominators (*Decision*): a row without an edit has an all-zero span, so it adds no token to
  ``token_mean`` and is not counted as a sequence by the ``seq_mean_*`` modes (they count non-empty rows
  only): unedited rows never dilute ``L_cf``, and a batch without any edit gives ``(0, 0)`` (value and
  gradient 0). The default ``token_mean`` is the ``ppo_clip`` default, so ``L_cf`` is a mean over span
  tokens, on the per-token scale of ``L_GRPO``; ``seq_mean_token_sum`` instead gives every edit the
  field-level gradient ``dc_i grad log pi(field_i)`` (mean over edits), whatever the field's length.

  Args:
    logp: ``[B, T]`` float, current log-probs of the *original* spec's tokens (differentiated).
    old_logp: ``[B, T]`` float, log-probs of the policy that sampled the spec.
    dc: ``[B]`` float, ``r(original) - r(edited)`` per row (gradient stopped).
    span_mask: ``[B, T]`` 1 on the edited field's tokens of the original spec, 0 elsewhere; all 0 for a
      row without an edit. Nonzero entries count as 1.
    completion_mask: optional ``[B, T]`` loss mask of the spec's generated tokens; the span is intersected
      with it (a guard against a span map that reaches into the prompt or padding).
    eps_low, eps_high, dual_clip, sampler_logp, tis_cap: as in
      :func:`lemon_rl.losses.clipped_surrogate_loss` (``None`` clip ranges: ``ppo_clip``'s 0.2). May be
      traced (not the arrays' presence).
    aggregation: a name in :data:`lemon_rl.losses.AGGREGATIONS` (``None``: ``token_mean``). Static.
    max_len: the constant of ``seq_mean_token_sum_norm``. Static.

  Returns:
    ``(loss, metrics)``: ``loss`` a :class:`~lemon_rl.ops.WeightedMetric`; ``metrics`` the surrogate's
    (``clip_frac``, ``ratio_mean``, ``approx_kl``, ...; token means over the span tokens) plus
    ``edit_frac`` (share of rows with an edit), ``dc_mean`` and ``abs_dc_mean`` (over edited rows) and
    ``span_tokens`` (mean span length over edited rows), all additive pairs.
  """
  chex.assert_rank([logp, old_logp, span_mask], 2)
  chex.assert_equal_shape([logp, old_logp, span_mask])
  chex.assert_rank(dc, 1)
  chex.assert_shape(dc, logp.shape[:1])
  span = jnp.asarray(span_mask) != 0
  if completion_mask is not None:
    chex.assert_equal_shape([logp, completion_mask])
    span = span & (jnp.asarray(completion_mask) != 0)
  span = span.astype(jnp.float32)
  edited = jnp.any(span != 0, axis=-1)
  dc = jax.lax.stop_gradient(jnp.where(edited, jnp.asarray(dc, jnp.float32), 0.0))

  loss, metrics = pg.clipped_surrogate_loss(
      logp, old_logp, dc, span, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
      ratio_level="token", sampler_logp=sampler_logp, tis_cap=tis_cap, aggregation=aggregation,
      max_len=max_len)
  rows = jnp.ones(dc.shape, jnp.float32)
  metrics.update({
      "edit_frac": ops.weighted_metric(edited.astype(jnp.float32), rows),
      "dc_mean": ops.weighted_metric(dc, edited),
      "abs_dc_mean": ops.weighted_metric(jnp.abs(dc), edited),
      "span_tokens": ops.weighted_metric(jnp.sum(span, axis=-1), edited),
  })
  return loss, metrics


def combined_loss(
    grpo: LossAndMetrics,
    cf: LossAndMetrics,
    *,
    mu: float | Array = DEFAULT_MU,
    grpo_denominator: Array | None = None,
    cf_denominator: Array | None = None,
    share: float | Array = 1.0,
) -> LossAndMetrics:
  """LEMON's total loss ``L = L_GRPO + mu L_cf`` from the two terms' ``(loss, metrics)`` pairs.

  The two terms are means over different tokens (all completion tokens; the edited spans), so the total is
  ``sum_of_means``, not one pair: ``WeightedMetric(S_GRPO / D_GRPO + mu S_cf / D_cf, share)`` (see
  :mod:`lemon_rl.losses.fest`). For the whole batch leave the denominators ``None`` (each term's own) and
  ``share = 1``. Under micro-batching or across devices pass the *whole-batch* denominators (they depend on
  the masks only: ``aggregate(zeros, mask, mode).denominator``) and each piece's share of the batch
  (shares add up to 1, e.g. ``1 / M``); the pieces' pairs then add up to ``(L, 1)`` and their gradients to
  the whole batch's. A term whose denominator is 0 (no edit anywhere) contributes 0.

  Args:
    grpo: ``(loss, metrics)`` of :func:`lemon_rl.losses.grpo_loss` (or any policy loss).
    cf: ``(loss, metrics)`` of :func:`counterfactual_loss`.
    mu: weight of ``L_cf`` (*Decision*: 1). May be traced.
    grpo_denominator, cf_denominator: whole-batch denominators (both or neither).
    share: this piece's share of the batch.

  Returns:
    ``(loss, metrics)``: the GRPO metrics under their own names, the counterfactual ones prefixed
    ``cf/``, and the terms themselves as ``grpo/loss`` and ``cf/loss`` (gradient stopped).
  """
  (grpo_term, grpo_metrics), (cf_term, cf_metrics) = grpo, cf
  if (grpo_denominator is None) != (cf_denominator is None):
    raise ValueError("pass both whole-batch denominators (grpo_denominator, cf_denominator) or neither")
  dens = None if grpo_denominator is None else (grpo_denominator, cf_denominator)
  total = ops.sum_of_means([grpo_term, cf_term], [1.0, mu], dens)
  sg = jax.lax.stop_gradient
  metrics: Metrics = dict(grpo_metrics)
  metrics.update({f"cf/{k}": v for k, v in cf_metrics.items()})
  metrics["grpo/loss"] = sg(grpo_term)
  metrics["cf/loss"] = sg(cf_term)
  return WeightedMetric(total, jnp.asarray(share, jnp.float32)), metrics


# ---------------------------------------------------------------------------------------------------
# Edit-family sampling (host side).
# ---------------------------------------------------------------------------------------------------


def floored_proportional(weights, applicable=None, *, floor: float = DEFAULT_FLOOR) -> np.ndarray:
  """Probabilities proportional to ``weights`` among the applicable entries, each at least ``floor``.

  Exactly (*Decision*, "water filling"): ``p_f = 0`` for an inapplicable ``f``; otherwise
  ``p_f = max(floor, c w_f)`` with the one ``c`` that makes them sum to 1. So a family whose proportional
  share would fall below the floor gets exactly ``floor``, and the rest split the remaining mass in
  proportion to their weights (``p_f / p_g = w_f / w_g`` among them). Computed by clamping the smallest
  weights one at a time until no unclamped share is below the floor. If no applicable weight is positive
  the applicable entries are uniform; if none is applicable all probabilities are 0.

  Args:
    weights: ``[F]`` or ``[N, F]`` non-negative weights.
    applicable: same shape, bool (``None``: all applicable).
    floor: in ``[0, 1/F]``, so that ``K floor <= 1`` for any ``K <= F`` applicable entries.

  Returns:
    float64 probabilities of ``weights``' shape; each applicable row sums to 1.
  """
  w = np.asarray(weights, np.float64)
  mask = np.ones(w.shape, bool) if applicable is None else np.asarray(applicable, bool)
  if mask.shape != w.shape or w.ndim not in (1, 2):
    raise ValueError(f"weights {w.shape} and applicable {mask.shape} must have one shape, [F] or [N, F]")
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"weights must be finite and >= 0, got {w}")
  num = w.shape[-1]
  if not 0 <= floor <= 1.0 / num:
    raise ValueError(f"floor must be in [0, 1/{num}] for {num} families, got {floor}")
  if w.ndim == 2:  # one solve per distinct (weights, mask) row: a batch of specs has few
    keys, inverse = np.unique(np.concatenate([w, mask], axis=-1), axis=0, return_inverse=True)
    solved = np.stack([floored_proportional(k[:num], k[num:] != 0, floor=floor) for k in keys])
    return solved[np.reshape(inverse, -1)]
  p = np.zeros(num)
  idx = np.flatnonzero(mask)
  if idx.size == 0:
    return p
  wa = w[idx]
  if wa.sum() <= 0:
    p[idx] = 1.0 / idx.size
    return p
  # Clamp the smallest remaining weight while its proportional share is below the floor. Clamping lowers
  # the others' scale c, so earlier clamps stay below the floor; the largest weight is never clamped
  # (its share is at least 1 - (K - 1) floor >= floor), so it is left out and the free set never empty.
  clamped = np.zeros(idx.size, bool)
  for j in np.argsort(wa, kind="stable")[:-1]:
    scale = (1.0 - floor * clamped.sum()) / wa[~clamped].sum()
    if scale * wa[j] >= floor:
      break
    clamped[j] = True
  pa = np.full(idx.size, floor)
  pa[~clamped] = (1.0 - floor * clamped.sum()) * wa[~clamped] / wa[~clamped].sum()
  p[idx] = pa
  return p


class EditFamilySampler:
  """Chooses which counterfactual edit family to apply, by how much each has mattered (host-side NumPy).

  State: per family a running mean ``m_f`` of ``|dc|`` and a count ``n_f`` of observations. One
  observation updates ``m_f <- m_f + max(1 / n_f, rate) (|dc| - m_f)`` (after incrementing ``n_f``):
  the exact mean of the first ``1 / rate`` observations, then an exponential moving average with rate
  ``rate`` (*Decision*, :data:`DEFAULT_RATE`); ``rate = 0`` keeps the cumulative mean forever.

  Probabilities for a spec: :func:`floored_proportional` of the weights ``m_f`` among the families
  applicable to it (e.g. ``drop_edge`` needs an edge, ``reset_duty`` a customised duty,
  ``lower_capacity`` an agent above the smallest capacity). A family not yet observed takes the largest
  observed mean as its weight (optimistic: it is drawn at least as often as the most useful family until
  measured); with no observation at all the applicable families are uniform.

  Draws come from ``numpy.random.default_rng(seed)``, so a run is reproducible; :meth:`state_dict` /
  :meth:`load_state_dict` save and restore the means, counts and generator for checkpointing.
  """

  def __init__(self, families: Sequence[str] = EDIT_FAMILIES, *, floor: float = DEFAULT_FLOOR,
               rate: float = DEFAULT_RATE, seed: int = 0):
    self.families = tuple(families)
    if len(set(self.families)) != len(self.families) or not self.families:
      raise ValueError(f"families must be distinct and non-empty, got {self.families}")
    if not 0 <= floor <= 1.0 / len(self.families):
      raise ValueError(f"floor must be in [0, 1/{len(self.families)}], got {floor}")
    if not 0 <= rate <= 1:
      raise ValueError(f"rate must be in [0, 1], got {rate}")
    self.floor, self.rate = float(floor), float(rate)
    self.means = np.zeros(len(self.families))
    self.counts = np.zeros(len(self.families), np.int64)
    self._rng = np.random.default_rng(seed)

  def index(self, family: str | int) -> int:
    """The position of ``family`` (a name or an index) in :attr:`families`."""
    if isinstance(family, (int, np.integer)):
      if not 0 <= family < len(self.families):
        raise ValueError(f"family index {family} out of range for {self.families}")
      return int(family)
    if family not in self.families:
      raise ValueError(f"unknown edit family {family!r}; known: {', '.join(self.families)}")
    return self.families.index(family)

  def weights(self) -> np.ndarray:
    """``[F]``: each family's running mean ``|dc|``; unobserved families take the largest observed one."""
    seen = self.counts > 0
    if not seen.any():
      return np.ones(len(self.families))
    return np.where(seen, self.means, self.means[seen].max())

  def probabilities(self, applicable=None) -> np.ndarray:
    """``[F]`` or ``[N, F]`` sampling probabilities for specs with the given applicable families.

    Args:
      applicable: ``[F]`` or ``[N, F]`` bool, or a collection of family names (``None``: all).
    """
    if applicable is not None and not isinstance(applicable, np.ndarray) and all(
        isinstance(a, str) for a in applicable):
      applicable = np.isin(self.families, list(applicable))
    w = self.weights()
    if applicable is not None:
      applicable = np.asarray(applicable, bool)
      w = np.broadcast_to(w, applicable.shape)
    return floored_proportional(w, applicable, floor=self.floor)

  def sample(self, applicable=None) -> np.ndarray:
    """Draws a family index per spec (``-1`` where none is applicable).

    Args:
      applicable: as in :meth:`probabilities`; ``[F]`` gives a scalar, ``[N, F]`` an ``[N]`` array.

    Returns:
      int64 indices into :attr:`families`.
    """
    probs = self.probabilities(applicable)
    rows = np.atleast_2d(probs)
    u = self._rng.random(rows.shape[0])  # one uniform per spec, applicable or not
    # Inverse CDF: the number of cumulative sums <= u * total is the first family whose cdf exceeds it
    # (zero-probability families repeat the previous sum and are skipped); rounding at the top is resolved
    # by the last applicable family.
    cdf = np.cumsum(rows, axis=-1)
    draws = np.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    positive = rows > 0
    last = rows.shape[-1] - 1 - np.argmax(positive[:, ::-1], axis=-1)
    draws = np.where(positive.any(-1), np.minimum(draws, last), -1).astype(np.int64)
    return draws[0] if probs.ndim == 1 else draws

  def update(self, families, dc) -> None:
    """Adds observed ``(family, dc)`` pairs, in order (``dc = r(original) - r(edited)``).

    Args:
      families: a family name or index, or a sequence of them; entries ``-1`` or ``None`` (no edit)
        are skipped.
      dc: the matching contrast(s).
    """
    fams = [families] if isinstance(families, (str, int, np.integer)) else list(families)
    dcs = np.atleast_1d(np.asarray(dc, np.float64))
    if len(fams) != dcs.shape[0]:
      raise ValueError(f"{len(fams)} families but {dcs.shape[0]} contrasts")
    for fam, x in zip(fams, dcs):
      if fam is None or (isinstance(fam, (int, np.integer)) and fam == -1):
        continue
      if not np.isfinite(x):
        raise ValueError(f"dc must be finite, got {x} for family {fam!r}")
      f = self.index(fam)
      self.counts[f] += 1
      step = max(1.0 / self.counts[f], self.rate)
      self.means[f] += step * (abs(x) - self.means[f])

  def state_dict(self) -> dict:
    """The sampler's state (means, counts, generator) as plain Python/NumPy values."""
    return {"families": self.families, "means": self.means.copy(), "counts": self.counts.copy(),
            "rng": self._rng.bit_generator.state}

  def load_state_dict(self, state: Mapping) -> None:
    """Restores :meth:`state_dict`'s output (the families must match)."""
    if tuple(state["families"]) != self.families:
      raise ValueError(f"state is for families {tuple(state['families'])}, not {self.families}")
    self.means = np.asarray(state["means"], np.float64).copy()
    self.counts = np.asarray(state["counts"], np.int64).copy()
    self._rng.bit_generator.state = state["rng"]
