"""Multi-turn RL: one trainer step over groups of episodes, with GRPO, GiGPO or PPO (METHODS.md section 5).

A step takes ``P`` :class:`Group` s (one task each: ``G`` fresh environments, their reset seeds and the group's
turn budget ``B``), plays the ``P * G`` episodes with :func:`lemon_rl.training.multiturn.run_episodes` (token
in, token out; one KV cache across turns), lays them out with :func:`~lemon_rl.training.multiturn.
episodes_to_batch`, computes per-token advantages and updates through :func:`lemon_rl.training.state.
update_step` with the shared clipped surrogate (:class:`lemon_rl.training.rl.PolicyLoss`, which takes per-token
advantages ``[N, T-1]``). Advantages are non-zero only on action tokens (the loss mask), so observation and
prompt tokens get exactly zero gradient.

Rewards. The outcome reward of an episode is its total reward, except that an episode that did not finish
within its budget (status ``budget_exhausted``) gets ``R = 0`` whatever its turns earned (BudgetMix's "reward 0
on overrun"); the per-turn rewards of such an episode are zeroed too, so that GiGPO's step returns and PPO's GAE
see the same outcome. A malformed action ends the episode with the engine's ``invalid_action_reward``.
*Decision*: episodes that ended with ``env_error`` (the environment crashed; they say nothing about the policy)
are dropped from every statistic and get advantage 0 (``drop_env_errors``).

Budgets. Every environment is wrapped in :class:`TurnBudget`, which ends its episode after ``B`` actions with
status ``budget_exhausted``, so groups with different budgets share one engine call (whose ``max_turns`` is the
largest budget). The remaining budget before action ``t`` is ``B - t`` with the group's ``B``.

Estimators (``MultiTurnRLSettings.estimator``), each a per-turn advantage ``A[n, t]`` put on the action tokens of
turn ``t`` (``out[n, j] = A[n, turn_index[n, j]] * loss_mask[n, j]``):

- ``grpo``: ``A[n, t] = (R_n - mean_g R) / (std_g R + eps)`` (:func:`lemon_rl.losses.grpo`), the same on every
  turn of the episode.
- ``gigpo``: :func:`lemon_rl.losses.gigpo` with the turn rewards as step rewards and anchor ids from the key
  ``(anchor_state(o_t), B - t)`` (``budget_in_anchor``; plain GiGPO keys on ``anchor_state(o_t)`` alone), where
  ``o_t`` is the observation shown before action ``t`` and ``anchor_state`` maps it to the environment state
  (default :func:`observation_anchor`: the text without its budget counters). Keys become integer ids on the
  host; ``gigpo`` forms step groups within each group.
- ``ppo``: a value head (``ModelConfig(value_head=True)``) read at the position predicting each turn's first
  action token (:func:`lemon_rl.losses.value.token_values_to_steps`), so the critic sees the whole history and
  the budget in the prompt; turn-level GAE (:func:`lemon_rl.losses.value.gae`, terminal after the last turn),
  whitened over the batch's turns, and :class:`ValuePolicyLoss` = policy loss + ``value_coef`` * clipped value
  loss.

Updates: ``num_iterations`` full-batch updates per step (old log-probs are recorded when there is more than one),
each split into ``num_microbatches`` with exact gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lemon_rl import ops
from lemon_rl.envs.protocol import Environment, FinishStatus, StepResult
from lemon_rl.losses import advantages as advantages_lib
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.losses import value as value_lib
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.multiturn import Episode, EpisodeSettings, episodes_to_batch, run_episodes
from lemon_rl.training.rl import PolicyLoss
from lemon_rl.training.state import TrainState

ESTIMATORS = ("grpo", "gigpo", "ppo")

AnchorState = Callable[[str], Hashable]


# -- budgets and rewards ---------------------------------------------------------------------------------


class TurnBudget:
  """Wraps an environment so that its episode ends after ``budget`` actions (status ``budget_exhausted``).

  The step that spends the last turn keeps its reward and observation; if the environment did not say ``done``
  itself, the wrapper does, with ``info["status"] = "budget_exhausted"`` and ``info["success"] = False``. An
  environment that enforces the same budget itself (FrozenLake's ``max_turns``) ends first; the wrapper then
  passes its result through.
  """

  def __init__(self, env: Environment, budget: int):
    if budget < 1:
      raise ValueError(f"budget must be >= 1, got {budget}")
    self.env, self.budget, self.turn = env, int(budget), 0

  def reset(self, seed: int) -> str:
    self.turn = 0
    return self.env.reset(seed)

  def step(self, action_text: str) -> StepResult:
    result = self.env.step(action_text)
    if not isinstance(result, StepResult):
      result = StepResult(*result)
    self.turn += 1
    if result.done or self.turn < self.budget:
      return result
    info = dict(result.info or {}, status=FinishStatus.BUDGET_EXHAUSTED.value, success=False)
    return StepResult(result.observation, result.reward, True, info)


def episode_reward(episode: Episode) -> float:
  """The outcome reward ``R``: ``total_reward``, or 0 when the episode ran out of its turn budget."""
  return 0.0 if episode.status == FinishStatus.BUDGET_EXHAUSTED else float(episode.total_reward)


class TurnTables(NamedTuple):
  """Per-turn arrays of ``N`` episodes, left-aligned over ``K`` turn slots (numpy).

  Attributes:
    episode_rewards: ``[N]`` float32 outcome reward ``R`` (:func:`episode_reward`).
    step_rewards: ``[N, K]`` float32 reward of each turn (all 0 on an overrun, see the module docstring).
    step_mask: ``[N, K]`` float32, 1 on the turns that happened in valid episodes.
    remaining: ``[N, K]`` int32 remaining budget ``B - t`` before action ``t`` (0 on masked turns).
    valid: ``[N]`` bool, the episodes that count (all but dropped ``env_error`` ones).
  """

  episode_rewards: np.ndarray
  step_rewards: np.ndarray
  step_mask: np.ndarray
  remaining: np.ndarray
  valid: np.ndarray


def turn_tables(episodes: Sequence[Episode], budgets: Sequence[int], num_turns: int,
                drop_env_errors: bool = True) -> TurnTables:
  """Builds :class:`TurnTables` for episodes played under per-episode ``budgets`` in ``num_turns`` slots."""
  n = len(episodes)
  step_rewards = np.zeros((n, num_turns), np.float32)
  step_mask = np.zeros((n, num_turns), np.float32)
  remaining = np.zeros((n, num_turns), np.int32)
  valid = np.ones((n,), bool)
  for i, (ep, budget) in enumerate(zip(episodes, budgets, strict=True)):
    k = ep.num_turns
    if k > min(num_turns, budget):
      raise ValueError(f"episode {i} took {k} turns: more than its budget {budget} or the {num_turns} slots")
    if len(ep.turn_rewards) != k:
      raise ValueError(f"episode {i} has {len(ep.turn_rewards)} turn rewards for {k} turns")
    if ep.status != FinishStatus.BUDGET_EXHAUSTED:
      step_rewards[i, :k] = ep.turn_rewards
    step_mask[i, :k] = 1.0
    remaining[i, :k] = budget - np.arange(k)
    valid[i] = not (drop_env_errors and ep.status == FinishStatus.ENV_ERROR)
  step_mask *= valid[:, None]
  rewards = np.asarray([episode_reward(ep) for ep in episodes], np.float32)
  return TurnTables(rewards, step_rewards, step_mask, remaining, valid)


# -- GiGPO anchors ---------------------------------------------------------------------------------------

_BUDGET_COUNTER = re.compile(r"\[(?:MAX TURNS|CURRENT TURN|REMAINING TURNS)\][ \t]*\d+")


def observation_anchor(observation: str) -> str:
  """The observation text without its budget counters (``[MAX TURNS] n`` etc.), whitespace-normalised.

  verl-agent keys GiGPO's step groups on the observation text; with a budget-aware prompt the counters would
  make every turn's text distinct, so they are removed here and the remaining budget is added to the key
  explicitly when wanted (``budget_in_anchor``).
  """
  return " ".join(_BUDGET_COUNTER.sub(" ", observation).split())


def anchor_ids(observations: Sequence[Sequence[str]], step_mask: np.ndarray, remaining: np.ndarray | None = None,
               anchor_state: AnchorState = observation_anchor) -> np.ndarray:
  """Integer anchor ids ``[N, K]`` of the keys ``(anchor_state(o_t), B - t)`` (or ``anchor_state(o_t)``).

  Args:
    observations: per episode, the observation shown before each action (``Episode.observations``).
    step_mask: ``[N, K]`` 1 on the turns to key (others get id 0, which :func:`~lemon_rl.losses.gigpo` ignores).
    remaining: ``[N, K]`` remaining budget ``B - t`` to add to the key; ``None`` keys on the state alone.
    anchor_state: observation text -> hashable state.

  Returns:
    ``[N, K]`` int32: equal ids exactly where the keys are equal (ids are dense, in first-seen order).
  """
  mask = np.asarray(step_mask) != 0
  ids = np.zeros(mask.shape, np.int32)
  table: dict[Hashable, int] = {}
  for n, t in zip(*np.nonzero(mask)):
    key = anchor_state(observations[n][t])
    if remaining is not None:
      key = (key, int(remaining[n, t]))
    ids[n, t] = table.setdefault(key, len(table))
  return ids


# -- jitted advantage pieces (one compile each instead of many eager ops) ----------------------------

_grpo_jit = jax.jit(advantages_lib.grpo, static_argnames=("num_groups", "eps", "scale_by_std"))
_gigpo_jit = jax.jit(advantages_lib.gigpo, static_argnames=("num_groups", "gamma", "omega", "eps", "scale_by_std"))
_steps_to_tokens = jax.jit(value_lib.steps_to_tokens)


@functools.partial(jax.jit, static_argnames=("num_turns", "gamma", "lam", "whiten", "eps"))
def _ppo_targets(token_values, loss_mask, turn_index, step_rewards, step_mask, *, num_turns: int, gamma: float,
                 lam: float, whiten: bool, eps: float):
  """PPO's per-turn ``(advantages, old values, returns)`` ``[N, K]`` from the sampling policy's values."""
  old = value_lib.token_values_to_steps(token_values, loss_mask, turn_index, num_turns).values
  adv, returns = value_lib.gae(step_rewards, old, step_mask, gamma=gamma, lam=lam)
  if whiten:
    adv = value_lib.whiten_advantages(adv, step_mask, eps=eps)
  return adv, jnp.where(step_mask > 0, old, 0.0), returns


def gigpo_turn_advantages(episodes: Sequence[Episode], tables: TurnTables, group_ids: np.ndarray, num_groups: int,
                          *, anchor_state: AnchorState = observation_anchor, budget_in_anchor: bool = True,
                          gamma: float = 0.95, omega: float = 1.0, eps: float = advantages_lib.DEFAULT_EPS,
                          scale_by_std: bool = True) -> tuple[advantages_lib.GiGPOAdvantages, np.ndarray]:
  """GiGPO's per-turn advantages of played episodes: :func:`anchor_ids` then :func:`lemon_rl.losses.gigpo`.

  The key of turn ``t`` of episode ``n`` is ``(anchor_state(o_t), B_n - t)`` with ``budget_in_anchor`` (the
  BudgetMix anchor: the same state with a different remaining budget is a different step group), else
  ``anchor_state(o_t)``; step groups never cross groups (``gigpo`` keys on the group id too).

  Args:
    episodes: ``N`` episodes (their ``observations`` give the states).
    tables: their :func:`turn_tables` (rewards, step mask, remaining budgets, valid rows).
    group_ids: ``[N]`` int group of each episode; ``num_groups``: the number of groups.
    anchor_state, budget_in_anchor: the key (above).
    gamma, omega, eps, scale_by_std: :func:`lemon_rl.losses.gigpo`'s.

  Returns:
    ``(GiGPOAdvantages, anchor ids [N, K])``.
  """
  ids = anchor_ids([ep.observations for ep in episodes], tables.step_mask,
                   tables.remaining if budget_in_anchor else None, anchor_state)
  out = _gigpo_jit(jnp.asarray(tables.episode_rewards), jnp.asarray(tables.step_rewards),
                   jnp.asarray(tables.step_mask), jnp.asarray(ids), jnp.asarray(group_ids, jnp.int32),
                   num_groups=num_groups, gamma=gamma, omega=omega, eps=eps, scale_by_std=scale_by_std,
                   valid=jnp.asarray(tables.valid))
  return jax.device_get(out), ids


# -- the PPO loss ----------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef",))
def token_values(graphdef, params, ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """``[N, T-1]`` value head at every next-token position (column ``j`` is read at ``ids[:, j]``)."""
  model = nnx.merge(graphdef, params)
  return model.value_from_hidden(model.hidden_states(ids, attention_mask)[:, :-1])


@dataclasses.dataclass(frozen=True)
class ValuePolicyLoss:
  """PPO's loss with a value head sharing the policy's trunk: ``L = L_pi + value_coef * L_V`` (one forward).

  ``L_pi`` is :class:`~lemon_rl.training.rl.PolicyLoss` on the batch's per-token advantages; ``L_V`` is
  :func:`lemon_rl.losses.value.clipped_value_loss` over the valid turns (``token_mean``: the mean over the
  batch's turns) of ``V(s_t)`` read at the position predicting each turn's first action token. The two means
  have different denominators, so the batch carries them (``loss_denominators [M, 3]``: the policy term's and
  the value term's whole-batch denominators and ``1 / M``, one row per micro-batch) and the micro-batch pieces
  add up to the whole-batch loss and gradient exactly (as FEST's combined loss does).

  Batch: ``ids``, ``attention_mask`` ``[N, T]``; ``loss_mask``, ``turn_index``, ``advantages`` ``[N, T-1]``;
  ``old_values``, ``returns``, ``step_mask`` ``[N, K]``; ``loss_denominators``; optional ``old_logp``,
  ``ref_logp``, ``sampler_logp`` as :class:`PolicyLoss` reads them.
  """

  policy: PolicyLoss
  num_turns: int
  value_coef: float = 0.5
  value_clip: float | None = 0.5

  def __call__(self, model: nnx.Module, batch: Mapping[str, jax.Array]):
    hidden = model.hidden_states(batch["ids"], batch["attention_mask"])[:, :-1]
    return self.loss_from_outputs(model.logits_from_hidden(hidden), model.value_from_hidden(hidden), batch)

  def loss_from_outputs(self, logits: jax.Array, values: jax.Array, batch: Mapping[str, jax.Array]):
    """The loss from next-token ``logits [N, T-1, V]`` and per-position ``values [N, T-1]``."""
    policy, metrics = self.policy.loss_from_logits(logits, batch)
    steps = value_lib.token_values_to_steps(values, batch["loss_mask"], batch["turn_index"], self.num_turns)
    value, value_metrics = value_lib.clipped_value_loss(steps.values, batch["old_values"], batch["returns"],
                                                        batch["step_mask"], clip_range=self.value_clip)
    den = batch["loss_denominators"][0]
    total = ops.sum_of_means([policy, value], [1.0, self.value_coef], [den[0], den[1]])
    metrics = dict(metrics, policy_loss=jax.lax.stop_gradient(policy), value_loss=jax.lax.stop_gradient(value))
    metrics.update({f"value/{k}": v for k, v in value_metrics.items()})
    return ops.WeightedMetric(total, den[2]), metrics


# -- the trainer -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Group:
  """One task's episodes of a step: ``G`` fresh environments, their reset seeds and the turn budget ``B``.

  Attributes:
    envs: ``G`` environments (distinct objects) of the same task; each shows ``budget`` in its prompt if the
      policy is to be budget-aware (the environment's job).
    seeds: ``G`` reset seeds.
    budget: the group's turn budget ``B`` (every episode of the group gets it).
    t_max: the task's full budget ``T_max`` (optional; only for the ``budget/fraction_of_t_max`` metric).
  """

  envs: Sequence[Environment]
  seeds: Sequence[int]
  budget: int
  t_max: int | None = None


@dataclasses.dataclass(frozen=True)
class MultiTurnRLSettings:
  """The multi-turn RL step.

  Attributes:
    episode: the engine's settings; its ``max_turns`` is the largest budget a group may have (``K``, the turn
      slots of the per-turn arrays); each step runs the engine with the largest budget of its groups.
    estimator: ``grpo``, ``gigpo`` or ``ppo``.
    batch_size: rows of the engine's KV cache (``None``: all episodes at once).
    eps: added to group standard deviations.
    scale_by_std: divide group deviations by the std (GRPO, GiGPO's ``F_norm``); ``False`` = mean only.
    gigpo_gamma: GiGPO's step-return discount (0.95).
    omega: GiGPO's step-advantage weight (1.0).
    budget_in_anchor: GiGPO anchor key ``(s_t, B - t)`` (BudgetMix) instead of ``s_t``.
    gae_gamma, gae_lambda: PPO's GAE discount and lambda (1.0, 1.0: verl's defaults; the sparse outcome reward
      is then the return of every turn).
    whiten_advantages: normalise PPO's turn advantages over the batch's valid turns.
    value_coef: weight of the value loss in PPO's total loss (0.5).
    value_clip: PPO's value clip range (0.5, the paper's; ``None``: unclipped).
    drop_env_errors: give ``env_error`` episodes no weight (module docstring).
    num_iterations: full-batch updates per step.
    num_microbatches: gradient-accumulation slices of each update (must divide ``P * G``).
    length_multiple: the batch's sequence length is padded up to a multiple of this (fewer compiled shapes).
  """

  episode: EpisodeSettings
  estimator: str = "grpo"
  batch_size: int | None = None
  eps: float = advantages_lib.DEFAULT_EPS
  scale_by_std: bool = True
  gigpo_gamma: float = 0.95
  omega: float = 1.0
  budget_in_anchor: bool = True
  gae_gamma: float = 1.0
  gae_lambda: float = 1.0
  whiten_advantages: bool = True
  value_coef: float = 0.5
  value_clip: float | None = 0.5
  drop_env_errors: bool = True
  num_iterations: int = 1
  num_microbatches: int = 1
  length_multiple: int = 64

  def __post_init__(self):
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
    if self.num_iterations < 1 or self.num_microbatches < 1 or self.length_multiple < 1:
      raise ValueError(f"num_iterations, num_microbatches and length_multiple must be >= 1: {self}")


@dataclasses.dataclass
class MultiTurnRollout:
  """One step's episodes and what the update needs (numpy; ``N = P * G`` rows, group-major).

  Attributes:
    episodes: the ``N`` played episodes.
    group_ids: ``[N]`` int32 group of each episode.
    budgets: ``[P]`` int32 budget of each group.
    tables: the per-turn arrays (:class:`TurnTables`).
    turn_advantages: ``[N, K]`` float32 advantage of each turn (before it is put on the tokens).
    batch: the update's arrays: ``ids``, ``attention_mask`` ``[N, T]``; ``loss_mask``, ``turn_index``,
      ``advantages`` (per token) ``[N, T-1]``; PPO adds ``old_values``, ``returns``, ``step_mask`` ``[N, K]``
      and ``loss_denominators``; optional ``old_logp`` / ``ref_logp`` / ``sampler_logp``.
    metrics: episode, budget and advantage scalars.
  """

  episodes: list[Episode]
  group_ids: np.ndarray
  budgets: np.ndarray
  tables: TurnTables
  turn_advantages: np.ndarray
  batch: dict[str, np.ndarray]
  metrics: dict[str, float]


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
  x = np.asarray(x, np.float64)
  if not x.size:
    return {}
  return {f"{prefix}/mean": float(x.mean()), f"{prefix}/std": float(x.std()), f"{prefix}/min": float(x.min()),
          f"{prefix}/max": float(x.max())}


def episode_metrics(episodes: Sequence[Episode], rewards: np.ndarray, budgets: Sequence[int],
                    t_maxes: Sequence[int | None] = ()) -> dict[str, float]:
  """Success rate, reward, turns, tokens and status shares of the episodes; the groups' budgets."""
  status = [ep.status for ep in episodes]
  metrics = {
      "episode/reward_mean": float(np.mean(rewards)),
      "episode/success_rate": float(np.mean([s == FinishStatus.SUCCESS for s in status])),
      "episode/turns_mean": float(np.mean([ep.num_turns for ep in episodes])),
      "episode/turns_max": float(max(ep.num_turns for ep in episodes)),
      "episode/tokens_mean": float(np.mean([len(ep.token_ids) for ep in episodes])),
      "episode/action_tokens_mean": float(np.mean([ep.loss_mask.sum() for ep in episodes])),
  }
  metrics.update({f"episode/status/{s.value}": float(np.mean([x == s for x in status])) for s in FinishStatus})
  b = np.asarray(budgets, np.float64)
  metrics.update({"budget/mean": float(b.mean()), "budget/min": float(b.min()), "budget/max": float(b.max()),
                  "budget/distinct": float(len(set(budgets)))})
  fractions = [bi / t for bi, t in zip(budgets, t_maxes) if t]
  if fractions:
    metrics["budget/fraction_of_t_max"] = float(np.mean(fractions))
  return metrics


class MultiTurnTrainer:
  """Holds what is fixed during multi-turn RL (graph, optimizer, tokenizer, loss, settings); state is passed in.

  Args:
    graphdef: the policy's graph (``state_lib.create_train_state``); a value head for ``ppo``.
    optimizer: the optax optimizer of ``state``.
    tokenizer: the engine's tokenizer (prompts, observations, actions).
    loss: the clipped surrogate (its ``sampling`` must be the engine's ``episode.sampling``).
    settings: :class:`MultiTurnRLSettings`.
    anchor_state: GiGPO's observation -> state map (default :func:`observation_anchor`).
    ref_params: frozen reference parameters, needed when ``loss.kl_coef > 0``.
  """

  def __init__(self, graphdef, optimizer: optax.GradientTransformation, tokenizer, loss: PolicyLoss,
               settings: MultiTurnRLSettings, anchor_state: AnchorState = observation_anchor, ref_params: Any = None):
    if loss.sampling != settings.episode.sampling:
      raise ValueError(f"the loss scores tokens under {loss.sampling}, the engine samples under "
                       f"{settings.episode.sampling}: they must be the same distribution")
    if loss.kl_coef and ref_params is None:
      raise ValueError("kl_coef > 0 needs a frozen reference model (ref_params)")
    self.graphdef, self.optimizer, self.tokenizer = graphdef, optimizer, tokenizer
    self.loss, self.settings, self.anchor_state = loss, settings, anchor_state
    self.ref_params = ref_params if loss.kl_coef else None
    self.num_turns = settings.episode.max_turns
    self.update_loss = loss if settings.estimator != "ppo" else ValuePolicyLoss(
        loss, self.num_turns, settings.value_coef, settings.value_clip)
    self._estimators = {"grpo": self._grpo, "gigpo": self._gigpo, "ppo": self._ppo}

  # Advantages: each returns (turn advantages [N, K], batch additions, metrics).

  def _grpo(self, state, tables: TurnTables, episodes, group_ids, num_groups, batch):
    cfg = self.settings
    adv = _grpo_jit(jnp.asarray(tables.episode_rewards), jnp.asarray(group_ids), num_groups=num_groups,
                    eps=cfg.eps, scale_by_std=cfg.scale_by_std, valid=jnp.asarray(tables.valid))
    return np.asarray(adv)[:, None] * tables.step_mask, {}, {}

  def _gigpo(self, state, tables: TurnTables, episodes, group_ids, num_groups, batch):
    cfg = self.settings
    out, ids = gigpo_turn_advantages(episodes, tables, group_ids, num_groups, anchor_state=self.anchor_state,
                                     budget_in_anchor=cfg.budget_in_anchor, gamma=cfg.gigpo_gamma, omega=cfg.omega,
                                     eps=cfg.eps, scale_by_std=cfg.scale_by_std)
    mask = tables.step_mask > 0
    sizes = np.asarray(out.step_group_size)[mask]
    metrics = {"gigpo/step_group_size_mean": float(sizes.mean()) if sizes.size else 0.0,
               "gigpo/singleton_share": float(np.mean(sizes == 1)) if sizes.size else 0.0,
               "gigpo/anchor_keys": float(len(np.unique(ids[mask]))) if sizes.size else 0.0}
    metrics.update(_stats("gigpo/episode_advantage", np.asarray(out.episode)[tables.valid]))
    metrics.update(_stats("gigpo/step_advantage", np.asarray(out.step)[mask]))
    return np.asarray(out.advantages), {}, metrics

  def _ppo(self, state, tables: TurnTables, episodes, group_ids, num_groups, batch):
    cfg = self.settings
    n, m = batch["ids"].shape[0], cfg.num_microbatches
    if n % m:
      raise ValueError(f"{n} episodes do not split into num_microbatches={m}")
    values = token_values(self.graphdef, state.params, jnp.asarray(batch["ids"]),
                          jnp.asarray(batch["attention_mask"]))
    adv, old, returns = jax.device_get(_ppo_targets(
        values, jnp.asarray(batch["loss_mask"]), jnp.asarray(batch["turn_index"]),
        jnp.asarray(tables.step_rewards), jnp.asarray(tables.step_mask), num_turns=self.num_turns,
        gamma=cfg.gae_gamma, lam=cfg.gae_lambda, whiten=cfg.whiten_advantages, eps=cfg.eps))
    aggregation = pg.resolve_surrogate_options(self.loss.policy_loss, eps_low=self.loss.eps_low,
                                               eps_high=self.loss.eps_high, aggregation=self.loss.aggregation,
                                               dual_clip=self.loss.dual_clip).aggregation
    mask = jnp.asarray(batch["loss_mask"])
    dens = np.array([float(pg.aggregate(jnp.zeros_like(mask), mask, aggregation,
                                        max_len=self.loss.max_len).denominator),
                     float(tables.step_mask.sum()), 1.0 / m], np.float32)
    extra = {"old_values": old, "returns": returns, "step_mask": tables.step_mask,
             "loss_denominators": np.tile(dens, (m, 1))}
    valid = tables.step_mask > 0
    metrics = _stats("value/old", old[valid])
    metrics.update(_stats("value/return", returns[valid]))
    if valid.any() and np.var(returns[valid]) > 0:  # 1 - Var(R - V) / Var(R), population variances.
      metrics["value/explained_variance"] = float(1.0 - np.var((returns - old)[valid]) / np.var(returns[valid]))
    return adv, extra, metrics

  # Rollout, update, step.

  def rollout(self, state: TrainState, groups: Sequence[Group]) -> MultiTurnRollout:
    """Plays the groups' episodes with the current policy and computes the update's arrays."""
    cfg = self.settings
    envs, seeds, budgets, group_ids = [], [], [], []
    for g, group in enumerate(groups):
      if not group.envs or len(group.envs) != len(group.seeds):
        raise ValueError(f"group {g}: {len(group.envs)} environments and {len(group.seeds)} seeds")
      if not 1 <= group.budget <= self.num_turns:
        raise ValueError(f"group {g}: budget {group.budget} outside [1, episode.max_turns={self.num_turns}]")
      for env, seed in zip(group.envs, group.seeds):
        envs.append(TurnBudget(env, group.budget))
        seeds.append(int(seed))
        budgets.append(int(group.budget))
        group_ids.append(g)
    group_ids = np.asarray(group_ids, np.int32)
    group_budgets = np.asarray([group.budget for group in groups], np.int32)
    t0 = time.perf_counter()
    episodes = run_episodes(nnx.merge(self.graphdef, state.params), self.tokenizer, envs, seeds,
                            dataclasses.replace(cfg.episode, max_turns=int(max(budgets))),
                            state_lib.step_key(state, 0), batch_size=cfg.batch_size)
    t1 = time.perf_counter()
    longest = max(2, max(len(ep.token_ids) for ep in episodes))
    full = episodes_to_batch(episodes, self.tokenizer.pad_id, _round_up(longest, cfg.length_multiple))
    batch = {k: full[k] for k in ("ids", "attention_mask", "loss_mask", "turn_index")}
    tables = turn_tables(episodes, budgets, self.num_turns, cfg.drop_env_errors)
    turn_adv, extra, metrics = self._estimators[cfg.estimator](state, tables, episodes, group_ids, len(groups),
                                                               batch)
    turn_adv = np.asarray(turn_adv, np.float32) * tables.step_mask
    batch["advantages"] = np.asarray(_steps_to_tokens(jnp.asarray(turn_adv), jnp.asarray(batch["loss_mask"]),
                                                      jnp.asarray(batch["turn_index"])))
    batch.update(extra)
    ids, attn = jnp.asarray(batch["ids"]), jnp.asarray(batch["attention_mask"])
    if cfg.num_iterations > 1:
      batch["old_logp"] = np.asarray(rollout_lib.sequence_token_log_probs(self.graphdef, state.params, ids, attn,
                                                                          self.loss.sampling))
    if self.ref_params is not None:
      batch["ref_logp"] = np.asarray(rollout_lib.sequence_token_log_probs(self.graphdef, self.ref_params, ids,
                                                                          attn, self.loss.sampling))
    if self.loss.tis_cap:
      batch["sampler_logp"] = full["sampler_logp"]

    metrics.update(episode_metrics(episodes, tables.episode_rewards, group_budgets.tolist(),
                                   [group.t_max for group in groups]))
    metrics.update(rollout_lib.group_statistics(tables.episode_rewards[tables.valid], group_ids[tables.valid]))
    action = batch["loss_mask"] > 0
    metrics.update(_stats("advantage", batch["advantages"][action]))
    metrics.update(_stats("turn_advantage", turn_adv[tables.step_mask > 0]))
    metrics.update({"time/episodes_s": t1 - t0, "time/advantages_s": time.perf_counter() - t1,
                    "batch/length": float(batch["ids"].shape[1])})
    return MultiTurnRollout(episodes, group_ids, group_budgets, tables, turn_adv, batch, metrics)

  def update(self, state: TrainState, rollout: MultiTurnRollout) -> tuple[TrainState, dict[str, float]]:
    """``num_iterations`` full-batch updates, each with ``num_microbatches`` accumulated slices."""
    batch = {k: jnp.asarray(v) for k, v in rollout.batch.items()}
    collected = []
    for _ in range(self.settings.num_iterations):
      state, values = state_lib.update_step(self.graphdef, state, batch, loss_fn=self.update_loss,
                                            optimizer=self.optimizer,
                                            num_microbatches=self.settings.num_microbatches)
      collected.append(values)
    return state, rollout_lib.reduce_update_metrics(collected)

  def step(self, state: TrainState, groups: Sequence[Group]):
    """One RL step (episodes + updates); returns ``(state, metrics, rollout)``."""
    return rollout_lib.rollout_and_update(self, state, groups, lambda r: float(r.batch["loss_mask"].sum()))
