r"""Math word problems from local files in their public formats (GSM8K, MATH) or from reasoning-gym's GSM-Symbolic.

Formats read (one record per row; ``.jsonl`` JSON lines, ``.json`` a JSON array or JSON lines, and, if the
optional ``datasets`` library is importable, ``.parquet`` / ``.arrow`` files and ``save_to_disk`` folders):

- ``gsm8k`` (openai/grade-school-math): ``{"question", "answer"}``; ``answer`` is the worked solution with
  calculator annotations ``<<48/2=24>>`` and ends with ``#### <number>``.
- ``math`` (hendrycks/math, MATH-500): ``{"problem", "solution", "level", "type"}`` (``subject`` is read when
  ``type`` is absent; an ``answer`` column, as MATH-500 has, is preferred over the solution's box); the gold is
  the solution's last ``\boxed{...}``.
- ``gsm_symbolic``: ``reasoning_gym.create_dataset("gsm_symbolic", ...)`` (GSM-Symbolic templates instantiated
  offline; optional dependency ``pip install lemon_rl[reasoning]``); each item's chain of thought ends in
  ``#### <number>`` like GSM8K's.

Every record becomes ``{id, prompt, question, answer, solution, completion, level, type, source}`` (all
``str``): ``answer`` is the gold final answer (GSM8K: the number after ``####`` without thousands separators;
MATH: the boxed LaTeX), ``completion`` the demonstration (GSM8K's solution without calculator annotations,
MATH's solution), ``prompt`` = ``PROMPTS[format].format(question=...)``, which asks for the answer in the
convention :func:`lemon_rl.rewards.math_verify_reward.extract_final_answer` reads.

Splits. ``canonical_key`` is the normalised question (NFKC, case-folded, whitespace collapsed); a GSM-Symbolic
item's key is its template and the numbers of its question, so two instances that differ only in names or
objects are one problem. With ``test_files`` (e.g. GSM8K's ``test.jsonl``) the test split is those records and
every other record whose key occurs there is dropped; the other records go to buckets by
``lemon_rl.data.splits.content_bucket`` (``test`` only without ``test_files``, ``validation``, ``train``, and
the rest ``sft``), so no key is in two splits. Repeated keys within one split are kept once.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from typing import Any, Iterable, Sequence

from lemon_rl.data import splits as content_splits
from lemon_rl.rewards.math_verify_reward import last_boxed

FORMATS: tuple[str, ...] = ("gsm8k", "math", "gsm_symbolic")
SPLITS: tuple[str, ...] = ("sft", "train", "validation", "test")
FIELDS: tuple[str, ...] = ("id", "prompt", "question", "answer", "solution", "completion", "level", "type",
                           "source")
SALT = b"lemon_math_v1"
DEFAULT_TEST_FRACTION = 0.1  # Share of keys in test (only without test_files).
DEFAULT_VALIDATION_FRACTION = 0.05
DEFAULT_TRAIN_FRACTION = 0.5  # RL prompts; the rest of the key space is SFT.
PROMPTS: dict[str, str] = {
    "gsm8k": "{question}\nSolve step by step, then write the final answer after \"#### \".\n",
    "gsm_symbolic": "{question}\nSolve step by step, then write the final answer after \"#### \".\n",
    "math": "{question}\nSolve step by step, and put your final answer within \\boxed{{}}.\n",
}
DATASETS_HINT = "pip install datasets (needed only for parquet/arrow files and save_to_disk folders)"
REASONING_GYM_HINT = "pip install 'lemon_rl[reasoning]' (reasoning-gym) for the gsm_symbolic source"
_CALCULATOR = re.compile(r"<<[^<>]*>>")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_SYMBOLIC_SUFFIX = " Give the result as your final answer. Do not include units."


# ------------------------------------------------------------------------------------------------------
# Reading rows.


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """The rows of one local file (module docstring); ``ValueError`` names the file and line of a bad row."""
  path = os.fspath(path)
  if os.path.isdir(path) or path.endswith((".parquet", ".arrow")):
    return _read_with_datasets(path)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if path.endswith(".json") and text.lstrip().startswith("["):
    rows = json.loads(text)
  else:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{number}: not a JSON line ({e})") from e
  if not all(isinstance(r, dict) for r in rows):
    raise ValueError(f"{path}: expected JSON objects (one per row)")
  return rows


def datasets_available() -> bool:
  """Whether the optional Hugging Face ``datasets`` library can be imported."""
  try:
    import datasets  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def _read_with_datasets(path: str) -> list[dict[str, Any]]:
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"reading {path} needs the Hugging Face datasets library: {DATASETS_HINT}") from e
  if os.path.isdir(path):
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
      raise ValueError(f"{path} holds several splits ({list(ds)}); pass one split's folder")
  elif path.endswith(".arrow"):
    ds = datasets.Dataset.from_file(path)
  else:
    ds = datasets.Dataset.from_parquet(path)
  return [dict(row) for row in ds]


# ------------------------------------------------------------------------------------------------------
# Rows -> records.


def gsm8k_final_answer(answer_text: str) -> str:
  """The number after GSM8K's last ``####`` without thousands separators (``"#### 1,200"`` -> ``"1200"``)."""
  if "####" not in answer_text:
    raise ValueError(f"GSM8K answer has no '####' line: {answer_text[-80:]!r}")
  return answer_text.rsplit("####", 1)[1].strip().replace(",", "")


