"""Tests of lemon_rl.losses.policy_gradient (aggregation, KL, clipped surrogates), the surrogate settings
(lemon_rl.losses.surrogate) and the registry.

The by-hand tests run under ``chex.variants`` (eager, ``jax.jit`` and ``jax.pmap``; under pytest there is
one CPU device, so the pmap variant maps over one device: it checks that the losses trace under pmap,
while tests/test_loss_transforms.py splits batches over 4 fake devices).
"""

import functools

from absl.testing import parameterized
import chex
import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lemon_rl import losses
from lemon_rl import ops
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.losses import surrogate
from lemon_rl.utils.registry import Registry
from lemon_rl.utils.registry import UnknownNameError

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


pytestmark = pytest.mark.usefixtures("pmap_variant_on_one_device")

# ---------------------------------------------------------------------------------------------------
# Independent NumPy transcriptions of METHODS.md section 0 (float64).
# ---------------------------------------------------------------------------------------------------


def np_aggregate(x, mask, mode, max_len=None):
  x = np.where(mask != 0, x, 0.0) * mask
  tokens = mask.sum(-1)
  nonempty = (tokens > 0).sum()
  if mode == "token_mean":
    return x.sum() / mask.sum()
  if mode == "seq_mean_token_mean":
    per_seq = [x[i].sum() / tokens[i] for i in range(len(x)) if tokens[i] > 0]
    return np.sum(per_seq) / nonempty
  if mode == "seq_mean_token_sum":
    return x.sum() / nonempty
  if mode == "seq_mean_token_sum_norm":
    return (x.sum(-1) / (max_len or x.shape[-1])).sum() / nonempty
  raise ValueError(mode)


def np_kl(logp, ref, name):
  if name == "k1":
    return logp - ref
  if name == "k2":
    return 0.5 * (logp - ref) ** 2
  return np.exp(ref - logp) - (ref - logp) - 1.0


def np_surrogate_per_token(logp, old, adv, mask, eps_low, eps_high, dual_clip=None,
                           ratio_level="token", sampler=None, cap=None):
  logp, old = logp.astype(np.float64), old.astype(np.float64)
  a = np.broadcast_to(adv[:, None], logp.shape) if adv.ndim == 1 else adv
  if ratio_level == "token":
    rho = np.exp(logp - old)
  else:
    rho = np.zeros_like(logp)
    for i in range(len(logp)):
      sel = mask[i] != 0
      s = np.exp(np.mean((logp[i] - old[i])[sel])) if sel.any() else 1.0
      rho[i] = s
  loss = -np.minimum(rho * a, np.clip(rho, 1 - eps_low, 1 + eps_high) * a)
  if dual_clip is not None:
    loss = np.where(a < 0, np.minimum(loss, -dual_clip * a), loss)
  if sampler is not None:
    w = np.exp(old - sampler)
    if cap is not None:
      w = np.minimum(w, cap)
    loss = loss * w
  return loss, rho


def random_batch(seed, b=4, t=6, seq_adv=True):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
  old = (logp + rng.normal(scale=0.3, size=(b, t))).astype(np.float32)
  adv = rng.normal(size=(b,) if seq_adv else (b, t)).astype(np.float32)
  mask = (rng.uniform(size=(b, t)) < 0.7).astype(np.float32)
  mask[0] = 0.0  # an all-padding row
  mask[1, 0] = 1.0
  return logp, old, adv, mask


# ---------------------------------------------------------------------------------------------------
# Aggregation.
# ---------------------------------------------------------------------------------------------------


class AggregationTest(chex.TestCase):

  X = jnp.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 6.0, 7.0, 8.0]])
  M = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], jnp.float32)  # row 2 is padding

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.named_parameters(
      # valid tokens: row 0 {1, 2, 3} (sum 6, mean 2), row 1 {4} (sum 4, mean 4), row 2 none.
      ("token_mean", "token_mean", None, 10.0, 4.0),  # (1 + 2 + 3 + 4) / 4 = 2.5
      ("seq_mean_token_mean", "seq_mean_token_mean", None, 6.0, 2.0),  # (2 + 4) / 2 = 3
      ("seq_mean_token_sum", "seq_mean_token_sum", None, 10.0, 2.0),  # (6 + 4) / 2 = 5
      ("seq_mean_token_sum_norm", "seq_mean_token_sum_norm", 5, 2.0, 2.0),  # (6/5 + 4/5) / 2 = 1
      ("seq_mean_token_sum_norm_default_T", "seq_mean_token_sum_norm", None, 2.5, 2.0),  # T = 4
  )
  def test_by_hand(self, mode, max_len, expected_sum, expected_den):
    f = self.variant(functools.partial(pg.aggregate, mode=mode, max_len=max_len))
    out = f(self.X, self.M)
    self.assertIsInstance(out, ops.WeightedMetric)
    np.testing.assert_allclose(out.sum, expected_sum, rtol=1e-6)
    np.testing.assert_allclose(out.denominator, expected_den)

  @parameterized.parameters(*AGG_MODES)
  def test_against_numpy(self, mode):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 7)).astype(np.float32)
    m = (rng.uniform(size=(5, 7)) < 0.6).astype(np.float32)
    m[2] = 0
    m[3, 1] = 1
    np.testing.assert_allclose(pg.aggregate(x, m, mode, max_len=9).value,
                               np_aggregate(x.astype(np.float64), m, mode, 9), rtol=1e-5)

  @parameterized.parameters(*AGG_MODES)
  def test_halves_add_up(self, mode):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(6, 5)).astype(np.float32)
    m = (rng.uniform(size=(6, 5)) < 0.6).astype(np.float32)
    m[4] = 0
    whole = pg.aggregate(x, m, mode)
    parts = pg.aggregate(x[:3], m[:3], mode) + pg.aggregate(x[3:], m[3:], mode)
    np.testing.assert_allclose(parts.value, whole.value, rtol=1e-6)

  def test_registry(self):
    self.assertEqual(losses.AGGREGATIONS.names(), AGG_MODES)
    with self.assertRaisesRegex(KeyError, "token_mean, seq_mean_token_mean"):
      pg.aggregate(self.X, self.M, "seq_mean")

  def test_bad_shapes(self):
    with self.assertRaises(AssertionError):
      pg.token_mean(self.X, self.M[:, :3])
    with self.assertRaises(AssertionError):
      pg.token_mean(self.X[0], self.M[0])
    with self.assertRaisesRegex(ValueError, "max_len"):
      pg.seq_mean_token_sum_norm(self.X, self.M, max_len=0)


