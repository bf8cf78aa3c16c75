"""Which machine a figure came from: the CPU line of `bench` and `tune`."""

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from layerplan.app import cli
from layerplan.app import bars as progress_bars
from layerplan.app.cli import research
from layerplan.app.bench import bench_methods, wants_transformers
from layerplan.app.bench_runs import run_bench
from layerplan.machine import cpu_info, isa_level, read_cpuinfo
from tiny import tiny_model

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma
"""


@pytest.mark.parametrize("flags, level", [
    ("sse2 avx avx2", "AVX2"),
    ("avx2 avx512f avx512bw", "AVX-512"),
    ("avx2 avx512f avx512_bf16", "AVX-512 BF16"),
    ("avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8", "AMX"),
    ("sse2 avx", "below AVX2"),
])
def test_isa_level_from_cpu_flags(flags, level):
    assert isa_level(set(flags.split())) == level


def test_cpu_line_from_proc_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert read_cpuinfo(path) == ("AMD EPYC 7B13", {"fpu", "sse", "sse2", "avx", "avx2", "fma"})
    info = cpu_info(path)
    assert (info.model, info.isa) == ("AMD EPYC 7B13", "AVX2")
    assert info.torch_capability == torch.backends.cpu.get_cpu_capability()  # what ATEN_CPU_CAPABILITY may lower
    assert info.threads == torch.get_num_threads() and info.torch == torch.__version__
    line = info.line()
    assert "AMD EPYC 7B13" in line and "AVX2" in line and f"{info.threads} threads" in line
    assert cpu_info(tmp_path / "absent").isa == "unknown"  # not Linux: still a line, not an error


def test_bench_results_say_which_cpu_they_came_from():
    model = SimpleNamespace(name="tiny", dtype=torch.float32, precision="float32", encode=lambda text, chat=False: torch.tensor([[1, 2]]))

    def run(ids, new_tokens):
        return 0.01, [1, 2], None

    result = run_bench(model, {"transformers generate": run, "layerplan plain": run}, {"code": "def f():"},
                       new_tokens=2, repeats=1)
    assert result.cpu == cpu_info()
    assert json.loads(json.dumps(result.to_dict()))["cpu"]["isa"] == cpu_info().isa


def test_bench_without_transformers_is_against_plain_decoding(tmp_path):
    """A GGUF run as stored is not timed in transformers unless asked (it would run the file
    dequantized whole: 28 GB for a 7B): the speedups are then against layerplan's plain decoding."""
    from layerplan.models.gguf_place import DEFAULT_MODEL

    assert not wants_transformers(DEFAULT_MODEL, "stored-fast") and not wants_transformers(DEFAULT_MODEL, "stored")
    assert wants_transformers(DEFAULT_MODEL, "float32")  # dense by the user's word
    folder = tmp_path / "hf"
    folder.mkdir()
    assert wants_transformers(str(folder), "q4_k")  # a checkpoint's own weights, quantized at load
    model = tiny_model("llama", num_layers=2)
    assert list(bench_methods(None, model)) == ["layerplan plain"]
    with pytest.raises(ValueError, match="--transformers"):
        bench_methods(None, model, hf_early_exits=[1])
    fake = SimpleNamespace(name="tiny", dtype=torch.float32, precision="float32",
                           encode=lambda text, chat=False: torch.tensor([[1, 2]]))
    result = run_bench(fake, {"layerplan plain": lambda ids, n: (0.02, [1, 2], None),
                              "layerplan draft=ngram": lambda ids, n: (0.01, [1, 2], None)},
                       {"code": "def f():"}, new_tokens=2, repeats=1)
    assert result.reference == "layerplan plain" and result.versus == "vs plain"
    assert [round(r.speedup, 6) for r in result.rows] == [1.0, 2.0]
    assert "vs plain" in result.table().splitlines()[0]


