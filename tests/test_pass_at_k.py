"""Tests of lemon_rl.eval.pass_at_k: hand values, brute force over k-subsets, Pass@(K,T)."""

import itertools
import math

import numpy as np
import pytest

from lemon_rl.eval.pass_at_k import avg_at_k, pass_at_k, pass_at_k_from_successes, pass_at_k_t

EPS = float(np.finfo(np.float64).eps)  # 2.2e-16


def atol(n: int) -> float:
  """The float64 error bound of ``pass_at_k`` with ``n`` samples (against an exact value rounded once).

  ``pass_at_k = -expm1(L)`` with ``L = sum_i log1p(-k / i)`` over at most ``n`` terms of one sign: summed in any
  order (NumPy's pairwise / SIMD sums differ between AVX2 and AVX-512, and with the padding of a vectorised
  call) ``L`` is within ``(n - 1) eps |L|``, each ``log1p`` within a few ulp (``4 eps |L|`` in all), so the
  result is within ``exp(L) (n + 4) eps |L| + eps <= ((n + 4) / e + 1) eps`` (``x e^-x <= 1 / e``); one more
  ``eps`` for rounding the reference.
  """
  return ((n + 4) / math.e + 2) * EPS


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
  """Fraction of the k-subsets of n samples (the first c correct) holding at least one correct sample."""
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(j < c for j in s) for s in subsets) / len(subsets)


class TestPassAtK:

  def test_hand_values(self):
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, rel=0, abs=atol(5))
    # 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, rel=0, abs=atol(5))
    # Exact: no product is formed when the answer is certain (1) or C(n - c, k) / C(n, k) = 1 (c = 0 gives
    # L = 0 and expm1(0) = 0).
    # k = n: 1 iff any sample is correct.
    assert pass_at_k(5, 1, 5) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0
    # c = 0 and c = n.
    assert pass_at_k(8, 0, 3) == 0.0
    assert pass_at_k(8, 8, 3) == 1.0
    # n - c < k: every k-subset contains a correct sample.
    assert pass_at_k(8, 6, 3) == 1.0

  def test_k1_is_the_sample_accuracy(self):
    n = np.array([4, 7, 10, 16])
    c = np.array([1, 0, 10, 5])
    np.testing.assert_allclose(pass_at_k(n, c, 1), c / n, rtol=0, atol=atol(n.max()))

  @pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
  def test_matches_brute_force(self, n):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), rel=0, abs=atol(n)), (n, c, k)

  def test_vectorised_matches_scalar_and_binomials(self):
    rng = np.random.default_rng(0)
    n = rng.integers(8, 300, size=50)
    c = np.array([rng.integers(0, m + 1) for m in n])
    got = pass_at_k(n, c, 8)
    assert got.shape == (50,)
    want = [1.0 - math.comb(int(m) - int(x), 8) / math.comb(int(m), 8) for m, x in zip(n, c)]
    np.testing.assert_allclose(got, want, rtol=0, atol=atol(n.max()))
    # Not bit-equal: the vectorised call sums over a zero-padded index range, the scalar one over its own, and
    # NumPy's SIMD sums and log1p differ between ISAs (1 ulp apart on an AVX2-only EPYC).
    np.testing.assert_allclose(got, [pass_at_k(int(m), int(x), 8) for m, x in zip(n, c)], rtol=0,
                               atol=2 * atol(n.max()))

  def test_large_n_is_stable(self):
    # C(2000, 100) overflows float64; the product form does not.
    got = pass_at_k(2000, 3, 100)
    want = 1.0 - math.comb(1997, 100) / math.comb(2000, 100)
    assert np.isfinite(got) and got == pytest.approx(want, rel=0, abs=atol(3))  # 3 non-zero terms

  def test_monotone_in_k_and_c(self):
    # Monotone up to the rounding of two values (each within atol(20) of the exact one).
    ks = [pass_at_k(20, 3, k) for k in range(1, 21)]
    assert all(a <= b + 2 * atol(20) for a, b in zip(ks, ks[1:]))
    cs = pass_at_k(20, np.arange(21), 4)
    assert np.all(np.diff(cs) >= -2 * atol(20))

  def test_from_successes(self):
    s = np.array([[1, 0, 0, 1, 0], [0, 0, 0, 0, 0], [True] * 5])
    np.testing.assert_allclose(pass_at_k_from_successes(s, 1), [0.4, 0.0, 1.0], rtol=0, atol=atol(5))

  @pytest.mark.parametrize("n, c, k", [(3, 1, 4), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3.5, 1, 1)])
  def test_bad_input(self, n, c, k):
    with pytest.raises(ValueError):
      pass_at_k(n, c, k)

  def test_bool_counts_rejected(self):
    with pytest.raises(ValueError, match="integers"):
      pass_at_k(np.array([True]), 0, 1)


