"""experiments/RESULTS.md is exactly what the committed result files give, and readings add no numbers."""

import json
import os
import re
import signal
import time

import pytest

from experiments import machine
from experiments import results_md
from experiments.reports import grpo_arithmetic


def test_results_md_is_regenerated_from_committed_result_files():
  with open(results_md.RESULTS) as f:
    assert f.read() == results_md.render_all(), "run: python -m experiments.results_md"


def test_results_go_where_asked_and_only_the_committed_file_regenerates_results_md(tmp_path):
  scratch = results_md.save_results({"seeds": [0]}, str(tmp_path / "new" / "results.json"))
  assert json.load(open(scratch)) == {"seeds": [0]}
  assert not results_md.is_committed(scratch, grpo_arithmetic)
  committed = grpo_arithmetic.RESULTS_FILE
  assert results_md.is_committed(committed, grpo_arithmetic)
  assert results_md.is_committed(os.path.join(results_md.ROOT, committed), grpo_arithmetic)


def _call(fn, args):
  return fn(*args)


def _square(x, wait_for=None):
  """``x * x``, once ``wait_for`` exists (at most 120 s)."""
  deadline = time.time() + 120
  while wait_for and not os.path.exists(wait_for) and time.time() < deadline:
    time.sleep(0.01)
  return x * x


@pytest.mark.parametrize("workers", [1, 2])
def test_run_parallel_reports_each_result_as_it_finishes_and_returns_them_in_job_order(workers, tmp_path):
  reported = []
  second_reported = str(tmp_path / "second_reported")

  def on_result(i, result):
    reported.append((i, result))
    open(second_reported, "w").close()

  # In parallel the first job waits until the second one's result has been reported; in order, nothing waits.
  jobs = [(3, second_reported), (4,)] if workers > 1 else [(3,), (4,)]
  assert machine.run_parallel(_square, jobs, workers, on_result=on_result) == [9, 16]
  assert reported == ([(1, 16), (0, 9)] if workers > 1 else [(0, 9), (1, 16)])


def _wait_for_sigterm(ready: str) -> None:
  """Announces it runs (``ready``), then waits for SIGTERM (at most 120 s) and stops with an error, as an
  experiment stops after its checkpoint."""
  stop = []
  signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
  open(ready, "w").close()
  deadline = time.time() + 120
  while not stop and time.time() < deadline:
    time.sleep(0.01)
  raise RuntimeError("stopped by SIGTERM" if stop else "no SIGTERM came")


def _mark(path: str) -> None:
  open(path, "w").close()


def test_run_parallel_stopped_by_sigterm_stops_its_running_jobs_and_starts_no_other(tmp_path):
  ready, reported = str(tmp_path / "ready"), []
  marks = [str(tmp_path / f"started_{i}") for i in (2, 3)]

  def on_result(i, result):  # Job 1 runs: SIGTERM to this process, which passes it on.
    reported.append((i, result))
    os.kill(os.getpid(), signal.SIGTERM)

  jobs = [(_square, (3, ready)), (_wait_for_sigterm, (ready,)), (_mark, (marks[0],)), (_mark, (marks[1],))]
  with pytest.raises(machine.Stopped, match=r"1 of 4 jobs finished, 1 stopped \(stopped by SIGTERM\), 2 never"):
    machine.run_parallel(_call, jobs, 2, on_result=on_result)
  assert reported == [(0, 9)]
  assert not any(os.path.exists(m) for m in marks)


def test_machines_of_records_never_credit_this_machine_with_an_unrecorded_arm():
  records = [{"machine": "B, 2 CPUs"}, {"machine": "A, 2 CPUs"}, {"machine": "B, 2 CPUs"}]
  assert machine.of_records(records) == "A, 2 CPUs; B, 2 CPUs"
  assert machine.of_records([*records, {}]) == "A, 2 CPUs; B, 2 CPUs; machine not recorded"


@pytest.mark.parametrize("module", results_md.REPORTS)
def test_hand_written_readings_add_no_numbers(module):
  report = __import__(module, fromlist=["RESULTS_FILE"])
  path = os.path.join(results_md.ROOT, results_md.reading_path(report.RESULTS_FILE))
  if not os.path.exists(path):
    pytest.skip("no reading")
  text = open(path).read()
  assert not re.findall(r"\d+\.\d+|\d+\s*%", text), "a reading cites the tables; it adds no decimals or percentages"


def _arm(final, evals=()):
  return {"final": final, "evals": list(evals), "rl_reward": [], "wall_s": 10.0, "user_s": 9.0, "system_s": 1.0}


def test_default_experiment_section_reads_the_verdict_from_the_interval():
  seeds = []
  for seed, (sft, rl, more) in enumerate([(0.2, 0.4, 0.25), (0.25, 0.45, 0.3), (0.22, 0.41, 0.27)]):
    seeds.append({"seed": seed,
                  "grpo": _arm({"sft": {"accuracy": sft, "carryless": 0.3}, "rl": {"accuracy": rl, "carryless": 0.05}}),
                  "sft_control": _arm({"continued_sft": {"accuracy": more, "carryless": 0.3 + 0.01 * seed}})})
  saved = {"command": "cmd", "machine": "cpu", "family_alpha": 0.05, "seeds": seeds,
           "setup": {"sft_steps": 10, "sft_batch": 4, "rl_steps": 2, "rl_rows": 8, "continued_sft_steps": 11,
                     "eval_examples": 5, "flops_per_step": {"sft": 1e9, "rl": 5e9, "continued_sft": 1e9}}}
  text = grpo_arithmetic.render(saved)
  rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| GRPO - ")}
  assert rows["GRPO - its SFT start, accuracy"].endswith("| reproduced |")
  assert rows["GRPO - FLOP-matched more SFT, accuracy"].endswith("| reproduced |")
  assert rows["GRPO - FLOP-matched more SFT, carry-less share"].endswith("| reproduced |")
  seeds[1]["sft_control"]["final"]["continued_sft"]["accuracy"] = 0.9  # One seed where more SFT wins big.
  rows = {line.split("|")[1].strip(): line for line in grpo_arithmetic.render(saved).splitlines()
          if line.startswith("| GRPO - ")}
  assert rows["GRPO - FLOP-matched more SFT, accuracy"].endswith("| not distinguishable |")
