"""Generation over a session: samplers, stop strings, streamed steps, ds4's logprob dumps.

`stream` yields one `Step` per generated token: the token, the text it adds (UTF-8 is
decoded incrementally, so a character split over two tokens comes out whole), its
log-prob and, on request, the top alternatives. Sampling happens on the host from the
float32 logits: greedy when temperature is 0, else temperature, then top-k, top-p and min-p
filters, drawn with a seeded generator. `dump_logprobs` writes the JSON that ds4's
`--dump-logprobs` writes, so the two can be diffed.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import json
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .atomic import atomic_open
from .model.kernels import on_cuda
from .model.rope import reserve_tables
from .tokenizer import token_bytes, vocab

if TYPE_CHECKING:
    import pandas as pd

    from .mtp import SpecConfig


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None


@dataclass
class Step:
    index: int
    token: int
    text: str
    logprob: float
    top: list[tuple[int, float, float]] = field(default_factory=list)   # (id, logit, logprob)
    finish: str | None = None       # on the last step: "eos", "stop" or "length"


@dataclass
class Generation:
    text: str
    tokens: list[int]
    steps: list[Step]
    finish_reason: str      # "eos", "stop", or "length"
    spec_trace: pd.DataFrame | None = None     # with `spec`: one row per speculative cycle (ds4lab.mtp)
    spec_summary: dict | None = None           # with `spec`: ds4lab.mtp.summarize(spec_trace)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    top = x.max()
    return (x - top - np.log(np.exp(x - top).sum())).astype(np.float32)


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """One token id from `logits` under `sampling` (greedy when temperature is 0; ties to the lower id)."""
    if sampling.temperature <= 0:
        return int(np.argmax(np.asarray(logits, dtype=np.float64)))
    order, probs = _filtered(logits, sampling)
    return int(order[rng.choice(len(order), p=probs)])


def distribution(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """The probabilities `sample` draws from, over the whole vocabulary (float64; one-hot at the
    argmax when temperature is 0)."""
    logits = np.asarray(logits, dtype=np.float64)
    p = np.zeros(logits.shape[-1])
    if sampling.temperature <= 0:
        p[int(np.argmax(logits))] = 1.0
        return p
    order, probs = _filtered(logits, sampling)
    p[order] = probs
    return p


def _filtered(logits: np.ndarray, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """Token ids by decreasing logit and their probabilities after temperature, top-k, top-p, min-p."""
    logits = np.asarray(logits, dtype=np.float64)
    order = np.argsort(-logits, kind="stable")
    if sampling.top_k > 0:
        order = order[: sampling.top_k]
    z = logits[order] / sampling.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones(len(order), dtype=bool)
    if sampling.top_p < 1.0:
        keep &= (np.cumsum(probs) - probs) < sampling.top_p
    if sampling.min_p > 0.0:
        keep &= probs >= sampling.min_p * probs[0]
    probs = np.where(keep, probs, 0.0)
    return order, probs / probs.sum()


def _top(logits: np.ndarray, logprobs: np.ndarray, k: int) -> list[tuple[int, float, float]]:
    ids = np.argsort(-logits, kind="stable")[:k]
    return [(int(i), float(logits[i]), float(logprobs[i])) for i in ids]


class Emitter:
    """Turns chosen tokens into `Step`s: incremental UTF-8, stop strings (up to longest stop - 1
    characters held back until it is clear they do not begin one), EOS and max_tokens."""

    def __init__(self, max_tokens: int, stop: Sequence[str] = (), top_logprobs: int = 0) -> None:
        self.max_tokens, self.stop, self.top_logprobs = max_tokens, list(stop), top_logprobs
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.index = 0
        self.eos = vocab().eos_id

    def step(self, token: int, logits, logprob: float | None = None) -> Step:
        """The step of the next token, chosen from `logits` (the row its logprob is read from,
        unless `logprob` is given and no top alternatives are asked for); `finish` is set when
        generation ends with it."""
        top = []
        if logprob is None or self.top_logprobs:
            row = np.array(logits, dtype=np.float32)
            lp = log_softmax(row)
            logprob = float(lp[token])
            top = _top(row, lp, self.top_logprobs) if self.top_logprobs else []
        index, self.index = self.index, self.index + 1
        if token == self.eos:
            return Step(index, token, self.pending, logprob, top, finish="eos")
        self.pending += self.decoder.decode(token_bytes(token))
        hit = min((self.pending.find(s) for s in self.stop if s in self.pending), default=-1)
        if hit >= 0:
            return Step(index, token, self.pending[:hit], logprob, top, finish="stop")
        if index + 1 == self.max_tokens:
            return Step(index, token, self.pending + self.decoder.decode(b"", final=True), logprob, top,
                        finish="length")
        emit = self.pending[: max(len(self.pending) - self.hold, 0)]
        self.pending = self.pending[len(emit):]
        return Step(index, token, emit, logprob, top)


@mx.compile
def _greedy_choice(logits: mx.array) -> tuple[mx.array, mx.array]:
    """The greedy token of a logits row (the lowest id on ties, as `sample`) and its log-prob,
    both on the device. The greedy stream reads these two scalars instead of the row: copying
    the vocabulary's logits to the host and taking their log-softmax there cost its thread
    ~1 ms a step, about a tenth of a 43-layer step's time."""
    return mx.argmax(logits), mx.max(logits) - mx.logsumexp(logits)


