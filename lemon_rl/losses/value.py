"""PPO's critic: generalised advantage estimation and the clipped value loss (METHODS.md sections 0 and 5).

Pure functions of arrays, never of a model (as in :mod:`lemon_rl.losses.policy_gradient`):

- :func:`gae`: advantages and value targets ``[N, T]`` of ``N`` episodes of ``T`` steps by a reverse
  ``lax.scan``;
- :func:`clipped_value_loss`: PPO's clipped squared error as a ``(sum, denominator)`` pair plus additive
  metrics, from which :func:`explained_variance_from_metrics` recovers the explained variance after the
  metrics of micro-batches or devices are combined;
- :func:`explained_variance` and :func:`whiten_advantages` (batch statistics, ``axis_name`` for rows split
  over devices);
- :func:`token_values_to_steps` / :func:`steps_to_tokens`: between the per-token arrays of a multi-turn batch
  (:func:`lemon_rl.training.multiturn.episodes_to_batch`) and per-turn steps.

Steps are whatever the caller scores: the turns of a multi-turn episode (the default use), or tokens. A step
mask ``m [N, T]`` marks the steps that happened; masked steps are *skipped* (the recursion links each valid
step to the next valid one), so left-aligned turns, and token rows whose prompt and observation positions are
masked, both work.

*Decision* (where a state's value is read in a multi-turn episode): the value of the state ``s_t`` before
action ``t`` is the value head at the position that predicts the first token of action ``t``, i.e. the last
token before the action (the end of the observation that states ``[REMAINING TURNS] B - t``). The critic
therefore sees the whole history and the remaining budget: it is budget-conditioned by construction, and one
value (one squared error) is trained per turn, not per token. With per-token values ``v [N, T-1]`` aligned
with the next-token arrays (``v[:, j] = value_from_hidden(hidden[:, j])``, which predicts ``ids[:, j+1]``),
:func:`token_values_to_steps` picks ``V(s_t)`` and :func:`steps_to_tokens` spreads a per-turn advantage back
onto the turn's action tokens for the policy loss.

*Decision* (the end of an episode): ``bootstrap_values`` defaults to 0, the value after a *terminal* step.
With the budget in the state (BudgetMix), running out of turns is terminal too (the budget-conditioned MDP
ends there, with reward 0 on an overrun), so 0 is right for every finish status that the budget or the
environment decides. Pass ``V(s_T)`` only for a truncation the state does not show (e.g. a context overflow
where the task could go on).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from lemon_rl import ops
from lemon_rl.losses import policy_gradient as pg

Array = jax.Array
WeightedMetric = ops.WeightedMetric
Metrics = dict[str, ops.Metric]

DEFAULT_EPS = 1e-6


def _check_steps(*arrays: Array) -> None:
  chex.assert_rank(arrays, 2)
  chex.assert_equal_shape(arrays)


def _masked(mask: Array, *arrays: Array) -> tuple[Array, ...]:
  """float32 copies of ``arrays`` with 0 on masked entries, taken before any difference (no NaN leaks)."""
  valid = jnp.asarray(mask) != 0
  return tuple(jnp.where(valid, jnp.asarray(a).astype(jnp.float32), 0.0) for a in arrays)


def _concrete(x) -> float | None:
  """``x`` as a Python float when concrete; ``None`` when traced (or ``None``)."""
  if x is None or isinstance(x, jax.core.Tracer):
    return None
  return float(np.asarray(x))


# ---------------------------------------------------------------------------
# Generalised advantage estimation.
# ---------------------------------------------------------------------------


class GAEAdvantages(NamedTuple):
  """The result of :func:`gae` (no gradient; 0 on masked steps). Unpacks as ``(advantages, returns)``.

  Attributes:
    advantages: ``[N, T]`` float32 ``A_t``.
    returns: ``[N, T]`` float32 value targets ``A_t + V_t`` (the ``lambda``-returns).
  """

  advantages: Array
  returns: Array


def gae(rewards: Array, values: Array, mask: Array, *, gamma: float | Array, lam: float | Array,
        bootstrap_values: Array | None = None) -> GAEAdvantages:
  """Generalised advantage estimation (Schulman et al. 2016) over the valid steps of each row.

  For the valid steps ``t_1 < t_2 < ... < t_L`` of row ``n`` (``mask != 0``)::

    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lam * A_next(t)        (A after the last valid step = 0)
    R_t     = A_t + V_t

  where ``V_next(t)`` is the value of the next valid step, or ``bootstrap_values[n]`` after the last one.
  ``lam = 1`` gives the discounted return to go (plus ``gamma^k`` times the bootstrap) minus ``V_t``;
  ``lam = 0`` gives the one-step TD error. Computed by one reverse ``lax.scan`` over ``T`` whose carry is
  ``(V_next, A_next)`` and which leaves the carry unchanged on masked steps.

  Args:
    rewards: ``[N, T]`` reward of each step (received after its action).
    values: ``[N, T]`` ``V(s_t)`` of the policy that sampled (``sg`` is applied). Masked entries may hold
      anything, even NaN.
    mask: ``[N, T]`` 1 on steps that happened.
    gamma: discount per step. May be traced.
    lam: GAE's ``lambda``. May be traced.
    bootstrap_values: ``[N]`` the value after the last valid step; ``None`` = 0 (terminated; see the module
      docstring for when to pass ``V(s_T)``).

  Returns:
    :class:`GAEAdvantages` ``(advantages, returns)``, float32 ``[N, T]``, 0 on masked steps.
  """
  _check_steps(rewards, values, mask)
  for name, x in (("gamma", gamma), ("lam", lam)):
    v = _concrete(x)
    if v is not None and not 0 <= v <= 1:
      raise ValueError(f"{name} must be in [0, 1], got {x}")
  valid = jnp.asarray(mask) != 0
  r, v = _masked(mask, jax.lax.stop_gradient(rewards), jax.lax.stop_gradient(values))
  n = r.shape[0]
  if bootstrap_values is None:
    boot = jnp.zeros((n,), jnp.float32)
  else:
    chex.assert_shape(bootstrap_values, (n,))
    boot = jax.lax.stop_gradient(jnp.asarray(bootstrap_values, jnp.float32))
  gamma = jnp.asarray(gamma, jnp.float32)
  lam = jnp.asarray(lam, jnp.float32)

  def body(carry, step):
    v_next, a_next = carry
    r_t, v_t, m_t = step
    a_t = r_t + gamma * v_next - v_t + gamma * lam * a_next
    a_t = jnp.where(m_t, a_t, 0.0)
    carry = (jnp.where(m_t, v_t, v_next), jnp.where(m_t, a_t, a_next))
    return carry, a_t

  init = (boot, jnp.zeros((n,), jnp.float32))
  _, adv = jax.lax.scan(body, init, (r.T, v.T, valid.T), reverse=True)
  adv = adv.T
  returns = jnp.where(valid, adv + v, 0.0)
  return GAEAdvantages(jax.lax.stop_gradient(adv), jax.lax.stop_gradient(returns))


# ---------------------------------------------------------------------------
# The clipped value loss.
# ---------------------------------------------------------------------------


def clipped_value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    *,
    clip_range: float | Array | None = None,
    aggregation: str = "token_mean",
    max_len: int | None = None,
) -> tuple[WeightedMetric, Metrics]:
  """PPO's (optionally clipped) value loss, as a ``(sum, denominator)`` pair and additive metrics.

  Per step::

    V_clip = V_old + clip(V - V_old, -c, c)
    l      = 0.5 * max((V - R)^2, (V_clip - R)^2)        (clip_range = c)
    l      = 0.5 * (V - R)^2                             (clip_range = None)

  then aggregated with ``aggregation`` (:data:`lemon_rl.losses.AGGREGATIONS`; ``token_mean`` is the mean over
  all valid steps of the batch). The clipped side is chosen only where it is strictly larger, so on a tie the
  unclipped gradient is kept; where it is chosen, ``V_clip`` is constant in ``V`` and the step gives no
  gradient (the critic may not move further than ``c`` from ``V_old`` in the direction that helps).
  Cross-device reduction is the caller's (``ops.reduce_metrics`` and a ``psum`` of the pair), as for the
  policy losses.

  Args:
    values: ``[N, T]`` current ``V(s_t)`` (differentiated).
    old_values: ``[N, T]`` the values of the critic that produced ``returns`` (no gradient).
    returns: ``[N, T]`` value targets, e.g. :func:`gae`'s ``returns`` (no gradient).
    mask: ``[N, T]`` 1 on valid steps. Masked entries of the three arrays may hold anything (even NaN).
    clip_range: ``c > 0``, or ``None`` for the unclipped loss. May be traced.
    aggregation: a name in ``AGGREGATIONS``. Static.
    max_len: the constant of ``seq_mean_token_sum_norm``. Static.

  Returns:
    ``(loss, metrics)``: ``loss`` a :class:`~lemon_rl.ops.WeightedMetric`; ``metrics`` step means over the
    mask (no gradient): ``value_clip_frac`` (share of steps where the clipped side is strictly larger; 0
    without clipping), ``value_mean``, ``return_mean``, ``return_sq_mean`` (``E[R^2]``), ``residual_mean``
    (``E[R - V]``) and ``residual_sq_mean`` (``E[(R - V)^2]``, the mean squared error); the last four give
    :func:`explained_variance_from_metrics`.
  """
  _check_steps(values, old_values, returns, mask)
  c = _concrete(clip_range)
  if c is not None and not c > 0:
    raise ValueError(f"clip_range must be > 0 (or None), got {clip_range}")
  v, v_old, ret = _masked(mask, values, jax.lax.stop_gradient(old_values), jax.lax.stop_gradient(returns))
  unclipped = jnp.square(v - ret)
  if clip_range is None:
    per_step = 0.5 * unclipped
    clipped_side = jnp.zeros(v.shape, bool)
  else:
    v_clip = v_old + jnp.clip(v - v_old, -clip_range, clip_range)
    clipped = jnp.square(v_clip - ret)
    clipped_side = clipped > unclipped
    per_step = 0.5 * jnp.where(clipped_side, clipped, unclipped)
  loss = pg.aggregate(per_step, mask, aggregation, max_len=max_len)
  v_sg = jax.lax.stop_gradient(v)
  residual = ret - v_sg
  metrics: Metrics = {
      "value_clip_frac": ops.weighted_metric(clipped_side.astype(jnp.float32), mask),
      "value_mean": ops.weighted_metric(v_sg, mask),
      "return_mean": ops.weighted_metric(ret, mask),
      "return_sq_mean": ops.weighted_metric(ret * ret, mask),
      "residual_mean": ops.weighted_metric(residual, mask),
      "residual_sq_mean": ops.weighted_metric(residual * residual, mask),
  }
  return loss, metrics


def explained_variance_from_metrics(metrics: Mapping[str, ops.Metric | Array]) -> Array:
  """``1 - Var(R - V) / Var(R)`` from :func:`clipped_value_loss`'s (combined) metrics.

  Takes the metric pairs (after ``ops.merge_metrics`` / ``ops.reduce_metrics``) or their values
  (``ops.metric_values``). Population variances from the first two moments, ``E[x^2] - E[x]^2``; NaN when
  ``Var(R) = 0`` (undefined, as in Stable-Baselines3 and CleanRL).
  """
  def value(name):
    m = metrics[name]
    return m.value if isinstance(m, WeightedMetric) else jnp.asarray(m, jnp.float32)

  var_r = value("return_sq_mean") - jnp.square(value("return_mean"))
  var_res = value("residual_sq_mean") - jnp.square(value("residual_mean"))
  return jnp.where(var_r > 0, 1.0 - var_res / jnp.where(var_r > 0, var_r, 1.0), jnp.nan)


def explained_variance(values: Array, returns: Array, mask: Array, *, axis_name=None) -> Array:
  """``1 - Var(R - V) / Var(R)`` over the valid steps (population variances); NaN when ``Var(R) = 0``.

  ``[N, T], [N, T], [N, T] -> []``, no gradient. With ``axis_name`` (a mapped axis the rows are split
  over), the variances are those of every device's rows.
  """
  _check_steps(values, returns, mask)
  v, ret = _masked(mask, jax.lax.stop_gradient(values), jax.lax.stop_gradient(returns))
  w = (jnp.asarray(mask) != 0).astype(jnp.float32).reshape(-1)
  zeros = jnp.zeros(w.shape, jnp.int32)
  _, std_r, _ = ops.segment_mean_std(ret.reshape(-1), zeros, 1, weights=w, ddof=0, axis_name=axis_name)
  _, std_res, _ = ops.segment_mean_std((ret - v).reshape(-1), zeros, 1, weights=w, ddof=0,
                                       axis_name=axis_name)
  var_r, var_res = jnp.square(std_r[0]), jnp.square(std_res[0])
  return jnp.where(var_r > 0, 1.0 - var_res / jnp.where(var_r > 0, var_r, 1.0), jnp.nan)


def whiten_advantages(advantages: Array, mask: Array, *, eps: float = DEFAULT_EPS, shift_mean: bool = True,
                      axis_name=None) -> Array:
  """PPO's advantage normalisation over the valid entries of the batch: ``(A - mean) / (std + eps)``.

  The unbiased (N-1) standard deviation, as the library's other estimators use. ``shift_mean=False`` only
  scales (keeps the sign of every advantage). With ``axis_name``, the statistics are those of every
  device's rows. ``[N, T], [N, T] -> [N, T]`` float32, 0 on masked entries, no gradient.
  """
  _check_steps(advantages, mask)
  valid = jnp.asarray(mask) != 0
  (a,) = _masked(mask, jax.lax.stop_gradient(advantages))
  flat = a.reshape(-1)
  mean, std, _ = ops.segment_mean_std(flat, jnp.zeros(flat.shape, jnp.int32), 1,
                                      weights=valid.reshape(-1).astype(jnp.float32), ddof=1,
                                      axis_name=axis_name)
  out = ((a - mean[0]) if shift_mean else a) / (std[0] + eps)
  return jax.lax.stop_gradient(jnp.where(valid, out, 0.0))


# ---------------------------------------------------------------------------
# Per-token arrays of a multi-turn batch <-> per-turn steps.
# ---------------------------------------------------------------------------


class StepValues(NamedTuple):
  """The result of :func:`token_values_to_steps`.

  Attributes:
    values: ``[N, K]`` float32 ``V(s_t)`` per turn ``t`` (0 where ``mask`` is 0); differentiable.
    mask: ``[N, K]`` float32, 1 for turns with at least one action token in the batch.
    position: ``[N, K]`` int32 column of the first action token of each turn (0 where ``mask`` is 0).
  """

  values: Array
  mask: Array
  position: Array


def _check_tokens(loss_mask: Array, turn_index: Array, num_turns: int) -> None:
  _check_steps(loss_mask, turn_index)
  chex.assert_type(turn_index, int)
  if num_turns < 1:
    raise ValueError(f"num_turns must be >= 1, got {num_turns}")
  if not isinstance(turn_index, jax.core.Tracer) and not isinstance(loss_mask, jax.core.Tracer):
    t = np.asarray(turn_index)[np.asarray(loss_mask) != 0]
    if t.size and (t.min() < 0 or t.max() >= num_turns):
      raise ValueError(f"action tokens have turn indices in [{t.min()}, {t.max()}], outside "
                       f"[0, num_turns={num_turns})")


def token_values_to_steps(token_values: Array, loss_mask: Array, turn_index: Array,
                          num_turns: int) -> StepValues:
  """Picks ``V(s_t)`` per turn from per-token values, at the position predicting action ``t``'s first token.

  ``token_values[:, j]``, ``loss_mask[:, j]`` and ``turn_index[:, j]`` are next-token arrays (column ``j``
  predicts ``ids[:, j + 1]``, as :func:`lemon_rl.training.multiturn.episodes_to_batch` returns them). For
  turn ``t`` of row ``n`` the column is ``min{j : loss_mask[n, j] != 0, turn_index[n, j] = t}``: the
  position of the last token before the action (module docstring). A gather, so the gradient flows to
  exactly those positions.

  Args:
    token_values: ``[N, L]`` per-token values (e.g. ``value_from_hidden(hidden)[:, :-1]``).
    loss_mask: ``[N, L]`` 1 on action tokens.
    turn_index: ``[N, L]`` int, the turn of each predicted token.
    num_turns: ``K``, static; turn indices of action tokens must lie in ``[0, K)`` (checked when concrete,
      dropped under ``jit``).

  Returns:
    :class:`StepValues` ``(values [N, K], mask [N, K], position [N, K])``, left-aligned turns as
    :func:`gae` and :func:`clipped_value_loss` take them.
  """
  _check_steps(token_values, loss_mask)
  _check_tokens(loss_mask, turn_index, num_turns)
  n, length = loss_mask.shape
  action = jnp.asarray(loss_mask) != 0
  cols = jnp.where(action, jnp.arange(length, dtype=jnp.int32)[None, :], length)
  turns = jnp.where(action, jnp.asarray(turn_index, jnp.int32), num_turns)  # num_turns: dropped
  rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, length))
  first = jnp.full((n, num_turns), length, jnp.int32).at[rows, turns].min(cols, mode="drop")
  present = first < length
  position = jnp.where(present, first, 0)
  picked = jnp.take_along_axis(token_values, position, axis=1)
  values = jnp.where(present, picked.astype(jnp.float32), 0.0)
  return StepValues(values, present.astype(jnp.float32), position)


def steps_to_tokens(step_values: Array, loss_mask: Array, turn_index: Array) -> Array:
  """Spreads per-turn values onto the action tokens of their turn: ``out[n, j] = x[n, turn_index[n, j]]``.

  ``[N, K], [N, L], [N, L] -> [N, L]`` float32, 0 where ``loss_mask`` is 0 (prompt, observations, padding).
  E.g. :func:`gae`'s per-turn advantages to the per-token advantages of the policy loss.
  """
  chex.assert_rank(step_values, 2)
  _check_tokens(loss_mask, turn_index, step_values.shape[1])
  chex.assert_equal_shape_prefix([step_values, loss_mask], 1)
  action = jnp.asarray(loss_mask) != 0
  idx = jnp.clip(jnp.asarray(turn_index, jnp.int32), 0, step_values.shape[1] - 1)
  out = jnp.take_along_axis(jnp.asarray(step_values, jnp.float32), idx, axis=1)
  return jnp.where(action, out, 0.0)
