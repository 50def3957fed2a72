"""The CAST section: every RL variant from the SFT policy, tuned on validation (METHODS.md section 1; issue 10).

``saved`` (written by :mod:`experiments.reproduce_cast`): ``command``, ``machine``, ``seeds``, ``variants``,
``overrides``, ``setup`` (the config facts the text states), ``headroom`` (``{SFT seed: the step-0 gate's
statistics and checks on that SFT policy}``), ``tuning`` (the :mod:`lemon_rl.eval.tuning` record), ``results``
(``{variant: {"final", "seeds", "summary", "eval_curves", "train_curves", "profile"}}``, see
``reproduce_cast.collect``; absent until every run finished) and ``total_s``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from experiments.reports import figures

TITLE = "CAST"
RESULTS_FILE = "experiments/results/cast/results.json"
PLOT_DIR = "experiments/results/cast"
COMMAND = ("python -m experiments.reproduce_cast --seeds=0,1,2,3,4 --sft-group=2 --learning_rates=3e-5,1e-4 "
           "--workers=2")
MISSING = "Not run yet with the headroom design of issue 10 (the previous run's splits leaked and were withdrawn)."
CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
SCORES = ("name", "key", "type", "constraint", "value", "exact")


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


# ---------------------------------------------------------------------------------------------------------
# Plots and the report.


PLOTS = ("accuracy.png", "think_length.png", "training.png")


def plot(results: dict[str, Any], path_dir: str) -> list[str]:
  """Held-out accuracy and think length (all / easy / hard) against RL step, mean over seeds."""
  os.makedirs(path_dir, exist_ok=True)
  paths = []
  panel_keys = {"accuracy.png": [("accuracy", "held-out exact accuracy")],
                "think_length.png": [("think_len", "think length (all)"), ("think_len_easy", "think length (easy)"),
                                     ("think_len_hard", "think length (hard)")]}
  for name, keys in panel_keys.items():
    fig, axes = figures.panels(len(keys), height=3.6)
    for ax, (key, title) in zip(axes, keys):
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
    paths.append(figures.save(fig, axes, os.path.join(path_dir, name)))
  # Training-time think length and normalised advantage variance per RL step.
  fig, axes = figures.panels(2, height=3.6)
  for variant, rows in results.items():
    curves = rows["train_curves"]
    if variant == "sft_only" or not curves:
      continue
    n = min(len(c) for c in curves)
    steps = [curves[0][i]["step"] for i in range(n)]
    for ax, key in zip(axes, ("think_len", "advantage/normalized_variance")):
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
  paths.append(figures.save(fig, axes, os.path.join(path_dir, "training.png")))
  return paths


def _mean(results: dict[str, Any], variant: str, key: str) -> float:
  vals = [f.get(key) for f in results.get(variant, {}).get("final", [])]
  vals = [v for v in vals if v is not None]
  return float(np.mean(vals)) if vals else float("nan")


def _by_seed(results: dict[str, Any], variant: str, key: str) -> dict[Any, float]:
  """``{seed: final[key]}`` of ``variant`` (positions stand in for seeds when ``collect`` gave none)."""
  rows = results.get(variant, {})
  finals = rows.get("final", [])
  seeds = rows.get("seeds", range(len(finals)))
  return {s: f[key] for s, f in zip(seeds, finals) if f.get(key) is not None}


def _paired_seeds(results: dict[str, Any], a: str, b: str, key: str) -> dict[Any, float]:
  """``{seed: a - b}`` of ``key`` on every seed both variants finished (paired by seed, not by position)."""
  xa, xb = _by_seed(results, a, key), _by_seed(results, b, key)
  return {s: xa[s] - xb[s] for s in xa if s in xb}


def _per_seed_diff(results: dict[str, Any], a: str, b: str, key: str, scale: float = 1.0) -> list[float]:
  return [scale * d for d in _paired_seeds(results, a, b, key).values()]


def _budget_easy_minus_hard(results: dict[str, Any]) -> list[float]:
  """Per seed: ``(cast_no_budget - cast)`` think length on easy queries minus the same on hard ones."""
  easy, hard = (_paired_seeds(results, "cast_no_budget", "cast", k) for k in ("think_len_easy", "think_len_hard"))
  return [easy[s] - hard[s] for s in easy if s in hard]


def _hard_minus_easy(results: dict[str, Any], variant: str) -> list[float]:
  hard, easy = _by_seed(results, variant, "think_len_hard"), _by_seed(results, variant, "think_len_easy")
  return [hard[s] - easy[s] for s in hard if s in easy]


# The paper's directions: (line prefix, comparison, variants it needs, paper's sign of the difference,
# per-seed differences). Accuracy differences in percentage points, think lengths in tokens.
DIRECTIONS = (
    ("- CAST accuracy >= GRPO", "cast - grpo, accuracy (pp)", ("cast", "grpo"), +1,
     lambda r: _per_seed_diff(r, "cast", "grpo", "accuracy", 100)),
    ("- shorter thinking on easy queries (cast < cast_no_budget)", "cast - cast_no_budget, easy think len",
     ("cast", "cast_no_budget"), -1, lambda r: _per_seed_diff(r, "cast", "cast_no_budget", "think_len_easy")),
    ("- the budget cuts easy thinking more than hard thinking ((cast_no_budget - cast) on easy minus the same "
     "on hard > 0)", "(cast_no_budget - cast) think len, easy - hard", ("cast", "cast_no_budget"), +1,
     _budget_easy_minus_hard),
    ("- CAST thinks less than GRPO (all queries)", "cast - grpo, think len", ("cast", "grpo"), -1,
     lambda r: _per_seed_diff(r, "cast", "grpo", "think_len")),
    ("- longer thinking kept on hard queries (cast hard - cast easy > 0)", "cast, hard - easy think len",
     ("cast",), +1, lambda r: _hard_minus_easy(r, "cast")),
    ("- hard-to-easy curriculum hurts accuracy (cast_hard_to_easy < cast)",
     "cast_hard_to_easy - cast, accuracy (pp)", ("cast", "cast_hard_to_easy"), -1,
     lambda r: _per_seed_diff(r, "cast_hard_to_easy", "cast", "accuracy", 100)),
    ("- hard-to-easy lengthens thinking (cast_hard_to_easy > cast)", "cast_hard_to_easy - cast, think len",
     ("cast", "cast_hard_to_easy"), +1, lambda r: _per_seed_diff(r, "cast_hard_to_easy", "cast", "think_len")),
    ("- schema reward helps (cast > cast_no_schema, accuracy)", "cast - cast_no_schema, accuracy (pp)",
     ("cast", "cast_no_schema"), +1, lambda r: _per_seed_diff(r, "cast", "cast_no_schema", "accuracy", 100)),
)


def findings(results: dict[str, Any], family_alpha: float = 0.05) -> list[str]:
  """One line per direction the paper reports, with its verdict, then the Holm table of the family.

  The family is every direction whose variants were part of the run and have at least one paired seed
  (fixed by the design and by which runs finished, not by the outcomes; the others read "not run"); per-seed
  paired differences, Holm-corrected t-intervals and the verdict words "reproduced" / "opposite" / "not
  distinguishable" come from :func:`lemon_rl.eval.stats.holm_paired_intervals`.
  """
  from lemon_rl.eval import stats  # pylint: disable=g-import-not-at-top
  family, line = [], {}
  for prefix, name, needs, sign, diffs in DIRECTIONS:
    if all(v in results for v in needs):
      d = diffs(results)
      if d:
        family.append((prefix, stats.PairedComparison(name, sign, d)))
      else:
        line[prefix] = f"{prefix}: not run"
  verdicts = stats.holm_paired_intervals([c for _, c in family], family_alpha)
  line.update({prefix: f"{prefix}: paired diff {stats.format_paired(r, digits=2)}"
               for (prefix, _), r in zip(family, verdicts)})
  out = []
  acc = {v: 100 * _mean(results, v, "accuracy") for v in results}
  first = DIRECTIONS[0][0]
  if first in line:  # With the accuracies themselves (a "not run" line is left as it is).
    out.append(line.pop(first).replace(": paired diff", f": cast {acc['cast']:.1f}% vs grpo {acc['grpo']:.1f}% "
                                       f"(SFT {acc.get('sft_only', float('nan')):.1f}%); paired diff", 1))
  for key, label in (("think_len_easy", "easy"), ("think_len_hard", "hard")):
    vals = {v: _mean(results, v, key) for v in results}
    out.append(f"- think length on {label} queries: " + ", ".join(f"{v} {x:.1f}" for v, x in vals.items()))
  out += [line[prefix] for prefix, *_ in DIRECTIONS if prefix in line]
  nav = {v: np.mean([np.mean([r["advantage/normalized_variance"] for r in c]) for c in rows["train_curves"] if c])
         for v, rows in results.items() if v != "sft_only" and any(rows["train_curves"])}
  out.append("- normalised advantage variance (paper: GRPO 0.48 -> CAST 0.10): "
             + ", ".join(f"{v} {x:.3f}" for v, x in nav.items()))
  if verdicts:
    out += ["", *stats.format_paired_table(verdicts, digits=2)]
  return out


def _setup_lines(saved: Mapping[str, Any]) -> list[str]:
  st = saved["setup"]
  noise = st["demo_noise"]
  sft = _sft_design(st["sft_seeds"])
  return [
      f"Command: `{saved['command']}` on {saved['machine']}. Config `configs/cast_tool_use.py`"
      + (f" with {' '.join(saved['overrides'])}" if saved["overrides"] else "") + ".", "",
      f"Design: SFT of {st['sft_steps']} steps x {st['sft_batch']} demonstrations made imperfect "
      f"(`lemon_rl.envs.tool_use.DemoNoise`): a conversion skipped with probability {noise['skip_conversion']} "
      f"per call that needs one (note dropped, the query's own value passed), filler sentences in "
      f"{noise['filler']:.0%} of the think blocks, a look-alike key in {noise['look_alike_key']:.0%} and a "
      f"number as a string in {noise['number_as_string']:.0%} of the calls. RL: {st['rl_steps']} steps x "
      f"{st['prompts_per_step']} prompts x {st['num_generations']} completions, minibatches of "
      f"{st['minibatch_size']} ({st['prompts_per_step'] * st['num_generations'] // max(st['minibatch_size'], 1)} "
      "updates per batch). Held-out: the `tool_use` test split, greedy BFCL exact match; every cell is the mean "
      f"± 95% t-interval over the seeds (n shown). SFT: {sft}.", ""]


def _sft_design(sft_seeds: Mapping[str, int]) -> str:
  """How RL seeds share SFT runs (``sft_seeds``: ``{RL seed: seed of its SFT run}``)."""
  groups: dict[int, list[str]] = {}
  for seed, sft_seed in sft_seeds.items():
    groups.setdefault(sft_seed, []).append(seed)
  if all(len(g) == 1 for g in groups.values()):
    return "one run per seed"
  shared = "; ".join(f"seed{'s' if len(g) > 1 else ''} {', '.join(g)} from SFT seed {s}" for s, g in groups.items())
  return (f"{len(groups)} run{'s' if len(groups) > 1 else ''} ({shared}); seeds that share an SFT run differ "
          "in RL sampling, data order and the case library only, so the intervals cover SFT variation only across "
          "these runs")


def _gate_line(saved: Mapping[str, Any]) -> str:
  gates = saved.get("headroom")
  if not gates:
    return "Step-0 headroom gate: not run."
  per_sft = []
  for sft_seed, gate in gates.items():
    checks = "; ".join(f"{c['statistic']} = {c['value']:.3f} ({'>=' if c['bound'] == 'min' else '<='} "
                       f"{c['threshold']:g}: {'ok' if c['passed'] else 'FAILED'})" for c in gate["checks"])
    per_sft.append(f"SFT seed {sft_seed}: {checks}")
  return (f"Step-0 headroom gate (every SFT policy, {saved['setup']['num_generations']} samples of each "
          f"of {saved['setup']['headroom']['num_prompts']} validation queries, thresholds fixed in the config): "
          + ". ".join(per_sft) + ".")


def _tuning_lines(saved: Mapping[str, Any]) -> list[str]:
  tuning = saved.get("tuning")
  if not tuning:
    return ["Tuning: not finished."]
  lrs = saved["setup"]["learning_rates"]
  rows = [f"Tuning ({tuning['metric']} on the `{tuning['split']}` split, seed {saved['seeds'][0]}, "
          f"{tuning['trials_per_arm']} trials per variant, ties to the first):", "",
          "| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |", "|" + "---|" * (len(lrs) + 2)]
  for variant, rec in tuning["arms"].items():
    scores = [f"{t['score']:.3f}" if t["score"] is not None else "-" for t in rec["trials"]]
    rows.append(f"| {variant} | " + " | ".join(scores) + f" | {rec['chosen_params']['learning_rate']:g} |")
  return rows


def _per_seed_lines(saved: Mapping[str, Any]) -> list[str]:
  """Overall / irrelevance exact match per RL seed, with the SFT policy each seed started from."""
  results, sft_seeds = saved["results"], saved["setup"]["sft_seeds"]
  seeds = [str(s) for s in saved["seeds"]]
  header = "| variant | " + " | ".join(f"seed {s} (SFT {sft_seeds[s]})" for s in seeds) + " |"
  lines = ["### Per seed: exact accuracy overall / on irrelevance queries (%)", "", header,
           "|" + "---|" * (len(seeds) + 1)]
  for v, rows in results.items():
    by_seed = {str(s): f for s, f in zip(rows["seeds"], rows["final"])}
    start = [by_seed.get(str(sft_seeds[s]) if v == "sft_only" else s) for s in seeds]
    cells = [f"{100 * f['accuracy']:.1f} / {100 * f['acc_irrelevance']:.1f}" if f else "-" for f in start]
    lines.append(f"| {v} | " + " | ".join(cells) + " |")
  return lines


def render(saved: Mapping[str, Any]) -> str:
  lines = [*_setup_lines(saved), _gate_line(saved), "", *_tuning_lines(saved), ""]
  if not saved.get("results"):
    return "\n".join(lines + ["Runs: not finished.", ""])
  results = saved["results"]
  variants = list(results)
  chosen = {v: rec["chosen_params"]["learning_rate"] for v, rec in saved["tuning"]["arms"].items()}
  header = "| variant | RL lr | n | " + " | ".join(CATEGORIES) + " | overall |"
  lines += ["### Exact accuracy (%) per category", "", header, "|" + "---|" * (header.count("|") - 1)]
  for v in variants:
    final = results[v]["final"]
    cells = [fmt([f.get(f"acc_{c}") for f in final], 100) for c in CATEGORIES]
    lines.append(f"| {v} | {chosen.get(v, '-')} | {len(final)} | " + " | ".join(cells)
                 + f" | {fmt([f.get('accuracy') for f in final], 100)} |")
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
  lines += ["", *_per_seed_lines(saved)]
  lines += ["", "### The paper's directions on this run", ""] + findings(results) + [""]
  profiles = results.get("cast", {}).get("profile", [])
  if profiles:
    lines += ["", "### Case libraries (SFT policy, per seed)", ""]
    for seed, p in zip(results["cast"]["seeds"], profiles):
      lines.append(f"- seed {seed}: {p['num_cases']} cases over {p['num_queries']} training queries, base "
                   f"accuracy {100 * p['base_accuracy']:.1f}%, H bin edges {[round(e, 2) for e in p['bin_edges']]}, "
                   f"baselines L_emp {p['baselines']} tokens, failure rates "
                   f"{ {k: round(x, 2) for k, x in p['failure_rates'].items()} }, {p.get('frac_hardest', float('nan')):.0%} "
                   f"of the queries at H = 1, sampled in {p['sample_s']} s")
  lines += ["", f"Wall time of the script's last invocation (finished runs are read back, not rerun): "
            f"{saved['total_s'] / 60:.1f} min.", "",
            "Plots: " + ", ".join(f"`{os.path.join(PLOT_DIR, name)}`" for name in PLOTS), ""]
  return "\n".join(lines)
