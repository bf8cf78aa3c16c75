"""The light front end (layerplan/lite/): the torch front end's logits bit for bit on stored GGUF
weights, the command lines it takes (and leaves to the torch front end), the rotary tables both
front ends share."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import tiny_hf
from tiny_gguf import write_tiny_gguf

from layerplan.engine import load, native
from layerplan.engine.choices import STORED_ARITHMETIC
from layerplan.engine.load import load_model
from layerplan.engine.rope_tables import rope_rows
from layerplan.engine.runner import forward, new_cache
from layerplan.app.cli.generating import light_request
from layerplan.app.cli.scoring import light_ppl_request, light_scan_request
from layerplan.app.cli.exploring import light_explore_request
from layerplan.app.cli.exporting import light_export_request
from layerplan.app.cli.searching import light_search_request
from layerplan.app.cli.timing import light_bench_request, light_frontier_request, light_probe_request
from layerplan.decoding.budget import UNTIL_CONTEXT
from layerplan.decoding.generate import generate
from layerplan.decoding.loop import DecodeLoop
from layerplan.lite.exporting import run_export
from layerplan.lite.request import LiteExportRequest, LiteRequest
from layerplan.lite import TorchFrontEnd
from layerplan.lite.model import LiteModel, lite_refusal
from layerplan.models.arch_table import ARCHITECTURES
from layerplan.models.errors import ModelError
from layerplan.models.gguf_place import INDEX_VERSION, TENSORS_FILE, index_folder

PLANS = (None, "0,1,1,2", "exit:2", "skip:attn=1;mlp=0", "2,0,1")
PROMPT = [5, 17, 3, 88, 41, 9, 60]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))


def _wide_llama():
    """A llama of 256 wide (the K-quants' blocks are 256 inputs)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config).eval()


def _qwen3():
    """A tiny Qwen3 of head_dim 128: the head_dim transformers' GGUF reader gives every Qwen3 file
    (it reads no key length; the real models' heads are 128 wide)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config).eval()


def _pair(tmp_path, arch: str, matrix_type: str, dtype: str, types: dict | None = None, modules: bool = False):
    """(the tiny GGUF on the torch front end, which indexes it and keeps its panels; the same file
    on the light front end). modules: the torch front end describes its layers from its modules
    (engine/native.py NativeLayer) rather than from the file (engine/file_kernels.py)."""
    hf = {"wide-llama": _wide_llama, "qwen3": _qwen3,
          # six layers: the sixth is full attention (transformers' Gemma 3 default pattern), the rest sliding
          "gemma3": lambda: tiny_hf("gemma3", num_layers=6)}.get(arch, lambda: tiny_hf(arch, num_layers=3))()
    path = write_tiny_gguf(hf, tmp_path / f"{arch}.gguf", matrix_type, types)
    with pytest.MonkeyPatch.context() as patch:
        if modules:
            for module in (load, native):
                patch.setattr(module, "file_refusal", lambda index: "described by its modules here")
        model = load_model(path, dtype=dtype, engine="native")
    assert (model.native.file is None) == modules
    return model, LiteModel(path, STORED_ARITHMETIC[dtype], threads=2)


PARITY_CASES = [
    ("llama", "Q4_1", None), ("qwen2", "Q4_0", None), ("llama", "Q8_0", {"attn_v": "Q4_0", "ffn_down": "Q5_1"}),
    ("wide-llama", "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"}), ("qwen3", "Q8_0", None), ("gemma3", "Q8_0", None)]
# a case's model type, where its name is not one (config.json's model_type)
_CASE_TYPES = {"wide-llama": "llama", "gemma3": "gemma3_text"}


@pytest.mark.parametrize("arch,matrix_type,types", PARITY_CASES)
@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_the_light_front_end_gives_the_torch_front_ends_logits(tmp_path, arch, matrix_type, types, dtype):
    """Every plan's prompt pass (every row's logits) and the decoding steps after it: the same bits.
    The torch front end's layers described from its modules here, so the file's descriptors
    (engine/file_kernels.py, which the light front end runs) meet the modules' (native.py)."""
    model, lite = _pair(tmp_path, arch, matrix_type, dtype, types, modules=True)
    assert model.native is not None and not model.native.eager_sub_layers()
    assert lite.packed.packed_here == 0  # it stacks as native.py does: every panel was kept by the torch load
    for text in PLANS:
        plan, lite_plan = model.plan(text), lite.plan(text)
        assert lite_plan == plan
        cache, lite_cache = new_cache(plan, 64), lite.new_cache(lite_plan, 64)
        want = forward(model, torch.tensor([PROMPT]), plan, cache)[0].numpy()
        assert np.array_equal(lite.logits(PROMPT, lite_cache, 0, last_only=False), want), text
        for i, token in enumerate((7, 80, 2)):
            position = len(PROMPT) + i
            want = forward(model, torch.tensor([[token]]), plan, cache, position, last_only=True)[0].numpy()
            assert np.array_equal(lite.logits([token], lite_cache, position), want), (text, i)


