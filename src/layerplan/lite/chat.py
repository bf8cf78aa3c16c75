"""`layerplan chat` on the light front end: LightChatSession, a conversation with a GGUF run as
stored by the kernels alone (lite/model.py), by a plan of the model. app/chat_loop.py runs
it as it runs the torch front end's session (app/chat.py), and the replies are that session's:
the conversation rendered whole through the chat template as transformers renders it
(models/chat_template.py), tokenized without added special tokens, the cache kept up to the
longest prefix it shares with the new turn's tokens, each token chosen from the same logits by
the same settings and seed (decoding/choice.py; tests/test_lite_chat.py runs both); a drafted
reply by decoding/rounds.py's speculative rounds (a lookup, a sub-plan of the model, auto).

What it does not run it raises TorchFrontEnd for, before changing anything: a draft that runs
torch modules (or a token tree). The loop then hands the conversation and that line on to the
torch front end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from layerplan.decoding.chat_state import ChatHistory, ChatSettings, Reply, draft_named
from layerplan.decoding.drafters.kinds import drafts_on_the_light_front_end
from layerplan.decoding.loop import DecodeLoop
from layerplan.decoding.rounds import SpeculativeLoop
from layerplan.engine.probe_rows import PaceCheck
from layerplan.lite import TorchFrontEnd
from layerplan.lite.model import LiteCache, LiteModel
from layerplan.models.chat_template import plain_chat_text
from layerplan.plan.plan import LayerPlan

DRAFTS_NEED_TORCH = ("a draft that runs a re-quantized copy of the model, a draft head, online skips or a dynamic "
                     "exit, or a token tree, runs on the torch front end")


def light_refusal(settings: ChatSettings) -> str | None:
    """Why these settings need the torch front end (one line), or None: a draft other than a
    light front end's (kinds.py; sampling, the logit bias and the penalties run here:
    decoding/choice.py)."""
    if settings.draft is not None and not drafts_on_the_light_front_end(settings.draft):
        return DRAFTS_NEED_TORCH
    return None


class LightChatSession(ChatHistory):
    """A conversation with a LiteModel (see the module's docstring); TorchFrontEnd at the start
    where its settings, template or plan need the torch front end."""

    def __init__(self, model: LiteModel, settings: ChatSettings | None = None,
                 messages: Sequence[dict[str, str]] = ()) -> None:
        if model.tokenizer is None:
            model.encode("")  # ModelError in the model's own words: text cannot be turned into tokens
        refusal = light_refusal(settings) if settings is not None else None
        if refusal is not None:
            raise TorchFrontEnd(refusal)
        self.template = model.chat_template()
        self.probe_row = model.probe_row()  # (the pace's and a draft's costs, as app/chat.py's session)
        self.pass_costs = dict(self.probe_row.relative) if self.probe_row is not None else {}
        super().__init__(model, settings, messages)
        self.cache: LiteCache | None
        self.drafter = self._drafter(self.settings.draft, self.plan)

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    # ----- settings ---------------------------------------------------------------------------
    def kept_streams(self) -> dict[int, int]:
        return {step: self.cache.length for step in self.cache.streams} if self.cache is not None else {}

    def run_again_from(self, restart: int, held: int) -> None:
        old = self.cache
        cache = self.model.new_cache(self.plan, old.capacity, self.stream_steps(self.plan))
        cache.take(old, restart, held)
        self.model.run_from(cache, restart, held)
        self.cache = cache

    def _drafter(self, spec: str | None, plan: LayerPlan):
        """The draft's drafter for `plan`, kept across replies (what it learned); None: plain
        decoding (imported here: a plain conversation does not wait for the drafters)."""
        if spec is None:
            return None
        from layerplan.decoding.drafters.registry import make_drafter

        return make_drafter(spec, self.model, plan, pass_costs=self.pass_costs, load_draft=self.model.load_draft)

    def plan_taken(self, plan: LayerPlan) -> None:
        self.drafter = self._drafter(self.settings.draft, plan)  # a draft that cannot draft for it: refused here

    def set_draft(self, spec: str | None) -> None:
        spec = draft_named(spec)
        if spec is not None and not drafts_on_the_light_front_end(spec):
            raise TorchFrontEnd(DRAFTS_NEED_TORCH)
        self.drafter = self._drafter(spec, self.plan)
        self.settings.draft = spec

    # ----- replies ------------------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        """The conversation's token ids, ready for the assistant's turn (decoding/output.py
        chat_prompt_ids's on the torch front end)."""
        conversation = self.conversation(messages)
        if self.template is None:
            return self.model.tokenizer.encode(plain_chat_text(conversation))
        return self.model.tokenizer.encode(self.template.render(conversation), special_tokens=False)

    def reply(self, text: str, on_text: Callable[[str], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> Reply:
        """Answer a user message. on_text gets the reply's text as it comes; should_stop() True
        stops it (the partial reply stays in the conversation)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        budget = self.budget(ids)
        kept = self.keep(ids)
        cache, self.cache, self.cached = self.cache, None, []  # a reply that fails leaves no half-written cache
        need = len(ids) + budget + 1
        if cache is None:
            cache = self.model.new_cache(self.plan, need, self.stream_steps(self.plan))
        elif cache.capacity < need:
            cache = cache.grown(need)
        settings = self.settings
        if self.drafter is None:
            loop = DecodeLoop(self.model, ids, self.plan, budget, self.reply_stops, True, on_text, should_stop,
                              PaceCheck(self.probe_row), cache=cache, sampling=settings.sampling(), seed=settings.seed)
        else:
            loop = SpeculativeLoop(self.model, ids, self.plan, self.drafter, budget, self.reply_stops, True, on_text,
                                   should_stop, PaceCheck(self.probe_row), cache=cache, sampling=settings.sampling(),
                                   seed=settings.seed, draft_length=settings.draft_length, pass_costs=self.pass_costs)
        result = loop.run()
        return self.replied(messages, ids, result, cache, kept, result.stats if self.drafter is not None else {})

