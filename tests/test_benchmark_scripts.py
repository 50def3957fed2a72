"""The lemon_rl side of ``benchmarks/train_step.py`` runs on today's trainer (no timing).

The benchmark builds its own GRPO step; this runs that step once on a small model, so that a config field
the trainer starts to require, or a change of the trainer's interface, fails here and not in a
benchmark run on another machine.
"""

import dataclasses
import os
import sys

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import train_step  # pylint: disable=g-import-not-at-top,wrong-import-position

from lemon_rl.models import Transformer, get_preset  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_train_step_benchmark_grpo_step_runs_full_length_completions():
  cfg = dataclasses.replace(get_preset("bench"), num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2,
                            mlp_dim=64)
  run, holder = train_step.lemon_grpo_step(Transformer(cfg, rngs=nnx.Rngs(0)))
  run()  # Asserts the rollout shapes (every completion NEW_TOKENS long) itself.
  metrics = holder["metrics"]
  assert np.isfinite(float(metrics["train/loss"])) and float(metrics["rl/skipped_zero_signal"]) == 0
  assert float(metrics["frac_all_equal_groups"]) < 1  # The trivial reward gives the update a signal.
