"""BudgetMix and the multi-turn RL step: budget candidates, shared group budgets, the (s_t, B - t) GiGPO key,
one training step of GRPO, GiGPO and PPO on FrozenLake with zero gradient on observation tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl.envs import frozenlake as fl
from lemon_rl.envs.protocol import FinishStatus, StepResult, finish_status
from lemon_rl.models import Transformer, get_preset
from lemon_rl.text import ByteTokenizer
from lemon_rl.training import budgetmix, multiturn, multiturn_rl
from lemon_rl.training import state as state_lib
from lemon_rl.training.rl import PolicyLoss
from lemon_rl.training.rollout import SamplingSettings

MOVES = tuple(fl.format_action(a) for a in range(fl.NUM_ACTIONS))
TOK = ByteTokenizer(extra_special_tokens=MOVES)  # each "<action>move</action>" is one token
SAMPLING = SamplingSettings(1.0, 0, 1.0)
EPISODE = multiturn.EpisodeSettings(max_turns=6, max_action_tokens=2, num_slots=768, sampling=SAMPLING, chunk_size=64)
MAPS = [("SFG",), ("SF", "HG")]  # T_max = 6 and 6 with t_max_multiple=3 (shortest paths 2 and 2)
ENV_KWARGS = {"t_max_multiple": 3.0}
GROUP_SIZE = 4


# -- budgets -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t_max, expected", [
    (1, [1]),                                  # floor(k/10) = 0 for k < 10
    (3, [1, 2, 3]),                            # 0,0,0,1,1,1,2,2,2,3
    (5, [1, 2, 3, 4, 5]),                      # 0,1,1,2,2,3,3,4,4,5
    (6, [1, 2, 3, 4, 5, 6]),                   # 0,1,1,2,3,3,4,4,5,6
    (10, list(range(1, 11))),
    (12, [1, 2, 3, 4, 6, 7, 8, 9, 10, 12]),    # 1.2, 2.4, 3.6, 4.8, 6, 7.2, 8.4, 9.6, 10.8, 12
    (24, [2, 4, 7, 9, 12, 14, 16, 19, 21, 24]),
    (70, [7, 14, 21, 28, 35, 42, 49, 56, 63, 70]),  # the paper's FrozenLake T_max
])
def test_budget_candidates_hand_values(t_max, expected):
  assert budgetmix.budget_candidates(t_max) == expected


def test_budget_candidates_reject_non_positive():
  for bad in (0, -3, 2.5):
    with pytest.raises(ValueError):
      budgetmix.budget_candidates(bad)


def test_draw_budgets_uniform_reproducible_and_full_mode():
  t_maxes = [6, 12, 70]
  a = budgetmix.draw_budgets(t_maxes, np.random.default_rng([3, 7]))
  b = budgetmix.draw_budgets(t_maxes, np.random.default_rng([3, 7]))
  np.testing.assert_array_equal(a, b)
  assert all(x in budgetmix.budget_candidates(t) for x, t in zip(a, t_maxes))
  np.testing.assert_array_equal(budgetmix.draw_budgets(t_maxes, np.random.default_rng(0), "full"), t_maxes)
  with pytest.raises(ValueError):
    budgetmix.draw_budgets(t_maxes, np.random.default_rng(0), "half")
  # Uniform over the 10 candidates of T_max = 12: 5000 draws, each count ~ Binomial(5000, 0.1) (sd 21.2);
  # a 6-sd band cannot fail by chance for this fixed seed and catches a skewed draw (e.g. 0.08 vs 0.1).
  draws = budgetmix.draw_budgets([12] * 5000, np.random.default_rng(1))
  values, counts = np.unique(draws, return_counts=True)
  assert values.tolist() == budgetmix.budget_candidates(12)
  assert np.all(np.abs(counts - 500) < 6 * np.sqrt(5000 * 0.1 * 0.9))


def test_groups_share_one_budget_shown_in_the_prompt_and_are_reproducible():
  maps = fl.generate_maps(0, 6, "train", sizes=(4, 5))
  groups = budgetmix.budgetmix_frozenlake_groups(maps, 3, seed=11, step=5)
  again = budgetmix.budgetmix_frozenlake_groups(maps, 3, seed=11, step=5)
  assert [(g.budget, g.seeds) for g in groups] == [(g.budget, g.seeds) for g in again]
  for m, g in zip(maps, groups):
    assert g.t_max == fl.t_max(m) and g.budget in budgetmix.budget_candidates(g.t_max)
    assert len(g.envs) == 3 and len(set(g.seeds)) == 3
    for env, seed in zip(g.envs, g.seeds):
      assert env.max_turns == g.budget and env.show_budget
      assert f"[MAX TURNS] {g.budget}\n" in env.reset(seed)
  steps = [[g.budget for g in budgetmix.budgetmix_frozenlake_groups(maps, 1, seed=11, step=s)] for s in range(8)]
  assert len({tuple(s) for s in steps}) > 1  # different steps draw different budgets
  full = budgetmix.budgetmix_frozenlake_groups(maps, 2, seed=11, step=5, mode="full")
  assert [g.budget for g in full] == [fl.t_max(m) for m in maps]
  with pytest.raises(ValueError):
    budgetmix.budgetmix_frozenlake_groups(maps, 2, seed=0, step=0, max_turns=3)


# -- the GiGPO key (s_t, B - t): a hand-computed case --------------------------------------------------------


def scripted_episode(desc, budget, moves, index=0):
  """Plays action names through a budget-aware FrozenLake (as the engine would) and records the Episode."""
  env = multiturn_rl.TurnBudget(fl.FrozenLakeEnv(desc, max_turns=budget, show_budget=True), budget)
  observations, rewards, infos = [env.reset(0)], [], []
  for t, move in enumerate(moves):
    result = env.step(fl.format_action(fl.ACTION_NAMES.index(move)))
    rewards.append(result.reward)
    infos.append(result.info)
    if result.done:
      assert t == len(moves) - 1, "the script goes past the end of the episode"
      break
    observations.append(result.observation)
  assert result.done, "the script stops before the end of the episode"
  empty = np.zeros((0,), np.int32)
  return multiturn.Episode(
      index=index, seed=0, token_ids=empty, loss_mask=empty, log_probs=empty.astype(np.float32),
      turn_index=empty, prompt_length=0, observations=observations,
      remaining_turns=[budget - t for t in range(len(observations))], actions=list(moves),
      action_ids=[[0]] * len(moves), action_stops=["eos"] * len(moves), turn_rewards=rewards,
      total_reward=float(sum(rewards)), status=finish_status(result), num_turns=len(moves),
      final_observation=result.observation, infos=infos, error=None)


GAMMA = 0.95


def _normalise(values):
  """(x - mean) / (std_{N-1} + 1e-6): GiGPO's group normalisation (0 for a group of one)."""
  x = np.asarray(values, np.float64)
  if x.size < 2:
    return np.zeros_like(x)
  return (x - x.mean()) / (x.std(ddof=1) + 1e-6)


