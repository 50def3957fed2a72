"""LEMON's executor: DAG compilation, prompts, batching by depth, the node cache and counterfactual re-runs."""

import numpy as np
import pytest
from flax import nnx

from lemon_rl import sampling
from lemon_rl.envs.orchestration.executor import (AgentPrompt, Executor, ModelWorker, NodeCache, NodeOutput,
                                                  ProgrammaticWorker, WorkerOutput, compile_spec,
                                                  format_agent_prompt, node_key, parse_agent_prompt,
                                                  programmatic_pool)
from lemon_rl.envs.orchestration.spec import Agent, Spec, SpecError, enumerate_edits, parse_spec
from lemon_rl.models import Transformer, get_preset
from lemon_rl.text import ByteTokenizer, encode_prompt

# A diamond (a -> b, a -> c, {b, c} -> d) plus an unused root e. Every edit family applies somewhere.
DIAMOND = parse_spec("""agents:
- {id: a, role: planner, duty: plan split in two, cap: small}
- {id: b, role: calculator, duty: compute, cap: large, deps: [a]}
- {id: c, role: verifier, duty: verify units, cap: medium, deps: [a]}
- {id: d, role: aggregator, duty: aggregate, cap: medium, deps: [c, b]}
- {id: e, role: critic, duty: critique, cap: small}
answer: d""")
CHAIN = parse_spec("""agents:
- {id: x, role: extractor, duty: extract, cap: small}
- {id: y, role: solver, duty: solve, cap: large, deps: [x]}
answer: y""")
SINGLE = parse_spec("agents: [{id: s, role: solver, duty: solve carefully, cap: medium}]\nanswer: s")


def symbolic(capacity):
  """A worker's exact output as a formula of its capacity, duty and inputs (so any change shows)."""

  def solve(p: AgentPrompt) -> str:
    return f"{capacity[0]}.{p.duty}({','.join(out for _, out in p.inputs) or p.task})"

  return solve


def symbolic_pool(accuracy=1.0, extra=None):
  extra = extra or {"small": 0, "medium": 8, "large": 24}
  return {cap: ProgrammaticWorker(symbolic(cap), accuracy, extra[cap]) for cap in ("small", "medium", "large")}


def test_compile_spec_graph():
  g = compile_spec(DIAMOND)
  assert g.parents == ((), (0,), (0,), (1, 2), ())  # Parents in agent order, whatever the deps order.
  assert g.children == ((1, 2), (3,), (3,), (), ())
  assert g.depths == (0, 1, 1, 2, 0)
  assert g.levels == ((0, 4), (1, 2), (3,))
  assert g.answer == 3
  assert g.descendants(0) == {1, 2, 3} and g.descendants(2) == {3} and g.descendants(4) == frozenset()
  with pytest.raises(SpecError, match="unknown role"):
    compile_spec(Spec((Agent("a", "coder", "plan", "small"),), "a"))


def test_prompt_format_round_trips():
  prompt = format_agent_prompt("Ann has 3\napples.", "verifier", "verify units", [("planner", "p1\np2"),
                                                                                  ("calculator", "x" * 9)],
                               max_input_chars=5)
  assert prompt == ("task: Ann has 3 apples.\nrole: verifier\nduty: verify units\nin planner: p1 p2\n"
                    "in calculator: xxxxx\nout: ")
  assert parse_agent_prompt(prompt) == AgentPrompt("Ann has 3 apples.", "verifier", "verify units",
                                                   (("planner", "p1 p2"), ("calculator", "xxxxx")))
  assert parse_agent_prompt(format_agent_prompt("t", "solver", "solve", [])).inputs == ()
  for bad in ("hello", "task: t\nrole: r\nduty: d\nout:", "task: t\nrole: r\nduty: d\nfrom x: y\nout: "):
    with pytest.raises(ValueError):
      parse_agent_prompt(bad)


def test_answer_composes_parent_outputs_and_tokens_are_accounted():
  executor = Executor(symbolic_pool())
  run = executor.run_one(DIAMOND, "T", seed=0)
  plan = "s.plan split in two(T)"
  assert [n.output for n in run.nodes] == [
      plan, f"l.compute({plan})", f"m.verify units({plan})",
      f"m.aggregate(l.compute({plan}),m.verify units({plan}))", "s.critique(T)"]
  assert run.answer == run.nodes[3].output
  assert run.nodes[3].prompt.endswith(f"in calculator: l.compute({plan})\nin verifier: m.verify units({plan})\nout: ")
  extra, price = {"small": 0, "medium": 8, "large": 24}, {"small": 1.0, "medium": 2.0, "large": 4.0}
  for node in run.nodes:
    assert node.prompt_tokens == len(node.prompt.encode())
    assert node.completion_tokens == len(node.output) + 1 + extra[node.capacity]
    assert node.cost == price[node.capacity] * (node.prompt_tokens + node.completion_tokens)
    assert not node.cached
  assert run.prompt_tokens == sum(n.prompt_tokens for n in run.nodes)
  assert run.completion_tokens == sum(n.completion_tokens for n in run.nodes)
  assert run.tokens == run.prompt_tokens + run.completion_tokens
  assert run.cost == sum(n.cost for n in run.nodes) and run.executed == 5
  assert [n.depth for n in run.nodes] == [0, 1, 1, 2, 0]


