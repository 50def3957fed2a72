"""LEMON's spec language: validator messages, fuzzing, serialiser round trips, span maps and edits."""

import dataclasses

import hypothesis
import pytest
import tokenizers as hf
import yaml
from hypothesis import strategies as st

from lemon_rl.envs.orchestration import spec as spec_lib
from lemon_rl.envs.orchestration.spec import (DEFAULT_SCHEMA, EDIT_FAMILIES, ERROR_CODES, Agent, Schema, Spec,
                                              SpecError, char_to_token_spans, enumerate_edits,
                                              parse_spec, parse_spec_with_spans, serialize, token_char_ranges,
                                              validate_spec)
from lemon_rl.text import ByteTokenizer, HFTokenizer

EXAMPLE = """agents:
- {id: p, role: planner, duty: plan, cap: small}
- {id: c, role: calculator, duty: compute units first, cap: large, deps: [p]}
- {id: v, role: verifier, duty: verify, cap: medium, deps: [p, c]}
answer: v"""

EXAMPLE_SPEC = Spec((Agent("p", "planner", "plan", "small"),
                     Agent("c", "calculator", "compute units first", "large", ("p",)),
                     Agent("v", "verifier", "verify", "medium", ("p", "c"))), "v")


def _agent(i="a", role="planner", duty="plan", cap="small", deps=None):
  deps_part = f", deps: {deps}" if deps is not None else ""
  return f"- {{id: {i}, role: {role}, duty: {duty}, cap: {cap}{deps_part}}}\n"


def _spec(*agents, answer="answer: a"):
  return "agents:\n" + "".join(agents) + answer


# (text, code, field, a fragment of the message)
MALFORMED = [
    ("", "empty", "", "empty"),
    ("# only a comment\n", "empty", "", "empty"),
    ("agents: [", "not_yaml", "", "not valid YAML"),
    ("{a: 1}\n---\n{b: 2}", "not_yaml", "", "single document"),
    ("- a\n- b", "not_mapping", "", "the spec must be a mapping, got a list"),
    ("just text", "not_mapping", "", "got str"),
    ("agents: [a]\nanswer: a\nextra: 1", "unknown_field", "extra", "unknown field 'extra'"),
    ("answer: a", "missing_field", "agents", "missing field 'agents'"),
    (_spec(_agent(), answer=""), "no_answer", "answer", "no answer node"),
    (_spec(_agent(), answer="answer: b"), "unknown_answer", "answer", "'b' is not an agent id"),
    (_spec(_agent(), answer="answer: [a]"), "wrong_type", "answer", "must be a string, got a list"),
    ("agents: {a: 1}\nanswer: a", "wrong_type", "agents", "must be a list of agents"),
    ("agents: []\nanswer: a", "no_agents", "agents", "at least one agent"),
    (_spec(*[_agent(f"a{i}") for i in range(9)]), "too_many_agents", "agents", "9 agents, at most 8"),
    (_spec("- [a, planner]\n"), "not_mapping", "agents[0]", "an agent must be a mapping"),
    (_spec("- {id: a, role: planner, duty: plan}\n"), "missing_field", "agents[0].cap", "missing field 'cap'"),
    (_spec("- {id: a, role: planner, duty: plan, cap: small, cap: large}\n"), "duplicate_field", "agents[0].cap",
     "given twice"),
    (_spec("- {id: a, role: planner, duty: plan, capacity: small}\n"), "unknown_field", "agents[0].capacity",
     "did you mean 'cap'"),
    (_spec("- {id: a, role: planner, duty: plan, cap: small, depends_on: []}\n"), "unknown_field",
     "agents[0].depends_on", "did you mean 'deps'"),
    (_spec(_agent(role="coder")), "unknown_role", "agents[0].role", "unknown role 'coder' (roles: planner"),
    (_spec(_agent(duty="dance")), "unknown_duty", "agents[0].duty", "unknown duty 'dance' (duties: plan"),
    (_spec(_agent(duty="'plan  twice'")), "bad_duty_text", "agents[0].duty", "printable ASCII"),
    (_spec(_agent(duty="plan " + "x" * 49)), "bad_duty_text", "agents[0].duty", "1-48"),
    (_spec(_agent(duty='"plan caf\\u00e9"')), "bad_duty_text", "agents[0].duty", "printable ASCII"),
    (_spec(_agent(cap="huge")), "bad_capacity", "agents[0].cap", "bad capacity 'huge' (capacities: small"),
    (_spec(_agent(cap="3")), "wrong_type", "agents[0].cap", "must be a string, got int '3'"),
    (_spec(_agent(cap="")), "wrong_type", "agents[0].cap", "got null"),
    (_spec(_agent(i="yes"), answer="answer: 'yes'"), "wrong_type", "agents[0].id", "got bool 'yes'"),
    (_spec(_agent(i="'yes'"), answer="answer: 'yes'"), "bad_id", "agents[0].id", "YAML bool/null"),
    (_spec(_agent(i="Alpha"), answer="answer: Alpha"), "bad_id", "agents[0].id", "bad id 'Alpha'"),
    (_spec(_agent(i="!!str 12"), answer="answer: '12'"), "bad_id", "agents[0].id", "bad id '12'"),
    (_spec(_agent(i="!custom a")), "wrong_type", "agents[0].id", "must be a string, got !custom"),
    (_spec(_agent(), _agent()), "duplicate_id", "agents[1].id", "duplicate id 'a' (also agents[0])"),
    (_spec(_agent(deps="a")), "wrong_type", "agents[0].deps", "must be a list of agent ids"),
    (_spec(_agent(deps="[a]")), "self_dependency", "agents[0].deps[0]", "cycle: 'a' depends on itself"),
    (_spec(_agent(deps="[zz]")), "missing_agent", "agents[0].deps[0]", "'zz', which is not an agent"),
    (_spec(_agent(deps="[b]"), _agent("b")), "later_agent", "agents[0].deps[0]",
     "'b', which comes later (agents[1])"),
    (_spec(_agent(deps="[c]"), _agent("b", deps="[a]"), _agent("c", deps="[b]")), "cycle", "agents[0].deps[0]",
     "cycle: a -> c -> b -> a"),
    (_spec(_agent(), _agent("b", deps="[a, a]"), answer="answer: b"), "duplicate_dependency",
     "agents[1].deps[1]", "lists 'a' twice"),
    (_spec(_agent(deps="[[a]]")), "wrong_type", "agents[0].deps[0]", "must be a string, got a list"),
    ("a: &x [1]\nb: *x", "anchor", "", "anchors and aliases"),
    ("agents: &x\n- {id: a, role: planner, duty: plan, cap: small}\nanswer: a", "anchor", "", "anchors"),
    ("agents: [[[[[[[[a]]]]]]]]\nanswer: a", "too_deep", "", "nested deeper than 8"),
    ("x" * 5000, "too_long", "", "5000 characters, at most 4096"),
    ("agents: []\x00", "not_yaml", "", "special characters are not allowed"),
]


