"""Analytic FLOP counts of the decoder (PaLM convention, causal attention counted once).

Per token of a sequence of length ``T``, forward:

    2 * (N_matmul + V * E) + 4 * L * H * D * (T + 1) / 2

with ``N_matmul = L * (E*(H+2K)*D + H*D*E + 3*E*F)`` the non-embedding matmul parameters (fused QKV, output,
gate/up/down), ``V * E`` the LM head and the last term the causal ``q k^T`` and ``p v`` products (query ``t``
sees ``t + 1`` keys on average ``(T + 1) / 2``). Forward + backward is 3x the forward. The counts are of the
padded shapes a step computes (what the machine spends), not of the real tokens.
"""

from __future__ import annotations

from lemon_rl.models.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
  """``N_matmul + V * E``: the parameters that take part in a matmul per token."""
  e, h, k, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  return cfg.num_layers * (e * (h + 2 * k) * d + h * d * e + 3 * e * f) + cfg.vocab_size * e


def forward_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
  """Forward FLOPs of ``batch`` sequences of ``seq`` tokens (full causal pass or cached decoding alike)."""
  attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (seq + 1) / 2
  return float(batch) * seq * (2 * matmul_params(cfg) + attention)


def train_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
  """Forward + backward FLOPs: ``3 * forward_flops``."""
  return 3.0 * forward_flops(cfg, batch, seq)


def rl_step_flops(cfg: ModelConfig, rows: int, seq: int, *, update_passes: int, scoring_passes: int) -> float:
  """One RL step on ``rows`` sequences padded to ``seq`` tokens (prompt + completion slots).

  Sampling is one forward over the padded sequence (prefill plus cached decoding of every completion slot),
  ``scoring_passes`` forwards score old / reference log-probs, and ``update_passes`` forward + backward passes
  train on the batch (``rl.num_iterations``).
  """
  return (1 + scoring_passes) * forward_flops(cfg, rows, seq) + update_passes * train_flops(cfg, rows, seq)