def test_gigpo_advantages_match_hand_computed_cases_with_repeated_states_at_different_turns_and_budgets():
  """Map ``SFFG`` (cells 0..3 of one row, goal at 3); "up" bumps the edge and stays (the state recurs).

  Group 0, budget 5:  tau1 = R R R        cells 0 1 2       -> goal at turn 3, R = 1
                      tau2 = U R R R      cells 0 0 1 2     -> goal at turn 4, R = 1
                      tau3 = R L U U U    cells 0 1 0 0 0   -> out of turns,   R = 0
  Group 1, budget 3:  tau4 = U R R        cells 0 0 1       -> out of turns,   R = 0
                      tau5 = R R R        cells 0 1 2       -> goal on the last turn, R = 1
  Step returns (gamma 0.95, reward 1 on entering the goal): tau1 [.9025 .95 1], tau2 [.857375 .9025 .95 1],
  tau3, tau4 all 0, tau5 [.9025 .95 1].
  """
  desc = ("SFFG",)
  scripts = [(5, "right right right"), (5, "up right right right"), (5, "right left up up up"),
             (3, "up right right"), (3, "right right right")]
  episodes = [scripted_episode(desc, b, s.split(), i) for i, (b, s) in enumerate(scripts)]
  budgets = [b for b, _ in scripts]
  group_ids = np.asarray([0, 0, 0, 1, 1], np.int32)
  assert [ep.status for ep in episodes] == [FinishStatus.SUCCESS, FinishStatus.SUCCESS,
                                            FinishStatus.BUDGET_EXHAUSTED, FinishStatus.BUDGET_EXHAUSTED,
                                            FinishStatus.SUCCESS]
  # The anchor state read from the text is the engine-independent cell: the prompt (turn 0) and later
  # observations of the same cell agree with the environment's own position.
  for ep in episodes:
    cells = [budgetmix.frozenlake_anchor_state(o) for o in ep.observations]
    assert cells[0] == (0, 0) and cells[1:] == [tuple(info["position"]) for info in ep.infos[:-1]]
  tables = multiturn_rl.turn_tables(episodes, budgets, num_turns=5)
  np.testing.assert_array_equal(tables.episode_rewards, [1, 1, 0, 0, 1])
  np.testing.assert_array_equal(tables.remaining[1, :4], [5, 4, 3, 2])

  g = {1: [.9025, .95, 1.0], 2: [.857375, .9025, .95, 1.0], 3: [0.0] * 5, 4: [0.0] * 3, 5: [.9025, .95, 1.0]}
  a_e = {}
  for members in ([1, 2, 3], [4, 5]):
    a_e.update(zip(members, _normalise([{1: 1, 2: 1, 3: 0, 4: 0, 5: 1}[m] for m in members])))
  np.testing.assert_allclose([a_e[i] for i in range(1, 6)], [0.57735, 0.57735, -1.15470, -0.70711, 0.70711],
                             atol=1e-5)

  def expected(step_groups):
    """A[n, t] = A_E[n] + A_S[n, t]; A_S over the hand-listed step groups of (trajectory, turn)."""
    adv, size = np.zeros((5, 5)), np.zeros((5, 5))
    listed = [m for members in step_groups for m in members]
    assert len(listed) == len(set(listed)) == sum(len(v) for v in g.values())
    for members in step_groups:
      for (i, t), a_s in zip(members, _normalise([g[i][t] for i, t in members])):
        adv[i - 1, t], size[i - 1, t] = a_e[i] + a_s, len(members)
    return adv, size

  singles = lambda *steps: [[s] for s in steps]
  with_budget = [  # key (cell, B - t), within a group
      [(1, 0), (2, 0), (3, 0)],  # (0, 5)
      [(1, 1), (3, 1)],          # (1, 4)
      *singles((1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (3, 3), (3, 4)),  # (2,3) (0,4) (1,3) (2,2) (0,3) (0,2) (0,1)
      [(4, 0), (5, 0)],          # (0, 3) in group 1: not merged with group 0's (0, 3) at tau3, turn 2
      *singles((4, 1), (4, 2), (5, 1), (5, 2)),                          # (0,2) (1,1) (1,2) (2,1)
  ]
  without_budget = [  # key = cell, within a group
      [(1, 0), (2, 0), (2, 1), (3, 0), (3, 2), (3, 3), (3, 4)],  # cell 0 at turns 0..4
      [(1, 1), (2, 2), (3, 1)],                                  # cell 1
      [(1, 2), (2, 3)],                                          # cell 2: equal returns -> A_S = 0
      [(4, 0), (4, 1), (5, 0)], [(4, 2), (5, 1)], [(5, 2)],
  ]
  mask = tables.step_mask > 0
  for budget_in_anchor, groups in ((True, with_budget), (False, without_budget)):
    out, ids = multiturn_rl.gigpo_turn_advantages(
        episodes, tables, group_ids, 2, anchor_state=budgetmix.frozenlake_anchor_state,
        budget_in_anchor=budget_in_anchor, gamma=GAMMA)
    adv, size = expected(groups)
    # float32 means and stds of <= 7 returns of size <= 1 against float64 (errors ~1e-7 relative, times
    # 1 / std <= 3): 1e-5 leaves a wide margin and is far below any grouping or sign error (O(0.1) or more).
    np.testing.assert_allclose(np.asarray(out.advantages)[mask], adv[mask], atol=1e-5, err_msg=str(budget_in_anchor))
    np.testing.assert_array_equal(np.asarray(out.step_group_size)[mask], size[mask])
    np.testing.assert_allclose(np.asarray(out.step_returns)[1, :4], g[2], atol=1e-6)
    assert np.all(np.asarray(out.advantages)[~mask] == 0)
  # The recurring start cell of tau2 (turn 1, 4 turns left) is its own step group with the budget in the key
  # (A = A_E), but one of the 7 visits of cell 0 without it; the values, written out:
  out_b, _ = multiturn_rl.gigpo_turn_advantages(episodes, tables, group_ids, 2,
                                                anchor_state=budgetmix.frozenlake_anchor_state, gamma=GAMMA)
  out_p, _ = multiturn_rl.gigpo_turn_advantages(episodes, tables, group_ids, 2,
                                                anchor_state=budgetmix.frozenlake_anchor_state,
                                                budget_in_anchor=False, gamma=GAMMA)
  assert np.asarray(out_b.step_group_size)[1, 1] == 1 and np.asarray(out_p.step_group_size)[1, 1] == 7
  np.testing.assert_allclose(np.asarray(out_b.advantages)[1, 1], 0.57735, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out_b.advantages)[0, 1], 0.57735 + 0.70711, atol=1e-5)  # (1, 4) pair
  np.testing.assert_allclose(np.asarray(out_b.advantages)[2, 1], -1.15470 - 0.70711, atol=1e-5)


