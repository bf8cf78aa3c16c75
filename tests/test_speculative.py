"""Lossless speculative decoding: greedy equality, the acceptance rule, and the distribution."""

import random
import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from layerplan.decoding.acceptance import accept_draft, accept_greedy
from layerplan.decoding.choice import seeded_generator
from layerplan.decoding.draft_length import AdaptiveLength, HeuristicLength, SharedRounds, expected_speedup
from layerplan.decoding.drafters.model import ModelDrafter
from layerplan.decoding.drafters.ngram import NgramDrafter
from layerplan.decoding.drafters.plan import PlanDrafter
from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.drafters.staged import StagedDrafter
from layerplan.decoding.generate import generate
from layerplan.decoding.rounds import target_pick, target_probs
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.speculative import speculative_generate
from layerplan.engine.executors import use_native
from layerplan.engine.runner import ModelPasses, forward, new_cache
from layerplan.engine.tree import TreeShape
from layerplan.models.loading import wrap_model
from layerplan.plan.plan import PlanError
from tiny import ARCHS, VOCAB, tiny_config, tiny_hf, tiny_model

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8]  # repeats, so n-gram lookup has something to find


# ----- the acceptance rule on hand-made distributions ----------------------------------------
def one_hot(i, v=5):
    return torch.nn.functional.one_hot(torch.tensor(i), v).float()


def test_greedy_rule_accepts_prefix_then_recovers():
    target = torch.stack([one_hot(1), one_hot(2), one_hot(4), one_hot(0)])  # argmaxes 1, 2, 4 | bonus 0
    verdict = accept_draft([1, 2, 3], target, None)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (2, 4, False)
    assert verdict.emitted([1, 2, 3]) == [1, 2, 4]


def test_greedy_rule_all_accepted_gives_bonus():
    target = torch.stack([one_hot(1), one_hot(2), one_hot(3)])
    verdict = accept_draft([1, 2], target, torch.stack([one_hot(1), one_hot(2)]))
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (2, 3, True)


def test_empty_draft_is_a_plain_step():
    verdict = accept_draft([], torch.stack([one_hot(3)]), None)
    assert (verdict.accepted, verdict.next_token, verdict.bonus) == (0, 3, True)


def test_sampled_rule_residual_excludes_overproposed_mass():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])  # the draft always proposes token 1; p(1)/q(1) = 0.5
    counts = {"accepted": 0, "recovered": 0}
    g = seeded_generator(0)
    for _ in range(4000):
        verdict = accept_draft([1], p, q, g)
        if verdict.accepted:
            counts["accepted"] += 1
            assert verdict.next_token == 0  # bonus from p[1]
        else:
            counts["recovered"] += 1
            assert verdict.next_token == 0  # residual max(0, p - q) = [0.5, 0, 0]
    assert abs(counts["accepted"] / 4000 - 0.5) < 0.03


def test_rule_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="need 3 target distributions for 2 drafted tokens"):
        accept_draft([1, 2], torch.ones(2, 5) / 5, None)


# ----- greedy: identical to plain greedy, token for token (float32) ---------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_plain_for_every_drafter(arch):
    model = tiny_model(arch, num_layers=4)
    plain = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False).token_ids
    for draft in ["ngram", "exit:2", "skip:attn=1;mlp=2", "skip:attn=1-2", "ngram|exit:3", "auto", "window:2,3"]:
        for policy in ["fixed", "heuristic", "adaptive"]:
            result = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False, draft=draft, draft_length=policy)
            assert result.token_ids == plain, (draft, policy)
            stats = result.stats
            assert stats["emitted"] == len(result.token_ids) - 1  # the first token comes from the prefill
            assert stats["accepted"] <= stats["drafted"]


def test_greedy_with_a_separate_draft_model_and_stop_at_eos():
    model = tiny_model("llama", num_layers=3, seed=0)
    draft_model = wrap_model(tiny_hf("llama", num_layers=2, seed=1))
    drafter = ModelDrafter(draft_model, ModelPasses(draft_model))
    plain = generate(model, PROMPT, max_new_tokens=20)
    result = generate(model, PROMPT, max_new_tokens=20, draft=drafter, draft_length="fixed")
    assert result.token_ids == plain.token_ids and result.stop_reason == plain.stop_reason
    # the drafter caught up with the accepted text, cropping its own cache as needed
    assert drafter.fed[: len(PROMPT)] == PROMPT


