"""Splits by content: an example's split is a function of its canonical CONTENT KEY, so no key is in two splits.

Every task defines ``canonical_key(example) -> str`` in its own module: a normal form of the problem that a
rephrasing does not change (``57+68`` and ``68+57`` are one arithmetic problem; "convert $5k" and "convert
5000 dollars" are one tool call). ``content_score(key, salt)`` maps a key to a stable pseudo-random number in
``[0, 1)`` (BLAKE2b of the UTF-8 bytes, personalised by ``salt``; independent of every seed and of the order
of generation); :func:`content_bucket` assigns the buckets by thresholds on it (e.g. ``score < 0.1`` ->
test). Each split draws only examples whose key falls in its bucket (:func:`draw_from_bucket`), so any two
generators that produce the same key, in whatever surface form, put it in the same split, and two splits
with different buckets share no key: disjointness holds by construction, whatever the sizes and seeds.
:func:`key_overlaps` counts shared keys between splits (the tests' check).

Used by ``lemon_rl.envs.arithmetic``, ``multistep_math``, ``tool_use_task`` and ``frozenlake`` (whose key is
the map text).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Callable, Hashable, Iterable, Mapping, Sequence, TypeVar

T = TypeVar("T")


def content_score(text: str, salt: bytes) -> float:
  """A stable number in ``[0, 1)`` for ``text`` (``salt``: at most 16 bytes, one per task)."""
  digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=salt).digest()
  return int.from_bytes(digest, "big") / 2.0**64


def check_fractions(fractions: Sequence[tuple[str, float]], rest: str) -> None:
  """Raises ``ValueError`` unless every fraction is in ``(0, 1)``, their sum is ``< 1`` and names are unique."""
  names = [name for name, _ in fractions] + [rest]
  if len(set(names)) != len(names):
    raise ValueError(f"bucket names must be distinct, got {names}")
  total = sum(f for _, f in fractions)
  if not all(0.0 < f < 1.0 for _, f in fractions) or total >= 1.0:
    raise ValueError(f"need every bucket fraction in (0, 1) and a sum < 1 (the rest is {rest!r}), got "
                     f"{dict(fractions)}")


def bucket_mass(fractions: Sequence[tuple[str, float]], rest: str, name: str) -> float:
  """The share of the key space in bucket ``name`` (``1 - sum(fractions)`` for ``rest``)."""
  if name == rest:
    return 1.0 - sum(f for _, f in fractions)
  masses = dict(fractions)
  if name not in masses:
    raise ValueError(f"unknown bucket {name!r}; expected one of {[*masses, rest]}")
  return masses[name]


def content_bucket(text: str, salt: bytes, fractions: Sequence[tuple[str, float]], rest: str) -> str:
  """The bucket of ``text``: the first ``(name, fraction)`` whose cumulative fraction exceeds its score.

  ``content_bucket(t, salt, (("test", 0.1), ("validation", 0.1)), "train")`` puts 10% of all texts in test,
  the next 10% in validation and the rest in train, by :func:`content_score`.
  """
  score, edge = content_score(text, salt), 0.0
  for name, fraction in fractions:
    edge += fraction
    if score < edge:
      return name
  return rest


def draw_from_bucket(draw: Callable[[], T], key: Callable[[T], str], bucket_of_key: Callable[[str], str],
                     bucket: str, num: int, *, distinct: bool = False, max_misses: int = 10_000,
                     what: str = "examples") -> list[T]:
  """``num`` draws whose key lies in ``bucket`` (rejection sampling); deterministic if ``draw`` is.

  Args:
    draw: a fresh candidate per call (e.g. a closure over a seeded generator).
    key: the candidate's canonical content key.
    bucket_of_key: the bucket of a key (e.g. a :func:`content_bucket` partial).
    bucket: the wanted bucket.
    num: how many to return (``>= 0``).
    distinct: if set, also reject a key already drawn (a split without repeated problems).
    max_misses: rejections in a row after which the bucket counts as exhausted.
    what: what is drawn, for the error message (e.g. ``"distinct test problems"``).

  Returns:
    The accepted candidates in draw order; with a stream-like ``draw``, the first ``k`` of ``num`` are the
    result for ``k`` (prefix-stable).

  Raises:
    ValueError: after ``max_misses`` rejected draws in a row (the bucket, or its unseen part, is exhausted).
  """
  if num < 0:
    raise ValueError(f"num must be >= 0, got {num}")
  out: list[T] = []
  seen: set[str] = set()
  misses = 0
  while len(out) < num:
    candidate = draw()
    k = key(candidate)
    if bucket_of_key(k) != bucket or (distinct and k in seen):
      misses += 1
      if misses > max_misses:
        raise ValueError(f"could not draw {num} {what} from bucket {bucket!r}: only {len(out)} found before "
                         f"{max_misses} draws in a row were rejected; lower num or widen the bucket")
      continue
    misses = 0
    if distinct:
      seen.add(k)
    out.append(candidate)
  return out


def key_overlaps(keys_by_split: Mapping[str, Iterable[Hashable]]) -> dict[tuple[str, str], int]:
  """``{(a, b): number of distinct keys in both split a and split b}`` for every pair of splits (``a < b``)."""
  sets = {name: set(keys) for name, keys in keys_by_split.items()}
  return {(a, b): len(sets[a] & sets[b]) for a, b in itertools.combinations(sorted(sets), 2)}
