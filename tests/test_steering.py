"""Steering: ds4's projection rule on the sublayer outputs, files in both formats, building, sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from ds4lab import load
from ds4lab.cli import main as cli_main
from ds4lab.generation import generate
from ds4lab.steering import SteeringVector, collect_activations, render_prompt, sweep
from ds4lab.tokenizer import load as load_tokenizer

DATA = Path(__file__).resolve().parent.parent / "data" / "steering"
POINTS = ("attn.hook_out", "ffn.hook_out")


@pytest.fixture(scope="module")
def model(tiny_q2):
    return load(tiny_q2)


@pytest.fixture(scope="module")
def tokens(model):
    return load_tokenizer(mode="ds4").encode(render_prompt("Why is the sky blue?"))


def random_vector(cfg, seed=0) -> SteeringVector:
    rows = np.random.default_rng(seed).standard_normal((cfg.n_layer, cfg.n_embd))
    return SteeringVector(rows / np.linalg.norm(rows, axis=1, keepdims=True))


def sublayer_outputs(model, tokens, **steering):
    """(before, after) the steering edit: {hook name: [T, n_embd]} recorded around the steering hooks."""
    before, after = {}, {}

    def recorder(store):
        def fn(act, hook):
            store[hook.name] = np.array(act)
        return fn

    def every(name):
        return name.startswith("blocks.") and name.split(".", 2)[2] in POINTS

    with model.hooks([(every, recorder(before))]), model.steering(**steering), \
            model.hooks([(every, recorder(after))]):
        model(tokens)
    return before, after


def test_scale_one_removes_the_component(model, tokens):
    v = random_vector(model.config)
    before, after = sublayer_outputs(model, tokens, vector=v, attn=1.0, ffn=1.0, layers=[2, 4])
    for name in before:
        layer = int(name.split(".")[1])
        d = v.directions[layer]
        if layer in (2, 4):
            assert np.abs(before[name] @ d).max() > 1e-2            # there was a component to remove
            scale = np.linalg.norm(before[name], axis=1)
            assert np.all(np.abs(after[name] @ d) <= 1e-5 * scale)
            expected = before[name] - np.outer(before[name] @ d, d)
            np.testing.assert_allclose(after[name], expected, rtol=0, atol=1e-5 * scale.max())
        else:
            assert np.array_equal(after[name], before[name])            # other layers untouched


@pytest.mark.parametrize("s", [-2.0, -0.5, 0.5, 2.0])
def test_component_becomes_one_minus_s_times(model, tokens, s):
    v = random_vector(model.config, seed=1)
    before, after = sublayer_outputs(model, tokens, vector=v, attn=s, ffn=s)
    for name in before:
        d = v.directions[int(name.split(".")[1])]
        c0, c1 = before[name] @ d, after[name] @ d
        tol = 1e-5 * np.linalg.norm(before[name], axis=1).max()
        np.testing.assert_allclose(c1, (1 - s) * c0, rtol=0, atol=tol)
        # Only the component along v changes.
        np.testing.assert_allclose(after[name] - np.outer(c1, d), before[name] - np.outer(c0, d), rtol=0, atol=tol)


def test_separate_scales_and_additive_mode(model, tokens):
    v = random_vector(model.config, seed=2)
    before, after = sublayer_outputs(model, tokens, vector=v, attn=0.0, ffn=0.75, mode="add", layers=range(1, 3))
    for name in before:
        layer = int(name.split(".")[1])
        if name.endswith("ffn.hook_out") and layer in (1, 2):
            np.testing.assert_allclose(after[name], before[name] + 0.75 * v.directions[layer], rtol=0, atol=1e-6)
        else:
            assert np.array_equal(after[name], before[name])


def test_scale_zero_is_bit_identical_and_steering_ends_with_the_block(model, tokens):
    v = random_vector(model.config, seed=3)
    plain = np.array(model(tokens))
    for mode in ("project", "add"):
        with model.steering(v, attn=0.0, ffn=0.0, mode=mode):
            assert np.array_equal(np.array(model(tokens)), plain)
    with model.steering(v, ffn=1.0):
        steered = np.array(model(tokens))
    assert np.abs(steered - plain).max() > 1e-3
    assert np.array_equal(np.array(model(tokens)), plain)


def test_steering_reaches_sessions_and_run_with_cache(model, tokens):
    v = random_vector(model.config, seed=4)
    with model.steering(v, ffn=1.0, layers=[3]):
        full = np.array(model(tokens))
        session = model.session()
        session.prefill(tokens[:-1])
        decoded = np.array(session.decode(tokens[-1]))
        _, cache = model.run_with_cache(tokens, "blocks.3.ffn.hook_out")
        first = generate(model, tokens, 1).steps[0]
    np.testing.assert_allclose(decoded, full[-1], rtol=1e-4, atol=1e-4)
    steered_logprobs = full[-1] - np.logaddexp.reduce(full[-1].astype(np.float64))
    assert first.token == int(np.argmax(full[-1]))
    assert abs(first.logprob - steered_logprobs[first.token]) < 1e-3
    assert not np.allclose(full[-1], np.array(model(tokens))[-1], atol=1e-3)     # steering did change them
    assert np.abs(cache["blocks.3.ffn.hook_out"] @ v.directions[3]).max() < 1e-4


def test_vector_must_fit_the_model(model):
    with pytest.raises(ValueError):
        model.steering(SteeringVector(np.ones((2, model.config.n_embd + 1))))
    with pytest.raises(ValueError):
        model.steering(random_vector(model.config), layers=[model.config.n_layer])
    with pytest.raises(ValueError):
        model.steering(random_vector(model.config), mode="scale")


# ---- files ---------------------------------------------------------------------------------------
def test_ds4_round_trip_is_raw_little_endian_rows(tmp_path):
    rows = np.random.default_rng(5).standard_normal((7, 24)).astype(np.float32)
    path = SteeringVector(rows, {"component": "ffn_out"}).save(tmp_path / "v.f32")
    assert path.read_bytes() == rows.astype("<f4").tobytes()
    meta = json.loads((tmp_path / "v.json").read_text())
    assert meta["format"] == "ds4-directional-steering-v1" and meta["shape"] == [7, 24]
    back = SteeringVector.load(path)
    assert np.array_equal(back.directions, rows) and back.metadata["component"] == "ffn_out"
    assert np.array_equal(SteeringVector.load(tmp_path / "v.json").directions, rows)
    (tmp_path / "v.json").unlink()                       # without the JSON: rows of the given width
    assert np.array_equal(SteeringVector.load(path, n_embd=24).directions, rows)
    with pytest.raises(ValueError):
        SteeringVector.load(path, n_embd=25)


def test_gguf_round_trip_as_llama_cpp_control_vector(tmp_path):
    rows = np.random.default_rng(6).standard_normal((5, 16)).astype(np.float32)
    rows[0] = 0                                          # an unsteered layer is not written
    path = SteeringVector(rows, {"method": "pca"}).save(tmp_path / "v.gguf", format="gguf")
    reader = gguf.GGUFReader(path)
    assert reader.get_field("general.architecture").contents() == "controlvector"
    assert {t.name for t in reader.tensors} == {f"direction.{k}" for k in range(1, 5)}
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.array(t.data), rows[int(t.name.split(".")[1])])
    back = SteeringVector.load(path)
    assert np.array_equal(back.directions, rows) and back.metadata["method"] == "pca"


def test_reads_a_control_vector_gguf_from_another_writer(tmp_path):
    rows = np.random.default_rng(7).standard_normal((3, 8)).astype(np.float32)
    writer = gguf.GGUFWriter(tmp_path / "cv.gguf", "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", 3)
    for k, row in enumerate(rows, start=1):
        writer.add_tensor(f"direction.{k}", row)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    back = SteeringVector.load(tmp_path / "cv.gguf")
    assert back.directions.shape == (4, 8)
    assert not back.directions[0].any() and np.array_equal(back.directions[1:], rows)


def test_ds4_verbosity_direction_loads():
    v = SteeringVector.load(DATA / "verbosity.f32")
    # dir-steering/out/verbosity.json and the spec: 43 x 4096 unit rows built from ffn_out;
    # layer 42's largest coordinate is index 3077, about -0.200; layers' directions are far apart.
    assert v.directions.shape == (43, 4096) and v.metadata["component"] == "ffn_out"
    assert v.metadata["orthogonalize_control_mean"] is True
    np.testing.assert_allclose(np.linalg.norm(v.directions.astype(np.float64), axis=1), 1.0, atol=1e-6)
    assert np.argmax(np.abs(v.directions[42])) == 3077 and abs(v.directions[42, 3077] + 0.200) < 5e-4
    cos = v.directions @ v.directions.T
    assert np.abs(cos - np.diag(np.diag(cos))).max() < 0.27
    bare = Path(DATA / "verbosity.f32")
    assert bare.stat().st_size == 43 * 4096 * 4


# ---- building ------------------------------------------------------------------------------------
TARGET = [f"Tell me one fact about the number {n}." for n in range(6)]
CONTROL = [f"Describe the colour of item {n} in detail." for n in range(6)]


@pytest.fixture(scope="module")
def planted(model):
    """(target, control activations, the planted direction, its layer): the target prompts' FFN
    output at that layer is shifted along a random direction by three times a typical output's norm."""
    cfg, layer = model.config, 3
    direction = np.random.default_rng(8).standard_normal(cfg.n_embd)
    direction /= np.linalg.norm(direction)
    control = collect_activations(model, CONTROL)
    shift = mx.array((3.0 * np.linalg.norm(control[:, layer], axis=1).mean() * direction).astype(np.float32))

    def plant(act, hook):
        return act + shift

    with model.hooks([(f"blocks.{layer}.ffn.hook_out", plant)]):
        target = collect_activations(model, TARGET)
    return target, control, direction, layer


