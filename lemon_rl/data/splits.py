"""Splits by content: an example's split is a function of its text, so no text lands in two splits.

``content_score(text, salt)`` maps a text to a stable pseudo-random number in ``[0, 1)`` (BLAKE2b of the
UTF-8 bytes, personalised by ``salt``; independent of every seed and of the order of generation); a task
assigns the buckets by thresholds on it (e.g. ``score < 0.1`` -> test). Any two generators that produce the
same text put it in the same split.
"""

from __future__ import annotations

import hashlib


def content_score(text: str, salt: bytes) -> float:
  """A stable number in ``[0, 1)`` for ``text`` (``salt``: at most 16 bytes, one per task)."""
  digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=salt).digest()
  return int.from_bytes(digest, "big") / 2.0**64
