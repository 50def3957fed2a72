"""The ``tool_use`` task of the CAST experiment: data, scoring, and the case-library step between SFT and RL.

Pieces (the task itself is registered in :mod:`lemon_rl.envs.tasks` as ``"tool_use"``):

- :func:`make_split`: examples of :mod:`lemon_rl.envs.tool_use` as flat records (``gold`` / ``functions`` /
  ``request`` as JSON strings, so that they collate like any text field), each tagged with a static
  ``difficulty``: ``"easy"`` = at most one call and no conversion note, ``"hard"`` = several calls or a
  conversion (*Decision*: the held-out set is binned by this tag, because the case library's hardness ``H``
  exists only for training queries). The splits ``sft``, ``train`` (RL), ``validation`` and ``test`` are
  disjoint by content (below).
- :class:`ToolUseScore`: the evaluation function (reward = BFCL exact match, 1.0 iff exact) with the six
  dimension scores, format, think length, and accuracy / think length per category and difficulty as
  per-sample metrics (``NaN`` where the sample is not in the group, so means are group means). It is also
  the training reward of the plain ``grpo`` baseline (binary exact match, with the same metrics logged).
- :func:`sample_cases`: ``n`` rollouts of the base (SFT) policy per training query -> cases.
- :class:`CurriculumIterator`: columnar batches of training records in the order of a
  :class:`lemon_rl.data.curriculum.CurriculumSampler`, with ``get_state`` / ``set_state`` for checkpoints.
- :func:`prepare_rl`: the ``Task.prepare_rl`` hook: case library (persisted as JSONL in
  ``<workdir>/cases/``; a resumed run rebuilds the profiles from that file instead of re-sampling) ->
  complexity and failure profiles -> :class:`lemon_rl.rewards.cast.CastReward` and the curriculum.

BFCL-format data (``task.source = "bfcl"``; the synthetic world is ``"synthetic"``, the default): the entries
of ``task.bfcl_categories`` in a folder laid out like bfcl-eval's ``data/`` (``task.bfcl_dir``; "" = the
installed bfcl-eval's), read by :func:`lemon_rl.envs.bfcl_data.load_bfcl`, become records of the same fields
(:func:`bfcl_splits`: prompt = compact signatures + the user turn, demonstration = the gold's first acceptable
answer with a one-line thinking, difficulty ``"easy"`` iff at most one gold call; system messages are dropped),
those over the byte limits are left out, and each record goes to the bucket of :func:`bfcl_key` (its normalised
query) under the same :data:`BUCKETS`; ``num_*`` cap each split (``-1``: all). ``task.tokenizer`` (``"byte"`` or a
tokenizer directory; set to the policy's by the experiment when it loads a Hugging Face checkpoint) is the
tokenizer of the task (the byte tokenizer's prompt slots are ``1 + max_prompt_bytes``, another's a bucket).

Splits by content (``lemon_rl.data.splits``). *Decision*: the content key (:func:`canonical_key`) is the
REQUEST, the multiset of calls the query asks for, each normalised by
:func:`lemon_rl.envs.tool_world.canonical_call` (tool name + arguments with sorted keys, canonical numbers
and strings, defaults dropped, lists as multisets). It ignores the wording ("$5k" / "5000 dollars" /
"five thousand dollars"), the order of the calls, the offered tools and distractors, and the category: an
``irrelevance`` query is keyed by the call it was drawn from, so "Get the weather in Oslo." is in one split
whether ``get_weather`` is offered or not; only off-world requests ("tell me a joke") are keyed by their
normalised text. Each split draws only requests whose key hashes into its bucket (``test``: 10% of the key
space, ``validation``: 10%, ``train``: 10%, ``sft``: the rest, :data:`BUCKETS`), so no request is in two
splits in any wording. The category of each record is drawn first and kept, then examples of that category
are drawn until one fits the byte limits and the bucket, so every split has the configured category mix.
The unit is the whole request, not each call: a held-out two-call query may combine calls that training
queries make separately (composition is part of what is tested), whereas holding out single calls would
hold out argument values that no training example then teaches (the world has 8 tickers: the request "price
of Netflix" is in the test bucket, yet SFT teaches Netflix=NFLX through two-call requests in its own bucket).
Key space: at least 71,457 single-call keys (from 8 for ``get_stock_price`` to 19,327 for
``search_flights``; every tool has keys in every bucket) and 7 off-world requests (none in the test bucket),
so the small splits repeat the requests of the small tools (i.i.d. draws). Measured at the CAST config
(``data_seed=0``): 0 shared keys, prompts or queries between any two splits (before: 114 of the 300 test
prompts verbatim among the SFT demonstrations, 2 among the RL prompts, 246 RL prompts among SFT); distinct
keys: 39,042 in the 112,000 SFT records, 400 in the 640 RL prompts, 220 in the 300 validation and 229 in the
300 test records.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from absl import logging

from lemon_rl.data import case_library as cl
from lemon_rl.data import splits as content_splits
from lemon_rl.data.curriculum import MODES
from lemon_rl.data.curriculum import CurriculumSampler
from lemon_rl.data.curriculum import example_hardness
from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.data.pipeline import collate
from lemon_rl.envs import bfcl_data
from lemon_rl.envs import tool_use
from lemon_rl.envs import tool_world
from lemon_rl.eval import headroom
from lemon_rl.rewards.base import RewardOutput
from lemon_rl.rewards.cast import THINK_MODES
from lemon_rl.rewards.cast import CastReward
from lemon_rl.rewards.cast import dimension_weights
from lemon_rl.rewards.cast import tool_reward
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.rewards.tool_calls import DIMENSIONS
from lemon_rl.sampling import generate
from lemon_rl.text.decoding import decode_completion, encode_prompt
from lemon_rl.text.tokenizers import load_tokenizer
from lemon_rl.utils import config_checks as cc

DIFFICULTIES = ("easy", "hard")
REWARDS = ("cast", "exact")
SOURCES = ("synthetic", "bfcl")
CASES_DIR = "cases"
CASES_FILE = "cases.jsonl"
PROFILE_FILE = "profile.json"
SPLITS = ("sft", "train", "validation", "test")
# Split seeds: split k of data seed s is generated with seed 1000 * s + k (disjoint query ids).
SPLIT_OFFSETS = {"sft": 1, "train": 2, "test": 3, "validation": 4}
# Content buckets of the request keys (module docstring); the rest of the key space is the SFT bucket.
BUCKETS = (("test", 0.1), ("validation", 0.1), ("train", 0.1))
_SALT = b"lemon-tool"
_MAX_MISSES = 5_000  # Out-of-bucket draws in a row after which a split counts as unfillable.


# ---------------------------------------------------------------------------------------------------------
# Data.


def difficulty_of(example: Mapping[str, Any]) -> str:
  """Static difficulty tag: ``"easy"`` iff at most one gold call and no conversion note."""
  return "easy" if len(example["gold"]) <= 1 and example["num_conversions"] == 0 else "hard"


def _as_list(value: Any) -> list[Any]:
  return json.loads(value) if isinstance(value, str) else list(value)


def canonical_key(example: Mapping[str, Any]) -> str:
  """The content key of an example or record: its request as a sorted multiset of canonical calls.

  Reads ``request`` (a list of ``{tool: {param: [values]}}`` or its JSON string; module docstring) and, for
  an empty request (an off-world query), ``query`` or else the ``Q:`` line of ``prompt``. Examples:
  ``'convert_currency{"amount":5000,"dst":"jpy","src":"eur"}'`` for "Convert $5k euros to yen." in any
  wording, category or set of offered tools; two calls are joined by ``" & "`` in sorted order.
  """
  calls = sorted(tool_world.canonical_call(tool, args) for call in _as_list(example["request"])
                 for tool, args in call.items())
  if calls:
    return " & ".join(calls)
  query = example.get("query")
  if query is None:
    query = example["prompt"].rsplit("Q: ", 1)[-1]
  return "offworld:" + " ".join(query.strip().rstrip(".?!").split()).casefold()


def bucket_of(key: str) -> str:
  """The split whose bucket holds a content key: ``"test"``, ``"validation"``, ``"train"`` or ``"sft"``."""
  return content_splits.content_bucket(key, _SALT, BUCKETS, "sft")


def _fitting_example(rng, category: str, style: str, max_prompt_bytes: int, max_completion_bytes: int):
  """An example of ``category`` within the byte limits (at most 100 draws, as ``tool_use.generate_examples``)."""
  for _ in range(100):
    ex = tool_use.generate_example(rng, category, style)
    if len(ex["prompt"].encode()) <= max_prompt_bytes and len(ex["demonstration"].encode()) <= max_completion_bytes:
      return ex
  raise RuntimeError(f"no {category} example within the byte limits after 100 tries")


def make_split(cfg, split: str) -> list[dict[str, Any]]:
  """The records of one split (``sft``, ``train``, ``validation`` or ``test``); a pure function of the config.

  ``task.source = "bfcl"``: :func:`bfcl_splits` (module docstring). Otherwise the synthetic world:

  Record ``i`` draws its category from ``cfg.category_weights``, then examples of that category until one
  fits ``max_prompt_bytes`` / ``max_completion_bytes`` and its :func:`canonical_key` lies in the split's
  bucket (:func:`bucket_of`); draws are i.i.d., so a request may repeat within a split, never across splits.
  Records: ``id, category, difficulty, num_conversions, prompt, completion`` (the demonstration; for ``sft``,
  made imperfect by ``cfg.demo_noise``, :func:`demo_noise`), ``gold``, ``functions`` and ``request`` (JSON
  strings). ``max_completion_bytes`` bounds the clean demonstration; a noisy one may be up to
  ``DemoNoise.max_extra_bytes`` longer (:func:`completion_budget`).
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  if cfg.get("source", "synthetic") == "bfcl":
    return bfcl_splits(cfg)[split]
  n = int({"sft": cfg.num_sft, "train": cfg.num_train, "test": cfg.num_test,
           "validation": cfg.num_validation}[split])
  weights = {k: float(v) for k, v in dict(cfg.category_weights).items()}
  names, probs = list(weights), list(weights.values())
  seed = 1000 * int(cfg.data_seed) + SPLIT_OFFSETS[split]
  rng = random.Random(seed)
  max_prompt, max_completion = int(cfg.max_prompt_bytes), int(cfg.max_completion_bytes)
  noise = demo_noise(cfg) if split == "sft" else tool_use.DemoNoise()
  records = []
  for i in range(n):
    category = rng.choices(names, probs)[0]
    draw = functools.partial(_fitting_example, rng, category, cfg.style, max_prompt, max_completion)
    ex, = content_splits.draw_from_bucket(draw, canonical_key, bucket_of, split, 1, max_misses=_MAX_MISSES,
                                          what=f"{category} {split} request")
    # The noise has its own generator, so the requests of every split are those of the clean world.
    completion = tool_use.noisy_demonstration(ex, noise, random.Random(f"noise-{seed}-{i}"), cfg.style)
    records.append({"id": f"tool-s{seed}-{i}", "category": ex["category"], "difficulty": difficulty_of(ex),
                    "num_conversions": int(ex["num_conversions"]), "prompt": ex["prompt"],
                    "completion": completion, "gold": _compact_json(ex["gold"]),
                    "functions": _compact_json(ex["functions"]), "request": _compact_json(ex["request"])})
  return records


