"""`layerplan bench`, `frontier` and `probe`: their command lines, defined without torch (a command's
help and a mistyped option answer at once); running one imports its work (app/cli/measuring.py),
or, for the lines the light front end takes (light_bench_request, light_frontier_request,
light_probe_request), that front end's (app/light_timing.py, lite/probing.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import click

from layerplan.app import llamacpp
from layerplan.app.bench_runs import BenchResult
from layerplan.app.options import (DRAFT_LENGTH_HELP, Output, auto_dtype_option, engine_option, light_context,
                                   light_runs_draft, model_option, n_predict_option, threads_option,
                                   transformers_option)
from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS, pick_prompts, read_prompt_file
from layerplan.app.report import frontier_plot
from layerplan.decoding.draft_length import DRAFT_LENGTHS
from layerplan.decoding.drafters.kinds import drafter_help
from layerplan.decoding.frontier import FrontierResult
from layerplan.engine.choices import ENGINES, PASS_LENGTHS, STORED, STORED_FAST
from layerplan.files import write_json_atomic
from layerplan.lite.research_request import LiteBenchRequest, LiteFrontierRequest, LiteProbeRequest


FRONTIER_PROMPTS = ("code", "summary")  # frontier's built-in prompts unless --prompt names others


@click.command()
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
@click.option("--out", type=Output("folder"), default="runs/frontier", show_default=True,
              help="folder for frontier.json and frontier.png")
def frontier(**options) -> None:
    """Each draft's measured acceptance against its measured cost on this machine, beside the
    break-even curve of the probe's verify costs: whether any self-draft can pay here, and by how
    much."""
    importlib.import_module("layerplan.app.cli.measuring").run_frontier_command(**options)


@click.command()
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
@transformers_option
@click.option("--hf-early-exit", "hf_exits", multiple=True, type=int,
              help="also time transformers' assistant_early_exit=E (repeatable)")
@click.option("--hf-prompt-lookup", type=click.IntRange(min=1), default=None, help="also time transformers' prompt_lookup_num_tokens=N")
@click.option("--llama-cpp/--no-llama-cpp", default=True, show_default=True,
              help="also time llama.cpp's own tools (llama-bench; llama-lookup beside ngram/suffix/auto drafts) on "
                   f"the GGUF file as stored and on its weights at --dtype; needs `{llamacpp.BUILD_COMMAND}` once")
@click.option("--llama-draft-max", type=click.IntRange(min=1), default=8, show_default=True,
              help="llama-lookup's --spec-draft-n-max (llama.cpp's own default is 3)")
@click.option("--out", type=Output("file"), default="runs/bench.json", show_default=True)
def bench(**options) -> None:
    """Time decoding against transformers' generate in the same run (ratios, CPU).

    Rows: transformers plain (and its early-exit / prompt-lookup assistants when asked; not on a
    GGUF run as stored unless --transformers), layerplan plain on the eager engine and on the
    chosen one, each layerplan drafter, and
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
    importlib.import_module("layerplan.app.cli.measuring").run_bench_command(**options)


@click.command()
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
def probe(**options) -> None:
    """Time a pass over k = 1..16 new tokens per dtype and engine on this machine: the cost of
    verifying k drafted tokens relative to one decoding step. Cached per machine (CPU, flags,
    threads, kernels; an eager row per torch build) and model; bench, tune, serve and generate
    take their default dtype from it,
    and the adaptive draft length its verify costs. Beside each row, the floor: the least cost
    that this machine's product and memory-read rates, measured between the rounds, allow."""
    importlib.import_module("layerplan.app.cli.measuring").run_probe_command(**options)


def light_probe_request(argv: list[str]) -> LiteProbeRequest | None:
    """The light front end's request of `layerplan probe ...` (argv without the program), read by
    this command: a GGUF's native rows in its stored arithmetics (those given, else both), which
    is all the torch front end times of a GGUF where the kernels run. Rows of another dtype, or
    of the eager engine alone, help, or a line the command refuses give None (the torch front end
    reads it then)."""
    context = light_context(probe, argv)
    if context is None:
        return None
    given = context.params
    if given["engines"] and "native" not in given["engines"]:
        return None
    return LiteProbeRequest(model=given["model"], threads=given["threads"],
                            dtypes=list(given["dtypes"]) or [STORED, STORED_FAST],
                            max_length=given["max_length"], repeats=given["repeats"], refresh=given["refresh"],
                            as_json=given["as_json"])


