"""Tests of the FEST trainer step (lemon_rl.training.fest) and its plumbing into the runner.

The loss pieces are checked on a constructed batch with a small real Transformer against NumPy
transcriptions of METHODS.md section 2 (adaptive beta, decaying weight, semi-online DPO, weighted SFT, the
clipped surrogate); the end-to-end check runs ``configs/fest_math.py:tiny`` through ``experiments.main``.
"""

import json
import os
import subprocess
import sys
import types

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import fest_math
from lemon_rl.models import Transformer, get_preset
from lemon_rl.training import fest as fest_lib
from lemon_rl.training import phases
from lemon_rl.training import state as state_lib
from lemon_rl.training.config_validation import ConfigError, validate_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 32
B1, B2, B3 = 0.05, 0.2, 0.7  # Far from the defaults so that a mix-up shows.
EPS_LOW, EPS_HIGH = 0.2, 0.28
EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7
# Float32 error budget (worst case) of a log-prob of make_model's model (d 32, MLP 64, V = VOCAB) computed by
# two differently compiled forwards (or against the float64 reference): contractions over d + MLP + V terms,
# each of the size of a log-prob (|logp| <= ~4 for a fresh model over 32 tokens).
DLOGP = (32 + 64 + VOCAB) * EPS32 * 4
DSEQ = 6 * DLOGP  # A sequence sum of <= 6 completion log-probs.
SEQ_MAX = 6 * 5.0  # |sum of <= 6 log-probs| of a fresh model.
# The decaying weight beta sigmoid(beta (r- - r+)), relative: slope beta (1 - sigmoid) <= B3 in r+ - r- (within
# 2 DSEQ), plus a sigmoid and a few roundings.
DW_REL = B3 * 2 * DSEQ + 8 * EPS32


def loss_atol(batch, algorithm):
  """The float32 error budget of ``c L_E + L_I`` (c = 0.7) against another forward or the reference.

  L_I: per-token terms A r, with r = exp(logp - old_logp) <= exp(-old_logp) (logp <= 0) off by DLOGP relative.
  L_E: FEST-DPO -log sigmoid(beta margin), slope <= beta in a margin within 2 DSEQ; FEST-GRPO -w log pi(y+),
  off by w DSEQ + |log pi(y+)| w DW_REL.
  """
  rl, ex = batch["rl"], batch["expert"]
  a_max = max(np.abs(rl["advantages"]).max(), np.abs(ex["neg_advantages"]).max())
  r_max = np.exp(-min(rl["old_logp"].min(), ex["neg_old_logp"].min()))
  d_le = B3 * 2 * DSEQ if algorithm == "fest_dpo" else B3 * (DSEQ + SEQ_MAX * DW_REL)
  return float(0.7 * d_le + a_max * r_max * DLOGP)


def np_log_softmax_logp(logits, ids):
  logits = np.asarray(logits, np.float64)[:, :-1]
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return np.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0] - lse


def np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def make_model(seed):
  cfg = get_preset("tiny", vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def make_batch(correct, num_rl_rows=4, prompt_len=4, completion_len=6, seed=0):
  """A FEST batch: ``num_rl_rows`` D_I rollouts, ``E x G`` D_E rollouts and ``E`` expert solutions."""
  correct = np.asarray(correct, np.float32)
  e, g = correct.shape
  rng = np.random.default_rng(seed)
  t = prompt_len + completion_len

  def seqs(n):
    ids = rng.integers(1, VOCAB, (n, t)).astype(np.int32)
    lengths = rng.integers(2, completion_len + 1, n)
    comp = (np.arange(completion_len)[None] < lengths[:, None]).astype(np.int32)
    attn = np.concatenate([np.ones((n, prompt_len), np.int32), comp], 1)
    loss_mask = np.pad(comp, ((0, 0), (prompt_len - 1, 0))).astype(np.float32)
    return ids, attn, loss_mask

  rl_ids, rl_attn, rl_mask = seqs(num_rl_rows)
  neg_ids, neg_attn, neg_mask = seqs(e * g)
  pos_ids, pos_attn, pos_mask = seqs(e)
  noise = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)
  return {
      "rl": {"ids": rl_ids, "attention_mask": rl_attn, "loss_mask": rl_mask,
             "old_logp": -2.0 + noise(num_rl_rows, t - 1), "advantages": rng.standard_normal(num_rl_rows)
             .astype(np.float32)},
      "expert": {
          "pos_ids": pos_ids, "pos_attention_mask": pos_attn, "pos_loss_mask": pos_mask,
          "ref_logp_pos": (-10.0 + 3 * rng.standard_normal(e)).astype(np.float32),
          "neg_ids": neg_ids.reshape(e, g, t), "neg_attention_mask": neg_attn.reshape(e, g, t),
          "neg_loss_mask": neg_mask.reshape(e, g, t - 1), "neg_old_logp": -2.0 + noise(e, g, t - 1),
          "neg_advantages": rng.standard_normal((e, g)).astype(np.float32),
          "ref_logp_neg": (-10.0 + 3 * rng.standard_normal((e, g))).astype(np.float32),
          "correct": correct,
      },
  }


