"""Benchmarks that time layerplan against peers in the same run and report ratios.

Methods run interleaved (A, B, C, A, B, C, ...) so that drift in machine speed hits all alike;
each figure is the median over repeats. Times are whole calls (prefill included) per token
produced; every method stops at EOS or after `new_tokens`. Beside them, where a method reports it,
the decoding rate alone (prefill left out): the figure llama.cpp's llama-bench prints (tg).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace

import torch

from layerplan.app.prompts import CHAT_PROMPTS
from layerplan.decoding.generate import generate
from layerplan.engine.cpu_pack import packing_supported
from layerplan.engine.choices import BLOCK_PRECISIONS
from layerplan.engine.load import load_model
from layerplan.engine.native import resolve_engine
from layerplan.engine.probe_rows import ProbeRow
from layerplan.machine import CpuInfo, cpu_info
from layerplan.models.loading import LoadedModel, dense_bytes, resolve_dtype

# run(ids, new_tokens) -> (seconds, tokens, stats or None). A peer that does not hand its tokens back
# (llama.cpp's tools) gives their count instead. Stats: speculative figures, and
# "decode_tokens_per_second" (prefill left out), "pass_steps" ({k: a k-token pass in steps}).
Runner = Callable[[torch.Tensor, int], tuple[float, list[int] | int, dict | None]]
TRANSFORMERS = "transformers generate"  # the row of transformers' own generate, the reference where it runs
PLAIN = "layerplan plain"  # layerplan's plain decoding on the chosen engine, the reference elsewhere


@dataclass
class BenchRow:
    method: str
    prompt: str
    ms_per_token: float  # median over repeats
    tokens_per_second: float
    speedup: float  # the reference row's ms/token divided by this row's (>1 is faster; BenchResult.reference)
    same_as_plain: bool | None  # same tokens as layerplan's plain greedy decoding (None: a peer that does not say)
    tokens: int
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    samples_ms: list[float] = field(default_factory=list)
    by_drafter: dict[str, dict] = field(default_factory=dict)  # where a drafter picks among several (auto)
    decode_tokens_per_second: float | None = None  # decoding alone, prefill left out (median)
    pass_steps: dict[str, float] = field(default_factory=dict)  # a pass over k tokens in one-token steps (median)


@dataclass
class BenchResult:
    model: str
    dtype: str
    threads: int
    new_tokens: int
    repeats: int
    cpu: CpuInfo  # timings are this machine's: say which one
    rows: list[BenchRow] = field(default_factory=list)
    # the row every speedup is against: transformers' own generate, or layerplan's plain decoding
    # where transformers is not timed (a GGUF run as stored: wants_transformers)
    reference: str = TRANSFORMERS

    def to_dict(self) -> dict:
        return asdict(self)

    def peer_lines(self, pairs: dict[str, Collection[str]]) -> list[str]:
        """Per prompt, each peer row against ours ({peer method: our methods}), both timed in this
        run: the whole call (prefill included, per token) and, where both report it, decoding alone."""
        lines = []
        for prompt in dict.fromkeys(r.prompt for r in self.rows):
            rows = {r.method: r for r in self.rows if r.prompt == prompt}
            for peer, ours_names in pairs.items():
                for ours in ours_names:
                    if ours not in rows or peer not in rows:
                        continue
                    a, b = rows[ours], rows[peer]
                    line = (f"{prompt}: {ours} / {peer}: {a.tokens_per_second / b.tokens_per_second:.2f}x whole call "
                            f"({a.tokens_per_second:.1f} / {b.tokens_per_second:.1f} tok/s)")
                    if a.decode_tokens_per_second and b.decode_tokens_per_second:
                        line += (f", {a.decode_tokens_per_second / b.decode_tokens_per_second:.2f}x decoding "
                                 f"({a.decode_tokens_per_second:.1f} / {b.decode_tokens_per_second:.1f} tok/s)")
                    lines.append(line)
        return lines

    @property
    def versus(self) -> str:
        """The speedup column's name: 'vs HF' (transformers' generate) or 'vs plain'."""
        return "vs HF" if self.reference == TRANSFORMERS else "vs plain"

    @property
    def reference_words(self) -> str:
        """The reference row in words, for a sentence ("1.3x <this>")."""
        return "transformers' plain greedy generate" if self.reference == TRANSFORMERS else "layerplan's plain decoding"

    def table(self) -> str:
        width = max([34, *(len(r.method) for r in self.rows)])
        lines = [f"{'prompt':<13} {'method':<{width}} {'ms/tok':>7} {'tok/s':>6} {'dec/s':>6} {self.versus:>8} {'=plain':>6} "
                 f"{'accept':>6} {'tok/pass':>8}"]
        for row in self.rows:
            acc = f"{row.acceptance_rate:.2f}" if row.acceptance_rate is not None and row.acceptance_rate == row.acceptance_rate else "-"
            mal = f"{row.mean_accepted_length:.2f}" if row.mean_accepted_length is not None else "-"
            same = "-" if row.same_as_plain is None else "yes" if row.same_as_plain else "NO"
            decode = f"{row.decode_tokens_per_second:.1f}" if row.decode_tokens_per_second else "-"
            lines.append(
                f"{row.prompt:<13} {row.method:<{width}} {row.ms_per_token:>7.1f} {row.tokens_per_second:>6.1f} "
                f"{decode:>6} {row.speedup:>7.2f}x {same:>6} {acc:>6} {mal:>8}"
            )
            if row.pass_steps:
                lines.append(" " * 14 + "; ".join(f"a pass over {k} tokens costs {steps:.2f} steps"
                                                  for k, steps in row.pass_steps.items()))
            if len(row.by_drafter) > 1:  # which drafter drafted how much, and how well (the last repeat)
                lines.append(" " * 14 + "; ".join(
                    f"{name}: {part['rounds']} rounds, {part['acceptance_rate'] or 0:.2f} accept, "
                    f"{part['tokens_per_pass'] or 0:.2f} tok/pass" for name, part in row.by_drafter.items()))
        return "\n".join(lines)


def transformers_runner(model: LoadedModel, **options) -> Runner:
    """transformers' own generate (greedy), with extra options such as assistant_early_exit=4
    or prompt_lookup_num_tokens=10."""
    pad = model.eos_token_ids[0] if model.eos_token_ids else 0

    def run(ids: torch.Tensor, new_tokens: int):
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=pad, **options)
            elapsed = time.perf_counter() - start
        return elapsed, out[0, ids.shape[1]:].tolist(), None

    return run


def layerplan_runner(model: LoadedModel, draft=None, draft_length=None, probe_row: ProbeRow | None = None) -> Runner:
    """probe_row: this machine's probe row for the model, the verify costs of a draft's rounds."""
    def run(ids: torch.Tensor, new_tokens: int):
        result = generate(model, ids, max_new_tokens=new_tokens, draft=draft, draft_length=draft_length,
                          probe_row=probe_row)
        # decoding alone: the tokens after the first (which the prefill's logits give) over the time after it
        decode = result.seconds - result.prefill_seconds
        rate = (len(result.token_ids) - 1) / decode if len(result.token_ids) > 1 and decode > 0 else None
        return result.seconds, result.token_ids, {**result.stats, "decode_tokens_per_second": rate}

    return run


def run_bench(
    model: LoadedModel,
    methods: dict[str, Runner],
    prompts: dict[str, str],
    new_tokens: int = 64,
    repeats: int = 3,
    reference: str | None = None,
    plain: str = PLAIN,
    on_progress: Callable[[int, int], None] | None = None,
    chat: Collection[str] = CHAT_PROMPTS,
    precision: str | None = None,
) -> BenchResult:
    """model: the one whose tokenizer encodes the prompts (transformers' where it runs). reference:
    the row every speedup is against (None: transformers' generate where it is among the methods,
    else `plain`). chat: the prompt names that go through the tokenizer's chat template.
    precision: layerplan's (default: model's), where it differs from the model's (a GGUF as stored
    against transformers' float32 of it)."""
    reference = reference or (TRANSFORMERS if TRANSFORMERS in methods else plain)
    if reference not in methods:
        raise ValueError(f"the methods must include the reference '{reference}'")
    if precision is not None and precision != model.precision:
        precision = f"{precision} (transformers: {model.precision})"
    result = BenchResult(model.name, precision or model.precision, torch.get_num_threads(),
                         new_tokens, repeats, cpu_info(), reference=reference)
    total, done = len(prompts) * repeats * len(methods), 0
    for label, prompt in prompts.items():
        ids = model.encode(prompt, chat=label in chat)
        for run in methods.values():
            run(ids, 4)  # warm-up: first calls allocate
        samples: dict[str, list[float]] = {name: [] for name in methods}
        decode_rates: dict[str, list[float]] = {name: [] for name in methods}
        passes: dict[str, dict[str, list[float]]] = {name: {} for name in methods}
        outputs: dict[str, list[int] | int] = {}
        stats: dict[str, dict | None] = {}
        for _ in range(repeats):
            for name, run in methods.items():
                seconds, tokens, extra = run(ids, new_tokens)
                count = tokens if isinstance(tokens, int) else len(tokens)
                samples[name].append(1000 * seconds / max(count, 1))
                outputs[name], stats[name] = tokens, extra
                if extra and extra.get("decode_tokens_per_second"):
                    decode_rates[name].append(extra["decode_tokens_per_second"])
                for k, steps in ((extra or {}).get("pass_steps") or {}).items():
                    passes[name].setdefault(k, []).append(steps)
                done += 1
                if on_progress:
                    on_progress(done, total)
        ref_ms = statistics.median(samples[reference])
        plain_tokens = outputs.get(plain, outputs[reference])
        for name in methods:
            ms = statistics.median(samples[name])
            extra = stats[name] or {}
            tokens = outputs[name]
            same = None if isinstance(tokens, int) else tokens == plain_tokens
            result.rows.append(BenchRow(
                name, label, ms, 1000 / ms, ref_ms / ms, same, tokens if isinstance(tokens, int) else len(tokens),
                extra.get("acceptance_rate"), extra.get("mean_accepted_length"), samples[name],
                extra.get("by_drafter", {}),
                statistics.median(decode_rates[name]) if decode_rates[name] else None,
                {k: statistics.median(v) for k, v in passes[name].items()},
            ))
    return result


