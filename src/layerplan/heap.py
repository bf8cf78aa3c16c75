"""How the process's C heap treats large blocks (glibc). Nothing imported at the module's import:
the command's launcher (app/launch.py) imports it first thing, before the tokenizer's fork that
a later start waits for."""

from __future__ import annotations

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEPT_BLOCK_BYTES = 1 << 30  # blocks below this come from the heap, and freed ones stay in it


def keep_freed_memory() -> bool:
    """Ask the C heap (glibc) to serve blocks below KEPT_BLOCK_BYTES itself and keep what is freed,
    rather than map each large block afresh and unmap it when freed. The kernels allocate a pass's
    scratch anew every pass (a 512-token pass of a 1.5B: the gate and up outputs, 37 MB a layer,
    the activations quantized, ...), and each fresh 4 KB page costs a fault on first touch:
    ~250,000 a pass, 11% of its time on the AMD EPYC with AVX-512. (numpy's own large arrays ask
    for 2 MB pages and fault little.) The process then keeps its high-water mark of freed memory,
    as llama.cpp keeps its compute buffers. The `layerplan` command asks for it at its start; a
    library user may. The panels are mapped apart (engine/kernel_library.py huge_page_buffer), so
    they still start untouched, on 2 MB pages. False where the C library is not glibc."""
    import ctypes  # (here: see the module)

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEPT_BLOCK_BYTES))


class collector_paused:
    """Python's cyclic garbage collector off for a block that makes millions of objects and frees
    none in cycles (a large vocabulary's JSON, its merges and table): the collector's passes,
    set off by the count of objects made, were a fifth to a third of such a block's time. It is
    on again after (where it was on)."""

    def __enter__(self) -> None:
        import gc  # (here: see the module)

        self._was_on = gc.isenabled()
        gc.disable()

    def __exit__(self, *exception) -> None:
        import gc

        if self._was_on:
            gc.enable()