def test_anchor_ids_ignore_budget_counters_and_split_by_remaining_budget():
  obs = [["Map\npos (0, 1) F\n[CURRENT TURN] 1 [REMAINING TURNS] 4", "pos (0, 1) F\n[CURRENT TURN] 3 "
          "[REMAINING TURNS] 2"], ["pos (0, 1) F\n[CURRENT TURN] 1 [REMAINING TURNS] 2", "pos (1, 1) H"]]
  mask = np.ones((2, 2))
  text = multiturn_rl.anchor_ids(obs, mask)  # default: the text without counters
  assert text[0, 1] == text[1, 0] != text[0, 0] and len(np.unique(text)) == 3
  cells = multiturn_rl.anchor_ids(obs, mask, anchor_state=budgetmix.frozenlake_anchor_state)
  assert cells[0, 0] == cells[0, 1] == cells[1, 0] != cells[1, 1]
  keyed = multiturn_rl.anchor_ids(obs, mask, np.asarray([[4, 2], [2, 1]]), budgetmix.frozenlake_anchor_state)
  assert keyed[0, 1] == keyed[1, 0] != keyed[0, 0]


# -- one training step per estimator ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def policy():
  """A tiny random model with a value head, set up to emit move tokens (so that episodes differ in outcome).

  Every embedding gets a constant first coordinate, so the final-norm hidden state has a large positive first
  coordinate at every position; the LM head's first row gives the four move tokens weight 1 there. The moves
  then take most of the probability (the rest, bytes, makes some actions malformed), chosen nearly uniformly:
  a random walk with successes, holes, overruns and invalid actions.
  """
  cfg = get_preset("tiny", vocab_size=TOK.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   mlp_dim=64, tie_embeddings=False, value_head=True)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  model.embed[...] = model.embed[...].at[:, 0].set(1.0)
  moves = jnp.asarray([TOK.token_to_id(m) for m in MOVES])
  model.lm_head[...] = model.lm_head[...].at[0, moves].set(1.0)
  return nnx.split(model, nnx.Param)


