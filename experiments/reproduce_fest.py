r"""FEST vs pure GRPO vs SFT-then-GRPO on multi-step chains (METHODS.md section 2), over seeds.

    python -m experiments.reproduce_fest --workdir=runs/fest [--seeds=0,1,2 --extra_shots=64,512 \
        --budget_minutes=70]

Per seed: ONE easy-SFT run (``<workdir>/seed_<s>/sft``, the starting policy, scored too); its
``checkpoints/sft`` is copied into every variant's workdir, so the runner skips SFT there. Then, from the same
start: pure GRPO (budget-matched: as many prompts per step as FEST's two streams), SFT-then-GRPO, FEST-DPO and
FEST-GRPO at ``--main_shots`` shots, seed after seed; then the ``--extra_shots`` points of the three
shot-dependent methods, seed by seed, as long as ``--budget_minutes`` allows (what was skipped is reported).

Final scores: Avg@k and Pass@k (``eval.num_samples`` samples at ``eval.temperature``;
``lemon_rl.eval.pass_at_k``) on the hard test set (4-5 steps) and the shifted test set (6-7 steps); mean and 95%
CI over seeds. Greedy hard-test accuracy over training goes to ``experiments/results/fest/`` (JSON + PNG);
the table goes into the "FEST" section of ``experiments/RESULTS.md`` after every run (partial results are
marked as such).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Any

from absl import app
from absl import flags
import numpy as np

from configs import fest_math
from experiments import results_md
from experiments.reports import fest as report
from lemon_rl.envs import multistep_math
from lemon_rl.eval import evaluate
from lemon_rl.eval.pass_at_k import avg_at_k, pass_at_k_from_successes
from lemon_rl.training import experiment
from lemon_rl.training.metrics import read_records

flags.DEFINE_string("workdir", "runs/fest", "Root directory; one sub-directory per seed and run (resumable).")
flags.DEFINE_string("seeds", "0,1,2", "Comma-separated seeds.")
flags.DEFINE_integer("main_shots", 128, "Shots of the main comparison (all four methods, every seed).")
flags.DEFINE_string("extra_shots", "64,512", "Further shot counts for the shot-dependent methods ('' = none).")
flags.DEFINE_float("budget_minutes", 70.0, "Skip extra-shot runs that would start after this much wall time.")
flags.DEFINE_string("results_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fest"),
                    "Where curves and the raw results go.")
flags.DEFINE_bool("write_results", True, "Regenerate experiments/RESULTS.md (python -m experiments.results_md).")
flags.DEFINE_bool("report_only", False, "Redraw the curves and print the section from <results_dir>/results.json "
                  "(nothing is trained or evaluated).")
FLAGS = flags.FLAGS

METHODS, SHOT_METHODS, LOW_LR, LOW_LR_METHODS, LABELS = (report.METHODS, report.SHOT_METHODS, report.LOW_LR,
                                                      report.LOW_LR_METHODS, report.LABELS)


def sampled_scores(model, task, config) -> dict[str, float]:
  """Avg@k, Pass@k (and line diagnostics) on the hard and the shifted test sets."""
  k = config.eval.num_samples
  sets = {
      "hard": (task.test_examples[:config.eval.num_examples], task.max_new_tokens),
      "shifted": (multistep_math.shifted_test(config.task.data_seed, config.eval.num_shifted),
                  multistep_math.completion_budget(multistep_math.SPLIT_STEPS["shifted_test"][1])),
  }
  out = {}
  for name, (examples, max_new_tokens) in sets.items():
    metrics, scores = evaluate(model, task.tokenizer, examples, task.eval_reward, max_new_tokens,
                               batch_size=len(examples) * k, temperature=config.eval.temperature,
                               num_samples=k, seed=10_000 + config.seed)
    success = (scores > 0).astype(np.float64)
    out[f"{name}/avg@{k}"] = float(avg_at_k(success, k).mean())
    out[f"{name}/pass@{k}"] = float(pass_at_k_from_successes(success, k).mean())
    out[f"{name}/all_wrong"] = float((success.sum(1) == 0).mean())
    for m in ("complete", "line_accuracy", "num_lines"):
      out[f"{name}/{m}"] = float(metrics[m])
  return out


def run_dir(root: str, name: str, seed: int, shots: int | None) -> str:
  if name == "start":
    return os.path.join(root, f"seed_{seed}", "sft")
  return os.path.join(root, f"seed_{seed}", f"{name}_{shots}" if name in SHOT_METHODS else name)


def fest_diagnostics(workdir: str, first: int = 5) -> dict[str, float] | None:
  """Means over the first / last ``first`` RL steps of the FEST step metrics (None for non-FEST runs)."""
  path = os.path.join(workdir, "metrics.jsonl")
  rl = [r for r in read_records(path) if r["phase"] == "rl"] if os.path.exists(path) else []
  if not rl or "fest/decaying_weight/mean" not in rl[0]:
    return None
  out = {}
  for key in ("fest/decaying_weight/mean", "fest/frac_all_wrong_groups_expert", "fest/frac_all_wrong_groups_rl",
              "fest/reward_expert_stream", "fest/reward_rl_stream"):
    out[f"{key}/first"] = float(np.mean([r[key] for r in rl[:first]]))
    out[f"{key}/last"] = float(np.mean([r[key] for r in rl[-first:]]))
  return out


def run_one(name: str, seed: int, shots: int, root: str) -> dict[str, Any]:
  """Runs (or resumes) one variant from the seed's easy-SFT checkpoint; returns its result record."""
  base = name[:-len("_low_lr")] if name.endswith("_low_lr") else name
  config = fest_math.get_config("grpo" if base == "start" else base)
  config.seed = seed
  if name.endswith("_low_lr"):
    config.rl.learning_rate = LOW_LR
  config.fest.num_shots = shots
  workdir = run_dir(root, name, seed, shots)
  if name == "start":
    config.rl.steps = 0
  else:
    src = os.path.join(root, f"seed_{seed}", "sft", "checkpoints", "sft")
    dst = os.path.join(workdir, "checkpoints", "sft")
    if not os.path.exists(dst):
      shutil.copytree(src, dst)
  start = time.time()
  summary = experiment.run(config, workdir, final_eval=lambda model, task: sampled_scores(model, task, config))
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  curve = [(r["step"], r["accuracy"]) for r in records if r["phase"] == "eval_rl"]
  rl = [r for r in records if r["phase"] == "rl"]
  expert_sft = [r for r in records if r["phase"] == "eval_expert_sft"]
  return {
      "method": name, "seed": seed, "shots": shots if name in SHOT_METHODS else None,
      "final": summary["final_eval"], "curve": curve, "wall_s": summary["wall_time_s"],
      "process_s": time.time() - start, "rl_steps": config.rl.steps,
      "greedy_hard_final": curve[-1][1] if curve else None,
      "after_expert_sft_greedy_hard": expert_sft[-1]["accuracy"] if expert_sft else None,
      "reward_curve": [(r["step"], r["reward/total/mean"]) for r in rl],
      "diagnostics": fest_diagnostics(workdir),
      "frac_all_wrong_rl": [(r["step"], r.get("fest/frac_all_wrong_groups_rl", r.get("frac_all_equal_groups")))
                            for r in rl],
  }