def demo_noise(cfg) -> tool_use.DemoNoise:
  """``cfg.demo_noise`` (optional; its fields are :class:`lemon_rl.envs.tool_use.DemoNoise`'s), else no noise."""
  return tool_use.DemoNoise(**dict(cfg.get("demo_noise") or {}))


def completion_budget(cfg) -> int:
  """Tokens a completion may take: the longest (noisy) demonstration in bytes, EOS and a little slack."""
  return int(cfg.max_completion_bytes) + demo_noise(cfg).max_extra_bytes + 8


def _compact_json(value: Any) -> str:
  return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _categories(value: Any) -> tuple[str, ...]:
  if isinstance(value, str):
    return tuple(c.strip() for c in value.split(",") if c.strip())
  return tuple(value)


def bfcl_key(example: Mapping[str, Any]) -> str:
  """The content key of a BFCL entry: its user turn, whitespace-collapsed and case-folded, so the entries that
  share a query (BFCL's ``multiple`` reuses ``simple``'s questions with more functions) land in one split."""
  return "bfcl:" + " ".join(example["query"].split()).casefold()


def bfcl_splits(cfg) -> dict[str, list[dict[str, Any]]]:
  """Records of every split from BFCL-format files (module docstring): each split's categories interleaved
  (``c1[0], c2[0], ..., c1[1], ...``), file order within a category, then capped at ``num_<split>``. The files
  are read once per distinct setting (:func:`make_split` asks for one split at a time)."""
  caps = tuple(int(cfg[f"num_{split}"]) for split in SPLITS)
  splits = _bfcl_splits(cfg.get("bfcl_dir", "") or None, _categories(cfg.get("bfcl_categories", "")), cfg.style,
                        int(cfg.max_prompt_bytes), int(cfg.max_completion_bytes), caps)
  return {split: [dict(r) for r in rows] for split, rows in zip(SPLITS, splits)}  # Copies: the cache stays intact.


