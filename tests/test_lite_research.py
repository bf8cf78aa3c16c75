"""The scan, the search and explore's grid on the light front end (lite/evaluator.py): every
candidate's numbers, and so every search's steps and trials, equal the torch front end's, bit for bit, on stored GGUF
weights in both arithmetics; the light front end's decode costs; and the shared scorer
(search/reference.py) against the textbook formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import tiny_hf
from tiny_gguf import write_tiny_gguf

from layerplan.engine.choices import STORED_ARITHMETIC
from layerplan.engine.load import load_model
from layerplan.lite.evaluator import LitePlanEvaluator, explore_lite, measure_lite_costs
from layerplan.lite.model import LiteModel
from layerplan.search.evaluator import explore
from layerplan.search.explore import explore_journal, recompute_rewind_grid
from layerplan.search.importance import scan_plans
from layerplan.search.plan_search import search_plans
from layerplan.search.reference import LogitsReference
from layerplan.search.run import run_search
from layerplan.search.scan import scan
from layerplan.search.windows import logits_divergence

IDS = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 45, 8]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch,matrix_type,dtype", [("llama", "Q4_1", "stored"), ("qwen2", "Q8_0", "stored-fast"),
                                                    ("gemma3", "Q8_0", "stored-fast")])
@pytest.mark.parametrize("base", [None, "skip:attn=1"])
@pytest.mark.parametrize("reuse", [True, False])
def test_the_light_scan_prints_the_torch_front_ends_numbers(tmp_path, arch, matrix_type, dtype, base, reuse):
    model, lite = _pair(tmp_path, arch, matrix_type, dtype)
    kinds = ("attention", "mlp", "layer", "exit")
    want = scan(model, torch.tensor([IDS]), model.plan(base), kinds=kinds, reuse=reuse)
    evaluator = LitePlanEvaluator(lite, IDS, lite.plan(base), reuse=reuse)
    got = scan_plans(evaluator, kinds)
    assert got.items == want.items and len(got.items) > 5
    assert (got.model, got.base_plan, got.tokens, got.base_perplexity, got.reuse) == (
        want.model, want.base_plan, want.tokens, want.base_perplexity, want.reuse)
    if reuse:  # the same plan again: the memo, no run
        runs = evaluator.evaluations
        scored = next(iter(evaluator.cache))
        assert evaluator.divergence(scored) is evaluator.cache[scored]
        assert evaluator.evaluations == runs


def _pair(tmp_path, arch: str, matrix_type: str, dtype: str):
    hf = tiny_hf(arch, num_layers=6 if arch == "gemma3" else 3)
    path = write_tiny_gguf(hf, tmp_path / f"{arch}.gguf", matrix_type)
    return load_model(path, dtype=dtype, engine="native"), LiteModel(path, STORED_ARITHMETIC[dtype], threads=2)


@pytest.mark.parametrize("arch,matrix_type,dtype", [("llama", "Q4_1", "stored"), ("gemma3", "Q8_0", "stored-fast")])
def test_the_light_search_is_the_torch_front_ends(tmp_path, arch, matrix_type, dtype):
    """Greedy steps and a seeded study's trials: the same plans and values on either front end."""
    model, lite = _pair(tmp_path, arch, matrix_type, dtype)
    for objective, method in (("kl", "greedy"), ("agreement", "both")):
        options = dict(objective=objective, method=method, budget=2, trials=4, seed=3, allow_ends=True)
        want = run_search(model, torch.tensor([IDS]), folder=tmp_path / "torch" / objective, **options)
        got = search_plans(LitePlanEvaluator(lite, IDS), folder=tmp_path / "light" / objective, **options)
        assert got.to_dict() == want.to_dict() and got.best_plan == want.best_plan, objective
        assert (got.greedy.steps if got.greedy else got.study.trials) and got.saved_draft is None


def test_the_light_front_ends_costs_add_up(tmp_path):
    _, lite = _pair(tmp_path, "llama", "Q4_1", "stored")
    costs = measure_lite_costs(lite, context=8, repeats=3)
    assert 0 < costs.fixed <= costs.full_step and costs.attention > 0 and costs.mlp > 0
    assert costs.relative_cost(lite.plan()) == pytest.approx(1.0)
    assert costs.relative_cost(lite.plan("skip:mlp=0-2")) < 1.0
    with pytest.raises(ValueError, match="measure_costs"):  # an objective that weighs costs needs them
        search_plans(LitePlanEvaluator(lite, IDS), "speedup", "greedy", folder=tmp_path)


