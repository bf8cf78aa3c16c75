"""Benchmarks that time layerplan against a peer in the same run and report ratios.

Runs are interleaved (A, B, A, B, ...) so that drift in machine speed hits both sides alike, and
each figure is the median over repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from layerplan.decode import generate
from layerplan.models import LoadedModel

# Small prompts of different kinds; the continuation is what gets timed.
PROMPTS = {
    "code": 'def binary_search(items, target):\n    """Return the index of target in the sorted list items, or -1."""\n',
    "chat": "What are three good habits for writing readable Python code?",
    "summary": (
        "Summarise in one sentence: The Python standard library is very extensive, offering a wide "
        "range of facilities. It contains built-in modules that provide access to system functionality "
        "such as file I/O, as well as modules written in Python that provide standardized solutions "
        "for many problems that occur in everyday programming."
    ),
    "continuation": "The history of the printing press begins in",
}


@dataclass
class BenchRow:
    method: str
    prompt: str
    ms_per_token: float  # median over repeats, decode only where the method reports it
    tokens_per_second: float
    speedup: float  # transformers' ms/token divided by this row's (>1 is faster)
    identical: bool  # same tokens as transformers' greedy output
    samples_ms: list[float] = field(default_factory=list)


@dataclass
class BenchResult:
    model: str
    dtype: str
    threads: int
    new_tokens: int
    repeats: int
    rows: list[BenchRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"{'prompt':<13} {'method':<26} {'ms/token':>9} {'tok/s':>7} {'vs HF':>7} {'same':>5}"]
        for row in self.rows:
            lines.append(
                f"{row.prompt:<13} {row.method:<26} {row.ms_per_token:>9.2f} {row.tokens_per_second:>7.1f} "
                f"{row.speedup:>6.2f}x {'yes' if row.identical else 'NO':>5}"
            )
        return "\n".join(lines)


def _time_transformers(model: LoadedModel, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=model.eos_token_ids[0] if model.eos_token_ids else 0)
        elapsed = time.perf_counter() - start
    return elapsed, out[0, ids.shape[1]:].tolist()


def _time_layerplan(model: LoadedModel, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    result = generate(model, ids, max_new_tokens=new_tokens)  # stops at EOS, as generate does
    return result.seconds, result.token_ids


def bench_plain(
    model: LoadedModel,
    packed: LoadedModel | None = None,
    prompts: dict[str, str] | None = None,
    new_tokens: int = 64,
    repeats: int = 3,
    on_progress: Callable[[int, int], None] | None = None,
) -> BenchResult:
    """Plain greedy decoding, same prompt, dtype and threads: transformers' generate and
    layerplan's loop on the stock model, and layerplan on `packed` (the same weights with bf16
    linears prepacked, as `load_model` does by default on CPU). Times are whole calls (prefill
    included) per token produced; all stop at EOS."""
    prompts = prompts or PROMPTS
    result = BenchResult(model.name, str(model.dtype).replace("torch.", ""), torch.get_num_threads(), new_tokens, repeats)
    methods: list[tuple[str, Callable, LoadedModel]] = [
        ("transformers generate", _time_transformers, model),
        ("layerplan, unpacked", _time_layerplan, model),
    ]
    if packed is not None:
        methods.append(("layerplan", _time_layerplan, packed))
    total, done = len(prompts) * repeats * len(methods), 0
    for label, prompt in prompts.items():
        ids = model.encode(prompt, chat=label == "chat")
        for _, run, target in methods:
            run(target, ids, 4)  # warm-up: first calls allocate
        samples: dict[str, list[float]] = {name: [] for name, _, _ in methods}
        outputs: dict[str, list[int]] = {}
        for _ in range(repeats):
            for name, run, target in methods:
                seconds, tokens = run(target, ids, new_tokens)
                samples[name].append(1000 * seconds / max(len(tokens), 1))
                outputs[name] = tokens
                done += 1
                if on_progress:
                    on_progress(done, total)
        reference = statistics.median(samples["transformers generate"])
        for name, _, _ in methods:
            ms = statistics.median(samples[name])
            result.rows.append(BenchRow(name, label, ms, 1000 / ms, reference / ms,
                                        outputs[name] == outputs["transformers generate"], samples[name]))
    return result
