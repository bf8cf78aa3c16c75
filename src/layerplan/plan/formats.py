"""Plans in other tools' formats and in files; FORMATS is the one registry the CLI reads.

- layerplan JSON: ``{"format": "layerplan", "version": 1, "num_layers": N, "plan": "..."}``;
- Draft & Verify JSON: ``{"attention": [...], "mlp": [...]}``, the skipped sub-layers;
- llama.cpp ``run_layers``: per layer 0 skip, 1 attention only, 2 MLP only, 3 both;
- mergekit passthrough ``slices:`` YAML (``layer_range`` half-open; ``scale`` filters on o_proj /
  down_proj read as sub-layer switches and residual scales);
- PEFT ``layer_replication``: ``[[start, end), ...]`` pairs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from layerplan.files import write_text_atomic
from layerplan.plan.plan import LayerPlan, PlanError, Step, ascending_runs, out_of_range, parse_plan


# ----- layerplan JSON ---------------------------------------------------------------------------
def to_json(plan: LayerPlan) -> dict[str, Any]:
    return {"format": "layerplan", "version": 1, "num_layers": plan.num_layers, "plan": plan.to_string()}


JSON_KEYS = ("format", "version", "num_layers", "plan")  # a layerplan plan file holds these and nothing else


def from_json(obj: dict[str, Any], num_layers: int | None = None, model_name: str = "the model") -> LayerPlan:
    unknown = [str(k) for k in obj if k not in JSON_KEYS]
    if unknown:
        raise PlanError(f"unknown key(s) {', '.join(repr(k) for k in sorted(unknown))} in a layerplan plan file; "
                        f"it holds {', '.join(JSON_KEYS)}")
    if obj.get("version", 1) != 1 or isinstance(obj.get("version"), bool):
        raise PlanError(f"plan file version {obj.get('version')!r}: this layerplan reads version 1")
    n = int(obj["num_layers"]) if num_layers is None else num_layers
    if num_layers is not None and int(obj.get("num_layers", n)) != n:
        raise PlanError(f"the saved plan was made for {obj['num_layers']} layers but {model_name} has {n}")
    return parse_plan(obj["plan"], n, model_name)


# ----- Draft & Verify ---------------------------------------------------------------------------
def to_draft_verify(plan: LayerPlan) -> dict[str, list[int]]:
    """Draft & Verify's skip sets: {"attention": [...], "mlp": [...]} of skipped layers."""
    _require_model_order(plan, "Draft & Verify skip sets")
    return plan.skipped()


def from_draft_verify(obj: dict[str, Any] | str, num_layers: int, model_name: str = "the model") -> LayerPlan:
    if isinstance(obj, str):
        obj = json.loads(obj)
    unknown = set(obj) - {"attention", "mlp"}
    if unknown:
        raise PlanError(f"unknown key(s) {sorted(unknown)} in a Draft & Verify skip set; expected 'attention' and 'mlp'")
    attention = [_as_layer_index(v, num_layers, model_name) for v in obj.get("attention", [])]
    mlp = [_as_layer_index(v, num_layers, model_name) for v in obj.get("mlp", [])]
    return LayerPlan.from_skips(num_layers, attention=attention, mlp=mlp, model_name=model_name)


# ----- llama.cpp run_layers ---------------------------------------------------------------------
def to_run_layers(plan: LayerPlan) -> list[int]:
    """llama.cpp's run_layers vector (needs the model's own layer order)."""
    _require_model_order(plan, "run_layers")
    limit = len(plan.active_steps)
    return [int(s.attention) + 2 * int(s.mlp) if i < limit else 0 for i, s in enumerate(plan.steps)]


def from_run_layers(vector: Sequence[int], num_layers: int | None = None, model_name: str = "the model") -> LayerPlan:
    n = len(vector) if num_layers is None else num_layers
    if len(vector) != n:
        raise PlanError(f"run_layers has {len(vector)} entries but {model_name} has {n} layers")
    steps = []
    for i, value in enumerate(vector):
        if value not in (0, 1, 2, 3):
            raise PlanError(f"run_layers[{i}] = {value!r}: each entry must be 0 (skip), 1 (attention), 2 (MLP) or 3 (both)")
        steps.append(Step(i, attention=bool(value & 1), mlp=bool(value & 2)))
    return LayerPlan(tuple(steps), n, model_name=model_name)