@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_one_decode_loop_gives_both_front_ends_the_same_tokens(tmp_path, dtype):
    """decoding/loop.py's loop on a LiteModel (lite/cli.py's decode) and the torch front end's
    generate on the same file: the same greedy tokens, stop reason and prompt count, through a
    plan that repeats a layer too."""
    model, lite = _pair(tmp_path, "llama", "Q4_1", dtype)
    for text in (None, "0,1,1,2"):
        want = generate(model, PROMPT, model.plan(text), max_new_tokens=12, stop_at_eos=False)
        got = DecodeLoop(lite, PROMPT, lite.plan(text), 12, stop_at_eos=False).run()
        assert (got.token_ids, got.stop_reason, got.prompt_tokens, got.plan) == (
            want.token_ids, want.stop_reason, want.prompt_tokens, want.plan), text
        assert len(got.token_ids) == 12


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_lookup_drafts_on_the_light_model_give_the_torch_front_ends_rounds(tmp_path, arch, dtype):
    """decoding/rounds.py's loop on a LiteModel (lite/cli.py's drafted decode): greedy, the plain
    decode's tokens; greedy and seeded sampled, the torch front end's rounds on the same file (the
    same tokens, drafts and acceptances: its logits are the same bits), through a plan too."""
    from layerplan.decoding.drafters.ngram import NgramDrafter
    from layerplan.decoding.drafters.suffix import SuffixDrafter
    from layerplan.decoding.rounds import SpeculativeLoop
    from layerplan.decoding.sampling_params import SamplingParams

    model, lite = _pair(tmp_path, arch, "Q8_0", dtype)
    prompt = PROMPT * 3  # (repeats: the lookups find something to propose)
    sampled = SamplingParams(temperature=0.3, top_k=20)
    for text, make, sampling, seed in [(None, NgramDrafter, None, None), ("0,1,1,2", SuffixDrafter, None, None),
                                       (None, SuffixDrafter, sampled, 4), ("exit:2", NgramDrafter, sampled, 9)]:
        plain = DecodeLoop(lite, prompt, lite.plan(text), 24, stop_at_eos=False, sampling=sampling, seed=seed).run()
        got = SpeculativeLoop(lite, prompt, lite.plan(text), make(), 24, stop_at_eos=False, sampling=sampling,
                              seed=seed, draft_length="fixed").run()
        want = generate(model, prompt, model.plan(text), max_new_tokens=24, stop_at_eos=False, sampling=sampling,
                        seed=seed, draft=make(), draft_length="fixed")
        assert got.token_ids == want.token_ids, (text, make)
        assert sampling is not None or got.token_ids == plain.token_ids, text
        rounds = ("rounds", "drafted", "accepted", "emitted", "drafted_at", "accepted_at")
        assert [got.stats[k] for k in rounds] == [want.stats[k] for k in rounds], (text, make)
        assert got.stats["drafted"] > 0 and len(got.token_ids) == 24


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_self_drafts_on_the_light_model_give_the_torch_front_ends_rounds(tmp_path, arch, dtype):
    """A sub-plan of the model as its own draft (an exit, skipped sub-layers, a window; `|` after
    a lookup; auto over them) on a LiteModel, its steps writing the target's slots (LiteCache.draft_view):
    greedy, the plain decode's tokens; greedy and seeded sampled, the torch front end's rounds
    on the same file (the same tokens, drafts, acceptances and q), through a plan too."""
    from layerplan.decoding.drafters.registry import make_drafter
    from layerplan.decoding.rounds import SpeculativeLoop
    from layerplan.decoding.sampling_params import SamplingParams

    model, lite = _pair(tmp_path, arch, "Q8_0", dtype)
    prompt = PROMPT * 2
    sampled = SamplingParams(temperature=0.8, top_k=30)
    last = lite.num_layers - 1
    cases = [(None, "exit:1", None, None), (None, f"skip:mlp={last}", None, None), ("0,1,1,2", "exit:3", sampled, 5),
             (None, f"skip:attn=1;mlp={last}", sampled, 8), (None, "ngram|exit:2", None, None),
             (None, "window:2,5", None, None), (None, "window:1,4/exit:2", sampled, 3)]
    for text, spec, sampling, seed in cases:
        plain = DecodeLoop(lite, prompt, lite.plan(text), 20, stop_at_eos=False, sampling=sampling, seed=seed).run()
        plan = lite.plan(text)
        got = SpeculativeLoop(lite, prompt, plan, make_drafter(spec, lite, plan, 0.0), 20, stop_at_eos=False,
                              sampling=sampling, seed=seed, draft_length="fixed").run()
        want = generate(model, prompt, model.plan(text), max_new_tokens=20, stop_at_eos=False, sampling=sampling,
                        seed=seed, draft=spec, draft_length="fixed")
        assert got.token_ids == want.token_ids, (text, spec)
        assert sampling is not None or got.token_ids == plain.token_ids, (text, spec)
        rounds = ("rounds", "drafted", "accepted", "emitted", "drafted_at", "accepted_at")
        assert [got.stats[k] for k in rounds] == [want.stats[k] for k in rounds], (text, spec)
        assert got.stats["drafted"] > 0 and len(got.token_ids) == 20
    # auto (drafters/arbiter.py) picks by measured time: its greedy tokens are plain's all the same
    plain = DecodeLoop(lite, prompt, lite.plan(), 20, stop_at_eos=False).run()
    got = SpeculativeLoop(lite, prompt, lite.plan(), make_drafter("auto", lite, lite.plan()), 20,
                          stop_at_eos=False).run()
    assert got.token_ids == plain.token_ids


@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_a_draft_model_on_the_light_front_end_gives_the_torch_front_ends_rounds(tmp_path, dtype):
    """--draft model:PATH (-md) with a GGUF of the same vocabulary: on the light front end a
    LiteModel of it (LiteModel.load_draft), on the torch one the file as stored in the target's
    arithmetic (never dequantized whole): the same rounds, greedy (plain's tokens) and seeded
    sampled (the same q). Its cache grows as the context does (LiteModel.with_room)."""
    from transformers import AutoModelForCausalLM
    from tiny import tiny_config

    from layerplan.decoding.drafters.registry import make_drafter
    from layerplan.decoding.rounds import SpeculativeLoop
    from layerplan.decoding.sampling_params import SamplingParams

    model, lite = _pair(tmp_path, "llama", "Q8_0", dtype)
    small = write_tiny_gguf(tiny_hf("llama", num_layers=2, seed=1), tmp_path / "small.gguf", "Q8_0")
    spec = f"model:{small}"
    prompt = PROMPT * 2
    for sampling, seed in ((None, None), (SamplingParams(temperature=0.8, top_k=30), 4)):
        plan = lite.plan()
        drafter = make_drafter(spec, lite, plan, load_draft=lite.load_draft)
        assert isinstance(drafter.model, LiteModel) and drafter.model.arithmetic == lite.arithmetic
        got = SpeculativeLoop(lite, prompt, plan, drafter, 100, stop_at_eos=False, sampling=sampling, seed=seed,
                              draft_length="fixed").run()
        want = generate(model, prompt, model.plan(), max_new_tokens=100, stop_at_eos=False, sampling=sampling,
                        seed=seed, draft=spec, draft_length="fixed")
        assert got.token_ids == want.token_ids
        rounds = ("rounds", "drafted", "accepted", "emitted", "drafted_at", "accepted_at")
        assert [got.stats[k] for k in rounds] == [want.stats[k] for k in rounds]
        if sampling is None:
            assert got.token_ids == DecodeLoop(lite, prompt, plan, 100, stop_at_eos=False).run().token_ids
    cache = lite.new_cache(lite.plan(), 16)
    lite.logits(PROMPT, cache, 0)
    assert lite.with_room(cache, 16) is cache
    grown = lite.with_room(cache, 20)
    assert grown.capacity == 32 and grown.length == len(PROMPT)
    assert np.array_equal(grown.slots[0][0][:, :len(PROMPT)], cache.slots[0][0][:, :len(PROMPT)])
    config = tiny_config("llama", 2)
    config.vocab_size = 64
    other = write_tiny_gguf(AutoModelForCausalLM.from_config(config).eval(), tmp_path / "other.gguf", "Q8_0")
    with pytest.raises(ValueError, match="vocabulary"):  # (the torch front end's check, in its words)
        make_drafter(f"model:{other}", lite, load_draft=lite.load_draft)


def test_the_light_model_reads_this_machines_probe_row_without_torch(tmp_path):
    """The probe a torch process cached (engine/probe_rows.py: keyed without torch) gives the light
    front end its native row for the model's arithmetic: its verify costs for a draft, its pace;
    eager rows (torch's products) are not its own."""
    from layerplan.engine.probe_rows import ProbeResult, ProbeRow, machine_key_of, probe_path_of
    from layerplan.files import cache_dir, write_json_atomic

    _, lite = _pair(tmp_path, "llama", "Q8_0", "stored-fast")
    assert lite.probe_row() is None  # none cached
    fast = ProbeRow("native", "stored-fast", 5.0, {1: 1.0, 2: 1.2, 4: 1.5})
    exact = ProbeRow("native", "stored", 7.0, {1: 1.0, 2: 1.6})
    eager = ProbeRow("eager", "stored-fast", 9.0, {1: 1.0, 2: 1.9}, torch="2.x AVX512")
    result = ProbeResult(machine_key_of(lite.threads), "cpu", lite.name, [eager, exact, fast])
    write_json_atomic(probe_path_of(cache_dir(), lite.name, lite.threads), result.to_dict())
    assert lite.probe_row() == fast
    assert LiteModel(tmp_path / "llama.gguf", "exact", threads=lite.threads).probe_row() == exact
    assert LiteModel(tmp_path / "llama.gguf", "fast", threads=lite.threads + 1).probe_row() is None  # another key


