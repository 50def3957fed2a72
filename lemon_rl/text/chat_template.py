"""Hugging Face chat templates, rendered exactly as ``transformers``' ``apply_chat_template``.

A model directory's chat template is a Jinja program (``chat_template.jinja``, or the ``chat_template``
entry of ``tokenizer_config.json``) that turns a list of messages into the prompt text::

  template = ChatTemplate.from_dir("/path/to/Qwen2.5-0.5B-Instruct", tokenizer=tok)
  text = template.render([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
  ids = template.encode([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)

Rendering follows ``transformers.utils.chat_template_utils`` (``_compile_jinja_template`` and
``render_jinja_template``), without importing ``transformers``:

- the environment is jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks=True``,
  ``lstrip_blocks=True`` and the ``loopcontrols`` extension (``break`` / ``continue``);
- ``tojson`` is ``json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`` (no
  HTML escaping, unlike Jinja's built-in filter; ``indent=4`` gives Llama's pretty-printed tools);
- globals ``raise_exception(msg)`` (raises ``jinja2.TemplateError``), ``strftime_now(fmt)`` (the local
  date), ``dict(...)`` and a ``namespace(...)`` that refuses underscore-prefixed attributes;
- ``{% generation %}...{% endgeneration %}`` blocks render their body; :meth:`ChatTemplate.render_with_spans`
  also returns their character spans (the assistant text a training mask selects);
- the template sees ``messages`` (``None``-valued keys dropped, reasoning copied to ``reasoning_content``
  and ``thinking``), ``tools`` (JSON schemas, or ``None``), ``documents``, ``add_generation_prompt``, the
  tokenizer's named special tokens (``bos_token``, ``eos_token``, ``pad_token``, ...; strings) and every
  extra keyword (``enable_thinking=False``, ``date_string=...``), which overrides a special token of the
  same name. Everything passes through :func:`plain_template_data` first (JSON types only).

``encode`` tokenizes the rendered text with ``add_special_tokens=False`` (no BOS from a post-processor, the
template writes it): special-token strings in the text become their single ids, as in ``transformers``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Mapping
from typing import Any, Iterator, Sequence

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

from lemon_rl.text.tokenizers import _read_json, _token_content

# The named special tokens ``transformers`` passes to every template (``special_tokens_map``).
SPECIAL_TOKEN_KEYS: tuple[str, ...] = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning arrives under; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_MIN_JINJA = (3, 1, 6)  # Older jinja2 has known sandbox escapes; templates from the Hub are untrusted code.


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
  """``transformers``' ``tojson``: plain ``json.dumps`` (no HTML escaping), non-ASCII kept."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


