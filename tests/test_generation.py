"""Generation: samplers, stop strings, streamed text, greedy against ds4, ds4's dump schema."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4lab import generation, load, tokenizer
from ds4lab.eval import compare_vectors
from ds4lab.generation import Emitter, Sampling, dump_logprobs, generate, sample, stream, token_bytes

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a"
OFFICIAL = Path(__file__).resolve().parents[2] / "shared" / "vectors" / "official"


@pytest.fixture(scope="module")
def tiny(tiny_q2):
    return load(tiny_q2)


def test_sampler_rules():
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0])
    assert sample(logits, Sampling(), rng) == 1                       # greedy, tie to the lower id
    assert sample(logits, Sampling(temperature=1.0, top_k=1), rng) == 1
    draws = {sample(logits, Sampling(temperature=1.0, top_k=3, seed=1), rng) for _ in range(200)}
    assert draws == {1, 2, 3}
    # min_p 0.5 keeps what is at least half as likely as the best: ids 1 and 3 (2 is e^-1 = 0.37).
    draws = {sample(logits, Sampling(temperature=1.0, min_p=0.5), rng) for _ in range(200)}
    assert draws == {1, 3}
    # top_p 0.5: the first token alone already reaches 0.5 of the mass among {1, 3, 2, ...}
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert probs[1] < 0.5 and probs[1] + probs[3] >= 0.5
    draws = {sample(logits, Sampling(temperature=1.0, top_p=0.5), rng) for _ in range(200)}
    assert draws == {1, 3}


def test_seeded_sampling_repeats(tiny):
    s = Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=11)
    a = generate(tiny, list(range(500, 520)), max_tokens=6, sampling=s)
    b = generate(tiny, list(range(500, 520)), max_tokens=6, sampling=s)
    assert a.tokens == b.tokens and len(a.tokens) == 6 and a.finish_reason == "length"


def test_streamed_text_is_the_decoded_tokens(tiny):
    g = generate(tiny, list(range(700, 720)), max_tokens=10, top_logprobs=3)
    assert g.text == b"".join(token_bytes(t) for t in g.tokens).decode("utf-8", errors="replace")
    assert g.text == tiny.tokenizer.decode(g.tokens)
    assert all(len(s.top) == 3 and s.top[0][0] == s.token for s in g.steps)


def test_greedy_logprobs_are_the_rows_log_softmax(tiny):
    # The greedy stream reads each token's log-prob from the device (`_greedy_choice`), not
    # from the row: log-softmax of the session's logits in float64 up to the float32 sum over
    # the vocabulary (1.5e-5 relative measured on the CPU), as is the stream that reads the
    # rows for its top alternatives.
    prompt = list(range(700, 720))
    fast = generate(tiny, prompt, max_tokens=6)
    ranked = generate(tiny, prompt, max_tokens=6, top_logprobs=2)
    session = tiny.session()
    rows = [np.array(session.prefill(prompt), dtype=np.float64)]
    for token in fast.tokens[:-1]:
        rows.append(np.array(session.decode(token), dtype=np.float64))
    for step, other, row in zip(fast.steps, ranked.steps, rows, strict=True):
        expected = row[step.token] - np.logaddexp.reduce(row)
        assert step.token == int(np.argmax(row)) == other.token
        assert abs(step.logprob - expected) < 1e-4 * max(1.0, abs(expected))
        assert abs(other.logprob - expected) < 1e-6 * max(1.0, abs(expected))
        assert step.top == [] and other.top[0][0] == step.token


def test_stop_strings(tiny):
    full = generate(tiny, list(range(700, 720)), max_tokens=10)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    cut = generate(tiny, list(range(700, 720)), max_tokens=10, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text) and full.text[len(cut.text):].startswith(stop)


def test_greedy_matches_ds4_on_tiny_a(tiny_a_gguf):
    oracle = np.load(ORACLE / "oracle.npz")
    model = load(tiny_a_gguf, numerics="ds4-cpu")
    steps = list(stream(model, [int(t) for t in oracle["tokens"]], max_tokens=16))
    gaps = oracle["gen_topk_logits"][:, 0] - oracle["gen_topk_logits"][:, 1]
    first_tie = int(np.argmax(gaps < 0.2)) if (gaps < 0.2).any() else 16
    assert [s.token for s in steps[:first_tie]] == oracle["gen_ids"][:first_tie].tolist()
    assert first_tie >= 4


def test_dump_logprobs_schema_and_scoring(tmp_path, tiny):
    path = dump_logprobs(tiny, list(range(900, 910)), tmp_path / "dump.json", max_tokens=3, top_k=5)
    doc = json.loads(path.read_text())
    assert {"source", "prompt_tokens", "ctx", "top_k", "steps"} <= set(doc) and doc["prompt_tokens"] == 10
    step = doc["steps"][0]
    assert set(step) == {"step", "selected", "top_logprobs"}
    assert set(step["selected"]) == {"id", "text", "bytes"}
    assert {"token", "logit", "logprob"} == set(step["top_logprobs"][0])
    assert step["top_logprobs"][0]["token"]["id"] == step["selected"]["id"]
    # A dump scored against itself (in the official schema) agrees everywhere.
    official = {"steps": [{"step": s["step"], "token": s["selected"], "logprob": s["top_logprobs"][0]["logprob"],
                           "top_logprobs": s["top_logprobs"]} for s in doc["steps"]]}
    scores = compare_vectors(doc, official)
    assert scores["top1_match"].all() and (scores["topk_overlap"] == 1).all()
    assert (scores["mean_abs_logprob_diff"] == 0).all()
    real = json.loads((OFFICIAL / "short_italian_fact.official.json").read_text())
    against = compare_vectors(doc, real)
    assert len(against) == 3 and not against["top1_match"].any()


def test_dump_logprobs_are_the_models_and_scoring_is_exact(tmp_path, tiny):
    # The dump's logprobs are log-softmax of the model's own logits (computed here in float64
    # from a teacher-forced run), and the scorer's numbers are the hand-computed ones.
    prompt = list(range(900, 910))
    doc = json.loads(dump_logprobs(tiny, prompt, tmp_path / "dump.json", max_tokens=3, top_k=5).read_text())
    chosen = [s["selected"]["id"] for s in doc["steps"]]
    logits = np.array(tiny.session().prefill_all(prompt + chosen[:-1]).logits, dtype=np.float64)
    for k, step in enumerate(doc["steps"]):
        row = logits[len(prompt) - 1 + k]
        lp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        ids = [t["token"]["id"] for t in step["top_logprobs"]]
        assert ids == np.argsort(-row, kind="stable")[:5].tolist()
        assert np.allclose([t["logprob"] for t in step["top_logprobs"]], lp[ids], atol=2e-5)
    # Scoring: drop one shared token and move another's logprob by 0.25: overlap 4/5, mean |Δ| 0.25/4.
    first = doc["steps"][0]
    moved = [dict(t) for t in first["top_logprobs"]]
    moved[1]["logprob"] += 0.25
    moved[4]["token"] = {"id": -1, "text": "\u2400", "bytes": [0xE2, 0x90, 0x80]}
    official = {"steps": [{"step": 0, "token": first["selected"], "logprob": moved[0]["logprob"],
                           "top_logprobs": moved}]}
    row = compare_vectors(doc, official).iloc[0]
    assert row["top1_match"] and row["topk_overlap"] == 0.8
    assert row["mean_abs_logprob_diff"] == pytest.approx(0.25 / 4, abs=1e-12)


@pytest.fixture(params=[(), (0, 1, 99)], ids=["one piece", "pieces"])
def commits(request, tiny):
    """The greedy stream handing each step over in one piece, or in pieces up to layers 0 and 1
    (and a layer past the model's, which is left out)."""
    tiny.stream_commits = request.param
    yield request.param
    tiny.stream_commits = ()


def _plain_greedy(model, prompt: list[int], n: int, held_at: int, path) -> tuple[list[int], bytes]:
    """n greedy tokens decoded one by one, and the session's .kv bytes when token `held_at`
    is chosen (before it is consumed: what a stream's session holds when it yields it)."""
    plain = model.session()
    logits = plain.prefill(prompt)
    tokens, held = [], b""
    for i in range(n):
        tokens.append(int(np.argmax(np.array(logits))))
        if i == held_at:
            held = plain.save_kv(path, now=0).read_bytes()
        logits = plain.decode(tokens[-1])
    return tokens, held


def test_greedy_stream_runs_ahead_yet_leaves_the_session_as_plain_decoding(tmp_path, tiny, commits):
    """Greedy `stream` queues each next step before reading the token (pipelined); its tokens
    and the session it leaves, also when the caller stops early, are plain decoding's, whether
    a step is handed over in one piece or in several (`Model.stream_commits`)."""
    prompt = list(range(700, 720))
    tokens, held = _plain_greedy(tiny, prompt, 6, 3, tmp_path / "plain.kv")
    session = tiny.session()
    got = []
    for step in stream(tiny, prompt, max_tokens=10, session=session):
        got.append(step.token)
        if len(got) == 4:
            break
    assert got == tokens[:4]
    assert session.tokens == prompt + tokens[:3] and all(type(t) is int for t in session.tokens)
    assert session.save_kv(tmp_path / "stream.kv", now=0).read_bytes() == held
    full = tiny.session()
    assert generate(tiny, prompt, max_tokens=6, session=full).tokens == tokens
    assert full.tokens == prompt + tokens[:5]                # the last token is not consumed


@pytest.mark.parametrize("steps_ahead", [1, 2, 3])
def test_greedy_stream_builds_its_steps_ahead_and_none_past_the_last(tmp_path, tiny, monkeypatch, steps_ahead):
    """Each token is read with the steps of the next `STEPS_AHEAD` already built (none past
    the last), and the tokens, the session left after an early stop and after the last step
    are plain decoding's however far ahead the stream runs."""
    monkeypatch.setattr(generation, "STEPS_AHEAD", steps_ahead)
    prompt = list(range(700, 720))
    tokens, held = _plain_greedy(tiny, prompt, 6, 2, tmp_path / "plain.kv")
    counted, decodes = tiny.session(), []
    real = counted.decode
    counted.decode = lambda token: decodes.append(token) or real(token)
    got, built = [], []
    for step in stream(tiny, prompt, max_tokens=6, session=counted):
        got.append(step.token)
        built.append(len(decodes))
        if len(got) == 3:
            assert counted.tokens == prompt + tokens[:2] and all(type(t) is int for t in counted.tokens)
            assert counted.save_kv(tmp_path / "stream.kv", now=0).read_bytes() == held
    assert got == tokens
    assert built == [min(k + steps_ahead, 5) for k in range(6)]
    assert counted.tokens == prompt + tokens[:5]


def test_token_bytes_of_an_id_past_the_vocabulary_is_empty_and_the_stream_goes_on():
    # A model's output rows may outnumber the tokenizer's tokens (a random model picks them).
    v = tokenizer.vocab()
    assert token_bytes(len(v.tokens)) == b"" and token_bytes(len(v.tokens) + 7) == b""
    assert token_bytes(len(v.tokens) - 1) != b""
    emitter = Emitter(3, (), 0)
    step = emitter.step(len(v.tokens) + 1, mx.zeros((len(v.tokens) + 8,)))
    assert step.token == len(v.tokens) + 1 and not step.finish
