"""imatrix: collected values equal the definition worked by hand; both file layouts round-trip."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ds4lab import gguf, load
from ds4lab.hooks import ActivationCache
from ds4lab.quants import imatrix


@pytest.fixture(scope="module")
def tiny(tiny_q2):
    model = load(tiny_q2)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, model.config.n_vocab, size=n)] for n in (37, 20)]
    return model, gguf.open(tiny_q2), prompts


@pytest.fixture(scope="module")
def collected(tiny):
    model, _, prompts = tiny
    return imatrix.collect(model, prompts, chunk=16, dataset="random ids")


def _chunk_cache(model, state, tokens):
    """The FFN inputs, experts and route weights of one forward chunk continuing `state`, and the new state."""
    cache = ActivationCache()
    wanted = lambda n: n.endswith(("ffn.hook_in", "ffn.hook_experts", "ffn.hook_expert_weights"))  # noqa: E731
    with model.hooks([(wanted, cache.record)]):
        result = model.forward(state, tokens, last_only=True)
    return cache, result.state


def _swiglu(gate: np.ndarray, up: np.ndarray, clamp: float) -> np.ndarray:
    gate, up = np.minimum(gate, clamp), np.clip(up, -clamp, clamp)
    return gate / (1 + np.exp(-gate)) * up


def test_values_equal_the_definition(tiny, collected):
    """Recompute every expert's statistics from cached activations and the decoded weights:
    gate/up = mean of x² over the routes to the expert, down = mean of (w·swiglu(Wg·x, Wu·x))²."""
    model, model_file, prompts = tiny
    cfg = model.config
    sums = {}
    for tokens in prompts:
        # one forward per 16 tokens, as collected, so the activations are the same ones
        state = model.empty_state()
        for start in range(0, len(tokens), 16):
            cache, state = _chunk_cache(model, state, tokens[start:start + 16])
            for layer in range(cfg.n_layer):
                b = f"blocks.{layer}.ffn."
                x, experts, weights = cache[b + "hook_in"], cache[b + "hook_experts"], cache[b + "hook_expert_weights"]
                gate_w = model_file.dequantize(f"blk.{layer}.ffn_gate_exps.weight")
                up_w = model_file.dequantize(f"blk.{layer}.ffn_up_exps.weight")
                for t in range(len(x)):
                    for slot, e in enumerate(experts[t]):
                        mid = _swiglu(gate_w[e] @ x[t], up_w[e] @ x[t], cfg.swiglu_clamp[layer]) * weights[t, slot]
                        gu, down, n = sums.get((layer, e), (0.0, 0.0, 0))
                        sq_x, sq_mid = x[t].astype(np.float64) ** 2, mid.astype(np.float64) ** 2
                        sums[(layer, e)] = (gu + sq_x, down + sq_mid, n + 1)
    for layer in range(cfg.n_layer):
        for role in ("gate", "up", "down"):
            entry = collected.entries[f"blk.{layer}.ffn_{role}_exps.weight"]
            means = entry.means()
            for e in range(cfg.n_expert):
                gu, down, n = sums.get((layer, e), (None, None, 0))
                assert entry.counts[e] == n
                if n == 0:
                    assert (means[e] == imatrix.UNROUTED_VALUE).all()      # ds4's default
                    continue
                expected = (down if role == "down" else gu) / n
                np.testing.assert_allclose(means[e], expected, rtol=2e-4, atol=1e-7)
    assert collected.chunks == cfg.n_layer * (3 + 2) and collected.chunk_size == 16


def test_dat_layout_is_ds4s(collected, tmp_path):
    path = collected.save(tmp_path / "x.dat")
    buf = path.read_bytes()
    n_entries, name_len = struct.unpack_from("<ii", buf, 0)
    name = buf[8:8 + name_len].decode()
    ncall, nval = struct.unpack_from("<ii", buf, 8 + name_len)
    assert (n_entries, name, ncall) == (18, "blk.0.ffn_gate_exps.weight", 1)
    first = np.frombuffer(buf, "<f4", count=nval, offset=16 + name_len)
    np.testing.assert_array_equal(first, collected.entries[name].means().reshape(-1))   # expert-major
    chunks, dataset_len = struct.unpack_from("<ii", buf, len(buf) - 8 - len("random ids"))
    assert (chunks, dataset_len) == (collected.chunks, 10) and buf.endswith(b"random ids")


def test_round_trip_through_both_layouts(collected, tmp_path):
    n_expert = 16
    dat = imatrix.load(collected.save(tmp_path / "x.dat"), n_expert=n_expert)
    gg = imatrix.load(collected.save(tmp_path / "x.gguf"))
    for name, entry in collected.entries.items():
        np.testing.assert_array_equal(dat.entries[name].means(), entry.means())
        np.testing.assert_array_equal(gg.entries[name].counts, entry.counts)
        np.testing.assert_allclose(gg.entries[name].means(), entry.means(), rtol=1e-6)
    assert (dat.chunks, dat.datasets) == (collected.chunks, ["random ids"])
    assert (gg.chunks, gg.chunk_size, gg.datasets) == (collected.chunks, 16, ["random ids"])
    assert dat.save(tmp_path / "y.dat").read_bytes() == (tmp_path / "x.dat").read_bytes()    # byte for byte


def test_gguf_layout_reads_in_gguf_py(collected, tmp_path):
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(collected.save(tmp_path / "x.gguf"))
    assert reader.fields["general.type"].contents() == "imatrix"
    tensors = {t.name: t for t in reader.tensors}
    sums = tensors["blk.2.ffn_down_exps.weight.in_sum2"]
    assert list(sums.shape) == [256, 16]                       # ne: [n_cols, n_expert]
    counts = np.asarray(tensors["blk.2.ffn_down_exps.weight.counts"].data).reshape(-1)
    np.testing.assert_array_equal(counts, collected.entries["blk.2.ffn_down_exps.weight"].counts)


def test_importance_lookup_follows_ds4(collected):
    name = "blk.4.ffn_gate_exps.weight"
    means = collected.entries[name].means()
    np.testing.assert_array_equal(collected.importance(name, 256, expert=3, n_expert=16), means[3])
    flat = imatrix.Imatrix({name: imatrix.ImatrixEntry(means.reshape(1, -1).astype(np.float64), np.ones(1, int))})
    np.testing.assert_array_equal(flat.importance(name, 256, expert=3, n_expert=16), means[3])
    assert collected.importance("blk.4.attn_kv.weight", 256) is None
    with pytest.raises(imatrix.ImatrixFileError):
        collected.importance(name, 128, expert=0, n_expert=16)


def test_truncated_dat_is_a_clear_error(collected, tmp_path):
    path = collected.save(tmp_path / "x.dat")
    (tmp_path / "cut.dat").write_bytes(path.read_bytes()[:5000])
    with pytest.raises(imatrix.ImatrixFileError, match="truncated"):
        imatrix.load(tmp_path / "cut.dat")


def test_hostile_gguf_imatrix_is_a_clear_error(tmp_path):
    def write(name, counts, meta=()):
        tensors = [gguf.TensorOut("w.in_sum2", "F32", (4, 2), lambda: np.ones(8, np.float32)),
                   gguf.TensorOut("w.counts", "F32", (1, len(counts)), lambda: np.asarray(counts, np.float32))]
        return gguf.write_gguf(tmp_path / name, [("general.type", "STRING", "imatrix"), *meta], tensors)

    assert imatrix.load(write("ok.gguf", [1, 2])).entries["w"].counts.tolist() == [1, 2]
    with pytest.raises(imatrix.ImatrixFileError, match="non-finite or negative"):
        imatrix.load(write("neg.gguf", [1, -2]))
    with pytest.raises(imatrix.ImatrixFileError, match="non-finite or negative"):
        imatrix.load(write("nan.gguf", [1, np.nan]))
    with pytest.raises(imatrix.ImatrixFileError, match="do not divide"):
        imatrix.load(write("three.gguf", [1, 2, 3]))
    with pytest.raises(imatrix.ImatrixFileError, match="an array of strings"):
        imatrix.load(write("meta.gguf", [1, 2], [("imatrix.datasets", "STRING", "not a list")]))


def test_dataset_prompts(tmp_path):
    text = "ignored\n===== DS4_IMATRIX_PROMPT a x =====\n  first  \n\n===== DS4_IMATRIX_PROMPT b =====\nsecond\n"
    (tmp_path / "d.txt").write_text(text)
    assert imatrix.read_prompts(tmp_path / "d.txt") == ["first", "second"]

    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    assert imatrix.dataset_tokens(["abcdef", "gh", "ij"], Chars(), ctx=4, max_tokens=5) == [[97, 98, 99, 100], [103]]
    assert imatrix.dataset_tokens(["ab", "cd", "ef"], Chars(), max_prompts=2) == [[97, 98], [99, 100]]


def test_cli_collect(tiny_q2, tmp_path, capsys):
    from ds4lab.cli import main

    (tmp_path / "d.txt").write_text("===== DS4_IMATRIX_PROMPT a\nHello there.\n===== DS4_IMATRIX_PROMPT b\nx = 1\n")
    assert main(["imatrix", "collect", str(tiny_q2), "--prompts", str(tmp_path / "d.txt"),
                 "--out", str(tmp_path / "c.dat")]) == 0
    assert "2 prompts" in capsys.readouterr().err
    collected = imatrix.load(tmp_path / "c.dat", n_expert=16)
    assert collected.datasets == [str(tmp_path / "d.txt")] and len(collected.entries) == 18
