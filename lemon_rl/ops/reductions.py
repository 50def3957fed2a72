"""Masked reductions and additive metrics.

Every loss in lemon_rl returns an unreduced ``(sum, denominator)`` pair, a
:class:`WeightedMetric`. Pairs add element-wise, so summing them over
micro-batches, gradient-accumulation steps or devices and dividing once at the
end gives exactly the value of the full batch.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def _as_weights(mask: Array, dtype) -> Array:
  """A 0/1 (or fractional) mask as weights of ``dtype``."""
  return jnp.asarray(mask).astype(dtype)


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
  """``sum(x * mask)`` over ``axis``; masked-out entries never contribute.

  Entries where ``mask == 0`` are replaced by 0 before the product, so a NaN or
  inf in a padded position (e.g. the log-prob of a padding token) cannot leak
  into the sum.

  Args:
    x: values, any shape.
    mask: same shape as ``x`` (bool, 0/1 or fractional weights).
    axis: axes to reduce (``None``: all).

  Returns:
    The masked sum, float32 (or ``x``'s float dtype if wider).
  """
  x = jnp.asarray(x)
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  w = _as_weights(mask, dtype)
  x = jnp.where(w != 0, x.astype(dtype), 0)
  return jnp.sum(x * w, axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
  """``sum(x * mask) / sum(mask)`` over ``axis``; 0 where the mask is empty."""
  total = masked_sum(x, mask, axis=axis)
  count = masked_sum(jnp.ones_like(total, shape=jnp.shape(x)), mask, axis=axis)
  return safe_divide(total, count)


def safe_divide(numerator: Array, denominator: Array) -> Array:
  """``numerator / denominator`` where ``denominator > 0``, else 0 (gradient-safe)."""
  positive = denominator > 0
  return jnp.where(positive, numerator / jnp.where(positive, denominator, 1), 0)


class WeightedMetric(NamedTuple):
  """An unreduced mean: ``value = sum / denominator``.

  A pytree (NamedTuple), so it passes through ``jax.jit``, ``jax.lax.scan`` and
  ``jax.tree.map``. ``a + b`` adds sums and denominators (NOT tuple
  concatenation), which is the right way to combine micro-batches or devices.
  ``value`` is 0 when the denominator is 0.
  """

  sum: Array
  denominator: Array

  @property
  def value(self) -> Array:
    return safe_divide(self.sum, self.denominator)

  def __add__(self, other: "WeightedMetric") -> "WeightedMetric":  # pytype: disable=signature-mismatch
    if not isinstance(other, WeightedMetric):
      return NotImplemented
    return WeightedMetric(self.sum + other.sum, self.denominator + other.denominator)

  def scale(self, coef) -> "WeightedMetric":
    """``coef * value`` as a pair (scales the sum, keeps the denominator)."""
    return WeightedMetric(coef * self.sum, self.denominator)

  @classmethod
  def zero(cls) -> "WeightedMetric":
    return cls(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))


class MinMetric(NamedTuple):
  """A running minimum; ``a + b`` is ``min(a, b)``. Empty = ``+inf``."""

  min: Array

  @property
  def value(self) -> Array:
    return self.min

  def __add__(self, other: "MinMetric") -> "MinMetric":  # pytype: disable=signature-mismatch
    if not isinstance(other, MinMetric):
      return NotImplemented
    return MinMetric(jnp.minimum(self.min, other.min))


class MaxMetric(NamedTuple):
  """A running maximum; ``a + b`` is ``max(a, b)``. Empty = ``-inf``."""

  max: Array

  @property
  def value(self) -> Array:
    return self.max

  def __add__(self, other: "MaxMetric") -> "MaxMetric":  # pytype: disable=signature-mismatch
    if not isinstance(other, MaxMetric):
      return NotImplemented
    return MaxMetric(jnp.maximum(self.max, other.max))


Metric = WeightedMetric | MinMetric | MaxMetric


def weighted_metric(x: Array, mask: Array) -> WeightedMetric:
  """The masked mean of ``x`` as an unreduced pair ``(sum(x m), sum(m))``."""
  x = jnp.asarray(x)
  return WeightedMetric(masked_sum(x, mask), masked_sum(jnp.ones(x.shape, jnp.float32), mask))


def masked_min(x: Array, mask: Array) -> MinMetric:
  """Minimum of ``x`` over entries with ``mask != 0`` (``+inf`` if none)."""
  x = jnp.asarray(x, jnp.promote_types(jnp.asarray(x).dtype, jnp.float32))
  return MinMetric(jnp.min(jnp.where(jnp.asarray(mask) != 0, x, jnp.inf)))


def masked_max(x: Array, mask: Array) -> MaxMetric:
  """Maximum of ``x`` over entries with ``mask != 0`` (``-inf`` if none)."""
  x = jnp.asarray(x, jnp.promote_types(jnp.asarray(x).dtype, jnp.float32))
  return MaxMetric(jnp.max(jnp.where(jnp.asarray(mask) != 0, x, -jnp.inf)))


def merge_metrics(a: Mapping[str, Metric], b: Mapping[str, Metric]) -> dict[str, Metric]:
  """Combines two metric dicts key by key with each metric's own ``+``."""
  if set(a) != set(b):
    raise ValueError(f"metric dicts have different keys: {sorted(set(a) ^ set(b))}")
  return {k: a[k] + b[k] for k in a}


def reduce_metric(metric: Metric, axis_name) -> Metric:
  """One metric combined across the named mapped axis ``axis_name`` (``pmap``, ``shard_map``, ``vmap``).

  :class:`WeightedMetric`: ``psum`` of the sum and of the denominator; :class:`MinMetric`: ``pmin``;
  :class:`MaxMetric`: ``pmax`` (a ``psum`` would add the extrema). Every device gets the result.
  """
  if isinstance(metric, WeightedMetric):
    return WeightedMetric(*jax.lax.psum((metric.sum, metric.denominator), axis_name))
  if isinstance(metric, MinMetric):
    return MinMetric(jax.lax.pmin(metric.min, axis_name))
  if isinstance(metric, MaxMetric):
    return MaxMetric(jax.lax.pmax(metric.max, axis_name))
  raise TypeError(f"not a metric (WeightedMetric, MinMetric or MaxMetric): {type(metric).__name__}")


def reduce_metrics(metrics: Mapping[str, Metric], axis_name) -> dict[str, Metric]:
  """A metrics dict combined across the named mapped axis, each metric by its own rule (:func:`reduce_metric`).

  The cross-device counterpart of :func:`merge_metrics`: inside ``jax.pmap(..., axis_name="i")`` or
  ``jax.shard_map``, ``reduce_metrics(metrics, "i")`` gives every device the metrics of the whole batch.
  """
  return {k: reduce_metric(m, axis_name) for k, m in metrics.items()}


def metric_values(metrics: Mapping[str, Metric]) -> dict[str, Array]:
  """``{name: metric.value}``."""
  return {k: m.value for k, m in metrics.items()}


def sum_of_means(terms: Sequence[WeightedMetric], coefs: Sequence[float],
                 denominators: Sequence[Array] | None = None) -> Array:
  """``sum_k coef_k * sum_k / den_k``: a total loss made of means with different denominators.

  With the whole batch, leave ``denominators`` as ``None`` (each term's own
  denominator is used). Under micro-batching pass the *global* denominators
  (they depend on masks only, never on parameters, so they can be computed
  before the backward pass); then the per-micro-batch values and gradients add
  up exactly to the full-batch ones.
  """
  if len(terms) != len(coefs):
    raise ValueError(f"{len(terms)} terms but {len(coefs)} coefficients")
  if denominators is None:
    denominators = [t.denominator for t in terms]
  if len(denominators) != len(terms):
    raise ValueError(f"{len(terms)} terms but {len(denominators)} denominators")
  total = jnp.zeros((), jnp.float32)
  for term, coef, den in zip(terms, coefs, denominators):
    total = total + coef * safe_divide(term.sum, jnp.asarray(den, jnp.float32))
  return total
