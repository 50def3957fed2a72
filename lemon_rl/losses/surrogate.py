"""The clipped-surrogate settings the RL trainers share, and how an ``rl`` config section is read into them.

:class:`SurrogateSettings` is the base of the trainers' loss dataclasses (``PolicyLoss`` in
:mod:`lemon_rl.training.rl`, ``FestLoss`` in :mod:`lemon_rl.training.fest`). Its ``eps_low``, ``eps_high`` and
``aggregation`` default to ``None``, meaning *the policy loss's own default*
(:data:`lemon_rl.losses.policy_gradient.POLICY_LOSS_DEFAULTS`: ``ppo_clip`` 0.2 / 0.2 ``token_mean``; ``gspo``
3e-4 / 4e-4 ``seq_mean_token_mean``), resolved once, on construction, by
:func:`lemon_rl.losses.policy_gradient.resolve_surrogate_options`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lemon_rl.losses import policy_gradient as pg


@dataclasses.dataclass(frozen=True)
class SurrogateSettings:
  """The clipped-surrogate fields the RL losses share (``PolicyLoss``, FEST's ``FestLoss``).

  Hashable (a static argument of the jitted update). ``None`` for ``eps_low``, ``eps_high`` or
  ``aggregation`` means the policy loss's default; construction replaces it with the resolved value, so
  the fields always hold what the loss uses (``dataclasses.replace`` keeps resolved values: to switch
  ``policy_loss`` and take its defaults, pass ``eps_low=None, eps_high=None, aggregation=None`` too).
  ``dual_clip`` with ``policy_loss="gspo"`` raises (GSPO's ratio is per sequence).

  Attributes:
    policy_loss: a name in :data:`lemon_rl.losses.POLICY_LOSSES`.
    eps_low: lower clip range (``None``: the policy loss's default).
    eps_high: upper clip range (``None``: ``eps_low`` if given, else the policy loss's default).
    dual_clip: dual-clip constant ``c > 1`` or ``None`` (off).
    aggregation: a name in :data:`lemon_rl.losses.AGGREGATIONS` (``None``: the policy loss's default).
    max_len: the constant of ``seq_mean_token_sum_norm`` (``None``: the padded length).
  """

  policy_loss: str = "ppo_clip"
  eps_low: float | None = None
  eps_high: float | None = None
  dual_clip: float | None = None
  aggregation: str | None = None
  max_len: int | None = None

  def __post_init__(self):
    resolved = pg.resolve_surrogate_options(self.policy_loss, eps_low=self.eps_low, eps_high=self.eps_high,
                                            aggregation=self.aggregation, dual_clip=self.dual_clip)
    for name, value in resolved._asdict().items():
      object.__setattr__(self, name, value)

  def surrogate_kwargs(self) -> dict[str, Any]:
    """Keyword arguments of :func:`lemon_rl.losses.grpo_loss` (``dual_clip`` only when set)."""
    kwargs = {"policy_loss": self.policy_loss, "eps_low": self.eps_low, "eps_high": self.eps_high,
              "aggregation": self.aggregation, "max_len": self.max_len}
    if self.dual_clip is not None:
      kwargs["dual_clip"] = self.dual_clip
    return kwargs


def surrogate_fields_from_config(cfg) -> dict[str, Any]:
  """The :class:`SurrogateSettings` fields of an ``rl`` config section, resolved and checked.

  Names are checked against the registries; ``None`` clip ranges and aggregation take the policy loss's
  defaults; ``max_len`` defaults to ``rl.max_new_tokens``.

  Raises:
    ValueError: an unknown name; ``rl.dual_clip`` with ``rl.policy_loss='gspo'``; ``rl.use_tis=True``
      without a positive ``rl.tis_cap`` (the loss would otherwise silently drop the sampler log-probs).
  """
  pg.POLICY_LOSSES.validate(cfg.policy_loss)
  if cfg.get("use_tis"):
    cap = cfg.get("tis_cap")
    if cap is None or isinstance(cap, bool) or not cap > 0:
      raise ValueError(f"rl.use_tis=True needs rl.tis_cap > 0 (the truncation C of the TIS weight "
                       f"min(pi_old / pi_sampler, C)), got rl.tis_cap={cap!r}: set rl.tis_cap or rl.use_tis=False")
  resolved = pg.resolve_surrogate_options(cfg.policy_loss, eps_low=cfg.get("eps_low"),
                                          eps_high=cfg.get("eps_high"), aggregation=cfg.get("aggregation"),
                                          dual_clip=cfg.get("dual_clip"))
  return {"policy_loss": cfg.policy_loss, **resolved._asdict(), "dual_clip": cfg.get("dual_clip"),
          "max_len": cfg.get("max_len") or cfg.max_new_tokens}
