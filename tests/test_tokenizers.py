"""Tests for lemon_rl.text.tokenizers."""

import json
import os
import re

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest
import tokenizers as hf_tokenizers

from lemon_rl.text import ByteTokenizer
from lemon_rl.text import HFTokenizer
from lemon_rl.text import load_tokenizer
from lemon_rl.text import Tokenizer

_CORPUS = [
    "hello world", "héllo wörld 12+34=46", "the quick brown fox jumps over the lazy dog",
    "数学 problems: 123*45=5535", "emoji 🍋 lemon 🍋🍋", "<think>reason</think> answer",
]
_PROBES = ["hello wörld", "🍋 12+34=", "a<eos>b", "<s>start</s>", "unseen ЖЖЖ text", "", "   ", "x<think>y"]


class TestByteTokenizer:

  def test_layout(self):
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
    assert tok.token_to_id("<think>") == 259
    assert tok.token_to_id("</tool_call>") == 262
    assert tok.vocab_size == 263
    assert tok.eos_ids == (258,)
    assert tok.special_ids == frozenset(range(256, 263))
    assert tok.token_to_id("A") == 65

  def test_ascii_ids_are_code_points(self):
    tok = ByteTokenizer()
    assert tok.encode("12+34=") == [ord(c) for c in "12+34="]
    assert tok.encode("ab", add_bos=True, add_eos=True) == [257, 97, 98, 258]

  def test_unicode_is_utf8_bytes(self):
    tok = ByteTokenizer()
    text = "é🍋数"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text

  def test_specials_in_text_encode_to_one_id(self):
    tok = ByteTokenizer()
    assert tok.encode("<eos>") == [258]
    assert tok.encode("a<think>b</think>") == [97, 259, 98, 260]
    # Not special: partial or differently spelled markers stay bytes.
    assert tok.encode("<think") == list(b"<think")
    assert tok.encode("<EOS>") == list(b"<EOS>")

  def test_decode_skip_and_keep_specials(self):
    tok = ByteTokenizer()
    ids = tok.encode("<bos>hi<think>x</think><eos><pad>")
    assert tok.decode(ids) == "hix"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>hi<think>x</think><eos><pad>"

  def test_longest_special_wins(self):
    tok = ByteTokenizer(extra_special_tokens=("<a>", "<a>>"))
    assert tok.encode("<a>>") == [tok.token_to_id("<a>>")]
    assert tok.encode("<a>") == [tok.token_to_id("<a>")]

  @settings(max_examples=200, deadline=None)
  @given(st.text())
  def test_round_trip_any_text(self, text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text

  @settings(max_examples=100, deadline=None)
  @given(st.lists(st.sampled_from(list("ab<>/") + ["<eos>", "<think>", "</think>", "é"])).map("".join))
  def test_round_trip_dense_specials(self, text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Skipping specials removes exactly the non-overlapping left-to-right matches (one pass, not repeated).
    assert tok.decode(ids) == re.sub(r"<eos>|</think>|<think>", "", text)

  def test_invalid_utf8_never_raises(self):
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0xFE, 65]) == "\ufffd\ufffdA"
    truncated = list("🍋".encode("utf-8"))[:2]
    assert tok.decode(truncated + [66]) == "\ufffdB"
    # A special in the middle of a multi-byte sequence splits it; both halves are replaced.
    lemon = list("🍋".encode("utf-8"))
    out = tok.decode(lemon[:2] + [tok.eos_id] + lemon[2:], skip_special_tokens=False)
    assert out.startswith("\ufffd") and "<eos>" in out and "🍋" not in out

  @settings(max_examples=200, deadline=None)
  @given(st.lists(st.integers(0, 262), max_size=40))
  def test_decode_any_ids_never_raises(self, ids):
    tok = ByteTokenizer()
    assert isinstance(tok.decode(ids), str)
    assert isinstance(tok.decode(ids, skip_special_tokens=False), str)

  def test_vocab_padding(self):
    tok = ByteTokenizer(pad_vocab_to_multiple_of=8)
    assert tok.vocab_size == 264
    assert tok.decode([72, 263, 73]) == "H\ufffdI"
    with pytest.raises(ValueError, match="264"):
      tok.decode([264])
    with pytest.raises(ValueError, match="-1"):
      tok.decode([-1])
    assert ByteTokenizer(extra_special_tokens=(), pad_vocab_to_multiple_of=64).vocab_size == 320

  def test_bad_construction_and_lookup(self):
    with pytest.raises(ValueError, match="duplicate"):
      ByteTokenizer(extra_special_tokens=("<eos>",))
    with pytest.raises(ValueError, match="pad_vocab_to_multiple_of"):
      ByteTokenizer(pad_vocab_to_multiple_of=0)
    tok = ByteTokenizer()
    with pytest.raises(KeyError, match="ab"):
      tok.token_to_id("ab")
    with pytest.raises(KeyError):
      tok.token_to_id("é")  # Two bytes, not one token.
    with pytest.raises(TypeError):
      tok.encode(b"bytes")