@functools.lru_cache(maxsize=4)
def _bfcl_splits(data_dir, categories, style, max_prompt, max_completion, caps) -> tuple[tuple[dict, ...], ...]:
  by_category: dict[str, dict[str, list[dict[str, Any]]]] = {split: {} for split in SPLITS}
  for category in categories:
    for ex in bfcl_data.load_bfcl(category, style=style, data_dir=data_dir):
      if len(ex["prompt"].encode()) > max_prompt or len(ex["demonstration"].encode()) > max_completion:
        continue
      by_category[bucket_of(bfcl_key(ex))].setdefault(category, []).append({
          "id": ex["id"], "category": ex["category"], "difficulty": "easy" if len(ex["gold"]) <= 1 else "hard",
          "num_conversions": int(ex["num_conversions"]), "prompt": ex["prompt"], "completion": ex["demonstration"],
          "gold": _compact_json(ex["gold"]), "functions": _compact_json(ex["functions"]), "query": ex["query"]})
  out = []
  for (split, groups), n in zip(by_category.items(), caps):  # Interleaved: a capped split keeps the mix.
    rows = [r for column in itertools.zip_longest(*groups.values()) for r in column if r is not None]
    out.append(tuple(rows[:n] if n >= 0 else rows))
  return tuple(out)


