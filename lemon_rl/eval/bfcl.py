"""BFCL-style evaluation: per-category accuracy and BFCL's summary scores on the local BFCL data.

The verdict on each answer is :func:`lemon_rl.rewards.bfcl_checker.check_output` (BFCL's own rules, not
the CAST reward's). Data: BFCL v4 files of the installed ``bfcl-eval`` package, read without importing it
(:mod:`lemon_rl.envs.bfcl_data`), or any directory laid out like its ``data/`` folder.

Categories use :data:`lemon_rl.envs.bfcl_data.CATEGORY_FILES`' names (``simple`` is BFCL's
``simple_python``; the others are BFCL's own). A category's accuracy is ``correct / scored``, as BFCL's
``save_eval_results`` computes it; BFCL requires every entry of an evaluated category unless
``--partial-eval`` is set, and so does :func:`score_outputs` unless ``partial=True``.

Summary scores, as BFCL's ``generate_leaderboard_csv`` computes them (``n_c`` the scored count of
category ``c``, ``a_c`` its accuracy; a category that was not evaluated counts as ``a_c = 0`` with its
dataset size, which BFCL displays as ``N/A``; :attr:`Aggregate.complete` says whether every part was
evaluated):

- ``non_live = mean(simple_ast, multiple, parallel, parallel_multiple)`` with
  ``simple_ast = mean(simple_python, simple_java, simple_javascript)`` (unweighted means). Java and
  JavaScript are out of scope here, so they always count as 0 and this is never complete;
  ``non_live_python`` (ours) uses ``simple_ast = simple_python``.
- ``live = sum_c n_c a_c / sum_c n_c`` over ``live_simple, live_multiple, live_parallel,
  live_parallel_multiple`` (weighted by count).
- ``irrelevance = mean(irrelevance, live_irrelevance)``.
- ``overall = (10 non_live + 10 live + 10 irrelevance + 30 multi_turn + 40 agentic) / 100``; multi-turn
  and agentic are out of scope and count as 0, so this is BFCL's overall for a run of these categories
  only (a lower bound of a full run's). ``single_turn`` (ours) is ``mean(non_live_python, live,
  irrelevance)``, the single-turn part of ``overall`` renormalised.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from lemon_rl.envs import bfcl_data
from lemon_rl.rewards import bfcl_checker

CATEGORIES: tuple[str, ...] = tuple(bfcl_data.CATEGORY_FILES)
NON_LIVE_AST: tuple[str, ...] = ("simple", "multiple", "parallel", "parallel_multiple")
LIVE_AST: tuple[str, ...] = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
IRRELEVANCE: tuple[str, ...] = ("irrelevance", "live_irrelevance")
OVERALL_WEIGHTS: dict[str, float] = {"non_live": 10.0, "live": 10.0, "irrelevance": 10.0,
                                     "multi_turn": 30.0, "agentic": 40.0}
SUMMARY_KEYS: tuple[str, ...] = ("non_live", "non_live_python", "live", "irrelevance", "single_turn", "overall")
_STEM_TO_CATEGORY = {stem: name for name, stem in bfcl_data.CATEGORY_FILES.items()}


def bfcl_name(category: str) -> str:
  """BFCL's name of one of our categories (``simple`` -> ``simple_python``)."""
  _check_category(category)
  return bfcl_data.CATEGORY_FILES[category]


def category_of_id(entry_id: str) -> str | None:
  """Our category of a BFCL entry id (``live_simple_3-2-0`` -> ``live_simple``), or None if not in scope."""
  stem = entry_id.split(":")[0].rsplit("_", 1)[0]
  return _STEM_TO_CATEGORY.get(stem)


def _check_category(category: str) -> None:
  if category not in bfcl_data.CATEGORY_FILES:
    raise ValueError(f"unknown BFCL category {category!r}; expected one of {CATEGORIES}")


# ------------------------------------------------------------------------------------------------------
# Data.


@dataclasses.dataclass(frozen=True)
class BfclEntry:
  """One BFCL entry: ``gold`` is ``None`` for irrelevance categories (no answer file)."""

  id: str
  category: str
  functions: list[dict[str, Any]]
  gold: list[dict[str, Any]] | None
  question: list[Any]


def _data_dir(data_dir: str | None) -> str:
  if data_dir is not None:
    return data_dir
  found = bfcl_data.bfcl_data_dir()
  if found is None:
    raise FileNotFoundError(f"bfcl-eval is not installed; {bfcl_data.INSTALL_HINT}")
  return found


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def load_entries(category: str, data_dir: str | None = None) -> list[BfclEntry]:
  """All entries of one category, in file order, with their possible answers.

  Answers are paired with questions by position, as BFCL's runner does (ids are checked to agree).
  """
  _check_category(category)
  root = _data_dir(data_dir)
  stem = bfcl_data.VERSION_PREFIX + bfcl_data.CATEGORY_FILES[category] + ".json"
  questions = _read_jsonl(os.path.join(root, stem))
  answers: list[Any] = [None] * len(questions)
  if not bfcl_checker.is_irrelevance_category(category):
    rows = _read_jsonl(os.path.join(root, "possible_answer", stem))
    if len(rows) != len(questions):
      raise ValueError(f"{stem}: {len(questions)} questions but {len(rows)} possible answers")
    for q, a in zip(questions, rows):
      if q["id"] != a["id"]:
        raise ValueError(f"{stem}: question {q['id']!r} is paired with answer {a['id']!r}")
    answers = [a["ground_truth"] for a in rows]
  return [BfclEntry(q["id"], category, q["function"], a, q["question"]) for q, a in zip(questions, answers)]


