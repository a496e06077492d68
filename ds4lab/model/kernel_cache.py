"""MLX's kernel cache filled ahead of time: the fast path's CUDA kernels compiled in parallel.

MLX's CUDA back-end compiles a custom kernel with NVRTC the first time a process launches
each variant of it (its source with one set of templates and input types). It compiles on
the thread that encodes the graph, one variant at a time, and for custom kernels it never
writes the result to its disk cache, although it reads that cache before compiling. The
43-layer fast path meets ~50 variants, so every new process spent 1.5-2 minutes compiling
before its first tokens at full speed.

This module fills that cache itself:
- `recorded_variants()` runs the fast path with every launch recorded, and returns zeros
  in its place, so that a prefill and a few decode steps list the variants a real run
  launches without a GPU.
- `KernelVariant.mlx_source()` rebuilds the source MLX generates for a launch
  (mlx/backend/cuda/custom_kernel.cpp `build_kernel`, MLX 0.30-0.32), and
  `KernelVariant.module_name()` MLX's name for its compiled module: the kernel name, then
  libstdc++'s `std::hash` of that source in hex.
- `fill()` compiles the variants with NVRTC on a thread pool, for the GPU's architecture,
  and writes each one where MLX looks first: `<cache>/<module name>.ptx`, holding the
  cubin, and `.txt`, the kernel's name and its mangled symbol.
The cache is `MLX_PTX_CACHE_DIR`, else `<tmp>/mlx/<MLX version>/ptx`. A variant missing
from it, or named differently by another MLX version, is compiled by MLX as before: a
mismatch costs time, never correctness. The NVRTC compile is the one MLX runs (its options,
its source) except MLX's device header, which only brings in the CUDA headers our sources
use: they are the only ones these kernels need.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import kernels, numerics, rope, state

# What MLX's default header would bring in for our sources (its device utilities include
# these); NVRTC is given it under the name MLX's generated source includes.
MLX_DEVICE_HEADER_NAME = "mlx/backend/cuda/device/utils.cuh"
MLX_DEVICE_HEADER = "".join(f"#include <{h}>\n" for h in (
    "cuda_fp16.h", "cuda_bf16.h", "cuda/std/complex", "cuda/std/limits", "cuda/std/array", "cuda/std/cstdint"))
_DEFAULT_HEADER = f'\n#include "{MLX_DEVICE_HEADER_NAME}"\n\n#include <cooperative_groups.h>\n\n'
_HASH_SEED = 0xC70F6907                 # libstdc++'s seed of std::hash<std::string>
_MAX_FILE_NAME = 245                    # MLX splits longer module names into folders


@dataclass(frozen=True)
class KernelVariant:
    """One compiled form of a custom kernel: what `mx.fast.cuda_kernel` was given and how it
    was launched (input types and ranks, output types, templates in the order passed)."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    inputs: tuple[tuple[mx.Dtype, int], ...]        # (dtype, ndim) of each input
    output_dtypes: tuple[mx.Dtype, ...]
    template: tuple[tuple[str, int | bool], ...]

    @property
    def kernel_name(self) -> str:
        """MLX's name of the `__global__` function: the name, then each template's value."""
        values = "".join(f"_{'t' if v else 'f'}" if isinstance(v, bool) else f"_{v}" for _, v in self.template)
        return f"custom_kernel_{self.name}{values}"

    def mlx_source(self) -> str:
        """The source MLX hands NVRTC for this variant, byte for byte."""
        params = []
        for name, (dtype, ndim) in zip(self.input_names, self.inputs, strict=True):
            params.append(f"    const {kernels.CUDA_TYPES[dtype]}* {name},\n")
            if ndim > 0:
                for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                    if name + suffix in self.source:
                        params.append(f"    const __grid_constant__ {kind} {name}{suffix},\n")
        outputs = [f"    {kernels.CUDA_TYPES[dtype]}* {name}"
                   for name, dtype in zip(self.output_names, self.output_dtypes, strict=True)]
        constants = "".join(f"  constexpr bool {k} = {str(v).lower()};\n" if isinstance(v, bool)
                            else f"  constexpr int {k} = {v};\n" for k, v in self.template)
        return (_DEFAULT_HEADER + self.header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                f"__global__ void {self.kernel_name}(\n" + "".join(params) + ",\n".join(outputs) + ") {\n"
                + (constants + "\n" if constants else "") + self.source + "\n}\n\n} // namespace mlx::core::cu\n")

    def module_name(self) -> str:
        """MLX's name of the compiled module: `<kernel name>_<std::hash(source) in hex>`."""
        return f"{self.kernel_name}_{std_hash(self.mlx_source()):x}"


