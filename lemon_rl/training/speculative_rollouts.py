"""Speculative rollouts in the RL trainers: the policy as the target, a drafter kept in step with it.

``rl.speculative.enabled = True`` makes the shared rollout (:mod:`lemon_rl.training.rollout`) sample with
:func:`lemon_rl.sampling.speculative_generate` instead of ``generate``: the current policy is the target, the
drafter proposes ``K = num_draft`` tokens per verification, the sampling settings are the rollout's own
(temperature, top-k, top-p, EOS ids). The engine is lossless, so the rollouts have the distribution of plain
sampling (token for token the same at greedy decoding): nothing downstream (rewards, advantages, the loss)
changes. :func:`lemon_rl.training.rollout.rollout_and_update`, the body of every trainer's step, installs a
:class:`SpeculativeRollouts` as the rollout's sampler and calls :meth:`SpeculativeRollouts.refit` after the
policy update, so every trainer that samples through the shared rollout gets speculation without a branch of
its own. One step::

    decide (cost model) -> rollout (speculative or plain) -> policy update -> refit the drafter -> guard

Drafters (``rl.speculative.drafter``): ``eagle``, an :class:`~lemon_rl.models.drafter.EagleHead` over the
policy's own features (``feature_layers``, default EAGLE-3's), drafting through the policy's LM head; or
``transformer``, a small ``Transformer`` of preset ``drafter_preset`` over the policy's vocabulary.

**Refresh** (NeMo-RL style token distillation). After every policy update (with the cost model, after every
update whose rollout speculated: see below), ``distill_steps_per_rl_step``
AdamW steps of the drafter on the step's own rollout sequences (prompt + completion, right-packed), with soft
labels from the *updated* policy: :class:`~lemon_rl.training.drafter_training.DrafterLoss` (the EAGLE-3
training-time test over ``ttt_steps`` drafting steps) for ``eagle``; for ``transformer``
:class:`TokenDistillLoss`, the same soft-label cross-entropy ``sum_t m_t CE(p_t, q_t) / sum_t m_t`` at every
position. Both go through :func:`lemon_rl.training.drafter_training.update_step`, whose gradient touches the
drafter only (the policy enters as a constant). *Decision*: the drafter does not learn from prompts only;
every real token of the rollout sequences, prompt included, is a distillation position (the completions are
what it drafts, the prompts are the context it must read).

**PPOW refresh** (``refresh = "ppow"``, ``eagle`` only): instead, ``ppow.steps_per_refresh`` PPOW updates
(window-level RL, :mod:`lemon_rl.training.ppow_training`, METHODS.md section 3): windows of ``K`` tokens drafted
at temperature 1 after prefixes of ``ppow.pool_rows`` rollout sequences, rewarded by their accepted length under
the updated policy (the frozen target), ``ppow.group_size`` windows per prefix, ADAW prefix choice, the clipped
window surrogate minus ``beta KL(Q || P)``, with the drafter's optimizer. With either refresh,
``refresh_every = N`` refreshes on every ``N``-th step that needs one (the first one included) and leaves the
drafter as it is in between, where only the running acceptance follows the measured rollouts.

**Refit guard** (no anchor has one; NeMo-RL #2646 is a run whose drafter weights were silently dropped).
After every refresh: (1) some drafter parameter must differ from its value before the refresh, else
:class:`DrafterRefitError`; (2) the drafter's acceptance on a fixed probe batch (``probe_size`` rows of the
first step's rollout sequences, kept for the whole run) must exceed ``min_probe_acceptance``, else
:class:`DrafterRefitError`. The probe is teacher-forced: :func:`window_acceptance` gives the acceptance
rate ``alpha_k`` of drafting step ``k`` given an accepted prefix (greedy: the drafter's argmax equals the
policy's; otherwise ``sum_v min(p, q)`` under the sampling settings, the probability that speculative
sampling accepts), and the probe's per-position acceptance ``a_k = prod_{j<=k} alpha_j`` (independent
positions), its ``acceptance = mean_k a_k`` (accepted / drafted tokens) and ``tau = 1 + sum_k a_k``.

**Cost model.** With ``t`` the policy's plain decode step (one token per row), ``c`` one drafter proposal of
``K`` tokens and ``v`` one verification pass of ``K + 1`` tokens, all measured for the rollout's batch
(:func:`measure_step_costs`, once, in the first refit, outside any rollout's time), a speculative rollout
emits ``tau`` tokens per ``c + v`` seconds and plain sampling one per ``t``::

    speedup = tau * t / (c + v)          (= tau / (1 + K gamma) when v = t and c = K gamma t)

with ``tau = 1 + sum_k a_k`` from the running per-position acceptance ``a`` (:func:`expected_tau`). Keeping
the drafter in step costs ``r`` seconds a step (the last refit's refresh and probe that compiled nothing,
divided by ``refresh_every``), so a step
speculates iff ``speedup > min_speedup`` and the rollout's predicted saving pays for the refit,
``N t (1 - 1 / speedup) > r`` (``N = max_new_tokens`` decode steps; :func:`should_speculate`); a step that
sampled plainly once ``r`` is known does no refit at all (no distillation, no probe), so with the cost model
on a step is never predicted slower than plain sampling. *Decision*: a drafter that does not pay is not
trained further (and ``a``, ``r`` and the costs stay as they are, so speculation stays off): start the cost
model from a trained drafter (:meth:`SpeculativeRollouts.set_drafter`); a random one gets the first refits
(until ``r`` is measured) and stays off. *Decisions*: ``a`` is an exponential moving average (weight
``1 - acceptance_decay`` on the newest value) of the measured per-position acceptance of the speculative
rollouts and, on steps that sampled plainly and refitted (which measure nothing), of the probe's; before
any acceptance is known (the first step) the cost model samples plainly. ``cost_model = False`` speculates
on every step (nothing is timed).

Metrics (every step, merged into the trainer's): ``rollout/speculative_on``; on speculative steps
``rollout/tau``, ``rollout/acceptance``, ``rollout/accept_pos_{k}``, ``rollout/iteration_s`` and, with the
cost model, ``rollout/measured_speedup = tau * t / iteration_s`` (``iteration_s`` = the call's seconds per
verification iteration, prefills included; not logged for a call that compiled); with the cost model
``rollout/predicted_speedup``, ``rollout/predicted_tau``, ``cost/target_s``, ``cost/draft_s``,
``cost/verify_s``, ``cost/gamma``, ``cost/refit_s`` (``cost/measure_s`` once); after the refit
``drafter/refitted`` and, when it ran, the distillation loss and parameter change, the probe
acceptance and tau, per-position probe acceptance, refit seconds (``drafter/*``) and ``time/drafter_refit_s``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import config_dict

from lemon_rl import ops
from lemon_rl.losses import ppow as ppow_losses
from lemon_rl.models.config import get_preset, preset_names
from lemon_rl.models.drafter import EagleDrafter, EagleHead, shift_left
from lemon_rl.models.transformer import Transformer
from lemon_rl.sampling import distribution, speculative
from lemon_rl.sampling.sampler import SampleOutput, prompt_bucket
from lemon_rl.training import base_config
from lemon_rl.training import distributed
from lemon_rl.training import drafter_training
from lemon_rl.training import ppow_training
from lemon_rl.training import state as state_lib
from lemon_rl.utils import config_checks as cc

DRAFTERS = ("eagle", "transformer")
REFRESHES = ("distill", "ppow")


def default_config() -> config_dict.ConfigDict:
  """The ``rl.speculative`` section with its defaults (documented in ``lemon_rl.training.base_config``)."""
  return base_config.get_base_config().rl.speculative


def check_config(rl) -> None:
  """``rl.speculative``: known fields only (a typo names the field and its closest known name), ranges."""
  if "speculative" not in rl:
    return
  spec = rl.speculative
  known = default_config()
  for prefix, section, defaults in (("", spec, known), ("ppow.", spec.get("ppow", {}), known.ppow)):
    for key in section.keys():
      if key not in defaults:
        close = difflib.get_close_matches(key, list(defaults.keys()), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise cc.ConfigError(f"config.rl.speculative.{prefix}{key}: unknown field{hint} (known: "
                             f"{', '.join(defaults.keys())})")
  for key in ("enabled", "cost_model"):
    cc.require(isinstance(spec[key], bool), f"rl.speculative.{key}", spec[key], "must be True or False")
  cc.require_choice(DRAFTERS, "rl.speculative.drafter", spec.drafter)
  cc.require_choice(REFRESHES, "rl.speculative.refresh", spec.refresh)
  cc.require(spec.refresh != "ppow" or spec.drafter == "eagle", "rl.speculative.refresh", spec.refresh,
             f"PPOW trains an EagleHead: needs rl.speculative.drafter='eagle', not {spec.drafter!r}")
  cc.require(isinstance(spec.refresh_every, int) and spec.refresh_every >= 1, "rl.speculative.refresh_every",
             spec.refresh_every, "must be an integer >= 1")
  if spec.refresh == "ppow":
    cc.require_positive(spec.ppow, "rl.speculative.ppow", "steps_per_refresh", "group_size", "num_prefixes",
                        "pool_rows")
    cc.require_choice(ppow_losses.VERIFICATIONS, "rl.speculative.ppow.verification", spec.ppow.verification)
  cc.require_choice(preset_names(), "rl.speculative.drafter_preset", spec.drafter_preset)
  cc.require_positive(spec, "rl.speculative", "num_draft", "distill_steps_per_rl_step", "learning_rate",
                      "probe_size", "min_speedup")
  cc.require_positive(spec, "rl.speculative", "distill_microbatch_size", "ttt_steps", "drafter_num_layers",
                      "min_probe_acceptance", allow_zero=True)
  cc.require(0 <= spec.min_probe_acceptance < 1, "rl.speculative.min_probe_acceptance", spec.min_probe_acceptance,
             "must be in [0, 1) (the guard needs acceptance above it)")
  cc.require(0 <= spec.acceptance_decay < 1, "rl.speculative.acceptance_decay", spec.acceptance_decay,
             "must be in [0, 1)")
  cc.require(all(isinstance(i, int) and i >= 0 for i in spec.feature_layers), "rl.speculative.feature_layers",
             spec.feature_layers, "must be policy block indices (() = EAGLE-3's default)")
  if spec.enabled and rl.get("steps"):
    rows = rl.prompts_per_step * rl.num_generations
    micro = spec.distill_microbatch_size or rows
    cc.require(rows % micro == 0, "rl.speculative.distill_microbatch_size", micro,
               f"must divide rl.prompts_per_step * rl.num_generations = {rows}")


class DrafterRefitError(RuntimeError):
  """The refit guard failed: the drafter was not updated, or its probe acceptance is at or below the floor."""


# -- the cost model: pure functions of measured times ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Measured seconds for the rollout's batch: ``target_s`` one plain decode step of the policy (a 1-token
  extend + draw), ``draft_s`` one drafter proposal of ``K`` tokens, ``verify_s`` one ``K + 1``-token
  verification pass of the policy (extend + verify)."""

  target_s: float
  draft_s: float
  verify_s: float
  num_draft: int

  @property
  def gamma(self) -> float:
    """Drafter / target cost per token, ``draft_s / (K target_s)``."""
    return self.draft_s / (self.num_draft * self.target_s)


