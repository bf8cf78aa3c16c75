"""Bayesian search over per-layer attention / MLP switches with Optuna.

Results live in an Optuna storage: a SQLite file by default, any RDB URL (PostgreSQL for a
team), or a journal file (`journal:PATH`). Several processes or machines running the same
command with the same storage and study name share one study without repeating one another's
work: each worker seeds its sampler differently, a plan the study holds is never evaluated again,
and the study stops at exactly `n_trials` finished trials in total. Interrupted runs resume:
finished trials are kept and trials whose worker died are marked failed (layerplan.search.workers);
a worker stopped by SIGTERM or Ctrl-C fails its running trial itself before it exits, so that the
study asks its plan again. On a database server every storage call rides out an outage
(layerplan.search.patience): the worker waits for the database, up to `patience` seconds.

A study keeps one question: what it optimises (objective, directions), on which model and how many
tokens is stored in the study's user attrs when it is made, and a run that asks something else of
the same study is refused, naming what differs (values of two objectives never mix in one study).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import random
import secrets
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Imported with this module, not where a study starts: Optuna keeps the ImportErrors of its optional
# imports, tracebacks and all, and a traceback keeps every frame of the importer's stack alive with
# its locals — imported inside a command, the model the command loaded, for the rest of the process
# (0.6 GB a `search` run in-process). It costs ~55 ms once torch is imported.
import optuna
from optuna.trial import TrialState

from layerplan.files import check_output, writing
from layerplan.plan.plan import LayerPlan, PlanError
from layerplan.search.greedy import candidate_items
from layerplan.search.objectives import OBJECTIVES, score
from layerplan.search.reference import CostModel, ResumingEvaluator
from layerplan.search.patience import (DEFAULT_PATIENCE, StorageUnavailable, open_patiently, patient_storage,
                                       single_attempt)
from layerplan.search.workers import Heartbeat, claiming, is_stale, stop_within, stopping_politely

MAX_REPEATS = 3  # proposals in a row of plans the study holds before a worker draws an unseen one


@dataclass(frozen=True)
class Sampler:
    help: str
    make: Callable[[Any, int], Any]  # (the optuna module, seed) -> an Optuna sampler


SAMPLERS = {
    "tpe": Sampler("multivariate TPE (with --multi: NSGA-II)",
                   lambda optuna, seed: optuna.samplers.TPESampler(seed=seed, multivariate=True)),
    "gp": Sampler("Gaussian process", lambda optuna, seed: optuna.samplers.GPSampler(seed=seed)),
    "nsga2": Sampler("NSGA-II, a genetic algorithm", lambda optuna, seed: optuna.samplers.NSGAIISampler(seed=seed)),
    "random": Sampler("uniform random (a baseline)", lambda optuna, seed: optuna.samplers.RandomSampler(seed=seed)),
}


STORAGE_FORMS = "a SQLite path, sqlite:///PATH, postgresql://…, mysql://… (with its driver installed) or journal:PATH"


def quiet_optuna() -> None:
    """Optuna's log at warnings only: a line per trial would hide a command's progress bar."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def check_storage(url: str | None) -> None:
    """ValueError naming the problem when `url` cannot be a study storage: an unknown database
    kind, a database whose Python driver is not installed, a file that cannot be written. Opens
    no connection and creates nothing: made before any work."""
    if url is None:
        return
    if url.startswith("journal:") or "://" not in url:
        path = url[len("journal:"):] if url.startswith("journal:") else url
        if not path.strip():
            raise ValueError(f"the study storage '{url}' names no file; use {STORAGE_FORMS}")
        try:
            check_output(Path(path).parent, "folder")
        except OSError as error:  # (WriteError names the folder; say it is the storage's)
            raise ValueError(f"cannot write {path}: {str(error).partition(': ')[2]}") from None
        if Path(path).is_dir():
            raise ValueError(f"the study storage {path} is a folder; give a file in it (e.g. {Path(path) / 'study.db'})")
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        dialect = make_url(url).get_dialect()
    except NoSuchModuleError:  # (an ArgumentError too)
        kind = url.partition("://")[0]
        raise ValueError(f"cannot open the study storage {url}: '{kind}' is not a database SQLAlchemy knows; "
                         f"use {STORAGE_FORMS}") from None
    except (ArgumentError, ValueError):
        raise ValueError(f"cannot read the study storage URL '{url}'; use {STORAGE_FORMS}") from None
    load = getattr(dialect, "import_dbapi", None) or getattr(dialect, "dbapi")
    try:
        load()
    except ImportError as error:
        raise ValueError(f"cannot open the study storage {url}: its database driver is not installed "
                         f"({error}); install it or use {STORAGE_FORMS}") from None


