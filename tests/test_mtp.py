"""MTP: the head loads and drafts, speculative decoding is lossless with exact rollback, the
offline acceptance is the online one, sampled verification follows p, a fitted head saves."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

import ds4lab
from ds4lab import gguf, mtp
from ds4lab.errors import ModelFileError
from ds4lab.mtp import SpecConfig, accept_or_resample
from ds4lab.steering import SteeringVector
from ds4lab.synth import make_model, successor_drafter

N_TOKENS = 6
SHORT = 4           # tokens per run of the lossless matrix (32 configs)
FIT_STEPS = 200


@pytest.fixture(scope="module")
def tiny_mtp(synth_dir):
    """4 layers of `tiny` (raw, raw, ratio 4, ratio 128), 128 random vocabulary rows, its MTP file."""
    mx.set_default_device(mx.cpu)
    main, head = make_model(synth_dir / "tiny4-mtp.gguf", "tiny", "q2", mtp=True, seed=5, n_layer=4, vocab_rows=128)
    rows = np.flatnonzero(np.abs(gguf.open(main).dequantize("token_embd.weight")).sum(axis=1))
    return main, head, rows


@pytest.fixture(scope="module")
def plain(tiny_mtp, tmp_path_factory):
    """The model, a prompt, plain greedy decoding's tokens and the .kv bytes it leaves."""
    main, head, rows = tiny_mtp
    model = ds4lab.load(main, mtp=head)
    prompt = [int(t) for t in np.random.default_rng(0).choice(rows, 12)]
    session = model.session()
    tokens = ds4lab.generate(model, prompt, N_TOKENS, session=session).tokens
    kv = session.save_kv(tmp_path_factory.mktemp("kv") / "plain.kv", now=0).read_bytes()
    return model, prompt, tokens, kv


@pytest.fixture(scope="module")
def fitted(tiny_mtp, tmp_path_factory):
    """A head fitted under ds4's pairing on random text and saved; the main model with it
    loaded from the file; held-out text and the random head's acceptance on it."""
    main, head, rows = tiny_mtp
    model = ds4lab.load(main, mtp=head)
    rng = np.random.default_rng(2)
    train = [[int(t) for t in rng.choice(rows, 256)] for _ in range(4)]
    held = [int(t) for t in rng.choice(rows, 64)]
    before = mtp.teacher_forced(model, held, pairing="ds4")["accepted"].mean()
    result = mtp.fit(model, train, steps=FIT_STEPS, pairing="ds4", held_out=held, eval_every=FIT_STEPS)
    path = result.save(tmp_path_factory.mktemp("fit") / "fitted-mtp.gguf")
    return result, path, ds4lab.load(main, mtp=path), held, before


@pytest.fixture(scope="module")
def fitted_plain(fitted, tmp_path_factory):
    """The fitted model, a prompt from its held-out text, SHORT tokens of plain greedy decoding
    and the .kv bytes they leave."""
    model, prompt = fitted[2], fitted[3][:12]
    session = model.session()
    tokens = ds4lab.generate(model, prompt, SHORT, session=session).tokens
    return model, prompt, tokens, session.save_kv(tmp_path_factory.mktemp("kv") / "short.kv", now=0).read_bytes()


def _run(model, prompt, spec, tmp_path, n=N_TOKENS):
    session = model.session()
    out = ds4lab.generate(model, prompt, n, spec=spec, session=session)
    return out, session.save_kv(tmp_path / "spec.kv", now=0).read_bytes()


def _scripted(prompt, tokens, right: float, seed: int = 0):
    """A drafter proposing plain decoding's next tokens, each replaced by a wrong one with 1 - right."""
    rng = np.random.default_rng(seed)

    def drafter(context, k):
        start = len(context) - len(prompt)
        truth = (list(tokens[start:start + k]) + [0] * k)[:k]
        return [t if rng.random() < right else (t + 1) % 129280 for t in truth]

    return drafter


