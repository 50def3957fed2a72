"""The speculative-GRPO experiment's parts: the Python syntax reward, the function-head prompts and their
splits, the document-start prompt encoding, TOST equivalence, and the reproduction end to end (tiny)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments.reports import speculative_grpo as report
from lemon_rl.data.stdlib_corpus import SourceFile, StdlibCorpus
from lemon_rl.envs import stdlib_code
from lemon_rl.eval import stats
from lemon_rl.rewards.python_syntax import INVALID, VALID, PythonSyntaxReward, syntax_status
from lemon_rl.text import ByteTokenizer
from lemon_rl.text.decoding import DocumentPromptTokenizer, encode_prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD = "def f(x):\n"


# -- the reward ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source, finished, expected", [
    (HEAD + "    return x + 1\n", True, VALID),  # a whole function
    (HEAD, True, INVALID),  # stopped right after the header: not a module
    (HEAD, False, VALID),  # cut right after the header: an open block
    (HEAD + "    y = (x +\n", False, VALID),  # an open bracket
    (HEAD + '    """doc\n', False, VALID),  # an open string
    (HEAD + "    y = x x\n    z = (\n", False, INVALID),  # an error before the cut
    (HEAD + "    y = 1\n      z = 2\n", False, INVALID),  # unexpected indent
    (HEAD + "    return x\n    y = x x", False, VALID),  # the partial last line is dropped
    (HEAD + "    return x\n    y = x x", True, INVALID),  # ... unless the model said it was finished
    (HEAD + "    return (x", True, INVALID),  # finished: an open bracket is an error
    (HEAD + "    return '\\d'\n", True, VALID),  # SyntaxWarning (invalid escape) is not an error
    (HEAD + "    return '\x00'\n", True, INVALID),  # NUL: ValueError
    ("(" * 300 + "\n", False, INVALID),  # too deeply nested
])
def test_syntax_status_by_hand(source, finished, expected):
  assert syntax_status(source, finished) == expected


def test_reward_reads_eos_from_the_ids():
  reward = PythonSyntaxReward(eos_ids=[2, 7])
  prompts = [HEAD] * 4
  completions = ["    return x\n", "    return x\n", "", "    y = x x\n"]
  ids = [[5, 5, 2], [5, 5], [7], [5, 5, 5]]  # finished, cut, finished right away, cut
  out = reward(prompts, completions, ids)
  np.testing.assert_array_equal(out.rewards, [1.0, 1.0, 0.0, 0.0])
  np.testing.assert_array_equal(out.metrics["finished"], [1.0, 0.0, 1.0, 0.0])
  np.testing.assert_array_equal(out.metrics["lines"], [1.0, 1.0, 0.0, 1.0])
  # A docstring head compiles on its own: with min_lines, stopping right after it earns nothing.
  doc_head = 'def f(x):\n    """Doc."""\n'
  bodies = ["", "    y = x\n", "    y = x\n    return y\n"]
  lines = PythonSyntaxReward(eos_ids=[2], min_lines=2)([doc_head] * 3, bodies, [[2], [5, 2], [5, 5, 2]])
  np.testing.assert_array_equal(lines.rewards, [0.0, 0.0, 1.0])
  np.testing.assert_array_equal(reward([doc_head], [""], [[2]]).rewards, [1.0])  # min_lines = 0: the shortcut


# -- prompts and splits ----------------------------------------------------------------------------------

MODULE = '''import os


@decorator
def top(a, b):
    """Adds.

    More.
    """
    c = a + b
    d = c * 2
    return d


def short(a):
    return a


class K:
    def method(self, x):
        y = x
        z = y
        w = z
        return w
'''


