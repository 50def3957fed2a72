r"""Where one decode step's time goes, and how far it is from reading the weights once.

A decode step at small batch is bound by reading the model (every weight once per step), not by FLOPs. This
script compiles one greedy decode step of a random model (``extend`` of one token per row over a cache of
``--context`` cached positions and ``--slots`` slots, the LM head, the argmax) with the XLA options
``generate`` uses at that batch (``sampler.decode_compiler_options``), and reports:

* its wall time per step (separate dispatches of the jitted step, best of 3 x ``--steps``);
* its per-op time from a profiler trace, split into matmul ops (dots and fusions that contain a dot) and the
  rest; XLA:CPU records ops only outside ``while_loop`` bodies (``--xla_cpu_enable_xprof_traceme``, set here
  before JAX starts), which is why one step is compiled on its own instead of profiling ``generate``'s loop;
  op times are summed over threads;
* the weight-read bound: weight bytes per step / this machine's read bandwidth at that size, measured in the
  same run two ways (best of ``--repeats``): a jitted ``jnp.sum`` over a float32 array of that many bytes
  (streaming read), and a one-row matmul ``[1, K] x [K, 2048]`` over it (what a decode step's matmuls do at
  batch 1). The KV cache read per step is printed next to it (small at these shapes). The matmul ops' time
  is also given as the rate at which they read the weights and as a FLOP rate (``2 x batch x weights``,
  attention products left out) against the header's matmul peak: at batch 1 the first is the one to compare,
  from batch 8 on the second.

``generate``'s loop adds per-step sampling bookkeeping (EOS masks, the output writes) and saves the
dispatches, so its step time differs from this one by a few percent (compare with ``benchmarks/sampler.py``).

    python benchmarks/decode_profile.py [--batch 1] [--preset bench] [--context 64] [--slots 192]
        [--steps 64] [--repeats 20] [--top 12]

Last line: ``decode_step_ms=<wall> decode_read_bound_ms=<bound> decode_matmul_share=<fraction>``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning("--default-malloc")  # as the launcher runs (train_step.py's docstring)
  from cpus import restrict_cpus_from_argv  # pylint: disable=g-import-not-at-top
  restrict_cpus_from_argv()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
  import conditions  # pylint: disable=g-import-not-at-top,unused-import  (load baseline before the imports)

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import collections
import glob
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import conditions
from lemon_rl.models import Transformer, get_preset
from lemon_rl.sampling import sampler as sampler_lib

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.-]+) [^\n]*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = [^\n]*$", re.M)
_CALLS = re.compile(r"calls=%([\w.-]+)")


def instruction_lines(hlo_text: str) -> dict[str, str]:
  """Every instruction of an HLO module's text (``compiled.as_text()``): ``{name: its first line}``."""
  lines: dict[str, str] = {}
  for m in _INSTRUCTION.finditer(hlo_text):
    lines.setdefault(m.group(1), m.group(0))
  return lines


def matmul_instructions(hlo_text: str) -> set[str]:
  """Names of the instructions of an HLO module (``compiled.as_text()``) that are dots, or fusions whose
  called computations (transitively) contain a dot."""
  body: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    if (m := _COMPUTATION.match(line)) and not _INSTRUCTION.match(line):
      current = body.setdefault(m.group(1), [])
    elif current is not None and _INSTRUCTION.match(line):
      current.append(line)

  has_dot: dict[str, bool] = {}

  def contains_dot(name: str) -> bool:
    if name not in has_dot:
      has_dot[name] = False  # breaks cycles (none in valid HLO)
      has_dot[name] = any(" dot(" in line or any(contains_dot(c) for c in _CALLS.findall(line))
                          for line in body.get(name, []))
    return has_dot[name]

  return {_INSTRUCTION.match(line).group(1) for lines in body.values() for line in lines
          if " dot(" in line or any(contains_dot(c) for c in _CALLS.findall(line))}


