"""ds4's disk-cache policy: every expected value below comes from ds4's rules and the tables
in ../shared/spec/kvc.md §3 and §7 (confirmed against ds4's C) and kvc_variants.md §1.3-1.4,
never from ds4lab's own output."""

from __future__ import annotations

import hashlib
import io
import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

import ds4lab  # noqa: F401  (import order: ds4lab first)
from ds4lab.cache import (
    chat_anchor,
    continued_target,
    eviction_score,
    explain_eviction,
    file_size_fits,
    find_prefix,
    payload_bytes,
    plan_eviction,
    store_len,
    widget,
)
from ds4lab.cache.simulate import simulate
from ds4lab.cache.workloads import coding_agent_trace, read_ds4_trace
from ds4lab.kvc.header import KVCHeader

HALF = 21600
U64_MAX = (1 << 64) - 1


# ---- store length, continued frontiers, chat anchor ------------------------------------------
@pytest.mark.parametrize("tokens,expected", [
    (100, 100), (544, 544), (545, 545), (1695, 1695), (2079, 2079), (2080, 2048), (4127, 2048), (4128, 4096),
    (8192, 6144), (8224, 8192), (11011, 10240), (30000, 28672), (32768, 30720), (100000, 98304)])
def test_store_len_table(tokens, expected):
    assert store_len(tokens) == expected


def test_store_len_options():
    assert store_len(3500, boundary_trim_tokens=0, boundary_align_tokens=1000) == 3000
    assert store_len(3500, boundary_align_tokens=0) == 3500 - 32
    with pytest.raises(TypeError):
        store_len(3500, align=0)


@pytest.mark.parametrize("live,expected", [
    (0, 0), (511, 0), (2048, 0), (10239, 0), (10240, 10240), (10241, 0), (20480, 20480), (30000, 0),
    (30720, 30720), (40960, 40960)])
def test_continued_targets(live, expected):
    assert continued_target(live, 0) == expected


def test_continued_after_a_store_and_without_alignment():
    assert continued_target(10240, 10240) == 0
    assert continued_target(20480, 10240) == 20480
    assert continued_target(29999, 20480, boundary_align_tokens=0) == 0
    assert continued_target(30000, 20480, boundary_align_tokens=0) == 30000
    assert continued_target(20480, 0, continued_interval_tokens=0) == 0


def test_chat_anchor():
    u, a = 100, 101
    assert chat_anchor([1, 2, u, 3, 4, u, 5, a], u, a, 4) == 5
    assert chat_anchor([1, 2, 3, 4, u, 5, a], u, a, 4) == 4
    assert chat_anchor([1, 2, u, 3, a, 4, u, 5, a], u, a, 2) == 2
    assert chat_anchor([1, 2, u, 3, a, 4, u, 5, a], u, a, 3) == -1
    assert chat_anchor([1, 2, u, 3, a, 4, u, 5, a], -1, a, 2) == -1


# ---- sizes and budget ------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,expected", [
    (1, 12_811_664), (128, 25_757_580), (512, 31_042_956), (600, 32_226_028), (2048, 52_184_460),
    (8192, 136_750_476), (10240, 164_939_148), (30720, 446_825_868), (32768, 475_014_540)])
def test_payload_bytes_flash(tokens, expected):
    assert payload_bytes("flash", tokens) == expected


