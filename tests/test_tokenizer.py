"""ds4lab.tokenizer: reference mode equals tokenizer.json, ds4 mode equals ds4's C tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4lab import tokenizer as tk

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a"

SPECIALS = [*tk.DS4_SPECIALS, "<|EOT|>", "<｜fim▁hole｜>", "<｜tool▁sep｜>", "<｜▁pad▁｜>"]

_unicode = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
_spaces = st.text(st.sampled_from(" \t\n\r\v\f\u00a0\u3000"), min_size=1, max_size=8)
_digits = st.from_regex(r"[0-9]{1,9}", fullmatch=True)
_words = st.sampled_from(["hello", " world", "int", " (", "°C", "naïve", "中文", "カタカナ", "ß", "🙂", ";\n", "x_1"])
TEXTS = st.lists(st.one_of(_unicode, _spaces, _digits, _words, st.sampled_from(SPECIALS)), max_size=8).map("".join)
NO_NUL = TEXTS.map(lambda s: s.replace("\0", ""))
ASCII = st.text(st.characters(min_codepoint=1, max_codepoint=127), max_size=40)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def hf():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tk.tokenizer_json_path())


@pytest.fixture(scope="module")
def ref_gguf(tiny_a_gguf):
    return tk.load(tiny_a_gguf)


@pytest.fixture(scope="module")
def ds4():
    return tk.load(mode="ds4")


def test_load_defaults_and_compat_api():
    tok = tk.load()
    assert tok is tk.load()
    assert tok.mode == "reference" and tok.n_vocab == 129280
    enc = tok.encode("Hello world", add_special_tokens=False)
    assert isinstance(enc, list) and enc == enc.ids == [19923, 2058]
    assert tok.decode(enc.ids) == "Hello world"
    with pytest.raises(ValueError):
        tk.load(mode="llama")


def test_vocab_unchanged():
    v = tk.vocab()
    assert len(v.tokens) == 129280 and v.tokens[v.bos_id] == "<｜begin▁of▁sentence｜>"


@FAST
@given(TEXTS)
def test_reference_from_gguf_equals_tokenizer_json(hf, ref_gguf, text):
    want = hf.encode(text, add_special_tokens=False).ids
    assert ref_gguf.encode(text) == want
    assert ref_gguf.decode(want) == text
    assert ref_gguf.decode(want) == hf.decode(want, skip_special_tokens=False)


@FAST
@given(NO_NUL)
def test_ds4_bpe_equals_tokenizers_bpe_per_piece(hf, ds4, text):
    """ds4 mode's own BPE gives the tokenizers BPE model's ids on every ds4 piece; decode is exact."""
    for piece in ds4.pieces(text):
        want = [t.id for t in hf.model.tokenize(tk._byte_encode(piece))]
        assert list(ds4._bpe(piece)) == want
    assert ds4.decode(ds4.encode(text)) == text


@FAST
@given(ASCII)
def test_modes_agree_on_ascii(ds4, text):
    assert ds4.encode(text) == tk.load().encode(text)


def test_ds4_matches_oracle_prompt(ds4, tiny_a_gguf):
    text = (ORACLE / "prompt" / "rendered.txt").read_text(encoding="utf-8")
    want = np.load(ORACLE / "oracle.npz")["tokens"].tolist()
    assert ds4.encode(text) == want
    assert tk.load(tiny_a_gguf, mode="ds4").encode(text) == want
    assert ds4.decode(want) == text


@pytest.mark.parametrize(
    ("text", "ds4_pieces", "ref_pieces", "ids_differ"),
    [
        # " " + ASCII punct run stops at the non-ASCII '°', which starts a letter run in ds4;
        # the regex's ` ?[\p{P}\p{S}]+` takes '°' (a symbol) with the parenthesis.
        (" (°C", [" (", "°C"], [" (°", "C"], True),
        # ds4's letter run swallows CJK after a non-CJK non-ASCII char; the regex isolates CJK first.
        ("é中文x", ["é中文x"], ["é", "中文", "x"], False),
        # a non-ASCII symbol is a letter in ds4, so it joins the next word (BPE happens not to merge across).
        ("→ab", ["→ab"], ["→", "ab"], False),
    ],
)
def test_ds4_pretokenizer_differs_from_regex(ds4, text, ds4_pieces, ref_pieces, ids_differ):
    assert ds4.pieces(text) == ds4_pieces
    assert tk.load().pieces(text) == ref_pieces
    assert (ds4.encode(text) != tk.load().encode(text)) == ids_differ
    assert ds4.decode(ds4.encode(text)) == text


def test_ds4_pretokenizer_ascii_rules():
    assert tk.ds4_pretokenize("    int x;\n\n  y") == ["   ", " int", " x", ";\n\n", " ", " y"]
    assert tk.ds4_pretokenize("a  (b") == ["a", " ", " (", "b"]
    assert tk.ds4_pretokenize("\t\t(") == ["\t", "\t", "("]
    assert tk.ds4_pretokenize("1234567") == ["123", "456", "7"]
    assert tk.ds4_pretokenize("a\0b") == ["a"]  # ds4 reads a C string


def test_ds4_special_tokens(ds4):
    ids = ds4.encode("<｜User｜>hi<think></think>｜DSML｜")
    t2i = {t: i for i, t in enumerate(tk.vocab().tokens)}
    assert ids[0] == t2i["<｜User｜>"] and ids[-3:] == [t2i["<think>"], t2i["</think>"], t2i["｜DSML｜"]]
    # only ds4's seven specials are matched; other added tokens go through BPE in ds4 mode
    assert len(tk.load().encode("<|EOT|>")) == 1
    assert len(ds4.encode("<|EOT|>")) > 1
    assert ds4.decode(ds4.encode("<|EOT|>")) == "<|EOT|>"