def stream(model, prompt: Sequence[int], max_tokens: int = 256, sampling: Sampling = Sampling(),
           stop: Sequence[str] = (), top_logprobs: int = 0, session=None, progress: bool = False,
           spec: SpecConfig | None = None) -> Iterator[Step]:
    """Prefill `prompt` (or continue `session`) and yield generated steps until EOS, a stop
    string (the text before it is yielded, the stop string is not) or `max_tokens`.

    With stop strings, up to (longest stop - 1) characters are held back until it is
    clear they do not begin one; the last step carries the rest and `finish`.
    `spec` decodes speculatively (`ds4lab.mtp.SpecConfig`): the same tokens (greedy) or the
    same distribution (sampled), the session left as plain decoding leaves it; the per-cycle
    record is then `session.spec_trace`."""
    session = session or model.session()
    if spec is not None:
        from .mtp import speculative_stream

        yield from speculative_stream(model, session, list(prompt), Emitter(max_tokens, stop, top_logprobs),
                                      sampling, spec, progress)
        return
    logits = session.prefill(list(prompt), progress=progress) if prompt else session.logits
    emitter = Emitter(max_tokens, stop, top_logprobs)
    if sampling.temperature <= 0:
        threaded = session.model.numerics.fast and not session.model.hooked
        encoder = _WorkerEncoder(session, logits, max_tokens) if threaded else _InlineEncoder()
        yield from _greedy_pipelined(session, logits, emitter, max_tokens, encoder)
        return
    rng = np.random.default_rng(sampling.seed)
    for _ in range(max_tokens):
        step = emitter.step(sample(np.array(logits, dtype=np.float32), sampling, rng), logits)
        yield step
        if step.finish:
            return
        logits = session.decode(step.token)


# How many steps greedy decoding has built and queued when it reads a token. With one, the
# host reads step n's token once step n + 1 is queued, then builds step n + 2: that build
# starts only when the device finishes step n, and step n + 2's encoding after it, so the
# period is at least (build + encoding + the last graph's device time) / 2 whenever that is
# longer than the device's step (H200, 43 layers at 4096: 5.7-11 ms built, 10-13 encoded).
# With two, the token read comes from the step queued before the one just handed over.
STEPS_AHEAD = 1


def _greedy_pipelined(session, logits: mx.array, emitter: Emitter, max_tokens: int,
                      encoder: _InlineEncoder | _WorkerEncoder) -> Iterator[Step]:
    """Greedy decoding with the host `STEPS_AHEAD` steps ahead of the device (mlx-lm's
    pattern): the argmax stays on the device, the following steps' graphs are built from the
    unread tokens and handed to the encoder (queued for the device) before a token is read,
    so building a step's graph overlaps the device computing the ones before. Each state
    built holds the unread tokens as device scalars, replaced by their ids once read. While a
    step is yielded the session shows the state before its token (as plain decoding would
    leave it); no step past the last token is built, and a caller that stops early leaves the
    steps built ahead unread."""
    try:
        with encoder.stream():
            chosen, logprob = _greedy_choice(logits)
        encoder.submit([chosen, logprob])
        # (the state before token j, the logits that predict it, its argmax and log-prob), for
        # each token j built on and not yet read; the first is the next to read
        ahead = [(session.state, logits, chosen, logprob)]
        for index in range(max_tokens):
            built = False
            while index + len(ahead) - 1 < min(index + STEPS_AHEAD, max_tokens - 1):
                if session.model.hooked:               # a hook may evaluate while the step is built
                    encoder.settle()
                session.state = ahead[-1][0]
                with encoder.stream():
                    upcoming = session.decode(ahead[-1][2])   # built from the unread token
                    following, following_logprob = _greedy_choice(upcoming)
                encoder.settle()                       # the step before is now queued
                encoder.submit([upcoming, following, following_logprob], _step_pieces(session))
                ahead.append((session.state, upcoming, following, following_logprob))
                built = True
            if not built:                              # nothing follows: the worker done first
                encoder.settle()
            before, step_logits, chosen, logprob = ahead.pop(0)
            token = int(chosen.item())                 # a wait on the device
            for later, *_ in ahead:
                later.tokens[before.n_tokens] = token
            session.state = before
            step = emitter.step(token, step_logits, logprob.item())
            yield step
            if step.finish:
                return
    finally:
        encoder.close()


