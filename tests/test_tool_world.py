"""Tests of the CAST tool world, the query generator and the BFCL data loader."""

import collections
import json
import random

import pytest

from lemon_rl.envs import bfcl_data
from lemon_rl.envs import tool_use
from lemon_rl.envs import tool_world as world
from lemon_rl.rewards.cast import format_reward
from lemon_rl.rewards.tool_calls import score_tool_calls
from lemon_rl.rewards.tool_parsing import parse_tool_calls


@pytest.fixture(scope="module")
def examples():
  return tool_use.generate_examples(1500, seed=7)


def _all_types(spec, out):
  out.add(spec["type"])
  if isinstance(spec.get("items"), dict):
    _all_types(spec["items"], out)
  for sub in (spec.get("properties") or {}).values():
    _all_types(sub, out)


def test_world_has_20_typed_tools():
  assert len(world.FUNCTION_DOCS) >= 20
  assert len({d["name"] for d in world.FUNCTION_DOCS}) == len(world.FUNCTION_DOCS)
  types, has_enum, has_range, has_optional = set(), False, False, False
  for doc in world.FUNCTION_DOCS:
    assert set(doc) == {"name", "description", "parameters"}
    params = doc["parameters"]
    assert params["type"] == "dict"
    assert set(params["required"]) <= set(params["properties"])
    has_optional |= set(params["required"]) != set(params["properties"])
    for spec in params["properties"].values():
      _all_types(spec, types)
      has_enum |= "enum" in spec or "enum" in spec.get("items", {})
      has_range |= "minimum" in spec and "maximum" in spec
    assert set(world.SAMPLERS) >= {doc["name"]}
    assert world.CLUSTER_OF[doc["name"]] in world.CLUSTERS
  assert {"string", "integer", "float", "boolean", "array", "dict"} <= types
  assert has_enum and has_range and has_optional


def test_signatures_hand_written():
  assert world.signature(world.DOCS_BY_NAME["get_forecast"]) == "get_forecast(city:str,days:int[1..14])"
  assert world.signature(world.DOCS_BY_NAME["get_weather"]) == "get_weather(city:str,unit?:celsius|fahrenheit)"
  assert world.signature(world.DOCS_BY_NAME["add_contact"]) == (
      "add_contact(name:str,details:{phone:str,email?:str})")
  assert world.signature(world.DOCS_BY_NAME["set_alarm"]) == (
      "set_alarm(time:str,repeat?:[mon|tue|wed|thu|fri|sat|sun])")
  assert world.signature(world.DOCS_BY_NAME["calc_density"]) == "calc_density(mass:float>=0,volume:float>=0)"


def test_render_prompt_and_calls():
  docs = [world.DOCS_BY_NAME["get_weather"], world.DOCS_BY_NAME["set_timer"]]
  assert tool_use.render_prompt("Hi.", docs) == (
      "get_weather(city:str,unit?:celsius|fahrenheit)\nset_timer(minutes:int[1..1440],label?:str)\nQ: Hi.\n")
  calls = [("get_weather", {"city": "Oslo"}), ("set_timer", {"minutes": 150, "label": "tea"})]
  assert tool_use.render_calls(calls) == ('<tool_call>[{"name":"get_weather","arguments":{"city":"Oslo"}},'
                                          '{"name":"set_timer","arguments":{"minutes":150,"label":"tea"}}]'
                                          '</tool_call>')
  assert tool_use.render_calls(calls, "python") == (
      '<tool_call>[get_weather(city="Oslo"),set_timer(minutes=150,label="tea")]</tool_call>')
  assert tool_use.render_calls([]) == "<tool_call>[]</tool_call>"
  with pytest.raises(ValueError, match="call style"):
    tool_use.render_calls(calls, "xml")


def test_generator_is_deterministic():
  a = tool_use.generate_examples(60, seed=3)
  b = tool_use.generate_examples(60, seed=3)
  c = tool_use.generate_examples(60, seed=4)
  assert json.dumps(a) == json.dumps(b)
  assert [e["query"] for e in a] != [e["query"] for e in c]
  assert len({e["id"] for e in a + c}) == 120