def test_greedy_on_a_frankenmerge_target_with_exit_draft():
    model = tiny_model("qwen2", num_layers=3)
    target = model.plan("0,1,1,2")
    plain = generate(model, PROMPT, plan=target, max_new_tokens=16, stop_at_eos=False).token_ids
    result = generate(model, PROMPT, plan=target, max_new_tokens=16, stop_at_eos=False, draft="exit:3")
    assert result.token_ids == plain


def test_draft_plan_must_share_the_cache_layout():
    model = tiny_model("llama", num_layers=3)
    with pytest.raises(PlanError, match="not a sub-plan of the target"):
        generate(model, PROMPT, max_new_tokens=4, draft="0,2,1")


def test_ready_made_drafters_are_checked_like_named_ones():
    model = tiny_model("llama", num_layers=3)
    deeper = PlanDrafter(model.plan("0,1,1,2"))  # four steps: the full target has three KV slots
    for draft in (deeper, StagedDrafter([NgramDrafter(), deeper])):
        with pytest.raises(PlanError, match="not a sub-plan of the target"):
            generate(model, [5, 6, 7], max_new_tokens=4, draft=draft)  # no n-gram match: the plan drafts
    dynamic = make_drafter("dynamic:confidence=0.5", model)
    with pytest.raises(PlanError, match="not a sub-plan"):
        make_drafter(dynamic, model, model.plan("skip:attn=1"))
    with pytest.raises(ValueError, match="built for"):
        make_drafter(dynamic, tiny_model("llama", num_layers=3))


def test_every_drafter_checks_model_and_target_alike():
    model = tiny_model("llama", num_layers=3)
    drafters = [make_drafter(spec, model) for spec in ("ngram", "exit:2", "window:2,3", "dynamic:confidence=0.5",
                                                        "ngram|exit:1", "skip:attn=1")]
    small = tiny_model("llama", num_layers=2)
    drafters.append(ModelDrafter(small, ModelPasses(small)))
    for drafter in drafters:
        drafter.check(model, model.plan())  # one signature: (model, target plan)
    config = tiny_config("llama", 2)
    config.vocab_size = VOCAB // 2
    small_vocab = wrap_model(AutoModelForCausalLM.from_config(config).eval())
    with pytest.raises(ValueError, match="vocabulary"):
        ModelDrafter(small_vocab, ModelPasses(small_vocab)).check(model, model.plan())


def test_draft_confidence_stops_every_drafter_that_runs_a_model():
    """--draft-confidence is not only for model:PATH drafts: every drafter that runs a model keeps
    one token and stops its round below the threshold (here: always)."""
    model = tiny_model("llama", num_layers=3)
    for spec in ("exit:1", "window:2,3", "dynamic:confidence=0.5"):
        result = generate(model, PROMPT, max_new_tokens=8, draft=spec, draft_length="fixed", draft_confidence=1.01)
        assert len(result.stats["drafted_at"]) == 1, spec


class _TreeWithDraftProbs:
    """Proposes a two-root token tree with draft distributions: node 1 is a sibling of node 0,
    node 2 node 0's child, so the first chain is nodes 0 and 2."""

    name = "tree-with-q"

    def check(self, model, target) -> None:
        pass

    def propose(self, state, max_tokens):
        q = np.full((3, VOCAB), 0.5 / (VOCAB - 1))
        for node, token in enumerate((11, 12, 13)):
            q[node, token] = 0.5
        return Proposal([11, 12, 13], q, tree=TreeShape((-1, -1, 0)))


