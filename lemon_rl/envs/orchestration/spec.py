"""LEMON's executable orchestration spec: schema, parser, validator, serialiser, span maps and edits.

See METHODS.md section 4 (LEMON). An orchestrator writes one spec; this module decides whether it is valid,
where each of its fields sits (characters, then tokens) and what its counterfactual edits are.

The language. A YAML mapping with a list of agents, one flow mapping per agent, and the answer agent::

  agents:
  - {id: p, role: planner, duty: plan, cap: small}
  - {id: c, role: calculator, duty: compute units first, cap: large, deps: [p]}
  - {id: v, role: verifier, duty: verify, cap: medium, deps: [p, c]}
  answer: v

Fields of an agent (all required except ``deps``, which defaults to ``[]``):

- ``id``: ``[a-z][a-z0-9_]{0,11}``, unique, not a word YAML reads as a bool or null (``no``, ``on``, ...).
- ``role``: a base role of the :class:`Schema`'s role library; each role has a default duty.
- ``duty``: a word of the duty vocabulary, optionally followed by one space and free text (printable ASCII,
  at most ``Schema.max_duty_text`` characters, no leading or trailing space).
- ``cap``: a capacity level, ``small`` < ``medium`` < ``large`` (which worker model runs the agent).
- ``deps``: ids of EARLIER agents whose outputs this agent receives, each at most once. Order in the list
  carries no meaning for execution (parents are read in agent order).

*Decision*: the short keys ``cap`` and ``deps`` and flow-style agents keep a spec at tens of BPE tokens (the
example is 211 characters and 77 pre-tokens under GPT-2's byte-level split, the floor of any BPE with that
pre-tokenizer and what a large vocabulary reaches on these common words; a byte-level model pays one token
per character). The
serialiser always writes this canonical form; the parser accepts any YAML with the same content (block
style, quoting, comments, another key order), so spans are located in the text the orchestrator wrote.

Parsing (:func:`parse_spec`, :func:`parse_spec_with_spans`) never raises anything but :class:`SpecError` on
any input, whose ``field`` names the offending field (``"agents[1].cap"``) and ``code`` the problem
(:data:`ERROR_CODES`). Only ``yaml.SafeLoader``'s scanner, parser and composer run (no constructor: nothing
is instantiated from a tag); the input is bounded (``Schema.max_chars``), anchors and aliases are refused
(no billion laughs), nesting is bounded from the event stream before the recursive composer runs, and every
scalar must be a YAML string (``5``, ``true``, ``null``, ``!tag x`` are type errors).

Spans. A field path is a tuple: ``("agents", i)`` (the agent's mapping), ``("agents", i, key)`` for
``key in ("id", "role", "duty", "cap", "deps")``, ``("agents", i, "deps", j)`` (the j-th dependency) and
``("answer",)``. A span is a half-open character range ``[start, end)`` of the scalar (quotes included when
quoted) or collection as YAML marks it. :func:`serialize` returns the canonical text with the spans of every
field, and ``parse_spec_with_spans(text)`` finds the same spans in it. :func:`char_to_token_spans` maps
character spans to token spans for any :class:`~lemon_rl.text.Tokenizer`: the smallest token range
``[a, b)`` whose tokens produce every character of the span.

Edits (METHODS.md section 4): :func:`drop_edge`, :func:`reset_duty` and :func:`lower_capacity` are pure
``Spec -> Spec`` functions; :func:`enumerate_edits` lists every applicable edit of each family with the path
of the edited field in the original spec (whose tokens get the counterfactual credit) and in the edited one.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import re
from typing import Iterable, Mapping, NamedTuple, Sequence

import yaml

FieldPath = tuple  # ("agents", i, "cap"), ("agents", i, "deps", j), ("answer",), ...
Span = tuple[int, int]
Spans = dict  # FieldPath -> Span

AGENT_KEYS = ("id", "role", "duty", "cap", "deps")
REQUIRED_AGENT_KEYS = ("id", "role", "duty", "cap")
ROOT_KEYS = ("agents", "answer")
EDIT_FAMILIES = ("drop_edge", "reset_duty", "lower_capacity")  # as in lemon_rl.losses.counterfactual

# Every SpecError.code.
ERROR_CODES = (
    "not_text", "too_long", "not_yaml", "anchor", "too_deep", "empty", "not_mapping", "unknown_field",
    "duplicate_field", "missing_field", "wrong_type", "no_agents", "too_many_agents", "bad_id", "duplicate_id",
    "unknown_role", "unknown_duty", "bad_duty_text", "bad_capacity", "self_dependency", "missing_agent",
    "later_agent", "cycle", "duplicate_dependency", "no_answer", "unknown_answer")

# Role library: base role -> its default duty (what "reset the duty to the base role" restores).
DEFAULT_ROLES: Mapping[str, str] = {
    "planner": "plan",
    "extractor": "extract",
    "solver": "solve",
    "calculator": "compute",
    "verifier": "verify",
    "critic": "critique",
    "aggregator": "aggregate",
    "summarizer": "summarize",
}
DEFAULT_DUTIES = ("plan", "extract", "solve", "compute", "verify", "critique", "aggregate", "summarize",
                  "explain", "format")
CAPACITIES = ("small", "medium", "large")

_ID_RE = re.compile(r"[a-z][a-z0-9_]{0,11}")
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
_FREE_TEXT_RE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
_STR_TAG = "tag:yaml.org,2002:str"
# A spec nests 4 collections (root map > agents list > agent map > deps list); a little more is read so that
# a list in the wrong place gets a type error; deeper input is refused before the recursive composer runs.
_MAX_DEPTH = 8
_RESOLVER = yaml.resolver.Resolver()


class SpecError(ValueError):
  """An invalid spec. ``field``: the offending field (``""`` for the whole text); ``code``: one of
  :data:`ERROR_CODES`; ``span``: its character span in the parsed text when known."""

  def __init__(self, field: str, code: str, message: str, span: Span | None = None):
    super().__init__(f"{field}: {message}" if field else message)
    self.field = field
    self.code = code
    self.message = message
    self.span = span


def _plain_str(word: str) -> bool:
  """Whether YAML reads the plain scalar ``word`` as a string (not a bool, null, number...)."""
  return _RESOLVER.resolve(yaml.ScalarNode, word, (True, False)) == _STR_TAG


@dataclasses.dataclass(frozen=True)
class Schema:
  """What a valid spec may contain.

  Attributes:
    roles: base role -> its default duty (a word of ``duties``).
    duties: the duty vocabulary.
    capacities: capacity levels, lowest first.
    max_agents: most agents in a spec.
    max_duty_text: most characters of a duty's free text (after the duty word and one space).
    max_chars: longest spec text the parser reads at all.
  """

  roles: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_ROLES))
  duties: tuple[str, ...] = DEFAULT_DUTIES
  capacities: tuple[str, ...] = CAPACITIES
  max_agents: int = 8
  max_duty_text: int = 48
  max_chars: int = 4096

  def __post_init__(self):
    object.__setattr__(self, "roles", dict(self.roles))
    object.__setattr__(self, "duties", tuple(self.duties))
    object.__setattr__(self, "capacities", tuple(self.capacities))
    for kind, names in (("role", self.roles), ("duty", self.duties), ("capacity", self.capacities)):
      if not names or len(set(names)) != len(names):
        raise ValueError(f"Schema: the {kind} names must be non-empty and distinct, got {list(names)}")
      for name in names:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or not _plain_str(name):
          raise ValueError(f"Schema: {kind} {name!r} must match [a-z][a-z0-9_]* and read as a YAML string")
    for role, duty in self.roles.items():
      if duty not in self.duties:
        raise ValueError(f"Schema: the default duty {duty!r} of role {role!r} is not in the duty vocabulary")
    if self.max_agents < 1 or self.max_duty_text < 0 or self.max_chars < 1:
      raise ValueError(f"Schema: bad limits max_agents={self.max_agents}, max_duty_text={self.max_duty_text}, "
                       f"max_chars={self.max_chars}")

  def __hash__(self):
    return hash((tuple(self.roles.items()), self.duties, self.capacities, self.max_agents,
                 self.max_duty_text, self.max_chars))


DEFAULT_SCHEMA = Schema()


@dataclasses.dataclass(frozen=True)
class Agent:
  """One agent of a spec; ``depends_on`` holds ids of earlier agents (a tuple)."""

  id: str
  role: str
  duty: str
  capacity: str
  depends_on: tuple[str, ...] = ()

  def __post_init__(self):
    if isinstance(self.depends_on, (list, tuple)):
      object.__setattr__(self, "depends_on", tuple(self.depends_on))

  @property
  def duty_word(self) -> str:
    """The duty's vocabulary word (the text before the first space)."""
    return self.duty.split(" ", 1)[0]