def wants_transformers(model: str, dtype: str) -> bool:
    """Whether timing `model` at `dtype` times transformers' own generate unless told: not for a GGUF
    run at a block precision, which transformers would run dequantized whole (4-8 times the file in
    memory: 28 GB for a 7B); there layerplan's plain decoding is the reference, and llama.cpp's own
    tools the peer."""
    return not (dtype in BLOCK_PRECISIONS and dense_bytes(model, "float32") is not None)


def load_for_timing(model: str, dtype: str, engine: str, on_note: Callable[[str], None] = lambda _: None,
                    transformers: bool = True) -> tuple[LoadedModel | None, LoadedModel]:
    """(stock, fast) at `dtype` (chosen already: no 'auto'): transformers' generate runs stock's own
    modules (None: transformers is not timed), layerplan runs fast. The native engine leaves the
    modules as they are, so one load serves both; the eager engine packs bf16 linears where oneDNN
    supports it, into a second copy. on_note: the lines that say what loads, and what a GGUF
    dequantized for transformers costs."""
    if dtype in BLOCK_PRECISIONS:  # transformers runs the model dense: in float32 (a GGUF by its own loader)
        if not transformers:
            on_note(f"loading {model} ({dtype}, engine native)…")
            return None, load_model(model, dtype=dtype, engine="native")
        on_note(f"loading {model} ({dtype}, engine native; transformers: float32)…")
        sizes = dense_bytes(model, "float32")
        if sizes is not None:
            on_note(f"dequantizing the GGUF to float32 for transformers: {sizes[0] / 1e9:.1f} GB of weights in "
                    f"memory beside the {sizes[1] / 1e9:.1f} GB it runs as stored (--no-transformers leaves it out)")
        return load_model(model, dtype="float32", engine="eager"), load_model(model, dtype=dtype, engine="native")
    kind = resolve_engine(engine, resolve_dtype(dtype), "cpu")
    on_note(f"loading {model} ({dtype}, engine {kind})…")
    if kind == "native":
        loaded = load_model(model, dtype=dtype, engine="native")
        return (loaded if transformers else None), loaded
    stock = load_model(model, dtype=dtype, pack=False, engine="eager")
    if not packing_supported(stock.dtype, "cpu"):
        return (stock if transformers else None), stock
    if not transformers:  # (the packed copy alone)
        del stock
        return None, load_model(model, dtype=dtype, pack=True, engine="eager")
    return stock, load_model(model, dtype=dtype, pack=True, engine="eager")


