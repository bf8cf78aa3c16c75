"""`layerplan models`: the model files the cache holds folders for, what each weighs, and (with
--prune) the folders of files gone or changed removed; the architectures' table and check, which
run on torch (app/cli/measuring.py). The listing itself imports no torch."""

from __future__ import annotations

import importlib
import json

import click

from layerplan.files import cache_dir
from layerplan.models.cache_listing import STALE, CachedModel, CacheListing, cache_listing, prune_stale


def _size(count: int | None) -> str:
    if count is None:
        return "-"
    for unit, scale in (("GB", 2 ** 30), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count} B"


@click.command()
@click.option("--architectures", is_flag=True,
              help="list every causal LM architecture of the installed transformers with its status instead")
@click.option("--markdown", is_flag=True, help="with --architectures: as a Markdown table")
@click.option("--check", metavar="TYPE|MODEL", default=None,
              help="check one architecture now (a model_type such as olmo2, or a model folder): the identity plan "
                   "against transformers on a tiny random config of it; the answer is cached")
@click.option("--prune", is_flag=True, help="remove the cache folders of model files gone or changed since")
@click.option("--json", "as_json", is_flag=True, help="the listing as one JSON object")
def models(architectures, markdown, check, prune, as_json) -> None:
    """List the model files the cache holds folders for, and what each weighs; the packaged default first."""
    if markdown and not architectures:
        raise click.UsageError("--markdown formats the --architectures table: add --architectures")
    if check or architectures:  # (their modules import torch)
        measuring = importlib.import_module("layerplan.app.cli.measuring")
        if check:
            measuring.run_architecture_check(check)
        measuring.print_architectures(markdown)
        return
    listing = cache_listing(cache_dir())
    if prune:
        pruned = prune_stale(listing)
        click.echo(f"removed the folders of {pruned.files} model files gone or changed: "
                   f"{_size(pruned.freed_bytes)} freed", err=True)
        listing = pruned.listing
    if as_json:
        click.echo(json.dumps(listing.to_dict(), indent=2))
        return
    for line in _lines(listing):
        click.echo(line)


def _lines(listing: CacheListing) -> list[str]:
    """The listing for a person: each present file and its folders, the stale ones summed."""
    lines = []
    for model in listing.models:
        if model.state in STALE:
            continue
        lines.append(_headline(model))
        for folder in model.folders:
            note = "  (float32 or bfloat16 weights a command was asked for: free to delete)" \
                if folder.kind == "dense copy" else ""
            lines.append(f"    {folder.kind:<11} {_size(folder.bytes):>10}  {folder.path}{note}")
    stale = [m for m in listing.models if m.state in STALE]
    if stale:
        lines.append(f"{len(stale)} model files gone or changed since their folders were made: "
                     f"{sum(len(m.folders) for m in stale)} folders, {_size(sum(m.cache_bytes for m in stale))} "
                     "(`layerplan models --prune` removes them)")
    others = ", ".join(f"{label} {_size(size)}" for label, size in listing.others.items())
    lines.append(f"cache {listing.cache}: {_size(listing.total_bytes)}" + (f" (also {others})" if others else ""))
    return lines


def _headline(model: CachedModel) -> str:
    if model.source is None:
        return "folders that record no source file (made by an older layerplan)"
    name = "the packaged default (smollm2)" if model.default else "GGUF"
    cached = f"; cache {_size(model.cache_bytes)}" if model.folders else "; nothing cached yet"
    return f"{model.source}  [{name}, {_size(model.file_bytes)}{cached}]"


COMMANDS = (models,)  # registered on main (the package's __init__: COMMAND_INDEX)
