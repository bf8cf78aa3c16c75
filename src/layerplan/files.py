"""Atomic file writes: a reader never sees half a file, an interrupted run never leaves one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import platformdirs


class WriteError(OSError):
    """A file or folder that cannot be written, named by the path the user gave (not by the
    temporary file beside it that an atomic write makes first)."""

    def __str__(self) -> str:
        return self.strerror


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turns an OSError raised while writing `path` into a WriteError that names `path`."""
    try:
        yield
    except WriteError:
        raise
    except OSError as error:
        blocking = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
        reason = f"{blocking} is a file, not a folder" if blocking is not None else error.strerror or str(error)
        raise WriteError(error.errno, f"cannot write {path}: {reason}") from None


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def cache_dir() -> Path:
    """Where layerplan keeps what it computes once: converted models, probes, built kernels.
    $LAYERPLAN_CACHE, else the platform's user cache folder."""
    env = os.environ.get("LAYERPLAN_CACHE")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("layerplan"))
