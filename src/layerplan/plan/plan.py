"""The layer plan value: which decoder layers run, in which order, with which sub-layers on.

A plan is frozen, validated data. It is parsed once (from a string, a file or another tool's
format, see formats.py) and everything downstream trusts it. The human string:
``"0-26,20-31"``, ``"skip:attn=3,5,6;mlp=6,9"``, ``"exit:8"``, combined with ``;``
(``"0-26,20-31;skip:attn=3;exit:20"``). Ranges are inclusive, order and repeats are kept. An
order item is ``A``, ``A-B`` (descending allowed), optionally ``*K`` (repeat K times),
``/attn``, ``/mlp`` or ``/none`` (which sub-layers run) and ``@S`` (residual scale).
Generated orders: ``pattern:recompute=8,rewind=4`` (8 layers, back 4, repeat) and
``frac:0.0-0.6,0.2-0.8,0.6-1.0`` (half-open slices as fractions of the depth).

A whole-layer skip keeps its step (both sub-layers off) so that step indices, which own the KV
cache slots, stay aligned between a plan and the drafts derived from it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace



class PlanError(ValueError):
    """A plan that cannot be parsed or does not fit the model; the message names the culprit."""


@dataclass(frozen=True)
class Step:
    """One pass through a decoder layer."""

    layer: int  # index of the model's decoder layer this step runs
    attention: bool = True  # run the attention sub-layer (False: its residual update is skipped)
    mlp: bool = True  # run the MLP sub-layer
    scale: float = 1.0  # multiplies each sub-layer's residual update (weighted repeats)
    model: str = ""  # which loaded model the layer comes from ("" = the primary one, "a")

    @property
    def active(self) -> bool:
        return self.attention or self.mlp


@dataclass(frozen=True)
class LayerPlan:
    """An ordered tuple of steps over a model of `num_layers` layers, plus an optional exit."""

    steps: tuple[Step, ...]
    num_layers: int  # depth of the model the plan was validated against
    exit: int | None = None  # run only the first `exit` steps, then the final norm and LM head
    # used in error messages only: plans that run the same steps are equal (and hash alike, so
    # memos keyed by plan hit) whichever name they were parsed with
    model_name: str = field(default="the model", compare=False)

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise PlanError(f"a model needs at least one layer, got num_layers={self.num_layers}")
        if not self.steps:
            raise PlanError("the plan is empty: it must run at least one layer")
        for step in self.steps:
            if not 0 <= step.layer < self.num_layers:
                raise PlanError(out_of_range(step.layer, self.num_layers, self.model_name))
            if not math.isfinite(step.scale):
                raise PlanError(f"layer {step.layer} has a non-finite residual scale {step.scale}")
        if self.exit is not None and not 1 <= self.exit <= len(self.steps):
            raise PlanError(
                f"exit:{self.exit} is out of range: the plan has {len(self.steps)} steps, "
                f"so exit must be 1–{len(self.steps)}"
            )
        if self.exit == len(self.steps):  # exiting after the last step is no exit: one plan, one value
            object.__setattr__(self, "exit", None)
        if not any(step.active and step.scale != 0 for step in self.active_steps):
            raise PlanError("the plan skips every sub-layer (or scales all of them by 0): at least one attention "
                            "or MLP must run")

    # ----- constructors -------------------------------------------------------------------
    @classmethod
    def full(cls, num_layers: int, model_name: str = "the model") -> LayerPlan:
        return cls(tuple(Step(i) for i in range(num_layers)), num_layers, model_name=model_name)

    @classmethod
    def from_skips(
        cls,
        num_layers: int,
        attention: Iterable[int] = (),
        mlp: Iterable[int] = (),
        layers: Iterable[int] = (),
        exit: int | None = None,
        model_name: str = "the model",
    ) -> LayerPlan:
        """The model's own order with the given layers / sub-layers skipped."""
        return LayerPlan.full(num_layers, model_name).with_skips(attention, mlp, layers, exit)

    # ----- views --------------------------------------------------------------------------
    @property
    def active_steps(self) -> tuple[Step, ...]:
        return self.steps if self.exit is None else self.steps[: self.exit]

    @property
    def is_identity(self) -> bool:
        return self == LayerPlan.full(self.num_layers, self.model_name)

    @property
    def is_model_order(self) -> bool:
        """Steps are layers 0..n-1 once each at scale 1 (sub-layers may be off)."""
        return len(self.steps) == self.num_layers and all(
            s.layer == i and s.scale == 1.0 and not s.model for i, s in enumerate(self.steps)
        )

    @property
    def models(self) -> tuple[str, ...]:
        """Labels of the extra models the plan's steps use ("" = the primary model only)."""
        return tuple(sorted({s.model for s in self.steps if s.model}))

    @property
    def cost(self) -> float:
        """Fraction of the full model's sub-layers this plan runs (a crude compute estimate)."""
        ran = sum(int(s.attention) + int(s.mlp) for s in self.active_steps)
        return ran / (2 * self.num_layers)

    def skipped(self) -> dict[str, list[int]]:
        """Skipped sub-layers by layer index (model-order plans only), exits counted as skips."""
        if not self.is_model_order:
            raise PlanError(f"skip sets need the model's own layer order, not '{self.to_string()}'")
        limit = len(self.active_steps)
        return {
            "attention": [i for i, s in enumerate(self.steps) if i >= limit or not s.attention],
            "mlp": [i for i, s in enumerate(self.steps) if i >= limit or not s.mlp],
        }

    def with_skips(
        self,
        attention: Iterable[int] = (),
        mlp: Iterable[int] = (),
        layers: Iterable[int] = (),
        exit: int | None = None,
    ) -> LayerPlan:
        """Switch off sub-layers in every step that runs the named layers."""
        attention, mlp, layers = set(attention), set(mlp), set(layers)
        present = {s.layer for s in self.steps}
        for idx in sorted(attention | mlp | layers):
            if not 0 <= idx < self.num_layers:
                raise PlanError(out_of_range(idx, self.num_layers, self.model_name))
            if idx not in present:
                raise PlanError(f"layer {idx} is skipped but the plan never runs it")
        steps = tuple(
            replace(
                s,
                attention=s.attention and s.layer not in attention | layers,
                mlp=s.mlp and s.layer not in mlp | layers,
            )
            for s in self.steps
        )
        return replace(self, steps=steps, exit=self.exit if exit is None else exit)

    def with_step(self, index: int, attention: bool | None = None, mlp: bool | None = None) -> LayerPlan:
        """The plan with step `index`'s sub-layers switched as given (None keeps them)."""
        step = self.steps[index]
        changed = replace(
            step,
            attention=step.attention if attention is None else attention,
            mlp=step.mlp if mlp is None else mlp,
        )
        return replace(self, steps=self.steps[:index] + (changed,) + self.steps[index + 1 :])

    def with_exit(self, exit: int | None) -> LayerPlan:
        return replace(self, exit=exit)

    def is_draft_of(self, target: LayerPlan) -> bool:
        """True when this plan runs a subset of `target`'s sub-layers with the same step indices,
        so both can share one KV cache (a step's slot holds the same layer's keys). Steps after the
        target's exit do not count: the target never fills their slots."""
        if len(self.active_steps) > len(target.active_steps):
            return False
        return all(
            d.layer == t.layer and d.model == t.model and d.scale == t.scale
            and d.attention <= t.attention and d.mlp <= t.mlp
            for d, t in zip(self.active_steps, target.active_steps)
        )

    # ----- the human string ---------------------------------------------------------------
    def to_string(self) -> str:
        clauses: list[str] = []
        if self.is_model_order:
            off = [s.layer for s in self.steps if not s.active]
            attn = [s.layer for s in self.steps if s.mlp and not s.attention]
            mlp = [s.layer for s in self.steps if s.attention and not s.mlp]
            parts = []
            if off:
                parts.append("layers=" + _compress(off))
            if attn:
                parts.append("attn=" + _compress(attn))
            if mlp:
                parts.append("mlp=" + _compress(mlp))
            clauses.append("skip:" + ";".join(parts) if parts else "full")
        else:
            clauses.append(",".join(_order_items(self.steps)))
        if self.exit is not None:
            clauses.append(f"exit:{self.exit}")
        return ";".join(clauses)

    def __str__(self) -> str:
        return self.to_string()


