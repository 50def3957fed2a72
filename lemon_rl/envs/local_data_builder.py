"""Local public-format data (GSM8K, MATH, GSM-Symbolic, BFCL) as a ``tensorflow_datasets`` builder (array_record).

Like :mod:`lemon_rl.envs.arithmetic_builder`, the data is written once to ``array_record`` files (no TensorFlow)
and read back as random-access data sources. What is read:

- ``fmt="gsm8k"`` / ``"math"``: the ``files`` (and ``test_files``), parsed and split by
  :mod:`lemon_rl.envs.math_data` (splits ``sft``, ``train``, ``validation``, ``test``, disjoint by content key);
- ``fmt="gsm_symbolic"``: reasoning-gym's offline generator (``seed`` and the ``num_*`` sizes; no files);
- ``fmt="bfcl"``: ``files[0]`` is a folder laid out like bfcl-eval's ``data/`` (question files
  ``BFCL_v4_<category>.json`` with ``{"id", "question", "function"}`` per line, ground truths in
  ``possible_answer/`` with ``{"id", "ground_truth"}``; irrelevance categories have none), read by
  :func:`lemon_rl.envs.bfcl_data.load_bfcl` for each of ``categories``; BFCL is an evaluation set, so there is
  one split, ``test``. ``functions`` and ``gold`` are stored as JSON text and decoded by :func:`load_split`.

A config's name is the format plus a hash of its parameters and of the bytes of its files, so editing a file
gives a new directory (``data_dir/lemon_local_data/<name>/<version>/``) instead of stale records.

Usage::

  builder = build_local_data(data_dir, "gsm8k", files=["train.jsonl"], test_files=["test.jsonl"])
  test = load_split(builder, "test")               # list of dicts with str fields
  source = builder.as_data_source("train")         # random access, bytes fields
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
from typing import Any, Sequence

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

from lemon_rl.envs import bfcl_data
from lemon_rl.envs import math_data

DATASET_NAME = "lemon_local_data"
FORMATS: tuple[str, ...] = math_data.FORMATS + ("bfcl",)
BFCL_FIELDS: dict[str, str] = {"id": "text", "category": "text", "query": "text", "system": "text",
                               "functions": "json", "gold": "json", "prompt": "text", "demonstration": "text",
                               "num_conversions": "int", "source": "text"}
MATH_FIELDS: dict[str, str] = {name: "text" for name in math_data.FIELDS}


def field_types(fmt: str) -> dict[str, str]:
  """``{field: "text" | "json" | "int"}`` of the records of ``fmt``."""
  return BFCL_FIELDS if fmt == "bfcl" else MATH_FIELDS


def split_names(fmt: str) -> tuple[str, ...]:
  return ("test",) if fmt == "bfcl" else math_data.SPLITS


@dataclasses.dataclass(eq=False)
class LocalDataConfig(tfds.core.BuilderConfig):
  """Parameters of one local dataset (module docstring); ``num_*`` < 0 keeps every record of the split."""

  fmt: str = "gsm8k"
  files: tuple[str, ...] = ()
  test_files: tuple[str, ...] = ()
  categories: tuple[str, ...] = ()  # BFCL categories (bfcl_data.CATEGORY_FILES names).
  seed: int = 0  # gsm_symbolic generation seed.
  num_train: int = -1
  num_sft: int = -1
  num_validation: int = -1
  num_test: int = -1
  test_fraction: float = math_data.DEFAULT_TEST_FRACTION
  validation_fraction: float = math_data.DEFAULT_VALIDATION_FRACTION
  train_fraction: float = math_data.DEFAULT_TRAIN_FRACTION

  def limit(self, split: str) -> int:
    return {"train": self.num_train, "sft": self.num_sft, "validation": self.num_validation,
            "test": self.num_test}[split]


_PARAMS = tuple(f.name for f in dataclasses.fields(LocalDataConfig) if f.name not in
                {f2.name for f2 in dataclasses.fields(tfds.core.BuilderConfig)})


def _files_digest(paths: Sequence[str], hasher: Any) -> None:
  for path in paths:
    hasher.update(os.path.abspath(path).encode())
    if os.path.isdir(path):
      for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
          _files_digest([os.path.join(root, name)], hasher)
    else:
      with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
          hasher.update(chunk)


def make_config(fmt: str, **params: Any) -> LocalDataConfig:
  """A validated :class:`LocalDataConfig` named ``<fmt>_<hash of params and file bytes>``."""
  unknown = set(params) - set(_PARAMS)
  if unknown:
    raise ValueError(f"unknown local-data parameter(s) {sorted(unknown)}; valid: {sorted(_PARAMS)}")
  if fmt not in FORMATS:
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
  for name in ("files", "test_files", "categories"):
    value = params.get(name, ())
    params[name] = (value,) if isinstance(value, str) else tuple(str(v) for v in value)
  for path in params["files"] + params["test_files"]:
    if not os.path.exists(path):
      raise FileNotFoundError(f"{fmt} data file {path} not found")
  if fmt in ("gsm8k", "math") and not params["files"] and not params["test_files"]:
    raise ValueError(f"format {fmt!r} needs files (and/or test_files)")
  if fmt == "bfcl":
    if len(params["files"]) != 1 or not os.path.isdir(params["files"][0]):
      raise ValueError("format 'bfcl' needs files=[a folder laid out like bfcl-eval's data/]")
    if not params["categories"]:
      raise ValueError("format 'bfcl' needs categories")
    for category in params["categories"]:
      if category not in bfcl_data.CATEGORY_FILES:
        raise ValueError(f"unknown BFCL category {category!r}; expected one of {sorted(bfcl_data.CATEGORY_FILES)}")
  if fmt == "gsm_symbolic":
    for split in math_data.SPLITS:
      if int(params.get(f"num_{split}", -1)) < 1:
        raise ValueError(f"gsm_symbolic needs num_{split} >= 1 (generated sizes), got {params.get(f'num_{split}')}")
  hasher = hashlib.sha256(json.dumps({"fmt": fmt, **params}, sort_keys=True).encode())
  _files_digest(params["files"] + params["test_files"], hasher)
  config = LocalDataConfig(name=f"{fmt}_{hasher.hexdigest()[:16]}", description=f"lemon_rl local {fmt} data",
                           fmt=fmt, **params)
  if fmt != "bfcl":
    math_data.fractions(None if config.test_files else config.test_fraction, config.validation_fraction,
                        config.train_fraction)  # Raises ValueError naming the fractions.
  return config


def records_by_split(config: LocalDataConfig) -> dict[str, list[dict[str, Any]]]:
  """The records of every split of ``config`` (sizes capped by ``num_*``)."""
  fractions = {"test_fraction": config.test_fraction, "validation_fraction": config.validation_fraction,
               "train_fraction": config.train_fraction}
  if config.fmt == "bfcl":
    records = [ex for c in config.categories for ex in bfcl_data.load_bfcl(c, data_dir=config.files[0])]
    out = {"test": records}
  elif config.fmt == "gsm_symbolic":
    out = math_data.symbolic_splits(config.seed, {s: config.limit(s) for s in math_data.SPLITS}, **fractions)
  else:
    pool = math_data.read_records(config.fmt, config.files)
    test = math_data.read_records(config.fmt, config.test_files) if config.test_files else None
    out = math_data.assign_splits(pool, test, **fractions)
  return {s: recs[:config.limit(s)] if config.limit(s) >= 0 else recs for s, recs in out.items()}


class LemonLocalData(tfds.core.GeneratorBasedBuilder):
  """Local GSM8K / MATH / GSM-Symbolic / BFCL records (module docstring)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:  # See arithmetic_builder: tfds 4.9.10's default needs importlib_resources.
    return epath.Path(inspect.getfile(cls))

  def _info(self) -> tfds.core.DatasetInfo:
    types = {"text": tfds.features.Text(), "json": tfds.features.Text(), "int": np.int64}
    return tfds.core.DatasetInfo(
        builder=self, description=__doc__,
        features=tfds.features.FeaturesDict({k: types[t] for k, t in field_types(self.builder_config.fmt).items()}),
        supervised_keys=None,
        disable_shuffling=True)  # Records keep their file order (e.g. a benchmark's test order).

  def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
    del dl_manager  # Local files only.
    records = records_by_split(self.builder_config)
    empty = [s for s in split_names(self.builder_config.fmt) if not records[s]]
    if empty:  # tfds cannot write an empty split.
      raise ValueError(f"{self.builder_config.fmt} data gives no records for split(s) {empty} (sizes "
                       f"{ {s: len(r) for s, r in records.items()} }); add data or change the fractions")
    return {s: self._generate_examples(records[s]) for s in split_names(self.builder_config.fmt)}

  def _generate_examples(self, records: list[dict[str, Any]]):
    types = field_types(self.builder_config.fmt)
    for index, record in enumerate(records):
      yield index, {k: json.dumps(record[k]) if t == "json" else record[k] for k, t in types.items()}


def build_local_data(data_dir: str | os.PathLike[str], fmt: str, **params: Any) -> LemonLocalData:
  """Prepares (once per config; later calls reuse the files) and returns the builder (module docstring)."""
  builder = LemonLocalData(data_dir=os.fspath(data_dir), config=make_config(fmt, **params),
                           file_format="array_record")
  builder.download_and_prepare()
  return builder


def decode(record: dict[str, Any], fmt: str) -> dict[str, Any]:
  """A stored record as plain Python: text as ``str``, JSON fields parsed, ints as ``int``."""
  from lemon_rl.data.pipeline import decode_record  # pylint: disable=g-import-not-at-top
  out = decode_record(record)
  for k, t in field_types(fmt).items():
    if t == "json":
      out[k] = json.loads(out[k])
  return out


def load_split(builder: LemonLocalData, split: str, limit: int | None = None) -> list[dict[str, Any]]:
  """Up to ``limit`` records of ``split`` as plain dicts (:func:`decode`), in their files' order."""
  source = builder.as_data_source(split)
  n = len(source) if limit is None else min(limit, len(source))
  return [decode(source[i], builder.builder_config.fmt) for i in range(n)]
