r"""Trains the stdlib tokenizer, target decoder and EAGLE-3 drafter in one command.

    python -m experiments.train_speculative --config=configs/stdlib_speculative.py[:tiny] --workdir=DIR \
        [--config.target.steps=... ...]

Stages (each resumes from ``DIR`` when re-run; see ``configs/stdlib_speculative.py`` for the budget):

1. corpus: Python's standard library of this interpreter, split by package (``data/corpus.json`` records the
   hash, the packages of each split and every dropped file); a byte-level BPE tokenizer trained on the
   training packages (``tokenizer/``); the files packed into rows of ``seq_len`` tokens (``data/*.npy``).
2. target: next-token loss on the training rows; held-out NLL on the test packages' rows
   (``checkpoints/target``).
3. self-distillation data: the target's own continuations (greedy and sampled, cycled) of prompts cut from
   training rows (``data/distill.npz``).
4. drafter: EAGLE-3 training-time test against the target's soft labels on that data (``checkpoints/
   drafter``); held-out per-step top-1 agreement and acceptance probability.
5. report: batch-1 decode step time of the target and the drafter (their ratio should be at least
   ``eval.min_cost_ratio``), and greedy speculative decoding of held-out prompts against the target alone
   (identical output, acceptance length ``tau``); the target and the drafter saved together
   (``checkpoints/speculative``, ``lemon_rl.training.drafter_training.load_speculative``); ``summary.json``.
"""

