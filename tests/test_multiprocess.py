"""Multi-process (multi-host) training on one machine: two JAX processes x 2 CPU devices with gloo collectives.

The harness starts ``python -m experiments.main`` (config: ``_multiprocess_child.py``) once in one process with
4 CPU devices and once in two processes with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` each and
``--coordinator_address=127.0.0.1:<free port> --num_processes=2 --process_id=i`` (gloo collectives), so the
multi-host code paths (``jax.make_array_from_process_local_data``, per-process sampling and rewards, gathers,
orbax's multi-host checkpoints, the preemption sync point, process-0 logging) run in CI rather than first on
a cluster. A process that reads an array another process holds fails loudly in JAX (non-addressable data), so
a clean two-process run also shows that nothing does. About 2 minutes on 2 idle cores (3 launches; compiles
dominate).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.text import ByteTokenizer
from lemon_rl.training import state as state_lib
from lemon_rl.training.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(TESTS, "_multiprocess_child.py")
sys.path.insert(0, TESTS)
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int):
  """A child's environment: ``devices`` CPU devices (keeping the caller's XLA flags, e.g. a max ISA), and no
  distributed settings inherited from the caller (the two-process launch passes them as flags)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip())
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def start(args, devices: int, log: str) -> subprocess.Popen:
  """Starts ``args`` with ``devices`` CPU devices; stdout and stderr go to ``log.out`` / ``log.err`` (files: a
  pipe nobody reads while the test polls could fill up and block the child)."""
  with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
    proc = subprocess.Popen(args, env=_env(devices), cwd=REPO, stdout=out, stderr=err, text=True)
  proc.log = log
  return proc


def wait_all(procs, timeout=TIMEOUT_S) -> list[tuple[int, str, str]]:
  """``(returncode, stdout, stderr)`` of each process. If one fails (any status but 0 or 143), or at the
  deadline, the others are killed (a process left alone would wait for its peer in a collective)."""
  deadline = time.monotonic() + timeout
  try:
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0, 143) for p in procs):
        time.sleep(2.0)  # Let the others report what they can, then stop them.
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  results = []
  for p in procs:
    with open(p.log + ".out") as out, open(p.log + ".err") as err:
      results.append((p.returncode, out.read(), err.read()))
  return results


