"""Token-tree passes (engine/tree.py): a node's logits equal those of a chain of its path, and the
cache keeps the accepted path as if it had been run alone."""

from __future__ import annotations

import pytest
import torch

from layerplan.engine import native
from layerplan.engine.runner import forward, new_cache
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
        native.enable(model)
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