def test_a_light_bench_checks_its_probe_row_as_the_torch_front_end_does(tmp_path):
    """lite/probing.py checked_row: a cached row whose step a step timed now agrees with (within
    RECHECK_RATIO) is the row as cached; one a thousand times off is timed again, over the same
    pass lengths, and replaces the cached row on disk, the other rows kept."""
    from layerplan.engine.probe_rows import ProbeResult, ProbeRow, machine_key_of, probe_path_of, read_probe
    from layerplan.engine.probing import ids_needed, timed_passes
    from layerplan.files import cache_dir, write_json_atomic
    from layerplan.lite.probing import LiteTimedPasses, checked_row

    _, lite = _pair(tmp_path, "llama", "Q8_0", "stored-fast")
    assert checked_row(lite) is None  # none cached
    path = probe_path_of(cache_dir(), lite.name, lite.threads)
    exact = ProbeRow("native", "stored", 7.0, {1: 1.0, 2: 1.6})
    step_ms = 1000 * timed_passes(LiteTimedPasses(lite, ids_needed((1,))), (1,), 3)[1]
    agreeing = ProbeRow("native", "stored-fast", step_ms, {1: 1.0, 2: 1.2})
    write_json_atomic(path, ProbeResult(machine_key_of(lite.threads), "cpu", lite.name, [exact, agreeing]).to_dict())
    assert checked_row(lite) == agreeing  # (within 2x of a step timed now, on a quiet machine)
    stale = ProbeRow("native", "stored-fast", 1e6, {1: 1.0, 2: 1.2})  # a thousand seconds a step
    write_json_atomic(path, ProbeResult(machine_key_of(lite.threads), "cpu", lite.name, [exact, stale]).to_dict())
    notes = []
    row = checked_row(lite, notes.append)
    assert notes[0].startswith("probe native stored-fast: a step took ") and "measuring the row again" in notes[0]
    if row == stale:  # the tiny model's new timings failed their checks, or the machine was busy: kept
        assert "the cached row stays" in notes[-1]
        assert read_probe(cache_dir(), lite.name, lite.threads).rows == [exact, stale]
    else:
        assert (row.engine, row.dtype, sorted(row.relative)) == ("native", "stored-fast", [1, 2]) and row.step_ms < 1e6
        assert read_probe(cache_dir(), lite.name, lite.threads).rows == [exact, row]


@pytest.mark.parametrize("arch,matrix_type", [("llama", "Q8_0"), ("gemma3", "Q4_0")])
def test_the_light_probe_times_the_passes_and_counts_the_bytes_the_torch_front_ends_does(tmp_path, arch, matrix_type):
    """engine/probing.py's timing over the light model's passes: a step's one-token passes back to
    back, a verify pass's every row, the cache cut back to the context between them; the matrices
    a step reads are the torch front end's count (a tied head counts, the embedding's lookups do
    not)."""
    from layerplan.engine.probe import streamed_matrix_bytes
    from layerplan.engine.probing import STEP_RUN, ids_needed, timed_passes
    from layerplan.lite.probing import LiteTimedPasses, streamed_bytes

    model, lite = _pair(tmp_path, arch, matrix_type, "stored-fast")
    assert streamed_bytes(lite) == streamed_matrix_bytes(model, torch.float32)
    passes = LiteTimedPasses(lite, ids_needed((1, 2, 4), context=8))
    calls = []
    run = passes.run
    passes.run = lambda position, count: (calls.append((position, count, passes.cache.length)), run(position, count))
    times = timed_passes(passes, (1, 2, 4), repeats=1, context=8)
    assert set(times) == {1, 2, 4} and all(t > 0 for t in times.values())
    # each round: STEP_RUN steps on from the context, then a 2- and a 4-token pass at it
    round_calls = [(8 + j, 1, 8 + j) for j in range(STEP_RUN)] + [(8, 2, 8), (8, 4, 8)]
    assert calls == round_calls * 2
    full = lite.logits(passes.ids[:12], lite.new_cache(lite.plan(), 13), 0, last_only=False)
    assert np.array_equal(lite.logits(passes.ids[8:12], passes.cache, 8, last_only=False), full[8:])


def test_a_kept_probe_with_eager_rows_is_the_torch_front_ends_to_show(tmp_path):
    """Only the torch front end can tell an eager row's torch build from its own: the light probe
    leaves such a kept probe to it (None), unless --refresh times the rows afresh."""
    from layerplan.engine.probe_rows import ProbeResult, ProbeRow, machine_key_of, probe_path_of
    from layerplan.files import cache_dir, write_json_atomic
    from layerplan.lite.probing import run_probe
    from layerplan.lite.research_request import LiteProbeRequest

    path = write_tiny_gguf(tiny_hf("llama", num_layers=2), tmp_path / "llama.gguf", "Q8_0")
    request = LiteProbeRequest(model=str(path), threads=2, dtypes=["stored-fast"], max_length=2, repeats=1)
    rows = [ProbeRow("native", "stored-fast", 5.0, {1: 1.0, 2: 1.2}),
            ProbeRow("eager", "float32", 9.0, {1: 1.0, 2: 1.9}, torch="2.x AVX512")]
    kept = ProbeResult(machine_key_of(2), "cpu", "llama", rows)
    write_json_atomic(probe_path_of(cache_dir(), "llama", 2), kept.to_dict())
    assert run_probe(request) is None
    assert run_probe(LiteProbeRequest(**{**request.__dict__, "refresh": True, "as_json": True})) == 0


def test_a_draft_view_writes_the_targets_slots_and_no_others(tmp_path):
    """A draft plan's pass through LiteCache.draft_view writes the target's slots of the steps it
    runs (the verify pass writes them again), at the drafted position only, and no other step's."""
    _, lite = _pair(tmp_path, "llama", "Q8_0", "stored")
    plan = lite.plan()
    cache = lite.new_cache(plan, 32)
    lite.logits(PROMPT, cache, 0)
    before = [(keys.copy(), values.copy()) for keys, values in cache.slots]
    draft = lite.plan("skip:attn=1;mlp=2")
    position = len(PROMPT)
    lite.draft_logits(7, position, draft, cache)
    assert cache.draft_view(draft) is cache.draft_view(draft) and cache.length == len(PROMPT)
    for step, ((keys, values), (old_keys, old_values)) in enumerate(zip(cache.slots, before)):
        changed = not np.array_equal(keys[:, position], old_keys[:, position])
        assert changed == (step != 1), step  # step 1's attention is off in the draft
        assert np.array_equal(keys[:, :position], old_keys[:, :position])
        assert np.array_equal(values[:, position + 1:], old_values[:, position + 1:])
    with pytest.raises(TorchFrontEnd, match="draft head"):
        lite.draft_logits(7, position, draft, cache, draft_head=lambda hidden: hidden)


@pytest.mark.parametrize("arch,matrix_type,types", PARITY_CASES)
def test_the_torch_front_end_runs_a_gguf_by_the_files_descriptors(tmp_path, arch, matrix_type, types):
    """A GGUF whose model the file describes runs its layers, final norm and LM head by the file's
    descriptors on the torch front end too (one builder): the logits of the modules' descriptors,
    every row, through a plan that repeats and skips."""
    by_modules, _ = _pair(tmp_path, arch, matrix_type, "stored", types, modules=True)
    model = load_model(tmp_path / f"{arch}.gguf", dtype="stored", engine="native")
    assert model.native.file is not None and all(layer.matrices == () for layer in model.native.layers)
    ids = torch.tensor([PROMPT])
    for text in (None, "0,1,1,2", "exit:2"):
        assert torch.equal(forward(model, ids, model.plan(text)), forward(by_modules, ids, by_modules.plan(text))), text