@pytest.mark.parametrize("method", ["mean", "pair_mean", "pca"])
def test_build_recovers_a_planted_direction(planted, method):
    target, control, direction, layer = planted
    v = SteeringVector.from_activations(target, control, method=method)
    assert v.directions[layer] @ direction >= 0.95
    assert abs(v.directions[layer - 1] @ direction) < 0.5      # upstream layers cannot see the plant
    np.testing.assert_allclose(np.linalg.norm(v.directions, axis=1), 1.0, atol=1e-6)
    base = control.mean(axis=0)
    assert np.abs((v.directions * base).sum(axis=1)).max() < 1e-4 * np.linalg.norm(base, axis=1).max()


def test_from_activations_follows_ds4s_rules():
    rng = np.random.default_rng(9)
    target, control = rng.standard_normal((4, 2, 6)), rng.standard_normal((5, 2, 6))
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    d = unit(target.mean(0) - control[:4].mean(0))              # ds4 uses min(n) pairs
    v = SteeringVector.from_activations(target, control, orthogonalize=False)
    np.testing.assert_allclose(v.directions, d, atol=1e-6)
    b = unit(control[:4].mean(0))
    v = SteeringVector.from_activations(target, control)
    np.testing.assert_allclose(v.directions, unit(d - (d * b).sum(-1, keepdims=True) * b), atol=1e-6)
    v = SteeringVector.from_activations(target, control, method="pair_mean", orthogonalize=False)
    np.testing.assert_allclose(v.directions, unit(unit(target - control[:4]).mean(0)), atol=1e-6)
    assert v.metadata["pair_normalize"] is True


