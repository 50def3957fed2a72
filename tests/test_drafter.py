"""EAGLE-3 drafter: shared frozen target weights, training-time test, loss, lossless decoding, checkpoints."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl.models import Transformer, get_preset
from lemon_rl.models.drafter import EagleDrafter, EagleHead, default_feature_layers
from lemon_rl.sampling import compare_greedy, generate, speculative, speculative_generate
from lemon_rl.sampling.sampler import right_pad
from lemon_rl.training import drafter_training as dt
from lemon_rl.training import state as state_lib

# Untied embeddings (the head must use the target's LM head, not its embedding) and a larger initialiser so
# that greedy paths wander. A small vocabulary so that even an untrained drafter gets some drafts accepted.
CFG = get_preset("tiny", vocab_size=16, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=64,
                 tie_embeddings=False, initializer_range=0.1)
LAYERS = (0, 1, 2)
TOKENS = np.array([[3, 7, 1, 12, 5, 9, 2, 14, 6, 11], [4, 4, 8, 15, 0, 10, 13, 0, 0, 0]], np.int32)
MASK = np.array([[1] * 10, [1] * 7 + [0] * 3], np.int32)
# Cached (one entry at a time, grouped_attention) against unrolled (causal_attention + the diagonal
# softmax) paths: float32 sums in another order through one layer; activations are O(1), so the rounding is
# about sqrt(E) * eps ~ 1e-6 per matmul; 2e-5 is several times that, and a wrong input is off by O(0.1).
ATOL = 2e-5


@pytest.fixture(scope="module")
def target():
  return Transformer(CFG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def head():
  return EagleHead(CFG, LAYERS, rngs=nnx.Rngs(2))


@jax.jit
def _teacher_jit(target_vars, tokens, mask):
  return dt.teacher(nnx.merge(TARGET_DEF, target_vars), tokens, mask.astype(bool), LAYERS)


TARGET_DEF = nnx.graphdef(Transformer(CFG, rngs=nnx.Rngs(0)))
HEAD_DEF = nnx.graphdef(EagleHead(CFG, LAYERS, rngs=nnx.Rngs(0)))


def _teacher(target, tokens=TOKENS, mask=MASK):
  """``(features, hidden, logits, embeds)`` of the frozen target (one compile per shape)."""
  return _teacher_jit(nnx.state(target), jnp.asarray(tokens), jnp.asarray(mask))


@functools.partial(jax.jit, static_argnames="num_steps")
def _unroll(head_vars, features, embeds, mask, num_steps):
  return nnx.merge(HEAD_DEF, head_vars).unroll(features, embeds, mask.astype(bool), num_steps)


def test_default_feature_layers_follow_eagle3():
  assert default_feature_layers(32) == (1, 15, 28)
  assert default_feature_layers(8) == (1, 3, 4)
  assert default_feature_layers(2) == (1, 0, 0)  # clipped into the blocks a small target has


def test_head_holds_only_its_own_parameters(head):
  params = nnx.state(head, nnx.Param)
  shapes = {jax.tree_util.keystr(path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  e, d, f, h, k = CFG.hidden_size, CFG.head_dim, CFG.mlp_dim, CFG.num_heads, CFG.num_kv_heads
  qkv = (h + 2 * k) * d
  assert shapes == {"['fuse'].value": (3 * e, e), "['embed_norm'].value": (e,), "['feature_norm'].value": (e,),
                    "['qkv'].value": (2 * e, qkv), "['qkv_bias'].value": (qkv,), "['out'].value": (h * d, e),
                    "['mlp_norm'].value": (e,), "['gate_up'].value": (e, 2 * f), "['down'].value": (f, e),
                    "['final_norm'].value": (e,)}
  # No V-sized array: the embedding and the LM head are the target's.
  assert all(CFG.vocab_size not in s for s in shapes.values())
  with pytest.raises(ValueError, match="outside the target's blocks"):
    EagleHead(CFG, (0, 3), rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnames="num_steps")
def _cached_path(head_vars, fused, embeds, t, num_steps):
  """Drafting after the prefix ``x_0..x_t`` of row 0, one cached step at a time, on the drafter's own outputs.

  Returns ``o^k_t`` for ``k < num_steps`` (``[S, E]``) and, for step 1, the output when the *target's*
  feature ``g_{t+1}`` is fed instead of the drafter's own (what a wrong unroll would compute).
  """
  head = nnx.merge(HEAD_DEF, head_vars)
  fused, embeds = fused[:1], embeds[:1]
  length = fused.shape[1]
  nxt = jnp.concatenate([embeds[:, 1:], jnp.zeros_like(embeds[:, :1])], axis=1)
  out, cache = head.prefill(fused, nxt, jnp.reshape(t + 1, (1,)), length + num_steps)  # entries 0..t
  hidden = jax.lax.dynamic_index_in_dim(out, t, axis=1)  # [1, 1, E]
  outs, wrong = [hidden[0, 0]], None
  for k in range(1, num_steps):
    token = jax.lax.dynamic_index_in_dim(embeds, t + 1 + k, axis=1)
    if k == 1:
      wrong = head.extend(jax.lax.dynamic_index_in_dim(fused, t + 1, axis=1), token, cache)[0][0, 0]
    hidden, cache = head.extend(hidden, token, cache)
    outs.append(hidden[0, 0])
  return jnp.stack(outs), wrong


def test_unroll_equals_cached_drafting_on_own_features(target, head):
  features, _, _, embeds = _teacher(target)
  num_steps = 3
  head_vars = nnx.state(head)
  unrolled = _unroll(head_vars, features, embeds, jnp.asarray(MASK), num_steps)
  assert unrolled.shape == (num_steps, 2, 10, CFG.hidden_size)
  # Row 1 is padded after 7 tokens; its valid positions must not see the padding.
  padded = _unroll(head_vars, features[1:, :7], embeds[1:, :7], jnp.ones((1, 7), jnp.int32), num_steps)
  for k in range(num_steps):
    np.testing.assert_allclose(unrolled[k, 1, :7 - k - 1], padded[k, 0, :7 - k - 1], atol=ATOL)
  fused = head.fuse_features(features)
  for t in range(0, 10 - num_steps):
    outs, wrong = _cached_path(head_vars, fused, embeds, t, num_steps)
    np.testing.assert_allclose(unrolled[:, 0, t], outs, atol=ATOL, err_msg=f"position {t}")
    # Feeding the target's feature at step 1 gives something else: the test can tell the two apart.
    assert float(jnp.max(jnp.abs(unrolled[1, 0, t] - wrong))) > 100 * ATOL


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_loss_equals_direct_computation(target, head):
  num_steps, decay, feature_weight = 3, 0.8, 0.5
  loss_fn = dt.DrafterLoss(num_steps=num_steps, step_decay=decay, feature_weight=feature_weight)
  batch = {"tokens": jnp.asarray(TOKENS), "mask": jnp.asarray(MASK)}
  metrics = dt.eval_metrics(HEAD_DEF, nnx.state(head), TARGET_DEF, nnx.state(target), batch, loss=loss_fn)
  loss = metrics.pop("loss")
  # Direct: the unrolled outputs (checked against cached drafting above), then numpy with the target's own
  # LM head matrix and the full-forward logits as labels.
  features, hidden, logits, embeds = _teacher(target)
  out = np.asarray(_unroll(nnx.state(head), features, embeds, jnp.asarray(MASK), num_steps), np.float64)
  hidden = np.asarray(hidden, np.float64)
  normed = _rms(out, np.asarray(head.final_norm[...], np.float64), CFG.rms_norm_eps)
  draft_logp = _log_softmax(normed @ np.asarray(target.lm_head[...], np.float64))
  target_logp = _log_softmax(np.asarray(logits, np.float64))
  lengths = MASK.sum(axis=1)
  total, regression, count0, top1 = 0.0, 0.0, 0, np.zeros(num_steps)
  for b in range(2):
    for t in range(10):
      for k in range(num_steps):
        if t + k + 1 >= lengths[b]:
          continue
        count0 += k == 0
        p = np.exp(target_logp[b, t + k + 1])
        total += decay ** k * -(p * draft_logp[k, b, t]).sum()
        diff = np.abs(normed[k, b, t] - hidden[b, t + k + 1])
        regression += decay ** k * np.mean(np.where(diff < 1, 0.5 * diff ** 2, diff - 0.5))
        top1[k] += np.argmax(draft_logp[k, b, t]) == np.argmax(p)
  assert count0 == 15  # 9 + 6 step-0 positions
  np.testing.assert_allclose(float(loss.value), (total + feature_weight * regression) / count0, rtol=1e-5)
  np.testing.assert_allclose(float(metrics.pop("feature_loss").value), regression / count0, rtol=1e-5)
  assert float(loss.denominator) == count0
  for k in range(num_steps):
    assert float(metrics[f"top1_{k}"].sum) == top1[k]
    assert float(metrics[f"top1_{k}"].denominator) == count0 - 2 * k  # one fewer position per row per step


@pytest.fixture(scope="module")
def trained(target):
  """A fresh head trained (micro-batched update) on the target's greedy continuations of random prompts;
  ``(head, losses, target parameters before, head parameters before)``."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CFG.vocab_size, rng.integers(2, 8)).tolist() for _ in range(16)]
  out = generate(target, prompts, 24, jax.random.key(0), temperature=0.0)
  tokens, mask = right_pad([p + out.tokens[i].tolist() for i, p in enumerate(prompts)], 32, 0)
  head = EagleHead(CFG, LAYERS, rngs=nnx.Rngs(5))
  optimizer = state_lib.make_optimizer(5e-3, 80, warmup_steps=5, weight_decay=0.1)  # decay moves all it sees
  head_def, state = state_lib.create_train_state(head, optimizer, 0)
  target_def, target_params = nnx.split(target)
  before = (jax.tree.map(np.array, target_params), jax.tree.map(np.array, state.params))
  # The optimizer state covers the head's parameters only: no gradient is taken for the target's.
  assert jax.tree.structure(state.params) == jax.tree.structure(nnx.state(head, nnx.Param))
  batch = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}
  losses = []
  for _ in range(80):
    state, metrics = dt.update_step(head_def, state, target_def, target_params, batch,
                                    loss=dt.DrafterLoss(num_steps=3), optimizer=optimizer, num_microbatches=2)
    losses.append(float(metrics["loss"]))
  return nnx.merge(head_def, state.params), losses, before


