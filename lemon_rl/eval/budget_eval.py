"""Evaluation of multi-turn agents under turn budgets: Pass@(K,T), step quality, recovery (METHODS.md section 5).

Budgets. A map's turn limit is ``T_max`` (:attr:`FrozenLakeEnv.t_max`, about 4x its shortest path). The budget
of a fraction ``f`` (default 25/50/75/100%) is

    T(f) = max(1, ceil(f * T_max))        (rounded UP, at least one turn; 1e-9 absorbs float error),

so a fraction never buys fewer turns than it names (``T_max = 10``: 25% -> 3 turns, not 2) and 25% of the
default ``T_max`` is exactly the shortest path (winnable without slack). (BudgetMix *training* draws
``floor(k * 0.1 * T_max)``; evaluation rounds up so that 25% stays winnable.)

Pass@(K,T), two modes (both from the same maps, seeds and policy samples):

- ``prompted``: the policy is re-run at each budget ``T``: the environment's ``max_turns`` is ``T`` (it ends the
  episode after ``T`` turns) and, with ``show_budget``, the prompt says ``[MAX TURNS] T`` and every turn
  ``[CURRENT TURN] t [REMAINING TURNS] T - t``. A sample succeeds iff its episode succeeded.
- ``truncated``: ONE run at the full budget ``T_max``; a sample counts for budget ``T`` iff it succeeded within
  ``T`` turns, ``c_T = sum_j [success_j and turns_j <= T]``, computed after the fact from those episodes.

Per map ``p`` with ``n >= K`` samples and ``c`` successes, Pass@k is the unbiased ``1 - C(n - c, k) / C(n, k)``
(:func:`lemon_rl.eval.pass_at_k.pass_at_k`); the table holds, per (mode, fraction), the mean over maps of
Pass@1 ... Pass@K. Runs of the same configuration share the environments' reset seeds and the engine's key,
so episode ``i`` draws the same random numbers at every budget (paired comparisons); a budget equal to
``T_max`` on every map is the full-budget run itself (not re-run). Without ``show_budget`` the prompted and
truncated modes are the same numbers (the prompt does not change, so the run at ``T`` is the full run cut at
``T``): a check of the bookkeeping, and the reason a budget-unaware policy needs only the truncated mode.

Step-level action quality (:func:`score_steps`, :func:`summarize_steps`). For every move of an episode, the state
``s`` before it and the remaining budget ``h`` (turns left before the move, from the environment's ``info``)
are matched with the exact finite-horizon ``Q*_h`` (:func:`lemon_rl.envs.frozenlake.optimal_q`, gamma 0.95).
*Decision*: the headline quality is the ratio

    quality(s, h, a) = Q*_h(s, a) / max_a' Q*_h(s, a')   in [0, 1],

which is scale-free across distances and horizons (non-slippery: one detour that costs two turns scores
``gamma^2 = 0.9025``; a move into a hole or into a state from which the goal is out of reach in ``h - 1`` turns
scores 0). The regret ``max_a' Q*_h(s, a') - Q*_h(s, a) >= 0`` and the share of optimal moves
(``Q*_h(s, a) >= max - 1e-9``, float64 round-off of ties) are reported too. States with ``max Q*_h = 0`` (the
goal is out of reach within ``h`` turns: every move is equally worthless) are "hopeless" and excluded from all
three; malformed actions (no move) are not steps. Aggregation pools the steps of all episodes (each move weighs
one). "Matched states": :func:`matched_keys` intersects the ``(map, state, h)`` keys that several step tables
(policies) visited, and :func:`summarize_steps` restricted to them compares policies on the same states.

Recovery from injected errors (:class:`InjectedErrorEnv`, :func:`recovery_rate`). An injected episode starts
with moves the policy did not choose: an expert walks shortest-path moves (uniform among the optimal ones) until
the first state where some safe move lengthens the shortest path (from a corner start every move either
shortens it or bumps the wall; ``lead_in`` fixes the number of expert moves instead, 0 = inject at the start),
then :meth:`FrozenLakeEnv.inject_error` takes that lengthening move (else a safe bump,
:func:`~lemon_rl.envs.frozenlake.error_action`). The prompt the policy sees is the usual prompt followed by
these moves and their observations, as turns (every move spends a turn of the budget, so the error costs the
slack a detour costs: 2 turns, 1 for a bump). Then the policy continues. With ``n_p`` the injected episodes of
map ``p`` whose injection was usable (an error existed and the injected moves did not end the episode, which
can only happen when slippery), ``s_p`` their successes and ``c_p`` the successes of map ``p``'s ``n`` clean
episodes at the same budget (same reset seeds and engine key),

    recovery = mean_{p: n_p > 0} s_p / n_p,    clean = mean_{p: n_p > 0} c_p / n,    ratio = recovery / clean.

Everything is seeded by ``BudgetEvalSettings.seed``: the reset
seeds of episode ``j`` of map ``p`` come from ``default_rng([seed, p])``, the engine key is
``jax.random.key(seed)``, and the expert and injected moves are drawn with ``default_rng([reset_seed, 1])``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from lemon_rl.envs.frozenlake import (FrozenLakeEnv, Map, as_map, format_action, move, optimal_actions, optimal_q,
                                     safe_actions, shortest_distances, start_state)
from lemon_rl.envs.protocol import FinishStatus
from lemon_rl.eval.pass_at_k import pass_at_k
from lemon_rl.training.multiturn import Episode, EpisodeSettings, run_episodes
from lemon_rl.training.rollout import SamplingSettings

BUDGET_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
MODES = ("prompted", "truncated")
OPTIMAL_TOL = 1e-9  # Q* ties are exact for deterministic moves; 1e-9 covers float64 sums of slippery ones.
_INJECT_STREAM = 1  # default_rng([reset_seed, _INJECT_STREAM]) draws the expert lead-in and the injected error.


# ----------------------------------------------------------------------------------------------------------
# Budgets and the Pass@(K,T) surface (pure).


def budget_turns(t_max: int, fraction: float) -> int:
  """``max(1, ceil(fraction * t_max))``: the turn budget of a fraction of ``T_max`` (rounded up)."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"a budget fraction must be in (0, 1], got {fraction}")
  return max(1, int(math.ceil(fraction * int(t_max) - 1e-9)))


