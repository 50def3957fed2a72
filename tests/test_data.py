"""Tests for the arithmetic tfds builder (array_record, lemon_rl.envs) and the grain pipeline (lemon_rl.data)."""

import ast
import collections
import json
import os
import pathlib

import numpy as np
import pytest

import lemon_rl
from lemon_rl.data import BatchIterator
from lemon_rl.data import splits as content_splits
from lemon_rl.envs import arithmetic
from lemon_rl.envs import arithmetic_builder
from lemon_rl.envs.arithmetic_builder import build_arithmetic
from lemon_rl.envs.arithmetic_builder import make_config

_PARAMS = {"seed": 5, "num_train": 300, "num_sft": 400, "num_test": 60, "num_validation": 50}
_SPLITS = ("train", "sft", "validation", "test")
_FIELDS = ("prompt", "answer", "completion", "sloppy")


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
  return build_arithmetic(tmp_path_factory.mktemp("tfds"), **_PARAMS)


@pytest.fixture(scope="module")
def sources(builder):
  return builder.as_data_source()


def _plain(value):
  if isinstance(value, bytes):
    return value.decode()
  return value.item() if isinstance(value, np.generic) else value


def _records(source):
  return [{k: _plain(v) for k, v in source[i].items()} for i in range(len(source))]


class TestBuilder:

  def test_layout_and_sizes(self, builder, sources):
    assert builder.builder_config.name == "seed5_train300_sft400_test60_val50"
    files = os.listdir(builder.data_dir)
    for split in _SPLITS:
      assert any(f.startswith(f"lemon_arithmetic-{split}.array_record") for f in files), files
    assert {k: len(v) for k, v in sources.items()} == {"train": 300, "sft": 400, "test": 60, "validation": 50}
    assert builder.info.splits["sft"].num_examples == 400

  @pytest.mark.parametrize("split", _SPLITS)
  def test_record_round_trip(self, sources, split):
    """What is read back is exactly what the generator produced (as a multiset; tfds permutes records)."""
    stored = collections.Counter(tuple(r[k] for k in _FIELDS) for r in _records(sources[split]))
    generated = collections.Counter(
        tuple(e[k] for k in _FIELDS)
        for e in arithmetic.generate_examples(5, _PARAMS[f"num_{split}"], split))
    assert stored == generated

  def test_splits_disjoint(self, sources):
    """No canonical problem (a+b = b+a) is stored in two splits; test and validation hold distinct ones."""
    keys = {split: {arithmetic.canonical_key(arithmetic.parse_prompt(r["prompt"])) for r in _records(sources[split])}
            for split in _SPLITS}
    assert len(keys["test"]) == 60 and len(keys["validation"]) == 50
    assert not any(content_splits.key_overlaps(keys).values()), content_splits.key_overlaps(keys)

  def test_rebuild_reuses_files(self, builder, tmp_path_factory):
    path = os.path.join(builder.data_dir, "dataset_info.json")
    mtime = os.stat(path).st_mtime_ns
    again = build_arithmetic(os.path.dirname(os.path.dirname(os.path.dirname(builder.data_dir))), **_PARAMS)
    assert again.data_dir == builder.data_dir
    assert os.stat(path).st_mtime_ns == mtime

  def test_config_names_and_validation(self):
    assert arithmetic_builder.config_name() == "default"
    assert arithmetic_builder.config_name(seed=0, p_sloppy=0.25) == "psloppy0.25"
    assert make_config(seed=2).name == "seed2"
    with pytest.raises(ValueError, match="unknown arithmetic dataset parameter"):
      make_config(p_slopy=0.5)
    with pytest.raises(ValueError, match="num_test"):
      make_config(num_test=0)
    with pytest.raises(ValueError, match="p_sloppy"):
      make_config(p_sloppy=2.0)
    with pytest.raises(ValueError, match="bucket fraction"):
      make_config(validation_fraction=0.5, train_fraction=0.5)
    with pytest.raises(ValueError, match="either config or"):
      build_arithmetic("/nonexistent", config="default", seed=1)


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]))


