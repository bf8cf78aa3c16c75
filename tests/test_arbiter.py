"""The arbiter (--draft auto): it picks the drafter expected to pay, decodes plainly when none
does, and never changes greedy output."""

from types import SimpleNamespace

import pytest
import torch

from layerplan.app.bench_runs import run_bench
from layerplan.decoding.drafters.arbiter import Arbiter
from layerplan.decoding.drafters.ngram import NgramDrafter
from layerplan.decoding.drafters.plan import PlanDrafter
from layerplan.decoding.drafters.proposal import DraftState, Proposal, RoundOutcome
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.drafters.saved import saved_draft_path
from layerplan.decoding.drafters.suffix import SuffixDrafter
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
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
    # loss_credit: room in the ledger for these probes, each of which may lose a whole step
    # (the ledger itself: test_the_ledger_bounds_the_loss_of_drafts_that_the_model_prices_wrong)
    arbiter = Arbiter([lookup], pass_costs=pass_costs, probe_every=5, loss_credit=10.0)
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


# --- never slower than plain (issue 29), on synthetic cost and acceptance traces ----------------
# No model runs: a fake clock stands in for time.perf_counter (the arbiter times model drafts with
# it), drafts cost `cost` plain steps per token on that clock, a k-token verify pass costs
# 1 + slope·(k − 1) steps, and each drafted token is accepted with probability α until the first
# rejection. The loop is speculative_generate's, with FixedLength(max_draft) as `auto` runs.

STEP = 0.1  # seconds of a plain step on the fake clock


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class TraceDraft:
    """Proposes `length` tokens; its draft steps advance the clock (cost 0: a lookup)."""

    def __init__(self, name, clock, alpha, cost=0.0, length=8):
        self.name, self.clock, self.alpha, self.cost, self.length = name, clock, alpha, cost, length

    def check(self, model, target):
        pass

    def propose(self, state, max_tokens):
        n = min(self.length, max_tokens)
        self.clock.now += self.cost * STEP * n
        return Proposal([7] * n)


def verify_curve(slope):
    return {k: 1.0 + slope * (k - 1) for k in range(1, 17)}