def test_modules_that_differ_from_the_files_facts_describe_the_model(tmp_path):
    """Where a module computes otherwise than the file says (its attention's scaling changed after
    load), the kernels take the modules' description and compute what the modules do."""
    from layerplan.engine.executors import use_native
    from layerplan.models.loading import load_stored_model

    model, _ = _pair(tmp_path, "llama", "Q8_0", "stored")
    changed = load_stored_model(tmp_path / "llama.gguf")
    changed.parts.layers[1].attention.scaling *= 0.5
    engine = use_native(changed)
    assert engine.file is None and not engine.eager_sub_layers()
    ids = torch.tensor([PROMPT])
    eager = load_stored_model(tmp_path / "llama.gguf")
    eager.parts.layers[1].attention.scaling *= 0.5
    for layer in eager.parts.layers:
        eager.stored.materialize(layer.attention)
        eager.stored.materialize(layer.mlp)
    got = forward(changed, ids)
    assert torch.allclose(got, forward(eager, ids), atol=1e-4) and not torch.allclose(got, forward(model, ids), atol=1e-2)


def test_panels_packed_from_the_files_rows_give_the_same_logits(tmp_path, monkeypatch):
    """Without kept panels (LAYERPLAN_PANEL_CACHE=0) the light front end packs the file's rows
    itself (stored_pack.py, as the torch front end does): the same bits."""
    model, _ = _pair(tmp_path, "qwen2", "Q8_0", "stored")
    monkeypatch.setenv("LAYERPLAN_PANEL_CACHE", "0")
    lite = LiteModel(tmp_path / "qwen2.gguf", threads=2)
    assert lite.packed.packed_here > 0 and lite.packed.panels is None
    plan = model.plan()
    want = forward(model, torch.tensor([PROMPT]), plan, new_cache(plan, 64))[0].numpy()
    assert np.array_equal(lite.logits(PROMPT, lite.new_cache(lite.plan(), 64), 0, last_only=False), want)


def test_a_kept_entry_cut_short_is_packed_again(tmp_path, monkeypatch):
    """An entry cut short between finding it and reading it (another process's eviction, a full
    disk): lp_read_files reports it, and that stack is packed from the file's rows and kept again:
    the same logits."""
    from layerplan.engine.panel_cache import PanelCache

    model, first = _pair(tmp_path, "llama", "Q4_1", "stored")
    entry = max(first.packed.panels.folder.glob("*.panels"), key=lambda p: p.stat().st_size)
    whole = entry.stat().st_size
    entry.write_bytes(entry.read_bytes()[:100])
    monkeypatch.setattr(PanelCache, "kept", lambda self, *wanted: self._entry(*wanted))  # found before the cut
    lite = LiteModel(tmp_path / "llama.gguf", threads=2)
    assert lite.packed.packed_here == 1 and entry.stat().st_size == whole  # packed, and kept whole again
    plan = model.plan()
    want = forward(model, torch.tensor([PROMPT]), plan, new_cache(plan, 64))[0].numpy()
    assert np.array_equal(lite.logits(PROMPT, lite.new_cache(lite.plan(), 64), 0, last_only=False), want)


