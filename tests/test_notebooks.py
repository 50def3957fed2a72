"""Executes every notebook under experiments/notebooks/ with nbclient; any cell error fails the test.

Needs the test extras ``nbformat``, ``nbclient`` and ``ipykernel`` (a ``python3`` kernel).
"""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "experiments" / "notebooks").glob("*.ipynb"))


# The shared losses (GRPO family, GiGPO, FEST) and one notebook per method on top of them.
EXPECTED = ("losses", "cast", "ppow", "lemon", "budgetmix")


def test_every_method_has_a_notebook():
  assert {p.stem for p in NOTEBOOKS} >= set(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  nb = nbformat.read(str(path), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()  # raises CellExecutionError (naming the cell and the exception) on any error
  errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
            if out.get("output_type") == "error"]
  assert not errors, errors
