"""The one rollout path of every RL trainer: prompts -> ``G`` sampled completions -> rewards -> advantages.

:func:`collect_rollout` samples ``G`` completions per prompt with the jitted sampler, decodes them once
(token-in, token-out: the training sequences are the sampled ids, never re-tokenised), scores them with the
reward functions, computes group advantages (integer group ids) and lays everything out on the ``[P | L]``
sequence layout of :mod:`lemon_rl.training.batches`. Trainers add what their loss needs (old / reference
log-probs, FEST's expert pairs) to the :class:`Rollout` it returns, then update through
:func:`rollout_and_update`.

Two options spend no update on groups without signal: :func:`collect_dynamic_rollout` (``rl.dynamic_sampling``,
DAPO) drops the groups whose rewards are all equal and refills the batch from the data iterator, and
:func:`rollout_and_update` skips the optimizer step of a batch whose loss has no signal at all
(``rl.skip_zero_signal``, :func:`zero_signal`).

The policy the learner scores is the distribution the sampler sampled from (:class:`SamplingSettings`):
temperature, then top-k, then top-p, as :mod:`lemon_rl.sampling.distribution` defines it once for both.

Several processes (:mod:`lemon_rl.training.distributed`): each process samples its own prompts (every group
in one process), decodes and rewards its own completions; the rewards are then gathered, so advantages
(batch-normalised ones included) and every logged reward, length and advantage statistic are those of the
global batch, and each process keeps its own rows. With one process nothing is gathered.
"""

from __future__ import annotations

import contextlib
import contextvars
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
from lemon_rl.training import distributed
from lemon_rl.training import speculative_rollouts
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

  ``coupled`` changes the random numbers, not the distribution: token ``i`` of rollout row ``b`` is drawn
  with Gumbel noise of ``(key, b, i)`` (``generate(..., coupled=True)``), so a speculative rollout of the
  same key emits the same tokens as a plain one (``speculative_generate(..., coupled=True)``) and two arms
  of an experiment that differ only in how they sample are compared sample by sample.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  coupled: bool = False

  @classmethod
  def from_config(cls, cfg) -> "SamplingSettings":
    """From an ``rl`` config section (``temperature``, ``top_k``, ``top_p``, ``coupled_noise``)."""
    return cls(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p), bool(cfg.coupled_noise))

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
                    top_p=self.top_p, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, coupled=self.coupled)


MODEL_DISTRIBUTION = SamplingSettings()  # The model's own distribution: temperature 1, no filter.

# The shared rollout's sampler: None = SamplingSettings.sample; else called as sampler(model, prompt_ids,
# max_new_tokens, rng, tokenizer, sampling) -> SampleOutput (rl.speculative installs one for a step,
# lemon_rl.training.speculative_rollouts).
_SAMPLER: contextvars.ContextVar = contextvars.ContextVar("rollout_sampler", default=None)


@contextlib.contextmanager
def rollout_sampler(sampler):
  """Within the block, the shared rollout samples with ``sampler`` (``None``: plain sampling)."""
  token = _SAMPLER.set(sampler)
  try:
    yield
  finally:
    _SAMPLER.reset(token)


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

  A short dynamic-sampling batch (:func:`collect_dynamic_rollout`) ends with padding groups: their rows keep
  their (all-equal) rewards but have an all-zero ``loss_mask`` and advantage 0.
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


@dataclasses.dataclass
class _Samples:
  """One sampling round before the sequence layout: ``N = groups * G`` rows, prompt-major (numpy)."""

  prompt_ids: list[list[int]]
  tokens: np.ndarray  # [N, L] completion ids.
  mask: np.ndarray  # [N, L] 1 on generated tokens.
  log_probs: np.ndarray  # [N, L] the sampler's log-probs.
  lengths: np.ndarray  # [N]
  finish_reasons: list[str]
  completions: list[str]
  rewards: np.ndarray  # [N] total rewards.
  reward_metrics: dict[str, float]
  sample_time: float

  def rows(self, rows: np.ndarray) -> "_Samples":
    """The rows ``rows`` (an integer index array), in that order."""
    rows = np.asarray(rows, np.int64)
    return _Samples([self.prompt_ids[i] for i in rows], self.tokens[rows], self.mask[rows],
                    self.log_probs[rows], self.lengths[rows], [self.finish_reasons[i] for i in rows],
                    [self.completions[i] for i in rows], self.rewards[rows], self.reward_metrics, self.sample_time)

  @staticmethod
  def concatenate(parts: Sequence["_Samples"]) -> "_Samples":
    """The rows of ``parts`` one after the other (the first part's reward metrics, the summed time)."""
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])
    return _Samples([x for p in parts for x in p.prompt_ids], cat("tokens"), cat("mask"), cat("log_probs"),
                    cat("lengths"), [x for p in parts for x in p.finish_reasons],
                    [x for p in parts for x in p.completions], cat("rewards"), parts[0].reward_metrics,
                    sum(p.sample_time for p in parts))


