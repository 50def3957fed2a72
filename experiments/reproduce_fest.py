r"""FEST against pure GRPO, two SFT-then-GRPO controls and its own ablations (METHODS.md section 2), over seeds.

    python -m experiments.reproduce_fest --workdir=runs/fest [--seeds=0,1,2,3,4 --learning_rates=5e-5,2e-4,5e-4]

The task (``configs/fest_math.py``): a procedure the starting policy never saw (chains read right to left) with
128 worked demonstrations of it. The six arms are ``fest_math.ARMS``: pure GRPO, mixed SFT then GRPO, SFT on
the shots then GRPO, FEST-DPO, FEST-GRPO and FEST-GRPO with its weight held fixed.

1. **Start.** Per seed, ONE easy-SFT run (``<workdir>/seed_<s>/start``), shared by every arm of that seed (its
   ``checkpoints/sft`` is copied into each arm's workdir, so the runner skips SFT there).
2. **Step-0 headroom gate** (``config.headroom``, fixed before the run) on the first seed's start, on the
   VALIDATION split: the hard set must start nearly unsolved (the regime FEST is for) and the starting policy
   must have the skills the procedure composes (easy accuracy). A failed gate stops the run
   (``HeadroomError``) after saving the statistics.
3. **Tuning on validation.** On the first seed, every arm runs once per ``--learning_rates`` value (the same
   trials for every arm); the RL learning rate with the best validation Avg@k is chosen per arm
   (``lemon_rl.eval.tuning``, recorded in ``<workdir>/tuning.json`` and in the results). The chosen trial is
   also that seed's test run: the choice never looks at the test split.
4. **Seeds.** Every other seed runs every arm at its chosen learning rate.

Every run's final scores: Avg@k / Pass@k (``eval.num_samples`` samples at ``eval.temperature``) on the hard
validation and test sets and the shifted (longer) test set, and greedy accuracy on easy test chains
(forgetting). Each run's record is cached as ``result.json`` in its workdir, so the command resumes and several
processes (``--seeds`` subsets after the tuning) can share one workdir. The results go to
``experiments/results/fest/results.json`` (then ``python -m experiments.results_md`` renders the section, with
Holm-corrected paired intervals for the paper's directions).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Any

from absl import app
from absl import flags
import numpy as np

from configs import fest_math
from experiments import machine
from experiments import results_md
from experiments.reports import fest as report
from lemon_rl.envs import multistep_math
from lemon_rl.eval import evaluate
from lemon_rl.eval import headroom
from lemon_rl.eval import tuning
from lemon_rl.eval.pass_at_k import avg_at_k, pass_at_k_from_successes
from lemon_rl.training import experiment
from lemon_rl.training.metrics import read_records

flags.DEFINE_string("workdir", "runs/fest", "Root directory; one sub-directory per seed and run (resumable).")
flags.DEFINE_string("seeds", "0,1,2,3,4", "Comma-separated seeds; the first one is the tuning seed.")
flags.DEFINE_string("learning_rates", "5e-5,2e-4,5e-4", "RL learning rates tried on validation, for every arm.")
flags.DEFINE_string("arms", ",".join(fest_math.ARMS), "Arms (fest_math variants) to run.")
flags.DEFINE_enum("size", "", ["", "tiny"], "Config size of every arm ('tiny': the smoke test's).")
flags.DEFINE_bool("tune_only", False, "Stop after the start run, the gate and the tuning seed.")
flags.DEFINE_float("family_alpha", 0.05, "Familywise error rate of the paired comparisons (Holm).")
flags.DEFINE_string("results_file", report.RESULTS_FILE,
                    "Where the results go (relative to the repository or absolute); the committed file "
                    "regenerates RESULTS.md.")
FLAGS = flags.FLAGS


def _successes(model, task, examples, max_new_tokens: int, k: int, temperature: float, seed: int):
  metrics, scores = evaluate(model, task.tokenizer, examples, task.eval_reward, max_new_tokens,
                             batch_size=len(examples) * k, temperature=temperature, num_samples=k, seed=seed)
  return metrics, (scores > 0).astype(np.float64)


def final_scores(model, task, config) -> dict[str, float]:
  """Avg@k, Pass@k, all-wrong share and line diagnostics on validation / test / shifted; easy greedy accuracy."""
  k, seed = config.eval.num_samples, 10_000 + config.seed
  n = config.eval.num_examples
  sets = {
      "validation": (task.validation_examples[:n], task.max_new_tokens),
      "hard": (task.test_examples[:n], task.max_new_tokens),
      "shifted": (multistep_math.shifted_test(config.task.data_seed, config.eval.num_shifted),
                  multistep_math.completion_budget(multistep_math.SPLIT_STEPS["shifted_test"][1])),
  }
  out = {}
  for name, (examples, max_new_tokens) in sets.items():
    metrics, success = _successes(model, task, examples, max_new_tokens, k, config.eval.temperature, seed)
    out[f"{name}/avg@{k}"] = float(avg_at_k(success, k).mean())
    out[f"{name}/pass@{k}"] = float(pass_at_k_from_successes(success, k).mean())
    out[f"{name}/all_wrong"] = float((success.sum(1) == 0).mean())
    for m in ("complete", "line_accuracy"):
      out[f"{name}/{m}"] = float(metrics[m])
  easy = list(multistep_math.generate_examples(config.task.data_seed, n, "easy_test"))
  _, success = _successes(model, task, easy, task.max_new_tokens, 1, 0.0, seed)
  out["easy/accuracy"] = float(success.mean())
  return out


def arm_config(arm: str):
  return fest_math.get_config(f"{arm},{FLAGS.size}" if FLAGS.size else arm)


def run_dir(arm: str, seed: int, lr: float | None) -> str:
  name = "start" if arm == "start" else f"{arm}_lr{lr:g}"
  return os.path.join(FLAGS.workdir, f"seed_{seed}", name)


def fest_diagnostics(rl: list[dict[str, Any]], first: int = 8) -> dict[str, float] | None:
  """Means over the first / last ``first`` RL steps of the FEST step metrics (None for GRPO runs)."""
  if not rl or "fest/decaying_weight/mean" not in rl[0]:
    return None
  out = {}
  for key in ("fest/decaying_weight/mean", "train/expert/reward_margin", "fest/frac_all_wrong_groups_expert",
              "fest/frac_all_wrong_groups_rl", "fest/reward_expert_stream", "fest/reward_rl_stream"):
    out[f"{key}/first"] = float(np.mean([r[key] for r in rl[1:first + 1]]))  # Step 1 has w = beta / 2.
    out[f"{key}/last"] = float(np.mean([r[key] for r in rl[-first:]]))
  return out


def run_one(arm: str, seed: int, lr: float | None) -> dict[str, Any]:
  """Runs (or reads back) one arm from the seed's easy-SFT checkpoint; returns its record."""
  workdir = run_dir(arm, seed, lr)
  cached = os.path.join(workdir, "result.json")
  if os.path.exists(cached):
    with open(cached) as f:
      return json.load(f)
  config = arm_config("grpo" if arm == "start" else arm)
  config.seed = seed
  if arm == "start":
    config.rl.steps = 0
  else:
    config.rl.learning_rate = lr
    experiment.start_from(run_dir("start", seed, None), workdir, "sft")
  summary = experiment.run(config, workdir, final_eval=lambda model, task: final_scores(model, task, config))
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  rl = [r for r in records if r["phase"] == "rl"]
  result = {
      "arm": arm, "seed": seed, "lr": lr, "final": summary["final_eval"], "wall_s": summary["wall_time_s"],
      "rl_steps": config.rl.steps,
      "curve": [(r["step"], r["accuracy"]) for r in records if r["phase"] == "eval_rl"],
      "reward_curve": [(r["step"], r["reward/total/mean"]) for r in rl],
      "after_expert_sft": next((r["accuracy"] for r in records if r["phase"] == "eval_expert_sft"), None),
      "diagnostics": fest_diagnostics(rl),
  }
  with open(cached, "w") as f:
    json.dump(result, f)
  return result


