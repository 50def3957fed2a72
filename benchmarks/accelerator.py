"""Policy-update MFU and sampler tokens/s on whatever accelerator JAX finds (``jax.devices()[0]``).

Model: ``--preset`` (default ``qwen2.5-0.5b-mixed``: Qwen2.5-0.5B shapes, float32 master weights, bfloat16
matmuls, float32 logits / log-softmax / loss, blocks rematerialised with ``dots_with_no_batch_dims_saveable``),
with ``--dtype``, ``--param-dtype`` and ``--remat-policy`` overrides. Everything runs on one device (on a
multi-chip host: per-chip figures).

(a) Policy update: one jitted ``lemon_rl.training.state.update_step`` (forward + backward of the clipped
    policy loss ``PolicyLoss``, AdamW with global-norm clipping, parameters updated in place) on ``--batch``
    sequences of ``--seq`` tokens (the first third prompt, the loss on the rest). Reported as tokens/s
    (``batch * seq / step time``) and MFU = model FLOPs / step time / the device's peak, with the model FLOPs
    of ``lemon_rl.models.flops.train_flops`` (PaLM convention: ``6 (N_matmul + V E)`` per token plus causal
    attention; rematerialised recomputation is not counted, the optimizer's elementwise work neither).
    XLA's own cost analysis of the compiled step is printed next to it (it counts the recomputation).

    Peak: the dense bfloat16 peak of :data:`DENSE_BF16_PEAKS` for the device's ``device_kind`` (spec-sheet
    figures without sparsity); for any other accelerator a measured peak (best of a jitted ``8192^3``
    bfloat16 ``jnp.dot``); on CPU the float32 ``jnp.dot`` peak that ``conditions.py`` measures in the
    header (XLA:CPU has no fast bfloat16 matmul: a CPU run is a smoke test, not a measurement). The peak's
    source is printed.

(b) Sampler: ``lemon_rl.sampling.generate`` (temperature 1, no early stop) of ``--new-tokens`` tokens for
    ``--sample-batch`` distinct random prompts of ``--prompt-len`` tokens; new tokens/s of the whole call
    (prefill + decode + host work, compilation excluded). ``--sampler-weights master`` samples with the
    training weights as stored (what ``lemon_rl.training.rollout`` does), ``bf16`` with a bfloat16 copy.

Each time is the best of ``--repeats`` runs after one warm-up run (the median is printed too).

    python benchmarks/accelerator.py [--preset qwen2.5-0.5b-mixed] [--batch 16] [--seq 1024]
        [--micro-batches 1] [--remat-policy NAME|none] [--dtype bfloat16] [--param-dtype float32]
        [--sample-batch 64] [--prompt-len 128] [--new-tokens 256] [--sampler-weights master|bf16]
        [--repeats 3] [--peak-repeats 5]

CPU smoke test (every code path, tiny shapes, well under a minute on 2 cores):

    JAX_PLATFORMS=cpu python benchmarks/accelerator.py --preset tiny --dtype bfloat16 --remat-policy \\
        dots_with_no_batch_dims_saveable --batch 2 --seq 32 --sample-batch 2 --prompt-len 8 --new-tokens 8 \\
        --repeats 1 --peak-repeats 1

The header and footer come from ``benchmarks/conditions.py``. The last two lines read
``accelerator_update_mfu=<fraction>`` and ``accelerator_sampler_tokens_per_s=<new tokens/s>``.
"""

from __future__ import annotations

if __name__ == "__main__":
  import conditions  # pylint: disable=g-import-not-at-top,unused-import  (load baseline before the imports)

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import conditions
from lemon_rl.models import ModelConfig, Transformer, get_preset
from lemon_rl.models.config import REMAT_POLICIES
from lemon_rl.models.flops import train_flops
from lemon_rl.sampling import generate
from lemon_rl.training import state as state_lib
from lemon_rl.training.rl import PolicyLoss

