"""Splits disjoint by canonical content key, per task (``lemon_rl.data.splits`` and each task's ``canonical_key``).

Each task test generates every split the task has, at its config's sizes except where noted, and asserts
that no canonical key (nor raw prompt) is in two splits; the invariance tests check that the keys really
identify what they claim (operand order, commuting steps, wordings of one tool request).
"""

import collections
import json
import random

import pytest

from configs import cast_tool_use
from configs import fest_math
from configs import grpo_arithmetic
from lemon_rl.data import splits as content_splits
from lemon_rl.envs import arithmetic as ar
from lemon_rl.envs import frozenlake as fl
from lemon_rl.envs import multistep_math as mm
from lemon_rl.envs import tool_use
from lemon_rl.envs import tool_use_task as tut
from lemon_rl.envs import tool_world as world
from lemon_rl.envs.tasks import TASKS
from lemon_rl.rewards.tool_parsing import parse_tool_calls


def assert_disjoint(keys_by_split):
  overlaps = content_splits.key_overlaps(keys_by_split)
  assert len(overlaps) == len(keys_by_split) * (len(keys_by_split) - 1) // 2
  assert not any(overlaps.values()), {pair: n for pair, n in overlaps.items() if n}


# ---------------------------------------------------------------------------------------------------------
# The shared helper.


def test_draw_from_bucket_rejects_other_buckets_and_repeats():
  stream = iter(range(1000))
  bucket = lambda k: "even" if int(k) % 2 == 0 else "odd"  # pylint: disable=unnecessary-lambda-assignment
  assert content_splits.draw_from_bucket(lambda: next(stream), str, bucket, "odd", 4) == [1, 3, 5, 7]
  repeats = iter([2, 2, 4, 2, 6])
  assert content_splits.draw_from_bucket(lambda: next(repeats), str, bucket, "even", 3, distinct=True) == [2, 4, 6]
  with pytest.raises(ValueError, match="only 1 found"):
    content_splits.draw_from_bucket(lambda: 2, str, bucket, "even", 2, distinct=True, max_misses=10)
  assert content_splits.key_overlaps({"a": [1, 2], "b": [2, 3], "c": [4]}) == {("a", "b"): 1, ("a", "c"): 0,
                                                                               ("b", "c"): 0}
  with pytest.raises(ValueError, match="sum < 1"):
    content_splits.check_fractions((("test", 0.5), ("validation", 0.5)), "train")


# ---------------------------------------------------------------------------------------------------------
# tool_use (CAST).


def test_tool_use_splits_disjoint_by_request():
  """RL, validation and test at the CAST config's sizes; SFT at 5,000 of its 112,000 records (the full
  size costs about 40 s of CPU; its measured numbers are in ``tool_use_task``'s docstring)."""
  cfg = cast_tool_use.get_config("cast").task
  cfg.num_sft = 5_000
  records = {split: tut.make_split(cfg, split) for split in tut.SPLITS}
  assert {s: len(r) for s, r in records.items()} == {"sft": 5_000, "train": cfg.num_train,
                                                      "validation": cfg.num_validation, "test": cfg.num_test}
  keys = {split: [tut.canonical_key(r) for r in recs] for split, recs in records.items()}
  for split in tut.SPLITS:
    assert {tut.bucket_of(k) for k in keys[split]} == {split}
  assert_disjoint(keys)
  assert_disjoint({s: [r["prompt"] for r in recs] for s, recs in records.items()})
  assert_disjoint({s: [r["prompt"].rsplit("Q: ", 1)[1] for r in recs] for s, recs in records.items()})
  # Every split keeps every category, and the held-out splits are mostly distinct requests.
  for split, recs in records.items():
    assert {r["category"] for r in recs} == set(tool_use.CATEGORIES), split
  assert len(set(keys["test"])) > 200 and len(set(keys["validation"])) > 200 and len(set(keys["train"])) > 350
  assert len({r["id"] for recs in records.values() for r in recs}) == sum(map(len, records.values()))


