"""llama.cpp's and transformers' names for the settings they share with layerplan (app/options.py
FAMILIAR_NAMES): every command the table names takes every flag it lists, the docs show the table,
the old `-t` (temperature) is refused in one line, and the new names mean what they say. And the
command list `layerplan -h` shows without importing a command (app/cli/__init__.py COMMAND_INDEX)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from click.utils import make_default_short_help

from layerplan.app.cli import COMMAND_INDEX, main
from layerplan.app.options import FAMILIAR_NAMES, familiar_table, gpu_layers_device
from layerplan.decoding.choice import processed_logits
from layerplan.decoding.sampling_params import SamplingError, SamplingParams

DOCS = Path(__file__).parent.parent / "docs" / "coming-from.md"


def _flags(text: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", text)


def _command_flags(name: str) -> set[str]:
    command = main.get_command(None, name)
    return {flag for param in command.params for flag in (*param.opts, *param.secondary_opts)}


@pytest.mark.parametrize("row", FAMILIAR_NAMES, ids=lambda row: row.setting)
def test_every_command_the_table_names_takes_its_flags(row):
    flags = _flags(row.layerplan)
    assert flags, row
    for command in row.commands:
        missing = [f for f in flags if f not in _command_flags(command)]
        if command != "generate":  # (a generate-only note such as "--chat (generate)")
            missing = [f for f in missing if f not in ("--chat", "--stats", "--json")]
        assert not missing, f"layerplan {command} lacks {missing}"


def test_the_docs_show_the_table():
    assert familiar_table() in DOCS.read_text(), "docs/coming-from.md: paste app/options.py familiar_table()"


def test_help_shows_the_familiar_name_first():
    for command, flag, first in (("generate", "--n-predict", "-n, --n-predict, --max-new-tokens"),
                                 ("generate", "--threads", "-t, --threads"), ("generate", "--temp", "--temp, --temperature"),
                                 ("serve", "--alias", "-a, --alias, --served-name"),
                                 ("serve", "--parallel", "-np, --parallel, --max-batch"),
                                 ("chat", "--system", "-sys, --system, --system-prompt")):
        text = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
        assert first in text, (command, flag)


@pytest.mark.parametrize("value", ["0.7", "0", "1.5", "hot"])
def test_the_old_temperature_t_is_refused_in_one_line(value):
    for command in ("generate", "chat"):
        result = CliRunner().invoke(main, [command, "hi", "-t", value] if command == "generate" else [command, "-t", value])
        assert result.exit_code == 2
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in result.output, result.output
        assert "-t/--threads is the CPU thread count, as in llama.cpp" in lines[0] and "--temp" in lines[0]


def test_the_prompt_is_given_once():
    for args, named in ((["hi", "-p", "there"], "PROMPT and -p/--prompt"),
                        (["-p", "hi", "-f", __file__], "-p/--prompt and -f/--file")):
        result = CliRunner().invoke(main, ["generate", *args])
        assert result.exit_code == 2 and named in result.output, result.output


def test_a_context_longer_than_the_models_is_refused(tmp_path):
    from tiny import tiny_hf

    tiny_hf("llama", num_layers=2).save_pretrained(tmp_path / "tiny")
    result = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "tiny"), "-p", "hi", "-c", "999999"])
    assert result.exit_code == 1 and "-c/--ctx-size 999999 is more than" in result.output, result.output


def test_n_minus_one_generates_until_the_context_is_full_as_llama_cpps_does():
    """llama.cpp's -n -1 (and -2): as many tokens as the context leaves; generate and chat take them,
    the timing commands (a count to time) and other negatives do not."""
    from layerplan.app.cli.generating import light_request
    from layerplan.decoding.budget import UNTIL_CONTEXT, token_budget

    assert token_budget(13, UNTIL_CONTEXT, 40) == 27 and token_budget(13, 5, 40) == 5
    for n in ("-1", "-2"):
        assert light_request(["generate", "hi", "-n", n]).max_new_tokens == UNTIL_CONTEXT
    for argv in (["generate", "hi", "-n", "-3"], ["chat", "-n", "-5"], ["bench", "-n", "-1"]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2 and "is not in the range" in result.output, (argv, result.output)
        assert ("-1: until the context is full" in result.output) == (argv[0] != "bench")
    result = CliRunner().invoke(main, ["generate", "-p", "Count: 1, 2, 3,", "-n", "-1", "-c", "20", "--no-stream",
                                       "--json"])  # (the packaged model: a tokenizer)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stderr[result.stderr.index("{"):])
    new_tokens = sum(summary["provenance"].values())
    assert summary["prompt_tokens"] + new_tokens == 20 and summary["stop_reason"] == "length", summary


def test_gpu_layers_choose_the_gpu_where_one_is_seen_and_the_device_given_wins():
    assert gpu_layers_device(None, "cpu", True) == ("cpu", None)
    assert gpu_layers_device(0, "cpu", True) == ("cpu", None)
    assert gpu_layers_device(99, "cpu", True) == ("cuda", None)
    assert gpu_layers_device(99, "cuda:1", True) == ("cuda:1", None)  # --device names the GPU
    device, note = gpu_layers_device(99, "cpu", False)
    assert device == "cpu" and "no GPU here" in note


@pytest.mark.parametrize("value", ["99", "all", "auto", "-1"])
def test_a_llama_cpp_gpu_layers_flag_runs_where_it_can(tmp_path, value):
    """-ngl as llama.cpp's users type it: on a machine torch sees no GPU on, a note and the CPU (as
    llama.cpp's CPU build ignores it); with one, the model on the GPU."""
    from tiny_text import save_tiny_with_tokenizer

    folder = save_tiny_with_tokenizer(tmp_path / "tiny")
    result = CliRunner().invoke(main, ["generate", "-m", str(folder), "-p", "hi", "-n", "2", "--dtype", "float32",
                                       "-ngl", value])
    assert result.exit_code == 0, result.output
    where = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"(float32, {where}, engine auto)" in result.stderr
    assert ("torch sees no GPU here" in result.stderr) == (where == "cpu")
    refused = CliRunner().invoke(main, ["generate", "-m", str(folder), "-p", "hi", "-ngl", "1.5"])
    assert refused.exit_code == 2 and "'1.5' is no layer count" in refused.output, refused.output


