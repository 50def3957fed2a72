"""Several weighted reward functions, with per-function metrics and fault isolation.

``R = sum_k w_k r_k``. A reward function that raises on the batch is logged (once per call, with the
traceback) and counted (``reward/<name>/batch_errors``), then retried sample by sample; a sample on which it
still raises is scored ``error_reward`` (default 0) and counted (``reward/<name>/errors``), so one bad
completion never crashes a run. Such a score is not a verdict: it enters the advantages like any other, so a
non-zero error count deserves a look.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
from absl import logging

from lemon_rl.rewards.base import RewardFn, RewardOutput, as_reward_output


@dataclasses.dataclass(frozen=True)
class WeightedReward:
  name: str
  fn: RewardFn
  weight: float = 1.0


def _slice_fields(fields: Mapping[str, Sequence[Any]], i: int) -> dict[str, list[Any]]:
  return {k: [v[i]] for k, v in fields.items()}


def _call_robust(reward: WeightedReward, prompts, completions, completion_ids, fields, error_reward: float
                 ) -> tuple[RewardOutput, int, bool]:
  """``(output, samples scored error_reward, whether the batch call raised)``."""
  n = len(prompts)
  try:
    return as_reward_output(reward.fn(prompts, completions, completion_ids, **fields), n), 0, False
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("reward %r raised on a batch of %d samples (%s: %s); retrying sample by sample",
                    reward.name, n, type(e).__name__, e, exc_info=True)
  rewards = np.full(n, error_reward, np.float32)
  metric_rows: dict[str, np.ndarray] = {}
  errors = 0
  for i in range(n):
    try:
      out = as_reward_output(reward.fn([prompts[i]], [completions[i]], [completion_ids[i]],
                                       **_slice_fields(fields, i)), 1)
    except Exception as e:  # pylint: disable=broad-except
      errors += 1
      if errors <= 3:
        logging.warning("reward %r raised on sample %d (%s: %s); scored %s", reward.name, i,
                        type(e).__name__, e, error_reward)
      continue
    rewards[i] = out.rewards[0]
    for k, v in out.metrics.items():
      metric_rows.setdefault(k, np.full(n, np.nan, np.float32))[i] = v[0]
  return RewardOutput(rewards, metric_rows), errors, True


def compute_rewards(rewards: Sequence[WeightedReward], prompts: list[str], completions: list[str],
                    completion_ids: list[list[int]], fields: Mapping[str, Sequence[Any]],
                    error_reward: float = 0.0) -> tuple[np.ndarray, dict[str, float], dict[str, np.ndarray]]:
  """Total rewards ``[N]``, scalar metrics, and each function's raw rewards ``{name: [N]}``."""
  n = len(prompts)
  total = np.zeros(n, np.float32)
  metrics: dict[str, float] = {}
  per_fn: dict[str, np.ndarray] = {}
  for reward in rewards:
    out, errors, batch_failed = _call_robust(reward, prompts, completions, completion_ids, fields, error_reward)
    total += reward.weight * out.rewards
    per_fn[reward.name] = out.rewards
    metrics[f"reward/{reward.name}/mean"] = float(out.rewards.mean())
    metrics[f"reward/{reward.name}/std"] = float(out.rewards.std())
    metrics[f"reward/{reward.name}/errors"] = float(errors)
    metrics[f"reward/{reward.name}/batch_errors"] = float(batch_failed)
    for k, v in out.metrics.items():
      if np.isfinite(v).any():
        metrics[f"reward/{reward.name}/{k}"] = float(np.nanmean(v))
  metrics["reward/total/mean"] = float(total.mean())
  metrics["reward/total/std"] = float(total.std())
  return total, metrics, per_fn
