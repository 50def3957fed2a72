"""Budget evaluation: Pass@(K,T) in both modes, step quality against Q*, error injection and recovery."""

import math

import numpy as np
import pytest
from flax import nnx

from lemon_rl.envs.frozenlake import (FrozenLakeEnv, NUM_ACTIONS, LEFT, DOWN, RIGHT, UP, format_action, optimal_q,
                                      parse_action, shortest_distances, start_state)
from lemon_rl.eval import budget_eval as be
from lemon_rl.eval.pass_at_k import pass_at_k_t
from lemon_rl.models import Transformer, get_preset
from lemon_rl.text import ByteTokenizer
from lemon_rl.training.rollout import SamplingSettings

GAMMA = 0.95
LAKE_2X2 = ("SF", "FG")
GYM_4X4 = ("SFFF", "FHFH", "FFFH", "HFFG")  # Gymnasium's default 4x4 map.


# -- budgets and Pass@(K,T) -----------------------------------------------------------------------------------


def test_budgets_round_up_to_at_least_one_turn():
  assert [be.budget_turns(10, f) for f in be.BUDGET_FRACTIONS] == [3, 5, 8, 10]  # 2.5 -> 3, 7.5 -> 8
  assert [be.budget_turns(24, f) for f in be.BUDGET_FRACTIONS] == [6, 12, 18, 24]
  assert [be.budget_turns(1, f) for f in be.BUDGET_FRACTIONS] == [1, 1, 1, 1]
  assert be.budget_turns(30, 0.1) == 3  # 0.1 * 30 = 3.0000000000000004 in float64: not 4.
  np.testing.assert_array_equal(be.budget_table([10, 1]), [[3, 5, 8, 10], [1, 1, 1, 1]])
  for bad in (0.0, -0.5, 1.5):
    with pytest.raises(ValueError):
      be.budget_turns(10, bad)


def test_pass_surface_matches_hand_computed_values_in_both_modes():
  # Two maps, n = 4 samples, fractions (0.5, 1.0) with budgets [[4, 8], [3, 6]].
  prompted = np.array([[[1, 0, 0, 0], [0, 0, 0, 0]],
                       [[1, 1, 0, 0], [1, 1, 1, 1]]])
  full_success = np.array([[1, 1, 1, 0], [1, 0, 1, 0]])
  full_turns = np.array([[2, 5, 9, 9], [3, 4, 8, 1]])
  budgets = np.array([[4, 8], [3, 6]])
  s = be.pass_surface(prompted, full_success, full_turns, budgets, (0.5, 1.0), (1, 2))
  assert s.modes == ("prompted", "truncated") and s.per_map.shape == (2, 2, 2, 2)
  # c successes of n = 4: Pass@1 = c / 4, Pass@2 = 1 - C(4 - c, 2) / C(4, 2) = 1 - C(4 - c, 2) / 6.
  p2 = {0: 0.0, 1: 1 - 3 / 6, 2: 1 - 1 / 6, 3: 1.0, 4: 1.0}
  expected_prompted = [[(1 / 4 + 0) / 2, (p2[1] + 0) / 2], [(2 / 4 + 1) / 2, (p2[2] + 1) / 2]]
  # Truncated: map 0 within 4 turns: c = 1 (the 5-turn success is out), within 8: c = 2 (9 > 8).
  # Map 1 within 3: c = 1 (a success at exactly T = 3 counts; the 1-turn sample failed), within 6: c = 1.
  expected_truncated = [[(1 / 4 + 1 / 4) / 2, (p2[1] + p2[1]) / 2], [(2 / 4 + 1 / 4) / 2, (p2[2] + p2[1]) / 2]]
  np.testing.assert_allclose(s.mean[0], expected_prompted, rtol=1e-12)
  np.testing.assert_allclose(s.mean[1], expected_truncated, rtol=1e-12)
  assert s.value("truncated", 0.5, 2) == pytest.approx(p2[1])
  # The truncated counting agrees with the landed per-budget estimator, map by map.
  for p in range(2):
    for f in range(2):
      for k in (1, 2):
        assert s.per_map[1, f, p, k - 1] == pytest.approx(
            pass_at_k_t(full_success[p:p + 1], full_turns[p:p + 1], k, budgets[p, f])[0], abs=1e-12)
  table = s.table()
  assert set(table) == {(m, f) for m in be.MODES for f in (0.5, 1.0)}
  md = s.markdown()
  assert "| truncated | 50% | 0.250 | 0.500 |" in md and "Pass@2" in md


def test_truncated_success_counts_a_success_at_exactly_t_and_not_after():
  out = be.truncated_success([[1, 1, 0]], [[3, 4, 2]], [[3, 4]])
  np.testing.assert_array_equal(out, [[[True, False, False]], [[True, True, False]]])


# -- step quality against Q* --------------------------------------------------------------------------------


def scripted_infos(desc, moves, **env_kwargs):
  env = FrozenLakeEnv(desc, **env_kwargs)
  env.reset(0)
  infos = []
  for m in moves:
    infos.append(env.step(m if isinstance(m, str) else format_action(m)).info)
    if env.status != "running":
      break
  return infos


