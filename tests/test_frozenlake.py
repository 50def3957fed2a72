"""Tests of the text FrozenLake environment (lemon_rl.envs.frozenlake) against Gymnasium's FrozenLake-v1.

Gymnasium is a test-only dependency (setup.py ``test`` extras); it is imported plainly, so a missing install
fails loudly instead of skipping.
"""

import itertools
import math

import numpy as np
import pytest
from gymnasium.envs.toy_text import frozen_lake as gym_fl

from lemon_rl.envs import frozenlake as fl
from lemon_rl.envs.protocol import Environment, InvalidAction, is_success

GAMMA = fl.GAMMA


@pytest.fixture(scope="module")
def split_maps():
  nums = {"train": 300, "validation": 60, "test": 60, "validation_8x8": 20, "test_8x8": 20}
  return {split: fl.generate_maps(0, num, split) for split, num in nums.items()}


def parity_maps():
  """Maps of every size for the Gymnasium parity tests (training sizes and 8x8)."""
  return fl.generate_maps(1, 6, "train") + fl.generate_maps(1, 2, "test_8x8")


def gym_env(desc, slippery, success_rate=fl.DEFAULT_SUCCESS_RATE):
  # The unwrapped class: gym.make's TimeLimit would truncate long random walks.
  return gym_fl.FrozenLakeEnv(desc=list(desc), is_slippery=slippery, success_rate=success_rate)


# --------------------------------------------------------------------------------------------------------
# Maps and splits.