def test_payload_bytes_pro_and_closed_forms():
    assert payload_bytes("pro", 2048) == 75_564_572
    assert payload_bytes("pro", 600) == 46_995_324
    for t in (128, 1000, 4097, 99_999):
        assert payload_bytes("flash", t) == 23_995_788 + 4 * t + 53_760 * (t // 4) + 40_960 * (t // 128)
        assert payload_bytes("pro", t) == 35_218_972 + 4 * t + 76_800 * (t // 4) + 63_488 * (t // 128)


def test_file_size_fits():
    assert file_size_fits(100, 930, 0, 1100) == (True, 1082, 1093)
    assert file_size_fits(100, 938, 0, 1100) == (False, 1090, 1101)
    assert file_size_fits(100, 900, 40, 1100)[0] is False
    assert file_size_fits(100, U64_MAX, 0, 1100) == (False, None, None)
    assert file_size_fits(100, 930, 0, 0) == (True, 1082, None)
    assert file_size_fits(0, U64_MAX - 52, 0, 1100) == (False, U64_MAX, None)  # the headroom overflows


# ---- scores -----------------------------------------------------------------------------------------
def entry(tokens, hits, size, created=0, last_used=0, reason=2, sha="a" * 40, **extra):
    return {"sha": sha, "tokens": tokens, "hits": hits, "file_size": size, "created_at": created,
            "last_used": last_used, "reason": reason, **extra}


@pytest.mark.parametrize("e,now,expected", [
    (entry(1024, 10, 4096, last_used=1000), 1000 + 14 * HALF, 0.25),
    (entry(2048, 5, 4096, created=77), 77 + HALF, 1.75),
    (entry(2048, 5, 4096, last_used=200), 100, 3.0),
    (entry(2048, 1, 4096, last_used=1), 1 + 6 * HALF + 1, 0.50781224929974711),
    (entry(2048, 1, 4096, last_used=1), 1 + 7 * HALF, 0.5)])
def test_scores_8d57664(e, now, expected):
    assert eviction_score(e, now, policy="ds4@8d57664") == expected


def test_score_edge_cases():
    assert eviction_score(entry(2048, 3, 0), 10, policy="ds4@8d57664") == 0.0
    dbl_max = 1.7976931348623157e308
    assert eviction_score(entry(2048, 3, 4096), 10, protected_sha="a" * 40, policy="ds4@8d57664") == dbl_max
    # ba00a8a dropped the protection: the same call scores like any file (fresh hits never decay, used_at 0)
    assert eviction_score(entry(2048, 3, 4096), 10, protected_sha="a" * 40, policy="ds4@ba00a8a") == 0.5


TEXT = b"the incoming checkpoint text, longer than the continued one"
T, SIZE = 2048, 52_184_512
BASE = 2048 / 52_184_512


def cont(hits=0, last_used=1000, ctx=32768, prefix=20, reason=2):
    return entry(T, hits, SIZE, created=1000, last_used=last_used, reason=reason,
                 sha=hashlib.sha1(TEXT[:prefix]).hexdigest(), model_id=0, quant_bits=2, ctx_size=ctx,
                 text_bytes=prefix)


def incoming(ctx=32768, text=TEXT):
    return {"text": text, "model_id": 0, "quant_bits": 2, "ctx_size": ctx, "reject_different_quant": False}


@pytest.mark.parametrize("e,inc,now,expected", [
    (cont(reason=1), None, 1000, 7.8491e-5),                      # anchors x2
    (cont(reason=3), None, 1000, 7.8491e-5),
    (cont(reason=4), None, 1000, 7.8491e-5),
    (cont(reason=2), None, 1000, 3.9245e-5),
    (cont(reason=6), None, 1000, 3.9245e-5),
    (cont(), incoming(), 1000, 1.9623e-6),                        # superseded, never hit: x0.05
    (cont(hits=3), incoming(), 1000, 6.0830e-5),                  # 4 * (0.05 + 0.45 * 0.75) * base
    (cont(hits=3), incoming(ctx=65536), 1000, 1.5698e-4),         # newcomer needs a larger ctx
    (cont(hits=3), incoming(text=b"x" * 80), 1000, 1.5698e-4),    # not a prefix
    (cont(hits=4, reason=1), None, 1000 + HALF, 2.3547e-4)])      # 2 * 3 * base
def test_scores_ba00a8a(e, inc, now, expected):
    got = eviction_score(e, now, incoming=inc, policy="ds4@ba00a8a")
    assert got == pytest.approx(expected, rel=2e-4)


def test_supersede_factor_exactly():
    assert eviction_score(cont(hits=3), 1000, incoming=incoming()) == 4 * BASE * (0.05 + 0.45 * 0.75)
    assert eviction_score(cont(), 1000, incoming=incoming(), policy="ds4@8d57664") == BASE


# ---- eviction on synthetic directories -------------------------------------------------------------
def stub(directory, name, tokens, size, hits=0, created=1, last_used=1, reason=2, text=b"", **header):
    h = KVCHeader(tokens=tokens, hits=hits, created_at=created, last_used=last_used, reason=reason,
                  text_bytes=len(text), **header).pack()
    data = h + text
    (directory / f"{name}.kv").write_bytes(data + bytes(max(0, size - len(data))))
    return f"{name}.kv"


def sha(i):
    return f"{i:040x}"


@pytest.mark.parametrize("policy", ["ds4@8d57664", "ds4@ba00a8a"])
def test_denser_file_survives(tmp_path, policy):
    fresh = stub(tmp_path, sha(1), 2048, 2048)
    sparse = stub(tmp_path, sha(2), 512, 4096)
    assert plan_eviction(tmp_path, 5000, now=1, policy=policy) == [sparse]
    assert fresh not in plan_eviction(tmp_path, 2048, now=1, policy=policy)[:1]


@pytest.mark.parametrize("policy", ["ds4@8d57664", "ds4@ba00a8a"])
def test_stale_hits_decay_and_recent_hits_count(tmp_path, policy):
    now = 1000 + 14 * HALF
    stale = stub(tmp_path, sha(1), 2048, 4096, hits=15, last_used=1000)
    fresh = stub(tmp_path, sha(2), 2048, 4096, created=now, last_used=now)
    assert plan_eviction(tmp_path, 4096, now, policy=policy) == [stale]  # equal scores: older last_used
    recent = stub(tmp_path, sha(3), 2048, 4096, hits=3, last_used=now)
    assert plan_eviction(tmp_path, 4096, now, policy=policy) == [stale, fresh]
    # the recent hits keep `recent` last: (3 + 1) x density against 1 x for the others
    e = {"sha": sha(3), "tokens": 2048, "hits": 3, "file_size": 4096, "created_at": 1, "last_used": now, "reason": 2}
    assert eviction_score(e, now, policy=policy) == pytest.approx(4 * 2048 / 4096, rel=1e-12)
    assert plan_eviction(tmp_path, 1, now, policy=policy)[-1] == recent


def test_anchor_reason_weighting_only_at_ba00a8a(tmp_path):
    cold = stub(tmp_path, sha(1), 1536, 4096, reason=1)
    continued = stub(tmp_path, sha(2), 2048, 4096, reason=2)
    assert plan_eviction(tmp_path, 4096, now=1, policy="ds4@8d57664") == [cold]
    assert plan_eviction(tmp_path, 4096, now=1, policy="ds4@ba00a8a") == [continued]


@pytest.mark.parametrize("policy", ["ds4@8d57664", "ds4@ba00a8a"])
def test_ties_go_to_older_last_use(tmp_path, policy):
    a = stub(tmp_path, sha(1), 2048, 4096, last_used=200)
    b = stub(tmp_path, sha(2), 2048, 4096, last_used=100)
    c = stub(tmp_path, sha(3), 2048, 4096, last_used=300)
    assert plan_eviction(tmp_path, 1, now=300, policy=policy) == [b, a, c]


def test_protection_at_8d57664(tmp_path):
    old = stub(tmp_path, sha(1), 2048, 4096, hits=2, last_used=1)
    new = stub(tmp_path, sha(2), 512, 4096, created=2, last_used=2)
    assert plan_eviction(tmp_path, 4096, now=2, protected_sha=sha(2), policy="ds4@8d57664") == [old]
    assert plan_eviction(tmp_path, 4000, now=2, protected_sha=sha(2), policy="ds4@8d57664") == [new, old]
    assert plan_eviction(tmp_path, 4096, now=2, protected_sha=sha(2), policy="ds4@ba00a8a") == [new]


def test_pre_store_eviction_at_ba00a8a(tmp_path):
    a = stub(tmp_path, sha(1), 512, 4096)
    b = stub(tmp_path, sha(2), 2048, 4096)
    assert plan_eviction(tmp_path, 10000, now=1) == []
    assert plan_eviction(tmp_path, 10000, now=1, extra_bytes=2000) == [a]          # 8192 > 10000 - 2000
    assert plan_eviction(tmp_path, 10000, now=1, extra_bytes=6000) == [a, b]
    assert plan_eviction(tmp_path, 10000, now=1, extra_bytes=10001) == []          # oversized newcomer
    assert plan_eviction(tmp_path, 0, now=1, extra_bytes=6000) == []               # budget 0: unlimited


def test_indexing_rules(tmp_path):
    good = stub(tmp_path, sha(1), 2048, 4096)
    old_abi = stub(tmp_path, sha(2), 2048, 4096, payload_abi=0)
    stub(tmp_path, sha(3), 2048, 4096, quant_bits=3)
    stub(tmp_path, sha(4), 0, 4096)
    stub(tmp_path, sha(5), 2048, 4096, version=2)
    stub(tmp_path, "sysprompt", 2048, 4096)
    (tmp_path / f"{sha(6)}.kv").write_bytes(KVCHeader(tokens=2048, payload_bytes=100).pack() + bytes(99))
    upper = stub(tmp_path, sha(7).upper().replace("0", "A"), 2048, 4096)
    # the file's real name (issue 13), not a lowercased one
    assert sorted(plan_eviction(tmp_path, 1, now=1, policy="ds4@ba00a8a")) == sorted([good, upper])
    assert sorted(plan_eviction(tmp_path, 1, now=1, policy="ds4@8d57664")) == sorted([good, old_abi,
                                                                                         upper])


# ---- lookup -----------------------------------------------------------------------------------------------
def named(directory, text, tokens, **kw):
    return stub(directory, hashlib.sha1(text).hexdigest(), tokens, 0, text=text, **kw)


def test_longest_prefix_wins(tmp_path):
    named(tmp_path, b"transcript prefix", 512, ctx_size=32768)
    longest = named(tmp_path, b"transcript prefix with sampled token bytes", 700, ctx_size=32768)
    short = named(tmp_path, b"transcript", 9000, ctx_size=32768)
    assert find_prefix(tmp_path, "transcript prefix with sampled token bytes and more", 32768, 2) == longest
    assert find_prefix(tmp_path, "transcript prefiX", 32768, 2) == short
    assert find_prefix(tmp_path, "transcrip", 32768, 2) is None


def test_lookup_filters(tmp_path):
    small = named(tmp_path, b"few tokens", 511)
    wide = named(tmp_path, b"wide ctx", 4096, ctx_size=65536)
    q4 = named(tmp_path, b"quant four", 4096, quant_bits=4)
    pro = named(tmp_path, b"pro model", 4096, model_id=1)
    assert find_prefix(tmp_path, "few tokens here", 32768, 2) is None
    assert find_prefix(tmp_path, "few tokens here", 32768, 2, min_tokens=511) == small
    assert find_prefix(tmp_path, "wide ctx prompt", 32768, 2) is None
    assert find_prefix(tmp_path, "wide ctx prompt", 65536, 2) == wide
    assert find_prefix(tmp_path, "quant four!", 32768, 2) == q4
    assert find_prefix(tmp_path, "quant four!", 32768, 2, reject_different_quant=True) is None
    assert find_prefix(tmp_path, "quant four!", 32768, 3) is None
    assert find_prefix(tmp_path, "pro model?", 32768, 2) is None
    assert find_prefix(tmp_path, "pro model?", 32768, 2, model_id=1) == pro
    assert find_prefix(tmp_path, "pro model?", 32768, 2, policy="ds4@8d57664") == pro


# ---- the simulator on ds4's scenarios (kvc.md §7.23) -----------------------------------------------
BIG = 1 << 40


def run(records, policy="ds4@8d57664", budget=BIG, **options):
    ev = simulate(records, policy, budget, {"shutdown": False, **options})
    return ev, [(r.reason, r.tokens) for r in ev[ev["event"] == "store"].itertuples()]


def test_cold_prompt_without_anchor():
    _, stores = run([{"t": 0, "session": "a", "prompt_tokens": 20000, "gen_tokens": 1}])
    assert stores == [("continued", 10240), ("cold", 18432)]
    _, stores = run([{"t": 0, "session": "a", "prompt_tokens": 21000, "gen_tokens": 1}])
    assert stores == [("cold", 20480)]


def test_ba00a8a_chunks_of_4096_skip_the_10240_frontier_in_prefill():
    _, stores = run([{"t": 0, "session": "a", "prompt_tokens": 20000, "gen_tokens": 1}], "ds4@ba00a8a")
    assert stores == [("cold", 18432)]


def test_cold_save_at_the_chat_anchor():
    _, stores = run([{"t": 0, "session": "a", "prompt_tokens": 9000, "gen_tokens": 1, "anchor": 5001}])
    assert stores == [("cold", 5001)]


def test_switch_saves_the_live_session_then_hits_disk():
    recs = [{"t": 0, "session": "a", "prompt_tokens": 3000, "gen_tokens": 100, "shared": "sys", "shared_tokens": 2600},
            {"t": 10, "session": "b", "prompt_tokens": 2900, "gen_tokens": 100, "shared": "sys", "shared_tokens": 2600},
            {"t": 20, "session": "b", "prompt_tokens": 3500, "gen_tokens": 10, "shared": "sys", "shared_tokens": 2600}]
    ev, stores = run(recs)
    assert stores == [("cold", 2600), ("evict", 3100)]
    req = ev[ev["event"] == "request"]
    assert list(req["source"]) == ["none", "disk", "memory"]
    assert list(req["matched_tokens"]) == [0, 2600, 3000]


def test_long_generation_crosses_frontiers_and_hits_are_consumed():
    recs = [{"t": 0, "session": "a", "prompt_tokens": 1000, "gen_tokens": 41000},
            {"t": 5000, "session": "b", "prompt_tokens": 700, "gen_tokens": 1},
            {"t": 6000, "session": "a", "prompt_tokens": 42100, "gen_tokens": 1}]
    for policy, consumed in (("ds4@ba00a8a", 1), ("ds4@24fa85ea", 0)):
        ev, stores = run(recs, policy)
        assert [s for s in stores if s[0] == "continued"] == [("continued", 10240), ("continued", 20480),
                                                               ("continued", 30720), ("continued", 40960)]
        assert ("evict", 42000) in stores
        last = ev[(ev["event"] == "request")].iloc[-1]
        assert last["source"] == "disk" and last["matched_tokens"] == 42000
        assert (ev["event"] == "consume").sum() == consumed


def test_shutdown_only_at_min_tokens():
    _, stores = run([{"t": 0, "session": "a", "prompt_tokens": 400, "gen_tokens": 100}], shutdown=True)
    assert stores == []
    _, stores = run([{"t": 0, "session": "a", "prompt_tokens": 400, "gen_tokens": 200}], shutdown=True)
    assert stores == [("shutdown", 600)]


def test_budget_pressure_under_both_versions():
    recs = [{"t": 100 * i, "session": f"s{i}", "prompt_tokens": 4000 + 10 * i, "gen_tokens": 1} for i in range(6)]
    budget = 3 * payload_bytes("flash", 2048) + 1_000_000
    for policy in ("ds4@8d57664", "ds4@ba00a8a"):
        ev = simulate(recs, policy, budget, {"shutdown": False})
        assert ev["dir_bytes"].iloc[-1] <= budget
        assert (ev["event"] == "evict").sum() > 0


def test_ds4_trace_reader(tmp_path):
    block = ("\n===== request {i} 2026-05-20 10:00:0{i} =====\nkind: chat\nprompt_tokens: {p}\n"
             "cached_tokens: 0\n\n--- cache decision ---\nlive_tokens_before: 0\n\n--- raw request json ---\n{js}\n"
             "\n--- rendered prompt ---\n{prompt}\n\n--- generated text ---\n{gen}\n\n--- parsed message ---\n"
             "finish: stop\ngenerated_tokens: {g}\n\n===== end request {i} =====\n")
    text = block.format(i=1, p=700, js=json.dumps({"messages": []}), prompt="<｜User｜>hi<｜Assistant｜>",
                        gen="hello", g=2) + \
        block.format(i=2, p=710, js="{}", prompt="<｜User｜>hi<｜Assistant｜>hello<｜User｜>more<｜Assistant｜>",
                     gen="ok\n\n--- trace: tool call ---\n\n", g=1)
    path = tmp_path / "trace.txt"
    path.write_text(text, encoding="utf-8")
    recs = read_ds4_trace(path)
    assert [r["prompt_tokens"] for r in recs] == [700, 710]
    assert recs[0]["text"] == "<｜User｜>hi<｜Assistant｜>" and recs[0]["gen_text"] == "hello"
    assert recs[1]["gen_text"] == "ok" and recs[1]["gen_tokens"] == 1
    ev = simulate(path, "ds4@ba00a8a", BIG)
    assert list(ev[ev["event"] == "request"]["source"]) == ["none", "memory"]


def test_cli_simulate_and_plan(tmp_path, capsys):
    from ds4lab.cache.workloads import coding_agent_trace, write_jsonl
    from ds4lab.cli import main

    trace = write_jsonl(coding_agent_trace(50, n_users=3, seed=1), tmp_path / "t.jsonl")
    assert main(["cache", "simulate", str(trace), "--policy", "ds4@8d57664", "--budget-mb", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 50 and out["policy"] == "ds4@8d57664"
    cold = stub(tmp_path, sha(1), 1536, 4 << 20, reason=1)
    stub(tmp_path, sha(2), 2048, 4 << 20, reason=2)
    assert main(["cache", "plan", str(tmp_path), "--budget-mb", "5", "--policy", "ds4@8d57664", "--now", "1"]) == 0
    assert f"next victim: {cold}" in capsys.readouterr().out


def test_cli_budget_zero_means_ds4s_default(tmp_path, capsys):
    from ds4lab.cli import main

    stub(tmp_path, sha(1), 2048, 4 << 20)
    assert main(["cache", "plan", str(tmp_path), "--budget-mb", "0", "--now", "1"]) == 0
    out = capsys.readouterr().out
    assert "budget 4096 MiB" in out and "nothing to evict" in out


def test_paths_keep_the_files_own_case(tmp_path):
    # ds4 indexes 40-hex names in any case and compares hashes case-blind; what ds4lab returns
    # must be the names that exist, not lowercased ones (other, absent files on Linux).
    upper = stub(tmp_path, sha(0xABC).upper(), 2048, 4096, hits=0, last_used=1)
    mixed = stub(tmp_path, "Ab" + sha(0xDEF)[2:], 2048, 4096, hits=0, last_used=2)
    plan = plan_eviction(tmp_path, 1, now=3, policy="ds4@ba00a8a")
    assert plan == [upper, mixed] and all((tmp_path / name).is_file() for name in plan)
    text = b"a prompt stored under an upper-case name"
    found = stub(tmp_path, hashlib.sha1(text).hexdigest().upper(), 600, 0, text=text, ctx_size=32768)
    assert find_prefix(tmp_path, text + b" and what follows", 32768, 2) == found
    assert plan_eviction(tmp_path, 4096, now=3, protected_sha=sha(0xABC).upper(), policy="ds4@8d57664")[0] != upper
    table = explain_eviction(tmp_path, 1, now=3)
    assert set(table["file"]) == {upper, mixed, found}


# ---- the notebook's panel --------------------------------------------------------------------


def test_panel_redraws_off_pyplot(monkeypatch):
    # The panel's callback runs in a comm handler while ipykernel may fire post_execute on
    # another thread, whose flush_figures renders and closes every pyplot figure: the panel's
    # figure must not be one (a pyplot one came out blank in JupyterLab after a dropdown move).
    shown = []
    monkeypatch.setattr(widget, "display", lambda fig: shown.append((fig, plt.get_fignums())))
    panel = widget.cache_panel(coding_agent_trace(300, n_users=2, seed=0), budget_mb=512)
    policy = panel.children[0].children[0]
    policy.value = "lru"
    assert len(shown) == 2
    for fig, pyplot_figures in shown:
        assert isinstance(fig, Figure) and len(fig.axes) == 3
        assert pyplot_figures == []                       # nothing of the panel's open in pyplot while shown
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=40)
        gray = np.asarray(Image.open(png).convert("L"))
        assert (gray < 200).mean() > 0.02                 # drawn: lines, labels, markers
