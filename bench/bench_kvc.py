"""Reading .kv files: ds4lab's reader against plain buffered I/O, and scanning a directory.

1. A synthetic 32k-token Flash checkpoint (≈ 475 MB, the real payload layout) is written,
   then read twice per round, cold (pages dropped with posix_fadvise) and warm: once with
   plain buffered reads of the whole file, once with `ds4lab.kvc.read` plus a copy of every
   array (tokens, logits, all 43 layers' blocks) into memory. Prints the throughput ratio;
   target ≥ 0.80.
2. 1000 checkpoint files (headers, texts and payload words; payload bodies left sparse) are
   scanned into a DataFrame with `ds4lab.cache.scan` (headers + eviction scores); target < 1 s.

    python bench/bench_kvc.py [--tokens 32768] [--files 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import ds4lab  # noqa: F401  (loads OpenBLAS before MLX)

# isort: split
import numpy as np

from ds4lab.cache import scan
from ds4lab.config import FLASH
from ds4lab.kvc import read
from ds4lab.kvc.header import KVCHeader
from ds4lab.kvc.payload import checkpoint_bytes, encode, frontier_shape
from ds4lab.model.kv_state import payload_words


def write_checkpoint(path: Path, n_tokens: int, seed: int = 0) -> int:
    """A Flash-shaped checkpoint of `n_tokens` with random rows; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    words = payload_words(FLASH, n_tokens, max(2 * n_tokens, 4096), "ba00a8a")
    layers = []
    for ratio in FLASH.compress_ratios:
        arrays = {"raw_kv": rng.standard_normal((words["raw_live"], FLASH.head_dim), np.float32)}
        if ratio:
            state = frontier_shape(ratio, FLASH.head_dim)
            arrays |= {"comp_kv": rng.standard_normal((n_tokens // ratio, FLASH.head_dim), np.float32),
                       "attn_state_kv": rng.standard_normal(state, np.float32),
                       "attn_state_score": rng.standard_normal(state, np.float32)}
        if ratio == 4:
            state = frontier_shape(ratio, FLASH.indexer_head_dim)
            arrays |= {"index_comp_kv": rng.standard_normal((n_tokens // 4, FLASH.indexer_head_dim), np.float32),
                       "index_state_kv": rng.standard_normal(state, np.float32),
                       "index_state_score": rng.standard_normal(state, np.float32)}
        layers.append(arrays)
    n_comp = [n_tokens // r if r else 0 for r in FLASH.compress_ratios]
    n_index = [n_tokens // 4 if r == 4 else 0 for r in FLASH.compress_ratios]
    pieces = encode(words, rng.integers(0, FLASH.n_vocab, n_tokens), rng.standard_normal(FLASH.n_vocab), n_comp,
                    n_index, layers)
    text = b"x" * (4 * n_tokens)
    header = KVCHeader(quant_bits=2, reason=1, tokens=n_tokens, ctx_size=words["ctx"],
                       payload_bytes=sum(map(len, pieces)), text_bytes=len(text), created_at=1, last_used=1)
    with open(path, "wb") as fh:
        for piece in (header.pack(), text, *pieces):
            fh.write(piece)
        fh.flush()
        os.fsync(fh.fileno())
    return path.stat().st_size


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read(path: Path) -> int:
    with open(path, "rb") as fh:
        return len(fh.read())


def ds4lab_read(path: Path) -> int:
    f = read(path)
    total = len(np.array(f.tokens)) + len(np.array(f.logits))
    for il in range(len(f.payload.ratios)):
        total += sum(np.array(a).nbytes for a in f.arrays(il).values())
    return total


def timed(fn, path: Path) -> float:
    start = time.perf_counter()
    fn(path)
    return time.perf_counter() - start


def bench_read(folder: Path, n_tokens: int, rounds: int) -> None:
    path = folder / "checkpoint.kv"
    size = write_checkpoint(path, n_tokens)
    print(f"checkpoint: {n_tokens} tokens, {size / 1e6:.1f} MB")
    for state in ("cold", "warm"):
        best = {}
        for _ in range(rounds):
            for name, fn in (("plain", plain_read), ("ds4lab", ds4lab_read)):
                if state == "cold":
                    drop_pages(path)
                else:
                    plain_read(path)
                best[name] = min(best.get(name, float("inf")), timed(fn, path))
        rates = {k: size / v / 1e6 for k, v in best.items()}
        print(f"{state}: plain {rates['plain']:.0f} MB/s, ds4lab {rates['ds4lab']:.0f} MB/s, "
              f"ratio {rates['ds4lab'] / rates['plain']:.2f} (target >= 0.80)")


def bench_scan(folder: Path, n_files: int) -> None:
    cache = folder / "cache"
    cache.mkdir()
    rng = np.random.default_rng(1)
    for i in range(n_files):
        n_tokens = int(rng.integers(512, 40000))
        text = f"conversation {i} ".encode() * int(rng.integers(10, 200))
        words = payload_words(FLASH, n_tokens, 65536, "ba00a8a")
        body = encode(words, [], [], [], [], [])[0]
        header = KVCHeader(quant_bits=2, reason=int(rng.integers(1, 5)), tokens=n_tokens, hits=int(rng.integers(0, 9)),
                           ctx_size=65536, payload_bytes=checkpoint_bytes(FLASH, n_tokens, 65536), text_bytes=len(text),
                           created_at=1_790_000_000 + i, last_used=1_790_000_000 + 2 * i)
        path = cache / f"{hashlib.sha1(text).hexdigest()}.kv"
        with open(path, "wb") as fh:
            fh.write(header.pack() + text + body)
            fh.truncate(header.trailer_offset)  # a sparse payload body: real sizes, no disk use
    start = time.perf_counter()
    frame = scan(cache)
    elapsed = time.perf_counter() - start
    print(f"scan: {len(frame)} files -> DataFrame of {frame.shape[1]} columns in {elapsed:.3f} s (target < 1 s); "
          f"valid {int(frame['valid'].sum())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ds4lab-bench-kvc-"))
    try:
        bench_read(folder, args.tokens, args.rounds)
        bench_scan(folder, args.files)
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
