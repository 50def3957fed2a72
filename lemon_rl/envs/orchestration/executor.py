"""LEMON's executor: a valid spec -> a DAG of worker calls, batched by depth, with a node cache.

See METHODS.md section 4. :func:`compile_spec` turns a :class:`~lemon_rl.envs.orchestration.spec.Spec` into
a :class:`Graph` (parents, depths, levels). :class:`Executor` runs many ``(spec, task, seed)`` triples at once
in topological order: at depth ``d`` it builds the prompt of every agent of depth ``d`` of every spec (the
task plus its parents' outputs, :func:`format_agent_prompt`), looks each node up in the :class:`NodeCache`,
and sends the misses to the worker of the agent's capacity, ONE call per (depth, capacity) for the whole
batch of specs and tasks. The answer agent's output is the spec's answer.

Workers. A :class:`Worker` maps a batch of prompts and one sampling key per prompt to texts and token
counts. :class:`ModelWorker` serves a lemon_rl :class:`~lemon_rl.models.Transformer` through
:func:`lemon_rl.sampling.generate` (three sizes make a pool by capacity); :class:`ProgrammaticWorker` is a
deterministic stand-in with capacity-dependent accuracy and token cost, for tests.

Node keys and the cache. A node's sampling key is a function of the task seed and the agent's POSITION
(:func:`node_key`): an edit keeps every agent's position, so a counterfactual re-run samples each node with
the key it had in the original run (common random numbers), and the cache key ``(role, duty, capacity,
prompt, sampling key)`` (the prompt holds the task and the parents' roles and outputs) matches every node
whose agent and inputs the edit did not change: re-executing an edited spec with the same cache runs only
the edited agent and those downstream of it whose inputs actually changed, so ``dc = r(original) -
r(edited)`` measures the edit, not sampling noise. Two identical nodes in one batch run once.

Every agent runs, also one the answer does not depend on (*Decision*: the spec is executed as written, so
a useless agent costs its tokens and the reward's efficiency term sees it).

Accounting (*Decision*): every node records its prompt and completion tokens and ``cost = price[capacity]
* (prompt + completion tokens)`` whether it ran or came from the cache, so a spec's tokens and cost (what
the reward sees) never depend on what else shared the cache; ``executed`` counts the nodes actually run.
Default prices double per capacity level (1, 2, 4), roughly the per-token FLOP ratio of worker models whose
width grows by a factor of about 1.4 per level; pass measured ones (e.g. from
:mod:`lemon_rl.models.flops`) for an experiment.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from lemon_rl import sampling
from lemon_rl.envs.orchestration.spec import DEFAULT_SCHEMA, Schema, Spec, validate_spec
from lemon_rl.text.decoding import decode_completion, encode_prompt
from lemon_rl.text.tokenizers import ByteTokenizer

DEFAULT_TOKEN_PRICES: Mapping[str, float] = {"small": 1.0, "medium": 2.0, "large": 4.0}
DEFAULT_MAX_INPUT_CHARS = 256

# ---------------------------------------------------------------------------------------------------
# Graphs and prompts.
# ---------------------------------------------------------------------------------------------------


class Graph(NamedTuple):
  """The DAG of a spec (agents by position; the list order is a topological order).

  Attributes:
    parents: per agent, the positions of its dependencies in increasing order.
    children: per agent, the positions of the agents that depend on it.
    depths: per agent, ``0`` without parents, else ``1 + max(depth of its parents)``.
    levels: ``levels[d]`` = positions of the agents of depth ``d``.
    answer: position of the answer agent.
  """

  parents: tuple[tuple[int, ...], ...]
  children: tuple[tuple[int, ...], ...]
  depths: tuple[int, ...]
  levels: tuple[tuple[int, ...], ...]
  answer: int

  def descendants(self, i: int) -> frozenset[int]:
    """Positions of every agent downstream of agent ``i`` (``i`` excluded)."""
    out, stack = set(), list(self.children[i])
    while stack:
      j = stack.pop()
      if j not in out:
        out.add(j)
        stack.extend(self.children[j])
    return frozenset(out)


def compile_spec(spec: Spec, schema: Schema = DEFAULT_SCHEMA) -> Graph:
  """The :class:`Graph` of a valid spec (validated here; :class:`SpecError` otherwise)."""
  validate_spec(spec, schema)
  position = {a.id: i for i, a in enumerate(spec.agents)}
  parents = tuple(tuple(sorted(position[d] for d in a.depends_on)) for a in spec.agents)
  children = [[] for _ in spec.agents]
  depths = []
  for i, ps in enumerate(parents):
    for p in ps:
      children[p].append(i)
    depths.append(1 + max(depths[p] for p in ps) if ps else 0)
  levels = tuple(tuple(i for i, d in enumerate(depths) if d == level) for level in range(max(depths) + 1))
  return Graph(parents, tuple(map(tuple, children)), tuple(depths), levels, position[spec.answer])


class AgentPrompt(NamedTuple):
  """The fields of an agent prompt: the task, the agent's role and duty, and ``(role, output)`` per parent."""

  task: str
  role: str
  duty: str
  inputs: tuple[tuple[str, str], ...]


