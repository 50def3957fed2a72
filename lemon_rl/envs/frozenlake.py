"""Text FrozenLake: Gymnasium's ``FrozenLake-v1`` as a multi-turn text environment (METHODS.md section 5).

Pure Python and numpy; implements the text-environment protocol of :mod:`lemon_rl.envs.protocol`
(``reset(seed) -> str``, ``step(action_text) -> StepResult``).

Maps. A map is a tuple of row strings over ``S`` (start, top left), ``F`` (frozen, safe), ``H`` (hole) and
``G`` (goal, bottom right). :func:`random_map` draws a board exactly as Gymnasium's ``generate_random_map``
does (same ``rng.choice`` call, so the same generator state gives the same map) and rejects it unless a path
from ``S`` to ``G`` avoids the holes (Gymnasium's validity rule). Splits (:data:`SPLITS`):

==============  ======  ==========  ==================================================
split           sizes   bucket      use
==============  ======  ==========  ==================================================
train           4-6     train       RL / SFT maps
validation      4-6     validation  model selection
test            4-6     test        held-out maps of the training sizes
validation_8x8  8       validation  larger maps, model selection
test_8x8        8       test        larger held-out maps (evaluation)
==============  ======  ==========  ==================================================

Splits are disjoint by map CONTENT by construction: a stable hash (BLAKE2b) of the map's canonical key
(:func:`canonical_key`: the smaller of the map text and its transpose's, so a board and its mirror image
across the diagonal, the same puzzle with down/right and up/left swapped, share a split) gives a score
``u in [0, 1)``; ``u < test_fraction`` is the test bucket, ``u < test_fraction + validation_fraction`` the
validation bucket, the rest train. Within a split every map appears once (deduplicated by canonical key). Every
generator is a pure function of ``(seed, split)`` and ``generate_maps(seed, 64, s)`` is a prefix of
``generate_maps(seed, 128, s)``. Several sizes in one split never collide (different text).

Dynamics. :func:`transition_table` builds ``P[s][a] = [(prob, next_state, reward, terminated), ...]`` exactly as
``FrozenLake-v1`` does (``env.unwrapped.P``): actions ``LEFT=0, DOWN=1, RIGHT=2, UP=3``; a move off the grid
stays in place; holes and the goal are terminal (self-loop ``(1.0, s, 0, True)``); reward 1 on entering the
goal. Slippery: the intended move with probability ``success_rate`` (1/3) and each perpendicular move with
``(1 - success_rate) / 2``, listed in Gymnasium's order ``[(a - 1) % 4, a, (a + 1) % 4]`` (duplicates kept).
Sampling matches Gymnasium's RNG use exactly: ``reset(seed)`` makes ``np.random.default_rng(seed)`` (what
``gymnasium.utils.seeding.np_random(seed)`` makes) and draws one uniform for the start state; every step draws
one uniform and takes ``argmax(cumsum(probs) > u)`` (``categorical_sample``), also when not slippery. So the
same seed and action sequence give Gymnasium's trajectory, slippery or not.

Text interface (:class:`FrozenLakeEnv`). ``reset`` returns the whole prompt: the rules, the map once, the move
format and the first position (``"pos (0, 0) S"``). Each step returns a short observation
``"pos (r, c) X"`` (``X`` the tile there), with ``": fell in a hole"``, ``": reached the goal"`` or
``": out of turns"`` on the final one. With ``show_budget`` the prompt states ``[MAX TURNS] B`` and every
non-final observation ``[CURRENT TURN] t [REMAINING TURNS] B - t`` (``t`` = actions taken so far), the
BudgetMix format. A 6x6 episode of ~20 turns is about 1k bytes (a few hundred BPE tokens).

Action rule (:func:`parse_action`): if the text contains a complete ``<action>...</action>`` tag (the tag name
is configurable), the LAST such tag decides and its content, stripped and case-insensitive, must be exactly
one of ``left``, ``down``, ``right``, ``up``; otherwise (no tag; not in ``strict`` mode) the last whole word
among those four, case-insensitive, decides. Anything else is malformed. *Decision*: a malformed action
raises :class:`~lemon_rl.envs.protocol.InvalidAction` (``on_invalid="raise"``, the protocol's way: the
episode engine ends the episode with status ``invalid_action`` and its ``invalid_action_reward``); with
``on_invalid="end"`` the environment itself returns a final :class:`StepResult` with reward
``invalid_action_reward`` (default -1, the engine's default) and ``info["status"] == "invalid_action"``.

Budget. ``T_max = ceil(t_max_multiple * shortest_path)`` (BFS over non-hole cells, deterministic moves; 4x by
default, so budgets of 25% of ``T_max`` stay winnable when not slippery). The environment counts turns
(every step, valid or not, is a turn), stops after ``max_turns`` (default ``T_max``) with status
``budget_exhausted`` (reward 0; reaching the goal on the last turn is a success; ``end_on_budget=False``
leaves the cut to the episode engine) and reports ``turn``, ``max_turns`` and ``remaining_turns`` in ``info``.

Exact ``Q*`` (:func:`optimal_q`): finite-horizon dynamic programming over (state, remaining turns ``h``),
``Q*_h(s, a) = sum_{s'} P(s'|s,a) (r + gamma * (1 - terminated) * max_a' Q*_{h-1}(s', a'))``, ``Q*_0 = 0``,
``gamma = 0.95``; after termination the value is 0.

Error-state injection (:func:`error_action`): an action whose deterministic move lengthens the shortest path
to the goal (to a cell that still reaches it), else any safe (no hole) non-optimal action, else ``None``.

Noisy-expert SFT demonstrations (:func:`noisy_expert_demonstration`): each turn, with probability
``detour_prob`` a random safe non-optimal move (a detour, only while the remaining budget still allows a
shortest path afterwards), else a uniformly chosen shortest-path move; so every detour is followed by recovery.
Rendered as the exact multi-turn text the environment produces.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, NamedTuple, Sequence

import numpy as np

from lemon_rl.data.splits import content_bucket
from lemon_rl.envs.protocol import InvalidAction, StepResult

LEFT, DOWN, RIGHT, UP = 0, 1, 2, 3
ACTION_NAMES = ("left", "down", "right", "up")
NUM_ACTIONS = 4
_DELTAS = ((0, -1), (1, 0), (0, 1), (-1, 0))  # (drow, dcol) of LEFT, DOWN, RIGHT, UP.

GAMMA = 0.95
DEFAULT_SUCCESS_RATE = 1.0 / 3.0
DEFAULT_FROZEN_PROB = 0.8  # Gymnasium's generate_random_map default ``p``.
DEFAULT_T_MAX_MULTIPLE = 4.0
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_TEST_FRACTION = 0.1
DEFAULT_INVALID_ACTION_REWARD = -1.0
DEFAULT_DETOUR_PROB = 0.2
ACTION_TAG = "action"

# Episode statuses reported in ``info["status"]`` (the final ones equal protocol.FinishStatus values).
RUNNING = "running"
SUCCESS = "success"
FAILURE = "failure"
BUDGET_EXHAUSTED = "budget_exhausted"
INVALID_ACTION = "invalid_action"

SPLITS = ("train", "validation", "test", "validation_8x8", "test_8x8")
SPLIT_SIZES = {"train": (4, 5, 6), "validation": (4, 5, 6), "test": (4, 5, 6),
               "validation_8x8": (8,), "test_8x8": (8,)}
_SPLIT_BUCKET = {"train": "train", "validation": "validation", "test": "test",
                 "validation_8x8": "validation", "test_8x8": "test"}

Map = tuple[str, ...]


# ----------------------------------------------------------------------------------------------------------
# Maps.


def as_map(desc: Sequence[str] | str) -> Map:
  """A map as a tuple of row strings (accepts a sequence of rows or one ``\\n``-joined string); validated."""
  rows = tuple(desc.split("\n")) if isinstance(desc, str) else tuple("".join(row) for row in desc)
  if not rows or any(len(r) != len(rows[0]) for r in rows) or not rows[0]:
    raise ValueError(f"a map needs equal-length non-empty rows, got {rows!r}")
  if set("".join(rows)) - set("SFHG"):
    raise ValueError(f"map tiles must be S, F, H or G, got {rows!r}")
  if "".join(rows).count("S") != 1 or "G" not in "".join(rows):
    raise ValueError(f"a map needs exactly one S and at least one G, got {rows!r}")
  return rows


def map_text(desc: Map) -> str:
  """The map's content as text (rows joined by newlines): what splits hash and what the prompt shows."""
  return "\n".join(desc)


