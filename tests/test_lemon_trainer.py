"""LEMON: the orchestration reward by hand, the counterfactual step on a tiny orchestrator, the tiny experiment.

The counterfactual step is checked on teacher-forced rollouts (known spec texts laid out exactly as the
sampler lays out completions: the trainer's own ``add_counterfactuals``, loss and update run on them), so
every edit family has specs to act on; the sampled path runs in the tiny end-to-end experiment.
Tolerances: float32 sums of a few hundred O(1) terms, so 1e-5 relative / 1e-6 absolute.
"""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import lemon_orchestration
from experiments.reports import lemon as report
from lemon_rl.envs import word_problems as wp
from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.envs.orchestration import Execution, Executor, SpecError, enumerate_edits, parse_spec
from lemon_rl.losses import advantages as advantages_lib
from lemon_rl.losses import counterfactual as cf_lib
from lemon_rl.models import Transformer, get_preset
from lemon_rl.text import ByteTokenizer, encode_prompt
from lemon_rl.training import experiment
from lemon_rl.training import lemon
from lemon_rl.training import state as state_lib
from lemon_rl.training import worker_models
from lemon_rl.training.batches import build_sequences, pad_completions
from lemon_rl.training.metrics import read_records
from lemon_rl.training.rollout import Rollout
from lemon_rl.training.sft import SFTTrainer

SETTINGS = lemon.RewardSettings(lambda_tok=0.5, lambda_graph=0.25, token_budget=1000.0)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPE = parse_spec("agents:\n- {id: a, role: extractor, duty: extract, cap: small}\n"
                  "- {id: b, role: calculator, duty: compute, cap: large, deps: [a]}\nanswer: b", wp.TASK_SCHEMA)


def _execution(spec, answer, prompt_tokens, completion_tokens, cost=0.0):
  return Execution(spec, "task", 0, (), answer, prompt_tokens, completion_tokens, cost, 0)


def test_orchestration_reward_by_hand():
  # Graph cost: small (1) + large (3) + one edge = 5, over the largest 4-agent spec: 4 x 3 + 6 edges = 18.
  run = _execution(PIPE, " 44 ", 300, 50)
  r = lemon.orchestration_reward(run, "44", SETTINGS, wp.TASK_SCHEMA)
  assert r.valid and r.success == 1.0 and r.worker_tokens == 350 and (r.nodes, r.edges) == (2, 1)
  assert r.token_efficiency == pytest.approx(0.65) and r.graph_cost == pytest.approx(5 / 18)
  assert r.total == pytest.approx(1.0 + 0.5 * 0.65 - 0.25 * 5 / 18)
  wrong = lemon.orchestration_reward(_execution(PIPE, "45", 300, 50), "44", SETTINGS, wp.TASK_SCHEMA)
  assert wrong.success == 0.0 and wrong.total == pytest.approx(r.total - 1.0)  # Success is worth exactly 1.
  over = lemon.orchestration_reward(_execution(PIPE, "44", 1500, 600), "44", SETTINGS, wp.TASK_SCHEMA)
  assert over.token_efficiency == 0.0  # Clipped at 0 past the budget.
  more_tokens = lemon.orchestration_reward(_execution(PIPE, "44", 400, 50), "44", SETTINGS, wp.TASK_SCHEMA)
  assert more_tokens.total < r.total  # Fewer tokens, higher reward (sign of lambda_tok).
  cost = dataclasses.replace(SETTINGS, token_measure="cost")
  assert lemon.orchestration_reward(_execution(PIPE, "44", 300, 50, cost=700.0), "44", cost,
                                    wp.TASK_SCHEMA).token_efficiency == pytest.approx(0.3)
  err = SpecError("agents[0].cap", "bad_capacity", "bad")
  bad = lemon.orchestration_reward(err, "44", SETTINGS)
  assert bad.total == -1.0 and not bad.valid and bad.error == "bad_capacity" and np.isnan(bad.worker_tokens)
  bigger = parse_spec("agents:\n- {id: a, role: extractor, duty: extract, cap: small}\n"
                      "- {id: c, role: critic, duty: critique, cap: small, deps: [a]}\n"
                      "- {id: b, role: calculator, duty: compute, cap: large, deps: [a, c]}\nanswer: b", wp.TASK_SCHEMA)
  assert lemon.graph_cost(bigger, SETTINGS, wp.TASK_SCHEMA) == pytest.approx((1 + 1 + 3 + 3) / 18)
  assert lemon.orchestration_reward(_execution(bigger, "44", 300, 50), "44", SETTINGS,
                                    wp.TASK_SCHEMA).total < r.total  # A bigger graph costs (sign of lambda_graph).


