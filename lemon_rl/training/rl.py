"""The single-turn GRPO-family trainer.

One step: sample ``G`` completions per prompt with the jitted sampler -> rewards -> advantages (integer
group ids) -> ``num_iterations`` passes of minibatch updates, each with exact gradient accumulation over
micro-batches, under the clipped surrogate of :mod:`lemon_rl.losses.policy_gradient` (optionally a KL to a
frozen reference, an entropy bonus and truncated importance sampling against the sampler's log-probs).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lemon_rl import ops
from lemon_rl.losses import advantages as advantages_lib
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.rewards.combine import WeightedReward, compute_rewards
from lemon_rl.sampling import generate
from lemon_rl.text.decoding import decode_completion
from lemon_rl.training import state as state_lib
from lemon_rl.training.batches import build_sequences, completion_to_targets
from lemon_rl.training.state import TrainState


@dataclasses.dataclass(frozen=True)
class SurrogateSettings:
  """The clipped-surrogate fields the RL losses share (:class:`PolicyLoss`, FEST's ``FestLoss``)."""

  policy_loss: str = "ppo_clip"
  eps_low: float = 0.2
  eps_high: float | None = None
  dual_clip: float | None = None
  aggregation: str = "token_mean"
  max_len: int | None = None

  def surrogate_kwargs(self) -> dict[str, Any]:
    """Keyword arguments of :func:`pg.grpo_loss` (GSPO's sequence ratio takes no dual-clip)."""
    kwargs = {"policy_loss": self.policy_loss, "eps_low": self.eps_low, "eps_high": self.eps_high,
              "aggregation": self.aggregation, "max_len": self.max_len}
    if self.policy_loss != "gspo":
      kwargs["dual_clip"] = self.dual_clip
    return kwargs


def surrogate_fields_from_config(cfg) -> dict[str, Any]:
  """The :class:`SurrogateSettings` fields of an ``rl`` config section (names checked against the registries)."""
  pg.POLICY_LOSSES.validate(cfg.policy_loss)
  pg.AGGREGATIONS.validate(cfg.aggregation)
  return {"policy_loss": cfg.policy_loss, "eps_low": cfg.eps_low, "eps_high": cfg.get("eps_high"),
          "dual_clip": cfg.get("dual_clip"), "aggregation": cfg.aggregation,
          "max_len": cfg.get("max_len") or cfg.max_new_tokens}


@dataclasses.dataclass(frozen=True)
class PolicyLoss(SurrogateSettings):
  """The policy-gradient loss of one micro-batch (hashable: a static argument of the jitted update).

  ``batch`` holds ``ids [N, T]``, ``attention_mask [N, T]``, ``loss_mask [N, T-1]``, ``advantages [N]``,
  and optionally ``old_logp``, ``ref_logp`` and ``sampler_logp`` (``[N, T-1]``); without ``old_logp`` the
  update is on-policy (the current log-probs, without gradient, stand in for them).
  """

  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  tis_cap: float | None = None

  def __call__(self, model: nnx.Module, batch: Mapping[str, jax.Array]):
    logits = model(batch["ids"], batch["attention_mask"])[:, :-1]
    logp = ops.token_log_probs(logits, batch["ids"][:, 1:])
    entropy = ops.entropy_from_logits(logits)
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
                    entropy_coef=cfg.entropy_coef, tis_cap=cfg.get("tis_cap") if cfg.get("use_tis") else None)


@dataclasses.dataclass
class Rollout:
  """A sampled batch ready for updates (numpy arrays, ``N = prompts * G`` rows)."""

  batch: dict[str, np.ndarray]
  rewards: np.ndarray
  group_ids: np.ndarray
  completions: list[str]
  metrics: dict[str, float]


