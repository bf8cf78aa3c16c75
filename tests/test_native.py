"""The native engine (engine/native.py, engine/kernels/) against PyTorch and transformers; the library
itself (its build, ABI and checks at load) is tests/test_kernels.py's."""

from __future__ import annotations

import pytest
import torch

from layerplan.decoding.generate import generate
from layerplan.engine import native
from layerplan.engine.executors import use_native
from layerplan.engine.kernel_library import HUGE_PAGE
from layerplan.engine.cache import KVCache
from layerplan.engine.runner import forward, head, new_cache, run_hidden, softcap
from layerplan.engine.tree import TreeShape
from layerplan.models.architectures import arch_spec
from layerplan.models.discovery import parts_of
from tiny import ARCHS, tiny_model

pytestmark = pytest.mark.skipif(native.native_available() is not None, reason=str(native.native_available()))


def _linear(x, w, b):
    return native.linear(x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 32), (37, 45), (130, 16), (5, 7), (256, 300)])
def test_linear_matches_torch_and_is_batch_invariant(dtype, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(17, k, generator=gen).to(dtype)
    reference = torch.nn.functional.linear(x.float(), w.float(), b.float())
    alone = torch.cat([_linear(x[i : i + 1], w, b) for i in range(17)])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in range(1, 18):
        together = _linear(x[:rows], w, b)
        torch.testing.assert_close(together.float(), reference[:rows], atol=tolerance, rtol=tolerance)
        # a row's result does not depend on the rows computed beside it: bit for bit
        assert torch.equal(together, alone[:rows]), f"row results changed with {rows} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_does_not_depend_on_the_thread_count(dtype):
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(1000, 96, generator=gen) / 10).to(dtype)  # 62.5 panels: a partial last one
    x = torch.randn(9, 96, generator=gen).to(dtype)
    packed = native.PackedMatrix([w], [None])
    before = torch.get_num_threads()
    try:
        # more threads than cores: a thread is often descheduled, and the others take panels from
        # its run (see lp_gemm in kernels/gemm.c), which must not change a number
        for rows in (1, 2, 3, 8, 9):
            results = []
            for threads in (1, 2, 3, 5):
                torch.set_num_threads(threads)
                results.extend(packed(x[:rows]) for _ in range(3))
            assert all(torch.equal(results[0], r) for r in results[1:]), f"{rows} rows"
            torch.testing.assert_close(results[0].float(), torch.nn.functional.linear(x[:rows].float(), w.float()),
                                       atol=1e-5 if dtype == torch.float32 else 2e-2,
                                       rtol=1e-5 if dtype == torch.float32 else 2e-2)
    finally:
        torch.set_num_threads(before)


def test_stacked_matrices_equal_separate_ones():
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, 40, generator=gen) for n in (24, 8, 8)]
    biases = [torch.randn(24, generator=gen), None, torch.randn(8, generator=gen)]
    x = torch.randn(5, 40, generator=gen)
    stacked = native.PackedMatrix(parts, biases)(x)
    separate = torch.cat([native.linear(x, w, b) for w, b in zip(parts, biases)], dim=-1)
    assert torch.equal(stacked, separate)