def dataset_sizes(data_dir: str | None = None) -> dict[str, int]:
  """Number of entries of every category (what BFCL counts for a category that was not evaluated)."""
  root = _data_dir(data_dir)
  sizes = {}
  for category, stem in bfcl_data.CATEGORY_FILES.items():
    path = os.path.join(root, bfcl_data.VERSION_PREFIX + stem + ".json")
    with open(path, encoding="utf-8") as f:
      sizes[category] = sum(1 for line in f if line.strip())
  return sizes


# ------------------------------------------------------------------------------------------------------
# Scoring.


@dataclasses.dataclass(frozen=True)
class EntryVerdict:
  """BFCL's verdict on one entry's output."""

  id: str
  category: str
  valid: bool
  error_type: str
  error: str


@dataclasses.dataclass(frozen=True)
class CategoryScore:
  """``correct`` of ``total`` scored entries; ``size`` entries in the dataset."""

  category: str
  correct: int
  total: int
  size: int
  error_types: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def accuracy(self) -> float:
    return self.correct / self.total if self.total else 0.0


class Aggregate(NamedTuple):
  """A summary score: ``accuracy`` in [0, 1], BFCL's ``total_count``, and whether all parts were scored."""

  accuracy: float
  total_count: int
  complete: bool


@dataclasses.dataclass(frozen=True)
class BfclReport:
  """Per-category scores (evaluated categories only), summary scores and per-entry verdicts."""

  scores: dict[str, CategoryScore]
  summary: dict[str, Aggregate]
  verdicts: tuple[EntryVerdict, ...]

  def as_dict(self) -> dict[str, Any]:
    """JSON-ready: ``categories`` (with accuracy) and ``summary``; verdicts are left out."""
    return {
        "categories": {c: {**dataclasses.asdict(s), "accuracy": s.accuracy} for c, s in self.scores.items()},
        "summary": {k: a._asdict() for k, a in self.summary.items()},
    }


def score_entries(entries: Iterable[BfclEntry], outputs: Mapping[str, Any], *, decoder: str = "python",
                  strip_think: bool = False, underscore_to_dot: bool = False) -> list[EntryVerdict]:
  """Verdicts on the entries that have an output in ``outputs`` (id -> model output text)."""
  verdicts = []
  for entry in entries:
    if entry.id not in outputs:
      continue
    result = bfcl_checker.check_output(outputs[entry.id], bfcl_name(entry.category), entry.functions,
                                       entry.gold, decoder=decoder, strip_think=strip_think,
                                       underscore_to_dot=underscore_to_dot)
    verdicts.append(EntryVerdict(entry.id, entry.category, result.valid, result.error_type, result.error))
  return verdicts


def score_outputs(outputs: Mapping[str, Any], categories: Sequence[str] | None = None, *,
                  decoder: str = "python", strip_think: bool = False, underscore_to_dot: bool = False,
                  partial: bool = False, data_dir: str | None = None) -> BfclReport:
  """Scores model outputs (``{BFCL id: text}``) on the local BFCL data.

  Args:
    outputs: one output per entry id; ids of other categories (also out-of-scope ones such as
      ``simple_java_3`` or ``multi_turn_base_0``) are ignored.
    categories: the categories to evaluate; default: every in-scope category with an output.
    decoder, strip_think, underscore_to_dot: see :func:`lemon_rl.rewards.bfcl_checker.check_output`.
    partial: score only the entries present (BFCL's ``--partial-eval``); otherwise every entry of an
      evaluated category needs an output.
    data_dir: a BFCL ``data/`` directory (default: the installed bfcl-eval's).

  Raises:
    ValueError: an id of an evaluated category that names none of its entries; missing entries without
      ``partial``.
  """
  by_category: dict[str, list[str]] = collections.defaultdict(list)
  for entry_id in outputs:
    category = category_of_id(entry_id)
    if category is not None:
      by_category[category].append(entry_id)
  if categories is None:
    categories = [c for c in CATEGORIES if c in by_category]
  for c in categories:
    _check_category(c)
  sizes = dataset_sizes(data_dir)
  scores, verdicts = {}, []
  for category in categories:
    entries = load_entries(category, data_dir)
    known = {e.id for e in entries}
    unknown = [i for i in by_category.get(category, []) if i not in known]
    if unknown:
      raise ValueError(f"{len(unknown)} output ids are not entries of {category}, e.g. {unknown[:3]}")
    missing = len(entries) - len(by_category.get(category, []))
    if missing and not partial:
      raise ValueError(f"{category}: {missing} of {len(entries)} entries have no output; pass partial=True "
                       "(--partial; BFCL's --partial-eval) to score the present ones only")
    category_verdicts = score_entries(entries, outputs, decoder=decoder, strip_think=strip_think,
                                      underscore_to_dot=underscore_to_dot)
    errors = collections.Counter(v.error_type for v in category_verdicts if not v.valid)
    scores[category] = CategoryScore(category, sum(v.valid for v in category_verdicts), len(category_verdicts),
                                     sizes[category], dict(errors.most_common()))
    verdicts.extend(category_verdicts)
  return BfclReport(scores, summarize(scores, sizes), tuple(verdicts))


