r"""LEMON over seeds: SFT only, global GRPO, LEMON, LEMON without each edit family, LEMON without SFT.

    python -m experiments.reproduce_lemon --workdir=runs/lemon --seeds=0,1,2,3,4 --workers=2   # the experiment
    python -m experiments.reproduce_lemon --workdir=runs/lemon --train_workers_only             # workers only
    python -m experiments.reproduce_lemon --workdir=/tmp/lemon_tiny --variant=tiny --seeds=0 \
        --results_file=/tmp/lemon_tiny/results.json                                              # smoke run

Workers (``task.workers="models"``, the ``cpu`` variant): the three worker models are trained ONCE, by SFT on worker
demonstrations (``lemon_rl.envs.word_problems.worker_demonstrations``), into ``WORKERS_DIR`` (committed with the
results: about 9 MB of float32 parameters; ``--workers_dir`` elsewhere) and their skills are measured on held-out
demonstrations; they are part of the environment, the same for every arm and seed. The experiment spans sessions and
machines, and training the workers costs several CPU-hours: committing them is what keeps every seed on the same
workers (arms stored with other workers are refused; so are saved workers taught other demonstrations, e.g. after
the world's rules changed). A worker in training checkpoints every
``worker_training.checkpoint_every`` steps and on SIGTERM into ``WORKERS_DIR/<capacity>_training`` and the same
command resumes it exactly: commit that directory to go on in another session. Before any orchestrator trains, the
worker gate (``task.worker_gate``, :func:`lemon_rl.training.worker_models.worker_gate`) checks the premise that
capacity matters (the large worker multiplies reliably, the small one clearly worse): with workers that fail it the
command saves the workers and the failed gate as the results (no arm) and stops, since every arm would be comparing
teams whose capacities make no difference; ``--run_despite_worker_gate`` runs the arms anyway and the results say
that the gate failed (the step-0 check then measures how often lowering a capacity changes the reward). The
``tiny`` and ``pilot`` variants use the programmatic workers instead.

Per seed (``configs/lemon_orchestration.py:<variant>_<arm>``): the ``sft_only`` arm runs the orchestrator's
SFT on the scripted teacher's specs; its final policy is "SFT only" and the step-0 check runs on it (specs
sampled on validation problems; every applicable edit of every valid spec re-executed: the ``|dc|``
distribution of each family and the share of specs on which it flips task success, against the thresholds
of ``lemon.step0_thresholds``). Each RL arm (``grpo``, ``lemon``, ``no_<family>``) continues from a copy of
that SFT checkpoint; ``no_sft`` runs LEMON from a random orchestrator. Every seed's ``sft_only`` run comes
first, then every (seed, RL arm) run; ``--workers=N`` runs N of them at a time, each in its own process. Runs
resume; a finished one is re-read from its ``arm.json``. Results go to ``experiments/results/lemon/results.json``
(after the SFT runs, as soon as a seed's last arm is done, and at the end) and the section of
``experiments/RESULTS.md`` is regenerated when the results file is the committed one. Every finished arm's
``arm.json`` also goes to ``arms/`` beside the results file (:mod:`experiments.arm_store`, committed), and a rerun
with the same setup and worker models restores them first: a run longer than a session goes on in the next one,
on whichever machine (each arm records its own). A seed whose remaining RL arms need the ``sft_only`` checkpoint,
which is not stored, re-runs that SFT and checks that it evaluates exactly as the stored run did.
"""

import json
import os
import shlex
import sys

from absl import app
from absl import flags

from configs import lemon_orchestration
from experiments import arm_store
from experiments import machine
from experiments import results_md
from experiments.reports import lemon as report
from lemon_rl.envs import word_problems
from lemon_rl.text import ByteTokenizer
from lemon_rl.training import experiment
from lemon_rl.training import lemon
from lemon_rl.training import worker_models
from lemon_rl.training.metrics import read_records

flags.DEFINE_string("workdir", None, "Root directory: workers/, then one sub-directory per seed and arm.")
flags.DEFINE_string("seeds", "0,1,2,3,4", "Comma-separated seeds.")
flags.DEFINE_string("variant", "cpu", "Config size: cpu (worker models), pilot or tiny (programmatic workers).")
flags.DEFINE_string("arms", ",".join(report.ARMS), "Comma-separated arms (sft_only always runs first).")
flags.DEFINE_integer("workers", 1, "Runs at a time, each in its own process (every seed's SFT, then the RL arms).")
WORKERS_DIR = os.path.join(os.path.dirname(report.RESULTS_FILE), "workers")
flags.DEFINE_string("workers_dir", WORKERS_DIR, "Trained worker models (absolute, or relative to the repository).")
flags.DEFINE_bool("train_workers_only", False, "Train (or re-score) the worker models and stop.")
flags.DEFINE_bool("run_despite_worker_gate", False,
                  "Run the arms on workers that fail the worker gate (the results say that the gate failed).")