@pytest.mark.parametrize("text,code,field,fragment", MALFORMED)
def test_malformed_specs_get_the_right_message(text, code, field, fragment):
  with pytest.raises(SpecError) as info:
    parse_spec(text)
  err = info.value
  assert (err.code, err.field) == (code, field), str(err)
  assert fragment in str(err)
  assert err.code in ERROR_CODES
  assert str(err).startswith(f"{field}: " if field else err.message)


def test_error_spans_point_at_the_offending_field():
  text = _spec(_agent(), _agent("b", role="coder", deps="[a]"), answer="answer: b")
  with pytest.raises(SpecError) as info:
    parse_spec(text)
  start, end = info.value.span
  assert text[start:end] == "coder"
  text = _spec(_agent(), _agent("b", deps="[a, zz]"), answer="answer: b")
  with pytest.raises(SpecError) as info:
    parse_spec(text)
  assert text[slice(*info.value.span)] == "zz"


@pytest.mark.parametrize("bad", [None, b"agents: []", 5, ["agents"]])
def test_non_text_is_a_spec_error(bad):
  with pytest.raises(SpecError, match="a spec is text"):
    parse_spec(bad)


def test_billion_laughs_and_deep_nesting_are_refused_quickly():
  laughs = "a: &a [lol, lol]\n" + "".join(f"{c}: &{c} [*{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
  with pytest.raises(SpecError, match="aliases"):
    parse_spec(laughs)
  roomy = Schema(max_chars=10**6)  # The depth guard, not the length limit, stops these before any recursion.
  for deep in ("[" * 100_000, "- " * 50_000 + "a", "{a: " * 20_000 + "1" + "}" * 20_000):
    with pytest.raises(SpecError) as info:
      parse_spec(deep, roomy)
    assert info.value.code == "too_deep"


def test_canonical_example_round_trips_exactly():
  assert parse_spec(EXAMPLE) == EXAMPLE_SPEC
  text, spans = serialize(EXAMPLE_SPEC)
  assert text == EXAMPLE
  assert parse_spec_with_spans(text)[1] == spans
  assert text[slice(*spans[("agents", 1, "duty")])] == "compute units first"
  assert text[slice(*spans[("agents", 2, "deps", 1)])] == "c"
  assert text[slice(*spans[("agents", 2, "deps")])] == "[p, c]"
  assert text[slice(*spans[("agents", 0)])] == "{id: p, role: planner, duty: plan, cap: small}"
  assert text[slice(*spans[("answer",)])] == "v"


def test_any_yaml_layout_parses_to_the_same_spec_with_spans_in_its_own_text():
  block = """# a team of three
agents:
  - id: p        # first
    role: planner
    duty: 'plan'
    cap: small
  - {cap: large, id: c, role: calculator, deps: [p], duty: "compute units first"}
  - id: v
    role: verifier
    duty: verify
    cap: medium
    deps:
      - p
      - c
answer: "v"
"""
  spec, spans = parse_spec_with_spans(block)
  assert spec == EXAMPLE_SPEC
  assert block[slice(*spans[("agents", 0, "id")])] == "p"
  assert block[slice(*spans[("agents", 0, "duty")])] == "'plan'"
  assert block[slice(*spans[("agents", 1, "duty")])] == '"compute units first"'
  assert block[slice(*spans[("agents", 2, "deps", 1)])] == "c"
  assert block[slice(*spans[("answer",)])] == '"v"'


def test_schema_checks_itself():
  with pytest.raises(ValueError, match="default duty"):
    Schema(roles={"planner": "dance"})
  with pytest.raises(ValueError, match="read as a YAML string"):
    Schema(capacities=("low", "on"))
  with pytest.raises(ValueError, match="distinct"):
    Schema(capacities=("small", "small"))
  custom = Schema(roles={"solver": "solve"}, duties=("solve",), capacities=("lo", "hi"), max_agents=2)
  spec = parse_spec("agents: [{id: a, role: solver, duty: solve, cap: hi}]\nanswer: a", custom)
  assert spec.agents[0].capacity == "hi"
  with pytest.raises(SpecError, match="bad capacity 'small'"):
    parse_spec("agents: [{id: a, role: solver, duty: solve, cap: small}]\nanswer: a", custom)


def test_validate_spec_checks_specs_built_in_code():
  with pytest.raises(SpecError, match=r"agents\[0\].role: unknown role"):
    validate_spec(Spec((Agent("a", "coder", "plan", "small"),), "a"))
  with pytest.raises(SpecError, match="must be a string"):
    validate_spec(Spec((Agent("a", "planner", "plan", 3),), "a"))
  with pytest.raises(SpecError, match="wrong_type|expected a Spec"):
    serialize("agents: []")
  assert validate_spec(EXAMPLE_SPEC) is EXAMPLE_SPEC


# ---------------------------------------------------------------------------------------------------
# Fuzzing: nothing but SpecError, ever.
# ---------------------------------------------------------------------------------------------------


def _parse_or_spec_error(text):
  try:
    spec = parse_spec(text)
  except SpecError as err:
    assert err.code in ERROR_CODES
    return None
  assert serialize(spec)[0]  # A spec that parses is valid and serialisable.
  return spec


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(max_size=200))
def test_fuzz_arbitrary_text(text):
  _parse_or_spec_error(text)