def task_tokenizer(cfg):
  """``task.tokenizer`` (``"byte"`` by default, the CAST tokenizer with ``<think>`` / ``<tool_call>`` ids)."""
  return load_tokenizer(cfg.get("tokenizer", "byte"))


def prompt_len(cfg) -> int | None:
  """Prompt slots of training sequences: BOS + ``max_prompt_bytes`` for the byte tokenizer, else a bucket."""
  return 1 + int(cfg.max_prompt_bytes) if cfg.get("tokenizer", "byte") == "byte" else None


# ---------------------------------------------------------------------------------------------------------
# Scoring.


class ToolUseScore:
  """Exact match (1.0 iff the response is BFCL-correct) with per-sample diagnostics.

  Called like any reward function with the record fields ``gold``, ``functions``, ``category`` and
  ``difficulty``; returns :class:`RewardOutput` whose metrics are ``name, key, type, constraint, value,
  exact, format, think_len, num_calls`` for every sample, and ``acc_<group>`` / ``think_len_<group>`` for
  each category and difficulty (``NaN`` on the samples outside the group).
  """

  def __init__(self, tokenizer: Any = None):
    self._scorer = CastReward(use_budget=False, use_schema=False, tokenizer=tokenizer)
    self.__name__ = "tool_use_exact"

  def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
               gold: list[Any], functions: list[Any], category: list[str] | None = None,
               difficulty: list[str] | None = None, **unused: Any) -> RewardOutput:
    del prompts, unused
    n = len(completions)
    if len(gold) != n or len(functions) != n:
      raise ValueError(f"gold ({len(gold)}) and functions ({len(functions)}) must align with the {n} completions")
    rows = [self._scorer.score_one(completions[i], None if completion_ids is None else completion_ids[i], None,
                                   gold[i], functions[i]) for i in range(n)]
    keys = (*DIMENSIONS, "format", "think_len", "num_calls")
    metrics = {k: np.array([r[k] for r in rows], np.float32) for k in keys}
    exact, think = metrics["exact"], metrics["think_len"]
    for tags, groups in ((category, tool_use.CATEGORIES), (difficulty, DIFFICULTIES)):
      if tags is None:
        continue
      tags = np.asarray(tags)
      for g in groups:
        member = tags == g
        metrics[f"acc_{g}"] = np.where(member, exact, np.nan).astype(np.float32)
        metrics[f"think_len_{g}"] = np.where(member, think, np.nan).astype(np.float32)
    return RewardOutput(exact.copy(), metrics)


