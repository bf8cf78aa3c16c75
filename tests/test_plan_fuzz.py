"""Property-based fuzzing of the plan grammar and the plan file formats (seeded: the same inputs
every run; a few thousand in `make test`, over 10,000 in `make fuzz`, see fuzzing.py). Every input
either parses into a valid plan that round-trips through every format that can express it, or
raises PlanError with a message that names the problem (the command line prints it as one line);
nothing else."""

import json

import yaml
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings

from layerplan.plan.formats import FORMATS, plan_from_text
from layerplan.plan.plan import LayerPlan, PlanError, parse_plan

# the suffix each format's text is read back with (layer_replication travels inside an object)
SUFFIXES = {"string": ".plan", "json": ".json", "draft-verify": ".json", "run-layers": ".json",
            "mergekit": ".yaml", "layer-replication": ".json"}


EXACT = {"string", "json"}  # layerplan's own formats keep everything; the others keep what a plan runs


def _effect(plan: LayerPlan) -> tuple:
    """What a plan computes: the sub-layers it runs, in order (an exit and a skip of the layers
    after it compute the same thing, as do a step at scale 0 and a skipped one; formats without
    exits or zero scales write the second)."""
    return tuple((s.layer, s.attention, s.mlp, s.scale, s.model) for s in plan.active_steps
                 if s.active and s.scale != 0)


def _round_trips(plan: LayerPlan, num_layers: int) -> None:
    assert isinstance(plan, LayerPlan) and plan.num_layers == num_layers and plan.active_steps
    assert parse_plan(plan.to_string(), num_layers) == plan
    for name, fmt in FORMATS.items():
        try:
            text = fmt.dump(plan, "org/model")
        except PlanError as error:  # a format that cannot express this plan says so
            assert str(error).strip()
            continue
        if name == "layer-replication":
            text = json.dumps({"layer_replication": json.loads(text)})
        again = plan_from_text(text, SUFFIXES[name], num_layers)
        assert (again == plan) if name in EXACT else (_effect(again) == _effect(plan)), (name, text)


def _parses_or_says_why(read, num_layers: int) -> None:
    try:
        plan = read()
    except PlanError as error:
        message = str(error)
        assert message.strip(), "a PlanError without a message"
        assert "Exceeds the limit" not in message, message  # Python's int-conversion text is no answer
        return
    _round_trips(plan, num_layers)


# ----- the plan grammar ---------------------------------------------------------------------------
# A plan string is built from a list of integers, each choosing the next token: one cheap draw per
# input (composite strategies spend most of the run generating), and shrinking still works.
NUMBERS = [str(i) for i in range(12)] * 3 + [str(i) for i in range(12, 44)] + [
    "", "-1", "00", "1e3", "99999999999999999999", "\uff18", "\u0663", "3.5", " 2 ", "7" * 5000]
SUBS = ["", "", "", "", "/attn", "/mlp", "/none", "/attention", "/ffn", "/"]
SCALES = ["", "", "", "", "@0.5", "@1", "@0", "@-1", "@1e999", "@nan", "@.", "@2.", "@1e-3", "@+0.25"]
LABELS = [""] * 9 + ["b:", "a:", "zz:", "1:"]
REPEATS = [""] * 6 + ["*2", "*0", "*3", "*", "*100000000"]
SKIP_KINDS = ["attn=", "mlp=", "layers=", "ffn=", "", "bogus="]
FIXED = ["full", "all", "identity", "FULL", "frac:0-0.5", "frac:0.2-0.8,0.5-1", "frac:1-0", "order:", "",
         "pattern:recompute=4,rewind=2", "pattern:recompute=2", "pattern:rewind=1"]
NOISE = ["\uff18", "\u0663", "\x00", "\u00e9", " ", ",", ";", ":", "-", "*", "@", "=", "/", "x", "\t", "\n",
         "1e5", "\u200b", "exit", "skip"]
SEPARATORS = [";", ";", "; ", " ;", ";;"]