class TestAvgAtK:

  def test_values(self):
    s = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
    # c / n: an exact integer count divided once (0.5 ulp); the brute force averages <= 6 subset means of <= 3
    # values (a few roundings each): 16 eps.
    np.testing.assert_allclose(avg_at_k(s, 4), [0.5, 0.0, 0.75], rtol=0, atol=EPS)
    # The expectation over k-subsets of the subset's mean accuracy is c / n for every k.
    for k in (1, 2, 3):
      subsets = list(itertools.combinations(range(4), k))
      brute = [np.mean([row[list(sub)].mean() for sub in subsets]) for row in s]
      np.testing.assert_allclose(avg_at_k(s, k), brute, rtol=0, atol=16 * EPS)

  def test_bad_input(self):
    with pytest.raises(ValueError, match="k must be"):
      avg_at_k(np.ones((2, 3)), 4)
    with pytest.raises(ValueError, match="0/1"):
      avg_at_k(np.full((2, 3), 0.5), 1)
    with pytest.raises(ValueError, match=r"\[problems, samples\]"):
      avg_at_k(np.ones(3), 1)


class TestPassAtKT:

  def test_hand_cases(self):
    successes = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    turns = np.array([[2, 5, 1, 1], [3, 1, 1, 1], [1, 1, 1, 1]])
    # T = 5: c = [2, 1, 0] -> Pass@1 = c / 4.
    np.testing.assert_allclose(pass_at_k_t(successes, turns, 1, 5), [0.5, 0.25, 0.0], rtol=0, atol=atol(4))
    # T = 2: the success that took 5 turns and the one that took 3 no longer count: c = [1, 0, 0].
    np.testing.assert_allclose(pass_at_k_t(successes, turns, 1, 2), [0.25, 0.0, 0.0], rtol=0, atol=atol(4))
    # T = 1: nothing succeeds in time.
    np.testing.assert_allclose(pass_at_k_t(successes, turns, 2, 1), [0.0, 0.0, 0.0], rtol=0, atol=atol(4))
    # K = 2, T = 5: row 0 has c = 2 of 4 -> 1 - C(2,2)/C(4,2) = 5/6; row 1 c = 1 -> 1 - C(3,2)/C(4,2) = 1/2.
    np.testing.assert_allclose(pass_at_k_t(successes, turns, 2, 5), [5 / 6, 0.5, 0.0], rtol=0, atol=atol(4))
    # Failures do not count however few turns they used; T = turns used counts (<=).
    np.testing.assert_allclose(pass_at_k_t(successes, turns, 4, 3), [1.0, 1.0, 0.0], rtol=0, atol=atol(4))

  def test_large_budget_equals_pass_at_k(self):
    rng = np.random.default_rng(1)
    s = rng.random((30, 10)) < 0.3
    turns = rng.integers(0, 6, size=(30, 10))
    np.testing.assert_allclose(pass_at_k_t(s, turns, 3, 10), pass_at_k_from_successes(s, 3), rtol=0,
                               atol=2 * atol(10))
    # Monotone in T (up to the rounding of two values).
    values = np.stack([pass_at_k_t(s, turns, 3, t) for t in range(7)])
    assert np.all(np.diff(values, axis=0) >= -2 * atol(10))

  def test_bad_input(self):
    with pytest.raises(ValueError, match="shape"):
      pass_at_k_t(np.ones((2, 3)), np.ones((2, 4), int), 1, 1)
    with pytest.raises(ValueError, match="turns_used"):
      pass_at_k_t(np.ones((2, 3)), -np.ones((2, 3), int), 1, 1)
    with pytest.raises(ValueError, match="t must be"):
      pass_at_k_t(np.ones((2, 3)), np.ones((2, 3), int), 1, -1)
    with pytest.raises(ValueError, match="0/1"):
      pass_at_k_t(np.full((2, 3), 2), np.ones((2, 3), int), 1, 1)
