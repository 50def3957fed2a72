"""LoRA adapters (``lemon_rl.models.lora``) on a tiny Qwen2-shaped model (GQA: 4 query heads, 2 KV heads)."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from lemon_rl.models import DEFAULT_AXIS_RULES, ModelConfig, Transformer, from_hf, make_mesh, param_logical_axes
from lemon_rl.models import lora
from lemon_rl.models.hf import config_to_hf, hf_state_dict, to_hf
from lemon_rl.models.sharding import logical_to_spec
from lemon_rl.training.checkpoint import Checkpointer
from lemon_rl.training.sft import SFTLoss
from lemon_rl.training.state import make_optimizer

CFG = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
                  initializer_range=0.1)
LORA = lora.LoraConfig(rank=4, alpha=8.0)
EPS32 = float(np.finfo(np.float32).eps)
# A logit ends float32 contractions over, per layer (2): E = 32 (QKV, RMSNorm), H*D = 32 (output), F = 48 (down)
# and <= 10 attended positions, then the head's E = 32; two implementations (XLA, torch) or a merged vs an
# unmerged weight add them in other orders: at most LOGIT_TERMS eps |logit| apart.
LOGIT_TERMS = 2 * (32 + 32 + 48 + 10) + 32


def logit_atol(logits) -> float:
  return LOGIT_TERMS * EPS32 * float(np.abs(logits).max())


@pytest.fixture(scope="module")
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(model):
  """``forward(params) -> logits [4, 10, V]`` on :func:`batch`: one compilation for every parameter tree."""
  graphdef, _ = nnx.split(model, nnx.Param)
  b = batch()
  run = jax.jit(lambda params: nnx.merge(graphdef, params)(b["ids"], b["attention_mask"]))
  return lambda params: np.asarray(run(params))


def random_adapters(lora_cfg=LORA, seed=1):
  """Adapters with a non-zero ``b`` (a fresh one has ``b = 0``)."""
  adapters = lora.init_adapters(CFG, lora_cfg, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), len(adapters)))
  return {t: {"a": ad["a"], "b": 0.05 * jax.random.normal(next(keys), ad["b"].shape)} for t, ad in adapters.items()}


def batch(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, CFG.vocab_size, size=(4, 10))
  mask = np.ones((4, 10), np.int32)
  mask[1, 7:] = 0  # right padded
  return {"ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask), "loss_mask": jnp.asarray(mask[:, 1:])}


def adapted_logits(forward, model, adapters, lora_cfg=LORA):
  return forward(lora.apply_adapters(nnx.state(model, nnx.Param), adapters, lora_cfg))


def hand_merged_state_dict(model, adapters, lora_cfg=LORA):
  """The Hugging Face weights ``W + s (A B)^T`` per ``nn.Linear``, built in NumPy from the base's state dict."""
  sd = hf_state_dict(model)
  for t in lora_cfg.targets:
    a, b = np.asarray(adapters[t]["a"], np.float64), np.asarray(adapters[t]["b"], np.float64)
    for i in range(CFG.num_layers):
      name = f"model.layers.{i}.{lora.HF_MODULES[t]}.weight"
      sd[name] = (sd[name] + lora_cfg.alpha / lora_cfg.rank * (a[i] @ b[i]).T).astype(np.float32)
  return sd


def test_config_validation_and_order():
  assert lora.LoraConfig(targets=("v", "q")).targets == ("q", "v")
  assert lora.LoraConfig(rank=4, alpha=8).scale == 2.0
  assert lora.LoraConfig(rank=4, alpha=8, use_rslora=True).scale == 4.0
  with pytest.raises(ValueError, match="targets"):
    lora.LoraConfig(targets=("q", "lm_head"))
  with pytest.raises(ValueError, match="rank"):
    lora.LoraConfig(rank=0)