def test_weight_arena_gives_aligned_disjoint_buffers_and_the_same_products(monkeypatch):
    monkeypatch.setattr(native.WeightArena, "CHUNK", 4 << 20)  # small chunks: several in one test
    arena = native.WeightArena()
    sizes = [(1000, torch.float32), (3, torch.bfloat16), (1_100_000, torch.float32), (5, torch.float32),
             (3_000_000, torch.bfloat16)]  # the third and the last do not fit what is left of a chunk
    buffers = [arena.empty(numel, dtype) for numel, dtype in sizes]
    spans = []
    for buffer, (numel, dtype) in zip(buffers, sizes):
        assert buffer.numel() == numel and buffer.dtype == dtype and buffer.is_contiguous()
        assert buffer.data_ptr() % 4096 == 0
        spans.append((buffer.data_ptr(), buffer.data_ptr() + numel * buffer.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "buffers overlap"
    # every chunk starts on a 2 MB page: the first buffer of each begins one
    assert buffers[0].data_ptr() % HUGE_PAGE == 0
    assert buffers[2].data_ptr() % HUGE_PAGE == 0
    assert buffers[4].data_ptr() % HUGE_PAGE == 0
    for buffer in buffers:  # writable to the end, and nothing written spills into a neighbour
        buffer.fill_(1)
    assert all(bool((buffer == 1).all()) for buffer in buffers)
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(300, 70, generator=gen).to(dtype)
        x = torch.randn(8, 70, generator=gen).to(dtype)
        assert torch.equal(native.PackedMatrix([w], [None], arena)(x), native.PackedMatrix([w], [None])(x))


def test_a_model_packs_its_weights_into_its_arena():
    model = tiny_model("llama", 2)
    engine = use_native(model)
    chunks = {t.untyped_storage().data_ptr() for layer in engine.layers for t in (m.packed for m in layer.matrices)}
    assert engine.layers[0].matrices and len(chunks) == 1  # tiny weights: all in the one first chunk


def test_a_sub_layer_left_eager_packs_nothing_into_the_arena():
    model = tiny_model("llama", 1)
    hf_layer = model.hf.model.layers[0]
    # a norm the kernels do not know: the MLP runs eagerly, after the checks that pass
    hf_layer.post_attention_layernorm = torch.nn.LayerNorm(hf_layer.post_attention_layernorm.weight.shape[0])
    model.parts = parts_of(model.hf)
    engine = use_native(model)
    assert "mlp" in engine.layers[0].why and engine.layers[0].mlp is None
    qkv, o = engine.layers[0].matrices  # the attention's only
    used = -(-qkv.packed.numel() * 4 // 4096) * 4096 + -(-o.packed.numel() * 4 // 4096) * 4096
    assert engine.arena._used == used


def test_packing_refuses_what_the_kernels_do_not_take():
    with pytest.raises(native.Unsupported, match="float16"):
        native.PackedMatrix([torch.zeros(4, 4, dtype=torch.float16)], [None])


def _eager_and_native(arch, dtype=torch.float32, layers=3):
    eager, fast = tiny_model(arch, layers, dtype=dtype), tiny_model(arch, layers, dtype=dtype)
    use_native(fast)
    return eager, fast


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_plan_matches_transformers_prefill_and_incremental(arch):
    _, model = _eager_and_native(arch)
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model.hf(ids).logits
    plan = model.plan()
    cache = new_cache(plan)
    chunks = [forward(model, ids[:, :4], plan, cache, 0)]
    chunks += [forward(model, ids[:, i : i + 1], plan, cache, i) for i in range(4, 7)]
    chunks.append(forward(model, ids[:, 7:], plan, cache, 7))  # a 4-token verify-sized pass
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=1e-4)


def test_llama_family_runs_natively():
    for arch in [a for a in ARCHS if arch_spec(a).kernels is not None]:  # the table's rows with a kernel layout
        _, model = _eager_and_native(arch)
        assert model.native.eager_sub_layers() == {}, arch


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mistral"])
@pytest.mark.parametrize("plan_text", ["0,1,1,2", "skip:attn=1;mlp=0", "exit:2", "0,1,2@0.5"])
def test_plans_match_eager(arch, plan_text):
    eager, fast = _eager_and_native(arch)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    plan = eager.plan(plan_text)
    reference = forward(eager, ids, plan, new_cache(plan), 0)
    cache = new_cache(plan)
    out = torch.cat([forward(fast, ids[:, :6], plan, cache, 0)] + [forward(fast, ids[:, i : i + 1], plan, cache, i) for i in range(6, 9)], 1)
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_plans_taken_in_turn_each_run_their_own_steps():
    """step_run answers the plan it was last asked for without hashing it again; a plan asked for
    between two calls of another (a draft's plan between target passes) still gets its own steps,
    and each gives the eager loop's logits for that plan."""
    eager, fast = _eager_and_native("llama")
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(8))
    plans = [fast.plan(), fast.plan("skip:mlp=1"), fast.plan(), fast.plan("exit:2"), fast.plan("skip:mlp=1")]
    runs = [fast.native.step_run(plan, 0, len(plan.active_steps), lambda layer: "") for plan in plans]
    assert runs[0] is runs[2] and runs[1] is runs[4] and len({id(run) for run in runs}) == 3
    for plan in plans:
        got = forward(fast, ids, plan, new_cache(plan), 0)
        torch.testing.assert_close(got, forward(eager, ids, plan, new_cache(plan), 0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,plan_text", [("llama", "0,1,1,2@0.5"), ("gemma3", "skip:attn=1;mlp=0"), ("qwen3", "exit:2")])
def test_one_native_call_equals_the_loop_sub_layer_by_sub_layer(arch, plan_text, dtype):
    _, fast = _eager_and_native(arch, dtype)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    plan = fast.plan(plan_text)
    assert fast.native.step_run(plan, 0, len(plan.active_steps), lambda layer: layer.layer_type) is not None

    def run(observe):
        cache = new_cache(plan)
        chunks = [(0, 6), (6, 8), (8, 9)]
        return torch.cat([head(fast, run_hidden(fast, ids[:, a:b], plan, cache, a, observe=observe))
                          for a, b in chunks], 1)

    # an observer makes the runner take its Python loop, one native call per sub-layer
    assert torch.equal(run(None), run(lambda *args: None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_final_norm_and_head_in_one_kernel_call_match_the_modules(arch, dtype):
    _, fast = _eager_and_native(arch, dtype)
    parts = fast.parts
    assert fast.native._final_norm(parts.final_norm, dtype) is not None  # the kernel path, not the fallback
    hidden = (torch.randn(1, 9, parts.lm_head.in_features, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    with torch.inference_mode():
        modules = softcap(parts, parts.lm_head(parts.final_norm(hidden)))
        together = head(fast, hidden)
        alone = torch.cat([head(fast, hidden[:, i : i + 1]) for i in range(9)], 1)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(together.float(), modules.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(together, alone)  # a row's logits do not depend on the rows beside it


def test_a_final_norm_the_kernels_do_not_know_runs_as_its_module():
    _, fast = _eager_and_native("llama")
    norm = torch.nn.LayerNorm(fast.parts.lm_head.in_features)
    hidden = torch.randn(1, 3, fast.parts.lm_head.in_features, generator=torch.Generator().manual_seed(6))
    assert fast.native._final_norm(norm, torch.float32) is None
    with torch.inference_mode():
        logits = fast.native.head(norm, fast.parts.lm_head, hidden)
        torch.testing.assert_close(logits, fast.parts.lm_head(norm(hidden)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "mistral"])
def test_a_whole_pass_in_one_native_call_equals_its_parts(arch, dtype):
    _, fast = _eager_and_native(arch, dtype)
    plan = fast.plan("0,1,1,2")  # a repeated layer: two cache slots for one module
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(8))
    tree = TreeShape((-1, 0, 0, 1)) if arch != "mistral" else None  # trees need full attention

    def run(one_call: bool):
        cache, outs = new_cache(plan), []
        for a, b, last_only in [(0, 5, False), (5, 7, True), (7, 8, False)]:
            if one_call:
                assert fast.executor.whole_pass(fast, ids[:, a:b], plan, None, a, last_only, None) is None  # no cache
                outs.append(forward(fast, ids[:, a:b], plan, cache, a, last_only=last_only))
            else:
                hidden = run_hidden(fast, ids[:, a:b], plan, cache, a)
                outs.append(head(fast, hidden[:, -1:] if last_only else hidden))
        if one_call:
            outs.append(fast.executor.whole_pass(fast, ids[:, 8:12], plan, cache, 8, False, tree))
        else:
            outs.append(head(fast, run_hidden(fast, ids[:, 8:12], plan, cache, 8, tree=tree)))
        return torch.cat(outs, 1)

    assert torch.equal(run(True), run(False))


def test_one_native_call_leaves_what_it_does_not_take_to_the_modules():
    _, gemma = _eager_and_native("gemma3")  # its embedding is scaled: not a plain lookup
    assert gemma.native.pass_ends(gemma.parts, 3) is None
    _, llama = _eager_and_native("llama")
    assert llama.native.pass_ends(llama.parts, 3) is not None
    plan = llama.plan()
    with pytest.raises(IndexError, match="token id 96 is outside the vocabulary"):
        forward(llama, torch.tensor([[5, 96, 7]]), plan, new_cache(plan), 0)


def test_architectures_the_kernels_are_not_checked_for_run_eagerly():
    model = tiny_model("gpt2")
    use_native(model)
    assert set(model.native.eager_sub_layers().values()) == {"the kernels are not checked for gpt2 layers"}


def test_bf16_close_to_eager():
    eager, fast = _eager_and_native("llama", torch.bfloat16)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    plan = eager.plan()
    reference = forward(eager, ids, plan, new_cache(plan), 0).float()
    out = forward(fast, ids, plan, new_cache(plan), 0).float()
    assert (out - reference).abs().max() < 0.05 * reference.abs().max()


def test_windowed_read_matches_eager():
    eager, fast = _eager_and_native("llama")
    ids = torch.randint(3, 96, (1, 14), generator=torch.Generator().manual_seed(4))
    plan = eager.plan()
    results = []
    for model in (eager, fast):
        cache = new_cache(plan)
        forward(model, ids[:, :10], plan, cache, 0)
        cache.read_window = (2, 3)
        results.append(torch.cat([forward(model, ids[:, i : i + 1], plan, cache, i) for i in range(10, 14)], 1))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)


def test_reserve_refuses_a_gap_unless_filling():
    cache = KVCache(1, 8)
    cache.write_pos = 0
    cache.reserve(0, 3, 1, 2, 4, 4, torch.float32, torch.device("cpu"))
    cache.write_pos = 5
    with pytest.raises(RuntimeError, match="holds 3 positions"):
        cache.reserve(0, 6, 1, 2, 4, 4, torch.float32, torch.device("cpu"))
    cache.fill_gaps = True
    keys, _ = cache.reserve(0, 6, 1, 2, 4, 4, torch.float32, torch.device("cpu"))
    assert cache.lengths[0] == 6 and keys[:, :, 3:5].abs().sum() == 0


@pytest.mark.parametrize("draft", ["ngram", "exit:2", "skip:attn=1", "window:1,3", "dynamic:confidence=0.5,min=1", "ngram|exit:2"])
def test_speculative_greedy_equals_plain_through_native(draft):
    _, model = _eager_and_native("llama", layers=4)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    plain = generate(model, prompt, max_new_tokens=24, stop_at_eos=False)
    spec = generate(model, prompt, max_new_tokens=24, stop_at_eos=False, draft=draft)
    assert spec.token_ids == plain.token_ids


def test_bf16_speculative_greedy_equals_plain_thanks_to_batch_invariance():
    _, model = _eager_and_native("llama", torch.bfloat16, layers=4)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    plain = generate(model, prompt, max_new_tokens=32, stop_at_eos=False)
    for draft in ("ngram", "exit:2", "skip:mlp=1"):
        assert generate(model, prompt, max_new_tokens=32, stop_at_eos=False, draft=draft).token_ids == plain.token_ids


def test_resolve_engine():
    assert native.resolve_engine("eager", torch.float32, "cpu") == "eager"
    assert native.resolve_engine("auto", torch.float32, "cpu") == "native"
    assert native.resolve_engine("auto", torch.float16, "cpu") == "eager"
    with pytest.raises(native.NativeUnavailable, match="float16"):
        native.resolve_engine("native", torch.float16, "cpu")
    with pytest.raises(ValueError, match="unknown engine 'fast'; choose from auto, native, eager"):
        native.resolve_engine("fast", torch.float32, "cpu")


def test_one_native_model_runs_plan_after_plan():
    """Nothing is specialised to a plan: the same model runs different plans in turn, each exact."""
    eager, fast = _eager_and_native("qwen3", layers=4)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(5))
    for text in ("full", "0,1,1,2,3", "skip:attn=2", "exit:3", "full", "3,2,1,0"):
        plan = eager.plan(text)
        cache = new_cache(plan)
        out = torch.cat([forward(fast, ids[:, :5], plan, cache, 0), forward(fast, ids[:, 5:], plan, cache, 5)], 1)
        torch.testing.assert_close(out, forward(eager, ids, plan, new_cache(plan), 0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_pass_without_cache_matches_eager(arch):
    """Scans and searches run chunks without a KV cache: the tokens attend to each other only."""
    eager, fast = _eager_and_native(arch)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(6))
    for start in (0, 5):
        torch.testing.assert_close(forward(fast, ids, None, None, start), forward(eager, ids, None, None, start),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_of_no_tokens_do_nothing(dtype):
    w = torch.randn(40, 24).to(dtype)
    assert native.linear(torch.empty(0, 24, dtype=dtype), w).shape == (0, 40)
    _, model = _eager_and_native("llama", dtype)
    layer = model.native.layers[0]
    empty = torch.empty(1, 0, model.hf.config.hidden_size, dtype=dtype)
    assert layer.run_mlp(empty, 1.0).shape == empty.shape


def _wide_head_llama(dtype, head_dim=64):
    """A llama with SmolLM2's head shape (head_dim 64, 3 query heads per kv head), so that the
    attention's 64-lane value sums and a pass's shared keys run as they do on the real model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from layerplan.models.loading import wrap_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=3 * head_dim, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256)
    model = wrap_model(AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval(),
                       name="wide-head-llama")
    use_native(model)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["tiny", "wide-head"])
def test_a_pass_gives_each_token_the_logits_of_decoding_it_alone(dtype, shape):
    """Batch invariance of the whole model: a pass over k tokens (a verify) and k one-token steps
    give bit-identical logits, for every k up to 12 (row groups, shared keys and per-row work in
    parallel change with k; the numbers may not)."""
    model = _eager_and_native("llama", dtype)[1] if shape == "tiny" else _wide_head_llama(dtype)
    ids = torch.randint(3, 96, (1, 19), generator=torch.Generator().manual_seed(11))
    plan = model.plan()
    cache = new_cache(plan)
    forward(model, ids[:, :7], plan, cache, 0)
    alone = torch.cat([forward(model, ids[:, p:p + 1], plan, cache, p) for p in range(7, 19)], 1)
    for k in range(1, 13):
        cache.crop(7)
        together = forward(model, ids[:, 7:7 + k], plan, cache, 7)
        assert torch.equal(together, alone[:, :k]), f"a pass over {k} tokens changed a token's logits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 36])
def test_a_pass_over_a_long_context_gives_each_token_the_logits_of_decoding_it_alone(dtype, head_dim):
    """The attention goes through the cache in runs of positions (4096 / head_dim of them), every
    query of a kv head through each run before the next: after 150 cached positions (several runs,
    a query's own range ending inside one), a pass over k tokens and k one-token steps still give
    bit-identical logits, with head dims of one 64-lane block, two, and one with a tail past the
    last eight; and the pass agrees with transformers."""
    model = _wide_head_llama(dtype, head_dim)
    ids = torch.randint(3, 96, (1, 162), generator=torch.Generator().manual_seed(5))
    plan = model.plan()
    cache = new_cache(plan, capacity=170)
    forward(model, ids[:, :150], plan, cache, 0)
    alone = torch.cat([forward(model, ids[:, p:p + 1], plan, cache, p) for p in range(150, 162)], 1)
    for k in (2, 5, 8, 12):
        cache.crop(150)
        together = forward(model, ids[:, 150:150 + k], plan, cache, 150)
        assert torch.equal(together, alone[:, :k]), f"a pass over {k} tokens changed a token's logits"
    if dtype == torch.float32:
        with torch.inference_mode():
            expected = model.hf(ids).logits[:, 150:]
        torch.testing.assert_close(alone, expected, atol=1e-4, rtol=1e-4)
