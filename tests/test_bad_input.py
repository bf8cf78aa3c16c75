"""Every bad input gets one clear line on stderr (exit status 1 or 2), never a traceback: a table of
cases run through the command line, most in this process (click's runner), some as real processes."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from layerplan.app.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The bad files of the table, made once."""
    from tiny import tiny_config, tiny_hf

    root = tmp_path_factory.mktemp("bad")
    (root / "broken.yaml").write_text("slices:\n  - sources: [{model: m, layer_range: [0, 4]\n")
    (root / "empty.json").write_text("")
    (root / "binary.txt").write_bytes(b"\x00\x01\xff\xfe garbage")
    (root / "broken.json").write_text('{"attention": [1, 2')
    (root / "string.json").write_text('"skip:attn=1"')
    (root / "wrong-shape.json").write_text('{"format": "layerplan", "num_layers": "thirty", "plan": "full"}')
    (root / "not-mergekit.yaml").write_text("slices: 5\n")
    no_weights = root / "no-weights"
    tiny_config("llama").save_pretrained(no_weights)
    broken_config = root / "broken-config"
    broken_config.mkdir()
    (broken_config / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": ')
    (root / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 20)
    tiny_hf("llama").save_pretrained(root / "tiny")
    return root


# (arguments, the exit status, what the one line says); FILES/ stands for the fixture's folder
CASES = [
    (["plan", "FILES/broken.yaml", "--layers", "30"], 1, "broken.yaml: not valid YAML"),
    (["plan", "FILES/not-mergekit.yaml", "--layers", "30"], 1, "not-mergekit.yaml: not a mergekit file"),
    (["plan", "FILES/empty.json", "--layers", "30"], 1, "empty.json: the file is empty"),
    (["plan", "FILES/broken.json", "--layers", "30"], 1, "broken.json: not valid JSON"),
    (["plan", "FILES/string.json", "--layers", "30"], 1, "string.json: expected a JSON object"),
    (["plan", "FILES/wrong-shape.json", "--layers", "30"], 1, "wrong-shape.json: not a layerplan plan file"),
    (["plan", "FILES/missing.json", "--layers", "30"], 1, "plan file not found"),
    (["plan", "full", "--model", "FILES/broken-config"], 1, "broken-config/config.json: cannot read it as JSON"),
    (["generate", "hi", "--model", "FILES/no-weights", "--dtype", "float32"], 1, "has config.json but no weights"),
    (["generate", "hi", "--model", "FILES/truncated.gguf", "--dtype", "float32"], 1,
     "truncated.gguf: cannot read it as a GGUF model"),
    (["generate", "hi", "--threads", "0"], 2, "Invalid value for '--threads': 0 is not in the range x>=1"),
    (["generate", "hi", "--threads", "-1"], 2, "Invalid value for '--threads': -1 is not in the range x>=1"),
    (["generate", "hi", "--device", "bogus", "--dtype", "float32"], 1, "unknown device 'bogus'"),
    (["plan", "0-29", "--layers", "0"], 2, "Invalid value for '--layers': 0 is not in the range x>=1"),
    (["plan", "0-29", "--layers", "-3"], 2, "Invalid value for '--layers': -3 is not in the range x>=1"),
    (["plan", "exit:\uff18", "--layers", "30"], 1, "U+FF18"),
    (["plan", "skip:attn=\u0663", "--layers", "30"], 1, "U+0663"),
    (["plan", "exit:3;exit:5", "--layers", "30"], 1, "the plan gives an exit twice"),
    (["plan", "0*1000000000", "--layers", "30"], 1, "more than 100000 steps"),
    (["plan", "0-29", "--layers", "30", "--to", "bogus"], 2, "Invalid value for '--to'"),
    (["search", "--trials", "0"], 2, "Invalid value for '--trials': 0 is not in the range x>=1"),
    (["search", "--max-cost-cut", "2"], 2, "Invalid value for '--max-cost-cut': 2.0 is not in the range 0.0<x<=1.0"),
    (["scan", "--tokens", "0"], 2, "Invalid value for '--tokens': 0 is not in the range x>=2"),
    (["train-exit", "--exit", "4", "--steps", "0"], 2, "Invalid value for '--steps': 0 is not in the range x>=1"),
    (["tune", "--repeats", "0"], 2, "Invalid value for '--repeats': 0 is not in the range x>=1"),
    (["bench", "--new-tokens", "0"], 2, "Invalid value for '--new-tokens': 0 is not in the range x>=1"),
    (["probe", "--repeats", "0"], 2, "Invalid value for '--repeats': 0 is not in the range x>=1"),
    (["ppl", "--max-tokens", "-1"], 2, "Invalid value for '--max-tokens': -1 is not in the range x>=0"),
    (["generate", "hi", "--draft-confidence", "2"], 2, "Invalid value for '--draft-confidence'"),
    (["serve", "--port", "99999"], 2, "Invalid value for '--port': 99999 is not in the range 0<=x<=65535"),
    (["export", "0,1,1,2", "--model", "FILES/tiny", "--out", "FILES/empty.json/merged"], 1,
     "cannot write FILES/empty.json/merged: FILES/empty.json is a file, not a folder"),
    (["generate", "hi", "--model", "FILES/tiny"], 1, "has no tokenizer"),
    (["ppl", "--text", "FILES/binary.txt"], 1, "binary.txt: not UTF-8 text (byte 2: invalid start byte)"),
    (["search", "--method", "bayes", "--trials", "1", "--tokens", "16", "--storage", "FILES/empty.json/study.db"], 1,
     "cannot write FILES/empty.json/study.db: FILES/empty.json is a file, not a folder"),
    (["search", "--method", "bayes", "--trials", "1", "--tokens", "16", "--storage",
      "postgresql://nobody@127.0.0.1:1/none"], 1, "cannot open the study storage postgresql://nobody@127.0.0.1:1/none"),
    (["generate"], 2, "Missing argument 'PROMPT'"),
    (["no-such-command"], 2, "No such command 'no-such-command'"),
]


def _args(args, files: Path) -> list[str]:
    return [a.replace("FILES/", f"{files}/") for a in args]


def _check(code: int, stderr: str, expected_code: int, needle: str) -> None:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("loading ")]
    assert len(lines) == 1, stderr  # 'loading MODEL…' is progress, not the error
    assert needle in lines[0], lines[0]
    assert code == expected_code, stderr


