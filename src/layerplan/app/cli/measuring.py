"""The commands that measure this machine, the models and the peers: bench, peers, probe, frontier,
models."""

from __future__ import annotations

import json
from pathlib import Path

import click

from layerplan.app import llamacpp
from layerplan.app.bars import Progress
from layerplan.app.bench import bench_methods, load_for_timing, run_bench, wants_transformers
from layerplan.app.cli.common import checked_probe_row, command_dtype, load, note, set_threads, user_errors
from layerplan.app.options import (DRAFT_LENGTH_HELP, Output, auto_dtype_option, engine_option, model_option,
                                   n_predict_option, threads_option, transformers_option)
from layerplan.app.peers import llama_cpp_peers
from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS, pick_prompts, read_prompt_file
from layerplan.app.report import frontier_plot
from layerplan.decoding.budget import token_budget
from layerplan.decoding.draft_length import DRAFT_LENGTHS
from layerplan.decoding.drafters.registry import drafter_help, make_drafter
from layerplan.decoding.drafters.saved import saved_draft_path
from layerplan.decoding.frontier import measure_frontier, pass_costs_of, self_drafts
from layerplan.engine.choices import STORED, STORED_ARITHMETIC, STORED_FAST
from layerplan.engine.load import load_model
from layerplan.engine.choices import ENGINES
from layerplan.engine.native import native_available
from layerplan.engine.probe import CONTEXT, PASS_LENGTHS, load_probe, probe as run_probe, save_probe
from layerplan.engine.verify import check_architecture, config_for
from layerplan.files import write_json_atomic
from layerplan.machine import cpu_info
from layerplan.models.architectures import STATUSES, architecture_statuses
from layerplan.models.depth import model_depth
from layerplan.models.loading import cache_dir, gguf_of


def print_architectures(markdown: bool) -> None:
    """`layerplan models --architectures`: every causal LM architecture's status (app/cli/listing.py)."""
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


def run_architecture_check(check: str) -> None:
    """`layerplan models --check TYPE|MODEL`: one architecture checked now (app/cli/listing.py)."""
    with user_errors():
        result = check_architecture(config_for(check), force=True)
    native = {True: "; native kernels match too", False: "; native kernels differ: runs on the eager engine",
              None: ""}[result.native]
    click.echo(f"{result.model_type}: {'passed' if result.passed else 'failed'}: {result.detail}"
               f"{native if result.passed else ''}")
    raise SystemExit(0 if result.passed else 1)


