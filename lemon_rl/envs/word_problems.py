"""LEMON's task: multi-step word problems where the team an orchestrator writes decides the outcome.

See METHODS.md section 4. A problem is a chain of two or three operations told as a short story, with an
optional distractor sentence whose number plays no part::

  Ann has 12 pens. She gets 5 more. Ann is 9 years old. She trades each for 3. How many pens now?

Its *expression* is the chain without the story, ``12+5*3`` (applied LEFT TO RIGHT, no precedence:
``(12 + 5) * 3``), and its answer the chain's value, ``51``. A problem is ``add`` (``+`` / ``-`` steps only)
or ``multiply`` (at least one ``*`` step).

The world's rules. Every agent of a spec is a worker prompted with :func:`~lemon_rl.envs.orchestration.
format_agent_prompt` (the task, its role, its duty, its parents' outputs); what a perfect worker answers is
:func:`reference_output`, a function of the DUTY word (the role only names the duty an agent gets by
default, :data:`~lemon_rl.envs.orchestration.DEFAULT_ROLES`, and labels its output for its children):

============  =================================================================================
duty          a perfect worker's output
============  =================================================================================
extract       the problem's expression (``12+5*3``), distractor skipped           skill ``extract``
compute       the worked chain of the LAST parent output that is an expression    skill ``add`` /
              (its running values, ``17 51``: :func:`worked_chain`); ``?``        ``multiply``
              without one (a calculator needs its extractor: a needed edge)
verify        as ``compute`` when a parent gives an expression; else it repeats   as compute
              the value of the last parent number (``?`` if none)
solve         the answer, from the task text alone (extract and compute at once,  ``solve_add`` /
              no worked chain)                                                    ``solve_multiply``
aggregate     the most common value among the parent numbers (ties: earliest)     exact
plan          ``<k> steps``                                                       useless
critique      ``looks fine``                                                      useless
summarize     the task's first sentence                                           useless
explain       ``work left to right``                                              useless
format        the last parent output unchanged (``?`` if none)                    pass-through
============  =================================================================================

A *number* is an output made of integers separated by spaces (a worked chain or a single integer) and its
*value* is its last integer (:func:`number_value`); the team succeeds when the answer agent's output is a
number whose value is the answer (:func:`answer_matches`). *Decision* (2026-12-07): a calculator writes the
running values rather than the value alone, because worker models of these sizes did not learn to evaluate a
chain in one shot (see ``configs/lemon_orchestration.py``); solving stays one-shot, which is what makes it
worse than extract-then-compute.

So a role is useless at its default duty (planner, critic, summarizer, explainer-like duties) and useful
once its duty is customised (``{role: planner, duty: extract}`` extracts): resetting a duty changes what a
worker does. The extractor -> calculator edge is needed. Workers of a higher capacity are more reliable on
the hard skills: with the programmatic workers (:class:`WordProblemWorker`, tests and pilots) a node of
skill ``s`` at capacity ``c`` is right with probability :data:`SKILL_ACCURACY` ``[s][c]`` (*Decision*,
calibration: every capacity extracts and adds reliably, only ``large`` multiplies reliably, solving in one
step is worse than extract-then-compute at every capacity), else its output is corrupted. For the real
experiment, three worker models of different sizes are trained by SFT on :func:`worker_demonstrations`
(``lemon_rl.training.worker_models.train_worker_models``); their skill levels are measured, not set.

The best team therefore depends on the problem: extractor (small) -> calculator (small for ``add``,
large for ``multiply``), without useless agents; the scripted teacher (:func:`teacher_spec`), whose specs
warm up the orchestrator by SFT, writes valid specs of reasonable shapes (pipelines, verifier chains, solo
solvers, sometimes a useless agent or a missing edge) with capacities drawn INDEPENDENTLY of the problem,
so choosing capacities by the problem is left to RL. Measured with the programmatic workers on 200
validation problems (success on ``add`` / ``multiply``): extractor (small) -> calculator (small) 0.94 / 0.26,
with a large calculator 0.95 / 0.88, a large solver alone 0.85 / 0.60, a calculator without its edge 0 / 0;
200 teacher specs 0.60 on average (reward 0.78 with the default reward settings, against 0.84 for
the small pipeline and 1.10 for the large one).

Splits. Every split is drawn from the content bucket of its problems' canonical key (:func:`canonical_key`:
the chain with each maximal run of commuting steps sorted; names, items, wording and the distractor are
surface and not part of it), by :mod:`lemon_rl.data.splits`: test 10%, validation 10%, RL prompts 30%,
and the remaining 50% for the orchestrator's SFT specs and the workers' demonstrations (workers are trained
on no RL, validation or test problem; their skills are measured on validation problems). Every generator is
a pure function of ``(seed, split)``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from typing import Any, Mapping, Sequence

import numpy as np

from lemon_rl.data import splits as content_splits
from lemon_rl.envs.orchestration import executor as ex_lib
from lemon_rl.envs.orchestration.executor import AgentPrompt, format_agent_prompt
from lemon_rl.envs.orchestration.spec import CAPACITIES, DEFAULT_ROLES, Agent, Schema, Spec, serialize
from lemon_rl.envs.tasks import TASK_CONFIG_CHECKS, TASKS, Task
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.text.tokenizers import ByteTokenizer
from lemon_rl.utils import config_checks as cc

NAMES = (("Ann", "She"), ("Bea", "She"), ("Eve", "She"), ("Fay", "She"), ("Cal", "He"), ("Dan", "He"),
         ("Gil", "He"), ("Hal", "He"))
ITEMS = ("pens", "cards", "beads", "coins", "stamps", "shells", "marbles", "books")
STEP_TEMPLATES = {"+": ("{P} gets {b} more.", "{P} finds {b} more."),
                  "-": ("{P} gives away {b}.", "{P} loses {b}."),
                  "*": ("{P} then has {b} times as many.", "{P} trades each for {b}.")}
DISTRACTOR_TEMPLATES = ("{N} is {d} years old.", "{P} lives {d} km away.", "The shop opens at {d}.")
START_RANGE = (2, 30)
OPERAND_RANGES = {"+": (2, 20), "-": (1, 20), "*": (2, 5)}  # Inclusive; "-" keeps the value >= 1.
MAX_VALUE = 500
DISTRACTOR_RANGE = (2, 60)
KINDS = ("add", "multiply")
SKILLS = ("extract", "add", "multiply", "solve_add", "solve_multiply")
USELESS_OUTPUTS = {"critique": "looks fine", "explain": "work left to right"}
UNKNOWN = "?"
MAX_INPUT_CHARS = 32  # Cut of each parent output in a worker prompt (every useful output is shorter).

# *Decision* (calibration of the programmatic workers; see the module docstring).
SKILL_ACCURACY: Mapping[str, Mapping[str, float]] = {
    "extract": {"small": 0.97, "medium": 0.98, "large": 0.99},
    "add": {"small": 0.97, "medium": 0.98, "large": 0.99},
    "multiply": {"small": 0.25, "medium": 0.6, "large": 0.95},
    "solve_add": {"small": 0.3, "medium": 0.55, "large": 0.8},
    "solve_multiply": {"small": 0.05, "medium": 0.25, "large": 0.6},
}
# Completion tokens a worker spends beyond its answer (a bigger model reasons longer): the executor's default.
EXTRA_TOKENS: Mapping[str, int] = dict(ex_lib.PROGRAMMATIC_EXTRA_TOKENS)

_SALT = b"lemon-wordprob"
# Content buckets: split -> bucket. SFT specs and worker demonstrations share the "sft" bucket.
_FRACTIONS = (("test", 0.1), ("validation", 0.1), ("rl", 0.3))
_REST = "sft"
SPLITS = ("sft", "rl", "validation", "test", "workers", "workers_eval")
_SPLIT_BUCKET = {"sft": "sft", "rl": "rl", "validation": "validation", "test": "test", "workers": "sft",
                 "workers_eval": "validation"}

_NUMBER_RE = re.compile(r"-?[0-9]+(?: -?[0-9]+)*")  # A number: integers separated by spaces.
_EXPR_RE = re.compile(r"[0-9]+(?:[+*-][0-9]+)+")
_STEP_SPLIT_RE = re.compile(r"([+*-])([0-9]+)")


# ---------------------------------------------------------------------------------------------------
# Problems.
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  """A word problem: its chain and its surface (who, what, wording, distractor).

  Attributes:
    start: the starting quantity.
    steps: ``(op, operand)`` pairs applied left to right.
    name: index into :data:`NAMES`; item: into :data:`ITEMS`.
    wording: per step, the index of its template in :data:`STEP_TEMPLATES`.
    distractor: ``None`` or ``(template index, value, position)``: the distractor sentence comes before
      step ``position`` (``len(steps)``: after the last step).
  """

  start: int
  steps: tuple[tuple[str, int], ...]
  name: int = 0
  item: int = 0
  wording: tuple[int, ...] = ()
  distractor: tuple[int, int, int] | None = None

  @property
  def expression(self) -> str:
    return str(self.start) + "".join(f"{op}{b}" for op, b in self.steps)

  @property
  def answer(self) -> int:
    return evaluate_chain(self.expression)

  @property
  def kind(self) -> str:
    return "multiply" if any(op == "*" for op, _ in self.steps) else "add"

  @property
  def text(self) -> str:
    name, pronoun = NAMES[self.name]
    item = ITEMS[self.item]
    wording = self.wording or (0,) * len(self.steps)
    sentences = [f"{name} has {self.start} {item}."]
    for (op, b), w in zip(self.steps, wording):
      sentences.append(STEP_TEMPLATES[op][w].format(P=pronoun, b=b))
    if self.distractor is not None:
      t, d, pos = self.distractor
      sentences.insert(1 + pos, DISTRACTOR_TEMPLATES[t].format(N=name, P=pronoun, d=d))
    sentences.append(f"How many {item} now?")
    return " ".join(sentences)


def running_values(expression: str) -> list[int]:
  """The value after each step of ``"12+5*3-7"``, applied left to right: ``[17, 51, 44]``; ``ValueError`` if
  malformed."""
  if not _EXPR_RE.fullmatch(expression):
    raise ValueError(f"not a chain expression: {expression!r}")
  start = re.match(r"[0-9]+", expression).group()
  value, values = int(start), []
  for op, b in _STEP_SPLIT_RE.findall(expression[len(start):]):
    value = value + int(b) if op == "+" else value - int(b) if op == "-" else value * int(b)
    values.append(value)
  return values


def evaluate_chain(expression: str) -> int:
  """The value of ``"12+5*3-7"`` applied left to right (``((12 + 5) * 3) - 7``); ``ValueError`` if malformed."""
  return running_values(expression)[-1]


def worked_chain(expression: str) -> str:
  """A calculator's output: the running values separated by spaces, ``"12+5*3-7"`` -> ``"17 51 44"`` (its last
  integer is the chain's value); ``ValueError`` if malformed."""
  return " ".join(map(str, running_values(expression)))


