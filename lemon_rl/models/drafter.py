"""An EAGLE-3-style drafter for any ``Transformer``: one decoder layer over the target's fused features.

EAGLE-3 (Li et al. 2025) drafts from the target's own features rather than from tokens alone. With ``E``
the target's width, ``u^(i)_t`` the residual stream after target block ``i`` at position ``t`` (before any
norm) and ``feature_layers = (l, m, h)`` a low, a middle and a high block:

- fusion: ``g_t = [u^(l)_t; u^(m)_t; u^(h)_t] W_fuse`` (``W_fuse [3E, E]``, any number of layers works);
- one decoder layer whose residual stream starts at a feature ``a`` (``g_t``, or the drafter's own output
  of the previous drafting step) and whose attention reads the *next token's* embedding ``e`` too::

      z  = [rmsnorm(e) * w_e ; rmsnorm(a) * w_a]             [2E]
      a' = a + Attn(q, k, v = z W_qkv (+ b_qkv)) W_out        (grouped-query, rotary, causal over the cache)
      o  = a' + SwiGLU(rmsnorm(a') * w_mlp)

- logits: the target's frozen LM head on ``rmsnorm(o) * w_final`` (the drafter's own final norm).

The drafter's sequence: *entry* ``i`` is the pair (feature of position ``i``, token ``i + 1``), stored in
cache slot ``i`` with rotary position ``i``; its output ``o_i`` predicts token ``i + 2``. While drafting
after the verified prefix ``x_0..x_t``, entry ``t`` is (``g_t``, ``x_{t+1}``) and the next entries are
(``o_t``, ``d_1``), (``o_{t+1}``, ``d_2``)...: from the second drafting step on, the drafter's own output
stands in for the target's feature it does not have. Training unrolls exactly this (the training-time
test, :meth:`EagleHead.unroll`, ``lemon_rl.training.drafter_training``).

Two modules:

- :class:`EagleHead`: the trainable parameters only (fusion, the layer, the final norm), with the
  full-sequence, cached and unrolled forwards; it takes token embeddings as inputs and never holds the
  target, so an optimizer over ``nnx.state(head, nnx.Param)`` cannot touch the target's embedding or head.
- :class:`EagleDrafter`: ``EagleHead`` + the target, implementing the speculative engine's ``Drafter``
  protocol (``speculative_generate(target, EagleDrafter(target, head), ...)``).

Shapes: ``B`` batch, ``T``/``P`` sequence/prompt length, ``E`` width, ``F = n E`` concatenated features of
``n`` target blocks, ``K`` drafted tokens per window, ``V`` vocabulary, ``S`` unrolled drafting steps.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lemon_rl.models.config import ModelConfig
from lemon_rl.models.transformer import (KVCache, Transformer, cache_keys, cache_values, causal_attention,
                                         grouped_attention, init_param, rms_norm, rope_inverse_frequencies,
                                         rope_tables, rotate, write_rows)
from lemon_rl.sampling.speculative import draw, noise_at, noise_steps

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's low / middle / high target blocks ``(1, L//2 - 1, L - 4)``, clipped to ``[0, L)``.

  (The layers SpecForge and the EAGLE-3 reference read for an ``L``-block target; e.g. ``(1, 3, 4)`` for 8
  blocks, ``(1, 5, 8)`` for 12.)
  """
  return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


def shift_left(x: jax.Array, n: int) -> jax.Array:
  """``y[:, t] = x[:, t + n]`` (zeros past the end) along axis 1."""
  if n == 0:
    return x
  t = x.shape[1]
  pad = jnp.zeros((x.shape[0], min(n, t), *x.shape[2:]), x.dtype)
  return jnp.concatenate([x[:, n:], pad], axis=1)


