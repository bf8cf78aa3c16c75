"""Drafters by name: one table from a spec string to a factory (`make_drafter`).

"ngram", "exit:8", "skip:attn=3,5", "window:4,64", "exit:20+head", "exit:20+head+vocab=8192",
"dynamic:confidence=0.8,min=12", "model:PATH", "ngram|exit:8" (the first that proposes), "suffix:corpus=FILE", "auto".
A drafter kind is one row of kinds.py's DRAFTERS (its syntax and help: the CLI's --draft help
is generated from them, without torch) and its builder here, registered under the same keyword.

The table builds the drafters of both front ends: the light front end's (kinds.py
drafts_on_the_light_front_end: lookups, the target's own sub-plans and exits, auto over them, on a
LiteModel) and the torch front end's. So nothing torch-bound is imported at the top: a builder of
a kind that runs torch modules (exit heads, reduced heads, dynamic exits, other or re-quantized
models, online skips) imports them where it builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from layerplan.decoding.drafters.arbiter import Arbiter
from layerplan.decoding.drafters.base import AutoregressiveDrafter
from layerplan.decoding.drafters.kinds import DRAFTERS, PLAN, PLAN_KEYWORD
from layerplan.decoding.drafters.ngram import NgramDrafter
from layerplan.decoding.drafters.plan import Head, PlanDrafter, WindowedDrafter
from layerplan.decoding.drafters.proposal import Drafter
from layerplan.decoding.drafters.saved import saved_draft_path
from layerplan.decoding.drafters.staged import StagedDrafter
from layerplan.decoding.drafters.suffix import SuffixDrafter, read_corpus
from layerplan.engine.choices import QUANTIZE_AT_LOAD, STORED_ARITHMETIC
from layerplan.models.errors import ModelError
from layerplan.plan.plan import LayerPlan, parse_plan


@dataclass(frozen=True)
class Context:
    """What a factory builds with."""

    model: Any  # the target's: models/loading.py LoadedModel, or lite/model.py LiteModel
    target: LayerPlan
    min_confidence: float = 0.0
    head: Head | None = None  # +vocab=K: a reduced LM head for a layer-plan draft
    # k -> cost of a k-token verify pass in steps on this machine (engine/probe.py); empty: learned
    pass_costs: dict[int, float] = field(default_factory=dict)
    # the spec came from a client of this machine (a server's request): it may name no file here
    # (a plan, corpus or head file) and load no other model (the server keeps one model in memory)
    remote: bool = False
    # load_draft(path): a draft model (model:PATH) and its passes, as the target's front end runs
    # it (lite/model.py LiteModel.load_draft); None: the torch front end's (_loaded_draft)
    load_draft: Callable[[str], tuple[Any, Any]] | None = None

    def plan(self, text: str) -> LayerPlan:
        """A plan for the model: a plan string, or (not remote) a plan file."""
        if not self.remote:
            return self.model.plan(text)
        plan = parse_plan(text, self.model.num_layers, self.model.name)
        self.model.check_plan(plan)
        return plan

    def local_only(self, text: str, what: str) -> None:
        """Refuse a remote spec that would `what` (read a file, load a model) on this machine."""
        if self.remote:
            raise ValueError(f"draft '{text}' would {what} on the server: a request may not; start the server "
                             f"with --draft {text} instead")


Builder = Callable[[str | None, str, Context], Drafter]  # (text after "keyword:" or None, whole spec, context)
# a kind's keyword (kinds.py DRAFTERS; PLAN_KEYWORD for a plan) -> what builds its drafters
BUILDERS: dict[str, Builder] = {}


def builds(keyword: str) -> Callable[[Builder], Builder]:
    """Register the decorated function as the builder of the drafter kind `keyword`."""
    def register(build: Builder) -> Builder:
        BUILDERS[keyword] = build
        return build
    return register


def is_number(text: str, integer: bool) -> bool:
    try:
        int(text) if integer else float(text)
    except ValueError:
        return False
    return True


@builds("ngram")
def _ngram(arg: str | None, text: str, ctx: Context) -> Drafter:
    if arg is None:
        return NgramDrafter()
    if not arg.isdigit():
        raise ValueError(f"cannot read '{text}': expected ngram or ngram:N with N the longest n-gram")
    return NgramDrafter(max_n=int(arg))


@builds("suffix")
def _suffix(arg: str | None, text: str, ctx: Context) -> Drafter:
    options: dict = {}
    corpus: list[list[int]] = []
    for item in arg.split(",") if arg else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if key == "corpus" and value:
            ctx.local_only(text, "read a corpus file")
            encode = ctx.model.encode_text if ctx.model.tokenizer is not None else None
            corpus.append(read_corpus(value, encode, ctx.model.name))
        elif key in ("max", "share") and is_number(value, integer=key == "max"):
            options["max_tokens" if key == "max" else "min_share"] = int(value) if key == "max" else float(value)
        elif key in ("learn", "tree") and not eq:
            options[key] = True
        else:
            raise ValueError(f"cannot read '{item}' in '{text}': expected suffix or "
                             "suffix:corpus=FILE,max=N,share=P,learn,tree")
    return SuffixDrafter(corpus, name=text, **options)


def drafts_by_lookup(drafter: Drafter) -> bool:
    """A drafter that looks its drafts up and runs no model (n-gram, suffix): cheap to make for each
    request, so a server gives every request of a batch its own (decoding/batch.py)."""
    return isinstance(drafter, (NgramDrafter, SuffixDrafter))


@builds(PLAN_KEYWORD)
def _plan(arg: str | None, text: str, ctx: Context) -> Drafter:
    return PlanDrafter(ctx.plan(text), ctx.min_confidence, ctx.head)


@builds("exit")
def _exit(arg: str | None, text: str, ctx: Context) -> Drafter:
    exit_text, with_head, path = (arg or "").partition("+head")
    if with_head:
        from layerplan.decoding.drafters.heads import ExitHeadDrafter, default_head_path, load_head

        if not exit_text.isdigit():
            raise ValueError(f"cannot read '{text}': expected exit:E+head or exit:E+head=PATH")
        exit = int(exit_text)
        if path:
            ctx.local_only(text, "read a head file")
        exit_head = load_head(path[1:] if path.startswith("=") else default_head_path(ctx.model, exit), ctx.model)
        if exit_head.exit and exit_head.exit != exit:
            raise ValueError(f"the exit head was trained for exit:{exit_head.exit}, not exit:{exit}")
        return ExitHeadDrafter(ctx.target.with_exit(exit), exit_head, ctx.min_confidence, ctx.head)
    if exit_text.isdigit():  # an exit within the target plan
        return PlanDrafter(ctx.target.with_exit(int(exit_text)), ctx.min_confidence, ctx.head)
    return _plan(arg, text, ctx)  # a plan string that starts with its exit ("exit:8;skip:attn=3")


@builds("window")
def _window(arg: str | None, text: str, ctx: Context) -> Drafter:
    window, _, rest = (arg or "").partition("/")
    sizes = window.split(",")
    if len(sizes) != 2 or not all(v.strip().isdigit() for v in sizes):
        raise ValueError(f"cannot read '{text}': expected window:SINK,RECENT (e.g. window:4,64), "
                         "optionally /PLAN for a cheaper draft plan")
    plan = ctx.plan(rest) if rest else ctx.target
    return WindowedDrafter(plan, int(sizes[0]), int(sizes[1]), ctx.min_confidence, ctx.head)


@builds("dynamic")
def _dynamic(arg: str | None, text: str, ctx: Context) -> Drafter:
    from layerplan.decoding.drafters.dynamic_exit import DynamicExitDrafter, ExitPolicy

    return DynamicExitDrafter(ctx.model, ctx.target, ExitPolicy.parse(arg or ""), ctx.min_confidence)


@builds("model")
def _model(arg: str | None, text: str, ctx: Context) -> Drafter:
    if not arg:
        raise ValueError(f"cannot read '{text}': expected model:PATH")
    ctx.local_only(text, "load a second model")
    from layerplan.decoding.drafters.model import ModelDrafter

    model, passes = ctx.load_draft(arg) if ctx.load_draft is not None else _loaded_draft(arg, ctx.model)
    return ModelDrafter(model, passes, ctx.min_confidence)


def _loaded_draft(path: str, target) -> tuple[Any, Any]:
    """A draft model on the torch front end, and its passes: a GGUF in the target's arithmetic
    where the target runs stored weights (its blocks as stored, never dequantized whole), else at
    the target's dtype."""
    from layerplan.engine.load import load_model
    from layerplan.engine.runner import ModelPasses
    from layerplan.models.gguf_place import gguf_of

    stored = target.precision in STORED_ARITHMETIC and gguf_of(path) is not None
    model = load_model(path, dtype=target.precision if stored else target.dtype, device=target.device)
    return model, ModelPasses(model)


