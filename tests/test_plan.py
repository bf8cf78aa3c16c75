import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerplan.plan import formats
from layerplan.plan.formats import load_plan, save_plan
from layerplan.plan.plan import LayerPlan, PlanError, Step, parse_plan

N = 30
NAME = "SmolLM2-135M-Instruct"


def layers_of(plan):
    return [s.layer for s in plan.steps]


def test_order_with_repeats_and_inclusive_ranges():
    plan = parse_plan("0-26,20-29", N)
    assert layers_of(plan) == list(range(27)) + list(range(20, 30))
    assert plan.to_string() == "0-26,20-29"


def test_identity_is_full():
    assert parse_plan("0-29", N).is_identity
    assert parse_plan("full", N) == LayerPlan.full(N)
    assert LayerPlan.full(N).to_string() == "full"


def test_the_model_name_is_for_messages_only():
    named, anonymous = parse_plan("skip:attn=3", N, NAME), parse_plan("skip:attn=3", N)
    assert named == anonymous and hash(named) == hash(anonymous)
    assert LayerPlan.full(N, NAME).is_identity and len({named, anonymous}) == 1


def test_skip_sets_and_exit():
    plan = parse_plan("skip:attn=3,5,6;mlp=6,9;exit:20", N)
    assert plan.exit == 20 and len(plan.active_steps) == 20
    assert plan.skipped()["attention"][:3] == [3, 5, 6]
    step6 = plan.steps[6]
    assert not step6.attention and not step6.mlp
    assert plan.steps[9] == Step(9, attention=True, mlp=False)
    assert parse_plan(plan.to_string(), N) == plan


def test_whole_layer_skip_keeps_step_for_cache_alignment():
    plan = parse_plan("skip:4-5", N)
    assert len(plan.steps) == N
    assert not plan.steps[4].active and not plan.steps[5].active
    assert plan.to_string() == "skip:layers=4-5"


def test_item_modifiers():
    plan = parse_plan("0-3,2*3@0.5,4/attn,5/mlp,6/none,29", N)
    assert layers_of(plan) == [0, 1, 2, 3, 2, 2, 2, 4, 5, 6, 29]
    assert plan.steps[4].scale == 0.5
    assert plan.steps[7] == Step(4, True, False)
    assert plan.steps[8] == Step(5, False, True)
    assert not plan.steps[9].active
    assert parse_plan(plan.to_string(), N) == plan


def test_descending_range():
    assert layers_of(parse_plan("3-1", N)) == [3, 2, 1]


def test_cost_and_draft_relation():
    target = LayerPlan.full(N)
    draft = parse_plan("skip:attn=3;mlp=4;exit:10", N)
    assert draft.is_draft_of(target)
    assert not target.is_draft_of(draft)
    assert draft.cost == pytest.approx(18 / 60)
    assert not parse_plan("0,2,1", N).is_draft_of(target)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("0-31", "layer 31 is out of range: SmolLM2-135M-Instruct has layers 0–29"),
        ("0-26,20-31", "'20-31': layer 31 is out of range"),
        ("skip:attn=3,30", "'30' in skip: layer 30 is out of range"),
        ("abc", "cannot read 'abc'"),
        ("0-5,x", "cannot read 'x' as a layer item"),
        ("skip:foo=3", "unknown skip kind 'foo'"),
        ("skip:attn=3,a", "cannot read 'a' in skip"),
        ("exit:40", "exit:40 is out of range: the plan has 30 steps, so exit must be 1–30"),
        ("exit:0", "exit:0 is out of range"),
        ("exit:x", "cannot read 'exit:x'"),
        ("", "the plan is empty"),
        ("0;;1", "empty clause"),
        ("skip:0-29", "skips every sub-layer"),
        ("0-5;7-9", "gives a layer order twice"),
        ("0-5;skip:attn=9", "layer 9 is skipped but the plan never runs it"),
    ],
)
def test_bad_plans_name_the_token_and_range(text, fragment):
    with pytest.raises(PlanError) as error:
        parse_plan(text, N, NAME)
    assert fragment in str(error.value)


def test_draft_verify_round_trip():
    obj = {"attention": [3, 5, 6], "mlp": [6, 9]}
    plan = formats.from_draft_verify(obj, N)
    assert formats.to_draft_verify(plan) == obj
    assert formats.from_draft_verify(json.dumps(obj), N) == plan
    with pytest.raises(PlanError, match="unknown key"):
        formats.from_draft_verify({"attn": [1]}, N)
    with pytest.raises(PlanError, match="layer 30 is out of range"):
        formats.from_draft_verify({"mlp": [30]}, N)


def test_run_layers_round_trip():
    vector = [3] * 5 + [1, 2, 0] + [3] * 22
    plan = formats.from_run_layers(vector, N)
    assert formats.to_run_layers(plan) == vector
    assert plan.steps[5] == Step(5, True, False)
    assert formats.to_run_layers(parse_plan("exit:2", 4)) == [3, 3, 0, 0]
    with pytest.raises(PlanError, match=r"run_layers\[1\] = 7"):
        formats.from_run_layers([3, 7, 3], 3)
    with pytest.raises(PlanError, match="model's own layer order"):
        formats.to_run_layers(parse_plan("0,0,1", N))


def test_mergekit_round_trip_half_open():
    plan = parse_plan("0-26,20-29", N)
    text = formats.to_mergekit(plan, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "layer_range:\n    - 0\n    - 27" in text or "[0, 27]" in text
    assert formats.from_mergekit(text, N) == plan
    yaml_text = """
slices:
  - sources:
      - model: m
        layer_range: [0, 8]
  - sources:
      - model: m
        layer_range: [4, 12]
merge_method: passthrough
dtype: bfloat16
"""
    assert layers_of(formats.from_mergekit(yaml_text, 12)) == list(range(8)) + list(range(4, 12))
    with pytest.raises(PlanError, match="layer 12 is out of range"):
        formats.from_mergekit(yaml_text.replace("[4, 12]", "[4, 13]"), 12)
    with pytest.raises(PlanError, match="only 'passthrough'"):
        formats.from_mergekit(yaml_text.replace("passthrough", "slerp"), 12)
    with pytest.raises(PlanError, match="whole layers"):
        formats.to_mergekit(parse_plan("skip:attn=3", N), "m")


FRANKENMERGE = """
slices:
  - sources:
      - model: m
        layer_range: [0, 8]
  - sources:
      - model: m
        layer_range: [4, 8]
        parameters:
          scale:
            - filter: o_proj
              value: {attention}
            - filter: down_proj
              value: {mlp}
            - value: 1.0
merge_method: passthrough
dtype: bfloat16
"""


@pytest.mark.parametrize("attention, mlp, expected", [
    (0.0, 0.0, "0-7,4-7/none"),  # the common no-op repeat: both outputs zeroed
    (0.0, 1.0, "0-7,4-7/mlp"),
    (1.0, 0.0, "0-7,4-7/attn"),
    (0.5, 0.5, "0-7,4-7@0.5"),
    (0.0, 0.5, "0-7,4-7/mlp@0.5"),
    (1.0, 1.0, "0-7,4-7"),
])
def test_mergekit_scale_filters_become_sub_layer_switches_and_scales(attention, mlp, expected):
    plan = formats.from_mergekit(FRANKENMERGE.format(attention=attention, mlp=mlp), 8)
    assert plan == parse_plan(expected, 8)


def test_mergekit_scales_a_plan_cannot_express_are_refused_by_name():
    base = FRANKENMERGE.format(attention=0.0, mlp=0.0)
    with pytest.raises(PlanError, match="o_proj is scaled by 0.5 and down_proj by 0.7"):
        formats.from_mergekit(FRANKENMERGE.format(attention=0.5, mlp=0.7), 8)
    with pytest.raises(PlanError, match="filter 'q_proj'"):
        formats.from_mergekit(base.replace("filter: o_proj", "filter: q_proj"), 8)
    with pytest.raises(PlanError, match="the unfiltered scale"):
        formats.from_mergekit(base.replace("- value: 1.0", "- value: 0.9"), 8)
    with pytest.raises(PlanError, match="gradient"):
        formats.from_mergekit(base.replace("value: 0.0", "value: [0.0, 1.0]", 1), 8)
    # slice- and config-level settings count too: per tensor, the source's, then the slice's, then the config's
    def config(slice_scale, config_scale):
        plain = {"sources": [{"model": "m", "layer_range": [0, 4], "parameters": {"scale": 1}}]}
        return {"slices": [plain, {"sources": [{"model": "m", "layer_range": [2, 4]}],
                                   "parameters": {"scale": slice_scale}}],
                "parameters": {"scale": config_scale}}

    assert formats.from_mergekit(config([{"filter": "down_proj", "value": 0}, {"value": 1}], 0.5), 4) == \
        parse_plan("0-3,2-3/attn", 4)
    assert formats.from_mergekit(config([{"filter": "down_proj", "value": 0}], [{"filter": "o_proj", "value": 0}]),
                                 4) == parse_plan("0-3,2-3/none", 4)
    with pytest.raises(PlanError, match="the unfiltered scale"):  # the config's 0.5 reaches every other tensor
        formats.from_mergekit(config([{"filter": "down_proj", "value": 0}], 0.5), 4)


def test_layer_replication_round_trip():
    pairs = [[0, 4], [2, 5]]
    plan = formats.from_layer_replication(pairs, 5)
    assert layers_of(plan) == [0, 1, 2, 3, 2, 3, 4]
    assert formats.to_layer_replication(plan) == pairs
    with pytest.raises(PlanError, match="empty"):
        formats.from_layer_replication([[3, 3]], 5)
    with pytest.raises(PlanError, match="layer 5 is out of range"):
        formats.from_layer_replication([[0, 6]], 5)


def test_files_round_trip(tmp_path):
    plan = parse_plan("0-26,20-29;exit:30", N)
    json_path = save_plan(plan, tmp_path / "plan.json")
    assert load_plan(json_path, N) == plan
    yaml_path = save_plan(parse_plan("0-26,20-29", N), tmp_path / "plan.yaml")
    assert load_plan(yaml_path, N) == parse_plan("0-26,20-29", N)
    dv = tmp_path / "dv.json"
    dv.write_text(json.dumps({"attention": [1], "mlp": []}))
    assert load_plan(dv, N) == LayerPlan.from_skips(N, attention=[1])
    with pytest.raises(PlanError, match="plan file not found"):
        load_plan(tmp_path / "missing.json", N)
    with pytest.raises(PlanError, match="made for 30 layers but"):
        load_plan(json_path, 12)


item = st.builds(
    lambda a, b, k, sub, scale: (a, b, k, sub, scale),
    st.integers(0, N - 1), st.integers(0, N - 1), st.integers(1, 3),
    st.sampled_from([None, "attn", "mlp"]), st.sampled_from([1.0, 0.5, 0.25, 2.0]),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(item, min_size=1, max_size=6), st.booleans())
def test_string_round_trip_property(items, with_exit):
    text = ",".join(
        f"{a}-{b}" + (f"*{k}" if k > 1 else "") + (f"/{sub}" if sub else "") + (f"@{scale}" if scale != 1.0 else "")
        for a, b, k, sub, scale in items
    )
    plan = parse_plan(text, N)
    if with_exit:
        plan = plan.with_exit(max(1, len(plan.steps) // 2))
    assert parse_plan(plan.to_string(), N) == plan


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3]), min_size=N, max_size=N).filter(lambda v: any(v)))
def test_run_layers_property(vector):
    plan = formats.from_run_layers(vector, N)
    assert formats.to_run_layers(plan) == vector
    assert parse_plan(plan.to_string(), N) == plan
    assert formats.from_draft_verify(formats.to_draft_verify(plan), N) == plan
