"""`layerplan export` on the light front end: a GGUF's plan as a GGUF file of its stored blocks
(export_gguf.py), or any model's plan as mergekit YAML, written as app/cli/running.py's
run_export_command writes them, with its lines, and without loading a model: neither needs
more than the file's header (its config as the file's index would hold it) and the blocks' bytes.
"""

from __future__ import annotations

from layerplan.export_gguf import gguf_pattern_refusal, gguf_scale_refusal, write_gguf_plan
from layerplan.files import check_output, write_text_atomic
from layerplan.lite import TorchFrontEnd
from layerplan.lite.cli import ENDINGS, ended_by
from layerplan.lite.request import LiteExportRequest
from layerplan.models.depth import display_name, gguf_depth, model_depth
from layerplan.models.errors import ModelError
from layerplan.models.file_index import config_of, file_index_refusal, full_config
from layerplan.models.gguf_file import read_header
from layerplan.models.gguf_place import gguf_of
from layerplan.plan.formats import load_plan, to_mergekit
from layerplan.plan.plan import LayerPlan, check_attached


def pattern_of(config: dict, plan: LayerPlan) -> list[str]:
    """The kinds of the layers of a GGUF of the model's architecture as deep as the plan, from the
    file's config (models/file_index.py full_config: the rule its config class follows);
    TorchFrontEnd where the file index has no rule (transformers' config class has it)."""
    if config.get("model_type") != "gemma3_text":
        raise TorchFrontEnd(f"{config.get('model_type')}'s pattern of layer kinds")
    return full_config({**config, "num_hidden_layers": len(plan.active_steps)})["layer_types"]


def run_export(request: LiteExportRequest) -> int | None:
    """Carry out the request: its exit status, or None where the torch front end is to (a GGUF of
    layers of several kinds whose pattern the index has no rule for). A plan whose layers leave
    the file's pattern, or scale a sub-layer, is refused in the torch front end's words (export.py
    gguf_refusal)."""
    try:
        check_output(request.out, "file")  # before any work
        if request.fmt == "mergekit":
            plan = load_plan(request.plan, *model_depth(request.model))
            sources = {"b": request.model_b} if request.model_b else None
            write_text_atomic(request.out, to_mergekit(plan, request.source or request.model, request.yaml_dtype,
                                                       sources))
            print(f"wrote {request.out}")
            return 0
        gguf = gguf_of(request.model)
        try:  # (once: the plan's depth and the layers' kinds, then the file written from it)
            header = read_header(gguf)
        except (ModelError, OSError) as error:  # (a file it cannot read: the torch front end says so)
            raise TorchFrontEnd(str(error)) from error
        refusal = file_index_refusal(header)
        if refusal is not None:  # (its config is transformers')
            raise TorchFrontEnd(refusal)
        plan = load_plan(request.plan, gguf_depth(header), display_name(gguf))
        config = full_config(config_of(header))  # (as the file's index holds it: no index needed)
        check_attached(plan)
        layer_types = config.get("layer_types") or []
        refusal = (gguf_pattern_refusal(config["model_type"], layer_types, pattern_of(config, plan), plan)
                   if len(set(layer_types)) > 1 else None) or gguf_scale_refusal(plan)
        if refusal is not None:
            raise ValueError(refusal)
        path = write_gguf_plan(header, plan, request.out)
        print(f"wrote {path} ({len(plan.active_steps)} layers, the source's stored types)")
        return 0
    except ENDINGS as error:
        return ended_by(error)
