r"""Reproduces the CAST experiment (issue 10's discipline); writes experiments/results/cast/.

    python -m experiments.reproduce_cast --seeds=0,1,2,3,4 --sft-group=2 --learning_rates=3e-5,1e-4 \
        [--root=/tmp/cast_repro] [--variants=grpo,cast,...] [--workers=2] [--set=rl.steps=20 ...]

1. **SFT** (``sft_only`` variant of ``configs/cast_tool_use.py``) in ``<root>/seed<s>/sft_only``: once per seed,
   or, with ``--sft-group=N``, once per N consecutive seeds (with the first one's seed) and shared by them (those
   seeds then differ in RL sampling, data order and the case library only; the section says so).
2. **Step-0 headroom gate** on every SFT policy (``config.headroom``, fixed before the run):
   ``rl.num_generations`` samples of each of the first ``headroom.num_prompts`` validation queries,
   statistics of :func:`lemon_rl.envs.tool_use_task.gate_statistics`. A failed gate stops the script before
   any RL run.
3. **Tuning on validation**: on the first seed every RL variant runs once per ``--learning_rates`` value (the
   same trials for every variant); the learning rate with the best greedy validation exact match is chosen
   per variant and recorded with :mod:`lemon_rl.eval.tuning` (``<root>/tuning.json``).
4. **The other seeds** at the chosen learning rates.

Each RL run starts from a copy of its seed's SFT checkpoint in ``<root>/seed<s>/<variant>_lr<lr>`` (the runner
restores it and skips SFT). The case library depends only on the SFT parameters and the seed, so a ``cast*``
run reuses a finished sibling's ``cases/cases.jsonl``. A finished run (``summary.json``) is read back, an
interrupted one resumes; ``--workers=2`` runs two RL runs at a time in separate processes. The collected runs
go to ``experiments/results/cast/results.json`` (committed), the plots next to it, and
``experiments/RESULTS.md`` is regenerated (:mod:`experiments.results_md`; the section is rendered by
:mod:`experiments.reports.cast`: the gate, the tuning table, held-out metrics as mean +- 95% t-interval over the
seeds, and the paper's directions with Holm-corrected paired intervals).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import sys
import time
from typing import Any, Sequence

import numpy as np

from experiments import machine
from experiments import results_md
from experiments.reports import cast as report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "cast_tool_use.py")
RL_VARIANTS = ("grpo", "cast", "cast_no_budget", "cast_no_schema", "cast_hard_to_easy")
TUNING_SPLIT, TUNING_METRIC = "validation", "validation/accuracy"


# ---------------------------------------------------------------------------------------------------------
# Running.


def load_config(variant: str, seed: int, overrides: Sequence[str], size: str = ""):
  """The variant's config (at ``size``, e.g. ``"tiny"``) with ``seed`` and ``key=value`` overrides (values
  parsed as Python/JSON literals)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("cast_tool_use_config", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(f"{variant},{size}" if size else variant)
  config.seed = seed
  for item in overrides:
    key, _, raw = item.partition("=")
    try:
      value = json.loads(raw)
    except json.JSONDecodeError:
      value = raw
    section = config
    *parents, leaf = key.split(".")
    for p in parents:
      section = section[p]
    section[leaf] = type(section[leaf])(value) if section[leaf] is not None else value
  return config


def validation_scores(model, task, config) -> dict[str, float]:
  """Greedy exact match and think length on the first ``eval.num_examples`` validation queries (tuning)."""
  from lemon_rl.eval.generation import evaluate  # pylint: disable=g-import-not-at-top
  metrics, _ = evaluate(model, task.tokenizer, task.validation_examples[:config.eval.num_examples], task.eval_reward,
                        task.max_new_tokens, batch_size=config.eval.batch_size)
  return {TUNING_METRIC: float(metrics["accuracy"]), "validation/think_len": float(metrics["think_len"])}


def headroom_gate(config):
  """``config.headroom`` as a :class:`lemon_rl.eval.headroom.HeadroomGate` (``num_prompts`` is the sample size)."""
  from lemon_rl.eval import headroom  # pylint: disable=g-import-not-at-top
  fields = config.headroom.to_dict()
  fields.pop("num_prompts")
  return headroom.HeadroomGate.from_config(fields)


def gate_scores(model, task, config) -> dict[str, float]:
  """The gate's statistics of the policy (``config.headroom``; :func:`tool_use_task.gate_statistics`)."""
  from lemon_rl.envs import tool_use_task as tut  # pylint: disable=g-import-not-at-top
  rollout = tut.headroom_rollout(model, task.tokenizer, task.validation_examples[:config.headroom.num_prompts],
                                 config.rl.num_generations, task.max_new_tokens, seed=10_000 + config.seed,
                                 temperature=config.task.cast.temperature,
                                 batch_size=config.task.cast.rollout_batch_size)
  gate_ = headroom_gate(config)
  return tut.gate_statistics(rollout, gate_.length_std_threshold, gate_.reward_atol)


FINAL_EVALS = {"validation": validation_scores, "gate": gate_scores}


def run_variant(variant: str, seed: int, workdir: str, overrides: Sequence[str],
                final_eval: str | None = None, size: str = "") -> dict[str, Any]:
  """Runs (or resumes, or reads back when finished) one variant; returns its summary.

  ``final_eval``: a name in :data:`FINAL_EVALS`, scoring the final policy into ``summary["final_eval"]``.
  """
  from lemon_rl.training import experiment  # pylint: disable=g-import-not-at-top
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      return json.load(f)
  print(f"=== seed {seed}: {variant} {' '.join(overrides)} -> {workdir}", flush=True)
  t0 = time.time()
  config = load_config(variant, seed, overrides, size)
  score = None if final_eval is None else (lambda model, task: FINAL_EVALS[final_eval](model, task, config))
  summary = experiment.run(config, workdir, final_eval=score)
  summary["process_wall_s"] = round(time.time() - t0, 1)
  with open(summary_path, "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def reseed_sft_checkpoint(directory: str, seed: int) -> None:
  """Marks a copied, finished SFT checkpoint as taken with ``seed``'s data iterator.

  The runner restores the SFT phase (and skips it, being finished) with an iterator seeded by
  ``config.seed``, which refuses a saved position of another seed; the position of a finished phase is
  never used again, so only the recorded seed changes.
  """
  for step in os.listdir(directory):
    path = os.path.join(directory, step, "metadata", "metadata")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      meta = json.load(f)
    meta["metadata"]["data"]["seed"] = seed
    with open(path, "w") as f:
      json.dump(meta, f)


def sft_seeds_of(seeds: Sequence[int], group: int) -> dict[int, int]:
  """``{seed: seed of its SFT run}``: consecutive groups of ``group >= 1`` seeds share the first one's SFT run."""
  return {seed: seeds[i - i % group] for i, seed in enumerate(seeds)}


def sft_dir(root: str, sft_seed: int) -> str:
  return os.path.join(root, f"seed{sft_seed}", "sft_only")


def run_dir(root: str, seed: int, variant: str, lr: float) -> str:
  return os.path.join(root, f"seed{seed}", f"{variant}_lr{lr:g}")


def start_from_sft(workdir: str, root: str, seed: int, sft_seed: int) -> None:
  """Copies the finished SFT checkpoint of ``sft_seed`` into ``workdir`` (re-marked for ``seed`` if they differ)."""
  from lemon_rl.training import experiment  # pylint: disable=g-import-not-at-top
  if experiment.start_from(sft_dir(root, sft_seed), workdir, "sft") and sft_seed != seed:
    reseed_sft_checkpoint(os.path.join(workdir, "checkpoints", "sft"), seed)


def run_rl(variant: str, seed: int, lr: float, sft_seed: int, root: str, overrides: Sequence[str],
           size: str = "") -> dict[str, Any]:
  """One RL run from the SFT policy of ``sft_seed`` at learning rate ``lr``, scored on validation at its end."""
  workdir = run_dir(root, seed, variant, lr)
  start_from_sft(workdir, root, seed, sft_seed)
  cases = os.path.join(workdir, "cases", "cases.jsonl")
  done = sorted(glob.glob(os.path.join(root, f"seed{seed}", "cast*", "cases", "cases.jsonl")))
  if variant.startswith("cast") and done and not os.path.exists(cases):
    os.makedirs(os.path.dirname(cases), exist_ok=True)
    shutil.copyfile(done[0], cases)
  return run_variant(variant, seed, workdir, [*overrides, f"rl.learning_rate={lr!r}"], "validation", size)


def gate(root: str, sft_seed: int, overrides: Sequence[str], size: str = ""):
  """The step-0 gate on the SFT policy of ``sft_seed`` (a run with no RL steps in ``<root>/seed<s>/gate``)."""
  from lemon_rl.eval import headroom  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(root, f"seed{sft_seed}", "gate")
  start_from_sft(workdir, root, sft_seed, sft_seed)
  summary = run_variant("sft_only", sft_seed, workdir, overrides, "gate", size)
  thresholds = headroom_gate(load_config("cast", sft_seed, overrides, size)).thresholds
  return headroom.check_headroom(summary["final_eval"], thresholds, raise_on_failure=False)


# ---------------------------------------------------------------------------------------------------------
# Collecting.


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def final_eval(workdir: str, phase: str) -> dict[str, Any]:
  evals = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r["phase"] == f"eval_{phase}"]
  return evals[-1] if evals else {}


def _rows() -> dict[str, list[Any]]:
  return {"final": [], "seeds": [], "summary": [], "eval_curves": [], "train_curves": [], "profile": []}


def collect(root: str, chosen: dict[str, float], sft_seeds: dict[int, int]) -> dict[str, Any]:
  """``{variant: {"final": [per-seed final test eval], "seeds", "summary", "eval_curves", "train_curves",
  "profile"}}`` for ``sft_only`` and every variant of ``chosen`` (at its chosen learning rate), over the seeds
  of ``sft_seeds`` (``{seed: seed of its SFT run}``).

  The ``sft_only`` row holds the SFT policy's final test evaluation (greedy, so equal to the RL runs' step 0),
  once per SFT run.
  """
  out: dict[str, Any] = {"sft_only": _rows()}
  for s in sorted(set(sft_seeds.values())):
    workdir = sft_dir(root, s)
    if os.path.exists(os.path.join(workdir, "summary.json")):
      out["sft_only"]["final"].append(final_eval(workdir, "sft"))
      out["sft_only"]["seeds"].append(s)
      with open(os.path.join(workdir, "summary.json")) as f:
        out["sft_only"]["summary"].append(json.load(f))
  for variant, lr in chosen.items():
    rows = _rows()
    for seed in sft_seeds:
      workdir = run_dir(root, seed, variant, lr)
      if not os.path.exists(os.path.join(workdir, "summary.json")):
        continue
      records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
      rows["final"].append(final_eval(workdir, "rl"))
      rows["seeds"].append(seed)
      with open(os.path.join(workdir, "summary.json")) as f:
        rows["summary"].append(json.load(f))
      rows["eval_curves"].append([r for r in records if r["phase"] == "eval_rl"])
      rows["train_curves"].append([r for r in records if r["phase"] == "rl"])
      profile = os.path.join(workdir, "cases", "profile.json")
      if os.path.exists(profile):
        with open(profile) as f:
          d = json.load(f)
        hardness = list(d["complexity"]["hardness"].values())
        rows["profile"].append({**d["meta"], "frac_hardest": float(np.mean([h >= 1.0 for h in hardness]))})
    out[variant] = rows
  return out


def setup_facts(seeds: Sequence[int], lrs: Sequence[float], overrides: Sequence[str], sft_seeds: dict[int, int],
                size: str = "") -> dict[str, Any]:
  """The config facts the section states (saved with the results, so a rerender never reads a config)."""
  c = load_config("cast", seeds[0], overrides, size)
  return {"sft_steps": c.sft.steps, "sft_batch": c.sft.batch_size, "rl_steps": c.rl.steps,
          "prompts_per_step": c.rl.prompts_per_step, "num_generations": c.rl.num_generations,
          "minibatch_size": c.rl.minibatch_size, "num_iterations": c.rl.num_iterations,
          "demo_noise": c.task.demo_noise.to_dict(), "headroom": c.headroom.to_dict(),
          "learning_rates": list(lrs), "sft_seeds": {str(s): t for s, t in sft_seeds.items()},
          "eval_examples": c.eval.num_examples}


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", default="0,1,2,3,4")
  parser.add_argument("--root", default="/tmp/cast_repro", help="parent of the per-seed workdirs")
  parser.add_argument("--variants", default=",".join(RL_VARIANTS))
  parser.add_argument("--learning_rates", default="3e-5,1e-4", help="RL learning rates tried on validation, "
                      "for every variant")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      help="config override key=value applied to every run, e.g. rl.steps=20")
  parser.add_argument("--sft-group", type=int, default=1,
                      help="consecutive seeds sharing one SFT run (that of the group's first seed); 1: SFT per seed")
  parser.add_argument("--workers", type=int, default=1, help="RL runs at a time (separate processes)")
  parser.add_argument("--size", default="", help="'tiny': every run at smoke-test size (tests)")
  parser.add_argument("--results-file", default=os.path.join(ROOT, report.RESULTS_FILE),
                      help="where the collected results go (the committed default regenerates RESULTS.md)")
  parser.add_argument("--plot-dir", default=os.path.join(ROOT, report.PLOT_DIR))
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",") if s]
  lrs = [float(x) for x in args.learning_rates.split(",") if x]
  variants = [v for v in args.variants.split(",") if v]
  unknown = set(variants) - set(RL_VARIANTS)
  if unknown:
    parser.error(f"unknown variants {sorted(unknown)}; expected some of {RL_VARIANTS}")
  if args.sft_group < 1:
    parser.error(f"--sft-group must be >= 1, got {args.sft_group}")
  sft_seeds = sft_seeds_of(seeds, args.sft_group)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  t0 = time.time()
  command = "python -m experiments.reproduce_cast " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
  saved = {"command": command.strip(), "machine": machine.description(), "seeds": seeds, "variants": variants,
           "overrides": args.overrides, "setup": setup_facts(seeds, lrs, args.overrides, sft_seeds, args.size),
           "done": False}

  def log(msg: str) -> None:
    print(f"[{(time.time() - t0) / 60:.1f} min] {msg}", flush=True)

  sft_runs = sorted(set(sft_seeds.values()))
  log(f"SFT, seeds {sft_runs}")
  machine.run_parallel(run_variant, [("sft_only", s, sft_dir(args.root, s), args.overrides, None, args.size)
                                     for s in sft_runs], args.workers)
  checked = {s: gate(args.root, s, args.overrides, args.size) for s in sft_runs}
  saved["headroom"] = {str(s): c.to_dict() for s, c in checked.items()}
  results_md.save_results(saved, args.results_file)
  for s, c in checked.items():
    log(f"step-0 headroom gate, SFT seed {s}: " + "; ".join(str(check) for check in c.checks))
  failed = [c for c in checked.values() if not c.passed]
  if failed:
    from lemon_rl.eval import headroom  # pylint: disable=g-import-not-at-top
    raise headroom.HeadroomError(failed[0])

  from lemon_rl.eval import tuning  # pylint: disable=g-import-not-at-top
  def rl_jobs(runs):  # (variant, seed, lr) -> the arguments of run_rl.
    return [(v, seed, lr, sft_seeds[seed], args.root, args.overrides, args.size) for v, seed, lr in runs]

  tuned = [(v, seeds[0], lr) for lr in lrs for v in variants]  # A cast run's case library serves the next ones.
  log(f"tuning: {len(tuned)} runs on seed {seeds[0]}")
  summaries = machine.run_parallel(run_rl, rl_jobs(tuned), args.workers)
  trials = {v: [] for v in variants}
  for (v, _, lr), summary in zip(tuned, summaries):
    trials[v].append({"params": {"learning_rate": lr}, "score": summary["final_eval"][TUNING_METRIC]})
  choice = tuning.record_choice(os.path.join(args.root, "tuning.json"), trials, split=TUNING_SPLIT,
                                metric=f"greedy {TUNING_METRIC}")
  saved["tuning"] = choice.to_dict()
  chosen = {v: choice.params(v)["learning_rate"] for v in variants}
  log("chosen learning rates: " + ", ".join(f"{v} {lr:g}" for v, lr in chosen.items()))

  jobs = rl_jobs([(v, seed, chosen[v]) for seed in seeds[1:] for v in variants])
  log(f"{len(jobs)} runs on seeds {seeds[1:]}")
  machine.run_parallel(run_rl, jobs, args.workers)
  saved["results"] = collect(args.root, chosen, sft_seeds)
  saved["total_s"] = time.time() - t0
  saved["done"] = True
  plots = report.plot(saved["results"], args.plot_dir)
  print(results_md.write_results(saved, args.results_file, report))
  print(f"wrote {args.results_file} and {', '.join(plots)}")
  return 0


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()  # The launcher's malloc settings (lemon_rl/utils/allocator.py).
  sys.exit(main())