flags.DEFINE_integer("step0_examples", 100, "Validation problems of the step-0 check (G specs each).")
flags.DEFINE_string("results_file", report.RESULTS_FILE,
                    "Where the results JSON goes (absolute, or relative to the repository).")
flags.DEFINE_float("family_alpha", 0.05, "Familywise error rate of the claimed directions (Holm).")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def train_workers(config, workers_dir: str) -> dict:
  """Trains (once) and scores the worker models of ``config.task``; returns their ``workers.json``."""
  t, w = config.task, config.task.worker_training
  kwargs = word_problems._generator_kwargs(t)  # pylint: disable=protected-access
  demos = word_problems.worker_demonstrations(t.data_seed, int(w.num_demos), "workers", **kwargs)
  eval_demos = word_problems.worker_demonstrations(t.data_seed, int(w.num_eval), "workers_eval", **kwargs)
  return worker_models.train_worker_models(demos, eval_demos, t.worker_models, w, workers_dir, ByteTokenizer(),
                                   prompt_len=word_problems.WORKER_PROMPT_LEN,
                                   max_new_tokens=word_problems.WORKER_MAX_NEW_TOKENS)


def final_eval(workdir: str, config) -> dict:
  """The last held-out evaluation of the arm's last phase that ran (its accuracy, tokens, graph size...)."""
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  phase = [p for p in config.phases if config[p].steps][-1]
  evals = [r for r in records if r["phase"] == f"eval_{phase}"]
  return {k: v for k, v in evals[-1].items() if k not in ("phase", "step")}


ARM_CURVES = ("reward/total/mean", "lemon/worker_tokens", "lemon/invalid_share", "lemon/success",
              "lemon/graph_nodes")


def arm_record(workdir: str, config, timing: dict) -> dict:
  """Final evaluation, RL curves, held-out accuracy along the way, per-family contrast statistics."""
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  rl = [r for r in records if r["phase"] == "rl"]
  curves = {k: [[r["step"], r.get(k)] for r in rl] for k in ARM_CURVES}
  families = {}
  for f in lemon_orchestration.EDIT_FAMILIES:
    mean = lambda k: _nanmean([r.get(f"lemon/{f}/{k}") for r in rl])
    families[f] = {"edits": _nansum([r.get(f"lemon/{f}/edits") for r in rl]), "abs_dc": mean("abs_dc"),
                   "changed_share": mean("changed_share"), "success_changed_share": mean("success_changed_share"),
                   "final_prob": rl[-1].get(f"lemon/{f}/prob") if rl else None}
  return {"final": final_eval(workdir, config), "curves": curves, "evals": eval_records(workdir),
          "families": families, "machine": machine.description(), **timing}


def eval_records(workdir: str) -> list[list]:
  """The run's held-out evaluations along the way: ``[phase, step, accuracy, worker tokens]``."""
  return [[r["phase"].removeprefix("eval_"), r["step"], r["accuracy"], r.get("worker_tokens")]
          for r in read_records(os.path.join(workdir, "metrics.jsonl")) if r["phase"].startswith("eval_")]


def _nanmean(xs):
  xs = [x for x in xs if isinstance(x, (int, float)) and x == x]
  return sum(xs) / len(xs) if xs else None


def _nansum(xs):
  return float(sum(x for x in xs if isinstance(x, (int, float)) and x == x))