@pytest.mark.parametrize("style", tool_use.CALL_STYLES)
def test_every_demonstration_is_exact(examples, style):
  exs = examples if style == "json" else tool_use.generate_examples(500, seed=11, style=style)
  seen = collections.Counter()
  for ex in exs:
    seen[ex["category"]] += 1
    scores = score_tool_calls(ex["demonstration"], ex["gold"], ex["functions"])
    assert scores.as_dict()["parse_status"] in ("ok", "empty"), ex
    assert (scores.name, scores.key, scores.type, scores.constraint, scores.value, scores.exact) == (1,) * 6, (
        ex["demonstration"], ex["gold"], scores)
    assert format_reward(ex["demonstration"]) == 1.0
    parsed = parse_tool_calls(ex["demonstration"])
    assert len(parsed.calls) == len(ex["gold"])
    assert [c.name for c in parsed.calls] == [next(iter(g)) for g in ex["gold"]]
  assert set(seen) == set(tool_use.CATEGORIES)


def test_category_structure(examples):
  for ex in examples:
    offered = [f["name"] for f in ex["functions"]]
    called = [next(iter(g)) for g in ex["gold"]]
    assert set(called) <= set(offered)
    assert ex["prompt"].endswith(f"Q: {ex['query']}\n")
    assert all(world.signature(f) in ex["prompt"] for f in ex["functions"])
    cat = ex["category"]
    if cat == "simple":
      assert len(offered) == 1 and len(called) == 1
    elif cat == "multiple":
      assert 2 <= len(offered) <= 3 and len(called) == 1
    elif cat == "parallel":
      assert len(offered) == 1 and len(called) >= 2
      assert len({json.dumps(g, sort_keys=True) for g in ex["gold"]}) == len(called)  # Calls differ.
    elif cat == "parallel_multiple":
      assert len(called) >= 2 and len(set(called)) >= 2
    else:
      assert cat == "irrelevance"


def test_irrelevance_offers_nothing_that_fits(examples):
  irr = [e for e in examples if e["category"] == "irrelevance"]
  assert len(irr) > 100
  for ex in irr:
    assert ex["gold"] == []
    assert ex["demonstration"].endswith("<tool_call>[]</tool_call>")
    offered = {f["name"] for f in ex["functions"]}
    for tool in ex["intent"]:
      assert tool not in offered
      assert not offered & set(world.SUBSTITUTES.get(tool, ()))
    # Any call of an offered tool is wrong.
    for f in ex["functions"]:
      wrong = tool_use.render_completion("x", [(f["name"], {})])
      assert score_tool_calls(wrong, ex["gold"], ex["functions"]).exact == 0.0
  # Look-alike (same-cluster) offers are present, not only unrelated tools.
  assert any(world.CLUSTER_OF[f["name"]] == world.CLUSTER_OF[e["intent"][0]]
             for e in irr if e["intent"] for f in e["functions"])


def _sample(tool, n=400, seed=0):
  rng = random.Random(seed)
  return [world.SAMPLERS[tool](rng) for _ in range(n)]


def test_tricky_conversions_present():
  timers = {(c.clause, c.args["minutes"]) for c in _sample("set_timer")}
  assert ("set a timer for two and a half hours", 150) in timers
  assert ("set a timer for half an hour", 30) in timers
  pizzas = [c for c in _sample("order_pizza") if "a dozen" in c.clause and "half" not in c.clause]
  assert pizzas and all(c.args["quantity"] == 12 for c in pizzas)
  rates = [c for c in _sample("compound_interest") if "at 5% " in c.clause]
  assert rates and all(c.args["rate"] == 0.05 and "5%=0.05" in c.notes for c in rates)
  alarms = {(c.clause, c.args["time"]) for c in _sample("set_alarm")}
  assert ("set an alarm for 7:30 pm", "19:30") in alarms
  bmi = [c for c in _sample("calc_bmi") if "180 cm" in c.clause]
  assert bmi and all(c.args["height"] == 1.8 for c in bmi)
  stocks = [c for c in _sample("get_stock_price") if "Apple" in c.clause]
  assert stocks and all(c.args["symbol"] == "AAPL" for c in stocks)