# ---------------------------------------------------------------------------------------------------
# KL estimators.
# ---------------------------------------------------------------------------------------------------


class KLTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_by_hand(self):
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-2.0, -1.0]])
    # d = logp - ref = [1, -1]; k1 = d; k2 = d^2 / 2; k3 = exp(-d) + d - 1 = [e^-1, e - 2].
    chex.assert_trees_all_close(self.variant(pg.kl_k1)(logp, ref), jnp.array([[1.0, -1.0]]))
    chex.assert_trees_all_close(self.variant(pg.kl_k2)(logp, ref), jnp.array([[0.5, 0.5]]))
    chex.assert_trees_all_close(self.variant(pg.kl_k3)(logp, ref),
                                jnp.array([[np.exp(-1.0), np.e - 2.0]]), rtol=1e-6)

  @parameterized.parameters("k1", "k2", "k3")
  def test_against_numpy_and_penalty(self, name):
    logp, ref, _, mask = random_batch(5)
    est = losses.KL_ESTIMATORS.get(name)(logp, ref)
    np.testing.assert_allclose(est, np_kl(logp.astype(np.float64), ref, name), rtol=1e-5, atol=1e-6)
    out = pg.kl_penalty(logp, ref, mask, estimator=name, aggregation="seq_mean_token_mean")
    np.testing.assert_allclose(out.value, np_aggregate(np_kl(logp.astype(np.float64), ref, name), mask,
                                                       "seq_mean_token_mean"), rtol=1e-5)

  def test_k3_nonnegative_and_second_order(self):
    d = jnp.linspace(-3, 3, 61)[None]
    self.assertTrue(bool(jnp.all(pg.kl_k3(d, jnp.zeros_like(d)) >= 0)))
    small = jnp.array([[1e-3]])
    np.testing.assert_allclose(pg.kl_k3(small, jnp.zeros_like(small)),
                               pg.kl_k2(small, jnp.zeros_like(small)), rtol=1e-2)

  def test_estimators_of_true_kl(self):
    # E_{x~pi}[k1] = E[k3] = KL(pi || ref) for samples from pi (categorical, 3 outcomes).
    pi = np.array([0.6, 0.3, 0.1])
    ref = np.array([0.2, 0.5, 0.3])
    true_kl = np.sum(pi * np.log(pi / ref))
    x = np.arange(3)
    lp, lr = np.log(pi[x])[None], np.log(ref[x])[None]
    for name in ("k1", "k3"):
      expectation = np.sum(pi * np.asarray(losses.KL_ESTIMATORS.get(name)(jnp.array(lp), jnp.array(lr)))[0])
      np.testing.assert_allclose(expectation, true_kl, rtol=1e-5)

  def test_registry(self):
    self.assertEqual(losses.KL_ESTIMATORS.names(), ("k1", "k2", "k3"))
    with self.assertRaisesRegex(ValueError, "unknown KL estimator 'low_var'; registered: k1, k2, k3"):
      pg.kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), estimator="low_var")


# ---------------------------------------------------------------------------------------------------
# Clipped surrogate.
# ---------------------------------------------------------------------------------------------------


