"""Helpers of tests/test_multiprocess.py (not a test module): an experiment config, and a layout check.

As a config file (``python -m experiments.main --config=tests/_multiprocess_child.py``): an RL-only GRPO
experiment on the ``multiprocess_test`` task registered here (8 arithmetic-looking prompts, a byte-level 1-layer
model, a reward with variance at initialisation, so the step has a gradient), 4 prompts x 4 samples a step,
REINFORCE++ advantages (normalised over the global batch), 2 passes x 2 minibatches of 8 rows, a checkpoint
every step, a greedy evaluation of 3 prompts every 2 steps, 200 steps (the test stops it before). Each
process's training reward function appends the ``(prompt, completion)`` pairs it scored, one line per call
(per step), to ``<workdir>/data/scored_<process count>_<process>.jsonl``.

As a script, ``python _multiprocess_child.py layout OUT`` (one process, 4 CPU devices): the fused QKV, output
and gate/up weights on (2, 1, 2) and (1, 1, 4) meshes: which slice of which projection each device holds, the
tensor-parallel forward against one device, and the collectives of that forward (no slice moved between
devices, no weight re-assembled). Writes a JSON report to OUT.
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import config_dict

from lemon_rl.envs.tasks import TASKS, Task
from lemon_rl.models import Transformer, activation_sharding, get_preset, make_mesh, shard_model
from lemon_rl.models.transformer import ungroup_qkv
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.text import ByteTokenizer
from lemon_rl.training.base_config import get_base_config

TASK_NAME = "multiprocess_test"
PROMPTS = ("12+34=", "7*8=", "99+1=", "5*5=", "3+4=", "60*2=", "8+80=", "1*1=")
GENERATIONS = 4
LEARNING_RATE = 1e-3
UPDATES_PER_STEP = 4  # num_iterations x (rows / minibatch_size).


def _task(cfg, data_dir: str):
  """The ``multiprocess_test`` task (in memory; ``data_dir`` only receives the reward functions' log)."""
  del cfg
  os.makedirs(data_dir, exist_ok=True)

  def score(prompts, completions, completion_ids, **fields):
    del prompts, completions, fields
    return np.asarray([sum(ids) % 7 / 6 for ids in completion_ids], np.float32)

  def reward(prompts, completions, completion_ids, **fields):
    log = os.path.join(data_dir, f"scored_{jax.process_count()}_{jax.process_index()}.jsonl")
    with open(log, "a") as f:
      f.write(json.dumps(list(zip(prompts, completions))) + "\n")
    return score(prompts, completions, completion_ids, **fields)

  records = [{"prompt": p} for p in PROMPTS]
  return Task(tokenizer=ByteTokenizer(), sft_source=None, rl_source=records, test_examples=records[:3],
              validation_examples=records[:2], rewards=[WeightedReward("r", reward)], eval_reward=score,
              max_new_tokens=8, max_completion_len=8, prompt_len=8)


def get_config():
  """The experiment (see the module docstring); registers its task (in the process that runs it)."""
  if TASK_NAME not in TASKS:
    TASKS.register(TASK_NAME, _task)
  return experiment_config()


def experiment_config():
  """The experiment's config, without registering the task."""
  c = get_base_config()
  c.task = config_dict.ConfigDict({"name": TASK_NAME})
  c.phases = ("rl",)
  c.sft.steps = 0
  c.model.overrides = config_dict.ConfigDict({"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                              "num_kv_heads": 1, "mlp_dim": 64})
  c.rl.update(dict(steps=200, eval_every=2, prompts_per_step=4, num_generations=GENERATIONS, max_new_tokens=8,
                   num_iterations=2, minibatch_size=8, microbatch_size=4, learning_rate=LEARNING_RATE,
                   advantage_estimator="reinforce_pp_baseline"))
  c.eval.num_examples, c.eval.batch_size = 3, 3  # Odd: two processes pad their rows to their 2 devices.
  c.checkpoint.every, c.checkpoint.max_to_keep = 1, 1000
  c.tensorboard = False
  return c


def _layout(out_path: str) -> None:
  assert jax.device_count() == 4, jax.devices()
  # H 4 query heads in K 2 groups (G 2), the preset's D; F 32; Qwen2-style Q/K/V bias (random: checked too).
  cfg = get_preset("tiny", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=32,
                   qkv_bias=True)
  h, kv, d, f, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.hidden_size
  g = h // kv
  reference = Transformer(cfg, rngs=nnx.Rngs(0))
  block = reference.blocks[0]
  block.qkv_bias.set_value(jax.random.normal(jax.random.key(5), block.qkv_bias.shape))
  # The Hugging Face projections ([in, out] here): what each device's slice must be made of.
  q_proj, k_proj, v_proj = np.split(ungroup_qkv(np.asarray(block.qkv[...]), cfg), [h * d, (h + kv) * d], axis=1)
  q_bias, k_bias, v_bias = np.split(ungroup_qkv(np.asarray(block.qkv_bias[...]), cfg), [h * d, (h + kv) * d])
  gate, up = np.asarray(block.gate_up[...])[..., 0], np.asarray(block.gate_up[...])[..., 1]
  out_proj, down = np.asarray(block.out[...]).reshape(h * d, e), np.asarray(block.down[...])
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
  expected_logits = np.asarray(jax.jit(lambda m, i: m(i))(reference, ids))
  report = {"meshes": []}
  for shape in ((2, 1, 2), (1, 1, 4)):
    mesh = make_mesh(*shape)
    tensor = shape[2]
    model = shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    sharded_block = model.blocks[0]
    sharded_block.qkv_bias.set_value(jax.device_put(block.qkv_bias[...], sharded_block.qkv_bias[...].sharding))
    position = {dev: tuple(int(c) for c in np.argwhere(mesh.devices == dev)[0]) for dev in mesh.devices.flat}
    # A KV-head axis that the tensor axis does not divide stays replicated (whole groups or nothing).
    groups_split = kv % tensor == 0
    checks = []
    for shard in sharded_block.qkv[...].addressable_shards:
      t = position[shard.device][2]
      heads = range(t * kv // tensor, (t + 1) * kv // tensor) if groups_split else range(kv)
      want = np.stack([np.concatenate(
          [q_proj[:, (k * g + j) * d:(k * g + j + 1) * d][:, None] for j in range(g)]
          + [k_proj[:, k * d:(k + 1) * d][:, None], v_proj[:, k * d:(k + 1) * d][:, None]], axis=1)
          for k in heads], axis=1)  # [E, heads, G + 2, D]: each group's queries, key, value.
      checks.append(("qkv", str(shard.device), list(heads), bool(np.array_equal(np.asarray(shard.data), want))))
    for shard in sharded_block.qkv_bias[...].addressable_shards:
      t = position[shard.device][2]
      heads = range(t * kv // tensor, (t + 1) * kv // tensor) if groups_split else range(kv)
      want = np.stack([np.stack([q_bias[(k * g + j) * d:(k * g + j + 1) * d] for j in range(g)]
                                + [k_bias[k * d:(k + 1) * d], v_bias[k * d:(k + 1) * d]]) for k in heads])
      checks.append(("qkv_bias", str(shard.device), list(heads), bool(np.array_equal(np.asarray(shard.data), want))))
    for shard in sharded_block.out[...].addressable_shards:  # Whole query heads (those of its KV groups).
      t = position[shard.device][2]
      heads = range(t * h // tensor, (t + 1) * h // tensor) if h % tensor == 0 else range(h)
      want = out_proj[heads.start * d:heads.stop * d].reshape(len(heads), d, e)
      checks.append(("out", str(shard.device), list(heads), bool(np.array_equal(np.asarray(shard.data), want))))
    for shard in sharded_block.gate_up[...].addressable_shards:  # Columns f of gate and up, side by side.
      t = position[shard.device][2]
      cols = slice(t * f // tensor, (t + 1) * f // tensor)
      data = np.asarray(shard.data)
      checks.append(("gate_up", str(shard.device), [cols.start, cols.stop],
                     data.shape == (e, f // tensor, 2) and bool(np.array_equal(data[..., 0], gate[:, cols]))
                     and bool(np.array_equal(data[..., 1], up[:, cols]))))
    for shard in sharded_block.down[...].addressable_shards:
      t = position[shard.device][2]
      cols = slice(t * f // tensor, (t + 1) * f // tensor)
      checks.append(("down", str(shard.device), [cols.start, cols.stop],
                     bool(np.array_equal(np.asarray(shard.data), down[cols]))))
    with activation_sharding(mesh, cfg.axis_rules):
      forward = jax.jit(lambda m, i: m(i))
      logits = np.asarray(forward(model, ids))
      hlo = forward.lower(model, ids).compile().as_text()
    # Full (unsplit) fused weights re-assembled on a device would show as all-gathers with these shapes.
    full_shapes = {f"f32[{e},{kv},{g + 2},{d}]", f"f32[{e},{f},2]", f"f32[{e},{(h + 2 * kv) * d}]",
                   f"f32[{e},{2 * f}]", f"f32[{h},{d},{e}]", f"f32[{h * d},{e}]"}
    gathers = re.findall(r"= (\S+) all-gather", hlo)
    report["meshes"].append({
        "shape": shape, "checks": checks, "qkv_spec": str(sharded_block.qkv[...].sharding.spec),
        "gate_up_spec": str(sharded_block.gate_up[...].sharding.spec),
        "logits_max_diff": float(np.abs(logits - expected_logits).max()),
        "logit_scale": float(np.abs(expected_logits).max()),
        "weight_all_gathers": [s for s in gathers if s.split("{")[0] in full_shapes],
        # A split that crosses a q | k | v or gate | up boundary makes XLA move slices between devices.
        "resharding_ops": len(re.findall(r" (?:all-to-all|collective-permute)(?:-start)?\(", hlo)),
        "collectives": sorted(set(re.findall(r" (all-reduce|all-gather|reduce-scatter|all-to-all|"
                                             r"collective-permute)(?:-start)?\(", hlo)))})
  with open(out_path, "w") as f_out:
    json.dump(report, f_out)
  print("OK", flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "layout":
    _layout(sys.argv[2])
  else:
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
