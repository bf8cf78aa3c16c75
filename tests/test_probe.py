"""The hardware probe: timing passes, caching per machine, and what it decides."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from layerplan.engine import probe
from tiny import tiny_model


def test_probe_times_every_length_and_round_trips(tmp_path):
    model = tiny_model("llama")
    result = probe.probe(lambda dtype, engine: model if engine == "eager" else None, "tiny", ["float32"],
                         ["eager", "native"], lengths=(1, 2, 4), repeats=2)
    assert [(r.engine, r.dtype) for r in result.rows] == [("eager", "float32")]
    row = result.rows[0]
    assert set(row.relative) == {1, 2, 4} and row.relative[1] == 1.0 and row.step_ms > 0
    assert row.cost(8) == pytest.approx(row.relative[4] * 2)  # extrapolated linearly past the measured lengths
    path = probe.save_probe(result, tmp_path)
    assert probe.load_probe(tmp_path, "tiny") == result
    assert json.loads(path.read_text())["machine"] == probe.machine_key()
    assert "k=4" in result.table() and "eager" in result.table()


def test_cached_probe_is_ignored_on_another_machine_or_torch(tmp_path, monkeypatch):
    result = probe.ProbeResult(probe.machine_key(), "cpu", "m", [probe.ProbeRow("native", "bfloat16", 10.0, {1: 1.0, 8: 1.2})])
    probe.save_probe(result, tmp_path)
    assert probe.load_probe(tmp_path, "m") is not None
    assert probe.default_dtype(tmp_path, "m", "native", native_bf16=False) == "bfloat16"  # measured beats the guess
    assert probe.pass_costs(tmp_path, "m", "native", "bfloat16") == {1: 1.0, 8: 1.2}
    monkeypatch.setattr(probe, "read_cpuinfo", lambda: ("Other CPU", {"avx2", "avx512f"}))
    assert probe.load_probe(tmp_path, "m") is None  # another CPU: the probe is stale
    assert probe.default_dtype(tmp_path, "m", "native", native_bf16=False) == "float32"
    monkeypatch.undo()
    monkeypatch.setattr(probe.torch, "__version__", "9.9.9")
    assert probe.load_probe(tmp_path, "m") is None  # another torch: stale too
    monkeypatch.undo()
    monkeypatch.setattr(probe, "kernels_key", lambda: "other kernels")
    assert probe.load_probe(tmp_path, "m") is None  # the native kernels changed: their timings too


def test_corrupt_probe_file_is_ignored(tmp_path):
    path = probe.probe_path(tmp_path, "m")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert probe.load_probe(tmp_path, "m") is None


def test_adaptive_length_takes_verify_costs_from_the_probe():
    from layerplan.decoding.draft_length import AdaptiveLength, make_draft_length

    flat = make_draft_length("adaptive", 4, pass_costs={k: 1.0 for k in range(1, 17)})
    steep = make_draft_length("adaptive", 4, pass_costs={k: float(k) for k in range(1, 17)})
    for policy in (flat, steep):
        assert isinstance(policy, AdaptiveLength)
        policy.update(0, 0, 0, 0.0, 0.010)  # one plain step: 10 ms
        policy.update(4, 4, 3, 0.002, 0.011)  # a drafting round: cheap drafts, 3 of 4 accepted
    # where checking k tokens costs one step, drafting pays; where it costs k steps, it cannot
    assert flat.next_gamma() > 0
    assert steep.next_gamma() == 0


def test_floor_is_the_larger_of_reading_the_weights_and_the_passes_arithmetic():
    # 100 MB read at 20 GB/s: 5 ms; 0.2 GFLOP per token at 100 GFLOP/s: 2 ms per token
    row = probe.ProbeRow("native", "bfloat16", 9.0, {1: 1.0, 2: 1.3, 4: 1.9}, product_gflops=100.0, read_gbs=20.0,
                         weight_bytes=100_000_000, flops_per_token=0.2e9)
    assert row.step_floor_ms() == pytest.approx(5.0)
    assert row.floor(1) == 1.0 and row.floor(2) == 1.0  # 4 ms of arithmetic hides under 5 ms of reads
    assert row.floor(4) == pytest.approx(8 / 5) and row.floor(8) == pytest.approx(16 / 5)
    compute_bound = probe.ProbeRow("native", "float32", 9.0, {1: 1.0}, product_gflops=10.0, read_gbs=20.0,
                                   weight_bytes=100_000_000, flops_per_token=0.2e9)
    assert compute_bound.floor(3) == pytest.approx(3.0)  # 20 ms of arithmetic per token: linear in k
    unmeasured = probe.ProbeRow("eager", "float32", 9.0, {1: 1.0})
    assert unmeasured.floor(4) is None and unmeasured.step_floor_ms() is None
    result = probe.ProbeResult("key", "cpu", "m", [row, unmeasured])
    table = result.table()
    assert "floor" in table and "products 100 GFLOP/s, reads 20.0 GB/s" in table and "0.20 GFLOP per token" in table
    assert probe.ProbeResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    older = result.to_dict()  # a probe written before the rates were measured still loads
    for r in older["rows"]:
        for key in ("product_gflops", "read_gbs", "weight_bytes", "flops_per_token"):
            del r[key]
    assert probe.ProbeResult.from_dict(older).rows[0].floor(4) is None


def test_streamed_matrices_count_the_lm_head_once_and_skip_an_untied_embedding():
    for arch in ("llama", "qwen2"):
        model = tiny_model(arch)
        hf = model.hf
        matrices = {p.data_ptr(): p.numel() for p in hf.parameters() if p.dim() == 2}
        embedding, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
        expected = sum(matrices.values())
        if embedding.data_ptr() != head.data_ptr():
            expected -= embedding.numel()  # only looked up, row by row
        assert probe.streamed_matrix_elements(model) == expected
        assert head.data_ptr() in matrices  # the LM head is read whole every step
        hf.get_output_embeddings().weight = embedding  # tied, as SmolLM2's: the one matrix counts once
        assert probe.streamed_matrix_elements(model) == expected - head.numel() + embedding.numel()


@pytest.mark.skipif(probe.native_available() is not None, reason="the native kernels cannot run here")
def test_rate_sampler_measures_this_machine(monkeypatch):
    monkeypatch.setattr(probe, "READ_BYTES", 8 << 20)
    monkeypatch.setattr(probe, "_last_level_cache_bytes", lambda: 0)
    sampler = probe.RateSampler()
    assert sampler.buffer.numel() == 8 << 20
    sampler()
    sampler()
    products, read = sampler.best()
    # an AVX2 core does at least a few GFLOP/s of FMAs and reads at least 1 GB/s; nothing does 100x
    assert 2.0 < products < 10_000 and 1.0 < read < 10_000
    assert sampler.best() == (None, None)  # each row starts afresh
    sampler.dtype = torch.bfloat16  # a bf16 row times the bf16 kernels
    sampler()
    assert 2.0 < sampler.best()[0] < 10_000
    model = tiny_model("llama")
    result = probe.probe(lambda dtype, engine: model, "tiny", ["float32"], ["eager"], lengths=(1, 2), repeats=2)
    row = result.rows[0]
    assert row.product_gflops > 2.0 and row.read_gbs > 1.0
    assert row.weight_bytes == 4 * probe.streamed_matrix_elements(model) and row.flops_per_token == row.weight_bytes / 2
    assert row.floor(1) == 1.0 and row.floor(2) >= 1.0


def test_last_level_cache_size_is_read_from_sysfs(tmp_path):
    for text, size in (("32768K\n", 32 << 20), ("1M", 1 << 20), ("", 0), ("lots", 0)):
        (tmp_path / "size").write_text(text)
        assert probe._last_level_cache_bytes(str(tmp_path / "size")) == size
    assert probe._last_level_cache_bytes(str(tmp_path / "absent")) == 0


def test_a_model_on_a_gpu_gets_no_floor_from_the_cpus_rates(monkeypatch):
    seen = []

    def fake_time_passes(model, lengths, repeats, on_progress=None, between_rounds=None):
        seen.append(between_rounds)
        if between_rounds:
            between_rounds()  # one round's samples
        return {k: 0.01 * k for k in lengths}

    monkeypatch.setattr(probe, "time_passes", fake_time_passes)
    monkeypatch.setattr(probe.RateSampler, "__call__", lambda self: self.products.append(100.0) or self.read.append(20.0))
    hf = tiny_model("llama").hf
    on_gpu = SimpleNamespace(hf=hf, device=torch.device("cuda"))
    on_cpu = SimpleNamespace(hf=hf, device=torch.device("cpu"))
    result = probe.probe(lambda dtype, engine: on_gpu if engine == "eager" else on_cpu, "m", ["float32"],
                         ["eager", "native"], lengths=(1, 2), repeats=1)
    assert seen[0] is None and seen[1] is not None  # the GPU row samples nothing
    gpu_row, cpu_row = result.rows
    assert gpu_row.floor(2) is None and gpu_row.product_gflops is None
    assert (cpu_row.product_gflops, cpu_row.read_gbs) == (100.0, 20.0) and cpu_row.floor(2) is not None
