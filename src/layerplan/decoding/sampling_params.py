"""A request's sampling settings, checked once: temperature, top-k, top-p, min-p, the penalties,
logit bias, and the seed's range. Without torch (the light front end's chat keeps them too);
decoding/choice.py turns logits into tokens by them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from layerplan.decoding.limits import SEED_RANGE


# Sampling settings whose arithmetic stays finite: a temperature below MIN_TEMPERATURE, or a
# penalty outside PENALTY_RANGE, turns float32 logits into inf and the probabilities into NaN.
MIN_TEMPERATURE = 1e-4
PENALTY_RANGE = (0.01, 100.0)
# a logit bias's finite range (OpenAI's); -inf bans the token (llama.cpp's TOKEN-inf)
BIAS_RANGE = (-100.0, 100.0)
# OpenAI's range of presence_penalty and frequency_penalty
OUTPUT_PENALTY_RANGE = (-2.0, 2.0)


class SamplingError(ValueError):
    """A sampling setting out of its range; the message names the setting and the valid range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    repetition_penalty: float = 1.0  # CTRL-style: divide positive / multiply negative logits of seen tokens
    # keep the tokens whose probability (after temperature) is at least min_p times the most likely
    # one's; 0 keeps all (transformers' MinPLogitsWarper; llama.cpp's --min-p)
    min_p: float = 0.0
    # (token id, bias) added to the logits before everything else (OpenAI's logit_bias, llama.cpp's
    # --logit-bias, first in its sampler chain); greedy decoding takes it too
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's (and vLLM's) penalties on the tokens generated so far (not the prompt's): each logit
    # less presence_penalty where its token came at all, and frequency_penalty times its count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE)):
            raise SamplingError(f"temperature {self.temperature} is out of range: 0 (greedy) or a finite number "
                                f">= {MIN_TEMPERATURE}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k {self.top_k} is out of range: a whole number >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:  # (NaN fails this too)
            raise SamplingError(f"top_p {self.top_p} is out of range: a number in (0, 1]")
        if not 0 <= self.min_p <= 1:  # (NaN fails this too)
            raise SamplingError(f"min_p {self.min_p} is out of range: a number in [0, 1] (0 keeps every token)")
        low, high = PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise SamplingError(f"repetition_penalty {self.repetition_penalty} is out of range: a number in "
                                f"[{low:g}, {high:g}] (1 is no penalty)")
        low, high = OUTPUT_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not low <= getattr(self, name) <= high:  # (NaN fails this too)
                raise SamplingError(f"{name} {getattr(self, name)} is out of range: a number in [{low:g}, {high:g}] "
                                    "(0 is no penalty)")
        low, high = BIAS_RANGE
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingError(f"logit_bias token {token!r} is out of range: a token id >= 0")
            if not (low <= bias <= high or bias == -math.inf):
                raise SamplingError(f"logit_bias {bias} for token {token} is out of range: a number in "
                                    f"[{low:g}, {high:g}], or -inf to ban the token")

    def check_vocabulary(self, size: int) -> None:
        """SamplingError where logit_bias names a token outside a vocabulary of `size` ids."""
        outside = [token for token, _ in self.logit_bias if token >= size]
        if outside:
            raise SamplingError(f"logit_bias token {outside[0]} is out of range: the vocabulary has ids 0-{size - 1}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_greedy_choice(self) -> bool:
        """Whether a greedy choice is other than the logits' first maximum: a logit bias or a penalty
        (top-k, top-p and min-p keep the most likely token)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, settings: object) -> SamplingParams:
        """The sampling settings an object holds under these fields' names (a chat's settings, a
        light request), checked: SamplingError where one is out of range."""
        given = {field.name: getattr(settings, field.name) for field in fields(cls)}
        return cls(**{**given, "logit_bias": tuple(given["logit_bias"])})


def check_seed(seed: int | None) -> int | None:
    """The seed, or SamplingError when torch cannot take it."""
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise SamplingError(f"seed {seed} is out of range: a whole number in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
    return seed
