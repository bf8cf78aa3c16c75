"""An OpenAI-compatible HTTP server over layerplan's decoding (`layerplan serve`).

Routes and the mapping of requests and replies; the decoding is the scheduler's
(decoding/scheduler.py: up to --max-batch requests share each pass, in arrival order, on the main
thread, while HTTP is served from a background one). A client that disconnects has its generation
stopped at its next pass, its place freed. Speculative statistics ride in each response's `usage`
block.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both
with `"stream": true` for server-sent events, and `stream_options.include_usage`; a chat stream's
role chunk is sent when decoding starts, not while the request waits in the queue); POST
/tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's and llama-server's forms. Several
choices (n > 1, or a completion's list of prompts) decode together, streamed or not (a stream's
chunks carry each choice's index). What the server cannot honour is refused with a 400 rather
than ignored: best_of > n streamed, suffix, tools / tool_choice / functions,
response_format other than text, content parts other than text, a text part without text, a
message without content. Every client mistake is a 4xx: a sampling setting whose arithmetic would
not stay finite (temperature 1e-300), a seed torch cannot take, a conversation the chat template
refuses. Prompts are tokenized off the event loop (one worker thread), so a long one does not
hold up /health or other requests.

Extension: a request's `"layerplan": {"plan", "draft", "draft_length", "provenance",
"stream_interval"}` object runs it by its own plan and draft (parsed as the command line parses
them; a 400 naming the field when one cannot be used), with provenance each stream chunk's
`layerplan.tokens` (a whole answer's, for one not streamed) says which tokens were plain,
accepted drafts, corrections or bonuses (usage.provenance counts them), and stream_interval
gathers a stream's text into fewer chunks.

Log-probabilities: a chat request's `logprobs: true` (with `top_logprobs` up to 20) and a
completion's `logprobs: N` (0-20) answer in OpenAI's two shapes, a stream's chunks carrying their
own tokens'; a completion's `echo` puts the prompt before the completion, its tokens scored too
(decoding/prompt_logprobs.py). They are the model's own distribution at each token
(decoding/logprobs.py: before penalties, temperature and truncation, as vLLM reports them), the
same for a drafted token the target accepted as for one decoded plainly.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from layerplan.app.playground import add_playground
from layerplan.decoding.draft_length import make_draft_length
from layerplan.decoding.scheduler import DEFAULT_MAX_BATCH, Job, Scheduler
from layerplan.decoding.output import ChatTemplateError, chat_prompt_ids
from layerplan.decoding.text import GenerationResult, TextDelta
from layerplan.decoding.budget import ContextLengthError, token_budget
from layerplan.decoding.limits import SEED_RANGE
from layerplan.decoding.logprobs import MAX_TOP_LOGPROBS, CompletionLogprobs, TokenSpeller, chat_logprobs
from layerplan.decoding.prompt_logprobs import prompt_logprobs
from layerplan.decoding.sampling_params import SamplingError, SamplingParams
from layerplan.engine.probe_rows import ProbeRow
from layerplan.engine.runner import new_cache
from layerplan.models.architectures import ModelError
from layerplan.models.chat_template import PLAIN_CHAT_STOPS
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan, PlanError, parse_plan


# a request's plan runs at most this many steps per layer of the model: a frankenmerge repeats a
# block once or twice, while a plan of thousands of steps would take a KV slot each (gigabytes) and
# hold every other request up (the server's own --plan has no such bound)
REQUEST_STEPS_PER_LAYER = 4


# a request's choices (n of each prompt): decoded together, their passes shared (the scheduler's
# batch); bounded, as a request's KV caches and queue places are
MAX_N = 16
MAX_CHOICES = 64


# ----- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    """An error the client caused (or may retry), answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ----- request bodies ----------------------------------------------------------------------------
class LayerplanOptions(BaseModel):
    """The request's `layerplan` extension object: the plan and draft this request runs with (the
    server's own where left out; "draft": null decodes plainly), and whether the answer says where
    each token came from (provenance: `layerplan.tokens` of each stream chunk, or of the answer not
    streamed, and usage's counts).
    stream_interval: a stream's text that comes within this many seconds of the last chunk waits
    and goes out with the next one, in one chunk (a browser pays for every event it reads, on the
    cores that decode; 0: a chunk as each piece comes)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key would otherwise change nothing, silently

    plan: str | None = None  # a plan string (`layerplan generate --plan`'s grammar; no files)
    draft: str | None = None  # a drafter spec (`--draft`'s), made for this request; no files, no second model
    draft_length: str | None = None  # `--draft-length`'s policies
    provenance: bool = False
    stream_interval: float = Field(0.0, ge=0, le=1)


class _GenerationRequest(BaseModel):
    # clients send fields we have no use for (user, ...): ignore them, reject only the ones whose
    # meaning we would silently change
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the model served (llama-server and vLLM take a request without one)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # extension (as in vLLM); 0 keeps all tokens
    repetition_penalty: float = Field(1.0, gt=0)  # extension
    min_p: float = Field(0.0, ge=0, le=1)  # extension (as in vLLM and llama-server); 0 keeps all tokens
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # (decoding/limits.py)
    n: int = Field(1, ge=1, le=MAX_N)  # choices of each prompt, decoded together
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = 0.0  # OpenAI's -2..2, on the tokens generated so far
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, OpenAI's -100..100
    layerplan: LayerplanOptions | None = None  # extension: this request's plan, draft, provenance

    def kept_logprobs(self) -> int | None:
        """How many alternatives each token's logprob comes with; None: no logprobs."""
        return None

    def check_supported(self) -> None:
        """A 400 for what the request asks that the server would otherwise change silently (each
        route's request adds its own)."""

    def sampling(self, vocabulary: int | None = None) -> SamplingParams:
        """The sampling settings; a 400 naming the setting whose arithmetic would not stay finite, or
        a logit_bias key that is no token id (of a vocabulary of that many ids, where given)."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdecimal():  # (isdigit takes '²', which int() does not)
                raise APIError(400, f"logit_bias key {key!r} is not a token id (a whole number as a string)",
                               "logit_bias")
            bias.append((int(key), value))
        try:
            params = SamplingParams(self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.min_p,
                                    tuple(bias), self.presence_penalty, self.frequency_penalty)
            if vocabulary is not None:
                params.check_vocabulary(vocabulary)
            return params
        except SamplingError as error:
            raise APIError(400, str(error), str(error).split(" ", 1)[0]) from None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # (a batch of one: lm-evaluation-harness's)
    echo: bool = False  # the prompt before the completion, its tokens scored where logprobs are asked
    # candidates a prompt decodes, of which the n with the highest mean token logprob are answered
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    # each token's logprob and the N most likely tokens' at its place (OpenAI's legacy form)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, value):
        return None if value is False else value  # (a client's "logprobs": false asks for none)

    def kept_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a text or token ids, or a list of either (a batch)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]

    @property
    def candidates(self) -> int:
        """Completions decoded for each prompt: best_of where given, else n."""
        return self.best_of if self.best_of is not None else self.n

    def check_supported(self) -> None:
        super().check_supported()
        if self.candidates < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.stream and self.candidates > self.n:
            raise APIError(400, "best_of > n cannot be streamed: the best are known once all are done", "best_of")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by this server", "suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        """The message's text; a 400 for a message without content or with parts that are not text
        (an image dropped silently would change the question)."""
        where = f"messages.{index}.content"
        if self.content is None:
            raise APIError(400, f"message {index} ({self.role}) has no content", where)
        if isinstance(self.content, list):
            other = [str(part.get("type")) for part in self.content if part.get("type") != "text"]
            if other:
                raise APIError(400, f"message {index}: content parts of type {', '.join(sorted(set(other)))} are "
                                    "not supported by this server (text only)", where)
            if not self.content:
                raise APIError(400, f"message {index} ({self.role}) has no content", where)
            empty = next((k for k, part in enumerate(self.content) if not isinstance(part.get("text"), str)), None)
            if empty is not None:
                raise APIError(400, f"message {index}: content part {empty} is of type text but has no text "
                                    "(expected {\"type\": \"text\", \"text\": \"...\"})", f"{where}.{empty}")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # the newer name of max_tokens
    # accepted only in the forms that ask for nothing: a server that answered them with free text
    # would break agent frameworks quietly
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None  # the older names of tools and tool_choice
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)

    def kept_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} (function calling) is not supported by this server", name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise APIError(400, f"{name} (function calling) is not supported by this server", name)
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {json.dumps(self.response_format)[:80]} is not supported "
                                "by this server (plain text only)", "response_format")


class TokenizeRequest(BaseModel):
    """POST /tokenize in vLLM's words (prompt, add_special_tokens: default true) or llama-server's
    (content, add_special: default false)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None

    def text(self) -> str:
        text = self.prompt if self.prompt is not None else self.content
        if text is None:
            raise APIError(400, "give the text to tokenize as 'prompt' (or 'content')", "prompt")
        return text

    def special(self) -> bool:
        """Whether the tokenizer adds its special tokens (a BOS), by the name the request used."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.add_special if self.add_special is not None else self.prompt is not None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class RequireKey:
    """ASGI middleware: /v1/* and the page's /layerplan/* need 'Authorization: Bearer KEY'; /health
    stays open for probes, and so do the page's own files (/, /playground/*), which hold no data:
    the page asks for the key and sends it with each request (playground.py).
    (A plain ASGI wrapper: starlette's BaseHTTPMiddleware would hide client disconnects from streams.)"""

    GUARDED = ("/v1/", "/layerplan/", "/tokenize", "/detokenize", "/tokenizer_info")

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.GUARDED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                    kind="authentication_error", code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----- the app -----------------------------------------------------------------------------------
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
STARTED = object()  # a stream's event: the decode thread took the job


def _finite(value):
    """JSON has no NaN (e.g. the acceptance rate of a run that drafted nothing): use null."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _usage(result: GenerationResult, provenance: bool = False) -> dict:
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
             "total_tokens": result.prompt_tokens + len(result.token_ids),
             "decode_seconds": round(result.seconds, 4), "tokens_per_second": round(result.tokens_per_second, 2)}
    if result.stats:
        usage["speculative"] = result.stats
    if provenance:  # the completion's tokens by kind (output.TokenKind): they sum to completion_tokens
        usage["provenance"] = result.provenance
    return _finite(usage)


def _one_line(error: Exception) -> str:
    """An error's message on one line (a plan or spec the client sent may hold line breaks)."""
    return " ".join(str(error).splitlines())


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _budget(model: LoadedModel, prompt_ids: list[int], asked: int | None, default: int | None) -> int:
    """The tokens a request may generate; a 400 when its prompt leaves it none."""
    try:
        return token_budget(len(prompt_ids), asked, model.context_length, default)
    except ContextLengthError as error:
        param = error.param if error.param != "prompt" else ("messages" if default is None else "prompt")
        raise APIError(400, str(error), param, code="context_length_exceeded") from None

def _chosen(model: LoadedModel, scheduler: Scheduler, options: LayerplanOptions | None) -> dict:
    """The Job fields a request's `layerplan` object sets: its plan, its drafter made for that
    plan (the server's draft where it names none), its draft length; a 400 naming the field that
    cannot be used, with the command line's message."""
    if options is None:
        return {"draft": scheduler.drafter_for(scheduler.plan), "draft_chosen": True}
    chosen: dict = {}
    plan = scheduler.plan
    if options.plan is not None:
        try:
            plan = parse_plan(options.plan, model.num_layers, model.name)
            model.check_plan(plan)
        except PlanError as error:
            raise APIError(400, _one_line(error), "layerplan.plan") from None
        most = REQUEST_STEPS_PER_LAYER * model.num_layers
        if len(plan.active_steps) > most:
            raise APIError(400, f"the plan runs {len(plan.active_steps)} steps; a request's plan runs at most "
                                f"{most} here ({REQUEST_STEPS_PER_LAYER} per layer of the model)", "layerplan.plan")
        chosen["plan"] = plan
    named = "draft" in options.model_fields_set  # "draft": null decodes plainly
    try:
        draft = scheduler.drafter_for(plan, options.draft, named)
    except (ValueError, FileNotFoundError, ModelError) as error:  # PlanError included
        raise APIError(400, _one_line(error), "layerplan.draft" if named else "layerplan.plan") from None
    chosen.update(draft=draft, draft_chosen=True)
    if options.draft_length is not None:
        if draft is None:
            raise APIError(400, "draft_length is the length policy of a draft, and this request decodes "
                                "plainly: name a draft too", "layerplan.draft_length")
        try:
            make_draft_length(options.draft_length)
        except ValueError as error:
            raise APIError(400, _one_line(error), "layerplan.draft_length") from None
        chosen["draft_length"] = options.draft_length
    return chosen


def _add_error_handlers(app: FastAPI) -> None:
    """Every client mistake as an OpenAI-shaped error body with its status."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError):
        problems = error.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return APIError(400, f"malformed JSON body: {problems[0].get('ctx', {}).get('error', problems[0]['msg'])}").response()
        first = problems[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return APIError(400, f"{where}: {first['msg']}{more}", where).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), kind=kind).response()


async def _reply(scheduler: Scheduler, request: Request, body: _GenerationRequest, choice: Choice):
    """One choice, not streamed: its job queued, answered with one JSON object."""
    provenance = body.layerplan is not None and body.layerplan.provenance
    job = _job(body, choice, 0, body.kept_logprobs())
    (result,) = await _finished(request, [job], [asyncio.wrap_future(scheduler.submit(job))])
    answer = {**choice.shape(result.text, FINISH_REASONS[result.stop_reason], logprobs=result.logprobs),
              "usage": _usage(result, provenance)}
    if provenance:  # the whole text by token, as a stream's chunks carry it
        answer["layerplan"] = {"tokens": [asdict(piece) for piece in result.pieces]}
    return answer


def _job(body: _GenerationRequest, choice: Choice, k: int, logprobs: int | None, **events) -> Job:
    """Choice k's job: sampled with seed + k where a seed is given (seed - k past the range's top);
    its tokens' logprobs kept with `logprobs` alternatives each (None: none kept)."""
    seed = None
    if body.seed is not None:
        seed = body.seed + k if body.seed + k <= SEED_RANGE[1] else body.seed - k
    return Job(choice.prompt_ids, choice.max_tokens, body.sampling(), seed, body.stops(), logprobs=logprobs,
               **events, **choice.fields)


def _stream(scheduler: Scheduler, request: Request, body: _GenerationRequest,
            choices: list[Choice]) -> StreamingResponse:
    """Choices (one or several, in index order) as server-sent events: every job queued at once,
    each chunk carrying one choice's text under its index as it comes (a choice's text gathered
    for `stream_interval` where asked), each choice's last chunk its reason, then the usage of
    them all where asked, then [DONE]."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()  # (choice index, event): text, STARTED, or None (its job ended)
    provenance = body.layerplan is not None and body.layerplan.provenance
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    interval = body.layerplan.stream_interval if body.layerplan is not None else 0.0

    def put_for(k: int) -> Callable:
        def put(event) -> None:  # from the decode thread
            loop.call_soon_threadsafe(events.put_nowait, (k, event))

        return put

    jobs = [_job(body, choice, k, body.kept_logprobs(), on_text=put_for(k),
                 on_start=lambda put=put_for(k): put(STARTED))
            for k, choice in enumerate(choices)]
    futures = [asyncio.wrap_future(scheduler.submit(job)) for job in jobs]
    for k, future in enumerate(futures):
        future.add_done_callback(lambda _, k=k: events.put_nowait((k, None)))

    async def next_event(timeout: float):
        """The next (index, event), or None when none came within `timeout` seconds."""
        try:
            return await asyncio.wait_for(events.get(), timeout=max(timeout, 0.0))
        except TimeoutError:
            return None

    async def event_stream():
        try:
            checked = time.monotonic()
            sent = [float("-inf")] * len(choices)  # when each choice's text last went (its first goes at once)
            held: list[TextDelta | None] = [None] * len(choices)  # text gathered for the interval
            scored = [0] * len(choices)  # the tokens whose logprobs each choice's chunks carried
            results: list[GenerationResult | None] = [None] * len(choices)
            open_choices = set(range(len(choices)))

            def text_chunk(k: int) -> str:
                piece, held[k], sent[k] = held[k], None, time.monotonic()
                chunk = choices[k].shape(piece, None, logprobs=piece.logprobs if jobs[k].logprobs is not None
                                         else None)
                scored[k] += len(piece.logprobs)
                if provenance:  # an extension field, which OpenAI clients ignore
                    chunk["layerplan"] = {"tokens": [asdict(part) for part in piece.pieces]}
                return _sse(chunk)

            while open_choices:
                due = min((sent[k] + interval for k in open_choices if held[k]), default=time.monotonic() + 0.2)
                event = await next_event(min(due - time.monotonic(), 0.2))
                for k in open_choices:  # text whose interval is over
                    if held[k] and time.monotonic() >= sent[k] + interval:
                        yield text_chunk(k)
                if time.monotonic() - checked > 0.2:  # notice a vanished client even while nothing is sent
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                k, piece = event
                if piece is STARTED:  # not while queued: clients time their first token from it
                    if (opening := choices[k].shape("", None, first=True)) is not None:
                        yield _sse(opening)
                elif piece is not None:
                    if piece:
                        held[k] = piece if not held[k] else TextDelta(held[k] + piece, held[k].pieces + piece.pieces,
                                                                      held[k].logprobs + piece.logprobs)
                        if time.monotonic() >= sent[k] + interval:
                            yield text_chunk(k)
                else:  # its job ended: what it held, then its reason
                    if held[k]:
                        yield text_chunk(k)
                    try:
                        results[k] = result = await futures[k]
                    except Exception as error:  # noqa: BLE001
                        yield _sse({"error": {"message": f"generation failed: {error}", "type": "server_error"}})
                        yield _sse("[DONE]")
                        return
                    open_choices.discard(k)
                    if result is None:  # (cancelled before it began: the client left)
                        return
                    # (the tokens no text carried, an EOS among them, go with the reason)
                    kept = result.logprobs if jobs[k].logprobs is not None and result.logprobs is not None else None
                    rest = kept[scored[k]:] if kept is not None else None
                    yield _sse(choices[k].shape("", FINISH_REASONS[result.stop_reason], logprobs=rest or None))
            if include_usage:
                usage = (_usage(results[0], provenance) if len(results) == 1
                         else _summed_usage(choices, results))
                yield _sse({**choices[0].shape("", None), "choices": [], "usage": usage})
            yield _sse("[DONE]")
        finally:
            for job in jobs:  # a disconnect lands here: stop decoding at the next token
                job.cancelled.set()

    return StreamingResponse(event_stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(model: LoadedModel, plan: LayerPlan | None = None, draft=None, draft_length: str | None = None,
               api_key: str | None = None, served_name: str | None = None, decode_thread: bool = True,
               probe_row: ProbeRow | None = None, max_batch: int = DEFAULT_MAX_BATCH) -> FastAPI:
    """The FastAPI app serving `model` (run by `plan`, speculatively when `draft` is given).
    decode_thread=False: the caller runs `app.state.scheduler.run()` on the thread that should
    decode (decoding/scheduler.py; `serve` does this). probe_row: this machine's probe row for the
    model (engine/probe.py checked_model_row); /health says when decodes ran far slower than it."""
    scheduler = Scheduler(model, plan, draft, draft_length, probe_row=probe_row, max_batch=max_batch)
    if decode_thread:
        scheduler.start_thread()
    name = served_name or model.name
    created = int(time.time())
    # one thread: a fast tokenizer used from two threads at once may fail ("Already borrowed")
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="layerplan-tokenize")
    spellers: list[TokenSpeller] = []

    def speller() -> TokenSpeller:
        """The vocabulary's spelling of tokens, made for the first request that asks for logprobs."""
        if not spellers:
            spellers.append(TokenSpeller(model.tokenizer))
        return spellers[0]

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        scheduler.close()
        tokenizing.shutdown(wait=False, cancel_futures=True)

    async def off_loop(function: Callable, *args):
        """function(*args) on the tokenizing thread: the event loop goes on answering meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(tokenizing, function, *args)

    app = FastAPI(title="layerplan", description=f"OpenAI-compatible server for {name}", lifespan=lifespan)
    app.state.scheduler = scheduler

    _add_error_handlers(app)
    if api_key:
        app.add_middleware(RequireKey, key=api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "plan": scheduler.plan.to_string(),
                "draft": getattr(scheduler.drafter, "name", None), **vars(scheduler.counters),
                "batch": scheduler.batch, "max_batch": scheduler.max_batch,
                "batch_recent": scheduler.batch_recent(), "slow_decode": scheduler.slow_note}

    add_playground(app, model, scheduler, name)  # the web page at /, and the JSON it reads under /layerplan/

    def _checked_ids(ids: list[int], param: str) -> list[int]:
        vocab = model.hf.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range: the vocabulary has ids 0–{vocab - 1}", param)
        return ids

    # vLLM's and llama-server's tokenizer routes (lm-evaluation-harness's `local-completions` finds a
    # server's tokenizer by them: it then scores and generates with no tokenizer of its own)
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(body.model)
        text, special = body.text(), body.special()
        ids = (await off_loop(lambda: model.tokenizer(text, add_special_tokens=special))).input_ids
        return {"tokens": ids, "count": len(ids), "max_model_len": model.context_length}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model)
        text = await off_loop(model.tokenizer.decode, _checked_ids(body.tokens, "tokens"))
        return {"prompt": text, "content": text}  # (vLLM's name, llama-server's)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tokenizer = model.tokenizer
        return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": model.context_length,
                **{name: getattr(tokenizer, name, None)
                   for name in ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template")}}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "layerplan"}]}

    def _check_model(requested: str | None) -> None:
        if requested is not None and requested != name:
            raise APIError(404, f"model '{requested}' is not served here; this server serves '{name}'",
                           "model", code="model_not_found")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        body.check_supported()
        body.sampling(model.hf.config.vocab_size)  # a 400 now, not a failed generation later
        # off the loop: a drafter may read (the corpus of suffix:corpus=F)
        chosen = await off_loop(_chosen, model, scheduler, body.layerplan)
        prompts = body.prompts()
        _check_choices(body, len(prompts), body.candidates)
        ident, stamp = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        choices: list[Choice] = []  # in index order
        for prompt in prompts:
            if isinstance(prompt, str):
                prompt_ids = (await off_loop(model.tokenizer, prompt)).input_ids
            else:
                prompt_ids = _checked_ids(list(prompt), "prompt")
            if not prompt_ids:
                raise APIError(400, "the prompt is empty", "prompt")
            max_tokens = _budget(model, prompt_ids, body.max_tokens, default=16)  # OpenAI's default for completions
            echo = cache = None
            if body.echo:
                scores = None
                if body.logprobs is not None:  # on the decode thread, between passes (it runs the model)
                    plan = chosen.get("plan") or scheduler.plan
                    # (its cache goes to the prompt's first choice: its decode prefills the last token only)
                    cache = new_cache(plan, capacity=len(prompt_ids) + max_tokens + 16)
                    scores = await asyncio.wrap_future(scheduler.call(
                        lambda ids=prompt_ids, kept=cache: prompt_logprobs(model, ids, plan, body.logprobs,
                                                                           cache=kept)))
                text = prompt if isinstance(prompt, str) else await off_loop(model.tokenizer.decode, prompt_ids)
                echo = (text, prompt_ids[0], scores)

            def shape_for(index: int, echo=echo) -> Callable[..., dict | None]:
                return _completion_shape(ident, stamp, name, index, echo,
                                         CompletionLogprobs(speller()) if body.logprobs is not None else None)

            for k in range(body.candidates):
                fields = {**chosen, "cache": cache} if cache is not None and k == 0 else chosen
                choices.append(Choice(prompt_ids, max_tokens, shape_for(len(choices)), fields, shape_for))
        if body.candidates > body.n:
            return await _best_of(scheduler, request, body, choices)
        return await _answer(scheduler, request, body, choices)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        _check_model(body.model)
        body.check_supported()
        body.sampling(model.hf.config.vocab_size)  # a 400 now, not a failed generation later
        # off the loop: a drafter may read (the corpus of suffix:corpus=F)
        chosen = await off_loop(_chosen, model, scheduler, body.layerplan)
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
        prompt_ids = await off_loop(_chat_ids, model, messages)
        if not getattr(model.tokenizer, "chat_template", None):  # 'role: content' lines: end at the user's turn
            body = body.model_copy(update={"stop": [*body.stops(), *PLAIN_CHAT_STOPS]})
        asked = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        max_tokens = _budget(model, prompt_ids, asked, default=None)
        ident, stamp = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        _check_choices(body, 1)
        spelled = speller() if body.logprobs else None
        ending = frozenset(model.eos_token_ids)

        def shape_of(index: int) -> Callable[..., dict]:
            def shape(text: str, finish: str | None, first: bool = False, logprobs=None) -> dict:
                kept = (chat_logprobs(logprobs, spelled, ending) if logprobs is not None and spelled is not None
                        else None)
                if body.stream:  # the first chunk names the role, later ones carry text, the last one the reason
                    delta: dict = ({"role": "assistant", "content": ""} if first
                                   else ({"content": text} if text else {}))
                    choice = {"index": index, "delta": delta, "logprobs": kept, "finish_reason": finish}
                    kind = "chat.completion.chunk"
                else:
                    choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": kept,
                              "finish_reason": finish}
                    kind = "chat.completion"
                return {"id": ident, "object": kind, "created": stamp, "model": name, "choices": [choice]}

            return shape

        return await _answer(scheduler, request, body,
                             [Choice(prompt_ids, max_tokens, shape_of(k), chosen) for k in range(body.n)])

    return app


def _completion_shape(ident: str, stamp: int, name: str, index: int, echo: tuple | None,
                      logprobs_form: CompletionLogprobs | None) -> Callable[..., dict | None]:
    """A completion choice's chunks (or its whole answer): its text, the prompt before the first
    one where echoed (echo: the prompt's text, its first token, its other tokens' logprobs), and
    its tokens' logprobs in the legacy form where asked."""
    echoed = [echo] if echo is not None else []  # until sent

    def shape(text: str, finish: str | None, first: bool = False, logprobs=None) -> dict | None:
        if first:
            return None  # completions streams start with text
        said = None
        if echoed and (text or finish is not None):  # the first chunk with text, or the last
            prompt_text, first_token, scores = echoed.pop()
            if logprobs_form is not None:
                said = logprobs_form(scores, first_token=first_token)
            text = prompt_text + text
        kept = logprobs_form(logprobs) if logprobs is not None and logprobs_form is not None else None
        kept = _joined(said, kept) if said is not None else kept
        return {"id": ident, "object": "text_completion", "created": stamp, "model": name,
                "choices": [{"index": index, "text": text, "logprobs": kept, "finish_reason": finish}]}

    return shape


@dataclass(frozen=True)
class Choice:
    """One choice of a request: its prompt, budget, the shape of its answer (or chunks), and the
    Job fields it runs with (its plan and draft; a cache its prompt was scored into)."""

    prompt_ids: list[int]
    max_tokens: int
    shape: Callable[..., dict | None]
    fields: dict
    shape_for: Callable[[int], Callable[..., dict | None]] | None = None  # its shape under another index


def _check_choices(body: _GenerationRequest, prompts: int, candidates: int | None = None) -> None:
    """A 400 for more completions than the server decodes for one request (MAX_CHOICES):
    `candidates` a prompt (best_of's, else n)."""
    each = candidates if candidates is not None else body.n
    choices = prompts * each
    if choices > MAX_CHOICES:
        name = "n" if each == body.n else "best_of"
        raise APIError(400, f"{prompts} prompt(s) x {name}={each} is {choices} completions; at most {MAX_CHOICES} "
                            "a request", name if prompts == 1 else "prompt")


async def _answer(scheduler: Scheduler, request: Request, body: _GenerationRequest, choices: list[Choice]):
    """A request's choices answered: streamed, one JSON object, or several choices' in one."""
    if body.stream:
        return _stream(scheduler, request, body, choices)
    if len(choices) == 1:
        return await _reply(scheduler, request, body, choices[0])
    return await _replies(scheduler, request, body, choices)


async def _finished(request: Request, jobs: list[Job], futures: list[asyncio.Future]) -> list[GenerationResult]:
    """The jobs' results (not streamed), polling for a vanished client while they wait or decode
    (it cancels them all): a 500 where one failed, a 499 where the client left."""
    pending = set(futures)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.2)
        if pending and await request.is_disconnected():
            for job in jobs:
                job.cancelled.set()
    try:
        results = [future.result() for future in futures]
    except Exception as error:  # noqa: BLE001 - the server stays up; the client learns why
        raise APIError(500, f"generation failed: {error}", kind="server_error") from error
    if any(result is None for result in results):
        raise APIError(499, "client closed the request")
    return results


async def _replies(scheduler: Scheduler, request: Request, body: _GenerationRequest, choices: list[Choice]) -> dict:
    """Several choices (in index order), not streamed: every job queued at once (decoded together,
    their passes shared), choice k sampled with seed + k where a seed is given; each answered by its
    own shape."""
    jobs = [_job(body, choice, k, body.kept_logprobs()) for k, choice in enumerate(choices)]
    results = await _finished(request, jobs, [asyncio.wrap_future(scheduler.submit(job)) for job in jobs])
    answer, provenance = None, body.layerplan is not None and body.layerplan.provenance
    for result, choice in zip(results, choices):
        shaped = choice.shape(result.text, FINISH_REASONS[result.stop_reason], logprobs=result.logprobs)
        if provenance:
            shaped["choices"][0]["layerplan"] = {"tokens": [asdict(piece) for piece in result.pieces]}
        answer = shaped if answer is None else {**answer, "choices": answer["choices"] + shaped["choices"]}
    return {**answer, "usage": _summed_usage(choices, results)}


async def _best_of(scheduler: Scheduler, request: Request, body: CompletionRequest, candidates: list[Choice]) -> dict:
    """best_of candidates a prompt (in prompt order), decoded together as n choices are; each
    prompt's n with the highest mean log-probability a token (the model's own distribution, OpenAI's
    rule; ties in candidate order) answered, best first; usage counts every candidate's tokens."""
    each, n = body.candidates, body.n
    kept = body.kept_logprobs()
    jobs = [_job(body, candidate, k % each, kept if kept is not None else 0)
            for k, candidate in enumerate(candidates)]
    results = await _finished(request, jobs, [asyncio.wrap_future(scheduler.submit(job)) for job in jobs])

    def mean_logprob(index: int) -> float:
        scores = [entry.logprob for entry in results[index].logprobs or ()]
        return sum(scores) / len(scores) if scores else -math.inf

    answered = []
    for start in range(0, len(candidates), each):
        ranked = sorted(range(start, start + each), key=mean_logprob, reverse=True)[:n]
        for rank, index in enumerate(ranked):
            result, shape = results[index], candidates[index].shape_for(start // each * n + rank)
            shaped = shape(result.text, FINISH_REASONS[result.stop_reason],
                           logprobs=result.logprobs if kept is not None else None)
            answered.extend(shaped["choices"])
            answer = shaped
    return {**answer, "choices": answered, "usage": _summed_usage(candidates, results)}


def _summed_usage(choices: list[Choice], results: list[GenerationResult]) -> dict:
    """Several choices' usage: each prompt counted once, the completions summed, the slowest's time."""
    prompts = {id(choice.prompt_ids): len(choice.prompt_ids) for choice in choices}
    completion = sum(len(result.token_ids) for result in results)
    seconds = max(result.seconds for result in results)
    return {"prompt_tokens": sum(prompts.values()), "completion_tokens": completion,
            "total_tokens": sum(prompts.values()) + completion, "decode_seconds": round(seconds, 4),
            "tokens_per_second": round(completion / seconds, 2) if seconds > 0 else None}


def _joined(first: dict, then: dict | None) -> dict:
    """Two stretches of a completion's logprobs (CompletionLogprobs), one after the other."""
    return first if then is None else {key: first[key] + then[key] for key in first}


def _chat_ids(model: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    """chat_prompt_ids, with a conversation the model's template refuses as a 400."""
    try:
        return chat_prompt_ids(model, messages)
    except ChatTemplateError as error:
        raise APIError(400, str(error), "messages") from None


class ListenError(OSError):
    """The server's address cannot be bound (in use, not this machine's, not permitted)."""

    def __str__(self) -> str:
        return self.strerror


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port for the server; ListenError with one line where it cannot."""
    try:
        listening = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as error:
        if error.errno is not None and error.errno < 0:  # getaddrinfo's codes, which os.strerror does not know
            reason = (error.strerror or str(error)).split(" (while attempting")[0]
            raise ListenError(error.errno, f"cannot listen on {host}:{port}: {reason} (give an address or host "
                                           "name of this machine, e.g. 127.0.0.1 or 0.0.0.0)") from None
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise ListenError(error.errno, f"cannot listen on {host}:{port}: {reason}") from None
    except (OverflowError, UnicodeError, ValueError) as error:  # a host name that is not one
        raise ListenError(None, f"cannot listen on {host!r}:{port}: not an address ({error})") from None
    # Replies go out at once, not held back by Nagle's algorithm until the client acknowledges the
    # last segment (which it delays up to 40 ms: a 1-token request took 64 ms, now 8): asyncio sets
    # TCP_NODELAY only on connections whose socket says protocol TCP, and create_server's says 0.
    # Linux's accepted sockets inherit it from the listening one.
    listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listening


def serve(model: LoadedModel, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
          on_listening: Callable[[str, int, int], None] | None = None, **options) -> None:
    """Serve until interrupted: HTTP on a background thread, decoding on this one (decoding/
    scheduler.py).
    on_listening(host, port, max_batch): once the address is bound (port 0 becomes the one chosen),
    with the requests the scheduler decodes at once (1 where the draft runs a model);
    options: see create_app."""
    import uvicorn

    app = create_app(model, decode_thread=False, **options)  # a bad draft fails here, before "listening"
    # bound here, not in uvicorn's thread, whose failure would leave this one serving nothing
    listening = listen_socket(host, port)
    if on_listening:
        on_listening(host, listening.getsockname()[1], app.state.scheduler.max_batch)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    http = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, name="layerplan-http", daemon=True)
    http.start()
    try:
        app.state.scheduler.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
