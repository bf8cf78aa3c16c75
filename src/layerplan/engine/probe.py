"""The hardware probe: what a k-token pass costs on this machine, per dtype and engine.

Speculative decoding pays only when verifying k tokens costs little more than one decoding step,
and whether it does depends on the CPU more than on anything else (a bf16 matrix product on 8 rows
costs one row's time with native bf16 instructions, eight rows' without). The probe times a pass
over k = 1..16 new tokens after a short cached context, per dtype and engine, and caches the
result per machine (CPU model and flags, threads, the native kernels; an eager row its torch build)
and model (engine/probe_rows.py: the rows as data, without torch). bench, tune, serve and
generate take their default dtype from it, and the adaptive draft length starts from its costs.

Between its rounds the probe also measures what the machine allows at that moment: the rate of
the products' own kernels on weights already in cache (all threads, 8 rows, the row's dtype) and
the rate of reading memory. A pass's products need k times a step's arithmetic, and every pass
reads the step's weights, so the cost of a k-token pass cannot fall much below
max(weights ÷ read rate, k × arithmetic ÷ product rate) ÷ the same for k = 1: the table prints that
floor beside each row. (On a shared host both rates move with what the neighbours run: two threads
of bare FMAs on the AVX2 EPYC ran at 107-198 GFLOP/s within a minute.)

A probe run beside busy neighbours can time nonsense: the OpenMP threads spin at barriers while one
of them is descheduled, and a pass takes 10-60x its time (one cached a 1184 ms step where a step is
20 ms, and an 8-token pass at 0.04 of it). So every row is checked before it is trusted
(row_problems), timed again when it fails, and a probe with a row that still fails is not cached;
the other processes' CPU use during the run is noted (MachineLoad), and a probe run on a busy
machine is not cached either. A cached row is checked again when it is used, by one timed step
(recheck_row), and a decode compares its own passes with what the row says they cost (PaceCheck).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from layerplan.engine.choices import PASS_LENGTHS
from layerplan.engine.native import native_available, product_rate, read_rate
from layerplan.engine.probe_rows import (MachineLoad, ProbeResult, ProbeRow, machine_key_of, probe_path_of, read_probe,
                                         row_problems, summary_of)
from layerplan.engine.runner import forward, new_cache
from layerplan.files import cache_dir, write_json_atomic
from layerplan.machine import cpu_info

# k = 1 is timed as plain decoding runs it, one-token passes back to back: STEP_RUN of them, the
# first STEP_WARM left out. A step right after a longer pass (or a pause) runs slower, ~40% after
# a 16-token pass on a Xeon with AVX-512, recovering over ~10 steps: divided by such a step, every
# k-token pass looked cheaper than a verify round is against plain decoding (c(4): 1.16 against
# 1.45 measured in rounds), and drafts that lose were taken for drafts that pay
STEP_RUN, STEP_WARM = 12, 8
CONTEXT = 100  # cached positions before the timed pass (a short chat turn)
READ_BYTES = 128 << 20  # at least this much, and 4x the last-level cache, read for the read rate
RETRIES = 2  # a row that fails its checks is timed again this many times before the probe gives up on it
RECHECK_RATIO = 2.0  # a cached row whose step, timed now, is off by more than this is measured again


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
    hand it a busy or a quiet machine."""

    def __init__(self, busy_seconds: Callable[[], float | None] = _busy_cpu_seconds,
                 own_seconds: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 load_average: Callable[[], float | None] = _load_average, cores: int | None = None,
                 threads: int | None = None) -> None:
        self.busy_seconds, self.own_seconds = busy_seconds, own_seconds
        self.clock, self.load_average = clock, load_average
        self.cores = cores or os.cpu_count() or 1
        self.threads = threads or torch.get_num_threads()
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
        return MachineLoad(self.cores, self.threads, self.load_average(), others)


def torch_build() -> str:
    """torch's version and the CPU capability its kernels run (an eager row's ProbeRow.torch)."""
    return f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()}"


def machine_key() -> str:
    """This process's probe key (probe_rows.py machine_key_of, at torch's thread count)."""
    return machine_key_of(torch.get_num_threads())


