"""The ``frozenlake`` task: text FrozenLake maps and noisy-expert demonstrations for multi-turn SFT and RL.

Built by :func:`build_task` from the ``task`` config section (registered as ``"frozenlake"`` in
:data:`lemon_rl.envs.tasks.TASKS`); it is played by the multi-turn phases of
:mod:`lemon_rl.training.multiturn_phases` (``multiturn_sft``, ``multiturn_rl``), not by the single-turn
``sft`` / ``rl`` phases (:func:`check_config` refuses them).

Tokenizer (:func:`make_tokenizer`). *Decision*: a byte tokenizer whose special tokens are the four moves
(``"<action>left</action>"`` ... one id each, :data:`MOVE_TOKENS`) and the three budget tags of the BudgetMix
prompt (``[MAX TURNS]``, ``[CURRENT TURN]``, ``[REMAINING TURNS]``, :data:`BUDGET_TOKENS`). The environment's
text is unchanged (the tags are what the prompt says); only its encoding is shorter: an action is 2 policy
tokens (the move and EOS) and a turn's observation ``"pos (r, c) F\\n[CURRENT TURN] t [REMAINING TURNS] b"``
about 21 tokens instead of 48 bytes, so a 6x6 episode of ~15 turns is ~600 tokens. A policy may still write
a move byte by byte (the environment parses the text); ``max_action_tokens`` bounds that.

Splits, all disjoint by map content (:func:`lemon_rl.envs.frozenlake.canonical_key`):

- ``rl_source``: the first ``num_train`` maps of ``generate_maps(data_seed, num_train + num_sft, "train")``,
  ``sft_source``: the next ``num_sft`` (one call deduplicates by content, so the two never share a map and
  each is a prefix-stable function of its own count);
- ``validation_examples``: ``num_validation`` maps of the ``validation`` split (4-6), for evaluation during
  training, the headroom gate and any tuning;
- ``test_examples``: ``num_test`` maps of ``test`` (4-6) then ``num_test_8x8`` of ``test_8x8``, each record
  tagged with its ``split``: the final evaluation only.

Records: RL, validation and test ``{"map": text, "split": name}``; SFT ``{"map", "split", "turns"}`` with
``turns`` the JSON list of ``[observation, action_text]`` pairs of one noisy-expert demonstration
(:func:`lemon_rl.envs.frozenlake.noisy_expert_demonstration`; ``turns[0][0]`` is the prompt). *Decision*:
demonstrations are played at the full budget ``T_max`` with the budget shown (``show_budget``), so the SFT
policy reads the budget format but was never shown a tight budget: adapting to one is what BudgetMix RL has to
teach (a detour is only taken while a shortest path still fits in the turns left, so every demonstration
succeeds and recovers from its detours).
"""

from __future__ import annotations

import json
from typing import Any

from lemon_rl.envs import frozenlake as fl
from lemon_rl.text import ByteTokenizer
from lemon_rl.utils import config_checks as cc

MOVE_TOKENS = tuple(fl.format_action(a) for a in range(fl.NUM_ACTIONS))
BUDGET_TOKENS = ("[MAX TURNS]", "[CURRENT TURN]", "[REMAINING TURNS]")
PHASES = ("multiturn_sft", "multiturn_rl")  # The phases that play this task.


def make_tokenizer() -> ByteTokenizer:
  """Bytes plus one id per move and per budget tag (module docstring)."""
  return ByteTokenizer(extra_special_tokens=MOVE_TOKENS + BUDGET_TOKENS)


def env_kwargs(cfg) -> dict[str, Any]:
  """The :class:`~lemon_rl.envs.frozenlake.FrozenLakeEnv` options of the ``task`` section (not the budget)."""
  return {"slippery": bool(cfg.slippery), "t_max_multiple": float(cfg.t_max_multiple)}


def split_maps(cfg) -> dict[str, list[fl.Map]]:
  """The maps of every split of the task (module docstring): ``rl``, ``sft``, ``validation``, ``test``,
  ``test_8x8``."""
  seed, sizes = int(cfg.data_seed), tuple(int(s) for s in cfg.sizes)
  pool = fl.generate_maps(seed, cfg.num_train + cfg.num_sft, "train", sizes=sizes)
  return {"rl": pool[:cfg.num_train], "sft": pool[cfg.num_train:],
          "validation": fl.generate_maps(seed, cfg.num_validation, "validation", sizes=sizes),
          "test": fl.generate_maps(seed, cfg.num_test, "test", sizes=sizes),
          "test_8x8": fl.generate_maps(seed, cfg.num_test_8x8, "test_8x8")}


def map_records(maps, split: str) -> list[dict[str, str]]:
  return [{"map": fl.map_text(m), "split": split} for m in maps]


def demonstration_records(cfg, maps) -> list[dict[str, str]]:
  """One noisy-expert demonstration per map, at the full budget with the budget shown."""
  demos = fl.demonstrations(int(cfg.data_seed), len(maps), "train", detour_prob=float(cfg.detour_prob),
                            maps=maps, show_budget=bool(cfg.show_budget), **env_kwargs(cfg))
  return [{"map": fl.map_text(d.desc), "split": "sft", "turns": json.dumps([list(t) for t in d.turns])}
          for d in demos]


def record_map(record) -> fl.Map:
  return fl.as_map(record["map"])


def build_task(cfg):
  """The :class:`~lemon_rl.envs.tasks.Task` of the ``task`` section (fields in :func:`check_config`)."""
  from lemon_rl.envs.tasks import Task  # pylint: disable=g-import-not-at-top  (tasks imports this lazily)

  maps = split_maps(cfg)
  tokenizer = make_tokenizer()
  return Task(
      tokenizer=tokenizer,
      sft_source=demonstration_records(cfg, maps["sft"]),
      rl_source=map_records(maps["rl"], "rl"),
      validation_examples=map_records(maps["validation"], "validation"),
      test_examples=map_records(maps["test"], "test") + map_records(maps["test_8x8"], "test_8x8"),
      rewards=[],  # The environment's step rewards (the multi-turn trainer reads them from the episodes).
      eval_reward=None,  # No single-turn evaluation: the multi-turn phases evaluate episodes on validation maps.
      max_new_tokens=2,  # A move token and EOS (the action limit itself is multiturn_rl.max_action_tokens).
      max_completion_len=2,
  )


def check_config(config) -> None:
  """The ``task`` section, and that only the multi-turn phases are listed."""
  t = config.task
  for name in config.phases:
    cc.require(name in PHASES, "phases", tuple(config.phases),
               f"the frozenlake task is played by the multi-turn phases {PHASES} only (got {name!r})")
  cc.require_positive(t, "task", "num_sft", "num_train", "num_validation", "num_test", "t_max_multiple")
  cc.require_positive(t, "task", "num_test_8x8", allow_zero=True)
  cc.require(0.0 <= t.detour_prob < 1.0, "task.detour_prob", t.detour_prob, "must be in [0, 1)")
  cc.require(t.t_max_multiple >= 1.0, "task.t_max_multiple", t.t_max_multiple,
             "must be >= 1 (T_max = ceil(multiple * shortest path); about 4 keeps 25% budgets winnable)")
  sizes = tuple(t.sizes)
  cc.require(bool(sizes) and all(isinstance(s, int) and 3 <= s <= 8 for s in sizes), "task.sizes", sizes,
             "must be side lengths in [3, 8]")
  cc.require(isinstance(t.show_budget, bool) and isinstance(t.slippery, bool), "task.show_budget", t.show_budget,
             "task.show_budget and task.slippery must be True or False")
