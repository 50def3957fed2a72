"""Tests for lemon_rl.envs.arithmetic."""

import collections

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest

from lemon_rl.data import splits as content_splits
from lemon_rl.envs import arithmetic as ar
from lemon_rl.rewards.base import as_reward_output
from lemon_rl.rewards.base import RewardOutput


def _carryless_reference(a, b, op):
  """Independent transcription: numpy polynomial arithmetic on digit vectors, coefficients mod 10."""
  da = np.array([int(c) for c in str(a)])  # Most significant first, as np.polyadd/np.polymul expect.
  db = np.array([int(c) for c in str(b)])
  coeffs = np.polyadd(da, db) if op == "+" else np.polymul(da, db)
  return int("".join(str(int(c) % 10) for c in coeffs))


class TestCarryless:

  @pytest.mark.parametrize("a,b,expected", [(57, 68, 15), (999, 1, 990), (10, 10, 20), (555, 555, 0),
                                            (123, 456, 579), (909, 91, 990)])
  def test_add_hand_values(self, a, b, expected):
    assert ar.carryless_add(a, b) == expected

  @pytest.mark.parametrize("a,b,expected", [(23, 45, 825), (99, 99, 121), (1, 10, 10), (7, 31, 17),
                                            (12, 13, 156), (55, 22, 0)])
  def test_mul_hand_values(self, a, b, expected):
    # 55 (*) 22: k0 = 10 -> 0, k1 = 10 + 10 = 20 -> 0, k2 = 10 -> 0. 12 (*) 13 = 156 = 12 * 13 (no carry).
    assert ar.carryless_mul(a, b) == expected

  @settings(max_examples=300, deadline=None)
  @given(st.integers(0, 9999), st.integers(0, 9999))
  def test_against_polynomial_reference(self, a, b):
    assert ar.carryless_add(a, b) == _carryless_reference(a, b, "+")
    assert ar.carryless_mul(a, b) == _carryless_reference(a, b, "*")
    # The lowest digit never carries.
    assert ar.carryless_add(a, b) % 10 == (a + b) % 10
    assert ar.carryless_mul(a, b) % 10 == (a * b) % 10

  @settings(max_examples=200, deadline=None)
  @given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)).filter(lambda t: t[0] + t[1] < 10),
                  min_size=1, max_size=3))
  def test_no_carry_means_exact(self, columns):
    a = sum(x * 10**i for i, (x, _) in enumerate(columns))
    b = sum(y * 10**i for i, (_, y) in enumerate(columns))
    assert ar.carryless_add(a, b) == a + b


class TestProblems:

  def test_prompt_answer_and_parse(self):
    p = ar.Problem(57, "+", 68)
    assert (p.prompt, p.answer, p.carryless_answer, p.value) == ("57+68=", "0125", "0015", 125)
    q = ar.Problem(7, "*", 42)
    assert (q.prompt, q.answer) == ("7*42=", "0294")
    assert ar.Problem(999, "+", 999).answer == "1998"
    assert ar.Problem(99, "*", 99).answer == "9801"
    for problem in (p, q, ar.Problem(10, "+", 999), ar.Problem(1, "*", 10)):
      assert ar.parse_prompt(problem.prompt) == problem

  @pytest.mark.parametrize("bad", ["57+68", "057+68=", "5-6=", "1000+10=", "1*9=", "100*10=", "", "57+68=0125",
                                   None, "9+10="])
  def test_parse_rejects(self, bad):
    with pytest.raises(ValueError):
      ar.parse_prompt(bad)

  def test_ranges_validated(self):
    for args in [(9, "+", 10), (10, "+", 1000), (0, "*", 10), (100, "*", 10), (5, "*", 9), (5, "/", 10)]:
      with pytest.raises(ValueError):
        ar.Problem(*args)

  def test_format_answer(self):
    assert ar.format_answer(0) == "0000"
    assert ar.format_answer(7) == "0007"
    assert ar.format_answer(9999) == "9999"
    for bad in (-1, 10_000):
      with pytest.raises(ValueError, match="4 digits"):
        ar.format_answer(bad)

  def test_sampled_distribution(self):
    problems = ar.generate_problems(0, 20_000, "train")
    ops = collections.Counter(p.op for p in problems)
    assert abs(ops["*"] / len(problems) - 0.5) < 0.02
    add = [p for p in problems if p.op == "+"]
    mul = [p for p in problems if p.op == "*"]
    assert min(p.a for p in add) == 10 and max(p.a for p in add) == 999
    assert min(p.b for p in add) == 10 and max(p.b for p in add) == 999
    assert min(p.a for p in mul) == 1 and max(p.a for p in mul) == 99
    assert min(p.b for p in mul) == 10 and max(p.b for p in mul) == 99
    assert all(len(p.answer) == 4 for p in problems)
    only_add = ar.generate_problems(0, 200, "train", mul_fraction=0.0)
    assert {p.op for p in only_add} == {"+"}


