"""The scheduler (decoding/scheduler.py): one loop for every caller, a batch of one a batch. Jobs
keep their solo generate() tokens at every max_batch; calls run between passes in arrival order;
the counters add up; a job cancelled before it starts gets None; a model drafter the scheduler
owns decodes one job at a time."""

import pytest
import torch

from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.scheduler import Job, Scheduler
from layerplan.engine.executors import use_native
from layerplan.engine.kernel_library import native_available
from layerplan.engine.runner import forward, new_cache
from tiny import tiny_model

native = pytest.mark.skipif(native_available() is not None, reason=str(native_available()))
PROMPTS = [[5, 6, 7, 5, 6, 7], [9, 9, 9], [1, 2, 3, 1, 2, 3, 1]]


@pytest.fixture(scope="module")
def model():
    loaded = tiny_model("llama", num_layers=3)
    use_native(loaded)
    return loaded


def _job(prompt, tokens=6, **fields) -> Job:
    return Job(list(prompt), tokens, SamplingParams(), None, (), stop_at_eos=False, **fields)


@native
@pytest.mark.parametrize("max_batch", [1, 2, 8])
def test_jobs_keep_their_solo_tokens_at_every_batch_size(model, max_batch):
    scheduler = Scheduler(model, max_batch=max_batch)
    futures = [scheduler.submit(_job(prompt)) for prompt in PROMPTS]
    assert scheduler.counters.waiting == len(PROMPTS)
    scheduler.run(until_idle=True)
    for prompt, future in zip(PROMPTS, futures):
        assert future.result().token_ids == generate(model, prompt, max_new_tokens=6, stop_at_eos=False).token_ids
    assert (scheduler.counters.waiting, scheduler.counters.running, scheduler.counters.finished) == (0, 0, 3)
    assert scheduler.batch == 0
    widest = max(size for _, size in scheduler.passes)
    assert widest == min(max_batch, len(PROMPTS))  # a batch of one is a batch; more share a pass
    assert scheduler.batch_recent()["max_batch"] == widest


@native
def test_calls_run_between_jobs_in_arrival_order_and_cancelled_jobs_get_none(model):
    scheduler = Scheduler(model, max_batch=1)
    order = []
    first = scheduler.submit(_job(PROMPTS[0], on_start=lambda: order.append("job 1")))
    called = scheduler.call(lambda: order.append("call") or 42)
    cancelled = _job(PROMPTS[1], on_start=lambda: order.append("never"))
    cancelled.cancelled.set()
    gone = scheduler.submit(cancelled)
    failing = scheduler.call(lambda: 1 / 0)
    scheduler.run(until_idle=True)
    assert order == ["job 1", "call"] and called.result() == 42
    assert first.result().token_ids and gone.result() is None
    with pytest.raises(ZeroDivisionError):
        failing.result()
    assert (scheduler.counters.finished, scheduler.counters.cancelled) == (1, 1)


@native
def test_a_failing_pass_fails_its_jobs_and_the_loop_goes_on(model):
    """(A pass that fails fails every job in it: serve checks token ids before it submits.)"""
    scheduler = Scheduler(model, max_batch=1)
    bad = scheduler.submit(_job([model.hf.config.vocab_size + 5]))  # out of the vocabulary
    good = scheduler.submit(_job(PROMPTS[0]))
    scheduler.run(until_idle=True)
    with pytest.raises(Exception):
        bad.result()
    assert good.result().token_ids
    assert scheduler.counters.failed == 1 and scheduler.counters.running == 0


@native
def test_a_model_drafter_the_scheduler_owns_decodes_one_job_at_a_time(model):
    scheduler = Scheduler(model, draft="exit:2", max_batch=4)
    assert scheduler.max_batch == 1
    future = scheduler.submit(_job(PROMPTS[2], tokens=8))
    assert scheduler.drafter_for(scheduler.plan) is scheduler.drafter
    thread = scheduler.start_thread()
    assert future.result(timeout=60).token_ids == generate(model, PROMPTS[2], max_new_tokens=8,
                                                           stop_at_eos=False).token_ids
    scheduler.close()
    thread.join(timeout=10)
    assert not thread.is_alive()


@native
@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_job_whose_cache_holds_its_first_tokens_prefills_from_there(model, max_batch):
    """(layerplan chat: a reply's earlier turns stay in its cache.) The tokens are a fresh run's."""
    prompt = PROMPTS[2]
    cache = new_cache(model.plan(), capacity=64)
    forward(model, torch.tensor([prompt[:4]]), model.plan(), cache, 0)
    scheduler = Scheduler(model, max_batch=max_batch)
    other = scheduler.submit(_job(PROMPTS[0], tokens=10))
    kept = scheduler.submit(_job(prompt, cache=cache))
    scheduler.run(until_idle=True)
    assert kept.result().token_ids == generate(model, prompt, max_new_tokens=6, stop_at_eos=False).token_ids
    assert other.result().token_ids == generate(model, PROMPTS[0], max_new_tokens=10, stop_at_eos=False).token_ids
    assert cache.length == len(prompt) + 6 - 1  # written on: the last token chosen, not yet run
