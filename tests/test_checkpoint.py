"""Tests for lemon_rl.training.checkpoint."""

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lemon_rl.training.checkpoint import Checkpointer
from lemon_rl.training.checkpoint import TargetMismatchError

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_checkpoint_child.py")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_child_module():
  spec = importlib.util.spec_from_file_location("_checkpoint_child", _CHILD)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _bits(x):
  """Raw bytes, dtype and shape of an array leaf (typed PRNG keys via their key data)."""
  if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    return ("key", str(x.dtype), _bits(jax.random.key_data(x)))
  if isinstance(x, (int, float, bool)):
    return (type(x).__name__, x)
  a = np.asarray(x)
  return (str(a.dtype), a.shape, a.tobytes())


def assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert _bits(x) == _bits(y)


def _train_state(seed=0):
  params = {"dense": {"kernel": jax.random.normal(jax.random.key(seed), (8, 16)),
                      "bias": jnp.linspace(-1.0, 1.0, 16)},
            "embed": jax.random.normal(jax.random.key(seed + 1), (12, 8)).astype(jnp.bfloat16)}
  opt = optax.adamw(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.1)
  opt_state = opt.init(params)
  for i in range(2):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p.astype(jnp.float32) * (i + 1)).astype(p.dtype), params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return {"params": params, "opt_state": opt_state, "step": jnp.asarray(2, jnp.int32),
          "rng": jax.random.key(seed + 7), "rngs": jax.random.split(jax.random.key(seed + 8), 3),
          "raw_rng": jax.random.PRNGKey(seed + 9), "epoch": 3}


@pytest.mark.parametrize("async_save", [True, False])
def test_exact_round_trip(tmp_path, async_save):
  state = _train_state()
  meta = {"data": {"next_index": 17, "seed": 0, "num_epochs": None}, "lr": 1e-3, "name": "run é"}
  with Checkpointer(tmp_path / "ckpt", async_save=async_save) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(10, state, meta)
    ckpt.wait_until_finished()
    assert ckpt.latest_step() == 10
    # From an abstract target (jax.eval_shape: no shardings given) and from concrete arrays.
    for target in (jax.eval_shape(lambda: state), jax.tree.map(jnp.zeros_like, state)):
      restored, restored_meta = ckpt.restore(target)
      assert restored_meta == meta
      if not isinstance(target["epoch"], int):
        restored["epoch"] = int(restored["epoch"])
      assert_bitwise_equal(restored, state)
    assert ckpt.read_metadata() == meta
  # The key is a typed key again and still usable.
  assert restored["rng"].dtype == state["rng"].dtype
  np.testing.assert_array_equal(jax.random.uniform(restored["rng"], (4,)), jax.random.uniform(state["rng"], (4,)))


def test_nnx_state_with_rng_streams(tmp_path):

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 3, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)
      self.rngs = rngs

  model = Model(nnx.Rngs(0, dropout=1))
  model.rngs.dropout()  # Advance a stream so that count and key differ from a fresh model.
  state = nnx.state(model)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state)
    ckpt.wait_until_finished()
    abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(5, dropout=6))))
    restored, meta = ckpt.restore(abstract)
  assert meta == {}
  assert_bitwise_equal(restored, state)
  fresh = Model(nnx.Rngs(5, dropout=6))
  nnx.update(fresh, restored)
  np.testing.assert_array_equal(fresh.linear.kernel[...], model.linear.kernel[...])
  np.testing.assert_array_equal(jax.random.key_data(fresh.rngs.dropout()), jax.random.key_data(model.rngs.dropout()))


def test_keep_n_and_explicit_steps(tmp_path):
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    for step in range(1, 6):
      ckpt.save(step, {"x": jnp.full((3,), step, jnp.float32)}, {"step": step})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [4, 5]
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["4", "5"]
    target = {"x": jax.ShapeDtypeStruct((3,), jnp.float32)}
    state, meta = ckpt.restore(target, step=4)
    np.testing.assert_array_equal(state["x"], [4, 4, 4])
    assert meta == {"step": 4}
    with pytest.raises(FileNotFoundError, match="step 1"):
      ckpt.restore(target, step=1)
  # Reopening sees the same steps.
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() == 5
    assert ckpt.read_metadata(4) == {"step": 4}


def test_uncommitted_directories_are_never_latest(tmp_path):
  target = {"x": jax.ShapeDtypeStruct((2,), jnp.float32)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, {"x": jnp.asarray([1.0, 2.0])}, {"ok": True})
  # A half-copied step directory (no commit marker) and a tmp directory left by a crash.
  os.makedirs(tmp_path / "9" / "state")
  (tmp_path / "9" / "state" / "garbage").write_text("x")
  os.makedirs(tmp_path / "3.orbax-checkpoint-tmp" / "state")
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 2
    assert not (tmp_path / "3.orbax-checkpoint-tmp").exists()
    assert not (tmp_path / "9").exists()
    moved = os.listdir(tmp_path / "_uncommitted")
    assert len(moved) == 1 and moved[0].startswith("9.")
    state, meta = ckpt.restore(target)
    np.testing.assert_array_equal(state["x"], [1.0, 2.0])
    assert meta == {"ok": True}
    # orbax alone would refuse step 3 because of "9"; here the next save works.
    assert ckpt.save(3, {"x": jnp.asarray([3.0, 4.0])})
    ckpt.wait_until_finished()
    assert ckpt.latest_step() == 3