# ----- parsing ------------------------------------------------------------------------------
_ITEM = re.compile(
    r"^(?:(?P<m>[a-z][a-z0-9_]*):)?(?P<a>\d+)(?:-(?P<b>\d+))?(?:\*(?P<k>\d+))?(?:/(?P<sub>attn|attention|mlp|none))?(?:@(?P<s>[-+]?[0-9.]+(?:e[-+]?\d+)?))?$"
)
MAX_STEPS = 100_000  # a plan longer than this is a typo ('0*1000000'), not a model
_KEYWORDS = ("exit", "layers", "order", "skip", "frac", "pattern")
_SKIP_KINDS = {"attn": "attention", "attention": "attention", "mlp": "mlp", "ffn": "mlp", "layers": "layers", "layer": "layers"}


def check_attached(plan: LayerPlan, others: Sequence[str] = ()) -> None:
    """PlanError where the plan takes layers from a model not attached: `others`, the labels of the
    models beside the first ("a")."""
    missing = [label for label in plan.models if label not in others]
    if missing:
        loaded = ", ".join(["a"] + sorted(others))
        raise PlanError(f"the plan takes layers from model(s) {', '.join(missing)}, but only {loaded} "
                        f"{'is' if not others else 'are'} loaded (attach them, e.g. --model-b PATH)")


