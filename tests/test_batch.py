"""Continuous batching (decoding/batch.py, runner.forward_batch): several sequences in one pass,
each its own cache and positions, give each one's own numbers bit for bit; requests join and
leave; greedy and seeded sampled outputs equal their solo generate()."""

import pytest
import torch

from layerplan.decoding import batch as batching
from layerplan.decoding.scheduler import generate_batch
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.executors import use_native
from layerplan.engine.kernel_library import native_available
from layerplan.engine.runner import forward, forward_batch, new_cache
from tiny import tiny_model

native = pytest.mark.skipif(native_available() is not None, reason=str(native_available()))


def _native(arch: str, dtype=torch.float32):
    model = tiny_model(arch, num_layers=3, dtype=dtype)
    use_native(model)
    return model


@native
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16), ("gemma3", torch.float32)])
def test_a_batched_pass_gives_each_sequence_its_own_logits(arch, dtype):
    model = _native(arch, dtype)
    plan = model.plan("0,1,1,2")  # a repeated layer: its own KV slot in every sequence's cache
    prompts = [torch.tensor([[3, 9, 27, 81]]), torch.tensor([[5]]), torch.tensor([[7, 1, 4, 1, 5, 9, 2]])]
    alone, together = [], []
    for ids in prompts:
        for caches in (alone, together):
            cache = new_cache(plan, 32)
            forward(model, ids, plan, cache)
            caches.append(cache)
    for step in range(3):  # one token each, then a chunk of two for one of them
        inputs = [torch.tensor([[11 + step]]), torch.tensor([[13, 17]]) if step == 2 else torch.tensor([[12]]),
                  torch.tensor([[14 + step]])]
        starts = [ids.shape[1] + step for ids in prompts]
        batched = forward_batch(model, [(x, c, s) for x, c, s in zip(inputs, together, starts)], plan)
        for x, cache, start, got in zip(inputs, alone, starts, batched):
            assert torch.equal(got, forward(model, x, plan, cache, start)[0])
    # prompts of several lengths prefilled in one pass, the head on each one's last row only
    fresh = [new_cache(plan, 32) for _ in prompts]
    lasts = forward_batch(model, [(ids, cache, 0) for ids, cache in zip(prompts, fresh)], plan, last_only=True)
    for ids, got in zip(prompts, lasts):
        assert torch.equal(got, forward(model, ids, plan, new_cache(plan, 32), 0, last_only=True)[0])


@native
def test_generate_batch_equals_solo_generation_as_requests_join_and_leave():
    model = _native("llama")
    prompts = [[5, 6, 7, 5, 6], [9], [1, 2, 3, 4, 5, 6, 7, 8], [42, 17], [3, 3, 3]]
    batched = generate_batch(model, prompts, max_new_tokens=12, stop_at_eos=False, max_batch=2)
    for prompt, result in zip(prompts, batched):
        assert result.token_ids == generate(model, prompt, max_new_tokens=12, stop_at_eos=False).token_ids
    sampling = SamplingParams(temperature=0.9, top_k=20)
    seeds = [11, 12, 13, 14, 15]
    sampled = generate_batch(model, prompts, max_new_tokens=10, sampling=sampling, seeds=seeds, stop_at_eos=False,
                             max_batch=3)
    for prompt, seed, result in zip(prompts, seeds, sampled):
        assert result.token_ids == generate(model, prompt, max_new_tokens=10, sampling=sampling, seed=seed,
                                            stop_at_eos=False).token_ids


def test_generate_batch_refuses_what_it_cannot_do():
    model = tiny_model("llama", num_layers=1)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        generate_batch(model, [[1]], max_batch=0)
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        generate_batch(model, [[1]], seeds=[1, 2])
    assert [r.token_ids for r in generate_batch(model, [[1], [2]], max_new_tokens=3, stop_at_eos=False)] == \
        [generate(model, [p], max_new_tokens=3, stop_at_eos=False).token_ids for p in (1, 2)]  # the eager engine


