"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8: prints max |diff| of sharded vs 1-device."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lemon_rl.models import Transformer, activation_sharding, get_preset, make_mesh, shard_model
from lemon_rl.ops import token_log_probs
from lemon_rl.sampling import generate


def loss_fn(model, ids, mask):
  logp = token_log_probs(model(ids, mask)[:, :-1], ids[:, 1:])
  return -jnp.sum(logp * mask[:, 1:]) / jnp.sum(mask[:, 1:])


def run(model, ids, mask):
  logits = jax.jit(lambda m, i, k: m(i, k))(model, ids, mask)
  loss, grads = jax.jit(nnx.value_and_grad(loss_fn))(model, ids, mask)
  sampled = generate(model, [[1, 2, 3, 4], [5, 6], [7], [8, 9, 10], [11] * 5, [12], [13, 14], [15]],
                     max_new_tokens=16, rng=jax.random.key(0), temperature=0.0)
  return (np.asarray(logits), float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads)),
          sampled.tokens)


def main():
  assert len(jax.devices()) == 8, jax.devices()
  cfg = get_preset("tiny", vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=128)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 64, (8, 12)), jnp.int32)
  mask = np.ones((8, 12), np.int32)
  mask[1, :3] = 0
  mask[5, 7:] = 0
  mask = jnp.asarray(mask)
  single = run(Transformer(cfg, rngs=nnx.Rngs(0)), ids, mask)

  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  model = shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  with activation_sharding(mesh, cfg.axis_rules):
    sharded = run(model, jax.device_put(ids, batch_sharding), jax.device_put(mask, batch_sharding))
  spec = str(model.blocks[0].gate_up[...].sharding.spec)
  valid = np.asarray(mask, bool)
  grad_diff = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(single[2]), jax.tree.leaves(sharded[2])))
  print(json.dumps({
      "logits": float(np.abs(single[0] - sharded[0])[valid].max()),
      "loss": abs(single[1] - sharded[1]),
      "grad": float(grad_diff),
      "greedy_equal": bool(np.array_equal(single[3], sharded[3])),
      # Scales for the test's float32 tolerances.
      "logit_scale": float(np.abs(single[0])[valid].max()), "loss_value": single[1],
      "grad_scale": float(max(np.abs(g).max() for g in jax.tree.leaves(single[2]))),
      "num_tokens": int(np.asarray(mask)[:, 1:].sum()),
      "param_spec": spec,
  }))


if __name__ == "__main__":
  main()
