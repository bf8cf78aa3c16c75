"""`layerplan chat`: a conversation with a model run by a plan, in the model's chat template, a
reply at a time, streamed.

ChatSession is the conversation without a terminal: its messages, plan, draft and sampling
settings, and the KV cache of the tokens the model has already read, so that a turn prefills only
what is new. Each turn renders the whole conversation through the chat template (the one
rendering a fresh run of the same history gets, so a reply equals that run's) and keeps the cache
up to the longest prefix it shares with the tokens the cache holds: everything up to the new user
message, unless the template or the tokenizer writes the last reply differently from the tokens
that were generated (from there on it is prefilled again).

run_chat is the loop at a terminal or behind a pipe: a line is a message or a /command; replies
go to stdout, everything else to stderr; Ctrl-C stops a reply, Ctrl-D (end of input) leaves.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TextIO

import click

from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.output import chat_prompt_ids
from layerplan.decoding.scheduler import Job, Scheduler
from layerplan.decoding.text import GenerationResult, common_prefix
from layerplan.decoding.sampling_params import SamplingParams, check_seed
from layerplan.engine.cache import KVCache
from layerplan.engine.probe import ProbeRow
from layerplan.engine.runner import Resume, new_cache, run_hidden
from layerplan.files import write_json_atomic
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

SAVE_FORMAT = "layerplan-chat"  # the "format" of a /save file, which `chat --load` checks
ROLES = ("user", "assistant")
NO_DRAFT = ("none", "off")  # /draft none: plain decoding again
MAX_SAVED_BYTES = 256 * 2 ** 20  # a transcript longer than any model's context, many times over
# the cache keeps the residual stream entering every STREAM_EVERY-th step, so that /plan reruns
# the conversation from the last such step at or before the first one it changes, not from the
# start (each kept stream costs a hidden-wide row a token: at 4, SmolLM2's are 0.7x its cache)
STREAM_EVERY = 4


@dataclass
class ChatSettings:
    """What a /save file keeps beside the transcript, and what `chat --load` resumes with."""

    plan: str = "full"
    draft: str | None = None  # a drafter spec (decoding/drafters/registry.py); None: plain decoding
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # every reply samples with it, so a reply follows from its transcript
    max_new_tokens: int = 256  # per reply, within the model's context
    system: str | None = None  # a system message before the conversation
    top_k: int = 0  # the rest of the sampling settings (decoding/sampling.py SamplingParams)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.sampling()  # SamplingError: out of range
        check_seed(self.seed)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens!r} is out of range: a whole number >= 1")

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.min_p)


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


class ChatSession:
    """A conversation with `model`: reply() answers a user message; the set_* methods change the
    plan, draft and settings between replies; save() and read_saved() keep and resume it."""

    def __init__(self, model: LoadedModel, settings: ChatSettings | None = None,
                 messages: Sequence[dict[str, str]] = (), probe_row: ProbeRow | None = None,
                 draft_length: str | None = None, stream_every: int = STREAM_EVERY) -> None:
        if model.tokenizer is None:
            model.encode("")  # ModelError in the model's own words: text cannot be turned into tokens
        self.model, self.probe_row, self.draft_length = model, probe_row, draft_length
        self.stream_every = stream_every  # the cache keeps the stream entering every such step (STREAM_EVERY)
        self.settings = settings if settings is not None else ChatSettings()
        self.plan = model.plan(self.settings.plan)
        self.settings.plan = self.plan.to_string()
        self.drafter = self._drafter(self.settings.draft, self.plan)
        self.messages: list[dict[str, str]] = [dict(m) for m in messages]
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.last: Totals | None = None
        self.session = Totals()
        self.replan: str | None = None

    # ----- settings ---------------------------------------------------------------------------
    def _drafter(self, spec: str | None, plan: LayerPlan):
        costs = dict(self.probe_row.relative) if self.probe_row is not None else {}
        return make_drafter(spec, self.model, plan, pass_costs=costs) if spec else None

    def set_plan(self, text: str) -> str:
        """Run the model by this plan from the next reply on; what was kept of the cache."""
        plan = self.model.plan(text)
        drafter = self._drafter(self.settings.draft, plan)  # a draft that cannot draft for it: refused here
        first = first_changed_step(self.plan, plan)
        self.plan, self.drafter, self.settings.plan = plan, drafter, plan.to_string()
        if first is None:
            self.replan = "the same steps as before: the cache is kept whole"
            return self.replan
        held = len(self.cached)
        # Steps before `first` hold the same keys and values under both plans: the conversation
        # runs again from the last step at or before `first` whose entering stream the cache
        # kept, that step's stream being where it starts, the steps before it kept as they are
        restart = self._restart_step(first, held)
        if restart is None:
            self.cache, self.cached = None, []
            self.replan = (f"step {first} is the first to change and no stream is kept before it: the "
                           f"{held}-token conversation prefills again through {plan.to_string()} at the next "
                           "reply (nothing of the cache reused)")
            return self.replan
        try:
            self._run_again_from(restart, held)
        except BaseException:  # (Ctrl-C among them) half rewritten: the next reply prefills it all again
            self.cache, self.cached = None, []
            raise
        self.replan = (f"step {first} is the first to change: steps 0-{restart - 1} kept, the {held}-token "
                       f"conversation ran again from step {restart} (its kept stream) through the new plan")
        return self.replan

    def _stream_steps(self, plan: LayerPlan) -> range:
        """The steps whose entering stream the cache keeps."""
        return range(self.stream_every, len(plan.active_steps), self.stream_every)

    def _restart_step(self, first: int, held: int) -> int | None:
        """The last step at or before `first` whose entering stream the cache holds for every one
        of its `held` tokens (None: none, or nothing held)."""
        cache = self.cache
        if cache is None or held == 0:
            return None
        kept = [step for step, length in cache.stream_lengths.items() if 0 < step <= first and length >= held]
        return max(kept, default=None)

    def _run_again_from(self, restart: int, held: int) -> None:
        """The cache made the new plan's (self.plan's): its slots from `restart` on written again
        over the `held` positions from the stream entering that step, its streams kept anew."""
        cache, plan = self.cache, self.plan
        cache.crop(held)
        hidden = cache.streams[restart][:held][None].clone()
        cache.resize(len(plan.steps))
        cache.drop_slots(restart)
        cache.keep_streams(plan, self._stream_steps(plan))
        run_hidden(self.model, None, plan, cache, 0, resume=Resume(hidden, restart))

    def set_draft(self, spec: str | None) -> None:
        spec = None if spec is None or spec.strip().lower() in ("", *NO_DRAFT) else spec.strip()
        self.drafter = self._drafter(spec, self.plan)
        self.settings.draft = spec

    def set_temperature(self, temperature: float) -> None:
        self.settings = _replace(self.settings, temperature=temperature)

    def set_seed(self, seed: int | None) -> None:
        self.settings = _replace(self.settings, seed=seed)

    def set_system(self, text: str | None) -> None:
        """The system message (None or empty: none); the cache keeps what precedes the change."""
        self.settings.system = text or None

    def reset(self) -> None:
        """Forget the conversation (the settings and the session's counts stay). The cache stays
        too: a new conversation starts with the same template tokens, which it keeps."""
        self.messages = []

    # ----- replies ------------------------------------------------------------------------------
    def conversation(self, messages: Sequence[dict[str, str]] | None = None) -> list[dict[str, str]]:
        """The messages the template renders: the system message, then the conversation."""
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return system + list(self.messages if messages is None else messages)

    def prompt_ids(self, messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        """The conversation's token ids, ready for the assistant's turn (what a fresh run reads)."""
        return chat_prompt_ids(self.model, self.conversation(messages))

    def reply(self, text: str, on_text: Callable[[str], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> Reply:
        """Answer a user message. on_text gets the reply's text as it comes; should_stop() True
        stops it (the partial reply stays in the conversation)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        room = self.model.context_length - len(ids)
        if room <= 0:
            raise ValueError(f"the conversation is {len(ids)} tokens and the model's context "
                             f"{self.model.context_length}: /reset starts a new one (/save keeps this one first)")
        kept = self._keep(ids)
        cache, self.cache, self.cached = self.cache, None, []  # a reply that fails leaves no half-written cache
        settings, sampling = self.settings, self.settings.sampling()
        budget = min(settings.max_new_tokens, room)
        if cache is None:
            cache = new_cache(self.plan, capacity=len(ids) + budget + 16)
            cache.keep_streams(self.plan, self._stream_steps(self.plan))
        scheduler = Scheduler(self.model, self.plan, probe_row=self.probe_row, max_batch=1)
        reply = scheduler.submit(Job(ids, budget, sampling, settings.seed, (), on_text=on_text, plan=self.plan,
                                     draft=self.drafter, draft_chosen=True, draft_length=self.draft_length,
                                     cache=cache, should_stop=should_stop))
        scheduler.run(until_idle=True)
        result = reply.result()
        if result is None:  # stopped before it began: nothing said, the cache as it was
            result = GenerationResult("", [], len(ids), "cancelled", 0.0, 0.0, self.plan.to_string())
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        self.cache, self.cached = cache, [*ids, *result.token_ids][: cache.length]
        spec = result.stats if self.drafter is not None else {}
        totals = Totals(1, len(result.token_ids), result.seconds - result.prefill_seconds, result.prefill_seconds,
                        len(ids) - kept, kept, spec.get("rounds", max(len(result.token_ids) - 1, 0)),
                        spec.get("drafted", 0), spec.get("accepted", 0))
        self.last = totals
        self.session.add(totals)
        return Reply(result.text, result.token_ids, result.stop_reason, totals, result.slow_note)

    def _keep(self, ids: list[int]) -> int:
        """Crop the cache to the longest prefix its tokens share with ids (at least the last token
        left to run: its logits give the reply's first token); how many tokens it keeps."""
        if self.cache is None:
            return 0
        kept = common_prefix(self.cached, ids[:-1])
        self.cache.crop(kept)
        self.cached = self.cached[:kept]
        return kept

    # ----- what it shows and keeps --------------------------------------------------------------
    def stats(self) -> ChatStats:
        probe_ms = self.probe_row.step_ms if self.probe_row is not None else None
        return ChatStats(self.settings.plan, self.settings.draft, self.plan.cost,
                         sum(m["role"] == "user" for m in self.messages), len(self.cached), self.last,
                         self.session, probe_ms, self.replan)

    def to_dict(self) -> dict:
        return {"format": SAVE_FORMAT, "version": 1, "model": self.model.name, "settings": asdict(self.settings),
                "messages": self.messages}

    def save(self, path: str | Path) -> Path:
        """The transcript, plan, draft and settings as JSON (written atomically)."""
        return write_json_atomic(path, self.to_dict())


def _replace(settings: ChatSettings, **changes) -> ChatSettings:
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


# ----- the loop -------------------------------------------------------------------------------------
HELP = """\
a line is a message to the model; a line that starts with / is a command (// sends a message that starts with /):
  /plan PLAN     run the model by this plan from the next reply on (the conversation goes on)
  /draft SPEC    lossless speculative decoding with this drafter (as --draft); /draft none: plain
  /temp T        temperature: 0 greedy, else a number >= 1e-4
  /seed S        every reply samples with seed S; /seed none: unseeded
  /system TEXT   the system message (/system alone: none)
  /stats         tokens/s, acceptance, tokens per pass, the plan's cost, what the cache holds
  /reset         forget the conversation (settings stay)
  /save FILE     the transcript, plan, draft and settings as JSON (`layerplan chat --load FILE` resumes)
  /help          this list
Ctrl-C stops a reply; Ctrl-D (end of input) leaves."""


@contextmanager
def _interrupt_stops(stop: threading.Event):
    """While a reply decodes, Ctrl-C (SIGINT) sets `stop` instead of raising, so the decode ends
    at its next token with the cache whole; elsewhere Ctrl-C keeps its meaning."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# a reply's control characters but newline and tab, shown as U+FFFD at a terminal: a model's bytes
# must not move the cursor or switch the terminal's modes (a pipe gets the text as it is)
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x20), *range(0x7f, 0xa0)] if chr(c) not in "\n\t"}


def _number(text: str, kind: type, what: str):
    if text.lower() == "none" and kind is int:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{what} takes {'a whole number or none' if kind is int else 'a number'}, not "
                         f"{text!r}") from None


class ChatLoop:
    """Lines in, replies and status out: run() reads until end of input."""

    def __init__(self, session: ChatSession, stdin: TextIO, stdout: TextIO, stderr: TextIO,
                 interactive: bool, guard: Callable = nullcontext) -> None:
        """guard(): a context in which bad input becomes click.ClickException (the CLI's
        _user_errors), so a bad command gets the CLI's one line and the session goes on."""
        self.session, self.stdin, self.stdout, self.stderr = session, stdin, stdout, stderr
        self.interactive, self.guard = interactive, guard
        self.leave = False

    def status(self, line: str) -> None:
        self.stderr.write(line + "\n")
        self.stderr.flush()

    def read(self) -> str | None:
        """The next line; None at end of input."""
        if self.interactive:
            try:
                return input("> ")
            except EOFError:
                self.stdout.write("\n")
                return None
        line = self.stdin.readline()
        return line.rstrip("\r\n") if line else None

    def run(self) -> int:
        if self.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            self.status(f"chatting with {self.session.model.name} (plan {self.session.settings.plan}, draft "
                        f"{self.session.settings.draft or 'none'}); /help lists the commands, Ctrl-D leaves")
        if not getattr(self.session.model.tokenizer, "chat_template", None):  # (decoding/output.py chat_prompt_ids)
            self.status("(this model has no chat template: the conversation goes to it as 'role: content' lines, "
                        "which a base model continues rather than answers)")
        while not self.leave:
            try:
                line = self.read()
            except KeyboardInterrupt:  # at the prompt: a fresh line (a pipe's reader is stopped instead)
                if not self.interactive:
                    return 130
                self.stdout.write("\n")
                continue
            if line is None:
                break
            if not line.strip():
                continue
            try:
                with self.guard():
                    if line.startswith("/") and not line.startswith("//"):
                        self.command(line)
                    else:
                        self.answer(line[1:] if line.startswith("//") else line)
            except click.ClickException as error:
                self.status(f"Error: {error.format_message()}")
            except KeyboardInterrupt:  # a command that takes long (a draft model loading): that command
                self.status("(interrupted)")
        return 0

    def answer(self, text: str) -> None:
        stop = threading.Event()

        def show(piece: str) -> None:
            self.stdout.write(piece.translate(_CONTROLS) if self.interactive else piece)
            self.stdout.flush()

        with _interrupt_stops(stop):
            reply = self.session.reply(text, on_text=show, should_stop=stop.is_set)
        self.stdout.write("\n")
        self.stdout.flush()
        if reply.stop_reason == "cancelled":
            self.status(f"(reply stopped after {reply.totals.tokens} tokens; it stays in the conversation)")
        elif reply.stop_reason == "length":
            self.status(f"(reply cut at {reply.totals.tokens} tokens: --max-new-tokens, or the model's context)")
        if reply.slow_note:
            self.status(reply.slow_note)

    def command(self, line: str) -> None:
        name, _, argument = line.partition(" ")
        name, argument, session = name.lower(), argument.strip(), self.session
        if name == "/plan":
            if not argument:
                raise ValueError("/plan takes a plan, e.g. /plan skip:attn=3,5 or /plan full")
            note = session.set_plan(argument)
            self.status(f"plan {session.settings.plan}: {note}")
        elif name == "/draft":
            if not argument:
                raise ValueError("/draft takes a drafter spec (as --draft, e.g. /draft suffix) or none")
            session.set_draft(argument)
            self.status(f"draft {session.settings.draft or 'none'}")
        elif name in ("/temp", "/temperature"):
            session.set_temperature(_number(argument, float, "/temp"))
            self.status(f"temperature {session.settings.temperature:g}")
        elif name == "/seed":
            session.set_seed(_number(argument, int, "/seed"))
            self.status(f"seed {session.settings.seed if session.settings.seed is not None else 'none'}")
        elif name == "/system":
            session.set_system(argument)
            self.status(f"system message {'set' if argument else 'removed'}")
        elif name == "/stats":
            for stat_line in session.stats().lines():
                self.status(stat_line)
        elif name == "/reset":
            session.reset()
            self.status("conversation forgotten")
        elif name == "/save":
            if not argument:
                raise ValueError("/save takes a file name")
            self.status(f"saved to {session.save(argument)}")
        elif name == "/help":
            self.status(HELP)
        elif name in ("/quit", "/exit"):
            self.leave = True
        else:
            raise ValueError(f"unknown command {name}: /help lists the commands")


def run_chat(session: ChatSession, guard: Callable = nullcontext, stdin: TextIO | None = None,
             stdout: TextIO | None = None, stderr: TextIO | None = None, interactive: bool | None = None) -> int:
    """The chat loop on the process's streams by default; interactive (a prompt, line editing):
    when stdin is a terminal. Its exit status: 0 at end of input, 130 when Ctrl-C stops a pipe's
    reading."""
    stdin = stdin if stdin is not None else sys.stdin
    if interactive is None:
        interactive = stdin.isatty()
    loop = ChatLoop(session, stdin, stdout if stdout is not None else sys.stdout,
                    stderr if stderr is not None else sys.stderr, interactive, guard)
    return loop.run()
