"""The arithmetic task: ``"aaa+bbb="`` and ``"aa*bb="`` with a 4-digit answer, a sloppy teacher and a 0/1 verifier.

Problems (DESIGN.md, "Measured facts about RL at this scale"):

- addition ``a+b=`` with ``a, b`` uniform in ``[10, 999]``, e.g. ``"57+123="``;
- multiplication ``a*b=`` with ``a`` uniform in ``[1, 99]`` and ``b`` in ``[10, 99]``, e.g. ``"7*42="``.

Operands are written in plain decimal (no leading zeros). The answer is the exact result zero-padded to
``ANSWER_WIDTH = 4`` digits (the largest is ``999 + 999 = 1998`` and ``99 * 99 = 9801``), e.g. ``"0180"``; the
model is trained to emit those 4 digits then EOS.

Carry-less arithmetic (what the "sloppy teacher" writes with probability ``p_sloppy``). Write
``x = sum_i x_i 10^i`` with decimal digits ``x_i``:

- carry-less addition: ``(a (+) b)_i = (a_i + b_i) mod 10`` -- every column sum forgets its carry, e.g.
  ``57 (+) 68 = 15`` (7+8 -> 5, 5+6 -> 1), whereas ``57 + 68 = 125``;
- carry-less multiplication: the digit polynomials are multiplied with every coefficient reduced mod 10 and no
  carry ever propagated, ``(a (*) b)_k = (sum_{i+j=k} a_i b_j) mod 10``, e.g. ``23 (*) 45 = 825``
  (k=0: 3*5 = 15 -> 5, k=1: 2*5 + 3*4 = 22 -> 2, k=2: 2*4 = 8), whereas
  ``23 * 45 = 1035``. When no column overflows, the carry-less and exact results coincide.

Splits are disjoint by CONTENT (``lemon_rl.data.splits``): a problem's bucket is a stable hash (BLAKE2b) of
its canonical key (:func:`canonical_key`: the prompt with commutative operands sorted, so ``68+57=`` and
``57+68=`` are one problem). *Decision*: four buckets, ``test`` (``test_fraction`` = 10% of the key space),
``validation`` (10%), ``train`` (the RL prompts, 20%) and ``sft`` (the rest, 60%), one per split; every split
draws only from its own bucket, so SFT demonstrations, RL prompts, validation and test share no problem in
either operand order. ``test`` and ``validation`` hold distinct problems (without replacement), ``train`` and
``sft`` are i.i.d. (repeats possible). 490,545 addition and 4,905 multiplication keys exist (a
multiplication ``a*b`` with ``a < 10`` has no commuted form in range), so each bucket keeps every operand
size. Every generator is a pure function of ``(seed, split)`` and prefix-stable in ``num``.

The verifier :func:`answer_reward` follows ``lemon_rl/rewards/base.py``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Sequence

import numpy as np

from lemon_rl.data import splits as content_splits
from lemon_rl.rewards.base import RewardOutput
from lemon_rl.rewards.formats import as_text, check_same_length, clean_completion

ANSWER_WIDTH = 4
ADD_RANGE = (10, 999)  # Both operands, inclusive.
MUL_LHS_RANGE = (1, 99)
MUL_RHS_RANGE = (10, 99)
DEFAULT_TEST_FRACTION = 0.1
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_TRAIN_FRACTION = 0.2  # The RL prompts' bucket; SFT gets the rest.
DEFAULT_P_SLOPPY = 0.5
DEFAULT_MUL_FRACTION = 0.5
SPLITS = ("train", "sft", "test", "validation")  # Appended only: a split's stream is its index.
_DISTINCT_SPLITS = ("test", "validation")
_SALT = b"lemon-arith"
# Consecutive draws without a new usable problem after which generation gives up (the test bucket is exhausted).
_MAX_STALLED_DRAWS = 50_000

_PROMPT_RE = re.compile(r"^([0-9]{1,3})([+*])([0-9]{1,3})=$")
_ANSWER_RE = re.compile(r"^[0-9]{%d}$" % ANSWER_WIDTH)


def _digits(x: int) -> list[int]:
  """Decimal digits of ``x >= 0``, least significant first (``0 -> [0]``)."""
  if x < 0:
    raise ValueError(f"expected a non-negative integer, got {x}")
  return [int(c) for c in reversed(str(x))]


def _from_digits(digits: Sequence[int]) -> int:
  return sum(d * 10**i for i, d in enumerate(digits))


def carryless_add(a: int, b: int) -> int:
  """``(a (+) b)_i = (a_i + b_i) mod 10``: column sums with every carry dropped."""
  da, db = _digits(a), _digits(b)
  n = max(len(da), len(db))
  da += [0] * (n - len(da))
  db += [0] * (n - len(db))
  return _from_digits([(x + y) % 10 for x, y in zip(da, db)])


def carryless_mul(a: int, b: int) -> int:
  """``(a (*) b)_k = (sum_{i+j=k} a_i b_j) mod 10``: digit-polynomial product, coefficients mod 10.

  Example: ``23 (*) 45``: ``k=0: 3*5 = 15 -> 5``, ``k=1: 2*5 + 3*4 = 22 -> 2``, ``k=2: 2*4 = 8``, so ``825``
  (the exact product is ``1035``).
  """
  da, db = _digits(a), _digits(b)
  coeffs = [0] * (len(da) + len(db) - 1)
  for i, x in enumerate(da):
    for j, y in enumerate(db):
      coeffs[i + j] += x * y
  return _from_digits([c % 10 for c in coeffs])


def format_answer(value: int) -> str:
  """``value`` zero-padded to ``ANSWER_WIDTH`` digits; ``7 -> "0007"``."""
  if not 0 <= value < 10**ANSWER_WIDTH:
    raise ValueError(f"answer {value} does not fit in {ANSWER_WIDTH} digits")
  return f"{value:0{ANSWER_WIDTH}d}"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem ``a op b =`` with ``op`` in ``{"+", "*"}``."""

  a: int
  op: str
  b: int

  def __post_init__(self):
    if self.op == "+":
      lo, hi = ADD_RANGE
      ok = lo <= self.a <= hi and lo <= self.b <= hi
    elif self.op == "*":
      ok = (MUL_LHS_RANGE[0] <= self.a <= MUL_LHS_RANGE[1] and MUL_RHS_RANGE[0] <= self.b <= MUL_RHS_RANGE[1])
    else:
      raise ValueError(f"op must be '+' or '*', got {self.op!r}")
    if not ok:
      raise ValueError(f"operands out of range for {self.a}{self.op}{self.b}: addition takes {ADD_RANGE} for both, "
                       f"multiplication {MUL_LHS_RANGE} x {MUL_RHS_RANGE}")

  @property
  def prompt(self) -> str:
    return f"{self.a}{self.op}{self.b}="

  @property
  def value(self) -> int:
    return self.a + self.b if self.op == "+" else self.a * self.b

  @property
  def carryless_value(self) -> int:
    return carryless_add(self.a, self.b) if self.op == "+" else carryless_mul(self.a, self.b)

  @property
  def answer(self) -> str:
    return format_answer(self.value)

  @property
  def carryless_answer(self) -> str:
    return format_answer(self.carryless_value)


