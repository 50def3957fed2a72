"""The speculative-GRPO section: GRPO with and without speculative rollouts, equivalence and speed.

``saved`` (written by :mod:`experiments.reproduce_speculative_grpo`): ``command``, ``machine``, ``arms``,
``seeds``, ``margin``, ``family_alpha``, ``config`` (``configs/speculative_grpo.py`` as a dict),
``disjointness`` (split sizes and overlap counts), ``headroom`` (the step-0 gate), ``runs`` (one per arm and
seed: ``arm``, ``seed``, ``steps``, ``curve`` (per step: ``step_s``, ``time/sample_s``, reward, ``rollout/*``)
and ``test`` (``reward_t1``, ``reward_greedy``, lengths)).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from experiments.reports import figures
from lemon_rl.eval.stats import (PairedComparison, format_mean_ci, format_paired_table, holm_equivalence,
                                 holm_paired_intervals)

TITLE = "Speculative rollouts inside GRPO: the stdlib policy with a Python syntax reward (METHODS.md section 3)"
RESULTS_FILE = "experiments/results/speculative_grpo/results.json"
PLOT_FILE = "experiments/results/speculative_grpo/rollouts.png"
COMMAND = ("python -m experiments.reproduce_speculative_grpo --workdir=runs/spec_grpo --init_from=SPEC_WORKDIR "
           "--seeds=0,1,2")
MISSING = "Not run yet."
ENDPOINTS = (("reward_t1", "test reward, T=1"), ("reward_greedy", "test validity, greedy"))
ROLLOUT_TARGET = 1.3  # The target rollout speedup at batch 8-32.


def _run(saved: Mapping[str, Any], arm: str, seed: int) -> Mapping[str, Any] | None:
  return next((r for r in saved["runs"] if r["arm"] == arm and r["seed"] == seed), None)


def _pairs(saved: Mapping[str, Any], arm: str,
           base: str = "plain") -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
  """``(base run, arm run)`` of every seed both ran."""
  pairs = [(_run(saved, base, s), _run(saved, arm, s)) for s in saved["seeds"]]
  return [(p, a) for p, a in pairs if p and a]


def _mean_tau(run: Mapping[str, Any]) -> float:
  """Mean rollout ``tau`` over a run's steps."""
  return float(np.mean([row["rollout/tau"] for row in run["curve"]]))


def equivalence_family(saved: Mapping[str, Any]) -> list[PairedComparison]:
  """Each speculative arm minus ``plain``, per seed, on each test endpoint (fixed before the run)."""
  return [PairedComparison(f"{arm} - plain, {label}", +1,
                           [a["test"][key] - p["test"][key] for p, a in _pairs(saved, arm)])
          for arm in saved["arms"] if arm != "plain" for key, label in ENDPOINTS]


def refresh_family(saved: Mapping[str, Any]) -> list[PairedComparison]:
  """PPOW refreshes against per-step distillation, per seed (both speculate on every step): the rollouts'
  mean ``tau`` (PPOW aims higher) and the total step seconds saved (``speculative`` minus ``ppow_refresh``:
  a refresh every few steps aims to cost less); ``[]`` unless both arms ran."""
  if not {"speculative", "ppow_refresh"} <= set(saved["arms"]):
    return []
  pairs = _pairs(saved, "ppow_refresh", base="speculative")
  total_s = lambda r: float(sum(row["step_s"] for row in r["curve"]))
  return [PairedComparison("ppow_refresh - speculative, mean rollout tau", +1,
                           [_mean_tau(p) - _mean_tau(d) for d, p in pairs]),
          PairedComparison("speculative - ppow_refresh, total step seconds", +1,
                           [total_s(d) - total_s(p) for d, p in pairs])]


