"""The PPOW section: PPOW and its ablations against a compute-matched token-level drafter (held-out tau).

``saved`` (written by :mod:`experiments.reproduce_ppow`): ``command``, ``machine``, ``family_alpha``, ``arms``,
``seeds``, ``setup`` (steps, ``K``, ``G_roll``, prefixes, pool, evaluation sizes, ``gamma``), ``splits``
(the rows and the disjointness counts), ``calibration`` (CPU seconds per step of ``full`` and of
distillation, the control's steps), ``headroom`` (the step-0 gate's statistics and checks), ``tuning`` (the
``lemon_rl.eval.tuning`` record), ``start`` (seed -> split -> the start drafter's evaluation) and ``runs``
(one per arm and seed: ``arm``, ``seed``, ``lr``, ``steps``, ``curve``, ``cpu_s``, ``wall_s``, ``test`` and,
for the tuning seed, ``validation``: ``tau_greedy``, ``tau_t1``, ``accept_greedy``, ``accept_t1``,
``speedup_*``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from experiments.reports import figures
from lemon_rl.eval.stats import PairedComparison, format_mean_ci, format_paired_table, holm_paired_intervals

TITLE = "PPOW: window-level RL of the stdlib drafter (METHODS.md section 3)"
RESULTS_FILE = "experiments/results/ppow/results.json"
PLOT_FILE = "experiments/results/ppow/acceptance.png"
COMMAND = ("python -m experiments.reproduce_ppow --workdir=runs/ppow --init_from=SPEC_WORKDIR --seeds=0,1 "
           "--steps=10 --ppow_lrs=1e-4 --control_lrs=1e-4")
MISSING = "Not run yet."
ABLATIONS = ("no_dist", "no_adaw", "neither")
TEMPERATURES = (("greedy", "greedy"), ("t1", "T=1"))
PPOW_CURVE = "step_tau_reward_kl"  # ``curve_columns`` of a PPOW arm's run; the control's is a distillation loss.


def _test(saved: Mapping[str, Any], arm: str, seed: int, key: str) -> float | None:
  for r in saved["runs"]:
    if r["arm"] == arm and r["seed"] == seed:
      return r["test"][key]
  return None


def _differences(saved, a: str, b: str, key: str) -> list[float]:
  """Per-seed ``a - b`` on the test split (seeds where both arms ran)."""
  out = []
  for s in saved["seeds"]:
    x, y = _test(saved, a, s, key), _test(saved, b, s, key)
    if x is not None and y is not None:
      out.append(x - y)
  return out


def directions(saved: Mapping[str, Any]) -> list[PairedComparison]:
  """The paper's directions, fixed before the run: PPOW ``tau`` > token-level ``tau``, each ablation lowers
  ``tau`` (full - ablation > 0), at greedy and at temperature 1 (over the arms that ran)."""
  arms, out = saved["arms"], []
  for key, label in TEMPERATURES:
    if "full" in arms and "control" in arms:
      out.append(PairedComparison(f"full - token-level control, tau {label}", +1,
                                  _differences(saved, "full", "control", f"tau_{key}")))
    for ablation in ABLATIONS:
      if "full" in arms and ablation in arms:
        out.append(PairedComparison(f"full - {ablation}, tau {label}", +1,
                                    _differences(saved, "full", ablation, f"tau_{key}")))
  return out


def _row(name: str, evals: list[Mapping[str, Any]], extra: str) -> str:
  cols = [format_mean_ci([e[f"tau_{k}"] for e in evals]) for k, _ in TEMPERATURES]
  cols.append(format_mean_ci([e["speedup_greedy"] for e in evals]))
  k = len(evals[0]["accept_greedy"])
  for key, _ in TEMPERATURES:
    cols.append(" / ".join(f"{sum(e[f'accept_{key}'][j] for e in evals) / len(evals):.2f}" for j in range(k)))
  return f"| {name} | {len(evals)} | " + " | ".join(cols) + f" | {extra} |"


def render(saved: Mapping[str, Any]) -> str:
  setup, seeds, arms = saved["setup"], saved["seeds"], saved["arms"]
  chosen = saved["tuning"]["arms"]
  rows = ["| drafter | seeds | tau greedy | tau T=1 | implied speedup (greedy) | accept per position greedy | "
          "accept per position T=1 | lr (validation) / steps / CPU s |",
          "|---|---|---|---|---|---|---|---|"]
  rows.append(_row("start (token-level, spec run)", [saved["start"][str(s)]["test"] for s in seeds], "-"))
  for arm in arms:
    runs = [r for r in saved["runs"] if r["arm"] == arm]
    if not runs:
      continue
    cpu = sum(r["cpu_s"] for r in runs) / len(runs)
    name = "token-level control (distillation)" if arm == "control" else f"PPOW {arm}"
    rows.append(_row(name, [r["test"] for r in runs],
                     f"{chosen[arm]['chosen_params']['learning_rate']:g} / {runs[0]['steps']} / {cpu:.0f}"))
  trial_rows = ["| arm | " + " | ".join(f"trial {i + 1}: lr, validation score" for i in
                                        range(saved["tuning"]["trials_per_arm"])) + " | chosen |",
                "|---|" + "---|" * saved["tuning"]["trials_per_arm"] + "---|"]
  for arm, record in chosen.items():
    trial_rows.append(f"| {arm} | " + " | ".join(
        f"{t['params']['learning_rate']:g}, {t['score']:.3f}" if t["score"] is not None else
        f"{t['params']['learning_rate']:g}, none" for t in record["trials"]) +
        f" | {record['chosen_params']['learning_rate']:g} |")
  gate = saved["headroom"]
  checks = "; ".join(f"{c['statistic']} {c['value']:.3f} ({c['bound']} {c['threshold']:g}: "
                     f"{'pass' if c['passed'] else 'FAIL'})" for c in gate["checks"])
  d, cal = saved["splits"]["disjointness"], saved["calibration"]
  results = holm_paired_intervals(directions(saved), saved["family_alpha"])
  lines = [
      f"Command: `{saved['command']}` on {saved['machine']}.",
      "",
      f"Held-out `tau` (tokens per target forward, bonus token included) of the stdlib target's EAGLE-3 drafter "
      f"with `K = {setup['num_draft']}`, decoded by the lossless engine on {setup['eval_prompts']} test prompts "
      f"of {setup['prompt_len']} tokens ({setup['max_new_tokens']} new tokens), the same prompts and key for "
      f"every arm of a seed. Every arm starts from the same token-level drafter. PPOW: {setup['ppow_steps']} "
      f"steps of {setup['num_prefixes']} prefixes x {setup['group_size']} windows (pool of "
      f"{setup['pool_rows']} rows, `gamma` {setup['gamma_reward']:g} in the reward). Control: token "
      f"distillation (the spec run's loss, batch {setup['distill_batch']}) for {setup['control_steps']} steps, "
      f"the CPU time of {setup['ppow_steps']} steps of `full` ({cal['ppow_full_cpu_s']:.2f} vs "
      f"{cal['distill_cpu_s']:.2f} CPU s a step, measured after compiling). Implied speedup "
      f"`tau / (1 + K gamma)` with the measured `gamma` {setup['gamma_measured']:.3f}.",
      "",
      f"Splits: validation and test prompts are disjoint rows of the held-out files; none of the "
      f"{d['validation_prompts']} validation and {d['test_prompts']} test prompts occurs among the "
      f"{d['train_windows']} {d['window_length']}-token windows of the distillation data "
      f"({d['validation_in_train']} and {d['test_in_train']} found), {d['validation_in_test']} shared. "
      f"Step-0 headroom gate: {checks}.",
      "",
      *rows,
      "",
      (f"Learning rate chosen per arm on the validation split ({saved['tuning']['metric']}, seed {seeds[0]}, "
       f"{saved['tuning']['trials_per_arm']} trials per arm):" if saved["tuning"]["trials_per_arm"] > 1 else
       "One learning rate per arm, fixed before the run (no tuning: one trial per arm; its validation score "
       f"is recorded, {saved['tuning']['metric']}, seed {seeds[0]}):"),
      "",
      *trial_rows,
      "",
      *format_paired_table(results),
      "",
      f"Per-position acceptance on the test prompts (mean over seeds, every drafter) and the PPOW arms' "
      f"training-window `tau` over steps: `{PLOT_FILE}`; raw numbers in `{RESULTS_FILE}`.",
  ]
  return "\n".join(lines)


def mean_acceptance(saved: Mapping[str, Any], key: str) -> dict[str, np.ndarray]:
  """``{drafter: [K]}``: each draft position's test acceptance rate, the mean over the seeds, for the start
  drafter (``"start"``) and every arm that ran; ``key`` is ``accept_greedy`` or ``accept_t1``."""
  out = {"start": np.mean([saved["start"][str(s)]["test"][key] for s in saved["seeds"]], axis=0)}
  for arm in saved["arms"]:
    rows = [r["test"][key] for r in saved["runs"] if r["arm"] == arm]
    if rows:
      out[arm] = np.mean(rows, axis=0)
  return out


def training_tau(saved: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """``{PPOW arm: (steps [N], tau [N])}``: the training windows' ``tau`` at each step (rows of a
  :data:`PPOW_CURVE` curve), the mean over the seeds (the control's curve is a distillation loss and is left out)."""
  out = {}
  for arm in saved["arms"]:
    runs = [r for r in saved["runs"] if r["arm"] == arm and r["curve_columns"] == PPOW_CURVE]
    if runs:
      n = min(len(r["curve"]) for r in runs)
      out[arm] = (np.asarray([row[0] for row in runs[0]["curve"][:n]]),
                  np.mean([[row[1] for row in r["curve"][:n]] for r in runs], axis=0))
  return out


def plot(saved: Mapping[str, Any], path: str) -> str:
  """Per-position test acceptance (greedy, T=1) of every drafter and PPOW's training ``tau``, saved to ``path``."""
  fig, axes = figures.panels(3)
  for ax, (key, label) in zip(axes, TEMPERATURES):
    for name, rates in mean_acceptance(saved, f"accept_{key}").items():
      ax.plot(np.arange(1, len(rates) + 1), rates, marker="o", label=name,
              linestyle="--" if name in ("start", "control") else "-")
    ax.set_xticks(np.arange(1, saved["setup"]["num_draft"] + 1))
    ax.set_title(f"test acceptance per draft position, {label}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
  for arm, (steps, tau) in training_tau(saved).items():
    axes[2].plot(steps, tau, label=arm)
  axes[2].set_title("PPOW training windows: tau (mean over seeds)")
  axes[2].set_xlabel("PPOW step")
  return figures.save(fig, axes, path)
