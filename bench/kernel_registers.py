"""Registers, stack frame and shared memory of every kernel in MLX's kernel cache, from the
cubins themselves (`ds4lab.model.cubin`): no GPU needed.

The cache is the folder `bench/device_checks.sh warm` fills (`.ptx_cache`: NVRTC, sm_90a),
else MLX_PTX_CACHE_DIR, else MLX's default. A decode kernel at 30-40 registers that should
keep dozens of loads in flight is one the compiler serialised; a non-zero frame is local
memory (spills, or an array indexed at run time).

    python bench/kernel_registers.py [--cache .ptx_cache] [--match NAME]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ds4lab.model import kernel_cache
from ds4lab.model.cubin import CubinError, kernel_resources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None, help="the cache folder (default: .ptx_cache, else MLX's)")
    parser.add_argument("--match", default="", help="only modules whose name contains this")
    args = parser.parse_args()
    folder = args.cache or (Path(".ptx_cache") if Path(".ptx_cache").is_dir() else kernel_cache.cache_dir())
    files = sorted(p for p in folder.rglob("*.ptx") if args.match in p.name)
    if not files:
        raise SystemExit(f"no cubins matching {args.match!r} in {folder}")
    print(f"{'module':72s} {'registers':>9s} {'frame B':>8s} {'shared B':>9s}")
    for path in files:
        try:
            found = kernel_resources(path.read_bytes(), str(path))
        except CubinError as error:
            print(f"{path.name[:72]:72s} {error}")
            continue
        for k in found:
            print(f"{path.stem.removeprefix('custom_kernel_')[:72]:72s} {k.registers:9d} {k.frame_bytes:8d} "
                  f"{k.shared_bytes:9d}")


if __name__ == "__main__":
    main()
