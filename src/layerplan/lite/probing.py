"""`layerplan probe` on the light front end: a GGUF's rows (the native engine in each stored
arithmetic) timed over the LiteModel's own passes as engine/probing.py times any model's, checked,
cached under the key the torch front end reads, and printed as app/cli/measuring.py
run_probe_command prints them (tests/test_lite_cli.py runs both).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from layerplan.engine.choices import STORED_ARITHMETIC
from layerplan.engine.kernel_library import choose_isa
from layerplan.engine.probe_rows import ProbeRow, probe_path_of, read_probe
from layerplan.engine.probing import (CONTEXT, STEP_REPEATS, cache_line, checked_cached_row, ids_needed,
                                      loading_line, measure_row_by, probe_report, probe_rows_by, save_probe_of,
                                      timed_passes, trusted_row)
from layerplan.files import cache_dir
from layerplan.lite.cli import ENDINGS, ended_by
from layerplan.lite.model import LiteModel, model_name_of
from layerplan.lite.research_request import LiteProbeRequest
from layerplan.machine import kernels_cpu_info, physical_cores
from layerplan.models.gguf_place import gguf_of


class LiteTimedPasses:
    """engine/probing.py's TimedPasses of a LiteModel: its full plan's passes over random ids
    (seed 0) in a cache of its own."""

    def __init__(self, model: LiteModel, count: int) -> None:
        self.model = model
        rows = min(model.vocab_size, model.embedding.rows)
        self.ids = np.random.default_rng(0).integers(0, rows, count)
        self.cache = model.new_cache(model.plan(), capacity=count + 1)

    def prefill(self, count: int) -> None:
        self.model.logits(self.ids[:count], self.cache, 0)

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def run(self, position: int, count: int) -> None:
        self.model.logits(self.ids[position: position + count], self.cache, position, last_only=count == 1)


def streamed_bytes(model: LiteModel) -> tuple[int, int]:
    """(bytes, elements) of the stored matrices a decoding step reads whole: every one but the
    input embedding, whose rows are only looked up, unless it is the LM head too (engine/probe.py
    streamed_matrix_bytes, for the torch front end's model of the same file)."""
    kernels = model.kernels
    embedding = model.spec.name(model.spec.embed, "weight")
    head = f"{kernels.head_name}.weight"
    streamed = [t for name, t in kernels.tensors.items() if name != embedding or name == head]
    return sum(t.nbytes for t in streamed), sum(t.rows * t.columns for t in streamed)


def checked_row(model: LiteModel, on_note: Callable[[str], None] | None = None) -> ProbeRow | None:
    """The cached probe row for the model as it runs here (LiteModel.probe_row; None: none cached),
    checked as the torch front end checks its row (engine/probe.py checked_model_row): a step timed
    after CONTEXT cached tokens, and the row timed again where the step is off by more than
    RECHECK_RATIO (engine/probing.py recheck_row); a row timed again replaces the cached one. For
    the commands that time the model anyway (bench), not for a start (generate)."""
    folder = cache_dir()

    def remeasure(row: ProbeRow) -> ProbeRow | None:
        lengths = sorted(row.relative)
        passes = LiteTimedPasses(model, ids_needed(lengths))
        return trusted_row(lambda: measure_row_by(
            lambda progress_of, rounds: timed_passes(passes, lengths, on_progress=progress_of, between_rounds=rounds),
            "native", model.precision, *streamed_bytes(model), on_note=on_note), model.threads)

    return checked_cached_row(read_probe(folder, model.name, model.threads), "native", model.precision,
                              lambda: time_passes(model, (1,), STEP_REPEATS)[1], remeasure, folder, model.threads,
                              on_note)


def time_passes(model: LiteModel, lengths: Sequence[int], repeats: int) -> dict[int, float]:
    """engine/probing.py timed_passes over a LiteModel's passes (engine/probe.py time_passes's
    twin, for the torch front end's model)."""
    return timed_passes(LiteTimedPasses(model, ids_needed(lengths)), lengths, repeats)


def run_probe(request: LiteProbeRequest, on_progress: Callable[[int, int], None] | None = None) -> int | None:
    """Carry out a runnable `layerplan probe` request as run_probe_command would: the cached probe
    where it holds every row asked for (unless --refresh), else those rows timed now and cached
    where they can be trusted; then its table or JSON. on_progress(done, total): each row's
    passes. The exit status, or None where the torch front end is to run it (a cached probe with
    eager rows, which only it can tell stale from current)."""
    threads = request.threads or physical_cores()
    gguf = gguf_of(request.model)
    name = model_name_of(gguf)
    folder = cache_dir()
    if not request.refresh and _has_eager_rows(probe_path_of(folder, name, threads)):
        return None
    try:
        cached = None if request.refresh else read_probe(folder, name, threads)
        wanted = {("native", dtype) for dtype in request.dtypes}
        if cached is None or not wanted <= {(r.engine, r.dtype) for r in cached.rows}:
            lengths = tuple(range(1, request.max_length + 1))

            def measure(dtype: str, engine: str, progress) -> tuple[ProbeRow, list[str]]:
                print(loading_line(request.model, dtype, engine), file=sys.stderr, flush=True)
                model = LiteModel(gguf, STORED_ARITHMETIC[dtype], threads, with_tokenizer=False)
                passes = LiteTimedPasses(model, ids_needed(lengths, CONTEXT))
                return measure_row_by(
                    lambda progress_of, rounds: timed_passes(passes, lengths, request.repeats, CONTEXT,
                                                             progress_of, rounds),
                    engine, dtype, *streamed_bytes(model), on_progress=progress,
                    on_note=lambda line: print(line, file=sys.stderr, flush=True))

            cached = probe_rows_by(measure, name, request.dtypes, ["native"], threads,
                                   kernels_cpu_info(threads, choose_isa().name).line(),
                                   (lambda _label, done, total: on_progress(done, total)) if on_progress else None)
            print(cache_line(cached, save_probe_of(cached, folder, threads)), file=sys.stderr)
    except ENDINGS as error:
        return ended_by(error)
    try:
        print(probe_report(cached, request.as_json), flush=True)
    except BrokenPipeError:
        return 1
    return 0


def _has_eager_rows(path: Path) -> bool:
    """Whether a cached probe's file holds eager rows (timed by torch: whether its build is this
    one's, only the torch front end can say)."""
    try:
        return any(row.get("engine") == "eager" for row in json.loads(path.read_text()).get("rows", []))
    except (OSError, ValueError, AttributeError):
        return False

