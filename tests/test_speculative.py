"""Speculative decoding: greedy identity with the target, lossless sampling, cache rollback, log-probs."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from lemon_rl.models import Transformer, get_preset
from lemon_rl.sampling import (compare_coupled, compare_greedy, generate, sampling_log_probs, sampling_logits,
                               speculative, speculative_generate)
from lemon_rl.sampling.sampler import prompt_bucket, right_pad

# Untied embeddings and a larger initialiser than the preset's so that greedy paths of these random models
# wander over the vocabulary instead of repeating the last token.
CFG = get_preset("tiny", vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=128,
                 tie_embeddings=False, initializer_range=0.1)
SMALL_CFG = CFG.replace(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, mlp_dim=64)
PROMPTS = [[20, 34, 50, 6, 45], [1], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 9], [33, 12, 60], [5, 44, 17, 28, 9, 61, 2],
           [14, 14], [3, 59, 26, 40, 11, 7, 52, 30, 19], [62, 0, 23, 47]]
K = 3
N = 24
NO_EOS = [-2, -3]  # two ids that match nothing: every call has two EOS ids (one compiled shape)

# Greedy reference path: ``generate(target, temperature=0)``, a 1-token cached decode. Tie rule: where the
# speculative output first differs from it in a row, the target's top-two logits at that position (full
# forward over the reference prefix) must lie within TIE_GAP of each other (a near-tie, where the rounding
# of the (K+1)-token verification, about sqrt(E) * eps * |logit| ~ 1e-6 here, can pick the other token);
# the rest of that row is excluded and the tie counted. Any other difference fails. For the seeds below
# there are no near-ties (the counts are asserted to be 0).
TIE_GAP = 1e-4


def _perturbed(cfg, seed, scale, noise_seed):
  """A model of ``cfg`` initialised from ``seed`` plus Gaussian noise of std ``scale`` on every parameter."""
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(noise_seed), len(leaves))
  nnx.update(model, jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                              for x, k in zip(leaves, keys)]))
  return model


@pytest.fixture(scope="module")
def target():
  return Transformer(CFG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def drafters(target):
  """Same architecture as the target (one compiled loop): itself, a noisy copy, an unrelated random model."""
  return {"identical": target, "noisy": _perturbed(CFG, 1, 0.01, 7), "unrelated": Transformer(CFG, rngs=nnx.Rngs(2))}


@pytest.fixture(scope="module")
def forward(target):
  return nnx.jit(type(target).__call__)


def _padded(seqs, width):
  ids, mask = right_pad(seqs, width, 0)
  return jnp.asarray(ids), jnp.asarray(mask)


def _count_ties_and_check(target, prompts, out, ref):
  """Asserts ``out`` equals ``ref`` row by row except after near-ties (see TIE_GAP); returns their number."""
  agreement = compare_greedy(target, prompts, out, ref, TIE_GAP)
  assert not agreement.mismatches, agreement.mismatches
  differing = {d.row for d in agreement.near_ties}
  for i in set(range(len(prompts))) - differing:
    np.testing.assert_allclose(out.log_probs[i], ref.log_probs[i], atol=1e-5)
  return len(agreement.near_ties)


@pytest.fixture(scope="module")
def greedy_reference(target):
  """``(eos_ids, generate's greedy output)``, with an EOS id that stops some rows mid-way."""
  free = generate(target, PROMPTS, N, jax.random.key(0), temperature=0.0, eos_ids=NO_EOS)
  # A token that the target emits greedily (not first) in some rows but not in all.
  candidates = [int(t) for t in np.unique(free.tokens[:, 3:])
                if 0 < np.isin(free.tokens, t).any(axis=1).sum() < len(PROMPTS)]
  eos = [candidates[0], -2]
  return eos, generate(target, PROMPTS, N, jax.random.key(0), temperature=0.0, eos_ids=eos)


def _compaction_batches(target_forwards: np.ndarray) -> list[int]:
  """The batch sizes a compacting decode ran at, from each row's number of active iterations: the loop
  halves the batch whenever at most half of its rows are active (``speculative._run``)."""
  batch, sizes = len(target_forwards), [len(target_forwards)]
  for t in range(int(target_forwards.max()) + 1):
    active = int((target_forwards > t).sum())  # rows active at iteration t
    while 0 < active <= batch // 2:
      batch //= 2
      sizes.append(batch)
  return sizes


def test_greedy_equals_target_greedy_at_batch_8_and_1(target, drafters, greedy_reference):
  speculative._loop.clear_cache()
  eos, ref = greedy_reference
  assert 0 < ref.finish_reasons.count("eos") < len(PROMPTS)
  assert any(r == "eos" and 1 < n < N for r, n in zip(ref.finish_reasons, ref.lengths))
  ties, outs, shapes = 0, {}, set()
  for name, drafter in drafters.items():
    outs[name] = out = speculative_generate(target, drafter, PROMPTS, N, jax.random.key(5), num_draft=K,
                                            temperature=0.0, eos_ids=eos)
    ties += _count_ties_and_check(target, PROMPTS, out, ref)
    shapes.update(_compaction_batches(out.stats.target_forwards))
    s = out.stats
    np.testing.assert_array_equal(s.drafted, K * s.target_forwards)
    np.testing.assert_array_equal(s.accepted, s.accepted_per_position.sum(axis=1))
    # Every verification emits accepted + 1 tokens, the last window possibly cut by EOS / the length.
    emitted = s.accepted + s.target_forwards
    assert np.all(out.lengths - 1 <= emitted) and np.all(emitted < out.lengths - 1 + K + 1)
  # The rows finish at different iterations, so the batch was compacted (outputs checked above); one compile
  # per batch size it ran at for the three drafters and two EOS sets.
  assert len(shapes) > 2 and speculative._loop._cache_size() == len(shapes)
  assert ties == 0
  same = outs["identical"].stats
  np.testing.assert_array_equal(same.accepted, same.drafted)  # all accepted: tau = K + 1
  np.testing.assert_array_equal(same.tau[same.target_forwards > 0], K + 1)
  noisy, unrelated = outs["noisy"].stats, outs["unrelated"].stats
  assert 0.2 < noisy.accepted.sum() / noisy.drafted.sum() < 0.9 and len(set(noisy.accepted.tolist())) > 2
  assert unrelated.accepted.sum() / unrelated.drafted.sum() < 0.2  # many rejections
  # Per-position acceptance never increases (position j needs j - 1 accepted before it).
  assert np.all(np.diff(noisy.accepted_per_position.sum(axis=0)) <= 0)

  # Batch 1: the first row that stops on EOS, against generate at batch 1.
  row = ref.finish_reasons.index("eos")
  ref1 = generate(target, [PROMPTS[row]], N, jax.random.key(0), temperature=0.0, eos_ids=eos)
  assert ref1.finish_reasons == ["eos"] and ref1.lengths[0] == ref.lengths[row]
  for name in ("identical", "unrelated"):
    out = speculative_generate(target, drafters[name], [PROMPTS[row]], N, jax.random.key(6), num_draft=K,
                               temperature=0.0, eos_ids=eos)
    assert _count_ties_and_check(target, [PROMPTS[row]], out, ref1) == 0
    np.testing.assert_array_equal(out.tokens, ref.tokens[row:row + 1])


# -- lossless sampling --------------------------------------------------------------------------------

V6 = get_preset("tiny", vocab_size=6, hidden_size=32, num_heads=2, num_kv_heads=1, mlp_dim=64,
                tie_embeddings=False, initializer_range=0.1)
SMALL_PROMPTS = [[1, 2], [3, 0, 4]]  # different lengths in one batch
WINDOW = 4  # new tokens: the prefill's token, then K6 drafts + correction / bonus, then more windows
K6 = 2
ROWS = 3000  # per prompt (the lossy variant then gets p-values below 1e-40)
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.8), (0.8, 4, 0.9)]


