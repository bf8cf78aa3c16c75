"""Token-tree passes (engine/tree.py): a node's logits equal those of a chain of its path, and the
cache keeps the accepted path as if it had been run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerplan.decoding.choice import seeded_generator
from layerplan.decoding.drafters.proposal import Proposal
from layerplan.decoding.drafters.suffix import SuffixDrafter
from layerplan.decoding.generate import generate
from layerplan.engine import native
from layerplan.engine.executors import use_native
from layerplan.engine.runner import ModelPasses, forward, new_cache
from layerplan.engine.tree import TreeShape
from tiny import tiny_model

# two roots; node 3 continues node 1, node 6 continues node 2, node 5 continues node 4
TREE = TreeShape((-1, 0, 0, 1, -1, 4, 2))
PROMPT = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(11))
NODES = torch.randint(3, 96, (1, len(TREE)), generator=torch.Generator().manual_seed(12))


def test_tree_shape():
    assert TREE.depths == (0, 1, 1, 2, 0, 1, 2)
    assert TREE.path(3) == [0, 1, 3] and TREE.path(6) == [0, 2, 6] and TREE.path(4) == [4]
    assert TREE.children(-1) == [0, 4] and TREE.children(0) == [1, 2]
    assert TREE.ancestors[3].tolist() == [True, True, False, True, False, False, False]
    assert TreeShape.chain(3).parents == (-1, 0, 1)
    for bad in [(), (0,), (-1, 1), (-1, -2), (-1, 0.5)]:
        with pytest.raises(ValueError):
            TreeShape(bad)


def _model(arch, engine, dtype=torch.float32):
    model = tiny_model(arch, dtype=dtype)
    if engine == "native":
        if native.native_available() is not None:
            pytest.skip(native.native_available())
        use_native(model)
    return model


@pytest.mark.parametrize("engine", ["eager", "native"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gpt2"])
def test_each_node_equals_a_chain_of_its_path(arch, engine):
    model = _model(arch, engine)
    plan = model.plan()
    cache = new_cache(plan)
    forward(model, PROMPT, plan, cache, 0)
    start = PROMPT.shape[1]
    logits = forward(model, NODES, plan, cache, start, tree=TREE)
    for node in range(len(TREE)):
        path = TREE.path(node)
        chain_cache = new_cache(plan)
        forward(model, PROMPT, plan, chain_cache, 0)
        chain = forward(model, NODES[:, path], plan, chain_cache, start)
        if engine == "native" and not model.native.eager_sub_layers():  # the same kernels, keys summed in the same order
            assert torch.equal(logits[0, node], chain[0, -1]), f"node {node}"
        else:
            torch.testing.assert_close(logits[0, node], chain[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", ["eager", "native"])
def test_keeping_a_path_leaves_the_cache_of_that_path_alone(engine):
    model = _model("llama", engine)
    plan = model.plan("0,1,1,2")  # a repeated layer: its own slot moves too
    start = PROMPT.shape[1]
    for node in (3, 5, 6, 0):
        path = TREE.path(node)
        cache = new_cache(plan)
        forward(model, PROMPT, plan, cache, 0)
        forward(model, NODES, plan, cache, start, tree=TREE)
        cache.keep_path(start, path)
        alone = new_cache(plan)
        forward(model, PROMPT, plan, alone, 0)
        forward(model, NODES[:, path], plan, alone, start)
        assert cache.length == alone.length == start + len(path)
        for slot in range(len(plan.steps)):
            end = start + len(path)
            torch.testing.assert_close(cache.keys[slot][:, :, :end], alone.keys[slot][:, :, :end], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.values[slot][:, :, :end], alone.values[slot][:, :, :end], atol=1e-5, rtol=1e-5)
        follow = torch.tensor([[7]])
        torch.testing.assert_close(forward(model, follow, plan, cache, start + len(path)),
                                   forward(model, follow, plan, alone, start + len(path)), atol=1e-5, rtol=1e-5)


def test_bf16_native_tree_nodes_equal_chains_bit_for_bit():
    model = _model("qwen3", "native", torch.bfloat16)
    plan = model.plan()
    cache = new_cache(plan)
    forward(model, PROMPT, plan, cache, 0)
    logits = forward(model, NODES, plan, cache, PROMPT.shape[1], tree=TREE)
    for node in (3, 5, 6):
        chain_cache = new_cache(plan)
        forward(model, PROMPT, plan, chain_cache, 0)
        chain = forward(model, NODES[:, TREE.path(node)], plan, chain_cache, PROMPT.shape[1])
        assert torch.equal(logits[0, node], chain[0, -1])


def test_trees_refuse_sliding_window_layers():
    model = tiny_model("gemma3")  # alternates sliding-window and full layers
    plan = model.plan()
    cache = new_cache(plan)
    forward(model, PROMPT, plan, cache, 0)
    with pytest.raises(ValueError, match="sliding window"):
        forward(model, NODES, plan, cache, PROMPT.shape[1], tree=TREE)


def test_tree_size_must_match_the_pass():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="7 nodes for a pass over 3"):
        forward(model, NODES[:, :3], model.plan(), new_cache(model.plan()), 0, tree=TREE)


# ----- speculative decoding with token trees ------------------------------------------------------

class _BranchingOracle:
    """Knows the plain greedy continuation; proposes a wrong first branch and the right one second
    (so only a tree check accepts it), each two deep."""

    name = "oracle-tree"

    def __init__(self, continuation: list[int], prompt_length: int) -> None:
        self.continuation, self.prompt_length = continuation, prompt_length

    def check(self, model, target) -> None:
        pass

    def propose(self, state, max_tokens):
        done = len(state.tokens) - self.prompt_length  # generated so far, the pending token included
        right = self.continuation[done: done + 2]
        if len(right) < 2 or max_tokens < 4:
            return Proposal()
        wrong = (right[0] + 1) % 96
        return Proposal([wrong, wrong, right[0], right[1]], None, tree=TreeShape((-1, 0, -1, 2)))


def test_a_greedy_tree_round_accepts_the_branch_the_target_picks():
    model = tiny_model("llama")
    prompt = [5, 9, 14, 3, 22, 7]
    plain = generate(model, prompt, max_new_tokens=20, stop_at_eos=False).token_ids
    result = generate(model, prompt, max_new_tokens=20, stop_at_eos=False, draft=_BranchingOracle(plain, len(prompt)),
                      draft_length="fixed")
    assert result.token_ids == plain
    # the right tokens sit in the second branch only: a chain check (the first branch) accepts none
    assert result.stats["accepted"] >= 8 and result.stats["mean_accepted_length"] > 1.8


def test_sampling_checks_the_first_chain_of_a_tree():
    proposal = Proposal([4, 5, 6, 7], None, tree=TreeShape((-1, 0, -1, 1)))
    assert proposal.first_chain().tokens == [4, 5, 7]


@pytest.mark.parametrize("engine", ["eager", "native"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gpt2"])
def test_greedy_suffix_trees_equal_plain(arch, engine):
    model = _model(arch, engine)
    prompt = [5, 9, 14, 3, 22, 7, 5, 9, 14, 8, 22, 7, 5, 9]  # repeats with two continuations of "5 9 14"
    plain = generate(model, prompt, max_new_tokens=24, stop_at_eos=False).token_ids
    for spec in ["suffix:tree", "suffix:tree,share=0.1"]:
        result = generate(model, prompt, max_new_tokens=24, stop_at_eos=False, draft=spec, draft_length="fixed")
        assert result.token_ids == plain, spec


def test_suffix_tree_branches_where_the_corpus_disagrees():
    drafter = SuffixDrafter(corpus=[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9, 9]], tree=True)
    proposal = drafter.propose(_State([7, 1, 2]), 6)
    # after "1 2": 3 (two of three) then 4, and 9 (one of three) then 9
    assert proposal.tree is not None
    assert proposal.tokens[:2] == [3, 9] and proposal.tree.parents[:2] == (-1, -1)
    assert sorted(zip(proposal.tokens, proposal.tree.parents))[:4] == [(3, -1), (4, 0), (9, -1), (9, 1)]


class _State:
    def __init__(self, tokens):
        self.tokens = tokens


@pytest.mark.real
def test_real_model_suffix_trees_equal_plain(smollm2):
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    ids = smollm2.encode(prompt)
    plain = generate(smollm2, ids, max_new_tokens=32).token_ids
    result = generate(smollm2, ids, max_new_tokens=32, draft="suffix:tree")
    assert result.token_ids == plain
    assert result.stats["accepted"] > 0


# ----- the acceptance rule on trees ------------------------------------------------------------

# the pass: node 0 pending; its children 1 (token 2), 2 (token 0), 3 (token 2 again); node 1's child 4 (token 1)
PASS = TreeShape((-1, 0, 0, 0, 1))
PASS_TOKENS = [9, 2, 0, 2, 1]
P = {0: [0.1, 0.2, 0.4, 0.2, 0.1], 1: [0.3, 0.3, 0.1, 0.2, 0.1], 2: [0.05, 0.05, 0.1, 0.2, 0.6],
     3: [0.2] * 5, 4: [0.5, 0.1, 0.1, 0.1, 0.2]}


def _emitted_distributions(rule, draws=40_000):
    generator = seeded_generator(1234)
    probs = {node: np.array(p) for node, p in P.items()}  # (accept_tree's distributions: numpy)
    first = np.zeros(5)
    second = {2: np.zeros(5), 0: np.zeros(5)}
    for _ in range(draws):
        verdict = rule(PASS, PASS_TOKENS, probs.__getitem__, generator)
        emitted = [PASS_TOKENS[i] for i in verdict.path] + [verdict.next_token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[0]][emitted[1]] += 1
    return first / draws, {token: counts / counts.sum() for token, counts in second.items()}


def _tv(a, b):
    return 0.5 * float(np.abs(a - np.array(b)).sum())


def test_tree_acceptance_keeps_the_target_distribution():
    from layerplan.decoding.acceptance import accept_tree

    first, second = _emitted_distributions(accept_tree)
    # 40,000 draws: a total-variation distance above 0.015 would be a 4-sigma event for 5 tokens
    assert _tv(first, P[0]) < 0.015
    assert _tv(second[2], P[1]) < 0.02  # after token 2 (node 1): node 1's distribution
    assert _tv(second[0], P[2]) < 0.02  # after token 0 (node 2, no children): the bonus from node 2's


def test_tree_acceptance_negative_control():
    """The same walk without the residual (each child judged against the full distribution) is
    biased, and the test above would see it."""
    from layerplan.decoding.acceptance import TreeVerdict, _draw

    def without_residual(tree, tokens, target_probs, generator):
        path, node = [], 0
        while True:
            p = target_probs(node)
            child = next((c for c in tree.children(node)
                          if generator.random() < float(p[tokens[c]])), None)
            if child is None:
                return TreeVerdict(path, _draw(p, generator), bonus=not tree.children(node))
            path.append(child)
            node = child

    first, _ = _emitted_distributions(without_residual)
    assert _tv(first, P[0]) > 0.05


def test_greedy_tree_acceptance_follows_the_argmax_and_draws_nothing():
    from layerplan.decoding.acceptance import accept_tree

    one_hot = {0: 2, 1: 1, 2: 4, 3: 4, 4: 3}
    generator = seeded_generator(5)
    state = generator.bit_generator.state
    verdict = accept_tree(PASS, PASS_TOKENS, lambda n: np.eye(5)[one_hot[n]], generator)
    assert verdict.path == [1, 4] and verdict.next_token == 3 and verdict.bonus
    assert generator.bit_generator.state == state


def test_greedy_tree_verdict_from_picks_is_accept_trees():
    """accept_tree_greedy gives what accept_tree gives on the one-hot distributions of a greedy
    target, for every assignment of picks over the test tree's nodes (tokens 0-4)."""
    import itertools

    from layerplan.decoding.acceptance import accept_tree, accept_tree_greedy

    nodes = len(PASS_TOKENS)
    for picks in itertools.product(range(5), repeat=nodes):
        def one_hot(node):
            return np.eye(5)[picks[node]]
        assert accept_tree_greedy(PASS, PASS_TOKENS, lambda node: picks[node]) == accept_tree(PASS, PASS_TOKENS, one_hot)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sampled_tree_speculation_runs_and_is_seeded(arch):
    model = _model(arch, "native")
    prompt = [5, 9, 14, 3, 22, 7, 5, 9, 14, 8, 22, 7, 5, 9]
    from layerplan.decoding.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=20)
    # a fixed draft length: the adaptive one follows measured times, and with it the random draws
    runs = [generate(model, prompt, max_new_tokens=24, stop_at_eos=False, sampling=params, seed=3, draft="suffix:tree",
                     draft_length="fixed") for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 24
    assert runs[0].stats["drafted"] > 0


@pytest.mark.parametrize("engine", ["eager", "native"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_branching_self_drafts_equal_plain(arch, engine):
    model = _model(arch, engine)
    prompt = [5, 9, 14, 3, 22, 7, 5, 9]
    plain = generate(model, prompt, max_new_tokens=20, stop_at_eos=False).token_ids
    for spec in ["skip:attn=1+branch=0.9", "exit:2+branch=0.5"]:
        result = generate(model, prompt, max_new_tokens=20, stop_at_eos=False, draft=spec, draft_length="fixed")
        assert result.token_ids == plain, spec
        assert result.stats["drafted"] > 0


def test_a_branching_draft_proposes_its_runner_up_beside_unsure_tokens():
    model = tiny_model("llama")
    from layerplan.decoding.drafters.proposal import DraftState
    from layerplan.decoding.drafters.registry import make_drafter
    from layerplan.decoding.sampling_params import SamplingParams

    plan = model.plan()
    cache = new_cache(plan)
    prompt = [5, 9, 14, 3, 22, 7]
    forward(model, torch.tensor([prompt[:-1]]), plan, cache, 0)
    drafter = make_drafter("exit:2+branch=0.999", model, plan)  # a tiny random model is never that sure
    proposal = drafter.propose(DraftState(model, plan, cache, prompt, SamplingParams(), passes=ModelPasses(model)), 6)
    assert proposal.tree is not None and len(proposal.tokens) == 6
    # chain nodes and their runner-ups share a parent; the chain goes on from the chain node
    assert proposal.tree.parents == (-1, -1, 0, 0, 2, 2)
    assert drafter.name.endswith("exit:2+branch=0.999")


def test_branch_option_errors():
    model = tiny_model("llama")
    from layerplan.decoding.drafters.registry import make_drafter

    for spec, message in {"exit:2+branch=2": "probability in", "exit:2+branch=x": "probability in",
                          "ngram+branch=0.5": "applies to drafts that run a model"}.items():
        with pytest.raises(ValueError, match=message):
            make_drafter(spec, model)


# ----- on-the-fly layer selection -----------------------------------------------------------------

@pytest.mark.parametrize("engine", ["eager", "native"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_online_layer_selection_equals_plain(arch, engine):
    model = _model(arch, engine)
    prompt = [5, 9, 14, 3, 22, 7, 5, 9, 30, 31]
    plain = generate(model, prompt, max_new_tokens=30, stop_at_eos=False).token_ids
    result = generate(model, prompt, max_new_tokens=30, stop_at_eos=False, draft="online:every=2,calibration=4",
                      draft_length="fixed")
    assert result.token_ids == plain
    # the proposals name their skip sets: the stats show the sets the run went through
    assert result.stats["drafted"] > 0 and all(name.startswith("online skip:") for name in result.stats["by_drafter"])


def test_online_ranking_puts_a_sub_layer_that_does_nothing_first():
    from layerplan.decoding.drafters.proposal import DraftState
    from layerplan.decoding.drafters.online import OnlineSkipDrafter
    from layerplan.decoding.sampling_params import SamplingParams

    model = tiny_model("llama", num_layers=3)
    with torch.no_grad():  # layer 1's MLP adds nothing: its down projection is zero
        model.parts.layers[1].mlp.down_proj.weight.zero_()
    drafter = OnlineSkipDrafter(model.plan(), calibration=6, start=0.2)
    plan = model.plan()
    cache = new_cache(plan)
    prompt = [5, 9, 14, 3, 22, 7, 11]
    forward(model, torch.tensor([prompt[:-1]]), plan, cache, 0)
    proposal = drafter.propose(DraftState(model, plan, cache, prompt, SamplingParams(), passes=ModelPasses(model)), 3)
    assert drafter.ranking[0] == (1, "mlp")
    assert drafter.draft.plan.to_string() == "skip:mlp=1" and proposal.source == "online skip:mlp=1"


def test_online_skip_count_climbs_while_it_gets_faster_and_turns_back():
    from layerplan.decoding.drafters.proposal import RoundOutcome
    from layerplan.decoding.drafters.online import OnlineSkipDrafter

    drafter = OnlineSkipDrafter(tiny_model("llama", num_layers=4).plan(), every=2, start=0.25)
    assert drafter.skip_count == 2
    for seconds, expected in [(1.0, 4), (0.5, 6), (2.0, 4)]:  # faster, faster, then slower: back
        for _ in range(2):
            drafter.observe(RoundOutcome("online", 3, 2, seconds / 2, seconds / 2))
        assert drafter.skip_count == expected


def test_online_spec_errors():
    from layerplan.decoding.drafters.registry import make_drafter

    model = tiny_model("llama")
    for spec in ["online:every=x", "online:speed=2", "online:start=2"]:
        with pytest.raises(ValueError):
            make_drafter(spec, model)
