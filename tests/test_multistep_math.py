"""Tests of the FEST task (lemon_rl.envs.multistep_math) and its task builder."""

import re

import ml_collections
import numpy as np
import pytest

from lemon_rl.data import splits as content_splits
from lemon_rl.envs import multistep_math as mm
from lemon_rl.envs.tasks import TASKS

NUM = 200  # Records per split in the property tests (the 2-step test bucket holds 269 computations).


@pytest.fixture(scope="module")
def records():
  return {split: list(mm.generate_examples(0, NUM, split)) for split in mm.SPLITS}


def evaluate_chain(prompt: str) -> int:
  """Independent evaluation of a chain prompt: ``"07+5*3-4="`` left to right, ``"07-4*3+5?"`` right to left."""
  tokens = re.findall(r"[+*-]|[0-9]+", prompt[:-1])
  value, steps = int(tokens[0]), list(zip(tokens[1::2], tokens[2::2]))
  for op, operand in steps if prompt.endswith("=") else steps[::-1]:
    value = {"+": value + int(operand), "-": value - int(operand), "*": value * int(operand)}[op]
  return value


def score(completions, answers, prompts=None):
  prompts = prompts or [""] * len(completions)
  return mm.answer_reward(prompts, completions, [[0]] * len(completions), answers)


class TestProblems:

  def test_hand_example(self):
    problem = mm.Problem(7, (("+", 5), ("*", 3), ("-", 4)))
    assert problem.prompt == "07+5*3-4="
    assert problem.solution == "07+5=12;12*3=36;36-4=32;#32"
    assert problem.answer == "32"
    assert problem.values == [7, 12, 36, 32]
    assert mm.parse_prompt(problem.prompt) == problem
    assert len(problem.prompt) == mm.prompt_length(3) and len(problem.solution) == mm.solution_length(3)

  def test_hand_example_right_to_left(self):
    problem = mm.Problem(7, (("+", 5), ("*", 3), ("-", 4)), "?")
    assert problem.prompt == "07-4*3+5?"  # The same computation, written reversed.
    assert problem.solution == mm.Problem(7, problem.steps).solution == "07+5=12;12*3=36;36-4=32;#32"
    assert mm.parse_prompt("07-4*3+5?") == problem
    assert problem.order_sensitive  # Read left to right: (7 - 4) * 3 + 5 = 14, not 32.
    assert not mm.Problem(7, (("+", 5), ("-", 4)), "?").order_sensitive  # Commuting steps: one answer.
    assert mm.Problem(5, (("*", 2), ("-", 6)), "?").order_sensitive  # 5 - 6 leaves the range: counts.
    assert mm.canonical_key(problem) == mm.canonical_key("07+5*3-4=")  # The rule is not part of the key.
    with pytest.raises(ValueError, match="rule"):
      mm.Problem(7, (("+", 5),), "!")

  @pytest.mark.parametrize("start, steps", [
      (100, (("+", 1),)), (95, (("+", 5),)), (5, (("-", 6),)), (40, (("*", 3),)), (5, (("*", 4),)),
      (5, (("+", 10),)), (5, (("/", 2),)), (5, (("+", 0),)), (5, ()), (5, (("+", 1),) * (mm.MAX_STEPS + 1))])
  def test_invalid_problems_raise(self, start, steps):
    with pytest.raises(ValueError):
      mm.Problem(start, steps)

  @pytest.mark.parametrize("prompt", ["7+5=", "07+05=", "07+5", "07/5=", "07+5=12", "", "99+5=", "07+5!",
                                      "07+5?=", "05*2-6?"])
  def test_parse_prompt_rejects(self, prompt):
    with pytest.raises(ValueError):
      mm.parse_prompt(prompt)

  def test_worked_solutions_are_correct(self, records):
    for split, recs in records.items():
      for r in recs:
        lines = r["solution"].split(";")
        assert lines[-1] == "#" + r["answer"], r
        steps = lines[:-1]
        assert len(steps) == r["num_steps"]
        assert all(mm.line_is_correct(line) for line in steps), r
        # Each line starts from the previous line's result and ends with the answer.
        results = [line.split("=")[1] for line in steps]
        assert all(line.startswith(prev) for prev, line in zip(results, steps[1:])), r
        assert steps[0].startswith(r["prompt"][:mm.NUM_WIDTH]) and results[-1] == r["answer"]
        # The answer is the prompt's value (an independent evaluation) and every value is in range.
        assert int(r["answer"]) == evaluate_chain(r["prompt"])
        assert all(0 <= int(v) <= 99 for v in results)
        assert r["split"] == split
        assert set(r) == {"prompt", "answer", "solution", "num_steps", "split"}

  def test_step_counts_per_split(self, records):
    for split, recs in records.items():
      lo, hi = mm.SPLIT_STEPS[split]
      counts = {r["num_steps"] for r in recs}
      assert counts == set(range(lo, hi + 1)), (split, counts)
      assert all(r["prompt"].count("+") + r["prompt"].count("-") + r["prompt"].count("*") == r["num_steps"]
                 for r in recs)
    # The hard chains are no longer than the starting policy's: only the rule is new.
    assert mm.SPLIT_STEPS["hard_train"][1] <= mm.SPLIT_STEPS["easy_sft"][1]
    assert mm.SPLIT_STEPS["hard_test"][1] < mm.SPLIT_STEPS["shifted_test"][0]

  def test_rules_per_split(self, records):
    for split, recs in records.items():
      rule = mm.SPLIT_RULE[split]
      assert all(r["prompt"].endswith(rule) for r in recs), split
      if rule == mm.RIGHT_TO_LEFT:  # Read left to right, every hard prompt gives another answer.
        assert all(int(r["answer"]) != evaluate_chain(r["prompt"][:-1] + "=") for r in recs), split

  def test_all_operations_occur(self, records):
    ops = "".join(r["prompt"] for r in records["hard_train"])
    for op in mm.OPS:
      assert ops.count(op) > 50

  def test_length_limits(self, records):
    for recs in records.values():
      for r in recs:
        assert len(r["prompt"]) < mm.MAX_PROMPT_LEN and len(r["prompt"]) == mm.prompt_length(r["num_steps"])
        assert len(r["solution"]) < mm.MAX_SOLUTION_LEN
        assert len(r["solution"]) == mm.solution_length(r["num_steps"])
    assert mm.prompt_length(mm.MAX_STEPS) < mm.MAX_PROMPT_LEN
    assert mm.solution_length(mm.MAX_STEPS) < mm.MAX_SOLUTION_LEN


