"""The CAST reproduction's verdicts: each of the paper's directions is read with the right sign."""

import json

import pytest

from experiments import reproduce_cast
from experiments.reports import cast as cast_report

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


def test_sft_row_is_the_rl_runs_step0_evaluation_once_per_sft_run(tmp_path):
  # The SFT run scored its own (smaller) held-out set; the RL runs re-score the same policy at step 0.
  for seed in (0, 1):
    if seed == 0:
      _write_run(tmp_path / "seed0" / "sft_only", [{"phase": "eval_sft", "step": 10, "accuracy": 0.9}])
    _write_run(tmp_path / f"seed{seed}" / "grpo",
               [{"phase": "eval_rl", "step": 0, "accuracy": 0.5},
                {"phase": "eval_rl", "step": 4, "accuracy": 0.6 + 0.1 * seed}])
  shared = reproduce_cast.collect(str(tmp_path), [0, 1], ["grpo"], sft_seed=0)
  assert [f["accuracy"] for f in shared["sft_only"]["final"]] == [0.5]
  assert [f["accuracy"] for f in shared["grpo"]["final"]] == [0.6, 0.7]
  (tmp_path / "seed0" / "grpo" / "metrics.jsonl").write_text("")  # No RL evaluation: the SFT run's own.
  assert [f["accuracy"] for f in reproduce_cast.collect(str(tmp_path), [0], ["grpo"])["sft_only"]["final"]] == [0.9]


def test_equal_means_are_no_difference_in_either_direction():
  results = _results(PAPER)
  results["grpo"]["final"] = [dict(f) for f in results["cast"]["final"]]
  line = _line(cast_report.findings(results), "- CAST accuracy >= GRPO")
  assert line.endswith(": not distinguishable"), line