def budget_table(t_max: Sequence[int], fractions: Sequence[float] = BUDGET_FRACTIONS) -> np.ndarray:
  """``[P, F]`` int64: :func:`budget_turns` of every map's ``T_max`` at every fraction."""
  return np.asarray([[budget_turns(t, f) for f in fractions] for t in t_max], np.int64).reshape(-1, len(fractions))


def truncated_success(success, turns, budgets) -> np.ndarray:
  """``[F, P, n]`` bool: sample ``j`` of map ``p`` succeeded within ``budgets[p, f]`` turns.

  Args:
    success: ``[P, n]`` 0/1 or bool, the full-budget run's outcomes.
    turns: ``[P, n]`` ints, the turns each of those episodes used.
    budgets: ``[P, F]`` ints.
  """
  success, turns, budgets = np.asarray(success, bool), np.asarray(turns), np.asarray(budgets)
  if success.shape != turns.shape or success.ndim != 2 or budgets.shape[0] != success.shape[0]:
    raise ValueError(f"need success and turns [P, n] and budgets [P, F], got {success.shape}, {turns.shape}, "
                     f"{budgets.shape}")
  return success[None] & (turns[None] <= budgets.T[:, :, None])


def pass_curve(success, ks: Sequence[int]) -> np.ndarray:
  """``[P, len(ks)]`` float64: unbiased Pass@k of each map (row of the ``[P, n]`` 0/1 ``success``), each k."""
  s = np.asarray(success, bool)
  if s.ndim != 2:
    raise ValueError(f"success must be [P, n], got shape {s.shape}")
  return np.stack([pass_at_k(s.shape[1], s.sum(axis=1), k) for k in ks], axis=-1)