def parse_prompt(prompt: str) -> Problem:
  """Inverse of ``Problem.prompt``; raises ``ValueError`` for anything else."""
  match = _PROMPT_RE.match(prompt) if isinstance(prompt, str) else None
  if match is None or any(len(g) > 1 and g[0] == "0" for g in (match.group(1), match.group(3))):
    raise ValueError(f"not an arithmetic prompt: {prompt!r}")
  return Problem(int(match.group(1)), match.group(2), int(match.group(3)))


def canonical_key(problem: Problem) -> str:
  """The content key of a problem: its prompt with the operands in ascending order.

  Addition and multiplication commute, so ``a+b`` and ``b+a`` are one problem: ``canonical_key`` of
  ``68+57=`` and of ``57+68=`` is ``"57+68="``. (The sorted form is itself a valid problem: a multiplication
  operand below 10 is always the smaller one.)
  """
  return f"{min(problem.a, problem.b)}{problem.op}{max(problem.a, problem.b)}="


def _fractions(test_fraction: float, validation_fraction: float, train_fraction: float):
  fractions = (("test", test_fraction), ("validation", validation_fraction), ("train", train_fraction))
  content_splits.check_fractions(fractions, "sft")
  return fractions


def bucket_of(problem: Problem, test_fraction: float = DEFAULT_TEST_FRACTION,
              validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
              train_fraction: float = DEFAULT_TRAIN_FRACTION) -> str:
  """The split whose bucket holds ``problem`` (``"test"``, ``"validation"``, ``"train"`` or ``"sft"``)."""
  return content_splits.content_bucket(canonical_key(problem), _SALT,
                                       _fractions(test_fraction, validation_fraction, train_fraction), "sft")


