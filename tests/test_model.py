"""The decoder: presets, options (remat, value head, dtypes), masking and config errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl.models import ModelConfig, Transformer, get_preset, preset_names
from lemon_rl.models.transformer import (causal_attention, grouped_attention, rope_inverse_frequencies,
                                         rope_tables)
from lemon_rl.sampling.sampler import right_pad

SMALL = dict(vocab_size=50, hidden_size=32, num_heads=4, num_kv_heads=2, mlp_dim=64)


def test_real_presets_have_their_published_sizes():
  # Parameter counts from the model cards (embeddings included).
  expected = {"qwen2.5-0.5b": 494e6, "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.62e9, "llama-3-8b": 8.03e9}
  for name, count in expected.items():
    assert abs(get_preset(name).num_params() / count - 1) < 0.01, name
  abstract = nnx.eval_shape(lambda: Transformer(get_preset("qwen2.5-0.5b"), rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert n == get_preset("qwen2.5-0.5b").num_params()
  assert {"tiny", "bench"} <= set(preset_names())


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="dtype"):
    ModelConfig(dtype="float8")
  with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
    get_preset("qwen9")


def test_padding_does_not_change_real_token_logits(small_model):
  model = small_model
  ids = jnp.array([[5, 6, 7, 8]])
  plain = _forward(model, ids)  # Whole forwards jitted (see _forward below).
  left = _forward(model, jnp.array([[0, 0, 5, 6, 7, 8]]), jnp.array([[0, 0, 1, 1, 1, 1]]))
  right = _forward(model, jnp.array([[5, 6, 7, 8, 0, 0]]), jnp.array([[1, 1, 1, 1, 0, 0]]))
  np.testing.assert_allclose(left[:, 2:], plain, atol=1e-5)
  np.testing.assert_allclose(right[:, :4], plain, atol=1e-5)


def test_grouped_attention_matches_repeated_kv_reference():
  rng = np.random.default_rng(0)
  b, t, h, k, d = 2, 5, 4, 2, 8
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  keys = rng.normal(size=(b, k, t, d)).astype(np.float32)
  values = rng.normal(size=(b, k, t, d)).astype(np.float32)
  allowed = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
  ours = np.asarray(grouped_attention(jnp.asarray(q), jnp.asarray(keys.transpose(0, 1, 3, 2)), jnp.asarray(values),
                                     jnp.asarray(allowed)))  # keys slots-last, as the cache stores them
  kr, vr = np.repeat(keys, h // k, axis=1), np.repeat(values, h // k, axis=1)  # head h reads kv head h // G
  scores = np.einsum("bthd,bhsd->bhts", q, kr) / np.sqrt(d)
  scores = np.where(allowed[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ref = np.einsum("bhts,bhsd->bthd", probs, vr).reshape(b, t, h * d)
  np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_remat_gives_the_same_gradients():
  ids = jnp.array([[1, 2, 3, 4, 5]])

  def grads(remat):  # Jitted: one compile instead of op-by-op dispatch of the backward pass.
    model = Transformer(get_preset("tiny", remat=remat, **SMALL), rngs=nnx.Rngs(0))
    return jax.tree.leaves(nnx.jit(nnx.grad(lambda m: jnp.sum(m(ids) ** 2)))(model))

  for a, b in zip(grads(False), grads(True)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_value_head_and_bfloat16_compute():
  model = Transformer(get_preset("tiny", value_head=True, dtype="bfloat16", **SMALL), rngs=nnx.Rngs(0))
  hidden = nnx.jit(Transformer.hidden_states)(model, jnp.array([[1, 2, 3]]))  # jitted: see _forward below
  assert hidden.dtype == jnp.bfloat16
  assert _forward(model, jnp.array([[1, 2, 3]])).dtype == jnp.float32  # logits always float32
  assert nnx.jit(Transformer.value_from_hidden)(model, hidden).shape == (1, 3)
  no_head = Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no value head"):
    no_head.value_from_hidden(hidden)


def f32_tol(reference, width: int = SMALL["mlp_dim"], chained: int = 16) -> float:
  """Absolute tolerance between two float32 evaluation orders of the same network.

  A dot product of ``K`` terms rounded in a different order differs by about ``sqrt(K) * eps`` times the
  terms' magnitude (random-walk accumulation of per-addition rounding); ``chained`` bounds how many such
  reductions compound (a few matmuls, a softmax and two norms per layer, two layers). ``K`` is the widest
  contraction (the MLP), the magnitude that of the reference, so the bound follows the model's scale rather
  than any one CPU's rounding.
  """
  return chained * np.sqrt(width) * np.finfo(np.float32).eps * float(np.abs(np.asarray(reference)).max())


def _right_padded(seqs, width=None):
  ids, mask = right_pad(seqs, width or max(map(len, seqs)), 0)
  return jnp.asarray(ids), jnp.asarray(mask)


# Whole calls jitted (one compile per shape) instead of op-by-op dispatch, which compiles every primitive.
_prefill = nnx.jit(Transformer.prefill, static_argnums=3)
_extend = nnx.jit(Transformer.extend)
_logits = nnx.jit(Transformer.logits_from_hidden)
_forward = nnx.jit(Transformer.__call__)

PROMPTS = [[9, 8, 7], [3, 4, 5, 6, 2], [1]]
NEW = [[11, 12, 13], [14, 15, 16], [17, 18, 19]]


@pytest.fixture(scope="module")
def small_model():
  return Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0))


def _valid(cache, row, layer=0):
  """Row ``row``'s valid keys and values of one layer: ``[K, length, D]`` each (keys are stored slots-last)."""
  n = int(cache.lengths[row])
  return np.asarray(cache.keys[layer][row, :, :, :n]).transpose(0, 2, 1), np.asarray(cache.values[layer][row, :, :n])


