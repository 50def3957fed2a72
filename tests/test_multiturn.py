"""The multi-turn episode engine: token-in/token-out episodes on one KV cache, finish statuses, batch independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl.envs.protocol import (Environment, FinishStatus, GymAdapter, InvalidAction, StepResult,
                                    choice_decoder, finish_status)
from lemon_rl.losses.policy_gradient import grpo_loss
from lemon_rl.models import Transformer, get_preset
from lemon_rl.text import ByteTokenizer, decode_completion, encode_prompt
from lemon_rl.training import multiturn
from lemon_rl.training.rollout import SamplingSettings, sequence_token_log_probs

TOK = ByteTokenizer()


def tiny_model(seed=0):
  cfg = get_preset("tiny", vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                   mlp_dim=64)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


MODEL = tiny_model()


class CounterEnv:
  """A deterministic toy: counts the turns, ends after ``length`` of them; logs what it returns and receives.

  Reward 0.25 per turn; success iff the last action has an even number of characters. Optional faults:
  ``invalid_on`` / ``raise_on`` raise at that turn, ``big_on`` returns a ``big``-character observation then,
  ``length=None`` never ends, ``prompt`` overrides the first observation.
  """

  def __init__(self, length=3, invalid_on=None, raise_on=None, big_on=None, big=400, prompt=None,
               reset_raises=False):
    self.length, self.invalid_on, self.raise_on = length, invalid_on, raise_on
    self.big_on, self.big, self.prompt, self.reset_raises = big_on, big, prompt, reset_raises
    self.returned, self.received, self.t = [], [], 0

  def reset(self, seed):
    if self.reset_raises:
      raise RuntimeError("reset failed")
    self.t = 0
    text = self.prompt or f"Count from {seed}. Say anything.\n"
    self.returned.append(text)
    return text

  def step(self, action_text):
    self.t += 1
    self.received.append(action_text)
    if self.t == self.invalid_on:
      raise InvalidAction("not a move")
    if self.t == self.raise_on:
      raise RuntimeError("the environment crashed")
    obs = "x" * self.big if self.t == self.big_on else f"\n[turn {self.t}] n={self.t * 7 % 10}\n"
    self.returned.append(obs)
    done = self.length is not None and self.t >= self.length
    return StepResult(obs, 0.25, done, {"success": len(action_text) % 2 == 0})


def settings(**kw):
  base = dict(max_turns=5, max_action_tokens=6, num_slots=160, sampling=SamplingSettings(1.0, 0, 1.0),
              chunk_size=16)
  base.update(kw)
  return multiturn.EpisodeSettings(**base)


def mixed_envs():
  """Episodes of 1 to 5 turns (different lengths) and one that runs into the budget."""
  return [CounterEnv(length=n) for n in (3, 1, 5, 2, None, 4)]


def play(envs, cfg, batch_size=None, seed=0, model=MODEL):
  seeds = list(range(10, 10 + len(envs)))
  return multiturn.run_episodes(model, TOK, envs, seeds, cfg, jax.random.key(seed), batch_size=batch_size)


def test_episode_ids_are_prompt_sampled_actions_and_observation_tokens():
  """(a) No re-tokenisation: ids = encode(prompt) + per turn the sampled action + encode(observation)."""
  envs = mixed_envs()
  episodes = play(envs, settings(), batch_size=4)
  for env, ep in zip(envs, episodes):
    expected, mask = encode_prompt(TOK, env.returned[0]), [0] * len(encode_prompt(TOK, env.returned[0]))
    for t, action in enumerate(ep.action_ids):
      expected += action
      mask += [1] * len(action)
      if t + 1 < ep.num_turns:  # observations after the last action are recorded, not appended
        obs = TOK.encode(env.returned[t + 1])
        expected += obs
        mask += [0] * len(obs)
    np.testing.assert_array_equal(ep.token_ids, expected)
    np.testing.assert_array_equal(ep.loss_mask, mask)
    assert env.received == ep.actions == [decode_completion(TOK, a) for a in ep.action_ids]
    assert ep.observations == env.returned[:ep.num_turns]
    assert ep.final_observation == env.returned[-1]
    assert ep.remaining_turns == [5 - t for t in range(ep.num_turns)]
    assert ep.prompt_length == len(encode_prompt(TOK, env.returned[0]))
    assert np.all(ep.log_probs[ep.loss_mask == 0] == 0) and np.all(ep.log_probs[ep.loss_mask == 1] < 0)
    # turn index: prompt and action 0 are turn 0; the observation after action t and action t+1 are turn t+1
    starts = np.flatnonzero(np.diff(np.concatenate([[0], ep.loss_mask])) == 1)
    assert list(ep.turn_index[starts]) == list(range(ep.num_turns))
  assert [ep.num_turns for ep in episodes] == [3, 1, 5, 2, 5, 4]
  assert episodes[4].status == FinishStatus.BUDGET_EXHAUSTED
  assert all(ep.status in (FinishStatus.SUCCESS, FinishStatus.FAILURE) for i, ep in enumerate(episodes) if i != 4)
  for ep in episodes:
    if ep.status != FinishStatus.BUDGET_EXHAUSTED:
      assert (ep.status == FinishStatus.SUCCESS) == (len(ep.actions[-1]) % 2 == 0)
    assert ep.turn_rewards == [0.25] * ep.num_turns and ep.total_reward == 0.25 * ep.num_turns


@pytest.mark.parametrize("sampling", [SamplingSettings(1.0, 0, 1.0), SamplingSettings(0.7, 20, 0.9),
                                      SamplingSettings(0.0, 0, 1.0)])
def test_cached_log_probs_equal_a_full_forward_of_the_episode(sampling):
  """(b) The multi-turn cached rollout's log-probs = one full forward over the whole episode, on policy tokens.

  Both are float32 log-softmaxes of the same logits computed two ways: the cache path appends observations
  and actions with ``extend`` (attention over the ``S`` slots of the cache), the full forward uses the
  blocked causal attention; the sums run in different orders, so logits differ by ~1e-7 relative for this
  2-layer model with O(0.1) logits, and the log-softmax over V = 259 terms adds ~sqrt(V) * eps ~ 2e-6 at
  most. 1e-5 leaves 5x margin over that and is far below any real error (a wrong position or a missed token
  moves a log-prob by O(0.1) or more).
  """
  envs = mixed_envs()
  episodes = play(envs, settings(sampling=sampling), batch_size=4, seed=1)
  batch = multiturn.episodes_to_batch(episodes, TOK.pad_id)
  graphdef, params = nnx.split(MODEL, nnx.Param)
  learner = np.asarray(sequence_token_log_probs(graphdef, params, jnp.asarray(batch["ids"]),
                                                jnp.asarray(batch["attention_mask"]), sampling))
  mask = batch["loss_mask"] > 0
  assert mask.sum() == sum(int(ep.loss_mask.sum()) for ep in episodes) > 0
  np.testing.assert_allclose(learner[mask], batch["sampler_logp"][mask], atol=1e-5, rtol=0)
  assert np.all(batch["sampler_logp"][~mask] == 0)


def test_observation_tokens_get_exactly_zero_gradient():
  """(c) The policy-gradient loss on the loss mask gives observation (and prompt) tokens exactly zero gradient."""
  episodes = play(mixed_envs(), settings(), batch_size=6, seed=2)
  batch = multiturn.episodes_to_batch(episodes, TOK.pad_id)
  graphdef, params = nnx.split(MODEL, nnx.Param)
  ids, attn = jnp.asarray(batch["ids"]), jnp.asarray(batch["attention_mask"])
  old = jnp.asarray(batch["sampler_logp"])
  mask = jnp.asarray(batch["loss_mask"])
  adv = jnp.asarray([1.0, -0.5, 0.3, -1.0, 0.7, 0.2], jnp.float32)

  def loss_of_logp(logp):
    loss, _ = grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation="seq_mean_token_mean")
    return loss.value

  logp = sequence_token_log_probs(graphdef, params, ids, attn)
  grad = np.asarray(jax.grad(loss_of_logp)(logp))
  observation = (np.asarray(attn[:, 1:]) > 0) & (np.asarray(mask) == 0)
  assert observation.sum() > 50
  assert np.all(grad[observation] == 0.0)
  assert np.all(grad[np.asarray(mask) > 0] != 0.0)

  # Through the model the gradient stays finite: the masked observation ratios (sampler log-prob 0 there)
  # leak no inf / nan.
  def loss_of_params(p):
    return loss_of_logp(sequence_token_log_probs(graphdef, p, ids, attn))

  grads = jax.grad(loss_of_params)(params)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_abnormal_ends_have_defined_status_and_reward_and_the_batch_goes_on():
  """(d) Malformed action, environment exception, turn budget, context overflow (observation, action, prompt)."""
  cfg = settings(max_turns=4, invalid_action_reward=-1.0, env_error_reward=0.0,
                 context_full_reward=-0.5)
  long_prompt = "p" * 156  # BOS + 156 = 157 tokens of 160: the first action is cut after 3 tokens
  envs = [CounterEnv(length=3), CounterEnv(length=9, invalid_on=2), CounterEnv(length=9, raise_on=2),
          CounterEnv(length=None), CounterEnv(length=9, big_on=1), CounterEnv(length=9, prompt=long_prompt),
          CounterEnv(prompt="q" * 170), CounterEnv(reset_raises=True), CounterEnv(length=2)]
  episodes = play(envs, cfg, batch_size=4, seed=3)
  status = [ep.status for ep in episodes]
  assert status[0] in (FinishStatus.SUCCESS, FinishStatus.FAILURE) and episodes[0].num_turns == 3
  assert status[1:8] == [FinishStatus.INVALID_ACTION, FinishStatus.ENV_ERROR, FinishStatus.BUDGET_EXHAUSTED,
                         FinishStatus.CONTEXT_FULL, FinishStatus.CONTEXT_FULL, FinishStatus.CONTEXT_FULL,
                         FinishStatus.ENV_ERROR]
  assert status[8] in (FinishStatus.SUCCESS, FinishStatus.FAILURE) and episodes[8].num_turns == 2
  rewards = [ep.turn_rewards for ep in episodes]
  assert rewards[1] == [0.25, -1.0] and episodes[1].total_reward == -0.75 and "not a move" in episodes[1].error
  assert rewards[2] == [0.25, 0.0] and "crashed" in episodes[2].error
  assert rewards[3] == [0.25] * 4 and episodes[3].num_turns == 4
  assert rewards[4] == [0.25 - 0.5] and episodes[4].final_observation == "x" * 400
  assert len(episodes[4].token_ids) == episodes[4].prompt_length + len(episodes[4].action_ids[0])  # not appended
  assert rewards[5] == [-0.5] and episodes[5].num_turns == 1 and len(episodes[5].action_ids[0]) == 3
  assert envs[5].received == []  # a context-cut action is not sent to the environment
  assert episodes[5].action_stops == ["context"] and set(episodes[0].action_stops) <= {"eos", "length"}
  assert len(episodes[5].token_ids) == 160 and episodes[5].loss_mask.sum() == 3
  assert episodes[6].num_turns == 0 and episodes[6].total_reward == -0.5 and episodes[6].loss_mask.sum() == 0
  assert episodes[7].num_turns == 0 and episodes[7].total_reward == 0.0 and len(episodes[7].token_ids) == 0
  # The rows that ended early did not disturb the others: with well-behaved neighbours instead, episodes 0
  # and 8 (same indices, so the same keys) are token for token the same.
  calm = [CounterEnv(length=3)] + [CounterEnv(length=1) for _ in range(7)] + [CounterEnv(length=2)]
  reference = play(calm, cfg, batch_size=4, seed=3)
  for i in (0, 8):
    np.testing.assert_array_equal(episodes[i].token_ids, reference[i].token_ids)
    np.testing.assert_allclose(episodes[i].log_probs, reference[i].log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", [SamplingSettings(0.0, 0, 1.0), SamplingSettings(1.0, 0, 1.0)])
def test_results_do_not_depend_on_batch_composition(sampling):
  """(e) Each episode is the same alone, in a full batch, with refill in 2 rows, and with masking (no refill).

  With refill, a finished episode's slot is reused by the next one: equality with the full batch (no slot
  reuse) shows that neither the finished episode nor its successor is disturbed. Greedy tokens are equal
  exactly; with sampling too, since each episode's keys depend on its index alone.
  """
  cfg = settings(sampling=sampling)
  runs = {"full": play(mixed_envs(), cfg, seed=4),
          "refill_2": play(mixed_envs(), cfg, batch_size=2, seed=4),
          "masked_4": play(mixed_envs(), settings(sampling=sampling, refill=False), batch_size=4, seed=4)}
  reference = runs.pop("full")
  for name, episodes in runs.items():
    for ref, ep in zip(reference, episodes):
      np.testing.assert_array_equal(ep.token_ids, ref.token_ids, err_msg=name)
      np.testing.assert_allclose(ep.log_probs, ref.log_probs, atol=1e-5, rtol=0, err_msg=name)
      assert (ep.status, ep.turn_rewards, ep.actions) == (ref.status, ref.turn_rewards, ref.actions), name
  # Alone (batch of 1): the same episode index must be used, so play the prefix ending at it in 1 row.
  alone = play(mixed_envs()[:3], cfg, batch_size=1, seed=4)
  for ref, ep in zip(reference, alone):
    np.testing.assert_array_equal(ep.token_ids, ref.token_ids)
  assert len({ep.num_turns for ep in reference}) > 3  # the episodes really have different lengths


def test_gym_adapter_and_malformed_actions():
  """The Gymnasium-style adapter: codecs as functions, a malformed action raises InvalidAction."""

  class Line:  # a 1-D walk: reach position 2
    def reset(self, seed=None):
      self.pos = 0
      return self.pos, {"seed": seed}

    def step(self, action):
      self.pos += action
      return self.pos, float(self.pos == 2), self.pos == 2, False, {}

  env = GymAdapter(Line(), choice_decoder({"left": -1, "right": 1}), lambda obs, info: f"at {obs}")
  assert isinstance(env, Environment)
  assert env.reset(seed=3) == "at 0"
  r = env.step(" Right.\n")
  assert (r.observation, r.reward, r.done) == ("at 1", 0.0, False)
  r = env.step("right")
  assert (r.reward, r.done, r.info["success"]) == (1.0, True, True)
  with pytest.raises(InvalidAction):
    env.step("jump")
  assert finish_status(StepResult("", 1.0, True)) == FinishStatus.SUCCESS
  assert finish_status(StepResult("", 1.0, True, {"success": False})) == FinishStatus.FAILURE
  assert finish_status(StepResult("", -1.0, True, {"status": "invalid_action"})) == FinishStatus.INVALID_ACTION
  assert finish_status(StepResult("", 0.0, True, {"status": "running"})) == FinishStatus.FAILURE
  # In the engine a random policy's text is malformed: invalid_action with the defined penalty.
  envs = [GymAdapter(Line(), choice_decoder({"left": -1, "right": 1}), lambda o, i: f"at {o}") for _ in range(2)]
  episodes = multiturn.run_episodes(MODEL, TOK, envs, [0, 1], settings(invalid_action_reward=-2.0),
                                    jax.random.key(0))
  assert [(ep.status, ep.turn_rewards, ep.num_turns) for ep in episodes] == [
      (FinishStatus.INVALID_ACTION, [-2.0], 1)] * 2
