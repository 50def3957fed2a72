"""Segment (group) statistics over integer group ids.

Groups are integer ids in ``[0, num_segments)`` (``num_segments`` static), as
``jax.ops.segment_sum`` wants them; every function here is jittable. Optional
``weights`` are *frequency* weights: a member of weight 2 counts as two equal
members, weight 0 removes it (padding rows).

Out-of-range ids are dropped by XLA inside ``jit``; when the ids are concrete
(eager call) they are checked and a ``ValueError`` names the bad value.

Rows split across devices: pass ``axis_name``, the name of the mapped axis
(``jax.pmap``, ``jax.shard_map``, or ``jax.vmap(..., axis_name=...)``) over
which the rows of one batch are split. Ids are then *global* (the same id on
two devices is one segment), every per-segment sum is ``psum``-ed and every
maximum ``pmax``-ed across the axis, and each device gets the statistics of the
whole batch (equal to the single-device ones up to float32 summation order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def check_segment_ids(segment_ids: Array, num_segments: int, name: str = "segment_ids") -> None:
  """Raises ``ValueError`` for non-integer or (when concrete) out-of-range ids."""
  if not isinstance(num_segments, (int, np.integer)) or num_segments < 1:
    raise ValueError(f"num_segments must be a positive Python int (static), got {num_segments!r}")
  segment_ids = jnp.asarray(segment_ids) if not isinstance(segment_ids, jax.core.Tracer) else segment_ids
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer ids, got dtype {segment_ids.dtype}")
  if isinstance(segment_ids, jax.core.Tracer):
    return
  ids = np.asarray(segment_ids)
  if ids.size and (ids.min() < 0 or ids.max() >= num_segments):
    bad = ids[(ids < 0) | (ids >= num_segments)][0]
    raise ValueError(f"{name} holds {bad}, outside [0, {num_segments}) (num_segments={num_segments})")


def _weights(x: Array, weights: Array | None) -> Array:
  if weights is None:
    return jnp.ones(jnp.shape(x), jnp.float32)
  return jnp.asarray(weights, jnp.float32)


def _sum(values: Array, segment_ids: Array, num_segments: int, axis_name) -> Array:
  """``jax.ops.segment_sum``, ``psum``-ed across ``axis_name`` when given."""
  out = jax.ops.segment_sum(values, segment_ids, num_segments)
  return out if axis_name is None else jax.lax.psum(out, axis_name)


def segment_count(segment_ids: Array, num_segments: int, weights: Array | None = None,
                  axis_name=None) -> Array:
  """Number (total weight) of members per segment. ``[N] -> [S]`` (across ``axis_name`` when given)."""
  check_segment_ids(segment_ids, num_segments)
  w = _weights(segment_ids, weights)
  return _sum(w, segment_ids, num_segments, axis_name)


def segment_sum(x: Array, segment_ids: Array, num_segments: int,
                weights: Array | None = None, axis_name=None) -> Array:
  """``sum_{i in s} w_i x_i`` per segment. ``[N] -> [S]``; weight-0 members never contribute."""
  check_segment_ids(segment_ids, num_segments)
  x = jnp.asarray(x, jnp.promote_types(jnp.asarray(x).dtype, jnp.float32))
  w = _weights(x, weights)
  return _sum(jnp.where(w != 0, x, 0) * w, segment_ids, num_segments, axis_name)


def segment_max(x: Array, segment_ids: Array, num_segments: int,
                weights: Array | None = None, empty_value: float = 0.0, axis_name=None) -> Array:
  """Maximum over the members with non-zero weight; ``empty_value`` for empty segments."""
  check_segment_ids(segment_ids, num_segments)
  x = jnp.asarray(x, jnp.promote_types(jnp.asarray(x).dtype, jnp.float32))
  w = _weights(x, weights)
  m = jax.ops.segment_max(jnp.where(w != 0, x, -jnp.inf), segment_ids, num_segments)
  if axis_name is not None:
    m = jax.lax.pmax(m, axis_name)
  return jnp.where(jnp.isneginf(m), jnp.asarray(empty_value, m.dtype), m)


def segment_mean(x: Array, segment_ids: Array, num_segments: int,
                 weights: Array | None = None, axis_name=None) -> Array:
  """Weighted mean per segment (0 for an empty segment). ``[N] -> [S]``.

  Computed as ``shift + sum w (x - shift) / sum w`` with ``shift`` = the
  segment's maximum: a segment whose members are all equal gets *exactly* that
  value (a plain ``sum / n`` can be off by an ulp, which the ``1 / (std + eps)``
  of group normalisation would blow up to ~0.1).
  """
  mean, _, _ = segment_mean_std(x, segment_ids, num_segments, weights=weights, ddof=None,
                                axis_name=axis_name)
  return mean


def segment_std(x: Array, segment_ids: Array, num_segments: int,
                weights: Array | None = None, ddof: int = 1, axis_name=None) -> Array:
  """Standard deviation per segment, unbiased by default (``ddof=1``). ``[N] -> [S]``.

  ``sqrt(sum w (x - mean)^2 / (sum w - ddof))``; 0 when ``sum w <= ddof``
  (e.g. a group of one). Two-pass, so an all-equal segment gets exactly 0.
  """
  _, std, _ = segment_mean_std(x, segment_ids, num_segments, weights=weights, ddof=ddof,
                               axis_name=axis_name)
  return std


def segment_mean_std(x: Array, segment_ids: Array, num_segments: int,
                     weights: Array | None = None, ddof: int | None = 1, axis_name=None
                     ) -> tuple[Array, Array, Array]:
  """``(mean [S], std [S], count [S])`` in one pass over the data (see the two functions above).

  ``ddof=None`` skips the standard deviation (returns zeros). With
  ``axis_name``, the statistics are those of the rows of every device.
  """
  check_segment_ids(segment_ids, num_segments)
  x = jnp.asarray(x, jnp.promote_types(jnp.asarray(x).dtype, jnp.float32))
  w = _weights(x, weights)
  count = _sum(w, segment_ids, num_segments, axis_name)
  shift = segment_max(x, segment_ids, num_segments, weights=w, axis_name=axis_name)
  dev = jnp.where(w != 0, x - shift[segment_ids], 0)
  mean = shift + _divide(_sum(dev * w, segment_ids, num_segments, axis_name), count)
  if ddof is None:
    return mean, jnp.zeros_like(mean), count
  centred = jnp.where(w != 0, x - mean[segment_ids], 0)
  sq = _sum(centred * centred * w, segment_ids, num_segments, axis_name)
  dof = count - ddof
  var = jnp.where(dof > 0, sq / jnp.where(dof > 0, dof, 1), 0)
  return mean, jnp.sqrt(var), count


def _divide(num: Array, den: Array) -> Array:
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0)


def broadcast_to_members(segment_values: Array, segment_ids: Array) -> Array:
  """``segment_values[segment_ids]``: per-segment statistics back to each member. ``[S] -> [N]``."""
  return jnp.asarray(segment_values)[segment_ids]
