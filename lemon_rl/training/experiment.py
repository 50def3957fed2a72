"""An experiment: build the task and model, run the config's phases in order; resumable, logged, summarised.

``run(config, workdir)`` is what ``python -m experiments.main`` calls. ``config.phases`` names the phases
(each a config section and a builder in :data:`lemon_rl.training.phases.PHASES`; skipped when its ``steps``
is 0), e.g. ``("sft", "rl")``: masked NLL on demonstrations from a random init, then the RL algorithm
``rl.algorithm`` from the SFT parameters with a fresh optimizer. Each phase starts from the parameters the
previous one ended with.

The policy is a random init of ``model.preset`` with the task's tokenizer, or, with ``model.hf_checkpoint``, a
local Hugging Face model directory (:func:`build_policy`): its weights, tokenizer (every declared EOS id) and,
with ``model.chat_template``, its chat template for every prompt; the task's data and rewards stay the task's.

Each phase checkpoints into ``workdir/checkpoints/<phase>`` (parameters, optimizer state, step, PRNG key,
data-iterator position, elapsed time). Re-running on the same ``workdir`` resumes from the latest committed
checkpoint; a SIGTERM makes the run save a checkpoint at the end of the current step and exit with status 143.
All randomness derives from ``(seed, step)``, so a resumed run reproduces an uninterrupted one exactly.

Several processes (``jax.distributed`` started first, :mod:`lemon_rl.training.distributed`): every process
runs this same loop on one global mesh; batch sizes in the config are global. Process 0 writes the config,
metrics, progress bar and summary; process 0 builds the task's data first (the others then read it);
checkpoints are written by all processes together (orbax, a filesystem every process sees). Once per step
every process learns whether any received SIGTERM (the preemption sync point), so all save the same step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
from typing import Any, Callable

import jax
from absl import logging
from flax import nnx
from tqdm import tqdm

from lemon_rl.envs.tasks import TASKS, Task
from lemon_rl.eval import evaluate
from lemon_rl.models import Transformer, activation_sharding, get_preset, make_mesh, shard_model
from lemon_rl.models.hf import load_hf_policy
from lemon_rl.models.sharding import axis_rules
from lemon_rl.text.decoding import ChatPromptTokenizer
from lemon_rl.training import distributed
from lemon_rl.training.checkpoint import Checkpointer
from lemon_rl.training.config_validation import validate_config
from lemon_rl.training.metrics import MetricsWriter, plot_curves, read_records
from lemon_rl.training.phases import PHASES, Phase, PhaseContext

PREEMPTED_EXIT_CODE = 143


class Preempted(Exception):
  """Raised after a checkpoint was saved in response to SIGTERM."""


class SigtermFlag:
  """While active (main thread only), turns SIGTERM into the flag ``raised``, checked between steps; the
  handler does no other work than ``on_signal()`` (e.g. passing the signal on to child processes)."""

  def __init__(self, on_signal: Callable[[], None] = lambda: None):
    self.raised = False
    self._on_signal = on_signal
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # Not the main thread: leave signals alone.
      self._previous = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.raised = True
    self._on_signal()

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
  """A columnar batch ``{field: [B]}`` -> ``B`` example dicts."""
  keys = list(batch)
  return [dict(zip(keys, values)) for values in zip(*(batch[k] for k in keys))]


# The preset's fields that also apply to a Hugging Face checkpoint (whose config.json gives the architecture).
CHECKPOINT_PRESET_FIELDS = ("param_dtype", "dtype", "remat", "remat_policy", "value_head")


def model_overrides(config) -> dict[str, Any]:
  """``model.overrides``, with the rule set ``model.axis_rules`` (if named) as ``axis_rules``."""
  overrides = dict(config.model.overrides)
  if config.model.get("axis_rules"):
    overrides.setdefault("axis_rules", axis_rules(config.model.axis_rules))
  return overrides


def build_model(config, vocab_size: int) -> Transformer:
  """The preset with the config's overrides; the vocabulary follows the task's tokenizer."""
  overrides = model_overrides(config)
  overrides.setdefault("vocab_size", vocab_size)
  if overrides["vocab_size"] < vocab_size:
    raise ValueError(f"config.model.overrides.vocab_size={overrides['vocab_size']} is smaller than the "
                     f"tokenizer's vocabulary ({vocab_size})")
  return Transformer(get_preset(config.model.preset, **overrides), rngs=nnx.Rngs(config.seed))


def task_section(config):
  """``config.task``; with ``model.hf_checkpoint``, a task section that has a ``tokenizer`` field gets the
  checkpoint there, so that what the task builds with its tokenizer (e.g. a reward's token counts) uses the
  policy's."""
  path = config.model.get("hf_checkpoint", "")
  if not path or "tokenizer" not in config.task or config.task.tokenizer == path:
    return config.task
  section = config.task.copy_and_resolve_references()
  section.tokenizer = path
  return section


def checkpoint_overrides(config) -> dict[str, Any]:
  """The ``ModelConfig`` fields a Hugging Face checkpoint is loaded with: the preset's
  :data:`CHECKPOINT_PRESET_FIELDS`, then :func:`model_overrides`."""
  preset = get_preset(config.model.preset)
  return {**{name: getattr(preset, name) for name in CHECKPOINT_PRESET_FIELDS}, **model_overrides(config)}


def build_policy(config, task: Task) -> tuple[Transformer, Task]:
  """The initial policy and the task it trains on (module docstring).

  With ``model.hf_checkpoint``: :func:`load_hf_policy` with :func:`checkpoint_overrides`, and the task with the
  directory's tokenizer, wrapped in :class:`ChatPromptTokenizer` when ``model.chat_template`` is set.
  Otherwise :func:`build_model` and the task as it is.
  """
  path = config.model.get("hf_checkpoint", "")
  if not path:
    return build_model(config, task.tokenizer.vocab_size), task
  model, tokenizer, template = load_hf_policy(path, **checkpoint_overrides(config))
  if config.model.chat_template:
    if template is None:
      raise ValueError(f"config.model.chat_template=True but {path} declares no chat template "
                       "(tokenizer_config.json's chat_template or chat_template.jinja)")
    tokenizer = ChatPromptTokenizer(tokenizer, template)
  return model, dataclasses.replace(task, tokenizer=tokenizer)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class _PhaseRunner:
  """The loop every phase shares: resume, step, log, evaluate, checkpoint, honour SIGTERM.

  ``checkpoint`` has ``every`` (steps between checkpoints, plus the last step and on SIGTERM), ``max_to_keep``
  and ``async_save`` (an experiment config's ``checkpoint`` section)."""

  def __init__(self, name: str, checkpoint, workdir: str, writer: MetricsWriter, sigterm: SigtermFlag):
    self.name = name
    self.every = checkpoint.every
    self.writer = writer
    self.sigterm = sigterm
    self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints", name),
                             max_to_keep=checkpoint.max_to_keep, async_save=checkpoint.async_save)

  def run(self, phase: Phase):
    """Runs (or resumes) ``phase``; returns ``(final state, elapsed seconds)``."""
    state, iterator, steps, eval_every = phase.state, phase.iterator, phase.steps, phase.eval_every
    start, elapsed = 0, 0.0
    latest = self.ckpt.latest_step()
    if latest is not None:
      state, meta = self.ckpt.restore(_abstract(state))
      iterator.set_state(meta["data"])
      start, elapsed = int(meta["phase_step"]), float(meta["elapsed_s"])
      self.writer.truncate(self.name, start)
      self.writer.truncate(f"eval_{self.name}", start)
      logging.info("%s: resumed from step %d", self.name, start)
    if start == 0 and eval_every:
      self._evaluate(state, 0, phase.evaluate)
    bar = tqdm(total=steps, initial=start, desc=self.name, dynamic_ncols=True, mininterval=1.0,
               disable=not distributed.is_main())
    for step in range(start + 1, steps + 1):
      t0 = time.perf_counter()
      state, metrics = phase.step(state, rows(next(iterator)))
      jax.block_until_ready(state)  # Dispatch is asynchronous: time the computation, not its launch.
      elapsed += time.perf_counter() - t0
      metrics["time/elapsed_s"] = elapsed
      record = self.writer.write(self.name, step, metrics)
      if (eval_every and step % eval_every == 0) or step == steps:
        record.update(self._evaluate(state, step, phase.evaluate))
      bar.set_postfix({k.split("/")[-2] if k.count("/") > 1 else k.split("/")[-1]: f"{record[k]:.3g}"
                       for k in phase.progress_keys if isinstance(record.get(k), float)}, refresh=False)
      bar.update(1)
      stop = distributed.global_any(self.sigterm.raised)  # Preemption sync point: any process's SIGTERM.
      if step % self.every == 0 or step == steps or stop:
        self.ckpt.save(step, state, {"data": iterator.get_state(), "phase_step": step, "elapsed_s": elapsed})
      if stop:
        self.ckpt.wait_until_finished()
        self.writer.flush()
        bar.close()
        raise Preempted(f"{self.name}: SIGTERM received{' by a process' if not self.sigterm.raised else ''}; "
                        f"checkpoint saved at step {step}")
    bar.close()
    self.ckpt.wait_until_finished()
    self.writer.flush()
    return state, elapsed

  def _evaluate(self, state, step: int, eval_fn) -> dict[str, float]:
    metrics = eval_fn(state)
    self.writer.write(f"eval_{self.name}", step, metrics)
    logging.info("%s step %d eval: %s", self.name, step, metrics)
    return {f"eval/{k}": v for k, v in metrics.items()}

  def close(self):
    self.ckpt.close()


