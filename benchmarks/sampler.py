"""Sampler throughput: lemon_rl ``generate`` vs ``transformers`` ``generate`` on the same weights.

Greedy, CPU, prompts of 64 tokens, 128 new tokens, no early stop, batch 1 / 8 / 32, on the Qwen2-shaped
benchmark model (vocab 512, d 256, 4 layers, 8 heads, 4 KV heads, MLP 1024). Prefill and decode are timed
separately (for ``transformers``: one cached forward over the prompt, and ``generate`` minus that).
Each figure is the best of ``--repeats`` runs after a warm-up (compilation excluded).

    python benchmarks/sampler.py [--repeats 3] [--batches 1,8,32] [--cpus N]

The last three lines read ``sampler_speedup_vs_transformers_b{1,8,32}=<ratio>`` (new tokens/s, end to end).
"""

from __future__ import annotations

if __name__ == "__main__":
  from cpus import restrict_cpus_from_argv  # pylint: disable=g-import-not-at-top
  restrict_cpus_from_argv()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from lemon_rl.models import Transformer, get_preset, to_hf
from lemon_rl.sampling import sampler as sampler_lib

PROMPT_LEN, NEW_TOKENS = 64, 128


def best_time(fn, repeats: int) -> float:
  fn()  # warm-up / compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def time_lemon(model, prompts, repeats):
  ids, mask = sampler_lib.right_pad(prompts, PROMPT_LEN, 0)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  graphdef, state = nnx.split(model)
  slots = PROMPT_LEN + NEW_TOKENS

  def prefill():
    return jax.block_until_ready(sampler_lib._prefill(graphdef, state, ids, mask, num_slots=slots))

  def full():
    out = sampler_lib.generate(model, prompts, NEW_TOKENS, jax.random.key(0), temperature=0.0)
    assert out.tokens.shape == (len(prompts), NEW_TOKENS)

  return best_time(prefill, repeats), best_time(full, repeats)


def time_hf(hf_model, prompts, repeats):
  ids = torch.tensor(prompts)

  def prefill():
    with torch.no_grad():
      hf_model(input_ids=ids, use_cache=True)

  def full():
    with torch.no_grad():
      out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    assert out.shape == (len(prompts), PROMPT_LEN + NEW_TOKENS)

  return best_time(prefill, repeats), best_time(full, repeats)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--batches", default="1,8,32")
  parser.add_argument("--cpus", type=int, default=0, help="pin to the first N CPUs (0 = all)")
  args = parser.parse_args()
  batches = [int(b) for b in args.batches.split(",")]

  cfg = get_preset("bench")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  with tempfile.TemporaryDirectory() as path:
    to_hf(model, path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

  print(f"load average at start {os.getloadavg()[0]:.1f}; CPUs {len(os.sched_getaffinity(0))}")
  print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}")
  print(f"model: {cfg.num_params() / 1e6:.2f}M params, prompt {PROMPT_LEN}, new {NEW_TOKENS}, greedy")
  header = f"{'batch':>5} | {'impl':>12} | {'prefill ms':>10} | {'decode tok/s':>12} | {'new tok/s':>10}"
  print(header)
  print("-" * len(header))
  rng = np.random.default_rng(0)
  speedups = {}
  for b in batches:
    prompts = rng.integers(1, cfg.vocab_size, size=(b, PROMPT_LEN)).tolist()
    rows = {}
    for name, fn, m in (("lemon_rl", time_lemon, model), ("transformers", time_hf, hf_model)):
      prefill_s, full_s = fn(m, prompts, args.repeats)
      decode_s = max(full_s - prefill_s, 1e-9)
      rows[name] = b * NEW_TOKENS / full_s
      print(f"{b:>5} | {name:>12} | {prefill_s * 1e3:>10.1f} | {b * NEW_TOKENS / decode_s:>12.0f} | "
            f"{rows[name]:>10.0f}")
    speedups[b] = rows["lemon_rl"] / rows["transformers"]
  print(f"load average at end {os.getloadavg()[0]:.1f}")
  for b in batches:
    print(f"sampler_speedup_vs_transformers_b{b}={speedups[b]:.2f}")


if __name__ == "__main__":
  main()
