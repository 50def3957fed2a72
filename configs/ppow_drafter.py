"""PPOW: window-level RL of the stdlib EAGLE-3 drafter against its frozen target (METHODS.md section 3).

    python -m experiments.train_ppow --config=configs/ppow_drafter.py[:variant] --workdir=DIR \
        --config.init_from=SPEC_WORKDIR

``SPEC_WORKDIR`` is a finished ``experiments/train_speculative.py`` run: its ``checkpoints/speculative``
(target + token-level drafter, the starting point), ``data/distill.npz`` (the target's own continuations of
training prompts: the prefixes) and ``data/test.npy`` (held-out rows: the prompts of the before/after
``tau``). ``lemon_rl.training.ppow_training`` documents the step.

Variants (``--config=configs/ppow_drafter.py:<variant>``, optionally ``tiny,<ablation>``), the paper's
ablations:
  ``full`` (default): ``R_speedup + R_dist`` and ADAW prefix sampling;
  ``no_dist``: without ``R_dist`` (``eta = 0``);
  ``no_adaw``: prefixes uniform over the valid windows;
  ``neither``: both removed.
  ``tiny``: a smoke run on a ``configs/stdlib_speculative.py:tiny`` workdir (a few steps, seconds after
  compiling).
The ``cpu`` size (every variant but ``tiny``): 200 steps of 8 prefixes x 8 windows of 4 tokens from a pool
of 32 rows (estimated a few s/step on a 2-core CPU for the 8-block stdlib target; not yet timed on a full run).
"""

from ml_collections import config_dict

ABLATIONS = ("full", "no_dist", "no_adaw", "neither")


def get_config(variant: str = "full") -> config_dict.ConfigDict:
  parts = [p for p in variant.split(",") if p]
  size = "tiny" if "tiny" in parts else "cpu"
  ablations = [p for p in parts if p != "tiny"] or ["full"]
  if len(ablations) != 1 or ablations[0] not in ABLATIONS:
    raise ValueError(f"unknown variant {variant!r}; expected [tiny,]<one of {ABLATIONS}> or 'tiny'")
  ablation = ablations[0]

  c = config_dict.ConfigDict()
  c.seed = 0  # Pool rows, prefix draws, drafts.
  c.init_from = config_dict.placeholder(str)  # The train_speculative workdir (required).
  c.variant = ablation

  c.ppow = config_dict.ConfigDict()
  c.ppow.num_draft = 4  # K, tokens per window (the engine's num_draft at evaluation too).
  c.ppow.group_size = 8  # G_roll windows per prefix (the paper's 8).
  c.ppow.num_prefixes = 8  # B prefixes per step.
  c.ppow.pool_rows = 32  # Distillation rows scored per step; the prefixes are drawn from their windows.
  c.ppow.min_prefix = config_dict.placeholder(int)  # Smallest P; None = the distillation prompt length - 1
  # (so every window lies in the target's own continuation).
  c.ppow.verification = "greedy"  # Accepted length of the reward: greedy | sampling | expected.
  c.ppow.gamma = 0.12  # Drafter / target cost ratio of R_speedup (the paper's value) ...
  c.ppow.measured_gamma = False  # ... or the batch-1 decode-step ratio measured at start-up.
  c.ppow.use_dist_reward = ablation in ("full", "no_adaw")
  c.ppow.eta = 0.2  # R_dist (METHODS.md Decision).
  c.ppow.eps = 1.0  # R_dist threshold, nats per token.
  c.ppow.beta = 0.01  # KL(Q || P) weight.
  c.ppow.clip_eps = 0.2
  c.ppow.estimator = "grpo"  # Group-relative advantage over the G_roll windows of a prefix.
  c.ppow.aggregation = "seq_mean_token_mean"  # The paper's (1/G) sum_i (1/K) sum_t.
  c.ppow.adaw = ablation in ("full", "no_dist")
  c.ppow.adaw_floor = 0.1  # Uniform mixture weight of ADAW.
  c.ppow.num_iterations = 1  # Optimizer steps per collected batch.
  c.ppow.steps = 200
  c.ppow.learning_rate = 1e-4  # Fine-tuning the token-level drafter (trained at 1e-3).
  c.ppow.warmup_steps = 10
  c.ppow.weight_decay = 0.0
  c.ppow.max_grad_norm = 1.0
  c.ppow.checkpoint_every = 50

  c.eval = config_dict.ConfigDict()
  c.eval.num_prompts = 16  # Held-out prompts (rows of data/test.npy), decoded speculatively before and after.
  c.eval.prompt_len = 64
  c.eval.max_new_tokens = 64
  c.eval.sampled = True  # Also at temperature 1 (besides greedy).
  c.eval.timing_context = 128  # For measured_gamma: cached positions before the timed decode steps.
  c.eval.timing_steps = 64

  # Step-0 headroom gate of experiments/reproduce_ppow.py (lemon_rl.eval.headroom), fixed before the run:
  # windows of the start drafter must leave something to gain (held-out validation tau below K + 1 and a
  # first-position acceptance below 1) and the group-relative advantage must have signal (the share of
  # prefixes whose G_roll windows differ in reward, from one step-0 batch of the full arm). The tau bound
  # follows num_draft (a reference), also where a variant changes it.
  c.headroom = config_dict.ConfigDict()
  c.headroom.thresholds = config_dict.ConfigDict({
      "min_signal_group_share": 0.25, "max_start_tau_greedy": c.ppow.get_ref("num_draft") + 0.5,
      "max_start_accept_first_greedy": 0.95})
  c.headroom.reward_atol = 1e-6

  if size == "tiny":
    c.ppow.update(num_draft=3, group_size=4, num_prefixes=4, pool_rows=8, steps=4, warmup_steps=1,
                  learning_rate=1e-3, checkpoint_every=2)
    c.eval.update(num_prompts=8, prompt_len=16, max_new_tokens=16, sampled=False, timing_context=16,
                  timing_steps=8)
    c.headroom.thresholds.min_signal_group_share = 0.0  # A random tiny drafter: the gate only runs.
  return c
