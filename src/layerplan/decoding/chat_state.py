"""A conversation's state, apart from the model that answers it: its settings (ChatSettings), its
counts (Totals, Reply, ChatStats), the /save file (read_saved), and ChatHistory, what every chat
session does alike (the messages, the settings' changes, the cache kept by shared prefix, /stats,
/save). The torch front end's session (app/chat.py ChatSession) and the light front end's
(lite/chat.py LightChatSession) add the model's passes; app/chat_loop.py runs either. Without
torch."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from layerplan.decoding.budget import UNTIL_CONTEXT
from layerplan.decoding.draft_length import DRAFT_LENGTHS
from layerplan.decoding.sampling_params import SamplingParams, check_seed
from layerplan.decoding.text import GenerationResult, common_prefix
from layerplan.files import write_json_atomic
from layerplan.models.chat_template import PLAIN_CHAT_STOPS
from layerplan.plan.plan import LayerPlan

SAVE_FORMAT = "layerplan-chat"  # the "format" of a /save file, which `chat --load` checks
ROLES = ("user", "assistant")
NO_DRAFT = ("none", "off")  # /draft none: plain decoding again
MAX_SAVED_BYTES = 256 * 2 ** 20  # a transcript longer than any model's context, many times over
# the cache keeps the residual stream entering every STREAM_EVERY-th step, so that /plan reruns
# the conversation from the last such step at or before the first one it changes, not from the
# start (each kept stream costs a hidden-wide row a token: at 4, SmolLM2's are 0.7x its cache)
STREAM_EVERY = 4


def draft_named(spec: str | None) -> str | None:
    """The drafter spec a /draft line names; None for plain decoding (none, off, nothing)."""
    return None if spec is None or spec.strip().lower() in ("", *NO_DRAFT) else spec.strip()


@dataclass
class ChatSettings:
    """What a /save file keeps beside the transcript, and what `chat --load` resumes with."""

    plan: str = "full"
    draft: str | None = None  # a drafter spec (decoding/drafters/registry.py); None: plain decoding
    draft_length: str | None = None  # a draft's length policy (draft_length.py DRAFT_LENGTHS); None: adaptive
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # every reply samples with it, so a reply follows from its transcript
    max_new_tokens: int = 256  # per reply, within the model's context (UNTIL_CONTEXT: all it leaves)
    system: str | None = None  # a system message before the conversation
    top_k: int = 0  # the rest of the sampling settings (decoding/sampling_params.py SamplingParams)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a /save file's [id, bias] lists

    def __post_init__(self) -> None:
        try:
            self.logit_bias = tuple((token, bias) for token, bias in self.logit_bias)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias {self.logit_bias!r} is not a list of [token id, bias] pairs") from None
        self.sampling()  # SamplingError: out of range
        check_seed(self.seed)
        if self.draft_length is not None and self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length {self.draft_length!r} is not a draft length policy: "
                             f"{', '.join(DRAFT_LENGTHS)}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or (self.max_new_tokens < 1 and self.max_new_tokens != UNTIL_CONTEXT):
            raise ValueError(f"max_new_tokens {self.max_new_tokens!r} is out of range: a whole number >= 1, or "
                             f"{UNTIL_CONTEXT} (until the context is full)")

    def sampling(self) -> SamplingParams:
        return SamplingParams.of(self)


@dataclass
class Totals:
    """Decoding counts over some replies (one, or the session's)."""

    replies: int = 0
    tokens: int = 0  # new tokens
    decode_seconds: float = 0.0  # after the prefills
    prefill_seconds: float = 0.0
    prefilled: int = 0  # conversation tokens run through the plan before a reply
    reused: int = 0  # conversation tokens whose keys and values came from the cache instead
    passes: int = 0  # target passes after the prefills: one a token plainly, one a round with a draft
    drafted: int = 0
    accepted: int = 0

    def add(self, other: Totals) -> None:
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else math.nan

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per target pass after the prefill (1.0: plain decoding)."""
        return (self.tokens - self.replies) / self.passes if self.passes else math.nan

    @property
    def seconds_per_pass(self) -> float:
        return self.decode_seconds / self.passes if self.passes else math.nan

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second, "acceptance": self.acceptance,
                "tokens_per_pass": self.tokens_per_pass, "seconds_per_pass": self.seconds_per_pass}


@dataclass
class Reply:
    """One reply: its text, why it stopped ("eos", "length", "cancelled": Ctrl-C) and its counts."""

    text: str
    token_ids: list[int]
    stop_reason: str
    totals: Totals
    slow_note: str | None = None  # engine/probe.py PaceCheck: this reply decoded slower than the probe says

    def to_dict(self) -> dict:
        return {**asdict(self), "totals": self.totals.to_dict()}


@dataclass
class ChatStats:
    """What /stats shows: the settings, the last reply and the session's counts, the plan's cost."""

    plan: str
    draft: str | None
    sub_layers: float  # the share of the full model's sub-layers the plan runs
    turns: int
    conversation_tokens: int  # in the cache (the conversation as the model has read it)
    last: Totals | None
    session: Totals
    probe_step_ms: float | None  # this machine's probe: one step of the full model; None: not probed
    replan: str | None  # what the last /plan kept of the cache, and why

    @property
    def relative_cost(self) -> float | None:
        """The session's decode time per target pass over the probe's full-model step: this plan's
        (and draft's) cost in full steps, measured."""
        if self.probe_step_ms is None or not self.session.passes:
            return None
        return self.session.seconds_per_pass * 1000 / self.probe_step_ms

    def to_dict(self) -> dict:
        return {**asdict(self), "last": self.last.to_dict() if self.last else None,
                "session": self.session.to_dict(), "relative_cost": self.relative_cost}

    def lines(self) -> list[str]:
        lines = [f"plan {self.plan} (runs {self.sub_layers:.0%} of the sub-layers); draft {self.draft or 'none'}; "
                 f"turns {self.turns}, {self.conversation_tokens} tokens in the cache"]
        for name, totals in (("last reply", self.last), ("session", self.session)):
            if totals is None or not totals.replies:
                continue
            line = (f"{name}: {totals.tokens} tokens, {totals.tokens_per_second:.1f} tokens/s, "
                    f"{totals.tokens_per_pass:.2f} tokens per pass")
            if totals.drafted:
                line += f", acceptance {totals.acceptance:.2f} ({totals.accepted} of {totals.drafted} drafted)"
            line += f"; prefilled {totals.prefilled} tokens, {totals.reused} from the cache"
            lines.append(line)
        if self.probe_step_ms is None:
            lines.append("cost: no probe of this model here (`layerplan probe` measures one); plan runs "
                         f"{self.sub_layers:.0%} of the sub-layers")
        elif self.relative_cost is not None:
            lines.append(f"cost: {self.session.seconds_per_pass * 1000:.2f} ms per pass, {self.relative_cost:.2f}x "
                         f"the probe's full-model step ({self.probe_step_ms:.2f} ms)")
        if self.replan:
            lines.append(f"last /plan: {self.replan}")
        return lines


def first_changed_step(old: LayerPlan, new: LayerPlan) -> int | None:
    """The first step whose keys and values differ between the plans (another layer, sub-layers,
    scale or model, or a step one plan runs and the other does not); None: the same steps."""
    a, b = old.active_steps, new.active_steps
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def replaced(settings: ChatSettings, **changes) -> ChatSettings:
    """The settings with changes, checked (ChatSettings.__post_init__) before they are taken."""
    return ChatSettings(**{**asdict(settings), **changes})


@dataclass
class SavedChat:
    model: str
    settings: ChatSettings
    messages: list[dict[str, str]] = field(default_factory=list)


def read_saved(path: str | Path, given: dict | None = None) -> SavedChat:
    """A /save file, its settings overridden by `given` (options named on the command line). A
    file that is not one is a ValueError naming what is wrong."""
    path = Path(path)
    if not path.is_file():  # (a device such as /dev/zero would be read forever)
        raise ValueError(f"{path}: {'not a file' if path.exists() else 'no such file'}: give a file /save wrote")
    if path.stat().st_size > MAX_SAVED_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, more than a saved chat holds "
                         f"({MAX_SAVED_BYTES // 2 ** 20} MiB at most): give a file /save wrote")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg}, line {error.lineno}): give a file /save wrote") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file: give a file /save wrote") from None
    if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT:
        raise ValueError(f"{path}: not a saved chat (no \"format\": \"{SAVE_FORMAT}\"): give a file /save wrote")
    settings, messages = data.get("settings"), data.get("messages")
    known = {item.name for item in fields(ChatSettings)}
    if not isinstance(settings, dict) or not set(settings) <= known:
        raise ValueError(f"{path}: \"settings\" must be an object with keys among {', '.join(sorted(known))}")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES
            and isinstance(m["content"], str) for m in messages):
        raise ValueError(f"{path}: \"messages\" must be a list of {{\"role\": user|assistant, \"content\": text}}")
    try:
        chosen = ChatSettings(**{**settings, **(given or {})})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: its settings cannot be used: {error}") from None
    return SavedChat(str(data.get("model", "")), chosen, messages)