FRAGMENTS = ["agents:", "answer:", "\n", "\n- ", "  ", " ", "- ", "{", "}", "[", "]", ",", ": ", ":", "id: a",
             "id: b", "role: planner", "role: x", "duty: plan", "duty: plan note", "cap: small", "cap: large",
             "deps: [a]", "deps: [b, a]", "deps:", "a", "b", "&x ", "*x", "!!str ", "!!int ", "!!python/object ",
             "!t ", "<<: ", "? ", "|\n  ", ">\n  ", "'", '"', "#", "%YAML 1.1\n", "---\n", "...\n", "~", "null",
             "yes", "1e3", ".inf", "0x1F", "2001-12-14", "\t", "\\u00e9", "é", "\ufeff", "\r\n", "@", "`"]


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join))
def test_fuzz_yaml_token_soup(text):
  _parse_or_spec_error(text)


_SCALARS = (st.none() | st.booleans() | st.integers(-10, 10**12) | st.floats(allow_nan=True) |
            st.sampled_from(["a", "b", "planner", "plan", "small", "large", "verifier", "verify x"]) |
            st.text(max_size=8))
_KEYS = st.sampled_from(["agents", "answer", "id", "role", "duty", "cap", "deps", "x"]) | st.text(max_size=4)
_YAMLISH = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) |
                        st.dictionaries(_KEYS, inner, max_size=6), max_leaves=30)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(_YAMLISH, st.booleans())