def parse_plan(text: str, num_layers: int, model_name: str = "the model") -> LayerPlan:
    """Parse the human plan string (see the module docstring) against a model depth."""
    if num_layers > MAX_STEPS:  # (a full plan of it would be a list of that many steps)
        raise PlanError(f"a model of {num_layers} layers: plans are made for models of at most {MAX_STEPS} layers")
    if not isinstance(text, str) or not text.strip():
        raise PlanError("the plan is empty: give layers like '0-26,20-31', 'skip:attn=3,5' or 'exit:8'")
    odd = next((ch for ch in text if not ch.isascii() or (not ch.isprintable() and ch not in " \t\r\n")), None)
    if odd is not None:  # '８' or '٣' would read as digits: plans take ASCII only
        raise PlanError(f"plan {text.strip()[:60]!r} has the character {odd!r} (U+{ord(odd):04X}): plans are "
                        "written in ASCII (digits 0-9, letters, ':;,=-*/@.')")
    steps: list[Step] | None = None
    skips: dict[str, list[int]] = {"attention": [], "mlp": [], "layers": []}
    exit: int | None = None
    in_skip = False
    for raw in text.split(";"):
        clause = raw.strip()
        if not clause:
            raise PlanError(f"empty clause in plan '{text}' (two ';' in a row?)")
        keyword, sep, body = clause.partition(":")
        keyword = keyword.strip().lower()
        if clause.lower() in ("full", "all", "identity"):
            steps = _set_order(steps, [Step(i) for i in range(num_layers)], clause)
            in_skip = False
        elif sep and keyword == "exit":
            if exit is not None:
                raise PlanError(f"the plan gives an exit twice (exit:{exit}, then '{clause}'); keep one")
            exit = _parse_int(body.strip(), clause, "an exit step count like exit:8")
            in_skip = False
        elif sep and keyword in ("layers", "order"):
            steps = _set_order(steps, _parse_order(body, num_layers, model_name), clause)
            in_skip = False
        elif sep and keyword == "frac":
            steps = _set_order(steps, [Step(i) for i in fractional_layers(body, num_layers)], clause)
            in_skip = False
        elif sep and keyword == "pattern":
            steps = _set_order(steps, [Step(i) for i in _parse_pattern(body, num_layers)], clause)
            in_skip = False
        elif sep and keyword == "skip":
            _parse_skip_part(body, skips, num_layers, model_name)
            in_skip = True
        elif in_skip and not sep:
            _parse_skip_part(clause, skips, num_layers, model_name)
        elif clause[:1].isdigit() or (sep and keyword not in _KEYWORDS and re.fullmatch(r"[a-z][a-z0-9_]*", keyword)):
            steps = _set_order(steps, _parse_order(clause, num_layers, model_name), clause)
            in_skip = False
        else:
            raise PlanError(
                f"cannot read '{clause}' in plan '{text}': expected layers (0-26,20-31), "
                f"skip:attn=...;mlp=..., or exit:N ({model_name} has layers 0–{num_layers - 1})"
            )
    base = LayerPlan(tuple(steps) if steps else tuple(Step(i) for i in range(num_layers)), num_layers, model_name=model_name)
    return base.with_skips(skips["attention"], skips["mlp"], skips["layers"], exit)


