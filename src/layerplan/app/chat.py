"""`layerplan chat` on the torch front end: ChatSession, a conversation with a model run by a plan,
in the model's chat template, a reply at a time, streamed (app/chat_loop.py runs it at a terminal
or behind a pipe; decoding/chat_state.py holds what every session keeps).

A turn renders the whole conversation through the chat template (the one rendering a fresh run of
the same history gets, so a reply equals that run's) and keeps the cache up to the longest prefix
it shares with the tokens the cache holds: everything up to the new user message, unless the
template or the tokenizer writes the last reply differently from the tokens that were generated
(from there on it is prefilled again). Its cache keeps the residual stream entering every few
steps, so that /plan runs the conversation again from the last kept step before the first it
changes; drafts (/draft) and sampling run as in generate (the scheduler's Job).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from layerplan.decoding.chat_state import STREAM_EVERY, ChatHistory, ChatSettings, Reply, draft_named
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.output import chat_prompt_ids
from layerplan.decoding.scheduler import Job, Scheduler
from layerplan.decoding.text import GenerationResult
from layerplan.engine.cache import KVCache
from layerplan.engine.probe_rows import ProbeRow
from layerplan.engine.runner import Resume, new_cache, run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

class ChatSession(ChatHistory):
    """A conversation with `model`: reply() answers a user message; the set_* methods change the
    plan, draft and settings between replies; save() and read_saved() keep and resume it."""

    def __init__(self, model: LoadedModel, settings: ChatSettings | None = None,
                 messages: Sequence[dict[str, str]] = (), probe_row: ProbeRow | None = None,
                 stream_every: int = STREAM_EVERY) -> None:
        if model.tokenizer is None:
            model.encode("")  # ModelError in the model's own words: text cannot be turned into tokens
        self.probe_row = probe_row
        super().__init__(model, settings, messages, stream_every)
        self.cache: KVCache | None
        self.drafter = self._drafter(self.settings.draft, self.plan)

    @property
    def probe_step_ms(self) -> float | None:
        return self.probe_row.step_ms if self.probe_row is not None else None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.model.tokenizer, "chat_template", None))  # (decoding/output.py chat_prompt_ids)

    # ----- settings ---------------------------------------------------------------------------
    def _drafter(self, spec: str | None, plan: LayerPlan):
        costs = dict(self.probe_row.relative) if self.probe_row is not None else {}
        return make_drafter(spec, self.model, plan, pass_costs=costs) if spec else None

    def plan_taken(self, plan: LayerPlan) -> None:
        self.drafter = self._drafter(self.settings.draft, plan)  # a draft that cannot draft for it: refused here

    def kept_streams(self) -> dict[int, int]:
        return dict(self.cache.stream_lengths) if self.cache is not None else {}

    def run_again_from(self, restart: int, held: int) -> None:
        cache, plan = self.cache, self.plan
        cache.crop(held)
        hidden = cache.streams[restart][:held][None].clone()
        cache.resize(len(plan.steps))
        cache.drop_slots(restart)
        cache.keep_streams(plan, self.stream_steps(plan))
        run_hidden(self.model, None, plan, cache, 0, resume=Resume(hidden, restart))

    def set_draft(self, spec: str | None) -> None:
        spec = draft_named(spec)
        self.drafter = self._drafter(spec, self.plan)
        self.settings.draft = spec

    # ----- replies ------------------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        """The conversation's token ids, ready for the assistant's turn (what a fresh run reads)."""
        return chat_prompt_ids(self.model, self.conversation(messages))

    def reply(self, text: str, on_text: Callable[[str], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> Reply:
        """Answer a user message. on_text gets the reply's text as it comes; should_stop() True
        stops it (the partial reply stays in the conversation)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        budget = self.budget(ids)
        kept = self.keep(ids)
        cache, self.cache, self.cached = self.cache, None, []  # a reply that fails leaves no half-written cache
        settings, sampling = self.settings, self.settings.sampling()
        if cache is None:
            cache = new_cache(self.plan, capacity=len(ids) + budget + 16)
            cache.keep_streams(self.plan, self.stream_steps(self.plan))
        scheduler = Scheduler(self.model, self.plan, probe_row=self.probe_row, max_batch=1)
        reply = scheduler.submit(Job(ids, budget, sampling, settings.seed, self.reply_stops, on_text=on_text, plan=self.plan,
                                     draft=self.drafter, draft_chosen=True, draft_length=self.settings.draft_length,
                                     cache=cache, should_stop=should_stop))
        scheduler.run(until_idle=True)
        result = reply.result()
        if result is None:  # stopped before it began: nothing said, the cache as it was
            result = GenerationResult("", [], len(ids), "cancelled", 0.0, 0.0, self.plan.to_string())
        return self.replied(messages, ids, result, cache, kept, result.stats if self.drafter is not None else {})