def op_times(trace_dir: str, names: set[str]) -> collections.Counter:
  """Total nanoseconds per HLO instruction of ``names`` in the profiler trace under ``trace_dir``."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not files:
    raise RuntimeError(f"no profiler trace was written under {trace_dir}")
  totals = collections.Counter()
  for plane in jax.profiler.ProfileData.from_file(files[0]).planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in names:
          totals[event.name] += event.duration_ns
  return totals


def read_bandwidth(num_bytes: int, repeats: int) -> tuple[float, float]:
  """``(streaming-read bytes/s, one-row matmul bytes/s)`` over a float32 array of ``num_bytes`` (rounded to
  whole rows of 2048), best of ``repeats`` calls each, alternating back to back.

  Not :func:`conditions.interleaved`: its pause before each call (there against torch's spinning threads)
  lets the host idle, and a read right after an idle measured 2-3x slower than a warm one (bounds of 1.2-1.6
  ms against 0.37-0.67 ms for the bench model at batch 1).
  """
  rows = max(num_bytes // (4 * 2048), 1)
  weights = jnp.ones((rows, 2048), jnp.float32)
  x = jnp.ones((1, rows), jnp.float32)
  read = jax.jit(jnp.sum)
  matmul = jax.jit(jnp.dot, compiler_options=sampler_lib.decode_compiler_options(1))
  fns = {"read": lambda: jax.block_until_ready(read(weights)),
         "matmul": lambda: jax.block_until_ready(matmul(x, weights))}
  best = {}
  for fn in fns.values():
    fn()  # compiles
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      best[name] = min(best.get(name, np.inf), time.perf_counter() - t0)
  return weights.nbytes / best["read"], weights.nbytes / best["matmul"]


def decode_step(model: Transformer, batch: int, context: int, slots: int):
  """``(step, state, cache, tokens)``: a jitted greedy step ``(state, cache, tokens) -> (cache, tokens)``
  compiled as ``generate`` compiles its loop at ``batch`` rows, and its inputs: the cache of a prompt of
  ``context`` random tokens per row (``np.random.default_rng(0)``) and its greedy next tokens.

  The step appends ``tokens`` at position ``context`` and returns the greedy token after them, then rolls
  the cache back to ``context`` positions, so that every step reads the same cache: the first step computes
  ``generate``'s second greedy token of the prompt, later steps the token after the prompt + their input.
  """
  graphdef, state = nnx.split(model)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (batch, context)), jnp.int32)
  logits, cache = sampler_lib._prefill(graphdef, state, ids, jnp.ones_like(ids), num_slots=slots)

  def step(state, cache, tokens):
    m = nnx.merge(graphdef, state)
    hidden, cache = m.extend(tokens[:, None], cache)
    return cache.truncate(cache.lengths - 1), jnp.argmax(m.logits_from_hidden(hidden[:, 0]), -1).astype(jnp.int32)

  jitted = jax.jit(step, donate_argnames=("cache",),
                   compiler_options=sampler_lib.decode_compiler_options(batch))
  return jitted, state, cache, jnp.argmax(logits, -1).astype(jnp.int32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--preset", default="bench")
  parser.add_argument("--context", type=int, default=64)
  parser.add_argument("--slots", type=int, default=192)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--top", type=int, default=12, help="slowest instructions listed")
  parser.add_argument("--default-malloc", action="store_true")
  parser.add_argument("--cpus", type=int, default=0)
  args = parser.parse_args()
  if not 0 < args.context < args.slots:
    parser.error("need 0 < --context < --slots")

  cond = conditions.start("benchmarks/decode_profile.py: one decode step's ops and the weight-read bound")
  cfg = get_preset(args.preset)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  step, state, cache, tokens = decode_step(model, args.batch, args.context, args.slots)
  options = sampler_lib.decode_compiler_options(args.batch)
  print(f"model: {args.preset} preset, {cfg.num_params() / 1e6:.2f}M params, {cfg.dtype}; batch {args.batch}, "
        f"{args.context} cached positions of {args.slots} slots; compiled with {options or 'XLA defaults'}")

  hlo = step.lower(state, cache, tokens).compile().as_text()
  matmuls = matmul_instructions(hlo)
  lines = instruction_lines(hlo)
  for _ in range(3):
    cache, tokens = step(state, cache, tokens)
  walls = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(args.steps):
      cache, tokens = step(state, cache, tokens)
    jax.block_until_ready(tokens)
    walls.append((time.perf_counter() - t0) / args.steps)
  wall = min(walls)

  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    for _ in range(args.steps):
      cache, tokens = step(state, cache, tokens)
    jax.block_until_ready(tokens)
    jax.profiler.stop_trace()
    totals = op_times(trace_dir, set(lines))
  per_step = {name: ns / args.steps / 1e3 for name, ns in totals.items()}  # us
  matmul_us = sum(t for name, t in per_step.items() if name in matmuls)
  other_us = sum(t for name, t in per_step.items() if name not in matmuls)

  itemsize = jnp.dtype(cfg.jnp_dtype).itemsize
  params = nnx.state(model, nnx.Param)
  embed_rows_unread = 0 if cfg.tie_embeddings else cfg.vocab_size - args.batch  # untied: only gathered rows
  weight_bytes = (sum(x.size for x in jax.tree.leaves(params)) - embed_rows_unread * cfg.hidden_size) * itemsize
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves((cache.keys, cache.values))) * args.context / args.slots
  read_rate, matmul_rate = read_bandwidth(weight_bytes, args.repeats)
  bound = weight_bytes / read_rate

  print(f"wall per step: {wall * 1e3:.3f} ms (best of 3 x {args.steps} separately dispatched steps; "
        f"{args.batch / wall:.0f} tok/s)")
  print(f"op time per step (summed over threads): matmul ops {matmul_us:.0f} us "
        f"({sum(1 for n in per_step if n in matmuls) } instructions), other ops {other_us:.0f} us")
  print(f"bytes per step: weights {weight_bytes / 2**20:.2f} MiB, KV cache read {cache_bytes / 2**20:.2f} MiB")
  print(f"read bandwidth at {weight_bytes / 2**20:.1f} MiB (best of {args.repeats}): streaming sum "
        f"{read_rate / 1e9:.1f} GB/s, one-row matmul {matmul_rate / 1e9:.1f} GB/s")
  print(f"weight-read bound: {bound * 1e3:.3f} ms per step ({args.batch / bound:.0f} tok/s); this step takes "
        f"{wall / bound:.2f}x the bound")
  weight_flops = 2.0 * args.batch * weight_bytes / itemsize  # one multiply-add per weight and row
  print(f"matmul ops: the weights read at {weight_bytes / (matmul_us * 1e-6) / 1e9:.1f} GB/s, "
        f"{weight_flops / (matmul_us * 1e-6) / 1e9:.1f} GFLOP/s of weight products (2 x batch x weights; "
        f"{cond.peak.flops_per_s / 1e9:.0f} GFLOP/s matmul peak)")
  print(f"\nslowest instructions (us per step, summed over threads):")
  for name, t in sorted(per_step.items(), key=lambda kv: -kv[1])[:args.top]:
    print(f"  {t:7.1f}  {'matmul' if name in matmuls else 'other ':6s}  {lines[name].strip()[:120]}")
  cond.finish()
  print(f"decode_step_ms={wall * 1e3:.3f} decode_read_bound_ms={bound * 1e3:.3f} "
        f"decode_matmul_share={matmul_us / max(matmul_us + other_us, 1e-9):.2f}")


if __name__ == "__main__":
  main()
