"""One retry policy for every storage call of a shared study (ask, tell, heartbeat, the
duplicate-plan check, the final summary): a database server that restarts, fails over or drops
its connections must not end a search that runs on eight machines overnight.

PatientStorage wraps an Optuna storage. A call that fails because the database cannot be reached
is retried with backoff (SQLAlchemy's pool reconnects on the next checkout) until it succeeds or
the storage has been unreachable for `patience` seconds straight; one line goes to stderr when
the storage becomes unreachable and one when it is back, and after the patience a
StorageUnavailable (a one-line ValueError) ends the worker. Calls that change state are not
blindly repeated: before a retry the trial is read back, so a tell that committed before its
connection dropped is not told twice (and an ambiguous claim of an enqueued trial is let go, for
the staleness check to fail it; see layerplan.search.workers).

A thread inside `single_attempt()` (the heartbeat, a worker stopping on a signal) never waits:
its call is tried once and fails at once while the storage is away.

A trial's parameters are written in one transaction: Optuna writes each suggested parameter as
it is drawn (a commit, and on a server a round trip, per parameter: 56 a trial for a 30-layer
skip plan, two thirds of a trial's time), so on an SQL storage they are held until the next
call of any other kind and then written together. Invariant: every call but set_trial_param
writes the held parameters first, so anything that reads the trial (or ends it) sees them all.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

DEFAULT_PATIENCE = 600.0  # seconds a worker waits for its storage to come back
_FIRST_WAIT, _LONGEST_WAIT = 0.25, 2.0  # backoff between attempts: doubling, at most this
_NOT_DONE = object()
_local = threading.local()


class StorageUnavailable(ValueError):
    """The storage stayed unreachable for longer than the patience (a one-line message)."""


@contextmanager
def single_attempt() -> Iterator[None]:
    """Storage calls of this thread, inside the block, are tried once (no waiting for an outage)."""
    before = getattr(_local, "single", False)
    _local.single = True
    try:
        yield
    finally:
        _local.single = before


def describe(seconds: float) -> str:
    """'10 min', '90 s', '2.5 s'."""
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


def _chain(error: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    while error is not None and all(error is not e for e in found):
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def unreachable_reason(error: BaseException) -> str | None:
    """Why the database could not be reached, in one line, when `error` says so (a dropped or
    refused connection, a server shutting down, a pool timeout); None for any other error (a
    bad value, a finished trial, a missing table), which is not retried."""
    try:
        from sqlalchemy import exc
    except ImportError:  # no SQLAlchemy: no database either
        return None
    chain = _chain(error)
    transient = False
    for e in chain:
        if isinstance(e, (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError,
                          ConnectionError)):
            transient = True
        elif isinstance(e, exc.DBAPIError) and e.connection_invalidated:
            transient = True
        elif type(e).__module__.startswith(("psycopg", "pymysql", "MySQLdb")) and type(e).__name__ in (
                "OperationalError", "InterfaceError"):
            transient = True
    if not transient:
        return None
    drivers = [e.orig for e in chain if getattr(e, "orig", None) is not None]  # the driver's own words
    drivers += [e for e in chain if type(e).__module__.startswith(("psycopg", "pymysql", "MySQLdb"))]
    for e in drivers + chain:
        line = next((part.strip() for part in str(e).splitlines() if part.strip()), "")
        line = line.split(" (Background on this error")[0]
        if line and line != "()":
            return line if len(line) <= 160 else line[:157] + "..."
    return type(error).__name__


class _Outage:
    """What the workers' threads share: since when the storage has been unreachable, and why."""

    def __init__(self, patience: float, say: Callable[[str], None]) -> None:
        self.patience = patience
        self.say = say
        self.since: float | None = None
        self.reason = ""
        self.outages = 0  # times the storage became unreachable (for reports and tests)
        self._lock = threading.Lock()

    def failed(self, reason: str) -> float:
        """Record a failed attempt; the time (monotonic) at which patience runs out."""
        with self._lock:
            if self.since is None:
                self.since, self.reason = time.monotonic(), reason
                self.outages += 1
                if self.patience > 0:  # (no patience: the caller's one error line says it all)
                    self.say(f"storage unreachable ({reason}): retrying for up to {describe(self.patience)}")
            return self.since + self.patience

    def succeeded(self) -> None:
        if self.since is None:
            return
        with self._lock:
            if self.since is not None:
                self.say(f"storage reachable again after {time.monotonic() - self.since:.1f} s")
                self.since = None


