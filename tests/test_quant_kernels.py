"""The GGUF block formats as weight formats of the native kernels (kernels/quant.h): their
dequantization is gguf's bit for bit, their products are the fp32 format's products of the
dequantized matrix bit for bit (so batch-invariant: any rows, any threads), and close to torch's.
Their integer products (LP_ARITH_INT8, kernels/formats.h) are the product of the dequantized matrix
with the int8-quantized activations, batch-invariant too, the same bits from every build."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from layerplan.engine import kernel_library as kl  # noqa: E402

# format: (gguf type, inputs a block, bytes a block, gguf-py quantizes it)
FORMATS = {
    "F16": (T.F16, 1, 2, True),
    "Q8_0": (T.Q8_0, 32, 34, True),
    "Q4_0": (T.Q4_0, 32, 18, True),
    "Q4_1": (T.Q4_1, 32, 20, True),
    "Q5_0": (T.Q5_0, 32, 22, True),
    "Q5_1": (T.Q5_1, 32, 24, True),
    "Q2_K": (T.Q2_K, 256, 84, False),
    "Q3_K": (T.Q3_K, 256, 110, False),
    "Q4_K": (T.Q4_K, 256, 144, False),
    "Q5_K": (T.Q5_K, 256, 176, False),
    "Q6_K": (T.Q6_K, 256, 210, False),
}
# where each format keeps its f16 scales in a stored block: (offset, count)
F16_SCALES = {"Q8_0": [(0, 1)], "Q4_0": [(0, 1)], "Q4_1": [(0, 2)], "Q5_0": [(0, 1)], "Q5_1": [(0, 2)],
              "Q2_K": [(80, 2)], "Q3_K": [(108, 1)], "Q4_K": [(0, 2)], "Q5_K": [(0, 2)], "Q6_K": [(208, 1)]}


def _library(isa: str | None = None):
    """(library, ABI): this CPU's build, or the one of `isa` ("generic": the portable tiles)."""
    if isa is None:
        return kl.library(), kl.ABI
    known = {i.name: i for i in (*kl.ISAS, kl.PORTABLE)}
    return kl._load(kl.build(known[isa], kl._compiler())), kl.ABI


@pytest.fixture(scope="module")
def native():
    if kl.native_available() is not None:
        pytest.skip(kl.native_available())
    return _library()


