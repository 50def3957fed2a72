r"""Writes a tiny random Hugging Face model directory: the checkpoint of the CPU end-to-end runs and the tests.

    python -m experiments.make_tiny_checkpoint --out=/tmp/tiny_qwen [--template=qwen2_5_instruct]
    python -m experiments.main --config=configs/grpo_gsm8k.py:tiny --config.model.hf_checkpoint=/tmp/tiny_qwen \
        --workdir=/tmp/gsm8k_tiny

Nothing is downloaded; it needs the test extras (``torch``, ``transformers``). The directory holds what a
Hub model directory holds, in the public formats:

- ``tokenizer.json``: a byte-level BPE trained by the ``tokenizers`` library on :data:`CORPUS`, laid out like
  Qwen2's / Llama 3's (their pre-tokenizer regex, NFC normaliser, control tokens added after the BPE ids;
  Llama 3 prepends BOS in its post-processor);
- ``tokenizer_config.json`` with the verbatim public chat template of ``tests/fixtures/chat_templates/`` and
  the special tokens, ``generation_config.json`` declaring every EOS id (Qwen2.5: ``<|im_end|>`` and
  ``<|endoftext|>``; Llama 3: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``);
- ``config.json`` + ``model.safetensors``: a random Qwen2 (Llama for ``llama3_*`` templates) model saved by
  ``transformers`` (d 32, 1 layer, 4 heads / 2 KV heads, MLP 64, untied head, ``torch.manual_seed(seed)``), its
  vocabulary the tokenizer's rounded up to a multiple of 16 (embedding rows beyond the tokenizer, as real
  checkpoints have).

:func:`write_model_dir` is what the chat-template and real-model-config tests build their directories with.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES_DIR = os.path.join(REPO, "tests", "fixtures", "chat_templates")
TEMPLATES = ("qwen2_5_instruct", "qwen3", "llama3_2_instruct")
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "Cutting Knowledge Date: December 2023. Today Date: 26 Jul 2024. Environment: ipython",
    "What is the weather in Paris? Use the tools: get_weather(location, unit).",
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}',
    "The answer is 42. Let me think step by step about 12+30 and then reply.",
]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# The random model's shape (transformers config fields).
MODEL_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024)


def train_tokenizer(regex: str, special: Sequence[str], added: Sequence[str], bos: str | None,
                    corpus: Sequence[str] = CORPUS):
  """A byte-level BPE in Qwen2's / Llama 3's ``tokenizer.json`` layout, control tokens after the BPE ids."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
    processors, trainers

  tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
  trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(list(corpus) * 10, trainer)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
  if bos is not None:  # Llama 3 prepends BOS in its post-processor; a chat template must not get it twice.
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, bos_id)])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok


def write_json(path: str, obj: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)


def write_model_dir(path: str, template: str = "qwen2_5_instruct", seed: int = 0) -> str:
  """Writes a complete model directory for ``template`` (a name in :data:`TEMPLATES`) at ``path``; returns it."""
  # pylint: disable=import-outside-toplevel
  import torch
  import transformers

  if template not in TEMPLATES:
    raise ValueError(f"unknown template {template!r}; expected one of {', '.join(TEMPLATES)}")
  llama = template.startswith("llama")
  os.makedirs(path, exist_ok=True)
  tok = train_tokenizer(LLAMA_REGEX if llama else QWEN_REGEX, LLAMA_SPECIAL if llama else QWEN_SPECIAL,
                        [] if llama else QWEN_ADDED, "<|begin_of_text|>" if llama else None)
  tok.save(os.path.join(path, "tokenizer.json"))
  tid = tok.token_to_id
  with open(os.path.join(TEMPLATES_DIR, template + ".jinja"), encoding="utf-8") as f:
    chat_template = f.read()
  added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": t.special}
           for i, t in sorted(tok.get_added_tokens_decoder().items())}
  vocab = -(-tok.get_vocab_size() // 16) * 16  # Embedding rows beyond the tokenizer, as real checkpoints have.
  torch.manual_seed(seed)
  if llama:
    write_json(os.path.join(path, "tokenizer_config.json"), {
        "added_tokens_decoder": added, "bos_token": "<|begin_of_text|>", "chat_template": chat_template,
        "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>", "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"})
    eos = [tid("<|end_of_text|>"), tid("<|eom_id|>"), tid("<|eot_id|>")]
    write_json(os.path.join(path, "generation_config.json"),
               {"bos_token_id": tid("<|begin_of_text|>"), "eos_token_id": eos, "do_sample": True})
    cfg = transformers.LlamaConfig(vocab_size=vocab, **MODEL_SHAPE, rope_theta=500000.0, tie_word_embeddings=False,
                                   bos_token_id=tid("<|begin_of_text|>"), eos_token_id=eos)
    model = transformers.LlamaForCausalLM(cfg)
  else:
    write_json(os.path.join(path, "tokenizer_config.json"), {
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": chat_template, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None})
    eos = [tid("<|im_end|>"), tid("<|endoftext|>")]
    write_json(os.path.join(path, "generation_config.json"),
               {"bos_token_id": tid("<|endoftext|>"), "pad_token_id": tid("<|endoftext|>"), "eos_token_id": eos})
    cfg = transformers.Qwen2Config(vocab_size=vocab, **MODEL_SHAPE, rope_theta=1000000.0, tie_word_embeddings=False,
                                   bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"))
    model = transformers.Qwen2ForCausalLM(cfg)
  model.save_pretrained(path)  # config.json + model.safetensors (and its own generation_config.json).
  # save_pretrained rewrote generation_config.json from cfg; put the directory's declared EOS list back.
  with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as f:
    gen = json.load(f)
  gen["eos_token_id"] = eos
  write_json(os.path.join(path, "generation_config.json"), gen)
  return path


def main(argv: Sequence[str] | None = None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="the directory to write (created; files in it are replaced)")
  parser.add_argument("--template", default="qwen2_5_instruct", choices=TEMPLATES,
                      help="the fixture chat template (llama3_* templates give a Llama-architecture model)")
  parser.add_argument("--seed", type=int, default=0, help="torch seed of the random weights")
  args = parser.parse_args(argv)
  path = write_model_dir(args.out, args.template, args.seed)
  print(path)
  return path


if __name__ == "__main__":
  main()
