"""Tests of lemon_rl.losses.advantages: GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, GiGPO.

By-hand tests run under ``chex.variants`` (eager, ``jax.jit``, ``jax.pmap``). Rows split over a named axis
(``axis_name``) are tested with ``jax.vmap(..., axis_name=...)``, which has the collective semantics of
``pmap`` on the one CPU device pytest sees; tests/test_loss_transforms.py does the same over 4 fake devices.
"""

import collections
import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lemon_rl import losses
from lemon_rl.losses import advantages as adv_lib

EPS = 1e-6


pytestmark = pytest.mark.usefixtures("pmap_variant_on_one_device")

# ---------------------------------------------------------------------------------------------------
# Independent NumPy transcriptions (METHODS.md sections 0 and 5), float64, Python loops over groups.
# ---------------------------------------------------------------------------------------------------


def np_groups(ids):
  groups = collections.defaultdict(list)
  for i, g in enumerate(ids):
    groups[int(g)].append(i)
  return groups


def np_grpo(r, ids, scale=True):
  out = np.zeros(len(r))
  for members in np_groups(ids).values():
    x = r[members]
    if len(x) == 1:
      continue
    d = x - x.mean()
    out[members] = d / (x.std(ddof=1) + EPS) if scale else d
  return out


def np_rloo(r, ids):
  out = np.zeros(len(r))
  for members in np_groups(ids).values():
    if len(members) > 1:
      for i in members:
        out[i] = r[i] - (r[members].sum() - r[i]) / (len(members) - 1)
  return out


def np_reinforce_pp(r, ids):
  a = np.zeros(len(r))
  for members in np_groups(ids).values():
    a[members] = r[members] - r[members].mean()
  return (a - a.mean()) / (a.std(ddof=1) + EPS)


def np_gigpo(ep_r, step_r, mask, anchors, ids, gamma, omega, scale=True, step_row=False):
  n, t = step_r.shape
  lengths = mask.sum(1).astype(int)
  # Episode advantage: each trajectory once (or once per valid step).
  ep = np.zeros(n)
  for members in np_groups(ids).values():
    vals = np.concatenate([[ep_r[i]] * (lengths[i] if step_row else 1) for i in members])
    if len(vals) < 2:
      continue
    for i in members:
      d = ep_r[i] - vals.mean()
      ep[i] = d / (vals.std(ddof=1) + EPS) if scale else d
  # Discounted step returns (verl-agent's backward recursion).
  ret = np.zeros((n, t))
  for i in range(n):
    running = 0.0
    for k in reversed(range(lengths[i])):
      running = step_r[i, k] + gamma * running
      ret[i, k] = running
  # Step groups: identical anchors within a group.
  step_groups = collections.defaultdict(list)
  for i in range(n):
    for k in range(lengths[i]):
      step_groups[(int(ids[i]), int(anchors[i, k]))].append((i, k))
  st = np.zeros((n, t))
  for cells in step_groups.values():
    if len(cells) < 2:
      continue
    vals = np.array([ret[c] for c in cells])
    for c in cells:
      d = ret[c] - vals.mean()
      st[c] = d / (vals.std(ddof=1) + EPS) if scale else d
  valid = np.arange(t)[None] < lengths[:, None]
  return np.where(valid, ep[:, None] + omega * st, 0.0), ep, st, ret


# ---------------------------------------------------------------------------------------------------
# Outcome estimators.
# ---------------------------------------------------------------------------------------------------

# Group 0: rewards {1, 0, 1}; group 1: {0.3, 0.3, 0.3} (all equal); group 2: {5} (a group of one).
REWARDS = jnp.array([1.0, 0.0, 1.0, 0.3, 0.3, 0.3, 5.0])
IDS = jnp.array([0, 0, 0, 1, 1, 1, 2])
SQRT3 = np.sqrt(3.0)


class OutcomeEstimatorTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.named_parameters(
      # Group 0: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = 1/sqrt(3):
      # A = (1/3) sqrt(3) = 0.57735, (-2/3) sqrt(3) = -1.1547.
      ("grpo", "grpo", [SQRT3 / 3, -2 * SQRT3 / 3, SQRT3 / 3, 0, 0, 0, 0]),
      # Dr.GRPO: r - mean.
      ("dr_grpo", "dr_grpo", [1 / 3, -2 / 3, 1 / 3, 0, 0, 0, 0]),
      # RLOO: 1 - (0 + 1) / 2 = 0.5, 0 - (1 + 1) / 2 = -1.
      ("rloo", "rloo", [0.5, -1.0, 0.5, 0, 0, 0, 0]),
  )
  def test_by_hand(self, name, expected):
    fn = self.variant(functools.partial(losses.ADVANTAGE_ESTIMATORS.get(name), num_groups=3))
    out = fn(REWARDS, IDS)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)

  @parameterized.parameters("grpo", "dr_grpo", "rloo")
  def test_all_equal_and_singleton_groups_are_exactly_zero(self, name):
    fn = losses.ADVANTAGE_ESTIMATORS.get(name)
    rewards = jnp.array([0.1] * 7 + [0.7, 0.7] + [3.0] + [1e6 + 0.5] * 4, jnp.float32)
    ids = jnp.array([0] * 7 + [1, 1] + [2] + [3] * 4)
    chex.assert_trees_all_equal(fn(rewards, ids, 4), jnp.zeros(14))

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_reinforce_pp_baseline_by_hand(self):
    rewards = jnp.array([1.0, 0.0, 1.0, 2.0, 4.0, 7.0])
    ids = jnp.array([0, 0, 0, 1, 1, 2])
    # a = r - group mean = [1/3, -2/3, 1/3, -1, 1, 0]; batch mean 0;
    # unbiased batch std sqrt((1/9 + 4/9 + 1/9 + 1 + 1 + 0) / 5) = sqrt(8/15).
    a = np.array([1 / 3, -2 / 3, 1 / 3, -1.0, 1.0, 0.0])
    fn = self.variant(functools.partial(losses.reinforce_pp_baseline, num_groups=3))
    # atol: the batch mean of a is 0 up to the rounding of its 6 additions (6 eps max|a| ~ 1e-6).
    np.testing.assert_allclose(fn(rewards, ids), a / (np.sqrt(8 / 15) + EPS), rtol=1e-5, atol=1e-6)
    # Token-level whitening: weight 2 on the first row = the row duplicated.
    weighted = losses.reinforce_pp_baseline(rewards, ids, 3, batch_weights=jnp.array([2.0, 1, 1, 1, 1, 1]))
    a_dup = np.concatenate([[a[0]], a])
    expected = (a - a_dup.mean()) / (a_dup.std(ddof=1) + EPS)
    np.testing.assert_allclose(weighted, expected, rtol=1e-5)

  @parameterized.product(seed=(0, 1, 2), name=("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"))
  def test_against_numpy(self, seed, name):
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(6), rng.integers(1, 6, size=6))  # group sizes 1..5
    rng.shuffle(ids)
    rewards = rng.normal(size=len(ids)).astype(np.float32)
    if seed == 1:
      rewards = (rewards > 0).astype(np.float32)  # binary verifier rewards
    reference = {"grpo": np_grpo, "dr_grpo": functools.partial(np_grpo, scale=False), "rloo": np_rloo,
                 "reinforce_pp_baseline": np_reinforce_pp}[name]
    out = losses.ADVANTAGE_ESTIMATORS.get(name)(rewards, ids, 6)
    np.testing.assert_allclose(out, reference(rewards.astype(np.float64), ids), rtol=2e-5, atol=2e-5)

  @parameterized.parameters("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
  def test_valid_mask_equals_dropping_rows(self, name):
    fn = losses.ADVANTAGE_ESTIMATORS.get(name)
    rewards = jnp.array([1.0, 0.0, 9.0, 1.0, 0.5, 2.0, -3.0])
    ids = jnp.array([0, 0, 0, 0, 1, 1, 1])
    valid = jnp.array([1, 1, 0, 1, 1, 1, 0])
    keep = np.asarray(valid) == 1
    out = fn(rewards, ids, 2, valid=valid)
    np.testing.assert_allclose(np.asarray(out)[keep], fn(rewards[keep], ids[keep], 2), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out)[~keep], 0.0)

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "group_ids holds 3"):
      losses.grpo(REWARDS, IDS.at[0].set(3), 3)
    with self.assertRaises(AssertionError):
      losses.grpo(REWARDS, IDS.astype(jnp.float32), 3)
    with self.assertRaises(AssertionError):
      losses.grpo(REWARDS[:3], IDS, 3)
    with self.assertRaisesRegex(KeyError, "registered: grpo, dr_grpo, rloo, reinforce_pp_baseline, gigpo"):
      losses.ADVANTAGE_ESTIMATORS.get("ppo")


OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
F32_EPS = float(np.finfo(np.float32).eps)


def split_call(name, rewards, ids, num_groups, devices, **kwargs):
  """The estimator with the rows split into ``devices`` equal slices along a vmapped named axis."""
  fn = losses.ADVANTAGE_ESTIMATORS.get(name)
  split = lambda x: None if x is None else jnp.asarray(x).reshape(devices, -1)
  arrays = {k: split(v) for k, v in kwargs.items()}
  out = jax.vmap(lambda r, i, a: fn(r, i, num_groups, axis_name="dev", **a), axis_name="dev")(
      split(rewards), split(ids), arrays)
  return np.asarray(out).reshape(-1)


class AxisNameTest(parameterized.TestCase):
  """Group statistics reduced across a named axis equal the single-device ones."""

  @parameterized.product(name=OUTCOME_ESTIMATORS, seed=(0, 1), devices=(2, 4), with_valid=(False, True))
  def test_rows_split_over_an_axis_equal_one_device(self, name, seed, devices, with_valid):
    rng = np.random.default_rng(seed)
    n, g = 24, 5
    ids = rng.integers(0, g, size=n).astype(np.int32)  # random group sizes; groups straddle the slices
    rewards = rng.normal(size=n).astype(np.float32)
    if seed == 1:
      rewards = (rewards > 0).astype(np.float32)
    kwargs = {"valid": (rng.uniform(size=n) < 0.8).astype(np.float32)} if with_valid else {}
    if name == "reinforce_pp_baseline":
      kwargs["batch_weights"] = rng.integers(1, 5, size=n).astype(np.float32)
    whole = np.asarray(losses.ADVANTAGE_ESTIMATORS.get(name)(rewards, ids, g, **kwargs))
    split = split_call(name, rewards, ids, g, devices, **kwargs)
    # Only the order of the float32 additions differs: each group (and REINFORCE++'s batch) statistic is a
    # sum of at most n terms, changed by at most n * eps * (sum of |terms|) <= n^2 * eps * max|r - shift|
    # (the deviations from the group max are bounded by the reward range, 2 * max|r| here); the
    # normalisation divides by std + eps >= std, and the deviations over std are at most n-ish, so the
    # advantages move by at most ~4 n^2 eps (1 + max|A|).
    tol = 4 * n * n * F32_EPS * (1 + np.abs(whole).max())
    np.testing.assert_allclose(split, whole, atol=tol, rtol=0)
    if with_valid:
      np.testing.assert_array_equal(split[kwargs["valid"] == 0], 0.0)

  @parameterized.parameters(*OUTCOME_ESTIMATORS)
  def test_all_equal_groups_split_over_an_axis_are_exactly_zero(self, name):
    rewards = np.array([0.1, 0.7, 0.1, 0.7, 0.1, 0.7, 0.1, 0.7], np.float32)
    ids = np.array([0, 1, 0, 1, 0, 1, 0, 1], np.int32)  # each group has one member on every slice
    out = split_call(name, rewards, ids, 2, 4)
    if name == "reinforce_pp_baseline":  # group baselines 0 -> a = 0 -> (0 - 0) / (0 + eps) = 0
      np.testing.assert_array_equal(out, 0.0)
    else:
      np.testing.assert_array_equal(out, np.zeros(8))

  def test_pmap_variant_on_the_available_devices(self):
    # jax.pmap over every local device (one under pytest): the rows of each device are its own slice.
    d = jax.local_device_count()
    rewards = jnp.tile(REWARDS, d).reshape(d, -1)
    ids = jnp.tile(IDS, d).reshape(d, -1)
    out = jax.pmap(lambda r, i: losses.grpo(r, i, 3, axis_name="dev"), axis_name="dev")(rewards, ids)
    np.testing.assert_allclose(out[0], losses.grpo(REWARDS, IDS, 3), rtol=1e-6, atol=1e-7)

  def test_gigpo_rejects_axis_name(self):
    with self.assertRaisesRegex(ValueError, "groups? must stay on one device"):
      losses.gigpo(EP_R, STEP_R, STEP_MASK, ANCHORS, GROUPS, 2, axis_name="dev")


