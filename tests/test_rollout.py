"""The shared rollout path: the learner scores what the sampler sampled; real tokenizers run end to end."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers as hf_tokenizers
from flax import nnx

from lemon_rl.models import Transformer, get_preset
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.text import ByteTokenizer, HFTokenizer
from lemon_rl.training import rollout as rollout_lib
from lemon_rl.training import state as state_lib
from lemon_rl.training.base_config import get_base_config
from lemon_rl.training.rl import PolicyLoss, RLTrainer
from lemon_rl.training.rollout import SamplingSettings


def length_reward(prompts, completions, completion_ids, **fields):
  del prompts, completions, fields
  return np.asarray([len(ids) % 3 for ids in completion_ids], np.float32)


def rl_section(**overrides):
  cfg = get_base_config().rl
  cfg.update(dict(prompts_per_step=4, num_generations=4, max_new_tokens=8, minibatch_size=0, microbatch_size=16,
                  num_iterations=1))
  cfg.update(overrides)
  return cfg


def tiny_model(vocab_size, seed=0):
  cfg = get_preset("tiny", vocab_size=vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   mlp_dim=64)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def test_learner_log_probs_equal_the_samplers_before_any_update(top_k=20, top_p=0.9):
  """Temperature 0.7 with top-k 20 and top-p 0.9: the learner's log-probs of a sampled batch are the sampler's.

  (The sampling distribution itself is checked for each filter alone in ``test_sampler.py``.)"""
  tok = ByteTokenizer()
  model = tiny_model(tok.vocab_size)
  graphdef, params = nnx.split(model, nnx.Param)
  cfg = rl_section(temperature=0.7, top_k=top_k, top_p=top_p)
  examples = [{"prompt": p} for p in ("12+34=", "7*8=", "a longer prompt", "x")]
  rollout = rollout_lib.collect_rollout(graphdef, params, tok, examples, [WeightedReward("len", length_reward)],
                                        cfg, jax.random.key(3))
  batch = rollout.batch
  mask = batch["loss_mask"] > 0
  sampling = SamplingSettings.from_config(cfg)
  learner = np.asarray(rollout_lib.sequence_token_log_probs(
      graphdef, params, jnp.asarray(batch["ids"]), jnp.asarray(batch["attention_mask"]), sampling))
  # Both sides take the same float32 log-softmax of logits from a full forward vs. a KV-cached decode (sums
  # in another order). For this fresh 1-layer model the logits are O(0.1), so their rounding differences
  # are ~1e-8; the log-softmax adds a logsumexp over V = 259 terms (relative error ~sqrt(V) eps ~ 2e-6 of a
  # value ~log V) and the subtraction (~|log p| eps ~ 1e-6): ~3e-6, inside the 1e-5 bound. A
  # distribution mismatch (temperature or filter ignored) shows as > 1e-2, checked below.
  dlogp = 1e-5
  np.testing.assert_allclose(learner[mask], batch["sampler_logp"][mask], rtol=0, atol=dlogp)
  # The temperature-1 log-probs (what the learner used to compute) are not the sampler's.
  plain = np.asarray(rollout_lib.sequence_token_log_probs(
      graphdef, params, jnp.asarray(batch["ids"]), jnp.asarray(batch["attention_mask"])))
  assert np.abs(plain[mask] - batch["sampler_logp"][mask]).max() > 1e-2
  # Through the loss: with the sampler's log-probs as pi_old the ratio is 1 on every token.
  loss = PolicyLoss(sampling=sampling)
  fed = {k: jnp.asarray(v) for k, v in batch.items()}
  fed["old_logp"] = fed.pop("sampler_logp")
  _, metrics = loss(nnx.merge(graphdef, params), fed)
  assert abs(float(metrics["ratio_min"].value) - 1) <= 2 * dlogp  # |exp(d) - 1| ~ |d| for the loss's own forward
  assert abs(float(metrics["ratio_max"].value) - 1) <= 2 * dlogp


def test_kl_penalty_with_a_truncated_sampler_is_refused():
  with pytest.raises(ValueError, match="top_k=0 and top_p=1.0"):
    PolicyLoss(kl_coef=0.1, sampling=SamplingSettings(0.7, 0, 0.9))
  PolicyLoss(kl_coef=0.1, sampling=SamplingSettings(0.7, 0, 1.0))  # Temperature alone is fine.


def _word_tokenizer(directory):
  """A word-level ``tokenizer.json`` built by the ``tokenizers`` library: no BOS, two EOS ids."""
  vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<|endoftext|>", "<|eot|>", "a", "b", "c", "d"])}
  raw = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  raw.pre_tokenizer = hf_tokenizers.pre_tokenizers.Whitespace()
  raw.add_special_tokens(["<pad>", "<|endoftext|>", "<|eot|>"])
  raw.save(os.path.join(directory, "tokenizer.json"))
  for name, obj in (("tokenizer_config.json", {"eos_token": "<|endoftext|>", "pad_token": "<pad>"}),
                    ("generation_config.json", {"eos_token_id": [2, 3]})):
    with open(os.path.join(directory, name), "w") as f:
      json.dump(obj, f)
  return HFTokenizer.from_file(directory)


def test_one_rl_step_with_a_tokenizer_without_bos_and_with_two_eos_ids(tmp_path):
  tok = _word_tokenizer(str(tmp_path))
  assert tok.bos_id is None and tok.eos_ids == (2, 3)
  model = tiny_model(tok.vocab_size, seed=1)
  optimizer = optax.adam(1e-3)
  graphdef, state = state_lib.create_train_state(model, optimizer, seed=0)
  cfg = rl_section(prompts_per_step=8, max_new_tokens=12, microbatch_size=32)
  trainer = RLTrainer(graphdef, optimizer, tok, [WeightedReward("len", length_reward)], cfg)
  examples = [{"prompt": p} for p in ("a b", "c", "d a b", "b b", "a", "c d", "d", "a c")]
  new_state, metrics, rollout = trainer.step(state, examples)
  assert int(new_state.step) == 1 and np.isfinite(metrics["train/loss"])
  # Prompts carry no BOS: each is exactly the text's ids.
  assert rollout.prompt_ids[0] == tok.encode("a b") == [4, 5]
  # Every row stops at its first EOS, whichever of the two it is.
  p = rollout.batch["ids"].shape[1] - cfg.max_new_tokens
  completions = rollout.batch["ids"][:, p:]
  lengths = rollout.batch["loss_mask"].sum(-1).astype(int)
  ended_on = set()
  for row, n in zip(completions, lengths):
    stops = [j for j, t in enumerate(row[:n]) if t in tok.eos_ids]
    assert stops == [n - 1] or (not stops and n == cfg.max_new_tokens), (row, n)
    if stops:
      ended_on.add(int(row[n - 1]))
  assert ended_on == {2, 3}  # 32 near-uniform rows over 8 ids: both EOS ids end some row.
