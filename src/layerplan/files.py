"""The files layerplan writes. Every output goes through here, so every output obeys the same rules:

- atomic: a file or folder is written under a hidden staging name beside its target and renamed
  onto it when whole, so a reader never sees half of one and an interrupted run never leaves one;
- it never destroys what it does not own: a target that exists and is not a regular file (a
  directory, FIFO, socket or device) is refused, and so is a symbolic link: layerplan does not
  write through links (the link would be replaced by a file, or the file it points to rewritten
  behind the user's back); a checkpoint folder replaces only an earlier checkpoint or an empty
  folder (replace_folder);
- outputs can be checked before any work (check_output), so a run does not compute for an hour
  and then fail to write;
- files and folders get the user's umask (0666 / 0777 minus it), whatever wrote them;
- staging debris is cleaned: while it is written, a staging file or folder is held by an
  exclusive flock of its writer; a later write of the same target removes staging entries of that
  target (hidden, `.NAME.XXXXXXXX[.tmp]`) that no live process holds and that are older than this
  process (a kill -9 leaves them; nothing else does).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import platformdirs

STARTED = time.time()  # staging debris is older than this: its writer started before us and is gone
_STAGING_SUFFIX = ".tmp"  # staging files end so; staging folders have no suffix


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


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, what: str) -> WriteError:
    return WriteError(errno.EEXIST, f"cannot write {path}: it exists and is {what}; layerplan replaces only "
                                    "a regular file it can own: give another path")


def _check_target(path: Path, folder: bool = False) -> os.stat_result | None:
    """The target's lstat (None when absent); WriteError for a symbolic link, or for anything but a
    regular file (folder=False) or a folder (folder=True)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None  # a parent is a file: the write itself says so (writing())
    if stat.S_ISLNK(info.st_mode):
        raise WriteError(errno.EEXIST, f"cannot write {path}: it is a symbolic link (to {os.readlink(path)}); "
                                       "layerplan does not write through links: give the link's target or a new path")
    if folder and not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, _kind(info.st_mode) if not stat.S_ISREG(info.st_mode) else "a file, not a folder")
    if not folder and not stat.S_ISREG(info.st_mode):
        raise _refuse(path, _kind(info.st_mode))
    return info


# the endings of the files a command writes: a folder output named with one (scan --out
# scan.json; export --to checkpoint --out m.safetensors) would become a folder of that name
FILE_SUFFIXES = (".json", ".jsonl", ".png", ".html", ".csv", ".yaml", ".yml", ".txt", ".gguf", ".safetensors")


def check_output(path: str | os.PathLike, kind: str = "file") -> Path:
    """Refuse, before any work, an output that could not be written: kind 'file' (a file written
    atomically), 'folder' (a folder that outputs are written into; it may exist, also as a link to
    a folder) or 'checkpoint' (a folder replaced as a whole, see replace_folder). Creates nothing:
    the nearest folder that exists is probed by making and removing a hidden folder in it."""
    path = Path(path)
    with writing(path):
        if kind != "file" and not path.exists() and path.suffix.lower() in FILE_SUFFIXES:
            raise WriteError(errno.EISDIR, f"cannot write {path}: the output is a folder that its files go "
                                           f"into, and '{path.name}' names a file; give a folder (made if it "
                                           f"does not exist)")
        if kind == "folder":
            if path.exists() and not path.is_dir():
                mode = os.stat(path).st_mode
                what = "a file" if stat.S_ISREG(mode) else _kind(mode)
                raise WriteError(errno.ENOTDIR, f"cannot write {path}: {path} is {what}, not a folder")
        else:
            _check_target(path, folder=kind == "checkpoint")
            if kind == "checkpoint" and path.is_dir():
                _check_replaceable(path)
        probe = path if kind == "folder" else path.parent
        existing = next(p for p in (probe, *probe.parents) if p.exists() or p == Path(p.anchor or "."))
        if not existing.is_dir():
            raise WriteError(errno.ENOTDIR, f"cannot write {path}: {existing} is a file, not a folder")
        try:
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".layerplan-check-"))
        except OSError as error:
            raise WriteError(error.errno, f"cannot write {path}: nothing can be created in {existing} "
                                          f"({error.strerror or error})") from None
    return path


