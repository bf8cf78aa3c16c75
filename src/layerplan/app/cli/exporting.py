"""`layerplan export`: its command line, defined without torch (its help and a mistyped option
answer at once); running it imports its work (app/cli/running.py)."""

from __future__ import annotations

import importlib

import click

from layerplan.app.options import export_dtype_option, light_context, model_b_option, model_option
from layerplan.export_formats import EXPORT_FORMATS, export_format_of
from layerplan.lite.request import LiteExportRequest
from layerplan.models.gguf_place import gguf_of


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


def light_export_request(argv: list[str]) -> LiteExportRequest | None:
    """The light front end's request of `layerplan export ...` (argv without the program), read by
    this command: a GGUF's plan as a GGUF file (its blocks copied, never run), or any model's plan
    as mergekit YAML (its config alone). A checkpoint (written from torch modules), a GGUF file of
    two models or of a source that is not a GGUF (the torch front end says why not), help, or a
    line the command refuses give None."""
    context = light_context(export, argv, any_dtype=True)
    if context is None:
        return None
    given = context.params
    fmt = given["fmt"] or export_format_of(given["out"])
    if fmt == "checkpoint" or (fmt == "gguf" and (given["model_b"] or gguf_of(given["model"]) is None)):
        return None
    return LiteExportRequest(model=given["model"], model_b=given["model_b"], plan=given["plan"], out=given["out"],
                             fmt=fmt, source=given["source"], yaml_dtype=given["dtype"])


COMMANDS = (export,)  # registered on main (the package's __init__: COMMAND_INDEX)