class TestSplits:

  def test_disjoint_by_canonical_key(self, records):
    keys = {split: {mm.canonical_key(r["prompt"]) for r in recs} for split, recs in records.items()}
    overlaps = content_splits.key_overlaps(keys)
    # The two test sets of different rules may share a computation (module docstring); no other pair may.
    allowed = {("easy_test", "hard_test"), ("hard_test", "easy_test")}
    assert not any(n for pair, n in overlaps.items() if pair not in allowed), overlaps

  def test_canonical_key_sorts_commuting_runs_only(self):
    assert mm.canonical_key("07+5-3*2*3=") == mm.canonical_key("07-3+5*3*2=") == "07(+5-3)(*2*3)="
    assert evaluate_chain("07+5-3*2*3=") == evaluate_chain("07-3+5*3*2=")
    assert mm.canonical_key("07+5*2=") != mm.canonical_key("07*2+5=")  # Different answers: not one problem.
    assert mm.canonical_key("07+5-1+1=") != mm.canonical_key("07+5=")  # The step count is part of the problem.
    assert mm.canonical_key(mm.parse_prompt("12-4+9=")) == mm.canonical_key("12+9-4=")

  def test_buckets(self, records):
    expected = {"easy_sft": "sft", "hard_train": "rl", "expert": "expert", "easy_test": "test",
                "hard_test": "test", "shifted_test": "test", "hard_validation": "validation"}
    assert set(expected) == set(mm.SPLITS)
    for split, recs in records.items():
      assert {mm.bucket_of(r["prompt"]) for r in recs} == {expected[split]}

  def test_distinct_where_promised(self, records):
    for split in ("easy_test", "expert", "hard_validation", "hard_test", "shifted_test"):
      assert len({mm.canonical_key(r["prompt"]) for r in records[split]}) == NUM, split

  def test_deterministic(self, records):
    for split in mm.SPLITS:
      assert list(mm.generate_examples(0, NUM, split)) == records[split]
    assert list(mm.generate_examples(1, 50, "hard_test")) != records["hard_test"][:50]

  def test_expert_shots_are_nested(self):
    small, large = mm.expert_demonstrations(3, 64), mm.expert_demonstrations(3, 128)
    assert small == large[:64]
    assert all(r["completion"] == r["solution"] for r in large)

  def test_helpers(self):
    rl = mm.rl_prompts(0, 20)
    assert all("solution" not in r and "completion" not in r for r in rl)
    assert [r["prompt"] for r in rl] == [r["prompt"] for r in mm.generate_examples(0, 20, "hard_train")]
    sft = mm.sft_demonstrations(0, 20)
    assert all(r["completion"] == r["solution"] and r["num_steps"] <= 2 and r["prompt"][-1] == "=" for r in sft)
    assert all(r["num_steps"] == 3 and r["prompt"][-1] == "?" for r in mm.shifted_test(0, 20))
    assert mm.hard_test(0, 20) == list(mm.generate_examples(0, 20, "hard_test"))
    assert mm.hard_validation(0, 20) == list(mm.generate_examples(0, 20, "hard_validation"))
    assert all(2 <= r["num_steps"] <= 3 for r in mm.hard_validation(0, 20))

  def test_num_steps_override_and_errors(self):
    recs = list(mm.generate_examples(0, 20, "hard_test", num_steps=(5, 5)))
    assert {r["num_steps"] for r in recs} == {5}
    with pytest.raises(ValueError, match="unknown split"):
      mm.generate_problems(0, 1, "train")
    with pytest.raises(ValueError, match="num_steps"):
      mm.generate_problems(0, 1, "hard_test", num_steps=(0, 2))
    with pytest.raises(ValueError, match="num must be"):
      mm.generate_problems(0, -1, "hard_test")
    with pytest.raises(ValueError, match="fraction"):
      mm.generate_problems(0, 1, "hard_test", test_fraction=0.6, expert_fraction=0.5)
    with pytest.raises(ValueError, match="distinct"):  # Only 1,792 one-step chains exist.
      mm.generate_problems(0, 5000, "easy_test", num_steps=(1, 1))
    with pytest.raises(ValueError, match="num_shots"):
      mm.expert_demonstrations(0, 0)


