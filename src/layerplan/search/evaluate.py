"""Perplexity (sliding window), and how far a plan's predictions move from the full model's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from layerplan.corpus import default_corpus, first_tokens
from layerplan.engine.runner import forward
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.reference import CHUNK_ROWS, LogitsReference
from layerplan.search.windows import (NLL_ROWS, Divergence, PerplexityResult, added_bos, chunk_perplexity,
                                     logits_divergence, sliding_perplexity)


def calibration_ids(model: LoadedModel, text: str | None = None, tokens: int = 512) -> torch.Tensor:
    """(1, tokens) ids from `text` (default: the built-in corpus)."""
    ids = model.tokenizer(text if text is not None else default_corpus(), return_tensors="pt").input_ids
    return first_tokens(ids[0], tokens)[None].to(model.device)


def perplexity(
    model: LoadedModel,
    texts: str | Sequence[str] | torch.Tensor | Sequence[torch.Tensor],
    plan: LayerPlan | None = None,
    window: int = 512,
    stride: int = 256,
    on_progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity as in transformers' "Perplexity of fixed-length models": windows
    of `window` tokens advance by `stride`; each token is scored once, with up to window-1 tokens
    of context. Several texts are scored separately and pooled by token."""
    plan = plan if plan is not None else model.plan()
    texts = [texts] if isinstance(texts, (str, torch.Tensor)) else list(texts)
    sequences = [
        t.reshape(1, -1) if isinstance(t, torch.Tensor) else model.tokenizer(t, return_tensors="pt").input_ids
        for t in texts
    ]
    return sliding_perplexity([ids[0].tolist() for ids in sequences], _window_logits(model, plan), window, stride,
                              plan.to_string(), on_progress)


def perplexity_in_chunks(
    model: LoadedModel,
    ids: torch.Tensor,
    plan: LayerPlan | None = None,
    context: int = 512,
    on_progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity as llama.cpp's llama-perplexity computes it (PROTOCOLS["llama.cpp"]): the ids
    (1, T), tokenized as the model's tokenizer does (BOS first where it adds one), cut into
    T // context chunks; where the tokenizer adds BOS, each chunk's first token is replaced by it;
    a chunk's tokens context/2+1 .. context-1 are scored, each with every chunk token before it as
    context."""
    plan = plan if plan is not None else model.plan()
    tokenizer = model.tokenizer
    bos = added_bos(lambda text, special: tokenizer(text, add_special_tokens=special).input_ids)
    return chunk_perplexity(ids.reshape(-1).tolist(), _window_logits(model, plan), context, bos, plan.to_string(),
                            on_progress)


def _window_logits(model: LoadedModel, plan: LayerPlan):
    """search/windows.py's logits_of on the torch front end: a window's logits, float32, from an
    empty cache."""
    def logits_of(tokens: list[int]):
        return forward(model, torch.tensor([tokens], device=model.device), plan)[0].float().cpu().numpy()

    return logits_of


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1) negative log-likelihood of ids[:, 1:] under logits[:, :-1], float32 from float64
    sums (search/windows.py token_nll's rule: float32 cross_entropy reads ~1e-5 nats low)."""
    batch, length, vocab = logits.shape
    rows = logits[:, :-1].float().reshape(-1, vocab)
    targets = ids[:, 1:].reshape(-1, 1).to(rows.device)
    parts = []
    for start in range(0, rows.shape[0], NLL_ROWS):
        part = rows[start:start + NLL_ROWS]
        top = part.amax(-1, keepdim=True)
        sums = torch.exp(part - top).sum(-1, dtype=torch.float64)
        picked = part.gather(-1, targets[start:start + NLL_ROWS])[:, 0]
        parts.append((sums.log() + top[:, 0].double() - picked.double()).float())
    return torch.cat(parts).view(batch, length - 1) if parts else rows.new_zeros(batch, length - 1)


def _rows_of(head_fn, hidden: torch.Tensor, copy: bool):
    """search/reference.py's logits_of over hidden states (B, T, H) (or logits, head_fn the
    identity): float32 numpy logits on the CPU; copy where the array would be the caller's."""
    def logits_of(b: int, start: int, end: int) -> np.ndarray:
        logits = head_fn(hidden[b:b + 1, start:end])[0].float().cpu()
        return logits.numpy().copy() if copy else logits.numpy()

    return logits_of


class Reference:
    """The reference plan's next-token distributions on fixed ids (B, T): search/reference.py's
    LogitsReference (numpy: the light front end's scorer too, so both front ends' scans print the
    same numbers) over torch's logits, or over hidden states and an LM head (the logits of blocks
    of positions then never exist whole)."""

    @torch.inference_mode()
    def __init__(self, logits: torch.Tensor, ids: torch.Tensor, chunk: int = CHUNK_ROWS) -> None:
        self.logits = logits  # (B, T, V) as given
        self.ids = ids
        self.scorer = LogitsReference(_rows_of(lambda part: part, logits, copy=True), ids.cpu().numpy(),
                                      chunk_rows=chunk)
        self.perplexity = self.scorer.perplexity

    @classmethod
    @torch.inference_mode()
    def from_hidden(cls, head_fn, hidden: torch.Tensor, ids: torch.Tensor, chunk: int = CHUNK_ROWS) -> Reference:
        """The same as Reference(head_fn(hidden), ids), with head_fn applied to blocks of positions."""
        reference = cls.__new__(cls)
        reference.logits, reference.ids = None, ids
        reference.scorer = LogitsReference(_rows_of(head_fn, hidden, copy=False), ids.cpu().numpy(),
                                           chunk_rows=chunk)
        reference.perplexity = reference.scorer.perplexity
        return reference

    def divergence(self, logits: torch.Tensor, plan: str = "") -> Divergence:
        """Compare a candidate's logits (B, T, V) on the same ids."""
        return self.scorer.divergence(_rows_of(lambda part: part, logits, copy=True), plan)

    @torch.inference_mode()
    def divergence_of_hidden(self, head_fn, hidden: torch.Tensor, plan: str = "", chunk: int | None = None,
                             give_up: Callable[[Divergence], bool] | None = None,
                             head_rows: int | None = None) -> Divergence:
        """The same as divergence(head_fn(hidden)), head_fn on blocks of head_rows positions, scored
        chunk rows at a time; give_up: LogitsReference.divergence's."""
        return self.scorer.divergence(_rows_of(head_fn, hidden, copy=False), plan, give_up=give_up,
                                      block_rows=head_rows, chunk_rows=chunk)


def compare(model: LoadedModel, ids: torch.Tensor, plan: LayerPlan, reference: LayerPlan | None = None) -> Divergence:
    """KL, top-1 agreement and perplexities of `plan` against `reference` (default: full model) on
    ids (B, T): search/windows.py's logits_divergence, the light front end's too (`layerplan ppl
    --plan` prints the same on either)."""
    def logits_of(chosen: LayerPlan | None):
        return forward(model, ids, chosen).float().cpu().numpy()

    return logits_divergence(logits_of(reference), logits_of(plan), ids.tolist(), plan.to_string())
