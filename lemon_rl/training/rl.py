"""The single-turn GRPO-family trainer.

One step: :func:`lemon_rl.training.rollout.collect_rollout` (``G`` completions per prompt, rewards, group
advantages) -> ``num_iterations`` passes of minibatch updates, each with exact gradient accumulation over
micro-batches, under the clipped surrogate of :mod:`lemon_rl.losses.policy_gradient` (optionally a KL to a
frozen reference, an entropy bonus and truncated importance sampling against the sampler's log-probs). The
learner scores tokens under the sampling distribution (temperature, top-k, top-p) the rollouts came from.
With ``rl.dynamic_sampling`` the rollout drops groups without reward variance and refills the batch
(:func:`lemon_rl.training.rollout.collect_dynamic_rollout`); with ``rl.skip_zero_signal`` a batch without
signal makes no optimizer update (:func:`lemon_rl.training.rollout.rollout_and_update`).

Several processes: each process's rollout rows become its rows of one global batch
(:func:`lemon_rl.training.distributed.to_global`); minibatches are drawn from the global batch by global row
index on the devices (:func:`lemon_rl.training.distributed.take_rows`), so the updates do not depend on the
number of processes; ``rl.prompts_per_step`` and ``rl.minibatch_size`` count global prompts and rows.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from lemon_rl.losses import advantages as advantages_lib
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.losses.surrogate import SurrogateSettings, surrogate_fields_from_config
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.training import distributed
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import speculative_rollouts
from lemon_rl.training import state as state_lib
from lemon_rl.training.rollout import Rollout, SamplingSettings
from lemon_rl.training.state import TrainState
from lemon_rl.utils import config_checks as cc


@dataclasses.dataclass(frozen=True)
class PolicyLoss(SurrogateSettings):
  """The policy-gradient loss of one micro-batch (hashable: a static argument of the jitted update).

  ``batch`` holds ``ids [N, T]``, ``attention_mask [N, T]``, ``loss_mask [N, T-1]``, ``advantages [N]``,
  and optionally ``old_logp``, ``ref_logp`` and ``sampler_logp`` (``[N, T-1]``); without ``old_logp`` the
  update is on-policy (the current log-probs, without gradient, stand in for them).

  Log-probs (the ratio's, TIS's and the KL's) are taken under ``sampling``, the distribution the rollouts
  were sampled from, so that before any update they equal the sampler's. *Decision*: the entropy bonus is
  the entropy of the tempered, unfiltered distribution (the filter is a truncation, not a density to
  regularise).
  """

  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  tis_cap: float | None = None
  sampling: SamplingSettings = SamplingSettings()

  def __post_init__(self):
    if self.kl_coef and self.sampling.filters:
      raise ValueError(
          f"kl_coef={self.kl_coef} with top_k={self.sampling.top_k} / top_p={self.sampling.top_p}: the KL to a "
          "reference under a truncated sampling distribution is infinite wherever the reference's top-k / "
          "top-p set misses a sampled token; use top_k=0 and top_p=1.0 with a KL penalty")

  def __call__(self, model: nnx.Module, batch: Mapping[str, jax.Array]):
    return self.loss_from_logits(model(batch["ids"], batch["attention_mask"])[:, :-1], batch)

  def loss_from_logits(self, logits: jax.Array, batch: Mapping[str, jax.Array]):
    """The loss from next-token ``logits [N, T-1, V]`` (for losses that also read the hidden states)."""
    logp = self.sampling.token_log_probs(logits, batch["ids"][:, 1:])
    entropy = rollout_lib.entropy_of(logits, self.sampling)
    if not self.entropy_coef:
      entropy = jax.lax.stop_gradient(entropy)
    kwargs = self.surrogate_kwargs()
    if "sampler_logp" in batch:
      kwargs.update(sampler_logp=batch["sampler_logp"], tis_cap=self.tis_cap)
    # Absent old log-probs mean an exactly on-policy update: ratio = exp(logp - sg[logp]) = 1 with the
    # gradient of logp, which saves the separate forward pass.
    old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
    loss, metrics = pg.grpo_loss(
        logp, old_logp, batch["advantages"], batch["loss_mask"], ref_logp=batch.get("ref_logp"),
        kl_coef=self.kl_coef, kl_estimator=self.kl_estimator, entropy=entropy, entropy_coef=self.entropy_coef,
        **kwargs)
    return loss, metrics


def policy_loss_from_config(cfg) -> PolicyLoss:
  """Builds the loss from the ``rl`` config section (names checked against the registries)."""
  pg.KL_ESTIMATORS.validate(cfg.kl_estimator)
  return PolicyLoss(**surrogate_fields_from_config(cfg), kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                    entropy_coef=cfg.entropy_coef, tis_cap=cfg.get("tis_cap") if cfg.get("use_tis") else None,
                    sampling=SamplingSettings.from_config(cfg))


def check_config(config) -> None:
  """The ``rl`` section as the single-turn RL trainers read it (names, ranges, batch divisibility)."""
  rl = config.rl
  speculative_rollouts.check_config(rl)
  cc.require_positive(rl, "rl", "steps", "eval_every", "warmup_steps", "weight_decay", "kl_coef", "entropy_coef",
                      "temperature", "top_k", allow_zero=True)
  if not rl.steps:
    return
  cc.require_positive(rl, "rl", "prompts_per_step", "num_generations", "max_new_tokens", "num_iterations",
                      "learning_rate", "microbatch_size")
  cc.require_name(advantages_lib.ADVANTAGE_ESTIMATORS, "rl.advantage_estimator", rl.advantage_estimator)
  cc.require(rl.advantage_estimator != "gigpo", "rl.advantage_estimator", rl.advantage_estimator,
             "gigpo needs per-step anchor states (multi-turn); the single-turn trainers take an outcome "
             "estimator: grpo, dr_grpo, rloo or reinforce_pp_baseline")
  cc.require_choice(state_lib.SCHEDULES, "rl.lr_schedule", rl.lr_schedule)
  cc.require(0 < rl.top_p <= 1, "rl.top_p", rl.top_p, "must be in (0, 1]")
  try:  # The loss's own checks (names, clip ranges, TIS cap, KL with a truncated sampler), before compiling.
    policy_loss_from_config(rl)
  except ValueError as e:
    raise cc.ConfigError(f"config.rl: {e}") from None
  rows = rl.prompts_per_step * rl.num_generations
  minibatch = rl.minibatch_size or rows
  cc.require(rows % minibatch == 0, "rl.minibatch_size", rl.minibatch_size,
             f"must divide rl.prompts_per_step * rl.num_generations = {rows}")
  cc.require(minibatch % rl.microbatch_size == 0, "rl.microbatch_size", rl.microbatch_size,
             f"must divide the minibatch size {minibatch}")
  check_zero_signal_options(rl)


def check_zero_signal_options(rl) -> None:
  """``rl.skip_zero_signal``, ``rl.dynamic_sampling`` (booleans) and ``rl.dynamic_sampling_max_rounds``."""
  for field in ("skip_zero_signal", "dynamic_sampling"):
    cc.require(isinstance(rl[field], bool), f"rl.{field}", rl[field], "must be True or False")
  rounds = rl.dynamic_sampling_max_rounds
  cc.require(isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 0,
             "rl.dynamic_sampling_max_rounds", rounds, "must be an integer >= 0 (extra sampling rounds a step "
             "may draw to refill the batch)")
  if rl.skip_zero_signal:
    for field in ("kl_coef", "entropy_coef"):
      cc.require(not rl[field], f"rl.{field}", rl[field],
                 "with rl.skip_zero_signal=True: this term has a gradient on every batch, so no step would ever "
                 "be skipped; use 0 or rl.skip_zero_signal=False")


class RLTrainer:
  """Holds what is fixed during RL (graph, optimizer, tokenizer, rewards, config); state is passed in."""

  def __init__(self, graphdef, optimizer: optax.GradientTransformation, tokenizer, rewards: Sequence[WeightedReward],
               cfg, ref_params: Any = None, prompt_len: int | None = None):
    self.graphdef = graphdef
    self.optimizer = optimizer
    self.tokenizer = tokenizer
    self.rewards = list(rewards)
    self.cfg = cfg
    self.prompt_len = prompt_len
    self.loss = policy_loss_from_config(cfg)
    advantages_lib.ADVANTAGE_ESTIMATORS.validate(cfg.advantage_estimator)
    if cfg.kl_coef and ref_params is None:
      raise ValueError("rl.kl_coef > 0 needs a frozen reference model (ref_params)")
    self.ref_params = ref_params if cfg.kl_coef else None
    self.zero_signal_skips = 0  # Steps whose update was skipped (rl.skip_zero_signal).

  @property
  def signal_without_variance(self) -> bool:
    """Whether the loss has a gradient when every advantage is 0 (a KL or entropy term)."""
    return bool(self.cfg.kl_coef or self.cfg.entropy_coef)

  def rollout(self, state: TrainState, examples: Sequence[Mapping[str, Any]],
              refill: Callable[[], Sequence[Mapping[str, Any]]] | None = None) -> Rollout:
    """:func:`~lemon_rl.training.rollout.collect_rollout` (with ``rl.dynamic_sampling``
    :func:`~lemon_rl.training.rollout.collect_dynamic_rollout`, refilling from ``refill()``), plus old /
    reference log-probs where needed."""
    cfg = self.cfg
    key = state_lib.step_key(state, 0)
    if cfg.get("dynamic_sampling", False):
      if refill is None:
        raise ValueError("rl.dynamic_sampling=True needs a refill source: pass refill (the phase's data "
                         "iterator) to RLTrainer.step")
      rollout = rollout_lib.collect_dynamic_rollout(
          self.graphdef, state.params, self.tokenizer, examples, self.rewards, cfg, key, refill,
          max_rounds=cfg.dynamic_sampling_max_rounds, prompt_len=self.prompt_len)
    else:
      rollout = rollout_lib.collect_rollout(self.graphdef, state.params, self.tokenizer, examples, self.rewards,
                                            cfg, key, prompt_len=self.prompt_len)
    batch = rollout.batch
    t0 = time.perf_counter()
    ids, attn = distributed.to_global((batch["ids"], batch["attention_mask"]))
    rows = ids.shape[0]  # Of the global batch.
    sampling = self.loss.sampling
    if cfg.num_iterations > 1 or (cfg.minibatch_size or rows) < rows:  # Off-policy after the first update.
      batch["old_logp"] = distributed.to_local(rollout_lib.sequence_token_log_probs(
          self.graphdef, state.params, ids, attn, sampling))
    if self.ref_params is not None:
      batch["ref_logp"] = distributed.to_local(rollout_lib.sequence_token_log_probs(
          self.graphdef, self.ref_params, ids, attn, sampling))
    if not self.loss.tis_cap:
      del batch["sampler_logp"]
    rollout.metrics["time/logprob_s"] = time.perf_counter() - t0
    return rollout

  def update(self, state: TrainState, rollout: Rollout) -> tuple[TrainState, dict[str, float]]:
    """``num_iterations`` passes over shuffled minibatches of the rollout (of its global batch)."""
    cfg = self.cfg
    batch = distributed.to_global(rollout.batch)
    n = batch["ids"].shape[0]
    mb = cfg.minibatch_size or n
    if n % mb or mb % cfg.microbatch_size:
      raise ValueError(f"rollout of {n} rows, rl.minibatch_size={mb} and rl.microbatch_size="
                       f"{cfg.microbatch_size} must divide evenly")
    rng = np.random.default_rng(int(jax.random.randint(state_lib.step_key(state, 1), (), 0, 2**31 - 1)))
    collected: list[dict[str, Any]] = []
    for _ in range(cfg.num_iterations):
      order = rng.permutation(n) if mb < n else np.arange(n)
      for start in range(0, n, mb):
        minibatch = batch if mb == n else distributed.take_rows(batch, order[start:start + mb])
        state, values = state_lib.update_step(
            self.graphdef, state, minibatch, loss_fn=self.loss, optimizer=self.optimizer,
            num_microbatches=mb // cfg.microbatch_size)
        collected.append(values)
    return state, rollout_lib.reduce_update_metrics(collected)

  def step(self, state: TrainState, examples: Sequence[Mapping[str, Any]],
           refill: Callable[[], Sequence[Mapping[str, Any]]] | None = None):
    """One RL step (rollout + updates); ``state.step`` advances by the number of optimizer updates (by 1 for
    a step skipped for lack of signal). ``refill()`` draws more examples (``rl.dynamic_sampling``)."""
    return rollout_lib.rollout_and_update(self, state, examples, lambda r: float(r.batch["loss_mask"].sum()),
                                          refill)