# Dense (no sparsity) bfloat16 peak FLOP/s per chip, by a substring of ``jax.Device.device_kind`` (first
# match wins, so the more specific names come first). Spec sheets: NVIDIA H100 SXM / H200 989.4, H100 PCIe
# 756, A100 312; Google TPU v4 275, v5e 197, v5p 459, v6e (Trillium) 918.
DENSE_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # v5p reports "TPU v5".
    ("tpu v6 lite", 918e12),
    ("tpu v6e", 918e12),
)
MEASURED_PEAK_N = 8192


def table_peak(device_kind: str) -> float | None:
  """The dense bfloat16 peak of :data:`DENSE_BF16_PEAKS` for ``device_kind``, or ``None`` if not listed."""
  kind = device_kind.lower()
  for name, flops in DENSE_BF16_PEAKS:
    if name in kind:
      return flops
  return None


def best_and_median(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
  """Runs ``fn`` once (warm-up, compilation), then ``repeats`` timed runs: ``(best s, median s)``."""
  fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times), float(np.median(times))


def device_peak(device: jax.Device, cond: conditions.Conditions, repeats: int) -> tuple[float, str]:
  """``(FLOP/s, where it comes from)`` for MFU on ``device``."""
  peak = table_peak(device.device_kind)
  if peak is not None:
    return peak, f"dense bfloat16 spec-sheet peak of {device.device_kind!r}: {peak / 1e12:.0f} TFLOP/s"
  if device.platform == "cpu":
    flops = cond.peak.flops_per_s
    return flops, (f"no table entry for {device.device_kind!r}: this CPU's measured float32 jnp.dot peak "
                   f"(header) {flops / 1e9:.0f} GFLOP/s")
  a = jax.device_put(jnp.ones((MEASURED_PEAK_N, MEASURED_PEAK_N), jnp.bfloat16), device)
  dot = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
  best, _ = best_and_median(lambda: jax.block_until_ready(dot(a)), max(repeats, 1))
  flops = 2.0 * MEASURED_PEAK_N**3 / best
  return flops, (f"no table entry for {device.device_kind!r}: measured bfloat16 {MEASURED_PEAK_N}^3 jnp.dot "
                 f"peak {flops / 1e12:.1f} TFLOP/s")


def model_config(args: argparse.Namespace) -> ModelConfig:
  overrides = {}
  if args.dtype:
    overrides["dtype"] = args.dtype
  if args.param_dtype:
    overrides["param_dtype"] = args.param_dtype
  if args.remat_policy == "none":
    overrides["remat"] = False
  elif args.remat_policy:
    overrides.update(remat=True, remat_policy=args.remat_policy)
  return get_preset(args.preset, **overrides)