def _sample(graphdef, params, tokenizer, examples: Sequence[Mapping[str, Any]], rewards: Sequence[WeightedReward],
            cfg, rng: jax.Array, exclude_fields: Sequence[str]) -> _Samples:
  """``G`` completions per example, decoded and scored."""
  g = cfg.num_generations
  prompt_texts = [ex[PROMPT_KEY] for ex in examples for _ in range(g)]
  encoded = [encode_prompt(tokenizer, ex[PROMPT_KEY]) for ex in examples]
  prompt_ids = [ids for ids in encoded for _ in range(g)]
  t0 = time.perf_counter()
  sampling, sampler, model = SamplingSettings.from_config(cfg), _SAMPLER.get(), nnx.merge(graphdef, params)
  out = (sampling.sample(model, prompt_ids, cfg.max_new_tokens, rng, tokenizer) if sampler is None
         else sampler(model, prompt_ids, cfg.max_new_tokens, rng, tokenizer, sampling))
  sample_time = time.perf_counter() - t0
  completion_ids = [out.tokens[i, :out.lengths[i]].tolist() for i in range(len(prompt_ids))]
  completions = [decode_completion(tokenizer, ids) for ids in completion_ids]
  skip = {PROMPT_KEY, *exclude_fields}
  fields = {k: [ex[k] for ex in examples for _ in range(g)] for k in examples[0] if k not in skip}
  total, reward_metrics, per_fn = compute_rewards(rewards, prompt_texts, completions, completion_ids, fields)
  reward_metrics = _global_reward_metrics(reward_metrics, total, per_fn)
  return _Samples(prompt_ids, np.asarray(out.tokens), np.asarray(out.mask), np.asarray(out.log_probs),
                  np.asarray(out.lengths), list(out.finish_reasons), completions, total, reward_metrics,
                  sample_time)


def _global_reward_metrics(metrics: dict[str, float], total: np.ndarray, per_fn: Mapping[str, np.ndarray]
                           ) -> dict[str, float]:
  """:func:`compute_rewards`' metrics over every process's rows (the identity with one process): the mean and
  std of the total and of each function from the gathered rewards, error counts summed, the functions' other
  metrics averaged over the processes' equal shards."""
  if distributed.process_count() == 1:
    return metrics
  out = distributed.mean_over_processes(metrics, sums=[k for k in metrics if k.endswith("errors")])
  for name, values in [("total", total), *per_fn.items()]:
    everyone = distributed.gather_rows(np.asarray(values, np.float32))
    out[f"reward/{name}/mean"], out[f"reward/{name}/std"] = float(everyone.mean()), float(everyone.std())
  return out


