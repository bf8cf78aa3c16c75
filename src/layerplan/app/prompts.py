"""Prompts: the built-in ones (bench, tune, search, frontier), a user's prompt file, and the rules
by which a command line names its prompt or prompts (generate's PROMPT, -p, -f, --prompt-file;
bench's and tune's --prompt names)."""

from __future__ import annotations

import json
from pathlib import Path

from layerplan.corpus import read_text_file

# Small prompts of different kinds; the continuation is what gets timed.
PROMPTS = {
    "code": (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
        "class Queue:\n    def __init__(self):\n"
    ),
    "chat": "What are three good habits for writing readable Python code?",
    "summary": (
        "Summarise in one sentence: The Python standard library is very extensive, offering a wide "
        "range of facilities. It contains built-in modules that provide access to system functionality "
        "such as file I/O, as well as modules written in Python that provide standardized solutions "
        "for many problems that occur in everyday programming."
    ),
    "continuation": "The history of the printing press begins in",
}
CHAT_PROMPTS = {"chat", "summary"}


def read_prompt_file(path: str | Path) -> tuple[dict[str, str], set[str]]:
    """({name: prompt}, names to wrap in the chat template) from a user's file.

    .jsonl: one record a line, either a JSON string or an object with "prompt" and optionally
    "name" and "chat" (true/false). Any other file: one prompt a non-empty line (plain text)."""
    path = Path(path)
    if path.exists() and not (path.is_file() or path.is_dir() or path.is_fifo()):  # /dev/zero never ends
        raise ValueError(f"cannot read prompts from {path}: not a text file (a device or socket)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read prompts from {path}: {error.strerror or error}") from None
    prompts: dict[str, str] = {}
    chat: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        name, prompt, as_chat = f"{path.stem}-{len(prompts) + 1}", line, False
        if path.suffix.lower() == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if isinstance(record, dict):
                prompt, name = record.get("prompt"), str(record.get("name") or name)
                as_chat = record.get("chat", False)
            else:
                prompt = record
            if not isinstance(prompt, str) or not prompt.strip() or not isinstance(as_chat, bool):
                raise ValueError(f"{path}:{number}: expected a non-empty string or "
                                 '{"prompt": "...", "name": "...", "chat": true|false}')
        if name in prompts:
            raise ValueError(f"{path}:{number}: prompt name '{name}' is used twice")
        prompts[name] = prompt
        if as_chat:
            chat.add(name)
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts, chat


class PromptUsageError(ValueError):
    """A command line that names its prompt more than once (a usage error, not bad input)."""


def pick_prompts(names, default=None) -> dict[str, str] | None:
    """The built-in prompts named on the command line (default when none)."""
    unknown = set(names) - set(PROMPTS)
    if unknown:
        raise ValueError(f"unknown prompt(s) {sorted(unknown)}; built-in: {', '.join(PROMPTS)}")
    return {k: PROMPTS[k] for k in names} if names else default


def one_prompt(argument: str | None, option: str | None, path: str | None) -> str | None:
    """The prompt from the first argument, -p or -f (one of them), or None."""
    given = [name for name, value in (("PROMPT", argument), ("-p/--prompt", option), ("-f/--file", path))
             if value is not None]
    if len(given) > 1:
        raise PromptUsageError(f"give the prompt once: {' and '.join(given)} both name one")
    if path is not None:  # (one line for a file that is not there, not text, or a device: /dev/zero never ends)
        return read_text_file(Path(path))
    return argument if argument is not None else option
