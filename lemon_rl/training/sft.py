"""Supervised fine-tuning: masked negative log-likelihood on completion tokens.

Shares :class:`~lemon_rl.training.state.TrainState`, the jitted update, checkpoints and metrics with the
RL trainer. ``L = -sum_{i,t} m[i,t] log pi(y[i,t] | y[i,<t]) / sum m`` (token mean over completions).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from lemon_rl import ops
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.text.decoding import encode_prompt
from lemon_rl.training import distributed
from lemon_rl.training import state as state_lib
from lemon_rl.training.batches import build_sequences, pad_completions
from lemon_rl.training.state import TrainState


@dataclasses.dataclass(frozen=True)
class SFTLoss:
  """Masked NLL; ``batch`` holds ``ids``, ``attention_mask`` ``[N, T]`` and ``loss_mask [N, T-1]``."""

  aggregation: str = "token_mean"

  def __call__(self, model: nnx.Module, batch: Mapping[str, jax.Array]):
    logp = ops.token_log_probs(model(batch["ids"], batch["attention_mask"])[:, :-1], batch["ids"][:, 1:])
    mask = batch["loss_mask"]
    loss = pg.aggregate(-logp, mask, self.aggregation)
    return loss, {"nll": ops.weighted_metric(-logp, mask)}


def sft_batch(tokenizer, examples: Sequence[Mapping[str, Any]], max_completion_len: int,
              prompt_len: int | None = None) -> dict[str, np.ndarray]:
  """Tokenises ``{"prompt", "completion"}`` examples; the completion ends with EOS (in the loss)."""
  prompts = [encode_prompt(tokenizer, ex["prompt"]) for ex in examples]
  completions = [tokenizer.encode(ex["completion"]) + [tokenizer.eos_id] for ex in examples]
  ids, mask = pad_completions(completions, max_completion_len, tokenizer.pad_id)
  return build_sequences(prompts, ids, mask, tokenizer.pad_id, prompt_len)


class SFTTrainer:

  def __init__(self, graphdef, optimizer: optax.GradientTransformation, tokenizer, max_completion_len: int,
               microbatch_size: int | None = None, prompt_len: int | None = None):
    self.graphdef = graphdef
    self.optimizer = optimizer
    self.tokenizer = tokenizer
    self.max_completion_len = max_completion_len
    self.microbatch_size = microbatch_size
    self.prompt_len = prompt_len
    self.loss = SFTLoss()

  def step(self, state: TrainState, examples: Sequence[Mapping[str, Any]]):
    batch = sft_batch(self.tokenizer, examples, self.max_completion_len, self.prompt_len)
    tokens = distributed.global_sum(float(batch["loss_mask"].sum()))
    batch = distributed.to_global(batch)  # This process's examples are its rows of the global batch.
    n = batch["ids"].shape[0]
    micro = self.microbatch_size or n
    if n % micro:
      raise ValueError(f"SFT batch of {n} is not a multiple of microbatch_size={micro}")
    state, values = state_lib.update_step(self.graphdef, state, batch, loss_fn=self.loss, optimizer=self.optimizer,
                                          num_microbatches=n // micro)
    return state, {f"train/{k}": v for k, v in values.items()}, tokens