def test_function_heads_by_hand():
  heads = dict(stdlib_code.function_heads(MODULE, min_body_lines=3))
  assert heads == {"top": 'def top(a, b):\n    """Adds.\n\n    More.\n    """\n',  # decorator left out
                   "K.method": "def method(self, x):\n    y = x\n"}  # dedented; short() has 1 body line
  assert stdlib_code.function_heads("def broken(:\n") == []
  assert set(dict(stdlib_code.function_heads(MODULE, min_body_lines=0))) == {"top", "short", "K.method"}


def _file(path, text):
  return SourceFile(path=path, package=path.split("/")[0].removesuffix(".py"), text=text)


def test_code_splits_are_disjoint_and_drop_heads_copied_from_training_files():
  shared = "def common(self):\n    a = 1\n    b = 2\n    c = 3\n    return a\n"
  train = (_file("alpha.py", MODULE), _file("beta.py", shared))
  test = (_file("gamma.py", "class C:\n    " + shared.replace("\n", "\n    ")),  # a copy, indented
          _file("delta.py", "def own(q):\n    r = q\n    s = r\n    t = s\n    return t\n"))
  corpus = StdlibCorpus(root="/", train=train, test=test, dropped={}, test_percent=10.0, hash="h")
  splits, info = stdlib_code.code_splits(corpus, ByteTokenizer(), min_tokens=1, max_tokens=1000)
  assert [r["name"] for r in splits["train"]] == ["top", "K.method", "common"]
  assert corpus.packages("test") == ["delta", "gamma"]  # validation delta, test gamma (alternately)
  assert [r["name"] for r in splits["validation"]] == ["own"]
  assert splits["test"] == [] and info["test_dropped_in_train_files"] == 1
  assert info["validation_in_train_files"] == info["train_in_validation"] == 0
  with pytest.raises(AssertionError, match="overlap"):
    stdlib_code.check_disjoint_code({"train": splits["train"], "validation": splits["train"][:1]}, "")


def test_code_prompts_filter_by_token_count():
  files = [_file("alpha.py", MODULE)]
  lengths = {r["name"]: r["prompt_tokens"] for r in stdlib_code.code_prompts(files, ByteTokenizer(),
                                                                             min_tokens=1, max_tokens=1000)}
  assert lengths == {"top": 47, "K.method": 31}  # bytes
  kept = stdlib_code.code_prompts(files, ByteTokenizer(), min_tokens=31, max_tokens=40)
  assert [r["name"] for r in kept] == ["K.method"]


def test_document_prompts_start_with_eos():
  tok = ByteTokenizer()
  wrapped = DocumentPromptTokenizer(tok)
  assert encode_prompt(wrapped, "ab") == [tok.eos_id] + tok.encode("ab")
  assert wrapped.eos_ids == tok.eos_ids and wrapped.decode(tok.encode("ab")) == "ab"


# -- equivalence -----------------------------------------------------------------------------------------


def test_tost_matches_two_one_sided_scipy_tests():
  d = [0.01, -0.02, 0.015, 0.0, 0.005]
  margin = 0.05
  lower = scipy_stats.ttest_1samp(np.asarray(d) + margin, 0.0, alternative="greater").pvalue
  upper = scipy_stats.ttest_1samp(np.asarray(d) - margin, 0.0, alternative="less").pvalue
  assert stats.tost_p_value(d, margin) == pytest.approx(max(lower, upper), rel=1e-12)
  assert stats.tost_p_value([0.01, 0.01], margin) == 0.0 and stats.tost_p_value([0.1, 0.1], margin) == 1.0
  assert stats.tost_p_value([0.0], margin) == 1.0


