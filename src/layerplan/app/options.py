"""The options several commands share, each with one name in every command: llama.cpp's name where
the meaning is the same (`-t` is the thread count, `-n` the tokens to generate, `--temp`), its
longer or transformers' name beside it. FAMILIAR_NAMES is the table docs/coming-from.md shows
(tests/test_familiar_flags.py checks both against the commands' own options)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import click

from layerplan.decoding.budget import UNTIL_CONTEXT
from layerplan.decoding.draft_length import draft_length_help
from layerplan.decoding.drafters.kinds import draft_models, drafts_on_the_light_front_end
from layerplan.decoding.limits import SEED_RANGE
from layerplan.engine.choices import BLOCK_PRECISIONS, DENSE_PRECISIONS, ENGINES
from layerplan.files import WriteError, check_output
from layerplan.lite import FRONT_END_VARIABLE
from layerplan.lite.request import ARITHMETICS
from layerplan.models.gguf_place import DEFAULT_MODEL, gguf_of

SEED = click.IntRange(*SEED_RANGE)  # (decoding/limits.py)
MAX_THREADS = 1024


class ThreadCount(click.ParamType):
    """A thread count, 1 to MAX_THREADS. `-t` meant the temperature in layerplan's first releases; where a
    value reads as one (0.7, 0) the refusal says so, rather than sampling or threading silently."""

    name = "integer"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            count = value
        else:
            try:
                count = int(str(value).strip())
            except ValueError:
                count = None
        if count is not None and 1 <= count <= MAX_THREADS:
            return count
        said = (f"{value} is not in the range 1<=x<={MAX_THREADS}" if count is not None
                else f"'{value}' is not a whole number")
        self.fail(f"{said}: -t/--threads is the CPU thread count, as in llama.cpp (-t was the temperature in "
                  f"earlier layerplan; that is --temp now)", param, ctx)


threads_option = click.option("--threads", "-t", type=ThreadCount(), default=None, metavar="N",
                              help="CPU threads (default: torch's choice, one a core)")


class TokenCount(click.ParamType):
    """-n's count: a whole number from `low`, or (until_context) llama.cpp's -1 and -2, which
    generate until the context is full (EOS and stop strings still end it): UNTIL_CONTEXT."""

    name = "integer"

    def __init__(self, low: int, until_context: bool) -> None:
        self.low, self.until_context = low, until_context

    def convert(self, value, param, ctx):
        count = value if isinstance(value, int) and not isinstance(value, bool) else None
        if count is None:
            try:
                count = int(str(value).strip())
            except ValueError:
                self.fail(f"'{value}' is not a whole number", param, ctx)
        if self.until_context and count in (-1, -2):
            return UNTIL_CONTEXT
        if count < self.low:
            also = " (or -1: until the context is full, as llama.cpp's -1 and -2)" if self.until_context else ""
            self.fail(f"{count} is not in the range x>={self.low}{also}", param, ctx)
        return count


def n_predict_option(default: int, low: int = 1, help: str = "at most this many new tokens", dest: str = "max_new_tokens",
                     until_context: bool = False):
    """-n: how many tokens to generate, as llama.cpp's -n/--n-predict; --max-new-tokens (transformers')
    and --new-tokens (layerplan's earlier name in the timing commands) stay as aliases. until_context:
    -1 (and -2) generate until the context is full, as llama.cpp's."""
    if until_context:
        help += "; -1: until the context is full (llama.cpp's -1 and -2)"
    return click.option("--n-predict", "-n", "--max-new-tokens", "--new-tokens", dest,
                        type=TokenCount(low, until_context), default=default, show_default=True, metavar="N",
                        help=help)


ctx_size_option = click.option("--ctx-size", "-c", type=click.IntRange(min=0), default=0, show_default=True,
                               metavar="N", help="context length: prompt plus new tokens (0: the model's own); "
                                                 "at most the model's")
seed_option = click.option("--seed", "-s", type=SEED, default=None, help="sampling seed (default: a fresh one)")
temp_option = click.option("--temp", "--temperature", "temperature", type=float, default=0.0, show_default=True,
                           help="sampling temperature; 0 = greedy")


class LogitBias(click.ParamType):
    """-l/--logit-bias TOKEN+BIAS, TOKEN-BIAS or TOKEN-inf (llama.cpp's form): (token id, bias)."""

    name = "TOKEN(+|-)BIAS"
    _FORM = re.compile(r"(\d+)([+-])(inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)")

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        match = self._FORM.fullmatch(str(value).strip())
        if match is None or (match.group(3) == "inf" and match.group(2) == "+"):
            self.fail(f"{value!r} is not TOKEN+BIAS, TOKEN-BIAS or TOKEN-inf (e.g. 15043+1, 15043-inf)", param, ctx)
        bias = float(match.group(3)) * (-1 if match.group(2) == "-" else 1)
        return int(match.group(1)), bias


def output_penalty_options(command):
    """--presence-penalty, --frequency-penalty: OpenAI's penalties on the tokens generated so far."""
    for flag, what in (("--presence-penalty", "where a token was generated already"),
                       ("--frequency-penalty", "times the times a token was generated already")):
        command = click.option(flag, type=float, default=0.0, show_default=True,
                               help=f"subtract this from a token's logit {what} (-2..2; 0 = none)")(command)
    return command


logit_bias_option = click.option("--logit-bias", "-l", "logit_bias", type=LogitBias(), multiple=True, default=(),
                                 help="add BIAS to the token's logit before sampling or greedy choice (repeatable; "
                                      "TOKEN-inf bans it; llama.cpp's -l)")


def sampling_options(command):
    """--temp, --top-k, --top-p, --min-p, --repeat-penalty, -s/--seed: llama.cpp's sampling names."""
    for option in reversed((
        temp_option,
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 keeps every token"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1 keeps every token"),
        click.option("--min-p", type=float, default=0.0, show_default=True,
                     help="drop tokens below this fraction of the most likely one's probability; 0 keeps all"),
        click.option("--repeat-penalty", "--repetition-penalty", "repetition_penalty", type=float, default=1.0,
                     show_default=True, help="1 = none"),
        seed_option,
    )):
        command = option(command)
    return command


