"""The FEST section: FEST-GRPO / FEST-DPO against pure GRPO, two SFT-then-GRPO controls and fixed-weight FEST.

``saved`` (written by :mod:`experiments.reproduce_fest`): ``command``, ``machine``, ``done``,
``family_alpha``, ``arms``, ``seeds``, ``setup`` (the config facts the text states), ``headroom`` (the step-0
gate's statistics and checks), ``tuning`` (the ``lemon_rl.eval.tuning`` record), ``tuning_runs`` (every
tuning trial's run record) and ``runs``: one record per
run (``arm`` or ``"start"``, ``seed``, ``lr``, ``final`` scores, greedy ``curve``, ``wall_s`` per phase run,
FEST ``diagnostics``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from experiments.reports import figures
from lemon_rl.eval.stats import PairedComparison, format_mean_ci, format_paired_table, holm_paired_intervals

TITLE = "FEST"
RESULTS_FILE = "experiments/results/fest/results.json"
PLOT_FILE = "experiments/results/fest/curves.png"
COMMAND = "python -m experiments.reproduce_fest --workdir=runs/fest"

LABELS = {"start": "easy-SFT start", "grpo": "pure GRPO", "mixed_sft_grpo": "mixed SFT then GRPO",
          "shots_sft_grpo": "SFT on the shots then GRPO", "fest_dpo": "FEST-DPO", "fest_grpo": "FEST-GRPO",
          "fest_grpo_fixed_w": "FEST-GRPO, w fixed"}
# The paper's directions (each "a > b"): FEST above pure RL and above SFT-then-RL, FEST-GRPO at least FEST-DPO
# (42.36 vs 41.98 Avg@8), and the decaying weight (the gradient identity) above a fixed one.
DIRECTIONS = (("fest_grpo", "grpo"), ("fest_dpo", "grpo"), ("fest_grpo", "mixed_sft_grpo"),
              ("fest_grpo", "shots_sft_grpo"), ("fest_grpo", "fest_dpo"), ("fest_grpo", "fest_grpo_fixed_w"))


def gate_statistics(start_final: Mapping[str, float], k: int) -> dict[str, float]:
  """The step-0 gate's statistics from the start's final scores (``config.headroom`` names them)."""
  return {"hard_validation_pass_at_k": start_final[f"validation/pass@{k}"],
          "hard_validation_all_wrong": start_final["validation/all_wrong"],
          "easy_accuracy": start_final["easy/accuracy"]}


def _final(saved, arm: str, seed: int) -> Mapping[str, float] | None:
  for r in saved["runs"]:
    if r["arm"] == arm and r["seed"] == seed:
      return r["final"]
  return None


def _differences(saved, a: str, b: str, metric: str) -> list[float]:
  """Per-seed ``a - b`` of a test ``metric`` (seeds where both arms ran)."""
  out = []
  for s in saved["seeds"]:
    x, y = _final(saved, a, s), _final(saved, b, s)
    if x is not None and y is not None:
      out.append(x[metric] - y[metric])
  return out


def paired_results(saved: Mapping[str, Any]):
  """The Holm family: every direction of ``DIRECTIONS`` in hard-test Avg@k and Pass@k."""
  k = saved["setup"]["eval_samples"]
  family = []
  for metric in (f"hard/avg@{k}", f"hard/pass@{k}"):
    for a, b in DIRECTIONS:
      if a in saved["arms"] and b in saved["arms"]:
        diffs = _differences(saved, a, b, metric)
        if diffs:
          family.append(PairedComparison(f"{LABELS[a]} - {LABELS[b]}, {metric}", +1, diffs))
  return holm_paired_intervals(family, saved["family_alpha"]) if family else []


def _main_table(saved, k: int) -> list[str]:
  cols = [f"hard/avg@{k}", f"hard/pass@{k}", f"shifted/avg@{k}", f"shifted/pass@{k}", "hard/all_wrong",
          "hard/complete", "hard/line_accuracy", "easy/accuracy"]
  rows = ["| arm | RL lr | seeds | hard Avg@k | hard Pass@k | shifted Avg@k | shifted Pass@k | hard all-wrong | "
          "hard complete | hard line acc | easy greedy acc | wall s / run |".replace("@k", f"@{k}"),
          "|" + "---|" * (len(cols) + 4)]
  for arm in ("start", *saved["arms"]):
    runs = [r for r in saved["runs"] if r["arm"] == arm]
    if not runs:
      continue
    cells = [format_mean_ci([r["final"][c] for r in runs]) for c in cols]
    rows.append(f"| {LABELS[arm]} | {runs[0]['lr'] if runs[0]['lr'] is not None else '-'} | "
                f"{','.join(str(r['seed']) for r in runs)} | " + " | ".join(cells)
                + f" | {np.mean([sum(r['wall_s'].values()) for r in runs]):.0f} |")
  return rows


def _tuning_lines(saved, k: int) -> list[str]:
  tuning = saved.get("tuning")
  if not tuning:
    return ["Tuning: not finished."]
  lrs = saved["setup"]["learning_rates"]
  rows = [f"Tuning ({tuning['metric']} on `{tuning['split']}`, seed {saved['seeds'][0]}, {tuning['trials_per_arm']} "
          "trials per arm, ties to the first):", "",
          "| arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |", "|" + "---|" * (len(lrs) + 2)]
  for arm, rec in tuning["arms"].items():
    scores = [f"{t['score']:.3f}" if t["score"] is not None else "-" for t in rec["trials"]]
    rows.append(f"| {LABELS[arm]} | " + " | ".join(scores) + f" | {rec['chosen_params']['learning_rate']:g} |")
  return rows


def _diagnostics(saved) -> list[str]:
  lines = []
  for arm in saved["arms"]:
    ds = [r["diagnostics"] for r in saved["runs"] if r["arm"] == arm and r.get("diagnostics")]
    if not ds:
      continue
    f = lambda key, ds=ds: (f"{np.mean([d[key + '/first'] for d in ds]):.3g} -> "
                            f"{np.mean([d[key + '/last'] for d in ds]):.3g}")
    lines.append(f"- {LABELS[arm]} ({len(ds)} runs): w {f('fest/decaying_weight/mean')}; margin z "
                 f"{f('train/expert/reward_margin')}; all-wrong groups `D_E` / `D_I` "
                 f"{f('fest/frac_all_wrong_groups_expert')} / {f('fest/frac_all_wrong_groups_rl')}; reward "
                 f"`D_E` / `D_I` {f('fest/reward_expert_stream')} / {f('fest/reward_rl_stream')}")
  if lines:
    lines.insert(0, "FEST step diagnostics (mean over seeds of steps 2-9 -> the last 8 RL steps): decaying weight "
                 "`w`, sequence log-ratio margin `z = r+ - r-`, share of all-wrong groups, reward per stream:")
  return lines


def render(saved: Mapping[str, Any]) -> str:
  setup = saved["setup"]
  k = setup["eval_samples"]
  betas = "/".join(f"{b:g}" for b in setup["betas"])
  gate = saved.get("headroom")
  gate_line = ("Step-0 headroom gate (first seed's start, validation split, thresholds fixed in "
               "`configs/fest_math.py`): " + ("; ".join(
                   f"{c['statistic']} = {c['value']:.3f} ({'>=' if c['bound'] == 'min' else '<='} "
                   f"{c['threshold']:g}: {'ok' if c['passed'] else 'FAILED'})" for c in gate["checks"])
                   if gate else "not run."))
  records = {(r["arm"], r["seed"], r["lr"]): r for r in saved["runs"] + saved.get("tuning_runs", [])}
  wall = sum(sum(r["wall_s"].values()) for r in records.values()) / 60
  lines = [
      f"Command: `{saved['command']}` on {saved['machine']}: {len(records)} runs, {wall:.0f} min of wall time "
      f"in their phases{'' if saved['done'] else '; PARTIAL: still running or stopped early'}.",
      "",
      f"Task `fest_math` (redesigned in issue 10): a tiny decoder (`{setup['preset']}` preset) is fine-tuned on "
      f"worked solutions of 1-2 step chains read left to right ({setup['sft_steps']} steps x "
      f"{setup['sft_batch']}); RL then trains for {setup['rl_steps']} steps on 2-step chains under a rule it never "
      "saw (`?`: apply the written operations right to left; every chain order-sensitive), with "
      f"{setup['num_shots']} worked `?` solutions as `D_E`. FEST: {setup['rl_prompts']} `D_I` + "
      f"{setup['expert_prompts']} `D_E` prompts x {setup['num_generations']} rollouts per step, betas {betas} "
      f"(from a pilot of the margin, `beta1 >= beta2 >= beta3`), c = {setup['c']}; FEST-GRPO with w fixed "
      "holds `w = beta / 2`. The GRPO arms get "
      f"{setup['grpo_prompts']} `D_I` prompts per step (same sampling budget); mixed SFT runs "
      f"{setup['mixed_sft_steps']} steps x {setup['expert_sft_batch']} on the shots plus "
      f"{setup['mixed_easy_per_shot']} easy demonstrations per shot, SFT on the shots {setup['shots_sft_steps']} "
      f"steps x {setup['expert_sft_batch']} (lr {setup['expert_sft_lr']:g}), both before GRPO. "
      f"{setup['num_iterations']} update per batch, dr_grpo advantages, clip 0.2/0.28, no KL.",
      "",
      gate_line,
      "",
      *_tuning_lines(saved, k),
      "",
      f"Scores on the TEST splits: Avg@{k} / Pass@{k} at temperature {setup['eval_temperature']} on "
      f"{setup['eval_examples']} hard problems and {setup['eval_shifted']} shifted (3-step `?`) problems; "
      "'all-wrong' = share of hard problems with no correct sample; 'complete' = share of samples with one line "
      "per step; 'line acc' = share of written lines that are true arithmetic; 'easy greedy acc' = greedy "
      "accuracy on held-out 1-2 step `=` chains (forgetting). Mean ± 95% CI (Student t) over the seeds listed; "
      "every arm at its chosen learning rate.",
      "",
      *_main_table(saved, k),
      "",
  ]
  results = paired_results(saved)
  if results:
    lines += [f"Paired differences over seeds (same seed, same start), one Holm family of {len(results)} at "
              f"familywise alpha {saved['family_alpha']}; each is read as first arm > second:", "",
              *format_paired_table(results)]
  diagnostics = _diagnostics(saved)
  if diagnostics:
    lines += ["", *diagnostics]
  lines += ["", f"Curves (greedy hard-test accuracy over RL steps, per run): `{PLOT_FILE}`; raw numbers in "
            f"`{RESULTS_FILE}`."]
  return "\n".join(lines)


def plot(saved: Mapping[str, Any], path: str) -> None:
  """Greedy hard-test accuracy over RL steps, one line per run, one colour per arm."""
  fig, (ax,) = figures.panels(1, width=7.0, height=4.0)
  colors = dict(zip(LABELS, ("grey", "k", "tab:orange", "tab:red", "tab:blue", "tab:green", "tab:olive")))
  labelled = set()
  for r in saved["runs"]:
    if not r["curve"]:
      continue
    steps, acc = zip(*r["curve"])
    ax.plot(steps, acc, color=colors[r["arm"]], alpha=0.6,
            label=None if r["arm"] in labelled else LABELS[r["arm"]])
    labelled.add(r["arm"])
  ax.set_xlabel("RL step")
  ax.set_ylabel("greedy hard-test accuracy")
  figures.save(fig, [ax], path)