@dataclasses.dataclass(frozen=True)
class Spec:
  """A parsed orchestration spec: agents in order (every dependency points to an earlier one) and the id of
  the answer agent, whose output is the spec's answer."""

  agents: tuple[Agent, ...]
  answer: str

  def __post_init__(self):
    if isinstance(self.agents, (list, tuple)):
      object.__setattr__(self, "agents", tuple(self.agents))

  def index(self, agent_id: str) -> int:
    """Position of the agent with this id (``ValueError`` if none)."""
    for i, agent in enumerate(self.agents):
      if agent.id == agent_id:
        return i
    raise ValueError(f"no agent {agent_id!r} in the spec")

  @property
  def num_edges(self) -> int:
    return sum(len(a.depends_on) for a in self.agents)


def field_name(path: FieldPath) -> str:
  """``("agents", 1, "deps", 0)`` -> ``"agents[1].deps[0]"``."""
  out = ""
  for part in path:
    out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
  return out


# ---------------------------------------------------------------------------------------------------
# Validation (shared by the parser and by specs built in code).
# ---------------------------------------------------------------------------------------------------


def _fail(path: FieldPath, code: str, message: str, spans: Mapping | None = None):
  raise SpecError(field_name(path), code, message, (spans or {}).get(path))


def validate_spec(spec: Spec, schema: Schema = DEFAULT_SCHEMA, spans: Mapping | None = None) -> Spec:
  """Returns ``spec`` if it is valid under ``schema``, else raises :class:`SpecError` on its first problem.

  ``spans`` (from the parser) only decorate the error with the offending field's span.
  """
  if not isinstance(spec, Spec):
    raise SpecError("", "wrong_type", f"expected a Spec, got {type(spec).__name__}")
  agents = spec.agents
  if not agents:
    _fail(("agents",), "no_agents", "a spec needs at least one agent", spans)
  if len(agents) > schema.max_agents:
    _fail(("agents",), "too_many_agents", f"{len(agents)} agents, at most {schema.max_agents} allowed", spans)
  position: dict[str, int] = {}
  for i, agent in enumerate(agents):
    path = ("agents", i)
    if not isinstance(agent, Agent):
      _fail(path, "wrong_type", f"must be an Agent, got {type(agent).__name__}", spans)
    for key, value in (("id", agent.id), ("role", agent.role), ("duty", agent.duty), ("cap", agent.capacity)):
      if not isinstance(value, str):
        _fail(path + (key,), "wrong_type", f"must be a string, got {type(value).__name__}", spans)
    if not _ID_RE.fullmatch(agent.id) or not _plain_str(agent.id):
      _fail(path + ("id",), "bad_id", f"bad id {agent.id!r}: ids match [a-z][a-z0-9_]{{0,11}} and are not "
            "YAML bool/null words", spans)
    if agent.id in position:
      _fail(path + ("id",), "duplicate_id", f"duplicate id {agent.id!r} (also agents[{position[agent.id]}])",
            spans)
    position[agent.id] = i
    if agent.role not in schema.roles:
      _fail(path + ("role",), "unknown_role", f"unknown role {agent.role!r} (roles: {', '.join(schema.roles)})",
            spans)
    word, sep, text = agent.duty.partition(" ")
    if word not in schema.duties:
      _fail(path + ("duty",), "unknown_duty", f"unknown duty {word!r} (duties: {', '.join(schema.duties)})",
            spans)
    if sep and (len(text) > schema.max_duty_text or not _FREE_TEXT_RE.fullmatch(text)):
      _fail(path + ("duty",), "bad_duty_text", f"the free text after {word!r} must be 1-{schema.max_duty_text} "
            "printable ASCII characters without leading or trailing spaces", spans)
    if agent.capacity not in schema.capacities:
      _fail(path + ("cap",), "bad_capacity",
            f"bad capacity {agent.capacity!r} (capacities: {', '.join(schema.capacities)})", spans)
  for i, agent in enumerate(agents):
    if not isinstance(agent.depends_on, tuple):
      _fail(("agents", i, "deps"), "wrong_type", "must be a tuple of agent ids", spans)
    seen = set()
    for j, dep in enumerate(agent.depends_on):
      path = ("agents", i, "deps", j)
      if not isinstance(dep, str):
        _fail(path, "wrong_type", f"must be a string, got {type(dep).__name__}", spans)
      if dep in seen:
        _fail(path, "duplicate_dependency", f"{agent.id!r} lists {dep!r} twice", spans)
      seen.add(dep)
      if dep == agent.id:
        _fail(path, "self_dependency", f"cycle: {agent.id!r} depends on itself", spans)
      if dep not in position:
        _fail(path, "missing_agent", f"{agent.id!r} depends on {dep!r}, which is not an agent", spans)
      if position[dep] > i:
        cycle = _path_between(agents, position, dep, agent.id)
        if cycle:
          _fail(path, "cycle", "cycle: " + " -> ".join([agent.id, *cycle]) + " (dependencies must be earlier "
                "agents)", spans)
        _fail(path, "later_agent", f"{agent.id!r} depends on {dep!r}, which comes later (agents[{position[dep]}]);"
              " dependencies must be earlier agents", spans)
  if not isinstance(spec.answer, str):
    _fail(("answer",), "wrong_type", f"must be a string, got {type(spec.answer).__name__}", spans)
  if spec.answer not in position:
    _fail(("answer",), "unknown_answer", f"the answer {spec.answer!r} is not an agent id", spans)
  return spec


