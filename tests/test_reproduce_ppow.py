"""experiments/reproduce_ppow.py end to end on a tiny speculative workdir, its disjointness check, its paired
statistics, and the ADAW-off fast path of the PPOW step (the same prefixes without scoring the pool).

One ``configs/stdlib_speculative.py:tiny`` run (2-block target, a few seconds of training) is the start;
``reproduce_ppow`` runs 2 arms (the control and ``full``) x 2 seeds x 2 steps with one learning-rate trial per
arm. The numbers are those of untrained tiny models: only structure and arithmetic are checked.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import reproduce_ppow
from experiments.reports import ppow as report
from lemon_rl.eval import stats
from lemon_rl.training import drafter_training as dt
from lemon_rl.training import ppow_training as pt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def spec_workdir(tiny_speculative_run):
  return tiny_speculative_run[0]  # configs/stdlib_speculative.py:tiny, run once per test run (conftest.py)


@pytest.fixture(scope="module")
def saved(spec_workdir, tmp_path_factory):
  out = tmp_path_factory.mktemp("ppow")
  results = str(out / "results.json")
  subprocess.run([sys.executable, "-m", "experiments.reproduce_ppow", f"--workdir={out / 'work'}",
                  f"--init_from={spec_workdir}", "--size=tiny", "--seeds=0,1", "--steps=2", "--arms=control,full",
                  "--ppow_lrs=1e-3", "--control_lrs=1e-3", "--calibration_steps=1", f"--results_file={results}"],
                 cwd=ROOT, check=True, capture_output=True)
  assert (out / os.path.basename(report.PLOT_FILE)).exists()  # drawn beside the results file
  with open(results) as f:
    return json.load(f)


def test_results_structure(saved):
  assert saved["arms"] == ["control", "full"] and saved["seeds"] == [0, 1]
  assert sorted((r["arm"], r["seed"]) for r in saved["runs"]) == [("control", 0), ("control", 1), ("full", 0),
                                                                   ("full", 1)]
  k = saved["setup"]["num_draft"]
  for r in saved["runs"]:
    assert r["steps"] == (saved["setup"]["control_steps"] if r["arm"] == "control" else 2)
    for key in ("tau_greedy", "tau_t1"):
      assert 1.0 <= r["test"][key] <= k + 1
    assert len(r["test"]["accept_greedy"]) == k
    assert (r["validation"] is not None) == (r["seed"] == 0)  # validation only on the tuning seed
  # The control gets the CPU time of the full arm's steps.
  cal = saved["calibration"]
  assert saved["setup"]["control_steps"] == max(1, round(2 * cal["ppow_full_cpu_s"] / cal["distill_cpu_s"]))
  # Tuning: recorded on the validation split, the same number of trials per arm.
  assert saved["tuning"]["split"] == "validation" and saved["tuning"]["trials_per_arm"] == 1
  assert set(saved["tuning"]["arms"]) == {"control", "full"}
  # The headroom gate ran with the config's thresholds and passed.
  assert {c["statistic"] for c in saved["headroom"]["checks"]} == {"signal_group_share", "start_tau_greedy",
                                                                    "start_accept_first_greedy"}
  assert all(c["passed"] for c in saved["headroom"]["checks"])
  # Disjoint splits: counted and zero.
  d = saved["splits"]["disjointness"]
  assert d["validation_in_train"] == d["test_in_train"] == d["validation_in_test"] == 0
  assert d["train_windows"] > 0 and d["test_prompts"] == d["validation_prompts"] == 8
  assert not set(saved["splits"]["rows"]["validation"]) & set(saved["splits"]["rows"]["test"])


def test_paired_statistics_follow_the_runs(saved):
  tau = {(r["arm"], r["seed"], key): r["test"][key] for r in saved["runs"] for key in ("tau_greedy", "tau_t1")}
  family = report.directions(saved)
  assert [c.name for c in family] == ["full - token-level control, tau greedy",
                                      "full - token-level control, tau T=1"]
  for c, key in zip(family, ("tau_greedy", "tau_t1")):
    assert c.expected_sign == 1
    np.testing.assert_allclose(c.differences, [tau[("full", s, key)] - tau[("control", s, key)] for s in (0, 1)])
  results = stats.holm_paired_intervals(family, saved["family_alpha"])
  for res, c in zip(results, family):
    d = np.asarray(c.differences)
    assert res.n == 2 and res.mean == pytest.approx(d.mean())
    assert res.lower <= res.mean <= res.upper
    # A family of 2: rank 1 at alpha / 2, rank 2 at alpha (if reached) -> levels 0.975 or 0.95.
    assert res.confidence in (pytest.approx(0.975), pytest.approx(0.95))
  text = report.render(saved)
  assert "full - token-level control, tau greedy" in text and "Holm" in text
  assert f"`{report.PLOT_FILE}`" in text


def test_disjointness_check_catches_a_leaked_prompt():
  rng = np.random.default_rng(0)
  train = rng.integers(0, 50, (6, 40)).astype(np.int32)
  mask = np.ones_like(train)
  mask[5, 30:] = 0
  clean = {"validation": rng.integers(50, 60, (3, 8)), "test": rng.integers(60, 70, (3, 8))}
  out = reproduce_ppow.check_disjoint(clean, train, mask)
  assert out["train_windows"] == 5 * 33 + 23 and out["test_in_train"] == 0
  leaked = {"validation": clean["validation"], "test": np.concatenate([clean["test"], train[2:3, 17:25]])}
  with pytest.raises(AssertionError, match="test_in_train"):
    reproduce_ppow.check_disjoint(leaked, train, mask)
  # A window that crosses into the padding is not training data.
  padded = {"validation": clean["validation"], "test": train[5:6, 25:33]}
  assert reproduce_ppow.check_disjoint(padded, train, mask)["test_in_train"] == 0
  shared = {"validation": clean["validation"], "test": clean["validation"][:1]}
  with pytest.raises(AssertionError, match="validation_in_test"):
    reproduce_ppow.check_disjoint(shared, train, mask)


def test_uniform_prefixes_equal_choose_prefixes_without_adaw(spec_workdir):
  """The fast path of a step without ADAW draws exactly the prefixes that scoring the pool would."""
  target, head, _ = dt.load_speculative(os.path.join(spec_workdir, "checkpoints", "speculative"))
  data = np.load(os.path.join(spec_workdir, "data", "distill.npz"))
  tokens, mask = jnp.asarray(data["tokens"][:8]), jnp.asarray(data["mask"][:8])
  cfg = pt.PPOWConfig(num_draft=3, num_prefixes=64, pool_rows=8, adaw=False, min_prefix=15)
  # Both jitted, as inside the trainer's step (one compile each instead of op-by-op dispatch).
  choose = nnx.jit(pt.choose_prefixes, static_argnames="cfg")
  uniform = jax.jit(pt.uniform_prefixes, static_argnames="cfg")
  for seed in range(3):
    key = jax.random.key(seed)
    slow = choose(head, target, tokens, mask, key, cfg)
    rows, ends = uniform(tokens, mask, key, cfg)
    np.testing.assert_array_equal(rows, slow.rows)
    np.testing.assert_array_equal(ends, slow.prefix_end)
  assert len(np.unique(np.asarray(ends))) > 1


def test_plotted_acceptance_and_training_tau_by_hand():
  ppow_run = lambda seed, accept, taus: {"arm": "full", "seed": seed, "test": {"accept_greedy": accept},
                                         "curve_columns": report.PPOW_CURVE,
                                         "curve": [[i + 1, t, 0.0, 0.0] for i, t in enumerate(taus)]}
  saved = {"seeds": [0, 1], "arms": ["control", "full"],
           "start": {"0": {"test": {"accept_greedy": [0.6, 0.2]}}, "1": {"test": {"accept_greedy": [0.8, 0.4]}}},
           "runs": [{"arm": "control", "seed": 0, "test": {"accept_greedy": [0.5, 0.1]},
                     "curve_columns": "distill_loss", "curve": [[2, 9.0]]},
                    {"arm": "control", "seed": 1, "test": {"accept_greedy": [0.7, 0.3]},
                     "curve_columns": "distill_loss", "curve": [[2, 8.0]]},
                    ppow_run(0, [0.9, 0.5], [1.5, 2.0, 9.0]), ppow_run(1, [0.7, 0.3], [2.5, 3.0])]}
  accept = report.mean_acceptance(saved, "accept_greedy")
  assert list(accept) == ["start", "control", "full"]
  np.testing.assert_allclose(accept["start"], [0.7, 0.3])
  np.testing.assert_allclose(accept["control"], [0.6, 0.2])
  np.testing.assert_allclose(accept["full"], [0.8, 0.4])
  (steps, tau), = report.training_tau(saved).values()  # the control's loss curve is not a tau
  np.testing.assert_array_equal(steps, [1, 2])  # the steps every seed has
  np.testing.assert_allclose(tau, [2.0, 2.5])