class SurrogateTest(chex.TestCase):
  # Two sequences of two tokens; ratios rho = exp(logp - old) = [[1.5, 0.5], [1.1, 0.7]], A = [+1, -1].
  OLD = jnp.zeros((2, 2))
  LOGP = jnp.log(jnp.array([[1.5, 0.5], [1.1, 0.7]]))
  ADV = jnp.array([1.0, -1.0])
  MASK = jnp.ones((2, 2))

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_token_level_by_hand(self):
    f = self.variant(functools.partial(pg.clipped_surrogate_loss, eps_low=0.2))
    loss, metrics = f(self.LOGP, self.OLD, self.ADV, self.MASK)
    # A=+1: max(-1.5, -1.2) = -1.2 (clipped high), max(-0.5, -0.8) = -0.5;
    # A=-1: max(1.1, 1.1) = 1.1, max(0.7, 0.8) = 0.8 (clipped low). Token mean 0.2 / 4 = 0.05.
    np.testing.assert_allclose(loss.sum, 0.2, atol=1e-6)
    np.testing.assert_allclose(loss.denominator, 4.0)
    values = ops.metric_values(metrics)
    np.testing.assert_allclose(values["clip_frac_high"], 0.25)
    np.testing.assert_allclose(values["clip_frac_low"], 0.25)
    np.testing.assert_allclose(values["clip_frac"], 0.5)
    np.testing.assert_allclose(values["ratio_mean"], 0.95, rtol=1e-6)
    np.testing.assert_allclose(values["ratio_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(values["ratio_max"], 1.5, rtol=1e-6)
    # approx_kl = mean k3(pi_old | pi) = mean(1/rho - 1 + log rho).
    rho = np.array([1.5, 0.5, 1.1, 0.7])
    np.testing.assert_allclose(values["approx_kl"], np.mean(1 / rho - 1 + np.log(rho)), rtol=1e-5)

  def test_token_level_gradient_by_hand(self):
    grad = jax.grad(lambda lp: pg.clipped_surrogate_loss(lp, self.OLD, self.ADV, self.MASK)[0].value)
    # d l / d logp = -A rho where the unclipped branch is active, else 0; then / 4 tokens.
    expected = np.array([[0.0, -0.5], [1.1, 0.0]]) / 4
    np.testing.assert_allclose(grad(self.LOGP), expected, atol=1e-6)

  def test_asymmetric_clip(self):
    loss, metrics = pg.clipped_surrogate_loss(self.LOGP, self.OLD, self.ADV, self.MASK,
                                              eps_low=0.2, eps_high=0.28)
    # Only the first token changes: -1.28 instead of -1.2 -> (-1.28 - 0.5 + 1.1 + 0.8) / 4 = 0.03.
    np.testing.assert_allclose(loss.value, 0.03, atol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac_high"].value, 0.25)

  def test_dual_clip(self):
    logp = jnp.log(jnp.array([[4.0, 2.0]]))
    adv = jnp.array([-1.0])
    loss, metrics = pg.clipped_surrogate_loss(logp, jnp.zeros((1, 2)), adv, jnp.ones((1, 2)), dual_clip=3.0)
    # A=-1: max(rho, clip(rho)) = rho = [4, 2]; bounded by -c A = 3 -> [3, 2]; mean 2.5.
    np.testing.assert_allclose(loss.value, 2.5, rtol=1e-6)
    np.testing.assert_allclose(metrics["dual_clip_frac"].value, 0.5)
    grad = jax.grad(lambda lp: pg.clipped_surrogate_loss(lp, jnp.zeros((1, 2)), adv, jnp.ones((1, 2)),
                                                         dual_clip=3.0)[0].value)(logp)
    np.testing.assert_allclose(grad, [[0.0, 1.0]], rtol=1e-6)  # bounded token has no gradient
    # For A > 0 the dual clip changes nothing.
    pos = pg.clipped_surrogate_loss(logp, jnp.zeros((1, 2)), -adv, jnp.ones((1, 2)), dual_clip=3.0)[0]
    np.testing.assert_allclose(pos.value, -1.2, rtol=1e-6)

  def test_truncated_importance_sampling(self):
    logp = jnp.zeros((1, 2))
    old = jnp.zeros((1, 2))
    sampler = jnp.log(jnp.array([[1.0 / 3.0, 2.0]]))  # exp(old - sampler) = [3, 0.5]
    loss, metrics = pg.clipped_surrogate_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)),
                                              sampler_logp=sampler, tis_cap=2.0)
    # l = -1 per token; weights min([3, 0.5], 2) = [2, 0.5] -> mean(-2, -0.5) = -1.25.
    np.testing.assert_allclose(loss.value, -1.25, rtol=1e-6)
    np.testing.assert_allclose(metrics["tis_weight_mean"].value, 1.25, rtol=1e-6)
    np.testing.assert_allclose(metrics["tis_clip_frac"].value, 0.5)
    untruncated = pg.clipped_surrogate_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)), sampler_logp=sampler)[0]
    np.testing.assert_allclose(untruncated.value, -1.75, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_gspo_by_hand(self):
    f = self.variant(functools.partial(pg.clipped_surrogate_loss, ratio_level="sequence", eps_low=0.2,
                                       aggregation="seq_mean_token_mean"))
    loss, metrics = f(self.LOGP, self.OLD, self.ADV, self.MASK)
    s = np.sqrt([1.5 * 0.5, 1.1 * 0.7])  # geometric means 0.8660, 0.8775, both inside [0.8, 1.2]
    np.testing.assert_allclose(loss.value, (-s[0] + s[1]) / 2, rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_min"].value, s[0], rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"].value, s[1], rtol=1e-5)

  def test_gspo_gradient_is_the_sequence_objective(self):
    logp, old, adv, mask = random_batch(6)
    mask[0, 0] = 1.0
    logp, old, adv, mask = map(jnp.asarray, (logp, old, adv, mask))

    def sequence_objective(lp):  # GSPO paper: mean_i -min(s_i A_i, clip(s_i) A_i)
      s = jnp.exp(jnp.sum((lp - old) * mask, -1) / jnp.sum(mask, -1))
      return jnp.mean(-jnp.minimum(s * adv, jnp.clip(s, 1 - 0.2, 1 + 0.25) * adv))

    ours = lambda lp: pg.clipped_surrogate_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.25,
                                                ratio_level="sequence",
                                                aggregation="seq_mean_token_mean")[0].value
    np.testing.assert_allclose(ours(logp), sequence_objective(logp), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(logp), jax.grad(sequence_objective)(logp), atol=1e-6)
    # The registered "gspo" loss is the same function with GSPO defaults.
    np.testing.assert_allclose(losses.POLICY_LOSSES.get("gspo")(logp, old, adv, mask, eps_low=0.2,
                                                                eps_high=0.25)[0].value,
                               sequence_objective(logp), rtol=1e-5)

  @parameterized.product(
      mode=AGG_MODES,
      ratio_level=("token", "sequence"),
      options=({}, {"dual_clip": 2.0}, {"tis": 1.5}, {"eps_high": 0.3}),
      seq_adv=(True, False),
  )
  def test_against_numpy(self, mode, ratio_level, options, seq_adv):
    logp, old, adv, mask = random_batch(7, seq_adv=seq_adv)
    logp = (old + 3 * (logp - old)).astype(np.float32)  # wider ratios so that clipping happens
    sampler = (old + np.random.default_rng(8).normal(scale=0.5, size=old.shape)).astype(np.float32)
    eps_high = options.get("eps_high", 0.2)
    use_tis = "tis" in options
    loss, metrics = pg.clipped_surrogate_loss(
        logp, old, adv, mask, eps_low=0.2, eps_high=eps_high, dual_clip=options.get("dual_clip"),
        ratio_level=ratio_level, sampler_logp=sampler if use_tis else None, tis_cap=options.get("tis"),
        aggregation=mode, max_len=8)
    per_token, rho = np_surrogate_per_token(
        logp, old, adv, mask, 0.2, eps_high, options.get("dual_clip"), ratio_level,
        sampler.astype(np.float64) if use_tis else None, options.get("tis"))
    np.testing.assert_allclose(loss.value, np_aggregate(per_token, mask, mode, 8), rtol=1e-5, atol=1e-6)
    a = np.broadcast_to(adv[:, None], logp.shape) if adv.ndim == 1 else adv
    sel = mask != 0
    np.testing.assert_allclose(metrics["ratio_mean"].value, rho[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_frac_high"].value, ((a > 0) & (rho > 1 + eps_high))[sel].mean(),
                               atol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac_low"].value, ((a < 0) & (rho < 0.8))[sel].mean(), atol=1e-6)

  def test_sequence_and_token_advantages_agree(self):
    logp, old, adv, mask = random_batch(9)
    a = pg.clipped_surrogate_loss(logp, old, adv, mask)[0]
    b = pg.clipped_surrogate_loss(logp, old, np.repeat(adv[:, None], logp.shape[1], 1), mask)[0]
    chex.assert_trees_all_close(a, b)

  def test_padding_with_inf_log_probs_is_harmless(self):
    logp = jnp.array([[-1.0, -jnp.inf]])
    old = jnp.array([[-1.2, -jnp.inf]])
    mask = jnp.array([[1.0, 0.0]])
    for level in ("token", "sequence"):
      f = lambda lp: pg.clipped_surrogate_loss(lp, old, jnp.array([1.0]), mask, ratio_level=level)[0].value
      self.assertTrue(np.isfinite(f(logp)))
      self.assertTrue(np.isfinite(np.asarray(jax.grad(f)(logp))).all())

  def test_option_errors(self):
    args = (self.LOGP, self.OLD, self.ADV, self.MASK)
    with self.assertRaisesRegex(ValueError, "ratio_level"):
      pg.clipped_surrogate_loss(*args, ratio_level="seq")
    with self.assertRaisesRegex(ValueError, "dual_clip"):
      pg.clipped_surrogate_loss(*args, dual_clip=0.5)
    with self.assertRaisesRegex(ValueError, "sampler_logp"):
      pg.clipped_surrogate_loss(*args, tis_cap=2.0)
    with self.assertRaisesRegex(ValueError, "eps_low"):
      pg.clipped_surrogate_loss(*args, eps_low=1.5)
    with self.assertRaises(AssertionError):  # advantages of the wrong length
      pg.clipped_surrogate_loss(self.LOGP, self.OLD, jnp.ones(3), self.MASK)
    with self.assertRaises(AssertionError):  # integer log-probs
      pg.clipped_surrogate_loss(self.LOGP.astype(jnp.int32), self.OLD, self.ADV, self.MASK)


class GRPOLossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_total_is_pg_plus_kl_minus_entropy(self):
    logp, old, adv, mask = random_batch(10)
    ref = (logp - 0.2).astype(np.float32)
    ent = np.abs(logp).astype(np.float32)
    f = self.variant(functools.partial(pg.grpo_loss, kl_coef=0.1, entropy_coef=0.01,
                                       aggregation="seq_mean_token_mean", eps_high=0.28))
    total, metrics = f(logp, old, adv, mask, ref_logp=ref, entropy=ent)
    expected_pg = np_aggregate(np_surrogate_per_token(logp, old, adv, mask, 0.2, 0.28)[0], mask,
                               "seq_mean_token_mean")
    expected_kl = np_aggregate(np_kl(logp.astype(np.float64), ref, "k3"), mask, "seq_mean_token_mean")
    expected_ent = np_aggregate(ent.astype(np.float64), mask, "seq_mean_token_mean")
    np.testing.assert_allclose(metrics["pg_loss"].value, expected_pg, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl"].value, expected_kl, rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy"].value, expected_ent, rtol=1e-5)
    np.testing.assert_allclose(total.value, expected_pg + 0.1 * expected_kl - 0.01 * expected_ent, rtol=1e-5)
    self.assertEqual(float(total.denominator), float(metrics["pg_loss"].denominator))

  def test_kl_gradient_flows_only_through_logp(self):
    logp, old, adv, mask = random_batch(11)
    ref = logp - 0.3
    g = jax.grad(lambda lp, r: pg.grpo_loss(lp, old, jnp.zeros_like(adv), mask, ref_logp=r,
                                            kl_coef=1.0)[0].value, argnums=(0, 1))(logp, ref)
    # d k3 / d logp = 1 - exp(ref - logp), / number of tokens.
    expected = np.where(mask != 0, 1 - np.exp(ref - logp), 0) / mask.sum()
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(g[1], np.zeros_like(ref))

  def test_errors(self):
    logp, old, adv, mask = random_batch(12)
    with self.assertRaisesRegex(ValueError, "ref_logp"):
      pg.grpo_loss(logp, old, adv, mask, kl_coef=0.1)
    with self.assertRaisesRegex(ValueError, "entropy"):
      pg.grpo_loss(logp, old, adv, mask, entropy_coef=0.1)
    with self.assertRaisesRegex(KeyError, "registered: ppo_clip, gspo"):
      pg.grpo_loss(logp, old, adv, mask, policy_loss="ppo")


# ---------------------------------------------------------------------------------------------------
# Extreme log-probs: bounded ratios, no NaN from masked -inf (METHODS.md section 0, LOG_RATIO_CLAMP).
# ---------------------------------------------------------------------------------------------------

# Every surrogate option: clip ranges, dual clip, GSPO (no dual clip), TIS with and without a cap.
SURROGATE_OPTIONS = {
    "symmetric": dict(eps_low=0.2),
    "asymmetric": dict(eps_low=0.2, eps_high=0.28),
    "dual_clip": dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0),
    "tis_cap": dict(eps_low=0.2, tis_cap=2.0, tis=True),
    "tis_uncapped": dict(eps_low=0.2, tis=True),
    "dual_clip_tis": dict(eps_low=0.2, dual_clip=2.0, tis_cap=5.0, tis=True),
    "gspo": dict(policy_loss="gspo"),
    "gspo_tis": dict(policy_loss="gspo", tis_cap=2.0, tis=True),
    "gspo_tis_uncapped": dict(policy_loss="gspo", eps_low=0.2, tis=True),
}
B_X, T_X = 3, 4
# Anything may sit at a masked position; -inf (a padding token's log-prob) is drawn most often.
MASKED_VALUES = st.sampled_from([-np.inf, -np.inf, -np.inf, np.inf, np.nan, -1e30, 0.0])


