"""The `layerplan` command's entry: a GGUF's plain generation, a greedy conversation with it, its
perplexity (under a plan of the model, in either protocol), its scan, its search, explore's grid,
its probe, its bench, its frontier (of drafts given) and its export as a GGUF file or mergekit YAML
run on the light front end (layerplan/lite/: numpy and the native kernels, a start of a tenth of a
second), every other command line on the torch front end (app/cli/), which reads it as it always
has.

Which one runs changes no output: the light front end takes only command lines whose meaning it
carries out as the torch one does (app/cli/generating.py light_request, app/cli/chatting.py
light_chat_request, app/cli/scoring.py light_ppl_request and light_scan_request,
app/cli/searching.py light_search_request, app/cli/exploring.py light_explore_request,
app/cli/timing.py light_probe_request, light_bench_request and light_frontier_request,
app/cli/exporting.py light_export_request), and only
models whose index it can read (kept, or made now from the file; an export reads the file's header
alone). Where it finds, once started, that
the model needs the torch front end, the command starts again as `python -m layerplan.app.cli` with
LAYERPLAN_FRONT_END=torch: the kernels' library, loaded by then, links an OpenMP runtime that must
not meet torch's in one process. (A conversation that asks for the torch front end halfway is handed
on so too, with its transcript: app/cli/chatting.py.)

A kept index's tokenizer process is started (lite/tokenizer_process.py) before anything that
starts threads is imported (a fork copies only the thread that calls it), from the model the line
names; then the `generate` or `chat` command itself reads the line (its options are defined
without torch, app/cli/generating.py and chatting.py), while the tokenizer is parsed on the other
core.
"""

from __future__ import annotations

import os
import sys

from layerplan.heap import keep_freed_memory
from layerplan.lite import FRONT_END_VARIABLE


def main() -> None:
    argv = sys.argv[1:]
    light_generate = argv[:1] in (["generate"], ["chat"]) and os.environ.get(FRONT_END_VARIABLE, "") != "torch"
    if not light_generate:  # (the C heap keeps a pass's freed scratch for the next: heap.py)
        keep_freed_memory()
    if light_generate:
        from layerplan.lite.tokenizer_process import TokenizerProcess
        from layerplan.models.gguf_place import DEFAULT_MODEL

        # the tokenizer's parse, most of a later start, begins now in a process of its own (before
        # numpy's threads, which a fork would not copy), while this one reads the command line
        named = _model_named(argv, DEFAULT_MODEL)
        tokenizer = TokenizerProcess.for_model(named)
        keep_freed_memory()  # (after the fork, which the tokenizer's parse waits for)
        if argv[0] == "chat":
            from layerplan.app.cli.chatting import light_chat_request, run_light_chat

            request, carry_out = light_chat_request(argv), run_light_chat
        else:
            from layerplan.app.cli.generating import light_request
            from layerplan.lite.cli import run as carry_out

            request = light_request(argv)
        if request is not None and request.model != named and tokenizer is not None:
            tokenizer.close()  # (read ahead from another model: LiteModel reads the tokenizer itself)
            tokenizer = None
        if request is None and tokenizer is not None:
            tokenizer.close()
        if request is not None:
            from layerplan.lite.cli import runnable

            taken = runnable(request)
            status = carry_out(request, tokenizer) if taken else None
            if tokenizer is not None:
                tokenizer.close()
            _leave_or_restart(status, taken, argv)
    if argv[:1] in (["ppl"], ["scan"], ["explore"], ["search"], ["probe"], ["bench"], ["frontier"], ["export"]):
        _research_on_the_light_front_end(argv)
    from layerplan.app.cli import run_as_process

    run_as_process()


