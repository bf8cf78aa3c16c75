"""`layerplan bench` and `frontier` on the light front end: a GGUF as stored, timed without torch.

A bench's methods are the torch front end's for the same command line (app/bench.py
bench_methods on a GGUF as stored, transformers left out): layerplan's plain decoding, each draft,
and llama.cpp's own tools, timed interleaved by app/bench_runs.py run_bench and reported by
app/cli/timing.py report_bench. A frontier's points are decoding/frontier.py measure_frontier's
over the drafts given (report_frontier). layerplan's decodes are lite/cli.py decode_loop's, the
loop `generate` runs here: the same tokens as the torch front end's (its native engine runs the
same kernels), at the start and memory of a process without torch. Figures say which kernels'
build timed them, where the torch front end's name torch's (machine.py kernels_cpu_info)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from layerplan.app.bench_runs import PLAIN, Runner, run_bench, timed_generation
from layerplan.app.cli.timing import report_bench, report_frontier
from layerplan.app.peers import LlamaToolError, llama_cpp_peers
from layerplan.app.prompts import CHAT_PROMPTS
from layerplan.decoding.budget import token_budget
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.frontier import measure_frontier, pass_costs_of
from layerplan.decoding.text import GenerationResult
from layerplan.engine.kernel_library import choose_isa
from layerplan.engine.probe_rows import ProbeRow
from layerplan.engine.probing import loading_line
from layerplan.lite.cli import ENDINGS, decode_loop, ended_by, load_for
from layerplan.lite.model import LiteModel
from layerplan.lite.probing import checked_row, time_passes
from layerplan.lite.research_request import LiteBenchRequest, LiteFrontierRequest
from layerplan.machine import kernels_cpu_info
from layerplan.messages import one_line


def lite_runner(model: LiteModel, row: ProbeRow | None, draft: str | None = None,
                draft_length: str | None = None) -> Runner:
    """A bench Runner of layerplan's greedy decoding of the full model, plain or drafted (row: the
    probe row its pass costs come from, as app/bench.py layerplan_runner's)."""
    plan = model.plan()

    def run(ids: list[int], new_tokens: int):
        return timed_generation(decode_loop(model, ids, plan, new_tokens, row, draft=draft,
                                            draft_length=draft_length).run())

    return run


def run_light_bench(request: LiteBenchRequest, on_progress: Callable[[int, int], None] | None = None) -> int | None:
    """Carry out a runnable request as app/cli/measuring.py run_bench_command would: the exit
    status, or None where the model turned out to need the torch front end (before any output)."""
    try:
        model = load_for(request, line=loading_line(request.model, request.precision, "native"))  # (bench's)
        token_budget(1, request.new_tokens, model.context_length, new_tokens_name="--new-tokens")
        peers, pairs = llama_cpp_peers(
            model.source, None, model.threads, lambda ids: model.tokenizer.decode(ids, skip_special_tokens=False),
            request.drafts, request.llama_draft_max, on_note=_note) if request.llama_cpp else ({}, {})
        row = checked_row(model, on_note=_note)  # (as the torch front end's bench checks its row)
        methods = {PLAIN: lite_runner(model, row)}
        for draft in request.drafts:
            methods[f"layerplan draft={draft}"] = lite_runner(model, row, draft, request.draft_length)
        methods.update(peers)
        result = run_bench(model, methods, request.prompts, request.new_tokens, request.repeats,
                           on_progress=on_progress, chat=request.chat,
                           cpu=kernels_cpu_info(model.threads, choose_isa().name))
    except LlamaToolError as error:  # (app/cli/common.py user_errors's line)
        print(f"Error: {one_line(str(error))}", file=sys.stderr)
        return 1
    except ENDINGS as error:
        return ended_by(error)
    report_bench(result, pairs, request.llama_draft_max, request.out)
    return 0


def run_light_frontier(request: LiteFrontierRequest,
                       on_progress: Callable[[int, int], None] | None = None) -> int | None:
    """Carry out a runnable request as app/cli/measuring.py run_frontier_command would: the exit
    status, or None where the model turned out to need the torch front end (before any output)."""
    try:
        model = load_for(request)
        token_budget(1, request.new_tokens, model.context_length, new_tokens_name="--new-tokens")
        plan = model.plan()
        for draft in request.drafts:  # a bad spec fails here, in one line, before anything is timed
            make_drafter(draft, model, plan, load_draft=model.load_draft)
        encoded = [model.encode(text, chat=name in CHAT_PROMPTS) for name, text in request.prompts.items()]
        costs = pass_costs_of(checked_row(model, on_note=_note), model, time_passes)

        def decode(prompt, new_tokens: int, draft, draft_length) -> GenerationResult:
            return decode_loop(model, prompt, plan, new_tokens, None, draft=draft, draft_length=draft_length).run()

        result = measure_frontier(model, decode, request.drafts, encoded, costs, request.new_tokens, request.gamma,
                                  cpu=kernels_cpu_info(model.threads, choose_isa().name).line(),
                                  on_progress=on_progress)
    except ENDINGS as error:
        return ended_by(error)
    report_frontier(result, Path(request.out))
    return 0


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