def gate(start: dict[str, Any], config) -> headroom.HeadroomReport:
  """The step-0 gate on the start's validation scores (``config.headroom``); never raises here."""
  statistics = report.gate_statistics(start["final"], config.eval.num_samples)
  thresholds = headroom.HeadroomGate.from_config(config.headroom).thresholds
  return headroom.check_headroom(statistics, thresholds, raise_on_failure=False)


def setup_facts(config, lrs: list[float]) -> dict[str, Any]:
  """The config facts the section states (saved with the results, so a rerender never reads a config)."""
  arms = {arm: arm_config(arm) for arm in fest_math.ARMS}
  return {"preset": config.model.preset, "sft_steps": config.sft.steps, "sft_batch": config.sft.batch_size,
          "rl_steps": config.rl.steps, "rl_prompts": config.rl.prompts_per_step,
          "grpo_prompts": arms["grpo"].rl.prompts_per_step,
          "expert_prompts": config.fest.expert_prompts_per_step, "num_generations": config.rl.num_generations,
          "num_shots": config.fest.num_shots,
          "mixed_sft_steps": arms["mixed_sft_grpo"].expert_sft.steps,
          "mixed_easy_per_shot": arms["mixed_sft_grpo"].expert_sft.easy_per_shot,
          "shots_sft_steps": arms["shots_sft_grpo"].expert_sft.steps,
          "expert_sft_batch": config.expert_sft.batch_size, "expert_sft_lr": config.expert_sft.learning_rate,
          "betas": [config.fest.beta1, config.fest.beta2, config.fest.beta3], "c": config.fest.c,
          "beta_pilot": fest_math.BETA_PILOT, "num_iterations": config.rl.num_iterations,
          "learning_rates": lrs, "eval_samples": config.eval.num_samples,
          "eval_temperature": config.eval.temperature, "eval_examples": config.eval.num_examples,
          "eval_shifted": config.eval.num_shifted,
          "headroom": config.headroom.to_dict()}


