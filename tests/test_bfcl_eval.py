"""The BFCL evaluation mode against BFCL's own decoder, AST checker and runner rules (bfcl-eval, test-only).

Every entry of the ten single-turn Python categories (simple, multiple, parallel, parallel_multiple,
live_simple, live_multiple, live_parallel, live_parallel_multiple, irrelevance, live_irrelevance) is fed
to both sides as model text: its ground truth (first acceptable value of each parameter, optional ones left
out) in BFCL's Python call syntax, plus deterministic mutations of it (wrong value / type / name, missing
required or extra argument, dropped / duplicated / reordered calls, other acceptable values, string case,
int-for-float, tuples, dict keys, undecodable and empty text, and decoder corner cases: code fences,
quotes, missing brackets, tuples of calls, positional and ``**`` arguments, names, nested calls,
subscripts, lambdas, arithmetic, unary plus). Irrelevance entries get empty answers, prose, ``[]``, calls
and reasoning-prefixed calls. Both verdicts (valid and BFCL's error type) must agree on every case.
No sampling: all 3,475 entries, about 94,000 cases. The Qwen function-calling decoder is compared with
BFCL's own ``QwenFCHandler.decode_ast`` (compiled from bfcl-eval's source, whose module imports model
SDKs) on every fourth entry; lemon_rl's call-block decoder on every eighth. Then: per-category counts and
BFCL's summary formulas of :mod:`lemon_rl.eval.bfcl`, and the ``experiments/eval_bfcl.py`` command on a
JSON-lines file and on a tiny random Hugging Face-format checkpoint.

Skipped (not failed) when bfcl-eval is not installed; see tests/bfcl_support.py.
"""

from __future__ import annotations

import ast
import collections
import copy
import json
import math
import random
import re
from typing import Any, Callable

import pytest

import bfcl_support
from lemon_rl.eval import bfcl
from lemon_rl.rewards import bfcl_checker
from lemon_rl.rewards import tool_calls

BFCL, _SKIP_REASON = bfcl_support.import_bfcl()
if BFCL is None:
  pytest.skip(_SKIP_REASON, allow_module_level=True)

Calls = bfcl_support.Calls


class Src(str):
  """Source text rendered verbatim as an argument value."""

  def __repr__(self) -> str:
    return str(self)


# ------------------------------------------------------------------------------------------------------
# BFCL's side.


def bfcl_verdict(category: str, functions: list, gold: list | None, text: str,
                 decode: Callable[[str], Any] | None = None) -> tuple[bool, str]:
  """``(valid, error_type)`` as BFCL's eval runner computes them for ``category`` (its file stem)."""
  decode = decode or BFCL.decode_ast
  if "irrelevance" in category:  # _evaluate_single_relevance_entry.
    try:
      decoded = decode(text)
    except Exception:  # pylint: disable=broad-except
      return True, ""
    return (True, "") if BFCL.is_empty_output(decoded) else (False, "irrelevance_error:decoder_success")
  try:  # _evaluate_single_ast_entry.
    decoded = decode(text)
  except Exception:  # pylint: disable=broad-except
    return False, "ast_decoder:decoder_failed"
  if not BFCL.is_function_calling_format_output(decoded):
    return False, "ast_decoder:decoder_wrong_output_format"
  try:
    result = BFCL.ast_checker(functions, decoded, gold, BFCL.python_language, category,
                              bfcl_support.STUB_MODEL_NAME)
  except Exception as e:  # pylint: disable=broad-except  # BFCL's runner aborts here.
    return False, f"checker_exception:{type(e).__name__}"
  return (True, "") if result["valid"] else (False, result["error_type"])


def ours(category: str, functions: list, gold: list | None, text: str, decoder: str = "python"):
  result = bfcl_checker.check_output(text, category, functions, gold, decoder=decoder)
  return result.valid, result.error_type


