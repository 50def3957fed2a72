"""Token-in, token-out batches: prompt + completion sequences and their loss masks.

Every sequence is a left-padded prompt of ``P`` slots followed by a right-padded completion of ``L``
slots, so ``T = P + L``. Next-token arrays (log-probs, loss mask) have ``T - 1`` columns; completion
token ``j`` is predicted at column ``P - 1 + j``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lemon_rl.sampling.sampler import left_pad, prompt_bucket
from lemon_rl.training import distributed


def build_sequences(prompts: Sequence[Sequence[int]], completions: np.ndarray, completion_mask: np.ndarray,
                    pad_id: int, prompt_len: int | None = None) -> dict[str, np.ndarray]:
  """Concatenates prompts and completions.

  Args:
    prompts: ``N`` token-id lists.
    completions: ``[N, L]`` completion ids (padding anywhere the mask is 0).
    completion_mask: ``[N, L]`` 1 on generated tokens.
    pad_id: padding id.
    prompt_len: ``P`` (default: the sampler's bucket of the longest prompt of any process, so that every
      process builds the same shape).

  Returns:
    ``ids [N, T]``, ``attention_mask [N, T]`` and ``loss_mask [N, T-1]`` (1 where the target is a
    completion token).
  """
  completions = np.asarray(completions, np.int32)
  completion_mask = np.asarray(completion_mask, np.int32)
  longest = max(len(x) for x in prompts)
  p = prompt_len or prompt_bucket(distributed.global_max(longest))
  if longest > p:
    raise ValueError(f"a prompt of {longest} tokens does not fit prompt_len={p}")
  prompt_ids, prompt_mask = left_pad(prompts, p, pad_id)
  ids = np.concatenate([prompt_ids, np.where(completion_mask > 0, completions, pad_id)], axis=1)
  attention_mask = np.concatenate([prompt_mask, completion_mask], axis=1)
  return {"ids": ids, "attention_mask": attention_mask,
          "loss_mask": completion_to_targets(completion_mask, p).astype(np.float32)}


def completion_to_targets(values: np.ndarray, prompt_len: int) -> np.ndarray:
  """Places completion-aligned ``[N, L]`` values at their next-token columns ``[N, P - 1 + L]``."""
  values = np.asarray(values)
  return np.pad(values, ((0, 0), (prompt_len - 1, 0)))


def pad_completions(token_lists: Sequence[Sequence[int]], length: int, pad_id: int):
  """Right-pads completions to ``length``: ``(ids [N, L], mask [N, L])``; longer ones are truncated."""
  ids = np.full((len(token_lists), length), pad_id, np.int32)
  mask = np.zeros((len(token_lists), length), np.int32)
  for i, toks in enumerate(token_lists):
    toks = list(toks)[:length]
    ids[i, :len(toks)] = toks
    mask[i, :len(toks)] = 1
  return ids, mask