def eager_view(model: LoadedModel) -> LoadedModel:
    """The same model (same modules, same weights) run by the eager engine."""
    return replace(model, executor=None) if model.native is not None else model


def bench_methods(
    stock: LoadedModel | None,
    fast: LoadedModel | None = None,
    drafts: list[str] = (),
    hf_early_exits: list[int] = (),
    hf_prompt_lookup: int | None = None,
    draft_length: str | None = None,
    peers: dict[str, Runner] | None = None,
    probe_row: ProbeRow | None = None,
) -> dict[str, Runner]:
    """transformers on the stock model's own modules; layerplan plain on the eager engine over
    the same modules, and on `fast` (the native engine, or packed linears) with each draft (its
    verify costs from probe_row, this machine's probe row for `fast`); then any peers (llama.cpp's
    tools). stock None: neither transformers nor the eager engine is timed (load_for_timing)."""
    fast = fast if fast is not None else stock
    if stock is None and (hf_early_exits or hf_prompt_lookup):
        raise ValueError("transformers' early exit and prompt lookup run on transformers' own model: time it too "
                         "(--transformers)")
    methods: dict[str, Runner] = {TRANSFORMERS: transformers_runner(stock)} if stock is not None else {}
    for exit_layer in hf_early_exits:
        methods[f"transformers early_exit={exit_layer}"] = transformers_runner(stock, assistant_early_exit=exit_layer)
    if hf_prompt_lookup:
        methods[f"transformers prompt_lookup={hf_prompt_lookup}"] = transformers_runner(
            stock, prompt_lookup_num_tokens=hf_prompt_lookup)
    if stock is not None and (fast is not stock or fast.native is not None):
        methods["layerplan plain, eager"] = layerplan_runner(eager_view(stock))
    methods[PLAIN] = layerplan_runner(fast)
    for draft in drafts:
        methods[f"layerplan draft={draft}"] = layerplan_runner(fast, draft, draft_length, probe_row)
    methods.update(peers or {})
    return methods