def _scorer():
  executor = Executor(wp.programmatic_workers(), schema=wp.TASK_SCHEMA, max_input_chars=wp.MAX_INPUT_CHARS)
  return lemon.OrchestrationScorer(executor, SETTINGS, breakdown_field="kind")


def test_scorer_parses_executes_in_one_batch_and_reports_parts():
  scorer = _scorer()
  ex = wp.examples(0, 2, "validation")
  texts = [PIPE_TEXT, "agents: [oops", PIPE_TEXT]
  out = scorer(["p"] * 3, texts, [[]] * 3, task=[ex[0]["task"], ex[0]["task"], ex[1]["task"]],
               answer=[ex[0]["answer"], ex[0]["answer"], ex[1]["answer"]], seed=[1, 1, 2],
               kind=[ex[0]["kind"], ex[0]["kind"], ex[1]["kind"]])
  assert out.rewards[1] == -1.0 and out.metrics["valid"].tolist() == [1.0, 0.0, 1.0]
  assert np.isnan(out.metrics["worker_tokens"][1]) and out.metrics["nodes"][0] == 2
  assert out.metrics["answer_capacity"][0] == 2.0  # The calculator is large.
  assert sum(w.calls for w in scorer.executor.workers.values()) == 2  # Depth 0 small, depth 1 large.
  success = scorer.success_view()(["p"] * 3, texts, [[]] * 3, task=[ex[0]["task"]] * 3, answer=[ex[0]["answer"]] * 3,
                                  seed=[1] * 3, kind=["add"] * 3)
  assert set(success.rewards.tolist()) <= {0.0, 1.0} and success.rewards[1] == 0.0


PIPE_TEXT = ("agents:\n- {id: a, role: planner, duty: extract, cap: small}\n"
             "- {id: b, role: calculator, duty: compute, cap: large, deps: [a]}\nanswer: b")
TEXTS = (
    PIPE_TEXT,
    "agents:\n- {id: a, role: extractor, duty: extract, cap: medium}\n"
    "- {id: b, role: verifier, duty: compute, cap: medium, deps: [a]}\nanswer: b",
    "agents:\n- {id: a, role: extractor, duty: extract, cap: small}\n"
    "- {id: b, role: critic, duty: critique, cap: small}\n"
    "- {id: c, role: solver, duty: compute, cap: large, deps: [b, a]}\nanswer: c",
    "agents: nope",  # Invalid: reward -1, no edit.
)
G = 4


def _rl_config(**changes):
  rl = lemon_orchestration.get_config("tiny").rl
  rl.num_generations = G
  rl.prompts_per_step = 2
  for k, v in changes.items():
    rl[k] = v
  return rl


@functools.lru_cache(maxsize=None)
def _policy():
  """One tiny orchestrator, optimizer and state for every trainer of this file (one init compile)."""
  cfg = get_preset("tiny", vocab_size=ByteTokenizer().vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                   num_kv_heads=1, mlp_dim=64)
  optimizer = state_lib.make_optimizer(1e-3, 10)
  graphdef, state = state_lib.create_train_state(Transformer(cfg, rngs=nnx.Rngs(0)), optimizer, 0)
  return graphdef, optimizer, state


def _trainer(families=lemon.EDIT_FAMILIES, mu=1.0, **rl_changes):
  graphdef, optimizer, state = _policy()
  settings = lemon.LemonSettings(mu=mu, families=families, floor=0.0)
  # A shorter sampling budget than the task's (every spec here fits) and the sampler's prompt bucket: short
  # sequences keep the tests fast; the layout is the same.
  trainer = lemon.LemonTrainer(graphdef, optimizer, ByteTokenizer(), _scorer(),
                               _rl_config(**{"max_new_tokens": 192, **rl_changes}), settings, prompt_len=None,
                               seed=0)
  return trainer, state


