"""FEST: few-shot expert guidance for RLVR on a procedure the starting policy never saw (METHODS.md section 2).

Task ``fest_math`` (``lemon_rl.envs.multistep_math``): the starting policy is fine-tuned on worked solutions of
chains of 1-2 steps read left to right (rule ``"="``); RL then trains on chains of 2 steps under rule ``"?"``
(apply the written operations right to left; ``D_I``, answers only), every one order-sensitive, so the start
solves almost none. ``D_E`` holds ``fest.num_shots`` ``"?"`` problems with worked solutions ``y+``.

Variants (``--config=configs/fest_math.py:<variant>``; shots via ``--config.fest.num_shots=64|128|512``), the
six arms of ``experiments/reproduce_fest.py``:
  ``grpo``: pure GRPO on ``D_I``, budget-matched (as many prompts per step as FEST's two streams together).
  ``mixed_sft_grpo``: SFT on the shots mixed with easy demonstrations (a quarter expert rows), then GRPO.
  ``shots_sft_grpo``: multi-epoch SFT on the shots alone (25 epochs), then the same GRPO.
  ``fest_dpo``: ``c * L_E + L_I``, semi-online DPO on ``D_E`` pairs + GRPO on ``D_I``.
  ``fest_grpo`` (default): weighted SFT on ``y+`` + GRPO on the rollouts of both streams.
  ``fest_grpo_fixed_w``: FEST-GRPO with the SFT weight held at ``beta / 2`` (no decay).
  ``<arm>,tiny``: that arm at smoke-test size, a few seconds (tests); ``tiny`` alone is ``fest_grpo,tiny``
    with two expert-SFT steps, so that every phase runs.

*Decision* (METHODS.md section 2, revised betas): ``beta1 >= beta2 >= beta3``, so an unsolved group's pairs
weigh at least as much as a partly solved group's and those at least as much as a correct rollout's, with
``beta1`` set so that ``beta1 * z`` reaches order 1 as the expert becomes likely, ``z = r+ - r-`` the
sequence log-ratio margin. BETA_PILOT records the pilot that measured ``z`` on this task.
"""

from ml_collections import config_dict

from lemon_rl.envs import multistep_math
from lemon_rl.training import base_config

VARIANTS = ("grpo", "mixed_sft_grpo", "shots_sft_grpo", "fest_dpo", "fest_grpo", "fest_grpo_fixed_w", "tiny")
ARMS = VARIANTS[:-1]  # The comparison of experiments/reproduce_fest.py.

# The pilot that set the betas (seed 0, this task, before any comparison was run): FEST-GRPO from the easy-SFT
# start, all three betas 0.1, RL learning rate 5e-4, 64 steps; scored on the validation split only.
BETA_PILOT = {
    "mean_margin_z_per_step": {"min": -18.8, "max": 7.0, "mean": -5.9},  # z = r+ - r- (nats), pair means.
    "decaying_weight_mean_q10_q90": [0.028, 0.088],  # Per-pair w = beta sigmoid(-beta z): |beta z| ~ 1-3.
    "expert_nll_per_token": {"step_1": 2.60, "last_8_steps": 0.34},  # y+ becomes likely.
}