def random_map(size: int, frozen_prob: float, rng: np.random.Generator) -> Map:
  """A random solvable ``size x size`` map, drawn exactly as Gymnasium's ``generate_random_map``.

  ``random_map(n, p, np.random.default_rng(seed)) == generate_random_map(n, p, seed)`` (same draws: one
  ``rng.choice(["F", "H"], (n, n), p=[p, 1 - p])`` per attempt until S reaches G).
  """
  p = min(1, frozen_prob)
  while True:
    board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
    board[0][0] = "S"
    board[-1][-1] = "G"
    desc = tuple("".join(row) for row in board)
    if is_solvable(desc):
      return desc


def canonical_key(desc: Map) -> str:
  """The split key of a map: ``min(text(desc), text(transpose(desc)))`` (S and G stay in their corners)."""
  return min(map_text(desc), map_text(tuple("".join(col) for col in zip(*desc))))


def bucket_of(desc: Map, validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
              test_fraction: float = DEFAULT_TEST_FRACTION) -> str:
  """``"test"``, ``"validation"`` or ``"train"``: the content-hash bucket of a map."""
  return content_bucket(canonical_key(desc), b"lemon-lake", (("test", test_fraction),
                                                        ("validation", validation_fraction)), "train")


def generate_maps(seed: int, num: int, split: str, *, sizes: Sequence[int] | None = None,
                  frozen_prob: float = DEFAULT_FROZEN_PROB,
                  validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                  test_fraction: float = DEFAULT_TEST_FRACTION) -> list[Map]:
  """``num`` distinct solvable maps of ``split``; deterministic in ``(seed, split)``, prefix-stable in ``num``.

  Args:
    seed: data seed.
    num: number of maps.
    split: one of :data:`SPLITS`.
    sizes: side lengths drawn uniformly per map (default ``SPLIT_SIZES[split]``).
    frozen_prob: probability that a tile is frozen (Gymnasium's ``p``).
    validation_fraction: mass of the validation bucket.
    test_fraction: mass of the test bucket.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  if num < 0:
    raise ValueError(f"num must be >= 0, got {num}")
  if not (0.0 < test_fraction and 0.0 < validation_fraction and test_fraction + validation_fraction < 1.0):
    raise ValueError(f"need 0 < test_fraction, validation_fraction and a sum < 1, got {test_fraction}, "
                     f"{validation_fraction}")
  sizes = tuple(SPLIT_SIZES[split] if sizes is None else sizes)
  if not sizes or min(sizes) < 2:
    raise ValueError(f"sizes must be >= 2, got {sizes}")
  bucket = _SPLIT_BUCKET[split]
  fraction = {"test": test_fraction, "validation": validation_fraction,
              "train": 1.0 - test_fraction - validation_fraction}[bucket]
  rng = np.random.default_rng([int(seed), SPLITS.index(split)])
  out: list[Map] = []
  seen: set[str] = set()  # Canonical keys: a map's mirror image counts as the same map.
  max_misses = int(1000 / fraction)  # Rejections in a row before giving up (pool nearly exhausted).
  misses = 0
  while len(out) < num:
    if misses > max_misses:
      raise ValueError(f"could not draw {num} distinct {split!r} maps of sizes {sizes} (got {len(out)}); "
                       "lower num or change sizes")
    desc = random_map(int(rng.choice(sizes)), frozen_prob, rng)
    key = canonical_key(desc)
    if key in seen or bucket_of(desc, validation_fraction, test_fraction) != bucket:
      misses += 1
      continue
    misses = 0
    seen.add(key)
    out.append(desc)
  return out


# ----------------------------------------------------------------------------------------------------------
# Dynamics.


def _shape(desc: Map) -> tuple[int, int]:
  return len(desc), len(desc[0])


def to_state(desc: Map, row: int, col: int) -> int:
  return row * len(desc[0]) + col


def to_position(desc: Map, state: int) -> tuple[int, int]:
  return divmod(int(state), len(desc[0]))


def start_state(desc: Map) -> int:
  text = "".join(desc)
  return text.index("S")


def tile(desc: Map, state: int) -> str:
  row, col = to_position(desc, state)
  return desc[row][col]


def move(desc: Map, state: int, action: int) -> int:
  """The deterministic (non-slippery) next state: one square in ``action``'s direction, clipped to the grid."""
  nrow, ncol = _shape(desc)
  row, col = to_position(desc, state)
  drow, dcol = _DELTAS[action]
  return to_state(desc, min(max(row + drow, 0), nrow - 1), min(max(col + dcol, 0), ncol - 1))


