"""`layerplan peers`: llama.cpp's own C++ tools (app/llamacpp.py), built once from a pinned source
and found again; `layerplan bench` times them beside layerplan. Without torch."""

from __future__ import annotations

import click

from layerplan.app import llamacpp
from layerplan.app.cli.errors import plain_user_errors


@click.group()
def peers() -> None:
    """llama.cpp's own C++ tools, which `layerplan bench` times beside layerplan."""


@peers.command("build", help=(
    f"Build llama.cpp's tools once from source into the cache ({', '.join(llamacpp.TOOLS)}).\n\n"
    f"The source is a pinned sdist from PyPI (default: {llamacpp.SOURCES[llamacpp.PINNED].describe()}); cmake "
    "and a C++ compiler build it (Release, CPU only, GGML_NATIVE=ON: tuned to this machine; ~10-20 min on 2 "
    "cores). The build runs in a staging folder that is renamed into <cache>/llama.cpp/<source> when done; a "
    "finished build is found and kept (--force builds again)."))
@click.option("--source", type=click.Choice(list(llamacpp.SOURCES)), default=llamacpp.PINNED, show_default=True,
              help="; ".join(f"{name}: {source.describe()}" for name, source in llamacpp.SOURCES.items()))
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=2, show_default=True, help="parallel compile jobs")
@click.option("--force", is_flag=True, help="build again even when a finished build is there")
def peers_build(source, jobs, force) -> None:
    with plain_user_errors(llamacpp.LlamaCppBuildError):
        bin_dir = llamacpp.build(source, jobs=jobs, force=force, log=lambda line: click.echo(line, err=True))
    click.echo(bin_dir)


@peers.command("show")
def peers_show() -> None:
    """Where llama.cpp's tools are and how they were built; exit status 1 when not built."""
    bin_dir = llamacpp.find_tools()
    if bin_dir is None:
        raise click.ClickException(llamacpp.missing_message("llama.cpp rows of `layerplan bench`"))
    info = llamacpp.build_info(bin_dir)
    click.echo(bin_dir)
    for key in ("llama_cpp", "sdist", "built", "seconds", "jobs", "tools"):
        if key in info:
            click.echo(f"  {key}: {', '.join(info[key]) if isinstance(info[key], list) else info[key]}")


COMMANDS = (peers,)  # registered on main (the package's __init__: COMMAND_INDEX)
