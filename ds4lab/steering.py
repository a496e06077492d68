"""Steering vectors: ds4's directional steering, built, stored, applied and swept from Python.

A `SteeringVector` holds one direction per layer, `directions` float32 [n_layer, n_embd].

Applying (`model.steering(vector, attn=0.0, ffn=1.0)` or `steer`) edits a sublayer's output
`y` (one n_embd row per token) before the hyper-connections spread it into the streams,
exactly as ds4's `--dir-steering-attn` / `--dir-steering-ffn` do:

    mode="project":  y <- y - s * v * (v . y)     (s = 1 removes the component along v,
                                                    negative s amplifies it to (1 - s)(v . y))
    mode="add":      y <- y + s * v

on the attention output projection's result (`blocks.L.attn.hook_out`) and on routed plus
shared expert output (`blocks.L.ffn.hook_out`), each with its own scale, for every token of
every forward run inside the `with` block: `model(...)`, sessions, generation,
`run_with_cache`. It is a set of ordinary hooks, so it composes with other hooks: hooks
registered before it see the unedited output, hooks registered after it the edited one.

Files (`SteeringVector.load` tells the two apart by the GGUF magic):

* ds4's `.f32`: little-endian float32 [n_layer][n_embd], layer-major, plus `<stem>.json`
  metadata (`"format": "ds4-directional-steering-v1"`, `"shape"`, how it was built). ds4
  itself reads only the `.f32`.
* llama.cpp / repeng control vectors: a GGUF with one F32 tensor `direction.<layer>` per layer
  (absent layers are zero). The layer numbers are ds4's block indices; llama.cpp adds
  `direction.k` to block k's output and refuses `direction.0`, so zero row 0 before saving a
  file meant for llama.cpp. The semantics (projection or addition, which sublayer) are chosen
  when applying, not stored.

Building (`build`, `ds4lab steer build`) follows ds4's dir-steering/tools/build_direction.py:
each prompt (one per line) is rendered as a one-turn chat, the chosen sublayer output is read
at the last prompt token (or averaged over the prompt), and per layer the direction is the
normalised difference of the target and control means, optionally made orthogonal to the
control mean. `sweep` runs prompts x scales x layer sets and tabulates what changed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np
import pandas as pd

from .atomic import atomic_open
from .config import ARCH, FLASH
from .generation import Sampling, generate
from .gguf import GGUF_MAGIC, TensorOut, write_gguf
from .hooks import HookFn, HookPoint

__all__ = [
    "DEFAULT_SYSTEM",
    "DS4_FORMAT",
    "SteeringVector",
    "build",
    "collect_activations",
    "plot_sweep",
    "read_prompts",
    "render_prompt",
    "steer",
    "steering_hooks",
    "sweep",
]

DS4_FORMAT = "ds4-directional-steering-v1"
# build_direction.py's default system prompt.
DEFAULT_SYSTEM = "You are a helpful assistant."
# The hook point of each sublayer output, below `blocks.<layer>.`, and ds4's name for it.
HOOKS = {"attn": "attn.hook_out", "ffn": "ffn.hook_out"}
DS4_COMPONENT = {"attn": "attn_out", "ffn": "ffn_out"}
SIGN_NOTE = "runtime positive scale suppresses this direction; negative scale amplifies it"

Component = Literal["attn", "ffn", "attn+ffn"]
Method = Literal["mean", "pair_mean", "pca"]


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm; all-zero rows stay zero (as ds4's builder leaves them)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


@dataclass
class SteeringVector:
    """Per-layer directions, float32 [n_layer, n_embd], and free-form metadata (ds4's JSON keys)."""

    directions: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        directions = np.ascontiguousarray(self.directions, dtype=np.float32)
        if directions.ndim != 2:
            raise ValueError(f"directions must be [n_layer, n_embd], got shape {directions.shape}")
        if not np.isfinite(directions).all():
            raise ValueError("directions hold NaN or infinite values")
        self.directions = directions

    @property
    def n_layer(self) -> int:
        return self.directions.shape[0]

    @property
    def n_embd(self) -> int:
        return self.directions.shape[1]

    # ---- files ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str], n_embd: int | None = None) -> SteeringVector:
        """Read a ds4 `.f32` (or its `.json`, which names the `.f32` beside it) or a control-vector GGUF.

        A ds4 file's shape comes from its JSON; without one, rows are `n_embd` wide (4096, Flash's
        width, by default)."""
        path = Path(path)
        if path.suffix == ".json":
            path = path.with_suffix(".f32")
        with open(path, "rb") as fh:
            magic = fh.read(len(GGUF_MAGIC))
        return cls._load_gguf(path) if magic == GGUF_MAGIC else cls._load_ds4(path, n_embd)

    @classmethod
    def _load_ds4(cls, path: Path, n_embd: int | None) -> SteeringVector:
        sidecar = path.with_suffix(".json")
        metadata = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.exists() else {}
        if metadata.get("format", DS4_FORMAT) != DS4_FORMAT:
            raise ValueError(f"{sidecar}: format {metadata['format']!r}, expected {DS4_FORMAT!r}")
        size = path.stat().st_size
        if "shape" in metadata:
            n_layer, width = (int(n) for n in metadata["shape"])
            if size != 4 * n_layer * width:          # ds4 checks the exact size too
                raise ValueError(f"{path}: {size} bytes, but its JSON says {n_layer} x {width} float32")
        else:
            width = n_embd or FLASH.n_embd
            if size == 0 or size % (4 * width):
                raise ValueError(f"{path}: {size} bytes is not a whole number of {width}-wide float32 rows")
            n_layer = size // (4 * width)
        directions = np.fromfile(path, dtype="<f4").reshape(n_layer, width)
        return cls(directions, metadata)

    @classmethod
    def _load_gguf(cls, path: Path) -> SteeringVector:
        import gguf

        reader = gguf.GGUFReader(path)
        metadata: dict[str, Any] = {}
        if (stored := reader.get_field("ds4lab.steering")) is not None:
            metadata = json.loads(stored.contents())
        rows: dict[int, np.ndarray] = {}
        for tensor in reader.tensors:
            prefix, _, index = tensor.name.partition(".")
            if prefix != "direction" or not index.isdigit():
                raise ValueError(f"{path}: tensor {tensor.name!r} is not a direction.<layer> tensor")
            if tensor.tensor_type != gguf.GGMLQuantizationType.F32 or len(tensor.shape) != 1:
                raise ValueError(f"{path}: {tensor.name} must be a 1-D F32 tensor")
            rows[int(index)] = np.array(tensor.data, dtype=np.float32)
        if not rows:
            raise ValueError(f"{path}: no direction.<layer> tensors")
        widths = {row.shape[0] for row in rows.values()}
        if len(widths) != 1:
            raise ValueError(f"{path}: direction tensors of different widths {sorted(widths)}")
        # Files from other tools do not say how many layers the model has: up to the last one given.
        n_layer = int(metadata["shape"][0]) if "shape" in metadata else max(rows) + 1
        directions = np.zeros((n_layer, widths.pop()), np.float32)
        for layer, row in rows.items():
            directions[layer] = row
        return cls(directions, metadata)

    def save(self, path: str | os.PathLike[str], format: Literal["ds4", "gguf"] = "ds4") -> Path:
        """Write `path` in ds4's format (the `.f32`, plus the JSON beside it) or as a control-vector
        GGUF (every non-zero row as `direction.<layer>`, the metadata as JSON under
        `ds4lab.steering`). Returns the path of the vector file."""
        path = Path(path)
        metadata = {**self.metadata, "format": DS4_FORMAT, "shape": list(self.directions.shape)}
        if format == "gguf":
            tensors = [TensorOut(f"direction.{layer}", "F32", (self.n_embd,), lambda row=row: row)
                       for layer, row in enumerate(self.directions) if row.any()]
            return write_gguf(path, [
                ("general.architecture", "STRING", "controlvector"),
                ("controlvector.model_hint", "STRING", ARCH),
                ("controlvector.layer_count", "UINT32", len(tensors)),
                ("ds4lab.steering", "STRING", json.dumps(metadata)),
            ], tensors)
        if format != "ds4":
            raise ValueError(f"format must be 'ds4' or 'gguf', not {format!r}")
        if path.suffix == ".json":                    # as ds4's builder: --out X.json writes X.f32 too
            path = path.with_suffix(".f32")
        with atomic_open(path) as fh:
            fh.write(self.directions.astype("<f4").tobytes())
        with atomic_open(path.with_suffix(".json")) as fh:
            fh.write(json.dumps(metadata, indent=2).encode("utf-8"))
        return path

    # ---- building ---------------------------------------------------------------------
    @classmethod
    def from_activations(cls, target: np.ndarray, control: np.ndarray, method: Method = "mean",
                         orthogonalize: bool = True, metadata: dict[str, Any] | None = None) -> SteeringVector:
        """Directions from activations [n_prompts, n_layer, n_embd] of target and control prompts.

        Like ds4, the i-th target and control prompts form a pair and only min(n_target,
        n_control) pairs are used. `method`: "mean" = unit(mean target - mean control);
        "pair_mean" = unit(mean of the unit per-pair differences) (ds4's --pair-normalize);
        "pca" = the first principal axis of the per-pair differences, signed to agree with the
        mean difference. `orthogonalize` then removes the component along the control mean.
        """
        n = min(len(target), len(control))
        if n == 0:
            raise ValueError("need at least one target and one control prompt")
        # float64 like ds4's builder (Python floats), so long sums do not lose the small difference.
        t = np.asarray(target[:n], np.float64)
        c = np.asarray(control[:n], np.float64)
        mean_diff = t.mean(axis=0) - c.mean(axis=0)
        if method == "mean":
            direction = mean_diff
        elif method == "pair_mean":
            direction = _unit(t - c).mean(axis=0)
        elif method == "pca":
            direction = np.stack([_principal_axis(diffs, mean) for diffs, mean
                                  in zip((t - c).transpose(1, 0, 2), mean_diff, strict=True)])
        else:
            raise ValueError(f"method must be 'mean', 'pair_mean' or 'pca', not {method!r}")
        direction = _unit(direction)
        if orthogonalize:
            base = _unit(c.mean(axis=0))
            direction = _unit(direction - (direction * base).sum(axis=-1, keepdims=True) * base)
        info = {"pair_normalize": method == "pair_mean", "orthogonalize_control_mean": orthogonalize,
                "method": method, "pairs": n, "note": SIGN_NOTE}
        return cls(direction.astype(np.float32), {**info, **(metadata or {})})


def _principal_axis(diffs: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """First right singular vector of the (uncentred) pair differences [n, n_embd] of one layer.

    Uncentred, because the consistent shift shared by all pairs is the signal; centring would
    subtract it. A singular vector's sign is arbitrary: pick the one along the mean difference."""
    axis = np.linalg.svd(diffs, full_matrices=False)[2][0]
    return -axis if axis @ mean < 0 else axis


# ---- prompts --------------------------------------------------------------------------------
def read_prompts(path: str | os.PathLike[str]) -> list[str]:
    """ds4's prompt files: one prompt per non-empty line; lines starting with '#' are comments."""
    lines = (line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines())
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def render_prompt(prompt: str, system: str | None = None, think: bool = False) -> str:
    """The one-turn chat ds4's builder feeds the model: BOS, system (ds4's default when None;
    none when ""), user turn, assistant turn opened with `</think>` (or `<think>` with `think`)."""
    from .chat import render

    system = DEFAULT_SYSTEM if system is None else system
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return render({"messages": messages, "thinking": {"type": "enabled" if think else "disabled"}})


def _encode(prompt: str, system: str | None, think: bool) -> list[int]:
    from .tokenizer import load as load_tokenizer

    return load_tokenizer(mode="ds4").encode(render_prompt(prompt, system, think)).ids


def _points(component: Component) -> tuple[str, ...]:
    if component not in ("attn", "ffn", "attn+ffn"):
        raise ValueError(f"component must be 'attn', 'ffn' or 'attn+ffn', not {component!r}")
    return tuple(HOOKS[part] for part in component.split("+"))


def _at(points: tuple[str, ...]):
    """A hook-name filter for those sublayer points in every block."""
    return lambda name: name.startswith("blocks.") and name.split(".", 2)[2] in points


# ---- building -------------------------------------------------------------------------------
def collect_activations(model, prompts: Sequence[str], component: Component = "ffn",
                        position: Literal["last", "mean"] = "last", system: str | None = None,
                        think: bool = False, progress: bool = False) -> np.ndarray:
    """Sublayer outputs [n_prompts, n_layer, n_embd] of each rendered prompt, at its last token
    (ds4's choice: the `</think>` marker) or averaged over its tokens. "attn+ffn" sums the two
    sublayers' outputs. Read through hooks, so hooks already active (steering too) apply."""
    points = _points(component)
    if position not in ("last", "mean"):
        raise ValueError(f"position must be 'last' or 'mean', not {position!r}")
    cfg = model.config
    out = np.zeros((len(prompts), cfg.n_layer, cfg.n_embd), np.float32)
    if progress:
        from tqdm.auto import tqdm

        prompts = tqdm(prompts, unit="prompt", desc="activations")
    for i, prompt in enumerate(prompts):
        ids = _encode(prompt, system, think)
        rows = out[i]

        def record(act: mx.array, hook: HookPoint, rows: np.ndarray = rows, n: int = len(ids)) -> None:
            # Prefill runs in chunks: summing each chunk's share gives the mean; the last chunk
            # holds the last token.
            if position == "mean":
                rows[hook.layer] += np.array(act.sum(axis=0)) / n
            elif hook.positions[-1] == n - 1:
                rows[hook.layer] += np.array(act[-1])

        with model.hooks([(_at(points), record)]):
            model.session().prefill(ids)
    return out


def build(model, target: Sequence[str], control: Sequence[str], component: Component = "ffn",
          position: Literal["last", "mean"] = "last", method: Method = "mean", orthogonalize: bool = True,
          system: str | None = None, think: bool = False, progress: bool = False) -> SteeringVector:
    """A direction per layer separating `target` prompts from `control` prompts (ds4's good and
    bad files): see `collect_activations` and `SteeringVector.from_activations`. A positive
    scale then suppresses what the target prompts share, a negative one amplifies it."""
    options = {"component": component, "position": position, "system": system, "think": think, "progress": progress}
    acts = [collect_activations(model, prompts, **options) for prompts in (target, control)]
    metadata = {"component": "+".join(DS4_COMPONENT[p] for p in component.split("+")), "thinking": think,
                "position": position, "model": str(model.source)}
    return SteeringVector.from_activations(*acts, method=method, orthogonalize=orthogonalize, metadata=metadata)


# ---- applying -------------------------------------------------------------------------------
def _projector(directions: mx.array, scale: float) -> HookFn:
    def fn(act: mx.array, hook: HookPoint) -> mx.array:
        v = directions[hook.layer]
        return act - (scale * (act @ v))[:, None] * v      # ds4: c = s (v . y); y -= c v
    return fn


def _adder(directions: mx.array, scale: float) -> HookFn:
    def fn(act: mx.array, hook: HookPoint) -> mx.array:
        return act + scale * directions[hook.layer]
    return fn


def steering_hooks(vector: SteeringVector, attn: float = 0.0, ffn: float = 1.0,
                   mode: Literal["project", "add"] = "project",
                   layers: Iterable[int] | None = None) -> list[tuple[str, HookFn]]:
    """The (hook name, fn) pairs that apply `vector` (see the module docstring), for
    `model.hooks(...)`. A zero scale adds no hook, so that sublayer runs exactly as unsteered
    (ds4 too leaves its release path alone then). `layers`: the blocks to steer (all when None)."""
    if mode not in ("project", "add"):
        raise ValueError(f"mode must be 'project' or 'add', not {mode!r}")
    chosen = range(vector.n_layer) if layers is None else sorted({int(layer) for layer in layers})
    if any(not 0 <= layer < vector.n_layer for layer in chosen):
        raise ValueError(f"layers {list(chosen)} outside the vector's 0..{vector.n_layer - 1}")
    directions = mx.array(vector.directions)
    make = _projector if mode == "project" else _adder
    hooks = []
    for part, scale in (("attn", attn), ("ffn", ffn)):
        if scale:
            fn = make(directions, float(scale))
            hooks += [(f"blocks.{layer}.{HOOKS[part]}", fn) for layer in chosen]
    return hooks


def steer(model, vector: SteeringVector, attn: float = 0.0, ffn: float = 1.0,
          mode: Literal["project", "add"] = "project", layers: Iterable[int] | None = None) -> AbstractContextManager:
    """`with steer(model, vector, ...)`: `model.steering(...)`; the vector must match the model's
    width and may cover fewer layers than the model has (the rest are not steered)."""
    cfg = model.config
    if vector.n_embd != cfg.n_embd or vector.n_layer > cfg.n_layer:
        raise ValueError(f"a {vector.n_layer} x {vector.n_embd} steering vector does not fit a model of "
                         f"{cfg.n_layer} layers x {cfg.n_embd}")
    return model.hooks(steering_hooks(vector, attn=attn, ffn=ffn, mode=mode, layers=layers))


# ---- sweeps ---------------------------------------------------------------------------------
def _layers_label(layers: Iterable[int] | None) -> str:
    return "all" if layers is None else ",".join(str(layer) for layer in sorted(set(layers)))


def sweep(model, vector: SteeringVector, prompts: Sequence[str], scales: Sequence[float],
          layers: Sequence[Iterable[int] | None] = (None,), component: Literal["attn", "ffn"] = "ffn",
          mode: Literal["project", "add"] = "project", max_tokens: int = 64, sampling: Sampling | None = None,
          system: str | None = None, think: bool = False, progress: bool = False) -> pd.DataFrame:
    """Generate from every prompt (rendered as a chat turn) at every scale and layer set, steering
    `component` only. One row per run: prompt, layers, scale, the text, its length in tokens and
    words, why it stopped, the summed and mean log-prob of the chosen tokens, and `proj_<layer>`:
    the mean over all tokens run (prompt and generated) of v . y at that layer's `component`
    output before the edit (so steering's effect on later layers shows; after a projection
    edit the component is (1 - s) times it)."""
    if component not in HOOKS:
        raise ValueError(f"a sweep steers one component, 'attn' or 'ffn', not {component!r}")
    point = HOOKS[component]
    runs = [(prompt, chosen, scale) for prompt in prompts for chosen in layers for scale in scales]
    if progress:
        from tqdm.auto import tqdm

        runs = tqdm(runs, unit="run", desc="sweep")
    directions = mx.array(vector.directions)
    records = []
    for prompt, chosen, scale in runs:
        total = np.zeros(vector.n_layer)
        count = np.zeros(vector.n_layer)

        def measure(act: mx.array, hook: HookPoint, total: np.ndarray = total, count: np.ndarray = count) -> None:
            if hook.layer < vector.n_layer:
                total[hook.layer] += float((act @ directions[hook.layer]).sum())
                count[hook.layer] += act.shape[0]

        scales = {"attn": scale if component == "attn" else 0.0, "ffn": scale if component == "ffn" else 0.0}
        # The measuring hook is registered first, so it sees each output before the edit.
        with model.hooks([(_at((point,)), measure)]), steer(model, vector, mode=mode, layers=chosen, **scales):
            result = generate(model, _encode(prompt, system, think), max_tokens, sampling or Sampling())
        logprobs = [step.logprob for step in result.steps]
        records.append({
            "prompt": prompt, "layers": _layers_label(chosen), "scale": float(scale), "component": component,
            "mode": mode, "text": result.text, "n_tokens": len(result.tokens), "n_words": len(result.text.split()),
            "finish": result.finish_reason, "logprob": float(np.sum(logprobs)),
            "mean_logprob": float(np.mean(logprobs)) if logprobs else float("nan"),
            **{f"proj_{layer}": value for layer, value in enumerate(total / np.maximum(count, 1))},
        })
    return pd.DataFrame.from_records(records)


def plot_sweep(frame: pd.DataFrame, measure: str = "n_tokens"):
    """Two panels from a `sweep` frame: `measure` against scale (a line per prompt and layer
    set), and the mean projection per layer (a line per scale). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for (prompt, layers), runs in frame.groupby(["prompt", "layers"], sort=False):
        short = prompt if len(prompt) <= 32 else prompt[:31] + "…"
        left.plot(runs["scale"], runs[measure], marker="o", label=f"{short} [{layers}]")
    left.set_xlabel(f"steering scale ({frame['component'].iloc[0]}, {frame['mode'].iloc[0]})")
    left.set_ylabel(measure.replace("_", " "))
    left.set_title(f"{measure.replace('_', ' ')} by scale")
    left.legend(fontsize=7)
    columns = [c for c in frame.columns if c.startswith("proj_")]
    layer_ids = [int(c.removeprefix("proj_")) for c in columns]
    for scale, runs in frame.groupby("scale"):
        right.plot(layer_ids, runs[columns].mean(axis=0).to_numpy(), marker=".", label=f"scale {scale:g}")
    right.axhline(0.0, color="grey", linewidth=0.6)
    right.set_xlabel("layer")
    right.set_ylabel("mean projection v·y (before the edit)")
    right.set_title("component along the direction")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig
