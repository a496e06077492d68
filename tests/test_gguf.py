"""ds4lab.gguf: opening, validating and describing ds4 GGUF files, good and bad."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf as ggufpy
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4lab import gguf
from ds4lab.config import preset
from ds4lab.errors import ModelFileError
from ds4lab.gguf import TensorOut, read_header, write_gguf
from ds4lab.layout import main_tensors, mtp_tensors, planned_bytes, with_types
from ds4lab.synth import metadata

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a"
TINY = preset("tiny")


def _zeros(n: int):
    return lambda: np.zeros(n, np.uint8)


def write_layout(path: Path, cfg=TINY, routed=("IQ2_XXS", "Q2_K"), meta_edit=None, tensor_edit=None,
                 mtp=False) -> Path:
    """A file with the layout of `cfg` and zero data, after optional edits of metadata and tensors."""
    meta = metadata(cfg)
    if meta_edit:
        meta = meta_edit(meta)
    specs = main_tensors(cfg) + (mtp_tensors(cfg) if mtp else [])
    tensors = [TensorOut(s.name, t, s.dims, None) for s, t in with_types(specs, cfg, routed)]
    if tensor_edit:
        tensors = tensor_edit(tensors)
    tensors = [TensorOut(t.name, t.type_name, t.dims, _zeros(t.n_bytes)) for t in tensors]
    return write_gguf(path, meta, tensors)


def _retype(name: str, type_name: str):
    return lambda ts: [TensorOut(t.name, type_name if t.name == name else t.type_name, t.dims, None) for t in ts]


def _open_problems(path: Path) -> list[str]:
    with pytest.raises(ModelFileError) as err:
        gguf.open(path)
    assert str(path) in str(err.value)
    return err.value.problems


# ---- the oracle file -------------------------------------------------------------------

def test_oracle_opens_to_its_config_json(tiny_a_gguf):
    model = gguf.open(tiny_a_gguf)
    want = json.loads((ORACLE / "config.json").read_text())
    assert model.config.to_json() == {k: want[k] for k in model.config.to_json()}
    assert model.variant == "q2" and model.kind == "main" and len(model.tensors) == want["gguf"]["n_tensors"]


def test_header_agrees_with_gguf_py(tiny_a_gguf, tiny_a_reader, small_q4_mtp):
    main_config = gguf.open(small_q4_mtp[0]).config
    for path, reader in ((tiny_a_gguf, tiny_a_reader), (small_q4_mtp[1], None)):
        model = gguf.open(path, config=main_config)
        reader = reader or model.reader
        assert [t.name for t in reader.tensors] == list(model.tensors)
        for t in reader.tensors:
            mine = model.tensors[t.name]
            assert mine.type_name == t.tensor_type.name
            assert mine.dims == tuple(int(d) for d in t.shape)
            assert mine.offset == t.data_offset and mine.n_bytes == t.n_bytes
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                assert model.metadata[key] == field.contents(), key


def test_dequantize_matches_gguf_py_on_every_tensor_of_an_mtp_file(small_q4_mtp):
    main, mtp = small_q4_mtp
    model = gguf.open(mtp, config=gguf.open(main).config)
    for t in model.reader.tensors:
        mine = model.dequantize(t.name)
        ref = ggufpy.quants.dequantize(t.data, t.tensor_type)
        assert mine.shape == ref.shape and np.array_equal(mine, ref), t.name


def test_open_reads_no_tensor_data(tiny_a_gguf):
    model = gguf.open(tiny_a_gguf)
    assert "_map" not in model.__dict__
    view = model.raw("blk.0.ffn_gate_exps.weight")
    assert isinstance(view, np.memmap) and view.size == model.tensor("blk.0.ffn_gate_exps.weight").n_bytes


def test_tables(tiny_a_gguf):
    model = gguf.open(tiny_a_gguf)
    table = model.tensor_table()
    assert len(table) == 178 and table["bytes"].sum() == sum(t.n_bytes for t in model.tensors.values())
    assert str(table["layer"].dtype) == "Int64" and table["component"].notna().all()
    comp = model.component_bytes().set_index("component")["bytes"]
    assert comp["routed experts"] == sum(
        t.n_bytes for n, t in model.tensors.items() if n.endswith("_exps.weight"))
    assert comp["embedding"] == 256 * 129280 * 2
    summary = model.summary()
    json.dumps(summary)
    assert summary["variant"] == "q2" and summary["config"]["compress_ratios"] == [0, 0, 4, 128, 4, 128]


def test_published_file_sizes_from_the_layout():
    # ds4's README: "about 81 GB" for q2 and "about 153 GB" for q4 (GiB in the notes: 80.8 / 153.3).
    flash = preset("flash-dims", 43)
    q2, q4 = (sum(planned_bytes(flash, v).values()) / 2**30 for v in ("q2", "q4"))
    assert 80.6 < q2 < 81.0 and 153.1 < q4 < 153.5


# ---- variants -------------------------------------------------------------------------

def test_variants(tmp_path, small_q4_mtp):
    assert gguf.open(small_q4_mtp[0]).variant == "q4"
    mtp = gguf.open(small_q4_mtp[1], config=gguf.open(small_q4_mtp[0]).config)
    assert mtp.kind == "mtp" and mtp.variant == "q4"

    def mix(ts):
        return [TensorOut(t.name, "Q4_K", t.dims, None) if t.name.startswith("blk.4.ffn_") and "_exps" in t.name
                else t for t in ts]

    mixed = gguf.open(write_layout(tmp_path / "mixed.gguf", tensor_edit=mix))
    assert mixed.variant == "mixed" and mixed.layer_variants() == ["q2"] * 4 + ["q4", "q2"]


def test_main_and_mtp_in_one_file(tmp_path):
    model = gguf.open(write_layout(tmp_path / "both.gguf", mtp=True))
    assert model.kind == "main+mtp" and len(model.routed_types()) == TINY.n_layer + 1


def test_pro_shaped_metadata_reads(tmp_path):
    # A Pro-like schedule (layers 0-1 at ratio 128) on a small shape: the inventory follows the ratios.
    cfg = TINY.replace(compress_ratios=(128, 128, 4, 128, 4, 128))
    model = gguf.open(write_layout(tmp_path / "pro-like.gguf", cfg=cfg))
    assert model.config.compress_ratios[:2] == (128, 128)
    assert "blk.0.attn_compressor_kv.weight" in model.tensors
    assert "blk.0.indexer.proj.weight" not in model.tensors


# ---- bad files: each a ModelFileError naming the file, the field and what was wrong -----

def test_wrong_dims_type_and_missing_tensor_reported_together(tmp_path):
    def edit(ts):
        out = []
        for t in ts:
            if t.name == "blk.2.attn_q_a.weight":
                t = TensorOut(t.name, t.type_name, (TINY.n_embd, 128), None)
            if t.name == "blk.3.ffn_gate_inp.weight":
                t = TensorOut(t.name, "F32", t.dims, None)
            if t.name != "blk.1.attn_sinks.weight":
                out.append(t)
        return out

    problems = _open_problems(write_layout(tmp_path / "bad.gguf", tensor_edit=edit))
    text = "\n".join(problems)
    assert "tensor blk.2.attn_q_a.weight: dims (256, 128), expected (256, 256)" in text
    assert "tensor blk.3.ffn_gate_inp.weight: type F32, expected F16" in text
    assert "tensor blk.1.attn_sinks.weight: missing" in text
    assert len(problems) == 3


def test_routed_expert_rules(tmp_path):
    edit = _retype("blk.3.ffn_up_exps.weight", "Q2_K")
    problems = _open_problems(write_layout(tmp_path / "r.gguf", tensor_edit=edit))
    assert any("gate is IQ2_XXS but up is Q2_K" in p for p in problems)
    problems = _open_problems(write_layout(tmp_path / "r2.gguf",
                                           tensor_edit=_retype("blk.0.ffn_down_exps.weight", "Q8_0")))
    assert any("ffn_down_exps.weight: type Q8_0, expected IQ2_XXS or Q2_K or Q4_K" in p for p in problems)


def test_tensors_that_contradict_the_ratio_schedule(tmp_path):
    meta_edit = _set_meta("deepseek4.attention.compress_ratios", [0, 0, 4, 4, 4, 128])
    problems = _open_problems(write_layout(tmp_path / "sched.gguf", meta_edit=meta_edit))
    text = "\n".join(problems)
    assert "blk.3.indexer.proj.weight: missing" in text
    assert "blk.3.attn_compressor_ape.weight: dims (256, 128), expected (512, 4)" in text


def test_hash_table_required_on_hash_layers(tmp_path):
    problems = _open_problems(write_layout(
        tmp_path / "h.gguf", tensor_edit=lambda ts: [t for t in ts if t.name != "blk.2.ffn_gate_tid2eid.weight"]))
    assert problems == ["tensor blk.2.ffn_gate_tid2eid.weight: missing (expected I32 with dims (6, 129280))"]


def _set_meta(key, value, vtype=None):
    def edit(meta):
        return [(k, vtype or t, value) if k == key else (k, t, v) for k, t, v in meta]
    return edit


def test_bad_metadata(tmp_path):
    problems = _open_problems(write_layout(tmp_path / "m.gguf", meta_edit=_set_meta(
        "deepseek4.attention.head_count", "eight", "STRING")))
    assert problems == ["deepseek4.attention.head_count: expected an integer in 1..1048576, found 'eight'"]
    problems = _open_problems(write_layout(tmp_path / "m2.gguf", meta_edit=lambda m: [
        kv for kv in m if kv[0] not in ("deepseek4.expert_count", "tokenizer.ggml.merges")]))
    assert problems == ["deepseek4.expert_count: required key is missing"]
    problems = _open_problems(write_layout(tmp_path / "m3.gguf", meta_edit=lambda m: [
        kv for kv in m if kv[0] != "tokenizer.ggml.merges"]))
    assert problems == ["tokenizer.ggml.merges: required string array is missing"]
    problems = _open_problems(write_layout(tmp_path / "m4.gguf", meta_edit=_set_meta("general.architecture", "llama")))
    assert problems == ["general.architecture: expected 'deepseek4', found 'llama'"]


def test_truncated_file_names_the_tensor(tmp_path, tiny_q2):
    data = tiny_q2.read_bytes()
    last = max(gguf.open(tiny_q2).tensors.values(), key=lambda t: t.offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFileError) as err:
        gguf.open(cut)
    assert f"tensor {last.name}: data" in str(err.value) and "truncated" in str(err.value)
    assert err.value.offset is not None
    cut.write_bytes(data[:200000])
    with pytest.raises(ModelFileError, match=r"cannot fit|truncated or corrupt"):
        gguf.open(cut)


def test_not_a_gguf(tmp_path):
    for content in (b"", b"hello", b"PK\x03\x04" + bytes(100), b"GGUF" + struct.pack("<I", 2) + bytes(40)):
        path = tmp_path / "x.bin"
        path.write_bytes(content)
        with pytest.raises(ModelFileError) as err:
            gguf.open(path)
        assert str(path) in str(err.value)
    with pytest.raises(ModelFileError, match="cannot read file"):
        gguf.open(tmp_path / "missing.gguf")


def test_hostile_counts_fail_fast(tmp_path, tiny_q2):
    data = bytearray(tiny_q2.read_bytes()[:200000])
    # header kv_count at offset 16: a count no file could hold
    hostile = bytearray(data)
    hostile[16:24] = struct.pack("<Q", 1 << 60)
    path = tmp_path / "hostile.gguf"
    path.write_bytes(bytes(hostile))
    with pytest.raises(ModelFileError, match="cannot fit"):
        gguf.open(path)
    # the first key's string length
    hostile = bytearray(data)
    hostile[24:32] = struct.pack("<Q", 1 << 62)
    path.write_bytes(bytes(hostile))
    with pytest.raises(ModelFileError, match="string length"):
        gguf.open(path)
    # the token array's length
    pos = data.find(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4
    hostile = bytearray(data)
    hostile[pos:pos + 8] = struct.pack("<Q", 1 << 61)
    path.write_bytes(bytes(hostile))
    with pytest.raises(ModelFileError, match="cannot fit"):
        gguf.open(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 7000), st.integers(0, 255)), min_size=1, max_size=8))
def test_random_header_corruption_never_crashes(tmp_path_factory, tiny_q2, flips):
    path = tmp_path_factory.mktemp("fuzz") / "f.gguf"
    data = bytearray(tiny_q2.read_bytes()[:8000])
    for pos, value in flips:
        data[pos] = value
    path.write_bytes(bytes(data))
    try:
        read_header(path)
    except ModelFileError as err:
        assert str(path) in str(err)


def test_write_is_atomic(tmp_path):
    target = tmp_path / "keep.gguf"
    target.write_bytes(b"the user's file")

    def boom():
        raise RuntimeError("generator failed")

    with pytest.raises(RuntimeError):
        write_gguf(target, [("general.architecture", "STRING", "deepseek4")],
                   [TensorOut("x", "F32", (4,), boom)])
    assert target.read_bytes() == b"the user's file"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.gguf"]
