"""Where and how long every reproduction ran, and how it spreads its runs over this machine's CPUs."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import platform
import resource
import signal
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from lemon_rl.training.experiment import SigtermFlag


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


class Stopped(RuntimeError):
  """:func:`run_parallel` stopped by SIGTERM: the finished jobs were reported, the running ones were asked to stop
  (an experiment checkpoints and stops), the rest never started."""


def _pass_sigterm_on() -> None:
  for child in multiprocessing.active_children():
    child.terminate()  # SIGTERM: an experiment saves a checkpoint after its current step and stops.


def _ignore_sigterm() -> None:
  """A pool process ignores SIGTERM between jobs (dying, it would break the pool and kill the running jobs
  before their checkpoint); a job that handles it, as ``experiment.run`` does, installs its own handler."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_parallel(fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]], workers: int,
                 on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
  """``[fn(*job) for job in jobs]``, ``workers`` processes at a time (in order when ``workers <= 1``).

  ``on_result(i, result)`` (optional) is called in this process as soon as job ``i`` finishes, in the order the
  jobs finish: a long run saves what is done before the rest finishes. ``fn`` and the jobs must pickle (a
  module-level function; configs as ``ConfigDict``); each process is spawned, not forked (JAX is not fork-safe),
  so it starts with a fresh JAX.

  A job starts only when a process is free, so nothing is queued in a process: when a job raises, or this
  process gets SIGTERM (passed on to the running jobs; the pool's processes ignore it between jobs), no other
  job starts, the running ones end, and the first error (or :class:`Stopped`) is raised. (A pool that queued
  jobs ahead kept running them, orphaned, after its parent was stopped.)
  """
  report = on_result or (lambda i, result: None)
  if workers <= 1:
    results = []
    for i, job in enumerate(jobs):
      results.append(fn(*job))
      report(i, results[-1])
    return results
  results, errors, waiting = {}, [], list(enumerate(jobs))[::-1]
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_sigterm) as pool, \
       SigtermFlag(on_signal=_pass_sigterm_on) as sigterm:
    running = {}
    while running or (waiting and not errors and not sigterm.raised):
      while waiting and len(running) < workers and not errors and not sigterm.raised:
        i, job = waiting.pop()
        running[pool.submit(fn, *job)] = i
      done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
      for future in done:
        i = running.pop(future)
        if future.exception() is not None:
          errors.append(future.exception())
        else:
          results[i] = future.result()
          report(i, results[i])
  if sigterm.raised:
    raise Stopped(f"SIGTERM: {len(results)} of {len(jobs)} jobs finished, {len(errors)} stopped "
                  f"({'; '.join(map(str, errors))}), {len(waiting)} never started")
  if errors:
    raise errors[0]
  return [results[i] for i in range(len(jobs))]