def patiently(attempt: Callable[[], Any], outage: _Outage, confirm: Callable[[], Any] | None = None):
    """attempt(), tried again with backoff while it fails because the database cannot be reached,
    for at most the outage's patience (then StorageUnavailable). confirm, before a retry: whether
    the attempt that lost its connection committed after all (its result, or _NOT_DONE)."""
    wait, retrying = _FIRST_WAIT, False
    while True:
        try:
            if retrying and confirm is not None:
                done = confirm()
                if done is not _NOT_DONE:
                    outage.succeeded()
                    return done
            result = attempt()
        except Exception as error:
            reason = unreachable_reason(error)
            if reason is None:
                if retrying:
                    outage.succeeded()  # it answered, with an error of another kind
                raise
            deadline = outage.failed(reason)
            now = time.monotonic()
            if now >= deadline:
                raise StorageUnavailable(
                    f"the study storage has been unreachable for {now - deadline + outage.patience:.0f} s "
                    f"({outage.reason}); giving up (--storage-patience {outage.patience:g})") from None
            if getattr(_local, "single", False):
                raise
            time.sleep(min(wait, max(0.0, deadline - now)))
            wait, retrying = min(2 * wait, _LONGEST_WAIT), True
            continue
        outage.succeeded()
        return result


def open_patiently(open_storage: Callable[[], Any], patience: float = DEFAULT_PATIENCE,
                   say: Callable[[str], None] | None = None):
    """open_storage() under the same policy as every call of an open storage: a worker started while
    its database server is down (or restarting) joins when it is back, within the patience."""
    return patiently(open_storage, _Outage(float(patience), say or _stderr))


def _stderr(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: the line is lost, the work goes on
        pass


_CLASS = None


def patient_storage(inner, patience: float | None = DEFAULT_PATIENCE, say: Callable[[str], None] = _stderr):
    """`inner` (an Optuna storage) with every call under the retry policy (see the module): an
    Optuna BaseStorage (and BaseHeartbeat, handing the heartbeat calls through), made on first use
    so that importing this module does not import Optuna. `patience` None: no retries (a local
    file), the parameters still written a trial at a time."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_class()
    return _CLASS(inner, patience, say)


def _make_class():
    from optuna.storages import BaseStorage
    from optuna.storages._heartbeat import BaseHeartbeat

    class PatientStorage(BaseStorage, BaseHeartbeat):
        """An Optuna storage whose every call waits out an unreachable database (see the module)."""

        def __init__(self, inner, patience: float | None = DEFAULT_PATIENCE,
                     say: Callable[[str], None] = _stderr) -> None:
            self._inner = inner
            self._outage = _Outage(float(patience), say) if patience is not None else None
            self._write_params = _params_writer(inner)  # None: this storage writes parameters one by one
            self._held: dict[int, list[tuple]] = {}  # trial id -> its parameters not yet written
            self._lock = threading.RLock()  # the heartbeat thread writes too; a signal handler re-enters

        @property
        def patience(self) -> float | None:
            return self._outage.patience if self._outage else None

        @property
        def outages(self) -> int:
            return self._outage.outages if self._outage else 0

        def _attempt(self, attempt: Callable[[], Any], confirm: Callable[[], Any] | None):
            return patiently(attempt, self._outage, confirm) if self._outage else attempt()

        def _call(self, name: str, args: tuple, kwargs: dict, confirm: Callable[[], Any] | None = None):
            self.flush()
            method = getattr(self._inner, name)
            return self._attempt(lambda: method(*args, **kwargs), confirm)

        def flush(self) -> None:
            """Write the held parameters, a trial's in one transaction."""
            while True:
                with self._lock:
                    if not self._held:
                        return
                    trial_id, params = self._held.popitem()

                def confirm(trial_id=trial_id, params=params):  # the transaction is all or nothing
                    return None if params[0][0] in self._inner._backend.get_trial(trial_id).params else _NOT_DONE

                self._attempt(lambda: self._write_params(trial_id, params), confirm)

        # ----- calls that change state: read back before a retry ------------------------------------
        def set_trial_state_values(self, trial_id: int, state, values=None) -> bool:
            from optuna.trial import TrialState

            def confirm():
                current = self._inner.get_trial(trial_id)
                if state.is_finished() and current.state == state and (
                        values is None or list(current.values or []) == [float(v) for v in values]):
                    return True  # the tell committed before its connection dropped: told once
                if state == TrialState.RUNNING and current.state == TrialState.RUNNING:
                    return False  # claimed, by this worker or another: let it go (stale trials are failed)
                return _NOT_DONE

            return self._call("set_trial_state_values", (trial_id, state, values), {}, confirm)

        def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float, distribution) -> None:
            if self._write_params is not None:
                with self._lock:
                    self._held.setdefault(trial_id, []).append((param_name, param_value_internal, distribution))
                return None

            def confirm():
                return None if param_name in self._inner.get_trial(trial_id).params else _NOT_DONE

            return self._call("set_trial_param", (trial_id, param_name, param_value_internal, distribution), {}, confirm)

        def create_new_study(self, directions, study_name: str | None = None) -> int:
            def confirm():
                if study_name is None:
                    return _NOT_DONE
                try:
                    return self._inner.get_study_id_from_name(study_name)
                except KeyError:
                    return _NOT_DONE

            return self._call("create_new_study", (directions, study_name), {}, confirm)

        # ----- the heartbeat calls of Optuna's own heartbeat (Study.optimize), handed through --------
        def get_heartbeat_interval(self) -> int | None:
            getter = getattr(self._inner, "get_heartbeat_interval", None)
            return getter() if getter else None

        def get_heartbeat_stale_trial_callback(self):
            getter = getattr(self._inner, "get_heartbeat_stale_trial_callback", None)
            return getter() if getter else None

        def remove_session(self) -> None:
            getattr(self._inner, "remove_session", lambda: None)()

        def check_trial_is_updatable(self, trial_id: int, trial_state) -> None:
            self._inner.check_trial_is_updatable(trial_id, trial_state)

        def __getattr__(self, name: str):  # anything else of the inner storage (its engine, ...)
            if name.startswith("__") or name == "_inner":
                raise AttributeError(name)
            return getattr(self._inner, name)

    # the rest: reads, and writes that may be repeated (attributes, intermediate values, a new trial)
    for name in REPEATABLE:
        setattr(PatientStorage, name, _delegate(name))
    PatientStorage.__abstractmethods__ = frozenset()  # each is defined above or by _delegate
    return PatientStorage


