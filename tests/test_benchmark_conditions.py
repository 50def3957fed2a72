"""The /proc parsing and load accounting of ``benchmarks/conditions.py`` (no timing, no JAX)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import conditions  # pylint: disable=g-import-not-at-top,wrong-import-position

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""

# user nice system idle iowait irq softirq steal guest guest_nice
STAT = """cpu  900 0 300 5000 100 0 0 0 50 0
cpu0 500 0 100 2000 40 10 5 7 50 0
cpu1 400 0 200 3000 60 0 0 0 0 0
intr 1 2 3
ctxt 99
"""


def test_cpuinfo_model_and_flags():
  model, flags = conditions.parse_cpuinfo(CPUINFO)
  assert model == "AMD EPYC 7B13 64-Core Processor"
  assert [f for f in conditions.ISA_FLAGS if f in flags] == ["avx", "avx2", "fma"]
  assert conditions.parse_cpuinfo("") == ("unknown", frozenset())


def test_proc_stat_busy_excludes_idle_and_iowait_and_counts_guest_once():
  stat = conditions.parse_proc_stat(STAT)
  assert set(stat) == {0, 1}  # The aggregate "cpu" line and the other lines are skipped.
  # cpu0: user 500 + system 100 + irq 10 + softirq 5 + steal 7 (guest 50 is inside user already).
  assert stat[0] == (622, 2662, 7)
  assert stat[1] == (600, 3660, 0)
  assert conditions.steal_seconds(stat, [0, 1], ticks_per_s=100) == 0.07
  assert conditions.busy_seconds(stat, [0], ticks_per_s=100) == 6.22
  assert conditions.busy_seconds(stat, [0, 1, 7], ticks_per_s=100) == 12.22  # An absent CPU counts 0.


def test_isa_restrictions_from_the_environment():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2",
         "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": ""}
  assert conditions.isa_restrictions(env) == ["XLA AVX2", "ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2"]
  assert not conditions.isa_restrictions({"XLA_FLAGS": "--xla_dump_to=/tmp/x"})


def _conditions(load, busy_ticks, own_cpu_s, wall_s, steal_ticks=(0, 0)):
  """Conditions over CPUs 0 and 1 (100 ticks/s) whose window saw ``busy_ticks`` per CPU (``steal_ticks`` of
  them hypervisor steal) and ``own_cpu_s``."""
  tick = conditions.CpuTicks
  cond = conditions.Conditions("test", peak=None, threshold=0.25)
  cond.cpus, cond.ticks_per_s = [0, 1], 100.0
  cond.baseline = conditions.Snapshot(wall=10.0, load=load, stat={0: tick(1000, 5000, 10), 1: tick(2000, 5000, 20)},
                                      own_cpu=3.0)
  now = conditions.Snapshot(wall=10.0 + wall_s, load=load,
                            stat={0: tick(1000 + busy_ticks[0], 9000, 10 + steal_ticks[0]),
                                  1: tick(2000 + busy_ticks[1], 9000, 20 + steal_ticks[1])},
                            own_cpu=3.0 + own_cpu_s)
  return cond, now


def test_other_processes_share_subtracts_own_cpu_time(capsys):
  # 4 s of wall on 2 CPUs; the CPUs were busy 3 + 2 = 5 s, 2 of them ours: others used 3 s / 4 s = 0.75 CPU.
  # 1.2 s of the CPUs' busy time was hypervisor steal: 0.3 of the 0.75 CPU.
  cond, now = _conditions(load=0.1, busy_ticks=(300, 200), own_cpu_s=2.0, wall_s=4.0, steal_ticks=(70, 50))
  assert cond.others_cpus(now) == 0.75
  assert cond.steal_cpus(now) == 0.3
  assert cond.finish(now)
  out = capsys.readouterr().out
  assert "other processes used 0.75 of this run's 2 CPUs" in out and "; hypervisor steal 0.30 CPUs" in out
  assert "WARNING: taken under load (other processes used 0.75 CPUs" in out


def test_a_quiet_run_is_not_flagged_but_a_loaded_start_is(capsys):
  # Busy time is our own (plus a tick of rounding the clamp absorbs).
  cond, now = _conditions(load=0.1, busy_ticks=(101, 100), own_cpu_s=2.02, wall_s=4.0)
  assert cond.others_cpus(now) == 0.0
  assert not cond.finish(now)
  assert "WARNING" not in capsys.readouterr().out
  cond, now = _conditions(load=1.7, busy_ticks=(101, 100), own_cpu_s=2.02, wall_s=4.0)
  assert cond.finish(now)
  assert "WARNING: taken under load (load average 1.70 at start" in capsys.readouterr().out


def test_cpu_ranges():
  assert conditions._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"  # pylint: disable=protected-access
