r"""CAST (METHODS.md section 1, ``configs/cast_tool_use.py``) on BFCL-format tool data from a Qwen2.5 checkpoint.

    python -m experiments.main --config=configs/cast_bfcl.py:qwen2.5-0.5b --workdir=runs/cast_bfcl_0.5b \
        --config.model.hf_checkpoint=/models/Qwen2.5-0.5B-Instruct [--config.task.bfcl_dir=/data/my_bfcl]

The phases are CAST's: SFT on demonstrations, then the case library of the SFT policy (``task.cast.num_samples``
rollouts per training query: complexity and failure profiles), then RL with ``CastReward`` on the easy-to-hard
curriculum. Held-out score: BFCL exact match (``ToolUseScore``), per category and difficulty.

Data (``task.source = "bfcl"``, ``lemon_rl.envs.tool_use_task.bfcl_splits``): the single-turn Python entries of
``task.bfcl_categories`` in a folder laid out like bfcl-eval's ``data/`` (``BFCL_v4_<category>.json`` and
``possible_answer/``; ``task.bfcl_dir``, "" = the installed bfcl-eval's own data). Prompts are the compact tool
signatures and the user turn, rendered as one user message of the checkpoint's chat template; demonstrations are
``<think>one line</think><tool_call>[f(a=1)]</tool_call>`` from the gold's first acceptable answer (BFCL has no
reasoning traces). Entries split by their normalised query into SFT (70% of the key space), RL prompts,
validation and test (10% each). With bfcl-eval's own data the test bucket is held out from training but is BFCL
itself: report it as an in-distribution split; for BFCL's leaderboard protocol, train on other data in this
format and score with ``python -m experiments.eval_bfcl``.

Model: ``model.hf_checkpoint`` (weights, tokenizer, every EOS id, chat template), the ``qwen2.5-*-mixed`` numerics
(float32 masters, bfloat16 compute, remat), sharding as ``configs/grpo_gsm8k.py``: one accelerator (mesh 1 x 1 x
1) or, with ``,tpu``, every device on ``fsdp`` with the ``fsdp`` rule set.

Hyper-parameters (*Decision*; the paper's training settings are not public): SFT 2 epochs of the SFT bucket
(~2,460 entries of bfcl-eval's data) at lr 1e-5, batch 32 (full fine-tuning range for 0.5-1.5B models); RL as
``configs/grpo_gsm8k.py`` (lr 1e-6, G = 8, temperature 1, clip 0.2, KL 0) on 32 prompts per step for 60 steps
(~6 passes over the ~320 RL prompts), one update per rollout batch. Hardness ``H = 1 - pass rate`` alone
(``score_hardness_weight = 0``, METHODS' default: an SFT'd Qwen2.5 passes enough queries for pass rates to
order them; the CPU config blends in the structural score because its tiny policy does not). Byte limits:
prompts up to 4,096 bytes, demonstrations up to 1,024 (the few longer entries are left out); a completion may
take ``rl.max_new_tokens`` = 1,040 tokens.

Variants (``--config=configs/cast_bfcl.py:<variant>``): ``qwen2.5-0.5b`` (default), ``qwen2.5-1.5b``,
``qwen2.5-0.5b,tpu``, ``qwen2.5-1.5b,tpu``; ``tiny``: the CPU smoke run on a tiny checkpoint
(``python -m experiments.make_tiny_checkpoint``) over bfcl-eval's installed ``simple`` and ``irrelevance`` entries
(the three entries of ``tests/fixtures/math/bfcl`` cannot fill disjoint SFT, RL and test splits).
"""

from ml_collections import config_dict

from configs.grpo_gsm8k import VARIANTS, use_accelerator
from lemon_rl.eval.bfcl import CATEGORIES  # BFCL's single-turn Python categories.
from lemon_rl.training import base_config