# ---------------------------------------------------------------------------------------------------------
# Case library.


def sample_cases(model, tokenizer, examples: Sequence[Mapping[str, Any]], num_samples: int, max_new_tokens: int,
                 rng: jax.Array, temperature: float = 1.0, batch_size: int = 256) -> list[cl.Case]:
  """``num_samples`` rollouts of ``model`` per example, scored into cases (think length in tokens).

  Rows are example-major (``examples[0]`` ``num_samples`` times, then ``examples[1]`` ...); batch ``b``
  uses ``fold_in(rng, b)``, so the library is a pure function of the parameters, examples and ``rng``.
  """
  rows = [ex for ex in examples for _ in range(num_samples)]
  open_ids, close_ids = tokenizer.encode(tool_use.THINK_OPEN), tokenizer.encode(tool_use.THINK_CLOSE)
  cases: list[cl.Case] = []
  for b, start in enumerate(range(0, len(rows), batch_size)):
    chunk = rows[start:start + batch_size]
    prompt_ids = [encode_prompt(tokenizer, ex["prompt"]) for ex in chunk]
    out = generate(model, prompt_ids, max_new_tokens, jax.random.fold_in(rng, b), temperature=temperature,
                   eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    for i, ex in enumerate(chunk):
      ids = out.tokens[i, :out.lengths[i]].tolist()
      text = decode_completion(tokenizer, ids)
      think_len = cl.think_length(text, ids, open_ids, close_ids)
      cases.append(cl.make_case(ex["id"], text, ex["gold"], ex["functions"], think_len, ex["category"]))
  return cases


def score_hardness(cases: Sequence[cl.Case]) -> dict[str, float]:
  """A dense second hardness source: ``H'(q) = 1 - mean over q's cases of the mean structural score``.

  (name, key, type, constraint, value; in [0, 1].) Averaged into ``H`` with weight
  ``task.cast.score_hardness_weight`` (METHODS.md allows a second source; with a weak base policy whose
  pass rate is 0 almost everywhere, ``1 - pass_rate`` alone gives every query the same ``H``.)
  """
  sums: dict[str, list[float]] = {}
  for c in cases:
    sums.setdefault(c.query_id, []).append(float(np.mean([c.scores[d] for d in DIMENSIONS[:5]])))
  return {q: 1.0 - float(np.mean(v)) for q, v in sums.items()}


def _atomic_write(path: str, write) -> None:
  tmp = f"{path}.tmp"
  write(tmp)
  os.replace(tmp, path)


def build_case_library(model, tokenizer, examples: Sequence[Mapping[str, Any]], directory: str, cast_cfg,
                       max_new_tokens: int, seed: int) -> tuple[cl.ComplexityProfile, cl.FailureProfile, dict]:
  """Loads ``directory/cases.jsonl`` if present, else samples it; builds and saves both profiles.

  Returns:
    ``(complexity, failure, summary)``; ``summary`` holds ``num_cases``, ``base_accuracy``, ``sampled``
    (False when the cases were read back), ``sample_s``, the bin edges and baselines.
  """
  os.makedirs(directory, exist_ok=True)
  cases_path = os.path.join(directory, CASES_FILE)
  t0 = time.perf_counter()
  sampled = not os.path.exists(cases_path)
  if sampled:
    rng = jax.random.fold_in(jax.random.key(seed), 0xCA5E)
    cases = sample_cases(model, tokenizer, examples, cast_cfg.num_samples, max_new_tokens, rng,
                         temperature=cast_cfg.temperature, batch_size=cast_cfg.rollout_batch_size)
    _atomic_write(cases_path, lambda p: cl.save_cases(p, cases))
  else:
    cases = cl.load_cases(cases_path)
    expected = {str(ex["id"]) for ex in examples}
    missing = expected - {c.query_id for c in cases}
    if missing:
      raise ValueError(f"{cases_path} lacks the training queries {sorted(missing)[:5]}... "
                       f"(written by a run with another task config?)")
  sample_s = time.perf_counter() - t0
  w = float(cast_cfg.score_hardness_weight)
  complexity, failure = cl.build_profiles(cases, cast_cfg.num_bins, min_baseline=cast_cfg.min_baseline,
                                          extra_hardness=score_hardness(cases) if w > 0 else None,
                                          extra_weight=w)
  summary = {"num_cases": len(cases), "num_queries": len(complexity.hardness),
             "base_accuracy": float(np.mean([c.correct for c in cases])), "sampled": sampled,
             "sample_s": round(sample_s, 1), "bin_edges": list(complexity.bin_edges),
             "baselines": list(complexity.baselines), "failure_rates": failure.overall}
  _atomic_write(os.path.join(directory, PROFILE_FILE),
                lambda p: cl.save_profiles(p, complexity, failure, summary))
  logging.info("case library: %s", summary)
  return complexity, failure, summary


class CurriculumIterator:
  """Columnar batches ``{field: [B]}`` of ``records`` in the order of a :class:`CurriculumSampler`.

  The position is the sampler's step; ``get_state()`` also records the settings it is valid for, and
  ``set_state`` refuses a state saved with other settings.
  """

  def __init__(self, records: Sequence[Mapping[str, Any]], sampler: CurriculumSampler):
    if len(records) != len(sampler):
      raise ValueError(f"{len(records)} records but the sampler orders {len(sampler)}")
    self.records = list(records)
    self.sampler = sampler
    self._config = {"mode": sampler.mode, "batch_size": sampler.batch_size, "num_records": len(records),
                    "seed": sampler.seed}

  def __iter__(self) -> "CurriculumIterator":
    return self

  def __next__(self) -> dict[str, Any]:
    return collate([self.records[i] for i in next(self.sampler)])

  def get_state(self) -> dict[str, Any]:
    return {**self.sampler.state_dict(), **self._config}

  def set_state(self, state: Mapping[str, Any]) -> None:
    mismatched = {k: (state[k], v) for k, v in self._config.items() if k in state and state[k] != v}
    if mismatched:
      raise ValueError("curriculum state was saved with different settings (saved, current): " +
                       ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in mismatched.items()))
    self.sampler.load_state_dict(state)


