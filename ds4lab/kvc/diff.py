"""Two checkpoints compared: which header fields, payload words, tokens and blocks differ."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pandas as pd

from .header import KVCHeader
from .kvfile import KVCFile


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    unequal = np.flatnonzero(a[:n] != b[:n])
    return int(unequal[0]) if len(unequal) else n


def diff(a: KVCFile, b: KVCFile) -> pd.DataFrame:
    """One row per difference: `part` (header, payload, text, tokens, logits, layer), `layer`,
    `field`, the two values, and for float blocks the largest |a-b| over the rows both hold.
    Two checkpoints of one conversation differ in length: their shared token prefix, and the
    compressed rows it determines, show up as `rows_a`/`rows_b` with a max difference on the
    common rows (0 when the later file extends the earlier one exactly)."""
    rows: list[dict] = []

    def add(part: str, field: str, va, vb, layer=None, max_abs=np.nan) -> None:
        rows.append({"part": part, "layer": layer, "field": field, "a": str(va), "b": str(vb),
                     "max_abs_diff": float(max_abs)})

    for name in (f.name for f in fields(KVCHeader)):
        if getattr(a.header, name) != getattr(b.header, name):
            add("header", name, getattr(a.header, name), getattr(b.header, name))
    words_a, words_b = a.payload_header, b.payload_header
    for name in dict.fromkeys([*words_a, *words_b]):
        if words_a.get(name) != words_b.get(name):
            add("payload", name, words_a.get(name), words_b.get(name))
    if a.text != b.text:
        shared = _common_prefix(np.frombuffer(a.text, np.uint8), np.frombuffer(b.text, np.uint8))
        add("text", "common_prefix_bytes", shared, f"of {len(a.text)} / {len(b.text)}")
    if not np.array_equal(a.tokens, b.tokens):
        add("tokens", "common_prefix_tokens", _common_prefix(a.tokens, b.tokens),
            f"of {len(a.tokens)} / {len(b.tokens)}")
    if a.logits.shape == b.logits.shape and not np.array_equal(a.logits, b.logits):
        add("logits", "logits", int(a.logits.argmax()), int(b.logits.argmax()),
            max_abs=np.abs(a.logits - b.logits).max())
    for il in range(min(len(a.ratios), len(b.ratios))):
        blocks_a, blocks_b = a.arrays(il), b.arrays(il)
        for name in sorted(blocks_a.keys() & blocks_b.keys()):
            xa, xb = blocks_a[name], blocks_b[name]
            if xa.shape[1:] != xb.shape[1:]:
                add("layer", name, xa.shape, xb.shape, layer=il)
                continue
            if name == "raw_kv":  # the last raw_live positions of each: line them up by position
                start = max(len(a.tokens) - len(xa), len(b.tokens) - len(xb))
                xa, xb = xa[start - (len(a.tokens) - len(xa)):], xb[start - (len(b.tokens) - len(xb)):]
            n = min(len(xa), len(xb))
            worst = float(np.abs(xa[:n] - xb[:n]).max()) if n else 0.0
            if len(blocks_a[name]) != len(blocks_b[name]) or worst:
                add("layer", f"{name} rows", len(blocks_a[name]), len(blocks_b[name]), layer=il, max_abs=worst)
    frame = pd.DataFrame(rows, columns=["part", "layer", "field", "a", "b", "max_abs_diff"])
    return frame.astype({"layer": "Int64", "max_abs_diff": "float64"})
