"""BudgetMix on text FrozenLake: multi-turn SFT on a noisy expert, then multi-turn RL (METHODS.md section 5).

    python -m experiments.main --config=configs/budgetmix_frozenlake.py:cpu --workdir=runs/budgetmix \\
        [--config.multiturn_rl.estimator=gigpo --config.multiturn_rl.budget_mode=full ...]

Phases: ``multiturn_sft`` (noisy-expert demonstrations, the engine's token layout) then ``multiturn_rl``
(:mod:`lemon_rl.training.multiturn_phases`). The RL arm is chosen by ``multiturn_rl.estimator``
(``grpo`` | ``gigpo`` | ``ppo``), ``multiturn_rl.budget_mode`` (``full``: every group plays at ``T_max``;
``budgetmix``: a budget per group drawn from ``{floor(k T_max / 10)}``) and ``multiturn_rl.budget_in_anchor``
(GiGPO's step groups keyed by ``(cell, B - t)`` rather than the cell). ``experiments.reproduce_budgetmix`` runs
the arms per seed from one shared SFT and adds the headroom gate (``headroom``) and the final evaluation
(``final_eval``) on test maps.

Variants (``--config=configs/budgetmix_frozenlake.py:<variant>``):
  ``cpu`` (default): the sizing recommended by the pilot recorded in ``experiments/reproduce_budgetmix.py``.
  ``tiny``: a smoke run (SFT a few steps, RL 2 steps) for tests.

Decisions (named here and in the modules that implement them):
- the tokenizer has one id per move and per budget tag (``lemon_rl.envs.frozenlake_task``): an action is a move
  token and EOS; ``episode.max_action_tokens = 4`` still lets a policy write bytes, which then end as malformed.
- demonstrations are played at the full budget ``T_max`` with the budget shown (the SFT policy never saw a
  tight budget); ``task.detour_prob`` sets how often the expert detours (and so how much recovery it shows).
- ``model.overrides.value_head = True`` in every arm: the head is zero-initialised and gets no gradient outside
  PPO, and one SFT checkpoint then restores into every arm, PPO included.
- the evaluation temperature is 1 (the sampling distribution RL trains): Pass@k needs diverse samples.
- the headroom gate (``headroom.thresholds``) is fixed here before any run: the base policy's Pass@8 on
  validation maps at every budget fraction must be in [0.05, 0.95].
- recovery is measured at 50% of ``T_max`` (``final_eval.recovery_fraction``): 25% is the shortest path
  itself, from which an injected detour cannot be recovered.
"""

from ml_collections import config_dict

from lemon_rl.training import base_config
from lemon_rl.training import multiturn_phases  # noqa: F401  pylint: disable=unused-import  (registers the phases)

FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def get_config(variant: str = "cpu") -> config_dict.ConfigDict:
  c = base_config.get_base_config()
  del c.sft, c.rl  # The single-turn sections; this experiment's phases have their own.
  c.phases = ("multiturn_sft", "multiturn_rl")
  # Every arm has the value head (module docstring), so one SFT checkpoint restores into each.
  c.model.overrides = config_dict.ConfigDict({"value_head": True})

  c.task = config_dict.ConfigDict()
  c.task.name = "frozenlake"  # lemon_rl.envs.frozenlake_task, registered in lemon_rl.envs.tasks.TASKS.
  c.task.data_seed = 0  # Maps and demonstrations are a pure function of it (fixed across experiment seeds).
  c.task.sizes = (4, 5, 6)  # Side lengths of the training, validation and test maps (test_8x8 is 8x8).
  c.task.num_sft = 1000  # Demonstrations, one per map; SFT maps are disjoint from the RL maps.
  c.task.num_train = 500  # RL maps.
  c.task.num_validation = 64  # Validation maps (evaluation during training, headroom gate, any tuning).
  c.task.num_test = 32  # Held-out maps of the training sizes (final evaluation only).
  c.task.num_test_8x8 = 16  # Held-out 8x8 maps (final evaluation only).
  c.task.detour_prob = 0.2  # The noisy expert's per-turn detour probability.
  c.task.slippery = False
  c.task.t_max_multiple = 4.0  # T_max = ceil(4 * shortest path): 25% of T_max is the shortest path.
  c.task.show_budget = True  # [MAX TURNS] / [CURRENT TURN] / [REMAINING TURNS] in prompt and observations.

  c.episode = config_dict.ConfigDict()  # The engine's limits, shared by training and evaluation.
  c.episode.max_action_tokens = 4  # A move token + EOS, with room for a malformed longer action.
  c.episode.num_slots = 2048  # Context of an episode (a 56-turn 8x8 episode is ~1.6k tokens).
  c.episode.batch_size = 0  # KV-cache rows (0 = every episode of a call at once).
  c.episode.chunk_size = 64
  c.episode.invalid_action_reward = -1.0  # A malformed action ends the episode with this reward.

  c.multiturn_sft = config_dict.ConfigDict()
  c.multiturn_sft.steps = 120  # The pilot's SFT (experiments/reproduce_budgetmix.py): it passes the gate.
  c.multiturn_sft.batch_size = 16
  c.multiturn_sft.microbatch_size = config_dict.placeholder(int)
  c.multiturn_sft.learning_rate = 2e-3
  c.multiturn_sft.lr_schedule = "cosine"
  c.multiturn_sft.warmup_steps = 10
  c.multiturn_sft.weight_decay = 0.0
  c.multiturn_sft.max_grad_norm = 1.0
  c.multiturn_sft.length_multiple = 128  # Demonstrations are padded to a multiple of this (few compiled shapes).
  c.multiturn_sft.eval_every = 0  # Only at the end (validation maps).

  c.multiturn_rl = rl = config_dict.ConfigDict()
  rl.steps = 60
  rl.maps_per_step = 8  # Groups per step (P).
  rl.group_size = 8  # Episodes per group (G), all at the group's budget.
  rl.estimator = "grpo"  # grpo | gigpo | ppo (lemon_rl.training.multiturn_rl).
  rl.budget_mode = "budgetmix"  # budgetmix | full (lemon_rl.training.budgetmix).
  rl.budget_in_anchor = True  # GiGPO anchor key (s_t, B - t) (BudgetMix) instead of s_t.
  rl.scale_by_std = True  # Divide group deviations by the std (GRPO; GiGPO's F_norm).
  rl.gigpo_gamma = 0.95  # GiGPO step-return discount.
  rl.omega = 1.0  # GiGPO step-advantage weight.
  rl.gae_gamma = 1.0  # PPO's GAE (verl defaults).
  rl.gae_lambda = 1.0
  rl.whiten_advantages = True
  rl.value_coef = 0.5
  rl.value_clip = 0.5
  rl.temperature = 1.0
  rl.top_k = 0
  rl.top_p = 1.0
  rl.coupled_noise = False  # Episodes draw independent noise (the multi-turn engine has no coupled sampling).
  rl.policy_loss = "ppo_clip"
  rl.eps_low = config_dict.placeholder(float)
  rl.eps_high = config_dict.placeholder(float)
  rl.dual_clip = config_dict.placeholder(float)
  rl.aggregation = config_dict.placeholder(str)
  rl.max_len = config_dict.placeholder(int)  # seq_mean_token_sum_norm constant (None = episode.num_slots).
  rl.kl_coef = 0.0
  rl.kl_estimator = "k3"
  rl.entropy_coef = 0.0
  rl.use_tis = False
  rl.tis_cap = 2.0
  rl.num_iterations = 2  # Updates per rollout batch (the second one exercises the clip).
  rl.num_microbatches = 1
  rl.length_multiple = 128  # Training sequences are padded to a multiple of this.
  rl.learning_rate = 1e-4  # The library's RL default (not tuned; the same for every arm).
  rl.lr_schedule = "constant"
  rl.warmup_steps = 0
  rl.weight_decay = 0.0
  rl.max_grad_norm = 1.0
  rl.eval_every = 20

  # Held-out evaluation during training (validation maps, prompted budgets).
  c.eval.num_examples = 32  # Validation maps.
  c.eval.batch_size = 128  # KV-cache rows of the evaluation runs (episodes beyond it refill finished rows).
  c.eval.num_samples = 4  # Episodes per map and budget.
  c.eval.fractions = (0.25, 1.0)
  c.eval.temperature = 1.0
  c.eval.seed = 0

  # Step-0 gate of experiments.reproduce_budgetmix (base policy, validation maps), fixed before any run.
  c.headroom = config_dict.ConfigDict()
  c.headroom.num_maps = 32
  c.headroom.num_samples = 8  # n = K: Pass@8 of a map is whether any of its 8 episodes succeeded.
  c.headroom.max_k = 8
  c.headroom.fractions = FRACTIONS
  c.headroom.seed = 1
  c.headroom.thresholds = config_dict.ConfigDict(
      {f"{bound}_pass_at_8_{int(100 * f)}": value for f in FRACTIONS
       for bound, value in (("min", 0.05), ("max", 0.95))})

  # Final evaluation of experiments.reproduce_budgetmix (test maps).
  c.final_eval = config_dict.ConfigDict()
  c.final_eval.splits = ("test", "test_8x8")
  c.final_eval.num_samples = 16
  c.final_eval.max_k = 8
  c.final_eval.fractions = FRACTIONS
  c.final_eval.recovery_fraction = 0.5
  c.final_eval.temperature = 1.0
  c.final_eval.seed = 2

  c.checkpoint.every = 20

  if variant == "cpu":
    pass
  elif variant == "tiny":
    c.model.overrides = config_dict.ConfigDict({"value_head": True, "hidden_size": 32, "num_layers": 1,
                                                "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 64})
    c.task.sizes = (4,)
    c.task.num_sft, c.task.num_train, c.task.num_validation = 16, 8, 4
    c.task.num_test, c.task.num_test_8x8 = 4, 2
    c.episode.num_slots = 1024
    c.multiturn_sft.steps, c.multiturn_sft.batch_size, c.multiturn_sft.eval_every = 3, 4, 0
    c.multiturn_sft.warmup_steps = 1
    c.multiturn_sft.length_multiple = 1024  # One compiled shape.
    rl.steps, rl.maps_per_step, rl.group_size, rl.eval_every = 2, 2, 2, 1
    c.eval.num_examples, c.eval.num_samples = 2, 2
    c.headroom.num_maps, c.headroom.num_samples, c.headroom.max_k = 4, 2, 2
    c.headroom.thresholds = config_dict.ConfigDict({"min_pass_at_2_100": 0.0, "max_pass_at_2_100": 1.0})
    c.final_eval.num_samples, c.final_eval.max_k = 2, 2
    c.checkpoint.every = 1
  else:
    raise ValueError(f"unknown variant {variant!r}; expected cpu or tiny")
  return c