def test_tune_draws_one_progress_bar_per_stage(monkeypatch, tmp_path):
    """Each stage gets a bar of its own: a shared one restarted its count but not its clock, so
    later stages showed ETAs of hours."""
    bars = []

    class Bar:
        def __init__(self, desc, **_):
            self.desc, self.n, self.total, self.closed = desc, 0, None, False
            bars.append(self)

        def refresh(self):
            pass

        def close(self):
            self.closed = True

    def fake_tune(model, fp32_model, prompts, tokens, steps, repeats, new_tokens, stock, on_stage, on_progress,
                  probe_row, scan_journal):
        for stage, total in (("scan: every sub-layer", 4), ("search: greedy", 3), ("bench: drafts", 2)):
            on_stage(stage)
            for done in range(1, total + 1):
                on_progress(done, total)
        raise ValueError("stop here")  # the rest of tune is not under test

    model = tiny_model("llama", num_layers=2)
    monkeypatch.setattr(progress_bars, "tqdm", Bar)
    monkeypatch.setattr(research, "load_for_timing", lambda name, dtype, engine, on_note, transformers: (model, model))
    monkeypatch.setattr(research, "run_tune", fake_tune)
    result = CliRunner().invoke(cli.main, ["tune", "--out", str(tmp_path)])
    assert "stop here" in result.output
    assert [(b.desc, b.n, b.total) for b in bars] == [("scan", 4, 4), ("search", 3, 3), ("bench", 2, 2)]
    assert all(b.closed for b in bars)


def test_prompt_file_jsonl_and_text(tmp_path):
    from layerplan.app.prompts import read_prompt_file

    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"prompt": "def f(x):\\n", "name": "code"}\n\n"plain string"\n{"prompt": "Hi?", "chat": true}\n')
    prompts, chat = read_prompt_file(jsonl)
    assert prompts == {"code": "def f(x):\n", "mine-2": "plain string", "mine-3": "Hi?"}
    assert chat == {"mine-3"}
    text = tmp_path / "lines.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompt_file(text) == ({"lines-1": "first prompt", "lines-2": "second prompt"}, set())


@pytest.mark.parametrize("content,message", [
    ("{not json\n", r"bad.jsonl:1: not JSON"),
    ('{"prompt": ""}\n', r"bad.jsonl:1: expected a non-empty string"),
    ('{"prompt": "a", "chat": "yes"}\n', r"bad.jsonl:1: expected"),
    ('{"prompt": "a", "name": "x"}\n{"prompt": "b", "name": "x"}\n', r"bad.jsonl:2: prompt name 'x' is used twice"),
    ("\n\n", r"bad.jsonl holds no prompt"),
])
def test_prompt_file_errors_name_file_and_line(tmp_path, content, message):
    from layerplan.app.prompts import read_prompt_file

    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_prompt_file(path)


def test_cli_bench_refuses_a_bad_prompt_file_in_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n")
    result = CliRunner().invoke(cli.main, ["bench", "--prompt-file", str(path)])
    assert result.exit_code == 1 and "bad.jsonl:1: not JSON" in result.output
    assert "Traceback" not in result.output


_FAULTS_OF_A_SECOND_BLOCK = """
import ctypes, resource, sys
from layerplan.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
def touched():  # as the kernels' scratch: malloc, every page written, free
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
touched()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touched()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_freed_large_block_is_reused_without_faults_once_the_heap_keeps_them():
    """heap.py keep_freed_memory (the command asks for it at its start): a second 64 MB block,
    after the first was freed, is the same memory, touched already; without it, each is mapped
    afresh and every page of it faults."""
    import subprocess
    import sys

    runs = {how: subprocess.run([sys.executable, "-c", _FAULTS_OF_A_SECOND_BLOCK, how], capture_output=True, text=True,
                                check=True).stdout.split() for how in ("keep", "default")}
    if runs["keep"][0] != "True":
        pytest.skip("the C library is not glibc: nothing to ask")
    assert int(runs["keep"][1]) < 100 < 16384 - 100 < int(runs["default"][1])
