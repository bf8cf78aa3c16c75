"""Perplexity over windows of a text's tokens: how the text is cut, which tokens are scored, and
each token's negative log-likelihood from its window's logits; and a plan's predictions against
the full model's on the same tokens (logits_divergence). One definition for both front ends'
`layerplan ppl` (search/evaluate.py gives it the torch front end's logits, lite/research.py the light
one's), so a line prints the same numbers on either. No torch here.

The likelihoods are summed in float64 (a row's log-sum-exp from its maximum, its exponentials'
sum and every total in float64): torch's float32 cross_entropy, which transformers' loss uses,
reads ~1e-5 nats a token low over a 49,152-token vocabulary (SmolLM2, 512 tokens: -8.9e-6 on
average against float64, at most 1.9e-5)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np


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
class Divergence:
    """A plan's next-token predictions against a reference plan's, on the same tokens."""

    perplexity: float
    reference_perplexity: float
    kl: float  # mean KL(reference || plan) per position, nats
    top1_agreement: float  # fraction of positions where both argmaxes agree
    tokens: int
    plan: str
    # False: scoring stopped early (give_up); kl and perplexity are then lower bounds and
    # top1_agreement an upper bound, from the positions scored plus the best case for the rest
    complete: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


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


NLL_ROWS = 64  # a window's rows whose exponentials are summed at once (64 x 151,936 floats: 39 MB)


def token_nll(logits: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """float64 (T-1,): the negative log-likelihood of ids[1:] under logits[:-1] (T, vocab),
    float32 logits summed in float64."""
    count = len(logits) - 1
    targets = np.asarray(ids[1:], np.int64)
    out = np.empty(count, np.float64)
    for start in range(0, count, NLL_ROWS):
        rows = logits[start:min(start + NLL_ROWS, count)]
        top = rows.max(axis=1, keepdims=True)
        sums = np.exp(rows - top).sum(axis=1, dtype=np.float64)
        picked = rows[np.arange(len(rows)), targets[start:start + len(rows)]]
        out[start:start + len(rows)] = np.log(sums) + top[:, 0] - picked
    return out


LogitsOf = Callable[[list[int]], np.ndarray]  # a window's token ids -> its logits (T, vocab), float32


def sliding_perplexity(sequences: Sequence[Sequence[int]], logits_of: LogitsOf, window: int, stride: int, plan: str,
                       on_progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """The sliding protocol over each text's token ids, pooled by token; logits_of runs a window
    from an empty cache."""
    spans = [(ids, span) for ids in sequences for span in sliding_spans(len(ids), window, stride)]
    nll_sum, count = 0.0, 0
    for done, (ids, span) in enumerate(spans, 1):
        tokens = [int(t) for t in ids[span.begin:span.end]]
        scored = token_nll(logits_of(tokens), tokens)[span.first_scored - span.begin - 1:]
        nll_sum += float(scored.sum())
        count += len(scored)
        if on_progress:
            on_progress(done, len(spans))
    if count == 0:
        raise ValueError("nothing to score: every text is shorter than two tokens")
    mean = nll_sum / count
    return PerplexityResult(math.exp(mean), mean, count, window, stride, plan)


def added_bos(encode: Callable[[str, bool], list[int]]) -> int | None:
    """The BOS a tokenizer puts before a text (encode(text, special_tokens)), or None: what the
    tokenizer does, which is what llama-perplexity follows (the file's tokenizer.ggml.add_bos_token),
    rather than transformers' add_bos_token, which reads False for Gemma 3's tokenizer that adds one."""
    with_special, without = encode("a", True), encode("a", False)
    adds_before = len(with_special) > len(without) and with_special[1:1 + len(without)] == without
    return with_special[0] if adds_before else None


def chunk_perplexity(ids: Sequence[int], logits_of: LogitsOf, context: int, bos: int | None, plan: str,
                     on_progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """The llama.cpp protocol over a text's token ids: each chunk's first token replaced by `bos`
    (added_bos: where the tokenizer adds one; None: kept), its second half scored."""
    chunks = chunk_count(len(ids), context)
    first = context // 2
    nll_sum, count = 0.0, 0
    for index in range(chunks):
        tokens = [int(t) for t in ids[index * context:(index + 1) * context]]
        if bos is not None:
            tokens[0] = bos
        scored = token_nll(logits_of(tokens), tokens)[first:]  # tokens first+1 .. context-1
        nll_sum += float(scored.sum())
        count += len(scored)
        if on_progress:
            on_progress(index + 1, chunks)
    mean = nll_sum / count
    return PerplexityResult(math.exp(mean), mean, count, context, context, plan, "llama.cpp")


def logits_divergence(reference: np.ndarray, logits: np.ndarray, ids: Sequence[Sequence[int]],
                      plan: str) -> Divergence:
    """A plan's logits (B, T, vocab) against the reference plan's on the same ids (B, T), both
    float32: the mean KL(reference || plan) over the B x T positions (from log-softmaxes in float64,
    NLL_ROWS rows at a time), how often both argmaxes (the first maximum) agree, and both
    perplexities over the B x (T - 1) tokens predicted (token_nll). (search/evaluate.py's Reference
    scores many plans against one reference faster, in float32; tests/test_evaluate.py checks that
    the two agree.)"""
    targets = np.asarray(ids, np.int64)
    if (targets.ndim != 2 or targets.shape[1] < 2 or reference.shape != logits.shape
            or logits.shape[:2] != targets.shape):
        raise ValueError(f"a divergence needs two (B, T, vocab) logits of the same (B, T >= 2) ids, got "
                         f"{reference.shape} and {logits.shape} for {targets.shape} ids")
    batch, length = targets.shape
    kl_sum, agree = 0.0, 0
    for b in range(batch):
        for start in range(0, length, NLL_ROWS):
            rows = slice(start, min(start + NLL_ROWS, length))
            reference_log, plan_log = (_log_softmax(part[b, rows]) for part in (reference, logits))
            kl_sum += float((np.exp(reference_log) * (reference_log - plan_log)).sum())
            agree += int((reference[b, rows].argmax(axis=1) == logits[b, rows].argmax(axis=1)).sum())
    nll = [sum(float(token_nll(part[b], targets[b]).sum()) for b in range(batch)) for part in (reference, logits)]
    positions, predicted = batch * length, batch * (length - 1)
    return Divergence(perplexity=math.exp(nll[1] / predicted), reference_perplexity=math.exp(nll[0] / predicted),
                      kl=max(kl_sum / positions, 0.0), top1_agreement=agree / positions, tokens=positions, plan=plan)


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    """float64 log-softmax of float32 rows (rows, vocab)."""
    wide = rows.astype(np.float64)
    wide -= wide.max(axis=1, keepdims=True)
    wide -= np.log(np.exp(wide).sum(axis=1, keepdims=True))
    return wide
