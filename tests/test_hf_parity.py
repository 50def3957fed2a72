"""Parity with Hugging Face ``transformers`` (torch, CPU) on tiny random Qwen2 and Llama checkpoints.

The checkpoints are built here with ``transformers`` itself (random init, nothing downloaded).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lemon_rl.models import from_hf, to_hf  # noqa: E402
from lemon_rl.sampling import generate  # noqa: E402

VOCAB = 97
EPS32 = float(np.finfo(np.float32).eps)
# A logit ends float32 contractions over, per layer (2), d 64 (projections, RMSNorm), MLP 128 and <= 12
# attended positions, then the head's d 64. Two implementations (XLA vs torch's oneDNN) or two compilations
# add them in other orders (and AVX2 vs AVX-512 widths): worst case LOGIT_TERMS eps |logit| apart.
LOGIT_TERMS = 2 * (64 + 64 + 128 + 12) + 64


def logit_atol(logits) -> float:
  return LOGIT_TERMS * EPS32 * float(np.abs(logits).max())


def _hf_config(kind: str):
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  if kind == "qwen2":
    return transformers.Qwen2Config(rope_theta=10000.0, tie_word_embeddings=True, **common)
  return transformers.LlamaConfig(rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                  **common)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
  torch.manual_seed(0)
  cfg = _hf_config(request.param)
  cls = transformers.Qwen2ForCausalLM if request.param == "qwen2" else transformers.LlamaForCausalLM
  hf_model = cls(cfg).eval()
  with torch.no_grad():  # Random biases / norms so that parity is not trivially met by zeros and ones.
    for name, p in hf_model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  path = str(tmp_path_factory.mktemp(request.param))
  # A small shard limit exercises the sharded index format on read.
  hf_model.save_pretrained(path, max_shard_size="100KB")
  return request.param, path, hf_model


def _padded_batch():
  rng = np.random.default_rng(0)
  ids = rng.integers(0, VOCAB, size=(3, 12))
  mask = np.ones((3, 12), np.int64)
  mask[1, :4] = 0  # left padded
  mask[2, 9:] = 0  # right padded
  return ids, mask


def _hf_logits(hf_model, ids, mask):
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   position_ids=torch.tensor(positions))
  return out.logits.numpy()


def test_sharded_checkpoint_is_read(checkpoint):
  _, path, _ = checkpoint
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))


def test_logits_match_transformers_on_padded_batch(checkpoint):
  _, path, hf_model = checkpoint
  model = from_hf(path)
  ids, mask = _padded_batch()
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  theirs = _hf_logits(hf_model, ids, mask)
  valid = mask.astype(bool)
  np.testing.assert_array_less(np.abs(ours - theirs)[valid].max(), logit_atol(theirs[valid]))


def test_greedy_continuation_matches_generate(checkpoint):
  _, path, hf_model = checkpoint
  model = from_hf(path)
  prompts = [[5, 17, 3, 9, 44, 2], [8, 1, 60]]
  out = generate(model, prompts, max_new_tokens=32, rng=jax.random.key(0), temperature=0.0)
  for row, prompt in enumerate(prompts):
    with torch.no_grad():
      ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    expected = ref[0, len(prompt):].tolist()
    assert out.tokens[row].tolist() == expected


def test_to_hf_round_trip_loads_in_transformers(checkpoint, tmp_path):
  kind, path, hf_model = checkpoint
  model = from_hf(path)
  out_dir = str(tmp_path / "export")
  to_hf(model, out_dir, max_shard_bytes=50_000)
  with open(os.path.join(out_dir, "config.json")) as f:
    assert json.load(f)["model_type"] == kind
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
  ids, mask = _padded_batch()
  expected = _hf_logits(hf_model, ids, mask)[mask.astype(bool)]  # Same weights (exported exactly), same kernels.
  np.testing.assert_allclose(_hf_logits(reloaded, ids, mask)[mask.astype(bool)], expected, rtol=0,
                             atol=logit_atol(expected))
  # And back into lemon_rl.
  again = from_hf(out_dir)
  expected = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  np.testing.assert_allclose(np.asarray(again(jnp.asarray(ids), jnp.asarray(mask))), expected, rtol=0,
                             atol=logit_atol(expected))


def test_bad_checkpoints_give_clear_errors(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "gpt2"}, f)
  with pytest.raises(ValueError, match="not supported"):
    from_hf(str(tmp_path))
