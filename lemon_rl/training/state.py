"""Train state, optimizer and the jitted update with exact gradient accumulation.

The model is split once into a static ``graphdef`` and a parameter pytree; everything below is a pure
function of ``TrainState`` and arrays. A loss function has the signature

    loss_fn(model, batch) -> (WeightedMetric, metrics)

where ``WeightedMetric(sum, denominator)`` is the *unreduced* loss and ``metrics`` a dict of additive
metrics (``lemon_rl.ops``). The update splits a minibatch into ``num_microbatches`` equal slices, sums the
gradients of each slice's ``sum`` and divides once by the total denominator, so the step is exactly that
of the whole minibatch (the denominator never depends on the parameters).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lemon_rl import ops

LossFn = Callable[[nnx.Module, Any], tuple[ops.WeightedMetric, dict[str, Any]]]


class TrainState(flax.struct.PyTreeNode):
  """Parameters, optimizer state, step counter and base PRNG key data (``uint32``)."""

  params: Any
  opt_state: Any
  step: jax.Array
  rng: jax.Array


SCHEDULES = ("cosine", "constant")


def make_schedule(learning_rate: float, total_steps: int, warmup_steps: int = 0, end_lr_fraction: float = 0.0,
                  schedule: str = "cosine") -> optax.Schedule:
  """The learning rate of update ``k`` (``k = 0`` is the first update).

  With ``warmup_steps = W > 0`` the rate rises linearly from 0 at ``k = 0`` to ``learning_rate`` at ``k = W``
  (optax's convention: the first update only fills Adam's moments); with ``W = 0`` the first update already
  has the full ``learning_rate``, for every schedule. Then ``cosine`` decays to
  ``learning_rate * end_lr_fraction`` at ``k = total_steps``; ``constant`` stays at ``learning_rate``.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
  if schedule == "cosine":
    decay = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup_steps, 1), alpha=end_lr_fraction)
  else:
    decay = optax.constant_schedule(learning_rate)
  if not warmup_steps:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), decay], [warmup_steps])


def make_optimizer(learning_rate: float, total_steps: int, warmup_steps: int = 0, weight_decay: float = 0.0,
                   max_grad_norm: float | None = 1.0, b1: float = 0.9, b2: float = 0.999,
                   end_lr_fraction: float = 0.0, schedule: str = "cosine") -> optax.GradientTransformation:
  """AdamW with global-norm clipping and the learning rate of :func:`make_schedule`."""
  lr = make_schedule(learning_rate, total_steps, warmup_steps, end_lr_fraction, schedule)
  chain = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
  chain.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*chain)


def create_train_state(model: nnx.Module, optimizer: optax.GradientTransformation, seed: int):
  """Returns ``(graphdef, TrainState)``.

  The state is built inside ``jax.jit`` so that every leaf (optimizer moments, step, key) gets the sharding
  XLA propagates from the parameters: the same shardings the jitted update returns, so the update compiles
  once rather than once more on its second call.
  """
  graphdef, params = nnx.split(model, nnx.Param)
  key_data = jax.random.key_data(jax.random.key(seed))

  @jax.jit
  def init(params):
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                      rng=key_data)

  return graphdef, init(params)


def step_key(state: TrainState, *salt: int) -> jax.Array:
  """A PRNG key derived from the base key, the step and ``salt``: identical after a resume."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  for s in salt:
    key = jax.random.fold_in(key, s)
  return key


def merge_model(graphdef, params) -> nnx.Module:
  return nnx.merge(graphdef, params)


def _split_microbatches(batch: Any, num_microbatches: int) -> Any:
  def split(x):
    if x.shape[0] % num_microbatches:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {num_microbatches} micro-batches")
    return x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:])

  return jax.tree.map(split, batch)


def accumulate_gradients(graphdef, params, batch: Any, loss_fn: LossFn, num_microbatches: int = 1):
  """Sums ``grad(loss.sum)`` and the metrics over micro-batches.

  Returns:
    ``(loss, metrics, grad_sum)`` with ``loss`` a ``WeightedMetric`` over the whole batch; the exact
    gradient of the batch loss is ``grad_sum / loss.denominator``.
  """

  def sum_and_metrics(p, micro):
    loss, metrics = loss_fn(nnx.merge(graphdef, p), micro)
    return loss.sum, (loss, metrics)

  grad_fn = jax.grad(sum_and_metrics, has_aux=True)
  if num_microbatches == 1:
    grads, (loss, metrics) = grad_fn(params, batch)
    return loss, metrics, grads

  micro = _split_microbatches(batch, num_microbatches)
  first = jax.tree.map(lambda x: x[0], micro)
  grads, (loss, metrics) = grad_fn(params, first)

  def body(carry, m):
    g_acc, l_acc, met_acc = carry
    g, (l, met) = grad_fn(params, m)
    return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, ops.merge_metrics(met_acc, met)), None

  rest = jax.tree.map(lambda x: x[1:], micro)
  (grads, loss, metrics), _ = jax.lax.scan(body, (grads, loss, metrics), rest)
  return loss, metrics, grads


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_fn", "optimizer", "num_microbatches"),
                   donate_argnames=("state",))
def update_step(graphdef, state: TrainState, batch: Any, *, loss_fn: LossFn,
                optimizer: optax.GradientTransformation, num_microbatches: int = 1):
  """One optimizer step on ``batch``; returns ``(new_state, {name: scalar})``."""
  loss, metrics, grad_sum = accumulate_gradients(graphdef, state.params, batch, loss_fn, num_microbatches)
  return apply_gradient_sum(state, loss, metrics, grad_sum, optimizer)


def apply_gradient_sum(state: TrainState, loss, metrics, grad_sum, optimizer: optax.GradientTransformation):
  """The optimizer step from :func:`accumulate_gradients`' outputs: ``grads = grad_sum / loss.denominator``,
  ``state.params`` updated and ``state.step + 1``; returns ``(new_state, {name: scalar})`` with the reduced
  ``metrics``, ``"loss"`` and ``"grad_norm"`` (the global L2 norm of ``grads``)."""
  grads = jax.tree.map(lambda g: g / jnp.maximum(loss.denominator, 1e-9), grad_sum)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  values = ops.metric_values(metrics)
  values["loss"] = loss.value
  values["grad_norm"] = optax.tree.norm(grads)
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), values
