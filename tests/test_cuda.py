"""The CUDA path (`--device cuda`): the plan loop on a GPU gives transformers' own logits there
and the CPU's logits for the same weights, for every architecture, plan kind and cache growth;
speculative greedy equals plain greedy for every drafter (float32 and bfloat16); seeded sampling
draws the same tokens as on the CPU and keeps the target distribution; batches keep each
request's solo output; layers spread over the GPU, CPU memory and disk; GGUF files and the
command line.

Skipped where torch sees no CUDA GPU (CI has none). On a GPU machine: `make test-gpu`.
LAYERPLAN_TEST_GPU=cpu runs the same checks with the CPU standing in for the GPU (to check the
tests themselves on a machine without one)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from layerplan.app.cli import main
from layerplan.decoding.scheduler import generate_batch
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.load import load_model, wrap_model
from layerplan.engine.runner import forward, new_cache
from layerplan.engine.verify import incremental_logits
from layerplan.models.architectures import ModelError
from test_speculative import assert_draws_keep_the_target_distribution
from tiny import ARCHS, VOCAB, tiny_hf
from tiny_gguf import write_tiny_gguf
from tiny_text import save_tiny_with_tokenizer

GPU = torch.device(os.environ.get("LAYERPLAN_TEST_GPU", "cuda"))
pytestmark = pytest.mark.skipif(GPU.type == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch sees none)")
TOL = 1e-4  # float32 on both sides, TF32 off: only the order of additions differs
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8]  # repeats, so lookup drafts have something to find
DRAFTS = ["ngram", "suffix", "suffix:tree", "exit:2", "skip:attn=1;mlp=2", "ngram|exit:3", "window:2,3", "auto"]


@pytest.fixture(autouse=True)
def full_float32_products():
    """cuBLAS's TF32 products keep 10 mantissa bits: off, so float32 means float32 on both sides."""
    kept = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = kept


def ids_for(seed=0, length=14, device=GPU):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator).to(device)


def on_gpu(arch, num_layers=3, dtype=torch.float32, attn="sdpa", seed=0):
    return wrap_model(tiny_hf(arch, num_layers, seed, dtype, attn).to(GPU), name=f"tiny-{arch}-gpu")


def on_cpu(arch, num_layers=3, dtype=torch.float32, attn="sdpa", seed=0):
    return wrap_model(tiny_hf(arch, num_layers, seed, dtype, attn), name=f"tiny-{arch}")


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_full_plan_on_the_gpu_gives_transformers_logits_there_and_the_cpus(arch, attn):
    model = on_gpu(arch, attn=attn)
    assert model.device.type == GPU.type and model.native is None  # the eager engine: the model's own modules
    ids = ids_for()  # 14 tokens: longer than the configs' sliding windows (4, 5)
    with torch.no_grad():
        reference = model.hf(ids).logits
    logits = forward(model, ids)
    assert logits.device.type == GPU.type
    assert largest_difference(logits, reference) < TOL
    assert largest_difference(incremental_logits(model, ids, model.plan()), reference) < TOL  # a cache grown twice
    assert largest_difference(logits, forward(on_cpu(arch, attn=attn), ids.cpu())) < TOL
    assert largest_difference(forward(model, ids.cpu()), logits) < TOL  # ids made on the CPU go to the model


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kind_of_plan_on_the_gpu_gives_the_cpus_logits(arch):
    gpu, cpu = on_gpu(arch, num_layers=4), on_cpu(arch, num_layers=4)
    ids = ids_for(1)
    for text in ["skip:attn=1;mlp=2", "0,1,1,2,3", "0,2,1,3", "exit:2", "0-1,1@0.5,2-3"]:
        plan = gpu.plan(text)
        expected = forward(cpu, ids.cpu(), plan)
        assert largest_difference(forward(gpu, ids, plan), expected) < TOL, text
        assert largest_difference(incremental_logits(gpu, ids, plan), expected) < TOL, text
        # a repeated layer keeps a KV slot per step, on the GPU
        cache = new_cache(plan, capacity=4)
        forward(gpu, ids, plan, cache)
        assert all(k is None or k.device.type == GPU.type for k in cache.keys)


