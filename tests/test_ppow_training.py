"""The PPOW trainer: drafting from the drafter's distribution, target scoring, frozen target, learning
signal (with its sign), ADAW prefix sampling and resume.

A tiny random target (vocabulary 16, its LM head scaled up so that its distributions are peaked: greedy
acceptance and criticality are then far from trivial) and an untrained head; the data are the target's own
sampled continuations. Statistical checks use fixed seeds and state their margins in sigmas.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl.losses import ppow
from lemon_rl.models import Transformer, get_preset
from lemon_rl.models.drafter import EagleDrafter, EagleHead
from lemon_rl.sampling import generate, speculative
from lemon_rl.sampling.sampler import right_pad
from lemon_rl.training import drafter_training as dt
from lemon_rl.training import ppow_training as pt
from lemon_rl.training import state as state_lib

CFG = get_preset("tiny", vocab_size=16, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=64,
                 tie_embeddings=False, initializer_range=0.1)
LAYERS = (0, 1, 2)
K = 3
ROWS, PROMPT, NEW = 16, 4, 20
# Cached (extend, grouped_attention) vs unrolled / full-sequence (causal_attention) paths: float32 sums in
# another order through at most 4 blocks with O(1) activations, logits O(10) after the scaled head: about
# 1e-6 relative per matmul; 1e-4 is well above that, a wrong input moves the logits by O(1).
ATOL = 1e-4
CONFIG = pt.PPOWConfig(num_draft=K, group_size=8, num_prefixes=8, pool_rows=8, verification="expected",
                       min_prefix=2)


def _make_target() -> Transformer:
  target = Transformer(CFG, rngs=nnx.Rngs(1))
  target.lm_head[...] = target.lm_head[...] * 6.0
  return target


TARGET = _make_target()
TARGET_DEF, TARGET_VARS = nnx.split(TARGET)
HEAD_DEF = nnx.graphdef(EagleHead(CFG, LAYERS, rngs=nnx.Rngs(0)))


def _head() -> EagleHead:
  return EagleHead(CFG, LAYERS, rngs=nnx.Rngs(2))


@pytest.fixture(scope="module")
def data():
  """The target's own continuations ``tokens, mask [16, 24]``; the last 4 rows end 5 tokens early."""
  prompts = np.random.default_rng(0).integers(3, CFG.vocab_size, (ROWS, PROMPT))
  out = generate(TARGET, prompts.tolist(), NEW, jax.random.key(0), temperature=1.0, min_prompt_bucket=PROMPT)
  tokens = np.concatenate([prompts, out.tokens], axis=1).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[-4:, -5:] = 0
  return tokens, mask


@functools.partial(jax.jit, static_argnames=("group_size", "greedy"))
def _draft(head_vars, tokens, prefix_end, key, group_size, greedy=False):
  target, head = nnx.merge(TARGET_DEF, TARGET_VARS), nnx.merge(HEAD_DEF, head_vars)
  _, features = pt.target_prefix(target, tokens, prefix_end, K, LAYERS)
  return pt.draft_windows(target, head, tokens, prefix_end, features, key, K, group_size, 0 if greedy else 1.0)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def _unrolled_logits(head_vars, tokens, mask, num_steps):
  """``[S, B, T, V]``: the training-time-test path of the drafter over whole sequences."""
  target, head = nnx.merge(TARGET_DEF, TARGET_VARS), nnx.merge(HEAD_DEF, head_vars)
  features, _, _, embeds = dt.teacher(target, tokens, mask.astype(bool), LAYERS)
  return target.logits_from_hidden(head.normed(head.unroll(features, embeds, mask.astype(bool), num_steps)))


def _windows_in_rows(tokens, prefix_end, drafts):
  """Each window written into its prefix's row at ``P+1..P+K`` (``[N, T]``) and the mask up to ``P+K``."""
  group = len(drafts) // len(prefix_end)
  rows = np.repeat(tokens, group, axis=0).copy()
  ends = np.repeat(prefix_end, group)
  for i, p in enumerate(ends):
    rows[i, p + 1:p + 1 + K] = drafts[i]
  mask = (np.arange(rows.shape[1])[None] <= (ends + K)[:, None]).astype(np.int32)
  return rows, mask, ends