def test_surface_copy_errors_are_caught():
  """Passing the surface form ("5%" as 5) fails exact, value and the range constraint."""
  doc = world.DOCS_BY_NAME["compound_interest"]
  gold = [{"compound_interest": {"principal": [5000.0], "rate": [0.05], "years": [10], "n": ["", 1]}}]
  good = tool_use.render_completion("", [("compound_interest", {"principal": 5000.0, "rate": 0.05, "years": 10})])
  bad = tool_use.render_completion("", [("compound_interest", {"principal": 5000, "rate": 5, "years": 10})])
  assert score_tool_calls(good, gold, [doc]).exact == 1.0
  s = score_tool_calls(bad, gold, [doc])
  assert (s.exact, s.type) == (0.0, 1.0)
  # constraint: 2 of 3 arguments in range; value: 3 of 4 gold parameters (the omitted optional n counts).
  assert s.constraint == pytest.approx(2 / 3) and s.value == pytest.approx(3 / 4)


def test_thinking_grows_with_conversions(examples):
  by_conv = collections.defaultdict(list)
  for ex in examples:
    if ex["category"] != "irrelevance":
      think = ex["demonstration"].split("</think>")[0]
      by_conv[min(ex["num_conversions"], 3)].append(len(think))
  means = [sum(v) / len(v) for _, v in sorted(by_conv.items())]
  assert len(means) == 4 and means == sorted(means)
  easy = [e for e in examples if e["category"] == "simple" and e["num_conversions"] == 0]
  assert all(len(e["demonstration"].split("</think>")[0]) < 40 for e in easy)


def test_lengths_and_byte_caps(examples):
  simple = [e for e in examples if e["category"] == "simple"]
  assert sum(len(e["prompt"].encode()) < 250 for e in simple) / len(simple) > 0.95
  assert sum(len(e["demonstration"].encode()) < 200 for e in simple) / len(simple) > 0.9
  capped = tool_use.generate_examples(200, seed=5, max_prompt_bytes=250, max_completion_bytes=200)
  assert all(len(e["prompt"].encode()) <= 250 and len(e["demonstration"].encode()) <= 200 for e in capped)
  assert {e["category"] for e in capped} == set(tool_use.CATEGORIES)


def test_generator_arguments_validated():
  with pytest.raises(ValueError, match="unknown or empty categories"):
    tool_use.generate_examples(3, categories=["nope"])
  with pytest.raises(ValueError, match="weights"):
    tool_use.generate_examples(3, categories={"simple": -1.0})
  only = tool_use.generate_examples(20, seed=1, categories={"parallel": 1.0, "simple": 0.0})
  assert {e["category"] for e in only} == {"parallel"}
  with pytest.raises(ValueError, match="missing required"):
    world.make_call("get_forecast", "x", {"city": "Oslo"})


@pytest.mark.skipif(not bfcl_data.bfcl_available(), reason="bfcl-eval not installed")
@pytest.mark.parametrize("category", ["simple", "multiple", "parallel", "parallel_multiple", "irrelevance"])
def test_bfcl_loader_gold_demonstrations_are_exact(category):
  exs = bfcl_data.load_bfcl(category)
  assert len(exs) >= 200
  for ex in exs:
    assert set(ex) >= {"id", "category", "query", "functions", "gold", "prompt", "demonstration"}
    assert ex["query"] and ex["prompt"].endswith(f"Q: {ex['query']}\n")
    assert (ex["gold"] == []) == (category == "irrelevance")
    assert score_tool_calls(ex["demonstration"], ex["gold"], ex["functions"]).exact == 1.0, ex["id"]


def test_bfcl_loader_errors():
  with pytest.raises(ValueError, match="unknown BFCL category"):
    bfcl_data.load_bfcl("multi_turn_base")
  if bfcl_data.bfcl_available():
    assert len(bfcl_data.load_bfcl("live_simple", limit=5)) == 5
  else:
    with pytest.raises(FileNotFoundError, match="bfcl-eval"):
      bfcl_data.load_bfcl("simple")


# ---------------------------------------------------------------------------------------------------------
# Imperfect demonstrations (DemoNoise).


def _score(text, ex):
  return score_tool_calls(text, ex["gold"], ex["functions"])


