r"""Finished arms, committed next to a reproduction's results file, so that a run longer than a session goes on
in the next session, on whichever machine.

    <store>/setup.json               the setup every stored arm ran with
    <store>/seed_<s>/<arm>/<file>    the files that make the arm finished in its run directory

Before it runs anything, a reproduction copies the stored files of each (seed, arm) it will run into the run's
directory (:func:`restore`), so the run reads them back as finished; it stores an arm's files as soon as the arm
is done (:func:`store`). A store written with another setup is an error naming the differing fields: the arms
of two setups never mix. Checkpoints are not stored: an arm that starts from a stored run's checkpoint gets it
re-created by :func:`recreate` (through :func:`start_arms`), which checks that the re-run evaluates exactly as
the stored one did.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Mapping, Sequence

from experiments import machine
from experiments import results_md
from lemon_rl.training import experiment

SETUP = "setup.json"


def beside(results_file: str) -> str:
  """The store of a reproduction: ``arms/`` next to its results file."""
  return os.path.join(os.path.dirname(results_md.absolute(results_file)), "arms")


def _arm_dir(store_dir: str, seed: int, arm: str) -> str:
  return os.path.join(store_dir, f"seed_{seed}", arm)


def check_setup(store_dir: str, setup: Mapping[str, Any]) -> None:
  """``ValueError`` naming each field whose stored value differs from ``setup``; writes it into an empty store."""
  path = os.path.join(store_dir, SETUP)
  if not os.path.exists(path):
    os.makedirs(store_dir, exist_ok=True)
    with open(path, "w") as f:
      json.dump(setup, f, indent=1, sort_keys=True)
    return
  with open(path) as f:
    stored = json.load(f)
  setup = json.loads(json.dumps(setup))  # As JSON reads it back (tuples become lists).
  differing = [f"{k}: stored {stored.get(k)!r}, now {setup.get(k)!r}" for k in sorted({*stored, *setup})
               if stored.get(k) != setup.get(k)]
  if differing:
    raise ValueError(f"the arms stored in {store_dir} ran with another setup ({'; '.join(differing)}): delete the "
                     "store to start over, or write the results elsewhere (--results_file)")


def restore(store_dir: str, setup: Mapping[str, Any], runs: Sequence[tuple[int, str]],
            run_dir: Callable[[int, str], str], files: Sequence[str]) -> list[tuple[int, str]]:
  """Copies every stored file of ``runs`` (``(seed, arm)`` pairs) into ``run_dir(seed, arm)`` where that file is
  missing; returns the runs that were stored. :func:`check_setup` first."""
  check_setup(store_dir, setup)
  restored = []
  for seed, arm in runs:
    src = _arm_dir(store_dir, seed, arm)
    if not all(os.path.exists(os.path.join(src, name)) for name in files):
      continue
    os.makedirs(run_dir(seed, arm), exist_ok=True)
    for name in files:
      if not os.path.exists(os.path.join(run_dir(seed, arm), name)):
        shutil.copyfile(os.path.join(src, name), os.path.join(run_dir(seed, arm), name))
    restored.append((seed, arm))
  return restored


def store(store_dir: str, seed: int, arm: str, run_dir: str, files: Sequence[str]) -> None:
  """Copies the finished arm's ``files`` from its ``run_dir`` into the store, unless it is stored already (a
restored arm is not copied back). :func:`restore` takes an arm only with every file, so an interrupted copy is
never taken for a stored arm."""
  dst = _arm_dir(store_dir, seed, arm)
  if all(os.path.exists(os.path.join(dst, name)) for name in files):
    return
  os.makedirs(dst, exist_ok=True)
  for name in files:
    shutil.copyfile(os.path.join(run_dir, name), os.path.join(dst, name))


def recreate(config, workdir: str, evals_of: Callable[[str], Any], stored_evals: Any) -> None:
  """Re-runs a restored run without its final evaluation, for its checkpoints, and checks that its evaluations
  along the way (``evals_of(workdir)``) equal the stored run's: the arms started from it then start from the
  policy the stored arms started from (``RuntimeError`` otherwise, e.g. on a machine whose kernels round
  differently)."""
  experiment.run(config, workdir)
  evals = evals_of(workdir)
  if json.dumps(evals) != json.dumps(stored_evals):  # As JSON: NaN equals NaN, tuples equal lists.
    raise RuntimeError(f"{workdir}: re-run on this machine, it evaluates to {evals}; the stored run to "
                       f"{stored_evals}. The arms stored from it started from another policy: delete them from the "
                       "store and rerun them")


def start_arms(starts: Sequence[tuple[Any, str, Any, str]], phase: str, evals_of: Callable[[str], Any],
               workers: int) -> None:
  """Starts each unfinished arm from a copy of its source run's ``phase`` checkpoints
  (:func:`lemon_rl.training.experiment.start_from`). ``starts`` holds ``(source config, source dir, source's
  stored evaluations, arm dir)``; a source without those checkpoints (restored from the store) is re-created
  first, once, by :func:`recreate`, ``workers`` at a time."""
  missing = {src: (config, src, evals_of, evals) for config, src, evals, _ in starts
             if not os.path.isdir(os.path.join(src, "checkpoints", phase))}
  machine.run_parallel(recreate, list(missing.values()), workers)
  for _, src, _, dst in starts:
    experiment.start_from(src, dst, phase)