def test_bfloat16_on_the_gpu_follows_transformers_bfloat16():
    """bf16 on both sides, the same kernels on the same modules: the plan loop adds nothing of its own."""
    for arch in ["llama", "qwen2", "gemma3"]:
        model = on_gpu(arch, dtype=torch.bfloat16)
        ids = ids_for(2)
        with torch.no_grad():
            reference = model.hf(ids).logits
        logits = forward(model, ids)
        assert logits.dtype == torch.bfloat16
        scale = reference.float().abs().max().item()
        assert largest_difference(logits, reference) <= 0.02 * scale, arch
        assert torch.equal(logits.argmax(-1).cpu(), reference.argmax(-1).cpu()), arch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_greedy_speculation_on_the_gpu_equals_plain_greedy_for_every_drafter(arch, dtype):
    """float32: token for token. bfloat16 on the eager engine: cuBLAS (and oneDNN) pick their
    kernels by the number of rows, so a verify pass's logits differ from a one-token step's in the
    last bits; the texts agree up to a near-tie of the target's logits, where either token is the
    model's greedy choice within bf16 rounding (the native kernels, CPU-only, are batch-invariant)."""
    model = on_gpu(arch, num_layers=4, dtype=dtype)
    plain = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False).token_ids
    if dtype == torch.float32:  # the CPU's greedy text, from the same weights
        assert generate(on_cpu(arch, num_layers=4), PROMPT, max_new_tokens=24, stop_at_eos=False).token_ids == plain
    for draft in DRAFTS:
        for policy in ["fixed", "adaptive"]:
            result = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False, draft=draft, draft_length=policy)
            assert result.stats["accepted"] <= result.stats["drafted"]
            if dtype == torch.float32:
                assert result.token_ids == plain, (draft, policy)
            else:
                assert_equal_up_to_a_near_tie(model, result.token_ids, plain, (draft, policy))


def assert_equal_up_to_a_near_tie(model, got: list[int], expected: list[int], what) -> None:
    """got == expected, or at their first difference the two tokens' logits (the full context in
    one pass) are within 1/64 of the largest logit: two bf16 steps of rounding apart."""
    if got == expected:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    logits = forward(model, torch.tensor([PROMPT + expected[:first]], device=GPU))[0, -1].float()
    gap = abs(logits[got[first]] - logits[expected[first]]).item()
    assert gap <= logits.abs().max().item() / 64, (what, first, gap)


def test_seeded_sampling_on_the_gpu_draws_the_cpus_tokens():
    """The draws come from the request's CPU generator whatever the logits' device: a seed gives the
    same tokens on the GPU as on the CPU (float32: the probabilities agree to ~1e-6)."""
    params = SamplingParams(temperature=0.9, top_p=0.95)
    gpu, cpu = on_gpu("llama", num_layers=4), on_cpu("llama", num_layers=4)
    for seed in (1, 2, 3):
        on_the_gpu = generate(gpu, PROMPT, max_new_tokens=16, sampling=params, seed=seed, stop_at_eos=False).token_ids
        assert on_the_gpu == generate(cpu, PROMPT, max_new_tokens=16, sampling=params, seed=seed,
                                      stop_at_eos=False).token_ids
        drafted = generate(gpu, PROMPT, max_new_tokens=16, sampling=params, seed=seed, stop_at_eos=False,
                           draft="exit:2", draft_length="fixed").token_ids
        assert drafted == generate(cpu, PROMPT, max_new_tokens=16, sampling=params, seed=seed, stop_at_eos=False,
                                   draft="exit:2", draft_length="fixed").token_ids


def test_speculative_sampling_on_the_gpu_keeps_the_target_distribution():
    """tests/test_speculative.py's check, with the target and its exit draft on the GPU: 3 tokens,
    top-k 3, 1500 seeded runs; the chi-square test against the exact enumeration does not reject at
    p < 0.001 and the total variation distance is below 0.1."""
    assert_draws_keep_the_target_distribution(on_gpu("llama", num_layers=3, seed=2), "exit:1", runs=1500,
                                              most_apart=0.1)


@pytest.mark.parametrize("draft", [None, "suffix", "exit:2"])
def test_a_batch_on_the_gpu_keeps_each_requests_solo_output(draft):
    model = on_gpu("llama", num_layers=4)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9], [1, 2, 3, 1, 2, 3], [42, 17, 42, 17, 42], [7, 8]]
    solo = [generate(model, prompt, max_new_tokens=12, stop_at_eos=False).token_ids for prompt in prompts]
    for max_batch in (2, 4):  # requests join as others leave
        batched = generate_batch(model, prompts, max_new_tokens=12, stop_at_eos=False, max_batch=max_batch, draft=draft)
        assert [result.token_ids for result in batched] == solo, max_batch