def prepare_rl(task_cfg, train_records: Sequence[Mapping[str, Any]], model, tokenizer, workdir: str, config):
  """``Task.prepare_rl``: the RL rewards and data iterator, built after SFT.

  ``task.reward == "exact"`` (plain GRPO): :class:`ToolUseScore` as the reward, shuffled epochs of the
  training prompts, no case library. ``"cast"``: the case library of the SFT policy (``task.cast``),
  :class:`CastReward` with its profiles, and a :class:`CurriculumSampler` ordered by ``H``
  (``task.cast.curriculum``).
  """
  rl = config.rl
  if task_cfg.reward == "exact":
    return ([WeightedReward("exact", ToolUseScore(tokenizer), 1.0)],
            BatchIterator(train_records, batch_size=rl.prompts_per_step, seed=config.seed))
  if task_cfg.reward != "cast":
    raise ValueError(f"task.reward={task_cfg.reward!r}: expected one of {REWARDS}")
  c = task_cfg.cast
  complexity, failure, _ = build_case_library(model, tokenizer, train_records, os.path.join(workdir, CASES_DIR),
                                              c, rl.max_new_tokens, config.seed)
  reward = CastReward(profile=complexity, weights=c.weights, failure_rates=failure, weight_floor=c.weight_floor,
                      use_budget=c.use_budget, use_schema=c.use_schema, think_mode=c.think_mode,
                      tokenizer=tokenizer)
  sampler = CurriculumSampler(example_hardness(train_records, complexity), rl.prompts_per_step,
                              mode=c.curriculum, num_stages=c.num_stages, total_steps=rl.steps,
                              seed=config.seed)
  return [WeightedReward("cast", reward, 1.0)], CurriculumIterator(train_records, sampler)


