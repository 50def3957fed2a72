"""The jitted sampler: log-probs, filtering, determinism, stopping and compilation caching."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl.models import Transformer, get_preset
from lemon_rl.sampling import filter_logits, generate, sampling_log_probs, sampling_logits
from lemon_rl.sampling.sampler import right_pad
from lemon_rl.sampling import sampler as sampler_lib


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny", vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=128)
  return Transformer(cfg, rngs=nnx.Rngs(1))


PROMPTS = [[3, 7, 9, 11, 2], [5], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 9]]
NEW = 8  # max_new_tokens of every PROMPTS call: one compiled decode loop per sampling mode for the file.


def _right_padded(seqs, width=None):
  return right_pad(seqs, width or max(map(len, seqs)), 0)


def _full_sequences(prompts, out):
  """Right-padded prompt + completion ids ``[B, T]`` and mask, as a learner would score them."""
  return _right_padded([list(p) + out.tokens[i, :out.lengths[i]].tolist() for i, p in enumerate(prompts)])


def _teacher_forced(model, prompts, out, temperature=1.0, top_k=0, top_p=1.0):
  """The learner's view: ``sampling_log_probs`` of the sampled tokens from a full forward pass."""
  ids, mask = _full_sequences(prompts, out)
  logits = model(jnp.asarray(ids), jnp.asarray(mask))
  logp = np.asarray(sampling_log_probs(logits[:, :-1], jnp.asarray(ids[:, 1:]), temperature, top_k, top_p))
  result = np.zeros_like(out.log_probs)
  for i, p in enumerate(prompts):
    n = out.lengths[i]
    result[i, :n] = logp[i, len(p) - 1:len(p) - 1 + n]
  return result


def test_log_probs_equal_teacher_forced_forward(model):
  out = generate(model, PROMPTS, max_new_tokens=NEW, rng=jax.random.key(3), temperature=1.0)
  np.testing.assert_allclose(out.log_probs, _teacher_forced(model, PROMPTS, out), atol=1e-5)
  assert out.mask.sum() == out.lengths.sum() == 3 * NEW


# The sampler's logits come from the cached decode path, the learner's from a full forward; the two differ
# by float32 rounding of differently ordered sums, about sqrt(K) * eps * |logit| ~ 1e-6 for this model
# (K <= 128, |logits| < 1). A log-prob moves by at most twice the largest logit change divided by the
# temperature, so 1e-5 leaves a margin of several times; a wrong distribution (another temperature, filter
# or position) is off by far more than that.
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (0.7, 10, 1.0), (0.7, 10, 0.8),
                                                      (0.0, 0, 1.0)])
def test_sampling_log_probs_of_a_full_forward_equal_generate_log_probs(model, temperature, top_k, top_p):
  kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  out = generate(model, PROMPTS, max_new_tokens=NEW, rng=jax.random.key(4), **kwargs)
  np.testing.assert_allclose(out.log_probs, _teacher_forced(model, PROMPTS, out, **kwargs), atol=1e-5)


def test_greedy_equals_argmax_of_the_full_forward(model):
  out = generate(model, PROMPTS, max_new_tokens=NEW, rng=jax.random.key(0), temperature=0.0)
  forward = nnx.jit(type(model).__call__)  # one compile: every step has the same padded shape
  seqs = [list(p) for p in PROMPTS]
  for _ in range(NEW):
    ids, mask = _right_padded(seqs, width=24)
    logits = forward(model, jnp.asarray(ids), jnp.asarray(mask))
    for i, seq in enumerate(seqs):
      seq.append(int(jnp.argmax(logits[i, len(seq) - 1])))
  for i, p in enumerate(PROMPTS):
    np.testing.assert_array_equal(out.tokens[i], seqs[i][len(p):])


def test_sampling_distribution_pieces():
  logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
  # Greedy: unchanged, unfiltered (temperature-1 log-probs).
  np.testing.assert_array_equal(sampling_logits(logits, 0.0, 1, 0.1), logits)
  np.testing.assert_allclose(sampling_log_probs(logits, jnp.array([3, 0]), 0.0, 1, 0.1), np.log([0.1, 0.1]),
                             rtol=1e-6)
  # Temperature 0.5 squares the probabilities; top-k 2 then renormalises over the kept pair.
  want = np.log(np.array([0.16, 0.09]) / 0.25)
  np.testing.assert_allclose(sampling_log_probs(logits, jnp.array([0, 1]), 0.5, 2)[0], want[0], rtol=1e-5)
  np.testing.assert_allclose(sampling_log_probs(logits, jnp.array([3, 2]), 0.5, 2)[1], want[1], rtol=1e-5)
  # A scored token outside the kept set still gets a finite log-prob (it is counted as kept).
  outside = sampling_log_probs(logits, jnp.array([3, 0]), 1.0, 2, 1.0)
  np.testing.assert_allclose(outside, np.log([0.1 / 0.8, 0.1 / 0.8]), rtol=1e-5)
  # Any leading shape, traced parameters (greedy included), same values as static ones.
  x = jax.random.normal(jax.random.key(0), (2, 3, 17))
  tokens = jax.random.randint(jax.random.key(1), (2, 3), 0, 17)
  traced = jax.jit(sampling_log_probs)
  for t, k, p in [(0.7, 5, 0.9), (1.3, 0, 0.5), (0.0, 3, 0.5), (1.0, 0, 1.0)]:
    np.testing.assert_allclose(traced(x, tokens, t, k, p), sampling_log_probs(x, tokens, t, k, p), rtol=1e-6)
    rows = np.stack([np.asarray(filter_logits(x[i], jnp.int32(k), jnp.float32(p))) for i in range(2)])
    np.testing.assert_array_equal(filter_logits(x, k, p), rows)


