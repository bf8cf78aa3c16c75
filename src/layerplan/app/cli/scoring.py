"""`layerplan ppl` and `layerplan scan`: their options defined without torch, so that
app/launch.py reads a line with the command itself before it chooses a front end
(light_ppl_request, light_scan_request: the light one where it computes what this one prints:
search/windows.py's perplexity, search/importance.py's scan, on the same logits). Running one on
torch imports the rest (app/cli/research.py run_ppl_command, run_scan_command); report_scan
writes a scan's outputs for either front end."""

from __future__ import annotations

import importlib
from pathlib import Path

import click

from layerplan.app.options import (Output, device_option, dtype_option, light_context, model_b_option, model_option,
                                   threads_option)
from layerplan.app.report import exits_plot, scan_heatmap
from layerplan.files import write_json_atomic
from layerplan.lite.research_request import LitePerplexityRequest, LiteScanRequest
from layerplan.search.importance import EXIT, ScanResult, save_cached_scan
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
    the full model or one that takes layers from --model-b too, in either protocol. A device, help,
    or a line the command refuses give None: the torch front end reads the line then."""
    context = light_context(ppl, argv)
    if context is None:
        return None
    given = context.params
    return LitePerplexityRequest(model=given["model"], model_b=given["model_b"], dtype=given["dtype"],
                                 threads=given["threads"],
                                 text=given["text"], window=given["window"], stride=given["stride"],
                                 max_tokens=given["max_tokens"], plan=given["plan"], protocol=given["protocol"],
                                 compare=given["compare"])


@click.command()
@model_option
@dtype_option
@device_option
@threads_option
@click.option("--plan", "base_plan", default=None, help="base plan to scan (default: the full model)")
@click.option("--tokens", type=click.IntRange(min=2), default=512, show_default=True, help="calibration tokens")
@click.option("--text", type=click.Path(dir_okay=False), default=None,
              help="calibration text (.txt or .jsonl); default: built-in corpus")
@click.option("--kinds", default="attention,mlp,layer", show_default=True, help="what to switch off in turn")
@click.option("--exits", is_flag=True, help="scan every exit point instead (logit lens): writes exits.png")
@click.option("--no-reuse", is_flag=True, help="recompute from the embeddings for every candidate (naive baseline)")
@click.option("--out", type=Output("folder"), default="runs/scan", show_default=True,
              help="folder for scan.json and scan.png")
def scan(**options) -> None:
    """Skip each layer, attention and MLP in turn; report perplexity, KL and top-1 agreement.

    Interrupt it and run the same command again: it runs only the candidates left (each finished
    one is kept in OUT/scan.partial.jsonl until scan.json is written)."""
    # (the work's modules import torch: imported once the command line has been read)
    importlib.import_module("layerplan.app.cli.research").run_scan_command(**options)


def scan_kinds(kinds: str, exits: bool) -> list[str]:
    """--kinds and --exits as search/importance.py's kinds."""
    return [EXIT] if exits else [kind.strip() for kind in kinds.split(",")]


def light_scan_request(argv: list[str]) -> LiteScanRequest | None:
    """The light front end's request of `layerplan scan ...` (argv without the program), read by
    this command: a GGUF's scan on CPU at a dtype as stored, of any base plan of the model. A
    device, help, or a line the command refuses give None (the torch front end reads it then)."""
    context = light_context(scan, argv)
    if context is None:
        return None
    given = context.params
    return LiteScanRequest(model=given["model"], dtype=given["dtype"], threads=given["threads"],
                           plan=given["base_plan"], tokens=given["tokens"], text=given["text"],
                           kinds=scan_kinds(given["kinds"], given["exits"]), exits=given["exits"],
                           reuse=not given["no_reuse"], out=given["out"])


def report_scan(result: ScanResult, out: str, exits: bool) -> None:
    """A scan's table, its JSON and picture in `out` (--exits: as exits.json and exits.png),
    the copy `layerplan serve`'s page draws its plan builder from, and the closing lines: what
    either front end prints and writes."""
    click.echo(result.table())
    out_dir = Path(out)
    if exits:
        write_json_atomic(out_dir / "exits.json", result.to_dict())
        exits_plot(result, out_dir / "exits.png")
        click.echo(f"wrote {out_dir / 'exits.json'} and {out_dir / 'exits.png'}")
        return
    write_json_atomic(out_dir / "scan.json", result.to_dict())
    scan_heatmap(result, out_dir / "scan.png")
    save_cached_scan(result)
    least = ", ".join(item.label for item in result.ranked()[:6])
    click.echo(f"\nbase perplexity {result.base_perplexity:.3f} on {result.tokens} tokens; "
               f"{len(result.items)} candidates in {result.seconds:.1f}s ({'reuse' if result.reuse else 'naive'}"
               + (f"; {result.resumed} kept from the interrupted run before" if result.resumed else "") + ")")
    click.echo(f"least harmful to skip: {least}")
    click.echo(f"wrote {out_dir / 'scan.json'} and {out_dir / 'scan.png'}")


COMMANDS = (ppl, scan)  # registered on main (the package's __init__: COMMAND_INDEX)