def test_holm_equivalence_interval_and_verdict_agree():
  tight = stats.PairedComparison("tight", 1, [0.01, -0.01, 0.0, 0.005])
  wide = stats.PairedComparison("wide", 1, [0.2, -0.2, 0.1, -0.1])
  shifted = stats.PairedComparison("shifted", 1, [0.1, 0.11, 0.09, 0.1])
  results = stats.holm_equivalence([tight, wide, shifted], margin=0.05, family_alpha=0.05)
  assert [r.verdict for r in results] == [stats.EQUIVALENT] + [stats.NOT_SHOWN_EQUIVALENT] * 2
  for r in results:
    inside = -r.margin < r.lower and r.upper < r.margin
    assert inside == (r.adjusted_p_value <= r.family_alpha)
  # The first rank is tested at alpha / 3: its interval is the one-sided 1 - alpha/3 bound on both sides.
  d = np.asarray(tight.differences)
  half = scipy_stats.t.ppf(1 - 0.05 / 3, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
  assert results[0].upper == pytest.approx(d.mean() + half) and results[0].confidence == pytest.approx(1 - 0.1 / 3)
  with pytest.raises(ValueError, match="margin"):
    stats.holm_equivalence([tight], margin=0.0)


# -- the reproduction end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tiny_speculative_run, tmp_path_factory):
  out = tmp_path_factory.mktemp("spec_grpo")
  results = str(out / "results.json")
  subprocess.run([sys.executable, "-m", "experiments.reproduce_speculative_grpo", f"--workdir={out / 'work'}",
                  f"--init_from={tiny_speculative_run[0]}", "--size=tiny", "--seeds=0,1", "--steps=2",
                  "--arms=plain,speculative,ppow_refresh,residual", f"--results_file={results}"], cwd=ROOT, check=True,
                 capture_output=True)
  assert (out / os.path.basename(report.PLOT_FILE)).exists()  # drawn beside the results file
  with open(results) as f:
    return json.load(f)


def test_slower_speculative_steps_count_only_the_steps_that_speculated():
  row = lambda step_s, on=None: {"step_s": step_s, **({} if on is None else {"rollout/speculative_on": on})}
  saved = {"seeds": [0, 1], "runs": [
      {"arm": "plain", "seed": 0, "curve": [row(2.0), row(2.0), row(2.0)]},
      {"arm": "plain", "seed": 1, "curve": [row(3.0), row(3.0), row(3.0)]},
      # Plain-sampled steps 4x slower (timing noise of the same sampler) are not counted.
      {"arm": "cost_model", "seed": 0, "curve": [row(8.0, 0.0), row(1.0, 1.0), row(4.0, 1.0)]},
      {"arm": "cost_model", "seed": 1, "curve": [row(12.0, 0.0), row(2.0, 1.0), row(6.0, 0.0)]}]}
  assert report.slower_speculative_steps(saved, "cost_model") == (1, 3, 0.5)
  for r in saved["runs"][2:]:
    for x in r["curve"]:
      x["rollout/speculative_on"] = 0.0
  count, compared, least = report.slower_speculative_steps(saved, "cost_model")
  assert (count, compared) == (0, 0) and math.isnan(least)


def test_per_step_pairs_each_seed_and_step_with_plain():
  row = lambda sample_s, tau: {"time/sample_s": sample_s, "rollout/tau": tau}
  saved = {"seeds": [0, 1, 2], "runs": [
      {"arm": "plain", "seed": 0, "curve": [row(2.0, 0), row(4.0, 0), row(4.0, 0)]},
      {"arm": "plain", "seed": 1, "curve": [row(3.0, 0), row(6.0, 0)]},
      {"arm": "speculative", "seed": 0, "curve": [row(1.0, 1.5), row(8.0, 2.0), row(1.0, 2.0)]},
      {"arm": "speculative", "seed": 1, "curve": [row(3.0, 1.7), row(2.0, 1.9)]},
      {"arm": "speculative", "seed": 2, "curve": [row(1.0, 1.0), row(1.0, 1.0)]}]}  # no plain seed 2: unpaired
  speed = report.per_step(saved, "speculative", lambda x, y: x["time/sample_s"] / y["time/sample_s"])
  np.testing.assert_allclose(speed, [[2.0, 0.5], [1.0, 3.0]])  # [seeds, the steps both seeds have]
  np.testing.assert_allclose(report.per_step(saved, "speculative", lambda x, y: y["rollout/tau"]),
                             [[1.5, 2.0], [1.7, 1.9]])


def test_reproduction_structure_and_report(saved):
  assert sorted((r["arm"], r["seed"]) for r in saved["runs"]) == [
      ("plain", 0), ("plain", 1), ("ppow_refresh", 0), ("ppow_refresh", 1), ("residual", 0), ("residual", 1),
      ("speculative", 0), ("speculative", 1)]
  for r in saved["runs"]:
    assert len(r["curve"]) == 2 and all(row["step_s"] > 0 and row["time/sample_s"] > 0 for row in r["curve"])
    assert 0.0 <= r["test"]["reward_t1"] <= 1.0 and 0.0 <= r["test"]["reward_greedy"] <= 1.0
    assert all(row.get("rollout/speculative_on") == 1.0 and row["rollout/tau"] >= 1.0 for row in r["curve"]
               ) == (r["arm"] != "plain")
    if r["arm"] == "ppow_refresh":  # Refreshed on the first of every two steps (the tiny size's refresh_every).
      assert [row["drafter/refitted"] for row in r["curve"]] == [1.0, 0.0]
    assert all("rollout/speculative_on" not in row for row in r["curve"]) == (r["arm"] == "plain")
  d = saved["disjointness"]
  assert d["validation_in_train_files"] == d["test_in_train_files"] == d["train_in_test"] == 0
  assert all(c["passed"] for c in saved["headroom"]["checks"])
  family = report.equivalence_family(saved)
  assert [c.name for c in family][:2] == ["speculative - plain, test reward, T=1",
                                          "speculative - plain, test validity, greedy"]
  refresh = report.refresh_family(saved)
  mean_tau = lambda arm, s: np.mean([row["rollout/tau"] for row in next(
      r for r in saved["runs"] if r["arm"] == arm and r["seed"] == s)["curve"]])
  assert list(refresh[0].differences) == pytest.approx(
      [mean_tau("ppow_refresh", s) - mean_tau("speculative", s) for s in (0, 1)])
  for c, key in zip(family, ("reward_t1", "reward_greedy")):
    by = {(r["arm"], r["seed"]): r["test"][key] for r in saved["runs"]}
    assert list(c.differences) == [by["speculative", s] - by["plain", s] for s in (0, 1)]
  # Coupled noise: the speculative arms sample plain's tokens on every step, so they train the same policy;
  # the residual method with per-step noise samples other tokens.
  by = {(r["arm"], r["seed"]): r["test"] for r in saved["runs"]}
  for arm in ("speculative", "ppow_refresh"):
    assert report.same_samples(saved, arm) == (4, 4)
    assert all(by[arm, s] == by["plain", s] for s in (0, 1))
  assert report.same_samples(saved, "residual")[0] < 4
  coupling, = report.coupling_family(saved)
  assert list(coupling.differences) == pytest.approx(
      [mean_tau("residual", s) - mean_tau("speculative", s) for s in (0, 1)])
  plain = sum(row["time/sample_s"] for r in saved["runs"] if r["arm"] == "plain" for row in r["curve"])
  spec = sum(row["time/sample_s"] for r in saved["runs"] if r["arm"] == "speculative" for row in r["curve"])
  assert report.total_ratio(saved, "speculative", "time/sample_s") == pytest.approx(plain / spec)
  text = report.render(saved)
  assert "| speculative | 2 |" in text and "TOST" in text and "target is" in text
  assert "speculative steps slower than plain" in text and f"`{report.PLOT_FILE}`" in text
  assert "| 4/4 |" in text and "coupled noise" in text and "`residual` speculates" in text
  assert "residual - speculative (coupled), mean rollout tau" in text
  assert "PPOW refreshes (every 2 steps, 1 PPOW updates each)" in text
