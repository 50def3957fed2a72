"""Lossless batched speculative decoding: a drafter proposes ``K`` tokens, the target verifies them at once.

``speculative_generate(target, drafter, prompts, max_new_tokens, rng, num_draft=K, ...)`` returns what
:func:`lemon_rl.sampling.sampler.generate` returns (tokens, log-probs under the target's sampling
distribution, mask, lengths, finish reasons) plus per-row acceptance statistics, and samples from exactly the
same distribution: token for token the same output for greedy decoding, the same distribution at any
temperature / top-k / top-p.

One iteration, for every row at once (each row keeps its own length and position in both KV caches):

1. The drafter proposes ``d_1..d_K`` after the row's last emitted token ``x`` (a chain, each ``d_j`` drawn
   from the drafter's sampling distribution ``q_j``, or its argmax for greedy decoding).
2. The target runs ``[x, d_1..d_K]`` in ONE ``Transformer.extend`` of ``K + 1`` tokens over its cache, which
   gives ``p_0..p_K``, ``p_j`` the target's distribution of the token after ``d_j`` (``d_0 = x``).
3. Verification. Greedy: ``d_j`` is accepted while it equals ``argmax p_{j-1}``; the first mismatch is
   replaced by the target's argmax, and when all ``K`` match the target's argmax after ``d_K`` is a bonus
   token, so the output is the target's own greedy decoding. Sampling (Leviathan et al. 2023, Chen et al.
   2023): ``d_j`` is accepted with probability ``min(1, p_{j-1}(d_j) / q_j(d_j))`` (one uniform per
   position, tested in log space); at the first rejection ``j`` the token is drawn from the normalised
   residual ``max(0, p_{j-1} - q_j)``; when all ``K`` are accepted a bonus token is drawn from ``p_K``.
   Every emitted token is then distributed exactly as under the target alone.
4. The accepted drafts plus the corrected/bonus token (``n + 1`` tokens for ``n`` accepted) are appended to
   the row's output, cut at the row's first EOS and at ``max_new_tokens``; both caches are rolled back to
   the kept prefix (``KVCache.truncate``), so the next iteration continues from the emitted sequence.

``p`` and ``q`` are both :func:`lemon_rl.sampling.distribution.sampling_logits` of their model's logits
with the same ``(temperature, top_k, top_p)``, the one definition of the sampling distribution, so top-k /
top-p are applied to both consistently (losslessness holds for any ``q``; filtering ``q`` like ``p`` only
keeps the acceptance rate up). The first completion token is drawn from the target's prefill logits as in
``generate`` (no draft for it).

Invariant between iterations (row ``b`` with ``g`` emitted tokens ``y_1..y_g``): the target cache holds the
prompt and ``y_1..y_{g-1}``; ``y_g`` is pending (the ``x`` of the next iteration). The decode is a
``jax.lax.while_loop`` inside one jitted call after a jitted prefill of both models, compiled once per
(model graphs, batch, prompt bucket, max new tokens, ``K``, sampling mode, number of EOS ids); the
temperature, top-k and top-p values are traced.

Coupled sampling (``coupled=True``, :func:`verify_coupled`): every completion position of every row has its
own Gumbel noise (:func:`lemon_rl.sampling.distribution.coupled_noise`), which the drafter uses for its draft
at that position and the target for its token there; a draft is accepted iff it equals the target's token.
The output is then the plain sampler's ``generate(..., coupled=True)`` for the same key, token for token,
whatever the drafter (a speculative rollout and a plain one can be compared sample by sample), at a lower
acceptance than the residual method's.

Rows advance at different rates (each accepts as many drafts as it does), so a batch would run at full cost
until its slowest row is done. Whenever at most half of the rows are still active the loop returns, and it
continues on a batch of half the size holding them (one gather of every state; finished rows fill the rest),
down to one row: ``log2 B`` more compiled loops, each row computing the same thing at any batch size.

The drafter is anything implementing :class:`Drafter` (three methods on a pytree state, called inside the
jitted loop). :class:`ModelDrafter` implements it for a plain ``Transformer`` sharing the target's
vocabulary (a small draft model); passing a ``Transformer`` as ``drafter`` wraps it. A feature-level drafter
(EAGLE-3 style, :class:`lemon_rl.models.drafter.EagleDrafter`) also names the target blocks it reads in a
``feature_layers`` attribute; the engine then asks the target's prefill / verification pass for those
blocks' outputs and hands them to the drafter (``target_features``, see :class:`Drafter`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lemon_rl.models.transformer import KVCache, Transformer
from lemon_rl.sampling import distribution
from lemon_rl.sampling.sampler import SampleOutput, eos_array, prompt_bucket, right_pad


def _is_greedy(temperature) -> bool:
  """Whether ``temperature`` is the static greedy marker (a Python ``0``), as the engine passes it."""
  return isinstance(temperature, (int, float)) and temperature == 0


def draft_noise(key: jax.Array, batch: int, num_draft: int, vocab_size: int, temperature) -> jax.Array | None:
  """Independent Gumbel noise ``[B, K, V]`` for one proposal (``None`` for greedy decoding).

  Draft position ``j`` gets ``Gumbel(split(key, K)[j], (B, V))``, so :func:`draw` with it is the
  categorical draw ``jax.random.categorical(split(key, K)[j], q)``.
  """
  if _is_greedy(temperature):
    return None
  keys = jax.random.split(key, num_draft)
  return jnp.stack([jax.random.gumbel(k, (batch, vocab_size)) for k in keys], axis=1)


def draw(logits: jax.Array, noise: jax.Array | None, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array | None]:
  """One draft token per row of ``logits [..., V]`` and the distribution it was drawn from.

  Returns ``(tokens [...] int32, q)``: for greedy decoding (static ``temperature == 0``; ``noise`` is then
  ``None``) the argmax and ``q = None``; otherwise the Gumbel-max draw ``argmax(q + noise)`` from ``q =
  sampling_logits(logits, temperature, top_k, top_p)`` (float32 ``[..., V]``, ``-inf`` outside the kept
  set), exactly as the sampler draws; ``noise [..., V]`` is this position's Gumbel noise.
  """
  if _is_greedy(temperature):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
  q = distribution.sampling_logits(logits, temperature, top_k, top_p)
  return jnp.argmax(noise + q, axis=-1).astype(jnp.int32), q


def noise_steps(noise: jax.Array | None) -> jax.Array | None:
  """``noise [B, K, V]`` of draft positions ``1..K-1`` as ``[K - 1, B, V]`` scan inputs (``None`` stays)."""
  return None if noise is None else jnp.moveaxis(noise[:, 1:], 1, 0)


def noise_at(noise: jax.Array | None, j: int) -> jax.Array | None:
  """``noise[:, j]`` (``None`` stays ``None``)."""
  return None if noise is None else noise[:, j]


class Drafter(Protocol):
  """What the engine needs from a drafter; every method is called inside the jitted loop.

  ``state`` is any pytree (caches, pending tokens) threaded through the loop by the engine. ``B`` rows,
  ``K = num_draft``, ``V`` the target's vocabulary.

  Feature-level drafters: a drafter whose (optional) ``feature_layers`` attribute is a non-empty tuple of
  target block indices gets the target's outputs of those blocks (``Transformer.prefill`` / ``extend``
  with ``feature_layers``, ``F = len(feature_layers) * E`` wide): :meth:`prefill` is called with the extra
  keywords ``target_features [B, P, F]`` (every prompt position) and ``num_draft = K``, :meth:`rollback`
  with ``target_features [B, K + 1, F]`` (the verified positions). Drafters without the attribute (or
  with ``()``) are called exactly as documented below.
  """

  vocab_size: int

  def prefill(self, input_ids: jax.Array, attention_mask: jax.Array, num_slots: int) -> Any:
    """Reads the right-padded prompts ``[B, P]`` (as ``Transformer.prefill``); returns the initial state.

    ``num_slots`` bounds the row length (prompt + completion + ``K``) the state must hold. Feature-level
    drafters also receive ``target_features`` and ``num_draft`` (see the class docstring).
    """

  def propose(self, state: Any, last: jax.Array, noise: jax.Array | None, num_draft: int, temperature, top_k,
              top_p) -> tuple[jax.Array, jax.Array | None, Any]:
    """Drafts ``K`` tokens after ``last [B]`` (each row's last emitted token, not yet given to ``state``).

    ``noise [B, K, V]`` is the Gumbel noise of each draft position (``None`` for greedy decoding): draft
    ``j`` is :func:`draw` of its logits with ``noise[:, j]``, so the engine decides the random numbers (the
    coupled engine hands the drafter the noise the target's tokens at those positions will use).
    Returns ``(drafts [B, K] int32, q [B, K, V] | None, state)`` with ``q[:, j]`` the sampling logits
    ``drafts[:, j]`` was drawn from; ``None`` for greedy decoding (``temperature`` is
    then the Python number 0 and the drafts are argmaxes). Inactive (finished) rows may be drafted for
    too; the engine ignores them and passes ``num_kept = 0`` for them to :meth:`rollback`.
    """

  def rollback(self, state: Any, num_kept: jax.Array, target_hidden: jax.Array) -> Any:
    """Keeps what the target accepted.

    Args:
      state: the state returned by :meth:`propose`.
      num_kept: ``[B]`` in ``[0, K + 1]``: the row emitted ``num_kept`` tokens this iteration. They are
        ``d_1..d_{num_kept - 1}`` then one more token (the correction, the bonus, or, when EOS or the
        length limit cut the window, ``d_{num_kept}``), which is the ``last`` of the next
        :meth:`propose`. ``0``: the row was inactive; restore its state from before :meth:`propose`.
      target_hidden: ``[B, K + 1, E]`` the target's final-norm hidden states of ``[last, d_1..d_K]``
        (for feature-level drafters; position ``j`` is valid for ``j < num_kept``).

    Feature-level drafters also receive ``target_features [B, K + 1, F]``, the target's outputs of their
    ``feature_layers`` at the same positions (see the class docstring).
    """


class ModelDraftState(NamedTuple):
  """State of a :class:`ModelDrafter`.

  The cache holds the prompt and every emitted token except the pending ``last`` and, when ``has_carry``,
  except ``carry`` too: when all ``K`` drafts are accepted the drafter never ran ``d_K`` through itself,
  so the next :meth:`ModelDrafter.propose` appends ``[carry, last]`` in one 2-token extend.

  Attributes:
    cache: the draft model's KV cache.
    carry: ``[B]`` int32, ``d_K`` of the last proposal (pending when ``has_carry``).
    has_carry: ``[B]`` bool.
    base_lengths: ``[B]`` int32 cache lengths before the last proposal (for rollback of inactive rows).
  """

  cache: KVCache
  carry: jax.Array
  has_carry: jax.Array
  base_lengths: jax.Array


class ModelDrafter(nnx.Module):
  """:class:`Drafter` for a plain ``Transformer`` draft model sharing the target's vocabulary.

  A proposal is one extend of ``[carry, last]`` (or ``[last]``, ``num_new`` per row) then ``K - 1``
  one-token extends (a ``jax.lax.scan``), each followed by a draw from the draft's sampling distribution.
  The cache then holds ``last, d_1..d_{K-1}``; rollback truncates it to the kept prefix.
  """

  def __init__(self, model: Transformer):
    self.model = model

  @property
  def vocab_size(self) -> int:
    return self.model.cfg.vocab_size

  def prefill(self, input_ids, attention_mask, num_slots) -> ModelDraftState:
    _, cache = self.model.prefill(input_ids, attention_mask, num_slots)
    b = input_ids.shape[0]
    return ModelDraftState(cache, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), cache.lengths)

  def propose(self, state: ModelDraftState, last, noise, num_draft, temperature, top_k, top_p):
    model = self.model
    base = state.cache.lengths
    first = jnp.stack([jnp.where(state.has_carry, state.carry, last), last], axis=1)
    hidden, cache = model.extend(first, state.cache, num_new=1 + state.has_carry.astype(jnp.int32))
    h = jnp.where(state.has_carry[:, None], hidden[:, 1], hidden[:, 0])
    token, q = draw(model.logits_from_hidden(h), noise_at(noise, 0), temperature, top_k, top_p)

    def step(carry, noise):
      cache, token = carry
      hidden, cache = model.extend(token[:, None], cache)
      token, q = draw(model.logits_from_hidden(hidden[:, 0]), noise, temperature, top_k, top_p)
      return (cache, token), (token, q)

    (cache, _), (tokens, qs) = jax.lax.scan(step, (cache, token), noise_steps(noise), length=num_draft - 1)
    drafts = jnp.concatenate([token[:, None], tokens.T], axis=1)
    if q is not None:
      q = jnp.concatenate([q[:, None], qs.transpose(1, 0, 2)], axis=1)
    return drafts, q, ModelDraftState(cache, drafts[:, -1], state.has_carry, base)

  def rollback(self, state: ModelDraftState, num_kept, target_hidden) -> ModelDraftState:
    num_draft = target_hidden.shape[1] - 1
    active = num_kept > 0
    # Kept in the cache: the old carry, last, and d_1..d_{num_kept - 1} (at most d_{K-1} was run).
    kept = state.base_lengths + state.has_carry.astype(jnp.int32) + jnp.minimum(num_kept, num_draft)
    cache = state.cache.truncate(jnp.where(active, kept, state.base_lengths))
    has_carry = jnp.where(active, num_kept == num_draft + 1, state.has_carry)
    return state._replace(cache=cache, has_carry=has_carry)


class SpeculativeStats(NamedTuple):
  """Per-row acceptance statistics (numpy).

  Counted from the verification outcomes, before EOS / length cuts (a row's last window may emit fewer
  tokens than it accepted). The first token, drawn from the prefill as in ``generate``, is in no count.

  Attributes:
    target_forwards: ``[B]`` verification passes (one ``extend`` of ``K + 1`` tokens each) while the row
      was active.
    drafted: ``[B]`` drafted tokens verified, ``K * target_forwards``.
    accepted: ``[B]`` accepted drafted tokens.
    accepted_per_position: ``[B, K]`` how often draft position ``j`` (0-based) was accepted.
    tau: ``[B]`` acceptance length, tokens per target forward including the correction / bonus token,
      ``(accepted + target_forwards) / target_forwards`` (NaN for a row with no forward); ``K + 1`` when
      every draft is accepted.
  """

  target_forwards: np.ndarray
  drafted: np.ndarray
  accepted: np.ndarray
  accepted_per_position: np.ndarray
  tau: np.ndarray

  @property
  def mean_tau(self) -> float:
    """Batch acceptance length: all emitted-by-verification tokens over all target forwards."""
    forwards = int(self.target_forwards.sum())
    return float((self.accepted.sum() + forwards) / forwards) if forwards else float("nan")

  @property
  def acceptance_rate_per_position(self) -> np.ndarray:
    """``[K]`` fraction of verification passes that accepted draft position ``j``."""
    forwards = max(int(self.target_forwards.sum()), 1)
    return self.accepted_per_position.sum(axis=0) / forwards


class SpeculativeOutput(NamedTuple):
  """:class:`~lemon_rl.sampling.sampler.SampleOutput`'s fields (same meaning) plus ``stats``."""

  tokens: np.ndarray
  log_probs: np.ndarray
  mask: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[str]
  stats: SpeculativeStats

  def sample_output(self) -> SampleOutput:
    return SampleOutput(self.tokens, self.log_probs, self.mask, self.lengths, self.finish_reasons)


def _feature_layers(drafter) -> tuple[int, ...]:
  """The target blocks a feature-level drafter reads (``()`` for any other drafter)."""
  return tuple(getattr(drafter, "feature_layers", ()) or ())


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "num_slots", "num_draft"))
def _prefill(target_def, target_vars, drafter_def, drafter_vars, ids, mask, num_slots, num_draft=None):
  target, drafter = nnx.merge(target_def, target_vars), nnx.merge(drafter_def, drafter_vars)
  layers = _feature_layers(drafter)
  if not layers:
    hidden, cache = target.prefill(ids, mask, num_slots)
    return target.logits_from_hidden(hidden), cache, drafter.prefill(ids, mask, num_slots)
  hidden, cache, features = target.prefill(ids, mask, num_slots, feature_layers=layers)
  draft_state = drafter.prefill(ids, mask, num_slots, target_features=features, num_draft=num_draft)
  return target.logits_from_hidden(hidden), cache, draft_state