def coupling_family(saved: Mapping[str, Any]) -> list[PairedComparison]:
  """What Gumbel coupling costs in acceptance: ``residual`` minus ``speculative`` mean rollout ``tau`` per
  seed (both speculate on every step with a distilled drafter; the residual verifier's acceptance is the
  optimal 1 - TV, coupling's at least (1 - TV) / (1 + TV)); ``[]`` unless both ran with the coupled arm coupled."""
  if not {"speculative", "residual"} <= set(saved["arms"]) or not saved["config"]["rl"].get("coupled_noise"):
    return []
  return [PairedComparison("residual - speculative (coupled), mean rollout tau", +1,
                           [_mean_tau(r) - _mean_tau(c) for c, r in _pairs(saved, "residual", base="speculative")])]


def per_step(saved: Mapping[str, Any], arm: str, value) -> np.ndarray:
  """``[seeds, steps]``: ``value(plain row, arm row)`` at every step of every seed both ran (the steps all
  those seeds have)."""
  pairs = _pairs(saved, arm)
  if not pairs:
    return np.zeros((0, 0))
  n = min(min(len(p["curve"]), len(a["curve"])) for p, a in pairs)
  return np.asarray([[value(x, y) for x, y in zip(p["curve"][:n], a["curve"][:n])] for p, a in pairs])


def step_ratios(saved: Mapping[str, Any], arm: str, key: str) -> np.ndarray:
  """``plain / arm`` of ``key`` (``step_s`` or ``time/sample_s``) per (seed, step)."""
  return per_step(saved, arm, lambda x, y: x[key] / y[key]).ravel()


def total_ratio(saved: Mapping[str, Any], arm: str, key: str) -> float:
  """Total ``key`` seconds of ``plain`` over those of ``arm`` (the same seeds, every step)."""
  pairs = _pairs(saved, arm)
  return (sum(x[key] for p, _ in pairs for x in p["curve"]) / sum(y[key] for _, a in pairs for y in a["curve"]))


def slower_speculative_steps(saved: Mapping[str, Any], arm: str) -> tuple[int, int, float]:
  """``(steps slower than plain's, steps compared, least ratio)`` over the steps on which ``arm`` speculated
  (``rollout/speculative_on``), by ``plain / arm`` of ``step_s`` on the same seed and step; ``nan`` for no
  such step. A step the cost model ran with plain sampling compares plain with itself: only timing noise."""
  on = per_step(saved, arm, lambda x, y: bool(y.get("rollout/speculative_on"))).ravel().astype(bool)
  spec = step_ratios(saved, arm, "step_s")[on]
  return int((spec < 1).sum()), int(spec.size), float(spec.min()) if spec.size else float("nan")


def same_samples(saved: Mapping[str, Any], arm: str) -> tuple[int, int] | None:
  """``(steps whose rollout equals plain's, steps compared)`` over the seeds both ran, from the per-step
  ``rollout_sha``; ``None`` for runs recorded without it."""
  pairs = _pairs(saved, arm)
  rows = [(x.get("rollout_sha"), y.get("rollout_sha")) for p, a in pairs for x, y in zip(p["curve"], a["curve"])]
  if not rows or any(x is None or y is None for x, y in rows):
    return None
  return sum(x == y for x, y in rows), len(rows)


def _arm_row(saved: Mapping[str, Any], arm: str) -> str:
  runs = [r for r in saved["runs"] if r["arm"] == arm]
  curve = [row for r in runs for row in r["curve"]]
  on = [row for row in curve if row.get("rollout/speculative_on")]
  tau = f"{np.mean([row['rollout/tau'] for row in on]):.2f}" if on else "-"
  last = [np.mean([row["reward/total/mean"] for row in r["curve"][-10:]]) for r in runs]
  cols = [f"{len(runs)}", format_mean_ci([r["test"]["reward_t1"] for r in runs]),
          format_mean_ci([r["test"]["reward_greedy"] for r in runs]), format_mean_ci(last)]
  if arm == "plain":
    cols += ["-", "-", "-", "1", "1", "-"]
  else:
    step, sample = step_ratios(saved, arm, "step_s"), step_ratios(saved, arm, "time/sample_s")
    same, (slower, compared, least) = same_samples(saved, arm), slower_speculative_steps(saved, arm)
    cols += [f"{len(on)}/{len(curve)}", "-" if same is None else f"{same[0]}/{same[1]}", tau,
             f"{total_ratio(saved, arm, 'time/sample_s'):.2f}x (median {np.median(sample):.2f}x)",
             f"{total_ratio(saved, arm, 'step_s'):.2f}x (median {np.median(step):.2f}x)",
             f"{slower}/{compared}" + (f" (min {least:.2f}x)" if compared else "")]
  return f"| {arm} | " + " | ".join(cols) + " |"


