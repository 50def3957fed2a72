"""Tests of lemon_rl.losses.counterfactual: LEMON's span-local loss, L_GRPO + mu L_cf and the edit-family sampler.

The by-hand loss tests run under ``chex.variants`` (eager, ``jax.jit``, ``jax.pmap``; under pytest there is one
CPU device, so the pmap variant maps over that one device: it checks that the losses trace under pmap).
Tolerances: float32 sums of at most a few dozen O(1) terms, so 1e-6 absolute (values) and 1e-5 relative
(against the float64 NumPy transcription) are far above the accumulated rounding (~1e-7).
"""

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from lemon_rl import losses
from lemon_rl import ops
from lemon_rl.losses import counterfactual as cf

pytestmark = pytest.mark.usefixtures("pmap_variant_on_one_device")

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def np_cf_loss(logp, old, dc, span, mode, eps_low=0.2, eps_high=0.2, max_len=None):
  """An independent float64 transcription of METHODS.md section 4 (span-local clipped surrogate)."""
  rows = []
  for i in range(len(logp)):
    sel = span[i] != 0
    if not sel.any():
      continue  # no edit: the row does not exist for L_cf
    rho = np.exp(logp[i][sel].astype(np.float64) - old[i][sel])
    rows.append(-np.minimum(rho * dc[i], np.clip(rho, 1 - eps_low, 1 + eps_high) * dc[i]))
  if not rows:
    return 0.0
  if mode == "token_mean":
    return np.concatenate(rows).sum() / sum(len(r) for r in rows)
  if mode == "seq_mean_token_mean":
    return np.mean([r.mean() for r in rows])
  if mode == "seq_mean_token_sum":
    return np.mean([r.sum() for r in rows])
  return np.mean([r.sum() / (max_len or logp.shape[-1]) for r in rows])


def random_problem(seed, b=8, t=10):
  """Random log-probs; rows 1, 4 and 6 have no edit; junk (-inf, huge) outside the spans."""
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, size=(b, t))
  old = logp + rng.normal(scale=0.4, size=(b, t))  # ratios far enough from 1 to clip some tokens
  dc = rng.normal(size=b)
  span = np.zeros((b, t))
  for i in range(b):
    if i in (1, 4, 6):
      continue
    start = rng.integers(0, t - 3)
    span[i, start:start + rng.integers(1, 4)] = 1.0
  outside = span == 0
  logp[outside & (rng.uniform(size=(b, t)) < 0.3)] = -np.inf
  old[outside & (rng.uniform(size=(b, t)) < 0.3)] = 1e30
  dc[[1, 4]] = np.nan  # never read: those rows have no edit
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return f32(logp), f32(old), f32(dc), f32(span)


# ---------------------------------------------------------------------------------------------------
# The span-local loss.
# ---------------------------------------------------------------------------------------------------