def test_a_tree_with_draft_distributions_is_accepted_as_its_first_chain_with_its_q_rows(monkeypatch):
    """A round checks such a tree as its first chain, whose q rows are its nodes' (0 and 2), alone
    and in a batch's pass."""
    from layerplan.decoding import rounds
    from layerplan.decoding.speculative import SpeculativeDecoding

    seen = []
    verdict = rounds.chain_verdict
    monkeypatch.setattr(rounds, "chain_verdict", lambda context, draft, draft_probs, *rest: (
        seen.append((draft, draft_probs)), verdict(context, draft, draft_probs, *rest))[1])
    model = tiny_model("llama", num_layers=2)
    tree = _TreeWithDraftProbs().propose(None, 3)
    for batched in (False, True):
        decoding = SpeculativeDecoding(model, PROMPT, _TreeWithDraftProbs(), max_new_tokens=6,
                                       sampling=SamplingParams(temperature=1.0), seed=1, draft_length="fixed")
        decoding.prefill()
        if batched:
            ids, cache, position = decoding.next_pass()
            decoding.take_pass(forward(model, ids, decoding.plan, cache, position)[0])
        else:
            decoding.round()
        draft, draft_probs = seen[-1]
        assert draft == [11, 13] and np.array_equal(draft_probs, tree.probs[[0, 2]]), batched


def test_cache_after_a_round_holds_exactly_the_verified_prefix():
    """Run one draft round by hand: after crop, the next step sees the accepted prefix only."""
    model = tiny_model("mistral", num_layers=3)
    plan = model.plan()
    ids = torch.tensor([PROMPT])
    cache = new_cache(plan)
    forward(model, ids[:, :-1], plan, cache, 0)
    state = DraftState(model, plan, cache, PROMPT, SamplingParams(), passes=ModelPasses(model))
    proposal = make_drafter("exit:1", model).propose(state, 3)
    assert len(proposal.tokens) == 3
    verify = forward(model, torch.tensor([PROMPT[-1:] + proposal.tokens]), plan, cache, len(PROMPT) - 1)[0]
    picks = [target_pick(row, SamplingParams(), [], 0) for row in verify.numpy()]  # greedy: one-hot p
    verdict = accept_draft(proposal.tokens, np.eye(verify.shape[-1])[picks], proposal.probs)
    cache.crop(len(PROMPT) + verdict.accepted)
    kept = PROMPT + proposal.tokens[: verdict.accepted]
    step = forward(model, torch.tensor([[verdict.next_token]]), plan, cache, len(kept))[0, -1]
    fresh = forward(model, torch.tensor([kept + [verdict.next_token]]))[0, -1]
    assert (step - fresh).abs().max() < 1e-4


def test_windowed_draft_equals_transformers_with_the_same_mask():
    """A windowed read attends to the first 2 and last 3 positions: the same as transformers run
    with a custom 4-D mask that allows exactly those keys for the last query."""
    model = tiny_model("llama", num_layers=2)
    context = list(range(3, 23))
    length = len(context)
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[-1] = False
    allowed[-1, [0, 1, length - 3, length - 2, length - 1]] = True
    with torch.no_grad():
        reference = model.hf(torch.tensor([context]), attention_mask=allowed[None, None]).logits[0, -1]
    plan = model.plan()
    cache = new_cache(plan)
    forward(model, torch.tensor([context[:-1]]), plan, cache, 0)
    cache.read_window = (2, 3)
    windowed = forward(model, torch.tensor([context[-1:]]), plan, cache, length - 1)[0, -1]
    cache.read_window = None
    assert (windowed - reference).abs().max() < 1e-4
    full = forward(model, torch.tensor([context]))[0, -1]
    assert (full - windowed).abs().max() > 1e-3  # the window really changed something
    assert make_drafter("window:2,3", model).window == (2, 3)
    with pytest.raises(ValueError, match="expected window:SINK,RECENT"):
        make_drafter("window:4", model)


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    state = DraftState(None, None, None, [1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2, 3], SamplingParams())
    assert NgramDrafter().propose(state, 3).tokens == [7, 1, 2]
    assert NgramDrafter().propose(DraftState(None, None, None, [1, 2, 3], SamplingParams()), 3).tokens == []


