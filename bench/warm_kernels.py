"""Fill MLX's kernel cache with every CUDA kernel variant a flash-dims run launches, in parallel.

A new process on the GPU compiles each of the fast path's ~50 kernel variants with NVRTC
the first time it launches it, one at a time on the encoding thread: 1.5-2 minutes of every
device run (`ds4lab.model.kernel_cache`). This records the variants of a run like
`bench_model.py`'s (prefill then decode at each context, on the first `--layers` flash-dims
layers: every kind of layer), without a GPU, then compiles them on all cores into the cache
MLX reads (`--cache`, else MLX_PTX_CACHE_DIR, else <tmp>/mlx/<version>/ptx). Run it here
and carry the folder, or on the GPU machine; then set MLX_PTX_CACHE_DIR to it there.

    python bench/warm_kernels.py [--layers 6] [--contexts 128 4096] [--steps 6] [--cache DIR]
"""

from __future__ import annotations

import ds4lab  # noqa: F401  (first: OpenBLAS before MLX on Linux)

# isort: split
import argparse
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx

from ds4lab.config import preset
from ds4lab.model import Model, kernel_cache
from ds4lab.model.model import MERGED_LAUNCHES
from ds4lab.model.random_weights import random_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="flash-dims layers (6 hold every kind of layer)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 4096], help="prompt lengths")
    parser.add_argument("--steps", type=int, default=6, help="decode steps after each prompt (past an emission)")
    parser.add_argument("--types", nargs="+", default=["q2"], help="expert quantisations (q2, q4)")
    parser.add_argument("--cache", type=Path, default=None, help="the cache folder (default: MLX's)")
    parser.add_argument("--arch", default="sm_90a", help="NVRTC's --gpu-architecture (H100/H200: sm_90a)")
    args = parser.parse_args()
    started = time.perf_counter()
    variants: list[kernel_cache.KernelVariant] = []
    for quant in args.types:
        weights = random_weights(preset("flash-dims", args.layers), quant)
        with kernel_cache.recorded_variants() as recorded:
            for context in args.contexts:
                model = Model(weights)
                session = model.session()
                logits = session.prefill([1000 + i for i in range(context)])
                for _ in range(args.steps):
                    logits = session.decode(mx.argmax(logits))
                for merged in (MERGED_LAUNCHES, ()):      # every merge, and none (`stream_ab.py`)
                    model.merged_launches = set(merged)
                    mx.eval(session.decode(mx.argmax(logits)))
                model.expert_planes = False                 # the IQ2_XXS gate and up on floats
                mx.eval(session.decode(mx.argmax(logits)))
        variants += [v for v in recorded if v not in variants]
    recorded_at = time.perf_counter()
    directory = args.cache.absolute() if args.cache else kernel_cache.cache_dir()
    results = kernel_cache.fill(variants, kernel_cache.default_nvrtc(), directory, args.arch)
    outcome = Counter(r if r in ("cached", "compiled") else "failed" for _, r in results)
    for variant, result in results:
        if result not in ("cached", "compiled"):
            print(f"FAILED {variant.kernel_name}:\n{result[:2000]}")
    print(f"{len(variants)} kernel variants recorded in {recorded_at - started:.1f} s; {dict(outcome)} in "
          f"{time.perf_counter() - recorded_at:.1f} s; cache: {directory}")


if __name__ == "__main__":
    main()
