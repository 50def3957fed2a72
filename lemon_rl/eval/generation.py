"""Evaluation by generation: decode held-out prompts and score them with a reward function."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from lemon_rl.rewards.base import as_reward_output
from lemon_rl.sampling import generate
from lemon_rl.text.decoding import decode_completion, encode_prompt


def evaluate(model, tokenizer, examples: Sequence[Mapping[str, Any]], reward_fn, max_new_tokens: int, *,
             batch_size: int = 256, temperature: float = 0.0, num_samples: int = 1, seed: int = 0):
  """Scores ``num_samples`` completions per example (greedy by default).

  Returns:
    ``(metrics, scores)``: ``metrics`` holds ``accuracy`` (mean score; a score is the reward function's
    value, 1.0 = correct for verifiable tasks), ``completion_length`` and the mean of every per-sample
    metric the reward function reports; ``scores`` is ``[len(examples), num_samples]``.
  """
  prompts = [ex["prompt"] for ex in examples for _ in range(num_samples)]
  fields = {k: [ex[k] for ex in examples for _ in range(num_samples)] for k in examples[0] if k != "prompt"}
  scores, lengths = [], []
  metric_sums: dict[str, list[np.ndarray]] = {}
  key = jax.random.key(seed)
  for start in range(0, len(prompts), batch_size):
    chunk = slice(start, start + batch_size)
    ids = [encode_prompt(tokenizer, p) for p in prompts[chunk]]
    out = generate(model, ids, max_new_tokens, jax.random.fold_in(key, start), temperature=temperature,
                   eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    completion_ids = [out.tokens[i, :out.lengths[i]].tolist() for i in range(len(ids))]
    completions = [decode_completion(tokenizer, c) for c in completion_ids]
    result = as_reward_output(
        reward_fn(prompts[chunk], completions, completion_ids, **{k: v[chunk] for k, v in fields.items()}),
        len(ids))
    scores.append(result.rewards)
    lengths.append(out.lengths)
    for k, v in result.metrics.items():
      metric_sums.setdefault(k, []).append(v)
  scores_arr = np.concatenate(scores).reshape(len(examples), num_samples)
  metrics = {"accuracy": float(scores_arr.mean()),
             "completion_length": float(np.concatenate(lengths).mean())}
  metrics.update({k: float(np.nanmean(np.concatenate(v))) for k, v in metric_sums.items()})
  return metrics, scores_arr
