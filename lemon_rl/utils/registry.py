"""A name -> callable registry, one per family (aggregation, KL, advantage, policy loss, task).

Config validation calls :meth:`Registry.names`; an unknown name raises
:class:`UnknownNameError` (both a ``KeyError`` and a ``ValueError``) whose
message lists the registered names.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
  """An unknown registry name; the message lists the valid ones."""

  def __str__(self) -> str:  # KeyError would repr() the message.
    return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
  """Named callables of one family.

  >>> KL = Registry("KL estimator")
  >>> @KL.register("k1")
  ... def k1(logp, ref_logp): ...
  >>> KL.get("k1") is k1
  True
  """

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: dict[str, F] = {}

  def register(self, name: str, fn: F | None = None):
    """Registers ``fn`` under ``name``; without ``fn``, returns a decorator."""
    if not isinstance(name, str) or not name:
      raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

    def add(f: F) -> F:
      if name in self._entries:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      if not callable(f):
        raise TypeError(f"{self.kind} {name!r}: {f!r} is not callable")
      self._entries[name] = f
      return f

    return add if fn is None else add(fn)

  def get(self, name: str) -> F:
    """The callable registered as ``name``; :class:`UnknownNameError` otherwise."""
    try:
      return self._entries[name]
    except (KeyError, TypeError):
      raise UnknownNameError(
          f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

  def validate(self, name: str) -> str:
    """Returns ``name`` if registered, else raises (for config checks)."""
    self.get(name)
    return name

  def names(self) -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(self._entries)

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)

  def __repr__(self) -> str:
    return f"Registry({self.kind!r}, names={list(self._entries)})"
