"""The `layerplan` command line: options, printing, progress bars and files; the work lives in the
modules the commands call. common.py holds what the commands share (options, loading a model as
asked, one-line errors); running.py, research.py and measuring.py the commands, by kind.

A command's module is imported when the command runs (or its own help is asked for): they import
torch, and `layerplan -h` or `--version` need none of it. COMMAND_INDEX says where each command
lives and what `layerplan -h` lists for it."""

from __future__ import annotations

import importlib
import os
import sys

import click
from click.utils import make_default_short_help

from layerplan.heap import keep_freed_memory
from layerplan.messages import one_line

# name -> (its module in this package, the first sentence of its help: what `layerplan -h` lists,
# cut to the terminal's width as click cuts a command's own; tests/test_familiar_flags.py checks
# each against the command's docstring)
COMMAND_INDEX = {
    "bench": ("timing", "Time decoding against transformers' generate in the same run (ratios, CPU)."),
    "chat": ("chatting", "A multi-turn conversation in the model's chat template, streamed; /help lists the commands."),
    "eval": ("serving", "Evaluate the model under a plan with lm-evaluation-harness (pip install 'layerplan[eval]')."),
    "explore": ("exploring", "Explore in-situ frankenmerges."),
    "export": ("exporting", "Write PLAN as a real Hugging Face checkpoint, a GGUF file of the source's stored "
                          "blocks, or mergekit passthrough YAML."),
    "frontier": ("timing", "Each draft's measured acceptance against its measured cost on this machine, beside "
                              "the break-even curve of the probe's verify costs: whether any self-draft can pay here, "
                              "and by how much."),
    "generate": ("generating", "Generate a continuation of PROMPT (or -p TEXT, -f FILE), or of every prompt of "
                            "--prompt-file."),
    "models": ("listing", "List the model files the cache holds folders for, and what each weighs; the packaged "
                          "default first."),
    "peers": ("peering", "llama.cpp's own C++ tools, which `layerplan bench` times beside layerplan."),
    "plan": ("planning", "Validate PLAN (string or file) and print it in another format."),
    "ppl": ("scoring", "Perplexity of the model (under a plan) on a text: sliding windows, or llama-perplexity's "
                        "chunks."),
    "probe": ("timing", "Time a pass over k = 1..16 new tokens per dtype and engine on this machine: the cost of "
                           "verifying k drafted tokens relative to one decoding step."),
    "scan": ("scoring", "Skip each layer, attention and MLP in turn; report perplexity, KL and top-1 agreement."),
    "search": ("searching", "Find a good plan: greedy skipping and/or a Bayesian (Optuna) study; resumable, "
                           "shareable."),
    "serve": ("serving", "OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming), "
                         "/v1/models, /health, and a web playground at /."),
    "train-exit": ("tuning", "Train light exit heads by self-distillation; use them with --draft exit:E+head."),
    "tune": ("tuning", "The whole job: scan, search a draft, benchmark against plain decoding and transformers, "
                         "check exactness, save the plan, write report.html and report.json."),
}


class _Commands(click.Group):
    """The commands of COMMAND_INDEX, each imported when first asked for; and click's standalone
    mode, except that a usage error is one line, 'Error: WHAT (see 'layerplan CMD -h')', instead of
    click's usage block, hint and blank line before it; every error is one line (one_line)."""

    process_is_the_command = False  # set by run_as_process, read by common.py (see its freeze)

    def list_commands(self, ctx) -> list[str]:
        return sorted({*COMMAND_INDEX, *self.commands})

    def get_command(self, ctx, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMAND_INDEX:
            module = importlib.import_module(f"{__name__}.{COMMAND_INDEX[name][0]}")
            for command in module.COMMANDS:
                self.add_command(command)
        return self.commands.get(name)

    def all_commands(self) -> dict[str, click.Command]:
        """Every command, each module imported (for the tests and tools that walk the tree)."""
        return {name: self.get_command(None, name) for name in self.list_commands(None)}

    def format_commands(self, ctx, formatter) -> None:
        """The listing of `layerplan -h` from COMMAND_INDEX: no command's module imported for it."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(name, self.commands[name].get_short_help_str(limit) if name in self.commands
                 else make_default_short_help(COMMAND_INDEX[name][1], limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as error:  # bare `layerplan`: the help, whole
            click.echo(error.format_message(), err=True)
            sys.exit(error.exit_code)
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
        _quiet_progress_bars()


def _quiet_progress_bars() -> None:
    """transformers' and the hub's progress bars off, without importing transformers where it is
    not imported yet (half a second of a GGUF command's start that never runs it): both read the
    hub's variable when they are first imported; a user's explicit HF_HUB_DISABLE_PROGRESS_BARS
    is theirs."""
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def run_as_process() -> None:
    """The console entry: this process runs one command and ends with it (and so its C heap keeps
    freed blocks for the next pass: heap.py)."""
    main.process_is_the_command = True
    keep_freed_memory()
    main()
