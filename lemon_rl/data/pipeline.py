"""Grain pipelines over random-access sources (``tfds`` array_record data sources, lists, ...).

:class:`BatchIterator` is a ``grain.MapDataset`` over the source's record indices: shuffle with a seed (a new
permutation every epoch) -> repeat -> batch -> (optional) this process's slice of the batch -> read the
batch's records (one ``__getitems__`` call) -> decode -> optional per-record transform -> collate. It is
deterministic in ``(source, seed, batch_size * num_shards)``, and its position is a small JSON-serialisable
dict::

  it = BatchIterator(builder.as_data_source("train"), batch_size=64, seed=0)
  batch = next(it)          # {"prompt": ["57+68=", ...], "answer": ["0125", ...], "sloppy": array([...])}
  state = it.get_state()    # {"next_index": 1, "seed": 0, ...}: put it into the checkpoint metadata
  it.set_state(state)       # resumes at exactly the same next batch

Sharding by process (multi-host; ``lemon_rl.training.distributed.iterator_shard``): with ``num_shards = S``
every shard walks the same shuffled stream of *global* batches of ``S * batch_size`` records and reads only
its slice ``[shard_index * batch_size, (shard_index + 1) * batch_size)`` of each. So the shards of a step are
disjoint and together are exactly the global batch a single iterator with ``batch_size * S`` would yield
(the run does not depend on the number of processes, and a checkpointed position resumes under another
process count), every shard gets equal batches, and one epoch's worth of steps covers the epoch. Remainder:
with ``num_epochs`` set, the records that do not fill a last global batch are dropped
(``drop_remainder=False`` is refused with ``S > 1``: shards would get unequal batches); repeating forever
drops nothing (batches run across epoch boundaries).

Text fields (bytes in tfds records) come out as ``list[str]``; numeric fields as numpy arrays ``[B, ...]``.
Tokenisation happens in the trainers (``lemon_rl.training.sft.sft_batch``, the rollouts), on one
``[prompt | completion]`` layout shared by SFT and RL.
"""

from __future__ import annotations

import collections.abc
import functools
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np

Batch = dict[str, Any]


def decode_record(record: Mapping[str, Any]) -> dict[str, Any]:
  """``bytes`` -> ``str`` (UTF-8), numpy scalars -> Python scalars; arrays are left as they are."""
  out = {}
  for key, value in record.items():
    if isinstance(value, (bytes, np.bytes_)):
      value = bytes(value).decode("utf-8")
    elif isinstance(value, np.generic):
      value = value.item()
    out[key] = value
  return out


def collate(records: Sequence[Mapping[str, Any]]) -> Batch:
  """A list of records -> one batch: ``str`` fields as ``list[str]``, everything else stacked ``[B, ...]``."""
  if not records:
    raise ValueError("cannot collate an empty batch")
  keys = records[0].keys()
  batch: Batch = {}
  for key in keys:
    values = [r[key] for r in records]
    batch[key] = values if isinstance(values[0], str) else np.stack([np.asarray(v) for v in values])
  return batch


class LazySource(collections.abc.Sequence):
  """Records built on first access, their number known up front.

  A :class:`BatchIterator` over it reads nothing until it yields a batch, so a run that restores a finished
  phase never builds that phase's data (the CAST task's 112,000 generated SFT demonstrations cost about 40 s
  of CPU in every RL run otherwise).

  Args:
    length: how many records ``build()`` returns (checked when it runs).
    build: a function returning the records.
  """

  def __init__(self, length: int, build: Callable[[], Sequence[Any]]):
    self._length, self._build, self._records = int(length), build, None

  def _all(self) -> Sequence[Any]:
    if self._records is None:
      records = list(self._build())
      if len(records) != self._length:
        raise ValueError(f"LazySource built {len(records)} records, expected {self._length}")
      self._records = records
    return self._records

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    return self._all()[index]


def _read_batch(source: Any, transform: Callable[[dict[str, Any]], Mapping[str, Any]] | None,
                indices: list[int]) -> Batch:
  """Reads records ``indices`` from ``source`` (batched when it has ``__getitems__``), decodes and collates."""
  getitems = getattr(source, "__getitems__", None)
  records = getitems(indices) if getitems is not None else [source[i] for i in indices]
  records = [decode_record(r) for r in records]
  if transform is not None:
    records = [transform(r) for r in records]
  return collate(records)


def _slice(start: int, stop: int, indices: list[int]) -> list[int]:
  return indices[start:stop]


# Settings that may differ between a saved position and the iterator resuming it (another process count):
# the global batch ``batch_size * num_shards`` must match instead.
_SHARD_KEYS = ("batch_size", "shard_index", "num_shards")