def _one_line(text: str, max_chars: int | None = None) -> str:
  text = " ".join(text.splitlines())
  return text if max_chars is None else text[:max_chars]


def format_agent_prompt(task: str, role: str, duty: str, inputs: Sequence[tuple[str, str]],
                        max_input_chars: int | None = DEFAULT_MAX_INPUT_CHARS) -> str:
  """The prompt of one agent, one field per line::

    task: <task>
    role: <role>
    duty: <duty>
    in <parent role>: <parent output>      (one line per parent, in agent order)
    out:<space>

  Newlines inside the task and the outputs become spaces (so the lines parse back, :func:`parse_agent_prompt`);
  each parent output is cut to ``max_input_chars`` characters (None: no cut). Parents are named by role, not
  id: ids carry no meaning, so renaming agents changes no prompt.
  """
  lines = [f"task: {_one_line(task)}", f"role: {role}", f"duty: {duty}"]
  lines += [f"in {r}: {_one_line(out, max_input_chars)}" for r, out in inputs]
  return "\n".join(lines) + "\nout: "


def parse_agent_prompt(prompt: str) -> AgentPrompt:
  """Inverse of :func:`format_agent_prompt` (``ValueError`` on any other text)."""
  lines = prompt.split("\n")
  ok = (len(lines) >= 4 and lines[0].startswith("task: ") and lines[1].startswith("role: ")
        and lines[2].startswith("duty: ") and lines[-1] == "out: ")
  if not ok:
    raise ValueError(f"not an agent prompt: {prompt!r}")
  inputs = []
  for line in lines[3:-1]:
    head, sep, out = line.partition(": ")
    if not sep or not head.startswith("in "):
      raise ValueError(f"bad input line {line!r} in an agent prompt")
    inputs.append((head[3:], out))
  return AgentPrompt(lines[0][6:], lines[1][6:], lines[2][6:], tuple(inputs))


def node_key(seed: int, position: int) -> int:
  """The sampling key (a uint32) of the agent at ``position`` of a spec run on a task with ``seed``."""
  digest = hashlib.blake2b(f"{int(seed)}:{int(position)}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little")


# ---------------------------------------------------------------------------------------------------
# Workers.
# ---------------------------------------------------------------------------------------------------


class WorkerOutput(NamedTuple):
  """A worker's answers to a batch of ``B`` prompts: ``texts`` (B strings), ``prompt_tokens`` and
  ``completion_tokens`` (``[B]`` int, EOS included in the completion)."""

  texts: list[str]
  prompt_tokens: np.ndarray
  completion_tokens: np.ndarray


@runtime_checkable
class Worker(Protocol):
  """Answers a batch of prompts; ``keys[i]`` is prompt ``i``'s sampling key (an int)."""

  def __call__(self, prompts: Sequence[str], keys: Sequence[int]) -> WorkerOutput:
    ...