def test_parameter_count_is_r_times_in_plus_out():
  # E = 32, H*D = 32, K*D = 16, F = 48; r = 4; 2 layers.
  per_layer = {"q": 4 * (32 + 32), "k": 4 * (32 + 16), "v": 4 * (32 + 16), "o": 4 * (32 + 32),
               "gate": 4 * (32 + 48), "up": 4 * (32 + 48), "down": 4 * (48 + 32)}
  adapters = lora.init_adapters(CFG, LORA, jax.random.key(0))
  for t, n in per_layer.items():
    assert adapters[t]["a"].size + adapters[t]["b"].size == 2 * n
  total = sum(x.size for x in jax.tree.leaves(adapters))
  assert total == lora.num_adapter_params(CFG, LORA) == 2 * sum(per_layer.values())
  subset = lora.LoraConfig(rank=4, targets=("q", "v"))
  assert lora.num_adapter_params(CFG, subset) == 2 * (per_layer["q"] + per_layer["v"])
  assert sorted(lora.init_adapters(CFG, subset, jax.random.key(0))) == ["q", "v"]


def test_zero_adapters_leave_logits_exactly_unchanged(model, forward):
  adapters = lora.init_adapters(CFG, LORA, jax.random.key(0))
  assert all(not np.any(np.asarray(ad["b"])) and np.any(np.asarray(ad["a"])) for ad in adapters.values())
  np.testing.assert_array_equal(adapted_logits(forward, model, adapters), forward(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("targets", [lora.TARGETS, ("q", "v", "down")])
def test_adapted_weights_equal_direct_computation(model, forward, targets, tmp_path):
  lora_cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=targets)
  adapters = random_adapters(lora_cfg)
  expected_sd = hand_merged_state_dict(model, adapters, lora_cfg)
  merged = lora.merge(model, adapters, lora_cfg)
  got_sd = hf_state_dict(merged)
  assert set(got_sd) == set(expected_sd)
  for name, w in expected_sd.items():  # one float32 add of a rank-4 product: a few ulp of |W|.
    np.testing.assert_allclose(got_sd[name], w, rtol=1e-6, atol=1e-7, err_msg=name)
  base_sd = hf_state_dict(model)
  changed = {n for n in base_sd if not np.array_equal(base_sd[n], got_sd[n])}
  assert changed == {f"model.layers.{i}.{lora.HF_MODULES[t]}.weight" for i in range(2) for t in targets}
  # The hand-built weights loaded through from_hf (hf.py's own group_qkv) give the adapted logits.
  path = str(tmp_path / "direct")
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(CFG), f)
  save_file(expected_sd, os.path.join(path, "model.safetensors"))
  direct = forward(nnx.state(from_hf(path), nnx.Param))
  ours = adapted_logits(forward, model, adapters, lora_cfg)
  base = forward(nnx.state(model, nnx.Param))
  valid = np.asarray(batch()["attention_mask"], bool)
  assert np.abs(ours - base)[valid].max() > 100 * logit_atol(base)  # the adapters matter
  np.testing.assert_allclose(ours[valid], direct[valid], rtol=0, atol=logit_atol(direct))


def test_merged_export_reloads_in_transformers(model, forward, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  adapters = random_adapters()
  path = str(tmp_path / "merged")
  to_hf(lora.merge(model, adapters, LORA), path)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  b = batch()
  mask = np.asarray(b["attention_mask"])
  with torch.no_grad():
    theirs = hf_model(input_ids=torch.tensor(np.asarray(b["ids"])), attention_mask=torch.tensor(mask),
                      position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))).logits.numpy()
  ours = adapted_logits(forward, model, adapters)
  valid = mask.astype(bool)
  np.testing.assert_allclose(theirs[valid], ours[valid], rtol=0, atol=logit_atol(ours))


