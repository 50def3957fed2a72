"""Speculative rollouts in the RL trainers: lossless rollouts, identical greedy GRPO, refit guard, cost model."""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers as hf_tokenizers
from flax import nnx
from scipy import stats

from lemon_rl.losses import advantages as advantages_lib
from lemon_rl.models import Transformer, get_preset
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.text import HFTokenizer
from lemon_rl.training import rl as rl_lib
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import speculative_rollouts as sr
from lemon_rl.training import state as state_lib
from lemon_rl.training.base_config import get_base_config
from lemon_rl.utils.config_checks import ConfigError

WORDS = ["<pad>", "<unk>", "<eos>", "a", "b", "c", "d", "e"]  # V = 8; EOS = 2, padding = 0
V = len(WORDS)
# Untied embeddings and larger initialisers than the preset's (as tests/test_speculative.py): the policy's
# greedy paths wander over the vocabulary, and the drafter below is peaky, far from the policy.
POLICY_CFG = get_preset("tiny", vocab_size=V, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        mlp_dim=64, tie_embeddings=False, initializer_range=0.1)
DRAFTER_CFG = POLICY_CFG.replace(hidden_size=16, mlp_dim=32, initializer_range=0.5)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  """A word-level ``tokenizer.json`` of 8 ids built by the ``tokenizers`` library (one EOS, no BOS)."""
  directory = str(tmp_path_factory.mktemp("tok"))
  raw = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                                               unk_token="<unk>"))
  raw.pre_tokenizer = hf_tokenizers.pre_tokenizers.Whitespace()
  raw.add_special_tokens(["<pad>", "<eos>"])
  raw.save(os.path.join(directory, "tokenizer.json"))
  for name, obj in (("tokenizer_config.json", {"eos_token": "<eos>", "pad_token": "<pad>"}),
                    ("generation_config.json", {"eos_token_id": [2]})):
    with open(os.path.join(directory, name), "w") as f:
      json.dump(obj, f)
  return HFTokenizer.from_file(directory)


def rl_section(**overrides):
  cfg = get_base_config().rl
  cfg.update(dict(prompts_per_step=4, num_generations=2, max_new_tokens=8, minibatch_size=0, microbatch_size=8,
                  num_iterations=1, learning_rate=1e-3))
  speculative = overrides.pop("speculative", {})
  cfg.update(overrides)
  cfg.speculative.update(speculative)
  return cfg


def zero_reward(prompts, completions, completion_ids, **fields):
  del prompts, completions, fields
  return np.zeros(len(completion_ids), np.float32)


def token_reward(prompts, completions, completion_ids, **fields):
  """Prompt words plus distinct completion ids: differs across prompts whatever the policy samples."""
  del completions, fields
  return np.asarray([len(p.split()) + len(set(ids)) for p, ids in zip(prompts, completion_ids)], np.float32)


# -- the cost model --------------------------------------------------------------------------------------


def test_cost_model_switches_on_when_faster_and_off_when_slower():
  # Plain: 10 ms per token. K = 4 drafts cost 4 ms, the 5-token verification 12 ms: 16 ms per window.
  costs = sr.StepCosts(target_s=0.010, draft_s=0.004, verify_s=0.012, num_draft=4)
  assert costs.gamma == pytest.approx(0.1)
  acceptance = [0.8, 0.6, 0.4, 0.2]  # fraction of windows accepting draft position k
  tau = sr.expected_tau(acceptance)
  assert tau == pytest.approx(3.0)  # 1 + 0.8 + 0.6 + 0.4 + 0.2
  assert sr.predicted_speedup(tau, costs) == pytest.approx(3.0 * 0.010 / 0.016)  # 1.875
  assert sr.should_speculate(tau, costs)
  # A drafter as expensive as the target (40 ms for 4 drafts): 3 tokens per 52 ms vs 1 per 10 ms.
  slow = sr.StepCosts(target_s=0.010, draft_s=0.040, verify_s=0.012, num_draft=4)
  assert sr.predicted_speedup(tau, slow) == pytest.approx(0.030 / 0.052)
  assert not sr.should_speculate(tau, slow)
  # Low acceptance: tau = 1.1 cannot pay for 16 ms windows; the break-even tau is 1.6.
  assert not sr.should_speculate(sr.expected_tau([0.1, 0, 0, 0]), costs)
  assert sr.should_speculate(1.61, costs) and not sr.should_speculate(1.59, costs)
  # The margin: speculate only above min_speedup.
  assert not sr.should_speculate(tau, costs, min_speedup=2.0)
  # The refit must be paid for: 100 decode steps of 10 ms save 1 s x (1 - 1 / 1.875) = 0.4667 s.
  saving = 100 * 0.010 * (1 - 1 / 1.875)
  assert sr.should_speculate(tau, costs, decode_steps=100, refit_s=saving - 1e-3)
  assert not sr.should_speculate(tau, costs, decode_steps=100, refit_s=saving + 1e-3)
  assert sr.should_speculate(tau, costs, decode_steps=100, refit_s=None)  # unknown: the rollout alone decides
  # With verify_s = target_s and draft_s = K gamma target_s the speedup is tau / (1 + K gamma).
  paper = sr.StepCosts(target_s=1.0, draft_s=4 * 0.12, verify_s=1.0, num_draft=4)
  assert sr.predicted_speedup(tau, paper) == pytest.approx(tau / (1 + 4 * 0.12))


