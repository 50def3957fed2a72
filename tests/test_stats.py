"""Holm-corrected paired differences over seeds: the procedure by hand, the t-interval against scipy, verdicts."""

import numpy as np
import pytest
from scipy import stats as sps

from lemon_rl.eval import stats


def test_holm_adjust_by_hand():
  # Sorted: 0.005 (rank 1, x4 = 0.02), 0.01 (rank 2, x3 = 0.03), 0.03 (rank 3, x2 = 0.06),
  # 0.04 (rank 4, x1 = 0.04 -> max with 0.06 = 0.06). Levels 0.05/4, 0.05/3, then Holm stops at rank 3
  # (0.03 > 0.05/2): ranks 3 and 4 both get 0.05/2.
  ranks, adjusted, levels = stats.holm_adjust([0.01, 0.04, 0.03, 0.005], 0.05)
  assert ranks == [2, 4, 3, 1]
  np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02], rtol=1e-12)
  np.testing.assert_allclose(levels, [0.05 / 3, 0.05 / 2, 0.05 / 2, 0.05 / 4], rtol=1e-12)


def test_holm_adjust_is_monotone_in_rank_and_capped_at_one():
  # 0.3 x2 = 0.6, then 0.4 x1 = 0.4 < 0.6 -> 0.6 (monotone, not 0.4).
  _, adjusted, _ = stats.holm_adjust([0.4, 0.3])
  np.testing.assert_allclose(adjusted, [0.6, 0.6])
  _, adjusted, _ = stats.holm_adjust([0.5, 0.6, 0.7])  # 1.5, 1.2, 0.7 -> all capped at 1.
  assert adjusted == [1.0, 1.0, 1.0]
  rng = np.random.default_rng(0)
  p = rng.uniform(0, 0.2, size=12)
  ranks, adjusted, _ = stats.holm_adjust(p)
  by_rank = np.asarray(adjusted)[np.argsort(ranks)]
  assert np.all(np.diff(by_rank) >= 0) and np.all(by_rank <= 1) and np.all(by_rank >= np.sort(p))


def test_holm_ties_keep_the_input_order():
  ranks, adjusted, _ = stats.holm_adjust([0.02, 0.01, 0.02])
  assert ranks == [2, 1, 3]
  np.testing.assert_allclose(adjusted, [0.04, 0.03, 0.04])


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1])
def test_family_alpha_must_be_a_probability(alpha):
  with pytest.raises(ValueError, match="family_alpha"):
    stats.holm_paired_intervals([stats.PairedComparison("x", 1, [1.0, 2.0])], alpha)


def test_t_interval_and_p_value_agree_with_scipy():
  a = np.array([0.61, 0.55, 0.70, 0.58, 0.66])
  b = np.array([0.52, 0.50, 0.60, 0.49, 0.61])
  family = [stats.PairedComparison("a - b", +1, a - b),  # p = 0.0021: rank 2 (after "other"), level 0.05/2.
            stats.PairedComparison("noise", +1, [0.3, -0.2, 0.1, -0.4]),
            stats.PairedComparison("other", -1, [-1.0, -1.1, -0.9, -1.05])]
  results = stats.holm_paired_intervals(family, 0.05)
  ttest = sps.ttest_rel(a, b)
  first = results[0]
  np.testing.assert_allclose(first.p_value, ttest.pvalue, rtol=1e-10)
  np.testing.assert_allclose(first.mean, np.mean(a - b), rtol=1e-12)
  # Its interval at the level Holm gives its rank, from scipy's paired test and from t quantiles.
  assert first.rank == 2
  level = 0.05 / (3 - first.rank + 1)
  np.testing.assert_allclose(first.confidence, 1 - level, rtol=1e-12)
  ci = ttest.confidence_interval(confidence_level=1 - level)
  np.testing.assert_allclose([first.lower, first.upper], [ci.low, ci.high], rtol=1e-10)
  half = sps.t.ppf(1 - level / 2, 4) * np.std(a - b, ddof=1) / np.sqrt(5)
  np.testing.assert_allclose([first.lower, first.upper], [np.mean(a - b) - half, np.mean(a - b) + half],
                             rtol=1e-10)
  _, adjusted, _ = stats.holm_adjust([r.p_value for r in results])
  np.testing.assert_allclose([r.adjusted_p_value for r in results], adjusted)


def test_a_family_of_one_is_the_uncorrected_interval():
  d = [0.12, -0.03, 0.2, 0.07, 0.01]
  (result,) = stats.holm_paired_intervals([stats.PairedComparison("d", +1, d)], 0.05)
  mean, half = stats.mean_ci(d, 0.95)
  np.testing.assert_allclose([result.lower, result.upper], [mean - half, mean + half], rtol=1e-12)
  np.testing.assert_allclose(result.adjusted_p_value, result.p_value)
  assert result.confidence == pytest.approx(0.95) and result.rank == 1 and result.family_size == 1


def test_correction_widens_the_interval_of_the_first_rank():
  d = [1.0, -0.5, 0.4, 0.2]
  alone = stats.holm_paired_intervals([stats.PairedComparison("d", +1, d)])[0]
  family = [stats.PairedComparison("d", +1, d)] + [
      stats.PairedComparison(f"z{k}", +1, [0.5, -0.5, 0.4, -0.45]) for k in range(3)]
  first = stats.holm_paired_intervals(family)[0]
  assert first.rank == 1 and first.confidence == pytest.approx(1 - 0.05 / 4)
  assert first.upper - first.lower > alone.upper - alone.lower
  np.testing.assert_allclose(first.mean, alone.mean)


