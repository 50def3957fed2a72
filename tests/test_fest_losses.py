"""Tests of lemon_rl.losses.fest (METHODS.md section 2).

The gradient identity is checked on the real ``lemon_rl.models.Transformer``
(``tiny`` preset) for the policy and a second, differently initialised one as
the frozen reference.
"""

import functools

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lemon_rl import ops
from lemon_rl.losses import fest
from lemon_rl.models import get_preset
from lemon_rl.models import Transformer

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7


def f32_rtol(transcendentals: int = 0, roundings: int = 1) -> float:
  """Relative error of a short float32 expression against a float64 reference.

  XLA's float32 exp / log / log1p / logistic are accurate to a few ulp on every CPU: count 4 eps per call, and
  eps per arithmetic rounding (an input constant rounded to float32 is one). Counts (denominators) and
  integer-valued sums are exact: those checks use rtol=0.
  """
  return (4 * transcendentals + roundings) * EPS32


def np_log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def np_adaptive_beta(correct, ids, b1, b2, b3):
  out = np.zeros(len(correct))
  for i, (c, g) in enumerate(zip(correct, ids)):
    solvable = any(correct[j] for j in range(len(ids)) if ids[j] == g)
    out[i] = b3 if c else (b2 if solvable else b1)
  return out


class AdaptiveBetaTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_by_hand(self):
    # Group 0 all wrong -> beta1; group 1 mixed -> beta3 for the right one, beta2 for the wrong ones;
    # group 2 all right -> beta3.
    correct = jnp.array([False, False, False, True, False, False, True, True])
    ids = jnp.array([0, 0, 0, 1, 1, 1, 2, 2])
    f = self.variant(functools.partial(fest.adaptive_beta, num_groups=3, beta1=0.005, beta2=0.02, beta3=0.1))
    np.testing.assert_allclose(f(correct, ids), [0.005, 0.005, 0.005, 0.1, 0.02, 0.02, 0.1, 0.1],
                               rtol=f32_rtol())  # float32 constants

  def test_defaults_are_the_decision(self):
    out = fest.adaptive_beta(jnp.array([0, 0, 1, 0]), jnp.array([0, 0, 1, 1]), 2)
    np.testing.assert_allclose(out, [0.005, 0.005, 0.1, 0.02], rtol=f32_rtol())  # float32 constants

  def test_padding_rows_do_not_make_a_group_solvable(self):
    out = fest.adaptive_beta(jnp.array([0, 0, 1]), jnp.array([0, 0, 0]), 1, valid=jnp.array([1, 1, 0]))
    np.testing.assert_allclose(out[:2], [0.005, 0.005], rtol=f32_rtol())  # float32 constants

  def test_against_numpy(self):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 7, size=40)
    correct = rng.uniform(size=40) < 0.3
    np.testing.assert_allclose(fest.adaptive_beta(correct, ids, 7, beta1=1.0, beta2=2.0, beta3=3.0),
                               np_adaptive_beta(correct, ids, 1.0, 2.0, 3.0), rtol=0)  # selections of 1, 2, 3


class DPOLossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_by_hand(self):
    # Pair 0: r+ = -10 - (-20) = 10, r- = -30 - (-30) = 0, beta 0.1 -> -log sigmoid(1) = 0.3132617.
    # Pair 1: r+ = r- = 5 -> -log sigmoid(0) = log 2.
    pos = jnp.array([-10.0, -15.0])
    ref_pos = jnp.array([-20.0, -20.0])
    neg = jnp.array([-30.0, -20.0])
    ref_neg = jnp.array([-30.0, -25.0])
    f = self.variant(functools.partial(fest.semi_online_dpo_loss, beta=0.1))
    loss, metrics = f(pos, ref_pos, neg, ref_neg)
    # Two log-sigmoids (exp + log1p each) of beta * margin (0.1 rounded) and a sum.
    np.testing.assert_allclose(loss.sum, np.log1p(np.exp(-1.0)) + np.log(2.0), rtol=f32_rtol(2, 3))
    np.testing.assert_allclose(loss.denominator, 2.0, rtol=0)
    values = ops.metric_values(metrics)
    np.testing.assert_allclose(values["reward_margin"], 5.0, rtol=0)  # integer-valued: exact
    np.testing.assert_allclose(values["reward_accuracy"], 0.5, rtol=0)
    # w = beta sigmoid(beta (r- - r+)) = 0.1 sigmoid(-1) = 0.0268941 and 0.1 * 0.5.
    np.testing.assert_allclose(values["decaying_weight"], (0.1 * np_sigmoid(-1.0) + 0.05) / 2, rtol=f32_rtol(1, 5))

  def test_decaying_weight_by_hand_and_decays(self):
    w = fest.decaying_weight(jnp.array([0.0, 10.0, 100.0]), jnp.zeros(3), 0.1)
    np.testing.assert_allclose(w, [0.05, 0.1 * np_sigmoid(-1.0), 0.1 * np_sigmoid(-10.0)], rtol=f32_rtol(1, 4))
    self.assertTrue(bool(jnp.all(jnp.diff(w) < 0)))  # the more likely the expert, the smaller w

  def test_against_numpy_with_adaptive_beta_and_padding(self):
    rng = np.random.default_rng(1)
    n = 16
    pos, ref_pos, neg, ref_neg = (rng.normal(scale=30, size=n).astype(np.float32) - 100 for _ in range(4))
    beta = rng.choice([0.005, 0.02, 0.1], size=n).astype(np.float32)
    valid = rng.uniform(size=n) < 0.8
    loss, metrics = fest.semi_online_dpo_loss(pos, ref_pos, neg, ref_neg, beta, valid=valid)
    f64 = lambda x: x.astype(np.float64)
    margin = (f64(pos) - f64(ref_pos)) - (f64(neg) - f64(ref_neg))
    expected = -np_log_sigmoid(beta * margin)[valid].mean()
    # The float32 margin (r+ - r-, three subtractions of values up to M = max |log-prob|) is within 3 eps 2M;
    # -log sigmoid and w have slopes <= 1 and <= beta / 4 in x = beta * margin; then a few ulp and a mean of n.
    dx = beta.max() * 3 * EPS32 * 2 * max(np.abs(x).max() for x in (pos, ref_pos, neg, ref_neg))
    np.testing.assert_allclose(loss.value, expected, rtol=f32_rtol(2, n), atol=dx)
    w = beta * np_sigmoid(-beta * margin)
    np.testing.assert_allclose(metrics["decaying_weight"].value, w[valid].mean(), rtol=f32_rtol(1, n),
                               atol=beta.max() / 4 * dx)

  def test_fest_dpo_loss_combination(self):
    expert = ops.WeightedMetric(jnp.float32(3.0), jnp.float32(4.0))  # L_E = 0.75
    rl = ops.WeightedMetric(jnp.float32(-2.0), jnp.float32(10.0))  # L_I = -0.2
    # A few float32 roundings of O(1) numbers (divisions, products, sums).
    total = fest.fest_dpo_loss(expert, rl, c=2.0)
    self.assertIsInstance(total, ops.WeightedMetric)  # a (sum, denominator) pair like every other loss
    np.testing.assert_allclose(total.value, 2 * 0.75 - 0.2, rtol=f32_rtol(0, 4))
    np.testing.assert_allclose(total.denominator, 1.0, rtol=0)  # the whole batch
    np.testing.assert_allclose(fest.fest_dpo_loss(expert, rl).value, 0.75 - 0.2, rtol=f32_rtol(0, 4))  # c = 1
    # Two micro-batch pieces with the global denominators and their shares add up to the whole pair.
    pair = lambda s, d: ops.WeightedMetric(jnp.float32(s), jnp.float32(d))
    halves = [(pair(1.0, 1.0), pair(-2.0, 4.0)), (pair(2.0, 3.0), pair(0.0, 6.0))]
    pieces = [fest.fest_dpo_loss(e, r, c=2.0, expert_denominator=4.0, rl_denominator=10.0, share=0.5)
              for e, r in halves]
    whole = pieces[0] + pieces[1]
    np.testing.assert_allclose(whole.sum, 2 * 0.75 - 0.2, rtol=f32_rtol(0, 8))
    np.testing.assert_allclose(whole.denominator, 1.0, rtol=0)
    np.testing.assert_allclose(whole.value, total.value, rtol=f32_rtol(0, 12))
    with self.assertRaisesRegex(ValueError, "both"):
      fest.fest_dpo_loss(expert, rl, expert_denominator=4.0)

  def test_shape_errors(self):
    with self.assertRaises(AssertionError):
      fest.semi_online_dpo_loss(jnp.zeros(3), jnp.zeros(3), jnp.zeros(2), jnp.zeros(3), 0.1)
    with self.assertRaises(AssertionError):
      fest.semi_online_dpo_loss(jnp.zeros(3), jnp.zeros(3), jnp.zeros(3), jnp.zeros(3), jnp.ones(2))


class FestGRPOTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_sft_term_by_hand(self):
    # Two pairs sharing the expert y+ = 2 tokens with log-probs [-1, -2] (sum -3), third position padding.
    pos_tok = jnp.array([[-1.0, -2.0, -50.0], [-1.0, -2.0, -50.0]])
    pos_mask = jnp.array([[1, 1, 0], [1, 1, 0]])
    ref_pos = jnp.array([-3.0, -3.0])  # r+ = 0
    neg = jnp.array([-5.0, -1.0])
    ref_neg = jnp.array([-5.0, -11.0])  # r- = [0, 10]
    beta = jnp.array([0.1, 0.1])
    f = self.variant(fest.fest_grpo_sft_term)
    loss, metrics = f(pos_tok, pos_mask, ref_pos, neg, ref_neg, beta)
    w = np.array([0.1 * 0.5, 0.1 * np_sigmoid(1.0)])  # beta sigmoid(beta (r- - r+))
    np.testing.assert_allclose(loss.value, np.mean(w * 3.0), rtol=f32_rtol(1, 6))  # -mean w log pi(y+)
    np.testing.assert_allclose(metrics["decaying_weight"].value, w.mean(), rtol=f32_rtol(1, 4))
    # The weight carries no gradient: d/d logp[i,t] = -w_i / N on valid tokens.
    g = jax.grad(lambda x: fest.fest_grpo_sft_term(x, pos_mask, ref_pos, neg, ref_neg, beta)[0].value)(pos_tok)
    np.testing.assert_allclose(g, -w[:, None] * np.array([[1, 1, 0]]) / 2, rtol=f32_rtol(1, 4))

  @chex.variants(with_jit=True, without_jit=True)
  def test_fixed_weight_holds_beta_over_two(self):
    # The same pairs as above, but the weight does not decay: w = beta / 2 whatever the margins.
    pos_tok = jnp.array([[-1.0, -2.0, -50.0], [-1.0, -2.0, -50.0]])
    pos_mask = jnp.array([[1, 1, 0], [1, 1, 0]])
    ref_pos, neg, ref_neg = jnp.array([-3.0, -3.0]), jnp.array([-5.0, -1.0]), jnp.array([-5.0, -11.0])
    beta = jnp.array([0.1, 0.4])
    f = self.variant(functools.partial(fest.fest_grpo_sft_term, fixed_weight=True))
    loss, metrics = f(pos_tok, pos_mask, ref_pos, neg, ref_neg, beta)
    w = np.array([0.05, 0.2])
    np.testing.assert_allclose(loss.value, np.mean(w * 3.0), rtol=f32_rtol(1, 6))
    np.testing.assert_allclose(metrics["decaying_weight"].value, w.mean(), rtol=f32_rtol(1, 4))
    np.testing.assert_allclose(metrics["reward_margin"].value, -5.0, rtol=f32_rtol(1, 4))  # Still reported.
    g = jax.grad(lambda x: fest.fest_grpo_sft_term(x, pos_mask, ref_pos, neg, ref_neg, beta,
                                                   fixed_weight=True)[0].value)(pos_tok)
    np.testing.assert_allclose(g, -w[:, None] * np.array([[1, 1, 0]]) / 2, rtol=f32_rtol(1, 4))
    # At the reference policy (r+ = r- = 0) the decaying weight equals the fixed one.
    zero, _ = fest.fest_grpo_sft_term(pos_tok, pos_mask, ref_pos, neg, neg, beta)
    np.testing.assert_allclose(zero.value, loss.value, rtol=f32_rtol(1, 6))

  def test_fest_grpo_loss(self):
    sft = ops.WeightedMetric(jnp.float32(0.5), jnp.float32(2.0))
    rl = ops.WeightedMetric(jnp.float32(3.0), jnp.float32(6.0))
    total = fest.fest_grpo_loss(sft, rl, c=0.5)
    self.assertIsInstance(total, ops.WeightedMetric)
    np.testing.assert_allclose(total.value, 0.5 * 0.25 + 0.5, rtol=f32_rtol(0, 4))
    np.testing.assert_allclose(total.denominator, 1.0, rtol=0)
    piece = fest.fest_grpo_loss(sft, rl, c=0.5, sft_denominator=4.0, rl_denominator=12.0, share=0.25)
    np.testing.assert_allclose(piece.sum, 0.5 * 0.125 + 0.25, rtol=f32_rtol(0, 4))
    np.testing.assert_allclose(piece.denominator, 0.25, rtol=0)

  def test_combiners_are_differentiable_and_jittable(self):
    def loss(x):
      sft = ops.WeightedMetric(x * 2.0, jnp.float32(4.0))
      rl = ops.WeightedMetric(-x, jnp.float32(2.0))
      return fest.fest_grpo_loss(sft, rl, c=3.0).value
    # d/dx (3 * 2x / 4 - x / 2) = 1, exact in float32.
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(jnp.float32(1.5)), 1.0, rtol=f32_rtol(0, 4))


