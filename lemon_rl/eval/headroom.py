r"""Step-0 headroom gate: stop a run whose starting policy leaves its mechanism nothing to act on.

Before RL, the experiment samples one rollout batch from the starting policy (``N`` rows in groups of
completions of the same prompt) and computes statistics of it; thresholds fixed in the experiment config
*before the run* decide whether the run can test its mechanism (a group-relative method learns nothing from a
group whose rewards are all equal; a length budget has nothing to cut where lengths do not vary).

Statistics of :func:`headroom_statistics` (``g`` ranges over the ``G`` groups, ``r_g``, ``l_g`` the group's
rewards and completion lengths, ``std`` the unbiased (N-1) group standard deviation of METHODS.md section 0,
0 for a group of one):

    num_groups                 = G
    signal_group_share         = mean_g [max r_g - min r_g > reward_atol]   (any reward variance)
    mean_group_reward_std      = mean_g std(r_g)
    mean_group_length_std      = mean_g std(l_g)
    length_spread_group_share  = mean_g [std(l_g) > length_std_threshold]

plus any named statistic ``name -> fn(rollout) -> float`` the experiment supplies, built from the same
generic pieces (:func:`group_std`, :func:`group_varies`, :meth:`HeadroomRollout.subset` for e.g. the easy
queries only, per-row ``extra`` arrays such as another reward component).

The gate (:class:`HeadroomGate`) holds thresholds keyed ``min_<statistic>`` (the value must be ``>=``) or
``max_<statistic>`` (``<=``), e.g. ``{"min_signal_group_share": 0.3}``; :func:`check_headroom` compares and
raises :class:`HeadroomError` naming every failed statistic, its value and its threshold. A NaN statistic
(e.g. no rows) fails. Host-side NumPy, no per-method branches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

STATISTICS = ("num_groups", "signal_group_share", "mean_group_reward_std", "mean_group_length_std",
              "length_spread_group_share")


def _group_index(group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(inverse [N], counts [G])`` with groups numbered in sorted order of their ids."""
  _, inverse, counts = np.unique(np.asarray(group_ids).reshape(-1), return_inverse=True, return_counts=True)
  return inverse.reshape(-1), counts


def group_std(values, group_ids) -> np.ndarray:
  """Unbiased standard deviation per group, ``[N] -> [G]`` (groups in sorted id order; 0 for a group of one).

  ``std_g = sqrt(sum_{i in g} (x_i - mean_g x)^2 / (|g| - 1))``.
  """
  x = np.asarray(values, np.float64).reshape(-1)
  inverse, counts = _group_index(group_ids)
  if x.shape != inverse.shape:
    raise ValueError(f"values {x.shape} and group_ids {inverse.shape} must have the same length")
  mean = np.bincount(inverse, weights=x, minlength=counts.size) / counts
  sq = np.bincount(inverse, weights=(x - mean[inverse]) ** 2, minlength=counts.size)
  return np.where(counts > 1, np.sqrt(sq / np.maximum(counts - 1, 1)), 0.0)


def group_varies(values, group_ids, atol: float = 0.0) -> np.ndarray:
  """Whether a group's values are not all equal, ``max_g x - min_g x > atol``, ``[N] -> [G]`` bool."""
  x = np.asarray(values, np.float64).reshape(-1)
  inverse, counts = _group_index(group_ids)
  if x.shape != inverse.shape:
    raise ValueError(f"values {x.shape} and group_ids {inverse.shape} must have the same length")
  hi = np.full(counts.size, -np.inf)
  lo = np.full(counts.size, np.inf)
  np.maximum.at(hi, inverse, x)
  np.minimum.at(lo, inverse, x)
  return hi - lo > atol


def _share(mask: np.ndarray) -> float:
  return float(np.mean(mask)) if mask.size else float("nan")