# the settings a conversation's command line may give: ChatSettings' fields, each an option of `chat`
COMMAND_LINE_SETTINGS = tuple(item.name for item in fields(ChatSettings))


@dataclass
class ChatOpening:
    """How a conversation starts: its settings and messages, from the command line, or from a /save
    file (`load_file`) with the settings the command line named over the file's."""

    settings: ChatSettings
    messages: list[dict[str, str]] = field(default_factory=list)
    load_file: str | None = None
    saved_model: str = ""  # the model the file was saved with

    def model_note(self, model_name: str) -> str | None:
        """The line for a file saved with another model than the one that resumes it."""
        if self.load_file is None or self.saved_model == model_name:
            return None
        return f"{self.load_file} was saved with {self.saved_model or 'an unnamed model'}; resuming with {model_name}"


def open_chat(settings: dict, named: Iterable[str], load_file: str | Path | None = None) -> ChatOpening:
    """The opening of a conversation whose command line gave `settings` (ChatSettings' fields; plan
    None: the full model) and named those in `named`; with `load_file`, the file's (read_saved's
    ValueError where it is not one)."""
    if load_file:
        saved = read_saved(load_file, {name: settings[name] for name in named})
        return ChatOpening(saved.settings, saved.messages, str(load_file), saved.model)
    return ChatOpening(ChatSettings(**{**settings, "plan": settings["plan"] or "full"}))


