"""The arbiter (--draft auto): it picks the drafter expected to pay, decodes plainly when none
does, and never changes greedy output."""

from types import SimpleNamespace

import pytest
import torch

from layerplan.app.bench import run_bench
from layerplan.decoding.drafters.arbiter import Arbiter
from layerplan.decoding.drafters.base import DraftState, Proposal, RoundOutcome
from layerplan.decoding.drafters.ngram import NgramDrafter
from layerplan.decoding.drafters.plan import PlanDrafter
from layerplan.decoding.drafters.registry import make_drafter, saved_draft_path
from layerplan.decoding.drafters.suffix import SuffixDrafter
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling import SamplingParams
from layerplan.engine import native
from layerplan.engine.executors import use_native
from layerplan.plan.formats import save_plan
from tiny import tiny_model

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8]
CHEAP_VERIFY = {k: 1.0 + 0.05 * (k - 1) for k in range(1, 17)}
STATE = DraftState(None, None, None, [1, 2, 3], SamplingParams())


class FixedLookup:
    """A lookup that always proposes the same tokens."""

    def __init__(self, name, tokens=(1, 2, 3, 4)):
        self.name, self.tokens = name, list(tokens)
        self.calls = 0

    def check(self, model, target):
        pass

    def propose(self, state, max_tokens):
        self.calls += 1
        return Proposal(self.tokens[:max_tokens])


def trained(arbiter, history):
    """Feed a plain step of 10 ms, then each (source, drafted, accepted) round."""
    arbiter.observe(RoundOutcome(None, 0, 0, 0.0, 0.010))
    for source, drafted, accepted in history:
        arbiter.observe(RoundOutcome(source, drafted, accepted, 0.0, 0.011))
    return arbiter


@pytest.mark.parametrize("good, bad", [("a", "b"), ("b", "a")])
def test_the_arbiter_picks_the_drafter_whose_drafts_are_accepted(good, bad):
    history = [(good, 4, 4), (bad, 4, 0)] * 10
    arbiter = trained(Arbiter([FixedLookup("a"), FixedLookup("b")], pass_costs=CHEAP_VERIFY), history)
    assert arbiter.measured[good].alpha > 0.9 > 0.1 > arbiter.measured[bad].alpha
    proposal = arbiter.propose(STATE, 8)
    assert proposal.source == good and proposal.tokens == [1, 2, 3, 4]
    # a mediocre drafter is cut short: with α = 0.5 and verify passes that grow, one or two tokens pay best
    history = [("a", 4, 1), ("a", 4, 0), ("a", 4, 2)] * 5
    half = trained(Arbiter([FixedLookup("a", range(8))], pass_costs={k: 1.0 + 0.3 * (k - 1) for k in range(1, 17)}),
                   history).propose(STATE, 8)
    assert half.source == "a" and 1 <= len(half.tokens) <= 2


def test_a_model_draft_is_chosen_when_it_pays_better_than_the_lookup():
    lookup, model_draft = FixedLookup("lookup", [7]), FixedLookup("plan", [1, 2, 3, 4, 5, 6, 7, 8])
    arbiter = trained(Arbiter([lookup], [model_draft], pass_costs=CHEAP_VERIFY),
                      [("lookup", 1, 0), ("plan", 8, 8)] * 10)
    proposal = arbiter.propose(STATE, 8)
    assert proposal.source == "plan" and len(proposal.tokens) >= 4
    assert arbiter.measured["plan"].seconds_per_token is not None  # its cost is measured as it drafts