@dataclasses.dataclass(frozen=True)
class HeadroomRollout:
  """A step-0 rollout batch.

  Attributes:
    rewards: ``[N]`` scalar reward per completion.
    group_ids: ``[N]`` group (prompt) of each completion.
    lengths: ``[N]`` completion lengths (tokens, or whatever length the mechanism acts on).
    extra: optional per-row arrays ``name -> [N]`` (reward components, difficulty tags, ...).
  """

  rewards: Any
  group_ids: Any
  lengths: Any
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    rows = {"rewards": np.asarray(self.rewards, np.float64).reshape(-1),
            "group_ids": np.asarray(self.group_ids).reshape(-1),
            "lengths": np.asarray(self.lengths, np.float64).reshape(-1)}
    extra = {k: np.asarray(v).reshape(-1) for k, v in self.extra.items()}
    sizes = {k: v.size for k, v in {**rows, **extra}.items()}
    if len(set(sizes.values())) > 1:
      raise ValueError(f"every per-row array needs the same length N, got {sizes}")
    for k, v in rows.items():
      object.__setattr__(self, k, v)
    object.__setattr__(self, "extra", extra)

  def subset(self, mask) -> HeadroomRollout:
    """The rows where ``mask`` ``[N]`` (bool) is true, e.g. the easy queries; groups may shrink."""
    mask = np.asarray(mask, bool).reshape(-1)
    if mask.size != self.rewards.size:
      raise ValueError(f"mask has {mask.size} rows, the rollout {self.rewards.size}")
    return HeadroomRollout(self.rewards[mask], self.group_ids[mask], self.lengths[mask],
                           {k: v[mask] for k, v in self.extra.items()})


def headroom_statistics(rollout: HeadroomRollout, *, length_std_threshold: float = 0.0, reward_atol: float = 0.0,
                        custom: Mapping[str, Callable[[HeadroomRollout], float]] | None = None
                        ) -> dict[str, float]:
  """The module docstring's statistics of ``rollout``, plus ``custom`` ones (NaN where there are no rows).

  Args:
    rollout: the step-0 batch.
    length_std_threshold: the within-group length std a group must exceed for ``length_spread_group_share``.
    reward_atol: rewards of a group that differ by at most this count as equal.
    custom: extra named statistics, each ``fn(rollout) -> float``; a name may not shadow a built-in one.
  """
  if rollout.rewards.size == 0:
    out = {name: float("nan") for name in STATISTICS}
    out["num_groups"] = 0.0
  else:
    length_std = group_std(rollout.lengths, rollout.group_ids)
    out = {"num_groups": float(length_std.size),
           "signal_group_share": _share(group_varies(rollout.rewards, rollout.group_ids, reward_atol)),
           "mean_group_reward_std": float(np.mean(group_std(rollout.rewards, rollout.group_ids))),
           "mean_group_length_std": float(np.mean(length_std)),
           "length_spread_group_share": _share(length_std > length_std_threshold)}
  for name, fn in (custom or {}).items():
    if name in out:
      raise ValueError(f"custom statistic {name!r} shadows a built-in one ({', '.join(STATISTICS)})")
    out[name] = float(fn(rollout))
  return out


@dataclasses.dataclass(frozen=True)
class HeadroomCheck:
  """One threshold compared: ``value >= threshold`` (``bound == "min"``) or ``value <= threshold`` ("max")."""

  statistic: str
  bound: str
  threshold: float
  value: float
  passed: bool

  def __str__(self) -> str:
    op = ">=" if self.bound == "min" else "<="
    return (f"{self.statistic} = {self.value:.4g} (needs {op} {self.threshold:g}): "
            f"{'ok' if self.passed else 'FAILED'}")


