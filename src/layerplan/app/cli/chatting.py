"""`layerplan chat`'s command line: its options, defined without torch, so that app/launch.py reads a
line with the command itself before it chooses a front end (light_chat_request), and the light
front end's conversation (run_light_chat: lite/chat.py's session in app/chat_loop.py's loop).
The torch front end's run is app/cli/running.py run_chat_command.

A light conversation that meets a line only the torch front end runs (a draft, a plan of two
models) is handed on (hand_off): its transcript and settings saved as /save writes them,
into a private folder, and the process replaced by the torch front end's `chat --load` of it,
which runs that line first, keeps the session's counts and the line history, and removes the
folder. Standard input is read a byte at a time on the light front end (UnbufferedLines), so no
line the user sent is left in this process's buffer when it is replaced.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import click

from layerplan.app.cli.errors import plain_user_errors
from layerplan.app.options import (DRAFT_LENGTH_HELP, ctx_size_option, decoding_model_options, light_context,
                                   logit_bias_option, model_b_option, n_predict_option, output_penalty_options,
                                   sampling_options)
from layerplan.decoding.chat_state import COMMAND_LINE_SETTINGS, open_chat
from layerplan.decoding.draft_length import DRAFT_LENGTHS
from layerplan.lite import FRONT_END_VARIABLE
from layerplan.lite.request import LiteChatRequest

# a light conversation handed on to the torch front end: JSON {"file", "line", "totals", "history"}
HANDOFF_VARIABLE = "LAYERPLAN_CHAT_HANDOFF"


@click.command()
@decoding_model_options
@click.option("--plan", default=None, help="run the model by this plan (default: the full model; /plan switches)")
@model_b_option
@click.option("--draft", default=None, help="lossless speculative decoding with this drafter, as in generate "
                                           "(/draft switches)")
@click.option("--draft-length", default=None, type=click.Choice(list(DRAFT_LENGTHS)), help=DRAFT_LENGTH_HELP)
@ctx_size_option
@sampling_options
@output_penalty_options
@logit_bias_option
@n_predict_option(256, help="at most this many tokens a reply (within the context)", until_context=True)
@click.option("--system", "-sys", "--system-prompt", "system", default=None,
              help="a system message before the conversation (/system)")
@click.option("--load", "load_file", type=click.Path(dir_okay=False), default=None,
              help="resume a conversation /save wrote (options given here override its settings)")
def chat(**options) -> None:
    """A multi-turn conversation in the model's chat template, streamed; /help lists the commands.
    From a pipe: a line a message or command, replies on stdout, the rest on stderr."""
    # (the work's modules import torch: imported once the command line has been read)
    importlib.import_module("layerplan.app.cli.running").run_chat_command(**options)


def light_chat_request(argv: list[str]) -> LiteChatRequest | None:
    """The light front end's request of `layerplan chat ...` (argv without the program), read by
    this command: None where the line asks for what only the torch front end runs (a device, a
    context size, an eager engine; a draft, given or in a --load file, is weighed once the file
    is read: run_light_chat)."""
    context = light_context(chat, argv)
    if context is None:
        return None
    given = context.params
    if given["ctx_size"] or given["engine"] == "eager":
        return None
    settings, named = command_line_settings(context)
    return LiteChatRequest(model=given["model"], model_b=given["model_b"], dtype=given["dtype"], engine=given["engine"],
                           threads=given["threads"], settings=settings, named=named, load_file=given["load_file"])


def command_line_settings(context: click.Context) -> tuple[dict, list[str]]:
    """The conversation's settings as `chat`'s command line (read into `context`) gives them, and
    the names of those it gave itself (which override a --load file's)."""
    named = [name for name in COMMAND_LINE_SETTINGS
             if context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    return {name: context.params[name] for name in COMMAND_LINE_SETTINGS}, sorted(named)


def run_light_chat(request: LiteChatRequest, tokenizer=None) -> int | None:
    """The conversation on the light front end: its exit status, or None where its settings or
    model need the torch front end (before any output but the loading line)."""
    from layerplan.app.chat_loop import run_chat
    from layerplan.lite.chat import LightChatSession, light_refusal
    from layerplan.lite.cli import ENDINGS, ended_by, load_for

    try:
        opening = open_chat(request.settings, request.named, request.load_file)
        settings = opening.settings
        if light_refusal(settings) is not None:
            return None
        model = load_for(request, tokenizer)
        note = opening.model_note(model.name)
        if note:
            print(note, file=sys.stderr)
        settings.sampling().check_vocabulary(model.vocab_size)  # (as running.py's)
        session = LightChatSession(model, settings, opening.messages)
    except ENDINGS as error:
        return ended_by(error)
    interactive = sys.stdin.isatty()
    return run_chat(session, guard=plain_user_errors, stdin=None if interactive else UnbufferedLines(sys.stdin.fileno()),
                    interactive=interactive, hand_off=hand_off_to_torch(request, interactive))


class UnbufferedLines:
    """A file descriptor's lines, read a byte at a time (nothing read past the line returned)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def readline(self) -> str:
        data = bytearray()
        while not data.endswith(b"\n"):
            byte = os.read(self.fd, 1)
            if not byte:
                break
            data += byte
        return data.decode("utf-8", errors="replace")


def hand_off_to_torch(request: LiteChatRequest, interactive: bool):
    """ChatLoop's hand_off: the conversation and `line` to the torch front end's `chat --load` (this
    process replaced); where it cannot be (no room for the transcript, no interpreter to start), a
    ClickException saying why, and the light conversation goes on."""
    def hand_off(session, line: str) -> None:
        folder = None
        try:
            folder = Path(tempfile.mkdtemp(prefix="layerplan-chat-"))
            saved = session.save(folder / "conversation.json")
            state = {"file": str(saved), "line": line, "totals": asdict(session.session), "history": None}
            readline = sys.modules.get("readline")
            if interactive and readline is not None:
                state["history"] = str(folder / "history")
                readline.write_history_file(state["history"])
            argv = ["chat", "--model", request.model, "--dtype", request.dtype, "--engine", request.engine,
                    *(["--threads", str(request.threads)] if request.threads else []),
                    *(["--model-b", request.model_b] if request.model_b else []), "--load", str(saved)]
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.execve(sys.executable, [sys.executable, "-m", "layerplan.app.cli", *argv],
                      {**os.environ, HANDOFF_VARIABLE: json.dumps(state), FRONT_END_VARIABLE: "torch"})
        except OSError as error:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            raise click.ClickException(f"the torch front end could not be started ({error.strerror or error}): "
                                       f"'{line}' was not run; the conversation goes on here") from None

    return hand_off


def handed_off(load_file: str | None) -> dict | None:
    """The hand-off that started this process (its state, HANDOFF_VARIABLE's), where --load names
    its file; None for any other start. The variable is taken out of the environment."""
    state = os.environ.pop(HANDOFF_VARIABLE, None)
    if state is None or load_file is None:
        return None
    try:
        state = json.loads(state)
    except ValueError:
        return None
    return state if isinstance(state, dict) and state.get("file") == load_file else None


COMMANDS = (chat,)  # registered on main (the package's __init__: COMMAND_INDEX)
