"""What the commands share: their common options, the loading of a model as a command line asks
for it, progress bars on stderr, and bad input turned into one line."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path

import click
import torch

from layerplan.app import llamacpp
from layerplan.app.cli.errors import plain_user_errors
from layerplan.app.bars import Progress, Stages
from layerplan.app.options import DEVICE_MAP_KEY, GPU_LAYERS_KEY, gpu_layers_device
from layerplan.app.peers import LlamaToolError
from layerplan.engine.choices import BLOCK_PRECISIONS
from layerplan.engine.load import choose_dtype, load_model
from layerplan.engine.native import NativeUnavailable
from layerplan.engine.probe import checked_model_row, load_probe
from layerplan.messages import one_line
from layerplan.models.depth import model_depth
from layerplan.models.gguf_index import file_index
from layerplan.models.gguf_place import TENSORS_FILE, index_folder
from layerplan.models.loading import cache_dir, dense_bytes, gguf_of, resolve_device


@contextmanager
def user_errors():
    """Bad input becomes a one-line message and exit status 1, not a traceback (errors.py's, and
    the native kernels' and llama.cpp's tools' own)."""
    with plain_user_errors(NativeUnavailable, LlamaToolError, llamacpp.LlamaCppBuildError):
        yield


def _gguf_path(model: str) -> Path | None:
    """The GGUF file the source names, or None; a place this user may not read counts as none here
    (loading it names the problem in one line)."""
    try:
        return gguf_of(model)
    except (OSError, RuntimeError):
        return None


def command_dtype(model: str, dtype: str, engine: str, device: str = "cpu", dense: str | None = None) -> str:
    """'auto' -> a GGUF as stored; else `dense` where given (the research commands: float32), else the
    dtype this machine's probe found fastest for the model (see `layerplan probe`)."""
    # (a GGUF's auto is GGUF_DEFAULT whatever the probe says: its name would cost a header read)
    wanted = dtype == "auto" and dense is None and _gguf_path(model) is None
    probe = load_probe(cache_dir(), model_depth(model)[1]) if wanted else None
    return choose_dtype(dtype, engine, device, probe, source=model, dense=dense)


def checked_probe_row(loaded):
    """This machine's probe row for the loaded model, checked by one timed step and measured again
    when it is off by more than 2x (probe.checked_model_row); None when none is cached, or when the
    model is not all on the CPU, where the probe times its rows."""
    if loaded.device.type != "cpu" or loaded.placement is not None:
        return None
    return checked_model_row(loaded, cache_dir(), on_note=lambda line: click.echo(line, err=True))


def _device_map() -> str | None:
    """The command's --device-map (device_option keeps it in the click context)."""
    context = click.get_current_context(silent=True)
    return context.meta.get(DEVICE_MAP_KEY) if context is not None else None


def _gpu_layers_device(device: str) -> tuple[str, str | None]:
    """The command's device given its -ngl (device_option keeps it in the click context), and the
    note where -ngl changes nothing. A device map places the model itself."""
    context = click.get_current_context(silent=True)
    layers = context.meta.get(GPU_LAYERS_KEY) if context is not None else None
    if _device_map() is not None:
        return device, None
    return gpu_layers_device(layers, device, torch.cuda.is_available())


def load(model: str, dtype: str, device: str = "cpu", engine: str = "auto", dense: str | None = None,
          ctx_size: int = 0):
    """The model at `dtype` ('auto': see command_dtype; `dense`: what 'auto' means for a model that is not
    a GGUF run as stored); ctx_size: -c, a context shorter than the model's (0: its own)."""
    device, gpu_note = _gpu_layers_device(device)
    dtype = command_dtype(model, dtype, engine, device, dense)
    where = f"device map {_device_map()}" if _device_map() else device
    gguf = _gguf_path(model) if dtype in BLOCK_PRECISIONS else None
    first = (f"; its first use: indexed and packed for the kernels once, into {cache_dir()}"
             if gguf is not None and not (index_folder(gguf) / TENSORS_FILE).exists() else "")
    click.echo(one_line(f"loading {model} ({dtype}, {where}, engine {engine}{first})…"), err=True)
    resolve_device(device)  # a bad --device is the one line, before anything else is said
    # (a device map spreads the weights over devices and disk: not all of them in memory)
    sizes = dense_bytes(model, dtype) if dtype not in BLOCK_PRECISIONS and _device_map() is None else None
    if sizes is not None:  # a GGUF dequantized whole: say what it costs before it starts
        click.echo(f"dequantizing the GGUF to {dtype}: {sizes[0] / 1e9:.1f} GB of weights in memory (the file "
                   f"stores them in {sizes[1] / 1e9:.1f} GB; --dtype auto runs them as stored)", err=True)
    if first:  # its index made first, where the file index covers it: seconds for a large vocabulary
        with Stages() as stages:
            file_index(gguf, stages.report)
    # a bar where the load takes seconds: a GGUF dequantized, or packed for the kernels at its first use
    bar = Progress("dequantizing") if sizes is not None else Progress("packing for the kernels", unit="B") if first else None
    try:
        loaded = load_model(model, dtype=dtype, device=device, engine=engine, device_map=_device_map(), on_tensor=bar)
    finally:
        if bar is not None:
            bar.close()
    loaded.limit_context(ctx_size)
    if gpu_note is not None:  # (once the model loads: a load that fails says its one line alone)
        click.echo(gpu_note, err=True)
    if _process_is_the_command():
        freeze()
    return loaded


def _process_is_the_command() -> bool:
    """Whether this process runs one command and ends with it: the command group's flag, which
    run_as_process (the console entry) sets (see freeze)."""
    context = click.get_current_context(silent=True)
    return context is not None and bool(getattr(context.find_root().command, "process_is_the_command", False))


def freeze() -> None:
    """What the load made lives as long as this process: kept out of the collector's full
    collections, which would walk its ~400k objects again (150-225 ms a time, mid-reply for
    serve). Only where the process is the command (the console entry, or serve, which holds the
    process until it ends): a frozen object is never freed, so a caller that runs commands
    in-process (a test's CliRunner) would keep every model."""
    gc.freeze()


def attach(loaded, model_b: str | None, device: str = "cpu", engine: str = "auto"):
    """Load --model-b at the first model's precision and make its layers available to plans as 'b:…'."""
    if model_b:
        click.echo(one_line(f"loading {model_b} as model b ({loaded.precision})…"), err=True)
        loaded.attach(load_model(model_b, dtype=loaded.precision, device=_gpu_layers_device(device)[0],
                                 engine=engine,
                                 device_map=_device_map()), "b")
    return loaded


def note(line: str) -> None:
    """A line on stderr: what a command is doing, or leaves out."""
    click.echo(line, err=True)


def set_threads(threads: int | None) -> None:
    """--threads for the running command: torch's thread count, given back when the command ends,
    so that a command run in a process that goes on (CliRunner, a notebook, one process running
    several command lines) leaves the next one the count it found."""
    if threads:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        context = click.get_current_context(silent=True)
        if context is not None:
            context.call_on_close(lambda: torch.set_num_threads(previous))