def _path_between(agents, position, start: str, goal: str) -> list[str] | None:
  """Ids ``[start, ..., goal]`` along dependency links from ``start`` to ``goal`` (depth-first), or None."""
  stack, parent = [start], {start: None}
  while stack:
    node = stack.pop()
    if node == goal:
      out = [node]
      while parent[out[-1]] is not None:
        out.append(parent[out[-1]])
      return out[::-1]
    for dep in agents[position[node]].depends_on:
      if isinstance(dep, str) and dep in position and dep not in parent:
        parent[dep] = node
        stack.append(dep)
  return None


# ---------------------------------------------------------------------------------------------------
# Parsing.
# ---------------------------------------------------------------------------------------------------


def _yaml_problem(err: yaml.YAMLError) -> str:
  parts = [getattr(err, "context", None), getattr(err, "problem", None)]
  problem = ", ".join(p for p in parts if p) or str(err).split("\n")[0]
  mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
  return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else str(problem)


def _compose(text: str, schema: Schema) -> yaml.Node | None:
  """The YAML node tree of ``text`` after the size, anchor and depth guards (SpecError on any problem)."""
  if not isinstance(text, str):
    raise SpecError("", "not_text", f"a spec is text (str), got {type(text).__name__}")
  if len(text) > schema.max_chars:
    raise SpecError("", "too_long", f"{len(text)} characters, at most {schema.max_chars} allowed")
  try:
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):  # An iterative state machine: no recursion.
      if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
        raise SpecError("", "anchor", "YAML anchors and aliases (&x, *x) are not allowed in a spec")
      if isinstance(event, yaml.CollectionStartEvent):
        depth += 1
        if depth > _MAX_DEPTH:
          raise SpecError("", "too_deep",
                          f"nested deeper than {_MAX_DEPTH} levels (a spec nests 4: root > agents > agent > deps)")
      elif isinstance(event, yaml.CollectionEndEvent):
        depth -= 1
    return yaml.compose(text, Loader=yaml.SafeLoader)
  except yaml.YAMLError as err:
    raise SpecError("", "not_yaml", f"not valid YAML: {_yaml_problem(err)}") from None
  except RecursionError:  # Defensive: the depth guard above should make this unreachable.
    raise SpecError("", "too_deep", "nested too deeply") from None


