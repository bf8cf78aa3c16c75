"""A shared study's storage going away and coming back (issue 35): the retry policy of
search/patience.py, its one-line messages, the tell that is never told twice, and the polite
stop (SIGTERM, Ctrl-C) that fails the running trial. Unit-sized: a tiny model, a throwaway
PostgreSQL server where one is needed (the chaos runs themselves are tests/test_chaos.py)."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from layerplan.search.bayes import make_storage, run_study
from layerplan.search.evaluator import PlanEvaluator
from layerplan.search.patience import StorageUnavailable, patient_storage, unreachable_reason
from studies import fork_worker, reach_marker, study_trials
from tiny import VOCAB, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import chaos  # noqa: E402 - benchmarks/chaos.py: the throwaway PostgreSQL server


@pytest.fixture(scope="module")
def pg():
    import optuna

    try:
        server = chaos.Postgres()
    except chaos.Unavailable as error:
        pytest.skip(str(error))
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its handler writes to the stderr capsys replaced
    yield server
    optuna.logging.set_verbosity(verbosity)
    server.close()


def _lines(capsys) -> list[str]:
    """Our lines on stderr (not Optuna's log)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("storage ")]


def test_a_tell_while_the_database_is_down_is_told_once_it_is_back(pg, capsys):
    import optuna
    from optuna.trial import TrialState

    study = optuna.create_study(study_name="outage-tell", storage=make_storage(pg.url, heartbeat=None, patience=60))
    trial = study.ask()
    trial.set_user_attr("plan", "full")
    pg.crash()
    threading.Timer(2.0, pg.start).start()
    started = time.monotonic()
    study.tell(trial, 0.5)  # waits for the database, then tells
    assert time.monotonic() - started >= 1.5
    lines = _lines(capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith("storage unreachable (") and lines[0].endswith("): retrying for up to 1 min")
    assert lines[1].startswith("storage reachable again after ")
    found = [t for t in study_trials(pg.url, "outage-tell")]
    assert [(t.state, t.values) for t in found] == [(TrialState.COMPLETE, [0.5])]


def test_past_its_patience_a_worker_gives_up_in_one_line(pg, capsys):
    import optuna

    study = optuna.create_study(study_name="outage-patience", storage=make_storage(pg.url, heartbeat=None, patience=1))
    trial = study.ask()
    pg.crash()
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailable) as caught:
            study.tell(trial, 1.0)
        assert 0.9 <= time.monotonic() - started < 5
    finally:
        pg.start()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("the study storage has been unreachable for 1 s (")
    assert message.endswith("giving up (--storage-patience 1)")
    assert isinstance(caught.value, ValueError)  # the CLI's one-line error, exit status 1
    assert _lines(capsys) == [_lines_first(message)]


def test_a_worker_started_while_the_database_is_down_joins_when_it_comes_up(pg, capsys):
    """Opening the storage waits with the same patience as every later call (issue 46: a chaos
    worker restarted during a database restart gave up at once)."""
    import optuna

    pg.crash()
    threading.Timer(10.0, pg.start).start()
    started = time.monotonic()
    storage = make_storage(pg.url, heartbeat=None, patience=60)
    assert time.monotonic() - started >= 9.5
    study = optuna.create_study(study_name="outage-open", storage=storage)
    study.tell(study.ask(), 0.25)
    lines = _lines(capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith("storage unreachable (") and lines[0].endswith("): retrying for up to 1 min")
    assert lines[1].startswith("storage reachable again after ")
    assert [t.values for t in study_trials(pg.url, "outage-open")] == [[0.25]]


def test_a_database_that_stays_away_past_the_patience_is_one_line_at_open(pg):
    pg.crash()
    try:
        started = time.monotonic()
        with pytest.raises(ValueError) as caught:
            make_storage(pg.url, heartbeat=None, patience=1)
        assert 0.9 <= time.monotonic() - started < 15
    finally:
        pg.start()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot open the study storage {pg.url}: it has been "
                                                      "unreachable for 1 s (")
    assert message.endswith("giving up (--storage-patience 1)")


def _lines_first(message: str) -> str:
    reason = message.partition("(")[2].rpartition("); giving up")[0]
    return f"storage unreachable ({reason}): retrying for up to 1 s"


class _FlakyCommit:
    """An Optuna storage whose first tell commits and then loses its connection, as a database
    that goes down between the commit and its answer."""

    def __init__(self, inner) -> None:
        self.inner, self.tells = inner, 0

    def set_trial_state_values(self, trial_id, state, values=None):
        from sqlalchemy.exc import OperationalError

        self.tells += 1
        result = self.inner.set_trial_state_values(trial_id, state, values)
        if state.is_finished() and self.tells == 1:
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_tell_that_committed_before_its_connection_dropped_is_not_told_again():
    import optuna
    from optuna.storages import InMemoryStorage
    from optuna.trial import TrialState

    flaky = _FlakyCommit(InMemoryStorage())
    said = []
    study = optuna.create_study(storage=patient_storage(flaky, patience=30, say=said.append))
    trial = study.ask()
    study.tell(trial, 2.0)  # would raise "Cannot tell a COMPLETE trial" on a blind retry
    assert flaky.tells == 1
    assert [(t.state, t.values) for t in study.trials] == [(TrialState.COMPLETE, [2.0])]
    assert said[0] == ("storage unreachable (server closed the connection unexpectedly): retrying for up to 30 s")
    assert said[1].startswith("storage reachable again after")


def test_only_a_lost_connection_is_retried():
    from sqlalchemy.exc import IntegrityError, OperationalError

    assert unreachable_reason(OperationalError("SELECT 1", {}, Exception("connection refused\n\tIs the server running?"))) \
        == "connection refused"
    assert unreachable_reason(IntegrityError("INSERT", {}, Exception("duplicate key"))) is None
    assert unreachable_reason(ValueError("Cannot tell a COMPLETE trial.")) is None


def test_sqlite_is_not_retried_and_journal_not_wrapped(tmp_path):
    from optuna.storages import JournalStorage

    local = make_storage(str(tmp_path / "s.db"))
    assert local.patience is None  # a local file: its errors are the caller's at once
    assert isinstance(make_storage(f"journal:{tmp_path / 's.log'}"), JournalStorage)


def _commits(storage) -> list[str]:
    """The statements of every transaction that wrote (reads commit too) on `storage`'s engine
    from now on."""
    from sqlalchemy import event

    committed, pending = [], []
    engine = storage._backend.engine
    event.listen(engine, "before_cursor_execute", lambda *args: pending.append(args[2].split()[0]))

    def commit(connection) -> None:
        if {"INSERT", "UPDATE", "DELETE"} & set(pending):
            committed.append(" ".join(pending))
        pending.clear()

    event.listen(engine, "commit", commit)
    return committed


@pytest.mark.parametrize("server", [False, True], ids=["sqlite", "postgresql"])
def test_a_trials_parameters_are_written_in_one_transaction(tmp_path, server, request):
    """56 suggestions (a 30-layer skip plan has 60) were 56 commits, two thirds of a trial's time
    on SQLite and more on a server; held until the trial's next call of another kind, they are
    one, and every reader after that call sees them all."""
    import optuna

    url = request.getfixturevalue("pg").url if server else str(tmp_path / "s.db")
    storage = make_storage(url, heartbeat=None, patience=30)
    study = optuna.create_study(storage=storage, study_name=f"batched-{server}")
    commits = _commits(storage)
    trial = study.ask()
    commits.clear()
    drawn = {f"p{i}": trial.suggest_categorical(f"p{i}", [True, False]) for i in range(56)}
    assert commits == []  # held
    assert trial.params == drawn  # the trial's own view has them at once
    trial.set_user_attr("plan", "x")  # any other call writes them first, in one transaction
    assert len(commits) == 2 and commits[0].count("INSERT") == 56 and commits[1].count("INSERT") == 1
    assert optuna.load_study(study_name=f"batched-{server}", storage=make_storage(url)).trials[0].params == drawn
    study.tell(trial, 1.0)
    second = study.ask()
    second.suggest_categorical("p0", [True, False])
    with pytest.raises(ValueError, match="dynamic value space"):  # still checked against the first
        second.suggest_categorical("p1", [1, 2, 3])
        second.set_user_attr("plan", "y")


def test_parameters_that_committed_before_their_connection_dropped_are_not_written_again(tmp_path):
    import optuna
    from sqlalchemy.exc import OperationalError

    storage = make_storage(str(tmp_path / "s.db"))
    storage._outage = patient_storage(None, patience=30)._outage  # retried, as on a server
    write, calls = storage._write_params, []

    def write_then_drop(trial_id, params):
        calls.append(len(params))
        write(trial_id, params)
        if len(calls) == 1:
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    storage._write_params = write_then_drop
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    drawn = {f"p{i}": trial.suggest_categorical(f"p{i}", [True, False]) for i in range(5)}
    study.tell(trial, 1.0)  # a blind retry would insert the rows twice (IntegrityError)
    assert calls == [5]
    assert [(t.params, t.values) for t in study.trials] == [(drawn, [1.0])]


class _SlowEvaluator(PlanEvaluator):
    """Touches `marker` in its third evaluation, then takes `seconds` (in short steps, as a real
    evaluation does between torch calls)."""

    def __init__(self, model, ids, marker: Path, seconds: float) -> None:
        super().__init__(model, ids)
        self.marker, self.seconds = marker, seconds

    def divergence(self, plan, give_up=None):
        if self.evaluations >= 2 and not self.marker.exists():
            self.marker.touch()
            for _ in range(int(self.seconds * 100)):
                time.sleep(0.01)
        return super().divergence(plan, give_up)


def _work(model, storage: str, marker: Path, patience: float = 600, seconds: float = 60) -> None:
    torch.set_num_threads(1)
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    try:
        run_study(_SlowEvaluator(model, ids, marker, seconds), "kl", 20, storage, "polite", seeds=[model.plan()], poll=0.05,
                  patience=patience)
    except StorageUnavailable as error:
        Path(str(marker) + ".error").write_text(str(error))
        os._exit(3)


@pytest.fixture(scope="module")
def worker_model():
    return tiny_model("llama", num_layers=6)


class _WrappingEvaluator(PlanEvaluator):
    """Its third evaluation is stopped mid-call, and the call's library turns the stop into its own
    error (as SQLAlchemy does when SIGTERM lands in a connection's ping)."""

    def divergence(self, plan, give_up=None):
        if self.evaluations >= 2:
            from layerplan.search.workers import Stopped

            try:
                raise Stopped(signal.SIGTERM)
            except Stopped as stop:
                raise RuntimeError("can't change 'autocommit' now: connection in transaction status ACTIVE") from stop
        return super().divergence(plan, give_up)


def test_a_stop_that_a_library_wrapped_in_its_own_error_still_stops_politely(worker_model, tmp_path, capsys):
    """The worker fails its trial and exits with 128 + SIGTERM, no traceback, as for a stop
    raised in its own code."""
    from optuna.trial import TrialState

    storage = str(tmp_path / "study.db")
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(SystemExit) as stopped:
        run_study(_WrappingEvaluator(worker_model, ids), "kl", 20, storage, "wrapped", seeds=[worker_model.plan()],
                  poll=0.05)
    assert stopped.value.code == 128 + signal.SIGTERM and stopped.value.__cause__ is None
    states = [t.state for t in study_trials(storage, "wrapped")]
    assert states.count(TrialState.FAIL) == 1 and TrialState.RUNNING not in states
    assert "stopped (SIGTERM): trial" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_worker_stopped_politely_fails_its_trial_within_a_second(worker_model, tmp_path, how):
    from optuna.trial import TrialState

    storage = str(tmp_path / "study.db")
    marker = tmp_path / "in-trial"
    worker = fork_worker(_work, worker_model, storage, marker)
    reach_marker(worker, marker, 30.0, "slow")
    running = [t.number for t in study_trials(storage, "polite") if t.state == TrialState.RUNNING]
    assert len(running) == 1
    sent = time.monotonic()
    os.kill(worker.pid, getattr(signal, how))
    while study_trials(storage, "polite")[running[0]].state == TrialState.RUNNING and time.monotonic() - sent < 5:
        time.sleep(0.02)
    assert time.monotonic() - sent < 1.0  # failed within a second (then the process exits)
    worker.join(timeout=10)
    assert worker.exitcode == (128 + signal.SIGTERM if how == "SIGTERM" else 1)  # SIGINT: KeyboardInterrupt
    found = study_trials(storage, "polite")
    assert found[running[0]].state == TrialState.FAIL
    assert not [t for t in found if t.state == TrialState.RUNNING]


def test_a_worker_whose_database_stays_away_exits_with_one_line(worker_model, pg):
    marker = Path(pg.folder) / "patience-marker"
    worker = fork_worker(_work, worker_model, pg.url, marker, 1.0, 2.0)
    reach_marker(worker, marker, 30.0, "slow")
    pg.crash()
    try:
        worker.join(timeout=60)  # the slow trial (2 s) cannot be told: it gives up at the tell
    finally:
        pg.start()
    assert worker.exitcode == 3
    message = Path(str(marker) + ".error").read_text()
    assert "\n" not in message and "giving up (--storage-patience 1)" in message
