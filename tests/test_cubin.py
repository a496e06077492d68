"""`ds4lab.model.cubin` reads what ptxas gave each kernel, from cubins NVRTC compiles here."""

from __future__ import annotations

import pytest

from ds4lab.model.cubin import CubinError, kernel_resources

_SOURCE = r"""
extern "C" __global__ void staged(const float* x, float* y) {
    __shared__ float tile[100];
    tile[threadIdx.x % 100] = x[threadIdx.x];
    __syncthreads();
    y[threadIdx.x] = tile[(threadIdx.x + 1) % 100];
}
extern "C" __global__ void picked(const float* x, const int* at, float* y) {
    float a[256];
    for (int i = 0; i < 256; ++i) a[i] = x[i * blockDim.x + threadIdx.x];
    for (int i = 0; i < 32; ++i) a[at[i * blockDim.x + threadIdx.x] & 255] += 1.0f;
    y[threadIdx.x] = a[at[threadIdx.x] & 255];
}
"""


@pytest.fixture(scope="module")
def cubin(nvrtc) -> bytes:
    code, _, log = nvrtc.compile(_SOURCE, "resources.cu", "sm_90a")
    assert code is not None, log
    return code


def test_each_kernel_has_its_registers_frame_and_shared_memory(cubin):
    found = {k.name: k for k in kernel_resources(cubin)}
    assert set(found) == {"staged", "picked"}
    assert found["staged"].shared_bytes == 400 and found["picked"].shared_bytes == 0
    assert found["staged"].frame_bytes == 0
    assert found["picked"].frame_bytes >= 256 * 4         # an array indexed at run time lives in local memory
    assert all(1 <= k.registers <= 255 for k in found.values())


@pytest.mark.parametrize("cut", [3, 40, 200])
def test_a_cut_or_foreign_file_names_the_offset(cubin, cut):
    with pytest.raises(CubinError, match=r"x\.ptx: .*offset"):
        kernel_resources(cubin[:cut], "x.ptx")
    with pytest.raises(CubinError, match="not a little-endian ELF64"):
        kernel_resources(b"\x7fELF" + bytes(100), "x.ptx")