def _step_pieces(session) -> list[mx.array]:
    """The arrays a decode step is handed over by before the whole of it (`Model.stream_commits`):
    each listed layer's raw window, made by that layer's attention."""
    layers = session.state.layers
    return [layers[il].raw for il in session.model.stream_commits if 0 <= il < len(layers)]


def _queue(arrays: list[mx.array], pieces: Sequence[mx.array]) -> None:
    """`mx.async_eval` of each piece, then of `arrays`: with MLX's graph limits raised past a step
    (MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER), one CUDA graph each, committed at the same
    places every step (so MLX updates its cached graphs instead of building new ones), and the
    device starts on the first piece while the rest is encoded."""
    for piece in pieces:
        mx.async_eval(piece)
    mx.async_eval(arrays)


class _InlineEncoder:
    """Steps queued from this thread (`mx.async_eval` encodes them before it returns)."""

    def stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def submit(self, arrays: list[mx.array], pieces: Sequence[mx.array] = ()) -> None:
        _queue(arrays, pieces)

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


_ANY_THREAD_STREAMS: dict[str, mx.Stream] = {}


def _any_thread_stream() -> mx.Stream:
    """A stream on the default device that any thread may evaluate on (MLX's streams belong
    to their thread otherwise); one per device, so that compiled functions trace once for it."""
    device = mx.default_device()
    key = str(device)
    if key not in _ANY_THREAD_STREAMS:
        _ANY_THREAD_STREAMS[key] = mx.new_thread_unsafe_stream(device)
    return _ANY_THREAD_STREAMS[key]


def _cuda_driver() -> ctypes.CDLL | None:
    """The CUDA driver library when MLX runs on a CUDA GPU, else None."""
    return ctypes.CDLL("libcuda.so.1") if on_cuda() else None


def _cuda_context(driver: ctypes.CDLL, context: ctypes.c_void_p | None = None) -> ctypes.c_void_p:
    """This thread's current CUDA context, after making `context` current when given.

    MLX CUDA (0.32.4) makes a thread's context current only when that thread first commits
    work, after the work's kernels are loaded. A fresh thread whose first evaluation needs a
    kernel not yet loaded in the process therefore failed: a custom kernel's module (`Failed to
    load compiled ... kernel`) or one of MLX's own kernels loaded lazily (`cudaGraphAddKernelNode
    ... invalid argument`: the vocabulary's argmax); seen on an H200 when a greedy stream
    started straight after a prefill, with no plain step first (2026-12-04). The worker takes
    the context of the thread that made it, which has evaluated on the GPU. (Measured on the
    H200: the context bound, a 4-layer stream straight after its prefill ran; the argmax
    launched on the creating thread first, the checks' stream ran; each was needed once.)"""
    if context is not None and (status := driver.cuCtxSetCurrent(context)) != 0:
        raise RuntimeError(f"cuCtxSetCurrent failed with CUDA driver status {status}")
    current = ctypes.c_void_p()
    if (status := driver.cuCtxGetCurrent(ctypes.byref(current))) != 0:
        raise RuntimeError(f"cuCtxGetCurrent failed with CUDA driver status {status}")
    if current.value is None and context is None:       # none yet: device 0's primary context, MLX's
        if (status := driver.cuDevicePrimaryCtxRetain(ctypes.byref(current), 0)) != 0:
            raise RuntimeError(f"cuDevicePrimaryCtxRetain failed with CUDA driver status {status}")
    return current


