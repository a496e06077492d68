"""Peak memory of opening a multi-GB flash-dims GGUF, against the file's size.

Opening must read no tensor data: the header is parsed and the rest memory-mapped. This
writes a `flash-dims` model (real Flash widths, --layers layers) unless --file is given,
then, in a fresh process, opens it, builds the tensor table and the component summary,
and prints the resident memory that opening added (VmHWM after minus VmRSS before) as a
fraction of the file size. Target: under 2%. Linux only (reads /proc/self/status).

    python bench/bench_open_rss.py [--layers 2] [--file F.gguf] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import pandas
from ds4lab import gguf
before = status("VmRSS:")
t0 = time.perf_counter()
model = gguf.open(sys.argv[1])
table = model.tensor_table()
summary = model.component_bytes()
seconds = time.perf_counter() - t0
print(json.dumps({"before": before, "peak": status("VmHWM:"), "after": status("VmRSS:"),
                  "seconds": seconds, "tensors": len(table), "variant": model.variant}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variant", default="q2", choices=["q2", "q4"])
    parser.add_argument("--file", help="an existing GGUF to open instead of writing one")
    parser.add_argument("--keep", action="store_true", help="keep the generated file")
    args = parser.parse_args()

    tmp = None
    if args.file:
        path = Path(args.file)
    else:
        from ds4lab.synth import make_model

        tmp = Path(tempfile.mkdtemp(dir="."))
        path = tmp / f"flash-dims-{args.layers}L-{args.variant}.gguf"
        t0 = time.perf_counter()
        make_model(path, "flash-dims", args.variant, n_layer=args.layers, seed=0, vocab_rows=4096)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    size = path.stat().st_size
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"opening {path} failed:\n{out.stderr}")
    r = json.loads(out.stdout)
    added = r["peak"] - r["before"]
    print(f"file            {size / 2**30:8.3f} GiB  ({r['tensors']} tensors, variant {r['variant']})")
    print(f"open + tables   {r['seconds']:8.3f} s")
    print(f"RSS before open {r['before'] / 2**20:8.1f} MiB (Python, numpy, pandas, MLX)")
    print(f"peak RSS added  {added / 2**20:8.1f} MiB")
    print(f"ratio           {added / size:8.4%} of the file (target < 2%)")
    if tmp is not None and not args.keep:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