def number_value(output: str) -> str | None:
  """The value of a number output (its last integer: ``"17 51"`` -> ``"51"``), None for any other text."""
  output = output.strip()
  return output.rsplit(" ", 1)[-1] if _NUMBER_RE.fullmatch(output) else None


def answer_matches(output: str, gold: str) -> bool:
  """Task success: the answer agent's output is a number whose value is ``gold``."""
  return number_value(output) == str(gold).strip()


def _sentence_patterns():
  """``[(regex, kind, op or template)]`` for every sentence the generator writes."""
  name = "(?P<name>" + "|".join(n for n, _ in NAMES) + ")"
  pronoun = "(?P<pronoun>She|He)"
  out = [(re.compile(rf"{name} has (?P<start>[0-9]+) (?P<item>{'|'.join(ITEMS)})\."), "start", None)]
  for op, templates in STEP_TEMPLATES.items():
    for w, t in enumerate(templates):
      out.append((re.compile(re.escape(t).replace(r"\{P\}", pronoun).replace(r"\{b\}", "(?P<b>[0-9]+)")),
                  "step", (op, w)))
  for w, t in enumerate(DISTRACTOR_TEMPLATES):
    pattern = re.escape(t).replace(r"\{N\}", name).replace(r"\{P\}", pronoun).replace(r"\{d\}", "(?P<d>[0-9]+)")
    out.append((re.compile(pattern), "distractor", w))
  out.append((re.compile(rf"How many (?P<item>{'|'.join(ITEMS)}) now\?"), "question", None))
  return out