def test_step_quality_on_a_2x2_map_with_hand_known_q():
  # 2x2 "SF/FG": from S a step right or down then one into G. Q*_1(F, down) = 1; Q*_2(S, right) = 0.95;
  # Q*_3(S, left) = 0.95 * V*_2(S) = 0.9025 (a bump then the path); Q*_2(S, left) = 0.95 * V*_1(S) = 0.
  q = optimal_q(LAKE_2X2, 3)
  assert q[3, 0, LEFT] == pytest.approx(GAMMA**2) and q[3, 0, RIGHT] == pytest.approx(GAMMA)
  infos = scripted_infos(LAKE_2X2, [LEFT, RIGHT, DOWN], max_turns=3)
  states, remaining, actions = be.episode_steps(infos, start_state(LAKE_2X2))
  assert (states, remaining, actions) == ([0, 0, 1], [3, 2, 1], [LEFT, RIGHT, DOWN])
  t = be.score_steps(q, states, remaining, actions)
  np.testing.assert_allclose(t.quality, [GAMMA, 1.0, 1.0], rtol=1e-12)
  np.testing.assert_allclose(t.regret, [GAMMA - GAMMA**2, 0.0, 0.0], atol=1e-12)
  assert t.regret.min() >= 0  # regret = max - Q, never negative
  np.testing.assert_array_equal(t.optimal, [False, True, True])
  summary = be.summarize_steps(t)
  assert summary.quality == pytest.approx((GAMMA + 2) / 3) and summary.optimal_share == pytest.approx(2 / 3)
  assert (summary.num_steps, summary.num_hopeless) == (3, 0)

  # Budget 2: the bump makes the goal unreachable (quality 0); the next state (S, h = 1) is hopeless.
  infos = scripted_infos(LAKE_2X2, [LEFT, LEFT], max_turns=2)
  t2 = be.score_steps(optimal_q(LAKE_2X2, 2), *be.episode_steps(infos, 0))
  np.testing.assert_allclose(t2.quality, [0.0, 0.0])
  np.testing.assert_array_equal(t2.hopeful, [True, False])
  s2 = be.summarize_steps(t2)
  assert (s2.quality, s2.regret, s2.optimal_share) == (0.0, pytest.approx(GAMMA), 0.0)
  assert (s2.num_steps, s2.num_hopeless) == (1, 1)

  # Matched states: only keys both tables visited (map 0, S, h = 2) with a hopeful state.
  keys = be.matched_keys(t, t2)
  assert keys == {(0, 0, 2)}
  assert be.summarize_steps(t, keys).quality == 1.0 and be.summarize_steps(t2, keys).quality == 0.0


def test_a_malformed_action_is_not_a_step_and_a_hole_scores_zero():
  desc = ("SH", "FG")
  infos = scripted_infos(desc, ["<action>down</action>", "jump"], max_turns=4, on_invalid="end")
  assert be.episode_steps(infos, 0) == ([0], [4], [DOWN])
  infos = scripted_infos(desc, [RIGHT], max_turns=4)  # into the hole
  t = be.score_steps(optimal_q(desc, 4), *be.episode_steps(infos, 0))
  assert t.quality.tolist() == [0.0] and t.regret[0] == pytest.approx(GAMMA) and not t.optimal[0]


# -- error injection and recovery ---------------------------------------------------------------------------


def test_injected_error_env_starts_after_an_expert_lead_in_and_a_lengthening_error():
  dist = shortest_distances(GYM_4X4)
  for seed in range(6):
    env = be.InjectedErrorEnv(FrozenLakeEnv(GYM_4X4, show_budget=True))
    text = env.reset(seed)
    lead, error = env.injected_actions  # From S no move lengthens the path: one expert move first.
    ref = FrozenLakeEnv(GYM_4X4, show_budget=True)
    parts = [ref.reset(seed)]
    for a in (lead, error):
      parts += [format_action(a), ref.step_action(a).observation]
    assert text == "\n".join(parts)
    after_lead = ref.P[start_state(GYM_4X4)][lead][0][1]
    assert dist[after_lead] == dist[0] - 1 and dist[env.policy_start] == dist[after_lead] + 1
    assert env.usable and env.turn == 2 and text.endswith(f"[CURRENT TURN] 2 [REMAINING TURNS] {env.t_max - 2}")
    assert env.step(format_action(RIGHT)).info["turn"] == 3  # the policy continues the same episode
  # lead_in=0: the error at the start, where only a bump into the wall is available.
  env = be.InjectedErrorEnv(FrozenLakeEnv(GYM_4X4), lead_in=0)
  env.reset(1)
  assert env.injected_actions[0] in (LEFT, UP) and env.policy_start == 0 and env.turn == 1