def group_statistics(rewards: np.ndarray, group_ids: np.ndarray) -> dict[str, float]:
  """Fraction of groups whose rewards are all equal (no learning signal under GRPO)."""
  groups = [rewards[group_ids == g] for g in np.unique(group_ids)]
  return {"frac_all_equal_groups": float(np.mean([np.ptp(g) == 0 for g in groups]))}


def advantage_variance(rewards: np.ndarray, advantages: np.ndarray, group_ids: np.ndarray) -> dict[str, float]:
  """Advantage-variance diagnostics of one rollout batch (CAST's stability plot).

  *Decision* (the paper does not define its "normalised advantage variance"):
  ``advantage/normalized_variance = Var_i(A_i)``, the batch variance of the advantages the loss uses (the
  configured estimator's, e.g. GRPO's std-normalised ones). Also logged:
  ``advantage/within_group_share = sum_i (r_i - mean_g r)^2 / sum_i (r_i - mean r)^2``, the share of the
  reward variance that lies within groups (what group baselines can learn from; 0 if all rewards are equal).

  Args:
    rewards: ``r`` ``[N]``.
    advantages: ``A`` ``[N]``.
    group_ids: ``[N]`` integer group of each row.
  """
  r = np.asarray(rewards, np.float64)
  _, inverse, counts = np.unique(np.asarray(group_ids), return_inverse=True, return_counts=True)
  group_mean = np.bincount(inverse, weights=r) / counts
  within = float(np.sum((r - group_mean[inverse]) ** 2))
  total = float(np.sum((r - r.mean()) ** 2))
  return {"advantage/normalized_variance": float(np.var(np.asarray(advantages, np.float64))),
          "advantage/within_group_share": within / total if total > 0 else 0.0}