class EagleHead(nnx.Module):
  """The trainable part of an EAGLE-3 drafter for targets of config ``target_cfg``.

  Args:
    target_cfg: the target's config; the layer inherits its width, rotary base, norms, bias and dtypes.
    feature_layers: target blocks fused (default :func:`default_feature_layers`).
    num_heads, num_kv_heads, mlp_dim: the layer's attention heads and MLP width (default the target's);
      the head width stays the target's ``head_dim``.
    rngs: parameter initialisation.
  """

  def __init__(self, target_cfg: ModelConfig, feature_layers: Sequence[int] | None = None, *, rngs: nnx.Rngs,
               num_heads: int | None = None, num_kv_heads: int | None = None, mlp_dim: int | None = None):
    layers = tuple(int(i) for i in (feature_layers or default_feature_layers(target_cfg.num_layers)))
    for i in layers:
      if not 0 <= i < target_cfg.num_layers:
        raise ValueError(f"feature layer {i} is outside the target's blocks [0, {target_cfg.num_layers})")
    cfg = target_cfg.replace(num_layers=1, num_heads=num_heads or target_cfg.num_heads,
                             num_kv_heads=num_kv_heads or target_cfg.num_kv_heads,
                             mlp_dim=mlp_dim or target_cfg.mlp_dim, head_dim=target_cfg.head_dim,
                             value_head=False)
    self.cfg = cfg
    self.feature_layers = layers
    e, d, f = cfg.hidden_size, cfg.head_dim, cfg.mlp_dim
    qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    self.fuse = init_param(rngs, (len(layers) * e, e), cfg, (None, "embed"))
    self.embed_norm = init_param(rngs, (e,), cfg, ("embed",), init="ones")
    self.feature_norm = init_param(rngs, (e,), cfg, ("embed",), init="ones")
    self.qkv = init_param(rngs, (2 * e, qkv_width), cfg, ("embed", "heads"))
    self.qkv_bias = init_param(rngs, (qkv_width,), cfg, ("heads",), init="zeros") if cfg.qkv_bias else None
    self.out = init_param(rngs, (cfg.num_heads * d, e), cfg, ("heads", "embed"))
    self.mlp_norm = init_param(rngs, (e,), cfg, ("embed",), init="ones")
    self.gate_up = init_param(rngs, (e, 2 * f), cfg, ("embed", "mlp"))
    self.down = init_param(rngs, (f, e), cfg, ("mlp", "embed"))
    self.final_norm = init_param(rngs, (e,), cfg, ("embed",), init="ones")

  def spec(self) -> dict[str, Any]:
    """The constructor arguments beyond the target's config (JSON-serialisable, for checkpoints)."""
    return {"feature_layers": list(self.feature_layers), "num_heads": self.cfg.num_heads,
            "num_kv_heads": self.cfg.num_kv_heads, "mlp_dim": self.cfg.mlp_dim}

  # -- pieces --------------------------------------------------------------------------------------------

  def fuse_features(self, features: jax.Array) -> jax.Array:
    """Target features ``[..., F]`` -> ``g [..., E]`` (the fusion linear layer)."""
    dt = self.cfg.jnp_dtype
    return jnp.dot(features.astype(dt), self.fuse[...].astype(dt))

  def normed(self, hidden: jax.Array) -> jax.Array:
    """The layer's output ``[..., E]`` -> the input of the target's LM head (the drafter's final norm)."""
    return rms_norm(hidden, self.final_norm[...].astype(hidden.dtype), self.cfg.rms_norm_eps)

  def _qkv(self, embeds2: jax.Array, hidden2: jax.Array, batch: int, rope):
    """``[norm(e); norm(a)] W_qkv`` -> rotated ``q [B, T, H, D]``, rotated ``k [B, T, K, D]``, ``v``."""
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    z = jnp.concatenate([rms_norm(embeds2, self.embed_norm[...].astype(dt), cfg.rms_norm_eps),
                         rms_norm(hidden2, self.feature_norm[...].astype(dt), cfg.rms_norm_eps)], axis=-1)
    qkv = z @ self.qkv[...].astype(dt)
    if self.qkv_bias is not None:
      qkv = qkv + self.qkv_bias[...].astype(dt)
    qkv = qkv.reshape(batch, -1, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
    q, k, v = jnp.split(qkv, [cfg.num_heads, cfg.num_heads + cfg.num_kv_heads], axis=2)
    return rotate(q, *rope), rotate(k, *rope), v

  def _finish(self, hidden2: jax.Array, attn2: jax.Array) -> jax.Array:
    """Output projection + residual onto the feature ``a``, then the SwiGLU MLP + residual (2-D)."""
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    x2 = hidden2 + attn2 @ self.out[...].astype(dt)
    h = rms_norm(x2, self.mlp_norm[...].astype(dt), cfg.rms_norm_eps)
    gate, up = jnp.split(h @ self.gate_up[...].astype(dt), 2, axis=-1)
    return x2 + (jax.nn.silu(gate) * up) @ self.down[...].astype(dt)

  def _rope(self, positions: jax.Array):
    return rope_tables(positions, rope_inverse_frequencies(self.cfg))

  # -- cached forwards (drafting) ------------------------------------------------------------------------

  def init_cache(self, batch: int, num_slots: int) -> KVCache:
    """An empty one-layer cache of ``num_slots`` slots per row."""
    cfg = self.cfg
    return KVCache((jnp.zeros((batch, cfg.num_kv_heads, cfg.head_dim, num_slots), cfg.jnp_dtype),),
                   (jnp.zeros((batch, cfg.num_kv_heads, num_slots, cfg.head_dim), cfg.jnp_dtype),),
                   jnp.zeros((batch,), jnp.int32))

  def prefill(self, hidden: jax.Array, embeds: jax.Array, lengths: jax.Array, num_slots: int):
    """Runs entries ``[0, lengths)`` (causal) and writes them into cache slots ``[0, lengths)``.

    Args:
      hidden: ``[B, P, E]`` features ``a`` of the entries (fused target features).
      embeds: ``[B, P, E]`` embeddings of the entries' tokens (token ``i + 1`` for entry ``i``).
      lengths: ``[B]`` int, valid entries per row (``0`` allowed).
      num_slots: cache capacity ``S >= P``.

    Returns:
      ``(outputs [B, P, E], cache)``; outputs past ``lengths`` are finite but meaningless.
    """
    b, p, _ = hidden.shape
    if num_slots < p:
      raise ValueError(f"num_slots ({num_slots}) must be >= the number of entries ({p})")
    lengths = jnp.asarray(lengths, jnp.int32)
    rope = self._rope(jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p)))
    mask = jnp.arange(p)[None, :] < lengths[:, None]
    q, k, v = self._qkv(embeds.reshape(b * p, -1), hidden.reshape(b * p, -1), b, rope)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = self._finish(hidden.reshape(b * p, -1), causal_attention(q, k, v, mask).reshape(b * p, -1))
    return out.reshape(b, p, -1), KVCache((cache_keys(k, num_slots),), (cache_values(v, num_slots),), lengths)

  def extend(self, hidden: jax.Array, embeds: jax.Array, cache: KVCache, num_new: jax.Array | None = None):
    """Appends ``k`` entries per row (slots ``[lengths, lengths + k)``), as ``Transformer.extend``.

    Args:
      hidden: ``[B, k, E]`` features ``a`` of the new entries.
      embeds: ``[B, k, E]`` embeddings of their tokens.
      cache: the drafter's cache (room for ``k`` more slots in every row).
      num_new: optional ``[B]`` in ``[0, k]``, how many of the ``k`` entries count.

    Returns:
      ``(outputs [B, k, E], cache)``.
    """
    b, k, _ = hidden.shape
    s = cache.num_slots
    start = cache.lengths.astype(jnp.int32)
    positions = start[:, None] + jnp.arange(k, dtype=jnp.int32)
    allowed = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    q, new_k, new_v = self._qkv(embeds.reshape(b * k, -1), hidden.reshape(b * k, -1), b, self._rope(positions))
    keys = write_rows(cache.keys[0], new_k.transpose(0, 2, 3, 1), start, slot_axis=3)
    values = write_rows(cache.values[0], new_v.transpose(0, 2, 1, 3), start)
    out = self._finish(hidden.reshape(b * k, -1), grouped_attention(q, keys, values, allowed).reshape(b * k, -1))
    added = k if num_new is None else jnp.clip(jnp.asarray(num_new, jnp.int32), 0, k)
    lengths = jnp.where(start + k <= s, start + added, start)
    return out.reshape(b, k, -1), KVCache((keys,), (values,), lengths)

  # -- the training-time test ----------------------------------------------------------------------------

  def unroll(self, features: jax.Array, embeds: jax.Array, mask: jax.Array, num_steps: int) -> jax.Array:
    """``S = num_steps`` drafting steps from every position of whole sequences at once (EAGLE-3's TTT).

    Step ``k`` at position ``t`` is what drafting after the verified prefix ``x_0..x_t`` computes at its
    ``k``-th step: entry (``a``, ``x_{t+1+k}``) at rotary position ``t + k`` with ``a = g_t`` for ``k = 0``
    and ``a = o^{k-1}_t``, the drafter's own output of step ``k - 1`` at ``t``, for ``k >= 1``. It attends
    to the step-0 entries ``s <= t`` (the true-feature prefix, as in the cache) and to its own earlier
    steps' entries at ``t`` (the drafted ones), so ``o^k_t`` equals :meth:`extend`'s output along that path
    (``tests/test_drafter.py``) and predicts ``x_{t+k+2}``.

    Args:
      features: ``[B, T, F]`` the target's features of positions ``0..T-1``.
      embeds: ``[B, T, E]`` embeddings of tokens ``x_0..x_{T-1}``.
      mask: ``[B, T]`` bool, real tokens (right padding).
      num_steps: ``S >= 1``.

    Returns:
      ``o [S, B, T, E]``; ``o[k, :, t]`` is meaningful where ``x_{t+k+1}`` is a real token.
    """
    b, t, _ = features.shape
    mask = mask.astype(bool)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    entry_mask = mask & shift_left(mask, 1)  # entry s = (g_s, x_{s+1}) exists
    hidden = self.fuse_features(features)
    outputs, own = [], []
    keys0 = values0 = None
    for k in range(num_steps):
      tokens = shift_left(embeds, k + 1)  # x_{t+1+k}
      q, key, value = self._qkv(tokens.reshape(b * t, -1), hidden.reshape(b * t, -1), b,
                                self._rope(positions + k))
      if k == 0:
        keys0, values0 = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
        attn = causal_attention(q, keys0, values0, entry_mask)
      else:
        own.append((key, value))
        attn = _unrolled_attention(q, keys0, values0, entry_mask, own)
      hidden = self._finish(hidden.reshape(b * t, -1), attn.reshape(b * t, -1)).reshape(b, t, -1)
      outputs.append(hidden)
    return jnp.stack(outputs)


