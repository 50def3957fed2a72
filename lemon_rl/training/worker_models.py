"""LEMON's worker models: decoders of three capacities trained here by SFT on worker demonstrations.

:func:`train_worker_models` trains one decoder per capacity (what a perfect worker answers to an agent prompt,
:func:`lemon_rl.envs.word_problems.worker_demonstrations`), resumably, and measures each one's skills;
:func:`worker_gate` checks on those skills that capacity matters before any orchestrator trains;
:func:`load_worker_models` serves them as :class:`~lemon_rl.envs.orchestration.ModelWorker` pools to the
executor. Parameters are stored as ``.npz`` files keyed by their tree paths (:func:`save_params`), small enough
to commit with an experiment's results.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import config_dict

from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.envs.orchestration.executor import ModelWorker
from lemon_rl.envs.orchestration.spec import CAPACITIES
from lemon_rl.eval.headroom import check_headroom
from lemon_rl.training import phases as phases_lib
from lemon_rl.training import state as state_lib

WORKERS_META = "workers.json"


def save_params(path: str, model: nnx.Module) -> None:
  """The model's parameters as an ``.npz`` keyed by their tree paths."""
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})


def load_params(path: str, model: nnx.Module) -> nnx.Module:
  """Loads :func:`save_params`' file into ``model`` (same architecture; ``ValueError`` otherwise)."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  with np.load(path) as data:
    keys = [jax.tree_util.keystr(k) for k, _ in leaves]
    if set(keys) != set(data.files):
      raise ValueError(f"{path}: parameters {sorted(set(data.files) ^ set(keys))[:4]}... do not match the model")
    arrays = []
    for (k, like), key in zip(leaves, keys):
      value = data[key]
      if value.shape != like.shape:
        raise ValueError(f"{path}: {key} has shape {value.shape}, the model {like.shape}")
      arrays.append(jnp.asarray(value, like.dtype))
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, arrays))
  return model


def worker_model(overrides: Mapping[str, Any], vocab_size: int, seed: int = 0) -> nnx.Module:
  """A worker decoder: the ``tiny`` preset with ``overrides`` (e.g. ``hidden_size=64, num_layers=1``)."""
  from lemon_rl.models import Transformer, get_preset  # pylint: disable=g-import-not-at-top
  overrides = overrides.to_dict() if hasattr(overrides, "to_dict") else dict(overrides)
  return Transformer(get_preset("tiny", **{"vocab_size": vocab_size, **overrides}), rngs=nnx.Rngs(seed))


def score_workers(workers: Mapping[str, Any], demos: Sequence[Mapping[str, Any]],
                  key_seed: int = 0) -> dict[str, dict[str, float]]:
  """Per capacity, the exact-match accuracy of each skill on ``demos`` (``prompt``, ``completion``,
  ``skill``) and over all of them (``"all"``)."""
  out = {}
  skills = sorted({d["skill"] for d in demos})
  for cap, worker in workers.items():
    result = worker([d["prompt"] for d in demos], [key_seed + i for i in range(len(demos))])
    right = np.asarray([t.strip() == d["completion"].strip() for t, d in zip(result.texts, demos)])
    scores = {s: float(right[[d["skill"] == s for d in demos]].mean()) for s in skills}
    scores["all"] = float(right.mean())
    out[cap] = scores
  return out


def worker_gate(skills: Mapping[str, Mapping[str, float]], thresholds: Mapping[str, float]) -> dict[str, Any]:
  """Whether capacity matters among the measured workers (``skills``: capacity -> skill -> exact match, as
  :func:`score_workers` gives), the experiment's premise, checked before any orchestrator trains.

  Statistics: ``<skill>_<capacity>`` (each score) and ``<skill>_<bigger>_minus_<smaller>`` (every pair of
  capacities of :data:`CAPACITIES`), compared with ``thresholds`` (``min_`` / ``max_<statistic>``, e.g.
  ``min_multiply_large_minus_small``) by :func:`~lemon_rl.eval.headroom.check_headroom`. Returns its
  JSON-ready report; never raises on a failed check (the caller decides)."""
  statistics = {}
  for skill in skills[CAPACITIES[0]]:
    statistics.update({f"{skill}_{cap}": float(skills[cap][skill]) for cap in CAPACITIES})
    statistics.update({f"{skill}_{big}_minus_{small}": float(skills[big][skill] - skills[small][skill])
                       for i, small in enumerate(CAPACITIES) for big in CAPACITIES[i + 1:]})
  return check_headroom(statistics, dict(thresholds), raise_on_failure=False).to_dict()


def demonstrations_digest(demos: Sequence[Mapping[str, Any]]) -> str:
  """A SHA-256 of the demonstrations' prompts and completions, in order: what the workers were taught."""
  digest = hashlib.sha256()
  for d in demos:
    digest.update(json.dumps([d["prompt"], d["completion"]]).encode())
  return digest.hexdigest()