def with_denominators(loss, batch, num_microbatches=1):
  batch = dict(batch)
  batch["denominators"] = fest_lib.global_denominators(loss, batch, num_microbatches)
  return jax.tree.map(jnp.asarray, batch)


def np_clipped(logp, old_logp, adv, mask):
  """Token-mean PPO clip with asymmetric range, a NumPy transcription."""
  ratio = np.exp(logp - old_logp)
  a = adv[:, None]
  per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
  return (per_token * mask).sum() / mask.sum()


def np_reference_terms(model, batch, algorithm):
  """``(L_E, L_I)`` from separate forward passes and NumPy formulas."""
  rl, ex = batch["rl"], batch["expert"]
  e, g, t = ex["neg_ids"].shape
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda p, ids, attn: nnx.merge(graphdef, p)(ids, attn))
  logp = lambda ids, attn: np_log_softmax_logp(forward(params, jnp.asarray(ids), jnp.asarray(attn)),
                                               np.asarray(ids))
  lp_rl = logp(rl["ids"], rl["attention_mask"])
  lp_neg = logp(ex["neg_ids"].reshape(e * g, t), ex["neg_attention_mask"].reshape(e * g, t))
  lp_pos = logp(ex["pos_ids"], ex["pos_attention_mask"])
  neg_mask = ex["neg_loss_mask"].reshape(e * g, t - 1)
  pos_mask = ex["pos_loss_mask"]
  seq_neg = (lp_neg * neg_mask).sum(-1)
  seq_pos = np.repeat((lp_pos * pos_mask).sum(-1), g)
  correct = ex["correct"] > 0
  solved = np.repeat(correct.any(1), g)
  correct = correct.reshape(-1)
  beta = np.where(correct, B3, np.where(solved, B2, B1))
  r_pos = seq_pos - np.repeat(ex["ref_logp_pos"], g)
  r_neg = seq_neg - ex["ref_logp_neg"].reshape(-1)
  if algorithm == "fest_dpo":
    l_e = np.mean(np.logaddexp(0.0, -beta * (r_pos - r_neg)))  # -log sigmoid(beta (r+ - r-)).
    l_i = np_clipped(lp_rl, rl["old_logp"], rl["advantages"], rl["loss_mask"])
  else:
    w = beta * np_sigmoid(beta * (r_neg - r_pos))
    l_e = -np.mean(w * seq_pos)
    l_i = np_clipped(np.concatenate([lp_rl, lp_neg]),
                     np.concatenate([rl["old_logp"], ex["neg_old_logp"].reshape(e * g, t - 1)]),
                     np.concatenate([rl["advantages"], ex["neg_advantages"].reshape(-1)]),
                     np.concatenate([rl["loss_mask"], neg_mask]))
  return l_e, l_i, beta, w if algorithm == "fest_grpo" else beta * np_sigmoid(beta * (r_neg - r_pos))


def make_loss(algorithm, c=0.7):
  return fest_lib.FestLoss(algorithm=algorithm, c=c, beta1=B1, beta2=B2, beta3=B3, eps_low=EPS_LOW,
                           eps_high=EPS_HIGH)


