"""Multi-turn SFT: masked NLL on demonstrated episodes laid out exactly as the episode engine lays out episodes.

A demonstration is a list of turns ``(o_t, a_t)``: ``o_0`` the prompt (the environment's ``reset`` text),
``o_t`` for ``t >= 1`` the observation the environment returned after action ``a_{t-1}``, ``a_t`` the action
text. :func:`demonstration_sequence` tokenises it as :func:`lemon_rl.training.multiturn.run_episodes`
builds an episode whose policy sampled the tokens of those actions:

    ids = encode_prompt(o_0) ++ [enc(a_0), EOS] ++ enc(o_1) ++ [enc(a_1), EOS] ++ ... ++ [enc(a_{T-1}), EOS]

(``encode_prompt``: BOS when the tokenizer has one; ``enc`` = ``tokenizer.encode``, no BOS; every observation is
encoded once, on its own, never re-rendered with the history; the observation after the last action is not
appended, as the engine records but does not append a final observation). ``loss_mask`` is 1 exactly on the
action tokens and their EOS (the policy's tokens), 0 on the prompt and the observations.
``tests/test_budgetmix_experiment.py`` checks that the engine, driven by a policy that samples exactly these
action tokens, produces the same ids and mask token for token.

The loss is :class:`lemon_rl.training.sft.SFTLoss` (token mean over action tokens) on right-padded
sequences: ``L = -sum_{i,j} m[i,j] log pi(ids[i,j+1] | ids[i,<=j]) / sum m`` with ``m = loss_mask[:, 1:]``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
import optax

from lemon_rl.text.decoding import encode_prompt
from lemon_rl.training import state as state_lib
from lemon_rl.training.sft import SFTLoss
from lemon_rl.training.state import TrainState

Turns = Sequence[tuple[str, str]]


def demonstration_sequence(tokenizer, turns: Turns) -> tuple[np.ndarray, np.ndarray]:
  """``(ids [n] int32, loss_mask [n] int32)`` of a demonstration (module docstring for the layout)."""
  if not turns:
    raise ValueError("a demonstration needs at least one turn")
  ids = list(encode_prompt(tokenizer, turns[0][0]))
  mask = [0] * len(ids)
  for t, (observation, action) in enumerate(turns):
    if t:
      obs = tokenizer.encode(observation)
      ids += obs
      mask += [0] * len(obs)
    act = list(tokenizer.encode(action)) + [tokenizer.eos_id]
    ids += act
    mask += [1] * len(act)
  return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def sequences_to_batch(sequences: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int, length_multiple: int = 64,
                       max_length: int | None = None) -> dict[str, np.ndarray]:
  """Right-padded ``ids``, ``attention_mask`` ``[N, T]`` and next-token ``loss_mask`` ``[N, T-1]`` (float32).

  ``T`` is the longest sequence rounded up to ``length_multiple`` (few compiled shapes); a sequence longer
  than ``max_length`` raises (it would not fit the context the policy is played with).
  """
  longest = max(len(ids) for ids, _ in sequences)
  if max_length is not None and longest > max_length:
    raise ValueError(f"a demonstration of {longest} tokens is longer than max_length={max_length}")
  t = max(2, _round_up(longest, length_multiple))
  n = len(sequences)
  ids = np.full((n, t), pad_id, np.int32)
  attn = np.zeros((n, t), np.int32)
  loss = np.zeros((n, t), np.float32)
  for i, (seq, mask) in enumerate(sequences):
    ids[i, :len(seq)], attn[i, :len(seq)], loss[i, :len(seq)] = seq, 1, mask
  return {"ids": ids, "attention_mask": attn, "loss_mask": loss[:, 1:]}


def record_turns(record: Mapping[str, Any]) -> list[tuple[str, str]]:
  """The turns of a task record: ``record["turns"]``, a JSON list of ``[observation, action]`` (or the list)."""
  turns = record["turns"]
  if isinstance(turns, str):
    turns = json.loads(turns)
  return [(str(o), str(a)) for o, a in turns]


class MultiTurnSFTTrainer:
  """Masked NLL on demonstrations (records with ``turns``); ``step(state, examples) -> (state, metrics, tokens)``.

  Args:
    graphdef, optimizer: as :func:`lemon_rl.training.state.create_train_state` made them.
    tokenizer: the engine's tokenizer.
    microbatch_size: rows per gradient-accumulation slice (``None``: the whole batch).
    length_multiple: sequences are padded to a multiple of this.
    max_length: the context the policy is played with (longer demonstrations raise).
  """

  def __init__(self, graphdef, optimizer: optax.GradientTransformation, tokenizer, microbatch_size: int | None = None,
               length_multiple: int = 64, max_length: int | None = None):
    self.graphdef, self.optimizer, self.tokenizer = graphdef, optimizer, tokenizer
    self.microbatch_size, self.length_multiple, self.max_length = microbatch_size, length_multiple, max_length
    self.loss = SFTLoss()

  def batch(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    sequences = [demonstration_sequence(self.tokenizer, record_turns(ex)) for ex in examples]
    return sequences_to_batch(sequences, self.tokenizer.pad_id, self.length_multiple, self.max_length)

  def step(self, state: TrainState, examples: Sequence[Mapping[str, Any]]):
    batch = self.batch(examples)
    n = batch["ids"].shape[0]
    micro = self.microbatch_size or n
    if n % micro:
      raise ValueError(f"SFT batch of {n} is not a multiple of microbatch_size={micro}")
    state, values = state_lib.update_step(self.graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()},
                                          loss_fn=self.loss, optimizer=self.optimizer, num_microbatches=n // micro)
    tokens = float(batch["loss_mask"].sum())
    metrics = {f"train/{k}": v for k, v in values.items()}
    metrics.update({"train/action_tokens": tokens, "train/length": float(batch["ids"].shape[1])})
    return state, metrics, tokens