# ---------------------------------------------------------------------------------------------------
# GiGPO.
# ---------------------------------------------------------------------------------------------------

# Group 0: three trajectories; group 1: one trajectory that revisits group 0's anchor id 0.
EP_R = jnp.array([1.0, 0.0, 1.0, 1.0])
STEP_R = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
STEP_MASK = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]])
ANCHORS = jnp.array([[0, 1, 2], [0, 1, 5], [0, 3, 0], [0, 0, 7]])
GROUPS = jnp.array([0, 0, 0, 1])

# One compilation per call shape (eager GiGPO compiles dozens of small ops).
_gigpo = jax.jit(losses.gigpo, static_argnames=("num_groups", "scale_by_std", "episode_stats"))


class GiGPOTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_by_hand(self):
    fn = self.variant(functools.partial(losses.gigpo, num_groups=2, gamma=0.5, omega=1.0))
    out = fn(EP_R, STEP_R, STEP_MASK, ANCHORS, GROUPS)
    self.assertIsInstance(out, losses.GiGPOAdvantages)
    # Episode: group 0 rewards {1, 0, 1} -> [1/sqrt3, -2/sqrt3, 1/sqrt3]; group 1 is a group of one -> 0.
    ep = np.array([SQRT3 / 3, -2 * SQRT3 / 3, SQRT3 / 3, 0.0])
    np.testing.assert_allclose(out.episode, ep, rtol=1e-5)
    # Returns (gamma 0.5): [0.25, 0.5, 1], [0, 0, -], [0.5, 1, -], [0.25, 0.5, 1].
    np.testing.assert_allclose(out.step_returns, [[0.25, 0.5, 1], [0, 0, 0], [0.5, 1, 0], [0.25, 0.5, 1]])
    # Step groups of group 0: anchor 0 = {0.25, 0, 0.5}: mean 0.25, std 0.25 -> [0, -1, 1];
    # anchor 1 = {0.5, 0}: mean 0.25, std sqrt(0.125) -> +-1/sqrt2; anchors 2, 3 singletons -> 0.
    # Group 1: anchor 0 at t0 and t1 = {0.25, 0.5} -> -+1/sqrt2 (not merged with group 0's anchor 0).
    r2 = 1 / np.sqrt(2)
    step = np.array([[0, r2, 0], [-1, -r2, 0], [1, 0, 0], [-r2, r2, 0]])
    np.testing.assert_allclose(out.step, step, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.advantages, np.where(STEP_MASK, ep[:, None] + step, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.step_group_size, [[3, 2, 1], [3, 2, 0], [3, 1, 0], [2, 2, 1]])

  def test_by_hand_without_std_and_per_step_rows(self):
    out = _gigpo(EP_R, STEP_R, STEP_MASK, ANCHORS, GROUPS, 2, gamma=0.5, omega=0.5,
                       scale_by_std=False)
    np.testing.assert_allclose(out.episode, [1 / 3, -2 / 3, 1 / 3, 0], rtol=1e-6)
    np.testing.assert_allclose(out.step, [[0, 0.25, 0], [-0.25, -0.25, 0], [0.25, 0, 0], [-0.125, 0.125, 0]],
                               atol=1e-7)
    np.testing.assert_allclose(out.advantages[1, :2], [-2 / 3 - 0.125, -2 / 3 - 0.125], rtol=1e-6)
    # Per-step-row episode statistics: trajectories of 3, 2, 2 steps -> weighted mean 5/7,
    # unbiased var (3 (2/7)^2 + 2 (5/7)^2 + 2 (2/7)^2) / 6 = 5/21.
    rows = _gigpo(EP_R, STEP_R, STEP_MASK, ANCHORS, GROUPS, 2, gamma=0.5, episode_stats="step_row")
    std = np.sqrt(5 / 21)
    np.testing.assert_allclose(rows.episode[:3], [(2 / 7) / std, (-5 / 7) / std, (2 / 7) / std], rtol=1e-5)

  def test_singletons_and_degenerate_groups(self):
    # One trajectory, all anchors distinct: every advantage is 0.
    out = _gigpo(jnp.array([1.0]), jnp.array([[0.0, 1.0]]), jnp.ones((1, 2)), jnp.array([[0, 1]]),
                       jnp.array([0]), 1)
    chex.assert_trees_all_equal(out.advantages, jnp.zeros((1, 2)))
    # All trajectories identical: episode and step advantages exactly 0.
    out = _gigpo(jnp.full((3,), 0.7), jnp.full((3, 2), 0.1), jnp.ones((3, 2)), jnp.array([[0, 1]] * 3),
                       jnp.zeros(3, jnp.int32), 1)
    chex.assert_trees_all_equal(out.advantages, jnp.zeros((3, 2)))
    # Padding trajectories (valid = 0) change nothing and get 0.
    base = _gigpo(EP_R, STEP_R, STEP_MASK, ANCHORS, GROUPS, 2, gamma=0.5)
    pad = lambda x, v: jnp.concatenate([x, jnp.full((1,) + x.shape[1:], v, x.dtype)])
    padded = _gigpo(pad(EP_R, 9.0), pad(STEP_R, 9.0), pad(STEP_MASK, 1), pad(ANCHORS, 0), pad(GROUPS, 0), 2,
                          gamma=0.5, valid=jnp.array([1, 1, 1, 1, 0]))
    np.testing.assert_allclose(padded.advantages[:4], base.advantages, rtol=1e-6)
    np.testing.assert_array_equal(padded.advantages[4], 0.0)

  @parameterized.product(seed=(0, 1, 2), scale=(True, False), step_row=(False, True))
  def test_against_numpy(self, seed, scale, step_row):
    rng = np.random.default_rng(seed)
    n, t, g = 12, 5, 3
    ids = rng.integers(0, g, size=n)
    lengths = rng.integers(1, t + 1, size=n)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    anchors = rng.integers(0, 3, size=(n, t))
    step_r = (rng.uniform(size=(n, t)) < 0.3).astype(np.float32) * rng.normal(size=(n, t)).astype(np.float32)
    ep_r = (rng.uniform(size=n) < 0.5).astype(np.float32)
    out = _gigpo(ep_r, step_r, mask, anchors, ids, g, gamma=0.9, omega=0.7, scale_by_std=scale,
                       episode_stats="step_row" if step_row else "trajectory")
    adv, ep, st, ret = np_gigpo(ep_r.astype(np.float64), step_r.astype(np.float64), mask, anchors, ids, 0.9, 0.7,
                                scale, step_row)
    np.testing.assert_allclose(out.step_returns, ret, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.episode, ep, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.where(mask != 0, out.step, 0), np.where(mask != 0, st, 0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.advantages, adv, rtol=1e-4, atol=1e-5)

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "episode_stats"):
      losses.gigpo(EP_R, STEP_R, STEP_MASK, ANCHORS, GROUPS, 2, episode_stats="steps")
    with self.assertRaises(AssertionError):
      losses.gigpo(EP_R, STEP_R, STEP_MASK, ANCHORS.astype(jnp.float32), GROUPS, 2)
    with self.assertRaisesRegex(ValueError, "group_ids holds 2"):
      losses.gigpo(EP_R, STEP_R, STEP_MASK, ANCHORS, GROUPS.at[0].set(2), 2)

  def test_step_discounted_returns(self):
    r = jnp.array([[1.0, 2.0, 4.0, 8.0]])
    m = jnp.array([[1, 1, 1, 0]])
    # G2 = 4; G1 = 2 + 0.5 * 4 = 4; G0 = 1 + 0.5 * 4 = 3; masked step -> 0.
    np.testing.assert_allclose(adv_lib.step_discounted_returns(r, m, 0.5), [[3.0, 4.0, 4.0, 0.0]])


if __name__ == "__main__":
  pytest.main([__file__])
