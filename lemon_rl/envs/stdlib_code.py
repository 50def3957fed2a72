"""Code-completion prompts from the standard library: a function's head, the model writes its body.

A *function head* is the source of a ``def`` (a module-level function or a method of a module-level class),
dedented to column 0, from the ``def`` line (decorators left out) through its docstring when it has one,
otherwise through its first body line. It is kept when the function has at least ``min_body_lines`` further
lines (something left to write) and its head is ``min_tokens..max_tokens`` tokens long. The reward of a
completion is :class:`lemon_rl.rewards.python_syntax.PythonSyntaxReward` (the head plus the completion is
valid Python so far).

Splits (:func:`code_splits`): training prompts come from the corpus's training packages (the code the stdlib
target was trained on), validation and test prompts from its held-out packages, alternately by package in
sorted order (:mod:`lemon_rl.data.stdlib_corpus`: no package has files on both sides), so the three splits are
disjoint by file. :func:`check_disjoint_code` asserts in addition that no evaluation head (lines stripped of
their indentation) occurs verbatim in the training files, and that no head is in two splits.
"""

from __future__ import annotations

import ast
import textwrap
from typing import Any, Sequence

from lemon_rl.data.stdlib_corpus import SourceFile, StdlibCorpus


def _head_end(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """1-based last line of the head: the docstring's last line, else the first body line."""
  first = node.body[0]
  is_docstring = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                  and isinstance(first.value.value, str))
  return first.end_lineno if is_docstring else first.lineno


def function_heads(text: str, min_body_lines: int = 3) -> list[tuple[str, str]]:
  """``(qualified name, head)`` of every module-level function and method of a module-level class in
  ``text`` with at least ``min_body_lines`` lines after its head (none for a file that does not parse)."""
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):
    return []
  lines = text.splitlines(keepends=True)
  candidates = [(None, n) for n in tree.body]
  candidates += [(c.name, n) for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
  out = []
  for owner, node in candidates:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    end = _head_end(node)
    if node.end_lineno - end < min_body_lines:
      continue
    head = textwrap.dedent("".join(lines[node.lineno - 1:end]))
    out.append((f"{owner}.{node.name}" if owner else node.name, head))
  return out


def code_prompts(files: Sequence[SourceFile], tokenizer, *, min_tokens: int, max_tokens: int,
                 min_body_lines: int = 3) -> list[dict[str, Any]]:
  """Records ``{"prompt", "path", "name", "prompt_tokens"}`` of the heads of ``files`` (first occurrence of
  each head text, in file order) whose token count (``tokenizer.encode``) is in ``[min_tokens, max_tokens]``."""
  out, seen = [], set()
  for f in files:
    for name, head in function_heads(f.text, min_body_lines):
      n = len(tokenizer.encode(head))
      if head in seen or not min_tokens <= n <= max_tokens:
        continue
      seen.add(head)
      out.append({"prompt": head, "path": f.path, "name": name, "prompt_tokens": n})
  return out


def _stripped(text: str) -> str:
  return "\n".join(line.strip() for line in text.splitlines())


def code_splits(corpus: StdlibCorpus, tokenizer, *, min_tokens: int, max_tokens: int, min_body_lines: int = 3
                ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
  """``({"train", "validation", "test"}: prompt records, disjointness counts)`` (module docstring).

  A held-out head that occurs verbatim (indentation stripped) in a training file, e.g. a one-line
  ``__init__`` every package writes, is dropped (counted as ``{split}_dropped_in_train_files``); then
  :func:`check_disjoint_code` asserts the splits are disjoint."""
  held_out = corpus.packages("test")
  by_split = {"validation": set(held_out[0::2]), "test": set(held_out[1::2])}
  kwargs = dict(min_tokens=min_tokens, max_tokens=max_tokens, min_body_lines=min_body_lines)
  splits = {"train": code_prompts(corpus.files("train"), tokenizer, **kwargs)}
  training = "\n".join(_stripped(f.text) for f in corpus.files("train"))
  info = {}
  for split, packages in by_split.items():
    records = code_prompts([f for f in corpus.files("test") if f.package in packages], tokenizer, **kwargs)
    splits[split] = [r for r in records if _stripped(r["prompt"]) not in training]
    info[f"{split}_dropped_in_train_files"] = len(records) - len(splits[split])
  return splits, {**info, **check_disjoint_code(splits, training)}


def check_disjoint_code(splits: dict[str, list[dict[str, Any]]], training: str) -> dict[str, int]:
  """Asserts that no head of a split other than ``train`` occurs in ``training`` (the training files, lines stripped of
  indentation) and that no head is in two splits; returns the counts (all 0) and the split sizes."""
  out = {f"{split}_prompts": len(records) for split, records in splits.items()}
  for split in (s for s in splits if s != "train"):
    out[f"{split}_in_train_files"] = sum(_stripped(r["prompt"]) in training for r in splits[split])
  names = list(splits)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      out[f"{a}_in_{b}"] = len({r["prompt"] for r in splits[a]} & {r["prompt"] for r in splits[b]})
  leaks = {k: v for k, v in out.items() if "_in_" in k and v}
  assert not leaks, f"code prompts overlap the training files or each other: {leaks}"
  return out