class ModelWorker:
  """A :class:`Worker` over a lemon_rl decoder, sampled by :func:`lemon_rl.sampling.generate`.

  Prompts are encoded with :func:`~lemon_rl.text.encode_prompt` and completions decoded with
  :func:`~lemon_rl.text.decode_completion`; at most ``max_batch`` prompts go to one ``generate`` call. With
  ``pad_batch`` a call's batch is padded (repeating its first prompt; the copies are dropped) to the next
  power of two, so the varying number of agents per depth compiles ``generate`` a logarithmic number of
  times instead of once per batch size.

  Determinism (*Decision*): ``generate`` draws a whole batch from one PRNG key, so a row's sample at
  ``temperature > 0`` depends on its batch-mates; the batch key is a hash of the rows' keys, so the same
  batch gives the same samples. The default is greedy decoding (``temperature = 0``), where a node's output
  depends on its prompt alone (up to float rounding of differently padded batches) and the node cache is
  exact.
  """

  def __init__(self, model, tokenizer, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, max_batch: int | None = None, pad_batch: bool = True,
               min_prompt_bucket: int = 16):
    self.model = model
    self.tokenizer = tokenizer
    self.max_new_tokens = int(max_new_tokens)
    self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
    self.max_batch = max_batch
    self.pad_batch = pad_batch
    self.min_prompt_bucket = min_prompt_bucket

  def __call__(self, prompts: Sequence[str], keys: Sequence[int]) -> WorkerOutput:
    if len(prompts) != len(keys):
      raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
    texts, prompt_tokens, completion_tokens = [], [], []
    step = self.max_batch or max(1, len(prompts))
    for lo in range(0, len(prompts), step):
      ids = [encode_prompt(self.tokenizer, p) for p in prompts[lo:lo + step]]
      batch_keys = [int(k) for k in keys[lo:lo + step]]
      seed = int.from_bytes(hashlib.blake2b(repr(batch_keys).encode(), digest_size=4).digest(), "little")
      rows = 1 << (len(ids) - 1).bit_length() if self.pad_batch else len(ids)
      out = sampling.generate(self.model, ids + [ids[0]] * (rows - len(ids)), self.max_new_tokens,
                              jax.random.key(seed), temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id,
                              min_prompt_bucket=self.min_prompt_bucket)
      for row, prompt_ids in enumerate(ids):
        n = int(out.lengths[row])
        texts.append(decode_completion(self.tokenizer, out.tokens[row, :n].tolist()))
        prompt_tokens.append(len(prompt_ids))
        completion_tokens.append(n)
    return WorkerOutput(texts, np.asarray(prompt_tokens, np.int64), np.asarray(completion_tokens, np.int64))


def unit_interval(*parts) -> float:
  """A deterministic draw in ``[0, 1)`` from ``parts`` (a hash of their ``repr``): a programmatic worker's
  common random number."""
  digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


class ProgrammaticWorker:
  """A deterministic stand-in for a worker model (tests and calibration), with the accuracy of its capacity.

  For a prompt it computes the correct output ``solve(parse_agent_prompt(prompt))`` and returns it with
  probability ``accuracy``, else ``corrupt(correct)``; the draw is ``u(key, prompt) < accuracy`` with ``u`` a
  hash to ``[0, 1)``, so the output is a function of (prompt, key) alone, whatever the batch. Tokens:
  ``len(tokenizer.encode(prompt))`` prompt tokens and ``len(encode(output)) + 1 + extra_tokens`` completion
  tokens (EOS, plus the reasoning a bigger model spends). ``calls`` and ``rows`` count its use.
  """

  def __init__(self, solve: Callable[[AgentPrompt], str], accuracy: float = 1.0, extra_tokens: int = 0,
               tokenizer=None, corrupt: Callable[[str], str] = lambda text: text + "?"):
    if not 0.0 <= accuracy <= 1.0:
      raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
    self.solve, self.accuracy, self.extra_tokens = solve, float(accuracy), int(extra_tokens)
    self.tokenizer, self.corrupt = tokenizer or ByteTokenizer(), corrupt
    self.calls = 0
    self.rows = 0

  def answer(self, prompt: str, key: int) -> str:
    """The output for one prompt and sampling key (what a subclass with other accuracies overrides)."""
    correct = self.solve(parse_agent_prompt(prompt))
    return correct if unit_interval(key, prompt) < self.accuracy else self.corrupt(correct)

  def __call__(self, prompts: Sequence[str], keys: Sequence[int]) -> WorkerOutput:
    if len(prompts) != len(keys):
      raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
    self.calls += 1
    self.rows += len(prompts)
    texts = [self.answer(prompt, int(key)) for prompt, key in zip(prompts, keys)]
    prompt_tokens = [len(self.tokenizer.encode(p)) for p in prompts]
    completion_tokens = [len(self.tokenizer.encode(t)) + 1 + self.extra_tokens for t in texts]
    return WorkerOutput(texts, np.asarray(prompt_tokens, np.int64), np.asarray(completion_tokens, np.int64))