def transition_table(desc: Map, slippery: bool = False, success_rate: float = DEFAULT_SUCCESS_RATE
                     ) -> dict[int, dict[int, list[tuple[float, int, int, bool]]]]:
  """``P[s][a] = [(prob, next_state, reward, terminated), ...]``, equal to ``FrozenLake-v1``'s ``env.unwrapped.P``."""
  desc = as_map(desc)
  nrow, ncol = _shape(desc)
  fail_rate = (1.0 - success_rate) / 2.0

  def outcome(s: int, b: int) -> tuple[int, int, bool]:
    s2 = move(desc, s, b)
    letter = tile(desc, s2)
    return s2, int(letter == "G"), letter in "GH"

  table: dict[int, dict[int, list[tuple[float, int, int, bool]]]] = {}
  for s in range(nrow * ncol):
    table[s] = {}
    for a in range(NUM_ACTIONS):
      if tile(desc, s) in "GH":
        table[s][a] = [(1.0, s, 0, True)]
      elif slippery:
        table[s][a] = [(success_rate if b == a else fail_rate, *outcome(s, b))
                       for b in ((a - 1) % 4, a, (a + 1) % 4)]
      else:
        table[s][a] = [(1.0, *outcome(s, a))]
  return table


def categorical_sample(probs: Sequence[float], rng: np.random.Generator) -> int:
  """Gymnasium's ``categorical_sample``: one uniform draw, ``argmax(cumsum(probs) > u)``."""
  return int(np.argmax(np.cumsum(np.asarray(probs)) > rng.random()))


