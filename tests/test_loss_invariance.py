"""The (sum, denominator) contract: micro-batches and devices give the full-batch loss and gradient.

For every aggregation mode, the GRPO loss (clipped surrogate with clip-higher and dual clip, k3 KL,
entropy bonus) and its gradient with respect to the parameters of a small linear-softmax policy over
random features are computed

- on the whole batch;
- on 4 micro-batches, adding the ``(sum, denominator)`` pairs and the gradients of the sums, then
  dividing once by the total denominator;
- in a subprocess with 8 fake CPU devices: the batch sharded with ``NamedSharding`` over a ``Mesh``
  and the same function jitted, and with ``shard_map`` where each device computes its own pair and
  the pairs and gradients are ``psum``-ed;

and compared (<= 1e-5, float32). The batch holds groups that straddle micro-batches and devices, and an
all-padding row.
"""

import json
import os
import pathlib
import subprocess
import sys

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lemon_rl import losses
from lemon_rl import ops

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
B, T, F, V, G = 16, 6, 8, 11, 4  # batch, length, features, vocabulary, group size


def tol(reference) -> float:
  """Absolute float32 bound for a re-associated reduction equal to ``reference``.

  Splitting the batch (micro-batches, devices) only changes the order of the float32 sums: over the
  ``B*T`` tokens, the ``F`` features of a logit and the ``V`` terms of a log-softmax. Each of those
  ``B*T + F + V`` additions rounds by at most ``eps`` times the largest partial value, bounded by the
  largest magnitude of the quantity itself (times 4 for the products and exponentials feeding the sums).
  """
  return (B * T + F + V) * 4 * float(np.finfo(np.float32).eps) * max(float(np.max(np.abs(reference))), 1.0)
LOSS_KW = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, kl_coef=0.05, kl_estimator="k3",
               entropy_coef=0.01, max_len=T)


def make_problem(seed: int = 0):
  """A linear policy ``logits = x W + b`` and a batch of GRPO data (NumPy, float32)."""
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(scale=0.5, size=(F, V)).astype(np.float32),
            "b": rng.normal(scale=0.1, size=(V,)).astype(np.float32)}
  x = rng.normal(size=(B, T, F)).astype(np.float32)
  targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
  mask = (rng.uniform(size=(B, T)) < 0.75).astype(np.float32)
  mask[5] = 0.0  # an all-padding row
  mask[:, 0] = np.where(np.arange(B) == 5, 0.0, 1.0)
  # Old / reference policies: perturbed parameters, so the ratios leave the clip range.
  old = {k: v + rng.normal(scale=0.4, size=v.shape).astype(np.float32) for k, v in params.items()}
  ref = {k: v + rng.normal(scale=0.2, size=v.shape).astype(np.float32) for k, v in params.items()}
  rewards = rng.normal(size=B).astype(np.float32)
  group_ids = (np.arange(B) // G).astype(np.int32)
  batch = {
      "x": x, "targets": targets, "mask": mask,
      "old_logp": np.asarray(policy_logp(old, x, targets)),
      "ref_logp": np.asarray(policy_logp(ref, x, targets)),
      # Advantages are computed once on the whole batch, then split with it.
      "advantages": np.asarray(losses.grpo(rewards, group_ids, B // G)),
  }
  return params, batch


def policy_logits(params, x):
  return jnp.einsum("btf,fv->btv", x, params["w"]) + params["b"]


def policy_logp(params, x, targets):
  return ops.token_log_probs(policy_logits(params, x), targets)


def loss_pair(params, batch, mode):
  """The GRPO loss of ``batch`` as ``(sum, denominator)`` plus metrics."""
  logits = policy_logits(params, batch["x"])
  logp = ops.token_log_probs(logits, batch["targets"])
  return losses.grpo_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"],
                          ref_logp=batch["ref_logp"], entropy=ops.entropy_from_logits(logits),
                          aggregation=mode, **LOSS_KW)


def full_batch(params, batch, mode):
  """Loss value and gradient of the whole batch."""
  value, grads = jax.value_and_grad(lambda p: loss_pair(p, batch, mode)[0].value)(params)
  return value, grads


def sum_and_grad(params, batch, mode):
  """``((sum, denominator), d sum / d params, metrics)`` of one piece."""
  def f(p):
    pair, metrics = loss_pair(p, batch, mode)
    return pair.sum, (pair, metrics)
  (_, (pair, metrics)), grads = jax.value_and_grad(f, has_aux=True)(params)
  return pair, grads, metrics


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(leaf)) for leaf in jax.tree.leaves(tree)])