def _ngram_by_scan(tokens: list[int], max_tokens: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Prompt lookup by its definition: the latest earlier occurrence of the last n tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == tokens[-n:]:
                return tokens[start + n: start + n + max_tokens]
    return []


def test_the_indexed_ngram_lookup_proposes_what_the_scan_does():
    """The index grows with the context (rounds that add one token or several), and starts over on
    a context that does not extend it (a new request), proposing what a scan of the whole context
    proposes, for several n-gram ranges."""
    rng = random.Random(5)
    for max_n, min_n in ((4, 1), (3, 2), (1, 1)):
        drafter = NgramDrafter(max_n, min_n)
        for _ in range(6):  # requests
            tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
            while len(tokens) < 80:
                state = DraftState(None, None, None, list(tokens), SamplingParams())
                limit = rng.randrange(1, 9)
                assert drafter.propose(state, limit).tokens == _ngram_by_scan(tokens, limit, max_n, min_n)
                tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 6))]


# ----- sampling: the output has the target's distribution ------------------------------------
def exact_joint(model, prompt, params, length):
    """P(t1..tL) of the target model, by enumerating every continuation (top-k keeps it small)."""
    table = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in table.items():
            context = prompt + list(prefix)
            logits = forward(model, torch.tensor([context], device=model.device))[0, -1]
            probs = target_probs(logits.float().cpu().numpy(), params, context, len(prompt))
            for token in np.flatnonzero(probs).tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        table = grown
    return table


def empirical(model, prompt, params, length, runs, draft):
    counts = {}
    for seed in range(runs):
        out = generate(model, prompt, max_new_tokens=length, sampling=params, seed=seed, stop_at_eos=False,
                       draft=draft, draft_length="fixed")
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p(counts, table, runs):
    keys = sorted(table)
    observed = [counts.get(k, 0) for k in keys]
    assert sum(observed) == runs, "a sampled sequence has zero probability under the target"
    total = sum(table.values())
    expected = [table[k] / total * runs for k in keys]
    from scipy.stats import chisquare  # (1.5 s of import, for the statistical tests alone)

    return chisquare(observed, expected).pvalue