def probe_path(folder: Path, model_name: str) -> Path:
    return probe_path_of(folder, model_name, torch.get_num_threads())


def load_probe(folder: Path, model_name: str) -> ProbeResult | None:
    """The cached probe for this machine, model and thread count (probe_rows.py read_probe), its
    eager rows those of this torch build."""
    return read_probe(folder, model_name, torch.get_num_threads(), torch_build())


def time_passes(model, lengths: Sequence[int] = PASS_LENGTHS, repeats: int = 5, context: int = CONTEXT,
                on_progress: Callable[[int, int], None] | None = None,
                between_rounds: Callable[[], None] | None = None) -> dict[int, float]:
    """Median seconds of a pass over k new tokens after `context` cached ones, per k (k = 1: a
    decoding step, timed among one-token passes back to back); the lengths are interleaved so
    that drift in machine speed hits all alike. between_rounds runs after every timed round (the
    machine's rates are sampled there)."""
    plan = model.plan()
    generator = torch.Generator().manual_seed(0)
    vocab = model.hf.config.vocab_size
    longest = max(*lengths, STEP_RUN)
    ids = torch.randint(0, vocab, (1, context + longest), generator=generator, device=model.device)
    cache = new_cache(plan, capacity=context + longest + 1)
    forward(model, ids[:, :context], plan, cache, 0, last_only=True)
    samples: dict[int, list[float]] = {k: [] for k in lengths}
    total = (repeats + 1) * len(lengths)
    for rep in range(repeats + 1):  # the first round warms up
        for i, k in enumerate(lengths):
            cache.crop(context)
            if k == 1:  # a decoding step: one-token passes back to back, as plain decoding runs them
                for j in range(STEP_RUN):
                    start = time.perf_counter()
                    forward(model, ids[:, context + j: context + j + 1], plan, cache, context + j, last_only=True)
                    if rep and j >= STEP_WARM:
                        samples[k].append(time.perf_counter() - start)
            else:
                start = time.perf_counter()
                forward(model, ids[:, context: context + k], plan, cache, context)
                if rep:
                    samples[k].append(time.perf_counter() - start)
            if on_progress:
                on_progress(rep * len(lengths) + i + 1, total)
        if rep and between_rounds:
            between_rounds()
    return {k: statistics.median(v) for k, v in samples.items()}


def streamed_matrix_bytes(model, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes, elements) of the matrices a decoding step reads whole (streamed_matrix_elements), in
    `dtype`; a model run as stored reads its matrices' stored blocks."""
    if getattr(model, "stored", None) is None:
        elements = streamed_matrix_elements(model)
        return elements * torch.finfo(dtype).bits // 8, elements
    table = getattr(model.hf.get_input_embeddings(), "table", None)
    head = model.stored.of(model.hf.get_output_embeddings()) if model.hf.get_output_embeddings() is not None else None
    streamed = {t for t in model.stored.tensors.values() if t is not table or t is head}
    return sum(t.nbytes for t in streamed), sum(t.rows * t.columns for t in streamed)


def streamed_matrix_elements(model) -> int:
    """Elements of the matrices a decoding step reads whole: every 2-D weight but the input
    embedding, whose rows are only looked up (the LM head counts, also when it shares the
    embedding's tensor)."""
    embedding = model.hf.get_input_embeddings().weight
    head = model.hf.get_output_embeddings()
    head_ptr = head.weight.data_ptr() if head is not None else None
    seen, total = set(), 0
    for parameter in model.hf.parameters():
        ptr = parameter.data_ptr()
        if parameter.dim() != 2 or ptr in seen or (ptr == embedding.data_ptr() and ptr != head_ptr):
            continue
        seen.add(ptr)
        total += parameter.numel()
    return total


def _last_level_cache_bytes(path: str = "/sys/devices/system/cpu/cpu0/cache/index3/size") -> int:
    try:
        text = Path(path).read_text().strip().upper()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units and text[:-1].isdigit() else 0