class _TemplateDict:
  """``dict`` for templates, without attribute access to the real type."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
  """Jinja's ``namespace`` refusing underscore-prefixed (dunder) attributes."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, args = args[0], args[1:]  # Jinja's signature trick, so that ``namespace(self=...)`` works.
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check_name(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


class _GenerationTags(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}``: renders its body and, when tracking, records its span."""

  tags = {"generation"}

  def __init__(self, environment: jinja2.Environment):
    super().__init__(environment)
    self._tracking: contextvars.ContextVar = contextvars.ContextVar("lemon_rl_generation_spans", default=None)
    environment.extend(track_generation_spans=self.track)

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

  def _render_body(self, caller) -> str:
    text = caller()
    tracking = self._tracking.get()
    if tracking is not None:
      blocks, spans = tracking
      start = sum(len(b) for b in blocks)
      spans.append((start, start + len(text)))
    return text

  @contextlib.contextmanager
  def track(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
    if self._tracking.get() is not None:
      raise ValueError("generation-span tracking is already active")
    token = self._tracking.set((blocks, spans))
    try:
      yield
    finally:
      self._tracking.reset(token)


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
  """Compiles a chat template in the sandboxed environment described in the module docstring."""
  version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
  if version < _MIN_JINJA:
    raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); found {jinja2.__version__}")
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTags, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _TemplateNamespace
  return env.from_string(source)


def plain_template_data(value: Any) -> Any:
  """``value`` rebuilt from plain JSON types (what the sandbox may see); other objects become ``"<Type>"``.

  ``str`` / ``int`` / ``float`` subclasses (enums, numpy scalars) are cut back to the base type, mappings,
  lists and tuples are copied recursively, dataclasses and pydantic models become dicts.
  """
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
  if isinstance(value, list):
    return [plain_template_data(v) for v in value]
  if isinstance(value, tuple):
    return tuple(plain_template_data(v) for v in value)
  if isinstance(value, np.generic):
    return plain_template_data(value.item())
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if callable(getattr(value, "model_dump", None)):
    return plain_template_data(value.model_dump())
  return f"<{type(value).__name__}>"


def _objects_to_dicts(value: Any) -> Any:
  if isinstance(value, Mapping):
    return {k: _objects_to_dicts(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_objects_to_dicts(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_objects_to_dicts(v) for v in value)
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if callable(getattr(value, "model_dump", None)):
    return _objects_to_dicts(value.model_dump())
  return value


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
  """Messages as the template sees them.

  Message objects (dataclasses, pydantic models) become dicts; keys whose value is ``None`` are dropped
  (``content=None`` from an API must read as a missing key, not the string ``"None"``); everything is rebuilt
  from plain types; a reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` is copied to
  ``reasoning_content`` and (unless set) ``thinking``.
  """
  out = []
  for message in _objects_to_dicts(list(getattr(messages, "messages", messages))):
    if not isinstance(message, dict):
      raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, got {message!r}")
    message = plain_template_data({k: v for k, v in message.items() if v is not None})
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


def _read_text(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


class ChatTemplate:
  """A model's chat template(s), its named special tokens, and (for :meth:`encode`) its tokenizer.

  Args:
    source: the Jinja template, or ``{name: template}`` for a model with several (``"default"``, and e.g.
      ``"tool_use"``, picked when tools are given and no name is asked for).
    special_tokens: named special tokens as strings (``{"bos_token": "<|begin_of_text|>", ...}``); only
      the keys of ``SPECIAL_TOKEN_KEYS`` are passed to the template.
    tokenizer: a :class:`~lemon_rl.text.tokenizers.Tokenizer`; needed by :meth:`encode` only.
  """

  def __init__(self, source: str | Mapping[str, str], special_tokens: Mapping[str, str | None] | None = None,
               tokenizer: Any = None):
    if isinstance(source, str):
      templates = {"default": source}
    elif isinstance(source, Mapping) and source and all(isinstance(v, str) for v in source.values()):
      templates = dict(source)
    else:
      raise TypeError(f"source must be a template string or a non-empty {{name: template}} dict, got {source!r}")
    self._templates = templates
    self._special_tokens = {k: str(v) for k, v in (special_tokens or {}).items()
                            if k in SPECIAL_TOKEN_KEYS and v is not None}
    self._tokenizer = tokenizer
    for template in templates.values():
      compile_template(template)  # Syntax errors surface here, not at the first render.

  @classmethod
  def from_dir(cls, path: str | os.PathLike[str], tokenizer: Any = None) -> "ChatTemplate | None":
    """Reads a model directory's chat template(s); ``None`` when it declares none.

    As ``transformers``: ``chat_template.jinja`` (the default) and ``additional_chat_templates/*.jinja``
    take priority over the ``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of
    ``{"name", "template"}``). Special tokens come from ``tokenizer_config.json``, then (for keys it leaves
    unset) ``special_tokens_map.json``; a token may be a string or an AddedToken dict.
    """
    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    templates: dict[str, str] = {}
    default_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(default_file):
      templates["default"] = _read_text(default_file)
    extra_dir = os.path.join(directory, "additional_chat_templates")
    if os.path.isdir(extra_dir):
      for name in sorted(os.listdir(extra_dir)):
        if name.endswith(".jinja"):
          templates[name.removesuffix(".jinja")] = _read_text(os.path.join(extra_dir, name))
    if not templates:
      entry = config.get("chat_template")
      if isinstance(entry, str):
        templates["default"] = entry
      elif isinstance(entry, (list, tuple)):
        templates = {t["name"]: t["template"] for t in entry}
    if not templates:
      return None
    special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
    special: dict[str, str | None] = {}
    for key in SPECIAL_TOKEN_KEYS:
      value = _token_content(config.get(key))
      special[key] = value if value is not None else _token_content(special_map.get(key))
    return cls(templates["default"] if list(templates) == ["default"] else templates, special, tokenizer)

  @property
  def source(self) -> str | dict[str, str]:
    """The template string (or ``{name: template}`` for several)."""
    return self._templates["default"] if list(self._templates) == ["default"] else dict(self._templates)

  @property
  def special_tokens(self) -> dict[str, str]:
    return dict(self._special_tokens)

  @property
  def tokenizer(self) -> Any:
    return self._tokenizer

  def select(self, name: str | None = None, tools: Sequence[Any] | None = None) -> str:
    """The template used for a call: ``name`` if given, else ``"tool_use"`` when tools are, else the default."""
    if name is not None:
      if name not in self._templates:
        raise KeyError(f"no chat template named {name!r}; available: {sorted(self._templates)}")
      return self._templates[name]
    if tools is not None and "tool_use" in self._templates:
      return self._templates["tool_use"]
    if "default" in self._templates:
      return self._templates["default"]
    raise ValueError(f"several chat templates and no default; pass template_name (one of {sorted(self._templates)})")

  def _context(self, messages, tools, documents, add_generation_prompt, continue_final_message, kwargs):
    if tools is not None:
      for tool in tools:
        if not isinstance(tool, Mapping):
          raise TypeError(f"tools must be JSON-schema dicts ({{'type': 'function', 'function': {{...}}}}), "
                          f"got {type(tool).__name__}")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
      raise TypeError("documents must be a list of dicts (with 'title' and 'text' keys)")
    chat = normalize_messages(messages)
    if not chat:
      raise ValueError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
      raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    context = dict(
        messages=chat, tools=plain_template_data(list(tools) if tools is not None else None),
        documents=plain_template_data(list(documents) if documents is not None else None),
        add_generation_prompt=add_generation_prompt,
        **plain_template_data({**self._special_tokens, **kwargs}))
    return context

  def _continue(self, chat: list[dict[str, Any]], field: str, source: str) -> str:
    """Tags the final message's ``field`` so that the render can be cut right after its text."""
    final = chat[-1].get(field)
    if final is None:
      raise ValueError(f"continue_final_message is set but the final message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_FIELDS:
      fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in source for f in fields):
      raise ValueError(f"continue_final_message is set to {field!r} but the chat template never reads it")
    if isinstance(final, (list, tuple)):
      for block in reversed(final):
        if "text" in block:
          final = block["text"]
          block["text"] = block["text"] + _CONTINUE_TAG
          break
      else:
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    else:
      for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final

  def render_with_spans(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                        add_generation_prompt: bool = False, *, documents: Sequence[Mapping[str, Any]] | None = None,
                        continue_final_message: bool | str = False, template_name: str | None = None,
                        **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """:meth:`render`, plus the ``[start, end)`` character spans of its ``{% generation %}`` blocks."""
    source = self.select(template_name, tools)
    context = self._context(messages, tools, documents, add_generation_prompt, continue_final_message, kwargs)
    final = None
    if continue_final_message:
      field = continue_final_message if isinstance(continue_final_message, str) else "content"
      final = self._continue(context["messages"], field, source)
    template = compile_template(source)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with template.environment.track_generation_spans(blocks, spans):
      for block in template.generate(**context):
        blocks.append(block)
    text = "".join(blocks)
    if final is not None:
      if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the rendered "
                         "chat (the template rewrites it)")
      at = text.rindex(_CONTINUE_TAG.strip())
      text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text, spans

  def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
             add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """The prompt text ``apply_chat_template(messages, tools=tools, tokenize=False, ...)`` returns.

    Args:
      messages: ``[{"role": ..., "content": ..., "tool_calls": [...], "reasoning_content": ...}, ...]``.
      tools: JSON schemas (``{"type": "function", "function": {"name", "description", "parameters"}}``).
      add_generation_prompt: end with the header that opens an assistant turn.
      **kwargs: ``documents=``, ``continue_final_message=`` (``True`` or a field name: cut the render right
        after the final message's text, to continue it), ``template_name=``, and template variables
        (``enable_thinking=False``, ``date_string=...``).
    """
    return self.render_with_spans(messages, tools, add_generation_prompt, **kwargs)[0]

  def encode(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
             add_generation_prompt: bool = False, **kwargs: Any) -> list[int]:
    """The prompt ids ``apply_chat_template(..., tokenize=True)`` returns: the render, tokenized without
    added special tokens (the template writes BOS itself; special-token strings map to their ids)."""
    if self._tokenizer is None:
      raise ValueError("ChatTemplate.encode needs a tokenizer; pass tokenizer= (e.g. from load_hf_policy)")
    return self._tokenizer.encode(self.render(messages, tools, add_generation_prompt, **kwargs))

  def __repr__(self) -> str:
    return f"ChatTemplate(templates={sorted(self._templates)}, special_tokens={self._special_tokens})"
