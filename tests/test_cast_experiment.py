"""The CAST experiment: the ``tool_use`` task pieces, and the ``tiny`` variant end to end with a resume."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from lemon_rl.data.curriculum import CurriculumSampler
from lemon_rl.envs import tool_use
from lemon_rl.envs import tool_use_task as tut
from lemon_rl.training.config_validation import ConfigError, validate_config
from lemon_rl.training.rollout import advantage_variance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "configs/cast_tool_use.py:tiny"


def load_config(variant):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("cast_cfg", os.path.join(ROOT, "configs", "cast_tool_use.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


# ---------------------------------------------------------------------------------------------------------
# Pieces.


def test_splits_are_deterministic_disjoint_and_tagged():
  cfg = load_config("tiny").task
  a, b = tut.make_split(cfg, "train"), tut.make_split(cfg, "train")
  assert a == b and len(a) == cfg.num_train
  test = tut.make_split(cfg, "test")
  assert not {r["id"] for r in a} & {r["id"] for r in test}
  for r in a + test:
    gold = json.loads(r["gold"])
    assert r["difficulty"] == ("easy" if len(gold) <= 1 and r["num_conversions"] == 0 else "hard")
    assert len(r["prompt"].encode()) <= cfg.max_prompt_bytes
    assert r["completion"].startswith("<think>") and r["completion"].endswith("</tool_call>")


def test_demo_noise_changes_sft_demonstrations_only_never_the_requests():
  noisy = load_config("cast").task
  noisy.num_sft, noisy.num_train, noisy.num_validation, noisy.num_test = 400, 40, 40, 40
  clean = load_config("cast").task
  clean.num_sft, clean.num_train, clean.num_validation, clean.num_test = 400, 40, 40, 40
  del clean.demo_noise
  for split in tut.SPLITS:
    a, b = tut.make_split(noisy, split), tut.make_split(clean, split)
    assert [r["prompt"] for r in a] == [r["prompt"] for r in b] and [r["gold"] for r in a] == [r["gold"] for r in b]
    changed = np.mean([x["completion"] != y["completion"] for x, y in zip(a, b)])
    # SFT: filler alone touches half the demonstrations; the other splits keep the clean ones.
    assert (0.5 < changed < 0.8) if split == "sft" else changed == 0.0, (split, changed)
  longest = max(len(r["completion"].encode()) for r in tut.make_split(noisy, "sft"))
  assert noisy.max_completion_bytes < longest < tut.completion_budget(noisy)


def test_bad_demo_noise_is_named():
  config = load_config("cast")
  config.task.demo_noise.fillr = 0.5
  with pytest.raises(ConfigError, match="config.task.demo_noise"):
    validate_config(config)


def test_gate_statistics_hand_values():
  from lemon_rl.eval import headroom  # pylint: disable=g-import-not-at-top
  # Group a (easy): exact 0/0, R_tool 0.5/0.9, think 10/14.  Group b (easy): exact 0/1, R_tool 0.8/1, think
  # 10/10.  Group c (hard): exact 1/1, R_tool 1/1, think 30/50.
  rollout = headroom.HeadroomRollout(
      rewards=[0, 0, 0, 1, 1, 1], group_ids=["a", "a", "b", "b", "c", "c"], lengths=[10, 14, 10, 10, 30, 50],
      extra={"r_tool": [0.5, 0.9, 0.8, 1.0, 1.0, 1.0], "easy": [True, True, True, True, False, False]})
  stats = tut.gate_statistics(rollout)
  assert stats["signal_group_share"] == pytest.approx(1 / 3)
  assert stats["partial_credit_group_share"] == pytest.approx(1 / 3)  # Only a: R_tool varies, exact does not.
  assert stats["easy_think_length_std"] == pytest.approx(np.std([10, 14], ddof=1) / 2)  # Mean of a's and b's 0.
  hard_only = rollout.subset([False, False, False, False, True, True])
  assert np.isnan(tut.gate_statistics(hard_only)["easy_think_length_std"])


def test_tool_use_score_exact_and_group_metrics():
  rng = __import__("random").Random(3)
  simple = tool_use.generate_example(rng, "simple", style="python")
  irrelevant = tool_use.generate_example(rng, "irrelevance", style="python")
  records = [simple, simple, irrelevant]
  completions = [simple["demonstration"], "<think>x</think><tool_call>[]</tool_call>",
                 "<think>abc</think><tool_call>[]</tool_call>"]
  out = tut.ToolUseScore()(
      [r["prompt"] for r in records], completions, None, gold=[r["gold"] for r in records],
      functions=[json.dumps(r["functions"]) for r in records], category=[r["category"] for r in records],
      difficulty=["easy", "hard", "easy"])
  np.testing.assert_array_equal(out.rewards, [1.0, 0.0, 1.0])
  m = out.metrics
  np.testing.assert_array_equal(m["exact"], [1, 0, 1])
  np.testing.assert_array_equal(m["think_len"][1:], [1, 3])  # Bytes = tokens of the byte tokenizer.
  np.testing.assert_array_equal(m["acc_simple"][:2], [1, 0])
  assert np.isnan(m["acc_simple"][2]) and np.isnan(m["acc_irrelevance"][:2]).all()
  assert m["acc_irrelevance"][2] == 1.0 and np.isnan(m["acc_parallel"]).all()
  np.testing.assert_array_equal(m["think_len_hard"][1], 1.0)
  assert np.isnan(m["think_len_hard"][[0, 2]]).all()
  assert float(np.nanmean(m["acc_easy"])) == 1.0


def test_score_hardness_is_one_minus_mean_structural_score():
  from lemon_rl.data.case_library import Case  # pylint: disable=g-import-not-at-top
  dims = ("name", "key", "type", "constraint", "value")

  def case(q, structural, exact=0.0):
    return Case(q, "", 0, (), {**dict(zip(dims, structural)), "exact": exact}, exact == 1.0)

  cases = [case("a", [1, 1, 1, 1, 1], 1.0), case("a", [1, 0.5, 0, 0, 0]), case("b", [0, 0, 0, 0, 0])]
  h = tut.score_hardness(cases)
  assert h == pytest.approx({"a": 1 - (1.0 + 0.3) / 2, "b": 1.0})  # exact is not averaged in.


def test_curriculum_iterator_batches_state_and_mismatch():
  records = [{"id": f"q{i}", "prompt": f"p{i}"} for i in range(6)]
  hardness = [0.9, 0.1, 0.5, 0.0, 1.0, 0.3]
  it = tut.CurriculumIterator(records, CurriculumSampler(hardness, 2, total_steps=6, num_stages=3, seed=1))
  first = next(it)
  assert set(first) == {"id", "prompt"} and len(first["id"]) == 2
  assert set(first["id"]) == {"q3", "q1"}  # Stage 1 admits the two easiest.
  state = it.get_state()
  rest = [next(it)["id"] for _ in range(4)]
  again = tut.CurriculumIterator(records, CurriculumSampler(hardness, 2, total_steps=6, num_stages=3, seed=1))
  again.set_state(json.loads(json.dumps(state)))
  assert [next(again)["id"] for _ in range(4)] == rest
  other = tut.CurriculumIterator(records, CurriculumSampler(hardness, 2, mode="hard_to_easy", total_steps=6))
  with pytest.raises(ValueError, match="mode"):
    other.set_state(state)


def test_advantage_variance_against_hand_values():
  rewards = np.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
  groups = np.array([0, 0, 0, 1, 1, 1])
  adv = np.array([1.0, -0.5, -0.5, -1.0, 0.5, 0.5])
  out = advantage_variance(rewards, adv, groups)
  assert out["advantage/normalized_variance"] == pytest.approx(np.var(adv))
  # Group means 1/3 and 4/3; within SS = 2/3 + 8/3 = 10/3; total SS around 5/6 = 29/6.
  assert out["advantage/within_group_share"] == pytest.approx((10 / 3) / (29 / 6))
  assert advantage_variance(np.ones(4), np.zeros(4), np.array([0, 0, 1, 1]))["advantage/within_group_share"] == 0.0


@pytest.mark.parametrize("field,value,message", [
    ("task.cast.curriculum", "easy_first", "config.task.cast.curriculum='easy_first'"),
    ("task.reward", "dense", "config.task.reward='dense'"),
    ("task.cast.num_samples", 0, "config.task.cast.num_samples=0"),
])
def test_bad_tool_use_config_is_named(field, value, message):
  config = load_config("cast")
  section = config
  *parents, leaf = field.split(".")
  for p in parents:
    section = section[p]
  section[leaf] = value
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    validate_config(config)


def test_every_variant_validates_and_differs_as_documented():
  configs = {v: load_config(v) for v in ("cast", "grpo", "sft_only", "cast_no_budget", "cast_no_schema",
                                        "cast_hard_to_easy", "tiny")}
  for config in configs.values():
    validate_config(config)
  assert configs["grpo"].task.reward == "exact" and configs["sft_only"].rl.steps == 0
  assert not configs["cast_no_budget"].task.cast.use_budget and not configs["cast_no_schema"].task.cast.use_schema
  assert configs["cast_hard_to_easy"].task.cast.curriculum == "hard_to_easy"
  # Every RL variant shares the SFT phase, so one SFT checkpoint serves all of them.
  assert len({json.dumps(c.sft.to_dict()) for v, c in configs.items() if v != "tiny"}) == 1
  with pytest.raises(ValueError, match="unknown variant"):
    load_config("cats")


# ---------------------------------------------------------------------------------------------------------
# End to end through experiments.main (one workdir: interrupted during RL, then resumed).


def launch(workdir):
  return subprocess.Popen([sys.executable, "-m", "experiments.main", f"--config={TINY}", f"--workdir={workdir}"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
  """Runs the tiny CAST variant, SIGTERMs it after its first RL step, and reruns it to the end."""
  workdir = str(tmp_path_factory.mktemp("cast_tiny"))
  t0 = time.time()
  proc = launch(workdir)
  metrics = os.path.join(workdir, "metrics.jsonl")
  while time.time() - t0 < 300 and proc.poll() is None:
    if os.path.exists(metrics) and any(r["phase"] == "rl" for r in records(workdir)):
      break
    time.sleep(0.2)
  assert proc.poll() is None, "the run finished before it could be interrupted: " + proc.stderr.read()[-2000:]
  cases = os.path.join(workdir, "cases", "cases.jsonl")
  first_cases = open(cases).read()
  first_mtime = os.stat(cases).st_mtime_ns
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-3000:]
  interrupted_steps = [r["step"] for r in records(workdir) if r["phase"] == "rl"]
  proc = launch(workdir)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  return {"workdir": workdir, "out": out, "first_cases": first_cases, "first_mtime": first_mtime,
          "interrupted_steps": interrupted_steps, "seconds": time.time() - t0}


def test_tiny_run_writes_case_library_and_profile(resumed_run):
  workdir = resumed_run["workdir"]
  config = load_config("tiny")
  with open(os.path.join(workdir, "cases", "cases.jsonl")) as f:
    cases = [json.loads(line) for line in f]
  assert len(cases) == config.task.num_train * config.task.cast.num_samples
  train_ids = [r["id"] for r in tut.make_split(config.task, "train")]
  assert [c["query_id"] for c in cases] == [q for q in train_ids for _ in range(config.task.cast.num_samples)]
  for c in cases:
    assert set(c["scores"]) == {"name", "key", "type", "constraint", "value", "exact"}
  with open(os.path.join(workdir, "cases", "profile.json")) as f:
    profile = json.load(f)
  assert set(profile["complexity"]["hardness"]) == set(train_ids)
  assert len(profile["complexity"]["baselines"]) == config.task.cast.num_bins
  assert set(profile["failure"]["overall"]) == {"name", "key", "type", "constraint", "value", "exact"}
  assert "held-out accuracy" in resumed_run["out"]


def test_tiny_run_logs_per_dimension_and_per_category_metrics(resumed_run):
  recs = records(resumed_run["workdir"])
  rl = [r for r in recs if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for key in ("name", "key", "type", "constraint", "value", "exact", "format", "think_len", "alpha", "hardness",
              "r_tool", "r_think"):
    assert f"reward/cast/{key}" in rl[-1], key
  assert "advantage/normalized_variance" in rl[-1] and "advantage/within_group_share" in rl[-1]
  final = [r for r in recs if r["phase"] == "eval_rl"][-1]
  assert final["step"] == 3
  for key in ("accuracy", "exact", "think_len", "acc_easy", "acc_hard", "think_len_easy", "think_len_hard"):
    assert key in final, key
  assert {f"acc_{c}" for c in tool_use.CATEGORIES} <= set(final)


def test_resume_reuses_the_case_library(resumed_run):
  assert max(resumed_run["interrupted_steps"]) < 3
  cases = os.path.join(resumed_run["workdir"], "cases", "cases.jsonl")
  assert open(cases).read() == resumed_run["first_cases"]
  assert os.stat(cases).st_mtime_ns == resumed_run["first_mtime"]  # Not rewritten.
  with open(os.path.join(resumed_run["workdir"], "cases", "profile.json")) as f:
    assert json.load(f)["meta"]["sampled"] is False  # The resumed run read the cases back.