def test_update_trains_the_head_and_never_touches_the_target(target, trained):
  head, losses, (target_before, head_before) = trained
  assert losses[-1] < losses[0] - 0.3
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, nnx.state(target)), target_before)
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), jax.tree.map(np.array, nnx.state(head, nnx.Param)),
                         head_before)
  assert all(jax.tree.leaves(changed))


# -- decoding ------------------------------------------------------------------------------------------

PROMPTS = [[3, 9, 14, 2, 7], [11], [5, 5, 1, 8, 13, 0, 6, 12, 4, 10, 2]]  # different lengths
N, K = 20, 3
NO_EOS = [-2]
TIE_GAP = 1e-4  # the tie rule of tests/test_speculative.py


def _check_against_reference(target, prompts, out, ref):
  """Token-for-token equality with ``generate``'s greedy output, except after a near-tie (returns their count)."""
  agreement = compare_greedy(target, prompts, out, ref, TIE_GAP)
  assert not agreement.mismatches, agreement.mismatches
  for i in set(range(len(prompts))) - {d.row for d in agreement.near_ties}:
    np.testing.assert_allclose(out.log_probs[i], ref.log_probs[i], atol=1e-5)
  return len(agreement.near_ties)


@functools.partial(jax.jit, static_argnames="num_slots")
def _reference_cache(head_vars, features, embeds, lengths, num_slots):
  """The drafter's cache of entries ``(g_i, x_{i+1})``, ``i < lengths``, by one prefill; and ``g``."""
  head = nnx.merge(HEAD_DEF, head_vars)
  fused = head.fuse_features(features)
  nxt = jnp.concatenate([embeds[:, 1:], jnp.zeros_like(embeds[:, :1])], axis=1)
  return head.prefill(fused, nxt, lengths, num_slots)[1], fused


