"""glibc malloc settings that keep XLA's per-step scratch memory in the process.

XLA on CPU allocates a step's temporary buffer (hundreds of MB for a training step) on every call; glibc serves
a block that large with a fresh ``mmap`` (or from a worker thread's arena) and returns it to the OS afterwards,
so every step page-faults it in again: on the measured machines this was about a third of a training step as
system time (``BENCHMARKS.md``; the README's main job spent 244 s of 9 min 30 s in minor page faults on an AVX2
EPYC). :data:`MALLOC_TUNABLES` keeps freed memory in the main heap: one arena, no ``mmap`` chunks, no trimming.

The settings are read by glibc at process start, so :func:`reexec_with_malloc_tuning` re-executes the current
command (same interpreter, same ``-m`` module or script, same arguments) with ``GLIBC_TUNABLES`` set, unless it
is already set (the user's choice wins) or ``opt_out_flag`` is among the arguments. Call it first thing in a
``__main__`` block, before JAX is imported. A no-op off Linux/glibc.
"""

from __future__ import annotations

import os
import platform
import sys

MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295"
OPT_OUT_FLAG = "--default_malloc"


def reexec_with_malloc_tuning(opt_out_flag: str = OPT_OUT_FLAG) -> None:
  """Re-executes this process with :data:`MALLOC_TUNABLES` (see the module docstring); returns if it does not."""
  if "GLIBC_TUNABLES" in os.environ or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return
  if opt_out_flag in sys.argv:
    sys.argv.remove(opt_out_flag)
    return
  env = dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES)
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
