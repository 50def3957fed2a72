r"""BudgetMix on text FrozenLake over seeds: base (SFT), full-budget and BudgetMix GRPO / GiGPO (PPO optional).

    python -m experiments.reproduce_budgetmix --workdir=runs/budgetmix --seeds=0,1,2,3,4 [--workers=2] \
        [--arms=base,grpo_full,grpo_budgetmix,gigpo_full,gigpo_budgetmix] \
        [--config=configs/budgetmix_frozenlake.py:cpu --config.multiturn_rl.steps=...]

Runs live in ``<workdir>/seed_<s>/<arm>``; every run resumes, and a finished arm's evaluation is re-read from its
``final_eval.json``. ``--workers=N`` runs N of them at a time, each in its own process.

1. ``base``, for every seed first: the config with ``multiturn_rl.steps = 0``: multi-turn SFT, then the step-0
   headroom gate on validation maps (:func:`headroom_report`: the base policy's Pass@K at every budget fraction,
   prompted, against ``config.headroom.thresholds``). If any seed's gate fails, the run stops with a message
   naming every failed statistic (the results file records it), before any RL is spent.
2. every RL arm (``<estimator>_<budget_mode>``) of every seed copies the seed's base run's
   ``checkpoints/multiturn_sft`` (the shared SFT of the seed; the runner then skips SFT) and runs
   ``multiturn_rl`` with that estimator and budget mode.
3. every arm (base included) is evaluated on the test maps of ``config.final_eval.splits`` (``test``: 4-6,
   ``test_8x8``) with :func:`lemon_rl.eval.budget_eval.evaluate_budgets`: Pass@1..K at 25/50/75/100% of
   ``T_max`` in the prompted and truncated modes, step quality against ``Q*``, recovery from an injected error at
   ``final_eval.recovery_fraction``. Once all arms of a seed are done, step quality is also summarised on the
   ``(map, state, remaining turns)`` keys every arm visited (matched states).

The results go to ``experiments/results/budgetmix/results.json`` (committed) after the base runs, as soon as a
seed's last arm is done (the seed is then ``finished``) and at the end, when ``experiments/RESULTS.md`` is
regenerated (section :mod:`experiments.reports.budgetmix`). Every finished arm's ``final_eval.json`` and step
tables also go to ``arms/`` beside the results file (:mod:`experiments.arm_store`, committed, about 25 kB an arm),
and a rerun restores them first: a run longer than a session goes on in the next one, on whichever machine (each
arm records its own). A seed whose remaining RL arms need the base's SFT checkpoint, which is not stored, re-runs
that SFT and checks that it evaluates exactly as the stored base run did.

Sizing loop: ``--headroom_only --arms=base --seeds=0 [--config.multiturn_sft.steps=...]`` runs only the base SFT
and the gate and prints its statistics. Pilot (2026-12-01, this 2-core CPU while another experiment kept it at a
load of ~10, ``nice -n 15``; ``tiny`` model preset d128 / 2 layers, the ``cpu`` config with 120 SFT steps of 16
demonstrations out of 1000, gate on 24 validation maps x 8 samples, engine context 1536): SFT 2.7 CPU-s a step
(5.4 CPU-min, 830 s wall), success rate after SFT 0.22 at the full budget and 0.06 at 25% (16 validation maps x
2 episodes); the base policy's Pass@8 (prompted) 0.125 / 0.625 / 0.708 / 0.708 at 25 / 50 / 75 / 100% of T_max,
every value inside the gate's [0.05, 0.95]; the gate's evaluation (4 runs of 192 episodes) 3.6 CPU-min. The
``cpu`` config keeps that SFT. Measured cost of the ``cpu`` config (2026-12-02, two runs at a time on the 2 cores):
a base run about 1,000 CPU-s (SFT 260 s wall, gate, test evaluation about 600 s wall), an RL arm about 2,000 CPU-s
(60 steps of 20-35 s wall, test evaluation about 700 s wall): about 2.5 CPU-hours per seed with four RL arms.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import shlex
import sys
import time
from typing import Any, Mapping, Sequence

from absl import app
from absl import flags
import numpy as np
from ml_collections import config_flags

from experiments import arm_store
from experiments import machine
from experiments import results_md
from experiments.reports import budgetmix as report
from lemon_rl.envs import frozenlake_task as flt
from lemon_rl.eval import budget_eval
from lemon_rl.eval.headroom import check_headroom, HeadroomReport
from lemon_rl.training import experiment
from lemon_rl.training import multiturn_phases
from lemon_rl.training.metrics import read_records

config_flags.DEFINE_config_file("config", "configs/budgetmix_frozenlake.py:cpu",
                                "The experiment config (every arm's; --config.a.b=value overrides).")
flags.DEFINE_string("workdir", None, "Root directory; one sub-directory per seed and arm (resumable).")
flags.DEFINE_string("seeds", "0,1,2,3,4", "Comma-separated seeds.")
flags.DEFINE_integer("workers", 1, "Runs at a time, each in its own process (the base runs, then the RL runs).")
flags.DEFINE_string("arms", "base,grpo_full,grpo_budgetmix,gigpo_full,gigpo_budgetmix",
                    "Comma-separated arms: base first, then <grpo|gigpo|ppo>_<full|budgetmix>.")
flags.DEFINE_string("results_file", report.RESULTS_FILE,
                    "Where the results JSON goes (absolute, or relative to the repository).")
flags.DEFINE_float("family_alpha", 0.05, "Familywise error rate of the claimed directions (Holm).")
flags.DEFINE_bool("headroom_only", False, "Sizing loop: per seed only the base SFT and the headroom gate (no test "
                  "evaluation, no RL); prints the gate's statistics and writes no results file.")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


# -- arms ----------------------------------------------------------------------------------------------------


def arm_config(config, arm: str, seed: int):
  """The config of ``arm`` (``base`` or ``<estimator>_<budget_mode>``) for ``seed``."""
  c = copy.deepcopy(config)
  c.seed = int(seed)
  if arm == "base":
    c.multiturn_rl.steps = 0
    return c
  estimator, _, mode = arm.partition("_")
  if estimator not in report.ESTIMATORS or mode not in ("full", "budgetmix"):
    raise ValueError(f"unknown arm {arm!r}; expected base or <grpo|gigpo|ppo>_<full|budgetmix>")
  c.multiturn_rl.estimator, c.multiturn_rl.budget_mode = estimator, mode
  return c


# -- evaluation records (JSON) -------------------------------------------------------------------------------


def _num(x: float) -> float | None:
  return None if x is None or math.isnan(float(x)) else float(x)


def evaluation_record(result: budget_eval.BudgetEvalResult) -> dict[str, Any]:
  """A :class:`~lemon_rl.eval.budget_eval.BudgetEvalResult` as JSON: Pass@1..K per mode and budget (mean over
  maps), step quality per run, recovery, and the full run's turns and status shares."""
  s = result.surface
  statuses = [e.status.value for row in result.full.episodes for e in row]
  out = {
      "num_maps": int(s.budgets.shape[0]), "num_samples": int(result.full.success.shape[1]),
      "pass": {m: {str(multiturn_phases.pct(f)): [float(v) for v in s.mean[i, j]] for j, f in enumerate(s.fractions)}
               for i, m in enumerate(s.modes)},
      "quality": {name: {k: _num(v) for k, v in q._asdict().items()} for name, q in result.quality.items()},
      "full_turns_mean": float(result.full.turns.mean()),
      "full_status": {v: statuses.count(v) / len(statuses) for v in sorted(set(statuses))},
  }
  if result.recovery is not None:
    r = result.recovery
    out["recovery"] = {"recovery": _num(r.recovery), "clean": _num(r.clean), "ratio": _num(r.ratio),
                       "num_maps": r.num_maps, "num_excluded_episodes": r.num_excluded_episodes}
  return out


