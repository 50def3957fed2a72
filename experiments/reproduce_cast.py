r"""Reproduces the CAST experiment: SFT once per seed, then every RL variant from it; writes RESULTS.md "CAST".

    python -m experiments.reproduce_cast [--seeds=0,1,2] [--root=/tmp/cast_repro] \
        [--variants=grpo,cast,cast_no_budget,cast_no_schema,cast_hard_to_easy] [--set=rl.steps=20 ...]

Per seed: the ``sft_only`` variant of ``configs/cast_tool_use.py`` runs in ``<root>/seed<s>/sft_only``; its
``checkpoints/sft`` is copied into each RL variant's workdir, so the runner restores it and skips SFT
(every variant starts from the same SFT policy). ``--sft-seed=k`` runs SFT once (seed ``k``) and starts
every seed's RL from it (seeds then vary the RL sampling, data order and case library only). The case library depends only on the SFT parameters and
the seed, so the first ``cast*`` variant samples it and the others reuse a copy of ``cases/``. Runs are in
process, one after the other; a finished run (``summary.json`` present) is not rerun, an interrupted one
resumes. Then ``experiments/RESULTS.md`` gets (or has replaced) its ``## CAST`` section
(:func:`experiments.results_md.write_section`): final held-out
metrics as mean +- 95% t-interval over the seeds, wall times, the case libraries, and the plots
``experiments/results/cast/{accuracy,think_length}.png``. Other sections of RESULTS.md are kept as they are.
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

from experiments.results_md import write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "cast_tool_use.py")
RESULTS_MD = os.path.join(ROOT, "experiments", "RESULTS.md")
PLOT_DIR = os.path.join(ROOT, "experiments", "results", "cast")
RL_VARIANTS = ("grpo", "cast", "cast_no_budget", "cast_no_schema", "cast_hard_to_easy")
CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
SCORES = ("name", "key", "type", "constraint", "value", "exact")
TITLE = "CAST"


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


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
  """Mean and the half-width of the two-sided 95% Student-t interval (NaN half-width for one value)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  x = np.asarray([v for v in values if v is not None], np.float64)
  if x.size == 0:
    return float("nan"), float("nan")
  if x.size == 1:
    return float(x[0]), float("nan")
  return float(x.mean()), float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))