def test_the_light_exploration_is_the_torch_front_ends(tmp_path):
    """explore's grid of layer orders and an extra plan with a repeated layer: the same rows on
    either front end."""
    model, lite = _pair(tmp_path, "llama", "Q8_0", "stored-fast")
    plans = recompute_rewind_grid(model, [2, 3], [1, 2]) + [model.plan("0,1,1,2")]
    want = explore(model, torch.tensor([IDS]), plans)
    got = explore_lite(lite, IDS, [lite.plan(p.to_string()) for p in plans])
    assert got.rows == want.rows and (got.base_perplexity, got.tokens) == (want.base_perplexity, want.tokens)
    assert len(got.rows) == 3 and got.rows[-1].added_compute > 0


def test_an_interrupted_exploration_runs_only_the_rest_on_either_front_end(tmp_path):
    """explore's journal keeps each finished row: a grid interrupted on the light front end and
    started again on the torch one (the same numbers) runs only the plans not in it and gives the
    uninterrupted grid's rows; a line cut short is ignored; other ids start the journal afresh."""
    model, lite = _pair(tmp_path, "llama", "Q8_0", "stored-fast")
    plans = recompute_rewind_grid(model, [2, 3], [1, 2]) + [model.plan("0,0,1,2")]
    whole = explore(model, torch.tensor([IDS]), plans)
    journal = explore_journal(tmp_path / "out")

    def interrupted(done, total):
        if done == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        explore_lite(lite, IDS, [lite.plan(p.to_string()) for p in plans], interrupted, journal)
    with journal.path.open("a") as kept:
        kept.write('{"plan": "0-2,1')  # (the process killed mid-line)
    again = explore(model, torch.tensor([IDS]), plans, journal=explore_journal(tmp_path / "out"))
    assert again.rows == whole.rows and again.resumed == 2
    fresh = explore(model, torch.tensor([IDS[:-1]]), plans, journal=explore_journal(tmp_path / "out"))
    assert fresh.resumed == 0 and fresh.tokens == len(IDS) - 1
    explore_journal(tmp_path / "out").remove()
    assert not journal.path.exists()


@pytest.mark.parametrize("block_rows, chunk_rows", [(256, 32), (4, 3), (5, 1)])
def test_the_scorer_is_the_textbook_divergence(block_rows, chunk_rows):
    """KL(ref || cand), top-1 agreement and both perplexities against search/windows.py's float64
    logits_divergence, however the positions are cut into blocks and chunks."""
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((2, 11, 300)).astype(np.float32) * 3
    candidate = reference + rng.standard_normal(reference.shape).astype(np.float32) * 0.4
    candidate[0, 3] = reference[0, 3]  # an exact match: a position of zero KL
    ids = rng.integers(0, 300, (2, 11))
    scorer = LogitsReference(lambda b, s, e: reference[b, s:e].copy(), ids, block_rows, chunk_rows)
    got = scorer.divergence(lambda b, s, e: candidate[b, s:e].copy(), "p")
    want = logits_divergence(reference, candidate, ids, "p")
    assert got.kl == pytest.approx(want.kl, rel=1e-5)
    assert got.perplexity == pytest.approx(want.perplexity, rel=1e-6)
    assert scorer.perplexity == pytest.approx(want.reference_perplexity, rel=1e-6)
    assert got.top1_agreement == want.top1_agreement and 0 < got.top1_agreement < 1
    same = scorer.divergence(lambda b, s, e: reference[b, s:e].copy())
    assert same.kl == pytest.approx(0, abs=1e-6) and same.top1_agreement == 1.0


def test_giving_up_returns_bounds_and_ties_go_to_the_first_maximum():
    reference = np.zeros((1, 8, 6), np.float32)
    reference[0, :, 2] = 1.0
    candidate = reference.copy()
    candidate[0, :, 4] = 1.0  # tied with 2: argmax's first maximum, 2, still agrees
    ids = np.arange(8)[None] % 6
    scorer = LogitsReference(lambda b, s, e: reference[b, s:e].copy(), ids, 8, 2)
    seen = []
    bounds = scorer.divergence(lambda b, s, e: candidate[b, s:e].copy(), give_up=lambda d: seen.append(d) or True)
    assert not bounds.complete and len(seen) == 1 and bounds.top1_agreement == 1.0
    whole = scorer.divergence(lambda b, s, e: candidate[b, s:e].copy())
    assert whole.complete and whole.top1_agreement == 1.0 and bounds.kl <= whole.kl
    p = np.exp(reference[0, 0]) / np.exp(reference[0, 0]).sum()
    q = np.exp(candidate[0, 0]) / np.exp(candidate[0, 0]).sum()
    assert whole.kl == pytest.approx(float((p * np.log(p / q)).sum()), rel=1e-5)
