"""The interleaved timing of methods that decode the same prompts, and its table.

Methods run interleaved (A, B, C, A, B, C, ...) so that drift in machine speed hits all alike;
each figure is the median over repeats. Times are whole calls (prefill included) per token
produced; every method stops at EOS or after `new_tokens`. Beside them, where a method reports it,
the decoding rate alone (prefill left out): the figure llama.cpp's llama-bench prints (tg).

Without torch: both front ends time their methods here (app/bench.py the torch front end's,
app/light_timing.py the light one's), and a prompt's tokens reach every method as a list of ids.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from layerplan.app.prompts import CHAT_PROMPTS
from layerplan.decoding.text import GenerationResult
from layerplan.machine import CpuInfo, cpu_info

# run(ids, new_tokens) -> (seconds, tokens, stats or None), ids the prompt's token ids. A peer that
# does not hand its tokens back (llama.cpp's tools) gives their count instead. Stats: speculative
# figures, and "decode_tokens_per_second" (prefill left out), "pass_steps" ({k: a k-token pass in
# steps}).
Runner = Callable[[list[int], int], tuple[float, list[int] | int, dict | None]]
TRANSFORMERS = "transformers generate"  # the row of transformers' own generate, the reference where it runs
PLAIN = "layerplan plain"  # layerplan's plain decoding on the chosen engine, the reference elsewhere


class PromptModel(Protocol):
    """The model whose tokenizer encodes a bench's prompts (either front end's)."""

    name: str
    precision: str

    def encode(self, text: str, chat: bool = False) -> Sequence[int] | object:
        """The text's ids (a list, or a tensor of one row)."""


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


def run_bench(
    model: PromptModel,
    methods: dict[str, Runner],
    prompts: dict[str, str],
    new_tokens: int = 64,
    repeats: int = 3,
    reference: str | None = None,
    plain: str = PLAIN,
    on_progress: Callable[[int, int], None] | None = None,
    chat: Collection[str] = CHAT_PROMPTS,
    precision: str | None = None,
    cpu: CpuInfo | None = None,
) -> BenchResult:
    """model: the one whose tokenizer encodes the prompts (transformers' where it runs; its name,
    precision and encode(text, chat) are read). reference: the row every speedup is against (None:
    transformers' generate where it is among the methods, else `plain`). chat: the prompt names
    that go through the tokenizer's chat template. precision: layerplan's (default: model's), where
    it differs from the model's (a GGUF as stored against transformers' float32 of it). cpu: the
    machine and threads the methods run on (default: torch's, machine.py cpu_info)."""
    reference = reference or (TRANSFORMERS if TRANSFORMERS in methods else plain)
    if reference not in methods:
        raise ValueError(f"the methods must include the reference '{reference}'")
    if precision is not None and precision != model.precision:
        precision = f"{precision} (transformers: {model.precision})"
    cpu = cpu if cpu is not None else cpu_info()
    result = BenchResult(model.name, precision or model.precision, cpu.threads, new_tokens, repeats, cpu,
                         reference=reference)
    total, done = len(prompts) * repeats * len(methods), 0
    for label, prompt in prompts.items():
        ids = token_list(model.encode(prompt, chat=label in chat))
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


def token_list(ids: Sequence[int] | object) -> list[int]:
    """A prompt's ids as a list (a torch front end's model encodes to a tensor of one row)."""
    rows = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return rows[0] if rows and isinstance(rows[0], list) else rows


def timed_generation(result: GenerationResult) -> tuple[float, list[int], dict]:
    """A Runner's answer for one of layerplan's decodes: its seconds, tokens and statistics, with
    its decoding rate (the tokens after the first, which the prefill's logits give, over the time
    after the prefill)."""
    decode = result.seconds - result.prefill_seconds
    rate = (len(result.token_ids) - 1) / decode if len(result.token_ids) > 1 and decode > 0 else None
    return result.seconds, result.token_ids, {**result.stats, "decode_tokens_per_second": rate}
