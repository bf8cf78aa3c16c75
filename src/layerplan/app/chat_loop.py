"""`layerplan chat`'s loop, at a terminal or behind a pipe, over either front end's session (app/chat.py
ChatSession, lite/chat.py LightChatSession): a line is a message or a /command; replies go to
stdout, everything else to stderr; Ctrl-C stops a reply, Ctrl-D (end of input) leaves. Where the
light front end's session meets a line only the torch front end runs (a draft), the loop
hands the conversation and that line on (hand_off). Without torch.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from typing import TextIO

import click

from layerplan.decoding.chat_state import ChatHistory
from layerplan.lite import TorchFrontEnd

HELP = """\
a line is a message to the model; a line that starts with / is a command (// sends a message that starts with /):
  /plan PLAN     run the model by this plan from the next reply on (the conversation goes on)
  /draft SPEC    lossless speculative decoding with this drafter (as --draft); /draft none: plain
  /temp T        temperature: 0 greedy, else a number >= 1e-4
  /seed S        every reply samples with seed S; /seed none: unseeded
  /system TEXT   the system message (/system alone: none)
  /stats         tokens/s, acceptance, tokens per pass, the plan's cost, what the cache holds
  /reset         forget the conversation (settings stay)
  /save FILE     the transcript, plan, draft and settings as JSON (`layerplan chat --load FILE` resumes)
  /help          this list
Ctrl-C stops a reply; Ctrl-D (end of input) leaves."""


@contextmanager
def _interrupt_stops(stop: threading.Event):
    """While a reply decodes, Ctrl-C (SIGINT) sets `stop` instead of raising, so the decode ends
    at its next token with the cache whole; elsewhere Ctrl-C keeps its meaning."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# a reply's control characters but newline and tab, shown as U+FFFD at a terminal: a model's bytes
# must not move the cursor or switch the terminal's modes (a pipe gets the text as it is)
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x20), *range(0x7f, 0xa0)] if chr(c) not in "\n\t"}


def _number(text: str, kind: type, what: str):
    if text.lower() == "none" and kind is int:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{what} takes {'a whole number or none' if kind is int else 'a number'}, not "
                         f"{text!r}") from None