def _fmt(abi, name: str) -> int:
    return abi.constants[f"LP_FORMAT_{name}"]


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def stored_rows(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k inputs in `name` as a GGUF file stores them (uint8, (n, k / block * bytes)):
    quantized by gguf-py where it can, else random bytes with sane f16 scales; then the edge
    values: zero scales, negative and subnormal scales, the largest f16 scale, all-max and all-min
    quants."""
    qtype, block, nbytes, can = FORMATS[name]
    rng = np.random.default_rng(seed)
    if can:
        values = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
        rows = quantize(values, qtype)
        if name == "F16":
            rows = rows.view(np.uint8)
    else:
        rows = rng.integers(0, 256, (n, k // block * nbytes), dtype=np.uint8)
    if name == "F16":
        flat = rows.view(np.uint16).reshape(-1)
        flat[:8] = [0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff, 0x3c00]  # zeros, subnormals, max, 1
        return rows.reshape(n, k * 2)
    blocks = rows.reshape(-1, nbytes)
    if not can:  # sane scales: f16 magnitudes between 2^-14 and 2^-4, either sign
        for offset, count in F16_SCALES[name]:
            scale = (rng.uniform(2.0 ** -14, 2.0 ** -4, (len(blocks), count))
                     * rng.choice([-1.0, 1.0], (len(blocks), count))).astype(np.float16)
            blocks[:, offset:offset + 2 * count] = scale.view(np.uint8).reshape(len(blocks), 2 * count)
    edges = {0: 0x0000, 1: 0x8000, 2: 0x0001, 3: 0x83ff, 4: 0x7bff, 5: 0xc000}  # block -> its f16 scales
    for b, bits in edges.items():
        if b < len(blocks):
            for offset, count in F16_SCALES[name]:
                blocks[b, offset:offset + 2 * count] = np.array([bits] * count, np.uint16).view(np.uint8)
    scale_bytes = {o for offset, count in F16_SCALES[name] for o in range(offset, offset + 2 * count)}
    quants = np.array([o for o in range(nbytes) if o not in scale_bytes])
    for b, fill in ((6, 0xFF), (7, 0x00), (4, 0xFF)):
        if b < len(blocks):
            blocks[b, quants] = fill
    return blocks.reshape(n, -1)


def gguf_values(name: str, rows: np.ndarray) -> np.ndarray:
    return dequantize(rows, FORMATS[name][0]).astype(np.float32, copy=False)


def lp_dequantize(native, name, rows, k):
    lib, abi = native
    out = np.empty((rows.shape[0], k), np.float32)
    assert lib.lp_dequantize_rows(_fmt(abi, name), _ptr(rows), rows.shape[0], k, _ptr(out)) == abi.LP_OK
    return out


def pack(native, fmt: int, rows: np.ndarray, n: int, k: int):
    lib, abi = native
    nbytes = lib.lp_packed_bytes(fmt, n, k)
    assert nbytes > 0
    packed = np.zeros(nbytes + 64, np.uint8)
    at = (-packed.ctypes.data) % 64
    packed = packed[at:at + nbytes]
    assert lib.lp_pack(_ptr(rows), fmt, n, k, _ptr(packed)) == abi.LP_OK
    return packed


def linear(native, fmt: int, packed: np.ndarray, n: int, k: int, x: np.ndarray, threads: int,
           arithmetic: int = 0) -> np.ndarray:
    lib, abi = native
    m = x.shape[0]
    y = np.full((m, n), np.nan, np.float32)
    matrix = abi.structs["lp_matrix"](ctypes.c_void_p(packed.ctypes.data), None, n, k, fmt, arithmetic)
    status = lib.lp_linear(_ptr(x), abi.LP_DTYPE_F32, ctypes.byref(matrix), _ptr(y), abi.LP_DTYPE_F32, m, threads)
    assert status == abi.LP_OK
    return y


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


SHAPES = {1: [(37, 96), (149, 224)], 32: [(37, 96), (149, 224)], 256: [(37, 512), (149, 768)]}


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_rows_is_gguf_bit_for_bit(native, name):
    block = FORMATS[name][1]
    for n, k in SHAPES[block]:
        rows = stored_rows(name, n, k)
        assert same_bits(lp_dequantize(native, name, rows, k), gguf_values(name, rows))


@pytest.mark.parametrize("name", FORMATS)
def test_packed_products_are_the_fp32_products_of_the_dequantized_matrix(native, name):
    lib, abi = native
    block = FORMATS[name][1]
    rng = np.random.default_rng(1)
    for n, k in SHAPES[block]:
        rows = stored_rows(name, n, k, seed=n)
        values = gguf_values(name, rows)
        packed = pack(native, _fmt(abi, name), rows, n, k)
        dense = pack(native, abi.LP_FORMAT_F32, np.ascontiguousarray(values), n, k)
        x = rng.standard_normal((16, k)).astype(np.float32)
        alone = linear(native, _fmt(abi, name), packed, n, k, x, 1)
        assert same_bits(alone, linear(native, abi.LP_FORMAT_F32, dense, n, k, x, 1))
        for m in range(1, 17):
            for threads in (1, 2):
                y = linear(native, _fmt(abi, name), packed, n, k, np.ascontiguousarray(x[:m]), threads)
                assert same_bits(y, alone[:m]), (n, k, m, threads)
        reference = (torch.from_numpy(x).double() @ torch.from_numpy(values).double().T).numpy()
        bound = (torch.from_numpy(np.abs(x)).double() @ torch.from_numpy(np.abs(values)).double().T).numpy()
        assert np.all(np.abs(alone - reference) <= 1e-5 * bound + 1e-30)
        torch_y = (torch.from_numpy(x) @ torch.from_numpy(values).T).numpy()
        assert np.all(np.abs(alone - torch_y) <= 1e-5 * bound + 1e-30)


@pytest.mark.parametrize("name", FORMATS)
def test_the_portable_tiles_give_the_same_bits(native, name):
    portable = _library("generic")
    lib, abi = native
    block = FORMATS[name][1]
    n, k = SHAPES[block][0]
    rows = stored_rows(name, n, k, seed=3)
    x = np.random.default_rng(2).standard_normal((7, k)).astype(np.float32)
    ours = linear(native, _fmt(abi, name), pack(native, _fmt(abi, name), rows, n, k), n, k, x, 2)
    theirs = linear(portable, _fmt(abi, name), pack(portable, _fmt(abi, name), rows, n, k), n, k, x, 2)
    assert same_bits(ours, theirs)


@pytest.mark.parametrize("name", [name for name, spec in FORMATS.items() if spec[3]])
def test_quantize_rows_is_gguf_where_gguf_quantizes(native, name):
    lib, abi = native
    qtype, block, nbytes, _ = FORMATS[name]
    values = np.random.default_rng(4).standard_normal((9, 256)).astype(np.float32)
    values[0, :block] = 0.0  # an all-zero block
    values[1, :block] = np.linspace(-1, 1, block)  # ties of the rounding
    ours = np.empty((9, 256 // block * nbytes), np.uint8)
    assert lib.lp_quantize_rows(_fmt(abi, name), _ptr(values), 9, 256, _ptr(ours)) == abi.LP_OK
    assert np.array_equal(ours, quantize(values, qtype).view(np.uint8).reshape(9, -1))


@pytest.mark.parametrize("name", [name for name, spec in FORMATS.items() if not spec[3]])
def test_quantize_rows_gives_blocks_that_come_back_close(native, name):
    lib, abi = native
    qtype, block, nbytes, _ = FORMATS[name]
    values = np.random.default_rng(5).standard_normal((4, 512)).astype(np.float32)
    stored = np.empty((4, 512 // block * nbytes), np.uint8)
    assert lib.lp_quantize_rows(_fmt(abi, name), _ptr(values), 4, 512, _ptr(stored)) == abi.LP_OK
    back = gguf_values(name, stored)
    bits = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[name]
    assert np.abs(back - values).max() <= 8 * np.abs(values).max() / 2 ** bits


def test_shapes_and_formats_the_kernels_refuse(native):
    lib, abi = native
    out = np.empty(64, np.float32)
    rows = np.zeros(64, np.uint8)
    assert lib.lp_packed_bytes(abi.LP_FORMAT_Q4_K, 16, 128) == -1  # k not whole super-blocks
    assert lib.lp_packed_bytes(abi.LP_FORMAT_Q4_1, 17, 64) == 2 * 16 * 2 * 20
    assert lib.lp_dequantize_rows(abi.LP_FORMAT_Q8_0, _ptr(rows), 1, 48, _ptr(out)) == abi.LP_E_SHAPE
    assert lib.lp_dequantize_rows(abi.LP_FORMATS, _ptr(rows), 1, 32, _ptr(out)) == abi.LP_E_TYPE


def test_f16_rounding_is_torchs_for_every_kind_of_float(native):
    """The F16 format's halves (simd.h's f32_to_f16, the kernels' one f16 pair) are torch's and
    F16C's: numpy's too, but for NaNs, which torch and F16C make quiet (numpy keeps a signalling NaN
    signalling); and every half widens back to torch's float."""
    lib, abi = native
    bits = np.arange(0, 2 ** 32, 4099, dtype=np.uint64).astype(np.uint32)  # every exponent, both signs
    edges = np.array([0x477fefff, 0x477ff000, 0x33000000, 0x33000001, 0x387fc000, 0x387fe000, 0x7f800000,
                      0x7f800001, 0x7fa00000, 0xff812345, 0xffc00000, 0x00000001, 0x80000000], np.uint32)
    values = np.concatenate([bits, edges]).view(np.float32)
    ours = np.empty(values.size, np.uint16)
    assert lib.lp_quantize_rows(abi.LP_FORMAT_F16, _ptr(values), 1, values.size, _ptr(ours)) == abi.LP_OK
    torchs = torch.from_numpy(values).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, torchs)
    with np.errstate(over="ignore", invalid="ignore"):
        numbers = ~np.isnan(values)
        assert np.array_equal(ours[numbers], values[numbers].astype(np.float16).view(np.uint16))
    halves = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)  # subnormals, infinities, NaNs
    widened = np.empty(halves.size, np.float32)
    assert lib.lp_dequantize_rows(abi.LP_FORMAT_F16, _ptr(halves), 1, halves.size, _ptr(widened)) == abi.LP_OK
    want = torch.from_numpy(halves.view(np.int16)).view(torch.float16).float().numpy()
    assert np.array_equal(widened.view(np.uint32), want.view(np.uint32))


