"""Validation-only hyper-parameter choice with equal effort per arm, recorded as JSON."""

import json

import pytest

from lemon_rl.eval import tuning

TRIALS = {
    "grpo": [{"params": {"lr": 1e-4}, "score": 0.40}, {"params": {"lr": 3e-4}, "score": 0.55},
             {"params": {"lr": 1e-3}, "score": 0.55}],  # Tie with the 3e-4 trial: the first one wins.
    "cast": [tuning.Trial({"lr": 1e-4}, 0.61), tuning.Trial({"lr": 3e-4}, None),  # Diverged: counted, never chosen.
             tuning.Trial({"lr": 1e-3}, 0.30)],
}


def test_best_validation_trial_per_arm_ties_to_the_first():
  choice = tuning.choose_per_arm(TRIALS)
  assert (choice["grpo"].index, choice["grpo"].params, choice["grpo"].score) == (1, {"lr": 3e-4}, 0.55)
  assert (choice["cast"].index, choice["cast"].params) == (0, {"lr": 1e-4})


def test_lower_is_better_picks_the_minimum():
  choice = tuning.choose_per_arm(TRIALS, higher_is_better=False)
  assert choice["grpo"].index == 0 and choice["cast"].index == 2


def test_unequal_effort_is_an_error():
  uneven = {**TRIALS, "cast": TRIALS["cast"][:2]}
  with pytest.raises(ValueError, match=r"same \(non-zero\) number of trials, got \{'grpo': 3, 'cast': 2\}"):
    tuning.choose_per_arm(uneven)
  with pytest.raises(ValueError, match="same"):
    tuning.choose_per_arm({"a": [], "b": []})
  with pytest.raises(ValueError, match="no arms"):
    tuning.choose_per_arm({})


def test_an_arm_without_a_score_is_an_error():
  with pytest.raises(ValueError, match="arm 'a' has no trial with a validation score"):
    tuning.choose_per_arm({"a": [tuning.Trial({}, float("nan"))]})
  with pytest.raises(TypeError, match="a trial is"):
    tuning.choose_per_arm({"a": [({"lr": 1}, 0.5)]})


@pytest.mark.parametrize("split", ["test", "Test", "hard_test", "test-shifted", ""])
def test_test_splits_are_refused(tmp_path, split):
  with pytest.raises(ValueError, match="validation split"):
    tuning.record_choice(str(tmp_path / "choice.json"), TRIALS, split=split, metric="accuracy")
  assert not (tmp_path / "choice.json").exists()


def test_record_and_load_round_trip(tmp_path):
  path = tmp_path / "sub" / "choice.json"
  record = tuning.record_choice(str(path), TRIALS, split="validation", metric="validation accuracy")
  raw = json.loads(path.read_text())
  assert raw["split"] == "validation" and raw["trials_per_arm"] == 3 and raw["higher_is_better"] is True
  assert raw["tie_break"] == tuning.TIE_BREAK
  assert [t["score"] for t in raw["arms"]["cast"]["trials"]] == [0.61, None, 0.30]
  assert [t["params"] for t in raw["arms"]["grpo"]["trials"]] == [{"lr": 1e-4}, {"lr": 3e-4}, {"lr": 1e-3}]
  assert raw["arms"]["grpo"]["chosen_index"] == 1 and raw["arms"]["grpo"]["chosen_params"] == {"lr": 3e-4}
  loaded = tuning.load_choice(str(path))
  assert loaded == record
  assert loaded.params("cast") == {"lr": 1e-4} and loaded.split == "validation"
  with pytest.raises(KeyError, match="no recorded choice for arm 'ppo'"):
    loaded.params("ppo")
  assert tuning.record_choice(str(tmp_path / "latest.json"), TRIALS, split="latest_val", metric="acc").split \
      == "latest_val"  # "test" inside a word is not a test token.


def test_load_rejects_an_edited_record(tmp_path):
  path = tmp_path / "choice.json"
  tuning.record_choice(str(path), TRIALS, split="validation", metric="accuracy")
  raw = json.loads(path.read_text())
  raw["arms"]["grpo"]["chosen_index"] = 2
  raw["arms"]["grpo"]["chosen_params"] = {"lr": 1e-3}
  path.write_text(json.dumps(raw))
  with pytest.raises(ValueError, match="not its best validation trial"):
    tuning.load_choice(str(path))
  raw = json.loads(json.dumps(raw).replace('"validation"', '"test"'))
  path.write_text(json.dumps(raw))
  with pytest.raises(ValueError, match="validation split"):
    tuning.load_choice(str(path))
