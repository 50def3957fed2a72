r"""Scores a checkpoint on any registered task and split, with the task's own evaluation reward.

    python -m experiments.evaluate --task=gsm8k --split=test --checkpoint=DIR \
        [--config=configs/FILE.py[:variant]] [--set files=train.jsonl --set test_files=test.jsonl ...] \
        [--tokenizer=byte|DIR] [--limit=N] [--num_samples=1 --temperature=0.0] [--max_new_tokens=N] \
        [--batch_size=64] [--data_dir=DIR] [--json_out=scores.json] [--scores_out=scores.jsonl]

- ``--checkpoint``: a Hugging Face-format model directory (``config.json`` + safetensors; what
  :func:`lemon_rl.models.hf.to_hf` writes). The tokenizer is ``--tokenizer``, else the checkpoint's
  ``tokenizer.json`` if it has one, else the task's own (``byte`` for the CPU tasks).
- ``--task``: a name in :data:`lemon_rl.envs.tasks.TASKS`. Its config section is ``--config``'s ``task`` (an
  experiment config file, as ``experiments.main`` takes), else the task's default (:data:`DEFAULT_CONFIGS`),
  with ``--set FIELD=VALUE`` overrides (VALUE read as JSON when it parses, else as a string; the field's
  type is checked by the config).
- ``--split``: ``test`` (``Task.test_examples``), ``validation``, ``train`` (the RL prompts), ``sft`` or
  ``expert`` (FEST's ``D_E``), where the task has it.

Each example is answered ``--num_samples`` times (greedy by default) and scored by ``Task.eval_reward``
through :func:`lemon_rl.eval.generation.evaluate`; the report is the mean score (accuracy for 0/1 rewards)
with a 95% Student-t interval over examples (each example's mean over its samples), the mean completion
length and the reward's own metrics. Data is prepared under ``--data_dir`` (default: a ``lemon_eval_data``
folder in the system's temporary directory).

Example (the GSM8K fixtures of the tests)::

    python -m experiments.evaluate --task=gsm8k --split=test --checkpoint=/tmp/tiny_model --tokenizer=byte \
        --set files=tests/fixtures/math/gsm8k_train.jsonl --set test_files=tests/fixtures/math/gsm8k_test.jsonl \
        --set validation_fraction=0.2 --set train_fraction=0.4 --max_new_tokens=16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from typing import Any, Sequence

SPLITS = ("test", "validation", "train", "sft", "expert")
# Task name -> the experiment config whose task section is the default ("path[:variant]", from the repo root).
DEFAULT_CONFIGS: dict[str, str] = {
    "arithmetic": "configs/grpo_arithmetic.py:cpu",
    "fest_math": "configs/fest_math.py:fest_grpo",
    "tool_use": "configs/cast_tool_use.py:cast",
    "frozenlake": "configs/budgetmix_frozenlake.py:cpu",
}
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config_file(spec: str):
  """``get_config(variant)`` of a config file ``path.py[:variant]`` (relative paths: cwd, then the repo)."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path) and os.path.isfile(os.path.join(_REPO, path)):
    path = os.path.join(_REPO, path)
  module_spec = importlib.util.spec_from_file_location(f"_eval_config_{abs(hash(path))}", path)
  if module_spec is None or not os.path.isfile(path):
    raise FileNotFoundError(f"config file {path} not found")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def task_config(task: str, config: str | None, overrides: Sequence[str]):
  """The task section (module docstring), ``name`` set to ``task``, overrides applied."""
  # pylint: disable=import-outside-toplevel
  from lemon_rl.envs import math_task
  from lemon_rl.envs.tasks import TASKS

  TASKS.get(task)  # Raises naming the registered tasks.
  if config is not None:
    section = load_config_file(config).task
  elif task in math_task.TASK_FORMATS:
    section = math_task.default_config(task)
  elif task in DEFAULT_CONFIGS:
    section = load_config_file(DEFAULT_CONFIGS[task]).task
  else:
    raise ValueError(f"task {task!r} has no default config; pass --config=FILE.py[:variant]")
  section = section.copy_and_resolve_references()
  if section.name != task:
    raise ValueError(f"--config's task is {section.name!r}, not --task={task!r}")
  for item in overrides:
    field, sep, raw = item.partition("=")
    if not sep or field not in section:
      raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(section.keys())}")
    try:
      value = json.loads(raw)
    except json.JSONDecodeError:
      value = raw
    if isinstance(section[field], str):
      value = raw
    elif isinstance(section[field], float) and isinstance(value, int):
      value = float(value)
    section[field] = value
  return section