_PATTERNS = _sentence_patterns()
_SENTENCE_RE = re.compile(r"[^.?]*[.?]")


def parse_problem(text: str) -> Problem:
  """Inverse of :attr:`Problem.text` (``ValueError`` on any other text)."""
  sentences = [s.strip() for s in _SENTENCE_RE.findall(text)]
  if "".join(sentences).replace(" ", "") != text.replace(" ", "") or len(sentences) < 3:
    raise ValueError(f"not a word problem: {text!r}")
  start = name = item = None
  steps, wording, distractor = [], [], None
  for i, sentence in enumerate(sentences):
    for pattern, kind, extra in _PATTERNS:
      m = pattern.fullmatch(sentence)
      if m:
        break
    else:
      raise ValueError(f"unknown sentence {sentence!r} in {text!r}")
    if kind == "start" and i == 0:
      start, name, item = int(m["start"]), [n for n, _ in NAMES].index(m["name"]), ITEMS.index(m["item"])
    elif kind == "step" and i > 0:
      steps.append((extra[0], int(m["b"])))
      wording.append(extra[1])
    elif kind == "distractor" and i > 0 and distractor is None:
      distractor = (extra, int(m["d"]), len(steps))
    elif kind == "question" and i == len(sentences) - 1 and ITEMS.index(m["item"]) == item:
      pass
    else:
      raise ValueError(f"sentence {sentence!r} out of place in {text!r}")
  if start is None or not steps:
    raise ValueError(f"not a word problem: {text!r}")
  return Problem(start, tuple(steps), name, item, tuple(wording), distractor)


