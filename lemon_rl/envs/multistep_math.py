"""The FEST task: chains of one-digit operations on two-digit values under two evaluation rules.

See METHODS.md section 2 (FEST).

A problem is a start value and ``k`` operations with one-digit operands, applied in sequence (a chain, no
precedence); values are written with exactly ``NUM_WIDTH = 2`` digits. The prompt's last byte names the RULE,
the order in which the written operations are applied:

  rule "="  left to right   prompt "07+5*3-4="   solution "07+5=12;12*3=36;36-4=32;#32"
  rule "?"  right to left   prompt "07-4*3+5?"   solution "07+5=12;12*3=36;36-4=32;#32"

The solution is one line ``"a op b=c;"`` per step in the order of application, then ``"#"`` and the answer,
under either rule: the two prompts above are one computation. Values stay in ``VALUE_RANGE = [0, 99]`` by
construction: at each step (in application order) the generator picks uniformly among the operations that
keep the value in range (``OPERAND_RANGES``: ``+b`` and ``-b`` with ``1 <= b <= 9``, ``*b`` with
``b in {2, 3}``), then ``b`` uniformly among the operands that do. A step line is ``STEP_LEN = 8`` bytes, so a
``k``-step prompt has ``2k + 3`` bytes and a solution ``8k + 3``.

The missing piece is a PROCEDURE (issue 10's redesign): the starting policy is fine-tuned on worked solutions
of chains of 1-2 steps under rule ``"="`` only. It masters every line and the length of the hard set but has
never seen rule ``"?"``. The hard chains (2 steps, rule ``"?"``) are ORDER-SENSITIVE: read left to right they
give another answer (or leave the value range), so the answer is right only if the procedure (read the
operations from the right) is. Worked ``"?"`` solutions, which few-shot expert data (``D_E``) supplies, teach
exactly that piece. SHIFTED chains (3 steps, rule ``"?"``) test it one step beyond every trained length.

Measured (pilot, seed 0, ``configs/fest_math.py`` with its ``tiny`` model preset, 128 validation problems, 8 samples at
temperature 1): after the easy SFT (500 steps x 128) easy chains are solved greedily at 0.94 and the hard
set at Avg@8 0.003, Pass@8 0.023 (the lines written after a ``"?"`` are mostly not arithmetic); 100 SFT steps
x 32 on 128 worked ``"?"`` solutions give Avg@8 0.22, Pass@8 0.50 (easy greedy 0.07: forgotten), 200 steps
with three easy demonstrations per shot mixed in give 0.32, 0.58 (easy 0.81). So the shots can teach the
procedure, and the start leaves RL nearly all-wrong groups.

*Decision* (measured on the previous design): the hard set must not be longer than the starting policy's
chains. With easy chains of 1-2 steps and hard ones of 4-5, the policy garbled the third line, line accuracy
capped a full chain's chance near 0, and 93% of groups stayed all-wrong for every arm: the bottleneck was
length generalisation, not a procedure that a few hundred demonstrations can teach.

Splits (``SPLIT_STEPS`` gives the step range of each, ``SPLIT_RULE`` its rule):

===============  =====  ====  ==========  ====================================================
split            steps  rule  bucket      use
===============  =====  ====  ==========  ====================================================
easy_sft         1-2    =     sft         SFT demonstrations of the starting policy (i.i.d.)
easy_test        1-2    =     test        held-out check of the starting policy (distinct)
expert           2      ?     expert      ``D_E``: hard problems with worked solutions (distinct)
hard_train       2      ?     rl          ``D_I``: hard problems, answers only for RL (i.i.d.)
hard_validation  2      ?     validation  hard problems for tuning hyper-parameters (distinct)
hard_test        2      ?     test        held-out hard problems (distinct)
shifted_test     3      ?     test        out-of-distribution: a longer chain (distinct)
===============  =====  ====  ==========  ====================================================

Buckets make the splits disjoint by CONTENT, by construction (``lemon_rl.data.splits``): a stable hash
(BLAKE2b) of the problem's canonical key (:func:`canonical_key`) gives a score ``s in [0, 1)``;
``s < test_fraction`` is the test bucket, the next ``expert_fraction`` the expert bucket, the next
``validation_fraction`` the validation bucket, the next ``rl_fraction`` the RL bucket, the rest (50% by
default) the SFT bucket. *Decision*: the key is the COMPUTATION, whatever the rule that wrote it: the steps
in application order with every maximal run of commuting steps sorted (``07+5-3*2`` and ``07-3+5*2`` are one
problem: additions and subtractions commute with each other, multiplications with each other, so both chains
have the same answer and lines of the same arithmetic), so neither a reordered chain nor the same chain under
the other rule can carry an answer or a worked line into another split. Every split has its own bucket
except the three test splits, which share the test bucket: each is distinct, and a computation may be in
``easy_test`` under ``"="`` and in ``hard_test`` under ``"?"`` (neither trains anything). Every generator
is a pure function of ``(seed, split)``; the distinct splits are drawn sequentially, so
``expert_demonstrations(seed, 64)`` is a prefix of ``expert_demonstrations(seed, 128)``.

The verifier :func:`answer_reward` follows ``lemon_rl/rewards/base.py``: reward 1 iff the text after the last
``"#"`` is the answer (as a decimal integer, so ``"#7"`` and ``"#07"`` both answer ``"07"``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

import numpy as np

from lemon_rl.data import splits as content_splits
from lemon_rl.rewards.base import RewardOutput
from lemon_rl.rewards.formats import as_text, check_same_length, clean_completion

NUM_WIDTH = 2
VALUE_RANGE = (0, 99)  # Start value, every intermediate value and the answer, inclusive.
OPERAND_RANGES = {"+": (1, 9), "-": (1, 9), "*": (2, 3)}  # Inclusive; further capped to stay in range.
OPS = tuple(OPERAND_RANGES)
STEP_LEN = 2 * NUM_WIDTH + 4  # "aa+b=cc;"
ANSWER_LEN = NUM_WIDTH + 1  # "#cc"
MAX_STEPS = 10
MAX_PROMPT_LEN = 64  # Bytes; the CPU budget of the experiments.
MAX_SOLUTION_LEN = 96  # Bytes, EOS not included.
DEFAULT_TEST_FRACTION = 0.1
DEFAULT_EXPERT_FRACTION = 0.1
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_RL_FRACTION = 0.2
LEFT_TO_RIGHT, RIGHT_TO_LEFT = "=", "?"  # The rules: the prompt's last byte.
RULES = (LEFT_TO_RIGHT, RIGHT_TO_LEFT)

SPLIT_STEPS: dict[str, tuple[int, int]] = {
    "easy_sft": (1, 2),
    "easy_test": (1, 2),
    "expert": (2, 2),
    "hard_train": (2, 2),
    "hard_test": (2, 2),
    "shifted_test": (3, 3),
    "hard_validation": (2, 2),  # Last: a split's random stream is its index in SPLITS.
}
SPLITS = tuple(SPLIT_STEPS)
SPLIT_RULE = {"easy_sft": LEFT_TO_RIGHT, "easy_test": LEFT_TO_RIGHT, "expert": RIGHT_TO_LEFT,
              "hard_train": RIGHT_TO_LEFT, "hard_test": RIGHT_TO_LEFT, "shifted_test": RIGHT_TO_LEFT,
              "hard_validation": RIGHT_TO_LEFT}
_SPLIT_BUCKET = {"easy_sft": "sft", "easy_test": "test", "expert": "expert", "hard_train": "rl",
                 "hard_test": "test", "shifted_test": "test", "hard_validation": "validation"}
_REST_BUCKET = "sft"
_SALT = b"lemon-fest-rule"
# Repeats are allowed in the starting policy's demonstrations and in D_I: the RL bucket holds 583 distinct
# order-sensitive 2-step computations (of 2,817; 279 in the expert, 283 in the validation, 269 in the test
# bucket).
_IID_SPLITS = ("easy_sft", "hard_train")

_STEP_RE = re.compile(r"^([0-9]+)([+*-])([0-9]+)=([0-9]+)$")
_FINAL_RE = re.compile(r"^[0-9]{1,6}$")
_PROMPT_RE = re.compile(r"^([0-9]{%d})((?:[+*-][0-9])+)([=?])$" % NUM_WIDTH)


def solution_length(num_steps: int) -> int:
  """Bytes of the worked solution of a ``num_steps`` chain (EOS not included): ``8 k + 3``."""
  return STEP_LEN * num_steps + ANSWER_LEN


def prompt_length(num_steps: int) -> int:
  """Bytes of the prompt of a ``num_steps`` chain: ``2 k + 3``."""
  return NUM_WIDTH + 2 * num_steps + 1


def completion_budget(num_steps: int, slack_steps: int = 1) -> int:
  """Tokens to generate for a ``num_steps`` problem: its solution, ``slack_steps`` extra lines and EOS."""
  return solution_length(num_steps + slack_steps) + 1


def _apply(value: int, op: str, operand: int) -> int:
  if op == "+":
    return value + operand
  if op == "-":
    return value - operand
  if op == "*":
    return value * operand
  raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _fmt(value: int) -> str:
  return f"{value:0{NUM_WIDTH}d}"


@dataclasses.dataclass(frozen=True)
class Problem:
  """A chain ``start op_1 b_1 op_2 b_2 ...`` (``steps`` in APPLICATION order; every value in ``VALUE_RANGE``)
  written under ``rule``: ``"="`` writes the steps as applied, ``"?"`` writes them reversed."""

  start: int
  steps: tuple[tuple[str, int], ...]
  rule: str = LEFT_TO_RIGHT

  def __post_init__(self):
    lo, hi = VALUE_RANGE
    if self.rule not in RULES:
      raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
    if not 1 <= len(self.steps) <= MAX_STEPS:
      raise ValueError(f"a chain has 1..{MAX_STEPS} steps, got {len(self.steps)}")
    if not lo <= self.start <= hi:
      raise ValueError(f"start value {self.start} outside {VALUE_RANGE}")
    value = self.start
    for op, operand in self.steps:
      if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
      b_lo, b_hi = OPERAND_RANGES[op]
      if not b_lo <= operand <= b_hi:
        raise ValueError(f"operand {operand} of {op!r} outside {(b_lo, b_hi)}")
      value = _apply(value, op, operand)
      if not lo <= value <= hi:
        raise ValueError(f"intermediate value {value} of {self.prompt!r} outside {VALUE_RANGE}")

  @property
  def num_steps(self) -> int:
    return len(self.steps)

  @property
  def values(self) -> list[int]:
    """``[v_0 = start, v_1, ..., v_k]``: the value after each step."""
    out = [self.start]
    for op, operand in self.steps:
      out.append(_apply(out[-1], op, operand))
    return out

  @property
  def value(self) -> int:
    return self.values[-1]

  @property
  def written_steps(self) -> tuple[tuple[str, int], ...]:
    """The steps in the order the prompt writes them."""
    return self.steps if self.rule == LEFT_TO_RIGHT else self.steps[::-1]

  @property
  def prompt(self) -> str:
    return _fmt(self.start) + "".join(f"{op}{b}" for op, b in self.written_steps) + self.rule

  @property
  def order_sensitive(self) -> bool:
    """Whether applying the written steps in the other rule's order gives another answer (the value range
    not enforced): only then does a right answer show that the rule was followed."""
    value = self.start
    for op, operand in self.steps[::-1]:
      value = _apply(value, op, operand)
    return value != self.value

  @property
  def answer(self) -> str:
    return _fmt(self.value)

  @property
  def solution(self) -> str:
    """One line ``"a op b=c;"`` per step in application order, then ``"#"`` and the answer."""
    values = self.values
    lines = [f"{_fmt(v)}{op}{b}={_fmt(w)};" for v, (op, b), w in zip(values, self.steps, values[1:])]
    return "".join(lines) + "#" + self.answer


def parse_prompt(prompt: str) -> Problem:
  """Inverse of ``Problem.prompt``; raises ``ValueError`` for anything else."""
  match = _PROMPT_RE.match(prompt) if isinstance(prompt, str) else None
  if match is None:
    raise ValueError(f"not a multi-step math prompt: {prompt!r}")
  rest, rule = match.group(2), match.group(3)
  steps = tuple((rest[i], int(rest[i + 1])) for i in range(0, len(rest), 2))
  return Problem(int(match.group(1)), steps if rule == LEFT_TO_RIGHT else steps[::-1], rule)


def sample_problem(rng: np.random.Generator, num_steps: int, rule: str = LEFT_TO_RIGHT) -> Problem:
  """A random chain of ``num_steps`` under ``rule``: each step (in application order) picks uniformly among the
  in-range operations, then the operand."""
  lo, hi = VALUE_RANGE
  value = int(rng.integers(lo, hi + 1))
  start, steps = value, []
  for _ in range(num_steps):
    choices = []
    for op, (b_lo, b_hi) in OPERAND_RANGES.items():
      if op == "+":
        b_hi = min(b_hi, hi - value)
      elif op == "-":
        b_hi = min(b_hi, value - lo)
      else:
        b_hi = min(b_hi, hi // value) if value else 0  # 0 * b = 0: not a step worth writing.
      if b_hi >= b_lo:
        choices.append((op, b_lo, b_hi))
    op, b_lo, b_hi = choices[int(rng.integers(len(choices)))]
    operand = int(rng.integers(b_lo, b_hi + 1))
    steps.append((op, operand))
    value = _apply(value, op, operand)
  return Problem(start, tuple(steps), rule)


_COMMUTING = {"+": "+", "-": "+", "*": "*"}  # Steps of one class commute in a chain.


def canonical_key(problem: Problem | str) -> str:
  """The content key of a chain (a :class:`Problem` or its prompt): its steps in application order, each
  maximal run of commuting steps sorted; the rule that wrote it is not part of the key.

  ``+b`` and ``-b`` steps commute with each other, ``*b`` steps with each other, so reordering a run changes
  neither the answer nor the step count: ``07+5-3*2*3=``, ``07-3+5*3*2=`` and ``07*2*3-3+5?`` all give
  ``"07(+5-3)(*2*3)="``.
  """
  if isinstance(problem, str):
    problem = parse_prompt(problem)
  runs: list[list[tuple[str, int]]] = []
  for op, operand in problem.steps:
    if runs and _COMMUTING[runs[-1][0][0]] == _COMMUTING[op]:
      runs[-1].append((op, operand))
    else:
      runs.append([(op, operand)])
  return _fmt(problem.start) + "".join("(" + "".join(f"{op}{b}" for op, b in sorted(run)) + ")"
                                       for run in runs) + "="


def _fractions(test_fraction: float, expert_fraction: float, validation_fraction: float, rl_fraction: float):
  fractions = (("test", test_fraction), ("expert", expert_fraction), ("validation", validation_fraction),
               ("rl", rl_fraction))
  content_splits.check_fractions(fractions, _REST_BUCKET)
  return fractions


def bucket_of(problem: Problem | str, test_fraction: float = DEFAULT_TEST_FRACTION,
              expert_fraction: float = DEFAULT_EXPERT_FRACTION,
              validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
              rl_fraction: float = DEFAULT_RL_FRACTION) -> str:
  """``"test"``, ``"expert"``, ``"validation"``, ``"rl"`` or ``"sft"``: the hash bucket of a chain's key."""
  fractions = _fractions(test_fraction, expert_fraction, validation_fraction, rl_fraction)
  return content_splits.content_bucket(canonical_key(problem), _SALT, fractions, _REST_BUCKET)


