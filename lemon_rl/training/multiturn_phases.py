"""The multi-turn phases of the experiment runner: ``multiturn_sft`` and ``multiturn_rl`` (METHODS.md section 5).

Importing this module registers both in :data:`lemon_rl.training.phases.PHASES` (a config that lists them
imports it, e.g. ``configs/budgetmix_frozenlake.py``); the runner (:func:`lemon_rl.training.experiment.run`)
is unchanged. Both play the ``frozenlake`` task (:mod:`lemon_rl.envs.frozenlake_task`) with the token-in /
token-out episode engine (:mod:`lemon_rl.training.multiturn`), under the engine limits of ``config.episode``.

- ``multiturn_sft`` (section ``config.multiturn_sft``): masked NLL on the task's noisy-expert demonstrations,
  in the engine's layout (:mod:`lemon_rl.training.multiturn_sft`), from the model's initial parameters.
- ``multiturn_rl`` (section ``config.multiturn_rl``): :class:`~lemon_rl.training.multiturn_rl.MultiTurnTrainer`
  from the previous phase's policy. A step draws ``maps_per_step`` training maps (shuffled, resumable) and plays
  ``group_size`` episodes on each; the group's turn budget is ``T_max`` (``budget_mode="full"``, full-budget RL)
  or drawn uniformly from ``{floor(k T_max / 10)}`` (``"budgetmix"``), a pure function of ``(seed, step)``
  (:func:`lemon_rl.training.budgetmix.budgetmix_frozenlake_groups`). ``estimator``: ``grpo``, ``gigpo``
  (anchor ``(cell, B - t)`` with ``budget_in_anchor``, else the cell; :func:`~lemon_rl.training.budgetmix.
  frozenlake_anchor_state`) or ``ppo`` (needs ``model.overrides.value_head=True``).

Held-out evaluation of both phases (:func:`validation_metrics`, every ``eval_every`` steps and at the end):
``config.eval.num_examples`` validation maps, ``config.eval.num_samples`` episodes per map sampled at
``config.eval.temperature`` with the budget of each fraction ``config.eval.fractions`` of ``T_max`` in the
environment and the prompt (:func:`lemon_rl.eval.budget_eval.play`, the same reset seeds and engine key at every
evaluation, so the curve is paired across steps). Metrics: ``success_<pct>`` (success rate at that budget),
``accuracy`` (the success rate at the largest fraction), ``completion_length`` (policy tokens per episode at that
budget) and ``turns`` (turns per episode there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from flax import nnx
from ml_collections import config_dict

from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.envs import frozenlake as fl
from lemon_rl.envs import frozenlake_task as flt
from lemon_rl.eval import budget_eval
from lemon_rl.training import budgetmix
from lemon_rl.training import multiturn_rl as mrl
from lemon_rl.training import phases as phases_lib
from lemon_rl.training import rl as rl_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.multiturn import EpisodeSettings
from lemon_rl.training.multiturn_sft import MultiTurnSFTTrainer
from lemon_rl.training.rollout import SamplingSettings
from lemon_rl.utils import config_checks as cc

# -- evaluation ----------------------------------------------------------------------------------------------


def eval_settings(config, *, num_samples: int, max_k: int = 1, fractions: Sequence[float] = (1.0,),
                  temperature: float = 1.0, seed: int = 0, recovery_fraction: float | None = None
                  ) -> budget_eval.BudgetEvalSettings:
  """:class:`~lemon_rl.eval.budget_eval.BudgetEvalSettings` with the engine limits of ``config.episode`` and the
  environment options of ``config.task`` (``top_k`` / ``top_p`` off)."""
  return budget_eval.BudgetEvalSettings(
      num_samples=int(num_samples), max_k=int(max_k), fractions=tuple(float(f) for f in fractions),
      show_budget=bool(config.task.show_budget), max_action_tokens=int(config.episode.max_action_tokens),
      num_slots=int(config.episode.num_slots), sampling=SamplingSettings(float(temperature), 0, 1.0),
      batch_size=int(config.eval.batch_size) or None, seed=int(seed), recovery_fraction=recovery_fraction,
      env_kwargs=flt.env_kwargs(config.task))


def pct(fraction: float) -> int:
  """``0.25 -> 25``: the label of a budget fraction in metric and statistic names."""
  return int(round(100 * float(fraction)))


def validation_metrics(model, tokenizer, maps: Sequence[fl.Map], config) -> dict[str, float]:
  """Success rate per budget fraction on ``maps`` (module docstring), prompted mode."""
  ev = config.eval
  settings = eval_settings(config, num_samples=ev.num_samples, fractions=ev.fractions, temperature=ev.temperature,
                           seed=ev.seed)
  t_max = budget_eval.map_t_max(maps, settings)
  budgets = budget_eval.budget_table(t_max, settings.fractions)
  metrics = {}
  largest = int(np.argmax(settings.fractions))
  for j, f in enumerate(settings.fractions):
    run = budget_eval.play(model, tokenizer, maps, budgets[:, j], settings)
    metrics[f"success_{pct(f)}"] = float(run.success.mean())
    if j == largest:
      metrics["accuracy"] = float(run.success.mean())
      metrics["turns"] = float(run.turns.mean())
      metrics["completion_length"] = float(np.mean([e.loss_mask.sum() for row in run.episodes for e in row]))
  return metrics


def _evaluator(ctx: phases_lib.PhaseContext, graphdef):
  maps = [flt.record_map(r) for r in ctx.task.validation_examples[:ctx.config.eval.num_examples]]
  return lambda state: validation_metrics(nnx.merge(graphdef, state.params), ctx.task.tokenizer, maps, ctx.config)


# -- multiturn_sft -------------------------------------------------------------------------------------------


def multiturn_sft_phase(ctx: phases_lib.PhaseContext) -> phases_lib.Phase:
  """Masked NLL on the task's demonstrations (``config.multiturn_sft``), evaluated on validation maps."""
  section = ctx.config.multiturn_sft
  optimizer = phases_lib.optimizer_from_section(section)
  graphdef, state = state_lib.create_train_state(ctx.model, optimizer, ctx.config.seed)
  trainer = MultiTurnSFTTrainer(graphdef, optimizer, ctx.task.tokenizer, section.microbatch_size,
                                length_multiple=section.length_multiple, max_length=ctx.config.episode.num_slots)
  iterator = BatchIterator(ctx.task.sft_source, batch_size=section.batch_size, seed=ctx.config.seed)
  phase = phases_lib.policy_phase(ctx, state, iterator, trainer, section.steps, section.eval_every,
                                  ("train/loss", "eval/accuracy"))
  return dataclasses.replace(phase, evaluate=_evaluator(ctx, graphdef))