def test_head_loads_with_its_points_and_refuses_another_models(tiny_mtp, small_q4_mtp):
    main, head, _ = tiny_mtp
    model = ds4lab.load(main, mtp=head)
    names = model.hook_names()
    bare = ds4lab.load(main)
    assert bare.mtp is None and "mtp.hook_e" not in bare.hook_names()
    for name in ("mtp.hook_e", "mtp.hook_h", "mtp.hook_in", "mtp.attn.hook_q", "mtp.ffn.hook_experts",
                 "mtp.hook_resid_post", "mtp.hook_logits"):
        assert name in names
    assert not [n for n in names if n.startswith("mtp.attn.compressor") or n.startswith("mtp.attn.indexer")]
    with pytest.raises(ModelFileError) as err:
        ds4lab.load(main, mtp=small_q4_mtp[1])          # the `small` shape's head
    assert str(small_q4_mtp[1]) in str(err.value) and "mtp.0.attn_q_a.weight" in str(err.value)
    with pytest.raises(ModelFileError, match="not an MTP file"):
        ds4lab.load(main, mtp=main)


def test_draft_forward_is_the_formula(plain):
    # e and h as the formula computes them from the weights decoded by hand; the logits from
    # the head's final norm through the shared output matrix.
    model, prompt, _, _ = plain
    session = model.session()
    session.prefill(prompt)
    names = ["mtp.hook_e", "mtp.hook_h", "mtp.hook_in", "mtp.hook_final_norm", "mtp.hook_logits"]
    seen = {}
    with model.hooks([(n, lambda act, hook: seen.__setitem__(hook.name, np.array(act))) for n in names]):
        model.mtp.run(model, model.mtp.empty_state(model.config, len(prompt) - 1), session.state.hidden[None], [7])
    cfg, head = model.config, model.mtp

    def rms(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * np.array(w)

    emb = np.array(model.weights.token_embd[7]).astype(np.float32)
    e = rms(emb, head.enorm) @ np.array(head.e_proj.dense()).T
    h = rms(np.array(session.state.hidden), head.hnorm) @ np.array(head.h_proj.dense()).T
    assert np.allclose(seen["mtp.hook_e"][0], e, rtol=1e-4, atol=1e-4)
    assert np.allclose(seen["mtp.hook_h"][0], h, rtol=1e-4, atol=1e-4)
    assert np.allclose(seen["mtp.hook_in"][0], e[None] + h, rtol=1e-4, atol=1e-4)
    logits = seen["mtp.hook_final_norm"] @ np.array(model.weights.output.dense()).T
    assert np.allclose(logits, seen["mtp.hook_logits"], rtol=1e-4, atol=1e-4)


HEAD_CONFIGS = [SpecConfig(draft_len=k, pairing=p, schedule=s, margin=m)
                for k, p, s, m in itertools.product((1, 2, 3, 4), ("v3", "ds4"), ("standard", "ds4"), (None, 3.0))]
DS4_RING = {"warm_prefill": False, "ring": "ds4"}
HEAD_CONFIGS += [SpecConfig(draft_len=1, pairing="ds4", schedule="ds4", margin=3.0, **DS4_RING),
                 SpecConfig(draft_len=2, pairing="ds4", schedule="ds4", **DS4_RING),
                 SpecConfig(draft_len=3, pairing="v3", schedule="standard", **DS4_RING)]


def test_lossless_greedy_with_the_head(fitted_plain, tmp_path):
    # Every draft length x pairing x schedule x margin gate with the fitted head (under ds4's
    # pairing its guess passes ds4's gate, so drafts after it are verified; under v3 it mostly
    # misses), and a few under ds4's ring: plain greedy's tokens and .kv bytes. Each pairing
    # prefills the prompt once per window (max_tokens=1 chooses the first token without
    # consuming it: the head's window warm, or empty under ds4's ring), and every config
    # continues from that snapshot.
    model, prompt, tokens, kv = fitted_plain
    starts = {}
    for pairing, warm in itertools.product(mtp.PAIRINGS, (True, False)):
        session = model.session()
        ds4lab.generate(model, prompt, 1, spec=SpecConfig(pairing=pairing, warm_prefill=warm), session=session)
        starts[pairing, warm] = session.snapshot()
    paths, past_gate = set(), 0
    for spec in HEAD_CONFIGS:
        session = model.session(starts[spec.pairing, spec.warm_prefill])
        out = ds4lab.generate(model, [], SHORT, spec=spec, session=session)
        assert out.tokens == tokens, spec
        assert session.save_kv(tmp_path / "spec.kv", now=0).read_bytes() == kv, spec
        assert out.spec_trace["committed"].sum() == SHORT
        paths |= set(out.spec_trace["path"])
        past_gate += int((out.spec_trace["drafted"] > 0).sum()) if spec.schedule == "ds4" else 0
    assert {"partial", "margin-skip", "miss"} <= paths and past_gate > 0


@pytest.mark.parametrize("right", [1.0, 0.0, 0.6])
@pytest.mark.parametrize("schedule", ["standard", "ds4"])
def test_lossless_greedy_with_scripted_drafters(plain, tmp_path, right, schedule):
    model, prompt, tokens, kv = plain
    spec = SpecConfig(draft_len=3, schedule=schedule, drafter=_scripted(prompt, tokens, right))
    out, got = _run(model, prompt, spec, tmp_path)
    assert out.tokens == tokens and got == kv
    trace = out.spec_trace
    assert trace["committed"].sum() == len(tokens)
    if right == 1.0:
        assert set(trace["path"]) <= {"full", "fallback"} and (trace["accepted"] == trace["drafted"]).all()
        assert out.spec_summary["tokens_per_target_forward"] > 1.5
    if right == 0.0:
        assert trace["accepted"].sum() == 0 and out.spec_summary["target_forwards"] >= len(tokens) - 1


def _ds4_ring_rule(trace, n_swa):
    """ds4.c's ring, replayed over a ds4-schedule trace: per cycle the (rows seen besides the
    next one, stale, unwritten) that ds4's counter leaves. The one-row pass (ds4_session_eval)
    writes a real row for what it commits; a verified cycle drafted rows for nxt, d1..d_{k-1}
    and DS4_MTP_KEEP_ACCEPTED(1 + accepted) shows the committed positions as drafting left
    them: drafted rows first, a never-written slot after a full accept; a margin skip keeps
    the drafted row of nxt (DS4_MTP_KEEP_ACCEPTED(1))."""
    rows, expected = [], []
    for r in trace.itertuples():
        if r.target_passes:
            rows.append("real")
        if r.path == "fallback" and r.target_passes == 2:
            rows.append("real")
        elif r.path == "margin-skip":
            rows.append("drafted")
        elif r.path in ("full", "partial"):
            kept = 1 + r.accepted
            rows += ["drafted"] * min(kept, r.drafted) + ["unwritten"] * max(kept - r.drafted, 0)
        seen = rows[len(rows) - min(len(rows), n_swa - 1):]
        expected.append((len(seen), sum(x != "real" for x in seen), seen.count("unwritten")))
    return expected


def _oracle(seq, wrong=frozenset()):
    """An edit at mtp.hook_logits: under ds4's pairing the head's row at position i guesses
    seq[i + 1] (seq[i + 1] + 1 at the positions in `wrong`)."""
    def fn(act, hook):
        out = np.full(act.shape, -10.0, np.float32)
        for row, pos in enumerate(hook.positions):
            if pos + 1 < len(seq):
                out[row, (seq[pos + 1] + (pos in wrong)) % act.shape[-1]] = 10.0
        return mx.array(out)
    return fn


def test_ds4_ring_counts_its_stale_rows(plain, tmp_path):
    # ds4's pairing and schedule, the head's logits replaced by an oracle of plain decoding's
    # next token (wrong at two positions), so cycles end full, partial and missed: under ds4's
    # ring the trace's counts are ds4's rule replayed over the cycles, the rows written from
    # real states hold the exact ring's bytes and the stale ones do not (unwritten ones are
    # zero), and the output is plain decoding's; under the exact ring (cold too) nothing is stale.
    model, prompt, _, _ = plain
    n = 10
    session = model.session()
    tokens = ds4lab.generate(model, prompt, n, session=session).tokens
    kv = session.save_kv(tmp_path / "plain.kv", now=0).read_bytes()
    rings = {}
    with model.hooks([("mtp.hook_logits", _oracle(prompt + tokens, {len(prompt) + 5, len(prompt) + 6}))]):
        for ring, warm in (("ds4", False), ("exact", False), ("exact", True)):
            spec = SpecConfig(draft_len=2, pairing="ds4", schedule="ds4", warm_prefill=warm, ring=ring)
            session = model.session()
            out = ds4lab.generate(model, prompt, n, spec=spec, session=session)
            assert out.tokens == tokens and session.save_kv(tmp_path / "spec.kv", now=0).read_bytes() == kv
            rings[ring, warm] = out.spec_trace, session.state.mtp
    trace, state = rings["ds4", False]
    assert {"full", "partial", "miss"} <= set(trace["path"])
    rule = _ds4_ring_rule(trace, model.config.n_swa)
    assert list(zip(trace["ring_rows"], trace["ring_stale"], trace["ring_unwritten"], strict=True)) == rule
    assert trace.loc[trace["path"] == "full", "ring_unwritten"].min() > 0
    exact_trace, exact = rings["exact", False]
    assert (exact_trace["ring_stale"] == 0).all() and (rings["exact", True][0]["ring_stale"] == 0).all()
    assert exact_trace["ring_rows"].tolist() == trace["ring_rows"].tolist()
    assert state.next_pos == exact.next_pos and state.ring.raw.shape == exact.ring.raw.shape
    first = state.next_pos - state.ring.raw.shape[0]
    same = np.array(state.ring.raw == exact.ring.raw).all(axis=1)
    for i, p in enumerate(range(first, state.next_pos)):
        assert same[i] == (p not in state.stale), p
        assert (p in state.unwritten) == (not np.array(state.ring.raw[i]).any()), p
    with pytest.raises(ValueError, match="warm_prefill=False"):
        SpecConfig(pairing="ds4", schedule="ds4", ring="ds4")
    with pytest.raises(ValueError, match="schedule='ds4'"):
        SpecConfig(pairing="ds4", warm_prefill=False, ring="ds4")


def test_snapshot_restore_carries_the_head_state(plain):
    model, prompt, _, _ = plain
    session = model.session()
    list(ds4lab.stream(model, prompt, 4, spec=SpecConfig(), session=session))
    snap = session.snapshot()
    assert snap.mtp is not None and snap.mtp.next_pos == session.state.n_tokens - 1
    after = ds4lab.generate(model, [], 3, spec=SpecConfig(), session=session).tokens
    session.restore(snap)
    assert ds4lab.generate(model, [], 3, spec=SpecConfig(), session=session).tokens == after


def test_interventions_at_mtp_points_cannot_leak(fitted_plain, tmp_path):
    # With the fitted head (ds4's pairing and schedule), a zeroed h-branch and random head
    # logits change the head's guesses (more of them miss ds4's gate), never the tokens or
    # the state.
    model, prompt, tokens, kv = fitted_plain
    spec = SpecConfig(pairing="ds4", schedule="ds4")
    base, _ = _run(model, prompt, spec, tmp_path, n=SHORT)

    def misses(out):
        return int((out.spec_trace["path"] == "miss").sum())

    noise = np.random.default_rng(1)
    edits = [("mtp.hook_h", lambda act, hook: mx.zeros_like(act)),
             ("mtp.hook_logits", lambda act, hook: mx.array(noise.normal(size=act.shape).astype(np.float32)))]
    for edit in edits:
        with model.hooks([edit]):
            out, got = _run(model, prompt, spec, tmp_path, n=SHORT)
        assert out.tokens == tokens and got == kv
        assert misses(out) > misses(base)


def test_teacher_forced_equals_online(plain):
    # Same stream, v3 pairing, warm window, standard schedule: the drafts, margins and
    # acceptance of every online cycle are teacher_forced's rows at those positions.
    model, prompt, tokens, _ = plain
    out = ds4lab.generate(model, prompt, N_TOKENS, spec=SpecConfig(draft_len=1))
    offline = mtp.teacher_forced(model, prompt + tokens).set_index("pos")
    cycles = out.spec_trace[out.spec_trace["drafted"] > 0]
    assert len(cycles) >= 3
    for row in cycles.itertuples():
        tf = offline.loc[row.pos - 1]          # the head's row for (h_P, f) sits at P = pos - 1
        assert row.draft_ids[0] == tf["draft"] and row.margins[0] == pytest.approx(tf["margin"], abs=0)
        assert bool(row.accepted) == bool(tf["accepted"])
    # The control: drafts against the target one position later match no more than chance.
    shifted = (offline["draft"].to_numpy()[:-1] == offline["target"].to_numpy()[1:]).mean()
    assert shifted <= 0.2


def test_target_passes_of_a_greedy_continuation_are_aligned(plain):
    # What `fit` learns from: row i holds the streams the head reads online after t_i, and on
    # the model's greedy continuation row i's final normed vector picks t_{i+1} (so under v3
    # the row (h_i, t_{i+1}) is fitted to row i + 1's vector: the greedy choice after t_{i+1}).
    model, prompt, tokens, _ = plain
    ids = prompt + tokens
    run = mtp.target_passes(model, [ids])[0]
    assert np.array_equal(run.hidden, np.array(model.session().prefill_all(ids).hidden))
    logits = run.final_norm @ np.array(model.weights.output.dense()).T
    assert logits.argmax(axis=1)[len(prompt) - 1:-1].tolist() == tokens


def _tv(a, b):
    return 0.5 * np.abs(a - b).sum()


def test_sampled_verification_follows_p():
    rng = np.random.default_rng(0)
    v, n = 64, 100_000
    p = np.exp(rng.normal(size=v) * 1.5)
    p /= p.sum()
    q_far = np.exp(rng.normal(size=v) * 1.5)
    q_far /= q_far.sum()

    def broken(p, q, draft, rng):            # emits the target's own sample on rejection
        if rng.random() * q[draft] < p[draft]:
            return True, draft
        return False, int(rng.choice(len(p), p=p))

    for q in (q_far, np.eye(v)[int(np.argmax(p))]):          # far from p; an argmax draft
        for step, ok in ((accept_or_resample, True), (broken, False)):
            drafts = rng.choice(v, size=n, p=q)
            results = [step(p, q, int(d), rng) for d in drafts]
            counts = np.bincount([t for _, t in results], minlength=v) / n
            assert (_tv(counts, p) < 0.01) == ok
            if ok:
                rate, expected = np.mean([a for a, _ in results]), 1 - _tv(p, q)
                assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / n) + 1e-9