def test_tool_use_key_is_invariant_to_wording_order_and_category():
  weather = world.canonical_call("get_weather", {"city": ["Paris"], "unit": ["", "celsius"]})
  assert weather == world.canonical_call("get_weather", {"city": ["  paris "], "unit": ["celsius"]})
  assert weather != world.canonical_call("get_weather", {"city": ["Paris"], "unit": ["fahrenheit"]})
  money = {"amount": [5000.0], "src": ["EUR"], "dst": ["JPY"]}
  assert world.canonical_call("convert_currency", money) == world.canonical_call(
      "convert_currency", {"dst": ["JPY"], "amount": [5000], "src": ["EUR"]})
  assert world.canonical_call("compound_interest", {"principal": [100.0], "rate": [0.05], "years": [2]}) != (
      world.canonical_call("compound_interest", {"principal": [100.0], "rate": [5], "years": [2]}))
  assert world.canonical_call("average", {"numbers": [[3.0, 5.0]]}) == world.canonical_call(
      "average", {"numbers": [[5, 3]]})
  assert world.canonical_call("book_hotel", {"city": ["Oslo"], "nights": [2], "breakfast": [False]}) == (
      world.canonical_call("book_hotel", {"city": ["Oslo"], "nights": [2], "breakfast": ["", False]}))
  assert world.canonical_call("play_music", {"query": ["jazz"], "volume": [0]}) != world.canonical_call(
      "play_music", {"query": ["jazz"], "shuffle": [False], "volume": [False]})  # 0 is not False.
  a, b = {"get_weather": {"city": ["Oslo"]}}, {"set_timer": {"minutes": [5]}}
  assert tut.canonical_key({"request": [a, b]}) == tut.canonical_key({"request": json.dumps([b, a])})
  assert tut.canonical_key({"request": [], "query": "Tell me a joke."}) == tut.canonical_key(
      {"request": "[]", "prompt": "f(x:int)\nQ: tell me  a JOKE\n"})

  # On generated data: the key is the normal form of the calls the demonstration makes (parsed back from its
  # text), so every wording of one request shares it; one key gathers many wordings and categories.
  rng = random.Random(11)
  groups = collections.defaultdict(list)
  for i in range(6000):
    ex = tool_use.generate_example(rng, tool_use.CATEGORIES[i % len(tool_use.CATEGORIES)], style="python")
    key = tut.canonical_key(ex)
    groups[key].append(ex)
    if ex["category"] != "irrelevance":
      calls = parse_tool_calls(ex["demonstration"]).calls
      assert key == " & ".join(sorted(world.canonical_call(c.name, {k: [v] for k, v in c.arguments.items()})
                                      for c in calls)), ex["query"]
  reworded = [g for g in groups.values() if len({e["query"] for e in g}) > 1]
  assert len(reworded) > 100  # e.g. "Convert $5k ..." / "Convert five thousand dollars ..." / "Convert 5000 ...".
  assert sum("irrelevance" in {e["category"] for e in g} and len({e["category"] for e in g}) > 1
             for g in reworded) > 20


# ---------------------------------------------------------------------------------------------------------
# arithmetic.


