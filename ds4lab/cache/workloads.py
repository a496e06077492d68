"""Request traces for the cache simulator: JSONL records, generators, ds4-server `--trace` logs.

A trace is a list of records, one per request, in arrival order (JSONL: one object a line):

    t              arrival time, seconds (float)
    session        conversation id; a request extends its session's previous prompt and reply
    prompt_tokens  rendered prompt length in tokens
    gen_tokens     tokens generated
    shared         optional id of a prefix shared across sessions (system prompt + tools)
    shared_tokens  its length in tokens
    anchor         optional cold-save anchor in tokens (ds4's last <｜User｜> before the first
                   <｜Assistant｜>); default: `shared_tokens` when `shared` is set, else none
    keep_gen       default true: the reply is part of the session's next prompt; false when
                   the client drops it (hidden reasoning), so the next prompt forks before it
    text, gen_text optional rendered prompt and reply; with them prefixes come from the bytes

Without text a request's prompt is its session's history (previous prompt + kept reply)
followed by new tokens; a prompt shorter than the history restarts the session from the
shared prefix (a client compacting its context).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .texts import Text, TextTree

USER_MARKER = "<｜User｜>".encode()
ASSISTANT_MARKER = "<｜Assistant｜>".encode()


@dataclass(frozen=True)
class Request:
    """One request as the simulator replays it."""

    t: float
    session: str
    prompt: Text
    live: Text          # the live session after generation: prompt + reply
    anchor: Text | None  # the cold-save boundary when the prompt has a chat anchor


@dataclass
class _Session:
    branch: int
    history: int  # tokens of prompt + kept reply


def prepare(records: Iterable[dict[str, Any]], tree: TextTree, bytes_per_token: int = 4) -> list[Request]:
    """Place every record's prompt and reply in `tree` (see the module doc for the rules)."""
    sessions: dict[str, _Session] = {}
    shared_branches: dict[str, int] = {}
    out = []
    for rec in records:
        if "text" in rec:
            out.append(_prepare_text(rec, tree, bytes_per_token))
            continue
        sid = str(rec.get("session", ""))
        p, g = int(rec["prompt_tokens"]), int(rec.get("gen_tokens", 0))
        shared = rec.get("shared")
        shared_tokens = int(rec.get("shared_tokens", 0)) if shared is not None else 0
        s = sessions.get(sid)
        if s is None or p < s.history:
            root = -1
            if shared is not None:
                root = shared_branches.setdefault(str(shared), tree.new_branch())
            s = sessions[sid] = _Session(tree.new_branch(root, shared_tokens * bytes_per_token), 0)
        prompt = Text(s.branch, p * bytes_per_token, p)
        if rec.get("keep_gen", True):
            live = Text(s.branch, (p + g) * bytes_per_token, p + g)
            s.history = p + g
        else:
            live = Text(tree.new_branch(s.branch, p * bytes_per_token), (p + g) * bytes_per_token, p + g)
            s.history = p
        anchor = int(rec.get("anchor", shared_tokens if shared is not None else -1))
        out.append(Request(float(rec["t"]), sid, prompt, live,
                           TextTree.cut(prompt, anchor) if 0 <= anchor <= p else None))
    return out