def test_pack_sequences_and_window_acceptance_by_hand():
  # Rollout layout: left-padded prompt [P = 3] then right-padded completion [L = 3]; padding id 0.
  ids = np.asarray([[0, 5, 6, 7, 2, 0], [4, 4, 4, 3, 0, 0]])
  mask = np.asarray([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
  tokens, packed = sr.pack_sequences(ids, mask, pad_id=0)
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 2, 0, 0], [4, 4, 4, 3, 0, 0]])
  np.testing.assert_array_equal(packed, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]])
  # One row of 3 real tokens, V = 2. Target p_t = softmax(target[t]); step k at t is compared with p_{t+k+1}.
  target = jnp.log(jnp.asarray([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], [0.5, 0.5]]]))
  draft = jnp.log(jnp.asarray([[[[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.5, 0.5]]],   # step 0
                               [[[0.2, 0.8], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]]]))  # step 1
  row_mask = jnp.asarray([[1, 1, 1, 0]])
  # Step 0 is valid at t = 0, 1 (p_1, p_2); step 1 at t = 0 (p_2).
  sampled = np.asarray(sr.window_acceptance(draft, target, row_mask, 1.0))
  np.testing.assert_allclose(sampled, [(min(.6, .9) + min(.4, .1) + min(.7, .2) + min(.3, .8)) / 2,
                                       min(.2, .2) + min(.8, .8)], rtol=1e-6)
  greedy = np.asarray(sr.window_acceptance(draft, target, row_mask, 0.0))
  np.testing.assert_array_equal(greedy, [0.5, 1.0])  # step 0: agrees at t = 0 (0 = 0), not at t = 1 (0 != 1)


# -- config ----------------------------------------------------------------------------------------------


def test_config_typos_give_clear_errors():
  config = get_base_config()
  assert not config.rl.speculative.enabled  # off by default
  rl_lib.check_config(config)
  config.rl.speculative.num_drafts = 3  # the unlocked base config accepts the new key; the check does not
  with pytest.raises(ConfigError, match=r"rl\.speculative\.num_drafts: unknown field; did you mean 'num_draft'"):
    rl_lib.check_config(config)
  config = get_base_config()
  config.rl.speculative.drafter = "eagel"
  with pytest.raises(ConfigError, match=r"config\.rl\.speculative\.drafter='eagel': must be one of eagle, "):
    rl_lib.check_config(config)
  config = get_base_config()
  config.rl.speculative.update(enabled=True, distill_microbatch_size=3)
  with pytest.raises(ConfigError, match="distill_microbatch_size=3: must divide"):
    rl_lib.check_config(config)
  config = get_base_config()
  config.rl.speculative.update(refresh="ppow", drafter="transformer")
  with pytest.raises(ConfigError, match="PPOW trains an EagleHead"):
    rl_lib.check_config(config)
  config = get_base_config()
  config.rl.speculative.ppow.group_sizes = 4
  with pytest.raises(ConfigError, match=r"rl\.speculative\.ppow\.group_sizes: unknown field; did you mean 'group_s"):
    rl_lib.check_config(config)
  config = get_base_config()
  config.rl.speculative.refresh_every = 0
  with pytest.raises(ConfigError, match="refresh_every=0: must be an integer >= 1"):
    rl_lib.check_config(config)
  config.lock()  # locked (as experiment configs are): the typo fails at assignment, naming the key
  with pytest.raises(AttributeError, match="min_probe_acceptence"):
    config.rl.speculative.min_probe_acceptence = 0.1