@native
@pytest.mark.parametrize("draft", ["ngram", "suffix", "exit:2"])
def test_speculation_inside_a_batch_keeps_each_requests_solo_output(draft):
    """Each request drafts with its own drafter; its chain is verified in the batch's pass, the
    draft length shrinking with the batch (ROW_BUDGET): greedy tokens equal the request's solo
    generate(), drafted or not. Sampled, a request alone in its batch gives its solo speculative
    run's tokens for its seed; in a fuller batch its drafts are shorter, so the random draws fall
    differently (still the target's distribution: the acceptance rule is the solo one's)."""
    model = _native("llama")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9], [1, 2, 3, 1, 2, 3], [42, 17, 42, 17, 42]]
    drafted = {}
    for max_batch in (1, 2, 4):
        batched = generate_batch(model, prompts, max_new_tokens=14, stop_at_eos=False, max_batch=max_batch,
                                 draft=draft)
        for prompt, result in zip(prompts, batched):
            assert result.token_ids == generate(model, prompt, max_new_tokens=14, stop_at_eos=False).token_ids
        drafted[max_batch] = sum(r.stats["drafted"] for r in batched)
    assert drafted[1] > 0  # (the adaptive length, with no probe's pass costs, drafts only in a pass of its own)
    # four at once: 16 rows a pass leave each 3 drafts, under the fixed length's 4; each says so
    full = generate_batch(model, prompts, max_new_tokens=14, stop_at_eos=False, max_batch=4, draft=draft,
                          draft_length="fixed")
    assert all(r.stats["capped_rounds"] > 0 for r in full)
    alone = generate_batch(model, prompts[:1], max_new_tokens=14, stop_at_eos=False, draft=draft, draft_length="fixed")
    assert alone[0].stats["capped_rounds"] == 0
    sampling = SamplingParams(temperature=0.9)
    # a fixed draft length: the adaptive one follows the passes' timings, and the random draws follow it
    sampled = generate_batch(model, prompts, max_new_tokens=10, sampling=sampling, seeds=[1, 2, 3, 4],
                             stop_at_eos=False, draft=draft, max_batch=1, draft_length="fixed")
    for prompt, seed, result in zip(prompts, [1, 2, 3, 4], sampled):
        solo = generate(model, prompt, max_new_tokens=10, sampling=sampling, seed=seed, stop_at_eos=False, draft=draft,
                        draft_length="fixed")
        assert result.token_ids == solo.token_ids


@native
def test_a_busy_batch_drafts_less_and_says_so():
    """With the probe's pass costs steep past 4 rows (a pass bound by arithmetic), requests in a
    batch of four draft less than alone (usage's busy_rounds), and keep their solo greedy tokens."""
    from layerplan.engine.probe_rows import ProbeRow

    model = _native("llama")
    steep = ProbeRow("native", "float32", 1.0, {k: 1.0 + 0.05 * (k - 1) if k <= 4 else 1.15 + 0.3 * (k - 4)
                                                 for k in range(1, 17)})
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9], [1, 2, 3, 1, 2, 3], [42, 17, 42, 17, 42]]

    def decode(group_of: list[list[int]]) -> list:
        group = batching.Batch(model)
        decodes = [batching.SpeculativeDecoding(model, p, "ngram", model.plan(), 24, stop_at_eos=False, probe_row=steep)
                   for p in group_of]
        for i, d in enumerate(decodes):
            group.join(i, d)
        while len(group):
            group.step()
        return [d.result() for d in decodes]
    together = decode(prompts)
    alone = [decode([p])[0] for p in prompts]
    for prompt, busy, solo in zip(prompts, together, alone):
        assert busy.token_ids == solo.token_ids == generate(model, prompt, max_new_tokens=24, stop_at_eos=False).token_ids
        assert solo.stats["busy_rounds"] == 0
    assert sum(r.stats["busy_rounds"] for r in together) > 0
    assert sum(r.stats["drafted"] for r in together) < sum(r.stats["drafted"] for r in alone)


@native
def test_a_caches_slot_descriptors_are_kept_between_passes_and_renewed_when_it_grows():
    """The native batched pass keeps each cache's slot descriptors (cache.descriptors) between
    passes: still each sequence's own logits while its buffers grow past their capacity (the
    addresses change), after a rollback (crop), and a write past a skipped position still fails."""
    model = _native("llama")
    plan = model.plan("0,1,1,2")
    prompts = [torch.tensor([[3, 9, 27]]), torch.tensor([[5]])]
    alone, together = [new_cache(plan, 4) for _ in prompts], [new_cache(plan, 4) for _ in prompts]
    for ids, a, t in zip(prompts, alone, together):
        forward(model, ids, plan, a)
        forward(model, ids, plan, t)
    lengths = [ids.shape[1] for ids in prompts]
    for step in range(12):  # past the initial capacity of 4 twice over: the buffers move
        inputs = [torch.tensor([[11 + step]]), torch.tensor([[12 + step, 40 + step]])]
        batched = forward_batch(model, [(x, c, n) for x, c, n in zip(inputs, together, lengths)], plan)
        assert all(c.descriptors for c in together)  # kept for the next pass
        for x, cache, n, got in zip(inputs, alone, lengths, batched):
            assert torch.equal(got, forward(model, x, plan, cache, n)[0])
        if step == 5:  # a rejected draft's rollback: the next pass writes from the cropped end
            for cache in alone + together:
                cache.crop(lengths[1] + 1)
            lengths[1] += 1
        else:
            lengths[1] += 2
        lengths[0] += 1
    with pytest.raises(RuntimeError, match="a write starts at"):
        forward_batch(model, [(torch.tensor([[1]]), together[0], lengths[0] + 3), (torch.tensor([[2]]), together[1],
                                                                                    lengths[1])], plan)


