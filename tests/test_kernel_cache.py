"""ds4lab.model.kernel_cache: MLX's names and sources for our kernels, and the cache files.

MLX finds a compiled kernel in its cache by a name made of the kernel's name, its template
values and libstdc++'s std::hash of the generated source, so each of those must be what
MLX 0.30-0.32 makes (mlx/backend/cuda/custom_kernel.cpp, jit_module.cpp): the hash is
checked against a C++ program's std::hash, the source against the layout MLX writes.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from ds4lab.config import preset
from ds4lab.model import Model, kernel_cache, kernels
from ds4lab.model.random_weights import random_weights

_VARIANT = kernel_cache.KernelVariant(
    name="ds4lab_scale", input_names=("x", "factor"), output_names=("y", "count"),
    source="const int i = threadIdx.x;\nif (i < N) y[i] = x[i] * factor[0];\nif (ADD) count[0] = N;",
    header="// a header\n", inputs=((mx.float32, 2), (mx.float32, 0)), output_dtypes=(mx.float32, mx.int32),
    template=(("N", 7), ("ADD", True)))


def test_names_and_source_are_laid_out_as_mlx_builds_them():
    assert _VARIANT.kernel_name == "custom_kernel_ds4lab_scale_7_t"
    assert _VARIANT.mlx_source() == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "// a header\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_ds4lab_scale_7_t(\n"
        "    const float* x,\n"
        "    const float* factor,\n"
        "    float* y,\n"
        "    int32_t* count) {\n"
        "  constexpr int N = 7;\n"
        "  constexpr bool ADD = true;\n"
        "\n"
        "const int i = threadIdx.x;\nif (i < N) y[i] = x[i] * factor[0];\nif (ADD) count[0] = N;"
        "\n}\n\n} // namespace mlx::core::cu\n")
    name = _VARIANT.module_name()
    assert name.startswith("custom_kernel_ds4lab_scale_7_t_") and int(name.rsplit("_", 1)[1], 16) >= 0
    # MLX cuts names longer than 245 characters into folders of 245.
    long = "k" * 600
    assert kernel_cache.cache_path(Path("/c"), long) == Path("/c", "k" * 245, "k" * 245, "k" * 110 + ".ptx")


@pytest.mark.skipif(platform.system() != "Linux", reason="libstdc++'s std::hash (MLX's CUDA build is Linux)")
def test_the_source_hash_is_libstdcxx_std_hash(tmp_path):
    texts = ["", "a", _VARIANT.mlx_source(), "x" * 1000]
    program = tmp_path / "hash.cpp"
    program.write_text('#include <iostream>\n#include <string>\nint main() { std::string line, all; '
                       'while (std::getline(std::cin, line, \'\\0\')) std::cout << std::hash<std::string>{}(line) '
                       '<< "\\n"; }\n')
    subprocess.run([os.environ.get("CXX", "c++"), str(program), "-o", str(tmp_path / "hash")], check=True)
    out = subprocess.run([str(tmp_path / "hash")], input="\0".join(texts[1:]) + "\0", capture_output=True,
                         text=True, check=True).stdout.split()
    assert [kernel_cache.std_hash(t) for t in texts[1:]] == [int(v) for v in out]


def test_fill_compiles_into_mlx_s_cache_files_once(tmp_path):
    nvrtc = kernel_cache.default_nvrtc()
    broken = kernel_cache.KernelVariant(**{**_VARIANT.__dict__, "source": "y[0] = missing;"})
    first = kernel_cache.fill([_VARIANT, broken], nvrtc, tmp_path, arch="compute_90a", threads=2)
    assert first[0][1] == "compiled" and "missing" in first[1][1]
    path = kernel_cache.cache_path(tmp_path, _VARIANT.module_name())
    assert path.read_bytes().startswith(b"//") and b".entry" in path.read_bytes()       # PTX
    name, mangled = path.with_suffix(".txt").read_text().rstrip("\n").split("\t")
    assert name == "mlx::core::cu::custom_kernel_ds4lab_scale_7_t" and "custom_kernel_ds4lab_scale_7_t" in mangled
    assert mangled.encode() in path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.with_suffix(".txt").name])
    assert kernel_cache.fill([_VARIANT], nvrtc, tmp_path, arch="compute_90a")[0][1] == "cached"


def test_precompiled_headers_change_no_byte_of_the_code():
    """`-pch` (NVRTC 12.4+, which the dev extra installs) only caches the parsed headers: a
    real kernel's PTX is the same with it and without it."""
    from ds4lab.model.weights import Q8Matrix

    nvrtc = kernel_cache.default_nvrtc()
    assert nvrtc.precompiled_headers, nvrtc.version
    with kernel_cache.recorded_variants() as variants:
        q8 = Q8Matrix(mx.zeros((64, 128), mx.uint32), mx.zeros((64, 16)), mx.zeros((64, 16)), 64, 512)
        kernels.q8_pair(q8, q8, mx.ones((1, 512)), norm_a=(mx.ones((64,)), 1e-6))
    source = variants[0].mlx_source()
    first, _, log = nvrtc.compile(source, "k.cu", "compute_90a")
    again, _, _ = nvrtc.compile(source, "k.cu", "compute_90a")        # from the precompiled headers
    nvrtc.precompiled_headers = False
    plain, _, _ = nvrtc.compile(source, "k.cu", "compute_90a")
    assert first is not None, log
    assert first == again == plain