@st.composite
def extreme_batch(draw, bound):
  """``(logp, old, sampler, ref, adv, mask)``: finite values in ``[-bound, bound]`` (``None``: every finite
  float32) where valid, arbitrary (mostly -inf) where masked; at least one valid token."""
  finite = st.floats(-bound if bound else None, bound, width=32, allow_nan=False, allow_infinity=False)
  extreme = st.one_of(finite, st.sampled_from([-100.0, 100.0, -1e4, 0.0, -1e-30]))
  mask = draw(hnp.arrays(np.float32, (B_X, T_X), elements=st.sampled_from([0.0, 1.0])))
  mask[draw(st.integers(0, B_X - 1)), draw(st.integers(0, T_X - 1))] = 1.0
  arrays = []
  for _ in range(4):
    x = draw(hnp.arrays(np.float32, (B_X, T_X), elements=extreme))
    pad = draw(hnp.arrays(np.float32, (B_X, T_X), elements=MASKED_VALUES))
    arrays.append(np.where(mask != 0, x, pad).astype(np.float32))
  adv = draw(hnp.arrays(np.float32, (B_X,), elements=st.floats(-100, 100, width=32)))
  return (*arrays, adv, mask)


def _assert_finite_loss_and_grad(loss_fn, logp):
  value, grad = jax.value_and_grad(lambda lp: loss_fn(lp)[0].value)(jnp.asarray(logp))
  assert np.isfinite(float(value)), value
  assert np.isfinite(np.asarray(grad)).all(), grad
  _, metrics = loss_fn(jnp.asarray(logp))
  for name, metric in metrics.items():
    if isinstance(metric, ops.WeightedMetric):  # ratio_min / ratio_max are +-inf on an empty mask by design
      assert np.isfinite(float(metric.sum)) and np.isfinite(float(metric.denominator)), (name, metric)