# ---------------------------------------------------------------------------------------------------------
# Step-0 headroom gate.


def headroom_rollout(model, tokenizer, examples: Sequence[Mapping[str, Any]], num_generations: int,
                     max_new_tokens: int, seed: int, temperature: float = 1.0,
                     batch_size: int = 256) -> headroom.HeadroomRollout:
  """``num_generations`` samples of ``model`` per record (one group each) as the gate's step-0 batch.

  Rows: reward = BFCL exact match, length = think length (tokens), ``extra``: ``r_tool`` (the six-dimension
  tool reward with uniform weights, METHODS.md section 1) and ``easy`` (the record's static difficulty).
  """
  cases = sample_cases(model, tokenizer, examples, num_generations, max_new_tokens, jax.random.key(seed),
                       temperature, batch_size)
  uniform = dimension_weights()
  easy = {ex["id"]: ex["difficulty"] == "easy" for ex in examples}
  return headroom.HeadroomRollout(
      rewards=[c.scores["exact"] for c in cases], group_ids=[c.query_id for c in cases],
      lengths=[c.think_len for c in cases],
      extra={"r_tool": [tool_reward(c.scores, uniform) for c in cases], "easy": [easy[c.query_id] for c in cases]})


def _easy_think_length_std(rollout: headroom.HeadroomRollout) -> float:
  easy = rollout.subset(rollout.extra["easy"])
  return float(np.mean(headroom.group_std(easy.lengths, easy.group_ids))) if easy.lengths.size else float("nan")


def _partial_credit_group_share(rollout: headroom.HeadroomRollout) -> float:
  varies = headroom.group_varies(rollout.extra["r_tool"], rollout.group_ids, 1e-6)
  exact_varies = headroom.group_varies(rollout.rewards, rollout.group_ids)
  return float(np.mean(varies & ~exact_varies))


def gate_statistics(rollout: headroom.HeadroomRollout, length_std_threshold: float = 0.0,
                    reward_atol: float = 0.0) -> dict[str, float]:
  """The CAST gate's statistics: :func:`lemon_rl.eval.headroom.headroom_statistics` (exact match as the reward,
  think length as the length) plus

      easy_think_length_std       = mean over the easy groups of std(think length)   (R_think has length to cut)
      partial_credit_group_share  = share of groups where R_tool varies but exact match does not
                                    (the six-dimension reward has a signal the binary one lacks)

  ``length_std_threshold`` and ``reward_atol`` are the gate's (:class:`lemon_rl.eval.headroom.HeadroomGate`).
  """
  return headroom.headroom_statistics(rollout, length_std_threshold=length_std_threshold, reward_atol=reward_atol,
                                     custom={"easy_think_length_std": _easy_think_length_std,
                                             "partial_credit_group_share": _partial_credit_group_share})