class CountingWorker:
  """Records the batch size of every call of the wrapped worker."""

  def __init__(self, worker):
    self.worker, self.batches = worker, []

  def __call__(self, prompts, keys):
    self.batches.append(len(prompts))
    return self.worker(prompts, keys)


def _strip_cache_flags(run):
  return run._replace(nodes=tuple(n._replace(cached=False) for n in run.nodes), executed=0)


def test_one_worker_call_per_depth_and_capacity_across_specs_and_tasks():
  specs = [DIAMOND, CHAIN, SINGLE, DIAMOND]
  tasks = ["T1", "T1", "T2", "T2"]
  seeds = [1, 1, 2, 2]
  pool = {cap: CountingWorker(w) for cap, w in symbolic_pool(accuracy=0.6).items()}
  executor = Executor(pool)
  runs = executor.run(specs, tasks, seeds)
  # (depth, capacity) pairs: depth 0 small (a, e twice, x) and medium (s); depth 1 large (b twice, y) and
  # medium (c twice); depth 2 medium (d twice). Each pair is one call holding every spec's and task's nodes.
  assert {cap: w.batches for cap, w in pool.items()} == {"small": [5], "medium": [1, 2, 2], "large": [3]}
  assert dict(executor.worker_calls) == {"small": 1, "medium": 3, "large": 1}
  # Batching changes nothing: each run equals the run of its spec alone on a fresh cache.
  for spec, task, seed, run in zip(specs, tasks, seeds, runs):
    assert run == Executor(symbolic_pool(accuracy=0.6)).run_one(spec, task, seed)
  # A second sweep is served entirely by the cache, with the same outputs and accounting.
  again = executor.run(specs, tasks, seeds)
  assert sum(len(w.batches) for w in pool.values()) == 5
  assert all(n.cached for run in again for n in run.nodes) and all(run.executed == 0 for run in again)
  assert [_strip_cache_flags(r) for r in again] == [_strip_cache_flags(r) for r in runs]


def test_identical_nodes_in_one_batch_run_once_and_both_pay():
  pool = symbolic_pool()
  executor = Executor(pool)
  first, second = executor.run([DIAMOND, DIAMOND], ["T", "T"], [5, 5])
  assert sum(w.rows for w in pool.values()) == 5
  assert first.executed == 5 and second.executed == 0
  assert _strip_cache_flags(first) == _strip_cache_flags(second)  # Tokens and cost counted for both.
  other_seed = executor.run_one(DIAMOND, "T", 6)
  assert other_seed.executed == 5  # The sampling key is part of the node's identity.


@pytest.mark.parametrize("accuracy", [1.0, 0.7])
def test_counterfactual_rerun_executes_only_the_nodes_downstream_of_the_edit(accuracy):
  graph = compile_spec(DIAMOND)
  edits = enumerate_edits(DIAMOND)
  assert {e.family for e in edits} == {"drop_edge", "reset_duty", "lower_capacity"}
  for edit in edits:
    pool = symbolic_pool(accuracy)
    executor = Executor(pool)
    original = executor.run_one(DIAMOND, "T", seed=3)
    rows_before = sum(w.rows for w in pool.values())
    edited = executor.run_one(edit.spec, "T", seed=3)
    ran = {i for i, n in enumerate(edited.nodes) if not n.cached}
    downstream = {edit.agent} | graph.descendants(edit.agent)
    assert ran == downstream, edit  # Every output in this pool depends on capacity, duty and inputs.
    assert sum(w.rows for w in pool.values()) - rows_before == len(downstream) == edited.executed
    unchanged = set(range(len(DIAMOND.agents))) - downstream
    assert all(edited.nodes[i] == original.nodes[i]._replace(cached=True) for i in unchanged)
    # The cache is transparent: a fresh executor gives the same edited run, node for node.
    assert _strip_cache_flags(edited) == _strip_cache_flags(Executor(symbolic_pool(accuracy)).run_one(
        edit.spec, "T", seed=3))


def test_an_edit_that_leaves_an_output_unchanged_stops_the_rerun_there():
  pool = programmatic_pool(symbolic("any"), accuracy={"small": 1.0, "medium": 1.0, "large": 1.0})
  executor = Executor(pool)
  original = executor.run_one(DIAMOND, "T", seed=0)
  lowered = [e for e in enumerate_edits(DIAMOND, families=["lower_capacity"]) if e.agent == 1][0]
  edited = executor.run_one(lowered.spec, "T", seed=0)
  assert [n.cached for n in edited.nodes] == [True, False, True, True, True]  # b re-ran; d's inputs did not change.
  assert edited.answer == original.answer
  assert edited.cost < original.cost  # ... but b's tokens now cost the medium price.