def split_examples(task, split: str) -> list[dict[str, Any]]:
  """The examples of ``split`` as plain dicts (module docstring)."""
  from lemon_rl.envs.tasks import decoded  # pylint: disable=import-outside-toplevel
  source = {"test": task.test_examples, "validation": task.validation_examples, "train": task.rl_source,
            "sft": task.sft_source, "expert": task.expert_source}[split]
  if source is None:
    raise ValueError(f"this task has no {split!r} split")
  return decoded(source)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--task", required=True, help="a registered task name")
  parser.add_argument("--split", default="test", choices=SPLITS)
  parser.add_argument("--checkpoint", required=True, help="Hugging Face-format model directory")
  parser.add_argument("--config", default=None, help="experiment config file whose task section to use")
  parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a field of the task section (repeatable)")
  parser.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer directory (module docstring)")
  parser.add_argument("--data_dir", default=None, help="where the task prepares its data")
  parser.add_argument("--limit", type=int, default=None, help="score the first N examples of the split")
  parser.add_argument("--max_new_tokens", type=int, default=None, help="default: the task's")
  parser.add_argument("--num_samples", type=int, default=1)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json_out", default=None, help="write the report here")
  parser.add_argument("--scores_out", default=None, help="write one line per example (index, id, score) here")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the command; returns the report (also printed as JSON)."""
  args = _parse_args(argv)
  # pylint: disable=import-outside-toplevel
  import numpy as np

  from lemon_rl.envs.tasks import TASKS
  from lemon_rl.eval.generation import evaluate
  from lemon_rl.eval.stats import mean_ci
  from lemon_rl.models.hf import from_hf
  from lemon_rl.text.tokenizers import load_tokenizer

  if args.limit is not None and args.limit < 1:
    raise ValueError(f"--limit must be >= 1, got {args.limit}")
  if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
    raise FileNotFoundError(f"{args.checkpoint} is not a Hugging Face-format checkpoint (no config.json); export "
                            "a lemon_rl model with lemon_rl.models.hf.to_hf")
  section = task_config(args.task, args.config, args.overrides)
  data_dir = args.data_dir or os.path.join(tempfile.gettempdir(), "lemon_eval_data")
  task = TASKS.get(args.task)(section, data_dir)
  examples = split_examples(task, args.split)[:args.limit]
  if not examples:
    raise ValueError(f"split {args.split!r} of task {args.task!r} is empty")
  if args.tokenizer is not None:
    tokenizer = load_tokenizer(args.tokenizer)
  elif os.path.isfile(os.path.join(args.checkpoint, "tokenizer.json")):
    tokenizer = load_tokenizer(args.checkpoint)
  else:
    tokenizer = task.tokenizer
  model = from_hf(args.checkpoint)
  if model.cfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"the checkpoint's vocabulary ({model.cfg.vocab_size}) is smaller than the tokenizer's "
                     f"({tokenizer.vocab_size}); pass the checkpoint's tokenizer with --tokenizer")
  max_new_tokens = args.max_new_tokens or task.max_new_tokens
  metrics, scores = evaluate(model, tokenizer, examples, task.eval_reward, max_new_tokens,
                             batch_size=args.batch_size, temperature=args.temperature,
                             num_samples=args.num_samples, seed=args.seed)
  per_example = scores.mean(axis=1)
  mean, half = mean_ci(per_example)
  report = {"task": args.task, "split": args.split, "checkpoint": os.path.abspath(args.checkpoint),
            "num_examples": len(examples), "num_samples": args.num_samples, "temperature": args.temperature,
            "max_new_tokens": max_new_tokens, "score": mean, "score_ci95": half, **metrics}
  print(json.dumps(report, indent=2))
  for path, payload in ((args.json_out, json.dumps(report, indent=2) + "\n"),
                        (args.scores_out, "".join(
                            json.dumps({"index": i, "id": str(ex.get("id", i)), "score": float(s)}) + "\n"
                            for i, (ex, s) in enumerate(zip(examples, np.asarray(per_example)))))):
    if path:
      if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w", encoding="utf-8") as f:
        f.write(payload)
  return report


if __name__ == "__main__":
  try:
    main()
  except (ValueError, FileNotFoundError, ImportError) as e:
    sys.exit(f"error: {e}")
