"""`layerplan plan`: validate a plan against a model's depth (its GGUF header or config.json, read
without torch) and print it in another format. Nothing here imports torch: a plan is checked in
the time the interpreter takes to start."""

from __future__ import annotations

import click

from layerplan.app.cli.errors import plain_user_errors
from layerplan.app.options import MODEL_HELP, Output
from layerplan.files import write_text_atomic
from layerplan.models.depth import model_depth
from layerplan.models.gguf_place import DEFAULT_MODEL
from layerplan.plan.formats import FORMATS, load_plan
from layerplan.plan.plan import MAX_STEPS


@click.command("plan")
@click.argument("plan")
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help=MODEL_HELP)
@click.option("--layers", type=click.IntRange(1, MAX_STEPS), default=None, help="model depth instead of reading --model")
@click.option("--to", "fmt", type=click.Choice(list(FORMATS)), default="string", show_default=True,
              help="; ".join(f"{f.name}: {f.help}" for f in FORMATS.values()))
@click.option("--out", type=Output("file"), default=None, help="write to this file (atomically)")
def plan_command(plan, model, layers, fmt, out) -> None:
    """Validate PLAN (string or file) and print it in another format."""
    with plain_user_errors():
        depth, name = (layers, "the model") if layers is not None else model_depth(model)
        text = FORMATS[fmt].dump(load_plan(plan, depth, name), model)
    if out:
        write_text_atomic(out, text + "\n")
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text)


COMMANDS = (plan_command,)  # registered on main (the package's __init__: COMMAND_INDEX)
