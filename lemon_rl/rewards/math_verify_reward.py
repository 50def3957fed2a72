r"""Math answer reward: extract a completion's final answer and verify it against the gold with ``math-verify``.

Reward (per completion ``c`` with gold ``g``)::

    r(c, g) = 1  if verify(parse(g), parse(extract(c)))
              0  otherwise (also when nothing can be extracted, parsing fails, or verification raises).

``extract(c)`` (:func:`extract_final_answer`) takes, in this order of precedence:

1. the content of the LAST ``\boxed{...}`` (or ``\fbox{...}``), braces matched (MATH's convention);
2. else the text after the LAST ``####`` up to the end of its line (GSM8K's convention);
3. else the LAST number in the text (``-1,234.5``, ``3/4``, ``50%``; thousands separators kept for the parser).

Nothing after a final EOS string counts (:func:`lemon_rl.rewards.formats.clean_completion`). The extracted
string and the gold are each parsed as ``$<text>$`` by ``math_verify.parse`` (LaTeX first, then plain
expressions), so ``\frac{1}{2}``, ``1/2`` and ``0.5`` are one value, ``\{1,2\}`` and ``\{2,1\}`` one set,
``(0,1]`` an interval distinct from ``(0,1)``. Behaviour inherited from ``math-verify`` 0.9 (documented there,
checked in ``tests/test_math_reward.py``): text units after a number are dropped (``5 cm`` = ``5``);
``50\%`` equals both ``50`` and ``0.5``; a bare equation ``x=3`` compares its right-hand side; numbers are
compared after rounding to 6 decimals (``0.333`` is not ``1/3``); a gold ``(1, 2)`` is read as an interval OR a
tuple, so ``\{1, 2\}`` matches it (a grader would say no; the one disagreement of the test table).

Never raises on model output: any exception inside extraction, parsing or verification gives reward 0
(``math-verify``'s own time limits use ``signal.alarm`` and are switched off outside the main thread).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np

from lemon_rl.rewards.base import RewardOutput
from lemon_rl.rewards.formats import as_text, check_same_length, clean_completion

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_HASHES = "####"
# A signed number with optional thousands separators, decimals, a fraction bar or a percent sign.
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?\s*%?|-?\.\d+%?")


def last_boxed(text: str) -> str | None:
  r"""The content of the last ``\boxed{...}`` / ``\fbox{...}`` (braces matched), ``\boxed 5`` -> ``5``; or None.

  An unclosed box (``\boxed{3``) yields None.
  """
  start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
  if start < 0:
    return None
  cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
  i = start + len(cmd)
  if i < len(text) and text[i] == " ":  # ``\boxed 5``: the next token.
    rest = text[i + 1:].split("$")[0].strip()
    return rest.split()[0] if rest else None
  if i >= len(text) or text[i] != "{":
    return None
  depth = 0
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j]
  return None


def extract_final_answer(completion: Any) -> str | None:
  """The completion's final answer string (module docstring, steps 1-3), or None if there is none."""
  text = clean_completion(completion)
  if not text:
    return None
  if any(cmd in text for cmd in _BOX_COMMANDS):
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
      return boxed.strip()
  if _HASHES in text:
    tail = text.rsplit(_HASHES, 1)[1].strip().split("\n")[0].strip()
    if tail:
      return tail
  numbers = _NUMBER.findall(text)
  if numbers:
    return numbers[-1].strip().rstrip(",")
  return None


def _parse(text: str, in_main_thread: bool) -> list[Any]:
  """``math_verify.parse`` of ``$text$`` (LaTeX, then plain expressions); [] if nothing parses."""
  from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse  # pylint: disable=g-import-not-at-top
  wrapped = text if "$" in text or "\\(" in text or "\\[" in text else f"${text}$"
  timeout = 5 if in_main_thread else None
  return parse(wrapped, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
               parsing_timeout=timeout)


def is_equivalent(predicted: str | None, gold: str | None) -> bool:
  """Whether ``predicted`` and ``gold`` (answer strings, not whole completions) denote the same value.

  False on a missing or unparsable side and on any exception (never raises).
  """
  if not predicted or not gold:
    return False
  try:
    from math_verify import verify  # pylint: disable=g-import-not-at-top
    main = threading.current_thread() is threading.main_thread()
    gold_parsed = _parse(gold, main)
    pred_parsed = _parse(predicted, main)
    if not gold_parsed or not pred_parsed:
      return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=5 if main else None))
  except Exception:  # pylint: disable=broad-except  # Malformed model output must score 0, not crash training.
    return False


def math_answer_reward(prompts: list[str], completions: list[Any], completion_ids: list[list[int]],
                       answer: list[Any], **unused: list[Any]) -> RewardOutput:
  """1.0 where the completion's final answer equals the gold ``answer`` under ``math-verify``, else 0.0.

  Args:
    prompts: ``[N]`` (unused).
    completions: ``[N]`` decoded completions (``str`` or ``bytes``; anything else scores 0).
    completion_ids: ``[N]`` (unused).
    answer: ``[N]`` gold final answers (GSM8K's number after ``####``, MATH's boxed LaTeX).
    **unused: other example fields.

  Returns:
    ``RewardOutput(rewards [N] float32 in {0, 1}, metrics={"extracted": [N]})``, where ``extracted`` is 1 if a
    final answer was found in the completion (a format signal: ``rewards <= extracted`` elementwise).
  """
  del prompts, completion_ids, unused
  n = check_same_length("math_answer_reward", completions, answer=answer)
  rewards = np.zeros(n, np.float32)
  extracted = np.zeros(n, np.float32)
  for i, (completion, gold) in enumerate(zip(completions, answer)):
    try:
      predicted = extract_final_answer(completion)
    except Exception:  # pylint: disable=broad-except
      predicted = None
    extracted[i] = predicted is not None
    rewards[i] = float(is_equivalent(predicted, as_text(gold)))
  return RewardOutput(rewards, {"extracted": extracted})