class RateSampler:
    """Samples the machine's product and read rates (native kernels; none where they cannot run)."""

    def __init__(self) -> None:
        self.dtype = torch.float32
        self.buffer = (torch.ones(max(READ_BYTES, 4 * _last_level_cache_bytes()), dtype=torch.uint8)
                       if native_available() is None else None)
        self.products: list[float] = []
        self.read: list[float] = []

    def __call__(self) -> None:
        if self.buffer is not None:
            self.products.append(product_rate(self.dtype))
            self.read.append(read_rate(self.buffer))

    def best(self) -> tuple[float | None, float | None]:
        """(GFLOP/s, GB/s): the best of the samples since the last call (a floor must not be
        raised by a moment the neighbours took the cores), then starts afresh."""
        products, read = self.products, self.read
        self.products, self.read = [], []
        return (max(products) if products else None, max(read) if read else None)


def measure_row(model, engine: str, dtype: str, lengths: Sequence[int] = PASS_LENGTHS, repeats: int = 5,
                sampler: RateSampler | None = None, retries: int = RETRIES,
                on_progress: Callable[[int, int], None] | None = None, on_note: Callable[[str], None] | None = None,
                time_row: Callable[..., dict[int, float]] = time_passes) -> tuple[ProbeRow, list[str]]:
    """The model's row, timed by time_row (time_passes' signature) and timed again, up to `retries`
    more times, while it fails its checks. Returns the row and its last timing's problems (empty:
    it passed). sampler: the machine's rates between the rounds, for a model on the CPU (a GPU
    row gets no floor from the CPU's rates)."""
    if sampler is not None and (torch.device(model.device).type != "cpu" or dtype.startswith("stored")):
        sampler = None  # the sampled rates are the dense dtypes' products: not a floor for block formats
    weights_dtype = precision_dtype(dtype)
    if sampler is not None:
        sampler.dtype = weights_dtype
        sampler.best()  # samples of an earlier row are not this one's
    weight_bytes, elements = streamed_matrix_bytes(model, weights_dtype)
    for attempt in range(retries + 1):
        times = time_row(model, lengths, repeats, on_progress=on_progress, between_rounds=sampler)
        step = times[min(times)]
        products, read = sampler.best() if sampler is not None else (None, None)
        row = ProbeRow(engine, dtype, step * 1000, {k: t / step for k, t in sorted(times.items())}, products, read,
                       weight_bytes, 2.0 * elements, torch_build() if engine != "native" else None)
        problems = row_problems(row)
        if not problems:
            return row, []
        if attempt < retries and on_note:
            on_note(f"{summary_of(row, problems)}: timing it again ({retries - attempt} left)")
    return row, problems


def probe(load: Callable[[str, str], object], model_name: str, dtypes: Sequence[str], engines: Sequence[str],
          lengths: Sequence[int] = PASS_LENGTHS, repeats: int = 5,
          on_progress: Callable[[str, int, int], None] | None = None, on_note: Callable[[str], None] | None = None,
          retries: int = RETRIES, time_row: Callable[..., dict[int, float]] = time_passes,
          sampler: RateSampler | None = None, load_meter: LoadMeter | None = None) -> ProbeResult:
    """load(dtype, engine) -> LoadedModel; an engine that cannot run here is left out. Each row is
    checked and timed again while it fails (measure_row); one that still fails is kept, for the
    table, and named in the result's problems, which keep the probe out of the cache (save_probe),
    as does a busy machine: contention slows the rates that the floor is made of as well, so a
    row timed beside busy neighbours can pass its checks (a 577 ms step over a 242 ms floor).
    on_note: what the probe does about a failed row, one line each. time_row, sampler and
    load_meter time the passes, the machine's rates and the others' CPU use (defaults: this machine)."""
    result = ProbeResult(machine_key(), cpu_info().line(), model_name)
    meter = (load_meter or LoadMeter()).start()
    sampler = sampler or RateSampler()
    for dtype in dtypes:
        for engine in engines:
            model = load(dtype, engine)
            if model is None:
                continue
            label = f"{engine} {dtype}"
            row, problems = measure_row(
                model, engine, dtype, lengths, repeats, sampler, retries,
                on_progress=(lambda d, t, label=label: on_progress(label, d, t)) if on_progress else None,
                on_note=on_note, time_row=time_row)
            result.rows.append(row)
            if problems:
                result.problems.append(summary_of(row, problems))
    result.load = meter.stop()
    if result.load.busy:
        result.problems.append(f"the machine was busy ({result.load.summary()}; this process runs "
                               f"{result.load.threads} threads)")
    return result


