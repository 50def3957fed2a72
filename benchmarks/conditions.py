"""Which machine a benchmark ran on, and under what conditions: one header and one footer for every script.

    import conditions                   # as early as possible: the load baseline is taken at import
    cond = conditions.start("sampler")  # prints the header, measures the float32 matmul peak
    ...                                 # the benchmark
    cond.finish()                       # prints the footer; before the script's final result lines

The header names the CPU model (``/proc/cpuinfo``), the ISA flags present among :data:`ISA_FLAGS`, any ISA
restriction in effect (``XLA_FLAGS=--xla_cpu_max_isa``, ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, and
torch's own view when torch is loaded), the CPUs in the affinity mask, the allocator setting
(``GLIBC_TUNABLES``), library versions, the 1-minute load average when this module was imported, and the
float32 matmul peak (:class:`MatmulPeak`). The peak is what shows whether a restriction took: with jaxlib 0.10.2
``--xla_cpu_max_isa=AVX2`` caps XLA's generated code but not YNNPACK's matmul kernels (the peak stayed at
267 vs 271 GFLOP/s on an AVX-512 Xeon, ``BENCHMARKS.md``).

The footer prints the load average at the end and the CPU time that OTHER processes took on this process's
CPUs while it ran:

    others = (busy_ticks(t1) - busy_ticks(t0)) / CLK_TCK - (own CPU s(t1) - own CPU s(t0))    [CPU-seconds]
    others_cpus = others / wall                                                             [CPUs, average]

with ``busy = user + nice + system + irq + softirq + steal`` summed over the affinity CPUs' lines of
``/proc/stat`` (``steal``: time the hypervisor gave to other guests), and this process's own CPU time from
``os.times()`` (all threads, plus waited-for children). ``t0`` is the import of this module, so the window
covers start-up and compilation too. A run is flagged ``WARNING: taken under load`` when ``others_cpus``
exceeds :data:`LOAD_THRESHOLD` CPUs, or when the load average at import did. The footer also names the part of
``others_cpus`` that was hypervisor steal (``steal_cpus``, the same difference of ``steal`` ticks over the wall
time): on a virtual machine it is the usual reason for a "slow day" (on 2026-12-01 this 2-vCPU guest lost 26-34%
of its CPU time to steal while one training job ran, and its matmul peak read 139 GFLOP/s against 150-300 on
other days), and no process inside the guest can be stopped to remove it: the latter also trips in the
minute after another heavy job (e.g. the previous run of a benchmark) ended, since the load average decays
with a 1-minute time constant; wait for it to settle for a clean header.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import re
import resource
import statistics
import sys
import time
from typing import Iterable, Mapping, NamedTuple

ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
LIBRARIES = ("jax", "jaxlib", "flax", "numpy", "torch", "transformers", "trl")
LOAD_THRESHOLD = 0.25  # CPUs: other processes' average use, or the 1-minute load average at import.
PEAK_N = 2048
# Untimed idle before each timed call when a script alternates lemon_rl with torch: torch's OpenMP workers keep
# spinning after a call and the two thread pools compete, so a call started right after the other library's
# measured 15-30% slower (batch 1-8 decode, 2026-12-07, AVX2 host).
SETTLE_S = 0.5


def interleaved(fns: Mapping, repeats: int, warmup: int = 1) -> dict:
  """Runs every function ``warmup`` times, then ``repeats`` rounds in turn, each call after an untimed
  ``SETTLE_S`` pause, so that a change of the host's speed during the script reaches every function alike.

  Returns ``{name: (best wall s, median wall s, median cpu s)}`` (CPU time of this process, all threads).
  """
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  walls = {k: [] for k in fns}
  cpus = {k: [] for k in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      time.sleep(SETTLE_S)
      c0, t0 = _self_cpu_seconds(), time.perf_counter()
      fn()
      walls[name].append(time.perf_counter() - t0)
      cpus[name].append(_self_cpu_seconds() - c0)
  return {k: (min(walls[k]), statistics.median(walls[k]), statistics.median(cpus[k])) for k in fns}


def _self_cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


# -- pure helpers (text in, values out) ------------------------------------------------------------------------

def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
  """``(model name, flags)`` of the first processor of a ``/proc/cpuinfo`` text (``"unknown"`` if absent)."""
  model = re.search(r"^(?:model name|Processor|cpu model)\s*:\s*(.+)$", text, re.MULTILINE)
  flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.MULTILINE)
  return (model.group(1).strip() if model else "unknown",
          frozenset(flags.group(1).split()) if flags else frozenset())


class CpuTicks(NamedTuple):
  """One CPU's ``/proc/stat`` counters (ticks since boot)."""
  busy: int  # user + nice + system + irq + softirq + steal
  total: int  # the first eight fields
  steal: int  # time the hypervisor ran other guests while this CPU wanted to run