class ChatHistory:
    """What a chat session keeps between replies: `model` (its name, plans, context), the
    settings, the plan, the messages, the KV cache of the tokens in `cached`, the counts. A
    subclass answers (reply) and changes the plan and the draft (set_plan, set_draft)."""

    def __init__(self, model, settings: ChatSettings | None, messages: Sequence[dict[str, str]],
                 stream_every: int = STREAM_EVERY) -> None:
        self.model = model
        self.stream_every = stream_every  # the cache keeps the stream entering every such step (STREAM_EVERY)
        self.settings = settings if settings is not None else ChatSettings()
        self.plan: LayerPlan = model.plan(self.settings.plan)
        self.settings.plan = self.plan.to_string()
        self.messages: list[dict[str, str]] = [dict(m) for m in messages]
        self.cache = None  # the KV cache of the tokens in `cached` (None: nothing held)
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.last: Totals | None = None
        self.session = Totals()
        self.replan: str | None = None

    @property
    def probe_step_ms(self) -> float | None:
        """This machine's probe of the model: one step of the full model, in ms (None: not probed)."""
        return None

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a chat template (without one, 'role: content' lines)."""
        raise NotImplementedError

    @property
    def reply_stops(self) -> tuple[str, ...]:
        """The stop strings of every reply: without a chat template, the next 'user:' line."""
        return () if self.has_chat_template else PLAIN_CHAT_STOPS

    # ----- the plan -----------------------------------------------------------------------------
    def set_plan(self, text: str) -> str:
        """Run the model by this plan from the next reply on; what was kept of the cache."""
        plan = self.model.plan(text)
        self.plan_taken(plan)
        first = first_changed_step(self.plan, plan)
        self.plan, self.settings.plan = plan, plan.to_string()
        if first is None:
            self.replan = "the same steps as before: the cache is kept whole"
            return self.replan
        held = len(self.cached)
        # Steps before `first` hold the same keys and values under both plans: the conversation
        # runs again from the last step at or before `first` whose entering stream the cache
        # kept, that step's stream being where it starts, the steps before it kept as they are
        kept = [step for step, length in self.kept_streams().items() if 0 < step <= first and length >= held]
        restart = max(kept, default=None) if held else None
        if restart is None:
            self.cache, self.cached = None, []
            self.replan = (f"step {first} is the first to change and no stream is kept before it: the "
                           f"{held}-token conversation prefills again through {plan.to_string()} at the next "
                           "reply (nothing of the cache reused)")
            return self.replan
        try:
            self.run_again_from(restart, held)
        except BaseException:  # (Ctrl-C among them) half rewritten: the next reply prefills it all again
            self.cache, self.cached = None, []
            raise
        self.replan = (f"step {first} is the first to change: steps 0-{restart - 1} kept, the {held}-token "
                       f"conversation ran again from step {restart} (its kept stream) through the new plan")
        return self.replan

    def stream_steps(self, plan: LayerPlan) -> range:
        """The steps (indices into plan.active_steps) whose entering stream the cache keeps."""
        return range(self.stream_every, len(plan.active_steps), self.stream_every)

    def plan_taken(self, plan: LayerPlan) -> None:
        """Ready what the new plan needs (a draft for it), or raise before anything changes."""

    def kept_streams(self) -> dict[int, int]:
        """Step -> the positions of its entering stream the cache holds."""
        raise NotImplementedError

    def run_again_from(self, restart: int, held: int) -> None:
        """The cache made the new plan's (self.plan's): its slots from `restart` on written again
        over the `held` positions from the stream entering that step, its streams kept anew."""
        raise NotImplementedError

    # ----- the other settings -------------------------------------------------------------------
    def set_temperature(self, temperature: float) -> None:
        self.settings = replaced(self.settings, temperature=temperature)

    def set_seed(self, seed: int | None) -> None:
        self.settings = replaced(self.settings, seed=seed)

    def set_system(self, text: str | None) -> None:
        """The system message (None or empty: none); the cache keeps what precedes the change."""
        self.settings.system = text or None

    def reset(self) -> None:
        """Forget the conversation (the settings and the session's counts stay). The cache stays
        too: a new conversation starts with the same template tokens, which it keeps."""
        self.messages = []

    def conversation(self, messages: Sequence[dict[str, str]] | None = None) -> list[dict[str, str]]:
        """The messages the template renders: the system message, then the conversation."""
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return system + list(self.messages if messages is None else messages)

    def room(self, ids: Sequence[int]) -> int:
        """The new tokens the context leaves after the conversation's ids (ValueError: none)."""
        room = self.model.context_length - len(ids)
        if room <= 0:
            raise ValueError(f"the conversation is {len(ids)} tokens and the model's context "
                             f"{self.model.context_length}: /reset starts a new one (/save keeps this one first)")
        return room

    def budget(self, ids: Sequence[int]) -> int:
        """The new tokens a reply after the conversation's ids may take: the settings' count
        (UNTIL_CONTEXT: all the room) within the room the context leaves (ValueError: none)."""
        room = self.room(ids)
        return room if self.settings.max_new_tokens == UNTIL_CONTEXT else min(self.settings.max_new_tokens, room)

    def keep(self, ids: list[int]) -> int:
        """Crop the cache to the longest prefix its tokens share with ids (at least the last token
        left to run: its logits give the reply's first token); how many tokens it keeps."""
        if self.cache is None:
            return 0
        kept = common_prefix(self.cached, ids[:-1])
        self.cache.crop(kept)
        self.cached = self.cached[:kept]
        return kept

    def replied(self, messages: list[dict[str, str]], ids: list[int], result: GenerationResult, cache, kept: int,
                draft_stats: dict) -> Reply:
        """Take a reply to the conversation (messages: up to the user's): the cache that holds its
        tokens, the counts; draft_stats: the result's statistics where a draft ran (else {})."""
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        self.cache, self.cached = cache, [*ids, *result.token_ids][: cache.length]
        totals = Totals(1, len(result.token_ids), result.seconds - result.prefill_seconds, result.prefill_seconds,
                        len(ids) - kept, kept, draft_stats.get("rounds", max(len(result.token_ids) - 1, 0)),
                        draft_stats.get("drafted", 0), draft_stats.get("accepted", 0))
        self.last = totals
        self.session.add(totals)
        return Reply(result.text, result.token_ids, result.stop_reason, totals, result.slow_note)

    def stats(self) -> ChatStats:
        return ChatStats(self.settings.plan, self.settings.draft, self.plan.cost,
                         sum(m["role"] == "user" for m in self.messages), len(self.cached), self.last,
                         self.session, self.probe_step_ms, self.replan)

    def to_dict(self) -> dict:
        return {"format": SAVE_FORMAT, "version": 1, "model": self.model.name, "settings": asdict(self.settings),
                "messages": self.messages}

    def save(self, path: str | Path) -> Path:
        """The transcript, plan, draft and settings as JSON (written atomically)."""
        return write_json_atomic(path, self.to_dict())