def expected_tau(acceptance_per_position: Sequence[float]) -> float:
  """``tau = 1 + sum_k a_k``: tokens per verification, ``a_k`` the fraction of verifications accepting draft
  position ``k`` (acceptance is prefix-closed, so ``E[accepted] = sum_k P(accepted >= k + 1)``)."""
  return 1.0 + float(np.sum(acceptance_per_position))


def predicted_speedup(tau: float, costs: StepCosts) -> float:
  """Plain seconds per token over speculative seconds per token: ``tau * target_s / (draft_s + verify_s)``."""
  return tau * costs.target_s / (costs.draft_s + costs.verify_s)


def should_speculate(tau: float, costs: StepCosts, min_speedup: float = 1.0, decode_steps: int | None = None,
                     refit_s: float | None = None) -> bool:
  """Whether speculation pays: ``speedup = predicted_speedup(tau, costs) > min_speedup`` and, when the
  drafter's refit time ``refit_s`` is known, the rollout's predicted saving covers it:
  ``decode_steps * target_s * (1 - 1 / speedup) > refit_s`` (``decode_steps`` plain decode steps)."""
  speedup = predicted_speedup(tau, costs)
  if not speedup > min_speedup:
    return False
  return refit_s is None or decode_steps * costs.target_s * (1.0 - 1.0 / speedup) > refit_s