def check_multiturn_sft_config(config) -> None:
  _check_episode(config)
  section = config.multiturn_sft
  cc.require_positive(section, "multiturn_sft", "steps", "batch_size", "learning_rate", "length_multiple")
  cc.require_positive(section, "multiturn_sft", "eval_every", "warmup_steps", "weight_decay", allow_zero=True)
  cc.require_choice(state_lib.SCHEDULES, "multiturn_sft.lr_schedule", section.lr_schedule)
  micro = section.microbatch_size
  cc.require(micro is None or section.batch_size % micro == 0, "multiturn_sft.microbatch_size", micro,
             f"must divide multiturn_sft.batch_size={section.batch_size}")
  _check_eval(config)


# -- multiturn_rl --------------------------------------------------------------------------------------------


def policy_loss(config) -> rl_lib.PolicyLoss:
  """The clipped surrogate of ``config.multiturn_rl`` (fields as in the ``rl`` section).

  ``max_len``, the constant of the ``seq_mean_token_sum_norm`` aggregation, defaults to ``episode.num_slots``
  (no episode has more policy tokens).
  """
  view = config_dict.ConfigDict(config.multiturn_rl.to_dict())
  view.max_new_tokens = int(config.episode.num_slots)
  return rl_lib.policy_loss_from_config(view)


def max_budget(maps: Sequence[fl.Map], config) -> int:
  """The largest ``T_max`` of ``maps``: the turn slots of the trainer's per-turn arrays."""
  return max(fl.t_max(m, float(config.task.t_max_multiple)) for m in maps)


def multiturn_trainer(config, graphdef, optimizer, tokenizer, num_turns: int, ref_params: Any = None
                      ) -> mrl.MultiTurnTrainer:
  """The :class:`~lemon_rl.training.multiturn_rl.MultiTurnTrainer` of ``config.multiturn_rl``."""
  rl, ep = config.multiturn_rl, config.episode
  loss = policy_loss(config)
  episode = EpisodeSettings(max_turns=int(num_turns), max_action_tokens=int(ep.max_action_tokens),
                            num_slots=int(ep.num_slots), sampling=loss.sampling,
                            invalid_action_reward=float(ep.invalid_action_reward), chunk_size=int(ep.chunk_size))
  settings = mrl.MultiTurnRLSettings(
      episode=episode, estimator=rl.estimator, batch_size=int(ep.batch_size) or None,
      scale_by_std=bool(rl.scale_by_std), gigpo_gamma=float(rl.gigpo_gamma), omega=float(rl.omega),
      budget_in_anchor=bool(rl.budget_in_anchor), gae_gamma=float(rl.gae_gamma), gae_lambda=float(rl.gae_lambda),
      whiten_advantages=bool(rl.whiten_advantages), value_coef=float(rl.value_coef),
      value_clip=rl.value_clip, num_iterations=int(rl.num_iterations),
      num_microbatches=int(rl.num_microbatches), length_multiple=int(rl.length_multiple))
  return mrl.MultiTurnTrainer(graphdef, optimizer, tokenizer, loss, settings,
                              anchor_state=budgetmix.frozenlake_anchor_state, ref_params=ref_params)