class BatchIterator:
  """Deterministic, resumable batches from a random-access source.

  Args:
    source: anything with ``__len__`` and ``__getitem__`` (a tfds ``ArrayRecordDataSource``, a list, ...).
    batch_size: records per batch (per process when sharded).
    seed: shuffle seed; epoch ``e`` uses the permutation of seed ``seed + e``.
    shuffle: if False, records come in source order (e.g. for evaluation).
    num_epochs: ``None`` repeats forever; an int stops after that many passes (``StopIteration``).
    drop_remainder: drop a last incomplete batch (only matters with ``num_epochs``).
    transform: optional function applied to each decoded record before batching.
    shard_index, num_shards: this process reads slice ``shard_index`` of ``num_shards`` equal slices of each
      global batch of ``batch_size * num_shards`` records (module docstring; multi-host data loading).
    num_threads, prefetch_batches: grain read options (threads reading ahead; 0 threads reads in the caller).
  """

  def __init__(self, source: Any, *, batch_size: int, seed: int = 0, shuffle: bool = True,
               num_epochs: int | None = None, drop_remainder: bool = True,
               transform: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
               shard_index: int = 0, num_shards: int = 1, num_threads: int = 1, prefetch_batches: int = 4):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < num_shards:
      raise ValueError(f"shard_index must be in [0, num_shards={num_shards}), got {shard_index}")
    if num_epochs is not None and num_epochs < 1:
      raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}")
    num_records = len(source)
    if num_records < num_shards:
      raise ValueError(f"source has {num_records} records, fewer than num_shards={num_shards}")
    if num_epochs is None and drop_remainder is False:
      drop_remainder = True  # Irrelevant for an infinite stream; keep the state description canonical.
    if num_shards > 1 and not drop_remainder:
      raise ValueError(f"drop_remainder=False with num_shards={num_shards}: the shards of a last partial batch "
                       "would be unequal; use drop_remainder=True")
    # Shuffle, repeat and batch record *indices*, then read each batch with one `__getitems__` call: a tfds
    # array_record source reads a batch in one parallel call, ~10x faster per record than `source[i]` one by one.
    dataset = grain.MapDataset.range(num_records)
    if shuffle:
      dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat(num_epochs)
    dataset = dataset.batch(batch_size * num_shards, drop_remainder=drop_remainder, batch_fn=list)
    if num_shards > 1:  # This shard's slice of the global batch.
      dataset = dataset.map(functools.partial(_slice, shard_index * batch_size, (shard_index + 1) * batch_size))
    dataset = dataset.map(functools.partial(_read_batch, source, transform))
    self._dataset = dataset
    self._read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_batches)
    self._config = {"seed": int(seed), "shuffle": bool(shuffle), "batch_size": int(batch_size),
                    "num_epochs": num_epochs, "drop_remainder": bool(drop_remainder),
                    "shard_index": int(shard_index), "num_shards": int(num_shards), "num_records": num_records}
    self._iterator = None
    self._next_index = 0

  def __len__(self) -> int:
    """Number of batches (``sys.maxsize``-ish when repeating forever)."""
    return len(self._dataset)

  def __iter__(self) -> "BatchIterator":
    return self

  def _ensure_iterator(self):
    if self._iterator is None:
      self._iterator = iter(self._dataset.to_iter_dataset(self._read_options))
      if self._next_index:
        self._iterator.set_state({"next_index": self._next_index})
    return self._iterator

  def __next__(self) -> Batch:
    batch = next(self._ensure_iterator())
    self._next_index += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    """The position as a JSON-serialisable dict (also records the settings it is valid for)."""
    return {"next_index": self._next_index, **self._config}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Moves to the position ``state`` (from :meth:`get_state` of an iterator with the same settings; the
    split into shards may differ if the global batch ``batch_size * num_shards`` is the same)."""
    if "next_index" not in state:
      raise ValueError(f"iterator state has no 'next_index': {dict(state)}")
    mismatched = {k: (state[k], v) for k, v in self._config.items()
                  if k in state and k not in _SHARD_KEYS and state[k] != v}
    if "batch_size" in state:  # The global batch: the position is valid for any split of it into shards.
      saved, current = (int(state["batch_size"]) * int(state.get("num_shards", 1)),
                        self._config["batch_size"] * self._config["num_shards"])
      if saved != current:
        mismatched["batch_size * num_shards"] = (saved, current)
    if mismatched:
      raise ValueError("iterator state was saved with different settings (saved, current): " +
                       ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in mismatched.items()))
    next_index = int(state["next_index"])
    if next_index < 0:
      raise ValueError(f"next_index must be >= 0, got {next_index}")
    self._next_index = next_index
    if self._iterator is not None:
      self._iterator.set_state({"next_index": next_index})

  def close(self) -> None:
    """Stops the read-ahead threads (a new iteration restarts them at the current position)."""
    if self._iterator is not None and hasattr(self._iterator, "close"):
      self._iterator.close()
    self._iterator = None