@pytest.mark.parametrize("args, code, needle", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_gets_one_line(files, args, code, needle):
    result = CliRunner().invoke(main, _args(args, files))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == ""
    _check(result.exit_code, result.stderr, code, needle.replace("FILES/", f"{files}/"))


def test_bad_input_gets_one_line_from_real_processes(files):
    """A few rows again as `python -m layerplan.app.cli`, in parallel: the installed entry point's
    behaviour, stderr as a terminal user sees it."""
    rows = [CASES[0], CASES[2], CASES[9], CASES[10], CASES[15]]

    def run(row):
        args, code, needle = row
        done = subprocess.run([sys.executable, "-m", "layerplan.app.cli", *_args(args, files)],
                              capture_output=True, text=True, timeout=300)
        return done, code, needle

    with ThreadPoolExecutor(len(rows)) as pool:
        for done, code, needle in pool.map(run, rows):
            assert done.stdout == ""
            _check(done.returncode, done.stderr, code, needle)


@pytest.mark.real
def test_an_empty_answer_to_a_bare_prompt_hints_at_chat():
    # the greedy continuation of "1, 2, 3," starts with " 4": the stop string leaves no text
    result = CliRunner().invoke(main, ["generate", "1, 2, 3,", "-n", "6", "--stop", " 4", "--dtype", "float32",
                                       "--no-stream"])
    assert result.exit_code == 0, result.output
    assert "add --chat" in result.stderr
    chat = CliRunner().invoke(main, ["generate", "1, 2, 3,", "-n", "6", "--stop", " 4", "--dtype", "float32",
                                     "--no-stream", "--chat"])
    assert "add --chat" not in chat.stderr


def test_a_port_in_use_gets_one_line(files):
    """The server binds its address before it starts serving: a taken port is one line and a
    failure status (uvicorn alone logged it from its thread and the command exited 0)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--model", f"{files}/tiny", "--dtype", "float32",
                                           "--port", str(port)])
    assert result.stdout == ""
    _check(result.exit_code, result.stderr, 1, f"cannot listen on 127.0.0.1:{port}: Address already in use")