def test_sampled_spec_decoding_runs_and_repeats(plain):
    model, prompt, _, _ = plain
    sampling = ds4lab.generation.Sampling(temperature=0.8, seed=3)
    spec = SpecConfig(draft_len=2, verify="sample", draft_sampling="sample")
    a = ds4lab.generate(model, prompt, 6, sampling=sampling, spec=spec)
    b = ds4lab.generate(model, prompt, 6, sampling=sampling, spec=spec)
    assert a.tokens == b.tokens and len(a.tokens) == 6
    with pytest.raises(ValueError, match="temperature 0"):
        ds4lab.generate(model, prompt, 2, sampling=sampling, spec=SpecConfig())


def test_fit_raises_acceptance_and_saves_a_loadable_head(tiny_mtp, fitted):
    _, head, _ = tiny_mtp
    result, path, loaded, held, before = fitted
    rows = mtp.teacher_forced(loaded, held, pairing="ds4")
    after = rows["accepted"].mean()
    assert before < 0.1 and after >= 0.5
    # The control, on a head that does predict: its drafts against the target one position
    # later match no more than chance.
    assert (rows["draft"].to_numpy()[:-1] == rows["target"].to_numpy()[1:]).mean() <= 0.2
    assert after == pytest.approx(result.curve["acceptance"].dropna().iloc[-1])
    types = {t.name: t.type_name for t in gguf.open(path, config=loaded.config).tensors.values()}
    assert types["mtp.0.e_proj.weight"] == "Q8_0" and types["mtp.0.h_proj.weight"] == "Q8_0"
    original = gguf.open(head, config=loaded.config)
    saved = gguf.open(path, config=loaded.config)
    assert np.array_equal(saved.raw("mtp.0.attn_q_a.weight"), original.raw("mtp.0.attn_q_a.weight"))
    assert not np.array_equal(saved.raw("mtp.0.e_proj.weight"), original.raw("mtp.0.e_proj.weight"))