@dataclasses.dataclass(frozen=True)
class PassSurface:
  """Pass@(K,T) per mode, budget fraction, map and K.

  Attributes:
    modes: ``M`` mode names (:data:`MODES`).
    fractions: ``F`` budget fractions of ``T_max``.
    ks: the ``K`` values (1 ... K).
    budgets: ``[P, F]`` the turn budget of each map at each fraction.
    per_map: ``[M, F, P, len(ks)]`` Pass@(k, T) of each map.
  """

  modes: tuple[str, ...]
  fractions: tuple[float, ...]
  ks: tuple[int, ...]
  budgets: np.ndarray
  per_map: np.ndarray

  @property
  def mean(self) -> np.ndarray:
    """``[M, F, len(ks)]``: the mean over maps."""
    return self.per_map.mean(axis=2)

  def table(self) -> dict[tuple[str, float], np.ndarray]:
    """``{(mode, fraction): [len(ks)] means over maps}``."""
    return {(m, f): self.mean[i, j] for i, m in enumerate(self.modes) for j, f in enumerate(self.fractions)}

  def value(self, mode: str, fraction: float, k: int) -> float:
    return float(self.mean[self.modes.index(mode), self.fractions.index(fraction), self.ks.index(k)])

  def markdown(self, digits: int = 3) -> str:
    """The table as Markdown: one row per (mode, fraction), one column per Pass@k."""
    head = "| mode | budget | " + " | ".join(f"Pass@{k}" for k in self.ks) + " |"
    rule = "|---|---|" + "---|" * len(self.ks)
    rows = [f"| {m} | {f:.0%} | " + " | ".join(f"{v:.{digits}f}" for v in values) + " |"
            for (m, f), values in self.table().items()]
    return "\n".join([head, rule, *rows])


def pass_surface(prompted_success, full_success, full_turns, budgets, fractions: Sequence[float],
                 ks: Sequence[int]) -> PassSurface:
  """The Pass@(K,T) surface of both modes.

  Args:
    prompted_success: ``[F, P, n]`` 0/1: outcomes of the runs with budget ``budgets[p, f]`` in the
      environment (and prompt).
    full_success: ``[P, n']`` 0/1: outcomes of the full-budget run.
    full_turns: ``[P, n']`` ints: turns those episodes used.
    budgets: ``[P, F]`` ints.
    fractions: the ``F`` fractions (labels).
    ks: the k values (each ``<= n`` and ``<= n'``).

  Returns:
    :class:`PassSurface` with modes ``("prompted", "truncated")``.
  """
  prompted = np.asarray(prompted_success, bool)
  budgets = np.asarray(budgets)
  if prompted.ndim != 3 or prompted.shape[:2] != (len(fractions), budgets.shape[0]):
    raise ValueError(f"prompted_success must be [F={len(fractions)}, P={budgets.shape[0]}, n], "
                     f"got {prompted.shape}")
  if budgets.shape[1] != len(fractions):
    raise ValueError(f"budgets must be [P, F={len(fractions)}], got {budgets.shape}")
  truncated = truncated_success(full_success, full_turns, budgets)
  per_map = np.stack([np.stack([pass_curve(s, ks) for s in prompted]),
                      np.stack([pass_curve(s, ks) for s in truncated])])
  return PassSurface(MODES, tuple(float(f) for f in fractions), tuple(int(k) for k in ks), budgets, per_map)


# ----------------------------------------------------------------------------------------------------------
# Step-level action quality against Q* (pure).


class StepTable(NamedTuple):
  """The scored moves of some episodes, ``[S]`` arrays each.

  Attributes:
    map_index: the map (index into the evaluated map list).
    state: the state before the move.
    remaining: ``h``, the turns left before the move.
    action: the move (0..3).
    quality: ``Q*_h(s, a) / max Q*_h(s, .)`` (0 where hopeless).
    regret: ``max Q*_h(s, .) - Q*_h(s, a)``.
    optimal: ``Q*_h(s, a) >= max Q*_h(s, .) - OPTIMAL_TOL``.
    hopeful: ``max Q*_h(s, .) > 0`` (the goal is reachable within ``h`` turns).
  """

  map_index: np.ndarray
  state: np.ndarray
  remaining: np.ndarray
  action: np.ndarray
  quality: np.ndarray
  regret: np.ndarray
  optimal: np.ndarray
  hopeful: np.ndarray

  def keys(self) -> set[tuple[int, int, int]]:
    """The visited ``(map, state, h)`` keys of hopeful steps."""
    m = self.hopeful
    return set(zip(self.map_index[m].tolist(), self.state[m].tolist(), self.remaining[m].tolist()))