def _qwen_fc_decoder() -> Callable[[str], Any]:
  """BFCL's ``QwenFCHandler.decode_ast`` and ``_extract_tool_calls``, compiled from bfcl-eval's source."""
  path = BFCL.data_dir.parent / "model_handler" / "local_inference" / "qwen_fc.py"
  tree = ast.parse(path.read_text(encoding="utf-8"))
  cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QwenFCHandler")
  cls.bases, cls.keywords, cls.decorator_list = [], [], []
  cls.body = [n for n in cls.body
              if isinstance(n, ast.FunctionDef) and n.name in ("decode_ast", "_extract_tool_calls")]
  for method in cls.body:
    method.decorator_list = [d for d in method.decorator_list
                             if isinstance(d, ast.Name) and d.id == "staticmethod"]
  namespace = {"json": json, "re": re}
  exec(compile(ast.Module(body=[cls], type_ignores=[]), str(path), "exec"), namespace)  # pylint: disable=exec-used
  handler = namespace["QwenFCHandler"]()
  return lambda text: handler.decode_ast(text, None, False)


# ------------------------------------------------------------------------------------------------------
# Rendering.




def hermes_text(calls: Calls) -> str:
  return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def _json_safe(value: Any) -> bool:
  if isinstance(value, (tuple, Src)) or (isinstance(value, float) and not math.isfinite(value)):
    return False
  if isinstance(value, list):
    return all(_json_safe(v) for v in value)
  if isinstance(value, dict):
    return all(isinstance(k, str) and _json_safe(v) for k, v in value.items())
  return True










# ------------------------------------------------------------------------------------------------------
# Mutations.