def _check_drafter_state(target, head, state, tokens, lengths):
  """Rollback: the drafter's cache holds exactly the entries of the emitted history whose target features it
  was given (as a prefill over that history computes them), and the pending entries are the rest."""
  seqs = [list(p) + tokens[i, :lengths[i]].tolist() for i, p in enumerate(PROMPTS)]  # the pending last too
  width = max(map(len, seqs))
  ids, mask = right_pad(seqs, width, 0)
  features, _, _, embeds = _teacher(target, ids, mask)
  ref, fused = _reference_cache(nnx.state(head), features, embeds, jnp.asarray(mask.sum(1) - 1), num_slots=width)
  for i, seq in enumerate(seqs):
    n, cached = int(state.num_pending[i]), int(state.cache.lengths[i])
    assert cached + n == len(seq) - 1 and 1 <= n <= K + 1
    np.testing.assert_allclose(state.cache.keys[0][i, ..., :cached], ref.keys[0][i, ..., :cached], atol=ATOL)
    np.testing.assert_allclose(state.cache.values[0][i, :, :cached], ref.values[0][i, :, :cached], atol=ATOL)
    np.testing.assert_allclose(state.features[i, :n], fused[i, cached:cached + n], atol=ATOL)
    np.testing.assert_array_equal(state.tokens[i, :n - 1], seq[cached + 1:cached + n])


