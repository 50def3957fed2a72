r"""GRPO with and without speculative rollouts, same seeds: equivalent training, and what speculation saves.

    python -m experiments.reproduce_speculative_grpo --workdir=runs/spec_grpo --init_from=SPEC_WORKDIR \
        --seeds=0,1,2

Task, arms and sizes: ``configs/speculative_grpo.py``. ``SPEC_WORKDIR`` (a finished
``experiments/train_speculative.py`` run) is only read; this interpreter's standard library must be the
corpus it was trained on (its hash is compared).

*Splits.* ``lemon_rl.envs.stdlib_code.code_splits``: RL prompts from the training packages, validation and
test prompts from held-out packages, disjoint by package and asserted disjoint by content before anything
runs. Nothing is tuned on the test split: the settings are the config's, fixed before the run and the same for
every arm (the hypothesis is that the sampler changes nothing but speed, so there is no per-arm choice).

*Headroom* (step 0, thresholds in the config, checked before training): the start policy's validation
completions at temperature 1 (``eval.samples_per_prompt`` per prompt, plain ``generate``) must have reward
variance within prompts and a mean below the ceiling; the start drafter's acceptance on them
(``speculative_generate``, ``K = rl.speculative.num_draft``) must leave speculation something to gain.

*Runs.* For every seed and arm, ``rl.steps`` GRPO steps from the start policy (and, for the speculative
arms, the start drafter), the prompts of step ``k`` drawn by ``(seed, k)`` so every arm sees the same ones.
One throwaway warm-up run per arm compiles everything first, so the timed runs compile nothing, and the
order of the arms rotates from seed to seed, so no arm always runs first after an evaluation. Per step
the trainer's metrics are kept: reward, ``time/sample_s`` (the rollout's sampling), the step's wall time
(rollout, update and, for the speculative arms, the drafter's refit), ``rollout/tau``,
``rollout/speculative_on``, and a digest of the rollout's tokens (``rollout_sha``: the coupled arms' steps
are compared with plain's sample for sample).

*Evaluation.* Every final policy on the test prompts with plain ``generate`` (not the arm's sampler) and the
same key: mean reward at temperature 1 (``eval.samples_per_prompt`` samples) and greedy validity.

*Statistics.* Equivalence of each speculative arm with ``plain``, per seed paired, on both endpoints: TOST
with margin ``config.margin``, Holm over the family (``lemon_rl.eval.stats.holm_equivalence``). Speed: per
step the ratio ``plain / arm`` of sampling time and of step time on the same seed and step, summarised by the
median over steps (and, for the cost model, the share of steps slower than plain); see
:mod:`experiments.reports.speculative_grpo`.

Results: ``experiments/results/speculative_grpo/results.json``; ``experiments/RESULTS.md`` is regenerated.
Runs are cached under ``--workdir`` (a rerun re-reads them).
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
from experiments.reports import speculative_grpo as report

flags.DEFINE_string("workdir", None, "Directory of cached runs.")
flags.DEFINE_string("init_from", None, "A finished experiments/train_speculative.py workdir (read only).")
flags.DEFINE_string("seeds", "0,1,2", "Comma-separated seeds.")
flags.DEFINE_string("arms", "plain,speculative,cost_model,ppow_refresh,residual",
                    "Comma-separated arms (configs/speculative_grpo.py).")
flags.DEFINE_integer("steps", 0, "GRPO steps per run (0 = the config's rl.steps).")
flags.DEFINE_string("size", "cpu", "configs/speculative_grpo.py size: cpu or tiny.")
flags.DEFINE_string("results_file", report.RESULTS_FILE,
                    "Where the results JSON goes (absolute, or relative to the repository).")
flags.mark_flags_as_required(["workdir", "init_from"])
FLAGS = flags.FLAGS

KEPT_METRICS = ("reward/total/mean", "time/sample_s", "rollout/speculative_on", "rollout/tau",
                "rollout/predicted_speedup", "completion_length/mean", "drafter/refitted",
                "drafter/probe_acceptance", "time/drafter_refit_s", "cost/refit_s")


def log(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Setup:
  """What every run shares: the start policy and drafter, the tokenizer, the prompts, the reward."""

  def __init__(self, init_from: str, config):
    import jax  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from lemon_rl.data import stdlib_corpus  # pylint: disable=g-import-not-at-top
    from lemon_rl.envs import stdlib_code  # pylint: disable=g-import-not-at-top
    from lemon_rl.rewards.python_syntax import PythonSyntaxReward  # pylint: disable=g-import-not-at-top
    from lemon_rl.text.decoding import DocumentPromptTokenizer  # pylint: disable=g-import-not-at-top
    from lemon_rl.training import phases  # pylint: disable=g-import-not-at-top
    from lemon_rl.training import ppow_training as pt  # pylint: disable=g-import-not-at-top

    self.config = config
    target, head, spec, tokenizer, *_ = pt.load_start(init_from)
    self.tokenizer = DocumentPromptTokenizer(tokenizer)
    self.policy_def, self.start_policy = nnx.split(target)
    self.head_def, self.start_head = nnx.split(head)
    # Host copies: every run starts from fresh arrays (the updates donate their state).
    self.start_policy, self.start_head = jax.device_get((self.start_policy, self.start_head))
    c = spec.get("corpus", {})
    corpus = stdlib_corpus.load_stdlib_corpus(test_percent=c.get("test_percent", 10.0),
                                              near_duplicate_threshold=c.get("near_duplicate_threshold", 0.7),
                                              max_chars_per_split=c.get("max_chars_per_split"))
    with open(os.path.join(init_from, "data", "corpus.json")) as f:
      trained_on = json.load(f)["hash"]
    if corpus.hash != trained_on:
      raise SystemExit(f"{init_from} was trained on stdlib corpus {trained_on}, this interpreter's is {corpus.hash}")
    p = config.prompts
    self.splits, self.disjointness = stdlib_code.code_splits(
        corpus, tokenizer, min_tokens=p.min_tokens, max_tokens=p.max_tokens, min_body_lines=p.min_body_lines)
    self.reward = PythonSyntaxReward(self.tokenizer.eos_ids, config.reward_min_lines)
    self.optimizer = phases.optimizer_from_section(config.rl)  # One object: every run compiles one update.

  def policy(self):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    return nnx.merge(self.policy_def, jax.tree.map(jnp.array, self.start_policy))

  def head(self):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    return nnx.merge(self.head_def, jax.tree.map(jnp.array, self.start_head))

  def prompts(self, seed: int, step: int) -> list[dict]:
    """The training prompts of ``(seed, step)``, the same for every arm."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    train = self.splits["train"]
    rows = np.random.default_rng([seed, 23, step]).choice(len(train), self.config.rl.prompts_per_step,
                                                           replace=False)
    return [{"prompt": train[i]["prompt"]} for i in rows]

  def rl_section(self, arm: str, seed: int):
    cfg = self.config.rl.copy_and_resolve_references()
    cfg.speculative.enabled = arm != "plain"
    cfg.speculative.cost_model = arm == "cost_model"
    if arm == "residual":
      cfg.coupled_noise = False
    if arm == "ppow_refresh":
      cfg.speculative.update(refresh="ppow", refresh_every=int(self.config.ppow_refresh_every))
    cfg.speculative.seed = seed
    return cfg

  def evaluate(self, params, split: str, seed: int) -> dict:
    """Plain ``generate`` of ``split``'s prompts with ``params``: mean reward at temperature 1 and greedy."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from lemon_rl.eval.generation import evaluate  # pylint: disable=g-import-not-at-top
    e, rl = self.config.eval, self.config.rl
    examples = [{"prompt": r["prompt"]} for r in self.splits[split][:e.max_prompts or None]]
    model = nnx.merge(self.policy_def, jax.tree.map(jnp.asarray, params))
    out = {}
    for name, temperature, samples in (("t1", float(rl.temperature), int(e.samples_per_prompt)), ("greedy", 0.0, 1)):
      metrics, scores = evaluate(model, self.tokenizer, examples, self.reward, int(rl.max_new_tokens),
                                 temperature=temperature, num_samples=samples, seed=seed)
      out[f"reward_{name}"] = float(metrics["accuracy"])
      out[f"length_{name}"] = float(metrics["completion_length"])
      out[f"finished_{name}"] = float(metrics.get("finished", float("nan")))
      out[f"scores_{name}"] = scores.tolist()
    return out


def headroom(setup: Setup) -> dict:
  """The step-0 gate (raises ``HeadroomError`` when it fails): the start policy's validation rollouts and
  the start drafter's acceptance on the same prompts."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from lemon_rl.eval import headroom as hr  # pylint: disable=g-import-not-at-top
  from lemon_rl.models.drafter import EagleDrafter  # pylint: disable=g-import-not-at-top
  from lemon_rl.sampling import speculative_generate  # pylint: disable=g-import-not-at-top
  from lemon_rl.text.decoding import encode_prompt  # pylint: disable=g-import-not-at-top
  c = setup.config
  start = setup.evaluate(setup.start_policy, "validation", seed=0)
  scores = np.asarray(start["scores_t1"])  # [prompts, samples]
  ids = [encode_prompt(setup.tokenizer, r["prompt"]) for r in setup.splits["validation"][:c.eval.max_prompts or None]]
  target = setup.policy()
  stats = speculative_generate(target, EagleDrafter(target, setup.head()), ids, int(c.rl.max_new_tokens),
                               jax.random.key(0), num_draft=int(c.rl.speculative.num_draft),
                               temperature=float(c.rl.temperature), eos_ids=setup.tokenizer.eos_ids,
                               pad_id=setup.tokenizer.pad_id).stats
  acceptance = float(np.mean(stats.acceptance_rate_per_position))
  rollout = hr.HeadroomRollout(rewards=scores.reshape(-1), group_ids=np.repeat(np.arange(len(scores)),
                                                                               scores.shape[1]),
                               lengths=np.zeros(scores.size))
  custom = {"reward_mean": lambda r: float(r.rewards.mean()), "start_probe_acceptance": lambda _: acceptance}
  gate = hr.HeadroomGate.from_config(c.headroom)
  out = gate.check(rollout, custom=custom).to_dict()
  out["start_validation"] = {k: v for k, v in start.items() if not k.startswith("scores")}
  out["start_tau_t1"] = float(stats.mean_tau)
  return out