PROGRAMMATIC_ACCURACY: Mapping[str, float] = {"small": 0.5, "medium": 0.75, "large": 0.95}
PROGRAMMATIC_EXTRA_TOKENS: Mapping[str, int] = {"small": 0, "medium": 8, "large": 24}


def programmatic_pool(solve: Callable[[AgentPrompt], str], accuracy: Mapping[str, float] | None = None,
                      extra_tokens: Mapping[str, int] | None = None,
                      tokenizer=None) -> dict[str, ProgrammaticWorker]:
  """One :class:`ProgrammaticWorker` per capacity of ``accuracy`` (default :data:`PROGRAMMATIC_ACCURACY`
  and :data:`PROGRAMMATIC_EXTRA_TOKENS`: a bigger worker is more accurate and spends more tokens)."""
  accuracy = PROGRAMMATIC_ACCURACY if accuracy is None else accuracy
  extra_tokens = PROGRAMMATIC_EXTRA_TOKENS if extra_tokens is None else extra_tokens
  return {cap: ProgrammaticWorker(solve, accuracy[cap], extra_tokens.get(cap, 0), tokenizer) for cap in accuracy}


# ---------------------------------------------------------------------------------------------------
# The cache and the executor.
# ---------------------------------------------------------------------------------------------------


class NodeOutput(NamedTuple):
  text: str
  prompt_tokens: int
  completion_tokens: int


class NodeCache:
  """LRU map ``(role, duty, capacity, prompt, sampling key) -> NodeOutput`` with hit/miss counts.

  Valid as long as the workers do not change (clear it when a worker model is updated).
  """

  def __init__(self, max_entries: int | None = 100_000):
    self.max_entries = max_entries
    self._data: collections.OrderedDict = collections.OrderedDict()
    self.hits = 0
    self.misses = 0

  def get(self, key) -> NodeOutput | None:
    value = self._data.get(key)
    if value is None:
      self.misses += 1
    else:
      self.hits += 1
      self._data.move_to_end(key)
    return value

  def put(self, key, value: NodeOutput):
    self._data[key] = value
    self._data.move_to_end(key)
    if self.max_entries is not None:
      while len(self._data) > self.max_entries:
        self._data.popitem(last=False)

  def clear(self):
    self._data.clear()

  def __len__(self) -> int:
    return len(self._data)


class NodeResult(NamedTuple):
  """One executed (or cached) agent: its id, capacity, depth, prompt, output, token counts, cost, and
  whether it came from the cache."""

  agent: str
  capacity: str
  depth: int
  prompt: str
  output: str
  prompt_tokens: int
  completion_tokens: int
  cost: float
  cached: bool


class Execution(NamedTuple):
  """A spec run on one task: per-agent :class:`NodeResult` (spec order), the answer agent's output and the
  totals over every node (``tokens = prompt_tokens + completion_tokens``; ``executed`` = nodes actually run)."""

  spec: Spec
  task: str
  seed: int
  nodes: tuple[NodeResult, ...]
  answer: str
  prompt_tokens: int
  completion_tokens: int
  cost: float
  executed: int

  @property
  def tokens(self) -> int:
    return self.prompt_tokens + self.completion_tokens


