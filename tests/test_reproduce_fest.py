"""The FEST reproduction (experiments/reproduce_fest.py) end to end at tiny size, its gate and its report."""

import copy
import json
import os
import subprocess
import sys

import pytest

from configs import fest_math
from experiments.reports import fest as report
from lemon_rl.eval import headroom

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--size=tiny", "--seeds=0,1", "--learning_rates=1e-4,3e-3", "--arms=grpo,fest_grpo"]


def _run(workdir, results):
  return subprocess.run([sys.executable, "-m", "experiments.reproduce_fest", f"--workdir={workdir}",
                         f"--results_file={results}", *ARGS], cwd=ROOT, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp("fest")
  results = str(out / "results.json")
  _run(out / "work", results)
  with open(results) as f:
    return out, json.load(f)


def test_tuning_gate_and_seeds(run):
  out, saved = run
  assert saved["done"] and saved["arms"] == ["grpo", "fest_grpo"] and saved["seeds"] == [0, 1]
  assert saved["headroom"]["passed"] and len(saved["headroom"]["checks"]) == 3
  tuning = saved["tuning"]
  assert tuning["split"] == "hard_validation" and tuning["trials_per_arm"] == 2
  with open(out / "work" / "tuning.json") as f:
    assert json.load(f) == tuning
  for arm, rec in tuning["arms"].items():
    # The choice is the best validation score (ties to the first trial), read from the tuning runs.
    scores = [t["score"] for t in rec["trials"]]
    assert rec["chosen_index"] == scores.index(max(scores))
    runs = [r for r in saved["runs"] if r["arm"] == arm]
    assert [r["seed"] for r in runs] == [0, 1]
    assert all(r["lr"] == rec["chosen_params"]["learning_rate"] for r in runs)
    assert runs[0]["final"]["validation/avg@2"] == rec["chosen_score"]
  starts = [r for r in saved["runs"] if r["arm"] == "start"]
  assert [r["seed"] for r in starts] == [0, 1] and all(r["lr"] is None and r["rl_steps"] == 0 for r in starts)
  for r in saved["runs"]:
    assert {"validation/avg@2", "hard/pass@2", "shifted/avg@2", "hard/all_wrong", "easy/accuracy"} <= set(r["final"])
  fest_run = next(r for r in saved["runs"] if r["arm"] == "fest_grpo")
  assert fest_run["diagnostics"] is not None and "fest/decaying_weight/mean/last" in fest_run["diagnostics"]
  assert os.path.exists(out / "curves.png")


def test_a_rerun_reads_every_run_back(run):
  out, saved = run
  results = str(out / "again.json")
  _run(out / "work", results)
  with open(results) as f:
    again = json.load(f)
  assert again["runs"] == saved["runs"] and again["tuning"] == saved["tuning"]


def test_report_renders_the_run(run):
  _, saved = run
  text = report.render(saved)
  assert "| FEST-GRPO | " in text and "| pure GRPO | " in text and "| easy-SFT start | - | 0,1 |" in text
  assert "one Holm family of 2" in text  # FEST-GRPO - pure GRPO in Avg@2 and Pass@2: the directions run.
  assert "Step-0 headroom gate" in text and "Tuning (validation avg@2 on `hard_validation`" in text


def test_gate_names_what_failed():
  """The config's thresholds name exactly the statistics the reproduction computes (experiments/reproduce_fest.py
  imports flags, so the test reads the same two pieces it combines)."""
  config = fest_math.get_config("fest_grpo")
  thresholds = headroom.HeadroomGate.from_config(config.headroom).thresholds
  final = {"validation/pass@8": 0.5, "validation/all_wrong": 0.3, "easy/accuracy": 0.95}
  gate = headroom.check_headroom(report.gate_statistics(final, 8), thresholds, raise_on_failure=False)
  assert not gate.passed
  assert {c.statistic for c in gate.failures} == {"hard_validation_pass_at_k", "hard_validation_all_wrong"}
  final.update({"validation/pass@8": 0.05, "validation/all_wrong": 0.9})
  assert headroom.check_headroom(report.gate_statistics(final, 8), thresholds).passed


def _saved(fest_gain: float) -> dict:
  """Five seeds of every arm: FEST-GRPO above pure GRPO by ``fest_gain`` (seed noise +-0.01), every other
  arm equal to pure GRPO."""
  runs = []
  for seed in range(5):
    noise = 0.01 * (seed - 2)
    for arm in fest_math.ARMS:
      value = 0.3 + (fest_gain + noise if arm == "fest_grpo" else 0.0)
      if arm == "fest_grpo_fixed_w":
        value = 0.3 + 0.02 * (-1) ** seed  # No direction.
      final = {"hard/avg@8": value, "hard/pass@8": value, "shifted/avg@8": 0.0, "shifted/pass@8": 0.0,
               "hard/all_wrong": 0.5, "hard/complete": 1.0, "hard/line_accuracy": 1.0, "easy/accuracy": 0.9}
      runs.append({"arm": arm, "seed": seed, "lr": 1e-4, "final": final, "curve": [], "wall_s": {"rl": 1.0},
                   "diagnostics": None})
  setup = {"eval_samples": 8, "betas": [0.1, 0.05, 0.025], "preset": "tiny", "sft_steps": 1, "sft_batch": 1,
           "rl_steps": 1, "num_shots": 128, "rl_prompts": 8, "expert_prompts": 4, "num_generations": 8, "c": 1.0,
           "grpo_prompts": 12, "mixed_sft_steps": 1, "expert_sft_batch": 1, "mixed_easy_per_shot": 3,
           "shots_sft_steps": 1, "expert_sft_lr": 1e-3, "num_iterations": 1, "learning_rates": [1e-4],
           "eval_temperature": 1.0, "eval_examples": 128, "eval_shifted": 128}
  return {"command": "c", "machine": "m", "done": True, "family_alpha": 0.05,
          "arms": list(fest_math.ARMS), "seeds": list(range(5)), "setup": setup, "runs": runs}


def test_verdicts_follow_the_intervals():
  results = {r.name: r for r in report.paired_results(_saved(fest_gain=0.2))}
  assert len(results) == 2 * len(report.DIRECTIONS)
  assert results["FEST-GRPO - pure GRPO, hard/avg@8"].verdict == "reproduced"
  assert results["FEST-GRPO - FEST-DPO, hard/pass@8"].verdict == "reproduced"
  assert results["FEST-DPO - pure GRPO, hard/avg@8"].verdict == "not distinguishable"  # Zero differences.
  assert results["FEST-GRPO - FEST-GRPO, w fixed, hard/avg@8"].verdict == "reproduced"
  opposite = {r.name: r for r in report.paired_results(_saved(fest_gain=-0.2))}
  assert opposite["FEST-GRPO - mixed SFT then GRPO, hard/avg@8"].verdict == "opposite"
  partial = copy.deepcopy(_saved(fest_gain=0.2))
  partial["arms"] = ["grpo", "fest_grpo"]
  assert len(report.paired_results(partial)) == 2
  assert "PARTIAL" not in report.render(_saved(0.2)) and "Tuning: not finished." in report.render(_saved(0.2))