def final_settings(config) -> budget_eval.BudgetEvalSettings:
  f = config.final_eval
  return multiturn_phases.eval_settings(config, num_samples=f.num_samples, max_k=f.max_k, fractions=f.fractions,
                                        temperature=f.temperature, seed=f.seed,
                                        recovery_fraction=f.recovery_fraction)


def split_maps(task, split: str):
  return [flt.record_map(r) for r in task.test_examples if r["split"] == split]


def final_evaluation(model, task, config, workdir: str) -> dict[str, Any]:
  """Every test split's :func:`evaluation_record`; the full runs' step tables go to ``<workdir>/steps_<split>.npz``
  (for the matched-state summary)."""
  settings = final_settings(config)
  out = {}
  for split in config.final_eval.splits:
    result = budget_eval.evaluate_budgets(model, task.tokenizer, split_maps(task, split), settings)
    out[split] = evaluation_record(result)
    np.savez_compressed(os.path.join(workdir, f"steps_{split}.npz"), **result.full.steps()._asdict())
  return out


def headroom_statistics(model, task, config) -> dict[str, float]:
  """The base policy's Pass@K (``config.headroom.max_k``) per budget fraction on validation maps (prompted), and
  the share of maps whose samples disagree at that budget (groups with signal for a group-relative method)."""
  h = config.headroom
  maps = [flt.record_map(r) for r in task.validation_examples[:h.num_maps]]
  settings = multiturn_phases.eval_settings(config, num_samples=h.num_samples, max_k=h.max_k, fractions=h.fractions,
                                            temperature=config.final_eval.temperature, seed=h.seed)
  result = budget_eval.evaluate_budgets(model, task.tokenizer, maps, settings)
  stats = {}
  for f in settings.fractions:
    stats[f"pass_at_{h.max_k}_{multiturn_phases.pct(f)}"] = result.surface.value("prompted", f, h.max_k)
  for f in settings.fractions:
    success = result.prompted[f].success
    stats[f"signal_share_{multiturn_phases.pct(f)}"] = float(np.mean(success.any(1) & ~success.all(1)))
  return stats


