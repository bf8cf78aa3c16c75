"""The hardware probe: what a k-token pass costs on this machine, per dtype and engine.

Speculative decoding pays only when verifying k tokens costs little more than one decoding step,
and whether it does depends on the CPU more than on anything else (a bf16 matrix product on 8 rows
costs one row's time with native bf16 instructions, eight rows' without). The probe times a pass
over k = 1..16 new tokens after a short cached context, per dtype and engine, and caches the
result per machine (CPU model and flags, threads, the native kernels; an eager row its torch build)
and model (engine/probe_rows.py: the rows as data; engine/probing.py: how they are timed, both
without torch, for the light front end's probe too: lite/probing.py). bench, tune, serve and
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

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from layerplan.engine.choices import PASS_LENGTHS
from layerplan.engine.native import native_available, product_rate, read_rate
from layerplan.engine.probe_rows import ProbeResult, ProbeRow, machine_key_of, probe_path_of, read_probe
from layerplan.engine.probing import (CONTEXT, RETRIES, STEP_REPEATS, LoadMeter, checked_cached_row, ids_needed,
                                      measure_row_by, probe_rows_by, save_probe_of, timed_passes, trusted_row)
from layerplan.engine.runner import forward, new_cache
from layerplan.files import cache_dir
from layerplan.machine import cpu_info

READ_BYTES = 128 << 20  # at least this much, and 4x the last-level cache, read for the read rate


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


class ModelTimedPasses:
    """probing.py's TimedPasses of a loaded model: its full plan's passes over random ids (seed 0)
    in a cache of its own."""

    def __init__(self, model, count: int) -> None:
        self.model, self.plan = model, model.plan()
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, model.hf.config.vocab_size, (1, count), generator=generator, device=model.device)
        self.cache = new_cache(self.plan, capacity=count + 1)

    def prefill(self, count: int) -> None:
        forward(self.model, self.ids[:, :count], self.plan, self.cache, 0, last_only=True)

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def run(self, position: int, count: int) -> None:
        forward(self.model, self.ids[:, position: position + count], self.plan, self.cache, position,
                last_only=count == 1)


def time_passes(model, lengths: Sequence[int] = PASS_LENGTHS, repeats: int = 5, context: int = CONTEXT,
                on_progress: Callable[[int, int], None] | None = None,
                between_rounds: Callable[[], None] | None = None) -> dict[int, float]:
    """probing.py timed_passes over a loaded model's passes."""
    return timed_passes(ModelTimedPasses(model, ids_needed(lengths, context)), lengths, repeats, context,
                        on_progress, between_rounds)


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
    """The model's row, timed by time_row (time_passes' signature) and timed again while it fails
    its checks (probing.py measure_row_by). sampler: the machine's rates between the rounds, for
    a model on the CPU (a GPU row gets no floor from the CPU's rates)."""
    if sampler is not None and (torch.device(model.device).type != "cpu" or dtype.startswith("stored")):
        sampler = None  # the sampled rates are the dense dtypes' products: not a floor for block formats
    weights_dtype = precision_dtype(dtype)
    if sampler is not None:
        sampler.dtype = weights_dtype
    weight_bytes, elements = streamed_matrix_bytes(model, weights_dtype)
    return measure_row_by(
        lambda progress, rounds: time_row(model, lengths, repeats, on_progress=progress, between_rounds=rounds),
        engine, dtype, weight_bytes, elements, sampler, retries, torch_build() if engine != "native" else None,
        on_progress, on_note)


def probe(load: Callable[[str, str], object], model_name: str, dtypes: Sequence[str], engines: Sequence[str],
          lengths: Sequence[int] = PASS_LENGTHS, repeats: int = 5,
          on_progress: Callable[[str, int, int], None] | None = None, on_note: Callable[[str], None] | None = None,
          retries: int = RETRIES, time_row: Callable[..., dict[int, float]] = time_passes,
          sampler: RateSampler | None = None, load_meter: LoadMeter | None = None) -> ProbeResult:
    """load(dtype, engine) -> LoadedModel; an engine that cannot run here (None) is left out. Each
    row is measured by measure_row, the whole as probing.py probe_rows_by does at torch's thread
    count. on_note: what the probe does about a failed row, one line each. time_row, sampler and
    load_meter time the passes, the machine's rates and the others' CPU use (defaults: this machine)."""
    sampler = sampler or RateSampler()

    def measure(dtype: str, engine: str, progress) -> tuple[ProbeRow, list[str]] | None:
        model = load(dtype, engine)
        if model is None:
            return None
        return measure_row(model, engine, dtype, lengths, repeats, sampler, retries, progress, on_note, time_row)

    return probe_rows_by(measure, model_name, dtypes, engines, torch.get_num_threads(), cpu_info().line(),
                         on_progress, load_meter)


def save_probe(result: ProbeResult, folder: Path) -> Path | None:
    """probing.py save_probe_of, at torch's thread count."""
    return save_probe_of(result, folder, torch.get_num_threads())


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


def step_seconds(model, repeats: int = STEP_REPEATS) -> float:
    """One decoding step after CONTEXT cached tokens, as the probe times it (a warm-up step, then
    the median of `repeats`): the cheap check of a cached row."""
    return time_passes(model, (1,), repeats)[1]


def checked_model_row(model, folder: Path, time_step: Callable[[], float] | None = None,
                      remeasure: Callable[[], ProbeRow | None] | None = None,
                      on_note: Callable[[str], None] | None = None) -> ProbeRow | None:
    """The cached probe row for the model as it runs now (None: none cached), checked by one timed
    step (recheck_row); a row measured again replaces the cached one. time_step and remeasure
    default to timing this model (step_seconds, measure_row)."""
    engine, dtype = model_engine_dtype(model)
    threads = torch.get_num_threads()

    def remeasure_model(row: ProbeRow) -> ProbeRow | None:
        return trusted_row(lambda: measure_row(model, engine, dtype, sorted(row.relative), sampler=RateSampler(),
                                               on_note=on_note), threads)

    return checked_cached_row(load_probe(folder, model.name), engine, dtype, time_step or (lambda: step_seconds(model)),
                              (lambda _row: remeasure()) if remeasure else remeasure_model, folder, threads, on_note)