def _set_order(current: list[Step] | None, new: list[Step], clause: str) -> list[Step]:
    if current is not None:
        raise PlanError(f"the plan gives a layer order twice (second: '{clause}'); join them with commas")
    return new


def _parse_order(body: str, num_layers: int, model_name: str) -> list[Step]:
    steps: list[Step] = []
    label = ""  # a model prefix ("b:8-23") holds for the following items until the next prefix
    for token in body.split(","):
        item = token.strip()
        m = _ITEM.match(item.lower())
        if not m:
            raise PlanError(
                f"cannot read '{item}' as a layer item: expected N, A-B, with optional *K, /attn, /mlp, "
                f"/none, @scale ({model_name} has layers 0–{num_layers - 1})"
            )
        a = _layer_number(m["a"], item, num_layers, model_name)
        b = _layer_number(m["b"], item, num_layers, model_name) if m["b"] is not None else a
        for idx in (a, b):
            if idx >= num_layers:
                raise PlanError(f"'{item}': " + out_of_range(idx, num_layers, model_name))
        repeat = _count(m["k"], item) if m["k"] is not None else 1
        if repeat < 1:
            raise PlanError(f"'{item}': a repeat count must be at least 1")
        sub = m["sub"]
        attention = sub in (None, "attn", "attention")
        mlp = sub in (None, "mlp")
        scale = 1.0
        if m["s"] is not None:
            try:
                scale = float(m["s"])
            except ValueError:
                raise PlanError(f"'{item}': cannot read the residual scale '{m['s']}'") from None
        if m["m"] is not None:
            label = "" if m["m"] == "a" else m["m"]
        layers = range(a, b + 1) if a <= b else range(a, b - 1, -1)
        if len(steps) + repeat * len(layers) > MAX_STEPS:
            raise PlanError(f"'{item}': the plan would run more than {MAX_STEPS} steps")
        for idx in layers:
            steps.extend(Step(idx, attention, mlp, scale, label) for _ in range(repeat))
    return steps


def recompute_rewind_layers(num_layers: int, recompute: int, rewind: int) -> list[int]:
    """The common merge shape: run `recompute` layers, step back `rewind`, repeat to the end.
    (8, 4) on 16 layers: 0-7, 4-11, 8-15."""
    if recompute < 1 or not 0 <= rewind < recompute:
        raise PlanError(f"pattern needs recompute >= 1 and 0 <= rewind < recompute, got {recompute}, {rewind}")
    layers: list[int] = []
    start = 0
    while True:
        end = min(start + recompute, num_layers)
        layers.extend(range(start, end))
        if end == num_layers:
            return layers
        start = end - rewind


def fractional_layers(body: str, num_layers: int) -> list[int]:
    """"0.0-0.6,0.2-0.8,0.6-1.0": half-open slices given as fractions of the depth."""
    layers: list[int] = []
    for token in body.split(","):
        item = token.strip()
        m = re.fullmatch(r"([01](?:\.\d+)?)-([01](?:\.\d+)?)", item)
        if not m or not 0.0 <= float(m[1]) < float(m[2]) <= 1.0:
            raise PlanError(f"cannot read '{item}' in frac:{body}: expected fractions A-B with 0 <= A < B <= 1")
        start, end = round(float(m[1]) * num_layers), round(float(m[2]) * num_layers)
        if end <= start:
            raise PlanError(f"'{item}' covers no layer of a {num_layers}-layer model")
        layers.extend(range(start, end))
    return layers


def _parse_pattern(body: str, num_layers: int) -> list[int]:
    values: dict[str, int] = {}
    for token in body.split(","):
        key, sep, value = token.strip().partition("=")
        if not sep or key not in ("recompute", "rewind") or not re.fullmatch(r"\d+", value.strip()):
            raise PlanError(f"cannot read '{token.strip()}' in pattern:{body}: expected recompute=N,rewind=M")
        values[key] = _count(value.strip(), token.strip())
    if "recompute" not in values:
        raise PlanError(f"pattern:{body} needs recompute=N (and rewind=M)")
    return recompute_rewind_layers(num_layers, values["recompute"], values.get("rewind", 0))