def setup_facts(config) -> dict[str, Any]:
  """The config facts the FEST section states (saved with the results, so a rerender never reads a config)."""
  return {"preset": config.model.preset, "sft_steps": config.sft.steps, "sft_batch": config.sft.batch_size,
          "rl_steps": config.rl.steps, "rl_prompts": config.rl.prompts_per_step,
          "expert_prompts": config.fest.expert_prompts_per_step, "num_generations": config.rl.num_generations,
          "expert_sft_steps": fest_math.get_config("sft_then_grpo").expert_sft.steps,
          "expert_sft_batch": config.expert_sft.batch_size,
          "betas": [config.fest.beta1, config.fest.beta2, config.fest.beta3], "c": config.fest.c,
          "num_iterations": config.rl.num_iterations, "learning_rate": config.rl.learning_rate,
          "eval_samples": config.eval.num_samples, "eval_temperature": config.eval.temperature,
          "eval_examples": config.eval.num_examples, "eval_shifted": config.eval.num_shifted,
          "main_shots": FLAGS.main_shots}


def save(results, skipped, command, config, elapsed_s, done: bool) -> dict[str, Any]:
  """Writes ``<results_dir>/results.json``, the curves and (for the committed location) RESULTS.md."""
  saved = {"results": results, "skipped": skipped, "command": command, "elapsed_s": elapsed_s, "done": done,
           "setup": setup_facts(config)}
  results_md.save_results(saved, os.path.join(FLAGS.results_dir, "results.json"))
  report.plot(saved, os.path.join(FLAGS.results_dir, "curves.png"))
  if FLAGS.write_results:
    results_md.main([])
  return saved


def main(argv):
  del argv
  seeds = [int(s) for s in FLAGS.seeds.split(",")]
  extra = [int(s) for s in FLAGS.extra_shots.split(",") if s]
  main_shots = FLAGS.main_shots
  command = "python -m experiments.reproduce_fest " + " ".join(sys.argv[1:])
  config = fest_math.get_config("fest_grpo")
  if FLAGS.report_only:
    with open(os.path.join(FLAGS.results_dir, "results.json")) as f:
      saved = json.load(f)
    report.plot(saved, os.path.join(FLAGS.results_dir, "curves.png"))
    print(report.render(saved))
    return
  t0 = time.time()
  plan = [(m, s, main_shots) for s in seeds for m in ("start", *METHODS)]
  plan += [(m, s, n) for s in seeds for n in extra for m in METHODS if m in SHOT_METHODS]
  plan += [(m, s, main_shots) for s in seeds for m in LOW_LR_METHODS]
  results, skipped, durations = [], [], {}
  # A resumed run only re-scores its final policy: keep the wall time of the process that trained it.
  previous = {}
  saved_path = os.path.join(FLAGS.results_dir, "results.json")
  if os.path.exists(saved_path):
    with open(saved_path) as f:
      previous = {(r["method"], r["seed"], r["shots"]): r["process_s"] for r in json.load(f)["results"]}
  for name, seed, shots in plan:
    elapsed = time.time() - t0
    label = f"{LABELS[name]}{f' @{shots}' if name in SHOT_METHODS else ''} seed {seed}"
    estimate = np.mean(durations.get(name, [0.0]))
    optional = (name in SHOT_METHODS and shots != main_shots) or name in LOW_LR_METHODS
    if optional and elapsed + estimate > 60 * FLAGS.budget_minutes:
      skipped.append(label)
      continue
    print(f"[{elapsed / 60:.1f} min] {label}", flush=True)
    result = run_one(name, seed, shots, FLAGS.workdir)
    result["process_s"] = previous.get((result["method"], seed, result["shots"]), result["process_s"])
    durations.setdefault(name, []).append(result["process_s"])
    results.append(result)
    print(json.dumps(result["final"]), flush=True)
    save(results, skipped, command, config, time.time() - t0, done=False)
  print(report.render(save(results, skipped, command, config, time.time() - t0, done=True)))


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()  # The launcher's malloc settings (lemon_rl/utils/allocator.py).
  app.run(main)