def test_training_step_changes_only_adapters(model):
  optimizer = make_optimizer(1e-2, total_steps=10, schedule="constant")
  graphdef, base, state = lora.create_lora_train_state(model, LORA, optimizer, seed=0)
  base_before = [np.array(x) for x in jax.tree.leaves(base)]
  adapter_shapes = {x.shape for x in jax.tree.leaves(state.params)}
  opt_leaves = jax.tree.leaves(state.opt_state)
  assert all(x.shape == () or x.shape in adapter_shapes for x in opt_leaves)
  # AdamW's two moments per adapter leaf plus scalar counters: nothing base-sized.
  assert sum(x.size for x in opt_leaves if x.shape) == 2 * lora.num_adapter_params(CFG, LORA)
  a0 = {t: np.array(ad["a"]) for t, ad in state.params.items()}
  loss_fn = SFTLoss()
  losses = []
  for step in range(4):
    state, values = lora.lora_update_step(graphdef, base, state, batch(), loss_fn=loss_fn, optimizer=optimizer,
                                          lora_cfg=LORA)
    losses.append(float(values["loss"]))
    if step == 0:  # With b = 0, dL/da = s dW b^T = 0: the first step moves only b.
      assert all(np.any(np.asarray(ad["b"])) for ad in state.params.values())
      assert all(np.array_equal(np.asarray(ad["a"]), a0[t]) for t, ad in state.params.items())
  assert all(not np.array_equal(np.asarray(ad["a"]), a0[t]) for t, ad in state.params.items())
  assert losses[-1] < losses[0] - 0.05, losses  # descends on a fixed batch (a wrong sign would climb)
  for before, after in zip(base_before, jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(after), before)  # bitwise unchanged
  assert int(state.step) == 4


def test_microbatches_accumulate_the_same_gradient(model):
  graphdef, base = nnx.split(model, nnx.Param)
  adapters = random_adapters()
  grads = jax.jit(lora.accumulate_adapter_gradients, static_argnums=(0, 4, 5, 6))
  loss1, _, g1 = grads(graphdef, base, adapters, batch(), SFTLoss(), LORA, 1)
  loss2, _, g2 = grads(graphdef, base, adapters, batch(), SFTLoss(), LORA, 2)
  np.testing.assert_allclose(float(loss2.sum), float(loss1.sum), rtol=1e-5)
  for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6 * float(np.abs(x).max()))


def test_adapter_checkpoint_round_trip_and_mismatch(model, tmp_path):
  optimizer = make_optimizer(1e-2, total_steps=10, schedule="constant")
  _, _, state = lora.create_lora_train_state(model, LORA, optimizer, seed=0, adapters=random_adapters())
  with Checkpointer(tmp_path / "state", async_save=False) as ckpt:
    lora.save_adapters(ckpt, 3, state, LORA, CFG, {"data": 7})
    restored, meta = lora.restore_adapters(ckpt, LORA, CFG, target=state)
    assert meta == {"data": 7}
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    with pytest.raises(lora.LoraMismatchError, match=r"config.rank: saved 4, expected 8"):
      lora.restore_adapters(ckpt, lora.LoraConfig(rank=8, alpha=8.0), CFG, target=state)
    with pytest.raises(lora.LoraMismatchError, match=r"config.targets"):
      lora.restore_adapters(ckpt, lora.LoraConfig(rank=4, alpha=8.0, targets=("q", "v")), CFG)
    with pytest.raises(lora.LoraMismatchError, match=r"model.num_layers: saved 2, expected 3"):
      lora.restore_adapters(ckpt, LORA, CFG.replace(num_layers=3))
  with Checkpointer(tmp_path / "adapters", async_save=False) as ckpt:  # adapters alone, default target
    lora.save_adapters(ckpt, 1, state.params, LORA, CFG)
    adapters, _ = lora.restore_adapters(ckpt, LORA, CFG)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(adapters)):
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  with Checkpointer(tmp_path / "plain", async_save=False) as ckpt:  # not an adapter checkpoint
    ckpt.save(1, state.params)
    with pytest.raises(lora.LoraMismatchError, match="holds no LoRA config"):
      lora.restore_adapters(ckpt, LORA, CFG)