def episode_steps(infos: Sequence[Mapping[str, Any]], first_state: int) -> tuple[list[int], list[int], list[int]]:
  """``(states, remaining, actions)`` of an episode's moves from the environment's per-step ``info``.

  The state before move ``t`` is ``first_state`` for ``t = 0`` and ``infos[t - 1]["state"]`` after; the turns
  left before it are ``infos[t]["remaining_turns"] + 1``. Steps without a move (``action is None``: a malformed
  action the environment ended on) are skipped.
  """
  states, remaining, actions = [], [], []
  before = int(first_state)
  for info in infos:
    if info.get("action") is not None:
      states.append(before)
      remaining.append(int(info["remaining_turns"]) + 1)
      actions.append(int(info["action"]))
    before = int(info["state"])
  return states, remaining, actions


def score_steps(q: np.ndarray, states, remaining, actions, map_index: int = 0) -> StepTable:
  """Scores moves with the finite-horizon ``q`` (``[H + 1, num_states, 4]``, :func:`optimal_q`)."""
  states, remaining, actions = (np.asarray(x, np.int64).reshape(-1) for x in (states, remaining, actions))
  if np.any(remaining < 1) or np.any(remaining >= q.shape[0]):
    raise ValueError(f"remaining turns must be in [1, {q.shape[0] - 1}], got {remaining}")
  rows = q[remaining, states]  # [S, 4]
  best = rows.max(axis=1) if len(states) else np.zeros(0)
  chosen = rows[np.arange(len(states)), actions] if len(states) else np.zeros(0)
  hopeful = best > 0
  quality = np.where(hopeful, chosen / np.where(hopeful, best, 1.0), 0.0)
  return StepTable(np.full(len(states), map_index, np.int64), states, remaining, actions, quality, best - chosen,
                   chosen >= best - OPTIMAL_TOL, hopeful)


def concat_steps(tables: Sequence[StepTable]) -> StepTable:
  if not tables:
    empty = np.zeros(0, np.int64)
    return StepTable(empty, empty, empty, empty, np.zeros(0), np.zeros(0), np.zeros(0, bool), np.zeros(0, bool))
  return StepTable(*(np.concatenate(cols) for cols in zip(*tables)))


class StepQuality(NamedTuple):
  """Pooled step quality: means over hopeful steps (NaN when there is none) and the step counts."""

  quality: float
  regret: float
  optimal_share: float
  num_steps: int
  num_hopeless: int


def summarize_steps(table: StepTable, keys: set[tuple[int, int, int]] | None = None) -> StepQuality:
  """Pools the hopeful steps of ``table`` (only those whose ``(map, state, h)`` is in ``keys``, if given)."""
  select = np.ones(len(table.state), bool)
  if keys is not None:
    select = np.asarray([k in keys for k in zip(table.map_index.tolist(), table.state.tolist(),
                                                   table.remaining.tolist())], bool).reshape(-1)
  use = select & table.hopeful
  mean = lambda x: float(np.mean(x[use])) if use.any() else float("nan")
  return StepQuality(mean(table.quality), mean(table.regret), mean(table.optimal.astype(np.float64)),
                     int(use.sum()), int((select & ~table.hopeful).sum()))


def matched_keys(*tables: StepTable) -> set[tuple[int, int, int]]:
  """The ``(map, state, h)`` keys visited (hopeful) by every table: the states on which policies are compared."""
  if not tables:
    return set()
  return set.intersection(*(t.keys() for t in tables))


# ----------------------------------------------------------------------------------------------------------
# Recovery (pure) and the error-injection wrapper.


