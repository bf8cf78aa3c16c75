"""A probe's results as data, without torch: what a k-token pass costs on this machine (ProbeRow,
ProbeResult), the checks a row must pass to be trusted (row_problems), where a probe is cached and
how it is read back (read_probe), and a decode's pace against it (PaceCheck). engine/probe.py
measures them on the torch front end; the light front end (lite/) reads them.

A cached probe's key (machine_key_of) is the CPU model and flags, the thread count, the native
kernels' build and the way passes are timed: what a native row's costs follow. torch's build is a
row's own (ProbeRow.torch, the eager engine's rows: torch's products), so that a reader without
torch takes the native rows, and a torch of another build drops the eager ones.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerplan.engine.kernel_library import kernels_key
from layerplan.machine import read_cpuinfo

BATCH_RATE_SHARE = 0.9  # ProbeRow.fullest_pass: the default batch reaches 90% of the best rate
TIMING = "k=1 as steady consecutive steps"  # in machine_key: a probe timed another way is not reused

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
    torch: str | None = None  # the eager engine's: the torch build that timed it (engine/probe.py torch_build)

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


def summary_of(row: ProbeRow, problems: list[str]) -> str:
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


@dataclass
class ProbeResult:
    machine: str  # the key (machine_key_of): CPU model, flags, threads, kernels
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
                         r.get("product_gflops"), r.get("read_gbs"), r.get("weight_bytes"), r.get("flops_per_token"),
                         r.get("torch"))
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


def machine_key_of(threads: int) -> str:
    """Changes when the CPU, its flags, the thread count, the native kernels or the way passes are
    timed change: a stale probe is not reused."""
    model, flags = read_cpuinfo()
    text = "|".join([str(model), " ".join(sorted(flags or ())), str(threads), kernels_key(), TIMING])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe_path_of(folder: Path, model_name: str, threads: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return folder / "probe" / f"{safe}-{machine_key_of(threads)}.json"


def read_probe(folder: Path, model_name: str, threads: int, torch_build: str | None = None) -> ProbeResult | None:
    """The cached probe for this machine, model and thread count, or None (never measured, or
    measured on another machine or thread count). Rows that fail their checks are left out (a
    probe cached before the checks existed may hold timings taken beside busy neighbours), and
    eager rows of another torch build than `torch_build` (None: every eager row)."""
    path = probe_path_of(folder, model_name, threads)
    try:
        result = ProbeResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if result.machine != machine_key_of(threads):
        return None
    result.rows = [row for row in result.rows if not row_problems(row) and (row.torch is None or row.torch == torch_build)]
    return result


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
