"""Sampler throughput: lemon_rl ``generate`` vs ``transformers`` ``generate`` on the same weights.

Greedy, CPU, prompts of 64 tokens, 128 new tokens, no early stop, batch 1 / 8 / 32, on the Qwen2-shaped
benchmark model (vocab 512, d 256, 4 layers, 8 heads, 4 KV heads, MLP 1024). Prefill and decode are timed
separately (for ``transformers``: one cached forward over the prompt, and ``generate`` minus that).
Each figure is the best of ``--repeats`` runs after a warm-up (compilation excluded); the runs of the
implementations being compared alternate, so that a change of the host's speed during the script (memory
contention from other guests moves small-batch decode by up to 2x) reaches both alike.

Long-prompt groups (GRPO's layout, shared prompt prefixes): 8 distinct prompts of 512 tokens, each repeated
``G = 8`` times (batch 64), 128 new tokens, greedy. lemon_rl's ``generate`` prefills each distinct prompt once
and shares its cache across its ``G`` rows; reported are that prefill (8 rows) against prefilling all 64 rows
(the path taken when no prompt repeats), and the whole ``generate`` call against ``transformers``
``generate`` on the same 64 rows (which prefills every row).

    python benchmarks/sampler.py [--repeats 3] [--batches 1,8,32] [--cases batches,group] [--cpus N]
        [--group-prompt 512 --group-new 128 --group-prompts 8 --group-size 8]

The header and footer (machine, ISA, versions, matmul peak, load) come from ``benchmarks/conditions.py``.
The last lines read ``sampler_speedup_vs_transformers_b{1,8,32}=<ratio>`` (new tokens/s, end to end), then
``sampler_group_prefill_speedup=<ratio>`` (prefill of every row / shared prefill) and
``sampler_group_speedup_vs_transformers=<ratio>`` (whole call, new tokens/s) for the group case.
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
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

import conditions
from lemon_rl.models import Transformer, get_preset, to_hf
from lemon_rl.sampling import sampler as sampler_lib

PROMPT_LEN, NEW_TOKENS = 64, 128


def best_times(timers: dict, repeats: int) -> dict:
  """``timers``: ``{name: (prefill function, whole-call function)}``; returns ``{name: (prefill s, call s)}``,
  each the best of ``repeats`` alternated rounds (:func:`conditions.interleaved`)."""
  fns = {(name, part): fn for name, pair in timers.items() for part, fn in enumerate(pair)}
  best = {key: times[0] for key, times in conditions.interleaved(fns, repeats).items()}
  return {name: (best[name, 0], best[name, 1]) for name in timers}


def lemon_timers(model, prompts):
  """``(prefill, whole generate call)`` functions of lemon_rl on ``prompts``."""
  ids, mask = sampler_lib.right_pad(prompts, PROMPT_LEN, 0)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  graphdef, state = nnx.split(model)
  slots = PROMPT_LEN + NEW_TOKENS

  def prefill():
    return jax.block_until_ready(sampler_lib._prefill(graphdef, state, ids, mask, num_slots=slots))

  def full():
    out = sampler_lib.generate(model, prompts, NEW_TOKENS, jax.random.key(0), temperature=0.0)
    assert out.tokens.shape == (len(prompts), NEW_TOKENS)

  return prefill, full


def hf_timers(hf_model, prompts):
  """``(prefill, whole generate call)`` functions of ``transformers`` on ``prompts``."""
  ids = torch.tensor(prompts)

  def prefill():
    with torch.no_grad():
      hf_model(input_ids=ids, use_cache=True)

  def full():
    with torch.no_grad():
      out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    assert out.shape == (len(prompts), PROMPT_LEN + NEW_TOKENS)

  return prefill, full


def time_group(model, hf_model, prompt_len, new_tokens, num_prompts, group_size, repeats):
  """The long-prompt group case; returns ``{name: (prefill s, whole call s)}`` and whether tokens agree."""
  rng = np.random.default_rng(1)
  distinct = rng.integers(1, model.cfg.vocab_size, size=(num_prompts, prompt_len)).tolist()
  prompts = [p for p in distinct for _ in range(group_size)]  # Each prompt's G rows consecutive (GRPO).
  bucket = sampler_lib.prompt_bucket(prompt_len)
  slots = bucket + new_tokens
  graphdef, state = nnx.split(model)
  unique, rows = sampler_lib.distinct_prompts(prompts)
  assert int(rows.max()) + 1 == num_prompts
  shared_ids, shared_mask = (jnp.asarray(x) for x in sampler_lib.right_pad(unique, bucket, 0))
  all_ids, all_mask = (jnp.asarray(x) for x in sampler_lib.right_pad(prompts, bucket, 0))
  rows = jnp.asarray(rows)
  outputs = {}

  def shared_prefill():
    return jax.block_until_ready(
        sampler_lib._prefill_shared(graphdef, state, shared_ids, shared_mask, rows, num_slots=slots))

  def every_row_prefill():
    return jax.block_until_ready(sampler_lib._prefill(graphdef, state, all_ids, all_mask, num_slots=slots))

  def lemon_call(share):
    def call():
      outputs[share] = sampler_lib.generate(model, prompts, new_tokens, jax.random.key(0), temperature=0.0,
                                            share_prefixes=share)
      assert outputs[share].tokens.shape == (len(prompts), new_tokens)
    return call

  hf_ids = torch.tensor(prompts)

  def hf_prefill():
    with torch.no_grad():
      hf_model(input_ids=hf_ids, use_cache=True)

  def hf_call():
    with torch.no_grad():
      out = hf_model.generate(hf_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    assert out.shape == (len(prompts), prompt_len + new_tokens)

  timers = {
      f"lemon_rl shared ({num_prompts} rows)": (shared_prefill, lemon_call(True)),
      f"lemon_rl every row ({len(prompts)})": (every_row_prefill, lemon_call(False)),
      f"transformers ({len(prompts)} rows)": (hf_prefill, hf_call),
  }
  return best_times(timers, repeats), bool(np.array_equal(outputs[True].tokens, outputs[False].tokens))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--batches", default="1,8,32")
  parser.add_argument("--cases", default="batches,group", help="comma list of: batches, group")
  parser.add_argument("--group-prompt", type=int, default=512, help="group case: prompt length")
  parser.add_argument("--group-new", type=int, default=128, help="group case: new tokens")
  parser.add_argument("--group-prompts", type=int, default=8, help="group case: distinct prompts")
  parser.add_argument("--group-size", type=int, default=8, help="group case: rows per prompt (G)")
  parser.add_argument("--default-malloc", action="store_true",
                      help="keep glibc's default allocator settings (the launcher's are used otherwise)")
  parser.add_argument("--cpus", type=int, default=0, help="pin to the first N CPUs (0 = all)")
  args = parser.parse_args()
  cases = set(args.cases.split(","))
  if not cases <= {"batches", "group"}:
    parser.error(f"--cases takes batches and/or group, got {args.cases}")
  batches = [int(b) for b in args.batches.split(",")] if "batches" in cases else []

  cond = conditions.start("benchmarks/sampler.py: lemon_rl generate vs transformers generate")
  cfg = get_preset("bench")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  with tempfile.TemporaryDirectory() as path:
    to_hf(model, path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

  print(f"torch threads {torch.get_num_threads()}; jax platform {jax.devices()[0].platform}")
  print(f"model: {cfg.num_params() / 1e6:.2f}M params, greedy")
  speedups = {}
  if batches:
    print(f"\nbatches: prompt {PROMPT_LEN}, new {NEW_TOKENS}")
    header = f"{'batch':>5} | {'impl':>12} | {'prefill ms':>10} | {'decode tok/s':>12} | {'new tok/s':>10}"
    print(header)
    print("-" * len(header))
  rng = np.random.default_rng(0)
  for b in batches:
    prompts = rng.integers(1, cfg.vocab_size, size=(b, PROMPT_LEN)).tolist()
    timers = {"lemon_rl": lemon_timers(model, prompts), "transformers": hf_timers(hf_model, prompts)}
    rows = {}
    for name, (prefill_s, full_s) in best_times(timers, args.repeats).items():
      decode_s = max(full_s - prefill_s, 1e-9)
      rows[name] = b * NEW_TOKENS / full_s
      print(f"{b:>5} | {name:>12} | {prefill_s * 1e3:>10.1f} | {b * NEW_TOKENS / decode_s:>12.0f} | "
            f"{rows[name]:>10.0f}")
    speedups[b] = rows["lemon_rl"] / rows["transformers"]

  group = None
  if "group" in cases:
    p, g = args.group_prompts, args.group_size
    new = args.group_new
    print(f"\nlong-prompt groups: {p} prompts x G={g} = {p * g} rows, prompt {args.group_prompt}, new {new}")
    times, same = time_group(model, hf_model, args.group_prompt, new, p, g, args.repeats)
    header = f"{'impl':>28} | {'prefill ms':>10} | {'whole call s':>12} | {'new tok/s':>10}"
    print(header)
    print("-" * len(header))
    for name, (prefill_s, full_s) in times.items():
      print(f"{name:>28} | {prefill_s * 1e3:>10.1f} | {full_s:>12.3f} | {p * g * new / full_s:>10.0f}")
    (shared_prefill, shared_full), (every_prefill, every_full), (_, hf_full) = times.values()
    group = (every_prefill / shared_prefill, hf_full / shared_full)
    print(f"prefill: every row / shared = {group[0]:.2f}x; whole call: every row / shared = "
          f"{every_full / shared_full:.2f}x, transformers / shared = {group[1]:.2f}x; "
          f"same tokens with and without sharing: {same}")

  cond.finish()
  for b in batches:
    print(f"sampler_speedup_vs_transformers_b{b}={speedups[b]:.2f}")
  if group is not None:
    print(f"sampler_group_prefill_speedup={group[0]:.2f}")
    print(f"sampler_group_speedup_vs_transformers={group[1]:.2f}")


if __name__ == "__main__":
  main()
