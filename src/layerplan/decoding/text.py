"""A generation's text as its tokens make it, and when it stops: streamed deltas, stop strings,
EOS, the token budget, cancellation, and each token's provenance; and what it produces
(GenerationResult). Without torch: the light front
end (layerplan/lite/) decodes with these as the torch one does (decoding/output.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from layerplan.decoding.logprobs import TokenLogprob, token_logprob


# where an emitted token came from: a plain decoding step; a drafted token the target accepted; the
# target's own token where it rejected a draft (the recovered token); the extra token after a
# fully accepted draft (the bonus)
TokenKind = Literal["plain", "accepted", "correction", "bonus"]
TOKEN_KINDS: tuple[TokenKind, ...] = ("plain", "accepted", "correction", "bonus")


@dataclass(frozen=True)
class TokenText:
    """Text that one token produced (or the part of it in one streamed delta), and its provenance."""

    text: str
    kind: TokenKind


class TextDelta(str):
    """A streamed piece of text that also says which tokens it came from: `pieces`, one per token
    in order, whose texts concatenate to the delta; and, where the decode keeps them
    (Emitter.keep_logprobs), `logprobs`: those of the tokens whose text this delta completes (a
    token whose text is empty, or held back, goes with the delta that carries the text after it).
    A callback that wants only text uses it as the str it is, so every on_text keeps its
    one-argument form."""

    pieces: tuple[TokenText, ...]
    logprobs: tuple[TokenLogprob, ...]

    def __new__(cls, text: str, pieces: Sequence[TokenText] = (),
                logprobs: Sequence[TokenLogprob] = ()) -> TextDelta:
        delta = super().__new__(cls, text)
        delta.pieces = tuple(pieces)
        delta.logprobs = tuple(logprobs)
        return delta


class TextStream:
    """Tracks the decoded text of new tokens, stop strings, and streams text deltas (TextDelta:
    each delta's parts by token, with the token's kind)."""

    # the text of the tokens is their decode as a whole, computed from a window: the text of the
    # first `anchor` tokens (decoded whole) and what the tokens after it add to the decode of the
    # OVERLAP tokens before it. Decoders are concatenative but at the start of a text (a leading
    # space stripped, cleanup patterns a few characters long), so that sum is the whole decode
    # wherever the window's decode begins with its overlap's; where it does not (bytes of a
    # character split at the anchor, a cleanup across it), or every ANCHOR_EVERY tokens, the
    # tokens are decoded whole and anchored there. A token costs a window's decode, not all of
    # them: a 1000-token reply's decode was 160 us a token on SmolLM2's tokenizer.
    ANCHOR_EVERY = 64
    OVERLAP = 4

    def __init__(self, tokenizer, stop: Sequence[str], on_text: Callable[[str], None] | None) -> None:
        self.tokenizer, self.stop, self.on_text = tokenizer, tuple(s for s in stop if s), on_text
        self.emitted = 0
        self.text = ""
        self.owner: list[int] = []  # per character of text: the index of the token that produced it
        self.kinds: Sequence[str] = ()
        # the emitter's logprobs by token (None: not kept), and how many of them deltas carried
        self.logprobs: list[TokenLogprob] | None = None
        self.released = 0
        self._anchor_ids: list[int] = []  # tokens decoded whole: their text, and their last OVERLAP's
        self._anchor_text = self._anchor_overlap = ""

    def _decode(self, token_ids: list[int]) -> str:
        """tokenizer.decode(token_ids) (special tokens skipped), through the anchored window."""
        decode = self.tokenizer.decode
        anchor = len(self._anchor_ids)
        if anchor and anchor <= len(token_ids) < anchor + self.ANCHOR_EVERY \
                and token_ids[:anchor] == self._anchor_ids:
            window = decode(token_ids[max(anchor - self.OVERLAP, 0):], skip_special_tokens=True)
            if window.startswith(self._anchor_overlap) and not self._anchor_overlap.endswith("\ufffd"):
                return self._anchor_text + window[len(self._anchor_overlap):]
        text = decode(token_ids, skip_special_tokens=True)
        self._anchor_ids, self._anchor_text = list(token_ids), text
        self._anchor_overlap = decode(token_ids[max(len(token_ids) - self.OVERLAP, 0):], skip_special_tokens=True)
        return text

    def update(self, token_ids: list[int], kinds: Sequence[str] = ()) -> bool:
        """Decode the tokens so far (kinds: each one's TokenKind; none given: plain); return True
        when a stop string appeared (text is cut there)."""
        if self.tokenizer is None:
            return False
        text = self._decode(token_ids)
        # the characters the text had before keep their tokens; the new ones are the newest token's
        # (decoding the whole sequence may rewrite the tail, e.g. bytes that now complete a character)
        kept = len(self.text) if text.startswith(self.text) else common_prefix(self.text, text)
        del self.owner[kept:]
        self.owner.extend([len(token_ids) - 1] * (len(text) - kept))
        self.kinds = kinds
        # a stop string in the text kept from before was found then: look from where it could begin
        hit = min((at for s in self.stop if (at := text.find(s, max(kept - len(s) + 1, 0))) >= 0), default=-1)
        stopped = hit >= 0
        if stopped:
            text = text[:hit]
            del self.owner[hit:]
        self.text = text
        # hold back a possible prefix of a stop string and an incomplete UTF-8 character
        safe = len(text) if stopped else len(text) - max((len(s) - 1 for s in self.stop), default=0)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe > self.emitted:
            self._send(safe)
        return stopped

    def finish(self) -> None:
        if len(self.text) > self.emitted:
            self._send(len(self.text))

    def pieces(self, start: int = 0, end: int | None = None) -> list[TokenText]:
        """text[start:end] by the token that produced each part (a token whose text is empty, or
        not yet final, has no part), with each token's kind."""
        end = len(self.text) if end is None else end
        pieces = []
        for at in range(start + 1, end + 1):
            if at == end or self.owner[at] != self.owner[start]:
                token = self.owner[start]
                kind = self.kinds[token] if token < len(self.kinds) else "plain"
                pieces.append(TokenText(self.text[start:at], kind))
                start = at
        return pieces

    def text_tokens(self, end: int | None = None) -> int:
        """How many tokens the text up to `end` (None: all of it) comes from: up to the one that
        made its last character."""
        end = len(self.text) if end is None else end
        return self.owner[end - 1] + 1 if end > 0 else 0

    def _send(self, end: int) -> None:
        """text[emitted:end] to on_text, with its parts by token (and their logprobs, kept)."""
        released = max(self.released, self.text_tokens(end))
        if self.on_text:
            logprobs = self.logprobs[self.released:released] if self.logprobs is not None else ()
            self.on_text(TextDelta(self.text[self.emitted:end], self.pieces(self.emitted, end), logprobs))
        self.emitted, self.released = end, released


def common_prefix(a: Sequence, b: Sequence) -> int:
    """The length of the longest common prefix of a and b (texts, or token ids)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Emitter:
    """Collects emitted tokens and decides when to stop: EOS, a stop string, the budget, or
    should_stop() (a caller that lost interest, e.g. a server whose client disconnected)."""

    def __init__(self, model, max_new_tokens: int, stop: Sequence[str], stop_at_eos: bool | Sequence[int],
                 on_text: Callable[[str], None] | None, should_stop: Callable[[], bool] | None = None) -> None:
        self.max_new_tokens = max_new_tokens
        self.should_stop = should_stop
        # stop_at_eos: True = the model's EOS ids, False = none, or the ids to stop at
        self.eos = set(model.eos_token_ids) if stop_at_eos is True else set(stop_at_eos or ())
        self.stream = TextStream(model.tokenizer, stop, on_text)
        self.tokens: list[int] = []
        self.kinds: list[TokenKind] = []  # each token's provenance
        self.logprobs: list[TokenLogprob] | None = None  # each token's, where kept (keep_logprobs)
        self.top_logprobs = 0
        self.reason: str | None = None if max_new_tokens > 0 else "length"

    @property
    def done(self) -> bool:
        return self.reason is not None

    def keep_logprobs(self, top: int) -> None:
        """Keep each new token's logprob and its `top` most likely alternatives (decoding/logprobs.py)
        from the logits each emit is given; before the first token."""
        self.logprobs, self.top_logprobs = [], top
        self.stream.logprobs = self.logprobs

    def emit(self, tokens: Sequence[int], kinds: Sequence[TokenKind] | None = None,
             rows: Sequence | None = None) -> None:
        """Append tokens in order until one of them ends the generation; kinds: each one's
        provenance (None: plain decoding); rows: the logits (vocab,) each one was chosen from (the
        target's, at its place), which logprobs are read from where kept."""
        for i, token in enumerate(tokens):
            if self.done:
                return
            self.tokens.append(token)
            self.kinds.append(kinds[i] if kinds is not None else "plain")
            if self.logprobs is not None:
                self.logprobs.append(token_logprob(rows[i], token, self.top_logprobs))
            if token in self.eos:
                self.reason = "eos"
            elif self.stream.update(self.tokens, self.kinds):
                self.reason = "stop"
            elif len(self.tokens) >= self.max_new_tokens:
                self.reason = "length"
        if self.should_stop is not None and not self.done and self.should_stop():
            self.reason = "cancelled"

    def cancel(self) -> None:
        """The caller lost interest before any token (should_stop, while the prompt prefilled)."""
        self.reason = self.reason or "cancelled"

    def finish(self) -> str:
        if self.reason != "stop":
            # (an EOS token can only be the last one, so the others keep their indices)
            kept = [(t, k) for t, k in zip(self.tokens, self.kinds) if t not in self.eos]
            self.stream.update([t for t, _ in kept], [k for _, k in kept])
        self.stream.finish()
        return self.stream.text

    def provenance(self) -> dict[str, int]:
        """How many tokens are of each kind (GenerationResult.provenance)."""
        counts = Counter(self.kinds)
        return {kind: counts[kind] for kind in TOKEN_KINDS}


@dataclass
class GenerationResult:
    text: str  # the new text (stop string removed)
    token_ids: list[int]  # the new tokens
    prompt_tokens: int
    stop_reason: str  # "eos", "stop", "length", or "cancelled" (should_stop said so)
    seconds: float  # decoding time, prefill included
    prefill_seconds: float
    plan: str
    stats: dict = field(default_factory=dict)
    # one line when the decode's passes ran SLOW_DECODE_RATIO times slower than this machine's
    # probe says they cost (engine/probe.py PaceCheck): a busy machine; None otherwise
    slow_note: str | None = None
    # how many of the new tokens are of each TokenKind (plain decoding: all "plain")
    provenance: dict[str, int] = field(default_factory=dict)
    # the text by the token that produced each part, with its kind (what a stream's deltas carry)
    pieces: list[TokenText] = field(default_factory=list)
    # where asked (Emitter.keep_logprobs): the new tokens' logprobs, in order (an EOS that ended the
    # reply among them; the tokens of a stop string cut from the text not)
    logprobs: list[TokenLogprob] | None = None

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return len(self.token_ids) / decode if decode > 0 else float("nan")

    def to_dict(self) -> dict:
        """The result's fields and its rate; logprobs only where they were kept."""
        fields_ = {k: v for k, v in asdict(self).items() if k != "logprobs" or v is not None}
        return {**fields_, "tokens_per_second": self.tokens_per_second}

    def summary_lines(self, precision: str, threads: int, cpu: str) -> list[str]:
        """What llama.cpp prints after a run, for a person: the prompt's and the new tokens' counts,
        times and rates, the draft's acceptance where one drafted, and what ran where."""
        decode = self.seconds - self.prefill_seconds

        def rate(tokens: int, seconds: float) -> str:
            return f"{tokens / seconds:.1f} tokens/s" if seconds > 0 else "- tokens/s"

        lines = [f"prompt eval: {self.prompt_tokens} tokens in {self.prefill_seconds:.2f} s "
                 f"({rate(self.prompt_tokens, self.prefill_seconds)})",
                 f"       eval: {len(self.token_ids)} tokens in {decode:.2f} s ({rate(len(self.token_ids), decode)})"]
        if self.stats.get("drafted"):
            drafted, accepted = self.stats["drafted"], self.stats.get("accepted", 0)
            per_pass = self.stats.get("mean_accepted_length")
            lines.append(f"      draft: {self.stats.get('drafter', '?')}: {drafted} drafted, {accepted} accepted "
                         f"({100 * accepted / drafted:.0f}%), {per_pass:.2f} tokens a pass")
        elif "drafter" in self.stats:
            lines.append(f"      draft: {self.stats['drafter']}: nothing drafted")
        lines.append(f"    stopped: {self.stop_reason} · plan {self.plan} · {precision} · {threads} threads · {cpu}")
        return lines


def prompt_notes(result: GenerationResult, chat: bool, chat_template: bool, max_new_tokens: int) -> list[str]:
    """What `generate` says on stderr after its output about how the prompt was read (both front
    ends): --chat on a model whose file carries no chat template (the prompt went as it is), and an
    empty answer to a bare prompt (an instruction-tuned model may answer only in its template)."""
    notes = []
    if chat and not chat_template:
        notes.append("(--chat: this model has no chat template, so the prompt went to it as it is; a base model "
                     "continues text rather than answering it)")
    if not result.text.strip() and not chat and max_new_tokens > 0:
        notes.append(f"(no text generated, stop reason: {result.stop_reason}; an instruction-tuned model may answer "
                     "a bare prompt only when it is wrapped in its chat template: add --chat)")
    return notes