def test_cache_layout_and_separate_buffers(small_model):
  """Keys slots-last, values slots-second, as prefill writes them; every buffer of an empty cache its own
  array, so that a jitted loop can donate all of them (the multi-turn engine does)."""
  cfg = small_model.cfg
  cache = small_model.init_cache(3, 10)
  assert all(k.shape == (3, cfg.num_kv_heads, cfg.head_dim, 10) for k in cache.keys)
  assert all(v.shape == (3, cfg.num_kv_heads, 10, cfg.head_dim) for v in cache.values)
  assert len({id(x) for x in cache.keys + cache.values}) == 2 * cfg.num_layers and cache.num_slots == 10
  ids, mask = _right_padded(PROMPTS)
  _, filled = jax.jit(small_model.prefill, static_argnums=2)(ids, mask, 10)
  assert [x.shape for x in filled.keys + filled.values] == [x.shape for x in cache.keys + cache.values]


def test_prefill_and_extend_match_the_full_forward(small_model):
  model = small_model
  full = _forward(model, *_right_padded([p + n for p, n in zip(PROMPTS, NEW)]))
  ids, mask = _right_padded(PROMPTS, width=6)  # right-padded: every row left-aligned at slot 0
  hidden, cache = _prefill(model, ids, mask, num_slots=10)
  np.testing.assert_array_equal(cache.lengths, [3, 5, 1])
  lengths = [len(p) for p in PROMPTS]
  last = np.stack([full[i, n - 1] for i, n in enumerate(lengths)])
  np.testing.assert_allclose(_logits(model, hidden), last, atol=f32_tol(full))
  # Prefill is extend on an empty cache, computed with the full-sequence attention.
  all_hidden, extended = _extend(model, ids, model.init_cache(3, 10), num_new=cache.lengths)
  np.testing.assert_array_equal(extended.lengths, cache.lengths)
  last_hidden = all_hidden[jnp.arange(3), cache.lengths - 1]
  np.testing.assert_allclose(_logits(model, last_hidden), last, atol=f32_tol(full))
  # k = 3 tokens per row in one call, each row at its own slots.
  hidden, cache3 = _extend(model, jnp.asarray(NEW), cache)
  np.testing.assert_array_equal(cache3.lengths, [6, 8, 4])
  want = np.stack([full[i, n:n + 3] for i, n in enumerate(lengths)])
  np.testing.assert_allclose(_logits(model, hidden), want, atol=f32_tol(full))
  # The same three tokens one at a time (plain decoding) give the same logits and the same cache.
  one_by_one = cache
  for j in range(3):
    hidden, one_by_one = _extend(model, jnp.asarray(NEW)[:, j:j + 1], one_by_one)
    np.testing.assert_allclose(_logits(model, hidden[:, 0]), want[:, j], atol=f32_tol(full))
  np.testing.assert_array_equal(one_by_one.lengths, cache3.lengths)
  for row in range(3):
    for a, b in zip(_valid(one_by_one, row, layer=1), _valid(cache3, row, layer=1)):
      np.testing.assert_allclose(a, b, atol=f32_tol(b))


