"""Training an EAGLE-3 drafter against its frozen target: training-time test, soft labels, checkpoints.

For a batch of sequences ``x [B, T]`` (the target's own outputs in ``experiments/train_speculative.py``)
the frozen target gives, in one forward, its features of ``head.feature_layers``, its final-norm hidden
states ``z_t`` and its logits; :meth:`EagleHead.unroll` then runs ``S`` drafting steps from every position
(steps ``k >= 1`` on the drafter's own outputs, EAGLE-3's training-time test), and step ``k`` at position
``t``, which predicts ``x_{t+k+2}``, is scored against the target's distribution there::

    p^k_t = softmax(target_logits[t + k + 1])       q^k_t = softmax(head(rmsnorm(o^k_t)))
    L = sum_k w_k sum_t m^k_t CE(p^k_t, q^k_t) / sum_t m^0_t,   w_k = decay^k,   m^k_t = [x_{t+k+1} real]
      + feature_weight * the same sum of smoothL1(rmsnorm(o^k_t) - z_{t+k+1}) (mean over E)   (optional)

(``decay = 0.8`` as in SpecForge's EAGLE-3 recipe; dividing every step by the step-0 count keeps the sum and
denominator additive over micro-batches and never depends on the parameters.) The loss is a pure function
of arrays (:func:`soft_label_loss`, :func:`feature_regression_loss`); :class:`DrafterLoss` computes those
arrays from the models. :func:`update_step` differentiates with respect to the head's parameters only: the
target's parameters are a separate, non-differentiated argument, so its embedding and LM head (shared by
the drafter) stay frozen. Checkpoints hold the target and the drafter together (:func:`save_speculative`,
:func:`load_speculative`, orbax through ``lemon_rl.training.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Mapping

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from ml_collections import config_dict

from lemon_rl import ops
from lemon_rl.models.config import ModelConfig
from lemon_rl.models.drafter import EagleHead, shift_left
from lemon_rl.models.transformer import Transformer
from lemon_rl.training import state as state_lib
from lemon_rl.training.checkpoint import Checkpointer
from lemon_rl.training.state import TrainState

# -- the loss: pure functions of arrays -------------------------------------------------------------------


def step_weights(num_steps: int, decay: float) -> np.ndarray:
  """``w_k = decay^k`` for ``k < num_steps``."""
  return np.asarray([decay ** k for k in range(num_steps)], np.float32)


def _step_masks(mask: jax.Array, num_steps: int) -> list[jax.Array]:
  """``m^k_t = mask[t] & mask[t + k + 1]`` (0 past the end) for every step ``k``."""
  mask = mask.astype(bool)
  return [mask & shift_left(mask, k + 1) for k in range(num_steps)]


def soft_label_loss(draft_logits: jax.Array, target_logits: jax.Array, mask: jax.Array,
                    weights) -> tuple[ops.WeightedMetric, dict[str, ops.Metric]]:
  """Cross-entropy of the unrolled drafter to the target's soft labels (see the module docstring).

  Args:
    draft_logits: ``[S, B, T, V]``; step ``k`` at ``t`` predicts ``x_{t+k+2}``.
    target_logits: ``[B, T, V]``; position ``t`` predicts ``x_{t+1}``.
    mask: ``[B, T]``, 1 on real tokens (right padding).
    weights: ``[S]`` per-step weights ``w_k``.

  Returns:
    ``(loss, metrics)``: ``loss = (sum_k w_k sum_t m^k_t CE^k_t, sum_t m^0_t)``; per step ``k``: ``ce_k``
    (mean CE), ``top1_k`` (the drafter's argmax equals the target's, the greedy acceptance of that step
    given a correct prefix) and ``accept_k`` (``sum_v min(p, q)``, the acceptance probability of
    speculative sampling at temperature 1).
  """
  num_steps = draft_logits.shape[0]
  chex.assert_rank([draft_logits, target_logits, mask], [4, 3, 2])
  chex.assert_equal_shape([draft_logits[0], target_logits])
  chex.assert_shape(weights, (num_steps,))
  target_logp = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
  masks = _step_masks(mask, num_steps)
  total = jnp.zeros((), jnp.float32)
  metrics = {}
  for k in range(num_steps):
    labels = shift_left(target_logp, k + 1)
    draft_logp = jax.nn.log_softmax(draft_logits[k].astype(jnp.float32), axis=-1)
    p = jnp.exp(labels)
    ce = -jnp.sum(p * draft_logp, axis=-1)
    total = total + weights[k] * ops.masked_sum(ce, masks[k])
    metrics[f"ce_{k}"] = ops.weighted_metric(ce, masks[k])
    top1 = jnp.argmax(draft_logp, axis=-1) == jnp.argmax(labels, axis=-1)
    metrics[f"top1_{k}"] = ops.weighted_metric(top1.astype(jnp.float32), masks[k])
    metrics[f"accept_{k}"] = ops.weighted_metric(jnp.sum(jnp.minimum(p, jnp.exp(draft_logp)), axis=-1), masks[k])
  return ops.WeightedMetric(total, jnp.sum(masks[0], dtype=jnp.float32)), metrics


def feature_regression_loss(draft_hidden: jax.Array, target_hidden: jax.Array, mask: jax.Array,
                            weights) -> ops.WeightedMetric:
  """``(sum_k w_k sum_t m^k_t mean_E smoothL1(h^k_t - z_{t+k+1}), sum_t m^0_t)``.

  ``draft_hidden [S, B, T, E]`` the drafter's normed outputs (the LM head's input), ``target_hidden [B, T,
  E]`` the target's final-norm hidden states (what its head reads at ``t + k + 1``), ``mask [B, T]``.
  """
  num_steps = draft_hidden.shape[0]
  chex.assert_equal_shape([draft_hidden[0], target_hidden])
  masks = _step_masks(mask, num_steps)
  total = jnp.zeros((), jnp.float32)
  for k in range(num_steps):
    diff = draft_hidden[k].astype(jnp.float32) - shift_left(target_hidden, k + 1).astype(jnp.float32)
    total = total + weights[k] * ops.masked_sum(jnp.mean(optax.huber_loss(diff), axis=-1), masks[k])
  return ops.WeightedMetric(total, jnp.sum(masks[0], dtype=jnp.float32))


# -- from the models to the loss ------------------------------------------------------------------------


def teacher(target: Transformer, tokens: jax.Array, mask: jax.Array, feature_layers: tuple[int, ...]):
  """The frozen target's view of ``tokens [B, T]``: ``(features [B, T, F], hidden [B, T, E], logits [B, T, V],
  embeds [B, T, E])``, all under ``stop_gradient``."""
  b, t = tokens.shape
  hidden, features = target.hidden_states(tokens, mask, feature_layers=feature_layers)
  logits = target.logits_from_hidden(hidden)
  embeds = target.embed_tokens(tokens).reshape(b, t, -1)
  return jax.lax.stop_gradient((features, hidden, logits, embeds))


@dataclasses.dataclass(frozen=True)
class DrafterLoss:
  """The training-time-test loss of an :class:`EagleHead` on ``batch = {"tokens", "mask"}`` ``[B, T]``.

  Attributes:
    num_steps: unrolled drafting steps ``S`` (EAGLE-3 uses 7; about the ``K`` drafted at inference).
    step_decay: ``w_k = step_decay^k``.
    feature_weight: weight of :func:`feature_regression_loss` (0 = soft labels only, as EAGLE-3).
  """

  num_steps: int = 4
  step_decay: float = 0.8
  feature_weight: float = 0.0

  def __call__(self, head: EagleHead, target: Transformer, batch: Mapping[str, jax.Array]):
    tokens, mask = batch["tokens"], batch["mask"].astype(bool)
    features, hidden, target_logits, embeds = teacher(target, tokens, mask, head.feature_layers)
    normed = head.normed(head.unroll(features, embeds, mask, self.num_steps))
    draft_logits = target.logits_from_hidden(normed)
    weights = step_weights(self.num_steps, self.step_decay)
    loss, metrics = soft_label_loss(draft_logits, target_logits, mask, weights)
    if self.feature_weight:
      regression = feature_regression_loss(normed, hidden, mask, weights)
      metrics["feature_loss"] = regression
      loss = ops.WeightedMetric(loss.sum + self.feature_weight * regression.sum, loss.denominator)
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("head_def", "target_def", "loss", "optimizer", "num_microbatches"),
                   donate_argnames=("state",))
def update_step(head_def, state: TrainState, target_def, target_params, batch: Mapping[str, jax.Array], *,
                loss: DrafterLoss, optimizer: optax.GradientTransformation, num_microbatches: int = 1):
  """One optimizer step of the head on ``batch``; returns ``(new_state, {name: scalar})``.

  ``state`` holds the head's parameters only (``state_lib.create_train_state(head, ...)``); ``target_def,
  target_params = nnx.split(target)`` enter as constants of the gradient (never differentiated, never
  updated). Micro-batching and normalisation as ``lemon_rl.training.state.update_step``.
  """

  def loss_fn(head, micro):
    return loss(head, nnx.merge(target_def, target_params), micro)

  total, metrics, grad_sum = state_lib.accumulate_gradients(head_def, state.params, batch, loss_fn,
                                                            num_microbatches)
  return state_lib.apply_gradient_sum(state, total, metrics, grad_sum, optimizer)


@functools.partial(jax.jit, static_argnames=("head_def", "target_def", "loss"))
def eval_metrics(head_def, head_params, target_def, target_params, batch, *, loss: DrafterLoss):
  """The loss and metrics of ``batch`` as unreduced pairs (sum them over batches, then ``value``)."""
  total, metrics = loss(nnx.merge(head_def, head_params), nnx.merge(target_def, target_params), batch)
  return {"loss": total, **metrics}


# -- configuration --------------------------------------------------------------------------------------


def loss_from_config(c: config_dict.ConfigDict) -> DrafterLoss:
  """``c`` = the ``drafter`` section: ``ttt_steps``, ``step_decay``, ``feature_weight``."""
  return DrafterLoss(num_steps=int(c.ttt_steps), step_decay=float(c.step_decay),
                     feature_weight=float(c.feature_weight))


def head_from_config(target_cfg: ModelConfig, c: config_dict.ConfigDict, seed: int) -> EagleHead:
  """An :class:`EagleHead` for ``target_cfg`` from the ``drafter`` section (``feature_layers``: ``()`` =
  EAGLE-3's default; ``num_heads`` / ``num_kv_heads`` / ``mlp_dim``: 0 = the target's)."""
  return EagleHead(target_cfg, tuple(c.feature_layers) or None, rngs=nnx.Rngs(seed),
                   num_heads=c.num_heads or None, num_kv_heads=c.num_kv_heads or None, mlp_dim=c.mlp_dim or None)


def optimizer_from_config(c: config_dict.ConfigDict) -> optax.GradientTransformation:
  """AdamW + clipping + warmup/cosine from ``learning_rate``, ``steps``, ``warmup_steps``, ``weight_decay``,
  ``max_grad_norm`` (``state_lib.make_optimizer``)."""
  return state_lib.make_optimizer(c.learning_rate, c.steps, warmup_steps=c.warmup_steps,
                                  weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm)


# -- checkpoints: the target and the drafter together ----------------------------------------------------


def model_config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
  """A JSON-serialisable form of ``cfg`` (inverse: :func:`model_config_from_dict`)."""
  d = dataclasses.asdict(cfg)
  d["rope_scaling"] = None if cfg.rope_scaling is None else dict(cfg.rope_scaling)
  d["axis_rules"] = [[name, list(axes) if isinstance(axes, tuple) else axes] for name, axes in cfg.axis_rules]
  return d


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
  d = dict(d)
  d["axis_rules"] = tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in d["axis_rules"])
  return ModelConfig(**d)


def save_speculative(directory: str, step: int, target: Transformer, head: EagleHead,
                     metadata: Mapping[str, Any] | None = None) -> None:
  """Saves ``{"target", "drafter"}`` parameters and both configs as checkpoint ``step`` of ``directory``.

  ``metadata`` (JSON) is stored alongside, e.g. the tokenizer path and the corpus hash.
  """
  state = {"target": nnx.state(target, nnx.Param), "drafter": nnx.state(head, nnx.Param)}
  meta = {"target_config": model_config_to_dict(target.cfg), "drafter_spec": head.spec(), **(metadata or {})}
  with Checkpointer(directory, max_to_keep=None, async_save=False) as ckpt:
    ckpt.save(step, state, meta, force=True)


def load_speculative(directory: str, step: int | None = None) -> tuple[Transformer, EagleHead, dict[str, Any]]:
  """Restores ``(target, head, metadata)`` saved by :func:`save_speculative` (default: the latest step)."""
  with Checkpointer(directory, max_to_keep=None, async_save=False) as ckpt:
    meta = ckpt.read_metadata(step)
    cfg = model_config_from_dict(meta["target_config"])
    spec = meta["drafter_spec"]
    # Abstract modules (shapes only): every parameter is restored, so drawing initial values would be wasted
    # work (eager initialisation compiles each op: seconds per model).
    target = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    head = nnx.eval_shape(lambda: EagleHead(cfg, spec["feature_layers"], rngs=nnx.Rngs(0),
                                            num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"],
                                            mlp_dim=spec["mlp_dim"]))
    abstract = {"target": nnx.state(target, nnx.Param), "drafter": nnx.state(head, nnx.Param)}
    state, meta = ckpt.restore(abstract, step)
  nnx.update(target, state["target"])
  nnx.update(head, state["drafter"])
  return target, head, meta


# -- measured cost ratio --------------------------------------------------------------------------------


def seconds_per_step(run, steps: int, repeats: int) -> float:
  """Best of ``repeats`` timed calls of ``run()`` (a jitted loop of ``steps`` steps) after one warm-up call
  (compilation), divided by ``steps``."""
  jax.block_until_ready(run())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return min(times) / steps


def _target_steps(graphdef, variables, cache, tokens, steps):
  """``steps`` greedy target steps of ``W = tokens.shape[1]`` tokens per row: extend the cache by them, the
  argmax after each is the next step's input, and the cache keeps one new position per step (the others
  are rolled back, as after a rejected verification)."""
  model = nnx.merge(graphdef, variables)
  width = tokens.shape[1]

  def body(_, carry):
    cache, tokens = carry
    hidden, cache = model.extend(tokens, cache)
    tokens = jnp.argmax(model.logits_from_hidden(hidden), axis=-1).astype(jnp.int32)
    return cache.truncate(cache.lengths - (width - 1)), tokens

  return jax.lax.fori_loop(0, steps, body, (cache, tokens))[1]


@functools.cache
def _compiled_target_steps(options: tuple[tuple[str, str], ...]):
  return jax.jit(_target_steps, static_argnames=("graphdef", "steps"), compiler_options=dict(options) or None)


@functools.partial(jax.jit, static_argnames=("target_def", "head_def", "steps"))
def _drafter_decode(target_def, target_vars, head_def, head_vars, cache, hidden, token, steps):
  target, head = nnx.merge(target_def, target_vars), nnx.merge(head_def, head_vars)

  def body(_, carry):
    cache, hidden, token = carry
    embeds = target.embed_tokens(token[:, None]).reshape(token.shape[0], 1, -1)
    out, cache = head.extend(hidden[:, None], embeds, cache)
    token = jnp.argmax(target.logits_from_hidden(head.normed(out[:, 0])), axis=-1).astype(jnp.int32)
    return cache, out[:, 0], token

  return jax.lax.fori_loop(0, steps, body, (cache, hidden, token))[2]


def decode_step_seconds(target: Transformer, head: EagleHead, batch: int = 1, context: int = 64,
                        steps: int = 64, repeats: int = 3) -> dict[str, float]:
  """Seconds per greedy decode step of the target (one 1-token ``extend`` + head + argmax) and of the
  drafter (one 1-entry ``extend`` on its own output + the target's head + argmax), at ``batch`` rows after
  ``context`` cached positions: the best of ``repeats`` timed loops of ``steps`` steps after a warm-up.

  Returns ``{"target_s", "drafter_s", "ratio"}`` with ``ratio = target_s / drafter_s`` (the inverse of
  PPOW's cost ratio ``gamma``).
  """
  token = jnp.asarray(np.random.default_rng(0).integers(0, target.cfg.vocab_size, (batch,)), jnp.int32)
  target_def, target_vars = nnx.split(target)
  head_def, head_vars = nnx.split(head)
  head_cache = head.init_cache(batch, context + steps)._replace(lengths=jnp.full((batch,), context, jnp.int32))
  hidden = jnp.zeros((batch, target.cfg.hidden_size), target.cfg.jnp_dtype)
  target_s = target_step_seconds(target, 1, batch, context, steps, repeats)
  drafter_s = seconds_per_step(lambda: _drafter_decode(target_def, target_vars, head_def, head_vars, head_cache,
                                                       hidden, token, steps=steps), steps, repeats)
  return {"target_s": target_s, "drafter_s": drafter_s, "ratio": target_s / drafter_s}


def target_step_seconds(target: Transformer, width: int, batch: int = 1, context: int = 64, steps: int = 64,
                        repeats: int = 3, compiler_options: Mapping[str, str] | None = None) -> float:
  """Seconds per greedy target step of ``width`` tokens per row (``extend`` + LM head + argmax) at ``batch``
  rows after ``context`` cached positions, compiled with ``compiler_options`` (``None``: XLA's defaults):
  best of ``repeats`` timed loops of ``steps`` steps after a warm-up.

  ``width = 1`` is a decode step, ``width = K + 1`` a speculative verification; with
  ``sampler.decode_compiler_options(batch)`` the decode step is compiled as ``generate`` compiles it.
  """
  ids = jnp.asarray(np.random.default_rng(0).integers(0, target.cfg.vocab_size, (batch, context)), jnp.int32)
  _, cache = nnx.jit(Transformer.prefill, static_argnums=3)(target, ids, jnp.ones_like(ids),
                                                             context + steps + width)
  graphdef, variables = nnx.split(target)
  run = _compiled_target_steps(tuple(sorted((compiler_options or {}).items())))
  tokens = ids[:, -width:]
  return seconds_per_step(lambda: run(graphdef, variables, cache, tokens, steps=steps), steps, repeats)