def _run_phase(name: str, phase: Phase, checkpoint, workdir: str, writer: MetricsWriter,
               sigterm: SigtermFlag) -> tuple[Any, float]:
  """Runs (or resumes) ``phase``, calls ``phase.finish`` on its final state; returns ``(final state, elapsed
  seconds)``."""
  runner = _PhaseRunner(name, checkpoint, workdir, writer, sigterm)
  try:
    state, elapsed = runner.run(phase)
  finally:
    runner.close()
  phase.finish(state)
  return state, elapsed


def run_phase(name: str, phase: Phase, workdir: str, checkpoint,
              writer: MetricsWriter | None = None) -> tuple[Any, float]:
  """Runs (or resumes) one built ``phase`` on its own, as :func:`run` runs each of an experiment's phases:
  checkpoints in ``workdir/checkpoints/<name>`` (``checkpoint``: ``every``, ``max_to_keep``, ``async_save``),
  metrics to ``writer`` (default: ``workdir/metrics.jsonl``), :class:`Preempted` after the checkpoint a SIGTERM
  asks for. For what trains outside a policy experiment (LEMON's worker models, the stdlib target and its
  drafter, PPOW; :func:`lemon_rl.training.phases.numbered_phase`). Returns ``(final state, elapsed seconds)``,
  the seconds summed over resumes."""
  own_writer = writer is None
  writer = MetricsWriter(workdir, tensorboard=False) if own_writer else writer
  try:
    with SigtermFlag() as sigterm:
      return _run_phase(name, phase, checkpoint, workdir, writer, sigterm)
  finally:
    if own_writer:
      writer.close()