def test_arithmetic_splits_disjoint_by_problem():
  """All four splits at the ``grpo_arithmetic`` config's sizes (100,000 / 20,000 / 500 / 500)."""
  cfg = grpo_arithmetic.get_config("cpu").task
  sizes = {"sft": cfg.num_sft, "train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}
  problems = {s: ar.generate_problems(cfg.data_seed, n, s, mul_fraction=cfg.mul_fraction)
              for s, n in sizes.items()}
  assert set(problems) == set(ar.SPLITS)
  keys = {s: [ar.canonical_key(p) for p in ps] for s, ps in problems.items()}
  assert_disjoint(keys)
  assert_disjoint({s: [p.prompt for p in ps] for s, ps in problems.items()})
  assert len(set(keys["test"])) == cfg.num_test and len(set(keys["validation"])) == cfg.num_validation
  # Both operand orders of training problems occur, yet each lands in one split.
  flipped = [ar.Problem(p.b, p.op, p.a) for p in problems["sft"][:2000] if p.op == "+" and p.a != p.b]
  assert all(ar.bucket_of(p) == "sft" for p in flipped)


def test_arithmetic_key_is_invariant_to_operand_order():
  for a in range(10, 100, 7):
    for b in range(10, 100, 11):
      for op in "+*":
        assert ar.canonical_key(ar.Problem(a, op, b)) == ar.canonical_key(ar.Problem(b, op, a))
        assert ar.parse_prompt(ar.canonical_key(ar.Problem(a, op, b))).value == ar.Problem(a, op, b).value
  assert ar.canonical_key(ar.Problem(12, "+", 34)) != ar.canonical_key(ar.Problem(12, "*", 34))


# ---------------------------------------------------------------------------------------------------------
# fest_math (multistep_math).


def test_fest_math_splits_disjoint_by_chain():
  """Every split at the ``fest_math`` config's sizes, ``D_E`` at twice its shot count, and the easy / shifted
  test sets (not in ``Task``) at 256."""
  config = fest_math.get_config("fest_grpo")
  cfg = config.task
  sizes = {"easy_sft": cfg.num_sft, "hard_train": cfg.num_train, "expert": 2 * config.fest.num_shots,
           "hard_validation": cfg.num_validation, "hard_test": cfg.num_test, "easy_test": 256,
           "shifted_test": 256}
  assert set(sizes) == set(mm.SPLITS)
  problems = {s: mm.generate_problems(cfg.data_seed, n, s) for s, n in sizes.items()}
  keys = {s: [mm.canonical_key(p) for p in ps] for s, ps in problems.items()}
  # Every pair is disjoint, except the two test sets of different rules, which may hold one computation
  # under "=" and under "?" (neither trains anything; the module docstring).
  assert_disjoint({s: k for s, k in keys.items() if s != "easy_test"})
  assert_disjoint({s: k for s, k in keys.items() if s != "hard_test"})
  assert_disjoint({s: [p.prompt for p in ps] for s, ps in problems.items()})
  for split in sizes:
    if split not in ("easy_sft", "hard_train"):  # The two i.i.d. splits.
      assert len(set(keys[split])) == sizes[split], split


def _permuted_runs(problem, rng):
  """``problem`` with every run of commuting steps shuffled, or None if an intermediate value leaves range."""
  steps, runs = list(problem.steps), []
  for step in steps:
    if runs and (runs[-1][0][0] == "*") == (step[0] == "*"):
      runs[-1].append(step)
    else:
      runs.append([step])
  for run in runs:
    rng.shuffle(run)
  try:
    return mm.Problem(problem.start, tuple(s for run in runs for s in run), problem.rule)
  except ValueError:
    return None


def test_fest_math_key_is_invariant_to_commuting_steps():
  rng = random.Random(0)
  changed = 0
  # The easy chains under "=" and the shifted ones under "?" (the 2-step "?" chains are order-sensitive: no
  # commuting run there).
  for split in ("easy_sft", "shifted_test"):
    for problem in mm.generate_problems(0, 1000, split):
      other = _permuted_runs(problem, rng)
      if other is None:
        continue
      assert other.value == problem.value
      assert mm.canonical_key(other) == mm.canonical_key(problem)
      assert mm.bucket_of(other) == mm.bucket_of(problem)
      changed += other.prompt != problem.prompt
  assert changed > 300  # Many reordered chains exist, and they share the original's key and bucket.
  # Non-commuting reorders are different problems.
  assert mm.canonical_key("10+2*3=") != mm.canonical_key("10*3+2=")


# ---------------------------------------------------------------------------------------------------------
# frozenlake.


def test_frozenlake_splits_disjoint_by_map():
  """Representative sizes. The key is the map text or its transpose's, whichever is smaller (the prompt shows
  the map once, so there is no other wording of it; the transpose is the same puzzle mirrored)."""
  sizes = {"train": 400, "validation": 64, "test": 64, "validation_8x8": 32, "test_8x8": 32}
  assert set(sizes) == set(fl.SPLITS)
  maps = {s: fl.generate_maps(0, n, s) for s, n in sizes.items()}
  keys = {s: [fl.canonical_key(m) for m in ms] for s, ms in maps.items()}
  assert_disjoint(keys)
  for split, n in sizes.items():
    assert len(set(keys[split])) == n
  test_map = maps["test"][0]
  assert fl.map_text(test_map) in fl.FrozenLakeEnv(test_map).reset(seed=3)
  mirrored = tuple("".join(col) for col in zip(*test_map))
  assert fl.canonical_key(mirrored) == fl.canonical_key(test_map) and fl.bucket_of(mirrored) == "test"


# ---------------------------------------------------------------------------------------------------------
# Every registered task provides a validation split, disjoint from its other splits.


def _text(value):
  return value.decode() if isinstance(value, bytes) else value  # tfds sources give bytes.


def _task_keys(task, key):
  splits = {"sft": task.sft_source, "rl": task.rl_source, "validation": task.validation_examples,
            "test": task.test_examples}
  if task.expert_source is not None:
    splits["expert"] = task.expert_source
  return {name: [key(r) for r in records] for name, records in splits.items()}


@pytest.mark.parametrize("name,config,key", [
    ("tool_use", cast_tool_use.get_config("tiny"), tut.canonical_key),
    ("fest_math", fest_math.get_config("tiny"), lambda r: mm.canonical_key(r["prompt"])),
    ("arithmetic", grpo_arithmetic.get_config("tiny"), lambda r: ar.canonical_key(ar.parse_prompt(_text(r["prompt"])))),
])
def test_every_task_has_a_disjoint_validation_split(name, config, key, tmp_path):
  task = TASKS.get(name)(config.task, str(tmp_path))
  assert len(task.validation_examples) == config.task.num_validation > 0
  assert set(task.validation_examples[0]) >= {"prompt"}
  assert_disjoint(_task_keys(task, key))