@pytest.mark.parametrize("pass_costs", [{k: float(k) for k in range(1, 17)}, None])
def test_plain_steps_when_verifying_k_tokens_costs_k_steps(pass_costs):
    """From the probe's curve, or learned from verify passes that cost a step per token: even
    drafts that are always accepted cannot pay, so the arbiter drafts only its one-token probes."""
    lookup = FixedLookup("a")
    arbiter = Arbiter([lookup], pass_costs=pass_costs, probe_every=5)
    arbiter.observe(RoundOutcome(None, 0, 0, 0.0, 0.010))
    for _ in range(10):
        arbiter.observe(RoundOutcome("a", 4, 4, 0.0, 0.050))  # 5 tokens verified in 5 steps' time
    drafted = [len(arbiter.propose(STATE, 8).tokens) for _ in range(20)]
    assert drafted.count(0) == 16 and drafted.count(1) == 4  # a one-token probe every 5 rounds
    assert lookup.calls == 4  # a lookup that cannot pay is not even asked between its probes
    assert Arbiter([FixedLookup("a")]).propose(STATE, 8).tokens == []  # no plain step measured yet


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_greedy_output_with_the_arbiter_equals_plain(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    model = tiny_model(arch, num_layers=4)
    plain = generate(model, PROMPT, max_new_tokens=30, stop_at_eos=False).token_ids
    save_plan(model.plan("skip:attn=1"), saved_draft_path(model))  # --draft auto finds a saved draft plan
    auto = make_drafter("auto", model)
    assert [d.name for d in auto.lookups] == ["suffix", "ngram"] and len(auto.models) == 1
    cheap_models = Arbiter([SuffixDrafter(), NgramDrafter()], [PlanDrafter(model.plan("skip:mlp=2"))],
                           pass_costs=CHEAP_VERIFY, model_cost_prior=0.1)
    for draft, policy in [("auto", None), ("auto", "adaptive"), (cheap_models, None)]:
        result = generate(model, PROMPT, max_new_tokens=30, stop_at_eos=False, draft=draft, draft_length=policy)
        assert result.token_ids == plain, (draft, policy)
        stats = result.stats
        parts = stats["by_drafter"]
        assert sum(p["rounds"] for p in parts.values()) == stats["rounds"] - stats["plain_rounds"]
        assert sum(p["accepted"] for p in parts.values()) == stats["accepted"]
        for part in parts.values():
            assert part["tokens_per_pass"] == part["emitted"] / part["rounds"]
    assert "skip:mlp=2" in parts  # the cheap model draft got rounds of its own


def test_sampling_through_the_arbiter_and_the_suffix_drafter_keeps_the_target_support():
    """Sampling at top-k 1 is the target's argmax whatever the draws: the sampled acceptance path
    (lookups propose without q, a model draft with it) must reproduce plain greedy output."""
    model = tiny_model("llama", num_layers=3)
    plain = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False).token_ids
    params = SamplingParams(temperature=0.8, top_k=1)
    drafters = ["suffix", Arbiter([SuffixDrafter(), NgramDrafter()], [PlanDrafter(model.plan("skip:attn=1"))],
                                  pass_costs=CHEAP_VERIFY, model_cost_prior=0.1)]
    for draft in drafters:
        result = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False, sampling=params, seed=3, draft=draft)
        assert result.token_ids == plain
        assert result.stats["drafted"] > 0


@pytest.mark.real
def test_real_model_auto_with_a_saved_plan_equals_plain(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path))
    save_plan(smollm2.plan("skip:attn=5-8"), saved_draft_path(smollm2))
    ids = smollm2.encode("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
                         "def fact(n):\n")
    plain = generate(smollm2, ids, max_new_tokens=40).token_ids
    result = generate(smollm2, ids, max_new_tokens=40, draft="auto")
    assert result.token_ids == plain
    assert result.stats["by_drafter"]  # something drafted, and the rounds say who


def test_bench_rows_report_tokens_per_pass_per_drafter():
    model = SimpleNamespace(name="tiny", dtype=torch.float32, precision="float32", encode=lambda text, chat=False: torch.tensor([[1, 2]]))
    parts = {"suffix": {"rounds": 3, "drafted": 6, "accepted": 3, "emitted": 6, "acceptance_rate": 0.5,
                        "tokens_per_pass": 2.0},
             "ngram": {"rounds": 1, "drafted": 1, "accepted": 0, "emitted": 1, "acceptance_rate": 0.0,
                       "tokens_per_pass": 1.0}}

    def plain(ids, new_tokens):
        return 0.01, [1, 2], None

    def auto(ids, new_tokens):
        return 0.01, [1, 2], {"acceptance_rate": 3 / 7, "mean_accepted_length": 1.75, "by_drafter": parts}

    result = run_bench(model, {"transformers generate": plain, "layerplan plain": plain, "layerplan draft=auto": auto},
                       {"code": "def f():"}, new_tokens=2, repeats=1)
    row = result.rows[-1]
    assert row.by_drafter == parts and result.rows[0].by_drafter == {}
    assert "suffix: 3 rounds, 0.50 accept, 2.00 tok/pass; ngram: 1 rounds, 0.00 accept, 1.00 tok/pass" in result.table()


@pytest.mark.skipif(native.native_available() is not None, reason=str(native.native_available()))
def test_bf16_suffix_and_auto_equal_plain_on_the_batch_invariant_native_engine():
    model = tiny_model("llama", 4, dtype=torch.bfloat16)
    use_native(model)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    plain = generate(model, prompt, max_new_tokens=32, stop_at_eos=False).token_ids
    for draft in ("suffix", "auto"):
        assert generate(model, prompt, max_new_tokens=32, stop_at_eos=False, draft=draft).token_ids == plain, draft
