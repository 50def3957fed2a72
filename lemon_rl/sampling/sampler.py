"""A jitted sampler: prefill, then a decode loop over a preallocated, donated KV cache.

``generate(model, prompts, max_new_tokens, rng, ...)`` takes prompts as lists of token ids of different
lengths, right-pads them (each prompt left-aligned at slot 0, as the per-row-length cache of
:class:`~lemon_rl.models.transformer.KVCache` wants) into a length bucket, and returns completion ids, the
log-prob of every sampled token under the distribution actually sampled from
(:mod:`lemon_rl.sampling.distribution`: temperature, top-k and top-p applied), a completion mask (EOS
included, padding excluded) and a finish reason per row.

Shared prompt prefixes: GRPO asks for ``G`` completions of each prompt (the prompt repeated ``G`` times).
When some prompts repeat, ``generate`` prefills each distinct prompt once (``P`` rows instead of ``B``) and
gives every row the cache and last-token logits of its prompt (:meth:`KVCache.take` with an index ``[B]``,
inside the same jitted prefill): the prefill costs ``P / B`` of prefilling every row (``P`` padded to a power
of two, so that callers whose number of distinct prompts varies compile few prefills), and the decode loop
is unchanged. Rows then see the same keys, values and logits as with a prefill of their own (up to float32
rounding of a matmul run at another batch size), so a key gives the same tokens.

The decode loop is a ``jax.lax.while_loop`` inside a jitted call (each step one ``Transformer.extend`` of
one token per row). A cache sized for the whole completion would make every step attend over (and read)
all ``prompt bucket + max_new_tokens`` slots, most of them still empty; at batch 32 the cache is larger than
the weights and that read is most of a step. So the loop runs in at most :data:`MAX_DECODE_SEGMENTS`
segments of at least :data:`MIN_SEGMENT_STEPS` steps (:func:`decode_capacities`): each with a cache just
large enough for its last step, grown with empty slots between segments (:meth:`KVCache.grow`). The tokens
and the random draws are those of one loop over the full cache (the extra slots are masked; logits agree up
to the float32 rounding of a softmax over more masked slots). Compiled functions are cached per (model
graph, batch, prompt bucket, cache slots, max new tokens, sampling mode, number of EOS ids): one decode loop
per segment capacity, and the shared prefill per (distinct prompts ``P``, padded to a power of two, batch,
prompt bucket, slots). A one-row batch on CPU gets its own compilation options (:data:`ONE_ROW_CPU_OPTIONS`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lemon_rl.models.sharding import constrain
from lemon_rl.models.transformer import KVCache, Transformer
from lemon_rl.sampling import distribution
from lemon_rl.training import distributed


class SampleOutput(NamedTuple):
  """Completions of a batch of prompts.

  Attributes:
    tokens: ``[B, N]`` int32 completion ids, ``pad_id`` after the end of each row.
    log_probs: ``[B, N]`` float32 log-prob of each sampled token under the sampling distribution
      (0 where the mask is 0). For greedy decoding it is the temperature-1 log-prob of the argmax.
    mask: ``[B, N]`` int32, 1 on generated tokens (EOS included), 0 on padding.
    lengths: ``[B]`` int32 number of generated tokens.
    finish_reasons: ``B`` strings, ``"eos"`` or ``"length"``.
  """

  tokens: np.ndarray
  log_probs: np.ndarray
  mask: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[str]


def prompt_bucket(length: int, minimum: int = 16) -> int:
  """The padded prompt length: the next power of two ``>= length`` (at least ``minimum``)."""
  return max(minimum, 1 << max(0, int(length) - 1).bit_length())


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """``[B, length]`` ids and mask with each prompt right-aligned (padding first).

  The layout of the trainers' full-sequence batches; the sampler uses :func:`right_pad`.
  """
  ids = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), np.int32)
  for i, p in enumerate(prompts):
    if len(p):
      ids[i, length - len(p):] = p
      mask[i, length - len(p):] = 1
  return ids, mask


def right_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """``[B, length]`` ids and mask with each prompt left-aligned (padding after it), for ``prefill``."""
  ids = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
    mask[i, :len(p)] = 1
  return ids, mask


def eos_array(eos_ids: int | Sequence[int] | None) -> np.ndarray:
  """``eos_ids`` as a non-empty int32 array (``[-1]``, which matches no token, for ``None`` / empty).

  A negative id never matches a sampled token, so ``(-1,)`` also means "never stop early".
  """
  if eos_ids is None:
    ids = []
  elif isinstance(eos_ids, (int, np.integer)):
    ids = [int(eos_ids)]
  else:
    ids = [int(i) for i in eos_ids]
  return np.asarray(ids or [-1], np.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots"))
def _prefill(graphdef, state, ids, mask, num_slots):
  model = nnx.merge(graphdef, state)
  hidden, cache = model.prefill(ids, mask, num_slots)
  return model.logits_from_hidden(hidden), cache


def distinct_prompts(prompts: Sequence[Sequence[int]], multiple: int = 1) -> tuple[list[list[int]], np.ndarray]:
  """The distinct prompts in order of first appearance and, for every row, the index of its prompt.

  Returns ``(distinct, rows)`` with ``prompts[i] == distinct[rows[i]]`` (``rows [B]`` int32). ``distinct``
  is padded with copies of its first prompt (rows that no row reads) to a power of two, rounded up to a
  multiple of ``multiple``: calls whose number of distinct prompts differs within one bucket share one
  compiled prefill.
  """
  index: dict[tuple[int, ...], int] = {}
  rows = np.asarray([index.setdefault(tuple(int(t) for t in p), len(index)) for p in prompts], np.int32)
  distinct = [list(p) for p in index]
  size = 1 << (len(distinct) - 1).bit_length()  # A power of two,
  size += -size % multiple  # rounded up to the multiple.
  distinct += [distinct[0]] * (size - len(distinct))
  return distinct, rows


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots"))
def _prefill_shared(graphdef, state, ids, mask, rows, num_slots):
  """:func:`_prefill` of the ``P`` distinct prompts ``ids, mask [P, L]``, then row ``i`` of the batch gets
  prompt ``rows[i]``'s last-token logits and cache row: returns ``(logits [B, V], cache of B rows)``.

  The gathered rows are constrained to the batch sharding the decode loop uses (a no-op without
  :func:`lemon_rl.models.activation_sharding`).
  """
  model = nnx.merge(graphdef, state)
  hidden, cache = model.prefill(ids, mask, num_slots)
  logits = constrain(jnp.take(model.logits_from_hidden(hidden), rows, axis=0, mode="clip"),
                     ("batch", "vocab"))
  return logits, _constrain_cache(cache.take(rows))


def _constrain_cache(cache: KVCache) -> KVCache:
  """The cache's buffers constrained to the decode loop's sharding (batch, KV heads)."""
  keys = tuple(constrain(x, ("batch", "kv_heads", "head_dim", "seq")) for x in cache.keys)
  values = tuple(constrain(x, ("batch", "kv_heads", "seq", "head_dim")) for x in cache.values)
  return KVCache(keys, values, cache.lengths)


@functools.partial(jax.jit, static_argnames=("num_slots",))
def _grow(cache: KVCache, num_slots: int) -> KVCache:
  return _constrain_cache(cache.grow(num_slots))


MIN_SEGMENT_STEPS = 32  # Decode steps of a segment (the last may be shorter when max_new_tokens is).
MAX_DECODE_SEGMENTS = 4  # Compiled decode loops per generate shape.


def decode_capacities(prompt_len: int, max_new_tokens: int) -> list[int]:
  """The cache capacity of each decode segment (module docstring), ending at ``prompt_len + max_new_tokens``.

  Segment ``j`` runs decode steps ``[c_{j-1} - prompt_len, c_j - prompt_len)`` (``c_{-1} = prompt_len``):
  step ``i`` writes slot ``length + i <= prompt_len + i`` of a row, so ``c_j`` slots hold its last step.
  Segments are ``max(MIN_SEGMENT_STEPS, ceil(max_new_tokens / MAX_DECODE_SEGMENTS))`` steps long, e.g.
  ``(64, 128)`` -> ``[96, 128, 160, 192]``, ``(64, 16)`` -> ``[80]``.
  """
  steps = max(MIN_SEGMENT_STEPS, -(-max_new_tokens // MAX_DECODE_SEGMENTS))
  return [prompt_len + min(end, max_new_tokens) for end in range(steps, max_new_tokens + steps, steps)]


class _DecodeCarry(NamedTuple):
  """The decode loop's state, carried from one segment to the next (``B`` rows, ``N`` max new tokens)."""

  step: jax.Array  # int32, decode steps done
  logits: jax.Array  # [B, V] of each row's last token
  cache: KVCache
  tokens: jax.Array  # [B, N] int32, pad_id where not generated
  log_probs: jax.Array  # [B, N] float32
  done: jax.Array  # [B] bool, the row emitted an EOS


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def _start(logits, cache, pad_id, *, max_new_tokens) -> _DecodeCarry:
  """The carry before the first decode step (built under ``jit``, so it is laid out like the loop's)."""
  batch = logits.shape[0]
  return _DecodeCarry(jnp.int32(0), logits, cache, jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
                      jnp.zeros((batch, max_new_tokens), jnp.float32), jnp.zeros((batch,), bool))


