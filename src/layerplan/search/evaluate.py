"""Perplexity (sliding window), and how far a plan's predictions move from the full model's."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from layerplan.corpus import default_corpus
from layerplan.engine.runner import forward
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.windows import (NLL_ROWS, Divergence, PerplexityResult, added_bos, chunk_perplexity,
                                     logits_divergence, sliding_perplexity)


def calibration_ids(model: LoadedModel, text: str | None = None, tokens: int = 512) -> torch.Tensor:
    """(1, tokens) ids from `text` (default: the built-in corpus)."""
    ids = model.tokenizer(text if text is not None else default_corpus(), return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"the calibration text has {ids.shape[1]} tokens, fewer than the {tokens} asked for")
    return ids[:, :tokens].to(model.device)


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


HEAD_ROWS = 256  # positions per LM-head product when scoring (see _logit_chunks)


def first_argmax_is(logits: torch.Tensor, top: torch.Tensor, target: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """(c,) bool: logits.argmax(-1) == target for logits (c, V) whose row maxima are `top` (c,).

    argmax is a slow reduction on CPU (~8x an amax here); this needs only block maxima. The
    target wins when it reaches the row maximum and nothing before it does (argmax returns the
    first maximum): the maximum before the target is that of the whole blocks before its block
    and of the part of its own block before it."""
    rows, vocab = logits.shape
    reaches = logits.gather(-1, target[:, None])[:, 0] == top
    if vocab % block:  # pad with -inf to whole blocks (small test vocabularies)
        logits = F.pad(logits, (0, block - vocab % block), value=float("-inf"))
    blocks = logits.view(rows, -1, block)  # (c, V/block, block)
    whole_before = torch.arange(blocks.shape[1], device=logits.device) < (target // block)[:, None]
    before_block = blocks.amax(-1).masked_fill(~whole_before, float("-inf")).amax(-1)  # (c,)
    own = blocks.gather(1, (target // block)[:, None, None].expand(rows, 1, block))[:, 0]  # (c, block)
    in_block = torch.arange(block, device=logits.device) < (target % block)[:, None]
    before_in_block = own.masked_fill(~in_block, float("-inf")).amax(-1)
    return reaches & (torch.maximum(before_block, before_in_block) < top)


def _logit_chunks(head_fn, hidden: torch.Tensor, chunk: int, head_rows: int):
    """(b, start, end, logits) over every position: head_fn runs on blocks of `head_rows`
    positions (the LM head's matrix product is ~15% faster on 256 rows than on 64 here) and each
    block is handed out as float32 chunks of `chunk` rows (which stay in cache for the metrics).
    A chunk is a view where the block is float32 already; each row is handed out once."""
    batch, length, _ = hidden.shape
    for b in range(batch):
        for block_start in range(0, length, head_rows):
            block_end = min(block_start + head_rows, length)
            block = head_fn(hidden[b : b + 1, block_start:block_end])[0]  # (rows, V)
            for start in range(block_start, block_end, chunk):
                end = min(start + chunk, block_end)
                yield b, start, end, block[start - block_start : end - block_start].float()


class Reference:
    """The reference plan's next-token distributions on fixed ids, prepared once so that each
    candidate costs one max, one exp-sum and one dot product over the vocabulary:
    KL(ref || cand) = logsumexp(cand) − logsumexp(ref) − Σ p·(cand − ref). Working on the logit
    difference keeps float32 rounding small (no large terms that cancel).

    Candidates are scored over chunks of positions, so that the (positions × vocabulary) float32
    logits never exist at once: less memory traffic and no allocation churn of 100 MB tensors."""

    @torch.inference_mode()
    def __init__(self, logits: torch.Tensor, ids: torch.Tensor, chunk: int = 32) -> None:
        self.logits = logits  # (B, T, V) as given (scoring the reference itself reads it)
        self._prepare(lambda part: part, logits, ids, chunk)

    @classmethod
    @torch.inference_mode()
    def from_hidden(cls, head_fn, hidden: torch.Tensor, ids: torch.Tensor, chunk: int = 32) -> Reference:
        """The same as Reference(head_fn(hidden), ids), with head_fn applied to blocks of positions
        (the whole bf16 logits of 512 positions take twice as long to produce as 256-row blocks)."""
        reference = cls.__new__(cls)
        reference.logits = None
        reference._prepare(head_fn, hidden, ids, chunk)
        return reference

    def _prepare(self, head_fn, hidden: torch.Tensor, ids: torch.Tensor, chunk: int) -> None:
        batch, length, _ = hidden.shape
        self.ids, self.chunk = ids, chunk
        self.probs: torch.Tensor | None = None  # (B, T, V) float32, allocated once the vocabulary is known
        self.lse = torch.empty(batch, length, dtype=torch.float32, device=hidden.device)
        self.top1 = torch.empty(batch, length, dtype=torch.long, device=hidden.device)
        # Σ p·ref per position (float64 sum): a candidate's Σ p·(cand − ref) is then one fused
        # dot product, 10× cheaper than the elementwise difference and within ~1e-7 nats of it
        self.expected_logit = torch.empty(batch, length, dtype=torch.float32, device=hidden.device)
        nll_sum = 0.0
        for b, start, end, part in _logit_chunks(head_fn, hidden, chunk, HEAD_ROWS):  # part: (c, V)
            if self.probs is None:
                self.probs = torch.empty(batch, length, part.shape[-1], dtype=torch.float32, device=part.device)
            lse = torch.logsumexp(part, -1)
            probs = torch.exp(part - lse[:, None])
            self.probs[b, start:end] = probs
            self.lse[b, start:end] = lse
            self.top1[b, start:end] = part.argmax(-1)
            self.expected_logit[b, start:end] = torch.linalg.vecdot(probs.double(), part.double()).float()
            scored = min(end, length - 1) - start
            if scored > 0:
                picked = part[:scored].gather(-1, ids[b, start + 1 : start + 1 + scored, None])[:, 0]
                nll_sum += float((lse[:scored] - picked).sum())
        self.perplexity = math.exp(nll_sum / (batch * (length - 1)))

    def divergence(self, logits: torch.Tensor, plan: str = "") -> Divergence:
        """Compare a candidate's logits (B, T, V) on the same ids."""
        # the scorer overwrites float32 chunks in place (other dtypes are copied to float32 anyway)
        return self.divergence_of_hidden(lambda part: part.clone() if part.dtype == torch.float32 else part,
                                         logits, plan)

    @torch.inference_mode()
    def divergence_of_hidden(self, head_fn, hidden: torch.Tensor, plan: str = "", chunk: int | None = None,
                             give_up: Callable[[Divergence], bool] | None = None,
                             head_rows: int | None = None) -> Divergence:
        """The same as divergence(head_fn(hidden)), computed chunk by chunk (see _logit_chunks).

        give_up(bounds): called after each chunk but the last with the bounds so far
        (complete=False); True stops scoring and returns them. Per-position KL and NLL are >= 0,
        so the partial sums bound the final means from below, and agreement is bounded above by
        assuming the unscored positions agree."""
        batch, length, _ = hidden.shape
        positions, predicting = batch * length, batch * (length - 1)
        kl_sum, nll_sum, agree, done = 0.0, 0.0, 0, 0
        for b, start, end, logits in _logit_chunks(head_fn, hidden, chunk or self.chunk, head_rows or HEAD_ROWS):
            # logits (c, V) float32, overwritten below
            top = logits.amax(-1)  # (c,)
            agree += int(first_argmax_is(logits, top, self.top1[b, start:end]).sum())
            shift = torch.linalg.vecdot(self.probs[b, start:end], logits) - self.expected_logit[b, start:end]
            scored = min(end, length - 1) - start  # positions that predict a next token
            picked = None
            if scored > 0:
                picked = logits[:scored].gather(-1, self.ids[b, start + 1 : start + 1 + scored, None])[:, 0]
            lse = top + logits.sub_(top[:, None]).exp_().sum(-1).log_()  # in place: no second buffer
            kl_sum += float((lse - self.lse[b, start:end] - shift).sum())
            if picked is not None:
                nll_sum += float((lse[:scored] - picked).sum())
            done += end - start
            if give_up is not None and done < positions:
                bounds = Divergence(math.exp(nll_sum / predicting), self.perplexity, max(kl_sum / positions, 0.0),
                                    (agree + positions - done) / positions, int(self.ids.numel()), plan, False)
                if give_up(bounds):
                    return bounds
        return Divergence(
            perplexity=math.exp(nll_sum / predicting),
            reference_perplexity=self.perplexity,
            kl=max(kl_sum / positions, 0.0),  # rounding can make an exact match read -1e-7
            top1_agreement=agree / positions,
            tokens=int(self.ids.numel()),
            plan=plan,
        )


def compare(model: LoadedModel, ids: torch.Tensor, plan: LayerPlan, reference: LayerPlan | None = None) -> Divergence:
    """KL, top-1 agreement and perplexities of `plan` against `reference` (default: full model) on
    ids (B, T): search/windows.py's logits_divergence, the light front end's too (`layerplan ppl
    --plan` prints the same on either)."""
    def logits_of(chosen: LayerPlan | None):
        return forward(model, ids, chosen).float().cpu().numpy()

    return logits_divergence(logits_of(reference), logits_of(plan), ids.tolist(), plan.to_string())