def test_drafts_are_the_drafters_chain_and_its_distribution(data):
  tokens, _ = data
  head_vars = nnx.state(_head())
  rows = np.array([0, 5, 9, 14])
  prefix_end = np.array([4, 9, 13, 17], np.int32)
  group = 4
  drafts, q = jax.device_get(_draft(head_vars, jnp.asarray(tokens[rows]), jnp.asarray(prefix_end),
                                    jax.random.key(3), group))
  assert drafts.shape == (16, K) and q.shape == (16, K, CFG.vocab_size)
  # Independent path: EagleHead.unroll teacher-forced on [prefix, drafts]. Step k at position P - 1 reads
  # the target's features of the prompt and the drafter's own previous outputs, and predicts d_{k+1}.
  seq, mask, ends = _windows_in_rows(tokens[rows], prefix_end, drafts)
  unrolled = np.asarray(_unrolled_logits(head_vars, jnp.asarray(seq), jnp.asarray(mask), K))
  expected = np.stack([unrolled[k, np.arange(len(ends)), ends - 1] for k in range(K)], axis=1)
  np.testing.assert_allclose(q, expected, atol=ATOL)
  # The recorded old policy = the drafter's log-softmax at the drafted tokens.
  old_logp = np.take_along_axis(jax.nn.log_softmax(q), drafts[..., None], -1)[..., 0]
  direct = np.take_along_axis(jax.nn.log_softmax(expected), drafts[..., None], -1)[..., 0]
  np.testing.assert_allclose(old_logp, direct, atol=ATOL)
  # The G windows of a prefix differ (temperature 1), so the group has a spread.
  assert len({tuple(d) for d in drafts[:group]}) > 1
  # Greedy: each draft is the argmax of the unrolled logits along its own chain (the G copies agree).
  greedy, q0 = jax.device_get(_draft(head_vars, jnp.asarray(tokens[rows]), jnp.asarray(prefix_end),
                                     jax.random.key(3), group, greedy=True))
  assert q0 is None
  np.testing.assert_array_equal(greedy, np.repeat(greedy[::group], group, axis=0))
  seq, mask, ends = _windows_in_rows(tokens[rows], prefix_end, greedy)
  unrolled = np.asarray(_unrolled_logits(head_vars, jnp.asarray(seq), jnp.asarray(mask), K))
  argmax = np.stack([unrolled[k, np.arange(len(ends)), ends - 1].argmax(-1) for k in range(K)], axis=1)
  np.testing.assert_array_equal(greedy, argmax)


@functools.partial(jax.jit, static_argnames=("drafter_def",))
def _engine_propose(drafter_def, drafter_vars, state, last):
  """The engine's greedy proposal call (temperature the Python 0, as ``speculative._decode`` passes it)."""
  return nnx.merge(drafter_def, drafter_vars).propose(state, last, None, K, 0, 0, 1.0)[0]


def test_greedy_draft_equals_the_engines(data):
  tokens, _ = data
  head = _head()
  drafter = EagleDrafter(TARGET, head)
  rows, prefix_end = np.array([0, 5, 9, 14]), np.array([4, 9, 13, 17], np.int32)  # shapes of the test above
  ours = np.asarray(_draft(nnx.state(head), jnp.asarray(tokens[rows]), jnp.asarray(prefix_end), jax.random.key(0),
                           4, greedy=True)[0])[::4]
  # The engine: its jitted prefill of the (bucket-padded) prompts, then the drafter's first proposal after
  # the pending token x_P, exactly as speculative._loop calls it.
  prompts = [tokens[r, :p].tolist() for r, p in zip(rows, prefix_end)]
  ids, mask = right_pad(prompts, 32, 0)
  num_slots = 32 + 8 + K
  drafter_def, drafter_vars = nnx.split(drafter)
  _, _, state = speculative._prefill(TARGET_DEF, TARGET_VARS, drafter_def, drafter_vars, jnp.asarray(ids),
                                     jnp.asarray(mask), num_slots=num_slots, num_draft=K)
  last = jnp.asarray(tokens[rows, prefix_end])
  engine = np.asarray(_engine_propose(drafter_def, drafter_vars, state, last))
  np.testing.assert_array_equal(ours, engine)


