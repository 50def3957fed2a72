"""Under 8 fake devices: one GRPO update (PolicyLoss, micro-batched) on a 2x2x2 mesh vs on one device.

Usage: ``python _train_sharding_check.py OUT.npz``. For each aggregation it saves the parameters after the
update and the (clipped) gradient the optimizer saw, both flattened, and the loss, from both runs; the test
(``test_training.py``) derives its tolerances from them. The gradient is read back from Adam's first moment:
after one step ``mu = (1 - b1) * g``.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lemon_rl.models import Transformer, activation_sharding, get_preset, make_mesh, shard_model
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.rl import PolicyLoss

import _train_batch  # pylint: disable=g-bad-import-order

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
LR = 1e-3  # make_optimizer's cosine schedule: the full rate at the first update.
B1 = 0.9  # make_optimizer's defaults (and optax's Adam eps).
ADAM_EPS = 1e-8
MAX_LEN = 8


def flat(tree) -> np.ndarray:
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def update(model, batch, aggregation):
  optimizer = state_lib.make_optimizer(LR, 10, b1=B1)
  graphdef, state = state_lib.create_train_state(model, optimizer, 0)
  loss = PolicyLoss(aggregation=aggregation, max_len=MAX_LEN)
  state, metrics = state_lib.update_step(graphdef, state, batch, loss_fn=loss, optimizer=optimizer,
                                         num_microbatches=2)
  grads = flat(optax.tree_utils.tree_get(state.opt_state, "mu")) / (1.0 - B1)
  return flat(nnx.to_pure_dict(state.params)), grads, float(metrics["loss"])


def term_scale(model, batch) -> float:
  """``max |A_i| max(r_it, 2)``: a bound on every per-token term of the clipped surrogate (``eps_high <= 1``)."""
  batch = {k: np.asarray(v) for k, v in batch.items()}
  graphdef, params = nnx.split(model, nnx.Param)
  logp = np.asarray(rollout_lib.sequence_token_log_probs(graphdef, params, jnp.asarray(batch["ids"]),
                                                       jnp.asarray(batch["attention_mask"])))
  mask = batch["loss_mask"] > 0
  ratio = np.exp(logp - batch["old_logp"])[mask]
  return float(np.abs(batch["advantages"]).max() * max(ratio.max(), 2.0))


def main():
  assert len(jax.devices()) == 8
  out_path = sys.argv[1]
  cfg = get_preset("tiny", vocab_size=64, hidden_size=64, mlp_dim=128, num_layers=1)  # 1 block: half the compiles
  batch = _train_batch.make_batch(rows=16, vocab=64)
  result = {"lr": LR, "adam_eps": ADAM_EPS, "max_len": MAX_LEN, "n_terms": float(batch["loss_mask"].sum()),
            "term_scale": term_scale(Transformer(cfg, rngs=nnx.Rngs(0)), batch)}
  for aggregation in AGGREGATIONS:
    single = update(Transformer(cfg, rngs=nnx.Rngs(0)), {k: jnp.asarray(v) for k, v in batch.items()},
                    aggregation)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    with activation_sharding(mesh, cfg.axis_rules):
      sharded = update(shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh),
                       {k: jax.device_put(v, sharding) for k, v in batch.items()}, aggregation)
    for name, a, b in zip(("params", "grads", "loss"), single, sharded):
      result[f"{aggregation}/{name}/single"] = a
      result[f"{aggregation}/{name}/sharded"] = b
  np.savez(out_path, **result)
  print(json.dumps({k: float(np.max(np.abs(result[k] - result[k.replace("/single", "/sharded")])))
                    for k in result if k.endswith("/single")}))


if __name__ == "__main__":
  main()
