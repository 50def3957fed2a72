"""The jitted update: exact micro-batch accumulation, 8-device equivalence, rewards robustness, SFT."""

import functools
import logging
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lemon_rl.models import Transformer, get_preset
from lemon_rl.rewards.combine import WeightedReward, compute_rewards
from lemon_rl.text import ByteTokenizer
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.rl import PolicyLoss
from lemon_rl.training.rollout import group_statistics
from lemon_rl.training.sft import SFTLoss, sft_batch

sys.path.insert(0, os.path.dirname(__file__))
import _train_batch  # noqa: E402  pylint: disable=g-import-not-at-top
import _train_sharding_check  # noqa: E402  pylint: disable=g-import-not-at-top

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
# One block: the properties tested here (micro-batch and device splits of the batch sums) do not depend on
# depth, and a second block doubles every compile.
CFG = get_preset("tiny", vocab_size=64, hidden_size=64, mlp_dim=128, num_layers=1)
EPS = float(np.finfo(np.float32).eps)  # 1.19e-7
# The longest float32 contraction inside one token's forward / backward (the MLP width; d = vocab = 64): a
# gradient entry sums the batch's token terms, each a product of such contractions.
CONTRACTION = CFG.mlp_dim


def _reduction_atol(num_terms, scale):
  """Two float32 sums of ``num_terms`` terms of size <= ``scale``, added in different orders (micro-batches,
  devices, SIMD widths), differ by at most about ``num_terms * eps * scale`` (the worst-case bound)."""
  return float(num_terms) * EPS * float(scale)


def _max_abs(leaves):
  return max(float(np.abs(x).max()) for x in leaves)


# One jitted accumulator for the whole file: tests that use the same batch shape (8 rows) and loss settings
# share its compiled programs instead of each compiling its own.
_ACCUMULATE = jax.jit(state_lib.accumulate_gradients, static_argnums=(0, 3, 4))
ROWS = 8
MAX_LEN = 8  # The completion length of ``_train_batch``: the constant of seq_mean_token_sum_norm.


@functools.cache
def _graphdef_and_params():
  """The model's ``(graphdef, params)``, initialised once (eager initialisation takes seconds on CPU)."""
  return nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)


def _model():
  """A fresh ``Transformer(CFG, rngs=nnx.Rngs(0))`` (its parameters: immutable arrays shared by all)."""
  return nnx.merge(*_graphdef_and_params())