def test_drafted_tokens_follow_the_drafters_distribution_at_every_position(data):
  tokens, _ = data
  n = 2048
  drafts, q = jax.device_get(_draft(nnx.state(_head()), jnp.asarray(tokens[:1]), jnp.asarray([9], jnp.int32),
                                    jax.random.key(11), n))
  # Position 1's distribution is shared by all windows of the prefix.
  np.testing.assert_allclose(q[:, 0], np.broadcast_to(q[:1, 0], q[:, 0].shape), atol=1e-6)
  # E[onehot(d_j) - Q_j(. | d_<j)] = 0 at every position j if d_j ~ Q_j: each of the 16 x K means has
  # standard deviation <= 0.5 / sqrt(2048) = 0.011; 0.05 is 4.5 sigmas (a wrong distribution, e.g. the
  # previous position's or a tempered one, is off by O(0.1) on this peaked head).
  probs = np.asarray(jax.nn.softmax(q))
  onehot = np.eye(CFG.vocab_size)[drafts]
  assert np.abs((onehot - probs).mean(axis=0)).max() < 0.05
  # A drafter whose draws ignored q would fail: the empirical first-token histogram is not uniform.
  assert probs[0, 0].max() > 1.5 / CFG.vocab_size


@jax.jit
def _score(tokens, prefix_end, drafts):
  target = nnx.merge(TARGET_DEF, TARGET_VARS)
  cache, _ = pt.target_prefix(target, tokens, prefix_end, K, LAYERS)
  last = jnp.take_along_axis(tokens, prefix_end[:, None], axis=1)[:, 0]
  return pt.score_windows(target, cache, last, drafts), pt.greedy_window(target, cache, last, K)


_full_logits = nnx.jit(Transformer.__call__)


