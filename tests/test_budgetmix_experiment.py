"""The BudgetMix experiment pipeline: multi-turn SFT layout = the engine's, the FrozenLake task's splits, the tiny
config end to end through the launcher and through ``experiments.reproduce_budgetmix``, the headroom thresholds,
and the report's verdicts."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import budgetmix_frozenlake
from experiments.reports import budgetmix as report
from lemon_rl.envs import frozenlake as fl
from lemon_rl.envs import frozenlake_task as flt
from lemon_rl.envs.protocol import FinishStatus
from lemon_rl.eval.headroom import check_headroom
from lemon_rl.models import Transformer, get_preset
from lemon_rl.training import multiturn_sft
from lemon_rl.training.config_validation import ConfigError, validate_config
from lemon_rl.training.multiturn import EpisodeSettings, episodes_to_batch, run_episodes
from lemon_rl.training.rollout import SamplingSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = flt.make_tokenizer()


class ScriptedPolicy(Transformer):
  """A Transformer whose next token at position ``p`` of row ``b`` is ``scripts[b, p]`` whatever it has read.

  ``extend`` runs the real cached forward (the engine's cache bookkeeping is untouched) and returns, in place of
  the hidden states, the position of the token each one predicts and the row; ``logits_from_hidden`` turns that
  into logits that put all mass (float32: ``exp(-1e9)`` underflows to 0) on the script's token.
  """

  def __init__(self, cfg, scripts: np.ndarray, *, rngs):
    super().__init__(cfg, rngs=rngs)
    self.scripts = nnx.Variable(jnp.asarray(scripts, jnp.int32))

  def extend(self, tokens, cache, num_new=None):
    hidden, new_cache = super().extend(tokens, cache, num_new)
    b, k = tokens.shape
    predicts = cache.lengths[:, None] + jnp.arange(k)[None, :] + 1  # position of the token each one predicts
    code = jnp.stack([predicts, jnp.broadcast_to(jnp.arange(b)[:, None], (b, k))], -1).astype(hidden.dtype)
    return jnp.zeros_like(hidden).at[..., :2].set(code), new_cache

  def logits_from_hidden(self, hidden):
    scripts = self.scripts[...]
    pos = jnp.clip(hidden[..., 0].astype(jnp.int32), 0, scripts.shape[1] - 1)
    token = scripts[hidden[..., 1].astype(jnp.int32), pos]
    return jnp.where(jnp.arange(self.cfg.vocab_size) == token[..., None], 0.0, -1e9).astype(jnp.float32)


def test_sft_sequence_is_the_engine_episode_of_a_policy_sampling_the_demonstrated_actions():
  maps = fl.generate_maps(0, 3, "train", sizes=(4, 5))
  demos = fl.demonstrations(0, 3, maps=maps, detour_prob=0.5, show_budget=True)
  assert any(any(d.detours) for d in demos)  # Detours and recoveries are in the data.
  sequences = [multiturn_sft.demonstration_sequence(TOK, d.turns) for d in demos]
  longest = max(len(ids) for ids, _ in sequences)
  scripts = np.full((len(demos), longest + 1), TOK.pad_id, np.int32)
  for i, (ids, _) in enumerate(sequences):
    scripts[i, :len(ids)] = ids
  cfg = get_preset("tiny", vocab_size=TOK.vocab_size, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   mlp_dim=16)
  policy = ScriptedPolicy(cfg, scripts, rngs=nnx.Rngs(0))
  envs = [fl.FrozenLakeEnv(d.desc, show_budget=True) for d in demos]
  settings = EpisodeSettings(max_turns=max(e.t_max for e in envs), max_action_tokens=4, num_slots=longest + 8,
                             sampling=SamplingSettings(1.0, 0, 1.0))
  episodes = run_episodes(policy, TOK, envs, [d.seed for d in demos], settings, jax.random.key(0))
  for demo, (ids, mask), ep in zip(demos, sequences, episodes):
    assert ep.status == FinishStatus.SUCCESS and demo.status == fl.SUCCESS
    assert ep.actions == [a for _, a in demo.turns]
    np.testing.assert_array_equal(ep.token_ids, ids)  # token for token
    np.testing.assert_array_equal(ep.loss_mask, mask)
    assert ep.prompt_length == len(TOK.encode(demo.turns[0][0])) + 1  # BOS + the prompt
    assert all(len(a) == 2 for a in ep.action_ids)  # A move token and EOS.
    # Loss only on actions: every masked token is a move or EOS, the rest is prompt and observations.
    move_ids = {TOK.token_to_id(m) for m in flt.MOVE_TOKENS} | {TOK.eos_id}
    assert set(ids[mask == 1].tolist()) <= move_ids and not set(ids[mask == 0].tolist()) & move_ids
  # The training batch of the demonstrations is the engine's batch of those episodes.
  length = 64 * -(-longest // 64)
  sft = multiturn_sft.sequences_to_batch(sequences, TOK.pad_id, 64)
  played = episodes_to_batch(episodes, TOK.pad_id, length)
  for key in ("ids", "attention_mask", "loss_mask"):
    np.testing.assert_array_equal(sft[key], played[key])


def test_frozenlake_task_splits_are_disjoint_by_map_content():
  config = budgetmix_frozenlake.get_config("tiny")
  task = flt.build_task(config.task)
  splits = {"sft": task.sft_source, "rl": task.rl_source, "validation": task.validation_examples,
            "test": task.test_examples}
  keys = {name: {fl.canonical_key(flt.record_map(r)) for r in records} for name, records in splits.items()}
  names = list(keys)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      assert not keys[a] & keys[b], (a, b)
  assert len(keys["sft"]) == config.task.num_sft and len(keys["rl"]) == config.task.num_train
  assert [r["split"] for r in task.test_examples].count("test_8x8") == config.task.num_test_8x8
  turns = multiturn_sft.record_turns(task.sft_source[0])
  desc = flt.record_map(task.sft_source[0])
  assert f"[MAX TURNS] {fl.t_max(desc)}\n" in turns[0][0]  # Demonstrations at the full budget, budget shown.


def test_config_checks_name_the_field():
  config = budgetmix_frozenlake.get_config("tiny")
  validate_config(config)
  bad = budgetmix_frozenlake.get_config("tiny")
  bad.multiturn_rl.estimator = "ppo"
  bad.model.overrides.value_head = False
  with pytest.raises(ConfigError, match="model.overrides.value_head"):
    validate_config(bad)
  bad = budgetmix_frozenlake.get_config("tiny")
  bad.multiturn_rl.budget_mode = "half"
  with pytest.raises(ConfigError, match="multiturn_rl.budget_mode"):
    validate_config(bad)


def test_headroom_thresholds_name_the_statistics_the_gate_computes():
  config = budgetmix_frozenlake.get_config("cpu")
  h = config.headroom
  pct = lambda f: int(round(100 * f))
  stats = {f"pass_at_{h.max_k}_{pct(f)}": 0.5 for f in h.fractions}
  stats.update({f"signal_share_{pct(f)}": 0.5 for f in h.fractions})
  assert check_headroom(stats, dict(h.thresholds)).passed
  stats[f"pass_at_{h.max_k}_25"] = 0.0  # No headroom below: the gate says which statistic failed.
  stats[f"pass_at_{h.max_k}_100"] = 1.0  # Nor above.
  report_ = check_headroom(stats, dict(h.thresholds), raise_on_failure=False)
  assert {c.statistic for c in report_.failures} == {f"pass_at_{h.max_k}_25", f"pass_at_{h.max_k}_100"}


def test_tiny_config_runs_end_to_end_through_the_launcher(tmp_path):
  workdir = str(tmp_path / "run")
  args = [sys.executable, "-m", "experiments.main", "--config=configs/budgetmix_frozenlake.py:tiny",
          f"--workdir={workdir}"]
  proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  by_phase = lambda p: [r for r in records if r["phase"] == p]
  assert [r["step"] for r in by_phase("multiturn_sft")] == [1, 2, 3]
  rl = by_phase("multiturn_rl")
  assert [r["step"] for r in rl] == [1, 2]
  for key in ("episode/success_rate", "episode/reward_mean", "budget/mean", "budget/distinct", "train/loss",
              "train/grad_norm", "time/episodes_s"):
    assert key in rl[-1], key
  assert [r["step"] for r in by_phase("eval_multiturn_rl")] == [0, 1, 2]
  for r in by_phase("eval_multiturn_rl") + by_phase("eval_multiturn_sft"):
    assert {"success_25", "success_100", "accuracy", "completion_length", "turns"} <= set(r)
  for phase in ("multiturn_sft", "multiturn_rl"):
    assert os.listdir(os.path.join(workdir, "checkpoints", phase)), phase
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["multiturn_rl_steps"] == 2 and "multiturn_rl_final_accuracy" in summary


def _reproduce(workdir, results_file, *flags_):
  args = [sys.executable, "-m", "experiments.reproduce_budgetmix", "--config=configs/budgetmix_frozenlake.py:tiny",
          f"--workdir={workdir}", f"--results_file={results_file}", *flags_]
  return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_tiny_reproduction_runs_in_parallel_reads_finished_arms_back_and_goes_on_from_stored_arms(tmp_path):
  workdir, results_file = str(tmp_path / "runs"), str(tmp_path / "results.json")
  arms = ["base", "grpo_full", "grpo_budgetmix"]
  proc = _reproduce(workdir, results_file, "--seeds=0,1", f"--arms={','.join(arms)}", "--workers=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(results_file) as f:
    saved = json.load(f)
  assert [entry["seed"] for entry in saved["seeds"]] == [0, 1]
  for entry in saved["seeds"]:
    assert entry["headroom"]["passed"] and list(entry["arms"]) == arms
    for arm, record in entry["arms"].items():
      assert set(record["final"]) == {"test", "test_8x8"}, arm
      assert {"quality", "num_steps"} <= set(record["final"]["test"]["matched_quality"]["full"]), arm
      assert [r["step"] for r in record["train"]] == ([] if arm == "base" else [1, 2]), arm
    assert entry["finished"] and entry["machine"] == saved["machine"]
  finished = {os.path.join(workdir, f"seed_{s}", arm, "final_eval.json") for s in (0, 1) for arm in arms}
  stamps = {path: os.path.getmtime(path) for path in finished}
  # Rerun into another results file, one process: every arm is read back from the workdir (no run, no evaluation).
  reread_file = str(tmp_path / "reread" / "results.json")
  proc = _reproduce(workdir, reread_file, "--seeds=0,1", f"--arms={','.join(arms)}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {path: os.path.getmtime(path) for path in finished} == stamps
  same = lambda path: {**json.load(open(path)), "command": None} == {**saved, "command": None}
  assert same(reread_file) and "Claimed directions on `test`" in proc.stdout
  # On another machine (an empty workdir), the arms stored beside the results file are restored: nothing runs.
  store = tmp_path / "arms"
  proc = _reproduce(str(tmp_path / "elsewhere"), results_file, "--seeds=0,1", f"--arms={','.join(arms)}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "6 finished arms restored" in proc.stdout and same(results_file)
  assert not os.path.exists(tmp_path / "elsewhere" / "seed_0" / "base" / "checkpoints")
  # One RL arm missing from the store: its seed's SFT is re-run (and checked against the stored base run's
  # evaluations), and the arm runs again from it, to the same final evaluation.
  shutil.rmtree(store / "seed_1" / "grpo_budgetmix")
  proc = _reproduce(str(tmp_path / "partial"), str(tmp_path / "partial.json"), "--seeds=0,1",
                    f"--arms={','.join(arms)}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "5 finished arms restored" in proc.stdout
  assert os.listdir(tmp_path / "partial" / "seed_1" / "base" / "checkpoints" / "multiturn_sft")
  assert not os.path.exists(tmp_path / "partial" / "seed_0" / "base" / "checkpoints")
  with open(tmp_path / "partial.json") as f:
    rerun = json.load(f)["seeds"][1]["arms"]["grpo_budgetmix"]
  assert rerun["final"] == saved["seeds"][1]["arms"]["grpo_budgetmix"]["final"]
  # A stored base run that the re-run SFT does not reproduce: the arms stored from it are not trusted.
  with open(store / "seed_0" / "base" / "final_eval.json") as f:
    base = json.load(f)
  base["evals"][-1]["accuracy"] += 0.5
  with open(store / "seed_0" / "base" / "final_eval.json", "w") as f:
    json.dump(base, f)
  shutil.rmtree(store / "seed_0" / "grpo_full")
  proc = _reproduce(str(tmp_path / "tampered"), str(tmp_path / "tampered.json"), "--seeds=0",
                    f"--arms={','.join(arms)}")
  assert proc.returncode != 0 and "re-run on this machine, it evaluates to" in proc.stderr


def test_a_failed_gate_stops_the_reproduction_before_any_rl_run(tmp_path):
  workdir, results_file = str(tmp_path / "runs"), str(tmp_path / "results.json")
  proc = _reproduce(workdir, results_file, "--seeds=0", "--arms=base,grpo_full",
                    "--config.headroom.thresholds.min_pass_at_2_100=1.01")
  assert proc.returncode != 0 and "seed 0: step-0 headroom gate failed: pass_at_2_100" in proc.stderr
  with open(results_file) as f:
    saved = json.load(f)
  assert saved["stopped"].startswith("seed 0: step-0 headroom gate failed")
  assert saved["seeds"][0]["headroom"]["passed"] is False and saved["seeds"][0]["arms"] == {}
  assert not os.path.exists(os.path.join(workdir, "seed_0", "grpo_full"))


# -- the report --------------------------------------------------------------------------------------------


ARMS = ["base", "grpo_full", "grpo_budgetmix", "gigpo_full", "gigpo_budgetmix"]


def _evaluation(p8: dict[int, float], recovery: float):
  """An evaluation record whose Pass@8 at each budget is ``p8`` (Pass@k rising to it)."""
  curve = lambda v: [v * k / 8 for k in range(1, 9)]
  passes = {str(p): curve(v) for p, v in p8.items()}
  return {"num_maps": 4, "num_samples": 16, "pass": {"prompted": passes, "truncated": passes},
          "quality": {"full": {"quality": 0.9, "optimal_share": 0.8}},
          "matched_quality": {"full": {"quality": 0.85}},
          "recovery": {"recovery": recovery, "clean": 0.6, "ratio": recovery / 0.6}}


def _saved(gigpo_mix_25: float):
  """5 seeds. GRPO: full-budget RL gains at 100% and loses at 25%; BudgetMix gains at 25% and recovers more.
  GiGPO: BudgetMix at 25% is ``gigpo_mix_25`` (+ noise); its recovery gain is noise around 0."""
  rng = np.random.default_rng(0)
  seeds = []
  for seed in range(5):
    e = lambda: float(rng.normal(0, 0.01))
    base = {25: 0.30 + e(), 50: 0.45, 75: 0.55, 100: 0.60 + e()}
    full = {25: 0.25 + e(), 50: 0.5, 75: 0.7, 100: 0.80 + e()}
    mix = {25: 0.45 + e(), 50: 0.6, 75: 0.75, 100: 0.80 + e()}
    gmix = {25: gigpo_mix_25 + e(), 50: 0.6, 75: 0.75, 100: 0.80 + e()}
    noise = float(rng.normal(0, 0.05))
    final = {"base": (base, 0.2), "grpo_full": (full, 0.3), "grpo_budgetmix": (mix, 0.5 + e()),
             "gigpo_full": (full, 0.3), "gigpo_budgetmix": (gmix, 0.3 + noise)}
    seeds.append({"seed": seed, "finished": True, "headroom": {"statistics": {"pass_at_8_25": 0.4}, "passed": True,
                                             "checks": [{"statistic": "pass_at_8_25", "bound": "min",
                                                         "threshold": 0.05, "value": 0.4, "passed": True}]},
                  "arms": {arm: {"final": {"test": _evaluation(*v)}} for arm, v in final.items()}})
  setup = {"num_sft": 100, "sft_steps": 10, "rl_steps": 5, "maps_per_step": 2, "group_size": 4,
           "learning_rate": 1e-4, "num_samples": 16, "temperature": 1.0, "fractions": [0.25, 0.5, 0.75, 1.0],
           "recovery_fraction": 0.5, "max_k": 8, "splits": ["test"], "num_maps": {"test": 4}}
  return {"command": "cmd", "machine": "cpu", "family_alpha": 0.05, "setup": setup, "arms": ARMS, "seeds": seeds}


def _verdicts(text: str) -> dict[str, str]:
  rows = [line.split("|") for line in text.splitlines() if line.startswith("| ")]
  return {r[1].strip(): r[-2].strip() for r in rows if r[-2].strip() in ("reproduced", "opposite",
                                                                          "not distinguishable")}


def test_report_verdicts_follow_the_intervals():
  text = report.render(_saved(gigpo_mix_25=0.15))
  v = _verdicts(text)
  assert len(v) == 8
  assert v["full-budget GRPO gain over base, Pass@8: at 25% minus at 100%"] == "reproduced"  # -0.25, claimed < 0
  assert v["BudgetMix GRPO - full-budget GRPO, Pass@8 at 25%"] == "reproduced"
  assert v["BudgetMix GRPO - full-budget GRPO, Pass@8: at 25% minus at 100%"] == "reproduced"
  assert v["BudgetMix GRPO - full-budget GRPO, recovery after an injected error"] == "reproduced"
  assert v["BudgetMix GiGPO - full-budget GiGPO, Pass@8 at 25%"] == "opposite"  # 0.15 - 0.25 < 0
  assert v["BudgetMix GiGPO - full-budget GiGPO, recovery after an injected error"] == "not distinguishable"
  assert re.search(r"\| base \(SFT\) \| 0\.\d{3} ± 0\.\d{3} \|", text)  # Mean ± CI over the 5 seeds.
  assert "- the gain comes from recovery after errors:" in text
  assert "learning rate 0.0001 in every arm, the library's RL default, not tuned for any arm" in text
  # Without the GiGPO arms the family is the 4 GRPO directions (Holm over 4, not 8).
  saved = _saved(gigpo_mix_25=0.15)
  saved["arms"] = ARMS[:3]
  assert len(_verdicts(report.render(saved))) == 4 and "over these 4 directions" in report.render(saved)


def test_report_of_a_run_in_progress_pairs_only_the_finished_seeds():
  saved = _saved(gigpo_mix_25=0.15)
  for entry in saved["seeds"][1:]:  # Seeds 1-4: the base run only, as after a session that stopped.
    entry["arms"] = {"base": entry["arms"]["base"]}
    del entry["finished"]
  text = report.render(saved)
  assert "**In progress:** seeds finished [0] of the planned [0, 1, 2, 3, 4]" in text
  assert "| 4 | 0.400 | passed |" in text  # The gate of every seed that ran.
  assert not re.search(r"\| base \(SFT\) \| 0\.\d{3} ± ", text)  # One seed: no interval, not 5 bases.
  assert text.count("| not distinguishable (fewer than 2 seeds) |") == 8


def test_report_of_a_run_stopped_by_the_headroom_gate():
  saved = _saved(gigpo_mix_25=0.45)
  saved["seeds"] = saved["seeds"][:1]
  saved["seeds"][0]["headroom"]["passed"] = False
  saved["seeds"][0]["arms"] = {}
  del saved["seeds"][0]["finished"]
  saved["stopped"] = "seed 0: step-0 headroom gate failed: pass_at_8_25 = 0 (needs >= 0.05): FAILED"
  text = report.render(saved)
  assert "**Stopped:** seed 0: step-0 headroom gate failed" in text and "| 0 | 0.400 | FAILED |" in text


def test_report_plot_shows_the_mean_surface_of_the_finished_seeds(tmp_path):
  saved = _saved(gigpo_mix_25=0.15)
  saved["seeds"][4]["arms"]["grpo_full"]["final"]["test"] = _evaluation({25: 9, 50: 9, 75: 9, 100: 9}, 0.3)
  del saved["seeds"][4]["finished"]  # An unfinished seed does not enter the surface.
  grids = report.mean_pass_grids(saved)
  assert list(grids) == [report.label(a) for a in ARMS]
  full = grids["full-budget GRPO"]["prompted"]  # [F, K]: Pass@k = 0.5 k / 8 at 50% in every seed.
  assert full.shape == (4, 8)
  np.testing.assert_allclose(full[1], [0.5 * k / 8 for k in range(1, 9)], rtol=1e-12)
  expected_25 = np.mean([report.pass_at(s["arms"]["grpo_full"]["final"]["test"], "prompted", 25, 8)
                         for s in saved["seeds"][:4]])
  np.testing.assert_allclose(full[0, -1], expected_25, rtol=1e-12)
  path = report.plot(saved, str(tmp_path / "surface.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert f"`{report.PLOT_FILE}`" in report.render(saved)