def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog):
  target = {"x": jax.ShapeDtypeStruct((4,), jnp.float32)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"x": jnp.arange(4.0)}, {"step": 1})
    ckpt.save(2, {"x": jnp.arange(4.0) + 10}, {"step": 2})
  # Damage step 2 after its commit: delete its array data.
  for root, _, files in os.walk(tmp_path / "2" / "state"):
    for f in files:
      if f not in ("commit_success.txt", "_METADATA"):
        os.remove(os.path.join(root, f))
  with Checkpointer(tmp_path) as ckpt:
    with caplog.at_level(logging.WARNING, logger="lemon_rl.training.checkpoint"):
      state, meta = ckpt.restore(target)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(state["x"], np.arange(4.0))
    assert "could not restore checkpoint step 2" in caplog.text
    with pytest.raises(Exception):
      ckpt.restore(target, step=2)


def test_errors(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
      ckpt.restore({"x": jax.ShapeDtypeStruct((1,), jnp.float32)})
    with pytest.raises(ValueError, match="JSON"):
      ckpt.save(1, {"x": jnp.zeros(1)}, {"bad": object()})
    ckpt.save(1, {"x": jnp.zeros(1), "k": jax.random.key(0)})
    ckpt.wait_until_finished()
    with pytest.raises(ValueError, match="step 1 already exists"):
      ckpt.save(1, {"x": jnp.zeros(1), "k": jax.random.key(0)})
    # The target wants raw uint32 where a typed key was saved.
    with pytest.raises(TargetMismatchError, match="PRNG key"):
      ckpt.restore({"x": jax.ShapeDtypeStruct((1,), jnp.float32), "k": jax.ShapeDtypeStruct((2,), jnp.uint32)})
    # A different key implementation than the saved one.
    rbg = jax.random.key(0, impl="rbg")
    with pytest.raises(TargetMismatchError, match="key<fry>"):
      ckpt.restore({"x": jax.ShapeDtypeStruct((1,), jnp.float32), "k": jax.eval_shape(lambda: rbg)})
  with pytest.raises(ValueError, match="max_to_keep"):
    Checkpointer(tmp_path / "other", max_to_keep=0)


def test_sigkill_during_async_save_resumes_from_previous(tmp_path):
  """A process SIGKILLed while an async save of ~200 MB is being written loses only that save."""
  child = _load_child_module()
  directory = str(tmp_path / "ckpt")
  size_mb = 200
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_REPO)
  proc = subprocess.Popen([sys.executable, _CHILD, "kill", directory, str(size_mb)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=_REPO)
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line.strip())
      if line.startswith("saving"):
        break
    assert lines and lines[-1] == "saving", (lines, proc.stderr.read() if proc.poll() is not None else "")
    # Step 1 is committed before the second save starts (whose tmp directory may already exist under load).
    assert sorted(os.listdir(directory)) in (["1"], ["1", "2.orbax-checkpoint-tmp"]), os.listdir(directory)
    tmp_dir = os.path.join(directory, "2.orbax-checkpoint-tmp")
    deadline = time.monotonic() + 60
    while not os.path.exists(tmp_dir):
      assert time.monotonic() < deadline, "the child never started writing step 2"
      time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == -signal.SIGKILL
  rest = proc.stdout.read()
  # The kill landed in the middle of the save: step 2 never committed, its tmp directory is left behind.
  assert "finished" not in rest
  assert not os.path.exists(os.path.join(directory, "2")), "step 2 committed before the kill; enlarge the state"
  assert os.path.isdir(tmp_dir)

  expected1 = child.make_state(1, size_mb)
  abstract = jax.eval_shape(lambda: expected1)
  with Checkpointer(directory, max_to_keep=3) as ckpt:
    assert not os.path.exists(tmp_dir)  # Cleaned up on open.
    assert ckpt.latest_step() == 1
    restored, meta = ckpt.restore(abstract)
    assert meta == child.metadata_for(1)
    assert_bitwise_equal(restored, expected1)
    del restored, expected1
    # The next save (of the same step that was interrupted) works and round-trips.
    expected2 = child.make_state(2, size_mb)
    assert ckpt.save(2, expected2, child.metadata_for(2))
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [1, 2]
    restored, meta = ckpt.restore(abstract)
    assert meta == child.metadata_for(2)
    assert_bitwise_equal(restored, expected2)
  with open(os.path.join(directory, "2", "metadata", "metadata")) as f:
    assert json.load(f)["metadata"] == child.metadata_for(2)


def test_sharded_save_restores_onto_other_meshes(tmp_path):
  """Saved from a 4-device mesh; restored onto a (2, 2) mesh with other shardings and onto one device."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_REPO,  # Keeps the caller's XLA flags (e.g. the ISA).
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
  result = subprocess.run([sys.executable, _CHILD, "mesh", str(tmp_path / "ckpt")], capture_output=True, text=True,
                          env=env, cwd=_REPO, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.strip().splitlines()[-1] == "OK"