def is_solvable(desc: Map) -> bool:
  """Whether a path of non-hole cells leads from S to a G (Gymnasium's ``is_valid`` rule)."""
  return math.isfinite(shortest_distances(desc)[start_state(desc)])


def shortest_distances(desc: Map) -> np.ndarray:
  """``[num_states]`` float: fewest deterministic moves from each cell to a goal avoiding holes (BFS).

  Goals are 0; holes and cells that cannot reach a goal are ``inf``. Moves between non-hole cells are
  reversible, so a BFS from the goals over the grid graph gives the distances. Cached per map (read-only).
  """
  return _shortest_distances(as_map(desc))


@functools.lru_cache(maxsize=4096)
def _shortest_distances(desc: Map) -> np.ndarray:
  nrow, ncol = _shape(desc)
  dist = np.full(nrow * ncol, np.inf)
  frontier = [s for s in range(nrow * ncol) if tile(desc, s) == "G"]
  for s in frontier:
    dist[s] = 0
  while frontier:
    nxt = []
    for s in frontier:
      for a in range(NUM_ACTIONS):
        s2 = move(desc, s, a)
        if tile(desc, s2) in "SF" and not math.isfinite(dist[s2]):
          dist[s2] = dist[s] + 1
          nxt.append(s2)
    frontier = nxt
  dist.flags.writeable = False
  return dist


def shortest_path_length(desc: Map) -> int:
  """Fewest moves from S to G (raises if the map is unsolvable)."""
  d = shortest_distances(desc)[start_state(desc)]
  if not math.isfinite(d):
    raise ValueError(f"map has no path from S to G: {desc!r}")
  return int(d)


def t_max(desc: Map, multiple: float = DEFAULT_T_MAX_MULTIPLE) -> int:
  """The map's turn limit ``ceil(multiple * shortest_path_length)``."""
  if multiple < 1:
    raise ValueError(f"t_max multiple must be >= 1, got {multiple}")
  return int(math.ceil(multiple * shortest_path_length(desc) - 1e-9))


