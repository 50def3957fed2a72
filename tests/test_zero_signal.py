"""Updates only on batches with signal: the zero-signal skip and DAPO's dynamic sampling (issue 10).

One tiny model, ``P = 4`` prompts of ``G = 4`` rows per sampling call and one loss: the sampler, the
log-prob scorer and the update each compile once for the whole file.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import fest_math, grpo_arithmetic
from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.losses import advantages as advantages_lib
from lemon_rl.losses import policy_gradient as pg
from lemon_rl.models import Transformer, get_preset
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.text import ByteTokenizer
from lemon_rl.text.decoding import encode_prompt
from lemon_rl.training import phases
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.base_config import get_base_config
from lemon_rl.training.rl import RLTrainer
from lemon_rl.utils.config_checks import ConfigError

P, G = 4, 4
TOK = ByteTokenizer()


def mode_reward(prompts, completions, completion_ids, mode, **fields):
  """1 for every row of a ``"const"`` prompt; ``0, 1, 0, 1, ...`` by row for a ``"vary"`` prompt.

  Rows come prompt-major with ``G`` consecutive rows per prompt, so a ``"vary"`` group always has reward
  variance and a ``"const"`` group never has, whatever the model samples."""
  del prompts, completions, completion_ids, fields
  return np.asarray([1.0 if m == "const" else float(i % 2) for i, m in enumerate(mode)], np.float32)


REWARDS = [WeightedReward("mode", mode_reward)]


def examples(*modes, start=0):
  """One example per mode, with distinct prompts ``p<start>``, ``p<start+1>``, ..."""
  return [{"prompt": f"p{start + i}", "mode": m} for i, m in enumerate(modes)]


def rl_section(**overrides):
  cfg = get_base_config().rl
  cfg.update(dict(prompts_per_step=P, num_generations=G, max_new_tokens=4, minibatch_size=0,
                  microbatch_size=P * G, num_iterations=1))
  cfg.update(overrides)
  return cfg


def make_state(seed=0):
  model = Transformer(get_preset("tiny", vocab_size=TOK.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                                 num_kv_heads=1, mlp_dim=64), rngs=nnx.Rngs(seed))
  optimizer = optax.adam(1e-2)
  graphdef, state = state_lib.create_train_state(model, optimizer, seed=0)
  return model, graphdef, optimizer, state


def snapshot(tree):
  return jax.tree.map(np.array, tree)


def bitwise_equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
      x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)
      for x, y in zip(map(np.asarray, leaves_a), map(np.asarray, leaves_b)))


def batch_prompts(rollout):
  return [tuple(ids) for ids in rollout.prompt_ids[::G]]


def encoded(exs):
  return [tuple(encode_prompt(TOK, ex["prompt"])) for ex in exs]


def test_skip_leaves_params_and_optimizer_state_bitwise_unchanged():
  _, graphdef, optimizer, state = make_state()
  skipping = RLTrainer(graphdef, optimizer, TOK, REWARDS, rl_section(skip_zero_signal=True))
  plain = RLTrainer(graphdef, optimizer, TOK, REWARDS, rl_section())

  # One group of four varies: the batch has signal and is not skipped.
  before = snapshot(state)
  state, metrics, rollout = skipping.step(state, examples("const", "const", "vary", "const"))
  assert metrics["rl/zero_signal"] == 0 and metrics["rl/skipped_zero_signal"] == 0
  assert metrics["rl/skipped_zero_signal_total"] == 0 and "train/loss" in metrics
  assert np.flatnonzero(rollout.advantages).tolist() == list(range(2 * G, 3 * G))  # The varying group only.
  assert int(state.step) == 1 and not bitwise_equal(state.params, before.params)

  # Every group all-equal: no update; params and Adam's moments and count are the same bits.
  after_update = snapshot(state)
  const = examples("const", "const", "const", "const", start=4)
  state, metrics, rollout = skipping.step(state, const)
  assert np.ptp(rollout.rewards.reshape(P, G), axis=1).max() == 0 and not np.any(rollout.advantages)
  assert metrics["rl/zero_signal"] == 1 and metrics["rl/skipped_zero_signal"] == 1
  assert metrics["rl/skipped_zero_signal_total"] == 1 and "train/loss" not in metrics
  assert bitwise_equal(state.params, after_update.params)
  assert bitwise_equal(state.opt_state, after_update.opt_state)
  assert int(state.step) == int(after_update.step) + 1  # A fresh sampling key for the next step.
  state, metrics, _ = skipping.step(state, const)
  assert metrics["rl/skipped_zero_signal_total"] == 2 and bitwise_equal(state.params, after_update.params)

  # Without the option the same batch's gradient is exactly 0, yet Adam's momentum still moves the params.
  state, metrics, _ = plain.step(state, const)
  assert metrics["rl/zero_signal"] == 1 and metrics["rl/skipped_zero_signal"] == 0
  assert metrics["train/grad_norm"] == 0.0
  assert not bitwise_equal(state.params, after_update.params)
  assert not bitwise_equal(state.opt_state, after_update.opt_state)


def test_dynamic_sampling_drops_the_all_equal_groups_and_refills_from_further_prompts():
  _, graphdef, _, state = make_state()
  cfg = rl_section(dynamic_sampling=True)
  first = examples("vary", "const", "vary", "const")
  refills = [examples("const", "vary", "vary", "vary", start=4), examples("vary", "vary", "vary", "vary", start=8)]
  drawn = []

  def refill():
    drawn.append(refills[len(drawn)])
    return drawn[-1]

  key = jax.random.key(7)
  rollout = rollout_lib.collect_dynamic_rollout(graphdef, state.params, TOK, first, REWARDS, cfg, key, refill,
                                                max_rounds=3)
  assert len(drawn) == 1  # Round 0 keeps 2 groups, round 1 three: 5 >= 4, no third round.
  # The first four groups with variance in sampling order; p5's const group is dropped, p7 is surplus.
  assert batch_prompts(rollout) == encoded([first[0], first[2], refills[0][1], refills[0][2]])
  assert rollout.batch["ids"].shape[0] == P * G and rollout.batch["loss_mask"].sum(-1).min() > 0
  np.testing.assert_array_equal(rollout.rewards, np.tile([0.0, 1.0], P * G // 2))
  expected = advantages_lib.grpo(jnp.asarray(rollout.rewards), jnp.asarray(rollout.group_ids), P)
  np.testing.assert_array_equal(rollout.advantages, np.asarray(expected))
  m = rollout.metrics
  assert m["dynamic_sampling/dropped_group_frac"] == 3 / 8  # p1, p3 of round 0 and p4 of round 1.
  assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/prompts_consumed"]) == (2, 8)
  assert (m["dynamic_sampling/kept_groups"], m["dynamic_sampling/padding_groups"]) == (4, 0)
  assert (m["dynamic_sampling/short"], m["dynamic_sampling/surplus_groups"]) == (0, 1)
  assert m["frac_all_equal_groups"] == 0.5  # Round 0's sample, as a run without dynamic sampling logs it.
  assert m["reward/mode/mean"] == 0.75

  # Nothing to drop: no refill, and exactly collect_rollout's batch (same key).
  rollout = rollout_lib.collect_dynamic_rollout(graphdef, state.params, TOK, refills[1], REWARDS, cfg, key,
                                                refill, max_rounds=3)
  plain = rollout_lib.collect_rollout(graphdef, state.params, TOK, refills[1], REWARDS, cfg, key)
  assert len(drawn) == 1 and rollout.metrics["dynamic_sampling/rounds"] == 1
  for k, v in plain.batch.items():
    np.testing.assert_array_equal(rollout.batch[k], v, err_msg=k)


def test_a_short_batch_trains_on_the_kept_groups_alone():
  _, graphdef, _, state = make_state()
  cfg = rl_section(dynamic_sampling=True)
  first = examples("vary", "const", "const", "const")
  more = iter([examples("const", "const", "vary", "const", start=4)])  # Then exhausted: StopIteration.
  rollout = rollout_lib.collect_dynamic_rollout(graphdef, state.params, TOK, first, REWARDS, cfg,
                                                jax.random.key(1), lambda: next(more), max_rounds=3)
  m = rollout.metrics
  assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/prompts_consumed"]) == (2, 8)
  assert (m["dynamic_sampling/kept_groups"], m["dynamic_sampling/padding_groups"]) == (2, 2)
  assert m["dynamic_sampling/short"] == 1 and m["dynamic_sampling/dropped_group_frac"] == 6 / 8
  # The kept groups p0 and p6, then two dropped groups (p1, p2) as padding rows.
  assert batch_prompts(rollout) == encoded([first[0], {"prompt": "p6"}, first[1], first[2]])
  batch = rollout.batch
  real = np.repeat([True, True, False, False], G)
  assert batch["loss_mask"][real].sum(-1).min() > 0 and not batch["loss_mask"][~real].any()
  assert not np.any(rollout.advantages[~real]) and np.all(rollout.advantages[real] != 0)

  # The loss of the padded batch is the loss of the kept rows alone (padding rows enter no denominator).
  # A policy that moved off the sampler's log-probs, so that ratios differ from 1 and some clip.
  old = batch["sampler_logp"]
  logp = old + np.random.default_rng(0).normal(0.0, 0.3, old.shape).astype(np.float32)
  for aggregation in ("token_mean", "seq_mean_token_mean"):
    loss = lambda rows: pg.grpo_loss(jnp.asarray(logp[rows]), jnp.asarray(old[rows]),
                                     jnp.asarray(batch["advantages"][rows]), jnp.asarray(batch["loss_mask"][rows]),
                                     aggregation=aggregation)[0]
    padded, kept = loss(slice(None)), loss(real)
    assert float(padded.denominator) == float(kept.denominator) > 0 and abs(float(kept.value)) > 1e-3
    # Sums of the same terms, plus exact zeros, in another order (float32): relative 1e-6.
    np.testing.assert_allclose(float(padded.value), float(kept.value), rtol=1e-6, atol=1e-7)


def test_dynamic_sampling_through_the_phase_draws_from_its_iterator_and_skips_without_signal():
  model, graphdef, optimizer, state = make_state()
  source = examples(*["const"] * 12, *["vary"] * 4)
  iterator = BatchIterator(source, batch_size=P, shuffle=False, num_threads=0)
  trainer = RLTrainer(graphdef, optimizer, TOK, REWARDS,
                      rl_section(dynamic_sampling=True, dynamic_sampling_max_rounds=1, skip_zero_signal=True))
  ctx = phases.PhaseContext(config=None, task=None, model=model, workdir="", evaluate_policy=lambda p: {})
  phase = phases.policy_phase(ctx, state, iterator, trainer, steps=2, eval_every=0, progress_keys=(),
                              refill=True)
  rows = lambda batch: [dict(zip(batch, v)) for v in zip(*batch.values())]
  before = snapshot(state)
  # Step 1: p0-p3 and the one refill p4-p7 are all const: nothing kept, the update is skipped.
  state, metrics = phase.step(state, rows(next(iterator)))
  assert metrics["dynamic_sampling/kept_groups"] == 0 and metrics["dynamic_sampling/rounds"] == 2
  assert metrics["rl/skipped_zero_signal"] == 1 and bitwise_equal(state.params, before.params)
  # Step 2: p8-p11 const, the refill p12-p15 all vary: the batch is p12-p15 and it trains.
  state, metrics = phase.step(state, rows(next(iterator)))
  assert metrics["dynamic_sampling/kept_groups"] == 4 and metrics["dynamic_sampling/prompts_consumed"] == 8
  assert metrics["rl/skipped_zero_signal"] == 0 and metrics["rl/skipped_zero_signal_total"] == 1
  assert not bitwise_equal(state.params, before.params)
  # The iterator moved past every batch the steps drew (what the runner checkpoints).
  resumed = BatchIterator(source, batch_size=P, shuffle=False, num_threads=0)
  resumed.set_state(iterator.get_state())
  assert next(resumed)["prompt"] == ["p0", "p1", "p2", "p3"]  # The 4th batch: the source wrapped around.
  with pytest.raises(ValueError, match="needs a refill source"):
    trainer.step(state, examples("vary", "vary", "vary", "vary"))


@pytest.mark.parametrize("field, value, message", [
    ("skip_zero_signal", None, "config.rl.skip_zero_signal=None: must be True or False"),
    ("dynamic_sampling", None, "config.rl.dynamic_sampling=None: must be True or False"),
    ("dynamic_sampling_max_rounds", -1, "config.rl.dynamic_sampling_max_rounds=-1: must be an integer >= 0"),
    ("dynamic_sampling_max_rounds", True, "config.rl.dynamic_sampling_max_rounds=True: must be an integer"),
])
def test_config_validation_rejects_bad_values(field, value, message):
  """(``ml_collections`` already refuses a value of another type, e.g. ``1`` for a bool; not these.)"""
  config = grpo_arithmetic.get_config("tiny")
  phases.check_rl_config(config)
  config.rl[field] = value
  with pytest.raises(ConfigError, match=message):
    phases.check_rl_config(config)


def test_config_validation_rejects_options_that_cannot_act():
  config = grpo_arithmetic.get_config("tiny")
  config.rl.skip_zero_signal = True
  phases.check_rl_config(config)
  config.rl.kl_coef = 0.1
  with pytest.raises(ConfigError, match=r"config.rl.kl_coef=0.1: with rl.skip_zero_signal=True.*would ever be skipped"):
    phases.check_rl_config(config)
  config = fest_math.get_config("tiny")
  config.rl.dynamic_sampling = True
  with pytest.raises(ConfigError, match="config.rl.dynamic_sampling=True: not supported by the FEST trainer"):
    phases.check_rl_config(config)
  config.rl.dynamic_sampling = False
  config.rl.skip_zero_signal = True
  with pytest.raises(ConfigError, match=r"config.rl.skip_zero_signal=True: with fest.c=1.0: the expert term"):
    phases.check_rl_config(config)
  config.fest.c = 0.0  # FEST without its expert term is GRPO on both streams: the skip can act.
  phases.check_rl_config(config)