@pytest.mark.parametrize("component", ["ffn", "attn+ffn"])
def test_collected_rows_are_the_last_token_or_the_mean(model, component):
    prompt = "Why is the sky blue?"
    ids = load_tokenizer(mode="ds4").encode(render_prompt(prompt))
    parts = ("attn.hook_out", "ffn.hook_out") if component == "attn+ffn" else ("ffn.hook_out",)
    _, cache = model.run_with_cache(ids, lambda n: n.startswith("blocks.") and n.split(".", 2)[2] in parts)
    per_layer = np.stack([sum(cache[f"blocks.{k}.{p}"] for p in parts) for k in range(model.config.n_layer)])
    last = collect_activations(model, [prompt], component=component)[0]
    mean = collect_activations(model, [prompt], component=component, position="mean")[0]
    np.testing.assert_allclose(last, per_layer[:, -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, per_layer.mean(axis=1), rtol=1e-5, atol=1e-5)


def test_cli_build_and_sweep(model, tiny_q2, tmp_path):
    (tmp_path / "a.txt").write_text("# terse\nTell me one fact.\n\nName a colour.\n")
    (tmp_path / "b.txt").write_text("Describe the ocean at great length.\nWrite an essay about colour.\n")
    out = tmp_path / "v.f32"
    assert cli_main(["steer", "build", str(tiny_q2), "--target", str(tmp_path / "a.txt"),
                     "--control", str(tmp_path / "b.txt"), "--out", str(out)]) == 0
    v = SteeringVector.load(out)
    assert v.directions.shape == (model.config.n_layer, model.config.n_embd)
    assert v.metadata["pairs"] == 2 and v.metadata["component"] == "ffn_out"
    assert v.metadata["good_file"].endswith("a.txt")
    np.testing.assert_allclose(np.linalg.norm(v.directions, axis=1), 1.0, atol=1e-6)
    # The directions, by hand from the prompts' activations: unit(mean target - mean control)
    # per layer, after removing the component along the control mean.
    target = collect_activations(model, ["Tell me one fact.", "Name a colour."], component="ffn")
    control = collect_activations(model, ["Describe the ocean at great length.", "Write an essay about colour."],
                                  component="ffn")
    diff = (target.mean(axis=0) - control.mean(axis=0)).astype(np.float64)
    c = control.mean(axis=0) / np.linalg.norm(control.mean(axis=0), axis=1, keepdims=True)
    diff -= (diff * c).sum(axis=1, keepdims=True) * c
    np.testing.assert_allclose(v.directions, diff / np.linalg.norm(diff, axis=1, keepdims=True), atol=2e-5)

    (tmp_path / "p.txt").write_text("Why is the sky blue?\n")
    csv = tmp_path / "sweep.csv"
    assert cli_main(["steer", "sweep", str(tiny_q2), "--vector", str(out), "--prompts", str(tmp_path / "p.txt"),
                     "--scales", "0", "-1", "--max-tokens", "3", "--out", str(csv)]) == 0
    import pandas as pd

    frame = pd.read_csv(csv)
    assert list(frame["scale"]) == [0.0, -1.0] and (frame["n_tokens"] <= 3).all()
    assert {f"proj_{k}" for k in range(model.config.n_layer)} <= set(frame.columns)


def test_sweep_scale_zero_is_plain_generation(model, tokens):
    v = random_vector(model.config, seed=10)
    frame = sweep(model, v, ["Why is the sky blue?"], [0.0, 1.0], layers=[None, [2]], max_tokens=3)
    assert len(frame) == 4 and list(frame["layers"]) == ["all", "all", "2", "2"]
    plain = generate(model, tokens, 3)
    zero = frame[frame["scale"] == 0.0]
    assert (zero["text"] == plain.text).all()
    np.testing.assert_allclose(zero["logprob"], sum(s.logprob for s in plain.steps), rtol=1e-6)
    assert {"n_words", "mean_logprob", "finish", "proj_0"} <= set(frame.columns)
