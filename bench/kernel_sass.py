"""The longest loop of every cached kernel, from its SASS: instructions and their mix, no GPU.

A decode kernel whose weights loop issues ~8 instructions a weight is bound by issue, not
by memory (the IQ2_XXS expert dot: 8.8 a weight in 2026-12, 4.3 once its lanes took 16
values and each value became one byte permute from a table of sign bytes; the Q2_K one 5.5
after its lanes took 16 values, 8.1 before). This disassembles the cubins of the kernel cache
(`bench/device_checks.sh warm` fills `.ptx_cache`: NVRTC, sm_90a) with nvdisasm and prints,
per module, the longest loop's instruction count and its most frequent opcodes
(`ds4lab.model.cubin.main_loop`): divide by the weights a lane takes per trip.

nvdisasm is not a dependency: `pip download nvidia-cuda-nvdisasm` and unpack it, or the CUDA
toolkit's (/usr/local/cuda/bin).

    python bench/kernel_sass.py --match expert_swiglu [--cache .ptx_cache] [--nvdisasm PATH] [--top 12]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from ds4lab.model import kernel_cache
from ds4lab.model.cubin import main_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None, help="the cache folder (default: .ptx_cache, else MLX's)")
    parser.add_argument("--match", default="", help="only modules whose name contains this")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm")
    parser.add_argument("--top", type=int, default=12, help="opcodes printed per module")
    args = parser.parse_args()
    if not Path(args.nvdisasm).exists():
        raise SystemExit(f"no nvdisasm at {args.nvdisasm} (--nvdisasm PATH)")
    folder = args.cache or (Path(".ptx_cache") if Path(".ptx_cache").is_dir() else kernel_cache.cache_dir())
    files = sorted(p for p in folder.rglob("*.ptx") if args.match in p.name)
    if not files:
        raise SystemExit(f"no cubins matching {args.match!r} in {folder}")
    for path in files:
        run = subprocess.run([args.nvdisasm, "-c", str(path)], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{path.name}: nvdisasm failed: {run.stderr.strip()[:200]}")
            continue
        loop = main_loop(run.stdout)
        mix = ", ".join(f"{op} {n}" for op, n in loop.most_common(args.top))
        print(f"{path.stem.removeprefix('custom_kernel_')}: longest loop {sum(loop.values())} instructions\n    {mix}")


if __name__ == "__main__":
    main()
