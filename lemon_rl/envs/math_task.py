"""The ``gsm8k`` and ``math`` tasks: local public-format files (or GSM-Symbolic) scored by ``math-verify``.

Data: :mod:`lemon_rl.envs.local_data_builder` (tfds array_record under ``data_dir/tfds``) over
:mod:`lemon_rl.envs.math_data`'s records; splits disjoint by ``math_data.canonical_key``. Reward and evaluation:
:func:`lemon_rl.rewards.math_verify_reward.math_answer_reward` (1 if the completion's final answer equals the gold).

Config fields of the ``task`` section (:func:`default_config`):

- ``source``: ``"files"`` (``files`` / ``test_files`` in the task's format) or, for ``gsm8k`` only,
  ``"gsm_symbolic"`` (reasoning-gym's offline generator, sizes from ``num_*``, seed ``data_seed``);
- ``files``, ``test_files``: comma-separated paths (``.jsonl``, ``.json``; ``.parquet``/``.arrow`` or a
  ``save_to_disk`` folder with the optional ``datasets`` library); without ``test_files`` test is a content
  bucket of ``files`` of share ``test_fraction``;
- ``num_sft``, ``num_train``, ``num_validation``, ``num_test``: caps per split (``-1``: all records);
- ``test_fraction``, ``validation_fraction``, ``train_fraction``: bucket shares (SFT gets the rest);
- ``tokenizer``: ``"byte"`` or a directory with ``tokenizer.json`` (:func:`lemon_rl.text.load_tokenizer`);
- ``max_new_tokens`` (generation budget), ``max_completion_len`` (SFT padding, tokens incl. EOS).
"""

from __future__ import annotations

import os
from typing import Any

from ml_collections import config_dict

from lemon_rl.envs import local_data_builder as ldb
from lemon_rl.envs import math_data
from lemon_rl.envs.tasks import Task
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.rewards.math_verify_reward import math_answer_reward
from lemon_rl.text.tokenizers import load_tokenizer
from lemon_rl.utils import config_checks as cc

TASK_FORMATS = {"gsm8k": "gsm8k", "math": "math"}
SOURCES = ("files", "gsm_symbolic")


def default_config(name: str) -> config_dict.ConfigDict:
  """The ``task`` section of task ``name`` (``"gsm8k"`` or ``"math"``) with its defaults (no files set)."""
  if name not in TASK_FORMATS:
    raise ValueError(f"unknown math task {name!r}; expected one of {sorted(TASK_FORMATS)}")
  t = config_dict.ConfigDict()
  t.name = name
  t.source = "files"
  t.files = ""
  t.test_files = ""
  t.data_seed = 0
  t.num_sft = -1
  t.num_train = -1
  t.num_validation = -1
  t.num_test = -1
  t.test_fraction = math_data.DEFAULT_TEST_FRACTION
  t.validation_fraction = math_data.DEFAULT_VALIDATION_FRACTION
  t.train_fraction = math_data.DEFAULT_TRAIN_FRACTION
  t.tokenizer = "byte"
  t.max_new_tokens = 512 if name == "gsm8k" else 1024
  t.max_completion_len = 512 if name == "gsm8k" else 1024
  return t


def _paths(value: Any) -> tuple[str, ...]:
  if isinstance(value, str):
    return tuple(p.strip() for p in value.split(",") if p.strip())
  return tuple(str(p) for p in value)


def check_config(config) -> None:
  """The ``task`` section of a gsm8k / math experiment (raises ``ConfigError`` naming the field)."""
  t = config.task
  cc.require_choice(SOURCES, "task.source", t.source)
  cc.require(t.source == "files" or t.name == "gsm8k", "task.source", t.source,
             "gsm_symbolic generates GSM8K-style problems: use it with task.name='gsm8k'")
  if t.source == "files":
    cc.require(bool(_paths(t.files) or _paths(t.test_files)), "task.files", t.files,
               "must name local data files (comma-separated)")
  cc.require_positive(t, "task", "max_new_tokens", "max_completion_len")
  for split in math_data.SPLITS:
    n = int(t[f"num_{split}"])
    cc.require(n == -1 or n >= 1, f"task.num_{split}", n, "must be -1 (all) or >= 1")
    cc.require(t.source == "files" or n >= 1, f"task.num_{split}", n, "gsm_symbolic needs explicit sizes >= 1")


def build(cfg, data_dir: str) -> Task:
  """The task of ``cfg`` (module docstring); data prepared under ``data_dir/tfds``."""
  fmt = "gsm_symbolic" if cfg.source == "gsm_symbolic" else TASK_FORMATS[cfg.name]
  params = dict(num_sft=int(cfg.num_sft), num_train=int(cfg.num_train), num_validation=int(cfg.num_validation),
                num_test=int(cfg.num_test), test_fraction=float(cfg.test_fraction),
                validation_fraction=float(cfg.validation_fraction), train_fraction=float(cfg.train_fraction))
  if fmt == "gsm_symbolic":
    params["seed"] = int(cfg.data_seed)
  else:
    params.update(files=_paths(cfg.files), test_files=_paths(cfg.test_files))
  builder = ldb.build_local_data(os.path.join(data_dir, "tfds"), fmt, **params)
  return Task(
      tokenizer=load_tokenizer(cfg.tokenizer),
      sft_source=builder.as_data_source("sft"),
      rl_source=builder.as_data_source("train"),
      test_examples=ldb.load_split(builder, "test"),
      validation_examples=ldb.load_split(builder, "validation"),
      rewards=[WeightedReward("answer", math_answer_reward, 1.0)],
      eval_reward=math_answer_reward,
      max_new_tokens=int(cfg.max_new_tokens),
      max_completion_len=int(cfg.max_completion_len),
  )
