"""Shared pytest setup: float32 everywhere, no GPU/TPU probing, fast XLA compiles, one compilation cache per run."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import filelock
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests' programs are tiny and compile for far longer than they run. LLVM at -O0 (XLA's HLO passes still
# run) cuts the suite's CPU time by about a fifth, e.g. tests/test_rollout.py 41 -> 29 CPU s and
# tests/test_speculative.py 90 -> 72 CPU s on the 2-core Xeon. XLA:CPU's MLIR fusion emitters run an MLIR pass
# pipeline per fusion (a sixth of a tiny reproduction's CPU time under perf); its elemental LLVM IR emitters
# compile the same fusions without it: tests/test_rollout.py + tests/test_drafter.py 71 -> 44 CPU s (Xeon,
# 2026-12-07). Workers and subprocesses inherit the settings; a run that sets either flag itself keeps its own.
# XLA aborts a process on a flag it does not know, so a jaxlib that has dropped one runs without it.
_FAST_COMPILE = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}


def _xla_accepts(flags: str) -> bool:
  """Whether this jaxlib's XLA starts with ``XLA_FLAGS=flags`` (asked of a child process: ~2 s, once per run)."""
  probe = [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"]
  return subprocess.run(probe, env=dict(os.environ, XLA_FLAGS=flags), capture_output=True, timeout=300).returncode == 0


_missing = [f"{flag}={value}" for flag, value in _FAST_COMPILE.items() if flag not in os.environ.get("XLA_FLAGS", "")]
if _missing:
  _base = os.environ.get("XLA_FLAGS", "")
  if not _xla_accepts(" ".join([_base, *_missing])):
    _missing = [f for f in _missing if _xla_accepts(f"{_base} {f}")]
  os.environ["XLA_FLAGS"] = " ".join([_base, *_missing]).strip()


@pytest.fixture
def pmap_variant_on_one_device():
  """chex skips ``with_pmap`` variants on one device; run them (pmap over the one device pytest sees)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import chex  # pylint: disable=g-import-not-at-top,unused-import  (defines the flag)
  flag = flags.FLAGS["chex_skip_pmap_variant_if_single_device"]
  saved, flag.value = flag.value, False
  yield
  flag.value = saved


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_speculative_run(tmp_path_factory):
  """``(workdir, stdout)`` of ``python -m experiments.train_speculative --config=configs/stdlib_speculative.py:tiny``
  (tokenizer, target, drafter and report in under a minute), run once per test run: the xdist workers share it
  through a file lock in their common base directory. Tests read the workdir, never write to it."""
  root = tmp_path_factory.getbasetemp().parent  # common to every xdist worker of this run
  workdir, log = root / "tiny_speculative" / "run", root / "tiny_speculative.json"
  with filelock.FileLock(str(root / "tiny_speculative.lock")):
    if not log.exists():
      proc = subprocess.run([sys.executable, "-m", "experiments.train_speculative",
                             "--config=configs/stdlib_speculative.py:tiny", f"--workdir={workdir}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
      assert proc.returncode == 0, proc.stderr[-3000:]
      log.write_text(json.dumps({"stdout": proc.stdout}))
  return str(workdir), json.loads(log.read_text())["stdout"]


_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
  """Shares compiled XLA programs across the run: the xdist workers and every subprocess a test starts inherit
  a fresh persistent cache directory (about 15% less wall time, as many tests compile the same tiny models).
  The cache keys on the HLO, the flags and jaxlib, so a hit is the program a fresh compile would give. Runs
  that set ``JAX_COMPILATION_CACHE_DIR`` themselves keep theirs; the directory is removed at the end.
  """
  if hasattr(config, "workerinput") or _CACHE_ENV in os.environ:
    return
  config.lemon_rl_xla_cache = tempfile.mkdtemp(prefix="lemon_rl_xla_cache_")
  os.environ[_CACHE_ENV] = config.lemon_rl_xla_cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
  directory = getattr(config, "lemon_rl_xla_cache", None)
  if directory:
    shutil.rmtree(directory, ignore_errors=True)
    if os.environ.get(_CACHE_ENV) == directory:
      del os.environ[_CACHE_ENV]
