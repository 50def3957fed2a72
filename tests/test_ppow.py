"""Tests of lemon_rl.losses.ppow: accepted length, rewards, KL, criticality, ADAW and the window objective.

By-hand tests run under ``chex.variants`` (eager, ``jax.jit`` and ``jax.pmap`` over the one CPU device).
Statistical tests use fixed seeds (so they are deterministic) and state their power in the test.
"""

import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special
from scipy import stats

from lemon_rl import losses
from lemon_rl.losses import ppow
from lemon_rl.sampling import distribution
from lemon_rl.sampling import speculative

pytestmark = pytest.mark.usefixtures("pmap_variant_on_one_device")

NEG_INF = -np.inf


def np_softmax(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def realised(ks, window):
  """An Acceptance for realised lengths ``ks`` (one-hot length distribution)."""
  ks = np.asarray(ks)
  per_position = (np.arange(window)[None] < ks[:, None]).astype(np.float32)
  return ppow.Acceptance(jnp.asarray(ks, jnp.float32), jnp.asarray(per_position),
                         jnp.asarray(np.eye(window + 1, dtype=np.float32)[ks]))


# Sampling verification by hand: V = 4, K = 3; logits are log-probabilities (temperature 1, no filter).
P_PROBS = np.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
Q_PROBS = np.array([[0.25, 0.25, 0.25, 0.25], [0.1, 0.3, 0.4, 0.2], [0.5, 0.1, 0.2, 0.2]])
# d = [0, 2, 0]: a = min(1, p/q) = [0.5/0.25 -> 1, 0.2/0.4 = 0.5, 0.25/0.5 = 0.5].
# d = [1, 1, 1]: a = [0.2/0.25 = 0.8, 0.6/0.3 -> 1, 0.25/0.1 -> 1].
DRAFTS_A = [0, 2, 0]
DRAFTS_B = [1, 1, 1]


def sampling_case():
  drafts = jnp.array([DRAFTS_A] * 3 + [DRAFTS_B] * 2, jnp.int32)
  uniforms = jnp.array([[0.9, 0.4, 0.3],     # accept, 0.4 < 0.5 accept, 0.3 < 0.5 accept -> k = 3
                        [0.99, 0.6, 0.1],    # accept, 0.6 >= 0.5 reject -> k = 1
                        [0.0, 0.45, 0.7],    # accept, accept, reject -> k = 2
                        [0.85, 0.0, 0.0],    # 0.85 >= 0.8 reject -> k = 0 (later accepts do not count)
                        [0.75, 0.99, 0.99]])  # all accepted -> k = 3
  target = jnp.asarray(np.broadcast_to(np.log(P_PROBS), (5, 3, 4)), jnp.float32)
  drafter = jnp.asarray(np.broadcast_to(np.log(Q_PROBS), (5, 3, 4)), jnp.float32)
  return drafts, target, drafter, uniforms


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def engine_and_ours(temperature, top_k, top_p):
  """``(accepted_length, speculative.verify's num_accepted)`` on 256 random windows (K = 5, V = 6).

  One compiled program per case (as the engine's loop compiles ``verify``), not op-by-op dispatch."""
  n, k, v = 256, 5, 6
  keys = jax.random.split(jax.random.key(7), 4)
  target = jax.random.normal(keys[0], (n, k + 1, v)) * 1.5
  drafter = target[:, :k] + jax.random.normal(keys[1], (n, k, v))  # a drafter close to the target
  verify_key = keys[3]
  if temperature == 0:
    drafts = jnp.argmax(drafter, -1).astype(jnp.int32)
    engine, _, _ = speculative.verify(target, drafts, None, verify_key, 0, 0, 1.0)
    ours = ppow.accepted_length(drafts, target[:, :k], verification="greedy")
  else:
    q = distribution.sampling_logits(drafter, temperature, top_k, top_p)
    drafts = jax.random.categorical(keys[2], q, axis=-1).astype(jnp.int32)
    engine, _, _ = speculative.verify(target, drafts, q, verify_key, temperature, top_k, top_p)
    uniforms = jax.random.uniform(jax.random.split(verify_key)[0], drafts.shape)
    ours = ppow.accepted_length(drafts, target[:, :k], drafter, verification="sampling", uniforms=uniforms,
                                temperature=temperature, top_k=top_k, top_p=top_p)
  return ours.length, engine


# ---------------------------------------------------------------------------------------------------------
# Accepted length.
# ---------------------------------------------------------------------------------------------------------


class AcceptedLengthTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_greedy_by_hand(self):
    # Target argmax per position: [1, 2, 3, 0].
    target = jnp.broadcast_to(2.0 * jax.nn.one_hot(jnp.array([1, 2, 3, 0]), 4), (4, 4, 4))
    drafts = jnp.array([[1, 2, 0, 0],   # first mismatch at position 2 -> k = 2
                        [1, 2, 3, 0],   # all match -> k = 4
                        [0, 2, 3, 0],   # first token wrong -> k = 0 (later matches do not count)
                        [1, 2, 3, 0]])  # all match, but the window has 3 valid positions -> k = 3
    mask = jnp.array([[1, 1, 1, 1]] * 3 + [[1, 1, 1, 0]])
    fn = self.variant(functools.partial(ppow.accepted_length, verification="greedy"))
    out = fn(drafts, target, None, mask)
    np.testing.assert_array_equal(out.length, [2, 4, 0, 3])
    np.testing.assert_array_equal(out.per_position, [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(out.length_probs, np.eye(5)[[2, 4, 0, 3]])

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_sampling_by_hand(self):
    drafts, target, drafter, uniforms = sampling_case()
    fn = self.variant(functools.partial(ppow.accepted_length, verification="sampling"))
    out = fn(drafts, target, drafter, None, uniforms=uniforms)
    np.testing.assert_array_equal(out.length, [3, 1, 2, 0, 3])
    np.testing.assert_array_equal(out.length_probs, np.eye(4)[[3, 1, 2, 0, 3]])

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_expected_by_hand(self):
    drafts, target, drafter, _ = sampling_case()
    out = self.variant(functools.partial(ppow.accepted_length, verification="expected"))(
        drafts[2:4], target[2:4], drafter[2:4])
    # DRAFTS_A: c = [1, 0.5, 0.25], E[k] = 1.75, P(k) = [0, 0.5, 0.25, 0.25].
    # DRAFTS_B: c = [0.8, 0.8, 0.8], E[k] = 2.4, P(k) = [0.2, 0, 0, 0.8].
    np.testing.assert_allclose(out.length, [1.75, 2.4], rtol=1e-6)
    np.testing.assert_allclose(out.per_position, [[1, 0.5, 0.25], [0.8, 0.8, 0.8]], rtol=1e-6)
    np.testing.assert_allclose(out.length_probs, [[0, 0.5, 0.25, 0.25], [0.2, 0, 0, 0.8]], rtol=1e-6,
                               atol=1e-7)

  def test_padded_positions_are_rejections_and_may_hold_garbage(self):
    drafts, target, drafter, uniforms = sampling_case()
    mask = jnp.array([[1, 1, 0]] * 5)
    target = target.at[:, 2].set(jnp.nan)
    drafter = drafter.at[:, 2].set(-jnp.inf)
    out = ppow.accepted_length(drafts, target, drafter, mask, verification="sampling", uniforms=uniforms)
    np.testing.assert_array_equal(out.length, [2, 1, 2, 0, 2])
    expected = ppow.accepted_length(drafts, target, drafter, mask, verification="expected")
    np.testing.assert_allclose(expected.length, [1.5, 1.5, 1.5, 1.6, 1.6], rtol=1e-6)
    assert np.all(np.isfinite(expected.length_probs))

  @parameterized.parameters((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 0.8))
  def test_equals_the_engine(self, temperature, top_k, top_p):
    """``num_accepted`` of ``speculative.verify`` (the engine's rule) for the same uniforms."""
    ours, engine = engine_and_ours(temperature, top_k, top_p)
    np.testing.assert_array_equal(ours, engine)
    assert len(np.unique(np.asarray(engine))) >= 3  # the case exercises several lengths

  def test_expected_length_matches_monte_carlo(self):
    """E[k] and P(k = m) against the sampling rule over many uniforms, for fixed drafts.

    z-test of the mean at |z| < 4 (false alarm 6e-5) with n = 40000 uniform draws: se = sd(k) / 200, so
    the test has power >= 0.99 against any error of E[k] larger than (4 + 2.33) se, asserted below to be
    far smaller than the errors of the plausible bugs (no min(1, .), no cumulative product, off by one).
    Then a chi-square of the histogram of k against P(k = m) at level 1e-3.
    """
    n_windows, k, v, n = 4, 4, 5, 40000
    rng = np.random.default_rng(3)
    target = rng.normal(size=(n_windows, k, v)).astype(np.float32)
    drafter = target + 0.8 * rng.normal(size=(n_windows, k, v)).astype(np.float32)
    p, q = np_softmax(target), np_softmax(drafter)
    d = np.array([[rng.choice(v, p=q[w, j]) for j in range(k)] for w in range(n_windows)])  # drafts ~ q
    drafts, target, drafter = jnp.asarray(d, jnp.int32), jnp.asarray(target), jnp.asarray(drafter)
    exp = ppow.accepted_length(drafts, target, drafter, verification="expected")
    # Independent numpy transcription of E[k] = sum_j prod_{i<=j} min(1, p_i / q_i).
    ratio = np.take_along_axis(p, d[..., None], -1)[..., 0] / np.take_along_axis(q, d[..., None], -1)[..., 0]
    a = np.minimum(1.0, ratio)
    np.testing.assert_allclose(exp.length, np.cumprod(a, -1).sum(-1), rtol=1e-5)

    uniforms = jnp.asarray(rng.uniform(size=(n, n_windows, k)), jnp.float32)
    sampled = jax.jit(jax.vmap(lambda u: ppow.accepted_length(drafts, target, drafter, verification="sampling",
                                                              uniforms=u).length))(uniforms)
    sampled = np.asarray(sampled)
    ms = np.arange(k + 1)
    for w in range(n_windows):
      probs = np.asarray(exp.length_probs[w], np.float64)
      mean = float(exp.length[w])
      sd = np.sqrt(max(probs @ ms**2 - mean**2, 0.0))
      se = sd / np.sqrt(n)
      detectable = (4 + 2.33) * se
      bugs = [np.cumprod(ratio[w]).sum(), a[w].sum(), np.cumprod(a[w])[:-1].sum()]
      assert all(abs(b - mean) > detectable for b in bugs if abs(b - mean) > 1e-6), (bugs, mean, detectable)
      if se > 0:
        assert abs(sampled[:, w].mean() - mean) < 4 * se, (w, sampled[:, w].mean(), mean, se)
      counts = np.bincount(sampled[:, w].astype(int), minlength=k + 1)
      support = probs > 1e-9
      assert counts[~support].sum() == 0
      if support.sum() > 1:
        f_exp = n * probs[support] / probs[support].sum()
        assert stats.chisquare(counts[support], f_exp).pvalue > 1e-3

  def test_options_are_checked(self):
    drafts, target, drafter, _ = sampling_case()
    with self.assertRaisesRegex(ValueError, "verification"):
      ppow.accepted_length(drafts, target, drafter, verification="nucleus")
    with self.assertRaisesRegex(ValueError, "uniforms"):
      ppow.accepted_length(drafts, target, drafter, verification="sampling")
    with self.assertRaisesRegex(ValueError, "drafter_logits"):
      ppow.accepted_length(drafts, target, verification="expected")
    with self.assertRaises(AssertionError):  # chex shape check
      ppow.accepted_length(drafts[:, :2], target, drafter, verification="expected")


# ---------------------------------------------------------------------------------------------------------
# Rewards and advantages.
# ---------------------------------------------------------------------------------------------------------


class RewardTest(chex.TestCase):

  def test_speedup_reward_by_hand(self):
    np.testing.assert_allclose(ppow.speedup_reward(jnp.array([0, 1, 3, 10])),
                               [0.0, 1 / 1.12, 3 / 1.36, 10 / 2.2], rtol=1e-6)
    np.testing.assert_allclose(ppow.speedup_reward(jnp.array([2.0]), gamma=0.5), [1.0])
    np.testing.assert_allclose(ppow.speedup_reward(jnp.array([2.0]), gamma=0.0), [2.0])
    with self.assertRaises(ValueError):
      ppow.speedup_reward(jnp.array([1.0]), gamma=-0.1)
    assert ppow.measured_cost_ratio(0.003, 0.025) == pytest.approx(0.12)
    with self.assertRaises(ValueError):
      ppow.measured_cost_ratio(0.003, 0.0)

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_window_rewards_by_hand(self):
    # K = 2, eta = 0.2, eps = 1.0 (defaults); every gap below is exact in float32.
    ks = [0, 0, 1, 0, 0, 2]
    greedy = jnp.array([[-0.5, -0.5]] * 4 + [[-0.5, 0.0], [-0.5, -0.5]])
    draft = jnp.array([[-1.5, -1.5],    # gap exactly 1.0 = eps: not < eps -> R_dist 0
                       [-1.25, -1.5],   # gap (0.75 + 1) / 2 = 0.875 -> R_dist 0.2
                       [-0.5, -0.5],    # gap 0, but k = 1 -> R_dist 0; R_speedup 1 / 1.12
                       [-0.25, -0.5],   # gap -0.125 (the draft beats greedy) -> 0.2
                       [-1.25, NEG_INF],  # one valid position: gap 0.75 -> 0.2 (the -inf is padding)
                       [-9.0, -9.0]])   # k = 2: R_speedup 2 / 1.24, no R_dist whatever the gap
    mask = jnp.array([[1, 1]] * 4 + [[1, 0], [1, 1]])
    fn = self.variant(ppow.window_rewards)
    out = fn(realised(ks, 2), draft, greedy, mask)
    np.testing.assert_allclose(out.gap, [1.0, 0.875, 0.0, -0.125, 0.75, 8.5], rtol=1e-6)
    np.testing.assert_allclose(out.dist, [0, 0.2, 0, 0.2, 0.2, 0], rtol=1e-6)
    np.testing.assert_allclose(out.speedup, [0, 0, 1 / 1.12, 0, 0, 2 / 1.24], rtol=1e-6)
    np.testing.assert_allclose(out.total, out.speedup + out.dist, rtol=1e-6)

  def test_dist_threshold_edge_is_strict(self):
    greedy, draft = jnp.array([[-0.5, -0.5]]), jnp.array([[-1.5, -1.5]])  # gap exactly 1.0
    just_above = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
    for eps, fired in ((1.0, 0.0), (just_above, 0.2), (0.5, 0.0)):
      out = ppow.window_rewards(realised([0], 2), draft, greedy, eps=eps)
      np.testing.assert_allclose(out.dist, [fired], err_msg=f"eps={eps}")
    out = ppow.window_rewards(realised([0], 2), draft, greedy, eta=0.7, eps=2.0)
    np.testing.assert_allclose(out.dist, [0.7])

  def test_expected_acceptance_rewards(self):
    """With a distribution of k the rewards are their expectations: eta P(k = 0), E[R_speedup]."""
    acc = ppow.Acceptance(jnp.array([1.6]), jnp.array([[0.8, 0.8]]), jnp.array([[0.2, 0.0, 0.8]]))
    greedy, draft = jnp.array([[-0.5, -0.5]]), jnp.array([[-1.0, -1.0]])  # gap 0.5 < eps
    out = ppow.window_rewards(acc, draft, greedy)
    np.testing.assert_allclose(out.speedup, [0.8 * 2 / 1.24], rtol=1e-6)
    np.testing.assert_allclose(out.dist, [0.2 * 0.2], rtol=1e-6)
    # gamma = 0: R_speedup = E[k] of accepted_length exactly (METHODS.md's expected-length reward).
    drafts, target, drafter, _ = sampling_case()
    acc = ppow.accepted_length(drafts, target, drafter, verification="expected")
    lp = jnp.zeros(drafts.shape)
    out = ppow.window_rewards(acc, lp, lp, gamma=0.0)
    np.testing.assert_allclose(out.speedup, acc.length, rtol=1e-6)

  def test_window_advantages(self):
    rewards = jnp.array([1.0, 0.0, 1.0, 0.3, 0.3, 0.3])
    ids = jnp.array([0, 0, 0, 1, 1, 1])
    s3 = np.sqrt(3.0)
    # Group 0: mean 2/3, unbiased std 1/sqrt(3); group 1 all equal -> 0.
    np.testing.assert_allclose(ppow.window_advantages(rewards, ids, 2),
                               [s3 / 3, -2 * s3 / 3, s3 / 3, 0, 0, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ppow.window_advantages(rewards, ids, 2, estimator="rloo"),
                               losses.rloo(rewards, ids, 2))
    with self.assertRaisesRegex(ValueError, "gigpo"):
      ppow.window_advantages(rewards, ids, 2, estimator="gigpo")

  def test_window_metrics(self):
    acc = realised([0, 2, 1, 2], 2)
    rewards = ppow.WindowRewards(jnp.array([0.2, 2.0, 1.0, 9.0]), jnp.zeros(4), jnp.array([0.2, 0, 0, 0]),
                                 jnp.array([0.5, 2.0, 0.0, 3.0]))
    m = ops_values(ppow.window_metrics(acc, rewards, jnp.array([1, 1, 1, 0])))
    np.testing.assert_allclose(m["accepted_length"], 1.0)
    np.testing.assert_allclose(m["tau"], 2.0)
    np.testing.assert_allclose(m["acceptance_rate_0"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["acceptance_rate_1"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["zero_accept"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["near_miss"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["reward"], 3.2 / 3, rtol=1e-6)


def ops_values(metrics):
  return {k: float(v.value) for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------------------
# KL and criticality.
# ---------------------------------------------------------------------------------------------------------


class DivergenceTest(chex.TestCase):

  def test_exact_kl_equals_scipy(self):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 4, 7)).astype(np.float32) * 2
    b = rng.normal(size=(3, 4, 7)).astype(np.float32) * 2
    a[0, 0, :3] = -np.inf  # zero-probability tokens of A contribute nothing
    expected = special.rel_entr(np_softmax(a), np_softmax(b)).sum(-1)
    # float32 log-softmax: ~1e-6 relative error per term, 7 terms.
    np.testing.assert_allclose(ppow.exact_kl(jnp.asarray(a), jnp.asarray(b)), expected, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(ppow.exact_kl(jnp.asarray(a), jnp.asarray(a)), 0.0, atol=1e-6)
    grad = jax.grad(lambda x: ppow.exact_kl(x, jnp.asarray(b)).sum())(jnp.asarray(a))
    assert np.all(np.isfinite(grad))
    b_zero = b.copy()
    b_zero[1, 1, 0] = -np.inf  # B = 0 where A > 0: infinite
    assert np.isinf(ppow.exact_kl(jnp.asarray(a), jnp.asarray(b_zero))[1, 1])

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_criticality_by_hand(self):
    drafter = jnp.array([[[0.3, -1.0, 2.0, 0.5]] * 3])  # [1, 3, 4]
    target = jnp.array([[[0.0, 0.0, 0.0, 0.0],                   # uniform P: confidence 0 -> v = 0
                         [0.0, NEG_INF, NEG_INF, NEG_INF],         # one-hot P: v = KL(P || Q) = -log Q(0)
                         [0.0, 0.0, NEG_INF, NEG_INF]]])           # P = [.5, .5, 0, 0]
    v = self.variant(ppow.criticality)(target, drafter)
    q = np_softmax([0.3, -1.0, 2.0, 0.5])
    # Third: H = log 2, 1 - log 2 / log 4 = 1/2; KL = 0.5 log(0.5 / q0) + 0.5 log(0.5 / q1).
    third = 0.5 * (0.5 * np.log(0.5 / q[0]) + 0.5 * np.log(0.5 / q[1]))
    np.testing.assert_allclose(v, [[0.0, -np.log(q[0]), third]], rtol=1e-5, atol=1e-6)

  def test_criticality_against_numpy(self):
    rng = np.random.default_rng(1)
    t = rng.normal(size=(2, 5, 9)) * 3
    d = rng.normal(size=(2, 5, 9))
    p, q = np_softmax(t), np_softmax(d)
    h = -(p * np.log(p)).sum(-1)
    expected = (1 - h / np.log(9)) * (p * np.log(p / q)).sum(-1)
    np.testing.assert_allclose(ppow.criticality(jnp.asarray(t, jnp.float32), jnp.asarray(d, jnp.float32)),
                               expected, rtol=1e-4, atol=1e-6)
    # Uniform P against a Q with zeros: 0, not NaN.
    assert ppow.criticality(jnp.zeros((1, 1, 3)), jnp.array([[[0.0, NEG_INF, 0.0]]]))[0, 0] == 0.0


# ---------------------------------------------------------------------------------------------------------
# ADAW.
# ---------------------------------------------------------------------------------------------------------


class AdawTest(chex.TestCase):

  def test_window_scores_by_hand(self):
    v = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    np.testing.assert_allclose(ppow.window_scores(v, mask), [2.5, 3.0])
    np.testing.assert_allclose(ppow.window_scores(v[:, :2]), [1.5, 3.0])
    scores, valid = ppow.sliding_window_scores(v, mask, 2)
    np.testing.assert_allclose(scores, [[1.5, 2.5, 3.5, 0, 0], [3.0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(valid, [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    scores, valid = ppow.sliding_window_scores(v, mask, 1)
    np.testing.assert_allclose(scores, np.where(mask, v, 0))

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_probabilities_by_hand(self):
    fn = self.variant(functools.partial(ppow.adaw_probabilities, floor=0.1))
    # Valid scores [0, 1, 3] (sum 4): pi = 0.1 / 3 + 0.9 * [0, 1/4, 3/4]; the invalid 100 gets 0.
    out = fn(jnp.array([0.0, 1.0, 3.0, 100.0]), jnp.array([1, 1, 1, 0]))
    expected = [0.1 / 3, 0.1 / 3 + 0.9 / 4, 0.1 / 3 + 0.9 * 3 / 4, 0.0]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(fn(jnp.zeros(4), None), [0.25] * 4)  # no signal: uniform

  def test_floor_rule(self):
    scores = jnp.array([0.0, 1e-9, 1.0, 50.0])
    for floor in (0.0, 0.1, 0.5, 1.0):
      p = np.asarray(ppow.adaw_probabilities(scores, floor=floor), np.float64)
      np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-6)
      assert p.min() >= floor / 4 * (1 - 1e-6)
      np.testing.assert_allclose(p[0], floor / 4, rtol=1e-6, atol=1e-12)  # a zero score gets exactly the floor
    np.testing.assert_allclose(ppow.adaw_probabilities(scores, floor=1.0), [0.25] * 4)
    np.testing.assert_array_equal(ppow.adaw_probabilities(scores, jnp.zeros(4)), np.zeros(4))
    with self.assertRaises(ValueError):
      ppow.adaw_probabilities(scores, floor=1.5)

  def test_draws_follow_the_probabilities(self):
    """Chi-square of 40000 seeded draws against pi (level 1e-3), with the power against no floor stated."""
    scores = jnp.array([0.0, 0.05, 0.2, 1.0, 2.0, 0.0, 3.5, 0.5])
    probs = ppow.adaw_probabilities(scores, floor=0.2)
    n = 40000
    idx = np.asarray(ppow.adaw_sample(jax.random.key(11), probs, n))
    counts = np.bincount(idx, minlength=8)
    p = np.asarray(probs, np.float64)
    assert stats.chisquare(counts, n * p / p.sum()).pvalue > 1e-3
    # Power: against the same scores without the floor (zero-score windows never drawn), the noncentrality
    # of the chi-square is n sum (p - p0)^2 / p; at level 1e-3 the test rejects with power > 0.999.
    p0 = np.asarray(ppow.adaw_probabilities(scores, floor=0.0), np.float64)
    crit = stats.chi2.ppf(1 - 1e-3, df=7)
    assert stats.ncx2.sf(crit, 7, n * np.sum((p - p0) ** 2 / p)) > 0.999
    assert counts[0] > 0 and counts[5] > 0  # the floor keeps zero-score windows in play
    # Same key, same draws; without replacement: distinct indices, never an invalid window.
    np.testing.assert_array_equal(ppow.adaw_sample(jax.random.key(11), probs, n), idx)
    probs_valid = ppow.adaw_probabilities(scores, jnp.arange(8) < 6)
    drawn = np.asarray(ppow.adaw_sample(jax.random.key(2), probs_valid, 6, replace=False))
    assert sorted(drawn.tolist()) == list(range(6))


# ---------------------------------------------------------------------------------------------------------
# The window objective.
# ---------------------------------------------------------------------------------------------------------

KAPPA = (np.log(2 / 3) + 2 * np.log(4 / 3)) / 3  # KL(uniform_3 || [.5, .25, .25])
P_SKEW = np.log([0.5, 0.25, 0.25])


def loss_case():
  """N = 2 windows, K = 2, V = 3; the drafter is uniform, so log q(d) = -log 3 for every token."""
  drafter = jnp.zeros((2, 2, 3))
  target = jnp.asarray(np.stack([[np.zeros(3), P_SKEW], [P_SKEW, np.zeros(3)]]), jnp.float32)
  drafts = jnp.array([[0, 1], [2, 0]])
  logq = -np.log(3.0)
  # Ratios: row 0 [1, 1]; row 1 [e^0.5 (clipped at 1.2 for A > 0), e^-0.5 (unclipped: min takes it)].
  old_logp = jnp.array([[logq, logq], [logq - 0.5, logq + 0.5]], jnp.float32)
  advantages = jnp.array([1.0, 2.0])
  return drafter, drafts, old_logp, advantages, target, jnp.ones((2, 2))


class LossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.named_parameters(("seq_mean_token_mean", "seq_mean_token_mean"), ("token_mean", "token_mean"))
  def test_by_hand(self, aggregation):
    beta = 0.1
    fn = self.variant(functools.partial(ppow.ppow_loss, beta=beta, aggregation=aggregation))
    loss, metrics = fn(*loss_case())
    # Per token: -min(r A, clip(r) A) + beta KL(Q || P).
    per_token = np.array([[-1.0, -1.0 + beta * KAPPA],
                          [-1.2 * 2 + beta * KAPPA, -np.exp(-0.5) * 2]])
    if aggregation == "seq_mean_token_mean":
      expected_sum, expected_den = per_token.mean(1).sum(), 2.0
    else:
      expected_sum, expected_den = per_token.sum(), 4.0
    np.testing.assert_allclose(loss.sum, expected_sum, rtol=1e-5)
    np.testing.assert_allclose(loss.denominator, expected_den)
    kl_tokens = np.array([[0, KAPPA], [KAPPA, 0]])
    np.testing.assert_allclose(metrics["kl"].value, kl_tokens.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_frac"].value, 0.25)

  def test_default_is_the_papers_objective(self):
    # beta = 0.01, clip 0.2, (1/G) sum_i (1/K) sum_t.
    loss, _ = ppow.ppow_loss(*loss_case())
    per_token = np.array([[-1.0, -1.0 + 0.01 * KAPPA], [-2.4 + 0.01 * KAPPA, -2 * np.exp(-0.5)]])
    np.testing.assert_allclose(loss.value, per_token.mean(), rtol=1e-5)

  def test_kl_term_equals_direct_computation(self):
    rng = np.random.default_rng(4)
    drafter = rng.normal(size=(3, 4, 6)).astype(np.float32)
    target = rng.normal(size=(3, 4, 6)).astype(np.float32) * 2
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
    drafts = jnp.zeros((3, 4), jnp.int32)
    logp = distribution.sampling_log_probs(jnp.asarray(drafter), drafts)
    # A = 0: only the KL term remains; beta = 1.
    loss, _ = jax.jit(functools.partial(ppow.ppow_loss, beta=1.0))(
        jnp.asarray(drafter), drafts, logp, jnp.zeros(3), jnp.asarray(target), jnp.asarray(mask))
    kl = special.rel_entr(np_softmax(drafter), np_softmax(target)).sum(-1)  # KL(Q || P)
    expected = np.mean([(kl[i] * mask[i]).sum() / mask[i].sum() for i in range(3)])
    np.testing.assert_allclose(loss.value, expected, rtol=1e-5)

  def test_gradient_flows_through_the_drafter_only(self):
    """A linear drafter and target on shared features: the target's parameters get exactly 0."""
    rng = np.random.default_rng(5)
    feats = jnp.asarray(rng.normal(size=(4, 3, 8)), jnp.float32)
    params = {"drafter": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32),
              "target": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)}
    drafts = jnp.asarray(rng.integers(0, 5, size=(4, 3)), jnp.int32)
    old_logp = distribution.sampling_log_probs(feats @ params["drafter"], drafts) - 0.1
    advantages = jnp.array([1.0, -1.0, 0.5, -0.5])

    def objective(params, old_logp, advantages):
      loss, _ = ppow.ppow_loss(feats @ params["drafter"], drafts, old_logp, advantages,
                               feats @ params["target"], jnp.ones((4, 3)))
      return loss.value

    grads = jax.jit(jax.grad(objective, argnums=(0, 1, 2)))(params, old_logp, advantages)
    np.testing.assert_array_equal(grads[0]["target"], 0.0)
    np.testing.assert_array_equal(grads[1], 0.0)
    np.testing.assert_array_equal(grads[2], 0.0)
    assert np.abs(grads[0]["drafter"]).max() > 1e-3

  def test_kl_gradient_by_hand(self):
    """With A = 0: d(loss)/dz = beta / (N K) * q (log q - log p - KL) at every position."""
    rng = np.random.default_rng(6)
    z = rng.normal(size=(2, 3, 4)).astype(np.float32)
    t = rng.normal(size=(2, 3, 4)).astype(np.float32)
    drafts = jnp.zeros((2, 3), jnp.int32)
    old = distribution.sampling_log_probs(jnp.asarray(z), drafts)
    grad = jax.jit(jax.grad(lambda x: ppow.ppow_loss(x, drafts, old, jnp.zeros(2), jnp.asarray(t),
                                                     jnp.ones((2, 3)), beta=0.5)[0].value))(jnp.asarray(z))
    q, p = np_softmax(z), np_softmax(t)
    kl = (q * np.log(q / p)).sum(-1, keepdims=True)
    np.testing.assert_allclose(grad, 0.5 / 6 * q * (np.log(q / p) - kl), rtol=1e-4, atol=1e-7)

  def test_padded_positions_are_inert(self):
    drafter, drafts, old_logp, advantages, target, _ = loss_case()
    mask = jnp.array([[1, 0], [1, 1]])
    clean, _ = ppow.ppow_loss(drafter, drafts, old_logp, advantages, target, mask)

    @jax.jit
    def dirty(drafter):
      return ppow.ppow_loss(drafter.at[0, 1].set(jnp.nan), drafts.at[0, 1].set(99),
                            old_logp.at[0, 1].set(-jnp.inf), advantages, target.at[0, 1].set(-jnp.inf),
                            mask)[0].value

    np.testing.assert_allclose(dirty(drafter), clean.value, rtol=1e-6)
    assert np.all(np.isfinite(jax.jit(jax.grad(dirty))(drafter)))

  def test_traced_coefficients_and_vmap(self):
    case = loss_case()

    @jax.jit
    def step(beta, eps, gamma, eta, eps_dist, floor):
      loss, _ = ppow.ppow_loss(*case, beta=beta, eps_low=eps, eps_high=eps)
      acc = ppow.accepted_length(case[1], case[4], case[0], verification="expected")
      lp = jnp.zeros((2, 2))
      r = ppow.window_rewards(acc, lp, lp, gamma=gamma, eta=eta, eps=eps_dist)
      return loss.value, r.total, ppow.adaw_probabilities(r.total, floor=floor)

    value, _, probs = step(0.01, 0.2, 0.12, 0.2, 1.0, 0.1)
    np.testing.assert_allclose(value, ppow.ppow_loss(*case)[0].value, rtol=1e-6)
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-6)
    # vmap over prefixes of [G, K] groups equals the flat call.
    drafts, target, drafter, _ = sampling_case()
    flat = ppow.accepted_length(drafts[:4], target[:4], drafter[:4], verification="expected").length
    grouped = jax.vmap(functools.partial(ppow.accepted_length, verification="expected"))(
        drafts[:4].reshape(2, 2, 3), target[:4].reshape(2, 2, 3, 4), drafter[:4].reshape(2, 2, 3, 4)).length
    np.testing.assert_allclose(grouped.reshape(-1), flat)

  def test_ppow_steps_raise_acceptance(self):
    """Sign check: a few PPOW updates (beta = 0, so only the reward signal acts) raise the drafter's E[k].

    Position-wise drafter logits (no context), a fixed peaked target; 4 prefixes x 8 windows, K = 4.
    (A pilot with the advantages' sign flipped: E[k] 0.68 -> 0.17 over the same 20 steps; here 0.68 -> 1.94.)
    """
    num_prefixes, g, k, v = 4, 8, 4, 6
    target = 3.0 * jax.random.normal(jax.random.key(0), (num_prefixes, k, v))
    ids = jnp.repeat(jnp.arange(num_prefixes), g)
    target_w = jnp.repeat(target, g, axis=0)

    def expected_k(theta):
      # Positions are independent here, so over drafts d_i ~ Q_i and uniforms, position i is accepted with
      # probability alpha_i = sum_v min(P_i(v), Q_i(v)), and E[k] = sum_j prod_{i<=j} alpha_i exactly.
      alpha = np.minimum(np_softmax(target), np_softmax(theta)).sum(-1)
      return np.cumprod(alpha, -1).sum(-1).mean()

    @jax.jit
    def update(theta, key):
      logits = jnp.repeat(theta, g, axis=0)
      drafts = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
      old = distribution.sampling_log_probs(logits, drafts)
      acc = ppow.accepted_length(drafts, target_w, logits, verification="expected")
      lp = jnp.zeros(drafts.shape)
      adv = ppow.window_advantages(ppow.window_rewards(acc, lp, lp).total, ids, num_prefixes)

      def loss_fn(theta):
        return ppow.ppow_loss(jnp.repeat(theta, g, axis=0), drafts, old, adv, target_w, jnp.ones((g * 4, k)),
                              beta=0.0)[0].value

      return theta - 8.0 * jax.grad(loss_fn)(theta)

    theta = jnp.zeros((num_prefixes, k, v))
    before = expected_k(theta)
    for key in jax.random.split(jax.random.key(1), 20):
      theta = update(theta, key)
    after = expected_k(theta)
    assert after > before + 1.0, (before, after)