def test_an_injection_that_ends_the_episode_is_unusable():
  outcomes = set()
  for seed in range(40):  # slippery: the expert move down may slide right into the hole
    env = be.InjectedErrorEnv(FrozenLakeEnv(("SH", "FG"), slippery=True, max_turns=6))
    try:
      env.reset(seed)
      outcomes.add(env.usable)
    except be.InjectionUnusable:
      assert not env.usable and env.policy_start is None
      outcomes.add("unusable")
  assert outcomes == {True, "unusable"}


def test_recovery_rate_hand_computed():
  injected = [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
  usable = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]  # map 1 drops out; map 0's last sample does not count
  clean = [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
  r = be.recovery_rate(injected, usable, clean)
  assert r.recovery == pytest.approx((2 / 3 + 1) / 2) and r.clean == pytest.approx((0.5 + 0.75) / 2)
  assert r.ratio == pytest.approx(r.recovery / r.clean) and (r.num_maps, r.num_excluded_episodes) == (2, 5)
  assert math.isnan(r.per_map_recovery[1]) and math.isnan(r.per_map_clean[1])


# -- end to end with a tiny random model ----------------------------------------------------------------------

TOK = ByteTokenizer()
OPEN_4X4 = ("SFFF", "FFHF", "FFFF", "FFFG")  # shortest path 6, T_max 24: budgets 6 / 12 / 18 / 24


class LenientLake(FrozenLakeEnv):
  """A random byte model almost never writes a move: a malformed action maps to a move by its bytes' sum, so the
  policy's samples (not a script) decide a multi-turn walk."""

  def step(self, action_text):
    a = parse_action(action_text)
    return self.step_action(sum(action_text.encode()) % NUM_ACTIONS if a is None else a)


@pytest.fixture(scope="module")
def model():
  cfg = get_preset("tiny", vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                   mlp_dim=64)
  return Transformer(cfg, rngs=nnx.Rngs(0))


def settings(**kw):
  base = dict(num_samples=6, max_k=3, max_action_tokens=3, num_slots=2048, sampling=SamplingSettings(1.0, 0, 1.0),
              env_factory=LenientLake, seed=2)
  base.update(kw)
  return be.BudgetEvalSettings(**base)


def test_end_to_end_shapes_budget_in_prompt_and_determinism(model, tmp_path):
  cfg = settings()
  r = be.evaluate_budgets(model, TOK, [OPEN_4X4], cfg)
  assert r.surface.per_map.shape == (2, 4, 1, 3)
  np.testing.assert_array_equal(r.surface.budgets, [[6, 12, 18, 24]])
  assert 0.0 < r.surface.mean.max() and r.surface.mean.min() >= 0 and r.surface.mean.max() <= 1
  assert np.all(np.diff(r.surface.mean, axis=2) >= 0)  # Pass@k grows with k
  assert np.all(np.diff(r.surface.mean[1], axis=0) >= 0)  # truncated: more turns, never fewer successes
  for f, budget in zip(cfg.fractions, (6, 12, 18, 24)):
    for episode, env in zip(r.prompted[f].episodes[0], r.prompted[f].envs[0]):
      assert env.max_turns == budget and f"[MAX TURNS] {budget}\n" in episode.observations[0]
      assert episode.num_turns <= budget and all(i["max_turns"] == budget for i in episode.infos)
  assert r.prompted[1.0] is r.full
  # Truncated mode = the full run's episodes counted within T.
  np.testing.assert_array_equal(
      r.surface.per_map[1], np.stack([be.pass_curve(s, cfg.ks) for s in be.truncated_success(
          r.full.success, r.full.turns, r.surface.budgets)]))
  assert r.quality["full"].num_steps > 0 and 0.0 <= r.quality["full"].quality <= 1.0
  assert r.recovery.num_maps == 1 and r.injected.usable.all()
  for episode, env in zip(r.injected.episodes[0], r.injected.envs[0]):
    assert episode.observations[0].startswith(FrozenLakeEnv(OPEN_4X4, show_budget=True).reset(0))
    assert "[CURRENT TURN] 2 [REMAINING TURNS] 22" in episode.observations[0]
    assert episode.infos[0]["turn"] == 3
  # Deterministic: the same settings give the same episodes.
  again = be.play(model, TOK, [OPEN_4X4], [12], cfg)
  for a, b in zip(again.episodes[0], r.prompted[0.5].episodes[0]):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
  # The plot: one panel per mode and policy.
  path = be.plot_pass_surface({"policy a": r.surface, "policy b": r.surface}, str(tmp_path / "surface.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_without_the_budget_in_the_prompt_prompted_equals_truncated(model):
  # The run at T is then the full run cut at T (same prompt, keys, seeds): both modes give the same numbers.
  r = be.evaluate_budgets(model, TOK, [OPEN_4X4], settings(show_budget=False, recovery_fraction=None))
  np.testing.assert_array_equal(r.surface.per_map[0], r.surface.per_map[1])
  assert "[MAX TURNS]" not in r.prompted[0.25].episodes[0][0].observations[0]
  assert r.recovery is None
  assert r.surface.mean[1, 1, 0] < r.surface.mean[1, 3, 0]  # not vacuous: the cut at 50% removed successes