def _record(fmt: str, index: str, question: str, answer: str, solution: str, level: str = "",
            type_: str = "") -> dict[str, str]:
  return {"id": index, "prompt": PROMPTS[fmt].format(question=question), "question": question,
          "answer": answer, "solution": solution, "completion": solution, "level": level, "type": type_,
          "source": fmt}


def gsm8k_record(row: dict[str, Any], index: str) -> dict[str, str]:
  """One GSM8K row as a record (module docstring); calculator annotations are removed from the solution."""
  question, answer_text = str(row["question"]).strip(), str(row["answer"])
  solution = _CALCULATOR.sub("", answer_text).strip()
  return _record("gsm8k", index, question, gsm8k_final_answer(answer_text), solution)


def math_record(row: dict[str, Any], index: str) -> dict[str, str]:
  """One MATH row as a record; the gold is ``row["answer"]`` if present, else the solution's last box."""
  problem, solution = str(row["problem"]).strip(), str(row["solution"]).strip()
  answer = row.get("answer")
  answer = str(answer).strip() if answer not in (None, "") else last_boxed(solution)
  if not answer:
    raise ValueError(f"MATH solution has no \\boxed{{...}} answer: {solution[-80:]!r}")
  return _record("math", index, problem, answer, solution, str(row.get("level", "")),
                 str(row.get("type", row.get("subject", ""))))


def read_records(fmt: str, paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, str]]:
  """The records of the files ``paths`` in format ``fmt`` (``"gsm8k"`` or ``"math"``); ids are ``file:row``."""
  if fmt not in ("gsm8k", "math"):
    raise ValueError(f"files can be read as 'gsm8k' or 'math', not {fmt!r}")
  convert = gsm8k_record if fmt == "gsm8k" else math_record
  records = []
  for path in paths:
    for i, row in enumerate(read_rows(path)):
      try:
        records.append(convert(row, f"{os.path.basename(os.fspath(path))}:{i}"))
      except (KeyError, ValueError) as e:
        raise ValueError(f"{os.fspath(path)}: row {i} is not a {fmt} record: {e!r}") from e
  return records


def gsm_symbolic_records(seed: int, size: int) -> list[dict[str, str]]:
  """``size`` GSM-Symbolic items generated offline by reasoning-gym (``type`` = ``gsm_symbolic_<template>``)."""
  try:
    import reasoning_gym  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"the gsm_symbolic source needs reasoning-gym: {REASONING_GYM_HINT}") from e
  dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
  records = []
  for i in range(size):
    item = dataset[i]
    question = item["question"]
    if question.endswith(_SYMBOLIC_SUFFIX):  # Our prompt states the answer format itself.
      question = question[:-len(_SYMBOLIC_SUFFIX)]
    records.append(_record("gsm_symbolic", f"gsm_symbolic:{seed}:{i}", question.strip(), str(item["answer"]),
                           item["metadata"]["answer_cot"].strip(),
                           type_=f"gsm_symbolic_{dataset.task_indices[i]}"))
  return records


