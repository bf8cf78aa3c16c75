"""Chaos runs: a shared search that outlives its database and its workers, a server that outlives
its clients (issue 35). `make chaos` runs both, full length; `make test` runs a short version of
each (tests/test_chaos.py).

    python benchmarks/chaos.py [--only search|server] [--quick]

Search: N workers of `layerplan search --method bayes --objective kl` share one study in a
throwaway PostgreSQL server on 127.0.0.1; every `kill_every` seconds one worker is stopped (mostly
SIGKILL; every `polite_every`-th stop a SIGTERM or SIGINT, whose running trial must turn FAIL
within a second) and started again, and the database is restarted in immediate mode (down a few
seconds) `restarts` times. At the end: trials by state, plans evaluated twice, trials stuck
RUNNING, worker tracebacks and unexpected worker exits; all must be zero but the states.

Server: `layerplan serve` on 127.0.0.1 with `clients` streaming clients (greedy, each its own
prompt); every `hangup_every` seconds one client hangs up mid-stream (a closed socket, or a reset
as when its process is killed), a malformed request arrives every `malformed_every` seconds, and
/health is asked every 0.1 s. Every reply read to the end must equal the prompt's solo reply,
every malformed request must get a 4xx, /health must answer within 100 ms, and the server's
resident memory at the end must be within 10% of the one after the first minute.

Every loop is bounded: a run that overstays its limit stops its processes and fails. Only
127.0.0.1 is used. Each run prints one summary line; the exit status is 1 when any is off.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# as the `layerplan` console script starts a command (app/launch.py: the process is the command)
CLI = [sys.executable, "-c", "import sys; from layerplan.app.cli import run_as_process; sys.argv[0] = 'layerplan'; "
       "run_as_process()"]


class Unavailable(RuntimeError):
    """What a run needs is not here (PostgreSQL): the run cannot be made, which is not a pass."""


def _default_sigint() -> None:
    """In a child before it runs: SIGINT to its default, so the child's Python turns it into
    KeyboardInterrupt even where this run was started in the background (a shell starts background
    jobs with SIGINT ignored, which children inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----- a throwaway PostgreSQL server -------------------------------------------------------------
def postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")) if Path("/usr/lib/postgresql").exists() else []
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


class Postgres:
    """initdb into a temporary folder, serve on 127.0.0.1 only, restart in immediate mode (the
    way a crash or a failover looks to clients). As root it runs as the 'postgres' user."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        if self.bin is None:
            raise Unavailable("PostgreSQL is not installed (Debian package 'postgresql'; "
                              ".ci/install-postgresql installs it when it can)")
        try:
            import psycopg  # noqa: F401 - the workers' driver
        except ImportError:
            raise Unavailable("psycopg (3) is not installed: pip install 'psycopg[binary]'") from None
        self.as_root = os.geteuid() == 0
        if self.as_root and shutil.which("runuser") is None:
            raise Unavailable("running PostgreSQL as root needs runuser (util-linux)")
        self.folder = Path(tempfile.mkdtemp(prefix="layerplan-chaos-pg-"))
        self.data = self.folder / "data"
        self.data.mkdir()
        if self.as_root:
            try:
                shutil.chown(self.folder, "postgres")
                shutil.chown(self.data, "postgres")
            except LookupError:
                raise Unavailable("no 'postgres' user to run PostgreSQL as") from None
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-o", f"-p {self.port} -k {self.folder} -h 127.0.0.1",
                  "-l", str(self.folder / "server.log"), "-w", "-t", "60", "start")

    def crash(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def restart(self, down: float) -> None:
        """Stop at once (no checkpoint, connections cut), stay down `down` seconds, start."""
        self.crash()
        time.sleep(down)
        self.start()

    def close(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        except Exception:  # noqa: BLE001 - already down
            pass
        shutil.rmtree(self.folder, ignore_errors=True)

    def query(self, sql: str, *params) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.url, connect_timeout=5) as connection:
            return connection.execute(sql, params).fetchall()


# ----- the search under chaos --------------------------------------------------------------------
@dataclass
class SearchSettings:
    workers: int = 4
    trials: int = 400
    tokens: int = 64
    kill_every: float = 20.0  # seconds between stops of a worker
    polite_every: int = 4  # every this-many-th stop is SIGTERM or SIGINT (alternately), not SIGKILL
    restarts: int = 2  # database restarts, spread over the run
    restart_after: tuple[float, ...] = (30.0, 75.0)  # seconds after the first finished trial
    down: float = 5.0  # seconds the database stays down
    limit: float = 240.0  # seconds: past this the run is stopped and fails
    patience: float = 600.0
    settle: float = 15.0  # a database restart waits until every worker has run this long (connected)
    max_stops: int | None = None  # stops of a worker in all (None: until the study is done)

    @classmethod
    def quick(cls) -> SearchSettings:
        return cls(workers=2, trials=120, tokens=128, kill_every=1.5, polite_every=2, restarts=1,
                   restart_after=(1.0,), down=2.0, limit=100.0, settle=6.0, max_stops=2)


@dataclass
class Worker:
    index: int
    process: subprocess.Popen
    started: float
    log: Path
    stopped_by: str | None = None  # the signal we sent it


@dataclass
class SearchReport:
    states: dict[str, int] = field(default_factory=dict)
    twice: int = 0
    running: int = 0
    tracebacks: int = 0
    unexpected_exits: list[str] = field(default_factory=list)
    kills: int = 0
    polite: list[tuple[str, float | None, float]] = field(default_factory=list)  # (signal, FAIL after s, exit after s)
    restarts: int = 0
    outage_lines: int = 0
    back_lines: int = 0
    seconds: float = 0.0
    timed_out: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self, trials: int) -> str:
        states = ", ".join(f"{k} {v}" for k, v in sorted(self.states.items(), key=lambda kv: -kv[1]))
        polite = [f"{name} FAIL in {fail:.2f} s" if fail is not None else f"{name} no trial" for name, fail, _ in self.polite]
        worst_exit = max((ex for *_, ex in self.polite), default=0.0)
        return (f"search chaos: {self.states.get('COMPLETE', 0)}/{trials} trials complete ({states}); "
                f"plans evaluated twice {self.twice}; stuck RUNNING {self.running}; worker tracebacks "
                f"{self.tracebacks}; unexpected worker exits {len(self.unexpected_exits)}; "
                f"{self.kills} SIGKILL + {len(self.polite)} polite stops ({'; '.join(polite) or 'none'}; slowest exit "
                f"{worst_exit:.2f} s); {self.restarts} database restarts (outage lines {self.outage_lines}, "
                f"back {self.back_lines}); {self.seconds:.0f} s — "
                + ("ok" if self.ok else "FAILED: " + "; ".join(self.problems)))


def _study_rows(pg: Postgres, study: str, sql_tail: str, *params) -> list[tuple]:
    return pg.query("SELECT t.number, t.state::text, a.value_json FROM trials t JOIN studies s ON s.study_id = t.study_id "
                    "LEFT JOIN trial_user_attributes a ON a.trial_id = t.trial_id AND a.key = %s "
                    f"WHERE s.study_name = %s {sql_tail}", *params)


def _completed_before(pg: Postgres, study: str, trial: int, moment: datetime.datetime) -> bool:
    """Whether the trial is COMPLETE with its completion stamped no later than `moment`."""
    rows = pg.query("SELECT t.state::text, t.datetime_complete FROM trials t JOIN studies s ON s.study_id = t.study_id "
                    "WHERE s.study_name = %s AND t.number = %s", study, trial)
    return bool(rows) and rows[0][0] == "COMPLETE" and rows[0][1] is not None and rows[0][1] <= moment


def run_search_chaos(settings: SearchSettings, folder: Path, say=print, pg: Postgres | None = None) -> SearchReport:
    own = pg is None
    pg = pg or Postgres()
    report = SearchReport()
    study = "chaos"
    workers: list[Worker] = []
    begun = time.monotonic()
    try:
        def start(index: int) -> Worker:
            log = folder / f"worker{index}-{len(workers)}.log"
            command = CLI + ["search", "--method", "bayes", "--objective", "kl", "--tokens", str(settings.tokens),
                             "--trials", str(settings.trials), "--threads", "1", "--storage", pg.url, "--study", study,
                             "--storage-patience", f"{settings.patience:g}", "--no-save-draft",
                             "--out", str(folder / f"out{index}")]
            with open(log, "w") as handle:
                process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=handle, stdin=subprocess.DEVNULL,
                                           preexec_fn=_default_sigint)
            worker = Worker(index, process, time.monotonic(), log)
            workers.append(worker)
            return worker

        live = {i: start(i) for i in range(settings.workers)}
        finished: set[int] = set()

        def complete() -> int:
            try:
                return pg.query("SELECT count(*) FROM trials t JOIN studies s ON s.study_id = t.study_id "
                                "WHERE s.study_name = %s AND t.state = 'COMPLETE'", study)[0][0]
            except Exception:  # noqa: BLE001 - no tables yet, or the database is down
                return 0

        def reap() -> None:
            for i, worker in list(live.items()):
                code = worker.process.poll()
                if code is None:
                    continue
                del live[i]
                if worker.stopped_by is None:
                    if code == 0:
                        finished.add(i)
                    else:
                        report.unexpected_exits.append(f"worker {i} exited {code}: {_last_line(worker.log)}")
                        if complete() < settings.trials:
                            live[i] = start(i)

        def running_trial(worker: Worker) -> int | None:
            rows = _study_rows(pg, study, "AND t.state = 'RUNNING'", "worker", study)
            mine = [n for n, _, value in rows if value and f"/{worker.process.pid}/" in json.loads(value)]
            return mine[0] if mine else None

        def stop(i: int, how: str) -> None:
            worker = live.pop(i)
            worker.stopped_by = how
            if how == "SIGKILL":
                worker.process.kill()
                worker.process.wait(timeout=30)
                report.kills += 1
            else:
                trial = None
                for _ in range(100):  # wait (up to 5 s) until it runs a trial
                    trial = running_trial(worker)
                    if trial is not None or worker.process.poll() is not None:
                        break
                    time.sleep(0.05)
                sent, sent_at = time.monotonic(), datetime.datetime.now()  # (optuna's clock: naive local time)
                worker.process.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGINT)
                failed_after = None
                while time.monotonic() - sent < 10:
                    if trial is not None and failed_after is None:
                        state = _study_rows(pg, study, "AND t.number = %s", "plan", study, trial)[0][1]
                        if state != "RUNNING":
                            failed_after = time.monotonic() - sent
                            # a trial whose result was committed before the signal landed ends COMPLETE
                            if state != "FAIL" and not _completed_before(pg, study, trial, sent_at):
                                report.problems.append(f"{how}: trial {trial} ended {state}, not FAIL")
                    if worker.process.poll() is not None and (trial is None or failed_after is not None):
                        break
                    time.sleep(0.02)
                if worker.process.poll() is None:
                    worker.process.kill()
                    report.problems.append(f"{how}: worker {i} still alive 10 s later")
                worker.process.wait(timeout=30)
                exit_after = time.monotonic() - sent
                report.polite.append((how, failed_after, exit_after))
                if trial is not None and (failed_after is None or failed_after > 1.0):
                    report.problems.append(f"{how}: trial {trial} not FAIL within 1 s "
                                           f"({'never' if failed_after is None else f'{failed_after:.2f} s'})")
                expected = 128 + signal.SIGTERM if how == "SIGTERM" else 1
                if worker.process.returncode != expected:
                    report.problems.append(f"{how}: worker {i} exited {worker.process.returncode}, not {expected}")
            live[i] = start(i)

        first_done = None
        next_stop = None
        stops = 0
        restarts_due = list(settings.restart_after[: settings.restarts])
        while True:
            now = time.monotonic()
            if now - begun > settings.limit:
                report.timed_out = True
                report.problems.append(f"not done within {settings.limit:.0f} s")
                break
            reap()
            done = complete()
            if done >= settings.trials and not live:
                break
            if not live and done < settings.trials:
                report.problems.append("every worker ended before the study had its trials")
                break
            if len(report.unexpected_exits) > 2 * settings.workers:
                report.problems.append("workers keep failing")
                break
            if first_done is None and done > 0:
                first_done = now
                next_stop = now + settings.kill_every
            if first_done is not None and done < settings.trials:
                if restarts_due and now - first_done >= restarts_due[0] and all(
                        now - w.started > settings.settle for w in live.values()):  # every live worker has connected
                    restarts_due.pop(0)
                    say(f"  restarting the database ({settings.down:g} s down) at {done} trials")
                    pg.restart(settings.down)
                    report.restarts += 1
                    # no worker is stopped while they reconnect: a polite stop must find the storage
                    # answering (its trial FAIL within 1 s), and one landing in the outage raced it
                    next_stop = max(next_stop, time.monotonic() + settings.settle)
                    continue
                if now >= next_stop and live and (settings.max_stops is None or stops < settings.max_stops):
                    stops += 1
                    victim = sorted(live)[stops % len(live)]
                    how = ("SIGTERM" if (stops // settings.polite_every) % 2 else "SIGINT") \
                        if stops % settings.polite_every == 0 else "SIGKILL"
                    say(f"  {how} to worker {victim} at {done} trials")
                    stop(victim, how)
                    next_stop = time.monotonic() + settings.kill_every
            time.sleep(0.2)
        if restarts_due and not report.timed_out:
            report.problems.append(f"the study finished before {len(restarts_due)} database restart(s)")
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait(timeout=30)
        report.seconds = time.monotonic() - begun
        try:
            rows = _study_rows(pg, study, "", "plan", study)
            for _, state, _ in rows:
                report.states[state] = report.states.get(state, 0) + 1
            plans = [json.loads(value) for _, state, value in rows if state == "COMPLETE" and value]
            report.twice = len(plans) - len(set(plans))
            report.running = report.states.get("RUNNING", 0)
        except Exception as error:  # noqa: BLE001
            report.problems.append(f"could not read the study: {error}")
        for worker in workers:
            text = worker.log.read_text(errors="replace")
            report.tracebacks += text.count("Traceback (most recent call last)")
            report.outage_lines += len(re.findall(r"^storage unreachable \(", text, re.M))
            report.back_lines += len(re.findall(r"^storage reachable again", text, re.M))
        if own:
            pg.close()
    if report.states.get("COMPLETE", 0) != settings.trials:
        report.problems.append(f"{report.states.get('COMPLETE', 0)} complete trials, not {settings.trials}")
    for name, count in (("plans evaluated twice", report.twice), ("stuck RUNNING", report.running),
                        ("worker tracebacks", report.tracebacks)):
        if count:
            report.problems.append(f"{name}: {count}")
    if report.unexpected_exits:
        report.problems.append("unexpected exits: " + " | ".join(report.unexpected_exits[:3]))
    if report.restarts and not report.outage_lines:
        report.problems.append("no worker said the storage was unreachable")
    if report.outage_lines and report.back_lines < report.outage_lines - report.kills - len(report.polite):
        report.problems.append(f"{report.outage_lines} outage lines but {report.back_lines} 'reachable again'")
    return report


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"



# ----- the server under churn --------------------------------------------------------------------
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5,", "import numpy as np\n", "The three primary colors are",
           "Water boils at", "class Stack:\n    def __init__(self):"]


@dataclass
class ServerSettings:
    clients: int = 8
    seconds: float = 300.0  # the churn's length
    hangup_every: float = 2.0
    malformed_every: float = 1.0
    health_every: float = 0.1
    health_limit: float = 0.100  # seconds /health may take
    max_tokens: int = 24
    memory_at: float = 60.0  # the reference memory is taken this far into the churn
    memory_growth: float | None = 0.10  # allowed growth from then to the end (None: report only)
    limit: float = 340.0  # seconds for the whole run, start-up included
    prompts: int = len(PROMPTS)  # distinct prompts among the clients

    @classmethod
    def quick(cls) -> ServerSettings:
        return cls(seconds=8.0, max_tokens=8, memory_at=3.0, memory_growth=None, limit=120.0, prompts=4)


@dataclass
class ServerReport:
    answered: int = 0
    equal: int = 0
    unequal: list[str] = field(default_factory=list)
    hung_up: int = 0
    malformed: int = 0
    malformed_due: int = 0  # those whose request was whole (an answer is due; the others are cut off)
    malformed_4xx: int = 0
    malformed_bad: list[str] = field(default_factory=list)  # 5xx, or no answer where one was due
    health: list[float] = field(default_factory=list)
    health_failures: int = 0
    memory: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the churn, RSS bytes)
    growth: float | None = None
    tracebacks: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        worst = max(self.health, default=float("nan"))
        growth = "n/a" if self.growth is None else f"{self.growth:+.1%}"
        return (f"server chaos: {self.answered} streamed replies answered, {self.equal} equal to solo, "
                f"{len(self.unequal)} differ; {self.hung_up} hung up mid-request; malformed {self.malformed} "
                f"({self.malformed_4xx}/{self.malformed_due} whole ones answered 4xx, {len(self.malformed_bad)} not; "
                f"{self.malformed - self.malformed_due} cut off); /health worst "
                f"{worst * 1000:.0f} ms over {len(self.health)} (failed {self.health_failures}); memory growth "
                f"{growth} (1 min -> end); server tracebacks {self.tracebacks}; {self.seconds:.0f} s — "
                + ("ok" if self.ok else "FAILED: " + "; ".join(self.problems)))


class _Reply:
    """A raw HTTP/1.1 exchange on its own connection, read with short timeouts so that the reader
    can hang up (close or reset) between any two reads."""

    def __init__(self, port: int, raw: bytes, timeout: float = 120.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.settimeout(0.1)
        self.deadline = time.monotonic() + timeout
        self.sock.sendall(raw)
        self.buffer = b""
        self.status: int | None = None
        self.headers: dict[str, str] = {}

    def _more(self) -> bool:
        """Read what has come; False at end of stream."""
        while True:
            if time.monotonic() > self.deadline:
                raise TimeoutError("no complete answer in time")
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                return True
            if not data:
                return False
            self.buffer += data
            return True

    def head(self, poll=lambda *_: None) -> int | None:
        while b"\r\n\r\n" not in self.buffer:
            poll()
            if not self._more():
                return None
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        return self.status

    def body(self, poll=lambda *_: None):
        """The body's pieces as they come (chunked or Content-Length)."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                while b"\r\n" not in self.buffer:
                    poll()
                    if not self._more():
                        raise ConnectionError("the stream ended inside a chunk")
                size_line, _, rest = self.buffer.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                while len(rest) < size + 2:
                    poll()
                    if not self._more():
                        raise ConnectionError("the stream ended inside a chunk")
                    size_line, _, rest = self.buffer.partition(b"\r\n")
                self.buffer = rest[size + 2:]
                if size == 0:
                    return
                yield rest[:size]
        length = int(self.headers.get("content-length", "0"))
        while len(self.buffer) < length:
            poll()
            if not self._more():
                raise ConnectionError("the body ended early")
        yield self.buffer[:length]

    def hang_up(self, reset: bool) -> None:
        if reset:  # as when the client's process is killed with unread data: a RST
            import struct

            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _post(path: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def stream_text(port: int, model: str, prompt: str, max_tokens: int, poll=lambda *_: None) -> str:
    """One greedy streamed completion, read to its end: the text (ConnectionError when cut)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    reply = _Reply(port, _post("/v1/completions", body))
    try:
        status = reply.head(poll)
        if status != 200:
            raise ConnectionError(f"status {status}")
        events, text, done = b"", [], False
        for piece in reply.body(poll):
            events += piece
            while b"\n\n" in events:
                event, _, events = events.partition(b"\n\n")
                data = event.decode().removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                elif "error" in (parsed := json.loads(data)):
                    raise ConnectionError(f"error event: {parsed['error']}")
                else:
                    text.append(parsed["choices"][0]["text"])
                    poll(len(text))
        if not done:
            raise ConnectionError("no [DONE]")
        return "".join(text)
    finally:
        reply.close()


class _HangUp(Exception):
    pass


def _malformed(model: str) -> list[tuple[str, bytes, bool]]:
    """(name, raw request, whether an answer is due): bodies a server meets in the wild."""
    good = {"model": model, "prompt": "hi", "max_tokens": 2}
    cases = [
        ("truncated JSON", _post("/v1/completions", b'{"model": "x", "prompt": '), True),
        ("not JSON", _post("/v1/completions", b"hello", "text/plain"), True),
        ("not UTF-8", _post("/v1/completions", b'\xff\xfe{"model"'), True),
        ("negative max_tokens", _post("/v1/completions", json.dumps({**good, "max_tokens": -5}).encode()), True),
        ("no messages", _post("/v1/chat/completions", json.dumps({"model": model, "messages": []}).encode()), True),
        ("token id out of range", _post("/v1/completions", json.dumps({**good, "prompt": [10 ** 9]}).encode()), True),
        ("temperature 1e-300", _post("/v1/completions", json.dumps({**good, "temperature": 1e-300}).encode()), True),
        ("unknown model", _post("/v1/completions", json.dumps({**good, "model": "nope"}).encode()), True),
        ("a prompt past the context", _post("/v1/completions", json.dumps({**good, "prompt": "word " * 12000}).encode()),
         True),
        ("unknown path", b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", True),
        ("not HTTP", b"HELLO THERE\r\n\r\n", True),
        ("body shorter than its length", (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                          b"\r\nContent-Length: 500\r\n\r\n{\"model\""), False),
        ("headers cut off", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", False),
    ]
    return cases


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_server_chaos(settings: ServerSettings, folder: Path, say=print) -> ServerReport:
    folder.mkdir(parents=True, exist_ok=True)
    report = ServerReport()
    begun = time.monotonic()
    log = folder / "server.log"
    with open(log, "w") as handle:
        server = subprocess.Popen(CLI + ["serve", "--host", "127.0.0.1", "--port", "0"], stdout=handle,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_default_sigint)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        port = model = None
        while time.monotonic() - begun < min(180.0, settings.limit):
            found = re.search(r"serving '(.+?)' on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
            if found:
                model, port = found.group(1), int(found.group(2))
                break
            if server.poll() is not None:
                break
            time.sleep(0.2)
        if port is None:
            report.problems.append(f"the server did not start: {_last_line(log)}")
            return report
        prompts = [PROMPTS[i % settings.prompts] for i in range(settings.clients)]
        solo = {prompt: stream_text(port, model, prompt, settings.max_tokens) for prompt in set(prompts)}
        say(f"  server on port {port}: {len(solo)} solo replies; churning for {settings.seconds:g} s")
        lock = threading.Lock()
        churn_start = time.monotonic()
        hang = [None] * settings.clients  # per client: None, or "close" / "reset" asked by the churn
        progress = [0] * settings.clients  # text pieces of the client's current reply (0: not started)

        def client(index: int) -> None:
            prompt = prompts[index]
            while not stop.is_set():
                def poll(pieces=None):
                    if pieces is not None:
                        progress[index] = pieces
                    if hang[index] is not None or stop.is_set():  # at the end: no waiting for the queue
                        raise _HangUp(hang[index])

                progress[index] = 0
                try:
                    text = stream_text(port, model, prompt, settings.max_tokens, poll)
                except _HangUp:
                    if stop.is_set():
                        return
                    hang[index] = None
                    with lock:
                        report.hung_up += 1
                    continue
                except (OSError, ValueError) as error:
                    if stop.is_set():
                        return
                    with lock:
                        report.unequal.append(f"client {index}: {type(error).__name__}: {error}")
                    continue
                with lock:
                    report.answered += 1
                    if text == solo[prompt]:
                        report.equal += 1
                    else:
                        report.unequal.append(f"client {index}: {text!r} != {solo[prompt]!r}")

        def health() -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    reply = _Reply(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=5)
                    ok = reply.head() == 200 and b"ok" in b"".join(reply.body())
                    reply.close()
                except (OSError, ValueError):
                    ok = False
                took = time.monotonic() - started
                with lock:
                    report.health.append(took)
                    report.health_failures += not ok
                stop.wait(max(0.0, settings.health_every - took))

        def malformed() -> None:
            cases = _malformed(model)
            k = 0
            while not stop.wait(settings.malformed_every):
                name, raw, due = cases[k % len(cases)]
                k += 1
                outcome = None
                try:
                    reply = _Reply(port, raw, timeout=30)
                    if due:
                        status = reply.head()
                        outcome = None if status is not None and 400 <= status < 500 else f"{name}: {status}"
                    reply.close()  # a request cut short: hang up without waiting
                except (OSError, ValueError) as error:
                    outcome = f"{name}: {type(error).__name__}: {error}" if due else None
                with lock:
                    report.malformed += 1
                    report.malformed_due += due
                    report.malformed_4xx += due and outcome is None
                    if outcome:
                        report.malformed_bad.append(outcome)

        def memory() -> None:
            while not stop.wait(1.0):
                rss = _rss(server.pid)
                if rss is not None:
                    report.memory.append((time.monotonic() - churn_start, rss))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(settings.clients)]
        threads += [threading.Thread(target=f, daemon=True) for f in (health, malformed, memory)]
        for thread in threads:
            thread.start()
        turn = 0
        while time.monotonic() - churn_start < settings.seconds:
            if time.monotonic() - begun > settings.limit:
                report.problems.append(f"not done within {settings.limit:.0f} s")
                break
            time.sleep(settings.hangup_every)
            if server.poll() is not None:
                report.problems.append(f"the server died: {_last_line(log)}")
                break
            streaming = [i for i in range(settings.clients) if progress[i] > 0 and hang[i] is None]
            victim = random.Random(turn).choice(streaming or range(settings.clients))
            hang[victim] = "reset" if turn % 2 else "close"
            turn += 1
        stop.set()
        say(f"  churn over after {time.monotonic() - churn_start:.0f} s; waiting for the clients' last replies")
        for thread in threads:
            thread.join(timeout=150)
        say(f"  clients done after {time.monotonic() - churn_start:.0f} s")
        if any(thread.is_alive() for thread in threads):
            report.problems.append("a client thread did not finish")
    finally:
        stop.set()
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
                report.problems.append("the server did not stop on SIGINT within 20 s")
        report.seconds = time.monotonic() - begun
        report.tracebacks = log.read_text(errors="replace").count("Traceback (most recent call last)")
    reference = [rss for at, rss in report.memory if settings.memory_at - 5 <= at <= settings.memory_at + 5]
    if reference and report.memory:
        end = sorted(rss for _, rss in report.memory[-5:])
        report.growth = end[len(end) // 2] / sorted(reference)[len(reference) // 2] - 1
    if report.unequal:
        report.problems.append(f"{len(report.unequal)} replies differ or failed, e.g. {report.unequal[0][:200]}")
    if report.answered < settings.clients:
        report.problems.append(f"only {report.answered} replies answered")
    if report.malformed_bad:
        report.problems.append(f"malformed requests not answered 4xx: {', '.join(report.malformed_bad[:3])}")
    if report.health_failures:
        report.problems.append(f"/health failed {report.health_failures} times")
    if report.health and max(report.health) > settings.health_limit:
        slow = sum(t > settings.health_limit for t in report.health)
        report.problems.append(f"/health over {settings.health_limit * 1000:.0f} ms {slow} times")
    if settings.memory_growth is not None:
        if report.growth is None:
            report.problems.append("memory not measured")
        elif report.growth > settings.memory_growth:
            report.problems.append(f"memory grew {report.growth:.1%}")
    if report.tracebacks:
        report.problems.append(f"{report.tracebacks} tracebacks in the server's log")
    if server.returncode not in (0, None):
        report.problems.append(f"the server exited {server.returncode} on SIGINT")
    return report

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["search", "server"], default=None)
    parser.add_argument("--quick", action="store_true", help="the short version `make test` runs")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs in this folder")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="layerplan-chaos-"))
    folder.mkdir(parents=True, exist_ok=True)
    failed = False
    if args.only in (None, "search"):
        settings = SearchSettings.quick() if args.quick else SearchSettings()
        try:
            (folder / "search").mkdir(exist_ok=True)
            report = run_search_chaos(settings, folder / "search", say=lambda line: print(line, file=sys.stderr))
            print(report.line(settings.trials), flush=True)
            failed |= not report.ok
        except (Unavailable, RuntimeError, OSError) as error:  # no PostgreSQL here, or it would not start
            print(f"search chaos: not run: {error}", flush=True)
            failed = True
    if args.only in (None, "server"):
        settings = ServerSettings.quick() if args.quick else ServerSettings()
        try:
            report = run_server_chaos(settings, folder / "server", say=lambda line: print(line, file=sys.stderr))
            print(report.line(), flush=True)
            failed |= not report.ok
        except (RuntimeError, OSError) as error:  # the server never answered its solo requests
            print(f"server chaos: not run: {error}", flush=True)
            failed = True
    if args.keep is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