def test_same_rng_same_output_and_different_rng_differs(model):
  a = generate(model, PROMPTS, NEW, jax.random.key(0))
  b = generate(model, PROMPTS, NEW, jax.random.key(0))
  c = generate(model, PROMPTS, NEW, jax.random.key(1))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.log_probs, b.log_probs)
  assert not np.array_equal(a.tokens, c.tokens)


def test_eos_stops_rows_and_masks_padding(model):
  # Pick as EOS the greedy first token of row 0 so that it stops at once.
  greedy = generate(model, PROMPTS, NEW, jax.random.key(0), temperature=0.0)
  eos = int(greedy.tokens[0, 0])
  out = generate(model, PROMPTS, NEW, jax.random.key(0), temperature=0.0, eos_ids=eos, pad_id=63)
  assert out.finish_reasons[0] == "eos" and out.lengths[0] == 1
  assert out.mask[0].tolist() == [1] + [0] * (NEW - 1)  # EOS included, padding excluded
  assert (out.tokens[0, 1:] == 63).all() and (out.log_probs[0, 1:] == 0).all()
  for i in range(len(PROMPTS)):
    n = out.lengths[i]
    assert out.finish_reasons[i] == ("eos" if eos in greedy.tokens[i].tolist() else "length")
    np.testing.assert_array_equal(out.tokens[i, :n], greedy.tokens[i, :n])


def test_a_row_stops_on_any_of_several_eos_ids(model):
  free = generate(model, PROMPTS, NEW, jax.random.key(5), temperature=1.0)
  eos = [int(free.tokens[0, 2]), int(free.tokens[2, 3])]
  out = generate(model, PROMPTS, NEW, jax.random.key(5), temperature=1.0, eos_ids=eos, pad_id=63)
  stopped_on = set()
  for i in range(len(PROMPTS)):
    hits = np.isin(free.tokens[i], eos)
    n = int(hits.argmax()) + 1 if hits.any() else NEW
    assert out.lengths[i] == n and out.finish_reasons[i] == ("eos" if hits.any() else "length")
    np.testing.assert_array_equal(out.tokens[i, :n], free.tokens[i, :n])  # same key: same draws until EOS
    assert (out.tokens[i, n:] == 63).all()
    if hits.any():
      stopped_on.add(int(out.tokens[i, n - 1]))
  assert stopped_on == set(eos)  # one row stopped on each id
  single = generate(model, PROMPTS, NEW, jax.random.key(5), temperature=1.0, eos_ids=eos[0])
  assert single.finish_reasons[0] == "eos" and single.lengths[0] == out.lengths[0]


def test_filter_logits_keeps_exactly_the_top_sets():
  logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
  kept = np.isfinite(np.asarray(filter_logits(logits, jnp.int32(2), jnp.float32(1.0))))
  np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [0, 0, 1, 1]])
  # top-p 0.65: mass before token = 0, 0.4, 0.7 -> keep the first two.
  kept = np.isfinite(np.asarray(filter_logits(logits, jnp.int32(0), jnp.float32(0.65))))
  np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [0, 0, 1, 1]])
  # top-p tiny keeps the argmax only; top-k 3 then top-p 0.95 over the renormalised top-3.
  kept = np.isfinite(np.asarray(filter_logits(logits, jnp.int32(0), jnp.float32(1e-3))))
  np.testing.assert_array_equal(kept.sum(-1), [1, 1])
  kept = np.isfinite(np.asarray(filter_logits(logits, jnp.int32(3), jnp.float32(0.95))))
  np.testing.assert_array_equal(kept.sum(-1), [3, 3])


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (8, 0.7)])
def test_top_k_top_p_never_emit_outside_the_kept_set(model, top_k, top_p):
  prompts = [[1, 2, 3]] * 256
  out = generate(model, prompts, 4, jax.random.key(7), temperature=1.5, top_k=top_k, top_p=top_p)
  # Rows share the prompt, so the first token's distribution is the same for every row.
  first = filter_logits(model(jnp.asarray([[1, 2, 3]]))[:, -1] / 1.5, jnp.int32(top_k), jnp.float32(top_p))
  kept = np.isfinite(np.asarray(first))[0]
  counts = np.bincount(out.tokens[:, 0], minlength=kept.size)
  assert counts[~kept].sum() == 0
  # Statistical check: empirical frequencies match the renormalised kept distribution (5 standard errors).
  probs = np.asarray(jax.nn.softmax(first))[0]
  se = np.sqrt(probs * (1 - probs) / len(prompts))
  assert np.all(np.abs(counts / len(prompts) - probs) <= 5 * se + 1e-3)
  # Every later token lies inside the kept set of its own context: its filtered logit is finite.
  head = out._replace(tokens=out.tokens[:32], log_probs=out.log_probs[:32], lengths=out.lengths[:32])
  ids, mask = _full_sequences(prompts[:32], head)
  dist = sampling_logits(model(jnp.asarray(ids), jnp.asarray(mask))[:, :-1], 1.5, top_k, top_p)
  picked = np.take_along_axis(np.asarray(dist), ids[:, 1:, None], axis=-1)[..., 0]
  assert np.isfinite(picked[:, 2:]).all()  # completion positions (prompt length 3, no EOS)


