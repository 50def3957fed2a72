"""experiments.arm_store: finished arms restored into a new run directory, never mixed across setups."""

import json
import os

import pytest

from experiments import arm_store

FILES = ["record.json", "steps.npz"]


def _finished_run(directory, value):
  os.makedirs(directory, exist_ok=True)
  for name in FILES:
    with open(os.path.join(directory, name), "w") as f:
      f.write(f"{name} {value}")


def _read(directory):
  return {name: open(os.path.join(directory, name)).read() for name in FILES if os.path.exists(
      os.path.join(directory, name))}


def test_stored_arms_are_restored_into_new_run_directories_and_only_whole(tmp_path):
  store, setup = str(tmp_path / "arms"), {"steps": 3, "fractions": (0.25, 1.0)}
  first = lambda seed, arm: str(tmp_path / "first" / f"{seed}_{arm}")
  again = lambda seed, arm: str(tmp_path / "again" / f"{seed}_{arm}")
  runs = [(0, "base"), (0, "grpo"), (1, "base")]
  assert arm_store.restore(store, setup, runs, first, FILES) == []  # An empty store: it records the setup.
  for i, (seed, arm) in enumerate(runs):
    _finished_run(first(seed, arm), i)
    arm_store.store(store, seed, arm, first(seed, arm), FILES)
  os.remove(os.path.join(store, "seed_1", "base", "steps.npz"))  # An interrupted copy is not a stored arm.
  _finished_run(again(0, "grpo"), "here")  # A run directory's own files are kept.
  assert arm_store.restore(store, setup, runs + [(2, "base")], again, FILES) == [(0, "base"), (0, "grpo")]
  assert _read(again(0, "base")) == _read(first(0, "base"))
  assert _read(again(0, "grpo")) == {name: f"{name} here" for name in FILES}
  assert not os.path.exists(again(1, "base"))


def test_a_store_of_another_setup_is_an_error_naming_the_fields(tmp_path):
  store = str(tmp_path / "arms")
  arm_store.check_setup(store, {"steps": 3, "lr": 1e-4, "fractions": (0.25, 1.0)})
  arm_store.check_setup(store, {"steps": 3, "lr": 1e-4, "fractions": [0.25, 1.0]})  # The same, as JSON.
  with pytest.raises(ValueError, match=r"another setup \(lr: stored 0.0001, now 0.001; steps: stored 3, now None\)"):
    arm_store.check_setup(store, {"lr": 1e-3, "fractions": [0.25, 1.0]})
  with open(os.path.join(store, arm_store.SETUP)) as f:
    assert json.load(f) == {"steps": 3, "lr": 1e-4, "fractions": [0.25, 1.0]}