def test_layers_spread_over_the_gpu_cpu_memory_and_disk_give_the_plain_models_logits(tmp_path):
    entries = {"": 0 if GPU.type == "cuda" else "cpu", "model.layers.1": "cpu", "model.layers.2": "disk"}
    (tmp_path / "map.json").write_text(json.dumps(entries))
    model = wrap_model(tiny_hf("llama", num_layers=4), name="spread", device_map=str(tmp_path / "map.json"))
    assert model.placement is not None and model.placement.map.offloaded == (2,)
    reference = on_cpu("llama", num_layers=4)
    ids = ids_for(3, device="cpu")
    for text in [None, "0,1,1,2,2,3"]:  # a repeated disk layer: its weights brought in for each of its steps
        plan = reference.plan(text)
        expected = forward(reference, ids, plan)
        assert largest_difference(forward(model, ids, plan), expected) < TOL, text
        assert largest_difference(incremental_logits(model, ids, plan), expected) < TOL, text
    assert generate(model, PROMPT, max_new_tokens=10, stop_at_eos=False).token_ids == generate(
        reference, PROMPT, max_new_tokens=10, stop_at_eos=False).token_ids


def test_block_formats_on_the_gpu_are_refused_in_one_line(tmp_path):
    """A GGUF's block formats run on the CPU's native kernels only: on a GPU it is dequantized."""
    if GPU.type == "cpu":
        pytest.skip("the CPU standing in for the GPU runs block formats")
    path = write_tiny_gguf(tiny_hf("llama", num_layers=3), tmp_path / "tiny.gguf", "Q8_0")
    for dtype in ("stored", "stored-fast", "q4_k"):
        with pytest.raises(ModelError, match=f"--dtype {dtype} runs on the CPU only"):
            load_model(str(path), dtype=dtype, device=GPU.type)


def test_the_command_line_generates_on_the_gpu_what_it_generates_on_the_cpu(tmp_path):
    folder = save_tiny_with_tokenizer(tmp_path / "tiny")
    texts = {}
    for device in (GPU.type, "cpu"):
        result = CliRunner().invoke(main, ["generate", "-m", str(folder), "--dtype", "float32", "--device", device,
                                           "-n", "12", "--draft", "suffix", "hello hello"])
        assert result.exit_code == 0, result.output
        texts[device] = result.stdout
    assert texts[GPU.type] == texts["cpu"] and texts["cpu"].strip()
    auto = CliRunner().invoke(main, ["generate", "-m", str(folder), "--device", GPU.type, "-n", "4", "hello"])
    assert auto.exit_code == 0, auto.output  # --dtype auto: bfloat16 on a GPU


def test_a_chat_on_the_gpu_switches_plans_and_answers_as_fresh_runs(tmp_path):
    """A conversation's cache on the GPU, its kept residual streams too: after /plan the reply
    equals a fresh run of the new plan over the whole history, as on the CPU."""
    from layerplan.app.chat import ChatSession
    from layerplan.decoding.chat_state import ChatSettings

    model = load_model(str(save_tiny_with_tokenizer(tmp_path / "tiny", context=8192)), dtype="float32",
                       device=GPU.type)
    for draft in (None, "suffix:tree"):
        session = ChatSession(model, ChatSettings(max_new_tokens=12, draft=draft), stream_every=1)
        session.reply("hello there")
        session.reply("tell me more")
        assert "from step" in session.set_plan("skip:attn=1")
        reply = session.reply("and then?")
        fresh = generate(model, session.prompt_ids(session.messages[:-1]), plan=model.plan("skip:attn=1"),
                         max_new_tokens=12, sampling=SamplingParams())
        assert reply.totals.reused > 0 and reply.token_ids == fresh.token_ids, draft


def test_the_server_on_the_gpu_batches_concurrent_requests_as_their_solo_runs(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from layerplan.app.serve import create_app
    from servers import serving

    model = load_model(str(save_tiny_with_tokenizer(tmp_path / "tiny")), dtype="float32", device=GPU.type)
    prompts, lengths = ["hello", "the cat sat", "1, 2, 3,", "abcabcabc", "why?"], [20, 7, 13, 16, 4]
    with serving(create_app(model, max_batch=4, draft="suffix")) as base:
        def complete(pair):
            prompt, n = pair
            response = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": model.name, "prompt": prompt, "max_tokens": n, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(complete, zip(prompts, lengths)))
    for prompt, n, reply in zip(prompts, lengths, replies):
        assert reply == generate(model, model.tokenizer(prompt).input_ids, max_new_tokens=n,
                                 sampling=SamplingParams()).text, prompt
