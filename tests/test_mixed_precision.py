"""The accelerator path: bfloat16 compute on float32 master weights, remat policies, sharding rule sets.

Tolerances. bfloat16 keeps 8 significand bits, so one round-to-nearest has relative error at most
``u = 2^-8``. On the way to the logits a 2-layer model rounds a value to bfloat16 about ``R = 16`` times per
layer (each matmul's two inputs and its output, the rotary output, the attention probabilities and output,
two residual adds, two norms, ``silu(gate) * up``) plus the embedding, the final norm and the LM head's
weight: ``R = 35``. Independent roundings add like a random walk, so the norm-relative error of the logits
is about ``sqrt(R) u`` (``~0.023``; the worst case ``R u`` is ``0.14``); the backward pass rounds as often
again, ``sqrt(2R) u`` for a gradient. A float32 path is ``~1e-7`` away, so a lower bound of ``u / 8``
shows that bfloat16 is in effect.

This file is also the child of the 8-fake-device check: ``python tests/test_mixed_precision.py child``.
"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lemon_rl import ops
from lemon_rl.models import DEFAULT_AXIS_RULES, Transformer, get_preset, param_logical_axes
from lemon_rl.models.config import REMAT_POLICIES
from lemon_rl.models.sharding import axis_rules, logical_to_spec
from lemon_rl.training import state as state_lib

SMALL = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128)
U = 2.0 ** -8  # bfloat16 unit roundoff.
ROUNDINGS = 16 * SMALL["num_layers"] + 3  # R in the module docstring (16 per layer, 3 outside the blocks).


def nll_loss(model, batch):
  """Next-token NLL over the real tokens: ``WeightedMetric(sum of -log p, count)``, float32."""
  logp = ops.token_log_probs(model(batch["ids"], batch["attention_mask"])[:, :-1], batch["ids"][:, 1:])
  weight = batch["attention_mask"][:, 1:].astype(jnp.float32)
  return ops.WeightedMetric(-jnp.sum(logp * weight), jnp.sum(weight)), {}


def make_batch(rows: int = 4, length: int = 16, seed: int = 0):
  rng = np.random.default_rng(seed)
  mask = np.ones((rows, length), np.int32)
  mask[0, length - 5:] = 0
  return {"ids": jnp.asarray(rng.integers(0, SMALL["vocab_size"], (rows, length)), jnp.int32),
          "attention_mask": jnp.asarray(mask)}


def loss_and_grads(cfg, batch):
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)

  def mean_loss(params):
    return nll_loss(nnx.merge(graphdef, params), batch)[0].value

  @jax.jit
  def run(params):
    return jax.value_and_grad(mean_loss)(params)

  return run(params)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def dot_dtypes(jaxpr) -> list[tuple[str, str, str]]:
  """``(lhs, rhs, out)`` dtypes of every ``dot_general`` in ``jaxpr`` and its sub-jaxprs (custom VJPs, remat)."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(tuple(str(v.aval.dtype) for v in (*eqn.invars, eqn.outvars[0])))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out.extend(dot_dtypes(inner))
  return out


# -- presets and config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["0.5b", "1.5b"])
def test_mixed_presets_are_the_bf16_shapes_with_fp32_masters(size):
  mixed, stored = get_preset(f"qwen2.5-{size}-mixed"), get_preset(f"qwen2.5-{size}")
  assert (mixed.param_dtype, mixed.dtype, mixed.remat) == ("float32", "bfloat16", True)
  assert mixed.checkpoint_policy is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  assert mixed.replace(param_dtype="bfloat16", remat=False, remat_policy="nothing_saveable") == stored
  assert mixed.num_params() == stored.num_params()


def test_remat_flag_stays_backward_compatible():
  assert get_preset("tiny").checkpoint_policy is None
  assert get_preset("tiny", remat=True).checkpoint_policy is jax.checkpoint_policies.nothing_saveable
  assert get_preset("qwen2.5-7b").checkpoint_policy is jax.checkpoint_policies.nothing_saveable
  with pytest.raises(ValueError, match="remat_policy"):
    get_preset("tiny", remat=True, remat_policy="dots")


