"""LEMON (METHODS.md section 4): the orchestration reward, the LEMON trainer and the worker models.

The orchestrator writes one spec per sample (:mod:`lemon_rl.envs.orchestration`); a spec is parsed with the
character spans of its fields, executed by the :class:`~lemon_rl.envs.orchestration.Executor` (all specs of a
step in one depth-wise sweep) and scored by :func:`orchestration_reward`:

  r = task_success + lambda_tok * token_efficiency - lambda_graph * graph_cost,   r(invalid spec) = -1
  token_efficiency = clip(1 - worker_tokens / token_budget, 0, 1)
  graph_cost = (sum_agents w[capacity] + num_edges) / graph_norm

*Decision* (METHODS.md): ``worker_tokens`` are all tokens of every node (prompts and completions), the
capacity weights ``w`` are 1, 2, 3 for small, medium, large and ``graph_norm`` is the graph cost of the largest
spec the schema allows (``max_agents`` agents at the top capacity, every earlier agent a dependency), so the
cost is in ``[0, 1]``; the coefficients are in the task's ``reward`` config (``token_measure="cost"`` takes
the price-weighted tokens instead).

One LEMON step (:class:`LemonTrainer`, the RL algorithm ``"lemon"`` of :data:`lemon_rl.training.phases.
RL_ALGORITHMS`): the shared rollout path samples ``G`` specs per task and scores them (the
:class:`OrchestrationScorer` is the rollout's reward function) and computes GRPO advantages over each group;
then, for each valid spec, :class:`~lemon_rl.losses.counterfactual.EditFamilySampler` draws an edit family
among those applicable to it, one edit of that family is drawn uniformly, the edited specs are re-executed
through the node cache (only the nodes the edit changed run), ``dc = r(original) - r(edited)``, and the edited
field's character span in the ORIGINAL sampled text is mapped to its token span on the sampled ids
(:func:`~lemon_rl.envs.orchestration.char_to_token_spans`). The update minimises ``L_GRPO + mu L_cf``
(:func:`~lemon_rl.losses.counterfactual.combined_loss`) with exact micro-batch accumulation; the sampler's
running means see every observed ``|dc|``. With ``lemon.mu = 0`` no edit is made and the loss is GRPO's: the
"global RL only" arm runs through the same code.

Worker seeds (*Decision*): a task's workers draw their sampling keys from ``hash(example seed, RL step)``, so
the ``G`` specs of a group and their edits share common random numbers (a contrast measures the spec, not
worker noise) while a problem seen again at a later step gets fresh worker draws.

The worker models the executor serves are in :mod:`lemon_rl.training.worker_models`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.envs.orchestration import executor as ex_lib
from lemon_rl.envs.orchestration.executor import Execution, Executor
from lemon_rl.envs.orchestration.spec import (EDIT_FAMILIES, Edit, Schema, Spec, SpecError,
                                              char_to_token_spans, enumerate_edits, parse_spec_with_spans)
from lemon_rl.eval.headroom import check_headroom, headroom_statistics, HeadroomRollout
from lemon_rl.losses import counterfactual as cf_lib
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.rewards.base import RewardOutput
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.training import phases as phases_lib
from lemon_rl.training import rl as rl_lib
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.fest import aggregation_denominator
from lemon_rl.training.rollout import Rollout
from lemon_rl.training.state import TrainState
from lemon_rl.utils import config_checks as cc

REWARD_NAME = "orchestration"
DEFAULT_CAPACITY_WEIGHTS: Mapping[str, float] = {"small": 1.0, "medium": 2.0, "large": 3.0}
TOKEN_MEASURES = ("tokens", "cost")

# ---------------------------------------------------------------------------------------------------
# The orchestration reward (pure).
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RewardSettings:
  """The reward's coefficients (module docstring).

  Attributes:
    lambda_tok: weight of the token efficiency.
    lambda_graph: weight of the graph cost.
    token_budget: worker tokens (or cost units) at which the efficiency reaches 0.
    invalid_reward: the reward of an invalid spec.
    token_measure: ``"tokens"`` (all prompt and completion tokens of every node) or ``"cost"`` (the
      executor's price-weighted tokens).
    capacity_weights: capacity -> the weight of an agent of that capacity in the graph cost.
    graph_norm: the divisor of the graph cost (``None``: the cost of the largest spec the schema allows).
  """

  lambda_tok: float = 0.5
  lambda_graph: float = 0.5
  token_budget: float = 1000.0
  invalid_reward: float = -1.0
  token_measure: str = "tokens"
  capacity_weights: Mapping[str, float] = dataclasses.field(
      default_factory=lambda: dict(DEFAULT_CAPACITY_WEIGHTS))
  graph_norm: float | None = None

  def __post_init__(self):
    object.__setattr__(self, "capacity_weights", {k: float(v) for k, v in dict(self.capacity_weights).items()})
    if self.token_measure not in TOKEN_MEASURES:
      raise ValueError(f"token_measure must be one of {TOKEN_MEASURES}, got {self.token_measure!r}")
    if not self.token_budget > 0 or self.lambda_tok < 0 or self.lambda_graph < 0:
      raise ValueError(f"need token_budget > 0 and lambda_tok, lambda_graph >= 0, got {self.token_budget}, "
                       f"{self.lambda_tok}, {self.lambda_graph}")
    if any(w < 0 for w in self.capacity_weights.values()):
      raise ValueError(f"capacity weights must be >= 0, got {self.capacity_weights}")
    if self.graph_norm is not None and not self.graph_norm > 0:
      raise ValueError(f"graph_norm must be > 0 (or None), got {self.graph_norm}")

  def __hash__(self):
    return hash((self.lambda_tok, self.lambda_graph, self.token_budget, self.invalid_reward, self.token_measure,
                 tuple(sorted(self.capacity_weights.items())), self.graph_norm))

  def norm(self, schema: Schema) -> float:
    """``graph_norm``, or the graph cost numerator of the largest spec ``schema`` allows."""
    if self.graph_norm is not None:
      return float(self.graph_norm)
    n = schema.max_agents
    return n * max(self.capacity_weights[c] for c in schema.capacities) + n * (n - 1) / 2

  @classmethod
  def from_config(cls, cfg, schema: Schema) -> "RewardSettings":
    """From a ``reward`` config section; every capacity of ``schema`` needs a weight."""
    fields = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown reward fields {sorted(unknown)}")
    settings = cls(**fields)
    missing = set(schema.capacities) - set(settings.capacity_weights)
    if missing:
      raise ValueError(f"capacity_weights lacks {sorted(missing)}")
    return settings


class RewardParts(NamedTuple):
  """The reward of one spec and its parts (``nan`` for the parts an invalid spec does not have)."""

  total: float
  valid: bool
  success: float
  token_efficiency: float
  graph_cost: float
  worker_tokens: float
  nodes: float
  edges: float
  error: str  # the SpecError code, "" for a valid spec


def answer_matches(output: str, gold: str) -> bool:
  """Task success: the answer agent's output is the gold answer (surrounding whitespace ignored)."""
  return output.strip() == str(gold).strip()


def graph_cost(spec: Spec, settings: RewardSettings, schema: Schema) -> float:
  """``(sum_agents w[capacity] + num_edges) / graph_norm``."""
  weight = sum(settings.capacity_weights[a.capacity] for a in spec.agents)
  return (weight + spec.num_edges) / settings.norm(schema)


def orchestration_reward(outcome: Execution | SpecError, gold: str, settings: RewardSettings = RewardSettings(),
                         schema: Schema = ex_lib.DEFAULT_SCHEMA,
                         check: Callable[[str, str], bool] = answer_matches) -> RewardParts:
  """The reward of an executed spec (an :class:`~lemon_rl.envs.orchestration.Execution`) or of an invalid
  one (its :class:`~lemon_rl.envs.orchestration.SpecError`); the formula is in the module docstring."""
  nan = float("nan")
  if isinstance(outcome, SpecError):
    return RewardParts(float(settings.invalid_reward), False, 0.0, nan, nan, nan, nan, nan, outcome.code)
  if not isinstance(outcome, Execution):
    raise TypeError(f"expected an Execution or a SpecError, got {type(outcome).__name__}")
  success = float(check(outcome.answer, gold))
  used = float(outcome.tokens if settings.token_measure == "tokens" else outcome.cost)
  efficiency = float(np.clip(1.0 - used / settings.token_budget, 0.0, 1.0))
  cost = graph_cost(outcome.spec, settings, schema)
  total = success + settings.lambda_tok * efficiency - settings.lambda_graph * cost
  return RewardParts(float(total), True, success, efficiency, cost, float(outcome.tokens),
                     float(len(outcome.spec.agents)), float(outcome.spec.num_edges), "")


# ---------------------------------------------------------------------------------------------------
# The scorer: the rollout's reward function (parse, execute in one batch, score).
# ---------------------------------------------------------------------------------------------------


class Scored(NamedTuple):
  """One spec text, parsed (``spec`` and ``spans``, or ``error``), executed and scored."""

  text: str
  spec: Spec | None
  spans: dict | None
  error: SpecError | None
  execution: Execution | None
  reward: RewardParts


class OrchestrationScorer:
  """A reward function (``lemon_rl.rewards.base``) over spec texts: parse, execute, :func:`orchestration_reward`.

  Every valid spec of a call runs in ONE :meth:`Executor.run` (batched by depth and capacity across specs
  and tasks). The examples carry ``task_field`` (the workers' task text), ``answer_field`` (the gold answer)
  and ``seed_field`` (the workers' sampling-key seed); other fields are ignored, except ``breakdown_field``
  (e.g. the problem kind), by which success and the answer agent's capacity are also logged.

  Per-sample metrics (``nan`` where undefined, so means are over valid specs): ``success``, ``valid``,
  ``worker_tokens``, ``nodes``, ``edges``, ``token_efficiency``, ``graph_cost``, ``answer_capacity`` (level
  0, 1, 2 of the answer agent), ``large_share`` (share of agents at the top capacity) and, with a breakdown,
  ``success/<value>`` and ``answer_capacity/<value>``.
  """

  def __init__(self, executor: Executor, settings: RewardSettings = RewardSettings(), *,
               check: Callable[[str, str], bool] = answer_matches, task_field: str = "task",
               answer_field: str = "answer", seed_field: str = "seed", breakdown_field: str | None = None):
    self.executor = executor
    self.settings = settings
    self.check = check
    self.task_field, self.answer_field, self.seed_field = task_field, answer_field, seed_field
    self.breakdown_field = breakdown_field

  @property
  def schema(self) -> Schema:
    return self.executor.schema

  def reward(self, outcome: Execution | SpecError, gold: str) -> RewardParts:
    return orchestration_reward(outcome, gold, self.settings, self.schema, self.check)

  def score(self, texts: Sequence[str], tasks: Sequence[str], answers: Sequence[str],
            seeds: Sequence[int]) -> list[Scored]:
    """Parses, executes (one batch) and scores ``texts[i]`` on ``tasks[i]`` with worker seed ``seeds[i]``."""
    parsed = []
    for text in texts:
      try:
        spec, spans = parse_spec_with_spans(text, self.schema)
        parsed.append((spec, spans, None))
      except SpecError as e:
        parsed.append((None, None, e))
    valid = [i for i, p in enumerate(parsed) if p[0] is not None]
    runs = dict(zip(valid, self.executor.run([parsed[i][0] for i in valid], [tasks[i] for i in valid],
                                             [int(seeds[i]) for i in valid]))) if valid else {}
    out = []
    for i, (spec, spans, error) in enumerate(parsed):
      execution = runs.get(i)
      reward = self.reward(execution if execution is not None else error, answers[i])
      out.append(Scored(texts[i], spec, spans, error, execution, reward))
    return out

  def metrics(self, scored: Sequence[Scored], breakdown: Sequence[Any] | None = None) -> dict[str, np.ndarray]:
    """The per-sample metrics of the class docstring."""
    top = self.schema.capacities[-1]
    rows = {"success": [], "valid": [], "worker_tokens": [], "nodes": [], "edges": [], "token_efficiency": [],
            "graph_cost": [], "answer_capacity": [], "large_share": [], "reward": []}
    for s in scored:
      r = s.reward
      rows["success"].append(r.success)
      rows["valid"].append(float(r.valid))
      for k in ("worker_tokens", "nodes", "edges", "token_efficiency", "graph_cost"):
        rows[k].append(getattr(r, k))
      rows["reward"].append(r.total)
      if s.spec is None:
        rows["answer_capacity"].append(np.nan)
        rows["large_share"].append(np.nan)
      else:
        answer = s.spec.agents[s.spec.index(s.spec.answer)]
        rows["answer_capacity"].append(float(self.schema.capacities.index(answer.capacity)))
        rows["large_share"].append(float(np.mean([a.capacity == top for a in s.spec.agents])))
    out = {k: np.asarray(v, np.float32) for k, v in rows.items()}
    if breakdown is not None:
      values = np.asarray([str(b) for b in breakdown])
      for value in sorted(set(values)):
        here = values == value
        out[f"success/{value}"] = np.where(here, out["success"], np.nan).astype(np.float32)
        out[f"answer_capacity/{value}"] = np.where(here, out["answer_capacity"], np.nan).astype(np.float32)
    return out

  def _fields(self, fields: Mapping[str, Sequence[Any]]):
    for name in (self.task_field, self.answer_field, self.seed_field):
      if name not in fields:
        raise KeyError(f"the orchestration reward needs the example field {name!r}; got {sorted(fields)}")
    return fields[self.task_field], fields[self.answer_field], fields[self.seed_field]

  def __call__(self, prompts, completions, completion_ids, **fields) -> RewardOutput:
    del prompts, completion_ids
    tasks, answers, seeds = self._fields(fields)
    scored = self.score(completions, tasks, answers, seeds)
    breakdown = fields.get(self.breakdown_field) if self.breakdown_field else None
    metrics = self.metrics(scored, breakdown)
    del metrics["reward"]
    return RewardOutput(np.asarray([s.reward.total for s in scored], np.float32), metrics)

  def success_view(self) -> "SuccessView":
    """The evaluation reward: task success (0/1) as the score, the reward and its parts as metrics."""
    return SuccessView(self)


class SuccessView:
  """:class:`OrchestrationScorer` scoring task success (an evaluation's ``accuracy``); shares its executor."""

  def __init__(self, scorer: OrchestrationScorer):
    self.scorer = scorer

  def __call__(self, prompts, completions, completion_ids, **fields) -> RewardOutput:
    del prompts, completion_ids
    tasks, answers, seeds = self.scorer._fields(fields)  # pylint: disable=protected-access
    scored = self.scorer.score(completions, tasks, answers, seeds)
    breakdown = fields.get(self.scorer.breakdown_field) if self.scorer.breakdown_field else None
    metrics = self.scorer.metrics(scored, breakdown)
    return RewardOutput(metrics["success"], metrics)


def execution_seed(seed: int, step: int) -> int:
  """The workers' seed of an example at RL step ``step`` (module docstring)."""
  digest = hashlib.blake2b(f"{int(seed)}:{int(step)}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------------------
# The LEMON loss.
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LemonSettings:
  """The ``lemon`` config section.

  Attributes:
    mu: weight of ``L_cf`` (*Decision*, METHODS.md: 1); 0 makes no edit (GRPO alone).
    families: the edit families the sampler may draw (an ablation removes one).
    floor, rate: the :class:`~lemon_rl.losses.counterfactual.EditFamilySampler`'s floor and running-mean rate.
    cf_aggregation: aggregation of ``L_cf`` over the span tokens (``lemon_rl.losses.AGGREGATIONS``).
  """

  mu: float = cf_lib.DEFAULT_MU
  families: tuple[str, ...] = EDIT_FAMILIES
  floor: float = cf_lib.DEFAULT_FLOOR
  rate: float = cf_lib.DEFAULT_RATE
  cf_aggregation: str = "token_mean"

  def __post_init__(self):
    object.__setattr__(self, "families", tuple(self.families))
    if self.mu < 0:
      raise ValueError(f"mu must be >= 0, got {self.mu}")
    if not self.families or len(set(self.families)) != len(self.families) or set(self.families) - set(
        EDIT_FAMILIES):
      raise ValueError(f"families must be distinct names of {EDIT_FAMILIES}, got {self.families}")
    if not 0 <= self.floor <= 1.0 / len(self.families):
      raise ValueError(f"floor must be in [0, 1/{len(self.families)}], got {self.floor}")
    if not 0 <= self.rate <= 1:
      raise ValueError(f"rate must be in [0, 1], got {self.rate}")
    pg.AGGREGATIONS.validate(self.cf_aggregation)

  @classmethod
  def from_config(cls, cfg) -> "LemonSettings":
    return cls(float(cfg.mu), tuple(cfg.families), float(cfg.floor), float(cfg.rate), str(cfg.cf_aggregation))


@dataclasses.dataclass(frozen=True)
class LemonLoss:
  """``L_GRPO + mu L_cf`` of one micro-batch (hashable: a static argument of the jitted update).

  ``batch`` holds the :class:`~lemon_rl.training.rl.PolicyLoss` fields plus ``dc [N]``, ``span_mask
  [N, T-1]`` (the edited field's tokens, in the next-token columns) and ``denominators [M, 3]`` (the GRPO
  term's and ``L_cf``'s whole-minibatch denominators and ``1 / M``, :meth:`denominators`). ``L_cf`` uses the
  policy's clip ranges, dual clip and TIS, the span intersected with the loss mask, and the same old
  log-probs (on-policy: ``sg[logp]``).
  """

  policy: rl_lib.PolicyLoss
  mu: float = cf_lib.DEFAULT_MU
  cf_aggregation: str = "token_mean"

  @property
  def sampling(self):
    return self.policy.sampling

  @property
  def tis_cap(self):
    return self.policy.tis_cap

  def terms(self, logits: jax.Array, batch: Mapping[str, jax.Array]):
    """``((grpo, metrics), (cf, metrics))`` from next-token ``logits [N, T-1, V]``."""
    grpo = self.policy.loss_from_logits(logits, batch)
    logp = self.policy.sampling.token_log_probs(logits, batch["ids"][:, 1:])
    old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
    kwargs = {}
    if "sampler_logp" in batch and self.policy.tis_cap:
      kwargs = {"sampler_logp": batch["sampler_logp"], "tis_cap": self.policy.tis_cap}
    cf = cf_lib.counterfactual_loss(
        logp, old_logp, batch["dc"], batch["span_mask"], completion_mask=batch["loss_mask"],
        eps_low=self.policy.eps_low, eps_high=self.policy.eps_high, dual_clip=self.policy.dual_clip,
        aggregation=self.cf_aggregation, max_len=self.policy.max_len, **kwargs)
    return grpo, cf

  def from_logits(self, logits: jax.Array, batch: Mapping[str, jax.Array]):
    grpo, cf = self.terms(logits, batch)
    den = batch["denominators"][0]
    return cf_lib.combined_loss(grpo, cf, mu=self.mu, grpo_denominator=den[0], cf_denominator=den[1],
                                share=den[2])

  def __call__(self, model: nnx.Module, batch: Mapping[str, jax.Array]):
    return self.from_logits(model(batch["ids"], batch["attention_mask"])[:, :-1], batch)

  def denominators(self, batch: Mapping[str, np.ndarray], num_microbatches: int) -> np.ndarray:
    """``[M, 3]``: the two terms' denominators over the whole (mini)batch ``batch`` and ``1 / M``."""
    mask = np.asarray(batch["loss_mask"])
    span = ((np.asarray(batch["span_mask"]) != 0) & (mask != 0)).astype(np.float32)
    row = np.array([aggregation_denominator(mask, self.policy.aggregation, self.policy.max_len),
                    aggregation_denominator(span, self.cf_aggregation, self.policy.max_len),
                    1.0 / num_microbatches], np.float32)
    return np.tile(row, (num_microbatches, 1))


# ---------------------------------------------------------------------------------------------------
# The trainer.
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LemonRollout(Rollout):
  """A :class:`~lemon_rl.training.rollout.Rollout` with what LEMON added per row: the parsed and executed
  originals (``scored``), the applied edit (or None), its contrast ``dc`` (0 without an edit) and the edited
  field's token span in the completion (or None)."""

  scored: list = dataclasses.field(default_factory=list)
  edits: list = dataclasses.field(default_factory=list)
  dc: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
  token_spans: list = dataclasses.field(default_factory=list)


class LemonTrainer(rl_lib.RLTrainer):
  """GRPO over groups of specs plus LEMON's counterfactual span credit (module docstring).

  Args:
    graphdef, optimizer, tokenizer, rl_cfg, ref_params, prompt_len: as
      :class:`~lemon_rl.training.rl.RLTrainer` (``rl_cfg`` is the ``rl`` section).
    scorer: the task's :class:`OrchestrationScorer` (its executor and node cache are reused for the edits).
    settings: :class:`LemonSettings`.
    seed: seeds the edit-family sampler and the choice of an edit within a family.
  """

  def __init__(self, graphdef, optimizer, tokenizer, scorer: OrchestrationScorer, rl_cfg,
               settings: LemonSettings = LemonSettings(), ref_params: Any = None, prompt_len: int | None = None,
               seed: int = 0):
    if rl_cfg.get("dynamic_sampling", False):
      raise ValueError("the LEMON trainer does not support rl.dynamic_sampling")
    super().__init__(graphdef, optimizer, tokenizer, [WeightedReward(REWARD_NAME, scorer, 1.0)], rl_cfg,
                     ref_params=ref_params, prompt_len=prompt_len)
    self.scorer = scorer
    self.settings = settings
    self.seed = int(seed)
    self.loss = LemonLoss(self.loss, float(settings.mu), settings.cf_aggregation)
    self.sampler = cf_lib.EditFamilySampler(settings.families, floor=settings.floor, rate=settings.rate,
                                            seed=self.seed)
    self._cf_signal = False

  @property
  def counterfactual(self) -> bool:
    """Whether edits are made (``mu > 0``)."""
    return self.settings.mu > 0

  @property
  def signal_without_variance(self) -> bool:
    """A KL or entropy term, or a nonzero ``dc`` on an edited span in the last rollout."""
    return super().signal_without_variance or self._cf_signal

  def with_execution_seeds(self, examples: Sequence[Mapping[str, Any]], step: int) -> list[dict[str, Any]]:
    """Copies of ``examples`` whose worker seed is :func:`execution_seed` of theirs and ``step``."""
    field = self.scorer.seed_field
    return [dict(ex, **{field: execution_seed(ex[field], step)}) for ex in examples]

  def rollout(self, state: TrainState, examples: Sequence[Mapping[str, Any]], refill=None) -> LemonRollout:
    if refill is not None:
      raise ValueError("the LEMON trainer does not refill (rl.dynamic_sampling is not supported)")
    step = int(jax.device_get(state.step))
    examples = self.with_execution_seeds(examples, step)
    return self.add_counterfactuals(super().rollout(state, examples), examples, step)

  def add_counterfactuals(self, rollout: Rollout, examples: Sequence[Mapping[str, Any]],
                          step: int) -> LemonRollout:
    """Edits, re-executes and credits the rollout's valid specs; adds ``dc`` and ``span_mask`` to the batch.

    ``examples`` are the rollout's examples as scored (worker seeds included); row ``i`` is a completion of
    example ``i // G``. Every row gets ``dc`` and a ``span_mask`` row (0 without an edit).
    """
    t0 = time.perf_counter()
    g = self.cfg.num_generations
    n = len(rollout.completions)
    if n != len(examples) * g:
      raise ValueError(f"{n} rollout rows for {len(examples)} examples x G={g}")
    sc = self.scorer
    tasks = [examples[i // g][sc.task_field] for i in range(n)]
    answers = [examples[i // g][sc.answer_field] for i in range(n)]
    seeds = [examples[i // g][sc.seed_field] for i in range(n)]
    hits0 = sc.executor.cache.hits
    scored = sc.score(rollout.completions, tasks, answers, seeds)  # The originals: all from the cache.
    hits_originals = sc.executor.cache.hits - hits0
    r_orig = np.asarray([s.reward.total for s in scored], np.float64)
    families = self.sampler.families
    options: list[dict[str, list[Edit]]] = []
    applicable = np.zeros((n, len(families)), bool)
    for i, s in enumerate(scored):
      by_family: dict[str, list[Edit]] = {}
      if s.spec is not None:
        for e in enumerate_edits(s.spec, sc.schema, families):
          by_family.setdefault(e.family, []).append(e)
      options.append(by_family)
      applicable[i] = [f in by_family for f in families]
    draws = self.sampler.sample(applicable) if self.counterfactual else np.full(n, -1)
    rng = np.random.default_rng([self.seed, step, 0xCF])
    edits: list[Edit | None] = [None] * n
    for i in range(n):
      if draws[i] >= 0:
        choices = options[i][families[draws[i]]]
        edits[i] = choices[int(rng.integers(len(choices)))]
    rows = [i for i in range(n) if edits[i] is not None]
    edited_runs = sc.executor.run([edits[i].spec for i in rows], [tasks[i] for i in rows],
                                  [int(seeds[i]) for i in rows]) if rows else []
    r_edit = {i: sc.reward(run, answers[i]) for i, run in zip(rows, edited_runs)}
    dc = np.zeros(n, np.float32)
    span_mask = np.zeros_like(rollout.batch["loss_mask"], np.float32)
    p = rollout.batch["ids"].shape[1] - self.cfg.max_new_tokens
    lengths = rollout.batch["loss_mask"].sum(axis=1).astype(np.int64)
    token_spans: list[tuple[int, int] | None] = [None] * n
    for i in rows:
      dc[i] = np.float32(r_orig[i] - r_edit[i].total)
      path = edits[i].path
      completion_ids = rollout.batch["ids"][i, p:p + lengths[i]]
      a, b = char_to_token_spans({path: scored[i].spans[path]}, scored[i].text, self.tokenizer,
                                 ids=completion_ids)[path]
      token_spans[i] = (a, b)
      span_mask[i, p - 1 + a:p - 1 + b] = 1.0  # Completion token j is predicted at column P - 1 + j.
    if rows:
      self.sampler.update([edits[i].family for i in rows], dc[rows])
    rollout.batch["dc"] = dc
    rollout.batch["span_mask"] = span_mask
    self._cf_signal = bool(self.counterfactual and np.any(dc[rows] != 0)) if rows else False
    metrics = self._metrics(scored, edits, dc, r_edit, applicable, edited_runs, span_mask, rollout.batch)
    metrics["lemon/cache_hits_originals"] = float(hits_originals)
    metrics["lemon/cf_nodes_executed"] = float(sum(run.executed for run in edited_runs))
    metrics["lemon/cf_nodes_total"] = float(sum(len(run.nodes) for run in edited_runs))
    metrics["time/counterfactual_s"] = time.perf_counter() - t0
    rollout.metrics.update(metrics)
    fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(Rollout)}
    return LemonRollout(**fields, scored=scored, edits=edits, dc=dc, token_spans=token_spans)

  def _metrics(self, scored, edits, dc, r_edit, applicable, edited_runs, span_mask, batch) -> dict[str, float]:
    valid = np.asarray([s.spec is not None for s in scored])
    mean = lambda xs: float(np.mean(xs)) if len(xs) else float("nan")  # nan: nothing to average.
    out = {"lemon/invalid_share": float(1.0 - valid.mean()),
           "lemon/success": mean([s.reward.success for s in scored]),
           "lemon/worker_tokens": mean([s.reward.worker_tokens for s in scored if s.spec is not None]),
           "lemon/graph_nodes": mean([s.reward.nodes for s in scored if s.spec is not None]),
           "lemon/graph_edges": mean([s.reward.edges for s in scored if s.spec is not None]),
           "lemon/edit_share": mean([e is not None for e in edits])}
    edited = [i for i, e in enumerate(edits) if e is not None]
    out["lemon/span_tokens"] = mean([span_mask[i].sum() for i in edited])
    out["lemon/abs_dc"] = mean([abs(dc[i]) for i in edited])
    probs = self.sampler.probabilities()
    for k, f in enumerate(self.sampler.families):
      mine = [i for i in edited if edits[i].family == f]
      out[f"lemon/{f}/edits"] = float(len(mine))
      out[f"lemon/{f}/applicable_share"] = mean(applicable[valid, k])
      out[f"lemon/{f}/abs_dc"] = mean([abs(dc[i]) for i in mine])
      out[f"lemon/{f}/changed_share"] = mean([dc[i] != 0 for i in mine])
      out[f"lemon/{f}/success_changed_share"] = mean(
          [r_edit[i].success != scored[i].reward.success for i in mine])
      out[f"lemon/{f}/running_abs_dc"] = float(self.sampler.means[k])
      out[f"lemon/{f}/prob"] = float(probs[k])
    return out

  def update(self, state: TrainState, rollout: Rollout) -> tuple[TrainState, dict[str, float]]:
    """``num_iterations`` passes over shuffled minibatches; each minibatch's denominators are its own."""
    cfg = self.cfg
    n = rollout.batch["ids"].shape[0]
    mb = cfg.minibatch_size or n
    if n % mb or mb % cfg.microbatch_size:
      raise ValueError(f"rollout of {n} rows, rl.minibatch_size={mb} and rl.microbatch_size="
                       f"{cfg.microbatch_size} must divide evenly")
    num_micro = mb // cfg.microbatch_size
    rng = np.random.default_rng(int(jax.random.randint(state_lib.step_key(state, 1), (), 0, 2**31 - 1)))
    collected = []
    for _ in range(cfg.num_iterations):
      order = rng.permutation(n) if mb < n else np.arange(n)
      for start in range(0, n, mb):
        idx = order[start:start + mb]
        host = {k: np.asarray(v)[idx] for k, v in rollout.batch.items()}
        host["denominators"] = self.loss.denominators(host, num_micro)
        state, values = state_lib.update_step(self.graphdef, state, {k: jnp.asarray(v) for k, v in host.items()},
                                              loss_fn=self.loss, optimizer=self.optimizer,
                                              num_microbatches=num_micro)
        collected.append(values)
    return state, rollout_lib.reduce_update_metrics(collected)


class LemonIterator:
  """The phase's data iterator, carrying the edit-family sampler's state in its checkpointed state."""

  def __init__(self, inner, sampler: cf_lib.EditFamilySampler):
    self.inner = inner
    self.sampler = sampler

  def __iter__(self):
    return self

  def __next__(self):
    return next(self.inner)

  def get_state(self) -> dict[str, Any]:
    s = self.sampler.state_dict()
    return {"data": self.inner.get_state(),
            "edit_sampler": {"families": list(s["families"]), "means": [float(x) for x in s["means"]],
                             "counts": [int(x) for x in s["counts"]], "rng": s["rng"]}}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.inner.set_state(state["data"])
    self.sampler.load_state_dict(state["edit_sampler"])


def scorer_of(task) -> OrchestrationScorer:
  """The task's :class:`OrchestrationScorer` (its one reward function)."""
  scorers = [r.fn for r in task.rewards if isinstance(r.fn, OrchestrationScorer)]
  if len(scorers) != 1 or len(task.rewards) != 1:
    raise ValueError("rl.algorithm='lemon' needs a task whose only reward is an OrchestrationScorer "
                     f"(e.g. task.name='word_problems'), got {[r.name for r in task.rewards]}")
  return scorers[0]


def build_lemon_trainer(ctx: phases_lib.PhaseContext, graphdef, optimizer):
  """The ``"lemon"`` RL algorithm: :class:`LemonTrainer` over the task's RL prompts."""
  cfg, task, rl = ctx.config, ctx.task, ctx.config.rl
  ref_params = jax.tree.map(jnp.copy, nnx.state(ctx.model, nnx.Param)) if rl.kl_coef else None
  trainer = LemonTrainer(graphdef, optimizer, task.tokenizer, scorer_of(task), rl, LemonSettings.from_config(cfg.lemon),
                         ref_params=ref_params, prompt_len=task.prompt_len, seed=cfg.seed)
  iterator = BatchIterator(task.rl_source, batch_size=rl.prompts_per_step, seed=cfg.seed)
  return trainer, LemonIterator(iterator, trainer.sampler)


def check_config(config) -> None:
  """The ``lemon`` section, and the ``rl`` fields LEMON constrains."""
  rl = config.rl
  if not rl.steps:
    return
  cc.require("lemon" in config, "lemon", None, "rl.algorithm='lemon' needs a 'lemon' config section")
  try:
    LemonSettings.from_config(config.lemon)
  except (ValueError, KeyError, TypeError) as e:
    raise cc.ConfigError(f"config.lemon: {e}") from None
  cc.require(not rl.dynamic_sampling, "rl.dynamic_sampling", rl.dynamic_sampling,
             "not supported by the LEMON trainer: use False")


phases_lib.RL_ALGORITHMS.register("lemon", phases_lib.RLAlgorithm(build_lemon_trainer, check_config))


# ---------------------------------------------------------------------------------------------------
# Step 0: does each edit family change the reward?
# ---------------------------------------------------------------------------------------------------

QUANTILES = (0.1, 0.5, 0.9)


def edit_effects(scorer: OrchestrationScorer, texts: Sequence[str], tasks: Sequence[str], answers: Sequence[str],
                 seeds: Sequence[int], families: Sequence[str] = EDIT_FAMILIES) -> dict[str, Any]:
  """Every applicable edit of every valid spec, re-executed (one batch, through the cache) and contrasted.

  Returns (JSON-ready) ``num_specs``, ``valid_share`` and per family: ``applicable_share`` (of valid
  specs), ``num_edits``, ``changed_share`` (edits with ``dc != 0``), ``success_changed_share`` (edits that
  flip task success), ``useful_share`` (over valid specs, the chance that one edit of the family drawn
  uniformly, as the trainer draws it, flips task success; 0 where none applies), ``mean_abs_dc`` and
  ``abs_dc_q10/q50/q90``, ``mean_dc``.
  """
  scored = scorer.score(texts, tasks, answers, seeds)
  valid = [i for i, s in enumerate(scored) if s.spec is not None]
  jobs = []  # (row, family, edit)
  for i in valid:
    for e in enumerate_edits(scored[i].spec, scorer.schema, families):
      jobs.append((i, e.family, e))
  runs = scorer.executor.run([e.spec for _, _, e in jobs], [tasks[i] for i, _, _ in jobs],
                             [int(seeds[i]) for i, _, _ in jobs]) if jobs else []
  out: dict[str, Any] = {"num_specs": len(texts), "valid_share": len(valid) / max(len(texts), 1), "families": {}}
  for f in families:
    mine = [(i, scorer.reward(run, answers[i])) for (i, fam, _), run in zip(jobs, runs) if fam == f]
    dc = np.asarray([scored[i].reward.total - r.total for i, r in mine], np.float64)
    flips = np.asarray([r.success != scored[i].reward.success for i, r in mine], bool)
    per_spec: dict[int, list[bool]] = {}
    for (i, _), flip in zip(mine, flips):
      per_spec.setdefault(i, []).append(bool(flip))
    stats = {"applicable_share": len(per_spec) / max(len(valid), 1), "num_edits": len(mine),
             "changed_share": float(np.mean(dc != 0)) if len(dc) else 0.0,
             "success_changed_share": float(flips.mean()) if len(flips) else 0.0,
             "useful_share": float(sum(np.mean(v) for v in per_spec.values()) / max(len(valid), 1)),
             "mean_abs_dc": float(np.abs(dc).mean()) if len(dc) else 0.0,
             "mean_dc": float(dc.mean()) if len(dc) else 0.0}
    for q in QUANTILES:
      stats[f"abs_dc_q{int(q * 100):02d}"] = float(np.quantile(np.abs(dc), q)) if len(dc) else 0.0
    out["families"][f] = stats
  return out


def measure_step0(model: nnx.Module, task, config, num_examples: int | None = None) -> dict[str, Any]:
  """The step-0 check of an experiment: specs sampled by ``model`` (``config.rl``'s sampling, ``G`` per
  validation example) -> :func:`edit_effects`, group signal (:func:`~lemon_rl.eval.headroom_statistics`)
  and the gate ``config.lemon.step0_thresholds`` (``min_<family>_useful_share``, ``min_valid_share``, ...;
  reported, never raised). JSON-ready."""
  examples = task.validation_examples[:num_examples or len(task.validation_examples)]
  graphdef, params = nnx.split(model, nnx.Param)
  scorer = scorer_of(task)
  rl = config.rl
  rollout = rollout_lib.collect_rollout(graphdef, params, task.tokenizer, examples, task.rewards, rl,
                                        jax.random.key(config.seed + 7), prompt_len=task.prompt_len)
  g = rl.num_generations
  rows = range(len(rollout.completions))
  effects = edit_effects(scorer, rollout.completions, [examples[i // g][scorer.task_field] for i in rows],
                         [examples[i // g][scorer.answer_field] for i in rows],
                         [examples[i // g][scorer.seed_field] for i in rows], tuple(config.lemon.families))
  lengths = rollout.batch["loss_mask"].sum(axis=1)
  statistics = headroom_statistics(HeadroomRollout(rollout.rewards, rollout.group_ids, lengths))
  statistics["valid_share"] = effects["valid_share"]
  for f, s in effects["families"].items():
    statistics[f"{f}_useful_share"] = s["useful_share"]
    statistics[f"{f}_changed_share"] = s["changed_share"]
  report = check_headroom(statistics, config.lemon.step0_thresholds.to_dict(), raise_on_failure=False)
  return {"effects": effects, "gate": report.to_dict(),
          "reward_mean": float(np.mean(rollout.rewards)), "num_examples": len(examples)}