class CounterfactualLossTest(chex.TestCase):
  # Row 0: dc = +1, span t = 1, 2 with rho = 1.5 (clipped high: -1.2) and 0.9 (unclipped: -0.9).
  # Row 1: dc = -2, span t = 0, 3 with rho = 0.5 (clipped low: max(1.0, 1.6) = 1.6) and 1.1 (unclipped: 2.2).
  # Row 2: no edit (dc = 5 is ignored). Outside the spans: ratios far outside the clip range and -inf.
  RHO = np.array([[3.0, 1.5, 0.9, 0.1], [0.5, 4.0, 2.0, 1.1], [2.0, 0.3, 1.0, 7.0]])
  OLD = jnp.zeros((3, 4))
  LOGP = jnp.asarray(np.log(RHO), jnp.float32).at[0, 3].set(-jnp.inf).at[2, 0].set(-jnp.inf)
  DC = jnp.array([1.0, -2.0, 5.0])
  SPAN = jnp.array([[0, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0]], jnp.float32)

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_by_hand(self):
    def all_modes(logp, old, dc, span):
      return {mode: cf.counterfactual_loss(logp, old, dc, span, eps_low=0.2, eps_high=0.2, aggregation=mode)
              for mode in AGG_MODES}

    out = self.variant(all_modes)(self.LOGP, self.OLD, self.DC, self.SPAN)
    # Per-token losses -1.2, -0.9 (row 0), 1.6, 2.2 (row 1). The unedited row 2 adds neither tokens nor a
    # sequence to any denominator.
    expected = {"token_mean": (1.7, 4.0), "seq_mean_token_mean": (-1.05 + 1.9, 2.0),
                "seq_mean_token_sum": (1.7, 2.0), "seq_mean_token_sum_norm": (1.7 / 4, 2.0)}
    for mode, (expected_sum, expected_den) in expected.items():
      np.testing.assert_allclose(out[mode][0].sum, expected_sum, atol=1e-6, err_msg=mode)
      np.testing.assert_allclose(out[mode][0].denominator, expected_den, err_msg=mode)
    values = ops.metric_values(out["token_mean"][1])
    np.testing.assert_allclose(values["edit_frac"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(values["dc_mean"], -0.5, rtol=1e-6)
    np.testing.assert_allclose(values["abs_dc_mean"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(values["span_tokens"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(values["clip_frac_high"], 0.25)
    np.testing.assert_allclose(values["clip_frac_low"], 0.25)
    np.testing.assert_allclose(values["ratio_max"], 1.5, rtol=1e-6)  # span tokens only
    np.testing.assert_allclose(values["ratio_min"], 0.5, rtol=1e-6)

  def test_gradient_by_hand(self):
    grad = jax.grad(lambda lp: cf.counterfactual_loss(lp, self.OLD, self.DC, self.SPAN)[0].value)(self.LOGP)
    # d l / d logp = -dc rho on unclipped span tokens, 0 on clipped ones; / 4 span tokens. The signs:
    # dc > 0 pushes the original field up (negative gradient), dc < 0 pushes it down.
    expected = np.zeros((3, 4))
    expected[0, 2] = -1.0 * 0.9 / 4
    expected[1, 3] = 2.0 * 1.1 / 4
    np.testing.assert_allclose(grad, expected, atol=1e-7)

  def test_asymmetric_clip_and_dual_clip(self):
    loss = cf.counterfactual_loss(self.LOGP, self.OLD, self.DC, self.SPAN, eps_low=0.2, eps_high=0.6)[0]
    # Row 0's rho = 1.5 is now unclipped: -1.5 instead of -1.2.
    np.testing.assert_allclose(loss.value, (1.7 - 0.3) / 4, atol=1e-6)
    logp = jnp.log(jnp.array([[4.0, 1.0]]))
    loss = cf.counterfactual_loss(logp, jnp.zeros((1, 2)), jnp.array([-1.0]), jnp.array([[1.0, 0.0]]),
                                  dual_clip=3.0)[0]
    np.testing.assert_allclose(loss.value, 3.0, rtol=1e-6)  # max(4, 1.2) = 4 bounded by -c dc = 3

  @parameterized.parameters(*AGG_MODES)
  def test_matches_numpy_transcription(self, mode):
    logp, old, dc, span = random_problem(0)
    old = jnp.where(span != 0, old, 0.0)  # the transcription ignores junk anyway
    loss = cf.counterfactual_loss(logp, old, dc, span, eps_low=0.2, eps_high=0.28, aggregation=mode)[0]
    expected = np_cf_loss(np.asarray(logp), np.asarray(old), np.asarray(dc), np.asarray(span), mode,
                          eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(loss.value, expected, rtol=1e-5)

  @parameterized.parameters(*[(mode, {}) for mode in AGG_MODES],
                            ("token_mean", {"dual_clip": 3.0}),
                            ("seq_mean_token_sum", {"sampler": True, "tis_cap": 2.0}))
  def test_gradient_is_exactly_zero_outside_the_span(self, mode, options):
    logp, old, dc, span = random_problem(1)
    options = dict(options)
    if options.pop("sampler", False):
      options["sampler_logp"] = old + 0.3
    grad = jax.grad(lambda lp: cf.counterfactual_loss(lp, old, dc, span, aggregation=mode,
                                                      **options)[0].value)(logp)
    grad = np.asarray(grad)
    self.assertTrue(np.all(np.isfinite(grad)))  # -inf log-probs and NaN dc outside give no NaN
    np.testing.assert_array_equal(grad[np.asarray(span) == 0], 0.0)  # exactly, not approximately
    self.assertGreater(np.count_nonzero(grad[np.asarray(span) != 0]), 3)  # not vacuous

  def test_zero_dc_gives_zero_gradient(self):
    logp, old, _, span = random_problem(2)
    fn = lambda lp: cf.counterfactual_loss(lp, old, jnp.zeros(8), span, dual_clip=3.0)[0].value
    value, grad = jax.value_and_grad(fn)(logp)
    self.assertEqual(float(value), 0.0)
    np.testing.assert_array_equal(grad, 0.0)

  def test_gradient_step_follows_the_sign_of_dc(self):
    logp, old, dc, span = random_problem(3)
    old = logp  # on-policy: nothing clipped
    dc = jnp.where(jnp.isnan(dc), 0.0, dc)
    grad = jax.grad(lambda lp: cf.counterfactual_loss(lp, old, dc, span)[0].value)(logp)
    step = np.asarray(-grad)  # a gradient-descent step on the log-probs
    for i in range(8):
      sel = np.asarray(span[i]) != 0
      if sel.any():
        self.assertTrue(np.all(np.sign(step[i][sel]) == np.sign(float(dc[i]))), i)

  def test_no_edit_anywhere(self):
    logp, old, _, _ = random_problem(4)
    fn = lambda lp: cf.counterfactual_loss(lp, old, jnp.ones(8), jnp.zeros((8, 10)))[0]
    loss = fn(logp)
    self.assertEqual((float(loss.sum), float(loss.denominator), float(loss.value)), (0.0, 0.0, 0.0))
    np.testing.assert_array_equal(jax.grad(lambda lp: fn(lp).value)(logp), 0.0)

  def test_completion_mask_restricts_the_span(self):
    logp, old, dc, span = random_problem(5)
    completion = jnp.ones_like(span).at[:, :3].set(0.0)  # a span map that reached into the prompt
    ours = cf.counterfactual_loss(logp, old, dc, span, completion_mask=completion)[0]
    cut = cf.counterfactual_loss(logp, old, dc, span * completion)[0]
    np.testing.assert_array_equal(ours.sum, cut.sum)
    np.testing.assert_array_equal(ours.denominator, cut.denominator)

  def test_shape_checks(self):
    logp = jnp.zeros((2, 3))
    with self.assertRaises(AssertionError):
      cf.counterfactual_loss(logp, logp, jnp.zeros((2, 3)), jnp.ones((2, 3)))  # dc must be [B]
    with self.assertRaises(AssertionError):
      cf.counterfactual_loss(logp, logp, jnp.zeros(2), jnp.ones((2, 4)))


# ---------------------------------------------------------------------------------------------------
# L_GRPO + mu L_cf and micro-batching.
# ---------------------------------------------------------------------------------------------------


def grpo_problem(seed, b=8, t=10):
  rng = np.random.default_rng(seed)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  mask = jnp.asarray(rng.uniform(size=(b, t)) < 0.8, jnp.float32)
  return adv, mask


class CombinedLossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.parameters(1.0, 0.5)
  def test_value_gradient_and_metrics(self, mu):
    logp, old, dc, span = random_problem(6)
    adv, mask = grpo_problem(6)
    old_g = jnp.where(mask != 0, old, 0.0)

    def total(lp, mu):
      grpo = losses.grpo_loss(lp, old_g, adv, mask)
      return cf.combined_loss(grpo, cf.counterfactual_loss(lp, old, dc, span), mu=mu)

    loss, metrics = self.variant(total)(logp, mu)  # mu traced
    grpo_value = losses.grpo_loss(logp, old_g, adv, mask)[0].value
    cf_value = cf.counterfactual_loss(logp, old, dc, span)[0].value
    np.testing.assert_allclose(loss.value, grpo_value + mu * cf_value, atol=1e-6)
    self.assertEqual(float(loss.denominator), 1.0)
    np.testing.assert_allclose(metrics["cf/loss"].value, cf_value, atol=1e-6)
    np.testing.assert_allclose(metrics["grpo/loss"].value, grpo_value, atol=1e-6)
    self.assertIn("pg_loss", metrics)
    self.assertIn("cf/clip_frac", metrics)
    self.assertIn("cf/abs_dc_mean", metrics)

  def test_gradient_is_the_sum_of_the_terms(self):
    logp, old, dc, span = random_problem(7)
    adv, mask = grpo_problem(7)
    old_g = jnp.where(mask != 0, old, 0.0)
    grpo_fn = lambda lp: losses.grpo_loss(lp, old_g, adv, mask)
    cf_fn = lambda lp: cf.counterfactual_loss(lp, old, dc, span)
    total = jax.grad(lambda lp: cf.combined_loss(grpo_fn(lp), cf_fn(lp), mu=0.7)[0].value)(logp)
    parts = jax.grad(lambda lp: grpo_fn(lp)[0].value)(logp) + 0.7 * jax.grad(lambda lp: cf_fn(lp)[0].value)(logp)
    np.testing.assert_allclose(total, parts, atol=1e-7)
    # The cf term moves only the spans: outside them the total gradient is GRPO's alone.
    outside = np.asarray(span) == 0
    grpo_grad = np.asarray(jax.grad(lambda lp: grpo_fn(lp)[0].value)(logp))
    np.testing.assert_array_equal(np.asarray(total)[outside], grpo_grad[outside])

  def test_denominators_both_or_neither(self):
    pair = (ops.WeightedMetric(jnp.ones(()), jnp.ones(())), {})
    with self.assertRaisesRegex(ValueError, "both"):
      cf.combined_loss(pair, pair, grpo_denominator=jnp.ones(()))

  @parameterized.parameters(*AGG_MODES)
  def test_micro_batch_invariance(self, mode):
    logp, old, dc, span = random_problem(8, b=8)
    adv, mask = grpo_problem(8)
    old_g = jnp.where(mask != 0, old, 0.0)
    m = 4  # micro-batches of 2 rows; rows 4 and 6 (no edit) make micro-batch 2's cf term empty-ish
    split = lambda x: x.reshape((m, -1) + x.shape[1:])

    def cf_pair(lp, o, d, s):
      return cf.counterfactual_loss(lp, o, d, s, aggregation=mode, max_len=10)[0]

    # The (sum, denominator) pairs: vmapped over micro-batches and added up = the whole batch's pair.
    pieces = jax.vmap(cf_pair)(split(logp), split(old), split(dc), split(span))
    full = cf_pair(logp, old, dc, span)
    np.testing.assert_allclose(jnp.sum(pieces.sum), full.sum, atol=1e-6)
    np.testing.assert_allclose(jnp.sum(pieces.denominator), full.denominator)

    # The combined loss with whole-batch denominators and shares 1/m: the values and gradients add up.
    grpo_den = losses.aggregate(jnp.zeros_like(mask), mask, mode, max_len=10).denominator
    cf_den = losses.aggregate(jnp.zeros_like(span), span, mode, max_len=10).denominator

    def combined_sum(lp, o, og, d, s, a, mk, dens, share):
      grpo = losses.grpo_loss(lp, og, a, mk, aggregation=mode, max_len=10)
      cfl = cf.counterfactual_loss(lp, o, d, s, aggregation=mode, max_len=10)
      return cf.combined_loss(grpo, cfl, grpo_denominator=dens[0], cf_denominator=dens[1], share=share)[0].sum

    f = jax.value_and_grad(combined_sum)
    args = (logp, old, old_g, dc, span, adv, mask)
    value, grad = jax.jit(f)(*args, (grpo_den, cf_den), 1.0)  # share 1: the sum is the whole-batch value
    values, grads = jax.jit(jax.vmap(f, in_axes=(0,) * 7 + (None, None)))(
        *map(split, args), (grpo_den, cf_den), 1.0 / m)
    # float32 sums of ~80 terms of up to ~10: relative 1e-6 of the value.
    np.testing.assert_allclose(jnp.sum(values), value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads.reshape(grad.shape), grad, atol=1e-7)
    self.assertGreater(float(jnp.abs(grad).max()), 1e-3)


# ---------------------------------------------------------------------------------------------------
# Edit-family sampling.
# ---------------------------------------------------------------------------------------------------


class FlooredProportionalTest(parameterized.TestCase):

  def test_by_hand(self):
    # Proportional shares 0.0033, 0.33, 0.67: the first is lifted to the floor, the others split 0.9 as 1:2.
    np.testing.assert_allclose(cf.floored_proportional([0.01, 1.0, 2.0], floor=0.1), [0.1, 0.3, 0.6])
    # No share below the floor: exactly proportional.
    np.testing.assert_allclose(cf.floored_proportional([1.0, 2.0, 3.0], floor=0.1), [1 / 6, 2 / 6, 3 / 6])
    # Two lifted in turn: 0.0 and 0.05 (share 0.05 / 1.05 < 0.2).
    np.testing.assert_allclose(cf.floored_proportional([0.0, 0.05, 1.0], floor=0.2), [0.2, 0.2, 0.6])
    # Masking renormalises over the applicable families only.
    np.testing.assert_allclose(cf.floored_proportional([1.0, 5.0, 3.0], [True, False, True], floor=0.1),
                               [0.25, 0.0, 0.75])
    np.testing.assert_allclose(cf.floored_proportional([0.0, 0.0, 0.0], floor=0.1), [1 / 3] * 3)
    np.testing.assert_allclose(cf.floored_proportional([1.0, 2.0, 3.0], [False] * 3), [0.0] * 3)
    np.testing.assert_allclose(cf.floored_proportional([1.0, 2.0, 0.0], floor=1 / 3), [1 / 3] * 3)
    np.testing.assert_allclose(cf.floored_proportional([[0.01, 1.0, 2.0], [1.0, 5.0, 3.0]],
                                                       [[1, 1, 1], [1, 0, 1]], floor=0.1),
                               [[0.1, 0.3, 0.6], [0.25, 0.0, 0.75]])

  def test_random_weights_satisfy_the_definition(self):
    rng = np.random.default_rng(0)
    for _ in range(300):
      f = int(rng.integers(1, 6))
      floor = float(rng.uniform(0, 1 / f))
      w = rng.exponential(size=f) * (rng.uniform(size=f) < 0.8)
      mask = rng.uniform(size=f) < 0.8
      p = cf.floored_proportional(w, mask, floor=floor)
      np.testing.assert_array_equal(p[~mask], 0.0)
      if not mask.any():
        continue
      np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-12)
      self.assertTrue(np.all(p[mask] >= floor - 1e-15))
      if w[mask].sum() == 0:
        np.testing.assert_allclose(p[mask], 1 / mask.sum())
        continue
      # p_f = max(floor, c w_f) with one c: the families above the floor are exactly proportional, and the
      # ones at the floor would have had a share <= floor.
      free = mask & (p > floor + 1e-12)
      c = p[free][0] / w[free][0]
      np.testing.assert_allclose(p[free], c * w[free], rtol=1e-10)
      self.assertTrue(np.all(c * w[mask & ~free] <= floor + 1e-12))

  def test_invalid(self):
    with self.assertRaisesRegex(ValueError, "floor"):
      cf.floored_proportional([1.0, 1.0, 1.0], floor=0.4)
    with self.assertRaisesRegex(ValueError, ">= 0"):
      cf.floored_proportional([1.0, -1.0, 1.0])
    with self.assertRaisesRegex(ValueError, "shape"):
      cf.floored_proportional([1.0, 1.0, 1.0], [True, False])


class EditFamilySamplerTest(parameterized.TestCase):

  def test_running_mean(self):
    s = cf.EditFamilySampler(rate=0.5)
    s.update(["drop_edge", "drop_edge", "drop_edge"], [1.0, -3.0, 0.0])  # |dc|
    # Step max(1/n, 0.5): 1 (n = 1), then 1 + 0.5 (3 - 1) = 2, then 2 + 0.5 (0 - 2) = 1.
    np.testing.assert_allclose(s.means, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(s.counts, [3, 0, 0])
    cum = cf.EditFamilySampler(rate=0.0)
    cum.update([2, 2, 2, -1, None], [1.0, -3.0, 0.0, 100.0, 100.0])  # -1 / None: no edit, skipped
    np.testing.assert_allclose(cum.means, [0.0, 0.0, 4 / 3])
    np.testing.assert_array_equal(cum.counts, [0, 0, 3])
    ema = cf.EditFamilySampler(rate=0.1)  # exact mean for the first 10, then EMA
    xs = np.arange(1.0, 13.0)
    ema.update(["reset_duty"] * 12, xs)
    m = xs[:10].mean()
    for x in xs[10:]:
      m += 0.1 * (x - m)
    np.testing.assert_allclose(ema.means[1], m, rtol=1e-12)
    with self.assertRaisesRegex(ValueError, "unknown edit family"):
      s.update("drop_node", 1.0)
    with self.assertRaisesRegex(ValueError, "finite"):
      s.update("drop_edge", np.nan)

  def test_probabilities(self):
    s = cf.EditFamilySampler(floor=0.1)
    np.testing.assert_allclose(s.probabilities(), [1 / 3] * 3)  # nothing observed: uniform
    s.update(["drop_edge", "reset_duty"], [0.5, -1.5])
    # lower_capacity is unobserved: it takes the largest observed mean, 1.5 -> weights 0.5, 1.5, 1.5.
    np.testing.assert_allclose(s.probabilities(), [1 / 7, 3 / 7, 3 / 7])
    s.update("lower_capacity", 0.01)  # share 0.01 / 2.01 < floor -> exactly the floor
    p = s.probabilities()
    np.testing.assert_allclose(p, [0.9 * 0.25, 0.9 * 0.75, 0.1])
    np.testing.assert_allclose(s.probabilities(["reset_duty", "lower_capacity"]), [0.0, 0.9, 0.1])
    # Among drop_edge and lower_capacity the share 0.01 / 0.51 is still below the floor.
    np.testing.assert_allclose(s.probabilities(np.array([[1, 0, 1], [0, 0, 0]], bool)),
                               [[0.9, 0.0, 0.1], [0.0, 0.0, 0.0]])

  def test_chi_square_of_the_draws(self):
    s = cf.EditFamilySampler(floor=0.15, seed=3)
    s.update(["drop_edge", "reset_duty", "lower_capacity"], [0.05, 1.0, -2.0])
    n = 20000
    for applicable in ([True, True, True], [True, False, True]):
      p = s.probabilities(np.array(applicable))
      draws = s.sample(np.tile(applicable, (n, 1)))
      counts = np.bincount(draws, minlength=3)
      self.assertEqual(counts[~np.array(applicable)].sum(), 0)  # inapplicable families are never drawn
      sel = p > 0
      self.assertGreater(stats.chisquare(counts[sel], n * p[sel]).pvalue, 1e-3)
      # The test has power: the same draws reject the unfloored proportional and the uniform rules.
      for wrong in (cf.floored_proportional(s.weights(), applicable, floor=0.0),
                    np.where(applicable, 1.0, 0.0) / sum(applicable)):
        self.assertLess(stats.chisquare(counts[sel], n * wrong[sel]).pvalue, 1e-6)

  def test_sample_shapes_seeding_and_state(self):
    a = cf.EditFamilySampler(seed=7)
    b = cf.EditFamilySampler(seed=7)
    a.update([0, 1], [0.3, 0.9])
    b.update([0, 1], [0.3, 0.9])
    masks = np.array([[1, 1, 0], [0, 0, 0], [0, 0, 1]], bool)
    first = a.sample(masks)
    np.testing.assert_array_equal(first, b.sample(masks))
    self.assertEqual(first[1], -1)  # no applicable family
    self.assertEqual(first[2], 2)  # the only applicable one
    self.assertIn(int(first[0]), (0, 1))
    self.assertEqual(np.ndim(a.sample()), 0)
    saved = a.state_dict()
    later = a.sample(np.ones((50, 3), bool))
    c = cf.EditFamilySampler(seed=0)
    c.load_state_dict(saved)
    np.testing.assert_array_equal(c.sample(np.ones((50, 3), bool)), later)
    np.testing.assert_array_equal(c.means, a.means)
    with self.assertRaisesRegex(ValueError, "families"):
      cf.EditFamilySampler(families=("drop_edge", "reset_duty")).load_state_dict(saved)

  def test_invalid(self):
    with self.assertRaisesRegex(ValueError, "floor"):
      cf.EditFamilySampler(floor=0.5)
    with self.assertRaisesRegex(ValueError, "rate"):
      cf.EditFamilySampler(rate=1.5)
    with self.assertRaisesRegex(ValueError, "distinct"):
      cf.EditFamilySampler(families=("drop_edge", "drop_edge"))

  def test_exports(self):
    self.assertIs(losses.counterfactual_loss, cf.counterfactual_loss)
    self.assertIs(losses.EditFamilySampler, cf.EditFamilySampler)
    self.assertEqual(losses.EDIT_FAMILIES, ("drop_edge", "reset_duty", "lower_capacity"))
