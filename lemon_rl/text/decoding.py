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
  prompt is the text's ids alone. A tokenizer with its own ``encode_prompt`` (:class:`ChatPromptTokenizer`)
  encodes it instead. Every trainer, evaluation and sampler call encodes prompts here.
  """
  encode = getattr(tokenizer, "encode_prompt", None)
  if encode is not None:
    return list(encode(text))
  return tokenizer.encode(text, add_bos=tokenizer.bos_id is not None)


class _PromptTokenizer:
  """A tokenizer with its own ``encode_prompt``; every other attribute is the wrapped ``tokenizer``'s."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def __getattr__(self, name: str):
    if name in ("tokenizer", "template"):  # Not set yet (e.g. while unpickling): no recursion.
      raise AttributeError(name)
    return getattr(self.tokenizer, name)


class DocumentPromptTokenizer(_PromptTokenizer):
  """Prompts of a base model trained on documents separated by EOS (``stdlib_corpus.pack_documents``): a
  prompt is the start of a new document, ``[eos] + encode(text)``, as in training, where every document but
  the first follows an EOS. Completions, ``decode``, ``eos_ids`` and ``pad_id`` are the wrapped tokenizer's."""

  def encode_prompt(self, text: str) -> list[int]:
    return [self.tokenizer.eos_id] + self.tokenizer.encode(text)

  def __repr__(self) -> str:
    return f"DocumentPromptTokenizer({self.tokenizer!r})"


class ChatPromptTokenizer(_PromptTokenizer):
  """A tokenizer whose prompts are rendered as one user turn of a chat template (instruct models).

  A prompt ``text`` becomes ``template.encode([{"role": "user", "content": text}], add_generation_prompt=True)``:
  the ids of ``transformers``' ``apply_chat_template`` (the template writes BOS, the default system message
  and the assistant header itself). Everything else (``encode`` of completions, ``decode``, ``eos_ids``,
  ``pad_id``, ...) is the wrapped tokenizer's, so completions end with its EOS and generation stops on each of
  its EOS ids. Multi-turn episodes are out of scope: only the first observation would be rendered.
  """

  def __init__(self, tokenizer, template):
    super().__init__(tokenizer)
    self.template = template

  def encode_prompt(self, text: str) -> list[int]:
    return self.template.encode([{"role": "user", "content": text}], add_generation_prompt=True)

  def __repr__(self) -> str:
    return f"ChatPromptTokenizer({self.tokenizer!r}, {self.template!r})"
