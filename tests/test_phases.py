"""The phase protocol: a phase registered outside the runner runs, logs, checkpoints and resumes through it."""

import json
import os

import jax.numpy as jnp
import pytest

from configs import grpo_arithmetic
from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.training import experiment
from lemon_rl.training.config_validation import ConfigError, validate_config
from lemon_rl.training.phases import PHASES, Phase, PhaseKind
from lemon_rl.utils import config_checks as cc

FINISHED = []


def build_counting_phase(ctx):
  """A phase that trains no policy: its state counts the examples it saw (like a tokenizer or drafter phase
  whose result is not the policy's parameters)."""
  section = ctx.config.counting

  def step(state, examples):
    state = {"examples": state["examples"] + len(examples)}
    return state, {"train/examples": float(state["examples"])}

  return Phase(state={"examples": jnp.zeros((), jnp.int32)},
               iterator=BatchIterator(ctx.task.rl_source, batch_size=section.batch_size, seed=ctx.config.seed),
               step=step, steps=section.steps, eval_every=section.eval_every, progress_keys=("train/examples",),
               evaluate=lambda state: {"examples": float(state["examples"])},
               finish=lambda state: FINISHED.append(int(state["examples"])))


def check_counting_config(config):
  cc.require_positive(config.counting, "counting", "batch_size")


if "counting" not in PHASES:
  PHASES.register("counting", PhaseKind(build_counting_phase, check_counting_config))


def counting_config(tmp_path, steps=3):
  config = grpo_arithmetic.get_config("tiny")
  config.unlock()
  config.data_dir = str(tmp_path / "data")
  config.phases = ("counting",)
  config.counting = dict(steps=steps, batch_size=5, eval_every=2)
  return config


def test_a_new_phase_runs_through_the_unchanged_runner_and_resumes(tmp_path):
  FINISHED.clear()
  workdir = str(tmp_path / "run")
  experiment.run(counting_config(tmp_path, steps=3), workdir)
  assert FINISHED == [15]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["train/examples"] for r in records if r["phase"] == "counting"] == [5.0, 10.0, 15.0]
  assert [r["examples"] for r in records if r["phase"] == "eval_counting"] == [0.0, 10.0, 15.0]
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "counting"))
  # Asking for two more steps resumes from the checkpoint of step 3 (state and data position).
  experiment.run(counting_config(tmp_path, steps=5), workdir)
  assert FINISHED == [15, 25]


def test_unknown_phase_and_invalid_phase_section_fail_validation(tmp_path):
  config = counting_config(tmp_path)
  config.phases = ("sft", "distill")
  with pytest.raises(ConfigError, match="config.phases='distill'.*must be one of"):
    validate_config(config)
  config = counting_config(tmp_path)
  config.counting.batch_size = 0
  with pytest.raises(ConfigError, match="config.counting.batch_size=0"):
    validate_config(config)