def test_a_recorded_run_after_another_lists_the_same_kernels():
    """Every cached kernel object is dropped between recorded runs (`kernels._kernel_maker`):
    one made under an earlier run's stub would answer the later run's launches unrecorded."""
    weights = random_weights(preset("tiny"), "q2", seed=2)
    names = []
    for _ in range(2):
        with kernel_cache.recorded_variants() as variants:
            session = Model(weights).session()
            session.prefill([5, 6, 7, 8])
            mx.eval(session.decode(9))
        names.append({v.name for v in variants})
    assert names[0] and names[1] == names[0], names


def test_a_recorded_run_lists_the_step_s_kernels_and_leaves_mlx_as_it_was():
    original, ready = mx.fast.cuda_kernel, kernels.cuda_ready()
    weights = random_weights(preset("tiny"), "q2", seed=2)
    with kernel_cache.recorded_variants() as variants:
        session = Model(weights).session()
        session.prefill([5, 6, 7, 8])
        mx.eval(session.decode(9))
    assert mx.fast.cuda_kernel is original and kernels.cuda_ready() == ready
    names = {v.name for v in variants}
    assert {"ds4lab_hc_pre", "ds4lab_q8_hc", "ds4lab_attention_heads"} <= names, names
    # (the router and the gate and up on the input's planes: `Model.expert_planes`, the default)
    assert "ds4lab_router_planes" in names, names
    assert any(name.startswith("ds4lab_expert_swiglu_planes_") for name in names), names
    assert len(set(variants)) == len(variants)
    assert all(isinstance(ndim, int) for v in variants for _, ndim in v.inputs)


def test_std_hash_covers_bytes_past_a_nul():
    """The hash covers the whole text (its length is passed: a NUL does not end it)."""
    assert kernel_cache.std_hash("ab\0cd") != kernel_cache.std_hash("ab")


def test_precompiled_headers_stay_out_of_the_working_directory(tmp_path, monkeypatch):
    """NVRTC's `-pch` writes `<file name>.pch` as it compiles, by default in the working
    directory, where compiles of one file name at once (one kernel's variants on a thread
    pool, test processes side by side) deleted each other's file. Each thread has its own
    folder now: nothing lands in the working directory, and one name compiles on 4 threads."""
    from concurrent.futures import ThreadPoolExecutor

    nvrtc = kernel_cache.default_nvrtc()
    assert nvrtc.precompiled_headers, nvrtc.version
    monkeypatch.chdir(tmp_path)
    source = _VARIANT.mlx_source()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: nvrtc.compile(source, "same.cu", "compute_90a"), range(8)))
    assert all(code is not None for code, _, _ in results), [log for code, _, log in results if code is None]
    assert list(tmp_path.iterdir()) == []