# -- lossless at the rollout level -----------------------------------------------------------------------

PROMPT = "a b c"
ROWS = 4000  # per arm
ALPHA = 1e-3


def _next_token_probs(model, prefixes):
  """``[len(prefixes), V]`` temperature-1 next-token distribution after each prefix (full forward)."""
  width = max(map(len, prefixes))
  ids = np.zeros((len(prefixes), width), np.int32)
  mask = np.zeros_like(ids)
  for i, p in enumerate(prefixes):
    ids[i, :len(p)], mask[i, :len(p)] = p, 1
  logits = nnx.jit(type(model).__call__)(model, jnp.asarray(ids), jnp.asarray(mask))
  last = np.asarray([len(p) - 1 for p in prefixes])
  return np.asarray(jax.nn.softmax(logits[np.arange(len(prefixes)), last].astype(jnp.float32)), np.float64)


def _first_two_cells(rollout):
  """Cell ``t1 * (V + 1) + t2`` of each row's first two completion tokens, ``t2 = V`` for a row that ended."""
  p = rollout.batch["ids"].shape[1] - 2
  t1, t2 = rollout.batch["ids"][:, p], rollout.batch["ids"][:, p + 1]
  ended = rollout.batch["attention_mask"][:, p + 1] == 0
  return np.bincount(t1 * (V + 1) + np.where(ended, V, t2), minlength=V * (V + 1))


def _homogeneity(a, b):
  """Two-sample chi-square test of equal cell distributions (cells empty in both samples dropped)."""
  keep = (a + b) > 0
  return stats.chi2_contingency(np.stack([a[keep], b[keep]]), correction=False).pvalue


def test_speculative_rollouts_have_the_plain_distribution_and_a_lossy_engine_is_rejected(tok):
  """Temperature 1, one prompt, 4000 rollouts per arm: the joint histogram of the first two completion tokens
  (8 x 9 cells) of speculative rollouts (K = 2, a peaky drafter far from the policy) vs plain rollouts.

  Power, from the exact distributions: the lossy engine (resampling from ``p`` after a rejection) emits
  ``t2 | t1`` with probability ``min(p, q) + (1 - sum min(p, q)) p`` instead of ``p``; the two-sample test's
  noncentrality ``lambda = n1 n2 / (n1 + n2) sum (pi_1 - pi_2)^2 / pi_bar`` then gives the power at
  ``ALPHA = 1e-3``, asserted >= 0.99 below (the run here gives > 0.999). The lossless arm must not be
  rejected at the same level."""
  policy = Transformer(POLICY_CFG, rngs=nnx.Rngs(3))
  drafter = Transformer(DRAFTER_CFG, rngs=nnx.Rngs(4))
  graphdef, params = nnx.split(policy, nnx.Param)
  cfg = rl_section(prompts_per_step=1, num_generations=ROWS, max_new_tokens=2, microbatch_size=ROWS,
                   speculative=dict(enabled=True, drafter="transformer", num_draft=2, cost_model=False))
  examples, rewards = [{"prompt": PROMPT}], [WeightedReward("zero", zero_reward)]

  def sample(sampler, seed):
    with rollout_lib.rollout_sampler(sampler):
      return rollout_lib.collect_rollout(graphdef, params, tok, examples, rewards, cfg, jax.random.key(seed))

  def speculative_sampler(resample_from_residual):
    sampler = sr.SpeculativeRollouts(cfg.speculative, graphdef, tok.pad_id, resample_from_residual)
    sampler.set_drafter(drafter)
    return sampler

  plain = _first_two_cells(sample(None, 0))
  lossless_sampler = speculative_sampler(True)
  lossless = _first_two_cells(sample(lossless_sampler, 1))
  lossy = _first_two_cells(sample(speculative_sampler(False), 1))
  # The call speculated; the drafter is far from the policy (the first draft is rejected in most windows).
  metrics, _ = lossless_sampler.sampling_metrics()
  assert metrics["rollout/speculative_on"] == 1.0 and metrics["rollout/accept_pos_0"] < 0.6

  # Exact distributions of (t1, t2): t1 ~ p(.|prompt); t2 ~ p(.|prompt, t1), or END after EOS.
  prompt = tok.encode(PROMPT)
  p1 = _next_token_probs(policy, [prompt])[0]
  prefixes = [prompt + [t] for t in range(V)]
  p2, q2 = _next_token_probs(policy, prefixes), _next_token_probs(drafter, prefixes)
  overlap = np.minimum(p2, q2)
  lossy2 = overlap + (1 - overlap.sum(-1, keepdims=True)) * p2
  end = np.zeros((V, 1))
  end[tok.eos_id] = 1

  def joint(conditional):
    conditional = np.concatenate([np.where(end > 0, 0.0, conditional), end], axis=1)
    return (p1[:, None] * conditional).reshape(-1)

  exact, exact_lossy = joint(p2), joint(lossy2)
  keep = (exact + exact_lossy) > 0
  pooled = (exact[keep] + exact_lossy[keep]) / 2
  noncentrality = ROWS / 2 * np.sum((exact[keep] - exact_lossy[keep]) ** 2 / pooled)
  df = int(keep.sum()) - 1
  power = stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, noncentrality)
  assert power >= 0.99, f"the test cannot see the lossy engine: power {power:.3f}"

  assert _homogeneity(lossless, plain) > ALPHA
  assert _homogeneity(lossy, plain) < ALPHA
  # Both plain and speculative arms agree with the exact joint too (goodness of fit, same level).
  for counts in (plain, lossless):
    assert stats.chisquare(counts[keep], ROWS * exact[keep] / exact[keep].sum()).pvalue > ALPHA