def test_the_architectures_it_runs_are_the_tables_light_rows_each_checked_above(tmp_path):
    """The table's `light` mark is what lets an architecture in, and each marked one has a parity
    case; a row with kernels but no mark (Mistral) is left to the torch front end."""
    light = {model_type for model_type, spec in ARCHITECTURES.items() if spec.kernels is not None and spec.kernels.light}
    assert light and light <= {_CASE_TYPES.get(arch, arch) for arch, _, _ in PARITY_CASES}
    index = tmp_path / "mistral-index"
    index.mkdir()
    (index / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_act": "silu"}))
    (index / TENSORS_FILE).write_text(json.dumps({"version": INDEX_VERSION, "rotary": {"inv_freq": [1.0]},
                                                  "tensors": []}))
    assert ARCHITECTURES["mistral"].kernels is not None
    assert lite_refusal(index) == "architecture 'mistral' runs on the torch front end"


def test_a_file_never_seen_is_indexed_by_the_light_model_itself(tmp_path):
    """LiteModel on a file with no index yet (the library without torch): it makes the index from
    the file and packs the panels, and gives the torch front end's logits, which then load from both."""
    path = write_tiny_gguf(tiny_hf("qwen2", num_layers=3), tmp_path / "fresh.gguf", "Q8_0")
    assert "no index" in lite_refusal(index_folder(path))
    lite = LiteModel(path, threads=2)
    assert lite.packed.packed_here > 0 and lite_refusal(index_folder(path)) is None
    model = load_model(path, dtype="stored", engine="native")
    plan = model.plan()
    want = forward(model, torch.tensor([PROMPT]), plan, new_cache(plan, 64))[0].numpy()
    assert np.array_equal(lite.logits(PROMPT, lite.new_cache(lite.plan(), 64), 0, last_only=False), want)


def test_a_file_the_light_front_end_cannot_run_says_why(tmp_path):
    """No index yet, then a stack of matrices of two types (the torch front end dequantizes it)."""
    path = write_tiny_gguf(tiny_hf("llama"), tmp_path / "mixed.gguf", "Q8_0", {"ffn_up": "Q4_0"})
    assert "no index" in lite_refusal(index_folder(path))
    load_model(path, dtype="stored", engine="native")
    assert lite_refusal(index_folder(path)) is None
    with pytest.raises(TorchFrontEnd, match="Q8_0 matrices stacked with others"):
        LiteModel(path)


def test_a_token_outside_the_vocabulary_is_named(tmp_path):
    _, lite = _pair(tmp_path, "llama", "Q8_0", "stored")
    with pytest.raises(ValueError, match="token id 4096 is outside the vocabulary"):
        lite.logits([3, 4096], lite.new_cache(lite.plan(), 8), 0)


@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_a_plan_of_two_models_gives_the_torch_front_ends_logits(tmp_path, dtype):
    """--model-b on the light front end: a plan that interleaves two files' layers (random weights
    of their own) gives the torch front end's logits bit for bit, prompt and steps."""
    paths = [write_tiny_gguf(tiny_hf("llama", num_layers=3, seed=seed), tmp_path / f"{name}.gguf", "Q8_0")
             for name, seed in (("a", 0), ("b", 7))]
    model = load_model(paths[0], dtype=dtype, engine="native")
    model.attach(load_model(paths[1], dtype=dtype, engine="native"), "b")
    lite = LiteModel(paths[0], STORED_ARITHMETIC[dtype], threads=2)
    lite.attach(LiteModel(paths[1], STORED_ARITHMETIC[dtype], threads=2, with_tokenizer=False), "b")
    for text in ("0,b:1,2", "b:0-2", "0,b:1,b:1,2"):
        plan = model.plan(text)
        assert lite.plan(text) == plan
        cache, lite_cache = new_cache(plan, 64), lite.new_cache(plan, 64)
        want = forward(model, torch.tensor([PROMPT]), plan, cache)[0].numpy()
        assert np.array_equal(lite.logits(PROMPT, lite_cache, 0, last_only=False), want), text
        want = forward(model, torch.tensor([[7]]), plan, cache, len(PROMPT), last_only=True)[0].numpy()
        assert np.array_equal(lite.logits([7], lite_cache, len(PROMPT)), want), text
    full = lite.logits(PROMPT, lite.new_cache(lite.plan(), 64), 0)
    assert not np.array_equal(lite.logits(PROMPT, lite.new_cache(lite.plan("b:0-2"), 64), 0), full)


def test_a_second_model_is_refused_in_the_torch_front_ends_words(tmp_path):
    """A plan naming a model not attached, and a model of other sizes: the torch front end's lines."""
    from layerplan.plan.plan import PlanError

    _, lite = _pair(tmp_path, "llama", "Q8_0", "stored")
    with pytest.raises(PlanError, match="only a is loaded"):
        lite.plan("0,b:1")
    other = LiteModel(write_tiny_gguf(_wide_llama(), tmp_path / "wide.gguf", "Q8_0"), "exact", with_tokenizer=False)
    with pytest.raises(PlanError, match="does not match .*: hidden_size is 256, not"):
        lite.attach(other, "b")


@pytest.mark.parametrize("argv,taken", [
    (["generate", "Hi"], LiteRequest("Hi")),
    (["generate", "Hi", "-n", "5", "--model", "x.gguf", "--dtype", "stored-fast", "--threads", "2"],
     LiteRequest("Hi", model="x.gguf", dtype="stored-fast", threads=2, max_new_tokens=5)),
    (["generate", "--plan=exit:8", "Hi", "--stop", "a", "--stop", "b", "--no-stream", "--temp", "0", "--no-chat"],
     LiteRequest("Hi", plan="exit:8", stop=["a", "b"], stream=False)),
    (["generate", "-p", "Hi", "-t", "2", "--n-predict", "3", "--temperature=0"],
     LiteRequest("Hi", threads=2, max_new_tokens=3)),
    (["generate", "Hi", "-t", "0"], None),  # -t is the thread count: the torch front end refuses 0
    (["generate", "Hi", "-p", "there"], None),  # two prompts: the torch front end's usage error
    (["generate", "-f", "p.txt"], None),
    (["generate", "Hi", "--json", "-v"], LiteRequest("Hi", stats=True, as_json=True)),
    (["generate", "--engine", "native", "--device", "cpu", "Hi"], LiteRequest("Hi", engine="native")),
    (["generate", "Hi", "--chat"], LiteRequest("Hi", chat=True)),
    (["generate", "Hi", "--chat", "--no-chat"], LiteRequest("Hi")),
    (["generate", "Hi", "-t", "0.7"], None),  # not a thread count: the torch front end's message
    (["generate", "Hi", "--temp", "0.7"], LiteRequest("Hi", temperature=0.7)),
    (["generate", "Hi", "--temp", "0.8", "-s", "3", "--top-k", "40", "--min-p", "0.05"],
     LiteRequest("Hi", temperature=0.8, seed=3, top_k=40, min_p=0.05)),
    (["generate", "Hi", "--top-p", "1.5"], None),  # out of range: the torch front end's message
    (["generate", "Hi", "--draft", "suffix"], LiteRequest("Hi", draft="suffix")),  # lookup drafts: rounds.py
    (["generate", "Hi", "--draft", "ngram:3", "--draft-length", "fixed", "--draft-confidence", "0.5"],
     LiteRequest("Hi", draft="ngram:3", draft_length="fixed", draft_confidence=0.5)),
    (["generate", "Hi", "--draft", "suffix:max=8,learn"], LiteRequest("Hi", draft="suffix:max=8,learn")),
    (["generate", "Hi", "--draft", "suffix:tree"], None),  # a token tree's pass: the torch front end's
    (["generate", "Hi", "--draft", "suffix|ngram"], LiteRequest("Hi", draft="suffix|ngram")),
    # the model's own sub-plans (drafters/plan.py on LiteModel passes), auto over them
    (["generate", "Hi", "--draft", "exit:8", "--draft-confidence", "0.3"],
     LiteRequest("Hi", draft="exit:8", draft_confidence=0.3)),
    (["generate", "Hi", "--draft", "skip:attn=3;mlp=5|ngram"], LiteRequest("Hi", draft="skip:attn=3;mlp=5|ngram")),
    (["generate", "Hi", "--draft", "auto"], LiteRequest("Hi", draft="auto")),
    # what runs torch modules or token trees: the torch front end's
    (["generate", "Hi", "--draft", "exit:8+head"], None),
    (["generate", "Hi", "--draft", "exit:8+vocab=512"], None),
    (["generate", "Hi", "--draft", "exit:8+branch=0.5"], None),
    (["generate", "Hi", "--draft", "ngram|suffix:tree"], None),
    (["generate", "Hi", "--draft", "dynamic:confidence=0.8"], None),
    (["generate", "Hi", "--draft", "self:bits=q4_0"], None),
    (["generate", "Hi", "--draft", "online"], None),
    (["generate", "Hi", "--draft", "window:4,64"], LiteRequest("Hi", draft="window:4,64")),
    (["generate", "Hi", "-md", "smollm2"], LiteRequest("Hi", draft="model:smollm2")),  # another GGUF drafts
    (["generate", "Hi", "-md", "small.gguf"], None),  # no such file: the torch front end says so
    (["generate", "Hi", "-md", "some/folder"], None),  # a Hugging Face folder: the torch front end loads it
    (["generate", "Hi", "--draft", "ngram|model:some/folder"], None),
    (["generate", "Hi", "-md", "small.gguf", "--draft", "ngram"], None),  # both: the torch front end's message
    (["generate", "Hi", "--draft", "ngram", "--draft-length", "often"], None),  # its message
    (["generate", "Hi", "--stats"], LiteRequest("Hi", stats=True)),
    (["generate", "Hi", "--repeat-penalty", "1.1", "--frequency-penalty", "0.5", "-l", "5-inf", "-l", "7+2"],
     LiteRequest("Hi", repetition_penalty=1.1, frequency_penalty=0.5, logit_bias=((5, -float("inf")), (7, 2.0)))),
    (["generate", "Hi", "--presence-penalty", "3"], None),  # out of range: the torch front end's message
    (["generate", "Hi", "--model-b", "b.gguf", "--plan", "0,b:1"], LiteRequest("Hi", model_b="b.gguf", plan="0,b:1")),
    (["generate", "Hi", "-n5"], LiteRequest("Hi", max_new_tokens=5)),  # click's forms: the command reads the line
    (["generate", "Hi", "--top-k", "0", "--max-batch", "4"], LiteRequest("Hi")),  # greedy all the same
    (["generate", "Hi", "--top-p", "0.9"], LiteRequest("Hi", top_p=0.9)),  # (greedy: kept, and no token changes)
    (["generate", "Hi", "-c", "64"], None),
    (["generate", "Hi", "--device-map", "auto"], None),
    (["generate", "Hi", "-n", "-3"], None),  # a bad value: the torch front end's message
    (["generate", "Hi", "-n", "-1"], LiteRequest("Hi", max_new_tokens=-1)),  # llama.cpp's: until the context is full
    (["generate", "Hi", "--dtype", "float32"], None),
    (["generate", "Hi", "--device", "cuda"], None),
    (["generate", "-h"], None),
    (["generate", "Hi", "there"], None),  # two prompts: the torch front end's usage error
    (["generate", ""], None),  # an empty prompt: its message
    (["generate", "--", "-x"], LiteRequest("-x")),
    (["generate", "Hi", "-n"], None),
    (["generate", "--prompt-file", "p.txt"], None),
    (["bench", "Hi"], None),
])
def test_the_command_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    assert light_request(argv) == taken
    monkeypatch.setenv("LAYERPLAN_FRONT_END", "torch")
    assert light_request(argv) is None


@pytest.mark.parametrize("argv,taken", [
    (["ppl"], True),
    (["ppl", "-m", "some.gguf", "--dtype", "stored", "--window", "64", "--stride", "32", "--max-tokens", "0",
      "--no-compare", "-t", "1", "-f", "text.txt"], True),
    (["ppl", "--plan", "skip:attn=3"], True),
    (["ppl", "--plan", "0-10,b:11-20"], True),  # (its message: only a is loaded)
    (["ppl", "--protocol", "llama.cpp", "--plan", "exit:20", "--no-compare"], True),
    (["ppl", "--model-b", "other.gguf"], True),
    (["ppl", "--device", "cuda"], False),
    (["ppl", "--dtype", "float32"], False),
    (["ppl", "--window", "0"], False),  # refused by the command: the torch front end says so
    (["ppl", "-h"], False),
    (["generate", "Hi"], False),
])
def test_the_perplexity_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    assert (light_ppl_request(argv) is not None) == taken


@pytest.mark.parametrize("argv,taken", [
    (["scan"], True),
    (["scan", "-m", "some.gguf", "--dtype", "stored-fast", "--tokens", "64", "--kinds", "mlp", "--plan", "exit:20",
      "--no-reuse", "-t", "1", "--text", "text.txt", "--out", "somewhere"], True),
    (["scan", "--exits"], True),
    (["scan", "--device", "cuda"], False),
    (["scan", "--dtype", "bfloat16"], False),
    (["scan", "--tokens", "1"], False),  # refused by the command: the torch front end says so
    (["scan", "--help"], False),
    (["ppl"], False),
])
def test_the_scan_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_scan_request(argv)
    assert (request is not None) == taken
    if request is not None:  # the command's own reading of --kinds, --exits and --no-reuse
        kinds = ["exit"] if "--exits" in argv else ["mlp"] if "--kinds" in argv else ["attention", "mlp", "layer"]
        assert (request.kinds, request.exits, request.reuse) == (kinds, "--exits" in argv, "--no-reuse" not in argv)


@pytest.mark.parametrize("argv,taken", [
    (["search"], True),
    (["search", "-m", "some.gguf", "--dtype", "stored", "--method", "bayes", "--objective", "kl", "--multi",
      "--trials", "9", "--sampler", "random", "--storage", "journal:s.log", "--study", "x", "--seed", "4",
      "--tokens", "64", "--allow-ends", "--no-save-draft", "--out", "somewhere"], True),
    (["search", "--objective", "tokens-per-second"], False),  # it times speculative decoding: torch's
    (["search", "--dtype", "float32"], False),
    (["search", "--trials", "0"], False),  # refused by the command: the torch front end says so
    (["search", "-h"], False),
])
def test_the_search_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_search_request(argv)
    assert (request is not None) == taken
    if len(argv) > 2 and taken:  # the command's own reading of every option
        assert (request.method, request.objective, request.multi, request.trials, request.sampler, request.storage,
                request.study_name, request.seed, request.tokens, request.allow_ends, request.save_draft) == (
            "bayes", "kl", True, 9, "random", "journal:s.log", "x", 4, 64, True, False)


@pytest.mark.parametrize("argv,taken", [
    (["explore"], True),
    (["explore", "-m", "some.gguf", "--dtype", "stored", "--recompute", "4,6", "--rewind", "1,2", "--plan", "0-9,5-20",
      "--plan", "exit:12", "--tokens", "64", "--text", "t.txt", "-t", "1", "--out", "somewhere"], True),
    (["explore", "--blocks"], False),  # task probes and bootstrap: the torch front end's
    (["explore", "--search"], False),
    (["explore", "--model-b", "other.gguf"], False),
    (["explore", "--device", "cuda"], False),
    (["explore", "--dtype", "float32"], False),
    (["explore", "--help"], False),
])
def test_the_explore_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_explore_request(argv)
    assert (request is not None) == taken
    if len(argv) > 2 and taken:
        assert (request.recompute, request.rewind, request.plans, request.tokens, request.text) == (
            "4,6", "1,2", ["0-9,5-20", "exit:12"], 64, "t.txt")


@pytest.mark.parametrize("argv,taken", [
    (["probe"], True),
    (["probe", "-m", "some.gguf", "--dtype", "stored", "--engine", "native", "--engine", "eager", "-t", "1",
      "--max-length", "8", "--repeats", "2", "--refresh", "--json"], True),
    (["probe", "--dtype", "stored-fast"], True),
    (["probe", "--dtype", "float32"], False),  # dense rows: torch's
    (["probe", "--dtype", "stored", "--dtype", "bfloat16"], False),
    (["probe", "--engine", "eager"], False),  # a GGUF as stored has no eager row: the torch front end answers
    (["probe", "--max-length", "0"], False),  # refused by the command: the torch front end says so
    (["probe", "--help"], False),
    (["bench"], False),
])
def test_the_probe_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_probe_request(argv)
    assert (request is not None) == taken
    if request is not None:  # the command's own reading; no --dtype: both stored arithmetics
        given = [dtype for dtype in ("stored", "stored-fast") if dtype in argv]
        assert request.dtypes == (given or ["stored", "stored-fast"])
    if len(argv) > 4 and taken:
        assert (request.threads, request.max_length, request.repeats, request.refresh, request.as_json) == (
            1, 8, 2, True, True)


@pytest.mark.parametrize("argv,taken", [
    (["bench"], True),
    (["bench", "-m", "some.gguf", "--dtype", "stored", "-t", "1", "-n", "16", "--repeats", "2", "--prompt", "chat",
      "--draft", "auto", "--draft", "exit:12", "--draft-length", "fixed", "--no-llama-cpp", "--llama-draft-max", "4",
      "--out", "b.json"], True),
    (["bench", "--engine", "native", "--no-transformers"], True),
    (["bench", "--transformers"], False),  # transformers' rows: torch's
    (["bench", "--hf-early-exit", "4"], False),
    (["bench", "--hf-prompt-lookup", "10"], False),
    (["bench", "--engine", "eager"], False),
    (["bench", "--dtype", "float32"], False),
    (["bench", "--draft", "online"], False),  # a draft that runs torch modules
    (["bench", "--draft", "model:draft.safetensors"], False),  # a draft model that is no GGUF
    (["bench", "--prompt", "poem"], False),  # no such prompt: the torch front end says so
    (["bench", "--prompt", "code", "--prompt-file", "p.txt"], False),
    (["bench", "--prompt-file", "/nonexistent/p.txt"], False),
    (["bench", "--repeats", "0"], False),  # refused by the command
    (["bench", "--help"], False),
    (["probe"], False),
])
def test_the_bench_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_bench_request(argv)
    assert (request is not None) == taken
    if request is not None and len(argv) == 1:  # every built-in prompt, chat and summary templated
        assert list(request.prompts) == ["code", "chat", "summary", "continuation"]
        assert request.chat == ["chat", "summary"] and request.drafts == [] and request.llama_cpp
    if len(argv) > 4 and taken:
        assert (request.model, request.dtype, request.threads, request.new_tokens, request.repeats) == (
            "some.gguf", "stored", 1, 16, 2)
        assert (list(request.prompts), request.drafts, request.draft_length) == (["chat"], ["auto", "exit:12"], "fixed")
        assert (request.llama_cpp, request.llama_draft_max, request.out) == (False, 4, "b.json")


@pytest.mark.parametrize("argv,taken", [
    (["frontier", "--draft", "exit:12", "--draft", "suffix"], True),
    (["frontier", "-m", "some.gguf", "--dtype", "stored", "-t", "1", "--draft", "skip:mlp=3", "--prompt", "chat",
      "-n", "16", "--gamma", "3", "--out", "f"], True),
    (["frontier"], False),  # the default families: online skips and a 4-bit copy run torch modules
    (["frontier", "--draft", "online"], False),
    (["frontier", "--draft", "self:bits=q4_0"], False),
    (["frontier", "--draft", "suffix", "--engine", "eager"], False),
    (["frontier", "--draft", "suffix", "--dtype", "float32"], False),
    (["frontier", "--draft", "suffix", "--prompt", "poem"], False),  # no such prompt: the torch front end says so
    (["frontier", "--draft", "suffix", "--gamma", "0"], False),  # refused by the command
    (["frontier", "--help"], False),
])
def test_the_frontier_lines_it_takes(argv, taken, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_frontier_request(argv)
    assert (request is not None) == taken
    if request is not None and len(argv) == 5:  # the built-in code and summary prompts
        assert list(request.prompts) == ["code", "summary"] and request.drafts == ["exit:12", "suffix"]
        assert (request.new_tokens, request.gamma, request.out) == (48, 4, "runs/frontier")
    if len(argv) > 5 and taken:
        assert (request.model, request.dtype, request.threads, request.drafts, list(request.prompts)) == (
            "some.gguf", "stored", 1, ["skip:mlp=3"], ["chat"])
        assert (request.new_tokens, request.gamma, request.out) == (16, 3, "f")


@pytest.mark.parametrize("reader, command", [(light_ppl_request, "ppl"), (light_scan_request, "scan"),
                                             (light_search_request, "search"), (light_explore_request, "explore")])
def test_a_path_with_a_nul_is_left_to_the_torch_front_end(reader, command, monkeypatch):
    """click.Path's os.stat raises ValueError on a NUL (hypothesis found it: `ppl --text '\\x00'`);
    the reader gives None rather than raise."""
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    assert reader([command, "--text", "\x00"]) is None and reader([command]) is not None


def test_rotary_rows_are_transformers_within_a_unit_in_the_last_place():
    """rope_tables.py's rows against transformers' own rotary module (float32 cos and sin, which
    are themselves a unit in the last place off in about one entry in twenty)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    rotary = LlamaRotaryEmbedding(config)
    # the module a position a call (called on many, its threads split the cosine's loop where they
    # may, and a scalar tail rounds otherwise: engine/rope.py)
    rows = [rotary(torch.zeros(1, dtype=torch.float32), torch.tensor([[p]])) for p in range(0, 4096, 7)]
    want_cos, want_sin = (torch.cat([row[i][0] for row in rows]).numpy() for i in range(2))
    cos, sin = rope_rows(rotary.inv_freq.numpy(), rotary.attention_scaling, 0, 4096)
    for got, want in ((cos[::7], want_cos), (sin[::7], want_sin)):
        ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
        assert ulps.max() <= 1 and (ulps > 0).mean() < 0.2


def test_a_rotary_row_is_its_positions_alone():
    """Rows of a table computed in other blocks are the same bits (the front ends grow theirs
    from different places)."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    whole = rope_rows(inv_freq, 1.0, 0, 700)
    parts = [rope_rows(inv_freq, 1.0, start, end) for start, end in ((0, 3), (3, 256), (256, 700))]
    for i in range(2):
        assert np.array_equal(np.concatenate([part[i] for part in parts]), whole[i])


_WORDS = ["generate", "Hi", "-n", "5", "-1", "--model", "--dtype", "stored", "auto", "float32", "--plan", "exit:2",
          "--stop", "--chat", "--no-chat", "--stream", "--no-stream", "-t", "0", "0.5", "--threads", "--", "-", "",
          "--plan=0,1", "--stop=x", "--dtype=", "--bogus", "-h", "--engine", "native", "--device", "cpu"]


@given(st.lists(st.sampled_from(_WORDS) | st.text(max_size=6), max_size=9))
@settings(max_examples=300, deadline=None)
def test_any_command_line_is_taken_whole_or_left_to_the_torch_front_end(words):
    """light_request never raises: a line is a request whose every field is a value the torch front
    end would accept too, or None."""
    request = light_request(["generate", *words])
    if request is None:
        return
    assert request.prompt and request.prompt in words  # (the command's own reading: "-x" after "--" too)
    assert request.dtype in ("auto", "stored", "stored-fast") and request.engine in ("auto", "native")
    assert request.max_new_tokens >= 0 or request.max_new_tokens == UNTIL_CONTEXT  # (-n -1, -2: llama.cpp's)
    assert request.threads is None or 1 <= request.threads <= 1024


_PPL_WORDS = ["--window", "--stride", "64", "0", "-3", "--max-tokens", "--dtype", "stored", "float32", "--plan",
              "--protocol", "llama.cpp", "sliding", "--text", "-f", "builtin:code", "--no-compare", "--compare",
              "--model-b", "-t", "--device", "cpu", "cuda", "--", "-h", "--bogus", ""]


@given(st.lists(st.sampled_from(_PPL_WORDS) | st.text(max_size=6), max_size=9))
@settings(max_examples=300, deadline=None)
def test_any_perplexity_line_is_taken_whole_or_left_to_the_torch_front_end(words):
    """light_ppl_request never raises: a `layerplan ppl` line is a request the torch front end
    would carry out the same way, or None."""
    request = light_ppl_request(["ppl", *words])
    if request is None:
        return
    assert request.dtype in ("auto", "stored", "stored-fast") and request.window >= 1 and request.stride >= 1
    assert request.max_tokens >= 0 and (request.threads is None or 1 <= request.threads <= 1024)


def test_physical_cores_count_each_core_once(tmp_path):
    from layerplan.machine import physical_cores

    entries = [(0, 0, 0), (1, 0, 1), (2, 0, 0), (3, 0, 1)]  # (processor, package, core): 2 cores, 2 threads each
    text = "\n\n".join(f"processor\t: {p}\nphysical id\t: {k}\ncore id\t\t: {c}" for p, k, c in entries)
    (tmp_path / "cpuinfo").write_text(text)
    allowed = os.sched_getaffinity(0)
    expected = len({c for p, _, c in entries if p in allowed})
    assert physical_cores(tmp_path / "cpuinfo") == max(expected, 1)
    assert physical_cores(tmp_path / "absent") == len(allowed)


def _kept_smollm2_index():
    from layerplan.models.gguf_index import file_index
    from layerplan.models.gguf_place import default_gguf_path

    return file_index(default_gguf_path())


TOKENIZER_TEXTS = ("The capital of France is", " leading space,  two spaces", "naïve café — ünïcode ✓ 日本語",
                   "<|im_start|>user\nHi<|im_end|>\n", "", "tabs\tand\nnewlines\n\n", "emoji 🙂 and bytes \x00")


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "in-part"])
def test_the_tokenizer_process_answers_as_the_tokenizer_in_this_process(partial, monkeypatch):
    """encode (with and without the special tokens), decode (skipping them or not) and the EOS ids:
    the same answers from the forked process as from LiteTokenizer, and from the tokenizer read
    whole as read in part (models/tokenizer_table.py, as a large tokenizer.json is); closing it reaps it."""
    from tokenizers import Tokenizer

    from layerplan.lite import tokenizer as lite_tokenizer
    from layerplan.lite.tokenizer import LiteTokenizer
    from layerplan.lite.tokenizer_process import TokenizerProcess

    index = _kept_smollm2_index()
    if partial:
        monkeypatch.setattr(lite_tokenizer, "PARTIAL_TOKENIZER_BYTES", 0)
    whole = Tokenizer.from_file(str(index / "tokenizer.json"))
    assert (LiteTokenizer(index)._partial is not None) == partial
    local, process = LiteTokenizer(index), TokenizerProcess.start(index)
    try:
        assert process.ready().eos_ids == local.eos_ids and local.eos_ids
        for text in TOKENIZER_TEXTS:
            for special in (True, False):
                ids = local.encode(text, special_tokens=special)
                assert ids == whole.encode(text, add_special_tokens=special).ids
                assert process.encode(text, special_tokens=special) == ids, text
                for skip in (True, False):
                    assert process.decode(ids, skip_special_tokens=skip) == local.decode(ids, skip), text
        with pytest.raises(ModelError):  # an id outside the vocabulary: the tokenizer's own error, one line
            process.decode([10 ** 12])
        assert process.decode([1, 2]) == local.decode([1, 2])  # and it answers on
    finally:
        process.close()
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(process.pid, os.WNOHANG)


