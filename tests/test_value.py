"""Tests of lemon_rl.losses.value: GAE, the clipped value loss, explained variance, whitening, turn mapping.

By-hand tests run under ``chex.variants`` (eager, ``jax.jit``, ``jax.pmap`` over the one CPU device pytest
sees). Rows split over a named axis are tested with ``jax.vmap(..., axis_name=...)``, which has ``pmap``'s
collective semantics.
"""

import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl import losses
from lemon_rl import ops
from lemon_rl.envs.protocol import FinishStatus
from lemon_rl.models import Transformer, get_preset
from lemon_rl.training import multiturn

pytestmark = pytest.mark.usefixtures("pmap_variant_on_one_device")

NAN = float("nan")

# ---------------------------------------------------------------------------------------------------
# An independent NumPy transcription: float64, Python loops, the next valid step found by search.
# ---------------------------------------------------------------------------------------------------


def np_gae(rewards, values, mask, gamma, lam, bootstrap=None):
  n, t = rewards.shape
  adv, ret = np.zeros((n, t)), np.zeros((n, t))
  for i in range(n):
    steps = [k for k in range(t) if mask[i, k]]
    for pos, k in enumerate(steps):
      # A_k = sum_{l >= 0} (gamma lam)^l delta_{k_l}, over the valid steps k_0 = k < k_1 < ...
      total = 0.0
      for l, kl in enumerate(steps[pos:]):
        following = steps[pos + l + 1] if pos + l + 1 < len(steps) else None
        v_next = values[i, following] if following is not None else (0.0 if bootstrap is None else bootstrap[i])
        delta = rewards[i, kl] + gamma * v_next - values[i, kl]
        total += (gamma * lam) ** l * delta
      adv[i, k] = total
      ret[i, k] = total + values[i, k]
  return adv, ret


# ---------------------------------------------------------------------------------------------------
# GAE.
# ---------------------------------------------------------------------------------------------------

# Row 0: four steps; row 1: two steps, then a masked tail holding NaN (must not leak).
REWARDS = np.array([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, NAN, 5.0]], np.float32)
VALUES = np.array([[0.5, 1.0, 0.5, 0.25], [1.0, 2.0, NAN, 7.0]], np.float32)
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)
GAMMA = 0.5