def train_worker_models(demos: Sequence[Mapping[str, Any]], eval_demos: Sequence[Mapping[str, Any]],
                        sizes: Mapping[str, Mapping[str, Any]], training, out_dir: str, tokenizer, *,
                        prompt_len: int, max_new_tokens: int,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
  """Trains one worker decoder per capacity by SFT on ``demos`` and saves it to ``out_dir/<capacity>.npz``.

  ``training`` has ``steps``, ``batch_size``, ``learning_rate``, ``warmup_steps``, ``seed`` and
  ``checkpoint_every``. The same data and steps for every size (*Decision*: the skill levels come from the
  sizes). Each model trains as a phase of the shared runner (:func:`lemon_rl.training.experiment.run_phase`)
  in ``out_dir/<capacity>_training``: it checkpoints every ``checkpoint_every`` steps and on SIGTERM, and a
  rerun resumes it exactly, so a model longer than a session trains over several (its checkpoint directory
  is deleted once the ``.npz`` is saved; its ``metrics.jsonl`` stays). Each model's skills are then measured
  on ``eval_demos`` (greedy) and written, with the sizes and training seconds, to ``out_dir/workers.json``,
  which is returned. Models already saved are not retrained; ``ValueError`` if they, or a model in training,
  were started with other ``training`` settings, sizes or demonstrations (:func:`demonstrations_digest`: the
  world's rules changed), so a stale directory is never reused silently.
  """
  from lemon_rl.training import experiment  # pylint: disable=g-import-not-at-top  (experiment imports phases)
  from lemon_rl.training.sft import SFTTrainer  # pylint: disable=g-import-not-at-top
  os.makedirs(out_dir, exist_ok=True)
  meta_path = os.path.join(out_dir, WORKERS_META)
  requested = {k: training[k] for k in ("steps", "batch_size", "learning_rate", "warmup_steps", "seed")}
  requested["demonstrations"] = demonstrations_digest(demos)
  meta = {"sizes": {}, "train_s": {}}
  if os.path.exists(meta_path):
    with open(meta_path) as f:
      meta = json.load(f)
  saved = meta.get("training", requested)
  stale = [f"training.{k}: saved {saved.get(k)!r}, requested {v!r}" for k, v in requested.items()
           if saved.get(k) != v]
  stale += [f"sizes.{cap}: saved {v!r}, requested {dict(sizes[cap])!r}" for cap, v in meta["sizes"].items()
            if v != dict(sizes[cap])]
  if stale:
    raise ValueError(f"the worker models in {out_dir} were trained with other settings ({'; '.join(stale)}): "
                     "use another directory or delete it")
  meta["training"] = requested
  steps, seed = int(requested["steps"]), int(requested["seed"])
  checkpoint = {"every": int(training["checkpoint_every"]), "max_to_keep": 1, "async_save": True}

  def write_meta():
    with open(meta_path, "w") as f:
      json.dump(meta, f, indent=1)

  workers = {}
  for cap in CAPACITIES:
    model = worker_model(sizes[cap], tokenizer.vocab_size, seed)
    path = os.path.join(out_dir, f"{cap}.npz")
    if not os.path.exists(path):
      meta["sizes"][cap] = dict(sizes[cap])
      write_meta()  # The settings of a model in training, before its first checkpoint.
      optimizer = state_lib.make_optimizer(float(requested["learning_rate"]), steps, int(requested["warmup_steps"]))
      graphdef, state = state_lib.create_train_state(model, optimizer, seed)
      trainer = SFTTrainer(graphdef, optimizer, tokenizer, max_new_tokens, None, prompt_len)
      step = lambda state, examples: trainer.step(state, examples)[:2]  # pylint: disable=cell-var-from-loop
      phase = phases_lib.Phase(state, BatchIterator(list(demos), batch_size=int(requested["batch_size"]), seed=seed),
                               step, steps, eval_every=0, progress_keys=("train/nll",))
      run_dir = os.path.join(out_dir, f"{cap}_training")
      state, meta["train_s"][cap] = experiment.run_phase(f"worker_{cap}", phase, run_dir,
                                                          config_dict.ConfigDict(checkpoint))
      nnx.update(model, state.params)
      save_params(path, model)
      shutil.rmtree(os.path.join(run_dir, "checkpoints"))
      write_meta()
    else:
      load_params(path, model)
      meta["sizes"][cap] = dict(sizes[cap])
    workers[cap] = ModelWorker(model, tokenizer, max_new_tokens, max_batch=256)
  meta["skills"] = score_workers(workers, eval_demos)
  write_meta()
  log(f"worker skills: {json.dumps(meta['skills'])}")
  return meta


def load_worker_models(workers_dir: str, sizes: Mapping[str, Mapping[str, Any]], tokenizer, *,
                       max_new_tokens: int, max_batch: int = 256) -> dict[str, ModelWorker]:
  """The :class:`~lemon_rl.envs.orchestration.ModelWorker` pool saved by :func:`train_worker_models`."""
  workers = {}
  for cap in CAPACITIES:
    path = os.path.join(workers_dir, f"{cap}.npz")
    if not os.path.exists(path):
      raise FileNotFoundError(f"no trained {cap!r} worker at {path}: train the workers first "
                              "(python -m experiments.reproduce_lemon --train_workers_only ...)")
    model = load_params(path, worker_model(sizes[cap], tokenizer.vocab_size))
    workers[cap] = ModelWorker(model, tokenizer, max_new_tokens, max_batch=max_batch)
  return workers