class ExtremeLogProbTest(chex.TestCase):

  def test_log_ratio_of_100_is_bounded(self):
    # Regression: exp(100) = inf made the loss inf, and with dual_clip the gradient [nan, 0.5].
    logp = jnp.array([[100.0, 0.0]])
    old, mask, adv = jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.array([-1.0])
    loss = pg.clipped_surrogate_loss(logp, old, adv, mask)[0]
    # A = -1: per-token loss max(rho, clip(rho)) = rho; rho = e^LOG_RATIO_CLAMP and 1.
    np.testing.assert_allclose(loss.value, (np.exp(pg.LOG_RATIO_CLAMP) + 1) / 2, rtol=1e-6)
    self.assertEqual(pg.LOG_RATIO_CLAMP, 20.0)
    f = lambda lp: pg.clipped_surrogate_loss(lp, old, adv, mask, dual_clip=3.0)[0].value
    np.testing.assert_allclose(f(logp), (3.0 + 1.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp), [[0.0, 0.5]], rtol=1e-6)
    # The sequence ratio and the TIS weight are clamped the same way.
    gspo = pg.gspo_loss(logp, old, adv, mask, eps_low=0.2)[0]
    np.testing.assert_allclose(gspo.value, np.exp(pg.LOG_RATIO_CLAMP / 2), rtol=1e-5)  # exp(mean(20, 0))
    tis = pg.clipped_surrogate_loss(jnp.zeros((1, 2)), old, jnp.array([1.0]), mask,
                                    sampler_logp=jnp.array([[-100.0, 0.0]]))
    np.testing.assert_allclose(tis[1]["tis_weight_mean"].value, (np.exp(pg.LOG_RATIO_CLAMP) + 1) / 2, rtol=1e-6)

  def test_masked_inf_in_any_input_gives_no_nan(self):
    # Regression: -inf at a masked position of logp with a finite ref_logp made k3's gradient NaN.
    logp = jnp.array([[-1.0, -jnp.inf]])
    finite = jnp.array([[-1.2, -0.5]])
    mask = jnp.array([[1.0, 0.0]])
    f = lambda lp: pg.grpo_loss(lp, finite, jnp.array([1.0]), mask, ref_logp=finite, kl_coef=0.1,
                                sampler_logp=finite, tis_cap=2.0)[0].value
    self.assertTrue(np.isfinite(f(logp)))
    np.testing.assert_array_equal(np.isfinite(jax.grad(f)(logp)), [[True, True]])

  @hypothesis.settings(max_examples=40, deadline=None, database=None, derandomize=True)
  @hypothesis.given(batch=extreme_batch(bound=None), option=st.sampled_from(sorted(SURROGATE_OPTIONS)),
                    aggregation=st.sampled_from(AGG_MODES))
  def test_surrogate_finite_for_any_finite_log_probs(self, batch, option, aggregation):
    logp, old, sampler, _, adv, mask = batch
    kwargs = dict(SURROGATE_OPTIONS[option])
    policy_loss = kwargs.pop("policy_loss", "ppo_clip")
    if kwargs.pop("tis", False):
      kwargs["sampler_logp"] = jnp.asarray(sampler)
    loss_fn = functools.partial(losses.POLICY_LOSSES.get(policy_loss), old_logp=jnp.asarray(old),
                                advantages=jnp.asarray(adv), mask=jnp.asarray(mask), aggregation=aggregation,
                                **kwargs)
    _assert_finite_loss_and_grad(loss_fn, logp)

  @hypothesis.settings(max_examples=40, deadline=None, database=None, derandomize=True)
  @hypothesis.given(batch=extreme_batch(bound=2.0**50), option=st.sampled_from(sorted(SURROGATE_OPTIONS)),
                    aggregation=st.sampled_from(AGG_MODES), estimator=st.sampled_from(("k1", "k2", "k3")))
  def test_grpo_loss_finite_with_kl_and_entropy(self, batch, option, aggregation, estimator):
    # |log-probs| <= 2^50 keeps k1 and k2 = (2^51)^2 / 2 inside float32; k3's exponent is clamped.
    logp, old, sampler, ref, adv, mask = batch
    kwargs = dict(SURROGATE_OPTIONS[option])
    if kwargs.pop("tis", False):
      kwargs["sampler_logp"] = jnp.asarray(sampler)
    entropy = jnp.abs(jnp.nan_to_num(jnp.asarray(ref), posinf=0.0, neginf=0.0)) * 1e-10
    loss_fn = functools.partial(pg.grpo_loss, old_logp=jnp.asarray(old), advantages=jnp.asarray(adv),
                                mask=jnp.asarray(mask), ref_logp=jnp.asarray(ref), kl_coef=0.1,
                                kl_estimator=estimator, entropy=entropy, entropy_coef=0.01,
                                aggregation=aggregation, **kwargs)
    _assert_finite_loss_and_grad(loss_fn, logp)