import functools
import json
import os
import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "configs/stdlib_speculative.py[:variant]", lock_config=True)
flags.DEFINE_string("workdir", None, "Output directory (resumed if it exists).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def log(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int):
  """Rows of (1-based) ``step``: consecutive slices of a fresh permutation per epoch (resumable)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  per_epoch = max(num_rows // batch_size, 1)
  epoch, index = divmod(step - 1, per_epoch)
  order = np.random.default_rng([seed, epoch]).permutation(num_rows)
  rows = order[index * batch_size:(index + 1) * batch_size]
  return rows if len(rows) == batch_size else np.resize(order, batch_size)


def prepare_data(c, workdir: str):
  """Stage 1: ``(tokenizer, train_rows, test_rows, info)``."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lemon_rl.data import stdlib_corpus  # pylint: disable=g-import-not-at-top

  data_dir, tok_dir = os.path.join(workdir, "data"), os.path.join(workdir, "tokenizer")
  os.makedirs(data_dir, exist_ok=True)
  t0 = time.time()
  corpus = stdlib_corpus.load_stdlib_corpus(test_percent=c.corpus.test_percent,
                                            near_duplicate_threshold=c.corpus.near_duplicate_threshold,
                                            max_chars_per_split=c.corpus.max_chars_per_split)
  manifest_path = os.path.join(data_dir, "corpus.json")
  if os.path.exists(manifest_path):
    with open(manifest_path) as f:
      saved = json.load(f)["hash"]
    if saved != corpus.hash:
      raise SystemExit(f"{workdir} was built from corpus {saved}, this interpreter's is {corpus.hash}: "
                       "use a new --workdir")
  corpus.write_manifest(manifest_path)
  manifest = corpus.manifest()
  log(f"corpus {corpus.hash[:16]}: train {len(corpus.train)} files / {len(corpus.packages('train'))} packages, "
      f"test {len(corpus.test)} files / {len(corpus.packages('test'))} packages "
      f"({', '.join(corpus.packages('test'))}); dropped "
      f"{ {k: len(v) for k, v in corpus.dropped.items()} }")
  if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
    tokenizer = stdlib_corpus.train_tokenizer(corpus.texts("train"), tok_dir, c.tokenizer.vocab_size)
  else:
    tokenizer = stdlib_corpus.load_tokenizer(tok_dir)
  rows = {}
  for split in ("train", "test"):
    path = os.path.join(data_dir, f"{split}.npy")
    if not os.path.exists(path):
      docs = stdlib_corpus.encode_documents(tokenizer, corpus.texts(split))
      np.save(path, stdlib_corpus.pack_documents(docs, c.data.seq_len, tokenizer.eos_id))
    rows[split] = np.load(path)
  info = {"corpus_hash": corpus.hash, "tokenizer_sha256": stdlib_corpus.file_sha256(
      os.path.join(tok_dir, "tokenizer.json")), "vocab_size": tokenizer.vocab_size,
          "train_tokens": int(rows["train"].size), "test_tokens": int(rows["test"].size),
          "chars_per_token": manifest["splits"]["train"]["chars"] / max(rows["train"].size, 1),
          "data_s": time.time() - t0}
  log(f"tokenizer {tokenizer.vocab_size} ids; rows of {c.data.seq_len}: train {rows['train'].shape[0]}, "
      f"test {rows['test'].shape[0]} ({info['chars_per_token']:.2f} chars/token) in {info['data_s']:.0f}s")
  return tokenizer, rows["train"], rows["test"], info


def train_loop(name: str, workdir: str, state, steps: int, step_fn, eval_fn, eval_every: int,
               checkpoint_every: int, writer):
  """``step_fn(state, step) -> (state, metrics)`` run to ``steps`` as a phase of the shared runner (resumed from
  ``workdir/checkpoints/<name>``, checkpointed on SIGTERM), ``eval_fn(state) -> metrics`` every ``eval_every``
  steps; returns ``(state, seconds in steps)``."""
  from ml_collections import config_dict as cd  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import experiment, phases  # pylint: disable=g-import-not-at-top

  phase = phases.numbered_phase(state, step_fn, steps, progress_keys=("loss",), eval_every=eval_every,
                                evaluate=eval_fn)
  return experiment.run_phase(name, phase, workdir, cd.ConfigDict(
      {"every": checkpoint_every, "max_to_keep": 2, "async_save": True}), writer)


def train_target(c, workdir: str, tokenizer, train_rows, test_rows, writer):
  """Stage 2: the target ``Transformer`` and its held-out metrics."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from lemon_rl.models import Transformer, get_preset  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import state as state_lib  # pylint: disable=g-import-not-at-top
  from lemon_rl.training.sft import SFTLoss  # pylint: disable=g-import-not-at-top

  t = c.target
  cfg = get_preset(t.preset, vocab_size=tokenizer.vocab_size, num_layers=t.num_layers, hidden_size=t.hidden_size,
                   num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, mlp_dim=t.mlp_dim)
  optimizer = state_lib.make_optimizer(t.learning_rate, t.steps, warmup_steps=t.warmup_steps,
                                       weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm)
  graphdef, state = state_lib.create_train_state(Transformer(cfg, rngs=nnx.Rngs(c.seed)), optimizer, c.seed)
  loss = SFTLoss()
  log(f"target: {cfg.num_params() / 1e6:.2f}M parameters (d {cfg.hidden_size}, {cfg.num_layers} blocks), "
      f"{t.steps} steps of {t.batch_size} x {c.data.seq_len} tokens")

  def as_batch(rows):
    ids = jnp.asarray(rows, jnp.int32)
    return {"ids": ids, "attention_mask": jnp.ones_like(ids), "loss_mask": jnp.ones((ids.shape[0], ids.shape[1] - 1),
                                                                                      jnp.float32)}

  def step_fn(state, step):
    rows = train_rows[batch_indices(len(train_rows), t.batch_size, step, c.seed)]
    return state_lib.update_step(graphdef, state, as_batch(rows), loss_fn=loss, optimizer=optimizer)

  @functools.partial(jax.jit)
  def nll(params, batch):
    return loss(nnx.merge(graphdef, params), batch)[0]

  def eval_fn(state):
    rows = test_rows[:t.eval_rows]
    total, count = 0.0, 0.0
    for i in range(0, len(rows) - t.batch_size + 1, t.batch_size):
      pair = jax.device_get(nll(state.params, as_batch(rows[i:i + t.batch_size])))
      total, count = total + float(pair.sum), count + float(pair.denominator)
    value = total / max(count, 1.0)
    return {"test_nll": value, "test_bits_per_token": value / np.log(2)}

  state, elapsed = train_loop("target", workdir, state, t.steps, step_fn, eval_fn, t.eval_every, t.checkpoint_every,
                              writer)
  metrics = eval_fn(state)
  return nnx.merge(graphdef, state.params), {"target_train_s": elapsed, **{f"target_{k}": v for k, v in
                                                                          metrics.items()}}


def distillation_data(c, workdir: str, target, tokenizer, train_rows):
  """Stage 3: ``(tokens [N, P + G], mask [N, P + G])``, the target's continuations of training prompts."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lemon_rl.sampling import generate  # pylint: disable=g-import-not-at-top

  d = c.distill
  path = os.path.join(workdir, "data", "distill.npz")
  width = d.prompt_len + d.new_tokens
  if os.path.exists(path):
    saved = np.load(path)
    if saved["tokens"].shape == (d.num_sequences, width):
      return saved["tokens"], saved["mask"], 0.0
  t0 = last_print = time.time()
  order = np.random.default_rng([c.seed, 1]).permutation(len(train_rows))
  order = np.resize(order, d.num_sequences)
  tokens = np.full((d.num_sequences, width), tokenizer.pad_id, np.int32)
  mask = np.zeros((d.num_sequences, width), np.int32)
  for r, lo in enumerate(range(0, d.num_sequences, d.batch_size)):
    rows = order[lo:lo + d.batch_size]
    prompts = train_rows[rows, :d.prompt_len]
    out = generate(target, prompts.tolist(), d.new_tokens, jax.random.fold_in(jax.random.key(c.seed), r),
                   temperature=d.temperatures[r % len(d.temperatures)], eos_ids=tokenizer.eos_id,
                   pad_id=tokenizer.pad_id, min_prompt_bucket=d.prompt_len)
    n = len(rows)
    tokens[lo:lo + n] = np.concatenate([prompts, out.tokens], axis=1)
    mask[lo:lo + n] = np.concatenate([np.ones_like(prompts), out.mask], axis=1)
    if r == 0 or time.time() - last_print > 30:
      last_print = time.time()
      log(f"distill: {lo + n}/{d.num_sequences} continuations, {time.time() - t0:.0f}s")
  np.savez(path, tokens=tokens, mask=mask)
  log(f"distill: {d.num_sequences} continuations ({int(mask.sum())} tokens) in {time.time() - t0:.0f}s")
  return tokens, mask, time.time() - t0


def train_drafter(c, workdir: str, target, distill_tokens, distill_mask, test_rows, writer):
  """Stage 4: the trained ``EagleHead`` and its held-out metrics."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from lemon_rl import ops  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import drafter_training as dt  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import state as state_lib  # pylint: disable=g-import-not-at-top

  d = c.drafter
  head = dt.head_from_config(target.cfg, d, c.seed + 2)
  loss = dt.loss_from_config(d)
  optimizer = dt.optimizer_from_config(d)
  head_def, state = state_lib.create_train_state(head, optimizer, c.seed)
  target_def, target_params = nnx.split(target)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  log(f"drafter: {num_params / 1e6:.2f}M trainable parameters, feature layers {head.feature_layers}, "
      f"{loss.num_steps} unrolled steps, {d.steps} steps of {d.batch_size} x {distill_tokens.shape[1]} tokens")

  def step_fn(state, step):
    rows = batch_indices(len(distill_tokens), d.batch_size, step, c.seed + 2)
    batch = {"tokens": jnp.asarray(distill_tokens[rows]), "mask": jnp.asarray(distill_mask[rows])}
    return dt.update_step(head_def, state, target_def, target_params, batch, loss=loss, optimizer=optimizer)

  def eval_fn(state):
    rows = test_rows[:d.eval_rows]
    totals = None
    for i in range(0, len(rows) - d.batch_size + 1, d.batch_size):
      ids = jnp.asarray(rows[i:i + d.batch_size])
      metrics = dt.eval_metrics(head_def, state.params, target_def, target_params,
                                {"tokens": ids, "mask": jnp.ones_like(ids)}, loss=loss)
      totals = metrics if totals is None else ops.merge_metrics(totals, metrics)
    values = jax.device_get(ops.metric_values(totals))
    return {f"test_{k}": float(v) for k, v in values.items() if k == "loss" or k.split("_")[0] in ("top1", "accept")}

  state, elapsed = train_loop("drafter", workdir, state, d.steps, step_fn, eval_fn, d.eval_every, d.checkpoint_every,
                              writer)
  metrics = eval_fn(state)
  return nnx.merge(head_def, state.params), {"drafter_train_s": elapsed, **{f"drafter_{k}": v for k, v in
                                                                           metrics.items()}}


def report(c, target, head, tokenizer, test_rows):
  """Stage 5: cost ratio and speculative decoding of held-out prompts against the target alone."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lemon_rl.models.drafter import EagleDrafter  # pylint: disable=g-import-not-at-top
  from lemon_rl.sampling import generate, speculative_generate  # pylint: disable=g-import-not-at-top
  from lemon_rl.training.drafter_training import decode_step_seconds  # pylint: disable=g-import-not-at-top

  e = c.eval
  times = decode_step_seconds(target, head, batch=1, context=e.timing_context, steps=e.timing_steps)
  gamma = times["drafter_s"] / times["target_s"]
  verdict = "ok" if times["ratio"] >= e.min_cost_ratio else f"BELOW the required {e.min_cost_ratio}x"
  log(f"batch-1 decode step: target {times['target_s'] * 1e3:.2f} ms, drafter {times['drafter_s'] * 1e3:.2f} ms, "
      f"ratio {times['ratio']:.1f}x ({verdict}); gamma = {gamma:.3f}")
  rows = np.linspace(0, len(test_rows) - 1, e.num_prompts).astype(int)
  prompts = test_rows[rows, :e.prompt_len].tolist()
  drafter = EagleDrafter(target, head)
  key = jax.random.key(c.seed)
  ref = generate(target, prompts, e.max_new_tokens, key, temperature=0.0, eos_ids=tokenizer.eos_id,
                 pad_id=tokenizer.pad_id, min_prompt_bucket=c.distill.prompt_len)
  greedy = speculative_generate(target, drafter, prompts, e.max_new_tokens, key, num_draft=e.num_draft,
                                temperature=0.0, eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  tau_t1 = float("nan")
  if e.sampled:
    tau_t1 = speculative_generate(target, drafter, prompts, e.max_new_tokens, key, num_draft=e.num_draft,
                                  temperature=1.0, eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id).stats.mean_tau
  identical = int(sum(np.array_equal(a[:n], b[:m]) and n == m for a, b, n, m in
                      zip(greedy.tokens, ref.tokens, greedy.lengths, ref.lengths)))
  tau = greedy.stats.mean_tau
  out = {"target_step_ms": times["target_s"] * 1e3, "drafter_step_ms": times["drafter_s"] * 1e3,
         "cost_ratio": times["ratio"], "gamma": gamma, "greedy_identical_rows": identical,
         "eval_prompts": len(prompts), "tau_greedy": tau, "tau_t1": tau_t1,
         "accept_per_position_greedy": greedy.stats.acceptance_rate_per_position.round(3).tolist(),
         "implied_speedup_greedy": tau / (1 + e.num_draft * gamma)}
  log(f"held-out greedy: {identical}/{len(prompts)} rows identical to the target alone; tau {tau:.2f} "
      f"(per position {out['accept_per_position_greedy']}), at temperature 1 tau {tau_t1:.2f}; implied speedup "
      f"tau / (1 + K gamma) = {out['implied_speedup_greedy']:.2f}")
  return out


def run(c, workdir: str) -> dict:
  from lemon_rl.training import drafter_training as dt  # pylint: disable=g-import-not-at-top
  from lemon_rl.training.metrics import MetricsWriter  # pylint: disable=g-import-not-at-top

  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  writer = MetricsWriter(workdir, tensorboard=False)
  tokenizer, train_rows, test_rows, summary = prepare_data(c, workdir)
  target, info = train_target(c, workdir, tokenizer, train_rows, test_rows, writer)
  summary.update(info)
  tokens, mask, summary["distill_s"] = distillation_data(c, workdir, target, tokenizer, train_rows)
  head, info = train_drafter(c, workdir, target, tokens, mask, test_rows, writer)
  summary.update(info)
  summary.update(report(c, target, head, tokenizer, test_rows))
  final = os.path.join(workdir, "checkpoints", "speculative")
  if not os.path.exists(os.path.join(final, str(c.drafter.steps))):
    dt.save_speculative(final, c.drafter.steps, target, head,
                        {"tokenizer": "tokenizer", "corpus_hash": summary["corpus_hash"],
                         "tokenizer_sha256": summary["tokenizer_sha256"], "config": c.to_json()})
  summary["total_s"] = time.time() - t0
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  writer.close()
  log(f"done in {summary['total_s'] / 60:.1f} min; {os.path.join(workdir, 'summary.json')}")
  print(f"cost_ratio={summary['cost_ratio']:.2f} tau_greedy={summary['tau_greedy']:.3f} "
        f"greedy_identical={summary['greedy_identical_rows']}/{summary['eval_prompts']} "
        f"target_test_nll={summary['target_test_nll']:.4f}", flush=True)
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