# ---------------------------------------------------------------------------------------------------------
# Config.


def check_config(config) -> None:
  """The ``tool_use`` task section (CAST): split sizes, category mix, reward and case-library options."""
  task, rl = config.task, config.rl
  source = task.get("source", "synthetic")
  cc.require_choice(SOURCES, "task.source", source)
  cc.require_positive(task, "task", "max_prompt_bytes", "max_completion_bytes")
  for split in SPLITS:
    n = task[f"num_{split}"]
    cc.require(isinstance(n, int) and (n >= 1 or (source == "bfcl" and n == -1)), f"task.num_{split}", n,
               "must be >= 1" + (" or -1 (all)" if source == "bfcl" else ""))
  if source == "bfcl":
    categories = _categories(task.get("bfcl_categories", ""))
    cc.require(bool(categories), "task.bfcl_categories", task.get("bfcl_categories", ""), "must name BFCL categories")
    for c in categories:
      cc.require(c in bfcl_data.CATEGORY_FILES, "task.bfcl_categories", task.bfcl_categories,
                 f"unknown category {c!r}; expected among {', '.join(bfcl_data.CATEGORY_FILES)}")
    bfcl_dir = task.get("bfcl_dir", "")
    if bfcl_dir:
      cc.require(os.path.isdir(bfcl_dir), "task.bfcl_dir", bfcl_dir, "must be a folder laid out like "
                 "bfcl-eval's data/ (BFCL_v4_<category>.json, possible_answer/)")
    else:
      cc.require(bfcl_data.bfcl_available(), "task.bfcl_dir", bfcl_dir,
                 f"'' reads the installed bfcl-eval's data, which is missing: {bfcl_data.INSTALL_HINT}")
  weights = dict(task.category_weights)
  for k, v in weights.items():
    cc.require(k in tool_use.CATEGORIES, f"task.category_weights.{k}", v,
               f"unknown category; expected one of {', '.join(tool_use.CATEGORIES)}")
    cc.require(isinstance(v, (int, float)) and v >= 0, f"task.category_weights.{k}", v, "must be >= 0")
  cc.require(sum(weights.values()) > 0, "task.category_weights", weights, "must have a positive sum")
  cc.require(task.style in tool_use.CALL_STYLES, "task.style", task.style,
             f"must be one of {', '.join(tool_use.CALL_STYLES)}")
  cc.require(task.reward in ("cast", "exact"), "task.reward", task.reward, "must be 'cast' or 'exact'")
  cast = task.cast
  cc.require_positive(cast, "task.cast", "num_samples", "temperature", "rollout_batch_size", "num_bins",
                      "min_baseline", "weight_floor", "num_stages")
  w = cast.score_hardness_weight
  cc.require(isinstance(w, (int, float)) and 0 <= w <= 1, "task.cast.score_hardness_weight", w,
             "must lie in [0, 1]")
  cc.require(cast.weights in ("uniform", "failure_profile"), "task.cast.weights", cast.weights,
             "must be 'uniform' or 'failure_profile'")
  cc.require(cast.think_mode in THINK_MODES, "task.cast.think_mode", cast.think_mode,
             f"must be one of {', '.join(THINK_MODES)}")
  cc.require(cast.curriculum in MODES, "task.cast.curriculum", cast.curriculum,
             f"must be one of {', '.join(MODES)}")
  try:
    noise = demo_noise(task)
  except (TypeError, ValueError) as e:  # An unknown field or a bad probability.
    raise cc.ConfigError(f"config.task.demo_noise={task.get('demo_noise')!r}: {e}") from e
  longest = task.max_completion_bytes + noise.max_extra_bytes
  if rl.steps:
    cc.require(rl.max_new_tokens > longest, "rl.max_new_tokens", rl.max_new_tokens,
               f"must exceed the longest demonstration, {longest} bytes (task.max_completion_bytes plus the "
               "demo noise's extra bytes), with room for EOS")