def start_from(source_workdir: str, workdir: str, phase: str) -> bool:
  """Starts the run in ``workdir`` from a copy of ``source_workdir``'s ``phase`` checkpoints (the runner then
  resumes that phase, or skips it if finished); a copy already there is kept. Returns whether it copied."""
  dst = os.path.join(workdir, "checkpoints", phase)
  if os.path.exists(dst):
    return False
  shutil.copytree(os.path.join(source_workdir, "checkpoints", phase), dst)
  return True


def run(config, workdir: str, final_eval: Callable[[nnx.Module, Task], dict[str, Any]] | None = None
        ) -> dict[str, Any]:
  """Runs (or resumes) the experiment described by ``config`` in ``workdir``; returns the summary.

  ``final_eval(model, task)``, if given, scores the final policy; its dict goes into the summary under
  ``final_eval``.
  """
  validate_config(config)
  distributed.check_supported(config)
  os.makedirs(workdir, exist_ok=True)
  if distributed.is_main():
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  with distributed.main_process_first("build_task"):  # Process 0 prepares the data on disk.
    task: Task = TASKS.get(config.task.name)(task_section(config), config.data_dir or os.path.join(workdir, "data"))
  distributed.check_supported(config, task)
  mesh = make_mesh(**config.mesh)
  model, task = build_policy(config, task)
  model = shard_model(model, mesh)
  writer = MetricsWriter(workdir, tensorboard=config.tensorboard) if distributed.is_main() else \
      distributed.MetricsSink()
  graphdef = nnx.graphdef(model)
  test = task.test_examples[:config.eval.num_examples]

  def evaluate_policy(params):
    metrics, _ = evaluate(nnx.merge(graphdef, params), task.tokenizer, test, task.eval_reward,
                          task.max_new_tokens, batch_size=config.eval.batch_size)
    return metrics

  phase_times = {}
  with activation_sharding(mesh, model.cfg.axis_rules), SigtermFlag() as sigterm:
    for name in config.phases:
      if not config[name].steps:
        continue
      phase = PHASES.get(name)(PhaseContext(config, task, model, workdir, evaluate_policy))
      _, phase_times[name] = _run_phase(name, phase, config.checkpoint, workdir, writer, sigterm)
    final = final_eval(model, task) if final_eval is not None else None
  writer.close()
  summary = summarize(workdir, config, phase_times, final) if distributed.is_main() else None
  distributed.barrier("summary")
  if summary is None:  # The other processes return process 0's summary.
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  return summary