def forced_rollout(trainer, examples, texts):
  """A rollout of the given completion texts, laid out as ``collect_rollout`` lays out sampled ones."""
  tok, g = trainer.tokenizer, trainer.cfg.num_generations
  prompt_ids = [encode_prompt(tok, ex["prompt"]) for ex in examples for _ in range(g)]
  ids, mask = pad_completions([tok.encode(t) + [tok.eos_id] for t in texts], trainer.cfg.max_new_tokens, tok.pad_id)
  batch = build_sequences(prompt_ids, ids, mask, tok.pad_id, trainer.prompt_len)
  fields = {k: [ex[k] for ex in examples for _ in range(g)] for k in examples[0] if k != "prompt"}
  rewards = trainer.scorer(None, list(texts), None, **fields).rewards
  group_ids = np.repeat(np.arange(len(examples)), g).astype(np.int32)
  adv = np.asarray(advantages_lib.ADVANTAGE_ESTIMATORS.get("grpo")(jnp.asarray(rewards), jnp.asarray(group_ids),
                                                                   len(examples)), np.float32)
  batch["advantages"] = adv
  return Rollout(prompt_ids, batch, rewards, adv, group_ids, list(texts), {})


def _counterfactual_rollout(trainer, step=0):
  examples = trainer.with_execution_seeds(wp.examples(0, 2, "validation"), step)
  texts = [TEXTS[i % len(TEXTS)] for i in range(2 * G)]
  return trainer.add_counterfactuals(forced_rollout(trainer, examples, texts), examples, step), examples


FIELD_TEXT = {"drop_edge": lambda e, spec: spec.agents[e.agent].depends_on[e.dep],
              "reset_duty": lambda e, spec: spec.agents[e.agent].duty,
              "lower_capacity": lambda e, spec: spec.agents[e.agent].capacity}


