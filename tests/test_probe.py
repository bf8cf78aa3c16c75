"""The hardware probe: timing passes, caching per machine, and what it decides."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from layerplan.engine import probe, probe_rows, probing
from tiny import tiny_model


def test_probe_times_every_length():
    model = tiny_model("llama")
    result = probe.probe(lambda dtype, engine: model if engine == "eager" else None, "tiny", ["float32"],
                         ["eager", "native"], lengths=(1, 2, 4), repeats=2, retries=0)
    assert [(r.engine, r.dtype) for r in result.rows] == [("eager", "float32")]
    row = result.rows[0]
    assert set(row.relative) == {1, 2, 4} and row.relative[1] == 1.0 and row.step_ms > 0
    assert row.cost(8) == pytest.approx(row.relative[4] * 2)  # extrapolated linearly past the measured lengths
    assert result.load is not None and result.load.threads == torch.get_num_threads()
    assert "k=4" in result.table() and "eager" in result.table()


def test_a_step_is_timed_as_plain_decoding_runs_it_among_steps_not_after_a_longer_pass(monkeypatch):
    """On a machine where a one-token pass right after a longer one runs slower (and recovers over
    a few steps), the probe's step is the steady one plain decoding sees: dividing by the slow one
    made every verify pass look cheaper than it is against plain decoding."""
    clock = SimpleNamespace(now=0.0, since_long=99)

    def fake_forward(model, ids, plan=None, cache=None, start_pos=0, last_only=False):
        rows = ids.shape[1]
        if rows == 1:  # 2 ms a step, 1.5x that right after a longer pass, 10% less slow each step on
            clock.now += 0.002 * (1 + 0.5 * 0.5 ** clock.since_long)
            clock.since_long += 1
        else:
            clock.now += 0.002 * (1 + 0.25 * (rows - 1))
            clock.since_long = 0

    monkeypatch.setattr(probe, "forward", fake_forward)
    monkeypatch.setattr(probing, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    times = probe.time_passes(tiny_model("llama"), lengths=(1, 2, 4, 8), repeats=3)
    assert times[1] == pytest.approx(0.002, rel=0.01)  # the steady step, not the 3 ms one after a longer pass
    assert times[4] / times[1] == pytest.approx(1.75, rel=0.01)


def _sane_row(engine: str = "native", dtype: str = "float32", step_ms: float = 27.4) -> probe_rows.ProbeRow:
    """A quiet run's row (docs/lab/engine-rounds.md, ninth round, run 4): its floor is 20.0 ms (540 MB read at 27 GB/s)."""
    relative = {1: 1.00, 2: 1.17, 3: 1.17, 4: 1.25, 8: 1.40, 15: 1.82, 16: 1.77}
    return probe_rows.ProbeRow(engine, dtype, step_ms, relative, product_gflops=125.0, read_gbs=27.0,
                          weight_bytes=540_000_000, flops_per_token=0.27e9)


def test_a_cached_probe_round_trips_with_its_load(tmp_path):
    load = probe_rows.MachineLoad(cores=2, threads=2, load_average=2.3, others_cores=0.1)
    result = probe_rows.ProbeResult(probe.machine_key(), "cpu", "tiny", [_sane_row()], load)
    path = probe.save_probe(result, tmp_path)
    assert probe.load_probe(tmp_path, "tiny") == result
    written = json.loads(path.read_text())
    assert written["machine"] == probe.machine_key() and written["load"]["busy"] is False