def ast_cases(functions: list[dict], gold: list[dict], rng: random.Random) -> list[tuple[str, str]]:
  """``(label, model text)``: the rendered ground truth and its mutations."""
  schemas = bfcl_support.schemas(functions)
  base = bfcl_support.render_gold(functions, gold)
  calls_out: list[tuple[str, Calls]] = [("ground_truth", base)]

  def with_call(i: int, name: str, args: dict) -> Calls:
    calls = copy.deepcopy(base)
    calls[i] = (name, args)
    return calls

  def add(label: str, i: int, name: str, args: dict) -> None:
    calls_out.append((label, with_call(i, name, args)))

  names = [f["name"] for f in functions]
  for i, (name, args) in enumerate(base):
    props = schemas[name].get("properties", {})
    required = schemas[name].get("required", [])
    gold_params = list(gold[i].values())[0]
    others = [n for n in names if n != name]
    if others:
      add("wrong_name:other_function", i, rng.choice(others), dict(args))
    add("wrong_name:unknown_function", i, name + "_v2", dict(args))
    present_required = [p for p in required if p in args]
    if present_required:
      dropped = dict(args)
      del dropped[rng.choice(present_required)]
      add("missing_required", i, name, dropped)
    add("extra_arg:unknown", i, name, {**args, "unexpected_param": "abc"})
    absent = [p for p in props if p not in args]
    if absent:
      p = rng.choice(absent)
      add("extra_arg:schema", i, name, {**args, p: bfcl_support.default_value(props[p])})
    optional_unused = [p for p, vals in gold_params.items() if "" in vals and p not in args
                       and any(v != "" for v in vals)]
    if optional_unused:
      p = rng.choice(optional_unused)
      add("optional_given", i, name, {**args, p: bfcl_support.render_value(bfcl_support.first_acceptable(gold_params[p]), props.get(p, {}))})
    if not args:
      continue
    p = rng.choice(sorted(args))
    add("wrong_type", i, name, {**args, p: bfcl_support.wrong_type(args[p])})
    add("wrong_value", i, name, {**args, p: bfcl_support.wrong_value(args[p])})
    add("value_none", i, name, {**args, p: None})
    decoder_param = rng.choice(sorted(args))  # Decoder corner cases on one argument per call.
    for q in sorted(args):
      value, schema = args[q], props.get(q, {})
      if isinstance(value, str):
        add("string_case_punctuation", i, name, {**args, q: value.upper().replace(" ", "_") + "."})
        if value.isidentifier():
          add("decoder:bare_name", i, name, {**args, q: Src(value)})
        if q == decoder_param:
          add("decoder:subscript", i, name, {**args, q: Src("x[0]")})
      if type(value) is int:
        add("float_for_int", i, name, {**args, q: float(value)})
        if q == decoder_param:
          add("decoder:arithmetic", i, name, {**args, q: Src(f"({value} - 1) + 1")})
          add("decoder:unary_plus", i, name, {**args, q: Src(f"+{abs(value)}")})
      if isinstance(value, float) and value.is_integer():
        add("int_for_float", i, name, {**args, q: int(value)})
      if "enum" in schema:
        add("out_of_enum", i, name, {**args, q: "zz_not_in_enum"})
      if isinstance(value, list):
        add("tuple_for_list", i, name, {**args, q: tuple(value)})
        if value:
          add("list_element_wrong_type", i, name, {**args, q: [bfcl_support.wrong_type(value[0])] + value[1:]})
          add("list_reversed", i, name, {**args, q: list(reversed(value))})
        if value and all(isinstance(x, float) and x.is_integer() for x in value):
          add("ints_in_float_list", i, name, {**args, q: [int(x) for x in value]})
      if isinstance(value, dict):
        add("dict_extra_key", i, name, {**args, q: {**value, "zz_key": 1}})
        if value:
          smaller = dict(value)
          del smaller[sorted(smaller)[0]]
          add("dict_key_dropped", i, name, {**args, q: smaller})
      concrete = [v for v in gold_params.get(q, []) if v != ""]
      if len(concrete) > 1:
        add("other_acceptable_value", i, name, {**args, q: bfcl_support.render_value(concrete[-1], schema)})
    add("decoder:nested_call", i, name, {**args, decoder_param: Src("g(k=1)")})
    add("decoder:call_without_keywords", i, name, {**args, decoder_param: Src("g(1)")})
    add("decoder:lambda", i, name, {**args, decoder_param: Src("lambda: 1")})
  if len(base) > 1:
    calls = copy.deepcopy(base)
    del calls[rng.randrange(len(calls))]
    calls_out.append(("dropped_call", calls))
    calls_out.append(("swapped_order", list(reversed(copy.deepcopy(base)))))
  calls_out.append(("no_call", []))
  calls_out.append(("extra_call:duplicate", copy.deepcopy(base) + [copy.deepcopy(rng.choice(base))]))

  cases = [(label, bfcl_support.python_text(calls)) for label, calls in calls_out]
  text = bfcl_support.python_text(base)
  inner = text[1:-1]
  head, args_src = inner.split("(", 1)
  cases += [
      ("undecodable:prose", "I need more information to answer that."),
      ("undecodable:truncated", text[: len(text) // 2]),
      ("empty_text", ""),
      ("decoder:no_brackets", inner),
      ("decoder:whitespace", f"\n  {text} \n"),
      ("decoder:plain_fence", f"```\n{text}\n```"),
      ("decoder:python_fence", f"```python\n{text}\n```"),
      ("decoder:quoted", f"'{text}'"),
      ("decoder:tuple_of_calls", f"({inner},)"),
      ("decoder:positional_argument", f"[{head}(1, {args_src}]" if args_src != ")" else f"[{head}(1)]"),
      ("decoder:star_kwargs", f"[{head}({args_src[:-1]}{', ' if args_src != ')' else ''}**extra)]"),
      ("decoder:think_prefix", f"<think>plan</think>\n{text}"),
  ]
  return cases


def irrelevance_cases(functions: list[dict], rng: random.Random) -> list[tuple[str, str]]:
  if functions:
    f = rng.choice(functions)
    props, required = f["parameters"]["properties"], f["parameters"].get("required", [])
    call = bfcl_support.python_text([(f["name"], {p: bfcl_support.default_value(props[p]) for p in required if p in props})])
  else:  # Some live_irrelevance entries offer no function.
    f, call = {"name": "lookup"}, "[lookup(query='x')]"
  return [
      ("empty_text", ""),
      ("empty_list", "[]"),
      ("empty_list_fenced", "```\n[]\n```"),
      ("undecodable:prose", "None of the functions can answer this question."),
      ("undecodable:dict_in_list", "[{}]"),
      ("call", call),
      ("call_without_arguments", f"[{f['name']}()]"),
      ("call:unknown_function", "[lookup(query='x')]"),
      ("call_after_think", f"<think>plan</think>\n{call}"),
  ]


# ------------------------------------------------------------------------------------------------------
# Tests.


@pytest.fixture(scope="module")
def entries() -> dict[str, list[bfcl.BfclEntry]]:
  return {c: bfcl.load_entries(c, str(BFCL.data_dir)) for c in bfcl.CATEGORIES}


def test_every_category_is_loaded(entries):
  sizes = {c: len(v) for c, v in entries.items()}
  assert sizes == bfcl.dataset_sizes(str(BFCL.data_dir))
  assert all(n > 0 for n in sizes.values()), sizes
  for category, items in entries.items():
    assert (items[0].gold is None) == ("irrelevance" in category)
    assert all(bfcl.category_of_id(e.id) == category for e in items)


def _satisfiable(entry: bfcl.BfclEntry) -> bool:
  """Some answer passes: no required parameter without an acceptable value, no non-optional gold
  parameter missing from the schema (a few BFCL entries break one of these)."""
  schemas = bfcl_support.schemas(entry.functions)
  for call in entry.gold:
    (name, params), = call.items()
    for param in schemas[name].get("required", []):
      if not [v for v in params.get(param, []) if v != ""]:
        return False
    if any(p not in schemas[name]["properties"] and "" not in v for p, v in params.items()):
      return False
  return True


def test_verdicts_equal_bfcl_on_ground_truths_and_mutations(entries):
  per_category = collections.defaultdict(lambda: [0, 0, 0])  # cases, agreements, BFCL-valid.
  per_label = collections.defaultdict(lambda: [0, 0, 0])
  error_types = collections.Counter()
  disagreements, unsatisfiable = [], []
  for category, items in entries.items():
    name = bfcl.bfcl_name(category)
    for entry in items:
      rng = random.Random(entry.id)
      if entry.gold is None:
        cases = irrelevance_cases(entry.functions, rng)
      else:
        cases = ast_cases(entry.functions, entry.gold, rng)
      for label, text in cases:
        theirs = bfcl_verdict(name, entry.functions, entry.gold, text)
        mine = ours(name, entry.functions, entry.gold, text)
        same = mine == theirs
        error_types[theirs[1]] += 1
        group = label if label.startswith("decoder") else label.split(":")[0]
        for table, key in ((per_category, category), (per_label, group)):
          table[key][0] += 1
          table[key][1] += same
          table[key][2] += theirs[0]
        if not same:
          disagreements.append((entry.id, label, text[:200], mine, theirs))
        if label == "ground_truth":
          assert theirs[0] == _satisfiable(entry), (entry.id, text, theirs)
          if not theirs[0]:
            unsatisfiable.append(entry.id)
  print(f"\n{'category':<24} {'agree/cases':>15} {'BFCL-correct':>13}")
  for category, (n, same, valid) in per_category.items():
    print(f"{category:<24} {same:>7}/{n:<7} {valid:>13}")
  print(f"{'mutation':<24} {'agree/cases':>15} {'BFCL-correct':>13}")
  for label, (n, same, valid) in sorted(per_label.items()):
    print(f"{label:<24} {same:>7}/{n:<7} {valid:>13}")
  print(f"BFCL verdicts: {dict(error_types.most_common())}")
  total = sum(v[0] for v in per_category.values())
  print(f"total: {total} cases, {len(disagreements)} disagreements; ground truths BFCL itself rejects "
        f"(unsatisfiable gold): {unsatisfiable}")
  assert not disagreements, disagreements[:10]
  assert len(unsatisfiable) < 10
  assert per_label["ground_truth"][0] == sum(len(v) for c, v in entries.items() if "irrelevance" not in c)
  assert set(per_category) == set(bfcl.CATEGORIES)
  # The set exercises both verdicts, BFCL's checker errors and its decoder corner cases.
  assert total > 50_000
  for category, (n, _, valid) in per_category.items():
    assert 0 < valid < n, category


def test_hermes_decoder_equals_bfcl_qwen_fc_handler(entries):
  decode = _qwen_fc_decoder()
  total = 0
  for category, items in entries.items():
    name = bfcl.bfcl_name(category)
    for entry in items[::4]:
      rng = random.Random(entry.id)
      calls = bfcl_support.render_gold(entry.functions, entry.gold) if entry.gold else []
      texts = [hermes_text(calls), "", "[]", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
               "<tool_call>\n[1]\n</tool_call>", "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
               "<tool_call>\nnot json\n</tool_call>"]
      if entry.gold:
        for label, mutated in ast_cases(entry.functions, entry.gold, rng):
          del label
          try:
            parsed = BFCL.decode_ast(mutated)
          except Exception:  # pylint: disable=broad-except
            continue
          calls_m = [(list(c)[0], list(c.values())[0]) for c in parsed]
          if all(isinstance(n, str) and _json_safe(a) for n, a in calls_m):
            texts.append(hermes_text(calls_m))
      for text in texts:
        total += 1
        assert ours(name, entry.functions, entry.gold, text, "hermes") == bfcl_verdict(
            name, entry.functions, entry.gold, text, decode), (entry.id, text[:200])
  print(f"\nhermes decoder: {total} cases agree")


def test_lemon_decoder_reads_cast_call_blocks_like_bfcl_reads_python(entries):
  """``<think>..</think><tool_call>[...]</tool_call>`` (JSON or Python style) gets BFCL's verdict on the calls."""
  total = 0
  for category, items in entries.items():
    name = bfcl.bfcl_name(category)
    for entry in items[::8]:
      rng = random.Random(entry.id)
      cases = (ast_cases(entry.functions, entry.gold, rng) if entry.gold
               else irrelevance_cases(entry.functions, rng))
      for _, text in cases:
        try:
          parsed = BFCL.decode_ast(text)
        except Exception:  # pylint: disable=broad-except
          continue
        calls = [(list(c)[0], list(c.values())[0]) for c in parsed]
        theirs = bfcl_verdict(name, entry.functions, entry.gold, text)
        block = text.strip()
        lemon_python = f"<think>Use it.</think><tool_call>{block}</tool_call>"
        assert ours(name, entry.functions, entry.gold, lemon_python, "lemon") == theirs, (entry.id, text)
        total += 1
        if all(isinstance(n, str) and _json_safe(a) for n, a in calls):
          body = json.dumps([{"name": n, "arguments": a} for n, a in calls])
          lemon_json = f"<think>Use <tool_call>x</tool_call>.</think><tool_call>{body}</tool_call>"
          assert ours(name, entry.functions, entry.gold, lemon_json, "lemon") == theirs, (entry.id, body)
          total += 1
  print(f"\nlemon decoder: {total} cases agree")


# ------------------------------------------------------------------------------------------------------
# Hand-checked rules.

_F = [{"name": "f", "parameters": {"type": "dict", "properties": {
    "x": {"type": "integer"}, "s": {"type": "string"}}, "required": ["x"]}}]


@pytest.mark.parametrize("text,category,expected", [
    ("I cannot help.", "irrelevance", (True, "")),  # Undecodable: a correct abstention for BFCL...
    ("I cannot help.", "simple_python", (False, "ast_decoder:decoder_failed")),
    ("[f(x=1)]", "irrelevance", (False, "irrelevance_error:decoder_success")),
    ("", "irrelevance", (True, "")),
    ("", "simple_python", (False, "simple_function_checker:wrong_count")),  # "" decodes to [].
    ("f(x=1)", "simple_python", (True, "")),
    ("[f(x=+1)]", "simple_python", (False, "value_error:others")),  # BFCL negates any unary operand.
    ("[f(x=2-1)]", "simple_python", (True, "")),  # Binary operations are evaluated.
    ("[f(x=1, s=Hello_World)]", "simple_python", (True, "")),  # A bare name is its string; normalised.
    ("[f(x=1, s='hello world')]", "simple_python", (True, "")),
    ("[f(x=True)]", "simple_python", (False, "type_error:simple")),  # bool is not int.
    ("[f(x=1), f(x=1)]", "simple_python", (False, "simple_function_checker:wrong_count")),
    ("[f(x=len('ab'))]", "simple_python", (False, "type_error:simple")),  # A call: its source text.
    ("[f(x=1 + len('a'))]", "simple_python", (False, "ast_decoder:decoder_failed")),  # Never eval'd.
    ("[f(x=10 ** 10 ** 10)]", "simple_python", (False, "ast_decoder:decoder_failed")),  # Size guard.
])
def test_hand_checked_verdicts(text, category, expected):
  gold = [{"f": {"x": [1], "s": ["Hello World", ""]}}]
  assert ours(category, _F, gold, text) == expected
  if "+ len(" not in text and "**" not in text:  # BFCL would eval these (run code, spend the memory).
    assert bfcl_verdict(category, _F, gold, text) == expected


def test_cast_reward_differs_on_undecodable_irrelevance_answers():
  """The reason for this mode: CAST's exact requires [] where BFCL accepts any non-call."""
  assert tool_calls.score_tool_calls("I cannot help.", [], _F).exact == 0.0
  assert ours("irrelevance", _F, None, "I cannot help.") == (True, "")


def test_checker_exception_is_reported_as_wrong():
  """A non-dict in a list-of-dicts argument whose gold accepts "": BFCL's checker raises there."""
  functions = [{"name": "g", "parameters": {"type": "dict", "properties": {
      "items": {"type": "array", "items": {"type": "dict"}}}, "required": []}}]
  gold = [{"g": {"items": [[{"a": [1]}], ""]}}]
  assert bfcl_verdict("simple_python", functions, gold, "[g(items=['a'])]") == (
      False, "checker_exception:AttributeError")
  assert ours("simple_python", functions, gold, "[g(items=['a'])]") == (False, "checker_exception:AttributeError")
  assert ours("simple_python", functions, gold, "[g(items=[{'a': 1}])]") == (True, "")
  assert ours("simple_python", functions, gold, "[g(items=[])]") == (True, "")  # Matches the "" answer.


def test_huge_integer_in_an_error_message_is_a_checker_exception():
  text = "[f(x=0x" + "f" * 4000 + ")]"  # Over 4300 decimal digits: repr() raises in BFCL's message.
  gold = [{"f": {"x": [1], "s": [""]}}]
  assert bfcl_verdict("simple_python", _F, gold, text) == (False, "checker_exception:ValueError")
  assert ours("simple_python", _F, gold, text) == (False, "checker_exception:ValueError")


@pytest.mark.parametrize("terms", [100, 300, 2000])
def test_long_arithmetic_fails_where_bfcls_eval_does(terms):
  text = "[f(x=" + "+".join(["1"] * terms) + ")]"
  gold = [{"f": {"x": [terms], "s": [""]}}]
  assert ours("simple_python", _F, gold, text) == bfcl_verdict("simple_python", _F, gold, text)


def test_strip_reasoning_is_the_qwen_handlers_split():
  text = "<think>a</think>b<think>c</think>\n\n[f(x=1)]"
  assert bfcl_checker.strip_reasoning(text) == "[f(x=1)]"
  assert bfcl_checker.strip_reasoning("[f(x=1)]") == "[f(x=1)]"
  gold = [{"f": {"x": [1], "s": [""]}}]
  assert ours("simple_python", _F, gold, text) == (False, "ast_decoder:decoder_failed")
  assert bfcl_checker.check_output(text, "simple_python", _F, gold, strip_think=True).valid
  assert bfcl_checker.check_output(text, "irrelevance", _F, None).valid
  assert not bfcl_checker.check_output(text, "irrelevance", _F, None, strip_think=True).valid


# ------------------------------------------------------------------------------------------------------
# Scoring, BFCL's summary scores and the command.


def _mixed_outputs(entries, categories) -> tuple[dict[str, str], dict[str, int]]:
  """One deterministic case per entry, and how many of them BFCL counts correct per category."""
  outputs, expected = {}, collections.Counter()
  for category in categories:
    name = bfcl.bfcl_name(category)
    for entry in entries[category]:
      rng = random.Random(entry.id)
      cases = (ast_cases(entry.functions, entry.gold, rng) if entry.gold
               else irrelevance_cases(entry.functions, rng))
      _, text = cases[0] if rng.random() < 0.5 else rng.choice(cases)
      outputs[entry.id] = text
      expected[category] += bfcl_verdict(name, entry.functions, entry.gold, text)[0]
  return outputs, expected


def test_score_outputs_counts_bfcl_verdicts(entries):
  categories = ("simple", "live_parallel", "live_parallel_multiple", "irrelevance")
  outputs, expected = _mixed_outputs(entries, categories)
  report = bfcl.score_outputs({**outputs, "simple_java_0": "[f()]"}, data_dir=str(BFCL.data_dir))
  assert list(report.scores) == ["simple", "irrelevance", "live_parallel", "live_parallel_multiple"]
  for category in categories:
    score = report.scores[category]
    assert (score.correct, score.total, score.size) == (expected[category], len(entries[category]),
                                                         len(entries[category])), category
    assert 0 < score.correct < score.total
    assert sum(score.error_types.values()) == score.total - score.correct
  assert len(report.verdicts) == sum(len(entries[c]) for c in categories)
  with pytest.raises(ValueError, match="no output"):
    bfcl.score_outputs({"simple_python_0": outputs["simple_python_0"]}, data_dir=str(BFCL.data_dir))
  one = bfcl.score_outputs({"simple_python_0": outputs["simple_python_0"]}, partial=True,
                           data_dir=str(BFCL.data_dir))
  assert one.scores["simple"].total == 1
  with pytest.raises(ValueError, match="not entries"):
    bfcl.score_outputs({"simple_python_99999": ""}, partial=True, data_dir=str(BFCL.data_dir))


def test_summary_follows_bfcl_formulas():
  counts = {"simple": (300, 400), "multiple": (100, 200), "parallel": (150, 200), "parallel_multiple": (50, 200),
            "live_simple": (200, 258), "live_multiple": (500, 1053), "live_parallel_multiple": (12, 24),
            "irrelevance": (240, 240), "live_irrelevance": (442, 884)}  # live_parallel not evaluated.
  sizes = {c: n for c, (_, n) in counts.items()} | {"live_parallel": 16}
  scores = {c: bfcl.CategoryScore(c, k, n, n) for c, (k, n) in counts.items()}
  summary = bfcl.summarize(scores, sizes)
  non_live = (0.75 / 3 + 0.5 + 0.75 + 0.25) / 4  # Java and JavaScript simple count as 0.
  non_live_python = (0.75 + 0.5 + 0.75 + 0.25) / 4
  live = (200 + 500 + 0 + 12) / (258 + 1053 + 16 + 24)  # Count-weighted; live_parallel counts 0 of 16.
  irrelevance = (1.0 + 0.5) / 2
  expected = {"non_live": non_live, "non_live_python": non_live_python, "live": live, "irrelevance": irrelevance,
              "single_turn": (non_live_python + live + irrelevance) / 3,
              "overall": (10 * non_live + 10 * live + 10 * irrelevance) / 100}
  for key, value in expected.items():
    assert summary[key].accuracy == pytest.approx(value, rel=1e-12), key
  assert [summary[k].complete for k in bfcl.SUMMARY_KEYS] == [False, True, False, True, False, False]
  assert summary["live"].total_count == 1351


def _write_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


def test_command_scores_a_jsonl(entries, tmp_path, capsys):
  from experiments import eval_bfcl  # pylint: disable=import-outside-toplevel
  simple, irrelevance = entries["simple"][:40], entries["irrelevance"][:20]
  rows = [{"id": e.id, "model_output_text": bfcl_support.python_text(bfcl_support.render_gold(e.functions, e.gold)) if i < 30 else "Sorry."}
          for i, e in enumerate(simple)]
  rows += [{"id": e.id, "result": "" if i < 10 else irrelevance_cases(e.functions, random.Random(0))[5][1]}
           for i, e in enumerate(irrelevance)]  # BFCL result-file rows; the second half calls a function.
  rows.append({"id": "simple_java_0", "model_output_text": "[f()]"})  # Out of scope: ignored.
  path = tmp_path / "outputs.jsonl"
  _write_jsonl(path, rows)
  json_out, details_out = tmp_path / "scores.json", tmp_path / "verdicts.jsonl"
  report = eval_bfcl.main(["--outputs", str(path), "--partial", "--errors", "--json_out", str(json_out),
                           "--details_out", str(details_out)])
  printed = capsys.readouterr().out
  assert "simple_python" in printed and "75.00%" in printed and "50.00%" in printed
  assert "ast_decoder:decoder_failed" in printed and "irrelevance_error:decoder_success" in printed
  scores = json.loads(json_out.read_text())
  assert scores["categories"]["simple"]["correct"] == 30 and scores["categories"]["simple"]["total"] == 40
  assert scores["categories"]["irrelevance"]["accuracy"] == 0.5
  assert scores["summary"]["irrelevance"]["accuracy"] == pytest.approx(0.25)  # live_irrelevance counts 0.
  assert scores["summary"] == {k: a._asdict() for k, a in report.summary.items()}
  assert len(details_out.read_text().splitlines()) == 60
  only = eval_bfcl.main(["--outputs", str(path), "--partial", "--categories", "irrelevance"])
  assert list(only.scores) == ["irrelevance"]
  with pytest.raises(ValueError, match="no output"):
    eval_bfcl.main(["--outputs", str(path)])


def test_command_generates_with_a_checkpoint(tmp_path, capsys):
  """A tiny random model's greedy answers: never a call block, so wrong on simple and right on irrelevance."""
  # pylint: disable=import-outside-toplevel
  from flax import nnx

  from experiments import eval_bfcl
  from lemon_rl.models.config import ModelConfig
  from lemon_rl.models.hf import to_hf
  from lemon_rl.models.transformer import Transformer
  from lemon_rl.text.tokenizers import ByteTokenizer

  cfg = ModelConfig(vocab_size=ByteTokenizer().vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, mlp_dim=64)
  checkpoint = str(tmp_path / "model")
  to_hf(Transformer(cfg, rngs=nnx.Rngs(0)), checkpoint)
  generations = tmp_path / "generations.jsonl"
  report = eval_bfcl.main(["--checkpoint", checkpoint, "--tokenizer", "byte", "--categories", "simple,irrelevance",
                           "--limit", "2", "--max_new_tokens", "4", "--generations_out", str(generations)])
  assert "decoder=lemon" in capsys.readouterr().out
  rows = [json.loads(line) for line in generations.read_text().splitlines()]
  assert [r["id"] for r in rows] == ["simple_python_0", "simple_python_1", "irrelevance_0", "irrelevance_1"]
  assert all(isinstance(r["model_output_text"], str) for r in rows)
  assert [(s.correct, s.total) for s in report.scores.values()] == [(0, 2), (2, 2)]
  again = eval_bfcl.main(["--outputs", str(generations), "--decoder", "lemon", "--partial"])
  assert again.scores == report.scores
