"""`layerplan train-exit` and `layerplan tune`: their command lines, defined without torch (a
command's help and a mistyped option answer at once); running one imports its work
(app/cli/research.py)."""

from __future__ import annotations

import importlib

import click

from layerplan.app.options import (Output, auto_dtype_option, engine_option, model_option, n_predict_option,
                                   threads_option, transformers_option)


@click.command("train-exit")
@click.option("--exit", "exits", multiple=True, type=int, required=True, help="exit after this many steps (repeatable)")
@model_option
@auto_dtype_option
@threads_option
@click.option("--tokens", type=click.IntRange(min=2), default=2560, show_default=True, help="training + held-out tokens (built-in corpus unless --text)")
@click.option("--text", default=None, help=".txt or .jsonl, or builtin:code (standard-library Python source)")
@click.option("--steps", type=click.IntRange(min=1), default=150, show_default=True, help="optimiser steps (batches of 256 positions)")
@click.option("--out", type=Output("file"), default=None,
              help="where to save (default: the cache, where --draft exit:E+head finds it)")
def train_exit(**options) -> None:
    """Train light exit heads by self-distillation; use them with --draft exit:E+head.

    Interrupted, the same command goes on from the training's last checkpoint (kept every 30 s
    in the head's file name + .partial), to the head an uninterrupted run gives."""
    importlib.import_module("layerplan.app.cli.research").run_train_exit_command(**options)


@click.command()
@model_option
@auto_dtype_option
@engine_option
@threads_option
@click.option("--tokens", type=click.IntRange(min=2), default=256, show_default=True, help="calibration tokens for the scan and search")
@click.option("--steps", type=click.IntRange(min=1), default=8, show_default=True, help="greedy search steps")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="timings per method and prompt")
@n_predict_option(48, help="new tokens a prompt", dest="new_tokens")
@click.option("--prompt", "prompt_names", multiple=True, help="built-in prompts to tune on (default: code, summary)")
@transformers_option
@click.option("--out", type=Output("folder"), default="runs/tune", show_default=True)
def tune(**options) -> None:
    """The whole job: scan, search a draft, benchmark against plain decoding and transformers,
    check exactness, save the plan, write report.html and report.json.

    On a GGUF run as stored transformers is timed only with --transformers (it runs the file
    dequantized whole), and the exactness check decodes the file's blocks with exact products.
    Interrupted, the same command keeps its scan's finished candidates (OUT/scan.partial.jsonl)."""
    importlib.import_module("layerplan.app.cli.research").run_tune_command(**options)




COMMANDS = (train_exit, tune)  # registered on main (the package's __init__: COMMAND_INDEX)