def _decode_steps(graphdef, state, carry: _DecodeCarry, rng, stop, temperature, top_k, top_p, eos_ids, pad_id,
                  *, greedy, filtering, coupled=False) -> tuple[_DecodeCarry, jax.Array]:
  """Decode steps ``carry.step .. stop - 1`` (fewer when every row is done) on ``carry.cache``, which must
  hold ``stop`` more slots than the prompt bucket (:func:`decode_capacities`); returns ``(carry, rng)``.

  ``coupled``: token ``i`` of row ``b`` uses ``distribution.coupled_noise(rng, b, i)`` (``rng`` is then
  never split); otherwise one key per step is split from ``rng`` for the whole batch. The key is not
  donated (it may be the caller's).

  A row appends its tokens up to and including its EOS and then stops growing, so the cache holds exactly
  prompt + completion (``cache.lengths = prompt lengths + tokens generated``).
  """
  model = nnx.merge(graphdef, state)
  batch, vocab = carry.logits.shape
  row_ids = jnp.arange(batch, dtype=jnp.int32)
  if greedy:
    temperature, top_k, top_p = 0.0, 0, 1.0
  elif not filtering:
    top_k, top_p = 0, 1.0  # statically off: no sort in the loop

  def cond(loop):
    carry, _ = loop
    return (carry.step < stop) & ~jnp.all(carry.done)

  def body(loop):
    (i, logits, cache, out_tokens, out_logp, done), rng = loop
    if coupled and not greedy:
      noise = distribution.coupled_noise(rng, row_ids, jnp.full((batch, 1), i), vocab)[:, 0]
      token, logp = distribution.sample(logits, None, temperature, top_k, top_p, noise=noise)
    else:
      rng, key = jax.random.split(rng)
      token, logp = distribution.sample(logits, key, temperature, top_k, top_p)
    token = jnp.where(done, pad_id, token)
    out_tokens = out_tokens.at[:, i].set(token)
    out_logp = out_logp.at[:, i].set(jnp.where(done, 0.0, logp))
    hidden, cache = model.extend(token[:, None], cache, num_new=(~done).astype(jnp.int32))
    done = done | jnp.any(token[:, None] == eos_ids[None, :], axis=-1)
    return _DecodeCarry(i + 1, model.logits_from_hidden(hidden[:, 0]), cache, out_tokens, out_logp, done), rng

  return jax.lax.while_loop(cond, body, (carry, rng))