# -- bfloat16 compute on float32 masters ------------------------------------------------------------------


def test_mixed_forward_casts_matmuls_to_bf16_and_matches_float32():
  f32 = get_preset("tiny", **SMALL)
  mixed = f32.replace(dtype="bfloat16")
  batch = make_batch()
  models = [Transformer(c, rngs=nnx.Rngs(0)) for c in (f32, mixed)]
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(models[1], nnx.Param)))  # Masters.
  dots = dot_dtypes(jax.make_jaxpr(lambda m: m(batch["ids"]))(models[1]).jaxpr)
  # 6 per layer (QKV, two attention einsums, output, gate/up, down) and the LM head.
  assert len(dots) == 6 * SMALL["num_layers"] + 1, dots
  assert all(lhs == rhs == "bfloat16" for lhs, rhs, _ in dots), dots  # Weights cast where used.
  assert dots[-1][2] == "float32"  # The LM head accumulates into float32 logits.

  forward = jax.jit(lambda m: m(batch["ids"], batch["attention_mask"]))
  ref, out = (np.asarray(forward(m)) for m in models)
  assert out.dtype == np.float32
  valid = np.asarray(batch["attention_mask"], bool)
  err = rel_err(out[valid], ref[valid])
  assert U / 8 < err < math.sqrt(ROUNDINGS) * U, err
  # Log-softmax and the loss in float32 from the float32 logits: the NLL moves at most 2 max|d logits|
  # (logsumexp and z_target each move at most max|d z|), plus float32 rounding.
  targets, weight = batch["ids"][:, 1:], valid[:, 1:]
  loss_ref, loss_mixed = (-ops.token_log_probs(jnp.asarray(z[:, :-1]), targets)[weight].mean() for z in (ref, out))
  assert loss_mixed.dtype == jnp.float32
  delta = float(np.abs(out - ref)[valid].max())
  assert abs(float(loss_mixed) - float(loss_ref)) <= 2 * delta + 1e-6


def test_gradients_are_float32_on_float32_masters_and_close_to_float32():
  batch = make_batch()
  f32 = get_preset("tiny", **SMALL)
  loss_ref, grads_ref = loss_and_grads(f32, batch)
  loss_mixed, grads_mixed = loss_and_grads(f32.replace(dtype="bfloat16"), batch)
  assert loss_mixed.dtype == jnp.float32
  leaves_ref, leaves_mixed = jax.tree.leaves(grads_ref), jax.tree.leaves(grads_mixed)
  assert all(g.dtype == jnp.float32 for g in leaves_mixed)
  for a, b in zip(leaves_mixed, leaves_ref):
    assert rel_err(a, b) < math.sqrt(2 * ROUNDINGS) * U, (a.shape, rel_err(a, b))


