"""The step-0 headroom gate: statistics by hand, thresholds, the error that names what failed."""

import json

import ml_collections
import numpy as np
import pytest

from lemon_rl.eval import headroom

# Groups 7, 3, 5 (ids unsorted, not contiguous) and a group of one (9); statistics are over groups in sorted
# id order 3, 5, 7, 9.
GROUPS = [7, 3, 7, 3, 5, 7, 3, 5, 9]
REWARDS = [1.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.5, 1.0]  # Only group 7 varies.
LENGTHS = [10, 5, 20, 5, 40, 30, 7, 44, 12]
# Unbiased group stds. Rewards: group 7 = [1, 0, 1]: mean 2/3, squares 1/9 + 4/9 + 1/9 = 2/3, / 2 -> sqrt(1/3).
# Lengths: group 3 = [5, 5, 7]: squares 4/9 + 4/9 + 16/9 = 8/3, / 2 -> sqrt(4/3); group 5 = [40, 44]: sqrt(8);
# group 7 = [10, 20, 30]: 10; group 9 (one row): 0.
REWARD_STD = [0.0, 0.0, np.sqrt(1 / 3), 0.0]
LENGTH_STD = [np.sqrt(4 / 3), np.sqrt(8.0), 10.0, 0.0]


def _rollout(**extra):
  return headroom.HeadroomRollout(REWARDS, GROUPS, LENGTHS, extra)


def test_group_std_and_varies_by_hand():
  np.testing.assert_allclose(headroom.group_std(REWARDS, GROUPS), REWARD_STD, rtol=1e-12)
  np.testing.assert_allclose(headroom.group_std(LENGTHS, GROUPS), LENGTH_STD, rtol=1e-12)
  assert headroom.group_varies(REWARDS, GROUPS).tolist() == [False, False, True, False]
  assert headroom.group_varies(LENGTHS, GROUPS, atol=4.0).tolist() == [False, False, True, False]
  with pytest.raises(ValueError, match="same length"):
    headroom.group_std([1.0, 2.0], [0, 0, 1])


def test_statistics_by_hand():
  s = headroom.headroom_statistics(_rollout(), length_std_threshold=2.0)
  assert s["num_groups"] == 4
  assert s["signal_group_share"] == pytest.approx(1 / 4)
  assert s["mean_group_reward_std"] == pytest.approx(np.sqrt(1 / 3) / 4, rel=1e-12)
  assert s["mean_group_length_std"] == pytest.approx(np.mean(LENGTH_STD), rel=1e-12)
  assert s["length_spread_group_share"] == pytest.approx(2 / 4)  # sqrt(8) and 10 exceed 2; sqrt(4/3), 0 do not.
  # Strictly greater: a group exactly at the threshold does not count.
  assert headroom.headroom_statistics(_rollout(), length_std_threshold=10.0)["length_spread_group_share"] == 0.0
  # A reward tolerance larger than group 7's spread removes its signal.
  assert headroom.headroom_statistics(_rollout(), reward_atol=1.0)["signal_group_share"] == 0.0


def test_custom_statistic_on_extra_arrays_and_a_subset():
  # "R_tool varies but exact match does not": group 3 (tool varies, exact constant) only.
  r_tool = [0.5, 0.2, 0.5, 0.6, 0.3, 0.5, 0.2, 0.3, 1.0]
  exact = [1, 0, 0, 0, 0, 1, 0, 0, 1]
  easy = [True, False, True, False, True, True, False, True, False]  # Groups 7 and 5.

  def tool_only(ro):
    return float(np.mean(headroom.group_varies(ro.extra["r_tool"], ro.group_ids)
                         & ~headroom.group_varies(ro.extra["exact"], ro.group_ids)))

  def easy_length_spread(ro):
    return headroom.headroom_statistics(ro.subset(ro.extra["easy"]),
                                        length_std_threshold=5.0)["length_spread_group_share"]

  s = headroom.headroom_statistics(_rollout(r_tool=r_tool, exact=exact, easy=easy),
                                   custom={"tool_only_share": tool_only, "easy_length_spread": easy_length_spread})
  assert s["tool_only_share"] == pytest.approx(1 / 4)
  assert s["easy_length_spread"] == pytest.approx(1 / 2)  # Group 7 (std 10) > 5, group 5 (sqrt 8) not.
  with pytest.raises(ValueError, match="shadows"):
    headroom.headroom_statistics(_rollout(), custom={"num_groups": lambda ro: 0.0})