def sample_problem(rng: np.random.Generator, kind: str, num_steps: int, distractor_prob: float = 0.75) -> Problem:
  """A random problem of ``kind`` (``add``: ``+``/``-`` only; ``multiply``: at least one ``*``)."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  value = int(rng.integers(START_RANGE[0], START_RANGE[1] + 1))
  start = value
  times_at = int(rng.integers(num_steps)) if kind == "multiply" else -1
  steps = []
  for i in range(num_steps):
    if i == times_at:
      ops = ["*"]
    elif kind == "multiply":
      ops = ["+", "-", "*"]
    else:
      ops = ["+", "-"]
    ops = [op for op in ops if (op != "-" or value >= 2) and (op != "*" or value * 2 <= MAX_VALUE)]
    if not ops:  # "*" needed but the value is too large: start over with a fresh draw.
      return sample_problem(rng, kind, num_steps, distractor_prob)
    op = ops[int(rng.integers(len(ops)))]
    lo, hi = OPERAND_RANGES[op]
    if op == "-":
      hi = min(hi, value - 1)
    elif op == "*":
      hi = min(hi, MAX_VALUE // value)
    else:
      hi = min(hi, MAX_VALUE - value)
    if hi < lo:
      return sample_problem(rng, kind, num_steps, distractor_prob)
    b = int(rng.integers(lo, hi + 1))
    value = evaluate_chain(f"{value}{op}{b}")
    steps.append((op, b))
  wording = tuple(int(rng.integers(len(STEP_TEMPLATES[op]))) for op, _ in steps)
  distractor = None
  if rng.random() < distractor_prob:
    distractor = (int(rng.integers(len(DISTRACTOR_TEMPLATES))),
                  int(rng.integers(DISTRACTOR_RANGE[0], DISTRACTOR_RANGE[1] + 1)), int(rng.integers(num_steps + 1)))
  return Problem(start, tuple(steps), int(rng.integers(len(NAMES))), int(rng.integers(len(ITEMS))), wording,
                 distractor)


_COMMUTING = {"+": "additive", "-": "additive", "*": "multiplicative"}


def canonical_key(problem: Problem | str) -> str:
  """The content key of a problem (or its text): its chain with each maximal run of commuting steps sorted.

  ``+b`` / ``-b`` steps commute with each other and ``*b`` steps with each other, so reordering a run
  changes neither the answer nor the kind: ``12+5-3*2`` and ``12-3+5*2`` are one problem, ``"12(+5-3)(*2)"``.
  """
  if isinstance(problem, str):
    problem = parse_problem(problem)
  runs: list[list[tuple[str, int]]] = []
  for op, b in problem.steps:
    if runs and _COMMUTING[runs[-1][0][0]] == _COMMUTING[op]:
      runs[-1].append((op, b))
    else:
      runs.append([(op, b)])
  return str(problem.start) + "".join("(" + "".join(f"{op}{b}" for op, b in sorted(run)) + ")" for run in runs)


def bucket_of(problem: Problem | str) -> str:
  """``"test"``, ``"validation"``, ``"rl"`` or ``"sft"``: the content bucket of the problem's key."""
  return content_splits.content_bucket(canonical_key(problem), _SALT, _FRACTIONS, _REST)


# ---------------------------------------------------------------------------------------------------
# The world's rules: what a perfect worker answers, and programmatic workers.
# ---------------------------------------------------------------------------------------------------


def _last(outputs: Sequence[str], pattern: re.Pattern) -> str | None:
  for out in reversed(outputs):
    if pattern.fullmatch(out.strip()):
      return out.strip()
  return None


def reference_output(prompt: AgentPrompt) -> str:
  """What a perfect worker answers to ``prompt`` (the table of the module docstring)."""
  duty = prompt.duty.split(" ", 1)[0]
  outputs = [out for _, out in prompt.inputs]
  values = [v for v in map(number_value, outputs) if v is not None]  # The parent numbers' values.
  try:
    problem = parse_problem(prompt.task)
  except ValueError:
    problem = None
  if duty == "extract":
    return problem.expression if problem else UNKNOWN
  if duty in ("compute", "verify"):
    expression = _last(outputs, _EXPR_RE)
    if expression is not None:
      return worked_chain(expression)
    return values[-1] if duty == "verify" and values else UNKNOWN
  if duty == "solve":
    return str(problem.answer) if problem else UNKNOWN
  if duty == "aggregate":
    if not values:
      return UNKNOWN
    counts = collections.Counter(values)
    best = max(counts.values())
    return next(v for v in values if counts[v] == best)
  if duty == "plan":
    return f"{len(problem.steps)} steps" if problem else UNKNOWN
  if duty == "summarize":
    return prompt.task.split(".", 1)[0] + "." if "." in prompt.task else prompt.task
  if duty == "format":
    return outputs[-1].strip() if outputs else UNKNOWN
  return USELESS_OUTPUTS.get(duty, UNKNOWN)


def skill_of(prompt: AgentPrompt) -> str | None:
  """The skill a worker needs to answer ``prompt`` (:data:`SKILLS`), or None for the exact duties."""
  duty = prompt.duty.split(" ", 1)[0]
  if duty == "extract":
    return "extract"
  if duty in ("compute", "verify"):
    expression = _last([out for _, out in prompt.inputs], _EXPR_RE)
    if expression is None:
      return None
    return "multiply" if "*" in expression else "add"
  if duty == "solve":
    try:
      return "solve_" + parse_problem(prompt.task).kind
    except ValueError:
      return None
  return None