@pytest.mark.parametrize("family", lemon.EDIT_FAMILIES)
def test_counterfactual_step_credits_exactly_the_edited_field(family):
  trainer, _ = _trainer(families=(family,))
  ro, examples = _counterfactual_rollout(trainer)
  batch, tok = ro.batch, trainer.tokenizer
  p = batch["ids"].shape[1] - trainer.cfg.max_new_tokens
  fresh = _scorer()  # Independent re-execution: no shared cache.
  edited_rows = 0
  for i, (text, edit) in enumerate(zip(ro.completions, ro.edits)):
    applicable = enumerate_edits(ro.scored[i].spec, wp.TASK_SCHEMA, (family,)) if ro.scored[i].spec else []
    assert (edit is None) == (not applicable)
    if edit is None:
      assert ro.dc[i] == 0 and not batch["span_mask"][i].any()
      continue
    edited_rows += 1
    assert edit.family == family
    cols = np.flatnonzero(batch["span_mask"][i])
    a, b = ro.token_spans[i]
    assert cols.tolist() == list(range(p - 1 + a, p - 1 + b))  # Exactly the field's tokens, nothing else.
    assert tok.decode(batch["ids"][i, 1:][cols].tolist()) == FIELD_TEXT[family](edit, ro.scored[i].spec)
    assert np.all(batch["loss_mask"][i, cols] == 1)
    ex = examples[i // G]
    orig, new = fresh.score([text], [ex["task"]], [ex["answer"]], [ex["seed"]])[0], fresh.reward(
        fresh.executor.run_one(edit.spec, ex["task"], ex["seed"]), ex["answer"])
    assert ro.dc[i] == np.float32(orig.reward.total - new.total)
  assert edited_rows == sum(ro.scored[i].spec is not None for i in range(len(ro.scored))) == 6
  m = ro.metrics
  assert m["lemon/invalid_share"] == pytest.approx(2 / 8) and m[f"lemon/{family}/edits"] == 6
  assert m["lemon/edit_share"] == pytest.approx(6 / 8) and m["lemon/cf_nodes_executed"] <= m["lemon/cf_nodes_total"]
  assert m["lemon/cache_hits_originals"] == 2 + 2 + 3 + 2 + 2 + 3  # The originals were all cached.
  assert trainer.sampler.counts.tolist() == [6]
  assert trainer.sampler.means[0] == pytest.approx(np.abs(ro.dc[[e is not None for e in ro.edits]]).mean())


def test_dropping_a_needed_edge_has_positive_contrast():
  trainer, _ = _trainer(families=("drop_edge",))
  ro, _ = _counterfactual_rollout(trainer)
  for i, edit in enumerate(ro.edits):
    if edit is not None and ro.scored[i].reward.success == 1.0 and ro.scored[i].text == PIPE_TEXT:
      assert ro.dc[i] > 0.9  # The calculator loses its expression: success 1 -> 0 (graph cost falls a little).


def test_cf_gradient_is_zero_outside_the_span_and_has_the_sign_of_dc():
  trainer, state = _trainer()
  ro, _ = _counterfactual_rollout(trainer)
  batch = {k: jnp.asarray(v) for k, v in ro.batch.items()}
  batch["denominators"] = jnp.asarray(trainer.loss.denominators(ro.batch, 1))
  span = np.asarray(ro.batch["span_mask"])
  assert span.any() and np.any(ro.dc != 0)

  def cf_value(lg):
    term = trainer.loss.terms(lg, batch)[1][0]
    return term.sum / term.denominator

  def cf_of_logp(lp):  # The same term as a function of the log-probs (ratio 1: on-policy).
    term = cf_lib.counterfactual_loss(lp, jax.lax.stop_gradient(lp), batch["dc"], batch["span_mask"],
                                      completion_mask=batch["loss_mask"])[0]
    return term.sum / term.denominator

  @jax.jit
  def grads(params):
    lg = nnx.merge(trainer.graphdef, params)(batch["ids"], batch["attention_mask"])[:, :-1]
    logp = trainer.loss.sampling.token_log_probs(lg, batch["ids"][:, 1:])
    loss, metrics = trainer.loss.from_logits(lg, batch)
    return jax.grad(cf_value)(lg), jax.grad(cf_of_logp)(logp), loss.value, metrics["grpo/loss"].value, cf_value(lg)

  grad_logits, grad_logp, total, grpo, cf = jax.device_get(grads(state.params))
  outside = span == 0
  assert np.all(grad_logits[outside] == 0.0)  # Exactly zero: not just small.
  assert np.all(np.abs(grad_logits).sum(-1)[(span != 0) & (ro.dc[:, None] != 0)] > 0)
  # d L_cf / d logp = -dc / (span tokens) on the span: a positive dc raises the field's probability.
  expected = np.broadcast_to(-ro.dc[:, None], span.shape)[span != 0] / span.sum()
  np.testing.assert_allclose(grad_logp[span != 0], expected, rtol=1e-5, atol=1e-8)
  assert np.all(grad_logp[outside] == 0.0)
  assert float(total) == pytest.approx(float(grpo) + float(cf), rel=1e-5)  # L_GRPO + mu L_cf, mu = 1.


def test_microbatched_update_equals_the_whole_batch():
  trainer, state = _trainer(microbatch_size=4, num_iterations=1)  # 8 rows: 2 micro-batches.
  ro, _ = _counterfactual_rollout(trainer)
  host = dict(ro.batch, denominators=trainer.loss.denominators(ro.batch, 1))
  whole = jax.jit(lambda p, b: trainer.loss(nnx.merge(trainer.graphdef, p), b)[0].value)(
      state.params, {k: jnp.asarray(v) for k, v in host.items()})
  new_state, metrics = trainer.update(jax.tree.map(jnp.copy, state), ro)  # The two micro-batches' pieces.
  assert metrics["train/loss"] == pytest.approx(float(whole), rel=1e-5, abs=1e-6)
  assert int(new_state.step) == int(state.step) + 1
  assert metrics["train/cf/edit_frac"] == pytest.approx(6 / 8)
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params),
                                                       jax.tree.leaves(new_state.params)))


def test_mu_zero_is_plain_grpo_without_edits():
  trainer, _ = _trainer(mu=0.0)
  ro, _ = _counterfactual_rollout(trainer)
  assert all(e is None for e in ro.edits) and not ro.batch["span_mask"].any() and not trainer.signal_without_variance
  assert trainer.sampler.counts.sum() == 0


def test_iterator_checkpoints_the_sampler_state():
  trainer, _ = _trainer()
  _counterfactual_rollout(trainer)
  it = lemon.LemonIterator(BatchIterator(wp.examples(0, 8, "rl"), batch_size=2, seed=0), trainer.sampler)
  next(it)
  state = json.loads(json.dumps(it.get_state()))  # Checkpoint metadata is JSON.
  draws = [trainer.sampler.sample() for _ in range(5)]
  other = cf_lib.EditFamilySampler(lemon.EDIT_FAMILIES, floor=0.0)
  it2 = lemon.LemonIterator(BatchIterator(wp.examples(0, 8, "rl"), batch_size=2, seed=0), other)
  it2.set_state(state)
  assert [other.sample() for _ in range(5)] == draws and other.counts.tolist() == trainer.sampler.counts.tolist()