def _node_span(node: yaml.Node) -> Span:
  return node.start_mark.index, node.end_mark.index


def _kind(node: yaml.Node) -> str:
  if isinstance(node, yaml.MappingNode):
    return "a mapping"
  if isinstance(node, yaml.SequenceNode):
    return "a list"
  tag = node.tag.rsplit(":", 1)[-1] if node.tag.startswith("tag:yaml.org,2002:") else node.tag
  value = node.value if len(node.value) <= 40 else node.value[:37] + "..."
  return f"{tag} {value!r}" if value else tag


def _string(node: yaml.Node, path: FieldPath) -> str:
  if not isinstance(node, yaml.ScalarNode) or node.tag != _STR_TAG:
    raise SpecError(field_name(path), "wrong_type", f"must be a string, got {_kind(node)}", _node_span(node))
  return node.value


def _fields(node: yaml.Node, path: FieldPath, allowed: Sequence[str], required: Sequence[str],
            what: str) -> dict[str, yaml.Node]:
  """The ``key -> value node`` of a mapping node with checked keys."""
  if not isinstance(node, yaml.MappingNode):
    raise SpecError(field_name(path), "not_mapping", f"{what} must be a mapping, got {_kind(node)}",
                    _node_span(node))
  out: dict[str, yaml.Node] = {}
  for key_node, value_node in node.value:
    if not isinstance(key_node, yaml.ScalarNode):
      raise SpecError(field_name(path), "wrong_type", f"keys must be strings, got {_kind(key_node)}",
                      _node_span(key_node))
    key = key_node.value
    if key not in allowed:
      hint = {"capacity": " (did you mean 'cap'?)", "depends_on": " (did you mean 'deps'?)"}.get(key, "")
      raise SpecError(field_name(path + (key,)), "unknown_field",
                      f"unknown field {key!r}{hint} (fields: {', '.join(allowed)})", _node_span(key_node))
    if key in out:
      raise SpecError(field_name(path + (key,)), "duplicate_field", f"field {key!r} given twice",
                      _node_span(key_node))
    out[key] = value_node
  for key in required:
    if key not in out:
      code = "no_answer" if key == "answer" else "missing_field"
      message = ("no answer node: add 'answer: <agent id>'" if key == "answer" else f"missing field {key!r}")
      raise SpecError(field_name(path + (key,)), code, message, _node_span(node))
  return out