def main(argv):
  del argv
  seeds = [int(s) for s in FLAGS.seeds.split(",")]
  lrs = [float(x) for x in FLAGS.learning_rates.split(",")]
  arms = FLAGS.arms.split(",")
  unknown = set(arms) - set(fest_math.ARMS)
  if unknown:
    raise ValueError(f"unknown arms {sorted(unknown)}; expected some of {fest_math.ARMS}")
  config = arm_config("fest_grpo")
  k = config.eval.num_samples
  t0 = time.time()
  saved = {"command": "python -m experiments.reproduce_fest " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
           "machine": machine.description(), "family_alpha": FLAGS.family_alpha, "arms": arms,
           "seeds": seeds, "setup": setup_facts(config, lrs), "runs": [], "done": False}

  def save(done: bool = False) -> str:
    saved["done"] = done
    return results_md.save_results(saved, FLAGS.results_file)

  def log(msg: str) -> None:
    print(f"[{(time.time() - t0) / 60:.1f} min] {msg}", flush=True)

  tune_seed = seeds[0]
  log(f"start (easy SFT), seed {tune_seed}")
  start = run_one("start", tune_seed, None)
  report_ = gate(start, config)
  saved["headroom"] = report_.to_dict()
  save()
  if not report_.passed:
    raise headroom.HeadroomError(report_)
  log("step-0 headroom gate passed: " + "; ".join(str(c) for c in report_.checks))

  trials: dict[str, list[dict[str, Any]]] = {}
  saved["tuning_runs"] = []
  for arm in arms:
    trials[arm] = []
    for lr in lrs:
      log(f"tuning {arm} lr {lr:g} (seed {tune_seed})")
      result = run_one(arm, tune_seed, lr)
      saved["tuning_runs"].append(result)
      trials[arm].append({"params": {"learning_rate": lr}, "score": result["final"][f"validation/avg@{k}"]})
  choice = tuning.record_choice(os.path.join(FLAGS.workdir, "tuning.json"), trials, split="hard_validation",
                                metric=f"validation avg@{k}")
  saved["tuning"] = choice.to_dict()
  chosen = {arm: choice.params(arm)["learning_rate"] for arm in arms}
  log("chosen learning rates: " + ", ".join(f"{a} {lr:g}" for a, lr in chosen.items()))
  if FLAGS.tune_only:
    save()
    return

  for seed in seeds:
    log(f"start (easy SFT), seed {seed}")
    saved["runs"].append(run_one("start", seed, None))
    for arm in arms:
      log(f"{arm} lr {chosen[arm]:g}, seed {seed}")
      saved["runs"].append(run_one(arm, seed, chosen[arm]))
      save()
  report.plot(saved, os.path.join(os.path.dirname(save(done=True)), "curves.png"))
  print(results_md.publish(saved, FLAGS.results_file, report))


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()  # The launcher's malloc settings (lemon_rl/utils/allocator.py).
  app.run(main)
