"""Decoder configuration and presets (Llama / Qwen2 family).

A :class:`ModelConfig` is a frozen dataclass so that it can be a static argument of ``jax.jit``. Presets:

- ``tiny``: the CPU default used by tests and the default experiment (byte-level vocabulary).
- ``bench``: the Qwen2-shaped benchmark model (vocab 512, d 256, 4 layers, 8 heads, 4 KV heads, MLP 1024).
- real shapes for accelerator users: ``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``qwen2.5-7b``, ``llama-3-8b``
  (weights stored in bfloat16, as Hugging Face ships them: for inference, or training where memory rules).
- mixed precision for training on one accelerator: ``qwen2.5-0.5b-mixed``, ``qwen2.5-1.5b-mixed``: float32
  master weights (``param_dtype``; the optimizer updates them and its moments are float32 too), bfloat16
  matmuls and activations (``dtype``: every weight is cast to bfloat16 where it is used), float32 logits,
  log-softmax and loss, and blocks rematerialised with the ``dots_with_no_batch_dims_saveable`` policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
# Parameters and activations are annotated with the logical names on the left.
DEFAULT_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("seq", None),
)


# Named ``jax.checkpoint`` policies for ``ModelConfig.remat_policy``: what the forward pass of a block keeps for
# the backward pass (the rest is recomputed).
#   nothing_saveable: only the block's input (least memory, one extra forward of every block).
#   dots_saveable: every matmul output (attention scores and probabilities included, as ``[B, K, G*T, S]``).
#   dots_with_no_batch_dims_saveable: the projections' outputs (2-D matmuls, no batch dimension: QKV, output,
#     gate/up, down) but not the attention einsums (batched over batch x KV head), which are recomputed: the
#     ``O(T^2)`` tensors are not kept, the ``O(T E)`` ones are.
#   everything_saveable: keeps what no remat keeps (for tests: the same program under ``jax.checkpoint``).
REMAT_POLICIES: dict[str, Any] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder-only transformer.

  Attributes:
    vocab_size: number of token ids ``V``.
    hidden_size: model width ``E``.
    num_layers: number of decoder blocks.
    num_heads: query heads ``H``.
    num_kv_heads: key/value heads ``K`` (grouped-query attention; ``H % K == 0``).
    head_dim: per-head width ``D`` (defaults to ``E // H``).
    mlp_dim: SwiGLU inner width ``F``.
    rope_theta: rotary base.
    rope_scaling: ``None`` or a dict in Hugging Face's ``rope_scaling`` format (``rope_type`` "llama3").
    rms_norm_eps: RMSNorm epsilon.
    qkv_bias: Qwen2-style bias on the Q/K/V projections.
    tie_embeddings: share the input embedding and the LM head.
    max_position_embeddings: informational (RoPE has no table); copied to/from HF.
    param_dtype: storage dtype of parameters.
    dtype: compute dtype of activations/matmuls (logits and softmax are always float32).
    remat: rematerialise each block in the backward pass (saves memory, costs compute).
    remat_policy: what a rematerialised block saves, a name in :data:`REMAT_POLICIES` (used when ``remat``;
      the default ``nothing_saveable`` is what ``remat=True`` always did).
    value_head: add a scalar value head on the final hidden state (the PPO critic).
    initializer_range: std of the normal initialiser.
    axis_rules: logical axis -> mesh axis rules (see ``DEFAULT_AXIS_RULES``).
    model_type: ``"qwen2"`` or ``"llama"`` (used by the Hugging Face exporter).
  """

  vocab_size: int = 264
  hidden_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None
  mlp_dim: int = 512
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = True
  tie_embeddings: bool = True
  max_position_embeddings: int = 2048
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: bool = False
  remat_policy: str = "nothing_saveable"
  value_head: bool = False
  initializer_range: float = 0.02
  axis_rules: tuple[tuple[str, Any], ...] = DEFAULT_AXIS_RULES
  model_type: str = "qwen2"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name}={getattr(self, name)!r}; expected float32, bfloat16 or float16")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy={self.remat_policy!r}; expected one of {', '.join(REMAT_POLICIES)}")
    if self.model_type not in ("qwen2", "llama"):
      raise ValueError(f"model_type={self.model_type!r}; expected 'qwen2' or 'llama'")
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def checkpoint_policy(self):
    """The ``jax.checkpoint`` policy of :attr:`remat_policy`, or ``None`` when blocks are not rematerialised."""
    return REMAT_POLICIES[self.remat_policy] if self.remat else None

  @property
  def num_groups(self) -> int:
    """Query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count (embeddings included, value head excluded)."""
    e, d, f = self.hidden_size, self.head_dim, self.mlp_dim
    qkv = e * (self.num_heads + 2 * self.num_kv_heads) * d
    qkv_b = (self.num_heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
    block = qkv + qkv_b + self.num_heads * d * e + 3 * e * f + 2 * e
    embed = self.vocab_size * e * (1 if self.tie_embeddings else 2)
    return self.num_layers * block + embed + e


_PRESETS: dict[str, ModelConfig] = {
    # The byte-level CPU default: 264 = 256 bytes + 8 special tokens.
    "tiny": ModelConfig(),
    # Qwen2-shaped benchmark model (issue acceptance shapes).
    "bench": ModelConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         mlp_dim=1024),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                                num_kv_heads=2, mlp_dim=4864, rope_theta=1000000.0, tie_embeddings=True,
                                max_position_embeddings=32768, param_dtype="bfloat16", dtype="bfloat16"),
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                                num_kv_heads=2, mlp_dim=8960, rope_theta=1000000.0, tie_embeddings=True,
                                max_position_embeddings=32768, param_dtype="bfloat16", dtype="bfloat16"),
    # Float32 masters, bfloat16 compute: the presets above with param_dtype float32 (see the module docstring).
    "qwen2.5-0.5b-mixed": ModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                                      num_kv_heads=2, mlp_dim=4864, rope_theta=1000000.0, tie_embeddings=True,
                                      max_position_embeddings=32768, param_dtype="float32", dtype="bfloat16",
                                      remat=True, remat_policy="dots_with_no_batch_dims_saveable"),
    "qwen2.5-1.5b-mixed": ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                                      num_kv_heads=2, mlp_dim=8960, rope_theta=1000000.0, tie_embeddings=True,
                                      max_position_embeddings=32768, param_dtype="float32", dtype="bfloat16",
                                      remat=True, remat_policy="dots_with_no_batch_dims_saveable"),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                              num_kv_heads=4, mlp_dim=18944, rope_theta=1000000.0, tie_embeddings=False,
                              max_position_embeddings=32768, param_dtype="bfloat16", dtype="bfloat16",
                              remat=True),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, mlp_dim=14336, rope_theta=500000.0, rms_norm_eps=1e-5,
                              qkv_bias=False, tie_embeddings=False, max_position_embeddings=8192,
                              param_dtype="bfloat16", dtype="bfloat16", remat=True, model_type="llama"),
}


def preset_names() -> list[str]:
  return sorted(_PRESETS)


def get_preset(name: str, **overrides) -> ModelConfig:
  """Returns a preset config, optionally with fields replaced (``get_preset("tiny", num_layers=4)``)."""
  if name not in _PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}")
  return _PRESETS[name].replace(**overrides)