def train_arm(setup: Setup, arm: str, seed: int, steps: int) -> tuple[dict, object]:
  """``steps`` GRPO steps of ``arm``; ``(record with per-step metrics, final policy parameters)``."""
  import jax  # pylint: disable=g-import-not-at-top
  from lemon_rl.rewards.combine import WeightedReward  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import rl as rl_lib  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import speculative_rollouts as sr  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import state as state_lib  # pylint: disable=g-import-not-at-top
  graphdef, state = state_lib.create_train_state(setup.policy(), setup.optimizer, seed)
  trainer = rl_lib.RLTrainer(graphdef, setup.optimizer, setup.tokenizer, [WeightedReward("syntax", setup.reward)],
                             setup.rl_section(arm, seed), prompt_len=int(setup.config.prompt_len))
  speculative = sr.for_trainer(trainer)
  if speculative is not None:
    speculative.set_drafter(setup.head())
  curve = []
  for step in range(1, steps + 1):
    t0 = time.perf_counter()
    state, metrics, rollout = trainer.step(state, setup.prompts(seed, step))
    jax.block_until_ready(state.params)
    row = {"step": step, "step_s": time.perf_counter() - t0, "rollout_sha": rollout_digest(rollout)}
    row.update({k: float(metrics[k]) for k in KEPT_METRICS if k in metrics})
    curve.append(row)
  return {"arm": arm, "seed": seed, "steps": steps, "curve": curve}, jax.device_get(state.params)