def make_storage(url: str | None, heartbeat: int | None = 60, patience: float = DEFAULT_PATIENCE):
    """An Optuna storage for `url` (see the module's docstring). heartbeat: with an RDB, Optuna's
    own heartbeat for studies run by Study.optimize, retrying trials whose process died (None:
    off; run_study keeps its own liveness record on every storage, see layerplan.search.workers).
    patience: on a database server (not SQLite), seconds every call waits for an unreachable
    database to come back (layerplan.search.patience) before StorageUnavailable; opening it
    waits the same (a worker started while the server restarts joins when it is back). A
    malformed URL or a missing driver is a ValueError at once."""
    import optuna

    if url is None:
        return None
    check_storage(url)
    if url.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len("journal:"):])
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)  # a fresh --out folder
            return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        with writing(url):
            Path(url).parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{url}"
    # workers sharing a SQLite file wait for its lock rather than fail
    server = not url.startswith("sqlite:")
    options: dict = {"engine_kwargs": {"connect_args": {"timeout": 60}}} if not server else {}
    if server:  # a pooled connection the server dropped (a restart) is replaced, not used and failed
        options["engine_kwargs"] = {"pool_pre_ping": True}
        if url.startswith("postgresql"):  # an unreachable host fails the attempt, not hangs it
            options["engine_kwargs"]["connect_args"] = {"connect_timeout": 10}
    if heartbeat is not None:
        retry_class = (getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
                       or optuna.storages.RetryFailedTrialCallback)
        keyword = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback"
                   in inspect.signature(optuna.storages.RDBStorage).parameters else "failed_trial_callback")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # heartbeats are marked experimental
            retry = retry_class(max_retry=3)
        options.update(heartbeat_interval=heartbeat, grace_period=2 * heartbeat, **{keyword: retry})
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    def open_rdb():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # heartbeats are marked experimental
            return optuna.storages.RDBStorage(url, **options)

    for attempt in range(5):
        try:
            if not server:  # no retries on a local file; parameters still written a trial at a time
                return patient_storage(optuna.storages.get_storage(open_rdb()), None)
            # a server that is down (restarting, failing over) is waited for, as every later call is
            return patient_storage(optuna.storages.get_storage(open_patiently(open_rdb, patience)), patience)
        except StorageUnavailable as error:
            raise ValueError(f"cannot open the study storage {url}: {str(error).replace('the study storage', 'it', 1)}") \
                from None
        except (IntegrityError, OperationalError, ProgrammingError) as error:
            # workers started together race to create the schema in an empty database (SQLite:
            # locked; PostgreSQL: "relation ... already exists", a ProgrammingError, or a unique
            # violation): the loser finds the tables made by the winner on the next try
            if attempt == 4:
                reason = next((line.strip() for line in str(getattr(error, "orig", None) or error).splitlines()
                               if line.strip()), type(error).__name__)
                raise ValueError(f"cannot open the study storage {url}: {reason}") from None
            time.sleep(0.5 * (attempt + 1))


