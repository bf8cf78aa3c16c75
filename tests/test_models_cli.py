import gc
import json

import pytest
import torch
from click.testing import CliRunner

from layerplan.app.cli import main
from layerplan.models.depth import model_depth
from layerplan.models.loading import ModelError, load_model
from layerplan.search.importance import load_cached_scan


def test_missing_model_says_what_was_looked_for(tmp_path):
    with pytest.raises(ModelError, match="no model at .*looked for a folder with config.json"):
        load_model(tmp_path / "nothing")


def test_hf_folder_round_trip(tmp_path):
    from tiny import tiny_hf

    hf = tiny_hf("qwen2")
    hf.save_pretrained(tmp_path / "m")
    assert model_depth(tmp_path / "m") == (3, "m")


def test_cli_plan_conversions_and_errors():
    runner = CliRunner()
    result = runner.invoke(main, ["plan", "0-7,4-11", "--layers", "12", "--to", "layer-replication"])
    assert result.exit_code == 0 and json.loads(result.output) == [[0, 8], [4, 12]]
    result = runner.invoke(main, ["plan", "skip:attn=1;mlp=2", "--layers", "4", "--to", "run-layers"])
    assert json.loads(result.output) == [3, 2, 1, 3]
    result = runner.invoke(main, ["plan", "0-12", "--layers", "12"])
    assert result.exit_code == 1
    assert "layer 12 is out of range: the model has layers 0–11" in result.output


def test_cli_plan_errors_name_the_format_asked_for():
    result = CliRunner().invoke(main, ["plan", "0,2,1,3", "--layers", "4", "--to", "draft-verify"])
    assert result.exit_code != 0
    assert "Draft & Verify skip sets can only express the model's own layer order" in result.output
    assert "run_layers" not in result.output


@pytest.mark.real
def test_cli_plan_against_default_model_names_it():
    result = CliRunner().invoke(main, ["plan", "0-31"])
    assert result.exit_code == 1
    assert "layer 31 is out of range: SmolLM2-135M-Instruct has layers 0–29" in result.output


@pytest.mark.real
def test_cli_scan_writes_json_and_png(tmp_path, monkeypatch):
    # the kept copy goes to a cache of this test's own: the models stay where the cache has them
    monkeypatch.setattr("layerplan.search.importance.cache_dir", lambda: tmp_path / "cache")
    result = CliRunner().invoke(main, ["scan", "--tokens", "64", "--kinds", "attention", "--dtype", "bfloat16",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "scan.json").read_text())
    assert len(data["items"]) == 30 and data["tokens"] == 64
    assert (tmp_path / "scan.png").read_bytes()[:4] == b"\x89PNG"
    assert "least harmful to skip" in result.output
    kept = load_cached_scan(data["model"])  # the copy `layerplan serve`'s page draws its heatmap from
    assert kept is not None and kept.to_dict() == data