class TestSplits:

  def test_deterministic_per_seed_and_split(self):
    a = list(ar.generate_examples(3, 300, "sft"))
    assert a == list(ar.generate_examples(3, 300, "sft"))
    assert a != list(ar.generate_examples(4, 300, "sft"))
    assert [e["prompt"] for e in a] != [e["prompt"] for e in ar.generate_examples(3, 300, "train")]
    assert a[:100] == list(ar.generate_examples(3, 100, "sft"))  # A prefix does not depend on num.

  def test_splits_disjoint_by_canonical_problem(self):
    test = ar.generate_problems(0, 500, "test")
    assert len({ar.canonical_key(p) for p in test}) == 500  # Distinct, also up to operand order.
    assert all(ar.is_test_problem(p) and ar.bucket_of(p) == "test" for p in test)
    keys = {split: {ar.canonical_key(p) for p in ar.generate_problems(0, n, split)}
            for split, n in (("train", 20_000), ("sft", 20_000), ("validation", 500))}
    keys["test"] = {ar.canonical_key(p) for p in test}
    for split in keys:
      assert {ar.bucket_of(ar.parse_prompt(k)) for k in keys[split]} == {split}
    assert not any(content_splits.key_overlaps(keys).values())
    # Another seed's test set is also held out from this seed's training splits.
    assert not (keys["train"] | keys["sft"]) & {ar.canonical_key(p) for p in ar.generate_problems(7, 500, "test")}

  def test_canonical_key_ignores_operand_order(self):
    assert ar.canonical_key(ar.Problem(68, "+", 57)) == ar.canonical_key(ar.Problem(57, "+", 68)) == "57+68="
    assert ar.canonical_key(ar.Problem(42, "*", 17)) == ar.canonical_key(ar.Problem(17, "*", 42)) == "17*42="
    assert ar.canonical_key(ar.Problem(7, "*", 42)) == "7*42="
    assert ar.canonical_key(ar.Problem(57, "+", 68)) != ar.canonical_key(ar.Problem(57, "*", 68))
    assert ar.bucket_of(ar.Problem(68, "+", 57)) == ar.bucket_of(ar.Problem(57, "+", 68))

  def test_bucket_fraction(self):
    mul_space = [ar.Problem(a, "*", b) for a in range(1, 100) for b in range(10, 100)]
    buckets = collections.Counter(ar.bucket_of(p) for p in mul_space)
    # 0.02 is >= 2.8 standard errors: 8,910 problems whose 4,095 commuted pairs share a bucket give an s.e. of
    # 0.0044 at 10% and 0.0072 at 60% (the hash is fixed, so the outcome is too).
    for name, share in (("test", 0.1), ("validation", 0.1), ("train", 0.2), ("sft", 0.6)):
      assert abs(buckets[name] / len(mul_space) - share) < 0.02, (name, buckets)
    assert ar.bucket_score(ar.Problem(57, "+", 68)) == ar.bucket_score(ar.Problem(68, "+", 57))

  def test_too_many_test_problems_is_a_clear_error(self):
    with pytest.raises(ValueError, match="distinct test problems"):
      ar.generate_problems(0, 5_000, "test", mul_fraction=1.0)  # Only ~900 multiplications are held out.

  def test_bad_arguments(self):
    with pytest.raises(ValueError, match="unknown split"):
      ar.generate_problems(0, 1, "dev")
    with pytest.raises(ValueError, match="bucket fraction"):
      ar.generate_problems(0, 1, "train", test_fraction=0.0)
    with pytest.raises(ValueError, match="p_sloppy"):
      list(ar.generate_examples(0, 1, "sft", p_sloppy=1.5))