def verify(logits: jax.Array, drafts: jax.Array, q: jax.Array | None, key: jax.Array, temperature, top_k,
           top_p, resample_from_residual: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Verifies ``K`` drafts per row against the target's logits of ``[last, d_1..d_K]``.

  Args:
    logits: ``[B, K + 1, V]`` target logits; position ``j`` predicts the token after ``d_j`` (``d_0`` =
      last).
    drafts: ``[B, K]`` drafted tokens ``d_1..d_K``.
    q: ``[B, K, V]`` the draft sampling logits they were drawn from (``None`` for greedy decoding).
    key: PRNG key (unused for greedy decoding).
    temperature, top_k, top_p: the sampling distribution (``temperature`` the Python number 0 = greedy).
    resample_from_residual: ``False`` draws the token after a rejection from ``p`` instead of the
      residual: *lossy* (SPEC-RL's shortcut), for tests and ablations only. A Python or traced bool.

  Returns:
    ``(num_accepted [B], emitted [B, K + 1], log_probs [B, K + 1])``: ``emitted[:, :n]`` are the accepted
    drafts, ``emitted[:, n]`` the correction (or bonus) token, later positions are meaningless;
    ``log_probs`` the target's sampling log-probs of ``emitted``.
  """
  num_draft = drafts.shape[1]
  if _is_greedy(temperature):
    emitted = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # the target's own greedy tokens
    accept = drafts == emitted[:, :num_draft]
    num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1, dtype=jnp.int32)
    return num_accepted, emitted, distribution.sampling_log_probs(logits, emitted, 0.0)
  accept_key, resample_key = jax.random.split(key)
  logp = jax.nn.log_softmax(distribution.sampling_logits(logits, temperature, top_k, top_p), axis=-1)
  logq = jax.nn.log_softmax(q, axis=-1)
  logp_draft = jnp.take_along_axis(logp[:, :num_draft], drafts[..., None], axis=-1)[..., 0]
  logq_draft = jnp.take_along_axis(logq, drafts[..., None], axis=-1)[..., 0]  # finite: drawn from q
  u = jax.random.uniform(accept_key, drafts.shape)
  accept = jnp.log(u) < logp_draft - logq_draft  # probability min(1, p / q); never where p = 0
  num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1, dtype=jnp.int32)
  # The token at position n: from max(0, p_n - q_n) normalised at a rejection (n < K), from p_K (bonus).
  index = num_accepted[:, None, None]
  p_n = jnp.exp(jnp.take_along_axis(logp, index, axis=1)[:, 0])
  q_n = jnp.exp(jnp.take_along_axis(logq, jnp.minimum(index, num_draft - 1), axis=1)[:, 0])
  q_n = jnp.where((num_accepted < num_draft)[:, None], q_n, 0.0)
  residual = jnp.where(resample_from_residual, jnp.maximum(p_n - q_n, 0.0), p_n)
  # An all-zero residual means p_n == q_n up to rounding, where a rejection has probability ~0; use p_n.
  residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
  token = jax.random.categorical(resample_key, jnp.log(residual), axis=-1).astype(jnp.int32)
  positions = jnp.arange(num_draft + 1)
  padded = jnp.concatenate([drafts, token[:, None]], axis=1)
  emitted = jnp.where(positions < num_accepted[:, None], padded, token[:, None])
  log_probs = jnp.take_along_axis(logp, emitted[..., None], axis=-1)[..., 0]
  return num_accepted, emitted, log_probs


def verify_coupled(logits: jax.Array, drafts: jax.Array, noise: jax.Array, temperature, top_k,
                   top_p) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gumbel-coupled verification (drafter-invariant speculative decoding: Daliri, Musco and Suresh,
  "Coupling without Communication and Drafter-Invariant Speculative Decoding", 2024).

  The target's token at window position ``j`` is ``t_j = argmax(sampling_logits(logits_j) + noise_j)``,
  the plain sampler's draw with the same noise; the drafter drew ``d_{j+1} = argmax(q_{j+1} + noise_j)``
  with that noise too. ``d_{j+1}`` is accepted while it equals ``t_j``; the first mismatch emits ``t_j``,
  and the bonus after ``K`` accepted drafts is ``t_K``. Every emitted token is the Gumbel-max sample of
  ``p`` with fresh noise, so the output is distributed as the target's and, for the same noise, *equal*
  to plain sampling's whatever the drafter (:func:`lemon_rl.sampling.distribution.coupled_noise`). The
  price is acceptance: ``P(d = t)`` is at least ``(1 - TV) / (1 + TV)`` against ``1 - TV`` for
  :func:`verify`'s residual resampling.

  Args:
    logits: ``[B, K + 1, V]`` target logits of ``[last, d_1..d_K]``.
    drafts: ``[B, K]``.
    noise: ``[B, K + 1, V]`` the Gumbel noise of the ``K + 1`` completion positions after ``last``.
    temperature, top_k, top_p: the sampling distribution (not greedy).

  Returns:
    As :func:`verify`.
  """
  emitted = jnp.argmax(noise + distribution.sampling_logits(logits, temperature, top_k, top_p),
                       axis=-1).astype(jnp.int32)
  num_accepted = jnp.sum(jnp.cumprod(drafts == emitted[:, :-1], axis=1), axis=1, dtype=jnp.int32)
  return num_accepted, emitted, distribution.sampling_log_probs(logits, emitted, temperature, top_k, top_p)


class _Carry(NamedTuple):
  """The loop's state; every field but ``rng`` has the batch as its leading axis (rows can be taken)."""

  last: jax.Array  # [B] each row's pending token
  cache: KVCache
  draft_state: Any
  tokens: jax.Array  # [B, N]
  log_probs: jax.Array  # [B, N]
  generated: jax.Array  # [B]
  hit_eos: jax.Array  # [B]
  stats: tuple[jax.Array, jax.Array, jax.Array]  # forwards [B], accepted [B], accepted per position [B, K]
  row_ids: jax.Array  # [B] each row's index in the prompts (the coupled noise's row)
  rng: jax.Array  # split every iteration; with coupled noise the caller's key, never split

  @jax.jit
  def take(self, rows: jax.Array) -> "_Carry":
    """The carry of rows ``rows [B']`` (one compiled gather of every batch-leading leaf)."""
    batched = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), self._replace(rng=None))
    return batched._replace(rng=self.rng)

  def active(self) -> jax.Array:
    return ~self.hit_eos & (self.generated < self.tokens.shape[1])