class Executor:
  """Runs specs on tasks with a worker pool by capacity and a shared node cache.

  Args:
    workers: capacity -> :class:`Worker` (every capacity the specs use).
    schema: the spec schema (specs are validated before they run).
    token_prices: capacity -> cost per token (default :data:`DEFAULT_TOKEN_PRICES`).
    cache: a :class:`NodeCache` (default: a new one); share one between an original run and its edits.
    max_input_chars: cut of each parent output in a prompt (:func:`format_agent_prompt`).

  ``worker_calls`` counts the worker calls made per capacity.
  """

  def __init__(self, workers: Mapping[str, Worker], *, schema: Schema = DEFAULT_SCHEMA,
               token_prices: Mapping[str, float] | None = None, cache: NodeCache | None = None,
               max_input_chars: int | None = DEFAULT_MAX_INPUT_CHARS):
    self.workers = dict(workers)
    self.schema = schema
    self.token_prices = dict(DEFAULT_TOKEN_PRICES if token_prices is None else token_prices)
    for cap in schema.capacities:
      if cap not in self.token_prices:
        raise ValueError(f"no token price for capacity {cap!r}")
    self.cache = NodeCache() if cache is None else cache
    self.max_input_chars = max_input_chars
    self.worker_calls: collections.Counter = collections.Counter()

  def run(self, specs: Sequence[Spec], tasks: Sequence[str], seeds: Sequence[int]) -> list[Execution]:
    """Executes ``specs[i]`` on ``tasks[i]`` with node keys from ``seeds[i]``, all in one depth-wise sweep.

    Raises:
      SpecError: if a spec is invalid (score invalid specs before running them).
      KeyError: if a spec uses a capacity without a worker.
    """
    if not len(specs) == len(tasks) == len(seeds):
      raise ValueError(f"{len(specs)} specs, {len(tasks)} tasks and {len(seeds)} seeds")
    graphs = [compile_spec(s, self.schema) for s in specs]
    for spec in specs:
      for agent in spec.agents:
        if agent.capacity not in self.workers:
          raise KeyError(f"no worker for capacity {agent.capacity!r} (workers: {sorted(self.workers)})")
    results: list[list[NodeResult | None]] = [[None] * len(s.agents) for s in specs]
    for depth in range(max(len(g.levels) for g in graphs) if graphs else 0):
      pending: dict[tuple, list[tuple[int, int, str]]] = {}  # cache key -> [(run, agent, prompt)]
      for e, (spec, graph) in enumerate(zip(specs, graphs)):
        for i in graph.levels[depth] if depth < len(graph.levels) else ():
          agent = spec.agents[i]
          inputs = [(spec.agents[p].role, results[e][p].output) for p in graph.parents[i]]
          prompt = format_agent_prompt(tasks[e], agent.role, agent.duty, inputs, self.max_input_chars)
          key = (agent.role, agent.duty, agent.capacity, prompt, node_key(seeds[e], i))
          if key in pending:  # The same node twice in this batch: run it once.
            pending[key].append((e, i, prompt))
            continue
          hit = self.cache.get(key)
          if hit is not None:
            results[e][i] = self._result(spec.agents[i], depth, prompt, hit, cached=True)
          else:
            pending[key] = [(e, i, prompt)]
      by_capacity: dict[str, list[tuple]] = collections.defaultdict(list)
      for key in pending:
        by_capacity[key[2]].append(key)
      for capacity, keys in by_capacity.items():
        out = self.workers[capacity]([k[3] for k in keys], [k[4] for k in keys])
        self.worker_calls[capacity] += 1
        if len(out.texts) != len(keys):
          raise ValueError(f"the {capacity!r} worker answered {len(out.texts)} of {len(keys)} prompts")
        for row, key in enumerate(keys):
          node = NodeOutput(out.texts[row], int(out.prompt_tokens[row]), int(out.completion_tokens[row]))
          self.cache.put(key, node)
          for n, (e, i, prompt) in enumerate(pending[key]):
            results[e][i] = self._result(specs[e].agents[i], depth, prompt, node, cached=n > 0)
    return [self._execution(spec, task, seed, tuple(nodes), graph)
            for spec, task, seed, nodes, graph in zip(specs, tasks, seeds, results, graphs)]

  def run_one(self, spec: Spec, task: str, seed: int) -> Execution:
    return self.run([spec], [task], [seed])[0]

  def _result(self, agent, depth, prompt, node: NodeOutput, cached: bool) -> NodeResult:
    cost = self.token_prices[agent.capacity] * (node.prompt_tokens + node.completion_tokens)
    return NodeResult(agent.id, agent.capacity, depth, prompt, node.text, node.prompt_tokens,
                      node.completion_tokens, float(cost), cached)

  @staticmethod
  def _execution(spec, task, seed, nodes, graph) -> Execution:
    return Execution(spec, task, int(seed), nodes, nodes[graph.answer].output,
                     sum(n.prompt_tokens for n in nodes), sum(n.completion_tokens for n in nodes),
                     float(sum(n.cost for n in nodes)), sum(not n.cached for n in nodes))