class GAETest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.named_parameters(
      # lam = 1: discounted returns G minus V. Row 0: G = [1 + .5 * 1, 0 + .5 * 2, 2, 0] = [1.5, 1, 2, 0];
      # row 1: G = [0 + .5 * 1, 1] = [0.5, 1].
      ("lam1", 1.0, [[1.0, 0.0, 1.5, -0.25], [-0.5, -1.0, 0, 0]], [[1.5, 1.0, 2.0, 0.0], [0.5, 1.0, 0, 0]]),
      # lam = 0: one-step TD errors r + .5 V_next - V. Row 0: [1 + .5 - .5, 0 + .25 - 1, 2 + .125 - .5,
      # 0 - .25]; row 1: [0 + 1 - 1, 1 + 0 - 2].
      ("lam0", 0.0, [[1.0, -0.75, 1.625, -0.25], [0.0, -1.0, 0, 0]],
       [[1.5, 0.25, 2.125, 0.0], [1.0, 1.0, 0, 0]]),
      # lam = .5: A_t = delta_t + .25 A_{t+1}: -.25; 1.625 - .0625; -.75 + .390625; 1 - .08984375.
      ("lam_half", 0.5, [[0.91015625, -0.359375, 1.5625, -0.25], [-0.25, -1.0, 0, 0]],
       [[1.41015625, 0.640625, 2.0625, 0.0], [0.75, 1.0, 0, 0]]),
  )
  def test_by_hand(self, lam, advantages, returns):
    fn = self.variant(functools.partial(losses.gae, gamma=GAMMA, lam=lam))
    out = fn(REWARDS, VALUES, MASK)
    self.assertIsInstance(out, losses.GAEAdvantages)
    # Every term is a dyadic rational with few bits: float32 is exact up to one rounding per operation.
    np.testing.assert_allclose(out.advantages, advantages, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out.returns, returns, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out.advantages[1, 2:], 0.0)  # exactly 0 on the masked tail, no NaN
    np.testing.assert_array_equal(out.returns[1, 2:], 0.0)

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_bootstrap_for_truncation(self):
    fn = self.variant(functools.partial(losses.gae, gamma=GAMMA, lam=1.0))
    out = fn(REWARDS, VALUES, MASK, bootstrap_values=jnp.array([2.0, 4.0]))
    # lam = 1: G_t = discounted rewards + gamma^(steps left) * bootstrap.
    # Row 0: G_3 = 0 + .5 * 2 = 1, G_2 = 2.5, G_1 = 1.25, G_0 = 1.625 (the bootstrap follows step 3).
    # Row 1: the bootstrap follows its last *valid* step 1: G_1 = 1 + .5 * 4 = 3, G_0 = 1.5.
    np.testing.assert_allclose(out.returns, [[1.625, 1.25, 2.5, 1.0], [1.5, 3.0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(out.advantages, [[1.125, 0.25, 2.0, 0.75], [0.5, 1.0, 0, 0]], rtol=1e-6)

  @parameterized.parameters(0, 1, 2)
  def test_against_numpy_on_ragged_rows(self, seed):
    rng = np.random.default_rng(seed)
    n, t = 6, 9
    lengths = rng.integers(0, t + 1, size=n)
    lengths[0], lengths[1] = 0, t  # an empty row and a full row
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    if seed == 2:  # holes (token-level use: prompt and observation positions masked inside the row)
      mask = (rng.random((n, t)) < 0.6).astype(np.float32)
    rewards = rng.normal(size=(n, t)).astype(np.float32)
    values = rng.normal(size=(n, t)).astype(np.float32)
    rewards[mask == 0], values[mask == 0] = np.nan, np.inf  # garbage on masked steps must not leak
    bootstrap = rng.normal(size=n).astype(np.float32) if seed else None
    gamma, lam = 0.9, 0.8
    out = jax.jit(losses.gae)(rewards, values, mask, gamma=gamma, lam=lam,
                              bootstrap_values=bootstrap)
    adv, ret = np_gae(rewards.astype(np.float64), values.astype(np.float64), mask, gamma, lam,
                      None if bootstrap is None else bootstrap.astype(np.float64))
    # float32 recursion over <= 9 steps of O(1) terms: ~9 roundings of relative size 6e-8 each.
    np.testing.assert_allclose(out.advantages, adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.returns, ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.advantages)[mask == 0], 0.0)

  def test_holes_are_skipped(self):
    # Steps at columns 1 and 3 of a row with holes give what the compacted row [r1, r3] gives.
    r = jnp.array([[9.0, 1.0, 9.0, 2.0, 9.0]])
    v = jnp.array([[9.0, 0.5, 9.0, 1.5, 9.0]])
    m = jnp.array([[0, 1, 0, 1, 0]])
    holes = losses.gae(r, v, m, gamma=0.9, lam=0.7)
    compact = losses.gae(r[:, 1::2][:, :2], v[:, 1::2][:, :2], jnp.ones((1, 2)), gamma=0.9, lam=0.7)
    np.testing.assert_allclose(holes.advantages[:, [1, 3]], compact.advantages, rtol=1e-6)

  def test_no_gradient_and_traced_coefficients(self):
    def total(values, gamma):
      out = losses.gae(REWARDS, values, MASK, gamma=gamma, lam=0.9)
      return jnp.sum(out.advantages) + jnp.sum(out.returns)

    g = jax.grad(total)(jnp.asarray(VALUES), 0.5)
    np.testing.assert_array_equal(g, 0.0)
    # gamma traced under jit: one compilation serves two discounts.
    fn = jax.jit(lambda gamma: losses.gae(REWARDS, VALUES, MASK, gamma=gamma, lam=1.0).returns)
    np.testing.assert_allclose(fn(0.5)[0], [1.5, 1.0, 2.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(fn(1.0)[0], [3.0, 2.0, 2.0, 0.0], rtol=1e-6)

  def test_rejects_bad_coefficients(self):
    with self.assertRaisesRegex(ValueError, "gamma"):
      losses.gae(REWARDS, VALUES, MASK, gamma=1.5, lam=1.0)
    with self.assertRaisesRegex(ValueError, "lam"):
      losses.gae(REWARDS, VALUES, MASK, gamma=0.5, lam=-0.1)


# ---------------------------------------------------------------------------------------------------
# The clipped value loss.
# ---------------------------------------------------------------------------------------------------

# Cases (clip range 0.2), row-major; the last is masked and holds garbage.
#   1. V=1.0, old=1.0, R=2.0: no clip, 0.5 * 1 = 0.5, dl/dV = V - R = -1.
#   2. V=1.5, old=1.0, R=2.0: V_clip = 1.2; (1.5-2)^2 = .25 < (1.2-2)^2 = .64: clipped side, 0.32, grad 0.
#   3. V=1.5, old=1.0, R=1.0: V_clip = 1.2; .25 > .04: unclipped side, 0.125, grad 0.5.
#   4. V=0.5, old=1.0, R=0.0: V_clip = 0.8; .25 < .64: clipped side, 0.32, grad 0.
#   5. V=0.5, old=1.0, R=2.0: V_clip = 0.8; 2.25 > 1.44: unclipped side, 1.125, grad -1.5.
V = np.array([[1.0, 1.5, 1.5], [0.5, 0.5, NAN]], np.float32)
OLD = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, np.inf]], np.float32)
RET = np.array([[2.0, 2.0, 1.0], [0.0, 2.0, NAN]], np.float32)
VMASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)


class ClippedValueLossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_by_hand_clipped(self):
    fn = self.variant(losses.clipped_value_loss)
    loss, metrics = fn(V, OLD, RET, VMASK, clip_range=0.2)
    np.testing.assert_allclose(loss.sum, 0.5 + 0.32 + 0.125 + 0.32 + 1.125, rtol=1e-6)
    np.testing.assert_allclose(loss.denominator, 5.0)
    np.testing.assert_allclose(metrics["value_clip_frac"].value, 2 / 5, rtol=1e-6)
    np.testing.assert_allclose(metrics["value_mean"].value, 1.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["return_mean"].value, 1.4, rtol=1e-6)
    np.testing.assert_allclose(metrics["residual_sq_mean"].value, 0.8, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_by_hand_unclipped(self):
    fn = self.variant(losses.clipped_value_loss)
    loss, metrics = fn(V, OLD, RET, VMASK)
    np.testing.assert_allclose(loss.sum, 0.5 * (1 + 0.25 + 0.25 + 0.25 + 2.25), rtol=1e-6)
    np.testing.assert_allclose(loss.denominator, 5.0)
    np.testing.assert_array_equal(metrics["value_clip_frac"].value, 0.0)

  @parameterized.named_parameters(
      ("clipped", 0.2, [[-1.0, 0.0, 0.5], [0.0, -1.5, 0.0]]),
      ("unclipped", None, [[-1.0, -0.5, 0.5], [0.5, -1.5, 0.0]]),
  )
  def test_gradient(self, clip_range, expected):
    def total(values, old, ret):
      return losses.clipped_value_loss(values, old, ret, VMASK, clip_range=clip_range)[0].sum

    g_v, g_old, g_ret = jax.grad(total, argnums=(0, 1, 2))(V, OLD, RET)
    # Zero (not merely small) where the clipped side is chosen; no NaN from the masked garbage.
    np.testing.assert_allclose(g_v, expected, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(g_old, 0.0)  # old values and returns are constants
    np.testing.assert_array_equal(g_ret, 0.0)

  def test_tie_keeps_the_unclipped_gradient(self):
    # V=1.5, old=1.0, c=0.25: V_clip = 1.25 (clip active); R = 1.375 is mid-way, both squares are exactly
    # 0.015625 in float32. The unclipped gradient V - R = 0.125 is kept (jnp.maximum would halve it).
    v, old, ret = (jnp.array([[x]], jnp.float32) for x in (1.5, 1.0, 1.375))
    g = jax.grad(lambda v: losses.clipped_value_loss(v, old, ret, jnp.ones((1, 1)), clip_range=0.25)[0].sum)(v)
    np.testing.assert_array_equal(g, [[0.125]])

  @parameterized.parameters("token_mean", "seq_mean_token_mean")
  def test_microbatches_add_up(self, aggregation):
    rng = np.random.default_rng(0)
    v, old, ret = (rng.normal(size=(4, 5)).astype(np.float32) for _ in range(3))
    m = (rng.random((4, 5)) < 0.7).astype(np.float32)
    fn = functools.partial(losses.clipped_value_loss, clip_range=0.3, aggregation=aggregation)
    whole, met = fn(v, old, ret, m)
    a, met_a = fn(v[:2], old[:2], ret[:2], m[:2])
    b, met_b = fn(v[2:], old[2:], ret[2:], m[2:])
    np.testing.assert_allclose((a + b).value, whole.value, rtol=1e-6)
    merged = ops.merge_metrics(met_a, met_b)
    for k in met:
      np.testing.assert_allclose(merged[k].value, met[k].value, rtol=1e-5, atol=1e-7)

  def test_rejects_bad_clip_range(self):
    with self.assertRaisesRegex(ValueError, "clip_range"):
      losses.clipped_value_loss(V, OLD, RET, VMASK, clip_range=0.0)


# ---------------------------------------------------------------------------------------------------
# Explained variance and whitening.
# ---------------------------------------------------------------------------------------------------


def _split_rows(fn, *arrays, devices=2):
  """``fn`` on the rows split over ``devices`` slices of a vmapped named axis ``"dev"``."""
  split = [a.reshape(devices, a.shape[0] // devices, *a.shape[1:]) for a in arrays]
  return jax.vmap(functools.partial(fn, axis_name="dev"), axis_name="dev")(*split)


class BatchStatisticsTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(1)
    self.ret = rng.normal(size=(4, 6)).astype(np.float32)
    self.v = (self.ret + 0.5 * rng.normal(size=(4, 6))).astype(np.float32)
    self.m = (rng.random((4, 6)) < 0.7).astype(np.float32)
    self.v[self.m == 0] = np.nan

  def test_explained_variance(self):
    sel = self.m != 0
    r, v = self.ret[sel].astype(np.float64), self.v[sel].astype(np.float64)
    expected = 1 - np.var(r - v) / np.var(r)
    # Population variances of ~17 O(1) float32 terms: a few 1e-7 relative; the ratio doubles it.
    np.testing.assert_allclose(losses.explained_variance(self.v, self.ret, self.m), expected, rtol=1e-5)
    _, metrics = losses.clipped_value_loss(self.v, self.v, self.ret, self.m)
    # From E[x^2] - E[x]^2: cancellation costs about Var/E[x^2] ~ 1 digit.
    np.testing.assert_allclose(losses.explained_variance_from_metrics(metrics), expected, rtol=1e-4)
    values = {k: m.value for k, m in metrics.items()}
    np.testing.assert_allclose(losses.explained_variance_from_metrics(values), expected, rtol=1e-4)
    split = _split_rows(losses.explained_variance, self.v, self.ret, self.m)
    np.testing.assert_allclose(split, [expected, expected], rtol=1e-5)
    # Perfect critic -> 1; constant returns -> undefined (NaN).
    self.assertAlmostEqual(float(losses.explained_variance(self.ret, self.ret, self.m)), 1.0, places=6)
    self.assertTrue(np.isnan(losses.explained_variance(self.v, jnp.ones_like(self.ret), self.m)))

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_explained_variance_by_hand(self):
    # R = [0, 2, 4], V = [1, 2, 3]: Var R = 8/3, R - V = [-1, 0, 1], Var = 2/3 -> EV = 1 - 1/4.
    fn = self.variant(losses.explained_variance)
    # The masked entry (V = NaN, R = -50) must not count.
    ev = fn(jnp.array([[1.0, 2.0], [3.0, NAN]]), jnp.array([[0.0, 2.0], [4.0, -50.0]]),
            jnp.array([[1, 1], [1, 0]]))
    np.testing.assert_allclose(ev, 0.75, rtol=1e-6)

  def test_whiten_advantages(self):
    sel = self.m != 0
    a = self.ret.astype(np.float64)[sel]
    out = losses.whiten_advantages(self.ret, self.m)
    np.testing.assert_allclose(np.asarray(out)[sel], (a - a.mean()) / (a.std(ddof=1) + 1e-6),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out)[~sel], 0.0)
    scaled = losses.whiten_advantages(self.ret, self.m, shift_mean=False)
    np.testing.assert_allclose(np.asarray(scaled)[sel], a / (a.std(ddof=1) + 1e-6), rtol=1e-5)
    split = _split_rows(losses.whiten_advantages, self.ret, self.m).reshape(out.shape)
    np.testing.assert_allclose(split, out, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Per-token arrays of a multi-turn batch <-> per-turn steps.
# ---------------------------------------------------------------------------------------------------


def _episode(index, segments):
  """An Episode of (kind, ids, turn) segments: ``obs`` (prompt/observation) or ``act`` (policy tokens)."""
  ids = np.concatenate([np.asarray(s[1], np.int32) for s in segments])
  mask = np.concatenate([np.full(len(s[1]), s[0] == "act", np.int32) for s in segments])
  turn = np.concatenate([np.full(len(s[1]), s[2], np.int32) for s in segments])
  num_turns = sum(s[0] == "act" for s in segments)
  return multiturn.Episode(
      index=index, seed=index, token_ids=ids, loss_mask=mask, log_probs=np.where(mask, -0.5, 0.0),
      turn_index=turn, prompt_length=len(segments[0][1]), observations=[""] * num_turns,
      remaining_turns=[3 - t for t in range(num_turns)], actions=[""] * num_turns,
      action_ids=[list(s[1]) for s in segments if s[0] == "act"], action_stops=["eos"] * num_turns,
      turn_rewards=[0.0] * num_turns, total_reward=0.0, status=FinishStatus.FAILURE, num_turns=num_turns,
      final_observation=None, infos=[{}] * num_turns, error=None)


# Row 0: prompt (ids 0-2), action 0 (3-4), observation (5-6), action 1 (7), observation (8), action 2 (9-10).
# Row 1: prompt (0-1), action 0 (2-4), then the episode ended.
EPISODES = [
    _episode(0, [("obs", [11, 12, 13], 0), ("act", [21, 22], 0), ("obs", [14, 15], 1), ("act", [23], 1),
                 ("obs", [16], 2), ("act", [24, 25], 2)]),
    _episode(1, [("obs", [11, 12], 0), ("act", [21, 22, 23], 0)]),
]
# Column j predicts ids[j + 1]: the first action token at id position p is predicted at column p - 1.
POSITIONS = [[2, 6, 8], [1, 0, 0]]


class TurnMappingTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    batch = multiturn.episodes_to_batch(EPISODES, pad_id=0)
    self.loss_mask, self.turn_index = batch["loss_mask"], batch["turn_index"]
    self.ids, self.attention_mask = batch["ids"], batch["attention_mask"]

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_token_values_to_steps(self):
    token_values = jnp.arange(20, dtype=jnp.float32).reshape(2, 10) + 100 * jnp.arange(2)[:, None]
    fn = self.variant(functools.partial(losses.token_values_to_steps, num_turns=3))
    out = fn(token_values, self.loss_mask, self.turn_index)
    np.testing.assert_array_equal(out.position, POSITIONS)
    np.testing.assert_array_equal(out.mask, [[1, 1, 1], [1, 0, 0]])
    np.testing.assert_array_equal(out.values, [[2.0, 6.0, 8.0], [111.0, 0.0, 0.0]])

  def test_gradient_reaches_exactly_the_state_positions(self):
    weights = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    g = jax.grad(lambda tv: jnp.sum(weights * losses.token_values_to_steps(
        tv, self.loss_mask, self.turn_index, 3).values))(jnp.zeros((2, 10)))
    expected = np.zeros((2, 10))
    expected[0, [2, 6, 8]] = [1, 2, 3]
    expected[1, 1] = 4
    np.testing.assert_array_equal(g, expected)

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_steps_to_tokens(self):
    fn = self.variant(losses.steps_to_tokens)
    out = fn(jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), self.loss_mask, self.turn_index)
    # Row 0's columns 2-3 predict action 0, 6 action 1, 8-9 action 2; row 1's 1-3 action 0.
    np.testing.assert_array_equal(out, [[0, 0, 1, 1, 0, 0, 2, 0, 3, 3], [0, 4, 4, 4, 0, 0, 0, 0, 0, 0]])

  def test_rejects_turns_out_of_range(self):
    with self.assertRaisesRegex(ValueError, "num_turns"):
      losses.token_values_to_steps(jnp.zeros((2, 10)), self.loss_mask, self.turn_index, num_turns=2)

  def test_value_head_end_to_end(self):
    # The critic's V(s_t) depends on the observation before action t (where the remaining budget is
    # stated) and on nothing after it; a PPO value step gives gradient to the value head.
    cfg = get_preset("tiny", value_head=True, vocab_size=32, hidden_size=32, num_layers=1, num_heads=4,
                     num_kv_heads=2, mlp_dim=64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    model.value_head.set_value(jax.random.normal(jax.random.key(1), model.value_head.shape) * 0.1)
    graphdef, params = nnx.split(model)

    @jax.jit
    def state_values(params, ids, attention_mask):
      m = nnx.merge(graphdef, params)
      token_values = m.value_from_hidden(m.hidden_states(ids, attention_mask))[:, :-1]
      return losses.token_values_to_steps(token_values, self.loss_mask, self.turn_index, 3)

    base = state_values(params, self.ids, self.attention_mask)
    changed_action = self.ids.copy()
    changed_action[0, 7] = 30  # action 1's token: after s_1, before s_2
    other = state_values(params, changed_action, self.attention_mask)
    np.testing.assert_array_equal(other.values[0, :2], base.values[0, :2])
    self.assertNotEqual(float(other.values[0, 2]), float(base.values[0, 2]))
    changed_obs = self.ids.copy()
    changed_obs[0, 6] = 30  # the last observation token before action 1 (e.g. the remaining turns)
    other = state_values(params, changed_obs, self.attention_mask)
    self.assertEqual(float(other.values[0, 0]), float(base.values[0, 0]))
    self.assertNotEqual(float(other.values[0, 1]), float(base.values[0, 1]))

    rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    targets = losses.gae(rewards, base.values, base.mask, gamma=0.95, lam=0.95)

    def value_loss(params):
      sv = state_values(params, self.ids, self.attention_mask)
      loss, _ = losses.clipped_value_loss(sv.values, base.values, targets.returns, sv.mask, clip_range=0.2)
      return loss.value

    grads = jax.jit(jax.grad(value_loss))(params)
    head = np.asarray(grads["value_head"][...])
    self.assertTrue(np.all(np.isfinite(head)) and np.abs(head).max() > 0)