def _unrolled_attention(q: jax.Array, keys0: jax.Array, values0: jax.Array, entry_mask: jax.Array,
                        own: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
  """Attention of drafting step ``k = len(own) >= 1`` at every position ``t`` at once.

  Query ``(k, t)`` attends to the step-0 keys ``s <= t`` where ``entry_mask[s]`` (``keys0, values0 [B, K, T,
  D]``) and to the keys of steps ``1..k`` at the same position ``t`` (``own[j] = (k_j, v_j)``, each ``[B, T,
  K, D]``): one softmax over ``T + k`` scores per query. ``q [B, T, H, D]``; returns ``[B, T, H*D]``.
  """
  b, t, h, d = q.shape
  k_heads = keys0.shape[1]
  qg = q.reshape(b, t, k_heads, h // k_heads, d) * (1.0 / math.sqrt(d))
  prefix = jnp.einsum("btkgd,bksd->bkgts", qg, keys0, preferred_element_type=jnp.float32)
  allowed = jnp.tril(jnp.ones((t, t), bool))[None] & entry_mask[:, None, :]  # [B, T, S]
  prefix = jnp.where(allowed[:, None, None], prefix, _MASK_VALUE)
  own_keys = jnp.stack([key for key, _ in own], axis=-2)  # [B, T, K, J, D]
  own_values = jnp.stack([value for _, value in own], axis=-2)
  diagonal = jnp.einsum("btkgd,btkjd->bkgtj", qg, own_keys, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(jnp.concatenate([prefix, diagonal], axis=-1), axis=-1).astype(values0.dtype)
  out = (jnp.einsum("bkgts,bksd->btkgd", probs[..., :t], values0)
         + jnp.einsum("bkgtj,btkjd->btkgd", probs[..., t:], own_values))
  return out.reshape(b, t, h * d)


class EagleDraftState(NamedTuple):
  """State of an :class:`EagleDrafter` between proposals.

  The cache holds entries up to (not including) the ``num_pending`` entries whose target features arrived
  with the last verification: entry ``j`` of them is (``features[:, j]``, ``tokens[:, j]``) for ``j <
  num_pending - 1`` and (``features[:, num_pending - 1]``, ``last``) for the last, ``last`` being the token
  passed to the next :meth:`EagleDrafter.propose`. They are run in one ``K + 1``-wide extend there.

  Attributes:
    cache: the drafter's one-layer cache.
    features: ``[B, K + 1, E]`` fused target features of the pending entries.
    tokens: ``[B, K]`` their tokens (the accepted drafts of the last window).
    num_pending: ``[B]`` int32 in ``[1, K + 1]``.
    drafts: ``[B, K]`` the last proposal.
    base_lengths: ``[B]`` cache lengths before the last proposal (for rollback).
  """

  cache: KVCache
  features: jax.Array
  tokens: jax.Array
  num_pending: jax.Array
  drafts: jax.Array
  base_lengths: jax.Array


class EagleDrafter(nnx.Module):
  """The speculative engine's ``Drafter`` for an :class:`EagleHead` on ``target`` (features + shared head).

  ``feature_layers`` tells the engine to pass the target's outputs of those blocks to :meth:`prefill` and
  :meth:`rollback` (see ``lemon_rl.sampling.speculative.Drafter``). A proposal is one ``K + 1``-wide extend
  of the pending entries (``num_pending`` per row) then ``K - 1`` one-entry extends on the drafter's own
  outputs, each followed by a draw through the target's LM head; rollback keeps the pending entries and
  drops the drafted ones, whose true features the verification just delivered.
  """

  def __init__(self, target: Transformer, head: EagleHead):
    if head.cfg.hidden_size != target.cfg.hidden_size:
      raise ValueError(f"the head's width ({head.cfg.hidden_size}) differs from the target's "
                       f"({target.cfg.hidden_size})")
    if max(head.feature_layers) >= target.cfg.num_layers:
      raise ValueError(f"feature layers {head.feature_layers} exceed the target's {target.cfg.num_layers} blocks")
    self.target = target
    self.head = head

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.head.feature_layers

  def _embed(self, tokens: jax.Array) -> jax.Array:
    return self.target.embed_tokens(tokens).reshape(*tokens.shape, -1)

  def _draw(self, hidden, noise, temperature, top_k, top_p):
    return draw(self.target.logits_from_hidden(self.head.normed(hidden)), noise, temperature, top_k, top_p)

  def prefill(self, input_ids, attention_mask, num_slots, *, target_features, num_draft) -> EagleDraftState:
    """Entries ``0..P-2`` of each prompt into the cache; entry ``P-1`` (needs the first token) pending."""
    if num_draft is None:
      raise ValueError("EagleDrafter.prefill needs num_draft")
    b, p = input_ids.shape
    lengths = jnp.sum(attention_mask.astype(bool), axis=-1, dtype=jnp.int32)
    fused = self.head.fuse_features(target_features)
    _, cache = self.head.prefill(fused, shift_left(self._embed(input_ids), 1), lengths - 1, num_slots)
    last_feature = jnp.take_along_axis(fused, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    features = jnp.zeros((b, num_draft + 1, fused.shape[-1]), fused.dtype).at[:, :1].set(last_feature)
    zeros = jnp.zeros((b, num_draft), jnp.int32)
    return EagleDraftState(cache, features, zeros, jnp.ones((b,), jnp.int32), zeros, cache.lengths)

  def propose(self, state: EagleDraftState, last, noise, num_draft, temperature, top_k, top_p):
    if state.tokens.shape[1] != num_draft:
      raise ValueError(f"the state was prefilled for {state.tokens.shape[1]} drafts, not {num_draft}")
    n = state.num_pending
    slots = jnp.arange(num_draft + 1)[None, :]
    tokens = jnp.concatenate([state.tokens, jnp.zeros_like(last)[:, None]], axis=1)
    tokens = jnp.where(slots == (n - 1)[:, None], last[:, None], tokens)
    out, cache = self.head.extend(state.features, self._embed(tokens), state.cache, num_new=n)
    hidden = jnp.take_along_axis(out, (n - 1)[:, None, None], axis=1)[:, 0]
    token, q = self._draw(hidden, noise_at(noise, 0), temperature, top_k, top_p)

    def step(carry, noise):
      cache, hidden, token = carry
      out, cache = self.head.extend(hidden[:, None], self._embed(token[:, None]), cache)
      token, q = self._draw(out[:, 0], noise, temperature, top_k, top_p)
      return (cache, out[:, 0], token), (token, q)

    (cache, _, _), (rest, qs) = jax.lax.scan(step, (cache, hidden, token), noise_steps(noise),
                                             length=num_draft - 1)
    drafts = jnp.concatenate([token[:, None], rest.T], axis=1)
    if q is not None:
      q = jnp.concatenate([q[:, None], qs.transpose(1, 0, 2)], axis=1)
    return drafts, q, state._replace(cache=cache, drafts=drafts, base_lengths=state.cache.lengths)

  def rollback(self, state: EagleDraftState, num_kept, target_hidden, *, target_features) -> EagleDraftState:
    del target_hidden  # the drafter reads the fused block outputs instead
    active = num_kept > 0
    cache = state.cache.truncate(jnp.where(active, state.base_lengths + state.num_pending, state.base_lengths))
    features = jnp.where(active[:, None, None], self.head.fuse_features(target_features), state.features)
    return state._replace(cache=cache, features=features,
                          tokens=jnp.where(active[:, None], state.drafts, state.tokens),
                          num_pending=jnp.where(active, num_kept, state.num_pending).astype(jnp.int32))
