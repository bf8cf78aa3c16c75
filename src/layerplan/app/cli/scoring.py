"""`layerplan ppl`'s command line: its options defined without torch, so that app/launch.py reads a
line with the command itself before it chooses a front end (light_ppl_request: the light one
where it computes what this one prints, search/windows.py's perplexity on the same logits).
Running it on torch imports the rest (app/cli/research.py run_ppl_command)."""

from __future__ import annotations

import importlib

import click

from layerplan.app.options import (DEVICE_MAP_KEY, device_option, dtype_option, light_context, model_b_option,
                                   model_option, threads_option)
from layerplan.lite.request import ARITHMETICS, LitePerplexityRequest
from layerplan.search.windows import PROTOCOLS


@click.command()
@model_option
@dtype_option
@device_option
@threads_option
@click.option("--plan", default=None, help="plan to evaluate (default: full model)")
@model_b_option
@click.option("--text", "-f", "--file", "text", type=click.Path(dir_okay=False), default=None,
              help=".txt or .jsonl; default: built-in corpus (llama-perplexity's -f)")
@click.option("--window", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--stride", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=0), default=4096, show_default=True,
              help="score at most this many tokens per text (0: all)")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="also report KL and top-1 agreement against the full model")
@click.option("--protocol", type=click.Choice(list(PROTOCOLS)), default="sliding", show_default=True,
              help="; ".join(f"{name}: {text}" for name, text in PROTOCOLS.items()))
def ppl(**options) -> None:
    """Perplexity of the model (under a plan) on a text: sliding windows, or llama-perplexity's chunks."""
    # (the work's modules import torch: imported once the command line has been read)
    importlib.import_module("layerplan.app.cli.research").run_ppl_command(**options)


def light_ppl_request(argv: list[str]) -> LitePerplexityRequest | None:
    """The light front end's request of `layerplan ppl ...` (argv without the program), read by this
    command as it reads any line: a GGUF's perplexity on CPU at a dtype as stored, under a plan or
    the full model, in either protocol. A second model, a device, help, or a line the command
    refuses give None: the torch front end reads the line then (and where the plan turns out to
    take layers of a second model, lite/cli.py leaves it to the torch front end)."""
    context = light_context(ppl, argv)
    if context is None:
        return None
    given = context.params
    if (given["dtype"] not in ARITHMETICS or given["device"] != "cpu" or context.meta.get(DEVICE_MAP_KEY) is not None
            or given["model_b"] is not None):
        return None
    return LitePerplexityRequest(model=given["model"], dtype=given["dtype"], threads=given["threads"],
                                 text=given["text"], window=given["window"], stride=given["stride"],
                                 max_tokens=given["max_tokens"], plan=given["plan"], protocol=given["protocol"],
                                 compare=given["compare"])


COMMANDS = (ppl,)  # registered on main (the package's __init__: COMMAND_INDEX)