def update_batch(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> dict[str, jax.Array]:
  """``batch`` random sequences of ``seq`` tokens; the loss covers all but the first third (the prompt)."""
  rng = np.random.default_rng(seed)
  prompt = max(seq // 3, 1)
  loss_mask = np.zeros((batch, seq - 1), np.float32)
  loss_mask[:, prompt - 1:] = 1.0
  return {
      "ids": jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32),
      "attention_mask": jnp.ones((batch, seq), jnp.int32),
      "loss_mask": jnp.asarray(loss_mask),
      "old_logp": jnp.full((batch, seq - 1), -math.log(cfg.vocab_size), jnp.float32),
      "advantages": jnp.asarray(rng.normal(size=batch), jnp.float32),
  }


def measure_update(cfg: ModelConfig, args: argparse.Namespace) -> tuple[float, float, float]:
  """Compiles and times the policy update: ``(best s, median s, XLA cost-analysis FLOPs)``."""
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  optimizer = state_lib.make_optimizer(1e-6, total_steps=1000, schedule="constant")
  graphdef, train_state = state_lib.create_train_state(model, optimizer, seed=0)
  del model
  batch = update_batch(cfg, args.batch, args.seq)
  t0 = time.perf_counter()
  step = state_lib.update_step.lower(graphdef, train_state, batch, loss_fn=PolicyLoss(), optimizer=optimizer,
                                     num_microbatches=args.micro_batches).compile()
  print(f"update: compiled in {time.perf_counter() - t0:.1f} s")
  cost = step.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float((cost or {}).get("flops", float("nan")))
  holder = [train_state]

  def run():
    holder[0], metrics = step(holder[0], batch)
    jax.block_until_ready(metrics["loss"])

  best, median = best_and_median(run, args.repeats)
  return best, median, xla_flops


def measure_sampler(cfg: ModelConfig, args: argparse.Namespace) -> tuple[float, float, int]:
  """Times ``generate``: ``(best s, median s, new tokens per call)``."""
  if args.sampler_weights == "bf16":
    cfg = cfg.replace(param_dtype="bfloat16")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  prompts = [list(map(int, rng.integers(0, cfg.vocab_size, args.prompt_len))) for _ in range(args.sample_batch)]
  keys = iter(jax.random.split(jax.random.key(0), args.repeats + 1))

  def run():
    out = generate(model, prompts, args.new_tokens, next(keys), temperature=1.0, eos_ids=None)
    jax.block_until_ready(out.tokens)

  best, median = best_and_median(run, args.repeats)
  return best, median, args.sample_batch * args.new_tokens


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="qwen2.5-0.5b-mixed")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="compute dtype override")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="parameter (master) dtype override")
  p.add_argument("--remat-policy", choices=("none", *REMAT_POLICIES), default=None,
                 help="override the preset's remat ('none' turns it off)")
  p.add_argument("--batch", type=int, default=16, help="sequences per update")
  p.add_argument("--seq", type=int, default=1024, help="tokens per sequence in the update")
  p.add_argument("--micro-batches", type=int, default=1)
  p.add_argument("--sample-batch", type=int, default=64)
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--sampler-weights", choices=("master", "bf16"), default="master")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--peak-repeats", type=int, default=5, help="runs of the header's float32 matmul peak")
  return p.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  cond = conditions.start("benchmarks/accelerator.py: policy update MFU and sampler tokens/s",
                          peak_repeats=args.peak_repeats)
  device = jax.devices()[0]
  print(f"device: {device.platform} {device.device_kind!r} ({jax.device_count()} devices; timing device 0)")
  cfg = model_config(args)
  print(f"model: {args.preset} ({cfg.num_params() / 1e6:.1f}M parameters) param_dtype={cfg.param_dtype} "
        f"dtype={cfg.dtype} remat={cfg.remat_policy if cfg.remat else 'off'}")
  peak, peak_source = device_peak(device, cond, args.peak_repeats)
  print(f"peak: {peak_source}")

  best, median, xla_flops = measure_update(cfg, args)
  tokens = args.batch * args.seq
  flops = train_flops(cfg, args.batch, args.seq)
  mfu = flops / best / peak
  print(f"update: {args.batch} x {args.seq} tokens, {args.micro_batches} micro-batch(es): best {best * 1e3:.1f} ms "
        f"(median {median * 1e3:.1f}), {tokens / best:,.0f} tokens/s; model {flops:.4g} FLOP/step "
        f"(XLA cost analysis {xla_flops:.4g}, recomputation included), {flops / best / 1e12:.4g} TFLOP/s = "
        f"MFU {mfu:.2%}")
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "peak_bytes_in_use" in stats:
    print(f"device memory: peak {stats['peak_bytes_in_use'] / 2**30:.2f} GiB in use")

  s_best, s_median, new_tokens = measure_sampler(cfg, args)
  print(f"sampler: {args.sample_batch} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, "
        f"{args.sampler_weights} weights: best {s_best:.3f} s (median {s_median:.3f}), "
        f"{new_tokens / s_best:,.0f} new tokens/s")
  cond.finish()
  print(f"accelerator_update_mfu={mfu:.4f}")
  print(f"accelerator_sampler_tokens_per_s={new_tokens / s_best:.1f}")


if __name__ == "__main__":
  main()