@pytest.mark.parametrize("which", [0, 1])
def test_fit_under_v3_learns_a_target_with_language_like_structure(structured_models, which, on_cpu):
    # On a model whose greedy choice mostly follows a successor map (two shapes and seeds, one
    # strength: conftest.STRUCTURED), a head fitted under v3 on 1k rows of random text guesses
    # the target's choice after a token its state has not seen, on held-out text, at least
    # half the time; the loaded random head is at chance. The controls, broken variants of the
    # scoring: the same drafts against the target one position later (a misaligned pairing)
    # or against the targets shuffled match no more than chance, so the acceptance comes from
    # the pairing, not from what drafts and targets look like on their own.
    m = structured_models[which]
    model = ds4lab.load(m["main"], mtp=m["head"])
    rng = np.random.default_rng(0)
    train = [[int(t) for t in rng.choice(m["rows"], 256)] for _ in range(4)]
    held = [int(t) for t in rng.choice(m["rows"], 128)]
    before = mtp.teacher_forced(model, held, pairing="v3")["accepted"].mean()
    model.mtp = mtp.fit(model, train, steps=100, pairing="v3", l2=0.3).head
    rows = mtp.teacher_forced(model, held, pairing="v3")
    drafts, targets = rows["draft"].to_numpy(), rows["target"].to_numpy()
    after = rows["accepted"].mean()
    assert before <= 0.05 and after >= 0.5, (m["args"], before, after)
    assert (drafts[:-1] == targets[1:]).mean() <= 0.05
    assert (drafts == np.random.default_rng(1).permutation(targets)).mean() <= 0.05
    # What it learned is the map: its draft is the successor of the token it read.
    assert (drafts == m["succ"][rows["token"].to_numpy()]).mean() >= 0.7