def test_fp32_masters_keep_updates_below_bf16_resolution():
  """Adam's first step moves every weight by about ``lr`` (``m / sqrt(v) = sign(g)``). With ``lr = 1e-4``
  a norm scale at 1.0 (bfloat16 spacing ``2^-7`` there, so anything below ``2^-8`` rounds away) keeps the
  change only as a float32 master; stored in bfloat16 it stays exactly 1."""
  lr = 1e-4
  optimizer = state_lib.make_optimizer(lr, total_steps=10, max_grad_norm=None, schedule="constant")
  batch = make_batch()
  moved = {}
  for param_dtype in ("float32", "bfloat16"):
    cfg = get_preset("tiny", param_dtype=param_dtype, dtype="bfloat16", **SMALL)
    graphdef, state = state_lib.create_train_state(Transformer(cfg, rngs=nnx.Rngs(0)), optimizer, seed=0)
    assert all(x.dtype == jnp.dtype(param_dtype) for x in jax.tree.leaves(state.opt_state)
               if getattr(x, "ndim", 0) > 0)  # Adam's moments take the masters' dtype.
    before = np.asarray(state.params["blocks"][0]["attn_norm"][...], np.float32)
    state, metrics = state_lib.update_step(graphdef, state, batch, loss_fn=nll_loss, optimizer=optimizer)
    assert np.isfinite(float(metrics["loss"]))
    after = state.params["blocks"][0]["attn_norm"][...]
    assert after.dtype == jnp.dtype(param_dtype)
    np.testing.assert_array_equal(before, 1.0)
    moved[param_dtype] = np.asarray(after, np.float32) - before
  step = np.abs(moved["float32"])
  assert np.all(step > 0.5 * lr) and np.all(step < 1.5 * lr), step  # Every master moved by ~lr ...
  assert np.all(step < 2.0 ** -8)  # ... far below bfloat16's resolution at 1.0:
  np.testing.assert_array_equal(np.asarray((1.0 + moved["float32"]).astype(jnp.bfloat16), np.float32), 1.0)
  np.testing.assert_array_equal(moved["bfloat16"], 0.0)  # A bfloat16-stored weight loses the update.
  # The float32 masters accumulate: 80 such steps of one sign reach a bfloat16-visible 2^-7.
  master, stored = jnp.float32(1.0), jnp.bfloat16(1.0)
  for _ in range(80):
    master, stored = master - jnp.float32(lr), (stored - jnp.bfloat16(lr)).astype(jnp.bfloat16)
  assert jnp.bfloat16(master) < 1.0 and stored == 1.0


# -- remat policies ------------------------------------------------------------------------------------------


def remat_policies_in(jaxpr) -> list:
  out = []
  for eqn in jaxpr.eqns:
    if "policy" in eqn.params and "prevent_cse" in eqn.params:  # The jax.checkpoint primitive.
      out.append(eqn.params["policy"])
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        out.extend(remat_policies_in(inner))
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_remat_policies_give_the_loss_and_gradients_of_no_remat(dtype):
  """Rematerialisation recomputes the same operations, but XLA may fuse the recomputed forward differently.

  float32: a different fusion re-associates a few float32 sums: equal within 64 eps of each gradient's
  scale (observed: 0 or a few ulp). bfloat16: XLA:CPU evaluates a fused elementwise chain in float32 and
  rounds to bfloat16 once at the fusion's output, so other fusion boundaries round other intermediates
  (observed: 1-ulp bfloat16 differences in half the entries of a norm-scale gradient); bounded like any
  change of which of the ``2R`` roundings happen, ``sqrt(2R) u`` norm-relative (module docstring).
  """
  batch = make_batch()
  cfg = get_preset("tiny", dtype=dtype, **dict(SMALL, num_layers=1))  # One block: half the compile time.
  roundings = 16 * cfg.num_layers + 3
  loss_ref, grads_ref = loss_and_grads(cfg, batch)
  leaves_ref = jax.tree.leaves(grads_ref)
  policies = list(REMAT_POLICIES) if dtype == "float32" else ["dots_with_no_batch_dims_saveable"]
  for name in policies:
    remat_cfg = cfg.replace(remat=True, remat_policy=name)
    model = Transformer(remat_cfg, rngs=nnx.Rngs(0))
    found = remat_policies_in(jax.make_jaxpr(lambda m: m(batch["ids"]))(model).jaxpr)
    assert found == [REMAT_POLICIES[name]] * cfg.num_layers, (name, found)
    loss, grads = loss_and_grads(remat_cfg, batch)
    if dtype == "bfloat16":
      assert abs(float(loss) - float(loss_ref)) <= math.sqrt(roundings) * U * float(loss_ref)
      assert max(rel_err(a, b) for a, b in zip(jax.tree.leaves(grads), leaves_ref)) < math.sqrt(2 * roundings) * U
      continue
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), leaves_ref):
      scale = float(np.abs(np.asarray(b, np.float32)).max())
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0,
                                 atol=64 * float(np.finfo(np.float32).eps) * scale + 1e-12)