def test_a_tokenizer_that_cannot_be_read_is_one_line_in_either_process(tmp_path):
    from layerplan.lite.tokenizer import LiteTokenizer
    from layerplan.lite.tokenizer_process import TokenizerProcess

    index = tmp_path / "index"
    index.mkdir()
    (index / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelError, match="tokenizer.json: ") as local:
        LiteTokenizer(index)
    process = TokenizerProcess.start(index)
    try:
        with pytest.raises(ModelError) as forked:
            process.ready()
    finally:
        process.close()
    assert str(forked.value) == str(local.value) and "\n" not in str(local.value)


def test_only_a_kept_index_with_a_tokenizer_starts_a_process(tmp_path):
    """A first start (no index yet) reads the tokenizer in its own process once the index is made."""
    from layerplan.lite.tokenizer_process import TokenizerProcess

    assert TokenizerProcess.for_model("smollm2") is None  # (this test's cache is empty)
    assert TokenizerProcess.for_model(str(tmp_path / "missing.gguf")) is None
    assert TokenizerProcess.start(tmp_path) is None  # no tokenizer.json
    index = _kept_smollm2_index()

    def refused():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    with pytest.MonkeyPatch.context() as patch:  # a fork refused: the command reads the tokenizer itself
        patch.setattr(os, "fork", refused)
        before = len(os.listdir("/proc/self/fd"))
        assert TokenizerProcess.start(index) is None
        assert len(os.listdir("/proc/self/fd")) == before  # (its pipes closed)
    process = TokenizerProcess.for_model("smollm2")
    assert process is not None
    process.close()