def rollout_digest(rollout) -> str:
  """SHA-256 of a rollout's token ids and mask: equal digests of two arms' step = the same samples."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256()
  for key in ("ids", "attention_mask"):
    digest.update(np.ascontiguousarray(rollout.batch[key], np.int32).tobytes())
  return digest.hexdigest()


def cached(path: str, compute):
  """``compute()``'s value, pickled at ``path`` (re-read when present)."""
  if os.path.exists(path):
    with open(path, "rb") as f:
      return pickle.load(f)
  value = compute()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    pickle.dump(value, f)
  return value


def main(argv):
  del argv
  from configs import speculative_grpo  # pylint: disable=g-import-not-at-top
  from experiments import machine  # pylint: disable=g-import-not-at-top

  config = speculative_grpo.get_config(FLAGS.size)
  if FLAGS.steps:
    config.rl.steps = FLAGS.steps
  steps = int(config.rl.steps)
  seeds = [int(s) for s in FLAGS.seeds.split(",")]
  arms = [a for a in FLAGS.arms.split(",") if a]
  if "plain" not in arms or set(arms) - set(speculative_grpo.ARMS):
    raise SystemExit(f"--arms needs 'plain' and only arms of {speculative_grpo.ARMS}, got {arms}")
  os.makedirs(FLAGS.workdir, exist_ok=True)
  t_start = time.time()
  setup = Setup(FLAGS.init_from, config)
  log(f"prompts disjoint by package and content: {setup.disjointness}")
  gate = cached(os.path.join(FLAGS.workdir, "headroom.pkl"), lambda: headroom(setup))
  log(f"step-0 headroom gate passed: {gate['checks']}")

  for arm in arms:  # Compile every program of every arm before anything is timed.
    train_arm(setup, arm, seed=10_000, steps=2 if arm != "cost_model" else 3)
  log("warm-up runs done (everything compiled)")

  saved = {
      "command": ("python -m experiments.reproduce_speculative_grpo "
                  + " ".join(shlex.quote(a) for a in sys.argv[1:])),
      "machine": machine.description(), "arms": arms, "seeds": seeds, "margin": float(config.margin),
      "family_alpha": float(config.family_alpha), "config": json.loads(config.to_json()),
      "init_from": os.path.abspath(FLAGS.init_from), "disjointness": setup.disjointness,
      "headroom": gate, "runs": [],
  }
  for i, seed in enumerate(seeds):
    for arm in arms[i % len(arms):] + arms[:i % len(arms)]:  # Rotated: no arm always runs first.
      name = os.path.join(FLAGS.workdir, "runs", f"{arm}_seed{seed}_steps{steps}.pkl")
      record, params = cached(name, lambda arm=arm, seed=seed: train_arm(setup, arm, seed, steps))
      test = cached(name.replace(".pkl", "_test.pkl"), lambda params=params: setup.evaluate(params, "test", 1))
      saved["runs"].append({**record, "test": {k: v for k, v in test.items() if not k.startswith("scores")}})
      log(f"{arm} seed {seed}: test reward T=1 {test['reward_t1']:.3f}, greedy {test['reward_greedy']:.3f}; "
          f"{sum(r['step_s'] for r in record['curve']):.0f} s of steps")
  saved["total_wall_s"] = time.time() - t_start
  results_md.plot_beside(saved, FLAGS.results_file, report)
  print(results_md.write_results(saved, FLAGS.results_file, report))


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()
  app.run(main)
