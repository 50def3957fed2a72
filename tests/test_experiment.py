"""The launcher end to end on the tiny config: outputs, config errors, and exact resume after SIGTERM/SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "configs/grpo_arithmetic.py:tiny"
VOLATILE = ("time", "per_s")  # Wall-clock metrics differ between runs.


def launch(workdir, *overrides, data_dir=None):
  args = [sys.executable, "-m", "experiments.main", f"--config={TINY}", f"--workdir={workdir}", *overrides]
  if data_dir:
    args.append(f"--config.data_dir={data_dir}")
  return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def stable_records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in records]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
  workdir = str(tmp_path_factory.mktemp("reference"))
  proc = launch(workdir, data_dir=data_dir)
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  return workdir, out


def test_main_job_writes_metrics_plot_summary_and_events(reference_run):
  workdir, out = reference_run
  for name in ("metrics.jsonl", "curves.png", "summary.txt", "summary.json", "config.json"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tb")))
  assert "held-out accuracy" in out
  records = stable_records(workdir)
  rl = [r for r in records if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3, 4]
  for key in ("reward/answer/mean", "advantage/std", "train/clip_frac", "train/ratio_mean", "train/entropy",
              "completion_length/mean", "frac_all_equal_groups", "train/loss", "train/grad_norm"):
    assert key in rl[-1], key
  assert [r["step"] for r in records if r["phase"] == "eval_rl"] == [0, 2, 4]


def test_bad_config_key_and_value_fail_before_compiling(tmp_path):
  proc = launch(str(tmp_path / "a"), "--config.rl.advantage_estimatr=grpo")
  _, err = proc.communicate(timeout=120)
  assert proc.returncode != 0 and "advantage_estimatr" in err
  proc = launch(str(tmp_path / "b"), "--config.rl.advantage_estimator=grpoo")
  _, err = proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert "config.rl.advantage_estimator='grpoo'" in err and "rloo" in err
  proc = launch(str(tmp_path / "c"), "--config.rl.minibatch_size=7")
  _, err = proc.communicate(timeout=120)
  assert proc.returncode != 0 and "config.rl.minibatch_size=7" in err
  assert not os.path.exists(tmp_path / "b" / "checkpoints")


def test_sigterm_then_sigkill_resumes_to_identical_metrics(tmp_path, reference_run, data_dir):
  workdir = str(tmp_path / "interrupted")
  proc = launch(workdir, data_dir=data_dir)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 600
  # Signal as soon as SFT has been evaluated: RL's compilation alone outlasts the signal's delivery, so the
  # run stops at the end of SFT or within RL (waiting for an RL step raced the 4 fast steps to the end).
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and any(json.loads(l)["phase"] == "eval_sft" for l in open(metrics)):
      break
    time.sleep(0.05)
  assert proc.poll() is None, "run finished before it could be interrupted"
  proc.send_signal(signal.SIGTERM)
  try:
    proc.wait(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  assert proc.returncode in (143, -signal.SIGKILL), proc.stderr.read()[-2000:]
  done_steps = [r["step"] for r in stable_records(workdir) if r["phase"] == "rl"]
  assert max(done_steps, default=0) < 4
  # Restart on the same workdir: it resumes and finishes.
  proc = launch(workdir, data_dir=data_dir)
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  assert stable_records(workdir) == stable_records(reference_run[0])
  with open(os.path.join(workdir, "summary.json")) as f:
    resumed = json.load(f)
  with open(os.path.join(reference_run[0], "summary.json")) as f:
    reference = json.load(f)
  assert resumed["rl_final_accuracy"] == reference["rl_final_accuracy"]
  # Every kept checkpoint is committed (no stray temporary directories).
  for phase in ("sft", "rl"):
    entries = os.listdir(os.path.join(workdir, "checkpoints", phase))
    assert not [e for e in entries if "tmp" in e], entries