# XLA:CPU compiles a 1-row dot as its own generic matrix-vector loop and leaves YNNPACK to dots of several
# rows. Routing the 1-row dots through YNNPACK's dot fusions made a batch-1 decode step 1.12-1.30x faster on
# the Intel AVX-512 host (bench and stdlib-target shapes, BENCHMARKS.md) but batch-8 and batch-32 steps
# 11-14% slower, so only one-row batches on CPU are compiled with it.
ONE_ROW_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
_DECODE_STATICS = dict(static_argnames=("graphdef", "greedy", "filtering", "coupled"), donate_argnames=("carry",))
_decode = jax.jit(_decode_steps, **_DECODE_STATICS)
_decode_one_row = jax.jit(_decode_steps, **_DECODE_STATICS, compiler_options=ONE_ROW_CPU_OPTIONS)


@functools.cache
def _one_row_options_accepted() -> bool:
  """Whether this jaxlib knows :data:`ONE_ROW_CPU_OPTIONS` (experimental XLA options can disappear)."""
  try:
    jax.jit(lambda x: x @ x.T, compiler_options=ONE_ROW_CPU_OPTIONS).lower(jnp.ones((1, 2))).compile()
  except Exception:  # pylint: disable=broad-except  (XLA reports an unknown option as a runtime error)
    return False
  return True


def decode_compiler_options(batch: int) -> dict[str, str] | None:
  """The XLA options ``generate`` compiles its decode loop with for ``batch`` rows (see
  :data:`ONE_ROW_CPU_OPTIONS`); ``None`` is XLA's defaults."""
  one_row = batch == 1 and jax.default_backend() == "cpu" and _one_row_options_accepted()
  return ONE_ROW_CPU_OPTIONS if one_row else None


def _decode_for(batch: int):
  """The compiled decode loop for a batch of ``batch`` rows."""
  return _decode if decode_compiler_options(batch) is None else _decode_one_row


