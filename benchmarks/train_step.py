"""Training-step throughput: lemon_rl's policy update vs ``transformers``, and a whole GRPO step vs TRL.

Model: the Qwen2-shaped benchmark preset ``get_preset("bench")`` (vocab 512, d 256, 4 layers, 8 heads,
4 KV heads, MLP 1024), float32, on CPU. The same weights go to ``transformers`` through ``to_hf``.

(a) Forward + backward of the policy update on 32 sequences of 64 prompt + 128 completion tokens: the
    gradient of the clipped policy loss (``lemon_rl.training.rl.PolicyLoss`` through
    ``state.accumulate_gradients``) next to the same loss and ``backward()`` in ``transformers``
    (``Qwen2ForCausalLM``, SDPA attention). Reported as tokens/s and as achieved FLOP/s over this
    machine's float32 matmul peak, measured in the same run by ``conditions.MatmulPeak``, a jitted 2048^3
    ``jnp.dot`` timed in the header and again interleaved with the steps (the larger of its best
    wall-clock rate and its FLOPs per CPU-second times the CPU count: on a loaded machine the wall-clock
    rate of a two-thread dot collapses, which would make any fraction of it meaningless).

    FLOPs are counted analytically (`lemon_rl.models.flops`: the PaLM convention, causal attention once):
        per token: 6 * (N_matmul + V * E) + 3 * 4 * L * H * D * (T + 1) / 2
    with ``N_matmul = L * (E*(H+2K)*D + H*D*E + 3*E*F)`` the non-embedding matmul parameters, ``V * E`` the
    (tied) LM head, and the last term the causal ``q k^T`` and ``p v`` products (query ``t`` sees ``t + 1``
    keys), forward + backward. XLA's cost analysis of the compiled step is printed next to it.

(b) One whole GRPO step (4 prompts x 8 completions of 128 new tokens, temperature 1, a trivial reward,
    one optimizer update on the 32 completions) with ``lemon_rl.training.rl.RLTrainer`` next to TRL's
    ``GRPOTrainer`` at the same shapes (``beta=0``, one iteration, no gradient checkpointing, completions
    forced to the full 128 tokens on both sides). Skipped with ``--skip-trl`` or when TRL is missing.

Each figure is the best of ``--repeats`` runs after warm-up (compilation excluded); in (a) the implementations
are interleaved so that both see the same machine load, in (b) TRL's steps follow ours (``trainer.train()``
runs them back to back). Per-step CPU time (user + system) is printed as well:
on a shared machine it moves much less than wall time.

Allocator: XLA allocates the step's whole temporary buffer (about 0.9 GB here) per call; glibc serves it
with a fresh ``mmap`` from a worker thread's arena and unmaps it afterwards, so every step page-faults it
in again (about 0.35 s of system time per step on this machine). The script therefore re-executes itself
with ``GLIBC_TUNABLES`` set so that freed memory stays in the main heap (one arena, no ``mmap`` chunks, no
trimming) unless the variable is already set or ``--default-malloc`` is given. Both libraries run in the
same process, so both get the same allocator.

    python benchmarks/train_step.py [--repeats 5] [--skip-trl] [--default-malloc] [--cpus N]

The header and footer (machine, ISA, versions, matmul peak, load, other processes' CPU use during the run)
come from ``benchmarks/conditions.py``.

On a machine shared with other jobs (load average above the CPU count), multi-threaded torch suffers far
more than XLA (its OpenMP barriers wait for descheduled threads), so the all-CPU ratios flatter lemon_rl;
``--cpus 1`` gives the comparison without that effect (each library on one thread).

The last three lines read ``train_step_mfu=<fraction>``, ``train_step_speedup_vs_transformers=<ratio>``
and ``grpo_step_speedup_vs_trl=<ratio>`` (``nan`` for a part that was skipped).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning("--default-malloc")
  from cpus import restrict_cpus_from_argv  # pylint: disable=g-import-not-at-top
  restrict_cpus_from_argv()
  import conditions  # pylint: disable=g-import-not-at-top,unused-import  (load baseline before the imports)

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import functools
import math
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx
from ml_collections import config_dict

import conditions
from lemon_rl.models import ModelConfig, Transformer, get_preset, to_hf
from lemon_rl.models.flops import train_flops
from lemon_rl.rewards.combine import WeightedReward
from lemon_rl.text.tokenizers import ByteTokenizer
from lemon_rl.training import state as state_lib
from lemon_rl.training.base_config import get_base_config
from lemon_rl.training.rl import PolicyLoss, RLTrainer

BATCH, PROMPT_LEN, NEW_TOKENS = 32, 64, 128
PROMPTS, GENERATIONS = 4, 8


def make_batch(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """32 sequences of 64 prompt + 128 completion tokens; the loss covers the completions."""
  rng = np.random.default_rng(seed)
  t = PROMPT_LEN + NEW_TOKENS
  ids = rng.integers(0, cfg.vocab_size, size=(BATCH, t)).astype(np.int32)
  loss_mask = np.zeros((BATCH, t - 1), np.float32)
  loss_mask[:, PROMPT_LEN - 1:] = 1.0
  return {
      "ids": ids,
      "attention_mask": np.ones((BATCH, t), np.int32),
      "loss_mask": loss_mask,
      "old_logp": np.full((BATCH, t - 1), -math.log(cfg.vocab_size), np.float32),
      "advantages": rng.normal(size=BATCH).astype(np.float32),
  }


# -- (a) forward + backward ---------------------------------------------------------------------------------


def lemon_forward_backward(model: Transformer, batch: dict[str, np.ndarray]):
  graphdef, params = nnx.split(model, nnx.Param)
  loss_fn = PolicyLoss()
  jbatch = {k: jnp.asarray(v) for k, v in batch.items()}

  @jax.jit
  def grads(params, batch):
    return state_lib.accumulate_gradients(graphdef, params, batch, loss_fn)

  compiled = grads.lower(params, jbatch).compile()
  xla_flops = compiled.cost_analysis().get("flops", float("nan"))

  def run():
    jax.block_until_ready(grads(params, jbatch))

  return run, xla_flops


def torch_forward_backward(hf_model, batch: dict[str, np.ndarray], eps: float = 0.2):
  """The same clipped surrogate (token mean over completion tokens) and ``backward()`` in torch."""
  ids = torch.tensor(batch["ids"], dtype=torch.long)
  attention_mask = torch.tensor(batch["attention_mask"], dtype=torch.long)
  loss_mask = torch.tensor(batch["loss_mask"])
  old_logp = torch.tensor(batch["old_logp"])
  advantages = torch.tensor(batch["advantages"])[:, None]

  def run():
    hf_model.zero_grad(set_to_none=True)
    logits = hf_model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    ((per_token * loss_mask).sum() / loss_mask.sum()).backward()

  return run


# -- (b) GRPO step --------------------------------------------------------------------------------------------


class FixedLengthTokenizer(ByteTokenizer):
  """Byte tokenizer (vocabulary padded to the model's 512) whose EOS is never sampled (id -1).

  Every completion then runs to ``max_new_tokens``, as TRL's do with ``min_new_tokens``.
  """

  @property
  def eos_id(self) -> int:
    return -1

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (-1,)


def trivial_reward(prompts, completions, completion_ids, **fields):
  del prompts, completions, fields
  # Parity of the token-id sum: every completion has the same length, so its length would give every
  # group equal rewards (zero advantages); TRL's reward, the parity of the decoded text's length, varies.
  return np.array([int(np.sum(c)) % 2 for c in completion_ids], np.float32)


def rl_config() -> config_dict.ConfigDict:
  """The base config's ``rl`` section with this benchmark's shapes: one on-policy pass over the whole batch."""
  c = get_base_config().rl
  c.num_generations = GENERATIONS
  c.max_new_tokens = NEW_TOKENS
  c.num_iterations, c.minibatch_size, c.microbatch_size = 1, 0, PROMPTS * GENERATIONS
  return c


def prompt_texts(seed: int = 1) -> list[str]:
  """Four 63-character prompts: 64 tokens each with the byte tokenizer's BOS."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
  return ["".join(rng.choice(letters, PROMPT_LEN - 1)) for _ in range(PROMPTS)]


def lemon_grpo_step(model: Transformer):
  tok = FixedLengthTokenizer(pad_vocab_to_multiple_of=model.cfg.vocab_size)
  assert tok.vocab_size == model.cfg.vocab_size
  optimizer = state_lib.make_optimizer(1e-6, total_steps=1000, schedule="constant")
  graphdef, state = state_lib.create_train_state(model, optimizer, seed=0)
  trainer = RLTrainer(graphdef, optimizer, tok, [WeightedReward("trivial", trivial_reward)], rl_config())
  examples = [{"prompt": p} for p in prompt_texts()]
  assert all(len(tok.encode(e["prompt"], add_bos=True)) == PROMPT_LEN for e in examples)
  holder = {"state": state, "metrics": {}}

  def run():
    holder["state"], metrics, rollout = trainer.step(holder["state"], examples)
    assert rollout.batch["ids"].shape == (PROMPTS * GENERATIONS, PROMPT_LEN + NEW_TOKENS)
    assert float(rollout.batch["loss_mask"].sum()) == PROMPTS * GENERATIONS * NEW_TOKENS
    holder["metrics"] = metrics

  return run, holder


def hf_word_tokenizer(vocab_size: int, path: str):
  """A whitespace word-level ``PreTrainedTokenizerFast``: ``<pad> <eos> <unk>`` then words ``t3 .. t{V-1}``."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
  core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                             unk_token="<unk>")
  tok.save_pretrained(path)
  return tok


def trl_grpo_step(model_dir: str, vocab_size: int, repeats: int):
  """Times ``repeats`` GRPO steps of TRL after one warm-up step; returns per-step lists of seconds."""
  import datasets  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel

  tok = hf_word_tokenizer(vocab_size, model_dir)
  rng = np.random.default_rng(1)
  prompts = [" ".join(f"t{i}" for i in rng.integers(3, vocab_size, PROMPT_LEN)) for _ in range(PROMPTS)]
  assert all(tok(p)["input_ids"] == [int(w[1:]) for w in p.split()] for p in prompts)
  steps = 1 + repeats
  dataset = datasets.Dataset.from_dict({"prompt": prompts * steps})

  def reward(completions, **kwargs):
    del kwargs
    return [float(len(c) % 2) for c in completions]

  args = trl.GRPOConfig(
      output_dir=os.path.join(model_dir, "trl_out"), per_device_train_batch_size=PROMPTS * GENERATIONS,
      num_generations=GENERATIONS, max_completion_length=NEW_TOKENS, gradient_accumulation_steps=1,
      num_iterations=1, beta=0.0, learning_rate=1e-6, max_steps=steps, logging_steps=1, report_to="none",
      use_cpu=True, save_strategy="no", gradient_checkpointing=False, shuffle_dataset=False, temperature=1.0,
      generation_kwargs={"min_new_tokens": NEW_TOKENS}, disable_tqdm=True, bf16=False,
      dataloader_num_workers=0, seed=0)
  trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                            processing_class=tok)
  times = {"step": [], "generate": []}

  generate = trainer.model.generate

  @functools.wraps(generate)
  def timed_generate(*a, **kw):  # Times TRL's generation and checks that it made 128 new tokens.
    t0 = time.perf_counter()
    out = generate(*a, **kw)
    times["generate"].append(time.perf_counter() - t0)
    prompt = kw["input_ids"] if "input_ids" in kw else a[0]
    assert out.shape[1] - prompt.shape[1] == NEW_TOKENS, out.shape
    return out

  trainer.model.generate = timed_generate

  class Timer(transformers.TrainerCallback):

    def on_step_begin(self, args, state, control, **kwargs):
      self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      times["step"].append(time.perf_counter() - self.t0)

  trainer.add_callback(Timer())
  trainer.train()
  return times


# -- main -----------------------------------------------------------------------------------------------------


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--skip-trl", action="store_true")
  parser.add_argument("--default-malloc", action="store_true",
                      help="keep glibc's default allocator settings (see the module docstring)")
  parser.add_argument("--cpus", type=int, default=0,
                      help="run on the first N CPUs only (0 = all); both libraries then use N threads")
  args = parser.parse_args()

  cond = conditions.start("benchmarks/train_step.py: policy update vs transformers, GRPO step vs TRL")
  cfg = get_preset("bench")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tmp = tempfile.TemporaryDirectory()
  to_hf(model, tmp.name)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp.name, dtype=torch.float32)
  hf_model.train()

  print(f"torch {torch.get_num_threads()} threads, attention {hf_model.config._attn_implementation}")
  print(f"model: bench preset, {cfg.num_params() / 1e6:.2f}M params, float32")

  # (a) forward + backward.
  batch = make_batch(cfg)
  tokens = BATCH * (PROMPT_LEN + NEW_TOKENS)
  flops = train_flops(cfg, BATCH, PROMPT_LEN + NEW_TOKENS)
  lemon_run, xla_flops = lemon_forward_backward(model, batch)
  # The peak's samples: the header's, and more interleaved with the steps (the same machine load).
  res = conditions.interleaved({"peak": cond.peak, "lemon_rl": lemon_run,
                                "transformers": torch_forward_backward(hf_model, batch)}, args.repeats)
  conditions.interleaved({"peak": cond.peak}, 4 * args.repeats, warmup=0)
  ncpu = len(os.sched_getaffinity(0))
  peak = cond.peak.flops_per_s
  print(f"\n(a) forward + backward, {BATCH} x ({PROMPT_LEN} + {NEW_TOKENS}) tokens, "
        f"{flops / 1e9:.1f} GFLOP analytic (XLA cost analysis of the lemon_rl step: {xla_flops / 1e9:.1f})")
  print(cond.peak.describe())
  header = (f"{'impl':>12} | {'best s':>7} | {'median s':>8} | {'cpu s':>6} | {'tokens/s':>8} | "
            f"{'GFLOP/s':>7} | {'of peak':>7} | {'cpu-time of peak':>16}")
  print(header)
  print("-" * len(header))
  for name in ("lemon_rl", "transformers"):
    best, median, cpu = res[name]
    print(f"{name:>12} | {best:>7.3f} | {median:>8.3f} | {cpu:>6.2f} | {tokens / best:>8.0f} | "
          f"{flops / best / 1e9:>7.1f} | {flops / best / peak:>7.1%} | {flops / cpu * ncpu / peak:>16.1%}")
  mfu = flops / res["lemon_rl"][0] / peak
  fb_speedup = res["transformers"][0] / res["lemon_rl"][0]
  print(f"cpu-time ratio (transformers / lemon_rl, medians): {res['transformers'][2] / res['lemon_rl'][2]:.2f}")
  print("('of peak' uses wall time; 'cpu-time of peak' uses the CPU seconds spent, which a loaded machine "
        "inflates much less)")

  # (b) GRPO step.
  grpo_speedup = float("nan")
  if args.skip_trl:
    print("\n(b) skipped (--skip-trl)")
  else:
    try:
      import trl  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError as e:
      print(f"\n(b) skipped: TRL is not importable ({e})")
    else:
      lemon_step, holder = lemon_grpo_step(model)
      lemon_step()  # Compiles.
      ours = conditions.interleaved({"lemon_rl": lemon_step}, args.repeats, warmup=0)["lemon_rl"]
      m = holder["metrics"]
      trl_times = trl_grpo_step(tmp.name, cfg.vocab_size, args.repeats)
      trl_best = min(trl_times["step"][1:])
      trl_gen = min(trl_times["generate"][1:])
      print(f"\n(b) GRPO step: {PROMPTS} prompts x {GENERATIONS} completions of {NEW_TOKENS} tokens, "
            f"prompt {PROMPT_LEN} tokens, one update (best of {args.repeats} after one warm-up step)")
      print(f"  lemon_rl     step {ours[0]:.3f} s (median {ours[1]:.3f}, cpu {ours[2]:.2f}); last step: sample "
            f"{m['time/sample_s']:.3f} s, old log-probs {m['time/logprob_s']:.3f} s, update "
            f"{m['time/update_s']:.3f} s")
      trl_median = np.median(trl_times["step"][1:])
      print(f"  TRL {trl.__version__:<8} step {trl_best:.3f} s (median {trl_median:.3f}); "
            f"generate {trl_gen:.3f} s")
      grpo_speedup = trl_best / ours[0]

  tmp.cleanup()
  print()
  cond.finish()
  print(f"train_step_mfu={mfu:.3f}")
  print(f"train_step_speedup_vs_transformers={fb_speedup:.2f}")
  print(f"grpo_step_speedup_vs_trl={grpo_speedup:.2f}")


if __name__ == "__main__":
  main()
