"""The hardware probe: timing passes, caching per machine, and what it decides."""

from __future__ import annotations

import json

import pytest

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