def test_edit_effects_cover_every_edit_of_every_valid_spec():
  scorer = _scorer()
  ex = wp.examples(0, 3, "validation")
  texts = [t for t in TEXTS for _ in range(3)]
  effects = lemon.edit_effects(scorer, texts, [e["task"] for e in ex] * 4, [e["answer"] for e in ex] * 4,
                               [e["seed"] for e in ex] * 4)
  assert effects["valid_share"] == pytest.approx(0.75)
  fam = effects["families"]
  assert fam["drop_edge"]["num_edits"] == 3 + 3 + 6 and fam["reset_duty"]["num_edits"] == 3 + 3 + 3
  assert fam["lower_capacity"]["num_edits"] == 3 + 6 + 3 and fam["drop_edge"]["applicable_share"] == 1.0
  assert fam["lower_capacity"]["changed_share"] == 1.0  # A lower capacity always changes the graph cost.
  for f in fam.values():
    assert 0 <= f["useful_share"] <= f["applicable_share"] and f["abs_dc_q10"] <= f["abs_dc_q50"] <= f["abs_dc_q90"]


def test_tiny_config_end_to_end(tmp_path):
  config = lemon_orchestration.get_config("tiny")
  summary = experiment.run(config, str(tmp_path))
  assert summary["rl_steps"] == config.rl.steps
  records = read_records(os.path.join(str(tmp_path), "metrics.jsonl"))
  rl = [r for r in records if r["phase"] == "rl"]
  assert len(rl) == config.rl.steps
  for r in rl:
    assert 0.0 <= r["lemon/invalid_share"] <= 1.0 and -1.0 <= r["reward/total/mean"] <= 2.0
    assert r["lemon/edit_share"] is None or r["lemon/edit_share"] <= 1.0 - r["lemon/invalid_share"] + 1e-9
  evals = [r for r in records if r["phase"] == "eval_rl"]
  assert evals and 0.0 <= evals[-1]["accuracy"] <= 1.0 and "valid" in evals[-1]