def headroom_report(model, task, config) -> HeadroomReport:
  """:func:`headroom_statistics` against ``config.headroom.thresholds`` (no exception: the caller decides)."""
  return check_headroom(headroom_statistics(model, task, config), dict(config.headroom.thresholds),
                        raise_on_failure=False)


def matched_quality(arm_dirs: Mapping[str, str], split: str) -> dict[str, dict[str, Any]]:
  """Step quality of each arm on the ``(map, state, h)`` keys that every arm's full-budget run visited."""
  tables = {}
  for arm, d in arm_dirs.items():
    with np.load(os.path.join(d, f"steps_{split}.npz")) as z:
      tables[arm] = budget_eval.StepTable(**{k: z[k] for k in z.files})
  keys = budget_eval.matched_keys(*tables.values())
  return {arm: {k: _num(v) for k, v in budget_eval.summarize_steps(t, keys)._asdict().items()}
          for arm, t in tables.items()}


# -- running -------------------------------------------------------------------------------------------------


class GateFailed(Exception):
  pass


def eval_records(workdir: str) -> list[dict[str, Any]]:
  """The run's held-out evaluations along the way (phase, step, success per budget, accuracy)."""
  return [{k: r[k] for k in r if k == "phase" or k == "step" or k.startswith("success_") or k == "accuracy"}
          for r in read_records(os.path.join(workdir, "metrics.jsonl")) if r["phase"].startswith("eval_")]


def run_arm(config, workdir: str, gate: bool, headroom_only: bool = False) -> dict[str, Any]:
  """Runs (or resumes) an arm and evaluates it; re-reads ``final_eval.json`` of a finished one. With ``gate`` the
  headroom gate runs first (a failure returns ``{"headroom", "stopped"}``); ``headroom_only`` stops after it."""
  path = os.path.join(workdir, "final_eval.json")
  if os.path.exists(path) and not headroom_only:
    with open(path) as f:
      return json.load(f)
  usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
  record: dict[str, Any] = {}

  def final_eval(model, task):
    if gate:
      h = headroom_report(model, task, config)
      record["headroom"] = h.to_dict()
      print("headroom gate:", "; ".join(str(c) for c in h.checks), flush=True)
      if not h.passed:
        raise GateFailed("step-0 headroom gate failed: " + "; ".join(str(c) for c in h.failures))
    if headroom_only:
      return {}
    t = time.time()
    out = final_evaluation(model, task, config, workdir)
    record["final_eval_s"] = time.time() - t
    return out

  try:
    summary = experiment.run(config, workdir, final_eval=final_eval)
  except GateFailed as e:
    record["stopped"] = f"{e}. Resize the task (config.task, multiturn_sft.steps) so that the base policy leaves " \
                        "headroom at every budget, then rerun."
    return record
  usage1 = resource.getrusage(resource.RUSAGE_SELF)
  if headroom_only:
    return dict(record, wall_s=time.time() - t0, user_s=usage1.ru_utime - usage0.ru_utime,
                phase_wall_s=summary["wall_time_s"])
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  record.update({
      "final": summary["final_eval"], "machine": machine.description(), "evals": eval_records(workdir),
      "train": [{k: r.get(k) for k in ("step", "episode/success_rate", "episode/reward_mean", "budget/mean",
                                         "episode/turns_mean")} for r in records if r["phase"] == "multiturn_rl"],
      "wall_s": time.time() - t0, "user_s": usage1.ru_utime - usage0.ru_utime,
      "system_s": usage1.ru_stime - usage0.ru_stime, "phase_wall_s": summary["wall_time_s"]})
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  return record


def setup_record(config) -> dict[str, Any]:
  task_cfg, f, rl = config.task, config.final_eval, config.multiturn_rl
  maps = flt.split_maps(task_cfg)
  return {"num_sft": task_cfg.num_sft, "num_train_maps": task_cfg.num_train, "sizes": list(task_cfg.sizes),
          "sft_steps": config.multiturn_sft.steps, "sft_batch": config.multiturn_sft.batch_size,
          "rl_steps": rl.steps, "maps_per_step": rl.maps_per_step, "group_size": rl.group_size,
          "learning_rate": rl.learning_rate, "model": dict(config.model.overrides), "splits": list(f.splits),
          "num_maps": {s: len(maps[s]) for s in f.splits}, "num_samples": f.num_samples, "max_k": f.max_k,
          "fractions": list(f.fractions), "recovery_fraction": f.recovery_fraction, "temperature": f.temperature}