# -- GRPO with and without speculation -------------------------------------------------------------------

BATCH_NORMALISED = "batch_normalised_test"
PROMPTS = ["a", "b c", "d e a", "c"]


def batch_normalised(rewards, group_ids, num_groups, *, valid=None, eps=1e-6):
  """``A_i = (r_i - mean r) / (std r + eps)`` over the batch: no group baseline, so that greedy groups
  (identical completions) still get advantages when prompts' rewards differ."""
  del group_ids, num_groups, valid
  r = jnp.asarray(rewards, jnp.float32)
  return (r - r.mean()) / (r.std() + eps)


@pytest.fixture
def batch_estimator(monkeypatch):
  entries = advantages_lib.ADVANTAGE_ESTIMATORS._entries  # pylint: disable=protected-access
  monkeypatch.setitem(entries, BATCH_NORMALISED, batch_normalised)  # removed again after the test
  return BATCH_NORMALISED


@functools.lru_cache(maxsize=None)
def _optimizer(learning_rate):
  return optax.adam(learning_rate)  # one object: a static argument of the jitted update (compiled once)


def _run(tok, cfg, steps, seed=0, before_step=None):
  """``steps`` GRPO steps from the same policy; returns (trainer, final state, per-step rollouts and metrics).
  ``before_step(trainer, k)`` runs before step ``k``."""
  policy = Transformer(POLICY_CFG, rngs=nnx.Rngs(seed))
  optimizer = _optimizer(cfg.learning_rate)
  graphdef, state = state_lib.create_train_state(policy, optimizer, seed=seed)
  trainer = rl_lib.RLTrainer(graphdef, optimizer, tok, [WeightedReward("tokens", token_reward)], cfg)
  examples = [{"prompt": p} for p in PROMPTS]
  history = []
  for k in range(steps):
    if before_step is not None:
      before_step(trainer, k)
    state, metrics, rollout = trainer.step(state, examples)
    history.append((rollout, metrics))
  return trainer, state, history


