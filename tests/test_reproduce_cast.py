"""The CAST reproduction: each of the paper's directions read with the right sign, and a tiny run of the script."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import reproduce_cast
from experiments.reports import cast as cast_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIELDS = ("accuracy", "think_len", "think_len_easy", "think_len_hard")


def _results(per_variant):
  """``{variant: (accuracy, think_len, easy, hard)}`` -> the ``collect`` shape, three identical seeds + noise."""
  out = {}
  for variant, values in per_variant.items():
    finals = [{k: v + 0.01 * s for k, v in zip(FIELDS, values)} for s in range(3)]
    out[variant] = {"final": finals, "summary": [], "eval_curves": [], "train_curves": [[]], "profile": []}
  return out


def _line(lines, prefix):
  (match,) = [l for l in lines if l.startswith(prefix)]
  return match


# The paper's world: CAST more accurate and shorter than GRPO, the budget trims easy thinking only,
# hard-to-easy is worse and longer, the schema reward helps.
PAPER = {"sft_only": (0.5, 40, 30, 50), "grpo": (0.55, 80, 70, 90), "cast": (0.6, 45, 30, 60),
         "cast_no_budget": (0.58, 60, 50, 70), "cast_no_schema": (0.57, 45, 30, 60),
         "cast_hard_to_easy": (0.4, 120, 110, 130)}
# Every direction reversed.
REVERSED = {"sft_only": (0.5, 40, 30, 50), "grpo": (0.6, 40, 30, 50), "cast": (0.5, 60, 70, 50),
            "cast_no_budget": (0.5, 40, 30, 60), "cast_no_schema": (0.6, 45, 30, 60),
            "cast_hard_to_easy": (0.7, 30, 20, 40)}

PREFIXES = ("- CAST accuracy >= GRPO", "- shorter thinking on easy", "- the budget cuts easy thinking",
            "- CAST thinks less than GRPO", "- longer thinking kept on hard", "- hard-to-easy curriculum hurts",
            "- hard-to-easy lengthens", "- schema reward helps")


@pytest.mark.parametrize("prefix", PREFIXES)
def test_each_direction_holds_in_the_papers_world_and_fails_reversed(prefix):
  holds = _line(cast_report.findings(_results(PAPER)), prefix)
  fails = _line(cast_report.findings(_results(REVERSED)), prefix)
  assert holds.endswith(": reproduced"), holds
  assert fails.endswith(": opposite"), fails


def test_a_difference_inside_its_interval_is_not_significant():
  results = _results(PAPER)
  results["grpo"]["final"] = [{**f, "accuracy": a} for f, a in zip(results["grpo"]["final"], (0.2, 0.9, 0.6))]
  line = _line(cast_report.findings(results), "- CAST accuracy >= GRPO")
  assert line.endswith(": not distinguishable"), line


def _write_run(workdir, records):
  workdir.mkdir(parents=True)
  (workdir / "summary.json").write_text("{}")
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_collect_reads_the_chosen_learning_rate_and_one_sft_row_per_sft_run(tmp_path):
  _write_run(tmp_path / "seed0" / "sft_only", [{"phase": "eval_sft", "step": 10, "accuracy": 0.5}])
  for seed in (0, 1):
    for lr, acc in ((1e-4, 0.6), (3e-5, 0.1)):
      _write_run(tmp_path / f"seed{seed}" / f"grpo_lr{lr:g}",
                 [{"phase": "eval_rl", "step": 0, "accuracy": 0.5},
                  {"phase": "eval_rl", "step": 4, "accuracy": acc + 0.1 * seed}])
  shared = reproduce_cast.collect(str(tmp_path), {"grpo": 1e-4}, {0: 0, 1: 0})
  assert [f["accuracy"] for f in shared["sft_only"]["final"]] == [0.5]
  assert [f["accuracy"] for f in shared["grpo"]["final"]] == [0.6, 0.7] and shared["grpo"]["seeds"] == [0, 1]


def _reproduce(root, *extra):
  return subprocess.run(
      [sys.executable, "-m", "experiments.reproduce_cast", "--size=tiny", "--seeds=0,1,2", "--sft-group=2",
       "--variants=grpo,cast", "--learning_rates=1e-3,1e-2", f"--root={root}", f"--results-file={root}/results.json",
       f"--plot-dir={root}/plots", *extra],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def tiny_reproduction(tmp_path_factory):
  root = tmp_path_factory.mktemp("cast_repro")
  proc = _reproduce(root, "--workers=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return root, json.loads((root / "results.json").read_text())


def test_tiny_reproduction_gates_tunes_on_validation_then_runs_the_other_seeds(tiny_reproduction):
  root, saved = tiny_reproduction
  assert saved["done"] and sorted(saved["headroom"]) == ["0", "2"]  # One gate per SFT policy.
  for gate in saved["headroom"].values():
    assert gate["passed"]
    assert {c["statistic"] for c in gate["checks"]} == {"signal_group_share", "partial_credit_group_share"}
  tuning = saved["tuning"]
  assert tuning["split"] == "validation" and tuning["trials_per_arm"] == 2
  for variant in ("grpo", "cast"):
    rec = tuning["arms"][variant]
    scores = [t["score"] for t in rec["trials"]]
    assert rec["chosen_index"] == int(np.argmax(scores))  # Ties go to the first.
    lr = rec["chosen_params"]["learning_rate"]
    for t in rec["trials"]:  # Each trial's score is its run's validation accuracy.
      summary = json.loads((root / "seed0" / f"{variant}_lr{t['params']['learning_rate']:g}" / "summary.json").read_text())
      assert summary["final_eval"]["validation/accuracy"] == t["score"]
    # Seeds 1 and 2 ran only at the chosen learning rate; seed 1 from seed 0's SFT policy, seed 2 from its own.
    for seed in (1, 2):
      runs = [p.name for p in (root / f"seed{seed}").iterdir() if p.name.startswith(variant + "_")]
      assert runs == [f"{variant}_lr{lr:g}"]
    assert saved["results"][variant]["seeds"] == [0, 1, 2]
  assert not (root / "seed1" / "sft_only").exists() and (root / "seed2" / "sft_only" / "summary.json").exists()
  assert saved["results"]["sft_only"]["seeds"] == [0, 2]
  assert "SFT: 2 runs (seeds 0, 1 from SFT seed 0; seed 2 from SFT seed 2)" in cast_report.render(saved)
  lr = tuning["arms"]["cast"]["chosen_params"]["learning_rate"]
  assert (root / "seed1" / f"cast_lr{lr:g}" / "cases" / "profile.json").exists()
  assert "### The paper's directions on this run" in cast_report.render(saved)


def test_tiny_reproduction_reads_finished_runs_back(tiny_reproduction):
  root, saved = tiny_reproduction
  again = _reproduce(root)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "=== seed" not in again.stdout  # Nothing reran.
  assert json.loads((root / "results.json").read_text())["results"] == saved["results"]


def test_a_failed_gate_stops_before_any_rl_run(tmp_path):
  proc = _reproduce(tmp_path, "--set=headroom.thresholds.min_signal_group_share=1.5")
  assert proc.returncode != 0 and "step-0 headroom gate failed: signal_group_share" in proc.stderr
  saved = json.loads((tmp_path / "results.json").read_text())
  assert not saved["headroom"]["0"]["passed"] and "results" not in saved
  for seed in (0, 2):  # Both SFT policies were gated; no RL run started.
    assert sorted(p.name for p in (tmp_path / f"seed{seed}").iterdir()) == ["gate", "sft_only"]
  assert not (tmp_path / "seed1").exists()
  assert "FAILED" in cast_report.render(saved)


def test_sft_groups_share_the_first_seeds_sft_run(capsys):
  assert reproduce_cast.sft_seeds_of([0, 1, 2, 3, 4], 2) == {0: 0, 1: 0, 2: 2, 3: 2, 4: 4}
  assert reproduce_cast.sft_seeds_of([3, 5], 1) == {3: 3, 5: 5}
  assert reproduce_cast.sft_seeds_of([3, 5], 9) == {3: 3, 5: 3}
  with pytest.raises(SystemExit):
    reproduce_cast.main(["--sft-group=0"])
  assert "--sft-group must be >= 1, got 0" in capsys.readouterr().err


def test_equal_means_are_no_difference_in_either_direction():
  results = _results(PAPER)
  results["grpo"]["final"] = [dict(f) for f in results["cast"]["final"]]
  line = _line(cast_report.findings(results), "- CAST accuracy >= GRPO")
  assert line.endswith(": not distinguishable"), line
