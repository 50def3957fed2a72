"""LoRA: low-rank adapters on the attention and MLP projections, applied to the parameter tree.

For a projection ``y = x W`` (``W [in, out]``, our ``x @ W`` convention) a rank-``r`` adapter is
``A [in, r]``, ``B [r, out]`` and the adapted weight is

    W' = W + s A B,    s = alpha / r    (or alpha / sqrt(r) with ``use_rslora``).

This module never changes the :class:`~lemon_rl.models.transformer.Transformer`'s forward: the adapters
are merged into a copy of the frozen base parameters (:func:`apply_adapters`), so a LoRA loss is
``loss_fn(nnx.merge(graphdef, apply_adapters(base, adapters, cfg)), batch)`` and every existing loss, the
sampler and ``to_hf`` work unchanged; gradients and optimizer state exist only for ``adapters``
(:func:`lora_update_step`). Costs of the merged form against a LoRA branch ``x A B`` inside the forward:
the merge itself (``L`` rank-``r`` products and one add per adapted weight, small beside a forward of
thousands of tokens) and the weight-gradient matmuls ``dW = x^T dy`` of the adapted weights, which full
fine-tuning pays and a LoRA branch would not (``dA = s dW B^T``, ``dB = s A^T dW``); the memory saving
(no full-size gradients kept, optimizer moments for the adapters only) is kept. The forward sees the
merged weight in the base weight's dtype: exactly the model that :func:`merge` hands the sampler and that
the merged Hugging Face export reloads, so training and sampling log-probs agree. With bfloat16 base
weights a change of ``W`` below half a bfloat16 ulp is invisible to the forward (its gradient still
flows); keep ``param_dtype="float32"`` for small updates (a 1.5B model is 6 GB in float32).

Adapters are one pytree, each array stacked over the ``L`` layers::

  {"q": {"a": [L, E, r], "b": [L, r, H*D]}, "k": {"a": [L, E, r], "b": [L, r, K*D]}, "v": ...,
   "o": {"a": [L, H*D, r], "b": [L, r, E]}, "gate": {"a": [L, E, r], "b": [L, r, F]}, "up": ...,
   "down": {"a": [L, F, r], "b": [L, r, E]}}

in the input/output order of Hugging Face's ``q_proj ... down_proj`` (``A = lora_A.weight^T``,
``B = lora_B.weight^T`` in PEFT's files, :func:`to_peft`). Into the fused layouts (``hf.py``):
``qkv [E, K, G + 2, D]`` gets ``group_qkv(concat([dq, dk, dv], 1))``, ``gate_up [E, F, 2]`` gets
``stack([dgate, dup], -1)``, ``out [H, D, E]`` gets ``do`` reshaped, ``down [F, E]`` gets ``ddown``.
Initialisation as PEFT's default: ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` (kaiming-uniform with ``a = sqrt(5)``),
``B = 0``, so a fresh adapter leaves the model exactly unchanged. No LoRA dropout (a dropout on the
branch's input has no merged form; RL fine-tuning usually runs without it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import load_file, save_file

from lemon_rl import ops
from lemon_rl.models.config import ModelConfig
from lemon_rl.models.sharding import tree_shardings
from lemon_rl.models.transformer import Transformer
from lemon_rl.training.checkpoint import Checkpointer
from lemon_rl.training.state import LossFn, TrainState, apply_gradient_sum

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Hugging Face module of each target, under ``model.layers.{i}.``.
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_PEFT_PREFIX = "base_model.model.model.layers."
# Model fields that decide the adapters' shapes (stored in checkpoints and checked on restore).
_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")


class LoraMismatchError(ValueError):
  """An adapter checkpoint or file was written for another LoRA config or model shape."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """LoRA hyper-parameters (frozen: a static argument of ``jax.jit``).

  Attributes:
    rank: ``r``, the adapters' inner width.
    alpha: scale numerator; the update is ``(alpha / r) A B`` (``alpha / sqrt(r)`` with ``use_rslora``).
    targets: adapted projections, a subset of ``TARGETS`` (stored in ``TARGETS`` order).
    use_rslora: rank-stabilised scale ``alpha / sqrt(r)`` (Kalajdzievski 2023; PEFT's ``use_rslora``).
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = TARGETS
  use_rslora: bool = False

  def __post_init__(self):
    if int(self.rank) != self.rank or self.rank < 1:
      raise ValueError(f"rank={self.rank} must be a positive integer")
    targets = tuple(self.targets)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets or len(set(targets)) != len(targets):
      raise ValueError(f"targets={targets!r} must be distinct, non-empty names from {TARGETS}")
    object.__setattr__(self, "rank", int(self.rank))
    object.__setattr__(self, "alpha", float(self.alpha))
    object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))

  @property
  def scale(self) -> float:
    """``s``: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``."""
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

  def to_dict(self) -> dict[str, Any]:
    return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "use_rslora": self.use_rslora}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "LoraConfig":
    return cls(rank=d["rank"], alpha=d["alpha"], targets=tuple(d["targets"]), use_rslora=d["use_rslora"])


