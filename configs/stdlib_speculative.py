"""A target worth drafting for and its EAGLE-3 drafter, trained on the Python standard library.

    python -m experiments.train_speculative --config=configs/stdlib_speculative.py[:variant] --workdir=DIR

One command: the corpus (``lemon_rl.data.stdlib_corpus``, split by package), a byte-level BPE tokenizer
trained on the training packages, the target decoder (next-token loss on packed training files), then the
EAGLE-3 drafter (``lemon_rl.models.drafter``) on the target's own continuations of training prompts
(self-distillation, ``lemon_rl.training.drafter_training``).

Variants (``--config=configs/stdlib_speculative.py:<variant>``):
  ``cpu`` (default): 67 min on this 2-vCPU Xeon (2026-12-01, one run; besides it about 2 CPU-minutes
    of other work and 3-4% hypervisor steal): data and tokenizer 0.5 min; target 41.1 min (800 steps of
    16 x 256 tokens, about 1.1 epochs of the 3.0M training tokens; d 256, 8 blocks, 8.4M parameters;
    held-out NLL 3.48 nats/token); self-distillation data 7.3 min (2048 continuations of up to 192 tokens,
    256 per generate call); drafter 15.7 min (500 steps of 8 x 256 tokens, 4 unrolled steps; 1.3M trainable
    parameters); evaluations, report and the rest 2.4 min. Until 2026-12-01 the target ran 1000 steps and
    the drafter 600 (held-out NLL 3.26; 78-82 min in all).
  ``tiny``: a smoke run of every stage in about a minute (tests).
"""

from ml_collections import config_dict


def get_config(variant: str = "cpu") -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.seed = 0  # Model initialisation and data order.

  c.corpus = config_dict.ConfigDict()
  c.corpus.test_percent = 10.0  # Hash buckets (of 100) whose packages are held out (stdlib_corpus docstring).
  c.corpus.near_duplicate_threshold = 0.7  # Line containment in one earlier file above which a file is dropped.
  c.corpus.max_chars_per_split = config_dict.placeholder(int)  # None = every kept file.

  c.tokenizer = config_dict.ConfigDict()
  c.tokenizer.vocab_size = 2048  # Byte-level BPE ids, the 3 specials <pad> <bos> <eos> included.

  c.data = config_dict.ConfigDict()
  c.data.seq_len = 256  # Rows of the packed token stream (files separated by <eos>).

  c.target = config_dict.ConfigDict()
  c.target.preset = "bench"  # lemon_rl.models.config preset; the fields below override it.
  c.target.num_layers = 8
  c.target.hidden_size = 256
  c.target.num_heads = 8
  c.target.num_kv_heads = 4
  c.target.mlp_dim = 1024
  c.target.steps = 800
  c.target.batch_size = 16  # Rows of seq_len tokens per step.
  c.target.learning_rate = 1e-3
  c.target.warmup_steps = 60
  c.target.weight_decay = 0.01
  c.target.max_grad_norm = 1.0
  c.target.eval_every = 200  # Held-out NLL every this many steps (and at the end); 0 = only at the end.
  c.target.eval_rows = 128  # Held-out rows scored.
  c.target.checkpoint_every = 100

  c.distill = config_dict.ConfigDict()
  c.distill.num_sequences = 2048  # Target continuations of training prompts (the drafter's data).
  c.distill.prompt_len = 64  # Prompt: the first tokens of a training row.
  c.distill.new_tokens = 192  # Continuation length limit (a row stops at <eos>).
  c.distill.batch_size = 256  # Rows per generate call.
  c.distill.temperatures = (0.0, 1.0)  # Cycled over generate calls: greedy and sampled continuations.

  c.drafter = config_dict.ConfigDict()
  c.drafter.feature_layers = ()  # Target blocks fused; () = EAGLE-3's (1, L//2 - 1, L - 4), (1, 3, 4) here.
  c.drafter.num_heads = 0  # 0 = the target's.
  c.drafter.num_kv_heads = 0  # 0 = the target's.
  c.drafter.mlp_dim = 0  # 0 = the target's.
  c.drafter.ttt_steps = 4  # Unrolled drafting steps of the training-time test.
  c.drafter.step_decay = 0.8  # Weight decay^k of step k's loss.
  c.drafter.feature_weight = 0.0  # Weight of the optional feature regression.
  c.drafter.steps = 500
  c.drafter.batch_size = 8
  c.drafter.learning_rate = 1e-3
  c.drafter.warmup_steps = 30
  c.drafter.weight_decay = 0.0
  c.drafter.max_grad_norm = 1.0
  c.drafter.eval_every = 100  # Held-out acceptance metrics every this many steps (and at the end).
  c.drafter.eval_rows = 64  # Held-out rows scored.
  c.drafter.checkpoint_every = 100

  c.eval = config_dict.ConfigDict()
  c.eval.num_prompts = 16  # Held-out prompts decoded greedily by the target alone and speculatively.
  c.eval.prompt_len = 64
  c.eval.max_new_tokens = 64
  c.eval.num_draft = 4  # K, tokens drafted per target forward.
  c.eval.timing_context = 128  # Cached positions before the timed batch-1 decode steps.
  c.eval.timing_steps = 64  # Decode steps per timed loop.
  c.eval.min_cost_ratio = 5.0  # Target / drafter batch-1 step time the run reports against.
  c.eval.sampled = True  # Also decode speculatively at temperature 1 (reports its tau).

  if variant == "cpu":
    pass
  elif variant == "tiny":
    c.corpus.max_chars_per_split = 150_000
    c.tokenizer.vocab_size = 512
    c.data.seq_len = 64
    # Few compiles: 2 blocks, one sampling mode, and the report's prompts shaped like the distillation batch
    # (its target-only decode reuses that compiled loop).
    c.target.update(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=128, steps=12, batch_size=8,
                    warmup_steps=2, eval_every=0, eval_rows=8, checkpoint_every=5)
    c.distill.update(num_sequences=16, prompt_len=16, new_tokens=16, batch_size=8, temperatures=(0.0,))
    c.drafter.update(ttt_steps=2, steps=8, batch_size=8, warmup_steps=2, eval_every=0, eval_rows=8, checkpoint_every=4)
    c.eval.update(num_prompts=8, prompt_len=16, max_new_tokens=16, num_draft=3, timing_context=16, timing_steps=8,
                  sampled=False)
  else:
    raise ValueError(f"unknown variant {variant!r}; expected 'cpu' or 'tiny'")
  return c
