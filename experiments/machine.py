"""What every reproduction records about where and how long it ran."""

from __future__ import annotations

import os
import platform
import resource
import time
from typing import Any, Callable


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


def timed(fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, dict[str, float]]:
  """``fn(*args, **kwargs)`` and the wall, user and system seconds this process spent in it."""
  usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
  result = fn(*args, **kwargs)
  usage1 = resource.getrusage(resource.RUSAGE_SELF)
  return result, {"wall_s": time.time() - t0, "user_s": usage1.ru_utime - usage0.ru_utime,
                  "system_s": usage1.ru_stime - usage0.ru_stime}
