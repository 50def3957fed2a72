"""Shared prompt prefixes in ``generate``: each distinct prompt prefilled once, its cache shared by its rows.

The reference is ``generate(..., share_prefixes=False)``, which prefills every row. Run as a script (with 8
fake CPU devices) this module is also the child of :func:`test_eight_fake_devices_share_like_one_device`.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from lemon_rl.models import Transformer, get_preset
from lemon_rl.sampling import generate
from lemon_rl.sampling import sampler as sampler_lib

A, B, C = [3, 7, 9, 11, 2], [5], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 9]
# Different lengths, repeated non-consecutively; three distinct prompts for six rows.
PROMPTS = [A, B, A, C, B, A]

# Float32 tolerance of a log-prob. Sharing changes one thing: the prompt's keys, values and last logits come
# from a prefill of P = 3 rows instead of B = 6, and XLA:CPU may block a matmul differently at another batch
# size, reordering float32 sums. A logit of this model sums products over the width 64, the MLP 128, at most
# 11 + 8 attended positions and (in the softmax) the vocabulary 64: K ~ 300 terms, each reordering moving it
# by at most K * eps * |x| ~ 3.6e-5 * |x| with |x| < 1 here; a log-prob moves by at most twice the largest logit
# change over the temperature (0.7), so 1e-4. A wrong row (another prompt's cache or logits) changes the
# log-probs by O(0.1) and the tokens altogether.
LOGP_ATOL = 1e-4


def _config():
  return get_preset("tiny", vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=128)


@pytest.fixture(scope="module")
def model():
  return Transformer(_config(), rngs=nnx.Rngs(1))


def _assert_same_samples(got, want, atol=LOGP_ATOL):
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  assert got.finish_reasons == want.finish_reasons
  np.testing.assert_allclose(got.log_probs, want.log_probs, rtol=0, atol=atol)


def test_distinct_prompts_index_every_row():
  distinct, rows = sampler_lib.distinct_prompts([A, tuple(B), np.array(A), C, B])
  assert distinct == [A, B, C, A]  # Padded with the first prompt, which no row reads twice, to a power of two.
  np.testing.assert_array_equal(rows, [0, 1, 0, 2, 1])
  distinct, rows = sampler_lib.distinct_prompts([A, B, A, C, B], multiple=3)
  assert distinct == [A, B, C, A, A, A]  # The power of two, rounded up to the multiple.
  np.testing.assert_array_equal(rows, [0, 1, 0, 2, 1])
  distinct, _ = sampler_lib.distinct_prompts([A, A])
  assert distinct == [A]


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.7, 0), (0.7, 10)])
def test_sharing_gives_the_same_samples_as_prefilling_every_row(model, temperature, top_k):
  kwargs = dict(temperature=temperature, top_k=top_k)
  free = generate(model, PROMPTS, 8, jax.random.key(2), share_prefixes=False, **kwargs)
  # An EOS that the reference emits in some rows (after its first token), so that finish reasons differ.
  eos = int(free.tokens[0, 2])
  want = generate(model, PROMPTS, 8, jax.random.key(2), eos_ids=eos, pad_id=63, share_prefixes=False, **kwargs)
  got = generate(model, PROMPTS, 8, jax.random.key(2), eos_ids=eos, pad_id=63, **kwargs)
  assert "eos" in want.finish_reasons
  _assert_same_samples(got, want)
  _assert_same_samples(generate(model, PROMPTS, 8, jax.random.key(2), **kwargs), free)
  rows_of_a = {tuple(free.tokens[i]) for i in (0, 2, 5)}
  assert len(rows_of_a) == (1 if temperature == 0 else 3)  # Rows of one prompt share a cache, not draws.


def test_prefill_runs_on_the_distinct_prompts_only(model, monkeypatch):
  """Records the batch every traced prefill sees: P rows (a power of two) when prompts repeat, B otherwise."""
  seen = []
  original = Transformer.prefill

  def recording_prefill(self, input_ids, attention_mask, num_slots, **kwargs):
    seen.append(tuple(input_ids.shape))
    return original(self, input_ids, attention_mask, num_slots, **kwargs)

  monkeypatch.setattr(Transformer, "prefill", recording_prefill)
  sampler_lib._prefill_shared.clear_cache()
  sampler_lib._prefill.clear_cache()
  generate(model, [A, B, A, C, B], 4, jax.random.key(0))
  assert seen == [(4, 16)]  # P = 3 distinct prompts, padded to 4.
  generate(model, [C, B, C, A, B], 4, jax.random.key(1), temperature=0.0)  # Same P, B, bucket: no retrace.
  generate(model, [C, B, C, A, [4, 4]], 4, jax.random.key(1))  # 4 distinct prompts: the same bucket.
  assert seen == [(4, 16)] and sampler_lib._prefill_shared._cache_size() == 1
  generate(model, [A, B, C], 4, jax.random.key(0))  # Nothing repeats: the plain prefill of every row.
  generate(model, [A, B, C, A], 4, jax.random.key(0))  # The bucket of P = 3 is no smaller than B = 4: the same.
  generate(model, [A, B, A, C, B], 4, jax.random.key(0), share_prefixes=False)
  assert seen == [(4, 16), (3, 16), (4, 16), (5, 16)]
  assert sampler_lib._prefill._cache_size() == 3


def _mesh_child():
  """Greedy and sampled, shared and per-row prefills on a (data 2, fsdp 2, tensor 2) mesh of 8 devices."""
  from lemon_rl.models import activation_sharding, make_mesh, shard_model  # pylint: disable=g-import-not-at-top
  assert len(jax.devices()) == 8, jax.devices()
  cfg = _config()
  single = Transformer(cfg, rngs=nnx.Rngs(1))
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  sharded = shard_model(Transformer(cfg, rngs=nnx.Rngs(1)), mesh)
  prompts = PROMPTS + [C, B]  # 8 rows: the batch splits over data x fsdp.
  result = {}
  for name, temperature in (("greedy", 0.0), ("sampled", 0.7)):
    ref = generate(single, prompts, 8, jax.random.key(5), temperature=temperature, share_prefixes=False)
    with activation_sharding(mesh, cfg.axis_rules):
      outs = [generate(sharded, prompts, 8, jax.random.key(5), temperature=temperature, share_prefixes=s)
              for s in (True, False)]
    result[name] = {
        "tokens_equal": all(np.array_equal(o.tokens, ref.tokens) for o in outs),
        "lengths_equal": all(np.array_equal(o.lengths, ref.lengths) for o in outs),
        "logp_diff": max(float(np.abs(o.log_probs - ref.log_probs).max()) for o in outs),
    }
  print(json.dumps(result))


def test_eight_fake_devices_share_like_one_device():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  for name in ("greedy", "sampled"):
    assert result[name]["tokens_equal"] and result[name]["lengths_equal"], result
    # Sharded sums (8 shards) reorder float32 sums on top of the batch change: the same bound.
    assert result[name]["logp_diff"] <= LOGP_ATOL, result


if __name__ == "__main__":
  _mesh_child()