def parse_spec_with_spans(text: str, schema: Schema = DEFAULT_SCHEMA) -> tuple[Spec, Spans]:
  """Parses and validates ``text``; returns the spec and the character span of every field in ``text``.

  Raises:
    SpecError: on any problem whatsoever (and nothing else, whatever ``text`` is).
  """
  root = _compose(text, schema)
  if root is None:
    raise SpecError("", "empty", "the spec is empty: expected 'agents: [...]' and 'answer: <id>'")
  top = _fields(root, (), ROOT_KEYS, ROOT_KEYS, "the spec")
  spans: Spans = {}
  agents_node = top["agents"]
  if not isinstance(agents_node, yaml.SequenceNode):
    raise SpecError("agents", "wrong_type", f"must be a list of agents, got {_kind(agents_node)}",
                    _node_span(agents_node))
  if len(agents_node.value) > schema.max_agents:
    raise SpecError("agents", "too_many_agents",
                    f"{len(agents_node.value)} agents, at most {schema.max_agents} allowed", _node_span(agents_node))
  agents = []
  for i, agent_node in enumerate(agents_node.value):
    path = ("agents", i)
    fields = _fields(agent_node, path, AGENT_KEYS, REQUIRED_AGENT_KEYS, "an agent")
    spans[path] = _node_span(agent_node)
    values = {}
    for key in REQUIRED_AGENT_KEYS:
      values[key] = _string(fields[key], path + (key,))
      spans[path + (key,)] = _node_span(fields[key])
    deps = []
    if "deps" in fields:
      deps_node = fields["deps"]
      if not isinstance(deps_node, yaml.SequenceNode):
        raise SpecError(field_name(path + ("deps",)), "wrong_type",
                        f"must be a list of agent ids like [a, b], got {_kind(deps_node)}", _node_span(deps_node))
      spans[path + ("deps",)] = _node_span(deps_node)
      for j, dep_node in enumerate(deps_node.value):
        deps.append(_string(dep_node, path + ("deps", j)))
        spans[path + ("deps", j)] = _node_span(dep_node)
    agents.append(Agent(values["id"], values["role"], values["duty"], values["cap"], tuple(deps)))
  answer = _string(top["answer"], ("answer",))
  spans[("answer",)] = _node_span(top["answer"])
  spec = Spec(tuple(agents), answer)
  validate_spec(spec, schema, spans)
  return spec, spans