def user_mode(folder: bool = False) -> int:
    """The permissions a new file (folder=False) or folder gets from the user's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


def apply_umask(path: Path) -> None:
    """Give `path` (and, for a folder, everything in it) the user's umask: mkstemp and mkdtemp make
    0600 / 0700, and some writers (safetensors) make 0600 files too."""
    file_mode, folder_mode = user_mode(), user_mode(folder=True)
    if path.is_dir():
        for root, folders, files in os.walk(path):
            for name in files:
                os.chmod(os.path.join(root, name), file_mode)
            for name in folders:
                os.chmod(os.path.join(root, name), folder_mode)
        os.chmod(path, folder_mode)
    else:
        os.chmod(path, file_mode)


def _staging_pattern(name: str) -> re.Pattern:
    # mkstemp / mkdtemp names: the prefix, 8 characters of [a-z0-9_], the suffix
    return re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}(?:{re.escape(_STAGING_SUFFIX)})?")


def _held(path: Path) -> bool:
    """True when a process holds the staging entry's flock (its writer is alive)."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0) | os.O_NOFOLLOW)
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def clean_debris(folder: str | os.PathLike, name: str) -> list[Path]:
    """Remove the staging debris of target `name` in `folder` (see the module's docstring): the
    entries named as this module names staging for it, held by no process and older than this
    one. Returns what was removed."""
    folder = Path(folder)
    pattern = _staging_pattern(name)
    removed = []
    try:
        entries = [entry for entry in os.scandir(folder) if pattern.fullmatch(entry.name)]
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        try:
            if entry.is_symlink() or entry.stat(follow_symlinks=False).st_mtime >= STARTED or _held(path):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            continue  # another process cleaned it first, or it is not ours to remove
    return removed


@contextmanager
def staging(target: str | os.PathLike, folder: bool = False) -> Iterator[Path]:
    """A fresh hidden staging file (folder=False) or folder beside `target`, held by this process
    (flock) while the caller writes it and renames it onto the target; removed at exit if still
    there. The target's earlier debris is cleaned first (clean_debris)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_debris(target.parent, target.name)
    if folder:
        path = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    else:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=_STAGING_SUFFIX)
        path = Path(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)
        if folder:
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Write a file at `path` atomically through a staging path that the caller's writer fills
    (for writers that take a path, such as gguf's): on a clean exit it gets the user's umask and
    is renamed onto `path`. The target rules are the module's."""
    path = Path(path)
    with writing(path):
        _check_target(path)
        with staging(path) as staged:
            yield staged
            _check_target(path)  # something may have appeared there while we wrote
            apply_umask(staged)
            os.replace(staged, path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    with atomic_file(path) as staged:
        with open(staged, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


# what a Hugging Face checkpoint folder holds (save_pretrained of a model and its tokenizer)
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.bin", "*.txt", "*.model", "*.jinja", "*.md", ".gitattributes")


def _check_replaceable(folder: Path) -> None:
    """WriteError unless `folder` may be replaced by a checkpoint: it is empty, or it holds a
    checkpoint (config.json) and nothing but checkpoint files."""
    entries = list(folder.iterdir())
    if not entries:
        return
    strangers = [e.name for e in entries if e.is_symlink() or not e.is_file()
                 or not any(e.match(pattern) for pattern in CHECKPOINT_FILES)]
    if not (folder / "config.json").is_file() or strangers:
        shown = ", ".join(sorted(strangers)[:3]) if strangers else "no config.json"
        raise WriteError(errno.EEXIST, f"cannot write {folder}: the folder exists and is not a checkpoint ({shown}); "
                                       "layerplan replaces only an earlier checkpoint or an empty folder: "
                                       "give a new folder")


@contextmanager
def replace_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Write a folder (a checkpoint) atomically: the caller fills the staging folder yielded, which
    then gets the user's umask and takes the folder's place. An existing folder is replaced only
    when it is empty or an earlier checkpoint (_check_replaceable); it is moved aside first and
    removed after, so an interruption leaves the old folder or the new one, and debris at worst."""
    folder = Path(folder)
    with writing(folder):
        if _check_target(folder, folder=True) is not None:
            _check_replaceable(folder)
        with staging(folder, folder=True) as staged:
            yield staged
            apply_umask(staged)
            if _check_target(folder, folder=True) is not None:
                _check_replaceable(folder)
                with staging(folder, folder=True) as old:
                    os.replace(folder, old / "previous")
                    os.replace(staged, folder)
            else:
                os.replace(staged, folder)


def cache_dir() -> Path:
    """Where layerplan keeps what it computes once: converted models, probes, built kernels.
    $LAYERPLAN_CACHE, else the platform's user cache folder."""
    env = os.environ.get("LAYERPLAN_CACHE")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("layerplan"))