def _model_cfg(model_or_cfg: Transformer | ModelConfig) -> ModelConfig:
  return model_or_cfg if isinstance(model_or_cfg, ModelConfig) else model_or_cfg.cfg


def projection_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """``{target: (in, out)}`` of each projection in Hugging Face terms (``E``, ``H*D``, ``K*D``, ``F``)."""
  e, f = model_cfg.hidden_size, model_cfg.mlp_dim
  hd, kd = model_cfg.num_heads * model_cfg.head_dim, model_cfg.num_kv_heads * model_cfg.head_dim
  return {"q": (e, hd), "k": (e, kd), "v": (e, kd), "o": (hd, e), "gate": (e, f), "up": (e, f), "down": (f, e)}


# Logical axes (``sharding.py``) of each projection's input and output dimension, as the base weights have
# them: q's H*D columns are KV-group-major, split by ``kv_heads`` like the fused QKV; o's rows are heads.
_LOGICAL = {"q": ("embed", "kv_heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
            "o": ("heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed")}


def num_adapter_params(model_cfg: ModelConfig, lora_cfg: LoraConfig) -> int:
  """``L * sum_targets r * (in + out)``."""
  shapes = projection_shapes(model_cfg)
  return model_cfg.num_layers * sum(lora_cfg.rank * sum(shapes[t]) for t in lora_cfg.targets)


def init_adapters(model_or_cfg: Transformer | ModelConfig, lora_cfg: LoraConfig, key: jax.Array,
                  dtype: Any = jnp.float32) -> dict[str, dict[str, jax.Array]]:
  """Fresh adapters: ``a ~ U(-1/sqrt(in), 1/sqrt(in))`` ``[L, in, r]``, ``b = 0`` ``[L, r, out]`` per target."""
  cfg = _model_cfg(model_or_cfg)
  shapes, n, r = projection_shapes(cfg), cfg.num_layers, lora_cfg.rank
  adapters = {}
  for t, k in zip(lora_cfg.targets, jax.random.split(key, len(lora_cfg.targets))):
    fan_in, fan_out = shapes[t]
    bound = 1.0 / math.sqrt(fan_in)
    adapters[t] = {"a": jax.random.uniform(k, (n, fan_in, r), dtype, -bound, bound),
                   "b": jnp.zeros((n, r, fan_out), dtype)}
  return adapters


def abstract_adapters(model_or_cfg: Transformer | ModelConfig, lora_cfg: LoraConfig,
                      dtype: Any = jnp.float32) -> Any:
  """``jax.ShapeDtypeStruct`` leaves of :func:`init_adapters` (a restore target)."""
  return jax.eval_shape(lambda: init_adapters(model_or_cfg, lora_cfg, jax.random.key(0), dtype))


def adapter_logical_axes(lora_cfg: LoraConfig) -> dict[str, dict[str, tuple]]:
  """Logical axes of every adapter leaf: ``a`` ``(None, in)``, ``b`` ``(None, None, out)``.

  The layer and rank axes are replicated; ``in`` / ``out`` carry the base weight's logical name for that
  dimension (``embed``, ``heads``, ``kv_heads``, ``mlp``), so a tensor-parallel or FSDP split of an adapter
  follows its weight's.
  """
  return {t: {"a": (None, _LOGICAL[t][0], None), "b": (None, None, _LOGICAL[t][1])} for t in lora_cfg.targets}


def adapter_shardings(adapters: Any, lora_cfg: LoraConfig, mesh, rules) -> Any:
  """``NamedSharding`` of each adapter leaf on ``mesh`` by :func:`adapter_logical_axes` and ``rules``."""
  return tree_shardings(adapter_logical_axes(lora_cfg), adapters, mesh, rules)


def shard_adapters(adapters: Any, lora_cfg: LoraConfig, mesh, rules) -> Any:
  """Places adapters on ``mesh`` (see :func:`adapter_shardings`)."""
  return jax.device_put(adapters, adapter_shardings(adapters, lora_cfg, mesh, rules))


def _check_adapters(adapters: Mapping[str, Any], lora_cfg: LoraConfig) -> None:
  if tuple(t for t in TARGETS if t in adapters) != lora_cfg.targets or set(adapters) - set(TARGETS):
    raise LoraMismatchError(f"adapters hold targets {sorted(adapters)}, the LoRA config {list(lora_cfg.targets)}")
  for t in lora_cfg.targets:
    if adapters[t]["a"].shape[-1] != lora_cfg.rank or adapters[t]["b"].shape[-2] != lora_cfg.rank:
      raise LoraMismatchError(f"adapter {t!r} has rank {adapters[t]['a'].shape[-1]}, the LoRA config "
                              f"{lora_cfg.rank}")


def _delta(adapters: Mapping[str, Any], target: str, layer: int, scale: float) -> jax.Array:
  """``s A B`` of one layer, ``[in, out]`` float32 (full-precision matmul: it is small)."""
  a, b = adapters[target]["a"][layer], adapters[target]["b"][layer]
  return scale * jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def fused_deltas(adapters: Mapping[str, Any], lora_cfg: LoraConfig, layer: int,
                 shapes: Mapping[str, tuple[int, ...]]) -> dict[str, jax.Array]:
  """Layer ``layer``'s updates in the fused layouts, ``{param name: delta}`` (float32).

  ``shapes`` maps ``qkv``, ``out``, ``gate_up``, ``down`` to the base weights' shapes. Only weights with a
  target appear; a member without an adapter (e.g. ``k`` when only ``q`` and ``v`` are targeted) gets 0.
  """
  s, targets = lora_cfg.scale, lora_cfg.targets
  d = {t: _delta(adapters, t, layer, s) for t in targets}
  out = {}
  if any(t in targets for t in "qkv"):
    e, kv, slots, hd = shapes["qkv"]
    widths = {"q": kv * (slots - 2) * hd, "k": kv * hd, "v": kv * hd}
    parts = {t: d.get(t, jnp.zeros((e, widths[t]), jnp.float32)) for t in "qkv"}
    # = group_qkv(concat([dq, dk, dv], 1)): per KV head k, its G query heads, then its key, then its value.
    out["qkv"] = jnp.concatenate([parts["q"].reshape(e, kv, slots - 2, hd), parts["k"].reshape(e, kv, 1, hd),
                                  parts["v"].reshape(e, kv, 1, hd)], axis=2)
  if "o" in targets:
    out["out"] = d["o"].reshape(shapes["out"])
  if "gate" in targets or "up" in targets:
    e, f, _ = shapes["gate_up"]
    zeros = jnp.zeros((e, f), jnp.float32)
    out["gate_up"] = jnp.stack([d.get("gate", zeros), d.get("up", zeros)], axis=-1)
  if "down" in targets:
    out["down"] = d["down"]
  return out


def _names(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)


def apply_adapters(base_params: Any, adapters: Mapping[str, Any], lora_cfg: LoraConfig) -> Any:
  """``base_params`` (``nnx.split(model, nnx.Param)[1]`` or the model's whole state) with every adapted
  weight replaced by ``W + s A B`` in ``W``'s dtype; other leaves are passed through untouched.

  Pure: use under ``jax.grad`` with respect to ``adapters`` (the base's leaves get no gradient).
  """
  _check_adapters(adapters, lora_cfg)
  leaves = {_names(p)[:3]: x for p, x in jax.tree_util.tree_flatten_with_path(base_params)[0]}
  num_layers = next(iter(adapters.values()))["a"].shape[0]
  if ("blocks", num_layers - 1, "qkv") not in leaves or ("blocks", num_layers, "qkv") in leaves:
    raise LoraMismatchError(f"adapters have {num_layers} layers; the base parameters have a different number")
  deltas = {}
  for i in range(num_layers):
    shapes = {n: leaves[("blocks", i, n)].shape for n in ("qkv", "out", "gate_up", "down")}
    deltas.update({("blocks", i, n): v for n, v in fused_deltas(adapters, lora_cfg, i, shapes).items()})

  def update(path, w):
    delta = deltas.get(_names(path)[:3])
    if delta is None:
      return w
    return (w.astype(jnp.float32) + delta).astype(w.dtype)

  return jax.tree_util.tree_map_with_path(update, base_params)


def merge(model: Transformer, adapters: Mapping[str, Any], lora_cfg: LoraConfig) -> Transformer:
  """A plain :class:`Transformer` with the adapters merged in (``model`` is not changed).

  For sampling, evaluation and the merged Hugging Face export (``to_hf(merge(model, adapters, cfg), path)``).
  """
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, apply_adapters(state, adapters, lora_cfg))