def test_sampling_keys_decide_the_programmatic_worker_draws():
  assert node_key(3, 1) == node_key(3, 1) and len({node_key(s, i) for s in range(20) for i in range(8)}) == 160
  worker = ProgrammaticWorker(symbolic("small"), accuracy=0.5)
  prompts = [format_agent_prompt(f"task {i}", "solver", "solve", []) for i in range(200)]
  keys = list(range(200))
  out = worker(prompts, keys)
  wrong = sum(t.endswith("?") for t in out.texts)
  assert 60 < wrong < 140  # Binomial(200, 0.5): mean 100, standard deviation about 7.
  assert worker(prompts[::-1], keys[::-1]).texts == out.texts[::-1]  # A row's draw ignores its batch.
  assert worker(prompts, [k + 1000 for k in keys]).texts != out.texts


def test_errors():
  executor = Executor(symbolic_pool())
  with pytest.raises(SpecError, match="unknown duty"):
    executor.run_one(Spec((Agent("a", "planner", "dance", "small"),), "a"), "T", 0)
  with pytest.raises(KeyError, match="no worker for capacity 'large'"):
    Executor({"small": symbolic_pool()["small"]}).run_one(CHAIN, "T", 0)
  with pytest.raises(ValueError, match="specs"):
    executor.run([CHAIN], ["T", "U"], [0])
  with pytest.raises(ValueError, match="no token price"):
    Executor(symbolic_pool(), token_prices={"small": 1.0})
  short = lambda prompts, keys: WorkerOutput(["x"], [1], [1])  # noqa: E731
  with pytest.raises(ValueError, match="answered 1 of 3"):
    Executor({"small": short, "medium": short, "large": short}).run([CHAIN, DIAMOND], ["A", "B"], [0, 0])
  assert executor.run([], [], []) == []


def test_node_cache_is_lru():
  cache = NodeCache(max_entries=2)
  for k in "abc":
    cache.put(k, NodeOutput(k, 1, 1))
  assert len(cache) == 2 and cache.get("a") is None and cache.get("b").text == "b"
  cache.put("d", NodeOutput("d", 1, 1))  # "c" is now the least recently used.
  assert cache.get("c") is None and cache.get("b") is not None
  assert (cache.hits, cache.misses) == (2, 2)


def test_model_workers_of_three_sizes_share_generate_batched_by_depth(monkeypatch):
  tok = ByteTokenizer()
  sizes = {"small": (32, 1), "medium": (48, 1), "large": (64, 2)}
  pool = {}
  for n, (cap, (width, layers)) in enumerate(sizes.items()):
    cfg = get_preset("tiny", vocab_size=tok.vocab_size, hidden_size=width, num_layers=layers, num_heads=2,
                     num_kv_heads=1, mlp_dim=2 * width)
    pool[cap] = ModelWorker(Transformer(cfg, rngs=nnx.Rngs(n)), tok, max_new_tokens=6, min_prompt_bucket=128)
  calls = []
  real_generate = sampling.generate

  def counting_generate(model, prompts, *args, **kwargs):
    calls.append(len(prompts))
    return real_generate(model, prompts, *args, **kwargs)

  monkeypatch.setattr(sampling, "generate", counting_generate)  # What ModelWorker calls.
  specs, tasks, seeds = [DIAMOND, CHAIN], ["2+3", "4*5"], [0, 1]
  executor = Executor(pool)
  runs = executor.run(specs, tasks, seeds)
  assert sorted(calls) == [1, 1, 2, 4]  # small (a, e, x; padded to 4), large (b, y), medium (c), medium (d).
  for run in runs:
    for node in run.nodes:
      assert node.prompt_tokens == len(encode_prompt(tok, node.prompt))
      assert 1 <= node.completion_tokens <= 6 and isinstance(node.output, str)
  assert runs[0].answer == runs[0].nodes[3].output
  # Greedy workers and the same batches: a fresh executor reproduces every output; the cache serves repeats.
  assert [_strip_cache_flags(r) for r in Executor(pool).run(specs, tasks, seeds)] == [
      _strip_cache_flags(r) for r in runs]
  calls.clear()
  assert all(r.executed == 0 for r in executor.run(specs, tasks, seeds)) and not calls
  with pytest.raises(ValueError, match="keys"):
    pool["small"](["a"], [])
  # max_batch splits a call into several generate calls; sampled workers are deterministic per batch.
  sampled = ModelWorker(pool["small"].model, tok, max_new_tokens=6, temperature=1.0, max_batch=2,
                        min_prompt_bucket=128)
  prompts = [format_agent_prompt(t, "solver", "solve", []) for t in "abcd"]
  out, again = sampled(prompts, [6, 7, 8, 9]), sampled(prompts, [6, 7, 8, 9])
  assert calls == [2, 2, 2, 2]  # max_batch=2: two generate calls per worker call.
  assert out.texts == again.texts
  np.testing.assert_array_equal(out.completion_tokens, again.completion_tokens)