def save_probe(result: ProbeResult, folder: Path) -> Path | None:
    """Caches the probe; None, and nothing written, when it cannot be trusted (a row that fails its
    checks, a busy machine: result.problems): its timings would steer every later --dtype auto and
    draft length on this machine."""
    if result.problems or any(row_problems(row) for row in result.rows):
        return None
    path = probe_path(folder, result.model)
    write_json_atomic(path, result.to_dict())
    return path


def default_dtype(folder: Path, model_name: str, engine: str, native_bf16: bool) -> str:
    """The dtype that decodes fastest here: the cached probe's answer for this machine, model and
    engine when there is one; otherwise bf16 where bf16 weights are read at full speed (the native
    kernels, or a CPU with native bf16 instructions), else float32."""
    cached = load_probe(folder, model_name)
    measured = cached.fastest_dtype(engine) if cached is not None else None
    if measured is not None:
        return measured
    return "bfloat16" if native_bf16 else "float32"


def pass_costs(folder: Path, model_name: str, engine: str, dtype: str) -> dict[int, float]:
    """k -> cost of a k-token pass relative to one step, from the cached probe (empty if none)."""
    cached = load_probe(folder, model_name)
    row = cached.row(engine, dtype) if cached is not None else None
    return dict(row.relative) if row is not None else {}


def model_engine_dtype(model) -> tuple[str, str]:
    """The probe row's key of a loaded model as it runs now: its engine and its precision (a dtype,
    or "stored" / "stored-fast" for a GGUF's blocks: their passes cost what the blocks' kernels
    cost, not what the dense dtype's do)."""
    return "native" if model.native is not None else "eager", model.precision


def precision_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a probe row's precision: a stored GGUF's activations and products are
    float32."""
    return torch.float32 if precision.startswith("stored") else getattr(torch, precision)


def model_pass_costs(model) -> dict[int, float]:
    """pass_costs for a loaded model as it runs now (its engine and dtype), from the default cache,
    as cached: a caller that decodes for long checks the row first (checked_model_row) and hands
    it to the decode instead."""
    return pass_costs(cache_dir(), model.name, *model_engine_dtype(model))


def step_seconds(model, repeats: int = 3) -> float:
    """One decoding step after CONTEXT cached tokens, as the probe times it (a warm-up step, then
    the median of `repeats`): the cheap check of a cached row."""
    return time_passes(model, (1,), repeats)[1]


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


def checked_model_row(model, folder: Path, time_step: Callable[[], float] | None = None,
                      remeasure: Callable[[], ProbeRow | None] | None = None,
                      on_note: Callable[[str], None] | None = None) -> ProbeRow | None:
    """The cached probe row for the model as it runs now (None: none cached), checked by one timed
    step (recheck_row); a row measured again replaces the cached one. time_step and remeasure
    default to timing this model (step_seconds, measure_row)."""
    engine, dtype = model_engine_dtype(model)
    cached = load_probe(folder, model.name)
    row = cached.row(engine, dtype) if cached is not None else None
    if row is None:
        return None

    def remeasure_model() -> ProbeRow | None:
        meter = LoadMeter().start()
        fresh, problems = measure_row(model, engine, dtype, sorted(row.relative), sampler=RateSampler(),
                                      on_note=on_note)
        return None if problems or meter.stop().busy else fresh

    checked = recheck_row(row, time_step or (lambda: step_seconds(model)), remeasure or remeasure_model, on_note)
    if checked is not row:
        cached.rows = [checked if r is row else r for r in cached.rows]
        save_probe(cached, folder)
    return checked