def optimal_q(desc: Map, horizon: int, *, slippery: bool = False, success_rate: float = DEFAULT_SUCCESS_RATE,
              gamma: float = GAMMA) -> np.ndarray:
  """Exact finite-horizon ``Q*``: ``[horizon + 1, num_states, 4]`` float64, ``Q[h, s, a]`` with ``h`` turns left.

  ``Q[0] = 0``; ``Q[h, s, a] = sum_{(p, s', r, term)} p * (r + gamma * (1 - term) * max_a' Q[h - 1, s', a'])``
  over :func:`transition_table`; terminal cells (holes, goal) have ``Q = 0`` (the episode is over).
  """
  desc = as_map(desc)
  table = transition_table(desc, slippery, success_rate)
  n = len(table)
  cont = np.zeros((n, NUM_ACTIONS, n))  # Probability of moving to s' without terminating.
  reward = np.zeros((n, NUM_ACTIONS))  # Expected immediate reward.
  for s, row in table.items():
    for a, outcomes in row.items():
      for p, s2, r, term in outcomes:
        reward[s, a] += p * r
        if not term:
          cont[s, a, s2] += p
  q = np.zeros((horizon + 1, n, NUM_ACTIONS))
  for h in range(1, horizon + 1):
    q[h] = reward + gamma * cont @ q[h - 1].max(axis=1)
  return q


def optimal_actions(desc: Map, state: int) -> list[int]:
  """Actions whose deterministic move shortens the distance to the goal by one (empty at terminals)."""
  dist = shortest_distances(desc)
  if tile(desc, state) in "GH" or not math.isfinite(dist[state]):
    return []
  return [a for a in range(NUM_ACTIONS) if dist[move(desc, state, a)] == dist[state] - 1]


def safe_actions(desc: Map, state: int) -> list[int]:
  """Actions whose deterministic move lands on a cell that still reaches the goal (no hole, no dead end)."""
  dist = shortest_distances(desc)
  return [a for a in range(NUM_ACTIONS) if math.isfinite(dist[move(desc, state, a)])]


def error_action(desc: Map, state: int, rng: np.random.Generator | None = None) -> int | None:
  """An error to inject at ``state``: a safe action that lengthens the shortest path, chosen uniformly.

  Falls back to any safe non-optimal action (a bump into the edge: the path does not shorten) and returns
  ``None`` if every safe action is optimal (or ``state`` is terminal). Without ``rng``, the first candidate.
  """
  dist = shortest_distances(desc)
  if tile(desc, state) in "GH":
    return None
  safe = safe_actions(desc, state)
  longer = [a for a in safe if dist[move(desc, state, a)] > dist[state]]
  candidates = longer or [a for a in safe if dist[move(desc, state, a)] >= dist[state]]
  if not candidates:
    return None
  return int(candidates[0] if rng is None else rng.choice(candidates))


# ----------------------------------------------------------------------------------------------------------
# Text interface.


def format_action(action: int, tag: str = ACTION_TAG) -> str:
  """The canonical action text, e.g. ``"<action>right</action>"``."""
  return f"<{tag}>{ACTION_NAMES[action]}</{tag}>"


_WORD_RE = re.compile(r"\b(left|down|right|up)\b", re.IGNORECASE)


def parse_action(text: str, *, tag: str = ACTION_TAG, strict: bool = False) -> int | None:
  """The action id in ``text``, or ``None`` if malformed (rule in the module docstring).

  The last complete ``<tag>...</tag>`` decides if there is one (its stripped content must be a move name,
  any case); else, unless ``strict``, the last whole word ``left|down|right|up`` (any case) in the text.
  """
  tags = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.IGNORECASE | re.DOTALL)
  if tags:
    content = tags[-1].strip().lower()
    return ACTION_NAMES.index(content) if content in ACTION_NAMES else None
  if strict:
    return None
  words = _WORD_RE.findall(text)
  return ACTION_NAMES.index(words[-1].lower()) if words else None


