r"""GRPO on GSM8K from a Qwen2.5 Instruct checkpoint, rewarded by math-verify (issue 15).

    python -m experiments.main --config=configs/grpo_gsm8k.py:qwen2.5-0.5b --workdir=runs/gsm8k_0.5b \
        --config.model.hf_checkpoint=/models/Qwen2.5-0.5B-Instruct \
        --config.task.files=/data/gsm8k/train.jsonl --config.task.test_files=/data/gsm8k/test.jsonl

CPU end to end (a tiny random checkpoint and the test fixtures, about a minute)::

    python -m experiments.make_tiny_checkpoint --out=/tmp/tiny_qwen && python -m experiments.main \
        --config=configs/grpo_gsm8k.py:tiny --config.model.hf_checkpoint=/tmp/tiny_qwen --workdir=/tmp/gsm8k_tiny

Model (``model.hf_checkpoint``, a local Hugging Face directory; nothing is downloaded): weights, tokenizer,
every EOS id of ``generation_config.json`` and the chat template; each GSM8K prompt
(``lemon_rl.envs.math_data.PROMPTS["gsm8k"]``: the question, then "Solve step by step, then write the final
answer after "#### "") is one user message of that template (``model.chat_template``; set it False for a base
model). The preset gives the numerics: ``qwen2.5-*-mixed`` keep float32 master weights and Adam moments, compute
in bfloat16 with float32 logits and loss, and rematerialise every block (``lemon_rl.models.config``); its shapes
equal the public ``config.json`` of Qwen2.5-0.5B/1.5B(-Instruct), which the checkpoint's own config.json gives.

Data (``task``, ``lemon_rl.envs.math_task``): GSM8K's public jsonl files (``{"question", "answer"}``; parquet or
``save_to_disk`` folders with ``datasets``). ``test_files`` (GSM8K's 1,319 test problems) is the held-out set
(greedy accuracy every ``rl.eval_every`` steps); of ``files``, 98% of the content-key space are RL prompts and 2%
validation (for tuning). SFT is off: Instruct models start RL directly, as the recipes below do.

Hyper-parameters: the public GRPO-on-GSM8K recipes for Qwen2.5-0.5B/1.5B-Instruct. verl's GSM8K GRPO examples
(``examples/grpo_trainer``; its Qwen2.5-0.5B-Instruct CI config): actor lr 1e-6, prompts up to 512 tokens and
responses of 512-1024, PPO clip 0.2, token-mean loss, ``ppo_mini_batch_size`` 256, KL loss 0.001 (k3). TRL's
``GRPOConfig`` defaults: lr 1e-6, G = 8, temperature 1, clip 0.2, KL beta 0. Here: lr 1e-6 constant, G = 8,
temperature 1 without top-k / top-p, 512 new tokens, clip 0.2, token-mean loss, one pass over each rollout batch
in mini-batches of 256 rows, KL 0 (TRL; no reference model is kept: ``--config.rl.kl_coef=0.001`` gives verl's
k3 penalty at the memory of a frozen copy), grad-norm clip 1.0, no weight decay.

Variants (``--config=configs/grpo_gsm8k.py:<variant>``):
  ``qwen2.5-0.5b`` (default), ``qwen2.5-1.5b``: one accelerator (mesh 1 x 1 x 1, which fails on a host with
    more devices: use the ``,tpu`` form there). 64 prompts x 8 = 512 rollouts per step (two updates), 400 steps
    (3.4 epochs of GSM8K's 7,473 training problems), gradient accumulation over 8-row slices (the float32
    ``[8, T, 151936]`` logits and their gradient are ~10 GB at T = 1,024).
  ``qwen2.5-0.5b,tpu``, ``qwen2.5-1.5b,tpu``: a TPU slice (or several GPUs), every device on the ``fsdp`` axis
    with the ``fsdp`` rule set (``lemon_rl.models.sharding.AXIS_RULE_SETS``: parameters and Adam moments split
    along ``embed``, batch over all devices). 128 prompts x 8 = 1,024 rollouts per step (four updates), 200
    steps; 32-row accumulation slices (a multiple of the device count: up to 32 devices).
  ``tiny``: the CPU smoke run above (preset ``tiny``'s float32 numerics, GSM8K fixtures of the tests, 3 GRPO
    steps of 2 prompts x 4, 16 new tokens).

LoRA (``lemon_rl.models.lora``) is not an option here: the phases train full parameters and the RL trainer has
no adapter path yet (it would sample from ``lora.merge`` and update with ``lora.lora_update_step``).
"""

