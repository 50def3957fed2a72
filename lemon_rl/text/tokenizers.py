"""Tokenizers: a file-free byte-level default and a wrapper over Hugging Face ``tokenizer.json``.

Every tokenizer implements the :class:`Tokenizer` protocol::

  tok = load_tokenizer("byte")                  # ByteTokenizer, no files
  tok = load_tokenizer("/path/to/model_dir")    # HFTokenizer over tokenizer.json (+ config files)
  ids = tok.encode("12+34=", add_bos=True)      # list[int]
  text = tok.decode(ids)                        # str; specials dropped by default

Conventions shared by both implementations:

- ``encode`` never adds special tokens on its own (no hidden BOS from a post-processor); ``add_bos=True``
  prepends ``bos_id`` and ``add_eos=True`` appends ``eos_id``. Special-token strings that occur literally in
  the text (``"<eos>"``, ``"<think>"``...) encode to their single id.
- ``decode`` never raises on ids that do not form valid UTF-8 (bytes are decoded with ``errors="replace"``).
- ``token_to_id`` raises ``KeyError`` (naming the token) for a string that is not a single token.
- ``eos_ids`` lists every id that ends a generation (``eos_id`` first); ``special_ids`` every special id.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

DEFAULT_EXTRA_SPECIAL_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<tool_call>", "</tool_call>")


@runtime_checkable
class Tokenizer(Protocol):
  """The interface every tokenizer of lemon_rl implements."""

  @property
  def vocab_size(self) -> int:
    """Number of ids (the model's embedding table needs at least this many rows)."""
    ...

  @property
  def pad_id(self) -> int:
    ...

  @property
  def bos_id(self) -> int | None:
    ...

  @property
  def eos_id(self) -> int:
    ...

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a generation, ``eos_id`` first."""
    ...

  @property
  def special_ids(self) -> frozenset[int]:
    ...

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ...

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    ...

  def token_to_id(self, token: str) -> int:
    ...


class ByteTokenizer:
  """UTF-8 bytes as ids ``0..255``, followed by special tokens.

  Layout: id ``b`` for byte ``b`` (so ``ord(c) == id`` for ASCII), then ``<pad>``, ``<bos>``, ``<eos>`` at
  ``256, 257, 258``, then ``extra_special_tokens`` in order, then (optionally) unused ids up to the next multiple
  of ``pad_vocab_to_multiple_of`` (e.g. 8, for matmul-friendly embedding tables). Unused ids decode to U+FFFD.

  Args:
    extra_special_tokens: additional special strings, each encoded as one id when it occurs in text.
    pad_vocab_to_multiple_of: round ``vocab_size`` up to a multiple of this (1 = no padding).
  """

  NUM_BYTES = 256

  def __init__(self,
               extra_special_tokens: Sequence[str] = DEFAULT_EXTRA_SPECIAL_TOKENS,
               pad_vocab_to_multiple_of: int = 1):
    specials = ["<pad>", "<bos>", "<eos>", *extra_special_tokens]
    if len(set(specials)) != len(specials):
      raise ValueError(f"duplicate special tokens in {specials}")
    for tok in specials:
      if not isinstance(tok, str) or not tok:
        raise ValueError(f"special tokens must be non-empty strings, got {tok!r}")
    if int(pad_vocab_to_multiple_of) < 1:
      raise ValueError(f"pad_vocab_to_multiple_of must be >= 1, got {pad_vocab_to_multiple_of}")
    self._special_to_id = {tok: self.NUM_BYTES + i for i, tok in enumerate(specials)}
    self._id_to_special = {i: tok for tok, i in self._special_to_id.items()}
    used = self.NUM_BYTES + len(specials)
    m = int(pad_vocab_to_multiple_of)
    self._vocab_size = -(-used // m) * m
    # Longest first, so that a special that is a prefix of another never wins.
    self._special_re = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def pad_id(self) -> int:
    return self._special_to_id["<pad>"]

  @property
  def bos_id(self) -> int:
    return self._special_to_id["<bos>"]

  @property
  def eos_id(self) -> int:
    return self._special_to_id["<eos>"]

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  @property
  def special_ids(self) -> frozenset[int]:
    return frozenset(self._id_to_special)

  @property
  def special_tokens(self) -> tuple[str, ...]:
    return tuple(self._special_to_id)

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Encodes ``text`` as UTF-8 bytes, with special-token strings mapped to their single id."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    ids = [self.bos_id] if add_bos else []
    pos = 0
    for match in self._special_re.finditer(text):
      ids.extend(text[pos:match.start()].encode("utf-8"))
      ids.append(self._special_to_id[match.group()])
      pos = match.end()
    ids.extend(text[pos:].encode("utf-8"))
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Decodes ids; invalid UTF-8 and unused ids become U+FFFD; ids outside ``[0, vocab_size)`` raise."""
    pieces: list[str] = []
    buf = bytearray()
    for i in ids:
      i = int(i)
      if 0 <= i < self.NUM_BYTES:
        buf.append(i)
        continue
      if i < 0 or i >= self._vocab_size:
        raise ValueError(f"token id {i} is outside [0, {self._vocab_size})")
      if buf:
        pieces.append(buf.decode("utf-8", errors="replace"))
        buf = bytearray()
      special = self._id_to_special.get(i)
      if special is None:
        pieces.append("\ufffd")  # An unused (vocabulary-padding) id.
      elif not skip_special_tokens:
        pieces.append(special)
    if buf:
      pieces.append(buf.decode("utf-8", errors="replace"))
    return "".join(pieces)

  def token_to_id(self, token: str) -> int:
    """The id of a special token or of a single-byte (ASCII) character."""
    if token in self._special_to_id:
      return self._special_to_id[token]
    raw = token.encode("utf-8") if isinstance(token, str) else b""
    if len(raw) == 1:
      return raw[0]
    raise KeyError(f"{token!r} is not a single token of ByteTokenizer (specials: {list(self._special_to_id)})")

  def __repr__(self) -> str:
    return f"ByteTokenizer(vocab_size={self._vocab_size}, specials={list(self._special_to_id)})"


def _token_content(value: Any) -> str | None:
  """A token as written in ``tokenizer_config.json``: a string or an AddedToken dict ``{"content": ...}``."""
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  return None


def _as_id_list(value: Any) -> list[int]:
  if value is None:
    return []
  if isinstance(value, (list, tuple)):
    return [int(v) for v in value if v is not None]
  return [int(value)]


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  return data if isinstance(data, dict) else {}


class HFTokenizer:
  """A :class:`Tokenizer` over a Hugging Face ``tokenizer.json`` (the ``tokenizers`` package).

  Special ids come from, in order of precedence: the explicit arguments, ``tokenizer_config.json``,
  ``special_tokens_map.json`` (token strings), ``generation_config.json``, ``config.json`` (``*_token_id``),
  the first file that defines a non-null value winning, except that a token set to null in
  ``tokenizer_config.json`` means the tokenizer has none (the model configs' id is then ignored). ``eos_ids`` is the union of every EOS found (e.g.
  Llama 3's list in ``generation_config.json``). Without any pad token, ``pad_id`` falls back to ``eos_id``.
  ``bos_id`` may be ``None`` (e.g. Qwen2's tokenizer); then ``encode(add_bos=True)`` raises.
  """

  def __init__(self, tokenizer: Any, *, pad_id: int | None = None, bos_id: int | None = None,
               eos_id: int | None = None, extra_eos_ids: Sequence[int] = (), name: str = ""):
    self._tok = tokenizer
    self._name = name
    if eos_id is None:
      raise ValueError(f"HFTokenizer {name!r}: no EOS token found; pass eos_id explicitly")
    self._eos_id = int(eos_id)
    self._eos_ids = tuple(dict.fromkeys([self._eos_id, *(int(i) for i in extra_eos_ids)]))
    self._bos_id = None if bos_id is None else int(bos_id)
    self._pad_id = self._eos_id if pad_id is None else int(pad_id)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    for field, value in (("pad_id", self._pad_id), ("bos_id", self._bos_id), *(("eos_id", i) for i in self._eos_ids)):
      if value is not None and not 0 <= value < vocab:
        raise ValueError(f"HFTokenizer {name!r}: {field}={value} is outside the vocabulary [0, {vocab})")
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    self._special_ids = frozenset(
        {tokenizer.token_to_id(t) for t in specials} | set(self._eos_ids) | {self._pad_id}
        | ({self._bos_id} if self._bos_id is not None else set()))

  @classmethod
  def from_file(cls, path: str | os.PathLike[str], *, pad_id: int | None = None, bos_id: int | None = None,
                eos_id: int | None = None) -> "HFTokenizer":
    """Loads ``path`` (a ``tokenizer.json`` or a directory holding one) and the config files next to it."""
    from tokenizers import Tokenizer as _RawTokenizer  # pylint: disable=g-import-not-at-top

    path = os.fspath(path)
    if os.path.isdir(path):
      directory, file = path, os.path.join(path, "tokenizer.json")
    else:
      directory, file = os.path.dirname(path) or ".", path
    if not os.path.isfile(file):
      raise FileNotFoundError(f"no tokenizer.json at {file!r}")
    raw = _RawTokenizer.from_file(file)

    def lookup(token: str | None) -> int | None:
      if token is None:
        return None
      tid = raw.token_to_id(token)
      if tid is None:
        raise ValueError(f"{file}: special token {token!r} from the config files is not in the vocabulary")
      return tid

    found: dict[str, list[int]] = {"pad": [], "bos": [], "eos": []}
    # A tokenizer_config.json that sets a token to null declares that the tokenizer has none (Qwen2's
    # ``"bos_token": null``): the model configs' ids (Qwen2.5's generation_config names <|endoftext|> as
    # ``bos_token_id``) must not then make prompts start with it, which transformers' tokenizer never does.
    tokenizer_config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    declared_none = {kind for kind in found if f"{kind}_token" in tokenizer_config
                     and tokenizer_config[f"{kind}_token"] is None}
    for config in (tokenizer_config, _read_json(os.path.join(directory, "special_tokens_map.json"))):
      for kind in found:
        tid = lookup(_token_content(config.get(f"{kind}_token")))
        if tid is not None:
          found[kind].append(tid)
    for config_name in ("generation_config.json", "config.json"):
      config = _read_json(os.path.join(directory, config_name))
      for kind in set(found) - declared_none:
        found[kind].extend(_as_id_list(config.get(f"{kind}_token_id")))
    eos = eos_id if eos_id is not None else (found["eos"][0] if found["eos"] else None)
    return cls(raw,
               pad_id=pad_id if pad_id is not None else (found["pad"][0] if found["pad"] else None),
               bos_id=bos_id if bos_id is not None else (found["bos"][0] if found["bos"] else None),
               eos_id=eos, extra_eos_ids=found["eos"], name=file)

  @property
  def raw(self) -> Any:
    """The underlying ``tokenizers.Tokenizer``."""
    return self._tok

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return self._eos_ids

  @property
  def special_ids(self) -> frozenset[int]:
    return self._special_ids

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Encodes without the tokenizer's own post-processor; BOS/EOS only when asked."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    ids = list(self._tok.encode(text, add_special_tokens=False).ids)
    if add_bos:
      if self._bos_id is None:
        raise ValueError(f"HFTokenizer {self._name!r} has no BOS token; pass bos_id or use add_bos=False")
      ids.insert(0, self._bos_id)
    if add_eos:
      ids.append(self._eos_id)
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int:
    tid = self._tok.token_to_id(token)
    if tid is None:
      raise KeyError(f"{token!r} is not a token of {self._name or 'this tokenizer'}")
    return tid

  def __repr__(self) -> str:
    return (f"HFTokenizer({self._name!r}, vocab_size={self.vocab_size}, pad_id={self._pad_id}, "
            f"bos_id={self._bos_id}, eos_ids={self._eos_ids})")


def load_tokenizer(spec: "str | os.PathLike[str] | Tokenizer", **kwargs: Any) -> Tokenizer:
  """``"byte"`` -> :class:`ByteTokenizer` (``kwargs`` go to its constructor); a path -> :class:`HFTokenizer`.

  A :class:`Tokenizer` instance is returned unchanged.
  """
  if isinstance(spec, (ByteTokenizer, HFTokenizer)):
    return spec
  if isinstance(spec, str) and spec == "byte":
    return ByteTokenizer(**kwargs)
  if isinstance(spec, (str, os.PathLike)):
    if os.path.exists(spec):
      return HFTokenizer.from_file(spec, **kwargs)
    raise ValueError(f"unknown tokenizer spec {os.fspath(spec)!r}: expected 'byte' or an existing path to a "
                     "tokenizer.json file or a directory containing one")
  if isinstance(spec, Tokenizer):
    return spec
  raise TypeError(f"tokenizer spec must be 'byte', a path or a Tokenizer, got {type(spec).__name__}")