@pytest.fixture(scope="module")
def model():
  return make_model(0)


# -- host-side step pieces -------------------------------------------------------------------------


def test_beta_case_counts_and_all_wrong_fraction():
  correct = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
  assert fest_lib.beta_case_counts(correct) == {
      "fest/beta_case/all_wrong": 3.0, "fest/beta_case/this_wrong": 3.0, "fest/beta_case/this_right": 6.0}
  assert fest_lib.all_wrong_fraction(correct) == 0.25
  assert fest_lib.all_wrong_fraction(np.zeros((2, 4))) == 1.0


def test_decaying_weight_stats():
  w = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
  stats = fest_lib.decaying_weight_stats(w)
  f64 = 8 * np.finfo(np.float64).eps  # float64 mean of 5 / interpolation: a few roundings of values <= 0.5
  assert stats["fest/decaying_weight/mean"] == pytest.approx(0.3, rel=0, abs=f64)
  assert stats["fest/decaying_weight/min"] == 0.1 and stats["fest/decaying_weight/max"] == 0.5  # selections
  assert stats["fest/decaying_weight/q50"] == pytest.approx(0.3, rel=0, abs=f64)
  # Linear interpolation: 0.1 + 0.4 * 0.1.
  assert stats["fest/decaying_weight/q10"] == pytest.approx(0.14, rel=0, abs=f64)


def test_two_stream_iterator_layout_and_state():
  from lemon_rl.data.pipeline import BatchIterator  # pylint: disable=g-import-not-at-top
  rl = [{"prompt": f"r{i}", "answer": str(i)} for i in range(10)]
  expert = [{"prompt": f"e{i}", "answer": str(i), "completion": f"y{i}", "solution": "x"} for i in range(5)]
  make = lambda: fest_lib.TwoStreamIterator(BatchIterator(rl, batch_size=3, seed=1),
                                            BatchIterator(expert, batch_size=2, seed=1))
  it = make()
  first = next(it)
  assert first["stream"] == ["rl"] * 3 + ["expert"] * 2
  assert set(first) == {"prompt", "stream", "expert_completion", "answer"}
  assert first["expert_completion"][:3] == [""] * 3
  assert all(c == "y" + p[1:] for p, c in zip(first["prompt"][3:], first["expert_completion"][3:]))
  state = json.loads(json.dumps(it.get_state()))  # Goes into the checkpoint metadata as JSON.
  expected = [next(it) for _ in range(4)]  # Past the end of an epoch of D_E.
  resumed = make()
  resumed.set_state(state)
  assert [next(resumed) for _ in range(4)] == expected


# -- the loss on a constructed batch ---------------------------------------------------------------


class FestLossTest(chex.TestCase):

  @chex.variants(with_jit=True)
  def test_beta_cases_and_weights(self):
    model = make_model(0)
    # Prompt 0: all wrong (beta1); prompt 1: one right (beta3 for it, beta2 for the others).
    batch = make_batch([[0, 0, 0], [0, 1, 0]])
    loss = make_loss("fest_dpo")
    graphdef, params = nnx.split(model)
    run = self.variant(lambda p, b: loss.terms(nnx.merge(graphdef, p), b)[2])
    metrics = run(params, with_denominators(loss, batch))
    expected_beta = np.array([B1, B1, B1, B2, B3, B2])
    # float32 constants averaged over 6 pairs: 8 roundings.
    np.testing.assert_allclose(metrics["expert/beta"].value, expected_beta.mean(), rtol=8 * EPS32)
    _, _, beta, w = np_reference_terms(model, batch, "fest_dpo")
    np.testing.assert_allclose(beta, expected_beta, rtol=0)  # the same float64 selections
    np.testing.assert_allclose(metrics["expert/decaying_weight"].value, w.mean(), rtol=DW_REL + 8 * EPS32)
    np.testing.assert_allclose(metrics["expert/decaying_weight_min"].value, w.min(), rtol=DW_REL)
    np.testing.assert_allclose(metrics["expert/decaying_weight_max"].value, w.max(), rtol=DW_REL)

  @chex.variants(with_jit=True, without_jit=True)
  def test_combined_loss_is_c_le_plus_li(self):
    model = make_model(0)
    batch = make_batch([[0, 0], [1, 0], [1, 1]], num_rl_rows=6)
    graphdef, params = nnx.split(model)
    for algorithm in fest_lib.FEST_ALGORITHMS:
      loss = make_loss(algorithm, c=0.7)
      value = self.variant(lambda p, b: loss(nnx.merge(graphdef, p), b)[0].value)(
          params, with_denominators(loss, batch))
      l_e, l_i, _, _ = np_reference_terms(model, batch, algorithm)
      np.testing.assert_allclose(value, 0.7 * l_e + l_i, rtol=0, atol=loss_atol(batch, algorithm), err_msg=algorithm)
      assert abs(l_e) > 1e-3 and abs(l_i) > 1e-3  # Both terms matter.


