"""The one rollout path of every RL trainer: prompts -> ``G`` sampled completions -> rewards -> advantages.

:func:`collect_rollout` samples ``G`` completions per prompt with the jitted sampler, decodes them once
(token-in, token-out: the training sequences are the sampled ids, never re-tokenised), scores them with the
reward functions, computes group advantages (integer group ids) and lays everything out on the ``[P | L]``
sequence layout of :mod:`lemon_rl.training.batches`. Trainers add what their loss needs (old / reference
log-probs, FEST's expert pairs) to the :class:`Rollout` it returns, then update through
:func:`rollout_and_update`.

The policy the learner scores is the distribution the sampler sampled from (:class:`SamplingSettings`):
temperature, then top-k, then top-p, as :mod:`lemon_rl.sampling.distribution` defines it once for both.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lemon_rl import ops
from lemon_rl.losses import advantages as advantages_lib
from lemon_rl.rewards.combine import WeightedReward, compute_rewards
from lemon_rl.sampling import generate, sampling_log_probs
from lemon_rl.text.decoding import decode_completion, encode_prompt
from lemon_rl.training.batches import build_sequences, completion_to_targets

# Fields of an example that are not reward-function keyword arguments.
PROMPT_KEY = "prompt"


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """The sampling distribution of the rollouts, which the learner's log-probs must follow.

  ``temperature == 0`` is greedy decoding; its tokens are then scored at temperature 1 without filtering
  (as the sampler reports them). Otherwise a token's log-prob is taken under ``softmax(filter(z / T))``
  with the top-k / top-p filter of :func:`lemon_rl.sampling.filter_logits` (hashable: a static argument
  of the jitted functions).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @classmethod
  def from_config(cls, cfg) -> "SamplingSettings":
    """From an ``rl`` config section (``temperature``, ``top_k``, ``top_p``)."""
    return cls(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))

  @property
  def filters(self) -> bool:
    """Whether top-k or top-p truncates the sampling distribution (it has no density outside its kept set)."""
    return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)

  def token_log_probs(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``[B, T, V]`` logits, ``[B, T]`` targets -> ``[B, T]`` float32 log-probs under this distribution."""
    return sampling_log_probs(logits, targets, self.temperature, self.top_k, self.top_p)

  def sample(self, model, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, rng: jax.Array, tokenizer):
    """:func:`lemon_rl.sampling.generate` under these settings, stopping on every EOS of ``tokenizer``."""
    return generate(model, prompt_ids, max_new_tokens, rng, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)


MODEL_DISTRIBUTION = SamplingSettings()  # The model's own distribution: temperature 1, no filter.


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def sequence_token_log_probs(graphdef, params, ids: jax.Array, attention_mask: jax.Array,
                             sampling: SamplingSettings = MODEL_DISTRIBUTION) -> jax.Array:
  """``[B, T-1]`` log-prob of each next token ``ids[:, 1:]`` under ``sampling`` applied to the model."""
  model = nnx.merge(graphdef, params)
  return sampling.token_log_probs(model(ids, attention_mask)[:, :-1], ids[:, 1:])


@dataclasses.dataclass
class Rollout:
  """Sampled, scored completions of a batch of prompts (numpy; ``N = prompts * G`` rows, prompt-major).

  Attributes:
    prompt_ids: ``N`` prompt token-id lists (each prompt ``G`` times).
    batch: ``ids``, ``attention_mask`` ``[N, T]``; ``loss_mask``, ``sampler_logp`` ``[N, T-1]``;
      ``advantages [N]`` (trainers add ``old_logp``, ``ref_logp``, ... or rearrange it).
    rewards: ``[N]`` total rewards.
    advantages: ``[N]`` float32, the configured estimator's.
    group_ids: ``[N]`` int32, row ``i`` belongs to prompt ``i // G``.
    completions: ``N`` decoded completions (what the rewards saw).
    metrics: reward, advantage, length and timing scalars.
  """

  prompt_ids: list[list[int]]
  batch: dict[str, Any]
  rewards: np.ndarray
  advantages: np.ndarray
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


def collect_rollout(graphdef, params, tokenizer, examples: Sequence[Mapping[str, Any]],
                    rewards: Sequence[WeightedReward], cfg, rng: jax.Array, *, prompt_len: int | None = None,
                    exclude_fields: Sequence[str] = ()) -> Rollout:
  """Samples ``cfg.num_generations`` completions per example and scores them.

  Args:
    graphdef, params: the policy (``nnx.split``).
    tokenizer: encodes prompts (:func:`lemon_rl.text.encode_prompt`) and decodes completions.
    examples: ``P`` dicts with a ``prompt`` and the reward functions' keyword fields.
    rewards: the weighted reward functions.
    cfg: the ``rl`` config section (``num_generations``, ``max_new_tokens``, ``temperature``, ``top_k``,
      ``top_p``, ``advantage_estimator``).
    rng: the sampling key.
    prompt_len: prompt slots ``P`` of the training sequences (``None``: the sampler's power-of-two bucket).
    exclude_fields: example fields that are not reward arguments (besides ``prompt``).
  """
  g = cfg.num_generations
  prompt_texts = [ex[PROMPT_KEY] for ex in examples for _ in range(g)]
  encoded = [encode_prompt(tokenizer, ex[PROMPT_KEY]) for ex in examples]
  prompt_ids = [ids for ids in encoded for _ in range(g)]
  t0 = time.perf_counter()
  out = SamplingSettings.from_config(cfg).sample(nnx.merge(graphdef, params), prompt_ids, cfg.max_new_tokens,
                                                  rng, tokenizer)
  sample_time = time.perf_counter() - t0
  completion_ids = [out.tokens[i, :out.lengths[i]].tolist() for i in range(len(prompt_ids))]
  completions = [decode_completion(tokenizer, ids) for ids in completion_ids]
  skip = {PROMPT_KEY, *exclude_fields}
  fields = {k: [ex[k] for ex in examples for _ in range(g)] for k in examples[0] if k not in skip}
  total, metrics, _ = compute_rewards(rewards, prompt_texts, completions, completion_ids, fields)
  group_ids = np.repeat(np.arange(len(examples)), g).astype(np.int32)
  estimator = advantages_lib.ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
  advantages = np.asarray(estimator(jnp.asarray(total), jnp.asarray(group_ids), len(examples)), np.float32)

  batch = build_sequences(prompt_ids, out.tokens, out.mask, tokenizer.pad_id, prompt_len)
  p = batch["ids"].shape[1] - cfg.max_new_tokens
  batch["sampler_logp"] = completion_to_targets(out.log_probs, p).astype(np.float32)
  batch["advantages"] = advantages
  lengths = out.lengths.astype(np.float32)
  metrics.update(group_statistics(total, group_ids))
  metrics.update(advantage_variance(total, advantages, group_ids))
  metrics.update({
      "advantage/mean": float(advantages.mean()), "advantage/std": float(advantages.std()),
      "advantage/min": float(advantages.min()), "advantage/max": float(advantages.max()),
      "completion_length/mean": float(lengths.mean()), "completion_length/max": float(lengths.max()),
      "finished_with_eos": float(np.mean([r == "eos" for r in out.finish_reasons])),
      "time/sample_s": sample_time, "sample_tokens_per_s": float(lengths.sum() / max(sample_time, 1e-9)),
  })
  return Rollout(prompt_ids, batch, total, advantages, group_ids, completions, metrics)


def reduce_update_metrics(per_update: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Per-update scalars -> one ``train/<name>`` each: the mean, or the min / max for ``*_min`` / ``*_max``."""
  stacked = jax.device_get(list(per_update))
  metrics = {}
  for k in stacked[0]:
    reduce = np.min if k.endswith("_min") else np.max if k.endswith("_max") else np.mean
    metrics[f"train/{k}"] = float(reduce([c[k] for c in stacked]))
  return metrics


def rollout_and_update(trainer, state, examples: Sequence[Mapping[str, Any]],
                       trained_tokens: Callable[[Rollout], float]):
  """The body of every RL trainer's ``step``: ``trainer.rollout`` then ``trainer.update``, with timings.

  ``trained_tokens(rollout)`` counts the tokens the loss covers (for ``tokens_per_s``). Returns
  ``(state, metrics, rollout)``.
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


def entropy_of(logits: jax.Array, sampling: SamplingSettings) -> jax.Array:
  """``[B, T, V] -> [B, T]`` entropy of the tempered (unfiltered) distribution: the entropy bonus."""
  return ops.entropy_from_logits(logits, sampling.temperature if sampling.temperature > 0 else 1.0)
