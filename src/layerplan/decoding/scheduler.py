"""The continuous-batching scheduler: generations queued in arrival order and decoded together, up
to max_batch at once (decoding/batch.py: a pass's products read the weights once for every
request's rows, which on a CPU bound by reading the weights costs little more than one request's
step). A batch of one is a batch: one loop serves `layerplan serve`, `generate --prompt-file`, the
lm-eval adapter, generate_batch and `layerplan chat` (a reply a job, its earlier turns in its cache).

Each job decodes by its own plan and drafter (or the scheduler's). A lookup drafter (n-gram,
suffix) is made anew for each job, its chains verified in the batch's passes; a drafter that runs a
model decodes one job at a time, a round a turn beside the batch's pass (max_batch 1 when the
scheduler's own draft runs a model: it keeps its cache between jobs), unless each job makes its own
(drafter_per_job: generate_batch). Each job gets its own KV cache, and one whose caller lost
interest (Job.cancelled) stops at its next pass, its place freed.

The scheduler runs on the thread that calls run(): on CPU, torch's OpenMP pool belongs to the thread
that first ran parallel work (usually the main thread, which loaded the model), and a decode on a
second thread ran ~1.7x slower. `layerplan serve` decodes on the main thread and serves HTTP from a
background one; start_thread() (tests, notebooks) starts a decode thread instead."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from layerplan.decoding.batch import Batch
from layerplan.decoding.draft_length import SharedRounds
from layerplan.decoding.drafters.model import ModelDrafter
from layerplan.decoding.drafters.proposal import Drafter
from layerplan.decoding.drafters.registry import drafts_by_lookup, make_drafter
from layerplan.decoding.generate import Decoding
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.speculative import SpeculativeDecoding
from layerplan.decoding.text import GenerationResult
from layerplan.engine.cache import KVCache
from layerplan.engine.probe_rows import ProbeRow
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

# plain decodes batched at most (serve --max-batch, generate --prompt-file): on a CPU a pass of 8
# tokens costs little more than one, so 8 requests decode at nearly one request's pace each
DEFAULT_MAX_BATCH = 8
PASSES_KEPT = 4096  # the latest passes batch_recent summarises (a few minutes of a busy server's)
RECENT_SECONDS = 60.0  # batch_recent's default span
POLL_SECONDS = 0.5  # an idle loop wakes this often, so Ctrl-C gets through


@dataclass
class Job:
    """One generation to schedule. plan, draft and draft_length None: the scheduler's (submit
    fills them in)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    on_text: Callable[[str], None] | None = None
    on_start: Callable[[], None] | None = None  # called on the decode thread as decoding starts
    cancelled: threading.Event = field(default_factory=threading.Event)
    plan: LayerPlan | None = None
    # this job's drafter, made for its plan (Scheduler.drafter_for), when draft_chosen (None then:
    # it decodes plainly); otherwise the scheduler's draft for its plan
    draft: Drafter | None = None
    draft_chosen: bool = False
    draft_length: str | None = None
    stop_at_eos: bool | Sequence[int] = True
    chat: bool = False
    # a cache that holds the keys and values of the prompt's first cache.length tokens (a chat's
    # earlier turns), for the plan the job runs; the decode writes on into it
    cache: KVCache | None = None
    should_stop: Callable[[], bool] | None = None  # the caller's own stop, asked beside `cancelled`
    # keep each new token's logprob and this many alternatives' (decoding/logprobs.py); None: none
    logprobs: int | None = None

    def stopped(self) -> bool:
        return self.cancelled.is_set() or (self.should_stop is not None and self.should_stop())


@dataclass
class SchedulerCounters:
    waiting: int = 0  # submitted, not started
    running: int = 0
    finished: int = 0
    cancelled: int = 0  # stopped (or never started) because the caller lost interest
    failed: int = 0