OPTIMIZER = state_lib.make_optimizer(1e-3, 10, schedule="constant")


def make_trainer(estimator, **kw):
  graphdef, params = policy()
  state = state_lib.TrainState(params=jax.tree.map(jnp.array, params), opt_state=OPTIMIZER.init(params),
                               step=jnp.zeros((), jnp.int32), rng=jax.random.key_data(jax.random.key(0)))
  settings = multiturn_rl.MultiTurnRLSettings(EPISODE, estimator=estimator, length_multiple=256, **kw)
  trainer = multiturn_rl.MultiTurnTrainer(graphdef, OPTIMIZER, TOK, PolicyLoss(sampling=SAMPLING), settings,
                                          anchor_state=budgetmix.frozenlake_anchor_state)
  return trainer, state


@functools.partial(jax.jit, static_argnames="graphdef")
def logits_and_values(graphdef, params, ids, attention_mask):
  """Next-token logits ``[N, T-1, V]`` and values ``[N, T-1]`` (what the losses compute inside)."""
  model = nnx.merge(graphdef, params)
  hidden = model.hidden_states(ids, attention_mask)[:, :-1]
  return model.logits_from_hidden(hidden), model.value_from_hidden(hidden)


@pytest.mark.parametrize("estimator", ["grpo", "gigpo", "ppo"])
def test_one_training_step_per_estimator(estimator):
  """Episodes under per-group budgets -> per-token advantages on action tokens only -> one update.

  Checks: budgets shared within a group and shown in every prompt; overrun episodes have reward 0; the
  advantages are the per-turn ones spread over each turn's action tokens and exactly 0 elsewhere; the loss
  gives exactly zero gradient to the logits of observation and prompt tokens (and, for PPO, value gradient
  only at each turn's value position); one update changes the parameters.
  """
  trainer, state = make_trainer(estimator)
  groups = budgetmix.budgetmix_frozenlake_groups(MAPS, GROUP_SIZE, seed=0, step=0, **ENV_KWARGS)
  rollout = trainer.rollout(state, groups)
  batch, tables = rollout.batch, rollout.tables
  episodes = rollout.episodes

  # Budgets: one per group, in every prompt, never exceeded; overruns earn 0.
  assert rollout.budgets.tolist() == [g.budget for g in groups] and len(set(rollout.budgets.tolist())) == 2
  for ep, gid in zip(episodes, rollout.group_ids):
    budget = rollout.budgets[gid]
    assert f"[MAX TURNS] {budget}\n" in ep.observations[0] and ep.num_turns <= budget
    np.testing.assert_array_equal(tables.remaining[ep.index, :ep.num_turns], budget - np.arange(ep.num_turns))
    if ep.status == FinishStatus.BUDGET_EXHAUSTED:
      assert ep.num_turns == budget and tables.episode_rewards[ep.index] == 0
  statuses = {ep.status for ep in episodes}
  assert {FinishStatus.SUCCESS, FinishStatus.BUDGET_EXHAUSTED} <= statuses  # the policy gives a signal
  m = rollout.metrics
  assert m["episode/success_rate"] == np.mean([ep.status == FinishStatus.SUCCESS for ep in episodes])
  assert abs(sum(v for k, v in m.items() if k.startswith("episode/status/")) - 1) < 1e-9
  assert m["budget/mean"] == rollout.budgets.mean() and 0 < m["budget/fraction_of_t_max"] <= 1

  # Advantages: per turn, spread over that turn's action tokens, 0 on every other token.
  action = batch["loss_mask"] > 0
  adv = batch["advantages"]
  assert np.all(adv[~action] == 0) and np.any(adv[action] != 0)
  rows = np.broadcast_to(np.arange(adv.shape[0])[:, None], adv.shape)
  np.testing.assert_array_equal(adv[action], rollout.turn_advantages[rows[action], batch["turn_index"][action]])
  if estimator == "grpo":  # one value per episode: the group-normalised outcome, above the mean > 0
    r, gid = tables.episode_rewards, rollout.group_ids
    for ep in episodes:
      a = adv[ep.index][action[ep.index]]
      assert np.all(a == a[0]) and np.sign(a[0]) == np.sign(r[ep.index] - r[gid == gid[ep.index]].mean())
  if estimator == "ppo":
    assert np.all(np.isfinite(batch["returns"])) and np.all(batch["old_values"] == 0)  # zero-initialised head

  # Exactly zero gradient on observation and prompt logits (and on values off the value positions).
  graphdef, params = trainer.graphdef, state.params
  logits, values = logits_and_values(graphdef, params, jnp.asarray(batch["ids"]),
                                     jnp.asarray(batch["attention_mask"]))
  jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
  if estimator == "ppo":
    grad_logits, grad_values = jax.jit(jax.grad(lambda lg, v: trainer.update_loss.loss_from_outputs(
        lg, v, jbatch)[0].sum, argnums=(0, 1)))(logits, values)
  else:
    grad_logits = jax.jit(jax.grad(lambda lg: trainer.update_loss.loss_from_logits(lg, jbatch)[0].sum))(logits)
  per_token = np.abs(np.asarray(grad_logits)).sum(-1)
  observation = (batch["attention_mask"][:, 1:] > 0) & ~action
  assert observation.sum() > 1000
  assert np.all(per_token[~action] == 0.0)
  assert np.all(per_token[action & (adv != 0)] > 0)
  if estimator == "ppo":
    first = action & ~np.concatenate([np.zeros((adv.shape[0], 1), bool), action[:, :-1]], axis=1)
    gv = np.asarray(grad_values)
    assert np.all(gv[~first] == 0.0) and np.count_nonzero(gv[first]) > 0
    assert first.sum() == tables.step_mask.sum()  # one value position per turn
    # L = L_pi + 0.5 * L_V, and with the zero-initialised head (V = V_old = 0) L_V = mean over turns of R^2 / 2.
    total, parts = jax.jit(lambda lg, v: trainer.update_loss.loss_from_outputs(lg, v, jbatch))(logits, values)
    steps = tables.step_mask > 0
    np.testing.assert_allclose(parts["value_loss"].value, 0.5 * np.mean(batch["returns"][steps] ** 2), rtol=1e-6)
    np.testing.assert_allclose(total.value, parts["policy_loss"].value + 0.5 * parts["value_loss"].value,
                               rtol=1e-6, atol=1e-7)
    assert parts["value_loss"].value > 0

  # One update changes the parameters (the value head too for PPO) and keeps them finite.
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = trainer.update(state, rollout)
  after = jax.tree.map(np.asarray, state.params)
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
  assert sum(changed) > len(changed) // 2
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after))
  assert int(state.step) == 1 and np.isfinite(metrics["train/loss"])
  value_changed = not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before["value_head"]),
                                                               jax.tree.leaves(after["value_head"])))
  assert value_changed == (estimator == "ppo")


