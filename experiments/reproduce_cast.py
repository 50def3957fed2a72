r"""Reproduces the CAST experiment: SFT once per seed, then every RL variant from it; writes experiments/results/cast/.

    python -m experiments.reproduce_cast [--seeds=0,1,2] [--root=/tmp/cast_repro] \
        [--variants=grpo,cast,cast_no_budget,cast_no_schema,cast_hard_to_easy] [--set=rl.steps=20 ...]

Per seed: the ``sft_only`` variant of ``configs/cast_tool_use.py`` runs in ``<root>/seed<s>/sft_only``; its
``checkpoints/sft`` is copied into each RL variant's workdir, so the runner restores it and skips SFT
(every variant starts from the same SFT policy). ``--sft-seed=k`` runs SFT once (seed ``k``) and starts
every seed's RL from it (seeds then vary the RL sampling, data order and case library only). The case library depends only on the SFT parameters and
the seed, so the first ``cast*`` variant samples it and the others reuse a copy of ``cases/``. Runs are in
process, one after the other; a finished run (``summary.json`` present) is not rerun, an interrupted one
resumes. Then the collected runs go to ``experiments/results/cast/results.json`` (committed), the plots next to
it, and ``experiments/RESULTS.md`` is regenerated (:mod:`experiments.results_md`; the section is rendered by
:mod:`experiments.reports.cast`: held-out metrics as mean +- 95% t-interval over the seeds, wall times, the case
libraries and the paper's directions with Holm-corrected paired intervals).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from typing import Any, Sequence

import numpy as np

from experiments import results_md
from experiments.reports import cast as report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "cast_tool_use.py")
RL_VARIANTS = ("grpo", "cast", "cast_no_budget", "cast_no_schema", "cast_hard_to_easy")


# ---------------------------------------------------------------------------------------------------------
# Running.


def load_config(variant: str, seed: int, overrides: Sequence[str]):
  """The variant's config with ``seed`` and ``key=value`` overrides (values parsed as Python/JSON literals)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("cast_tool_use_config", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant)
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


def run_variant(variant: str, seed: int, workdir: str, overrides: Sequence[str]) -> dict[str, Any]:
  """Runs (or resumes, or skips when finished) one variant; returns its summary."""
  from lemon_rl.training import experiment  # pylint: disable=g-import-not-at-top
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      return json.load(f)
  print(f"=== seed {seed}: {variant} -> {workdir}", flush=True)
  t0 = time.time()
  summary = experiment.run(load_config(variant, seed, overrides), workdir)
  summary["process_wall_s"] = round(time.time() - t0, 1)
  with open(summary_path, "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def copy_tree(src: str, dst: str) -> None:
  if not os.path.exists(dst):
    shutil.copytree(src, dst)


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


def run_seed(seed: int, root: str, variants: Sequence[str], overrides: Sequence[str],
             sft_seed: int | None = None) -> None:
  """SFT of ``seed`` (or of ``sft_seed``, shared by every seed, when given), then each RL variant."""
  base = os.path.join(root, f"seed{seed}")
  sft_dir = os.path.join(root, f"seed{seed if sft_seed is None else sft_seed}", "sft_only")
  run_variant("sft_only", seed if sft_seed is None else sft_seed, sft_dir, overrides)
  cases_from = None
  for variant in variants:
    workdir = os.path.join(base, variant)
    copy_tree(os.path.join(sft_dir, "checkpoints", "sft"), os.path.join(workdir, "checkpoints", "sft"))
    if sft_seed is not None and sft_seed != seed:
      reseed_sft_checkpoint(os.path.join(workdir, "checkpoints", "sft"), seed)
    if variant.startswith("cast") and cases_from is not None:
      copy_tree(os.path.join(cases_from, "cases"), os.path.join(workdir, "cases"))
    run_variant(variant, seed, workdir, overrides)
    if variant.startswith("cast") and cases_from is None:
      cases_from = workdir


# ---------------------------------------------------------------------------------------------------------
# Collecting.


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def final_eval(workdir: str, phase: str) -> dict[str, Any]:
  evals = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r["phase"] == f"eval_{phase}"]
  return evals[-1] if evals else {}


