"""The hardware probe: what a k-token pass costs on this machine, per dtype and engine.

Speculative decoding pays only when verifying k tokens costs little more than one decoding step,
and whether it does depends on the CPU more than on anything else (a bf16 matrix product on 8 rows
costs one row's time with native bf16 instructions, eight rows' without). The probe times a pass
over k = 1..16 new tokens after a short cached context, per dtype and engine, and caches the
result per machine (CPU model and flags, torch version, threads) and model. bench, tune, serve and
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

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from layerplan.engine.choices import PASS_LENGTHS
from layerplan.engine.native import kernels_key, native_available, product_rate, read_rate
from layerplan.engine.runner import forward, new_cache
from layerplan.files import cache_dir, write_json_atomic
from layerplan.machine import cpu_info, read_cpuinfo

# k = 1 is timed as plain decoding runs it, one-token passes back to back: STEP_RUN of them, the
# first STEP_WARM left out. A step right after a longer pass (or a pause) runs slower, ~40% after
# a 16-token pass on a Xeon with AVX-512, recovering over ~10 steps: divided by such a step, every
# k-token pass looked cheaper than a verify round is against plain decoding (c(4): 1.16 against
# 1.45 measured in rounds), and drafts that lose were taken for drafts that pay
STEP_RUN, STEP_WARM = 12, 8
BATCH_RATE_SHARE = 0.9  # ProbeRow.fullest_pass: the default batch reaches 90% of the best rate
TIMING = "k=1 as steady consecutive steps"  # in machine_key: a probe timed another way is not reused
CONTEXT = 100  # cached positions before the timed pass (a short chat turn)
READ_BYTES = 128 << 20  # at least this much, and 4x the last-level cache, read for the read rate

# What a row must satisfy to be trusted (row_problems). A k-token pass does a step's work and more,
# so one timed under PASS_AT_LEAST of a step was not timed right; and no more than k steps' work (k
# steps one at a time would do it), so one over PASS_AT_MOST_STEPS x k steps was not either.
PASS_AT_LEAST = 0.9
PASS_AT_MOST_STEPS = 1.25
# Costs rise with k, up to noise: quiet runs on the 2-core EPYC put a pass up to 12% under a shorter
# one (k=16 at 3.45 after k=15 at 3.91), so a pass may come out this much under the dearest shorter one.
SHORTER_PASS_SLACK = 0.2
# The floor's rates are sampled between the rounds, not during the passes: drift can put a step a
# little under it, never far.
STEP_UNDER_FLOOR = 0.9
# How far above its floor a step may be: quiet native steps were 1.2-1.6x it. The floor is timed
# with the native kernels' products, so the eager engine (torch's products: bf16 ran ~5x the floor
# on AVX2) is held to a looser bound.
STEP_OVER_FLOOR = {"native": 3.0}
STEP_OVER_FLOOR_OTHER = 10.0
RETRIES = 2  # a row that fails its checks is timed again this many times before the probe gives up on it
RECHECK_RATIO = 2.0  # a cached row whose step, timed now, is off by more than this is measured again
SLOW_DECODE_RATIO = 3.0  # a decode this much slower than the probe says: the machine is busy
SLOW_DECODE_MIN_PASSES = 4  # fewer passes say nothing (the first ones pay for cold caches)
BUSY_MARGIN = 0.25  # cores: others' mean use beyond the cores this process leaves free that makes a run "busy"


@dataclass
class ProbeRow:
    engine: str
    dtype: str
    step_ms: float  # one decoding step (k = 1), median
    relative: dict[int, float] = field(default_factory=dict)  # k -> cost of a k-token pass / a step
    # what the machine allowed while this row was timed (the best over its rounds; None: not measured)
    product_gflops: float | None = None  # 8-row products on weights in cache, all threads
    read_gbs: float | None = None  # reading memory on all threads
    weight_bytes: int | None = None  # the matrices a step reads (every layer's and the LM head)
    flops_per_token: float | None = None  # 2 x their elements

    def _least_seconds(self, k: int) -> float | None:
        """The least time of a k-token pass by the measured rates: its weights' reads or its
        products, whichever is longer (None when the rates were not measured)."""
        if not (self.product_gflops and self.read_gbs and self.weight_bytes and self.flops_per_token):
            return None
        return max(self.weight_bytes / (self.read_gbs * 1e9), k * self.flops_per_token / (self.product_gflops * 1e9))

    def floor(self, k: int) -> float | None:
        """The least cost of a k-token pass relative to a step that the measured rates allow (only
        the matrix products and the weights' reads counted), or None when they were not measured."""
        least = self._least_seconds(k)
        return None if least is None else least / self._least_seconds(1)

    def step_floor_ms(self) -> float | None:
        """The least ms of a step that the measured rates allow (reads and products only)."""
        least = self._least_seconds(1)
        return None if least is None else 1000 * least

    def fullest_pass(self, share: float = BATCH_RATE_SHARE) -> int:
        """The fewest rows a pass carries at `share` of the most tokens per second this row
        measured (k / cost(k), over its k): a server's default batch (serve --max-batch). The last
        rows before the best add little throughput, and each costs every request in the pass
        its share of the time per token."""
        rates = {k: k / cost for k, cost in self.relative.items() if cost > 0}
        best = max(rates.values())
        return min(k for k, rate in rates.items() if rate >= share * best)

    def cost(self, k: int) -> float:
        """Relative cost of a k-token pass (interpolated past the measured lengths)."""
        if k in self.relative:
            return self.relative[k]
        known = max(self.relative)
        return self.relative[known] * k / known if k > known else 1.0


def row_problems(row: ProbeRow) -> list[str]:
    """What makes the row's timings impossible or implausible (empty: it can be trusted): a pass
    under PASS_AT_LEAST of a step or over PASS_AT_MOST_STEPS x k steps, a pass more than
    SHORTER_PASS_SLACK under a shorter one, a step under its floor or far above it (when the rates
    were measured)."""
    problems = []
    if not (row.step_ms > 0 and math.isfinite(row.step_ms)):
        return [f"step of {row.step_ms} ms"]
    lengths = sorted(row.relative)
    dearest_k, dearest = None, 0.0
    for k in lengths:
        cost = row.relative[k]
        if not math.isfinite(cost):
            problems.append(f"a {k}-token pass at {cost} of a step")
        elif k != lengths[0] and cost < PASS_AT_LEAST:
            problems.append(f"a {k}-token pass at {cost:.2f} of a step (under {PASS_AT_LEAST})")
        elif cost > PASS_AT_MOST_STEPS * k / lengths[0]:
            problems.append(f"a {k}-token pass at {cost:.2f} of a step (over {PASS_AT_MOST_STEPS:g} x {k} steps)")
        elif cost < (1 - SHORTER_PASS_SLACK) * dearest:
            problems.append(f"a {k}-token pass at {cost:.2f} of a step, "
                            f"under the {dearest_k}-token pass's {dearest:.2f}")
        if cost > dearest:
            dearest_k, dearest = k, cost
    floor = row.step_floor_ms()
    if floor is not None:
        over = STEP_OVER_FLOOR.get(row.engine, STEP_OVER_FLOOR_OTHER)
        if row.step_ms < STEP_UNDER_FLOOR * floor:
            problems.append(f"a step of {row.step_ms:.1f} ms, under its floor of {floor:.1f} ms")
        elif row.step_ms > over * floor:
            problems.append(f"a step of {row.step_ms:.1f} ms, {row.step_ms / floor:.0f}x its floor of {floor:.1f} ms "
                            f"(at most {over:g}x)")
    return problems


def _summary(row: ProbeRow, problems: list[str]) -> str:
    more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
    return f"{row.engine} {row.dtype}: " + "; ".join(problems[:2]) + more


@dataclass
class MachineLoad:
    """What else the machine ran while the probe timed its passes."""

    cores: int  # the machine's (what /proc/stat counts)
    threads: int  # this process's compute threads (torch's)
    load_average: float | None  # the 1-minute load average at the end (it counts this process's threads too)
    # the mean number of cores other processes kept busy (and a hypervisor took: steal) during the
    # run; None where /proc/stat cannot be read
    others_cores: float | None

    def others(self) -> float | None:
        """Cores used by the others: measured, else the load average less this process's threads."""
        if self.others_cores is not None:
            return self.others_cores
        return None if self.load_average is None else max(self.load_average - self.threads, 0.0)

    @property
    def busy(self) -> bool:
        """The others needed cores that this process's threads were using: its passes waited."""
        others = self.others()
        return others is not None and others > max(self.cores - self.threads, 0) + BUSY_MARGIN

    def summary(self) -> str:
        others = self.others()
        used = "unknown" if others is None else f"{others:.1f} of {self.cores}"
        return f"other processes kept {used} cores busy" + (
            "" if self.load_average is None else f", load average {self.load_average:.2f}")

    def line(self) -> str:
        others = self.others()
        verdict = ("busy: the timings may be slow and uneven" if self.busy
                   else "quiet" if others is not None else "load unknown")
        return f"machine {verdict} ({self.summary()}; this process runs {self.threads} threads)"


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


@dataclass
class ProbeResult:
    machine: str  # the key: CPU model, flags, torch, threads
    cpu: str  # the CPU line, for people
    model: str
    rows: list[ProbeRow] = field(default_factory=list)
    load: MachineLoad | None = None  # what else ran during the probe (None: not noted, an older probe)
    # why the probe cannot be trusted, one line each: a row that still failed its checks after
    # RETRIES (row_problems), or a busy machine; such a probe is shown but not cached
    problems: list[str] = field(default_factory=list)

    def row(self, engine: str, dtype: str) -> ProbeRow | None:
        return next((r for r in self.rows if r.engine == engine and r.dtype == dtype), None)

    def fastest_dtype(self, engine: str) -> str | None:
        """The dtype with the cheapest step on this engine (None when none was measured)."""
        rows = [r for r in self.rows if r.engine == engine]
        return min(rows, key=lambda r: r.step_ms).dtype if rows else None

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.load is not None:
            data["load"]["busy"] = self.load.busy  # derived, for readers of the JSON
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ProbeResult:
        rows = [ProbeRow(r["engine"], r["dtype"], r["step_ms"], {int(k): v for k, v in r["relative"].items()},
                         r.get("product_gflops"), r.get("read_gbs"), r.get("weight_bytes"), r.get("flops_per_token"))
                for r in data["rows"]]
        load = (MachineLoad(**{k: v for k, v in data["load"].items() if k in MachineLoad.__dataclass_fields__})
                if data.get("load") else None)
        return cls(data["machine"], data["cpu"], data["model"], rows, load, list(data.get("problems", [])))

    def table(self) -> str:
        ks = sorted({k for r in self.rows for k in r.relative})
        w = max([9, *(len(r.dtype) for r in self.rows)])  # (stored-fast, q4_k-fast: wider than the heading)
        head = f"{'engine':<7} {'dtype':<{w}} {'ms/step':>7}  " + " ".join(f"{'k=' + str(k):>5}" for k in ks)
        lines = [head]
        notes = []
        for r in self.rows:
            lines.append(f"{r.engine:<7} {r.dtype:<{w}} {r.step_ms:>7.1f}  " + " ".join(f"{r.relative.get(k, float('nan')):>5.2f}" for k in ks))
            if r.floor(1) is not None:
                lines.append(f"{'':<7} {'floor':<{w}} {r.step_floor_ms():>7.1f}  " + " ".join(f"{r.floor(k):>5.2f}" for k in ks))
                notes.append(f"{r.engine} {r.dtype}: products {r.product_gflops:.0f} GFLOP/s, reads {r.read_gbs:.1f} GB/s")
                flops = r.flops_per_token
        if notes:
            lines.append("floor: what the best rates of products on weights in cache and of memory reads allow, "
                         "sampled between the rounds (not during the passes: where the host's speed drifts, a "
                         "pass can come out under it) ("
                         + "; ".join(notes) + f"; {flops / 1e9:.2f} GFLOP per token)")
        return "\n".join(lines)


def machine_key() -> str:
    """Changes when the CPU, its flags, torch, the thread count, the native kernels or the way
    passes are timed change: a stale probe is not reused."""
    model, flags = read_cpuinfo()
    info = cpu_info()
    text = "|".join([str(model), " ".join(sorted(flags or ())), info.torch, info.torch_capability, str(info.threads),
                     kernels_key(), TIMING])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe_path(folder: Path, model_name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return folder / "probe" / f"{safe}-{machine_key()}.json"


def load_probe(folder: Path, model_name: str) -> ProbeResult | None:
    """The cached probe for this machine and model, or None (never measured, or measured on
    another machine, torch or thread count). Rows that fail their checks are left out: a probe
    cached before the checks existed may hold timings taken beside busy neighbours."""
    path = probe_path(folder, model_name)
    try:
        result = ProbeResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if result.machine != machine_key():
        return None
    result.rows = [row for row in result.rows if not row_problems(row)]
    return result


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
                       weight_bytes, 2.0 * elements)
        problems = row_problems(row)
        if not problems:
            return row, []
        if attempt < retries and on_note:
            on_note(f"{_summary(row, problems)}: timing it again ({retries - attempt} left)")
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
                result.problems.append(_summary(row, problems))
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


class PaceCheck:
    """A decode's passes against what the probe row says they cost here: a decode SLOW_DECODE_RATIO
    times slower is one that the machine's other work slowed down (no row: nothing to compare)."""

    def __init__(self, row: ProbeRow | None) -> None:
        self.row = row
        self.passes, self.seconds, self.expected = 0, 0.0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One target pass over `tokens` new tokens that took `seconds`."""
        if self.row is not None:
            self.passes += 1
            self.seconds += seconds
            self.expected += self.row.step_ms / 1000 * self.row.cost(tokens)

    def note(self) -> str | None:
        """One line when the decode ran SLOW_DECODE_RATIO times slower than the probe says, else None."""
        if self.passes < SLOW_DECODE_MIN_PASSES or self.seconds <= SLOW_DECODE_RATIO * self.expected:
            return None
        return (f"decoding ran {self.seconds / self.expected:.1f}x slower than this machine's probe says "
                f"({self.row.engine} {self.row.dtype}, {1000 * self.expected / self.passes:.1f} ms a pass expected, "
                f"{1000 * self.seconds / self.passes:.1f} ms taken): the machine is busy")