class PaidWalk:
  """Never ends by itself; pays 0.25 per turn: only the budget ends it, and an overrun must then earn 0."""

  def reset(self, seed):
    return f"Walk {seed}. Any action.\n"

  def step(self, action_text):
    return StepResult("\nok\n", 0.25, False, {})


def test_overrun_episodes_earn_zero_whatever_their_turn_rewards():
  trainer, state = make_trainer("gigpo")
  groups = [multiturn_rl.Group([PaidWalk() for _ in range(GROUP_SIZE)], list(range(GROUP_SIZE)), budget=b)
            for b in (2, 3)]
  rollout = trainer.rollout(state, groups)
  for ep in rollout.episodes:
    budget = rollout.budgets[rollout.group_ids[ep.index]]
    assert ep.status == FinishStatus.BUDGET_EXHAUSTED and ep.num_turns == budget
    assert ep.turn_rewards == [0.25] * budget  # what the turns earned ...
  assert np.all(rollout.tables.episode_rewards == 0) and np.all(rollout.tables.step_rewards == 0)  # ... counts 0
  assert np.all(rollout.batch["advantages"] == 0)
  assert rollout.metrics["episode/status/budget_exhausted"] == 1.0
  with pytest.raises(ValueError, match="budget"):
    trainer.rollout(state, [multiturn_rl.Group([PaidWalk()], [0], budget=EPISODE.max_turns + 1)])


def test_budgetmix_step_draws_the_groups_of_its_step_and_updates():
  """The full step (groups drawn from (seed, state.step), episodes, GiGPO advantages, update, timings)."""
  trainer, state = make_trainer("gigpo")
  state, metrics, rollout = budgetmix.budgetmix_frozenlake_step(trainer, state, MAPS, GROUP_SIZE, seed=0,
                                                                **ENV_KWARGS)
  expected = budgetmix.budgetmix_frozenlake_groups(MAPS, GROUP_SIZE, seed=0, step=0, **ENV_KWARGS)
  assert rollout.budgets.tolist() == [g.budget for g in expected]
  assert [ep.seed for ep in rollout.episodes] == [s for g in expected for s in g.seeds]
  assert int(state.step) == 1
  for key in ("episode/success_rate", "episode/turns_mean", "budget/mean", "gigpo/step_group_size_mean",
              "advantage/std", "train/loss", "time/step_s", "tokens_per_s"):
    assert np.isfinite(metrics[key]), key