def _loss_and_grad(loss_fn, batch, num_microbatches):
  graphdef, params = _graphdef_and_params()
  loss, _, grad_sum = _ACCUMULATE(graphdef, params, batch, loss_fn, num_microbatches)
  grads = jax.tree.map(lambda g: g / loss.denominator, grad_sum)
  return float(loss.value), jax.tree.leaves(grads)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_four_microbatches_equal_the_whole_batch(aggregation):
  batch = {k: jnp.asarray(v) for k, v in _train_batch.make_batch(rows=ROWS, vocab=64).items()}
  loss_fn = PolicyLoss(aggregation=aggregation, max_len=MAX_LEN, kl_coef=0.0)
  whole = _loss_and_grad(loss_fn, batch, 1)
  split = _loss_and_grad(loss_fn, batch, 4)
  # The loss sums n token terms of size <= term_scale (x max_len per sequence for seq_mean_token_sum); the
  # gradient entries sum n terms each made of contractions over <= CONTRACTION features.
  n = float(batch["loss_mask"].sum())
  per_term = _train_sharding_check.term_scale(_model(), batch)
  per_term *= MAX_LEN if aggregation == "seq_mean_token_sum" else 1
  assert abs(whole[0] - split[0]) <= _reduction_atol(n, per_term)
  atol = _reduction_atol(n + CONTRACTION, _max_abs(whole[1]))
  for a, b in zip(whole[1], split[1]):
    np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def test_gradient_equals_autodiff_of_the_mean_loss():
  """grad_sum / denominator is the gradient of the reduced loss itself.

  The batch and loss settings are those of ``test_four_microbatches_equal_the_whole_batch``, so the
  micro-batched program is the one that test compiled; the direct gradient is jitted (eager autodiff of the
  model dispatches each op separately and took most of this test's time).
  """
  batch = {k: jnp.asarray(v) for k, v in _train_batch.make_batch(rows=ROWS, vocab=64).items()}
  loss_fn = PolicyLoss(aggregation="seq_mean_token_mean", max_len=MAX_LEN)
  graphdef, params = _graphdef_and_params()
  direct = jax.jit(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch)[0].value))(params)
  _, ours = _loss_and_grad(loss_fn, batch, 4)
  # Same terms, summed whole vs in 4 micro-batches: the float32 reduction bound of the gradient entries.
  atol = _reduction_atol(float(batch["loss_mask"].sum()) + CONTRACTION, _max_abs(jax.tree.leaves(direct)))
  for a, b in zip(jax.tree.leaves(direct), ours):
    np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def test_update_on_eight_fake_devices_matches_one_device(tmp_path):
  """One micro-batched AdamW update on a 2x2x2 mesh of fake devices equals the one-device update.

  The two runs add the same float32 numbers in different orders (8 shards, 2 micro-batches; AVX2 and AVX-512
  vector widths differ too), so every bound below is the float32 error of the reduction it checks.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu",  # Keeps any XLA flags of the caller (e.g. --xla_cpu_max_isa).
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
  script = os.path.join(os.path.dirname(__file__), "_train_sharding_check.py")
  out = subprocess.run([sys.executable, script, str(tmp_path / "result.npz")], env=env, capture_output=True,
                       text=True, timeout=600, cwd=os.path.dirname(__file__))
  assert out.returncode == 0, out.stderr[-3000:]
  r = dict(np.load(tmp_path / "result.npz"))
  eps = np.finfo(np.float32).eps
  n = float(r["n_terms"])  # 16 rows x <= 8 completion tokens
  for aggregation in AGGREGATIONS:
    get = lambda name: (r[f"{aggregation}/{name}/single"], r[f"{aggregation}/{name}/sharded"])
    # Loss: a weighted sum of n per-token terms, each at most term_scale (= max |A| max(ratio, 2)); summed in
    # another order it moves by <= n eps sum|terms| / denominator <= n eps term_scale (x max_len for the
    # seq_mean_token_sum mode, whose per-sequence sums are not normalised).
    per_term = r["term_scale"] * (r["max_len"] if aggregation == "seq_mean_token_sum" else 1.0)
    loss_single, loss_sharded = get("loss")
    assert abs(loss_single - loss_sharded) <= n * eps * per_term, (aggregation, loss_single, loss_sharded)
    # Gradient: each entry is a sum over the n token terms of products formed by contractions over up to
    # 128 (mlp) features, all of the size of the largest entry at most: <= (n + 128) eps max|g| apart.
    g1, g2 = get("grads")
    atol_g = (n + 128) * eps * np.abs(g1).max()
    np.testing.assert_allclose(g2, g1, rtol=0, atol=atol_g, err_msg=aggregation)
    # Parameters: Adam's first step is p - lr g / (|g| + adam_eps), whose slope in g is up to 1 / (|g| + eps):
    # near-zero gradient entries (~1e-9 here) legitimately move by up to lr |dg| / adam_eps. Bound each entry
    # by that, plus a few float32 roundings of the update (~lr) and one of p - u (~|p|).
    p1, p2 = get("params")
    bound = (r["lr"] * np.abs(g1 - g2) / (np.minimum(np.abs(g1), np.abs(g2)) + r["adam_eps"])
             + 8 * eps * r["lr"] + 2 * eps * np.maximum(np.abs(p1), np.abs(p2)))
    excess = np.abs(p1 - p2) - bound
    assert excess.max() <= 0, (aggregation, float(np.abs(p1 - p2).max()), int(excess.argmax()))


def test_sft_loss_is_the_mean_nll_of_completion_tokens():
  tok = ByteTokenizer()
  cfg = CFG.replace(vocab_size=tok.vocab_size)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  examples = [{"prompt": "12+3=", "completion": "0015"}, {"prompt": "7*10=", "completion": "0070"}]
  batch = sft_batch(tok, examples, max_completion_len=6)
  assert batch["loss_mask"].sum() == 2 * 5  # 4 digits + EOS each
  # Jitted (one compile each) rather than dispatched op by op.
  loss, _ = nnx.jit(lambda m, b: SFTLoss()(m, b))(model, {k: jnp.asarray(v) for k, v in batch.items()})
  logits = np.asarray(nnx.jit(Transformer.__call__)(model, jnp.asarray(batch["ids"]),
                                                    jnp.asarray(batch["attention_mask"])))
  logp = jax.nn.log_softmax(logits[:, :-1], -1)
  nll = [-logp[i, t, batch["ids"][i, t + 1]] for i in range(2) for t in range(logp.shape[1])
         if batch["loss_mask"][i, t]]
  # Two log-softmax implementations (z[t] - logsumexp(z) vs jax.nn.log_softmax) over V logits: each sum of V
  # exponentials is within V eps relative, i.e. each log-prob within V eps absolute; then a mean of n terms.
  n = int(batch["loss_mask"].sum())
  atol = 2 * _reduction_atol(cfg.vocab_size, 1.0) + _reduction_atol(n, max(abs(x) for x in nll))
  np.testing.assert_allclose(float(loss.value), np.mean(nll), rtol=0, atol=atol)


def test_reward_that_raises_on_one_sample_is_scored_not_fatal():
  def fragile(prompts, completions, completion_ids, answer, **_):
    return [1.0 if c == a else 0.0 if c != "boom" else 1 / 0 for c, a in zip(completions, answer)]

  total, metrics, per_fn = compute_rewards(
      [WeightedReward("fragile", fragile, 2.0)], ["p"] * 3, ["7", "boom", "8"], [[1], [2], [3]],
      {"answer": ["7", "x", "9"]})
  np.testing.assert_array_equal(total, [2.0, 0.0, 0.0])
  assert metrics["reward/fragile/errors"] == 1.0
  np.testing.assert_array_equal(per_fn["fragile"], [1.0, 0.0, 0.0])


def test_all_equal_group_fraction():
  stats = group_statistics(np.array([1, 1, 0, 1, 0, 0.]), np.array([0, 0, 1, 1, 2, 2]))
  assert stats["frac_all_equal_groups"] == pytest.approx(2 / 3)


def test_on_policy_update_without_old_log_probs_matches_with_them():
  """Skipping the old-log-prob forward (one pass, one minibatch) leaves the loss gradient unchanged."""
  batch = _train_batch.make_batch(rows=ROWS, vocab=64)
  graphdef, params = _graphdef_and_params()
  with_old = dict(batch, old_logp=np.asarray(rollout_lib.sequence_token_log_probs(
      graphdef, params, jnp.asarray(batch["ids"]), jnp.asarray(batch["attention_mask"]))) * batch["loss_mask"])
  without = {k: v for k, v in batch.items() if k != "old_logp"}
  loss_fn = PolicyLoss(max_len=MAX_LEN)  # token_mean (the default): max_len is unused, shares a compile.
  a = _loss_and_grad(loss_fn, {k: jnp.asarray(v) for k, v in with_old.items()}, 1)
  b = _loss_and_grad(loss_fn, {k: jnp.asarray(v) for k, v in without.items()}, 1)
  # old_logp comes from a separately compiled forward: each log-prob may differ by the rounding of its
  # contractions (d, MLP, vocab: <= 3 * CONTRACTION terms of size |logp|), so the ratio is 1 + dlogp and the
  # loss (terms |A| r) and gradient (terms scaled by r) move by that relative amount, plus the reductions.
  dlogp = _reduction_atol(3 * CONTRACTION, np.abs(with_old["old_logp"]).max())
  n = float(batch["loss_mask"].sum())
  max_adv = float(np.abs(batch["advantages"]).max())
  assert abs(a[0] - b[0]) <= max_adv * dlogp + _reduction_atol(n, max_adv)
  scale = _max_abs(a[1])
  for x, y in zip(a[1], b[1]):
    np.testing.assert_allclose(x, y, rtol=0, atol=scale * dlogp + _reduction_atol(n + CONTRACTION, scale))


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("warmup", [0, 2])
def test_learning_rate_of_the_first_updates(schedule, warmup):
  """Warm-up 0 means the full learning rate from the first update (update k = 0), for every schedule."""
  lr, total = 1e-2, 10
  cosine = lambda k: lr * 0.5 * (1 + math.cos(math.pi * k / total))  # no warm-up, decays to 0 at `total`
  expected = {("constant", 0): [lr, lr, lr], ("cosine", 0): [cosine(0), cosine(1), cosine(2)],
              ("constant", 2): [0.0, lr / 2, lr], ("cosine", 2): [0.0, lr / 2, lr]}[schedule, warmup]
  # The optimizer's steps: with a constant gradient g, Adam's bias-corrected step is lr_k g / (|g| + 1e-8),
  # i.e. lr_k (|g| = 0.5 >> 1e-8) up to float32 rounding, dominated by optax's bias correction: 1 - b2^k in
  # float32 cancels ~3 digits (b2 = 0.999), a relative error up to eps / (1 - b2) in v_hat, half in the step.
  optimizer = state_lib.make_optimizer(lr, total, warmup, schedule=schedule)
  params = {"w": jnp.zeros((1,), jnp.float32)}
  opt_state = optimizer.init(params)
  steps = []
  for _ in range(3):
    updates, opt_state = optimizer.update({"w": jnp.full((1,), 0.5, jnp.float32)}, opt_state, params)
    steps.append(-float(updates["w"][0]))
  np.testing.assert_allclose(steps, expected, rtol=EPS / (1 - 0.999), atol=1e-12)
  # The schedule itself: a few float32 operations on lr (a cosine, a product), within 8 eps relative.
  schedule_fn = state_lib.make_schedule(lr, total, warmup, schedule=schedule)
  np.testing.assert_allclose([float(schedule_fn(k)) for k in range(3)], expected, rtol=8 * EPS, atol=0)


def test_unknown_schedule_and_negative_warmup_are_errors():
  with pytest.raises(ValueError, match="cosine"):
    state_lib.make_optimizer(1e-3, 10, schedule="linear")
  with pytest.raises(ValueError, match="warmup_steps"):
    state_lib.make_optimizer(1e-3, 10, warmup_steps=-1)


def test_reward_that_raises_on_the_batch_is_logged_with_traceback_and_counted(caplog):
  def fragile(prompts, completions, completion_ids, answer, **_):  # raises on the batch and on one sample
    return [1.0 if c == a else 0.0 if c != "boom" else 1 / 0 for c, a in zip(completions, answer)]

  def batch_only(prompts, completions, completion_ids, **_):  # raises on the batch only: every sample scores
    if len(completions) > 1:
      raise RuntimeError("cannot score a batch")
    return [0.5]

  def healthy(prompts, completions, completion_ids, **_):
    return [1.0] * len(completions)

  rewards = [WeightedReward("fragile", fragile), WeightedReward("batch_only", batch_only),
             WeightedReward("healthy", healthy)]
  with caplog.at_level(logging.WARNING):
    total, metrics, per_fn = compute_rewards(rewards, ["p"] * 3, ["7", "boom", "8"], [[1], [2], [3]],
                                             {"answer": ["7", "x", "9"]})
  with_traceback = [r for r in caplog.records if r.exc_info]
  # One record with the traceback per reward function that raised on the batch, per call.
  assert sorted(type(r.exc_info[1]).__name__ for r in with_traceback) == ["RuntimeError", "ZeroDivisionError"]
  assert any("fragile" in r.getMessage() for r in with_traceback)
  assert any("batch_only" in r.getMessage() for r in with_traceback)
  assert "Traceback" in caplog.text and "1 / 0" in caplog.text  # the formatted traceback reaches the log
  assert metrics["reward/fragile/batch_errors"] == 1.0 and metrics["reward/fragile/errors"] == 1.0
  assert metrics["reward/batch_only/batch_errors"] == 1.0 and metrics["reward/batch_only/errors"] == 0.0
  assert metrics["reward/healthy/batch_errors"] == 0.0 and metrics["reward/healthy/errors"] == 0.0
  np.testing.assert_array_equal(per_fn["batch_only"], [0.5, 0.5, 0.5])
  np.testing.assert_array_equal(total, [2.5, 1.5, 1.5])  # exact: sums of 1, 0.5 and 0 in float32