def test_peft_format_without_peft(model, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` would raise ImportError
  adapters = random_adapters()
  path = str(tmp_path / "peft")
  lora.to_peft(adapters, LORA, path, base_model_name_or_path="tiny")
  with open(os.path.join(path, "adapter_config.json")) as f:
    config = json.load(f)
  assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
  assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
  tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
  assert len(tensors) == 2 * 7 * CFG.num_layers
  prefix = "base_model.model.model.layers.1."
  assert tensors[prefix + "self_attn.k_proj.lora_A.weight"].shape == (4, 32)  # [r, in]
  assert tensors[prefix + "self_attn.k_proj.lora_B.weight"].shape == (16, 4)  # [out, r]
  # PEFT's convention: nn.Linear weight W + s * lora_B @ lora_A is the merged export's weight.
  merged_sd = hf_state_dict(lora.merge(model, adapters, LORA))
  base_sd = hf_state_dict(model)
  for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj"):
    name = f"model.layers.1.{module}"
    lora_a, lora_b = tensors[f"{prefix}{module}.lora_A.weight"], tensors[f"{prefix}{module}.lora_B.weight"]
    np.testing.assert_allclose(base_sd[name + ".weight"] + LORA.scale * lora_b @ lora_a,
                               merged_sd[name + ".weight"], rtol=1e-6, atol=1e-7)
  back, back_cfg = lora.from_peft(path, CFG)
  assert back_cfg == LORA
  for x, y in zip(jax.tree.leaves(adapters), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  with pytest.raises(lora.LoraMismatchError, match="shape"):
    lora.from_peft(path, CFG.replace(mlp_dim=64))
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump({**config, "use_dora": True}, f)
  with pytest.raises(ValueError, match="use_dora"):
    lora.from_peft(path, CFG)


def test_peft_loads_our_adapters_with_the_adapted_logits(model, forward, tmp_path):
  """Only where ``peft`` is installed (it is not a dependency): PEFT's own model on our files."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  adapters = random_adapters()
  base_path, adapter_path = str(tmp_path / "base"), str(tmp_path / "adapter")
  to_hf(model, base_path)
  lora.to_peft(adapters, LORA, adapter_path)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
  peft_model = peft.PeftModel.from_pretrained(hf_model, adapter_path).eval()
  b = batch()
  mask = np.asarray(b["attention_mask"])
  with torch.no_grad():
    theirs = peft_model(input_ids=torch.tensor(np.asarray(b["ids"])), attention_mask=torch.tensor(mask),
                        position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))).logits.numpy()
  ours = adapted_logits(forward, model, adapters)
  valid = mask.astype(bool)
  np.testing.assert_allclose(theirs[valid], ours[valid], rtol=0, atol=logit_atol(ours))


def test_adapter_sharding_follows_base_axes(model):
  axes = lora.adapter_logical_axes(LORA)
  spec = lambda a: tuple(logical_to_spec(a, DEFAULT_AXIS_RULES))
  base_axes = param_logical_axes(model)["blocks"][0]
  qkv, gate_up = spec(base_axes["qkv"]), spec(base_axes["gate_up"])  # [E, K, G+2, D], [E, F, 2]
  assert spec(axes["q"]["a"]) == (None, qkv[0], None) and spec(axes["q"]["b"]) == (None, None, qkv[1])
  assert spec(axes["v"]["b"]) == (None, None, qkv[1])
  assert spec(axes["up"]["b"]) == (None, None, gate_up[1])
  assert spec(axes["down"]["a"]) == (None, spec(base_axes["down"])[0], None)
  assert spec(axes["o"]["a"]) == (None, spec(base_axes["out"])[0], None)
  mesh = make_mesh()
  sharded = lora.shard_adapters(random_adapters(), LORA, mesh, DEFAULT_AXIS_RULES)
  assert all(x.sharding.mesh.shape == mesh.shape for x in jax.tree.leaves(sharded))