def corrupt(output: str, u: float) -> str:
  """A wrong version of a correct output (``u`` in ``[0, 1)`` picks which): a number's value (its last
  integer) moves by 1-3, an expression gets one operand changed by one; any other text is returned
  unchanged."""
  if number_value(output) is not None:
    head, _, value = output.rpartition(" ")
    delta = 1 + int(u * 6) % 3
    return (head + " " if head else "") + str(int(value) + (delta if u < 0.5 else -delta))
  if _EXPR_RE.fullmatch(output):
    numbers = list(re.finditer(r"[0-9]+", output))
    m = numbers[int(u * len(numbers)) % len(numbers)]
    return output[:m.start()] + str(int(m.group()) + 1) + output[m.end():]
  return output


class WordProblemWorker(ex_lib.ProgrammaticWorker):
  """A programmatic worker of one capacity (a :class:`~lemon_rl.envs.orchestration.Worker`).

  For a prompt of skill ``s`` (:func:`skill_of`) it answers :func:`reference_output` with probability
  ``skill_accuracy[s][capacity]``, else :func:`corrupt` of it; exact duties are always right. The draw is
  ``u(key, prompt) < accuracy`` with ``u`` a hash to ``[0, 1)``: a function of (prompt, key) alone, and the
  same ``u`` for every capacity, so a node a smaller worker gets right a bigger one gets right too.
  Tokens and counters as :class:`~lemon_rl.envs.orchestration.ProgrammaticWorker`, with
  ``extra_tokens[capacity]``.
  """

  def __init__(self, capacity: str, accuracy: Mapping[str, Mapping[str, float]] | None = None,
               extra_tokens: Mapping[str, int] | None = None, tokenizer=None):
    super().__init__(reference_output, extra_tokens=int((extra_tokens or EXTRA_TOKENS)[capacity]),
                     tokenizer=tokenizer)
    self.capacity = capacity
    self.skill_accuracy = {s: dict(v) for s, v in (accuracy or SKILL_ACCURACY).items()}

  def answer(self, prompt: str, key: int) -> str:
    parsed = ex_lib.parse_agent_prompt(prompt)
    correct, skill = reference_output(parsed), skill_of(parsed)
    if skill is None or ex_lib.unit_interval(key, prompt) < self.skill_accuracy[skill][self.capacity]:
      return correct
    return corrupt(correct, ex_lib.unit_interval("corrupt", key, prompt))


def programmatic_workers(accuracy: Mapping[str, Mapping[str, float]] | None = None,
                         extra_tokens: Mapping[str, int] | None = None, tokenizer=None) -> dict[str, WordProblemWorker]:
  """One :class:`WordProblemWorker` per capacity."""
  return {cap: WordProblemWorker(cap, accuracy, extra_tokens, tokenizer) for cap in CAPACITIES}


# ---------------------------------------------------------------------------------------------------
# The scripted teacher and the worker demonstrations.
# ---------------------------------------------------------------------------------------------------

TASK_SCHEMA = Schema(max_agents=4)  # *Decision*: four agents are enough for every useful team here.
_IDS = "abcd"
_EXTRACT_AS = (("extractor", "extract"), ("extractor", "extract"), ("planner", "extract"),
               ("summarizer", "extract"))
_COMPUTE_AS = (("calculator", "compute"), ("calculator", "compute"), ("verifier", "compute"),
               ("solver", "compute"), ("verifier", "verify"))
_USELESS_AS = (("critic", "critique"), ("planner", "plan"), ("summarizer", "summarize"))
TEACHER_SHAPES = {"pipeline": 0.45, "pipeline_useless": 0.15, "verified": 0.15, "solo": 0.15, "no_edge": 0.1}


def teacher_spec(rng: np.random.Generator) -> Spec:
  """A valid spec from the scripted teacher (independent of the problem; shapes :data:`TEACHER_SHAPES`).

  ``pipeline``: an extracting agent (small or medium) and a computing agent depending on it (any capacity);
  ``pipeline_useless``: the same with a useless agent (small) in between, which the computing agent also
  reads; ``verified``: a pipeline whose computing agent is re-checked by a verifier reading both;
  ``solo``: one solver (any capacity); ``no_edge``: a pipeline whose computing agent lacks its edge (it
  answers ``?``). Roles with customised duties (a planner that extracts, a verifier that computes) appear
  with the default ones, so every edit family has something to act on.
  """
  shapes = list(TEACHER_SHAPES)
  shape = shapes[int(rng.choice(len(shapes), p=list(TEACHER_SHAPES.values())))]
  cap = lambda choices=CAPACITIES: choices[int(rng.integers(len(choices)))]
  pick = lambda table: table[int(rng.integers(len(table)))]
  if shape == "solo":
    agents = [Agent("a", "solver", "solve", cap())]
  else:
    agents = [Agent("a", *pick(_EXTRACT_AS), cap(CAPACITIES[:2]))]
    deps = ["a"]
    if shape == "pipeline_useless":
      agents.append(Agent("b", *pick(_USELESS_AS), "small"))
      deps = ["b", "a"]
    compute_id = _IDS[len(agents)]
    agents.append(Agent(compute_id, *pick(_COMPUTE_AS), cap(), () if shape == "no_edge" else tuple(deps)))
    if shape == "verified":
      agents.append(Agent(_IDS[len(agents)], "verifier", "verify", cap(), ("a", compute_id)))
  return Spec(tuple(agents), agents[-1].id)


