"""Every bad input gets one clear line on stderr (exit status 1 or 2), never a traceback: a table of
cases run through the command line, most in this process (click's runner), some as real processes;
then a fuzz of every subcommand's options, drawn from the click command tree itself."""

import os
import signal
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from hypothesis import event, given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
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
    from tiny_text import save_tiny_with_tokenizer

    save_tiny_with_tokenizer(root / "tok")  # context 128 tokens
    random_weights = root / "random-weights"
    save_tiny_with_tokenizer(random_weights)
    (random_weights / "model.safetensors").write_bytes(bytes(range(256)) * 20)
    (root / "deep.yaml").write_text("slices: " + "[" * 20000 + "]" * 20000)
    (root / "fraction.yaml").write_text("slices:\n- sources:\n  - model: m\n    layer_range: [0.5, 10.7]\n")
    (root / "unknown-keys.yaml").write_text("slices:\n- sources:\n  - model: m\n    layer_range: [0, 10]\n"
                                            "  weight: 0.5\n")
    (root / "extra-key.json").write_text('{"format": "layerplan", "version": 1, "num_layers": 30, "plan": "full", '
                                         '"exit": 5}')
    (root / "empty.txt").write_text("")
    (root / "no-tasks").mkdir()
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
    (["generate", "hi", "--threads", "0"], 2, "Invalid value for '--threads' / '-t': 0 is not in the range 1<=x<=1024"),
    (["generate", "hi", "--threads", "-1"], 2, "Invalid value for '--threads' / '-t': -1 is not in the range 1<=x<=1024"),
    (["generate", "hi", "--device", "bogus", "--dtype", "float32"], 1, "unknown device 'bogus'"),
    (["plan", "0-29", "--layers", "0"], 2, "Invalid value for '--layers': 0 is not in the range 1<=x<=100000"),
    (["plan", "0-29", "--layers", "-3"], 2, "Invalid value for '--layers': -3 is not in the range 1<=x<=100000"),
    (["plan", "exit:\uff18", "--layers", "30"], 1, "U+FF18"),
    (["plan", "skip:attn=\u0663", "--layers", "30"], 1, "U+0663"),
    (["plan", "exit:3;exit:5", "--layers", "30"], 1, "the plan gives an exit twice"),
    (["plan", "0*1000000000", "--layers", "30"], 1, "more than 100000 steps"),
    (["plan", "0-29", "--layers", "30", "--to", "bogus"], 2, "Invalid value for '--to'"),
    (["search", "--trials", "0"], 2, "Invalid value for '--trials': 0 is not in the range x>=1"),
    (["search", "--max-cost-cut", "2"], 2, "Invalid value for '--max-cost-cut': 2.0 is not in the range 0.0<x<=1.0"),
    (["search", "--objective", "tokens-per-second", "--method", "greedy", "--model", "FILES/tok"], 1,
     "use --method bayes for tokens-per-second"),
    (["scan", "--tokens", "0"], 2, "Invalid value for '--tokens': 0 is not in the range x>=2"),
    (["train-exit", "--exit", "4", "--steps", "0"], 2, "Invalid value for '--steps': 0 is not in the range x>=1"),
    (["tune", "--repeats", "0"], 2, "Invalid value for '--repeats': 0 is not in the range x>=1"),
    (["bench", "--new-tokens", "0"], 2, "Invalid value for '--n-predict' / '-n' / '--max-new-tokens' / '--new-tokens': 0 is not in the range x>=1"),
    (["probe", "--repeats", "0"], 2, "Invalid value for '--repeats': 0 is not in the range x>=1"),
    (["ppl", "--max-tokens", "-1"], 2, "Invalid value for '--max-tokens': -1 is not in the range x>=0"),
    (["generate", "hi", "--draft-confidence", "2"], 2, "Invalid value for '--draft-confidence'"),
    (["serve", "--port", "99999"], 2, "Invalid value for '--port': 99999 is not in the range 0<=x<=65535"),
    (["export", "0,1,1,2", "--model", "FILES/tiny", "--out", "FILES/empty.json/merged"], 1,
     "cannot write FILES/empty.json/merged: FILES/empty.json is a file, not a folder"),
    (["generate", "hi", "--model", "FILES/tiny"], 1, "has no tokenizer"),
    (["generate", "-f", "/dev/zero"], 1, "/dev/zero: not a text file (a device or socket)"),
    (["generate", "-f", "FILES/absent.txt"], 1, "FILES/absent.txt: cannot read it (No such file or directory)"),
    (["generate", "-f", "FILES/binary.txt"], 1, "binary.txt: not UTF-8 text (byte 2: invalid start byte)"),
    # refused before the model loads (a model that is not there is never looked for)
    (["export", "0,b:1", "--model", "FILES/absent.gguf", "--model-b", "FILES/tiny", "--out", "FILES/m.gguf"], 2,
     "--to gguf writes one model's layers"),
    (["ppl", "--text", "FILES/binary.txt"], 1, "binary.txt: not UTF-8 text (byte 2: invalid start byte)"),
    (["search", "--method", "bayes", "--trials", "1", "--tokens", "16", "--storage", "FILES/empty.json/study.db"], 1,
     "cannot write FILES/empty.json/study.db: FILES/empty.json is a file, not a folder"),
    # a server that is not there is waited for as one restarting would be, for --storage-patience
    (["search", "--method", "bayes", "--trials", "1", "--tokens", "16", "--storage-patience", "0", "--storage",
      "postgresql://nobody@127.0.0.1:1/none"], 1, "cannot open the study storage postgresql://nobody@127.0.0.1:1/none: "
                                                  "it has been unreachable for 0 s"),
    (["generate"], 2, "give a PROMPT (or -p TEXT, -f FILE) or --prompt-file FILE"),
    (["generate", "hi", "--prompt-file", "FILES/empty.txt"], 2, "give a PROMPT (or -p TEXT, -f FILE) or --prompt-file FILE"),
    (["no-such-command"], 2, "No such command 'no-such-command'"),
    # issue 31: tracebacks
    (["plan", "0-29", "--layers", "30", "--out", "/proc/nope/x"], 2, "cannot write /proc/nope/x: nothing can be "
                                                                     "created in /proc"),
    (["plan", "FILES/deep.yaml", "--layers", "30"], 1, "deep.yaml: not a mergekit file: nested deeper than"),
    (["generate", "hi", "--model", "FILES/random-weights", "--dtype", "float32"], 1,
     "random-weights: cannot load its weights (damaged, truncated or unreadable?)"),
    (["generate", "hi", "--model", "FILES/tok", "--temp", "nan"], 1, "temperature nan is out of range"),
    (["generate", "hi", "--model", "FILES/tok", "--dtype", "float32", "-n", "1000000000"], 1,
     "--max-new-tokens=1000000000 does not fit: the prompt is 2 tokens and the model's context is 128 tokens"),
    (["ppl", "--model", "FILES/tok", "--text", "FILES/empty.txt"], 1, "empty.txt: no text in it"),
    (["search", "--storage", "bogus://x", "--model", "FILES/tok"], 1,
     "cannot open the study storage bogus://x: 'bogus' is not a database SQLAlchemy knows"),
    (["search", "--storage", "mysql://someone@localhost/db", "--model", "FILES/tok"], 1,
     "cannot open the study storage mysql://someone@localhost/db: its database driver is not installed"),
    (["eval", "--tasks", "no_such_task", "--include-path", "FILES/no-tasks", "--model", "FILES/tok"], 1,
     "no lm-evaluation-harness task 'no_such_task' (in FILES/no-tasks or built in)"),
    # context length, before any decoding
    (["generate", "x" * 300, "--model", "FILES/tok", "--dtype", "float32"], 1,
     "the prompt is 300 tokens; the model's context is 128 tokens"),
    # exit 0 doing something silly
    (["generate", "hi", "--model", "FILES/tok", "--temp", "inf"], 1, "temperature inf is out of range"),
    (["generate", "hi", "--model", "FILES/tok", "--repetition-penalty", "nan"], 1,
     "repetition_penalty nan is out of range: a number in [0.01, 100]"),
    (["plan", "FILES/fraction.yaml", "--layers", "30"], 1,
     "layer_range must be [start, end), two whole layer numbers, got [0.5, 10.7]"),
    (["plan", "FILES/extra-key.json", "--layers", "30"], 1, "unknown key(s) 'exit' in a layerplan plan file"),
    (["plan", "FILES/unknown-keys.yaml", "--layers", "30"], 1, "slice 0: unknown key(s) 'weight'"),
    (["explore", "--search", "--scales", "2-1", "--model", "FILES/tok"], 1, "--scales 2-1: expected finite scales"),
    (["serve", "--api-key", "", "--model", "FILES/tok"], 2, "Invalid value for '--api-key': an empty key would "
                                                            "switch authentication off"),
    (["generate", "hi", "--model", "FILES/tok", "--dtype", "float32", "--draft", "full", "-n", "2"], 1,
     "draft plan 'full' runs every sub-layer the target 'full' runs"),
    (["models", "--markdown"], 2, "--markdown formats the --architectures table: add --architectures"),
    # unclear errors
    (["plan", "1" * 10000, "--layers", "30"], 1, "layer 111111111111… (10000 digits) is out of range"),
    (["generate", "hi", "--seed", str(2 ** 70)], 2, "Invalid value for '--seed' / '-s': 1180591620717411303424 is not in "
                                                    "the range"),
    (["serve", "--host", "999.1.1.1", "--model", "FILES/tok"], 2, "Invalid value for '--host': 999.1.1.1 is not an "
                                                                   "IP address"),
    (["probe", "--max-length", "0"], 2, "Invalid value for '--max-length': 0 is not in the range 1<=x<=256"),
    (["serve", "--draft", "bogus", "--model", "FILES/tok", "--dtype", "float32"], 1, "cannot read 'bogus'"),
    (["generate", "hi", "--threads", "2147483648"], 2, "Invalid value for '--threads' / '-t'"),
    (["plan", "skip:attn=1", "--layers", str(2 ** 70)], 2, "Invalid value for '--layers'"),  # (built 2**70 steps)
    (["bench", "--new-tokens", "1000000000", "--model", "FILES/tok", "--dtype", "float32", "--engine", "eager",
      "--no-llama-cpp"], 1, "--new-tokens=1000000000 does not fit"),
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
    """A few rows again as `python -m layerplan.app.launch` (the installed entry point, which hands
    what the light front end does not take to app/cli/), in parallel: stderr as a terminal user
    sees it."""
    rows = [CASES[0], CASES[2], CASES[9], CASES[10], CASES[15]]

    def run(row):
        args, code, needle = row
        done = subprocess.run([sys.executable, "-m", "layerplan.app.launch", *_args(args, files)],
                              capture_output=True, text=True, timeout=300)
        return done, code, needle

    with ThreadPoolExecutor(len(rows)) as pool:
        for done, code, needle in pool.map(run, rows):
            assert done.stdout == ""
            _check(done.returncode, done.stderr, code, needle)


