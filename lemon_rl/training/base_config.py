"""The sections every experiment config shares, with their defaults (those of the default experiment).

``get_base_config()`` returns a ``ConfigDict`` with ``seed``, ``data_dir``, ``tensorboard``, ``phases`` and the ``model``,
``mesh``, ``sft``, ``rl``, ``eval`` and ``checkpoint`` sections read by :func:`lemon_rl.training.experiment.run`.
An experiment config (``configs/*.py``) adds its ``task`` section (and any method section, e.g. ``fest``) and
overrides the values it needs; every field is documented here, once.
"""

from ml_collections import config_dict


def get_base_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.seed = 0  # Seeds the model init, data order and sampling.
  c.data_dir = ""  # Where tfds data is written; "" = <workdir>/data.
  c.tensorboard = True  # Also write TensorBoard event files under <workdir>/tb.
  # The phases run in order, each a section of this config and a builder in lemon_rl.training.phases.PHASES
  # (a phase whose `steps` is 0 is skipped); each starts from the parameters the previous one ended with.
  c.phases = ("sft", "rl")

  c.model = config_dict.ConfigDict()
  c.model.preset = "tiny"  # lemon_rl.models.config preset: d 128, 2 layers, 4 heads (2 KV), MLP 512.
  c.model.overrides = config_dict.ConfigDict()  # ModelConfig fields replacing the preset's, e.g. num_layers=4.
  c.model.axis_rules = ""  # Sharding rule set, a name in lemon_rl.models.AXIS_RULE_SETS ("" = the preset's).
  # A local Hugging Face model directory (config.json, safetensors, tokenizer.json, tokenizer_config.json,
  # generation_config.json; lemon_rl.models.hf.load_hf_policy): the policy starts from its weights, with its
  # architecture and the preset's numerics (param_dtype, dtype, remat, remat_policy, value_head; overrides and
  # axis_rules on top), and the task uses its tokenizer (every declared EOS id stops generation) instead of its
  # own. "" = a random init of the preset with the task's tokenizer.
  c.model.hf_checkpoint = ""
  # Render every prompt as one user message of the checkpoint's chat template, with the assistant header
  # (lemon_rl.text.decoding.ChatPromptTokenizer: the ids of transformers' apply_chat_template); for instruct
  # models. False = the task's prompt text as it is (base models). Needs hf_checkpoint.
  c.model.chat_template = False

  c.mesh = config_dict.ConfigDict()
  c.mesh.data = -1  # Data-parallel axis (-1 = all remaining devices).
  c.mesh.fsdp = 1  # Parameter-sharding axis.
  c.mesh.tensor = 1  # Tensor-parallel axis.

  c.sft = config_dict.ConfigDict()
  c.sft.steps = 1500  # Optimizer steps (0 skips SFT).
  c.sft.batch_size = 256  # Demonstrations per step.
  c.sft.microbatch_size = config_dict.placeholder(int)  # None = no gradient accumulation.
  c.sft.learning_rate = 2e-3  # Peak AdamW learning rate (cosine decay to 0).
  c.sft.warmup_steps = 50
  c.sft.weight_decay = 0.0
  c.sft.max_grad_norm = 1.0
  c.sft.eval_every = 500  # Held-out evaluation period in steps (0 = only at the end).

  c.rl = config_dict.ConfigDict()
  c.rl.algorithm = "grpo"  # grpo | fest_dpo | fest_grpo (the FEST ones need a `fest` section).
  c.rl.steps = 100  # RL steps (one rollout batch each; 0 skips RL).
  c.rl.prompts_per_step = 64
  c.rl.num_generations = 8  # G, completions per prompt (one group).
  c.rl.max_new_tokens = 6  # Sampling length limit (4 digits + EOS + 1 spare).
  c.rl.temperature = 1.0
  c.rl.top_k = 0  # 0 = off.
  c.rl.top_p = 1.0  # 1.0 = off.
  # Gumbel noise per (rollout row, token position) instead of per decode step: the same distribution, and
  # speculative rollouts (rl.speculative) emit the plain sampler's tokens for the same key.
  c.rl.coupled_noise = False
  c.rl.advantage_estimator = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp_baseline (lemon_rl.losses).
  c.rl.policy_loss = "ppo_clip"  # ppo_clip | gspo.
  # eps_low / eps_high / aggregation: None = the policy loss's default (lemon_rl.losses.POLICY_LOSS_DEFAULTS:
  # ppo_clip 0.2 / 0.2, token_mean; gspo 3e-4 / 4e-4, seq_mean_token_mean).
  c.rl.eps_low = config_dict.placeholder(float)  # Clip range below 1.
  c.rl.eps_high = config_dict.placeholder(float)  # Clip range above 1 (None = eps_low if set, else the default).
  c.rl.dual_clip = config_dict.placeholder(float)  # Dual-clip constant c > 1 (None = off).
  c.rl.aggregation = config_dict.placeholder(str)  # token_mean | seq_mean_token_mean | seq_mean_token_sum[_norm].
  c.rl.max_len = config_dict.placeholder(int)  # Constant of seq_mean_token_sum_norm (None = max_new_tokens).
  c.rl.kl_coef = 0.0  # KL to the frozen SFT policy (0 = no reference model is kept).
  c.rl.kl_estimator = "k3"  # k1 | k2 | k3.
  c.rl.entropy_coef = 0.0
  c.rl.use_tis = False  # Truncated importance sampling against the sampler's log-probs.
  c.rl.tis_cap = 2.0
  c.rl.num_iterations = 2  # Passes over each rollout batch (>1 exercises the clipped objective).
  c.rl.minibatch_size = 256  # Rows per optimizer update (0 = the whole rollout batch).
  c.rl.microbatch_size = 256  # Rows per gradient-accumulation slice.
  c.rl.learning_rate = 1e-4
  c.rl.lr_schedule = "constant"  # constant | cosine.
  c.rl.warmup_steps = 0
  c.rl.weight_decay = 0.0
  c.rl.max_grad_norm = 1.0
  c.rl.eval_every = 25
  # Updates only on batches with signal (lemon_rl.training.rollout). skip_zero_signal: a step whose every
  # advantage is 0 (no group has reward variance) makes no optimizer update (params, Adam moments and the
  # schedule stay as they are; needs kl_coef = entropy_coef = 0). dynamic_sampling (DAPO): drop the groups
  # whose rewards are all equal and refill the batch with further prompts from the data iterator, at most
  # dynamic_sampling_max_rounds extra batches a step; still short, the step trains on the groups it has.
  c.rl.skip_zero_signal = False
  c.rl.dynamic_sampling = False
  c.rl.dynamic_sampling_max_rounds = 3
  # Speculative rollouts (lemon_rl.training.speculative_rollouts; off by default): the shared rollout samples
  # with speculative_generate, the policy as target and a drafter kept in step with it (distilled after every
  # update, or refreshed by PPOW), checked by a refit guard, switched off for a step by a cost model when it
  # would not pay.
  c.rl.speculative = s = config_dict.ConfigDict()
  s.enabled = False
  s.drafter = "eagle"  # eagle (an EagleHead on the policy's features) | transformer (a small Transformer).
  s.feature_layers = ()  # eagle: policy blocks fused (() = EAGLE-3's default_feature_layers).
  s.drafter_preset = "tiny"  # transformer: lemon_rl.models preset (its vocabulary becomes the policy's).
  s.drafter_num_layers = 0  # transformer: blocks (0 = the preset's).
  s.num_draft = 4  # K, tokens drafted per verification.
  s.refresh = "distill"  # How the drafter follows the policy: distill (token level) | ppow (window RL, eagle).
  s.refresh_every = 1  # Refresh on every N-th step that needs one (the refresh cost is charged per step / N).
  s.distill_steps_per_rl_step = 1  # Drafter optimizer steps on each step's rollouts, after the policy update.
  s.learning_rate = 1e-3  # Drafter AdamW learning rate (constant).
  s.distill_microbatch_size = 0  # Rows per gradient-accumulation slice of a distillation step (0 = all rows).
  s.ttt_steps = 0  # eagle: unrolled drafting steps of the distillation loss (0 = num_draft).
  s.min_probe_acceptance = 0.0  # Refit guard: probe acceptance (accepted / drafted tokens) must exceed this.
  s.probe_size = 16  # Rows of the first step's rollout kept as the fixed probe batch.
  s.cost_model = True  # Switch speculation off for a step when the predicted speedup is <= min_speedup.
  s.min_speedup = 1.0
  s.acceptance_decay = 0.5  # EMA weight of the old running acceptance (the cost model's tau).
  s.seed = 0  # Drafter initialisation.
  # refresh = ppow: PPOW steps (lemon_rl.training.ppow_training) on the step's rollout sequences, the updated
  # policy as the frozen target; windows of num_draft tokens, the PPOWConfig fields of the same names.
  s.ppow = p = config_dict.ConfigDict()
  p.steps_per_refresh = 2  # PPOW updates per refresh (each collects its own windows).
  p.group_size = 4  # G_roll windows per prefix.
  p.num_prefixes = 8
  p.pool_rows = 16  # Rollout rows scored per PPOW step.
  p.verification = "expected"  # Accepted length of the reward: greedy | sampling | expected.
  p.gamma = 0.12
  p.use_dist_reward = True
  p.beta = 0.01  # KL(Q || P) weight.
  p.adaw = True

  c.eval = config_dict.ConfigDict()
  c.eval.num_examples = 500  # Held-out problems scored greedily.
  c.eval.batch_size = 500

  c.checkpoint = config_dict.ConfigDict()
  c.checkpoint.every = 100  # Steps between checkpoints (plus the last step and on SIGTERM).
  c.checkpoint.max_to_keep = 2
  c.checkpoint.async_save = True

  return c
