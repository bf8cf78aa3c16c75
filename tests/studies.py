"""Workers of a shared Optuna study in forked processes, and checks on what they left in the
storage: shared by the skip search's tests (test_search.py) and the merge study's (test_blocks.py)."""

import gc
import multiprocessing
import signal
import time
from pathlib import Path


def _interruptible(work, *args):
    # Ctrl-C (SIGINT) raises KeyboardInterrupt in the worker, as in a command started from a
    # terminal, even where this test run was started in the background (a shell starts background
    # jobs with SIGINT ignored, and a forked child inherits that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the parent's objects, inherited, are never the child's garbage: a collection that walked them
    # would write to (and so copy) every page of a test process's heap, long enough to miss a
    # deadline such as "a stopped worker fails its trial within a second"
    gc.freeze()
    work(*args)


def fork_worker(work, *args):
    """work(*args) in its own process, forked so that it starts without re-importing torch
    (work must set torch.set_num_threads(1): a forked child must not reuse the parent's pool)."""
    process = multiprocessing.get_context("fork").Process(target=_interruptible, args=(work, *args))
    process.start()
    return process


def run_workers(work, count: int, *args) -> None:
    procs = [fork_worker(work, *args) for _ in range(count)]
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * count


def study_trials(storage_url: str, name: str = "shared") -> list:
    import optuna

    from layerplan.search.bayes import make_storage

    return optuna.load_study(study_name=name, storage=make_storage(storage_url)).trials


def assert_exact_and_distinct(storage_url: str, trials: int, name: str = "shared") -> list:
    """The study holds exactly `trials` finished trials, no plan twice, none left RUNNING."""
    from optuna.trial import TrialState

    found = study_trials(storage_url, name)
    complete = [t for t in found if t.state == TrialState.COMPLETE]
    assert len(complete) == trials
    assert len({t.user_attrs["plan"] for t in complete}) == trials  # no plan evaluated twice
    assert not [t.number for t in found if t.state == TrialState.RUNNING]
    for t in found:  # a repeated proposal carries the values of the trial that holds its plan
        if "duplicate_of" in t.user_attrs and "copied_values" in t.user_attrs:
            holder = found[t.user_attrs["duplicate_of"]]
            assert holder.user_attrs["plan"] == t.user_attrs["plan"]
            assert t.user_attrs["copied_values"] == holder.values
    return found


def reach_marker(worker, marker: Path, seconds: float, what: str) -> None:
    """Wait until the forked worker touches `marker` (it is inside its trial), for at most
    `seconds` or until it dies; assert that it did."""
    deadline = time.monotonic() + seconds
    while not marker.exists() and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), f"the worker never reached its {what} trial"


def kill_mid_trial(work, args: tuple, storage_url: str, marker: Path, name: str = "shared"):
    """Start work(*args) (which touches `marker` inside a trial and then hangs), SIGKILL it there
    (no handler runs: the trial stays RUNNING in `storage_url`) and return that RUNNING trial."""
    from optuna.trial import TrialState

    victim = fork_worker(work, *args)
    reach_marker(victim, marker, 120.0, "hanging")
    victim.kill()
    victim.join()
    killed = [t for t in study_trials(storage_url, name) if t.state == TrialState.RUNNING]
    assert len(killed) == 1
    return killed[0]
