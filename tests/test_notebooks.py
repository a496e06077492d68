"""`ds4lab tour`'s path: a notebook executed headless into its HTML report. Every notebook is
run, checked for errors, stderr and figures, in JupyterLab by tests/test_browser.py."""

from __future__ import annotations

import nbformat

from ds4lab.notebooks import NOTEBOOK_DIR, run_notebook


def test_there_are_notebooks():
    assert (NOTEBOOK_DIR / "01_tour.py").is_file()


def test_tour_report(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4LAB_CACHE", str(tmp_path / "cache"))
    report = run_notebook("01_tour", tmp_path)
    executed = nbformat.read(report.with_suffix(".ipynb"), as_version=4)
    outputs = [o for cell in executed.cells if cell.cell_type == "code" for o in cell.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert report.stat().st_size > 10_000