def test_greedy_speculative_equals_target_greedy_at_batch_3_and_1(target, head, trained):
  ref = generate(target, PROMPTS, N, jax.random.key(0), temperature=0.0, eos_ids=NO_EOS)
  ref1 = generate(target, PROMPTS[2:], N, jax.random.key(0), temperature=0.0, eos_ids=NO_EOS)
  accepted_total = {}
  for name, h in (("untrained", head), ("trained", trained[0])):  # one compiled loop for both
    drafter = EagleDrafter(target, h)
    raw = jax.device_get(speculative._run(target, drafter, PROMPTS, N, jax.random.key(1), K, 0.0, 0, 1.0, NO_EOS,
                                          0, 16, True))
    tokens, _, lengths, _, (forwards, accepted, per_position), _, state = raw
    out = speculative_generate(target, drafter, PROMPTS, N, jax.random.key(1), num_draft=K, temperature=0.0,
                               eos_ids=NO_EOS)
    np.testing.assert_array_equal(out.tokens, tokens)
    assert _check_against_reference(target, PROMPTS, out, ref) == 0, name
    _check_drafter_state(target, h, state, tokens, lengths)
    accepted_total[name] = accepted.sum() / forwards.sum()
    if name == "trained":
      # Windows of 0, some and all K accepted drafts occur, so every rollback path ran.
      assert per_position[:, -1].sum() > 0 and (accepted < K * forwards).any()
    # Batch 1, against generate at batch 1.
    out1 = speculative_generate(target, drafter, PROMPTS[2:], N, jax.random.key(2), num_draft=K, temperature=0.0,
                                eos_ids=NO_EOS)
    assert _check_against_reference(target, PROMPTS[2:], out1, ref1) == 0, name
    np.testing.assert_array_equal(out1.tokens[0], ref.tokens[2])
  assert accepted_total["trained"] > accepted_total["untrained"] + 0.2  # training helps


def test_sampling_with_the_eagle_drafter_runs_and_reports_target_log_probs(target, head):
  drafter = EagleDrafter(target, head)
  out = speculative_generate(target, drafter, PROMPTS, N, jax.random.key(3), num_draft=K, temperature=1.0,
                             top_k=8, eos_ids=NO_EOS)
  assert (out.lengths == N).all() and 0 < out.stats.accepted.sum() < out.stats.drafted.sum()
  # The reported log-probs are the target's sampling log-probs of the emitted tokens (full forward).
  seqs = [list(p) + out.tokens[i].tolist() for i, p in enumerate(PROMPTS)]
  ids, mask = right_pad(seqs, max(map(len, seqs)), 0)
  all_logits = np.asarray(_teacher(target, ids, mask)[2])
  for i, prompt in enumerate(PROMPTS):
    logits = all_logits[i, len(prompt) - 1:len(seqs[i]) - 1]
    kth = np.sort(logits, axis=-1)[:, -8][:, None]
    logp = _log_softmax(np.where(logits >= kth, logits, -np.inf))
    np.testing.assert_allclose(out.log_probs[i], logp[np.arange(N), out.tokens[i]], atol=1e-4)


def test_checkpoint_holds_target_and_drafter(target, head, tmp_path):
  dt.save_speculative(str(tmp_path / "ckpt"), 7, target, head, {"corpus_hash": "abc"})
  target2, head2, meta = dt.load_speculative(str(tmp_path / "ckpt"))
  assert meta["corpus_hash"] == "abc" and target2.cfg == target.cfg and head2.feature_layers == LAYERS
  for a, b in ((target, target2), (head, head2)):
    jax.tree.map(np.testing.assert_array_equal, nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))


def test_timed_target_steps_of_one_token_are_greedy_decoding(target):
  """``target_step_seconds`` times ``_target_steps``; at width 1 it must be the decode step ``generate`` runs."""
  prompts = TOKENS[:, :6]
  graphdef, variables = nnx.split(target)
  hidden, cache = nnx.jit(Transformer.prefill, static_argnums=3)(target, jnp.asarray(prompts),
                                                                 jnp.ones_like(prompts), 16)
  first = jnp.argmax(target.logits_from_hidden(hidden), -1).astype(jnp.int32)[:, None]
  fourth = dt._compiled_target_steps(())(graphdef, variables, cache, first, steps=3)
  out = generate(target, prompts.tolist(), 4, jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(first[:, 0]), out.tokens[:, 0])
  np.testing.assert_array_equal(np.asarray(fourth[:, 0]), out.tokens[:, 3])
  assert dt.target_step_seconds(target, 3, batch=2, context=6, steps=2, repeats=1) > 0  # a verification runs
