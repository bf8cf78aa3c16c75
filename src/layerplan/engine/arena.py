"""Memory for a model's packed weights (WeightArena), and the threads that fill it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

import torch

from layerplan.engine.kernel_library import huge_page_buffer


class WeightArena:
    """Memory for a model's packed weights, in chunks on 2 MB pages where the system gives them
    (lp_advise_huge_pages). A pass streams every packed weight from memory once, and on 4 KB pages
    that costs a TLB miss every 64 cache lines and stops the hardware prefetchers at every page
    (benchmarks/product_pages.c measures the difference). Chunks rather than a buffer per matrix,
    so that the small matrices (a layer's o_proj) sit on 2 MB pages too."""

    CHUNK = 64 << 20

    def __init__(self, panels=None, fillers: int = 1) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self.panels = panels  # where a GGUF's matrices may be found packed already
        # threads that fill stored matrices (read and pack a file's rows, or read kept panels):
        # each job is one C call or file read without the GIL, and faulting in fresh pages
        # (2 MB ones are compacted for) costs as much as the copy, so they run side by side
        self.fillers = fillers
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        # on_filled(bytes done, bytes given) as settle() sees jobs finish (a first load's progress bar)
        self.on_filled: Callable[[int, int], None] | None = None
        self._sizes: dict[Future, int] = {}  # each pending job's bytes
        self._given = self._done = 0

    def fill(self, job: Callable[[], object], nbytes: int) -> Future:
        """Run `job` (it writes `nbytes` of a matrix's packed bytes into this arena) on the fill
        threads; its matrix is ready for the kernels once settle() (or the future returned) is done."""
        if self.fillers <= 1:
            done: Future = Future()
            done.set_result(job())
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.fillers, thread_name_prefix="layerplan-fill")
        self._pending.append(self._pool.submit(job))
        self._sizes[self._pending[-1]] = nbytes
        self._given += nbytes
        return self._pending[-1]

    def settle(self) -> None:
        """Wait for every fill job; the first that failed raises its error here."""
        pending, self._pending = self._pending, []
        try:
            for job in as_completed(pending):
                job.result()
                self._done += self._sizes.pop(job)
                if self.on_filled is not None:
                    self.on_filled(self._done, self._given)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-d tensor of numel elements, 4 KB-aligned, in the arena."""
        nbytes = numel * dtype.itemsize
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = torch.from_numpy(huge_page_buffer(max(self.CHUNK, nbytes))), 0
        out = self._chunk[self._used:self._used + nbytes].view(dtype)
        self._used += -(-nbytes // 4096) * 4096
        return out
