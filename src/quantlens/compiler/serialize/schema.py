"""The IR file format, declared once: magic, versions, the safetensors metadata keys, the header's fields, the
tensor dtypes a file holds, and the checksum over header and constants.

:mod:`.writer` writes exactly these fields, :mod:`.reader` checks the magic, versions and checksum, and
:mod:`.validate` checks each field's contents. A change here that old readers cannot follow bumps
``FORMAT_VERSION``.
"""

from __future__ import annotations

import hashlib
import struct

import torch

MAGIC = "quantlens-ir"
#: version of the file layout (header fields and their encoding); bumped on any incompatible change.
#: 2: the checksum (metadata key ``CHECKSUM_KEY``) covers the header text as well as the constants.
FORMAT_VERSION = 2
#: the safetensors metadata key that holds the JSON header.
METADATA_KEY = "quantlens"
#: the safetensors metadata key that holds the SHA-256 of the header text and the constants.
CHECKSUM_KEY = "quantlens_sha256"

# Tensor dtypes the file can hold (torch name -> torch dtype); everything safetensors stores.
DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
#: dtypes a value of the graph may have besides those (host ops' intermediate values: an FFT's complex result);
#: no constant is stored in them
VALUE_DTYPES = frozenset(DTYPES) | {"complex64", "complex128"}

#: the fields of the JSON header (``writer._header`` writes them all; ``validate`` refuses missing or extra ones)
HEADER_FIELDS = frozenset({"magic", "format_version", "ir_version", "kind", "inputs", "outputs", "constants",
                            "values", "nodes", "input_leaves", "input_spec", "output_spec", "meta", "writer"})
#: the fields of one entry of ``nodes``, ``values`` and ``input_leaves``
NODE_FIELDS = frozenset({"op", "inputs", "outputs", "attrs", "site"})
VALUE_FIELDS = frozenset({"name", "shape", "dtype", "qdtype", "scale", "axis"})
LEAF_FIELDS = frozenset({"kind", "name", "value"})


def file_checksum(text: str, constants: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the whole model: the header text, then every constant (sorted by name) with its dtype,
    shape and bytes. Every field is length-prefixed, so no two different files share the same byte stream."""
    digest = hashlib.sha256()

    def field(data: bytes) -> None:
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)

    field(f"{MAGIC}/{FORMAT_VERSION}".encode())
    field(text.encode("utf-8"))
    for name in sorted(constants):
        t = constants[name]
        field(name.encode("utf-8"))
        field(str(t.dtype).encode())
        field(repr(tuple(t.shape)).encode())
        field(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
