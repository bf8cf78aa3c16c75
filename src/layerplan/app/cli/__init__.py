"""The `layerplan` command line: options, printing, progress bars and files; the work lives in the
modules the commands call. common.py holds what the commands share (options, loading a model as
asked, one-line errors); running.py, research.py and measuring.py the commands, by kind."""

from __future__ import annotations

import sys

import click

from layerplan.app.cli import common, measuring, research, running
from layerplan.messages import one_line


class _Commands(click.Group):
    """click's standalone mode, except that a usage error is one line, 'Error: WHAT (see
    'layerplan CMD -h')', instead of click's usage block, hint and blank line before it; every
    error is one line (one_line)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as error:
            where = f" (see '{error.ctx.command_path} -h')" if error.ctx is not None else ""
            click.echo(f"Error: {one_line(error.format_message())}{where}", err=True)
            sys.exit(error.exit_code)
        except click.ClickException as error:
            click.echo(f"Error: {one_line(error.format_message())}", err=True)
            sys.exit(error.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except BrokenPipeError:  # `layerplan … | head` closed the pipe: nothing more to say
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="layerplan")
def main() -> None:
    """Run a transformer's layers by plan: skip, exit early, repeat, reorder, self-speculate.

    \b
    Plans: "0-26,20-31" (order, repeats), "skip:attn=3,5;mlp=9", "exit:8", joined with ';',
    or a file (.json layerplan / Draft&Verify / run_layers, .yaml mergekit slices).
    """
    if not sys.stderr.isatty():  # transformers' weight-loading bars would print every redraw to a log
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


for command in (*running.COMMANDS, *research.COMMANDS, *measuring.COMMANDS):
    main.add_command(command)


def run_as_process() -> None:
    """The console entry: this process runs one command and ends with it."""
    common.PROCESS_IS_THE_COMMAND = True
    main()
