"""FEST: few-shot expert guidance for RLVR on multi-step chains (METHODS.md section 2).

Task ``fest_math`` (``lemon_rl.envs.multistep_math``): the starting policy is fine-tuned on worked solutions of
EASY chains (1-2 steps); RL then trains on HARD chains (4-5 steps, answers only: ``D_I``), where it starts
almost unsolved. ``D_E`` holds ``fest.num_shots`` hard problems with worked solutions ``y+``.

Variants (``--config=configs/fest_math.py:<variant>``; shots via ``--config.fest.num_shots=64|128|512``):
  ``grpo``: pure GRPO on ``D_I``, budget-matched (as many prompts per step as FEST's two streams together).
  ``sft_then_grpo``: SFT on the ``D_E`` demonstrations (``expert_sft``), then the same GRPO.
  ``fest_dpo``: ``c * L_E + L_I``, semi-online DPO on ``D_E`` pairs + GRPO on ``D_I``.
  ``fest_grpo`` (default): weighted SFT on ``y+`` + GRPO on the rollouts of both streams.
  ``tiny``: a smoke run of ``fest_grpo`` in a few seconds (tests).
"""

from ml_collections import config_dict

from lemon_rl.envs import multistep_math
from lemon_rl.training import base_config

VARIANTS = ("grpo", "sft_then_grpo", "fest_dpo", "fest_grpo", "tiny")


def get_config(variant: str = "fest_grpo") -> config_dict.ConfigDict:
  c = base_config.get_base_config()
  c.tensorboard = False

  c.fest = config_dict.ConfigDict()
  c.fest.num_shots = 128  # |D_E|: hard problems with worked solutions (64 within 128 within 512).
  c.fest.expert_prompts_per_step = 4  # B_E, D_E prompts per step (G rollouts each, paired with y+).
  c.fest.beta1 = 0.005  # Adaptive beta: all G rollouts of the prompt wrong (METHODS.md decision).
  c.fest.beta2 = 0.02  # This rollout wrong, another right.
  c.fest.beta3 = 0.1  # This rollout right.
  c.fest.c = 1.0  # Weight of L_E (FEST-DPO) / of the weighted SFT term (FEST-GRPO).
  c.fest.sft_aggregation = "seq_mean_token_sum"  # FEST-GRPO's SFT term: sequence-sum log-probs (the DPO scale).
  c.fest.num_microbatches = 1  # Gradient-accumulation slices of a FEST update (divides B_I * G and B_E).

  c.task = config_dict.ConfigDict()
  c.task.name = "fest_math"
  c.task.data_seed = 0  # Seed of the generated problems (fixed across experiment seeds).
  c.task.num_sft = 20_000  # Easy (1-2 step) worked solutions: the starting policy's SFT.
  c.task.num_train = 4_000  # D_I: hard (4-5 step) prompts with answers only.
  c.task.num_validation = 256  # Hard prompts for tuning (Task.validation_examples); never the test set.
  c.task.num_test = 256  # Held-out hard prompts.
  # Every split (easy SFT, D_I, D_E, validation, test) is disjoint by canonical chain (runs of commuting steps
  # sorted, multistep_math.canonical_key), from content buckets of 70% (easy SFT and D_I, which differ in step
  # count) / 10% (D_E) / 10% (validation) / 10% (test) of the problem space.
  c.task.num_shots = c.fest.get_ref("num_shots")  # Follows fest.num_shots.

  # Easy SFT: the starting policy (shared by all variants of a seed); fields documented in base_config.
  c.sft.steps = 500
  c.sft.batch_size = 128
  c.sft.eval_every = 0

  c.phases = ("sft", "expert_sft", "rl")
  c.expert_sft = config_dict.ConfigDict()  # SFT on the D_E demonstrations after the easy SFT (0 = skip).
  c.expert_sft.steps = 0
  c.expert_sft.batch_size = 32
  c.expert_sft.learning_rate = 1e-3
  c.expert_sft.warmup_steps = 0
  c.expert_sft.weight_decay = 0.0
  c.expert_sft.max_grad_norm = 1.0
  c.expert_sft.eval_every = 0

  c.rl.algorithm = "fest_grpo"  # grpo | fest_dpo | fest_grpo.
  c.rl.steps = 40
  c.rl.prompts_per_step = 8  # B_I (FEST); GRPO gets B_I + B_E (budget-matched).
  # The longest hard solution + one line of slack + EOS.
  c.rl.max_new_tokens = multistep_math.completion_budget(multistep_math.SPLIT_STEPS["hard_train"][1])
  c.rl.advantage_estimator = "dr_grpo"  # The paper's L_I: no std normalisation.
  c.rl.eps_high = 0.28  # Asymmetric clip (clip-higher).
  c.rl.num_iterations = 1  # Updates per rollout batch, each on the whole batch (CPU budget: 1).
  c.rl.minibatch_size = 0  # 0 = the whole rollout batch (FEST requires it).
  c.rl.microbatch_size = 64  # GRPO gradient-accumulation slice (rows); FEST uses fest.num_microbatches.
  c.rl.learning_rate = 5e-4
  c.rl.eval_every = 10

  c.eval.num_examples = 128  # Held-out hard problems: greedy during training (curves), sampled at the end.
  c.eval.batch_size = 128
  c.eval.num_samples = 8  # Final Avg@k / Pass@k (experiments/reproduce_fest.py): k samples ...
  c.eval.temperature = 1.0  # ... at this temperature ...
  c.eval.num_shifted = 128  # ... on the hard test set and this many shifted (6-7 step) problems.

  c.checkpoint.every = 1000
  c.checkpoint.max_to_keep = 1
  c.checkpoint.async_save = False

  if variant == "grpo":
    c.rl.algorithm = "grpo"
    c.rl.prompts_per_step = 12  # B_I + B_E.
    c.rl.microbatch_size = 96
  elif variant == "sft_then_grpo":
    c.rl.algorithm = "grpo"
    c.rl.prompts_per_step = 12
    c.rl.microbatch_size = 96
    c.expert_sft.steps = 100
  elif variant == "fest_dpo":
    c.rl.algorithm = "fest_dpo"
  elif variant == "fest_grpo":
    pass
  elif variant == "tiny":
    c.task.num_sft, c.task.num_train, c.task.num_validation, c.task.num_test = 512, 256, 16, 16
    c.model.overrides = config_dict.ConfigDict({"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                                "num_kv_heads": 1, "mlp_dim": 64})
    c.fest.num_shots, c.fest.expert_prompts_per_step, c.fest.num_microbatches = 8, 2, 2
    c.sft.steps, c.sft.batch_size, c.sft.warmup_steps = 4, 16, 0
    c.expert_sft.steps = 2
    c.expert_sft.batch_size = 4
    c.rl.steps, c.rl.prompts_per_step, c.rl.num_generations, c.rl.eval_every = 3, 4, 2, 0
    c.rl.microbatch_size = 8
    c.eval.num_examples, c.eval.batch_size, c.eval.num_shifted, c.eval.num_samples = 16, 16, 8, 2
    c.checkpoint.every = 2
  else:
    raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
  return c