def sft_eval(root: str, seed: int, variants: Sequence[str]) -> dict[str, Any]:
  """The SFT policy of ``seed`` on the RL runs' held-out set: their step-0 evaluation (every RL variant of
  the seed starts from that checkpoint), else the SFT run's own final evaluation."""
  for variant in variants:
    path = os.path.join(root, f"seed{seed}", variant, "metrics.jsonl")
    if os.path.exists(path):
      first = [r for r in read_jsonl(path) if r["phase"] == "eval_rl" and r["step"] == 0]
      if first:
        return first[0]
  return final_eval(os.path.join(root, f"seed{seed}", "sft_only"), "sft")


def collect(root: str, seeds: Sequence[int], variants: Sequence[str],
            sft_seed: int | None = None) -> dict[str, Any]:
  """``{variant: {"final": [per-seed final eval], "curves": [...], "summary": [...], ...}}``.

  The ``sft_only`` row has one entry per SFT run (only ``sft_seed`` when SFT was shared).
  """
  out: dict[str, Any] = {}
  for variant in ("sft_only", *variants):
    rows = {"final": [], "seeds": [], "summary": [], "eval_curves": [], "train_curves": [], "profile": []}
    for seed in (seeds if variant != "sft_only" or sft_seed is None else [sft_seed]):
      workdir = os.path.join(root, f"seed{seed}", variant)
      if not os.path.exists(os.path.join(workdir, "summary.json")):
        continue
      records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
      rows["final"].append(sft_eval(root, seed, variants) if variant == "sft_only" else final_eval(workdir, "rl"))
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


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--root", default="/tmp/cast_repro", help="parent of the per-seed workdirs")
  parser.add_argument("--variants", default=",".join(RL_VARIANTS))
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      help="config override key=value applied to every run, e.g. rl.steps=20")
  parser.add_argument("--sft-seed", type=int, default=None,
                      help="run SFT once with this seed and start every seed's RL from it (default: SFT per seed)")
  parser.add_argument("--results-file", default=os.path.join(ROOT, report.RESULTS_FILE),
                      help="where the collected results go (the committed default regenerates RESULTS.md)")
  parser.add_argument("--plot-dir", default=os.path.join(ROOT, report.PLOT_DIR))
  parser.add_argument("--report-only", action="store_true", help="only collect finished runs and write the results")
  parser.add_argument("--total-seconds", type=float, default=0.0,
                      help="with --report-only: the reproduction's wall time to report")
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",") if s]
  variants = [v for v in args.variants.split(",") if v]
  unknown = set(variants) - set(RL_VARIANTS)
  if unknown:
    parser.error(f"unknown variants {sorted(unknown)}; expected some of {RL_VARIANTS}")
  t0 = time.time()
  if not args.report_only:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for seed in seeds:
      run_seed(seed, args.root, variants, args.overrides, args.sft_seed)
  results = collect(args.root, seeds, variants, args.sft_seed)
  plots = report.plot(results, args.plot_dir)
  # The command that produced the runs (a --report-only rerun reports the reproduction command).
  command = "python -m experiments.reproduce_cast " + " ".join(
      shlex.quote(a) for a in (argv or sys.argv[1:]) if a != "--report-only" and not a.startswith("--total-seconds"))
  total_s = args.total_seconds if args.report_only and args.total_seconds else time.time() - t0
  saved = {"results": results, "seeds": seeds, "command": command.strip(), "overrides": args.overrides,
           "total_s": total_s}
  print(results_md.write_results(saved, args.results_file, report))
  print(f"wrote {args.results_file} and {', '.join(plots)}")
  return 0


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()  # The launcher's malloc settings (lemon_rl/utils/allocator.py).
  sys.exit(main())
