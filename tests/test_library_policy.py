"""What the CLI used to decide for itself, as library functions that take what they need: the
"auto" dtype, the plan the `auto` drafter proposes with, a merge study's first trials, and the
probe's verify costs handed to speculative decoding rather than read from disk on every call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.drafters.saved import save_draft_plan, saved_draft_path
from layerplan.decoding.speculative import speculative_generate
from layerplan.engine import probe
from layerplan.engine.cpu_pack import packing_supported
from layerplan.engine.load import choose_dtype
from layerplan.plan.formats import load_plan
from layerplan.search.blocks import MergeSpace, repeat_plan
from layerplan.search.run import run_search
from tiny import tiny_model


def test_auto_dtype_is_the_probes_fastest_else_what_reads_bf16_at_full_speed():
    assert choose_dtype("float16", "eager", "cpu") == "float16"  # not "auto": as given
    fastest = SimpleNamespace(fastest_dtype=lambda engine: {"eager": "float32", "native": "bfloat16"}.get(engine))
    assert choose_dtype("auto", "eager", "cpu", fastest) == "float32"
    unmeasured = SimpleNamespace(fastest_dtype=lambda engine: None)
    plain = "bfloat16" if packing_supported(torch.bfloat16, "cpu") else "float32"
    assert choose_dtype("auto", "eager", "cpu", unmeasured) == plain
    assert choose_dtype("auto", "eager", "cpu", None) == plain


def test_a_merge_space_seeds_only_the_parameters_it_chooses():
    model = tiny_model("llama", num_layers=4)
    fixed = MergeSpace((0, 3), 3, 2, (1.0, 1.0), ("",))
    assert fixed.seed(1, 2, 2) == {"start": 1, "length": 2, "repeats": 2}
    ranged = MergeSpace((0, 3), 3, 2, (0.5, 1.0), ("", "b"))
    seed = ranged.seed(1, 2, 2)
    assert seed == {"start": 1, "length": 2, "repeats": 2, "scale": 1.0, "source": ""}
    assert ranged.plan_of_params(model, seed) == repeat_plan(model, 1, 2, 2, 1.0, "")
    assert fixed.plan_of_params(model, fixed.seed(1, 2, 2)) == repeat_plan(model, 1, 2, 2, 1.0, "")


def test_the_auto_drafters_plan_is_kept_by_the_library(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    model = tiny_model("llama", num_layers=4)
    assert save_draft_plan(model, model.plan()) is None and not saved_draft_path(model).exists()
    path = save_draft_plan(model, model.plan("skip:attn=1"))
    assert path == saved_draft_path(model)
    assert load_plan(path, model.num_layers, model.name).to_string() == "skip:attn=1"
    assert len(make_drafter("auto", model).models) == 1


def test_a_search_keeps_its_best_plan_for_auto_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    quiet = run_search(model, ids, "agreement", "greedy", budget=1, folder=tmp_path / "a")
    assert quiet.saved_draft is None and not saved_draft_path(model).exists()  # a library call writes nothing by default
    kept = run_search(model, ids, "agreement", "greedy", budget=1, folder=tmp_path / "b", save_draft=None)
    assert kept.draft_worthy and kept.saved_draft == saved_draft_path(model)
    assert load_plan(kept.saved_draft, model.num_layers, model.name) == kept.best_plan


def test_speculative_decoding_takes_its_verify_costs_and_reads_no_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))

    def no_disk(*args, **kwargs):
        raise AssertionError("the probe cache was read")

    monkeypatch.setattr(probe, "load_probe", no_disk)
    monkeypatch.setattr(probe, "pass_costs", no_disk)
    model = tiny_model("llama", num_layers=4)
    costs = {k: 1.0 + 0.1 * (k - 1) for k in range(1, 17)}
    assert make_drafter("auto", model, pass_costs=costs).pass_costs == costs
    row = probe.ProbeRow("eager", "float32", 1.0, costs)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    plain = speculative_generate(model, prompt, "ngram", max_new_tokens=12, stop_at_eos=False)
    with_row = speculative_generate(model, prompt, "auto", max_new_tokens=12, stop_at_eos=False, probe_row=row)
    assert with_row.token_ids == plain.token_ids


@pytest.mark.parametrize("spec", ["ngram", "auto"])
def test_without_a_probe_row_the_costs_are_learned(spec, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "load_probe", lambda *args, **kwargs: pytest.fail("the probe cache was read"))
    model = tiny_model("llama", num_layers=3)
    result = speculative_generate(model, [5, 9, 14, 5, 9], spec, max_new_tokens=6, stop_at_eos=False)
    assert len(result.token_ids) == 6
