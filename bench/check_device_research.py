"""On a GPU: the research paths added for the KV files, steering and imatrix behave as on the CPU.

Runs the tiny synthetic model on the GPU and on the CPU. Routing on a tiny random model is
near-tied, so the GPU's experts are pinned to the CPU's choice (through `ffn.hook_experts`)
wherever the two devices are compared. The devices still differ upstream (MLX's CUDA GEMMs
and the indexer's near-tied top-k: about 0.5-1% rms at the FFN input of the later layers on
an H200), so the checks ask that the new paths add no error of their own:
- `ffn.hook_routed_mid` (route-weighted SwiGLU activations): its GPU-CPU rms difference is at
  most twice the shared expert's, which reads the same input;
- steering at scale 1 leaves no component along the direction at the hooked output;
- imatrix collection: the same counts, and each entry's sums of squares within four times
  the rms difference of the activations it sums (FFN input, or routed mid for down);
- a replacement at a block boundary (`attn.hook_out` of the last block) keeps every block on
  the fast path and changes the logits as on the reference path (the two effects within the
  paths' own unedited difference, at least 1e-4 of the logits' std);
- a session saved to .kv on the GPU and loaded again on the GPU continues exactly as the
  uninterrupted GPU session; the file loads and runs on the CPU.

    python bench/check_device_research.py
"""

from __future__ import annotations

import tempfile

import ds4lab

# isort: split
import mlx.core as mx
import numpy as np

from ds4lab import generation
from ds4lab.paths import synthetic_model
from ds4lab.quants import imatrix
from ds4lab.steering import SteeringVector

GPU = mx.gpu if mx.is_available(mx.gpu) else mx.cpu  # without a GPU the script checks itself, CPU vs CPU


def on(device, fn):
    with mx.stream(device):
        return fn()


def rms_rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(((a - b) ** 2).mean() / max((b ** 2).mean(), 1e-300)))


def report(name: str, value: float, bound: float) -> bool:
    ok = value <= bound
    print(f"{name:52s} {value:.2e} (bound {bound:.2e})  {'ok' if ok else 'FAIL'}")
    return ok