def total_variation(counts, table, runs):
    keys = set(counts) | set(table)
    return 0.5 * sum(abs(counts.get(k, 0) / runs - table.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize("draft", ["exit:1", "ngram"])
def test_speculative_sampling_preserves_the_target_distribution(draft):
    """3 tokens with top-k 3 and a repetition penalty: 27 possible sequences, 2500 seeded runs.
    Stated bounds: the chi-square test against the exact enumeration does not reject at
    p < 0.001, and the total variation distance is below 0.08 (its expected value here is
    ≤ 0.045). Power: the draft's own distribution is more than 0.3 away from what we sample.
    On the native kernels, the CPU's default engine: several times faster than on the modules, and the
    rule under test (speculative.py) is the same whatever engine gives the logits."""
    model = tiny_model("llama", num_layers=3, seed=2)
    use_native(model)
    counts = assert_draws_keep_the_target_distribution(model, draft, runs=2500, most_apart=0.08)
    assert total_variation(counts, exact_joint_draft(model, DISTRIBUTION_PROMPT, DISTRIBUTION_PARAMS, 3), 2500) > 0.3


DISTRIBUTION_PROMPT = [5, 6, 7, 5, 6]
# (every penalty: the repetition penalty over the context, presence and frequency over what was generated)
DISTRIBUTION_PARAMS = SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1.3, presence_penalty=0.4,
                                     frequency_penalty=0.3)


def assert_draws_keep_the_target_distribution(model, draft, runs: int, most_apart: float) -> dict:
    """`runs` seeded 3-token samples of DISTRIBUTION_PROMPT with `draft` (top-k 3, a repetition
    penalty: 27 possible sequences): the chi-square test against the target's exact enumeration
    does not reject at p < 0.001, and the total variation distance is below `most_apart`. Returns
    the counts."""
    table = exact_joint(model, DISTRIBUTION_PROMPT, DISTRIBUTION_PARAMS, 3)
    assert sum(table.values()) == pytest.approx(1.0)
    counts = empirical(model, DISTRIBUTION_PROMPT, DISTRIBUTION_PARAMS, 3, runs, draft)
    assert chi_square_p(counts, table, runs) > 1e-3
    assert total_variation(counts, table, runs) < most_apart
    return counts


def exact_joint_draft(model, prompt, params, length):
    plan = model.plan("exit:1")
    table = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in table.items():
            context = prompt + list(prefix)
            probs = target_probs(forward(model, torch.tensor([context]), plan)[0, -1].numpy(), params, context,
                                 len(prompt))
            for token in np.flatnonzero(probs).tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        table = grown
    return table


# ----- draft length ----------------------------------------------------------------------------
def test_expected_speedup_formula():
    assert expected_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert expected_speedup(1.0, 3, 0.0) == pytest.approx(4.0)


def test_adaptive_length_falls_back_to_plain_when_drafting_does_not_pay():
    policy = AdaptiveLength(max_gamma=8, probe_every=5)
    policy.update(0, 0, 0, 0.0, 1.0)  # a plain step costs 1 s
    assert policy.next_gamma() == policy.gamma  # one drafting round to measure
    for _ in range(5):
        policy.update(4, 4, 0, 3.6, 1.1)  # draft steps cost 0.9 each, nothing accepted
    gammas = [policy.next_gamma() for _ in range(10)]
    assert gammas.count(0) == 8 and gammas.count(1) == 2  # plain, probing every 5 rounds


def test_adaptive_length_drafts_long_when_drafts_are_free_and_good():
    policy = AdaptiveLength(max_gamma=8)
    policy.update(0, 0, 0, 0.0, 1.0)
    for _ in range(10):
        policy.update(8, 8, 7, 0.001, 1.05)
    assert policy.next_gamma() >= 6


def test_adaptive_length_in_a_busy_pass_drafts_less():
    """In a batch the speedup is the pass's: (others + E(α, γ)) tokens for c(others + 1 + γ)
    against others + 1 for c(others + 1). Where rows are nearly free (a flat cost curve) a full
    batch leaves fewer free rows to fill with drafts; where a pass turns compute-bound past 4 rows
    (steep), a busy one drafts nothing."""
    flat = {k: 1.0 + 0.03 * (k - 1) for k in range(1, 17)}
    steep = {k: 1.0 + 0.05 * (k - 1) if k <= 4 else 1.15 + 0.3 * (k - 4) for k in range(1, 17)}
    chosen = {}
    for name, costs in (("flat", flat), ("steep", steep)):
        policy = AdaptiveLength(max_gamma=8, pass_costs=costs)
        policy.update(0, 0, 0, 0.0, 1.0)
        for _ in range(10):
            policy.update(4, 4, 2, 0.0, 1.1)  # free lookup drafts, α about 0.66
        chosen[name] = [policy.best_gamma(others) for others in (0, 1, 3, 6, 10, 15)]
    assert chosen["flat"][0] == 6 and chosen["flat"] == sorted(chosen["flat"], reverse=True) and chosen["flat"][4] > 0
    assert chosen["steep"][0] > 0 and chosen["steep"][2:] == [0, 0, 0, 0]
    # by hand, steep at others = 3: plain 4 tokens / 1.15 = 3.48 a step; γ = 1: (3 + 1.66) / 1.45 = 3.21
    assert AdaptiveLength(max_gamma=8).next_gamma(others=3) == 0  # nothing measured yet: plain first


def test_adaptive_length_without_the_probes_costs_drafts_only_in_a_pass_of_its_own():
    """No pass costs (no probe on this machine): what a request measures of its own verify passes
    says nothing of a batch's other rows, so a shared pass drafts nothing; alone, the same
    measurements draft as before."""
    policy = AdaptiveLength(max_gamma=8)
    policy.update(0, 0, 0, 0.0, 1.0)
    for _ in range(10):
        policy.update(8, 8, 7, 0.001, 1.05)  # free, well-accepted drafts
    assert policy.next_gamma(others=0) >= 6
    assert [policy.best_gamma(others) for others in (1, 3, 15)] == [0, 0, 0]


def test_requests_that_share_their_rounds_start_from_what_the_others_measured():
    """A server's requests of one drafter share what they measure (SharedRounds): where drafts do
    not pay, a new request decodes plainly from its first round instead of spending a drafting
    round and its prior (α = 0.5) finding that out again; in a shared pass of 4 requests each
    probes 4 times less often, so the pass probes at one request's rate."""
    shared = SharedRounds()
    first = AdaptiveLength(max_gamma=8, probe_every=5, shared=shared)
    first.update(0, 0, 0, 0.0, 1.0)  # a plain step: 1 s
    for _ in range(6):
        first.update(4, 4, 0, 3.6, 1.1)  # draft steps of 0.9 s, nothing accepted
    assert shared.plain_step == first.plain_step and shared.draft_step == first.draft_step
    assert shared.accepted_count < 0.6 and shared.rejected_count > 4
    alone = AdaptiveLength(max_gamma=8, probe_every=5)
    alone.update(0, 0, 0, 0.0, 1.0)
    assert alone.next_gamma() == alone.gamma  # a request on its own: one drafting round to measure
    later = AdaptiveLength(max_gamma=8, probe_every=5, shared=shared)
    assert [later.next_gamma() for _ in range(10)] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]  # plain; probes every 5
    costs = {k: 1.0 + 0.05 * (k - 1) if k <= 4 else 1.15 + 0.3 * (k - 4) for k in range(1, 17)}
    busy = AdaptiveLength(max_gamma=8, probe_every=5, shared=shared, pass_costs=costs)
    gammas = [busy.next_gamma(others=3) for _ in range(40)]
    assert gammas.count(1) == 2 and gammas.index(1) == 19  # a probe every 5 x 4 rounds
    # what the probes find goes to the others: accepted drafts raise the shared acceptance
    before = shared.accepted_count
    busy.update(1, 1, 1, 0.0, 1.2)
    assert shared.accepted_count > before * busy.decay