class Scheduler:
    """Decodes queued jobs, in arrival order, on the thread that calls run(): up to max_batch at
    once (a job joins after its prefill, whatever its plan, and leaves when done; its greedy tokens
    are its solo run's). Work that must not overlap a decode runs between passes (call())."""

    def __init__(self, model: LoadedModel, plan: LayerPlan | None = None, draft=None,
                 draft_length: str | None = None, probe_row: ProbeRow | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, drafter_per_job: bool = False) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be at least 1, not {max_batch}")
        self.model = model
        self.probe_row = probe_row  # this machine's probe row for the model: the pace decodes are held to
        # the latest decode's GenerationResult.slow_note: set while decodes run far slower than the
        # probe says (a busy machine), cleared by one that keeps pace
        self.slow_note: str | None = None
        self.plan = plan if plan is not None else model.plan()
        # a lookup drafter is made anew for each job, its drafts verified in the batch's passes; a
        # drafter that runs a model keeps one job at a time, unless drafter_per_job (generate_batch:
        # each job makes its own from the spec, and its chains are verified in the batch's passes)
        self.drafter_per_job = drafter_per_job and isinstance(draft, str)
        # built once (it checks the spec: a bad one fails here): a model drafter keeps its own cache
        # between jobs (it re-syncs by prefix). Not where each job makes its own, which checks it
        # then: a self-draft at other bits would be a second copy of the model, built for nothing
        self.drafter = make_drafter(draft, model, self.plan) if draft and not self.drafter_per_job else None
        self.draft_text = draft if isinstance(draft, str) else None  # made again for a job's own plan
        self.draft_length = draft_length
        self.draft_spec = draft if self.drafter_per_job or (
            isinstance(draft, str) and self.drafter is not None and drafts_by_lookup(self.drafter)) else None
        self.max_batch = max_batch if self.drafter is None or self.draft_spec is not None else 1
        self.batch = 0  # decodes in flight now
        # (monotonic time, decodes in the pass) of the latest passes, for batch_recent
        self.passes: deque[tuple[float, int]] = deque(maxlen=PASSES_KEPT)
        self.counters = SchedulerCounters()
        # what the jobs of each (draft, plan, length policy) measured of their rounds: where a new
        # job's draft length starts (draft_length.SharedRounds); the decode thread's alone
        self.shared_rounds: dict[tuple[str, str, str], SharedRounds] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()  # FIFO: fair in arrival order

    # ----- the callers' side (any thread) ------------------------------------------------------
    def start_thread(self) -> threading.Thread:
        """Decode on a thread of its own (daemon) until close()."""
        thread = threading.Thread(target=self.run, name="layerplan-decode", daemon=True)
        thread.start()
        return thread

    def drafter_for(self, plan: LayerPlan, spec: str | None = None, chosen: bool = False) -> Drafter | None:
        """The drafter of a job run by `plan`: the one its spec names when chosen (None: it decodes
        plainly), made for it alone from a client's spec (no files, no second model); else the
        scheduler's draft for that plan. ValueError (PlanError, ...) for a draft that cannot be
        made or does not fit the plan."""
        costs = dict(self.probe_row.relative) if self.probe_row is not None else {}
        if chosen:
            return make_drafter(spec, self.model, plan, pass_costs=costs, remote=True) if spec is not None else None
        if self.draft_spec is not None:  # a lookup, or drafter_per_job: each job its own
            return make_drafter(self.draft_spec, self.model, plan, pass_costs=costs)
        if self.drafter is None:
            return None
        # one at a time (max_batch 1): the scheduler's drafter, which keeps its cache between jobs;
        # a drafter with a model of its own drafts for any plan, a self-draft only for its target's
        if plan == self.plan or isinstance(self.drafter, ModelDrafter):
            return self.drafter
        if self.draft_text is None:
            raise ValueError(f"the server's draft {self.drafter.name} was made for its own plan: name a draft "
                             "for this plan")
        return make_drafter(self.draft_text, self.model, plan, pass_costs=costs)

    def submit(self, job: Job) -> Future:
        """Queue a job (its plan, draft and draft length the scheduler's where it leaves them out);
        its future gets its GenerationResult (None when cancelled before it started)."""
        if job.plan is None:
            job.plan = self.plan
        if not job.draft_chosen:
            job.draft, job.draft_chosen = self.drafter_for(job.plan), True
        if job.draft_length is None:
            job.draft_length = self.draft_length
        future: Future = Future()
        self._count(waiting=1)
        self._jobs.put((job, future))
        return future

    def call(self, function: Callable[[], Any]) -> Future:
        """function() on the decode thread, between passes, queued in arrival order like a job:
        work on the model that must not overlap a decode (the page's layer scan: playground.py).
        Decodes wait while it runs."""
        future: Future = Future()
        self._jobs.put((function, future))
        return future

    def close(self) -> None:
        """run() returns once the jobs queued before this are done."""
        self._jobs.put(None)

    def batch_recent(self, seconds: float = RECENT_SECONDS) -> dict:
        """The passes of the last `seconds`: how many, and the decodes they carried (mean, most)."""
        since = time.monotonic() - seconds
        sizes = [size for at, size in list(self.passes) if at >= since]
        return {"seconds": seconds, "passes": len(sizes), "mean_batch": sum(sizes) / len(sizes) if sizes else 0.0,
                "max_batch": max(sizes, default=0)}

    # ----- the decode thread ---------------------------------------------------------------------
    def run(self, until_idle: bool = False) -> None:
        """Decode queued jobs until close() (until_idle: until the queue is empty and every job
        done). A turn admits queued jobs while there is room (max_batch in all), each into the
        batch whatever its plan (its prompt prefills a chunk per pass beside the decoding rows), or,
        when its drafter runs a model, to decode alone; then the batch's pass and each lone
        decode's round."""
        batch = Batch(self.model)  # jobs of any plan: each decode carries its own
        alone: list[tuple[Future, SpeculativeDecoding]] = []

        def in_flight() -> int:
            return len(batch) + len(alone)

        closing = False
        while not (closing and not in_flight()):
            while not closing and in_flight() < self.max_batch:
                try:  # wait for work only when there is none
                    item = self._jobs.get(timeout=POLL_SECONDS) if not in_flight() and not until_idle \
                        else self._jobs.get_nowait()
                except queue.Empty:
                    closing = until_idle and not in_flight()
                    break
                if item is None:
                    closing = True
                    break
                started = self._start(*item)
                if started is None:
                    continue
                job, future, decoding = started
                if job.draft is None or drafts_by_lookup(job.draft) or self.drafter_per_job:
                    batch.join(future, decoding)
                elif self._alone(future, decoding, first=True):
                    alone.append((future, decoding))
            self.batch = in_flight()
            if len(batch):
                self.passes.append((time.monotonic(), len(batch)))
                self._step(batch)
            alone = [entry for entry in alone if self._alone(*entry)]
        self.batch = 0

    def _count(self, **changes: int) -> None:
        with self._lock:
            for name, delta in changes.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def _call(self, function: Callable[[], Any], future: Future) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(function())
            except Exception as error:  # noqa: BLE001 - the caller's future carries it
                future.set_exception(error)

    def _start(self, job: Job, future: Future) -> tuple[Job, Future, Decoding | SpeculativeDecoding] | None:
        """A job taken up: its decode, ready for its prefill; None when it ends here (cancelled,
        failed, or not a job but a call)."""
        if not isinstance(job, Job):
            self._call(job, future)
            return None
        if not future.set_running_or_notify_cancel():
            return None
        if job.stopped():
            self._count(waiting=-1, cancelled=1)
            future.set_result(None)
            return None
        self._count(waiting=-1, running=1)
        try:
            if job.on_start:
                job.on_start()
            if job.draft is not None:
                # (submit gave the job its plan and its drafter, an object with a name)
                key = (job.draft.name, job.plan.to_string(), str(job.draft_length))
                decoding = SpeculativeDecoding(self.model, job.prompt_ids, job.draft, job.plan, job.max_tokens,
                                               job.sampling, job.seed, job.stop, job.stop_at_eos, job.chat,
                                               on_text=job.on_text, draft_length=job.draft_length,
                                               should_stop=job.stopped, probe_row=self.probe_row, cache=job.cache,
                                               shared_rounds=self.shared_rounds.setdefault(key, SharedRounds()))
            else:
                decoding = Decoding(self.model, job.prompt_ids, job.plan, job.max_tokens, job.sampling, job.seed,
                                    job.stop, job.stop_at_eos, job.chat, on_text=job.on_text,
                                    should_stop=job.stopped, probe_row=self.probe_row, cache=job.cache)
            if job.logprobs is not None:
                decoding.out.keep_logprobs(job.logprobs)
        except Exception as error:  # noqa: BLE001 - the caller's future carries it
            self._count(running=-1, failed=1)
            future.set_exception(error)
            return None
        return job, future, decoding

    def _alone(self, future: Future, decoding: SpeculativeDecoding, first: bool = False) -> bool:
        """The next round of a decode whose drafter runs a model (first: its prompt's prefill);
        False once it has left (done, cancelled, failed)."""
        try:
            decoding.prefill() if first else decoding.round()
        except Exception as error:  # noqa: BLE001 - the caller's future carries it
            self._count(running=-1, failed=1)
            future.set_exception(error)
            return False
        if decoding.done:
            self._finish(future, decoding)
            return False
        return True

    def _step(self, batch: Batch) -> None:
        """One pass for the batch; the jobs it finished get their results. A pass that fails fails
        each job in the batch with the error."""
        try:
            finished = batch.step()
        except Exception as error:  # noqa: BLE001 - every job of the pass carries it
            for future, _ in batch.entries():
                self._count(running=-1, failed=1)
                future.set_exception(error)
            batch.clear()
            return
        for future, decoding in finished:
            self._finish(future, decoding)

    def _finish(self, future: Future, decoding: Decoding | SpeculativeDecoding) -> None:
        result = decoding.result()
        self._count(running=-1, **({"cancelled": 1} if result.stop_reason == "cancelled" else {"finished": 1}))
        self.slow_note = result.slow_note
        future.set_result(result)