def plan_text_from(choices: list[int]) -> str:
    pick = iter(choices)

    def one(options):
        return options[next(pick, 0) % len(options)]

    def number_range():
        return one(NUMBERS) + (f"-{one(NUMBERS)}" if next(pick, 1) % 3 == 0 else "")

    clauses = []
    for _ in range(1 + next(pick, 0) % 3):
        kind = next(pick, 0) % 10
        if kind <= 3 or kind == 9:
            items = [one(LABELS) + number_range() + one(REPEATS) + one(SUBS) + one(SCALES)
                     for _ in range(1 + next(pick, 0) % 4)]
            clauses.append(("layers:" if kind == 9 else "") + ",".join(items))
        elif kind <= 5:
            values = ",".join(number_range() for _ in range(1 + next(pick, 0) % 3))
            clauses.append(("skip:" if kind == 4 else "") + one(SKIP_KINDS) + values)
        elif kind == 6:
            clauses.append(f"exit:{one(NUMBERS)}")
        elif kind == 7:
            clauses.append(one(FIXED))
        else:
            clauses.append("".join(one(NOISE) for _ in range(1 + next(pick, 0) % 4)))
    return one(SEPARATORS).join(clauses)


plan_text = st.lists(st.integers(0, 1 << 16), min_size=1, max_size=40).map(plan_text_from)


def _cut(texts):
    """Texts and their truncations (a file cut short)."""
    return st.builds(lambda text, keep: text[:keep], texts, st.integers(0, 400))


@fuzz_settings(quick=1000, full=5000)
@given(plan_text, st.integers(1, 40))
def test_plan_strings_parse_and_round_trip_or_raise_plan_error(text, num_layers):
    _parses_or_says_why(lambda: parse_plan(text, num_layers), num_layers)


# ----- JSON files -----------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 45), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=6), st.sampled_from(["full", "exit:3", "skip:attn=1", "0-3,2-5", "layerplan"]))
layer_lists = st.lists(st.one_of(st.integers(-2, 45), st.booleans(), st.text(max_size=2), st.none()), max_size=8)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=6)
json_objects = st.one_of(
    st.fixed_dictionaries({"format": st.sampled_from(["layerplan", "other"]), "version": scalars,
                           "num_layers": st.one_of(st.integers(0, 45), scalars), "plan": st.one_of(plan_text, scalars)},
                          optional={"exit": scalars, "extra": scalars}),
    st.fixed_dictionaries({}, optional={"attention": st.one_of(layer_lists, scalars),
                                        "mlp": st.one_of(layer_lists, scalars), "extra": scalars}),
    st.fixed_dictionaries({"layer_replication": st.one_of(
        st.lists(st.lists(st.one_of(st.integers(-2, 45), scalars), max_size=3), max_size=4), scalars)}),
    st.lists(st.one_of(st.integers(-1, 4), scalars), max_size=24),
    json_values,
)
def _nested(opening: str, closing: str, depths=(10, 1000, 20000)):
    """Text nested `depth` deep (a reader that recurses per level runs out of stack)."""
    return st.builds(lambda depth, inner: opening * depth + inner + closing * depth,
                     st.sampled_from(depths), st.sampled_from(["", "1", '"x"']))


json_texts = st.one_of(json_objects.map(json.dumps), st.text(max_size=30), _cut(json_objects.map(json.dumps)),
                       _nested("[", "]"), _nested('{"a": ', "}"))


@fuzz_settings(quick=600, full=3000)
@given(json_texts, st.integers(1, 40))
def test_json_plan_files_parse_and_round_trip_or_raise_plan_error(text, num_layers):
    _parses_or_says_why(lambda: plan_from_text(text, ".json", num_layers), num_layers)


# ----- mergekit YAML files --------------------------------------------------------------------------
filters = st.one_of(st.floats(-2, 3), st.integers(0, 2), st.booleans(), st.text(max_size=3), st.none(),
                    st.lists(st.floats(0, 1), max_size=3),
                    st.lists(st.fixed_dictionaries({"value": st.one_of(st.floats(-1, 2), st.sampled_from([0, 1, 0.5]),
                                                                       st.text(max_size=2))},
                                                   optional={"filter": st.sampled_from(["o_proj", "down_proj", "mlp",
                                                                                        "self_attn", "q_proj", ""])}),
                             max_size=3))
