"""The native library itself (engine/kernels/, engine/kernel_library.py): its ABI as read from
kernels.h, the checks at load, the build's variants (ISA, compiler flags, sanitizers), the C's own
refusals, and the portable build against the AVX2 one, bit for bit."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import re
import subprocess
import weakref

import pytest
import torch

from layerplan.engine import kernel_library as kl
from layerplan.engine import native
from layerplan.engine.rope import chain_rotary_embedding
from tiny import tiny_model

pytestmark = pytest.mark.skipif(native.native_available() is not None, reason=str(native.native_available()))


def test_every_function_of_the_header_is_exported_with_its_signature():
    lib = native.library()
    header = kl.HEADER.read_text()
    declared = set(re.findall(r"\bLP_API\s+[\w\s*]+?\b(\w+)\s*\(", header))
    assert declared == set(kl.ABI.functions) and len(declared) >= 15
    for name, (result, arguments) in kl.ABI.functions.items():
        function = getattr(lib, name)
        assert function.restype == result and function.argtypes == arguments, name
    assert lib.lp_abi_version() == kl.ABI.LP_ABI_VERSION
    assert lib.isa == kl.choose_isa().name


def test_a_layout_that_differs_from_the_library_fails_in_one_line():
    text = kl.HEADER.read_text().replace("    int arithmetic;\n} lp_matrix;", "    int arithmetic;\n    long extra;\n} lp_matrix;")
    assert text != kl.HEADER.read_text()
    with pytest.raises(kl.AbiMismatch, match=r"^lp_matrix is laid out as 40 w 0 bias 8 n 16 k 24 format 32 arithmetic 36 "
                                             r"in the library and 48 .* extra 40 in native.py's reading") as error:
        kl.check_abi(native.library(), kl.read_abi(text))
    assert "\n" not in str(error.value)
    stale = kl.read_abi(kl.HEADER.read_text().replace("#define LP_ABI_VERSION ", "#define LP_ABI_VERSION 1"))
    with pytest.raises(kl.AbiMismatch, match="a stale build"):
        kl.check_abi(native.library(), stale)


def test_the_header_parser_refuses_what_it_does_not_read():
    with pytest.raises(kl.AbiMismatch, match="one plain field per declaration"):
        kl.read_abi("#define LP_ABI_VERSION 1\ntypedef struct { long a, b; } s;\nLP_API int f(void);")
    with pytest.raises(kl.AbiMismatch, match="does not read the C type"):
        kl.read_abi("#define LP_ABI_VERSION 1\ntypedef struct { unknown_t a; } s;\nLP_API int f(void);")


def test_the_library_shares_torchs_openmp_runtime_and_a_foreign_one_is_refused():
    lib = native.library()
    torch_runtimes = kl.mapped_libraries(kl._OPENMP)
    assert lib.openmp_runtime in torch_runtimes, (lib.openmp_runtime, torch_runtimes)
    with pytest.raises(kl.NativeUnavailable, match=r"link the OpenMP runtime .* torch uses /elsewhere/libiomp5.so"):
        kl.check_openmp(lib, {"/elsewhere/libiomp5.so"})


def test_each_build_variant_has_its_own_key(monkeypatch):
    monkeypatch.setenv("LAYERPLAN_SANITIZE", "0")
    monkeypatch.setenv("LAYERPLAN_KERNEL_FLAGS", "")
    plain = kl.kernels_key()
    monkeypatch.setenv("LAYERPLAN_SANITIZE", "1")
    sanitized = kl.kernels_key()
    monkeypatch.setenv("LAYERPLAN_SANITIZE", "0")
    monkeypatch.setenv("LAYERPLAN_KERNEL_FLAGS", "-DLP_BLOCK=64")
    flagged = kl.kernels_key()
    monkeypatch.setenv("LAYERPLAN_KERNEL_FLAGS", "")
    portable = kl.kernels_key(isa=kl.PORTABLE)
    assert len({plain, sanitized, flagged, portable}) == 4
    assert kl.kernels_key() == plain


def test_a_compiler_is_asked_its_version_once_until_its_file_changes(monkeypatch, tmp_path):
    """A start finds the compiler's --version line kept by the compiler file's identity (no
    process spawned); a compiler file that changed is asked again, and another version makes
    another key."""
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    asked = tmp_path / "asked"
    compiler = tmp_path / "fakecc"
    compiler.write_text(f"#!/bin/sh\necho x >> {asked}\necho 'fakecc 1.0'\n")
    compiler.chmod(0o755)

    def identity() -> str:
        kl._compiler_identity.cache_clear()
        return kl._compiler_identity(str(compiler))

    try:
        first = identity()
        assert first == f"{compiler} fakecc 1.0"
        assert identity() == first and asked.read_text().count("x") == 1
        compiler.write_text(f"#!/bin/sh\necho x >> {asked}\necho 'fakecc 2.0 (a longer line)'\n")
        assert identity() == f"{compiler} fakecc 2.0 (a longer line)" and asked.read_text().count("x") == 2
        assert kl.kernels_key(str(compiler), kl.PORTABLE) != kl.kernels_key("cc", kl.PORTABLE)
    finally:
        kl._compiler_identity.cache_clear()


def test_a_sanitized_library_is_not_loaded_into_a_process_without_the_sanitizer(monkeypatch, tmp_path):
    if kl.mapped_libraries(re.compile(r"libasan")):
        pytest.skip("this process runs under the sanitizer")
    monkeypatch.setenv("LAYERPLAN_SANITIZE", "1")
    with pytest.raises(kl.NativeUnavailable, match="LD_PRELOAD"):
        kl._load(tmp_path / "never-built.so")


def test_an_unknown_isa_is_named(monkeypatch):
    monkeypatch.setenv("LAYERPLAN_KERNEL_ISA", "sse2")
    with pytest.raises(kl.NativeUnavailable, match="built for avx512vnni, avx2, generic"):
        kl.choose_isa()


def test_each_product_file_is_one_isas_and_tests_no_other_isas_macros():
    """Every products_*.c is in an ISAS row, and each is named for the ISA it is written for: an
    avx2 file asks for no AVX-512 (the avx512vnni build has files of its own), a generic one for no
    intrinsics at all."""
    rows = (*kl.ISAS, kl.PORTABLE)
    named = {name for isa in rows for name in isa.products}
    assert named == {path.name for path in kl.KERNELS.glob("products_*.c")}
    for path in [*kl.KERNELS.glob("*.c"), *kl.KERNELS.glob("*.h")]:
        text = path.read_text()
        if "avx512" not in path.name:
            assert "__AVX512" not in text and "_mm512_" not in text, path.name
        if "generic" in path.name:
            assert "immintrin" not in text and "__AVX" not in text, path.name


def test_the_avx512vnni_build_compiles_and_links_whole(tmp_path):
    """The avx512vnni library builds here (where it may not run): every symbol it needs but libc's,
    libm's, libdl's and OpenMP's is its own, as the AVX2 build's."""
    avx512vnni = next(isa for isa in kl.ISAS if isa.name == "avx512vnni")
    # -O0 after the row's -O3: the same sources and symbols, compiled in a third of the time (the
    # check is that it compiles and links, not its code)
    quick = dataclasses.replace(avx512vnni, flags=(*avx512vnni.flags, "-O0"))
    built = kl.build(quick, kl._compiler(), tmp_path / "native")
    needed = subprocess.run(["nm", "-u", "--format=just-symbols", str(built)], capture_output=True, text=True,
                            check=True).stdout.split()
    assert not [name for name in needed if name.startswith("lp_")], needed
    defined = subprocess.run(["nm", "--defined-only", str(built)], capture_output=True, text=True, check=True).stdout
    assert all(f"lp_int_tiles_{f}" in defined for f in ("q8_0", "q4_0", "q2_k", "q6_k"))


def test_a_compiler_that_refuses_the_alignment_flags_still_builds_the_kernels(tmp_path, monkeypatch):
    fussy = tmp_path / "fussy-cc"
    fussy.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -falign-*) echo "unknown argument: $a" >&2; exit 1;; esac; done\n'
                     f'exec {kl._compiler()} "$@"\n')
    fussy.chmod(0o755)
    monkeypatch.setenv("CC", str(fussy))
    # the portable build: the same build steps over the smallest sources (the CPU's build compiles
    # the AVX2 tiles, twice as long, on a core the other test worker shares)
    built = kl.build(kl.PORTABLE, kl._compiler(), tmp_path / "native")
    assert built.exists() and list((tmp_path / "native").glob("kernels-*.so")) == [built]
    assert kl._load(built).lp_abi_version() == kl.ABI.LP_ABI_VERSION


_ROUNDING_CHECK = r"""
#include <stdio.h>
#include "simd.h"
/* every seventh fp32 bit pattern (NaNs, infinities, subnormals and ties among them) through the
 * eight-lane rounding and bf16 and f16 stores against the scalar ones (on AVX2, the f16 lanes are
 * F16C's conversions: the scalar f32_to_f16 is checked against the hardware's); every f16 bit
 * pattern through the eight-lane load against f16_to_f32 (bit for bit: NaNs made quiet as F16C's) */