def test_rollout_validation_and_empty_subset():
  with pytest.raises(ValueError, match="same length"):
    headroom.HeadroomRollout([1.0, 0.0], [0, 0], [3, 4], {"tag": [1, 2, 3]})
  empty = _rollout().subset(np.zeros(len(GROUPS), bool))
  s = headroom.headroom_statistics(empty)
  assert s["num_groups"] == 0 and np.isnan(s["signal_group_share"])


def test_check_passes_and_reports():
  s = headroom.headroom_statistics(_rollout(), length_std_threshold=2.0)
  report = headroom.check_headroom(s, {"min_signal_group_share": 0.25, "max_mean_group_reward_std": 0.5})
  assert report.passed and report.failures == ()
  assert json.loads(json.dumps(report.to_dict()))["checks"][0] == {
      "statistic": "signal_group_share", "bound": "min", "threshold": 0.25, "value": 0.25, "passed": True}


def test_failure_names_each_failed_statistic_value_and_threshold():
  s = headroom.headroom_statistics(_rollout(), length_std_threshold=2.0)
  thresholds = {"min_signal_group_share": 0.3, "min_length_spread_group_share": 0.5,
                "max_mean_group_length_std": 3.0}
  with pytest.raises(headroom.HeadroomError) as err:
    headroom.check_headroom(s, thresholds)
  message = str(err.value)
  assert "signal_group_share = 0.25 (needs >= 0.3): FAILED" in message
  assert f"mean_group_length_std = {np.mean(LENGTH_STD):.4g} (needs <= 3): FAILED" in message
  assert "length_spread_group_share" not in message  # 0.5 >= 0.5 passes.
  assert [c.statistic for c in err.value.report.failures] == ["signal_group_share", "mean_group_length_std"]
  report = headroom.check_headroom(s, thresholds, raise_on_failure=False)
  assert not report.passed and len(report.failures) == 2


def test_nan_statistic_fails_and_bad_thresholds_are_errors():
  with pytest.raises(headroom.HeadroomError, match="signal_group_share = nan"):
    headroom.check_headroom({"signal_group_share": float("nan")}, {"min_signal_group_share": 0.0})
  with pytest.raises(ValueError, match="unknown statistic 'signal_share'"):
    headroom.check_headroom({"signal_group_share": 0.5}, {"min_signal_share": 0.3})
  with pytest.raises(ValueError, match="min_<statistic> or max_<statistic>"):
    headroom.check_headroom({"signal_group_share": 0.5}, {"signal_group_share": 0.3})


def test_gate_from_config_dict():
  config = ml_collections.ConfigDict({"length_std_threshold": 2.0, "thresholds": {
      "min_signal_group_share": 0.2, "min_length_spread_group_share": 0.5}})
  gate = headroom.HeadroomGate.from_config(config)
  assert gate.check(_rollout()).passed
  strict = headroom.HeadroomGate.from_config({"length_std_threshold": 9.0, "thresholds": {
      "min_length_spread_group_share": 0.5}})
  with pytest.raises(headroom.HeadroomError, match="length_spread_group_share = 0.25"):
    strict.check(_rollout())
  with pytest.raises(ValueError, match="unknown headroom gate fields"):
    headroom.HeadroomGate.from_config({"thresholds": {}, "min_signal_group_share": 0.3})
  with pytest.raises(ValueError, match="min_<statistic>"):
    headroom.HeadroomGate({"signal_group_share": 0.3})