@pytest.mark.real
def test_cli_generate_and_ppl():
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "Write a Python function that adds two numbers.", "--chat",
                                  "-n", "30", "--no-stream"])
    assert result.exit_code == 0 and "def " in result.output
    result = runner.invoke(main, ["ppl", "--plan", "skip:attn=20", "--window", "128", "--stride", "128"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["perplexity"] > 1 and 0 < report["vs_full_model"]["top1_agreement"] < 1


def test_cli_export_mergekit(tmp_path):
    out = tmp_path / "merge.yaml"
    result = CliRunner().invoke(main, ["export", "0-5,3-9", "--model", str(_tiny_folder(tmp_path)),
                                       "--to", "mergekit", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "passthrough" in out.read_text() and "- 3\n" in out.read_text()


def _tiny_folder(tmp_path):
    from tiny import tiny_hf

    hf = tiny_hf("llama", num_layers=10)
    hf.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


@pytest.mark.real
def test_cli_explore_and_export_checkpoint(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["explore", "--recompute", "20", "--rewind", "10", "--tokens", "64",
                                  "--dtype", "bfloat16", "--out", str(tmp_path / "explore")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "explore" / "explore.png").read_bytes()[:4] == b"\x89PNG"
    assert "0-19,10-29" in result.output
    del result
    gc.collect()  # explore's model (in reference cycles) before export loads its own
    result = runner.invoke(main, ["export", "0-9", "--out", str(tmp_path / "pruned")])
    assert result.exit_code == 0, result.output
    assert '"num_hidden_layers": 10' in (tmp_path / "pruned" / "config.json").read_text()


@pytest.mark.real
def test_cli_search_writes_plan_report_plots_and_resumes(tmp_path):
    args = ["search", "--objective", "agreement", "--trials", "5", "--budget", "2", "--tokens", "64",
            "--dtype", "bfloat16", "--out", str(tmp_path), "--no-save-draft"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    report = json.loads((tmp_path / "search.json").read_text())
    assert len(report["greedy"]["steps"]) == 2
    assert len([t for t in report["study"]["trials"] if t["state"] == "COMPLETE"]) == 5
    assert report["study"]["trials"][0]["plan"] == "full"  # seeded with the full model, then greedy's plan
    assert report["study"]["trials"][1]["plan"] == report["greedy"]["best_plan"]
    for name in ("best_plan.json", "greedy.png", "trajectory.png", "skip-frequency.png", "study.db"):
        assert (tmp_path / name).exists(), name
    del first
    gc.collect()  # the first run's model (in reference cycles) before the second loads its own
    again = CliRunner().invoke(main, args[:4] + ["7"] + args[5:])
    assert again.exit_code == 0, again.output
    report = json.loads((tmp_path / "search.json").read_text())
    assert len([t for t in report["study"]["trials"] if t["state"] == "COMPLETE"]) == 7


@pytest.mark.real
def test_cli_tune_writes_report_and_checks_exactness(tmp_path):
    result = CliRunner().invoke(main, ["tune", "--tokens", "64", "--steps", "1", "--repeats", "1", "--new-tokens", "8",
                                       "--prompt", "code", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["best"]["draft"] in [c["draft"] for c in report["choices"]]
    assert all(c["same_as_plain_fp32"] for c in report["choices"])  # the exactness guarantee
    # a GGUF run as stored: checked on its blocks with exact products, and nothing dequantized whole
    # for transformers (--transformers asks for it): the speedups are against plain decoding
    assert report["exact_precision"] == "stored"
    methods = {r["method"] for r in report["bench"]["rows"]}
    assert methods >= {"layerplan plain", "layerplan draft=ngram"} and "transformers generate" not in methods
    assert report["bench"]["reference"] == "layerplan plain"
    html_text = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in html_text and "layerplan generate --dtype stored" in html_text  # auto runs the GGUF as stored
    assert "use it: layerplan generate" in result.output
    # the frontier: every family placed, the lookups at no draft cost, in the report and its picture
    points = {p["draft"]: p for p in report["frontier"]["points"]}
    assert {"online", "ngram", "suffix"} <= set(points) and any(d.startswith("exit:") for d in points)
    assert points["ngram"]["draft_cost"] < 0.1 < min(p["draft_cost"] for d, p in points.items() if d.startswith("exit:"))
    assert (tmp_path / "frontier.png").exists() and "The draft frontier" in html_text
    assert "frontier: best self-draft" in result.output
    assert not (tmp_path / "scan.partial.jsonl").exists()  # the scan's journal goes with the report written


@pytest.mark.real
def test_cli_frontier_places_the_drafts_it_is_given(tmp_path):
    result = CliRunner().invoke(main, ["frontier", "--draft", "exit:15", "--draft", "ngram", "--prompt", "code",
                                       "--new-tokens", "8", "--gamma", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "frontier.json").read_text())
    assert [p["draft"] for p in report["points"]] == ["exit:15", "ngram"] and report["gamma"] == 2
    assert (tmp_path / "frontier.png").exists() and "exit:15" in result.output
    bad = CliRunner().invoke(main, ["frontier", "--draft", "exit:999", "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "Traceback" not in bad.output and len(bad.output.strip().splitlines()) <= 2


@pytest.mark.real
def test_cli_frontier_places_the_plan_a_search_saved(tmp_path, monkeypatch):
    """Without --draft, the frontier's families include the draft plan a search or tune saved for
    the model (the file `auto` drafts with), read as the plan file it is."""
    from layerplan.decoding.drafters.saved import save_draft_plan
    from layerplan.engine.load import load_model

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    model = load_model()
    saved = save_draft_plan(model, model.plan("skip:attn=14"))
    result = CliRunner().invoke(main, ["frontier", "--prompt", "code", "--new-tokens", "4", "--gamma", "2",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    points = [p["draft"] for p in json.loads((tmp_path / "out" / "frontier.json").read_text())["points"]]
    assert str(saved) in points and "ngram" in points


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--threads", "-1"], "Invalid value for '--threads' / '-t': -1 is not in the range 1<=x<=1024"),
    (["generate", "hi", "--threads", "0"], "Invalid value for '--threads' / '-t': 0 is not in the range 1<=x<=1024"),
    (["generate", "hi", "--device", "bogus", "--dtype", "float32"], "unknown device 'bogus'; use cpu, cuda or cuda:N"),
    (["generate", "hi", "--device", "bogus"], "unknown device 'bogus'; use cpu, cuda or cuda:N"),
])
def test_cli_bad_values_get_one_line(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (1, 2) and message in result.output
    assert "Traceback" not in result.output


def test_missing_gpu_and_empty_prompt_are_named(smollm2):
    from layerplan.decoding.generate import generate
    from layerplan.models.loading import resolve_device

    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="sees no CUDA GPU; use --device cpu"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(smollm2, "", max_new_tokens=2)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(smollm2, [], max_new_tokens=2)


def test_models_lists_what_the_cache_holds_by_file_and_prunes_the_stale(tmp_path, monkeypatch):
    """A cache with a file's index, panels and dense copy, a file since changed and a file gone:
    each present file with its folders and sizes (the packaged default first), the stale ones
    summed; --prune removes only theirs; --json says the same."""
    from layerplan.models.gguf_index import write_source_record

    cache = tmp_path / "cache"
    monkeypatch.setenv("LAYERPLAN_CACHE", str(cache))
    kept, changed, gone = (tmp_path / f"{name}.gguf" for name in ("kept", "changed", "gone"))
    for path in (kept, changed, gone):
        path.write_bytes(b"GGUF" + bytes(1000))
    folders = {}
    for source in (kept, changed, gone):
        for sub in ("stored", "panels", "models"):
            folder = folders[source.stem, sub] = cache / sub / f"{source.stem}-x"
            folder.mkdir(parents=True)
            write_source_record(folder, source)
            (folder / "data").write_bytes(bytes(4096 if sub == "panels" else 100))
    changed.write_bytes(b"GGUF" + bytes(2000))  # (another file now: its folders can never be used again)
    gone.unlink()
    (cache / "llama.cpp").mkdir()
    (cache / "llama.cpp" / "tool").write_bytes(bytes(300))

    listing = json.loads(CliRunner().invoke(main, ["models", "--json"]).output)
    by_source = {m["source"]: m for m in listing["models"]}
    assert listing["models"][0]["default"]  # the packaged default, first
    assert by_source[str(kept.resolve())]["state"] == "present"
    assert by_source[str(kept.resolve())]["file_bytes"] == 1004
    assert sorted((f["kind"], f["bytes"]) for f in by_source[str(kept.resolve())]["folders"]) == [
        ("dense copy", 100 + len((folders["kept", "models"] / "layerplan-source.json").read_bytes())),
        ("index", 100 + len((folders["kept", "stored"] / "layerplan-source.json").read_bytes())),
        ("panels", 4096 + len((folders["kept", "panels"] / "layerplan-source.json").read_bytes()))]
    assert (by_source[str(changed.resolve())]["state"], by_source[str(gone.resolve())]["state"]) == ("changed", "gone")
    assert listing["others"] == {"llama.cpp's tools": 300}

    shown = CliRunner().invoke(main, ["models"])
    assert shown.exit_code == 0
    assert str(kept.resolve()) in shown.output and str(gone.resolve()) not in shown.output
    assert "2 model files gone or changed since their folders were made: 6 folders" in shown.output
    assert "free to delete" in shown.output

    pruned = CliRunner().invoke(main, ["models", "--prune"])
    assert pruned.exit_code == 0 and "removed the folders of 2 model files gone or changed" in pruned.output
    assert all(folders["kept", sub].exists() for sub in ("stored", "panels", "models"))
    assert not any(folders[name, sub].exists() for name in ("changed", "gone") for sub in ("stored", "panels", "models"))