def _parse_skip_part(body: str, skips: dict[str, list[int]], num_layers: int, model_name: str) -> None:
    kind_name, sep, values = body.partition("=")
    if sep:
        kind = _SKIP_KINDS.get(kind_name.strip().lower())
        if kind is None:
            raise PlanError(f"unknown skip kind '{kind_name.strip()}': use attn=, mlp= or layers=")
    else:
        kind, values = "layers", kind_name
    for token in values.split(","):
        item = token.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise PlanError(
                f"cannot read '{item}' in skip:{body}: expected layer numbers or ranges like 3,5-7 "
                f"({model_name} has layers 0–{num_layers - 1})"
            )
        a = _layer_number(m[1], item, num_layers, model_name)
        b = _layer_number(m[2], item, num_layers, model_name) if m[2] is not None else a
        for idx in (a, b):
            if idx >= num_layers:
                raise PlanError(f"'{item}' in skip: " + out_of_range(idx, num_layers, model_name))
        skips[kind].extend(range(min(a, b), max(a, b) + 1))


def _parse_int(value: str, clause: str, expected: str) -> int:
    if not re.fullmatch(r"\d+", value):
        raise PlanError(f"cannot read '{clause}': expected {expected}")
    return _count(value, clause)


_DIGITS = 18  # no layer index, repeat or exit count has more digits; int() of 10,000 digits is Python's own error


def _count(digits: str, item: str) -> int:
    """A count or step number written in ASCII digits; PlanError for one too long to be meant."""
    if len(digits) > _DIGITS:
        raise PlanError(f"'{_short(item)}': the number {digits[:12]}… has {len(digits)} digits; plans count steps "
                        f"and layers in at most {_DIGITS} digits")
    return int(digits)


def _short(text: str, keep: int = 40) -> str:
    return text if len(text) <= keep else f"{text[:keep - 12]}…{text[-8:]}"


def _layer_number(digits: str, item: str, num_layers: int, model_name: str) -> int:
    """A layer index written in ASCII digits; one too long to be meant is out of range, said once."""
    if len(digits) > _DIGITS:
        raise PlanError(f"'{_short(item)}': layer {digits[:12]}… ({len(digits)} digits) is out of range: {model_name} "
                        f"has layers 0–{num_layers - 1}")
    return int(digits)


def out_of_range(idx: int, num_layers: int, model_name: str) -> str:
    return f"layer {idx} is out of range: {model_name} has layers 0–{num_layers - 1}"


def ascending_runs(layers: Sequence[int]) -> list[tuple[int, int]]:
    """[0,1,2,5,6,3] -> [(0,2),(5,6),(3,3)]: maximal runs of consecutive ascending layers."""
    runs: list[tuple[int, int]] = []
    for idx in layers:
        if runs and idx == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], idx)
        else:
            runs.append((idx, idx))
    return runs


def _compress(layers: Sequence[int]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ascending_runs(sorted(set(layers))))


def _order_items(steps: Sequence[Step]) -> list[str]:
    """Steps as order items, joining ascending runs of steps that share flags and scale."""
    items: list[str] = []
    run: list[Step] = []
    multi = any(s.model for s in steps)
    current = [None]  # the model label of the last item written

    def flush() -> None:
        if not run:
            return
        first, last = run[0], run[-1]
        text = str(first.layer) if len(run) == 1 else f"{first.layer}-{last.layer}"
        if multi and first.model != current[0]:
            text = f"{first.model or 'a'}:{text}"
            current[0] = first.model
        if not (first.attention and first.mlp):
            text += "/attn" if first.attention else "/mlp" if first.mlp else "/none"
        if first.scale != 1.0:
            text += f"@{first.scale!r}"
        items.append(text)
        run.clear()

    for step in steps:
        if run and (
            step.layer == run[-1].layer + 1
            and (step.attention, step.mlp, step.scale, step.model)
            == (run[-1].attention, run[-1].mlp, run[-1].scale, run[-1].model)
        ):
            run.append(step)
        else:
            flush()
            run.append(step)
    flush()
    return items