@pytest.mark.parametrize("temperature, coupled", [(0.0, False), (1.0, True)], ids=["greedy", "coupled-T1"])
def test_grpo_rollouts_and_parameters_are_identical_with_speculation(tok, batch_estimator, temperature, coupled):
  """Greedy sampling, or temperature 1 with coupled noise (``rl.coupled_noise``); batch-normalised
  advantages (the policy moves every step), an EAGLE head distilled to the policy every step: the rollouts
  are token-identical on every step and the final parameters are equal.

  Both runs execute the same update on the same tokens; only ``sampler_logp`` (unused without TIS, dropped
  by the trainer) could differ, so the parameters are compared exactly."""
  steps = 3
  base = dict(temperature=temperature, coupled_noise=coupled, advantage_estimator=batch_estimator)
  _, plain_state, plain = _run(tok, rl_section(**base), steps)
  trainer, spec_state, spec = _run(tok, rl_section(**base, speculative=dict(
      enabled=True, drafter="eagle", num_draft=3, cost_model=False, learning_rate=1e-2)), steps)
  initial = nnx.state(Transformer(POLICY_CFG, rngs=nnx.Rngs(0)), nnx.Param)
  for step, ((a, ma), (b, mb)) in enumerate(zip(plain, spec)):
    np.testing.assert_array_equal(a.batch["ids"], b.batch["ids"], err_msg=f"step {step}")
    np.testing.assert_array_equal(a.batch["attention_mask"], b.batch["attention_mask"])
    assert np.abs(a.advantages).max() > 0.5  # the policy gets a gradient on every step
    assert "rollout/speculative_on" not in ma
    assert mb["rollout/speculative_on"] == 1.0 and 1.0 <= mb["rollout/tau"] <= 4.0
    assert 0.0 <= mb["rollout/acceptance"] <= 1.0 and "rollout/accept_pos_2" in mb
    assert mb["drafter/param_change"] > 0 and mb["drafter/probe_acceptance"] > 0
    assert mb["drafter/probe_tau"] == pytest.approx(1 + 3 * mb["drafter/probe_acceptance"])
  # The moving policy changes its rollouts from step to step: the drafter has a moving target.
  assert all((plain[k][0].batch["ids"] != plain[k + 1][0].batch["ids"]).any() for k in range(steps - 1))
  moved = jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), initial, plain_state.params))
  assert max(moved) > 1e-3
  for x, y in zip(jax.tree.leaves(plain_state.params), jax.tree.leaves(spec_state.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert trainer.speculative_rollouts.refits == steps


# -- the refit guard -------------------------------------------------------------------------------------


def test_refit_guard_fails_a_dropped_drafter_update(tok, monkeypatch):
  """The refresh is replaced by one that returns the drafter's old weights (the update never lands)."""
  monkeypatch.setattr(sr.SpeculativeRollouts, "distill", lambda self, state, params, batch: (state, {"loss": 0.0}))
  cfg = rl_section(speculative=dict(enabled=True, drafter="transformer", drafter_num_layers=1, num_draft=2,
                                    cost_model=False))
  with pytest.raises(sr.DrafterRefitError, match="no drafter parameter changed"):
    _run(tok, cfg, 1)


def test_refit_guard_fails_a_dropped_ppow_refresh(tok, monkeypatch):
  monkeypatch.setattr(sr.SpeculativeRollouts, "ppow_refresh",
                      lambda self, state, params, tokens, mask: (state, {"loss": 0.0}))
  cfg = rl_section(speculative=dict(enabled=True, drafter="eagle", num_draft=2, cost_model=False, refresh="ppow"))
  with pytest.raises(sr.DrafterRefitError, match=r"no drafter parameter changed after 2 PPOW step\(s\)"):
    _run(tok, cfg, 1)


def test_ppow_refresh_every_second_step_is_lossless(tok):
  """Greedy GRPO with an EAGLE head refreshed by PPOW on steps 1 and 3 (``refresh_every = 2``): the rollouts
  equal plain sampling's on every step, the head changes only on refresh steps, and the PPOW metrics and the
  guard's probe come with each refresh."""
  steps = 3
  _, _, plain = _run(tok, rl_section(temperature=0.0), steps)
  heads = []
  spec = dict(enabled=True, drafter="eagle", num_draft=2, cost_model=False, refresh="ppow", refresh_every=2,
              learning_rate=1e-2, ppow=dict(steps_per_refresh=1, group_size=2, num_prefixes=4, pool_rows=4))
  trainer, _, history = _run(tok, rl_section(temperature=0.0, speculative=spec), steps,
                             before_step=lambda t, k: heads.append(
                                 None if k == 0 else jax.tree.map(np.asarray, t.speculative_rollouts.state.params)))
  heads.append(jax.tree.map(np.asarray, trainer.speculative_rollouts.state.params))
  for step, ((a, _), (b, metrics)) in enumerate(zip(plain, history)):
    np.testing.assert_array_equal(a.batch["ids"], b.batch["ids"], err_msg=f"step {step}")
    refreshed = step % 2 == 0
    assert metrics["drafter/refitted"] == float(refreshed)
    assert ("drafter/ppow_loss" in metrics) == ("drafter/probe_acceptance" in metrics) == refreshed
    if refreshed:
      assert metrics["drafter/param_change"] > 0 and "drafter/ppow/kl" in metrics
  same = jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), heads[1], heads[2]))
  assert all(same)  # Step 2 (index 1) did not refresh.
  assert not all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), heads[2], heads[3])))
  assert trainer.speculative_rollouts.refits == 2