def std_hash(text: str) -> int:
    """libstdc++'s `std::hash<std::string>` of `text` (its exported `std::_Hash_bytes`)."""
    data = text.encode()
    hash_bytes = _libstdcxx()._ZSt11_Hash_bytesPKvmm
    hash_bytes.restype, hash_bytes.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return hash_bytes(data, len(data), _HASH_SEED)


def _libstdcxx() -> ctypes.CDLL:
    return ctypes.CDLL("libstdc++.so.6")


def cache_dir() -> Path:
    """Where MLX looks for compiled kernels: MLX_PTX_CACHE_DIR, else <tmp>/mlx/<version>/ptx."""
    if path := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(path).absolute()
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def cache_path(directory: Path, module_name: str) -> Path:
    """The `.ptx` file of a module (MLX cuts names over 245 characters into folders)."""
    path, rest = Path(directory), module_name
    while len(rest) > _MAX_FILE_NAME:
        path, rest = path / rest[:_MAX_FILE_NAME], rest[_MAX_FILE_NAME:]
    return path / f"{rest}.ptx"


@functools.lru_cache(maxsize=1024)
def _host_zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    return mx.array(np.zeros(shape, np.dtype(str(dtype).rsplit(".", 1)[-1])))


@contextlib.contextmanager
def recorded_variants(record: bool = True) -> Iterator[list[KernelVariant]]:
    """The fast path on, as on a CUDA GPU (its kernels, and the GPU's batched schedule), each
    kernel launch answered with zeros of its output shapes (one `Depends` primitive on its
    inputs) and, with `record`, recorded: the
    list holds the distinct variants launched inside the `with`, in first-launch order, once
    it exits. Without `record` what is left of a step is its Python build
    (`bench/step_build.py`)."""
    seen: dict[KernelVariant, None] = {}

    def cuda_kernel(*, name, input_names, output_names, source, header="", **_):
        def launch(*, inputs, output_shapes, output_dtypes, template=(), **_):
            if record:
                seen.setdefault(KernelVariant(name, tuple(input_names), tuple(output_names), source, header,
                                              tuple((x.dtype, x.ndim) for x in inputs), tuple(output_dtypes),
                                              tuple(template)))
            # Host arrays of zeros (made once a shape: a launch copies no host bytes), tied to the
            # inputs: a step's graph keeps its edges and has one primitive per launch
            # (`bench/step_build.py --count`), as with the real kernels.
            zeros = [_host_zeros(tuple(shape), dtype)
                     for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]
            return mx.depends(zeros, list(inputs))
        return launch

    patched = [(mx.fast, "cuda_kernel", cuda_kernel), (kernels, "cuda_ready", lambda: True),
               *((module, "batch_invariant_device", lambda: False) for module in (numerics, state, rope))]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    kernels.forget_kernel_objects()
    for module, name, value in patched:
        setattr(module, name, value)
    variants: list[KernelVariant] = []
    try:
        yield variants
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        kernels.forget_kernel_objects()
        variants.extend(seen)


