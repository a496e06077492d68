"""Same random weights, same tokens: logits on MLX's default device (GPU) against the CPU.

Run on a CUDA or Metal machine to check that the model's GPU paths (quantized matmuls,
batched attention) agree with the CPU paths the tests cover; prints the relative error
and top-1 agreement, and prefill = decode on the device.
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import mlx.core as mx
import numpy as np

from ds4lab.config import preset
from ds4lab.model import Model, kernels
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


def main() -> None:
    check_fused_experts()
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