def parse_spec(text: str, schema: Schema = DEFAULT_SCHEMA) -> Spec:
  """Parses and validates a spec text; raises :class:`SpecError` (only) on any problem."""
  return parse_spec_with_spans(text, schema)[0]


# ---------------------------------------------------------------------------------------------------
# Serialisation and span maps.
# ---------------------------------------------------------------------------------------------------


def _duty_scalar(duty: str) -> str:
  """``duty`` as written in a flow mapping: plain when YAML reads it back unchanged there, else quoted.

  A valid duty is printable ASCII, so ``json.dumps`` escapes only ``"`` and ``\\`` (both valid YAML
  double-quoted escapes).
  """
  try:
    if yaml.safe_load("{d: " + duty + "}") == {"d": duty}:
      return duty
  except yaml.YAMLError:
    pass
  return json.dumps(duty)


def serialize(spec: Spec, schema: Schema = DEFAULT_SCHEMA) -> tuple[str, Spans]:
  """The canonical text of a valid spec and the character span of every field in it.

  ``parse_spec_with_spans(text)`` gives back ``(spec, spans)`` exactly. Raises :class:`SpecError` for an
  invalid ``spec``.
  """
  validate_spec(spec, schema)
  parts: list[str] = []
  spans: Spans = {}
  pos = 0

  def put(piece: str, path: FieldPath | None = None):
    nonlocal pos
    if path is not None:
      spans[path] = (pos, pos + len(piece))
    parts.append(piece)
    pos += len(piece)

  put("agents:\n")
  for i, agent in enumerate(spec.agents):
    path = ("agents", i)
    put("- ")
    start = pos
    put("{id: ")
    put(agent.id, path + ("id",))
    put(", role: ")
    put(agent.role, path + ("role",))
    put(", duty: ")
    put(_duty_scalar(agent.duty), path + ("duty",))
    put(", cap: ")
    put(agent.capacity, path + ("cap",))
    if agent.depends_on:
      put(", deps: ")
      deps_start = pos
      put("[")
      for j, dep in enumerate(agent.depends_on):
        put(", " if j else "")
        put(dep, path + ("deps", j))
      put("]")
      spans[path + ("deps",)] = (deps_start, pos)
    put("}")
    spans[path] = (start, pos)
    put("\n")
  put("answer: ")
  put(spec.answer, ("answer",))
  return "".join(parts), spans