class TestVerifier:

  def test_accepts_gold(self, records):
    for split in ("easy_sft", "hard_test", "shifted_test"):
      recs = records[split]
      out = score([r["solution"] for r in recs], [r["answer"] for r in recs], [r["prompt"] for r in recs])
      np.testing.assert_array_equal(out.rewards, 1.0)
      np.testing.assert_array_equal(out.metrics["well_formed"], 1.0)
      np.testing.assert_array_equal(out.metrics["line_accuracy"], 1.0)
      np.testing.assert_array_equal(out.metrics["complete"], 1.0)
      np.testing.assert_array_equal(out.metrics["num_lines"], [r["num_steps"] for r in recs])

  def test_hand_cases(self):
    gold = "07+5=12;12*3=36;36-4=32;#32"
    completions = [
        gold,                                # 1: the worked solution
        "#32",                               # 1: the final answer alone
        gold + "<eos>",                      # 1: trailing EOS string
        "  " + gold + " \n",                 # 1: whitespace
        "07+5=12;#12#32",                    # 1: the last "#" counts
        "07+5=12;12*3=36;#36",               # 0: stopped early
        "07+5=12;12*3=36;36-4=32;#33",       # 0: wrong answer
        "07+5=12;12*3=36;36-4=32;#32;",      # 0: junk after the answer
        "07+5=12;12*3=36;36-4=32;",          # 0: no answer
        "#",                                 # 0: empty answer
        "#-32",                              # 0: not a digit string
        "",                                  # 0: empty
    ]
    out = score(completions, ["32"] * len(completions), ["07+5*3-4="] * len(completions))
    np.testing.assert_array_equal(out.rewards, [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(out.metrics["well_formed"], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(out.metrics["num_lines"], [3, 0, 3, 3, 2, 2, 3, 3, 3, 0, 0, 0])
    np.testing.assert_array_equal(out.metrics["complete"], [1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0])

  def test_line_accuracy(self):
    out = score(["07+5=12;12*3=35;35-4=31;#31", "07+5=12;garbage;#12"], ["32", "32"])
    np.testing.assert_allclose(out.metrics["line_accuracy"], [2 / 3, 0.5])  # 12*3=35 is wrong.
    np.testing.assert_array_equal(out.metrics["complete"], 0.0)  # No prompt given: unknown step count.

  def test_answer_forms(self):
    out = score(["#07", "#7", "#07", "#7", "#08"], ["07", "07", 7, np.int64(7), 7])
    np.testing.assert_array_equal(out.rewards, [1, 1, 1, 1, 0])

  def test_garbage_never_raises(self):
    completions = [None, b"#32", b"\xff\xfe#", 12, "\x00#32\x00", "#" * 500, "9" * 1000, "#" + "9" * 100]
    answers = ["32", "32", "32", "32", "32", None, "32", "32"]
    out = score(completions, answers, [None, "x", "07+5*3-4="] + ["?"] * 5)
    np.testing.assert_array_equal(out.rewards, [0, 1, 0, 0, 0, 0, 0, 0])

  def test_length_mismatch_raises(self):
    with pytest.raises(ValueError, match="answer"):
      mm.answer_reward(["a"], ["#1"], [[1]], ["1", "2"])


class TestTaskBuilder:

  def test_fest_math_task(self):
    cfg = ml_collections.ConfigDict(dict(data_seed=0, num_sft=40, num_train=30, num_test=20, num_validation=24,
                                         num_shots=16))
    task = TASKS.get("fest_math")(cfg, "/nonexistent")
    assert len(task.sft_source) == 40 and len(task.rl_source) == 30 and len(task.test_examples) == 20
    assert task.validation_examples == mm.hard_validation(0, 24)
    assert all(r["completion"] == r["solution"] and r["prompt"][-1] == "=" for r in task.sft_source)
    assert all("solution" not in r and r["prompt"][-1] == "?" for r in task.rl_source)
    assert task.test_examples == mm.hard_test(0, 20)
    assert task.max_new_tokens >= mm.solution_length(3) + 1
    assert task.max_completion_len >= max(len(r["completion"]) for r in task.sft_source) + 1
    assert task.prompt_len >= 1 + max(len(r["prompt"]) for r in task.rl_source + task.test_examples)
    assert task.expert_source == mm.expert_demonstrations(0, 16)
    assert all(r["prompt"][-1] == "?" and r["completion"] == r["solution"] for r in task.expert_source)
    hard = task.test_examples
    out = task.eval_reward([r["prompt"] for r in hard], [r["solution"] for r in hard], [[0]] * 20,
                           **{k: [r[k] for r in hard] for k in hard[0] if k != "prompt"})
    np.testing.assert_array_equal(out.rewards, 1.0)
    ids = task.tokenizer.encode(hard[0]["solution"])
    assert task.tokenizer.decode(ids) == hard[0]["solution"]

  def test_bad_config(self):
    cfg = ml_collections.ConfigDict(dict(data_seed=0, num_sft=4, num_train=3, num_test=2, num_validation=2,
                                         num_shots=0))
    with pytest.raises(ValueError, match="num_shots"):
      TASKS.get("fest_math")(cfg, "")