# -- sharding rule sets ----------------------------------------------------------------------------------------

EXPECTED_SPECS = {  # parameter -> (fsdp, fsdp_tp); data_parallel replicates every parameter.
    "embed": P(None, "fsdp"), "final_norm": P("fsdp"),
    "qkv": P("fsdp", None, None, None), "qkv_bias": P(None, None, None), "out": P(None, None, "fsdp"),
    "gate_up": P("fsdp", None, None), "down": P(None, "fsdp"), "attn_norm": P("fsdp"), "mlp_norm": P("fsdp"),
}
EXPECTED_TP = {
    "embed": P("tensor", "fsdp"), "final_norm": P("fsdp"), "qkv": P("fsdp", "tensor", None, None),
    "qkv_bias": P("tensor", None, None), "out": P("tensor", None, "fsdp"), "gate_up": P("fsdp", "tensor", None),
    "down": P("tensor", "fsdp"), "attn_norm": P("fsdp"), "mlp_norm": P("fsdp"),
}


def named_specs(rules) -> dict[str, P]:
  """Logical -> PartitionSpec of the tiny model's parameters (block 0 stands for every block)."""
  axes = param_logical_axes(Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0)))
  flat = nnx.to_pure_dict(axes) if not isinstance(axes, dict) else axes
  out = {k: logical_to_spec(v, rules) for k, v in flat.items() if k != "blocks"}
  out.update({k: logical_to_spec(v, rules) for k, v in flat["blocks"][0].items()})
  return out


def test_rule_sets_map_parameters_to_the_intended_specs():
  assert axis_rules("fsdp_tp") == DEFAULT_AXIS_RULES
  assert named_specs(axis_rules("fsdp")) == EXPECTED_SPECS
  assert named_specs(axis_rules("fsdp_tp")) == EXPECTED_TP
  assert all(s == P(*[None] * len(s)) for s in named_specs(axis_rules("data_parallel")).values())
  assert logical_to_spec(("batch", "embed"), axis_rules("fsdp")) == P(("data", "fsdp"), None)
  with pytest.raises(ValueError, match="unknown axis rule set"):
    axis_rules("tp")