# ----- PEFT layer_replication -------------------------------------------------------------------
def to_layer_replication(plan: LayerPlan) -> list[list[int]]:
    """PEFT's layer_replication: half-open [start, end) ranges, concatenated."""
    _require_whole_layers(plan, "layer_replication")
    if plan.models:
        raise PlanError("layer_replication repeats layers of one model; this plan uses several")
    return [[a, b + 1] for a, b in ascending_runs([s.layer for s in plan.active_steps])]


def from_layer_replication(pairs: Sequence[Sequence[int]], num_layers: int, model_name: str = "the model") -> LayerPlan:
    layers: list[int] = []
    for pair in pairs:
        if len(pair) != 2:
            raise PlanError(f"layer_replication entry {list(pair)!r} must be a [start, end) pair")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in pair):
            raise PlanError(f"layer_replication entry {list(pair)!r} must hold two integers")
        start, end = pair
        if end <= start:
            raise PlanError(f"layer_replication entry [{start}, {end}) is empty: end must exceed start")
        if start < 0 or end > num_layers:
            bad = start if start < 0 else end - 1
            raise PlanError(out_of_range(bad, num_layers, model_name))
        layers.extend(range(start, end))
    return LayerPlan(tuple(Step(i) for i in layers), num_layers, model_name=model_name)


# ----- mergekit passthrough ---------------------------------------------------------------------
def to_mergekit(plan: LayerPlan, model: str, dtype: str = "bfloat16", sources: dict[str, str] | None = None) -> str:
    """mergekit passthrough YAML that builds this plan as a real checkpoint.
    sources: model path per extra label ("b": "org/other") for plans over several models.
    A residual scale s becomes `parameters: scale` filters of s on o_proj and down_proj (the
    Llama-family names from_mergekit reads), which scale exactly the layer's residual updates."""
    if any(not (s.attention and s.mlp) for s in plan.active_steps):
        raise PlanError(f"mergekit passthrough can only express whole layers, not '{plan.to_string()}'")
    names = {"": model, **(sources or {})}
    missing = [label for label in plan.models if label not in names]
    if missing:
        raise PlanError(f"the plan uses model(s) {', '.join(missing)}: give their paths for the mergekit config")
    slices = []
    for label, run in _model_runs(plan.active_steps):
        pieces: list[list] = []  # [first layer, last layer, scale]: ascending layers at one scale
        for step in run:
            if pieces and step.layer == pieces[-1][1] + 1 and step.scale == pieces[-1][2]:
                pieces[-1][1] = step.layer
            else:
                pieces.append([step.layer, step.layer, step.scale])
        for a, b, scale in pieces:
            piece: dict[str, Any] = {"sources": [{"model": names[label], "layer_range": [a, b + 1]}]}
            if scale != 1.0:
                piece["parameters"] = {"scale": [{"filter": "o_proj", "value": scale},
                                                 {"filter": "down_proj", "value": scale}]}
            slices.append(piece)
    return yaml.safe_dump({"slices": slices, "merge_method": "passthrough", "dtype": dtype}, sort_keys=False)


