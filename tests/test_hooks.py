"""Hook points: every point fires, caches hold what the forward computed, interventions act."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4lab import gguf, load


@pytest.fixture(scope="module")
def small(small_q4_mtp):
    embd = gguf.open(small_q4_mtp[0]).dequantize("token_embd.weight")
    rows = np.flatnonzero(np.abs(embd).sum(axis=1))
    tokens = [int(t) for t in np.random.default_rng(3).choice(rows, size=40)]
    return load(small_q4_mtp[0]), tokens


def test_every_point_fires_once_per_forward(small):
    model, tokens = small
    seen: list[str] = []
    logits = model.run_with_hooks(tokens, [(lambda name: True, lambda act, hook: seen.append(hook.name))])
    assert seen == model.hook_names()          # each once, in the documented order
    assert logits.shape == (40, model.config.n_vocab)
    with pytest.raises(KeyError):
        model.run_with_hooks(tokens, [("blocks.0.attn.hook_nothing", lambda a, h: None)])


def test_cache_matches_the_forward(small):
    model, tokens = small
    logits, cache = model.run_with_cache(tokens, lambda n: n.endswith(("hook_logits", "ffn.hook_experts",
                                                                        "hook_final_norm", "attn.hook_hc_comb")))
    assert np.array_equal(cache["hook_logits"], np.array(logits))
    result = model.forward(model.empty_state(), tokens)
    assert np.array_equal(cache["blocks.1.ffn.hook_experts"], np.array(result.experts[1]))
    # Recompute the logits from the cached final norm with the output matrix decoded by hand.
    dense = np.array(model.weights.output.dense())
    assert np.allclose(cache["hook_final_norm"] @ dense.T, cache["hook_logits"], rtol=1e-4, atol=1e-4)
    comb = cache["blocks.0.attn.hook_hc_comb"]
    assert np.allclose(comb.sum(axis=1), 1, atol=1e-3)          # Sinkhorn: columns sum to 1
    assert set(cache) == {n for n in model.hook_names() if n.endswith(("hook_logits", "ffn.hook_experts",
                                                                       "hook_final_norm", "attn.hook_hc_comb"))}
    assert np.array_equal(cache.positions["hook_logits"], np.arange(40))
    frame = cache.to_frame("blocks.2.ffn.hook_experts")
    assert list(frame.columns) == ["position", "index1", "value"] and len(frame) == 40 * model.config.n_expert_used


def test_cache_over_many_prompts_is_each_prompts_cache(small, capsys):
    model, tokens = small
    prompts = [tokens[:4], tokens[4:7]]
    name = "blocks.1.ffn.hook_out"
    runs = list(model.run_with_cache_over(prompts, [name], progress=True))
    assert "7/7" in capsys.readouterr().err                       # the bar counted every token
    for prompt, (logits, cache) in zip(prompts, runs, strict=True):
        alone_logits, alone = model.run_with_cache(prompt, [name])
        assert np.array_equal(np.array(logits), np.array(alone_logits))
        assert np.array_equal(cache[name], alone[name])


def test_zeroing_attention_output_removes_the_sublayer(small):
    model, tokens = small
    layer = 2
    names = [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_hc_comb", f"blocks.{layer}.hook_resid_mid"]
    def zero(act, hook):
        return mx.zeros_like(act)

    with model.hooks([(f"blocks.{layer}.attn.hook_out", zero)]):
        _, cache = model.run_with_cache(tokens, names)
    # With no attention output the streams are only the Sinkhorn mix of the old ones.
    expected = np.einsum("tac,tad->tcd", cache[names[1]], cache[names[0]])
    assert np.allclose(cache[names[2]], expected, rtol=1e-5, atol=1e-5)


def test_forcing_experts_through_the_hook(small):
    model, tokens = small
    cfg = model.config
    forced = mx.array(np.tile(np.arange(cfg.n_expert_used, dtype=np.int32), (40, 1)))
    name = "blocks.3.ffn.hook_experts"
    logits, cache = model.run_with_cache(tokens, [name])
    with model.hooks([(name, lambda act, hook: forced)]):
        changed = model(tokens)
        result = model.forward(model.empty_state(), tokens)
    assert np.array_equal(np.array(result.experts[3]), np.array(forced))
    assert not np.array_equal(cache[name], np.array(forced))
    assert not np.allclose(np.array(changed), np.array(logits))


def test_hooks_fire_in_sessions_with_absolute_positions(small):
    model, tokens = small
    positions = []
    with model.hooks([("hook_embed", lambda act, hook: positions.append(hook.positions.tolist()))]):
        session = model.session()
        session.prefill(tokens[:10], chunk=4)
        session.decode(tokens[10])
    assert positions == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10]]
    assert not model._hooks.by_name


def test_attention_pattern_over_the_keys_used(small):
    model, tokens = small
    cfg = model.config
    layer = cfg.compress_ratios.index(4)
    b = f"blocks.{layer}.attn."
    _, cache = model.run_with_cache(tokens, [b + "hook_pattern", b + "hook_key_span", b + "indexer.hook_selected"])
    weights, span = cache[b + "hook_pattern"], cache[b + "hook_key_span"]
    assert np.allclose(weights.sum(axis=-1), 1, atol=1e-5)           # sink share + key weights
    used = span[..., 0] >= 0
    assert (weights[:, :, 1:][np.broadcast_to(~used[:, None, :], weights[:, :, 1:].shape)] == 0).all()
    for t in range(len(tokens)):
        raw = span[t][used[t] & (span[t, :, 0] == span[t, :, 1])]
        # the raw window: the last n_swa positions up to t, oldest first
        assert raw[:, 0].tolist() == list(range(max(0, t - cfg.n_swa + 1), t + 1))
        comp = span[t][used[t] & (span[t, :, 0] != span[t, :, 1])]
        assert (comp[:, 1] <= t).all()                                 # compressed rows only of past windows
        assert len(comp) == cache[b + "indexer.hook_selected"][t].sum()
        assert (np.diff(comp[:, 1]) > 0).all()                         # compressed rows in cache order


def test_cache_positions_and_estimate(small):
    model, tokens = small
    names = ["blocks.1.hook_resid_post", "hook_logits"]
    estimate = model.cache_estimate(names, len(tokens))
    _, full = model.run_with_cache(tokens, names)
    assert estimate == sum(v.nbytes for v in full.values())
    _, some = model.run_with_cache(tokens, names, positions=[3, 7, 39])
    assert some["hook_logits"].shape == (3, model.config.n_vocab)
    assert np.array_equal(some["hook_logits"], full["hook_logits"][[3, 7, 39]])
    assert some.positions["blocks.1.hook_resid_post"].tolist() == [3, 7, 39]


def test_interventions(small):
    from ds4lab.interventions import ablate_experts, force_experts, patch, select_compressed_rows

    model, tokens = small
    cfg = model.config
    used = cfg.n_expert_used
    name = "blocks.3.ffn.hook_experts"
    _, base = model.run_with_cache(tokens, [name])
    with model.hooks(force_experts(3, range(used))):
        _, forced = model.run_with_cache(tokens, [name])
    assert (forced[name] == np.arange(used)).all()

    banned = [int(base[name][0, 0]), int(base[name][5, 1])]
    with model.hooks(ablate_experts(3, banned)):
        _, ablated = model.run_with_cache(tokens, [name])
    assert not np.isin(ablated[name], banned).any()
    assert all(len(set(row)) == used for row in ablated[name])
    kept = [set(r) - set(banned) for r in base[name]]
    assert all(k <= set(a) for k, a in zip(kept, ablated[name], strict=True))

    # Patching every position of the attention output with a donor run's gives the donor's logits.
    other = tokens[::-1]
    point = "blocks.1.attn.hook_out"
    donor_logits, donor = model.run_with_cache(other, [point, "hook_embed", "blocks.0.hook_resid_post"])
    patched = model.run_with_hooks(tokens, patch("blocks.0.hook_resid_post", donor))
    assert np.allclose(np.array(patched), np.array(donor_logits), atol=1e-5)
    one = model.run_with_hooks(tokens, patch(point, donor, positions=[7]))
    clean = model(tokens)
    diff = np.abs(np.array(one) - np.array(clean)).max(axis=1)
    assert (diff[:7] == 0).all() and diff[7] > 0

    layer = cfg.compress_ratios.index(4)
    only_first = select_compressed_rows(layer, lambda sel, hook: mx.arange(sel.shape[1])[None, :] < 1)
    pattern = f"blocks.{layer}.attn.hook_key_span"
    with model.hooks(only_first):
        _, cache = model.run_with_cache(tokens, [pattern])
    span = cache[pattern]
    comp = span[..., 0] != span[..., 1]
    assert (comp & (span[..., 0] >= 0)).sum(axis=1).max() == 1


def test_frames_drop_rows_and_frontier_edits(small):
    from ds4lab.interventions import drop_compressed_rows, edit_frontier

    model, tokens = small
    cfg = model.config
    layer = cfg.compress_ratios.index(4)
    b = f"blocks.{layer}."
    names = [b + "attn.hook_pattern", b + "attn.hook_key_span", b + "ffn.hook_experts", b + "ffn.hook_expert_weights"]
    _, cache = model.run_with_cache(tokens, names)
    routing = cache.routing_frame()
    assert len(routing) == 40 * cfg.n_expert_used and set(routing.columns) >= {"position", "layer", "expert", "weight"}
    assert np.allclose(routing.groupby("position")["weight"].sum(), cfg.expert_weight_scale, rtol=1e-4)
    attention = cache.attention_frame(layer)
    assert np.allclose(attention.groupby(["position", "head"])["weight"].sum(), 1, atol=1e-5)
    assert (attention.loc[attention["key"] >= 0, "last"] <= attention.loc[attention["key"] >= 0, "position"]).all()

    with model.hooks(drop_compressed_rows(layer, [0, 1])):
        _, dropped = model.run_with_cache(tokens, [b + "attn.hook_key_span"])
    span = dropped[b + "attn.hook_key_span"]
    compressed = (span[..., 0] >= 0) & (span[..., 0] != span[..., 1])
    assert not (compressed & (span[..., 1] < 8)).any()              # rows 0 and 1 cover tokens 0..7

    plain, edited = model.session(), model.session()
    plain.prefill(tokens[:30])
    edited.prefill(tokens[:30])
    edit_frontier(edited, layer, lambda kv, score: (mx.zeros_like(kv), mx.full(score.shape, -1e30)))
    for t in tokens[30:33]:                                         # token 31 completes the window 28..31
        plain.decode(t)
        edited.decode(t)
    a, c = plain.state.layers[layer].comp, edited.state.layers[layer].comp
    assert a.shape == c.shape and not np.array_equal(np.array(a[-1]), np.array(c[-1]))
    assert np.array_equal(np.array(a[:-1]), np.array(c[:-1]))


def test_frontier_hook_reads_and_replaces_the_state(small):
    model, tokens = small
    layer = model.config.compress_ratios.index(4)
    name = f"blocks.{layer}.attn.compressor.hook_frontier"
    session = model.session()
    seen = []
    session.prefill(tokens[:9])
    with model.hooks([(name, lambda act, hook: seen.append(np.array(act)))]):
        session.decode(tokens[9])
    frontier = session.state.layers[layer].frontier
    assert np.array_equal(seen[-1][0], np.array(frontier.kv)) and np.array_equal(seen[-1][1], np.array(frontier.score))
    with model.hooks([(name, lambda act, hook: mx.zeros_like(act))]):
        session.decode(tokens[10])
    assert not np.array(session.state.layers[layer].frontier.kv).any()


# ---- issue 13: hooks that cannot leak, replacements never dropped, one table -----------------
def test_a_failed_registration_leaves_no_hook(small):
    model, tokens = small
    calls = []

    def count(act, hook):
        calls.append(hook.name)

    for _ in range(2):                          # re-running the corrected cell must not stack copies
        pairs = [("hook_embed", count), ("blocks.0.attn.hook_no_such_point", count)]
        with pytest.raises(KeyError), model.hooks(pairs):
            pass
    assert not model._hooks.by_name
    model(tokens[:3])
    assert calls == []
    with model.hooks([("hook_embed", count)]):
        model(tokens[:3])
    assert calls == ["hook_embed"]


def test_router_probs_replacement_drives_selection_and_weights(small):
    model, tokens = small
    cfg = model.config
    layer = cfg.n_hash_layer                     # a biased top-k layer
    b = f"blocks.{layer}.ffn."
    favoured = np.arange(cfg.n_expert_used)[::-1] + 1          # experts 1..U, best last

    def favour(probs, hook):
        boost = np.zeros(cfg.n_expert, np.float32)
        boost[favoured] = 1e3 * np.arange(1, len(favoured) + 1)
        return probs + mx.array(boost)

    with model.hooks([(b + "hook_router_probs", favour)]):
        _, cache = model.run_with_cache(tokens, [b + n for n in ("hook_router_probs", "hook_experts",
                                                                  "hook_expert_weights")])
    assert (cache[b + "hook_experts"] == favoured[::-1]).all()  # the selection followed the replacement
    probs = cache[b + "hook_router_probs"]                        # the cache sees the replaced scores
    chosen = np.take_along_axis(probs, cache[b + "hook_experts"], axis=1)
    expected = chosen / chosen.sum(axis=1, keepdims=True) * cfg.expert_weight_scale
    assert np.allclose(cache[b + "hook_expert_weights"], expected, rtol=1e-6)


@pytest.mark.parametrize("point", ["blocks.1.attn.hook_pattern", "blocks.1.attn.hook_key_span",
                                   "blocks.1.ffn.hook_routed_mid"])
def test_read_only_points_refuse_replacements(small, point):
    from ds4lab.hooks import HookError, spec_of

    model, tokens = small
    assert not spec_of(point).replaceable
    with pytest.raises(HookError, match="read-only"):
        model.run_with_hooks(tokens[:5], [(point, lambda act, hook: act * 0)])
    model.run_with_hooks(tokens[:5], [(point, lambda act, hook: None)])     # reading is fine


def test_every_replaceable_point_takes_effect(small):
    # A replacement at any replaceable point must change what follows (or the state): none is
    # dropped. Each point gets a replacement that differs from what the model computed.
    from ds4lab.hooks import spec_of

    model, tokens = small
    base = np.array(model(tokens[:24]))
    for name in model.hook_names():
        spec = spec_of(name)
        if not spec.replaceable or name.endswith(("hook_frontier", "hook_logits")):
            continue

        sizes: list[int] = []

        def change(act, hook, sizes=sizes):
            sizes.append(act.size)
            if act.dtype == mx.bool_:
                return mx.zeros_like(act)
            if act.dtype == mx.int32:
                return (act + 1) % model.config.n_expert
            return act[..., ::-1] * 0.5 + 0.25      # not monotonic: a ranking changes too

        changed = np.array(model.run_with_hooks(tokens[:24], [(name, change)]))
        assert sizes and (not np.array_equal(changed, base) or max(sizes) == 0), name   # (no rows emitted yet)
    assert np.array_equal(np.array(model(tokens[:24])), base)


def test_readme_table_is_the_point_table():
    from pathlib import Path

    from ds4lab.hooks import markdown_table

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert markdown_table() in readme


def test_forced_experts_are_what_other_hooks_see(small):
    # model(tokens, experts=E) is force_experts hooks registered first: a user's hook on the
    # point sees (and may replace) the forced experts, not the router's.
    model, tokens = small
    cfg = model.config
    layer = cfg.n_hash_layer
    forced = np.tile(np.arange(cfg.n_expert_used, dtype=np.int32)[::-1], (10, cfg.n_layer, 1))
    seen = []
    with model.hooks([(f"blocks.{layer}.ffn.hook_experts", lambda act, hook: seen.append(np.array(act)))]):
        model(tokens[:10], experts=forced)
    assert np.array_equal(seen[0], forced[:, layer])


def test_routed_mid_seen_in_decode_is_the_prefills_row(small):
    # Decode batches a token's experts (CPU, one lazy graph); the point must still show each
    # (token, slot) row in the router's slot order, bit for bit what prefill shows.
    model, tokens = small
    name = f"blocks.{model.config.n_layer - 1}.ffn.hook_routed_mid"
    _, cache = model.run_with_cache(tokens[:12], [name])
    seen = []
    session = model.session()
    with model.hooks([(name, lambda act, hook: seen.append(np.array(act)))]):
        for t in tokens[:12]:
            session.decode(t)
    assert np.array_equal(np.concatenate(seen), cache[name])
