"""The default experiment: SFT on a sloppy teacher, then GRPO with an exact-answer verifier.

Task: ``"aaa+bbb="`` / ``"aa*bb="`` with 4-digit zero-padded answers (``lemon_rl.envs.arithmetic``). The
SFT demonstrations give the carry-less answer half of the time, so SFT alone plateaus; GRPO with a 0/1
verifier removes the carry-less answers (see ``shared/DESIGN.md``, feasibility run). Over five seeds with
content-disjoint splits its accuracy gain over the SFT start and over FLOP-matched more SFT is not
distinguishable from zero (``experiments/RESULTS.md``, "GRPO arithmetic").

Variants (``--config=configs/grpo_arithmetic.py:<variant>``):
  ``cpu`` (default): the README's main job, one seed in a few minutes on a 2-core CPU.
  ``tiny``: a smoke run of a few steps for tests.
  ``gpu``: a larger model and batch for an accelerator.
  ``sft_control``: the ``cpu`` run with its GRPO phase replaced by more SFT of the same compute in FLOPs
    (``continued_sft``, :func:`flop_matched_sft_steps`), from the same SFT policy and with GRPO's optimizer
    settings, so the only difference is the objective and data (``experiments.reproduce_grpo_arithmetic``).
  ``tiny_sft_control``: the same control for the ``tiny`` run.
"""

from ml_collections import config_dict

from lemon_rl.envs import arithmetic
from lemon_rl.models import get_preset
from lemon_rl.models import flops
from lemon_rl.text.tokenizers import ByteTokenizer
from lemon_rl.training import base_config

PROMPT_LEN = 1 + len("999+999=")  # BOS + the longest prompt (the task's prompt_len).


def step_flops(c: config_dict.ConfigDict) -> dict[str, float]:
  """Analytic FLOPs of one ``sft`` and one ``rl`` step of ``c`` (``lemon_rl.models.flops``, padded shapes).

  A GRPO step samples and trains ``prompts_per_step * num_generations`` sequences of ``PROMPT_LEN +
  max_new_tokens`` slots (one sampling forward, one scoring forward for the old log-probs when
  ``num_iterations > 1`` and one for the reference when ``kl_coef > 0``, ``num_iterations`` forward + backward
  passes); an SFT step trains ``batch_size`` sequences of ``PROMPT_LEN + ANSWER_WIDTH + 1`` slots.
  """
  model = get_preset(c.model.preset, **{"vocab_size": ByteTokenizer().vocab_size, **dict(c.model.overrides)})
  rows = c.rl.prompts_per_step * c.rl.num_generations
  scoring = int(c.rl.num_iterations > 1) + int(c.rl.kl_coef > 0)
  return {"rl": flops.rl_step_flops(model, rows, PROMPT_LEN + c.rl.max_new_tokens,
                                    update_passes=c.rl.num_iterations, scoring_passes=scoring),
          "sft": flops.train_flops(model, c.sft.batch_size, PROMPT_LEN + arithmetic.ANSWER_WIDTH + 1)}


def flop_matched_sft_steps(c: config_dict.ConfigDict) -> int:
  """SFT steps (of ``c.sft``'s batch) whose FLOPs equal those of ``c.rl.steps`` GRPO steps, rounded."""
  per_step = step_flops(c)
  return round(c.rl.steps * per_step["rl"] / per_step["sft"])


def _as_sft_control(c: config_dict.ConfigDict) -> config_dict.ConfigDict:
  c.phases = ("sft", "continued_sft")
  c.continued_sft = config_dict.ConfigDict({
      "steps": flop_matched_sft_steps(c), "batch_size": c.sft.batch_size, "microbatch_size": c.sft.microbatch_size,
      "learning_rate": c.rl.learning_rate, "lr_schedule": c.rl.lr_schedule, "warmup_steps": c.rl.warmup_steps,
      "weight_decay": c.rl.weight_decay, "max_grad_norm": c.rl.max_grad_norm, "eval_every": c.rl.eval_every})
  return c


def get_config(variant: str = "cpu") -> config_dict.ConfigDict:
  c = base_config.get_base_config()

  c.task = config_dict.ConfigDict()
  c.task.name = "arithmetic"  # A name registered in lemon_rl.envs.tasks.TASKS.
  c.task.data_seed = 0  # Seed of the generated problems (fixed across experiment seeds).
  c.task.num_train = 20_000  # RL prompts.
  c.task.num_sft = 100_000  # Sloppy-teacher demonstrations.
  c.task.num_validation = 500  # Distinct problems for tuning (Task.validation_examples); never the test set.
  c.task.num_test = 500  # Held-out problems.
  # Splits are disjoint by canonical problem (a+b = b+a, arithmetic.canonical_key), from content buckets of
  # 60% (SFT) / 20% (RL) / 10% (validation) / 10% (test) of the problem space.
  c.task.p_sloppy = 0.5  # Probability that a demonstration is the carry-less answer.
  c.task.mul_fraction = 0.5  # Share of multiplication problems.

  if variant.endswith("sft_control"):
    return _as_sft_control(get_config(variant.removesuffix("sft_control").removesuffix("_") or "cpu"))
  if variant == "cpu":
    pass
  elif variant == "tiny":
    c.model.overrides = config_dict.ConfigDict({"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                                "num_kv_heads": 1, "mlp_dim": 64})  # Few-second compiles.
    c.task.num_train, c.task.num_sft, c.task.num_validation, c.task.num_test = 512, 2048, 64, 64
    c.sft.steps, c.sft.batch_size, c.sft.eval_every = 6, 32, 0
    c.rl.steps, c.rl.prompts_per_step, c.rl.num_generations = 4, 8, 4
    c.rl.minibatch_size, c.rl.microbatch_size, c.rl.eval_every = 16, 8, 2
    c.eval.num_examples, c.eval.batch_size = 64, 64
    c.checkpoint.every = 2
  elif variant == "gpu":
    c.model.overrides = config_dict.ConfigDict({"hidden_size": 512, "num_layers": 8, "num_heads": 8,
                                                "num_kv_heads": 4, "mlp_dim": 2048})
    c.sft.batch_size, c.rl.prompts_per_step = 1024, 256
    c.rl.minibatch_size = c.rl.microbatch_size = 1024
  else:
    raise ValueError(f"unknown variant {variant!r}; expected cpu, tiny, gpu, sft_control or tiny_sft_control")
  return c