def arm_dir(seed: int, arm: str) -> str:
  return os.path.join(FLAGS.workdir, f"seed_{seed}", arm)


def finish_seed(entry: dict[str, Any], arms: Sequence[str], splits: Sequence[str]) -> bool:
  """Once every arm of the seed is evaluated: step quality on the states every arm visited, the machines the arms
  ran on, and ``finished``."""
  if entry.get("finished") or any(arm not in entry["arms"] for arm in arms):
    return False
  for split in splits:
    for arm, q in matched_quality({arm: arm_dir(entry["seed"], arm) for arm in arms}, split).items():
      entry["arms"][arm]["final"][split]["matched_quality"] = {"full": q}
  entry["arms"] = {arm: entry["arms"][arm] for arm in arms}  # In the table's order, whatever finished first.
  entry["machine"] = machine.of_records(entry["arms"].values())
  entry["finished"] = True
  return True


def main(argv):
  del argv
  config = FLAGS.config
  seeds = [int(s) for s in FLAGS.seeds.split(",")]
  arms = [a for a in FLAGS.arms.split(",") if a]
  if not arms or arms[0] != "base":
    raise app.UsageError("--arms must start with base (the shared SFT and the headroom gate)")
  for arm in arms:
    arm_config(config, arm, 0)  # Validates the names before anything runs.
  setup = setup_record(config)
  saved = {"command": "python -m experiments.reproduce_budgetmix " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
           "machine": machine.description(), "family_alpha": FLAGS.family_alpha, "setup": setup, "arms": arms,
           "seeds": [{"seed": s, "arms": {}} for s in seeds]}
  entries = {entry["seed"]: entry for entry in saved["seeds"]}
  store_dir = arm_store.beside(FLAGS.results_file)
  files = ["final_eval.json", *[f"steps_{split}.npz" for split in config.final_eval.splits]]
  if not FLAGS.headroom_only:
    restored = arm_store.restore(store_dir, setup, [(s, arm) for s in seeds for arm in arms], arm_dir, files)
    print(f"{len(restored)} finished arms restored from {store_dir}", flush=True)

  bases = machine.run_parallel(run_arm, [(arm_config(config, "base", s), arm_dir(s, "base"), True,
                                          FLAGS.headroom_only) for s in seeds], FLAGS.workers)
  for s, record in zip(seeds, bases):
    entries[s]["headroom"] = record.pop("headroom")
    if FLAGS.headroom_only:
      timing = {k: record.get(k) for k in ("wall_s", "user_s", "phase_wall_s")}
      print(f"seed {s}:", json.dumps({**entries[s]["headroom"]["statistics"],
                                      "passed": entries[s]["headroom"]["passed"], **timing}))
  if FLAGS.headroom_only:
    return
  stopped = [f"seed {s}: {record['stopped']}" for s, record in zip(seeds, bases) if "stopped" in record]
  if stopped:
    saved["stopped"] = " ".join(stopped)
    results_md.save_results(saved, FLAGS.results_file)
    sys.exit(saved["stopped"])
  for s, record in zip(seeds, bases):
    arm_store.store(store_dir, s, "base", arm_dir(s, "base"), files)
    entries[s]["arms"]["base"] = record
    finish_seed(entries[s], arms, config.final_eval.splits)
  results_md.save_results(saved, FLAGS.results_file)

  runs = [(s, arm) for s in seeds for arm in arms[1:]]
  arm_store.start_arms([(arm_config(config, "base", s), arm_dir(s, "base"), entries[s]["arms"]["base"]["evals"],
                         arm_dir(s, arm)) for s, arm in runs
                        if not os.path.exists(os.path.join(arm_dir(s, arm), "final_eval.json"))],
                       "multiturn_sft", eval_records, FLAGS.workers)

  def store_arm(i: int, record: dict[str, Any]):
    seed, arm = runs[i]
    arm_store.store(store_dir, seed, arm, arm_dir(seed, arm), files)  # A stopped run goes on from here.
    entries[seed]["arms"][arm] = record
    if finish_seed(entries[seed], arms, config.final_eval.splits):
      results_md.save_results(saved, FLAGS.results_file)

  machine.run_parallel(run_arm, [(arm_config(config, arm, s), arm_dir(s, arm), False) for s, arm in runs],
                       FLAGS.workers, on_result=store_arm)
  results_md.plot_beside(saved, FLAGS.results_file, report)
  print(results_md.write_results(saved, FLAGS.results_file, report))


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()  # The launcher's malloc settings (lemon_rl/utils/allocator.py).
  app.run(main)
