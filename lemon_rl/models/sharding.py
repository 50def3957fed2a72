"""Device mesh and logical-axis sharding.

Parameters and activations are annotated with *logical* axis names (``batch``, ``embed``, ``heads``,
``kv_heads``, ``mlp``, ``vocab``, ...). Rules in the model config map each logical name to a mesh axis of a
``Mesh`` with axes ``("data", "fsdp", "tensor")``. The same code runs on one device (every mesh axis of
size 1), on 8 fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and on an
accelerator slice.

Multi-host: call ``jax.distributed.initialize()`` (on a TPU pod or a SLURM/Open MPI cluster it needs no
arguments; elsewhere pass ``coordinator_address``, ``num_processes`` and ``process_id``) *before* any other
JAX call, then build the mesh with :func:`make_mesh` over ``jax.devices()`` (all processes' devices). Each
process feeds its slice of the global batch (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Named logical-axis rule sets (``ModelConfig(axis_rules=AXIS_RULE_SETS[name])``). In all of them the batch
# is split over ``data`` x ``fsdp``; they differ in how the parameters are split.
#   fsdp: parameters split along ``embed`` over ``fsdp`` (ZeRO-3 style: each device holds ``1/fsdp`` of every
#     weight and its Adam moments, XLA all-gathers a weight where it is used and reduce-scatters its
#     gradient), nothing over ``tensor``. One GPU: ``make_mesh(1, 1, 1)``, every split is trivial (FSDP-1).
#     Several GPUs of one host, or a small model on a TPU slice: ``make_mesh(data=1, fsdp=-1)``.
#   fsdp_tp: ``fsdp`` plus tensor parallelism over ``tensor``: heads, KV groups (whole ``q | k | v`` groups,
#     see ``transformer.group_qkv``), MLP columns (whole ``gate | up`` pairs) and the vocabulary. For a TPU
#     slice, e.g. ``make_mesh(data=1, fsdp=-1, tensor=4)`` for a model whose KV heads ``tensor`` divides (a
#     dimension that ``tensor`` does not divide stays replicated: Qwen2.5-0.5B/1.5B have 2 KV heads, so
#     their fused QKV splits over ``tensor <= 2`` only). Equal to ``config.DEFAULT_AXIS_RULES``.
#   data_parallel: parameters replicated, only the batch split (small models, many devices).
AXIS_RULE_SETS: dict[str, tuple[tuple[str, Any], ...]] = {
    "fsdp": (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("vocab", None), ("heads", None),
             ("kv_heads", None), ("mlp", None), ("head_dim", None), ("seq", None)),
    "fsdp_tp": (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("vocab", "tensor"), ("heads", "tensor"),
                ("kv_heads", "tensor"), ("mlp", "tensor"), ("head_dim", None), ("seq", None)),
    "data_parallel": (("batch", ("data", "fsdp")), ("embed", None), ("vocab", None), ("heads", None),
                      ("kv_heads", None), ("mlp", None), ("head_dim", None), ("seq", None)),
}


def axis_rules(name: str) -> tuple[tuple[str, Any], ...]:
  """The rule set ``name`` of :data:`AXIS_RULE_SETS`."""
  if name not in AXIS_RULE_SETS:
    raise ValueError(f"unknown axis rule set {name!r}; expected one of {', '.join(AXIS_RULE_SETS)}")
  return AXIS_RULE_SETS[name]


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a ``(data, fsdp, tensor)`` mesh; ``-1`` for one axis takes the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  shape = [data, fsdp, tensor]
  if shape.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got data={data}, fsdp={fsdp}, tensor={tensor}")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices cannot be split into a mesh with fixed axes of size {known}")
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f"mesh data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} needs "
                     f"{int(np.prod(shape))} devices, {len(devices)} available")
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Sequence[tuple[str, Any]]) -> PartitionSpec:
  """Maps logical axis names to a ``PartitionSpec`` with ``rules``; a mesh axis is used at most once."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name in logical_axes:
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a not in used)
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


_ACTIVE_RULES: list[tuple[Mesh, Sequence[tuple[str, Any]]]] = []


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Iterator[None]:
  """Within this context (at trace time), :func:`constrain` applies sharding constraints."""
  _ACTIVE_RULES.append((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE_RULES.pop()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """``with_sharding_constraint`` by logical names; a no-op outside :func:`activation_sharding`."""
  if not _ACTIVE_RULES:
    return x
  mesh, rules = _ACTIVE_RULES[-1]
  spec = logical_to_spec(logical_axes, rules)
  # Drop mesh axes that do not divide the dimension (e.g. batch 1 on a data axis of 2).
  spec = PartitionSpec(*[_fit(dim, s, mesh) for dim, s in zip(x.shape, spec)])
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _fit(dim: int, axes: Any, mesh: Mesh) -> Any:
  if axes is None:
    return None
  names = (axes,) if isinstance(axes, str) else tuple(axes)
  kept, size = [], 1
  for name in names:
    if dim % (size * mesh.shape[name]) == 0:
      kept.append(name)
      size *= mesh.shape[name]
  return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def tree_shardings(logical_tree: Any, shapes: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
  """``NamedSharding`` for each leaf of ``shapes`` given matching logical-axis tuples."""

  def one(axes, leaf):
    spec = logical_to_spec(axes, rules) if axes is not None else PartitionSpec()
    return NamedSharding(mesh, PartitionSpec(*[_fit(d, s, mesh) for d, s in zip(leaf.shape, spec)]))

  return jax.tree.map(one, logical_tree, shapes, is_leaf=lambda a: isinstance(a, tuple) or a is None)