@pytest.fixture(scope="module")
def small_models():
  target = Transformer(V6, rngs=nnx.Rngs(3))
  # A drafter whose q is far from p: other weights, a larger initialiser (peaky q; total variation
  # distance to p of 0.4-0.7 on these prompts).
  drafter = Transformer(V6.replace(num_layers=1, hidden_size=16, mlp_dim=32, initializer_range=0.5),
                        rngs=nnx.Rngs(4))
  return target, drafter


@functools.partial(jax.jit, static_argnames="window")
def _exact_joints(logits, starts, temperature, top_k, top_p, *, window):
  """The target's exact distribution of ``window`` new tokens after each prompt, by enumeration.

  ``logits [P, M, T, V]``: the target's logits over prompt ``i`` followed by each of the ``M = V **
  (window - 1)`` heads (``itertools.product`` order), the prompt's last token at ``starts[i]``. Returns
  ``[P, V ** window]`` probabilities, the window read as a base-``V`` number.
  """
  probs = jax.nn.softmax(sampling_logits(logits, temperature, top_k, top_p), axis=-1)
  v = logits.shape[-1]
  heads = jnp.asarray(list(itertools.product(range(v), repeat=window - 1)))
  rows = jnp.arange(heads.shape[0])
  joints = []
  for i, start in enumerate(starts):
    joint = jnp.ones((heads.shape[0], 1))
    for j in range(window - 1):
      joint = joint * probs[i, rows, start + j, heads[:, j]][:, None]
    joints.append((joint * probs[i, :, start + window - 1]).reshape(-1))
  return jnp.stack(joints)


