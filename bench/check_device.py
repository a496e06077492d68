"""Same random weights, same tokens: logits on MLX's default device (GPU) against the CPU.

Run on a CUDA or Metal machine to check that the model's GPU paths (quantized matmuls,
batched attention) agree with the CPU paths the tests cover; prints the relative error
and top-1 agreement, and prefill = decode on the device. Then the fast path against the
reference composition on the same device (small and tiny shapes; run with
MLX_ENABLE_TF32=0): top-1 agreement and max |Δlogit| / std (bar 1e-3), prefill vs decode,
and each fused kernel against the composition it replaces.
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import mlx.core as mx
import numpy as np

from ds4lab.config import preset
from ds4lab.model import Model, hc, kernels
from ds4lab.model.moe import _decode
from ds4lab.model.random_weights import _expert_blocks, random_weights


def logits_on(device, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    with mx.stream(device):
        mx.set_default_device(device)
        model = Model(random_weights(preset("small"), "q2", seed=1))
        full = np.array(model(tokens))
        session = model.session()
        decoded = np.stack([np.array(session.decode(t)) for t in tokens])
    return full, decoded


def check_fused_experts() -> None:
    """The fused expert kernels against decode-then-multiply, per block format."""
    for type_name in ("IQ2_XXS", "Q2_K", "Q4_K"):
        if not kernels.available(type_name):
            print(f"{type_name}: no fused kernel on {mx.default_device()}")
            continue
        tensor = _expert_blocks(type_name, 16, 512, 1024)
        ids = mx.array([3, 15, 0, 3, 7, 9], dtype=mx.int32)
        x = mx.random.normal((6, 1024))
        fused = np.array(kernels.expert_matvec(tensor, ids, x))
        ref = np.array((_decode(tensor, ids) @ x[:, :, None])[..., 0])
        print(f"{type_name}: fused kernel vs decode-then-multiply, max rel err "
              f"{np.abs(fused - ref).max() / np.abs(ref).max():.2e}")


def check_fused_kernels() -> None:
    """Each fast-path kernel against the reference composition it replaces, on the device."""
    if not kernels.cuda_ready():
        print(f"no CUDA kernels on {mx.default_device()}")
        return
    for n, t in ((4, 1), (4, 300), (2, 17)):
        mix = mx.random.normal((t, (2 + n) * n))
        scale, base = mx.random.uniform(0.5, 2.0, (3,)), mx.random.normal(((2 + n) * n,))
        fused = kernels.hc_split(mix, scale, base, n, 20, 1e-6)
        ref = hc._split(mix, scale, base, n, 20, 1e-6)
        err = max(float(mx.abs(a - b).max() / mx.abs(b).max()) for a, b in zip(fused, ref, strict=True))
        print(f"hc_split kernel (n_hc {n}, {t} tokens) vs hc._split: max rel err {err:.2e}")


def fast_vs_reference(shape: str, tokens: list[int]) -> None:
    """The fast path against the reference composition on the default device."""
    model = Model(random_weights(preset(shape), "q2", seed=2))
    fast = np.array(model(tokens))
    session = model.session()
    fast_decode = np.stack([np.array(session.decode(t)) for t in tokens])
    model.numerics.allow_fast = False
    ref = np.array(model(tokens))
    scale = ref.std()
    print(f"{shape}: fast path vs reference, top-1 {np.mean(fast.argmax(1) == ref.argmax(1)):.3f}, "
          f"max |Δ| / std {np.abs(fast - ref).max() / scale:.2e} (bar 1e-3); "
          f"fast prefill vs decode {np.abs(fast - fast_decode).max() / scale:.2e}")


def main() -> None:
    check_fused_experts()
    check_fused_kernels()
    for shape in ("small", "tiny"):
        fast_vs_reference(shape, list(range(2000, 2048)))
    gpu = mx.default_device()
    tokens = list(range(2000, 2048))
    g_full, g_dec = logits_on(gpu, tokens)
    c_full, _ = logits_on(mx.cpu, tokens)
    scale = c_full.std()
    print(f"device {gpu}: max |gpu - cpu| / std = {np.abs(g_full - c_full).max() / scale:.2e}, "
          f"top-1 agreement {np.mean(g_full.argmax(1) == c_full.argmax(1)):.3f}")
    print(f"on {gpu}: max |prefill - decode| / std = {np.abs(g_full - g_dec).max() / scale:.2e}")


if __name__ == "__main__":
    main()