# ----- the model, its precision, device and engine (every command that loads one) ----------------
DRAFT_LENGTH_HELP = "draft length policy: " + draft_length_help()
MODEL_HELP = f"HF folder (config.json + safetensors), .gguf file, or '{DEFAULT_MODEL}' (the packaged default)"
model_b_option = click.option("--model-b", default=None,
                              help="a second model of the same architecture and size; plans name its layers as b:8-23")

model_option = click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help=MODEL_HELP)
_DTYPE_CHOICES = [*DENSE_PRECISIONS, *BLOCK_PRECISIONS]
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
# bench's and tune's: whether transformers' own generate is timed (None: app/bench.py wants_transformers)
transformers_option = click.option(
    "--transformers/--no-transformers", default=None,
    help="also time transformers' own generate (the speedups' reference) and layerplan on the eager engine; "
         "default: yes, but not for a GGUF run as stored, which transformers runs dequantized whole (the GB said "
         "before it loads): there the reference is layerplan's plain decoding, and llama.cpp's tools the peer")
DEVICE_MAP_KEY = "layerplan.device_map"
_device_only = click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, …")
_device_map_option = click.option(
    "--device-map", metavar="auto|FILE", default=None, expose_value=False,
    callback=lambda context, _, value: context.meta.__setitem__(DEVICE_MAP_KEY, value),
    help="spread the decoder layers over GPUs, CPU memory and disk instead of --device: auto (accelerate's plan "
         "for the free memory) or a JSON/YAML map of module -> cpu, disk, cuda:N (as accelerate writes it)")


GPU_LAYERS_KEY = "layerplan.gpu_layers"
ALL_GPU_LAYERS = ("-1", "auto", "all")  # llama.cpp's words for as many layers as fit


def _gpu_layers(context: click.Context, param: click.Parameter, value: str | None) -> None:
    """-ngl N (N >= 0, or -1, auto, all: every layer) into the context (GPU_LAYERS_KEY: layers, None)."""
    text = None if value is None else value.strip().lower()
    if text is not None and text not in ALL_GPU_LAYERS and not text.isdecimal():
        raise click.BadParameter(f"{value!r} is no layer count: N (0 or more), or -1, auto or all for every layer",
                                 context, param)
    # (any count above a model's depth means every layer: a count of many digits is not read as a number)
    layers = None if text is None else 1 << 30 if text in ALL_GPU_LAYERS or len(text.lstrip("0")) > 9 else int(text)
    context.meta[GPU_LAYERS_KEY] = layers


