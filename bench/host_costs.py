"""Host time per primitive, by kind: what one more operation in a decode step costs the host.

A 43-layer decode step on the H200 is host-bound (the device finishes ~0.5 ms after the host
has encoded the step), so its speed is the number of primitives in its graph times what each
costs to build (Python, `mx` calls) and to encode (`mx.async_eval`: MLX's eval loop, buffer
allocation, the CUDA graph node). This builds a graph of `--ops` primitives of one kind, each
depending on the one before (as a step's are), on tiny arrays so the device time is nothing,
and prints per kind: µs per primitive to build, to encode, and to finish on the device.

    python bench/host_costs.py [--ops 2000] [--repeat 3]
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import time
from collections.abc import Callable

import mlx.core as mx

from ds4lab.model import kernels

ADD_ONE = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[0]) out[i] = x[i] + 1.0f;
"""


def _kinds() -> dict[str, Callable[[mx.array], mx.array]]:
    """Each kind: one primitive from the array before (a [256] float32 vector)."""
    w = mx.random.normal((256, 256))
    index = mx.array([3, 1, 2, 0] * 64)
    fused = mx.compile(lambda x: mx.maximum(x * 0.5 + 1.0, -x))
    kinds = {
        "add (elementwise)": lambda x: x + 1.0,
        "compiled elementwise chain (3 ops fused)": fused,
        "reshape (a view)": lambda x: x.reshape(16, 16).reshape(256),
        "slice (a view: reversed)": lambda x: x[::-1],
        "concatenate of two halves": lambda x: mx.concatenate([x[128:], x[:128]]),
        "gather (take)": lambda x: x[index],
        "sum (reduction, keepdims then broadcast)": lambda x: x - x.sum(keepdims=True),
        "float32 matvec (Matmul 256x256)": lambda x: w @ x,
    }
    constants = [mx.array([float(i)]) for i in range(7)]
    if kernels.cuda_ready():
        # The fast path's kernels take 4-8 inputs (small constants among them) and some write
        # several outputs: what each input and output adds to a launch's host cost.
        kernel = mx.fast.cuda_kernel(name="host_cost_add", input_names=["x"], output_names=["out"], source=ADD_ONE)
        wide = mx.fast.cuda_kernel(name="host_cost_add8", input_names=["x", *"abcdefg"], output_names=["out"],
                                   source=ADD_ONE)
        outs = mx.fast.cuda_kernel(name="host_cost_add_4out", input_names=["x"], output_names=["out", "o1", "o2", "o3"],
                                   source=ADD_ONE)
        kinds["custom kernel (mx.fast.cuda_kernel)"] = lambda x: kernel(
            inputs=[x], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
            output_dtypes=[x.dtype])[0]
        kinds["custom kernel, 8 inputs (7 constants)"] = lambda x: wide(
            inputs=[x, *constants], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
            output_dtypes=[x.dtype])[0]
        kinds["custom kernel, 4 outputs (3 unused)"] = lambda x: outs(
            inputs=[x], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape] * 4,
            output_dtypes=[x.dtype] * 4)[0]
        # MLX hashes a custom kernel's whole source (header included) at every evaluation, and
        # commits a CUDA graph once its inputs pass MLX_MAX_MB_PER_BUFFER (1000 MB on an H100
        # or H200), counting each input whole: a routed-expert tensor is 0.5-0.7 GB.
        # Earlier forms of the fast path sent its files' text without comments
        # (`kernels.kernel_source`), the headers cut to what the body uses; it now writes that
        # text once under its SHA-256 and sends `#include` lines of it (`kernels.kernel_texts`:
        # here q8_matvec's header), which NVRTC reads.
        files = ("ds4lab_block.cuh", "q8_rows.cuh")
        for how, header in (("as written", "\n".join((kernels.KERNEL_DIR / f).read_text() for f in files)),
                            ("without comments", kernels.kernel_source(*files)),
                            ("as sent", kernels.kernel_texts("q8_matvec.cu", *files)["header"])):
            headed = mx.fast.cuda_kernel(name=f"host_cost_add_headed_{how.replace(' ', '_')}", input_names=["x"],
                                         output_names=["out"], source=ADD_ONE, header=header)
            kinds[f"custom kernel, q8 headers {how} ({len(header) / 1024:.1f} KB)"] = (
                lambda x, headed=headed: headed(inputs=[x], grid=(256, 1, 1), threadgroup=(256, 1, 1),
                                                output_shapes=[x.shape], output_dtypes=[x.dtype])[0])
        big = mx.zeros((150_000_000,), mx.float32)
        mx.eval(big)
        kinds["custom kernel, 2nd input 600 MB (a commit per 2)"] = lambda x: wide(
            inputs=[x, big, *constants[:6]], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
            output_dtypes=[x.dtype])[0]
    mx.eval(w, index, *constants)
    return kinds


def build_encode_wait(build: Callable[[], object]) -> tuple[float, float, float]:
    """Seconds to build a graph (`build()`), to encode it (`mx.async_eval` until it returns)
    and to wait for the device to finish it."""
    t = time.perf_counter()
    arrays = build()
    built = time.perf_counter() - t
    mx.async_eval(arrays)
    encoded = time.perf_counter() - t - built
    mx.eval(arrays)
    return built, encoded, time.perf_counter() - t - built - encoded


def measure(op: Callable[[mx.array], mx.array], n_ops: int) -> tuple[float, float, float]:
    """Seconds per primitive: (build, encode, wait) for a chain of n_ops."""
    x = mx.random.normal((256,))
    mx.eval(x)

    def chain() -> mx.array:
        y = x
        for _ in range(n_ops):
            y = op(y)
        return y
    return tuple(v / n_ops for v in build_encode_wait(chain))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="primitives per graph")
    parser.add_argument("--repeat", type=int, default=3, help="graphs per kind (the fastest is printed)")
    args = parser.parse_args()
    print(f"device {mx.default_device()}: µs per primitive in a chain of {args.ops} "
          f"(the fastest of {args.repeat} graphs; the first graph of each kind is a warm-up)")
    print(f"{'kind':45s} {'build':>8s} {'encode':>8s} {'device':>8s}")
    for name, op in _kinds().items():
        measure(op, 16)
        best = min((measure(op, args.ops) for _ in range(args.repeat)), key=lambda r: r[0] + r[1])
        print(f"{name:45s} " + " ".join(f"{v * 1e6:8.2f}" for v in best))


if __name__ == "__main__":
    main()
