"""Several generations at once (continuous batching): each request's decode is a
generate.Decoding (plain) or a speculative.SpeculativeDecoding (its own drafter, draft length and
acceptance), and a step
runs every active one's next pass (its pending token, and its drafted chain) as one pass
(runner.forward_batch), whose products the requests share. A request's tokens are those of its
own generate() call, bit for bit: the kernels' rows do not depend on the other rows of a pass,
and each request keeps its own cache, positions, sampler and seed. Requests join at any step,
their prompts prefilled a chunk per pass beside the decoding rows (PREFILL_CHUNK), and leave when
done. The rows of a pass are budgeted (ROW_BUDGET): the more requests, the shorter each one's
drafts, since a pass's cost grows with its rows. The queue that feeds a batch, and its loop:
scheduler.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from layerplan.decoding.generate import Decoding
from layerplan.decoding.speculative import SpeculativeDecoding
from layerplan.engine.executors import executor_of
from layerplan.engine.runner import forward_batch
from layerplan.models.loading import LoadedModel

# the rows a batch's pass carries at most, drafts included: one request drafts up to its policy's
# length, 4 up to 3 tokens each, 8 one each (what an 8-16-row pass costs over one row on a CPU)
ROW_BUDGET = 16
# prompt rows a pass carries at most beside the decoding rows: a newcomer's prompt goes in chunks,
# so the requests decoding meanwhile wait a chunk's pass per step, not the whole prompt's
PREFILL_CHUNK = 32


@dataclass(eq=False)  # one per decode: compared by identity
class Prefill:
    """A decode whose prompt goes through the batch's passes a chunk at a time."""

    decoding: Decoding | SpeculativeDecoding
    rows: int  # the prompt's
    done_rows: int = 0


def chunkable(model: LoadedModel, rows: int) -> bool:
    """Whether a prompt of `rows` tokens may prefill in chunks: only where the native kernels run
    every sub-layer and take a pass of the whole prompt, whose rows are independent of one another
    (elsewhere a chunk's numbers could differ from the whole prompt's, and the request's tokens
    from its solo run's)."""
    native = executor_of(model).native
    return native is not None and native.takes(rows) and not native.eager_sub_layers()


def prefill_all(model: LoadedModel, joining: Sequence[Decoding | SpeculativeDecoding]) -> None:
    """The prompts of the decodes that join, each through its own plan, in one pass (the head on
    each one's last row only; a cache that holds the prompt's first tokens, from the next one),
    and each one's first token."""
    sequences = [(d.ids[:, d.cache.length:], d.cache, d.cache.length) for d in joining]  # past what a cache kept
    for decoding, logits in zip(joining, forward_batch(model, sequences, [d.plan for d in joining], last_only=True)):
        decoding.prefilled(logits[-1])