def split_rng(seed: int, split: str) -> np.random.Generator:
  """The generator for ``(seed, split)``; different splits get independent streams."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  return np.random.default_rng([int(seed), SPLITS.index(split)])


def generate_problems(seed: int, num: int, split: str, *, num_steps: tuple[int, int] | None = None,
                      test_fraction: float = DEFAULT_TEST_FRACTION,
                      expert_fraction: float = DEFAULT_EXPERT_FRACTION,
                      validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                      rl_fraction: float = DEFAULT_RL_FRACTION) -> list[Problem]:
  """``num`` problems of ``split`` under its rule (``SPLIT_RULE``); deterministic in ``(seed, split)``.

  Problems of the ``"?"`` rule are order-sensitive (:attr:`Problem.order_sensitive`): others are redrawn.

  Args:
    seed: data seed.
    num: number of problems.
    split: one of ``SPLITS``.
    num_steps: ``(lo, hi)`` inclusive step range, drawn uniformly; default ``SPLIT_STEPS[split]``.
    test_fraction: mass of the test bucket.
    expert_fraction: mass of the expert bucket.
    validation_fraction: mass of the validation bucket.
    rl_fraction: mass of the RL (``D_I``) bucket; the rest is the SFT bucket.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  lo, hi = SPLIT_STEPS[split] if num_steps is None else num_steps
  if not 1 <= lo <= hi <= MAX_STEPS:
    raise ValueError(f"num_steps must satisfy 1 <= lo <= hi <= {MAX_STEPS}, got {(lo, hi)}")
  fractions = _fractions(test_fraction, expert_fraction, validation_fraction, rl_fraction)
  if num < 0:
    raise ValueError(f"num must be >= 0, got {num}")
  bucket, rule = _SPLIT_BUCKET[split], SPLIT_RULE[split]
  distinct = split not in _IID_SPLITS
  rng = split_rng(seed, split)

  def draw() -> Problem:
    while True:
      problem = sample_problem(rng, int(rng.integers(lo, hi + 1)), rule)
      if rule == LEFT_TO_RIGHT or problem.order_sensitive:
        return problem

  return content_splits.draw_from_bucket(
      draw, canonical_key, lambda key: content_splits.content_bucket(key, _SALT, fractions, _REST_BUCKET),
      bucket, num, distinct=distinct,
      # Rejections in a row before giving up: the (distinct) pool is (nearly) exhausted.
      max_misses=int(1000 / content_splits.bucket_mass(fractions, _REST_BUCKET, bucket)),
      what=f"{'distinct ' if distinct else ''}{split!r} problems with {lo}-{hi} steps")