def light_bench_request(argv: list[str]) -> LiteBenchRequest | None:
    """The light front end's request of `layerplan bench ...` (argv without the program), read by
    this command: a GGUF as stored, layerplan's plain decoding and drafts the light front end runs
    (those of `generate`), and llama.cpp's rows. transformers' rows (--transformers, its assistants),
    the eager engine, another dtype, a draft that runs torch modules, prompts that cannot be read,
    help, or a line the command refuses give None (the torch front end reads it then, and says what
    it says)."""
    context = light_context(bench, argv)
    if context is None:
        return None
    given = context.params
    if given["transformers"] or given["hf_exits"] or given["hf_prompt_lookup"] or given["engine"] == "eager":
        return None
    drafts = list(given["drafts"])
    if not all(light_runs_draft(d) for d in drafts):
        return None
    try:
        if given["prompt_file"] and given["prompt_names"]:
            return None  # (the torch front end's message)
        if given["prompt_file"]:
            prompts, chat = read_prompt_file(given["prompt_file"])
        else:
            prompts, chat = pick_prompts(given["prompt_names"], PROMPTS), CHAT_PROMPTS
    except ValueError:  # (said by the torch front end, in its words)
        return None
    return LiteBenchRequest(model=given["model"], dtype=given["dtype"], engine=given["engine"],
                            threads=given["threads"], prompts=prompts, chat=sorted(chat), new_tokens=given["new_tokens"],
                            repeats=given["repeats"], drafts=drafts, draft_length=given["draft_length"],
                            llama_cpp=given["llama_cpp"], llama_draft_max=given["llama_draft_max"], out=given["out"])


def light_frontier_request(argv: list[str]) -> LiteFrontierRequest | None:
    """The light front end's request of `layerplan frontier ...` (argv without the program), read by
    this command: a GGUF as stored, over drafts given that the light front end runs. No draft
    given (the default families: online skips and a 4-bit copy run torch modules), a draft that
    runs torch modules, the eager engine, another dtype, an unknown prompt, help, or a line the
    command refuses give None (the torch front end reads it then)."""
    context = light_context(frontier, argv)
    if context is None:
        return None
    given = context.params
    drafts = list(given["drafts"])
    if not drafts or given["engine"] == "eager" or not all(light_runs_draft(d) for d in drafts):
        return None
    try:
        prompts = pick_prompts(given["prompt_names"]) or {name: PROMPTS[name] for name in FRONTIER_PROMPTS}
    except ValueError:  # (said by the torch front end, in its words)
        return None
    return LiteFrontierRequest(model=given["model"], dtype=given["dtype"], engine=given["engine"],
                               threads=given["threads"], drafts=drafts, prompts=prompts,
                               new_tokens=given["new_tokens"], gamma=given["gamma"], out=given["out"])


def report_bench(result: BenchResult, pairs: dict[str, list[str]], llama_draft_max: int, out: str) -> None:
    """`layerplan bench`'s table, its ratios to llama.cpp's rows (pairs: llama_cpp_peers'), and its
    JSON written to `out` (either front end's result)."""
    click.echo(result.cpu.line())
    click.echo(f"{result.model}, {result.dtype}, {result.threads} threads, up to {result.new_tokens} new tokens, "
               f"median of {result.repeats}; '{result.versus}' = {result.reference} ms/token ÷ this row's; "
               "dec/s: decoding alone")
    click.echo(result.table())
    if pairs:
        bin_dir = llamacpp.find_tools()
        click.echo(f"layerplan vs llama.cpp's own tools ({llamacpp.peer_name(bin_dir)}, {bin_dir}; "
                   f"llama-lookup drafts up to {llama_draft_max}):")
        for line in result.peer_lines(pairs):
            click.echo("  " + line)
    write_json_atomic(out, result.to_dict())
    click.echo(f"wrote {out}")


def frontier_line(result) -> str:
    """Which self-drafts (every draft but the lookups) can pay here, in one line."""
    own = [p for p in result.points if p.draft not in ("ngram", "suffix")]
    best = max(own, key=lambda p: p.measured_speedup, default=None)
    if best is None:
        return "frontier: no self-draft measured"
    paying = [p.draft for p in own if p.above_break_even]
    return (f"frontier: best self-draft {best.draft}: {best.measured_speedup:.2f}x plain (α {best.acceptance:.2f}, "
            f"draft step {best.draft_cost:.2f} of a plain one); above break-even: {', '.join(paying) or 'none'}")


def report_frontier(result: FrontierResult, out_dir: Path) -> None:
    """`layerplan frontier`'s lines, and its frontier.json and frontier.png written into `out_dir`
    (either front end's result)."""
    write_json_atomic(out_dir / "frontier.json", result.to_dict())
    frontier_plot(result, out_dir / "frontier.png")
    for p in result.points:
        click.echo(f"{p.draft:<28} α {p.acceptance:.2f}  draft step {p.draft_cost:.2f}  measured {p.measured_speedup:.2f}x"
                   f"  predicted {p.predicted_speedup:.2f}x at γ={p.predicted_gamma}"
                   f"  {'pays' if p.above_break_even else 'below break-even'}")
    click.echo(frontier_line(result))
    click.echo(f"wrote {out_dir / 'frontier.json'} and {out_dir / 'frontier.png'}")


COMMANDS = (frontier, bench, probe)  # registered on main (the package's __init__: COMMAND_INDEX)