class ChatLoop:
    """Lines in, replies and status out: run() reads until end of input."""

    def __init__(self, session: ChatHistory, stdin: TextIO, stdout: TextIO, stderr: TextIO,
                 interactive: bool, guard: Callable = nullcontext,
                 hand_off: Callable[[ChatHistory, str], None] | None = None, first_lines: Sequence[str] = ()) -> None:
        """guard(): a context in which bad input becomes click.ClickException (the CLI's
        _user_errors), so a bad command gets the CLI's one line and the session goes on.
        hand_off(session, line): where the session raises TorchFrontEnd for a line, carries the
        conversation and the line on to the torch front end (it does not return; a ClickException
        where it could not, and the session goes on). first_lines: run before any line is read (the
        line a hand-off carried)."""
        self.session, self.stdin, self.stdout, self.stderr = session, stdin, stdout, stderr
        self.interactive, self.guard, self.hand_off = interactive, guard, hand_off
        self.pending = list(first_lines)
        self.leave = False

    def status(self, line: str) -> None:
        self.stderr.write(line + "\n")
        self.stderr.flush()

    def read(self) -> str | None:
        """The next line; None at end of input."""
        if self.pending:
            return self.pending.pop(0)
        if self.interactive:
            try:
                return input("> ")
            except EOFError:
                self.stdout.write("\n")
                return None
        line = self.stdin.readline()
        return line.rstrip("\r\n") if line else None

    def run(self) -> int:
        if self.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            self.status(f"chatting with {self.session.model.name} (plan {self.session.settings.plan}, draft "
                        f"{self.session.settings.draft or 'none'}); /help lists the commands, Ctrl-D leaves")
        if not self.session.has_chat_template:
            self.status("(this model has no chat template: the conversation goes to it as 'role: content' lines, "
                        "which a base model continues rather than answers; a reply ends where it starts a "
                        "'user:' line)")
        while not self.leave:
            try:
                line = self.read()
            except KeyboardInterrupt:  # at the prompt: a fresh line (a pipe's reader is stopped instead)
                if not self.interactive:
                    return 130
                self.stdout.write("\n")
                continue
            if line is None:
                break
            if not line.strip():
                continue
            try:
                with self.guard():
                    if line.startswith("/") and not line.startswith("//"):
                        self.command(line)
                    else:
                        self.answer(line[1:] if line.startswith("//") else line)
            except click.ClickException as error:
                self.status(f"Error: {error.format_message()}")
            except TorchFrontEnd as error:  # (raised before the line changed anything)
                if self.hand_off is None:
                    self.status(f"Error: {error}")
                    continue
                self.status(f"({error}: starting it, the conversation kept)")
                try:
                    self.hand_off(self.session, line)
                except click.ClickException as failed:
                    self.status(f"Error: {failed.format_message()}")
            except KeyboardInterrupt:  # a command that takes long (a draft model loading): that command
                self.status("(interrupted)")
        return 0

    def answer(self, text: str) -> None:
        stop = threading.Event()

        def show(piece: str) -> None:
            self.stdout.write(piece.translate(_CONTROLS) if self.interactive else piece)
            self.stdout.flush()

        with _interrupt_stops(stop):
            reply = self.session.reply(text, on_text=show, should_stop=stop.is_set)
        self.stdout.write("\n")
        self.stdout.flush()
        if reply.stop_reason == "cancelled":
            self.status(f"(reply stopped after {reply.totals.tokens} tokens; it stays in the conversation)")
        elif reply.stop_reason == "length":
            self.status(f"(reply cut at {reply.totals.tokens} tokens: --max-new-tokens, or the model's context)")
        if reply.slow_note:
            self.status(reply.slow_note)

    def command(self, line: str) -> None:
        name, _, argument = line.partition(" ")
        name, argument, session = name.lower(), argument.strip(), self.session
        if name == "/plan":
            if not argument:
                raise ValueError("/plan takes a plan, e.g. /plan skip:attn=3,5 or /plan full")
            note = session.set_plan(argument)
            self.status(f"plan {session.settings.plan}: {note}")
        elif name == "/draft":
            if not argument:
                raise ValueError("/draft takes a drafter spec (as --draft, e.g. /draft suffix) or none")
            session.set_draft(argument)
            self.status(f"draft {session.settings.draft or 'none'}")
        elif name in ("/temp", "/temperature"):
            session.set_temperature(_number(argument, float, "/temp"))
            self.status(f"temperature {session.settings.temperature:g}")
        elif name == "/seed":
            session.set_seed(_number(argument, int, "/seed"))
            self.status(f"seed {session.settings.seed if session.settings.seed is not None else 'none'}")
        elif name == "/system":
            session.set_system(argument)
            self.status(f"system message {'set' if argument else 'removed'}")
        elif name == "/stats":
            for stat_line in session.stats().lines():
                self.status(stat_line)
        elif name == "/reset":
            session.reset()
            self.status("conversation forgotten")
        elif name == "/save":
            if not argument:
                raise ValueError("/save takes a file name")
            self.status(f"saved to {session.save(argument)}")
        elif name == "/help":
            self.status(HELP)
        elif name in ("/quit", "/exit"):
            self.leave = True
        else:
            raise ValueError(f"unknown command {name}: /help lists the commands")


def run_chat(session: ChatHistory, guard: Callable = nullcontext, stdin: TextIO | None = None,
             stdout: TextIO | None = None, stderr: TextIO | None = None, interactive: bool | None = None,
             hand_off: Callable[[ChatHistory, str], None] | None = None, first_lines: Sequence[str] = ()) -> int:
    """The chat loop on the process's streams by default; interactive (a prompt, line editing):
    when stdin is a terminal. Its exit status: 0 at end of input, 130 when Ctrl-C stops a pipe's
    reading."""
    stdin = stdin if stdin is not None else sys.stdin
    if interactive is None:
        interactive = stdin.isatty()
    loop = ChatLoop(session, stdin, stdout if stdout is not None else sys.stdout,
                    stderr if stderr is not None else sys.stderr, interactive, guard, hand_off, first_lines)
    return loop.run()