def frontier_line(result) -> str:
    """Which self-drafts (every draft but the lookups) can pay here, in one line."""
    own = [p for p in result.points if p.draft not in ("ngram", "suffix")]
    best = max(own, key=lambda p: p.measured_speedup, default=None)
    if best is None:
        return "frontier: no self-draft measured"
    paying = [p.draft for p in own if p.above_break_even]
    return (f"frontier: best self-draft {best.draft}: {best.measured_speedup:.2f}x plain (α {best.acceptance:.2f}, "
            f"draft step {best.draft_cost:.2f} of a plain one); above break-even: {', '.join(paying) or 'none'}")


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
def frontier(model, dtype, engine, threads, drafts, prompt_names, new_tokens, gamma, out) -> None:
    """Each draft's measured acceptance against its measured cost on this machine, beside the
    break-even curve of the probe's verify costs: whether any self-draft can pay here, and by how
    much."""
    set_threads(threads)
    out_dir = Path(out)
    with user_errors():
        prompts = pick_prompts(prompt_names) or {name: PROMPTS[name] for name in ("code", "summary")}
        loaded = load(model, command_dtype(model, dtype, engine), engine=engine)
        token_budget(1, new_tokens, loaded.context_length, new_tokens_name="--new-tokens")
        saved = saved_draft_path(loaded)
        chosen = list(drafts) or self_drafts(loaded, str(saved) if saved.exists() else None)
        for draft in chosen:
            make_drafter(draft, loaded)  # a bad spec fails here, in one line, before anything is timed
        encoded = [loaded.encode(p, chat=k in CHAT_PROMPTS) for k, p in prompts.items()]
        with Progress("frontier") as progress:
            result = measure_frontier(loaded, chosen, encoded, pass_costs_of(loaded, checked_probe_row(loaded)),
                                      new_tokens, gamma, cpu=cpu_info().line(), on_progress=progress)
    write_json_atomic(out_dir / "frontier.json", result.to_dict())
    frontier_plot(result, out_dir / "frontier.png")
    for p in result.points:
        click.echo(f"{p.draft:<28} α {p.acceptance:.2f}  draft step {p.draft_cost:.2f}  measured {p.measured_speedup:.2f}x"
                   f"  predicted {p.predicted_speedup:.2f}x at γ={p.predicted_gamma}"
                   f"  {'pays' if p.above_break_even else 'below break-even'}")
    click.echo(frontier_line(result))
    click.echo(f"wrote {out_dir / 'frontier.json'} and {out_dir / 'frontier.png'}")


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
def bench(model, dtype, engine, threads, new_tokens, repeats, prompt_names, prompt_file, drafts, draft_length,
          transformers, hf_exits, hf_prompt_lookup, llama_cpp, llama_draft_max, out) -> None:
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
    set_threads(threads)
    with user_errors():
        if prompt_file and prompt_names:
            raise ValueError("give either --prompt or --prompt-file, not both")
        if prompt_file:
            prompts, chat = read_prompt_file(prompt_file)
        else:
            prompts, chat = pick_prompts(prompt_names, PROMPTS), CHAT_PROMPTS
        dtype = command_dtype(model, dtype, engine)
        if transformers is None:
            transformers = wants_transformers(model, dtype) or bool(hf_exits or hf_prompt_lookup)
        if not transformers and (hf_exits or hf_prompt_lookup):
            raise ValueError("--hf-early-exit and --hf-prompt-lookup time transformers' generate: not with "
                             "--no-transformers")
        stock, fast = load_for_timing(model, dtype, engine, on_note=note, transformers=transformers)
        token_budget(1, new_tokens, fast.context_length, new_tokens_name="--new-tokens")  # before any decoding
        peers, pairs = llama_cpp_peers(fast, drafts, llama_draft_max, on_note=note) if llama_cpp else ({}, {})
        methods = bench_methods(stock, fast, list(drafts), list(hf_exits), hf_prompt_lookup, draft_length, peers,
                                probe_row=checked_probe_row(fast))
        with Progress("bench") as progress:
            result = run_bench(stock or fast, methods, prompts, new_tokens, repeats, on_progress=progress, chat=chat,
                               precision=fast.precision)
    click.echo(result.cpu.line())
    click.echo(f"{result.model}, {result.dtype}, {result.threads} threads, up to {new_tokens} new tokens, "
               f"median of {repeats}; '{result.versus}' = {result.reference} ms/token ÷ this row's; "
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
def probe(model, dtypes, engines, threads, max_length, repeats, refresh, as_json) -> None:
    """Time a pass over k = 1..16 new tokens per dtype and engine on this machine: the cost of
    verifying k drafted tokens relative to one decoding step. Cached per machine (CPU, flags,
    torch, threads) and model; bench, tune, serve and generate take their default dtype from it,
    and the adaptive draft length its verify costs. Beside each row, the floor: the least cost
    that this machine's product and memory-read rates, measured between the rounds, allow."""
    set_threads(threads)
    with user_errors():
        _, name = model_depth(model)
        stored_here = gguf_of(model) is not None and native_available() is None
        dtypes = list(dtypes) or ([STORED, STORED_FAST] if stored_here else ["float32", "bfloat16"])
        engines = list(engines) or [e for e in ENGINES if e != "auto"]
        cached = None if refresh else load_probe(cache_dir(), name)
        wanted = {(e, d) for e in engines for d in dtypes}
        if cached is None or not wanted <= {(r.engine, r.dtype) for r in cached.rows}:
            if "native" in engines and native_available() is not None:
                click.echo(f"native engine left out: {native_available()}", err=True)

            def load_for_probe(dtype: str, engine: str):
                if (engine == "native" and native_available() is not None) or (engine == "eager" and dtype in STORED_ARITHMETIC):
                    return None  # a GGUF as stored runs on the native kernels only (eagerly it is a reference)
                click.echo(f"loading {model} ({dtype}, engine {engine})…", err=True)
                return load_model(model, dtype=dtype, engine=engine, pack=None if engine == "eager" else False)

            with Progress("probe") as progress:
                cached = run_probe(load_for_probe, name, dtypes, engines, tuple(range(1, max_length + 1)), repeats,
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


COMMANDS = (frontier, bench, probe)  # registered on main (the package's __init__)
