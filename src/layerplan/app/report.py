"""Pictures and pages for people: heatmaps, plots, the tune report. Nothing here computes results.
matplotlib is imported when a picture is drawn (it is slow to import)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import numpy as np

from layerplan.files import write_bytes_atomic
from layerplan.search.importance import KINDS, ScanResult


def _save(fig, path) -> Path:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    return write_bytes_atomic(path, buffer.getvalue())


def _figure(width: float = 6.4, height: float = 4.0):
    """A figure of its own, drawn by the Agg canvas: neither pyplot's figure list nor the
    process-wide backend (a notebook's or an application's) is touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def scan_heatmap(result: ScanResult, path: str | Path, metric: str = "kl") -> Path:
    """Layers × {attention, MLP, whole layer}, coloured by `metric` (log scale), as a PNG."""
    from matplotlib.colors import LogNorm

    items = [item for item in result.items if item.kind in KINDS]
    layers = sorted({item.layer for item in items})
    grid = np.full((len(KINDS), len(layers)), np.nan)
    for item in items:
        grid[KINDS.index(item.kind), layers.index(item.layer)] = max(getattr(item, metric), 1e-6)
    fig, ax = _figure(max(6.0, 0.32 * len(layers) + 2), 2.8)
    finite = grid[np.isfinite(grid)]
    norm = LogNorm(vmin=max(finite.min(), 1e-4), vmax=finite.max()) if finite.size else None
    image = ax.imshow(grid, aspect="auto", cmap="magma_r", norm=norm, interpolation="nearest")
    ax.set_yticks(range(len(KINDS)), ["attention", "MLP", "layer"])
    ax.set_xticks(range(len(layers)), [str(layer) for layer in layers], fontsize=7)
    ax.set_xlabel("layer skipped")
    label = {"kl": "KL to full model (nats/token)", "perplexity_delta": "perplexity increase"}.get(metric, metric)
    fig.colorbar(image, ax=ax, label=label, fraction=0.03)
    ax.set_title(f"{result.model}: damage from skipping one sub-layer ({result.tokens} tokens)", fontsize=9)
    return _save(fig, path)