# -- training ------------------------------------------------------------------------------------------


def create_lora_train_state(model: Transformer, lora_cfg: LoraConfig, optimizer: optax.GradientTransformation,
                            seed: int, adapters: Any = None):
  """Returns ``(graphdef, base_params, TrainState)``; the state's ``params`` are the adapters only.

  ``adapters`` default to :func:`init_adapters` with a key derived from ``seed``; the optimizer state is
  ``optimizer.init(adapters)`` (built under ``jit`` as in ``state.create_train_state``). ``base_params``
  stay frozen: pass them to :func:`lora_update_step`, which never changes them.
  """
  graphdef, base_params = nnx.split(model, nnx.Param)
  init_key, state_key = jax.random.split(jax.random.key(seed))
  if adapters is None:
    adapters = init_adapters(model.cfg, lora_cfg, init_key)
  _check_adapters(adapters, lora_cfg)
  key_data = jax.random.key_data(state_key)

  @jax.jit
  def init(adapters):
    return TrainState(params=adapters, opt_state=optimizer.init(adapters), step=jnp.zeros((), jnp.int32),
                      rng=key_data)

  return graphdef, base_params, init(adapters)


def accumulate_adapter_gradients(graphdef, base_params, adapters, batch: Any, loss_fn: LossFn,
                                 lora_cfg: LoraConfig, num_microbatches: int = 1):
  """``state.accumulate_gradients`` with respect to the adapters of a frozen base.

  ``loss_fn(model, batch)`` gets the merged plain model. Returns ``(loss, metrics, grad_sum)`` with
  ``grad_sum`` shaped like ``adapters`` (the exact batch gradient is ``grad_sum / loss.denominator``).
  """

  def sum_and_metrics(ad, micro):
    loss, metrics = loss_fn(nnx.merge(graphdef, apply_adapters(base_params, ad, lora_cfg)), micro)
    return loss.sum, (loss, metrics)

  grad_fn = jax.grad(sum_and_metrics, has_aux=True)
  if num_microbatches == 1:
    grads, (loss, metrics) = grad_fn(adapters, batch)
    return loss, metrics, grads

  def split(x):
    if x.shape[0] % num_microbatches:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {num_microbatches} micro-batches")
    return x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:])

  micro = jax.tree.map(split, batch)
  grads, (loss, metrics) = grad_fn(adapters, jax.tree.map(lambda x: x[0], micro))

  def body(carry, m):
    g_acc, l_acc, met_acc = carry
    g, (l, met) = grad_fn(adapters, m)
    return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, ops.merge_metrics(met_acc, met)), None

  (grads, loss, metrics), _ = jax.lax.scan(body, (grads, loss, metrics), jax.tree.map(lambda x: x[1:], micro))
  return loss, metrics, grads


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_fn", "optimizer", "lora_cfg", "num_microbatches"),
                   donate_argnames=("state",))