def plan_from_params(num_layers: int, params: dict[str, bool], model_name: str = "the model") -> LayerPlan:
    """Trial parameters {"attn_3": False, "mlp_7": True, ...} (False = skipped) as a plan."""
    attention = [int(k[5:]) for k, v in params.items() if k.startswith("attn_") and not v]
    mlp = [int(k[4:]) for k, v in params.items() if k.startswith("mlp_") and not v]
    return LayerPlan.from_skips(num_layers, attention=attention, mlp=mlp, model_name=model_name)


def params_from_plan(plan: LayerPlan, items) -> dict[str, bool]:
    skipped = plan.skipped()
    return {
        (f"attn_{i}" if kind == "attention" else f"mlp_{i}"): i not in skipped[kind]
        for kind, i in items
    }


@dataclass
class TrialRecord:
    number: int
    plan: str
    values: list[float]
    cost: float
    state: str


@dataclass
class StudyResult:
    study: str
    objective: str
    directions: list[str]
    best_plan: str
    best_value: float | None
    trials: list[TrialRecord] = field(default_factory=list)
    pareto: list[TrialRecord] = field(default_factory=list)
    stale_failed: list[int] = field(default_factory=list)  # RUNNING trials of dead workers this run failed

    def to_dict(self) -> dict:
        return asdict(self)

    def ranked(self) -> list[TrialRecord]:
        """Finished trials, best first by the (first) objective."""
        done = [t for t in self.trials if t.state == "COMPLETE"]
        return sorted(done, key=lambda t: t.values[0], reverse=self.directions[0] == "maximize")


def derive_seed(study_name: str, seed: int | None, worker: object) -> int:
    """The sampler seed of one worker: the same for the same (study, --seed, worker) and different
    across workers, so that two workers, or a worker resumed after a crash, never replay one
    another's proposals. Without a user seed it is fresh entropy each run."""
    material = f"{study_name}\0{seed if seed is not None else secrets.token_hex(16)}\0{worker}"
    return int.from_bytes(hashlib.sha256(material.encode()).digest()[:4], "little")


def _unseen_params(num_layers: int, items, held: set[str], rng: random.Random) -> dict[str, bool] | None:
    """Switches for a valid plan the study does not hold yet (None: it holds every one)."""
    def plan_of(switches):
        params = {(f"attn_{i}" if kind == "attention" else f"mlp_{i}"): on for (kind, i), on in zip(items, switches)}
        try:
            return params, plan_from_params(num_layers, params).to_string()
        except PlanError:
            return params, None

    for _ in range(256):
        params, text = plan_of([rng.random() < 0.5 for _ in items])
        if text is not None and text not in held:
            return params
    if len(items) <= 16:  # small enough to list every plan
        for switches in itertools.product([True, False], repeat=len(items)):
            params, text = plan_of(switches)
            if text is not None and text not in held:
                return params
    return None


def _plan_of(trial) -> str | None:
    return trial.user_attrs.get("plan")


@dataclass(frozen=True)
class StudySpace:
    """What a shared study (optimise) searches, as three callbacks on Optuna trial parameters."""

    propose: Callable[[Any], LayerPlan]  # a trial -> its plan, suggesting the trial's parameters (PlanError: invalid)
    plan_of_params: Callable[[dict], LayerPlan]  # complete parameters -> their plan (PlanError: invalid or unknown)
    unseen: Callable[[set[str], random.Random], dict | None]  # parameters of a valid plan not in the held set of
    # plan strings; None once every plan is held


def skip_space(model, items) -> StudySpace:
    """Per-sub-layer switches (`items` from greedy.candidate_items) as a study space."""
    def params_of(trial) -> dict[str, bool]:
        return {name: trial.suggest_categorical(name, [True, False])
                for name in ((f"attn_{i}" if kind == "attention" else f"mlp_{i}") for kind, i in items)}

    return StudySpace(
        propose=lambda trial: plan_from_params(model.num_layers, params_of(trial), model.name),
        plan_of_params=lambda params: plan_from_params(model.num_layers, params),
        unseen=lambda held, rng: _unseen_params(model.num_layers, items, held, rng))