def test_refit_guard_fails_below_the_probe_acceptance_floor(tok):
  """Floor 0.999: a once-distilled drafter's probe acceptance (reported in the error) is far below it."""
  spec = dict(enabled=True, drafter="transformer", drafter_num_layers=1, num_draft=2, cost_model=False,
              min_probe_acceptance=0.999)
  with pytest.raises(sr.DrafterRefitError, match=r"probe acceptance .* not above rl.speculative.min_probe_accep") as e:
    _run(tok, rl_section(speculative=spec), 1)
  achieved = float(re.search(r"probe acceptance ([0-9.]+)", str(e.value)).group(1))
  assert 0 < achieved < 0.999


# -- the cost model inside a run -------------------------------------------------------------------------


def test_cost_model_in_a_run_measures_and_decides(tok):
  """Step 1 samples plainly (no acceptance known yet) and distils (no refit cost known yet); the refit
  measures the three kernels. Step 2 decides from the running acceptance (the probe's after step 1): with
  ``min_speedup`` tiny and the refit cost forgotten (the rollout alone decides) it speculates and distils.
  Step 3, with ``min_speedup`` huge, samples plainly and, the refit cost being known, does no refit: the
  drafter is left as it was."""
  spec = dict(enabled=True, drafter="transformer", drafter_num_layers=1, num_draft=2, min_speedup=1e-6)
  drafters = []

  def before(trainer, k):
    spec_rollouts = trainer.speculative_rollouts if k else None
    if k == 1:
      spec_rollouts.refit_s = None
    if k == 2:
      spec_rollouts.cfg.min_speedup = 1e6
      assert spec_rollouts.refit_s > 0  # step 2's distillation compiled nothing
    if k:
      drafters.append(jax.tree.map(np.asarray, spec_rollouts.state.params))

  trainer, _, history = _run(tok, rl_section(speculative=spec), 3, before_step=before)
  first, second, third = (m for _, m in history)
  assert first["rollout/speculative_on"] == 0.0 and "rollout/predicted_speedup" not in first
  assert first["drafter/refitted"] == 1.0
  costs = trainer.speculative_rollouts.costs
  assert min(costs.target_s, costs.draft_s, costs.verify_s) > 0
  assert second["rollout/predicted_tau"] == pytest.approx(1 + 2 * first["drafter/probe_acceptance"])
  for metrics, on in ((second, 1.0), (third, 0.0)):
    assert metrics["rollout/speculative_on"] == on and ("rollout/tau" in metrics) == bool(on)
    assert metrics["drafter/refitted"] == on
    assert ("drafter/param_change" in metrics) == ("drafter/probe_acceptance" in metrics) == bool(on)
    assert metrics["rollout/predicted_speedup"] == pytest.approx(
        metrics["rollout/predicted_tau"] * costs.target_s / (costs.draft_s + costs.verify_s))
    assert metrics["cost/gamma"] == pytest.approx(costs.draft_s / (2 * costs.target_s))
  assert trainer.speculative_rollouts.refits == 2
  final = jax.tree.map(np.asarray, trainer.speculative_rollouts.state.params)
  jax.tree.map(np.testing.assert_array_equal, drafters[-1], final)  # step 3 left the drafter unchanged