def _enumeration_logits(forward, target, prompts):
  """``[P, V ** (WINDOW - 1), T, V]`` full-forward logits of every prompt followed by every head."""
  v = target.cfg.vocab_size
  seqs = [list(p) + list(h) for p in prompts for h in itertools.product(range(v), repeat=WINDOW - 1)]
  logits = forward(target, *_padded(seqs, max(map(len, seqs))))
  return logits.reshape(len(prompts), v ** (WINDOW - 1), *logits.shape[1:])


def _chi_square_p_value(tokens, exact, v):
  """Chi-square goodness of fit of the windows' empirical joint to ``exact``; cells with expected < 5 are
  pooled. Also asserts that no window of probability 0 was emitted."""
  counts = np.bincount((tokens * v ** np.arange(WINDOW - 1, -1, -1)).sum(axis=1), minlength=v ** WINDOW)
  expected = len(tokens) * exact / exact.sum()
  assert counts[expected == 0].sum() == 0
  small = expected < 5
  observed = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  keep = expected > 0
  assert keep.sum() > 20
  return stats.chisquare(observed[keep], expected[keep]).pvalue


def test_sampling_is_lossless_and_resampling_from_p_is_not(small_models):
  target, drafter = small_models
  prompts = [p for p in SMALL_PROMPTS for _ in range(ROWS)]
  logits = _enumeration_logits(nnx.jit(type(target).__call__), target, SMALL_PROMPTS)
  starts = tuple(len(p) - 1 for p in SMALL_PROMPTS)
  alpha = 0.01 / (len(SETTINGS) * len(SMALL_PROMPTS))  # family-wise 1% (Bonferroni)
  compiled, shapes = speculative._loop._cache_size(), set()
  for s, (temperature, top_k, top_p) in enumerate(SETTINGS):
    exact = np.asarray(_exact_joints(logits, starts, temperature, top_k, top_p, window=WINDOW), np.float64)
    # The residual method, its lossy variant (one compiled loop: the flag is traced), Gumbel coupling.
    for residual, coupled in ((True, False), (False, False), (True, True)):
      out = speculative_generate(target, drafter, prompts, WINDOW, jax.random.key(100 + s), num_draft=K6,
                                 temperature=temperature, top_k=top_k, top_p=top_p, min_prompt_bucket=4,
                                 resample_from_residual=residual, coupled=coupled)
      assert (out.lengths == WINDOW).all()
      shapes.update((top_k > 0 or top_p < 1, coupled, b) for b in _compaction_batches(out.stats.target_forwards))
      # q is far from p: the first draft is rejected in about half of the windows or more.
      assert out.stats.acceptance_rate_per_position[0] < 0.6
      for i in range(len(SMALL_PROMPTS)):
        p_value = _chi_square_p_value(out.tokens[i * ROWS:(i + 1) * ROWS], exact[i], target.cfg.vocab_size)
        setting = f"T={temperature} top_k={top_k} top_p={top_p} prompt {i} coupled={coupled}"
        if residual:
          assert p_value > alpha, f"lossless sampling rejected at {setting}: p={p_value:.2e}"
        else:
          assert p_value < alpha, f"the lossy variant passed at {setting}: p={p_value:.2e}"
  # Temperature, top-k, top-p and the residual flag are traced: one compile per (filtered or not, coupled or
  # not, batch size the compaction ran at).
  assert speculative._loop._cache_size() == compiled + len(shapes)