def step_all(model: LoadedModel, active: Sequence[Decoding | SpeculativeDecoding],
             prefilling: Sequence[Prefill] = ()) -> list[Prefill]:
    """The next pass of every active decode (a token each, and the drafts' chains within the row
    budget) and the next chunks of the prompts prefilling (PREFILL_CHUNK rows at most, the first
    joined first), in one pass, each through its own plan (the steps their plans begin with alike
    shared by all); the prefills it completed (each decode holds its first token)."""
    # a chunk at a time beside decoding rows, so they wait a chunk's pass per step; with none
    # decoding, none waits: the prompts' rows whole (the same numbers: chunkable)
    chunks = []
    budget = PREFILL_CHUNK if active else sum(p.rows - p.done_rows for p in prefilling)
    for prefill in prefilling:
        if budget == 0:
            break
        rows = min(budget, prefill.rows - prefill.done_rows)
        chunks.append((prefill, rows))
        budget -= rows
    cap = max(ROW_BUDGET // max(len(active), 1) - 1, 0)
    # the rows the pass carries besides a decode's own: the others' tokens and the prompts' chunks
    others = len(active) - 1 + sum(rows for _, rows in chunks)
    passes = [d.next_pass(cap, others) for d in active]
    sequences = passes + [(p.decoding.ids[:, p.done_rows:p.done_rows + rows], p.decoding.cache, p.done_rows)
                          for p, rows in chunks]
    # a verify needs every row's logits; a chunk only its prompt's last row's, in its last chunk
    wanted = [ids.shape[1] for ids, _, _ in passes] + [int(p.done_rows + rows == p.rows) for p, rows in chunks]
    start = time.perf_counter()
    plans = [d.plan for d in active] + [p.decoding.plan for p, _ in chunks]
    every = forward_batch(model, sequences, plans, wanted=wanted)
    seconds, rows = time.perf_counter() - start, sum(ids.shape[1] for ids, _, _ in sequences)
    for decoding, logits in zip(active, every):
        if isinstance(decoding, Decoding):
            decoding.take_pass(logits, rows, seconds)
        else:  # a speculative round times its own verify
            decoding.take_pass(logits)
    completed = []
    for (prefill, count), logits in zip(chunks, every[len(passes):]):
        prefill.done_rows += count
        if prefill.done_rows == prefill.rows:
            prefill.decoding.prefilled(logits[-1])
            completed.append(prefill)
    return completed


class Batch:
    """The decodes of a continuous batch, each under a key of the caller's and each with its own
    plan: those decoding, those whose prompts still prefill a chunk at a time, and those joined
    whose prompts prefill whole (where chunks could change their numbers). step() runs their next
    pass."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.decoding: list[tuple[object, Decoding | SpeculativeDecoding]] = []
        self.prefilling: list[tuple[object, Prefill]] = []
        self.whole: list[tuple[object, Decoding | SpeculativeDecoding]] = []

    def __len__(self) -> int:
        return len(self.decoding) + len(self.prefilling) + len(self.whole)

    def join(self, key, decoding: Decoding | SpeculativeDecoding) -> None:
        rows = decoding.ids.shape[1]
        if chunkable(self.model, rows):  # from the first token its cache does not hold (a chat's kept turns)
            self.prefilling.append((key, Prefill(decoding, rows, decoding.cache.length)))
        else:
            self.whole.append((key, decoding))

    def entries(self) -> list[tuple[object, Decoding | SpeculativeDecoding]]:
        """(key, decode) of every decode in the batch."""
        return self.decoding + [(k, p.decoding) for k, p in self.prefilling] + self.whole

    def clear(self) -> None:
        self.decoding, self.prefilling, self.whole = [], [], []

    def step(self) -> list[tuple[object, Decoding | SpeculativeDecoding]]:
        """One pass for the batch (the whole prompts joined, if any, first in a pass of their own);
        the (key, decode) pairs that finished with it, now out of the batch. A decode whose caller
        lost interest while its prompt prefills leaves at once."""
        if self.whole:
            prefill_all(self.model, [d for _, d in self.whole])
            self.decoding, self.whole = self.decoding + self.whole, []
        # asked once each: a client may hang up between two asks, and its decode would be in neither list
        gone, staying = [], []
        for entry in self.prefilling:
            (gone if _lost_interest(entry[1].decoding) else staying).append(entry)
        self.prefilling = staying
        if self.decoding or self.prefilling:
            completed = step_all(self.model, [d for _, d in self.decoding], [p for _, p in self.prefilling])
            self.decoding += [(k, p.decoding) for k, p in self.prefilling if p in completed]
            self.prefilling = [(k, p) for k, p in self.prefilling if p not in completed]
        finished = [(k, d) for k, d in self.decoding if d.done] + [(k, p.decoding) for k, p in gone]
        self.decoding = [(k, d) for k, d in self.decoding if not d.done]
        return finished


def _lost_interest(decoding: Decoding | SpeculativeDecoding) -> bool:
    should_stop = decoding.out.should_stop
    if should_stop is not None and should_stop():
        decoding.out.cancel()
        return True
    return False