@functools.lru_cache(maxsize=4096)
def _text_of(spec: Spec) -> str:
  return serialize(spec, TASK_SCHEMA)[0]


def teacher_text(rng: np.random.Generator) -> str:
  """The canonical text of :func:`teacher_spec` (memoised: the teacher writes a few hundred distinct specs)."""
  return _text_of(teacher_spec(rng))


def max_teacher_chars() -> int:
  """Characters of the longest spec the teacher can write (a verified chain with the longest names)."""
  longest = Spec((Agent("a", "summarizer", "extract", "medium"),
                  Agent("b", "calculator", "compute", "medium", ("a",)),
                  Agent("c", "verifier", "verify", "medium", ("a", "b"))), "c")
  useless = Spec((Agent("a", "summarizer", "extract", "medium"), Agent("b", "summarizer", "summarize", "small"),
                  Agent("c", "calculator", "compute", "medium", ("b", "a"))), "c")
  return max(len(serialize(s, TASK_SCHEMA)[0]) for s in (longest, useless))


# Duties of the worker demonstrations and their shares (*Decision*: the skills that differ by capacity get
# most of the data; the exact duties are easy and need little).
WORKER_DUTIES = {"extract": 0.18, "compute": 0.25, "verify": 0.1, "solve": 0.12, "aggregate": 0.07, "plan": 0.05,
                 "critique": 0.05, "summarize": 0.06, "explain": 0.04, "format": 0.08}
_FREE_TEXT = ("carefully", "step by step", "the numbers", "fast")


def _worker_prompt(problem: Problem, rng: np.random.Generator) -> str:
  """A random worker prompt about ``problem``: a duty (:data:`WORKER_DUTIES`), a role (any: roles do not
  drive behaviour, duties do), and parent outputs of the kinds a real team produces (right or corrupted
  expressions and numbers, useless texts); a computing duty usually gets an expression among them; one
  prompt in ten has free text after the duty word."""
  duty = str(rng.choice(list(WORKER_DUTIES), p=list(WORKER_DUTIES.values())))
  role = list(DEFAULT_ROLES)[int(rng.integers(len(DEFAULT_ROLES)))]
  expression, answer = problem.expression, str(problem.answer)
  useless = ["looks fine", f"{len(problem.steps)} steps", problem.text.split(".", 1)[0] + ".", UNKNOWN]

  def parent(kind):
    if kind == "expression":
      return "extractor", expression if rng.random() < 0.8 else corrupt(expression, rng.random())
    if kind == "number":  # A calculator's worked chain or a single value (a solver's, an aggregator's).
      number = worked_chain(expression) if rng.random() < 0.5 else answer
      return "calculator", number if rng.random() < 0.7 else corrupt(number, rng.random())
    return str(rng.choice(["critic", "planner", "summarizer", "solver"])), useless[int(rng.integers(len(useless)))]

  kinds = [str(rng.choice(["expression", "number", "useless"], p=[0.4, 0.4, 0.2]))
           for _ in range(int(rng.choice([0, 1, 1, 1, 2, 2, 3])))]
  if duty in ("compute", "verify") and "expression" not in kinds and rng.random() < 0.85:
    kinds.insert(int(rng.integers(len(kinds) + 1)), "expression")
  if duty == "solve" and rng.random() < 0.7:
    kinds = []
  if duty == "aggregate" and rng.random() < 0.8:
    kinds = ["number"] * int(rng.integers(2, 4))
  if rng.random() < 0.1:
    duty = f"{duty} {_FREE_TEXT[int(rng.integers(len(_FREE_TEXT)))]}"
  return format_agent_prompt(problem.text, role, duty, [parent(k) for k in kinds], MAX_INPUT_CHARS)


# ---------------------------------------------------------------------------------------------------
# Splits and records.
# ---------------------------------------------------------------------------------------------------


def split_rng(seed: int, split: str) -> np.random.Generator:
  return np.random.default_rng([int(seed), SPLITS.index(split), 0x1E40])