def from_mergekit(text_or_obj: str | dict[str, Any], num_layers: int, model_name: str = "the model") -> LayerPlan:
    """A passthrough config as a plan. `parameters: scale` filters (on a source, a slice or the
    whole config, in mergekit's precedence) become the steps' sub-layer switches and residual
    scales: 0 on o_proj switches attention off, 0 on down_proj the MLP, the same value on both
    scales the layer's residual updates. A scale the plan cannot express is refused, naming it."""
    obj = yaml.safe_load(text_or_obj) if isinstance(text_or_obj, str) else text_or_obj
    if not isinstance(obj, dict) or "slices" not in obj:
        raise PlanError("a mergekit config needs a top-level 'slices:' list")
    _known_keys(obj, MERGEKIT_KEYS, "the mergekit config")
    method = obj.get("merge_method", "passthrough")
    if method != "passthrough":
        raise PlanError(f"merge_method '{method}' blends weights; only 'passthrough' is a layer plan")
    steps: list[Step] = []
    labels: dict[str, str] = {}  # model path -> label: the first model is "", then b, c, ...
    for k, piece in enumerate(obj["slices"]):
        sources = piece.get("sources") if isinstance(piece, dict) else None
        if not isinstance(sources, list) or len(sources) != 1:
            raise PlanError(f"slice {k} must have exactly one source for a passthrough merge")
        _known_keys(piece, SLICE_KEYS, f"slice {k}")
        source = sources[0]
        if not isinstance(source, dict) or not isinstance(source.get("model"), str):
            raise PlanError(f"slice {k}: its source needs model: NAME and layer_range: [start, end)")
        _known_keys(source, SOURCE_KEYS, f"slice {k}'s source")
        name = source["model"]
        if name not in labels:
            labels[name] = "" if not labels else "bcdefghijklmnopqrstuvwxyz"[len(labels) - 1]
        rng = source.get("layer_range")
        if (not isinstance(rng, (list, tuple)) or len(rng) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in rng)):
            raise PlanError(f"slice {k}: layer_range must be [start, end), two whole layer numbers, got {rng!r}")
        start, end = rng
        if end <= start:
            raise PlanError(f"slice {k}: layer_range [{start}, {end}) is empty")
        if start < 0 or end > num_layers:
            bad = start if start < 0 else end - 1
            raise PlanError(f"slice {k}: " + out_of_range(bad, num_layers, model_name))
        attention, mlp, scale = _scale_filters(_parameter("scale", source, piece, obj), f"slice {k}")
        steps.extend(Step(i, attention, mlp, scale, labels[name]) for i in range(start, end))
    return LayerPlan(tuple(steps), num_layers, model_name=model_name)


# A Llama-style decoder layer's tensors, as mergekit's filters see them (a filter matches every
# tensor whose name contains it): only the output projections can be scaled by a plan.
_LAYER_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                  "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_SUB_LAYER_OUTPUTS = {"self_attn.o_proj.weight": "attention", "mlp.down_proj.weight": "mlp"}


# the keys of mergekit's configuration a passthrough layer plan reads or may ignore (the rest, and
# every other key, would change the merge: refused, naming it)
MERGEKIT_KEYS = ("slices", "merge_method", "dtype", "out_dtype", "base_model", "parameters", "tokenizer_source",
                 "tokenizer", "chat_template")
SLICE_KEYS = ("sources", "parameters", "base_model")
SOURCE_KEYS = ("model", "layer_range", "parameters")
PASSTHROUGH_PARAMETERS = ("scale",)  # the one parameter mergekit's passthrough method takes


def _known_keys(obj: dict, known: Sequence[str], where: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise PlanError(f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)}; a passthrough layer plan "
                        f"reads {', '.join(known)}")


def _parameter(name: str, source: dict, piece: dict, config: dict) -> list[Any]:
    """The settings of a parameter in mergekit's order: the source's, its slice's, the config's.
    For each tensor the first of them with an entry that matches it decides."""
    found = []
    for holder, where in ((source, "the source"), (piece, "the slice"), (config, "the config")):
        parameters = holder.get("parameters") if isinstance(holder, dict) else None
        if parameters is None:
            continue
        if not isinstance(parameters, dict):
            raise PlanError(f"{where}'s parameters must be a mapping like {{scale: ...}}, got {parameters!r}")
        other = sorted(str(k) for k in parameters if k not in PASSTHROUGH_PARAMETERS)
        if other:
            raise PlanError(f"parameter(s) {', '.join(repr(k) for k in other)} of {where}: a passthrough merge "
                            f"takes {', '.join(PASSTHROUGH_PARAMETERS)} only")
        if name in parameters:
            found.append(parameters[name])
    return found