COUPLED_SETTINGS = [(1.0, 0, 1.0), (0.8, 4, 0.9)]


def test_coupled_sampling_emits_plain_coupled_sampling_tokens_whatever_the_drafter(target, drafters,
                                                                                   greedy_reference):
  """Gumbel coupling: speculative output == ``generate(coupled=True)`` for the key, for any drafter.

  Tie rule as for greedy decoding (TIE_GAP), on the perturbed logits ``sampling_logits + noise`` whose
  argmax both paths take (:func:`compare_coupled`); for these seeds there are none (asserted)."""
  eos, _ = greedy_reference
  for s, (temperature, top_k, top_p) in enumerate(COUPLED_SETTINGS):
    key = jax.random.key(40 + s)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=eos)
    ref = generate(target, PROMPTS, N, key, coupled=True, **sampling)
    assert 0 < ref.finish_reasons.count("eos") < len(PROMPTS)
    # The noise belongs to (key, row, position): other prompts in the other rows change nothing in a row,
    # and without coupling the same key gives other tokens.
    others = generate(target, PROMPTS[:4] + PROMPTS[:3:-1], N, key, coupled=True, **sampling)
    np.testing.assert_array_equal(others.tokens[:4], ref.tokens[:4])
    assert (generate(target, PROMPTS, N, key, **sampling).tokens != ref.tokens).any()
    acceptance = {}
    for name, drafter in drafters.items():
      out = speculative_generate(target, drafter, PROMPTS, N, key, num_draft=K, coupled=True, **sampling)
      agreement = compare_coupled(target, PROMPTS, out, ref, TIE_GAP, key, temperature, top_k, top_p)
      assert not agreement.mismatches and not agreement.near_ties, (name, agreement)
      assert agreement.identical == len(PROMPTS)
      np.testing.assert_allclose(out.log_probs, ref.log_probs, atol=1e-5)
      acceptance[name] = out.stats.accepted.sum() / out.stats.drafted.sum()
    # The target as its own drafter draws the target's tokens: every draft is accepted.
    assert acceptance["identical"] == 1
    assert acceptance["unrelated"] < acceptance["noisy"] < 1


# -- rollback and log-probs ---------------------------------------------------------------------------