class Nvrtc:
    """NVRTC through ctypes, with MLX's options: `--device-as-default-execution-space`, the
    architecture (`sm_90a`: a cubin; `compute_90a`: PTX) and the CUDA headers' paths.

    From NVRTC 12.4 on it also passes `-pch`, NVRTC's automatic precompiled header: the
    headers every kernel includes are parsed once a process instead of once a compile (a
    compile is ~2 s of parsing them on 2 cores; with `-pch` and 4 threads 8 compiles took 2.5
    s instead of 14.7). The code is the same, PTX byte for byte (tests/test_kernel_cache.py).
    NVRTC writes and deletes the header file `<file name>.pch` as it compiles, by default in
    the working directory: two compiles of one file name at once (the same kernel's variants
    on a thread pool, or test processes side by side) then delete each other's file and fail.
    So each thread gets a folder of its own (`--pch-dir`) in this object's temporary one."""

    def __init__(self, library: str | os.PathLike[str], include_dirs: list[str | os.PathLike[str]]) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.includes = [f"--include-path={d}".encode() for d in include_dirs]
        major, minor = ctypes.c_int(), ctypes.c_int()
        _check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        self.precompiled_headers = self.version >= (12, 4)
        self._pch_root = tempfile.TemporaryDirectory(prefix="ds4lab-nvrtc-pch-")

    def _pch_options(self) -> list[bytes]:
        if not self.precompiled_headers:
            return []
        folder = Path(self._pch_root.name) / str(threading.get_ident())
        folder.mkdir(exist_ok=True)
        return [b"-pch", f"--pch-dir={folder}".encode()]

    def compile(self, source: str, file_name: str, arch: str = "sm_90a",
                name: str | None = None) -> tuple[bytes | None, str | None, str]:
        """(the cubin or PTX, `name`'s mangled symbol, NVRTC's log); None, None and the log
        when the source does not compile."""
        lib, program = self.lib, ctypes.c_void_p()
        header_names = (ctypes.c_char_p * 1)(MLX_DEVICE_HEADER_NAME.encode())
        header_texts = (ctypes.c_char_p * 1)(MLX_DEVICE_HEADER.encode())
        _check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), file_name.encode(), 1, header_texts,
                                      header_names), "nvrtcCreateProgram")
        try:
            if name:
                _check(lib.nvrtcAddNameExpression(program, name.encode()), "nvrtcAddNameExpression")
            options = [b"--device-as-default-execution-space", f"--gpu-architecture={arch}".encode(), *self.includes,
                       *self._pch_options()]
            result = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            if result != 0:
                return None, None, log.value.decode(errors="replace")
            mangled = None
            if name:
                lowered = ctypes.c_char_p()
                _check(lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
                mangled = lowered.value.decode()
            kind = "CUBIN" if arch.startswith("sm_") else "PTX"
            _check(getattr(lib, f"nvrtcGet{kind}Size")(program, ctypes.byref(size)), f"nvrtcGet{kind}Size")
            code = ctypes.create_string_buffer(size.value)
            _check(getattr(lib, f"nvrtcGet{kind}")(program, code), f"nvrtcGet{kind}")
            return code.raw, mangled, log.value.decode(errors="replace")
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"NVRTC: {call} returned {result}")


def fill(variants: list[KernelVariant], nvrtc: Nvrtc, directory: Path | None = None, arch: str = "sm_90a",
         threads: int | None = None) -> list[tuple[KernelVariant, str]]:
    """Compile each variant not yet in the cache and write it there (atomically: a temp file,
    then a rename; the `.txt` before the `.ptx`, which is what MLX tests for). Returns
    (variant, what happened: "cached", "compiled" or NVRTC's log when it failed)."""
    directory = Path(directory) if directory is not None else cache_dir()

    def one(variant: KernelVariant) -> str:
        module = variant.module_name()
        path = cache_path(directory, module)
        if path.exists():
            return "cached"
        kernel = f"mlx::core::cu::{variant.kernel_name}"
        code, mangled, log = nvrtc.compile(variant.mlx_source(), f"{module}.cu", arch, kernel)
        if code is None:
            return log
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path.with_suffix(".txt"), f"{kernel}\t{mangled}\n".encode())
        _write(path, code)
        return "compiled"

    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        return list(zip(variants, pool.map(one, variants), strict=True))


def _write(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


def default_nvrtc() -> Nvrtc:
    """NVRTC and the CUDA headers from the NVIDIA wheels (`nvidia-cuda-nvrtc-cu12`, the runtime
    and CCCL wheels: the dev extra), else from the CUDA toolkit (CUDA_HOME, /usr/local/cuda)."""
    import glob

    wheels = []
    with contextlib.suppress(ImportError):
        import nvidia

        wheels = [Path(root) for root in nvidia.__path__]
    for root in wheels:
        libraries = sorted(glob.glob(str(root / "cuda_nvrtc" / "lib" / "libnvrtc.so.*")))
        includes = [root / package / "include" for package in ("cuda_cccl", "cuda_runtime")]
        if libraries and all(d.is_dir() for d in includes):
            return Nvrtc(libraries[0], includes)
    toolkit = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")
    libraries = sorted(glob.glob(str(toolkit / "lib64" / "libnvrtc.so*")))
    if not libraries:
        raise FileNotFoundError("no NVRTC: install the dev extra (nvidia-cuda-nvrtc-cu12) or set CUDA_HOME")
    include = toolkit / "include"
    return Nvrtc(libraries[0], [include, *([include / "cccl"] if (include / "cccl").is_dir() else [])])