def test_cached_probe_is_ignored_on_another_machine_or_torch(tmp_path, monkeypatch):
    native = probe_rows.ProbeRow("native", "bfloat16", 10.0, {1: 1.0, 8: 1.2})
    eager = probe_rows.ProbeRow("eager", "float32", 20.0, {1: 1.0, 8: 2.0}, torch=probe.torch_build())
    probe.save_probe(probe_rows.ProbeResult(probe.machine_key(), "cpu", "m", [native, eager]), tmp_path)
    assert probe.load_probe(tmp_path, "m").rows == [native, eager]
    assert probe.default_dtype(tmp_path, "m", "native", native_bf16=False) == "bfloat16"  # measured beats the guess
    assert probe.pass_costs(tmp_path, "m", "native", "bfloat16") == {1: 1.0, 8: 1.2}
    # a reader without torch (the light front end): the native rows, at the same key
    threads = torch.get_num_threads()
    assert probe_rows.read_probe(tmp_path, "m", threads).rows == [native]
    assert probe_rows.read_probe(tmp_path, "m", threads + 1) is None  # another thread count: another probe
    monkeypatch.setattr(probe_rows, "read_cpuinfo", lambda: ("Other CPU", {"avx2", "avx512f"}))
    assert probe.load_probe(tmp_path, "m") is None  # another CPU: the probe is stale
    assert probe.default_dtype(tmp_path, "m", "native", native_bf16=False) == "float32"
    monkeypatch.undo()
    monkeypatch.setattr(probe.torch, "__version__", "9.9.9")
    assert probe.load_probe(tmp_path, "m").rows == [native]  # another torch: its eager rows are stale
    monkeypatch.undo()
    monkeypatch.setattr(probe_rows, "kernels_key", lambda: "other kernels")
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
    row = probe_rows.ProbeRow("native", "bfloat16", 9.0, {1: 1.0, 2: 1.3, 4: 1.9}, product_gflops=100.0, read_gbs=20.0,
                         weight_bytes=100_000_000, flops_per_token=0.2e9)
    assert row.step_floor_ms() == pytest.approx(5.0)
    assert row.floor(1) == 1.0 and row.floor(2) == 1.0  # 4 ms of arithmetic hides under 5 ms of reads
    assert row.floor(4) == pytest.approx(8 / 5) and row.floor(8) == pytest.approx(16 / 5)
    compute_bound = probe_rows.ProbeRow("native", "float32", 9.0, {1: 1.0}, product_gflops=10.0, read_gbs=20.0,
                                   weight_bytes=100_000_000, flops_per_token=0.2e9)
    assert compute_bound.floor(3) == pytest.approx(3.0)  # 20 ms of arithmetic per token: linear in k
    unmeasured = probe_rows.ProbeRow("eager", "float32", 9.0, {1: 1.0})
    assert unmeasured.floor(4) is None and unmeasured.step_floor_ms() is None
    result = probe_rows.ProbeResult("key", "cpu", "m", [row, unmeasured])
    table = result.table()
    assert "floor" in table and "products 100 GFLOP/s, reads 20.0 GB/s" in table and "0.20 GFLOP per token" in table
    assert probe_rows.ProbeResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    older = result.to_dict()  # a probe written before the rates were measured still loads
    for r in older["rows"]:
        for key in ("product_gflops", "read_gbs", "weight_bytes", "flops_per_token"):
            del r[key]
    assert probe_rows.ProbeResult.from_dict(older).rows[0].floor(4) is None


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


class FixedRates:
    """A RateSampler that samples 100 GFLOP/s and 20 GB/s each round."""

    def __init__(self) -> None:
        self.dtype, self.rounds = None, 0

    def __call__(self) -> None:
        self.rounds += 1

    def best(self) -> tuple[float | None, float | None]:
        rates = (100.0, 20.0) if self.rounds else (None, None)
        self.rounds = 0
        return rates


def test_a_model_on_a_gpu_gets_no_floor_from_the_cpus_rates():
    seen = []

    def fake_time_passes(model, lengths, repeats, on_progress=None, between_rounds=None):
        seen.append(between_rounds)
        if between_rounds:
            between_rounds()  # one round's samples
        return {k: 0.01 * k for k in lengths}

    hf = tiny_model("llama").hf
    on_gpu = SimpleNamespace(hf=hf, device=torch.device("cuda"))
    on_cpu = SimpleNamespace(hf=hf, device=torch.device("cpu"))
    sampler = FixedRates()
    result = probe.probe(lambda dtype, engine: on_gpu if engine == "eager" else on_cpu, "m", ["float32"],
                         ["eager", "native"], lengths=(1, 2), repeats=1, retries=0, time_row=fake_time_passes,
                         sampler=sampler)
    assert seen == [None, sampler]  # the GPU row samples nothing
    gpu_row, cpu_row = result.rows
    assert gpu_row.floor(2) is None and gpu_row.product_gflops is None
    assert (cpu_row.product_gflops, cpu_row.read_gbs) == (100.0, 20.0) and cpu_row.floor(2) is not None