def simulate(monkeypatch, lookups=(), models=(), slope=0.2, probe_slope=None, tokens=2000, seed=0):
    """Speedup over plain of `auto` on the trace: tokens / time in plain steps (plain: 1.0), and
    the rounds each drafter drafted. lookups, models: (name, α, cost per token); probe_slope: the
    verify curve the arbiter is handed as the probe's (None: the true one)."""
    import random

    from layerplan.decoding.drafters import arbiter as arbiter_module

    clock = FakeClock()
    monkeypatch.setattr(arbiter_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    drafts = {name: TraceDraft(name, clock, alpha, cost) for name, alpha, cost in [*lookups, *models]}
    arbiter = Arbiter([drafts[d[0]] for d in lookups], [drafts[d[0]] for d in models],
                      pass_costs=verify_curve(slope if probe_slope is None else probe_slope))
    rng, done, drafted_rounds = random.Random(seed), 0, {}
    while done < tokens:
        gamma = min(arbiter.max_draft, tokens - done - 1)
        start = clock.now
        proposal = arbiter.propose(STATE, gamma) if gamma > 0 else Proposal()
        draft_seconds = clock.now - start
        drafted, accepted = len(proposal.tokens), 0
        if drafted:
            drafted_rounds[proposal.source] = drafted_rounds.get(proposal.source, 0) + 1
            while accepted < drafted and rng.random() < drafts[proposal.source].alpha:
                accepted += 1
        verify_seconds = (1.0 + slope * drafted) * STEP
        clock.now += verify_seconds
        arbiter.observe(RoundOutcome(proposal.source if drafted else None, drafted, accepted, draft_seconds,
                                     verify_seconds))
        done += accepted + 1
    return done / (clock.now / STEP), drafted_rounds


LOSING_TRACES = {
    # a self-draft at α 0.3 and 0.7 of a step per token: every round loses; its probes every 16
    # rounds alone cost 3.7% (0.963x plain before probe_interval)
    "self-draft": dict(models=[("plan", 0.3, 0.7)]),
    # prose: both lookups propose every round and are rarely right, beside the losing self-draft
    # (0.955x before)
    "prose": dict(lookups=[("suffix", 0.1, 0.0), ("ngram", 0.1, 0.0)], models=[("plan", 0.3, 0.7)]),
    # a probe row that prices verify passes 10x too cheap (timed for other weights, or on a quiet
    # machine): lookups at α 0.3 look worth 4-token rounds that lose (0.93x before calibration)
    "verify priced wrong": dict(lookups=[("suffix", 0.3, 0.0), ("ngram", 0.3, 0.0)], probe_slope=0.02),
    # both at once, on verify passes dearer still (1 + 0.3 k); 0.91x before
    "prose, verify priced wrong": dict(lookups=[("suffix", 0.1, 0.0), ("ngram", 0.1, 0.0)],
                                       models=[("plan", 0.3, 0.7)], slope=0.3, probe_slope=0.02),
}


@pytest.mark.parametrize("trace", LOSING_TRACES)
def test_auto_is_never_slower_than_plain_when_every_draft_is_a_loss(trace, monkeypatch):
    """≥ 0.97x plain on a long decode, for every seed; and over short ones (48 tokens, as bench
    decodes, where exploring the first rounds weighs most), on average and ≥ 0.96x for each."""
    for seed in range(3):
        speedup, _ = simulate(monkeypatch, **LOSING_TRACES[trace], seed=seed)
        assert speedup >= 0.97, (trace, seed, speedup)
    short = [simulate(monkeypatch, **LOSING_TRACES[trace], tokens=48, seed=seed)[0] for seed in range(30)]
    assert sum(short) / len(short) >= 0.97 and min(short) >= 0.96, (trace, short)


@pytest.mark.parametrize("lookups, models", [([("suffix", 0.9, 0.0), ("ngram", 0.1, 0.0)], []),
                                              ([("ngram", 0.1, 0.0)], [("plan", 0.9, 0.1)])])
def test_auto_drafts_when_drafts_pay(lookups, models, monkeypatch):
    """α 0.9 and a cheap draft: the arbiter drafts with it most rounds and earns its speedup."""
    good = (lookups + models)[0 if lookups[0][1] > 0.5 else -1][0]
    for tokens, floor in [(2000, 1.7), (48, 1.3)][: 2 if not models else 1]:  # a model draft's first try
        # waits for its probe (its prior does not pay): 48 tokens are too few to show its speedup
        speedup, rounds = simulate(monkeypatch, lookups, models, tokens=tokens)
        assert speedup >= floor, (tokens, speedup)
        assert rounds.get(good, 0) > 2 * sum(n for name, n in rounds.items() if name != good), rounds


def test_the_ledger_bounds_the_loss_of_drafts_that_the_model_prices_wrong(monkeypatch):
    """However wrong the formula (here: told verify passes are free), a decode never falls more
    than loss_credit + loss_budget per round (plus one round) behind plain."""
    speedup, rounds = simulate(monkeypatch, lookups=[("ngram", 0.0, 0.0)], slope=0.5, probe_slope=0.0, tokens=48)
    arbiter_bound = 0.3 + 0.02 * 48 + 0.5 * 8  # the credit, the budget, one misjudged 8-token round
    assert 48 / speedup - 48 <= arbiter_bound and speedup >= 0.9


def test_a_self_draft_that_could_not_pay_is_never_tried():
    """A saved skip plan that runs 59 of 60 sub-layers costs ~a step a token: even with every token
    accepted it gains nothing, so it is never probed (its one try cost SmolLM2's chat answer about
    a step). The plan's share of sub-layers is its cost before it is measured; a cheap one is tried."""
    def plan_draft(name, cost):
        draft = FixedLookup(name, [1, 2, 3, 4])
        draft.plan = SimpleNamespace(cost=cost)
        return draft

    for cost, tried in ((59 / 60, False), (0.3, True)):
        arbiter = Arbiter([], [plan_draft("plan", cost)], pass_costs=CHEAP_VERIFY)
        arbiter.observe(RoundOutcome(None, 0, 0, 0.0, 0.010))
        drafted = []
        for _ in range(40):
            proposal = arbiter.propose(STATE, 8)
            drafted.append(len(proposal.tokens))
            arbiter.observe(RoundOutcome(proposal.source if proposal.tokens else None, len(proposal.tokens),
                                         len(proposal.tokens), 0.0, 0.010))
        assert any(drafted) is tried, (cost, drafted)
