"""The CPU's native Q8_0 kernel (kernels/cpu/q8_0_matmul.c): the documented order of its sums,
bit for bit; rows that do not depend on their batch or the thread count; the model's use of it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4lab.model import cpu_kernels
from ds4lab.model.weights import Q8Matrix


def random_q8(rows: int, cols: int, seed: int = 0) -> tuple[Q8Matrix, np.ndarray, np.ndarray]:
    """A Q8_0 matrix from random GGUF blocks, with its int8 codes and float32 scales."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, (rows, cols // 32, 32), dtype=np.int8)
    d = (rng.random((rows, cols // 32)) * 0.02 + 1e-4).astype(np.float16)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    return Q8Matrix.from_blocks(raw.reshape(-1), rows, cols), q, d.astype(np.float32)


def documented_order(q: np.ndarray, d: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's header, step by step in float32: per block p[l] = sum_k q·x over the four
    8-lane slices in order, acc[l] += d·p[l], then the fixed tree over the eight lanes."""
    f = np.float32
    qf = q.astype(f)                                             # [rows, blocks, 32], exact
    xb = x.astype(f).reshape(x.shape[0], 1, -1, 32)              # [T, 1, blocks, 32]
    acc = np.zeros((x.shape[0], q.shape[0], 8), f)
    for b in range(q.shape[1]):
        p = qf[None, :, b, 0:8] * xb[:, :, b, 0:8]
        for k in range(1, 4):
            p = p + qf[None, :, b, 8 * k:8 * k + 8] * xb[:, :, b, 8 * k:8 * k + 8]
        acc = acc + d[None, :, b, None] * p
    a = acc
    return ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))


@pytest.mark.parametrize("rows,cols,tokens", [(37, 64, 1), (300, 96, 7), (5, 256, 9), (1030, 32, 4)])
def test_sums_follow_the_documented_order_bit_for_bit(rows, cols, tokens):
    matrix, q, d = random_q8(rows, cols, seed=rows)
    x = np.random.default_rng(1).standard_normal((tokens, cols)).astype(np.float32) * 3
    y = np.array(cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.array(x)))
    assert y.shape == (tokens, rows)
    np.testing.assert_array_equal(y, documented_order(q, d, x))
    exact = x.astype(np.float64) @ (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(rows, cols).T
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    rows, cols = 2051, 128
    matrix, _, _ = random_q8(rows, cols)
    x = np.random.default_rng(2).standard_normal((11, cols)).astype(np.float32)
    batch = np.array(cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.array(x)))
    for t in range(11):
        alone = np.array(cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.array(x[t:t + 1])))
        np.testing.assert_array_equal(alone[0], batch[t])
    lib = cpu_kernels._library()
    codes = np.ascontiguousarray(np.asarray(matrix.codes).view(np.uint8))
    scales = np.ascontiguousarray(np.asarray(matrix.scales))
    for threads in (1, 3, 16):
        y = np.empty((11, rows), np.float32)
        assert lib.ds4lab_q8_0_matmul(codes.ctypes.data, scales.ctypes.data, x.ctypes.data, y.ctypes.data,
                                      rows, cols, 11, threads) == 0
        np.testing.assert_array_equal(y, batch)
    y = np.empty((1, rows), np.float32)
    assert lib.ds4lab_q8_0_matmul(codes.ctypes.data, scales.ctypes.data, x.ctypes.data, y.ctypes.data,
                                  rows, cols - 1, 1, 1) == -1


def test_shapes_are_checked():
    matrix, _, _ = random_q8(8, 64)
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.q8_0_matmul(matrix.codes, matrix.scales, mx.zeros((2, 32)))
    with pytest.raises(ValueError, match="Q8_0 matrix"):
        cpu_kernels.q8_0_matmul(matrix.codes[:4], matrix.scales, mx.zeros((2, 64)))


def test_the_model_reads_its_output_head_in_codes_and_agrees_with_the_blas_product(tiny_q2, monkeypatch, on_cpu):
    import ds4lab

    model = ds4lab.load(tiny_q2)
    head = model.weights.output
    assert cpu_kernels.handles(head.rows, head.cols) and head.float32 is None
    tokens = list(range(1000, 1024))
    native = np.array(model.session().prefill_all(tokens).logits)
    monkeypatch.setattr(cpu_kernels, "handles", lambda rows, cols: False)
    blas = np.array(model.session().prefill_all(tokens).logits)
    assert not np.array_equal(native, blas)               # two float orders, both exercised
    assert np.abs(native - blas).max() <= 1e-5 * blas.std()
    assert (native.argmax(axis=1) == blas.argmax(axis=1)).all()