def test_compiles_once_per_bucket_and_length(model):
  sampler_lib._decode.clear_cache()
  sampler_lib._prefill.clear_cache()
  generate(model, [[1, 2, 3], [4, 5]], 5, jax.random.key(0))
  generate(model, [[1, 2, 3, 4, 5, 6, 7], [4]], 5, jax.random.key(1))  # same bucket (16), same batch
  generate(model, [[9] * 10, [4, 4]], 5, jax.random.key(2), temperature=0.5)  # temperature is traced
  assert sampler_lib._decode._cache_size() == 1
  assert sampler_lib._prefill._cache_size() == 1
  generate(model, [[1] * 20, [2]], 5, jax.random.key(0))  # bucket 32
  assert sampler_lib._prefill._cache_size() == 2


def test_decode_capacities():
  assert sampler_lib.decode_capacities(64, 128) == [96, 128, 160, 192]
  assert sampler_lib.decode_capacities(64, 16) == [80]  # Never fewer than MIN_SEGMENT_STEPS steps.
  assert sampler_lib.decode_capacities(16, 40) == [48, 56]
  assert sampler_lib.decode_capacities(8, 1000) == [258, 508, 758, 1008]  # At most MAX_DECODE_SEGMENTS.
  assert sampler_lib.decode_capacities(16, 33) == [48, 49]


# Two segments (32 + 8 steps, the cache grown from 48 to 56 slots) against one loop over the 56-slot cache:
# the same computation but for the masked slots a softmax sums over, hence the same tokens, and log-probs
# equal up to the float32 rounding of those sums (1e-5, as for the teacher-forced comparison above).
@pytest.mark.parametrize("temperature,top_k,coupled", [(0.0, 0, False), (1.0, 0, False), (0.8, 5, True)])
def test_segmented_decode_equals_one_loop_over_the_whole_cache(model, monkeypatch, temperature, top_k,
                                                                coupled):
  prompts = [[3, 7, 9, 11, 2], [5], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 9], [5]]  # Rows 1 and 3 share a prompt.
  kwargs = dict(temperature=temperature, top_k=top_k, coupled=coupled, eos_ids=9)
  sampler_lib._decode.clear_cache()
  segmented = generate(model, prompts, 40, jax.random.key(5), **kwargs)
  assert sampler_lib._decode._cache_size() == 2  # One compiled loop per segment capacity.
  monkeypatch.setattr(sampler_lib, "MIN_SEGMENT_STEPS", 1000)
  whole = generate(model, prompts, 40, jax.random.key(5), **kwargs)
  np.testing.assert_array_equal(segmented.tokens, whole.tokens)
  np.testing.assert_array_equal(segmented.lengths, whole.lengths)
  assert segmented.finish_reasons == whole.finish_reasons
  np.testing.assert_allclose(segmented.log_probs, whole.log_probs, atol=1e-5)
  # Covered: a row stopped by EOS and a row decoded through both segments (for this model and key).
  assert "eos" in segmented.finish_reasons and segmented.lengths.max() == 40


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_row_compilation_samples_what_the_default_compilation_samples(model, monkeypatch, temperature):
  """Batch 1 runs the decode loop compiled with ``ONE_ROW_CPU_OPTIONS`` (other dot kernels): the same
  computation up to float32 rounding of the matmuls, so the same tokens and log-probs within 1e-5."""
  assert sampler_lib._decode_for(1) is sampler_lib._decode_one_row
  assert sampler_lib._decode_for(2) is sampler_lib._decode
  one_row = generate(model, PROMPTS[:1], 40, jax.random.key(2), temperature=temperature, eos_ids=9)
  monkeypatch.setattr(sampler_lib, "_decode_for", lambda batch: sampler_lib._decode)
  default = generate(model, PROMPTS[:1], 40, jax.random.key(2), temperature=temperature, eos_ids=9)
  np.testing.assert_array_equal(one_row.tokens, default.tokens)
  np.testing.assert_array_equal(one_row.lengths, default.lengths)
  np.testing.assert_allclose(one_row.log_probs, default.log_probs, atol=1e-5)


def test_bad_arguments_raise(model):
  with pytest.raises(ValueError, match="at least one token"):
    generate(model, [[1], []], 4, jax.random.key(0))
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, [[1]], 0, jax.random.key(0))
  with pytest.raises(ValueError, match="top_p"):
    generate(model, [[1]], 2, jax.random.key(0), top_p=0.0)
