"""`layerplan generate` on the light front end, where it gives what the torch front end gives:
the command lines lite/request.py takes, on a model whose index the light front end runs; and
what every light command shares: whether it runs a request (runnable), the model's load and how a
request ends. The output (text, stream, the closing line and the messages on stderr) is the torch
front end's for the same command line (tests/test_lite.py, tests/test_lite_cli.py run both).
`ppl`, `scan` and `explore` are lite/research.py's, `search` lite/searching.py's: modules of
their own, which a `generate` does not wait to import.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

from layerplan.decoding.budget import token_budget
from layerplan.decoding.loop import DecodeLoop
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.text import TextDelta, prompt_notes
from layerplan.engine.probe_rows import PaceCheck, ProbeRow
from layerplan.files import WriteError, cache_dir
from layerplan.lite import TorchFrontEnd
from layerplan.lite.model import LiteModel, lite_refusal
from layerplan.lite.request import ARITHMETICS, FileRequest, LiteRequest
from layerplan.lite.tokenizer_process import TokenizerProcess
from layerplan.machine import read_cpuinfo
from layerplan.messages import one_line
from layerplan.models.errors import ModelError
from layerplan.models.file_index import WRITING_TOKENIZER
from layerplan.models.gguf_index import file_index
from layerplan.models.gguf_place import TENSORS_FILE, gguf_of, index_folder
from layerplan.plan.plan import PlanError


def runnable(request: FileRequest) -> bool:
    """Whether the light front end runs it: a GGUF whose index it reads (kept from an earlier
    load, or made now from the file where models/file_index.py's tables cover it), with a
    tokenizer (the torch front end says what a model without one cannot do). A file that cannot
    be read is the torch front end's to report."""
    gguf = gguf_of(request.model)
    if gguf is None:
        return False
    try:
        request.first_use = not (index_folder(gguf) / TENSORS_FILE).exists()
        index = file_index(gguf, _indexing_bar if request.first_use and sys.stderr.isatty() else None)
    except (ModelError, OSError):
        return False
    return index is not None and lite_refusal(index) is None and (index / "tokenizer.json").exists()


def _indexing_bar(stage: str, done: int, total: int) -> None:
    """A first start's index, where it takes seconds (a large vocabulary), on a terminal: one line
    redrawn, kept once the tokenizer is written."""
    count = f": {done:,} of {total:,} tokens" if total > 1 else ""
    end = "\n" if stage == WRITING_TOKENIZER and done >= total else ""
    print(f"\rindexing the file: {stage}{count}\x1b[K{end}", end="", file=sys.stderr, flush=True)


def _packing_bar(done: int, total: int) -> None:
    """The first start's packing, on a terminal: one line redrawn."""
    end = "\n" if done >= total else ""
    print(f"\rpacking the weights for the kernels: {done / 2 ** 20:,.0f} of {total / 2 ** 20:,.0f} MB{end}",
          end="", file=sys.stderr, flush=True)


def load_for(request: FileRequest, tokenizer: TokenizerProcess | None = None, line: str | None = None) -> LiteModel:
    """The request's model, after its loading line (None: app/cli/common.py's); its panels'
    packing drawn on a terminal (a first use)."""
    first = (f"; its first use: indexed and packed for the kernels once, into {cache_dir()}"
             if request.first_use else "")
    line = line or f"loading {request.model} ({request.precision}, cpu, engine {request.engine}{first})…"
    print(one_line(line), file=sys.stderr, flush=True)
    model = LiteModel(gguf_of(request.model), ARITHMETICS[request.dtype], request.threads,
                      on_packed=_packing_bar if sys.stderr.isatty() else None, tokenizer=tokenizer)
    if request.model_b:  # (app/cli/common.py attach's line)
        print(one_line(f"loading {request.model_b} as model b ({request.precision})…"), file=sys.stderr, flush=True)
        gguf_b = gguf_of(request.model_b)
        if gguf_b is None:
            raise TorchFrontEnd(f"{request.model_b}: not a GGUF file")  # (the torch front end names what it is)
        model.attach(LiteModel(gguf_b, ARITHMETICS[request.dtype], request.threads,
                               on_packed=_packing_bar if sys.stderr.isatty() else None, with_tokenizer=False), "b")
    return model


def run(request: LiteRequest, tokenizer: TokenizerProcess | None = None) -> int | None:
    """Carry out a runnable request as app/cli/running.py's generate would: the exit status, or None where
    the model turned out to need the torch front end (before any output). tokenizer: the model's,
    started at the command's start (app/launch.py)."""
    try:
        model = load_for(request, tokenizer)
        sampling = request.sampling()
        # (app/cli/running.py's check, after the load as there)
        sampling.check_vocabulary(model.vocab_size)
        plan = model.plan(request.plan)
        ids = model.encode(request.prompt, request.chat)
        if not ids:
            raise ValueError("the prompt is empty (no tokens): give some text to continue")
        max_new_tokens = token_budget(len(ids), request.max_new_tokens, model.context_length,
                                      new_tokens_name="--max-new-tokens")

        def on_text(piece: TextDelta) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        streamed = on_text if request.stream else None
        row = model.probe_row()  # (the pace's and the draft's costs, as the torch front end's generate)
        result = decode_loop(model, ids, plan, max_new_tokens, row, request.stop, streamed, sampling,
                             request.seed, request.draft, request.draft_length, request.draft_confidence).run()
    except ENDINGS as error:
        return ended_by(error)
    print("" if request.stream else result.text, flush=True)
    for line in prompt_notes(result, request.chat, bool(model.chat.get("template")), max_new_tokens):
        print(line, file=sys.stderr)
    if request.stats:  # app/cli/running.py's summary lines
        for line in result.summary_lines(request.precision, model.threads, read_cpuinfo()[0] or "unknown CPU"):
            print(line, file=sys.stderr)
    if request.as_json:  # app/cli/running.py's object: the result but its text and tokens
        summary = {k: v for k, v in result.to_dict().items() if k not in ("text", "token_ids")}
        print(json.dumps(summary, indent=2), file=sys.stderr)
    return 0


def decode_loop(model: LiteModel, ids: list[int], plan, max_new_tokens: int, row: ProbeRow | None,
                stop: Sequence[str] = (), on_text: Callable[[TextDelta], None] | None = None,
                sampling: SamplingParams | None = None, seed: int | None = None, draft: str | None = None,
                draft_length: str | None = None, draft_confidence: float = 0.0) -> DecodeLoop:
    """The decode of `ids` as the torch front end's generate runs it: plain, or speculative rounds
    of `draft` (a draft the light front end runs); row: this machine's probe row for the model,
    the pace's and the draft's pass costs (None: none cached)."""
    if draft is None:
        return DecodeLoop(model, ids, plan, max_new_tokens, stop, True, on_text, pace=PaceCheck(row),
                          sampling=sampling, seed=seed)
    # (speculative rounds, imported here: a plain start does not wait for them)
    from layerplan.decoding.drafters.registry import make_drafter
    from layerplan.decoding.rounds import SpeculativeLoop

    costs = dict(row.relative) if row is not None else {}
    drafter = make_drafter(draft, model, plan, draft_confidence, pass_costs=costs, load_draft=model.load_draft)
    return SpeculativeLoop(model, ids, plan, drafter, max_new_tokens, stop, True, on_text, pace=PaceCheck(row),
                           sampling=sampling, seed=seed, draft_length=draft_length, pass_costs=costs)


# what a request may end with, before its output (ended_by)
ENDINGS = (TorchFrontEnd, KeyboardInterrupt, PlanError, ModelError, ValueError, OSError)


def ended_by(error: BaseException) -> int | None:
    """The exit status of a request that raised one of ENDINGS, its one line said as the torch
    front end says it (app/cli/common.py user_errors); None: the torch front end is to run it."""
    if isinstance(error, TorchFrontEnd):
        return None
    if isinstance(error, KeyboardInterrupt):  # as click's standalone mode ends it
        print("Aborted!", file=sys.stderr)
    elif isinstance(error, BrokenPipeError):  # `layerplan … | head` closed the pipe: nothing more to say
        pass
    elif isinstance(error, (PlanError, ModelError, ValueError, FileNotFoundError, WriteError)):
        print(f"Error: {one_line(str(error))}", file=sys.stderr)
    else:
        where = f"{error.filename}: " if error.filename else ""
        print(f"Error: {one_line(where + (error.strerror or str(error)))}", file=sys.stderr)
    return 1
