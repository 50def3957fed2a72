r"""PPOW against a compute-matched token-level drafter, and its ablations, over seeds (METHODS.md section 3).

    python -m experiments.reproduce_ppow --workdir=runs/ppow --init_from=SPEC_WORKDIR --seeds=0,1 --steps=10 \
        [--ppow_lrs=3e-5,1e-4 --control_lrs=1e-4,3e-4]

``SPEC_WORKDIR`` is a finished ``experiments/train_speculative.py`` run (target, token-level drafter,
``data/distill.npz``, ``data/test.npy``, tokenizer); it is only read. Arms (``--arms``), every one from the
same start drafter with the same seeds:

  ``control``  the token-level drafter trained on by token distillation (its own training-time-test loss,
               ``drafter_training.DrafterLoss`` of the spec run, on the same ``distill.npz`` rows PPOW draws
               its prefixes from) for the compute of ``--steps`` steps of the ``full`` arm;
  ``full``, ``no_dist``, ``no_adaw``, ``neither``: PPOW (``configs/ppow_drafter.py:<arm>``), ``--steps`` steps.

*Compute matching.* Before any arm trains, ``--calibration_steps`` steps of ``full`` and of token
distillation are timed (process CPU seconds, after their compile, start drafter) and the control runs
``round(steps * cpu_full / cpu_distill)`` distillation steps: the CPU time of PPOW's most expensive arm
(the ablations without ADAW do not score the pool and cost less). Recorded in the results.

*Splits.* ``data/test.npy`` rows (held-out stdlib files) are split by position: ``2 n`` evenly spaced rows,
alternately validation and test (``n = eval.num_prompts``); a prompt is a row's first ``eval.prompt_len``
tokens. Asserted before anything runs: no validation or test prompt occurs as a contiguous token window of
any distillation row (the PPOW / control training data), and no prompt is in both splits.

*Tuning.* One hyper-parameter, the learning rate, chosen per arm on the validation split only
(``lemon_rl.eval.tuning``): every arm gets the same number of trials (``--ppow_lrs`` for the PPOW arms,
``--control_lrs`` for the control, equally long), run on the first seed; the score is validation
``(tau_greedy + tau_t1) / 2``. The chosen trial's drafter of the first seed is the first seed's run of
that arm (the same seed and settings would reproduce it), then evaluated once on the test split.

*Headroom* (step 0, thresholds in ``configs/ppow_drafter.py``'s ``headroom``, checked before training):
the start drafter's validation ``tau_greedy`` and first-position acceptance, and the share of prefixes of one
step-0 batch of ``full`` whose ``G_roll`` windows differ in reward (non-zero advantages).

*Evaluation.* ``speculative_generate`` (the lossless engine) of the split's prompts, ``K = ppow.num_draft``,
greedy and temperature 1, the same prompts and PRNG key (per seed) for every arm: mean ``tau`` (tokens per
target forward) and per-position acceptance; implied speedup ``tau / (1 + K gamma)`` with the spec run's
measured batch-1 cost ratio ``gamma``.

*Statistics.* Per seed, paired differences on the test split; the family of claimed directions (the paper's:
PPOW ``tau`` > token-level ``tau``; each ablation lowers ``tau``), at greedy and at temperature 1, Holm-
corrected (``lemon_rl.eval.stats.holm_paired_intervals``); see :mod:`experiments.reports.ppow`.

Results: ``experiments/results/ppow/results.json``; ``experiments/RESULTS.md`` is regenerated.
Intermediate runs are cached under ``--workdir`` (a rerun re-reads them).
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import sys
import time

from absl import app
from absl import flags

from experiments import results_md
from experiments.reports import ppow as report

ARMS = ("control", "full", "no_dist", "no_adaw", "neither")

flags.DEFINE_string("workdir", None, "Directory of cached runs.")
flags.DEFINE_string("init_from", None, "A finished experiments/train_speculative.py workdir (read only).")
flags.DEFINE_string("seeds", "0,1", "Comma-separated seeds (the first one tunes the learning rates).")
flags.DEFINE_integer("steps", 30, "PPOW steps per arm (the control gets the same CPU time).")
flags.DEFINE_string("arms", ",".join(ARMS), "Comma-separated arms (control, full, no_dist, no_adaw, neither).")
flags.DEFINE_string("ppow_lrs", "3e-5,1e-4", "Learning-rate trials of every PPOW arm (validation).")
flags.DEFINE_string("control_lrs", "1e-4,3e-4", "Learning-rate trials of the control (as many as ppow_lrs).")
flags.DEFINE_string("size", "cpu", "configs/ppow_drafter.py size: cpu or tiny.")
flags.DEFINE_integer("calibration_steps", 3, "Timed steps of each kind for the compute matching.")
flags.DEFINE_string("results_file", report.RESULTS_FILE,
                    "Where the results JSON goes (absolute, or relative to the repository).")
flags.DEFINE_float("family_alpha", 0.05, "Familywise error rate of the claimed directions (Holm).")
flags.mark_flags_as_required(["workdir", "init_from"])
FLAGS = flags.FLAGS


def log(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- splits ---------------------------------------------------------------------------------------------


def split_rows(num_rows: int, num_prompts: int):
  """``(validation rows, test rows)`` of ``data/test.npy``: ``2 n`` evenly spaced rows, alternately."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if 2 * num_prompts > num_rows:
    raise ValueError(f"{num_rows} held-out rows cannot give two splits of {num_prompts} prompts")
  rows = np.linspace(0, num_rows - 1, 2 * num_prompts).round().astype(int)
  return rows[0::2], rows[1::2]