_gpu_layers_option = click.option(
    "--n-gpu-layers", "-ngl", "--gpu-layers", default=None, metavar="N", expose_value=False, callback=_gpu_layers,
    help="llama.cpp's layers on the GPU: here a model runs on one device, so N > 0 (or all) runs the whole "
         "model on the GPU (--device cuda) where torch sees one, and is ignored where it sees none, as "
         "llama.cpp's CPU build ignores it")


def device_option(command):
    """--device, with --device-map and -ngl beside it (read by load: every command that takes a device
    takes a map and llama.cpp's GPU layers)."""
    return _device_only(_device_map_option(_gpu_layers_option(command)))


def gpu_layers_device(layers: int | None, device: str, gpu_seen: bool) -> tuple[str, str | None]:
    """The device a command runs on given -ngl (None: not given) beside --device, and a note where
    -ngl changes nothing: --device (or a device map) names the device where given, N > 0 the GPU
    where one is seen, the CPU where none is."""
    if not layers or device != "cpu":
        return device, None
    if gpu_seen:
        return "cuda", None
    return device, "(-ngl: torch sees no GPU here, so the model runs on the CPU; llama.cpp's CPU build ignores -ngl too)"
engine_option = click.option("--engine", default="auto", show_default=True, type=click.Choice(list(ENGINES)),
                             help="; ".join(f"{name}: {text}" for name, text in ENGINES.items()))
auto_dtype_option = click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", *_DTYPE_CHOICES]),
                                 help="auto: a GGUF as stored in llama.cpp's arithmetic (stored-fast) where the "
                                      "native kernels run, else the fastest here by `layerplan probe` (measured once "
                                      f"per machine), else bfloat16 where it is fast, float32 elsewhere; {_BLOCK_HELP}")


@dataclass(frozen=True)
class FamiliarName:
    """One row of docs/coming-from.md: what llama.cpp and transformers call a setting, and ours."""

    setting: str
    llama_cpp: str  # its flag in llama.cpp's tools ("" where it has none)
    transformers: str  # its name in transformers' generate / config ("" where it has none)
    layerplan: str  # our flags, the first the one --help shows first
    commands: tuple[str, ...]  # where it is taken


FAMILIAR_NAMES = (
    FamiliarName("model file or folder", "-m, --model", "from_pretrained(PATH)", "-m, --model",
                 ("generate", "chat", "serve", "bench", "ppl", "scan", "search", "explore")),
    FamiliarName("prompt", "-p, --prompt", "the input text", "-p, --prompt (or the first argument)", ("generate",)),
    FamiliarName("prompt from a file", "-f, --file", "", "-f, --file", ("generate",)),
    FamiliarName("tokens to generate", "-n, --n-predict", "max_new_tokens",
                 "-n, --n-predict (--max-new-tokens; -1: until the context is full, generate and chat)",
                 ("generate", "chat", "bench", "tune", "frontier")),
    FamiliarName("CPU threads", "-t, --threads", "torch.set_num_threads", "-t, --threads",
                 ("generate", "chat", "serve", "bench", "ppl", "scan", "search", "explore", "tune")),
    FamiliarName("layers on the GPU", "-ngl, --n-gpu-layers", "device_map", "-ngl, --n-gpu-layers (all or none)",
                 ("generate", "chat", "serve", "ppl", "scan", "explore", "eval")),
    FamiliarName("context length", "-c, --ctx-size", "max_position_embeddings", "-c, --ctx-size",
                 ("generate", "chat", "serve")),
    FamiliarName("temperature", "--temp", "temperature", "--temp (--temperature)", ("generate", "chat")),
    FamiliarName("top-k", "--top-k", "top_k", "--top-k", ("generate", "chat")),
    FamiliarName("top-p (nucleus)", "--top-p", "top_p", "--top-p", ("generate", "chat")),
    FamiliarName("min-p", "--min-p", "min_p", "--min-p", ("generate", "chat")),
    FamiliarName("repetition penalty", "--repeat-penalty", "repetition_penalty",
                 "--repeat-penalty (--repetition-penalty)", ("generate", "chat")),
    FamiliarName("logit bias", "-l, --logit-bias", "sequence_bias", "-l, --logit-bias", ("generate", "chat")),
    FamiliarName("presence and frequency penalties", "--presence-penalty, --frequency-penalty", "",
                 "--presence-penalty, --frequency-penalty", ("generate", "chat")),
    FamiliarName("sampling seed", "-s, --seed", "torch.manual_seed / set_seed", "-s, --seed", ("generate", "chat")),
    FamiliarName("system message", "-sys, --system-prompt", "a {'role': 'system'} message",
                 "-sys, --system (--system-prompt)", ("chat",)),
    FamiliarName("chat template", "-cnv / --jinja", "apply_chat_template", "--chat (generate); chat wraps always",
                 ("generate",)),
    FamiliarName("draft model", "-md, --model-draft", "assistant_model", "-md, --model-draft (--draft model:PATH)",
                 ("generate",)),
    FamiliarName("lookup drafts", "llama-lookup", "prompt_lookup_num_tokens", "--draft ngram, --draft suffix",
                 ("generate", "chat", "serve")),
    FamiliarName("timings after a run", "(printed always)", "", "--stats (a summary), --json (the object)",
                 ("generate",)),
    FamiliarName("server address", "--host, --port", "", "--host, --port", ("serve",)),
    FamiliarName("served model name", "-a, --alias", "", "-a, --alias (--served-name)", ("serve",)),
    FamiliarName("requests at once", "-np, --parallel", "", "-np, --parallel (--max-batch)", ("serve",)),
    FamiliarName("API key", "--api-key", "", "--api-key", ("serve",)),
)