class RecoveryResult(NamedTuple):
  """Success after an injected error vs without one (definitions in the module docstring).

  Attributes:
    recovery: mean over maps of the injected episodes' success share.
    clean: mean over the same maps of the clean episodes' success share.
    ratio: ``recovery / clean`` (NaN when ``clean`` is 0).
    per_map_recovery: ``[P]`` (NaN for maps that drop out).
    per_map_clean: ``[P]`` (NaN for maps that drop out).
    num_maps: maps in the means.
    num_excluded_episodes: injected episodes whose injection was unusable (no error, or it ended the episode).
  """

  recovery: float
  clean: float
  ratio: float
  per_map_recovery: np.ndarray
  per_map_clean: np.ndarray
  num_maps: int
  num_excluded_episodes: int


def recovery_rate(injected_success, injected_usable, clean_success) -> RecoveryResult:
  """Recovery from ``[P, n]`` injected outcomes (``injected_usable`` marks usable injections) vs ``[P, n']`` clean."""
  s = np.asarray(injected_success, bool)
  usable = np.asarray(injected_usable, bool)
  clean = np.asarray(clean_success, bool)
  if s.shape != usable.shape or s.ndim != 2 or clean.ndim != 2 or clean.shape[0] != s.shape[0]:
    raise ValueError(f"need [P, n] injected arrays and [P, n'] clean, got {s.shape}, {usable.shape}, {clean.shape}")
  n_p = usable.sum(axis=1)
  keep = n_p > 0
  rec = np.where(keep, (s & usable).sum(axis=1) / np.maximum(n_p, 1), np.nan)
  cln = np.where(keep, clean.mean(axis=1), np.nan)
  r = float(rec[keep].mean()) if keep.any() else float("nan")
  c = float(cln[keep].mean()) if keep.any() else float("nan")
  return RecoveryResult(r, c, r / c if c > 0 else float("nan"), rec, cln, int(keep.sum()),
                        int((~usable).sum()))


class InjectionUnusable(RuntimeError):
  """Raised by :meth:`InjectedErrorEnv.reset` when no error can be injected or the injected move ended the
  episode (the engine records ``env_error``; recovery excludes the episode)."""


def _has_lengthening_move(desc: Map, state: int) -> bool:
  """Whether a safe move from ``state`` lengthens the shortest path (the error :func:`error_action` prefers)."""
  dist = shortest_distances(desc)
  return any(dist[move(desc, state, a)] > dist[state] for a in safe_actions(desc, state))


class InjectedErrorEnv:
  """A FrozenLake environment whose episodes start with an injected error (a thin wrapper; other attributes
  are the wrapped environment's).

  ``reset(seed)`` resets the wrapped environment, walks the expert lead-in and takes
  :meth:`FrozenLakeEnv.inject_error` (module docstring; moves drawn with ``default_rng([seed, 1])``), and
  returns the prompt followed by each injected move's text and observation, joined by ``separator`` (the
  turn separator of :func:`~lemon_rl.envs.frozenlake.episode_text`). ``step`` is the wrapped environment's.
  After ``reset``: ``injected_actions`` (lead-in moves, then the error), ``policy_start`` (the state the policy
  starts from) and ``usable``; an unusable injection raises :class:`InjectionUnusable` (the engine records
  ``env_error``).

  Args:
    env: the environment (its ``max_turns`` is the episode's budget, the injected moves included).
    lead_in: expert moves before the error (``None``: until a lengthening error exists; never onto the goal).
    separator: text between the prompt, the moves and the observations.
  """

  def __init__(self, env: FrozenLakeEnv, lead_in: int | None = None, separator: str = "\n"):
    if lead_in is not None and lead_in < 0:
      raise ValueError(f"lead_in must be >= 0 or None, got {lead_in}")
    self.env = env
    self.lead_in = lead_in
    self.separator = separator
    self.injected_actions: list[int] = []
    self.policy_start: int | None = None
    self.usable = False

  def reset(self, seed: int) -> str:
    env = self.env
    parts = [env.reset(seed)]
    self.injected_actions, self.policy_start, self.usable = [], None, False
    rng = np.random.default_rng([int(seed), _INJECT_STREAM])
    dist = env.distances

    def take(text: str, result) -> None:
      self.injected_actions.append(int(result.info["action"]))
      parts.extend((text, result.observation))
      if result.done:
        raise InjectionUnusable(f"the injected moves ended the episode ({result.info['status']})")

    while dist[env.state] > 1 and (len(self.injected_actions) < self.lead_in if self.lead_in is not None
                                   else not _has_lengthening_move(env.desc, env.state)):
      a = int(rng.choice(optimal_actions(env.desc, env.state)))
      take(format_action(a, env.action_tag), env.step_action(a))
    injected = env.inject_error(rng)
    if injected is None:
      raise InjectionUnusable(f"no error action at state {env.state} of {env.desc}")
    take(*injected)
    self.policy_start, self.usable = int(env.state), True
    return self.separator.join(parts)

  def step(self, action_text: str):
    return self.env.step(action_text)

  def __getattr__(self, name: str):
    if name == "env":
      raise AttributeError(name)
    return getattr(self.env, name)