# quantized copies of a model kept for its `self:bits=` drafts, at most this many precisions, on the
# model itself (LoadedModel.derived: they go when it goes): a copy quantizes the whole model at load
# (seconds), and every decode builds its drafter anew
QUANTIZED_COPIES_KEPT = 2


def _quantized_copy(model, precision: str):
    """A LoadedModel's copy at `precision`, kept on it."""
    from layerplan.engine.load import load_model
    from layerplan.engine.native import BoundedCache

    copies = model.derived.setdefault("quantized copies", BoundedCache(QUANTIZED_COPIES_KEPT))
    copy = copies.get(precision)
    if copy is None:
        copy = copies[precision] = load_model(model.source, dtype=precision)
    return copy


@builds("self")
def _self(arg: str | None, text: str, ctx: Context) -> Drafter:
    spec, _, rest = (arg or "").partition("/")
    key, _, bits = spec.partition("=")
    bits = bits.strip().lower()
    if key.strip() != "bits" or bits.removesuffix("-fast") not in QUANTIZE_AT_LOAD:
        raise ValueError(f"cannot read '{text}': expected self:bits=FORMAT[/PLAN] with FORMAT one of "
                         f"{', '.join(QUANTIZE_AT_LOAD)} (e.g. self:bits=q4_0, self:bits=q3_k/exit:20)")
    ctx.local_only(text, "load a quantized copy of the model")
    if ctx.model.device.type != "cpu":
        raise ValueError(f"'{text}' quantizes the model again on the CPU: this model's weights are on "
                         f"{ctx.model.device}")
    # the copy's products in integer arithmetic where the format has them: a draft need not be exact
    try:
        copy = _quantized_copy(ctx.model, bits if bits.endswith("-fast") else f"{bits}-fast")
    except ModelError as error:
        raise ValueError(f"'{text}' quantizes the model again from its file: {error}") from None
    from layerplan.decoding.drafters.model import ModelDrafter
    from layerplan.engine.runner import ModelPasses

    return ModelDrafter(copy, ModelPasses(copy), ctx.min_confidence, plan=copy.plan(rest) if rest else None,
                        name=text)