def test_a_seeded_sample_drafts_by_its_own_rounds_and_repeats_itself(monkeypatch):
    """With a seed and a temperature the draft length defaults to the heuristic schedule, which
    follows the rounds' outcomes alone: the same tokens whatever a server's other requests measured
    and however the clock runs. A policy named is kept; greedy and unseeded runs keep adaptive."""
    from layerplan.decoding import speculative
    from layerplan.decoding.speculative import SpeculativeDecoding

    model = tiny_model("llama", 3)
    params = SamplingParams(temperature=1.3)

    def run(shared: SharedRounds) -> list[int]:
        return SpeculativeDecoding(model, PROMPT, "ngram", max_new_tokens=24, sampling=params, seed=11,
                                   stop_at_eos=False, shared_rounds=shared).run().token_ids

    first = run(SharedRounds())
    measured = SharedRounds()  # what a server's other requests learned: drafts never pay
    drafted = AdaptiveLength(max_gamma=8, shared=measured)
    drafted.update(0, 0, 0, 0.0, 1.0)
    for _ in range(6):
        drafted.update(4, 4, 0, 3.6, 1.1)
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: next(ticks) * 0.37)  # another clock
    assert run(measured) == first
    assert isinstance(SpeculativeDecoding(model, PROMPT, "ngram", sampling=params, seed=11).lengths, HeuristicLength)
    for kept in ({"sampling": params, "seed": 11, "draft_length": "adaptive"}, {"sampling": params},
                 {"seed": 11}):
        assert isinstance(SpeculativeDecoding(model, PROMPT, "ngram", **kept).lengths, AdaptiveLength), kept


def test_heuristic_schedule():
    policy = HeuristicLength(4)
    policy.update(4, 4, 4, 0, 0)
    assert policy.next_gamma() == 6
    policy.update(6, 6, 2, 0, 0)
    assert policy.next_gamma() == 5