@native
@pytest.mark.parametrize("arch,dtype,shared", [("llama", torch.float32, True), ("qwen2", torch.bfloat16, True),
                                               ("gemma3", torch.float32, False)])  # Gemma scales its embedding: each runs alone
def test_sequences_of_different_plans_share_the_steps_their_plans_begin_with(arch, dtype, shared, monkeypatch):
    """A pass of several plans: the steps they begin with alike run once over every row, then each
    plan's own from there; each sequence gets its own plan's logits bit for bit (a skip and a
    repeat that part at step 2, an exit inside the shared steps, the full plan)."""
    from layerplan.engine import native as native_module

    model = tiny_model(arch, num_layers=4, dtype=dtype)
    use_native(model)
    plans = [model.plan(), model.plan("skip:attn=2"), model.plan("0,1,1,2,3"), model.plan("exit:2"), model.plan()]
    prompts = [torch.tensor([[3, 9, 27]]), torch.tensor([[5]]), torch.tensor([[7, 1, 4, 1]]), torch.tensor([[2, 8]]),
               torch.tensor([[6]])]
    calls = []
    monkeypatch.setattr(native_module.StepRun, "batch_hidden", lambda self, *a, _real=native_module.StepRun.batch_hidden:
                        calls.append(len(self.slots)) or _real(self, *a))
    alone = [new_cache(plan, 32) for plan in plans]
    together = [new_cache(plan, 32) for plan in plans]
    lasts = forward_batch(model, [(ids, cache, 0) for ids, cache in zip(prompts, together)], plans, last_only=True)
    for ids, plan, cache, got in zip(prompts, plans, alone, lasts):
        assert torch.equal(got, forward(model, ids, plan, cache, 0, last_only=True)[0])
    # the full plans share a group; from step 2 each other plan runs its own rest (exit:2: none),
    # then one call of no steps runs the LM head over every sequence's wanted rows
    assert sorted(calls) == ([0, 0, 2, 2, 3] if shared else [])
    for step in range(3):
        inputs = [torch.tensor([[11 + step + s]]) for s in range(len(plans))]
        starts = [ids.shape[1] + step for ids in prompts]
        batched = forward_batch(model, [(x, c, n) for x, c, n in zip(inputs, together, starts)], plans)
        for x, plan, cache, n, got in zip(inputs, plans, alone, starts, batched):
            assert torch.equal(got, forward(model, x, plan, cache, n)[0])
    # a pass that wants no logits of some (a prompt's chunk) or of none: the head runs on the rest
    for want in ([0, 1, 0, 2, 0], [0] * 5):
        got = forward_batch(model, [(ids, new_cache(plan, 32), 0) for ids, plan in zip(prompts, plans)], plans,
                            wanted=want)
        for ids, plan, rows, logits in zip(prompts, plans, want, got):
            whole = forward(model, ids, plan, new_cache(plan, 32), 0)[0]
            assert torch.equal(logits, whole[whole.shape[0] - rows:])
    # plans that part at the first step share nothing but the pass: still each one's own logits
    apart = [model.plan("skip:mlp=0"), model.plan()]
    got = forward_batch(model, [(prompts[0], new_cache(plan, 32), 0) for plan in apart], apart)
    for plan, logits in zip(apart, got):
        assert torch.equal(logits, forward(model, prompts[0], plan, new_cache(plan, 32), 0)[0])


@native
def test_a_batch_of_decodes_of_different_plans_keeps_each_ones_solo_output():
    model = _native("llama")
    group = batching.Batch(model)
    plans = ["full", "skip:attn=1", "exit:2", "0,1,1,2"]
    decodes = {plan: batching.Decoding(model, [3, 9, 27], model.plan(plan), 12, stop_at_eos=False) for plan in plans}
    for plan, decoding in decodes.items():
        group.join(plan, decoding)
    finished = {}
    while len(group):
        finished.update(group.step())
    for plan in plans:
        solo = generate(model, [3, 9, 27], model.plan(plan), 12, stop_at_eos=False)
        assert finished[plan].out.tokens == solo.token_ids