def run_study(
    evaluator: ResumingEvaluator,
    objective: str,
    n_trials: int,
    storage: str | None = None,
    study_name: str | None = None,
    sampler: str = "tpe",
    multi_objective: bool = False,
    seeds: list[LayerPlan] = (),
    allow_ends: bool = False,
    costs: CostModel | None = None,
    timed_speed: Callable[[LayerPlan], float] | None = None,
    seed: int | None = None,
    on_trial: Callable[[int, int], None] | None = None,
    heartbeat: float = 10.0,
    grace: float = 60.0,
    poll: float = 0.2,
    patience: float = DEFAULT_PATIENCE,
) -> StudyResult:
    """Optimise `objective` over per-sub-layer skip plans (and, with multi_objective, the plan's
    relative cost too, minimised) until the study holds `n_trials` finished trials, counting every
    worker's (see optimise). `seeds` (e.g. the greedy result, the full model) are enqueued as the
    first trials of a new study. `patience`: seconds to wait for an unreachable database server."""
    model = evaluator.model
    items = [item for item in candidate_items(model.num_layers, "sublayer", allow_ends)]
    directions = [OBJECTIVES[objective].direction] + (["minimize"] if multi_objective else [])

    def evaluate(plan: LayerPlan) -> float | tuple[float, float]:
        value = score(objective, plan, evaluator, costs, timed_speed)
        return (value, costs.relative_cost(plan) if costs else plan.cost) if multi_objective else value

    return optimise(skip_space(model, items), evaluate, objective, directions, n_trials, storage,
                    study_name or f"{model.name}-{objective}{'-cost' if multi_objective else ''}",
                    sampler if not (multi_objective and sampler == "tpe") else "nsga2",
                    [params_from_plan(plan, items) for plan in seeds], seed, on_trial, heartbeat, grace, poll,
                    identity={"model": model.name, "tokens": evaluator.tokens}, patience=patience)


def optimise(space: StudySpace, evaluate: Callable[[LayerPlan], float | tuple[float, ...]], objective: str,
             directions: list[str], n_trials: int, storage: str | None, name: str, sampler: str = "tpe",
             seeds: list[dict] = (), seed: int | None = None, on_trial: Callable[[int, int], None] | None = None,
             heartbeat: float = 10.0, grace: float = 60.0, poll: float = 0.2,
             identity: dict[str, Any] | None = None, patience: float = DEFAULT_PATIENCE) -> StudyResult:
    """One worker of study `name` on `storage`: proposes plans from `space` and evaluates them
    (`evaluate`: the value, or one per direction) until the study holds `n_trials` finished
    trials, counting every worker's.

    `seeds` (trial parameters) are enqueued as the first trials of a new study. Each worker's
    sampler seed comes from the study name, `seed` and the number of the worker's first trial
    (reproducible with a seed; fresh without). A plan the study already holds is not evaluated
    again: the trial is pruned with the holder's values copied (`duplicate_of`). Trials whose
    worker died (see layerplan.search.workers) are failed at start-up and while waiting; a worker
    waits for earlier trials in flight rather than run one past `n_trials`.
    `heartbeat`/`grace`: seconds between a running trial's heartbeats / before a silent one on
    another host counts as dead; `poll`: seconds between looks at the study while waiting.
    `identity`: what the study is about beyond `objective` and `directions` (model, tokens, ...),
    kept in the study and checked on every later run (check_identity).
    `patience`: on a database server, seconds every storage call waits for the database to come
    back (layerplan.search.patience), then StorageUnavailable. SIGTERM (while this runs on the
    main thread, where no one else handles it) and Ctrl-C fail the running trial, then end the
    process (SystemExit 143) or raise KeyboardInterrupt."""
    return BayesOptimisation(space, evaluate, objective, directions, n_trials, storage, name, sampler, seeds, seed,
                             on_trial, heartbeat, grace, poll, identity, patience).run()