def test_fit_on_greedy_continuations_under_v3_reaches_half_on_held_out_text(structured_models, on_cpu):
    # The bar as the issue words it: fitted on the model's own greedy continuations, the v3
    # head's teacher-forced acceptance on a held-out continuation goes from chance to >= 50%.
    # The continuations are decoded speculatively with the successor map as the drafter
    # (lossless greedy decoding: the tokens are plain greedy decoding's), so they cost fewer
    # target passes.
    m = structured_models[0]
    model = ds4lab.load(m["main"], mtp=m["head"])
    rng = np.random.default_rng(3)
    texts = []
    for _ in range(7):
        prompt = [int(t) for t in rng.choice(m["rows"], 8)]
        g = ds4lab.generate(model, prompt, 96, spec=mtp.SpecConfig(draft_len=8, drafter=successor_drafter(m["succ"])))
        texts.append(prompt + g.tokens)
    check = texts[0][:8] + ds4lab.generate(model, texts[0][:8], 16).tokens     # plain greedy decoding
    assert check == texts[0][:24]
    train, held = texts[:-1], texts[-1]
    before = mtp.teacher_forced(model, held, pairing="v3")["accepted"].mean()
    model.mtp = mtp.fit(model, train, steps=150, pairing="v3", l2=0.3).head
    after = mtp.teacher_forced(model, held, pairing="v3")["accepted"].mean()
    assert before <= 0.05 and after >= 0.5, (before, after)


