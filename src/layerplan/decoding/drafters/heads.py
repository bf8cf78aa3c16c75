"""Everything that turns a residual stream into logits for a draft: the model's own head, light
exit heads trained by self-distillation, and a head over a reduced vocabulary. A drafter takes
its head as a constructor argument.

Exit heads (tuned-lens / Kangaroo style) map the residual stream after `exit` steps to something
the model's own final norm and LM head read well: h' = h + W h + b, with W, b zero at the start
(the plain logit lens). Only W and b are trained, on the full model's own next-token
distributions (KL(full || exit)) over the built-in corpus or the user's text: no labels, no
download, minutes on a CPU.

The reduced head (frequency-ranked, as in FR-Spec) scores only the K most frequent tokens of
calibration text, so it costs K/V of the full LM head; tokens outside the subset get probability
0 in the draft. The target still verifies with the whole vocabulary, so output stays exactly the
target's: a token the draft cannot propose only lowers acceptance.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save
from torch import nn
from torch.func import functional_call

from layerplan.corpus import default_corpus
from layerplan.decoding.drafters.plan import Head, PlanDrafter, named
from layerplan.engine.cpu_pack import PackedLinear, packing_supported
from layerplan.engine.load import dequantized_matrix
from layerplan.engine.runner import head as lm_head
from layerplan.engine.runner import run_hidden, softcap
from layerplan.files import write_bytes_atomic
from layerplan.models.loading import LoadedModel, cache_dir
from layerplan.plan.plan import LayerPlan


def final_head(model: LoadedModel) -> Head:
    """The model's own final norm and LM head (with logit soft-capping where it has one)."""
    return partial(lm_head, model)


# ----- exit heads -------------------------------------------------------------------------------
class ExitHead(nn.Module):
    def __init__(self, hidden_size: int, exit: int) -> None:
        super().__init__()
        self.exit = exit  # steps run before the head
        self.proj = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(hidden)


@dataclass
class TrainReport:
    exit: int
    steps: int
    seconds: float
    train_tokens: int
    eval_tokens: int
    kl_before: float  # held-out KL(full || plain exit)
    kl_after: float  # held-out KL(full || exit + head)
    agreement_before: float  # held-out top-1 agreement with the full model
    agreement_after: float

    def to_dict(self) -> dict:
        return asdict(self)


def _trainable(tensor: torch.Tensor) -> torch.Tensor:
    """A detached float32 tensor that autograd may save: a copy of one made under inference mode
    (a module the file model built during a pass has such parameters), else the tensor itself."""
    tensor = tensor.detach().float()
    return tensor.clone() if tensor.is_inference() else tensor


class ExitHeadDrafter(PlanDrafter):
    """Early exit after E steps, read through a trained exit head (ExitHead) before the LM head
    (the model's own, or `head`)."""

    def __init__(self, plan: LayerPlan, exit_head: ExitHead, min_confidence: float = 0.0,
                 head: Head | None = None) -> None:
        super().__init__(plan, min_confidence, head)
        self.exit_head = exit_head
        self.name = named(f"exit:{len(plan.active_steps)}+head", head)

    def draft_head(self, model: LoadedModel) -> Head:
        last = self.head if self.head is not None else final_head(model)
        exit_head = self.exit_head
        return lambda hidden: last(exit_head(hidden))


