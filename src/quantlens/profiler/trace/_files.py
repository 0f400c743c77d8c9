"""Writing a trace's safetensors files: straight from the tensors' memory, through a temporary name."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantlens._io import atomic_write
from quantlens.profiler.trace.format import ALIGN

#: the safetensors dtype codes of the tensors written without ``save_file`` (the others go through it)
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                     ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _code


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` that nothing else holds (the model may change ``t`` in place later)."""
    return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Write contiguous CPU tensors as a safetensors file, straight from their memory (no serialised copy);
    dtypes safetensors has no code for go through ``safetensors.torch.save_file``."""
    if any(t.dtype not in ST_DTYPES or not t.is_contiguous() or t.device.type != "cpu" for t in tensors.values()):
        save_file({k: dense_copy(t) for k, t in tensors.items()}, str(path))
        return
    header, offset = {}, 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)  # the first tensor's data starts 64-byte aligned in the file
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file written through a temporary name (never a half-written file)."""
    payload, seen = {}, set()
    for key, value in tensors.items():
        t = value.detach().cpu()
        storage = t.untyped_storage()
        # dense, unshared storage only: copy views and shared tensors (an identity op's output is its input)
        if not t.is_contiguous() or storage.nbytes() != t.nbytes or storage.data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        payload[key] = t
    atomic_write(path, lambda tmp: write_safetensors(tmp, payload), size=sum(t.nbytes for t in payload.values()))