def _prefix_counts(tokenizer, ids: Sequence[int], text: str) -> tuple[list[int], list[int]]:
  """``started[k]`` and ``complete[k]``: how many characters of ``text`` the first ``k`` tokens begin and finish.

  ``decode(ids[:k])`` (special tokens kept) is compared with ``text``: the characters it agrees on are
  complete; the ones it reaches are started (a partial UTF-8 character decodes to U+FFFD, which reaches its
  position but does not agree with it). Both are kept non-decreasing in ``k``.
  """
  started, complete = [0], [0]
  for k in range(1, len(ids) + 1):
    prefix = tokenizer.decode(ids[:k], skip_special_tokens=False)
    agree, reach = complete[-1], min(len(prefix), len(text))
    while agree < reach and prefix[agree] == text[agree]:
      agree += 1
    complete.append(max(complete[-1], agree))
    started.append(max(started[-1], reach))
  if complete[-1] != len(text):
    raise ValueError(f"the token ids decode to {tokenizer.decode(ids, skip_special_tokens=False)!r}, which "
                     f"does not start with the text {text!r}")
  return started, complete


def token_char_ranges(tokenizer, ids: Sequence[int], text: str | None = None) -> list[Span]:
  """For each token ``k``, the characters ``[complete[k], started[k + 1])`` of ``text`` it helps produce.

  By incremental decoding (:func:`_prefix_counts`), so it holds for any tokenizer whose decoding of a prefix
  of the ids is a prefix of the text up to a partial last character (bytes, byte-level BPE). A character
  split over several tokens (a multi-byte character in byte tokens) belongs to each of them. Cost: one
  ``decode`` per prefix (quadratic in the length; specs are short).

  Args:
    tokenizer: a :class:`~lemon_rl.text.Tokenizer`.
    ids: token ids (e.g. a sampled completion, never re-tokenised).
    text: their text (default ``decode(ids, skip_special_tokens=False)``).
  """
  ids = [int(i) for i in ids]
  if text is None:
    text = tokenizer.decode(ids, skip_special_tokens=False)
  started, complete = _prefix_counts(tokenizer, ids, text)
  return [(complete[k], started[k + 1]) for k in range(len(ids))]


def char_to_token_spans(spans: Mapping[FieldPath, Span], text: str, tokenizer,
                        ids: Sequence[int] | None = None) -> dict[FieldPath, Span]:
  """Maps character spans of ``text`` to token spans: the smallest ``[a, b)`` whose tokens produce them.

  Args:
    spans: ``path -> (start, end)`` character spans (non-empty, inside ``text``).
    text: the text the spans index.
    tokenizer: any :class:`~lemon_rl.text.Tokenizer`.
    ids: token ids whose decoding starts with ``text`` (e.g. a sampled completion as sampled, never
      re-tokenised; a trailing EOS or padding is fine); default ``tokenizer.encode(text)``.

  Returns:
    ``path -> (a, b)``: ``a`` is the token that starts character ``start`` (the first ``k`` with
    ``started[k + 1] > start``) and ``b - 1`` the one that completes character ``end - 1`` (``b`` the first
    ``k`` with ``complete[k] >= end``); see :func:`token_char_ranges`.
  """
  ids = [int(i) for i in (tokenizer.encode(text) if ids is None else ids)]
  started, complete = _prefix_counts(tokenizer, ids, text)
  out = {}
  for path, (start, end) in spans.items():
    if not 0 <= start < end <= len(text):
      raise ValueError(f"span {field_name(path)}={start, end} is empty or outside the text ({len(text)} chars)")
    a = bisect.bisect_right(started, start) - 1  # started[a] <= start < started[a + 1]
    b = bisect.bisect_left(complete, end)  # the first k with complete[k] >= end
    out[path] = (a, b)
  return out


