"""`layerplan explore`: its options defined without torch, so that app/launch.py reads a line with
the command itself before it chooses a front end (light_explore_request: the light one for the
grid of layer orders, search/explore.py over the same logits; --blocks and --search score task
probes and studies on the torch front end). Running it on torch imports the rest
(app/cli/research.py run_explore_command). report_explore writes the grid's outputs for either
front end."""

from __future__ import annotations

import importlib
from pathlib import Path

import click

from layerplan.app.options import (SEED, Output, device_option, dtype_option, light_context, model_b_option,
                                   model_option, threads_option)
from layerplan.app.report import explore_plot
from layerplan.files import write_json_atomic
from layerplan.lite.research_request import LiteExploreRequest
from layerplan.search.bayes import SAMPLERS
from layerplan.search.explore import ExploreResult
from layerplan.search.measure_registry import MEASURES


@click.command(epilog="\b\nMeasures (--measure, --rank):\n" + "\n".join(f"  {m.name:<11} {m.help}"
                                                                       for m in MEASURES.values()))
@model_option
@dtype_option
@device_option
@threads_option
@click.option("--recompute", default="6,8,10,12", show_default=True, help="layers run before each rewind (list)")
@click.option("--rewind", default="1,2,4,6", show_default=True, help="layers stepped back each time (list)")
@click.option("--plan", "plans", multiple=True, help="extra plan(s) to evaluate alongside the grid")
@click.option("--tokens", type=click.IntRange(min=2), default=None,
              help="evaluation tokens of the corpus / --text (default: 512; 256 with --blocks or --search)")
@click.option("--text", type=click.Path(dir_okay=False), default=None,
              help=".txt or .jsonl: the grid's evaluation text; with --blocks / --search a perplexity measure on it")
@click.option("--blocks", is_flag=True, help="scan every block i..j repeated after itself (0..j, i..j, j+1..N-1) "
              "against the model, on --measure; writes blocks.json and a heatmap per measure")
@click.option("--range", "layer_range", default=None, help="blocks inside these layers only, e.g. 4-25 (inclusive)")
@click.option("--max-len", type=click.IntRange(min=1), default=None, help="blocks of at most this many layers")
@click.option("--repeats", default="1", show_default=True,
              help="extra passes of the block: 1, 2, or 1,2 for both (a heatmap each; --search: the most it may choose)")
@click.option("--measure", "measures", multiple=True, type=click.Choice(list(MEASURES)),
              help="repeatable; default: ppl and arithmetic (plus text with --text, file with --probe-file, task with --task)")
@click.option("--rank", type=click.Choice(list(MEASURES)), default=None,
              help="the measure that ranks blocks and that --search optimises (default: the first)")
@click.option("--probe-file", type=click.Path(dir_okay=False), default=None,
              help='your probe: JSONL records {"prompt": ..., "answer": ...}')
@click.option("--probe-items", type=click.IntRange(min=1), default=24, show_default=True,
              help="items per built-in probe (documents of --task)")
@click.option("--task", default=None, help="a local lm-evaluation-harness task as a probe (loglikelihood, "
              "generate_until or multiple_choice; pip install 'layerplan[eval]')")
@click.option("--include-path", type=click.Path(exists=True, file_okay=False), default=None,
              help="folder of your own lm-evaluation-harness task YAML files")
@click.option("--seed", "-s", type=SEED, default=0, show_default=True,
              help="built-in probe items, bootstrap and the study's sampler")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="scan only the first N blocks (a quick look)")
@click.option("--no-reuse", is_flag=True, help="run every block from the embeddings (the naive baseline)")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="--blocks: candidates scored at once, each on one thread, instead of every thread on one "
              "candidate (default: torch's thread count; the scores are the same)")
@click.option("--report", is_flag=True, help="also write report.html (heatmaps, top blocks, export commands)")
@click.option("--search", "study", is_flag=True, help="an Optuna study over merge plans (block, repeats, residual "
              "scale, --model-b) optimising --rank; resumes from its storage; exports the best")
@click.option("--trials", type=click.IntRange(min=1), default=60, show_default=True, help="--search: finished trials in the study")
@click.option("--scales", default="0.5-1.0", show_default=True,
              help="--search: residual scale range of the repeated passes (one number fixes it)")
@click.option("--sampler", type=click.Choice(list(SAMPLERS)), default="tpe", show_default=True)
@click.option("--storage", default=None, help="--search: Optuna storage (default OUT/study.db; RDB URL or journal:PATH)")
@click.option("--study", "study_name", default=None, help="--search: study name (default MODEL-merge-MEASURE)")
@click.option("--export/--no-export", default=True, show_default=True,
              help="--search: write the best plan as a file of the model (OUT/best-merge.gguf for a GGUF's plan that a GGUF "
                   "holds, else a checkpoint, OUT/best-merge/) besides mergekit YAML")
@model_b_option
@click.option("--out", type=Output("folder"), default="runs/explore", show_default=True)
def explore(**options) -> None:
    """Explore in-situ frankenmerges.

    \b
    Default: a grid of recompute/rewind layer orders, perplexity against added compute.
    --blocks: every block i..j repeated after itself, scored on measures that say "better"
    (perplexity, task probes) with bootstrap intervals; --search: an Optuna study over merges."""
    # (the torch front end's modules: imported once the command line has been read)
    importlib.import_module("layerplan.app.cli.research").run_explore_command(**options)


def light_explore_request(argv: list[str]) -> LiteExploreRequest | None:
    """The light front end's request of `layerplan explore ...` (argv without the program): the
    grid of layer orders of a GGUF on CPU at a dtype as stored, with extra plans of this model.
    --blocks, --search, a second model, a device, help or a line the command refuses give None."""
    context = light_context(explore, argv)
    if context is None:
        return None
    given = context.params
    if given["model_b"] is not None or given["blocks"] or given["study"]:
        return None
    return LiteExploreRequest(model=given["model"], dtype=given["dtype"], threads=given["threads"],
                              recompute=given["recompute"], rewind=given["rewind"], plans=list(given["plans"]),
                              tokens=given["tokens"] or 512, text=given["text"], out=given["out"])


def report_explore(result: ExploreResult, out: str) -> None:
    """The grid's table, explore.json and explore.png in `out`, and its closing lines: what either
    front end prints and writes."""
    click.echo(result.table())
    out_dir = Path(out)
    write_json_atomic(out_dir / "explore.json", result.to_dict())
    explore_plot(result, out_dir / "explore.png")
    best = result.best()
    click.echo(f"\nfull model perplexity {result.base_perplexity:.3f}; best order {best.plan} "
               f"({best.perplexity:.3f}, {best.added_compute:+.0%} compute)"
               + (f"; {result.resumed} of {len(result.rows)} rows kept from the interrupted run before"
                  if result.resumed else ""))
    click.echo(f"wrote {out_dir / 'explore.json'} and {out_dir / 'explore.png'}")


COMMANDS = (explore,)  # registered on main (the package's __init__: COMMAND_INDEX)
