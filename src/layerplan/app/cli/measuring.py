"""The work of the commands that measure this machine, the models and the peers: bench, probe,
frontier (their command lines: app/cli/timing.py), and `models --architectures`, `--check`."""

from __future__ import annotations

from pathlib import Path

import click
import torch

from layerplan.app.bars import Progress
from layerplan.app.bench import bench_methods, load_for_timing, wants_transformers
from layerplan.app.bench_runs import run_bench
from layerplan.app.cli.common import checked_probe_row, command_dtype, load, note, set_threads, user_errors
from layerplan.app.cli.timing import FRONTIER_PROMPTS, report_bench, report_frontier
from layerplan.app.peers import llama_cpp_peers
from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS, pick_prompts, read_prompt_file
from layerplan.decoding.budget import token_budget
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.drafters.saved import saved_draft_path
from layerplan.decoding.frontier import measure_frontier, pass_costs_of, self_drafts
from layerplan.decoding.generate import decode_by
from layerplan.engine.choices import STORED, STORED_ARITHMETIC, STORED_FAST
from layerplan.engine.load import load_model
from layerplan.engine.choices import ENGINES
from layerplan.engine.native import native_available
from layerplan.engine.probe import load_probe, probe as run_probe, save_probe, time_passes
from layerplan.engine.probing import cache_line, loading_line, probe_report
from layerplan.engine.verify import check_architecture, config_for
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


def run_frontier_command(model, dtype, engine, threads, drafts, prompt_names, new_tokens, gamma, out) -> None:
    """`layerplan frontier`'s work (its command line: timing.py)."""
    set_threads(threads)
    out_dir = Path(out)
    with user_errors():
        prompts = pick_prompts(prompt_names) or {name: PROMPTS[name] for name in FRONTIER_PROMPTS}
        loaded = load(model, command_dtype(model, dtype, engine), engine=engine)
        token_budget(1, new_tokens, loaded.context_length, new_tokens_name="--new-tokens")
        saved = saved_draft_path(loaded)
        chosen = list(drafts) or self_drafts(loaded, str(saved) if saved.exists() else None)
        for draft in chosen:
            make_drafter(draft, loaded)  # a bad spec fails here, in one line, before anything is timed
        encoded = [loaded.encode(p, chat=k in CHAT_PROMPTS) for k, p in prompts.items()]
        costs = pass_costs_of(checked_probe_row(loaded), loaded, time_passes)
        with Progress("frontier") as progress:
            result = measure_frontier(loaded, decode_by(loaded), chosen, encoded, costs, new_tokens, gamma,
                                      cpu=cpu_info().line(), on_progress=progress)
    report_frontier(result, out_dir)


def run_bench_command(model, dtype, engine, threads, new_tokens, repeats, prompt_names, prompt_file, drafts,
                      draft_length, transformers, hf_exits, hf_prompt_lookup, llama_cpp, llama_draft_max, out) -> None:
    """`layerplan bench`'s work (its command line: timing.py)."""
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
        peers, pairs = llama_cpp_peers(
            fast.source, None if fast.stored is not None else str(fast.dtype).replace("torch.", ""),
            torch.get_num_threads(), lambda ids: fast.tokenizer.decode(ids, skip_special_tokens=False), drafts,
            llama_draft_max, on_note=note) if llama_cpp else ({}, {})
        methods = bench_methods(stock, fast, list(drafts), list(hf_exits), hf_prompt_lookup, draft_length, peers,
                                probe_row=checked_probe_row(fast))
        with Progress("bench") as progress:
            result = run_bench(stock or fast, methods, prompts, new_tokens, repeats, on_progress=progress, chat=chat,
                               precision=fast.precision)
    report_bench(result, pairs, llama_draft_max, out)


def run_probe_command(model, dtypes, engines, threads, max_length, repeats, refresh, as_json) -> None:
    """`layerplan probe`'s work (its command line: timing.py)."""
    set_threads(threads)
    with user_errors():
        _, name = model_depth(model)
        stored_here = gguf_of(model) is not None and native_available() is None
        dtypes = list(dtypes) or ([STORED, STORED_FAST] if stored_here else ["float32", "bfloat16"])
        engines = list(engines) or [e for e in ENGINES if e != "auto"]
        cached = None if refresh else load_probe(cache_dir(), name)

        def timed_here(engine: str, dtype: str) -> bool:
            """A GGUF as stored runs on the native kernels only (eagerly it is a reference)."""
            return not ((engine == "native" and native_available() is not None)
                        or (engine == "eager" and dtype in STORED_ARITHMETIC))

        wanted = {(e, d) for e in engines for d in dtypes if timed_here(e, d)}
        if cached is None or not wanted <= {(r.engine, r.dtype) for r in cached.rows}:
            if "native" in engines and native_available() is not None:
                click.echo(f"native engine left out: {native_available()}", err=True)

            def load_for_probe(dtype: str, engine: str):
                if not timed_here(engine, dtype):
                    return None
                click.echo(loading_line(model, dtype, engine), err=True)
                return load_model(model, dtype=dtype, engine=engine, pack=None if engine == "eager" else False)

            with Progress("probe") as progress:
                cached = run_probe(load_for_probe, name, dtypes, engines, tuple(range(1, max_length + 1)), repeats,
                                   on_progress=lambda label, done, total: progress(done, total),
                                   on_note=lambda line: click.echo(line, err=True))
            click.echo(cache_line(cached, save_probe(cached, cache_dir())), err=True)
    click.echo(probe_report(cached, as_json))

