r"""PPOW fine-tuning of a token-level EAGLE-3 drafter, with held-out ``tau`` before and after.

    python -m experiments.train_ppow --config=configs/ppow_drafter.py[:variant] --workdir=DIR \
        --config.init_from=SPEC_WORKDIR [--config.ppow.steps=... ...]

``SPEC_WORKDIR`` is a finished ``experiments/train_speculative.py`` run. Stages:

1. load the target and the token-level drafter (``SPEC_WORKDIR/checkpoints/speculative``), its tokenizer
   (EOS / pad ids), the target's continuations ``data/distill.npz`` (PPOW's prefixes) and the held-out rows
   ``data/test.npy``; optionally measure ``gamma`` (``ppow.measured_gamma``);
2. held-out ``tau`` of the token-level drafter: ``speculative_generate`` of ``eval.num_prompts`` held-out
   prompts, greedy (and at temperature 1), ``K = ppow.num_draft``;
3. PPOW (``lemon_rl.training.ppow_training``), resumable from ``DIR/checkpoints/ppow``; metrics every step
   in ``DIR/metrics.jsonl`` (phase ``ppow``);
4. held-out ``tau`` of the PPOW drafter on the same prompts and keys; the target and the PPOW drafter saved
   together as ``DIR/checkpoints/speculative`` (``drafter_training.load_speculative``); ``summary.json``.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "configs/ppow_drafter.py[:variant]", lock_config=True)
flags.DEFINE_string("workdir", None, "Output directory (resumed if it exists).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def log(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def held_out_tau(c, target, head, tokenizer, test_rows, num_draft: int) -> dict:
  """Speculative decoding of held-out prompts (greedy, and at temperature 1 if ``eval.sampled``)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lemon_rl.models.drafter import EagleDrafter  # pylint: disable=g-import-not-at-top
  from lemon_rl.sampling import speculative_generate  # pylint: disable=g-import-not-at-top

  e = c.eval
  rows = np.linspace(0, len(test_rows) - 1, e.num_prompts).astype(int)
  prompts = test_rows[rows, :e.prompt_len].tolist()
  drafter = EagleDrafter(target, head)
  key = jax.random.key(c.seed)
  out = {}
  for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
    if name == "t1" and not e.sampled:
      continue
    stats = speculative_generate(target, drafter, prompts, e.max_new_tokens, key, num_draft=num_draft,
                                 temperature=temperature, eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                 min_prompt_bucket=e.prompt_len).stats
    out[f"tau_{name}"] = stats.mean_tau
    out[f"accept_per_position_{name}"] = stats.acceptance_rate_per_position.round(4).tolist()
  return out


def run(c, workdir: str) -> dict:
  from lemon_rl.training import drafter_training as dt  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import ppow_training as pt  # pylint: disable=g-import-not-at-top
  from lemon_rl.training.metrics import MetricsWriter  # pylint: disable=g-import-not-at-top

  if not c.init_from:
    raise SystemExit("--config.init_from=SPEC_WORKDIR (a finished experiments.train_speculative run) is required")
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  writer = MetricsWriter(workdir, tensorboard=False)
  target, head, spec_config, tokenizer, tokens, mask, test_rows = pt.load_start(c.init_from)
  p = c.ppow
  min_prefix = p.min_prefix
  if min_prefix is None:
    min_prefix = max(int(spec_config.get("distill", {}).get("prompt_len", 2)) - 1, 1)
  gamma = p.gamma
  summary = {"variant": c.variant, "init_from": os.path.abspath(c.init_from), "min_prefix": min_prefix}
  if p.measured_gamma:
    times = dt.decode_step_seconds(target, head, batch=1, context=c.eval.timing_context, steps=c.eval.timing_steps)
    gamma = times["drafter_s"] / times["target_s"]
    summary.update({"target_step_ms": times["target_s"] * 1e3, "drafter_step_ms": times["drafter_s"] * 1e3})
  summary["gamma"] = gamma
  cfg = pt.ppow_config_from_config(p, eos_id=tokenizer.eos_id, gamma=gamma, min_prefix=min_prefix)
  log(f"PPOW ({c.variant}): {tokens.shape[0]} target sequences of {tokens.shape[1]} tokens, K {cfg.num_draft}, "
      f"{cfg.num_prefixes} prefixes x {cfg.group_size} windows per step, verification {cfg.verification}, "
      f"gamma {gamma:.3f}, R_dist {'on' if cfg.use_dist_reward else 'off'}, ADAW {'on' if cfg.adaw else 'off'}, "
      f"P >= {min_prefix}")
  before = held_out_tau(c, target, head, tokenizer, test_rows, cfg.num_draft)
  log("token-level drafter, held-out: " + ", ".join(f"{k} {v}" for k, v in before.items()))
  trainer = pt.PPOWTrainer(target, head, tokens, mask, cfg, pt.optimizer_from_config(p), seed=c.seed)
  state, elapsed = pt.train(trainer, workdir, p.steps, writer=writer, checkpoint_every=p.checkpoint_every)
  trained = trainer.head(state)
  after = held_out_tau(c, target, trained, tokenizer, test_rows, cfg.num_draft)
  log("PPOW drafter, held-out: " + ", ".join(f"{k} {v}" for k, v in after.items()))
  final = os.path.join(workdir, "checkpoints", "speculative")
  if not os.path.exists(os.path.join(final, str(p.steps))):
    dt.save_speculative(final, p.steps, target, trained, {"tokenizer": os.path.join(os.path.abspath(c.init_from),
                                                                                    "tokenizer"),
                                                          "config": c.to_json(), "init_from": summary["init_from"]})
  summary.update({f"before_{k}": v for k, v in before.items()})
  summary.update({f"after_{k}": v for k, v in after.items()})
  summary.update({"ppow_train_s": elapsed, "steps": p.steps, "total_s": time.time() - t0})
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  writer.close()
  print(f"variant={c.variant} tau_greedy {before['tau_greedy']:.3f} -> {after['tau_greedy']:.3f}"
        + (f" tau_t1 {before['tau_t1']:.3f} -> {after['tau_t1']:.3f}" if "tau_t1" in after else ""), flush=True)
  return summary


def main(argv):
  del argv
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint operation at INFO
  run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()
  sys.exit(app.run(main))
