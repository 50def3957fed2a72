"""The BudgetMix section: Pass@8 under turn budgets, step quality and recovery of the base policy and the RL arms.

``saved`` (written by :mod:`experiments.reproduce_budgetmix`): ``command``, ``machine``, ``family_alpha``,
``setup`` (sizes of the run), ``arms`` (names, ``base`` first), optionally ``stopped`` (why the run stopped,
e.g. the headroom gate) and one record per seed: ``seed``, ``headroom`` (the gate's statistics and checks on
validation maps) and ``arms``: ``{arm: {"final": {split: evaluation}, "wall_s", ...}}``. An evaluation
(:func:`experiments.reproduce_budgetmix.evaluation_record`) holds ``pass`` (``{mode: {pct: [Pass@1..K]}}``, the
mean over maps), ``quality`` (``{run: {quality, regret, optimal_share, num_steps, num_hopeless}}``),
``matched_quality`` (the same on the states every arm of the seed visited) and ``recovery`` (``recovery``,
``clean``, ``ratio`` at ``setup.recovery_fraction``).

The family of claimed directions (fixed before the run; METHODS.md section 5's paper figures), per estimator
``E`` whose two arms ran, on the ``test`` split (4-6), Pass@8 in the prompted mode, paired by seed:

1. full-budget RL's gain shrinks or reverses at tight budgets:
   ``(full_E - base)@25% - (full_E - base)@100% < 0``;
2. BudgetMix gains at 25%: ``(budgetmix_E - full_E)@25% > 0``;
3. BudgetMix gains most at 25%: ``(budgetmix_E - full_E)@25% - (budgetmix_E - full_E)@100% > 0``;
4. the gain comes from recovery after errors: ``recovery(budgetmix_E) - recovery(full_E) > 0``.

All of them are tested together with Holm's correction (:func:`lemon_rl.eval.stats.holm_paired_intervals`); the
verdict words follow the intervals.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from experiments import results_md
from lemon_rl.eval.stats import PairedComparison, format_mean_ci, format_paired_table, holm_paired_intervals

TITLE = "BudgetMix on FrozenLake (multi-turn RL under turn budgets)"
RESULTS_FILE = "experiments/results/budgetmix/results.json"
PLOT_FILE = "experiments/results/budgetmix/pass_surface.png"
PLANNED_SEEDS = (0, 1, 2, 3, 4)
COMMAND = ("python -m experiments.reproduce_budgetmix --workdir=runs/budgetmix "
           f"--seeds={','.join(map(str, PLANNED_SEEDS))} --workers=2")
MISSING = ("Not run yet: the pipeline, its step-0 headroom gate and the sizing pilot are in "
           "`experiments/reproduce_budgetmix.py`.")

ESTIMATORS = ("grpo", "gigpo", "ppo")
LABELS = {"base": "base (SFT)", "grpo_full": "full-budget GRPO", "grpo_budgetmix": "BudgetMix GRPO",
          "gigpo_full": "full-budget GiGPO", "gigpo_budgetmix": "BudgetMix GiGPO", "ppo_full": "full-budget PPO",
          "ppo_budgetmix": "BudgetMix PPO"}
FAMILY_SPLIT = "test"
FAMILY_K = 8
CLAIMS = {
    "shrinks": "full-budget RL's gain shrinks or reverses at tight budgets",
    "gain25": "BudgetMix gains at 25%",
    "most25": "BudgetMix gains most at 25%",
    "recovery": "the gain comes from recovery after errors",
}


def label(arm: str) -> str:
  return LABELS.get(arm, arm)


def pass_at(evaluation: Mapping[str, Any], mode: str, pct: int, k: int) -> float:
  return float(evaluation["pass"][mode][str(pct)][k - 1])


def _final(seed: Mapping[str, Any], arm: str, split: str) -> Mapping[str, Any]:
  return seed["arms"][arm]["final"][split]


def _complete(seeds: Sequence[Mapping[str, Any]], arms: Sequence[str], split: str) -> list[Mapping[str, Any]]:
  """The seeds where every one of ``arms`` has a final evaluation on ``split`` (the paired seeds)."""
  return [s for s in seeds if all(split in s.get("arms", {}).get(a, {}).get("final", {}) for a in arms)]


def directions(seeds: Sequence[Mapping[str, Any]], arms: Sequence[str], split: str = FAMILY_SPLIT,
               k: int = FAMILY_K) -> list[tuple[str, PairedComparison]]:
  """The family (module docstring): ``(claim key, comparison)`` per direction, for each estimator with both arms."""
  out = []
  p = lambda s, arm, pct: pass_at(_final(s, arm, split), "prompted", pct, k)
  for e in ESTIMATORS:
    full, mix = f"{e}_full", f"{e}_budgetmix"
    if full not in arms or mix not in arms:
      continue
    name = e.upper() if e != "gigpo" else "GiGPO"
    paired = _complete(seeds, ("base", full, mix), split)
    out.append(("shrinks", PairedComparison(
        f"full-budget {name} gain over base, Pass@{k}: at 25% minus at 100%", -1,
        [(p(s, full, 25) - p(s, "base", 25)) - (p(s, full, 100) - p(s, "base", 100)) for s in paired])))
    out.append(("gain25", PairedComparison(f"BudgetMix {name} - full-budget {name}, Pass@{k} at 25%", +1,
                                           [p(s, mix, 25) - p(s, full, 25) for s in paired])))
    out.append(("most25", PairedComparison(
        f"BudgetMix {name} - full-budget {name}, Pass@{k}: at 25% minus at 100%", +1,
        [(p(s, mix, 25) - p(s, full, 25)) - (p(s, mix, 100) - p(s, full, 100)) for s in paired])))
    rec = [s for s in paired if _recovery(_final(s, mix, split)) is not None
           and _recovery(_final(s, full, split)) is not None]
    out.append(("recovery", PairedComparison(
        f"BudgetMix {name} - full-budget {name}, recovery after an injected error", +1,
        [_recovery(_final(s, mix, split)) - _recovery(_final(s, full, split)) for s in rec])))
  return out


def _recovery(evaluation: Mapping[str, Any]) -> float | None:
  value = (evaluation.get("recovery") or {}).get("recovery")
  return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _cell(values: Sequence[float | None]) -> str:
  values = [v for v in values if v is not None and not math.isnan(v)]
  if not values:
    return "-"
  return format_mean_ci(values) if len(values) > 1 else f"{values[0]:.3f}"


def pass_table(seeds, arms, split: str, mode: str, k: int, pcts: Sequence[int]) -> list[str]:
  rows = ["| arm | " + " | ".join(f"Pass@{k} {p}%" for p in pcts) + " |", "|---|" + "---|" * len(pcts)]
  for arm in arms:
    done = _complete(seeds, (arm,), split)
    rows.append(f"| {label(arm)} | " + " | ".join(_cell([pass_at(_final(s, arm, split), mode, p, k) for s in done])
                                                for p in pcts) + " |")
  return rows


def quality_table(seeds, arms, split: str) -> list[str]:
  rows = ["| arm | step quality (all states) | optimal moves | step quality (matched states) | "
          "recovery | clean at the same budget | recovery / clean |", "|---|---|---|---|---|---|---|"]
  for arm in arms:
    ev = [_final(s, arm, split) for s in _complete(seeds, (arm,), split)]
    q = lambda e, key, field: ((e.get(key) or {}).get("full") or {}).get(field)
    r = lambda e, field: (e.get("recovery") or {}).get(field)
    rows.append(f"| {label(arm)} | {_cell([q(e, 'quality', 'quality') for e in ev])} | "
                f"{_cell([q(e, 'quality', 'optimal_share') for e in ev])} | "
                f"{_cell([q(e, 'matched_quality', 'quality') for e in ev])} | "
                f"{_cell([r(e, 'recovery') for e in ev])} | {_cell([r(e, 'clean') for e in ev])} | "
                f"{_cell([r(e, 'ratio') for e in ev])} |")
  return rows


def headroom_table(saved: Mapping[str, Any]) -> list[str]:
  seeds = [s for s in saved["seeds"] if s.get("headroom")]
  if not seeds:
    return []
  names = list(seeds[0]["headroom"]["statistics"])
  rows = ["| seed | " + " | ".join(names) + " | gate |", "|---|" + "---|" * (len(names) + 1)]
  for s in seeds:
    h = s["headroom"]
    rows.append(f"| {s['seed']} | " + " | ".join(f"{h['statistics'][n]:.3f}" for n in names) +
                f" | {'passed' if h['passed'] else 'FAILED'} |")
  checks = seeds[0]["headroom"]["checks"]
  bounds = ", ".join(f"{c['statistic']} {'>=' if c['bound'] == 'min' else '<='} {c['threshold']:g}" for c in checks)
  return [f"Step-0 headroom gate (base policy on validation maps; thresholds fixed in the config: {bounds}):", "",
          *rows]


def claim_summary(keyed: Sequence[tuple[str, Any]]) -> list[str]:
  """One line per paper claim: the verdicts of its directions."""
  lines = []
  for key, text in CLAIMS.items():
    verdicts = [f"{r.name}: {r.verdict}" for k, r in keyed if k == key]
    if verdicts:
      lines.append(f"- {text}: " + "; ".join(verdicts) + ".")
  return lines


def _pcts(setup: Mapping[str, Any]) -> list[int]:
  """The budget fractions of ``T_max`` as the integer percentages that key the saved Pass@k."""
  return [int(round(100 * f)) for f in setup["fractions"]]


def _finished(seeds: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """The seeds whose every arm is done: the only ones the tables and the plot pair."""
  return [s for s in seeds if s.get("finished")]


def render(saved: Mapping[str, Any]) -> str:
  setup, seeds, arms = saved["setup"], saved["seeds"], list(saved["arms"])
  pcts = _pcts(setup)
  k = int(setup["max_k"])
  lines = [f"Command: `{saved['command']}` {results_md.where_seeds_ran(saved)}.", ""]
  lines += [
      f"Per seed one multi-turn SFT on {setup['num_sft']} noisy-expert demonstrations ({setup['sft_steps']} steps) "
      f"is the base policy and the start of every RL arm ({setup['rl_steps']} steps x {setup['maps_per_step']} maps "
      f"x {setup['group_size']} episodes; learning rate {setup['learning_rate']:g} in every arm, the library's RL "
      "default, not tuned for any arm). Pass@k at a budget of 25/50/75/100% of T_max (4x the shortest path): "
      f"{setup['num_samples']} episodes per map at temperature {setup['temperature']:g}; *prompted* re-runs the "
      "policy with the budget in its prompt, *truncated* counts the full-budget episodes that succeeded within it. "
      f"Step quality is Q*(s, a) / max Q*(s, .) (gamma 0.95) of the full-budget episodes' moves; recovery is the "
      f"success rate after an injected detour at {int(round(100 * setup['recovery_fraction']))}% of T_max. "
      "Mean ± 95% CI over seeds.", ""]
  finished = [s["seed"] for s in _finished(seeds)]
  if not set(PLANNED_SEEDS) <= set(finished):
    lines += [f"**In progress:** seeds finished {finished or 'none'} of the planned {list(PLANNED_SEEDS)}; the "
              "tables below hold the finished seeds only. The section's command goes on from the committed arms "
              "(`arms/` beside the results).", ""]
  lines += headroom_table(saved)
  if saved.get("stopped"):
    lines += ["", f"**Stopped:** {saved['stopped']}"]
  seeds = _finished(seeds)  # Every table pairs the same seeds: those with every arm.
  if not seeds:
    return "\n".join(lines)
  for split in setup["splits"]:
    maps = setup["num_maps"].get(split, "?")
    lines += ["", f"**{split}** ({maps} maps), prompted:", "", *pass_table(seeds, arms, split, "prompted", k, pcts),
              "", f"**{split}**, truncated:", "", *pass_table(seeds, arms, split, "truncated", k, pcts),
              "", f"**{split}**, Pass@1 prompted:", "", *pass_table(seeds, arms, split, "prompted", 1, pcts),
              "", f"**{split}**, step quality and recovery:", "", *quality_table(seeds, arms, split)]
  keyed = directions(seeds, arms, FAMILY_SPLIT, k)
  if keyed:
    results = holm_paired_intervals([c for _, c in keyed], saved["family_alpha"])
    lines += ["", f"Claimed directions on `{FAMILY_SPLIT}` (Pass@{k}, prompted; paired by seed):", "",
              *format_paired_table(results), "", "The paper's directions:", "",
              *claim_summary(list(zip([key for key, _ in keyed], results)))]
  lines += ["", f"Pass@(K,T) surfaces on `{FAMILY_SPLIT}` (mean over the finished seeds, both modes, per arm): "
            f"`{PLOT_FILE}`; raw numbers in `{RESULTS_FILE}`."]
  return "\n".join(lines)


def mean_pass_grids(saved: Mapping[str, Any], split: str = FAMILY_SPLIT) -> dict[str, dict[str, np.ndarray]]:
  """``{arm label: {mode: [F, K] Pass@(k, T)}}``, the mean over the finished seeds where the arm ran on ``split``."""
  seeds, pcts = _finished(saved["seeds"]), _pcts(saved["setup"])
  grids = {}
  for arm in saved["arms"]:
    done = _complete(seeds, (arm,), split)
    if done:
      grids[label(arm)] = {mode: np.mean([[_final(s, arm, split)["pass"][mode][str(p)] for p in pcts] for s in done],
                                         axis=0) for mode in ("prompted", "truncated")}
  return grids


def plot(saved: Mapping[str, Any], path: str, split: str = FAMILY_SPLIT) -> str:
  """The Pass@(K,T) heat maps of :func:`mean_pass_grids` (one row per arm), saved to ``path``."""
  from lemon_rl.eval.budget_eval import plot_pass_grids  # pylint: disable=g-import-not-at-top  (imports JAX)
  setup = saved["setup"]
  return plot_pass_grids(mean_pass_grids(saved, split), setup["fractions"], range(1, int(setup["max_k"]) + 1), path)
