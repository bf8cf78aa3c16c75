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

from layerplan.decoding.chat_state import NO_DRAFT, ChatHistory, ChatSettings, Reply, first_changed_step
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.output import chat_prompt_ids
from layerplan.decoding.scheduler import Job, Scheduler
from layerplan.decoding.text import GenerationResult
from layerplan.engine.cache import KVCache
from layerplan.engine.probe import ProbeRow
from layerplan.engine.runner import Resume, new_cache, run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

# the cache keeps the residual stream entering every STREAM_EVERY-th step, so that /plan reruns
# the conversation from the last such step at or before the first one it changes, not from the
# start (each kept stream costs a hidden-wide row a token: at 4, SmolLM2's are 0.7x its cache)
STREAM_EVERY = 4


class ChatSession(ChatHistory):
    """A conversation with `model`: reply() answers a user message; the set_* methods change the
    plan, draft and settings between replies; save() and read_saved() keep and resume it."""

    def __init__(self, model: LoadedModel, settings: ChatSettings | None = None,
                 messages: Sequence[dict[str, str]] = (), probe_row: ProbeRow | None = None,
                 draft_length: str | None = None, stream_every: int = STREAM_EVERY) -> None:
        if model.tokenizer is None:
            model.encode("")  # ModelError in the model's own words: text cannot be turned into tokens
        self.probe_row, self.draft_length = probe_row, draft_length
        self.stream_every = stream_every  # the cache keeps the stream entering every such step (STREAM_EVERY)
        super().__init__(model, settings, messages)
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
        room = self.room(ids)
        kept = self.keep(ids)
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
        return self.replied(messages, ids, result, cache, kept, result.stats if self.drafter is not None else {})
