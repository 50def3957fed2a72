r"""Hyper-parameters chosen on validation only, with equal effort per arm, and the choice recorded.

Every arm of a comparison (GRPO, CAST, ...) gets the same number of trials ``K`` (a trial: a params dict and
its validation score); an arm with more trials would get the better of more draws from the same noise. Per
arm the chosen trial is

    k* = argmax_k score_k     (argmin with ``higher_is_better=False``)

*Decisions*: ties go to the first trial in the arm's list (list the trials in the order they were planned,
e.g. the grid order, so the choice does not depend on anything seen later); a trial that produced no
score (``None`` / NaN, e.g. a diverged run) still counts toward ``K`` but is never chosen, and an arm with
no scored trial is an error. The split must be a validation split: a name with a ``test`` token
(``test``, ``hard_test``, ``test-shifted``; tokens are split on non-alphanumerics) is refused.

:func:`record_choice` writes the choice as JSON (split, metric, direction, ``K``, every trial's params and
score, the chosen index and params per arm); :func:`load_choice` reads it back and re-checks it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping, Sequence

TIE_BREAK = "first trial in list order"


@dataclasses.dataclass(frozen=True)
class Trial:
  """One hyper-parameter setting and its validation score (``None`` if the trial produced none)."""

  params: Mapping[str, Any]
  score: float | None

  def __post_init__(self):
    score = None if self.score is None or math.isnan(float(self.score)) else float(self.score)
    object.__setattr__(self, "score", score)
    object.__setattr__(self, "params", dict(self.params))


@dataclasses.dataclass(frozen=True)
class ArmChoice:
  index: int
  params: dict[str, Any]
  score: float
  trials: tuple[Trial, ...]


@dataclasses.dataclass(frozen=True)
class TuningRecord:
  """A recorded choice: ``arms[name].params`` are the hyper-parameters to run the arm with."""

  split: str
  metric: str
  higher_is_better: bool
  trials_per_arm: int
  arms: dict[str, ArmChoice]

  def params(self, arm: str) -> dict[str, Any]:
    if arm not in self.arms:
      raise KeyError(f"no recorded choice for arm {arm!r}; recorded: {', '.join(self.arms)}")
    return dict(self.arms[arm].params)

  def to_dict(self) -> dict[str, Any]:
    return {"split": self.split, "metric": self.metric, "higher_is_better": self.higher_is_better,
            "trials_per_arm": self.trials_per_arm, "tie_break": TIE_BREAK,
            "arms": {name: {"chosen_index": c.index, "chosen_params": c.params, "chosen_score": c.score,
                            "trials": [{"params": t.params, "score": t.score} for t in c.trials]}
                     for name, c in self.arms.items()}}


def check_split(split: str) -> str:
  """``split`` unless it is empty or has a ``test`` token (ValueError)."""
  if not split or "test" in re.split(r"[^0-9a-z]+", split.lower()):
    raise ValueError(f"hyper-parameters must be chosen on a validation split, got split {split!r}")
  return split


def _as_trial(trial) -> Trial:
  if isinstance(trial, Trial):
    return trial
  if isinstance(trial, Mapping) and set(trial) == {"params", "score"}:
    return Trial(trial["params"], trial["score"])
  raise TypeError(f"a trial is a Trial or a {{'params': ..., 'score': ...}} mapping, got {trial!r}")


def choose_per_arm(trials: Mapping[str, Sequence[Any]], higher_is_better: bool = True) -> dict[str, ArmChoice]:
  """The best validation trial of every arm (module docstring).

  Args:
    trials: arm -> its trials (:class:`Trial` or ``{"params", "score"}`` mappings), in planned order.
    higher_is_better: False for a score to minimise (a loss).

  Raises:
    ValueError: no arms, arms with different numbers of trials, or an arm without a scored trial.
  """
  if not trials:
    raise ValueError("no arms to choose for")
  arms = {name: tuple(_as_trial(t) for t in ts) for name, ts in trials.items()}
  counts = {name: len(ts) for name, ts in arms.items()}
  if len(set(counts.values())) != 1 or 0 in counts.values():
    raise ValueError(f"every arm needs the same (non-zero) number of trials, got {counts}")
  sign = 1.0 if higher_is_better else -1.0
  out = {}
  for name, ts in arms.items():
    best = None
    for k, t in enumerate(ts):
      if t.score is not None and (best is None or sign * t.score > sign * ts[best].score):
        best = k  # Strict improvement only: ties keep the first trial.
    if best is None:
      raise ValueError(f"arm {name!r} has no trial with a validation score")
    out[name] = ArmChoice(best, dict(ts[best].params), ts[best].score, ts)
  return out


def record_choice(path: str, trials: Mapping[str, Sequence[Any]], *, split: str, metric: str,
                  higher_is_better: bool = True) -> TuningRecord:
  """Chooses per arm (:func:`choose_per_arm`) on ``split`` and writes the record to ``path`` (JSON).

  Args:
    path: the JSON file to write (parent directories are created).
    trials: arm -> trials, every arm the same number.
    split: the split the scores come from; a test split is refused.
    metric: what the score is, e.g. ``"validation accuracy"``.
    higher_is_better: the direction of the score.
  """
  record = TuningRecord(check_split(split), metric, higher_is_better,
                        len(next(iter(trials.values()))) if trials else 0,
                        choose_per_arm(trials, higher_is_better))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(record.to_dict(), f, indent=1, allow_nan=False)
    f.write("\n")
  return record


def load_choice(path: str) -> TuningRecord:
  """Reads a :func:`record_choice` file and re-checks it (split, equal trial counts, the chosen trials)."""
  with open(path) as f:
    raw = json.load(f)
  trials = {name: [Trial(t["params"], t["score"]) for t in arm["trials"]] for name, arm in raw["arms"].items()}
  record = TuningRecord(check_split(raw["split"]), raw["metric"], bool(raw["higher_is_better"]),
                        int(raw["trials_per_arm"]), choose_per_arm(trials, bool(raw["higher_is_better"])))
  for name, arm in raw["arms"].items():
    if len(arm["trials"]) != record.trials_per_arm:
      raise ValueError(f"{path}: arm {name!r} has {len(arm['trials'])} trials, the record says "
                       f"{record.trials_per_arm}")
    if arm["chosen_index"] != record.arms[name].index or arm["chosen_params"] != record.arms[name].params:
      raise ValueError(f"{path}: the recorded choice of arm {name!r} is not its best validation trial")
  return record