def _window_hashes(tokens, length: int):
  """A polynomial hash (uint64, wrapping) of every contiguous ``length``-token window of each row."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  tokens = np.asarray(tokens, np.uint64)
  powers = np.full(length, 1000003, np.uint64) ** np.arange(length - 1, -1, -1, dtype=np.uint64)
  windows = np.lib.stride_tricks.sliding_window_view(tokens, length, axis=-1)
  with np.errstate(over="ignore"):
    return (windows * powers).sum(axis=-1, dtype=np.uint64)


def check_disjoint(prompts: dict, train_tokens, train_mask) -> dict:
  """Asserts that no prompt of any split occurs in the training rows, nor in two splits; returns counts.

  Args:
    prompts: split name -> ``[n, L]`` prompts (equal ``L``).
    train_tokens, train_mask: ``[N, T]`` the distillation rows (right padded).

  A candidate (equal hash) is compared token by token, so a hash collision cannot hide or fake a match.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  length = next(iter(prompts.values())).shape[1]
  hashes = _window_hashes(train_tokens, length)  # [N, T - L + 1]
  real = np.lib.stride_tricks.sliding_window_view(np.asarray(train_mask) != 0, length, axis=-1).all(-1)
  out = {"train_windows": int(real.sum()), "window_length": length}
  for name, p in prompts.items():
    p = np.asarray(p)
    prompt_hashes = _window_hashes(p, length)[:, 0]
    candidates = zip(*np.nonzero(real & np.isin(hashes, prompt_hashes)))  # then compared token by token
    leaked = {i for r, c in candidates for i in np.flatnonzero(prompt_hashes == hashes[r, c])
              if np.array_equal(train_tokens[r, c:c + length], p[i])}
    out[f"{name}_prompts"] = int(len(p))
    out[f"{name}_in_train"] = len(leaked)
  names = list(prompts)
  keys = {name: {tuple(int(x) for x in row) for row in prompts[name]} for name in names}
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      out[f"{a}_in_{b}"] = len(keys[a] & keys[b])
  leaks = {k: v for k, v in out.items() if "_in_" in k and v}
  assert not leaks, f"evaluation prompts overlap the training data or each other: {leaks}"
  return out


# -- the models: start drafter, evaluation, the two kinds of training -----------------------------------


