"""Several JAX processes (multi-host): initialisation, batch placement, host-side gathers, process-0 output.

lemon_rl runs multi-host the way JAX itself does (multi-controller SPMD, no launcher or RPC layer): every
process runs the same program on one global ``Mesh`` over all processes' devices, and every jitted call is
a collective over that mesh. What this module adds is the host side:

* :func:`initialize` starts ``jax.distributed`` from arguments, ``JAX_COORDINATOR_ADDRESS`` /
  ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or the cluster's own environment (SLURM, Open MPI, TPU
  slices, Kubernetes: JAX detects them), with gloo collectives for CPU devices.
* **A global batch is the concatenation of process-local batches.** The data pipeline gives each process
  its own rows (:func:`iterator_shard`: ``B / S`` examples of every global batch of ``B`` for ``S`` data
  shards); :func:`to_global` places them with ``jax.make_array_from_process_local_data``, rows sharded on
  the mesh's batch axes; :func:`to_local` reads back only this process's rows of a batch-sharded result
  (its addressable shards: never a ``device_get`` of data another process holds).
* **Host-side work stays where its rows are.** Each prompt's ``G`` samples are consecutive rows of one
  process, so completions are decoded and rewarded by the process that holds them; the small per-row
  results (rewards, lengths) are then gathered (:func:`gather_rows`) when a statistic needs every row
  (batch-level advantages, logged metrics).
* **Process 0 writes** logs, metrics and summaries (:func:`is_main`, :class:`MetricsSink` for the others);
  orbax writes checkpoints from all processes together.
* **Preemption sync point**: :func:`global_any` of each process's stop flag once per step, so a SIGTERM to
  any one process makes every process save the same step and stop.

With one process every function here is the identity or a local computation (no collective), so the same
code runs unchanged in one and in several processes. ``S`` (the number of data shards) is the number of
distinct batch slices the processes hold (:func:`data_shard`): the process count when the batch axes span
the processes, fewer when processes hold replicas of the same rows (e.g. a tensor axis across hosts).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lemon_rl.models import sharding as sharding_lib
from lemon_rl.models.config import DEFAULT_AXIS_RULES
from lemon_rl.utils.config_checks import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # Read by jax.distributed.initialize itself.
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def requested_by_environment() -> bool:
  """Whether the environment asks for a multi-process run (``JAX_COORDINATOR_ADDRESS`` is set)."""
  return bool(os.environ.get(ENV_COORDINATOR))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               initialization_timeout: int = 300, heartbeat_timeout_seconds: int = 100) -> None:
  """Starts ``jax.distributed`` (before any other JAX call); a no-op if it is already started.

  Missing arguments come from ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0's coordinator),
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, else from the cluster (SLURM, Open MPI, Cloud TPU, GKE: JAX's
  own detection, so ``initialize()`` alone works there). CPU devices use gloo collectives (the default
  CPU client has none across processes).
  """
  if jax.distributed.is_initialized():
    return
  if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and os.environ.get(ENV_PROCESS_ID):
    process_id = int(os.environ[ENV_PROCESS_ID])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             local_device_ids=list(local_device_ids) if local_device_ids is not None else None,
                             initialization_timeout=initialization_timeout,
                             heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  _orbax_barriers_through_the_coordinator()


ORBAX_BARRIER_FLAG = "experimental_orbax_use_distributed_barrier"


def _orbax_barriers_through_the_coordinator() -> None:
  """Makes orbax synchronise processes through the coordinator's barriers (unless its flag was set).

  By default orbax's barriers are device collectives (``sync_global_devices``), and its async saves run them
  from background threads while the training loop issues its own collectives: the processes can then enter
  them in different orders and deadlock (seen here within a few steps with gloo). The coordinator's
  key-value barriers involve no device.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import  (defines the flag)
  if ORBAX_BARRIER_FLAG in flags.FLAGS and not flags.FLAGS[ORBAX_BARRIER_FLAG].present:
    flag = flags.FLAGS[ORBAX_BARRIER_FLAG]
    flag.value = True
    flag.present = 1  # Readable before absl parses the command line (e.g. in a notebook).


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def is_main() -> bool:
  """Whether this process writes logs, metrics and summaries (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier ``name`` (a no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def main_process_first(name: str) -> Iterator[None]:
  """Process 0 runs the block first (e.g. builds a dataset on disk), then the others (which find it built)."""
  if not is_main():
    barrier(f"{name}:main_done")
  yield
  if is_main():
    barrier(f"{name}:main_done")


# -- host-side collectives ------------------------------------------------------------------------------

def gather_rows(x: Any) -> np.ndarray:
  """``[n, ...]`` host rows of every process (equal shapes) -> ``[S * n, ...]``, in process order.

  The rows travel through the devices, so 64-bit values arrive as 32-bit ones unless ``jax_enable_x64``.
  """
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x
  if x.dtype == np.bool_:
    return np.asarray(multihost_utils.process_allgather(x.astype(np.int32), tiled=True)).astype(bool)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_block(gathered: np.ndarray) -> np.ndarray:
  """This process's rows of a :func:`gather_rows` result (its block ``[p * n, (p + 1) * n)``)."""
  n = gathered.shape[0] // jax.process_count()
  return gathered[jax.process_index() * n:(jax.process_index() + 1) * n]


