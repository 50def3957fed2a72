"""Training phases: what the experiment runner runs, one registered builder per phase.

An experiment config lists its phases in order (``config.phases``, e.g. ``("sft", "expert_sft", "rl")``);
each name is a config section with at least ``steps`` and ``eval_every`` and a :class:`PhaseKind` (builder
and config check) registered in :data:`PHASES`. The runner (:func:`lemon_rl.training.experiment.run`) knows nothing of what a phase does:
for every listed phase with ``steps > 0`` it calls the builder with a :class:`PhaseContext` (the task, the
model holding the parameters of the previous phase, the config) and gets a :class:`Phase` back (initial
state, data iterator, step, evaluation and finish functions), which it runs with resumption, logging,
evaluation, checkpoints and SIGTERM handling, then calls ``phase.finish(state)``: the policy phases load
their final parameters into the model for the next phase; a phase that trains something else (a drafter,
a tokenizer, a worker) hands its result on its own way and leaves the policy as it is.

A new method adds a phase (drafter training, PPOW, worker training...) by registering a builder here or in
its own module (``PHASES.register("ppow", PhaseKind(build_ppow_phase, check_ppow_config))``) and listing it
in its config: the runner does not change. The ``rl`` phase itself dispatches on ``rl.algorithm`` through :data:`RL_ALGORITHMS` (GRPO and
the FEST variants), which new single-turn algorithms extend the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.envs.tasks import Task
from lemon_rl.training import distributed
from lemon_rl.training import fest as fest_lib
from lemon_rl.training import rl as rl_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.sft import SFTTrainer
from lemon_rl.utils import config_checks as cc
from lemon_rl.utils.registry import Registry

StepFn = Callable[[Any, list[dict[str, Any]]], tuple[Any, dict[str, float]]]  # (state, examples) -> (state, metrics)


@dataclasses.dataclass
class PhaseContext:
  """What a phase builder may read.

  Attributes:
    config: the experiment config.
    task: the task (tokenizer, data sources, rewards).
    model: the policy, holding the parameters the previous phase ended with.
    workdir: the run's directory (a phase may persist what it builds there, resume-safely).
    evaluate_policy: ``evaluate_policy(params) -> metrics``, the held-out evaluation of policy parameters.
  """

  config: Any
  task: Task
  model: nnx.Module
  workdir: str
  evaluate_policy: Callable[[Any], dict[str, float]]


@dataclasses.dataclass
class Phase:
  """A built phase: the runner resumes ``state`` and ``iterator`` and calls ``step`` ``steps`` times.

  Attributes:
    state: the initial state, a pytree the runner checkpoints (a
      :class:`~lemon_rl.training.state.TrainState` for the policy phases).
    iterator: yields columnar batches ``{field: [B]}``; has ``get_state`` / ``set_state`` (checkpointed).
    step: ``step(state, examples) -> (state, metrics)``.
    steps: number of steps.
    eval_every: held-out evaluation period (0 = only at the end).
    progress_keys: metrics shown on the progress bar.
    evaluate: ``evaluate(state) -> metrics`` on held-out data (default: none).
    finish: ``finish(state)``, called once the phase has run: hands its result to the next phase (default:
      nothing; :func:`lemon_rl.training.experiment.run_phase` also returns the final state).
  """

  state: Any
  iterator: Iterator[dict[str, list[Any]]]
  step: StepFn
  steps: int
  eval_every: int
  progress_keys: tuple[str, ...]
  evaluate: Callable[[Any], dict[str, float]] = lambda state: {}
  finish: Callable[[Any], None] = lambda state: None


class StepNumbers:
  """The iterator of a phase that draws its own data from the step number: yields ``{"step": [n]}`` for
  ``n = 1, 2, ...``; its state is the next number."""

  def __init__(self):
    self._next = 1

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, list[int]]:
    self._next += 1
    return {"step": [self._next - 1]}

  def get_state(self) -> dict[str, int]:
    return {"next": self._next}

  def set_state(self, state: dict[str, int]) -> None:
    self._next = int(state["next"])


def numbered_phase(state: Any, step: Callable[[Any, int], tuple[Any, dict[str, Any]]], steps: int, *,
                   progress_keys: tuple[str, ...], eval_every: int = 0,
                   evaluate: Callable[[Any], dict[str, float]] = lambda state: {}) -> Phase:
  """A phase whose ``step(state, n) -> (state, metrics)`` draws its batch from the step number ``n`` (1-based;
  e.g. rows indexed by ``(seed, n)``), so its resume needs only the state and ``n``. For what trains outside a
  task's data pipeline (a drafter, a stdlib target, PPOW), run by
  :func:`lemon_rl.training.experiment.run_phase`."""
  return Phase(state, StepNumbers(), lambda state, examples: step(state, examples[0]["step"]), steps, eval_every,
               progress_keys, evaluate)


def policy_phase(ctx: PhaseContext, state: state_lib.TrainState, iterator, trainer, steps: int, eval_every: int,
                 progress_keys: tuple[str, ...], refill: bool = False) -> Phase:
  """A phase that trains the policy with ``trainer.step(state, examples) -> (state, metrics, extra)``: it is
  evaluated with the task's held-out evaluation and hands its parameters to the next phase. With ``refill``
  the step may draw more examples from ``iterator`` (``trainer.step(state, examples, refill)``, e.g. dynamic
  sampling); the runner checkpoints the iterator's position after the step, so a resume continues after
  every batch a step drew."""

  def draw():  # The iterator's next batch as example dicts, as the runner passes them to `step`.
    batch = next(iterator)
    return [dict(zip(batch, values)) for values in zip(*batch.values())]

  def step(state, examples):
    state, metrics, _ = trainer.step(state, examples, draw) if refill else trainer.step(state, examples)
    return state, metrics

  return Phase(state, iterator, step, steps, eval_every, progress_keys,
               evaluate=lambda state: ctx.evaluate_policy(state.params),
               finish=lambda state: nnx.update(ctx.model, state.params))


ConfigCheck = Callable[[Any], None]


@dataclasses.dataclass(frozen=True)
class PhaseKind:
  """A registered phase: ``build(context) -> Phase`` and ``check_config(config)`` (raises ``ConfigError``
  naming the field; called before anything is compiled, for phases with ``steps > 0``)."""

  build: Callable[[PhaseContext], Phase]
  check_config: ConfigCheck

  def __call__(self, context: PhaseContext) -> Phase:
    return self.build(context)


PHASES: Registry[PhaseKind] = Registry("phase")


def optimizer_from_section(section, updates_per_step: int = 1):
  """AdamW from a phase section (``learning_rate``, ``steps``, ``warmup_steps``, ``weight_decay``,
  ``max_grad_norm`` and, if present, ``lr_schedule``; else cosine), ``updates_per_step`` updates a step."""
  return state_lib.make_optimizer(section.learning_rate, section.steps * updates_per_step,
                                  section.warmup_steps * updates_per_step, section.weight_decay,
                                  section.max_grad_norm, schedule=section.get("lr_schedule", "cosine"))


def _sft_phase(ctx: PhaseContext, section, source, max_completion_len: int, microbatch_size,
               seed_offset: int) -> Phase:
  optimizer = optimizer_from_section(section)
  graphdef, state = state_lib.create_train_state(ctx.model, optimizer, ctx.config.seed + seed_offset)
  trainer = SFTTrainer(graphdef, optimizer, ctx.task.tokenizer, max_completion_len, microbatch_size,
                       ctx.task.prompt_len)
  # This process's share of each global batch (all of it with one process).
  iterator = BatchIterator(source, seed=ctx.config.seed, **distributed.iterator_shard(section.batch_size))
  return policy_phase(ctx, state, iterator, trainer, section.steps, section.eval_every,
                      ("train/loss", "eval/accuracy"))


def _check_sft_section(name: str) -> ConfigCheck:

  def check(config) -> None:
    section = config[name]
    cc.require_positive(section, name, "steps", "batch_size", "learning_rate")
    cc.require_positive(section, name, "eval_every", "warmup_steps", "weight_decay", allow_zero=True)
    micro = section.get("microbatch_size")
    cc.require(micro is None or section.batch_size % micro == 0, f"{name}.microbatch_size", micro,
               f"must divide {name}.batch_size={section.batch_size}")

  return check


def sft_phase(ctx: PhaseContext) -> Phase:
  """Masked NLL on the task's demonstrations (``config.sft``)."""
  sft = ctx.config.sft
  return _sft_phase(ctx, sft, ctx.task.sft_source, ctx.task.max_completion_len, sft.microbatch_size, 0)


