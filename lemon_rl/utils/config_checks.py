"""Config checks that name the offending field: what every module's ``check_config`` is written with.

Each check raises :class:`ConfigError` (a ``ValueError``) with ``config.<field>=<value>: <expectation>``, before
anything is compiled.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
  """An invalid config value; the message names the field."""


def require(condition: bool, field: str, value: Any, expectation: str) -> None:
  """Raises ``ConfigError("config.<field>=<value!r>: <expectation>")`` unless ``condition``."""
  if not condition:
    raise ConfigError(f"config.{field}={value!r}: {expectation}")


def require_name(registry, field: str, value: Any) -> None:
  """``value`` must be registered in ``registry`` (a :class:`~lemon_rl.utils.registry.Registry`)."""
  require(value in registry, field, value, f"must be one of {', '.join(registry.names())}")


def require_choice(choices, field: str, value: Any) -> None:
  """``value`` must be one of ``choices``."""
  require(value in choices, field, value, f"must be one of {', '.join(map(str, choices))}")


def require_positive(section, section_name: str, *fields: str, allow_zero: bool = False) -> None:
  """Each ``section[field]`` must be a number ``> 0`` (``>= 0`` with ``allow_zero``)."""
  for f in fields:
    v = section[f]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
    require(ok, f"{section_name}.{f}", v, "must be >= 0" if allow_zero else "must be > 0")
