"""`layerplan serve` and `layerplan eval`: their command lines, defined without torch (a command's
help, a mistyped option and a bad --host or --api-key answer at once); running one imports its
work (app/cli/running.py)."""

from __future__ import annotations

import importlib
import ipaddress
import re

import click

from layerplan.app.options import (DRAFT_LENGTH_HELP, Output, ctx_size_option, decoding_model_options,
                                   device_option, dtype_option, engine_option, model_b_option, model_option,
                                   threads_option)
from layerplan.decoding.draft_length import DRAFT_LENGTHS


@click.command()
@decoding_model_options
@click.option("--plan", default=None, help="serve the model run by this plan (lossy unless it is the full model)")
@model_b_option
@click.option("--draft", default=None, help="lossless speculative decoding with this drafter (as in generate)")
@click.option("--draft-length", default=None, type=click.Choice(list(DRAFT_LENGTHS)), help=DRAFT_LENGTH_HELP)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="as llama-server's")
@click.option("--api-key", envvar="LAYERPLAN_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' on /v1/* (or set LAYERPLAN_API_KEY); not empty")
@click.option("--alias", "-a", "--served-name", "served_name", default=None,
              help="the model id clients send (default: the model's name)")
@ctx_size_option
@click.option("--parallel", "-np", "--max-batch", "max_batch", type=click.IntRange(1, 64), default=None,
              help="requests decoded at once, each pass carrying a token of each (continuous batching; "
                   "with a --draft that runs a model, one request at a time); default: the fewest whose pass "
                   "reaches 90% of the best tokens/s in this machine's probe of the model (`layerplan probe`), "
                   "8 without one")
def serve(**options) -> None:
    """OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming),
    /v1/models, /health, and a web playground at /. Up to --parallel requests decode at once, in
    arrival order (continuous batching: each pass carries the next token of every one; a request's
    tokens are those of its solo run); /health shows the batch."""
    if options["api_key"] is not None and not options["api_key"].strip():
        raise click.BadParameter("an empty key would switch authentication off: give a key, or leave --api-key "
                                 "and LAYERPLAN_API_KEY out to serve without one", param_hint="'--api-key'")
    _check_host(options["host"])
    importlib.import_module("layerplan.app.cli.running").run_serve_command(**options)


@click.command("eval")
@click.option("--tasks", required=True, help="lm-evaluation-harness task names, comma-separated")
@model_option
@dtype_option
@device_option
@engine_option
@threads_option
@click.option("--plan", default=None, help="evaluate the model run by this plan")
@click.option("--draft", default=None, help="drafter for generate_until tasks (same output, faster)")
@click.option("--include-path", type=click.Path(exists=True, file_okay=False), default=None,
              help="folder of your own task YAML files")
@click.option("--limit", type=click.FloatRange(0.0, min_open=True), default=None, help="documents per task (or a fraction)")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None)
@click.option("--out", type=Output("file"), default="runs/eval.json", show_default=True)
def eval_command(**options) -> None:
    """Evaluate the model under a plan with lm-evaluation-harness (pip install 'layerplan[eval]').
    Tasks whose data is not on disk are downloaded by lm_eval itself."""
    importlib.import_module("layerplan.app.cli.running").run_eval_command(**options)


def _check_host(host: str) -> None:
    """A usage error for a --host that is no IP address and no host name (999.1.1.1, a space);
    whether a name is this machine's is known when the server binds it."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host) or ":" in host:
        raise click.BadParameter(f"{host} is not an IP address (e.g. 127.0.0.1, 0.0.0.0 or ::1)",
                                 param_hint="'--host'")
    label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    if len(host) > 253 or not re.fullmatch(rf"{label}(\.{label})*\.?", host):
        raise click.BadParameter(f"{host!r} is not a host name or IP address (e.g. localhost, 127.0.0.1)",
                                 param_hint="'--host'")


COMMANDS = (eval_command, serve)  # registered on main (the package's __init__: COMMAND_INDEX)