def parse_proc_stat(text: str) -> dict[int, CpuTicks]:
  """``{cpu: CpuTicks}`` from the per-CPU ``cpuN`` lines of a ``/proc/stat`` text.

  Fields: user nice system idle iowait irq softirq steal [guest guest_nice]; ``busy`` excludes idle and
  iowait, ``total`` is the sum of the first eight (guest time is already counted in user).
  """
  out = {}
  for line in text.splitlines():
    m = re.match(r"cpu(\d+)\s+(.*)$", line)
    if m:
      f = [int(x) for x in m.group(2).split()][:8] + [0] * 8
      user, nice, system, idle, iowait, irq, softirq, steal = f[:8]
      out[int(m.group(1))] = CpuTicks(user + nice + system + irq + softirq + steal, sum(f[:8]), steal)
  return out


def busy_seconds(stat: Mapping[int, CpuTicks], cpus: Iterable[int], ticks_per_s: float) -> float:
  """Busy seconds summed over ``cpus`` (those missing from ``stat``, e.g. offline, count 0)."""
  return sum(stat[c].busy for c in cpus if c in stat) / ticks_per_s


def steal_seconds(stat: Mapping[int, CpuTicks], cpus: Iterable[int], ticks_per_s: float) -> float:
  """Hypervisor steal seconds summed over ``cpus`` (part of :func:`busy_seconds`)."""
  return sum(stat[c].steal for c in cpus if c in stat) / ticks_per_s


def others_cpus(busy_s: float, own_cpu_s: float, wall_s: float) -> float:
  """Average number of CPUs other processes used: ``max(busy_s - own_cpu_s, 0) / wall_s``.

  ``busy_s`` is the busy time of this process's CPUs over the window, ``own_cpu_s`` its own CPU time over
  the same window (the clamp absorbs tick rounding when the machine is otherwise idle).
  """
  return max(busy_s - own_cpu_s, 0.0) / max(wall_s, 1e-9)


def isa_restrictions(env: Mapping[str, str]) -> list[str]:
  """The ISA caps set in ``env``: ``--xla_cpu_max_isa`` inside ``XLA_FLAGS`` and :data:`ISA_ENV` variables."""
  out = [f"XLA {m.group(1)}" for m in re.finditer(r"--xla_cpu_max_isa=(\S+)", env.get("XLA_FLAGS", ""))]
  return out + [f"{k}={env[k]}" for k in ISA_ENV if env.get(k)]


# -- the machine ---------------------------------------------------------------------------------------------

def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def own_cpu_seconds() -> float:
  """User + system CPU seconds of this process (all threads) and of its waited-for children."""
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """Wall clock, 1-minute load average, per-CPU ``/proc/stat`` ticks and own CPU time at one instant."""
  wall: float
  load: float
  stat: dict[int, CpuTicks]
  own_cpu: float

  @classmethod
  def take(cls) -> "Snapshot":
    return cls(time.perf_counter(), os.getloadavg()[0], parse_proc_stat(_read("/proc/stat")), own_cpu_seconds())


_IMPORT_SNAPSHOT = Snapshot.take()


def library_versions(names: Iterable[str] = LIBRARIES) -> dict[str, str]:
  """Installed versions (from package metadata: nothing is imported) of those of ``names`` present."""
  out = {"python": platform.python_version()}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


class MatmulPeak:
  """This machine's float32 matmul peak: a jitted ``PEAK_N^3`` ``jnp.dot``, timed at every call.

  ``flops_per_s = max(best wall rate, best FLOPs per CPU-second x CPUs)``: on a loaded machine the
  wall-clock rate of a multi-threaded dot collapses (its threads wait for descheduled peers), which would
  make any fraction of it meaningless, while its CPU-time rate moves much less. Call the object (e.g. in
  :func:`interleaved` timing next to the code measured) to add samples.
  """

  def __init__(self, n: int = PEAK_N):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    self.n, self.flops = n, 2.0 * n**3
    self._block = jax.block_until_ready
    self._a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    self._dot = jax.jit(lambda a: jnp.dot(a, a))
    self._block(self._dot(self._a))  # Compiles.
    self.walls: list[float] = []
    self.cpus: list[float] = []

  def __call__(self) -> None:
    usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    self._block(self._dot(self._a))
    wall, usage1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    self.walls.append(wall)
    self.cpus.append(usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime)

  def measure(self, repeats: int) -> "MatmulPeak":
    for _ in range(repeats):
      self()
    return self

  @property
  def num_cpus(self) -> int:
    return len(os.sched_getaffinity(0))

  @property
  def wall_flops_per_s(self) -> float:
    return self.flops / min(self.walls)

  @property
  def cpu_flops_per_s(self) -> float:
    return self.flops / max(min(self.cpus), 1e-9) * self.num_cpus

  @property
  def flops_per_s(self) -> float:
    return max(self.wall_flops_per_s, self.cpu_flops_per_s)

  def describe(self) -> str:
    return (f"float32 matmul peak ({self.n}^3 jnp.dot, {len(self.walls)} runs): {self.flops_per_s / 1e9:.0f} "
            f"GFLOP/s = max(best wall {self.wall_flops_per_s / 1e9:.0f}, FLOPs per CPU-second x {self.num_cpus} "
            f"CPUs {self.cpu_flops_per_s / 1e9:.0f})")