# ----------------------------------------------------------------------------------------------------------
# Running policies.


@dataclasses.dataclass(frozen=True)
class BudgetEvalSettings:
  """What :func:`evaluate_budgets` runs.

  Attributes:
    num_samples: ``n``, episodes per map and budget (``>= max_k``).
    max_k: Pass@1 ... Pass@max_k are reported.
    fractions: budget fractions of ``T_max``.
    show_budget: write the budget into the prompt (a budget-aware policy).
    max_action_tokens: per-turn action limit of the engine.
    num_slots: context limit of an episode (tokens).
    sampling: the sampling distribution.
    batch_size: rows of the engine's KV cache (default all episodes of a run).
    seed: seeds everything (reset seeds, engine key, injected actions).
    recovery_fraction: budget fraction of the recovery comparison (``None``: no recovery run).
    injection_lead_in: :class:`InjectedErrorEnv`'s ``lead_in`` (``None``: until a lengthening error exists).
    env_factory: ``env_factory(desc, max_turns=, show_budget=, end_on_budget=True, **env_kwargs)`` builds an
      environment (default :class:`FrozenLakeEnv`).
    env_kwargs: further environment arguments (``slippery``, ``t_max_multiple``, ``strict``, ...).
  """

  num_samples: int = 16
  max_k: int = 8
  fractions: tuple[float, ...] = BUDGET_FRACTIONS
  show_budget: bool = True
  max_action_tokens: int = 32
  num_slots: int = 2048
  sampling: SamplingSettings = SamplingSettings()
  batch_size: int | None = None
  seed: int = 0
  recovery_fraction: float | None = 1.0
  injection_lead_in: int | None = None
  env_factory: Callable[..., Any] = FrozenLakeEnv
  env_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not 1 <= self.max_k <= self.num_samples:
      raise ValueError(f"need 1 <= max_k <= num_samples, got {self.max_k}, {self.num_samples}")
    for f in (*self.fractions, *(() if self.recovery_fraction is None else (self.recovery_fraction,))):
      budget_turns(1, f)  # validates the fraction
    reserved = {"max_turns", "show_budget", "end_on_budget"} & set(self.env_kwargs)
    if reserved:
      raise ValueError(f"env_kwargs may not set {sorted(reserved)} (the evaluation sets them)")

  @property
  def ks(self) -> tuple[int, ...]:
    return tuple(range(1, self.max_k + 1))