int main(void) {
    long differ = 0;
    float in[8], out[8];
    uint16_t stored[8], halves[8];
    for (uint64_t base = 0; base < (1ull << 32); base += 56) {
        for (int j = 0; j < 8; j++) { uint32_t u = (uint32_t)(base + 7 * j); memcpy(&in[j], &u, 4); }
        lp_f8 v = f8_load(in);
        f8_store(out, f8_round_bf16(v));
        f8_store_bf16(stored, v);
        f8_store_f16(halves, v);
        for (int j = 0; j < 8; j++) {
            float want = round_bf16(in[j]);
            differ += memcmp(&want, &out[j], 4) != 0 || stored[j] != f32_to_bf16(in[j]) || halves[j] != f32_to_f16(in[j]);
        }
    }
    for (uint32_t h = 0; h < 65536; h += 8) {
        for (int j = 0; j < 8; j++) halves[j] = (uint16_t)(h + j);
        f8_store(out, f8_load_f16(halves));
        for (int j = 0; j < 8; j++) {
            float want = f16_to_f32(halves[j]);
            differ += memcmp(&want, &out[j], 4) != 0;
        }
    }
    printf("%ld\n", differ);
    return differ != 0;
}
"""


def test_eight_lane_rounding_is_the_scalar_rounding_bit_for_bit(tmp_path):
    """The per-row work runs on eight lanes with a scalar tail: both must round every value alike,
    or a token's logits would depend on where its row's elements fall."""
    program = tmp_path / "rounding.c"
    program.write_text(_ROUNDING_CHECK)
    isa = kl.choose_isa()
    flags = [flag for flag in kl.FLAGS + isa.flags if flag not in ("-shared", "-fPIC", "-fopenmp")]
    subprocess.run([kl._compiler(), *flags, f"-I{kl.KERNELS}", str(program), "-o", str(tmp_path / "rounding"), "-lm"],
                   check=True, capture_output=True)
    done = subprocess.run([str(tmp_path / "rounding")], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "0")


# ----- the C's refusals --------------------------------------------------------------------------

def test_unknown_formats_and_shapes_are_refused_not_read():
    lib = native.library()
    assert lib.lp_packed_bytes(99, 16, 16) == -1 and lib.lp_packed_bytes(kl.ABI.LP_FORMAT_F32, -1, 16) == -1
    assert lib.lp_packed_bytes(kl.ABI.LP_FORMAT_BF16, 17, 3) == 32 * 3 * 2
    out = torch.empty(16 * 4)
    assert lib.lp_pack(torch.zeros(4, 4).data_ptr(), 99, 4, 4, out.data_ptr()) == kl.ABI.LP_E_TYPE
    matrix = native._Matrix(out.data_ptr(), None, 4, 4, 99)
    x, y = torch.zeros(1, 4), torch.zeros(1, 4)
    assert lib.lp_linear(x.data_ptr(), 0, ctypes.byref(matrix), y.data_ptr(), 0, 1, 1) == kl.ABI.LP_E_TYPE
    assert lib.lp_linear(x.data_ptr(), 7, ctypes.byref(matrix), y.data_ptr(), 0, 1, 1) == kl.ABI.LP_E_TYPE
    assert lib.lp_product_rate(99, 1, 1) < 0
    with pytest.raises(RuntimeError, match=r"status -5: an unknown weight format or dtype"):
        kl.check(kl.ABI.LP_E_TYPE, "a test")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_refuses_positions_past_its_kv_slot(dtype):
    model = tiny_model("llama", 1, dtype=dtype)
    layer = native.NativeLayer(model.parts.layers[0], dtype, 0.0, native.WeightArena())
    a = layer.attention
    hidden = torch.randn(1, 3, 32).to(dtype)
    rope = chain_rotary_embedding(model.parts.rotary, hidden, 4, 3, None)
    keys, values = (torch.zeros(1, a.kv_heads, 6, a.head_dim, dtype=dtype) for _ in range(2))
    layer.run_attention(hidden, keys, values, 3, rope, 1.0, None)  # positions 3-5 of 6: fits
    with pytest.raises(RuntimeError, match="positions past the end of the KV slot"):
        layer.run_attention(hidden, keys, values, 4, rope, 1.0, None)  # 4-6 of 6: does not


# a step; a pass whose queries (2 a kv head a row) attend as one group, each run of the cache
# widened in L1; one with more than LP_QUERIES a kv head, the slot widened whole first
@pytest.mark.parametrize("rows", [1, 4, 20])
def test_an_f16_kv_cache_holds_torchs_halves_of_the_keys_and_values(rows):
    """A KV cache in f16 (stored-fast's): every key and value written is torch's .half() of the one
    an fp32 cache gets, and attention over them stays within f16's rounding of the fp32 result."""
    model = tiny_model("llama", 1)
    layer = native.NativeLayer(model.parts.layers[0], torch.float32, 0.0, native.WeightArena())
    a = layer.attention
    torch.manual_seed(0)
    prefix, step = torch.randn(1, 5, 32), torch.randn(1, rows, 32)
    cos, sin = chain_rotary_embedding(model.parts.rotary, torch.cat([prefix, step], 1), 0, 5 + rows, None)
    half = [torch.zeros(1, a.kv_heads, 32, a.head_dim, dtype=torch.float16) for _ in range(2)]
    wide = [torch.zeros(1, a.kv_heads, 32, a.head_dim) for _ in range(2)]
    for cache in (half, wide):
        layer.run_attention(prefix, *cache, 0, (cos[..., :5, :], sin[..., :5, :]), 1.0, None)
    for h, w in zip(half, wide):
        w.copy_(w.half().float())  # the same prefix in both: the step's own rows are what differs
    got = layer.run_attention(step, *half, 5, (cos[..., 5:, :], sin[..., 5:, :]), 1.0, None)
    want = layer.run_attention(step, *wide, 5, (cos[..., 5:, :], sin[..., 5:, :]), 1.0, None)
    for h, w in zip(half, wide):
        assert torch.equal(h[:, :, :5 + rows], w[:, :, :5 + rows].half())
    assert not torch.equal(got, want) and torch.allclose(got, want, rtol=0, atol=2e-3)


# ----- references held, caches bounded -----------------------------------------------------------

def test_descriptors_keep_the_tensors_they_point_into():
    model = tiny_model("llama", 1)
    parts = model.parts.layers[0]
    layer = native.NativeLayer(parts, torch.float32, 0.0, native.WeightArena())
    norm = parts.attention_norm
    old = weakref.ref(norm.weight)
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())  # the module lets go of its tensor
    gc.collect()
    assert old() is not None and layer.attention.norm.weight == old().data_ptr()
    packed = native.PackedMatrix([torch.randn(20, 8)], [torch.randn(20)])
    assert any(held is packed.packed for held in packed.descriptor._owners)
    assert any(held is packed.bias for held in packed.descriptor._owners)