def global_any(flag: bool) -> bool:
  """Whether ``flag`` is true in any process (the per-step preemption sync point)."""
  return bool(np.any(gather_rows(np.asarray([bool(flag)]))))


def global_sum(value: float) -> float:
  """The sum of a scalar over processes."""
  return float(np.sum(gather_rows(np.asarray([value], np.float64))))


def global_max(value: int) -> int:
  """The maximum of an integer over processes (e.g. the longest prompt, which fixes a padded shape)."""
  return int(np.max(gather_rows(np.asarray([value], np.int64))))


def gather_json(obj: Any) -> list[Any]:
  """Every process's JSON-serialisable ``obj``, in process order (``[obj]`` with one process)."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode("utf-8"), np.uint8)
  padded = np.zeros((1, global_max(len(data))), np.uint8)
  padded[0, :len(data)] = data
  rows, lengths = gather_rows(padded), gather_rows(np.asarray([len(data)]))
  return [json.loads(bytes(row[:n]).decode("utf-8")) for row, n in zip(rows, lengths)]


def mean_over_processes(metrics: Mapping[str, float], sums: Sequence[str] = ()) -> dict[str, float]:
  """Scalar metrics of equal-size process shards -> their mean over the processes that report each key
  (``sums``: the sum; ``*/max`` / ``*_max``: the max; ``*/min`` / ``*_min``: the min). The identity with one
  process."""
  if jax.process_count() == 1:
    return dict(metrics)
  per_process = gather_json({k: float(v) for k, v in metrics.items()})
  out = {}
  for k in sorted(set().union(*per_process)):
    column = np.asarray([m[k] for m in per_process if k in m], np.float64)
    if k in sums:
      out[k] = float(column.sum())
    elif k.endswith(("/max", "_max")):
      out[k] = float(column.max())
    elif k.endswith(("/min", "_min")):
      out[k] = float(column.min())
    else:
      out[k] = float(column.mean())
  return out


# -- the mesh's batch axes and this process's data shard ------------------------------------------------

def active_mesh() -> tuple[Mesh | None, Sequence[tuple[str, Any]]]:
  """The mesh and rules of the innermost :func:`lemon_rl.models.activation_sharding` context, if any."""
  if sharding_lib._ACTIVE_RULES:  # pylint: disable=protected-access
    return sharding_lib._ACTIVE_RULES[-1]  # pylint: disable=protected-access
  return None, DEFAULT_AXIS_RULES


def batch_axes(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> tuple[str, ...]:
  """The mesh axes (of size > 1) that the logical ``batch`` axis is split over."""
  spec = sharding_lib.logical_to_spec(("batch",), rules)[0]
  axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
  return tuple(a for a in axes if mesh.shape[a] > 1)


def data_shard(mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] | None = None) -> tuple[int, int]:
  """``(index, count)``: which of the ``count`` distinct row slices of a global batch this process holds.

  Processes whose devices hold the same rows (replicas along non-batch axes) share an index and must read
  the same data. Without a mesh (no :func:`lemon_rl.models.activation_sharding` context): one slice per
  process. Raises if the processes hold unequal numbers of batch slices.
  """
  if mesh is None:
    mesh, active_rules = active_mesh()
    rules = rules if rules is not None else active_rules
    if mesh is None:
      return jax.process_index(), jax.process_count()
  rules = rules if rules is not None else DEFAULT_AXIS_RULES
  if jax.process_count() == 1:
    return 0, 1
  axes = batch_axes(mesh, rules)
  n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  indices = NamedSharding(mesh, PartitionSpec(axes or None)).devices_indices_map((n,))
  blocks: dict[int, set[int]] = {}
  for device, index in indices.items():
    blocks.setdefault(device.process_index, set()).add(index[0].start or 0)
  per_process = {p: tuple(sorted(b)) for p, b in blocks.items()}
  if len({len(b) for b in per_process.values()}) != 1:
    raise ValueError(f"processes hold unequal numbers of batch slices on mesh {dict(mesh.shape)}: {per_process}")
  distinct = sorted(set(per_process.values()))
  return distinct.index(per_process[jax.process_index()]), len(distinct)


def iterator_shard(global_batch_size: int) -> dict[str, int]:
  """``BatchIterator`` keyword arguments for this process's share of a global batch of ``global_batch_size``
  examples: ``batch_size = global_batch_size / S``, ``shard_index``, ``num_shards = S`` (:func:`data_shard`)."""
  index, count = data_shard()
  if global_batch_size % count:
    raise ValueError(f"a global batch of {global_batch_size} examples does not split evenly over {count} data "
                     f"shards (processes); use a multiple of {count}")
  return {"batch_size": global_batch_size // count, "shard_index": index, "num_shards": count}


def row_multiple(mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] | None = None) -> int:
  """The number of batch slices per process: process-local row counts must be a multiple of it when
  several processes share the batch (one process pads nothing: a non-dividing batch is replicated)."""
  if mesh is None:
    mesh, active_rules = active_mesh()
    rules = rules if rules is not None else active_rules
  if mesh is None or jax.process_count() == 1:
    return 1
  axes = batch_axes(mesh, rules if rules is not None else DEFAULT_AXIS_RULES)
  total = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  return total // data_shard(mesh, rules)[1]


# -- placing process-local rows on the mesh and reading them back ----------------------------------------

def to_global(tree: Any, mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] | None = None) -> Any:
  """Process-local rows ``[n, ...]`` (numpy) -> global ``jax.Array`` s ``[S * n, ...]`` with rows sharded on
  the mesh's batch axes (``jax.make_array_from_process_local_data``).

  ``mesh`` and ``rules`` default to the active :func:`lemon_rl.models.activation_sharding` context. With one
  process, a batch axis that does not divide ``n`` is dropped (rows replicated over it, as
  :func:`lemon_rl.models.sharding.constrain` does), and without any mesh the leaves become plain
  ``jnp`` arrays; with several processes ``n`` must be a multiple of :func:`row_multiple`.
  """
  if mesh is None:
    mesh, active_rules = active_mesh()
    rules = rules if rules is not None else active_rules
  rules = rules if rules is not None else DEFAULT_AXIS_RULES
  if mesh is None:
    if jax.process_count() > 1:
      raise ValueError("several processes need a mesh to place a batch on: call inside "
                       "lemon_rl.models.activation_sharding(mesh, rules) or pass mesh=")
    return jax.tree.map(jnp.asarray, tree)
  axes = batch_axes(mesh, rules)

  def place(x):
    x = np.asarray(x)
    if jax.process_count() == 1:
      spec = sharding_lib._fit(x.shape[0], axes or None, mesh)  # pylint: disable=protected-access
      return jax.device_put(x, NamedSharding(mesh, PartitionSpec(spec)))
    multiple = row_multiple(mesh, rules)
    if x.shape[0] % multiple:
      raise ValueError(f"{x.shape[0]} process-local rows do not split over this process's {multiple} batch "
                       "slices; use a multiple")
    return jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec(axes or None)), x)

  return jax.tree.map(place, tree)


@functools.partial(jax.jit, static_argnames=("sharding",))
def _take(tree: Any, rows: jax.Array, sharding: NamedSharding) -> Any:
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x[rows], sharding), tree)


def take_rows(tree: Any, rows: np.ndarray, mesh: Mesh | None = None,
              rules: Sequence[tuple[str, Any]] | None = None) -> Any:
  """Rows ``rows`` (global row indices, the same in every process) of global batch arrays, placed as
  :func:`to_global` places a batch: a gather on the devices, so a minibatch drawn from a rollout does not
  depend on which process sampled which rows."""
  if mesh is None:
    mesh, active_rules = active_mesh()
    rules = rules if rules is not None else active_rules
  rows = np.asarray(rows, np.int32)
  if mesh is None:
    return jax.tree.map(lambda x: jnp.asarray(x)[rows], tree)
  axes = batch_axes(mesh, rules if rules is not None else DEFAULT_AXIS_RULES)
  spec = sharding_lib._fit(len(rows), axes or None, mesh)  # pylint: disable=protected-access
  return _take(tree, rows, NamedSharding(mesh, PartitionSpec(spec)))


def to_local(tree: Any) -> Any:
  """Global arrays -> numpy: this process's rows of a batch-sharded array (its addressable shards, in row
  order), the whole array when it is fully addressable (one process) or replicated.

  The inverse of :func:`to_global` on row-wise results (sampled tokens, per-row log-probs).
  """

  def read(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    blocks: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
      rows = shard.index[0] if shard.index else slice(None)
      if any(s != slice(None) and (s.start or 0, s.stop) != (0, d) for s, d in zip(shard.index[1:], x.shape[1:])):
        raise ValueError(f"to_local reads row-sharded arrays; got sharding {x.sharding} for shape {x.shape}")
      blocks.setdefault(rows.start or 0, shard.data)
    return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)])

  return jax.tree.map(read, tree)


# -- process-0 output --------------------------------------------------------------------------------------

class MetricsSink:
  """What processes other than 0 use in place of a ``MetricsWriter``: returns records, writes nothing."""

  def write(self, phase: str, step: int, scalars: Mapping[str, Any], echo: bool = False) -> dict[str, Any]:
    del echo
    record: dict[str, Any] = {"phase": phase, "step": int(step)}
    for k, v in scalars.items():
      try:
        record[k] = float(np.asarray(v))
      except (TypeError, ValueError):
        record[k] = None
    return record

  def truncate(self, phase: str, last_step: int) -> None:
    del phase, last_step

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


# -- what runs multi-process -------------------------------------------------------------------------------

SUPPORTED_PHASES = ("sft", "expert_sft", "continued_sft", "rl")
SUPPORTED_RL_ALGORITHMS = ("grpo",)


def check_supported(config, task=None) -> None:
  """Raises ``ConfigError`` (before anything is compiled) for what is not yet multi-process: phases other than
  :data:`SUPPORTED_PHASES`, RL algorithms other than GRPO, dynamic sampling, a task's ``prepare_rl`` hook."""
  if jax.process_count() == 1:
    return
  active = [p for p in config.phases if config[p].get("steps")]
  unsupported = [p for p in active if p not in SUPPORTED_PHASES]
  problems = [f"phase(s) {unsupported} (supported: {SUPPORTED_PHASES})"] if unsupported else []
  if "rl" in active:
    if config.rl.algorithm not in SUPPORTED_RL_ALGORITHMS:
      problems.append(f"rl.algorithm={config.rl.algorithm!r} (supported: {SUPPORTED_RL_ALGORITHMS})")
    if config.rl.get("dynamic_sampling"):
      problems.append("rl.dynamic_sampling=True (its refill decisions are per process)")
    if task is not None and getattr(task, "prepare_rl", None) is not None:
      problems.append(f"task {config.task.name!r} with a prepare_rl hook")
  if problems:
    raise ConfigError(f"not supported with {jax.process_count()} processes yet: " + "; ".join(problems))