# ---------------------------------------------------------------------------------------------------
# Each policy loss's own defaults; SurrogateSettings and the rl config.
# ---------------------------------------------------------------------------------------------------


def rl_config(**overrides):
  from lemon_rl.training.base_config import get_base_config  # pylint: disable=g-import-not-at-top
  cfg = get_base_config().rl
  for k, v in overrides.items():
    cfg[k] = v
  return cfg


class PolicyLossDefaultsTest(parameterized.TestCase):

  def test_every_policy_loss_has_defaults(self):
    self.assertEqual(tuple(losses.POLICY_LOSS_DEFAULTS), losses.POLICY_LOSSES.names())
    self.assertEqual(losses.POLICY_LOSS_DEFAULTS["ppo_clip"],
                     losses.PolicyLossDefaults(0.2, 0.2, "token_mean"))
    self.assertEqual(losses.POLICY_LOSS_DEFAULTS["gspo"],
                     losses.PolicyLossDefaults(3e-4, 4e-4, "seq_mean_token_mean", takes_dual_clip=False))

  def test_resolution_rules(self):
    r = losses.resolve_surrogate_options
    self.assertEqual(r("ppo_clip"), (0.2, 0.2, "token_mean"))
    self.assertEqual(r("gspo"), (3e-4, 4e-4, "seq_mean_token_mean"))
    self.assertEqual(r("ppo_clip", eps_low=0.3), (0.3, 0.3, "token_mean"))  # eps_low alone: symmetric
    self.assertEqual(r("gspo", eps_high=1e-3), (3e-4, 1e-3, "seq_mean_token_mean"))
    self.assertEqual(r("gspo", eps_low=0.2, aggregation="token_mean"), (0.2, 0.2, "token_mean"))
    with self.assertRaisesRegex(KeyError, "registered: ppo_clip, gspo"):
      r("ppo")
    with self.assertRaisesRegex(KeyError, "unknown aggregation mode"):
      r("ppo_clip", aggregation="mean")

  def test_gspo_through_a_config_is_gspo(self):
    # Regression: the shared rl config defaults (0.2, token_mean) silently replaced GSPO's own.
    fields = surrogate.surrogate_fields_from_config(rl_config(policy_loss="gspo"))
    self.assertEqual((fields["eps_low"], fields["eps_high"], fields["aggregation"]),
                     (3e-4, 4e-4, "seq_mean_token_mean"))
    settings = surrogate.SurrogateSettings(**fields)
    self.assertEqual(settings, surrogate.SurrogateSettings(policy_loss="gspo", max_len=fields["max_len"]))
    ppo = surrogate.SurrogateSettings(**surrogate.surrogate_fields_from_config(rl_config()))
    self.assertEqual((ppo.eps_low, ppo.eps_high, ppo.aggregation), (0.2, 0.2, "token_mean"))
    # Explicit config values are kept.
    mine = surrogate.surrogate_fields_from_config(rl_config(policy_loss="gspo", eps_low=1e-3,
                                                            aggregation="token_mean"))
    self.assertEqual((mine["eps_low"], mine["eps_high"], mine["aggregation"]), (1e-3, 1e-3, "token_mean"))
    # The loss the settings build is gspo_loss with its defaults.
    logp, old, adv, mask = random_batch(13)
    logp = (old + 1e-3 * np.sign(logp - old)).astype(np.float32)  # ratios around GSPO's tiny clip range
    expected = pg.gspo_loss(logp, old, adv, mask)[0].value
    np.testing.assert_allclose(pg.grpo_loss(logp, old, adv, mask, **settings.surrogate_kwargs())[0].value,
                               expected, rtol=1e-6)
    np.testing.assert_allclose(pg.grpo_loss(logp, old, adv, mask, policy_loss="gspo")[0].value, expected,
                               rtol=1e-6)
    self.assertNotAlmostEqual(
        float(expected), float(pg.grpo_loss(logp, old, adv, mask, policy_loss="gspo", eps_low=0.2,
                                            aggregation="token_mean")[0].value), places=4)

  def test_gspo_rejects_dual_clip(self):
    logp, old, adv, mask = random_batch(14)
    for call in (lambda: pg.gspo_loss(logp, old, adv, mask, dual_clip=3.0),
                 lambda: pg.grpo_loss(logp, old, adv, mask, policy_loss="gspo", dual_clip=3.0),
                 lambda: surrogate.SurrogateSettings(policy_loss="gspo", dual_clip=3.0),
                 lambda: surrogate.surrogate_fields_from_config(rl_config(policy_loss="gspo", dual_clip=3.0))):
      with self.assertRaisesRegex(ValueError, "policy_loss='gspo' takes no dual_clip"):
        call()
    # ppo_clip keeps it, and passes it to the loss.
    self.assertEqual(surrogate.SurrogateSettings(dual_clip=3.0).surrogate_kwargs()["dual_clip"], 3.0)

  @parameterized.parameters(None, 0.0)
  def test_use_tis_needs_a_cap(self, cap):
    # Regression: use_tis=True with tis_cap unset silently deleted the sampler log-probs.
    cfg = rl_config(use_tis=True, tis_cap=cap)
    with self.assertRaisesRegex(ValueError, r"rl.use_tis=True needs rl.tis_cap > 0.*rl.tis_cap="):
      surrogate.surrogate_fields_from_config(cfg)
    from lemon_rl.training import rl as rl_lib  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(ValueError, "rl.tis_cap"):
      rl_lib.policy_loss_from_config(cfg)
    self.assertEqual(rl_lib.policy_loss_from_config(rl_config(use_tis=True, tis_cap=2.0)).tis_cap, 2.0)
    self.assertIsNone(rl_lib.policy_loss_from_config(rl_config(use_tis=False, tis_cap=cap)).tis_cap)

  def test_settings_are_hashable_and_resolved(self):
    a = surrogate.SurrogateSettings(policy_loss="gspo")
    self.assertEqual(hash(a), hash(surrogate.SurrogateSettings(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4,
                                                                aggregation="seq_mean_token_mean")))
    self.assertIs(surrogate.SurrogateSettings, losses.SurrogateSettings)