# the formats with integer tiles (the trait rows' int_tiles, products_int_avx2.c); the others run exact
INTEGER = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


# the formats whose integer products take Q8_K activations (formats.h); the others take Q8_0's
KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def int8_activations(x: np.ndarray, name: str = "Q8_0") -> np.ndarray:
    """x as the integer products of format `name` quantize it, dequantized, in float64 (formats.h):
    Q8_0's per 32 inputs, d = max|x| / 127, q = x 127 / max|x| rounded to even; a K-quant's Q8_K per
    256 inputs, iscale = -127 / x_m (x_m the largest input, or the smallest where its magnitude is
    larger), q = min(127, x iscale rounded to even), d = 1 / iscale."""
    m, k = x.shape
    if name in KQUANTS:
        blocks = x.reshape(m, k // 256, 256)
        most, least = blocks.max(axis=2), blocks.min(axis=2)
        x_m = np.where(most >= -least, most, least).astype(np.float32)
        with np.errstate(divide="ignore"):
            iscale = np.where(x_m != 0, np.float32(-127) / x_m, 0).astype(np.float32)
        q = np.minimum(np.rint(blocks * iscale[:, :, None]), 127)
        assert np.abs(q).max() <= 127
        d = np.where(x_m != 0, np.float32(1) / np.where(x_m != 0, iscale, 1), 0).astype(np.float32)
        return (q * d[:, :, None].astype(np.float64)).reshape(m, k)
    blocks = x.reshape(m, k // 32, 32)
    most = np.abs(blocks).max(axis=2)
    inverse = np.where(most > 0, np.float32(127) / np.where(most > 0, most, 1), 0).astype(np.float32)
    q = np.rint(blocks * inverse[:, :, None])
    assert np.abs(q).max() <= 127
    return (q * (most / np.float32(127)).astype(np.float32)[:, :, None].astype(np.float64)).reshape(m, k)


@pytest.mark.parametrize("name", INTEGER)
def test_integer_products_are_the_product_with_int8_activations(native, name):
    lib, abi = native
    rng = np.random.default_rng(6)
    for n, k in SHAPES[FORMATS[name][1]]:
        rows = stored_rows(name, n, k, seed=n + 1)
        values = gguf_values(name, rows).astype(np.float64)
        packed = pack(native, _fmt(abi, name), rows, n, k)
        x = rng.standard_normal((16, k)).astype(np.float32)
        x[3, :256] = 0.0  # an all-zero block (and K-quant super-block)
        x[5, 32:64] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # ties of the rounding
        # every activation at +-127 against the edge blocks' largest quants: the int16 sums of the
        # AVX2 tiles at their bound (LP_INT16_SUMS)
        x[6], x[7] = 1.0, -1.0
        alone = linear(native, _fmt(abi, name), packed, n, k, x, 1, abi.LP_ARITH_INT8)
        xq = int8_activations(x, name)
        reference, bound = xq @ values.T, np.abs(xq) @ np.abs(values).T
        # Q8_0 runs q + 128 and takes 128 d times the activations' sum off in fp32: a cancellation
        # that costs a few more roundings than the unsigned formats' offsets
        tolerance = 1e-5 if name == "Q8_0" else 1e-6
        assert np.all(np.abs(alone - reference) <= tolerance * bound + 1e-30), name
        exact = linear(native, _fmt(abi, name), packed, n, k, x, 1)
        assert not same_bits(alone, exact)  # it is another arithmetic, and within the int8 rounding of x:
        assert np.all(np.abs(alone - exact) <= 0.01 * (np.abs(x) @ np.abs(values).T) + 1e-30)
        for m in range(1, 17):
            for threads in (1, 2):
                y = linear(native, _fmt(abi, name), packed, n, k, np.ascontiguousarray(x[:m]), threads,
                           abi.LP_ARITH_INT8)
                assert same_bits(y, alone[:m]), (n, k, m, threads)


@pytest.mark.parametrize("name", [name for name in FORMATS if name not in INTEGER])
def test_formats_without_integer_tiles_run_exact(native, name):
    lib, abi = native
    n, k = SHAPES[FORMATS[name][1]][0]
    rows = stored_rows(name, n, k, seed=7)
    packed = pack(native, _fmt(abi, name), rows, n, k)
    x = np.random.default_rng(8).standard_normal((5, k)).astype(np.float32)
    assert same_bits(linear(native, _fmt(abi, name), packed, n, k, x, 2, abi.LP_ARITH_INT8),
                     linear(native, _fmt(abi, name), packed, n, k, x, 2))


@pytest.mark.parametrize("name", INTEGER)
def test_every_build_gives_the_same_integer_products(native, name):
    """vpdpbusd (avx512vnni) and vpmaddubsw + vpmaddwd (avx2) sum the same integers; the portable
    build has no integer tiles and runs exact."""
    from layerplan.machine import read_cpuinfo

    lib, abi = native
    n, k = SHAPES[FORMATS[name][1]][1]
    rows = stored_rows(name, n, k, seed=9)
    x = np.random.default_rng(10).standard_normal((7, k)).astype(np.float32)
    flags = read_cpuinfo()[1] or set()
    builds = [isa.name for isa in kl.ISAS if isa.cpu_flags <= flags]
    results = {}
    for isa in builds:
        build = _library(isa)
        results[isa] = linear(build, _fmt(abi, name), pack(build, _fmt(abi, name), rows, n, k), n, k, x, 2,
                              abi.LP_ARITH_INT8)
    assert all(same_bits(y, results[builds[0]]) for y in results.values()), list(results)
    portable = _library("generic")
    packed = pack(portable, _fmt(abi, name), rows, n, k)
    assert same_bits(linear(portable, _fmt(abi, name), packed, n, k, x, 2, abi.LP_ARITH_INT8),
                     linear(portable, _fmt(abi, name), packed, n, k, x, 2))
