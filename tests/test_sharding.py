"""Mesh construction, logical-axis rules, and 1-device vs 8-fake-device equivalence."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec

from lemon_rl.models import DEFAULT_AXIS_RULES, make_mesh
from lemon_rl.models.sharding import logical_to_spec


def test_logical_rules_map_to_mesh_axes():
  assert logical_to_spec(("embed", "mlp"), DEFAULT_AXIS_RULES) == PartitionSpec("fsdp", "tensor")
  assert logical_to_spec(("batch", None), DEFAULT_AXIS_RULES) == PartitionSpec(("data", "fsdp"), None)
  # A mesh axis is used once: batch takes fsdp, so embed is replicated.
  assert logical_to_spec(("batch", "embed"), DEFAULT_AXIS_RULES) == PartitionSpec(("data", "fsdp"), None)


def test_make_mesh_on_one_device_and_errors():
  mesh = make_mesh()
  assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.size == 1
  with pytest.raises(ValueError, match="needs 4 devices"):
    make_mesh(data=2, fsdp=2, tensor=1)


def test_eight_fake_devices_match_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu",  # Keeps any XLA flags of the caller (e.g. --xla_cpu_max_isa).
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
  script = os.path.join(os.path.dirname(__file__), "_sharding_check.py")
  out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["param_spec"] == "P('fsdp', 'tensor', None)"  # gate_up [E, F, 2]: F split, gate|up kept.
  # Float32 sums in another order (8 shards; also AVX2 vs AVX-512): a logit sums contractions over d 64, MLP
  # 128, <= 12 attended positions and the vocabulary 64 (softmax), worst case K eps |x| apart; the loss is a
  # mean of n positive NLL terms (each within K eps of its logit scale); a gradient entry sums n token terms.
  eps = float(np.finfo(np.float32).eps)
  k, n = 64 + 128 + 12 + 64, result["num_tokens"]
  assert result["logits"] <= k * eps * result["logit_scale"], result
  assert result["loss"] <= (n + k) * eps * (result["loss_value"] + result["logit_scale"]), result
  assert result["grad"] <= (n + k) * eps * result["grad_scale"], result
  assert result["greedy_equal"]