_full = jax.jit(full_batch, static_argnums=2)
_piece = jax.jit(sum_and_grad, static_argnums=2)


class MicroBatchTest(parameterized.TestCase):

  @parameterized.parameters(*MODES)
  def test_four_micro_batches(self, mode):
    params, batch = make_problem()
    value, grads = _full(params, batch, mode)
    total, total_grads, metrics = None, None, None
    for k in range(4):
      piece = {name: arr[k * 4:(k + 1) * 4] for name, arr in batch.items()}
      pair, g, m = _piece(params, piece, mode)
      total = pair if total is None else total + pair
      total_grads = g if total_grads is None else jax.tree.map(jnp.add, total_grads, g)
      metrics = m if metrics is None else ops.merge_metrics(metrics, m)
    micro_grads = jax.tree.map(lambda g: g / total.denominator, total_grads)
    np.testing.assert_allclose(total.value, value, atol=tol(value), rtol=0)
    np.testing.assert_allclose(_flat(micro_grads), _flat(grads), atol=tol(_flat(grads)), rtol=0)
    # The logged metrics combine the same way.
    _, full_metrics = jax.jit(loss_pair, static_argnums=2)(params, batch, mode)
    for name, metric in full_metrics.items():
      np.testing.assert_allclose(metrics[name].value, metric.value, atol=tol(metric.value), rtol=0, err_msg=name)
    # Non-trivial: clipping happened and the gradient is not zero.
    self.assertGreater(float(full_metrics["clip_frac"].value), 0.05)
    self.assertGreater(float(np.abs(_flat(grads)).max()), 1e-3)

  def test_micro_batches_differ_from_averaging_means(self):
    # Averaging per-micro-batch means (the usual mistake) is not the full-batch value for
    # seq_mean_token_mean with unequal numbers of valid rows: the test above can fail.
    params, batch = make_problem()
    value, _ = _full(params, batch, "token_mean")
    means = [_piece(params, {k: v[i * 4:(i + 1) * 4] for k, v in batch.items()}, "token_mean")[0].value
             for i in range(4)]
    self.assertGreater(abs(float(np.mean(means)) - float(value)), 1e-4)


_SUBPROCESS = r"""
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
import test_loss_invariance as t

assert len(jax.devices()) == 8, jax.devices()
params, batch = t.make_problem()
mesh = Mesh(np.array(jax.devices()), ("data",))
rows = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())
batch = {k: jax.device_put(v, rows) for k, v in batch.items()}
params = jax.device_put(params, replicated)
assert len(batch["x"].sharding.device_set) == 8

def per_device(params, batch, mode):
  # Mark the replicated parameters as device-varying so that each device's gradient is its own
  # (otherwise shard_map's transpose already sums it), then add pairs and gradients explicitly.
  params = jax.lax.pcast(params, "data", to="varying")
  pair, grads, _ = t.sum_and_grad(params, batch, mode)
  pair, grads = jax.lax.psum((pair, grads), "data")
  return pair.value, jax.tree.map(lambda g: g / pair.denominator, grads)

out = {}
for mode in t.MODES:
  value, grads = jax.jit(t.full_batch, static_argnums=2)(params, batch, mode)
  sm = jax.jit(jax.shard_map(lambda p, b: per_device(p, b, mode), mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=(P(), P())))
  sm_value, sm_grads = sm(params, batch)
  out[mode] = {"jit": [float(value), t._flat(grads).tolist()],
               "shard_map": [float(sm_value), t._flat(sm_grads).tolist()]}
print("RESULT" + json.dumps(out))
"""


def test_eight_fake_devices():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  tests_dir = str(pathlib.Path(__file__).resolve().parent)
  proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, tests_dir], env=env, capture_output=True,
                        text=True, timeout=300, cwd=str(pathlib.Path(tests_dir).parent))
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  results = json.loads(line[len("RESULT"):])
  params, batch = make_problem()
  for mode in MODES:
    value, grads = _full(params, batch, mode)
    for kind in ("jit", "shard_map"):
      sharded_value, sharded_grads = results[mode][kind]
      np.testing.assert_allclose(sharded_value, float(value), atol=tol(value), rtol=0, err_msg=f"{mode} {kind}")
      np.testing.assert_allclose(np.array(sharded_grads), _flat(grads), atol=tol(_flat(grads)), rtol=0,
                                 err_msg=f"{mode} {kind}")


if __name__ == "__main__":
  pytest.main([__file__])
