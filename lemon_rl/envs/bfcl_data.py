"""BFCL's own single-turn data (from the installed ``bfcl-eval`` package) in the tool-use example format.

``bfcl-eval`` ships its questions as ``bfcl_eval/data/BFCL_v4_<category>.json`` (JSON lines:
``{"id", "question": [[{"role", "content"}, ...]], "function": [docs]}``) and the possible answers as
``data/possible_answer/BFCL_v4_<category>.json`` (``{"id", "ground_truth": [{func: {param: [values]}}]}``);
irrelevance categories have no answer file (gold ``[]``: no call is right). This module reads those files
without importing ``bfcl_eval`` (importing it writes folders into site-packages unless
``BFCL_PROJECT_ROOT`` is set, and pulls model SDKs), so it works with ``pip install --no-deps bfcl-eval``.

Each example has the fields of :mod:`lemon_rl.envs.tool_use` examples: ``id`` (BFCL's), ``category`` (our
name, e.g. ``"simple"`` or ``"live_multiple"``), ``query`` (the user messages of the single turn, joined by
newlines; system messages are kept in ``system``), ``functions``, ``gold``, ``prompt`` (compact signatures,
:func:`tool_use.render_prompt`), ``demonstration`` (a call block built from the first acceptable value of
every non-optional gold parameter, with a one-line thinking; BFCL has no reasoning traces), and
``num_conversions = -1`` (unknown), plus ``source = "bfcl"``.

When ``bfcl-eval`` is not installed, :func:`bfcl_available` is ``False`` and :func:`load_bfcl` raises
``FileNotFoundError`` with the install hint; tests skip on it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from lemon_rl.envs import tool_use

# Our category name -> BFCL v4 file stem. Multi-turn, Java/JavaScript, memory, web-search and relevance
# (any call counts) categories are not single-turn Python possible-answer tasks and are not loaded.
CATEGORY_FILES: dict[str, str] = {
    "simple": "simple_python",
    "multiple": "multiple",
    "parallel": "parallel",
    "parallel_multiple": "parallel_multiple",
    "irrelevance": "irrelevance",
    "live_simple": "live_simple",
    "live_multiple": "live_multiple",
    "live_parallel": "live_parallel",
    "live_parallel_multiple": "live_parallel_multiple",
    "live_irrelevance": "live_irrelevance",
}
VERSION_PREFIX = "BFCL_v4_"
INSTALL_HINT = ("pip install --no-deps bfcl-eval (see DESIGN.md: its pinned dependencies clash with jax; "
                "only its data files are read here)")


def bfcl_data_dir() -> str | None:
  """``.../site-packages/bfcl_eval/data`` of the installed package (found without importing it), or None."""
  try:
    spec = importlib.util.find_spec("bfcl_eval")
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  for root in spec.submodule_search_locations:
    data = os.path.join(root, "data")
    if os.path.isdir(data):
      return data
  return None


def bfcl_available() -> bool:
  """Whether BFCL's data files can be read."""
  return bfcl_data_dir() is not None


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _pick(acceptable: Any, required: bool = False) -> tuple[bool, Any]:
  """``(present, value)`` for one gold parameter.

  Omitted if optional (``""`` listed) unless the schema requires it (BFCL has a few such items), else the
  first acceptable value that is not ``""``.
  """
  if not isinstance(acceptable, list):
    return True, _concrete(acceptable)
  values = [v for v in acceptable if not (isinstance(v, str) and v == "")]
  if not values or ("" in acceptable and not required):
    return False, None
  return True, _concrete(values[0])


def _concrete(value: Any) -> Any:
  """A concrete argument from a possible-answer value (dict answers map keys to acceptable lists)."""
  if isinstance(value, dict):
    out = {}
    for key, acceptable in value.items():
      present, v = _pick(acceptable)
      if present:
        out[key] = v
    return out
  if isinstance(value, list):
    return [_concrete(v) for v in value]
  return value


def demonstration_from_gold(gold: list[dict[str, dict[str, list[Any]]]],
                            functions: list[dict[str, Any]] | None = None, style: str = "json") -> str:
  """A completion whose call block is the gold's first acceptable answer (optional parameters omitted).

  ``functions`` (the docs) let parameters the schema requires be given even where the gold marks them
  optional.
  """
  required = {f.get("name"): set((f.get("parameters") or {}).get("required") or []) for f in functions or []}
  calls = []
  for entry in gold:
    (name, params), = entry.items()
    args = {}
    for param, acceptable in params.items():
      present, v = _pick(acceptable, param in required.get(name, ()))
      if present:
        args[param] = v
    calls.append((name, args))
  if calls:
    thinking = "Use " + ", ".join(dict.fromkeys(n for n, _ in calls)) + "."
  else:
    thinking = "No offered tool fits."
  return tool_use.render_completion(thinking, calls, style)


def load_bfcl(category: str, limit: int | None = None, style: str = "json",
              data_dir: str | None = None) -> list[dict[str, Any]]:
  """Loads one BFCL category as tool-use examples.

  Args:
    category: a key of :data:`CATEGORY_FILES`.
    limit: keep the first ``limit`` examples (file order) if set.
    style: call-block style of the demonstrations (:func:`tool_use.render_calls`).
    data_dir: a local folder laid out like bfcl-eval's ``data/`` (``BFCL_v4_<stem>.json`` and
      ``possible_answer/``); default: the installed package's.

  Returns:
    The examples (module docstring).

  Raises:
    ValueError: unknown category. FileNotFoundError: bfcl-eval not installed or the file is missing.
  """
  if category not in CATEGORY_FILES:
    raise ValueError(f"unknown BFCL category {category!r}; expected one of {sorted(CATEGORY_FILES)}")
  data = data_dir if data_dir is not None else bfcl_data_dir()
  if data is None:
    raise FileNotFoundError(f"bfcl-eval is not installed; {INSTALL_HINT}")
  stem = VERSION_PREFIX + CATEGORY_FILES[category] + ".json"
  question_path = os.path.join(data, stem)
  if not os.path.isfile(question_path):
    raise FileNotFoundError(f"BFCL data file {question_path} not found (bfcl-eval version without v4 data?)")
  questions = _read_jsonl(question_path)
  if limit is not None:
    questions = questions[:limit]
  answers: dict[str, list[Any]] = {}
  if "irrelevance" not in category:
    answer_path = os.path.join(data, "possible_answer", stem)
    if not os.path.isfile(answer_path):
      raise FileNotFoundError(f"BFCL possible-answer file {answer_path} not found")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(answer_path)}
  examples = []
  for q in questions:
    turn = q["question"][0] if q["question"] and isinstance(q["question"][0], list) else q["question"]
    user = [m["content"] for m in turn if m.get("role") == "user"]
    system = [m["content"] for m in turn if m.get("role") == "system"]
    query = "\n".join(user)
    gold = [] if "irrelevance" in category else answers[q["id"]]
    functions = q["function"]
    examples.append({
        "id": q["id"],
        "category": category,
        "query": query,
        "system": "\n".join(system),
        "functions": functions,
        "gold": gold,
        "prompt": tool_use.render_prompt(query, functions),
        "demonstration": demonstration_from_gold(gold, functions, style),
        "num_conversions": -1,
        "source": "bfcl",
    })
  return examples
