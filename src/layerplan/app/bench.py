"""The torch front end's methods for `layerplan bench` and `tune`: transformers' own generate,
layerplan's decoding on a loaded model, and the models they run (their interleaved timing and
table: app/bench_runs.py, which the light front end's bench shares)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from layerplan.app.bench_runs import PLAIN, TRANSFORMERS, Runner, timed_generation
from layerplan.decoding.generate import generate
from layerplan.engine.cpu_pack import packing_supported
from layerplan.engine.choices import BLOCK_PRECISIONS
from layerplan.engine.load import load_model
from layerplan.engine.native import resolve_engine
from layerplan.engine.probe_rows import ProbeRow
from layerplan.models.loading import LoadedModel, dense_bytes, resolve_dtype


def transformers_runner(model: LoadedModel, **options) -> Runner:
    """transformers' own generate (greedy), with extra options such as assistant_early_exit=4
    or prompt_lookup_num_tokens=10."""
    pad = model.eos_token_ids[0] if model.eos_token_ids else 0

    def run(ids: list[int], new_tokens: int):
        row = torch.tensor([ids])
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.hf.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=pad, **options)
            elapsed = time.perf_counter() - start
        return elapsed, out[0, len(ids):].tolist(), None

    return run


def layerplan_runner(model: LoadedModel, draft=None, draft_length=None, probe_row: ProbeRow | None = None) -> Runner:
    """probe_row: this machine's probe row for the model, the verify costs of a draft's rounds."""
    def run(ids: list[int], new_tokens: int):
        return timed_generation(generate(model, ids, max_new_tokens=new_tokens, draft=draft,
                                         draft_length=draft_length, probe_row=probe_row))

    return run


def wants_transformers(model: str, dtype: str) -> bool:
    """Whether timing `model` at `dtype` times transformers' own generate unless told: not for a GGUF
    run at a block precision, which transformers would run dequantized whole (4-8 times the file in
    memory: 28 GB for a 7B); there layerplan's plain decoding is the reference, and llama.cpp's own
    tools the peer."""
    return not (dtype in BLOCK_PRECISIONS and dense_bytes(model, "float32") is not None)


def load_for_timing(model: str, dtype: str, engine: str, on_note: Callable[[str], None] = lambda _: None,
                    transformers: bool = True) -> tuple[LoadedModel | None, LoadedModel]:
    """(stock, fast) at `dtype` (chosen already: no 'auto'): transformers' generate runs stock's own
    modules (None: transformers is not timed), layerplan runs fast. The native engine leaves the
    modules as they are, so one load serves both; the eager engine packs bf16 linears where oneDNN
    supports it, into a second copy. on_note: the lines that say what loads, and what a GGUF
    dequantized for transformers costs."""
    if dtype in BLOCK_PRECISIONS:  # transformers runs the model dense: in float32 (a GGUF by its own loader)
        if not transformers:
            on_note(f"loading {model} ({dtype}, engine native)…")
            return None, load_model(model, dtype=dtype, engine="native")
        on_note(f"loading {model} ({dtype}, engine native; transformers: float32)…")
        sizes = dense_bytes(model, "float32")
        if sizes is not None:
            on_note(f"dequantizing the GGUF to float32 for transformers: {sizes[0] / 1e9:.1f} GB of weights in "
                    f"memory beside the {sizes[1] / 1e9:.1f} GB it runs as stored (--no-transformers leaves it out)")
        return load_model(model, dtype="float32", engine="eager"), load_model(model, dtype=dtype, engine="native")
    kind = resolve_engine(engine, resolve_dtype(dtype), "cpu")
    on_note(f"loading {model} ({dtype}, engine {kind})…")
    if kind == "native":
        loaded = load_model(model, dtype=dtype, engine="native")
        return (loaded if transformers else None), loaded
    stock = load_model(model, dtype=dtype, pack=False, engine="eager")
    if not packing_supported(stock.dtype, "cpu"):
        return (stock if transformers else None), stock
    if not transformers:  # (the packed copy alone)
        del stock
        return None, load_model(model, dtype=dtype, pack=True, engine="eager")
    return stock, load_model(model, dtype=dtype, pack=True, engine="eager")


def eager_view(model: LoadedModel) -> LoadedModel:
    """The same model (same modules, same weights) run by the eager engine."""
    return replace(model, executor=None) if model.native is not None else model


def bench_methods(
    stock: LoadedModel | None,
    fast: LoadedModel | None = None,
    drafts: list[str] = (),
    hf_early_exits: list[int] = (),
    hf_prompt_lookup: int | None = None,
    draft_length: str | None = None,
    peers: dict[str, Runner] | None = None,
    probe_row: ProbeRow | None = None,
) -> dict[str, Runner]:
    """transformers on the stock model's own modules; layerplan plain on the eager engine over
    the same modules, and on `fast` (the native engine, or packed linears) with each draft (its
    verify costs from probe_row, this machine's probe row for `fast`); then any peers (llama.cpp's
    tools). stock None: neither transformers nor the eager engine is timed (load_for_timing)."""
    fast = fast if fast is not None else stock
    if stock is None and (hf_early_exits or hf_prompt_lookup):
        raise ValueError("transformers' early exit and prompt lookup run on transformers' own model: time it too "
                         "(--transformers)")
    methods: dict[str, Runner] = {TRANSFORMERS: transformers_runner(stock)} if stock is not None else {}
    for exit_layer in hf_early_exits:
        methods[f"transformers early_exit={exit_layer}"] = transformers_runner(stock, assistant_early_exit=exit_layer)
    if hf_prompt_lookup:
        methods[f"transformers prompt_lookup={hf_prompt_lookup}"] = transformers_runner(
            stock, prompt_lookup_num_tokens=hf_prompt_lookup)
    if stock is not None and (fast is not stock or fast.native is not None):
        methods["layerplan plain, eager"] = layerplan_runner(eager_view(stock))
    methods[PLAIN] = layerplan_runner(fast)
    for draft in drafts:
        methods[f"layerplan draft={draft}"] = layerplan_runner(fast, draft, draft_length, probe_row)
    methods.update(peers or {})
    return methods
