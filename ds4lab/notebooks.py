"""Run the notebooks headless: jupytext py:percent source -> executed notebook -> HTML report.

The notebooks live in `notebooks/NN_topic.py` beside the package (a source checkout); the
same function backs `ds4lab tour` and the test that executes every notebook in CI.
"""

from __future__ import annotations

from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def notebook_path(name: str) -> Path:
    """`notebooks/<name>.py` (the name may omit or include the .py suffix)."""
    path = Path(name)
    if path.suffix != ".py":
        path = NOTEBOOK_DIR / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"notebook {path} not found (ds4lab's notebooks ship with a source checkout)")
    return path


def run_notebook(name: str, out_dir: Path, timeout: int = 900) -> Path:
    """Execute one notebook in a fresh kernel and write `<out_dir>/<name>.html` (and .ipynb)."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    source = notebook_path(name)
    nb = jupytext.read(source)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(source.parent)}}).execute()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = source.stem
    nbformat.write(nb, out_dir / f"{stem}.ipynb")
    html, _ = HTMLExporter().from_notebook_node(nb)
    report = out_dir / f"{stem}.html"
    report.write_text(html, encoding="utf-8")
    return report