def bucket_score(problem: Problem) -> float:
  """The stable number in ``[0, 1)`` that places ``problem`` (BLAKE2b of its canonical key, seed-free)."""
  return content_splits.content_score(canonical_key(problem), _SALT)


def is_test_problem(problem: Problem, test_fraction: float = DEFAULT_TEST_FRACTION) -> bool:
  """Whether ``problem`` is held out (in the test bucket)."""
  return bucket_score(problem) < test_fraction


def sample_problem(rng: np.random.Generator, mul_fraction: float = DEFAULT_MUL_FRACTION) -> Problem:
  """One uniformly random problem: multiplication with probability ``mul_fraction``, else addition."""
  if rng.random() < mul_fraction:
    return Problem(int(rng.integers(MUL_LHS_RANGE[0], MUL_LHS_RANGE[1] + 1)), "*",
                   int(rng.integers(MUL_RHS_RANGE[0], MUL_RHS_RANGE[1] + 1)))
  return Problem(int(rng.integers(ADD_RANGE[0], ADD_RANGE[1] + 1)), "+",
                 int(rng.integers(ADD_RANGE[0], ADD_RANGE[1] + 1)))


def split_rng(seed: int, split: str) -> np.random.Generator:
  """The generator for ``(seed, split)``; different splits get independent streams."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  return np.random.default_rng([int(seed), SPLITS.index(split)])


def generate_problems(seed: int, num: int, split: str, *, mul_fraction: float = DEFAULT_MUL_FRACTION,
                      test_fraction: float = DEFAULT_TEST_FRACTION,
                      validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                      train_fraction: float = DEFAULT_TRAIN_FRACTION) -> list[Problem]:
  """``num`` problems of ``split``; deterministic in ``(seed, split)``.

  ``train``/``sft``: i.i.d. from their buckets (repeats possible). ``test``/``validation``: distinct problems
  (by canonical key) from theirs.
  """
  return [p for p, _ in _generate(seed, num, split, mul_fraction, test_fraction, validation_fraction,
                                  train_fraction, p_sloppy=0.0)]


def teacher_completion(problem: Problem, rng: np.random.Generator,
                       p_sloppy: float = DEFAULT_P_SLOPPY) -> tuple[str, bool]:
  """The sloppy teacher: the carry-less answer with probability ``p_sloppy``, else the exact one.

  Returns ``(completion, sloppy)``; ``completion`` is the 4 digits (the caller appends EOS when tokenising).
  """
  if not 0.0 <= p_sloppy <= 1.0:
    raise ValueError(f"p_sloppy must be in [0, 1], got {p_sloppy}")
  sloppy = bool(rng.random() < p_sloppy)
  return (problem.carryless_answer if sloppy else problem.answer), sloppy


def _generate(seed: int, num: int, split: str, mul_fraction: float, test_fraction: float,
              validation_fraction: float, train_fraction: float,
              p_sloppy: float) -> Iterator[tuple[Problem, tuple[str, bool]]]:
  fractions = _fractions(test_fraction, validation_fraction, train_fraction)
  if not 0.0 <= mul_fraction <= 1.0:
    raise ValueError(f"mul_fraction must be in [0, 1], got {mul_fraction}")
  if num < 0:
    raise ValueError(f"num must be >= 0, got {num}")
  rng = split_rng(seed, split)
  teacher_rng = np.random.default_rng([int(seed), SPLITS.index(split), 1])
  distinct = split in _DISTINCT_SPLITS
  problems = content_splits.draw_from_bucket(
      lambda: sample_problem(rng, mul_fraction), canonical_key,
      lambda key: content_splits.content_bucket(key, _SALT, fractions, "sft"), split, num, distinct=distinct,
      max_misses=_MAX_STALLED_DRAWS, what=f"{'distinct ' if distinct else ''}{split} problems")
  for problem in problems:
    completion = teacher_completion(problem, teacher_rng, p_sloppy) if split == "sft" else (problem.answer, False)
    yield problem, completion


def generate_examples(seed: int, num: int, split: str, *, p_sloppy: float = DEFAULT_P_SLOPPY,
                      mul_fraction: float = DEFAULT_MUL_FRACTION,
                      test_fraction: float = DEFAULT_TEST_FRACTION,
                      validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                      train_fraction: float = DEFAULT_TRAIN_FRACTION) -> Iterator[dict[str, Any]]:
  """Records of ``split``, deterministic in ``(seed, split)``.

  Each record: ``prompt`` (e.g. ``"57+68="``), ``answer`` (exact, 4 digits), ``completion`` (the demonstration:
  the sloppy teacher's for ``sft``, the exact answer otherwise), ``carryless_answer``, ``sloppy`` (whether the
  completion is the carry-less one), ``op``, ``a``, ``b``.
  """
  for problem, (completion, sloppy) in _generate(seed, num, split, mul_fraction, test_fraction,
                                                 validation_fraction, train_fraction, p_sloppy):
    yield {"prompt": problem.prompt, "answer": problem.answer, "completion": completion,
           "carryless_answer": problem.carryless_answer, "sloppy": sloppy, "op": problem.op,
           "a": problem.a, "b": problem.b}


def _normalise_answer(answer: Any) -> str | None:
  if isinstance(answer, (int, np.integer)) and not isinstance(answer, bool):
    return format_answer(int(answer)) if 0 <= answer < 10**ANSWER_WIDTH else None
  text = as_text(answer)
  return text.strip() if text is not None else None


def answer_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  answer: list[Any], **_: Any) -> RewardOutput:
  """Exact-answer verifier: ``r_n = 1`` iff ``completions[n]`` (whitespace and trailing EOS strings stripped)
  equals the 4-digit ``answer[n]``, else ``0``.

  Never raises on a malformed completion (garbage, ``None``, bytes); raises ``ValueError`` only if the lists have
  different lengths (a caller bug). Metrics ``[N]``: ``well_formed`` (exactly 4 digits) and ``carryless`` (the
  completion is the carry-less answer and that differs from the exact one: the sloppy teacher's mistake).
  """
  n = check_same_length("answer_reward", completions, prompts=prompts, completion_ids=completion_ids,
                        answer=answer)
  rewards = np.zeros(n, np.float32)
  well_formed = np.zeros(n, np.float32)
  carryless = np.zeros(n, np.float32)
  for i, (prompt, completion, gold) in enumerate(zip(prompts, completions, answer)):
    text = clean_completion(completion)
    gold = _normalise_answer(gold)
    if text is None or not _ANSWER_RE.match(text):
      continue
    well_formed[i] = 1.0
    if gold is not None and text == gold:
      rewards[i] = 1.0
      continue
    try:
      problem = parse_prompt(as_text(prompt) or "")
    except ValueError:
      continue
    if problem.carryless_value != problem.value and text == problem.carryless_answer:
      carryless[i] = 1.0
  return RewardOutput(rewards, {"well_formed": well_formed, "carryless": carryless})