@pytest.mark.parametrize("algorithm", fest_lib.FEST_ALGORITHMS)
def test_microbatches_equal_whole_batch(model, algorithm):
  batch = make_batch([[0, 0], [1, 0], [1, 1], [0, 1]], num_rl_rows=8, seed=3)
  loss = make_loss(algorithm)
  graphdef, params = nnx.split(model)
  out = {}
  for m in (1, 2):
    total, metrics, grad_sum = jax.jit(
        lambda p, b, m=m: state_lib.accumulate_gradients(graphdef, p, b, loss, m))(
            params, with_denominators(loss, batch, m))
    grads = jax.tree.map(lambda x, d=total.denominator: x / d, grad_sum)
    out[m] = (total.value, grads, metrics["expert/decaying_weight"].value,
              metrics["expert/decaying_weight_min"].value)
  # Micro-batches run forwards of another shape (other contraction blockings): the same error budgets as
  # against the reference, plus the gradient's reduction over the n tokens and 128 contraction terms.
  n = sum(float(x.sum()) for x in (batch["rl"]["loss_mask"], batch["expert"]["neg_loss_mask"],
                                   batch["expert"]["pos_loss_mask"]))
  r_max = float(np.exp(-min(batch["rl"]["old_logp"].min(), batch["expert"]["neg_old_logp"].min())))
  g_max = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(out[1][1]))
  for m in (2,):
    np.testing.assert_allclose(out[m][0], out[1][0], rtol=0, atol=loss_atol(batch, algorithm))
    np.testing.assert_allclose(out[m][2], out[1][2], rtol=DW_REL + 8 * EPS32)
    np.testing.assert_allclose(out[m][3], out[1][3], rtol=DW_REL)
    chex.assert_trees_all_close(out[m][1], out[1][1], rtol=0,
                                atol=g_max * (DW_REL + (1 + r_max) * DLOGP + (n + 128) * EPS32))
  assert float(optax_norm(out[1][1])) > 0


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(tree)))


def test_fest_grpo_expert_gradient_is_weighted_sft(model):
  """With the RL term off (zero advantages) the update direction is ``sum_i w_i grad log pi(y+) / N``."""
  batch = make_batch([[0, 0], [1, 0]], seed=5)
  batch["rl"]["advantages"][:] = 0
  batch["expert"]["neg_advantages"][:] = 0
  loss = make_loss("fest_grpo", c=1.0)
  graphdef, params = nnx.split(model)
  b = with_denominators(loss, batch)
  grads = jax.jit(jax.grad(lambda p: loss(nnx.merge(graphdef, p), b)[0].sum))(params)
  _, _, _, w = np_reference_terms(model, batch, "fest_grpo")
  ex = batch["expert"]
  pos_w = jnp.asarray(w.reshape(2, 2).sum(1) / w.size, jnp.float32)

  def weighted_nll(p):
    m = nnx.merge(graphdef, p)
    logits = m(jnp.asarray(ex["pos_ids"]), jnp.asarray(ex["pos_attention_mask"]))[:, :-1]
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(ex["pos_ids"])[:, 1:, None], -1)[..., 0]
    return -jnp.sum(pos_w * (lp * jnp.asarray(ex["pos_loss_mask"])).sum(-1))

  # pos_w comes from the float64 reference (w within DW_REL); the two log-softmax implementations differ by
  # DLOGP per token; the gradient sums the n expert tokens' terms.
  expected = jax.jit(jax.grad(weighted_nll))(params)
  g_max = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(expected))
  n = float(ex["pos_loss_mask"].sum())
  chex.assert_trees_all_close(grads, expected, rtol=0, atol=g_max * (DW_REL + DLOGP + (n + 128) * EPS32))