class _WorkerEncoder:
    """Steps queued by a worker thread: for the fast path on a GPU (hook-free), where host work
    bounds a step. MLX encodes a graph on the thread that evaluates it (on CUDA some 20 µs a
    kernel: ~20 ms a 43-layer step), and building the graph in Python takes ~7 ms more; with
    the worker, the generator's thread builds step n + 1 while the worker encodes step n. The
    steps are built on a stream any thread may use (MLX leaves the synchronisation to its
    user): the worker takes one step at a time, and the generator evaluates nothing while it
    encodes (`settle` first) and reads a token only from a step already queued (a wait on the
    device). Building a step evaluates nothing: the RoPE tables are grown beforehand for every
    position the generation can reach, and the loop settles before building when a hook is
    registered (a hook may evaluate an activation). Between steps the caller's own work runs on
    its own stream."""

    def __init__(self, session, logits: mx.array, max_tokens: int) -> None:
        # Nothing lazy left on this thread's stream, and the greedy choice's kernels (the
        # vocabulary's argmax, max and logsumexp) launched here once (see `_cuda_context`: on the
        # H200 the argmax's first launch on the worker failed even with the context bound there,
        # when the process had run other work first).
        mx.eval(logits, *_greedy_choice(logits), *session.state.arrays())
        session.model.ready_for_decode()
        self._driver = _cuda_driver()
        self._context = None if self._driver is None else _cuda_context(self._driver)
        reserve_tables(session.state.n_tokens + max_tokens)
        self._queued, self._encoded = queue.Queue(), queue.Queue()
        self._busy = False                             # a step handed over, not yet encoded
        self._worker = threading.Thread(target=self._encode, name="ds4lab-encode", daemon=True)
        self._worker.start()

    def _encode(self) -> None:
        unbound = self._driver is not None
        while (work := self._queued.get()) is not None:
            try:
                if unbound:                    # the context first (`_cuda_context`)
                    _cuda_context(self._driver, self._context)
                    unbound = False
                _queue(*work)
                self._encoded.put(None)
            except BaseException as error:     # handed to the generator, which raises it
                self._encoded.put(error)

    def stream(self) -> contextlib.AbstractContextManager:
        return mx.stream(_any_thread_stream())

    def submit(self, arrays: list[mx.array], pieces: Sequence[mx.array] = ()) -> None:
        self._queued.put((arrays, pieces))
        self._busy = True

    def settle(self) -> None:
        """Wait until the worker has encoded the step handed to it (its error raised here)."""
        if self._busy:
            self._busy = False
            if (error := self._encoded.get()) is not None:
                raise error

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self._queued.put(None)
            self._worker.join()


def generate(model, prompt: str | Sequence[int], max_tokens: int = 256, sampling: Sampling = Sampling(),
             stop: Sequence[str] = (), top_logprobs: int = 0, spec: SpecConfig | None = None,
             session=None) -> Generation:
    """Generate from a prompt (text, tokenized as is, or token ids); see `stream`. With `spec`
    the result carries `spec_trace` and `spec_summary`."""
    ids = model.tokenizer.encode(prompt, add_special_tokens=False).ids if isinstance(prompt, str) else list(prompt)
    session = session or model.session()
    steps = list(stream(model, ids, max_tokens, sampling, stop, top_logprobs, session=session, spec=spec))
    finish = steps[-1].finish if steps else "length"
    tokens = [s.token for s in steps if s.finish != "eos"]
    out = Generation("".join(s.text for s in steps), tokens, steps, finish or "length")
    if spec is not None:
        from .mtp import summarize

        out.spec_trace, out.spec_summary = session.spec_trace, summarize(session.spec_trace)
    return out


def _json_token(token: int) -> dict:
    raw = token_bytes(token)
    return {"id": token, "text": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}


def dump_logprobs(model, prompt: Sequence[int], path: str | os.PathLike[str], max_tokens: int = 4,
                  top_k: int = 20, ctx: int = 32768) -> Path:
    """Greedy steps with their top-k (ids, logits, logprobs), as ds4's `--dump-logprobs` writes them."""
    top_k = min(max(top_k, 1), 128)
    session = model.session()
    logits = session.prefill(list(prompt))
    steps = []
    for step in range(max_tokens):
        row = np.array(logits, dtype=np.float32)
        lp = log_softmax(row)
        token = int(np.argmax(row))
        steps.append({"step": step, "selected": _json_token(token),
                      "top_logprobs": [{"token": _json_token(i), "logit": lg, "logprob": p}
                                       for i, lg, p in _top(row, lp, top_k)]})
        if token == vocab().eos_id:
            break
        logits = session.decode(token)
    doc = {"source": "ds4lab", "prompt_tokens": len(prompt), "ctx": ctx, "top_k": top_k, "steps": steps}
    path = Path(path)
    with atomic_open(path) as fh:
        fh.write(json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8"))
    return path