def test_fuzz_yaml_structures(obj, flow):
  _parse_or_spec_error(yaml.safe_dump(obj, default_flow_style=flow))


@hypothesis.settings(max_examples=120, deadline=None)
@hypothesis.given(st.data())
def test_fuzz_spec_shaped_structures(data):
  """Dicts shaped like specs, with each field valid or junk (deep checks, not just the first one)."""
  n = data.draw(st.integers(0, 9))
  ids = [f"a{i}" for i in range(n)]
  junk = _SCALARS | st.lists(_SCALARS, max_size=3) | st.sampled_from(ids + ["coder", "huge", "dance x"])

  def maybe(valid):
    return data.draw(junk if data.draw(st.integers(0, 15)) == 0 else valid)

  agents = []
  for i in range(n):
    agent = {"id": maybe(st.just(ids[i])), "role": maybe(st.sampled_from(sorted(DEFAULT_SCHEMA.roles))),
             "duty": maybe(st.sampled_from(DEFAULT_SCHEMA.duties)),
             "cap": maybe(st.sampled_from(DEFAULT_SCHEMA.capacities)),
             "deps": maybe(st.lists(st.sampled_from(ids[:i]), max_size=3, unique=True) if i else st.just([]))}
    if data.draw(st.integers(0, 15)) == 0:
      agent.pop(data.draw(st.sampled_from(sorted(agent))))
    agents.append(agent)
  obj = {"agents": agents, "answer": maybe(st.sampled_from(ids or ["a"]))}
  _parse_or_spec_error(yaml.safe_dump(obj, default_flow_style=data.draw(st.booleans())))


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.integers(0, len(EXAMPLE)), st.integers(0, 3),
                                     st.sampled_from(list("{}[],:-' \"\n#&*!|>?abcpv0"))), min_size=1, max_size=4))
def test_fuzz_near_valid_specs(mutations):
  """What an orchestrator nearly gets right: a valid spec with a few characters deleted, inserted, replaced."""
  text = EXAMPLE
  for pos, op, char in mutations:
    pos = min(pos, len(text))
    text = (text[:pos] + char + text[pos + 1:] if op == 0 else text[:pos] + text[pos + 1:] if op == 1
            else text[:pos] + char + text[pos:])
  _parse_or_spec_error(text)


# ---------------------------------------------------------------------------------------------------
# Valid specs: round trips, character spans, token spans, edits.
# ---------------------------------------------------------------------------------------------------

_IDS = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True).filter(lambda s: yaml.safe_load(s) == s)
_FREE_TEXT = st.text(st.sampled_from([chr(c) for c in range(0x20, 0x7f)]), min_size=1, max_size=48).filter(
    lambda t: t.strip(" ") == t)


@st.composite
def valid_specs(draw, schema=DEFAULT_SCHEMA):
  n = draw(st.integers(1, schema.max_agents))
  ids = draw(st.lists(_IDS, min_size=n, max_size=n, unique=True))
  agents = []
  for i, agent_id in enumerate(ids):
    word = draw(st.sampled_from(schema.duties))
    text = draw(st.none() | _FREE_TEXT)
    deps = draw(st.lists(st.sampled_from(ids[:i]), unique=True)) if i else []
    agents.append(Agent(agent_id, draw(st.sampled_from(sorted(schema.roles))),
                        word if text is None else f"{word} {text}", draw(st.sampled_from(schema.capacities)),
                        tuple(deps)))
  return Spec(tuple(agents), draw(st.sampled_from(ids)))


def _field_value(spec, path):
  if path == ("answer",):
    return spec.answer
  agent = spec.agents[path[1]]
  key = path[2]
  if key == "deps":
    return agent.depends_on[path[3]]
  return {"id": agent.id, "role": agent.role, "duty": agent.duty, "cap": agent.capacity}[key]