class Setup:
  """Everything every arm shares: the frozen target, the start drafter, the data and the splits."""

  def __init__(self, init_from: str, size: str):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
    from configs import ppow_drafter  # pylint: disable=g-import-not-at-top
    from lemon_rl.training import ppow_training as pt  # pylint: disable=g-import-not-at-top
    from lemon_rl.training import drafter_training as dt  # pylint: disable=g-import-not-at-top

    self.size = size
    target, head, spec, self.tokenizer, tokens, mask, test_rows = pt.load_start(init_from)
    self.tokens, self.mask = np.asarray(tokens, np.int32), np.asarray(mask, np.int32)
    self.target = target
    self.head_def, start = nnx.split(head)
    self.start = jax.device_get(start)  # Host copy: every run starts from fresh arrays (updates donate).
    self.config = ppow_drafter.get_config(self.variant("full"))
    self.num_draft = int(self.config.ppow.num_draft)
    self.min_prefix = self.config.ppow.min_prefix
    if self.min_prefix is None:
      self.min_prefix = max(int(spec.get("distill", {}).get("prompt_len", 2)) - 1, 1)
    self.drafter_config = config_dict.ConfigDict(spec["drafter"])
    self.distill_loss = dt.loss_from_config(self.drafter_config)
    summary = os.path.join(init_from, "summary.json")
    self.gamma = float(self.config.ppow.gamma)
    if os.path.exists(summary):
      with open(summary) as f:
        self.gamma = float(json.load(f).get("gamma", self.gamma))
    e = self.config.eval
    val_rows, test_rows_ = split_rows(len(test_rows), int(e.num_prompts))
    self.rows = {"validation": val_rows.tolist(), "test": test_rows_.tolist()}
    self.prompts = {"validation": np.asarray(test_rows[val_rows, :e.prompt_len]),
                    "test": np.asarray(test_rows[test_rows_, :e.prompt_len])}
    self.disjointness = check_disjoint(self.prompts, self.tokens, self.mask)
    self._optimizers = {}
    self._param_def = nnx.split(self.head(), nnx.Param)[0]  # For token distillation's jitted update.
    self._target_def, self._target_params = nnx.split(self.target)

  def variant(self, arm: str) -> str:
    """The ``configs/ppow_drafter.py`` variant of a PPOW arm at this size."""
    return f"tiny,{arm}" if self.size == "tiny" else arm

  def head(self, params=None):
    """A fresh drafter head with ``params`` (default: the start drafter's)."""
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    head = nnx.merge(self.head_def, jax.tree.map(jnp.array, self.start))
    if params is not None:
      nnx.update(head, jax.tree.map(jnp.array, params))
    return head

  def optimizer(self, lr: float, steps: int):
    """One optimizer object per (lr, steps): it is a static argument of the jitted updates (one compile)."""
    from lemon_rl.training import state as state_lib  # pylint: disable=g-import-not-at-top
    p = self.config.ppow
    key = (float(lr), int(steps))
    if key not in self._optimizers:
      self._optimizers[key] = state_lib.make_optimizer(float(lr), int(steps), warmup_steps=p.warmup_steps,
                                                       weight_decay=p.weight_decay, max_grad_norm=p.max_grad_norm)
    return self._optimizers[key]

  def arm_config(self, arm: str):
    from configs import ppow_drafter  # pylint: disable=g-import-not-at-top
    from lemon_rl.training import ppow_training as pt  # pylint: disable=g-import-not-at-top
    c = ppow_drafter.get_config(self.variant(arm))
    return pt.ppow_config_from_config(c.ppow, eos_id=self.tokenizer.eos_id, gamma=float(c.ppow.gamma),
                                      min_prefix=self.min_prefix)

  def evaluate(self, head, split: str, seed: int) -> dict:
    """Held-out ``tau`` of ``head`` on ``split``: greedy and temperature 1, key ``(seed, split)``."""
    import jax  # pylint: disable=g-import-not-at-top
    from lemon_rl.models.drafter import EagleDrafter  # pylint: disable=g-import-not-at-top
    from lemon_rl.sampling import speculative_generate  # pylint: disable=g-import-not-at-top
    e = self.config.eval
    key = jax.random.fold_in(jax.random.key(seed), 0 if split == "validation" else 1)
    out = {}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
      stats = speculative_generate(self.target, EagleDrafter(self.target, head), self.prompts[split].tolist(),
                                   int(e.max_new_tokens), key, num_draft=self.num_draft, temperature=temperature,
                                   eos_ids=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                                   min_prompt_bucket=int(e.prompt_len)).stats
      out[f"tau_{name}"] = float(stats.mean_tau)
      out[f"accept_{name}"] = [float(x) for x in stats.acceptance_rate_per_position]
      out[f"speedup_{name}"] = float(stats.mean_tau) / (1.0 + self.num_draft * self.gamma)
    return out

  # PPOW.
  def ppow_trainer(self, arm: str, lr: float, steps: int, seed: int):
    from lemon_rl.training import ppow_training as pt  # pylint: disable=g-import-not-at-top
    return pt.PPOWTrainer(self.target, self.head(), self.tokens, self.mask, self.arm_config(arm),
                          self.optimizer(lr, steps), seed=seed)

  # Token distillation (the control).
  def distill_batch(self, seed: int, step: int) -> dict:
    import numpy as np  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng([seed, 11, step])
    rows = np.sort(rng.choice(len(self.tokens), size=int(self.drafter_config.batch_size), replace=False))
    return {"tokens": jnp.asarray(self.tokens[rows], jnp.int32), "mask": jnp.asarray(self.mask[rows], jnp.int32)}

  def distill_state(self, lr: float, steps: int, seed: int):
    import jax  # pylint: disable=g-import-not-at-top
    from lemon_rl.training import state as state_lib  # pylint: disable=g-import-not-at-top
    state = state_lib.create_train_state(self.head(), self.optimizer(lr, steps), seed)[1]
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)

  def distill_step(self, state, lr: float, steps: int, seed: int, step: int):
    from lemon_rl.training import drafter_training as dt  # pylint: disable=g-import-not-at-top
    return dt.update_step(self._param_def, state, self._target_def, self._target_params,
                          self.distill_batch(seed, step), loss=self.distill_loss,
                          optimizer=self.optimizer(lr, steps))