def get_config(variant: str = "qwen2.5-0.5b") -> config_dict.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
  model, _, sharding = variant.partition(",")
  c = base_config.get_base_config()

  c.task = t = config_dict.ConfigDict()  # Fields documented in lemon_rl.envs.tool_use_task / configs/cast_tool_use.
  t.name = "tool_use"
  t.source = "bfcl"
  t.bfcl_dir = ""  # "" = the installed bfcl-eval's data/.
  t.bfcl_categories = ",".join(CATEGORIES)
  t.tokenizer = "byte"  # Replaced by model.hf_checkpoint's tokenizer.
  t.data_seed = 0  # Unused by the bfcl source (the splits are a function of the files).
  t.num_sft, t.num_train, t.num_validation, t.num_test = -1, -1, -1, -1  # Caps per split (-1: all).
  t.category_weights = config_dict.ConfigDict({k: 1.0 for k in ("simple", "multiple", "parallel",
                                                                  "parallel_multiple", "irrelevance")})  # Unused.
  t.style = "python"  # Call syntax of the demonstrations: [f(a=1)].
  t.max_prompt_bytes = 4096
  t.max_completion_bytes = 1024
  t.reward = "cast"  # cast | exact (binary BFCL exact match: the GRPO baseline).
  t.cast = config_dict.ConfigDict()
  t.cast.num_samples = 4
  t.cast.temperature = 1.0
  t.cast.rollout_batch_size = 128
  t.cast.num_bins = 3
  t.cast.score_hardness_weight = 0.0
  t.cast.min_baseline = 1.0
  t.cast.use_budget = True
  t.cast.use_schema = True
  t.cast.weights = "failure_profile"
  t.cast.weight_floor = 0.05
  t.cast.think_mode = "multiplicative"
  t.cast.curriculum = "easy_to_hard"
  t.cast.num_stages = 3

  c.model.hf_checkpoint = ""  # Required: --config.model.hf_checkpoint=/path/to/Qwen2.5-...-Instruct.
  c.model.chat_template = True

  c.sft.steps = 150
  c.sft.batch_size = 32
  c.sft.microbatch_size = 8
  c.sft.learning_rate = 1e-5
  c.sft.warmup_steps = 10
  c.sft.eval_every = 50

  c.rl.algorithm = "grpo"
  c.rl.steps = 60
  c.rl.prompts_per_step = 32
  c.rl.num_generations = 8
  c.rl.max_new_tokens = 1040  # > max_completion_bytes: every demonstration fits, whatever the tokenizer.
  c.rl.temperature = 1.0
  c.rl.kl_coef = 0.0
  c.rl.num_iterations = 1
  c.rl.minibatch_size = 0  # One update per step on the whole rollout batch.
  c.rl.microbatch_size = 8
  c.rl.learning_rate = 1e-6
  c.rl.eval_every = 20

  c.eval.num_examples = 1000  # The whole test bucket (~350 entries of bfcl-eval's data).
  c.eval.batch_size = 128
  c.checkpoint.every = 50
  c.checkpoint.max_to_keep = 2

  if model == "tiny":
    c.tensorboard = False
    c.model.preset = "tiny"  # float32 numerics; the shapes are the checkpoint's.
    t.bfcl_categories = "simple,irrelevance"
    t.num_sft, t.num_train, t.num_validation, t.num_test = 16, 4, 4, 4
    t.max_prompt_bytes, t.max_completion_bytes = 400, 120
    t.cast.num_samples, t.cast.rollout_batch_size = 2, 8
    c.sft.steps, c.sft.batch_size, c.sft.microbatch_size, c.sft.warmup_steps, c.sft.eval_every = 2, 8, None, 1, 0
    c.sft.learning_rate = 1e-3
    c.rl.steps, c.rl.prompts_per_step, c.rl.num_generations, c.rl.max_new_tokens = 2, 2, 2, 128
    c.rl.microbatch_size, c.rl.eval_every, c.rl.learning_rate = 4, 2, 1e-3
    c.eval.num_examples, c.eval.batch_size = 4, 4
    c.checkpoint.every, c.checkpoint.max_to_keep, c.checkpoint.async_save = 2, 1, False
    return c

  use_accelerator(c, model, sharding)
  if sharding == "tpu":
    c.sft.microbatch_size, c.rl.microbatch_size = 32, 32
  return c