@native
def test_a_batched_pass_gives_each_sequence_the_logits_of_the_rows_it_wants():
    """A pass's segments each want the logits of their last 0 (a prompt's chunk), 1 (its last
    chunk) or all rows (a verify): each gets exactly those, as its own pass computes them."""
    model = _native("qwen2")
    plan = model.plan()
    prompts = [torch.tensor([[3, 9, 27, 81]]), torch.tensor([[5, 6]]), torch.tensor([[7, 1, 4, 1, 5]])]
    for wanted in ([0, 2, 1], [4, 0, 0], [1, 1, 5], [0, 0, 0]):
        got = forward_batch(model, [(ids, new_cache(plan, 16), 0) for ids in prompts], plan, wanted=wanted)
        for ids, rows, logits in zip(prompts, wanted, got):
            whole = forward(model, ids, plan, new_cache(plan, 16), 0)[0]
            assert logits.shape == (rows, whole.shape[-1]) and torch.equal(logits, whole[whole.shape[0] - rows:])


@native
@pytest.mark.parametrize("stored", [None, "stored", "stored-fast"])
def test_prompts_prefilled_in_chunks_beside_decoding_requests_keep_their_solo_output(tmp_path, monkeypatch, stored):
    """A newcomer's prompt goes through the batch's passes a chunk at a time (PREFILL_CHUNK rows
    a pass) while the others decode (whole where none does): each request still gets its solo
    generate()'s tokens, greedy and sampled, and the requests decoding get a token at every pass
    meanwhile."""
    from layerplan.engine.load import load_model
    from tiny import tiny_hf
    from tiny_gguf import write_tiny_gguf

    model = (load_model(write_tiny_gguf(tiny_hf("llama", num_layers=2), tmp_path / "m.gguf", "Q4_1"), dtype=stored)
             if stored else _native("llama"))
    monkeypatch.setattr(batching, "PREFILL_CHUNK", 3)
    seen = []
    real = batching.forward_batch
    monkeypatch.setattr(batching, "forward_batch", lambda *a, **k: seen.append(k.get("wanted")) or real(*a, **k))
    prompts = [[5, 6, 7, 5, 6, 1, 2, 3, 4, 9, 9], [9], [1, 2, 3, 4, 5, 6, 7, 8], [42, 17]]
    batched = generate_batch(model, prompts, max_new_tokens=8, stop_at_eos=False, max_batch=3)
    for prompt, result in zip(prompts, batched):
        assert result.token_ids == generate(model, prompt, max_new_tokens=8, stop_at_eos=False).token_ids
    # with nothing decoding yet, nobody waits: the first three prompts go whole, in one pass
    assert seen[0] == [1, 1, 1]
    sampling = SamplingParams(temperature=0.9, top_k=20)
    sampled = generate_batch(model, prompts, max_new_tokens=6, sampling=sampling, seeds=[1, 2, 3, 4],
                             stop_at_eos=False, max_batch=2)
    for prompt, seed, result in zip(prompts, [1, 2, 3, 4], sampled):
        assert result.token_ids == generate(model, prompt, max_new_tokens=6, sampling=sampling, seed=seed,
                                            stop_at_eos=False).token_ids

    # one request decoding, a long prompt joining: a token a pass for the first, 11 / 3 -> 4 passes
    # of prefill for the second, then both decode
    group = batching.Batch(model)
    first = batching.Decoding(model, [9], model.plan(), 20, stop_at_eos=False)
    group.join("first", first)
    group.step()
    before = len(first.out.tokens)
    group.join("second", second := batching.Decoding(model, prompts[0], model.plan(), 20, stop_at_eos=False))
    for passes in range(1, 5):
        group.step()
        assert len(first.out.tokens) == before + passes
        assert (len(second.out.tokens) == 1) == (passes == 4)

    # requests of other plans, a long prompt among them prefilling in chunks: each its solo output
    mixed = batching.Batch(model)
    plans = {"full": model.plan(), "skip": model.plan("skip:attn=1"), "exit": model.plan("exit:1")}
    asked = {"full": [9, 4], "skip": prompts[0], "exit": [3, 1, 4, 1, 5]}
    for name, plan in plans.items():
        mixed.join(name, batching.Decoding(model, asked[name], plan, 8, stop_at_eos=False))
    done = {}
    while len(mixed):
        done.update(mixed.step())
    for name, plan in plans.items():
        assert done[name].out.tokens == generate(model, asked[name], plan, 8, stop_at_eos=False).token_ids