def _sample_metrics(samples: _Samples, g: int) -> dict[str, float]:
  """Reward, group, length and timing scalars of sampled rows (of every process's rows)."""
  lengths = distributed.gather_rows(samples.lengths.astype(np.float32))
  metrics = dict(samples.reward_metrics)
  metrics.update(group_statistics(distributed.gather_rows(samples.rewards),
                                  np.repeat(np.arange(len(lengths) // g), g)))
  eos = distributed.gather_rows(np.asarray([r == "eos" for r in samples.finish_reasons]))
  metrics.update({
      "completion_length/mean": float(lengths.mean()), "completion_length/max": float(lengths.max()),
      "finished_with_eos": float(np.mean(eos)),
      "time/sample_s": samples.sample_time,
      "sample_tokens_per_s": float(lengths.sum() / max(samples.sample_time, 1e-9)),
  })
  return metrics


def _assemble(samples: _Samples, cfg, tokenizer, prompt_len: int | None, metrics: dict[str, float],
              real: np.ndarray | None = None) -> Rollout:
  """Advantages and the ``[P | L]`` sequence layout of ``samples``; ``real [N]`` marks rows that are not
  padding (padding rows get no loss-mask token and advantage 0, and no advantage statistic counts them)."""
  g = cfg.num_generations
  group_ids = np.repeat(np.arange(len(samples.prompt_ids) // g), g).astype(np.int32)
  mask = samples.mask if real is None else samples.mask * real[:, None]
  # Advantages of the global batch (every process's rewards, in process order), then this process's rows.
  all_rewards = distributed.gather_rows(samples.rewards)
  all_real = None if real is None else distributed.gather_rows(real)
  num_groups = len(all_rewards) // g
  all_group_ids = np.repeat(np.arange(num_groups), g).astype(np.int32)
  estimator = advantages_lib.ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
  valid = {} if real is None else {"valid": jnp.asarray(all_real)}
  all_advantages = np.asarray(estimator(jnp.asarray(all_rewards), jnp.asarray(all_group_ids), num_groups, **valid),
                              np.float32)
  advantages = distributed.local_block(all_advantages)
  batch = build_sequences(samples.prompt_ids, samples.tokens, mask, tokenizer.pad_id, prompt_len)
  p = batch["ids"].shape[1] - cfg.max_new_tokens
  batch["sampler_logp"] = completion_to_targets(samples.log_probs * mask, p).astype(np.float32)
  batch["advantages"] = advantages
  rows = all_real.astype(bool) if real is not None and all_real.any() else slice(None)  # All padding: zeros.
  a = all_advantages[rows]
  metrics = dict(metrics)
  metrics.update(advantage_variance(all_rewards[rows], a, all_group_ids[rows]))
  metrics.update({"advantage/mean": float(a.mean()), "advantage/std": float(a.std()),
                  "advantage/min": float(a.min()), "advantage/max": float(a.max())})
  return Rollout(samples.prompt_ids, batch, samples.rewards, advantages, group_ids, samples.completions, metrics)


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
  samples = _sample(graphdef, params, tokenizer, examples, rewards, cfg, rng, exclude_fields)
  return _assemble(samples, cfg, tokenizer, prompt_len, _sample_metrics(samples, cfg.num_generations))


def group_has_variance(rewards: np.ndarray, g: int) -> np.ndarray:
  """``[N]`` rewards of ``N / g`` consecutive groups -> ``[N / g]`` bool, whether a group's rewards differ."""
  return np.ptp(np.asarray(rewards).reshape(-1, g), axis=1) > 0


def collect_dynamic_rollout(graphdef, params, tokenizer, examples: Sequence[Mapping[str, Any]],
                            rewards: Sequence[WeightedReward], cfg, rng: jax.Array,
                            refill: Callable[[], Sequence[Mapping[str, Any]]], *, max_rounds: int,
                            prompt_len: int | None = None, exclude_fields: Sequence[str] = ()) -> Rollout:
  """DAPO's dynamic sampling: :func:`collect_rollout` of ``P = len(examples)`` groups that all carry signal.

  Round 0 samples ``examples`` (with ``rng``: nothing dropped gives :func:`collect_rollout`'s batch). A group
  whose rewards are all equal has zero advantage under every outcome estimator, so it is dropped; while fewer
  than ``P`` groups are kept and fewer than ``max_rounds`` extra rounds have run, ``refill()`` draws more
  examples (the phase's data iterator; a ``StopIteration`` ends the refill) and round ``k`` samples them with
  ``fold_in(rng, k)``. The batch is the first ``P`` kept groups in sampling order (surplus kept groups are
  discarded, as in DAPO). *Decision*: if fewer than ``P`` groups are kept, the batch is filled to ``P``
  groups (fixed shapes: no recompilation) with dropped groups whose rows are padding (no loss-mask token,
  advantage 0, excluded from the advantage estimator's statistics); every aggregation excludes all-padding
  rows from its denominator, so the loss is that of the kept groups alone ("train on what is there"; with
  several minibatches a step, one that draws only padding rows makes an update with zero gradient).

  Advantages are recomputed over the batch (batch-normalised estimators see the kept groups only). The
  sample metrics (``reward/*``, ``frac_all_equal_groups``, lengths) are round 0's: what a run without
  dynamic sampling logs for the same step; ``time/sample_s`` sums the rounds; ``advantage/*`` describe the
  batch's real rows; ``dynamic_sampling/*``:

  * ``dropped_group_frac``: share of the sampled groups (all rounds) that were dropped;
  * ``rounds``: sampling rounds run (1 = no refill); ``prompts_consumed``: prompts sampled (all rounds);
  * ``kept_groups``: groups with signal in the batch; ``padding_groups = P - kept_groups``;
    ``short``: 1 if the batch is short of ``P`` signal groups (``padding_groups > 0``);
  * ``surplus_groups``: kept groups sampled beyond ``P`` (discarded).

  Args:
    graphdef, params, tokenizer, examples, rewards, cfg, rng, prompt_len, exclude_fields: as
      :func:`collect_rollout`.
    refill: returns the next examples (a batch of the phase's iterator).
    max_rounds: the most extra sampling rounds (0: drop without refilling).
  """
  if distributed.process_count() > 1:
    raise NotImplementedError("dynamic sampling with several processes: its refill decisions are per process")
  g, target = cfg.num_generations, len(examples)
  rounds = [_sample(graphdef, params, tokenizer, examples, rewards, cfg, rng, exclude_fields)]
  kept = [np.flatnonzero(group_has_variance(rounds[0].rewards, g))]
  while sum(map(len, kept)) < target and len(rounds) <= max_rounds:
    try:
      more = list(refill())
    except StopIteration:
      break
    rounds.append(_sample(graphdef, params, tokenizer, more, rewards, cfg, jax.random.fold_in(rng, len(rounds)),
                          exclude_fields))
    kept.append(np.flatnonzero(group_has_variance(rounds[-1].rewards, g)))
  num_kept = sum(map(len, kept))
  sampled = sum(len(r.prompt_ids) for r in rounds) // g
  # Global group indices (round offset + group) of the kept groups, then of the dropped ones as padding.
  offsets = np.cumsum([0] + [len(r.prompt_ids) // g for r in rounds[:-1]])
  kept_groups = np.concatenate([o + k for o, k in zip(offsets, kept)])[:target]
  dropped = np.setdiff1d(np.arange(sampled), np.concatenate([o + k for o, k in zip(offsets, kept)]))
  padding = dropped[:target - len(kept_groups)]
  groups = np.concatenate([kept_groups, padding]).astype(np.int64)
  samples = _Samples.concatenate(rounds).rows((groups[:, None] * g + np.arange(g)).reshape(-1))
  real = np.repeat(np.arange(len(groups)) < len(kept_groups), g).astype(np.float32)
  metrics = _sample_metrics(rounds[0], g)
  total_time = sum(r.sample_time for r in rounds)
  metrics.update({
      "time/sample_s": total_time,
      "sample_tokens_per_s": float(sum(r.lengths.sum() for r in rounds) / max(total_time, 1e-9)),
      "dynamic_sampling/dropped_group_frac": 1.0 - num_kept / sampled,
      "dynamic_sampling/rounds": float(len(rounds)),
      "dynamic_sampling/prompts_consumed": float(sampled),
      "dynamic_sampling/kept_groups": float(len(kept_groups)),
      "dynamic_sampling/padding_groups": float(len(padding)),
      "dynamic_sampling/short": float(len(padding) > 0),
      "dynamic_sampling/surplus_groups": float(num_kept - len(kept_groups)),
  })
  return _assemble(samples, cfg, tokenizer, prompt_len, metrics, real=None if real.all() else real)


def reduce_update_metrics(per_update: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Per-update scalars -> one ``train/<name>`` each: the mean, or the min / max for ``*_min`` / ``*_max``."""
  stacked = jax.device_get(list(per_update))
  metrics = {}
  for k in stacked[0]:
    reduce = np.min if k.endswith("_min") else np.max if k.endswith("_max") else np.mean
    metrics[f"train/{k}"] = float(reduce([c[k] for c in stacked]))
  return metrics


def zero_signal(trainer, rollout: Rollout) -> bool:
  """Whether ``trainer``'s loss has no gradient on ``rollout``: every advantage is exactly 0 and the loss has
  no term that does not vanish with them (``trainer.signal_without_variance``: a KL or entropy term, FEST's
  expert term). The registered outcome estimators give exactly 0 to every row of a group whose rewards are
  all equal, so the advantages all vanish exactly when no group has reward variance."""
  return not trainer.signal_without_variance and not distributed.global_any(np.any(rollout.advantages))


def rollout_and_update(trainer, state, examples: Sequence[Mapping[str, Any]],
                       trained_tokens: Callable[[Rollout], float],
                       refill: Callable[[], Sequence[Mapping[str, Any]]] | None = None):
  """The body of every RL trainer's ``step``: ``trainer.rollout`` then ``trainer.update``, with timings.

  ``trainer`` has ``rollout(state, examples[, refill])`` and ``update(state, rollout)``; a trainer that
  supports the zero-signal skip also has ``signal_without_variance``, a ``zero_signal_skips`` counter and
  ``cfg`` (the ``rl`` section), and its rollouts have ``advantages`` (one without them, e.g. the multi-turn
  trainer, always updates and logs no ``rl/*`` metric). ``trained_tokens(rollout)`` counts the tokens the
  loss covers (for ``tokens_per_s``); ``refill`` draws more examples for dynamic sampling (passed on to
  ``trainer.rollout``). Returns ``(state, metrics, rollout)``.

  With ``rl.skip_zero_signal``, a step whose loss has no signal (:func:`zero_signal`) makes no optimizer
  update: params and optimizer state are returned unchanged (the same arrays), so the learning-rate
  schedule and Adam's moments do not advance; ``state.step`` advances by 1 so that the next step samples
  with a fresh key. Without it the update runs: its gradient is 0 but Adam's momentum, weight decay and the
  schedule still move. Logged every step: ``rl/zero_signal`` (0/1), ``rl/skipped_zero_signal`` (0/1) and
  ``rl/skipped_zero_signal_total`` (the running count of ``trainer.zero_signal_skips``, since the trainer was
  built: a resumed run counts from the resume).

  With ``rl.speculative.enabled`` (:mod:`lemon_rl.training.speculative_rollouts`) the rollout samples through
  the trainer's speculative sampler and, after the update, the drafter is refitted to the new policy and
  checked, unless the cost model made the step plain (its metrics join the step's; ``time/step_s`` includes
  the refit, ``time/drafter_refit_s``).
  """
  speculative = speculative_rollouts.for_trainer(trainer)
  t0 = time.perf_counter()
  with rollout_sampler(speculative):
    rollout = trainer.rollout(state, examples) if refill is None else trainer.rollout(state, examples, refill)
  t1 = time.perf_counter()
  aware = hasattr(trainer, "signal_without_variance")
  no_signal = aware and zero_signal(trainer, rollout)
  skip = no_signal and bool(trainer.cfg.get("skip_zero_signal", False))
  if skip:
    state, update_metrics = state.replace(step=state.step + 1), {}
    trainer.zero_signal_skips += 1
  else:
    state, update_metrics = trainer.update(state, rollout)
  jax.block_until_ready(state.params)
  t2 = time.perf_counter()
  metrics = dict(rollout.metrics, **update_metrics)
  t3 = t2
  if speculative is not None:
    metrics.update(speculative.refit(state.params, rollout))
    t3 = time.perf_counter()
    metrics["time/drafter_refit_s"] = t3 - t2
  metrics.update({"time/update_s": t2 - t1, "time/step_s": t3 - t0,
                  "tokens_per_s": (0.0 if skip else distributed.global_sum(trained_tokens(rollout))) /
                                  max(t3 - t0, 1e-9)})
  if aware:
    metrics.update({"rl/zero_signal": float(no_signal), "rl/skipped_zero_signal": float(skip),
                    "rl/skipped_zero_signal_total": float(trainer.zero_signal_skips)})
  return state, metrics, rollout


def entropy_of(logits: jax.Array, sampling: SamplingSettings) -> jax.Array:
  """``[B, T, V] -> [B, T]`` entropy of the tempered (unfiltered) distribution: the entropy bonus."""
  return ops.entropy_from_logits(logits, sampling.temperature if sampling.temperature > 0 else 1.0)
