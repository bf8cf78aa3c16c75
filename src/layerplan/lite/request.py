"""The requests the light front end carries out (lite/cli.py; the research commands' are
lite/research_request.py's). A `layerplan generate` request: a GGUF's continuation of one prompt
(the model, its dtype as stored, the engine, threads, a plan of this model, the token budget, stop
strings, streaming, the chat template where it only wraps the prompt, the sampling settings and
seed, a draft, the statistics); app/cli/generating.py light_request makes one of a command
line that the command itself has read, where the line asks for nothing else. A `layerplan chat`
request: a conversation's model and settings (app/cli/chatting.py light_chat_request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.choices import GGUF_DEFAULT, STORED_ARITHMETIC, STORED_PRECISION
from layerplan.models.gguf_place import DEFAULT_MODEL

# dtype -> the arithmetic of the products (engine/load.py: auto is a GGUF as stored, GGUF_DEFAULT,
# where the native kernels run, and the light front end runs only where they do)
ARITHMETICS = {"auto": STORED_ARITHMETIC[GGUF_DEFAULT], **STORED_ARITHMETIC}


def precision_of(dtype: str) -> str:
    """The dtype the torch front end names for a request's (a GGUF's auto is stored-fast)."""
    return STORED_PRECISION[ARITHMETICS[dtype]]


@dataclass(kw_only=True)
class FileRequest:
    """What every request of the light front end names: a GGUF, its dtype as stored, the threads;
    `engine` what the loading line names (the torch front end's default), `first_use` whether the
    command made the model's index (lite/cli.py runnable); `model_b` a second GGUF whose layers
    plans take (--model-b, where the command has it)."""

    model: str = DEFAULT_MODEL
    model_b: str | None = None
    dtype: str = "auto"
    engine: str = "auto"
    threads: int | None = None
    first_use: bool = False

    @property
    def precision(self) -> str:
        return precision_of(self.dtype)


@dataclass
class LiteRequest(FileRequest):
    prompt: str
    plan: str | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stream: bool = True
    chat: bool = False
    stats: bool = False  # --stats / --verbose: the summary lines
    as_json: bool = False  # --json: the statistics object
    # the sampling settings (decoding/choice.py chooses each token by them)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # a draft the light front end runs (drafters/kinds.py drafts_on_the_light_front_end: lookups,
    # the model's own sub-plans, auto), its draft-length policy, and where a sub-plan's draft
    # stops (its top-1 probability under this)
    draft: str | None = None
    draft_length: str | None = None
    draft_confidence: float = 0.0

    def sampling(self) -> SamplingParams:
        """The settings, checked: SamplingError where one is out of range."""
        return SamplingParams.of(self)


@dataclass
class LiteChatRequest(FileRequest):
    """app/cli/chatting.py's options: the settings (decoding/chat_state.py ChatSettings's fields) as
    the command line gives them, those it names (they override a --load file's), the file."""

    settings: dict = field(default_factory=dict)
    named: list[str] = field(default_factory=list)
    load_file: str | None = None


@dataclass
class LiteExportRequest(FileRequest):
    """`layerplan export` where no torch module is needed (app/cli/exporting.py
    light_export_request): a GGUF's plan as a GGUF file of its stored blocks (fmt 'gguf'), or any
    model's plan as mergekit YAML from its config (fmt 'mergekit'; yaml_dtype its dtype line,
    model_b its source b)."""

    plan: str = ""
    out: str = ""
    fmt: str = "gguf"
    source: str | None = None
    yaml_dtype: str = "float32"