@dataclasses.dataclass(frozen=True)
class HeadroomReport:
  statistics: dict[str, float]
  checks: tuple[HeadroomCheck, ...]

  @property
  def passed(self) -> bool:
    return all(c.passed for c in self.checks)

  @property
  def failures(self) -> tuple[HeadroomCheck, ...]:
    return tuple(c for c in self.checks if not c.passed)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready: the statistics and every check (for the run's record)."""
    return {"statistics": dict(self.statistics), "passed": self.passed,
            "checks": [dataclasses.asdict(c) for c in self.checks]}


class HeadroomError(RuntimeError):
  """The step-0 rollout fails the gate; ``report`` holds every statistic and check."""

  def __init__(self, report: HeadroomReport):
    self.report = report
    super().__init__("step-0 headroom gate failed: " + "; ".join(str(c) for c in report.failures))


def _parse_threshold(key: str) -> tuple[str, str]:
  bound, _, statistic = key.partition("_")
  if bound not in ("min", "max") or not statistic:
    raise ValueError(f"threshold {key!r} must be named min_<statistic> or max_<statistic>")
  return bound, statistic


def check_headroom(statistics: Mapping[str, float], thresholds: Mapping[str, float],
                   raise_on_failure: bool = True) -> HeadroomReport:
  """Compares ``statistics`` with ``thresholds`` (``min_<statistic>`` / ``max_<statistic>`` -> value).

  Raises:
    ValueError: a threshold names a statistic that was not computed, or is malformed.
    HeadroomError: some statistic is on the wrong side of its threshold (or NaN) and ``raise_on_failure``.
  """
  checks = []
  for key, threshold in thresholds.items():
    bound, statistic = _parse_threshold(key)
    if statistic not in statistics:
      raise ValueError(f"threshold {key!r} names an unknown statistic {statistic!r}; computed: "
                       f"{', '.join(sorted(statistics))}")
    value, threshold = float(statistics[statistic]), float(threshold)
    passed = not math.isnan(value) and (value >= threshold if bound == "min" else value <= threshold)
    checks.append(HeadroomCheck(statistic, bound, threshold, value, passed))
  report = HeadroomReport(dict(statistics), tuple(checks))
  if raise_on_failure and not report.passed:
    raise HeadroomError(report)
  return report


@dataclasses.dataclass(frozen=True)
class HeadroomGate:
  """The gate of one experiment, fixed in its config before the run.

  In the config (``ml_collections``), e.g.::

      config.headroom = ml_collections.ConfigDict({
          "length_std_threshold": 4.0,
          "thresholds": {"min_signal_group_share": 0.3, "min_length_spread_group_share": 0.2}})

  Attributes:
    thresholds: ``min_<statistic>`` / ``max_<statistic>`` -> value.
    length_std_threshold: see :func:`headroom_statistics`.
    reward_atol: see :func:`headroom_statistics`.
  """

  thresholds: Mapping[str, float]
  length_std_threshold: float = 0.0
  reward_atol: float = 0.0

  def __post_init__(self):
    for key in self.thresholds:
      _parse_threshold(key)
    object.__setattr__(self, "thresholds", {k: float(v) for k, v in self.thresholds.items()})

  @classmethod
  def from_config(cls, config) -> HeadroomGate:
    """From a ``ConfigDict`` (or a plain mapping) with the fields above; unknown fields are an error."""
    fields = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown headroom gate fields {sorted(unknown)}; expected thresholds, "
                       "length_std_threshold, reward_atol")
    if "thresholds" not in fields:
      raise ValueError("the headroom gate config needs 'thresholds'")
    return cls(**fields)

  def check(self, rollout: HeadroomRollout,
            custom: Mapping[str, Callable[[HeadroomRollout], float]] | None = None,
            raise_on_failure: bool = True) -> HeadroomReport:
    """Statistics of ``rollout`` compared with the thresholds (raises :class:`HeadroomError` on failure)."""
    stats = headroom_statistics(rollout, length_std_threshold=self.length_std_threshold,
                                reward_atol=self.reward_atol, custom=custom)
    return check_headroom(stats, self.thresholds, raise_on_failure)