def test_min_p_keeps_the_tokens_within_its_fraction_of_the_most_likely():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04], np.float32))
    kept = np.isfinite(processed_logits(logits, SamplingParams(temperature=1.0, min_p=0.2), [], 0))
    assert kept.tolist() == [True, True, True, False, False]  # 0.1 >= 0.2 * 0.5 > 0.06
    assert np.isfinite(processed_logits(logits, SamplingParams(temperature=1.0), [], 0)).all()
    with pytest.raises(SamplingError, match="min_p 1.5 is out of range"):
        SamplingParams(temperature=1.0, min_p=1.5)


def test_min_p_is_transformers_min_p():
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(257, generator=torch.Generator().manual_seed(0))
    theirs = MinPLogitsWarper(0.05)(None, TemperatureLogitsWarper(0.8)(None, logits[None].clone()))[0]
    ours = torch.from_numpy(processed_logits(logits.numpy(), SamplingParams(temperature=0.8, min_p=0.05), [], 0))
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)) and 1 < torch.isfinite(ours).sum() < 257


def test_the_command_index_lists_what_each_command_says_of_itself():
    """`layerplan -h` lists COMMAND_INDEX's sentences: each is its command's short help, at any width."""
    for name, (module, sentence) in COMMAND_INDEX.items():
        command = main.get_command(None, name)
        assert command.callback.__module__ == f"layerplan.app.cli.{module}", name
        for limit in (45, 63, 1000):
            assert make_default_short_help(sentence, limit) == command.get_short_help_str(limit), (name, limit)
    assert sorted(main.all_commands()) == sorted(COMMAND_INDEX)


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_the_top_level_help_and_version_import_no_command(argv):
    """The listing and the version come from data: no command module, torch or transformers imported."""
    probe = ("import sys\n"
             "from layerplan.app.cli import main\n"
             f"main({argv!r}, prog_name='layerplan', standalone_mode=False)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')\n"
             "             or m.startswith('layerplan.app.cli.')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    *shown, imported = done.stdout.strip().splitlines()
    assert imported == "[]"
    if argv == ["--help"]:
        listed = [line.split()[0] for line in shown[shown.index("Commands:") + 1:]]
        assert listed == sorted(COMMAND_INDEX)
    else:
        assert "version" in shown[-1]


@pytest.mark.parametrize("argv", [
    ["plan", "0-20,15-29", "--to", "mergekit"], ["plan", "0-40"], ["plan", "skip:attn=3", "--layers", "12"],
    ["peers", "show"], ["models"], *([name, "-h"] for name in sorted(COMMAND_INDEX)),
    ["serve", "--nonsense"], ["serve", "--host", "999.1.1.1"], ["bench", "--repeats", "0"]])
def test_commands_that_run_no_model_import_no_torch(argv):
    """`layerplan plan` (a plan checked against the GGUF header's depth), `peers`, and every
    command's help and usage errors (its options are defined without torch; generate's and
    bench's --draft help lists the drafter kinds from their torch-free table): neither torch nor
    transformers imported."""
    probe = ("import sys\n"
             "from layerplan.app.cli import main\n"
             "try:\n"
             f"    main({argv!r}, prog_name='layerplan')\n"
             "except SystemExit:\n"
             "    pass\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr


def test_a_bare_layerplan_prints_its_help_whole():
    """No command: the help as `layerplan -h` prints it (exit 2, click's status), not one folded line."""
    result = CliRunner().invoke(main, [], prog_name="layerplan")
    assert result.exit_code == 2 and "\nCommands:\n" in result.stderr, result.output
    assert result.stderr == CliRunner().invoke(main, ["-h"], prog_name="layerplan").stdout


def test_threads_hold_for_their_command_only(tmp_path):
    """-t sets torch's thread count for the command; a command run in a process that goes on
    leaves the next one the count it found."""
    from tiny_text import save_tiny_with_tokenizer

    save_tiny_with_tokenizer(tmp_path / "tiny", num_layers=1)
    before = torch.get_num_threads()
    threads = 1 if before > 1 else 2
    result = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "tiny"), "-p", "hi", "-n", "2",
                                       "-t", str(threads), "--dtype", "float32", "--stats"])
    assert result.exit_code == 0, result.output
    assert f"· {threads} threads ·" in result.stderr  # the command ran on them
    assert torch.get_num_threads() == before
