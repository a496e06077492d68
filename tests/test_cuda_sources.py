"""Every CUDA kernel the fast path launches compiles, as MLX would compile it, on the CPU.

A kernel source that does not compile only shows on a GPU machine, where device time is
scarce. Here a tiny model prefills a chunk and decodes on the CPU with `mx.fast.cuda_kernel`
replaced by a recorder (each launch's outputs from test_fast_path's stand-ins, so the model
runs its real fast-path branches): every launch is kept as a `kernel_cache.KernelVariant`.
Each distinct one is then compiled from the source MLX's CUDA back-end would generate for it
(`KernelVariant.mlx_source`: its default header, a `__global__` function of typed pointers,
the templates as constexprs) with NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel of the dev
extra, with the CUDA runtime and CCCL wheels' headers) for an H100/H200 (compute_90a), with
MLX's NVRTC options (`kernel_cache.Nvrtc`).
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from test_fast_path import (
    STAND_INS,
    _expert_matvec,
    _expert_swiglu,
    _expert_swiglu_planes,
    _launcher,
    _q8_hc_routed,
    _quant_gemm,
    _routed_swiglu,
)

from ds4lab.model import Model, kernel_cache, kernels
from ds4lab.model.weights import ExpertBlocks, Q8Matrix
from ds4lab.quants.formats import row_bytes


def compile_log(nvrtc: kernel_cache.Nvrtc, variant: kernel_cache.KernelVariant) -> str | None:
    """None when NVRTC compiles the variant's source as MLX generates it, else its log."""
    code, _, log = nvrtc.compile(variant.mlx_source(), f"{variant.name}.cu", "compute_90a")
    return None if code is not None else log


def _stand_in(short: str):
    """The stand-in of a kernel named ds4lab_<short>, and its name for `_launcher`."""
    types = {v: k for k, v in kernels._TYPES.items()} | {"q8_0": "Q8_0"}
    if short == "expert_swiglu_planes_iq2_xxs":
        return "expert_swiglu_planes", _expert_swiglu_planes
    for prefix, make in (("expert_swiglu_", _expert_swiglu), ("expert_matvec_", _expert_matvec),
                         ("routed_swiglu_", _routed_swiglu), ("quant_gemm_", _quant_gemm),
                         ("q8_hc_", _q8_hc_routed)):
        if short.startswith(prefix):
            return prefix[:-1], make(types[short.removeprefix(prefix)])
    return short, STAND_INS[short]


@pytest.fixture
def recorded_launches(monkeypatch, batched):
    """The fast path on the CPU with `mx.fast.cuda_kernel` recording; returns the launches."""
    monkeypatch.setattr(kernels, "cuda_ready", lambda: True)
    launches: list[kernel_cache.KernelVariant] = []

    def cuda_kernel(*, name, input_names, output_names, source, header=""):
        key, emulate = _stand_in(name.removeprefix("ds4lab_"))
        # a variant without some operands (`kernels._launch`): the stand-in sees them as zeros
        _, _, all_inputs, all_outputs = kernels._KERNELS.get(key, (None, None, input_names, output_names))
        absent = tuple((n, mx.float32, False) for n in all_inputs if n not in input_names) + tuple(
            (n, mx.float32, True) for n in all_outputs if n not in output_names)
        run = _launcher(key, emulate, {}, absent)

        def launch(**kwargs):
            launches.append(kernel_cache.KernelVariant(
                name, tuple(input_names), tuple(output_names), source, header,
                tuple((x.dtype, x.ndim) for x in kwargs["inputs"]), tuple(kwargs["output_dtypes"]),
                tuple(kwargs.get("template", ()))))
            return run(**kwargs)
        return launch

    kernels.forget_kernel_objects()
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    yield launches
    kernels.forget_kernel_objects()


# Integer templates that choose a code path, as the boolean ones do.
_PATH_TEMPLATES = {"SPLIT", "SPLIT_C", "PRE_SPLIT"}


