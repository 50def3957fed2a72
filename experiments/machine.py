"""Where and how long every reproduction ran, and how it spreads its runs over this machine's CPUs."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import platform
import resource
import time
from typing import Any, Callable, Iterable, Mapping, Sequence


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def description() -> str:
  return f"{cpu_model()}, {os.cpu_count()} CPUs"


def of_records(records: Iterable[Mapping[str, Any]]) -> str:
  """The machines that ``records`` (e.g. one seed's arms, each with ``"machine"``) ran on, ``"; "``-joined. A
  record stored before records named their machine counts as ``"machine not recorded"``, never as this one:
  a restored arm may have run anywhere."""
  return "; ".join(sorted({r.get("machine", "machine not recorded") for r in records}))


def timed(fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, dict[str, float]]:
  """``fn(*args, **kwargs)`` and the wall, user and system seconds this process spent in it."""
  usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
  result = fn(*args, **kwargs)
  usage1 = resource.getrusage(resource.RUSAGE_SELF)
  return result, {"wall_s": time.time() - t0, "user_s": usage1.ru_utime - usage0.ru_utime,
                  "system_s": usage1.ru_stime - usage0.ru_stime}


def run_parallel(fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]], workers: int,
                 on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
  """``[fn(*job) for job in jobs]``, ``workers`` processes at a time (in order when ``workers <= 1``).

  ``on_result(i, result)`` (optional) is called in this process as soon as job ``i`` finishes, in the order the
  jobs finish: a long run saves what is done before the rest finishes. ``fn`` and the jobs must pickle (a
  module-level function; configs as ``ConfigDict``); each process is spawned, not forked (JAX is not fork-safe),
  so it starts with a fresh JAX.
  """
  report = on_result or (lambda i, result: None)
  if workers <= 1:
    results = []
    for i, job in enumerate(jobs):
      results.append(fn(*job))
      report(i, results[-1])
    return results
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
    futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
    for future in concurrent.futures.as_completed(futures):
      report(futures[future], future.result())
    return [f.result() for f in futures]