class FrozenLakeEnv:
  """One FrozenLake map as a text environment (``reset(seed) -> str``, ``step(action_text) -> StepResult``).

  Args:
    desc: the map (rows).
    slippery: Gymnasium's ``is_slippery`` (default off).
    success_rate: probability of the intended move when slippery.
    max_turns: the episode's turn budget (default ``T_max``); BudgetMix passes its drawn budget here.
    t_max_multiple: ``T_max = ceil(t_max_multiple * shortest_path)``.
    show_budget: write ``[MAX TURNS]`` / ``[CURRENT TURN]`` / ``[REMAINING TURNS]`` into the text.
    on_invalid: ``"raise"`` (raise :class:`InvalidAction`, the protocol's way) or ``"end"`` (end the episode
      here with reward ``invalid_action_reward`` and status ``invalid_action``).
    invalid_action_reward: reward of a malformed action when ``on_invalid="end"``.
    end_on_budget: end the episode (status ``budget_exhausted``, ``done``) after ``max_turns`` turns. With
      ``False`` the environment only counts and reports the budget and leaves the cut to the episode engine,
      which then records its own ``budget_exhausted`` status (a ``done`` from the environment would be
      recorded as a failure there).
    strict: only a complete action tag counts (no last-word fallback).
    action_tag: the action tag's name.

  ``info`` of every step: ``status`` (``running`` / ``success`` / ``failure`` / ``budget_exhausted`` /
  ``invalid_action``), ``success``, ``turn`` (actions taken), ``max_turns``, ``remaining_turns``, ``t_max``,
  ``state``, ``position``, ``action`` (id or ``None``), ``distance`` (shortest path from the new state).
  """

  def __init__(self, desc: Sequence[str] | str, *, slippery: bool = False,
               success_rate: float = DEFAULT_SUCCESS_RATE, max_turns: int | None = None,
               t_max_multiple: float = DEFAULT_T_MAX_MULTIPLE, show_budget: bool = False,
               on_invalid: str = "raise", invalid_action_reward: float = DEFAULT_INVALID_ACTION_REWARD,
               strict: bool = False, action_tag: str = ACTION_TAG, end_on_budget: bool = True):
    self.desc = as_map(desc)
    if on_invalid not in ("raise", "end"):
      raise ValueError(f"on_invalid must be 'raise' or 'end', got {on_invalid!r}")
    self.slippery = bool(slippery)
    self.success_rate = float(success_rate)
    self.nrow, self.ncol = _shape(self.desc)
    self.num_states = self.nrow * self.ncol
    self.P = transition_table(self.desc, self.slippery, self.success_rate)
    self.distances = shortest_distances(self.desc)
    self.shortest_path = shortest_path_length(self.desc)
    self.t_max = t_max(self.desc, t_max_multiple)
    self.max_turns = self.t_max if max_turns is None else int(max_turns)
    if self.max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
    self.show_budget = bool(show_budget)
    self.end_on_budget = bool(end_on_budget)
    self.on_invalid = on_invalid
    self.invalid_action_reward = float(invalid_action_reward)
    self.strict = bool(strict)
    self.action_tag = action_tag
    self._initial = np.asarray([float(c == "S") for c in "".join(self.desc)])
    self._initial /= self._initial.sum()
    self._q: np.ndarray | None = None
    self.rng: np.random.Generator | None = None
    self.state = start_state(self.desc)
    self.turn = 0
    self.status = RUNNING

  # Text.

  def system_prompt(self) -> str:
    """Rules, the map and the action format (the first part of :meth:`reset`'s text)."""
    names = "|".join(ACTION_NAMES)
    lines = [
        "FrozenLake: walk from S to G. F is ice, H is a hole (falling in ends the game). "
        "Row 0 is the top, column 0 the left; a move off the grid stays in place.",
    ]
    if self.slippery:
      lines.append("The ice is slippery: a move may go sideways.")
    lines += ["Map:", map_text(self.desc), f"Answer with one move: <{self.action_tag}>{names}</{self.action_tag}>"]
    if self.show_budget:
      lines.append(f"[MAX TURNS] {self.max_turns}")
    return "\n".join(lines)

  def position_text(self, state: int, note: str = "") -> str:
    row, col = to_position(self.desc, state)
    return f"pos ({row}, {col}) {tile(self.desc, state)}" + (f": {note}" if note else "")

  def _budget_text(self) -> str:
    return f"\n[CURRENT TURN] {self.turn} [REMAINING TURNS] {self.max_turns - self.turn}" if self.show_budget else ""

  def _info(self, action: int | None, prob: float | None = None) -> dict[str, Any]:
    return {"status": self.status, "success": self.status == SUCCESS, "turn": self.turn,
            "max_turns": self.max_turns, "remaining_turns": self.max_turns - self.turn, "t_max": self.t_max,
            "state": self.state, "position": to_position(self.desc, self.state), "action": action,
            "distance": float(self.distances[self.state]), "prob": prob}

  # Protocol.

  def reset(self, seed: int | None = None) -> str:
    """Starts an episode; the RNG is ``np.random.default_rng(seed)``, used as Gymnasium uses its own."""
    self.rng = np.random.default_rng(seed)
    self.state = categorical_sample(self._initial, self.rng)
    self.turn = 0
    self.status = RUNNING
    return self.system_prompt() + "\n" + self.position_text(self.state) + self._budget_text()

  def step(self, action_text: str) -> StepResult:
    """Parses and applies one action (a malformed one raises or ends the episode, per ``on_invalid``)."""
    self._check_running()
    action = parse_action(action_text, tag=self.action_tag, strict=self.strict)
    if action is None:
      if self.on_invalid == "raise":
        raise InvalidAction(f"no move in {action_text[-80:]!r}; answer <{self.action_tag}>"
                            f"{'|'.join(ACTION_NAMES)}</{self.action_tag}>")
      self.turn += 1
      self.status = INVALID_ACTION
      return StepResult(f"invalid action: answer <{self.action_tag}>{'|'.join(ACTION_NAMES)}</{self.action_tag}>",
                        self.invalid_action_reward, True, self._info(None))
    return self.step_action(action)

  def step_action(self, action: int) -> StepResult:
    """Applies an action id (no parsing): what :meth:`step` does after parsing, Gymnasium's ``step``."""
    self._check_running()
    if action not in range(NUM_ACTIONS):
      raise ValueError(f"action must be in 0..3, got {action!r}")
    outcomes = self.P[self.state][action]
    prob, self.state, reward, terminated = outcomes[categorical_sample([o[0] for o in outcomes], self.rng)]
    self.turn += 1
    note = ""
    if terminated:
      self.status = SUCCESS if tile(self.desc, self.state) == "G" else FAILURE
      note = "reached the goal" if self.status == SUCCESS else "fell in a hole"
    elif self.end_on_budget and self.turn >= self.max_turns:
      self.status = BUDGET_EXHAUSTED
      note = "out of turns"
    done = self.status != RUNNING
    text = self.position_text(self.state, note) + ("" if done else self._budget_text())
    return StepResult(text, float(reward), done, self._info(action, float(prob)))

  def _check_running(self):
    if self.rng is None:
      raise RuntimeError("call reset(seed) before step")
    if self.status != RUNNING:
      raise RuntimeError(f"the episode is over ({self.status}); call reset(seed)")

  # Analysis helpers.

  def q_table(self) -> np.ndarray:
    """``optimal_q`` of this map up to ``max_turns`` (cached): ``[max_turns + 1, num_states, 4]``."""
    if self._q is None:
      self._q = optimal_q(self.desc, self.max_turns, slippery=self.slippery, success_rate=self.success_rate)
    return self._q

  def q_values(self) -> np.ndarray:
    """``Q*`` of the current state with the remaining turns: ``[4]`` (step-level action quality)."""
    return self.q_table()[self.max_turns - self.turn, self.state]

  def inject_error(self, rng: np.random.Generator | None = None) -> tuple[str, StepResult] | None:
    """Takes an error action (:func:`error_action`) here; returns ``(action_text, result)`` or ``None``."""
    self._check_running()
    action = error_action(self.desc, self.state, rng)
    if action is None:
      return None
    return format_action(action, self.action_tag), self.step_action(action)