class TestMaps:

  def test_random_map_is_gymnasiums(self):
    for seed, size in itertools.product(range(6), (4, 5, 6, 8)):
      ours = fl.random_map(size, 0.8, np.random.default_rng(seed))
      assert ours == tuple(gym_fl.generate_random_map(size, 0.8, seed))
    assert fl.random_map(5, 0.6, np.random.default_rng(3)) == tuple(gym_fl.generate_random_map(5, 0.6, 3))

  def test_is_solvable_matches_gymnasium_rule(self):
    rng = np.random.default_rng(0)
    for _ in range(300):
      size = int(rng.integers(3, 7))
      board = rng.choice(["F", "H"], (size, size), p=[0.6, 0.4])
      board[0][0], board[-1][-1] = "S", "G"
      desc = tuple("".join(r) for r in board)
      assert fl.is_solvable(desc) == gym_fl.is_valid(board.tolist(), size)

  def test_splits_disjoint_by_content_and_deduplicated(self, split_maps):
    sets = {split: set(maps) for split, maps in split_maps.items()}
    for split, maps in split_maps.items():
      assert len(sets[split]) == len(maps), f"duplicate map in {split}"
      sizes = {len(m) for m in maps}
      assert sizes <= set(fl.SPLIT_SIZES[split])
      if split == "train":
        assert sizes == {4, 5, 6}
    for a, b in itertools.combinations(sets, 2):
      assert not sets[a] & sets[b], (a, b)
    # By construction: the content hash bucket decides the split, whatever the seed.
    for split, maps in split_maps.items():
      assert all(fl.bucket_of(m) == fl._SPLIT_BUCKET[split] for m in maps)
    other_seed = set(fl.generate_maps(7, 200, "train"))
    assert not other_seed & (sets["test"] | sets["validation"])

  def test_deterministic_and_prefix_stable(self, split_maps):
    assert fl.generate_maps(0, 300, "train") == split_maps["train"]
    assert fl.generate_maps(0, 40, "train") == split_maps["train"][:40]
    assert fl.generate_maps(1, 40, "train") != split_maps["train"][:40]
    with pytest.raises(ValueError, match="unknown split"):
      fl.generate_maps(0, 1, "dev")

  def test_every_map_solvable_and_t_max(self, split_maps):
    for maps in split_maps.values():
      for desc in maps:
        n = len(desc)
        assert desc[0][0] == "S" and desc[-1][-1] == "G" and all(len(r) == n for r in desc)
        assert fl.is_solvable(desc)
        length = fl.shortest_path_length(desc)
        assert length >= 2 * (n - 1)  # Manhattan distance S -> G.
        assert fl.t_max(desc) == math.ceil(4 * length)
        assert fl.t_max(desc, 2.5) == math.ceil(2.5 * length)
        env = fl.FrozenLakeEnv(desc, t_max_multiple=3)
        assert env.t_max == env.max_turns == math.ceil(3 * length)

  def test_shortest_path_agrees_with_q_star(self):
    # Independent of the BFS: without slipping, Q*_h(S) > 0 iff h >= L, and then max_a Q* = gamma^(L - 1).
    for desc in fl.generate_maps(2, 12, "train"):
      length = fl.shortest_path_length(desc)
      q = fl.optimal_q(desc, length + 2)[:, fl.start_state(desc)].max(axis=1)
      assert q[length - 1] == 0 and q[length] > 0
      np.testing.assert_allclose(q[length:], GAMMA**(length - 1), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------------------
# Dynamics.


class TestDynamics:

  @pytest.mark.parametrize("slippery", [False, True])
  def test_transition_table_equals_gymnasium(self, slippery):
    for desc in parity_maps():
      assert fl.transition_table(desc, slippery) == gym_env(desc, slippery).unwrapped.P
      assert fl.FrozenLakeEnv(desc, slippery=slippery).P == gym_env(desc, slippery).P
    desc = parity_maps()[0]
    assert fl.transition_table(desc, True, 0.6) == gym_env(desc, True, 0.6).P

  @pytest.mark.parametrize("slippery", [False, True])
  def test_trajectories_match_gymnasium_under_same_seeds(self, slippery):
    # Same seed, same action ids: our env draws its uniforms exactly as Gymnasium's (one at reset, one per
    # step, categorical_sample), so states, rewards and termination agree step by step.
    rng = np.random.default_rng(0)
    episodes = 0
    for desc in parity_maps():
      for seed in range(8):
        ref = gym_env(desc, slippery)
        ours = fl.FrozenLakeEnv(desc, slippery=slippery, max_turns=10_000)
        s_ref, _ = ref.reset(seed=seed)
        ours.reset(seed)
        assert ours.state == s_ref
        for _ in range(200):
          a = int(rng.integers(4))
          s_ref, r_ref, term_ref, _, info_ref = ref.step(a)
          result = ours.step(f"I move <action>{fl.ACTION_NAMES[a]}</action>")
          assert (ours.state, result.reward, result.done) == (s_ref, r_ref, term_ref)
          assert result.info["prob"] == info_ref["prob"] and result.info["action"] == a
          if term_ref:
            break
        episodes += 1
    assert episodes == 64

  def test_slippery_moves_sideways_sometimes(self):
    desc = ("SFFF", "FFFF", "FFFF", "FFFG")
    seen = set()
    for seed in range(40):
      env = fl.FrozenLakeEnv(desc, slippery=True)
      env.reset(seed)
      seen.add(env.step_action(fl.RIGHT).info["position"])
    assert seen == {(0, 1), (1, 0), (0, 0)}  # Intended, down (perpendicular), up (clipped: stays).


# --------------------------------------------------------------------------------------------------------
# Q*.


def value_iteration(table, gamma=GAMMA, tol=1e-15):
  """Infinite-horizon discounted Q by value iteration on a Gymnasium-style table (terminal value 0)."""
  n = len(table)
  v = np.zeros(n)
  for _ in range(100_000):
    q = np.array([[sum(p * (r + gamma * (0.0 if t else v[s2])) for p, s2, r, t in table[s][a])
                   for a in range(4)] for s in range(n)])
    v_new = q.max(axis=1)
    if np.max(np.abs(v_new - v)) < tol:
      return q
    v = v_new
  raise AssertionError("value iteration did not converge")


def open_loop_value(table, state, actions, gamma=GAMMA):
  """Expected discounted return of a fixed action sequence, by exact enumeration of the outcomes."""
  if not actions:
    return 0.0
  return sum(p * (r + (0.0 if t else gamma * open_loop_value(table, s2, actions[1:], gamma)))
             for p, s2, r, t in table[state][actions[0]])


def expectimax(table, state, action, h, gamma=GAMMA):
  """Closed-loop optimum by exhaustive search of the game tree (no memoisation, no DP table)."""
  if h == 0:
    return 0.0
  return sum(p * (r + (0.0 if t else gamma * max(expectimax(table, s2, b, h - 1, gamma) for b in range(4))))
             for p, s2, r, t in table[state][action])


class TestOptimalQ:

  def test_corridor_by_hand(self):
    q = fl.optimal_q(("SFFG",), 5)
    assert q[2, 0].max() == 0  # Two turns cannot reach G three squares away.
    assert q[3, 0, fl.RIGHT] == pytest.approx(GAMMA**2, abs=1e-15)
    assert q[3, 0, fl.LEFT] == 0 and q[4, 0, fl.LEFT] == pytest.approx(GAMMA**3, abs=1e-15)
    assert np.all(q[:, 3] == 0)  # The goal is terminal: nothing after termination.

  @pytest.mark.parametrize("slippery", [False, True])
  def test_long_horizon_equals_value_iteration(self, slippery):
    # gamma^700 ~ 2.6e-16: the finite-horizon values have converged to the discounted fixed point.
    for desc in parity_maps()[:3] + parity_maps()[-1:]:
      q = fl.optimal_q(desc, 700, slippery=slippery)
      assert q.dtype == np.float64
      np.testing.assert_allclose(q[700], value_iteration(fl.transition_table(desc, slippery)), rtol=0,
                                 atol=1e-9)

  def test_short_horizons_equal_brute_force_not_slippery(self):
    for desc in fl.generate_maps(3, 2, "train", sizes=(4,)) + fl.generate_maps(3, 1, "train", sizes=(5,)):
      table = fl.transition_table(desc)
      q = fl.optimal_q(desc, 5)
      for h in range(1, 6):
        best = np.zeros((len(table), 4))
        for seq in itertools.product(range(4), repeat=h):
          for s in range(len(table)):
            best[s, seq[0]] = max(best[s, seq[0]], open_loop_value(table, s, seq))
        np.testing.assert_allclose(q[h], best, rtol=0, atol=1e-12)

  def test_short_horizons_equal_brute_force_slippery(self):
    desc = fl.generate_maps(4, 1, "train", sizes=(4,))[0]
    table = fl.transition_table(desc, True)
    q = fl.optimal_q(desc, 4, slippery=True)
    states = range(len(table))
    for h in range(1, 4):
      tree = np.array([[expectimax(table, s, a, h) for a in range(4)] for s in states])
      np.testing.assert_allclose(q[h], tree, rtol=0, atol=1e-12)
    for s in (fl.start_state(desc), 5, 10, 14):  # Four-turn trees from a few states (12^3 leaves each).
      np.testing.assert_allclose(q[4, s], [expectimax(table, s, a, 4) for a in range(4)], rtol=0, atol=1e-12)
    # Open-loop action sequences never beat the closed-loop optimum.
    for seq in itertools.product(range(4), repeat=3):
      for s in states:
        assert open_loop_value(table, s, seq) <= q[3, s, seq[0]] + 1e-12

  def test_env_q_values_use_remaining_turns(self):
    desc = ("SFFG",)
    env = fl.FrozenLakeEnv(desc, max_turns=4)
    env.reset(0)
    assert env.q_values()[fl.RIGHT] == pytest.approx(GAMMA**2)
    env.step_action(fl.LEFT)  # Bump: 3 turns left, still winnable.
    assert env.q_values()[fl.RIGHT] == pytest.approx(GAMMA**2)
    env.step_action(fl.LEFT)  # 2 turns left: G is out of reach.
    assert env.q_values().max() == 0


# --------------------------------------------------------------------------------------------------------
# Text interface.


class TestText:

  @pytest.mark.parametrize("text, expected", [
      ("<action>left</action>", fl.LEFT),
      ("<action> DOWN </action>", fl.DOWN),
      ("I think up is wrong. <action>Right</action>", fl.RIGHT),
      ("<action>up</action> no wait <action>left</action>", fl.LEFT),  # The last tag decides.
      ("<ACTION>up</ACTION>", fl.UP),
      ("left or right? I go Down.", fl.DOWN),  # No tag: the last move word.
      ("up\n", fl.UP),
      ("<action>jump</action> right", None),  # A tag is there, so it decides: malformed.
      ("<action>left right</action>", None),
      ("upward and leftover", None),  # Whole words only.
      ("<action>left", fl.LEFT),  # No complete tag: the last word.
      ("", None),
  ])
  def test_parse_action(self, text, expected):
    assert fl.parse_action(text) == expected

  def test_parse_action_strict(self):
    assert fl.parse_action("go left", strict=True) is None
    assert fl.parse_action("go <action>left</action>", strict=True) == fl.LEFT
    assert fl.parse_action("<move>up</move>", tag="move") == fl.UP
    for a in range(4):
      assert fl.parse_action(fl.format_action(a), strict=True) == a

  def test_prompt_and_observations(self):
    desc = ("SFH", "FFF", "HFG")
    env = fl.FrozenLakeEnv(desc)
    assert isinstance(env, Environment)
    prompt = env.reset(0)
    assert prompt.count("SFH\nFFF\nHFG") == 1 and prompt.endswith("pos (0, 0) S")
    assert "<action>left|down|right|up</action>" in prompt and "[MAX TURNS]" not in prompt
    result = env.step("<action>down</action>")
    assert result == (result.observation, 0.0, False, result.info)
    assert result.observation == "pos (1, 0) F" and "SFH" not in result.observation
    assert result.info["status"] == "running" and result.info["turn"] == 1
    assert result.info["remaining_turns"] == env.t_max - 1 == 15
    for text in ("<action>right</action>", "<action>down</action>"):
      result = env.step(text)
    assert result.observation == "pos (2, 1) F"
    result = env.step("<action>right</action>")
    assert result.observation == "pos (2, 2) G: reached the goal"
    assert result.done and result.reward == 1.0 and result.info["status"] == "success" and is_success(result)
    with pytest.raises(RuntimeError, match="over"):
      env.step("<action>up</action>")

  def test_hole_ends_episode(self):
    env = fl.FrozenLakeEnv(("SFH", "FFF", "HFG"))
    env.reset(0)
    env.step("right")
    result = env.step("right")
    assert result.observation == "pos (0, 2) H: fell in a hole"
    assert result.done and result.reward == 0.0 and result.info["status"] == "failure" and not is_success(result)

  def test_budget_counting_and_exhaustion(self):
    env = fl.FrozenLakeEnv(("SFFG",), max_turns=4, show_budget=True)
    prompt = env.reset(0)
    assert "[MAX TURNS] 4" in prompt and prompt.endswith("[CURRENT TURN] 0 [REMAINING TURNS] 4")
    assert env.t_max == 12
    for turn in range(1, 4):
      result = env.step("<action>left</action>")
      assert not result.done and result.info["remaining_turns"] == 4 - turn
      assert result.observation == f"pos (0, 0) S\n[CURRENT TURN] {turn} [REMAINING TURNS] {4 - turn}"
    result = env.step("<action>left</action>")
    assert result.done and result.reward == 0 and result.info["status"] == "budget_exhausted"
    assert result.info["remaining_turns"] == 0 and result.observation == "pos (0, 0) S: out of turns"
    # Leaving the cut to the episode engine: counted and reported, not ended.
    env = fl.FrozenLakeEnv(("SFFG",), max_turns=2, end_on_budget=False)
    env.reset(0)
    results = [env.step("left") for _ in range(2)]
    assert not results[-1].done and results[-1].info["remaining_turns"] == 0
    assert results[-1].info["status"] == "running"
    # Reaching the goal on the last turn is a success.
    env = fl.FrozenLakeEnv(("SFFG",), max_turns=3)
    env.reset(0)
    results = [env.step("right") for _ in range(3)]
    assert results[-1].info["status"] == "success" and results[-1].reward == 1.0

  def test_malformed_action_raise(self):
    env = fl.FrozenLakeEnv(("SFFG",))
    env.reset(0)
    with pytest.raises(InvalidAction):
      env.step("<action>jump</action>")

  def test_malformed_action_end(self):
    env = fl.FrozenLakeEnv(("SFFG",), on_invalid="end")
    env.reset(0)
    env.step("<action>right</action>")
    result = env.step("I will jump")
    assert result.done and result.reward == fl.DEFAULT_INVALID_ACTION_REWARD == -1.0
    assert result.info["status"] == "invalid_action" and result.info["success"] is False
    assert result.info["turn"] == 2 and result.info["action"] is None and not is_success(result)
    env = fl.FrozenLakeEnv(("SFFG",), on_invalid="end", invalid_action_reward=-0.25, strict=True)
    env.reset(0)
    result = env.step("right")  # Strict: a bare word is malformed.
    assert result.reward == -0.25 and result.info["status"] == "invalid_action"
    with pytest.raises(RuntimeError):
      env.step("<action>right</action>")


# --------------------------------------------------------------------------------------------------------
# Error injection and demonstrations.


class TestErrorsAndDemonstrations:

  def test_error_action_lengthens_shortest_path(self):
    rng = np.random.default_rng(0)
    lengthened = 0
    for desc in fl.generate_maps(5, 20, "train"):
      dist = fl.shortest_distances(desc)
      for s in range(len(dist)):
        a = fl.error_action(desc, s, rng)
        if fl.tile(desc, s) in "GH":
          assert a is None
          continue
        if not math.isfinite(dist[s]):
          continue
        longer = [b for b in range(4) if math.isfinite(dist[fl.move(desc, s, b)]) and
                  dist[fl.move(desc, s, b)] > dist[s]]
        if longer:
          assert a in longer
          lengthened += 1
        elif a is not None:  # Fallback: safe and not shortening.
          assert dist[fl.move(desc, s, a)] == dist[s]
    assert lengthened > 100
    # A corridor start: no lengthening move; bumping left (stay) is the fallback.
    assert fl.error_action(("SFFG",), 0) == fl.LEFT

  def test_inject_error_then_continue(self):
    def lengthening_at_start(desc):
      dist, s = fl.shortest_distances(desc), fl.start_state(desc)
      return any(math.isfinite(dist[fl.move(desc, s, a)]) and dist[fl.move(desc, s, a)] > dist[s]
                 for a in range(4))

    desc = next(m for m in fl.generate_maps(6, 50, "train") if lengthening_at_start(m))
    env = fl.FrozenLakeEnv(desc)
    env.reset(0)
    before = env.distances[env.state]
    action_text, result = env.inject_error(np.random.default_rng(0))
    assert fl.parse_action(action_text) == result.info["action"]
    assert result.info["distance"] > before and not result.done and result.info["turn"] == 1
    env.step(fl.format_action(fl.optimal_actions(desc, env.state)[0]))  # The episode goes on.
    assert env.turn == 2

  def test_noisy_expert_demonstrations_reach_goal_with_detours(self):
    demos = fl.demonstrations(0, 40, detour_prob=0.3)
    assert len(demos) == 40
    for demo in demos:
      assert demo.status == "success" and demo.reward == 1.0
      assert demo.final_observation.endswith("reached the goal")
      assert len(demo.turns) <= fl.t_max(demo.desc)
      # Rendered exactly as the environment renders it: replaying the actions reproduces every text.
      env = fl.FrozenLakeEnv(demo.desc)
      observation = env.reset(demo.seed)
      for (obs, action_text), action in zip(demo.turns, demo.actions):
        assert obs == observation and fl.parse_action(action_text, strict=True) == action
        observation = env.step(action_text).observation
      assert observation == demo.final_observation
      # A detour never shortens the path; every other move is on a shortest path (recovery).
      dist = fl.shortest_distances(demo.desc)
      state = fl.start_state(demo.desc)
      for action, detour in zip(demo.actions, demo.detours):
        nxt = fl.move(demo.desc, state, action)
        assert (dist[nxt] >= dist[state]) if detour else (dist[nxt] == dist[state] - 1)
        state = nxt
    with_detours = sum(any(d.detours) for d in demos)
    assert with_detours >= 30 and sum(sum(d.detours) for d in demos) > 40
    # Without noise: exactly a shortest path.
    for demo in fl.demonstrations(0, 10, detour_prob=0.0):
      assert not any(demo.detours) and len(demo.actions) == fl.shortest_path_length(demo.desc)

  def test_demonstrations_deterministic_and_slippery(self):
    assert fl.demonstrations(1, 5) == fl.demonstrations(1, 5)
    demos = fl.demonstrations(1, 5, slippery=True, show_budget=True)
    assert all(d.status == "success" for d in demos)
    assert all("[MAX TURNS]" in d.turns[0][0] and "slippery" in d.turns[0][0] for d in demos)
