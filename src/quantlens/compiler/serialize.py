"""Save and load an IR module (qat or quantized) as ONE versioned file.

The file is a `safetensors <https://github.com/huggingface/safetensors>`_ file:

* its tensors are the graph constants, keyed by constant name, in their own dtype (float, int8/16/32/64, bool...);
* its metadata (``str -> str``) holds one key, ``"quantlens"``, whose value is a JSON header: magic
  ``"quantlens-ir"``, ``format_version``, ``ir_version``, the module kind, nodes, inputs/outputs, value types,
  input leaves, the input/output pytree specs, meta, and a SHA-256 of the constants' bytes.

JSON cannot hold every Python value the IR uses, so the header encodes them explicitly (strict JSON, no NaN
literals): a non-finite float is ``{"$float": "nan" | "inf" | "-inf"}``, a tuple is ``{"$tuple": [...]}``, and a
dict whose keys are not all plain strings (or start with ``$``) is ``{"$dict": [[key, value], ...]}``. The layout
and the error cases are documented in ``docs/ir.md``.

Writes are atomic (a temporary file in the target folder, fsync, ``os.replace``): a failed ``save`` leaves the
folder as it was. ``load`` raises ``QuantLensError`` naming the file, what is wrong and what was expected for a
damaged, truncated, foreign or newer file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch

from quantlens.compiler.ir import IR_VERSION, Graph, InputLeaf, Module, Node, ValueInfo
from quantlens._io import atomic_write
from quantlens.errors import QuantLensError

__all__ = ["save", "load", "FORMAT_VERSION", "MAGIC", "METADATA_KEY"]

MAGIC = "quantlens-ir"
#: version of the file layout (header fields and their encoding); bumped on any incompatible change.
FORMAT_VERSION = 1
#: the safetensors metadata key that holds the JSON header.
METADATA_KEY = "quantlens"

# Tensor dtypes the file can hold (torch name -> torch dtype); everything safetensors stores.
_DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
_MAX_HEADER_BYTES = 256 * 1024 * 1024


# -- JSON encoding of IR values -------------------------------------------------------------------------------
def _encode(value: Any, where: str) -> Any:
    """A strict-JSON form of ``value`` that ``_decode`` turns back into an equal value of the same type."""
    if value is None or type(value) in (bool, str):
        return value
    if type(value) is int:
        return value
    if type(value) is float:
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if type(value) is list:
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"$tuple": [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) is dict:
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$dict": [[_encode(k, f"{where} key"), _encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise QuantLensError(
        f"{where} has type {type(value).__module__}.{type(value).__qualname__} ({value!r:.80}), which the IR file "
        "cannot store. Attributes, meta and non-tensor input leaves must be None, bool, int, float, str, or "
        "lists/tuples/dicts of these. Convert the value (e.g. an enum to its .value) before saving."
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, body), = value.items()
            if tag == "$float":
                if body not in ("nan", "inf", "-inf"):
                    raise ValueError(f"bad $float value {body!r}")
                return float(body)
            if tag == "$tuple":
                return tuple(_decode(v) for v in _as_list(body, "$tuple"))
            if tag == "$dict":
                return {_hashable(_decode(k)): _decode(v) for k, v in _as_list(body, "$dict")}
        if any(k.startswith("$") for k in value):
            raise ValueError(f"unknown tagged value {sorted(value)!r}")
        return {k: _decode(v) for k, v in value.items()}
    return value


def _as_list(body: Any, tag: str) -> list:
    if not isinstance(body, list):
        raise ValueError(f"{tag} must hold a list")
    return body


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# -- header -------------------------------------------------------------------------------------------------
def _constants_digest(names: list[str], constants: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in names:
        t = constants[name]
        digest.update(name.encode("utf-8"))
        digest.update(str(t.dtype).encode())
        digest.update(repr(tuple(t.shape)).encode())
        if t.numel():
            digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _header(module: Module, constants: dict[str, torch.Tensor]) -> dict:
    graph = module.graph
    names = list(graph.constants)
    leaves = []
    for i, leaf in enumerate(module.input_leaves):
        if leaf.kind == "const" and type(leaf.value) not in (type(None), bool, int, float, str, list, tuple, dict):
            raise QuantLensError(
                f"save: non-tensor input leaf #{i} has type {type(leaf.value).__qualname__} ({leaf.value!r:.80}); "
                "the IR file stores non-tensor inputs fixed at export as JSON values only (None, bool, int, float, "
                "str and lists/tuples/dicts of these). Export with a JSON-compatible value (e.g. a string instead of "
                "an enum), or pass it as a tensor."
            )
        leaves.append({"kind": leaf.kind, "name": leaf.name,
                       "value": _encode(leaf.value, f"save: non-tensor input leaf #{i}")})
    values = []
    for name, info in graph.values.items():
        values.append({
            "name": name,
            "shape": [int(d) for d in info.shape],
            "dtype": _encode(info.dtype, f"save: dtype of value {name!r}"),
            "qdtype": _encode(info.qdtype, f"save: qdtype of value {name!r}"),
            "scale": _encode(info.scale, f"save: scale of value {name!r}"),
            "axis": _encode(info.axis, f"save: axis of value {name!r}"),
        })
    nodes = []
    for node in graph.nodes:
        where = f"save: node '{node.op}' (op site '{node.site}')"
        nodes.append({
            "op": node.op,
            "inputs": list(node.inputs),
            "outputs": list(node.outputs),
            "attrs": _encode(dict(node.attrs), f"{where} attrs"),
            "site": node.site,
        })
    return {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "ir_version": IR_VERSION,
        "kind": module.kind,
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "constants": names,
        "constants_sha256": _constants_digest(names, constants),
        "values": values,
        "nodes": nodes,
        "input_leaves": leaves,
        "input_spec": module.input_spec,
        "output_spec": module.output_spec,
        "meta": _encode(dict(module.meta), "save: module meta"),
        "writer": _writer(),
    }


def _writer() -> str:
    try:
        from importlib.metadata import version

        return f"quantlens {version('quantlens')}"
    except Exception:  # noqa: BLE001 - informational only
        return "quantlens"


# -- save -----------------------------------------------------------------------------------------------------
def save(module: Module, path: str | os.PathLike) -> Path:
    """Write ``module`` (qat or quantized IR) to ``path`` as one file; returns the path.

    The write is atomic: the file appears complete or not at all, and a failed save (e.g. a non-tensor input
    leaf that is not JSON-serialisable) leaves no temporary file behind. Parent folders are created.
    """
    if not isinstance(module, Module):
        raise QuantLensError(f"save expects a quantlens.compiler.Module, got {type(module).__name__}.")
    from safetensors.torch import save_file

    path = Path(path)
    if path.is_dir():
        raise QuantLensError(f"save: '{path}' is a folder; give a file path such as '{path / 'model.qlir'}'.")
    constants = _tensors_for_file(module.graph)
    text = json.dumps(_header(module, constants), allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    atomic_write(path, lambda tmp: save_file(constants, tmp, metadata={METADATA_KEY: text}), fsync=True)
    return path


def _tensors_for_file(graph: Graph) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[tuple[int, int]] = set()
    for name, tensor in graph.constants.items():
        if name == "__metadata__":
            raise QuantLensError("save: a constant is named '__metadata__', a name the file format reserves; "
                                 "rename it in the graph before saving.")
        if not isinstance(tensor, torch.Tensor):
            raise QuantLensError(f"save: constant {name!r} is a {type(tensor).__name__}, expected a torch.Tensor.")
        if str(tensor.dtype).replace("torch.", "") not in _DTYPES:
            raise QuantLensError(f"save: constant {name!r} has dtype {tensor.dtype}, which the IR file cannot "
                                 f"store; supported dtypes are {sorted(_DTYPES)}.")
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory: give each its own storage.
        if t.numel():
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in seen_storage or storage.nbytes() != t.numel() * t.element_size():
                t = t.clone()
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
            seen_storage.add(key)
        tensors[name] = t
    return tensors


# -- load -----------------------------------------------------------------------------------------------------
def load(path: str | os.PathLike) -> Module:
    """Read an IR module written by ``save``.

    Raises ``QuantLensError`` naming the file when it is missing, truncated or otherwise damaged, is not a
    quantlens IR file, or was written by a newer format version than this quantlens reads.
    """
    path = Path(path)
    header = _read_header(path)
    constants = _read_constants(path, header)
    try:
        return _module_from_header(header, constants)
    except (KeyError, TypeError, ValueError, AttributeError, QuantLensError) as exc:
        raise _damaged(path, f"its header is inconsistent ({type(exc).__name__}: {exc})") from exc


def _damaged(path: Path, what: str) -> QuantLensError:
    return QuantLensError(
        f"Cannot load '{path}': {what}. Expected a quantlens IR file written by quantlens.compiler.save "
        f"(a safetensors file with a '{METADATA_KEY}' metadata header, magic '{MAGIC}', format version "
        f"<= {FORMAT_VERSION}). The file may be damaged or incomplete; save the module again."
    )


def _read_header(path: Path) -> dict:
    if not path.exists():
        raise QuantLensError(f"Cannot load '{path}': no such file.")
    if path.is_dir():
        raise QuantLensError(f"Cannot load '{path}': it is a folder, expected a quantlens IR file.")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise _damaged(path, f"the file is {size} bytes long, too short for a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n < 2 or n > _MAX_HEADER_BYTES:
            raise _not_ours(path, size, n)
        if n > size - 8:
            raise _damaged(path, f"it is truncated: its safetensors header announces {n} bytes, the file holds "
                                 f"{size - 8} after the 8-byte length")
        raw = handle.read(n)
    try:
        st_header = json.loads(raw.decode("utf-8"))
        if not isinstance(st_header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise _damaged(path, f"its safetensors header is not valid JSON ({exc})") from exc
    metadata = st_header.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise QuantLensError(
            f"Cannot load '{path}': it is a safetensors file without a quantlens IR header (no '{METADATA_KEY}' "
            "entry in its metadata), e.g. a plain weights file. Expected a file written by "
            "quantlens.compiler.save; load weights with safetensors instead."
        )
    try:
        header = json.loads(metadata[METADATA_KEY])
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (TypeError, ValueError) as exc:
        raise _damaged(path, f"its '{METADATA_KEY}' header is not valid JSON ({exc})") from exc
    magic = header.get("magic")
    if magic != MAGIC:
        raise QuantLensError(
            f"Cannot load '{path}': its header magic is {magic!r}, expected {MAGIC!r}. The file was not written by "
            "quantlens.compiler.save."
        )
    version = header.get("format_version")
    if type(version) is not int or version < 1:
        raise _damaged(path, f"its format_version is {version!r}, expected an integer >= 1")
    if version > FORMAT_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it was written in IR file format version {version}, and this quantlens reads "
            f"versions up to {FORMAT_VERSION}. Upgrade quantlens, or save the module again with this version."
        )
    ir_version = header.get("ir_version")
    if type(ir_version) is not int or ir_version < 1:
        raise _damaged(path, f"its ir_version is {ir_version!r}, expected an integer >= 1")
    if ir_version > IR_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it holds IR version {ir_version}, and this quantlens knows IR versions up to "
            f"{IR_VERSION}. Upgrade quantlens, or export and save the model again with this version."
        )
    # Tensor entries must lie inside the file: catches truncation before safetensors maps the file.
    data_size = size - 8 - n
    end = 0
    for key, entry in st_header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _damaged(path, f"tensor entry {key!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if end > data_size:
        raise _damaged(path, f"it is truncated: its tensors need {end} data bytes, the file holds {data_size}")
    return header


def _not_ours(path: Path, size: int, n: int) -> QuantLensError:
    with open(path, "rb") as handle:
        start = handle.read(64)
    if start.lstrip()[:1] in (b"{", b"["):
        kind = "a JSON/text file"
    elif all(32 <= b < 127 or b in (9, 10, 13) for b in start):
        kind = "a text file"
    else:
        kind = "not a safetensors file (or a truncated one)"
    return QuantLensError(
        f"Cannot load '{path}': {kind}; its first 8 bytes announce a {n}-byte header but the file has {size} bytes. "
        f"Expected a quantlens IR file written by quantlens.compiler.save (safetensors with a '{METADATA_KEY}' "
        f"header, magic '{MAGIC}')."
    )


def _read_constants(path: Path, header: dict) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    names = header.get("constants")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _damaged(path, "its header has no valid 'constants' list")
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            if keys != set(names):
                missing = sorted(set(names) - keys)[:5]
                extra = sorted(keys - set(names))[:5]
                raise _damaged(path, f"its tensors do not match its header (missing {missing}, unexpected {extra})")
            constants = {name: handle.get_tensor(name) for name in names}
    except QuantLensError:
        raise
    except Exception as exc:  # safetensors raises its own error types for broken files
        raise _damaged(path, f"its tensor data cannot be read ({type(exc).__name__}: {exc})") from exc
    digest = header.get("constants_sha256")
    if digest != _constants_digest(names, constants):
        raise _damaged(path, "the checksum of its constants does not match the header (the tensor data changed)")
    return constants


def _module_from_header(header: dict, constants: dict[str, torch.Tensor]) -> Module:
    values = {}
    for v in header["values"]:
        values[_str(v["name"])] = ValueInfo(
            tuple(int(d) for d in v["shape"]), _decode(v["dtype"]), _decode(v["qdtype"]), _decode(v["scale"]),
            _decode(v["axis"]),
        )
    nodes = []
    for n in header["nodes"]:
        attrs = _decode(n["attrs"])
        if not isinstance(attrs, dict):
            raise ValueError("node attrs must be an object")
        nodes.append(Node(_str(n["op"]), [_str(i) for i in n["inputs"]], [_str(o) for o in n["outputs"]], attrs,
                          _str(n["site"])))
    graph = Graph(nodes=nodes, inputs=[_str(i) for i in header["inputs"]],
                  outputs=[_str(o) for o in header["outputs"]], constants=constants, values=values)
    _check_graph(graph)
    leaves = [InputLeaf(_str(leaf["kind"]), leaf["name"], _decode(leaf["value"])) for leaf in header["input_leaves"]]
    meta = _decode(header["meta"])
    if not isinstance(meta, dict):
        raise ValueError("meta must be an object")
    return Module(_str(header["kind"]), graph, leaves, _str(header["input_spec"]), _str(header["output_spec"]),
                  meta=meta)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r:.60}")
    return value


def _check_graph(graph: Graph) -> None:
    """Every node input is defined before use and every output is defined."""
    defined = set(graph.inputs) | set(graph.constants)
    for node in graph.nodes:
        for name in node.inputs:
            if name and name not in defined:
                raise ValueError(f"node '{node.op}' (op site '{node.site}') reads undefined value {name!r}")
        defined.update(node.outputs)
    missing = [o for o in graph.outputs if o not in defined]
    if missing:
        raise ValueError(f"graph outputs {missing} are never computed")
