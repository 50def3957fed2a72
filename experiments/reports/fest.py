"""The FEST section: FEST-DPO / FEST-GRPO vs pure GRPO vs SFT-then-GRPO (METHODS.md section 2).

``saved`` (written by :mod:`experiments.reproduce_fest`): ``command``, ``elapsed_s``, ``done``, ``skipped``,
``setup`` (the config facts the text states) and ``results``: one record per run (method, seed, shots, final
sampled scores, greedy curve, wall time, FEST step diagnostics when recorded).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from lemon_rl.eval import stats
from lemon_rl.eval.stats import format_mean_ci

TITLE = "FEST"
RESULTS_FILE = "experiments/results/fest/results.json"
PLOT_FILE = "experiments/results/fest/curves.png"
COMMAND = "python -m experiments.reproduce_fest --workdir=runs/fest"

METHODS = ("grpo", "sft_then_grpo", "fest_dpo", "fest_grpo")
SHOT_METHODS = ("sft_then_grpo", "fest_dpo", "fest_grpo", "sft_then_grpo_low_lr", "fest_dpo_low_lr",
                "fest_grpo_low_lr")
# Controls at a lower RL learning rate (the shared one is high for sparse rewards); run at the main shot count.
LOW_LR = 1e-4
LOW_LR_METHODS = ("grpo_low_lr", "sft_then_grpo_low_lr", "fest_dpo_low_lr", "fest_grpo_low_lr")
LABELS = {"start": "easy-SFT start", "grpo": "pure GRPO", "sft_then_grpo": "SFT-then-GRPO",
          "fest_dpo": "FEST-DPO", "fest_grpo": "FEST-GRPO"}
LABELS.update({f"{m}_low_lr": f"{LABELS[m]}, lr 1e-4" for m in METHODS})


def _key(r):
  return (r["method"], r["shots"])


def _paired(results, a, b, metric):
  """Per-seed differences ``a - b`` of ``metric`` over the seeds both ran."""
  by = {(_key(r), r["seed"]): r["final"][metric] for r in results}
  seeds = sorted({s for (k, s) in by if k == a} & {s for (k, s) in by if k == b})
  return [by[(a, s)] - by[(b, s)] for s in seeds]


def _paired_sections(results, main: int, k: int) -> list[tuple[str, list[tuple[str, tuple, tuple, str]]]]:
  """Every paired difference the section reports, ``[(heading, [(label, a, b, metric), ...]), ...]``.

  Each is ``a - b`` with ``a`` the arm the paper (or the control's premise) expects higher: FEST over pure
  GRPO and over SFT-then-GRPO, FEST-GRPO over FEST-DPO (paper: 42.36 vs 41.98 Avg@8), and SFT-then-GRPO
  over pure GRPO (the shots help at all). All of them form one Holm family (:func:`_holm_verdicts`).
  """
  a, p = f"hard/avg@{k}", f"hard/pass@{k}"
  vs_grpo = lambda methods, metric, base="grpo": [
      (f"{LABELS[m]} - {LABELS[base]}", (m, main), (base, None), metric) for m in methods]
  sections = [
      (f"Paired differences in hard Avg@{k} (same seed, same start), {main} shots:",
       vs_grpo(("fest_grpo", "fest_dpo", "sft_then_grpo"), a)
       + [("FEST-GRPO - SFT-then-GRPO", ("fest_grpo", main), ("sft_then_grpo", main), a)]),
      (f"Paired differences in hard Pass@{k}, {main} shots:",
       vs_grpo(("fest_grpo", "fest_dpo", "sft_then_grpo"), p))]
  for metric, name in ((a, f"Avg@{k}"), (p, f"Pass@{k}")):
    sections.append((f"At lr {LOW_LR:g} for every method (paired differences in hard {name}, {main} shots):",
                     vs_grpo(("fest_grpo_low_lr", "fest_dpo_low_lr", "sft_then_grpo_low_lr"), metric,
                             "grpo_low_lr")))
  sections.append((f"Shot-count points (hard Avg@{k} / Pass@{k} per method and shots: see the table):",
                   [(f"{shots} shots, FEST-GRPO - FEST-DPO", ("fest_grpo", shots), ("fest_dpo", shots), a)
                    for shots in sorted({r["shots"] for r in results if r["shots"] and r["shots"] != main})]))
  return sections


def _holm_verdicts(results, sections, family_alpha: float = 0.05) -> tuple[list[str], int]:
  """One line per paired difference of ``sections`` (headings kept) and the family size.

  The family is every difference with at least one paired seed (one that was not run reads "not run" and
  is left out: what ran is fixed by the wall-time budget, not by the outcomes); the expected sign is +1
  for all (see :func:`_paired_sections`). Intervals and verdicts: :func:`stats.holm_paired_intervals`.
  """
  family = []
  for _, items in sections:
    for label, a, b, metric in items:
      diffs = _paired(results, a, b, metric)
      if diffs:
        family.append(stats.PairedComparison(f"{label}, {metric}", +1, diffs))
  verdicts = iter(stats.holm_paired_intervals(family, family_alpha))
  lines = []
  for heading, items in sections:
    lines.append(heading)
    for label, a, b, metric in items:
      lines.append(f"- {label}: "
                   + (stats.format_paired(next(verdicts)) if _paired(results, a, b, metric) else "not run"))
  return lines, len(family)



def render(saved: Mapping[str, Any]) -> str:
  results, skipped, setup = saved["results"], saved["skipped"], saved["setup"]
  k = setup["eval_samples"]
  cols = [f"hard/avg@{k}", f"hard/pass@{k}", f"shifted/avg@{k}", f"shifted/pass@{k}"]
  groups: dict[tuple, list] = {}
  for r in results:
    groups.setdefault(_key(r), []).append(r)
  order = [("start", None), ("grpo", None), ("grpo_low_lr", None)] + [
      (m, s) for s in sorted({r["shots"] for r in results if r["shots"]}) for m in SHOT_METHODS]
  rows = ["| method | shots | seeds | " + " | ".join(c.replace("/", " ") for c in cols) +
          " | hard all-wrong | hard complete | hard line acc | greedy hard (end) | RL steps | wall s / run |",
          "|" + "---|" * (len(cols) + 9)]
  for key in order:
    if key not in groups:
      continue
    rs = groups[key]
    cells = [format_mean_ci([r["final"][c] for r in rs]) for c in cols]
    greedy = [r["greedy_hard_final"] for r in rs if r["greedy_hard_final"] is not None]
    walls = [r["process_s"] for r in rs]  # This script's wall clock for the run (SFT not included).
    rows.append(f"| {LABELS[key[0]]} | {key[1] or '-'} | {','.join(str(r['seed']) for r in rs)} | "
                + " | ".join(cells) + f" | {format_mean_ci([r['final']['hard/all_wrong'] for r in rs])} | "
                f"{format_mean_ci([r['final']['hard/complete'] for r in rs], 2)} | "
                f"{format_mean_ci([r['final']['hard/line_accuracy'] for r in rs], 2)} | "
                f"{format_mean_ci(greedy) if greedy else '-'} | {rs[0]['rl_steps']} | {np.mean(walls):.0f} |")
  main = setup["main_shots"]
  lines = [
      f"Command: `{saved['command']}` (2-core CPU shared with other jobs; {saved['elapsed_s'] / 60:.0f} min wall "
      f"for this command{'' if saved['done'] else ', PARTIAL: still running or stopped early'}).",
      "",
      f"Task `fest_math`: a tiny decoder (`{setup['preset']}` preset) is fine-tuned on worked solutions of "
      f"1-2 step chains ({setup['sft_steps']} steps x {setup['sft_batch']}); RL then trains on 4-5 step chains "
      f"(`D_I`, answers only) for {setup['rl_steps']} steps. FEST: {setup['rl_prompts']} `D_I` + "
      f"{setup['expert_prompts']} `D_E` prompts x {setup['num_generations']} rollouts per step; "
      f"pure GRPO and SFT-then-GRPO get {setup['rl_prompts'] + setup['expert_prompts']} `D_I` "
      f"prompts (same sampling budget); SFT-then-GRPO first runs {setup['expert_sft_steps']}"
      f" SFT steps x {setup['expert_sft_batch']} on the shots. betas {setup['betas'][0]}/{setup['betas'][1]}/"
      f"{setup['betas'][2]}, c = {setup['c']}, {setup['num_iterations']} updates per batch, AdamW "
      f"{setup['learning_rate']}, dr_grpo advantages, clip 0.2/0.28, no KL.",
      "",
      f"Scores: Avg@{k} / Pass@{k} at temperature {setup['eval_temperature']} on {setup['eval_examples']} hard "
      f"test problems and {setup['eval_shifted']} shifted (6-7 step) problems; 'hard all-wrong' = share of hard "
      f"test problems with no correct sample; 'complete' = share of samples that write as many lines as the "
      f"chain has steps (the procedure); 'line acc' = share of written lines that are true arithmetic; greedy "
      f"hard = greedy accuracy at the end of RL. Mean ± 95% CI (Student t) over the seeds listed.",
      "",
      *rows,
      "",
  ]
  paired_lines, family_size = _holm_verdicts(results, _paired_sections(results, main, k))
  lines += [f"Paired differences over seeds: mean, Holm-corrected t-interval (over all {family_size} paired "
            "differences below, familywise alpha 0.05; the level each interval is at is shown), p and Holm p; "
            "the verdict follows the interval (reproduced / opposite / not distinguishable; each is read as "
            "first arm > second).", *paired_lines]
  for shots in sorted({r["shots"] for r in results if r["method"] == "sft_then_grpo"}):
    after = [r["after_expert_sft_greedy_hard"] for r in results if r["method"] == "sft_then_grpo"
             and r["shots"] == shots and r["after_expert_sft_greedy_hard"] is not None]
    if after:
      lines.append(f"- {shots} shots: greedy hard accuracy right after the SFT on the shots (before GRPO) "
                   f"{format_mean_ci(after)} ({len(after)} runs)")
  diag = {}
  for r in results:
    if r.get("diagnostics"):
      diag.setdefault((r["method"], r["shots"]), []).append(r["diagnostics"])
  if diag:
    lines += ["", "FEST step diagnostics (mean over seeds of the first -> last 5 RL steps): decaying weight "
              "`w` (pre-update policy), share of all-wrong groups in `D_E` / `D_I`, reward in `D_E` / `D_I`:"]
    for (m, n), ds in sorted(diag.items(), key=lambda kv: (kv[0][1], kv[0][0])):
      f = lambda key: (f"{np.mean([d[key + '/first'] for d in ds]):.3g} -> "
                       f"{np.mean([d[key + '/last'] for d in ds]):.3g}")
      lines.append(f"- {LABELS[m]} @{n} ({len(ds)} runs): w {f('fest/decaying_weight/mean')}; all-wrong "
                   f"{f('fest/frac_all_wrong_groups_expert')} / {f('fest/frac_all_wrong_groups_rl')}; reward "
                   f"{f('fest/reward_expert_stream')} / {f('fest/reward_rl_stream')}")
  if skipped:
    lines += ["", "Not run (wall-time budget): " + ", ".join(skipped) + "."]
  lines += ["", "Curves (greedy hard-test accuracy over RL steps, per run): `experiments/results/fest/curves.png`, "
            "raw numbers in `experiments/results/fest/results.json`."]
  return "\n".join(lines)


def plot(saved: Mapping[str, Any], path: str) -> None:
  """Greedy hard-test accuracy over RL steps, one panel per shot count, one line per run."""
  results = saved["results"]
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  shots = sorted({r["shots"] for r in results if r["shots"]})
  if not shots:
    return
  fig, axes = plt.subplots(1, len(shots), figsize=(5 * len(shots), 3.6), squeeze=False)
  colors = {"grpo": "k", "sft_then_grpo": "tab:orange", "fest_dpo": "tab:blue", "fest_grpo": "tab:green"}
  for ax, n in zip(axes[0], shots):
    for r in results:
      if r["method"] == "start" or (r["shots"] not in (None, n)) or not r["curve"]:
        continue
      steps, acc = zip(*r["curve"])
      label = LABELS[r["method"]] if r["seed"] == min(x["seed"] for x in results if _key(x) == _key(r)) else None
      low = r["method"].endswith("_low_lr")
      ax.plot(steps, acc, color=colors[r["method"].removesuffix("_low_lr")], linestyle="--" if low else "-",
              alpha=0.7, label=label)
    ax.set_title(f"{n} shots (GRPO: no shots)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("greedy hard-test accuracy")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
