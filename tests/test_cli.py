"""The `ds4lab` command line: make-model, info, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


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


def test_logits_command(tmp_path, tiny_q2):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(3000, 3012))))
    out = tmp_path / "run.npz"
    result = _run("logits", str(tiny_q2), "--tokens", str(ids), "--top-k", "5", "--gen", "3",
                  "--numerics", "float", "--out", str(out))
    assert result.returncode == 0, result.stderr
    import numpy as np

    from ds4lab import load

    z = np.load(out)
    assert z["tokens"].tolist() == list(range(3000, 3012))
    assert z["topk_ids"].shape == (12, 5) and z["topk_ids"].dtype == np.int32
    assert z["experts"].shape == (12, 6, 6) and z["gen_ids"].shape == (3,)
    logits = np.array(load(tiny_q2)(list(range(3000, 3012))))
    assert np.array_equal(z["topk_ids"][:, 0], logits.argmax(1))
    assert np.allclose(z["logsumexp"], np.log(np.exp(logits.astype(np.float64)).sum(1)), rtol=1e-5)
    assert z["gen_ids"][0] == logits[-1].argmax() and z["gen_topk_ids"][0, 0] == z["gen_ids"][0]
    assert (np.diff(z["gen_topk_logits"], axis=1) <= 0).all()


def test_info_memory(tiny_q2):
    result = _run("info", str(tiny_q2), "--memory", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    resident = report["resident_bytes"]
    # Q8_0 output head: 40 bytes per 32 weights (not a float32 head); the HC mixer (F16) widened
    # to float32; the F32 vectors as they are. Routed experts keep their block bytes.
    head = 129280 * 256 // 32 * 40
    hc_fn, hc_base, hc_scale, norm = 4 * 256 * 4 * 4, 4 * 4, 1 * 4, 256 * 4
    assert resident["output"] == head + hc_fn + hc_base + hc_scale + norm
    # 6 layers x 16 experts x 256 rows, one 256-value block per row: IQ2_XXS gate/up, Q2_K down.
    assert resident["routed experts"] == 6 * 16 * 256 * (2 * 66 + 84)


def test_generate_command(tmp_path, tiny_q2):
    text = _run("generate", str(tiny_q2), "--prompt", "Hello there", "--max-tokens", "4")
    assert text.returncode == 0, text.stderr
    from ds4lab import load
    from ds4lab.generation import generate

    model = load(tiny_q2)
    assert text.stdout == generate(model, "Hello there", max_tokens=4).text + "\n"
    dump = tmp_path / "d.json"
    made = _run("generate", str(tiny_q2), "--prompt", "Hello there", "--max-tokens", "2",
                "--dump-logprobs", str(dump), "--top-logprobs", "3")
    assert made.returncode == 0, made.stderr
    doc = json.loads(dump.read_text())
    assert len(doc["steps"]) == 2 and len(doc["steps"][0]["top_logprobs"]) == 3


def test_render_command_prints_ds4s_bytes():
    oracle = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a" / "prompt"
    result = subprocess.run([sys.executable, "-m", "ds4lab.cli", "render", str(oracle / "request.json")],
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (oracle / "rendered.txt").read_bytes()


def test_tokenize_and_chat_commands(tmp_path, tiny_q2):
    oracle = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a"
    count = _run("tokenize", str(oracle / "prompt" / "rendered.txt"), "--mode", "ds4", "--count")
    assert count.returncode == 0 and count.stdout.strip() == "392"
    ids = _run("tokenize", str(oracle / "prompt" / "rendered.txt"), "--mode", "ds4")
    import numpy as np

    assert json.loads(ids.stdout) == np.load(oracle / "oracle.npz")["tokens"].tolist()
    chat = subprocess.run([sys.executable, "-m", "ds4lab.cli", "chat", str(tiny_q2), "--max-tokens", "3"],
                          input="Hello\nAgain\n", capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("\n") >= 2 and chat.stdout.strip()


def test_lab_refuses_a_missing_model(tmp_path):
    result = _run("lab", "--model", str(tmp_path / "absent.gguf"))
    assert result.returncode == 2
    assert result.stderr == f"ds4lab: {tmp_path / 'absent.gguf'}: no such model file\n"