def _cpu() -> float:
  return time.process_time()


def calibrate(setup: Setup, steps: int, lr: float) -> dict:
  """CPU seconds per step of the ``full`` arm and of token distillation (median of ``steps`` after one
  compiling step each), on throwaway states from the start drafter."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  trainer = setup.ppow_trainer("full", lr, FLAGS.steps, seed=10_000)
  state = trainer.init_state()
  ppow_s = []
  for step in range(1, steps + 2):
    c0 = _cpu()
    state, metrics = trainer.step(state, step)
    jax.block_until_ready(metrics)
    ppow_s.append(_cpu() - c0)
  dstate = setup.distill_state(lr, FLAGS.steps, 10_000)
  distill_s = []
  for step in range(1, steps + 2):
    c0 = _cpu()
    dstate, metrics = setup.distill_step(dstate, lr, FLAGS.steps, 10_000, step)
    jax.block_until_ready(metrics)
    distill_s.append(_cpu() - c0)
  out = {"ppow_full_cpu_s": float(np.median(ppow_s[1:])), "distill_cpu_s": float(np.median(distill_s[1:])),
         "ppow_full_samples": ppow_s[1:], "distill_samples": distill_s[1:]}
  out["control_steps"] = max(1, int(round(FLAGS.steps * out["ppow_full_cpu_s"] / out["distill_cpu_s"])))
  return out


def headroom(setup: Setup, start_validation: dict) -> dict:
  """The step-0 gate of the config (raises ``HeadroomError`` when it fails)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lemon_rl.eval import headroom as hr  # pylint: disable=g-import-not-at-top
  trainer = setup.ppow_trainer("full", 1e-4, FLAGS.steps, seed=0)
  batch, _ = trainer.collect(trainer.init_state(), 1)
  advantages, mask = jax.device_get((batch["advantages"], batch["mask"]))
  g = trainer.cfg.group_size
  rollout = hr.HeadroomRollout(rewards=advantages, group_ids=np.arange(len(advantages)) // g,
                               lengths=mask.sum(axis=1))
  custom = {"start_tau_greedy": lambda _: start_validation["tau_greedy"],
            "start_accept_first_greedy": lambda _: start_validation["accept_greedy"][0]}
  gate = hr.HeadroomGate.from_config(setup.config.headroom)
  return gate.check(rollout, custom=custom).to_dict()