@dataclass(frozen=True)
class FrozenHead:
    """The model's final norm and LM head as float32 tensors that gradients pass through to the
    input only (nothing is accumulated into the model): a dense model's own parameters, detached;
    a model run as stored has its LM head dequantized, the one matrix that is (vocab x hidden
    floats: 0.9 GB for the 1.5B's 151,936 x 1,536, against 7 GB for the whole model)."""

    parts: object  # the model's ModelParts (soft-capping)
    norm: nn.Module
    norm_parameters: dict
    weight: torch.Tensor  # (vocab, hidden) float32
    bias: torch.Tensor | None

    @classmethod
    def of(cls, model: LoadedModel) -> FrozenHead:
        parts = model.parts
        norm = parts.final_norm.resolve() if hasattr(parts.final_norm, "resolve") else parts.final_norm
        lm_head = parts.lm_head.resolve() if hasattr(parts.lm_head, "resolve") else parts.lm_head
        stored = model.stored.of(lm_head) if model.stored is not None else None
        weight = dequantized_matrix(stored) if stored is not None else lm_head.weight.detach()
        bias = getattr(lm_head, "bias", None)
        return cls(parts, norm, {k: _trainable(v) for k, v in norm.named_parameters()}, _trainable(weight),
                   _trainable(bias) if bias is not None else None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = functional_call(self.norm, self.norm_parameters, (hidden,))
        return softcap(self.parts, F.linear(normed, self.weight, self.bias))


@torch.inference_mode()
def _collect(model: LoadedModel, ids: torch.Tensor, exit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden after `exit` steps, final hidden) for every position, shape (N, hidden)."""
    captured = {}
    final = run_hidden(model, ids, observe=lambda i, sub, h: captured.__setitem__(i, h) if i == exit and sub == "attention" else None)
    return captured[exit].reshape(-1, captured[exit].shape[-1]).clone(), final.reshape(-1, final.shape[-1]).clone()


def _evaluate(frozen: FrozenHead, head, exit_hidden, final_hidden, chunk=256) -> tuple[float, float, float, float]:
    kl_plain = kl_head = agree_plain = agree_head = 0.0
    with torch.no_grad():
        for start in range(0, exit_hidden.shape[0], chunk):
            h, f = exit_hidden[start : start + chunk], final_hidden[start : start + chunk]
            target = F.log_softmax(frozen(f).float(), -1)
            for use_head in (False, True):
                logits = frozen(head(h) if use_head else h).float()
                kl = F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="sum").item()
                agree = (logits.argmax(-1) == target.argmax(-1)).sum().item()
                if use_head:
                    kl_head, agree_head = kl_head + kl, agree_head + agree
                else:
                    kl_plain, agree_plain = kl_plain + kl, agree_plain + agree
    n = exit_hidden.shape[0]
    return kl_plain / n, kl_head / n, agree_plain / n, agree_head / n


def train_exit_head(
    model: LoadedModel,
    ids: torch.Tensor,
    exit: int,
    steps: int = 300,
    batch: int = 256,
    lr: float = 1e-3,
    eval_fraction: float = 0.2,
    seed: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every_s: float = 30.0,
) -> tuple[ExitHead, TrainReport]:
    """Train a head for an exit after `exit` steps on ids (B, T) of the model's own text.
    checkpoint: a file where the training's state (the head, the optimiser's moments, the batch
    sampler's state, the step) is kept every `checkpoint_every_s` seconds, so that the same
    training started again after an interruption goes on from there, to the same head an
    uninterrupted run gives; a checkpoint of another training (model, exit, text, settings) is
    not taken. The caller removes it once the head is saved."""
    if not 1 <= exit < model.num_layers:
        raise ValueError(f"exit must be 1–{model.num_layers - 1} for {model.name}, got {exit}")
    if model.stored is None and model.dtype != torch.float32:
        raise ValueError("train exit heads on the float32 model or a GGUF as stored (the head is saved in float32 "
                         "and works in any dtype)")
    exit_hidden, final_hidden = _collect(model, ids, exit)
    frozen = FrozenHead.of(model)
    n_eval = max(1, int(exit_hidden.shape[0] * eval_fraction))
    train_h, eval_h = exit_hidden[:-n_eval], exit_hidden[-n_eval:]
    train_f, eval_f = final_hidden[:-n_eval], final_hidden[-n_eval:]
    head = ExitHead(exit_hidden.shape[-1], exit)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    training = {"model": model.name, "exit": exit, "ids": _digest(ids), "steps": steps, "batch": batch, "lr": lr,
                "eval_fraction": eval_fraction, "seed": seed}
    first = _resume(checkpoint, training, head, optimizer, generator) if checkpoint is not None else 0
    start = kept = time.perf_counter()
    for step in range(first, steps):
        if checkpoint is not None and time.perf_counter() - kept >= checkpoint_every_s:
            _keep(checkpoint, training, step, head, optimizer, generator)
            kept = time.perf_counter()
        rows = torch.randint(0, train_h.shape[0], (min(batch, train_h.shape[0]),), generator=generator)
        with torch.no_grad():
            target = F.log_softmax(frozen(train_f[rows]).float(), -1)
        logits = frozen(head(train_h[rows])).float()
        loss = F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if on_progress:
            on_progress(step + 1, steps)
    seconds = time.perf_counter() - start
    kl_plain, kl_head, agree_plain, agree_head = _evaluate(frozen, head, eval_h, eval_f)
    report = TrainReport(exit, steps, seconds, train_h.shape[0], n_eval, kl_plain, kl_head, agree_plain, agree_head)
    return head.eval(), report


def _digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.flatten().to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def _keep(path: Path, training: dict, step: int, head: ExitHead, optimizer, generator: torch.Generator) -> None:
    """The training's state before `step`, atomically (train_exit_head's checkpoint)."""
    buffer = io.BytesIO()
    torch.save({"training": training, "step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                "generator": generator.get_state()}, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def _resume(path: Path, training: dict, head: ExitHead, optimizer, generator: torch.Generator) -> int:
    """The step a checkpoint of this training leaves off at, its state loaded (0: none, or another's)."""
    try:
        kept = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
        return 0
    if not isinstance(kept, dict) or kept.get("training") != training:
        return 0
    head.load_state_dict(kept["head"])
    optimizer.load_state_dict(kept["optimizer"])
    generator.set_state(kept["generator"])
    return int(kept["step"])


def default_head_path(model: LoadedModel, exit: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.name)
    return cache_dir() / "heads" / f"{safe}-exit{exit}.safetensors"


def save_head(head: ExitHead, path: str | Path, model: LoadedModel, report: TrainReport | None = None) -> Path:
    metadata = {"exit": str(head.exit), "model": model.name, "hidden_size": str(head.proj.in_features)}
    if report is not None:
        metadata["report"] = json.dumps(report.to_dict())
    tensors = {k: v.detach().float().contiguous() for k, v in head.state_dict().items()}
    return write_bytes_atomic(path, save(tensors, metadata=metadata))


def load_head(path: str | Path, model: LoadedModel) -> ExitHead:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"exit head not found: {path} (train one with `layerplan train-exit --exit E`)")
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    hidden = int(metadata.get("hidden_size", tensors["proj.weight"].shape[0]))
    if hidden != model.hf.config.hidden_size:
        raise ValueError(f"exit head {path} is for hidden size {hidden}, but {model.name} has {model.hf.config.hidden_size}")
    head = ExitHead(hidden, int(metadata.get("exit", 0)))
    head.load_state_dict(tensors)
    return head.to(dtype=model.dtype, device=model.device).eval()