def lora_update_step(graphdef, base_params, state: TrainState, batch: Any, *, loss_fn: LossFn,
                     optimizer: optax.GradientTransformation, lora_cfg: LoraConfig, num_microbatches: int = 1):
  """One optimizer step of the adapters in ``state.params``; returns ``(new_state, {name: scalar})``.

  As ``state.update_step`` (same metrics, exact micro-batch accumulation) with the loss evaluated on
  ``apply_adapters(base_params, state.params)``. ``base_params`` are read, never donated nor updated.
  """
  loss, metrics, grad_sum = accumulate_adapter_gradients(graphdef, base_params, state.params, batch, loss_fn,
                                                         lora_cfg, num_microbatches)
  return apply_gradient_sum(state, loss, metrics, grad_sum, optimizer)


# -- adapter-only checkpoints --------------------------------------------------------------------------


def _signature(lora_cfg: LoraConfig, model_cfg: ModelConfig) -> dict[str, Any]:
  return {"config": lora_cfg.to_dict(), "model": {f: getattr(model_cfg, f) for f in _SHAPE_FIELDS}}


def _check_signature(saved: Any, lora_cfg: LoraConfig, model_cfg: ModelConfig, where: str) -> None:
  if not isinstance(saved, dict) or "config" not in saved:
    raise LoraMismatchError(f"{where} holds no LoRA config: not an adapter checkpoint written by save_adapters")
  wanted = _signature(lora_cfg, model_cfg)
  diffs = [f"{part}.{k}: saved {saved[part].get(k)!r}, expected {v!r}"
           for part in ("config", "model") for k, v in wanted[part].items() if saved[part].get(k) != v]
  if diffs:
    raise LoraMismatchError(f"{where} was written for another LoRA config or model: " + "; ".join(diffs))


