"""Python's cyclic garbage collector, paused while a model loads.

Importing torch and transformers and building a model's modules makes ~400k objects that live as
long as the process. While they are being made, every few thousand allocations the collector runs,
and each full collection walks all of them again: seven full collections during one load of the
packaged model, ~0.6 s of a 2.5 s load on this project's CPUs. Nothing made then is garbage in
cycles worth collecting early, so the collector waits until the load is done and then counts
from zero. The previous state comes back on exit (a caller that had it disabled keeps it so).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """The collector off inside the block; as it was before, after it (nested blocks are fine)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
