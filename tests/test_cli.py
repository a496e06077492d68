"""The `ds4lab` command line: make-model, info, errors."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4lab.cli", *args], capture_output=True, text=True, timeout=300)


def test_make_model_then_info(tmp_path):
    out = tmp_path / "m.gguf"
    made = _run("make-model", "--preset", "small", "--variant", "q4", "--mtp", "--seed", "2",
                "--vocab-rows", "32", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert made.stdout.split() == [str(out), str(tmp_path / "m-mtp.gguf")]

    info = _run("info", str(out), "--json")
    assert info.returncode == 0, info.stderr
    summary = json.loads(info.stdout)
    assert summary["variant"] == "q4" and summary["kind"] == "main"
    assert summary["config"]["n_head"] == 6 and summary["config"]["compress_ratios"] == [0, 4, 128, 4, 0]
    assert sum(summary["components"].values()) == sum(t["bytes"] for t in summary["tensors"])
    assert {"name", "type", "dims", "bytes", "component", "layer"} <= set(summary["tensors"][0])

    text = _run("info", str(tmp_path / "m-mtp.gguf"), "--main", str(out))
    assert text.returncode == 0 and "kind mtp" in text.stdout and "n_expert" in text.stdout


def test_bad_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    result = _run("info", str(bad))
    assert result.returncode == 2
    assert result.stderr.startswith(f"ds4lab: {bad}") and "Traceback" not in result.stderr