def test_the_bounded_cache_drops_the_least_recently_used():
    cache = native.BoundedCache(3)
    for key in "abc":
        cache[key] = key.upper()
    assert cache.get("a") == "A"  # a is now the most recent
    cache["d"] = "D"
    assert list(cache) == ["c", "a", "d"] and cache.get("b", "gone") == "gone"
    for i in range(100):
        cache[i] = i
    assert len(cache) == 3


# ----- the portable build ------------------------------------------------------------------------

@pytest.fixture
def libraries(monkeypatch):
    """Runs its test's body under each library: fn() -> [result with the ISA's, with the portable]."""
    def both(fn):
        results = []
        for isa in (kl.choose_isa().name, "generic"):
            monkeypatch.setenv("LAYERPLAN_KERNEL_ISA", isa)
            native.library.cache_clear()
            assert native.library().isa == isa
            results.append(fn())
        return results
    yield both
    monkeypatch.delenv("LAYERPLAN_KERNEL_ISA")
    native.library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_products_equal_the_isas_bit_for_bit(libraries, dtype):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(70, 130, generator=gen) / 10).to(dtype)  # 4.4 panels, 2 blocks and a tail of inputs
    x = torch.randn(17, 130, generator=gen).to(dtype)
    packed = native.PackedMatrix([w], [torch.randn(70, generator=gen)])

    def products():
        return [packed(x[:rows]) for rows in range(1, 18)]
    simd, portable = libraries(products)
    assert all(torch.equal(a, b) for a, b in zip(simd, portable))


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float16)])
@pytest.mark.parametrize("head_dim", [8, 36, 64])
def test_the_portable_layers_equal_the_isas_bit_for_bit(libraries, dtype, kv_dtype, head_dim):
    """A layer's attention and MLP (norms, RoPE, the cache in the activations' dtype or f16, shared
    keys, the softmax's exp, SiLU) on a 9-token pass and three one-token steps after it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from layerplan.models.loading import wrap_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=3 * head_dim, intermediate_size=100, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    model = wrap_model(AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), name="portable-check")
    layer = native.NativeLayer(model.parts.layers[0], dtype, 0.0, native.WeightArena())
    hidden = torch.randn(1, 12, 3 * head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)

    def run():
        keys, values = (torch.zeros(1, 1, 16, head_dim, dtype=kv_dtype or dtype) for _ in range(2))
        outs = []
        for start, end in ((0, 9), (9, 10), (10, 11), (11, 12)):
            rope = chain_rotary_embedding(model.parts.rotary, hidden, start, end - start, None)
            h = layer.run_attention(hidden[:, start:end], keys, values, start, rope, 1.0, None)
            outs.append(layer.run_mlp(h, 1.0))
        return torch.cat(outs, 1), keys, values
    simd, portable = libraries(run)
    assert all(torch.equal(a, b) for a, b in zip(simd, portable))
