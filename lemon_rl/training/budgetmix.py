"""BudgetMix: multi-turn RL under turn budgets drawn per group (METHODS.md section 5).

For a task ``x`` with full budget ``T_max(x)`` the candidate budgets are

    T(x) = Unique{ floor(k * 0.1 * T_max(x)) : k = 1..10 } \\ {0}

(:func:`budget_candidates`; computed in integers as ``k * T_max // 10``, so no float rounding can move a
budget). Each *group* (the ``G`` episodes of one task in a step) draws one budget uniformly from ``T(x)`` and all
its episodes share it (:func:`draw_budgets`); ``mode="full"`` gives every group ``T_max`` (full-budget RL, the
baseline). The budget is written into the prompt (``[MAX TURNS] B``, then ``[CURRENT TURN] t`` and ``[REMAINING
TURNS] B - t`` each turn: ``FrozenLakeEnv(show_budget=True)``), an episode that does not finish within ``B``
turns gets reward 0, and the rest is the generic multi-turn step of :mod:`lemon_rl.training.multiturn_rl`
with any of its estimators: GRPO, GiGPO with the anchor key ``(s_t, B - t)`` (``budget_in_anchor=True``; pass
:func:`frozenlake_anchor_state` as the trainer's ``anchor_state``) and PPO whose critic reads the budget from the
prompt.

Reproducibility: the budgets and reset seeds of a step are a pure function of ``(seed, step)``
(:func:`budgetmix_frozenlake_groups`), so a resumed run draws the same budgets.
"""

from __future__ import annotations

import re
from typing import Any, Hashable, Sequence

import numpy as np

from lemon_rl.envs import frozenlake
from lemon_rl.training.multiturn_rl import Group, MultiTurnTrainer, observation_anchor
from lemon_rl.training.state import TrainState

BUDGET_MODES = ("budgetmix", "full")
BUDGET_STEPS = 10  # k = 1..10: budgets at 10% intervals of T_max.


def budget_candidates(t_max: int) -> list[int]:
  """``sorted(Unique{floor(k * t_max / 10) : k = 1..10} - {0})``, e.g. ``t_max = 5 -> [1, 2, 3, 4, 5]``."""
  if int(t_max) != t_max or t_max < 1:
    raise ValueError(f"t_max must be a positive integer, got {t_max!r}")
  return sorted({k * int(t_max) // BUDGET_STEPS for k in range(1, BUDGET_STEPS + 1)} - {0})


def draw_budgets(t_maxes: Sequence[int], rng: np.random.Generator, mode: str = "budgetmix") -> np.ndarray:
  """One budget per group: uniform over :func:`budget_candidates` (``budgetmix``) or ``T_max`` (``full``).

  Args:
    t_maxes: ``[P]`` full budgets of the groups' tasks.
    rng: the draws' generator (one ``integers`` call per group, in order).
    mode: one of :data:`BUDGET_MODES`.

  Returns:
    ``[P]`` int64 budgets.
  """
  if mode not in BUDGET_MODES:
    raise ValueError(f"mode must be one of {BUDGET_MODES}, got {mode!r}")
  if mode == "full":
    return np.asarray([budget_candidates(t)[-1] for t in t_maxes], np.int64)
  out = []
  for t in t_maxes:
    candidates = budget_candidates(t)
    out.append(candidates[int(rng.integers(len(candidates)))])
  return np.asarray(out, np.int64)


_POSITION = re.compile(r"pos \((\d+), (\d+)\)")


def frozenlake_anchor_state(observation: str) -> Hashable:
  """The FrozenLake cell ``(row, col)`` an observation reports (its last ``pos (r, c)``).

  The prompt (turn 0) and the short per-turn observations both end with the position, so a cell revisited at
  any turn gives the same state. Text without a position (not a FrozenLake observation) falls back to
  :func:`~lemon_rl.training.multiturn_rl.observation_anchor`.
  """
  found = _POSITION.findall(observation)
  if not found:
    return observation_anchor(observation)
  row, col = found[-1]
  return int(row), int(col)


def budgetmix_frozenlake_groups(maps: Sequence[frozenlake.Map], group_size: int, *, seed: int, step: int,
                                mode: str = "budgetmix", show_budget: bool = True,
                                **env_kwargs: Any) -> list[Group]:
  """The groups of one BudgetMix step on FrozenLake: per map a budget, ``group_size`` environments, seeds.

  Args:
    maps: ``P`` maps, one group each.
    group_size: ``G`` episodes per group.
    seed: the run's seed.
    step: the step (with ``seed``, the only source of the budgets and reset seeds).
    mode: ``budgetmix`` (budgets drawn from :func:`budget_candidates`) or ``full`` (``T_max``).
    show_budget: write the budget into the prompt and observations.
    **env_kwargs: :class:`~lemon_rl.envs.frozenlake.FrozenLakeEnv` options (``slippery``,
      ``t_max_multiple``, ...; not ``max_turns``, which is the drawn budget).

  Returns:
    ``P`` :class:`~lemon_rl.training.multiturn_rl.Group` s.
  """
  if "max_turns" in env_kwargs:
    raise ValueError("max_turns is the drawn budget; do not pass it")
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  rng = np.random.default_rng([int(seed), int(step)])
  t_maxes = [frozenlake.t_max(frozenlake.as_map(m), env_kwargs.get("t_max_multiple",
                                                                   frozenlake.DEFAULT_T_MAX_MULTIPLE))
             for m in maps]
  budgets = draw_budgets(t_maxes, rng, mode)
  reset_seeds = rng.integers(2**31 - 1, size=(len(maps), group_size))
  return [Group(envs=[frozenlake.FrozenLakeEnv(m, max_turns=int(b), show_budget=show_budget, **env_kwargs)
                      for _ in range(group_size)],
                seeds=[int(s) for s in reset_seeds[i]], budget=int(b), t_max=int(t))
          for i, (m, b, t) in enumerate(zip(maps, budgets, t_maxes))]


def budgetmix_frozenlake_step(trainer: MultiTurnTrainer, state: TrainState, maps: Sequence[frozenlake.Map],
                              group_size: int, *, seed: int, mode: str = "budgetmix", **env_kwargs: Any):
  """One BudgetMix (or full-budget) RL step on ``maps``: draws the groups for ``state.step``, trains on them.

  Returns ``(state, metrics, rollout)`` as :meth:`MultiTurnTrainer.step`.
  """
  groups = budgetmix_frozenlake_groups(maps, group_size, seed=seed, step=int(state.step), mode=mode, **env_kwargs)
  return trainer.step(state, groups)