# ---------------------------------------------------------------------------------------------------
# Gradient identity on the real model.
# ---------------------------------------------------------------------------------------------------

P, N_PER, T_PROMPT, T = 2, 2, 3, 8  # prompts, rollouts per prompt, prompt length, total length


def _sequences(seed, num, vocab):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, size=(num, T)).astype(np.int32)
  lengths = rng.integers(T_PROMPT + 1, T + 1, size=num)  # completion lengths vary (right padding)
  positions = np.arange(T - 1)[None] + 1  # targets are ids[:, 1:]
  mask = ((positions >= T_PROMPT) & (positions < lengths[:, None])).astype(np.float32)
  return jnp.asarray(ids), jnp.asarray(mask)


def test_dpo_gradient_identity_on_transformer():
  # A 1-layer model keeps the three compiled gradients cheap; the identity does not depend on depth.
  cfg = get_preset("tiny", vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  ref_model = Transformer(cfg, rngs=nnx.Rngs(1))
  pos_ids, pos_mask = _sequences(0, P, cfg.vocab_size)  # one expert solution per prompt
  neg_ids, neg_mask = _sequences(1, P * N_PER, cfg.vocab_size)  # rollouts
  group_ids = jnp.repeat(jnp.arange(P), N_PER)
  beta = fest.adaptive_beta(jnp.array([False, False, True, False]), group_ids, P, beta1=0.05, beta2=0.2,
                            beta3=0.5)  # prompt 0 unsolved, prompt 1 mixed: all three betas appear

  def token_logp(model, ids):
    return ops.token_log_probs(model(ids)[:, :-1], ids[:, 1:])

  ref_pos = ops.masked_sum(token_logp(ref_model, pos_ids), pos_mask, axis=-1)[group_ids]
  ref_neg = ops.masked_sum(token_logp(ref_model, neg_ids), neg_mask, axis=-1)

  def policy_logps(params):
    model = nnx.merge(graphdef, params)
    pos_tok = token_logp(model, pos_ids)[group_ids]  # expert log-probs gathered per pair
    neg_tok = token_logp(model, neg_ids)
    return pos_tok, neg_tok

  @jax.jit
  def dpo_grad(params):
    def loss(params):
      pos_tok, neg_tok = policy_logps(params)
      pos = ops.masked_sum(pos_tok, pos_mask[group_ids], axis=-1)
      neg = ops.masked_sum(neg_tok, neg_mask, axis=-1)
      out, metrics = fest.semi_online_dpo_loss(pos, ref_pos, neg, ref_neg, beta)
      return out.value, metrics["decaying_weight"].value
    return jax.grad(loss, has_aux=True)(params)

  @jax.jit
  def decomposed_grad(params):
    def loss(params):
      pos_tok, neg_tok = policy_logps(params)
      pm = pos_mask[group_ids]
      r_pos = ops.masked_sum(pos_tok, pm, axis=-1) - ref_pos
      r_neg = ops.masked_sum(neg_tok, neg_mask, axis=-1) - ref_neg
      w = jax.lax.stop_gradient(fest.decaying_weight(r_pos, r_neg, beta))
      sft = fest.weighted_log_likelihood_loss(pos_tok, pm, w)  # -(sg[w] log pi(y+))
      reinforce = fest.weighted_log_likelihood_loss(neg_tok, neg_mask, -w)  # REINFORCE, reward -w
      return sft.value + reinforce.value
    return jax.grad(loss)(params)

  @jax.jit
  def sft_term_grad(params):
    def loss(params):
      pos_tok, neg_tok = policy_logps(params)
      neg = ops.masked_sum(neg_tok, neg_mask, axis=-1)
      return fest.fest_grpo_sft_term(pos_tok, pos_mask[group_ids], ref_pos, neg, ref_neg, beta)[0].value
    return jax.grad(loss)(params)

  g_dpo, w_mean = dpo_grad(params)
  g_dec = decomposed_grad(params)
  assert 0.0 < float(w_mean) < 0.5
  leaves_dpo, leaves_dec = jax.tree.leaves(g_dpo), jax.tree.leaves(g_dec)
  assert len(leaves_dpo) == len(leaves_dec) > 5
  max_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves_dpo, leaves_dec))
  max_mag = max(float(jnp.max(jnp.abs(a))) for a in leaves_dpo)
  assert max_mag > 1e-3, max_mag  # the identity is not trivially 0 == 0
  # Two float32 computations of one gradient: each entry sums the n token terms, each formed by contractions
  # over up to mlp_dim features, in different orders, and w (a sigmoid, ~8 eps) is computed two ways.
  n = float(pos_mask[group_ids].sum() + neg_mask.sum())
  bound = (n + cfg.mlp_dim + 8) * EPS32 * max_mag
  assert max_err <= bound, (max_err, bound)

  # FEST-GRPO's SFT term is the supervised half: DPO gradient minus the REINFORCE-on-y- half.
  @jax.jit
  def reinforce_grad(params):
    def loss(params):
      pos_tok, neg_tok = policy_logps(params)
      r_pos = ops.masked_sum(pos_tok, pos_mask[group_ids], axis=-1) - ref_pos
      r_neg = ops.masked_sum(neg_tok, neg_mask, axis=-1) - ref_neg
      w = jax.lax.stop_gradient(fest.decaying_weight(r_pos, r_neg, beta))
      return fest.weighted_log_likelihood_loss(neg_tok, neg_mask, -w).value
    return jax.grad(loss)(params)

  g_sft, g_rf = sft_term_grad(params), reinforce_grad(params)
  err = max(float(jnp.max(jnp.abs(a - (s + r)))) for a, s, r in
            zip(leaves_dpo, jax.tree.leaves(g_sft), jax.tree.leaves(g_rf)))
  assert err <= 2 * bound, (err, bound)  # a third gradient computation: twice the bound


if __name__ == "__main__":
  pytest.main([__file__])
