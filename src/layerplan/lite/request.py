"""A `layerplan generate` command line as the light front end reads it, with the standard library
alone: the command's start reads it (app/launch.py) before numpy or the tokenizer is imported.

`request_of` reads a command line as `layerplan generate` (app/cli/running.py) reads it, for the options
whose meaning the light front end carries out as the torch one does (lite/cli.py): a GGUF's plain
greedy continuation of one prompt (the model, its dtype as stored, the engine, threads, a plan of
this model, the token budget, stop strings, streaming, the chat template where it only wraps the
prompt, the statistics). Any other option, value or form — sampling, drafts, a prompt file, a
second model, help — returns None, and the torch front end reads the command line instead, with
its own parser, checks and messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from layerplan.models.gguf_place import DEFAULT_MODEL

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