def _scale_filters(settings: list[Any], where: str) -> tuple[bool, bool, float]:
    """(attention on, MLP on, residual scale) from a slice's `scale` settings. A setting is a
    number or a list of {filter, value} entries; the first entry whose filter a tensor name
    contains decides that tensor, and an entry without a filter matches every tensor."""
    values: dict[str, float] = {}  # tensor -> its scale, once an entry decided it
    for setting in settings:
        gradient = isinstance(setting, list) and all(isinstance(e, (int, float)) for e in setting)
        for entry in setting if isinstance(setting, list) and not gradient else [{"value": setting}]:
            if not isinstance(entry, dict) or "value" not in entry:
                raise PlanError(f"{where}: cannot read the scale entry {entry!r}: expected {{filter: NAME, value: NUMBER}}")
            label = f"filter '{entry['filter']}'" if entry.get("filter") else "the unfiltered scale"
            value = entry["value"]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlanError(f"{where}: {label} has value {value!r}; a layer plan takes one number per filter, "
                                "not a gradient")
            reach = [t for t in _LAYER_TENSORS if not entry.get("filter") or str(entry["filter"]) in t]
            matched = [t for t in reach if t not in values]  # the rest were decided by an earlier entry
            if float(value) != 1.0 and (not reach or any(t not in _SUB_LAYER_OUTPUTS for t in matched)):
                raise PlanError(f"{where}: cannot express {label} (scale {value}): a layer plan scales only the "
                                "output of attention (o_proj) and of the MLP (down_proj), each by 0 or both by one value")
            values.update((t, float(value)) for t in matched)
    attention = values.get("self_attn.o_proj.weight", 1.0)
    mlp = values.get("mlp.down_proj.weight", 1.0)
    if attention == 0.0 or mlp == 0.0 or attention == mlp:
        running = [v for v in (attention, mlp) if v != 0.0]
        return attention != 0.0, mlp != 0.0, running[0] if running else 1.0
    raise PlanError(f"{where}: o_proj is scaled by {attention} and down_proj by {mlp}; a layer plan has one "
                    "residual scale per step (0 on one of them switches that sub-layer off)")


# ----- files ------------------------------------------------------------------------------------
def load_plan(source: str | Path, num_layers: int, model_name: str = "the model") -> LayerPlan:
    """A plan from a string, or from a file: .json (layerplan, Draft & Verify, run_layers or
    layer_replication), .yaml (mergekit), or a text file holding a plan string. A file that cannot
    be read as a plan raises PlanError naming the file."""
    text = str(source)
    path = Path(text)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml", ".txt", ".plan"):
        return parse_plan(text, num_layers, model_name)
    if not path.is_file():
        raise PlanError(f"plan file not found: {path.resolve()}")
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"{path}: cannot read it as text ({_first_line(error)})") from None
    try:
        return plan_from_text(content, suffix, num_layers, model_name)
    except PlanError as error:
        raise PlanError(f"{path}: {error}") from None


def plan_from_text(content: str, suffix: str, num_layers: int, model_name: str = "the model") -> LayerPlan:
    """A plan from a file's text, read as its suffix says (see load_plan); PlanError for anything
    that is not a plan of that format."""
    if suffix in (".yaml", ".yml"):
        try:
            obj = yaml.safe_load(content)
        except yaml.YAMLError as error:
            raise PlanError(f"not valid YAML: {_first_line(error)}") from None
        except RecursionError:
            raise PlanError("not a mergekit file: nested deeper than a YAML reader follows") from None
        if not isinstance(obj, dict):  # (a string would be parsed again as YAML by from_mergekit)
            raise PlanError(f"a mergekit config needs a top-level 'slices:' list, not a {type(obj).__name__}")
        return _guarded(from_mergekit, obj, num_layers, model_name)
    if suffix == ".json":
        if not content.strip():
            raise PlanError("the file is empty; expected a JSON plan (see `layerplan plan --to json`)")
        try:
            obj = json.loads(content)
        except (json.JSONDecodeError, RecursionError) as error:
            raise PlanError(f"not valid JSON: {_first_line(error)}") from None
        if isinstance(obj, list):
            return _guarded(from_run_layers, obj, num_layers, model_name)
        if not isinstance(obj, dict):
            raise PlanError(f"expected a JSON object or a run_layers list, got {type(obj).__name__}")
        if obj.get("format") == "layerplan":
            return _guarded(from_json, obj, num_layers, model_name)
        if "layer_replication" in obj:
            if len(obj) > 1:
                other = sorted(str(k) for k in obj if k != "layer_replication")
                raise PlanError(f"unknown key(s) {', '.join(repr(k) for k in other)} beside layer_replication; "
                                "expected {\"layer_replication\": [[start, end), ...]}")
            return _guarded(from_layer_replication, obj["layer_replication"], num_layers, model_name)
        return _guarded(from_draft_verify, obj, num_layers, model_name)
    return parse_plan(content.strip(), num_layers, model_name)