def reduce_update_metrics(per_update: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Per-update scalars -> one ``train/<name>`` each: the mean, or the min / max for ``*_min`` / ``*_max``."""
  stacked = jax.device_get(list(per_update))
  metrics = {}
  for k in stacked[0]:
    reduce = np.min if k.endswith("_min") else np.max if k.endswith("_max") else np.mean
    metrics[f"train/{k}"] = float(reduce([c[k] for c in stacked]))
  return metrics


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

  # -- sampling and scoring ---------------------------------------------------------------------------

  def rollout(self, state: TrainState, examples: Sequence[Mapping[str, Any]]) -> Rollout:
    cfg, tok = self.cfg, self.tokenizer
    g = cfg.num_generations
    prompt_texts = [ex["prompt"] for ex in examples for _ in range(g)]
    prompt_ids = [tok.encode(p, add_bos=True) for p in prompt_texts]
    model = nnx.merge(self.graphdef, state.params)
    t0 = time.perf_counter()
    out = generate(model, prompt_ids, cfg.max_new_tokens, state_lib.step_key(state, 0),
                   temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, eos_id=tok.eos_id,
                   pad_id=tok.pad_id)
    sample_time = time.perf_counter() - t0
    completion_ids = [out.tokens[i, :out.lengths[i]].tolist() for i in range(len(prompt_ids))]
    completions = [decode_completion(tok, ids) for ids in completion_ids]
    fields = {k: [ex[k] for ex in examples for _ in range(g)] for k in examples[0] if k != "prompt"}
    rewards, metrics, _ = compute_rewards(self.rewards, prompt_texts, completions, completion_ids, fields)
    group_ids = np.repeat(np.arange(len(examples)), g).astype(np.int32)
    estimator = advantages_lib.ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
    advantages = np.asarray(estimator(jnp.asarray(rewards), jnp.asarray(group_ids), len(examples)),
                            np.float32)

    batch = build_sequences(prompt_ids, out.tokens, out.mask, tok.pad_id, self.prompt_len)
    prompt_len = batch["ids"].shape[1] - cfg.max_new_tokens
    batch["advantages"] = advantages
    batch["sampler_logp"] = completion_to_targets(out.log_probs, prompt_len).astype(np.float32)
    t1 = time.perf_counter()
    ids, attn = jnp.asarray(batch["ids"]), jnp.asarray(batch["attention_mask"])
    rows = batch["ids"].shape[0]
    if cfg.num_iterations > 1 or (cfg.minibatch_size or rows) < rows:  # Off-policy after the first update.
      batch["old_logp"] = np.asarray(state_lib.sequence_token_log_probs(self.graphdef, state.params, ids, attn))
    if self.ref_params is not None:
      batch["ref_logp"] = np.asarray(state_lib.sequence_token_log_probs(self.graphdef, self.ref_params, ids,
                                                                       attn))
    if not self.loss.tis_cap:
      del batch["sampler_logp"]
    lengths = out.lengths.astype(np.float32)
    metrics.update(group_statistics(rewards, group_ids))
    metrics.update({
        "advantage/mean": float(advantages.mean()), "advantage/std": float(advantages.std()),
        "advantage/min": float(advantages.min()), "advantage/max": float(advantages.max()),
        "completion_length/mean": float(lengths.mean()), "completion_length/max": float(lengths.max()),
        "finished_with_eos": float(np.mean([r == "eos" for r in out.finish_reasons])),
        "time/sample_s": sample_time, "time/logprob_s": time.perf_counter() - t1,
        "sample_tokens_per_s": float(lengths.sum() / max(sample_time, 1e-9)),
    })
    return Rollout(batch, rewards, group_ids, completions, metrics)

  # -- updates ----------------------------------------------------------------------------------------

  def update(self, state: TrainState, rollout: Rollout) -> tuple[TrainState, dict[str, float]]:
    """``num_iterations`` passes over shuffled minibatches of the rollout."""
    cfg = self.cfg
    n = rollout.batch["ids"].shape[0]
    mb = cfg.minibatch_size or n
    if n % mb or mb % cfg.microbatch_size:
      raise ValueError(f"rollout of {n} rows, rl.minibatch_size={mb} and rl.microbatch_size="
                       f"{cfg.microbatch_size} must divide evenly")
    rng = np.random.default_rng(int(jax.random.randint(state_lib.step_key(state, 1), (), 0, 2**31 - 1)))
    collected: list[dict[str, Any]] = []
    for _ in range(cfg.num_iterations):
      order = rng.permutation(n) if mb < n else np.arange(n)
      for start in range(0, n, mb):
        idx = order[start:start + mb]
        minibatch = {k: jnp.asarray(v[idx]) for k, v in rollout.batch.items()}
        state, values = state_lib.update_step(
            self.graphdef, state, minibatch, loss_fn=self.loss, optimizer=self.optimizer,
            num_microbatches=mb // cfg.microbatch_size)
        collected.append(values)
    return state, reduce_update_metrics(collected)

  def step(self, state: TrainState, examples: Sequence[Mapping[str, Any]]):
    """One RL step (rollout + updates); ``state.step`` advances by the number of optimizer updates."""
    return rollout_and_update(self, state, examples, lambda r: float(r.batch["loss_mask"].sum()))


def rollout_and_update(trainer, state: TrainState, examples: Sequence[Mapping[str, Any]],
                       trained_tokens) -> tuple[TrainState, dict[str, float], Any]:
  """The body of a trainer's ``step``: ``trainer.rollout`` then ``trainer.update``, with timings.

  ``trained_tokens(rollout)`` counts the tokens the loss covers (for ``tokens_per_s``).
  """
  t0 = time.perf_counter()
  rollout = trainer.rollout(state, examples)
  t1 = time.perf_counter()
  state, update_metrics = trainer.update(state, rollout)
  jax.block_until_ready(state.params)
  t2 = time.perf_counter()
  metrics = dict(rollout.metrics, **update_metrics)
  metrics.update({"time/update_s": t2 - t1, "time/step_s": t2 - t0,
                  "tokens_per_s": trained_tokens(rollout) / max(t2 - t0, 1e-9)})
  return state, metrics, rollout