def run_single(args, devices: int = 4) -> str:
  out = subprocess.run(args, env=_env(devices), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert out.returncode == 0, out.stderr[-4000:]
  return out.stdout


def _records(workdir) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def preempt_when(procs, workdir, last_step: int, target: int):
  """Waits until ``workdir``'s metrics log RL step ``last_step``, then SIGTERMs ``procs[target]`` only.

  Returns each process's ``(returncode, stdout, stderr)``."""
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while not any(r["phase"] == "rl" and r["step"] >= last_step for r in _records(workdir)):
      if any(p.poll() is not None for p in procs):
        break  # A process ended early: report its output below.
      assert time.monotonic() < deadline, f"RL step {last_step} never logged in {workdir}"
      time.sleep(0.5)
    if procs[target].poll() is None:
      procs[target].send_signal(signal.SIGTERM)
  finally:
    results = wait_all(procs, timeout=max(30.0, deadline - time.monotonic()))
  return results


def _saved_step(err: str) -> int:
  found = re.findall(r"checkpoint saved at step (\d+)", err)
  assert found, err[-4000:]
  return int(found[-1])


MAIN = [sys.executable, "-m", "experiments.main", f"--config={CHILD}", "--default_malloc"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The child's experiment (``_multiprocess_child.py``): in one process with 4 devices, SIGTERMed after step 2;
  then in two processes (2 + 2 devices, launched with --coordinator_address / --num_processes / --process_id)
  resuming that run's step-1 checkpoint, SIGTERMed (process 1 only) after step 3."""
  root = tmp_path_factory.mktemp("runs")
  one, two = str(root / "one"), str(root / "two")
  proc = start(MAIN + [f"--workdir={one}"], 4, str(root / "one"))
  (rc, _, err), = preempt_when([proc], one, 2, 0)
  assert rc == 143, err[-4000:]
  # The two-process run starts from the single run's step-1 checkpoint and its metrics up to then.
  shutil.copytree(one, two)
  for name in os.listdir(os.path.join(two, "checkpoints", "rl")):
    if name.isdigit() and int(name) > 1:
      shutil.rmtree(os.path.join(two, "checkpoints", "rl", name))
  with open(os.path.join(two, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in _records(one) if r["step"] <= 1)
  port = _free_port()
  procs = [start(MAIN + [f"--workdir={two}", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                         f"--process_id={i}"], 2, str(root / f"two_{i}")) for i in range(2)]
  results = preempt_when(procs, two, 3, 1)
  for rc, _, err in results:
    assert rc == 143, err[-4000:]
  return one, two, [_saved_step(err) for _, _, err in results]


def _scored(workdir, processes, process):
  with open(os.path.join(workdir, "data", f"scored_{processes}_{process}.jsonl")) as f:
    return [json.loads(line) for line in f]


def _step(workdir, step, phase="rl"):
  return next(r for r in _records(workdir) if r["phase"] == phase and r["step"] == step)


def _abstract_train_state():
  """The child experiment's train state (its model and optimizer) as a one-device restore target."""
  import _multiprocess_child as child  # pylint: disable=g-import-not-at-top
  from lemon_rl.training.experiment import build_model  # pylint: disable=g-import-not-at-top
  from lemon_rl.training import phases  # pylint: disable=g-import-not-at-top
  config = child.experiment_config()
  model = nnx.eval_shape(lambda: build_model(config, ByteTokenizer().vocab_size))
  optimizer = phases.optimizer_from_section(config.rl, phases.rl_updates_per_step(config.rl))
  abstract = jax.eval_shape(lambda p: state_lib.TrainState(
      params=p, opt_state=optimizer.init(p), step=jax.numpy.zeros((), jax.numpy.int32),
      rng=jax.random.key_data(jax.random.key(0))), nnx.state(model, nnx.Param))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)


def _restore(workdir, step):
  with Checkpointer(os.path.join(workdir, "checkpoints", "rl")) as ckpt:
    return ckpt.restore(_abstract_train_state(), step=step)


# Float32 tolerances of the two-process vs one-process step. The per-device programs are the same (same mesh
# shape, same global batch, the same sampled tokens: sampling has no cross-device reduction on a data-parallel
# mesh); only the cross-device sums (4 partial loss sums and gradients) may be added in another order by gloo,
# each then within ~3 eps of the sum of its parts' magnitudes. 64 eps bounds the loss (against its per-token
# term scale max|A|, the loss being a mean of such terms) and the gradient norm. Adam divides each gradient
# entry by its own RMS: an entry whose exact gradient is ~0 (e.g. a key bias, to which softmax is invariant)
# moves by its rounding noise (|dg| ~ 1e-11 here) over eps_adam = 1e-8, so its step may differ by ~1e-3 lr;
# hence parameters within UPDATES x lr x 1e-3, and Adam's moments (plain sums of gradients) within 64 eps.
EPS = float(np.finfo(np.float32).eps)


def test_two_processes_take_the_one_process_grpo_step(runs):
  """Step 2 of the two-process run (resumed from the one-process step 1) equals the one-process step 2."""
  import _multiprocess_child as child  # pylint: disable=g-import-not-at-top
  one, two, _ = runs
  # Each process scored only its own prompts' G completions (its data shard: half the global batch), the same
  # completions the single process sampled for that step: groups stay in one process, rewards where sampled.
  single = _scored(one, 1, 0)[1]  # Call k = step k + 1 of that run.
  halves = [_scored(two, 2, p)[0] for p in range(2)]  # Its first step is step 2.
  assert [tuple(x) for x in halves[0] + halves[1]] == [tuple(x) for x in single]
  for half in halves:  # Two prompts, each one group of G consecutive rows.
    prompts = [p for p, _ in half]
    assert prompts == [q for q in dict.fromkeys(prompts) for _ in range(child.GENERATIONS)] and len(half) == 8
  assert not {p for p, _ in halves[0]} & {p for p, _ in halves[1]}
  a, b = _step(one, 2), _step(two, 2)
  # Gathered statistics: of the global batch (REINFORCE++ advantages normalised over both processes' rows).
  for key in ("reward/total/mean", "reward/total/std", "reward/r/mean", "completion_length/mean",
              "frac_all_equal_groups", "advantage/std", "advantage/min", "advantage/max"):
    np.testing.assert_allclose(b[key], a[key], rtol=4 * EPS, atol=4 * EPS, err_msg=key)
  assert a["advantage/std"] > 0.5 and a["reward/total/std"] > 0  # A step with a gradient.
  term_scale = max(abs(a["advantage/min"]), abs(a["advantage/max"]))
  for key in ("train/loss", "train/pg_loss"):
    assert abs(b[key] - a[key]) <= 64 * EPS * term_scale, (key, a[key], b[key])
  for key in ("train/grad_norm", "train/entropy", "train/ratio_mean", "train/clip_frac"):
    np.testing.assert_allclose(b[key], a[key], rtol=64 * EPS, atol=64 * EPS, err_msg=key)
  # The held-out evaluation after step 2 (greedy, 3 prompts: each process pads its copy to its 2 devices).
  assert _step(two, 2, "eval_rl") == _step(one, 2, "eval_rl")
  # Parameters and optimizer state after step 2, each restored into this process (one device).
  (sa, meta_a), (sb, meta_b) = _restore(one, 2), _restore(two, 2)
  assert meta_a["data"]["num_shards"] == 1 and meta_b["data"]["num_shards"] == 2
  assert meta_a["data"]["next_index"] == meta_b["data"]["next_index"] == 2
  bound = child.UPDATES_PER_STEP * child.LEARNING_RATE * 1e-3
  for pa, pb in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
    np.testing.assert_allclose(np.asarray(pb), np.asarray(pa), rtol=0, atol=bound)
  for ma, mb in zip(jax.tree.leaves(sa.opt_state), jax.tree.leaves(sb.opt_state)):
    ma, mb = np.asarray(ma), np.asarray(mb)
    if np.issubdtype(ma.dtype, np.floating):
      np.testing.assert_allclose(mb, ma, rtol=64 * EPS, atol=64 * EPS * np.abs(ma).max())
    else:
      np.testing.assert_array_equal(mb, ma)
  assert int(sa.step) == int(sb.step) == 2 * child.UPDATES_PER_STEP


def test_checkpoints_restore_across_process_counts(runs):
  one, two, steps = runs
  # One -> two processes: the two-process run resumed the single run's step-1 checkpoint (state and data
  # position: its step 2 is the single run's step 2, previous test); it never re-ran step 1.
  assert _step(two, 1) == _step(one, 1)
  assert len(_scored(two, 2, 0)) == len(_scored(two, 2, 1)) == steps[0] - 1
  # Two processes -> one: what the two-process run wrote restores in this process, onto one device.
  state, meta = _restore(two, steps[0])
  assert int(state.step) == steps[0] * 4 and meta["phase_step"] == steps[0]
  assert all(isinstance(x, jax.Array) and len(x.devices()) == 1 for x in jax.tree.leaves(state))


def test_sigterm_to_one_process_stops_both_at_the_same_checkpoint(runs):
  _, two, steps = runs
  assert steps[0] == steps[1] >= 3, steps
  with Checkpointer(os.path.join(two, "checkpoints", "rl")) as ckpt:
    assert ckpt.latest_step() == steps[0]
    meta = ckpt.read_metadata()
  assert meta["phase_step"] == steps[0]
  # The data position counts global batches (2 shards of 2 prompts): one per step.
  assert meta["data"]["next_index"] == steps[0] and meta["data"]["num_shards"] == 2
  # Only process 0 logged, one record per step.
  assert [r["step"] for r in _records(two) if r["phase"] == "rl"] == list(range(1, steps[0] + 1))


def test_tensor_parallel_layout_keeps_qkv_and_gate_up_whole(tmp_path):
  """Which slice of which projection each device holds under tensor parallelism (not only the values)."""
  out = str(tmp_path / "layout.json")
  run_single([sys.executable, CHILD, "layout", out])
  with open(out) as f:
    report = json.load(f)
  split, wide = report["meshes"]
  # (2, 1, 2): each tensor shard holds whole KV groups -- the group's query heads, key and value (and their
  # biases) -- the same heads' rows of the output projection, and matching gate and up columns.
  assert split["qkv_spec"] == "P('fsdp', 'tensor', None, None)"
  assert split["gate_up_spec"] == "P('fsdp', 'tensor', None)"
  failed = [c for m in report["meshes"] for c in m["checks"] if not c[-1]]
  assert not failed, failed
  heads = {tuple(c[2]) for c in split["checks"] if c[0] == "qkv"}
  assert heads == {(0,), (1,)}
  assert {tuple(c[2]) for c in split["checks"] if c[0] == "gate_up"} == {(0, 16), (16, 32)}
  # Nothing moved between devices and no fused weight re-assembled: the split matches the computation.
  assert split["resharding_ops"] == 0 and not split["weight_all_gathers"], split
  assert split["collectives"] == ["all-reduce"], split["collectives"]
  # (1, 1, 4) with 2 KV heads: groups cannot split 4 ways, so QKV stays whole (replicated); gate/up still
  # split into 4 blocks of matching columns; the output projection into whole heads.
  assert wide["qkv_spec"] == "P('fsdp', None, None, None)"
  assert {tuple(c[2]) for c in wide["checks"] if c[0] == "qkv"} == {(0, 1)}
  assert not wide["weight_all_gathers"], wide
  # Values: float32 sums over E 32, D 32, F 32 and V 64 in another order (a few eps of the logit scale).
  for m in report["meshes"]:
    assert m["logits_max_diff"] <= 160 * EPS * max(m["logit_scale"], 1.0), m


def test_data_shards_are_disjoint_and_cover_the_epoch():
  """Each process reads a disjoint slice of every global batch; over an epoch the union is the whole data."""
  records = [{"x": np.int32(i)} for i in range(60)]
  # Two shards of a global batch of 12 (6 each): 5 steps are one epoch.
  shards = [list(BatchIterator(records, batch_size=6, seed=3, num_epochs=1, shard_index=s, num_shards=2))
            for s in range(2)]
  assert [len(s) for s in shards] == [5, 5] and all(len(b["x"]) == 6 for s in shards for b in s)
  single = list(BatchIterator(records, batch_size=12, seed=3, num_epochs=1))
  for step, (a, b) in enumerate(zip(*shards)):
    assert not set(a["x"]) & set(b["x"])
    # The shards of a step together are the single iterator's global batch (the run does not depend on S).
    np.testing.assert_array_equal(np.concatenate([a["x"], b["x"]]), single[step]["x"])
  assert sorted(np.concatenate([b["x"] for s in shards for b in s])) == list(range(60))
  # Remainder: 63 records -> 5 global batches of 12 per epoch; the 3 left over are dropped (equal shards).
  records = [{"x": np.int32(i)} for i in range(63)]
  shards = [list(BatchIterator(records, batch_size=6, seed=3, num_epochs=1, shard_index=s, num_shards=2))
            for s in range(2)]
  seen = np.concatenate([b["x"] for s in shards for b in s])
  assert len(seen) == 60 and len(set(seen)) == 60
  with pytest.raises(ValueError, match="drop_remainder"):
    BatchIterator(records, batch_size=6, num_epochs=1, drop_remainder=False, shard_index=0, num_shards=2)
  # A position saved by one shard of a 2-way split resumes a single iterator of the same global batch.
  two = BatchIterator(records, batch_size=6, seed=3, shard_index=1, num_shards=2)
  for _ in range(7):
    next(two)
  one = BatchIterator(records, batch_size=12, seed=3)
  one.set_state(json.loads(json.dumps(two.get_state())))
  reference = BatchIterator(records, batch_size=12, seed=3)
  for _ in range(7):
    next(reference)
  np.testing.assert_array_equal(next(one)["x"], next(reference)["x"])
  with pytest.raises(ValueError, match="batch_size \\* num_shards=12 vs 8"):
    BatchIterator(records, batch_size=8, seed=3).set_state(two.get_state())
