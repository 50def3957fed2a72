"""Policy-gradient losses: aggregation modes, KL estimators, clipped surrogates (PPO/GRPO/GSPO).

All functions are pure functions of arrays (log-probs, advantages, masks),
never of a model, and return *unreduced* :class:`~lemon_rl.ops.WeightedMetric`
``(sum, denominator)`` pairs. Summing the pairs of micro-batches or devices and
dividing once gives exactly the full-batch loss (and, since denominators depend
on masks only, the full-batch gradient). See METHODS.md section 0.

Shapes: ``B`` sequences, ``T`` positions (prompt, completion and padding; the
mask selects the policy-generated tokens). Log-probs are computed in float32;
lower-precision inputs are upcast.

Numerics: masked positions may hold any log-prob (``-inf`` included) in
``logp``, ``old_logp``, ``ref_logp`` or ``sampler_logp``: inputs are masked
*before* any difference is taken, so such positions give neither NaN values nor
NaN gradients. Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``
before ``exp`` (see :data:`LOG_RATIO_CLAMP`).

Coefficients (``kl_coef``, ``entropy_coef``, ``eps_low``, ``eps_high``,
``dual_clip``, ``tis_cap``) may be traced values (e.g. a KL schedule passed
into a jitted update without recompiling); range checks run only when a value
is concrete.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from lemon_rl import ops
from lemon_rl.utils.registry import Registry

Array = jax.Array
WeightedMetric = ops.WeightedMetric
Metrics = dict[str, ops.Metric]

# *Decision* (verl's value): every log-ratio (the token ratio, GSPO's sequence
# ratio, the TIS weight and k3's exponent) is clamped to +-20 before ``exp``,
# so a ratio lies in [e^-20, e^20] ~ [2e-9, 4.9e8]: finite in float32, and far
# outside any clip range, so clipped tokens are unaffected. Beyond the clamp
# the gradient through the log-ratio is 0.
LOG_RATIO_CLAMP = 20.0


def _concrete(x) -> float | None:
  """``x`` as a Python float when it is a concrete scalar; ``None`` when traced (or ``None``)."""
  if x is None or isinstance(x, jax.core.Tracer):
    return None
  return float(np.asarray(x))


def _clamp_log_ratio(log_ratio: Array) -> Array:
  return jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _masked_inputs(mask: Array, *arrays: Array) -> tuple[Array, ...]:
  """float32 copies of ``arrays`` with 0 at masked positions (before any subtraction).

  ``jnp.where(valid, a - b, 0)`` is not enough: with ``a = b = -inf`` the
  unselected branch is NaN, and with ``a`` finite and ``b = -inf`` any ``exp``
  downstream is inf, whose zero cotangent times inf is a NaN gradient.
  """
  valid = jnp.asarray(mask) != 0
  return tuple(jnp.where(valid, a.astype(jnp.float32), 0.0) for a in arrays)

# ---------------------------------------------------------------------------
# Aggregation modes.
# ---------------------------------------------------------------------------

AggregationFn = Callable[..., WeightedMetric]
AGGREGATIONS: Registry[AggregationFn] = Registry("aggregation mode")


def _check_per_token(per_token: Array, mask: Array) -> None:
  chex.assert_rank([per_token, mask], 2)
  chex.assert_equal_shape([per_token, mask])


def _valid_sequences(mask: Array) -> Array:
  """``[B]`` 1.0 for sequences with at least one valid token, else 0.0."""
  return (jnp.sum(jnp.asarray(mask) != 0, axis=-1) > 0).astype(jnp.float32)


@AGGREGATIONS.register("token_mean")
def token_mean(per_token: Array, mask: Array, *, max_len: int | None = None) -> WeightedMetric:
  """Token mean over the whole batch: ``sum_{i,t} m x / sum_{i,t} m``.

  Args:
    per_token: ``[B, T]`` per-token values (losses).
    mask: ``[B, T]`` 0/1 loss mask.
    max_len: unused (uniform signature).

  Returns:
    ``(sum_{i,t} m x, sum_{i,t} m)``.
  """
  del max_len
  _check_per_token(per_token, mask)
  return WeightedMetric(ops.masked_sum(per_token, mask),
                        ops.masked_sum(jnp.ones(per_token.shape, jnp.float32), mask))


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(per_token: Array, mask: Array, *,
                        max_len: int | None = None) -> WeightedMetric:
  """Mean over sequences of each sequence's token mean (GRPO paper).

  ``sum_i [ sum_t m x / sum_t m ] / #{i : sum_t m_i > 0}``.

  *Decision*: the denominator counts only sequences with at least one valid
  token, so all-padding rows (added to fill a device or a fixed batch shape)
  do not dilute the loss; a batch with real sequences only gives ``B``.

  Returns:
    ``(sum over sequences of the per-sequence token mean, number of non-empty sequences)``.
  """
  del max_len
  _check_per_token(per_token, mask)
  seq_sum = ops.masked_sum(per_token, mask, axis=-1)
  seq_len = ops.masked_sum(jnp.ones(per_token.shape, jnp.float32), mask, axis=-1)
  return WeightedMetric(jnp.sum(ops.safe_divide(seq_sum, seq_len)), jnp.sum(_valid_sequences(mask)))


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(per_token: Array, mask: Array, *,
                       max_len: int | None = None) -> WeightedMetric:
  """Mean over sequences of each sequence's token *sum*.

  ``sum_{i,t} m x / #{i : sum_t m_i > 0}`` (same denominator decision as
  :func:`seq_mean_token_mean`).
  """
  del max_len
  _check_per_token(per_token, mask)
  return WeightedMetric(ops.masked_sum(per_token, mask), jnp.sum(_valid_sequences(mask)))


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(per_token: Array, mask: Array, *,
                            max_len: int | None = None) -> WeightedMetric:
  """Dr.GRPO: each sequence's token sum divided by a *constant* ``max_len``, mean over sequences.

  ``sum_i [ sum_t m x / max_len ] / #{i : sum_t m_i > 0}``.

  Args:
    per_token: ``[B, T]``.
    mask: ``[B, T]``.
    max_len: the constant (the generation budget). ``None`` uses ``T``, the
      padded length (as verl does); pass it explicitly when micro-batches may be
      padded to different lengths, or the pieces will not add up.
  """
  _check_per_token(per_token, mask)
  norm = per_token.shape[-1] if max_len is None else max_len
  if not norm > 0:
    raise ValueError(f"max_len must be > 0, got {max_len}")
  return WeightedMetric(ops.masked_sum(per_token, mask) / norm, jnp.sum(_valid_sequences(mask)))


def aggregate(per_token: Array, mask: Array, mode: str = "token_mean", *,
              max_len: int | None = None) -> WeightedMetric:
  """Aggregates ``[B, T]`` per-token values with the registered ``mode``."""
  return AGGREGATIONS.get(mode)(per_token, mask, max_len=max_len)


# ---------------------------------------------------------------------------
# KL estimators (per token, [B, T]).
# ---------------------------------------------------------------------------

KLEstimator = Callable[[Array, Array], Array]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


def _check_logps(*arrays: Array) -> None:
  chex.assert_rank(arrays, 2)
  chex.assert_equal_shape(arrays)
  chex.assert_type(arrays, float)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Array, ref_logp: Array) -> Array:
  """``k1 = logp - logp_ref`` (unbiased, high variance). ``[B, T], [B, T] -> [B, T]``."""
  _check_logps(logp, ref_logp)
  return logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Array, ref_logp: Array) -> Array:
  """``k2 = 0.5 (logp - logp_ref)^2``. ``[B, T], [B, T] -> [B, T]``."""
  _check_logps(logp, ref_logp)
  d = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
  return 0.5 * d * d


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Array, ref_logp: Array) -> Array:
  """``k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1`` (Schulman; >= 0, low variance; default).

  ``[B, T], [B, T] -> [B, T]``. The log-ratio ``logp_ref - logp`` is clamped
  to ``+-LOG_RATIO_CLAMP`` first (as verl's ``low_var_kl`` does), so the value
  stays finite.
  """
  _check_logps(logp, ref_logp)
  d = _clamp_log_ratio(ref_logp.astype(jnp.float32) - logp.astype(jnp.float32))
  return jnp.expm1(d) - d


def kl_penalty(logp: Array, ref_logp: Array, mask: Array, *, estimator: str = "k3",
               aggregation: str = "token_mean", max_len: int | None = None) -> WeightedMetric:
  """The aggregated per-token KL estimate to a frozen reference, as a ``(sum, denominator)`` pair.

  Args:
    logp: ``[B, T]`` current policy log-probs (differentiated).
    ref_logp: ``[B, T]`` reference log-probs (no gradient is taken through them).
    mask: ``[B, T]``.
    estimator: a name in :data:`KL_ESTIMATORS` (``k1``, ``k2``, ``k3``).
    aggregation: a name in :data:`AGGREGATIONS`.
    max_len: see :func:`seq_mean_token_sum_norm`.

  Masked positions of ``logp`` / ``ref_logp`` are zeroed before the estimator,
  so ``-inf`` there gives no NaN (value or gradient).
  """
  _check_logps(logp, ref_logp)
  chex.assert_equal_shape([logp, mask])
  logp, ref_logp = _masked_inputs(mask, logp, jax.lax.stop_gradient(ref_logp))
  kl = KL_ESTIMATORS.get(estimator)(logp, ref_logp)
  return aggregate(kl, mask, aggregation, max_len=max_len)


def entropy_bonus(entropy: Array, mask: Array, *, aggregation: str = "token_mean",
                  max_len: int | None = None) -> WeightedMetric:
  """The aggregated per-token entropy ``[B, T]`` (e.g. :func:`lemon_rl.ops.entropy_from_logits`)."""
  return aggregate(entropy.astype(jnp.float32), mask, aggregation, max_len=max_len)


# ---------------------------------------------------------------------------
# Clipped surrogate (PPO / GRPO / DAPO asymmetric clip / dual clip / GSPO / TIS).
# ---------------------------------------------------------------------------

RATIO_LEVELS = ("token", "sequence")


def _broadcast_advantages(advantages: Array, shape: tuple[int, int]) -> Array:
  chex.assert_rank(advantages, {1, 2})
  if advantages.ndim == 1:
    chex.assert_shape(advantages, shape[:1])
    return jnp.broadcast_to(advantages[:, None], shape)
  chex.assert_shape(advantages, shape)
  return advantages


def _check_options(eps_low, eps_high, dual_clip, ratio_level, tis_cap, sampler_logp) -> None:
  """Checks the options; numeric ranges only for concrete (not traced) values."""
  if ratio_level not in RATIO_LEVELS:
    raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
  low, high, dual, cap = (_concrete(v) for v in (eps_low, eps_high, dual_clip, tis_cap))
  if low is not None and not 0 <= low < 1:
    raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
  if high is not None and not high >= 0:
    raise ValueError(f"eps_high must be >= 0, got {eps_high}")
  if dual is not None and not dual > 1:
    raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
  if tis_cap is not None:
    if sampler_logp is None:
      raise ValueError("tis_cap is set but sampler_logp is None: the TIS weight needs the sampler's log-probs")
    if cap is not None and not cap > 0:
      raise ValueError(f"tis_cap must be > 0 (or None), got {tis_cap}")


def _log_ratio(logp: Array, old_logp: Array, mask: Array) -> tuple[Array, Array]:
  """``(logp masked, clamp(logp - sg[old_logp]) [B, T])``, both 0 at masked positions."""
  logp, old_logp = _masked_inputs(mask, logp, jax.lax.stop_gradient(old_logp))
  return logp, _clamp_log_ratio(logp - old_logp)


def importance_ratio(logp: Array, old_logp: Array, mask: Array, *,
                     ratio_level: str = "token") -> Array:
  """The ratio ``rho [B, T]`` of the surrogate.

  - ``"token"``: ``rho[i,t] = exp(clamp(logp[i,t] - old_logp[i,t]))``.
  - ``"sequence"`` (GSPO): ``s_i = exp(mean_t m clamp(logp - old_logp))``, the
    geometric mean of the token ratios, written in GSPO-token form
    ``rho[i,t] = sg[s_i] * exp(logp[i,t] - sg[logp[i,t]])``: the value of every
    token is ``s_i`` and the gradient of ``sum_t rho A / |y_i|`` equals that of
    ``s_i A`` for sequence-level advantages.

  ``clamp`` bounds each token's log-ratio to ``+-LOG_RATIO_CLAMP`` (so the
  sequence mean is bounded too). Masked positions get ratio 1 and no gradient
  (their log-probs may be anything, even -inf).
  """
  if ratio_level not in RATIO_LEVELS:
    raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
  logp, log_ratio = _log_ratio(logp, old_logp, mask)
  if ratio_level == "token":
    return jnp.exp(log_ratio)
  seq_log_ratio = jax.lax.stop_gradient(ops.masked_mean(log_ratio, mask, axis=-1))  # [B], in +-clamp
  token_term = logp - jax.lax.stop_gradient(logp)  # value 0, gradient of logp; 0 where masked
  return jnp.exp(seq_log_ratio[:, None] + token_term)


def clipped_surrogate_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    sampler_logp: Array | None = None,
    tis_cap: float | None = None,
    aggregation: str | None = None,
    max_len: int | None = None,
) -> tuple[WeightedMetric, Metrics]:
  """The PPO/GRPO clipped surrogate (registered as ``ppo_clip``), as a ``(sum, denominator)`` loss pair.

  Per token (METHODS.md section 0):

    l[i,t] = max(-rho A, -clip(rho, 1 - eps_low, 1 + eps_high) A)
           = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)

  with ``rho`` from :func:`importance_ratio`. Options:

  - ``eps_high != eps_low``: asymmetric ("clip-higher", DAPO) clipping;
  - ``dual_clip = c > 1``: for ``A < 0`` the loss is bounded by ``-c A``,
    ``l = min(l, -c A)`` (Ye et al. 2020);
  - ``ratio_level="sequence"``: GSPO's sequence ratio (prefer :func:`gspo_loss`,
    which also takes GSPO's small clip range and aggregation by default);
  - ``sampler_logp``: truncated importance sampling for a sampler/trainer
    mismatch, ``l *= sg[min(exp(clamp(old_logp - sampler_logp)), tis_cap)]``
    (untruncated, but still clamped at ``e^LOG_RATIO_CLAMP``, when ``tis_cap``
    is None).

  Then ``l`` is aggregated with ``aggregation`` (see :data:`AGGREGATIONS`).

  Args:
    logp: ``[B, T]`` float, log-probs of the current policy (differentiated).
    old_logp: ``[B, T]`` float, log-probs of the policy that sampled (``pi_old``).
    advantages: ``[B]`` (one per sequence) or ``[B, T]`` (per token).
    mask: ``[B, T]`` loss mask (1 on policy-generated tokens).
    eps_low: lower clip range, ratio floor ``1 - eps_low`` (``None``: ``ppo_clip``'s
      default 0.2, see :data:`POLICY_LOSS_DEFAULTS`). May be traced.
    eps_high: upper clip range, ratio ceiling ``1 + eps_high`` (``None``:
      ``eps_low`` if that is given, else the default 0.2). May be traced.
    dual_clip: the dual-clip constant ``c > 1`` or ``None``. May be traced.
    ratio_level: ``"token"`` or ``"sequence"`` (GSPO). Static.
    sampler_logp: ``[B, T]`` the sampler's log-probs, or ``None``.
    tis_cap: the truncation ``C`` of the TIS weight, or ``None``. May be traced.
    aggregation: a name in :data:`AGGREGATIONS` (``None``: ``token_mean``). Static.
    max_len: the constant of ``seq_mean_token_sum_norm``. Static.

  Returns:
    ``(loss, metrics)``: ``loss`` a :class:`WeightedMetric`; ``metrics`` a dict
    of additive metrics, all token means over the mask (``clip_frac_low``:
    share of tokens with ``A < 0`` and ``rho < 1 - eps_low``; ``clip_frac_high``:
    ``A > 0`` and ``rho > 1 + eps_high``; ``clip_frac``; ``ratio_mean``;
    ``approx_kl``: k3 of ``pi_old`` from ``pi``; ``dual_clip_frac`` and
    ``tis_weight_mean``/``tis_clip_frac`` when enabled) plus ``ratio_min`` /
    ``ratio_max`` (:class:`~lemon_rl.ops.MinMetric` / ``MaxMetric``).
  """
  eps_low, eps_high, aggregation = resolve_surrogate_options(
      "ppo_clip", eps_low=eps_low, eps_high=eps_high, aggregation=aggregation)
  _check_options(eps_low, eps_high, dual_clip, ratio_level, tis_cap, sampler_logp)
  _check_logps(logp, old_logp)
  chex.assert_equal_shape([logp, mask])
  valid = jnp.asarray(mask) != 0
  adv = _broadcast_advantages(advantages, logp.shape).astype(jnp.float32)
  adv = jax.lax.stop_gradient(jnp.where(valid, adv, 0.0))

  rho = importance_ratio(logp, old_logp, mask, ratio_level=ratio_level)
  clipped_rho = jnp.clip(rho, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(-adv * rho, -adv * clipped_rho)
  metrics: Metrics = {}
  if dual_clip is not None:
    bound = -adv * dual_clip
    dual_active = (adv < 0) & (bound < loss)
    loss = jnp.where(adv < 0, jnp.minimum(loss, bound), loss)
    metrics["dual_clip_frac"] = ops.weighted_metric(dual_active.astype(jnp.float32), mask)
  if sampler_logp is not None:
    _check_logps(logp, sampler_logp)
    _, log_w = _log_ratio(old_logp, sampler_logp, mask)
    tis = jnp.exp(log_w)
    if tis_cap is not None:
      metrics["tis_clip_frac"] = ops.weighted_metric((tis > tis_cap).astype(jnp.float32), mask)
      tis = jnp.minimum(tis, tis_cap)
    tis = jax.lax.stop_gradient(tis)
    loss = loss * tis
    metrics["tis_weight_mean"] = ops.weighted_metric(tis, mask)

  low = (adv < 0) & (rho < 1.0 - eps_low)
  high = (adv > 0) & (rho > 1.0 + eps_high)
  ratio = jax.lax.stop_gradient(rho)
  token_log_ratio = jax.lax.stop_gradient(_log_ratio(logp, old_logp, mask)[1])
  metrics.update({
      "clip_frac_low": ops.weighted_metric(low.astype(jnp.float32), mask),
      "clip_frac_high": ops.weighted_metric(high.astype(jnp.float32), mask),
      "clip_frac": ops.weighted_metric((low | high).astype(jnp.float32), mask),
      "ratio_mean": ops.weighted_metric(ratio, mask),
      "ratio_min": ops.masked_min(ratio, mask),
      "ratio_max": ops.masked_max(ratio, mask),
      # k3 of pi_old from pi: exp(old - logp) - (old - logp) - 1 on the clamped log-ratio.
      "approx_kl": ops.weighted_metric(jnp.expm1(-token_log_ratio) + token_log_ratio, mask),
  })
  return aggregate(loss, mask, aggregation, max_len=max_len), metrics


# ---------------------------------------------------------------------------
# Policy-loss registry and each loss's own defaults.
# ---------------------------------------------------------------------------

PolicyLossFn = Callable[..., tuple[WeightedMetric, Metrics]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


@dataclasses.dataclass(frozen=True)
class PolicyLossDefaults:
  """What ``None`` means for a registered policy loss's options (:func:`resolve_surrogate_options`).

  Attributes:
    eps_low: default lower clip range.
    eps_high: default upper clip range (used when neither ``eps_low`` nor
      ``eps_high`` is given; a given ``eps_low`` alone means a symmetric range).
    aggregation: default aggregation mode.
    takes_dual_clip: whether ``dual_clip`` is accepted (an error otherwise).
  """

  eps_low: float
  eps_high: float
  aggregation: str
  takes_dual_clip: bool = True


# name -> defaults; one entry per name in POLICY_LOSSES (register both with register_policy_loss).
POLICY_LOSS_DEFAULTS: dict[str, PolicyLossDefaults] = {}


def register_policy_loss(name: str, defaults: PolicyLossDefaults, fn: PolicyLossFn | None = None):
  """Registers ``fn`` in :data:`POLICY_LOSSES` and its ``defaults``; without ``fn``, a decorator.

  A policy loss is called as ``fn(logp, old_logp, advantages, mask, *, eps_low,
  eps_high, aggregation, max_len, **options)`` and returns ``(WeightedMetric, metrics)``.
  """
  def add(f: PolicyLossFn) -> PolicyLossFn:
    POLICY_LOSSES.register(name, f)
    POLICY_LOSS_DEFAULTS[name] = defaults
    return f

  return add if fn is None else add(fn)


class SurrogateOptions(NamedTuple):
  """The resolved clip range and aggregation of a policy loss."""

  eps_low: float | Array
  eps_high: float | Array
  aggregation: str


def resolve_surrogate_options(policy_loss: str, *, eps_low: float | Array | None = None,
                              eps_high: float | Array | None = None, aggregation: str | None = None,
                              dual_clip: float | Array | None = None) -> SurrogateOptions:
  """Fills ``None`` options with ``policy_loss``'s own defaults (:data:`POLICY_LOSS_DEFAULTS`).

  The one place where defaults are resolved (:func:`grpo_loss`, the registered
  losses and :class:`lemon_rl.losses.surrogate.SurrogateSettings` all call it):

  - ``eps_low``: given, else the loss's default;
  - ``eps_high``: given, else ``eps_low`` if that is given (a symmetric range),
    else the loss's default;
  - ``aggregation``: given (checked against :data:`AGGREGATIONS`), else the
    loss's default.

  ``ppo_clip``: 0.2 / 0.2, ``token_mean``; ``gspo``: 3e-4 / 4e-4,
  ``seq_mean_token_mean`` (the GSPO paper).

  Raises:
    UnknownNameError: ``policy_loss`` is not registered.
    ValueError: ``dual_clip`` is set for a loss that takes none (``gspo``), or
      ``aggregation`` is unknown.
  """
  POLICY_LOSSES.validate(policy_loss)
  if policy_loss not in POLICY_LOSS_DEFAULTS:
    raise ValueError(f"policy loss {policy_loss!r} has no defaults in POLICY_LOSS_DEFAULTS: register it "
                     "with register_policy_loss")
  defaults = POLICY_LOSS_DEFAULTS[policy_loss]
  if dual_clip is not None and not defaults.takes_dual_clip:
    raise ValueError(f"policy_loss={policy_loss!r} takes no dual_clip (got dual_clip={dual_clip}): its "
                     "ratio is per sequence; unset dual_clip or use policy_loss='ppo_clip'")
  if eps_high is None:
    eps_high = defaults.eps_high if eps_low is None else eps_low
  if eps_low is None:
    eps_low = defaults.eps_low
  aggregation = defaults.aggregation if aggregation is None else AGGREGATIONS.validate(aggregation)
  return SurrogateOptions(eps_low, eps_high, aggregation)


register_policy_loss("ppo_clip", PolicyLossDefaults(eps_low=0.2, eps_high=0.2, aggregation="token_mean"),
                     clipped_surrogate_loss)


@register_policy_loss("gspo", PolicyLossDefaults(eps_low=3e-4, eps_high=4e-4, aggregation="seq_mean_token_mean",
                                                 takes_dual_clip=False))
def gspo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
              eps_low: float | None = None, eps_high: float | None = None,
              aggregation: str | None = None, dual_clip: float | None = None,
              **kwargs) -> tuple[WeightedMetric, Metrics]:
  """GSPO (Zheng et al. 2025): :func:`clipped_surrogate_loss` with ``ratio_level="sequence"``.

  Defaults (``None``) follow the GSPO paper: clip range ``(3e-4, 4e-4)`` and a
  mean over sequences of the (identical) per-token losses, i.e.
  ``mean_i -min(s_i A_i, clip(s_i) A_i)``. GSPO takes no ``dual_clip``: setting
  one raises a ``ValueError``.
  """
  eps_low, eps_high, aggregation = resolve_surrogate_options(
      "gspo", eps_low=eps_low, eps_high=eps_high, aggregation=aggregation, dual_clip=dual_clip)
  return clipped_surrogate_loss(logp, old_logp, advantages, mask, eps_low=eps_low,
                                eps_high=eps_high, aggregation=aggregation,
                                ratio_level="sequence", **kwargs)


# ---------------------------------------------------------------------------
# The total GRPO-style loss.
# ---------------------------------------------------------------------------


def _maybe_nonzero(coef) -> bool:
  """False only for a coefficient known to be 0 (``None``, 0, a concrete 0); True when traced."""
  if coef is None:
    return False
  value = _concrete(coef)
  return value is None or value != 0


def grpo_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    policy_loss: str = "ppo_clip",
    ref_logp: Array | None = None,
    kl_coef: float | Array = 0.0,
    kl_estimator: str = "k3",
    entropy: Array | None = None,
    entropy_coef: float | Array = 0.0,
    aggregation: str | None = None,
    max_len: int | None = None,
    **surrogate_kwargs,
) -> tuple[WeightedMetric, Metrics]:
  """GRPO-style total loss: surrogate + ``kl_coef`` KL - ``entropy_coef`` entropy.

    L = agg(l_pg) + kl_coef * agg(KL_est(pi || pi_ref)) - entropy_coef * agg(H)

  All three terms are aggregated with the same mode and mask, so they share one
  denominator and the total is again a single ``(sum, denominator)`` pair.

  Under ``jax.jit`` the string and length options are static and every
  coefficient may be traced (a KL or entropy schedule does not recompile)::

    jax.jit(grpo_loss, static_argnames=("policy_loss", "kl_estimator", "aggregation",
                                        "max_len", "ratio_level"))

  ``kl_coef``, ``entropy_coef``, ``eps_low``, ``eps_high``, ``dual_clip`` and
  ``tis_cap`` may be traced; whether an optional term exists is decided by
  which arrays are passed (a traced ``kl_coef`` always needs ``ref_logp``, a
  traced ``entropy_coef`` always needs ``entropy``) and range checks run only
  on concrete values.

  Args:
    logp, old_logp, advantages, mask: as in :func:`clipped_surrogate_loss`.
    policy_loss: a name in :data:`POLICY_LOSSES` (``ppo_clip``, ``gspo``).
    ref_logp: ``[B, T]`` frozen-reference log-probs; required if ``kl_coef != 0``.
    kl_coef: KL coefficient ``beta`` (0 = no KL term; the KL is still logged
      when ``ref_logp`` is given).
    kl_estimator: a name in :data:`KL_ESTIMATORS`.
    entropy: ``[B, T]`` per-token entropy; required if ``entropy_coef != 0``.
    entropy_coef: entropy bonus coefficient.
    aggregation: a name in :data:`AGGREGATIONS`; ``None`` = the policy loss's
      default (:data:`POLICY_LOSS_DEFAULTS`: ``token_mean`` for ``ppo_clip``,
      ``seq_mean_token_mean`` for ``gspo``).
    max_len: as in :func:`clipped_surrogate_loss`.
    **surrogate_kwargs: forwarded to the policy loss (``eps_low``, ``eps_high``,
      ``dual_clip``, ``sampler_logp``, ``tis_cap``, ``ratio_level``, ...);
      ``None`` clip ranges take the policy loss's defaults.

  Returns:
    ``(loss, metrics)``; metrics add ``pg_loss``, ``kl`` and ``entropy`` (when
    available) as pairs under ``aggregation``.
  """
  eps_low, eps_high, aggregation = resolve_surrogate_options(
      policy_loss, eps_low=surrogate_kwargs.pop("eps_low", None),
      eps_high=surrogate_kwargs.pop("eps_high", None), aggregation=aggregation,
      dual_clip=surrogate_kwargs.get("dual_clip"))
  use_kl, use_entropy = _maybe_nonzero(kl_coef), _maybe_nonzero(entropy_coef)
  if use_kl and ref_logp is None:
    raise ValueError(f"kl_coef={kl_coef} needs ref_logp (the frozen reference log-probs); a traced "
                     "kl_coef always does")
  if use_entropy and entropy is None:
    raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy; a traced entropy_coef "
                     "always does")
  pg, metrics = POLICY_LOSSES.get(policy_loss)(
      logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
      aggregation=aggregation, max_len=max_len, **surrogate_kwargs)
  total = pg
  if ref_logp is not None:
    kl = kl_penalty(logp, ref_logp, mask, estimator=kl_estimator, aggregation=aggregation,
                    max_len=max_len)
    metrics["kl"] = jax.lax.stop_gradient(kl)
    if use_kl:
      total = WeightedMetric(total.sum + kl_coef * kl.sum, total.denominator)
  if entropy is not None:
    chex.assert_equal_shape([entropy, logp])
    ent = entropy_bonus(entropy, mask, aggregation=aggregation, max_len=max_len)
    metrics["entropy"] = jax.lax.stop_gradient(ent)
    if use_entropy:
      total = WeightedMetric(total.sum - entropy_coef * ent.sum, total.denominator)
  metrics["pg_loss"] = jax.lax.stop_gradient(pg)
  return total, metrics