# ----- the checks: timings that cannot be true are not trusted ----------------------------------
def test_a_quiet_runs_row_passes_its_checks():
    assert _sane_row().step_floor_ms() == pytest.approx(20.0)
    assert probe_rows.row_problems(_sane_row()) == []
    # noise within the tolerance: a longer pass 12% under a shorter one (a quiet run's k=16 after k=15)
    noisy = probe_rows.ProbeRow("native", "bfloat16", 12.0, {1: 1.0, 8: 2.19, 15: 3.91, 16: 3.45})
    assert probe_rows.row_problems(noisy) == []
    # the eager engine's products are torch's, not the floor's: 5x the floor is no sign of trouble
    assert probe_rows.row_problems(_sane_row("eager", step_ms=100.0)) == []


def test_row_checks_name_what_cannot_be_true():
    cheaper = probe_rows.ProbeRow("native", "float32", 20.0, {1: 1.0, 2: 1.1, 8: 0.04})
    assert probe_rows.row_problems(cheaper) == ["a 8-token pass at 0.04 of a step (under 0.9)"]
    # a busy run's row, cached in an earlier version: two tokens at 6.64 steps, where two steps would do
    dearer = probe_rows.ProbeRow("native", "float32", 577.2, {1: 1.0, 2: 6.64})
    assert probe_rows.row_problems(dearer) == ["a 2-token pass at 6.64 of a step (over 1.25 x 2 steps)"]
    falling = probe_rows.ProbeRow("native", "float32", 20.0, {1: 1.0, 4: 1.6, 8: 1.2})  # 25% under k=4
    assert probe_rows.row_problems(falling) == ["a 8-token pass at 1.20 of a step, under the 4-token pass's 1.60"]
    slow = _sane_row(step_ms=1184.0)  # the step: 59x its 20 ms floor
    assert probe_rows.row_problems(slow) == ["a step of 1184.0 ms, 59x its floor of 20.0 ms (at most 3x)"]
    assert probe_rows.row_problems(_sane_row("eager", step_ms=1184.0))  # the eager engine's bound is looser, not absent
    fast = _sane_row(step_ms=15.0)
    assert probe_rows.row_problems(fast) == ["a step of 15.0 ms, under its floor of 20.0 ms"]
    assert probe_rows.row_problems(probe_rows.ProbeRow("native", "float32", 0.0, {1: 1.0})) == ["step of 0.0 ms"]


def _timings(step: float, relative: dict[int, float]):
    """A time_row that returns these timings (seconds) and counts its calls."""
    calls = []

    def time_row(model, lengths, repeats, on_progress=None, between_rounds=None):
        calls.append(lengths)
        return {k: step * relative[k] for k in lengths}

    return time_row, calls


def _quiet_meter() -> probing.LoadMeter:
    return probing.LoadMeter(busy_seconds=lambda: 0.0, own_seconds=lambda: 0.0, clock=iter([0.0, 10.0]).__next__,
                           load_average=lambda: 2.0, cores=2, threads=2)


def test_a_row_that_keeps_failing_is_timed_again_then_not_cached(tmp_path):
    # the row: k = 8 at 0.04 of a step, every time it is timed
    time_row, calls = _timings(1.184, {1: 1.0, 2: 1.15, 4: 0.3, 8: 0.04})
    notes = []
    model = SimpleNamespace(hf=tiny_model("llama").hf, device=torch.device("cpu"))
    result = probe.probe(lambda dtype, engine: model, "m", ["float32"], ["native"], lengths=(1, 2, 4, 8),
                         repeats=1, on_note=notes.append, retries=2, time_row=time_row, sampler=FixedRates(),
                         load_meter=_quiet_meter())
    assert len(calls) == 3  # timed, then timed again twice
    assert len(notes) == 2 and all("native float32: a 4-token pass at 0.30" in n and "timing it again" in n
                                   for n in notes)
    assert len(result.problems) == 1 and result.problems[0].startswith("native float32: a 4-token pass at 0.30")
    assert result.rows[0].step_ms == pytest.approx(1184.0)  # still shown
    assert probe.save_probe(result, tmp_path) is None
    assert not probe.probe_path(tmp_path, "m").exists() and probe.load_probe(tmp_path, "m") is None


