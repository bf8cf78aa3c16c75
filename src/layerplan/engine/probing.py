"""How a probe is run, without torch: the timing of k-token passes over a model's own passes
(TimedPasses: the torch front end's model, engine/probe.py; a GGUF's on the light front end,
lite/probing.py), a row timed again while it fails its checks, the other processes' CPU use
meanwhile, the cache written only when it can be trusted, and a cached row checked by one timed
step. engine/probe.py's docstring says why each is done so.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from layerplan.engine.probe_rows import (MachineLoad, ProbeResult, ProbeRow, machine_key_of, probe_path_of,
                                         row_problems, summary_of)
from layerplan.files import write_json_atomic

# k = 1 is timed as plain decoding runs it, one-token passes back to back: STEP_RUN of them, the
# first STEP_WARM left out. A step right after a longer pass (or a pause) runs slower, ~40% after
# a 16-token pass on a Xeon with AVX-512, recovering over ~10 steps: divided by such a step, every
# k-token pass looked cheaper than a verify round is against plain decoding (c(4): 1.16 against
# 1.45 measured in rounds), and drafts that lose were taken for drafts that pay
STEP_RUN, STEP_WARM = 12, 8
CONTEXT = 100  # cached positions before the timed pass (a short chat turn)
RETRIES = 2  # a row that fails its checks is timed again this many times before the probe gives up on it
RECHECK_RATIO = 2.0  # a cached row whose step, timed now, is off by more than this is measured again
STEP_REPEATS = 3  # timed steps (after a warm-up) of a cached row's check (recheck_row's time_step)

# time_row(on_progress, between_rounds) -> {k: median seconds of a k-token pass}
TimeRow = Callable[[Callable[[int, int], None] | None, Callable[[], None] | None], dict[int, float]]


class TimedPasses(Protocol):
    """A model's passes as the probe times them, over token ids of its choosing: prefill(count)
    writes the first `count` of them into a fresh cache; crop(length) cuts the cache back;
    run(position, count) passes the `count` ids from `position` on (one: the last logits, as a
    decoding step; more: every row's, as a verify pass)."""

    def prefill(self, count: int) -> None: ...

    def crop(self, length: int) -> None: ...

    def run(self, position: int, count: int) -> None: ...


def timed_passes(passes: TimedPasses, lengths: Sequence[int], repeats: int = 5, context: int = CONTEXT,
                 on_progress: Callable[[int, int], None] | None = None,
                 between_rounds: Callable[[], None] | None = None) -> dict[int, float]:
    """Median seconds of a pass over k new tokens after `context` cached ones, per k (k = 1: a
    decoding step, timed among one-token passes back to back); the lengths are interleaved so
    that drift in machine speed hits all alike. between_rounds runs after every timed round (the
    machine's rates are sampled there). `passes` holds ids for context + max(lengths, STEP_RUN)."""
    passes.prefill(context)
    samples: dict[int, list[float]] = {k: [] for k in lengths}
    total = (repeats + 1) * len(lengths)
    for rep in range(repeats + 1):  # the first round warms up
        for i, k in enumerate(lengths):
            passes.crop(context)
            if k == 1:  # a decoding step: one-token passes back to back, as plain decoding runs them
                for j in range(STEP_RUN):
                    start = time.perf_counter()
                    passes.run(context + j, 1)
                    if rep and j >= STEP_WARM:
                        samples[k].append(time.perf_counter() - start)
            else:
                start = time.perf_counter()
                passes.run(context, k)
                if rep:
                    samples[k].append(time.perf_counter() - start)
            if on_progress:
                on_progress(rep * len(lengths) + i + 1, total)
        if rep and between_rounds:
            between_rounds()
    return {k: statistics.median(v) for k, v in samples.items()}


def ids_needed(lengths: Sequence[int], context: int = CONTEXT) -> int:
    """How many ids a TimedPasses holds for timed_passes over `lengths`."""
    return context + max(*lengths, STEP_RUN)


def _busy_cpu_seconds(path: str = "/proc/stat") -> float | None:
    """Seconds all CPUs spent busy since boot (user, nice, system, irq, softirq, steal), or None."""
    try:
        fields = Path(path).read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError, IndexError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class LoadMeter:
    """Measures the other processes' CPU use between start() and stop(): all CPUs' busy time less
    this process's own (every one of its threads). The readers are parameters so that a test can
    hand it a busy or a quiet machine; threads: this process's compute threads (None: the
    probe's, set by probe_rows_by)."""

    def __init__(self, busy_seconds: Callable[[], float | None] = _busy_cpu_seconds,
                 own_seconds: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 load_average: Callable[[], float | None] = _load_average, cores: int | None = None,
                 threads: int | None = None) -> None:
        self.busy_seconds, self.own_seconds = busy_seconds, own_seconds
        self.clock, self.load_average = clock, load_average
        self.cores = cores or os.cpu_count() or 1
        self.threads = threads
        self.started: tuple[float | None, float, float] | None = None

    def start(self) -> LoadMeter:
        self.started = (self.busy_seconds(), self.own_seconds(), self.clock())
        return self

    def stop(self) -> MachineLoad:
        busy0, own0, clock0 = self.started
        busy1, own1, clock1 = self.busy_seconds(), self.own_seconds(), self.clock()
        others = None
        if busy0 is not None and busy1 is not None and clock1 > clock0:
            others = max((busy1 - busy0) - (own1 - own0), 0.0) / (clock1 - clock0)
        return MachineLoad(self.cores, self.threads or 1, self.load_average(), others)


class Rates(Protocol):
    """The machine's product and read rates, sampled between a row's rounds (engine/probe.py
    RateSampler): called once a round; best() the best since the last call, (GFLOP/s, GB/s)."""

    def __call__(self) -> None: ...

    def best(self) -> tuple[float | None, float | None]: ...


def measure_row_by(time_row: TimeRow, engine: str, dtype: str, weight_bytes: int, elements: int,
                   sampler: Rates | None = None, retries: int = RETRIES, torch_build: str | None = None,
                   on_progress: Callable[[int, int], None] | None = None,
                   on_note: Callable[[str], None] | None = None) -> tuple[ProbeRow, list[str]]:
    """A row timed by time_row and timed again, up to `retries` more times, while it fails its
    checks. Returns the row and its last timing's problems (empty: it passed). weight_bytes,
    elements: the matrices a step reads; sampler: the machine's rates between the rounds, where
    they bound the row (None: no floor); torch_build: an eager row's."""
    if sampler is not None:
        sampler.best()  # samples of an earlier row are not this one's
    for attempt in range(retries + 1):
        times = time_row(on_progress, sampler)
        step = times[min(times)]
        products, read = sampler.best() if sampler is not None else (None, None)
        row = ProbeRow(engine, dtype, step * 1000, {k: t / step for k, t in sorted(times.items())}, products, read,
                       weight_bytes, 2.0 * elements, torch_build)
        problems = row_problems(row)
        if not problems:
            return row, []
        if attempt < retries and on_note:
            on_note(f"{summary_of(row, problems)}: timing it again ({retries - attempt} left)")
    return row, problems


# measure(dtype, engine, on_progress) -> (the row, its problems), or None: that engine does not run it
MeasureRow = Callable[[str, str, Callable[[int, int], None] | None], tuple[ProbeRow, list[str]] | None]


def probe_rows_by(measure: MeasureRow, model_name: str, dtypes: Sequence[str], engines: Sequence[str],
                  threads: int, cpu: str, on_progress: Callable[[str, int, int], None] | None = None,
                  load_meter: LoadMeter | None = None) -> ProbeResult:
    """A probe of every (dtype, engine) that `measure` runs, under this machine's key for
    `threads`; cpu: the CPU line of the process that times it (machine.py). A row that still fails
    its checks is kept, for the table, and named in the result's problems, which keep the probe
    out of the cache (save_probe_of), as does a busy machine: contention slows the rates that the
    floor is made of as well, so a row timed beside busy neighbours can pass its checks (a 577 ms
    step over a 242 ms floor)."""
    result = ProbeResult(machine_key_of(threads), cpu, model_name)
    meter = load_meter or LoadMeter()
    if meter.threads is None:
        meter.threads = threads
    meter.start()
    for dtype in dtypes:
        for engine in engines:
            label = f"{engine} {dtype}"
            measured = measure(dtype, engine,
                               (lambda d, t, label=label: on_progress(label, d, t)) if on_progress else None)
            gc.collect()  # the row's model, before the next one loads (a torch model's modules hold cycles)
            if measured is None:
                continue
            row, problems = measured
            result.rows.append(row)
            if problems:
                result.problems.append(summary_of(row, problems))
    result.load = meter.stop()
    if result.load.busy:
        result.problems.append(f"the machine was busy ({result.load.summary()}; this process runs "
                               f"{result.load.threads} threads)")
    return result


def save_probe_of(result: ProbeResult, folder: Path, threads: int) -> Path | None:
    """Caches the probe (timed at `threads`); None, and nothing written, when it cannot be trusted
    (a row that fails its checks, a busy machine: result.problems): its timings would steer every
    later --dtype auto and draft length on this machine."""
    if result.problems or any(row_problems(row) for row in result.rows):
        return None
    path = probe_path_of(folder, result.model, threads)
    write_json_atomic(path, result.to_dict())
    return path


def recheck_row(row: ProbeRow, time_step: Callable[[], float], remeasure: Callable[[], ProbeRow | None],
                on_note: Callable[[str], None] | None = None) -> ProbeRow:
    """The cached row, when a step timed now (time_step() seconds) is within RECHECK_RATIO of its
    step either way; else the row measured again (remeasure(): a row that passed its checks, or
    None), or the cached row still when the new timings fail their checks: a machine too unsteady
    to time is no evidence against the cache."""
    now_ms = 1000 * time_step()
    if now_ms > 0 and max(now_ms / row.step_ms, row.step_ms / now_ms) <= RECHECK_RATIO:
        return row
    say = on_note or (lambda _: None)
    say(f"probe {row.engine} {row.dtype}: a step took {now_ms:.1f} ms where the cached probe says "
        f"{row.step_ms:.1f} ms: measuring the row again")
    fresh = remeasure()
    if fresh is None:
        say(f"probe {row.engine} {row.dtype}: the new timings failed their checks, or the machine is busy: "
            "the cached row stays")
        return row
    return fresh


def checked_cached_row(cached: ProbeResult | None, engine: str, dtype: str, time_step: Callable[[], float],
                       remeasure: Callable[[ProbeRow], ProbeRow | None], folder: Path, threads: int,
                       on_note: Callable[[str], None] | None = None) -> ProbeRow | None:
    """cached's row for (engine, dtype) (None: none cached), checked by recheck_row: time_step()
    a step timed now, remeasure(row) the row timed again over its pass lengths (None where that
    cannot be trusted: trusted_row); a row timed again replaces the cached one, and the probe is
    saved (timed at `threads`). Either front end's check of its row (engine/probe.py
    checked_model_row, lite/probing.py checked_row)."""
    row = cached.row(engine, dtype) if cached is not None else None
    if row is None:
        return None
    checked = recheck_row(row, time_step, lambda: remeasure(row), on_note)
    if checked is not row:
        cached.rows = [checked if r is row else r for r in cached.rows]
        save_probe_of(cached, folder, threads)
    return checked


def trusted_row(measure: Callable[[], tuple[ProbeRow, list[str]]], threads: int) -> ProbeRow | None:
    """measure()'s row (a row and its problems: measure_row_by's), or None where it failed its
    checks or the other processes kept the machine busy while it was timed (LoadMeter, this
    process's `threads` compute threads)."""
    meter = LoadMeter(threads=threads).start()
    fresh, problems = measure()
    return None if problems or meter.stop().busy else fresh


def loading_line(model: str, dtype: str, engine: str) -> str:
    """What `layerplan probe` says on stderr as it loads the model for a row."""
    return f"loading {model} ({dtype}, engine {engine})…"


def probe_report(result: ProbeResult, as_json: bool) -> str:
    """What `layerplan probe` prints of a probe, on either front end: its JSON, or its CPU line,
    heading and table."""
    if as_json:
        return json.dumps(result.to_dict(), indent=2)
    return "\n".join([result.cpu, f"{result.model}: ms per decoding step, and the cost of a pass over k new tokens "
                                  f"÷ one step (after {CONTEXT} cached tokens)", result.table()])


def cache_line(result: ProbeResult, path: Path | None) -> str:
    """What `layerplan probe` says on stderr of the probe it timed: where it was cached (path), or
    why it was not (None: save_probe_of's)."""
    if path is None:
        return f"warning: probe not cached, its timings cannot be trusted: {'; '.join(result.problems)}"
    return f"cached in {path} ({result.load.line()})"
