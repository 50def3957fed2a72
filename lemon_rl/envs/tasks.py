"""Tasks: what an experiment trains on, built by name from the ``task`` config section.

A :class:`Task` bundles a tokenizer, random-access sources of SFT demonstrations and RL prompts (records
are dicts with a ``prompt`` and the fields the reward functions need), validation and held-out test
examples, the reward functions of training and the 0/1 correctness function of evaluation.

Splits. Every task's SFT, RL, validation and test examples (and FEST's expert shots) are disjoint by a
canonical CONTENT KEY defined in the task's module (``canonical_key``: the normalised problem or gold call,
so a rephrasing or ``a+b`` / ``b+a`` lands in the same split; ``lemon_rl.data.splits``), checked per task by
``tests/test_splits.py``. ``validation_examples`` are for choosing hyper-parameters and stopping rules; the
runner does not evaluate them (it scores ``test_examples``), so an experiment that tunes scores its
candidates on ``validation_examples`` and reports ``test_examples`` once, for the chosen setting.

A task whose RL rewards or data order depend on the SFT policy (CAST's case library) sets ``prepare_rl``:
``prepare_rl(model, tokenizer, workdir, config) -> (rewards, iterator)`` is called once after SFT, with
the SFT parameters in ``model``, and replaces ``rewards`` and the default shuffled iterator over
``rl_source``. The iterator yields columnar batches ``{field: [B]}`` and has ``get_state()`` /
``set_state()`` (checkpointed); ``prepare_rl`` must be resume-safe (rebuild from what it persisted in
``workdir`` rather than re-sample).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from lemon_rl.rewards.base import RewardFn
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.text import ByteTokenizer
from lemon_rl.utils.registry import Registry


@dataclasses.dataclass
class Task:
  tokenizer: Any
  sft_source: Sequence[dict[str, Any]] | None
  rl_source: Sequence[dict[str, Any]]
  test_examples: list[dict[str, Any]]
  rewards: list[WeightedReward]
  eval_reward: RewardFn
  max_new_tokens: int
  max_completion_len: int
  # Prompt slots of training sequences (tokens incl. BOS); None = the sampler's power-of-two bucket.
  prompt_len: int | None = None
  prepare_rl: Callable[..., tuple[list[WeightedReward], Any]] | None = None
  # Prompts with expert solutions (``prompt``, ``completion`` = ``y+`` and the reward fields): FEST's ``D_E``.
  expert_source: Sequence[dict[str, Any]] | None = None
  # Examples for tuning (records like ``test_examples``, from a content bucket of their own; module
  # docstring). Every registered task sets them (``task.num_validation``); None only for a task without one.
  validation_examples: list[dict[str, Any]] | None = None


TaskBuilder = Callable[[Any, str], Task]
TASKS: Registry[TaskBuilder] = Registry("task")
# A task's checks of its own config section (``check(config)`` raises ``ConfigError`` naming the field).
TASK_CONFIG_CHECKS: Registry[Callable[[Any], None]] = Registry("task config check")


def decoded(source, limit: int | None = None) -> list[dict[str, Any]]:
  """Reads (up to ``limit``) records of a tfds data source as plain dicts with ``str`` text fields."""
  from lemon_rl.data.pipeline import decode_record  # pylint: disable=g-import-not-at-top
  n = len(source) if limit is None else min(limit, len(source))
  return [decode_record(source[i]) for i in range(n)]


@TASKS.register("arithmetic")
def arithmetic_task(cfg, data_dir: str) -> Task:
  """Multi-digit arithmetic with a sloppy teacher (``lemon_rl.envs.arithmetic``), stored as tfds array_record."""
  from lemon_rl.envs.arithmetic_builder import build_arithmetic  # pylint: disable=g-import-not-at-top
  from lemon_rl.envs import arithmetic  # pylint: disable=g-import-not-at-top

  builder = build_arithmetic(os.path.join(data_dir, "tfds"), seed=cfg.data_seed, num_train=cfg.num_train,
                             num_sft=cfg.num_sft, num_test=cfg.num_test, num_validation=cfg.num_validation,
                             p_sloppy=cfg.p_sloppy, mul_fraction=cfg.mul_fraction)
  tokenizer = ByteTokenizer()
  return Task(
      tokenizer=tokenizer,
      sft_source=builder.as_data_source("sft"),
      rl_source=builder.as_data_source("train"),
      test_examples=decoded(builder.as_data_source("test")),
      validation_examples=decoded(builder.as_data_source("validation")),
      rewards=[WeightedReward("answer", arithmetic.answer_reward, 1.0)],
      eval_reward=arithmetic.answer_reward,
      max_new_tokens=arithmetic.ANSWER_WIDTH + 2,
      max_completion_len=arithmetic.ANSWER_WIDTH + 1,
      prompt_len=1 + len("999+999="),
  )


@TASKS.register("fest_math")
def fest_math_task(cfg, data_dir: str) -> Task:
  """Chains of one-digit operations with worked solutions (``lemon_rl.envs.multistep_math``), in memory.

  Config fields: ``data_seed`` (every split is a pure function of it), ``num_sft`` (easy worked solutions,
  1-2 steps under rule ``"="``, ``prompt``/``completion``: the starting policy's SFT), ``num_train``
  (``D_I``: hard prompts, 2 steps under rule ``"?"``, with answers only), ``num_test`` (held-out hard
  prompts), ``num_validation`` (hard prompts for tuning, ``multistep_math.hard_validation``), ``num_shots``
  (``D_E``: hard prompts with worked solutions, ``expert_source``; 64 shots are a prefix of 128).
  ``multistep_math.shifted_test`` gives the out-of-distribution set (generate it with
  ``completion_budget(SPLIT_STEPS["shifted_test"][1])`` tokens). ``data_dir`` is unused.
  """
  del data_dir
  from lemon_rl.envs import multistep_math  # pylint: disable=g-import-not-at-top

  if int(cfg.num_shots) < 1:
    raise ValueError(f"task.num_shots must be >= 1, got {cfg.num_shots}")
  hard_steps = multistep_math.SPLIT_STEPS["hard_test"][1]
  return Task(
      tokenizer=ByteTokenizer(),
      sft_source=multistep_math.sft_demonstrations(cfg.data_seed, cfg.num_sft),
      rl_source=multistep_math.rl_prompts(cfg.data_seed, cfg.num_train),
      test_examples=multistep_math.hard_test(cfg.data_seed, cfg.num_test),
      validation_examples=multistep_math.hard_validation(cfg.data_seed, cfg.num_validation),
      rewards=[WeightedReward("answer", multistep_math.answer_reward, 1.0)],
      eval_reward=multistep_math.answer_reward,
      # The longest hard solution (19 bytes), one extra line of slack and EOS: 28 tokens.
      max_new_tokens=multistep_math.completion_budget(hard_steps),
      # SFT padding: the longest easy demonstration and EOS (FEST's expert SFT pads to max_new_tokens).
      max_completion_len=multistep_math.completion_budget(multistep_math.SPLIT_STEPS["easy_sft"][1],
                                                          slack_steps=0),
      prompt_len=1 + multistep_math.prompt_length(hard_steps),  # BOS + the longest hard prompt.
      expert_source=multistep_math.expert_demonstrations(cfg.data_seed, cfg.num_shots),
  )


@TASK_CONFIG_CHECKS.register("tool_use")
def check_tool_use_config(config) -> None:
  from lemon_rl.envs import tool_use_task as tut  # pylint: disable=g-import-not-at-top
  tut.check_config(config)


@TASKS.register("tool_use")
def tool_use_task(cfg, data_dir: str) -> Task:
  """Single-turn tool use (CAST, ``lemon_rl.envs.tool_use``), in memory; ``data_dir`` is unused.

  Prompts are the world's compact rendering (tool signatures + query); SFT completions are its
  demonstrations ``<think>...</think><tool_call>[...]</tool_call>``; evaluation is BFCL exact match with
  per-category / per-difficulty metrics (:class:`lemon_rl.envs.tool_use_task.ToolUseScore`). The RL
  rewards and data order come from ``prepare_rl`` (``task.reward``: ``"exact"`` = plain GRPO, ``"cast"`` =
  case library -> :class:`lemon_rl.rewards.cast.CastReward` + curriculum; options in ``task.cast``).
  Config fields: ``data_seed``, ``num_sft``, ``num_train``, ``num_validation``, ``num_test``, ``category_weights``,
  ``style`` (call syntax), ``max_prompt_bytes``, ``max_completion_bytes``, ``reward``, ``cast``; optional
  ``demo_noise`` (imperfect SFT demonstrations, ``tool_use.DemoNoise``),
  ``source`` (``"synthetic"`` or ``"bfcl"``: BFCL-format files, with ``bfcl_dir`` and ``bfcl_categories``) and
  ``tokenizer`` (``"byte"`` or a directory) (``lemon_rl.envs.tool_use_task``).
  """
  del data_dir
  import functools  # pylint: disable=g-import-not-at-top
  from lemon_rl.data.pipeline import LazySource  # pylint: disable=g-import-not-at-top
  from lemon_rl.envs import tool_use_task as tut  # pylint: disable=g-import-not-at-top

  tokenizer = tut.task_tokenizer(cfg)
  train = tut.make_split(cfg, "train")
  score = tut.ToolUseScore(tokenizer)
  budget = tut.completion_budget(cfg)
  return Task(
      tokenizer=tokenizer,
      sft_source=LazySource(cfg.num_sft, functools.partial(tut.make_split, cfg, "sft")),  # Unused by RL-only runs.
      rl_source=train,
      test_examples=tut.make_split(cfg, "test"),
      validation_examples=tut.make_split(cfg, "validation"),
      rewards=[WeightedReward("exact", score, 1.0)],
      eval_reward=score,
      max_new_tokens=budget,
      max_completion_len=budget,
      prompt_len=tut.prompt_len(cfg),  # Byte tokenizer: BOS + the longest prompt (one shape, no pow2 slack).
      prepare_rl=functools.partial(tut.prepare_rl, cfg, train),
  )


@TASK_CONFIG_CHECKS.register("frozenlake")
def check_frozenlake_config(config) -> None:
  from lemon_rl.envs import frozenlake_task as flt  # pylint: disable=g-import-not-at-top
  flt.check_config(config)


@TASKS.register("frozenlake")
def frozenlake_task(cfg, data_dir: str) -> Task:
  """Text FrozenLake for the multi-turn phases (``lemon_rl.envs.frozenlake_task``), in memory; ``data_dir`` is
  unused."""
  del data_dir
  from lemon_rl.envs import frozenlake_task as flt  # pylint: disable=g-import-not-at-top
  return flt.build_task(cfg)


@TASK_CONFIG_CHECKS.register("gsm8k")
@TASK_CONFIG_CHECKS.register("math")
def check_math_config(config) -> None:
  from lemon_rl.envs import math_task  # pylint: disable=g-import-not-at-top
  math_task.check_config(config)


@TASKS.register("gsm8k")
@TASKS.register("math")
def math_word_task(cfg, data_dir: str) -> Task:
  """GSM8K- / MATH-format local files (or GSM-Symbolic) scored by math-verify (``lemon_rl.envs.math_task``)."""
  from lemon_rl.envs import math_task  # pylint: disable=g-import-not-at-top
  return math_task.build(cfg, data_dir)