# ---------------------------------------------------------------------------------------------------
# Coefficients as traced values.
# ---------------------------------------------------------------------------------------------------

STATIC = ("policy_loss", "kl_estimator", "aggregation", "max_len", "ratio_level")


class TracedCoefficientTest(parameterized.TestCase):

  @parameterized.parameters("ppo_clip", "gspo")
  def test_jit_with_traced_coefficients(self, policy_loss):
    # Regression: a traced kl_coef raised TracerBoolConversionError (so did dual_clip and tis_cap).
    logp, old, adv, mask = random_batch(15)
    ref = (logp - 0.2).astype(np.float32)
    sampler = (old + 0.1).astype(np.float32)
    ent = np.abs(logp).astype(np.float32)
    coefs = dict(kl_coef=0.1, entropy_coef=0.01, eps_low=0.2, eps_high=0.28, tis_cap=1.5)
    if policy_loss == "ppo_clip":
      coefs["dual_clip"] = 3.0
    traces = []

    def counted(*args, **kwargs):
      traces.append(1)
      return pg.grpo_loss(*args, **kwargs)

    jitted = jax.jit(counted, static_argnames=STATIC)
    for scale in (1.0, 0.5):  # a KL / entropy schedule: new values, no new trace
      scaled = {k: v * scale if k.endswith("_coef") else v for k, v in coefs.items()}
      kwargs = dict(policy_loss=policy_loss, ref_logp=ref, entropy=ent, sampler_logp=sampler,
                    aggregation="seq_mean_token_mean", max_len=8)
      total, metrics = jitted(logp, old, adv, mask, **kwargs, **{k: jnp.float32(v) for k, v in scaled.items()})
      eager_total, eager_metrics = pg.grpo_loss(logp, old, adv, mask, **kwargs, **scaled)
      np.testing.assert_allclose(total.value, eager_total.value, rtol=1e-5)
      np.testing.assert_allclose(metrics["pg_loss"].value, eager_metrics["pg_loss"].value, rtol=1e-5)
    self.assertLen(traces, 1)

  def test_traced_coefficient_needs_its_array(self):
    logp, old, adv, mask = random_batch(16)
    f = jax.jit(pg.grpo_loss)
    with self.assertRaisesRegex(ValueError, "needs ref_logp"):
      f(logp, old, adv, mask, kl_coef=jnp.float32(0.0))
    with self.assertRaisesRegex(ValueError, "needs the per-token entropy"):
      f(logp, old, adv, mask, entropy_coef=jnp.float32(0.0))
    # Concrete zeros need nothing; concrete checks still run on jnp scalars.
    pg.grpo_loss(logp, old, adv, mask, kl_coef=jnp.float32(0.0), entropy_coef=0)
    with self.assertRaisesRegex(ValueError, "dual_clip"):
      pg.grpo_loss(logp, old, adv, mask, dual_clip=jnp.float32(0.5))


