"""The sampling distribution, in one place for the sampler and the learner.

A token is drawn from ``softmax(filter(logits / temperature))`` where ``filter`` keeps the top-k set, then
the top-p nucleus of what is left (:func:`filter_logits`). Temperature ``0`` means greedy: the argmax is
taken and its log-prob is reported under the *unfiltered temperature-1* distribution (a greedy sample has
no distribution of its own; this is the convention the trainers rely on).

The sampler draws its tokens from :func:`sampling_logits` and reports :func:`sampling_log_probs`; a learner
that recomputes logits with a full forward pass calls :func:`sampling_log_probs` with the same
``(temperature, top_k, top_p)`` and gets the same numbers up to float rounding of the logits.

How the kept set is decided (identically on both sides, given the logits):

- Ties: a token is kept iff its (tempered) logit is ``>=`` the threshold logit (the logit of the last token
  the rule keeps in descending order). Every token tied with the threshold is kept, so top-k can keep more
  than ``k`` tokens when logits tie; the set never depends on how a sort orders equal values.
- Top-p: sorted descending, a token is kept iff the probability mass strictly before it is ``< top_p``
  (so the smallest prefix reaching ``top_p`` is kept, and the most likely token always is). ``top_p >= 1``
  disables the filter exactly (float32 cumulative sums can reach 1 before the tail, which would otherwise
  drop tail tokens of negligible mass).
- Float rounding: the learner's full-forward logits differ from the sampler's cached-decode logits by
  float rounding (about ``1e-6`` relative), which can move a token across the top-p boundary when the mass
  before it is within that much of ``top_p``. So that such a token never scores ``-inf`` (an infinite
  importance ratio), :func:`sampling_log_probs` always counts the *scored* token as kept. For the sampler
  this changes nothing (a sampled token is always in its own kept set); for the learner it keeps the
  log-prob finite and, in that rare event, equal to the sampler's up to the mass of tokens whose
  membership flipped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Scalar = Any  # a Python number or a traced 0-d array


def _static(x: Scalar):
  """``x`` as a Python number if it is concrete, else ``None`` (traced)."""
  if isinstance(x, (int, float)):
    return x
  try:
    return x.item()
  except Exception:  # pylint: disable=broad-except  # a tracer
    return None


def filter_logits(logits: jax.Array, top_k: Scalar, top_p: Scalar) -> jax.Array:
  """Masks logits ``[..., V]`` outside the top-k set, then outside the top-p nucleus, to ``-inf``.

  ``top_k <= 0`` and ``top_p >= 1`` disable the respective filter; both may be traced scalars. Top-p keeps
  the smallest prefix of the descending order whose probability mass reaches ``top_p`` (the most likely
  token is always kept), computed over the top-k-filtered distribution. Tokens tied with the last kept
  logit are kept too (see the module docstring).
  """
  vocab = logits.shape[-1]
  lead = logits.shape[:-1]
  top_k = jnp.asarray(top_k, jnp.int32)
  top_p = jnp.asarray(top_p, jnp.float32)
  sorted_logits = -jnp.sort(-logits, axis=-1)  # descending; exact (negation is)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k = jnp.arange(vocab) < k
  kth = jnp.take_along_axis(sorted_logits, jnp.broadcast_to(k - 1, lead + (1,)), axis=-1)
  sorted_logits = jnp.where(in_top_k, sorted_logits, -jnp.inf)
  probs = jax.nn.softmax(sorted_logits.astype(jnp.float32), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = ((mass_before < top_p) | (top_p >= 1)) & in_top_k
  num_kept = jnp.maximum(jnp.sum(keep_sorted, axis=-1, keepdims=True), 1)
  threshold = jnp.maximum(jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1), kth)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def _tempered(logits: jax.Array, temperature: Scalar) -> jax.Array:
  """``logits / temperature`` in float32; unchanged for temperature 0 (greedy)."""
  logits = logits.astype(jnp.float32)
  t = _static(temperature)
  if t is not None:
    if t < 0:
      raise ValueError(f"temperature must be >= 0, got {t}")
    return logits if t in (0, 1) else logits / jnp.float32(t)
  temperature = jnp.asarray(temperature, jnp.float32)
  return jnp.where(temperature > 0, logits / jnp.where(temperature > 0, temperature, 1.0), logits)


def _filtered(tempered: jax.Array, temperature: Scalar, top_k: Scalar, top_p: Scalar) -> jax.Array:
  """Applies the filters unless they are statically off (or the temperature is 0)."""
  t, k, p = _static(temperature), _static(top_k), _static(top_p)
  if t == 0 or (k is not None and k <= 0 and p is not None and p >= 1):
    return tempered
  if t is None:  # traced temperature: greedy (0) must stay unfiltered
    greedy = jnp.asarray(temperature) <= 0
    top_k = jnp.where(greedy, 0, jnp.asarray(top_k, jnp.int32))
    top_p = jnp.where(greedy, 1.0, jnp.asarray(top_p, jnp.float32))
  return filter_logits(tempered, top_k, top_p)


def sampling_logits(logits: jax.Array, temperature: Scalar = 1.0, top_k: Scalar = 0,
                    top_p: Scalar = 1.0) -> jax.Array:
  """The logits a token is sampled from: ``filter(logits / temperature)``, float32 ``[..., V]``.

  Temperature ``0`` (greedy) returns the logits unchanged (float32) and unfiltered. Each argument may be
  a Python number or a traced scalar; filters that are statically off cost nothing (no sort).
  """
  return _filtered(_tempered(logits, temperature), temperature, top_k, top_p)


def _log_probs_from(tempered: jax.Array, filtered: jax.Array, tokens: jax.Array) -> jax.Array:
  """``log softmax(filtered)[tokens]`` with the scored token always counted as kept (finite)."""
  tokens = tokens.astype(jnp.int32)[..., None]
  picked = jnp.take_along_axis(tempered, tokens, axis=-1)
  one_hot = jnp.arange(tempered.shape[-1]) == tokens
  kept = jnp.where(one_hot, tempered, filtered)
  return (picked - jax.nn.logsumexp(kept, axis=-1, keepdims=True))[..., 0]


def sampling_log_probs(logits: jax.Array, tokens: jax.Array, temperature: Scalar = 1.0, top_k: Scalar = 0,
                       top_p: Scalar = 1.0) -> jax.Array:
  """Log-prob of each token under the sampling distribution (float32).

  Args:
    logits: ``[..., V]`` next-token logits (raw, any float dtype), e.g. a full forward's
      ``model(ids, mask)[:, :-1]`` for the tokens ``ids[:, 1:]``.
    tokens: ``[...]`` int ids scored at those positions.
    temperature, top_k, top_p: exactly as given to the sampler (``generate``).

  Returns:
    ``[...]`` float32 ``log softmax(sampling_logits(logits))[tokens]``, the scored token always counted
    in the kept set (see the module docstring). Greedy (temperature 0): the temperature-1 log-prob.
  """
  tempered = _tempered(logits, temperature)
  return _log_probs_from(tempered, _filtered(tempered, temperature, top_k, top_p), tokens)


def coupled_noise(rng: jax.Array, rows: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
  """Gumbel noise ``[B, L, V]`` of completion token ``positions[b, l]`` of row ``rows[b]``.

  ``rows [B]`` and ``positions [B, L]`` are int32; entry ``(b, l)`` is
  ``Gumbel(fold_in(fold_in(rng, rows[b]), positions[b, l]), (V,))``: it depends on the key, the row and
  the position only, never on the batch it is computed in or on the previous tokens. A sampler that draws
  token ``i`` of row ``b`` as ``argmax(sampling_logits + noise)`` with this noise (Gumbel-max) samples
  exactly from :func:`sampling_logits`, and two such samplers (plain decoding, speculative decoding with
  any drafter) emit the same tokens from the same logits: the coupling of ``generate(..., coupled=True)``
  and ``speculative_generate(..., coupled=True)``.
  """
  def row_noise(row, row_positions):
    row_key = jax.random.fold_in(rng, row)
    return jax.vmap(lambda i: jax.random.gumbel(jax.random.fold_in(row_key, i), (vocab_size,)))(row_positions)

  return jax.vmap(row_noise)(rows, positions)


def sample(logits: jax.Array, key: jax.Array | None, temperature: Scalar = 1.0, top_k: Scalar = 0,
           top_p: Scalar = 1.0, noise: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row of ``logits [..., V]``; returns ``(tokens [...] int32, log_probs [...])``.

  Greedy (``temperature`` 0) takes the argmax; otherwise a categorical draw from
  :func:`sampling_logits`: ``argmax(sampling_logits + Gumbel noise)``, the noise drawn from ``key`` (as
  ``jax.random.categorical`` draws it) or given as ``noise [..., V]`` (e.g. :func:`coupled_noise`; ``key``
  is then unused). The log-probs are :func:`sampling_log_probs` of the drawn tokens (computed from the
  same filtered logits, not recomputed).
  """
  tempered = _tempered(logits, temperature)
  filtered = _filtered(tempered, temperature, top_k, top_p)
  t = _static(temperature)
  if t == 0:
    tokens = jnp.argmax(tempered, axis=-1).astype(jnp.int32)
  else:
    if noise is None:
      noise = jax.random.gumbel(key, filtered.shape, filtered.dtype)
    tokens = jnp.argmax(noise + filtered, axis=-1).astype(jnp.int32)
    if t is None:  # traced: greedy rows of a traced temperature 0
      tokens = jnp.where(jnp.asarray(temperature) <= 0, jnp.argmax(tempered, axis=-1), tokens).astype(jnp.int32)
  return tokens, _log_probs_from(tempered, filtered, tokens)