def _guarded(reader: Callable[..., LayerPlan], obj: Any, num_layers: int, model_name: str) -> LayerPlan:
    """reader(obj, ...), with a malformed structure (a string where a list belongs, a missing
    key) reported as PlanError like every other bad plan."""
    try:
        return reader(obj, num_layers, model_name=model_name)
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError, yaml.YAMLError) as error:
        what = f"missing key {error}" if isinstance(error, KeyError) else _first_line(error)
        raise PlanError(f"not a {_READERS.get(reader, 'plan')} file: {what}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def save_plan(plan: LayerPlan, path: str | Path) -> Path:
    """Write a plan atomically: .yaml / .yml as mergekit slices, anything else as layerplan JSON."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        return write_text_atomic(path, to_mergekit(plan, plan.model_name))
    return write_text_atomic(path, json.dumps(to_json(plan), indent=2) + "\n")


_READERS = {from_mergekit: "mergekit", from_run_layers: "run_layers", from_json: "layerplan plan",
            from_layer_replication: "layer_replication", from_draft_verify: "Draft & Verify"}


# ----- the registry -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanFormat:
    name: str
    help: str
    dump: Callable[[LayerPlan, str], str]  # (plan, the model's name or path) -> text


FORMATS: dict[str, PlanFormat] = {f.name: f for f in (
    PlanFormat("string", "the plan string", lambda plan, model: plan.to_string()),
    PlanFormat("json", "layerplan's plan file", lambda plan, model: json.dumps(to_json(plan), indent=2)),
    PlanFormat("draft-verify", "Draft & Verify skip sets", lambda plan, model: json.dumps(to_draft_verify(plan))),
    PlanFormat("run-layers", "llama.cpp run_layers vector", lambda plan, model: json.dumps(to_run_layers(plan))),
    PlanFormat("mergekit", "mergekit passthrough slices (YAML)", lambda plan, model: to_mergekit(plan, model).rstrip()),
    PlanFormat("layer-replication", "PEFT layer_replication pairs",
               lambda plan, model: json.dumps(to_layer_replication(plan))),
)}


# ----- helpers ----------------------------------------------------------------------------------
def _require_model_order(plan: LayerPlan, what: str) -> None:
    if not plan.is_model_order:
        raise PlanError(f"{what} can only express the model's own layer order (each layer once, in order, "
                        f"at scale 1), not '{plan.to_string()}'")


def _require_whole_layers(plan: LayerPlan, what: str) -> None:
    if any(not (s.attention and s.mlp) or s.scale != 1.0 for s in plan.active_steps):
        raise PlanError(f"{what} can only express whole layers at scale 1, not '{plan.to_string()}'")


def _as_layer_index(value: Any, num_layers: int, model_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{value!r} is not a layer index ({model_name} has layers 0–{num_layers - 1})")
    if not 0 <= value < num_layers:
        raise PlanError(out_of_range(value, num_layers, model_name))
    return value


def _model_runs(steps: Sequence[Step]) -> list[tuple[str, list[Step]]]:
    """Consecutive steps grouped by model label."""
    runs: list[tuple[str, list[Step]]] = []
    for step in steps:
        if runs and runs[-1][0] == step.model:
            runs[-1][1].append(step)
        else:
            runs.append((step.model, [step]))
    return runs