def get_config(variant: str = "fest_grpo") -> config_dict.ConfigDict:
  arm, _, size = variant.partition(",")
  if arm == "tiny" and not size:
    arm, size = "fest_grpo", "tiny"
  if arm not in ARMS or size not in ("", "tiny"):
    raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}, or '<arm>,tiny'")
  c = base_config.get_base_config()
  c.tensorboard = False

  c.fest = config_dict.ConfigDict()
  c.fest.num_shots = 128  # |D_E|: hard problems with worked solutions (64 within 128 within 512).
  c.fest.expert_prompts_per_step = 4  # B_E, D_E prompts per step (G rollouts each, paired with y+).
  # Adaptive beta (METHODS.md decision, BETA_PILOT): per-pair margins |z| of about 10-35 nats, so beta1 = 0.1
  # puts beta1 * z at order 1; beta1 >= beta2 >= beta3 (halving) weighs unsolved groups most.
  c.fest.beta1 = 0.1  # All G rollouts of the prompt wrong.
  c.fest.beta2 = 0.05  # This rollout wrong, another right.
  c.fest.beta3 = 0.025  # This rollout right.
  c.fest.c = 1.0  # Weight of L_E (FEST-DPO) / of the weighted SFT term (FEST-GRPO).
  c.fest.fixed_weight = False  # FEST-GRPO ablation: hold the SFT weight w at beta / 2 (no decay).
  c.fest.sft_aggregation = "seq_mean_token_sum"  # FEST-GRPO's SFT term: sequence-sum log-probs (the DPO scale).
  c.fest.num_microbatches = 1  # Gradient-accumulation slices of a FEST update (divides B_I * G and B_E).

  c.task = config_dict.ConfigDict()
  c.task.name = "fest_math"
  c.task.data_seed = 0  # Seed of the generated problems (fixed across experiment seeds).
  c.task.num_sft = 20_000  # Easy worked solutions (1-2 steps, rule "="): the starting policy's SFT.
  c.task.num_train = 4_000  # D_I: hard prompts (2 steps, rule "?") with answers only.
  c.task.num_validation = 128  # Hard prompts for tuning (Task.validation_examples); never the test set.
  c.task.num_test = 128  # Held-out hard prompts (of 269 distinct 2-step computations in the test bucket).
  # Every split (easy SFT, D_I, D_E, validation, test) is disjoint by computation (steps in application order,
  # runs of commuting steps sorted, multistep_math.canonical_key), from content buckets of 50% (easy SFT) /
  # 20% (D_I) / 10% (D_E) / 10% (validation) / 10% (test) of the problem space.
  c.task.num_shots = c.fest.get_ref("num_shots")  # Follows fest.num_shots.

  # Easy SFT: the starting policy (shared by all variants of a seed); fields documented in base_config.
  c.sft.steps = 500
  c.sft.batch_size = 128
  c.sft.eval_every = 0

  c.phases = ("sft", "expert_sft", "rl")
  c.expert_sft = config_dict.ConfigDict()  # SFT on the D_E demonstrations after the easy SFT (0 = skip).
  c.expert_sft.steps = 0
  c.expert_sft.batch_size = 32
  c.expert_sft.easy_per_shot = 0  # Easy demonstrations mixed in per shot (0 = the shots alone).
  c.expert_sft.learning_rate = 1e-3
  c.expert_sft.warmup_steps = 0
  c.expert_sft.weight_decay = 0.0
  c.expert_sft.max_grad_norm = 1.0
  c.expert_sft.eval_every = 0

  c.rl.algorithm = "fest_grpo"  # grpo | fest_dpo | fest_grpo.
  c.rl.steps = 64  # With B_E = 4 every one of 128 shots is drawn twice.
  c.rl.prompts_per_step = 8  # B_I (FEST); GRPO gets B_I + B_E (budget-matched).
  # The longest hard solution + one line of slack + EOS.
  c.rl.max_new_tokens = multistep_math.completion_budget(multistep_math.SPLIT_STEPS["hard_train"][1])
  c.rl.advantage_estimator = "dr_grpo"  # The paper's L_I: no std normalisation.
  c.rl.eps_high = 0.28  # Asymmetric clip (clip-higher).
  c.rl.num_iterations = 1  # Updates per rollout batch, each on the whole batch (CPU budget: 1).
  c.rl.minibatch_size = 0  # 0 = the whole rollout batch (FEST requires it).
  c.rl.microbatch_size = 64  # GRPO gradient-accumulation slice (rows); FEST uses fest.num_microbatches.
  c.rl.learning_rate = 5e-4
  c.rl.eval_every = 16  # Greedy hard-test accuracy (the curves; never used for a choice).

  c.eval.num_examples = 128  # Held-out hard problems: greedy during training (curves), sampled at the end.
  c.eval.batch_size = 128
  c.eval.num_samples = 8  # Final Avg@k / Pass@k (experiments/reproduce_fest.py): k samples ...
  c.eval.temperature = 1.0  # ... at this temperature ...
  c.eval.num_shifted = 128  # ... on the hard test set and this many shifted (3-step) problems.

  # Step-0 headroom gate of experiments/reproduce_fest.py (the first seed's start, validation split): the hard
  # set starts nearly unsolved (FEST's regime) and the lines the procedure composes are mastered.
  c.headroom = config_dict.ConfigDict({"thresholds": {"max_hard_validation_pass_at_k": 0.2,
                                                      "min_hard_validation_all_wrong": 0.7,
                                                      "min_easy_accuracy": 0.8}})

  c.checkpoint.every = 1000
  c.checkpoint.max_to_keep = 1
  c.checkpoint.async_save = False

  if arm in ("grpo", "mixed_sft_grpo", "shots_sft_grpo"):
    c.rl.algorithm = "grpo"
    c.rl.prompts_per_step = 12  # B_I + B_E.
    c.rl.microbatch_size = 96
  if arm == "mixed_sft_grpo":
    c.expert_sft.steps = 200  # 6,400 rows, a quarter of them expert: each shot about 12 times.
    c.expert_sft.easy_per_shot = 3
  elif arm == "shots_sft_grpo":
    c.expert_sft.steps = 100  # 3,200 rows: 25 epochs of 128 shots.
  elif arm == "fest_dpo":
    c.rl.algorithm = "fest_dpo"
  elif arm == "fest_grpo_fixed_w":
    c.fest.fixed_weight = True
  if size == "tiny":
    _shrink(c, expert_sft_steps=2 if variant == "tiny" or c.expert_sft.steps else 0)
  return c


def _shrink(c: config_dict.ConfigDict, expert_sft_steps: int) -> None:
  """Smoke-test sizes: a 1-block d-32 model, a few steps of each phase, a gate every start passes."""
  c.task.num_sft, c.task.num_train, c.task.num_validation, c.task.num_test = 512, 256, 16, 16
  c.model.overrides = config_dict.ConfigDict({"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                              "num_kv_heads": 1, "mlp_dim": 64})
  c.fest.num_shots, c.fest.expert_prompts_per_step, c.fest.num_microbatches = 8, 2, 2
  c.sft.steps, c.sft.batch_size, c.sft.warmup_steps = 4, 16, 0
  c.expert_sft.steps = expert_sft_steps
  c.expert_sft.batch_size = 4
  c.rl.steps, c.rl.prompts_per_step, c.rl.num_generations, c.rl.eval_every = 3, 4, 2, 0
  c.rl.microbatch_size = 8
  c.eval.num_examples, c.eval.batch_size, c.eval.num_shifted, c.eval.num_samples = 16, 16, 8, 2
  c.headroom.thresholds = {"max_hard_validation_pass_at_k": 1.0, "min_hard_validation_all_wrong": 0.0,
                           "min_easy_accuracy": 0.0}
  c.checkpoint.every = 2