# -- config validation and the runner --------------------------------------------------------------


@pytest.mark.parametrize("field,value,needle", [
    ("rl.algorithm", "ppo", "config.rl.algorithm='ppo'"),
    ("fest.num_microbatches", 3, "config.fest.num_microbatches=3"),
    ("fest.expert_prompts_per_step", 1000, "config.fest.expert_prompts_per_step=1000"),
    ("rl.kl_coef", 0.1, "config.rl.kl_coef=0.1"),
    ("rl.minibatch_size", 32, "config.rl.minibatch_size=32"),
    ("fest.beta1", 0.0, "config.fest.beta1=0.0"),
    ("fest.sft_aggregation", "mean", "config.fest.sft_aggregation='mean'"),
])
def test_config_errors_name_the_field(field, value, needle):
  config = fest_math.get_config("fest_dpo")
  section, key = field.split(".")
  config[section][key] = value
  config.rl.microbatch_size = 32
  with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
    validate_config(config)


def test_expert_sft_source_mixes_easy_demonstrations():
  task = types.SimpleNamespace(expert_source=[{"id": f"e{i}"} for i in range(4)],
                               sft_source=[{"id": f"s{i}"} for i in range(20)])
  assert phases.expert_sft_source(task, 0) == task.expert_source
  mixed = phases.expert_sft_source(task, 3)
  assert [r["id"] for r in mixed] == [f"e{i}" for i in range(4)] + [f"s{i}" for i in range(12)]  # A quarter.
  with pytest.raises(ValueError, match="easy_per_shot=6 needs 24"):
    phases.expert_sft_source(task, 6)
  with pytest.raises(ValueError, match="expert demonstrations"):
    phases.expert_sft_source(types.SimpleNamespace(expert_source=None, sft_source=[]), 0)


def test_fixed_weight_is_a_fest_grpo_option():
  config = fest_math.get_config("fest_grpo_fixed_w")
  assert fest_lib.fest_loss_from_config(config.rl, config.fest, config.rl.algorithm).fixed_weight
  config.rl.algorithm = "fest_dpo"
  with pytest.raises(ConfigError, match="fest.fixed_weight"):
    validate_config(config)


def test_variants_validate_and_shots_follow_fest():
  for variant in fest_math.VARIANTS:
    validate_config(fest_math.get_config(variant))
  config = fest_math.get_config("fest_grpo")
  config.fest.num_shots = 64
  assert config.task.num_shots == 64
  with pytest.raises(ValueError, match="unknown variant"):
    fest_math.get_config("hpt")


def test_tiny_runs_end_to_end(tmp_path):
  """``experiments.main`` with the tiny FEST-GRPO variant: every phase runs and the FEST metrics are logged."""
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--config=configs/fest_math.py:tiny", f"--workdir={workdir}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  phases = {r["phase"] for r in records}
  assert {"sft", "rl", "eval_rl"} <= phases, phases
  rl = [r for r in records if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for key in ("fest/decaying_weight/q50", "fest/beta_case/all_wrong", "fest/frac_all_wrong_groups_rl",
              "fest/frac_all_wrong_groups_expert", "fest/reward_expert_stream", "train/expert/loss",
              "train/rl/clip_frac", "reward/total/mean"):
    assert all(np.isfinite(r[key]) for r in rl), key
  cases = sum(rl[-1][f"fest/beta_case/{k}"] for k in ("all_wrong", "this_wrong", "this_right"))
  assert cases == 2 * 2  # expert_prompts_per_step x num_generations pairs.
  from lemon_rl.training.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  with Checkpointer(workdir / "checkpoints" / "rl") as ckpt:
    data = ckpt.read_metadata()["data"]
  assert set(data) == {"rl", "expert"}  # Both streams' positions are checkpointed.