@dataclasses.dataclass
class Run:
  """The episodes of one configuration: ``n`` per map, map ``p``'s environments capped at ``budgets[p]``.

  Attributes:
    maps: the ``P`` maps.
    budgets: ``[P]`` the environments' ``max_turns``.
    episodes: ``[P][n]`` episodes.
    envs: ``[P][n]`` their environments (after the episode).
    injected: whether the episodes started with an injected error.
  """

  maps: list[Map]
  budgets: np.ndarray
  episodes: list[list[Episode]]
  envs: list[list[Any]]
  injected: bool

  @property
  def success(self) -> np.ndarray:
    """``[P, n]`` bool: the episode's status is ``success``."""
    return np.asarray([[e.status == FinishStatus.SUCCESS for e in row] for row in self.episodes], bool)

  @property
  def turns(self) -> np.ndarray:
    """``[P, n]`` int64: the policy's turns (actions) in each episode."""
    return np.asarray([[e.num_turns for e in row] for row in self.episodes], np.int64)

  @property
  def usable(self) -> np.ndarray:
    """``[P, n]`` bool: the episode is a valid sample (for injected runs: the injection was usable)."""
    return np.asarray([[getattr(env, "usable", True) for env in row] for row in self.envs], bool)

  def steps(self) -> StepTable:
    """Every move of every usable episode, scored against ``Q*`` of its map."""
    tables = []
    for p, (desc, row, envs) in enumerate(zip(self.maps, self.episodes, self.envs)):
      q = None
      for episode, env in zip(row, envs):
        if not getattr(env, "usable", True):
          continue
        first = env.policy_start if self.injected else start_state(desc)
        states, remaining, actions = episode_steps(episode.infos, first)
        if not states:
          continue
        if q is None:
          q = optimal_q(desc, int(self.budgets[p]), slippery=env.slippery, success_rate=env.success_rate)
        tables.append(score_steps(q, states, remaining, actions, map_index=p))
    return concat_steps(tables)


def reset_seeds(seed: int, map_index: int, num: int) -> list[int]:
  """The ``reset`` seeds of map ``map_index``'s ``num`` episodes (the same at every budget and mode)."""
  return [int(s) for s in np.random.default_rng([int(seed), int(map_index)]).integers(0, 2**31 - 1, num)]


def map_t_max(maps: Sequence[Sequence[str]], settings: BudgetEvalSettings) -> np.ndarray:
  """``[P]`` the maps' ``T_max`` under the settings' environment arguments."""
  return np.asarray([settings.env_factory(as_map(m), show_budget=settings.show_budget, **settings.env_kwargs).t_max
                     for m in maps], np.int64)


def play(model, tokenizer, maps: Sequence[Sequence[str]], budgets: Sequence[int], settings: BudgetEvalSettings,
         *, inject: bool = False) -> Run:
  """Plays ``settings.num_samples`` episodes per map with map ``p``'s environments capped at ``budgets[p]``.

  The environment enforces each map's budget (``end_on_budget``), the engine's limit is the largest budget;
  ``inject`` wraps every environment in :class:`InjectedErrorEnv`.
  """
  maps = [as_map(m) for m in maps]
  budgets = np.asarray(budgets, np.int64).reshape(-1)
  if len(budgets) != len(maps) or np.any(budgets < 1):
    raise ValueError(f"need one budget >= 1 per map, got {budgets} for {len(maps)} maps")
  n = settings.num_samples
  envs, seeds = [], []
  for p, (desc, budget) in enumerate(zip(maps, budgets)):
    for seed in reset_seeds(settings.seed, p, n):
      env = settings.env_factory(desc, max_turns=int(budget), show_budget=settings.show_budget, end_on_budget=True,
                                 **settings.env_kwargs)
      envs.append(InjectedErrorEnv(env, settings.injection_lead_in) if inject else env)
      seeds.append(seed)
  engine = EpisodeSettings(max_turns=int(budgets.max()), max_action_tokens=settings.max_action_tokens,
                           num_slots=settings.num_slots, sampling=settings.sampling)
  episodes = run_episodes(model, tokenizer, envs, seeds, engine, jax.random.key(settings.seed),
                          batch_size=settings.batch_size)
  grid = lambda xs: [list(xs[p * n:(p + 1) * n]) for p in range(len(maps))]
  return Run(maps, budgets, grid(episodes), grid(envs), inject)


@dataclasses.dataclass
class BudgetEvalResult:
  """Everything :func:`evaluate_budgets` measured.

  Attributes:
    surface: the Pass@(K,T) surface of both modes.
    full: the full-budget run (the truncated mode's episodes).
    prompted: ``{fraction: run}`` at each budget (the full run where the budget is ``T_max`` on every map).
    quality: step quality per run: ``"full"``, ``"prompted 25%"``, ..., ``"injected"``.
    injected: the recovery run (or ``None``).
    recovery: its comparison with the clean run at the same budget (or ``None``).
  """

  surface: PassSurface
  full: Run
  prompted: dict[float, Run]
  quality: dict[str, StepQuality]
  injected: Run | None
  recovery: RecoveryResult | None