def test_target_scoring_equals_a_full_forward_and_its_greedy_decode(data):
  tokens, _ = data
  rows, prefix_end = np.array([1, 6, 12]), np.array([3, 10, 18], np.int32)
  drafts = np.random.default_rng(5).integers(0, CFG.vocab_size, (6, K)).astype(np.int32)
  p, (g, g_logp) = jax.device_get(_score(jnp.asarray(tokens[rows]), jnp.asarray(prefix_end), jnp.asarray(drafts)))
  # Direct: a full forward over [x_0..x_P, d_1..d_K] (right-padded), logits at positions P..P+K-1.
  seq, mask, ends = _windows_in_rows(tokens[rows], prefix_end, drafts)
  full = np.asarray(_full_logits(TARGET, jnp.asarray(seq), jnp.asarray(mask)))
  direct = np.stack([full[np.arange(len(ends)), ends + j] for j in range(K)], axis=1)
  np.testing.assert_allclose(p, direct, atol=ATOL)
  # The greedy window and its log-probs: the sampler's own greedy decode of the prefixes x_0..x_P.
  prompts = [tokens[r, :e + 1].tolist() for r, e in zip(rows, prefix_end)]
  ref = generate(TARGET, prompts, K, jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(g, ref.tokens)
  np.testing.assert_allclose(g_logp, ref.log_probs, atol=ATOL)


def test_sequence_criticality_and_prefix_scores_by_hand():
  rng = np.random.default_rng(0)
  tl, dl = rng.normal(size=(2, 9, 5)) * 3, rng.normal(size=(2, 9, 5)) * 3
  mask = np.ones((2, 9), np.int32)
  mask[1, 7:] = 0
  v, valid = jax.device_get(pt.sequence_criticality(jnp.asarray(tl), jnp.asarray(dl), jnp.asarray(mask)))
  direct = np.asarray(ppow.criticality(jnp.asarray(tl[:, 1:-1]), jnp.asarray(dl[:, :-2])))
  np.testing.assert_allclose(v[0, 2:], direct[0], rtol=1e-6)
  np.testing.assert_allclose(v[1, 2:7], direct[1, :5], rtol=1e-6)
  assert not valid[:, :2].any() and not valid[1, 7:].any() and valid[0, 2:].all()
  scores, ok = jax.device_get(pt.prefix_scores(jnp.asarray(v), jnp.asarray(valid), jnp.asarray(mask), 3, 2))
  for b in range(2):
    length = mask[b].sum()
    for p in range(9):
      expect_ok = p >= 2 and p + 3 <= length - 1
      assert ok[b, p] == expect_ok, (b, p)
      if expect_ok:
        np.testing.assert_allclose(scores[b, p], v[b, p + 1:p + 4].mean(), rtol=1e-6)
  # The histogram's shares sum to one over the valid positions.
  hist = pt.criticality_histogram(jnp.asarray(v), jnp.asarray(valid))
  assert sum(float(m.value) for name, m in hist.items() if name.startswith("crit_frac")) == pytest.approx(1.0)


def test_eos_window_mask():
  drafts = jnp.asarray([[1, 2, 3, 4], [2, 9, 9, 1], [9, 1, 1, 1]])
  np.testing.assert_array_equal(pt.eos_window_mask(drafts, 9), [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
  np.testing.assert_array_equal(pt.eos_window_mask(drafts, None), np.ones((3, 4)))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _choose(head_vars, tokens, mask, key, cfg):
  return pt.choose_prefixes(nnx.merge(HEAD_DEF, head_vars), nnx.merge(TARGET_DEF, TARGET_VARS), tokens, mask, key,
                            cfg)


def test_adaw_favours_critical_windows(data):
  tokens, mask = data
  n = 4000
  results = {}
  for adaw in (True, False):
    cfg = pt.PPOWConfig(num_draft=K, num_prefixes=n, pool_rows=ROWS, adaw=adaw, adaw_floor=0.1, min_prefix=2)
    out = jax.device_get(_choose(nnx.state(_head()), jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(4), cfg))
    s, ok, probs = out.scores.reshape(-1), out.ok.reshape(-1), out.probs
    count = ok.sum()
    assert ok[out.rows * tokens.shape[1] + out.prefix_end].all()  # only valid windows are drawn
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)
    assert (probs[~ok] == 0).all()
    if adaw:  # the mixture of METHODS.md: floor / n + (1 - floor) s / sum s
      np.testing.assert_allclose(probs[ok], 0.1 / count + 0.9 * s[ok] / s[ok].sum(), rtol=1e-5)
    else:
      np.testing.assert_allclose(probs[ok], 1.0 / count, rtol=1e-5)
    picked = s[out.rows * tokens.shape[1] + out.prefix_end]
    mean, sd = (probs * s).sum(), np.sqrt((probs * (s - (probs * s).sum()) ** 2).sum() / n)
    assert abs(picked.mean() - mean) < 4 * sd  # the draws follow probs (4 sigmas)
    results[adaw] = picked.mean(), sd, s[ok].mean()
  # Uniform picks have the pool's mean score; ADAW's exceed it by far more than the sampling noise (10
  # sigmas of the difference of the two means).
  assert results[False][0] == pytest.approx(results[False][2], rel=0.05)
  assert results[True][0] - results[False][0] > 10 * np.hypot(results[True][1], results[False][1])


# One optimizer object for every trainer: it is a static argument of the jitted update (one compile).
OPTIMIZER = state_lib.make_optimizer(3e-3, 100, max_grad_norm=1.0)


def _trainer(data):
  tokens, mask = data
  return pt.PPOWTrainer(TARGET, _head(), tokens, mask, CONFIG, OPTIMIZER, seed=0)


def test_steps_update_only_the_drafter(data):
  trainer = _trainer(data)
  before_target = jax.tree.map(np.asarray, nnx.state(TARGET))
  state = trainer.init_state()
  before_head = jax.tree.map(np.asarray, state.params)
  for step in (1, 2):
    state, metrics = trainer.step(state, step)
  assert int(state.step) == 2
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(TARGET)), before_target)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.target_params), before_target)
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), state.params, before_head)
  assert all(jax.tree.leaves(moved))
  # The optimizer holds no V-sized array: the shared embedding and LM head are not among its parameters.
  assert all(CFG.vocab_size not in x.shape for x in jax.tree.leaves(state.opt_state) if hasattr(x, "shape"))
  for name in ("tau", "tau_greedy", "tau_expected", "acceptance_rate_0", "reward_speedup", "reward_dist", "kl",
               "crit_frac_ge_1", "loss", "grad_norm"):
    assert np.isfinite(float(metrics[name])), name
  assert 1.0 <= float(metrics["tau"]) <= K + 1