# ------------------------------------------------------------------------------------------------------
# BFCL's summary scores.


def _category_part(scores: Mapping[str, CategoryScore], sizes: Mapping[str, int], category: str) -> Aggregate:
  """BFCL's ``get_category_score``: a missing category is accuracy 0 with its dataset size."""
  score = scores.get(category)
  if score is None or score.total == 0:
    return Aggregate(0.0, int(sizes.get(category, 0)), False)
  return Aggregate(score.accuracy, score.total, True)


def _unweighted(parts: Sequence[Aggregate]) -> Aggregate:
  return Aggregate(sum(p.accuracy for p in parts) / len(parts), sum(p.total_count for p in parts),
                   all(p.complete for p in parts))


def _weighted(parts: Sequence[Aggregate]) -> Aggregate:
  total = sum(p.total_count for p in parts)
  accuracy = sum(p.accuracy * p.total_count for p in parts) / total if total else 0.0
  return Aggregate(accuracy, total, all(p.complete for p in parts))


def summarize(scores: Mapping[str, CategoryScore], sizes: Mapping[str, int] | None = None) -> dict[str, Aggregate]:
  """BFCL's summary scores (module docstring) from per-category scores.

  Args:
    scores: evaluated categories.
    sizes: dataset size per category (``total_count`` of a category that was not evaluated; it weights
      ``live``); default: each evaluated category's ``size``, 0 for the others.
  """
  if sizes is None:
    sizes = {c: s.size for c, s in scores.items()}
  part = {c: _category_part(scores, sizes, c) for c in CATEGORIES}
  absent = Aggregate(0.0, 0, False)  # Java / JavaScript simple, multi-turn, agentic: out of scope.
  rest = [part[c] for c in NON_LIVE_AST[1:]]
  non_live = _unweighted([_unweighted([part["simple"], absent, absent])] + rest)
  non_live_python = _unweighted([part["simple"]] + rest)
  live = _weighted([part[c] for c in LIVE_AST])
  irrelevance = _unweighted([part[c] for c in IRRELEVANCE])
  weights = OVERALL_WEIGHTS
  sections = {"non_live": non_live, "live": live, "irrelevance": irrelevance,
              "multi_turn": absent, "agentic": absent}
  overall = Aggregate(sum(weights[k] * sections[k].accuracy for k in weights) / sum(weights.values()),
                      sum(s.total_count for s in sections.values()), False)
  single_turn = _unweighted([non_live_python, live, irrelevance])
  return {"non_live": non_live, "non_live_python": non_live_python, "live": live,
          "irrelevance": irrelevance, "single_turn": single_turn, "overall": overall}


def format_report(report: BfclReport, show_errors: bool = False) -> str:
  """A per-category table and the summary scores (percentages with two decimals, as BFCL prints them)."""
  lines = [f"{'category':<24} {'BFCL name':<24} {'correct':>8} {'scored':>7} {'dataset':>7} {'accuracy':>9}"]
  for category, s in report.scores.items():
    lines.append(f"{category:<24} {bfcl_name(category):<24} {s.correct:>8} {s.total:>7} {s.size:>7} "
                 f"{100 * s.accuracy:>8.2f}%")
    if show_errors:
      for error_type, count in s.error_types.items():
        lines.append(f"    {error_type:<56} {count:>7}")
  notes = {
      "non_live": "BFCL formula; Java/JS simple count as 0",
      "non_live_python": "simple = simple_python only",
      "live": "count-weighted",
      "irrelevance": "mean of irrelevance, live_irrelevance",
      "single_turn": "mean of non_live_python, live, irrelevance",
      "overall": "BFCL weights 10/10/10/30/40; multi-turn, agentic count as 0",
  }
  lines.append("")
  lines.append(f"{'summary':<24} {'accuracy':>9}  {'complete':<8} note")
  for key in SUMMARY_KEYS:
    a = report.summary[key]
    lines.append(f"{key:<24} {100 * a.accuracy:>8.2f}%  {'yes' if a.complete else 'no':<8} {notes[key]}")
  return "\n".join(lines)