def _prepare_text(rec: dict[str, Any], tree: TextTree, bytes_per_token: int) -> Request:
    data = rec["text"].encode("utf-8")
    p = int(rec.get("prompt_tokens") or max(1, len(data) // bytes_per_token))
    g = int(rec.get("gen_tokens", 0))
    prompt = Text(tree.add_bytes(data), len(data), p)
    gen = rec.get("gen_text")
    if gen:
        full = data + gen.encode("utf-8")
        live = Text(tree.add_bytes(full), len(full), p + g)
    else:
        live = Text(tree.new_branch(prompt.branch, len(data)), len(data) + g * bytes_per_token, p + g)
    return Request(float(rec["t"]), str(rec.get("session", "")), prompt, live, _text_anchor(data, prompt))


def _text_anchor(data: bytes, prompt: Text) -> Text | None:
    """ds4's chat anchor found in the bytes: the last user marker before the first assistant
    marker, its token position estimated in proportion (ds4 counts it on token ids)."""
    first_assistant = data.find(ASSISTANT_MARKER)
    end = first_assistant if first_assistant >= 0 else len(data)
    pos = data.rfind(USER_MARKER, 0, end)
    if pos <= 0:
        return None
    return Text(prompt.branch, pos, pos * prompt.tokens // len(data))


# ---- files -------------------------------------------------------------------------------
def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL trace; blank lines are skipped, a bad line names its number."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
            if "t" not in rec or ("prompt_tokens" not in rec and "text" not in rec):
                raise ValueError(f"{path}:{i}: a record needs 't' and 'prompt_tokens' or 'text'")
            out.append(rec)
    return out


_BEGIN = re.compile(r"\n?===== request (\d+) (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) =====\n")


def read_ds4_trace(path: str | Path) -> list[dict[str, Any]]:
    """Records from a ds4-server `--trace` file (ds4_server.c trace_begin/trace_finish).

    Each request block gives its local start time (whole seconds), `prompt_tokens`, the
    rendered prompt, the generated text and `generated_tokens`. ds4 appends a newline to a
    prompt that lacks one, so a trailing newline of the prompt cannot be told apart and is
    dropped. The server runs one session, so every record has session "ds4".
    """
    raw = Path(path).read_bytes().decode("utf-8", errors="surrogateescape")
    out = []
    for m in _BEGIN.finditer(raw):
        end = raw.find(f"\n===== end request {m.group(1)} =====", m.end())
        block = raw[m.end(): end if end >= 0 else len(raw)]
        fields = dict(re.findall(r"^([a-z_]+): (.*)$", block.split("\n--- ", 1)[0], re.M))
        prompt = _between(block, "\n--- rendered prompt ---\n", "\n\n--- generated text ---\n")
        generated = _between(block, "\n--- generated text ---\n", "\n\n--- parsed message ---\n")
        gen_tokens = re.search(r"^generated_tokens: (\d+)$", block, re.M)
        t = time.mktime(time.strptime(m.group(2), "%Y-%m-%d %H:%M:%S"))
        rec: dict[str, Any] = {"t": t, "session": "ds4", "prompt_tokens": int(fields.get("prompt_tokens", 0)),
                               "gen_tokens": int(gen_tokens.group(1)) if gen_tokens else 0}
        if prompt is not None:
            rec["text"] = prompt
            # Trace events interleave "--- trace: ... ---" paragraphs with the pieces.
            rec["gen_text"] = re.sub(r"\n\n--- trace: .*? ---\n\n", "", generated or "")
        out.append(rec)
    return out


def _between(block: str, start: str, end: str) -> str | None:
    i = block.find(start)
    if i < 0:
        return None
    j = block.rfind(end, i + len(start))
    return block[i + len(start): j if j >= 0 else len(block)]


# ---- generators ------------------------------------------------------------------------------
def coding_agent_trace(n_requests: int = 1000, n_users: int = 8, seed: int = 0, *,
                       system_tokens: tuple[int, ...] = (18000, 24000), sessions_per_user: int = 3,
                       turn_gap_s: float = 40.0, switch_prob: float = 0.15, long_gen_prob: float = 0.02,
                       hidden_reasoning_prob: float = 0.0, max_context: int = 120000) -> list[dict[str, Any]]:
    """A coding-agent workload: users each juggle a few sessions of one agent.

    Every session starts with its agent's long system prompt + tool schemas (`system_tokens`,
    one agent per entry, shared by all sessions of it), then turns of tool output or user
    text (log-normal, ~1.5k tokens) and replies (log-normal, ~400 tokens; with
    `long_gen_prob` a long 20-40k-token generation). A user switches to another of their
    sessions with `switch_prob` per turn; a session that would pass `max_context` is
    compacted (restarted from the system prompt with a summary).
    """
    rng = np.random.default_rng(seed)
    records = []
    clock = 0.0
    users = [{"current": 0, "sessions": [None] * sessions_per_user, "next_id": 0, "t": rng.exponential(turn_gap_s)}
             for _ in range(n_users)]
    next_t = np.array([u["t"] for u in users])
    for _ in range(n_requests):
        ui = int(np.argmin(next_t))
        u = users[ui]
        clock = float(next_t[ui])
        if rng.random() < switch_prob:
            u["current"] = int(rng.integers(sessions_per_user))
        slot = u["current"]
        s = u["sessions"][slot]
        new_tokens = int(rng.lognormal(np.log(1500), 0.9)) + 20
        if s is None or s["history"] + new_tokens > max_context:
            agent = int(rng.integers(len(system_tokens)))
            summary = 0 if s is None else int(rng.lognormal(np.log(3000), 0.5))
            s = u["sessions"][slot] = {"id": f"u{ui}-s{u['next_id']}", "agent": agent,
                                       "history": system_tokens[agent] + summary}
            u["next_id"] += 1
        prompt = s["history"] + new_tokens
        gen = int(rng.integers(20000, 40000)) if rng.random() < long_gen_prob else \
            int(rng.lognormal(np.log(400), 0.8)) + 1
        keep = not rng.random() < hidden_reasoning_prob
        agent = s["agent"]
        records.append({"t": round(clock, 3), "session": s["id"], "prompt_tokens": prompt, "gen_tokens": gen,
                        "shared": f"agent{agent}", "shared_tokens": system_tokens[agent], "keep_gen": keep})
        s["history"] = prompt + (gen if keep else 0)
        next_t[ui] = clock + rng.exponential(turn_gap_s)
    return records


def iter_records(source: str | Path | Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Records from a JSONL path, a ds4 `--trace` log (detected by its header) or a list."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as fh:
            head = fh.read(200)
        yield from read_ds4_trace(source) if b"===== request " in head else read_jsonl(source)
    else:
        yield from source
