"""Advantage estimators over integer group ids (METHODS.md sections 0 and 5).

Outcome estimators share one signature::

    estimator(rewards [B], group_ids [B], num_groups, *, valid=None, axis_name=None, **options)
        -> advantages [B]

``group_ids`` are integers in ``[0, num_groups)`` (one id per prompt, so the
``G`` completions of a prompt share it); ``num_groups`` must be static under
``jax.jit`` (``static_argnames="num_groups"``). ``valid`` ([B] bool/0-1,
optional) marks real rows: padding rows neither count in any statistic nor get
an advantage (0). Everything is computed with segment sums, never Python loops
over groups, and the results carry no gradient.

``axis_name`` (optional): the name of a mapped axis (``jax.pmap``,
``jax.shard_map``, ``jax.vmap(..., axis_name=...)``) over which the rows of the
batch are split, e.g. the members of a group spread over devices. Group ids are
then global, the group statistics (segment sums, counts and maxima, and
REINFORCE++'s batch mean and std) are reduced across the axis
(:mod:`lemon_rl.ops.segments`), and every device gets the advantages of its own
rows as the single-device call on the whole batch would give them (up to
float32 summation order).

:func:`gigpo` has its own, multi-turn signature (documented there); its step
groups are found with ``jnp.unique`` over the local rows, so the trajectories of
a group must stay on one device (``axis_name`` raises). All five live in
:data:`ADVANTAGE_ESTIMATORS`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

from lemon_rl import ops
from lemon_rl.utils.registry import Registry

Array = jax.Array

ADVANTAGE_ESTIMATORS: Registry[Callable[..., Array]] = Registry("advantage estimator")

DEFAULT_EPS = 1e-6


def _outcome_inputs(rewards: Array, group_ids: Array, num_groups: int,
                    valid: Array | None) -> tuple[Array, Array]:
  """Checks the shared inputs; returns ``(rewards float32 [B], weights float32 [B])``."""
  chex.assert_rank([rewards, group_ids], 1)
  chex.assert_equal_shape([rewards, group_ids])
  chex.assert_type(group_ids, int)
  ops.check_segment_ids(group_ids, num_groups, name="group_ids")
  if valid is None:
    weights = jnp.ones(rewards.shape, jnp.float32)
  else:
    chex.assert_equal_shape([rewards, valid])
    weights = (jnp.asarray(valid) != 0).astype(jnp.float32)
  return jnp.asarray(rewards, jnp.float32), weights


def _group_normalise(x: Array, group_ids: Array, num_groups: int, weights: Array, *,
                     scale_by_std: bool, eps: float, axis_name=None) -> Array:
  """``(x - mean_g) / (std_g + eps)`` (unbiased std) or ``x - mean_g``; 0 for weight-0 rows."""
  mean, std, _ = ops.segment_mean_std(x, group_ids, num_groups, weights=weights, ddof=1,
                                      axis_name=axis_name)
  dev = x - mean[group_ids]
  if scale_by_std:
    dev = dev / (std[group_ids] + eps)
  return jnp.where(weights > 0, dev, 0.0)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: Array, group_ids: Array, num_groups: int, *, eps: float = DEFAULT_EPS,
         scale_by_std: bool = True, valid: Array | None = None, axis_name=None) -> Array:
  """GRPO group-relative advantage ``A_i = (r_i - mean_g r) / (std_g r + eps)``.

  ``std_g`` is the unbiased (N-1) group standard deviation and ``eps = 1e-6``,
  as TRL, verl and tunix compute it. A group of one gets 0; a group whose
  rewards are all equal gets exactly 0 (the group mean is computed relative to
  a member, see :func:`lemon_rl.ops.segment_mean`).

  Args:
    rewards: ``[B]`` float.
    group_ids: ``[B]`` int in ``[0, num_groups)``.
    num_groups: static number of groups.
    eps: added to the std.
    scale_by_std: ``False`` gives Dr.GRPO (:func:`dr_grpo`).
    valid: optional ``[B]`` mask of real rows.
    axis_name: optional mapped axis the rows are split over (module docstring).

  Returns:
    ``[B]`` float32 advantages.
  """
  r, w = _outcome_inputs(rewards, group_ids, num_groups, valid)
  return jax.lax.stop_gradient(
      _group_normalise(r, group_ids, num_groups, w, scale_by_std=scale_by_std, eps=eps,
                       axis_name=axis_name))


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: Array, group_ids: Array, num_groups: int, *,
            valid: Array | None = None, axis_name=None) -> Array:
  """Dr.GRPO (Liu et al. 2025): ``A_i = r_i - mean_g r`` (no std normalisation). ``[B] -> [B]``."""
  return grpo(rewards, group_ids, num_groups, scale_by_std=False, valid=valid, axis_name=axis_name)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: Array, group_ids: Array, num_groups: int, *,
         valid: Array | None = None, axis_name=None) -> Array:
  """RLOO: ``A_i = r_i - (sum_g r - r_i) / (G - 1)``, the leave-one-out baseline.

  Equal to ``G / (G - 1) * (r_i - mean_g r)``. A group of one (no other member
  to form a baseline) gets 0. ``[B] -> [B]``.
  """
  r, w = _outcome_inputs(rewards, group_ids, num_groups, valid)
  count = ops.segment_count(group_ids, num_groups, weights=w, axis_name=axis_name)
  # Deviations from a member of the group keep all-equal groups exactly at 0.
  shift = ops.segment_max(r, group_ids, num_groups, weights=w, axis_name=axis_name)
  dev = jnp.where(w > 0, r - shift[group_ids], 0.0)
  dev_sum = ops.segment_sum(dev, group_ids, num_groups, weights=w, axis_name=axis_name)[group_ids]
  n = count[group_ids]
  others = jnp.where(n > 1, (dev_sum - dev) / jnp.where(n > 1, n - 1, 1), 0.0)
  adv = jnp.where((w > 0) & (n > 1), dev - others, 0.0)
  return jax.lax.stop_gradient(adv)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: Array, group_ids: Array, num_groups: int, *,
                          eps: float = DEFAULT_EPS, valid: Array | None = None,
                          batch_weights: Array | None = None, axis_name=None) -> Array:
  """REINFORCE++-baseline (Hu et al. 2025): group mean baseline, then batch normalisation.

    a_i = r_i - mean_g r;   A_i = (a_i - mean_batch a) / (std_batch a + eps)

  with the unbiased batch std over the valid rows. A group of one has
  ``a_i = 0`` but still gets shifted by the batch mean.

  Args:
    rewards, group_ids, num_groups, valid: see the module docstring.
    eps: added to the batch std.
    batch_weights: optional ``[B]`` frequency weights of the *batch* statistics.
      ``None`` counts every sequence once (*Decision*); pass the completion
      lengths to reproduce verl's token-level whitening, where a sequence
      counts once per token.
    axis_name: optional mapped axis the rows are split over; the group and the
      batch statistics are then those of every device's rows.

  Returns:
    ``[B]`` float32 advantages.
  """
  r, w = _outcome_inputs(rewards, group_ids, num_groups, valid)
  a = _group_normalise(r, group_ids, num_groups, w, scale_by_std=False, eps=eps, axis_name=axis_name)
  bw = w
  if batch_weights is not None:
    chex.assert_equal_shape([rewards, batch_weights])
    bw = w * jnp.asarray(batch_weights, jnp.float32)
  zeros = jnp.zeros(a.shape, jnp.int32)
  mean, std, _ = ops.segment_mean_std(a, zeros, 1, weights=bw, ddof=1, axis_name=axis_name)
  adv = (a - mean[0]) / (std[0] + eps)
  return jax.lax.stop_gradient(jnp.where(w > 0, adv, 0.0))


# ---------------------------------------------------------------------------
# GiGPO (Feng et al. 2025, verl-agent semantics), METHODS.md section 5.
# ---------------------------------------------------------------------------

EPISODE_STATS = ("trajectory", "step_row")


class GiGPOAdvantages(NamedTuple):
  """The result of :func:`gigpo` (every field carries no gradient).

  Attributes:
    advantages: ``[N, T]`` ``A = A_E + omega * A_S`` per step, 0 on masked steps.
    episode: ``[N]`` episode (trajectory) advantage ``A_E``.
    step: ``[N, T]`` step advantage ``A_S`` (0 on masked steps and singletons).
    step_returns: ``[N, T]`` discounted step returns.
    step_group_ids: ``[N, T]`` compact step-group ids (arbitrary on masked steps).
    step_group_size: ``[N, T]`` size of each step's step group (0 on masked steps).
  """

  advantages: Array
  episode: Array
  step: Array
  step_returns: Array
  step_group_ids: Array
  step_group_size: Array


def step_discounted_returns(step_rewards: Array, step_mask: Array, gamma: float) -> Array:
  """``G[n, t] = sum_{k >= t} gamma^(k - t) m[n, k] r[n, k]`` by a reverse scan over ``T``.

  ``[N, T], [N, T] -> [N, T]``; 0 on masked steps.
  """
  chex.assert_rank([step_rewards, step_mask], 2)
  chex.assert_equal_shape([step_rewards, step_mask])
  m = jnp.asarray(step_mask) != 0
  r = jnp.where(m, jnp.asarray(step_rewards, jnp.float32), 0.0)

  def body(carry, r_t):
    g = r_t + gamma * carry
    return g, g

  _, g = jax.lax.scan(body, jnp.zeros(r.shape[:1], jnp.float32), r.T, reverse=True)
  return jnp.where(m, g.T, 0.0)


@ADVANTAGE_ESTIMATORS.register("gigpo")
def gigpo(
    episode_rewards: Array,
    step_rewards: Array,
    step_mask: Array,
    anchor_ids: Array,
    group_ids: Array,
    num_groups: int,
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    eps: float = DEFAULT_EPS,
    scale_by_std: bool = True,
    episode_stats: str = "trajectory",
    valid: Array | None = None,
    axis_name=None,
) -> GiGPOAdvantages:
  """GiGPO: episode-level plus anchor-state step-level group advantages.

  Layout: ``N`` trajectories (rows), each of up to ``T`` steps (turns), left
  aligned; ``step_mask[n, t]`` marks the steps that happened. The trainer maps
  ``advantages[n, t]`` onto the tokens of step ``t``'s action.

  - Episode advantage over the trajectories of a group (prompt):
    ``A_E[n] = (R_n - mean_g R) / F_norm`` with ``F_norm = std_g R + eps``
    (unbiased) or 1 (``scale_by_std=False``, verl-agent's ``mean_norm``).
    *Decision*: each trajectory counts once (``episode_stats="trajectory"``,
    the paper's equation); ``"step_row"`` counts it once per valid step, as
    verl-agent's default ``compute_mean_std_cross_all_data`` does. A group of
    one gets 0 (verl-agent would keep the raw reward).
  - Step groups: the steps of one group whose anchor ids are equal, across all
    trajectories and time steps of that group (the same anchor id in two groups
    makes two step groups). Step return
    ``G[n, t] = sum_{k >= t} gamma^(k - t) r[n, k]``;
    ``A_S[n, t] = (G - mean_sg G) / F_norm``; singleton step groups get 0.
  - ``A[n, t] = A_E[n] + omega * A_S[n, t]`` on valid steps, 0 elsewhere.

  For BudgetMix, fold the remaining budget into the anchor id (anchor key
  ``(s_t, B - t)``).

  Args:
    episode_rewards: ``[N]`` float, the trajectory's outcome reward ``R``.
    step_rewards: ``[N, T]`` float, the immediate reward of each step.
    step_mask: ``[N, T]`` 0/1, 1 on the steps that happened.
    anchor_ids: ``[N, T]`` int, an id of the anchor state (e.g. an index into
      the table of distinct observations); only equality matters.
    group_ids: ``[N]`` int in ``[0, num_groups)``, the group (prompt/task) of
      each trajectory.
    num_groups: static number of groups.
    gamma: step-return discount (0.95).
    omega: weight of the step advantage (1.0).
    eps: added to the std.
    scale_by_std: ``F_norm`` = std (True) or 1 (False).
    episode_stats: ``"trajectory"`` or ``"step_row"`` (see above).
    valid: optional ``[N]`` mask of real trajectories.
    axis_name: not supported (must be ``None``): step groups are found with
      ``jnp.unique`` over the local rows, so every group's trajectories must
      stay on one device. Shard whole groups and call :func:`gigpo` per device.

  Returns:
    A :class:`GiGPOAdvantages`.

  Raises:
    ValueError: ``axis_name`` is set, or ``episode_stats`` is unknown.
  """
  if axis_name is not None:
    raise ValueError(f"gigpo does not take axis_name (got {axis_name!r}): its step groups are found over "
                     "the local rows, so the trajectories of a group must stay on one device; shard whole "
                     "groups and call gigpo on each device without axis_name")
  if episode_stats not in EPISODE_STATS:
    raise ValueError(f"episode_stats must be one of {EPISODE_STATS}, got {episode_stats!r}")
  chex.assert_rank([episode_rewards, group_ids], 1)
  chex.assert_rank([step_rewards, step_mask, anchor_ids], 2)
  chex.assert_equal_shape([step_rewards, step_mask, anchor_ids])
  chex.assert_equal_shape_prefix([episode_rewards, group_ids, step_rewards], 1)
  chex.assert_type([group_ids, anchor_ids], int)
  ops.check_segment_ids(group_ids, num_groups, name="group_ids")
  n, t = step_rewards.shape
  traj_w = jnp.ones((n,), jnp.float32) if valid is None else (jnp.asarray(valid) != 0).astype(jnp.float32)
  if valid is not None:
    chex.assert_equal_shape([episode_rewards, valid])
  step_w = (jnp.asarray(step_mask) != 0).astype(jnp.float32) * traj_w[:, None]

  # Episode advantage.
  ep_w = traj_w if episode_stats == "trajectory" else jnp.sum(step_w, axis=1)
  ep_adv = _group_normalise(jnp.asarray(episode_rewards, jnp.float32), group_ids, num_groups,
                            ep_w, scale_by_std=scale_by_std, eps=eps)
  ep_adv = jnp.where(traj_w > 0, ep_adv, 0.0)

  # Step groups = distinct (group id, anchor id) pairs among the valid steps.
  returns = step_discounted_returns(step_rewards, step_w, gamma)
  keys = jnp.stack([jnp.broadcast_to(group_ids[:, None], (n, t)).reshape(-1),
                    jnp.asarray(anchor_ids).reshape(-1)], axis=-1).astype(jnp.int32)
  keys = jnp.where(step_w.reshape(-1, 1) > 0, keys, -1)
  _, inverse = jnp.unique(keys, axis=0, size=n * t, fill_value=-1, return_inverse=True)
  sg_ids = inverse.reshape(-1)
  flat_w = step_w.reshape(-1)
  step_adv = _group_normalise(returns.reshape(-1), sg_ids, n * t, flat_w,
                              scale_by_std=scale_by_std, eps=eps).reshape(n, t)
  sizes = ops.segment_count(sg_ids, n * t, weights=flat_w)[sg_ids].reshape(n, t) * step_w

  adv = jnp.where(step_w > 0, ep_adv[:, None] + omega * step_adv, 0.0)
  return jax.tree.map(jax.lax.stop_gradient, GiGPOAdvantages(
      advantages=adv, episode=ep_adv, step=step_adv, step_returns=returns,
      step_group_ids=sg_ids.reshape(n, t), step_group_size=sizes))