def test_each_layers_attention_is_read_from_the_config_by_one_rule(tmp_path):
    """models/arch_table.py layer_attention, which the torch front end's layers and the light
    front end's descriptors both take: layer types with the window on the sliding ones; GPT-Neo's
    local layers; a window on every layer where only sliding_window is set (Mistral); else none.
    The light front end leaves the last kind (no rotary table by layer type) to the torch one."""
    from types import SimpleNamespace as Config

    from layerplan.models.arch_table import layer_attention

    assert layer_attention(Config(layer_types=["sliding_attention", "full_attention"], sliding_window=4), 2) == [
        ("sliding_attention", 4), ("full_attention", None)]
    assert layer_attention(Config(attention_layers=["local", "global"], window_size=8), 2) == [
        ("sliding_attention", 8), ("full_attention", None)]
    assert layer_attention(Config(sliding_window=5), 2) == [("sliding_attention", 5)] * 2
    assert layer_attention(Config(sliding_window=None), 3) == [("full_attention", None)] * 3
    index = tmp_path / "windowed"
    index.mkdir()
    (index / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "silu", "sliding_window": 5,
                                                   "num_hidden_layers": 2}))
    (index / TENSORS_FILE).write_text(json.dumps({"version": INDEX_VERSION, "rotary": {"inv_freq": [1.0]},
                                                  "tensors": []}))
    assert lite_refusal(index) == "sliding-window attention runs on the torch front end"