def expert_sft_source(task, easy_per_shot: int, task_name: str = "") -> list:
  """The task's expert demonstrations (FEST's ``D_E``) followed by the first ``easy_per_shot * |D_E|`` of its
  SFT demonstrations: a batch then holds ``1 / (1 + easy_per_shot)`` expert rows in expectation (the mixed-SFT
  control; 0 = the shots alone)."""
  expert = task.expert_source
  if expert is None:
    raise ValueError(f"expert SFT needs a task with expert demonstrations; task {task_name!r} has none")
  num_easy = int(easy_per_shot) * len(expert)
  if not 0 <= num_easy <= len(task.sft_source):
    raise ValueError(f"expert_sft.easy_per_shot={easy_per_shot} needs {num_easy} SFT demonstrations; task "
                     f"{task_name!r} has {len(task.sft_source)}")
  return list(expert) + [task.sft_source[i] for i in range(num_easy)]


def expert_sft_phase(ctx: PhaseContext) -> Phase:
  """SFT on :func:`expert_sft_source` (``config.expert_sft``), padded to the sampling length."""
  section = ctx.config.expert_sft
  source = expert_sft_source(ctx.task, section.get("easy_per_shot", 0), ctx.config.task.name)
  return _sft_phase(ctx, section, source, ctx.task.max_new_tokens, None, 2)