def test_a_row_that_passes_when_timed_again_is_cached(tmp_path):
    answers = iter([{1: 0.020, 2: 0.0008, 4: 0.030},  # a 2-token pass at 0.04 of a step
                    {1: 0.020, 2: 0.024, 4: 0.027}])
    calls = []

    def time_row(model, lengths, repeats, on_progress=None, between_rounds=None):
        calls.append(lengths)
        return next(answers)

    notes = []
    result = probe.probe(lambda dtype, engine: tiny_model("llama"), "m", ["float32"], ["eager"], lengths=(1, 2, 4),
                         repeats=1, on_note=notes.append, time_row=time_row, sampler=FixedRates(),
                         load_meter=_quiet_meter())
    assert len(calls) == 2 and len(notes) == 1 and "a 2-token pass at 0.04" in notes[0]
    assert result.problems == [] and result.rows[0].relative == {1: 1.0, 2: pytest.approx(1.2), 4: pytest.approx(1.35)}
    assert probe.save_probe(result, tmp_path) is not None
    assert probe.load_probe(tmp_path, "m") == result


def test_a_cached_row_that_fails_its_checks_is_left_out_and_older_files_load(tmp_path):
    # a probe cached before the checks: no load, no problems, a bogus fp32 row beside a sane bf16 one
    older = {"machine": probe.machine_key(), "cpu": "cpu", "model": "m", "rows": [
        {"engine": "native", "dtype": "float32", "step_ms": 1184.0, "relative": {"1": 1.0, "8": 0.04}},
        {"engine": "native", "dtype": "bfloat16", "step_ms": 14.0, "relative": {"1": 1.0, "8": 1.7}}]}
    path = probe.probe_path(tmp_path, "m")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(older))
    loaded = probe.load_probe(tmp_path, "m")
    assert loaded is not None and loaded.load is None and loaded.problems == []
    assert [r.dtype for r in loaded.rows] == ["bfloat16"]
    assert probe.pass_costs(tmp_path, "m", "native", "float32") == {}  # the bogus costs steer nothing


# ----- the load on the machine ------------------------------------------------------------------
def test_the_load_meter_tells_a_busy_machine_from_a_quiet_one():
    def meter(busy, own, load_average=1.0, cores=2, threads=2):
        return probing.LoadMeter(busy_seconds=iter(busy).__next__, own_seconds=iter(own).__next__,
                               clock=iter([100.0, 110.0]).__next__, load_average=lambda: load_average,
                               cores=cores, threads=threads).start().stop()

    # 10 s: all CPUs busy 19 s, 17 of them this process's: others used 0.2 of a core
    quiet = meter([1000.0, 1019.0], [50.0, 67.0])
    assert quiet.others_cores == pytest.approx(0.2) and not quiet.busy and quiet.line().startswith("machine quiet")
    # others used 0.8 cores while this process's 2 threads wanted both: its passes waited
    busy = meter([1000.0, 1020.0], [50.0, 62.0], load_average=2.9)
    assert busy.others_cores == pytest.approx(0.8) and busy.busy
    assert busy.line() == ("machine busy: the timings may be slow and uneven (other processes kept 0.8 of 2 cores "
                           "busy, load average 2.90; this process runs 2 threads)")
    # 0.8 cores of others on 16 cores beside 2 threads: they had cores of their own
    assert not meter([1000.0, 1020.0], [50.0, 62.0], cores=16).busy
    # no /proc/stat: the load average, less this process's threads, stands in
    assert meter([None, None], [0.0, 0.0], load_average=3.5).busy
    assert not meter([None, None], [0.0, 0.0], load_average=2.1).busy


def test_a_probe_notes_a_busy_machine_in_its_result(tmp_path):
    time_row, _ = _timings(0.020, {1: 1.0, 2: 1.1})
    meter = probing.LoadMeter(busy_seconds=iter([0.0, 20.0]).__next__, own_seconds=iter([0.0, 10.0]).__next__,
                            clock=iter([0.0, 10.0]).__next__, load_average=lambda: 3.0, cores=2, threads=2)
    result = probe.probe(lambda dtype, engine: tiny_model("llama"), "m", ["float32"], ["eager"], lengths=(1, 2),
                         repeats=1, time_row=time_row, sampler=FixedRates(), load_meter=meter)
    assert result.load.others_cores == pytest.approx(1.0) and result.load.busy
    data = json.loads(json.dumps(result.to_dict()))
    assert data["load"]["busy"] is True and data["load"]["load_average"] == 3.0
    assert probe_rows.ProbeResult.from_dict(data).load == result.load
    # its rows pass their checks, but contention slows the floor's rates too: not cached
    assert probe_rows.row_problems(result.rows[0]) == []
    assert result.problems == ["the machine was busy (other processes kept 1.0 of 2 cores busy, load average 3.00; "
                               "this process runs 2 threads)"]
    assert probe.save_probe(result, tmp_path) is None and not probe.probe_path(tmp_path, "m").exists()


