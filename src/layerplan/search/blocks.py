"""Frankenmerges by block repetition: scan every contiguous block i..j repeated after itself
(`0..j, i..j, j+1..N-1`), scored against the base model on measures that say "better"
(measures.py), and an Optuna study over such plans (which block, how often, the residual
scale of the repeated passes, optionally the repeated layers from a second model).

Every candidate with block end j runs the base model's steps 0..j first, so each measure keeps
the base model's residual stream before every step (one pass per input batch) and a candidate
runs only its tail: the repeated block and the layers after it.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan, PlanError, Step
from layerplan.search.bayes import StudyResult, StudySpace, optimise
from layerplan.search.measure_registry import MEASURES
from layerplan.search.measures import Score, bootstrap, is_better, point_value


def repeat_plan(model: LoadedModel, start: int, end: int, repeats: int = 1, scale: float = 1.0,
                source: str = "") -> LayerPlan:
    """Layers 0..end, then start..end `repeats` more times (at residual `scale`, from model
    `source`: "" is the model itself), then end+1..N-1."""
    n = model.num_layers
    if not 0 <= start <= end < n:
        raise PlanError(f"block {start}-{end} is not inside {model.name}'s layers 0–{n - 1} (start <= end)")
    if repeats < 1:
        raise PlanError(f"a block repeats at least once, got {repeats}")
    repeated = [Step(layer, scale=scale, model=source) for layer in range(start, end + 1)] * repeats
    plan = LayerPlan(tuple(Step(i) for i in range(end + 1)) + tuple(repeated) + tuple(Step(i) for i in range(end + 1, n)),
                     n, model_name=model.name)
    model.check_plan(plan)
    return plan


def parse_range(text: str | None, num_layers: int) -> tuple[int, int]:
    """--range "A-B" (inclusive layers; blocks lie inside it); None: every layer."""
    if text is None:
        return 0, num_layers - 1
    first, sep, last = text.partition("-")
    if not (sep and re.fullmatch(r"\d{1,9}", first.strip()) and re.fullmatch(r"\d{1,9}", last.strip())):
        raise PlanError(f"cannot read --range '{text}': expected A-B, inclusive layers like 4-25")
    low, high = int(first), int(last)
    if not 0 <= low <= high < num_layers:
        raise PlanError(f"--range {text} is outside layers 0–{num_layers - 1} (or A > B)")
    return low, high


def parse_repeats(text: str | int) -> list[int]:
    """--repeats "1", "2" or "1,2": how many extra passes of each block to scan (each its own row
    and heatmap)."""
    counts = sorted({int(part) for part in str(text).split(",") if re.fullmatch(r"\d{1,9}", part.strip())})
    if not counts or len(counts) != len([part for part in str(text).split(",") if part.strip()]) or counts[0] < 1:
        raise PlanError(f"cannot read --repeats '{text}': expected counts of at least 1 separated by commas, like 1,2")
    return counts


def parse_scales(text: str) -> tuple[float, float]:
    """--scales "0.5-1.0": the range of residual scales a merge study gives the repeated passes
    (low <= high, finite, >= 0); one number fixes the scale."""
    low_text, sep, high_text = str(text).strip().partition("-")
    try:
        low, high = float(low_text), float(high_text if sep else low_text)
    except ValueError:
        raise PlanError(f"cannot read --scales '{text}': expected a number or a range like 0.5-1.0") from None
    if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high):
        raise PlanError(f"--scales {text}: expected finite scales A-B with 0 <= A <= B (the low end first), "
                        "like 0.5-1.0")
    return low, high


def block_candidates(num_layers: int, layer_range: tuple[int, int] | None = None,
                     max_len: int | None = None) -> list[tuple[int, int]]:
    """Every (start, end) block inside the range, at most max_len layers long, by end then start."""
    low, high = layer_range if layer_range is not None else (0, num_layers - 1)
    if max_len is not None and max_len < 1:
        raise PlanError(f"--max-len must be at least 1, got {max_len}")
    longest = max_len or num_layers
    return [(i, j) for j in range(low, high + 1) for i in range(max(low, j - longest + 1), j + 1)]


@dataclass(frozen=True)
class BlockRow:
    start: int
    end: int
    repeats: int
    plan: str
    steps: int
    added_compute: float  # steps / layers − 1
    scores: list[Score]

    def score(self, measure: str) -> Score:
        return next(s for s in self.scores if s.measure == measure)

    @property
    def key(self) -> tuple[int, int, int]:
        return self.start, self.end, self.repeats

    @classmethod
    def from_dict(cls, data: dict) -> BlockRow:
        return cls(**{**data, "scores": [Score(**score) for score in data["scores"]]})


@dataclass
class BlockScanResult:
    model: str
    num_layers: int
    measures: list[str]  # the first ranks the blocks
    base: list[Score]  # the model itself (its change is 0)
    rows: list[BlockRow] = field(default_factory=list)
    repeats: list[int] = field(default_factory=lambda: [1])  # the repeat counts scanned (rows for each)
    seconds: float = 0.0
    reuse: bool = True
    resumed: int = 0  # rows taken from an interrupted scan, not scored again

    def to_dict(self) -> dict:
        return asdict(self)

    def ranked(self, measure: str | None = None) -> list[BlockRow]:
        """Rows, best change on `measure` (default: the first) first."""
        measure = measure or self.measures[0]
        sign = 1.0 if MEASURES[measure].direction == "minimize" else -1.0
        return sorted(self.rows, key=lambda row: sign * row.score(measure).change)

    def best(self, measure: str | None = None) -> BlockRow:
        return self.ranked(measure)[0]

    def base_score(self, measure: str) -> Score:
        return next(s for s in self.base if s.measure == measure)

    def table(self, top: int | None = None) -> str:
        head = f"{'block':<8} {'steps':>5}" + "".join(f" {name[:12]:>12} {'change [95%]':>24}" for name in self.measures)
        lines = [head]
        base = "  ".join(f"{s.measure} {s.value:.4g} [{s.low:.4g}, {s.high:.4g}]" for s in self.base)
        lines.append(f"{'base':<8} {self.num_layers:>5} {base}")
        for row in self.ranked()[:top]:
            cells = "".join(f" {s.value:>12.4g} {f'{s.change:+.4g} [{s.change_low:+.3g}, {s.change_high:+.3g}]':>24}"
                            for s in row.scores)
            block = f"{row.start}-{row.end}" + (f"x{row.repeats}" if len(self.repeats) > 1 else "")
            lines.append(f"{block:>8} {row.steps:>5}{cells}")
        return "\n".join(lines)

    def better(self, measure: str | None = None) -> list[BlockRow]:
        """Blocks whose whole 95% interval of the change on `measure` is on the better side."""
        measure = measure or self.measures[0]
        return [row for row in self.ranked(measure)
                if is_better(measure, row.score(measure).change_low) and is_better(measure, row.score(measure).change_high)]


def block_scan(model: LoadedModel, scorers: dict, blocks: Sequence[tuple[int, int]],
               repeats: int | Sequence[int] = 1, seed: int = 0, on_progress: Callable[[int, int], None] | None = None,
               workers: int = 1, done: Sequence[BlockRow] = (),
               on_block: Callable[[list[BlockRow]], None] | None = None) -> BlockScanResult:
    """Score each block repeated `repeats` times (a count, or several: a row for each) on every
    measure (scorers from measures.build_scorers, the first ranks), against the model itself.
    A block's counts run in turn, each resuming where the one before it left its repeats (the
    block repeated twice runs only its second repeat and the layers after it).

    done: rows an interrupted scan with the same model, measures and inputs already scored;
    blocks they cover are not scored again (a row's scores do not depend on the rows scored
    before it). on_block(rows): each newly scored block's rows, to keep them (for example in a
    file, to resume from). The rows come out in block order whatever was resumed.

    workers > 1: that many candidates at once, each on one thread (torch's thread count is 1
    during the scan and restored after). The candidates are independent, so this scales better
    than splitting each candidate's small products across threads; every score is computed by
    the same operations as with one worker."""
    if not blocks:
        raise PlanError("no block to scan: the range and --max-len leave none")
    if not scorers:
        raise ValueError("give at least one measure")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    start_time = time.perf_counter()
    base_plan = model.plan()
    base_units = {name: scorer.units(base_plan) for name, scorer in scorers.items()}
    base = [bootstrap(name, units, units, scorers[name].summary, seed=seed) for name, units in base_units.items()]
    reuse = all(scorer.reuse for scorer in scorers.values())
    counts = sorted(set([repeats] if isinstance(repeats, int) else repeats))
    result = BlockScanResult(model.name, model.num_layers, list(scorers), base, repeats=counts, reuse=reuse)

    def rows_of(block: tuple[int, int]) -> list[BlockRow]:
        start, end = block
        rows = []
        for count in counts:
            plan = repeat_plan(model, start, end, count)
            # the next count's plan starts with this one's steps up to the end of its repeats
            keep = end + 1 + count * (end - start + 1) if count != counts[-1] else None
            scores = [bootstrap(name, scorer.units(plan, keep), base_units[name], scorer.summary, seed=seed)
                      for name, scorer in scorers.items()]
            rows.append(BlockRow(start, end, count, plan.to_string(), len(plan.steps),
                                 len(plan.steps) / model.num_layers - 1.0, scores))
        return rows

    kept = {row.key: row for row in done}
    pending = [block for block in blocks if any((*block, count) not in kept for count in counts)]
    result.rows = [kept[(*block, count)] for block in blocks if block not in pending for count in counts]
    result.resumed = len(result.rows)
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="block-scan") if workers > 1 and pending else None
    try:
        if pool is not None:
            torch.set_num_threads(1)
        if on_progress and result.rows:
            on_progress(len(result.rows), len(blocks) * len(counts))
        for rows in pool.map(rows_of, pending) if pool is not None else map(rows_of, pending):
            result.rows.extend(rows)
            if on_block:
                on_block(rows)
            if on_progress:
                on_progress(len(result.rows), len(blocks) * len(counts))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
            torch.set_num_threads(threads)
    order = {block: i for i, block in enumerate(blocks)}
    result.rows.sort(key=lambda row: (order[(row.start, row.end)], row.repeats))
    result.seconds = time.perf_counter() - start_time
    return result


# ----- the study ------------------------------------------------------------------------------
@dataclass(frozen=True)
class MergeSpace:
    """What a merge study may choose: a block inside `layer_range` of at most `max_len` layers,
    repeated 1..max_repeats times, its repeated passes at a residual scale in `scales` (steps of
    SCALE_STEP), taken from one of `sources` ("" the model itself, "b" an attached second model)."""

    layer_range: tuple[int, int]
    max_len: int
    max_repeats: int = 2
    scales: tuple[float, float] = (0.5, 1.0)
    sources: tuple[str, ...] = ("",)

    SCALE_STEP = 0.05

    def plan(self, model: LoadedModel, trial) -> LayerPlan:
        """The plan of an Optuna trial, suggesting its parameters (only those with a choice)."""
        low, high = self.layer_range
        params = {"start": trial.suggest_int("start", low, high), "length": trial.suggest_int("length", 1, self.max_len),
                  "repeats": trial.suggest_int("repeats", 1, self.max_repeats)}
        if self.scales[0] < self.scales[1]:
            params["scale"] = trial.suggest_float("scale", *self.scales, step=self.SCALE_STEP)
        if len(self.sources) > 1:
            params["source"] = trial.suggest_categorical("source", list(self.sources))
        return self.plan_of_params(model, params)

    def plan_of_params(self, model: LoadedModel, params: dict) -> LayerPlan:
        """The plan of trial parameters (PlanError where one with a choice is missing)."""
        missing = [key for key in ("start", "length", "repeats") if key not in params]
        if self.scales[0] < self.scales[1] and "scale" not in params:
            missing.append("scale")
        if missing:
            raise PlanError(f"merge parameters without {', '.join(missing)}")
        start = params["start"]
        end = min(start + params["length"] - 1, self.layer_range[1])
        return repeat_plan(model, start, end, params["repeats"], round(params.get("scale", self.scales[0]), 4),
                           params.get("source", self.sources[0]))

    def seed(self, start: int, end: int, repeats: int, scale: float = 1.0, source: str = "") -> dict:
        """The trial parameters of block start..end repeated `repeats` times (a block scan's row),
        as a study's first trials take them: only the parameters with a choice in this space."""
        params = {"start": start, "length": end - start + 1, "repeats": repeats}
        if self.scales[0] < self.scales[1]:
            params["scale"] = scale
        if len(self.sources) > 1:
            params["source"] = source
        return params

    def unseen(self, model: LoadedModel, held: set[str], rng: random.Random) -> dict | None:
        """Parameters of a plan of the space whose string is not in `held` (None: every one is):
        random draws first, then the whole space in order."""
        low, high = self.layer_range
        axes = {"start": range(low, high + 1), "length": range(1, self.max_len + 1),
                "repeats": range(1, self.max_repeats + 1)}
        if self.scales[0] < self.scales[1]:
            count = int(round((self.scales[1] - self.scales[0]) / self.SCALE_STEP)) + 1
            axes["scale"] = [round(self.scales[0] + k * self.SCALE_STEP, 4) for k in range(count)]
        if len(self.sources) > 1:
            axes["source"] = list(self.sources)
        draws = (dict(zip(axes, (rng.choice(list(axis)) for axis in axes.values()))) for _ in range(256))
        every = (dict(zip(axes, values)) for values in itertools.product(*axes.values()))
        for params in itertools.chain(draws, every):
            try:
                if self.plan_of_params(model, params).to_string() not in held:
                    return params
            except PlanError:
                continue
        return None

    def study_space(self, model: LoadedModel) -> StudySpace:
        return StudySpace(propose=lambda trial: self.plan(model, trial),
                          plan_of_params=lambda params: self.plan_of_params(model, params),
                          unseen=lambda held, rng: self.unseen(model, held, rng))


def merge_study(model: LoadedModel, scorer, measure: str, space: MergeSpace, n_trials: int,
                storage: str | None = None, study_name: str | None = None, sampler: str = "tpe",
                seed: int | None = 0, seeds: Sequence[dict] = (), on_trial: Callable[[int, int], None] | None = None,
                heartbeat: float = 10.0, grace: float = 60.0, poll: float = 0.2) -> StudyResult:
    """An Optuna study over frankenmerge plans optimising `measure` (its direction) with one
    scorer, on the skip search's machinery (bayes.optimise): shared storage, several workers
    that never run one plan twice, resumption, stale trials of dead workers failed. `seeds`:
    trial parameters enqueued first in a new study (e.g. the block scan's best)."""
    return optimise(space.study_space(model), lambda plan: point_value(scorer, plan), measure,
                    [MEASURES[measure].direction], n_trials, storage, study_name or f"{model.name}-merge-{measure}",
                    sampler, list(seeds), seed, on_trial, heartbeat, grace, poll,
                    identity={"model": model.name})