def evaluate_budgets(model, tokenizer, maps: Sequence[Sequence[str]],
                     settings: BudgetEvalSettings = BudgetEvalSettings()) -> BudgetEvalResult:
  """The budget evaluation of one policy on ``maps``: Pass@(K,T) in both modes, step quality, recovery."""
  maps = [as_map(m) for m in maps]
  t_max = map_t_max(maps, settings)
  budgets = budget_table(t_max, settings.fractions)
  full = play(model, tokenizer, maps, t_max, settings)
  prompted = {f: full if np.array_equal(budgets[:, j], t_max) else play(model, tokenizer, maps, budgets[:, j], settings)
              for j, f in enumerate(settings.fractions)}
  surface = pass_surface(np.stack([prompted[f].success for f in settings.fractions]), full.success, full.turns,
                         budgets, settings.fractions, settings.ks)
  quality = {"full": summarize_steps(full.steps())}
  quality.update({f"prompted {f:.0%}": summarize_steps(run.steps()) for f, run in prompted.items()})
  injected = recovery = None
  if settings.recovery_fraction is not None:
    f = settings.recovery_fraction
    col = np.asarray([budget_turns(t, f) for t in t_max])
    clean = prompted.get(f) or (full if np.array_equal(col, t_max) else play(model, tokenizer, maps, col, settings))
    injected = play(model, tokenizer, maps, col, settings, inject=True)
    recovery = recovery_rate(injected.success, injected.usable, clean.success)
    quality["injected"] = summarize_steps(injected.steps())
  return BudgetEvalResult(surface, full, prompted, quality, injected, recovery)


# ----------------------------------------------------------------------------------------------------------
# Plot.


def plot_pass_surface(surfaces: PassSurface | Mapping[str, PassSurface], path: str) -> str:
  """Heat maps of Pass@(K,T) of one policy or of several (``{name: surface}``); see :func:`plot_pass_grids`."""
  named = {"": surfaces} if isinstance(surfaces, PassSurface) else dict(surfaces)
  some = next(iter(named.values()))
  grids = {name: {mode: s.mean[i] for i, mode in enumerate(s.modes)} for name, s in named.items()}
  return plot_pass_grids(grids, some.fractions, some.ks, path)


def plot_pass_grids(grids: Mapping[str, Mapping[str, np.ndarray]], fractions: Sequence[float], ks: Sequence[int],
                    path: str) -> str:
  """Heat maps of Pass@(K,T): x = budget fraction, y = K, colour = value in [0, 1].

  Args:
    grids: ``{policy name: {mode: [F, len(ks)] Pass@(k, T)}}``; one row of panels per policy, one column per mode.
    fractions: the ``F`` budget fractions of ``T_max``.
    ks: the ``K`` values.
    path: where the figure is saved (matplotlib, Agg).

  Returns:
    ``path``.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  cols = max(len(modes) for modes in grids.values())
  fig, axes = plt.subplots(len(grids), cols, figsize=(1.2 + 3.6 * cols, 0.6 + 3.0 * len(grids)), squeeze=False,
                           layout="constrained")
  image = None
  for r, (name, modes) in enumerate(grids.items()):
    for c, (mode, grid) in enumerate(modes.items()):
      ax, z = axes[r, c], np.asarray(grid).T  # [K, F]
      image = ax.imshow(z, origin="lower", aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis")
      for (i, j), v in np.ndenumerate(z):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
      ax.set_xticks(range(len(fractions)), [f"{f:.0%}" for f in fractions])
      ax.set_yticks(range(len(ks)), [str(k) for k in ks])
      ax.set_xlabel("turn budget T (fraction of T_max)")
      ax.set_ylabel("K")
      ax.set_title(f"{name}: {mode}" if name else mode)
  fig.colorbar(image, ax=axes.ravel().tolist(), label="Pass@(K,T)")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