YAML_DEPTHS = (10, 400, 800)  # past a few hundred levels PyYAML recurses too deep (and its reader is slow)
numbers = st.one_of(st.integers(-2, 45), st.floats(-2, 45), st.sampled_from([0.5, 10.7, 3.0, True]))
parameters = st.fixed_dictionaries({}, optional={"scale": filters, "weight": filters, "density": filters})
sources = st.fixed_dictionaries({"model": st.sampled_from(["org/a", "org/b", "org/a"])},
                                optional={"layer_range": st.one_of(st.lists(numbers, max_size=3), scalars),
                                          "parameters": parameters, "weight": scalars})
slices = st.fixed_dictionaries({"sources": st.one_of(st.lists(sources, max_size=2), scalars)},
                               optional={"parameters": parameters, "residual_weight": scalars})
configs = st.fixed_dictionaries({"slices": st.one_of(st.lists(slices, max_size=5), scalars)},
                                optional={"merge_method": st.sampled_from(["passthrough", "linear", "slerp"]),
                                          "dtype": st.just("bfloat16"), "parameters": parameters,
                                          "base_model": st.just("org/a"), "models": scalars})
yaml_texts = st.one_of(configs.map(lambda c: yaml.safe_dump(c, sort_keys=False)), json_values.map(yaml.safe_dump),
                       st.text(max_size=30), _cut(configs.map(yaml.safe_dump)), _nested("[", "]", YAML_DEPTHS),
                       _nested("{a: ", "}", YAML_DEPTHS), _nested("- ", "", YAML_DEPTHS))


@fuzz_settings(quick=400, full=2000)
@given(yaml_texts, st.integers(1, 40))
def test_mergekit_plan_files_parse_and_round_trip_or_raise_plan_error(text, num_layers):
    _parses_or_says_why(lambda: plan_from_text(text, ".yaml", num_layers), num_layers)


# ----- what a plan file may not hold ------------------------------------------------------------------
@fuzz_settings(quick=100, full=500)
@given(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in ("format", "version", "num_layers", "plan")),
                       scalars, min_size=1, max_size=3))
def test_a_layerplan_plan_file_with_an_unknown_key_is_refused_naming_it(extra):
    """A plan JSON with an extra key ("exit": 5) loaded as `full`."""
    text = json.dumps({"format": "layerplan", "version": 1, "num_layers": 30, "plan": "full", **extra})
    try:
        plan_from_text(text, ".json", 30)
    except PlanError as error:
        assert "unknown key" in str(error) and repr(sorted(extra)[0]) in str(error)
    else:
        raise AssertionError(f"{text} was read as a plan")


@fuzz_settings(quick=100, full=500)
@given(st.sampled_from(["config", "slice", "source"]), st.text(min_size=1, max_size=8), scalars)
def test_a_mergekit_file_with_a_key_it_does_not_read_is_refused_naming_it(where, key, value):
    """Unknown mergekit keys were ignored: the merge it describes is then not the plan read."""
    known = {"config": ("slices", "merge_method", "dtype", "out_dtype", "base_model", "parameters",
                        "tokenizer_source", "tokenizer", "chat_template"),
             "slice": ("sources", "parameters", "base_model"), "source": ("model", "layer_range", "parameters")}
    if key in known[where]:
        return
    source = {"model": "org/a", "layer_range": [0, 4]}
    piece = {"sources": [source]}
    config = {"slices": [piece], "merge_method": "passthrough"}
    {"config": config, "slice": piece, "source": source}[where][key] = value
    try:
        plan_from_text(yaml.safe_dump(config), ".yaml", 30)
    except PlanError as error:
        assert "unknown key" in str(error) and repr(key) in str(error), str(error)
    else:
        raise AssertionError(f"{config} was read as a plan")


def test_a_plan_file_for_an_absurdly_deep_model_is_refused_not_built():
    """A full plan is a list of its steps: num_layers 2**70 in a file tried to build one."""
    text = json.dumps({"format": "layerplan", "version": 1, "num_layers": 2 ** 70, "plan": "full"})
    try:
        plan_from_text(text, ".json", None)
    except PlanError as error:
        assert "plans are made for models of at most 100000 layers" in str(error)
    else:
        raise AssertionError("a plan of 2**70 layers was built")