def test_extend_then_truncate_equals_extending_only_the_kept_tokens(small_model):
  # Speculative decoding: verify k = 3 drafted tokens, keep j of them per row, then decode on.
  model = small_model
  ids, mask = _right_padded(PROMPTS)
  _, cache = _prefill(model, ids, mask, num_slots=12)
  keep = jnp.array([0, 2, 3])
  _, drafted = _extend(model, jnp.asarray(NEW), cache)
  truncated = drafted.truncate(cache.lengths + keep)
  np.testing.assert_array_equal(truncated.lengths, [3, 7, 4])
  # num_new does the same in one call (identical computation, so identical arrays).
  _, partial = _extend(model, jnp.asarray(NEW), cache, num_new=keep)
  for a, b in zip(jax.tree.leaves(truncated), jax.tree.leaves(partial)):
    np.testing.assert_array_equal(a, b)
  nxt = jnp.array([[21], [22], [23]])
  hidden, _ = _extend(model, nxt, truncated)
  got = _logits(model, hidden[:, 0])
  for row, j in enumerate(keep.tolist()):
    # Reference: the same row with only its j kept tokens appended, alone (batch 1), then the next token.
    _, ref = _prefill(model, ids[row:row + 1], mask[row:row + 1], num_slots=12)
    if j:
      _, ref = _extend(model, jnp.asarray(NEW)[row:row + 1, :j], ref)
    np.testing.assert_array_equal(ref.lengths, truncated.lengths[row:row + 1])
    for a, b in zip(_valid(truncated, row, layer=1), _valid(ref, 0, layer=1)):
      np.testing.assert_allclose(a, b, atol=f32_tol(b))
    hidden, _ = _extend(model, nxt[row:row + 1], ref)
    ref_logits = _logits(model, hidden[:, 0])
    np.testing.assert_allclose(got[row], ref_logits[0], atol=f32_tol(ref_logits))
  # And the full forward over prompt + kept + next agrees.
  seqs = [p + n[:j] + [int(t)] for p, n, j, t in zip(PROMPTS, NEW, keep.tolist(), nxt[:, 0])]
  full = _forward(model, *_right_padded(seqs))
  want = np.stack([full[i, len(s) - 1] for i, s in enumerate(seqs)])
  np.testing.assert_allclose(got, want, atol=f32_tol(full))
  # truncate never lengthens a row.
  np.testing.assert_array_equal(truncated.truncate(jnp.array([100, 0, 4])).lengths, [3, 0, 4])


def test_take_equals_prefilling_each_copy(small_model):
  model = small_model
  ids, mask = _right_padded(PROMPTS[:2])
  _, cache = _prefill(model, ids, mask, num_slots=8)
  rows = [0, 1, 0, 1, 1, 0]  # Repeats in any order.
  tiled = cache.take(jnp.array(rows))
  _, copies = _prefill(model, ids[jnp.array(rows)], mask[jnp.array(rows)], num_slots=8)
  np.testing.assert_array_equal(tiled.lengths, copies.lengths)
  for a, b in zip(jax.tree.leaves(tiled), jax.tree.leaves(copies)):
    assert a.shape == b.shape
  for r in range(6):
    for layer in range(2):
      for a, b in zip(_valid(tiled, r, layer), _valid(copies, r, layer)):
        np.testing.assert_allclose(a, b, atol=f32_tol(b))
  # Different continuations of the shared prefix match the full forward.
  new = jnp.arange(30, 42).reshape(6, 2)
  hidden, _ = _extend(model, new, tiled)
  seqs = [PROMPTS[r] + new[i].tolist() for i, r in enumerate(rows)]
  full = _forward(model, *_right_padded(seqs))
  want = np.stack([full[i, len(s) - 2:len(s)] for i, s in enumerate(seqs)])
  np.testing.assert_allclose(_logits(model, hidden), want, atol=f32_tol(full))