def save_adapters(checkpointer: Checkpointer, step: int, state: Any, lora_cfg: LoraConfig,
                  model_cfg: ModelConfig, metadata: Mapping[str, Any] | None = None, *, force: bool = False) -> bool:
  """Saves adapters (or a LoRA ``TrainState``: adapters + their optimizer state) without the base weights.

  The LoRA config and the model's shape fields are stored in the step's metadata under ``"lora"`` and
  checked by :func:`restore_adapters`. Returns ``checkpointer.save``'s result.
  """
  adapters = state.params if isinstance(state, TrainState) else state
  _check_adapters(adapters, lora_cfg)
  meta = dict(metadata or {})
  meta["lora"] = _signature(lora_cfg, model_cfg)
  return checkpointer.save(step, state, meta, force=force)


def restore_adapters(checkpointer: Checkpointer, lora_cfg: LoraConfig, model_cfg: ModelConfig,
                     target: Any = None, step: int | None = None) -> tuple[Any, dict[str, Any]]:
  """Restores what :func:`save_adapters` wrote, after checking its LoRA config and model shapes.

  Args:
    checkpointer: the adapter checkpoint directory's :class:`Checkpointer`.
    lora_cfg: the config the caller expects; any difference raises :class:`LoraMismatchError`.
    model_cfg: the base model's config (its shape fields must equal the saved ones).
    target: the abstract pytree to restore (e.g. the LoRA ``TrainState``, for resuming); default the
      adapters alone (:func:`abstract_adapters`, float32).
    step: a committed step, default the latest.

  Returns:
    ``(state, metadata)``, ``metadata`` without the ``"lora"`` entry.
  """
  where = f"adapter checkpoint in {checkpointer.directory}"
  _check_signature(checkpointer.read_metadata(step).get("lora"), lora_cfg, model_cfg, where)
  if target is None:
    target = abstract_adapters(model_cfg, lora_cfg)
  state, meta = checkpointer.restore(target, step)
  _check_signature(meta.pop("lora", None), lora_cfg, model_cfg, where)  # the step restored (after a fallback)
  return state, meta


# -- PEFT format ---------------------------------------------------------------------------------------