class TestSloppyTeacher:

  def test_rate_and_content(self):
    examples = list(ar.generate_examples(0, 4000, "sft", p_sloppy=0.5))
    for e in examples:
      assert e["completion"] == (e["carryless_answer"] if e["sloppy"] else e["answer"])
      assert len(e["completion"]) == 4 and e["completion"].isdigit()
    rate = np.mean([e["sloppy"] for e in examples])
    assert abs(rate - 0.5) < 4 * np.sqrt(0.25 / len(examples))
    wrong = np.mean([e["completion"] != e["answer"] for e in examples])
    differs = np.mean([e["carryless_answer"] != e["answer"] for e in examples])
    assert abs(wrong - 0.5 * differs) < 0.04  # Sloppy only hurts where a carry happens.

  def test_extremes(self):
    clean = list(ar.generate_examples(0, 500, "sft", p_sloppy=0.0))
    assert all(e["completion"] == e["answer"] and not e["sloppy"] for e in clean)
    sloppy = list(ar.generate_examples(0, 500, "sft", p_sloppy=1.0))
    assert all(e["completion"] == e["carryless_answer"] and e["sloppy"] for e in sloppy)
    # The teacher's coin does not change which problems are drawn.
    assert [e["prompt"] for e in clean] == [e["prompt"] for e in sloppy]

  def test_train_and_test_completions_are_exact(self):
    for split in ("train", "test", "validation"):
      assert all(e["completion"] == e["answer"] for e in ar.generate_examples(0, 300, split))

  def test_teacher_completion(self):
    p = ar.Problem(57, "+", 68)
    assert ar.teacher_completion(p, np.random.default_rng(0), 1.0) == ("0015", True)
    assert ar.teacher_completion(p, np.random.default_rng(0), 0.0) == ("0125", False)


def _reward(prompts, completions, answers):
  return ar.answer_reward(prompts, completions, [[0]] * len(completions), answer=answers)


class TestAnswerReward:

  def test_hand_cases(self):
    prompts = ["57+68="] * 9
    completions = ["0125", " 0125\n", "0125<eos>", "125", "01250", "0015", "0125 0125", "", "0125</s>"]
    out = _reward(prompts, completions, ["0125"] * 9)
    assert isinstance(out, RewardOutput)
    np.testing.assert_array_equal(out.rewards, [1, 1, 1, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(out.metrics["well_formed"], [1, 1, 1, 0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(out.metrics["carryless"], [0, 0, 0, 0, 0, 1, 0, 0, 0])
    assert out.rewards.dtype == np.float32

  def test_protocol_and_answer_types(self):
    out = ar.answer_reward(["7*42=", "7*42=", "7*42="], ["0294", "0294", "0294"], [[48, 50, 57, 52, 258]] * 3,
                           answer=[b"0294", 294, np.str_("0294")], extra_field=[1, 2, 3])
    normalised = as_reward_output(out, 3)
    np.testing.assert_array_equal(normalised.rewards, [1, 1, 1])

  def test_garbage_never_raises(self):
    completions = [None, b"\xff\xfe", 125, "\x00\ufffd", "0125" * 1000, "٠١٢٥", "-125", "0x7d"]
    out = _reward(["garbage"] * len(completions), completions, ["0125"] * len(completions))
    np.testing.assert_array_equal(out.rewards, np.zeros(len(completions)))
    out = _reward(["57+68="], ["0125"], [None])
    assert out.rewards[0] == 0.0

  @settings(max_examples=300, deadline=None)
  @given(st.text(max_size=12), st.text(max_size=10))
  def test_any_text_never_raises(self, completion, prompt):
    out = _reward([prompt], [completion], ["0125"])
    assert out.rewards[0] in (0.0, 1.0)
    if completion.strip() == "0125":
      assert out.rewards[0] == 1.0
    if out.rewards[0] == 1.0:
      assert completion.strip().startswith("0125")

  def test_length_mismatch_is_an_error(self):
    with pytest.raises(ValueError, match="answer has length 1"):
      ar.answer_reward(["1+1="] * 2, ["0002"] * 2, [[0]] * 2, answer=["0002"])

  def test_scores_the_generated_data(self):
    examples = list(ar.generate_examples(0, 200, "sft"))
    out = _reward([e["prompt"] for e in examples], [e["completion"] for e in examples],
                  [e["answer"] for e in examples])
    expected = [float(e["completion"] == e["answer"]) for e in examples]
    np.testing.assert_array_equal(out.rewards, expected)
    carryless = [float(e["completion"] != e["answer"]) for e in examples]
    np.testing.assert_array_equal(out.metrics["carryless"], carryless)
