"""`ds4lab.model.cubin` reads what ptxas gave each kernel, from cubins NVRTC compiles here."""

from __future__ import annotations

import pytest

from ds4lab.model.cubin import CubinError, kernel_resources, main_loop

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


_LISTING = """
        .text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x4, PT ;
        /*0020*/               @P0 BRA `(.L_x_3) ;
.L_x_1:
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0040*/                   FFMA R8, R4, R5, R8 ;
        /*0050*/              @!P1 FFMA R8, R6, R7, R8 ;
.L_x_2:
        /*0060*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0070*/                   ISETP.NE.AND P1, PT, R2, R9, PT ;
        /*0080*/               @P1 BRA `(.L_x_1) ;
        /*0090*/                   FADD R8, R8, 1 ;
        /*00a0*/               @P2 BRA `(.L_x_2) ;
.L_x_3:
        /*00b0*/                   EXIT ;
"""


def test_main_loop_is_the_longest_loops_body_by_opcode():
    loop = main_loop(_LISTING)
    assert loop == {"LDG.E.128": 1, "FFMA": 2, "IADD3": 1, "ISETP.NE.AND": 1, "BRA": 1}
    assert main_loop(_LISTING.replace("@P1 BRA `(.L_x_1)", "@P1 BRA `(.L_x_3)")) == {
        "IADD3": 1, "ISETP.NE.AND": 1, "BRA": 2, "FADD": 1}          # the other loop, from .L_x_2
    assert main_loop("") == {}


def test_kernels_of_big_blocks_fit_them_and_keep_their_arrays_in_registers(nvrtc):
    """MLX's kernels carry no launch bounds, so ptxas may give a thread more registers than a
    1024-thread block can have (64: 65,536 a block): `hc_pre`'s block, whose threads hold their
    stream columns in registers, and `indexer_queries`' (32 warps a head), at the Flash and Pro
    widths (a launch fails otherwise). And `indexer_scores`' step of 32 dots stays in
    registers on the real 64 heads (a frame: local memory around every shuffle)."""
    import mlx.core as mx

    from ds4lab.model import kernel_cache, kernels

    with kernel_cache.recorded_variants() as variants:
        for e, q_lora in ((4096, 1024), (7168, 1536)):
            kernels.hc_pre(mx.ones((1, 4, e)), mx.ones((24, 4 * e)), mx.ones((3,)), mx.ones((24,)), mx.ones((e,)),
                           20, 1e-6, 1e-6)
            kernels.indexer_queries(mx.ones((1, q_lora)), mx.ones((q_lora,)), 1e-6, mx.ones((1, e)),
                                    mx.ones((8192, q_lora), mx.float16), mx.ones((64, e)),
                                    (mx.ones((1, 32)), mx.zeros((1, 32))), 64)
        kernels.indexer_scores(mx.ones((1, 64, 128)), mx.ones((1, 64)), mx.ones((1024, 128)),
                               choose=(mx.ones((1, 1024), mx.bool_), mx.ones((1, 129), mx.bool_), 512))
    assert len(variants) == 7                      # hc_pre launches hc_mix first
    for variant in variants:
        code, _, log = nvrtc.compile(variant.mlx_source(), f"{variant.kernel_name}.cu", "sm_90a")
        assert code is not None, log
        (found,) = kernel_resources(code)
        assert found.frame_bytes == 0, (variant.kernel_name, found)
        if "hc_pre" in variant.kernel_name or "indexer_queries" in variant.kernel_name:
            assert found.registers <= 64, (variant.kernel_name, found)


def test_the_next_sublayers_input_costs_the_hc_product_no_registers(nvrtc):
    """`q8_hc` with the next sublayer's input made by its last block (NEXT): a tail that one
    block of ~1000 runs must not raise the registers of every thread of the product (its
    occupancy). Inlined, the HC split took the kernel from 72 to 96-127; as a call it adds none.
    The shared expert's down product (2048 columns) and the attention's output (8192), at the
    Flash and Pro widths."""
    import mlx.core as mx

    from ds4lab.model import kernel_cache, kernels
    from ds4lab.model.weights import Q8Matrix

    registers = {}
    for e in (4096, 7168):
        for cols in (2048, 8192):
            q8 = Q8Matrix(mx.zeros((e, cols // 4), mx.uint32), mx.zeros((e, cols // 32)), mx.zeros((e, cols // 32)),
                          e, cols)
            args = (q8, mx.ones((1, cols)), mx.ones((1, 4, e)), mx.ones((1, 4)), mx.ones((1, 4, 4)), mx.ones((1, e)))
            nxt = kernels.HCInput(mx.ones((24, 4 * e)), mx.ones((3,)), mx.ones((24,)), mx.ones((e,)), 20, 1e-6, 1e-6)
            for with_next in (False, True):
                with kernel_cache.recorded_variants() as variants:
                    kernels.q8_hc(*args, next_input=nxt if with_next else None)
                (variant,) = variants
                code, _, log = nvrtc.compile(variant.mlx_source(), f"{variant.kernel_name}.cu", "sm_90a")
                assert code is not None, log
                (found,) = kernel_resources(code)
                assert found.frame_bytes == 0, (variant.kernel_name, found)
                registers[e, cols, with_next] = found.registers
    for (e, cols, with_next), n in registers.items():
        if with_next:
            assert n <= max(registers[e, cols, False], 72), (e, cols, registers)