def _complete(trials) -> list:
    return [t for t in trials if t.state == TrialState.COMPLETE]


class BayesOptimisation:
    """One worker of a shared study (optimise), a step a method: open (the study, checked and
    seeded), then rounds of step (look, ask, run_trial: wait for its turn, evaluate, tell) until
    the study is full, and result. Arguments as optimise's."""

    def __init__(self, space: StudySpace, evaluate: Callable[[LayerPlan], float | tuple[float, ...]], objective: str,
                 directions: list[str], n_trials: int, storage: str | None, name: str, sampler: str = "tpe",
                 seeds: list[dict] = (), seed: int | None = None, on_trial: Callable[[int, int], None] | None = None,
                 heartbeat: float = 10.0, grace: float = 60.0, poll: float = 0.2,
                 identity: dict[str, Any] | None = None, patience: float = DEFAULT_PATIENCE) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler '{sampler}'; choose from {', '.join(SAMPLERS)}")
        self.space, self.evaluate, self.objective, self.directions = space, evaluate, objective, list(directions)
        self.n_trials, self.storage, self.name, self.sampler = n_trials, storage, name, SAMPLERS[sampler]
        self.seeds, self.seed, self.on_trial = seeds, seed, on_trial
        self.heartbeat, self.grace, self.poll, self.patience = heartbeat, grace, poll, patience
        self.identity = {"objective": objective, "directions": list(directions), **(identity or {})}
        self.multi_objective = len(directions) > 1
        self.study = None
        self.stale: list[int] = []  # trials of dead workers this one failed
        self.worker_seed: int | None = None  # from this worker's first trial (ask)
        self.rng: random.Random | None = None
        self.repeats = 0  # this worker's proposals in a row that the study already held
        self.current = None  # the trial this worker holds RUNNING

    def run(self) -> StudyResult:
        """open, then steps until the study is full; a stop (SIGTERM, Ctrl-C) or an error fails the
        running trial (stopped)."""
        self.open()
        try:
            with stopping_politely():
                while self.step():
                    pass
        except BaseException as caught:
            self.stopped(caught)
        return self.result()

    def open(self) -> None:
        """Open (or make) the study, check what it is about (check_identity) and seed it if new."""
        self.study = optuna.create_study(
            storage=make_storage(self.storage, heartbeat=None, patience=self.patience), study_name=self.name,
            directions=self.directions, sampler=self.sampler.make(optuna, derive_seed(self.name, self.seed, "start")),
            load_if_exists=True)
        check_identity(self.study, self.identity)
        if not self.look():  # seed only a new study; a resumed one already has them
            for params in self.seeds:
                self.study.enqueue_trial(params, skip_if_exists=True)

    def look(self) -> list:
        """The study's trials, after failing the RUNNING ones whose worker is gone."""
        trials = self.study.get_trials(deepcopy=False)
        now, failed = time.time(), False
        for t in trials:
            if t.state == TrialState.RUNNING and is_stale(t, self.grace, now):
                try:
                    self.study.tell(t.number, state=TrialState.FAIL)
                    self.stale.append(t.number)
                    failed = True
                except StorageUnavailable:
                    raise
                except (ValueError, RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
                    pass  # another worker failed it first
        return self.study.get_trials(deepcopy=False) if failed else trials

    def step(self) -> bool:
        """One round: report progress, then run one trial; False once this worker is done (the study
        has its n_trials, or every valid plan has run)."""
        trials = self.look()
        done = _complete(trials)
        if self.on_trial:
            self.on_trial(min(len(done), self.n_trials), self.n_trials)
        if len(done) >= self.n_trials:
            return False
        if len(done) + sum(t.state == TrialState.RUNNING for t in trials) >= self.n_trials:
            time.sleep(self.poll)  # the trials in flight may fill the study: see how they end
            return True
        if self.repeats >= MAX_REPEATS and self.rng is not None and not self.enqueue_unseen(trials):
            return False  # every valid plan has been run
        self.current = self.ask()
        outcome = self.run_trial(self.current)
        self.current = None
        if outcome == "full":
            return False
        self.repeats = self.repeats + 1 if outcome in ("duplicate", "invalid") else 0
        return True

    def enqueue_unseen(self, trials) -> bool:
        """The sampler keeps proposing held plans (it has converged, or the space is small): enqueue
        one plan nobody has run yet, drawn at random, to keep the study moving; False when there is
        none left."""
        held = {_plan_of(t) for t in trials if t.state in (TrialState.COMPLETE, TrialState.RUNNING,
                                                             TrialState.WAITING)}
        held |= {self.queued_plan(t) for t in trials if t.state == TrialState.WAITING}
        params = self.space.unseen(held, self.rng)
        if params is None:
            return False
        self.study.enqueue_trial(params)
        self.repeats = 0
        return True

    def queued_plan(self, trial) -> str | None:
        """The plan of a WAITING (enqueued) trial."""
        try:
            return self.space.plan_of_params(trial.system_attrs.get("fixed_params", {})).to_string()
        except PlanError:
            return None

    def ask(self):
        """A new trial, RUNNING; the first one's number seeds this worker's sampler and draws."""
        with claiming(self.storage):  # on SQLite two workers could otherwise pop one enqueued trial
            trial = self.study.ask()
        if self.worker_seed is None:  # the first trial's number is this worker's identity in the study
            self.worker_seed = derive_seed(self.name, self.seed, trial.number)
            self.study.sampler = self.sampler.make(optuna, self.worker_seed)
            self.rng = random.Random(self.worker_seed)
        return trial

    def turn(self, number: int, plan: str):
        """Wait until trial `number` may run plan `plan`: ("run", None), ("duplicate", the trial
        that holds the plan) or ("full", None) once the study has its n_trials."""
        while True:
            trials = self.look()
            earlier = [t for t in trials if t.number < number and t.state == TrialState.RUNNING]
            if not any(_plan_of(t) is None for t in earlier):  # every earlier trial has said its plan
                done = _complete(trials)
                holder = next((t for t in done + earlier if _plan_of(t) == plan), None)
                if holder is not None:
                    return "duplicate", holder
                if len(done) >= self.n_trials:
                    return "full", None
                if len(done) + len(earlier) < self.n_trials:
                    return "run", None
            time.sleep(self.poll)

    def run_trial(self, trial) -> str:
        """Propose the trial's plan, wait for its turn, evaluate it and tell the study: 'complete',
        'invalid' (pruned), 'duplicate' (pruned, the holder's values copied) or 'full' (failed)."""
        beat = None
        try:
            beat = Heartbeat(trial, self.heartbeat)
            trial.set_user_attr("sampler_seed", self.worker_seed)
            try:
                plan = self.space.propose(trial)
            except PlanError as error:
                trial.set_user_attr("plan", "")
                trial.set_user_attr("invalid", str(error))
                beat.stop()
                self.study.tell(trial, state=TrialState.PRUNED)
                return "invalid"
            trial.set_user_attr("plan", plan.to_string())
            trial.set_user_attr("cost", plan.cost)
            verdict, holder = self.turn(trial.number, plan.to_string())  # the heartbeat goes on while waiting
            if verdict == "duplicate":
                trial.set_user_attr("duplicate_of", holder.number)
                if holder.values is not None:
                    trial.set_user_attr("copied_values", list(holder.values))
                    if not self.multi_objective:  # a pruned trial's value is its last report
                        trial.report(holder.values[0], 0)
                beat.stop()
                self.study.tell(trial, state=TrialState.PRUNED)
                return verdict
            if verdict == "full":
                trial.set_user_attr("not_run", f"the study had its {self.n_trials} finished trials")
                beat.stop()
                self.study.tell(trial, state=TrialState.FAIL)
                return verdict
            values = self.evaluate(plan)
            beat.stop()
            self.study.tell(trial, values)  # the storage away: told once it is back (patience)
            return "complete"
        except BaseException as error:
            if beat is not None:  # the caller fails the trial
                beat.stop(wait=1.0 if not isinstance(error, Exception) else None)
            raise

    def fail(self, trial, error: BaseException) -> bool:
        """Leave no RUNNING trial behind: FAIL it (True), so that the study asks its plan again.
        A worker stopping, or one whose storage is gone, tries once: a trial it could not fail is
        failed by the next worker's staleness check (layerplan.search.workers)."""
        hurry = not isinstance(error, Exception) or isinstance(error, StorageUnavailable)
        with single_attempt() if hurry else nullcontext():
            try:
                self.study.tell(trial, state=TrialState.FAIL)
                return True
            except Exception:  # told already (a signal right after the tell), or the storage is away
                return False

    def stopped(self, caught: BaseException) -> None:
        """A stop or an error while running: fail the running trial, say so on a stop, raise again."""
        error = stop_within(caught) or caught  # a stop a library turned into its own error is a stop
        if self.current is not None:
            failed = self.fail(self.current, error)
            if not isinstance(error, Exception):
                why = getattr(error, "signal_name", "SIGINT" if isinstance(error, KeyboardInterrupt) else "exit")
                print(f"stopped ({why}): trial {self.current.number} "
                      + ("marked failed; the study will ask its plan again" if failed else
                         "not marked failed (the storage did not answer); the next worker fails it"),
                      file=sys.stderr, flush=True)
        if error is caught:
            raise caught
        raise error from None

    def result(self) -> StudyResult:
        """The study summarised (summarise), with the stale trials this worker failed."""
        result = summarise(self.study, self.objective, self.directions)
        result.stale_failed = self.stale
        return result


def check_identity(study, identity: dict[str, Any]) -> None:
    """Keep `identity` in the study's user attrs (a new study, or one made before studies kept it,
    whose directions still match) or refuse, naming each difference, a study made for another."""
    stored = study.user_attrs
    directions = [d.name.lower() for d in study.directions]
    if directions != identity["directions"] and "directions" not in stored:
        stored = {**stored, "directions": directions}
    differ = [f"{key} {stored[key]!r}, not {value!r}" for key, value in identity.items()
              if key in stored and stored[key] != value]
    if differ:
        raise ValueError(f"study '{study.study_name}' in this storage was made for {'; '.join(differ)}: its values "
                         "would not compare; give another --study name (or --storage), or the same settings")
    for key, value in identity.items():
        if key not in stored:
            study.set_user_attr(key, value)


def summarise(study, objective: str, directions: list[str]) -> StudyResult:
    from optuna.trial import TrialState

    def record(t) -> TrialRecord:
        return TrialRecord(t.number, t.user_attrs.get("plan", ""), list(t.values or []),
                           t.user_attrs.get("cost", float("nan")), t.state.name)

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    trials = [record(t) for t in study.get_trials(deepcopy=False)]
    if len(directions) == 1:
        best = study.best_trial if complete else None
        return StudyResult(study.study_name, objective, directions, best.user_attrs["plan"] if best else "full",
                           best.value if best else None, trials)
    pareto = [record(t) for t in study.best_trials]
    # a single answer from the front: the best objective among plans at most 80% of the cost
    sign = 1 if directions[0] == "minimize" else -1
    cheap = [p for p in pareto if p.values[1] <= 0.8] or pareto
    pick = min(cheap, key=lambda p: sign * p.values[0]) if cheap else None
    return StudyResult(study.study_name, objective, directions, pick.plan if pick else "full",
                       pick.values[0] if pick else None, trials, pareto)
