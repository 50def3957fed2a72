"""The launcher's malloc settings: a re-executed child sees GLIBC_TUNABLES, the opt-out flag keeps defaults."""

import os
import subprocess
import sys

import pytest

from lemon_rl.utils import allocator

CHILD = ("import os, sys; from lemon_rl.utils.allocator import reexec_with_malloc_tuning; "
         "reexec_with_malloc_tuning(); print(os.environ.get('GLIBC_TUNABLES', '-')); print(sys.argv[1:])")


def _run(*args):
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  out = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=True)
  return out.stdout.splitlines()


@pytest.mark.skipif(allocator.platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_reexec_sets_the_tunables_and_keeps_the_arguments():
  assert _run("--a=1", "b") == [allocator.MALLOC_TUNABLES, "['--a=1', 'b']"]


def test_opt_out_flag_keeps_the_defaults_and_is_removed():
  assert _run("--a=1", allocator.OPT_OUT_FLAG) == ["-", "['--a=1']"]