# ----------------------------------------------------------------------------------------------------------
# Noisy-expert demonstrations.


class Demonstration(NamedTuple):
  """One rendered episode of the noisy expert.

  Attributes:
    desc: the map.
    turns: ``(observation, action_text)`` pairs in order; ``turns[0][0]`` is the prompt (``reset`` text).
    final_observation: the observation after the last action (no action follows it).
    actions: the action ids.
    detours: per turn, whether the action was a detour (a random safe non-optimal move).
    reward: the episode's total reward.
    status: the final status (``success`` unless slippery dynamics defeated every attempt).
    seed: the ``reset`` seed of the rendered episode.
  """

  desc: Map
  turns: tuple[tuple[str, str], ...]
  final_observation: str
  actions: tuple[int, ...]
  detours: tuple[bool, ...]
  reward: float
  status: str
  seed: int


def noisy_expert_demonstration(desc: Sequence[str], rng: np.random.Generator, *,
                               detour_prob: float = DEFAULT_DETOUR_PROB, max_attempts: int = 100,
                               **env_kwargs: Any) -> Demonstration:
  """A successful episode of the noisy expert on ``desc``, as text turns.

  Each turn: with probability ``detour_prob`` (and only if a shortest path still fits in the turns left after
  it) a uniformly chosen safe non-optimal move, else a uniformly chosen shortest-path move (recovery). Not
  slippery, every episode succeeds. Slippery, the expert move is instead uniform among the ``Q*``-greedy
  actions for the turns left (a shortest path is not optimal on slippery ice) and failed episodes are redrawn
  (up to ``max_attempts``; the last one is returned, with its status, if none succeeds), so slippery
  demonstrations are the successful ones only. ``env_kwargs`` go to :class:`FrozenLakeEnv` (e.g.
  ``slippery``, ``show_budget``, ``max_turns``).
  """
  if not 0.0 <= detour_prob <= 1.0:
    raise ValueError(f"detour_prob must be in [0, 1], got {detour_prob}")
  env = FrozenLakeEnv(desc, **env_kwargs)
  dist = env.distances
  demo = None
  for _ in range(max_attempts):
    seed = int(rng.integers(2**31))
    observation = env.reset(seed)
    turns, actions, detours, total = [], [], [], 0.0
    result = None
    while env.status == RUNNING:
      s, left = env.state, env.max_turns - env.turn
      detour = [a for a in safe_actions(env.desc, s)
                if dist[move(env.desc, s, a)] >= dist[s] and dist[move(env.desc, s, a)] <= left - 1]
      optimal = optimal_actions(env.desc, s)
      if env.slippery:  # Shortest paths are not optimal on slippery ice: follow Q* for the turns left.
        q = env.q_values()
        greedy = [a for a in range(NUM_ACTIONS) if q[a] >= q.max() - 1e-12]
        optimal = greedy if q.max() > 0 else optimal
        detour = [a for a in detour if a not in optimal]
      is_detour = bool(detour) and (not optimal or rng.random() < detour_prob)
      action = int(rng.choice(detour if is_detour else optimal)) if (detour or optimal) else int(
          rng.integers(NUM_ACTIONS))
      text = format_action(action, env.action_tag)
      result = env.step(text)
      turns.append((observation, text))
      actions.append(action)
      detours.append(is_detour)
      total += result.reward
      observation = result.observation
    demo = Demonstration(env.desc, tuple(turns), result.observation, tuple(actions), tuple(detours), total,
                         env.status, seed)
    if env.status == SUCCESS:
      return demo
  return demo


def demonstrations(seed: int, num: int, split: str = "train", *, detour_prob: float = DEFAULT_DETOUR_PROB,
                   maps: Sequence[Map] | None = None, **env_kwargs: Any) -> list[Demonstration]:
  """``num`` noisy-expert demonstrations, one per map of ``generate_maps(seed, num, split)`` (or ``maps``)."""
  maps = generate_maps(seed, num, split) if maps is None else list(maps)[:num]
  rng = np.random.default_rng([int(seed), SPLITS.index(split), 1])
  return [noisy_expert_demonstration(m, rng, detour_prob=detour_prob, **env_kwargs) for m in maps]


def episode_text(turns: Sequence[tuple[str, str]], final_observation: str | None = None, sep: str = "\n") -> str:
  """The turns joined into one text (observation, action, observation, ...), e.g. to inspect or measure."""
  parts = [p for pair in turns for p in pair]
  if final_observation is not None:
    parts.append(final_observation)
  return sep.join(parts)
