"""ds4lab.quants.quantize: ds4's quantizers (Q8_0, Q2_K, Q4_K, IQ2_XXS) against ds4's own C.

`data/quant_reference.json` holds what ds4's gguf-tools quantizer produced on the matrices
built by `fixed_matrices` (see data/README.md): weighted and plain RMS errors and sha256
digests of the bytes.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType

from ds4lab.quants import QUANTIZABLE, QuantError, column_energy, dequantize, quantize, quantize_q8_0

REFERENCE = json.loads((pathlib.Path(__file__).parent.parent / "data" / "quant_reference.json").read_text())
MATRIX_SEED = 20250901
MATRIX_SHAPE = (256, 2048)


def fixed_matrices() -> dict[str, np.ndarray]:
    """The reference inputs: two weight matrices, an imatrix-like importance vector, edge rows.

    "normal": Gaussian weights; "heavy": Student-t (3 degrees of freedom) weights, whose
    outliers stretch the block scales; "importance": log-normal per-column weights spanning
    several decades, like the mean squared activations of an imatrix; "edge" [8, 512]: rows
    that reach the degenerate branches (zeros, constants, one spike, tiny values), with
    "edge_importance" zero on some columns.
    """
    rng = np.random.default_rng(MATRIX_SEED)
    normal = rng.standard_normal(MATRIX_SHAPE) * 0.02
    heavy = rng.standard_t(3, MATRIX_SHAPE) * 0.02
    importance = rng.lognormal(0.0, 1.5, MATRIX_SHAPE[1])
    edge = np.zeros((8, 512))
    edge[1] = 0.5
    edge[2] = -0.25
    edge[3, 300] = 3.0
    edge[4] = np.where(np.arange(512) % 2, 1e-20, -1e-20)
    edge[5] = rng.standard_normal(512) * 1e-3
    edge[6, :256] = rng.standard_normal(256)
    edge[7] = np.linspace(-1.0, 1.0, 512)
    edge_importance = rng.lognormal(0.0, 1.0, 512)
    edge_importance[::7] = 0.0
    edge_importance[256:288] = 0.0
    return {
        "normal": normal.astype(np.float32),
        "heavy": heavy.astype(np.float32),
        "importance": importance.astype(np.float32),
        "edge": edge.astype(np.float32),
        "edge_importance": edge_importance.astype(np.float32),
    }


def weighted_rms(x: np.ndarray, y: np.ndarray, importance: np.ndarray) -> float:
    """sqrt(sum_rc imp_c (x - y)^2 / (rows * sum_c imp_c)): the error an imatrix cares about."""
    err = (x.astype(np.float64) - y) ** 2 @ importance.astype(np.float64)
    return float(np.sqrt(err.sum() / (len(x) * importance.astype(np.float64).sum())))


def rms(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2)))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def matrices() -> dict[str, np.ndarray]:
    mats = fixed_matrices()
    for name, digest in REFERENCE["inputs_sha256"].items():
        if sha256(mats[name].tobytes()) != digest:
            pytest.fail(f"numpy now generates a different {name!r} matrix from the seed; regenerate the reference")
    return mats


@pytest.fixture(scope="module")
def encoded(matrices) -> dict[str, bytes]:
    """Our bytes for every reference case, keyed like the reference ("TYPE/matrix/plain|imatrix")."""
    out = {}
    for key in REFERENCE["cases"]:
        type_name, matrix, mode = key.split("/")
        imp_name = "edge_importance" if matrix == "edge" else "importance"
        out[key] = quantize(matrices[matrix], type_name, matrices[imp_name] if mode == "imatrix" else None)
    return out


def test_reference_covers_every_case():
    keys = {
        f"{t}/{m}/{mode}" for t in QUANTIZABLE for m in ("normal", "heavy", "edge") for mode in ("plain", "imatrix")
    }
    assert set(REFERENCE["cases"]) == keys


@pytest.mark.parametrize("key", sorted(REFERENCE["cases"]))
def test_errors_within_2_percent_of_ds4(key, matrices, encoded):
    type_name, matrix, _ = key.split("/")
    ref = REFERENCE["cases"][key]
    x = matrices[matrix]
    y = dequantize(encoded[key], type_name, x.shape)
    imp = matrices["edge_importance" if matrix == "edge" else "importance"]
    assert weighted_rms(x, y, imp) == pytest.approx(ref["weighted_rms"], rel=0.02, abs=1e-12)
    assert rms(x, y) == pytest.approx(ref["rms"], rel=0.02, abs=1e-12)


@pytest.mark.parametrize("key", sorted(REFERENCE["cases"]))
def test_bytes_identical_to_ds4(key, encoded):
    """Same float32 operations in the same order as the C, so the same bytes.

    Includes IQ2_XXS, whose neighbour distances come from a BLAS product: a different BLAS
    could round a near-tie the other way, which would show up here first (and not above).
    """
    assert sha256(encoded[key]) == REFERENCE["cases"][key]["sha256"]


@pytest.mark.parametrize("type_name", QUANTIZABLE)
@pytest.mark.parametrize("matrix", ["normal", "heavy"])
def test_importance_lowers_the_weighted_error(type_name, matrix, matrices):
    x, imp = matrices[matrix], matrices["importance"]
    plain = weighted_rms(x, dequantize(quantize(x, type_name), type_name, x.shape), imp)
    weighted = weighted_rms(x, dequantize(quantize(x, type_name, imp), type_name, x.shape), imp)
    if type_name == "Q8_0":
        assert weighted == plain  # ds4's Q8_0 has no weighted path
    else:
        assert weighted < 0.97 * plain


@pytest.mark.parametrize("type_name", QUANTIZABLE)
@pytest.mark.parametrize("with_importance", [False, True])
def test_gguf_py_decodes_what_we_decode(type_name, with_importance, matrices):
    x = matrices["heavy"][:64]
    data = quantize(x, type_name, matrices["importance"] if with_importance else None)
    ours = dequantize(data, type_name, x.shape)
    raw = np.frombuffer(data, dtype=np.uint8).reshape(len(x), -1)
    theirs = gguf.quants.dequantize(raw, GGMLQuantizationType[type_name])
    assert theirs.shape == x.shape
    np.testing.assert_array_equal(ours, theirs)


def test_q8_0_matches_gguf_py_quantizer(matrices):
    x = matrices["heavy"]
    assert quantize(x, "Q8_0") == gguf.quants.quantize(x, GGMLQuantizationType.Q8_0).tobytes()
    assert quantize(x, "Q8_0") == quantize_q8_0(x).tobytes()


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_round_trip_is_stable(type_name, matrices):
    """Re-quantizing decoded weights lands (almost) on the same values: they are representable."""
    x = matrices["normal"][:64]
    once = dequantize(quantize(x, type_name), type_name, x.shape)
    twice = dequantize(quantize(once, type_name), type_name, x.shape)
    assert rms(once, twice) <= 0.25 * rms(x, once)


def test_iq2_xxs_defaults_to_column_energy(matrices):
    x = matrices["normal"][:32]
    assert quantize(x, "IQ2_XXS") == quantize(x, "IQ2_XXS", column_energy(x))
    np.testing.assert_allclose(column_energy(x), (x.astype(np.float64) ** 2).sum(axis=0), rtol=1e-5)


@pytest.mark.parametrize("shape", [(0, 256), (3, 0)])
def test_empty_matrix_gives_no_bytes(shape):
    for type_name in QUANTIZABLE:
        assert quantize(np.zeros(shape, np.float32), type_name) == b""


def test_zero_matrix_gives_zeros_quietly():
    x = np.zeros((2, 256), dtype=np.float32)
    with np.errstate(all="raise"):
        for type_name in QUANTIZABLE:
            for imp in (None, np.zeros(256, dtype=np.float32)):
                assert not dequantize(quantize(x, type_name, imp), type_name, x.shape).any()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((np.zeros((2, 300), np.float32), "Q4_K"), "not a multiple of the block size 256"),
        ((np.zeros((2, 48), np.float32), "Q8_0"), "not a multiple of the block size 32"),
        ((np.zeros((2, 256), np.float32), "Q2_K", np.ones(255, np.float32)), "one weight per column"),
        ((np.zeros((2, 256), np.float32), "IQ2_XXS", np.ones((2, 256), np.float32)), "one weight per column"),
        ((np.zeros((2, 256), np.float32), "Q4_K", np.full(256, np.nan, np.float32)), "finite and >= 0"),
        ((np.zeros((2, 256), np.float32), "Q4_K", -np.ones(256, np.float32)), "finite and >= 0"),
        ((np.zeros(256, np.float32), "Q8_0"), "2-D"),
        ((np.zeros((2, 256), np.int32), "Q8_0"), "float array"),
        ((np.full((2, 256), np.inf, np.float32), "Q2_K"), "NaN or infinite"),
        ((np.zeros((2, 256), np.float32), "F16"), "cannot quantize to F16"),
        ((np.zeros((2, 256), np.float32), "Q6_K"), "unsupported tensor type"),
    ],
)
def test_bad_input_is_a_clear_quant_error(args, message):
    with pytest.raises(QuantError, match=message) as info:
        quantize(*args)
    assert isinstance(info.value, ValueError)
