"""The multi-turn episode engine: token-in, token-out, one KV cache kept across turns (METHODS.md section 5).

:func:`run_episodes` plays ``N`` episodes of text environments (:mod:`lemon_rl.envs.protocol`) with the
policy, ``B`` at a time in the rows of one per-row-length KV cache
(:class:`~lemon_rl.models.transformer.KVCache`). Each turn:

1. the policy generates an action for every active row in one jitted ``while_loop`` (one
   ``Transformer.extend`` of one token per row per step, as :mod:`lemon_rl.sampling.sampler` does), each row
   stopping at an EOS id (``tokenizer.eos_ids``, included in the action), at ``max_action_tokens`` or when
   its context is full;
2. the action's ids are decoded once (:func:`lemon_rl.text.decode_completion`) and given to the row's
   environment;
3. the observation is tokenised once (``tokenizer.encode``, no BOS) and appended to the row's cache with
   ``extend(..., num_new)`` (rows of different lengths in one call); the history is never re-encoded or
   re-tokenised, so the episode's ids are exactly the prompt's, the sampled actions' and the observations'.

The sampling distribution is :class:`~lemon_rl.training.rollout.SamplingSettings` (temperature, top-k, top-p)
and the reported log-probs are :func:`lemon_rl.sampling.sampling_log_probs` of the sampled tokens, so a
learner that re-scores the whole episode with one full forward (``sequence_token_log_probs``) gets the same
numbers on the policy tokens. Randomness is per episode: the key of episode ``i``'s turn ``t`` is
``fold_in(fold_in(rng, i), t)`` (then the step), so an episode's trajectory does not depend on which other
episodes share its batch, nor on which slot it runs in.

How an episode ends (:class:`~lemon_rl.envs.protocol.FinishStatus`; ``EpisodeSettings`` holds the rewards):

- ``success`` / ``failure``: the environment said ``done``; the final observation is recorded, not appended
  (an environment that ends the episode itself for another reason names it in ``info["status"]``, see
  :func:`lemon_rl.envs.protocol.finish_status`).
- ``budget_exhausted``: ``max_turns`` actions were taken without ``done`` (a truncation status, not forced
  tokens); the last observation is recorded, not appended.
- ``invalid_action``: the environment raised :class:`~lemon_rl.envs.protocol.InvalidAction`; that turn's
  reward is ``invalid_action_reward`` (default -1).
- ``env_error``: ``reset`` or ``step`` raised anything else (or returned a non-string observation); that
  turn's reward is ``env_error_reward`` (default 0; such episodes say nothing about the policy, so a trainer
  may drop them by status).
- ``context_full``: the prompt, an action or an observation does not fit in ``num_slots`` tokens. An action
  cut by the context keeps its sampled tokens (they are in the cache and were sampled: they stay policy
  tokens) and is not sent to the environment; an observation that does not fit is recorded but not
  appended, and the environment's reward of that turn counts. ``context_full_reward`` (default 0) is added
  to that turn's reward.

An action that reaches ``max_action_tokens`` without EOS is still sent to the environment (which decides
whether the cut text is malformed).

A finished row does not hold the batch. *Decision* (measured): **refill**. When a row's episode ends, the
next pending episode starts in that slot at the next turn boundary (its length is reset to 0 and its prompt
appended with the same ragged ``extend`` as an observation), so every shape stays static (no recompilation)
and the slot does useful work again after at most one turn. The alternative, masking without refill
(``refill=False``: the next ``B`` episodes start only when the whole batch has finished, as static batches
do), leaves finished rows idle until the longest episode of the wave ends. Measured (2026-11-30, 2 shared CPU
cores, a 4-layer d-256 random model, 64 ``CounterEnv`` episodes of the test file with 1 to 8 turns drawn
uniformly, ``B = 8``, 12-token actions, temperature 1, warm compiles, 3 interleaved repeats): refill ran 38
turn-decodes (93% of row-turns busy) in 3.0 / 3.3 / 4.3 s, masking 60 turn-decodes (59% busy) in 4.6 / 4.4 /
4.8 s, about 1.4x slower. Compaction (shrinking the batch as rows finish) was not built: it needs a compiled
decode loop per batch size (or buckets), still waits for the longest episode of each wave (60 turn-decodes
here), and on an accelerator, where a decode step at small ``B`` costs about the same whatever ``B``, saves
nothing that refill does not.

Output: one :class:`Episode` per episode, in input order, with its token ids, a token-aligned loss mask (1
only on policy tokens), the sampler's log-probs, the turn index of every token, and per turn the observation
text shown before the action, the remaining budget (the GiGPO anchor ``(s_t, B - t)``), the action and its
reward. :func:`episodes_to_batch` lays episodes out as right-padded ``[N, T]`` sequences with next-token
``[N, T-1]`` arrays (the layout of :mod:`lemon_rl.training.batches`, without its prompt/completion split).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lemon_rl.envs.protocol import Environment, FinishStatus, InvalidAction, StepResult, finish_status
from lemon_rl.models.transformer import KVCache, Transformer
from lemon_rl.sampling import distribution
from lemon_rl.sampling.sampler import eos_array
from lemon_rl.text.decoding import decode_completion, encode_prompt
from lemon_rl.training.rollout import SamplingSettings


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
  """Limits, terminal rewards and sampling of :func:`run_episodes`.

  Attributes:
    max_turns: the turn budget: at most this many actions per episode.
    max_action_tokens: the per-turn limit on an action's tokens (EOS included).
    num_slots: the context limit of an episode (prompt + actions + observations, in tokens).
    sampling: the sampling distribution (``temperature == 0``: greedy).
    invalid_action_reward: reward of a turn whose action the environment rejected as malformed.
    env_error_reward: reward of a turn (or of an episode whose ``reset``) that raised.
    context_full_reward: added to the reward of the turn at which the context ran out.
    refill: start a pending episode in a finished row at the next turn (``False``: only when the whole
      batch has finished).
    chunk_size: most tokens appended per ``extend`` call (a power of two); prompts and observations are
      appended in chunks of at most this many, each padded to a power of two (so a few compiled shapes).
      The cache holds ``num_slots + chunk_size`` slots so that a ragged append never runs past its end.
  """

  max_turns: int
  max_action_tokens: int
  num_slots: int
  sampling: SamplingSettings = SamplingSettings()
  invalid_action_reward: float = -1.0
  env_error_reward: float = 0.0
  context_full_reward: float = 0.0
  refill: bool = True
  chunk_size: int = 64

  def __post_init__(self):
    if self.max_turns < 1 or self.max_action_tokens < 1 or self.num_slots < 2:
      raise ValueError(f"need max_turns >= 1, max_action_tokens >= 1, num_slots >= 2; got {self}")
    if self.chunk_size < 1 or self.chunk_size & (self.chunk_size - 1):
      raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size}")
    s = self.sampling
    if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0:
      raise ValueError(f"invalid sampling settings {s}")


@dataclasses.dataclass
class Episode:
  """One played episode (numpy; token arrays are aligned with ``token_ids``, length ``n``).

  Attributes:
    index: position of the episode in the input.
    seed: the seed its environment was reset with.
    token_ids: ``[n]`` int32: prompt, then per turn the sampled action and the observation after it.
    loss_mask: ``[n]`` int32, 1 on tokens the policy sampled (actions, EOS included), 0 on prompt and
      observations.
    log_probs: ``[n]`` float32, the sampler's log-prob of each policy token (0 elsewhere).
    turn_index: ``[n]`` int32: ``t`` for the observation shown before action ``t`` (the prompt is turn 0)
      and for action ``t``.
    prompt_length: tokens of the prompt (first observation).
    observations: per turn ``t`` the observation text shown before action ``t`` (``observations[0]`` is the
      prompt); the state of the GiGPO anchor.
    remaining_turns: per turn ``t``, ``max_turns - t``: the budget left before action ``t``.
    actions: per turn the decoded action text (what the environment received).
    action_ids: per turn the sampled action ids.
    action_stops: per turn why the action ended: ``"eos"``, ``"length"`` (``max_action_tokens``) or
      ``"context"`` (cut by ``num_slots``).
    turn_rewards: per turn the reward (the environment's, or the terminal one of an abnormal end).
    total_reward: ``sum(turn_rewards)`` (the ``reset``-error reward for an episode with no turn).
    status: how it ended.
    num_turns: actions taken (a malformed or context-cut action counts).
    final_observation: the observation returned by the last step (not appended), if any.
    infos: per stepped turn, the environment's ``info``.
    error: the exception text of an ``invalid_action`` or ``env_error`` end.
  """

  index: int
  seed: int
  token_ids: np.ndarray
  loss_mask: np.ndarray
  log_probs: np.ndarray
  turn_index: np.ndarray
  prompt_length: int
  observations: list[str]
  remaining_turns: list[int]
  actions: list[str]
  action_ids: list[list[int]]
  action_stops: list[str]
  turn_rewards: list[float]
  total_reward: float
  status: FinishStatus
  num_turns: int
  final_observation: str | None
  infos: list[Mapping[str, Any]]
  error: str | None


class _Running:
  """Host-side record of an episode in progress."""

  def __init__(self, index: int, seed: int, env: Environment):
    self.index, self.seed, self.env = index, seed, env
    self.ids: list[int] = []
    self.mask: list[int] = []
    self.logp: list[float] = []
    self.turn: list[int] = []
    self.prompt_length = 0
    self.observations: list[str] = []
    self.actions: list[str] = []
    self.action_ids: list[list[int]] = []
    self.action_stops: list[str] = []
    self.turn_rewards: list[float] = []
    self.infos: list[Mapping[str, Any]] = []
    self.final_observation: str | None = None

  @property
  def num_turns(self) -> int:
    return len(self.action_ids)

  def add_observation(self, text: str, ids: Sequence[int]) -> None:
    self.observations.append(text)
    self.ids.extend(ids)
    self.mask.extend([0] * len(ids))
    self.logp.extend([0.0] * len(ids))
    self.turn.extend([len(self.action_ids)] * len(ids))

  def add_action(self, ids: Sequence[int], logp: Sequence[float], text: str, stop: str) -> None:
    t = len(self.action_ids)
    self.action_ids.append(list(ids))
    self.action_stops.append(stop)
    self.actions.append(text)
    self.ids.extend(ids)
    self.mask.extend([1] * len(ids))
    self.logp.extend(float(x) for x in logp)
    self.turn.extend([t] * len(ids))

  def finish(self, status: FinishStatus, max_turns: int, extra_reward: float | None = None,
             error: str | None = None) -> Episode:
    rewards = list(self.turn_rewards)
    if extra_reward is not None:
      if len(rewards) < self.num_turns:  # the last turn was not stepped
        rewards.append(float(extra_reward))
      elif rewards:
        rewards[-1] += float(extra_reward)
    total = float(sum(rewards)) if rewards else float(extra_reward or 0.0)
    return Episode(
        index=self.index, seed=self.seed, token_ids=np.asarray(self.ids, np.int32),
        loss_mask=np.asarray(self.mask, np.int32), log_probs=np.asarray(self.logp, np.float32),
        turn_index=np.asarray(self.turn, np.int32), prompt_length=self.prompt_length,
        observations=list(self.observations),
        remaining_turns=[max_turns - t for t in range(len(self.observations))],
        actions=list(self.actions), action_ids=list(self.action_ids),
        action_stops=list(self.action_stops), turn_rewards=rewards, total_reward=total,
        status=FinishStatus(status), num_turns=self.num_turns, final_observation=self.final_observation,
        infos=list(self.infos), error=error)


# -- jitted pieces ----------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _append(graphdef, state, cache: KVCache, logits, tokens, num_new, reset):
  """Appends ``num_new[b]`` of ``tokens [B, k]`` to each row (after emptying rows with ``reset[b]``).

  Returns the cache and the next-token logits ``[B, V]``: those of each row's last appended token, or the
  previous ``logits`` for rows that appended nothing.
  """
  model = nnx.merge(graphdef, state)
  cache = cache._replace(lengths=jnp.where(reset, 0, cache.lengths))
  hidden, cache = model.extend(tokens, cache, num_new=num_new)
  last = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
  return cache, jnp.where((num_new > 0)[:, None], model.logits_from_hidden(last), logits)


@jax.jit
def _turn_keys(rng, episode_ids, turns):
  """Per-row keys ``fold_in(fold_in(rng, episode), turn)``."""
  return jax.vmap(lambda e, t: jax.random.fold_in(jax.random.fold_in(rng, e), t))(episode_ids, turns)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_tokens", "sampling"), donate_argnames=("cache",))
def _act(graphdef, state, cache: KVCache, logits, keys, active, limits, eos_ids, pad_id, *, max_tokens: int,
         sampling: SamplingSettings):
  """One turn's actions: a decode loop over the rows with ``active[b]``, at most ``limits[b]`` tokens each.

  Returns ``(tokens [B, N], log_probs [B, N], num_generated [B], hit_eos [B], cache, logits)``; the cache
  holds each row's action (EOS included) and ``logits`` are those after each row's last token.
  """
  model = nnx.merge(graphdef, state)
  batch = logits.shape[0]
  start = cache.lengths
  draw = jax.vmap(lambda l, k: distribution.sample(l, k, sampling.temperature, sampling.top_k, sampling.top_p))

  def cond(carry):
    i, _, _, _, _, done, _ = carry
    return (i < max_tokens) & ~jnp.all(done)

  def body(carry):
    i, logits, cache, out_tokens, out_logp, done, hit_eos = carry
    token, logp = draw(logits, jax.vmap(jax.random.fold_in, (0, None))(keys, i))
    token = jnp.where(done, pad_id, token)
    out_tokens = out_tokens.at[:, i].set(token)
    out_logp = out_logp.at[:, i].set(jnp.where(done, 0.0, logp))
    hidden, cache = model.extend(token[:, None], cache, num_new=(~done).astype(jnp.int32))
    logits = jnp.where(done[:, None], logits, model.logits_from_hidden(hidden[:, 0]))
    is_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1) & ~done
    hit_eos = hit_eos | is_eos
    done = done | is_eos | (cache.lengths - start >= limits)
    return i + 1, logits, cache, out_tokens, out_logp, done, hit_eos

  done = ~active | (limits <= 0)
  carry = (jnp.int32(0), logits, cache, jnp.full((batch, max_tokens), pad_id, jnp.int32),
           jnp.zeros((batch, max_tokens), jnp.float32), done, jnp.zeros((batch,), bool))
  _, logits, cache, tokens, logp, _, hit_eos = jax.lax.while_loop(cond, body, carry)
  return tokens, logp, cache.lengths - start, hit_eos, cache, logits


def _bucket(n: int, cap: int) -> int:
  return min(cap, max(8, 1 << max(0, n - 1).bit_length()))


# -- the engine --------------------------------------------------------------------------------------------


def run_episodes(model: Transformer, tokenizer, envs: Sequence[Environment], seeds: Sequence[int],
                 settings: EpisodeSettings, rng: jax.Array, batch_size: int | None = None) -> list[Episode]:
  """Plays one episode per environment, ``batch_size`` at a time, and returns them in input order.

  Args:
    model: the policy.
    tokenizer: encodes prompts (:func:`lemon_rl.text.encode_prompt`, BOS when it has one) and observations
      (``tokenizer.encode``, no BOS), decodes actions; ``eos_ids`` end an action, ``pad_id`` pads.
    envs: ``N`` environments, one per episode (each is reset once; the same object may not appear twice).
    seeds: ``N`` seeds for ``reset``.
    settings: limits, terminal rewards and sampling.
    rng: a PRNG key; episode ``i``'s randomness is derived from ``(rng, i)`` alone.
    batch_size: ``B``, rows of the KV cache (default ``N``).

  Returns:
    ``N`` :class:`Episode` records.
  """
  if len(envs) != len(seeds):
    raise ValueError(f"{len(envs)} environments but {len(seeds)} seeds")
  if len({id(e) for e in envs}) != len(envs):
    raise ValueError("each episode needs its own environment object")
  n = len(envs)
  if n == 0:
    return []
  b = min(batch_size or n, n)
  cfg = settings
  graphdef, state = nnx.split(model)
  cache = model.init_cache(b, cfg.num_slots + cfg.chunk_size)
  logits = jnp.zeros((b, model.cfg.vocab_size), jnp.float32)
  eos = jnp.asarray(eos_array(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,))))
  pad_id = jnp.int32(tokenizer.pad_id)
  rows: list[_Running | None] = [None] * b
  lengths = np.zeros(b, np.int64)  # host mirror of cache.lengths
  results: list[Episode | None] = [None] * n
  next_episode = 0
  pending: dict[int, list[int]] = {}  # row -> ids to append before its next action
  reset_rows: set[int] = set()

  def start(row: int) -> None:
    """Starts pending episodes in ``row`` until one is running (or none is left)."""
    nonlocal next_episode
    while next_episode < n:
      i, next_episode = next_episode, next_episode + 1
      ep = _Running(i, int(seeds[i]), envs[i])
      try:
        text = envs[i].reset(int(seeds[i]))
        if not isinstance(text, str):
          raise TypeError(f"reset returned {type(text).__name__}, not str")
        ids = encode_prompt(tokenizer, text)
        if not ids:
          raise ValueError("the first observation encodes to no tokens")
      except Exception as e:  # pylint: disable=broad-except  # isolated per episode
        results[i] = ep.finish(FinishStatus.ENV_ERROR, cfg.max_turns, cfg.env_error_reward, repr(e))
        continue
      ep.add_observation(text, ids)
      ep.prompt_length = len(ids)
      if len(ids) > cfg.num_slots:
        results[i] = ep.finish(FinishStatus.CONTEXT_FULL, cfg.max_turns, cfg.context_full_reward)
        continue
      rows[row] = ep
      pending[row] = ids
      reset_rows.add(row)
      return

  def end(row: int, status: FinishStatus, extra: float | None = None, error: str | None = None) -> None:
    ep = rows[row]
    results[ep.index] = ep.finish(status, cfg.max_turns, extra, error)
    rows[row] = None

  for row in range(b):
    start(row)

  while any(r is not None for r in rows):
    # 1. Append prompts of new episodes and observations, in chunks of at most chunk_size tokens.
    if pending:
      longest = max(len(v) for v in pending.values())
      for c in range(0, longest, cfg.chunk_size):
        counts = np.asarray([len(pending.get(r, ())[c:c + cfg.chunk_size]) for r in range(b)], np.int32)
        width = _bucket(int(counts.max()), cfg.chunk_size)
        chunk = np.full((b, width), tokenizer.pad_id, np.int32)
        for r, ids in pending.items():
          piece = ids[c:c + cfg.chunk_size]
          chunk[r, :len(piece)] = piece
        reset = np.asarray([c == 0 and r in reset_rows for r in range(b)])
        cache, logits = _append(graphdef, state, cache, logits, jnp.asarray(chunk), jnp.asarray(counts),
                                jnp.asarray(reset))
      for r, ids in pending.items():
        lengths[r] = (0 if r in reset_rows else lengths[r]) + len(ids)
      pending.clear()
      reset_rows.clear()

    # 2. One action per active row.
    active = np.asarray([r is not None for r in rows])
    limits = np.where(active, np.minimum(cfg.max_action_tokens, cfg.num_slots - lengths), 0).astype(np.int32)
    episode_ids = np.asarray([r.index if r is not None else 0 for r in rows], np.int32)
    turns = np.asarray([r.num_turns if r is not None else 0 for r in rows], np.int32)
    keys = _turn_keys(rng, jnp.asarray(episode_ids), jnp.asarray(turns))
    tokens, logp, generated, hit_eos, cache, logits = _act(
        graphdef, state, cache, logits, keys, jnp.asarray(active), jnp.asarray(limits), eos, pad_id,
        max_tokens=cfg.max_action_tokens, sampling=cfg.sampling)
    tokens, logp, generated, hit_eos = jax.device_get((tokens, logp, generated, hit_eos))

    # 3. Step the environments (host), decide who ends, queue observations.
    for row in range(b):
      ep = rows[row]
      if ep is None:
        continue
      k = int(generated[row])
      ids = tokens[row, :k].tolist()
      lengths[row] += k
      if not hit_eos[row] and lengths[row] >= cfg.num_slots:
        if k:  # an empty "action" (no room at all) is not a turn
          ep.add_action(ids, logp[row, :k], decode_completion(tokenizer, ids), "context")
        end(row, FinishStatus.CONTEXT_FULL, cfg.context_full_reward)
        continue
      text = decode_completion(tokenizer, ids)
      ep.add_action(ids, logp[row, :k], text, "eos" if hit_eos[row] else "length")
      try:
        result = ep.env.step(text)
        if not isinstance(result, StepResult):
          result = StepResult(*result)
        reward = float(result.reward)
        if not isinstance(result.observation, str) or not math.isfinite(reward):
          raise TypeError(f"invalid step result {result!r:.200}")
      except InvalidAction as e:
        end(row, FinishStatus.INVALID_ACTION, cfg.invalid_action_reward, str(e))
        continue
      except Exception as e:  # pylint: disable=broad-except  # isolated per episode
        end(row, FinishStatus.ENV_ERROR, cfg.env_error_reward, repr(e))
        continue
      ep.turn_rewards.append(reward)
      ep.infos.append(dict(result.info or {}))
      if result.done:
        ep.final_observation = result.observation
        end(row, finish_status(result))
        continue
      if ep.num_turns >= cfg.max_turns:
        ep.final_observation = result.observation
        end(row, FinishStatus.BUDGET_EXHAUSTED)
        continue
      try:
        obs_ids = list(tokenizer.encode(result.observation))
      except Exception as e:  # pylint: disable=broad-except
        end(row, FinishStatus.ENV_ERROR, cfg.env_error_reward, repr(e))
        continue
      if lengths[row] + len(obs_ids) > cfg.num_slots:
        ep.final_observation = result.observation
        end(row, FinishStatus.CONTEXT_FULL, cfg.context_full_reward)
        continue
      ep.add_observation(result.observation, obs_ids)
      if obs_ids:
        pending[row] = obs_ids

    # 4. Refill finished rows (or, without refill, only once the whole batch has finished).
    if cfg.refill or all(r is None for r in rows):
      for row in range(b):
        if rows[row] is None:
          start(row)

  return results  # type: ignore[return-value]


def episodes_to_batch(episodes: Sequence[Episode], pad_id: int, length: int | None = None) -> dict[str, np.ndarray]:
  """Right-padded training arrays of episodes.

  Returns ``ids``, ``attention_mask`` ``[N, T]`` and the next-token arrays ``loss_mask`` (float32),
  ``sampler_logp``, ``turn_index`` ``[N, T-1]`` (column ``j`` scores ``ids[:, j + 1]``). ``T`` is the
  longest episode (at least 2) unless ``length`` is given (longer episodes raise).
  """
  longest = max(len(e.token_ids) for e in episodes)
  t = max(2, longest) if length is None else int(length)
  if longest > t:
    raise ValueError(f"an episode of {longest} tokens does not fit length={t}")
  n = len(episodes)
  ids = np.full((n, t), pad_id, np.int32)
  attn = np.zeros((n, t), np.int32)
  loss = np.zeros((n, t), np.float32)
  logp = np.zeros((n, t), np.float32)
  turn = np.zeros((n, t), np.int32)
  for i, e in enumerate(episodes):
    k = len(e.token_ids)
    ids[i, :k], attn[i, :k], loss[i, :k] = e.token_ids, 1, e.loss_mask
    logp[i, :k], turn[i, :k] = e.log_probs, e.turn_index
  return {"ids": ids, "attention_mask": attn, "loss_mask": loss[:, 1:], "sampler_logp": logp[:, 1:],
          "turn_index": turn[:, 1:]}