# -- timing the actual kernels ---------------------------------------------------------------------------


def _drafter_module(kind: str, target: Transformer, drafter: nnx.Module) -> nnx.Module:
  """What the engine takes: ``EagleDrafter(target, head)`` or a ``ModelDrafter``."""
  return EagleDrafter(target, drafter) if kind == "eagle" else speculative.ModelDrafter(drafter)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "num_slots", "num_draft"))
def _timing_setup(target_def, target_vars, drafter_def, drafter_vars, ids, mask, num_slots, num_draft):
  """Prefilled policy cache and drafter state (as the engine's prefill)."""
  target, drafter = nnx.merge(target_def, target_vars), nnx.merge(drafter_def, drafter_vars)
  layers = tuple(getattr(drafter, "feature_layers", ()) or ())
  if not layers:
    _, cache = target.prefill(ids, mask, num_slots)
    return cache, drafter.prefill(ids, mask, num_slots)
  _, cache, features = target.prefill(ids, mask, num_slots, feature_layers=layers)
  return cache, drafter.prefill(ids, mask, num_slots, target_features=features, num_draft=num_draft)


@functools.partial(jax.jit, static_argnames=("target_def", "steps", "temperature", "top_k", "top_p"))
def _target_steps(target_def, target_vars, cache, token, key, *, steps, temperature, top_k, top_p):
  """``steps`` plain decode steps (1-token extend, draw), as ``generate``'s loop."""
  target = nnx.merge(target_def, target_vars)

  def body(i, carry):
    cache, token = carry
    hidden, cache = target.extend(token[:, None], cache)
    token, _ = distribution.sample(target.logits_from_hidden(hidden[:, 0]), jax.random.fold_in(key, i),
                                   temperature, top_k, top_p)
    return cache, token

  return jax.lax.fori_loop(0, steps, body, (cache, token))[1]


@functools.partial(jax.jit, static_argnames=("target_def", "steps", "temperature", "top_k", "top_p"))
def _verify_steps(target_def, target_vars, cache, window, key, *, steps, temperature, top_k, top_p):
  """``steps`` verification passes of ``window [B, K + 1]`` (extend, logits, verify, roll back)."""
  target = nnx.merge(target_def, target_vars)
  greedy = temperature == 0

  def body(i, carry):
    window, total = carry
    hidden, extended = target.extend(window, cache)
    logits = target.logits_from_hidden(hidden)
    q = None if greedy else logits[:, :-1]
    n, emitted, _ = speculative.verify(logits, window[:, 1:], q, jax.random.fold_in(key, i), temperature, top_k,
                                       top_p)
    del extended  # the cache is rolled back: every pass sees the same context
    return window.at[:, 0].set(emitted[:, 0]), total + n

  return jax.lax.fori_loop(0, steps, body, (window, jnp.zeros(window.shape[:1], jnp.int32)))[1]


@functools.partial(jax.jit, static_argnames=("drafter_def", "steps", "num_draft", "temperature", "top_k",
                                             "top_p", "hidden_size", "feature_size"))
