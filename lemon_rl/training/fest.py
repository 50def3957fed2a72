"""The FEST trainer: RLVR guided by a few expert demonstrations (METHODS.md section 2).

Two data streams per step: ``B_I`` answer-only prompts of ``D_I`` and ``B_E`` prompts of ``D_E`` with expert
solutions ``y+``. One ``generate`` call samples ``G`` rollouts for every prompt of both streams; the verifier
scores them; then ``rl.num_iterations`` updates on the whole step batch (exact micro-batch accumulation through
:func:`lemon_rl.training.state.update_step`) of

* ``fest_dpo``:  ``L = c * L_E + L_I`` with ``L_E`` the semi-online DPO loss on the pairs ``(y+, y-_i)`` (every
  rollout of a ``D_E`` prompt against its ``y+``; adaptive beta per pair; ``pi_ref`` the frozen policy at the
  start of RL) and ``L_I`` GRPO on the ``D_I`` rollouts;
* ``fest_grpo``: ``L = c * L_SFT + L_GRPO`` with ``L_SFT = -mean_i sg[w_i] log pi(y+)``,
  ``w_i = beta_i sigmoid(beta_i (r-_i - r+_i))``, and ``L_GRPO`` one token-level clipped objective over the
  rollouts of BOTH streams.

Each loss term is a mean with its own denominator; those are computed from the masks before the update
(``denominators [M, 3]``: expert term, RL term, ``1 / M`` per micro-batch) so that the micro-batch pieces add up
to the whole-batch loss and gradient exactly.

Batch layout (``M`` micro-batches split every leaf along axis 0)::

  rl:      ids, attention_mask [R, T]; loss_mask, old_logp [R, T-1]; advantages [R]     (R = B_I * G)
  expert:  pos_ids, pos_attention_mask [E, T]; pos_loss_mask [E, T-1]; ref_logp_pos [E]
           neg_ids, neg_attention_mask [E, G, T]; neg_loss_mask, neg_old_logp [E, G, T-1];
           neg_advantages, ref_logp_neg, correct [E, G]                                 (E = B_E)
  denominators: [M, 3]
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
from lemon_rl.losses import fest as fest_losses
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.losses.surrogate import SurrogateSettings, surrogate_fields_from_config
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.training import state as state_lib
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training.batches import build_sequences, pad_completions
from lemon_rl.training.rollout import Rollout, SamplingSettings
from lemon_rl.training.state import TrainState
from lemon_rl.utils import config_checks as cc

FEST_ALGORITHMS = ("fest_dpo", "fest_grpo")
STREAM_RL = "rl"  # D_I: prompts with answers only.
STREAM_EXPERT = "expert"  # D_E: prompts with expert solutions y+.
# Fields the two-stream iterator adds to every example.
STREAM_KEY = "stream"
EXPERT_COMPLETION_KEY = "expert_completion"
WEIGHT_QUANTILES = (0.1, 0.5, 0.9)


@dataclasses.dataclass(frozen=True)
class FestLoss(SurrogateSettings):
  """The FEST loss of one micro-batch (hashable: a static argument of the jitted update).

  ``algorithm`` is ``"fest_dpo"`` or ``"fest_grpo"``; the GRPO part is the clipped surrogate of the inherited
  :class:`lemon_rl.training.rl.SurrogateSettings` (no KL, no entropy term: the paper's ``L_I``).

  *Decision*: the surrogate scores the rollouts under ``sampling`` (the distribution they were sampled
  from); the expert terms (DPO pairs, the weighted SFT of ``y+``) and their reference are likelihoods of the
  model itself, at temperature 1 without filtering (``y+`` may lie outside a top-p set).
  """

  algorithm: str = "fest_grpo"
  c: float = fest_losses.DEFAULT_C
  beta1: float = fest_losses.DEFAULT_BETA1
  beta2: float = fest_losses.DEFAULT_BETA2
  beta3: float = fest_losses.DEFAULT_BETA3
  sft_aggregation: str = "seq_mean_token_sum"
  fixed_weight: bool = False  # FEST-GRPO ablation: w held at beta / 2 (fest_losses.fest_grpo_sft_term).
  sampling: SamplingSettings = SamplingSettings()

  def __post_init__(self):
    super().__post_init__()  # Resolves the policy loss's default clip range and aggregation.
    if self.algorithm not in FEST_ALGORITHMS:
      raise ValueError(f"FestLoss.algorithm={self.algorithm!r}: must be one of {FEST_ALGORITHMS}")

  def _grpo(self, logp, old_logp, advantages, mask):
    return pg.grpo_loss(logp, old_logp, advantages, mask, **self.surrogate_kwargs())

  def terms(self, model: nnx.Module, batch: Mapping[str, Any]):
    """``(expert_term, rl_term, metrics)``: the two unreduced means and the additive metrics."""
    rl, ex = batch["rl"], batch["expert"]
    e, g, t = ex["neg_ids"].shape
    r = rl["ids"].shape[0]
    ids = jnp.concatenate([rl["ids"], ex["neg_ids"].reshape(e * g, t), ex["pos_ids"]])
    attn = jnp.concatenate([rl["attention_mask"], ex["neg_attention_mask"].reshape(e * g, t),
                            ex["pos_attention_mask"]])
    logits = model(ids, attn)[:, :-1]
    logp = ops.token_log_probs(logits, ids[:, 1:])
    logp_rl, logp_neg, logp_pos = logp[:r], logp[r:r + e * g], logp[r + e * g:]
    if self.sampling != rollout_lib.MODEL_DISTRIBUTION:  # The rollouts' surrogate follows their sampler.
      sampled = self.sampling.token_log_probs(logits[:r + e * g], ids[:r + e * g, 1:])
      logp_rl, logp_neg_sampled = sampled[:r], sampled[r:]
    else:
      logp_neg_sampled = logp_neg
    group_ids = jnp.repeat(jnp.arange(e, dtype=jnp.int32), g)
    neg_mask = ex["neg_loss_mask"].reshape(e * g, t - 1)
    pos_mask = ex["pos_loss_mask"]
    beta = fest_losses.adaptive_beta(ex["correct"].reshape(-1), group_ids, e, beta1=self.beta1,
                                     beta2=self.beta2, beta3=self.beta3)
    sg = jax.lax.stop_gradient
    seq_neg = ops.masked_sum(logp_neg, neg_mask, axis=-1)
    seq_pos = ops.masked_sum(logp_pos, pos_mask, axis=-1)[group_ids]
    ref_neg = ex["ref_logp_neg"].reshape(-1)
    ref_pos = ex["ref_logp_pos"][group_ids]
    if self.algorithm == "fest_dpo":
      expert, expert_metrics = fest_losses.semi_online_dpo_loss(seq_pos, ref_pos, seq_neg, ref_neg, beta)
      rl_term, rl_metrics = self._grpo(logp_rl, rl["old_logp"], rl["advantages"], rl["loss_mask"])
    else:
      expert, expert_metrics = fest_losses.fest_grpo_sft_term(
          logp_pos[group_ids], pos_mask[group_ids], ref_pos, seq_neg, ref_neg, beta,
          aggregation=self.sft_aggregation, max_len=self.max_len, fixed_weight=self.fixed_weight)
      rl_term, rl_metrics = self._grpo(
          jnp.concatenate([logp_rl, logp_neg_sampled]),
          jnp.concatenate([rl["old_logp"], ex["neg_old_logp"].reshape(e * g, t - 1)]),
          jnp.concatenate([rl["advantages"], ex["neg_advantages"].reshape(-1)]),
          jnp.concatenate([rl["loss_mask"], neg_mask]))
    w = sg(fest_losses.decaying_weight(sg(seq_pos) - ref_pos, sg(seq_neg) - ref_neg, beta))
    ones = jnp.ones_like(w)
    metrics = {f"expert/{k}": v for k, v in expert_metrics.items()}
    metrics.update({f"rl/{k}": v for k, v in rl_metrics.items()})
    metrics.update({
        "expert/loss": sg(expert), "rl/loss": sg(rl_term),
        "expert/decaying_weight_min": ops.masked_min(w, ones),
        "expert/decaying_weight_max": ops.masked_max(w, ones),
        "expert/pos_nll_per_token": ops.weighted_metric(-sg(logp_pos), pos_mask),
    })
    return expert, rl_term, metrics

  def __call__(self, model: nnx.Module, batch: Mapping[str, Any]):
    expert, rl_term, metrics = self.terms(model, batch)
    den = batch["denominators"][0]
    combine = fest_losses.fest_dpo_loss if self.algorithm == "fest_dpo" else fest_losses.fest_grpo_loss
    kwargs = ({"expert_denominator": den[0]} if self.algorithm == "fest_dpo" else {"sft_denominator": den[0]})
    # den[2] is the micro-batch's share of the whole-batch mean: the shares add up to 1 over the
    # micro-batches, so update_step's grad_sum / denominator is the gradient of c * L_E + L_I.
    return combine(expert, rl_term, c=self.c, rl_denominator=den[1], share=den[2], **kwargs), metrics


def fest_loss_from_config(rl_cfg, fest_cfg, algorithm: str) -> FestLoss:
  """Builds the loss from the ``rl`` and ``fest`` config sections."""
  pg.AGGREGATIONS.validate(fest_cfg.sft_aggregation)
  return FestLoss(**surrogate_fields_from_config(rl_cfg), algorithm=algorithm, c=float(fest_cfg.c),
                  beta1=float(fest_cfg.beta1), beta2=float(fest_cfg.beta2), beta3=float(fest_cfg.beta3),
                  sft_aggregation=fest_cfg.sft_aggregation, fixed_weight=bool(fest_cfg.fixed_weight),
                  sampling=SamplingSettings.from_config(rl_cfg))


def check_config(config) -> None:
  """The ``fest`` section and the ``rl`` fields FEST constrains (for ``rl.algorithm`` fest_dpo / fest_grpo)."""
  rl = config.rl
  if not rl.steps:
    return
  fest = config.get("fest")
  cc.require(fest is not None, "fest", fest, f"rl.algorithm={rl.algorithm!r} needs a 'fest' config section")
  cc.require_positive(fest, "fest", "num_shots", "expert_prompts_per_step", "beta1", "beta2", "beta3",
                      "num_microbatches")
  cc.require_positive(fest, "fest", "c", allow_zero=True)
  cc.require(isinstance(fest.num_shots, int) and isinstance(fest.expert_prompts_per_step, int)
             and isinstance(fest.num_microbatches, int), "fest", dict(fest), "num_shots, expert_prompts_per_step "
             "and num_microbatches must be integers")
  cc.require(fest.expert_prompts_per_step <= fest.num_shots, "fest.expert_prompts_per_step",
             fest.expert_prompts_per_step, f"must be <= fest.num_shots={fest.num_shots}")
  cc.require_name(pg.AGGREGATIONS, "fest.sft_aggregation", fest.sft_aggregation)
  cc.require(isinstance(fest.fixed_weight, bool), "fest.fixed_weight", fest.fixed_weight, "must be a bool")
  cc.require(not (fest.fixed_weight and rl.algorithm == "fest_dpo"), "fest.fixed_weight", fest.fixed_weight,
             "holds FEST-GRPO's SFT weight; FEST-DPO has no separate weight to hold: use False")
  rows = rl.prompts_per_step * rl.num_generations
  cc.require(not rl.minibatch_size or rl.minibatch_size == rows, "rl.minibatch_size", rl.minibatch_size,
             f"FEST updates on the whole step batch: use 0 (or {rows})")
  cc.require(rows % fest.num_microbatches == 0 and fest.expert_prompts_per_step % fest.num_microbatches == 0,
             "fest.num_microbatches", fest.num_microbatches,
             f"must divide rl.prompts_per_step * rl.num_generations = {rows} and fest.expert_prompts_per_step = "
             f"{fest.expert_prompts_per_step}")
  for field in ("kl_coef", "entropy_coef"):
    cc.require(not rl[field], f"rl.{field}", rl[field], "FEST's L_I is GRPO without KL or entropy terms: use 0")
  cc.require(not rl.use_tis, "rl.use_tis", rl.use_tis, "not supported by the FEST trainer: use False")
  cc.require(not rl.dynamic_sampling, "rl.dynamic_sampling", rl.dynamic_sampling,
             "not supported by the FEST trainer (its step batch has a fixed two-stream layout): use False")
  cc.require(not (rl.skip_zero_signal and fest.c), "rl.skip_zero_signal", rl.skip_zero_signal,
             f"with fest.c={fest.c}: the expert term has a gradient on every batch, so no step would ever be "
             "skipped; use False (or fest.c=0)")


def aggregation_denominator(mask: np.ndarray, aggregation: str, max_len: int | None = None) -> float:
  """The denominator of ``aggregation`` over ``mask [N, T]``: it depends on the mask only."""
  mask = jnp.asarray(mask, jnp.float32)
  return float(pg.aggregate(jnp.zeros_like(mask), mask, aggregation, max_len=max_len).denominator)


def global_denominators(loss: FestLoss, batch: Mapping[str, Any], num_microbatches: int) -> np.ndarray:
  """``[M, 3]``: the expert term's and the RL term's whole-batch denominators, and ``1 / M``, per micro-batch."""
  rl, ex = batch["rl"], batch["expert"]
  e, g = ex["correct"].shape
  neg_mask = np.asarray(ex["neg_loss_mask"]).reshape(e * g, -1)
  if loss.algorithm == "fest_dpo":
    expert_den = float(e * g)  # Every rollout of a D_E prompt is one pair.
    rl_den = aggregation_denominator(rl["loss_mask"], loss.aggregation, loss.max_len)
  else:
    pos_mask = np.repeat(np.asarray(ex["pos_loss_mask"]), g, axis=0)
    expert_den = aggregation_denominator(pos_mask, loss.sft_aggregation, loss.max_len)
    rl_den = aggregation_denominator(np.concatenate([np.asarray(rl["loss_mask"]), neg_mask]),
                                     loss.aggregation, loss.max_len)
  row = np.array([expert_den, rl_den, 1.0 / num_microbatches], np.float32)
  return np.tile(row, (num_microbatches, 1))


def decaying_weight_stats(w: np.ndarray) -> dict[str, float]:
  """Mean, min, max and quantiles of the decaying weights of a step's pairs."""
  w = np.asarray(w, np.float64)
  out = {"fest/decaying_weight/mean": float(w.mean()), "fest/decaying_weight/min": float(w.min()),
         "fest/decaying_weight/max": float(w.max())}
  for q, v in zip(WEIGHT_QUANTILES, np.quantile(w, WEIGHT_QUANTILES)):
    out[f"fest/decaying_weight/q{int(round(q * 100)):02d}"] = float(v)
  return out


def beta_case_counts(correct: np.ndarray) -> dict[str, float]:
  """Pair counts of the adaptive-beta cases, ``correct [E, G]`` (one row per ``D_E`` prompt)."""
  correct = np.asarray(correct) > 0
  solved = correct.any(axis=1, keepdims=True)
  return {"fest/beta_case/all_wrong": float((~solved & ~correct).sum()),
          "fest/beta_case/this_wrong": float((solved & ~correct).sum()),
          "fest/beta_case/this_right": float(correct.sum())}


def all_wrong_fraction(correct: np.ndarray) -> float:
  """Share of groups (rows of ``correct [P, G]``) with no correct rollout."""
  return float(np.mean(~(np.asarray(correct) > 0).any(axis=1)))


class TwoStreamIterator:
  """Yields one columnar batch per step: ``B_I`` examples of ``D_I`` then ``B_E`` of ``D_E``.

  Every example holds ``prompt``, ``stream`` (``"rl"`` / ``"expert"``), ``expert_completion`` (``y+``; ``""``
  for ``D_I``) and the ``D_I`` records' other fields (what the rewards read). The position of both streams
  is the iterator state (checkpointed with the phase).

  Args:
    rl: iterator over ``D_I`` (columnar batches, ``get_state`` / ``set_state``).
    expert: iterator over ``D_E``; its records have a ``completion`` (``y+``).
    fields: the reward fields (default: the ``D_I`` batch's keys but ``prompt``).
  """

  def __init__(self, rl, expert, fields: Sequence[str] | None = None):
    self.rl = rl
    self.expert = expert
    self.fields = None if fields is None else tuple(fields)

  def __iter__(self):
    return self

  @staticmethod
  def _records(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    keys = list(batch)
    return [dict(zip(keys, values)) for values in zip(*(batch[k] for k in keys))]

  def __next__(self) -> dict[str, list[Any]]:
    rl_records = self._records(next(self.rl))
    expert_records = self._records(next(self.expert))
    fields = self.fields or tuple(k for k in rl_records[0] if k != "prompt")
    examples = []
    for stream, records in ((STREAM_RL, rl_records), (STREAM_EXPERT, expert_records)):
      for rec in records:
        missing = [k for k in ("prompt", *fields) if k not in rec]
        if missing or (stream == STREAM_EXPERT and "completion" not in rec):
          raise ValueError(f"a {stream!r} record lacks {missing or ['completion']}: {sorted(rec)}")
        ex = {"prompt": rec["prompt"], STREAM_KEY: stream,
              EXPERT_COMPLETION_KEY: rec["completion"] if stream == STREAM_EXPERT else ""}
        ex.update({k: rec[k] for k in fields})
        examples.append(ex)
    return {k: [ex[k] for ex in examples] for k in examples[0]}

  def get_state(self) -> dict[str, Any]:
    return {STREAM_RL: self.rl.get_state(), STREAM_EXPERT: self.expert.get_state()}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.rl.set_state(state[STREAM_RL])
    self.expert.set_state(state[STREAM_EXPERT])


class FestTrainer:
  """Holds what is fixed during FEST (graph, optimizer, tokenizer, rewards, frozen reference, configs).

  Args:
    graphdef, optimizer: as :class:`lemon_rl.training.rl.RLTrainer`.
    tokenizer: encodes prompts and ``y+``.
    rewards: the verifier(s); a rollout is *correct* (adaptive beta) when its total reward is ``> 0``.
    rl_cfg: the ``rl`` config section (sampling, GRPO surrogate, ``num_iterations``).
    fest_cfg: the ``fest`` config section (``beta1..3``, ``c``, ``sft_aggregation``, ``num_microbatches``).
    algorithm: ``"fest_dpo"`` or ``"fest_grpo"``.
    ref_params: the frozen reference (the policy at the start of RL).
    prompt_len: prompt slots of the training sequences (``None``: the sampler's power-of-two bucket).
  """

  def __init__(self, graphdef, optimizer: optax.GradientTransformation, tokenizer,
               rewards: Sequence[WeightedReward], rl_cfg, fest_cfg, algorithm: str, ref_params: Any,
               prompt_len: int | None = None):
    self.prompt_len = prompt_len
    self.graphdef = graphdef
    self.optimizer = optimizer
    self.tokenizer = tokenizer
    self.rewards = list(rewards)
    self.cfg = rl_cfg
    self.num_microbatches = int(fest_cfg.num_microbatches)
    self.loss = fest_loss_from_config(rl_cfg, fest_cfg, algorithm)
    advantages_lib.ADVANTAGE_ESTIMATORS.validate(rl_cfg.advantage_estimator)
    if ref_params is None:
      raise ValueError("FEST needs the frozen reference policy (ref_params)")
    self.ref_params = ref_params
    self.zero_signal_skips = 0  # Steps whose update was skipped (rl.skip_zero_signal).

  @property
  def signal_without_variance(self) -> bool:
    """Whether the loss has a gradient when every rollout advantage is 0: the expert term (``c > 0``) has.

    So ``rl.skip_zero_signal`` skips a FEST step only with ``c = 0`` and no group of either stream varying
    (with ``fest_dpo`` the ``D_E`` rollouts then do not enter the loss: such a step is not skipped though
    its gradient is 0, the conservative side)."""
    return self.loss.c > 0

  # -- sampling and scoring ---------------------------------------------------------------------------

  def rollout(self, state: TrainState, examples: Sequence[Mapping[str, Any]]) -> Rollout:
    cfg, tok = self.cfg, self.tokenizer
    g, length = cfg.num_generations, cfg.max_new_tokens
    streams = [ex[STREAM_KEY] for ex in examples]
    if set(streams) - {STREAM_RL, STREAM_EXPERT} or STREAM_EXPERT not in streams or STREAM_RL not in streams:
      raise ValueError(f"a FEST step needs examples of both streams, got {sorted(set(streams))}")
    # Order the prompts: D_I first, then D_E (group p = prompt p).
    order = [i for i, s in enumerate(streams) if s == STREAM_RL] + [
        i for i, s in enumerate(streams) if s == STREAM_EXPERT]
    examples = [examples[i] for i in order]
    num_rl = streams.count(STREAM_RL)
    num_expert = len(examples) - num_rl
    rollout = rollout_lib.collect_rollout(self.graphdef, state.params, tok, examples, self.rewards, cfg,
                                          state_lib.step_key(state, 0), prompt_len=self.prompt_len,
                                          exclude_fields=(STREAM_KEY, EXPERT_COMPLETION_KEY))
    rewards, advantages, group_ids, metrics = (rollout.rewards, rollout.advantages, rollout.group_ids,
                                               rollout.metrics)
    seqs = rollout.batch
    prompt_ids = rollout.prompt_ids[::g]  # One per prompt.

    # Rollouts of both streams and the experts' y+, all on one [P | L] layout.
    p = seqs["ids"].shape[1] - length
    expert_examples = examples[num_rl:]
    pos_tokens = [tok.encode(ex[EXPERT_COMPLETION_KEY]) + [tok.eos_id] for ex in expert_examples]
    too_long = [len(x) for x in pos_tokens if len(x) > length]
    if too_long:
      raise ValueError(f"an expert solution has {max(too_long)} tokens with EOS, more than "
                       f"rl.max_new_tokens={length}")
    pos_ids, pos_mask = pad_completions(pos_tokens, length, tok.pad_id)
    pos = build_sequences(prompt_ids[num_rl:], pos_ids, pos_mask, tok.pad_id, p)
    t1 = time.perf_counter()
    all_ids = jnp.asarray(np.concatenate([seqs["ids"], pos["ids"]]))
    all_attn = jnp.asarray(np.concatenate([seqs["attention_mask"], pos["attention_mask"]]))
    # The model's own log-probs (expert terms, diagnostics) and the sampling distribution's (the surrogate).
    old_logp = np.asarray(rollout_lib.sequence_token_log_probs(self.graphdef, state.params, all_ids, all_attn))
    n_rl, n_neg = num_rl * g, num_expert * g
    old_sampling_logp = old_logp[:n_rl + n_neg]
    if self.loss.sampling != rollout_lib.MODEL_DISTRIBUTION:
      old_sampling_logp = np.asarray(rollout_lib.sequence_token_log_probs(
          self.graphdef, state.params, all_ids[:n_rl + n_neg], all_attn[:n_rl + n_neg], self.loss.sampling))
    expert_ids, expert_attn = all_ids[n_rl:], all_attn[n_rl:]
    ref_logp = np.asarray(rollout_lib.sequence_token_log_probs(self.graphdef, self.ref_params, expert_ids,
                                                               expert_attn))
    metrics["time/logprob_s"] = time.perf_counter() - t1
    t = seqs["ids"].shape[1]
    neg_mask = seqs["loss_mask"][n_rl:]
    seq_sum = lambda lp, m: (lp * m).sum(axis=-1)
    correct = (rewards > 0).astype(np.float32)
    batch = {
        "rl": {"ids": seqs["ids"][:n_rl], "attention_mask": seqs["attention_mask"][:n_rl],
               "loss_mask": seqs["loss_mask"][:n_rl], "old_logp": old_sampling_logp[:n_rl],
               "advantages": advantages[:n_rl]},
        "expert": {
            "pos_ids": pos["ids"], "pos_attention_mask": pos["attention_mask"],
            "pos_loss_mask": pos["loss_mask"], "ref_logp_pos": seq_sum(ref_logp[n_neg:], pos["loss_mask"]),
            "neg_ids": seqs["ids"][n_rl:].reshape(num_expert, g, t),
            "neg_attention_mask": seqs["attention_mask"][n_rl:].reshape(num_expert, g, t),
            "neg_loss_mask": neg_mask.reshape(num_expert, g, t - 1),
            "neg_old_logp": old_sampling_logp[n_rl:].reshape(num_expert, g, t - 1),
            "neg_advantages": advantages[n_rl:].reshape(num_expert, g),
            "ref_logp_neg": seq_sum(ref_logp[:n_neg], neg_mask).reshape(num_expert, g),
            "correct": correct[n_rl:].reshape(num_expert, g),
        },
    }
    batch["denominators"] = global_denominators(self.loss, batch, self.num_microbatches)

    # Diagnostics with the pre-update policy: decaying weights, beta cases, all-wrong groups per stream.
    beta = np.asarray(fest_losses.adaptive_beta(
        jnp.asarray(correct[n_rl:]), jnp.asarray(group_ids[n_rl:] - num_rl), num_expert,
        beta1=self.loss.beta1, beta2=self.loss.beta2, beta3=self.loss.beta3))
    r_pos = np.repeat(seq_sum(old_logp[n_rl + n_neg:], pos["loss_mask"]) - batch["expert"]["ref_logp_pos"], g)
    r_neg = seq_sum(old_logp[n_rl:n_rl + n_neg], neg_mask) - batch["expert"]["ref_logp_neg"].reshape(-1)
    w = np.asarray(fest_losses.decaying_weight(jnp.asarray(r_pos), jnp.asarray(r_neg), jnp.asarray(beta)))
    metrics.update(decaying_weight_stats(w))
    metrics.update(beta_case_counts(batch["expert"]["correct"]))
    metrics.update({
        "fest/reward_rl_stream": float(rewards[:n_rl].mean()),
        "fest/reward_expert_stream": float(rewards[n_rl:].mean()),
        "fest/frac_all_wrong_groups_rl": all_wrong_fraction(correct[:n_rl].reshape(num_rl, g)),
        "fest/frac_all_wrong_groups_expert": all_wrong_fraction(correct[n_rl:].reshape(num_expert, g)),
        "fest/expert_r_pos_mean": float(r_pos.mean()), "fest/expert_r_neg_mean": float(r_neg.mean()),
    })
    rollout.batch = batch
    return rollout

  # -- updates ----------------------------------------------------------------------------------------

  def update(self, state: TrainState, rollout: Rollout) -> tuple[TrainState, dict[str, float]]:
    """``rl.num_iterations`` updates, each on the whole step batch in ``fest.num_microbatches`` slices."""
    batch = jax.tree.map(jnp.asarray, rollout.batch)
    collected = []
    for _ in range(self.cfg.num_iterations):
      state, values = state_lib.update_step(self.graphdef, state, batch, loss_fn=self.loss,
                                            optimizer=self.optimizer, num_microbatches=self.num_microbatches)
      collected.append(values)
    return state, rollout_lib.reduce_update_metrics(collected)

  def step(self, state: TrainState, examples: Sequence[Mapping[str, Any]]):
    """One FEST step (rollout of both streams + updates)."""
    return rollout_lib.rollout_and_update(
        self, state, examples,
        lambda r: float(r.batch["rl"]["loss_mask"].sum() + r.batch["expert"]["neg_loss_mask"].sum()))