class TestBatchIterator:

  def test_batch_format(self, sources):
    batch = next(BatchIterator(sources["train"], batch_size=8, seed=0))
    assert set(batch) == set(_FIELDS)
    assert isinstance(batch["prompt"], list) and all(isinstance(p, str) for p in batch["prompt"])
    assert len(batch["prompt"]) == 8
    assert batch["sloppy"].shape == (8,) and batch["sloppy"].dtype == np.bool_
    for prompt, answer in zip(batch["prompt"], batch["answer"]):
      assert arithmetic.parse_prompt(prompt).answer == answer

  def test_deterministic(self, sources):
    a = _take(BatchIterator(sources["sft"], batch_size=32, seed=1), 30)  # > 2 epochs of 400 records.
    b = _take(BatchIterator(sources["sft"], batch_size=32, seed=1, num_threads=0), 30)
    _assert_batches_equal(a, b)
    c = _take(BatchIterator(sources["sft"], batch_size=32, seed=2), 30)
    assert [x["prompt"] for x in a] != [x["prompt"] for x in c]

  def test_epochs_are_permutations_reshuffled(self, sources):
    batches = _take(BatchIterator(sources["train"], batch_size=25, seed=3), 36)  # 900 records = 3 epochs.
    indices = {tuple(r[k] for k in _FIELDS): i for i, r in enumerate(_records(sources["train"]))}
    order = [indices[tuple(b[k][j] if k != "sloppy" else bool(b[k][j]) for k in _FIELDS)]
             for b in batches for j in range(25)]
    # Records may repeat in the train split (i.i.d. draws), so compare multisets of records per epoch.
    full = collections.Counter(indices[tuple(r[k] for k in _FIELDS)] for r in _records(sources["train"]))
    epochs = [order[i * 300:(i + 1) * 300] for i in range(3)]
    for epoch in epochs:
      assert collections.Counter(epoch) == full
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]

  def test_resume_from_json_state(self, sources):
    reference = BatchIterator(sources["sft"], batch_size=16, seed=4)
    uninterrupted = _take(reference, 40)
    first = BatchIterator(sources["sft"], batch_size=16, seed=4)
    _take(first, 27)
    state = json.loads(json.dumps(first.get_state()))
    assert state["next_index"] == 27
    resumed = BatchIterator(sources["sft"], batch_size=16, seed=4)
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 13), uninterrupted[27:])
    # Rewinding an iterator that has already run (and whose read-ahead threads are live).
    first.set_state({**state, "next_index": 3})
    _assert_batches_equal(_take(first, 4), uninterrupted[3:7])
    first.close()
    _assert_batches_equal(_take(first, 2), uninterrupted[7:9])

  def test_state_from_other_settings_is_rejected(self, sources):
    state = BatchIterator(sources["sft"], batch_size=16, seed=4).get_state()
    with pytest.raises(ValueError, match="seed=4 vs 5"):
      BatchIterator(sources["sft"], batch_size=16, seed=5).set_state(state)
    with pytest.raises(ValueError, match="num_records=400 vs 300"):
      BatchIterator(sources["train"], batch_size=16, seed=4).set_state(state)
    with pytest.raises(ValueError, match="next_index"):
      BatchIterator(sources["sft"], batch_size=16, seed=4).set_state({"seed": 4})

  def test_single_ordered_epoch_for_evaluation(self, sources):
    it = BatchIterator(sources["test"], batch_size=25, shuffle=False, num_epochs=1, drop_remainder=False)
    batches = list(it)
    assert [len(b["prompt"]) for b in batches] == [25, 25, 10]
    assert sum((b["prompt"] for b in batches), []) == [r["prompt"] for r in _records(sources["test"])]

  def test_shards_partition_the_data(self, sources):
    prompts = []
    for shard in range(2):
      it = BatchIterator(sources["test"], batch_size=10, seed=0, num_epochs=1, shard_index=shard, num_shards=2)
      shard_prompts = sum((b["prompt"] for b in it), [])
      assert len(shard_prompts) == 30
      prompts.append(set(shard_prompts))
    assert not prompts[0] & prompts[1]
    assert prompts[0] | prompts[1] == {r["prompt"] for r in _records(sources["test"])}

  def test_bad_arguments(self, sources):
    with pytest.raises(ValueError, match="batch_size"):
      BatchIterator(sources["test"], batch_size=0)
    with pytest.raises(ValueError, match="shard_index"):
      BatchIterator(sources["test"], batch_size=4, shard_index=2, num_shards=2)
    with pytest.raises(ValueError, match="num_epochs"):
      BatchIterator(sources["test"], batch_size=4, num_epochs=0)

  def test_batched_and_single_reads_agree(self, sources):
    """A tfds source is read with one `__getitems__` per batch; a list one record at a time: same batches."""
    as_list = [sources["sft"][i] for i in range(len(sources["sft"]))]
    a = _take(BatchIterator(sources["sft"], batch_size=48, seed=9), 12)
    b = _take(BatchIterator(as_list, batch_size=48, seed=9), 12)
    _assert_batches_equal(a, b)

  def test_works_on_plain_lists(self):
    data = [{"x": np.int32(i), "name": f"r{i}".encode()} for i in range(10)]
    batch = next(BatchIterator(data, batch_size=10, shuffle=False))
    np.testing.assert_array_equal(batch["x"], np.arange(10))
    assert batch["name"] == [f"r{i}" for i in range(10)]


  def test_transform_applies_to_each_record(self, sources):
    it = BatchIterator(sources["sft"], batch_size=8, seed=0,
                       transform=lambda r: {"prompt": r["prompt"], "length": len(r["prompt"])})
    batch = next(it)
    assert sorted(batch) == ["length", "prompt"]
    np.testing.assert_array_equal(batch["length"], [len(p) for p in batch["prompt"]])


def _imported_modules(path: pathlib.Path) -> set[str]:
  """Every module an ``import`` / ``from ... import`` in ``path`` names, lazy (in-function) ones included."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_data_does_not_import_the_tasks():
  """lemon_rl.envs (the tasks) uses lemon_rl.data; the reverse would make an import cycle."""
  data_dir = pathlib.Path(lemon_rl.__file__).parent / "data"
  offending = {p.name: sorted(m for m in _imported_modules(p) if m == "lemon_rl.envs" or m.startswith("lemon_rl.envs."))
               for p in sorted(data_dir.glob("*.py"))}
  offending = {k: v for k, v in offending.items() if v}
  assert not offending, offending


def test_lazy_source_builds_on_first_read_only():
  from lemon_rl.data.pipeline import LazySource  # pylint: disable=g-import-not-at-top
  calls = []

  def build():
    calls.append(1)
    return [{"x": i} for i in range(10)]

  source = LazySource(10, build)
  it = BatchIterator(source, batch_size=4, seed=0)
  assert len(source) == 10 and calls == []  # An iterator that yields nothing reads nothing.
  batch = next(iter(it))
  assert calls == [1] and sorted(batch["x"].tolist()) == sorted(set(batch["x"].tolist()))
  assert source[3] == {"x": 3} and calls == [1]  # Built once.
  with pytest.raises(ValueError, match="built 10 records, expected 11"):
    LazySource(11, build)[0]
