"""A verifiable code reward: is the prompt plus the completion valid Python so far?

A completion either ends with an end-of-sequence id (the model says the source is finished) or runs into the
token limit (the source is cut mid-stream). The reward is 1 when

- *finished*: ``prompt + completion`` compiles as a module (``compile(..., "exec")``), or
- *cut*: ``prompt + completion`` up to its last newline is a valid prefix of some module:
  :func:`codeop.compile_command` (the interactive interpreter's test) returns a code object or ``None``
  ("incomplete": an open block, bracket or string) instead of raising ``SyntaxError``,

and the completion has at least ``min_lines`` complete lines (newlines); 0 otherwise. *Decisions*: the text
after the last newline of a cut completion is dropped (a line cut mid-token, e.g. inside a name, says nothing
about the model); a finished completion must be complete, so ending right after ``def f(x):`` earns nothing;
and ``min_lines`` keeps stopping early from being a shortcut where the prompt alone would compile (a head
that ends with its docstring is a whole function: with ``min_lines = 0`` a GRPO run learnt to emit EOS
right after it).
Compiling never executes the code. ``SyntaxWarning`` (e.g. an invalid escape sequence) does not count as an
error; ``ValueError`` (a NUL character), ``OverflowError``, ``RecursionError`` and ``MemoryError`` (absurdly
nested input) do.
"""

from __future__ import annotations

import codeop
import warnings
from typing import Sequence

import numpy as np

from lemon_rl.rewards.base import RewardOutput

VALID = "valid"  # Compiles (finished) or is a valid prefix (cut).
INVALID = "invalid"
_ERRORS = (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError)


def syntax_status(source: str, finished: bool) -> str:
  """:data:`VALID` or :data:`INVALID` for ``source`` as a whole module (``finished``) or as a prefix of one
  cut after its last newline (module docstring)."""
  if not finished:
    source = source[:source.rfind("\n") + 1]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      if finished:
        compile(source, "<completion>", "exec", dont_inherit=True)
      else:
        codeop.compile_command(source, "<completion>", "exec")
    except _ERRORS:
      return INVALID
  return VALID


class PythonSyntaxReward:
  """``reward_fn(prompts, completions, completion_ids) -> RewardOutput``: 1 for valid Python so far, else 0.

  Args:
    eos_ids: the ids that end a completion (a completion whose last id is one of them is *finished*).
    min_lines: complete lines (newlines) a completion needs to earn anything.

  Logged per sample: ``finished`` (ended with EOS) and ``lines`` (newlines in the completion).
  """

  def __init__(self, eos_ids: Sequence[int], min_lines: int = 0):
    self.eos_ids = frozenset(int(i) for i in eos_ids)
    self.min_lines = int(min_lines)

  def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
               **fields) -> RewardOutput:
    del fields
    finished = np.asarray([bool(ids) and ids[-1] in self.eos_ids for ids in completion_ids])
    lines = np.asarray([c.count("\n") for c in completions], np.float32)
    valid = np.asarray([syntax_status(p + c, f) == VALID for p, c, f in zip(prompts, completions, finished)])
    rewards = (valid & (lines >= self.min_lines)).astype(np.float32)
    return RewardOutput(rewards, {"finished": finished.astype(np.float32), "lines": lines})
