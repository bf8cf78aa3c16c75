"""`layerplan search`: its options defined without torch, so that app/launch.py reads a line with
the command itself before it chooses a front end (light_search_request: the light one where it
computes what this one prints: search/plan_search.py over the same scores); running it on torch
imports the rest (app/cli/research.py run_search_command). report_search writes a search's outputs
for either front end."""

from __future__ import annotations

import importlib
from pathlib import Path

import click

from layerplan.app.options import SEED, Output, dtype_option, light_context, model_option, threads_option
from layerplan.app.report import pareto_plot, search_trajectory, skip_frequency_plot
from layerplan.files import write_json_atomic
from layerplan.lite.research_request import LiteSearchRequest
from layerplan.plan.formats import save_plan
from layerplan.search.bayes import SAMPLERS
from layerplan.search.objectives import OBJECTIVES, objectives_help
from layerplan.search.plan_search import METHODS, SearchResult


@click.command(epilog="\b\nObjectives:\n" + objectives_help())
@model_option
@dtype_option
@threads_option
@click.option("--method", type=click.Choice(list(METHODS)), default="both", show_default=True,
              help="; ".join(f"{name}: {text}" for name, text in METHODS.items()))
@click.option("--objective", type=click.Choice(list(OBJECTIVES)), default="speedup", show_default=True,
              help="what to optimise (see below)")
@click.option("--multi", is_flag=True, help="optimise the objective and the plan's cost together (Pareto front)")
@click.option("--trials", type=click.IntRange(min=1), default=100, show_default=True, help="finished trials in the study, all workers together")
@click.option("--budget", type=click.IntRange(min=1), default=None, help="greedy: sub-layers (or layers) to switch; default 20")
@click.option("--max-cost-cut", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
              help="greedy: stop once this fraction of the model's sub-layers is switched off (e.g. 0.3)")
@click.option("--granularity", type=click.Choice(["sublayer", "layer"]), default="sublayer", show_default=True)
@click.option("--mode", type=click.Choice(["forward", "anti"]), default="forward", show_default=True,
              help="greedy: skip the least harmful (forward) or start skipped and add back the most useful (anti)")
@click.option("--sampler", type=click.Choice(list(SAMPLERS)), default="tpe", show_default=True,
              help="; ".join(f"{name}: {sampler.help}" for name, sampler in SAMPLERS.items()))
@click.option("--storage", default=None, help="Optuna storage: SQLite path (default OUT/study.db), any RDB URL "
              "(postgresql://user@host/db), or journal:PATH")
@click.option("--study", "study_name", default=None, help="study name (default: MODEL-OBJECTIVE); share it across machines")
@click.option("--storage-patience", type=click.FloatRange(min=0), default=600, show_default=True, metavar="SECONDS",
              help="how long a worker waits for an unreachable database server (retrying) before it gives up")
@click.option("--tokens", type=click.IntRange(min=2), default=512, show_default=True, help="calibration tokens")
@click.option("--text", type=click.Path(dir_okay=False), default=None, help="calibration text (.txt/.jsonl)")
@click.option("--allow-ends", is_flag=True, help="allow skipping the first and last layers")
@click.option("--save-draft/--no-save-draft", default=None,
              help="save the best plan for `--draft auto` (default: for "
                   f"{'/'.join(name for name, o in OBJECTIVES.items() if o.drafts)})")
@click.option("--seed", "-s", type=SEED, default=None,
              help="makes the study's sampler seeds reproducible (each worker still gets its own); default: fresh")
@click.option("--out", type=Output("folder"), default="runs/search", show_default=True)
def search(**options) -> None:
    """Find a good plan: greedy skipping and/or a Bayesian (Optuna) study; resumable, shareable.

    \b
    Interrupt it (Ctrl-C, kill) and run the same command again: it resumes from its storage.
    Run the same command with the same --storage URL and --study name on several machines and
    they share one study; a worker rides out a database restart (--storage-patience), and
    SIGTERM or Ctrl-C fails its running trial so that the study asks that plan again."""
    # (the torch front end's modules: imported once the command line has been read)
    importlib.import_module("layerplan.app.cli.research").run_search_command(**options)


def light_search_request(argv: list[str]) -> LiteSearchRequest | None:
    """The light front end's request of `layerplan search ...` (argv without the program), read by
    this command: a GGUF's search on CPU at a dtype as stored, for any objective but
    tokens-per-second (which times speculative decoding: the torch front end's). Help, or a line
    the command refuses give None (the torch front end reads it then)."""
    context = light_context(search, argv)
    if context is None:
        return None
    given = context.params
    if OBJECTIVES[given["objective"]].needs_prompts:
        return None
    return LiteSearchRequest(**given)


def report_search(result: SearchResult, model, model_source: str, out: str, save_draft: bool | None) -> None:
    """A search's plots, best_plan.json and search.json in `out`, and its lines: what either front
    end prints and writes. model: the searched model (its plans, its layers)."""
    out_dir = Path(out)
    objective = result.objective
    direction = OBJECTIVES[objective].direction
    if result.greedy is not None:
        greedy = result.greedy
        if greedy.steps:
            search_trajectory([step.value for step in greedy.steps], direction,
                              f"{objective} after each greedy step", out_dir / "greedy.png")
        click.echo(f"greedy: {len(greedy.steps)} steps, {greedy.evaluations} evaluations; plan {greedy.best_plan}")
    if result.study is not None:
        study = result.study
        ranked = study.ranked()
        search_trajectory([t.values[0] for t in study.trials if t.state == "COMPLETE"], direction, objective,
                          out_dir / "trajectory.png")
        if result.multi:
            pareto_plot([(t.values[0], t.values[1]) for t in ranked],
                        [(t.values[0], t.values[1]) for t in study.pareto], objective, out_dir / "pareto.png")
        top = [model.plan(t.plan) for t in ranked[: max(1, len(ranked) // 10)] if t.plan]
        if top:
            skip_frequency_plot(top, model.num_layers, out_dir / "skip-frequency.png")
        if study.stale_failed:
            click.echo(f"marked failed: trial(s) {', '.join(map(str, study.stale_failed))} of workers that died",
                       err=True)
        click.echo(f"study '{study.study}': {len(ranked)} finished trials; best {objective} {study.best_value} "
                   f"with plan {study.best_plan}")
    best_plan = result.best_plan
    save_plan(best_plan, out_dir / "best_plan.json")
    write_json_atomic(out_dir / "search.json", {"model": model_source, **result.to_dict()})
    if result.saved_draft is not None:
        click.echo(f"saved for --draft auto: {result.saved_draft}")
    elif save_draft if save_draft is not None else OBJECTIVES[objective].drafts:
        click.echo("no skip plan beats the full model here: nothing saved for --draft auto (it uses n-gram)")
    click.echo(f"best plan: {best_plan}  (agreement {result.best.top1_agreement:.3f}, KL {result.best.kl:.4f})")
    click.echo(f"wrote {out_dir / 'best_plan.json'}, {out_dir / 'search.json'} and plots in {out_dir}")


COMMANDS = (search,)  # registered on main (the package's __init__: COMMAND_INDEX)