def main() -> None:
    path = synthetic_model("tiny", "q2", seed=0)
    model = ds4lab.load(path)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(1000, 60000, size=160)]
    layer = 4
    results = []
    _, routed = on(mx.cpu, lambda: model.run_with_cache(tokens, lambda n: n.endswith("ffn.hook_experts")))
    pin = [(lambda n: n.endswith("ffn.hook_experts"),
            lambda act, hook: mx.array(routed[hook.name][np.asarray(hook.positions)]).astype(act.dtype))]

    points = [f"blocks.{layer}.ffn.{p}" for p in ("hook_in", "hook_routed_mid", "hook_shared_out")]

    def run():
        with model.hooks(pin):
            _, cache = model.run_with_cache(tokens, points)
        return cache

    gpu, cpu = on(GPU, run), on(mx.cpu, run)
    err = {p.rsplit(".", 1)[1]: rms_rel(gpu[p], cpu[p]) for p in points}
    print(f"layer {layer} FFN input, GPU vs CPU rms difference: {err['hook_in']:.2e}")
    results.append(report("hook_routed_mid rms diff (bound: 2x shared expert's)", err["hook_routed_mid"],
                          2 * err["hook_shared_out"] + 1e-6))

    direction = np.zeros((model.config.n_layer, model.config.n_embd), np.float32)
    direction[layer] = rng.standard_normal(model.config.n_embd)
    direction[layer] /= np.linalg.norm(direction[layer])
    vector = SteeringVector(direction)

    def steered():
        with model.steering(vector, attn=0.0, ffn=1.0):
            _, cache = model.run_with_cache(tokens, [f"blocks.{layer}.ffn.hook_out"])
        out = cache[f"blocks.{layer}.ffn.hook_out"]
        return out @ direction[layer]

    component = on(GPU, steered)
    results.append(report("steering s=1: max |component along v|", float(np.abs(component).max()), 1e-4))

    def collected():
        with model.hooks(pin):
            entries = imatrix.collect(model, [tokens]).entries
        return {k: entries[k] for k in sorted(entries)}

    gpu_m, cpu_m = on(GPU, collected), on(mx.cpu, collected)
    counts_equal = all(np.array_equal(gpu_m[k].counts, cpu_m[k].counts) for k in cpu_m)
    print(f"{'imatrix counts equal':52s} {counts_equal}")
    results.append(counts_equal)

    def entry_inputs():
        with model.hooks(pin):
            _, cache = model.run_with_cache(tokens, lambda n: n.endswith(("ffn.hook_in", "ffn.hook_routed_mid")))
        return cache

    # Each entry's sums against the difference of the very activations it sums (the devices
    # drift apart layer by layer, most after near-tied indexer choices): the FFN input for
    # gate and up, the routed mid for down, whose drift can be several times its layer input's.
    gpu_in, cpu_in = on(GPU, entry_inputs), on(mx.cpu, entry_inputs)
    sums = {k: rms_rel(gpu_m[k].sum2, cpu_m[k].sum2) for k in cpu_m}
    point = {k: f"blocks.{k.split('.')[1]}.ffn.{'hook_routed_mid' if 'ffn_down' in k else 'hook_in'}" for k in cpu_m}
    inputs = {k: rms_rel(gpu_in[point[k]], cpu_in[point[k]]) for k in cpu_m}
    worst = max(cpu_m, key=lambda k: sums[k] / (4 * inputs[k] + 1e-6))
    print(f"{'imatrix worst entry':52s} {worst}: sum2 diff {sums[worst]:.2e}, "
          f"its input's diff {inputs[worst]:.2e}")
    results.append(report("imatrix sum2 rms diff / 4x its input's diff", sums[worst] / (4 * inputs[worst] + 1e-6),
                          1.0))

    # The edit sits in the last block: what runs after it (that block's FFN with pinned
    # experts, the head) has no FP8 rounding, so each path's edited and unedited runs share
    # everything upstream. (Earlier in the stack
    # ds4's FP8 KV rounding turns the paths' 1e-6 float-order difference into whole FP8 steps
    # on a tiny random model, and both the edit and the paths' own gap become that noise.)
    last = model.config.n_layer - 1

    def logits_with(fast: bool, edit: bool):
        model.numerics.allow_fast = fast
        scale = [(f"blocks.{last}.attn.hook_out", lambda act, hook: act * 1.5)] if edit else []
        try:
            with model.hooks([*pin, *scale]):
                return model.fast_path_plan(), np.array(model(tokens[:48]))
        finally:
            model.numerics.allow_fast = True

    plan, fast_edit = on(GPU, lambda: logits_with(True, True))
    ref_edit, fast_plain, ref_plain = (on(GPU, lambda f=f, e=e: logits_with(f, e))[1]
                                       for f, e in ((False, True), (True, False), (False, False)))
    std = ref_plain.std()
    path_gap = float(np.abs(fast_plain - ref_plain).max() / std)
    print(f"{'boundary hook: blocks on the fast path':52s} {int((plan.path == 'fast').sum())} of {len(plan)}")
    print(f"{'boundary hook: its effect on the logits / std':52s} {np.abs(ref_edit - ref_plain).max() / std:.2e}")
    print(f"{'fast vs reference path, unedited, max diff / std':52s} {path_gap:.2e}")
    # The edit's effect passes through nonlinear steps at inputs that already differ between
    # the paths by their gap, so the effects may differ by up to about that gap; a fast path
    # that dropped or misplaced the replacement would differ by the whole effect.
    results.append(report("boundary hook: effect, fast vs reference, max diff / std",
                          float(np.abs((fast_edit - fast_plain) - (ref_edit - ref_plain)).max() / std),
                          max(path_gap, 1e-4)))

    # The greedy stream (a worker thread encodes its steps) straight after a prefill, with no
    # plain step before it to launch the decode's kernels first: the tokens of plain decoding.
    def streamed():
        session = model.session()
        session.prefill(tokens)
        return [step.token for step in generation.stream(model, [], max_tokens=8, session=session)]

    def plain():
        session = model.session()
        out, logits = [], session.prefill(tokens)
        for _ in range(8):
            out.append(int(mx.argmax(logits).item()))
            logits = session.decode(out[-1])
        return out

    results.append(on(GPU, streamed) == on(GPU, plain))
    print(f"{'greedy stream straight after a prefill: plain tokens':52s} {results[-1]}")

    folder = tempfile.mkdtemp()

    def save():
        session = model.session()
        session.prefill(tokens)
        return session.save_kv(folder, ctx_size=4096)

    saved = on(GPU, save)

    def continue_from(p):
        session = model.session()
        session.load_kv(p)
        return np.array(session.decode(1234))

    def uninterrupted():
        session = model.session()
        session.prefill(tokens)
        return np.array(session.decode(1234))

    results.append(report(".kv saved and continued on GPU vs uninterrupted", rms_rel(
        on(GPU, lambda: continue_from(saved)), on(GPU, uninterrupted)), 0.0))
    results.append(np.isfinite(on(mx.cpu, lambda: continue_from(saved))).all())
    print(f"{'.kv saved on GPU, continued on CPU: finite logits':52s} {results[-1]}")
    print("all ok" if all(results) else "SOME CHECKS FAILED")


if __name__ == "__main__":
    main()
