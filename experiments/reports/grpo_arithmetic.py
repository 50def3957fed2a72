"""The default experiment's section: GRPO vs the SFT it starts from and vs the same compute spent on more SFT.

``saved`` (written by :mod:`experiments.reproduce_grpo_arithmetic`): ``command``, ``setup`` (step counts,
batch sizes, analytic FLOPs per step of each phase), ``machine``, ``family_alpha`` and one record per seed with
``grpo`` and ``sft_control`` runs: final held-out accuracy and carry-less share after each phase, the held-out
evaluations along the way (``evals``: phase, step, accuracy, carryless), the RL reward per step, wall and CPU
times of the process.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from experiments.reports import figures
from lemon_rl.eval.stats import PairedComparison, format_mean_ci, format_paired_table, holm_paired_intervals

TITLE = "GRPO arithmetic (default experiment)"
RESULTS_FILE = "experiments/results/grpo_arithmetic/results.json"
PLOT_FILE = "experiments/results/grpo_arithmetic/curves.png"
COMMAND = "python -m experiments.reproduce_grpo_arithmetic --workdir=runs/grpo_arithmetic --seeds=0,1,2,3,4"


def directions(seeds: list[Mapping[str, Any]]) -> list[PairedComparison]:
  """The family of claimed directions (fixed before the run), as per-seed paired differences."""
  acc = lambda s, run, phase: s[run]["final"][phase]["accuracy"]
  carry = lambda s, run, phase: s[run]["final"][phase]["carryless"]
  return [
      PairedComparison("GRPO - its SFT start, accuracy", +1, [acc(s, "grpo", "rl") - acc(s, "grpo", "sft")
                                                              for s in seeds]),
      PairedComparison("GRPO - FLOP-matched more SFT, accuracy", +1,
                       [acc(s, "grpo", "rl") - acc(s, "sft_control", "continued_sft") for s in seeds]),
      PairedComparison("GRPO - FLOP-matched more SFT, carry-less share", -1,
                       [carry(s, "grpo", "rl") - carry(s, "sft_control", "continued_sft") for s in seeds]),
  ]


def _minutes(seconds: float) -> str:
  return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def render(saved: Mapping[str, Any]) -> str:
  setup, seeds = saved["setup"], saved["seeds"]
  rows = ["| seed | SFT acc | GRPO acc | more-SFT acc | SFT carry-less | GRPO carry-less | more-SFT carry-less | "
          "GRPO run wall / user / sys s | more-SFT run wall s |", "|---|---|---|---|---|---|---|---|---|"]
  for s in seeds:
    g, c = s["grpo"], s["sft_control"]
    rows.append(f"| {s['seed']} | {g['final']['sft']['accuracy']:.3f} | {g['final']['rl']['accuracy']:.3f} | "
                f"{c['final']['continued_sft']['accuracy']:.3f} | {g['final']['sft']['carryless']:.3f} | "
                f"{g['final']['rl']['carryless']:.3f} | {c['final']['continued_sft']['carryless']:.3f} | "
                f"{g['wall_s']:.0f} / {g['user_s']:.0f} / {g['system_s']:.0f} | {c['wall_s']:.0f} |")
  column = lambda run, phase, key: [s[run]["final"][phase][key] for s in seeds]
  rows.append(f"| mean ± 95% CI | {format_mean_ci(column('grpo', 'sft', 'accuracy'))} | "
              f"{format_mean_ci(column('grpo', 'rl', 'accuracy'))} | "
              f"{format_mean_ci(column('sft_control', 'continued_sft', 'accuracy'))} | "
              f"{format_mean_ci(column('grpo', 'sft', 'carryless'))} | "
              f"{format_mean_ci(column('grpo', 'rl', 'carryless'))} | "
              f"{format_mean_ci(column('sft_control', 'continued_sft', 'carryless'))} | | |")
  results = holm_paired_intervals(directions(seeds), saved["family_alpha"])
  gflop = lambda phase: setup["flops_per_step"][phase] / 1e9
  lines = [
      f"Command: `{saved['command']}` on {saved['machine']}.",
      "",
      f"Held-out exact accuracy (greedy) on {setup['eval_examples']} test problems and the share of carry-less "
      f"answers (the sloppy teacher's systematic mistake). Per seed, one SFT run ({setup['sft_steps']} steps x "
      f"{setup['sft_batch']} demonstrations, {gflop('sft'):.2f} GFLOP a step) is continued two ways from the same "
      f"checkpoint: GRPO ({setup['rl_steps']} steps x {setup['rl_rows']} completions, {gflop('rl'):.2f} GFLOP a "
      f"step) or more SFT of the same compute ({setup['continued_sft_steps']} steps, GRPO's optimizer settings; "
      "analytic FLOPs of the padded shapes, `lemon_rl.models.flops`). Wall / user / system seconds are those of "
      "the whole GRPO run's process (data generation, SFT, GRPO, evaluations): the README's main job.",
      "",
      *rows,
      "",
      *format_paired_table(results),
      "",
      f"Curves (held-out accuracy and carry-less share against cumulative training FLOPs, both arms, every "
      f"seed): `{PLOT_FILE}`.",
  ]
  return "\n".join(lines)


def plot(saved: Mapping[str, Any], path: str) -> None:
  """Accuracy and carry-less share against cumulative training FLOPs: SFT, then GRPO or more SFT."""
  per_step, sft_steps = saved["setup"]["flops_per_step"], saved["setup"]["sft_steps"]
  offset = {"sft": 0.0, "rl": sft_steps * per_step["sft"], "continued_sft": sft_steps * per_step["sft"]}
  style = {("grpo", "sft"): ("tab:gray", "SFT"), ("grpo", "rl"): ("tab:red", "GRPO"),
           ("sft_control", "continued_sft"): ("tab:blue", "more SFT (same FLOPs as GRPO)")}
  fig, axes = figures.panels(2, width=5.5)
  for ax, key, title in zip(axes, ("accuracy", "carryless"), ("held-out accuracy", "carry-less answers")):
    labelled = set()
    for s in saved["seeds"]:
      for (run, phase), (color, label) in style.items():
        pts = sorted((offset[phase] + e["step"] * per_step[phase], e[key]) for e in s[run]["evals"]
                     if e["phase"] == phase)
        if pts:
          xs, ys = np.asarray(pts).T
          ax.plot(xs / 1e12, ys, color=color, alpha=0.6, marker=".", label=None if label in labelled else label)
          labelled.add(label)
    ax.axvline(offset["rl"] / 1e12, color="k", lw=0.5, ls=":")
    ax.set_xlabel("cumulative training TFLOP (analytic)")
    ax.set_title(title)
  figures.save(fig, axes, path)
