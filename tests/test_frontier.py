"""The draft frontier (decoding/frontier.py): break-even arithmetic on hand-made costs, the
acceptance estimate on hand-made counts, and a measured frontier of a tiny model."""

import json

import pytest

from layerplan.decoding.frontier import (COST_REPEATS, PASS_LENGTHS, acceptance_of, best_length,
                                         break_even_acceptance, measure_frontier, pass_costs_of, self_drafts,
                                         verify_cost)
from layerplan.decoding.generate import decode_by
from layerplan.engine.probe_rows import ProbeRow
from tiny import tiny_model


def test_verify_costs_are_the_probes_interpolated_and_extended():
    costs = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4}
    assert verify_cost(costs, 4) == 1.6
    assert verify_cost(costs, 3) == pytest.approx(1.4)
    assert verify_cost(costs, 10) == pytest.approx(2.4 + 2 * 0.2)  # the last measured slope on
    assert verify_cost({}, 1) == 1.0


def test_pass_costs_are_the_probe_rows_else_timed_by_the_front_ends_timer():
    row = ProbeRow("native", "stored-fast", 3.0, {1: 1.0, 2: 1.1, 4: 1.3})
    model, asked = object(), []

    def time_passes(timed, lengths, repeats):
        asked.append((timed, tuple(lengths), repeats))
        return {k: 0.002 * (1 + 0.25 * (k - 1)) for k in lengths}

    assert pass_costs_of(row, model, time_passes) == {1: 1.0, 2: 1.1, 4: 1.3}
    assert not asked  # a probe row's costs are not timed again
    costs = pass_costs_of(None, model, time_passes)
    assert asked == [(model, PASS_LENGTHS, COST_REPEATS)]
    assert costs[1] == 1.0 and costs[3] == pytest.approx(1.5) and costs[9] == pytest.approx(3.0)


def test_break_even_is_where_the_best_draft_length_just_pays():
    free = {k: 1.0 for k in range(1, 12)}  # a verify pass as cheap as a step, whatever its length
    # a draft step of half a plain step: γ = 1 gives (1 + α) / 1.5, which pays past α = 0.5
    assert break_even_acceptance(0.5, free) == pytest.approx(0.5, abs=1e-6)
    assert best_length(0.5 - 1e-3, 0.5, free) == (0, 1.0)
    gamma, speedup = best_length(0.9, 0.5, free)
    assert gamma >= 1 and speedup > 1.0
    assert break_even_acceptance(0.0, free) == pytest.approx(0.0, abs=1e-6)  # a free draft pays at any α
    # a draft as dear as a step never pays, even always accepted: γ + 1 tokens for γ + 1 steps
    assert break_even_acceptance(1.0, free) is None
    # dearer verify passes move the curve up
    dear = {k: 1.0 + 0.25 * (k - 1) for k in range(1, 12)}
    assert break_even_acceptance(0.3, dear) > break_even_acceptance(0.3, free)


def test_acceptance_counts_a_rejection_only_where_a_position_was_tried():
    # three rounds of 4 drafts: 2 accepted, 4 accepted, 0 accepted
    stats = {"drafted_at": [3, 3, 3, 3], "accepted_at": [2, 2, 1, 1]}
    assert acceptance_of(stats) == (6, 2)  # two rounds stopped at a rejection
    assert acceptance_of({}) == (0, 0)


def test_a_tiny_models_frontier_places_every_draft():
    model = tiny_model("llama", num_layers=4)
    drafts = self_drafts(model)
    assert drafts == ["exit:2", "exit:3", "online", "ngram", "suffix"]
    result = measure_frontier(model, decode_by(model), ["exit:2", "ngram"], [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7]],
                              {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}, new_tokens=12, gamma=3)
    assert [p.draft for p in result.points] == ["exit:2", "ngram"]
    for point in result.points:
        assert 0.0 <= point.acceptance <= 1.0 and point.draft_cost >= 0.0 and point.measured_speedup > 0.0
        assert point.drafted > 0
        threshold = break_even_acceptance(point.draft_cost, result.pass_costs, 8)
        assert point.above_break_even == (threshold is not None and point.acceptance > threshold)
    assert result.points[0].draft_cost > result.points[1].draft_cost  # a self-draft runs layers, a lookup none
    assert len(result.curve) > 10 and result.curve[0][1] is not None
    json.dumps(result.to_dict())