def test_busy_cpu_seconds_read_from_proc_stat(tmp_path):
    (tmp_path / "stat").write_text("cpu  2000 100 300 9000 50 10 20 70 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    ticks = probing.os.sysconf("SC_CLK_TCK")
    assert probing._busy_cpu_seconds(str(tmp_path / "stat")) == pytest.approx((2000 + 100 + 300 + 10 + 20 + 70) / ticks)
    assert probing._busy_cpu_seconds(str(tmp_path / "absent")) is None


# ----- a cached row checked when it is used -----------------------------------------------------
def test_a_cached_row_is_kept_while_a_step_agrees_and_measured_again_when_not():
    cached = probe_rows.ProbeRow("native", "float32", 20.0, {1: 1.0, 8: 1.4})
    fresh = probe_rows.ProbeRow("native", "float32", 21.0, {1: 1.0, 8: 1.5})
    remeasured = []

    def remeasure():
        remeasured.append(True)
        return fresh

    assert probing.recheck_row(cached, lambda: 0.039, remeasure) is cached  # 1.95x: within 2x
    assert probing.recheck_row(cached, lambda: 0.011, remeasure) is cached
    assert remeasured == []
    notes = []
    assert probing.recheck_row(cached, lambda: 0.041, remeasure, notes.append) is fresh  # 2.05x slower
    bogus = probe_rows.ProbeRow("native", "float32", 1184.0, {1: 1.0, 8: 1.4})
    assert probing.recheck_row(bogus, lambda: 0.020, remeasure) is fresh  # the step, 59x a step timed now
    assert len(remeasured) == 2
    assert notes == ["probe native float32: a step took 41.0 ms where the cached probe says 20.0 ms: "
                     "measuring the row again"]
    # new timings that fail their checks are no evidence against the cache
    notes.clear()
    assert probing.recheck_row(cached, lambda: 0.200, lambda: None, notes.append) is cached
    assert len(notes) == 2 and "failed their checks" in notes[1]


def test_a_row_measured_again_replaces_the_cached_one(tmp_path):
    stale = probe_rows.ProbeRow("native", "float32", 60.0, {1: 1.0, 8: 1.4})
    other = probe_rows.ProbeRow("native", "bfloat16", 14.0, {1: 1.0, 8: 1.7})
    probe.save_probe(probe_rows.ProbeResult(probe.machine_key(), "cpu", "m", [stale, other]), tmp_path)
    model = SimpleNamespace(name="m", native=object(), dtype=torch.float32, precision="float32")
    fresh = probe_rows.ProbeRow("native", "float32", 20.0, {1: 1.0, 8: 1.3})
    assert probe.checked_model_row(model, tmp_path, time_step=lambda: 0.050, remeasure=lambda: fresh) == stale
    assert probe.load_probe(tmp_path, "m").rows == [stale, other]  # agreed: the file is left alone
    assert probe.checked_model_row(model, tmp_path, time_step=lambda: 0.020, remeasure=lambda: fresh) == fresh
    assert probe.load_probe(tmp_path, "m").rows == [fresh, other]
    assert probe.default_dtype(tmp_path, "m", "native", native_bf16=False) == "bfloat16"
    eager = SimpleNamespace(name="m", native=None, dtype=torch.float32, precision="float32")
    assert probe.checked_model_row(eager, tmp_path, time_step=lambda: 1 / 0, remeasure=lambda: 1 / 0) is None


def test_the_default_recheck_times_the_model_itself(tmp_path):
    model = tiny_model("llama")
    cached = probe_rows.ProbeRow("eager", "float32", 1e6, {1: 1.0, 2: 1.1})  # a thousand seconds a step
    probe.save_probe(probe_rows.ProbeResult(probe.machine_key(), "cpu", model.name, [cached]), tmp_path)
    notes = []
    row = probe.checked_model_row(model, tmp_path, on_note=notes.append)
    assert notes[0].startswith("probe eager float32: a step took ") and "measuring the row again" in notes[0]
    if row == cached:  # the tiny model's timings failed their checks (its step is far above its floor)
        assert "failed their checks" in notes[-1] and probe.load_probe(tmp_path, model.name).rows == [cached]
    else:
        assert row.step_ms < 1e6 and set(row.relative) == {1, 2}
        assert probe.load_probe(tmp_path, model.name).rows == [row]


# ----- a decode slower than the probe says ------------------------------------------------------
def test_pace_check_says_when_the_passes_ran_three_times_slower():
    row = probe_rows.ProbeRow("native", "float32", 20.0, {1: 1.0, 4: 1.5})
    pace = probe_rows.PaceCheck(row)
    for _ in range(10):
        pace.add(1, 0.055)  # 2.75x a step
    pace.add(4, 0.080)  # 2.67x a 4-token pass (30 ms)
    assert pace.note() is None
    slow = probe_rows.PaceCheck(row)
    for _ in range(3):
        slow.add(4, 0.100)
    assert slow.note() is None  # three passes say nothing
    slow.add(1, 0.080)
    assert slow.note() == ("decoding ran 3.5x slower than this machine's probe says (native float32, 27.5 ms a pass "
                           "expected, 95.0 ms taken): the machine is busy")
    unprobed = probe_rows.PaceCheck(None)
    unprobed.add(1, 10.0)
    assert unprobed.note() is None


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_a_decode_slower_than_its_probe_row_says_so(draft):
    from layerplan.decoding.generate import generate

    model = tiny_model("llama")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    impossible = probe_rows.ProbeRow("eager", "float32", 1e-6, {1: 1.0, 8: 1.5})  # a microsecond a step
    result = generate(model, prompt, max_new_tokens=12, draft=draft, stop_at_eos=False, probe_row=impossible)
    assert result.slow_note is not None and "slower than this machine's probe says" in result.slow_note
    assert result.to_dict()["slow_note"] == result.slow_note  # what --stats prints
    generous = probe_rows.ProbeRow("eager", "float32", 60_000.0, {1: 1.0, 8: 1.5})  # a minute a step
    assert generate(model, prompt, max_new_tokens=12, draft=draft, stop_at_eos=False,
                    probe_row=generous).slow_note is None


def test_health_says_when_decodes_run_slower_than_the_probe():
    from fastapi.testclient import TestClient

    from layerplan.app.serve import create_app
    from layerplan.decoding.scheduler import Job
    from layerplan.decoding.sampling_params import SamplingParams

    impossible = probe_rows.ProbeRow("eager", "float32", 1e-6, {1: 1.0})
    app = create_app(tiny_model("llama"), probe_row=impossible)
    client = TestClient(app)
    assert client.get("/health").json()["slow_decode"] is None
    job = Job(prompt_ids=[5, 6, 7], max_tokens=8, sampling=SamplingParams(), seed=0, stop=())
    result = app.state.scheduler.submit(job).result(timeout=60)
    assert result.slow_note is not None
    assert client.get("/health").json()["slow_decode"] == result.slow_note
    app.state.scheduler.close()


def test_a_servers_default_batch_is_the_fewest_rows_near_the_best_rate():
    """k / cost(k) is a pass's tokens per step: the default batch is the fewest rows at 90% of its
    best, not the best itself, whose last rows add little and slow every request in the pass."""
    flat = probe_rows.ProbeRow("native", "stored-fast", 3.0, {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4})
    assert flat.fullest_pass() == 16  # rows nearly free: 16 / 1.4 = 11.4 a step, 8 / 1.2 = 6.7
    bound = probe_rows.ProbeRow("native", "stored-fast", 3.0, {1: 1.0, 2: 1.08, 4: 1.34, 8: 2.07, 12: 3.3, 16: 4.2})
    # rates 1, 1.85, 2.99, 3.86, 3.64, 3.81: 90% of 3.86 is 3.48, first reached at 8 rows
    assert bound.fullest_pass() == 8 and bound.fullest_pass(share=0.75) == 4
    assert probe_rows.ProbeRow("native", "stored", 3.0, {1: 1.0, 2: 2.1}).fullest_pass() == 1


def test_the_table_keeps_its_columns_for_long_dtype_names():
    """`stored-fast` is wider than the dtype heading: the numbers stay under their headings."""
    rows = [probe_rows.ProbeRow("native", "stored", 32.6, {1: 1.0, 4: 2.92}),
            probe_rows.ProbeRow("native", "stored-fast", 21.8, {1: 1.0, 4: 1.46})]
    lines = probe_rows.ProbeResult("key", "cpu", "m", rows).table().splitlines()
    ends = {line.index("ms/step") + len("ms/step") if "ms/step" in line else line.index(".") + 2 for line in lines}
    assert len(ends) == 1 and len({len(line) for line in lines}) == 1, lines  # every column under its heading
