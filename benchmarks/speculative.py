r"""Speculative decoding vs the target alone, on held-out stdlib prompts, with the trained target and drafter.

Loads what ``python -m experiments.train_speculative --config=configs/stdlib_speculative.py --workdir=DIR``
wrote (``DIR/checkpoints/speculative``: the target and its EAGLE-3 drafter; ``DIR/tokenizer``; the held-out
packages' rows ``DIR/data/test.npy``) and decodes ``--num-prompts`` held-out prompts (prompt lengths spread
over ``[prompt_len / 2, prompt_len]``, EOS on) in chunks of ``--batches`` rows, with the same weights:

* target alone: ``lemon_rl.sampling.generate``;
* speculative: ``lemon_rl.sampling.speculative_generate`` with ``EagleDrafter`` and ``K = --num-draft``;
  with several candidates (``--num-draft 1,2,3,4``), ``K`` is chosen per batch size as the one with the most
  greedy speculative tokens/s on ``--validation-prompts`` other held-out rows (disjoint from the measured
  prompts; the candidates alternate chunk by chunk), so the choice never sees the prompts the speedup is
  reported on;

greedy and at temperature 1. Each chunk's time is the best of ``--repeats`` (>= 2, so compilation is never
timed), the two decoders alternating chunk by chunk; tokens/s = emitted tokens / summed chunk times. Greedy
outputs are compared token for token with the target alone at the same batch size
(``lemon_rl.sampling.compare_greedy``: rows that first differ where the target's top-two logits lie within
``--tie-gap`` are near-ties, counted; any other difference is a mismatch and fails the run). Also printed:
the acceptance length ``tau`` (tokens per target forward, bonus included), per-position acceptance, the
measured drafter / target decode-step cost ratio ``gamma`` and the speedup it implies, ``tau / (1 + K
gamma)`` (a ``K+1``-token verification costed as one decode step); the measured cost of a verification,
``verify`` = one ``K+1``-token target step / one decode step as ``generate`` compiles it (both timed in jitted
loops, ``drafter_training.target_step_seconds``), and the speedup the measured costs imply, ``costed`` =
``tau x decode step / (verification + K drafter steps)``; and the row use: rows that accept more
finish first and sit idle until the engine halves the batch (when at most half of its rows are active);
row use = the rows' verification passes / (rows x the chunk's most passes), 1 for a single row.

    python benchmarks/speculative.py --workdir runs/speculative [--num-prompts 100] [--batches 1,8] \
        [--num-draft 1,2,3,4]

Last line: ``speculative_speedup_b1=<x> speculative_speedup_b8=<x> tau=<x>`` (greedy; ``tau`` at batch 1).
"""

from __future__ import annotations

if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning("--default-malloc")  # as the launcher runs (train_step.py's docstring)
  from cpus import restrict_cpus_from_argv  # pylint: disable=g-import-not-at-top
  restrict_cpus_from_argv()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import os
import time

import jax
import numpy as np

import conditions
from lemon_rl.data import stdlib_corpus
from lemon_rl.models.drafter import EagleDrafter
from lemon_rl.sampling import compare_greedy, generate, speculative_generate
from lemon_rl.sampling.sampler import decode_compiler_options
from lemon_rl.training.drafter_training import decode_step_seconds, load_speculative, target_step_seconds


def held_out_rows(num_rows: int, num_prompts: int, num_validation: int) -> tuple[np.ndarray, np.ndarray]:
  """Disjoint row indices ``(measured, validation)``: ``num_prompts`` evenly spaced rows of ``[0, num_rows)``,
  then ``num_validation`` evenly spaced among the others."""
  measured = np.unique(np.linspace(0, num_rows - 1, num_prompts).astype(int))
  rest = np.setdiff1d(np.arange(num_rows), measured)
  if len(measured) < num_prompts or len(rest) < num_validation:
    raise ValueError(f"{num_rows} held-out rows cannot give {num_prompts} + {num_validation} distinct prompts")
  return measured, rest[np.linspace(0, len(rest) - 1, num_validation).astype(int)]