def _reproduce(workdir, results_file, *flags_):
  args = [sys.executable, "-m", "experiments.reproduce_lemon", "--variant=tiny", f"--workdir={workdir}",
          f"--results_file={results_file}", "--seeds=0,1", "--arms=sft_only,grpo,no_sft", *flags_]
  return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_tiny_reproduction_runs_in_parallel_reads_finished_arms_back_and_goes_on_from_stored_arms(tmp_path):
  workdir, results_file = str(tmp_path / "runs"), str(tmp_path / "results.json")
  proc = _reproduce(workdir, results_file, "--workers=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(results_file) as f:
    saved = json.load(f)
  assert [entry["seed"] for entry in saved["seeds"]] == [0, 1]
  assert not saved["done"]  # Three of the seven arms: the experiment stays partial.
  for entry in saved["seeds"]:
    assert set(entry["step0"]) >= {"effects", "gate"} and list(entry["arms"]) == ["sft_only", "grpo", "no_sft"]
    for arm, record in entry["arms"].items():
      assert "accuracy" in record["final"] and "step0" not in record, arm
      assert len(record["curves"]["reward/total/mean"]) == (0 if arm == "sft_only" else 2), arm
  # The RL arms after SFT start from a copy of the seed's SFT checkpoint; no_sft starts from scratch.
  assert os.path.isdir(os.path.join(workdir, "seed_1", "grpo", "checkpoints", "sft"))
  assert not os.path.exists(os.path.join(workdir, "seed_1", "no_sft", "checkpoints", "sft"))
  finished = [os.path.join(workdir, f"seed_{s}", arm, "arm.json") for s in (0, 1) for arm in ("sft_only", "grpo")]
  stamps = [os.path.getmtime(path) for path in finished]
  # Rerun into another results file, one process: every arm is read back from the workdir (no run, no step-0
  # check), and the results are the same.
  reread_file = str(tmp_path / "reread.json")
  proc = _reproduce(workdir, reread_file)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert [os.path.getmtime(path) for path in finished] == stamps
  with open(reread_file) as f:
    assert {**json.load(f), "command": None} == {**saved, "command": None}
  assert "LEMON - global GRPO, accuracy" in proc.stdout
  # On another machine (an empty workdir), the arms stored beside the results file are restored: nothing runs.
  proc = _reproduce(str(tmp_path / "elsewhere"), results_file)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "6 finished arms restored" in proc.stdout
  assert not os.path.exists(tmp_path / "elsewhere" / "seed_0" / "sft_only" / "checkpoints")
  with open(results_file) as f:
    assert {**json.load(f), "command": None} == {**saved, "command": None}
  # One RL arm missing from the store: its seed's SFT is re-run and checked against the stored one's evaluations,
  # and the arm runs again from it, to the same final evaluation.
  shutil.rmtree(tmp_path / "arms" / "seed_1" / "grpo")
  proc = _reproduce(str(tmp_path / "partial"), str(tmp_path / "partial.json"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "5 finished arms restored" in proc.stdout
  assert os.listdir(tmp_path / "partial" / "seed_1" / "sft_only" / "checkpoints" / "sft")
  with open(tmp_path / "partial.json") as f:
    assert json.load(f)["seeds"][1]["arms"]["grpo"]["final"] == saved["seeds"][1]["arms"]["grpo"]["final"]


def test_config_arms_and_checks():
  assert lemon_orchestration.get_config("tiny_grpo").lemon.mu == 0.0
  assert lemon_orchestration.get_config("tiny_sft_only").rl.steps == 0
  assert lemon_orchestration.get_config("tiny_no_sft").sft.steps == 0
  assert lemon_orchestration.get_config("cpu_no_reset_duty").lemon.families == ("drop_edge", "lower_capacity")
  with pytest.raises(ValueError, match="unknown"):
    lemon_orchestration.get_config("tiny_nope")
  bad = lemon_orchestration.get_config("tiny")
  bad.lemon.families = ("drop_edge", "swap_roles")
  with pytest.raises(Exception, match="families"):
    lemon.check_config(bad)
  bad = lemon_orchestration.get_config("tiny")
  bad.rl.dynamic_sampling = True
  with pytest.raises(Exception, match="dynamic_sampling"):
    lemon.check_config(bad)


def test_report_renders_directions_and_step0_from_saved_results():
  def arm(acc, tokens):
    return {"final": {"accuracy": acc, "worker_tokens": tokens, "nodes": 2.0, "edges": 1.0, "valid": 1.0},
            "curves": {"reward/total/mean": [[1, 0.5], [2, 0.7]], "lemon/worker_tokens": [[1, 400], [2, 350]]}}

  seeds = []
  for s in range(3):
    step0 = {"effects": {"valid_share": 0.9, "families": {f: {"applicable_share": 0.5, "changed_share": 1.0,
                                                               "success_changed_share": 0.3, "useful_share": 0.1,
                                                               "mean_abs_dc": 0.3, "abs_dc_q10": 0.01,
                                                               "abs_dc_q50": 0.05, "abs_dc_q90": 1.0}
                                                           for f in report.FAMILIES}},
             "gate": {"checks": [{"statistic": "valid_share", "bound": "min", "threshold": 0.5, "value": 0.9,
                                  "passed": True}]}}
    seeds.append({"seed": s, "step0": step0, "arms": {
        "sft_only": arm(0.5, 500), "grpo": arm(0.6 + 0.01 * s, 450), "lemon": arm(0.7 + 0.01 * s, 400 - s),
        "no_sft": arm(0.0, 0.0), "no_drop_edge": arm(0.65 - 0.02 * s, 420)}})
  saved = {"command": "cmd", "machine": "cpu", "family_alpha": 0.05, "done": True, "workers": None, "seeds": seeds,
           "setup": {"reward": {"lambda_tok": 0.5, "lambda_graph": 0.5, "token_budget": 1000, "invalid_reward": -1},
                     "sft_steps": 1, "sft_batch": 2, "rl_steps": 2, "rl_prompts": 2, "num_generations": 4,
                     "eval_examples": 8}}
  text = report.render(saved)
  rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| LEMON")}
  assert rows["LEMON - global GRPO, accuracy"].endswith("| reproduced |")
  assert rows["LEMON - global GRPO, worker tokens"].endswith("| reproduced |")
  assert rows["LEMON without SFT - LEMON, accuracy"].endswith("| reproduced |")
  assert "no paired seeds" in rows["LEMON - LEMON without reset_duty, accuracy"]
  assert "| drop_edge |" in text and "passed on 3 of 3 seeds" in text
  assert "3 of the 5 seeds the experiment plans" in text.splitlines()[0]
  five = {**saved, "seeds": seeds + [{**seeds[0], "seed": s} for s in (3, 4)]}
  assert "seeds the experiment plans" not in report.render(five)


_TINY_WORKER = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 32}
_WORKER_SIZES = {c: _TINY_WORKER for c in ("small", "medium", "large")}


def _train_tiny_workers(out: str, training: dict, sizes=None, demos=None) -> dict:
  demos = demos or wp.worker_demonstrations(0, 16, "workers")
  eval_demos = wp.worker_demonstrations(0, 8, "workers_eval")
  return worker_models.train_worker_models(demos, eval_demos, sizes or _WORKER_SIZES, training, out,
                                           ByteTokenizer(), prompt_len=wp.WORKER_PROMPT_LEN, max_new_tokens=4,
                                           log=lambda _: None)


def test_worker_training_reuses_saved_models_only_under_the_same_settings(tmp_path):
  out = str(tmp_path / "workers")
  training = {"steps": 2, "batch_size": 4, "learning_rate": 1e-3, "warmup_steps": 0, "seed": 0}
  run_settings = {**training, "checkpoint_every": 1}  # Not a setting of the models.
  meta = _train_tiny_workers(out, run_settings)
  digest = worker_models.demonstrations_digest(wp.worker_demonstrations(0, 16, "workers"))
  assert meta["training"] == {**training, "demonstrations": digest}
  assert set(meta["skills"]) == set(meta["train_s"]) == set(_WORKER_SIZES)
  assert sorted(os.listdir(out)) == ["large.npz", "large_training", "medium.npz", "medium_training", "small.npz",
                                     "small_training", "workers.json"]
  assert os.listdir(os.path.join(out, "small_training")) == ["metrics.jsonl"]  # Checkpoints go once saved.
  stamps = {c: os.path.getmtime(os.path.join(out, f"{c}.npz")) for c in _WORKER_SIZES}
  assert _train_tiny_workers(out, run_settings)["training"]["steps"] == 2  # Same settings: loaded, not retrained.
  assert {c: os.path.getmtime(os.path.join(out, f"{c}.npz")) for c in _WORKER_SIZES} == stamps
  with pytest.raises(ValueError, match=r"training.steps: saved 2, requested 3"):
    _train_tiny_workers(out, {**run_settings, "steps": 3})
  with pytest.raises(ValueError, match=r"sizes.large: saved"):
    _train_tiny_workers(out, run_settings, {**_WORKER_SIZES, "large": {**_TINY_WORKER, "mlp_dim": 64}})
  taught_otherwise = [{**d, "completion": d["completion"] + "!"} if i == 3 else d  # Another world's rules.
                      for i, d in enumerate(wp.worker_demonstrations(0, 16, "workers"))]
  with pytest.raises(ValueError, match=rf"training.demonstrations: saved '{digest}'"):
    _train_tiny_workers(out, run_settings, demos=taught_otherwise)


def test_worker_training_stopped_by_sigterm_resumes_to_the_same_models(tmp_path, monkeypatch):
  """A SIGTERM during the medium model's second step stops the training after a checkpoint of that step; the
  rerun skips the small model, resumes the medium one and ends with the models of an uninterrupted run."""
  training = {"steps": 4, "batch_size": 4, "learning_rate": 1e-3, "warmup_steps": 0, "seed": 0,
              "checkpoint_every": 100}
  straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
  _train_tiny_workers(straight, training)
  real_step, calls = SFTTrainer.step, []

  def step_then_sigterm(self, *args, **kwargs):
    calls.append(1)
    out = real_step(self, *args, **kwargs)
    if len(calls) == training["steps"] + 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return out

  monkeypatch.setattr(SFTTrainer, "step", step_then_sigterm)
  with pytest.raises(experiment.Preempted, match="worker_medium: SIGTERM received; checkpoint saved at step 2"):
    _train_tiny_workers(stopped, training)
  assert sorted(f for f in os.listdir(stopped) if f.endswith(".npz")) == ["small.npz"]
  assert os.path.isdir(os.path.join(stopped, "medium_training", "checkpoints", "worker_medium", "2"))
  with pytest.raises(ValueError, match=r"sizes.medium: saved"):  # A model in training keeps its settings too.
    _train_tiny_workers(stopped, training, {**_WORKER_SIZES, "medium": {**_TINY_WORKER, "mlp_dim": 64}})
  monkeypatch.undo()
  _train_tiny_workers(stopped, training)
  steps = [r["step"] for r in read_records(os.path.join(stopped, "medium_training", "metrics.jsonl"))
           if r["phase"] == "worker_medium"]
  assert steps == [1, 2, 3, 4]
  for cap in _WORKER_SIZES:
    with np.load(os.path.join(straight, f"{cap}.npz")) as a, np.load(os.path.join(stopped, f"{cap}.npz")) as b:
      assert a.files == b.files
      for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{cap} {name}")


def test_worker_gate_compares_each_capacity_and_every_gap_with_the_thresholds():
  skills = {"small": {"multiply": 0.25, "add": 0.9}, "medium": {"multiply": 0.5, "add": 0.95},
            "large": {"multiply": 0.6, "add": 1.0}}
  gate = worker_models.worker_gate(skills, {"min_multiply_large_minus_medium": 0.15, "min_multiply_large": 0.5})
  assert gate["statistics"]["multiply_large_minus_medium"] == pytest.approx(0.1)
  assert gate["statistics"]["add_medium_minus_small"] == pytest.approx(0.05)
  assert gate["statistics"]["multiply_large_minus_small"] == pytest.approx(0.35)
  assert gate["statistics"]["add_small"] == 0.9 and len(gate["statistics"]) == 2 * (3 + 3)  # Scores, every gap.
  assert not gate["passed"]
  assert [c["passed"] for c in gate["checks"]] == [False, True]
  text = report.gate_checks(gate)
  assert text == "`multiply_large_minus_medium` = 0.100 (>= 0.15): FAILED; `multiply_large` = 0.600 (>= 0.5): passed"
  assert worker_models.worker_gate({**skills, "large": {"multiply": 0.7, "add": 1.0}},
                           {"min_multiply_large_minus_medium": 0.15})["passed"]
  with pytest.raises(ValueError, match="unknown statistic"):
    worker_models.worker_gate(skills, {"min_multiply_huge": 0.5})
  lines = report.workers_table({"skills": skills, "sizes": {}}, gate)
  assert lines[-1].startswith("Worker gate") and "FAILED" in lines[-1]
  stopped = report.render({"command": "cmd", "machine": "cpu", "setup": {"reward": {}}, "seeds": [],
                           "workers": {"skills": skills, "sizes": {}}, "worker_gate": gate})
  assert "stopped at the worker gate" in stopped and "FAILED" in stopped and "| large |" in stopped
  overridden = report.workers_table({"skills": skills, "sizes": {}}, {**gate, "overridden": True})
  assert "FAILED" in overridden[-1] and "ran anyway" in overridden[-1]


def test_worker_params_round_trip_and_skill_scores(tmp_path):
  tok = ByteTokenizer()
  small = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 32}
  a = worker_models.worker_model(small, tok.vocab_size, seed=1)
  b = worker_models.worker_model(small, tok.vocab_size, seed=2)
  path = os.path.join(str(tmp_path), "small.npz")
  worker_models.save_params(path, a)
  worker_models.load_params(path, b)
  for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="shape|match"):
    worker_models.load_params(path, worker_models.worker_model({**small, "hidden_size": 32}, tok.vocab_size))
  with pytest.raises(FileNotFoundError, match="train the workers"):
    worker_models.load_worker_models(str(tmp_path), {c: small for c in ("small", "medium", "large")}, tok,
                                     max_new_tokens=4)
  demos = wp.worker_demonstrations(0, 600, "workers_eval")
  scores = worker_models.score_workers(wp.programmatic_workers(), demos)
  assert scores["small"]["exact"] == scores["large"]["exact"] == 1.0
  assert scores["small"]["multiply"] < scores["medium"]["multiply"] < scores["large"]["multiply"]
