"""Accelerator configs for real models (``configs/grpo_gsm8k.py``, ``configs/cast_bfcl.py``) and the tiny run.

Every variant builds and validates against a stand-in checkpoint directory holding Qwen2.5's public
``config.json`` (no weights: nothing big is loaded); the model it would load equals the variant's preset with its
sharding rules. The tiny GSM8K run starts from a random checkpoint written by ``experiments.make_tiny_checkpoint``
(``transformers`` weights, a ``tokenizers``-trained ``tokenizer.json``, the public Qwen2.5 chat template).
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from experiments.evaluate import load_config_file  # noqa: E402
from experiments.make_tiny_checkpoint import write_json, write_model_dir  # noqa: E402
from lemon_rl.envs import bfcl_data  # noqa: E402
from lemon_rl.envs import tool_use_task as tut  # noqa: E402
from lemon_rl.envs.tasks import TASKS  # noqa: E402
from lemon_rl.models import get_preset, make_mesh  # noqa: E402
from lemon_rl.models.hf import config_from_hf  # noqa: E402
from lemon_rl.models.sharding import AXIS_RULE_SETS  # noqa: E402
from lemon_rl.sampling import generate  # noqa: E402
from lemon_rl.text.decoding import ChatPromptTokenizer, encode_prompt  # noqa: E402
from lemon_rl.training import experiment  # noqa: E402
from lemon_rl.training.config_validation import ConfigError, validate_config  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "math")
GSM8K = "configs/grpo_gsm8k.py"
CAST = "configs/cast_bfcl.py"
ACCELERATOR_VARIANTS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-0.5b,tpu", "qwen2.5-1.5b,tpu")
EPS32 = float(np.finfo(np.float32).eps)
# The public config.json of Qwen/Qwen2.5-0.5B-Instruct and Qwen/Qwen2.5-1.5B-Instruct (the base models' differ
# only in max_window_layers / sliding_window, which a full-attention model ignores), written down here.
_QWEN_COMMON = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
    "max_window_layers": 21, "model_type": "qwen2", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
QWEN_CONFIGS = {
    "qwen2.5-0.5b": {**_QWEN_COMMON, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
                     "num_hidden_layers": 24, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {**_QWEN_COMMON, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                     "num_hidden_layers": 28, "num_key_value_heads": 2},
}
SLICE_SIZES = (4, 8, 16, 32)  # Devices of the TPU slices (or GPU hosts) the `,tpu` variants are sized for.


def _config(spec: str, **model_fields):
  """The config ``experiments.main`` would run: ``get_config(variant)``, overrides applied, then locked."""
  config = load_config_file(spec)
  for key, value in model_fields.items():
    config.model[key] = value
  config.lock()
  return config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  return write_model_dir(str(tmp_path_factory.mktemp("tiny_qwen")))


@pytest.fixture(scope="module")
def qwen_dirs(tiny_dir, tmp_path_factory):
  """Stand-ins for the downloaded checkpoints: the public config.json (and a tokenizer.json), no weights."""
  dirs = {}
  for name, hf_config in QWEN_CONFIGS.items():
    path = str(tmp_path_factory.mktemp(name))
    write_json(os.path.join(path, "config.json"), hf_config)
    shutil.copy(os.path.join(tiny_dir, "tokenizer.json"), path)
    dirs[name] = path
  return dirs


@pytest.mark.parametrize("name", list(QWEN_CONFIGS))
def test_presets_are_the_public_qwen_architectures(name):
  """The presets' shapes are Qwen2.5's; the ``-mixed`` ones keep float32 masters and compute in bfloat16."""
  from_json = config_from_hf(QWEN_CONFIGS[name])
  assert get_preset(name).replace(param_dtype="float32", dtype="float32") == from_json
  mixed = get_preset(f"{name}-mixed")
  assert mixed.replace(param_dtype="float32", dtype="float32", remat=False, remat_policy="nothing_saveable") == \
      from_json
  assert (mixed.param_dtype, mixed.dtype, mixed.remat) == ("float32", "bfloat16", True)


@pytest.mark.parametrize("path", [GSM8K, CAST])
@pytest.mark.parametrize("variant", ACCELERATOR_VARIANTS)
def test_accelerator_variants_validate(path, variant, qwen_dirs):
  name, _, sharding = variant.partition(",")
  config = _config(f"{path}:{variant}", hf_checkpoint=qwen_dirs[name])
  if path == GSM8K:
    with pytest.raises(ConfigError, match="task.files"):  # The user passes the data.
      validate_config(config)
    config.task.files = os.path.join(FIXTURES, "gsm8k_train.jsonl")
    config.task.test_files = os.path.join(FIXTURES, "gsm8k_test.jsonl")
    assert (config.rl.max_new_tokens, config.task.max_new_tokens, config.sft.steps) == (512, 512, 0)
  else:
    assert config.task.source == "bfcl" and config.task.reward == "cast" and config.sft.steps > 0
    config.task.bfcl_dir = os.path.join(FIXTURES, "bfcl")  # The installed bfcl-eval's data is the default.
  validate_config(config)
  rules = AXIS_RULE_SETS[config.model.axis_rules]
  # The model build_policy would load: the checkpoint's architecture with the preset's numerics and the rule set;
  # that is the preset itself, so the preset's FLOP and memory figures describe the run.
  loaded = config_from_hf(QWEN_CONFIGS[name], **experiment.checkpoint_overrides(config))
  assert loaded == get_preset(config.model.preset, axis_rules=rules)
  assert config.model.preset == f"{name}-mixed" and config.model.chat_template
  assert (loaded.param_dtype, loaded.dtype, loaded.remat) == ("float32", "bfloat16", True)
  rl = config.rl
  minibatch = rl.minibatch_size or rl.prompts_per_step * rl.num_generations  # 0: the whole rollout batch.
  assert (rl.prompts_per_step * rl.num_generations) % minibatch == 0 and minibatch % rl.microbatch_size == 0
  assert (rl.learning_rate, rl.num_generations, rl.temperature, rl.kl_coef) == (1e-6, 8, 1.0, 0.0)
  if config.sft.steps:
    assert config.sft.batch_size % config.sft.microbatch_size == 0
  if sharding == "tpu":
    assert dict(config.mesh) == {"data": 1, "fsdp": -1, "tensor": 1} and rules == AXIS_RULE_SETS["fsdp"]
    assert dict(rules)["embed"] == "fsdp" and dict(rules)["batch"] == ("data", "fsdp")
    for n in SLICE_SIZES:  # Every fsdp-split dimension and every accumulation slice divides over the slice.
      assert loaded.hidden_size % n == 0 and rl.microbatch_size % n == 0, n
      assert not config.sft.steps or config.sft.microbatch_size % n == 0, n
  else:
    assert dict(config.mesh) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert make_mesh(**config.mesh).devices.size == 1  # This host has one device: the tpu mesh folds to fsdp=1.


def test_config_mistakes_fail_naming_the_field(tiny_dir, tmp_path):
  with pytest.raises(ConfigError, match="model.chat_template.*needs model.hf_checkpoint"):
    validate_config(_config(f"{GSM8K}:tiny"))  # The documented command passes the checkpoint.
  with pytest.raises(ConfigError, match="model.hf_checkpoint.*missing config.json, tokenizer.json"):
    validate_config(_config(f"{GSM8K}:tiny", hf_checkpoint=str(tmp_path / "no_such_dir")))
  with pytest.raises(ConfigError, match="model.axis_rules"):
    validate_config(_config(f"{GSM8K}:tiny", hf_checkpoint=tiny_dir, axis_rules="fsdp_pt"))
  config = _config(f"{GSM8K}:tiny", hf_checkpoint=tiny_dir)
  validate_config(config)
  config.task.tokenizer = str(tmp_path)
  with pytest.raises(ConfigError, match="task.tokenizer"):
    validate_config(config)
  with pytest.raises(AttributeError, match="hf_checkpont"):  # A misspelt key: the locked config refuses it.
    config.model.hf_checkpont = tiny_dir


def test_bfcl_source_reads_bfcl_format_files(tiny_dir):
  """``task.source = "bfcl"``: BFCL-format entries become CAST records, split by query, demonstrations exact."""
  config = _config(f"{CAST}:tiny", hf_checkpoint=tiny_dir)
  config.task.bfcl_dir = os.path.join(FIXTURES, "bfcl")
  config.task.num_sft = config.task.num_train = config.task.num_validation = config.task.num_test = -1
  validate_config(config)
  splits = tut.bfcl_splits(config.task)
  records = [r for split in tut.SPLITS for r in splits[split]]
  assert sorted(r["id"] for r in records) == ["irrelevance_0", "simple_python_0", "simple_python_1"]
  for split in tut.SPLITS:
    assert all(tut.bucket_of(tut.bfcl_key(r)) == split for r in splits[split])
  by_id = {r["id"]: r for r in records}
  assert json.loads(by_id["simple_python_0"]["gold"]) == [
      {"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
  assert by_id["simple_python_1"]["query"] == "Convert 100 USD to EUR."  # The system turn is not the query.
  assert by_id["irrelevance_0"]["completion"] == "<think>No offered tool fits.</think><tool_call>[]</tool_call>"
  assert by_id["simple_python_0"]["completion"].endswith("[calculate_triangle_area(base=10,height=5)]</tool_call>")
  assert all(r["difficulty"] == "easy" for r in records)
  score = tut.ToolUseScore(None)
  out = score([r["prompt"] for r in records], [r["completion"] for r in records], None,
              gold=[r["gold"] for r in records], functions=[r["functions"] for r in records])
  np.testing.assert_array_equal(out.rewards, 1.0)
  wrong = score([records[0]["prompt"]], ["<think>x</think><tool_call>[no_such_tool(a=1)]</tool_call>"], None,
                gold=[by_id["simple_python_0"]["gold"]], functions=[by_id["simple_python_0"]["functions"]])
  assert wrong.rewards[0] == 0.0
  for field, value, match in (("source", "bfcI", "task.source"), ("bfcl_categories", "simple,simpel",
                                                                  "task.bfcl_categories"),
                              ("bfcl_dir", "/no/such/folder", "task.bfcl_dir")):
    bad = _config(f"{CAST}:tiny", hf_checkpoint=tiny_dir)
    bad.task[field] = value
    with pytest.raises(ConfigError, match=match):
      validate_config(bad)


@pytest.mark.skipif(not bfcl_data.bfcl_available(), reason=bfcl_data.INSTALL_HINT)
def test_cast_bfcl_tiny_builds_its_task(tiny_dir, tmp_path):
  """The tiny CAST variant over bfcl-eval's data: disjoint splits with both categories, the policy's tokenizer."""
  config = _config(f"{CAST}:tiny", hf_checkpoint=tiny_dir)
  validate_config(config)
  section = experiment.task_section(config)
  assert section.tokenizer == tiny_dir and config.task.tokenizer == "byte"
  model, task = experiment.build_policy(config, TASKS.get("tool_use")(section, str(tmp_path)))
  assert isinstance(task.tokenizer, ChatPromptTokenizer) and task.prompt_len is None
  splits = {"sft": task.sft_source, "train": task.rl_source, "validation": task.validation_examples,
            "test": task.test_examples}
  assert {k: len(v) for k, v in splits.items()} == {"sft": 16, "train": 4, "validation": 4, "test": 4}
  keys = {k: {tut.bfcl_key(r) for r in v} for k, v in splits.items()}
  assert sum(len(v) for v in keys.values()) == len(set().union(*keys.values()))  # No query in two splits.
  assert all({r["category"] for r in v} == {"simple", "irrelevance"} for v in splits.values())
  assert model.cfg.hidden_size == 32


def _swap_head_rows(src: str, dst: str, a: int, b: int) -> None:
  """Copies checkpoint ``src`` to ``dst`` with the LM-head rows (output logits) of ids ``a`` and ``b`` exchanged."""
  shutil.copytree(src, dst)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  head = tensors["lm_head.weight"].copy()
  head[[a, b]] = head[[b, a]]
  tensors["lm_head.weight"] = head
  save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_tiny_gsm8k_run_from_checkpoint(tiny_dir, tmp_path):
  """``configs/grpo_gsm8k.py:tiny`` end to end from the tiny checkpoint.

  ``build_policy`` (what ``run`` starts from) gives the checkpoint's logits as ``transformers`` computes them, on
  the prompt ids of ``apply_chat_template``, and the directory's EOS ids. To see in the run itself that the weights
  are the checkpoint's and that generation stops on a declared EOS other than ``eos_id``: the greedy completion
  ``t_1 t_2 ...`` of the first held-out prompt (no EOS in it) is rerouted by exchanging the head rows of a ``t_k``
  unlike ``t_1 .. t_{k-1}`` and of ``<|endoftext|>``; the run's step-0 evaluation of that prompt must then be
  ``k + 1`` tokens long, where the random init of the preset or an unswapped head gives 16.
  """
  config = _config(f"{GSM8K}:tiny", hf_checkpoint=tiny_dir)
  validate_config(config)
  task = TASKS.get("gsm8k")(experiment.task_section(config), str(tmp_path / "data"))
  model, task = experiment.build_policy(config, task)
  tok = task.tokenizer
  assert isinstance(tok, ChatPromptTokenizer)
  declared = json.load(open(os.path.join(tiny_dir, "generation_config.json")))["eos_token_id"]
  assert list(tok.eos_ids) == declared == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
  prompt = task.test_examples[0]["prompt"]
  ids = encode_prompt(tok, prompt)
  hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
  expected = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
  assert ids == [int(i) for i in expected]

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    want = hf_model(torch.tensor([ids])).logits.numpy()[0]
  got = np.asarray(model(jax.numpy.asarray([ids]), jax.numpy.ones((1, len(ids)), jax.numpy.int32)))[0]
  assert got.shape == (len(ids), hf_model.config.vocab_size)
  # Float32 sums reordered between XLA and torch: per layer (1) the projections and RMSNorm over d 32 (twice), the
  # MLP over 64 and attention over <= T positions, then the head over d 32; eps |logit| per term at worst.
  atol = ((32 + 32 + 64 + len(ids)) + 32) * EPS32 * float(np.abs(want).max())
  np.testing.assert_allclose(got, want, rtol=0, atol=atol)

  steps = config.task.max_new_tokens
  base = generate(model, [ids], steps, jax.random.key(0), temperature=0.0, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
  greedy = [int(t) for t in base.tokens[0]]
  assert base.finish_reasons == ["length"] and not set(greedy) & set(declared), greedy
  k = max(i for i in range(steps // 2) if greedy[i] not in greedy[:i])
  swapped = str(tmp_path / "swapped")
  _swap_head_rows(tiny_dir, swapped, greedy[k], declared[1])

  workdir = str(tmp_path / "run")
  run_config = _config(f"{GSM8K}:tiny", hf_checkpoint=swapped)
  run_config.eval.num_examples = run_config.eval.batch_size = 1  # The first held-out prompt only.
  summary = experiment.run(run_config, workdir)
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = {r["step"]: r for r in records if r["phase"] == "eval_rl"}
  assert evals[0]["completion_length"] == k + 1, (k, evals)
  assert [r["step"] for r in records if r["phase"] == "rl"] == [1, 2, 3]
  assert summary["rl_steps"] == 3 and summary["rl_final_completion_length"] == evals[3]["completion_length"]
  assert summary["rl_initial_accuracy"] == evals[0]["accuracy"] == 0.0
  for name in ("summary.json", "summary.txt", "config.json"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
