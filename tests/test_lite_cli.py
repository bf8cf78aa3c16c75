"""`layerplan generate` on the light front end (layerplan/lite/, what the command starts on for a
GGUF's plain greedy continuation) against the same command line on the torch front end
(LAYERPLAN_FRONT_END=torch): the same text, streamed or not, the same messages; ppl's JSON and
scan's table and files likewise; and a start that imports neither torch nor transformers. The
packaged SmolLM2.

The light front end runs a process per command line, as a user starts it. The torch front end's
answers to the same command lines (TORCH_LINES) come from one process that runs them in turn, each
as `python -m layerplan.app.cli` runs it (app/cli run_as_process; its file descriptors 1 and 2
pointed at files of its own): a torch process starts in ~8 s on the 2-core machine, and a dozen of
them were the suite's largest module. The cache fixture's first run is a torch process of its own."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from layerplan.files import cache_dir
from layerplan.models.gguf_place import default_gguf_path
from layerplan.lite.cli import runnable
from layerplan.app.cli.generating import light_request
from layerplan.app.cli.scoring import light_ppl_request, light_scan_request
from layerplan.app.cli.exploring import light_explore_request
from layerplan.app.cli.searching import light_search_request

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of this module's own, where a first run on the torch front end indexed the file and
    kept its panels (what a first start does; it also says more on stderr)."""
    folder = tmp_path_factory.mktemp("cache")
    built = cache_dir() / "native"
    if built.exists():  # the kernels' library, built once per machine, not per file: not rebuilt here
        shutil.copytree(built, folder / "native", symlinks=True)
    first = _run(["generate", "Hi", "-n", "1"], folder, "torch")
    assert first.returncode == 0, first.stderr
    return folder


