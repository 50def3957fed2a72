r"""Statistics for experiment tables: Student-t intervals over seeds and Holm-corrected paired differences.

A table claims a family of ``m`` directions ("CAST is more accurate than GRPO", "CAST thinks less", ...). Each
direction ``j`` is a :class:`PairedComparison`: the per-seed differences ``d_j = [d_{j,1}, ..., d_{j,n_j}]``
(arm A minus arm B on the same seed, so seed-level variation cancels) and the sign ``s_j`` in {+1, -1} the
paper reports. :func:`holm_paired_intervals` tests the whole family at ``family_alpha`` (familywise error
rate, Holm 1979) and gives each direction an interval and a verdict word that follows it.

Per direction (``n = n_j >= 2``; ``mean``, ``sd`` over seeds with ``ddof = 1``):

    se = sd / sqrt(n),   t = mean / se,   p = 2 * (1 - F_{n-1}(|t|))        (two-sided paired t-test)

Holm step-down: sort the ``p`` ascending, ``p_(1) <= ... <= p_(m)`` (ties keep the family's order); rank
``i`` is tested at ``alpha_i = family_alpha / (m - i + 1)`` and the procedure rejects ranks ``1..s-1``, where
``s`` is the first rank with ``p_(s) > alpha_s`` (``s = m + 1`` if none). Adjusted p-values:

    p~_(i) = min(1, max_{j <= i} (m - j + 1) * p_(j))          (monotone in rank, capped at 1)

so rank ``i`` is rejected iff ``p~_(i) <= family_alpha``. Interval of the direction at rank ``i``:

    mean +- t_{1 - a_i / 2, n - 1} * se,   a_i = alpha_i for i < s,   a_i = alpha_s for i >= s

i.e. the level Holm assigns the rank when the step-down reaches it; ranks the procedure never reaches (it
stopped at ``s``) get the level at which it stopped, ``alpha_s``, which is stricter than their own
``alpha_i`` (so their intervals are wider). *Decision*: this makes the interval, the adjusted p-value and
the verdict agree: for ``i < s``, ``p_(i) <= alpha_i`` and the interval excludes 0; for ``i >= s``,
``p_(i) >= p_(s) > alpha_s`` and the interval contains 0. (Using ``alpha_i`` for every rank would let a
later rank's interval exclude 0 after Holm has stopped.) A family of one is the ordinary
``1 - family_alpha`` t-interval.

Verdict (from the interval ``[lo, hi]`` and the paper's sign ``s_j``): "reproduced" when it excludes 0 on
the paper's side (``s_j * lo > 0`` and ``s_j * hi > 0``), "opposite" when it excludes 0 on the other side,
"not distinguishable" when it contains 0. The tests are two-sided so that an effect in the unexpected
direction is reported as such. A direction with fewer than 2 seeds cannot be tested: it keeps ``p = 1``
(it still counts in ``m``: the family is the table's claimed directions, fixed before the data) and reads
"not distinguishable" with a reason. If all differences are equal (``sd = 0``) the interval is the point
``[mean, mean]`` and ``p = 0`` (``p = 1`` when ``mean = 0``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy import stats

REPRODUCED = "reproduced"
OPPOSITE = "opposite"
NOT_DISTINGUISHABLE = "not distinguishable"


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
  """``(mean, half_width)`` of the two-sided Student-t interval; half-width 0 for fewer than 2 values."""
  x = np.asarray(values, np.float64)
  if x.size < 2:
    return float(x.mean()) if x.size else float("nan"), 0.0
  sem = x.std(ddof=1) / np.sqrt(x.size)
  return float(x.mean()), float(stats.t.ppf(0.5 + confidence / 2, x.size - 1) * sem)


def format_mean_ci(values: Sequence[float], digits: int = 3) -> str:
  mean, half = mean_ci(values)
  return f"{mean:.{digits}f} ± {half:.{digits}f}"


@dataclasses.dataclass(frozen=True)
class PairedComparison:
  """One claimed direction of a table.

  Attributes:
    name: what is compared, e.g. ``"cast - grpo, accuracy (%)"``.
    expected_sign: +1 if the paper reports ``A > B`` (difference ``A - B`` positive), -1 if ``A < B``.
    differences: per-seed ``A - B`` ``[n]`` (the same seed's runs paired).
  """

  name: str
  expected_sign: int
  differences: Sequence[float]

  def __post_init__(self):
    if self.expected_sign not in (1, -1):
      raise ValueError(f"{self.name}: expected_sign must be +1 or -1, got {self.expected_sign!r}")
    d = np.asarray(self.differences, np.float64).reshape(-1)
    if not np.all(np.isfinite(d)):
      raise ValueError(f"{self.name}: differences must be finite, got {list(d)}")
    object.__setattr__(self, "differences", tuple(float(x) for x in d))


@dataclasses.dataclass(frozen=True)
class PairedResult:
  """A direction after the Holm procedure (see the module docstring for every quantity).

  Attributes:
    name, expected_sign: from the :class:`PairedComparison`.
    n: number of paired seeds.
    mean: mean per-seed difference (NaN with no seeds).
    lower, upper: the interval at ``confidence`` (``-inf, inf`` with fewer than 2 seeds).
    confidence: ``1 - a_i``, the level Holm assigns the direction's rank.
    p_value: unadjusted two-sided paired t-test p-value (1 with fewer than 2 seeds).
    adjusted_p_value: Holm-adjusted p-value.
    rank: 1-based rank of ``p_value`` in the family.
    family_size: ``m``.
    family_alpha: the familywise error rate the family was tested at.
    verdict: "reproduced", "opposite" or "not distinguishable".
    reason: why an untestable direction reads "not distinguishable" ("" otherwise).
  """

  name: str
  expected_sign: int
  n: int
  mean: float
  lower: float
  upper: float
  confidence: float
  p_value: float
  adjusted_p_value: float
  rank: int
  family_size: int
  family_alpha: float
  verdict: str
  reason: str = ""


def _t_test(d: np.ndarray) -> tuple[float, float, float]:
  """``(mean, se, p)`` of the two-sided one-sample t-test of ``mean(d) = 0``; needs ``d.size >= 2``."""
  mean = float(d.mean())
  se = float(d.std(ddof=1) / math.sqrt(d.size))
  if se == 0.0:
    return mean, 0.0, 1.0 if mean == 0.0 else 0.0
  return mean, se, float(2.0 * stats.t.sf(abs(mean / se), d.size - 1))


def _verdict(lower: float, upper: float, sign: int) -> str:
  if sign * lower > 0 and sign * upper > 0:
    return REPRODUCED
  if sign * lower < 0 and sign * upper < 0:
    return OPPOSITE
  return NOT_DISTINGUISHABLE


def holm_adjust(p_values: Sequence[float], family_alpha: float = 0.05
                ) -> tuple[list[int], list[float], list[float]]:
  """Holm's step-down procedure on ``m`` p-values (module docstring), in the input order.

  Returns:
    ``(ranks, adjusted, levels)``: 1-based rank of each p-value (ties keep the input order), the adjusted
    p-values ``p~`` and the error level ``a_i`` each one is tested (and its interval built) at.
  """
  if not 0.0 < family_alpha < 1.0:
    raise ValueError(f"family_alpha must be in (0, 1), got {family_alpha}")
  p = [float(x) for x in p_values]
  if any(not 0.0 <= x <= 1.0 for x in p):
    raise ValueError(f"p-values must be in [0, 1], got {p}")
  m = len(p)
  order = sorted(range(m), key=lambda j: p[j])  # Stable: ties keep the input order.
  ranks, adjusted, levels = [0] * m, [0.0] * m, [0.0] * m
  running, stopped = 0.0, None
  for i, j in enumerate(order, start=1):
    running = max(running, min(1.0, (m - i + 1) * p[j]))
    if stopped is None and p[j] > family_alpha / (m - i + 1):
      stopped = i
    ranks[j], adjusted[j] = i, running
    levels[j] = family_alpha / (m - (i if stopped is None else stopped) + 1)
  return ranks, adjusted, levels


def holm_paired_intervals(comparisons: Sequence[PairedComparison],
                          family_alpha: float = 0.05) -> list[PairedResult]:
  """Holm-corrected paired t-intervals and verdicts for a table's family of claimed directions.

  Args:
    comparisons: the family, ``m`` directions (each with its own number of seeds).
    family_alpha: familywise error rate of the family, in ``(0, 1)``.

  Returns:
    One :class:`PairedResult` per comparison, in the input order.
  """
  m = len(comparisons)
  tests = []  # (mean, se, p, n) per comparison.
  for c in comparisons:
    d = np.asarray(c.differences, np.float64)
    if d.size < 2:
      tests.append((float(d.mean()) if d.size else float("nan"), float("nan"), 1.0, d.size))
    else:
      tests.append((*_t_test(d), d.size))
  ranks, adjusted, levels = holm_adjust([t[2] for t in tests], family_alpha)
  out = []
  for j, c in enumerate(comparisons):
    mean, se, p, n = tests[j]
    level = levels[j]  # Its error level; the interval has confidence 1 - level.
    if n < 2:
      lower, upper = -math.inf, math.inf
      reason = "no paired seeds" if n == 0 else "fewer than 2 seeds"
    else:
      half = float(stats.t.ppf(1.0 - level / 2.0, n - 1)) * se
      lower, upper, reason = mean - half, mean + half, ""
    out.append(PairedResult(
        name=c.name, expected_sign=c.expected_sign, n=n, mean=mean, lower=lower, upper=upper,
        confidence=1.0 - level, p_value=p, adjusted_p_value=adjusted[j], rank=ranks[j], family_size=m,
        family_alpha=family_alpha, verdict=_verdict(lower, upper, c.expected_sign), reason=reason))
  return out


def _signed(x: float, digits: int) -> str:
  return "n/a" if math.isnan(x) else f"{x:+.{digits}f}"


def _confidence(result: PairedResult) -> str:
  return f"{100 * result.confidence:.4g}%"


def format_paired(result: PairedResult, digits: int = 3) -> str:
  """One line, e.g. ``+0.050 [+0.012, +0.088] (98.3% CI, n=5, p=0.004, Holm p=0.012): reproduced``."""
  if result.n < 2:
    return f"{_signed(result.mean, digits)} (n={result.n}): {result.verdict} ({result.reason})"
  return (f"{_signed(result.mean, digits)} [{_signed(result.lower, digits)}, {_signed(result.upper, digits)}] "
          f"({_confidence(result)} CI, n={result.n}, p={result.p_value:.3g}, "
          f"Holm p={result.adjusted_p_value:.3g}): {result.verdict}")


PAIRED_TABLE_HEADER = ("| direction | claimed | n | mean diff | Holm CI | CI level | p | Holm p | verdict |\n"
                       "|---|---|---|---|---|---|---|---|---|")


def format_paired_row(result: PairedResult, digits: int = 3) -> str:
  """A markdown row under :data:`PAIRED_TABLE_HEADER`."""
  claimed = "> 0" if result.expected_sign > 0 else "< 0"
  if result.n < 2:
    interval, level, p = "-", "-", "-"
    verdict = f"{result.verdict} ({result.reason})"
  else:
    interval = f"[{_signed(result.lower, digits)}, {_signed(result.upper, digits)}]"
    level, p, verdict = _confidence(result), f"{result.p_value:.3g}", result.verdict
  return (f"| {result.name} | {claimed} | {result.n} | {_signed(result.mean, digits)} | {interval} | {level} | "
          f"{p} | {result.adjusted_p_value:.3g} | {verdict} |")


def format_paired_table(results: Sequence[PairedResult], digits: int = 3) -> list[str]:
  """Header and one row per direction, plus a line stating the family and its error rate."""
  if not results:
    return []
  return [PAIRED_TABLE_HEADER, *(format_paired_row(r, digits) for r in results), "",
          f"Paired t-intervals over seeds, Holm-corrected over these {results[0].family_size} directions "
          f"(familywise alpha {results[0].family_alpha:g}); the verdict follows the interval."]



# -- equivalence ---------------------------------------------------------------------------------------

EQUIVALENT = "equivalent"
NOT_SHOWN_EQUIVALENT = "not shown equivalent"


@dataclasses.dataclass(frozen=True)
class EquivalenceResult:
  """A claimed equivalence ``|mean(A - B)| < margin`` after two one-sided tests (TOST) and Holm.

  Per claim (``n >= 2`` paired seeds, ``se = sd / sqrt(n)``, ``F`` Student's t with ``n - 1`` degrees of
  freedom)::

      p = max(1 - F((mean + margin) / se), F((mean - margin) / se))      (TOST, Schuirmann 1987)

  Holm's step-down over the family (:func:`holm_adjust`) gives each claim its level ``a``; the interval is
  ``mean +- t_{1 - a, n - 1} se`` (the ``1 - 2a`` interval) and the verdict "equivalent" iff it lies inside
  ``(-margin, margin)``, which holds iff ``p <= a``. With ``sd = 0`` the interval is the point and ``p`` is 0
  inside the margin, 1 outside; with fewer than 2 seeds ``p = 1`` and the interval is unbounded.

  Attributes:
    name: the compared quantity. n: paired seeds. mean, lower, upper: the difference and its interval.
    margin: the equivalence margin. p_value, adjusted_p_value: TOST and Holm-adjusted. confidence: ``1 - 2a``.
    family_size, family_alpha: of the Holm family. verdict: "equivalent" or "not shown equivalent".
  """

  name: str
  n: int
  mean: float
  lower: float
  upper: float
  margin: float
  p_value: float
  adjusted_p_value: float
  confidence: float
  family_size: int
  family_alpha: float
  verdict: str


def tost_p_value(differences: Sequence[float], margin: float) -> float:
  """TOST p-value of ``|mean| < margin`` for paired ``differences`` (:class:`EquivalenceResult`)."""
  d = np.asarray(differences, np.float64)
  if d.size < 2:
    return 1.0
  mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
  if se == 0.0:
    return 0.0 if abs(mean) < margin else 1.0
  return float(max(stats.t.sf((mean + margin) / se, d.size - 1), stats.t.cdf((mean - margin) / se, d.size - 1)))


def holm_equivalence(comparisons: Sequence[PairedComparison], margin: float,
                     family_alpha: float = 0.05) -> list[EquivalenceResult]:
  """Holm-corrected TOST of each comparison's differences against ``(-margin, margin)`` (the comparisons'
  ``expected_sign`` is not used: equivalence has no side)."""
  if not margin > 0:
    raise ValueError(f"the equivalence margin must be positive, got {margin}")
  p = [tost_p_value(c.differences, margin) for c in comparisons]
  _, adjusted, levels = holm_adjust(p, family_alpha)
  out = []
  for j, c in enumerate(comparisons):
    d = np.asarray(c.differences, np.float64)
    mean = float(d.mean()) if d.size else float("nan")
    if d.size < 2:
      lower, upper = -math.inf, math.inf
    else:
      half = float(stats.t.ppf(1.0 - levels[j], d.size - 1)) * float(d.std(ddof=1) / math.sqrt(d.size))
      lower, upper = mean - half, mean + half
    verdict = EQUIVALENT if -margin < lower and upper < margin else NOT_SHOWN_EQUIVALENT
    out.append(EquivalenceResult(name=c.name, n=int(d.size), mean=mean, lower=lower, upper=upper, margin=margin,
                                 p_value=p[j], adjusted_p_value=adjusted[j], confidence=1.0 - 2.0 * levels[j],
                                 family_size=len(comparisons), family_alpha=family_alpha, verdict=verdict))
  return out