def generate_problems(seed: int, num: int, split: str, *, multiply_fraction: float = 0.5,
                      steps: tuple[int, int] = (2, 3), distractor_prob: float = 0.75,
                      distinct: bool = True) -> list[Problem]:
  """``num`` problems of ``split`` (from its content bucket; distinct keys unless ``distinct=False``)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if not 0 <= multiply_fraction <= 1 or not 1 <= steps[0] <= steps[1]:
    raise ValueError(f"bad multiply_fraction={multiply_fraction} or steps={steps}")
  rng = split_rng(seed, split)

  def draw():
    kind = "multiply" if rng.random() < multiply_fraction else "add"
    return sample_problem(rng, kind, int(rng.integers(steps[0], steps[1] + 1)), distractor_prob)

  return content_splits.draw_from_bucket(draw, canonical_key, lambda k: content_splits.content_bucket(
      k, _SALT, _FRACTIONS, _REST), _SPLIT_BUCKET[split], num, distinct=distinct,
                                         what=f"word problems for {split!r}")


def orchestrator_prompt(task: str) -> str:
  """The orchestrator's prompt: the problem, then a newline (the spec follows)."""
  return task + "\n"


def record(problem: Problem, seed: int) -> dict[str, Any]:
  """An orchestrator example: ``prompt``, ``task`` (the workers' task text), ``answer``, ``seed`` (of the
  workers' sampling keys), ``kind``."""
  return {"prompt": orchestrator_prompt(problem.text), "task": problem.text, "answer": str(problem.answer),
          "seed": int(seed), "kind": problem.kind}


def examples(seed: int, num: int, split: str, **kwargs) -> list[dict[str, Any]]:
  """Orchestrator examples of ``split`` (``rl``, ``validation``, ``test``); memoised (treat as read-only)."""
  return _examples(int(seed), int(num), split, tuple(sorted(kwargs.items())))


@functools.lru_cache(maxsize=16)
def _examples(seed: int, num: int, split: str, kwargs: tuple) -> list[dict[str, Any]]:
  kwargs = dict(kwargs)
  problems = generate_problems(seed, num, split, **kwargs)
  seeds = np.random.default_rng([int(seed), SPLITS.index(split), 0x5EED]).integers(0, 2**31 - 1, size=num)
  return [record(p, s) for p, s in zip(problems, seeds)]


def sft_specs(seed: int, num: int, **kwargs) -> list[dict[str, Any]]:
  """Orchestrator SFT records: ``prompt`` and the teacher's spec as ``completion`` (plus the example fields);
  memoised (treat as read-only)."""
  return _sft_specs(int(seed), int(num), tuple(sorted(kwargs.items())))


@functools.lru_cache(maxsize=4)
def _sft_specs(seed: int, num: int, kwargs: tuple) -> list[dict[str, Any]]:
  kwargs = dict(kwargs)
  problems = generate_problems(seed, num, "sft", distinct=False, **kwargs)
  rng = np.random.default_rng([int(seed), 0x5EC])
  out = []
  for p in problems:
    rec = record(p, int(rng.integers(0, 2**31 - 1)))
    rec["completion"] = teacher_text(rng)
    out.append(rec)
  return out


def worker_demonstrations(seed: int, num: int, split: str = "workers", **kwargs) -> list[dict[str, Any]]:
  """Worker SFT records: an agent prompt (:func:`_worker_prompt`, at most ``WORKER_PROMPT_LEN - 1`` tokens),
  the perfect ``completion`` (:func:`reference_output`) and its ``skill`` (``"exact"`` for the exact duties).
  ``split``: ``"workers"`` (the SFT bucket) or ``"workers_eval"`` (the validation bucket, to measure skills)."""
  problems = generate_problems(seed, num, split, distinct=False, **kwargs)
  rng = np.random.default_rng([int(seed), SPLITS.index(split), 0xD0])
  tokenizer = ByteTokenizer()
  out = []
  for p in problems:
    prompt = _worker_prompt(p, rng)
    while len(tokenizer.encode(prompt)) + 1 > WORKER_PROMPT_LEN:  # BOS + prompt must fit; draw another.
      prompt = _worker_prompt(p, rng)
    parsed = ex_lib.parse_agent_prompt(prompt)
    out.append({"prompt": prompt, "completion": reference_output(parsed), "skill": skill_of(parsed) or "exact"})
  return out


# Longest texts, by construction (checked in the tests): the orchestrator's and a worker's prompt.
def max_task_chars() -> int:
  """Characters of the longest problem text the generator writes (3 steps, a distractor)."""
  name = max((n for n, _ in NAMES), key=len)
  worst = [max(STEP_TEMPLATES[op], key=len).format(P="She", b=MAX_VALUE) for op in STEP_TEMPLATES]
  step = max(len(w) for w in worst)
  distractor = max(len(t.format(N=name, P="She", d=DISTRACTOR_RANGE[1])) for t in DISTRACTOR_TEMPLATES)
  item = max(len(i) for i in ITEMS)
  return (len(f"{name} has {MAX_VALUE} .") + item + 1 + 3 * (step + 1) + distractor + 1
          + len("How many  now?") + item)