def held_out_prompts(test_rows: np.ndarray, rows: np.ndarray, prompt_len: int, seed: int = 0) -> list[list[int]]:
  """The held-out ``rows``, each cut to a length drawn from ``[prompt_len/2, prompt_len]``."""
  lengths = np.random.default_rng(seed).integers(prompt_len // 2, prompt_len + 1, len(rows))
  return [test_rows[r, :n].tolist() for r, n in zip(rows, lengths)]


def decode_in_chunks(fns, prompts, batch: int, repeats: int):
  """Each ``fn(chunk)`` of ``fns`` over consecutive chunks of ``batch`` prompts: a list of ``(outputs,
  seconds)``, one per ``fn``, where each chunk's time is its best of ``repeats`` calls (the first call of a
  new shape compiles). The calls alternate between the ``fns`` chunk by chunk, so a drift in the machine's
  speed (other guests on the host) reaches all of them alike instead of biasing their ratio."""
  results = [([], 0.0) for _ in fns]
  for lo in range(0, len(prompts), batch):
    chunk = prompts[lo:lo + batch]
    times = [[] for _ in fns]
    for _ in range(repeats):
      for i, fn in enumerate(fns):
        start = time.perf_counter()
        out = fn(chunk)
        times[i].append(time.perf_counter() - start)
        if len(times[i]) == 1:
          results[i][0].append(out)
    results = [(outs, seconds + min(t)) for (outs, seconds), t in zip(results, times)]
  return results


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", default="runs/speculative", help="train_speculative's --workdir")
  parser.add_argument("--num-prompts", type=int, default=100)
  parser.add_argument("--prompt-len", type=int, default=64, help="longest prompt; lengths spread over [n/2, n]")
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--num-draft", default="1,2,3,4", help="K, tokens drafted per target forward; a comma list "
                      "of candidates is chosen from per batch size on the validation prompts")
  parser.add_argument("--validation-prompts", type=int, default=32,
                      help="held-out prompts (disjoint from the measured ones) that choose K among candidates")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--tie-gap", type=float, default=1e-4, help="top-two logit gap below which a greedy "
                      "difference is a near-tie (float32 rounding of the K+1-token verification)")
  parser.add_argument("--default-malloc", action="store_true",
                      help="keep glibc's default allocator settings (the launcher's are used otherwise)")
  parser.add_argument("--cpus", type=int, default=0, help="pin to the first N CPUs (0 = all)")
  args = parser.parse_args()
  if args.repeats < 2:
    parser.error("--repeats must be at least 2 (the first call of each shape compiles)")
  batches = [int(b) for b in args.batches.split(",")]
  temperatures = [float(t) for t in args.temperatures.split(",")]

  run = conditions.start("speculative decoding vs the target alone (stdlib models)")
  target, head, meta = load_speculative(os.path.join(args.workdir, "checkpoints", "speculative"))
  tokenizer = stdlib_corpus.load_tokenizer(os.path.join(args.workdir, "tokenizer"))
  candidates = [int(k) for k in args.num_draft.split(",")]
  test_rows = np.load(os.path.join(args.workdir, "data", "test.npy"))
  measured, validation = held_out_rows(len(test_rows), args.num_prompts,
                                       args.validation_prompts if len(candidates) > 1 else 0)
  prompts = held_out_prompts(test_rows, measured, args.prompt_len)
  validation_prompts = held_out_prompts(test_rows, validation, args.prompt_len, seed=1)
  drafter = EagleDrafter(target, head)
  print(f"target: {target.cfg.num_params() / 1e6:.2f}M params ({target.cfg.num_layers} blocks, d "
        f"{target.cfg.hidden_size}); drafter reads blocks {head.feature_layers}; corpus {meta['corpus_hash'][:16]}")
  print(f"{len(prompts)} held-out prompts of {args.prompt_len // 2}-{args.prompt_len} tokens, up to "
        f"{args.new_tokens} new, EOS id {tokenizer.eos_id}, K in {candidates}, best of {args.repeats} per chunk")

  common = dict(eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id, min_prompt_bucket=args.prompt_len)
  key = jax.random.key(0)  # Every call, target alone and speculative: the same draws.

  def speculative(chunk, k, temperature):
    return speculative_generate(target, drafter, chunk, args.new_tokens, key, num_draft=k,
                                temperature=temperature, **common)

  def choose_num_draft(b: int) -> int:
    """The candidate with the most greedy speculative tokens/s at batch ``b`` on the validation prompts."""
    if len(candidates) == 1:
      return candidates[0]
    rates, notes = {}, []
    runs = decode_in_chunks([lambda c, k=k: speculative(c, k, 0) for k in candidates], validation_prompts, b,
                            args.repeats)
    for k, (outs, seconds) in zip(candidates, runs):
      rates[k] = sum(int(o.lengths.sum()) for o in outs) / seconds
      iterations = sum(int(o.stats.target_forwards.max()) for o in outs)
      notes.append(f"K={k}: {rates[k]:.0f} tok/s, {seconds / iterations * 1e3:.1f} ms/iteration")
    best = max(rates, key=rates.get)
    print(f"batch {b}: K = {best} chosen on {len(validation_prompts)} validation prompts (greedy speculative: "
          f"{'; '.join(notes)})")
    return best

  chosen = {b: choose_num_draft(b) for b in batches}
  speedups, taus, failures = {}, {}, 0
  header = (f"{'batch':>5} | {'K':>2} | {'temp':>4} | {'target tok/s':>12} | {'spec tok/s':>10} | {'speedup':>7} | "
            f"{'tau':>5} | {'gamma':>6} | {'implied':>7} | {'verify':>6} | {'costed':>7} | {'row use':>7} | "
            f"{'EOS rows':>8} | per-position acceptance")
  print(header)
  print("-" * len(header))
  for b in batches:
    k = chosen[b]
    context = args.prompt_len + args.new_tokens // 2
    times = decode_step_seconds(target, head, batch=b, context=context)
    gamma = times["drafter_s"] / times["target_s"]
    # The measured cost model: generate's decode step (compiled as generate compiles it) against one
    # verification of K + 1 tokens and K drafter steps (compiled as the engine's loop is).
    base_s = target_step_seconds(target, 1, b, context, compiler_options=decode_compiler_options(b))
    verify_s = target_step_seconds(target, k + 1, b, context)
    for temperature in temperatures:
      (ref, ref_s), (spec, spec_s) = decode_in_chunks(
          [lambda c: generate(target, c, args.new_tokens, key, temperature=temperature, **common),
           lambda c: speculative(c, k, temperature)], prompts, b, args.repeats)
      ref_tokens = sum(int(o.lengths.sum()) for o in ref)
      spec_tokens = sum(int(o.lengths.sum()) for o in spec)
      forwards = sum(int(o.stats.target_forwards.sum()) for o in spec)
      accepted = sum(int(o.stats.accepted.sum()) for o in spec)
      per_position = sum(o.stats.accepted_per_position.sum(axis=0) for o in spec) / forwards
      tau = (accepted + forwards) / forwards
      speedup = (spec_tokens / spec_s) / (ref_tokens / ref_s)
      eos_rows = sum(o.finish_reasons.count("eos") for o in spec)
      # The loop runs until a chunk's slowest row is done: its iterations are the chunk's most forwards.
      row_use = forwards / sum(len(o.lengths) * int(o.stats.target_forwards.max()) for o in spec)
      print(f"{b:>5} | {k:>2} | {temperature:>4g} | {ref_tokens / ref_s:>12.0f} | {spec_tokens / spec_s:>10.0f} | "
            f"{speedup:>6.2f}x | {tau:>5.2f} | {gamma:>6.3f} | {tau / (1 + k * gamma):>6.2f}x | "
            f"{verify_s / base_s:>6.2f} | {tau * base_s / (verify_s + k * times['drafter_s']):>6.2f}x | "
            f"{row_use:>7.2f} | {eos_rows:>8} | {np.round(per_position, 3).tolist()}")
      if temperature == 0:
        speedups[b], taus[b] = speedup, tau
        ties, mismatches, identical = [], [], 0
        for chunk, (o, r) in enumerate(zip(spec, ref)):
          agreement = compare_greedy(target, prompts[chunk * b:(chunk + 1) * b], o, r, args.tie_gap)
          identical += agreement.identical
          ties += [d._replace(row=d.row + chunk * b) for d in agreement.near_ties]
          mismatches += [d._replace(row=d.row + chunk * b) for d in agreement.mismatches]
        print(f"      greedy at batch {b}: {identical}/{len(prompts)} rows identical to the target alone, "
              f"{len(ties)} near-ties (gap < {args.tie_gap:g}: {[(d.row, d.position) for d in ties]}), "
              f"{len(mismatches)} mismatches {[(d.row, d.position, round(d.gap, 5)) for d in mismatches]}")
        failures += len(mismatches)
  run.finish()
  if failures:
    raise SystemExit(f"{failures} greedy rows differ from the target alone without a near-tie")
  line = " ".join(f"speculative_speedup_b{b}={speedups[b]:.2f}" for b in batches if b in speedups)
  print(f"{line} tau={taus[min(taus)]:.3f}" if taus else line)


if __name__ == "__main__":
  main()
