"""Local GSM8K / MATH / BFCL data, GSM-Symbolic, the gsm8k / math tasks and ``experiments.evaluate``.

The fixtures in ``tests/fixtures/math`` are hand-written files in the public formats: GSM8K's
``{"question", "answer": "... #### n"}`` JSON lines (with calculator annotations), MATH's
``{"problem", "solution", "level", "type"}`` JSON lines and a MATH-500-style JSON array, and a folder laid out
like bfcl-eval's ``data/`` (questions, ``possible_answer/``, an irrelevance category without answers).
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest
from ml_collections import config_dict

from lemon_rl.data import splits as content_splits
from lemon_rl.envs import local_data_builder as ldb
from lemon_rl.envs import math_data as md
from lemon_rl.envs import math_task
from lemon_rl.envs.tasks import TASK_CONFIG_CHECKS, TASKS
from lemon_rl.rewards.math_verify_reward import math_answer_reward
from lemon_rl.text import ByteTokenizer
from lemon_rl.utils.config_checks import ConfigError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "math")
GSM_TRAIN = os.path.join(FIXTURES, "gsm8k_train.jsonl")
GSM_TEST = os.path.join(FIXTURES, "gsm8k_test.jsonl")
MATH = os.path.join(FIXTURES, "math.jsonl")
MATH500 = os.path.join(FIXTURES, "math500.json")
BFCL = os.path.join(FIXTURES, "bfcl")
FIXTURE_FRACTIONS = {"validation_fraction": 0.2, "train_fraction": 0.4}  # 19 pool records: no empty split.


def reward(records, golds=None):
  golds = [r["answer"] for r in records] if golds is None else golds
  return math_answer_reward([r["prompt"] for r in records], [r["completion"] for r in records],
                            [[]] * len(records), answer=golds).rewards


def test_gsm8k_rows_become_records():
  records = md.read_records("gsm8k", [GSM_TRAIN])
  assert len(records) == 20 and all(set(r) == set(md.FIELDS) for r in records)
  by_question = {r["question"]: r for r in records}
  cookies = by_question["A bakery sells 1,200 cookies a day. How many cookies does it sell in 3 days?"]
  assert cookies["answer"] == "3600"  # The fixture's "#### 3,600", separators dropped.
  assert cookies["completion"] == "It sells 1200*3=3600 cookies.\n#### 3,600"  # Calculator annotation removed.
  assert by_question["The temperature was 5 degrees and dropped by 12 degrees. What is the temperature now?"][
      "answer"] == "-7"
  assert cookies["prompt"].startswith(cookies["question"] + "\n") and "####" in cookies["prompt"]
  assert cookies["id"] == "gsm8k_train.jsonl:8" and cookies["source"] == "gsm8k"
  # Every demonstration earns the reward for its own gold, and none for another problem's gold.
  np.testing.assert_array_equal(reward(records), 1.0)
  shifted = [r["answer"] for r in records[1:] + records[:1]]
  assert reward(records, shifted).sum() <= 2  # Only problems that happen to share a numeric answer.


def test_math_rows_become_records():
  records = md.read_records("math", [MATH])
  assert [r["answer"] for r in records] == [
      r"\frac{5}{6}", r"\{2, 3\}", "(0, 1]", r"5\sqrt{2}", "-10", "6", r"\frac{1}{4}", "3", "720", "6", "x+1",
      "12"]  # The solution's LAST box (the log row boxes a wrong guess first).
  assert records[0]["level"] == "Level 1" and records[0]["type"] == "Prealgebra"
  assert "\\boxed{}" in records[0]["prompt"]
  np.testing.assert_array_equal(reward(records), 1.0)
  math500 = md.read_records("math", [MATH500])  # A JSON array, `answer` and `subject` columns.
  assert [(r["answer"], r["type"], r["level"]) for r in math500] == [("1024", "Algebra", "1"),
                                                                       (r"\frac{3}{4}", "Prealgebra", "1")]


def test_bad_rows_name_the_file(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl: row 0 is not a gsm8k record"):
    md.read_records("gsm8k", [bad])
  bad.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n{oops\n")
  with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
    md.read_records("math", [bad])


def test_parquet_without_datasets_says_how_to_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError.
  assert not md.datasets_available()
  path = tmp_path / "train.parquet"
  path.write_bytes(b"PAR1")
  with pytest.raises(ImportError, match="pip install datasets"):
    md.read_rows(path)


@pytest.mark.skipif(not md.datasets_available(), reason="the optional Hugging Face datasets library")
def test_parquet_and_arrow_through_datasets(tmp_path):
  import datasets  # pylint: disable=import-outside-toplevel
  rows = md.read_rows(GSM_TRAIN)
  ds = datasets.Dataset.from_list(rows)
  ds.to_parquet(str(tmp_path / "train.parquet"))
  ds.save_to_disk(str(tmp_path / "saved"))
  assert md.read_records("gsm8k", [tmp_path / "train.parquet"])[0]["answer"] == "19"
  assert len(md.read_records("gsm8k", [tmp_path / "saved"])) == len(rows)


def test_splits_are_disjoint_by_content_key():
  pool, test = md.read_records("gsm8k", [GSM_TRAIN]), md.read_records("gsm8k", [GSM_TEST])
  splits = md.assign_splits(pool, test, **FIXTURE_FRACTIONS)
  assert {s: len(r) for s, r in splits.items()} == {"sft": 5, "train": 8, "validation": 6, "test": 4}
  keys = {s: [md.canonical_key(r) for r in recs] for s, recs in splits.items()}
  assert not any(content_splits.key_overlaps(keys).values())
  # The test file rewords a train problem in case and spacing only: one key, kept in test, dropped from the pool.
  assert md.canonical_key(pool[0]) == md.canonical_key(test[2])
  assert sum(len(r) for r in splits.values()) == len(pool) + len(test) - 1
  fractions = md.fractions(None, **FIXTURE_FRACTIONS)
  for split in ("sft", "train", "validation"):
    assert {md.bucket_of(k, fractions) for k in keys[split]} == {split}
  # Without a test file, test is a content bucket of the pool; the buckets do not depend on the record order.
  math = md.read_records("math", [MATH])
  a = md.assign_splits(math, test_fraction=0.25, validation_fraction=0.2, train_fraction=0.3)
  b = md.assign_splits(math[::-1], test_fraction=0.25, validation_fraction=0.2, train_fraction=0.3)
  assert all(a[s] and sorted(r["id"] for r in a[s]) == sorted(r["id"] for r in b[s]) for s in md.SPLITS)
  assert md.canonical_key({"question": " What is  2+2?"}) == md.canonical_key({"question": "what is 2+2"})


def test_builder_writes_array_record_and_reads_back(tmp_path):
  expected = md.assign_splits(md.read_records("gsm8k", [GSM_TRAIN]), md.read_records("gsm8k", [GSM_TEST]),
                              **FIXTURE_FRACTIONS)
  builder = ldb.build_local_data(tmp_path, "gsm8k", files=[GSM_TRAIN], test_files=[GSM_TEST], **FIXTURE_FRACTIONS)
  assert list(builder.data_path.glob("*.array_record*"))
  for split in md.SPLITS:
    assert ldb.load_split(builder, split) == expected[split]
  assert len(builder.as_data_source("train")) == 8
  # Same parameters and bytes: the same config (reused); an edited file: a new one.
  again = ldb.build_local_data(tmp_path, "gsm8k", files=[GSM_TRAIN], test_files=[GSM_TEST], **FIXTURE_FRACTIONS)
  assert again.builder_config.name == builder.builder_config.name
  copy = tmp_path / "train.jsonl"
  shutil.copy(GSM_TRAIN, copy)
  first = ldb.make_config("gsm8k", files=[str(copy)]).name
  with open(copy, "a") as f:
    f.write(json.dumps({"question": "What is 1 + 1?", "answer": "1+1=2\n#### 2"}) + "\n")
  assert ldb.make_config("gsm8k", files=[str(copy)]).name != first
  capped = ldb.build_local_data(tmp_path, "math", files=[MATH], num_train=1, test_fraction=0.25,
                                validation_fraction=0.2, train_fraction=0.3)
  assert len(ldb.load_split(capped, "train")) == 1 and ldb.load_split(capped, "test")[0]["source"] == "math"
  with pytest.raises(ValueError, match="no records for split"):
    ldb.build_local_data(tmp_path, "math", files=[MATH500])


def test_bfcl_folder_through_the_builder(tmp_path):
  builder = ldb.build_local_data(tmp_path, "bfcl", files=[BFCL], categories=["simple", "irrelevance"])
  records = ldb.load_split(builder, "test")
  assert [r["id"] for r in records] == ["simple_python_0", "simple_python_1", "irrelevance_0"]
  area, money, joke = records
  assert area["gold"] == [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
  assert area["functions"][0]["parameters"]["required"] == ["base", "height"]
  assert money["system"] == "You are a helpful assistant." and money["query"] == "Convert 100 USD to EUR."
  assert money["demonstration"] == ("<think>Use convert_currency.</think><tool_call>[{\"name\":\"convert_currency\",\"arguments\":"
                                   "{\"amount\":100.0,\"source\":\"USD\",\"target\":\"EUR\"}}]</tool_call>")
  assert joke["gold"] == [] and joke["category"] == "irrelevance" and joke["num_conversions"] == -1
  with pytest.raises(ValueError, match="unknown BFCL category"):
    ldb.make_config("bfcl", files=[BFCL], categories=["simple_java"])


def test_gsm_symbolic_source():
  pytest.importorskip("reasoning_gym")
  sizes = {"sft": 6, "train": 8, "validation": 3, "test": 4}
  splits = md.symbolic_splits(3, sizes)
  assert {s: len(r) for s, r in splits.items()} == sizes
  keys = {s: [md.canonical_key(r) for r in recs] for s, recs in splits.items()}
  assert not any(content_splits.key_overlaps(keys).values())
  records = [r for recs in splits.values() for r in recs]
  assert all(r["type"].startswith("gsm_symbolic_") and "Do not include units" not in r["question"] for r in records)
  # The generator's chain of thought ends in '#### <answer>' and earns the reward for its own answer.
  np.testing.assert_array_equal(reward(records), 1.0)
  assert md.symbolic_splits(3, sizes) == splits  # Deterministic in the seed.


def gsm8k_config(**overrides):
  cfg = math_task.default_config("gsm8k")
  cfg.files, cfg.test_files = GSM_TRAIN, GSM_TEST
  cfg.validation_fraction, cfg.train_fraction = 0.2, 0.4
  cfg.max_new_tokens = cfg.max_completion_len = 16
  cfg.update(overrides)
  return cfg


def test_registered_tasks(tmp_path):
  task = TASKS.get("gsm8k")(gsm8k_config(), str(tmp_path))
  assert len(task.test_examples) == 4 and len(task.validation_examples) == 6 and len(task.rl_source) == 8
  np.testing.assert_array_equal(reward(task.test_examples), 1.0)
  assert task.eval_reward is math_answer_reward and task.tokenizer.vocab_size == ByteTokenizer().vocab_size
  cfg = math_task.default_config("math")
  cfg.files, cfg.test_fraction, cfg.validation_fraction, cfg.train_fraction = MATH, 0.25, 0.2, 0.3
  assert len(TASKS.get("math")(cfg, str(tmp_path)).test_examples) == 2
  check = TASK_CONFIG_CHECKS.get("gsm8k")
  check(config_dict.ConfigDict({"task": gsm8k_config()}))
  with pytest.raises(ConfigError, match="task.files"):
    check(config_dict.ConfigDict({"task": gsm8k_config(files="", test_files="")}))
  with pytest.raises(ConfigError, match="task.num_sft=-1: gsm_symbolic needs explicit sizes"):
    check(config_dict.ConfigDict({"task": gsm8k_config(source="gsm_symbolic")}))


def test_evaluate_command_on_a_tiny_checkpoint(tmp_path, capsys):
  # pylint: disable=import-outside-toplevel
  from flax import nnx

  from experiments import evaluate
  from lemon_rl.models.config import ModelConfig
  from lemon_rl.models.hf import to_hf
  from lemon_rl.models.transformer import Transformer

  cfg = ModelConfig(vocab_size=ByteTokenizer().vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64)
  checkpoint = str(tmp_path / "model")
  to_hf(Transformer(cfg, rngs=nnx.Rngs(0)), checkpoint)
  scores = tmp_path / "scores.jsonl"
  report = evaluate.main([
      "--task=gsm8k", "--split=test", f"--checkpoint={checkpoint}", f"--data_dir={tmp_path / 'data'}",
      f"--set=files={GSM_TRAIN}", f"--set=test_files={GSM_TEST}", "--set=validation_fraction=0.2",
      "--set=train_fraction=0.4", "--max_new_tokens=8", "--num_samples=2", "--temperature=1.0",
      f"--scores_out={scores}"])
  assert '"num_examples": 4' in capsys.readouterr().out  # After tfds's own messages.
  assert report["split"] == "test" and report["num_samples"] == 2 and report["max_new_tokens"] == 8
  assert 0.0 <= report["score"] <= 1.0 and report["score"] == report["accuracy"]
  assert 0.0 <= report["extracted"] <= 1.0 and 1.0 <= report["completion_length"] <= 8.0
  rows = [json.loads(line) for line in scores.read_text().splitlines()]
  assert [r["id"] for r in rows] == [f"gsm8k_test.jsonl:{i}" for i in range(4)]
  assert all(r["score"] in (0.0, 0.5, 1.0) for r in rows)  # The mean of two 0/1 samples.
  with pytest.raises(ValueError, match="FIELD=VALUE"):
    evaluate.task_config("gsm8k", None, ["nope=1"])
  with pytest.raises(ValueError, match="not --task"):
    evaluate.task_config("math", "configs/grpo_arithmetic.py:cpu", [])
  section = evaluate.task_config("arithmetic", None, ["num_test=3", "p_sloppy=1"])
  assert section.num_test == 3 and section.p_sloppy == 1.0