@builds("online")
def _online(arg: str | None, text: str, ctx: Context) -> Drafter:
    options: dict = {}
    for item in arg.split(",") if arg else []:
        key, _, value = (part.strip() for part in item.partition("="))
        if key in ("every", "calibration") and value.isdigit():
            options[key] = int(value)
        elif key == "start" and is_number(value, integer=False):
            options[key] = float(value)
        else:
            raise ValueError(f"cannot read '{item}' in '{text}': expected online or "
                             "online:every=R,calibration=T,start=F")
    from layerplan.decoding.drafters.online import OnlineSkipDrafter

    return OnlineSkipDrafter(ctx.target, ctx.min_confidence, **options)


@builds("auto")
def _auto(arg: str | None, text: str, ctx: Context) -> Drafter:
    if arg is not None:
        raise ValueError(f"cannot read '{text}': auto takes no argument")
    saved = saved_draft_path(ctx.model)
    models = [_build(str(saved), ctx)] if saved.exists() else []
    return Arbiter([SuffixDrafter(), NgramDrafter()], models, ctx.pass_costs)


if BUILDERS.keys() != {*DRAFTERS, PLAN_KEYWORD}:  # (kinds.py's rows and the builders here go together)
    raise ImportError(f"drafter kinds without a builder or builders of no kind: "
                      f"{sorted(BUILDERS.keys() ^ {*DRAFTERS, PLAN_KEYWORD})}")