def summarize(workdir: str, config, phase_times: dict[str, float],
              final_eval: dict[str, Any] | None = None) -> dict[str, Any]:
  """Writes ``summary.json``, ``summary.txt`` and ``curves.png``; returns the summary dict."""
  records = read_records(os.path.join(workdir, "metrics.jsonl"))
  summary: dict[str, Any] = {"seed": config.seed, **{f"{p}_steps": config[p].steps for p in config.phases},
                             "wall_time_s": {k: round(v, 1) for k, v in phase_times.items()}}
  if final_eval is not None:
    summary["final_eval"] = final_eval
  for phase in config.phases:  # The policy phases' held-out accuracy and completion length.
    evals = [r for r in records if r["phase"] == f"eval_{phase}" and "accuracy" in r]
    if evals:
      summary[f"{phase}_initial_accuracy"] = evals[0]["accuracy"]
      summary[f"{phase}_final_accuracy"] = evals[-1]["accuracy"]
      summary[f"{phase}_final_completion_length"] = evals[-1]["completion_length"]
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  lines = [f"workdir: {workdir}", f"seed: {config.seed}"]
  for phase in config.phases:
    if f"{phase}_final_accuracy" in summary:
      lines.append(f"{phase}: {summary[f'{phase}_initial_accuracy']:.3f} -> "
                   f"{summary[f'{phase}_final_accuracy']:.3f} held-out accuracy "
                   f"({config[phase].steps} steps, {summary['wall_time_s'].get(phase, 0):.0f} s)")
  with open(os.path.join(workdir, "summary.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
  plot_curves(records, os.path.join(workdir, "curves.png"), {
      "reward": [("rl", "reward/total/mean")],
      "held-out accuracy": [("eval_sft", "accuracy"), ("eval_rl", "accuracy")],
      "completion length": [("rl", "completion_length/mean"), ("eval_sft", "completion_length"),
                            ("eval_rl", "completion_length")],
  })
  print("\n".join(lines))
  return summary
