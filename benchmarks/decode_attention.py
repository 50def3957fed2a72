"""Decode attention over the KV cache: keys stored slots-last (the cache layout) vs slots-second (the former one).

``lemon_rl.models.transformer.grouped_attention`` reads keys ``[B, K, D, S]``, so the scores ``q k^T`` are a
``[G*T, D] x [D, S]`` matmul per (row, KV head); the reference is the same function given keys stored ``[B, K,
S, D]`` (transposed inside the jitted loop: the scores then contract both operands on their last axis), as the
cache stored them before. Both are jitted inside
a ``fori_loop`` of ``--steps`` calls (each call's queries depend on the previous output, so nothing is
hoisted), at the bench model's head shape (8 query heads, 4 KV heads, head width 32) and ``S`` cache slots
(the sampler benchmark's 64 + 128), for decode (``T = 1``) and verification (``T = K + 1``) shapes. Each
figure is the best of ``--repeats`` timed loops after a warm-up; the two layouts alternate.

    python benchmarks/decode_attention.py [--slots 192] [--steps 200] [--repeats 5]

Last line: ``decode_attention_speedup_b1=<x> decode_attention_speedup_b8=<x> decode_attention_speedup_b32=<x>``
(former / new time at ``T = 1``).
"""

from __future__ import annotations

if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning("--default-malloc")  # as the launcher runs (train_step.py's docstring)
  from cpus import restrict_cpus_from_argv  # pylint: disable=g-import-not-at-top
  restrict_cpus_from_argv()
  import conditions  # pylint: disable=g-import-not-at-top,unused-import  (load baseline before the imports)

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import conditions
from lemon_rl.models.transformer import grouped_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32
SHAPES = ((1, 1), (1, 4), (8, 1), (8, 2), (32, 1))  # (B, T)


def slots_second_attention(q, keys, values, allowed):
  """The reference: keys stored ``[B, K, S, D]``. XLA folds the transpose into the scores matmul, which then
  contracts both operands on their last axis, as the former layout's ``einsum("bkqd,bksd->bkqs")`` did (same
  time within noise, checked against a copy of that function)."""
  return grouped_attention(q, jnp.swapaxes(keys, 2, 3), values, allowed)


def seconds_per_call(attention, q, keys, values, allowed, steps: int, repeats: int) -> float:
  loop = jax.jit(lambda q, k, v, a: jax.lax.fori_loop(
      0, steps, lambda _, c: attention(c.reshape(q.shape), k, v, a).reshape(q.shape), q))
  jax.block_until_ready(loop(q, keys, values, allowed))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(loop(q, keys, values, allowed))
    times.append(time.perf_counter() - start)
  return min(times) / steps


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--slots", type=int, default=192)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--default-malloc", action="store_true", help="glibc's default allocator (no re-exec)")
  parser.add_argument("--cpus", type=int, default=0, help="pin to the first N CPUs (0 = all)")
  args = parser.parse_args()
  cond = conditions.start("decode attention: keys slots-last vs slots-second")
  s = args.slots
  print(f"heads {HEADS} / KV heads {KV_HEADS} / head width {HEAD_DIM}, {s} slots (each row attends to about "
        f"two thirds), {args.steps} calls per loop, best of {args.repeats}")
  print(f"{'B':>3} | {'T':>2} | {'slots-second us':>15} | {'slots-last us':>13} | speedup | max |diff|")
  speedups = {}
  rng = np.random.default_rng(0)
  for b, t in SHAPES:
    q = jnp.asarray(rng.standard_normal((b, t, HEADS, HEAD_DIM)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, KV_HEADS, s, HEAD_DIM)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, KV_HEADS, s, HEAD_DIM)), jnp.float32)
    allowed = jnp.asarray(np.arange(s)[None, None, :] <= (2 * s // 3 + np.arange(t))[None, :, None]).repeat(b, 0)
    keys_last = jnp.swapaxes(keys, 2, 3)
    diff = float(jnp.max(jnp.abs(grouped_attention(q, keys_last, values, allowed)
                                 - slots_second_attention(q, keys, values, allowed))))
    former, new = [], []
    for _ in range(2):  # alternate, so a drift of the machine's speed reaches both
      former.append(seconds_per_call(slots_second_attention, q, keys, values, allowed, args.steps, args.repeats))
      new.append(seconds_per_call(grouped_attention, q, keys_last, values, allowed, args.steps, args.repeats))
    former_s, new_s = min(former), min(new)
    print(f"{b:>3} | {t:>2} | {former_s * 1e6:>15.1f} | {new_s * 1e6:>13.1f} | {former_s / new_s:>6.2f}x | {diff:.1e}")
    if t == 1:
      speedups[b] = former_s / new_s
  cond.finish()
  print(" ".join(f"decode_attention_speedup_b{b}={x:.2f}" for b, x in speedups.items()))


if __name__ == "__main__":
  main()