# ----- a reduced vocabulary ------------------------------------------------------------------
def frequent_tokens(model: LoadedModel, k: int, text: str | None = None) -> torch.Tensor:
    """The k most frequent token ids of `text` (default: the built-in corpus), plus the special
    tokens (EOS must stay proposable), sorted."""
    vocab = model.hf.config.vocab_size
    if model.tokenizer is None:
        raise ValueError("a reduced draft vocabulary is counted on text, and this model has no tokenizer")
    if not 1 <= k <= vocab:
        raise ValueError(f"a reduced draft vocabulary needs 1 <= K <= {vocab}, got {k}")
    counts = Counter(model.tokenizer.encode(text if text is not None else default_corpus(), add_special_tokens=False))
    keep = {t for t, _ in counts.most_common(k)}
    keep.update(model.eos_token_ids)
    for special in model.tokenizer.all_special_ids:
        keep.add(int(special))
    for i in range(vocab):  # the text had fewer distinct tokens than k: fill with the lowest ids
        if len(keep) >= k:
            break
        keep.add(i)
    return torch.tensor(sorted(t for t in keep if 0 <= t < vocab), dtype=torch.long)


class ReducedHead:
    """Final norm + LM head restricted to `ids`; returns full-size logits with -inf elsewhere.

    A model run as stored (a GGUF's blocks, models/stored.py) keeps the head's rows `ids` in their
    block format (each row is whole blocks): the K rows are read from the file once, held in
    memory, and run by the same kernels and arithmetic as the full head; else the rows of the
    dense weight are copied."""

    def __init__(self, model: LoadedModel, ids: torch.Tensor, name: str = "") -> None:
        parts = model.parts
        self.name = name  # "vocab=K": what a drafter's name says about its head
        self.parts = parts
        self.vocab = model.hf.config.vocab_size
        self.ids = ids.to(model.device)
        full = parts.lm_head
        bias = getattr(full, "bias", None)
        stored = model.stored.of(full) if model.stored is not None else None
        linear = nn.Linear(full.weight.shape[1], len(self.ids), bias=bias is not None, dtype=full.weight.dtype,
                           device="meta" if stored is not None else full.weight.device)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach()[self.ids], requires_grad=False)
        self.native = None
        self.model_stored = model.stored
        if stored is not None:
            rows = stored.read_rows()[self.ids.cpu().numpy()]
            model.stored.adopt(linear, f"lm_head.vocab={len(self.ids)}",
                               replace(stored, rows=len(self.ids), offset=0, row_order=None, data=rows))
            # the native engine runs the stored rows as it runs the head; without it (and for passes
            # it does not take), __call__ dequantizes them once
            self.native = getattr(model.executor, "native", None)
            self.linear = linear
            return
        linear.weight = nn.Parameter(full.weight.detach()[self.ids].contiguous(), requires_grad=False)  # (K, H)
        # the same oneDNN packing as the model's own linears, where it applies
        self.linear = PackedLinear(linear) if packing_supported(linear.weight.dtype, linear.weight.device) else linear

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> logits (..., V), -inf outside the subset."""
        rows = hidden.numel() // hidden.shape[-1]
        if self.native is not None and self.native.takes(rows):
            scores = self.native.head(self.parts.final_norm, self.linear, hidden)
        else:  # (a stored head's rows dequantized, for passes longer than the kernels take)
            if self.linear.weight.device.type == "meta":
                self.model_stored.materialize(self.linear)
            scores = self.linear(self.parts.final_norm(hidden))
        sub = softcap(self.parts, scores)
        full = torch.full((*sub.shape[:-1], self.vocab), float("-inf"), dtype=sub.dtype, device=sub.device)
        full[..., self.ids] = sub
        return full


def reduced_head(model: LoadedModel, k: int, text: str | None = None) -> ReducedHead:
    """A ReducedHead over the k most frequent tokens of `text` (default: the built-in corpus),
    made once per model (LoadedModel.derived: a server builds a request's drafter anew, and a
    stored head's rows are read from the file)."""
    heads = model.derived.setdefault("reduced heads", {})
    if (k, text) not in heads:
        heads[k, text] = ReducedHead(model, frequent_tokens(model, k, text), name=f"vocab={k}")
    return heads[k, text]
