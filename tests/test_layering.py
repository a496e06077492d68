"""Layers point one way: files -> config/weights -> model -> hooks/cache files -> tables/plots.

kvc/ is the .kv file format (numpy only: no model, no cache policy, no MLX); cache/ may read
kvc/ but not the model; the core model does not import the feature modules at import time."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds4lab"


def _imports(folder: str) -> dict[str, set[str]]:
    """file -> every module it imports (relative imports resolved under ds4lab), at any depth."""
    out = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(parts[: len(parts) - node.level]) if node.level else ""
                names.add(".".join(p for p in (base, node.module or "") if p))
        out[str(path.relative_to(PACKAGE))] = names
    return out


def test_kvc_is_a_pure_file_format_layer():
    for file, names in _imports("kvc").items():
        bad = {n for n in names if n.startswith(("ds4lab.model", "ds4lab.cache", "ds4lab.generation",
                                                  "ds4lab.hooks", "ds4lab.steering", "mlx"))}
        assert not bad, (file, bad)


def test_cache_policy_does_not_need_the_model():
    for file, names in _imports("cache").items():
        bad = {n for n in names if n.startswith(("ds4lab.model", "ds4lab.steering", "mlx"))}
        assert not bad, (file, bad)


def test_model_modules_do_not_import_feature_modules_at_import_time():
    for path in sorted((PACKAGE / "model").glob("*.py")):
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {(n.module or "") for n in top if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n.lstrip(".").split(".")[0] in ("steering", "interventions", "cache",
                                                                         "generation", "notebooks")}, path.name
