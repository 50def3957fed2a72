"""The text-environment protocol of multi-turn episodes (METHODS.md section 5), and a Gymnasium adapter.

An environment speaks text both ways: :meth:`Environment.reset` returns the first observation (the whole
prompt of the episode: system text, task, first state) and :meth:`Environment.step` takes the decoded action
of the policy (EOS stripped, special tokens kept, as :func:`lemon_rl.text.decode_completion` gives it) and
returns a :class:`StepResult`. The episode engine (:mod:`lemon_rl.training.multiturn`) tokenises each
observation once and appends it to the sequence exactly as returned, so an environment writes every separator
or chat-template marker it wants into the observation text itself.

Malformed actions: the environment (or the adapter's action decoder) decides what is malformed and signals
it by raising :class:`InvalidAction` from ``step`` (or from the decoder). The engine ends that episode with
status :attr:`FinishStatus.INVALID_ACTION` and gives that turn the reward
``EpisodeSettings.invalid_action_reward`` (*Decision*: -1, below any failure reward of a well-formed
episode, and the episode ends instead of continuing). An environment that prefers to let a malformed action
pass as a no-op with its own penalty just returns a normal :class:`StepResult` for it.

Success: a ``done`` step is a success iff ``info["success"]`` is true; without that key, iff its reward is
``> 0`` (*Decision*, the convention of sparse 0/1 tasks such as FrozenLake). An environment that ends an
episode itself for another reason (its own turn budget, a malformed action it chose to end on) says so with
``info["status"]`` set to a :class:`FinishStatus` value, which the engine then records (:func:`finish_status`).

Any other exception from ``reset`` or ``step`` ends the episode with :attr:`FinishStatus.ENV_ERROR` (and the
engine's ``env_error_reward``); the other episodes of the batch go on.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping, NamedTuple, Protocol, runtime_checkable


class FinishStatus(str, enum.Enum):
  """How an episode ended (a ``str`` enum: ``FinishStatus.SUCCESS == "success"``).

  - ``SUCCESS`` / ``FAILURE``: the environment said ``done``; success per ``info["success"]`` (or reward > 0).
  - ``BUDGET_EXHAUSTED``: ``max_turns`` actions were taken and the environment had not said ``done``.
  - ``INVALID_ACTION``: the environment (or adapter) raised :class:`InvalidAction` on an action.
  - ``CONTEXT_FULL``: the prompt, an action or an observation did not fit in the episode's context
    (``EpisodeSettings.num_slots``).
  - ``ENV_ERROR``: ``reset`` or ``step`` raised any other exception.
  """

  SUCCESS = "success"
  FAILURE = "failure"
  BUDGET_EXHAUSTED = "budget_exhausted"
  INVALID_ACTION = "invalid_action"
  CONTEXT_FULL = "context_full"
  ENV_ERROR = "env_error"


_STATUS_VALUES = frozenset(s.value for s in FinishStatus)


class InvalidAction(ValueError):
  """Raised by an environment or an action decoder when the action text is malformed."""


class StepResult(NamedTuple):
  """The outcome of one action.

  Attributes:
    observation: text appended after the action (tokenised once, never re-rendered). Ignored (not appended)
      when ``done`` is true or the turn budget is spent, since no action follows it.
    reward: the reward of this turn.
    done: the episode is over (the environment's terminal state or its own time limit).
    info: free-form; ``"success"`` (bool) decides success vs failure when ``done``.
  """

  observation: str
  reward: float
  done: bool
  info: Mapping[str, Any] = {}


@runtime_checkable
class Environment(Protocol):
  """A text environment; one instance runs one episode at a time."""

  def reset(self, seed: int) -> str:
    """Starts a new episode (deterministic given ``seed``); returns the first observation (the prompt)."""
    ...

  def step(self, action_text: str) -> StepResult:
    """Applies the policy's action; raises :class:`InvalidAction` if the text is malformed."""
    ...


def finish_status(result: StepResult) -> "FinishStatus":
  """The status of a ``done`` step: ``info["status"]`` if it names a :class:`FinishStatus`, else success /
  failure by :func:`is_success`."""
  status = (result.info or {}).get("status")
  if status in _STATUS_VALUES:
    return FinishStatus(status)
  return FinishStatus.SUCCESS if is_success(result) else FinishStatus.FAILURE


def is_success(result: StepResult) -> bool:
  """Whether a ``done`` step is a success: ``info["success"]`` if present, else ``reward > 0``."""
  info = result.info or {}
  if "success" in info:
    return bool(info["success"])
  return float(result.reward) > 0


class GymAdapter:
  """Wraps a Gymnasium-style environment (``reset(seed=) -> (obs, info)``, ``step(a) -> (obs, r, terminated,
  truncated, info)``) as a text :class:`Environment`.

  Args:
    env: the Gymnasium-style environment (``gymnasium`` itself is not imported).
    action_decoder: action text -> the environment's action; raises :class:`InvalidAction` (or returns
      ``None``, which counts as malformed) on malformed text.
    observation_encoder: ``(obs, info) -> text`` of an observation after a step.
    prompt_encoder: ``(obs, info) -> text`` of the first observation (default ``observation_encoder``).
    success_fn: ``(obs, reward, terminated, truncated, info) -> bool`` for a finished episode (default:
      ``terminated and reward > 0``; a ``truncated`` episode, the environment's own time limit, fails).
  """

  def __init__(self, env, action_decoder: Callable[[str], Any],
               observation_encoder: Callable[[Any, Mapping[str, Any]], str],
               prompt_encoder: Callable[[Any, Mapping[str, Any]], str] | None = None,
               success_fn: Callable[..., bool] | None = None):
    self.env = env
    self.action_decoder = action_decoder
    self.observation_encoder = observation_encoder
    self.prompt_encoder = prompt_encoder or observation_encoder
    self.success_fn = success_fn or (lambda obs, r, terminated, truncated, info: bool(terminated and r > 0))

  def reset(self, seed: int) -> str:
    obs, info = self.env.reset(seed=int(seed))
    return self.prompt_encoder(obs, info)

  def step(self, action_text: str) -> StepResult:
    action = self.action_decoder(action_text)
    if action is None:
      raise InvalidAction(f"cannot decode an action from {action_text[:80]!r}")
    obs, reward, terminated, truncated, info = self.env.step(action)
    done = bool(terminated or truncated)
    info = dict(info or {}, action=action, terminated=bool(terminated), truncated=bool(truncated))
    if done:
      info["success"] = bool(self.success_fn(obs, reward, terminated, truncated, info))
    return StepResult(self.observation_encoder(obs, info), float(reward), done, info)


def choice_decoder(choices: Mapping[str, Any], strip: str = " \t\n.") -> Callable[[str], Any]:
  """An action decoder for a small discrete action set: the stripped, lower-cased text must be a key.

  ``choice_decoder({"left": 0, "down": 1, "right": 2, "up": 3})("Down\\n") == 1``; anything else raises
  :class:`InvalidAction`.
  """
  table = {str(k).lower(): v for k, v in choices.items()}

  def decode(text: str) -> Any:
    key = text.strip(strip).lower()
    if key not in table:
      raise InvalidAction(f"{text[:80]!r} is not one of {sorted(table)}")
    return table[key]

  return decode