def familiar_table() -> str:
    """FAMILIAR_NAMES as the Markdown table docs/coming-from.md shows."""
    rows = ["| setting | llama.cpp | transformers | layerplan | commands |", "|---|---|---|---|---|"]
    for name in FAMILIAR_NAMES:
        cells = (name.setting, name.llama_cpp, name.transformers, name.layerplan, ", ".join(name.commands))
        rows.append("| " + " | ".join(f"`{c}`" if c and i in (1, 3) else (c or "—") for i, c in enumerate(cells)) + " |")
    return "\n".join(rows)


def light_context(command: click.Command, argv: list[str], any_dtype: bool = False) -> click.Context | None:
    """`command`'s own reading of `layerplan NAME ...` (argv without the program), for the light
    front end to weigh (the light_*_request readers of app/cli/generating.py, scoring.py,
    searching.py, exploring.py): None where the line is another command's, asks for help, runs
    with LAYERPLAN_FRONT_END=torch, is refused by the command (the torch front end reads it then,
    and says what it says), or asks what only the torch front end runs: a dtype other than the
    GGUF's as stored, a device other than the CPU, a device map, GPU layers (-ngl: torch says
    whether a GPU is there). any_dtype: the command's --dtype is a name it writes, not an
    arithmetic (export's)."""
    if not argv or argv[0] != command.name or os.environ.get(FRONT_END_VARIABLE, "") == "torch":
        return None
    if any(arg in ("-h", "--help") for arg in argv[1:]):
        return None
    try:
        context = command.make_context(command.name, list(argv[1:]))
    except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
        return None
    except ValueError:  # (click.Path's os.stat of a path with a NUL in it: only a caller's argv, never a shell's)
        return None
    given = context.params
    dtypes = given["dtypes"] if "dtypes" in given else [given.get("dtype")]  # (probe's: none given, the stored)
    if ((not any_dtype and any(dtype not in ARITHMETICS for dtype in dtypes)) or given.get("device", "cpu") != "cpu"
            or context.meta.get(DEVICE_MAP_KEY) is not None or context.meta.get(GPU_LAYERS_KEY)):
        return None
    return context


def light_runs_draft(spec: str) -> bool:
    """Whether the light front end runs a --draft spec: every kind in it one it drafts by
    (drafters/kinds.py drafts_on_the_light_front_end: not a draft that runs torch modules, nor a
    token tree), and every draft model in it a GGUF (the torch front end loads any other, or says
    why not)."""
    return drafts_on_the_light_front_end(spec) and all(gguf_of(path) is not None for path in draft_models(spec))


class Output(click.Path):
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


def decoding_model_options(command):
    """The model a decoding command runs and how (generate, chat, serve): --model, --dtype (auto),
    --device, --engine, --threads."""
    for option in reversed((model_option, auto_dtype_option, device_option, engine_option, threads_option)):
        command = option(command)
    return command
