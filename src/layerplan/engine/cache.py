"""KV cache whose slots belong to plan steps, not to layer modules.

A repeated layer runs in two steps and so owns two slots: sharing one would make the second pass
attend to the first pass's keys, which is a different model. Buffers are preallocated and written
by position (gpt-fast style), so rolling back after a rejected draft is just `crop(length)`.
"""

from __future__ import annotations

import torch


class KVCache:
    """K/V buffers of shape (batch, kv_heads, capacity, head_dim), one per plan step."""

    def __init__(self, num_slots: int, capacity: int = 256) -> None:
        self.capacity = capacity  # initial positions per buffer; grows by doubling when exceeded
        self.keys: list[torch.Tensor | None] = [None] * num_slots
        self.values: list[torch.Tensor | None] = [None] * num_slots
        self.lengths = [0] * num_slots  # positions written (and valid) per slot
        self.write_pos = 0  # first position of the chunk being run; set by the runner
        # (sink, recent): single-token reads return only the first `sink` and the last `recent`
        # positions (a windowed draft, StreamingLLM-style); None returns everything
        self.read_window: tuple[int, int] | None = None
        # zero-fill the positions a step skipped instead of refusing the write: set while a
        # dynamic-exit draft leaves deeper slots unwritten (the verify pass rewrites them)
        self.fill_gaps = False
        # what an executor built from the buffers' addresses (the native kernels' slot
        # descriptors), by the executor's key: emptied whenever a buffer is allocated, so nothing
        # in it points at a buffer this cache no longer holds
        self.descriptors: dict = {}
        self.views = tuple(_SlotView(self, i) for i in range(num_slots))
        # the residual stream entering some steps, by position (keep_streams): what a plan that
        # changes from such a step on restarts from, its earlier slots kept (app/chat.py /plan).
        # Only passes of `stream_plan` write them, so a stream is what that plan's steps before it
        # made of the tokens (a pass of another plan on this cache, a draft's, writes none).
        self.stream_plan = None
        self.stream_steps: frozenset[int] = frozenset()
        self.streams: dict[int, torch.Tensor] = {}  # step -> (capacity, hidden)
        self.stream_lengths: dict[int, int] = {}  # positions written (and valid) per kept stream

    @property
    def num_slots(self) -> int:
        return len(self.keys)

    def resize(self, num_slots: int) -> None:
        """num_slots slots: the first ones kept, new ones empty (a plan of another length)."""
        keep = min(num_slots, self.num_slots)
        extra = num_slots - keep
        self.keys = self.keys[:keep] + [None] * extra
        self.values = self.values[:keep] + [None] * extra
        self.lengths = self.lengths[:keep] + [0] * extra
        self.views = tuple(_SlotView(self, i) for i in range(num_slots))
        self.descriptors.clear()

    def drop_slots(self, start: int) -> None:
        """Forget the slots from `start` on, buffers and positions: their next writes allocate
        anew (another plan's steps there, maybe of another shape)."""
        for slot in range(start, self.num_slots):
            self.keys[slot] = self.values[slot] = None
            self.lengths[slot] = 0
        self.descriptors.clear()

    def keep_streams(self, plan, steps) -> None:
        """From now on, passes of `plan` keep the residual stream entering each of `steps` (plan
        step indices) at its positions; streams of other steps are dropped."""
        self.stream_plan, self.stream_steps = plan, frozenset(steps)
        for step in set(self.streams) - self.stream_steps:
            del self.streams[step], self.stream_lengths[step]

    def keeps_streams_of(self, plan) -> bool:
        return bool(self.stream_steps) and (plan is self.stream_plan or plan == self.stream_plan)

    def stream_buffer(self, step: int, start: int, end: int, width: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """Step's stream buffer (capacity, width), positions [start, end) marked written (the
        caller fills them); allocated, or grown by doubling, as the KV buffers are (the native
        step table is pointed at the streams anew at every call, so no descriptor is kept)."""
        buffer = self.streams.get(step)
        if start > self.stream_lengths.get(step, 0):
            raise RuntimeError(f"the stream of step {step} holds {self.stream_lengths.get(step, 0)} positions but a "
                               f"write starts at {start}")
        if buffer is None or end > buffer.shape[0] or buffer.shape[1] != width or buffer.dtype != dtype:
            size = max(self.capacity, end, 2 * buffer.shape[0] if buffer is not None else 0)
            grown = torch.empty(size, width, dtype=dtype, device=device)
            keep = self.stream_lengths.get(step, 0) if buffer is not None and buffer.shape[1:] == grown.shape[1:] \
                and buffer.dtype == dtype else 0
            if keep:
                grown[:keep] = buffer[:keep]
            self.streams[step], self.stream_lengths[step], buffer = grown, keep, grown
        self.stream_lengths[step] = end
        return buffer

    def keep_stream(self, step: int, start: int, hidden: torch.Tensor) -> None:
        """The stream entering `step` of a pass (1, T, hidden) at positions [start, start + T)."""
        rows = hidden.shape[1]
        buffer = self.stream_buffer(step, start, start + rows, hidden.shape[-1], hidden.dtype, hidden.device)
        buffer[start:start + rows] = hidden[0]

    @property
    def length(self) -> int:
        """Positions valid in every slot that has been written."""
        written = [n for n, k in zip(self.lengths, self.keys) if k is not None]
        return min(written) if written else 0

    def reserve(self, slot: int, end: int, batch: int, heads: int, key_dim: int, value_dim: int,
                dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Make positions [write_pos, end) of the slot writable and mark them written; return the
        slot's whole buffers (B, H, capacity, D), which the caller fills at those positions."""
        start = self.write_pos
        if start > self.lengths[slot] and not (self.fill_gaps and self.keys[slot] is not None):
            raise self._gap(slot, start)
        buf_k, buf_v = self.keys[slot], self.values[slot]
        if buf_k is None or end > buf_k.shape[2] or buf_k.shape[0] != batch:
            buf_k, buf_v = self._allocate(slot, batch, heads, key_dim, value_dim, dtype, device, end)
        if start > self.lengths[slot]:  # fill_gaps: zero keys and values, a defined placeholder
            buf_k[:, :, self.lengths[slot] : start] = 0
            buf_v[:, :, self.lengths[slot] : start] = 0
        self.lengths[slot] = end
        return buf_k, buf_v

    def mark_written(self, slots, end: int) -> None:
        """reserve() for slots whose buffers already hold `end` positions (and fill_gaps off):
        positions [write_pos, end) of each are marked written (the caller fills them)."""
        start, lengths = self.write_pos, self.lengths
        for slot in slots:
            if start > lengths[slot]:
                raise self._gap(slot, start)
            lengths[slot] = end

    def _gap(self, slot: int, start: int) -> RuntimeError:
        return RuntimeError(f"KV slot {slot} holds {self.lengths[slot]} positions but a write starts at {start}: "
                            "a step that skipped earlier positions cannot attend to them")

    def write(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store key/value (B, H, T, D) at positions [write_pos, write_pos+T); return all keys and
        values of the slot up to the end of the chunk, views into the buffer."""
        start = self.write_pos
        end = start + key.shape[2]
        b, h, _, d = key.shape
        buf_k, buf_v = self.reserve(slot, end, b, h, d, value.shape[3], key.dtype, key.device)
        buf_k[:, :, start:end] = key
        buf_v[:, :, start:end] = value
        if self.read_window is not None and end - start == 1:
            sink, recent = self.read_window
            if end > sink + recent:
                keys = torch.cat([buf_k[:, :, :sink], buf_k[:, :, end - recent : end]], 2)
                values = torch.cat([buf_v[:, :, :sink], buf_v[:, :, end - recent : end]], 2)
                return keys, values
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def _allocate(self, slot: int, batch: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                  device: torch.device, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[slot], self.values[slot]
        keep = self.lengths[slot] if old_k is not None and old_k.shape[0] == batch else 0
        size = max(self.capacity, needed, 2 * old_k.shape[2] if old_k is not None else 0)
        new_k = torch.empty(batch, heads, size, key_dim, dtype=dtype, device=device)
        new_v = torch.empty(batch, heads, size, value_dim, dtype=dtype, device=device)
        if keep:
            new_k[:, :, :keep] = old_k[:, :, :keep]
            new_v[:, :, :keep] = old_v[:, :, :keep]
        self.keys[slot], self.values[slot], self.lengths[slot] = new_k, new_v, keep
        self.descriptors.clear()
        return new_k, new_v

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (rollback after rejected drafts)."""
        self.lengths = [min(n, length) for n in self.lengths]
        for step, n in self.stream_lengths.items():
            self.stream_lengths[step] = min(n, length)

    def keep_path(self, start: int, nodes: list[int]) -> None:
        """After a token-tree pass written at [start, start + nodes of the tree): keep the entries of
        `nodes` (a path, root first) at start, start + 1, ... and forget the rest. Moved in place:
        the slots' other positions are not copied."""
        if nodes and nodes != list(range(len(nodes))):
            source = torch.tensor(nodes) + start
            end = start + len(nodes)
            with torch.inference_mode():  # the buffers are inference tensors (written by the runner)
                for slot, (keys, values) in enumerate(zip(self.keys, self.values)):
                    if keys is not None and self.lengths[slot] > int(source.max()):
                        keys[:, :, start:end] = keys[:, :, source.to(keys.device)]
                        values[:, :, start:end] = values[:, :, source.to(values.device)]
                for step, stream in self.streams.items():
                    if self.stream_lengths[step] > int(source.max()):
                        stream[start:end] = stream[source.to(stream.device)]
        self.crop(start + len(nodes))


class _SlotView:
    """What an attention module sees as its cache (`cache`, or `past_key_values` before transformers 5.24): it calls update(k, v, layer_idx) and
    gets the slot's keys back. The module's own layer_idx is ignored: the plan step decides."""

    __slots__ = ("cache", "slot")

    def __init__(self, cache: KVCache, slot: int) -> None:
        self.cache = cache
        self.slot = slot

    def update(self, key_states, value_states, layer_idx=None, cache_kwargs=None, *args, **kwargs):
        return self.cache.write(self.slot, key_states, value_states)