def render(saved: Mapping[str, Any]) -> str:
  c, d, gate = saved["config"], saved["disjointness"], saved["headroom"]
  rl, spec = c["rl"], c["rl"]["speculative"]
  checks = "; ".join(f"{x['statistic']} {x['value']:.3f} ({x['bound']} {x['threshold']:g}: "
                     f"{'pass' if x['passed'] else 'FAIL'})" for x in gate["checks"])
  rows = ["| arm | seeds | test reward T=1 | test validity greedy | train reward, last 10 steps | "
          "speculative steps | steps with plain's samples | tau | rollout speedup | step speedup | "
          "speculative steps slower than plain |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
  rows += [_arm_row(saved, arm) for arm in saved["arms"]]
  results = holm_equivalence(equivalence_family(saved), saved["margin"], saved["family_alpha"])
  eq_rows = ["| comparison | seeds | mean difference | interval | TOST p | Holm-adjusted p | verdict |",
             "|---|---|---|---|---|---|---|"]
  eq_rows += [f"| {r.name} | {r.n} | {r.mean:+.3f} | [{r.lower:+.3f}, {r.upper:+.3f}] ({r.confidence:.1%}) | "
              f"{r.p_value:.3g} | {r.adjusted_p_value:.3g} | {r.verdict} |" for r in results]
  speed = []
  for arm in saved["arms"]:
    if arm != "plain":
      ratio = total_ratio(saved, arm, "time/sample_s")
      speed.append(f"`{arm}` rollout {ratio:.2f}x: the {ROLLOUT_TARGET}x target is "
                   f"{'met' if ratio >= ROLLOUT_TARGET else 'not met'}")
  lines = [
      f"Command: `{saved['command']}` on {saved['machine']}.",
      "",
      f"The stdlib target (`configs/stdlib_speculative.py`) as the policy, GRPO for {rl['steps']} steps of "
      f"{rl['prompts_per_step']} prompts x {rl['num_generations']} completions (rollout batch "
      f"{rl['prompts_per_step'] * rl['num_generations']}) of up to {rl['max_new_tokens']} tokens at temperature "
      f"{rl['temperature']:g}, lr {rl['learning_rate']:g}; prompts are standard-library function heads, the "
      f"reward is 1 when head + completion is valid Python so far and the completion has at least "
      f"{c['reward_min_lines']} complete lines (`lemon_rl.rewards.python_syntax`). "
      f"Speculative arms: the spec run's EAGLE-3 head as the start drafter, `K = {spec['num_draft']}`, "
      f"distilled to the policy after every update; `speculative` drafts on every step, `cost_model` when "
      f"the measured costs predict a gain"
      + (f"; `ppow_refresh` drafts on every step with the drafter refreshed by PPOW every "
         f"{c['ppow_refresh_every']} steps instead" if "ppow_refresh" in saved["arms"] else "")
      + (". Rollouts sample with coupled noise (`rl.coupled_noise`: Gumbel noise per row and token "
         "position, `lemon_rl.sampling.distribution.coupled_noise`), so a speculative rollout of a seed and "
         "step emits plain's tokens while the policies agree; *steps with plain's samples* counts the steps "
         "whose rollout token ids equal plain's (SHA-256)" if rl.get("coupled_noise") else "")
      + ("; `residual` speculates on every step with the residual method's verification and per-step noise "
         "(not coupled)" if "residual" in saved["arms"] else "")
      + ". Test evaluation with plain `generate`, the same key for every arm: "
      f"{c['eval']['samples_per_prompt']} samples per test prompt at T=1 and one greedy. Speedups are "
      f"`plain / arm` of the total seconds over the same seeds and steps (after a warm-up run compiled "
      f"everything), with the median of the per-step ratios; the step includes the drafter's refit.",
      "",
      f"Splits (function heads, disjoint by package): {d['train_prompts']} train, {d['validation_prompts']} "
      f"validation, {d['test_prompts']} test; held-out heads found in training files: "
      f"{d['validation_in_train_files']} validation, {d['test_in_train_files']} test (after dropping "
      f"{d['validation_dropped_in_train_files']} and {d['test_dropped_in_train_files']} verbatim copies). "
      f"Step-0 headroom gate (validation, start policy and drafter): {checks}.",
      "",
      *rows,
      "",
      f"Equivalence with plain sampling (TOST, margin ±{saved['margin']:g}, Holm over the "
      f"{len(results)} comparisons at familywise {saved['family_alpha']:g}):",
      "",
      *eq_rows,
      "",
      "Speed: " + "; ".join(speed) + ".",
  ]
  coupling = coupling_family(saved)
  if coupling:
    lines += ["", "The residual method against coupled verification (both on every step, drafters distilled after "
              "every update), paired by seed:", "",
              *format_paired_table(holm_paired_intervals(coupling, saved["family_alpha"]))]
  refresh = refresh_family(saved)
  if refresh:
    lines += ["", f"PPOW refreshes (every {c['ppow_refresh_every']} steps, {spec['ppow']['steps_per_refresh']} "
              f"PPOW updates each) against distillation after every update, paired by seed, Holm over "
              f"{len(refresh)} at familywise {saved['family_alpha']:g}:", "",
              *format_paired_table(holm_paired_intervals(refresh, saved["family_alpha"]))]
  lines += ["", f"Per step, over training (mean or median over the seeds): rollout `tau`, rollout speed against plain, "
            f"train reward: `{PLOT_FILE}`; raw numbers in `{RESULTS_FILE}`."]
  return "\n".join(lines)


def plot(saved: Mapping[str, Any], path: str) -> str:
  """Per step: each speculating arm's rollout ``tau`` (mean over seeds), its rollout speed ``plain / arm``
  (median over seeds), and every arm's train reward (mean over seeds); saved to ``path``."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  fig, axes = figures.panels(3)
  colors = dict(zip(saved["arms"], matplotlib.colormaps["tab10"].colors))
  for arm in saved["arms"]:
    if not _pairs(saved, arm):
      continue
    reward = per_step(saved, arm, lambda x, y: y["reward/total/mean"]).mean(axis=0)
    axes[2].plot(np.arange(1, reward.size + 1), reward, label=arm, color=colors[arm],
                 linestyle="--" if arm == "plain" else "-")
    if arm == "plain":
      continue
    tau = per_step(saved, arm, lambda x, y: y["rollout/tau"] if y.get("rollout/speculative_on") else np.nan)
    speed = np.median(per_step(saved, arm, lambda x, y: x["time/sample_s"] / y["time/sample_s"]), axis=0)
    steps = np.arange(1, speed.size + 1)
    if not np.isnan(tau).all():
      axes[0].plot(steps, np.nanmean(tau, axis=0), label=arm, color=colors[arm])
    axes[1].plot(steps, speed, label=arm, color=colors[arm])
  axes[1].axhline(1.0, color="k", linewidth=0.8)
  axes[1].axhline(ROLLOUT_TARGET, color="grey", linestyle=":", label=f"target {ROLLOUT_TARGET}x")
  for ax, title in zip(axes, ("rollout tau (steps that speculated, mean over seeds)",
                              "rollout speed, plain / arm (median over seeds)", "train reward (mean over seeds)")):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("GRPO step")
  return figures.save(fig, axes, path)
