"""Splits by content: an example's split is a function of its text, so no text lands in two splits.

``content_score(text, salt)`` maps a text to a stable pseudo-random number in ``[0, 1)`` (BLAKE2b of the
UTF-8 bytes, personalised by ``salt``; independent of every seed and of the order of generation); a task
assigns the buckets by thresholds on it (e.g. ``score < 0.1`` -> test). Any two generators that produce the
same text put it in the same split.
"""

from __future__ import annotations

import hashlib
from typing import Sequence


def content_score(text: str, salt: bytes) -> float:
  """A stable number in ``[0, 1)`` for ``text`` (``salt``: at most 16 bytes, one per task)."""
  digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=salt).digest()
  return int.from_bytes(digest, "big") / 2.0**64


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