def _draft_steps(drafter_def, drafter_vars, state, last, key, *, steps, num_draft, temperature, top_k, top_p,
                 hidden_size, feature_size):
  """``steps`` drafter proposals of ``K`` tokens, each rolled back to one kept token."""
  drafter = nnx.merge(drafter_def, drafter_vars)
  b = last.shape[0]
  hidden = jnp.zeros((b, num_draft + 1, hidden_size), jnp.float32)
  kept = jnp.ones((b,), jnp.int32)

  def body(i, carry):
    state, last = carry
    noise = speculative.draft_noise(jax.random.fold_in(key, i), b, num_draft, drafter.vocab_size, temperature)
    drafts, _, state = drafter.propose(state, last, noise, num_draft, temperature, top_k, top_p)
    if feature_size:
      state = drafter.rollback(state, kept, hidden,
                               target_features=jnp.zeros((b, num_draft + 1, feature_size), jnp.float32))
    else:
      state = drafter.rollback(state, kept, hidden)
    return state, drafts[:, 0]

  return jax.lax.fori_loop(0, steps, body, (state, last))[1]


def measure_step_costs(target: Transformer, drafter: nnx.Module, batch: int, context: int, num_draft: int,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, steps: int = 8,
                       repeats: int = 2) -> StepCosts:
  """Times the three kernels of the cost model on ``batch`` random rows after ``context`` cached positions.

  ``drafter`` is an engine drafter (``EagleDrafter`` or ``ModelDrafter``). Each kernel runs ``steps`` times
  inside one jitted loop; the best of ``repeats`` timed loops after a warm-up (which compiles) counts.
  """
  rng = np.random.default_rng(0)
  vocab = target.cfg.vocab_size
  ids = jnp.asarray(rng.integers(0, vocab, (batch, context)), jnp.int32)
  mask = jnp.ones_like(ids)
  # Room for the drafter's growth (at most K + 1 slots per proposal) and a K + 1 window.
  num_slots = context + steps * (num_draft + 2) + num_draft + 2
  target_def, target_vars = nnx.split(target)
  drafter_def, drafter_vars = nnx.split(drafter)
  cache, draft_state = _timing_setup(target_def, target_vars, drafter_def, drafter_vars, ids, mask,
                                     num_slots=num_slots, num_draft=num_draft)
  key = jax.random.key(0)
  sampling = {"temperature": 0 if temperature == 0 else float(temperature), "top_k": int(top_k),
              "top_p": float(top_p)}
  window = jnp.asarray(rng.integers(0, vocab, (batch, num_draft + 1)), jnp.int32)
  layers = tuple(getattr(drafter, "feature_layers", ()) or ())
  hidden_size = target.cfg.hidden_size

  best = lambda run: drafter_training.seconds_per_step(run, steps, repeats)
  target_s = best(lambda: _target_steps(target_def, target_vars, cache, ids[:, -1], key, steps=steps, **sampling))
  verify_s = best(lambda: _verify_steps(target_def, target_vars, cache, window, key, steps=steps, **sampling))
  draft_s = best(lambda: _draft_steps(drafter_def, drafter_vars, draft_state, ids[:, -1], key, steps=steps,
                                      num_draft=num_draft, hidden_size=hidden_size,
                                      feature_size=len(layers) * hidden_size, **sampling))
  return StepCosts(target_s, draft_s, verify_s, num_draft)


# -- distillation and the probe --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenDistillLoss:
  """Soft-label distillation of a token-level ``Transformer`` drafter to the policy on ``batch = {"tokens",
  "mask"}`` ``[B, T]`` (right padding): ``sum_t m_t CE(p_t, q_t) / sum_t m_t`` over the positions ``t >= 1``
  whose next token is real, ``p_t`` / ``q_t`` the policy's / drafter's next-token distributions (temperature
  1, as :class:`~lemon_rl.training.drafter_training.DrafterLoss`). Computed by
  :func:`~lemon_rl.training.drafter_training.soft_label_loss` with one step whose draft logits are the
  drafter's shifted one position (its convention: step 0 at ``t`` predicts ``x_{t+2}``), so its ``ce_0``,
  ``top1_0``, ``accept_0`` metrics have their meaning there."""

  def __call__(self, drafter: Transformer, target: Transformer, batch: Mapping[str, jax.Array]):
    tokens, mask = batch["tokens"], batch["mask"].astype(bool)
    target_logits = jax.lax.stop_gradient(target(tokens, mask))
    draft_logits = shift_left(drafter(tokens, mask), 1)[None]
    return drafter_training.soft_label_loss(draft_logits, target_logits, mask, jnp.ones((1,), jnp.float32))


def _draft_logits(kind: str, drafter, target: Transformer, tokens, mask, num_steps: int):
  """``(draft_logits [S, B, T, V], target_logits [B, T, V])``, step ``k`` at ``t`` predicting ``x_{t+k+2}``
  after the true prefix ``x_0..x_{t+k+1}`` (the training-time test for ``eagle``; a token drafter reads the
  true tokens, so its step ``k`` at ``t`` is its prediction at ``t + k + 1``)."""
  if kind == "eagle":
    features, _, target_logits, embeds = drafter_training.teacher(target, tokens, mask, drafter.feature_layers)
    normed = drafter.normed(drafter.unroll(features, embeds, mask, num_steps))
    return target.logits_from_hidden(normed), target_logits
  target_logits = target(tokens, mask)
  logits = drafter(tokens, mask)
  return jnp.stack([shift_left(logits, k + 1) for k in range(num_steps)]), target_logits


