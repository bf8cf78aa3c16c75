"""How a text's tokens are cut into windows for perplexity, and which of them are scored: the one
definition both front ends' `layerplan ppl` use (search/evaluate.py on torch, lite/perplexity.py on
the kernels alone). No torch here."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per predicted token
    tokens: int  # predicted tokens scored
    window: int
    stride: int
    plan: str
    protocol: str = "sliding"  # PROTOCOLS

    def to_dict(self) -> dict:
        return asdict(self)


# how a text's tokens are cut into windows and which of them are scored
PROTOCOLS = {
    "sliding": "windows of --window tokens advancing by --stride; every token scored once, with up to "
               "window-1 tokens of context (transformers' \"Perplexity of fixed-length models\")",
    "llama.cpp": "llama-perplexity's: the text cut into chunks of --window tokens (the rest dropped), each "
                 "begun with BOS where the model adds one, and only each chunk's second half scored",
}


@dataclass(frozen=True)
class Span:
    """One window of a text's tokens: [begin, end), and the first token it scores (the tokens before
    it were scored by the window before; each window's first token has nothing to predict it)."""

    begin: int
    end: int
    first_scored: int


def sliding_spans(length: int, window: int, stride: int) -> list[Span]:
    """The sliding protocol's windows over a text of `length` tokens: `window` tokens advancing by
    `stride`, each token scored once, with up to window-1 tokens of context."""
    if stride < 1 or stride > window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    spans = []
    for begin in range(0, max(length - 1, 1), stride):
        previous_end = 0 if begin == 0 else min(begin - stride + window, length)
        spans.append(Span(begin, min(begin + window, length), max(begin + 1, previous_end)))
        if begin + window >= length:
            break
    return spans


def chunk_count(length: int, context: int) -> int:
    """The llama.cpp protocol's chunks of `context` tokens in a text of `length` (the rest dropped);
    a chunk scores its tokens context // 2 + 1 .. context - 1."""
    if context < 4:
        raise ValueError(f"a chunk of {context} tokens has no second half to score (at least 4)")
    if length < context:
        raise ValueError(f"nothing to score: the text is {length} tokens, shorter than one chunk of {context}")
    return length // context