def generate(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, rng: jax.Array,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_ids: int | Sequence[int] | None = None, pad_id: int = 0,
             min_prompt_bucket: int = 16, share_prefixes: bool = True, coupled: bool = False) -> SampleOutput:
  """Samples completions for a batch of prompts of different lengths.

  Args:
    model: the decoder.
    prompts: ``B`` lists of token ids (at least one token each).
    max_new_tokens: ``N``, the length limit.
    rng: a PRNG key; the same key gives the same output.
    temperature: ``0`` means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the ``k`` most likely tokens (``0`` = off).
    top_p: nucleus sampling mass (``1.0`` = off).
    eos_ids: stop a row after it emits any of these ids (one id, several, e.g. ``tok.eos_ids``, or
      ``None`` = never stop early); its finish reason is then ``"eos"``.
    pad_id: id written after a row's end and used to pad prompts.
    min_prompt_bucket: smallest prompt bucket (prompts are padded to powers of two).
    share_prefixes: when some prompts repeat, prefill each distinct prompt once and share its cache
      across its rows (module docstring); ``False`` prefills every row (the reference path). Same tokens
      for the same key either way, log-probs equal up to float32 rounding.
    coupled: draw token ``i`` of row ``b`` (its index in ``prompts``) with the Gumbel noise
      :func:`lemon_rl.sampling.distribution.coupled_noise` ``(rng, b, i)``: the same distribution, and the
      same tokens as ``speculative_generate(..., coupled=True)`` for the same key with any drafter (up to
      float rounding of the logits), and as this call with other prompts in the other rows. ``False``
      (the default) splits one key per decode step for the whole batch.

  The sampling distribution and the reported log-probs are those of
  :func:`lemon_rl.sampling.distribution.sampling_log_probs` with the same ``temperature, top_k, top_p``.

  Multi-process (:mod:`lemon_rl.training.distributed`): each process passes its own prompts; they are rows of
  one global batch on the active mesh (the prompt bucket is the longest prompt of any process; a process's
  rows are padded with copies of its last prompt to a multiple of its batch slices) and each process gets
  back its own rows. With one process this is the plain single-batch call. Prompt sharing is then off
  (every row is prefilled): each process would find a different number of distinct prompts, and the shared
  prefill's shape must be the same on every process.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate needs at least one prompt and every prompt needs at least one token")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
    raise ValueError(f"invalid sampling parameters temperature={temperature}, top_k={top_k}, top_p={top_p}")
  eos = eos_array(eos_ids)
  num_prompts = len(prompts)
  multiple = distributed.row_multiple()
  prompt_len = prompt_bucket(distributed.global_max(max(len(p) for p in prompts)), min_prompt_bucket)
  capacities = decode_capacities(prompt_len, max_new_tokens)
  graphdef, state = nnx.split(model)
  greedy = temperature == 0
  distinct, rows = (distinct_prompts(prompts, multiple) if share_prefixes and jax.process_count() == 1
                    else (None, None))
  if rows is not None and len(distinct) < num_prompts:  # Fewer rows to prefill, padding included.
    ids, mask = distributed.to_global(right_pad(distinct, prompt_len, pad_id))
    logits, cache = _prefill_shared(graphdef, state, ids, mask, jnp.asarray(rows), num_slots=capacities[0])
  else:
    prompts = list(prompts) + [prompts[-1]] * (-num_prompts % multiple)
    ids, mask = distributed.to_global(right_pad(prompts, prompt_len, pad_id))
    logits, cache = _prefill(graphdef, state, ids, mask, num_slots=capacities[0])
  carry = _start(logits, cache, jnp.int32(pad_id), max_new_tokens=max_new_tokens)
  sampling = (jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), jnp.float32(top_p), jnp.asarray(eos),
              jnp.int32(pad_id))
  modes = dict(greedy=greedy, filtering=not greedy and (top_k > 0 or top_p < 1), coupled=bool(coupled))
  decode = _decode_for(logits.shape[0])
  for segment, capacity in enumerate(capacities):
    if segment:
      carry = carry._replace(cache=_grow(carry.cache, num_slots=capacity))
    carry, rng = decode(graphdef, state, carry, rng, jnp.int32(capacity - prompt_len), *sampling, **modes)
  # This process's rows (never a read of rows another process holds), without the padding rows.
  tokens, logp, done, lengths = (x[:num_prompts] for x in distributed.to_local(
      (carry.tokens, carry.log_probs, carry.done, carry.cache.lengths)))
  lengths = (lengths - np.asarray([len(p) for p in prompts[:num_prompts]])).astype(np.int32)
  out_mask = (np.arange(max_new_tokens)[None] < lengths[:, None]).astype(np.int32)
  reasons = ["eos" if d else "length" for d in done]
  return SampleOutput(tokens, np.where(out_mask, logp, 0.0).astype(np.float32), out_mask, lengths, reasons)