def window_acceptance(draft_logits: jax.Array, target_logits: jax.Array, mask: jax.Array, temperature: float,
                      top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """``[S]`` acceptance rate ``alpha_k`` of drafting step ``k`` given an accepted prefix, over real positions.

  ``draft_logits [S, B, T, V]`` (step ``k`` at ``t`` predicts ``x_{t+k+2}``), ``target_logits [B, T, V]``
  (``t`` predicts ``x_{t+1}``), ``mask [B, T]``. Greedy (``temperature == 0``): ``[argmax q = argmax p]``;
  otherwise ``sum_v min(p_v, q_v)`` with ``p``, ``q`` the sampling distributions
  (:func:`lemon_rl.sampling.sampling_logits`), the probability that speculative sampling accepts the draft.
  """
  mask = mask.astype(bool)
  rates = []
  for k in range(draft_logits.shape[0]):
    labels = shift_left(target_logits, k + 1)
    valid = mask & shift_left(mask, k + 1)
    if temperature == 0:
      accept = (jnp.argmax(draft_logits[k], -1) == jnp.argmax(labels, -1)).astype(jnp.float32)
    else:
      p = jax.nn.softmax(distribution.sampling_logits(labels.astype(jnp.float32), temperature, top_k, top_p), -1)
      q = jax.nn.softmax(distribution.sampling_logits(draft_logits[k].astype(jnp.float32), temperature, top_k,
                                                      top_p), -1)
      accept = jnp.sum(jnp.minimum(p, q), axis=-1)
    rates.append(ops.masked_sum(accept, valid) / jnp.maximum(jnp.sum(valid, dtype=jnp.float32), 1.0))
  return jnp.stack(rates)


@functools.partial(jax.jit, static_argnames=("kind", "drafter_def", "target_def", "num_steps", "temperature",
                                             "top_k", "top_p"))
def _probe(kind, drafter_def, drafter_params, target_def, target_params, tokens, mask, *, num_steps, temperature,
           top_k, top_p):
  draft_logits, target_logits = _draft_logits(kind, nnx.merge(drafter_def, drafter_params),
                                              nnx.merge(target_def, target_params), tokens, mask, num_steps)
  return window_acceptance(draft_logits, target_logits, mask, temperature, top_k, top_p)


def pack_sequences(ids: np.ndarray, attention_mask: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Rollout sequences (left-padded prompt, right-padded completion) -> right-padded ``(tokens, mask)``
  ``[N, T]``, each row's real tokens first in their order (what the distillation losses read)."""
  mask = np.asarray(attention_mask).astype(bool)
  order = np.argsort(~mask, axis=1, kind="stable")
  packed = np.take_along_axis(mask, order, axis=1)
  tokens = np.where(packed, np.take_along_axis(np.asarray(ids), order, axis=1), pad_id)
  return tokens.astype(np.int32), packed.astype(np.int32)


@jax.jit
def _changed(old, new):
  """``(any parameter differs, ||new - old|| / ||old||)``."""
  diff = jax.tree.map(lambda a, b: jnp.any(a != b), old, new)
  delta = _global_norm(jax.tree.map(lambda a, b: (b - a).astype(jnp.float32), old, new))
  return jnp.any(jnp.stack(jax.tree.leaves(diff))), delta / jnp.maximum(_global_norm(old), 1e-30)


def _global_norm(tree) -> jax.Array:
  """Global L2 norm of a pytree (float32)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


# -- the rollout sampler and the refit -------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def drafter_optimizer(learning_rate: float):
  """AdamW at a constant ``learning_rate``, clipped at global norm 1 (one object per rate: it is a static
  argument of the jitted update, so a rebuilt trainer reuses the compiled refresh)."""
  return state_lib.make_optimizer(learning_rate, 1, schedule="constant")


class SpeculativeRollouts:
  """The shared rollout's sampler under ``rl.speculative`` and the drafter it keeps in step with the policy.

  Called as ``sampler(model, prompt_ids, max_new_tokens, rng, tokenizer, sampling)`` by the shared rollout
  (returns a :class:`~lemon_rl.sampling.SampleOutput`); :meth:`refit` after each policy update. The drafter
  is built at the first call (it needs the policy's config).

  Args:
    cfg: the ``rl.speculative`` section.
    policy_graphdef: the policy's graph (``nnx.split(model, nnx.Param)[0]``); its parameters come with each
      call.
    pad_id: padding id of the rollout sequences.
    resample_from_residual: ``False`` makes the engine lossy (tests of the lossless test's power only).
  """

  def __init__(self, cfg, policy_graphdef, pad_id: int, resample_from_residual: bool = True):
    self.cfg = cfg
    self.kind = cfg.drafter
    self.num_draft = int(cfg.num_draft)
    self.policy_graphdef = policy_graphdef
    self.pad_id = int(pad_id)
    self.resample_from_residual = resample_from_residual
    self.optimizer = drafter_optimizer(float(cfg.learning_rate))
    self.num_steps = int(cfg.ttt_steps or cfg.num_draft)
    self.loss = (drafter_training.DrafterLoss(num_steps=self.num_steps) if self.kind == "eagle"
                 else TokenDistillLoss())
    self.drafter_def = None
    self.state = None  # The drafter's TrainState.
    self.costs: StepCosts | None = None
    self.acceptance: np.ndarray | None = None  # [K] running per-position acceptance.
    self.probe: tuple[np.ndarray, np.ndarray] | None = None
    self.sampling = None
    self._shape: tuple[int, int] | None = None
    self._calls: list[dict[str, Any]] = []
    self.refits = 0
    self.refit_s: float | None = None  # Seconds of the last refit (refresh, probe) that compiled nothing.
    self._eligible = 0  # Steps that needed a refit so far: every refresh_every-th one refreshes.
    self._ppow_updates = 0
    self._ppow_cfg = None
    if cfg.refresh == "ppow":
      p = cfg.ppow
      self._ppow_cfg = ppow_training.PPOWConfig(
          num_draft=self.num_draft, group_size=int(p.group_size), num_prefixes=int(p.num_prefixes),
          pool_rows=int(p.pool_rows), verification=str(p.verification), gamma=float(p.gamma),
          use_dist_reward=bool(p.use_dist_reward), beta=float(p.beta), adaw=bool(p.adaw))
    self._decode_steps = 0  # max_new_tokens of the last call.

  # -- the drafter ---------------------------------------------------------------------------------------

  def _build(self, policy: Transformer) -> None:
    cfg, seed = self.cfg, int(self.cfg.seed)
    if self.kind == "eagle":
      drafter = EagleHead(policy.cfg, tuple(cfg.feature_layers) or None, rngs=nnx.Rngs(seed))
    else:
      overrides = {"vocab_size": policy.cfg.vocab_size}
      if cfg.drafter_num_layers:
        overrides["num_layers"] = int(cfg.drafter_num_layers)
      drafter = Transformer(get_preset(cfg.drafter_preset, **overrides), rngs=nnx.Rngs(seed))
    self.drafter_def, self.state = state_lib.create_train_state(drafter, self.optimizer, seed)

  def set_drafter(self, drafter: nnx.Module) -> None:
    """Starts from ``drafter`` (e.g. a trained :class:`EagleHead` from
    :func:`~lemon_rl.training.drafter_training.load_speculative`, or a draft ``Transformer``; of this
    section's ``drafter`` kind) with a fresh optimizer state, instead of a random initialisation."""
    expected = EagleHead if self.kind == "eagle" else Transformer
    if not isinstance(drafter, expected):
      raise TypeError(f"rl.speculative.drafter={self.kind!r} needs a {expected.__name__}, "
                      f"got {type(drafter).__name__}")
    self.drafter_def, self.state = state_lib.create_train_state(drafter, self.optimizer, int(self.cfg.seed))

  def engine_drafter(self, policy: Transformer) -> nnx.Module:
    """The engine's drafter for ``policy`` with the current drafter parameters."""
    return _drafter_module(self.kind, policy, nnx.merge(self.drafter_def, self.state.params))

  # -- sampling ------------------------------------------------------------------------------------------

  def predicted_tau(self) -> float | None:
    return None if self.acceptance is None else expected_tau(self.acceptance)

  def decide(self) -> tuple[bool, float | None]:
    """``(speculate, predicted speedup)`` for the next call."""
    if not self.cfg.cost_model:
      return True, None
    tau = self.predicted_tau()
    if tau is None or self.costs is None:
      return False, None
    refit_s = None if self.refit_s is None else self.refit_s / int(self.cfg.refresh_every)  # Per step.
    speculate = should_speculate(tau, self.costs, float(self.cfg.min_speedup), self._decode_steps, refit_s)
    return speculate, predicted_speedup(tau, self.costs)

  def __call__(self, model: Transformer, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
               rng: jax.Array, tokenizer, sampling) -> SampleOutput:
    if self.state is None:
      self._build(model)
    self.sampling = sampling
    # The cost model's batch: rows, and the mean cached context of a decode step.
    self._shape = (len(prompt_ids), prompt_bucket(max(len(p) for p in prompt_ids)) + max_new_tokens // 2)
    self._decode_steps = int(max_new_tokens)
    on, speedup = self.decide()
    record: dict[str, Any] = {"on": on, "predicted_speedup": speedup}
    if not on:
      out = sampling.sample(model, prompt_ids, max_new_tokens, rng, tokenizer)
      self._calls.append(record)
      return out
    compiled = _compile_count()
    start = time.perf_counter()
    out = speculative.speculative_generate(
        model, self.engine_drafter(model), prompt_ids, max_new_tokens, rng, num_draft=self.num_draft,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, eos_ids=tokenizer.eos_ids,
        pad_id=tokenizer.pad_id, resample_from_residual=self.resample_from_residual, coupled=sampling.coupled)
    record.update(seconds=time.perf_counter() - start, stats=out.stats,
                  compiled=compiled is None or _compile_count() != compiled)
    self._calls.append(record)
    return out.sample_output()

  def sampling_metrics(self) -> tuple[dict[str, float], np.ndarray | None]:
    """The sampling metrics of the calls since the last refit and their measured per-position acceptance
    (``None`` if none speculated)."""
    calls = self._calls
    metrics = {"rollout/speculative_on": float(any(c["on"] for c in calls))}
    speedups = [c["predicted_speedup"] for c in calls if c["predicted_speedup"] is not None]
    if speedups:
      metrics["rollout/predicted_speedup"] = float(np.mean(speedups))
      metrics["rollout/predicted_tau"] = float(self.predicted_tau())
    if self.costs is not None:
      metrics.update({"cost/target_s": self.costs.target_s, "cost/draft_s": self.costs.draft_s,
                      "cost/verify_s": self.costs.verify_s, "cost/gamma": self.costs.gamma})
    if self.refit_s is not None:
      metrics["cost/refit_s"] = self.refit_s
    spec = [c for c in calls if c["on"]]
    if not spec:
      return metrics, None
    forwards = sum(int(c["stats"].target_forwards.sum()) for c in spec)
    accepted = sum(int(c["stats"].accepted.sum()) for c in spec)
    per_position = sum(c["stats"].accepted_per_position.sum(axis=0) for c in spec) / max(forwards, 1)
    iterations = sum(int(c["stats"].target_forwards.max()) for c in spec)
    seconds = sum(c["seconds"] for c in spec)
    tau = (accepted + forwards) / max(forwards, 1)
    metrics.update({"rollout/tau": tau, "rollout/acceptance": accepted / max(self.num_draft * forwards, 1),
                    "rollout/iteration_s": seconds / max(iterations, 1)})
    metrics.update({f"rollout/accept_pos_{k}": float(a) for k, a in enumerate(per_position)})
    if self.costs is not None and not any(c["compiled"] for c in spec):
      metrics["rollout/measured_speedup"] = tau * self.costs.target_s / (seconds / max(iterations, 1))
    return metrics, per_position

  # -- the refit -----------------------------------------------------------------------------------------

  def distill(self, state, policy_params, batch: Mapping[str, np.ndarray]):
    """``distill_steps_per_rl_step`` drafter updates on ``batch`` (``tokens``, ``mask``) with soft labels from
    the policy ``policy_params``; returns ``(new drafter state, metrics of the last update)``."""
    rows = batch["tokens"].shape[0]
    micro = int(self.cfg.distill_microbatch_size) or rows
    if rows % micro:
      raise ValueError(f"rl.speculative.distill_microbatch_size={micro} does not divide the rollout's {rows} rows")
    values = {}
    for _ in range(int(self.cfg.distill_steps_per_rl_step)):
      state, values = drafter_training.update_step(
          self.drafter_def, state, self.policy_graphdef, policy_params, batch, loss=self.loss,
          optimizer=self.optimizer, num_microbatches=rows // micro)
    return state, values

  def ppow_refresh(self, state, policy_params, tokens: np.ndarray, mask: np.ndarray):
    """``ppow.steps_per_refresh`` PPOW updates of the :class:`EagleHead` (``ppow_training.collect`` then
    ``update``) on ``pool_rows`` of the packed rollout ``tokens, mask [N, T]`` per update, the policy
    ``policy_params`` as the frozen target; returns ``(new drafter state, metrics of the last update)``.
    Pools and keys depend on the refresh count and ``seed`` only."""
    cfg = self._ppow_cfg
    usable = np.flatnonzero(mask.sum(axis=1) >= cfg.min_prefix + cfg.num_draft + 1)
    if not len(usable):
      raise ValueError(f"no rollout sequence holds a PPOW window of {cfg.num_draft} tokens after a prefix")
    values, metrics = {}, {}
    for _ in range(int(self.cfg.ppow.steps_per_refresh)):
      n, seed = self._ppow_updates, int(self.cfg.seed)
      self._ppow_updates += 1
      rows = usable[ppow_training.pool_indices(len(usable), cfg.pool_rows, n, seed)]
      key = jax.random.fold_in(jax.random.key(seed), n)
      batch, metrics = ppow_training.collect(self.drafter_def, state.params, self.policy_graphdef, policy_params,
                                             jnp.asarray(tokens[rows]), jnp.asarray(mask[rows]), key, cfg=cfg)
      state, values = ppow_training.update(self.drafter_def, state, self.policy_graphdef, policy_params, batch,
                                           cfg=cfg, optimizer=self.optimizer)
    return state, {**ops.metric_values(metrics), **values}

  def probe_acceptance(self, policy_params) -> np.ndarray:
    """``[K]`` per-position acceptance ``a_k = prod_{j<=k} alpha_j`` of the drafter on the probe batch."""
    s = self.sampling
    temperature = 0 if s.temperature == 0 else float(s.temperature)
    alpha = _probe(self.kind, self.drafter_def, self.state.params, self.policy_graphdef, policy_params,
                   jnp.asarray(self.probe[0]), jnp.asarray(self.probe[1]), num_steps=self.num_draft,
                   temperature=temperature, top_k=int(s.top_k), top_p=float(s.top_p))
    return np.cumprod(np.asarray(alpha, np.float64))

  def refit(self, policy_params, rollout) -> dict[str, float]:
    """After the policy update: distill the drafter on ``rollout``'s sequences, run the guard, update the
    running acceptance (none of it when the cost model made this step plain and the refit's cost is known:
    module docstring); returns the step's ``rollout/*``, ``cost/*`` and ``drafter/*`` metrics.

    Raises:
      DrafterRefitError: the drafter's parameters did not change, or its probe acceptance is not above
        ``min_probe_acceptance``.
      RuntimeError: this step's rollout did not sample through the shared rollout (a trainer with its own
        sampler cannot use ``rl.speculative``).
    """
    if not self._calls:
      raise RuntimeError("rl.speculative.enabled=True, but this trainer's rollout did not sample through the "
                         "shared rollout (lemon_rl.training.rollout); speculative rollouts need it")
    start = time.perf_counter()
    speculated = any(c["on"] for c in self._calls)
    metrics, measured = self.sampling_metrics()
    self._calls = []
    if "ids" not in rollout.batch or "attention_mask" not in rollout.batch:
      raise RuntimeError("speculative rollouts distil the drafter on rollout.batch['ids'] / ['attention_mask'], "
                         "which this trainer's rollout lacks")
    tokens, mask = pack_sequences(rollout.batch["ids"], rollout.batch["attention_mask"], self.pad_id)
    if self.probe is None:
      self.probe = (tokens[:int(self.cfg.probe_size)], mask[:int(self.cfg.probe_size)])
    if self.cfg.cost_model and not speculated and self.refit_s is not None:
      return {**metrics, "drafter/refitted": 0.0}  # A plain step: nothing drafted, nothing to pay for.
    self._eligible += 1
    if (self._eligible - 1) % int(self.cfg.refresh_every):  # Between refreshes: only the running acceptance.
      if measured is not None:
        self._update_acceptance(measured)
      return {**metrics, "drafter/refitted": 0.0}
    jitted = (_probe, *((ppow_training.collect, ppow_training.update) if self._ppow_cfg
                        else (drafter_training.update_step,)))
    compiled, refit_start = _compile_count(*jitted), time.perf_counter()
    metrics.update(self._refresh_and_check(policy_params, tokens, mask))
    probe = self.probe_acceptance(policy_params)
    if compiled is not None and _compile_count(*jitted) == compiled:
      self.refit_s = time.perf_counter() - refit_start  # Refresh and probe, nothing compiled.
    acceptance = float(probe.mean())
    if not acceptance > self.cfg.min_probe_acceptance:
      raise DrafterRefitError(
          f"drafter refit {self.refits}: probe acceptance {acceptance:.4f} (accepted / drafted tokens on the "
          f"fixed probe batch, per position {np.round(probe, 4).tolist()}) is not above "
          f"rl.speculative.min_probe_acceptance={self.cfg.min_probe_acceptance}")
    self._update_acceptance(measured if measured is not None else probe)
    if self.cfg.cost_model and self.costs is None:  # Once, after the first step (outside any rollout's time).
      measure_start = time.perf_counter()
      policy = nnx.merge(self.policy_graphdef, policy_params)
      s = self.sampling
      self.costs = measure_step_costs(policy, self.engine_drafter(policy), *self._shape, self.num_draft,
                                      s.temperature, s.top_k, s.top_p)
      metrics["cost/measure_s"] = time.perf_counter() - measure_start
    metrics.update({"drafter/refitted": 1.0, "drafter/probe_acceptance": acceptance,
                    "drafter/probe_tau": expected_tau(probe), "drafter/refit_s": time.perf_counter() - start})
    metrics.update({f"drafter/probe_accept_pos_{k}": float(a) for k, a in enumerate(probe)})
    return metrics

  def _update_acceptance(self, observed: np.ndarray) -> None:
    decay = float(self.cfg.acceptance_decay)
    self.acceptance = observed if self.acceptance is None else decay * self.acceptance + (1 - decay) * observed

  def _refresh_and_check(self, policy_params, tokens: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """:meth:`distill` or :meth:`ppow_refresh` on the packed rollout and the guard's parameter-change check."""
    old = jax.tree.map(jnp.copy, self.state.params)  # Both updates donate their state.
    if self._ppow_cfg is None:
      self.state, values = self.distill(self.state, policy_params, {"tokens": jnp.asarray(tokens),
                                                                    "mask": jnp.asarray(mask)})
      what, metrics = f"{self.cfg.distill_steps_per_rl_step} distillation step(s)", {}
    else:
      self.state, values = self.ppow_refresh(self.state, policy_params, tokens, mask)
      what = f"{self.cfg.ppow.steps_per_refresh} PPOW step(s)"
      metrics = {f"drafter/ppow/{k}": float(v) for k, v in jax.device_get(values).items() if np.ndim(v) == 0}
    changed, relative = jax.device_get(_changed(old, self.state.params))
    self.refits += 1
    if not changed:
      raise DrafterRefitError(
          f"drafter refit {self.refits}: no drafter parameter changed after {what}; the update was dropped "
          "(NeMo-RL #2646: a drafter whose weights never reach the rollout sampler); refusing to continue")
    values = jax.device_get(values)
    return {**metrics, f"drafter/{self.cfg.refresh}_loss": float(values["loss"]),
            "drafter/param_change": float(relative)}


def _compile_count(*functions) -> int | None:
  """Compiled variants of jitted ``functions`` (default: the engine's jitted parts); ``None`` where jax
  does not expose it."""
  # pylint: disable=protected-access
  functions = functions or (speculative._prefill, speculative._start, speculative._loop, speculative._Carry.take)
  try:
    return sum(f._cache_size() for f in functions)
  except AttributeError:
    return None


def for_trainer(trainer) -> SpeculativeRollouts | None:
  """The trainer's :class:`SpeculativeRollouts` (built on first use, kept on the trainer as
  ``speculative_rollouts``), or ``None`` when its ``rl`` section has no enabled ``speculative`` section."""
  cfg = getattr(trainer, "cfg", None)
  spec = cfg.get("speculative") if cfg is not None and hasattr(cfg, "get") else None
  if not spec or not spec.enabled:
    return None
  existing = getattr(trainer, "speculative_rollouts", None)
  if existing is None:
    if distributed.process_count() > 1:
      raise NotImplementedError("rl.speculative with several processes: speculative_generate samples one "
                                "process's rows only")
    existing = SpeculativeRollouts(spec, trainer.graphdef, trainer.tokenizer.pad_id)
    trainer.speculative_rollouts = existing
  return existing