@functools.partial(jax.jit, static_argnames=("group",))
def _expected_tau(head_vars, tokens, prefix_end, key, group=32):
  """``1 + E[k]`` (expected verification at temperature 1) over ``group`` fresh windows per prefix."""
  target, head = nnx.merge(TARGET_DEF, TARGET_VARS), nnx.merge(HEAD_DEF, head_vars)
  cache, features = pt.target_prefix(target, tokens, prefix_end, K, LAYERS)
  drafts, q = pt.draft_windows(target, head, tokens, prefix_end, features, key, K, group)
  last = jnp.take_along_axis(tokens, prefix_end[:, None], axis=1)[:, 0]
  p = pt.score_windows(target, cache, last, drafts)
  return 1.0 + jnp.mean(ppow.accepted_length(drafts, p, q, verification="expected").length)


def test_ppow_raises_tau_and_a_flipped_advantage_lowers_it(data):
  tokens, _ = data
  trainer = _trainer(data)
  # The training prefixes: every row at four prefix ends.
  rows = np.repeat(np.arange(ROWS), 4)
  ends = np.tile(np.array([4, 8, 12, 16], np.int32), ROWS)
  evaluate = lambda params: float(_expected_tau(params, jnp.asarray(tokens[rows]), jnp.asarray(ends),
                                                jax.random.key(99)))
  state0 = trainer.init_state()
  tau0 = evaluate(state0.params)
  taus = {}
  for sign in (1.0, -1.0):
    state = trainer.init_state()
    for step in range(1, 13):
      batch, _ = trainer.collect(state, step)
      batch = {**batch, "advantages": sign * batch["advantages"]}
      state, _ = pt.update(trainer.head_def, state, trainer.target_def, trainer.target_params, batch, cfg=CONFIG,
                           optimizer=trainer.optimizer)
      state = state.replace(step=state.step + 1)
    taus[sign] = evaluate(state.params)
  # 2048 windows per estimate: the standard error of a mean expected length is below 0.02.
  print(f"expected tau: start {tau0:.3f}, PPOW {taus[1.0]:.3f}, flipped advantage {taus[-1.0]:.3f}")
  assert taus[1.0] > tau0 + 0.1, (tau0, taus)
  assert taus[-1.0] < tau0 - 0.1, (tau0, taus)


def test_resume_repeats_the_next_step(data, tmp_path):
  trainer = _trainer(data)
  directory = str(tmp_path / "ppow")
  state, _ = pt.train(trainer, directory, 2, checkpoint_every=1)
  expected, expected_metrics = trainer.step(state, 3)
  expected = jax.device_get(expected)
  resumed, _ = pt.train(_trainer(data), directory, 3, checkpoint_every=1)
  resumed = jax.device_get(resumed)
  assert int(resumed.step) == 3
  jax.tree.map(np.testing.assert_array_equal, resumed.params, expected.params)
  jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, expected.opt_state)
  assert np.isfinite(float(expected_metrics["tau"]))