def explore_plot(result, path: str | Path) -> Path:
    """Perplexity against added compute for every explored layer order, as a PNG."""
    fig, ax = _figure()
    xs = [100 * row.added_compute for row in result.rows]
    ys = [row.perplexity for row in result.rows]
    ax.scatter(xs, ys, s=18, color="tab:blue", label="layer orders")
    ax.scatter([0], [result.base_perplexity], s=40, color="tab:red", marker="*", label="the model itself")
    best = result.best()
    ax.annotate(best.plan[:30], (100 * best.added_compute, best.perplexity), fontsize=7,
                xytext=(5, 5), textcoords="offset points")
    ax.set_xlabel("added compute (%)")
    ax.set_ylabel(f"perplexity ({result.tokens} tokens)")
    ax.set_title(f"{result.model}: in-situ frankenmerges", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def search_trajectory(values: list[float], direction: str, label: str, path: str | Path) -> Path:
    """Objective per trial (or greedy step) and the best so far."""
    fig, ax = _figure()
    best, running = [], None
    for value in values:
        running = value if running is None else (min(running, value) if direction == "minimize" else max(running, value))
        best.append(running)
    ax.plot(range(len(values)), values, ".", color="tab:gray", label="trial")
    ax.plot(range(len(values)), best, "-", color="tab:blue", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
    return _save(fig, path)


def pareto_plot(points: list[tuple[float, float]], front: list[tuple[float, float]], label: str, path: str | Path) -> Path:
    """Objective against relative cost for all trials, with the Pareto front."""
    fig, ax = _figure()
    if points:
        ax.scatter([c for _, c in points], [v for v, _ in points], s=10, color="tab:gray", label="trials")
    if front:
        front = sorted(front, key=lambda p: p[1])
        ax.plot([c for _, c in front], [v for v, _ in front], "o-", color="tab:red", label="Pareto front")
    ax.set_xlabel("relative cost of one decode step")
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
    return _save(fig, path)


def skip_frequency_plot(plans, num_layers: int, path: str | Path) -> Path:
    """How often each layer's attention / MLP is skipped among the given (best) plans."""
    counts = np.zeros((2, num_layers))
    for plan in plans:
        skipped = plan.skipped()
        for row, kind in enumerate(("attention", "mlp")):
            counts[row, skipped[kind]] += 1
    fig, ax = _figure(max(6.0, 0.3 * num_layers + 2), 2.4)
    image = ax.imshow(counts / max(len(plans), 1), aspect="auto", cmap="Blues", vmin=0, vmax=1)
    ax.set_yticks([0, 1], ["attention", "MLP"])
    ax.set_xticks(range(num_layers), [str(i) for i in range(num_layers)], fontsize=7)
    ax.set_xlabel("layer")
    ax.set_title(f"skip frequency among the best {len(plans)} plans", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.03)
    return _save(fig, path)


def exits_plot(result: ScanResult, path: str | Path) -> Path:
    """The logit lens: perplexity and top-1 agreement of exiting after each step."""
    exits = sorted((i for i in result.items if i.kind == "exit"), key=lambda i: i.step)
    fig, ax = _figure(6.4, 3.6)
    ax.plot([i.step for i in exits], [i.perplexity for i in exits], "o-", color="tab:red", ms=3, label="perplexity")
    ax.axhline(result.base_perplexity, color="tab:red", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("exit after step")
    ax.set_ylabel("perplexity", color="tab:red")
    twin = ax.twinx()
    twin.plot([i.step for i in exits], [i.top1_agreement for i in exits], "s-", color="tab:blue", ms=3)
    twin.set_ylabel("top-1 agreement with the full plan", color="tab:blue")
    twin.set_ylim(0, 1)
    ax.set_title(f"{result.model}: early exits ({result.tokens} tokens)", fontsize=9)
    return _save(fig, path)


_STYLE = """<style>body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.5rem 0 1.5rem}td,th{border:1px solid #ccc;padding:.25rem .5rem;text-align:left}
code{background:#f4f4f4;padding:.1rem .3rem}img{max-width:100%}</style>"""


def _html_table(rows: list[list[str]], header: list[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _inline_images(images: dict[str, Path]) -> str:
    """The pictures that exist, inline (the page needs no other file)."""
    return "".join(
        f'<h3>{html.escape(title)}</h3><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode(Path(p).read_bytes()).decode()}">'
        for title, p in images.items() if Path(p).exists()
    )


def tune_html(result, images: dict[str, Path], path: str | Path) -> Path:
    """A one-page report of `layerplan tune`, with the plots inline (no external files)."""
    best = result.best
    pictures = _inline_images(images)
    choices = _html_table(
        [[c.draft, f"{c.speedup_median:.2f}x", f"{c.speedup_min:.2f}–{c.speedup_max:.2f}x", f"±{c.spread_ms / 2:.1f} ms",
          "yes" if c.same_as_plain_fp32 else "NO", "yes" if c.same_as_plain_bf16 else "no (near-ties)"]
         for c in result.choices],
        ["draft", f"speedup vs {result.bench.reference} (median)", "range over prompts", "timing spread",
         f"= plain greedy (float32: {result.exact_precision})", f"= plain greedy ({result.dtype})"],
    )
    bench = _html_table(
        [[r.prompt, r.method, f"{r.ms_per_token:.1f}", f"{r.speedup:.2f}x",
          "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}",
          "-" if r.mean_accepted_length is None else f"{r.mean_accepted_length:.2f}"] for r in result.bench.rows],
        ["prompt", "method", "ms/token", f"vs {result.bench.reference}", "acceptance", "tokens/pass"],
    )
    least = result.scan.ranked()[:8]
    scan_rows = _html_table([[f"{i.kind} {i.layer}", f"{i.kl:.4f}", f"{i.top1_agreement:.3f}"] for i in least],
                      ["sub-layer", "KL to full", "top-1 agreement"])
    plan_text = result.saved_plan or "none: no skip plan is predicted to beat plain decoding on this model"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>layerplan tune: {html.escape(result.model)}</title>
{_STYLE}</head><body>
<h1>layerplan tune — {html.escape(result.model)} ({html.escape(result.dtype)})</h1>
<p><b>Machine:</b> {html.escape(result.bench.cpu.line())}. Every timing on this page is from it: a CPU
with another instruction set (AVX2 only, AVX-512, AVX-512 BF16, AMX) can rank the drafts differently.</p>
<p><b>Best draft:</b> <code>{html.escape(best.draft if best else "none")}</code>, {best.speedup_median if best else 1:.2f}×
{html.escape(result.bench.reference_words)} (median over prompts, range {best.speedup_min if best else 1:.2f}–{best.speedup_max if best else 1:.2f}×),
greedy output identical to plain decoding in float32 ({html.escape(result.exact_precision)}): <b>{"yes" if best and best.same_as_plain_fp32 else "NO"}</b>.</p>
<p><b>Use it:</b> <code>{html.escape(result.command())}</code></p>
<p><b>Searched skip plan:</b> <code>{html.escape(plan_text)}</code> (predicted speedup {result.predicted_speedup:.2f}×)</p>
<h2>Drafts</h2>{choices}
<h2>Benchmark (same run, interleaved, median of {result.bench.repeats})</h2>{bench}
<h2>Sub-layers that hurt least when skipped</h2>{scan_rows}
{pictures}
</body></html>"""
    return write_bytes_atomic(path, page.encode("utf-8"))


def times_in_words(counts: list[int]) -> str:
    """Repeat counts in words: [1] "once", [2] "twice", [1, 2] "once and twice"."""
    words = [{1: "once", 2: "twice"}.get(count, f"{count} times") for count in counts]
    return " and ".join(words)


def block_heatmap(result, measure: str, minimise: bool, path: str | Path, repeats: int | None = None) -> Path:
    """The (start, end) grid of a block-repeat scan (its rows repeated `repeats` times; default
    the first count scanned) coloured by the change in `measure` (lower is better where minimise)
    against the model itself; blue is better whichever way the measure points, and the model itself
    is 0."""
    from matplotlib.colors import TwoSlopeNorm

    repeats = repeats if repeats is not None else result.repeats[0]
    rows = [row for row in result.rows if row.repeats == repeats]
    low = min((row.start for row in rows), default=0)
    high = max((row.end for row in rows), default=result.num_layers - 1)
    n = high - low + 1  # the scanned range only
    grid = np.full((n, n), np.nan)
    for row in rows:
        grid[row.start - low, row.end - low] = row.score(measure).change
    fig, ax = _figure(max(5.0, 0.22 * n + 2), max(4.0, 0.2 * n + 1.5))
    finite = grid[np.isfinite(grid)]
    reach = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
    # RdBu runs red (low) to blue (high): reversed where lower is better, so that blue is better
    image = ax.imshow(grid, cmap="RdBu_r" if minimise else "RdBu", norm=TwoSlopeNorm(0.0, -reach, reach),
                      interpolation="nearest", origin="upper", extent=(low - 0.5, high + 0.5, high + 0.5, low - 0.5))
    ticks = range(low, high + 1, max(1, n // 15))
    ax.set_xticks(list(ticks), [str(t) for t in ticks], fontsize=7)
    ax.set_yticks(list(ticks), [str(t) for t in ticks], fontsize=7)
    ax.set_xlabel("block end j (last layer repeated)")
    ax.set_ylabel("block start i")
    base = next(s for s in result.base if s.measure == measure)
    way = "lower" if minimise else "higher"
    fig.colorbar(image, ax=ax, fraction=0.04, label=f"change in {measure} ({way} is better; blue = better)")
    ax.set_title(f"{result.model}: block i..j repeated {times_in_words([repeats])}; {measure} of the model {base.value:.4g}",
                 fontsize=9)
    return _save(fig, path)


def blocks_html(result, images: dict[str, Path], commands: list[str], path: str | Path, top: int = 15) -> Path:
    """report.html of a block-repeat scan: the heatmaps, the top blocks with intervals, and the
    commands that export the best."""
    rank = result.measures[0]
    best = result.best()
    header = ["block", "plan", "+compute"] + [f"{m} (95%)" for m in result.measures] + [f"change in {m} (95%)"
                                                                                      for m in result.measures]
    rows = [[f"{r.start}-{r.end}" + (f" x{r.repeats}" if len(result.repeats) > 1 else ""), r.plan,
             f"{r.added_compute:+.0%}"]
            + [f"{s.value:.4g} [{s.low:.4g}, {s.high:.4g}]" for s in r.scores]
            + [f"{s.change:+.4g} [{s.change_low:+.4g}, {s.change_high:+.4g}]" for s in r.scores]
            for r in result.ranked()[:top]]
    base = _html_table([[s.measure, f"{s.value:.4g}", f"{s.low:.4g} – {s.high:.4g}",
                         "" if s.detail is None else f"{s.detail:.3f}"] for s in result.base],
                       ["measure", "the model itself", "95% interval", "mean answer log-likelihood (probes)"])
    sure = result.better(rank)
    verdict = (f"{len(sure)} of {len(result.rows)} blocks are better on {rank} with the whole 95% interval of the change "
               "on the better side" if sure else
               f"no block is better on {rank} beyond the 95% interval of the change (the probes may be too small to tell)")
    times = times_in_words(result.repeats)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>layerplan explore --blocks: {html.escape(result.model)}</title>
{_STYLE}</head><body>
<h1>layerplan explore --blocks — {html.escape(result.model)}</h1>
<p>Every block i..j of layers repeated {times} right after itself ({len(result.rows)} candidates in
{result.seconds:.0f} s{", the model's residual stream shared up to each block's end" if result.reuse else ""}),
scored against the model itself. Intervals are 95% percentile bootstrap intervals; the change is paired
(the same resample of tokens or items for the block and for the model).</p>
<p><b>Best by {html.escape(rank)}:</b> <code>{html.escape(best.plan)}</code> (block {best.start}-{best.end}),
change {best.score(rank).change:+.4g} [{best.score(rank).change_low:+.4g}, {best.score(rank).change_high:+.4g}].
{html.escape(verdict)}.</p>
<p><b>Export it:</b><br>{"<br>".join(f"<code>{html.escape(c)}</code>" for c in commands)}</p>
<h2>The model itself</h2>{base}
<h2>Top {min(top, len(result.rows))} blocks by {html.escape(rank)}</h2>{_html_table(rows, header)}
{_inline_images(images)}
</body></html>"""
    return write_bytes_atomic(path, page.encode("utf-8"))


def frontier_plot(result, path: str | Path) -> Path:
    """Each drafter's measured acceptance against its draft cost, over the break-even curve of
    this machine's verify costs (decoding/frontier.py), as a PNG."""
    fig, ax = _figure(6.4, 4.4)
    curve = [(c, a) for c, a in result.curve if a is not None]
    if curve:
        costs, alphas = zip(*curve)
        ax.plot(costs, alphas, color="black", linewidth=1.2, label="break-even (best draft length)")
        ax.fill_between(costs, alphas, 1.0, color="tab:green", alpha=0.08, label="a draft here can pay")
    for point in result.points:
        colour = "tab:green" if point.above_break_even else "tab:red"
        ax.scatter([point.draft_cost], [point.acceptance], color=colour, s=28, zorder=3)
        ax.annotate(f"{point.draft} ({point.measured_speedup:.2f}x)", (point.draft_cost, point.acceptance),
                    textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlim(-0.02, max([1.2] + [p.draft_cost + 0.1 for p in result.points]))
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("draft step cost (plain steps)")
    ax.set_ylabel("per-token acceptance α")
    ax.set_title(f"{result.model} ({result.precision}): draft frontier at γ={result.gamma}, "
                 f"plain {result.plain_ms_per_token:.1f} ms/token", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)
