"""`layerplan export`: its command line, defined without torch (its help and a mistyped option
answer at once); running it imports its work (app/cli/running.py)."""

from __future__ import annotations

import importlib

import click

from layerplan.app.options import export_dtype_option, model_b_option, model_option
from layerplan.export_formats import EXPORT_FORMATS


@click.command()
@click.argument("plan")
@model_option
@export_dtype_option
@click.option("--out", type=click.Path(), required=True,
              help="folder (checkpoint), .gguf file (gguf) or .yaml file (mergekit)")
@click.option("--to", "fmt", type=click.Choice(list(EXPORT_FORMATS)), default=None,
              help="; ".join(f"{name}: {text}" for name, text in EXPORT_FORMATS.items())
              + "  [default: by --out: NAME.gguf gguf, NAME.yaml mergekit, else checkpoint]")
@click.option("--source", default=None, help="model name written into mergekit YAML (default: --model)")
@model_b_option
def export(**options) -> None:
    """Write PLAN as a real Hugging Face checkpoint, a GGUF file of the source's stored blocks, or mergekit passthrough YAML.

    \b
    The checkpoint loads in transformers (and converts for llama.cpp / vLLM) like any model;
    the GGUF file (a GGUF source) runs in llama.cpp as it is; a plan with fewer layers is a
    pruned model usable as a standalone draft model."""
    importlib.import_module("layerplan.app.cli.running").run_export_command(**options)



COMMANDS = (export,)  # registered on main (the package's __init__: COMMAND_INDEX)