def _check_char_spans(spec, text, spans):
  for path, (start, end) in spans.items():
    if len(path) == 2 or path[-1] == "deps":  # An agent's mapping, or its whole deps list.
      assert text[start] in "{[" and text[end - 1] in "}]"
      continue
    assert yaml.safe_load(text[start:end]) == _field_value(spec, path), path


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(valid_specs())
def test_valid_specs_round_trip_with_exact_character_spans(spec):
  text, spans = serialize(spec)
  parsed, parsed_spans = parse_spec_with_spans(text)
  assert parsed == spec
  assert parsed_spans == spans  # The serialiser's bookkeeping agrees with YAML's own marks.
  assert serialize(parsed) == (text, spans)
  expected_paths = {("answer",)}
  for i, agent in enumerate(spec.agents):
    expected_paths |= {("agents", i), *(("agents", i, k) for k in ("id", "role", "duty", "cap"))}
    if agent.depends_on:
      expected_paths |= {("agents", i, "deps"), *(("agents", i, "deps", j) for j in range(len(agent.depends_on)))}
  assert set(spans) == expected_paths
  _check_char_spans(spec, text, spans)
  for path in spans:
    if path[-1] in ("id", "role", "cap") or "deps" in path[2:3] and len(path) == 4 or path == ("answer",):
      assert text[slice(*spans[path])] == _field_value(spec, path)  # Plain scalars: the value itself.


def test_short_spec_is_tens_of_bpe_tokens(bpe):
  floor = len(hf.pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(EXAMPLE))
  assert len(bpe.encode(EXAMPLE)) == floor == 77  # A BPE cannot merge across pre-tokens; this one reaches it.


# A tiny byte-level BPE trained here on spec-like strings (no download).
_BPE_CORPUS = [EXAMPLE, serialize(Spec((Agent("s", "solver", "solve", "medium"),
                                        Agent("x", "extractor", "extract numbers", "small", ("s",)),
                                        Agent("g", "aggregator", "aggregate", "large", ("s", "x"))), "g"))[0],
               "critic critique summarizer summarize explain format deps: [a, b]"]


@pytest.fixture(scope="module")
def bpe():
  raw = hf.Tokenizer(hf.models.BPE())
  raw.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = hf.decoders.ByteLevel()
  trainer = hf.trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"], show_progress=False,
                                   initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
  raw.train_from_iterator(_BPE_CORPUS * 4, trainer=trainer)
  return HFTokenizer(raw, pad_id=raw.token_to_id("<pad>"), eos_id=raw.token_to_id("<eos>"), name="test-bpe")


def _check_token_spans(tokenizer, text, ids, char_spans, token_spans):
  """Independent check for texts whose tokens each decode to whole characters: ``[a, b)`` covers the span
  and dropping its first or last token does not."""
  cum = [len(tokenizer.decode(ids[:k], skip_special_tokens=False)) for k in range(len(ids) + 1)]
  assert cum[-1] == len(text)
  for path, (start, end) in char_spans.items():
    a, b = token_spans[path]
    assert cum[a] <= start and cum[b] >= end, path  # covers
    assert cum[a + 1] > start and cum[b - 1] < end, path  # minimal


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(valid_specs())
def test_token_spans_are_the_smallest_covering_ranges(bpe, spec):
  text, spans = serialize(spec)
  for tokenizer in (ByteTokenizer(), bpe):
    ids = tokenizer.encode(text)
    token_spans = char_to_token_spans(spans, text, tokenizer)
    _check_token_spans(tokenizer, text, ids, spans, token_spans)
    if tokenizer is ByteTokenizer:
      assert token_spans == spans  # ASCII text: one byte token per character.
  # The tokenizers library's own offsets agree with incremental decoding.
  encoding = bpe.raw.encode(text, add_special_tokens=False)
  assert token_char_ranges(bpe, encoding.ids, text) == [tuple(o) for o in encoding.offsets]