def run_arm(config, workdir: str, step0_examples: int = 0) -> dict:
  """Runs (or resumes) one arm and returns its :func:`arm_record`, with ``step0`` (the step-0 check of
  :func:`lemon_rl.training.lemon.measure_step0` on its final policy, ``step0_examples`` validation problems) when
  ``step0_examples`` is positive. The record is saved as ``<workdir>/arm.json``; a finished arm is re-read from it.
  """
  path = os.path.join(workdir, "arm.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)

  def step0(model, task):
    return lemon.measure_step0(model, task, config, step0_examples)

  summary, timing = machine.timed(experiment.run, config, workdir, final_eval=step0 if step0_examples else None)
  record = arm_record(workdir, config, timing)
  if step0_examples:
    record["step0"] = summary["final_eval"]
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  return record


def setup_facts(config) -> dict:
  """The config facts the section states (saved with the results: a rerender never reads a config)."""
  return {"variant": FLAGS.variant, "workers": config.task.workers, "sft_steps": config.sft.steps,
          "sft_batch": config.sft.batch_size, "rl_steps": config.rl.steps, "rl_prompts": config.rl.prompts_per_step,
          "num_generations": config.rl.num_generations, "learning_rate": config.rl.learning_rate,
          "mu": config.lemon.mu, "reward": config.task.reward.to_dict(), "eval_examples": config.eval.num_examples,
          "step0_examples": FLAGS.step0_examples, "multiply_fraction": config.task.multiply_fraction,
          "thresholds": config.lemon.step0_thresholds.to_dict()}


def arm_dir(seed: int, arm: str) -> str:
  return os.path.join(FLAGS.workdir, f"seed_{seed}", arm)


def main(argv):
  del argv
  seeds = [int(s) for s in FLAGS.seeds.split(",") if s]
  arms = [a for a in FLAGS.arms.split(",") if a]
  unknown = set(arms) - set(report.ARMS)
  if unknown:
    raise app.UsageError(f"unknown arms {sorted(unknown)}; known: {report.ARMS}")
  base = lemon_orchestration.get_config(FLAGS.variant)
  workers_dir = os.path.join(results_md.ROOT, FLAGS.workers_dir)  # An absolute path stays as it is.
  saved = {"command": "python -m experiments.reproduce_lemon " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
           "machine": machine.description(), "family_alpha": FLAGS.family_alpha,
           "setup": setup_facts(base), "workers": None, "seeds": [], "done": False}
  if base.task.workers == "models":
    saved["workers"] = train_workers(base, workers_dir)
    saved["worker_gate"] = worker_models.worker_gate(saved["workers"]["skills"], base.task.worker_gate)
  if FLAGS.train_workers_only:
    print(json.dumps({"workers": saved["workers"], "worker_gate": saved.get("worker_gate")}, indent=1)
          if saved["workers"] else f"variant {FLAGS.variant!r} uses programmatic workers: nothing to train")
    return
  gate = saved.get("worker_gate")
  if gate and not gate["passed"]:
    if not FLAGS.run_despite_worker_gate:
      saved["done"] = True  # The outcome: no orchestrator trains on these workers; the results say why.
      print(results_md.write_results(saved, FLAGS.results_file, report))
      raise SystemExit(f"the worker models in {workers_dir} fail the worker gate (task.worker_gate), so capacity "
                       f"would not matter to the orchestrator: {report.gate_checks(gate)}")
    gate["overridden"] = True  # The report then says that the arms ran on workers that failed it.

  def config_of(arm, seed):
    c = lemon_orchestration.apply_arm(lemon_orchestration.get_config(FLAGS.variant), arm)
    c.seed = seed
    c.task.workers_dir = workers_dir
    return c

  def save():
    path = results_md.save_results(saved, FLAGS.results_file)
    report.plot(saved, os.path.join(os.path.dirname(path), "curves.png"))

  all_arms = ["sft_only", *[arm for arm in arms if arm != "sft_only"]]
  saved["seeds"] = [{"seed": s, "arms": {}} for s in seeds]
  entries = {entry["seed"]: entry for entry in saved["seeds"]}
  store_dir = arm_store.beside(FLAGS.results_file)
  restored = arm_store.restore(store_dir, {"setup": saved["setup"], "workers": saved["workers"]},
                               [(s, arm) for s in seeds for arm in all_arms], arm_dir, ["arm.json"])
  print(f"{len(restored)} finished arms restored from {store_dir}", flush=True)
  sft_runs = [(config_of("sft_only", s), arm_dir(s, "sft_only"), FLAGS.step0_examples) for s in seeds]
  for s, record in zip(seeds, machine.run_parallel(run_arm, sft_runs, FLAGS.workers)):
    arm_store.store(store_dir, s, "sft_only", arm_dir(s, "sft_only"), ["arm.json"])
    entries[s]["step0"] = record.pop("step0")
    entries[s]["arms"]["sft_only"] = record
  save()
  runs = [(s, arm) for s in seeds for arm in all_arms[1:]]
  unfinished = [(s, arm) for s, arm in runs if not os.path.exists(os.path.join(arm_dir(s, arm), "arm.json"))]
  arm_store.start_arms([(config_of("sft_only", s), arm_dir(s, "sft_only"), entries[s]["arms"]["sft_only"]["evals"],
                         arm_dir(s, arm)) for s, arm in unfinished if config_of(arm, s).sft.steps],
                       "sft", eval_records, FLAGS.workers)

  def store_arm(i: int, record: dict):
    seed, arm = runs[i]
    arm_store.store(store_dir, seed, arm, arm_dir(seed, arm), ["arm.json"])  # A stopped run goes on from here.
    entries[seed]["arms"][arm] = record
    if all(a in entries[seed]["arms"] for a in all_arms):
      entries[seed]["arms"] = {a: entries[seed]["arms"][a] for a in all_arms}  # Whatever finished first.
      entries[seed]["machine"] = machine.of_records(entries[seed]["arms"].values())
      save()

  machine.run_parallel(run_arm, [(config_of(arm, s), arm_dir(s, arm)) for s, arm in runs], FLAGS.workers,
                       on_result=store_arm)
  saved["done"] = set(all_arms) == set(report.ARMS)  # A run of some arms leaves the experiment partial.
  save()
  print(results_md.publish(saved, FLAGS.results_file, report))


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()  # The launcher's malloc settings (lemon_rl/utils/allocator.py).
  app.run(main)
