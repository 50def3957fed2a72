r"""The default experiment over seeds: GRPO against its SFT start and against FLOP-matched more SFT.

    python -m experiments.reproduce_grpo_arithmetic --workdir=runs/grpo_arithmetic --seeds=0,1,2,3,4

Per seed: ``configs/grpo_arithmetic.py:<variant>`` (the README's main job) runs in ``<workdir>/seed_<s>/grpo``;
its SFT checkpoint is copied to ``<workdir>/seed_<s>/sft_control``, where the ``<variant>_sft_control`` config
continues it with FLOP-matched SFT instead of GRPO. Runs resume; a finished one is only re-read. The results
go to ``experiments/results/grpo_arithmetic/results.json`` (committed), the plot next to it, and
``experiments/RESULTS.md`` is regenerated (:mod:`experiments.results_md`, section
:mod:`experiments.reports.grpo_arithmetic`).
"""

import os
import shlex
import sys

from absl import app
from absl import flags

from configs import grpo_arithmetic
from experiments import machine
from experiments import results_md
from experiments.reports import grpo_arithmetic as report
from lemon_rl.training import experiment
from lemon_rl.training.metrics import read_records

flags.DEFINE_string("workdir", None, "Root directory; one sub-directory per seed.")
flags.DEFINE_string("seeds", "0,1,2,3,4", "Comma-separated seeds.")
flags.DEFINE_string("variant", "cpu", "Config variant of the GRPO arm (the control is <variant>_sft_control).")
flags.DEFINE_string("results_file", report.RESULTS_FILE,
                    "Where the results JSON goes (absolute, or relative to the repository).")
flags.DEFINE_float("family_alpha", 0.05, "Familywise error rate of the claimed directions (Holm).")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def run_arm(config, workdir: str) -> dict:
  """Runs (or resumes) one arm in this process; its summary and the wall and CPU seconds it took."""
  summary, timing = machine.timed(experiment.run, config, workdir)
  return {"summary": summary, **timing}


def arm_record(workdir: str, phases, timing: dict) -> dict:
  """Final and intermediate held-out evaluations of a finished arm, and its RL reward per step."""
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  evals = [{"phase": r["phase"].removeprefix("eval_"), "step": r["step"], "accuracy": r["accuracy"],
            "carryless": r.get("carryless")} for r in records if r["phase"].startswith("eval_")]
  final = {}
  for phase in phases:
    mine = [e for e in evals if e["phase"] == phase]
    if mine:
      final[phase] = {"accuracy": mine[-1]["accuracy"], "carryless": mine[-1]["carryless"]}
  reward = [[r["step"], r["reward/total/mean"]] for r in records if r["phase"] == "rl" and "reward/total/mean" in r]
  return {"final": final, "evals": evals, "rl_reward": reward, **{k: v for k, v in timing.items() if k != "summary"}}


def main(argv):
  del argv
  seeds = [int(s) for s in FLAGS.seeds.split(",")]
  config = grpo_arithmetic.get_config(FLAGS.variant)
  control = grpo_arithmetic.get_config(f"{FLAGS.variant}_sft_control")
  per_step = grpo_arithmetic.step_flops(config)
  saved = {
      "command": "python -m experiments.reproduce_grpo_arithmetic " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
      "machine": machine.description(),
      "family_alpha": FLAGS.family_alpha,
      "setup": {"sft_steps": config.sft.steps, "sft_batch": config.sft.batch_size, "rl_steps": config.rl.steps,
                "rl_rows": config.rl.prompts_per_step * config.rl.num_generations,
                "continued_sft_steps": control.continued_sft.steps, "eval_examples": config.eval.num_examples,
                "flops_per_step": {"sft": per_step["sft"], "rl": per_step["rl"], "continued_sft": per_step["sft"]}},
      "seeds": [],
  }
  for seed in seeds:
    root = os.path.join(FLAGS.workdir, f"seed_{seed}")
    config.seed = control.seed = seed
    grpo = run_arm(config, os.path.join(root, "grpo"))
    experiment.start_from(os.path.join(root, "grpo"), os.path.join(root, "sft_control"), "sft")
    more_sft = run_arm(control, os.path.join(root, "sft_control"))
    saved["seeds"].append({"seed": seed, "grpo": arm_record(os.path.join(root, "grpo"), config.phases, grpo),
                           "sft_control": arm_record(os.path.join(root, "sft_control"), control.phases, more_sft)})
    results_md.save_results(saved, FLAGS.results_file)
  if results_md.is_committed(FLAGS.results_file, report):
    report.plot(saved, os.path.join(results_md.ROOT, report.PLOT_FILE))
  print(results_md.publish(saved, FLAGS.results_file, report))


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()  # The launcher's malloc settings (lemon_rl/utils/allocator.py).
  app.run(main)