def _child() -> None:
  """On 8 fake devices: shards a mixed-precision model under each rule set, checks the specs and that
  tensor-parallel shards hold whole ``q | k | v`` groups and ``gate | up`` pairs, and runs one update."""
  from lemon_rl.models import activation_sharding, make_mesh, shard_model  # pylint: disable=g-import-not-at-top
  from lemon_rl.models.transformer import ungroup_qkv  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 8, jax.devices()
  base = get_preset("tiny", dtype="bfloat16", **SMALL)
  h, kv, d, f = base.num_heads, base.num_kv_heads, base.head_dim, base.mlp_dim
  g = h // kv
  batch = make_batch(rows=8)
  optimizer = state_lib.make_optimizer(1e-3, total_steps=10, schedule="constant")

  def one_update(model, mesh=None, rules=None):
    graphdef, state = state_lib.create_train_state(model, optimizer, seed=0)
    if mesh is None:
      _, metrics = state_lib.update_step(graphdef, state, batch, loss_fn=nll_loss, optimizer=optimizer)
    else:
      rows = jax.sharding.NamedSharding(mesh, P(("data", "fsdp")))
      with activation_sharding(mesh, rules):
        _, metrics = state_lib.update_step(graphdef, state, jax.device_put(batch, rows), loss_fn=nll_loss,
                                           optimizer=optimizer)
    return float(metrics["loss"]), float(metrics["grad_norm"])

  reference = Transformer(base, rngs=nnx.Rngs(0))
  block = reference.blocks[0]
  q_proj, k_proj, v_proj = np.split(ungroup_qkv(np.asarray(block.qkv[...]), base), [h * d, (h + kv) * d], axis=1)
  gate, up = np.asarray(block.gate_up[...])[..., 0], np.asarray(block.gate_up[...])[..., 1]
  single = one_update(reference)
  report = {"single": single, "runs": {}}
  for name, shape in (("fsdp", (1, 8, 1)), ("fsdp_tp", (2, 2, 2)), ("data_parallel", (8, 1, 1))):
    cfg = base.replace(axis_rules=axis_rules(name))
    mesh = make_mesh(*shape)
    model = shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    specs = {"embed": model.embed[...].sharding.spec, "final_norm": model.final_norm[...].sharding.spec}
    sharded = model.blocks[0]
    for key in ("qkv", "qkv_bias", "out", "gate_up", "down", "attn_norm", "mlp_norm"):
      specs[key] = getattr(sharded, key)[...].sharding.spec
    whole = []  # Each qkv shard: its KV groups' G queries, key and value; each gate_up shard: gate and up.
    for shard in sharded.qkv[...].addressable_shards:
      rows, groups = shard.index[0], range(*shard.index[1].indices(kv))
      want = np.stack([np.concatenate(
          [q_proj[rows, (k * g + j) * d:(k * g + j + 1) * d][:, None] for j in range(g)]
          + [k_proj[rows, k * d:(k + 1) * d][:, None], v_proj[rows, k * d:(k + 1) * d][:, None]], axis=1)
          for k in groups], axis=1)
      whole.append(bool(np.array_equal(np.asarray(shard.data), want)))
    for shard in sharded.gate_up[...].addressable_shards:
      rows, cols = shard.index[0], shard.index[1]
      data = np.asarray(shard.data)
      whole.append(data.shape[-1] == 2 and bool(np.array_equal(data[..., 0], gate[rows, cols]))
                   and bool(np.array_equal(data[..., 1], up[rows, cols])))
    report["runs"][name] = {"specs": {k: str(v) for k, v in specs.items()}, "whole": whole,
                            "qkv_shard_shape": list(sharded.qkv[...].addressable_shards[0].data.shape),
                            # data_parallel's update is the plain data-parallel one test_sharding runs.
                            "update": one_update(model, mesh, cfg.axis_rules) if name != "data_parallel" else None}
  print(json.dumps(report))


def test_rule_sets_on_eight_fake_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "child"], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  cfg = get_preset("tiny", **SMALL)
  e, kv, d, g = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_groups
  runs = report["runs"]
  assert runs["fsdp"]["specs"] == {k: str(v) for k, v in EXPECTED_SPECS.items()}
  assert runs["fsdp_tp"]["specs"] == {k: str(v) for k, v in EXPECTED_TP.items()}
  assert all("'" not in s for s in runs["data_parallel"]["specs"].values())  # No mesh axis named.
  assert runs["fsdp"]["qkv_shard_shape"] == [e // 8, kv, g + 2, d]
  assert runs["fsdp_tp"]["qkv_shard_shape"] == [e // 2, kv // 2, g + 2, d]  # Whole groups per device.
  for run in runs.values():
    assert run["whole"] and all(run["whole"]), run
    if run["update"] is None:
      continue
    # One update's loss and gradient norm: the same bfloat16 program with the matmuls split and summed in
    # another order (8-way; a sum of bfloat16-rounded partials): within the bfloat16 forward/backward bound.
    loss, grad_norm = run["update"]
    assert abs(loss - report["single"][0]) <= math.sqrt(ROUNDINGS) * U * report["single"][0], run
    assert abs(grad_norm - report["single"][1]) <= math.sqrt(2 * ROUNDINGS) * U * report["single"][1], run


if __name__ == "__main__":
  if sys.argv[1:] == ["child"]:
    _child()
  else:
    raise SystemExit(f"usage: {sys.argv[0]} child")
