"""GRPO with and without speculative rollouts: the stdlib target as the policy, a Python syntax reward.

    python -m experiments.reproduce_speculative_grpo --workdir=DIR --init_from=SPEC_WORKDIR [--size=tiny]

``SPEC_WORKDIR`` is a finished ``experiments/train_speculative.py`` run: its target (8 blocks, 8.4M
parameters at the ``cpu`` size) is the starting policy, its EAGLE-3 head the starting drafter, its tokenizer
the policy's. Prompts are function heads of the standard library (``lemon_rl.envs.stdlib_code``: training
packages for RL, held-out packages for validation and test); the policy writes up to ``rl.max_new_tokens``
tokens of the body and earns 1 when the head plus its completion is valid Python so far
(``lemon_rl.rewards.python_syntax``).

Arms (the same seeds, prompts and settings; only the sampler differs). Every arm but ``residual`` samples
with coupled noise (``rl.coupled_noise``: Gumbel noise per rollout row and token position), so a speculative
rollout of a seed and step emits the plain arm's tokens whenever the policies are the same (up to float
rounding at near-ties): over training the arms must then stay identical, sample for sample.
  ``plain``: ``generate``;
  ``speculative``: ``rl.speculative`` on every step (``cost_model = False``), the drafter distilled to the
    policy after every update;
  ``cost_model``: ``rl.speculative`` with the cost model deciding each step;
  ``ppow_refresh``: ``rl.speculative`` on every step, the drafter refreshed by PPOW (window-level RL on the
    step's rollouts, the updated policy as the target) every ``ppow_refresh_every`` steps instead of distilled
    after every update;
  ``residual``: as ``speculative``, with the residual method's verification and per-step noise
    (``rl.coupled_noise = False``): its higher acceptance, and samples no longer paired with ``plain``'s.

Sizes: ``cpu`` (default) and ``tiny`` (a ``configs/stdlib_speculative.py:tiny`` workdir, for the tests).
"""

from ml_collections import config_dict

from lemon_rl.training.base_config import get_base_config

ARMS = ("plain", "speculative", "cost_model", "ppow_refresh", "residual")


def get_config(size: str = "cpu") -> config_dict.ConfigDict:
  if size not in ("cpu", "tiny"):
    raise ValueError(f"unknown size {size!r}; expected 'cpu' or 'tiny'")
  c = config_dict.ConfigDict()
  c.size = size

  c.prompts = config_dict.ConfigDict()
  # Head lengths in tokens (without the EOS that starts a document): every prompt fits one 32-token bucket,
  # so the rollout compiles one shape.
  c.prompts.min_tokens = 16
  c.prompts.max_tokens = 31
  c.prompts.min_body_lines = 3  # Lines of the function after its head (something left to write).

  c.rl = get_base_config().rl
  c.rl.update(dict(
      prompts_per_step=2, num_generations=4,  # Rollout batch 8: where speculation pays on a 2-core CPU.
      max_new_tokens=96, temperature=1.0, top_k=0, top_p=1.0,
      learning_rate=1e-4, warmup_steps=0, minibatch_size=0, microbatch_size=8, num_iterations=1,
      advantage_estimator="grpo", kl_coef=0.0, entropy_coef=0.0, steps=40,
      coupled_noise=True))  # Every arm but `residual` (see the module docstring).
  c.rl.speculative.update(dict(
      drafter="eagle", num_draft=1, distill_steps_per_rl_step=1, learning_rate=1e-4, probe_size=8,
      min_probe_acceptance=0.05, acceptance_decay=0.5))
  c.rl.speculative.ppow.update(dict(steps_per_refresh=2, group_size=4, num_prefixes=8, pool_rows=8,
                                    verification="expected"))
  c.ppow_refresh_every = 4  # The ppow_refresh arm's rl.speculative.refresh_every.
  c.prompt_len = 32  # Prompt slots of the training sequences (the heads' bucket).
  # Complete lines a completion needs to earn the reward (lemon_rl.rewards.python_syntax): without it a head
  # ending with its docstring compiles on its own and the policy learns to stop right after it.
  c.reward_min_lines = 4

  c.eval = config_dict.ConfigDict()
  c.eval.samples_per_prompt = 4  # At temperature 1 (plus one greedy completion per prompt).
  c.eval.max_prompts = 0  # 0 = every test prompt.

  # Step-0 headroom (lemon_rl.eval.headroom), fixed before the run, from the first plain step: the reward
  # must vary within groups (GRPO has something to learn) and leave room above; the start drafter's
  # acceptance on the probe must leave speculation something to gain.
  c.headroom = config_dict.ConfigDict()
  c.headroom.thresholds = config_dict.ConfigDict({
      "min_signal_group_share": 0.25, "max_reward_mean": 0.9, "min_start_probe_acceptance": 0.2})
  c.headroom.reward_atol = 1e-6

  # Equivalence (two one-sided tests, lemon_rl.eval.stats.holm_equivalence): the final test reward at
  # temperature 1 and greedy validity of each speculative arm against plain, paired by seed, are
  # equivalent iff the Holm-corrected interval of the difference lies inside (-margin, +margin).
  c.margin = 0.05
  c.family_alpha = 0.05

  if size == "tiny":
    c.prompts.update(min_tokens=8, max_tokens=63)  # The tiny run's 512-id tokenizer: longer heads.
    c.rl.update(max_new_tokens=16, steps=3)
    c.rl.speculative.ppow.update(steps_per_refresh=1, num_prefixes=4, pool_rows=4)
    c.ppow_refresh_every = 2
    c.rl.speculative.update(num_draft=2, learning_rate=1e-3, min_probe_acceptance=0.0)
    c.prompt_len = 64
    c.reward_min_lines = 1
    c.eval.update(samples_per_prompt=2, max_prompts=8)
    c.headroom.thresholds.update(min_signal_group_share=0.0, max_reward_mean=1.0,
                                 min_start_probe_acceptance=0.0)  # An untrained tiny policy: the gate only runs.
  return c
