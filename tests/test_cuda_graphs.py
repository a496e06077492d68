"""ds4lab sizes MLX CUDA's graphs at import (`ds4lab._cuda_graphs`), before MLX makes a stream."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ds4lab._cuda_graphs import GRAPH_MB

_READ = "import os, ds4lab; print(os.environ.get('MLX_MAX_MB_PER_BUFFER'))"


def _after_import(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", _READ], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="set on Linux only (Metal keeps MLX's own)")
def test_import_sets_the_graph_limit_and_keeps_the_users():
    env = {k: v for k, v in os.environ.items() if k != "MLX_MAX_MB_PER_BUFFER"}
    assert _after_import(env) == str(GRAPH_MB)
    assert _after_import(env | {"MLX_MAX_MB_PER_BUFFER": "500"}) == "500"