def test_token_spans_of_sampled_non_canonical_ids(bpe):
  """A sampled spec need not be tokenised canonically: spans map onto the ids as sampled."""
  text, spans = serialize(EXAMPLE_SPEC)
  ids = [i for chunk in text.split(" ") for i in bpe.encode(chunk + " ")][:-1]  # One token per piece + space.
  assert ids != bpe.encode(text) and bpe.decode(ids) == text
  token_spans = char_to_token_spans(spans, text, bpe, ids=ids)
  _check_token_spans(bpe, text, ids, spans, token_spans)
  assert char_to_token_spans(spans, text, bpe, ids=ids + [bpe.eos_id, bpe.pad_id]) == token_spans  # A full row.
  with pytest.raises(ValueError, match="decode to"):
    char_to_token_spans(spans, text + "x", bpe, ids=ids)


def test_token_spans_with_multibyte_characters():
  tok = ByteTokenizer()
  text = "aé€😀b"
  assert char_to_token_spans({"e": (1, 2), "eur": (2, 3), "emoji": (3, 4), "b": (4, 5), "all": (0, 5)}, text,
                             tok) == {"e": (1, 3), "eur": (3, 6), "emoji": (6, 10), "b": (10, 11), "all": (0, 11)}
  # A comment in a non-Latin script before the fields shifts byte tokens, not characters.
  commented = "# équipe de trois 🍋\n" + EXAMPLE
  spec, spans = parse_spec_with_spans(commented)
  assert spec == EXAMPLE_SPEC
  token_spans = char_to_token_spans(spans, commented, tok)
  ids = tok.encode(commented)
  for path, (a, b) in token_spans.items():
    assert tok.decode(ids[a:b]) == commented[slice(*spans[path])]
  with pytest.raises(ValueError, match="empty or outside"):
    char_to_token_spans({"x": (3, 3)}, text, tok)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(valid_specs())
def test_edits_change_exactly_their_field(spec):
  edits = enumerate_edits(spec)
  counts = {f: sum(e.family == f for e in edits) for f in EDIT_FAMILIES}
  assert counts["drop_edge"] == spec.num_edges
  assert counts["reset_duty"] == sum(a.duty != DEFAULT_SCHEMA.roles[a.role] for a in spec.agents)
  assert counts["lower_capacity"] == sum(a.capacity != "small" for a in spec.agents)
  text, spans = serialize(spec)
  for edit in edits:
    validate_spec(edit.spec)
    assert edit.spec.answer == spec.answer
    i, old, new = edit.agent, spec.agents[edit.agent], edit.spec.agents[edit.agent]
    assert edit.spec.agents[:i] + edit.spec.agents[i + 1:] == spec.agents[:i] + spec.agents[i + 1:]
    edited_text, edited_spans = serialize(edit.spec)
    assert edit.path in spans
    assert edit.edited_path in edited_spans
    original_field = yaml.safe_load(text[slice(*spans[edit.path])])
    edited_field = edited_text[slice(*edited_spans[edit.edited_path])]
    if edit.family == "drop_edge":
      assert original_field == old.depends_on[edit.dep]
      assert new.depends_on == old.depends_on[:edit.dep] + old.depends_on[edit.dep + 1:]
      assert dataclasses.replace(new, depends_on=old.depends_on) == old
      if new.depends_on:
        assert yaml.safe_load(edited_field) == list(new.depends_on)
      else:
        assert "deps" not in edited_field and edited_field.startswith(f"{{id: {old.id},")
    elif edit.family == "reset_duty":
      assert original_field == old.duty and yaml.safe_load(edited_field) == DEFAULT_SCHEMA.roles[old.role]
      assert dataclasses.replace(new, duty=old.duty) == old
    else:
      levels = DEFAULT_SCHEMA.capacities
      assert original_field == old.capacity
      assert levels.index(edited_field) == levels.index(old.capacity) - 1
      assert dataclasses.replace(new, capacity=old.capacity) == old


def test_edit_functions_refuse_no_ops():
  with pytest.raises(ValueError, match="lowest capacity"):
    spec_lib.lower_capacity(EXAMPLE_SPEC, 0)
  with pytest.raises(ValueError, match="default duty"):
    spec_lib.reset_duty(EXAMPLE_SPEC, 0)
  with pytest.raises(IndexError):
    spec_lib.drop_edge(EXAMPLE_SPEC, 0, 0)
  with pytest.raises(ValueError, match="unknown edit family"):
    enumerate_edits(EXAMPLE_SPEC, families=["swap"])
  assert [e.family for e in enumerate_edits(EXAMPLE_SPEC, families=["reset_duty"])] == ["reset_duty"]
  assert EXAMPLE_SPEC.agents[1].duty_word == "compute"