def spec_token_budget() -> int:
  """Tokens the orchestrator may sample (byte-level): the longest teacher spec, EOS and 32 of slack."""
  return max_teacher_chars() + 1 + 32


def orchestrator_prompt_len() -> int:
  """Prompt slots of the orchestrator's training sequences: BOS and the longest prompt."""
  return 1 + len(orchestrator_prompt("x" * max_task_chars()))


WORKER_PROMPT_LEN = 256  # Token slots of a worker prompt (BOS included); longer demonstrations are dropped.
WORKER_MAX_NEW_TOKENS = 24  # The longest useful output (a summary sentence) and EOS, with slack.


# ---------------------------------------------------------------------------------------------------
# The task.
# ---------------------------------------------------------------------------------------------------


def check_config(config) -> None:
  """The ``task`` section of a ``word_problems`` experiment."""
  t = config.task
  cc.require_positive(t, "task", "num_sft", "num_train", "num_validation", "num_test")
  cc.require(0 <= t.multiply_fraction <= 1, "task.multiply_fraction", t.multiply_fraction, "must be in [0, 1]")
  cc.require(0 <= t.distractor_prob <= 1, "task.distractor_prob", t.distractor_prob, "must be in [0, 1]")
  cc.require(1 <= t.min_steps <= t.max_steps <= 3, "task.max_steps", (t.min_steps, t.max_steps),
             "need 1 <= min_steps <= max_steps <= 3 (the prompt budget is sized for three steps)")
  cc.require(t.workers in ("programmatic", "models"), "task.workers", t.workers,
             "must be 'programmatic' (WordProblemWorker) or 'models' (trained worker models)")
  cc.require(t.workers == "programmatic" or bool(t.workers_dir), "task.workers_dir", t.workers_dir,
             "task.workers='models' needs the directory of the trained worker models "
             "(lemon_rl.training.worker_models.train_worker_models)")
  from lemon_rl.training import lemon  # pylint: disable=g-import-not-at-top
  try:
    lemon.RewardSettings.from_config(t.reward, TASK_SCHEMA)
  except (ValueError, KeyError, TypeError) as e:
    raise cc.ConfigError(f"config.task.reward: {e}") from None


def _generator_kwargs(cfg) -> dict[str, Any]:
  return {"multiply_fraction": float(cfg.multiply_fraction), "steps": (int(cfg.min_steps), int(cfg.max_steps)),
          "distractor_prob": float(cfg.distractor_prob)}


def build_task(cfg, data_dir: str) -> Task:
  """The ``word_problems`` task (in memory; ``data_dir`` unused).

  Rewards: one :class:`lemon_rl.training.lemon.OrchestrationScorer` (parse, execute with the worker pool
  ``cfg.workers``, score with ``cfg.reward``); evaluation scores task success (``accuracy``) and logs the
  reward's parts. Config fields: ``data_seed``, ``num_sft``, ``num_train``, ``num_validation``,
  ``num_test``, ``multiply_fraction``, ``distractor_prob``, ``min_steps``, ``max_steps``, ``workers``,
  ``workers_dir``, ``worker_models`` (the sizes, for loading), ``reward``.
  """
  del data_dir
  from lemon_rl.training import lemon, worker_models  # pylint: disable=g-import-not-at-top

  kwargs = _generator_kwargs(cfg)
  tokenizer = ByteTokenizer()
  if cfg.workers == "programmatic":
    workers = programmatic_workers(tokenizer=tokenizer)
  else:
    workers = worker_models.load_worker_models(cfg.workers_dir, cfg.worker_models, tokenizer,
                                               max_new_tokens=WORKER_MAX_NEW_TOKENS)
  executor = ex_lib.Executor(workers, schema=TASK_SCHEMA, max_input_chars=MAX_INPUT_CHARS)
  scorer = lemon.OrchestrationScorer(executor, lemon.RewardSettings.from_config(cfg.reward, TASK_SCHEMA),
                                     check=answer_matches, breakdown_field="kind")
  return Task(
      tokenizer=tokenizer,
      sft_source=sft_specs(cfg.data_seed, cfg.num_sft, **kwargs),
      rl_source=examples(cfg.data_seed, cfg.num_train, "rl", **kwargs),
      test_examples=examples(cfg.data_seed, cfg.num_test, "test", **kwargs),
      validation_examples=examples(cfg.data_seed, cfg.num_validation, "validation", **kwargs),
      rewards=[WeightedReward(lemon.REWARD_NAME, scorer, 1.0)],
      eval_reward=scorer.success_view(),
      max_new_tokens=spec_token_budget(),
      max_completion_len=max_teacher_chars() + 1,
      prompt_len=orchestrator_prompt_len(),
  )


TASKS.register("word_problems", build_task)
TASK_CONFIG_CHECKS.register("word_problems", check_config)