@pytest.mark.real
def test_real_model_greedy_speculative_equals_plain_in_float32(smollm2):
    ids = smollm2.encode("class Stack:\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n")
    plain = generate(smollm2, ids, max_new_tokens=32).token_ids
    for draft in ["ngram", "skip:attn=5-8", "exit:24"]:
        result = speculative_generate(smollm2, ids, draft, max_new_tokens=32, draft_length="fixed")
        assert result.token_ids == plain, draft


def _folder_model(tmp_path):
    """A tiny checkpoint from a folder of its own (a self:bits= draft quantizes it again from there)."""
    from layerplan.engine.load import load_model
    from tiny import tiny_hf

    tiny_hf("llama", num_layers=3, seed=2).save_pretrained(tmp_path / "m")
    return load_model(tmp_path / "m", dtype="float32")


@pytest.mark.parametrize("draft", ["self:bits=q8_0", "self:bits=q4_0", "self:bits=q8_0/exit:2", "self:bits=q5_0-fast"])
def test_a_quantized_copy_drafts_losslessly(tmp_path, draft):
    """self:bits=: the model quantized again at load to fewer bits drafts for it (its own KV
    cache); greedy output stays the plain greedy output."""
    from layerplan.decoding.drafters.registry import make_drafter

    model = _folder_model(tmp_path)
    drafter = make_drafter(draft, model)
    assert drafter.name == draft and drafter.model.stored is not None  # the copy runs on the block kernels
    prompt = [5, 6, 7, 5, 6, 1, 2]
    out = generate(model, prompt, max_new_tokens=24, draft=draft, draft_length="fixed", stop_at_eos=False)
    assert out.token_ids == generate(model, prompt, max_new_tokens=24, stop_at_eos=False).token_ids
    assert out.stats["drafted"] > 0
    if draft == "self:bits=q8_0":  # 8 bits agree with the float32 model (4 bits of a tiny random one often not)
        assert out.stats["accepted"] > out.stats["drafted"] / 2


def test_a_quantized_copys_samples_keep_the_target_distribution(tmp_path):
    """As test_speculative_sampling_preserves_the_target_distribution, with a q4_0 copy drafting
    (2000 seeded runs; chi-square against the exact enumeration, p > 0.001; TV < 0.08)."""
    assert_draws_keep_the_target_distribution(_folder_model(tmp_path), "self:bits=q4_0", runs=2000, most_apart=0.08)


@pytest.mark.parametrize("draft,message", [
    ("self:bits=q9_9", "expected self:bits=FORMAT[/PLAN] with FORMAT one of q8_0"),
    ("self:bit=q4_0", "expected self:bits=FORMAT"),
    ("self", "expected self:bits=FORMAT"),
])
def test_a_bad_quantized_copy_spec_is_named(tmp_path, draft, message):
    from layerplan.decoding.drafters.registry import make_drafter

    with pytest.raises(ValueError, match=re.escape(message)):
        make_drafter(draft, tiny_model("llama", num_layers=1))
    with pytest.raises(ValueError, match="quantizes the model again from its file"):
        make_drafter("self:bits=q4_0", tiny_model("llama", num_layers=1))


@pytest.mark.parametrize("picks", [[3, 1, 4, 1], [3, 1, 4, 2], [0, 1, 4, 1], [3, 2, 2, 2]])
@pytest.mark.parametrize("draft_q", ["deterministic", "drawn"])
def test_greedy_verdict_from_picks_is_accept_drafts(picks, draft_q):
    """accept_greedy gives what accept_draft gives on the one-hot distributions of a greedy target,
    for deterministic proposals and for proposals drawn from a q of their own."""
    vocab, draft = 6, [3, 1, 4]
    target = torch.nn.functional.one_hot(torch.tensor(picks), vocab).float()
    q = None
    if draft_q == "drawn":
        q = torch.full((len(draft), vocab), 0.1)
        for i, token in enumerate(draft):
            q[i, token] = 0.5
    want = accept_draft(draft, target, q, seeded_generator(0))
    assert accept_greedy(draft, picks) == want


def test_greedy_verdict_needs_a_pick_per_position():
    with pytest.raises(ValueError, match="need 3 target picks for 2 drafted tokens, got 2"):
        accept_greedy([1, 2], [1, 2])