@pytest.mark.parametrize("sign, diffs, verdict", [
    (+1, [0.10, 0.12, 0.09, 0.11, 0.13], "reproduced"),
    (-1, [-0.10, -0.12, -0.09, -0.11, -0.13], "reproduced"),
    (+1, [-0.10, -0.12, -0.09, -0.11, -0.13], "opposite"),
    (-1, [0.10, 0.12, 0.09, 0.11, 0.13], "opposite"),
    # The case the old scripts called "holds": right sign, interval across 0 (-0.18 +- 0.42 style).
    (-1, [-0.5, 0.3, -0.6, 0.2, -0.3], "not distinguishable"),
])
def test_each_verdict_word_follows_the_interval(sign, diffs, verdict):
  (r,) = stats.holm_paired_intervals([stats.PairedComparison("x", sign, diffs)])
  assert r.verdict == verdict
  excludes_zero = r.lower > 0 or r.upper < 0
  assert excludes_zero == (verdict != "not distinguishable")
  if verdict == "reproduced":
    assert sign * r.mean > 0


def test_verdict_agrees_with_holm_decision_on_random_families():
  rng = np.random.default_rng(1)
  for _ in range(50):
    m = int(rng.integers(1, 7))
    family = [stats.PairedComparison(f"c{j}", int(rng.choice([-1, 1])),
                                     rng.normal(rng.normal(0, 0.3), 0.3, size=int(rng.integers(2, 8))))
              for j in range(m)]
    for r in stats.holm_paired_intervals(family, 0.1):
      assert (r.verdict != stats.NOT_DISTINGUISHABLE) == (r.adjusted_p_value <= 0.1), r


def test_a_later_rank_inside_its_own_level_is_not_declared_after_holm_stops():
  # Two directions with p just below 0.05 each: neither passes 0.05/2 at rank 1, so Holm stops there and
  # the second (whose plain 0.05 interval would exclude 0) is also not distinguishable.
  d1 = [0.30, 0.02, 0.25, 0.05, 0.18]
  d2 = [0.31, 0.03, 0.22, 0.04, 0.19]
  p = [sps.ttest_1samp(d, 0).pvalue for d in (d1, d2)]
  assert all(0.025 < x < 0.05 for x in p), p
  results = stats.holm_paired_intervals([stats.PairedComparison("a", 1, d1), stats.PairedComparison("b", 1, d2)])
  assert [r.verdict for r in results] == ["not distinguishable"] * 2
  assert all(r.confidence == pytest.approx(0.975) for r in results)
  assert all(r.lower < 0 < r.upper for r in results)


def test_fewer_than_two_seeds_is_not_distinguishable_with_a_reason_and_stays_in_the_family():
  family = [stats.PairedComparison("one seed", +1, [0.9]), stats.PairedComparison("none", -1, []),
            stats.PairedComparison("ok", +1, [0.1, 0.12, 0.11, 0.1])]
  one, none, ok = stats.holm_paired_intervals(family)
  assert one.verdict == none.verdict == "not distinguishable"
  assert one.reason == "fewer than 2 seeds" and none.reason == "no paired seeds"
  assert one.mean == 0.9 and np.isnan(none.mean) and one.p_value == 1.0 and one.adjusted_p_value == 1.0
  assert ok.family_size == 3 and ok.rank == 1 and ok.confidence == pytest.approx(1 - 0.05 / 3)
  assert ok.verdict == "reproduced" and ok.reason == ""
  assert "fewer than 2 seeds" in stats.format_paired(one)
  assert "fewer than 2 seeds" in stats.format_paired_row(one)


def test_identical_differences_give_a_point_interval():
  same, zero = stats.holm_paired_intervals([stats.PairedComparison("s", -1, [-2.0] * 3),
                                            stats.PairedComparison("z", -1, [0.0] * 3)])
  assert (same.lower, same.upper, same.p_value, same.verdict) == (-2.0, -2.0, 0.0, "reproduced")
  assert (zero.lower, zero.upper, zero.p_value, zero.verdict) == (0.0, 0.0, 1.0, "not distinguishable")


def test_comparison_validation():
  with pytest.raises(ValueError, match="expected_sign"):
    stats.PairedComparison("x", 0, [1.0, 2.0])
  with pytest.raises(ValueError, match="finite"):
    stats.PairedComparison("x", 1, [1.0, float("nan")])


def test_formatters():
  (r,) = stats.holm_paired_intervals([stats.PairedComparison("cast - grpo", -1, [-0.1, -0.12, -0.09])])
  line = stats.format_paired(r, digits=2)
  assert line.startswith(f"{r.mean:+.2f} [{r.lower:+.2f}, {r.upper:+.2f}] (95% CI, n=3") and \
      line.endswith(": reproduced")
  row = stats.format_paired_row(r)
  cells = [c.strip() for c in row.strip("|").split("|")]
  header = [c.strip() for c in stats.PAIRED_TABLE_HEADER.splitlines()[0].strip("|").split("|")]
  assert len(cells) == len(header) == 9
  assert cells[0] == "cast - grpo" and cells[1] == "< 0" and cells[2] == "3" and cells[-1] == "reproduced"
  table = stats.format_paired_table([r])
  assert table[0] == stats.PAIRED_TABLE_HEADER and table[1] == row
  assert "Holm-corrected over these 1 directions (familywise alpha 0.05)" in table[-1]


def test_mean_ci_unchanged():
  mean, half = stats.mean_ci([1.0, 2.0, 3.0])
  assert mean == 2.0 and half == pytest.approx(sps.t.ppf(0.975, 2) * 1.0 / np.sqrt(3))
  assert stats.mean_ci([4.0]) == (4.0, 0.0)
  assert stats.format_mean_ci([1.0, 2.0, 3.0], 2) == f"2.00 ± {half:.2f}"
