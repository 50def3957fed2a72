"""The row of panels the reports draw (matplotlib, Agg backend): :func:`panels` opens it, :func:`save` writes it."""

from __future__ import annotations


def panels(count: int, width: float = 5.0, height: float = 3.8):
  """``(figure, axes)``: ``count`` axes side by side, each ``width`` x ``height`` inches."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
  return fig, list(axes[0])


def save(fig, axes, path: str) -> str:
  """A light grid and a legend on every axis, then the figure to ``path`` (and closed); returns ``path``."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