def test_cli_generate_with_mtp_prints_the_summary(tiny_mtp, capsys):
    from ds4lab.cli import main

    model_path, head, _ = tiny_mtp
    assert main(["generate", str(model_path), "--mtp", str(head), "--draft-len", "2", "--pairing", "ds4",
                 "--schedule", "ds4", "--prompt", "Hello", "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    summary = dict(line.split(": ", 1) for line in err.strip().splitlines())
    assert int(summary["committed"]) == 4 and "tokens_per_target_forward" in summary


def _halves(model, prompt, spec, tmp_path, first_n=4, rest_n=3):
    """Decode first_n tokens, save the session to .kv, load it into a fresh session and decode
    rest_n more: (tokens, the saved file's bytes, the final session's .kv bytes)."""
    session = model.session()
    first = ds4lab.generate(model, prompt, first_n, spec=spec, session=session)
    saved = session.save_kv(tmp_path / "half.kv", now=0)
    resumed = model.session()
    resumed.load_kv(saved)
    rest = ds4lab.generate(model, first.tokens[-1:], rest_n, spec=spec, session=resumed)  # emitted, not consumed
    end = resumed.save_kv(tmp_path / "end.kv", now=0)
    return first, first.tokens + rest.tokens, saved.read_bytes(), end.read_bytes()


@pytest.mark.parametrize("numerics", ["float", "ds4-cpu"])
def test_kv_hooks_and_steering_work_with_the_head_loaded(tiny_mtp, plain, tmp_path, numerics):
    # With the MTP head loaded, in both numerics modes: 4 tokens decoded speculatively (the
    # oracle head at mtp.hook_logits: a full accept, drafts verified and committed), saved to
    # .kv, loaded into a fresh session and continued for 3 give the tokens and both files'
    # bytes of plain decoding through the same save and load (float: plain's tokens are the
    # `plain` fixture's uninterrupted ones); a hook on the target records every consumed
    # position; under steering (float; steering is hooks on the target's blocks in either
    # mode), speculative decoding gives plain steered decoding's tokens, which steering changed.
    main, head, _ = tiny_mtp
    model, prompt = (plain[0] if numerics == "float" else ds4lab.load(main, mtp=head, numerics=numerics)), plain[1]
    assert model.mtp is not None and model.numerics.mode == numerics
    _, tokens, plain_half, plain_end = _halves(model, prompt, None, tmp_path)
    assert numerics != "float" or tokens[:N_TOKENS] == plain[2]
    spec = SpecConfig(draft_len=2, pairing="ds4", schedule="ds4")
    seen = []
    record = ("blocks.0.hook_resid_post", lambda act, hook: seen.extend(hook.positions.tolist()))
    with model.hooks([("mtp.hook_logits", _oracle(prompt + tokens)), record]):
        first, got, half, end = _halves(model, prompt, spec, tmp_path)
    assert (first.spec_trace["path"] == "full").any()
    assert got == tokens and half == plain_half and end == plain_end
    assert set(seen) == set(range(len(prompt) + len(tokens) - 1))        # the last token is not consumed
    if numerics != "float":
        return
    vector = SteeringVector(np.random.default_rng(0).standard_normal((model.config.n_layer, model.config.n_embd)))
    with model.steering(vector, ffn=2.0, mode="add"):
        steered = ds4lab.generate(model, prompt, 4).tokens
        with model.hooks([("mtp.hook_logits", _oracle(prompt + steered))]):
            out = ds4lab.generate(model, prompt, 4, spec=spec)
    assert steered != tokens[:4] and out.tokens == steered and out.spec_summary["accepted"] > 0
