"""Train-state checkpoints on orbax ``CheckpointManager``: async save, keep-N, crash-safe resume.

::

  ckpt = Checkpointer(workdir + "/checkpoints", max_to_keep=3, async_save=True)
  ckpt.save(step, state, {"data": loader.get_state()})   # returns once arrays are copied to host
  ...
  if ckpt.latest_step() is not None:
    state, meta = ckpt.restore(abstract_state)           # the latest committed checkpoint
    loader.set_state(meta["data"])
  ckpt.close()

``state`` is any pytree of arrays (parameters, optax state, step counter, PRNG keys, an ``nnx.State``...).
Typed PRNG keys (``jax.random.key``) are stored as their ``jax.random.key_data`` and re-wrapped on restore with
the implementation recorded at save time. ``metadata`` is a JSON-serialisable dict (e.g. the data-iterator
position), saved in the same step directory and so committed atomically with the arrays.

Crash safety (verified in ``tests/test_checkpoint.py``): orbax writes step ``N`` into ``N.orbax-checkpoint-tmp``
and renames it to ``N`` only after every file and ``commit_success.txt`` are written, so a process killed in the
middle of a save leaves a tmp directory and the previous step stays the latest; the next :class:`Checkpointer`
on that directory deletes the tmp directory. orbax itself lists *any* integer-named directory as a step, even
one without its commit marker (e.g. a half-copied directory), and then silently refuses to save steps below it;
so :meth:`Checkpointer.latest_step` only considers committed steps, and on opening, uncommitted step directories
are moved (never deleted) to ``<directory>/_uncommitted/``.

:meth:`Checkpointer.restore` without a step falls back to the previous committed step, with a warning, if the
latest one cannot be read.

Several processes (``jax.distributed``): every process creates the :class:`Checkpointer` on the same directory
(a filesystem they all see) and calls ``save`` / ``restore`` with the same steps; orbax writes each process's
shards and process 0 commits the step. A checkpoint restores under any number of processes and any mesh: the
restore target's shardings decide what each process reads (``tests/test_multiprocess.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

_STATE = "state"
_META = "metadata"
_COMMIT_FILE = "commit_success.txt"
_UNCOMMITTED_DIR = "_uncommitted"
_FORMAT_VERSION = 1
# orbax writes step N into "N.orbax-checkpoint-tmp" (newer versions append a timestamp) and renames it when done.
_TMP_RE = re.compile(r"^\d+\.orbax-checkpoint-tmp")

logger = logging.getLogger(__name__)


class TargetMismatchError(ValueError):
  """The restore target does not match the checkpoint (a caller error, not a damaged checkpoint)."""


def _is_typed_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _key_data_sharding(sharding: Any) -> Any:
  """The sharding of ``key_data(k)`` for a typed key array ``k`` sharded by ``sharding``.

  ``key_data`` appends the key's own dimensions; a ``PartitionSpec`` leaves unnamed trailing dimensions
  replicated, so the same sharding applies.
  """
  if isinstance(sharding, (jax.sharding.SingleDeviceSharding, jax.sharding.NamedSharding)):
    return sharding
  raise TypeError(f"unsupported sharding {type(sharding).__name__} for a PRNG key leaf; use NamedSharding")


def _abstract_leaf(path: Any, x: Any) -> Any:
  """A restore target leaf: ``jax.ShapeDtypeStruct`` with a sharding (``x`` may be an array or a struct)."""
  if isinstance(x, (np.ndarray, np.generic, int, float, bool)) and not isinstance(x, jax.Array):
    return x  # NumPy arrays and Python scalars are restored as they were saved.
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"restore target leaf at {jax.tree_util.keystr(path)} is {type(x).__name__}; expected an "
                    "array or jax.ShapeDtypeStruct")
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  if _is_typed_key(x):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=_key_data_sharding(sharding))
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class Checkpointer:
  """Saves and restores ``(state pytree, JSON metadata)`` per step with orbax.

  Args:
    directory: where step directories go (created if missing).
    max_to_keep: number of most recent checkpoints kept (``None`` keeps all).
    async_save: write in a background thread; :meth:`save` returns after the device-to-host copy.
    save_interval_steps: orbax only saves steps that are multiples of this (``save`` returns False otherwise).
  """

  def __init__(self, directory: str | os.PathLike[str], max_to_keep: int | None = 3, async_save: bool = True,
               save_interval_steps: int = 1):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be None or >= 1, got {max_to_keep}")
    self._directory = os.path.abspath(os.fspath(directory))
    os.makedirs(self._directory, exist_ok=True)
    if jax.process_index() == 0:
      self._quarantine_uncommitted()
    if jax.process_count() > 1:  # Every process then sees the same committed steps.
      multihost_utils.sync_global_devices(f"checkpointer:{self._directory}")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
        save_interval_steps=save_interval_steps, create=True)
    self._manager = ocp.CheckpointManager(self._directory, item_names=(_STATE, _META), options=options)

  @property
  def directory(self) -> str:
    return self._directory

  def _step_dir(self, step: int) -> str:
    return os.path.join(self._directory, str(step))

  def _is_committed(self, step: int) -> bool:
    return os.path.isfile(os.path.join(self._step_dir(step), _COMMIT_FILE))

  def _quarantine_uncommitted(self) -> None:
    """Deletes tmp directories of interrupted saves (orbax only does so asynchronously) and moves integer-named
    directories without orbax's commit marker out of orbax's sight (to ``_uncommitted/``)."""
    for name in sorted(os.listdir(self._directory)):
      path = os.path.join(self._directory, name)
      if not os.path.isdir(path):
        continue
      if _TMP_RE.match(name):
        logger.warning("removing %s left by an interrupted checkpoint save", path)
        shutil.rmtree(path)
        continue
      if not name.isdigit() or os.path.isfile(os.path.join(path, _COMMIT_FILE)):
        continue
      target_dir = os.path.join(self._directory, _UNCOMMITTED_DIR)
      os.makedirs(target_dir, exist_ok=True)
      target = os.path.join(target_dir, f"{name}.{time.time_ns()}")
      logger.warning("checkpoint step directory %s has no %s (partial or corrupt); moving it to %s",
                     path, _COMMIT_FILE, target)
      os.rename(path, target)

  def all_steps(self) -> list[int]:
    """Committed steps, ascending (an in-flight async save is not included until it commits)."""
    return sorted(s for s in self._manager.all_steps() if self._is_committed(s))

  def latest_step(self) -> int | None:
    """The most recent committed step, or ``None``."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None, *,
           force: bool = False) -> bool:
    """Saves ``state`` and ``metadata`` as ``step`` (asynchronously if enabled).

    Returns False when skipped by ``save_interval_steps`` (unless ``force``). Raises ``ValueError`` if
    ``metadata`` is not JSON-serialisable or ``step`` is not after the latest saved step.
    """
    step = int(step)
    user_meta = dict(metadata or {})
    try:
      json.dumps(user_meta, allow_nan=True)
    except (TypeError, ValueError) as e:
      raise ValueError(f"checkpoint metadata must be JSON-serialisable: {e}") from e
    last = self._manager.latest_step()
    if last is not None and step <= last:
      raise ValueError(f"cannot save step {step}: a checkpoint for step {last} already exists in {self._directory}")
    key_impls: dict[str, str] = {}

    def to_data(path, x):
      if _is_typed_key(x):
        key_impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
        return jax.random.key_data(x)
      return x

    data_state = jax.tree_util.tree_map_with_path(to_data, state)
    meta = {"format_version": _FORMAT_VERSION, "metadata": user_meta, "prng_key_impls": key_impls}
    return bool(self._manager.save(
        step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardSave(data_state), _META: ocp.args.JsonSave(meta)}),
        force=force))

  def _read_meta(self, step: int) -> dict[str, Any]:
    restored = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
    meta = restored[_META]
    if not isinstance(meta, dict) or meta.get("format_version") != _FORMAT_VERSION:
      raise ValueError(f"checkpoint step {step} in {self._directory} was not written by this Checkpointer")
    return meta

  def read_metadata(self, step: int | None = None) -> dict[str, Any]:
    """Only the JSON metadata of ``step`` (default: the latest committed step)."""
    step = self._resolve_step(step)
    return self._read_meta(step)["metadata"]

  def _resolve_step(self, step: int | None) -> int:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no committed checkpoint in {self._directory}")
    elif int(step) not in self.all_steps():
      raise FileNotFoundError(f"no committed checkpoint for step {step} in {self._directory} "
                              f"(committed: {self.all_steps()})")
    return int(step)

  def _restore_step(self, abstract_state: Any, step: int) -> tuple[Any, dict[str, Any]]:
    meta = self._read_meta(step)
    key_impls = meta["prng_key_impls"]
    target_keys = {}

    def to_target(path, x):
      if _is_typed_key(x):
        target_keys[jax.tree_util.keystr(path)] = x
      return _abstract_leaf(path, x)

    target = jax.tree_util.tree_map_with_path(to_target, abstract_state)
    if set(target_keys) != set(key_impls):
      raise TargetMismatchError(f"PRNG key leaves differ between the restore target {sorted(target_keys)} and "
                                f"checkpoint step {step} {sorted(key_impls)}")
    for name, wanted in target_keys.items():
      saved_dtype = jax.eval_shape(lambda impl=key_impls[name]: jax.random.key(0, impl=impl)).dtype
      if saved_dtype != wanted.dtype:
        raise TargetMismatchError(f"PRNG key at {name} was saved with impl {key_impls[name]!r} ({saved_dtype}); "
                                  f"the restore target wants {wanted.dtype}")
    restored = self._manager.restore(
        step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)}))[_STATE]

    def to_key(path, x):
      name = jax.tree_util.keystr(path)
      if name not in key_impls:
        return x
      key = jax.random.wrap_key_data(x, impl=key_impls[name])
      sharding = getattr(target_keys[name], "sharding", None)
      return jax.device_put(key, sharding) if sharding is not None else key

    return jax.tree_util.tree_map_with_path(to_key, restored), meta["metadata"]

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Restores ``(state, metadata)`` from ``step`` (default: the latest committed one).

    Args:
      abstract_state: the target pytree: ``jax.ShapeDtypeStruct`` leaves (with ``sharding``, e.g. from
        ``jax.eval_shape`` plus shardings) or concrete arrays (their shape, dtype and sharding are used). Leaves
        are restored with exactly these shardings, so a checkpoint can be loaded onto a different mesh.
      step: a committed step, or ``None`` for the latest; if the latest cannot be read, earlier committed steps
        are tried (each failure is logged as a warning); if none can, the latest step's error is raised.
    """
    if step is not None:
      return self._restore_step(abstract_state, self._resolve_step(step))
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no committed checkpoint in {self._directory}")
    errors = []
    for candidate in reversed(steps):
      try:
        state, metadata = self._restore_step(abstract_state, candidate)
      except TargetMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
        logger.warning("could not restore checkpoint step %d from %s (%s: %s); trying an earlier step",
                       candidate, self._directory, type(e).__name__, e)
        continue
      return state, metadata
    # Every step failed: most likely the target does not match (e.g. a shape); report the latest step's error.
    raise errors[0]

  def wait_until_finished(self) -> None:
    """Blocks until a pending async save has committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