class RegistryTest(parameterized.TestCase):

  def test_register_get_names(self):
    reg = Registry("widget")

    @reg.register("a")
    def a():
      return 1

    reg.register("b", lambda: 2)
    self.assertIs(reg.get("a"), a)
    self.assertEqual(reg.names(), ("a", "b"))
    self.assertIn("b", reg)
    self.assertLen(reg, 2)
    self.assertEqual(reg.validate("a"), "a")

  def test_unknown_name_lists_names(self):
    reg = Registry("widget")
    reg.register("alpha", len)
    reg.register("beta", len)
    for exc in (KeyError, ValueError, UnknownNameError):
      with self.assertRaises(exc) as ctx:
        reg.get("gamma")
      self.assertEqual(str(ctx.exception), "unknown widget 'gamma'; registered: alpha, beta")
    with self.assertRaisesRegex(KeyError, "registered: alpha, beta"):
      reg.get(["unhashable"])

  def test_duplicate_and_bad_registration(self):
    reg = Registry("widget")
    reg.register("a", len)
    with self.assertRaisesRegex(ValueError, "already registered"):
      reg.register("a", len)
    with self.assertRaises(TypeError):
      reg.register("b", 3)
    with self.assertRaises(ValueError):
      reg.register("", len)

  def test_library_registries(self):
    self.assertEqual(losses.POLICY_LOSSES.names(), ("ppo_clip", "gspo"))
    self.assertEqual(losses.ADVANTAGE_ESTIMATORS.names(),
                     ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gigpo"))


if __name__ == "__main__":
  pytest.main([__file__])