def _is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def _static_sampling(temperature, top_k, top_p, greedy: bool, filtering: bool):
  """The traced sampling parameters, with what is off made static: greedy decoding (``temperature`` the
  Python 0, see :func:`draw`), or no top-k / top-p (no sort in the loop)."""
  if greedy:
    return 0.0, 0, 1.0
  return (temperature, top_k, top_p) if filtering else (temperature, 0, 1.0)


@functools.partial(jax.jit, donate_argnames=("cache", "draft_state"),
                   static_argnames=("max_new_tokens", "num_draft", "greedy", "filtering", "coupled"))
def _start(logits, cache: KVCache, draft_state, rng, temperature, top_k, top_p, eos_ids, pad_id, *,
           max_new_tokens, num_draft, greedy, filtering, coupled) -> _Carry:
  """The first completion token of each row, drawn from the target's prefill ``logits [B, V]``."""
  batch, vocab = logits.shape
  row_ids = jnp.arange(batch, dtype=jnp.int32)
  sampling = _static_sampling(temperature, top_k, top_p, greedy, filtering)
  if coupled and not greedy:
    noise = distribution.coupled_noise(rng, row_ids, jnp.zeros((batch, 1), jnp.int32), vocab)[:, 0]
    first, first_logp = distribution.sample(logits, None, *sampling, noise=noise)
  else:
    rng, key = jax.random.split(rng)
    first, first_logp = distribution.sample(logits, key, *sampling)
  tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  log_probs = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(first_logp)
  zeros = jnp.zeros((batch,), jnp.int32)
  return _Carry(first, cache, draft_state, tokens, log_probs, jnp.ones((batch,), jnp.int32), _is_eos(first, eos_ids),
                (zeros, zeros, jnp.zeros((batch, num_draft), jnp.int32)), row_ids, rng)