def make_drafter(spec: str | Drafter, model, target: LayerPlan | None = None,
                 min_confidence: float = 0.0, pass_costs: dict[int, float] | None = None,
                 remote: bool = False, load_draft: Callable[[str], tuple[Any, Any]] | None = None) -> Drafter:
    """A drafter from its spec (see DRAFTERS) or a ready-made one, checked against the model and
    the target plan before anything runs. pass_costs: k -> a k-token verify pass in steps on this
    machine (engine/probe.py), for the drafters that weigh proposals by cost (auto). remote: the
    spec came from a server's client, and may name no file on this machine nor load another model
    (ValueError). load_draft: see Context."""
    target = target if target is not None else model.plan()
    context = Context(model, target, min_confidence, pass_costs=dict(pass_costs or {}), remote=remote,
                      load_draft=load_draft)
    drafter = _build(spec, context) if isinstance(spec, str) else spec
    drafter.check(model, target)
    return drafter


def _build(spec: str, ctx: Context) -> Drafter:
    parts = [p.strip() for p in spec.split("|")]
    if len(parts) > 1:
        return StagedDrafter([_build(p, ctx) for p in parts])
    text, size, branch = parts[0], None, None
    if "+branch=" in text:  # greedy self-drafts: the runner-up joins the round where the draft is unsure
        text, _, branch_text = text.rpartition("+branch=")
        if not is_number(branch_text, integer=False) or not 0 < float(branch_text) < 1:
            raise ValueError(f"cannot read '{spec}': expected DRAFT+branch=P with P a probability in (0, 1), "
                             "e.g. skip:attn=5-8+branch=0.6")
        branch = float(branch_text)
    if "+vocab=" in text:  # a self-draft whose LM head scores only the K most frequent tokens
        text, _, size = text.rpartition("+vocab=")
        if not size.isdigit():
            raise ValueError(f"cannot read '{spec}': expected DRAFT+vocab=K with K a token count, "
                             "e.g. exit:24+head+vocab=8192")
    keyword, sep, arg = text.partition(":")
    kind = DRAFTERS.get(keyword)
    if kind is None:  # a plan string or file ("skip:attn=3,5", "0-20")
        keyword, kind = PLAN_KEYWORD, PLAN
    if size is not None:
        if not kind.takes_head:
            raise ValueError(f"+vocab=K applies to layer-plan drafts (exit:E, exit:E+head, skip:...), not '{text}'")
        from layerplan.decoding.drafters.heads import reduced_head

        ctx = replace(ctx, head=reduced_head(ctx.model, int(size)))
    drafter = BUILDERS[keyword](arg if sep else None, text, ctx)
    if branch is not None:
        if not isinstance(drafter, AutoregressiveDrafter):
            raise ValueError(f"+branch=P applies to drafts that run a model token by token (exit:E, skip:..., "
                             f"model:PATH), not '{text}'")
        drafter.branch_below = branch
        drafter.name += f"+branch={branch_text}"
    return drafter