def continued_sft_phase(ctx: PhaseContext) -> Phase:
  """More SFT on the task's demonstrations (``config.continued_sft``) from the previous phase's policy: the
  control that spends an RL phase's compute on SFT instead (its data order restarts at ``config.seed``'s)."""
  section = ctx.config.continued_sft
  return _sft_phase(ctx, section, ctx.task.sft_source, ctx.task.max_completion_len, section.microbatch_size, 3)


PHASES.register("sft", PhaseKind(sft_phase, _check_sft_section("sft")))
PHASES.register("expert_sft", PhaseKind(expert_sft_phase, _check_sft_section("expert_sft")))
PHASES.register("continued_sft", PhaseKind(continued_sft_phase, _check_sft_section("continued_sft")))


# -- RL ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RLAlgorithm:
  """A registered RL algorithm: ``build(context, graphdef, optimizer) -> (trainer, iterator)`` (the trainer
  has ``step(state, examples) -> (state, metrics, rollout)``) and the checks of its own config fields."""

  build: Callable[[PhaseContext, Any, Any], tuple[Any, Iterator[dict[str, list[Any]]]]]
  check_config: ConfigCheck = lambda config: None

  def __call__(self, context: PhaseContext, graphdef, optimizer):
    return self.build(context, graphdef, optimizer)


RL_ALGORITHMS: Registry[RLAlgorithm] = Registry("RL algorithm")


def grpo_trainer(ctx: PhaseContext, graphdef, optimizer):
  """The GRPO-family trainer; a task's ``prepare_rl`` hook may supply rewards and data order (CAST)."""
  cfg, task, rl = ctx.config, ctx.task, ctx.config.rl
  if task.prepare_rl is not None:  # Rewards / data order that depend on the SFT policy (e.g. CAST).
    rewards, iterator = task.prepare_rl(ctx.model, task.tokenizer, ctx.workdir, cfg)
  else:
    rewards = task.rewards
    iterator = BatchIterator(task.rl_source, seed=cfg.seed, **distributed.iterator_shard(rl.prompts_per_step))
  ref_params = _frozen_params(ctx.model) if rl.kl_coef else None
  return rl_lib.RLTrainer(graphdef, optimizer, task.tokenizer, rewards, rl, ref_params=ref_params,
                   prompt_len=task.prompt_len), iterator


RL_ALGORITHMS.register("grpo", RLAlgorithm(grpo_trainer))


def _fest_trainer(algorithm: str):

  def build(ctx: PhaseContext, graphdef, optimizer):
    """FEST (METHODS.md section 2): two streams, ``D_I`` answers only and ``D_E`` expert solutions."""
    cfg, task, rl = ctx.config, ctx.task, ctx.config.rl
    if task.expert_source is None:
      raise ValueError(f"config.rl.algorithm={algorithm!r} needs a task with expert demonstrations; "
                       f"task {cfg.task.name!r} has none")
    iterator = fest_lib.TwoStreamIterator(
        BatchIterator(task.rl_source, batch_size=rl.prompts_per_step, seed=cfg.seed),
        BatchIterator(task.expert_source, batch_size=cfg.fest.expert_prompts_per_step, seed=cfg.seed))
    trainer = fest_lib.FestTrainer(graphdef, optimizer, task.tokenizer, task.rewards, rl, cfg.fest, algorithm,
                                   _frozen_params(ctx.model), prompt_len=task.prompt_len)
    return trainer, iterator

  return build


for _algorithm in fest_lib.FEST_ALGORITHMS:
  RL_ALGORITHMS.register(_algorithm, RLAlgorithm(_fest_trainer(_algorithm), fest_lib.check_config))


def _frozen_params(model: nnx.Module):
  """A copy of the model's parameters at the start of the phase (the frozen reference policy)."""
  return jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))


def rl_updates_per_step(rl) -> int:
  """Optimizer updates per RL step: ``num_iterations`` passes over ``rows / minibatch_size`` minibatches."""
  rows = rl.prompts_per_step * rl.num_generations
  return rl.num_iterations * (rows // (rl.minibatch_size or rows))


def rl_phase(ctx: PhaseContext) -> Phase:
  """RL of the algorithm ``config.rl.algorithm`` (:data:`RL_ALGORITHMS`), from the previous phase's policy."""
  rl = ctx.config.rl
  optimizer = optimizer_from_section(rl, rl_updates_per_step(rl))
  graphdef, state = state_lib.create_train_state(ctx.model, optimizer, ctx.config.seed + 1)
  trainer, iterator = RL_ALGORITHMS.get(rl.algorithm)(ctx, graphdef, optimizer)
  return policy_phase(ctx, state, iterator, trainer, rl.steps, rl.eval_every,
                      ("reward/total/mean", "train/clip_frac", "eval/accuracy"), refill=rl.dynamic_sampling)


def check_rl_config(config) -> None:
  """The ``rl`` section (:func:`lemon_rl.training.rl.check_config`), then the algorithm's own checks."""
  cc.require_name(RL_ALGORITHMS, "rl.algorithm", config.rl.algorithm)
  rl_lib.check_config(config)
  RL_ALGORITHMS.get(config.rl.algorithm).check_config(config)


PHASES.register("rl", PhaseKind(rl_phase, check_rl_config))