@pytest.mark.parametrize("argv,fmt", [
    (["export", "0-20,15-29", "--out", "m.gguf"], "gguf"),
    (["export", "0-20", "--out", "m", "--to", "gguf"], "gguf"),
    (["export", "0-20", "-m", "missing.gguf", "--out", "m.gguf"], None),  # the torch front end says what is missing
    (["export", "0-20", "--out", "m.yaml"], "mergekit"),
    (["export", "0-20", "-m", "some/folder", "--out", "m.yml", "--dtype", "bfloat16"], "mergekit"),  # any model's config
    (["export", "0-20", "--out", "folder"], None),  # a checkpoint: torch modules' weights
    (["export", "0-20", "-m", "some/folder", "--out", "m.gguf"], None),  # not a GGUF: the torch front end says so
    (["export", "0-20,b:0-3", "--model-b", "other.gguf", "--out", "m.gguf"], None),  # (its refusal, in its words)
    (["export", "0-20", "--out", "m.gguf", "--to", "nonsense"], None),  # refused by the command
    (["export", "--help"], None),
])
def test_the_export_lines_it_takes(argv, fmt, monkeypatch):
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_export_request(argv)
    assert (None if request is None else request.fmt) == fmt
    if request is not None and "--dtype" in argv:
        assert (request.model, request.out, request.yaml_dtype) == ("some/folder", "m.yml", "bfloat16")


def test_a_light_export_keeps_the_pattern_of_layer_kinds_as_the_torch_front_end_does(tmp_path, capsys):
    """Gemma 3's layers are sliding but every sixth: a GGUF names the pattern, not each layer, so a
    plan exports only where step j runs a layer of the pattern's kind at j (export.py gguf_refusal
    on the torch front end; the light one has the rule from the index's config). Refused in the
    torch front end's words, writing nothing; one kind of layer: written, its blocks the source's.
    The kinds come from the file's header: a file never seen gets no index (its tokenizer, seconds
    for a large vocabulary)."""
    from layerplan.export import gguf_refusal
    from layerplan.models.gguf_file import read_header

    gemma = write_tiny_gguf(tiny_hf("gemma3", num_layers=6), tmp_path / "gemma3.gguf", "Q8_0")
    llama = write_tiny_gguf(tiny_hf("llama", num_layers=3), tmp_path / "llama.gguf", "Q8_0")
    on_torch = load_model(gemma, dtype="stored")
    for plan, keeps in (("0-5,0-5", True), ("0-5", True), ("1-5", False), ("0-4,4-5", False)):
        out = tmp_path / f"g-{plan}.gguf"
        status = run_export(LiteExportRequest(model=str(gemma), plan=plan, out=str(out), fmt="gguf"))
        refusal = gguf_refusal(on_torch, on_torch.plan(plan))
        assert (status == 0) == keeps == (refusal is None) == out.exists()
        if not keeps:
            assert capsys.readouterr().err == f"Error: {refusal}\n"
        else:
            assert read_header(out).get("{arch}.block_count") == len(on_torch.plan(plan).active_steps)
    out = tmp_path / "l.gguf"
    assert run_export(LiteExportRequest(model=str(llama), plan="0-2,1/mlp", out=str(out), fmt="gguf")) == 0
    assert not index_folder(llama).exists()
    source, written = read_header(llama), read_header(out)
    assert written.get("{arch}.block_count") == 4
    blocks = {t.name: llama.read_bytes()[t.offset:t.offset + t.nbytes] for t in source.tensors}
    for t in written.tensors:
        data = out.read_bytes()[t.offset:t.offset + t.nbytes]
        if t.name.startswith("blk.3.attn_output"):  # step 3 runs layer 1's MLP alone: its attention adds nothing
            assert data == bytes(t.nbytes)
        else:  # step j's tensors are layer (0, 1, 2, 1)[j]'s
            if t.name.startswith("blk."):
                _, step, rest = t.name.split(".", 2)
                name = f"blk.{(0, 1, 2, 1)[int(step)]}.{rest}"
            else:
                name = t.name
            assert data == blocks[name], t.name
    # where the operating system cannot copy between the two files, the blocks are read and written in chunks
    import layerplan.export_gguf as export_gguf

    def refused(*args):
        raise OSError(18, "Invalid cross-device link")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_gguf.os, "copy_file_range", refused)
        patch.setattr(export_gguf, "COPY_CHUNK", 100)  # (several chunks a tensor)
        again = tmp_path / "again.gguf"
        assert run_export(LiteExportRequest(model=str(llama), plan="0-2,1/mlp", out=str(again), fmt="gguf")) == 0
    assert again.read_bytes() == out.read_bytes()