@torch.inference_mode()
def generate_batch(model: LoadedModel, prompts: Sequence, plan: LayerPlan | None = None,
                   max_new_tokens: int | Sequence[int] = 64,
                   sampling: SamplingParams | None = None, seeds: Sequence[int | None] | None = None,
                   stop: Sequence[str] = (), stop_at_eos: bool | Sequence[int] = True, chat: bool = False,
                   max_batch: int = DEFAULT_MAX_BATCH, draft: str | None = None,
                   draft_length=None) -> list[GenerationResult]:
    """generate() for every prompt, up to max_batch decoding at once (continuous batching: a
    prompt starts as soon as one ends), on this thread. Each result is its prompt's generate()
    result, token for token where greedy. max_new_tokens: every prompt's, or each its own. draft: a
    drafter spec. A lookup (ngram, suffix) gives each prompt a drafter of its own (whatever it
    runs), its chains verified in the batch's passes, its adaptive draft length starting from what
    the prompts before it measured (SharedRounds); lossless: the same greedy tokens. Sampled and
    drafted, the random draws follow the draft lengths: the same tokens as alone for a fixed length
    in a batch of one, else other draws from the same distribution."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} token budgets for {len(prompts)} prompts")
    scheduler = Scheduler(model, plan, draft, draft_length, max_batch=max_batch, drafter_per_job=True)
    sampling = sampling if sampling is not None else SamplingParams()
    futures = [scheduler.submit(Job(prompt, budget, sampling, seed, tuple(stop), stop_at_eos=stop_at_eos,
                                    chat=chat)) for prompt, seed, budget in zip(prompts, seeds, budgets)]
    scheduler.run(until_idle=True)
    return [future.result() for future in futures]