def fmt(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> str:
  m, h = mean_ci([None if v is None else v * scale for v in values])
  if np.isnan(m):
    return "n/a"
  return f"{m:.{digits}f}" if np.isnan(h) else f"{m:.{digits}f} ± {h:.{digits}f}"


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
    rows = {"final": [], "summary": [], "eval_curves": [], "train_curves": [], "profile": []}
    for seed in (seeds if variant != "sft_only" or sft_seed is None else [sft_seed]):
      workdir = os.path.join(root, f"seed{seed}", variant)
      if not os.path.exists(os.path.join(workdir, "summary.json")):
        continue
      records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
      rows["final"].append(sft_eval(root, seed, variants) if variant == "sft_only" else final_eval(workdir, "rl"))
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


# ---------------------------------------------------------------------------------------------------------
# Plots and the report.


def plot(results: dict[str, Any], path_dir: str) -> list[str]:
  """Held-out accuracy and think length (all / easy / hard) against RL step, mean over seeds."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  os.makedirs(path_dir, exist_ok=True)
  paths = []
  panels = {"accuracy.png": [("accuracy", "held-out exact accuracy")],
            "think_length.png": [("think_len", "think length (all)"), ("think_len_easy", "think length (easy)"),
                                 ("think_len_hard", "think length (hard)")]}
  for name, keys in panels.items():
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys):
      for variant, rows in results.items():
        curves = rows["eval_curves"]
        if variant == "sft_only" or not curves:
          continue
        steps = sorted({r["step"] for c in curves for r in c})
        ys = []
        for s in steps:
          vals = [next((r.get(key) for r in c if r["step"] == s), None) for c in curves]
          ys.append(np.mean([v for v in vals if v is not None]) if any(v is not None for v in vals) else np.nan)
        ax.plot(steps, ys, marker="o", label=variant)
      ax.set_title(title)
      ax.set_xlabel("RL step")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(path_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  # Training-time think length and normalised advantage variance per RL step.
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), squeeze=False)
  for variant, rows in results.items():
    curves = rows["train_curves"]
    if variant == "sft_only" or not curves:
      continue
    n = min(len(c) for c in curves)
    steps = [curves[0][i]["step"] for i in range(n)]
    for ax, key in zip(axes[0], ("think_len", "advantage/normalized_variance")):
      ys = []
      for i in range(n):
        vals = []
        for c in curves:
          v = c[i].get(key)
          if v is None:  # The reward's own think-length metric.
            v = next((c[i][k] for k in c[i] if k.startswith("reward/") and k.endswith(f"/{key}")
                      and c[i][k] is not None), None)
          vals.append(np.nan if v is None else v)
        ys.append(np.nanmean(vals))
      ax.plot(steps, ys, label=variant)
      ax.set_title(f"train: {key}")
      ax.set_xlabel("RL step")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(path_dir, "training.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  paths.append(path)
  return paths


def _mean(results: dict[str, Any], variant: str, key: str) -> float:
  vals = [f.get(key) for f in results.get(variant, {}).get("final", [])]
  vals = [v for v in vals if v is not None]
  return float(np.mean(vals)) if vals else float("nan")


def _per_seed_diff(results: dict[str, Any], a: str, b: str, key: str) -> list[float]:
  fa, fb = results.get(a, {}).get("final", []), results.get(b, {}).get("final", [])
  return [x.get(key) - y.get(key) for x, y in zip(fa, fb) if x.get(key) is not None and y.get(key) is not None]


def findings(results: dict[str, Any]) -> list[str]:
  """One line per direction the paper reports, with the numbers and whether this run shows it.

  A direction "holds" when the mean difference has the paper's sign; "significant" when the 95% t-interval
  of the per-seed paired differences excludes 0.
  """
  out = []

  def verdict(diffs: list[float], sign: float) -> str:
    m, h = mean_ci(diffs)
    if np.isnan(m):
      return "not measured"
    head = f"paired diff {m:+.2f}" + ("" if np.isnan(h) else f" ± {h:.2f}") + " → "
    if abs(m) < 1e-9:
      return head + "no difference"
    holds = sign * m > 0
    sig = not np.isnan(h) and abs(m) > h
    return head + ("holds" if holds else "does NOT hold") + (" (significant)" if sig and holds else
                                                            " (not significant)" if holds else "")

  acc = {v: 100 * _mean(results, v, "accuracy") for v in results}
  out.append(f"- CAST accuracy >= GRPO: cast {acc.get('cast', float('nan')):.1f}% vs grpo "
             f"{acc.get('grpo', float('nan')):.1f}% (SFT {acc.get('sft_only', float('nan')):.1f}%); "
             + verdict([100 * d for d in _per_seed_diff(results, "cast", "grpo", "accuracy")], +1)
             .replace("does NOT hold", "CAST < GRPO"))
  for key, label in (("think_len_easy", "easy"), ("think_len_hard", "hard")):
    vals = {v: _mean(results, v, key) for v in results}
    out.append(f"- think length on {label} queries: " + ", ".join(f"{v} {x:.1f}" for v, x in vals.items()))
  out.append("- shorter thinking on easy queries (cast < cast_no_budget): "
             + verdict(_per_seed_diff(results, "cast", "cast_no_budget", "think_len_easy"), -1))
  out.append("- the budget cuts easy thinking more than hard thinking ((cast_no_budget - cast) on easy minus "
             "the same on hard > 0): "
             + verdict([e - h for e, h in zip(_per_seed_diff(results, "cast_no_budget", "cast", "think_len_easy"),
                                              _per_seed_diff(results, "cast_no_budget", "cast", "think_len_hard"))],
                       +1))
  out.append("- CAST thinks less than GRPO (all queries): "
             + verdict(_per_seed_diff(results, "cast", "grpo", "think_len"), -1))
  out.append("- longer thinking kept on hard queries (cast hard - cast easy > 0): "
             + verdict([x.get("think_len_hard") - x.get("think_len_easy") for x in results.get("cast", {})
                        .get("final", []) if x.get("think_len_hard") is not None and x.get("think_len_easy")
                        is not None], +1))
  out.append("- hard-to-easy curriculum hurts accuracy (cast_hard_to_easy < cast): "
             + verdict([100 * d for d in _per_seed_diff(results, "cast_hard_to_easy", "cast", "accuracy")], -1))
  out.append("- hard-to-easy lengthens thinking (cast_hard_to_easy > cast): "
             + verdict(_per_seed_diff(results, "cast_hard_to_easy", "cast", "think_len"), +1))
  out.append("- schema reward helps (cast > cast_no_schema, accuracy): "
             + verdict([100 * d for d in _per_seed_diff(results, "cast", "cast_no_schema", "accuracy")], +1))
  nav = {v: np.mean([np.mean([r["advantage/normalized_variance"] for r in c]) for c in rows["train_curves"] if c])
         for v, rows in results.items() if v != "sft_only" and any(rows["train_curves"])}
  out.append("- normalised advantage variance (paper: GRPO 0.48 -> CAST 0.10): "
             + ", ".join(f"{v} {x:.3f}" for v, x in nav.items()))
  return out


def report(results: dict[str, Any], seeds: Sequence[int], command: str, plots: Sequence[str],
           overrides: Sequence[str], total_s: float, notes: str = "") -> str:
  lines = [f"Command (from the repository root): `{command}`", "",
           f"Seeds {', '.join(map(str, seeds))}; every cell is the mean ± 95% t-interval over the seeds that "
           "finished (n shown); held-out set: the `tool_use` test split scored greedily (BFCL exact match). "
           f"Config: `configs/cast_tool_use.py`{' with ' + ' '.join(overrides) if overrides else ''}. "
           f"Total wall time of the script: {total_s / 60:.1f} min on this machine (2-core CPU).", ""]
  variants = list(results)
  header = "| variant | n | " + " | ".join(CATEGORIES) + " | overall |"
  lines += ["### Exact accuracy (%) per category", "", header, "|" + "---|" * (header.count("|") - 1)]
  for v in variants:
    final = results[v]["final"]
    cells = [fmt([f.get(f"acc_{c}") for f in final], 100) for c in CATEGORIES]
    lines.append(f"| {v} | {len(final)} | " + " | ".join(cells) + f" | {fmt([f.get('accuracy') for f in final], 100)} |")
  header = "| variant | " + " | ".join(SCORES) + " | format |"
  lines += ["", "### The six scores (%, response level, mean over held-out queries)", "", header,
            "|" + "---|" * (header.count("|") - 1)]
  for v in variants:
    final = results[v]["final"]
    cells = [fmt([f.get(s) for f in final], 100) for s in (*SCORES, "format")]
    lines.append(f"| {v} | " + " | ".join(cells) + " |")
  header = ("| variant | think len (all) | easy | hard | completion len | norm. adv. variance | "
            "within-group share | steps | process wall s |")
  lines += ["", "### Think length (tokens), stability, cost", "",
            "Easy = at most one call and no conversion note; hard = several calls or a conversion (static tag "
            "of the held-out query). Normalised advantage variance = batch variance of the advantages the loss "
            "used, mean over RL steps (decision, see `lemon_rl.training.rollout.advantage_variance`). "
            "Process wall s: the whole run of the variant (restore, case library, RL, evaluations).", "",
            header, "|" + "---|" * (header.count("|") - 1)]
  for v in variants:
    rows = results[v]
    final = rows["final"]
    nav = [np.mean([r["advantage/normalized_variance"] for r in c]) if c else None for c in rows["train_curves"]]
    share = [np.mean([r["advantage/within_group_share"] for r in c]) if c else None for c in rows["train_curves"]]
    steps = [f"{s.get('rl_steps')} RL" if v != "sft_only" else f"{s.get('sft_steps')} SFT" for s in rows["summary"]]
    wall = [s.get("process_wall_s") for s in rows["summary"]]
    lines.append(f"| {v} | {fmt([f.get('think_len') for f in final])} | "
                 f"{fmt([f.get('think_len_easy') for f in final])} | {fmt([f.get('think_len_hard') for f in final])} | "
                 f"{fmt([f.get('completion_length') for f in final])} | "
                 f"{fmt(nav if v != 'sft_only' else [], digits=3)} | {fmt(share if v != 'sft_only' else [], digits=3)} | "
                 f"{'/'.join(sorted(set(steps)))} | {fmt(wall, digits=0)} |")
  lines += ["", "### The paper's directions on this run", ""] + findings(results) + [""]
  profiles = results.get("cast", {}).get("profile", [])
  if profiles:
    lines += ["", "### Case libraries (SFT policy, per seed)", ""]
    for seed, p in zip(seeds, profiles):
      lines.append(f"- seed {seed}: {p['num_cases']} cases over {p['num_queries']} training queries, base "
                   f"accuracy {100 * p['base_accuracy']:.1f}%, H bin edges {[round(e, 2) for e in p['bin_edges']]}, "
                   f"baselines L_emp {p['baselines']} tokens, failure rates "
                   f"{ {k: round(x, 2) for k, x in p['failure_rates'].items()} }, {p.get('frac_hardest', float('nan')):.0%} "
                   f"of the queries at H = 1, sampled in {p['sample_s']} s")
  lines += ["", "Plots: " + ", ".join(f"`{os.path.relpath(p, ROOT)}`" for p in plots), ""]
  if notes:
    lines += ["### Reading", "", notes.strip(), ""]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--root", default="/tmp/cast_repro", help="parent of the per-seed workdirs")
  parser.add_argument("--variants", default=",".join(RL_VARIANTS))
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      help="config override key=value applied to every run, e.g. rl.steps=20")
  parser.add_argument("--sft-seed", type=int, default=None,
                      help="run SFT once with this seed and start every seed's RL from it (default: SFT per seed)")
  parser.add_argument("--results", default=RESULTS_MD)
  parser.add_argument("--plot-dir", default=PLOT_DIR)
  parser.add_argument("--report-only", action="store_true", help="only collect finished runs and write the report")
  parser.add_argument("--notes", default="", help="a Markdown file appended to the section as 'Reading'")
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
  plots = plot(results, args.plot_dir)
  # The command that produced the runs (a --report-only rerun reports the reproduction command).
  command = "python -m experiments.reproduce_cast " + " ".join(
      shlex.quote(a) for a in (argv or sys.argv[1:])
      if a != "--report-only" and not a.startswith(("--total-seconds", "--notes")))
  total_s = args.total_seconds if args.report_only and args.total_seconds else time.time() - t0
  notes = open(args.notes).read() if args.notes else ""
  write_section(TITLE, report(results, seeds, command.strip(), plots, args.overrides, total_s, notes),
                args.results)
  print(f"wrote {args.results} and {', '.join(plots)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
