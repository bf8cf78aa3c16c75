"""Each new token's log-probability, and the most likely tokens at its place, as OpenAI's
`logprobs` / `top_logprobs` and llama-server's `n_probs` report them.

The distribution is the model's own: the log-softmax of the target's logits at the token's place
(vLLM's default), before any penalty, temperature or truncation a sampler applies; so a token's
logprob is the same whether it was decoded plainly, accepted from a draft or drawn as a
correction, and greedy and sampled replies report the same numbers for the same text. Without
torch: the logits are a torch tensor or a numpy array (the light front end's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from layerplan.models.file_index import byte_spelling

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and vLLM's default)
# the floor OpenAI reports for a token the model gives no probability (JSON has no -inf)
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """A new token's log-probability (nats) and the `top` most likely tokens at its place, most
    likely first, as (token id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def token_logprob(logits, token: int, top: int) -> TokenLogprob:
    """The token's TokenLogprob under logits (vocab,) (a torch tensor or a numpy array), with its
    `top` most likely tokens (0: none), the lower id first among equals."""
    if hasattr(logits, "log_softmax"):  # a torch tensor
        logp = logits.float().log_softmax(-1)
        chosen = float(logp[token])
        values, ids = logp.topk(min(top, logp.numel())) if top else (logp[:0], logp[:0])
        best = list(zip(ids.tolist(), values.tolist()))
    else:
        row = np.asarray(logits, np.float64)
        shifted = row - row.max()
        logp = shifted - np.log(np.exp(shifted).sum())
        chosen = float(logp[token])
        ids = np.argpartition(-logp, top - 1)[:top] if 0 < top < logp.size else np.arange(logp.size if top else 0)
        best = [(int(i), float(logp[i])) for i in ids]
    best.sort(key=lambda pair: (-pair[1], pair[0]))
    return TokenLogprob(int(token), _finite(chosen), tuple((int(i), _finite(v)) for i, v in best))


# GPT-2's byte-level alphabet: the printable character its vocabularies spell each byte with
_BYTE_LEVEL = {char: byte for byte, char in byte_spelling().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback pieces


class TokenSpeller:
    """A vocabulary's tokens as the exact bytes each adds to a reply, and as text (OpenAI's `bytes`
    and `token`): byte-level BPE pieces (GPT-2, Qwen, SmolLM) through their byte alphabet,
    SentencePiece pieces (Llama, Gemma) with '▁' as a space and <0xNN> as that byte, an added
    token as itself. A token that is part of a character has bytes that are no text alone: its
    text has the replacement character there. Only the vocabulary is read (no decode), so any
    thread may spell while another decodes."""

    def __init__(self, tokenizer) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        try:  # (the decoder's own JSON: a Sequence of decoders may hold the byte-level one)
            decoder = backend.decoder.__getstate__()
        except AttributeError:
            decoder = b""
        self.byte_level = b'"ByteLevel"' in (decoder or b"")
        self._piece: Callable[[int], str | None] = (
            tokenizer.convert_ids_to_tokens if hasattr(tokenizer, "convert_ids_to_tokens") else backend.id_to_token)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")

    def _bytes(self, token: int) -> bytes:
        piece = self._piece(token)
        if piece is None:
            return b""
        if self.byte_level and all(char in _BYTE_LEVEL for char in piece):
            return bytes(_BYTE_LEVEL[char] for char in piece)
        if match := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if self.byte_level:  # (an added token, spelt as itself)
            return piece.encode("utf-8")
        return piece.replace("▁", " ").encode("utf-8")


def chat_logprobs(logprobs: Sequence[TokenLogprob], speller: TokenSpeller,
                  leave: frozenset[int] = frozenset()) -> dict:
    """OpenAI's chat form: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}, but the
    tokens in `leave` (the EOS that ends a message: its entries spell the message's content)."""
    def entry(token: int, logprob: float) -> dict:
        return {"token": speller.text(token), "logprob": logprob, "bytes": list(speller.bytes(token))}

    return {"content": [{**entry(kept.token, kept.logprob), "top_logprobs": [entry(*other) for other in kept.top]}
                        for kept in logprobs if kept.token not in leave], "refusal": None}


class CompletionLogprobs:
    """OpenAI's legacy completions form, {tokens, token_logprobs, top_logprobs, text_offset}, for
    one reply's text or its stream's chunks in order (the offsets run on across them). A token's
    top_logprobs hold its N alternatives and itself, by text. An echoed prompt's first token has
    no context: null for its logprob and its alternatives."""

    def __init__(self, speller: TokenSpeller) -> None:
        self.speller = speller
        self.offset = 0

    def __call__(self, logprobs: Sequence[TokenLogprob], first_token: int | None = None) -> dict:
        """The form of these tokens' logprobs, after first_token's (an echoed prompt's first)."""
        text = self.speller.text
        firsts = [first_token] if first_token is not None else []
        tokens = [text(token) for token in firsts] + [text(kept.token) for kept in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [None] * len(firsts) + [kept.logprob for kept in logprobs],
                "top_logprobs": [None] * len(firsts) + [
                    {**{text(other): value for other, value in kept.top}, text(kept.token): kept.logprob}
                    for kept in logprobs],
                "text_offset": offsets}
