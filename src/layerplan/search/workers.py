"""Who runs a trial of a shared study, and whether that worker is still alive.

Every trial a layerplan worker runs carries the worker's identity (host, pid, process start) and
a heartbeat time it refreshes while the trial runs. A RUNNING trial is stale when its worker is
known dead: on this host, its process is gone (or the pid now belongs to another process); on
another host, its heartbeat is older than the grace period. This works the same on every storage
(SQLite, any RDB, journal files), which Optuna's own heartbeat (RDB only, Study.optimize only) does not.

A worker that is asked to stop (SIGTERM, Ctrl-C) fails its running trial itself before it exits
(stopping_politely and layerplan.search.bayes.optimise); only a worker that cannot (SIGKILL, a
lost machine) leaves the trial RUNNING for the check above.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from layerplan.search.patience import single_attempt

try:
    import fcntl
except ImportError:  # Windows: no flock; one worker per SQLite file there
    fcntl = None

WORKER_ATTR = "worker"
ALIVE_ATTR = "alive_at"


def _process_start(pid: int) -> str:
    """The kernel's start time of process `pid` ('' where /proc does not say): a pid reused by a
    later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()  # field 22 of stat, counted after the command name
    except (OSError, IndexError):
        return ""


@dataclass(frozen=True)
class Worker:
    host: str
    pid: int
    started: str

    @classmethod
    def this(cls) -> Worker:
        return cls(socket.gethostname(), os.getpid(), _process_start(os.getpid()))

    def to_string(self) -> str:
        return f"{self.host}/{self.pid}/{self.started}"

    @classmethod
    def parse(cls, text: str) -> Worker | None:
        parts = text.rsplit("/", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        return cls(parts[0], int(parts[1]), parts[2])

    def is_dead(self) -> bool | None:
        """True/False for a worker on this host; None (unknown) for another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
        return bool(self.started) and _process_start(self.pid) not in (self.started, "")


def is_stale(trial, grace: float, now: float | None = None) -> bool:
    """A RUNNING trial (an Optuna FrozenTrial) whose worker is gone."""
    now = time.time() if now is None else now
    worker = Worker.parse(str(trial.user_attrs.get(WORKER_ATTR, "")))
    if worker is not None:
        dead = worker.is_dead()
        if dead is not None:
            return dead
    alive_at = trial.user_attrs.get(ALIVE_ATTR)
    if alive_at is None:  # a trial not started by a layerplan worker (or killed before it said so)
        start = trial.datetime_start
        alive_at = start.timestamp() if isinstance(start, datetime) else now
    return now - float(alive_at) > grace


def sqlite_file(storage_url: str) -> Path | None:
    """The database file of a SQLite storage (a bare path or sqlite:///PATH), else None."""
    if storage_url.startswith("journal:"):
        return None
    if "://" not in storage_url:
        return Path(storage_url)
    if storage_url.startswith("sqlite:///") and len(storage_url) > len("sqlite:///"):
        return Path(storage_url[len("sqlite:///"):])
    return None


@contextmanager
def claiming(storage_url: str | None) -> Iterator[None]:
    """Held by a worker while it asks the study for its next trial. On SQLite, Optuna's
    WAITING -> RUNNING change is a read then a write with no row lock (SQLite ignores
    SELECT ... FOR UPDATE), so two workers could pop the same enqueued trial and both run it;
    an exclusive lock on a file beside the database makes the asks take turns. Other RDBs lock
    the row and journal storages take their own lock: nothing to do there."""
    database = sqlite_file(storage_url) if storage_url else None
    if database is None or fcntl is None:
        yield
        return
    with open(database.with_name(database.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Stopped(SystemExit):
    """Raised in the main thread by SIGTERM while a worker runs (stopping_politely): the worker
    fails its trial on the way out, and the process exits with 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name


def stop_within(error: BaseException) -> Stopped | None:
    """The Stopped that `error` is, or that it was raised from or while handling: a signal that
    lands inside a library's call (a database driver's, mid-query) may come out as that library's
    own error, whose cause or context is the stop. None: no stop in the chain."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Stopped):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextmanager
def stopping_politely() -> Iterator[None]:
    """SIGTERM raises Stopped in the main thread inside the block (Ctrl-C raises KeyboardInterrupt
    as always), so that `finally` and `except` clauses run: the running trial is failed rather
    than left RUNNING until a heartbeat grace runs out. Nothing changes off the main thread, or
    where the program handles SIGTERM itself. A second SIGTERM ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (AttributeError, ValueError):  # no SIGTERM here
        yield
        return
    if previous not in (signal.SIG_DFL, None):
        yield
        return

    def stop(signum, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the second one is not polite
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Heartbeat:
    """Marks `trial` as run by this worker and refreshes its heartbeat every `interval` seconds
    until stop()."""

    def __init__(self, trial, interval: float) -> None:
        self.trial = trial
        self.interval = interval
        trial.set_user_attr(WORKER_ATTR, Worker.this().to_string())
        trial.set_user_attr(ALIVE_ATTR, time.time())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="layerplan-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with single_attempt():  # a beat the storage misses is retried at the next one, not waited for
            while not self._stop.wait(self.interval):
                try:
                    self.trial.set_user_attr(ALIVE_ATTR, time.time())
                except Exception:  # the trial was finished meanwhile (or the storage is away): next beat
                    pass

    def stop(self, wait: float | None = None) -> None:
        """Stop beating; wait for a beat in flight (at most `wait` seconds when given)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait)