def to_peft(adapters: Mapping[str, Any], lora_cfg: LoraConfig, path: str,
            base_model_name_or_path: str | None = None) -> None:
  """Writes ``adapter_model.safetensors`` and ``adapter_config.json`` as PEFT saves a LoRA adapter.

  Tensors ``base_model.model.model.layers.{i}.{module}.lora_A.weight`` ``[r, in]`` (``= A^T``) and
  ``.lora_B.weight`` ``[out, r]`` (``= B^T``), float32, so that ``W_hf + s lora_B @ lora_A`` is the adapted
  ``nn.Linear`` weight. Does not need (or import) ``peft``.
  """
  _check_adapters(adapters, lora_cfg)
  os.makedirs(path, exist_ok=True)
  tensors = {}
  for t in lora_cfg.targets:
    a = np.asarray(jax.device_get(adapters[t]["a"]), np.float32)
    b = np.asarray(jax.device_get(adapters[t]["b"]), np.float32)
    for i in range(a.shape[0]):
      name = f"{_PEFT_PREFIX}{i}.{HF_MODULES[t]}"
      tensors[name + ".lora_A.weight"] = np.ascontiguousarray(a[i].T)
      tensors[name + ".lora_B.weight"] = np.ascontiguousarray(b[i].T)
  save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
      "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "use_rslora": lora_cfg.use_rslora,
      "target_modules": [HF_MODULES[t].split(".")[-1] for t in lora_cfg.targets],
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
      "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
      "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
  }
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)


def from_peft(path: str, model_or_cfg: Transformer | ModelConfig) -> tuple[dict[str, Any], LoraConfig]:
  """Reads a PEFT LoRA adapter directory (as :func:`to_peft` writes) into ``(adapters, LoraConfig)``.

  Supports plain LoRA on any subset of the seven projections of every layer: a config with DoRA, a bias,
  per-module rank or alpha patterns, a layer subset or extra trained modules is refused.
  """
  cfg = _model_cfg(model_or_cfg)
  with open(os.path.join(path, "adapter_config.json")) as f:
    pc = json.load(f)
  if pc.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"peft_type {pc.get('peft_type')!r} is not LORA")
  unsupported = {"use_dora": False, "lora_bias": False, "bias": "none", "fan_in_fan_out": False,
                 "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
  for k, ok in unsupported.items():
    v = pc.get(k)
    if v not in (None, ok) and not (ok in (None, {}) and not v):
      raise ValueError(f"PEFT adapter option {k}={pc[k]!r} is not supported (supported: {ok!r})")
  modules = pc["target_modules"]
  if isinstance(modules, str):
    raise ValueError(f"target_modules given as a pattern ({modules!r}) is not supported; list module names")
  by_module = {m.split(".")[-1]: t for t, m in HF_MODULES.items()}
  unknown = sorted(set(modules) - set(by_module))
  if unknown:
    raise ValueError(f"target modules {unknown} are not LoRA targets here (known: {sorted(by_module)})")
  lora_cfg = LoraConfig(rank=pc["r"], alpha=pc["lora_alpha"], targets=tuple(by_module[m] for m in modules),
                        use_rslora=bool(pc.get("use_rslora", False)))
  tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
  shapes, used, adapters = projection_shapes(cfg), set(), {}
  for t in lora_cfg.targets:
    a_layers, b_layers = [], []
    for i in range(cfg.num_layers):
      name = f"{_PEFT_PREFIX}{i}.{HF_MODULES[t]}"
      for suffix, dest, shape in ((".lora_A.weight", a_layers, (lora_cfg.rank, shapes[t][0])),
                                  (".lora_B.weight", b_layers, (shapes[t][1], lora_cfg.rank))):
        if name + suffix not in tensors:
          raise LoraMismatchError(f"tensor {name + suffix!r} missing from {path}")
        x = np.asarray(tensors[name + suffix], np.float32)
        if x.shape != shape:
          raise LoraMismatchError(f"{name + suffix} has shape {x.shape}, this model expects {shape}")
        used.add(name + suffix)
        dest.append(x.T)
    adapters[t] = {"a": jnp.asarray(np.stack(a_layers)), "b": jnp.asarray(np.stack(b_layers))}
  extra = sorted(set(tensors) - used)
  if extra:
    raise LoraMismatchError(f"adapter tensors not used by this model: {extra[:8]}")
  return adapters, lora_cfg