def test_no_noise_is_the_clean_demonstration(examples):
  python = tool_use.generate_examples(300, seed=7, style="python")
  for i, (ex, py) in enumerate(zip(examples, python)):
    assert tool_use.noisy_demonstration(ex, tool_use.DemoNoise(), random.Random(i), "json") == ex["demonstration"]
    assert tool_use.noisy_demonstration(py, tool_use.DemoNoise(), random.Random(i), "python") == py["demonstration"]


def test_skipped_conversion_hand_example():
  doc = world.DOCS_BY_NAME["compound_interest"]
  ex = {"plan": "Use compound_interest.", "functions": [doc],
        "calls": [{"tool": "compound_interest", "args": {"principal": 5000.0, "rate": 0.05, "years": 10},
                   "notes": ["5k=5000", "5%=0.05"]}],
        "gold": [{"compound_interest": {"principal": [5000.0], "rate": [0.05], "years": [10], "n": ["", 1]}}]}
  noise = tool_use.DemoNoise(skip_conversion=1.0)
  outs = {tool_use.noisy_demonstration(ex, noise, random.Random(seed), "python") for seed in range(20)}
  # One of the two notes is dropped and the query's own number passed instead of the converted one.
  assert outs == {
      "<think>Use compound_interest. 5%=0.05.</think><tool_call>[compound_interest(principal=5,rate=0.05,years=10)]"
      "</tool_call>",
      "<think>Use compound_interest. 5k=5000.</think><tool_call>[compound_interest(principal=5000.0,rate=5,years=10)]"
      "</tool_call>"}
  assert all(_score(o, ex).exact == 0.0 and _score(o, ex).name == 1.0 for o in outs)


def test_each_noise_does_what_it_says(examples):
  calls = [e for e in examples if e["category"] != "irrelevance"]
  convert = [e for e in calls if e["num_conversions"]]
  rng = random.Random(0)
  skipped = [tool_use.noisy_demonstration(e, tool_use.DemoNoise(skip_conversion=1.0), rng) for e in convert]
  # A skipped conversion shortens the thinking and breaks the call, unless the written value is already right.
  broken = [_score(s, e).exact == 0.0 and len(s) < len(e["demonstration"]) for s, e in zip(skipped, convert)]
  assert sum(broken) / len(broken) > 0.9
  assert all(_score(s, e).name == 1.0 for s, e in zip(skipped, convert))
  # Filler lengthens the thinking only: every call stays exact.
  filled = [tool_use.noisy_demonstration(e, tool_use.DemoNoise(filler=1.0), rng) for e in examples]
  assert all(_score(f, e).exact == 1.0 for f, e in zip(filled, examples))
  assert all(f.removeprefix("<think>").split(".")[0] + "." in tool_use.FILLER for f in filled)
  # A look-alike key fails the key dimension but not the name; a number as a string fails the type.
  keyed = [(tool_use.noisy_demonstration(e, tool_use.DemoNoise(look_alike_key=1.0), rng), e) for e in calls]
  assert all(_score(k, e).exact == 0.0 and _score(k, e).name == 1.0 and _score(k, e).key < 1.0
             for k, e in keyed if k != e["demonstration"])
  assert sum(k != e["demonstration"] for k, e in keyed) / len(keyed) > 0.9
  typed = [(tool_use.noisy_demonstration(e, tool_use.DemoNoise(number_as_string=1.0), rng), e) for e in calls]
  changed = [(t, e) for t, e in typed if t != e["demonstration"]]
  assert len(changed) > len(calls) / 3
  assert all(_score(t, e).exact == 0.0 and _score(t, e).type < 1.0 for t, e in changed)
  assert tool_use._look_alike("start_date") == "startDate" and tool_use._look_alike("city") == "City"


def test_noise_length_bound_and_validation(examples):
  noise = tool_use.DemoNoise(skip_conversion=1.0, filler=1.0, look_alike_key=1.0, number_as_string=1.0)
  rng = random.Random(1)
  extra = [len(tool_use.noisy_demonstration(e, noise, rng).encode()) - len(e["demonstration"].encode())
           for e in examples]
  assert max(extra) <= noise.max_extra_bytes
  assert tool_use.DemoNoise().max_extra_bytes == 0
  with pytest.raises(ValueError, match="filler must be a probability"):
    tool_use.DemoNoise(filler=1.5)
  with pytest.raises(ValueError, match="max_filler"):
    tool_use.DemoNoise(max_filler=0)