def _train_bpe(directory, *, with_bos_post_processor=True):
  """Trains a tiny byte-level BPE with the `tokenizers` library and saves tokenizer.json in `directory`."""
  raw = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
  raw.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = hf_tokenizers.decoders.ByteLevel()
  trainer = hf_tokenizers.trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<eos2>"],
      initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet())
  raw.train_from_iterator(_CORPUS, trainer=trainer)
  raw.add_special_tokens(["<think>", "</think>"])
  if with_bos_post_processor:
    raw.post_processor = hf_tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "tokenizer.json")
  raw.save(path)
  return raw, path


def _write_json(directory, name, obj):
  with open(os.path.join(directory, name), "w") as f:
    json.dump(obj, f)


class TestHFTokenizer:

  def test_agrees_with_tokenizers_library(self, tmp_path):
    raw, path = _train_bpe(str(tmp_path))
    _write_json(str(tmp_path), "tokenizer_config.json",
                {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": "<pad>"})
    tok = HFTokenizer.from_file(path)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    for text in _CORPUS + _PROBES:
      expected = raw.encode(text, add_special_tokens=False).ids
      assert tok.encode(text) == expected, text
      assert tok.encode(text, add_bos=True) == [1] + expected
      assert tok.encode(text, add_eos=True) == expected + [2]
      assert tok.decode(expected) == raw.decode(expected, skip_special_tokens=True)
      assert tok.decode(expected, skip_special_tokens=False) == raw.decode(expected, skip_special_tokens=False)
    # The tokenizer's own post-processor would add <s>; ours only does when asked.
    assert raw.encode("hello").ids[0] == 1
    assert tok.encode("hello")[0] != 1
    # Specials in text are single ids; unicode round trips.
    think = raw.token_to_id("<think>")
    assert tok.token_to_id("<think>") == think
    assert think in tok.encode("a<think>b")
    assert think in tok.special_ids and 2 in tok.special_ids
    for text in _CORPUS:
      assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    with pytest.raises(KeyError, match="zzzq"):
      tok.token_to_id("zzzq")

  def test_invalid_byte_sequence_decodes(self, tmp_path):
    raw, path = _train_bpe(str(tmp_path))
    tok = HFTokenizer.from_file(path, eos_id=2)
    # A lone UTF-8 lead byte (0xF0 is 'ð' in the byte-level alphabet) is invalid on its own.
    lead = raw.token_to_id("ð")
    assert lead is not None
    out = tok.decode([lead, raw.token_to_id("a")])
    assert out == raw.decode([lead, raw.token_to_id("a")])
    assert out.endswith("a") and "\ufffd" in out

  def test_special_ids_precedence_and_fallbacks(self, tmp_path):
    d = str(tmp_path)
    raw, _ = _train_bpe(d)
    # special_tokens_map gives the pad; generation_config gives a list of EOS; config.json a BOS.
    _write_json(d, "special_tokens_map.json", {"pad_token": "<pad>"})
    _write_json(d, "generation_config.json", {"eos_token_id": [4, 2]})
    _write_json(d, "config.json", {"bos_token_id": 1, "eos_token_id": 2})
    tok = load_tokenizer(d)
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (3, 1, 4)
    assert tok.eos_ids == (4, 2)
    # tokenizer_config outranks the others; explicit arguments outrank everything.
    _write_json(d, "tokenizer_config.json", {"eos_token": "</s>", "bos_token": None})
    tok = load_tokenizer(d)
    assert tok.eos_id == 2 and tok.eos_ids == (2, 4)
    assert tok.bos_id is None  # null in tokenizer_config: no BOS, whatever config.json says (Qwen2).
    tok = HFTokenizer.from_file(os.path.join(d, "tokenizer.json"), pad_id=0, bos_id=None, eos_id=4)
    assert (tok.pad_id, tok.eos_id) == (0, 4)

  def test_no_pad_falls_back_to_eos_and_missing_bos(self, tmp_path):
    d = str(tmp_path)
    _train_bpe(d)
    _write_json(d, "tokenizer_config.json", {"eos_token": "</s>"})
    tok = HFTokenizer.from_file(d)
    assert tok.pad_id == tok.eos_id == 2
    assert tok.bos_id is None
    with pytest.raises(ValueError, match="no BOS"):
      tok.encode("x", add_bos=True)

  def test_errors(self, tmp_path):
    d = str(tmp_path)
    _train_bpe(d)
    with pytest.raises(ValueError, match="no EOS"):
      HFTokenizer.from_file(d)
    _write_json(d, "tokenizer_config.json", {"eos_token": "<missing>"})
    with pytest.raises(ValueError, match="<missing>"):
      HFTokenizer.from_file(d)
    os.remove(os.path.join(d, "tokenizer_config.json"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
      HFTokenizer.from_file(os.path.join(d, "tokenizer.json"), eos_id=10_000)
    with pytest.raises(FileNotFoundError):
      HFTokenizer.from_file(str(tmp_path / "nowhere"))


def test_load_tokenizer_dispatch(tmp_path):
  tok = load_tokenizer("byte")
  assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 263
  assert load_tokenizer("byte", pad_vocab_to_multiple_of=8).vocab_size == 264
  assert load_tokenizer(tok) is tok
  with pytest.raises(ValueError, match="unknown tokenizer spec"):
    load_tokenizer("bytes")
  with pytest.raises(TypeError):
    load_tokenizer(3)
  _, path = _train_bpe(str(tmp_path))
  assert isinstance(load_tokenizer(path, eos_id=2), HFTokenizer)
