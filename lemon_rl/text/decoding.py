"""Prompts into token ids, and sampled completion ids into the text reward functions see."""

from __future__ import annotations

from typing import Sequence


def decode_completion(tokenizer, ids: Sequence[int]) -> str:
  """Decodes a completion keeping special tokens (``<think>``, ``<tool_call>``, ...) but not EOS / padding.

  Reward functions parse structure that lives in special tokens, so they must see them; the end-of-sequence
  marker is a stop signal, not content.
  """
  ids = list(ids)
  stop = set(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,))) | {tokenizer.pad_id}
  while ids and ids[-1] in stop:
    ids.pop()
  return tokenizer.decode(ids, skip_special_tokens=False)


def encode_prompt(tokenizer, text: str) -> list[int]:
  """The token ids a prompt is sampled and trained from: BOS first when the tokenizer has one.

  Llama-style tokenizers declare a BOS that every sequence starts with; others (Qwen2) have none, so the
  prompt is the text's ids alone. Every trainer, evaluation and sampler call encodes prompts here.
  """
  return tokenizer.encode(text, add_bos=tokenizer.bos_id is not None)
