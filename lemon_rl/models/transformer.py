"""A Llama / Qwen2-family decoder in Flax NNX.

Layout choices (measured on XLA:CPU, see ``shared/DESIGN.md``): every projection runs on 2-D activations
``[B*T, E]``; Q/K/V are one fused matmul (weight ``[E, K, G + 2, D]``, grouped by KV head) and the SwiGLU
gate/up another (``[E, F, 2]``), laid out so that a tensor-parallel split never crosses the q | k | v or
gate | up boundaries (:func:`group_qkv`), and the output projection ``[H, D, E]`` splits on whole heads (each
weight is reshaped to 2-D for its matmul: a merge that keeps the split major axis); the KV cache is
keys ``[B, K, D, S]`` and values ``[B, K, S, D]`` with a length per row (each row left-aligned at slot 0,
appended to by one scatter per layer buffer; as fast as the former same-slot ``dynamic_update_slice`` at
batch 8 and 32 within this machine's noise) and grouped-query attention is two batched matmuls per (batch, KV
head), ``[G*T, D] x [D, S]`` and ``[G*T, S] x [S, D]`` (with keys stored ``[B, K, S, D]`` the scores contracted
both operands on their last axis, which XLA:CPU ran 1.7-2.8x slower at batch 8-32: ``BENCHMARKS.md``, "Decode
attention"). Full-sequence attention (training, log-probs, prefill) uses :func:`causal_attention`: query
blocks that skip keys above the diagonal, with a custom VJP that never materialises the normalised
probabilities; the rotary tables are computed once per forward. Together about 6% less CPU time for the
bench model's forward + backward than autodiff of a masked softmax over the full ``T x T`` (``BENCHMARKS.md``,
"train step").

Shapes: ``B`` batch, ``T`` query length, ``S`` key length / cache slots, ``E`` width, ``H`` query heads,
``K`` KV heads, ``G = H / K`` groups, ``D`` head width, ``F`` MLP width, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lemon_rl.models.config import ModelConfig
from lemon_rl.models.sharding import constrain, tree_shardings

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def init_param(rngs: nnx.Rngs, shape, cfg: ModelConfig, logical_axes, init="normal") -> nnx.Param:
  if init == "normal":
    value = cfg.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "ones":
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  return nnx.Param(value.astype(cfg.jnp_param_dtype), logical_axes=logical_axes)


class KVCache(NamedTuple):
  """Keys ``[B, K, D, S]`` and values ``[B, K, S, D]`` of ``L`` layers, and the number of valid slots per row.

  Row ``b``'s tokens lie contiguously in slots ``[0, lengths[b])`` in sequence order, so the token in
  slot ``s`` has rotary position ``s`` and a query at position ``p`` attends to slots ``<= p``. Slots at
  or beyond ``lengths[b]`` hold stale values that nothing reads; rolling a row back
  (:meth:`truncate`) therefore only lowers its length. The layer buffers are separate arrays (not one
  stacked array) so that an append updates each in place without slicing.

  The keys are stored with the slots last (transposed against the values): the attention scores ``q k^T`` are
  then a plain ``[G*T, D] x [D, S]`` matmul per (row, KV head), which XLA:CPU runs 1.7-2.8x faster at batch
  8-32 than contracting ``[S, D]`` keys on ``D`` (module docstring).

  Attributes:
    keys: ``L`` arrays ``[B, K, D, S]`` of rotated keys.
    values: ``L`` arrays ``[B, K, S, D]``.
    lengths: ``[B]`` int32, valid slots per row (``0 <= lengths <= S``).
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  lengths: jax.Array

  @property
  def num_slots(self) -> int:
    """``S``, the capacity of every row."""
    return self.values[0].shape[2]

  def truncate(self, lengths: jax.Array) -> "KVCache":
    """Rolls every row back to ``min(lengths, self.lengths)`` valid slots (``lengths [B]`` int).

    Pure and O(1): the buffers are untouched, the slots beyond the new lengths simply stop being read
    and are overwritten by the next append. Speculative decoding appends ``k`` drafted tokens, then
    keeps the accepted ones with ``cache.truncate(old_lengths + num_accepted)``. Never lengthens a row.
    """
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), self.lengths.shape)
    return self._replace(lengths=jnp.minimum(lengths, self.lengths))

  def take(self, rows: jax.Array) -> "KVCache":
    """The cache whose row ``i`` is row ``rows[i]`` of this one (``rows [B']`` int in ``[0, B)``, any order,
    repeats allowed): one ``jnp.take`` along the batch of every buffer and of the lengths.

    Prefix sharing: prefill the ``P`` distinct prompts once and take, for each of the ``B'`` rows to
    sample, the row of its prompt (``lemon_rl.sampling.generate`` does this when prompts repeat).
    """
    rows = jnp.asarray(rows, jnp.int32)
    pick = lambda x: jnp.take(x, rows, axis=0, mode="clip")
    return KVCache(tuple(map(pick, self.keys)), tuple(map(pick, self.values)), pick(self.lengths))

  def grow(self, num_slots: int) -> "KVCache":
    """The same cache with capacity ``num_slots >= S``: every buffer padded with empty (zero) slots.

    Lets a decode loop attend over (and read) only the slots it can have filled so far, and continue in
    a larger cache later (``lemon_rl.sampling.generate``); the rows, lengths and valid slots are unchanged.
    """
    if num_slots < self.num_slots:
      raise ValueError(f"cannot grow a cache of {self.num_slots} slots to {num_slots}")
    return KVCache(tuple(pad_slots(x, num_slots, 3) for x in self.keys),
                   tuple(pad_slots(x, num_slots, 2) for x in self.values), self.lengths)