def test_grow_equals_prefilling_with_the_larger_capacity(small_model):
  model = small_model
  ids, mask = _right_padded(PROMPTS)
  _, small = _prefill(model, ids, mask, num_slots=5)  # Full for row 1: no room for a token.
  _, large = _prefill(model, ids, mask, num_slots=9)
  grown = small.grow(9)
  assert grown.num_slots == 9
  np.testing.assert_array_equal(grown.lengths, large.lengths)
  for a, b in zip(jax.tree.leaves(grown), jax.tree.leaves(large)):  # Valid slots equal, empty slots zero.
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=f32_tol(b))
  hidden, extended = _extend(model, jnp.asarray(NEW), grown)  # Row 1 into slots 5..7, beyond the old 5.
  np.testing.assert_array_equal(extended.lengths, [6, 8, 4])
  seqs = [p + n for p, n in zip(PROMPTS, NEW)]
  full = _forward(model, *_right_padded(seqs))
  want = np.stack([full[i, len(s) - 3:len(s)] for i, s in enumerate(seqs)])
  np.testing.assert_allclose(_logits(model, hidden), want, atol=f32_tol(full))
  assert small.grow(5).num_slots == 5
  with pytest.raises(ValueError, match="cannot grow"):
    large.grow(8)


def test_extend_without_room_leaves_the_row_unchanged(small_model):
  model = small_model
  ids, mask = _right_padded([[1, 2, 3, 4], [5]])
  _, cache = _prefill(model, ids, mask, num_slots=5)
  _, out = _extend(model, jnp.array([[6, 7], [8, 9]]), cache)  # row 0 would need slots 4 and 5
  np.testing.assert_array_equal(out.lengths, [4, 3])
  for layer in range(2):
    np.testing.assert_array_equal(out.keys[layer][0], cache.keys[layer][0])
    np.testing.assert_array_equal(out.values[layer][0], cache.values[layer][0])


@pytest.mark.parametrize("t,block_size", [(13, 4), (20, 3), (7, 64)])  # 3 blocks, 4 uneven blocks, 1 block
def test_causal_attention_matches_grouped_attention_with_gradients(t, block_size):
  rng = np.random.default_rng(0)
  b, h, k, d = 3, 4, 2, 8
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  keys = jnp.asarray(rng.normal(size=(b, k, t, d)), jnp.float32)
  values = jnp.asarray(rng.normal(size=(b, k, t, d)), jnp.float32)
  mask = np.ones((b, t), bool)
  mask[0, :3] = False  # left padding: queries 0..2 of row 0 see no key
  mask[2, t - 2:] = False  # right padding
  allowed = jnp.tril(jnp.ones((t, t), bool))[None] & jnp.asarray(mask)[:, None, :]
  has_key = jnp.any(allowed, axis=-1)[:, :, None]  # rows with no allowed key differ by design
  cotangent = jnp.asarray(rng.normal(size=(b, t, h * d)), jnp.float32) * has_key

  def loss(fn):
    return lambda q, kk, vv: jnp.sum(fn(q, kk, vv) * cotangent)

  # Everything jitted: causal_attention unrolls a Python loop over blocks, which op-by-op would dispatch (and
  # compile) primitive by primitive.
  ours = jax.jit(lambda q, kk, vv: causal_attention(q, kk, vv, jnp.asarray(mask), block_size=block_size))
  ref = jax.jit(lambda q, kk, vv: grouped_attention(q, kk.transpose(0, 1, 3, 2), vv, allowed))
  np.testing.assert_allclose(ours(q, keys, values) * has_key, ref(q, keys, values) * has_key, atol=1e-5)
  g_ours = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, keys, values)
  g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, keys, values)
  for a, r in zip(g_ours, g_ref):
    np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)


def test_rope_table_lookup_equals_direct_evaluation_and_evaluates_only_the_table():
  cfg = ModelConfig(**SMALL, num_layers=2)
  positions = jnp.array([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
  inv_freq = rope_inverse_frequencies(cfg)
  for looked_up, direct in zip(rope_tables(positions, inv_freq, num_positions=5), rope_tables(positions, inv_freq)):
    np.testing.assert_array_equal(looked_up, direct)  # The same float32 angles, so the same values.
  # The training forward + backward evaluates sin/cos on the [T, D/2] table only, not per element of the
  # [B, T, N, D] tensors it rotates (which XLA would do if the tables were fused into their consumers).
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  seq_len = 16
  ids, mask = jnp.ones((4, seq_len), jnp.int32), jnp.ones((4, seq_len), jnp.int32)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids, mask))
  hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  sine_sizes = [int(np.prod([int(d) for d in shape.split(",") if d]))
                for shape in re.findall(r"f32\[([\d,]*)\]\S* (?:sine|cosine)\(", hlo)]
  assert sine_sizes and max(sine_sizes) <= seq_len * cfg.head_dim // 2, sine_sizes