# ------------------------------------------------------------------------------------------------------
# Content keys and splits.


def normalise_text(text: str) -> str:
  """NFKC, case-folded, whitespace collapsed, trailing punctuation dropped."""
  text = unicodedata.normalize("NFKC", text).casefold()
  return " ".join(text.split()).rstrip(" .?!")


def canonical_key(example: dict[str, Any]) -> str:
  """The content key (module docstring): normalised question; GSM-Symbolic: template + question numbers."""
  if example.get("source") == "gsm_symbolic":
    return f"{example['type']}:{','.join(_NUMBER.findall(example['question']))}"
  return normalise_text(example["question"])


def fractions(test_fraction: float | None, validation_fraction: float,
              train_fraction: float) -> tuple[tuple[str, float], ...]:
  """The bucket fractions (``sft`` is the rest); without ``test_fraction`` no key goes to test."""
  out = (("validation", validation_fraction), ("train", train_fraction))
  if test_fraction is not None:
    out = (("test", test_fraction),) + out
  content_splits.check_fractions(out, "sft")
  return out


def bucket_of(key: str, bucket_fractions: Sequence[tuple[str, float]]) -> str:
  return content_splits.content_bucket(key, SALT, bucket_fractions, "sft")


def assign_splits(records: Sequence[dict[str, str]], test_records: Sequence[dict[str, str]] | None = None, *,
                  test_fraction: float = DEFAULT_TEST_FRACTION,
                  validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                  train_fraction: float = DEFAULT_TRAIN_FRACTION) -> dict[str, list[dict[str, str]]]:
  """``{split: records}`` disjoint by :func:`canonical_key` (module docstring), in input order.

  Args:
    records: the pool the buckets split.
    test_records: a fixed test set (then ``test_fraction`` is unused and pool records with a test key are
      dropped); None draws test from the pool by ``test_fraction``.
    test_fraction, validation_fraction, train_fraction: bucket shares of the key space; SFT gets the rest.
  """
  bucket_fractions = fractions(None if test_records is not None else test_fraction, validation_fraction,
                               train_fraction)
  out: dict[str, list[dict[str, str]]] = {split: [] for split in SPLITS}
  seen: set[str] = set()
  if test_records is not None:
    for record in test_records:
      key = canonical_key(record)
      if key not in seen:
        seen.add(key)
        out["test"].append(record)
  for record in records:
    key = canonical_key(record)
    if key in seen:  # A repeat within a split, or a pool record that is in the fixed test set.
      continue
    seen.add(key)
    out[bucket_of(key, bucket_fractions)].append(record)
  return out


def symbolic_splits(seed: int, sizes: dict[str, int], *, test_fraction: float = DEFAULT_TEST_FRACTION,
                    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                    train_fraction: float = DEFAULT_TRAIN_FRACTION) -> dict[str, list[dict[str, str]]]:
  """GSM-Symbolic splits of ``sizes[split]`` records each, disjoint by key, from one generated pool.

  The pool has ``ceil(1.25 max_s(sizes[s] / mass_s)) + 64`` items (``mass_s`` the bucket's share); raises
  ``ValueError`` if a bucket still comes up short.
  """
  bucket_fractions = fractions(test_fraction, validation_fraction, train_fraction)
  masses = {s: content_splits.bucket_mass(bucket_fractions, "sft", s) for s in SPLITS}
  pool_size = int(1.25 * max(sizes.get(s, 0) / masses[s] for s in SPLITS)) + 64
  split = assign_splits(gsm_symbolic_records(seed, pool_size), test_fraction=test_fraction,
                        validation_fraction=validation_fraction, train_fraction=train_fraction)
  out = {}
  for s in SPLITS:
    if len(split[s]) < sizes.get(s, 0):
      raise ValueError(f"gsm_symbolic: only {len(split[s])} distinct {s} items in a pool of {pool_size}; "
                       f"asked for {sizes[s]}")
    out[s] = split[s][:sizes.get(s, 0)]
  return out
