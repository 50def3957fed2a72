"""Hugging Face weights: ``from_hf(path)`` and ``to_hf(model, path)``; ``load_hf_policy(path)`` for a whole directory.

Reads ``config.json`` and ``model.safetensors`` (or the sharded ``model.safetensors.index.json``) of a
Llama- or Qwen2-family checkpoint; writes a directory that ``transformers`` loads with
``AutoModelForCausalLM.from_pretrained``. Only local paths: nothing is downloaded.

Our fused layouts relate to Hugging Face's ``nn.Linear`` weights (``[out, in]``) by
``qkv = group_qkv(concat([q_proj.T, k_proj.T, v_proj.T], axis=1))`` (``[E, K, G + 2, D]``, grouped by KV head)
and ``gate_up = stack([gate_proj.T, up_proj.T], axis=-1)`` (``[E, F, 2]``); ``out = o_proj.T`` as ``[H, D, E]``.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from lemon_rl.models.config import ModelConfig
from lemon_rl.models.transformer import Transformer, group_qkv, ungroup_qkv
from lemon_rl.text.chat_template import ChatTemplate
from lemon_rl.text.tokenizers import HFTokenizer

_SUPPORTED = ("qwen2", "llama")


def config_from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
  """Maps a Hugging Face ``config.json`` dict to a :class:`ModelConfig`."""
  model_type = hf.get("model_type")
  if model_type not in _SUPPORTED:
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(_SUPPORTED)}")
  rope = dict(hf.get("rope_parameters") or {})
  scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
  if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
    scaling = None
  heads = hf["num_attention_heads"]
  fields = dict(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      qkv_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=hf.get("max_position_embeddings", 2048),
      model_type=model_type,
  )
  if model_type == "llama" and hf.get("mlp_bias"):
    raise ValueError("llama checkpoints with mlp_bias=True are not supported")
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The ``config.json`` dict ``transformers`` needs for this model."""
  out = {
      "architectures": ["Qwen2ForCausalLM" if cfg.model_type == "qwen2" else "LlamaForCausalLM"],
      "model_type": cfg.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.mlp_dim,
      "hidden_act": "silu",
      "rope_theta": cfg.rope_theta,
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_position_embeddings,
      "torch_dtype": cfg.param_dtype,
      "use_cache": True,
  }
  if cfg.rope_scaling:
    out["rope_scaling"] = dict(cfg.rope_scaling)
  if cfg.model_type == "llama":
    out["attention_bias"] = cfg.qkv_bias
    out["mlp_bias"] = False
  elif not cfg.qkv_bias:
    raise ValueError("a qwen2 export requires qkv_bias=True (Qwen2 always has Q/K/V biases)")
  return out


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(os.path.join(path, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    tensors.update(load_file(os.path.join(path, name)))
  return tensors


def from_hf(path: str, **config_overrides) -> Transformer:
  """Builds a :class:`Transformer` from a local Hugging Face checkpoint directory.

  ``config_overrides`` replace config fields (e.g. ``dtype="bfloat16"``, ``remat=True``).
  """
  with open(os.path.join(path, "config.json")) as f:
    cfg = config_from_hf(json.load(f), **config_overrides)
  tensors = _read_tensors(path)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  used: set[str] = set()

  def take(name: str) -> np.ndarray:
    if name not in tensors:
      raise KeyError(f"tensor {name!r} missing from checkpoint at {path}")
    used.add(name)
    return np.asarray(tensors[name], np.float32)

  def assign(var: nnx.Param, value: np.ndarray):
    if var.shape != value.shape:
      raise ValueError(f"shape mismatch: checkpoint gives {value.shape}, model expects {var.shape}")
    var.set_value(jnp.asarray(value, cfg.jnp_param_dtype))

  assign(model.embed, take("model.embed_tokens.weight"))
  for i, block in enumerate(model.blocks):
    p = f"model.layers.{i}."
    assign(block.attn_norm, take(p + "input_layernorm.weight"))
    assign(block.qkv, group_qkv(np.concatenate([take(p + f"self_attn.{n}_proj.weight").T for n in "qkv"],
                                               axis=1), cfg))
    if block.qkv_bias is not None:
      assign(block.qkv_bias, group_qkv(np.concatenate([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]),
                                       cfg))
    assign(block.out, take(p + "self_attn.o_proj.weight").T.reshape(block.out.shape))
    assign(block.mlp_norm, take(p + "post_attention_layernorm.weight"))
    assign(block.gate_up, np.stack([take(p + "mlp.gate_proj.weight").T, take(p + "mlp.up_proj.weight").T],
                                   axis=-1))
    assign(block.down, take(p + "mlp.down_proj.weight").T)
  assign(model.final_norm, take("model.norm.weight"))
  if model.lm_head is not None:
    assign(model.lm_head, take("lm_head.weight").T)
  if model.value_head is not None:
    model.value_head.set_value(jnp.zeros(model.value_head.shape, cfg.jnp_param_dtype))
  unused = set(tensors) - used - {"lm_head.weight"}
  unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
  if unused:
    raise ValueError(f"checkpoint tensors not used by the model: {sorted(unused)[:8]}")
  return model


def hf_state_dict(model: Transformer) -> dict[str, np.ndarray]:
  """The model's weights under Hugging Face names and layouts (float32 numpy)."""
  cfg = model.cfg

  def arr(var) -> np.ndarray:
    return np.asarray(jax.device_get(var[...]), np.float32)

  out = {"model.embed_tokens.weight": arr(model.embed), "model.norm.weight": arr(model.final_norm)}
  q_end = cfg.num_heads * cfg.head_dim
  k_end = q_end + cfg.num_kv_heads * cfg.head_dim
  for i, block in enumerate(model.blocks):
    p = f"model.layers.{i}."
    qkv = ungroup_qkv(arr(block.qkv), cfg)
    for n, part in zip("qkv", np.split(qkv, [q_end, k_end], axis=1)):
      out[p + f"self_attn.{n}_proj.weight"] = part.T
    if block.qkv_bias is not None:
      for n, part in zip("qkv", np.split(ungroup_qkv(arr(block.qkv_bias), cfg), [q_end, k_end])):
        out[p + f"self_attn.{n}_proj.bias"] = part
    out[p + "self_attn.o_proj.weight"] = arr(block.out).reshape(-1, cfg.hidden_size).T
    out[p + "input_layernorm.weight"] = arr(block.attn_norm)
    out[p + "post_attention_layernorm.weight"] = arr(block.mlp_norm)
    gate, up = arr(block.gate_up)[..., 0], arr(block.gate_up)[..., 1]
    out[p + "mlp.gate_proj.weight"] = gate.T
    out[p + "mlp.up_proj.weight"] = up.T
    out[p + "mlp.down_proj.weight"] = arr(block.down).T
  if model.lm_head is not None:
    out["lm_head.weight"] = arr(model.lm_head).T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def to_hf(model: Transformer, path: str, max_shard_bytes: int | None = None) -> None:
  """Writes ``config.json`` and safetensors weights (sharded with an index above ``max_shard_bytes``)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(model.cfg), f, indent=2)
  tensors = hf_state_dict(model)
  metadata = {"format": "pt"}
  total = sum(t.nbytes for t in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata=metadata)
    return
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata=metadata)
    weight_map.update({name: fname for name in shard})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


class HFPolicy(NamedTuple):
  """A model directory loaded whole: unpacks as ``model, tokenizer, chat_template = load_hf_policy(path)``."""

  model: Transformer
  tokenizer: HFTokenizer
  chat_template: ChatTemplate | None  # None for a directory that declares no chat template.


def load_hf_policy(path: str, **config_overrides) -> HFPolicy:
  """Loads everything a policy needs from one local Hugging Face directory.

  ``model``: :func:`from_hf` (``config.json`` + safetensors, ``config_overrides`` as there).
  ``tokenizer``: :meth:`HFTokenizer.from_file` (``tokenizer.json``, ``tokenizer_config.json``,
  ``special_tokens_map.json``, ``generation_config.json``, ``config.json``); its ``eos_ids`` are every EOS id
  the directory declares, to pass to ``generate(..., eos_ids=tokenizer.eos_ids)``.
  ``chat_template``: :meth:`ChatTemplate.from_dir` bound to that tokenizer (``None`` if none is declared).
  Raises ``ValueError`` when the tokenizer has ids beyond the model's embedding table.
  """
  model = from_hf(path, **config_overrides)
  tokenizer = HFTokenizer.from_file(path)
  if tokenizer.vocab_size > model.cfg.vocab_size:
    raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                     f"{model.cfg.vocab_size}")
  return HFPolicy(model, tokenizer, ChatTemplate.from_dir(path, tokenizer=tokenizer))