@pytest.mark.real
def test_an_empty_answer_to_a_bare_prompt_hints_at_chat():
    # the greedy continuation of "1, 2, 3," starts with " 4": the stop string leaves no text
    result = CliRunner().invoke(main, ["generate", "1, 2, 3,", "-n", "6", "--stop", " 4",
                                       "--no-stream"])
    assert result.exit_code == 0, result.output
    assert "add --chat" in result.stderr
    chat = CliRunner().invoke(main, ["generate", "1, 2, 3,", "-n", "6", "--stop", " 4",
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


def test_an_unreadable_model_folder_gets_one_line(files, monkeypatch):
    """A folder this user may not read (a PermissionError from stat; as root, made by hand)."""
    real_exists = Path.exists

    def exists(path, *args, **kwargs):
        if path.parent.name == "tok" and path.name == "config.json":
            raise PermissionError(13, "Permission denied", str(path))
        return real_exists(path, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", exists)
    result = CliRunner().invoke(main, ["generate", "hi", "--model", f"{files}/tok"])
    _check(result.exit_code, result.stderr, 1, f"cannot read the model at '{files}/tok': Permission denied")


# ----- the fuzz: every subcommand's options, from the click command tree --------------------------
class _Reached(BaseException):
    """The command got past its checks to real work (a model load): its input was taken as valid.
    A BaseException, so that no `except Exception` on the way turns it into an error line."""


def _leaves(group: click.Group, path: tuple = ()):
    commands = group.all_commands() if group is main else group.commands  # (main imports them when asked)
    for name, command in sorted(commands.items()):
        if isinstance(command, click.Group):
            yield from _leaves(command, path + (name,))
        else:
            yield path + (name,), command


COMMANDS = list(_leaves(main))
DEFAULT_MODEL_NAMES = {"smollm2", "default", "smollm2-135m-instruct"}  # would convert the packaged GGUF

JUNK = ["", " ", "-", "--", "nan", "NaN", "inf", "-inf", "1e309", "1e-300", "-1", "0", "-0", "2**70",
        str(2 ** 70), str(2 ** 64), "1" * 5000, "\u0663", "\uff18", "a\udcffb", "x" * 300, "--model", "-h",
        "~nobody/x", "..", "{}", "[", "null", "bogus://x", "journal:", "1,2,,3", "0.5-", "a:b:c"]
TEXTS = ["full", "0-2", "0,1,1,2", "skip:attn=1", "exit:1", "exit:9", "ngram", "suffix", "auto", "auto|ngram",
         "exit:1+head", "exit:1+vocab=0", "window:4,64", "dynamic:confidence=2", "model:FILES/tok", "skip:layers=0-2",
         "confidence=0.9", "code", "chat", "attention,mlp", "4-25", "1,2", "0.5-1.0", "2-1", "ppl", "localhost",
         "999.1.1.1", "::1", "0.0.0.0", "sqlite:///FILES/x.db", "mysql://u@h/db", "postgresql://u@127.0.0.1:1/x"]
PATHS = ["/proc/nope/x", "/proc", "/dev/full", "/dev/null", "/dev/zero", "FILES/fifo", "FILES/link", "FILES/folder",
         "FILES/empty.txt", "FILES/empty.json", "FILES/binary.txt", "FILES/deep.yaml", "FILES/fraction.yaml",
         "FILES/tok", "FILES/tiny", "FILES/random-weights", "FILES/truncated.gguf", "FILES/no-tasks",
         "FILES/empty.json/x", "FILES/missing/deeper/x.json", "OUT/new.json", "OUT/new", "OUT", "", "a\nb",
         "x" * 300]


def _value(param: click.Parameter):
    """A strategy of (mostly bad) values for one option or argument, by its click type."""
    kind = param.type
    junk = st.sampled_from(JUNK) | st.text(max_size=8)
    if isinstance(kind, (click.IntRange, click.FloatRange)):
        bounds = [b for b in (kind.min, kind.max) if b is not None]
        near = [str(type(b)(b) + d) for b in bounds for d in (-1, 0, 1)]
        return st.sampled_from(near or ["0"]) | st.integers(-2 ** 70, 2 ** 70).map(str) | junk
    if kind in (click.INT, click.FLOAT):
        return st.integers(-2 ** 70, 2 ** 70).map(str) | st.floats().map(repr) | junk
    if isinstance(kind, click.Choice):
        return st.sampled_from(list(kind.choices)) | junk
    if isinstance(kind, click.Path):  # (an input FIFO with no writer blocks as `cat` does: outputs only)
        return st.sampled_from(PATHS if "out" in param.name else [p for p in PATHS if "fifo" not in p]) | junk
    return st.sampled_from(TEXTS) | junk


@st.composite
def command_lines(draw):
    """A subcommand, some of its options each with a drawn value (flags as they are), its
    arguments drawn too; --model is the tiny model unless it is drawn."""
    path, command = draw(st.sampled_from(COMMANDS))
    args = list(path)
    options = [p for p in command.params if isinstance(p, click.Option) and "--help" not in p.opts]
    chosen = draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda p: p.name)) if options else []
    for param in chosen:
        args.append(draw(st.sampled_from(param.opts + param.secondary_opts)))
        if not (param.is_flag or param.count):
            value = draw(_value(param))
            if param.name in ("model", "model_b") and value.strip().lower() in DEFAULT_MODEL_NAMES:
                value = "FILES/tiny"
            args.append(value)
    if "model" in {p.name for p in command.params} and "model" not in {p.name for p in chosen}:
        args += ["--model", "FILES/tok"]
    if "engine" in {p.name for p in command.params} and "engine" not in {p.name for p in chosen}:
        args += ["--engine", "eager"]  # auto / native may build the native kernels into the cache: work
    for param in command.params:
        if isinstance(param, click.Argument) and draw(st.integers(0, 9)):  # now and then one is missing
            args.append(draw(_value(param)))
    if draw(st.integers(0, 49)) == 0:
        args.append("--help")
    return [arg.replace("\x00", "") for arg in args]  # (a command line cannot hold a NUL)


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under root: its kind and, for a file, its size and modification time."""
    found = {}
    for folder, folders, names in os.walk(root):
        for name in folders + names:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            found[os.path.relpath(path, root)] = ((stat.S_IFMT(info.st_mode), info.st_size, info.st_mtime_ns)
                                                  if stat.S_ISREG(info.st_mode) else (stat.S_IFMT(info.st_mode),))
    return found


@pytest.fixture(scope="module")
def fuzz_place(files, tmp_path_factory):
    """The fixture files plus the odd kinds (a FIFO, a link, a folder), and an empty working folder."""
    for name, make in (("fifo", os.mkfifo), ("folder", os.mkdir)):
        if not (files / name).exists():
            make(files / name)
    if not (files / "link").is_symlink():
        os.symlink("empty.txt", files / "link")
    return files, tmp_path_factory.mktemp("work")


def _stop(*_args, **_kwargs):
    raise _Reached()


def _known_tasks(names, include_path=None):
    """A stand-in for the lm-eval task index (seconds to build): the same refusal for unknown names."""
    unknown = [n for n in names if n != "arc_easy"]
    if unknown or not names:
        raise ValueError(f"no lm-evaluation-harness task {unknown!r}")


HANG_S = 120  # a case that takes longer hangs (each fails at its checks or reaches work in well under a second)


@fuzz_settings(quick=300, full=6000)
@given(command_lines())
def test_fuzzed_command_lines_get_one_line_or_reach_work_and_touch_nothing_else(fuzz_place, args):
    """Any command line: exit 0 (it was valid and needed no model), or its checks passed and it
    reached a model load (stopped there), or a nonzero exit with one 'Error:' line; never a
    traceback, never a file touched outside its --out (or --storage)."""
    from layerplan.app import bench, llamacpp
    from layerplan.app.cli import common, measuring, research, running

    files, work = fuzz_place
    out_dir = work / "out"
    args = [a.replace("FILES/", f"{files}/").replace("OUT", str(out_dir)) for a in args]
    outs = [os.path.abspath(os.path.join(work, args[i + 1])) for i, a in enumerate(args[:-1])
            if a in ("--out", "--storage")]
    before = {**{f"files/{k}": v for k, v in _tree(files).items()}, **{f"work/{k}": v for k, v in _tree(work).items()}}
    threads = torch.get_num_threads()
    reached = False
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        for module in (common, running, research, measuring, bench):  # where the commands look the names up
            for name in ("load_model", "check_architecture", "run_probe"):
                if hasattr(module, name):
                    patch.setattr(module, name, _stop)
        patch.setattr(llamacpp, "build", _stop)
        patch.setattr(running, "task_manager", _known_tasks)
        def hang(*_):
            raise TimeoutError(f"hung for {HANG_S}s: {args}")

        previous = signal.signal(signal.SIGALRM, hang)
        signal.alarm(HANG_S)
        try:
            result = CliRunner().invoke(main, args)
        except _Reached:
            reached = True
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            torch.set_num_threads(threads)
    event(f"{args[0]}: " + ("reached work" if reached else f"exit {result.exit_code}"))
    if not reached:
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
        assert "Traceback" not in result.stderr, (args, result.stderr)
        if result.exit_code != 0:
            lines = [line for line in result.stderr.splitlines()
                     if line.strip() and not line.startswith(("loading ", "native engine left out"))]
            assert len(lines) == 1 and lines[0].startswith(("Error: ", "Aborted!")), (args, result.stderr)
    after = {**{f"files/{k}": v for k, v in _tree(files).items()}, **{f"work/{k}": v for k, v in _tree(work).items()}}
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    roots = {"files": files, "work": work}
    for key in changed:
        where, _, rest = key.partition("/")
        path = os.path.abspath(os.path.join(roots[where], rest))
        # an output's missing folders are made on the way to it (files.py's atomic writes)
        made_for_output = key not in before and after.get(key) == (stat.S_IFDIR,) \
            and any(out.startswith(path + "/") for out in outs)
        assert made_for_output or any(path == out or path.startswith(out.rstrip("/") + "/") for out in outs), \
            (args, key)
    import shutil

    shutil.rmtree(out_dir, ignore_errors=True)


# ----- the fuzz: weights files -------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights(files):
    import json as json_module
    import struct

    data = (files / "tok" / "model.safetensors").read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return json_module.loads(data[8:8 + length]), data[8 + length:]


header_changes = st.sampled_from(["dtype", "shape", "data_offsets", "drop", "junk", "metadata", "copy", "list"])


@fuzz_settings(quick=15, full=300)
@given(data=st.data())
def test_fuzzed_safetensors_headers_get_one_model_error(files, weights, tmp_path_factory, data):
    """A model.safetensors whose header is damaged (or a file of random bytes) loads as a model
    or is one ModelError naming the folder; never a SafetensorError traceback."""
    import json as json_module
    import shutil
    import struct

    from layerplan.models.architectures import ModelError
    from layerplan.models.loading import load_model

    header, body = weights
    header = json_module.loads(json_module.dumps(header))
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(data.draw(st.integers(1, 3))):
        name, change = data.draw(st.sampled_from(names)), data.draw(header_changes)
        value = data.draw(st.integers(-5, 10 ** 7) | st.sampled_from(["F64", "I8", "BOOL", "XX", "F8_E4M3", "BF16"]))
        if change in ("dtype", "shape", "data_offsets") and not isinstance(header.get(name), dict):
            continue  # dropped or made junk by an earlier change
        if change == "dtype":
            header[name]["dtype"] = value
        elif change == "shape":
            header[name]["shape"] = data.draw(st.lists(st.integers(-1, 300), max_size=3))
        elif change == "data_offsets":
            header[name]["data_offsets"] = data.draw(st.lists(st.integers(-5, 10 ** 7), min_size=2, max_size=2))
        elif change == "drop":
            header.pop(name, None)
        elif change == "junk":
            header[name] = value
        elif change == "metadata":
            header["__metadata__"] = {"format": value}
        elif change == "copy" and name in header:
            header[f"{name}.again"] = header[name]
        elif change == "list":
            header = [value]
            break
    text = json_module.dumps(header).encode()
    length = data.draw(st.sampled_from([len(text)] * 6 + [0, 7, len(text) + 9, 2 ** 63]))
    folder = tmp_path_factory.mktemp("weights")
    shutil.copytree(files / "tok", folder, dirs_exist_ok=True)
    raw = data.draw(st.booleans() | st.just(False))
    (folder / "model.safetensors").write_bytes(data.draw(st.binary(max_size=200)) if raw and data.draw(st.booleans())
                                               else struct.pack("<Q", length) + text + body)
    try:
        load_model(str(folder))
    except ModelError as error:
        assert str(folder) in str(error) and "\n" not in str(error)
    finally:
        shutil.rmtree(folder)


@fuzz_settings(quick=10, full=200)
@given(st.binary(max_size=64), st.sampled_from([b"", b"GGUF", b"GGUF\x03\x00\x00\x00", b"GGUF\x02\x00\x00\x00"]))
def test_fuzzed_gguf_headers_get_one_model_error(tmp_path_factory, tail, head):
    from layerplan.models.architectures import ModelError
    from layerplan.models.loading import model_config

    folder = tmp_path_factory.mktemp("gguf")
    (folder / "m.gguf").write_bytes(head + tail)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERPLAN_CACHE", str(folder / "cache"))
        with pytest.raises(ModelError, match="m.gguf: cannot read it as a GGUF model"):
            model_config(folder / "m.gguf")
    assert not [p for p in (folder / "cache").rglob("*") if p.is_file()]  # nothing half-converted left
