"""Requantization: recipes give files the validator and the model accept; Q4_K repacks into MLX exactly."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4lab import ModelFileError, gguf, load
from ds4lab.quants import dequantize, imatrix, quantize, requantize, studies
from ds4lab.synth import make_model


@pytest.fixture(scope="module")
def collected(tiny_q2):
    model = load(tiny_q2)
    rng = np.random.default_rng(9)
    return imatrix.collect(model, [[int(t) for t in rng.integers(0, model.config.n_vocab, size=24)]],
                           dataset="ids")


@pytest.fixture(scope="module")
def q4_file(tiny_q2, collected, tmp_path_factory):
    out = tmp_path_factory.mktemp("requant") / "tiny-q4.gguf"
    seen = []
    requantize.requantize(tiny_q2, out, "q4", collected, progress=lambda name, old, new: seen.append(new))
    assert len(seen) == len(gguf.open(tiny_q2).tensors)
    return out


def test_q4_recipe_gives_a_valid_file_that_runs(tiny_q2, q4_file, collected):
    src, out = gguf.open(tiny_q2), gguf.open(q4_file)        # open() runs the layout validator
    assert gguf.inventory_problems(out.config, out.tensors, out.kind) == []
    assert out.variant == "q4" and src.variant == "q2"
    assert list(out.tensors) == list(src.tensors)             # ds4's tensor order
    for name in src.tensors:
        assert out.tensor(name).offset % out.header.alignment == 0
        if "_exps." not in name:
            assert np.array_equal(out.raw(name), src.raw(name)), name
    assert {k: v for k, v in out.metadata.items() if not k.startswith("quantize.")} == src.metadata
    assert out.metadata["quantize.imatrix.entries_count"] == 18
    assert out.header.value_types["quantize.imatrix.entries_count"] == "UINT64"
    logits = np.array(load(q4_file)([0, 100, 2000, 30000]))
    assert logits.shape == (4, out.config.n_vocab) and np.isfinite(logits).all()
    # Each expert's bytes are the (sha-checked, see test_quantize) Q4_K quantizer's on the
    # dequantized 2-bit source with that expert's imatrix slice: nothing lost or mixed up.
    name = "blk.3.ffn_down_exps.weight"
    n_expert, _, cols = src.tensor(name).shape
    for expert in (0, 7, n_expert - 1):
        importance = collected.importance(name, cols, expert, n_expert)
        expected = quantize(requantize.expert_matrix(src, name, expert), "Q4_K", importance)
        assert requantize.expert_bytes(out, name, expert).tobytes() == expected, expert


def test_mixed_recipe_splices_layers(tmp_path):
    src = make_model(tmp_path / "two.gguf", "tiny", "q4", n_layer=2, seed=4)[0]
    out = requantize.requantize(src, tmp_path / "mixed.gguf", "mixed:1")
    a, b = gguf.open(src), gguf.open(out)
    assert b.layer_variants() == ["q2", "q4"] and b.variant == "mixed"
    assert np.array_equal(b.raw("blk.1.ffn_gate_exps.weight"), a.raw("blk.1.ffn_gate_exps.weight"))
    assert np.isfinite(np.array(load(out)([1, 2, 3]))).all()


def test_plan_and_recipe_forms(tiny_q2):
    model_file = gguf.open(tiny_q2)
    table = requantize.plan(model_file, {"blk.2.ffn_down_exps": "Q4_K", "blk.*.ffn_down_exps.weight": "Q2_K"})
    changed = table[table["type"] != table["target"]]
    assert list(changed["name"]) == ["blk.2.ffn_down_exps.weight"]           # first match wins
    assert changed["target_bytes"].iloc[0] == 16 * 256 * 144
    assert requantize.parse_layers("0-2,5") == {0, 1, 2, 5}
    for bad in ("5-2", "x", "-3", "1-2-3"):
        with pytest.raises(ValueError, match="is not N or N-M"):
            requantize.parse_layers(bad)
    keep = requantize.plan(model_file, lambda name, layer, current: None)
    assert (keep["type"] == keep["target"]).all()


def test_a_recipe_ds4_would_reject_writes_nothing(tiny_q2, tmp_path):
    out = tmp_path / "bad.gguf"
    with pytest.raises(ModelFileError, match="one type for both"):
        requantize.requantize(tiny_q2, out, {"blk.0.ffn_gate_exps.weight": "Q4_K"})
    with pytest.raises(ModelFileError, match=r"attn_kv\.weight: type F16"):
        requantize.requantize(tiny_q2, out, {"blk.0.attn_kv.weight": "F16"})
    with pytest.raises(ValueError, match="unknown recipe"):
        requantize.requantize(tiny_q2, out, "q3")
    assert not out.exists()


def test_imatrix_lowers_the_weighted_error(q4_file):
    """Each expert weighted by its own imatrix slice: the weighted error drops against plain Q2_K."""
    model_file = gguf.open(q4_file)
    name = "blk.4.ffn_down_exps.weight"
    rng = np.random.default_rng(1)
    means = rng.lognormal(0, 1.5, size=(16, 256))
    im = imatrix.Imatrix({name: imatrix.ImatrixEntry(means, np.ones(16, np.int64))})
    shape = model_file.tensor(name).shape
    ref = model_file.dequantize(name)
    errors = {}
    for label, weights in (("plain", None), ("imatrix", im)):
        mine = dequantize(requantize.convert_tensor(model_file, name, "Q2_K", weights), "Q2_K", shape)
        errors[label] = sum(((mine[e] - ref[e]) ** 2 * means[e]).sum() for e in range(16))
    assert errors["imatrix"] < 0.9 * errors["plain"]


def test_q4_k_repacks_into_mlx_exactly(q4_file):
    model_file = gguf.open(q4_file)
    check = studies.repack_check(model_file, layers=[0, 3])
    assert len(check) == 2 * 3 * 16 and check["exact"].all()
    name = "blk.3.ffn_gate_exps.weight"
    size = model_file.tensor(name).n_bytes // 16
    codes, scales, biases = studies.q4_k_to_mlx(model_file.raw(name)[5 * size:6 * size], 256, 256)
    x = mx.array(np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32))
    dense = requantize.expert_matrix(model_file, name, 5)
    y = mx.quantized_matmul(x, codes, scales, biases, transpose=True, group_size=32, bits=4)
    np.testing.assert_allclose(np.array(y), np.array(x) @ dense.T, rtol=1e-4, atol=1e-4)


def test_cli_dry_run(tiny_q2, capsys):
    from ds4lab.cli import main

    assert main(["quantize", str(tiny_q2), "unused.gguf", "--recipe", "mixed:5",
                 "--tensor-type", "blk.0.ffn_down_exps=Q4_K", "--dry-run"]) == 0
    changes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("type_change")]
    assert changes == ["type_change: blk.0.ffn_down_exps.weight Q2_K -> Q4_K",
                       *(f"type_change: blk.5.ffn_{r}_exps.weight {t} -> Q4_K"
                         for r, t in (("gate", "IQ2_XXS"), ("up", "IQ2_XXS"), ("down", "Q2_K")))]


def test_cli_refuses_bad_recipes(tiny_q2, capsys):
    from ds4lab.cli import main

    with pytest.raises(SystemExit):
        main(["quantize", str(tiny_q2), "unused.gguf", "--tensor-type", "blk.0.ffn_down_exps", "--dry-run"])
    with pytest.raises(SystemExit):
        main(["quantize", str(tiny_q2), "unused.gguf", "--tensor-type", "blk.0.ffn_down_exps=Q5_K", "--dry-run"])
    assert "expected NAME=TYPE" in capsys.readouterr().err
    assert main(["quantize", str(tiny_q2), "unused.gguf", "--recipe", "mixed:x", "--dry-run"]) == 2
    assert "is not N or N-M" in capsys.readouterr().err
