"""A kept index's tokenizer in a process of its own, started first thing by `layerplan generate`.

`tokenizers` parses tokenizer.json holding the interpreter's lock, and the parse is a large part of
a later start: ~0.1 s for SmolLM2's 49,152 tokens (a large tokenizer is read in the part its texts
need instead: models/tokenizer_table.py, 0.13 s for Gemma 3's 262,144 tokens). In the command's
own process nothing else runs meanwhile (the imports, the index and the embedding need the lock
too). Forked before those imports, a process of its own parses on
the second core while this one imports numpy and reads the panels, and answers encode and decode
over two pipes: the same answers as LiteTokenizer, which it runs.

Standard library only, so that the fork comes before numpy starts its threads (a fork copies only
the thread that calls it). The process ends when the command closes its pipes (`close`, or the
command's exit or exec, which close them too: they are not inherited).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path

from layerplan.models.errors import ModelError
from layerplan.models.gguf_place import TENSORS_FILE, gguf_of, index_folder

_LENGTH_BYTES = 8  # each message: its length, then its JSON


def _send(fd: int, message: object) -> None:
    data = json.dumps(message).encode()
    data = len(data).to_bytes(_LENGTH_BYTES, "little") + data
    while data:
        data = data[os.write(fd, data):]


def _read(fd: int, count: int) -> bytes | None:
    """`count` bytes, or None where the other end closed its pipe first."""
    chunks = []
    while count:
        chunk = os.read(fd, count)
        if not chunk:
            return None
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int) -> object | None:
    head = _read(fd, _LENGTH_BYTES)
    body = _read(fd, int.from_bytes(head, "little")) if head is not None else None
    return json.loads(body) if body is not None else None


def _serve(index: Path, requests: int, replies: int) -> None:
    """The tokenizer process: load, say so (or why not), then answer until the requests end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a ^C is the command's to report; it then closes the pipes)
    try:
        from layerplan.lite.tokenizer import LiteTokenizer  # (here: only this process parses it)

        try:
            tokenizer = LiteTokenizer(index)
            _send(replies, ["ready", list(tokenizer.eos_ids)])
        except Exception as error:  # noqa: BLE001 - the command raises it
            _send(replies, ["error", str(error)])
            raise
        while (request := _receive(requests)) is not None:
            method, arguments = request
            try:
                reply = ["ok", getattr(tokenizer, method)(*arguments)]
            except Exception as error:  # noqa: BLE001 - the command raises it
                reply = ["error", str(error)]
            _send(replies, reply)
    except BaseException:  # noqa: BLE001 - said above, or the command is gone (a closed pipe)
        os._exit(1)
    os._exit(0)  # (no clean-up of the command's state, which this copy shares)


class TokenizerProcess:
    """LiteTokenizer's answers (encode, decode, eos_ids) from a process of its own."""

    def __init__(self, pid: int, requests: int, replies: int, index: Path) -> None:
        self.pid, self._requests, self._replies, self.index = pid, requests, replies, index
        self.eos_ids: tuple[int, ...] = ()
        self._ready = False

    @classmethod
    def start(cls, index: Path) -> TokenizerProcess | None:
        """Fork the process for the index's tokenizer (None where the index has none, or the
        platform no fork). Call it before anything starts a thread."""
        if not hasattr(os, "fork") or not (index / "tokenizer.json").exists():
            return None
        pipes = []
        try:
            pipes += os.pipe()
            pipes += os.pipe()
            pid = os.fork()
        except OSError:  # (no process or descriptor to spare: the command reads the tokenizer itself)
            for fd in pipes:
                os.close(fd)
            return None
        request_read, request_write, reply_read, reply_write = pipes
        if pid == 0:
            os.close(request_write)
            os.close(reply_read)
            _serve(index, request_read, reply_write)
        os.close(request_read)
        os.close(reply_write)
        return cls(pid, request_write, reply_read, index)

    @classmethod
    def for_model(cls, model: str) -> TokenizerProcess | None:
        """The process for the tokenizer of the GGUF a --model names, where its index is kept (a
        first start makes the index, and then reads the tokenizer itself)."""
        try:
            gguf = gguf_of(model)
            index = index_folder(gguf) if gguf is not None else None
            if index is None or not (index / TENSORS_FILE).exists():
                return None
        except OSError:
            return None
        return cls.start(index)

    def ready(self) -> TokenizerProcess:
        """Wait until it has read the tokenizer; a ModelError where it could not."""
        if not self._ready:
            kind, value = self._reply()
            if kind != "ready":
                raise ModelError(value)
            self.eos_ids, self._ready = tuple(value), True
        return self

    def _reply(self) -> list:
        reply = _receive(self._replies)
        if reply is None:
            raise ModelError(f"the tokenizer process of {self.index.name} ended")
        return reply

    def _call(self, method: str, *arguments) -> object:
        self.ready()
        _send(self._requests, [method, list(arguments)])
        kind, value = self._reply()
        if kind != "ok":
            raise ModelError(value)
        return value

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        return self._call("encode", text, special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._call("decode", list(ids), skip_special_tokens)

    def close(self) -> None:
        """End the process, reading or answering, and reap it."""
        if self._requests < 0:
            return
        for fd in (self._requests, self._replies):
            os.close(fd)
        self._requests = self._replies = -1
        try:
            os.kill(self.pid, signal.SIGKILL)  # (it holds nothing: it writes no file)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