REPEATABLE = ("create_new_trial", "delete_study", "get_all_studies", "get_all_trials", "get_best_trial",
              "get_n_trials", "get_study_directions", "get_study_id_from_name", "get_study_name_from_id",
              "get_study_system_attrs", "get_study_user_attrs", "get_trial", "get_trial_id_from_study_id_trial_number",
              "get_trial_number_from_id", "get_trial_param", "get_trial_params", "get_trial_system_attrs",
              "get_trial_user_attrs", "set_study_system_attr", "set_study_user_attr", "set_trial_intermediate_value",
              "set_trial_system_attr", "set_trial_user_attr", "record_heartbeat", "_get_stale_trial_ids")


def _params_writer(storage) -> Callable[[int, list[tuple]], None] | None:
    """A function writing one trial's parameters [(name, internal value, distribution), ...] in one
    transaction of `storage` (Optuna's cached SQL storage), keeping its distribution cache as its
    own set_trial_param does; None for a storage of another kind or an Optuna without these parts."""
    backend = getattr(storage, "_backend", None)
    try:
        from optuna.distributions import check_distribution_compatibility, distribution_to_json
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import RDBStorage, _create_scoped_session
    except ImportError:
        return None
    if not isinstance(backend, RDBStorage) or not all(
            hasattr(obj, part) for obj, part in ((storage, "_studies"), (storage, "_trial_id_to_study_id_and_number"),
                                                 (storage, "_lock"), (backend, "_set_trial_param_without_commit"))):
        return None

    def write(trial_id: int, params: list[tuple]) -> None:
        with storage._lock:
            study_id, _ = storage._trial_id_to_study_id_and_number[trial_id]
            known = storage._studies[study_id].param_distribution
            previous = [known.get(name) for name, _, _ in params]
        with _create_scoped_session(backend.scoped_session, True) as session:
            if any(before is None for before in previous):  # new to this process: Optuna's own checks
                for (name, value, distribution), before in zip(params, previous):
                    backend._set_trial_param_without_commit(session, trial_id, name, value, distribution, before)
            else:  # one look at the trial and one insert (each of Optuna's looks sends the rows before it)
                trial = models.TrialModel.find_or_raise_by_id(trial_id, session)
                backend.check_trial_is_updatable(trial_id, trial.state)
                for (name, _, distribution), before in zip(params, previous):
                    check_distribution_compatibility(before, distribution)
                session.add_all([models.TrialParamModel(trial_id=trial_id, param_name=name, param_value=value,
                                                        distribution_json=distribution_to_json(distribution))
                                 for name, value, distribution in params])
        with storage._lock:
            for name, _, distribution in params:
                known.setdefault(name, distribution)

    return write


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return self._call(name, args, kwargs)

    method.__name__ = name
    return method
