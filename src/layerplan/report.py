"""Pictures and tables for people: the scan heatmap. Nothing here computes results."""

from __future__ import annotations

from pathlib import Path

from layerplan.files import write_bytes_atomic
from layerplan.scan import KINDS, ScanResult


def scan_heatmap(result: ScanResult, path: str | Path, metric: str = "kl") -> Path:
    """Layers × {attention, MLP, whole layer}, coloured by `metric` (log scale), as a PNG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    layers = sorted({item.layer for item in result.items})
    grid = np.full((len(KINDS), len(layers)), np.nan)
    for item in result.items:
        grid[KINDS.index(item.kind), layers.index(item.layer)] = max(getattr(item, metric), 1e-6)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(layers) + 2), 2.8), dpi=120)
    finite = grid[np.isfinite(grid)]
    norm = LogNorm(vmin=max(finite.min(), 1e-4), vmax=finite.max()) if finite.size else None
    image = ax.imshow(grid, aspect="auto", cmap="magma_r", norm=norm, interpolation="nearest")
    ax.set_yticks(range(len(KINDS)), ["attention", "MLP", "layer"])
    ax.set_xticks(range(len(layers)), [str(layer) for layer in layers], fontsize=7)
    ax.set_xlabel("layer skipped")
    label = {"kl": "KL to full model (nats/token)", "perplexity_delta": "perplexity increase"}.get(metric, metric)
    fig.colorbar(image, ax=ax, label=label, fraction=0.03)
    ax.set_title(f"{result.model}: damage from skipping one sub-layer ({result.tokens} tokens)", fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return write_bytes_atomic(path, buffer.getvalue())


def explore_plot(result, path: str | Path) -> Path:
    """Perplexity against added compute for every explored layer order, as a PNG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
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
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return write_bytes_atomic(path, buffer.getvalue())