def test_caches_after_rollback_equal_a_run_over_the_accepted_prefix(target, drafters, greedy_reference):
  # The noisy drafter at greedy decoding (the loop compiled by the greedy test): partial acceptance, so
  # windows are rolled back by different amounts in different rows, fully accepted ones leave a carry, and
  # rows stopped by EOS must stay frozen.
  eos, _ = greedy_reference
  drafter = drafters["noisy"]
  tokens, _, generated, hit_eos, (forwards, accepted, per_position), cache, draft_state = jax.device_get(
      speculative._run(target, drafter, PROMPTS, N, jax.random.key(5), K, 0.0, 0, 1.0, eos, 0, 16, True))
  assert np.all(accepted < K * forwards) and len(set(accepted.tolist())) > 2  # rejections, mixed lengths
  assert per_position[:, -1].sum() > 0 and 0 < hit_eos.sum() < len(PROMPTS)  # full windows (carries), EOS
  # The target holds the prompt and every emitted token but the last; the drafter the same, but for
  # ``carry`` (d_K of a fully accepted window, which it never ran) when ``has_carry``.
  target_seqs = [list(p) + tokens[i, :generated[i] - 1].tolist() for i, p in enumerate(PROMPTS)]
  draft_seqs = [s[:len(s) - int(c)] for s, c in zip(target_seqs, draft_state.has_carry)]
  for i in np.flatnonzero(draft_state.has_carry):
    assert draft_state.carry[i] == tokens[i, generated[i] - 2]
  width = prompt_bucket(max(map(len, target_seqs)))
  target_def, target_vars = nnx.split(target)
  drafter_def, drafter_vars = nnx.split(speculative.ModelDrafter(drafter))
  ref_target = speculative._prefill(target_def, target_vars, drafter_def, drafter_vars,
                                    *_padded(target_seqs, width), num_slots=width)[1]
  ref_draft = speculative._prefill(target_def, target_vars, drafter_def, drafter_vars,
                                   *_padded(draft_seqs, width), num_slots=width)[2].cache
  # The same keys / values computed by two paths (prefill's causal attention vs appends by extend over
  # different query counts): float32 sums in another order. Keys/values are O(1); each of the 2 layers
  # adds relative rounding of about sqrt(E) * eps ~ 1e-6 per matmul (a few in sequence), so 2e-5 absolute
  # is a margin of several times (measured: 2.4e-6), and a wrong slot or a stale token is off by O(0.1).
  slots_second = lambda c: tuple(np.swapaxes(k, 2, 3) for k in c.keys) + c.values  # keys are stored slots-last
  for got, want, seqs in ((cache, ref_target, target_seqs), (draft_state.cache, ref_draft, draft_seqs)):
    np.testing.assert_array_equal(got.lengths, [len(s) for s in seqs])
    for layer_got, layer_want in zip(slots_second(got), slots_second(want)):
      for i, s in enumerate(seqs):
        np.testing.assert_allclose(layer_got[i, :, :len(s)], layer_want[i, :, :len(s)], atol=2e-5, rtol=0)


# The engine's log-probs come from the cached (K+1)-token verification, the learner's from a full forward:
# they differ by float32 rounding of the logits, about sqrt(E) * eps * |logit| ~ 1e-6 here, and a log-prob
# moves by at most twice that divided by the temperature; 1e-5 leaves a margin of several times while a
# wrong position, distribution or token is off by far more. On the small-vocabulary models (the loop the
# lossless test compiled) so that accepted, residual and bonus tokens all occur thousands of times.
def test_log_probs_equal_sampling_log_probs_of_a_full_forward(small_models):
  target, drafter = small_models
  temperature, top_k, top_p = SETTINGS[-1]
  prompts = [p for p in SMALL_PROMPTS for _ in range(ROWS)]
  out = speculative_generate(target, drafter, prompts, WINDOW, jax.random.key(7), num_draft=K6,
                             temperature=temperature, top_k=top_k, top_p=top_p, min_prompt_bucket=4)
  assert (out.lengths == WINDOW).all() and out.stats.accepted.sum() < out.stats.drafted.sum() / 2
  seqs = [p + t for p, t in zip(prompts, out.tokens.tolist())]
  ids, mask = _padded(seqs, max(map(len, seqs)))
  logp = np.asarray(sampling_log_probs(nnx.jit(type(target).__call__)(target, ids, mask)[:, :-1], ids[:, 1:],
                                       temperature, top_k, top_p))
  starts = np.asarray([len(p) - 1 for p in prompts])[:, None] + np.arange(WINDOW)
  np.testing.assert_allclose(out.log_probs, np.take_along_axis(logp, starts, axis=1), atol=1e-5)


def test_bad_arguments_raise(target):
  other = Transformer(CFG.replace(vocab_size=32), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="vocabulary"):
    speculative_generate(target, other, [[1]], 4, jax.random.key(0))
  with pytest.raises(ValueError, match="num_draft"):
    speculative_generate(target, target, [[1]], 4, jax.random.key(0), num_draft=0)
  with pytest.raises(ValueError, match="at least one token"):
    speculative_generate(target, target, [[1], []], 4, jax.random.key(0))
