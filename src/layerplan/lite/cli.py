"""`layerplan generate` on the light front end, where it gives what the torch front end gives.

`request_of` reads a command line as `layerplan generate` (app/cli/running.py) reads it, for the options
whose meaning the light front end carries out as the torch one does: a GGUF's plain greedy
continuation of one prompt (the model, its dtype as stored, the engine, threads, a plan of this
model, the token budget, stop strings, streaming, the chat template where it only wraps the
prompt, the statistics). Any other option, value or form — sampling, drafts, a prompt file, a
second model, help — returns None, and the
torch front end reads the command line instead, with its own parser, checks and messages. The
output (text, stream, the closing line and the messages on stderr) is the torch front end's for
the same command line (tests/test_lite.py runs both).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from layerplan.decoding.budget import token_budget
from layerplan.decoding.text import TextDelta
from layerplan.lite.generate import generate
from layerplan.lite.model import LiteModel, TorchFrontEnd, lite_refusal
from layerplan.machine import read_cpuinfo
from layerplan.messages import one_line
from layerplan.models.errors import ModelError
from layerplan.files import cache_dir
from layerplan.models.gguf_index import DEFAULT_MODEL, TENSORS_FILE, file_index, gguf_of, index_folder
from layerplan.plan.plan import PlanError

# LAYERPLAN_FRONT_END=torch: every command line to the torch front end
FRONT_END_VARIABLE = "LAYERPLAN_FRONT_END"
# dtype -> the arithmetic of the products (engine/load.py: auto is a GGUF as stored, GGUF_DEFAULT,
# where the native kernels run, and the light front end runs only where they do)
ARITHMETICS = {"auto": "fast", "stored": "exact", "stored-fast": "fast"}


@dataclass
class LiteRequest:
    prompt: str
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    engine: str = "auto"
    threads: int | None = None
    plan: str | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stream: bool = True
    chat: bool = False
    stats: bool = False  # --stats / --verbose: the summary lines
    as_json: bool = False  # --json: the statistics object
    first_use: bool = False  # the model's index was made by this command (runnable)

    @property
    def precision(self) -> str:
        """The dtype the torch front end names for it (a GGUF's auto is stored-fast)."""
        return "stored" if ARITHMETICS[self.dtype] == "exact" else "stored-fast"


def _integer(text: str, low: int) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= low else None


def _set(request: LiteRequest, prompts: list[str], option: str, value: str) -> bool:
    """Apply one option's value as app/cli/running.py's generate reads it (-p to `prompts`, the prompts as
    read); False where its meaning is not the light front end's (the torch front end then reads the
    whole line)."""
    if option in ("--model", "-m"):
        request.model = value
    elif option == "--dtype" and value in ARITHMETICS:
        request.dtype = value
    elif option == "--engine" and value in ("auto", "native"):
        request.engine = value
    elif option == "--device" and value == "cpu":
        pass
    elif option in ("--threads", "-t") and (threads := _integer(value, 1)) is not None and threads <= 1024:
        request.threads = threads
    elif option == "--plan":
        request.plan = value
    elif option in N_PREDICT and (count := _integer(value, 0)) is not None:
        request.max_new_tokens = count
    elif option in ("--temp", "--temperature") and _float(value) == 0.0:
        pass
    elif option in ("--prompt", "-p"):
        prompts.append(value)
    elif option == "--stop":
        request.stop.append(value)
    else:
        return False
    return True


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


N_PREDICT = ("--n-predict", "-n", "--max-new-tokens", "--new-tokens")  # (app/options.py n_predict_option)
VALUED = ("--model", "-m", "--dtype", "--engine", "--device", "--threads", "-t", "--plan", *N_PREDICT,
          "--temp", "--temperature", "--stop", "--prompt", "-p")
FLAGS = {"--stream": ("stream", True), "--no-stream": ("stream", False), "--chat": ("chat", True),
         "--no-chat": ("chat", False), "--stats": ("stats", True), "--verbose": ("stats", True),
         "-v": ("stats", True), "--json": ("as_json", True)}


def request_of(argv: list[str]) -> LiteRequest | None:
    """The request of `layerplan generate ...` (argv without the program), or None (see the module)."""
    if not argv or argv[0] != "generate" or os.environ.get(FRONT_END_VARIABLE, "") == "torch":
        return None
    request, prompts, i = LiteRequest(prompt=""), [], 1
    while i < len(argv):
        arg = argv[i]
        if arg in FLAGS:
            name, value = FLAGS[arg]
            setattr(request, name, value)
        elif arg.startswith("--") and "=" in arg:
            option, value = arg.split("=", 1)
            if option not in VALUED or not _set(request, prompts, option, value):
                return None
        elif arg in VALUED:
            if i + 1 >= len(argv) or not _set(request, prompts, arg, argv[i + 1]):
                return None
            i += 1
        elif arg.startswith("-"):  # another option or form (-n5, --help, --), or a prompt that starts with '-'
            return None
        else:
            prompts.append(arg)
        i += 1
    if len(prompts) != 1 or not prompts[0]:
        return None
    request.prompt = prompts[0]
    return request


def runnable(request: LiteRequest) -> bool:
    """Whether the light front end runs it: a GGUF whose index it reads (kept from an earlier
    load, or made now from the file where models/file_index.py's tables cover it), with a
    tokenizer (the torch front end says what a model without one cannot do). A file that cannot
    be read is the torch front end's to report."""
    gguf = gguf_of(request.model)
    if gguf is None:
        return False
    try:
        request.first_use = not (index_folder(gguf) / TENSORS_FILE).exists()
        index = file_index(gguf)
    except (ModelError, OSError):
        return False
    return index is not None and lite_refusal(index) is None and (index / "tokenizer.json").exists()


def _packing_bar(done: int, total: int) -> None:
    """The first start's packing, on a terminal: one line redrawn."""
    end = "\n" if done >= total else ""
    print(f"\rpacking the weights for the kernels: {done / 2 ** 20:,.0f} of {total / 2 ** 20:,.0f} MB{end}",
          end="", file=sys.stderr, flush=True)


def run(request: LiteRequest) -> int | None:
    """Carry out a runnable request as app/cli/running.py's generate would: the exit status, or None where
    the model turned out to need the torch front end (before any output)."""
    try:
        first = (f"; its first use: indexed and packed for the kernels once, into {cache_dir()}"
                 if request.first_use else "")  # (app/cli/common.py's loading line)
        print(f"loading {request.model} ({request.precision}, "
              f"cpu, engine {request.engine}{first})…", file=sys.stderr, flush=True)
        model = LiteModel(gguf_of(request.model), ARITHMETICS[request.dtype], request.threads,
                          on_packed=_packing_bar if sys.stderr.isatty() else None)
        plan = model.plan(request.plan)
        ids = model.encode(request.prompt, request.chat)
        if not ids:
            raise ValueError("the prompt is empty (no tokens): give some text to continue")
        token_budget(len(ids), request.max_new_tokens, model.context_length, new_tokens_name="--max-new-tokens")

        def on_text(piece: TextDelta) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = generate(model, ids, plan, request.max_new_tokens, request.stop,
                          on_text if request.stream else None)
    except TorchFrontEnd:
        return None
    except KeyboardInterrupt:  # as click's standalone mode ends it
        print("Aborted!", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `layerplan … | head` closed the pipe: nothing more to say
        return 1
    except (PlanError, ModelError, ValueError, FileNotFoundError) as error:
        print(f"Error: {one_line(str(error))}", file=sys.stderr)
        return 1
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        print(f"Error: {one_line(where + (error.strerror or str(error)))}", file=sys.stderr)
        return 1
    print("" if request.stream else result.text, flush=True)
    if not result.text.strip() and not request.chat and request.max_new_tokens > 0:
        print(f"(no text generated, stop reason: {result.stop_reason}; an instruction-tuned model may answer a bare "
              "prompt only when it is wrapped in its chat template: add --chat)", file=sys.stderr)
    if request.stats:  # app/cli/running.py's summary lines
        for line in result.summary_lines(request.precision, model.threads, read_cpuinfo()[0] or "unknown CPU"):
            print(line, file=sys.stderr)
    if request.as_json:  # app/cli/running.py's object: the result but its text and tokens
        summary = {k: v for k, v in result.to_dict().items() if k not in ("text", "token_ids")}
        print(json.dumps(summary, indent=2), file=sys.stderr)
    return 0
