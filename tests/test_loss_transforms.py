"""Notebook-style walk-through: GRPO advantages and loss under ``jax.jit``, ``jax.vmap`` and ``jax.pmap``.

One pipeline, written once::

    advantages = losses.grpo(rewards, group_ids, num_groups, axis_name=axis_name)
    (loss pair, metrics), d loss.sum / d logp = grpo_loss(...)
    across devices: psum the pair, ops.reduce_metrics the metrics, divide the gradient by the global denominator

is run

1. eagerly on one device (the reference);
2. under ``jax.jit``;
3. under ``jax.vmap`` over a leading axis of ``K`` stacked batches;
4. under ``jax.pmap`` over 4 fake CPU devices (a subprocess with
   ``XLA_FLAGS=--xla_force_host_platform_device_count=4``: the device count is fixed when jax starts, and the
   rest of the suite expects one device in-process), each device holding 4 rows so that every group of 4
   has one member on each device;

and every result must equal the reference within a float32 bound derived below from the number of float32
additions (:func:`tolerances`), never from what one CPU printed.

Why the results are not bit-identical: each transform may add the same numbers in another order (XLA
fuses and vectorises reductions differently under jit / vmap; pmap adds per-device partial sums). Two orders
of a sum of ``n`` float32 terms each lie within ``(n - 1) u sum|x_i|`` of the exact sum (``u = eps / 2``,
``eps = 2^-23``), so they differ by at most ``n eps sum|x_i|``.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lemon_rl import losses
from lemon_rl import ops

B, T, G = 16, 8, 4  # rows, positions, group size
D = 4  # fake devices of the pmap test: rows 4d..4d+3 on device d
K = 3  # stacked batches of the vmap test
NUM_GROUPS = B // G
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
EPS_LOW, EPS_HIGH, DUAL_CLIP, KL_COEF, ENT_COEF = 0.2, 0.28, 3.0, 0.05, 0.01
LOSS_KW = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=DUAL_CLIP, kl_coef=KL_COEF, kl_estimator="k3",
               entropy_coef=ENT_COEF, max_len=T)
EPS = float(np.finfo(np.float32).eps)  # 2^-23


def make_batch(seed: int) -> dict[str, np.ndarray]:
  """One GRPO batch (float32 / int32 NumPy): 4 groups of 4, group ``g`` = rows ``g, g+4, g+8, g+12``."""
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.05, 4.0, size=(B, T))
  mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float32)
  mask[:, 0] = 1.0
  mask[7] = 0.0  # an all-padding row
  return {
      "logp": logp.astype(np.float32),
      "old_logp": (logp + rng.normal(scale=0.7, size=(B, T))).astype(np.float32),  # ratios leave the clip range
      "ref_logp": (logp + rng.normal(scale=0.2, size=(B, T))).astype(np.float32),
      "entropy": rng.uniform(0.0, 2.0, size=(B, T)).astype(np.float32),
      "mask": mask,
      "rewards": rng.normal(size=B).astype(np.float32),
      "group_ids": (np.arange(B) % NUM_GROUPS).astype(np.int32),
  }


def pipeline(batch, mode: str, axis_name=None):
  """Advantages, the loss pair, the gradient of the loss value w.r.t. ``logp``, and the metrics.

  With ``axis_name`` the rows are this device's share: group statistics, the pair and the metrics are
  reduced across the axis, and the local gradient of the pair's sum is divided by the global denominator.
  """
  adv = losses.grpo(batch["rewards"], batch["group_ids"], NUM_GROUPS, axis_name=axis_name)

  def loss_sum(logp):
    pair, metrics = losses.grpo_loss(logp, batch["old_logp"], adv, batch["mask"], ref_logp=batch["ref_logp"],
                                     entropy=batch["entropy"], aggregation=mode, **LOSS_KW)
    return pair.sum, (pair, metrics)

  (_, (pair, metrics)), grad_sum = jax.value_and_grad(loss_sum, has_aux=True)(batch["logp"])
  if axis_name is not None:
    pair = jax.lax.psum(pair, axis_name)
    metrics = ops.reduce_metrics(metrics, axis_name)
  return adv, pair, grad_sum / pair.denominator, metrics


# ---------------------------------------------------------------------------------------------------
# The float32 bounds, from a float64 NumPy transcription of the inputs (METHODS.md section 0).
# ---------------------------------------------------------------------------------------------------


def np_grpo(rewards, group_ids):
  r = rewards.astype(np.float64)
  adv = np.zeros_like(r)
  for g in np.unique(group_ids):
    sel = group_ids == g
    adv[sel] = (r[sel] - r[sel].mean()) / (r[sel].std(ddof=1) + 1e-6)
  return adv


def np_mode_weights(mask, mode):
  """``w [B, T]`` with ``aggregated sum = sum_t w_t x_t`` over the valid tokens, and the denominator."""
  m = mask.astype(np.float64)
  lengths = m.sum(-1, keepdims=True)
  nonempty = float((lengths > 0).sum())
  if mode == "token_mean":
    return m, m.sum()
  if mode == "seq_mean_token_mean":
    return np.where(lengths > 0, m / np.maximum(lengths, 1), 0.0), nonempty
  if mode == "seq_mean_token_sum":
    return m, nonempty
  return m / T, nonempty  # seq_mean_token_sum_norm, max_len = T


def tolerances(batch, mode):
  """Absolute tolerances of every output of :func:`pipeline` against the one-device reference.

  Advantages. For a group of ``G`` rewards the code computes ``shift = max`` (exact in any order), the sum
  ``S1`` of ``r - shift`` (reordering changes it by <= ``G eps G R``, ``R`` the group's range), so the mean
  moves by ``dm <= G eps R``; then ``S2 = sum (r - mean)^2``, ``std = sqrt(S2 / (G-1))`` and
  ``A = (r - mean) / (std + 1e-6)``. By Samuelson's inequality ``R <= 2 sqrt(G) std``, so
  ``dm / std <= 2 G^1.5 eps``; ``S2`` moves by ``2 sum|r - mean| dm + G eps S2`` with ``sum|r - mean| <=
  sqrt(G S2)``, so ``d std / std <= sqrt(2) dm / std + G eps / 2``; adding one rounding per remaining
  operation (4 eps relative), to first order in eps::

      |dA| <= eps (2 G^1.5 + (3 G^1.5 + G / 2 + 4) |A|)

  Loss. The pair's sum is ``sum_t w_t (l_t + kl_coef k_t - ent_coef h_t)`` over the ``n`` valid tokens
  (three aggregates of <= ``n`` terms, then two additions): reordering changes it by <= ``(n + 3) eps
  sum_t w_t |...|``; allow 8 more ``eps |term|`` per token for element-wise operations (exp, clip, products)
  that a fused kernel may round differently. The advantages enter linearly with ``|dl / dA| <= C_t =
  max(rho_t, 1 + eps_high, dual_clip)``, adding ``sum_t w_t C_t |dA_i|``. Denominators are integer
  counts, exact. Metrics: the same bound on each metric's per-token values (0/1 indicators sum exactly).

  Gradient w.r.t. ``logp``: element-wise (``-A rho`` on the unclipped branch, ``1 - exp(ref - logp)`` for
  k3, times ``w_t / den``), so ``w_t / den (C_t |dA_i| + 8 eps (C_t |A_i| + kl_coef |1 - exp(ref - logp)|))``.
  """
  logp, old, ref = (batch[k].astype(np.float64) for k in ("logp", "old_logp", "ref_logp"))
  h, mask = batch["entropy"].astype(np.float64), batch["mask"]
  valid = mask != 0
  n = int(valid.sum())
  adv = np_grpo(batch["rewards"], batch["group_ids"])
  tol_adv = EPS * (2 * G ** 1.5 + (3 * G ** 1.5 + G / 2 + 4) * np.abs(adv))
  a = adv[:, None]
  rho = np.exp(logp - old)
  pg_loss = np.maximum(-a * rho, -a * np.clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH))
  pg_loss = np.where(a < 0, np.minimum(pg_loss, -DUAL_CLIP * a), pg_loss)
  c = np.maximum(rho, max(1 + EPS_HIGH, DUAL_CLIP))
  k3 = np.expm1(ref - logp) - (ref - logp)
  dk3 = np.abs(1 - np.exp(ref - logp))
  w, den = np_mode_weights(mask, mode)
  from_adv = w * c * tol_adv[:, None]
  reorder = (n + 3 + 8) * EPS

  def sum_tol(per_token, weights=w, extra=0.0):
    return reorder * np.sum(np.where(valid, weights * np.abs(per_token), 0.0)) + np.sum(np.where(valid, extra, 0))

  total = pg_loss + KL_COEF * k3 - ENT_COEF * h
  value = np.sum(np.where(valid, w * total, 0)) / den
  ones = np.ones_like(w)
  return {
      "adv": tol_adv,
      "value": sum_tol(np.abs(pg_loss) + KL_COEF * np.abs(k3) + ENT_COEF * h, extra=from_adv) / den
               + EPS * abs(value),
      "grad": w / den * (c * tol_adv[:, None] + 8 * EPS * (c * np.abs(a) + KL_COEF * dk3)),
      # Metric sums (the denominators are exact).
      "metrics": {
          "pg_loss": sum_tol(pg_loss, extra=from_adv), "kl": sum_tol(k3), "entropy": sum_tol(h),
          "ratio_mean": sum_tol(rho, ones), "approx_kl": sum_tol(np.expm1(old - logp) - (old - logp), ones),
          "clip_frac": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0, "dual_clip_frac": 0.0,
      },
      # min / max of element-wise ratios: no additions, only exp's rounding (a few ulp).
      "ratio_extrema_rtol": 4 * EPS,
      "min_abs_adv": float(np.abs(adv).min()),
  }


def assert_within(actual, desired, atol, label):
  """``|actual - desired| <= atol`` element-wise (``atol`` may be an array)."""
  actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  excess = np.abs(actual - desired) - np.broadcast_to(atol, desired.shape)
  worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.ndim else ()
  assert np.all(excess <= 0), (f"{label}: |diff| exceeds the bound by {excess[worst]:.3g} at {worst} "
                               f"(actual {actual[worst]!r}, desired {desired[worst]!r})")


def assert_matches(out, reference, tol, label):
  adv, pair, grad, metrics = jax.tree.map(np.asarray, out)
  ref_adv, ref_pair, ref_grad, ref_metrics = jax.tree.map(np.asarray, reference)
  # Precondition on the data: no advantage is so close to 0 that its sign (hence a clip decision) could flip.
  assert tol["min_abs_adv"] > tol["adv"].max(), label
  assert_within(adv, ref_adv, tol["adv"], f"{label}: advantages")
  np.testing.assert_array_equal(pair.denominator, ref_pair.denominator, err_msg=f"{label}: denominator")
  assert_within(ops.safe_divide(pair.sum, pair.denominator), ref_pair.value, tol["value"], f"{label}: loss")
  assert_within(grad, ref_grad, tol["grad"], f"{label}: gradient")
  assert set(metrics) == set(ref_metrics), label
  for name, metric in metrics.items():
    ref_metric = ref_metrics[name]
    if isinstance(ref_metric, ops.WeightedMetric):
      np.testing.assert_array_equal(metric.denominator, ref_metric.denominator, err_msg=f"{label}: {name}")
      assert_within(metric.sum, ref_metric.sum, tol["metrics"][name], f"{label}: {name}")
    else:
      np.testing.assert_allclose(metric.value, ref_metric.value, rtol=tol["ratio_extrema_rtol"],
                                 err_msg=f"{label}: {name}")


def reference(batch, mode):
  return pipeline({k: jnp.asarray(v) for k, v in batch.items()}, mode)


# ---------------------------------------------------------------------------------------------------
# 1-2. jax.jit and jax.vmap over stacked batches (in-process).
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_jit_equals_eager(mode):
  batch = make_batch(0)
  out = jax.jit(pipeline, static_argnums=1)(batch, mode)
  assert_matches(out, reference(batch, mode), tolerances(batch, mode), f"jit {mode}")
  # The clipped objective is exercised: some tokens are clipped, some dual-clipped.
  metrics = out[3]
  assert float(metrics["clip_frac"].value) > 0.05 and float(metrics["dual_clip_frac"].sum) > 0


@pytest.mark.parametrize("mode", MODES)
def test_vmap_over_stacked_batches_equals_each_batch(mode):
  batches = [make_batch(seed) for seed in range(1, K + 1)]
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
  out = jax.jit(jax.vmap(functools.partial(pipeline, mode=mode)))(stacked)
  for k, batch in enumerate(batches):
    assert_matches(jax.tree.map(lambda x, k=k: x[k], out), reference(batch, mode), tolerances(batch, mode),
                   f"vmap {mode} batch {k}")


# ---------------------------------------------------------------------------------------------------
# 3. jax.pmap over 4 fake devices, groups split across devices (subprocess).
# ---------------------------------------------------------------------------------------------------

_SUBPROCESS = r"""
import functools, json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
import test_loss_transforms as t

assert jax.device_count() == t.D, jax.devices()
batch = t.make_batch(0)
# Device d holds rows 4d..4d+3: one member of every group.
split = {k: v.reshape((t.D, t.B // t.D) + v.shape[1:]) for k, v in batch.items()}
assert all(len(set(split["group_ids"][d])) == t.NUM_GROUPS for d in range(t.D))
out = {}
for mode in t.MODES:
  adv, pair, grad, metrics = jax.device_get(
      jax.pmap(functools.partial(t.pipeline, mode=mode, axis_name="dev"), axis_name="dev")(split))
  out[mode] = {
      "adv": np.asarray(adv).reshape(-1).tolist(),
      "pair": [np.asarray(pair.sum).tolist(), np.asarray(pair.denominator).tolist()],  # one copy per device
      "grad": np.asarray(grad).reshape(t.B, t.T).tolist(),
      "metrics": {k: [np.asarray(leaf).tolist() for leaf in m] for k, m in metrics.items()},
  }
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def pmap_results():
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={D}",
             JAX_PLATFORMS="cpu")
  tests_dir = pathlib.Path(__file__).resolve().parent
  proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, str(tests_dir)], env=env, capture_output=True,
                        text=True, timeout=600, cwd=str(tests_dir.parent))
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("mode", MODES)
def test_pmap_over_four_devices_equals_one_device(pmap_results, mode):
  batch = make_batch(0)
  ref = reference(batch, mode)
  res = pmap_results[mode]
  tol = tolerances(batch, mode)
  for d in range(D):  # every device holds the whole batch's pair and metrics
    kinds = {k: type(m) for k, m in ref[3].items()}
    metrics = {k: kinds[k](*(np.float32(leaf[d]) for leaf in m)) for k, m in res["metrics"].items()}
    pair = ops.WeightedMetric(np.float32(res["pair"][0][d]), np.float32(res["pair"][1][d]))
    out = (np.float32(res["adv"]), pair, np.float32(res["grad"]), metrics)
    assert_matches(out, ref, tol, f"pmap {mode} device {d}")
  # The min / max metrics are the extrema over all devices (a psum would have added them).
  np.testing.assert_allclose(res["metrics"]["ratio_min"][0][0], float(ref[3]["ratio_min"].value), rtol=4 * EPS)
  np.testing.assert_allclose(res["metrics"]["ratio_max"][0][0], float(ref[3]["ratio_max"].value), rtol=4 * EPS)


if __name__ == "__main__":
  pytest.main([__file__])