def write_rows(buffer: jax.Array, new: jax.Array, start: jax.Array, slot_axis: int = 2) -> jax.Array:
  """Writes ``new`` into slots ``[start[b], start[b] + k)`` of every row ``b`` along ``slot_axis``.

  ``buffer [B, K, S, D]`` with ``new [B, K, k, D]`` (values, ``slot_axis = 2``) or ``buffer [B, K, D, S]``
  with ``new [B, K, D, k]`` (keys, ``slot_axis = 3``). One scatter whose windows are whole rows (as ``vmap``
  of ``dynamic_update_slice`` lowers to) but in ``FILL_OR_DROP`` mode: a row whose window does not fit in
  ``S`` is left untouched instead of being shifted back onto its valid slots.
  """
  b = buffer.shape[0]
  indices = jnp.stack([jnp.arange(b, dtype=jnp.int32), start.astype(jnp.int32)], axis=-1)
  dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3), inserted_window_dims=(0,),
                                         scatter_dims_to_operand_dims=(0, slot_axis))
  return jax.lax.scatter(buffer, indices, new.astype(buffer.dtype), dims, indices_are_sorted=True,
                         unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def pad_slots(x: jax.Array, num_slots: int, slot_axis: int) -> jax.Array:
  """``x`` zero-padded at the end of ``slot_axis`` to ``num_slots`` entries."""
  widths = [(0, 0)] * x.ndim
  widths[slot_axis] = (0, num_slots - x.shape[slot_axis])
  return jnp.pad(x, widths)


def cache_keys(keys: jax.Array, num_slots: int) -> jax.Array:
  """Full-sequence keys ``[B, K, T, D]`` -> a cache buffer ``[B, K, D, num_slots]`` (slots ``>= T`` zero)."""
  return pad_slots(keys.transpose(0, 1, 3, 2), num_slots, 3)


def cache_values(values: jax.Array, num_slots: int) -> jax.Array:
  """Full-sequence values ``[B, K, T, D]`` -> a cache buffer ``[B, K, num_slots, D]`` (slots ``>= T`` zero)."""
  return pad_slots(values, num_slots, 2)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """``x / sqrt(mean(x^2) + eps) * scale``, computed in float32 (as Hugging Face does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (scale.astype(jnp.float32) * normed).astype(x.dtype) if x.dtype != jnp.float32 else scale * normed


def rope_inverse_frequencies(cfg: ModelConfig) -> jax.Array:
  """``theta^(-2i/D)`` for ``i < D/2``, with Llama-3 frequency scaling when configured."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  scaling = dict(cfg.rope_scaling or ())
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind in (None, "default"):
    return inv
  if kind != "llama3":
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv
  smooth = (old_len / wavelen - low) / (high - low)
  scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
  mid = (1 - smooth) * inv / factor + smooth * inv
  is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
  return jnp.where(is_mid, mid, scaled)


def rope_tables(positions: jax.Array, inv_freq: jax.Array,
                num_positions: int | None = None) -> tuple[jax.Array, jax.Array]:
  """``(cos, sin)`` of the rotary angles ``positions * inv_freq``, each ``[B, T, D/2]`` float32.

  Computed once per forward and shared by every layer (and by the backward pass). With ``num_positions``
  (every position below it), ``cos``/``sin`` are evaluated on the ``[num_positions, D/2]`` table of
  positions ``0 .. num_positions - 1`` and looked up: XLA fuses the tables into their consumers, so computed
  directly they would be re-evaluated for every element of every ``[B, T, N, D]`` query, key and gradient
  tensor (about 6% of a training step on XLA:CPU), while a lookup is a load. The values are the same.
  """
  if num_positions is not None:
    cos, sin = rope_tables(jnp.arange(num_positions), inv_freq)
    return jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotary embedding (half-split convention) from precomputed tables.

  ``x [B, T, N, D]``, ``cos, sin [B, T, D/2]``.
  """
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, half-split convention. ``x [B, T, N, D]``, ``positions [B, T]``."""
  return rotate(x, *rope_tables(positions, inv_freq))


def grouped_attention(q: jax.Array, keys: jax.Array, values: jax.Array, allowed: jax.Array) -> jax.Array:
  """Grouped-query attention as one batched matmul per (batch, KV head).

  Args:
    q: ``[B, T, H, D]`` rotated queries.
    keys: ``[B, K, D, S]`` rotated keys, slots last (the cache layout, :class:`KVCache`).
    values: ``[B, K, S, D]``.
    allowed: ``[B, T, S]`` boolean, query ``t`` may attend to key ``s``.

  Returns:
    ``[B, T, H*D]``, ``softmax(q k^T / sqrt(D) + mask) v`` with query head ``h = k*G + g`` reading KV head ``k``.
  """
  b, t, h, d = q.shape
  k_heads = keys.shape[1]
  g = h // k_heads
  qg = q.reshape(b, t, k_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, k_heads, g * t, d)
  scores = jnp.einsum("bkqd,bkds->bkqs", qg, keys, preferred_element_type=jnp.float32)
  scores = scores.reshape(b, k_heads, g, t, -1) * (1.0 / math.sqrt(d))
  scores = jnp.where(allowed[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype).reshape(b, k_heads, g * t, -1)
  out = jnp.einsum("bkqs,bksd->bkqd", probs, values)
  return out.reshape(b, k_heads, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)


def _softmax_parts(qg: jax.Array, keys: jax.Array, values: jax.Array, allowed: jax.Array):
  """Forward of :func:`_attention_core`; also returns the unnormalised weights and their row sums.

  ``qg [B, K, G*T, D]`` (already scaled by ``1/sqrt(D)``), ``keys, values [B, K, S, D]``,
  ``allowed [B, 1, 1, T, S]`` bool. Returns ``out [B, K, G*T, D]``, ``e = exp(s - max s)`` with masked
  entries 0 (``[B, K, G*T, S]``, float32) and ``l = sum_s e`` (``[B, K, G*T, 1]``).
  """
  b, k_heads, gt, _ = qg.shape
  t = allowed.shape[-2]
  scores = jnp.einsum("bkqd,bksd->bkqs", qg, keys, preferred_element_type=jnp.float32)
  scores = jnp.where(allowed, scores.reshape(b, k_heads, gt // t, t, -1), _MASK_VALUE)
  e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)).reshape(b, k_heads, gt, -1)
  l = jnp.sum(e, axis=-1, keepdims=True)
  out = jnp.einsum("bkqs,bksd->bkqd", e.astype(values.dtype), values, preferred_element_type=jnp.float32)
  return (out / l).astype(values.dtype), e, l


@jax.custom_vjp
def _attention_core(qg: jax.Array, keys: jax.Array, values: jax.Array, allowed: jax.Array) -> jax.Array:
  """``softmax(qg k^T + mask) v`` per (batch, KV head); see :func:`_softmax_parts` for shapes.

  A custom VJP so that the backward pass keeps only the unnormalised weights ``e`` and the row sums
  ``l`` (the probabilities ``e / l`` are never materialised): with ``do' = do / l`` and
  ``delta = rowsum(do' * out)``, ``ds = e * (do' v^T - delta)`` (0 where masked), ``dq = ds k``,
  ``dk = ds^T q``, ``dv = e^T do'``. Measured on XLA:CPU this reads and writes the ``[.., T, S]`` tensors
  fewer times than autodiff of ``jax.nn.softmax`` (about 20% less time for the attention).
  """
  return _softmax_parts(qg, keys, values, allowed)[0]


def _attention_core_fwd(qg, keys, values, allowed):
  out, e, l = _softmax_parts(qg, keys, values, allowed)
  return out, (qg, keys, values, allowed, out, e, l)


def _attention_core_bwd(residuals, d_out):
  qg, keys, values, allowed, out, e, l = residuals
  b, k_heads, gt, s = e.shape
  t = allowed.shape[-2]
  d_out = d_out.astype(jnp.float32) / l
  d_values = jnp.einsum("bkqs,bkqd->bksd", e.astype(values.dtype), d_out.astype(values.dtype),
                        preferred_element_type=jnp.float32)
  d_e = jnp.einsum("bkqd,bksd->bkqs", d_out.astype(values.dtype), values, preferred_element_type=jnp.float32)
  delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1, keepdims=True)
  d_scores = (e * (d_e - delta)).reshape(b, k_heads, gt // t, t, s)
  d_scores = jnp.where(allowed, d_scores, 0.0).reshape(b, k_heads, gt, s).astype(qg.dtype)
  d_q = jnp.einsum("bkqs,bksd->bkqd", d_scores, keys, preferred_element_type=jnp.float32)
  d_keys = jnp.einsum("bkqs,bkqd->bksd", d_scores, qg, preferred_element_type=jnp.float32)
  return (d_q.astype(qg.dtype), d_keys.astype(keys.dtype), d_values.astype(values.dtype), None)


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


def causal_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                     block_size: int = 64, max_blocks: int = 4) -> jax.Array:
  """Causal grouped-query self-attention over a whole sequence, skipping blocks above the diagonal.

  The queries are cut into ``n = min(max_blocks, T // block_size)`` blocks (at least 1); block ``i``
  (queries ``[t_i, t_{i+1})``) attends to keys ``[0, t_{i+1})`` only, which saves about ``(n-1)/(2n)`` of
  the attention FLOPs and memory traffic. Each block is one batched matmul per (batch, KV head) with the
  memory-lean backward of :func:`_attention_core`.

  Args:
    q: ``[B, T, H, D]`` rotated queries.
    keys: ``[B, K, T, D]`` rotated keys (key ``s`` is sequence position ``s``).
    values: ``[B, K, T, D]``.
    mask: ``[B, T]`` bool, 1 on real tokens; query ``t`` attends to key ``s`` iff ``s <= t`` and
      ``mask[s]``.
    block_size: smallest query block.
    max_blocks: most query blocks (each adds a few small ops).

  Returns:
    ``[B, T, H*D]``, equal to :func:`grouped_attention` with ``allowed = tril & mask[:, None, :]`` on
    every row with at least one allowed key. Rows with none (padding queries before the first real token)
    get a finite average of values, like there, and no gradient reaches the scores from them.
  """
  b, t, h, d = q.shape
  k_heads = keys.shape[1]
  g = h // k_heads
  n = max(1, min(max_blocks, t // block_size))
  bounds = [round(i * t / n) for i in range(n + 1)]
  q = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
  causal = jnp.tril(jnp.ones((t, t), bool))
  outs = []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    qg = q[:, lo:hi].reshape(b, hi - lo, k_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, k_heads, -1, d)
    allowed = (causal[None, lo:hi, :hi] & mask[:, None, :hi])[:, None, None]
    out = _attention_core(qg, keys[:, :, :hi], values[:, :, :hi], allowed)
    outs.append(out.reshape(b, k_heads, g, hi - lo, d).transpose(0, 3, 1, 2, 4).reshape(b, hi - lo, h * d))
  return outs[0] if n == 1 else jnp.concatenate(outs, axis=1)


_QKV_AXES = ("kv_heads", None, "head_dim")  # Logical axes of the fused QKV's [K, G + 2, D] columns.


def group_qkv(w, cfg: ModelConfig):
  """Fused Q/K/V columns ``[..., (H + 2K) * D]`` in the order ``q | k | v`` (Hugging Face's projections
  concatenated) -> the grouped layout ``[..., K, G + 2, D]``: for each KV head ``k``, its ``G`` query heads
  ``k * G ... k * G + G - 1`` (slots ``0 .. G-1``), its key (slot ``G``) and its value (slot ``G + 1``).

  The weight is sharded along ``K`` (logical ``kv_heads``), so a tensor-parallel split hands each device
  whole KV groups (their queries, key and value) and never a slice that crosses the q | k | v boundary; the
  output projection's rows (query heads, KV-group-major) split the same way. NumPy or JAX arrays.
  """
  xp = np if isinstance(w, np.ndarray) else jnp
  h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  *lead, width = w.shape
  if width != (h + 2 * kv) * d:
    raise ValueError(f"fused QKV width {width} != (H + 2K) D = {(h + 2 * kv) * d}")
  w = w.reshape(*lead, h + 2 * kv, d)
  q = w[..., :h, :].reshape(*lead, kv, h // kv, d)
  k, v = w[..., h:h + kv, None, :], w[..., h + kv:, None, :]
  return xp.concatenate([q, k, v], axis=-2)


def ungroup_qkv(w, cfg: ModelConfig):
  """The inverse of :func:`group_qkv`: ``[..., K, G + 2, D]`` -> ``[..., (H + 2K) * D]`` (``q | k | v``)."""
  xp = np if isinstance(w, np.ndarray) else jnp
  *lead, kv, slots, d = w.shape
  g = slots - 2
  q = w[..., :g, :].reshape(*lead, kv * g * d)
  return xp.concatenate([q, w[..., g, :].reshape(*lead, kv * d), w[..., g + 1, :].reshape(*lead, kv * d)], axis=-1)


def _grouped(param: nnx.Param, cfg: ModelConfig, logical_axes) -> nnx.Param:
  return nnx.Param(group_qkv(param[...], cfg), logical_axes=logical_axes)


class Block(nnx.Module):
  """Pre-norm decoder block: attention + SwiGLU MLP, each with a residual connection."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    e, d, f = cfg.hidden_size, cfg.head_dim, cfg.mlp_dim
    qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    self.attn_norm = init_param(rngs, (e,), cfg, ("embed",), init="ones")
    # Fused layouts split on whole KV groups / MLP columns (see `group_qkv`); drawn in the concatenated
    # layout and rearranged, so a seed gives the same function as the former [q | k | v], [gate | up] ones.
    self.qkv = _grouped(init_param(rngs, (e, qkv_width), cfg, None), cfg, ("embed", *_QKV_AXES))
    self.qkv_bias = (_grouped(init_param(rngs, (qkv_width,), cfg, None, init="zeros"), cfg, _QKV_AXES)
                     if cfg.qkv_bias else None)
    out = init_param(rngs, (cfg.num_heads * d, e), cfg, None)[...]  # [H, D, E]: split on whole query heads.
    self.out = nnx.Param(out.reshape(cfg.num_heads, d, e), logical_axes=("heads", "head_dim", "embed"))
    self.mlp_norm = init_param(rngs, (e,), cfg, ("embed",), init="ones")
    gate_up = init_param(rngs, (e, 2 * f), cfg, None)[...].reshape(e, 2, f)  # [gate | up] -> [E, F, 2]
    self.gate_up = nnx.Param(gate_up.transpose(0, 2, 1), logical_axes=("embed", "mlp", None))
    self.down = init_param(rngs, (f, e), cfg, ("mlp", "embed"))

  def project_qkv(self, x2: jax.Array, batch: int, rope: tuple[jax.Array, jax.Array]):
    """``x2 [B*T, E]`` -> rotated ``q [B, T, H, D]``, rotated ``k [B, T, K, D]``, ``v [B, T, K, D]``.

    ``rope`` is ``(cos, sin)`` from :func:`rope_tables`, each ``[B, T, D/2]``.
    """
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    h = rms_norm(x2, self.attn_norm[...].astype(dt), cfg.rms_norm_eps)
    # One 2-D matmul: merging [K, G + 2, D] keeps a split of the (major) KV-head axis.
    w = self.qkv[...]
    qkv = h @ w.reshape(w.shape[0], -1).astype(dt)
    if self.qkv_bias is not None:
      qkv = qkv + self.qkv_bias[...].reshape(-1).astype(dt)
    qkv = qkv.reshape(batch, -1, *w.shape[1:])  # [B, T, K, G + 2, D]
    g = cfg.num_heads // cfg.num_kv_heads
    q = qkv[:, :, :, :g].reshape(batch, -1, cfg.num_heads, cfg.head_dim)  # head k * G + j: KV head k's j-th.
    k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    q = constrain(rotate(q, *rope), ("batch", "seq", "heads", "head_dim"))
    k = constrain(rotate(k, *rope), ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, constrain(v, ("batch", "seq", "kv_heads", "head_dim"))

  def finish(self, x2: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection + residual, then the SwiGLU MLP + residual. ``x2, attn`` are 2-D."""
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    w = self.out[...]
    x2 = x2 + attn @ w.reshape(-1, w.shape[-1]).astype(dt)
    h = rms_norm(x2, self.mlp_norm[...].astype(dt), cfg.rms_norm_eps)
    w = self.gate_up[...]  # [E, F, 2]: column f's gate and up side by side (a split of F keeps both).
    gate_up = (h @ w.reshape(w.shape[0], -1).astype(dt)).reshape(h.shape[0], -1, 2)
    x2 = x2 + (jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]) @ self.down[...].astype(dt)
    return constrain(x2, ("batch", "embed"))

  def __call__(self, x2, batch, rope, mask):
    """Full-sequence causal block: ``x2 [B*T, E]``, ``rope`` tables, ``mask [B, T]`` bool."""
    q, k, v = self.project_qkv(x2, batch, rope)
    attn = causal_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
    return self.finish(x2, attn.reshape(x2.shape[0], -1))


class Transformer(nnx.Module):
  """Decoder-only language model; ``model(input_ids, attention_mask)`` returns logits ``[B, T, V]``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e, v = cfg.hidden_size, cfg.vocab_size
    self.embed = init_param(rngs, (v, e), cfg, ("vocab", "embed"))
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = init_param(rngs, (e,), cfg, ("embed",), init="ones")
    self.lm_head = None if cfg.tie_embeddings else init_param(rngs, (e, v), cfg, ("embed", "vocab"))
    self.value_head = init_param(rngs, (e, 1), cfg, ("embed", None), init="zeros") if cfg.value_head else None

  # -- pieces shared by the full-sequence and the cached paths ------------------------------------------

  def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
    """``[B, T]`` int -> ``[B*T, E]``."""
    x = jnp.take(self.embed[...], input_ids.reshape(-1), axis=0).astype(self.cfg.jnp_dtype)
    return constrain(x, ("batch", "embed"))

  def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
    """Final hidden ``[..., E]`` (already normed) -> float32 logits ``[..., V]``."""
    dt = self.cfg.jnp_dtype
    if self.lm_head is not None:
      return jnp.dot(hidden, self.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
    # Tied: contract the embedding's own axis. Written as ``hidden @ embed.T``, XLA:CPU fused the transpose
    # and the final norm into a loop over the few rows of a decode step (51 us for the bench model's 0.5 MB
    # table at batch 1, where its other matmuls read 2 MB in 70-77 us); as this einsum ``generate`` decoded
    # 1.01-1.06x faster at batch 1, 8 and 32 (bench and stdlib-target shapes, same tokens; the training step's
    # gradients were bitwise equal).
    return jnp.einsum("...e,ve->...v", hidden, self.embed[...].astype(dt), preferred_element_type=jnp.float32)

  def value_from_hidden(self, hidden: jax.Array) -> jax.Array:
    """Final hidden ``[..., E]`` -> scalar value ``[...]`` (requires ``cfg.value_head``)."""
    if self.value_head is None:
      raise ValueError("this model has no value head; build it with ModelConfig(value_head=True)")
    return jnp.dot(hidden, self.value_head[...].astype(hidden.dtype),
                   preferred_element_type=jnp.float32)[..., 0]

  # -- full-sequence forward ----------------------------------------------------------------------------

  def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                    positions: jax.Array | None = None, feature_layers: tuple[int, ...] = ()):
    """Final-norm hidden states ``[B, T, E]``.

    Args:
      input_ids: ``[B, T]`` int token ids.
      attention_mask: ``[B, T]`` 1 on real tokens, 0 on padding (left or right). ``None`` = all real.
      positions: ``[B, T]`` rotary positions; default ``cumsum(mask) - 1`` so left padding is handled.
      feature_layers: block indices whose outputs to return too (see :func:`layer_features`).

    Returns:
      ``hidden``, or ``(hidden, features [B, T, n*E])`` when ``feature_layers`` is not empty.
    """
    b, t = input_ids.shape
    mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
    num_positions = None  # Positions given by the caller may be t or more.
    if positions is None:
      positions, num_positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0), t
    rope = rope_tables(positions, rope_inverse_frequencies(self.cfg), num_positions)
    x2 = self.embed_tokens(input_ids)

    def run_block(block, x2):
      return block(x2, b, rope, mask)

    if self.cfg.remat:  # Rematerialised under the config's named jax.checkpoint policy (`REMAT_POLICIES`).
      run_block = nnx.remat(run_block, policy=self.cfg.checkpoint_policy)
    outputs = []
    for block in self.blocks:
      x2 = run_block(block, x2)
      outputs.append(x2)
    x2 = rms_norm(x2, self.final_norm[...].astype(x2.dtype), self.cfg.rms_norm_eps)
    if feature_layers:
      return x2.reshape(b, t, -1), layer_features(outputs, feature_layers, b)
    return x2.reshape(b, t, -1)

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """Logits ``[B, T, V]`` (float32) for next-token prediction at every position."""
    hidden = self.hidden_states(input_ids, attention_mask, positions)
    b, t, e = hidden.shape
    logits = self.logits_from_hidden(hidden.reshape(b * t, e))
    return constrain(logits, ("batch", "vocab")).reshape(b, t, -1)

  # -- cached generation ----------------------------------------------------------------------------------
  #
  # One layout for every cached use (sampling, speculative verification, multi-turn episodes, shared
  # prompts): each row's tokens are contiguous from slot 0 (left-aligned), ``cache.lengths`` says how many
  # are valid, :meth:`extend` appends ``k`` tokens per row, ``KVCache.truncate`` rolls rows back and
  # ``KVCache.take`` shares a prefilled prefix. Methods return final-norm hidden states; apply
  # :meth:`logits_from_hidden` (or :meth:`value_from_hidden`) to them.

  def init_cache(self, batch: int, num_slots: int) -> KVCache:
    """An empty cache (every length 0) of ``num_slots`` slots per row; every buffer a separate array (each
    can be donated)."""
    cfg = self.cfg
    keys = tuple(jnp.zeros((batch, cfg.num_kv_heads, cfg.head_dim, num_slots), cfg.jnp_dtype)
                 for _ in range(cfg.num_layers))
    values = tuple(jnp.zeros((batch, cfg.num_kv_heads, num_slots, cfg.head_dim), cfg.jnp_dtype)
                   for _ in range(cfg.num_layers))
    return KVCache(keys, values, jnp.zeros((batch,), jnp.int32))

  def prefill(self, input_ids: jax.Array, attention_mask: jax.Array, num_slots: int,
              feature_layers: tuple[int, ...] = ()):
    """Runs left-aligned (right-padded) prompts and writes them into cache slots ``[0, length)``.

    Equal (up to float rounding) to ``extend(input_ids, init_cache(B, num_slots), num_new=lengths)`` but
    computed with the full-sequence causal attention (no attention to the empty slots beyond ``P``).

    Args:
      input_ids: ``[B, P]`` prompts, each left-aligned: row ``b``'s tokens at ``[0, lengths[b])`` and
        padding after them.
      attention_mask: ``[B, P]``, 1 on a prefix of each row (``lengths = attention_mask.sum(-1)``, at
        least 1); a mask with holes or left padding is not supported (positions would be wrong).
      num_slots: cache capacity ``S >= P`` (prompt + every token to be appended).
      feature_layers: block indices whose outputs to return too (see :func:`layer_features`).

    Returns:
      ``(last_hidden [B, E], cache)``: the final-norm hidden state of each row's last real token, and
      the cache with ``lengths`` = the prompt lengths; with ``feature_layers``, ``(last_hidden, cache,
      features [B, P, n*E])`` (every prompt position).
    """
    b, p = input_ids.shape
    if num_slots < p:
      raise ValueError(f"num_slots ({num_slots}) must be >= the prompt length ({p})")
    mask = attention_mask.astype(bool)
    lengths = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    rope = rope_tables(positions, rope_inverse_frequencies(self.cfg), num_positions=p)
    x2 = self.embed_tokens(input_ids)
    keys, values, outputs = [], [], []
    for block in self.blocks:
      q, k, v = block.project_qkv(x2, b, rope)
      k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
      x2 = block.finish(x2, causal_attention(q, k, v, mask).reshape(b * p, -1))
      keys.append(cache_keys(k, num_slots))
      values.append(cache_values(v, num_slots))
      outputs.append(x2)
    last_index = jnp.maximum(lengths - 1, 0)[:, None, None]
    last = jnp.take_along_axis(x2.reshape(b, p, -1), last_index, axis=1)[:, 0]
    last = rms_norm(last, self.final_norm[...].astype(last.dtype), self.cfg.rms_norm_eps)
    cache = KVCache(tuple(keys), tuple(values), lengths)
    if feature_layers:
      return last, cache, layer_features(outputs, feature_layers, b)
    return last, cache

  def extend(self, tokens: jax.Array, cache: KVCache, num_new: jax.Array | None = None,
             feature_layers: tuple[int, ...] = ()):
    """Appends ``k`` tokens to every row in one forward: plain decoding (``k = 1``), speculative
    verification of ``k`` drafted tokens, or a new turn of an episode.

    Row ``b``'s tokens go to slots ``[lengths[b], lengths[b] + k)`` with rotary positions equal to their
    slots; token ``j`` attends to the row's valid prefix and to new tokens ``0..j`` (causal). Size the
    cache so that ``lengths + k <= S``: a row without room for all ``k`` tokens is left unchanged
    (nothing written, length kept; its hidden states are meaningless) rather than having its valid
    slots overwritten.

    Args:
      tokens: ``[B, k]`` int token ids.
      cache: the cache to extend (donate it under ``jit`` so the buffers are updated in place).
      num_new: optional ``[B]`` int in ``[0, k]``: how many of the ``k`` tokens of each row are real.
        Only the first ``num_new[b]`` count (``lengths += num_new``); the others are still computed and
        written but lie beyond the new length, exactly as if they had been truncated. Default ``k``.
      feature_layers: block indices whose outputs to return too (see :func:`layer_features`).

    Returns:
      ``(hidden [B, k, E], cache)``: final-norm hidden states of the ``k`` positions (those past
      ``num_new`` are finite but meaningless) and the cache with the new lengths; with ``feature_layers``,
      ``(hidden, cache, features [B, k, n*E])``.
    """
    b, k = tokens.shape
    s = cache.num_slots
    start = cache.lengths.astype(jnp.int32)
    positions = start[:, None] + jnp.arange(k, dtype=jnp.int32)  # [B, k]: slots = rotary positions
    rope = rope_tables(positions, rope_inverse_frequencies(self.cfg))
    allowed = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]  # [B, k, S]
    x2 = self.embed_tokens(tokens)
    keys, values, outputs = [], [], []
    for block, layer_keys, layer_values in zip(self.blocks, cache.keys, cache.values):
      q, new_k, new_v = block.project_qkv(x2, b, rope)  # new_k, new_v [B, k, K, D]
      layer_keys = write_rows(layer_keys, new_k.transpose(0, 2, 3, 1), start, slot_axis=3)
      layer_values = write_rows(layer_values, new_v.transpose(0, 2, 1, 3), start)
      x2 = block.finish(x2, grouped_attention(q, layer_keys, layer_values, allowed).reshape(b * k, -1))
      keys.append(layer_keys)
      values.append(layer_values)
      outputs.append(x2)
    hidden = rms_norm(x2, self.final_norm[...].astype(x2.dtype), self.cfg.rms_norm_eps).reshape(b, k, -1)
    added = k if num_new is None else jnp.clip(jnp.asarray(num_new, jnp.int32), 0, k)
    lengths = jnp.where(start + k <= s, start + added, start)  # a row without room was not written
    cache = KVCache(tuple(keys), tuple(values), lengths)
    if feature_layers:
      return hidden, cache, layer_features(outputs, feature_layers, b)
    return hidden, cache


def layer_features(block_outputs: list[jax.Array], feature_layers: tuple[int, ...], batch: int) -> jax.Array:
  """The residual stream after the blocks ``feature_layers`` (before any norm), concatenated.

  ``block_outputs[i]`` is block ``i``'s output ``[B*T, E]``; returns ``[B, T, n*E]`` with ``n =
  len(feature_layers)``, block ``feature_layers[j]``'s output in columns ``[j*E, (j+1)*E)``. These are the
  low / middle / high features an EAGLE-3 drafter fuses (``lemon_rl.models.drafter``).
  """
  num_layers = len(block_outputs)
  for i in feature_layers:
    if not 0 <= i < num_layers:
      raise ValueError(f"feature layer {i} is outside [0, {num_layers}) (blocks of this model)")
  return jnp.concatenate([block_outputs[i].reshape(batch, -1, block_outputs[i].shape[-1])
                          for i in feature_layers], axis=-1)


def param_logical_axes(model: Transformer) -> Any:
  """A pytree like ``nnx.state(model, nnx.Param)`` whose leaves are logical-axis tuples."""
  state = nnx.state(model, nnx.Param)
  return jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


def shard_model(model: Transformer, mesh) -> Transformer:
  """Places the model's parameters on ``mesh`` by their logical axes and the config's rules (in place)."""
  params = nnx.state(model, nnx.Param)
  shardings = tree_shardings(param_logical_axes(model), params, mesh, model.cfg.axis_rules)
  nnx.update(model, jax.device_put(params, shardings))
  return model