def _run(argv: list[str], cache, front_end: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "LAYERPLAN_CACHE": str(cache), "LAYERPLAN_FRONT_END": front_end}
    return subprocess.run([sys.executable, "-m", "layerplan.app.launch", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


# a prompt read from a file (-f), as llama-cli reads one (written at import: the lines name it)
PROMPT_FILE = Path(tempfile.gettempdir()) / f"layerplan-test-prompt-{os.getpid()}.txt"
PROMPT_FILE.write_text("def fibonacci(n):\n", encoding="utf-8")
SAME_OUTPUT = [
    ["generate", "The capital of France is", "-n", "16"],
    ["generate", "-f", str(PROMPT_FILE), "-n", "12"],
    ["generate", "Once upon a time", "-n", "12", "--dtype", "stored-fast", "--no-stream", "--threads", "1"],
    ["generate", "List three colors:", "-n", "24", "--stop", "\n\n", "--plan", "0-25,20-29"],
    ["generate", "Write a haiku about rain.", "-n", "20", "--plan", "exit:24", "--stop", "rain"],
    ["generate", "Hello", "-n", "0"],
    ["generate", "Say hi.", "--chat", "-n", "-1"],  # llama.cpp's -1: until the context is full (or EOS)
    ["generate", "What is the capital of France?", "--chat", "-n", "24"],
    ["generate", "Name two planets.", "--chat", "-n", "16", "--dtype", "stored-fast", "--no-stream"],
    # greedy with the penalties and a logit bias (decoding/choice.py)
    ["generate", "Once upon a time", "-n", "24", "--repeat-penalty", "1.3", "--frequency-penalty", "0.7", "-l",
     "28-inf", "-l", "253+3"],
    # sampled, seeded: the same draws (decoding/choice.py, numpy's generator on both)
    ["generate", "Once upon a time", "-n", "32", "--temp", "0.9", "-s", "7"],
    ["generate", "Tell me a story.", "--chat", "-n", "24", "--temp", "1.1", "-s", "-3", "--top-k", "40", "--top-p",
     "0.92", "--min-p", "0.02", "--repeat-penalty", "1.1", "--presence-penalty", "0.4", "-l", "28-inf"],
    # a plan of two models (the packaged file as model b too: the one real file the suite holds)
    ["generate", "The capital of France is", "-n", "12", "--model-b", str(default_gguf_path()), "--plan",
     "0-14,b:15-29"],
    # lookup drafts (decoding/rounds.py): greedy, seeded sampled (a seeded sample's draft lengths
    # follow its own rounds on both: the default, or a policy named that learns no timings, never
    # `adaptive`), with a corpus file, a chat frame, penalties and a stop
    ["generate", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):", "-n",
     "40", "--draft", "suffix"],
    ["generate", "One two three. One two three. One two", "-n", "24", "--draft", "ngram:3", "--temp", "0.8", "-s",
     "11", "--top-k", "30"],
    ["generate", "List the days of the week.", "--chat", "-n", "40", "--draft", "suffix:max=6,share=0.3",
     "--draft-length", "fixed", "--repeat-penalty", "1.2", "--stop", "Friday"],
    ["generate", "def fibonacci(n):", "-n", "24", "--draft", f"suffix:corpus={PROMPT_FILE}", "--plan", "0-25",
     "--temp", "1.2", "-s", "5", "--draft-length", "heuristic"],
    # the model's own sub-plans as drafts (drafters/plan.py on the LiteModel's passes), auto over
    # them and the lookups: greedy (plain's tokens), seeded sampled, through a plan, stopping on
    # low confidence
    ["generate", "The capital of France is", "-n", "24", "--draft", "exit:20", "--draft-confidence", "0.4"],
    ["generate", "Once upon a time", "-n", "24", "--draft", "skip:attn=5-9;mlp=4-8", "--temp", "0.7", "-s", "3"],
    ["generate", "Name the planets.", "--chat", "-n", "24", "--plan", "0-25,20-29", "--draft", "exit:24|ngram",
     "--draft-length", "fixed"],
    ["generate", "def add(a, b):\n    return a + b\n\ndef sub(a, b):", "-n", "32", "--draft", "auto"],
    ["generate", "The history of Rome in brief:", "-n", "24", "--draft", "window:4,8/exit:24", "--temp", "0.6", "-s",
     "2"],
    # another GGUF as the draft (-md, llama.cpp's flag; the packaged file, the one real file the suite holds)
    ["generate", "Once upon a time", "-n", "16", "-md", str(default_gguf_path()), "--temp", "0.7", "-s", "9"],
]
STATISTICS = ["generate", "The capital of France is", "-n", "8", "--stats", "--json", "--no-stream"]
BAD_REQUESTS = [
    (["generate", "Hello", "-n", "100000"], "Error: --max-new-tokens=100000 does not fit"),
    (["generate", "Hello", "--plan", "0-40"], "Error: "),
    (["generate", "Hello", "--draft", "suffix:often"], "Error: cannot read 'often' in 'suffix:often'"),
    (["generate", "Hello", "--draft", "suffix:corpus=/no/such/corpus.txt"],
     "Error: suffix corpus '/no/such/corpus.txt': no such file"),
    (["generate", "Hello", "--draft", "exit:40"], "Error: exit:40 is out of range"),
    (["generate", "Hello", "--draft", "skip:mlp=3", "--plan", "0-20"], "Error: draft plan 'skip:mlp=3' is not a sub-plan"),
    (["generate", "Hello", "--draft", "exit:30"], "Error: draft plan 'full' runs every sub-layer"),
]
SECOND_MODEL = ["generate", "Hello", "--plan", "0-10,b:11-20"]
SECOND_MODEL_PERPLEXITY = ["ppl", "--plan", "0-10,b:11-20", "--max-tokens", "64", "--window", "32"]
# `layerplan ppl` lines the light front end takes: the same JSON (search/windows.py's sums over the
# same logits), the same loading line
SAME_PERPLEXITY = [
    ["ppl", "--max-tokens", "300", "--window", "128", "--stride", "64"],
    ["ppl", "--text", "builtin:code", "--max-tokens", "160", "--window", "64", "--stride", "64", "--dtype", "stored",
     "--threads", "1"],
    # a plan, with its comparison with the full model (search/windows.py logits_divergence)
    ["ppl", "--plan", "0-20,14-29", "--max-tokens", "200", "--window", "96", "--stride", "48"],
    ["ppl", "--protocol", "llama.cpp", "--window", "64", "--max-tokens", "200", "--plan", "skip:mlp=3,7",
     "--dtype", "stored-fast"],
    ["ppl", "--model-b", str(default_gguf_path()), "--plan", "0-14,b:10-29", "--max-tokens", "160", "--window", "64",
     "--stride", "32"],
]
BAD_PERPLEXITY = (["ppl", "--stride", "600"], "Error: stride must be in 1..window (512), got 600")
# `layerplan scan` lines the light front end takes (each front end writing into a folder of its own:
# SCAN_OUT / front end / line)
SCAN_OUT = Path(tempfile.gettempdir()) / f"layerplan-test-scans-{os.getpid()}"
SAME_SCAN = [
    ["scan", "--tokens", "40", "--kinds", "attention,layer", "--plan", "skip:mlp=3"],
    ["scan", "--tokens", "32", "--exits", "--dtype", "stored-fast", "--threads", "1"],
]


SAME_SEARCH = [
    ["search", "--method", "greedy", "--objective", "kl", "--budget", "2", "--tokens", "40", "--no-save-draft"],
    ["search", "--objective", "agreement", "--budget", "1", "--trials", "4", "--seed", "2", "--tokens", "32",
     "--no-save-draft", "--dtype", "stored-fast"],
]

SAME_EXPLORE = ["explore", "--tokens", "48", "--recompute", "8,12", "--rewind", "2,4", "--plan", "0-20,15-29"]
BAD_SCAN = (["scan", "--kinds", "attention,heads"], "Error: unknown scan kind(s) ['heads']")


def _scan_line(i: int, front_end: str) -> list[str]:
    return [*SAME_SCAN[i], "--out", str(SCAN_OUT / front_end / str(i))]


def _search_line(i: int, front_end: str) -> list[str]:
    return [*SAME_SEARCH[i], "--out", str(SCAN_OUT / front_end / f"search-{i}")]


TORCH_LINES = [*SAME_OUTPUT, STATISTICS, *(argv for argv, _ in BAD_REQUESTS), SECOND_MODEL, *SAME_PERPLEXITY,
               BAD_PERPLEXITY[0], SECOND_MODEL_PERPLEXITY, *(_scan_line(i, "torch") for i in range(len(SAME_SCAN))),
               *(_search_line(i, "torch") for i in range(len(SAME_SEARCH))), BAD_SCAN[0],
               [*SAME_EXPLORE, "--out", str(SCAN_OUT / "torch" / "explore")]]

# runs each command line of argv[1] (a JSON list) as the torch front end's process would, its
# descriptors 1 and 2 on files of its own, and writes [status, stdout, stderr] per line to argv[2]
_TORCH_DRIVER = """
import json, os, sys, tempfile
from layerplan.app import cli

cli.main.process_is_the_command = True  # (what run_as_process sets)
answers = []
for argv in json.loads(sys.argv[1]):
    kept = [os.dup(1), os.dup(2)]
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
    try:
        cli.main(argv, prog_name="layerplan")
        status = 0
    except SystemExit as end:
        status = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(kept[0], 1); os.dup2(kept[1], 2)
    texts = []
    for file in files:
        file.seek(0)
        texts.append(file.read().decode())
    answers.append([status, *texts])
with open(sys.argv[2], "w") as out:
    json.dump(answers, out)
"""


@pytest.fixture(scope="module")
def torch_runs(cache, tmp_path_factory) -> dict[tuple, subprocess.CompletedProcess]:
    """The torch front end's answer to each of TORCH_LINES, from one process (see the module)."""
    answers = tmp_path_factory.mktemp("torch") / "answers.json"
    env = {**os.environ, "LAYERPLAN_CACHE": str(cache), "LAYERPLAN_FRONT_END": "torch"}
    done = subprocess.run([sys.executable, "-c", _TORCH_DRIVER, json.dumps(TORCH_LINES), str(answers)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return {tuple(argv): subprocess.CompletedProcess(argv, status, stdout, stderr)
            for argv, (status, stdout, stderr) in zip(TORCH_LINES, json.loads(answers.read_text()))}


def test_the_torch_lines_in_one_process_answer_as_a_process_of_their_own(cache, torch_runs):
    """The shared process is a faithful stand-in: a line answers there as in a process of its own
    (a line after others that set threads, plans, stops and the chat frame)."""
    argv = SAME_OUTPUT[-1]
    alone, shared = _run(argv, cache, "torch"), torch_runs[tuple(argv)]
    assert (alone.returncode, alone.stdout, alone.stderr) == (shared.returncode, shared.stdout, shared.stderr)


@pytest.mark.parametrize("argv", SAME_OUTPUT + SAME_PERPLEXITY)
def test_the_light_front_end_prints_what_the_torch_one_prints(argv, cache, torch_runs, monkeypatch):
    """generate's lines, and ppl's (the same JSON: search/windows.py's sums over the same logits)."""
    torch_run = torch_runs[tuple(argv)]
    assert torch_run.returncode == 0, torch_run.stderr
    monkeypatch.setenv("LAYERPLAN_CACHE", str(cache))
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    request = light_ppl_request(argv) if argv[0] == "ppl" else light_request(argv)
    assert runnable(request)  # so launch runs it on the light front end
    lite_run = _run(argv, cache)
    assert (lite_run.returncode, lite_run.stdout, lite_run.stderr) == (0, torch_run.stdout, torch_run.stderr)
    if argv[0] == "ppl":
        assert json.loads(lite_run.stdout)["tokens"] > 0


@pytest.fixture(scope="module", autouse=True)
def _scan_out_removed():
    """The scan and search lines' output folders, removed with the module's tests."""
    yield
    shutil.rmtree(SCAN_OUT, ignore_errors=True)
    PROMPT_FILE.unlink(missing_ok=True)


def _both_runs(argv: list[str], torch_argv: list[str], request, cache, torch_runs, monkeypatch):
    """(the light front end's run of argv, which it must take, and the torch one's of torch_argv):
    both ended well and said the same on stderr."""
    torch_run = torch_runs[tuple(torch_argv)]
    assert torch_run.returncode == 0, torch_run.stderr
    monkeypatch.setenv("LAYERPLAN_CACHE", str(cache))
    monkeypatch.delenv("LAYERPLAN_FRONT_END", raising=False)
    assert runnable(request)  # so launch runs it on the light front end
    lite_run = _run(argv, cache)
    assert lite_run.returncode == 0 and lite_run.stderr == torch_run.stderr, lite_run.stderr
    return lite_run, torch_run


@pytest.mark.parametrize("line", range(len(SAME_SCAN)))
def test_the_light_scan_prints_and_writes_what_the_torch_one_does(line, cache, torch_runs, monkeypatch):
    """The same table, loading line and files but for the folder named and the seconds taken (the
    candidates' numbers are the same bits: tests/test_lite_research.py)."""
    torch_argv, argv = _scan_line(line, "torch"), _scan_line(line, "light")
    lite_run, torch_run = _both_runs(argv, torch_argv, light_scan_request(argv), cache, torch_runs,
                                     monkeypatch)

    def untimed(text: str) -> str:
        return re.sub(r"candidates in [0-9.]+s", "", text.replace(argv[-1], torch_argv[-1]))

    assert untimed(lite_run.stdout) == untimed(torch_run.stdout) and "wrote" in lite_run.stdout
    name = "exits" if "--exits" in argv else "scan"
    written = [json.loads((Path(run[-1]) / f"{name}.json").read_text()) for run in (torch_argv, argv)]
    for result in written:
        result.pop("seconds")
    assert written[0] == written[1] and len(written[0]["items"]) > 20
    assert (Path(argv[-1]) / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("line", range(len(SAME_SEARCH)))
def test_the_light_search_prints_and_writes_what_the_torch_one_does(line, cache, torch_runs, monkeypatch):
    """The same lines, loading line and search.json (greedy's steps, a seeded study's trials) but
    for the folder named and the trials' clocks."""
    torch_argv, argv = _search_line(line, "torch"), _search_line(line, "light")
    lite_run, torch_run = _both_runs(argv, torch_argv, light_search_request(argv), cache, torch_runs,
                                     monkeypatch)
    assert lite_run.stdout.replace(argv[-1], torch_argv[-1]) == torch_run.stdout and "best plan" in lite_run.stdout
    written = [json.loads((Path(run[-1]) / "search.json").read_text()) for run in (torch_argv, argv)]
    for result in written:
        for trial in result.get("study", {}).get("trials", []):
            trial.pop("seconds", None)
    assert written[0] == written[1]


def test_the_light_exploration_prints_and_writes_what_the_torch_one_does(cache, torch_runs, monkeypatch):
    torch_argv, argv = ([*SAME_EXPLORE, "--out", str(SCAN_OUT / front_end / "explore")] for front_end in ("torch", "light"))
    lite_run, torch_run = _both_runs(argv, torch_argv, light_explore_request(argv), cache, torch_runs,
                                     monkeypatch)
    assert lite_run.stdout.replace(argv[-1], torch_argv[-1]) == torch_run.stdout and "best order" in lite_run.stdout
    written = [json.loads((Path(run[-1]) / "explore.json").read_text()) for run in (torch_argv, argv)]
    for result in written:
        result.pop("seconds")
    assert written[0] == written[1] and len(written[0]["rows"]) == 5
    for run in (torch_argv, argv):  # (the journal of finished rows goes once explore.json is written)
        assert not (Path(run[-1]) / "explore.partial.jsonl").exists()


@pytest.mark.parametrize("bad", [BAD_PERPLEXITY, BAD_SCAN])
def test_a_bad_line_gets_the_torch_front_ends_message(bad, cache, torch_runs):
    argv, error = bad
    torch_run, lite_run = torch_runs[tuple(argv)], _run(argv, cache)
    assert torch_run.returncode == lite_run.returncode == 1
    assert lite_run.stderr == torch_run.stderr and error in lite_run.stderr


def test_the_statistics_are_the_torch_front_ends_but_the_timings(cache, torch_runs):
    argv = STATISTICS
    torch_run, lite_run = torch_runs[tuple(argv)], _run(argv, cache)
    assert lite_run.returncode == torch_run.returncode == 0 and lite_run.stdout == torch_run.stdout
    stats = [json.loads(run.stderr[run.stderr.index("{"):]) for run in (torch_run, lite_run)]
    assert list(stats[0]) == list(stats[1])
    timings = ("seconds", "prefill_seconds", "tokens_per_second")
    untimed = [{k: v for k, v in s.items() if k not in timings} for s in stats]
    assert untimed[0] == untimed[1]
    assert stats[1]["provenance"]["plain"] == 8 and stats[1]["tokens_per_second"] > 0
    # --stats: llama.cpp's closing lines for a person, the same but for the times and rates
    untimed_lines = [re.sub(r"[0-9.]+ s \([0-9.]+ tokens/s\)", "T", run.stderr[:run.stderr.index("{")])
                     for run in (torch_run, lite_run)]
    assert untimed_lines[0] == untimed_lines[1]
    assert re.search(r"^prompt eval: \d+ tokens in T$", untimed_lines[1], re.M)
    assert re.search(r"^ +eval: 8 tokens in T$", untimed_lines[1], re.M)
    assert re.search(r"stopped: length · plan .* · stored-fast · \d+ threads · ", untimed_lines[1])


def test_the_chat_frame_tokenizes_as_transformers_chat_template(cache, monkeypatch):
    """The prompt wrapped in the index's chat frame (models/stored.py _chat_frame) gives the ids
    transformers' apply_chat_template gives, for texts with spaces, newlines, braces and the
    template's own special tokens."""
    from layerplan.engine.load import load_model
    from layerplan.lite.model import LiteModel
    from layerplan.models.gguf_place import gguf_of

    monkeypatch.setenv("LAYERPLAN_CACHE", str(cache))
    torch_model = load_model("smollm2", dtype="stored")
    lite = LiteModel(gguf_of("smollm2"))
    assert "prefix" in lite.chat
    for text in ("Hi", "  two\n lines  ", "{{ not a template }} {% raw %}", "<|im_end|> and <|im_start|>user", "é ü 你好"):
        assert lite.encode(text, chat=True) == torch_model.encode(text, chat=True)[0].tolist(), text
        assert lite.encode(text) == torch_model.encode(text)[0].tolist(), text


@pytest.mark.parametrize("argv,error", BAD_REQUESTS)
def test_a_bad_request_gets_the_torch_front_ends_message(argv, error, cache, torch_runs):
    torch_run, lite_run = torch_runs[tuple(argv)], _run(argv, cache)
    assert torch_run.returncode == lite_run.returncode == 1
    assert lite_run.stderr == torch_run.stderr and error in lite_run.stderr
    assert lite_run.stderr.count("\n") == 2  # the loading line, then the error's one line


@pytest.mark.parametrize("argv", [SECOND_MODEL, SECOND_MODEL_PERPLEXITY])
def test_a_plan_of_a_second_model_not_given_is_the_torch_front_ends_one_line(argv, cache, torch_runs):
    """A plan naming model b without --model-b (generate's, ppl's): the torch front end's message,
    said by the light front end itself (no second start)."""
    torch_run, lite_run = torch_runs[tuple(argv)], _run(argv, cache)
    assert lite_run.returncode == torch_run.returncode == 1
    assert lite_run.stderr == torch_run.stderr and lite_run.stderr.count("\n") == 2
    assert "only a is loaded" in lite_run.stderr


def test_a_start_on_the_light_front_end_imports_neither_torch_nor_transformers(cache, tmp_path):
    """generate (plain, and with a lookup draft, an exit of the model, auto), and then a scan with its table, JSON and picture;
    the generate imports none of the
    research modules (lite/research.py's), which its start would wait for."""
    probe = ("import sys\n"
             "from layerplan.lite.cli import run, runnable\n"
             "from layerplan.app.cli.generating import light_request\n"
             "request = light_request(['generate', 'The capital of France is', '-n', '4'])\n"
             "assert runnable(request)\n"
             "assert run(request) == 0\n"
             "for draft in ('ngram', 'exit:20', 'auto'):\n"
             "    drafted = light_request(['generate', 'a b a b a b', '-n', '8', '--draft', draft])\n"
             "    assert runnable(drafted) and run(drafted) == 0\n"
             "research = ('layerplan.lite.research', 'layerplan.lite.research_request', 'layerplan.lite.evaluator',\n"
             "            'layerplan.search.importance', 'layerplan.search.explore', 'layerplan.search.windows')\n"
             "assert not [m for m in research if m in sys.modules], [m for m in research if m in sys.modules]\n"
             "from layerplan.lite.research import run_scan\n"
             "from layerplan.app.cli.scoring import light_scan_request, report_scan\n"
             f"scan = light_scan_request(['scan', '--tokens', '16', '--kinds', 'mlp', '--out', {str(tmp_path)!r}])\n"
             "assert runnable(scan)\n"
             "assert run_scan(scan, lambda result: report_scan(result, scan.out, scan.exits)) == 0\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'accelerate')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LAYERPLAN_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "scan.png").exists() and len(json.loads((tmp_path / "scan.json").read_text())["items"]) == 30


def test_a_probe_on_the_light_front_end_times_the_rows_the_torch_one_reads(cache, tmp_path, monkeypatch):
    """`layerplan probe` of a GGUF on the light front end: the native rows of both stored
    arithmetics, timed without torch and kept under the key the torch front end reads; a kept
    probe is printed alike by both, neither timing it again."""
    from click.testing import CliRunner

    from layerplan.app.cli import main
    from layerplan.engine.probe_rows import ProbeResult, ProbeRow, machine_key_of, probe_path_of
    from layerplan.files import write_json_atomic

    folder = tmp_path / "cache"  # (this module's cache but its probes: a probe row steers auto's drafts)
    folder.mkdir()
    for entry in cache.iterdir():
        if entry.name != "probe":
            (folder / entry.name).symlink_to(entry)
    line = ["probe", "--threads", "2", "--max-length", "3", "--repeats", "1"]
    env = {**os.environ, "LAYERPLAN_CACHE": str(folder), "LAYERPLAN_FRONT_END": ""}
    timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "layerplan.app.launch", *line, "--refresh",
                            "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert timed.returncode == 0, timed.stderr
    imported = {row.split("|")[-1].strip() for row in timed.stderr.splitlines() if row.startswith("import time:")}
    assert not [name for name in imported if name.split(".")[0] in ("torch", "transformers")]
    result = ProbeResult.from_dict(json.loads(timed.stdout))
    assert (result.machine, result.model) == (machine_key_of(2), "SmolLM2-135M-Instruct")
    assert [(row.engine, row.dtype, sorted(row.relative), row.torch) for row in result.rows] == [
        ("native", "stored", [1, 2, 3], None), ("native", "stored-fast", [1, 2, 3], None)]
    assert all(row.step_ms > 0 and row.weight_bytes > 0 for row in result.rows)
    assert re.search(r"^loading smollm2 \(stored, engine native\)…$", timed.stderr, re.M)
    kept = ProbeResult(result.machine, result.cpu, result.model, [
        ProbeRow("native", "stored", 5.0, {1: 1.0, 2: 1.2, 3: 1.5}),
        ProbeRow("native", "stored-fast", 4.0, {1: 1.0, 2: 1.1, 3: 1.3})])
    write_json_atomic(probe_path_of(folder, result.model, 2), kept.to_dict())
    light = _run(line, folder)
    monkeypatch.setenv("LAYERPLAN_CACHE", str(folder))
    on_torch = CliRunner().invoke(main, line)
    assert light.returncode == on_torch.exit_code == 0, (light.stderr, on_torch.stderr)
    assert light.stdout == on_torch.stdout and light.stderr == on_torch.stderr == ""
    assert "native  stored-fast     4.0   1.00  1.10  1.30" in light.stdout


def _on_both_front_ends(line: list[str], cache, out) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The line run on the light front end (-X importtime: it must import neither torch nor
    transformers) and on the torch one, each with --out out("light") / out("torch"); both
    succeeded."""
    env = {**os.environ, "LAYERPLAN_CACHE": str(cache), "LAYERPLAN_FRONT_END": ""}
    light = subprocess.run([sys.executable, "-X", "importtime", "-m", "layerplan.app.launch", *line, "--out",
                            out("light")], capture_output=True, text=True, env=env, timeout=300)
    assert light.returncode == 0, light.stderr
    imported = {row.split("|")[-1].strip() for row in light.stderr.splitlines() if row.startswith("import time:")}
    assert not [name for name in imported if name.split(".")[0] in ("torch", "transformers")]
    on_torch = _run([*line, "--out", out("torch")], cache, "torch")
    assert on_torch.returncode == 0, on_torch.stderr
    return light, on_torch


def test_a_bench_on_the_light_front_end_times_what_the_torch_one_times(cache, tmp_path):
    """`layerplan bench` of a GGUF as stored, without torch (-X importtime says what was imported):
    the rows, tokens and drafting figures of the torch front end's run of the same line (a fixed
    draft length: the rounds do not follow the clock), its CPU line naming the kernels' build."""
    line = ["bench", "--prompt", "code", "--new-tokens", "8", "--repeats", "1", "--draft", "suffix", "--draft",
            "exit:20", "--draft-length", "fixed", "--no-llama-cpp"]
    light, on_torch = _on_both_front_ends(line, cache, lambda name: str(tmp_path / f"{name}.json"))
    results = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("light", "torch")]
    said = [row for row in light.stderr.splitlines() if not row.startswith("import time:")]
    assert said == on_torch.stderr.splitlines() == ["loading smollm2 (stored-fast, engine native)…"]

    def rows(result: dict) -> list[tuple]:
        return [(r["method"], r["prompt"], r["tokens"], r["same_as_plain"], r["acceptance_rate"],
                 r["mean_accepted_length"], r["by_drafter"]) for r in result["rows"]]

    assert rows(results[0]) == rows(results[1])
    assert [r[0] for r in rows(results[0])] == ["layerplan plain", "layerplan draft=suffix", "layerplan draft=exit:20"]
    assert all(r[3] for r in rows(results[0]))  # every draft's tokens are plain decoding's
    assert {k: results[0][k] for k in ("model", "dtype", "threads", "new_tokens", "repeats", "reference")} == {
        k: results[1][k] for k in ("model", "dtype", "threads", "new_tokens", "repeats", "reference")}
    assert results[0]["cpu"]["torch"] is None and results[0]["cpu"]["kernels"]
    assert re.search(r"^CPU: .*\(native kernels \w+\), \d+ threads of \d+$", light.stdout, re.M)
    table = [row for row in light.stdout.splitlines() if row.startswith("code ")]
    assert [row.split()[1:3] for row in table] == [["layerplan", "plain"], ["layerplan", "draft=suffix"],
                                                   ["layerplan", "draft=exit:20"]]


def test_a_frontier_of_drafts_given_runs_without_torch_and_places_them_as_torch_does(cache, tmp_path):
    """`layerplan frontier --draft ...` of a GGUF as stored, over drafts the light front end runs:
    no torch imported, and each draft's counts (its acceptance) those of the torch front end's
    run of the same line; the JSON and the picture written."""
    line = ["frontier", "--draft", "exit:20", "--draft", "suffix", "--prompt", "code", "-n", "8"]
    light, on_torch = _on_both_front_ends(line, cache, lambda name: str(tmp_path / name))
    results = [json.loads((tmp_path / name / "frontier.json").read_text()) for name in ("light", "torch")]
    counts = [[(p["draft"], p["drafted"], p["accepted"], p["acceptance"]) for p in r["points"]] for r in results]
    assert counts[0] == counts[1] and [c[0] for c in counts[0]] == ["exit:20", "suffix"]
    assert results[0]["gamma"] == results[1]["gamma"] == 4 and results[0]["model"] == results[1]["model"]
    assert "native kernels" in results[0]["cpu"] and (tmp_path / "light" / "frontier.png").stat().st_size > 0
    assert light.stdout.splitlines()[-1] == f"wrote {tmp_path / 'light' / 'frontier.json'} and {tmp_path / 'light' / 'frontier.png'}"


def test_a_reader_that_leaves_ends_the_command_without_a_traceback(cache):
    """`layerplan generate … | head -c 5`: the light front end stops at the closed pipe, as the torch
    front end does, with status 1 and nothing but its loading line on stderr."""
    env = {**os.environ, "LAYERPLAN_CACHE": str(cache), "LAYERPLAN_FRONT_END": ""}
    process = subprocess.Popen([sys.executable, "-m", "layerplan.app.launch", "generate", "Once upon a time", "-n", "64"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    process.stdout.read(5)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == 1
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr


def _real_file(name: str) -> str:
    """The real GGUF `name` in the folder LAYERPLAN_REAL_MODELS names (real_models.sh fills it; `make
    bench-real`), or the test skipped: the default suite downloads no real file."""
    path = os.path.join(os.environ.get("LAYERPLAN_REAL_MODELS") or "/nonexistent", name)
    if not os.path.exists(path):
        pytest.skip(f"LAYERPLAN_REAL_MODELS does not name a folder with the real {name}")
    return path


@pytest.mark.parametrize("name", ["gemma-3-270m-Q4_K_M.gguf", "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf"])
def test_a_real_gguf_bench_is_the_same_on_both_front_ends(name, tmp_path):
    """A bench of plain decoding and a lookup and an exit draft on a real file (a fixed draft length:
    the rounds do not follow the clock): the same rows, tokens and drafting figures from both front
    ends. In `make bench-real` (LAYERPLAN_REAL_MODELS), never in the default suite."""
    path = _real_file(name)
    line = ["bench", "-m", path, "--prompt", "code", "--prompt", "chat", "-n", "16", "--repeats", "1", "--draft",
            "suffix", "--draft", "exit:12", "--draft-length", "fixed", "--no-llama-cpp"]
    cache = cache_dir()  # (the user's: the file's index and panels, made once)
    rows = []
    for front_end in ("", "torch"):
        run = _run([*line, "--out", str(tmp_path / f"{front_end or 'light'}.json")], cache, front_end)
        assert run.returncode == 0, run.stderr
        result = json.loads((tmp_path / f"{front_end or 'light'}.json").read_text())
        rows.append([(r["method"], r["prompt"], r["tokens"], r["same_as_plain"], r["acceptance_rate"], r["by_drafter"])
                     for r in result["rows"]])
    assert rows[0] == rows[1] and len(rows[0]) == 6 and all(r[3] for r in rows[0])


@pytest.mark.parametrize("name", ["gemma-3-270m-Q4_K_M.gguf", "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf"])
def test_a_real_gguf_ppl_is_the_same_on_both_front_ends(name, tmp_path):
    """A plan's perplexity in llama.cpp's protocol, with its comparison with the full model, on a real
    file (Gemma 3's tokenizer adds BOS, the 1.5B's 151,936-token rows span several NLL_ROWS): the
    same JSON from both front ends. In `make bench-real` (LAYERPLAN_REAL_MODELS names the folder
    real_models.sh fills), never in the default suite."""
    path = _real_file(name)
    argv = ["ppl", "-m", path, "--protocol", "llama.cpp", "--window", "128", "--max-tokens", "300", "--plan",
            "skip:mlp=5"]
    cache = cache_dir()  # (the user's: the file's index and panels, made once)
    light, torch_run = _run(argv, cache), _run(argv, cache, "torch")
    assert light.returncode == torch_run.returncode == 0, light.stderr + torch_run.stderr
    assert light.stdout == torch_run.stdout and json.loads(light.stdout)["vs_full_model"]["tokens"] == 128


@pytest.mark.parametrize("name", ["gemma-3-270m-Q4_K_M.gguf", "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf"])
def test_a_real_gguf_scan_is_the_same_on_both_front_ends(name, tmp_path):
    """A scan of every MLP of a real file, under a base plan: the same scan.json from both front ends
    but for the seconds. In `make bench-real` (LAYERPLAN_REAL_MODELS), never in the default suite."""
    path = _real_file(name)
    cache = cache_dir()  # (the user's: the file's index and panels, made once)
    written = []
    for front_end in ("", "torch"):
        out = tmp_path / (front_end or "light")
        run = _run(["scan", "-m", path, "--tokens", "96", "--kinds", "mlp", "--plan", "skip:attn=3", "--out", str(out)],
                   cache, front_end)
        assert run.returncode == 0, run.stderr
        written.append(json.loads((out / "scan.json").read_text()))
        written[-1].pop("seconds")
    assert written[0] == written[1] and len(written[0]["items"]) > 10


@pytest.mark.parametrize("name", ["gemma-3-270m-Q4_K_M.gguf", "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf"])
def test_a_real_gguf_sampled_generate_is_the_same_on_both_front_ends(name):
    """A seeded sample with llama.cpp's default settings (top-k 40, top-p 0.95, min-p 0.05) over a
    real vocabulary (262,144 and 151,936 tokens: top-p sorts its candidates alone): the same text
    and lines from both front ends. In `make bench-real` (LAYERPLAN_REAL_MODELS), never in the
    default suite."""
    path = _real_file(name)
    argv = ["generate", "-m", path, "Write a short poem about the sea.", "--chat", "-n", "32", "--temp", "0.8",
            "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "-s", "5"]
    cache = cache_dir()  # (the user's: the file's index and panels, made once)
    light, torch_run = _run(argv, cache), _run(argv, cache, "torch")
    assert light.returncode == torch_run.returncode == 0, light.stderr + torch_run.stderr
    assert light.stdout == torch_run.stdout and len(light.stdout) > 20
    assert light.stderr == torch_run.stderr


@pytest.mark.parametrize("name", ["gemma-3-270m-Q4_K_M.gguf", "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf"])
def test_a_real_gguf_drafted_generate_is_the_same_on_both_front_ends(name):
    """A suffix draft on code, greedy and seeded sampled; an exit of the model, seeded sampled;
    auto, greedy (decoding/rounds.py on the light front end, speculative.py on the torch one): the
    same text. In `make bench-real`."""
    path = _real_file(name)
    code = "Write a Python function that returns the squares of a list, then one that returns the cubes."
    cache = cache_dir()
    sampled = ["--temp", "0.7", "--top-p", "0.95", "-s", "3"]
    for draft, sampling in (("suffix", []), ("suffix", sampled), ("exit:14", sampled), ("auto", [])):
        argv = ["generate", "-m", path, code, "--chat", "-n", "64", "--draft", draft, *sampling]
        light, torch_run = _run(argv, cache), _run(argv, cache, "torch")
        assert light.returncode == torch_run.returncode == 0, light.stderr + torch_run.stderr
        assert light.stdout == torch_run.stdout and len(light.stdout) > 40, (draft, sampling)


def test_an_export_on_the_light_front_end_writes_the_torch_ones_bytes(cache, tmp_path):
    """`layerplan export` of the packaged GGUF as a GGUF file and as mergekit YAML, without torch
    (-X importtime): the torch front end's bytes and stdout line; a plan it cannot write as stored
    blocks (a residual scale of 0.5), and one the model has no layer for, end with the torch front
    end's line and status, and write nothing."""
    for plan, name, line in (("0-20,15-29,3/mlp", "merged.gguf", "merged.gguf (37 layers, the source's stored types)"),
                             ("0-20,15-29", "merged.yaml", "merged.yaml")):
        light, on_torch = _on_both_front_ends(["export", plan], cache, lambda front: str(tmp_path / f"{front}-{name}"))
        assert (tmp_path / f"light-{name}").read_bytes() == (tmp_path / f"torch-{name}").read_bytes()
        assert light.stdout == on_torch.stdout.replace("torch-", "light-") == f"wrote {tmp_path}/light-{line}\n"
    for plan in ("0-29@0.5", "0-40"):
        said = [_run(["export", plan, "--out", str(tmp_path / f"{front}-bad.gguf")], cache, front)
                for front in ("", "torch")]
        assert said[0].returncode == said[1].returncode != 0
        errors = [[row for row in run.stderr.splitlines() if row.startswith("Error:")] for run in said]
        assert errors[0] == errors[1] and len(errors[0]) == 1, said[0].stderr
        assert not list(tmp_path.glob("*-bad.gguf"))