def train_arm(setup: Setup, arm: str, lr: float, seed: int, control_steps: int) -> tuple[dict, object]:
  """Trains one arm from the start drafter; ``(record, params)`` (curves, seconds)."""
  import jax  # pylint: disable=g-import-not-at-top
  curve, t0, c0 = [], time.time(), _cpu()
  if arm == "control":
    state = setup.distill_state(lr, control_steps, seed)
    for step in range(1, control_steps + 1):
      state, metrics = setup.distill_step(state, lr, control_steps, seed, step)
      if step % max(1, control_steps // 20) == 0 or step == control_steps:
        curve.append([step, float(jax.device_get(metrics["loss"]))])
    params, steps, curve_name = state.params, control_steps, "distill_loss"
  else:
    trainer = setup.ppow_trainer(arm, lr, FLAGS.steps, seed)
    state = trainer.init_state()
    for step in range(1, FLAGS.steps + 1):
      state, metrics = trainer.step(state, step)
      metrics = jax.device_get(metrics)
      curve.append([step, float(metrics["tau"]), float(metrics["reward"]), float(metrics["kl"])])
    params, steps, curve_name = state.params, FLAGS.steps, report.PPOW_CURVE
  params = jax.device_get(params)
  record = {"arm": arm, "lr": lr, "seed": seed, "steps": steps, "curve": curve, "curve_columns": curve_name,
            "wall_s": time.time() - t0, "cpu_s": _cpu() - c0}
  return record, params


def cached_run(setup: Setup, arm: str, lr: float, seed: int, control_steps: int) -> tuple[dict, object]:
  """A run's record and trained parameters, from ``--workdir`` when it has them."""
  name = os.path.join(FLAGS.workdir, "runs", f"{arm}_lr{lr:g}_seed{seed}_steps{FLAGS.steps}")
  if os.path.exists(name + ".json") and os.path.exists(name + ".pkl"):
    with open(name + ".json") as f, open(name + ".pkl", "rb") as g:
      return json.load(f), pickle.load(g)
  record, params = train_arm(setup, arm, lr, seed, control_steps)
  log(f"{arm} lr {lr:g} seed {seed}: {record['steps']} steps, {record['cpu_s']:.0f} CPU s")
  os.makedirs(os.path.dirname(name), exist_ok=True)
  with open(name + ".pkl", "wb") as g:
    pickle.dump(params, g)
  with open(name + ".json", "w") as f:
    json.dump(record, f)
  return record, params


def cached_eval(setup: Setup, key: str, head_fn, split: str, seed: int) -> dict:
  path = os.path.join(FLAGS.workdir, "evals", f"{key}_{split}.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  out = setup.evaluate(head_fn(), split, seed)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f)
  return out


def main(argv):
  del argv
  from experiments import machine  # pylint: disable=g-import-not-at-top
  from lemon_rl.eval import tuning  # pylint: disable=g-import-not-at-top

  seeds = [int(s) for s in FLAGS.seeds.split(",")]
  arms = [a for a in FLAGS.arms.split(",") if a]
  unknown = set(arms) - set(ARMS)
  if unknown:
    raise SystemExit(f"unknown arms {sorted(unknown)}; expected some of {ARMS}")
  ppow_lrs = [float(x) for x in FLAGS.ppow_lrs.split(",")]
  control_lrs = [float(x) for x in FLAGS.control_lrs.split(",")]
  if len(ppow_lrs) != len(control_lrs):
    raise SystemExit("every arm gets the same number of learning-rate trials: --ppow_lrs and --control_lrs")
  os.makedirs(FLAGS.workdir, exist_ok=True)
  t_start = time.time()
  setup = Setup(FLAGS.init_from, FLAGS.size)
  log(f"splits disjoint from the distillation data: {setup.disjointness}")

  start = {s: {split: cached_eval(setup, f"start_seed{s}", setup.head, split, s)
               for split in ("validation", "test")} for s in seeds}
  gate = headroom(setup, start[seeds[0]]["validation"])
  log(f"step-0 headroom gate passed: {gate['checks']}")

  calibration_path = os.path.join(FLAGS.workdir, f"calibration_steps{FLAGS.steps}.json")
  if os.path.exists(calibration_path):
    with open(calibration_path) as f:
      calibration = json.load(f)
  else:
    calibration = calibrate(setup, FLAGS.calibration_steps, ppow_lrs[0])
    with open(calibration_path, "w") as f:
      json.dump(calibration, f)
  control_steps = calibration["control_steps"]
  log(f"compute matching: full {calibration['ppow_full_cpu_s']:.2f} CPU s/step, distillation "
      f"{calibration['distill_cpu_s']:.2f} CPU s/step: control {control_steps} steps")

  # Tuning on the validation split, first seed, the same number of trials per arm.
  tune_seed = seeds[0]
  trials, params = {}, {}
  for arm in arms:
    trials[arm] = []
    for lr in (control_lrs if arm == "control" else ppow_lrs):
      record, p = cached_run(setup, arm, lr, tune_seed, control_steps)
      val = cached_eval(setup, f"{arm}_lr{lr:g}_seed{tune_seed}_steps{FLAGS.steps}", lambda p=p: setup.head(p),
                        "validation", tune_seed)
      trials[arm].append({"params": {"learning_rate": lr}, "score": (val["tau_greedy"] + val["tau_t1"]) / 2})
      params[(arm, lr)] = (record, p, val)
  choice = tuning.record_choice(os.path.join(FLAGS.workdir, "tuning.json"), trials, split="validation",
                                metric="validation (tau_greedy + tau_t1) / 2")
  log("chosen learning rates: " + ", ".join(f"{a} {choice.params(a)['learning_rate']:g}" for a in arms))

  saved = {
      "command": "python -m experiments.reproduce_ppow " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
      "machine": machine.description(), "family_alpha": FLAGS.family_alpha, "arms": arms, "seeds": seeds,
      "setup": {"size": FLAGS.size, "ppow_steps": FLAGS.steps, "control_steps": control_steps,
                "num_draft": setup.num_draft, "group_size": int(setup.config.ppow.group_size),
                "num_prefixes": int(setup.config.ppow.num_prefixes), "pool_rows": int(setup.config.ppow.pool_rows),
                "min_prefix": int(setup.min_prefix), "gamma_reward": float(setup.config.ppow.gamma),
                "gamma_measured": setup.gamma, "eval_prompts": int(setup.config.eval.num_prompts),
                "prompt_len": int(setup.config.eval.prompt_len),
                "max_new_tokens": int(setup.config.eval.max_new_tokens), "distill_batch":
                int(setup.drafter_config.batch_size), "init_from": os.path.abspath(FLAGS.init_from)},
      "splits": {"rows": setup.rows, "disjointness": setup.disjointness},
      "calibration": calibration, "headroom": gate, "tuning": choice.to_dict(),
      "start": {str(s): start[s] for s in seeds}, "runs": [],
  }
  for seed in seeds:
    for arm in arms:
      lr = choice.params(arm)["learning_rate"]
      if seed == tune_seed:
        record, p, val = params[(arm, lr)]
      else:
        record, p = cached_run(setup, arm, lr, seed, control_steps)
        val = None
      test = cached_eval(setup, f"{arm}_lr{lr:g}_seed{seed}_steps{FLAGS.steps}", lambda p=p: setup.head(p),
                         "test", seed)
      saved["runs"].append({**record, "validation": val, "test": test})
      log(f"{arm} seed {seed} (lr {lr:g}): test tau greedy {test['tau_greedy']:.3f}, T=1 {test['tau_t1']:.3f}")
  saved["total_wall_s"] = time.time() - t_start
  results_md.plot_beside(saved, FLAGS.results_file, report)
  print(results_md.write_results(saved, FLAGS.results_file, report))


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()
  app.run(main)