def record(problem: Problem, split: str) -> dict[str, Any]:
  """The record of ``problem``: ``prompt``, ``answer``, ``solution``, ``num_steps``, ``split``."""
  return {"prompt": problem.prompt, "answer": problem.answer, "solution": problem.solution,
          "num_steps": problem.num_steps, "split": split}


def generate_examples(seed: int, num: int, split: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
  """Records of ``split`` (see :func:`record`); keyword arguments as :func:`generate_problems`."""
  for problem in generate_problems(seed, num, split, **kwargs):
    yield record(problem, split)


def demonstration(rec: dict[str, Any]) -> dict[str, Any]:
  """``rec`` with ``completion`` = its worked solution (the SFT target / the expert's ``y+``)."""
  return {**rec, "completion": rec["solution"]}


def answers_only(rec: dict[str, Any]) -> dict[str, Any]:
  """``rec`` without its worked solution: a ``D_I`` record (``prompt``, ``answer``, ``num_steps``, ``split``)."""
  return {k: v for k, v in rec.items() if k != "solution"}


def sft_demonstrations(seed: int, num: int) -> list[dict[str, Any]]:
  """``num`` easy worked solutions (``easy_sft``, rule ``"="``) with ``prompt`` and ``completion``: the
  starting policy's SFT."""
  return [demonstration(r) for r in generate_examples(seed, num, "easy_sft")]


def expert_demonstrations(seed: int, num_shots: int) -> list[dict[str, Any]]:
  """``D_E``: ``num_shots`` distinct hard problems (rule ``"?"``) with ``completion`` = worked solution (``y+``).

  Drawn sequentially, so a smaller ``num_shots`` gives a prefix of a larger one (64 within 128 within 512).
  """
  if num_shots < 1:
    raise ValueError(f"num_shots must be >= 1, got {num_shots}")
  return [demonstration(r) for r in generate_examples(seed, num_shots, "expert")]


def rl_prompts(seed: int, num: int) -> list[dict[str, Any]]:
  """``D_I``: ``num`` hard problems (i.i.d. from the RL bucket) with answers only (no worked solution)."""
  return [answers_only(r) for r in generate_examples(seed, num, "hard_train")]


def hard_validation(seed: int, num: int) -> list[dict[str, Any]]:
  """``num`` distinct hard problems for tuning (the validation bucket: disjoint from every other split)."""
  return list(generate_examples(seed, num, "hard_validation"))


def hard_test(seed: int, num: int) -> list[dict[str, Any]]:
  """``num`` distinct held-out hard problems."""
  return list(generate_examples(seed, num, "hard_test"))


def shifted_test(seed: int, num: int) -> list[dict[str, Any]]:
  """``num`` distinct held-out out-of-distribution problems (a longer ``"?"`` chain; generate with
  ``max_new_tokens = completion_budget(SPLIT_STEPS["shifted_test"][1])``)."""
  return list(generate_examples(seed, num, "shifted_test"))


def _as_int(value: Any) -> int | None:
  """A non-negative decimal integer from an ``int`` or a digit string, else ``None``."""
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return int(value) if value >= 0 else None
  text = as_text(value)
  if text is None:
    return None
  text = text.strip()
  return int(text) if _FINAL_RE.match(text) else None


def final_answer(completion: Any) -> int | None:
  """The integer after the last ``"#"`` of a completion (trailing whitespace / EOS strings ignored), or ``None``."""
  text = clean_completion(completion)
  if text is None or "#" not in text:
    return None
  return _as_int(text.rsplit("#", 1)[1])


def step_lines(completion: Any) -> list[str]:
  """The worked lines of a completion: the ``";"``-separated pieces before the last ``"#"``."""
  text = clean_completion(completion)
  if text is None:
    return []
  head = text.rsplit("#", 1)[0] if "#" in text else text
  return [line for line in head.split(";") if line.strip()]


def line_is_correct(line: str) -> bool:
  """Whether ``"a op b=c"`` is true arithmetic (any digit widths)."""
  match = _STEP_RE.match(line.strip())
  if match is None:
    return False
  a, op, b, c = match.groups()
  return _apply(int(a), op, int(b)) == int(c)


def answer_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  answer: list[Any], **_: Any) -> RewardOutput:
  """Final-answer verifier: ``r_n = 1`` iff the integer after the last ``"#"`` of ``completions[n]`` equals
  ``answer[n]`` (``"32"``, ``"07"`` or an ``int``), else ``0``.

  Never raises on a malformed completion (garbage, ``None``, bytes, no ``"#"``); raises ``ValueError`` only if
  the lists have different lengths (a caller bug). Metrics ``[N]``: ``well_formed`` (a ``"#"`` followed by an
  integer), ``num_lines`` (worked lines written), ``line_accuracy`` (fraction of worked lines that are true
  arithmetic, 0 when none) and ``complete`` (as many lines as the prompt has steps; 0 for a foreign prompt).
  """
  n = check_same_length("answer_reward", completions, prompts=prompts, completion_ids=completion_ids,
                        answer=answer)
  rewards = np.zeros(n, np.float32)
  well_formed = np.zeros(n, np.float32)
  num_lines = np.zeros(n, np.float32)
  line_accuracy = np.zeros(n, np.float32)
  complete = np.zeros(n, np.float32)
  for i, (prompt, completion, gold) in enumerate(zip(prompts, completions, answer)):
    predicted = final_answer(completion)
    gold_value = _as_int(gold)
    well_formed[i] = float(predicted is not None)
    rewards[i] = float(predicted is not None and gold_value is not None and predicted == gold_value)
    lines = step_lines(completion)
    num_lines[i] = len(lines)
    if lines:
      line_accuracy[i] = sum(line_is_correct(x) for x in lines) / len(lines)
    try:
      complete[i] = float(len(lines) == parse_prompt(as_text(prompt) or "").num_steps)
    except ValueError:
      pass
  return RewardOutput(rewards, {"well_formed": well_formed, "num_lines": num_lines,
                                "line_accuracy": line_accuracy, "complete": complete})
