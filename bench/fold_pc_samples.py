"""Function counts from `pc_sampler`'s samples (`bench/sample_stacks.sh`): each sample's pc
and stack-scanned return addresses (path+0xOFFSET) are resolved against the libraries' own
symbol tables (.symtab, else .dynsym: read here, so the machine needs no binutils), then
counted: innermost (the pc's function: where the thread's time is spent) and inclusive (each
function once a sample: an upper bound, stack scanning also finds stale return addresses).
Names stay mangled unless c++filt is on the PATH.

    python bench/fold_pc_samples.py SAMPLES [--top 50]
"""

from __future__ import annotations

import argparse
import bisect
import shutil
import struct
import subprocess
from collections import Counter
from functools import cache
from pathlib import Path


@cache
def symbols(path: str) -> tuple[list[int], list[tuple[int, str]]]:
    """A library's functions as (sorted starts, [(end, name)]), in file offsets."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return [], []
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    loads = []
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_vaddr + p_filesz, p_offset))
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    table = [s for s in sections if s[1] == 2] or [s for s in sections if s[1] == 11]
    funcs = []
    for _, _, _, _, offset, size, link, _, _, entsize in table[:1]:
        strings = sections[link][4]
        for j in range(size // entsize):
            name, info, _, _, value, sym_size = struct.unpack_from("<IBBHQQ", data, offset + j * entsize)
            if info & 0xF != 2 or value == 0:
                continue
            for lo, hi, file_offset in loads:
                if lo <= value < hi:
                    start = value - lo + file_offset
                    end_name = data.index(b"\0", strings + name)
                    funcs.append((start, start + max(sym_size, 1), data[strings + name:end_name].decode()))
    funcs.sort()
    return [f[0] for f in funcs], [(f[1], f[2]) for f in funcs]


def function(token: str) -> str:
    path, _, offset = token.rpartition("+0x")
    starts, rest = symbols(path)
    i = bisect.bisect_right(starts, int(offset, 16)) - 1
    library = Path(path).name
    if i >= 0 and int(offset, 16) < rest[i][0]:
        return f"{library}:{rest[i][1]}"
    return f"{library}:?"


def demangled(names: list[str]) -> list[str]:
    if not shutil.which("c++filt"):
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", type=Path)
    parser.add_argument("--top", type=int, default=50)
    args = parser.parse_args()
    innermost, inclusive, libraries, n = Counter(), Counter(), Counter(), 0
    for line in args.samples.read_text().splitlines():
        tokens = line.split()[1:]
        if not line.startswith("S") or not tokens:
            continue
        n += 1
        names = [function(t) for t in tokens]
        innermost[names[0]] += 1
        libraries[names[0].split(":")[0]] += 1
        for name in set(names):
            inclusive[name] += 1
    print(f"{n} samples")
    for title, counts in (("library of the pc", libraries), ("innermost", innermost), ("inclusive", inclusive)):
        print(f"{title}:")
        top = counts.most_common(args.top)
        for (_, count), shown in zip(top, demangled([name for name, _ in top]), strict=True):
            print(f"  {count / n:6.1%}  {shown[:160]}")


if __name__ == "__main__":
    main()