def _code_paths(launches: list[dict]) -> dict:
    """One launch per kernel, input types and set of boolean templates (each its own code
    path; so is each SPLIT), the one of largest sizes among them (the largest static shared arrays): an NVRTC
    compile takes 0.5-2 s on CI's 2 cores (less once NVRTC's precompiled headers are made), and
    other sizes only change constants."""
    chosen: dict = {}
    for launch in launches:
        flags = tuple((k, v) for k, v in launch.template if isinstance(v, bool) or k in _PATH_TEMPLATES)
        key = (launch.name, flags, tuple(str(dtype) for dtype, _ in launch.inputs))
        size = math.prod(v for _, v in launch.template if not isinstance(v, bool) and v > 0)
        if key not in chosen or size > chosen[key][0]:
            chosen[key] = (size, launch)
    return {key: launch for key, (_, launch) in chosen.items()}


def test_every_launched_kernel_compiles_with_nvrtc(recorded_launches, nvrtc, tiny_weights):
    model = Model(tiny_weights)
    session = model.session()
    logits = session.prefill([(37 * i + 11) % 900 + 100 for i in range(40)])
    for _ in range(6):
        logits = session.decode(int(mx.argmax(logits).item()))
    # Every block format's expert kernels, not only the model's: zero bytes of 3 experts,
    # 5 rows (odd: the matvec's last warp has one row) of 512 columns.
    x, ids = mx.ones((1, 512)), mx.array([[0, 2]], mx.int32)
    for type_name in kernels._TYPES:
        blocks = ExpertBlocks(mx.zeros((3, 5 * row_bytes(type_name, 512)), mx.uint8), type_name, 5, 512)
        kernels.expert_swiglu(blocks, blocks, ids, x, mx.ones((1, 2)), 0.0)
        kernels.expert_matvec(blocks, ids, x, pairs_per_input=2)
        # with the router inside (E = 40 over 128 threads, biased top-2; a hash layer's rows),
        # and the shared expert's rows in the launch
        shared = Q8Matrix(mx.zeros((5, 128), mx.uint32), mx.zeros((5, 16)), mx.zeros((5, 16)), 5, 512)
        for route in (kernels.Route(mx.ones((40, 512)), mx.zeros((40,)), 1.5, 2),
                      kernels.Route(mx.ones((40, 512), mx.float16), None, 1.5, 2,
                                    (mx.zeros((100, 2), mx.int32), mx.array([7], mx.int32)))):
            kernels.routed_swiglu(blocks, blocks, x, route, 0.0, (shared, shared))
    # The Q8_0 products on matrices of a few thousand rows and columns, whose warps split the
    # columns (SPLIT): zero codes of 4096 x 2048, as the model's shared expert and HC output.
    q8 = Q8Matrix(mx.zeros((4096, 512), mx.uint32), mx.zeros((4096, 64)), mx.zeros((4096, 64)), 4096, 2048)
    x = mx.ones((1, 2048))
    streams, post, comb = mx.ones((1, 4, 4096)), mx.ones((1, 4)), mx.ones((1, 4, 4))
    kernels.q8_matvec(q8, x)
    kernels.q8_pair(q8, q8, x)
    kernels.q8_pair(q8, q8, x, norm_a=(mx.ones((4096,)), 1e-6))
    # and with q_b's product of the norm: C's warps splitting its columns, and not
    c_split = Q8Matrix(mx.zeros((2048, 1024), mx.uint32), mx.zeros((2048, 128)), mx.zeros((2048, 128)), 2048, 4096)
    kernels.q8_pair(q8, q8, x, norm_a=(mx.ones((4096,)), 1e-6), then=(c_split, (1, 2048)))
    q8_a = Q8Matrix(mx.zeros((512, 512), mx.uint32), mx.zeros((512, 64)), mx.zeros((512, 64)), 512, 2048)
    c_rows = Q8Matrix(mx.zeros((16384, 128), mx.uint32), mx.zeros((16384, 16)), mx.zeros((16384, 16)), 16384, 512)
    kernels.q8_pair(q8_a, q8_a, x, norm_a=(mx.ones((512,)), 1e-6), then=(c_rows, (1, 32, 512)))
    # and with a layer's compressor update in the launch: a ratio-4 layer's two (F16 weights, as
    # the file's; the window completed: SHIFT), a ratio-128 layer's one (float32), each with q_b
    # and without
    def compressor(width: int, rows: int, ratio: int, dtype) -> tuple[mx.array, ...]:
        return (mx.ones((width, 2048), dtype), mx.ones((width, 2048), dtype), mx.ones((ratio, width)),
                mx.zeros((rows, width)), mx.zeros((rows, width)))
    for slots in (kernels.CompressorSlots(compressor(1024, 8, 4, mx.float16), compressor(256, 8, 4, mx.float16),
                                          kernels.slot_at(7, 3), True),
                  kernels.CompressorSlots(compressor(512, 128, 128, mx.float32), None, kernels.slot_at(5, 5), False)):
        kernels.q8_pair(q8, q8, x, norm_a=(mx.ones((4096,)), 1e-6), slots=slots)
        kernels.q8_pair(q8, q8, x, norm_a=(mx.ones((4096,)), 1e-6), then=(c_split, (1, 2048)), slots=slots)
    # a ratio-128 layer's emitted row pooled and finished, and a row pooled only (check_device's)
    front = (mx.zeros((128, 512)), mx.zeros((128, 512)))
    row = kernels.EmittedRow(front, front, 512, (mx.ones((512,)), 1e-6, False, True))
    kernels.compressor_pool([row], 128, False, (mx.ones((8192, 32)), mx.ones((8192, 32)), 4095))
    kernels.compressor_pool([row._replace(steps=None)], 128, False)
    kernels.q8_swiglu(q8, q8, x, 0.0)
    kernels.q8_hc(q8, x, mx.ones((1, 6, 4096)), mx.ones((1, 6)), mx.ones((1, 6, 6)))   # more streams than a split
    nxt = kernels.HCInput(mx.ones((24, 4 * 4096)), mx.ones((3,)), mx.ones((24,)), mx.ones((4096,)), 20, 1e-6, 1e-6)
    kernels.q8_hc(q8, x, streams, post, comb, next_input=nxt)
    # and with the grouped output product made first in the launch: the flash shape's (its
    # warps splitting the columns), and one whose warps take whole rows
    out_a = Q8Matrix(mx.zeros((8192, 1024), mx.uint32), mx.zeros((8192, 128)), mx.zeros((8192, 128)), 8192, 4096)
    out_b = Q8Matrix(mx.zeros((4096, 2048), mx.uint32), mx.zeros((4096, 256)), mx.zeros((4096, 256)), 4096, 8192)
    kernels.q8_hc(out_b, mx.ones((1, 64, 512)), streams, post, comb, next_input=nxt, pre=(out_a, 8))
    wide = Q8Matrix(mx.zeros((16384, 128), mx.uint32), mx.zeros((16384, 16)), mx.zeros((16384, 16)), 16384, 512)
    narrow = Q8Matrix(mx.zeros((512, 4096), mx.uint32), mx.zeros((512, 512)), mx.zeros((512, 512)), 512, 16384)
    nxt_512 = kernels.HCInput(mx.ones((24, 4 * 512)), mx.ones((3,)), mx.ones((24,)), mx.ones((512,)), 20, 1e-6, 1e-6)
    kernels.q8_hc(narrow, mx.ones((1, 2, 512)), mx.ones((1, 4, 512)), post, comb, next_input=nxt_512, pre=(wide, 2))
    # and with a token's routed down products beside its rows, in each block format
    for type_name in kernels._TYPES:
        down = ExpertBlocks(mx.zeros((2, 4096 * row_bytes(type_name, 2048)), mx.uint8), type_name, 4096, 2048)
        routed = kernels.RoutedDown(down, mx.array([[0, 1, 1, 0, 1, 0]], mx.int32), mx.ones((1, 6, 2048)))
        kernels.q8_hc(q8, x, streams, post, comb, add=routed, next_input=nxt)
    # Decode attention over 1152 keys (a ratio-4 layer at 4096 tokens): shares of the keys.
    q, rope = mx.ones((1, 64, 512)), (mx.ones((1, 32)), mx.zeros((1, 32)))
    # The flash shape's indexer queries (also without their rounding, as check_device runs
    # them) and its router with the logits made inside.
    for qat in (True, False):
        kernels.indexer_queries(mx.ones((1, 1024)), mx.ones((1024,)), 1e-6, mx.ones((1, 4096)),
                                mx.ones((8192, 1024)), mx.ones((64, 4096)), rope, 64, qat=qat)
    kernels.router(mx.ones((1, 4096)), mx.zeros((256,)), 6, 1.5, weight=mx.ones((256, 4096)))
    kernels.router(mx.ones((1, 4096)), None, 6, 1.5, weight=mx.ones((256, 4096)),
                   hashed=(mx.zeros((100, 6), mx.int32), mx.array([7], mx.int32)))
    # and writing the input's byte planes, which the IQ2_XXS gate and up then read (with the
    # shared expert's rows in the launch and without)
    planes = kernels.router_planes(mx.ones((1, 4096)), mx.zeros((256,)), 6, 1.5, mx.ones((256, 4096)))[3]
    iq2 = ExpertBlocks(mx.zeros((3, 5 * row_bytes("IQ2_XXS", 4096)), mx.uint8), "IQ2_XXS", 5, 4096)
    shared_4096 = Q8Matrix(mx.zeros((5, 1024), mx.uint32), mx.zeros((5, 128)), mx.zeros((5, 128)), 5, 4096)
    for shared in (None, (shared_4096, shared_4096)):
        kernels.expert_swiglu(iq2, iq2, mx.array([[0, 2]], mx.int32), mx.ones((1, 4096)), mx.ones((1, 2)), 0.0,
                              shared, planes)
    for eps in (None, 1e-6):
        kernels.attention_heads(q, mx.ones((128, 512)), mx.ones((1, 1152), mx.bool_), mx.zeros((64,)), rope,
                                mx.ones((1024, 512)), q_eps=eps)
    # and with the token's KV row finished inside (the decode step's form), over 1152 keys too
    kernels.attention_heads(q, mx.ones((127, 512)), mx.ones((1, 1152), mx.bool_), mx.zeros((64,)), rope,
                            mx.ones((1024, 512)), q_eps=1e-6, kv_row=(mx.ones((1, 512)), mx.ones((512,)), 1e-6))
    distinct = _code_paths(recorded_launches)
    names = {launch.name for launch in distinct.values()}
    # The step's kernels and a chunk's: the fused ones, an expert format's pair, the GEMM.
    assert {"ds4lab_hc_pre", "ds4lab_hc_mix", "ds4lab_q8_hc", "ds4lab_attention_heads", "ds4lab_attention_shares",
            "ds4lab_prefill_attention", "ds4lab_router", "ds4lab_indexer_queries", "ds4lab_router_planes",
            "ds4lab_expert_swiglu_planes_iq2_xxs"} <= names, names
    experts = {f"ds4lab_{kind}_{name}" for kind in ("expert_swiglu", "expert_matvec", "routed_swiglu", "q8_hc")
               for name in kernels._TYPES.values()}
    assert experts <= names, names
    assert any(n.startswith("ds4lab_quant_gemm_") for n in names)
    split = {launch.name for launch in distinct.values() if ("SPLIT", kernels._Q8_WARPS) in launch.template}
    assert split == {"ds4lab_q8_matvec", "ds4lab_q8_pair", "ds4lab_q8_swiglu", "ds4lab_q8_hc",
                     *(f"ds4lab_q8_hc_{name}" for name in kernels._TYPES.values())}, split
    with ThreadPoolExecutor(4) as pool:
        logs = list(pool.map(lambda launch: compile_log(nvrtc, launch), distinct.values()))
    failed = [f"{launch.name} {launch.template}:\n{log[:2000]}"
              for launch, log in zip(distinct.values(), logs, strict=True) if log is not None]
    assert not failed, "\n\n".join(failed)


def test_the_compile_check_catches_a_broken_source(nvrtc):
    """The check can fail: a kernel body with an undeclared name does not compile."""
    broken = kernel_cache.KernelVariant("ds4lab_broken", ("x",), ("y",), "y[0] = x[0] * N + missing;", "",
                                        ((mx.float32, 1),), (mx.float32,), (("N", 4),))
    log = compile_log(nvrtc, broken)
    assert log is not None and "missing" in log
    assert compile_log(nvrtc, dataclasses.replace(broken, source="y[0] = x[0] * N;")) is None
