"""The check that makes a discovered architecture usable: on a tiny random model of it (the real
config, shrunk), the identity plan's logits equal transformers' own, for a prefill and for
incremental decoding over the plan's KV cache, in float32. Run once per architecture-and-options
and transformers version; the answer is cached (models/discovery.py keys it). A failed check is a
one-line ModelError naming what differed; a model is never run on parts that failed it.

engine/load.py runs the check (`ensure_checked`) before it loads a model.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from layerplan.engine.executors import use_modules, use_native
from layerplan.engine.native import native_available
from layerplan.engine.runner import forward, new_cache
from layerplan.models import loading
from layerplan.models.arch_table import ARCHITECTURES
from layerplan.models.architectures import ModelError, refusal_of_config
from layerplan.models.discovery import (TINY_VOCAB, architecture_key, read_record, spec_of, tiny_config, tiny_model,
                                        write_record)

TOLERANCE = 1e-4  # float32 logits, identity plan vs transformers
CHECK_LENGTH = 14  # tokens: longer than the tiny configs' sliding windows (4)


@dataclass(frozen=True)
class ArchitectureCheck:
    """The answer of one check (also what the cache holds)."""

    model_type: str
    passed: bool
    detail: str  # what was compared, or what differed (a one-line error)
    max_difference: float | None = None  # largest |logit difference| seen (eager engine)
    native: bool | None = None  # the native kernels match too (None: not available here)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_ids(seed: int = 0, length: int = CHECK_LENGTH) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (1, length), generator=generator)


def incremental_logits(model, ids: torch.Tensor, plan=None, splits: tuple[int, int] = (6, 9)) -> torch.Tensor:
    """Logits from a prefill of ids[:a], a chunk ids[a:b], then one token at a time (a small cache
    capacity, so that growing it is exercised too)."""
    plan = plan if plan is not None else model.plan()
    cache = new_cache(plan, capacity=4)
    a, b = splits
    pieces = [forward(model, ids[:, :a], plan, cache, 0), forward(model, ids[:, a:b], plan, cache, a)]
    pieces += [forward(model, ids[:, t : t + 1], plan, cache, t) for t in range(b, ids.shape[1])]
    return torch.cat(pieces, 1)


def _compare(model, ids: torch.Tensor, reference: torch.Tensor) -> tuple[str | None, float]:
    """(what differed first, prefill then incremental, or None; the largest |difference|). An
    exception inside the runner is what differed too."""
    worst = 0.0
    for what, run in (("prefill", lambda: forward(model, ids)), ("incremental decoding", lambda: incremental_logits(model, ids))):
        try:
            logits = run()
        except Exception as error:  # noqa: BLE001 - any failure of the discovered parts is the answer
            message = (str(error).strip().splitlines() or [""])[0][:200]
            return f"{what} raised {type(error).__name__}: {message}", float("inf")
        if logits.shape != reference.shape:
            return f"{what} gave logits of shape {tuple(logits.shape)}, transformers {tuple(reference.shape)}", float("inf")
        error = torch.nan_to_num((logits - reference).abs().max(-1).values[0], nan=float("inf"))  # per position
        if error.max() > TOLERANCE:
            position = int(error.argmax())
            return f"{what} logits differ from transformers' by {float(error[position]):.2e} at position {position}", float(error.max())
        worst = max(worst, float(error.max()))
    return None, worst


def run_check(config, seed: int = 0) -> ArchitectureCheck:
    """Check an architecture now (no cache): discover its parts on a tiny model, compare."""
    model_type = config.model_type
    refusal = refusal_of_config(config)
    if refusal:  # before building anything: a recurrent model's tiny version may not even build here
        return ArchitectureCheck(model_type, False, f"architecture '{model_type}' is refused: {refusal}")
    try:
        hf = tiny_model(tiny_config(config), seed=seed)
        spec_of(config, sample=hf)  # the parts the real model will be found by
    except ModelError as error:
        return ArchitectureCheck(model_type, False, str(error))
    return check_model(hf)


def check_model(hf: nn.Module) -> ArchitectureCheck:
    """Compare the identity plan with transformers on an already built (tiny) model."""
    model_type = hf.config.model_type
    try:
        spec_of(hf.config, sample=hf)
        model = loading.LoadedModel(name=f"tiny-{model_type}", hf=hf, tokenizer=None, source="tiny random config",
                                    require_check=False)
    except ModelError as error:
        return ArchitectureCheck(model_type, False, str(error))
    ids = check_ids()
    with torch.no_grad():
        reference = hf(ids).logits.float()
    failure, worst = _compare(model, ids, reference)
    if failure is not None:
        return ArchitectureCheck(model_type, False, f"architecture '{model_type}' failed its check against "
                                 f"transformers: {failure} (tolerance {TOLERANCE:g})", worst)
    native = None
    if native_available() is None:
        use_native(model)
        native = _compare(model, ids, reference)[0] is None
        use_modules(model)
    return ArchitectureCheck(model_type, True, f"identity plan == transformers on a tiny random config, prefill and "
                             f"incremental, float32 (max |difference| {worst:.1e})", worst, native)


def check_architecture(config, force: bool = False) -> ArchitectureCheck:
    """The cached answer for an architecture (the table's rows pass: the test suite checks them)."""
    if config.model_type in ARCHITECTURES:
        return ArchitectureCheck(config.model_type, True, "written in the architecture table (checked by the test suite)")
    try:
        key = architecture_key(config)
    except ModelError as error:
        return ArchitectureCheck(config.model_type, False, str(error))
    record = None if force else read_record(key, "check")
    if record is not None:
        return ArchitectureCheck(**record)
    result = run_check(config)
    write_record(key, "check", result.to_json())
    return result


def ensure_checked(config) -> ArchitectureCheck:
    """The check's answer; a ModelError (one line, what differed) when it failed."""
    result = check_architecture(config)
    if not result.passed:
        raise ModelError(result.detail)
    return result


def config_for(name: str):
    """A transformers config for a model_type ('olmo2': its default config) or a model (folder,
    GGUF, the default)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name in CONFIG_MAPPING_NAMES:
        return AutoConfig.for_model(name)
    if not os.path.exists(name) and name not in (loading.DEFAULT_MODEL, "default"):
        raise ModelError(f"'{name}' is neither a model_type of transformers {_transformers_version()} nor a model path; "
                         "`layerplan models --architectures` lists the model types")
    return loading.model_config(name)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