@functools.partial(jax.jit, donate_argnames=("carry",),
                   static_argnames=("target_def", "drafter_def", "num_draft", "greedy", "filtering", "stop_at",
                                    "coupled"))
def _loop(target_def, target_vars, drafter_def, drafter_vars, carry: _Carry, temperature, top_k, top_p, eos_ids,
          resample_from_residual, *, num_draft, greedy, filtering, stop_at, coupled) -> _Carry:
  """Speculative iterations until at most ``stop_at`` rows are active (``0``: until every row is done).

  Between iterations the target cache holds prompt + all emitted tokens but the pending ``last``.
  """
  target, drafter = nnx.merge(target_def, target_vars), nnx.merge(drafter_def, drafter_vars)
  batch, n = carry.tokens.shape
  k = num_draft
  temperature, top_k, top_p = _static_sampling(temperature, top_k, top_p, greedy, filtering)
  rows = jnp.arange(batch)[:, None]
  positions = jnp.arange(k + 1)
  layers = _feature_layers(drafter)
  coupled = coupled and not greedy
  vocab = target.cfg.vocab_size

  def cond(carry):
    return jnp.sum(carry.active()) > stop_at

  def body(carry):
    last, cache, draft_state, tokens, log_probs, generated, hit_eos, stats, row_ids, rng = carry
    active = carry.active()
    if coupled:  # The noise of completion positions generated .. generated + K of each row.
      noise = distribution.coupled_noise(rng, row_ids, generated[:, None] + positions, vocab)
      drafter_noise = noise[:, :k]
    else:
      rng, draft_key, verify_key = jax.random.split(rng, 3)
      drafter_noise = draft_noise(draft_key, batch, k, vocab, temperature)
    drafts, q, draft_state = drafter.propose(draft_state, last, drafter_noise, k, temperature, top_k, top_p)
    window = jnp.concatenate([last[:, None], drafts], axis=1)
    if layers:
      hidden, extended, features = target.extend(window, cache, num_new=jnp.where(active, k + 1, 0),
                                                 feature_layers=layers)
    else:
      hidden, extended = target.extend(window, cache, num_new=jnp.where(active, k + 1, 0))
    target_logits = target.logits_from_hidden(hidden)
    if coupled:
      num_accepted, emitted, emitted_logp = verify_coupled(target_logits, drafts, noise, temperature, top_k, top_p)
    else:
      num_accepted, emitted, emitted_logp = verify(target_logits, drafts, q, verify_key, temperature, top_k,
                                                   top_p, resample_from_residual)
    # Keep the n + 1 emitted tokens up to the first EOS and the length limit; nothing for finished rows.
    eos_here = _is_eos(emitted, eos_ids) & (positions <= num_accepted[:, None])
    first_eos = jnp.where(jnp.any(eos_here, axis=1), jnp.argmax(eos_here, axis=1), k + 1)
    kept = jnp.minimum(jnp.minimum(num_accepted + 1, first_eos + 1), n - generated)
    kept = jnp.where(active, kept, 0)
    write = jnp.where(positions < kept[:, None], generated[:, None] + positions, n)  # n: dropped
    tokens = tokens.at[rows, write].set(emitted, mode="drop")
    log_probs = log_probs.at[rows, write].set(emitted_logp, mode="drop")
    hit_eos = hit_eos | jnp.any(eos_here & (positions < kept[:, None]), axis=1)
    cache = extended.truncate(cache.lengths + kept)  # last and the kept tokens but the final one
    if layers:
      draft_state = drafter.rollback(draft_state, kept, hidden, target_features=features)
    else:
      draft_state = drafter.rollback(draft_state, kept, hidden)
    last_kept = jnp.take_along_axis(emitted, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
    last = jnp.where(kept > 0, last_kept, last)
    forwards, accepted, per_position = stats
    stats = (forwards + active, accepted + jnp.where(active, num_accepted, 0),
             per_position + (active[:, None] & (positions[:k] < num_accepted[:, None])))
    return _Carry(last, cache, draft_state, tokens, log_probs, generated + kept, hit_eos, stats, row_ids, rng)

  return jax.lax.while_loop(cond, body, carry)


def _run(target: Transformer, drafter: Transformer | Drafter, prompts: Sequence[Sequence[int]],
         max_new_tokens: int, rng: jax.Array, num_draft: int, temperature: float, top_k: int, top_p: float,
         eos_ids, pad_id: int, min_prompt_bucket: int, resample_from_residual: bool, compact: bool = False,
         coupled: bool = False):
  """:func:`speculative_generate`'s decoding; returns ``(tokens, log_probs, num_generated, hit_eos, stats,
  cache, draft_state)``, the per-row outputs (``[B, ...]`` numpy) and the final states of both models.

  ``compact``: whenever at most half of the rows are still active, continue with a batch of half the size
  holding them (``_Carry.take``; finished rows fill the rest), down to one row. Each row computes the same
  thing at any batch size (up to the rounding of batch-size-dependent matmul kernels), and the batch no
  longer waits at full cost for its slowest rows. The returned states are then those of the last batch
  (rows in no particular order), so callers that inspect them pass ``compact=False``.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("speculative_generate needs at least one prompt and every prompt needs at least one token")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if num_draft < 1:
    raise ValueError(f"num_draft must be >= 1, got {num_draft}")
  if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
    raise ValueError(f"invalid sampling parameters temperature={temperature}, top_k={top_k}, top_p={top_p}")
  if isinstance(drafter, Transformer):
    drafter = ModelDrafter(drafter)
  if drafter.vocab_size != target.cfg.vocab_size:
    raise ValueError(f"the drafter's vocabulary ({drafter.vocab_size}) differs from the target's "
                     f"({target.cfg.vocab_size})")
  prompt_len = prompt_bucket(max(len(p) for p in prompts), min_prompt_bucket)
  ids, mask = right_pad(prompts, prompt_len, pad_id)
  # Room for: the prompt, every completion token but the pending one, and K + 1 verified tokens.
  num_slots = prompt_len + max_new_tokens + num_draft
  target_def, target_vars = nnx.split(target)
  drafter_def, drafter_vars = nnx.split(drafter)
  logits, cache, draft_state = _prefill(target_def, target_vars, drafter_def, drafter_vars, jnp.asarray(ids),
                                        jnp.asarray(mask), num_slots=num_slots, num_draft=num_draft)
  greedy = temperature == 0
  filtering = not greedy and (top_k > 0 or top_p < 1)
  sampling = (jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), jnp.float32(top_p))
  eos = jnp.asarray(eos_array(eos_ids))
  carry = _start(logits, cache, draft_state, rng, *sampling, eos, jnp.int32(pad_id), max_new_tokens=max_new_tokens,
                 num_draft=num_draft, greedy=greedy, filtering=filtering, coupled=coupled)
  rows = np.arange(len(prompts))  # the prompt of each row of the current batch
  outputs = None
  while True:
    stop_at = len(rows) // 2 if compact else 0
    carry = _loop(target_def, target_vars, drafter_def, drafter_vars, carry, *sampling, eos,
                  jnp.bool_(resample_from_residual), num_draft=num_draft, greedy=greedy, filtering=filtering,
                  stop_at=stop_at, coupled=coupled)
    part, active = jax.device_get(((carry.tokens, carry.log_probs, carry.generated, carry.hit_eos, carry.stats),
                                   carry.active()))
    if outputs is None:
      outputs = jax.tree.map(np.array, part)
    else:
      for full, new in zip(jax.tree.leaves(outputs), jax.tree.leaves(part)):
        full[rows] = new
    if stop_at == 0 or not active.any():
      return (*outputs, carry.cache, carry.draft_state)
    # The active rows, then finished ones to fill half the batch (they stay finished).
    keep = np.concatenate([np.flatnonzero(active), np.flatnonzero(~active)])[:len(rows) // 2]
    carry, rows = carry.take(keep), rows[keep]


def speculative_generate(target: Transformer, drafter: Transformer | Drafter, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int, rng: jax.Array, num_draft: int = 4, temperature: float = 1.0,
                         top_k: int = 0, top_p: float = 1.0, eos_ids: int | Sequence[int] | None = None,
                         pad_id: int = 0, min_prompt_bucket: int = 16,
                         resample_from_residual: bool = True, coupled: bool = False) -> SpeculativeOutput:
  """Samples completions from ``target`` with a drafter's proposals, losslessly (see the module docstring).

  Args:
    target: the model whose distribution is sampled.
    drafter: a ``Transformer`` over the same vocabulary (wrapped in :class:`ModelDrafter`) or any
      :class:`Drafter`.
    prompts: ``B`` lists of token ids (at least one token each).
    max_new_tokens: ``N``, the length limit.
    rng: a PRNG key; the same key gives the same output (not the same as ``generate``'s for a key: the
      random numbers are used differently; with ``coupled`` the same).
    num_draft: ``K``, tokens drafted per target forward.
    temperature, top_k, top_p, eos_ids, pad_id, min_prompt_bucket: as for
      :func:`lemon_rl.sampling.sampler.generate`; greedy (``temperature = 0``) output equals ``generate``'s
      greedy output token for token (up to near-ties of the target's top two logits, where the rounding of
      a ``K + 1``-token verification can pick the other token than a 1-token decode).
    resample_from_residual: ``False`` makes sampling lossy (resample from ``p`` after a rejection); only for
      tests and ablations.
    coupled: verify by Gumbel coupling (:func:`verify_coupled`) with the noise of
      :func:`lemon_rl.sampling.distribution.coupled_noise`: the same distribution, and the same tokens as
      ``generate(..., coupled=True)`` for the same key (up to float rounding of the logits, as for greedy
      decoding) whatever the drafter, at a lower acceptance than the residual method's. Ignored for
      greedy decoding.

  Returns:
    A :class:`SpeculativeOutput`: ``generate``'s outputs (log-probs of each emitted token under the
    target's sampling distribution, whether accepted or resampled) and :class:`SpeculativeStats`.
  """
  tokens, log_probs, lengths, hit_eos, (forwards, accepted, per_position), _, _ = _run(
      target, drafter, prompts, max_new_tokens, rng, num_draft, temperature, top_k, top_p, eos_ids, pad_id,
      min_prompt_bucket, resample_from_residual, compact=True, coupled=bool(coupled))
  lengths = lengths.astype(np.int32)
  mask = (np.arange(max_new_tokens)[None] < lengths[:, None]).astype(np.int32)
  with np.errstate(invalid="ignore", divide="ignore"):
    tau = np.where(forwards > 0, (accepted + forwards) / np.maximum(forwards, 1), np.nan).astype(np.float32)
  stats = SpeculativeStats(forwards.astype(np.int32), (num_draft * forwards).astype(np.int32),
                           accepted.astype(np.int32), per_position.astype(np.int32), tau)
  reasons = ["eos" if e else "length" for e in hit_eos]
  return SpeculativeOutput(tokens, np.where(mask, log_probs, 0.0).astype(np.float32), mask, lengths, reasons,
                           stats)


# -- greedy agreement with the target alone --------------------------------------------------------------


class GreedyDifference(NamedTuple):
  """Where a row first differs from the reference: ``position`` in the completion, and ``gap``, the target's
  top-two logit gap there (full forward over the prompt and the reference's first ``position`` tokens)."""

  row: int
  position: int
  gap: float


class GreedyAgreement(NamedTuple):
  """Outcome of :func:`compare_greedy` / :func:`compare_coupled`.

  Attributes:
    identical: rows equal to the reference token for token, in length and in finish reason.
    near_ties: rows that first differ where the gap is below the tie threshold (rounding of a
      ``(K+1)``-token verification vs a 1-token decode can pick the other of two near-equal logits).
    mismatches: rows that first differ without a near-tie (a bug, for greedy or coupled speculative
      decoding).
  """

  identical: int
  near_ties: list[GreedyDifference]
  mismatches: list[GreedyDifference]


_full_logits = nnx.jit(Transformer.__call__)


def compare_greedy(target: Transformer, prompts: Sequence[Sequence[int]], out: SampleOutput | SpeculativeOutput,
                   ref: SampleOutput, tie_gap: float) -> GreedyAgreement:
  """Compares greedy ``out`` with the reference greedy ``ref`` (e.g. ``generate(target, ..., temperature=0)``)
  row by row; a differing row is classified by the target's top-two logit gap at its first difference:
  ``logit_(1) - logit_(2) < tie_gap`` is a near-tie, anything else a mismatch.
  """
  return _compare(target, prompts, out, ref, tie_gap, lambda logits, row, position: logits)


def compare_coupled(target: Transformer, prompts: Sequence[Sequence[int]], out: SampleOutput | SpeculativeOutput,
                    ref: SampleOutput, tie_gap: float, rng: jax.Array, temperature: float, top_k: int = 0,
                    top_p: float = 1.0) -> GreedyAgreement:
  """:func:`compare_greedy` for two coupled samples of the same key (``generate(..., coupled=True)``,
  ``speculative_generate(..., coupled=True)``): the gap is that of the Gumbel-perturbed sampling logits
  ``sampling_logits + coupled_noise(rng, row, position)``, whose argmax both drew."""
  def perturbed(logits, row, position):
    noise = distribution.coupled_noise(rng, jnp.asarray([row]), jnp.asarray([[position]]), logits.shape[-1])
    return np.asarray(distribution.sampling_logits(jnp.asarray(logits), temperature, top_k, top_p) + noise[0, 0])

  return _compare(target, prompts, out, ref, tie_gap, perturbed)


def _compare(target, prompts, out, ref, tie_gap, scores) -> GreedyAgreement:
  """Row-by-row agreement; ``scores(logits [V], row, position)`` are what both sides took the argmax of."""
  identical, ties, mismatches = 0, [], []
  for i, prompt in enumerate(prompts):
    diff = np.flatnonzero(out.tokens[i] != ref.tokens[i])
    if diff.size == 0:
      same_end = out.lengths[i] == ref.lengths[i] and out.finish_reasons[i] == ref.finish_reasons[i]
      if not same_end:  # Equal tokens but a different length or finish reason: never a rounding effect.
        mismatches.append(GreedyDifference(i, int(min(out.lengths[i], ref.lengths[i])), float("inf")))
      identical += same_end
      continue
    j = int(diff[0])
    seq = list(prompt) + ref.tokens[i, :j].tolist()
    ids, mask = right_pad([seq], prompt_bucket(len(seq)), 0)
    logits = np.asarray(_full_logits(target, jnp.asarray(ids), jnp.asarray(mask)))[0, len(seq) - 1]
    top_two = np.sort(scores(logits, i, j))[-2:]
    gap = float(top_two[1] - top_two[0])
    (ties if gap < tie_gap else mismatches).append(GreedyDifference(i, j, gap))
  return GreedyAgreement(identical, ties, mismatches)
