"""Tests of lemon_rl.ops: masked reductions, metrics, segment statistics, log-probs."""

import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from lemon_rl import ops


class MaskedReductionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_masked_sum_and_mean_by_hand(self):
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = jnp.array([[1, 1, 0], [0, 1, 1]])
    # total 1 + 2 + 5 + 6 = 14 over 4 tokens; rows 3/2 and 11/2.
    chex.assert_trees_all_close(self.variant(ops.masked_sum)(x, m), 14.0)
    chex.assert_trees_all_close(self.variant(ops.masked_mean)(x, m), 3.5)
    row_mean = self.variant(lambda a, b: ops.masked_mean(a, b, axis=-1))(x, m)
    chex.assert_trees_all_close(row_mean, jnp.array([1.5, 5.5]))

  @chex.variants(with_jit=True, without_jit=True)
  def test_masked_positions_do_not_leak_nan_or_inf(self):
    x = jnp.array([[1.0, jnp.nan, -jnp.inf]])
    m = jnp.array([[True, False, False]])
    self.assertEqual(float(self.variant(ops.masked_sum)(x, m)), 1.0)
    self.assertEqual(float(self.variant(ops.masked_mean)(x, m)), 1.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_empty_mask_mean_is_zero(self):
    x = jnp.ones((2, 3))
    m = jnp.zeros((2, 3))
    self.assertEqual(float(self.variant(ops.masked_mean)(x, m)), 0.0)
    row = self.variant(lambda a, b: ops.masked_mean(a, b, axis=-1))(x, m.at[1, 0].set(1))
    chex.assert_trees_all_equal(row, jnp.array([0.0, 1.0]))

  def test_fractional_mask_weights(self):
    x = jnp.array([2.0, 4.0])
    m = jnp.array([0.5, 1.0])
    # (1 + 4) / 1.5
    np.testing.assert_allclose(ops.masked_mean(x, m), 5.0 / 1.5, rtol=1e-6)


class MetricTest(chex.TestCase):

  def test_weighted_metric_add_and_value(self):
    a = ops.WeightedMetric(jnp.float32(3.0), jnp.float32(2.0))
    b = ops.WeightedMetric(jnp.float32(1.0), jnp.float32(2.0))
    c = a + b
    self.assertIsInstance(c, ops.WeightedMetric)
    self.assertEqual(float(c.sum), 4.0)
    self.assertEqual(float(c.denominator), 4.0)
    self.assertEqual(float(c.value), 1.0)  # not the mean of the values (1.5 and 0.5 -> 1.0 here too)
    d = ops.WeightedMetric(jnp.float32(3.0), jnp.float32(1.0)) + b  # 4 / 3, not (3 + 0.5) / 2
    np.testing.assert_allclose(d.value, 4.0 / 3.0, rtol=1e-6)
    self.assertEqual(float(ops.WeightedMetric.zero().value), 0.0)
    np.testing.assert_allclose(a.scale(2.0).value, 3.0)

  def test_weighted_metric_is_a_pytree_through_jit(self):
    f = jax.jit(lambda x, m: ops.weighted_metric(x, m) + ops.weighted_metric(2 * x, m))
    out = f(jnp.array([1.0, 2.0, 3.0]), jnp.array([1.0, 1.0, 0.0]))
    self.assertIsInstance(out, ops.WeightedMetric)
    np.testing.assert_allclose(out.sum, 9.0)
    np.testing.assert_allclose(out.denominator, 4.0)
    self.assertLen(jax.tree.leaves(out), 2)

  def test_min_max_metrics(self):
    x = jnp.array([3.0, -1.0, 7.0])
    m = jnp.array([1, 1, 0])
    self.assertEqual(float(ops.masked_min(x, m).value), -1.0)
    self.assertEqual(float(ops.masked_max(x, m).value), 3.0)
    self.assertEqual(float((ops.masked_max(x, m) + ops.MaxMetric(jnp.float32(5.0))).value), 5.0)
    self.assertEqual(float((ops.masked_min(x, m) + ops.MinMetric(jnp.float32(-4.0))).value), -4.0)
    self.assertEqual(float(ops.masked_min(x, jnp.zeros(3)).value), np.inf)

  def test_merge_metrics(self):
    a = {"m": ops.WeightedMetric(jnp.float32(1.0), jnp.float32(1.0)), "x": ops.MaxMetric(jnp.float32(2.0))}
    b = {"m": ops.WeightedMetric(jnp.float32(3.0), jnp.float32(3.0)), "x": ops.MaxMetric(jnp.float32(1.0))}
    merged = ops.merge_metrics(a, b)
    self.assertEqual({k: float(v) for k, v in ops.metric_values(merged).items()}, {"m": 1.0, "x": 2.0})
    with self.assertRaisesRegex(ValueError, "different keys"):
      ops.merge_metrics(a, {"m": b["m"]})

  def test_sum_of_means(self):
    t1 = ops.WeightedMetric(jnp.float32(6.0), jnp.float32(3.0))  # mean 2
    t2 = ops.WeightedMetric(jnp.float32(1.0), jnp.float32(4.0))  # mean 0.25
    np.testing.assert_allclose(ops.sum_of_means([t1, t2], [0.5, 1.0]), 0.5 * 2 + 0.25)
    # Two micro-batch halves with the global denominators add up to the whole.
    h1 = [ops.WeightedMetric(jnp.float32(4.0), jnp.float32(2.0)), ops.WeightedMetric(jnp.float32(1.0), jnp.float32(1.0))]
    h2 = [ops.WeightedMetric(jnp.float32(2.0), jnp.float32(1.0)), ops.WeightedMetric(jnp.float32(0.0), jnp.float32(3.0))]
    parts = sum(float(ops.sum_of_means(h, [0.5, 1.0], [3.0, 4.0])) for h in (h1, h2))
    np.testing.assert_allclose(parts, 1.25, rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "coefficients"):
      ops.sum_of_means([t1], [1.0, 2.0])


def _device_metrics(x, m):
  """The metrics of one device's slice: a weighted mean, a min and a max."""
  return {"mean": ops.weighted_metric(x, m), "min": ops.masked_min(x, m), "max": ops.masked_max(x, m)}


# Four "devices" of three values each; device 3's values are all masked (its min/max are +-inf).
X4 = np.array([[1.0, -2.0, 5.0], [3.0, 4.0, -7.0], [0.5, 9.0, 2.0], [-100.0, 100.0, 3.0]], np.float32)
M4 = np.array([[1, 1, 1], [1, 1, 0], [0, 1, 1], [0, 0, 0]], np.float32)


class ReduceMetricsTest(chex.TestCase):
  """``ops.reduce_metrics``: psum for WeightedMetric, pmin / pmax for MinMetric / MaxMetric."""

  def check(self, reduced):
    valid = X4[M4 != 0]  # 1, -2, 5, 3, 4, 9, 2
    np.testing.assert_allclose(reduced["mean"].sum, valid.sum(), rtol=1e-6)
    np.testing.assert_allclose(reduced["mean"].denominator, 7.0)
    self.assertEqual(float(reduced["min"].value), -2.0)  # a psum would give -2 + 3 + 2 + inf
    self.assertEqual(float(reduced["max"].value), 9.0)
    self.assertIsInstance(reduced["min"], ops.MinMetric)
    self.assertIsInstance(reduced["max"], ops.MaxMetric)

  def test_under_vmap_with_an_axis_name(self):
    out = jax.vmap(lambda x, m: ops.reduce_metrics(_device_metrics(x, m), "dev"), axis_name="dev")(X4, M4)
    for d in range(4):  # every device gets the whole batch's metrics
      self.check(jax.tree.map(lambda leaf, d=d: leaf[d], out))
    # The same as merging the per-device dicts one by one.
    merged = functools.reduce(ops.merge_metrics, [_device_metrics(X4[d], M4[d]) for d in range(4)])
    self.check(merged)

  def test_under_pmap(self):
    # pmap over every local device (one under pytest; tests/test_loss_transforms.py runs 4 fake devices).
    # Device 0 holds the four slices, the others fully masked copies that must add nothing.
    n = jax.local_device_count()

    def per_device(x, m):
      local = functools.reduce(ops.merge_metrics, [_device_metrics(x[d], m[d]) for d in range(4)])
      return ops.reduce_metrics(local, "i")

    out = jax.pmap(per_device, axis_name="i")(np.stack([X4] * n), np.stack([M4] + [0 * M4] * (n - 1)))
    for d in range(n):
      self.check(jax.tree.map(lambda leaf, d=d: leaf[d], out))

  def test_single_metric_and_errors(self):
    out = jax.vmap(lambda v: ops.reduce_metric(ops.MinMetric(v), "d"), axis_name="d")(jnp.array([3.0, 1.0]))
    np.testing.assert_array_equal(out.min, [1.0, 1.0])
    with self.assertRaisesRegex(TypeError, "not a metric"):
      jax.vmap(lambda v: ops.reduce_metric(v, "d"), axis_name="d")(jnp.ones(2))


def _np_group_stats(x, ids, n, ddof=1):
  mean = np.zeros(n)
  std = np.zeros(n)
  count = np.zeros(n)
  for g in range(n):
    xs = x[ids == g]
    count[g] = len(xs)
    if len(xs):
      mean[g] = xs.mean()
    if len(xs) > ddof:
      std[g] = xs.std(ddof=ddof)
  return mean, std, count


class SegmentTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_by_hand(self):
    x = jnp.array([1.0, 3.0, 10.0, 2.0, 4.0])
    ids = jnp.array([0, 0, 1, 2, 2])
    f = self.variant(lambda a, b: ops.segment_mean_std(a, b, 4))
    mean, std, count = f(x, ids)
    # group 0 {1, 3}: mean 2, unbiased var ((1)^2 + (1)^2) / 1 = 2; group 1 {10}: std 0;
    # group 2 {2, 4}: mean 3, std sqrt(2); group 3 empty: 0, 0, count 0.
    chex.assert_trees_all_close(mean, jnp.array([2.0, 10.0, 3.0, 0.0]))
    chex.assert_trees_all_close(std, jnp.array([np.sqrt(2), 0.0, np.sqrt(2), 0.0]), rtol=1e-6)
    chex.assert_trees_all_equal(count, jnp.array([2.0, 1.0, 2.0, 0.0]))
    chex.assert_trees_all_equal(self.variant(lambda b: ops.segment_count(b, 4))(ids), count)
    chex.assert_trees_all_close(ops.segment_sum(x, ids, 4), jnp.array([4.0, 10.0, 6.0, 0.0]))
    chex.assert_trees_all_close(ops.broadcast_to_members(mean, ids), jnp.array([2.0, 2.0, 10.0, 3.0, 3.0]))

  def test_against_numpy_random(self):
    rng = np.random.default_rng(0)
    x = rng.normal(size=200).astype(np.float32)
    ids = rng.integers(0, 17, size=200)
    mean, std, count = _np_group_stats(x.astype(np.float64), ids, 20)
    np.testing.assert_allclose(ops.segment_mean(x, ids, 20), mean, atol=1e-6)
    np.testing.assert_allclose(ops.segment_std(x, ids, 20), std, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.segment_std(x, ids, 20, ddof=0), _np_group_stats(x, ids, 20, 0)[1],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ops.segment_count(ids, 20), count)

  def test_all_equal_groups_are_exact(self):
    # A plain sum / n of seven 0.1f is not 0.1f; the shifted mean is.
    x = jnp.array([0.1] * 7 + [0.3] * 3 + [1e8 + 1.0] * 5, jnp.float32)
    ids = jnp.array([0] * 7 + [1] * 3 + [2] * 5)
    mean, std, _ = ops.segment_mean_std(x, ids, 3)
    chex.assert_trees_all_equal(x - mean[ids], jnp.zeros_like(x))
    chex.assert_trees_all_equal(std, jnp.zeros(3))

  def test_frequency_weights_equal_duplicates(self):
    x = jnp.array([1.0, 2.0, 5.0])
    ids = jnp.array([0, 0, 0])
    w = jnp.array([2.0, 0.0, 1.0])
    dup = jnp.array([1.0, 1.0, 5.0])
    np.testing.assert_allclose(ops.segment_mean(x, ids, 1, weights=w), ops.segment_mean(dup, ids, 1))
    np.testing.assert_allclose(ops.segment_std(x, ids, 1, weights=w), ops.segment_std(dup, ids, 1), rtol=1e-6)
    np.testing.assert_allclose(ops.segment_std(dup, ids, 1), np.std([1, 1, 5], ddof=1), rtol=1e-6)
    self.assertEqual(float(ops.segment_max(x, ids, 1, weights=w)[0]), 5.0)

  @parameterized.parameters(2, 4)
  def test_rows_split_over_an_axis(self, devices):
    rng = np.random.default_rng(3)
    x = rng.normal(size=24).astype(np.float32)
    ids = rng.integers(0, 5, size=24).astype(np.int32)
    w = rng.integers(0, 3, size=24).astype(np.float32)

    def stats(x, ids, w, axis_name=None):
      return (ops.segment_mean_std(x, ids, 6, weights=w, axis_name=axis_name),
              ops.segment_sum(x, ids, 6, weights=w, axis_name=axis_name),
              ops.segment_count(ids, 6, weights=w, axis_name=axis_name),
              ops.segment_max(x, ids, 6, weights=w, axis_name=axis_name, empty_value=-1.0))

    whole = stats(x, ids, w)
    split = jax.vmap(functools.partial(stats, axis_name="dev"), axis_name="dev")(
        *(a.reshape(devices, -1) for a in (x, ids, w)))
    # Only the order of the float32 additions differs: two orders of a sum of n terms differ by at most
    # n * eps * sum|terms| <= n^2 * eps * max|w x| (each is within (n - 1) eps / 2 sum|terms| of the exact
    # sum); means and stds are such sums divided by counts (exact), the std through a square root that
    # halves relative errors, and their squares are <= (2 max|x|)^2, hence the square below.
    n = x.size
    tol = n * n * np.finfo(np.float32).eps * (w.max() * np.abs(x).max()) ** 2
    for d in range(devices):
      chex.assert_trees_all_close(jax.tree.map(lambda leaf, d=d: leaf[d], split), whole, atol=tol)
    # Counts and maxima are exact in any order.
    np.testing.assert_array_equal(split[2][0], whole[2])
    np.testing.assert_array_equal(split[3][0], whole[3])
    self.assertEqual(float(whole[3][5]), -1.0)  # segment 5 is empty

  def test_bad_ids(self):
    with self.assertRaisesRegex(ValueError, "outside"):
      ops.segment_mean(jnp.ones(3), jnp.array([0, 3, 1]), 3)
    with self.assertRaisesRegex(ValueError, "integer"):
      ops.segment_mean(jnp.ones(3), jnp.array([0.0, 1.0, 1.0]), 3)
    with self.assertRaisesRegex(ValueError, "num_segments"):
      ops.segment_mean(jnp.ones(3), jnp.array([0, 1, 1]), 0)


class LogitsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_log_probs_by_hand(self):
    # logits [0, log 3] -> softmax [1/4, 3/4].
    logits = jnp.array([[[0.0, np.log(3.0)], [0.0, np.log(3.0)]]], jnp.float32)
    targets = jnp.array([[0, 1]])
    out = self.variant(ops.token_log_probs)(logits, targets)
    chex.assert_trees_all_close(out, jnp.log(jnp.array([[0.25, 0.75]])), rtol=1e-6)

  @parameterized.parameters(1.0, 0.7)
  def test_token_log_probs_against_scipy(self, temperature):
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(3, 5, 11)) * 4).astype(np.float32)
    targets = rng.integers(0, 11, size=(3, 5))
    expected = np.take_along_axis(special.log_softmax(logits.astype(np.float64) / temperature, axis=-1),
                                  targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(ops.token_log_probs(logits, targets, temperature), expected, atol=1e-5)

  def test_token_log_probs_stable_for_huge_logits(self):
    logits = jnp.array([[[1e4, 1e4 - 1.0, -1e4]]], jnp.float32)
    out = ops.token_log_probs(logits, jnp.array([[1]]))
    # A naive log(sum(exp)) overflows to inf/nan; float32's ulp at 1e4 is ~1e-3, hence atol.
    np.testing.assert_allclose(out, [[-1.0 - np.log1p(np.exp(-1.0))]], atol=2e-3)
    self.assertTrue(np.isfinite(ops.token_log_probs(logits.astype(jnp.bfloat16), jnp.array([[0]]))).all())

  def test_token_log_probs_checks_shapes(self):
    with self.assertRaises(AssertionError):
      ops.token_log_probs(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32))
    with self.assertRaises(AssertionError):
      ops.token_log_probs(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3)))  # float targets
    with self.assertRaisesRegex(ValueError, "temperature"):
      ops.token_log_probs(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), jnp.int32), 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_entropy(self):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    p = special.softmax(logits.astype(np.float64), -1)
    expected = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(self.variant(ops.entropy_from_logits)(logits), expected, rtol=1e-5)
    # Uniform over 4 -> log 4; a -inf logit contributes nothing (no NaN).
    uniform = jnp.zeros((1, 1, 4))
    np.testing.assert_allclose(self.variant(ops.entropy_from_logits)(uniform), [[np.log(4.0)]], rtol=1e-6)
    masked = jnp.array([[[0.0, 0.0, -jnp.inf]]])
    np.testing.assert_allclose(self.variant(ops.entropy_from_logits)(masked), [[np.log(2.0)]], rtol=1e-6)


if __name__ == "__main__":
  pytest.main([__file__])
