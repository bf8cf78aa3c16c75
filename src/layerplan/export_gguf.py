"""A plan of a GGUF written as a GGUF file of the source's stored blocks, without torch: layer j
is a byte-for-byte copy of the tensors of the layer step j runs (llama.cpp runs the frankenmerge
without quantizing again). Both front ends write it so: export.py export_gguf on the torch front
end, after its checks of the loaded model; lite/exporting.py on the light one, from the file alone.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from layerplan.files import atomic_file
from layerplan.models.gguf_file import (ARRAY_TYPE, DEFAULT_ALIGNMENT, MAGIC, SCALAR_FORMATS, STRING_TYPE, GGUFHeader,
                                        TensorInfo)
from layerplan.plan.plan import LayerPlan

# A GGUF layer's tensors that make each sub-layer's update (llama.cpp's names, the same in every
# architecture): a switched-off sub-layer exports with them zero, which adds exactly nothing to the
# residual stream (a post-norm of zero is zero), in any stored type (all-zero bytes are zero weights).
GGUF_UPDATE_TENSORS = {"attention": ("attn_output.",), "mlp": ("ffn_down.", "ffn_down_exps.", "ffn_down_shexp.")}


def gguf_scale_refusal(plan: LayerPlan) -> str | None:
    """Why the plan's residual scales cannot be written as stored blocks (one line), or None: a
    GGUF keeps its weights as stored, so a sub-layer exports only on (1) or off (0)."""
    for j, step in enumerate(plan.active_steps):
        for sub_layer, on in (("attention", step.attention), ("mlp", step.mlp)):
            if on and step.scale not in (0.0, 1.0):
                return (f"step {j} scales its {sub_layer} by {step.scale:g}: a GGUF keeps the stored weights as they "
                        "are, so only 0 (off) and 1 export; use --to checkpoint")
    return None


def gguf_pattern_refusal(model_type: str, layer_types: list[str], pattern: list[str], plan: LayerPlan) -> str | None:
    """Why a model of layers of several kinds (layer_types) cannot be written as the plan (one
    line), or None. A GGUF names no layer's kind: its reader gives layer j the kind the
    architecture's pattern for the file's depth has at j (`pattern`; llama.cpp's Gemma 3: every
    sixth layer full), so step j must run a layer of that kind."""
    for j, step in enumerate(plan.active_steps):
        if j >= len(pattern) or layer_types[step.layer] != pattern[j]:
            wanted = pattern[j] if j < len(pattern) else "none"
            return (f"{model_type} has layers of several kinds, which a GGUF gives as a pattern, "
                    f"not layer by layer: the plan's layer {j} runs layer {step.layer} ({layer_types[step.layer]}) "
                    f"where a GGUF of {len(pattern)} layers has {wanted}; use --to checkpoint, or a plan that "
                    f"keeps the pattern")
    return None


def write_gguf_plan(header: GGUFHeader, plan: LayerPlan, path: str | os.PathLike) -> Path:
    """Write the plan of the GGUF file whose header this is (models/gguf_file.py read_header) as a
    GGUF file (version 3) at `path`, atomically:
    its metadata entries as the source's bytes, but the block count and each per-layer array
    (an array of the architecture's with one item a layer), which follow the plan; layer j's
    tensors the bytes of the layer step j runs, in their stored types (a switched-off sub-layer's
    update tensors zero). The caller has checked the plan (gguf_scale_refusal, and layers of one
    kind or in the file's pattern). Written from the header alone, the blocks copied by the
    operating system (copy_file_range): no reader builds a value of each vocabulary string."""
    arch = header.architecture
    depth = int(header.get("{arch}.block_count"))
    alignment = int(header.get("general.alignment", DEFAULT_ALIGNMENT))
    steps = plan.active_steps
    # a switched-off sub-layer's update tensors are written zero
    zeroed = {j: tuple(name for sub_layer, on in (("attention", step.attention), ("mlp", step.mlp))
                       if not on or step.scale == 0.0 for name in GGUF_UPDATE_TENSORS[sub_layer])
              for j, step in enumerate(steps)}
    by_layer: dict[int, list[TensorInfo]] = {}
    tensors: list[tuple[str, TensorInfo, bool]] = []  # (name, the source's tensor, written zero)
    for tensor in header.tensors:
        if tensor.name.startswith("blk."):
            by_layer.setdefault(int(tensor.name.split(".")[1]), []).append(tensor)
        else:
            tensors.append((tensor.name, tensor, False))
    for j, step in enumerate(steps):
        for tensor in by_layer[step.layer]:
            rest = tensor.name.split(".", 2)[2]
            tensors.append((f"blk.{j}.{rest}", tensor, rest.startswith(zeroed[j])))

    path = Path(path)
    with open(header.path, "rb", buffering=0) as source_file, atomic_file(path) as staged, \
            open(staged, "wb", buffering=0) as out:
        fd = source_file.fileno()
        head = [MAGIC + struct.pack("<IQQ", 3, len(tensors), len(header.entry_spans))]
        for key, start, end in header.entry_spans:
            value, raw = header.metadata[key], os.pread(fd, end - start, start)
            kind = struct.unpack_from("<I", raw, 8 + len(key.encode()))[0]
            if key == f"{arch}.block_count":
                head.append(_string(key) + struct.pack("<I", kind) + struct.pack(SCALAR_FORMATS[kind], len(steps)))
            elif key.startswith(f"{arch}.") and kind == ARRAY_TYPE and len(value) == depth:
                item = struct.unpack_from("<I", raw, 12 + len(key.encode()))[0]
                head.append(_string(key) + _array(item, [value[step.layer] for step in steps]))
            else:
                head.append(raw)
        offset = 0
        for name, tensor, _ in tensors:
            head.append(_string(name) + struct.pack(f"<I{len(tensor.shape)}QIQ", len(tensor.shape), *tensor.shape,
                                                 tensor.type_id, offset))
            offset += _padded(tensor.nbytes, alignment)
        size = sum(len(part) for part in head)
        head.append(bytes(_padded(size, alignment) - size))
        _write_all(out, b"".join(head))
        for _, tensor, zero in tensors:
            if zero:
                _write_all(out, bytes(tensor.nbytes))
            else:
                _copy(fd, out, tensor.offset, tensor.nbytes)
            _write_all(out, bytes(_padded(tensor.nbytes, alignment) - tensor.nbytes))
        os.fsync(out.fileno())
    return path


def _write_all(out, data: bytes) -> None:
    """(an unbuffered file's write may write less than it is given)"""
    view = memoryview(data)
    while view:
        view = view[out.write(view):]


COPY_CHUNK = 16 << 20  # bytes a read where the operating system cannot copy between the files itself


def _copy(fd: int, out, offset: int, size: int) -> None:
    """size bytes of file descriptor fd from offset to out's position: by the operating system
    where it can (copy_file_range: no pages in this process), else in chunks (the file's pages
    stay the page cache's, not this process's memory)."""
    done = 0
    try:
        while done < size:
            copied = os.copy_file_range(fd, out.fileno(), size - done, offset + done)
            if copied == 0:
                break
            done += copied
    except OSError:  # (not between these files' file systems)
        pass
    while done < size:
        chunk = os.pread(fd, min(COPY_CHUNK, size - done), offset + done)
        if not chunk:
            raise OSError(f"{size - done} bytes short of the tensor at byte {offset}: the file changed as it was read")
        _write_all(out, chunk)
        done += len(chunk)


def _padded(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _string(text: str) -> bytes:
    """A GGUF string (a key, a tensor's name, an array's item): u64 length, then UTF-8."""
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _array(item: int, items: list) -> bytes:
    """An array entry's type and value (its key written before it), its items of GGUF type item."""
    head = struct.pack("<IIQ", ARRAY_TYPE, item, len(items))
    if item == STRING_TYPE:
        return head + b"".join(_string(text) for text in items)
    return head + b"".join(struct.pack(SCALAR_FORMATS[item], value) for value in items)