import os

from ml_collections import config_dict

from lemon_rl.envs import math_task
from lemon_rl.training import base_config

MODELS = {"qwen2.5-0.5b": "qwen2.5-0.5b-mixed", "qwen2.5-1.5b": "qwen2.5-1.5b-mixed"}
SHARDINGS = ("", "tpu")  # "" = one accelerator.
VARIANTS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-0.5b,tpu", "qwen2.5-1.5b,tpu", "tiny")
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "math")


def use_accelerator(c: config_dict.ConfigDict, model: str, sharding: str) -> None:
  """The numerics and layout of an accelerator variant ``<model>[,tpu]``: the ``qwen2.5-*-mixed`` preset, the
  ``fsdp`` rule set, and a 1 x 1 x 1 mesh (one accelerator) or every device on ``fsdp`` (``tpu``)."""
  c.model.preset = MODELS[model]
  c.model.axis_rules = "fsdp"
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = (1, -1, 1) if sharding == "tpu" else (1, 1, 1)


def get_config(variant: str = "qwen2.5-0.5b") -> config_dict.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
  model, _, sharding = variant.partition(",")
  c = base_config.get_base_config()
  c.phases = ("sft", "rl")
  c.sft.steps = 0  # Instruct checkpoints start RL directly.

  c.task = math_task.default_config("gsm8k")  # Fields documented in lemon_rl.envs.math_task.
  c.task.validation_fraction = 0.02
  c.task.train_fraction = 0.98  # The rest of the key space (none) would be SFT demonstrations.
  c.task.max_new_tokens = 512  # Held-out generation budget (greedy).
  c.task.max_completion_len = 512

  c.model.hf_checkpoint = ""  # Required: --config.model.hf_checkpoint=/path/to/Qwen2.5-...-Instruct.
  c.model.chat_template = True

  c.rl.algorithm = "grpo"
  c.rl.num_generations = 8
  c.rl.max_new_tokens = 512
  c.rl.temperature = 1.0
  c.rl.advantage_estimator = "grpo"
  c.rl.policy_loss = "ppo_clip"  # eps 0.2 / 0.2, token_mean (lemon_rl.losses defaults).
  c.rl.kl_coef = 0.0
  c.rl.num_iterations = 1
  c.rl.minibatch_size = 256
  c.rl.learning_rate = 1e-6
  c.rl.lr_schedule = "constant"
  c.rl.warmup_steps = 0
  c.rl.weight_decay = 0.0
  c.rl.max_grad_norm = 1.0
  c.rl.eval_every = 25

  c.eval.num_examples = 1319  # GSM8K's whole test set.
  c.eval.batch_size = 256
  c.checkpoint.every = 25
  c.checkpoint.max_to_keep = 2

  if model == "tiny":
    c.tensorboard = False
    c.model.preset = "tiny"  # float32 numerics; the shapes are the checkpoint's.
    c.task.files = os.path.join(FIXTURES, "gsm8k_train.jsonl")
    c.task.test_files = os.path.join(FIXTURES, "gsm8k_test.jsonl")
    c.task.validation_fraction, c.task.train_fraction = 0.2, 0.6
    c.task.max_new_tokens = c.task.max_completion_len = 16
    c.rl.steps, c.rl.prompts_per_step, c.rl.num_generations, c.rl.max_new_tokens = 3, 2, 4, 16
    c.rl.minibatch_size, c.rl.microbatch_size, c.rl.eval_every = 0, 8, 3
    c.rl.learning_rate = 1e-3
    c.eval.num_examples, c.eval.batch_size = 4, 4
    c.checkpoint.every, c.checkpoint.max_to_keep, c.checkpoint.async_save = 3, 1, False
    return c

  use_accelerator(c, model, sharding)
  if sharding == "tpu":
    c.rl.steps, c.rl.prompts_per_step, c.rl.microbatch_size = 200, 128, 32
  else:
    c.rl.steps, c.rl.prompts_per_step, c.rl.microbatch_size = 400, 64, 8
  return c