class _MapGroupsTrainer:
  """``step(state, examples)``: the examples' maps -> this step's groups -> one multi-turn RL step."""

  def __init__(self, trainer: mrl.MultiTurnTrainer, config):
    self.trainer, self.config = trainer, config

  def step(self, state, examples):
    rl, task = self.config.multiturn_rl, self.config.task
    maps = [flt.record_map(ex) for ex in examples]
    groups = budgetmix.budgetmix_frozenlake_groups(maps, rl.group_size, seed=self.config.seed, step=int(state.step),
                                                   mode=rl.budget_mode, show_budget=bool(task.show_budget),
                                                   **flt.env_kwargs(task))
    return self.trainer.step(state, groups)


def multiturn_rl_phase(ctx: phases_lib.PhaseContext) -> phases_lib.Phase:
  """Multi-turn RL (``config.multiturn_rl``) from the previous phase's policy, evaluated on validation maps."""
  config, rl = ctx.config, ctx.config.multiturn_rl
  optimizer = phases_lib.optimizer_from_section(rl, rl.num_iterations)
  graphdef, state = state_lib.create_train_state(ctx.model, optimizer, config.seed + 1)
  ref_params = phases_lib._frozen_params(ctx.model) if rl.kl_coef else None  # pylint: disable=protected-access
  num_turns = max_budget([flt.record_map(r) for r in ctx.task.rl_source], config)
  trainer = multiturn_trainer(config, graphdef, optimizer, ctx.task.tokenizer, num_turns, ref_params)
  iterator = BatchIterator(ctx.task.rl_source, batch_size=rl.maps_per_step, seed=config.seed)
  phase = phases_lib.policy_phase(ctx, state, iterator, _MapGroupsTrainer(trainer, config), rl.steps, rl.eval_every,
                                  ("episode/success_rate", "eval/accuracy"))
  return dataclasses.replace(phase, evaluate=_evaluator(ctx, graphdef))


def check_multiturn_rl_config(config) -> None:
  _check_episode(config)
  rl = config.multiturn_rl
  cc.require_positive(rl, "multiturn_rl", "maps_per_step", "group_size", "learning_rate", "num_iterations",
                      "num_microbatches", "length_multiple", "temperature")
  cc.require_positive(rl, "multiturn_rl", "eval_every", "warmup_steps", "weight_decay", "kl_coef", "entropy_coef",
                      "top_k", "gigpo_gamma", "omega", "gae_gamma", "gae_lambda", "value_coef", allow_zero=True)
  cc.require(rl.group_size >= 2, "multiturn_rl.group_size", rl.group_size,
             "must be >= 2 (group-relative advantages of a group of one are 0)")
  cc.require_choice(mrl.ESTIMATORS, "multiturn_rl.estimator", rl.estimator)
  cc.require_choice(budgetmix.BUDGET_MODES, "multiturn_rl.budget_mode", rl.budget_mode)
  cc.require_choice(state_lib.SCHEDULES, "multiturn_rl.lr_schedule", rl.lr_schedule)
  cc.require(0 < rl.top_p <= 1, "multiturn_rl.top_p", rl.top_p, "must be in (0, 1]")
  cc.require(not rl.coupled_noise, "multiturn_rl.coupled_noise", rl.coupled_noise,
             "must be False: the multi-turn engine draws each episode's tokens with independent noise")
  rows = rl.maps_per_step * rl.group_size
  cc.require(rows % rl.num_microbatches == 0, "multiturn_rl.num_microbatches", rl.num_microbatches,
             f"must divide multiturn_rl.maps_per_step * multiturn_rl.group_size = {rows}")
  if rl.estimator == "ppo":
    cc.require(bool(config.model.overrides.get("value_head", False)), "model.overrides.value_head",
               config.model.overrides.get("value_head"), "multiturn_rl.estimator='ppo' needs a value head (True)")
  try:
    policy_loss(config)
  except ValueError as e:
    raise cc.ConfigError(f"config.multiturn_rl: {e}") from None
  _check_eval(config)


def _check_episode(config) -> None:
  ep = config.episode
  cc.require_positive(ep, "episode", "max_action_tokens", "num_slots", "chunk_size")
  cc.require_positive(ep, "episode", "batch_size", allow_zero=True)
  cc.require(ep.chunk_size & (ep.chunk_size - 1) == 0, "episode.chunk_size", ep.chunk_size, "must be a power of two")


def _check_eval(config) -> None:
  ev = config.eval
  cc.require_positive(ev, "eval", "num_samples")
  fractions = tuple(ev.fractions)
  cc.require(bool(fractions) and all(0 < f <= 1 for f in fractions), "eval.fractions", fractions,
             "must be budget fractions of T_max in (0, 1]")


phases_lib.PHASES.register("multiturn_sft", phases_lib.PhaseKind(multiturn_sft_phase, check_multiturn_sft_config))
phases_lib.PHASES.register("multiturn_rl", phases_lib.PhaseKind(multiturn_rl_phase, check_multiturn_rl_config))
