"""Which qat IR a derived file came from: the digest of a qat IR, recorded in what is made from it, and the check
that a pair belongs together.

``convert`` records the digest of its qat IR in the quantized IR's meta (:data:`SOURCE_DIGEST_KEY`, saved with the
module), ``to_onnx`` in the ONNX model's ``metadata_props`` (:data:`ONNX_SOURCE_DIGEST_PROP`). A pair of a qat IR
and a derived file (``quantlens compare``, ``QuantAnalysis`` 'convert' / 'onnxruntime') recomputes the qat IR's
digest and refuses a file recorded from another one: another version of the model (other weights, another graph)
would otherwise show every op site's difference as the runtime's or the integer kernels'. A file without the
record (written before it existed, or by another tool) cannot be checked: :func:`check_source` returns a warning.

The digest covers what the IR computes: the graph (inputs, outputs, nodes with their attrs and op sites, value
types) and every constant (name, dtype, shape, bytes); not its meta, nor the writer. It is the same for a module
in memory and after ``save`` / ``load``, and it is recomputed where it is checked, so a module changed after
``export`` is held to what it computes now.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any

import torch

from quantlens.compiler.ir import Module
from quantlens.errors import QuantLensError

__all__ = ["ir_digest", "check_source", "is_digest", "SOURCE_DIGEST_KEY", "ONNX_SOURCE_DIGEST_PROP"]

#: the quantized IR's meta key holding its qat IR's digest (``convert`` writes it, ``load`` validates it)
SOURCE_DIGEST_KEY = "source_ir_digest"
#: the ONNX ``metadata_props`` key holding the digest of the qat IR the model was written from (``to_onnx``)
ONNX_SOURCE_DIGEST_PROP = "quantlens.source_ir_digest"
#: bumped when what the digest covers changes (a recorded digest of another version never matches)
_DIGEST_VERSION = "quantlens-ir-digest/1"
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: the digest's first characters in messages (enough to tell two models apart)
_SHOWN = 16


def is_digest(value: Any) -> bool:
    """Whether ``value`` is a digest as :func:`ir_digest` writes it (64 lower-case hex characters)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def _canonical(value: Any, where: str) -> Any:
    """A value as the IR file encodes it (strict JSON); a value the file cannot hold is taken by its repr (the
    digest never fails, ``save`` says what it cannot write)."""
    from quantlens.compiler.serialize.codec import encode_value

    try:
        return encode_value(value, where)
    except QuantLensError:
        return {"$repr": repr(value)}


def _graph_text(module: Module) -> str:
    graph = module.graph
    values = []
    for name in sorted(graph.values):
        info = graph.values[name]
        values.append([name, [int(d) for d in info.shape],
                       *(_canonical(v, name) for v in (info.dtype, info.qdtype, info.scale, info.axis))])
    nodes = [[n.op, list(n.inputs), list(n.outputs), _canonical(dict(n.attrs), n.op), n.site] for n in graph.nodes]
    body = {"inputs": list(graph.inputs), "outputs": list(graph.outputs), "nodes": nodes, "values": values}
    return json.dumps(body, sort_keys=True, allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def ir_digest(module: Module) -> str:
    """SHA-256 (hex) of what ``module`` computes: its graph and every constant (see the module docstring).

    Every field is length-prefixed, so no two different graphs share the byte stream hashed."""
    if not isinstance(module, Module):
        raise QuantLensError(f"ir_digest expects a quantlens.compiler.Module, got {type(module).__name__}.")
    digest = hashlib.sha256()

    def field(data: bytes | memoryview) -> None:
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)

    field(_DIGEST_VERSION.encode())
    field(_graph_text(module).encode("utf-8"))
    for name in sorted(module.graph.constants):
        t = module.graph.constants[name]
        field(name.encode("utf-8"))
        if not isinstance(t, torch.Tensor):
            field(repr(t).encode("utf-8"))
            continue
        t = t.detach().to("cpu")
        field(str(t.dtype).encode())
        field(repr(tuple(t.shape)).encode())
        if t.is_complex():
            t = torch.view_as_real(t.resolve_conj())
        field(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    return digest.hexdigest()


def check_source(recorded: str | None, source: Module, *, who: str, derived: str, remake: str,
                 source_name: str = "") -> str:
    """Hold a derived file's recorded digest to the qat IR ``source`` given with it.

    Raises ``QuantLensError`` (in words: which file, made from which digest, which was expected, how to fix it)
    when the digests differ. Returns ``""`` when they match, and a warning (the file records no source, so the
    pair cannot be checked) when ``recorded`` is None.

    Args:
        recorded: the digest the derived file records (None: it records none).
        source: the qat IR given as its source.
        who: the caller, leading the message (``"quantlens compare"``, ``"QuantAnalysis('convert')"``).
        derived: the derived file in words (``"the ONNX file 'm.onnx'"``).
        remake: how to make it again from this qat IR (``"to_onnx(qat_ir, path)"``).
        source_name: the qat IR's file, when it came from one.
    """
    if recorded is None:
        return (f"{who}: {derived} records no digest of the qat IR it was made from (written by an older quantlens "
                "or another tool), so whether it belongs to this qat IR is not checked; make it again with "
                f"{remake} to have the pair checked.")
    expected = ir_digest(source)
    if recorded == expected:
        return ""
    given = f"the qat IR given with it ('{source_name}')" if source_name else "the qat IR given with it"
    raise QuantLensError(
        f"{who}: {derived} was made from the qat IR with digest {recorded[:_SHOWN]}..., and {given} has digest "
        f"{expected[:_SHOWN]}... (its graph or its weights differ): it belongs to another version of "
        "the model, and every op site's difference would be that model's, not the deployment's. Give the qat IR "
        f"it was made from, or make it again from this qat IR with {remake}.")
