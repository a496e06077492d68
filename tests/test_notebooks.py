"""Every notebook executes headless and produces its HTML report (what `ds4lab tour` does)."""

from __future__ import annotations

import nbformat
import pytest

from ds4lab.notebooks import NOTEBOOK_DIR, run_notebook

NOTEBOOKS = sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))


def test_there_are_notebooks():
    assert "01_tour" in NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("DS4LAB_CACHE", str(tmp_path / "cache"))
    report = run_notebook(name, tmp_path)
    executed = nbformat.read(report.with_suffix(".ipynb"), as_version=4)
    outputs = [o for cell in executed.cells if cell.cell_type == "code" for o in cell.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert report.stat().st_size > 10_000