class Conditions:
  """What :func:`start` measured; :meth:`finish` prints the footer and says whether the run was loaded."""

  def __init__(self, title: str, peak: MatmulPeak | None, threshold: float = LOAD_THRESHOLD):
    self.title, self.peak, self.threshold = title, peak, threshold
    self.baseline = _IMPORT_SNAPSHOT
    self.cpus = sorted(os.sched_getaffinity(0))
    self.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))

  def others_cpus(self, now: Snapshot | None = None) -> float:
    """Average CPUs other processes used on this process's CPUs since the import of this module."""
    now = now or Snapshot.take()
    busy = (busy_seconds(now.stat, self.cpus, self.ticks_per_s)
            - busy_seconds(self.baseline.stat, self.cpus, self.ticks_per_s))
    return others_cpus(busy, now.own_cpu - self.baseline.own_cpu, now.wall - self.baseline.wall)

  def steal_cpus(self, now: Snapshot | None = None) -> float:
    """Average CPUs the hypervisor took from this process's CPUs since the import (counted in
    :meth:`others_cpus`, up to how the kernel splits steal from process time)."""
    now = now or Snapshot.take()
    steal = (steal_seconds(now.stat, self.cpus, self.ticks_per_s)
             - steal_seconds(self.baseline.stat, self.cpus, self.ticks_per_s))
    return max(steal, 0.0) / max(now.wall - self.baseline.wall, 1e-9)

  def finish(self, now: Snapshot | None = None) -> bool:
    """Prints the end load average, other processes' CPU share and any warning; returns "under load".

    ``now`` defaults to a snapshot taken at the call.
    """
    now = now or Snapshot.take()
    others = self.others_cpus(now)
    if not self.baseline.stat:
      print("other processes' CPU use: unknown (no /proc/stat)")
    else:
      print(f"load average at end {now.load:.2f}; other processes used {others:.2f} of this run's "
            f"{len(self.cpus)} CPUs on average ({others / len(self.cpus):.0%}) over "
            f"{now.wall - self.baseline.wall:.0f} s; hypervisor steal {self.steal_cpus(now):.2f} CPUs")
    reasons = []
    if self.baseline.load > self.threshold:
      reasons.append(f"load average {self.baseline.load:.2f} at start")
    if others > self.threshold:
      reasons.append(f"other processes used {others:.2f} CPUs during the run")
    if reasons:
      print(f"WARNING: taken under load ({'; '.join(reasons)}; threshold {self.threshold} CPU): "
            "timings are not those of a quiet machine")
    return bool(reasons)


def header_lines(title: str, peak: MatmulPeak | None) -> list[str]:
  """The header's lines (the CPU, its ISA, restrictions, CPUs, allocator, versions, load, peak)."""
  model, flags = parse_cpuinfo(_read("/proc/cpuinfo"))
  present = [f for f in ISA_FLAGS if f in flags]
  caps = isa_restrictions(os.environ)
  torch = sys.modules.get("torch")
  if torch is not None and hasattr(torch.backends, "cpu"):  # What torch's kernels actually dispatch to.
    caps_note = f"; torch dispatches to {torch.backends.cpu.get_cpu_capability()}"
  else:
    caps_note = ""
  cpus = sorted(os.sched_getaffinity(0))
  lines = [
      f"== {title} ==",
      f"CPU: {model} ({platform.machine()}); ISA: {' '.join(present) or 'none of ' + ' '.join(ISA_FLAGS)}",
      f"ISA restriction: {', '.join(caps) if caps else 'none'}{caps_note}",
      f"CPUs: {len(cpus)} of {os.cpu_count()} in the affinity mask ({_ranges(cpus)}); "
      f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(default)')}",
      "versions: " + ", ".join(f"{k} {v}" for k, v in library_versions().items()),
      f"load average at start {_IMPORT_SNAPSHOT.load:.2f} (1 min)",
  ]
  if "jax" in sys.modules:
    jax = sys.modules["jax"]
    lines.append(f"jax devices: {len(jax.devices())} x {jax.devices()[0].platform}")
  if peak is not None:
    lines.append(peak.describe())
  return lines


def _ranges(cpus: list[int]) -> str:
  """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
  parts, i = [], 0
  while i < len(cpus):
    j = i
    while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
      j += 1
    parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
    i = j + 1
  return ",".join(parts)


def start(title: str, peak_repeats: int = 5, threshold: float = LOAD_THRESHOLD) -> Conditions:
  """Measures the matmul peak (best of ``peak_repeats``; 0 skips it), prints the header, returns the
  :class:`Conditions` whose :meth:`~Conditions.finish` prints the footer."""
  peak = MatmulPeak().measure(peak_repeats) if peak_repeats > 0 else None
  for line in header_lines(title, peak):
    print(line)
  return Conditions(title, peak, threshold)