# ---------------------------------------------------------------------------------------------------
# Counterfactual edits.
# ---------------------------------------------------------------------------------------------------


class Edit(NamedTuple):
  """One counterfactual edit of a spec.

  Attributes:
    family: one of :data:`EDIT_FAMILIES`.
    agent: index of the edited agent.
    dep: index in ``depends_on`` of the dropped dependency (``drop_edge``), else None.
    spec: the edited spec.
    path: the edited field in the ORIGINAL spec (its tokens get the credit ``dc``): ``("agents", i, "deps",
      dep)``, ``("agents", i, "duty")`` or ``("agents", i, "cap")``.
    edited_path: the edited field in the edited spec: the duty or capacity; for a dropped edge the agent's
      remaining ``("agents", i, "deps")`` list, or the whole agent ``("agents", i)`` when none remains
      (an empty ``deps`` is not written).
  """

  family: str
  agent: int
  dep: int | None
  spec: Spec
  path: FieldPath
  edited_path: FieldPath


def _replace_agent(spec: Spec, i: int, **changes) -> Spec:
  if not 0 <= i < len(spec.agents):
    raise IndexError(f"agent index {i} outside [0, {len(spec.agents)})")
  agents = list(spec.agents)
  agents[i] = dataclasses.replace(agents[i], **changes)
  return Spec(tuple(agents), spec.answer)


def drop_edge(spec: Spec, agent: int, dep: int) -> Spec:
  """``spec`` without the ``dep``-th dependency of agent ``agent`` (still valid: no agent or answer moves)."""
  deps = spec.agents[agent].depends_on
  if not 0 <= dep < len(deps):
    raise IndexError(f"agents[{agent}] has {len(deps)} dependencies, no index {dep}")
  return _replace_agent(spec, agent, depends_on=deps[:dep] + deps[dep + 1:])


def reset_duty(spec: Spec, agent: int, schema: Schema = DEFAULT_SCHEMA) -> Spec:
  """``spec`` with agent ``agent``'s duty reset to its base role's default duty (no free text)."""
  a = spec.agents[agent]
  default = schema.roles[a.role]
  if a.duty == default:
    raise ValueError(f"agents[{agent}] already has its role's default duty {default!r}")
  return _replace_agent(spec, agent, duty=default)


def lower_capacity(spec: Spec, agent: int, schema: Schema = DEFAULT_SCHEMA) -> Spec:
  """``spec`` with agent ``agent``'s capacity one level lower."""
  level = schema.capacities.index(spec.agents[agent].capacity)
  if level == 0:
    raise ValueError(f"agents[{agent}] already has the lowest capacity {schema.capacities[0]!r}")
  return _replace_agent(spec, agent, capacity=schema.capacities[level - 1])


def enumerate_edits(spec: Spec, schema: Schema = DEFAULT_SCHEMA,
                    families: Iterable[str] = EDIT_FAMILIES) -> list[Edit]:
  """Every applicable edit of each family, families in the given order, then agents and dependencies."""
  edits = []
  for family in families:
    if family not in EDIT_FAMILIES:
      raise ValueError(f"unknown edit family {family!r} (families: {', '.join(EDIT_FAMILIES)})")
    for i, agent in enumerate(spec.agents):
      if family == "drop_edge":
        for j in range(len(agent.depends_on)):
          edited_path = ("agents", i, "deps") if len(agent.depends_on) > 1 else ("agents", i)
          edits.append(Edit(family, i, j, drop_edge(spec, i, j), ("agents", i, "deps", j), edited_path))
      elif family == "reset_duty" and agent.duty != schema.roles[agent.role]:
        edits.append(Edit(family, i, None, reset_duty(spec, i, schema), ("agents", i, "duty"),
                          ("agents", i, "duty")))
      elif family == "lower_capacity" and schema.capacities.index(agent.capacity) > 0:
        edits.append(Edit(family, i, None, lower_capacity(spec, i, schema), ("agents", i, "cap"),
                          ("agents", i, "cap")))
  return edits