def _research_on_the_light_front_end(argv: list[str]) -> None:
    """A `ppl`, `scan`, `explore`, `search`, `probe`, `bench`, `frontier` or `export` line: carried out on
    the light front end where its reader takes it (and the process leaves), else nothing (the torch front
    end reads it). The readers say None under LAYERPLAN_FRONT_END=torch (app/options.py light_context)."""
    command = argv[0]
    needs_index = True  # (the model's index, made now where it is not kept: lite/cli.py runnable)
    if command == "ppl":
        from layerplan.app.cli.scoring import light_ppl_request

        request = light_ppl_request(argv)

        def run() -> int | None:
            from layerplan.lite.research import run_ppl

            return run_ppl(request)
    elif command == "scan":
        from layerplan.app.cli.scoring import light_scan_request, report_scan

        request = light_scan_request(argv)

        def run() -> int | None:
            from layerplan.lite.research import run_scan

            return run_scan(request, lambda result: report_scan(result, request.out, request.exits))
    elif command == "explore":
        from layerplan.app.cli.exploring import light_explore_request, report_explore

        request = light_explore_request(argv)

        def run() -> int | None:
            from layerplan.lite.research import run_explore

            return run_explore(request, lambda result: report_explore(result, request.out))
    elif command == "bench":
        from layerplan.app.cli.timing import light_bench_request

        request = light_bench_request(argv)

        def run() -> int | None:
            from layerplan.app.bars import Progress
            from layerplan.app.light_timing import run_light_bench

            with Progress("bench") as progress:
                return run_light_bench(request, progress)
    elif command == "frontier":
        from layerplan.app.cli.timing import light_frontier_request

        request = light_frontier_request(argv)

        def run() -> int | None:
            from layerplan.app.bars import Progress
            from layerplan.app.light_timing import run_light_frontier

            with Progress("frontier") as progress:
                return run_light_frontier(request, progress)
    elif command == "export":
        from layerplan.app.cli.exporting import light_export_request

        request = light_export_request(argv)
        needs_index = False  # (a GGUF's header, or any model's config for mergekit YAML: lite/exporting.py)

        def run() -> int | None:
            from layerplan.lite.exporting import run_export

            return run_export(request)
    elif command == "probe":
        from layerplan.app.cli.timing import light_probe_request

        request = light_probe_request(argv)

        def run() -> int | None:
            from layerplan.app.bars import Progress
            from layerplan.lite.probing import run_probe

            with Progress("probe") as progress:
                return run_probe(request, progress)
    else:
        from layerplan.app.cli.searching import light_search_request, report_search

        request = light_search_request(argv)

        def run() -> int | None:
            from layerplan.app.bars import Stages
            from layerplan.lite.searching import run_search

            with Stages() as stages:
                return run_search(request, lambda result, model: report_search(
                    result, model, request.model, request.out, request.save_draft), stages.start, stages)
    if request is None:
        return
    from layerplan.lite.cli import runnable

    taken = runnable(request) if needs_index else True
    _leave_or_restart(run() if taken else None, taken, argv)


def _leave_or_restart(status: int | None, taken: bool, argv: list[str]) -> None:
    """After the light front end: leave with its status; where the model turned out to need the
    torch front end after the kernels' library loaded, start again on it; else return (the torch
    front end reads the line in this process)."""
    if status is not None:
        # Nothing is left to clean up (what it wrote, it wrote whole and flushed), and the
        # interpreter's teardown (every module, the tokenizer's tables, the kernels' threads)
        # would add a tenth of the start to the command's time: leave now.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # a reader gone (`| head`): nothing more to say
                status = status or 1
        os._exit(status)
    if taken:
        os.environ[FRONT_END_VARIABLE] = "torch"
        os.execv(sys.executable, [sys.executable, "-m", "layerplan.app.cli", *argv])


def _model_named(argv: list[str], default: str) -> str:
    """The model a `generate` line names (-m/--model), read ahead of the command's own reading
    (app/cli/generating.py light_request) only to start its tokenizer's process early; the request's model
    is what counts. The standard library alone: nothing else is imported yet."""
    for i, arg in enumerate(argv):
        if arg in ("-m", "--model") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return default


if __name__ == "__main__":
    main()
