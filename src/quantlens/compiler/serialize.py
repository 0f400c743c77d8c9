"""Save and load an IR module (qat or quantized) as ONE versioned file.

The file is a `safetensors <https://github.com/huggingface/safetensors>`_ file:

* its tensors are the graph constants, keyed by constant name, in their own dtype (float, int8/16/32/64, bool...);
* its metadata (``str -> str``) holds two keys: ``"quantlens"``, whose value is a JSON header (magic
  ``"quantlens-ir"``, ``format_version``, ``ir_version``, the module kind, nodes, inputs/outputs, value types,
  input leaves, the input/output pytree specs, meta), and ``"quantlens_sha256"``, a SHA-256 over the header text
  and every constant's name, dtype, shape and bytes: one checksum for the whole model.

JSON cannot hold every Python value the IR uses, so the header encodes them explicitly (strict JSON, no NaN
literals): a non-finite float is ``{"$float": "nan" | "inf" | "-inf"}``, a tuple is ``{"$tuple": [...]}``, and a
dict whose keys are not all plain strings (or start with ``$``) is ``{"$dict": [[key, value], ...]}``. The layout
and the error cases are documented in ``docs/ir.md``.

Writes are atomic (a temporary file in the target folder, fsync, ``os.replace``): a failed ``save`` leaves the
folder as it was. ``load`` raises ``QuantLensError`` naming the file, what is wrong and what was expected for a
damaged, truncated, foreign, older or newer file: it checks the checksum, then validates the header (known
ops of the module's kind, attr types and ranges, value types, every referenced name defined before use), and
refuses anything that is not a regular file (a FIFO, a device) without opening it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import torch

from quantlens.compiler.ir import IR_VERSION, Graph, InputLeaf, Module, Node, ValueInfo
from quantlens._io import atomic_write
from quantlens.errors import QuantLensError
from quantlens.march.opset import IR_OPS

__all__ = ["save", "load", "FORMAT_VERSION", "MAGIC", "METADATA_KEY", "CHECKSUM_KEY"]

MAGIC = "quantlens-ir"
#: version of the file layout (header fields and their encoding); bumped on any incompatible change.
#: 2: the checksum (metadata key ``CHECKSUM_KEY``) covers the header text as well as the constants.
FORMAT_VERSION = 2
#: the safetensors metadata key that holds the JSON header.
METADATA_KEY = "quantlens"
#: the safetensors metadata key that holds the SHA-256 of the header text and the constants.
CHECKSUM_KEY = "quantlens_sha256"

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


_MAX_DEPTH = 64  # nesting of attrs, meta and input leaf values (save writes a few levels)


def _decode(value: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"a value is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, list):
        return [_decode(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, body), = value.items()
            if tag == "$float":
                if body not in ("nan", "inf", "-inf"):
                    raise ValueError(f"bad $float value {body!r}")
                return float(body)
            if tag == "$tuple":
                return tuple(_decode(v, depth + 1) for v in _as_list(body, "$tuple"))
            if tag == "$dict":
                pairs = _as_list(body, "$dict")
                if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                    raise ValueError("$dict must hold [key, value] pairs")
                return {_hashable(_decode(k, depth + 1)): _decode(v, depth + 1) for k, v in pairs}
        if any(k.startswith("$") for k in value):
            raise ValueError(f"unknown tagged value {sorted(value)!r}")
        return {k: _decode(v, depth + 1) for k, v in value.items()}
    if type(value) is float and not math.isfinite(value):
        raise ValueError("a non-finite float must be tagged {\"$float\": ...}")
    return value


def _as_list(body: Any, tag: str) -> list:
    if not isinstance(body, list):
        raise ValueError(f"{tag} must hold a list")
    return body


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, tuple)):
        return tuple(_hashable(k) for k in key)
    if isinstance(key, dict):
        raise ValueError("a $dict key cannot be an object")
    return key


# -- header -------------------------------------------------------------------------------------------------
def _file_checksum(text: str, constants: dict[str, torch.Tensor]) -> str:
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
    metadata = {METADATA_KEY: text, CHECKSUM_KEY: _file_checksum(text, constants)}
    atomic_write(path, lambda tmp: save_file(constants, tmp, metadata=metadata), fsync=True)
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

    Raises ``QuantLensError`` naming the file, and nothing else, when it is missing, not a regular file (a FIFO,
    a device), truncated or otherwise damaged (the checksum over header and constants does not match, or the
    header does not describe a valid graph), not a quantlens IR file, or written in another format version.
    """
    path = Path(path)
    try:
        return _load(path)
    except QuantLensError:
        raise
    except OSError as exc:
        raise QuantLensError(f"Cannot load '{path}': it cannot be read ({exc.strerror or exc}).") from exc
    except Exception as exc:  # noqa: BLE001 - load raises QuantLensError only, whatever the file holds
        raise _damaged(path, f"it cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _load(path: Path) -> Module:
    header, text = _read_header(path)
    constants = _read_constants(path, text)
    try:
        return _module_from_header(header, constants)
    except (_Invalid, QuantLensError) as exc:
        raise _damaged(path, f"its header is invalid: {exc}") from exc


def _damaged(path: Path, what: str) -> QuantLensError:
    return QuantLensError(
        f"Cannot load '{path}': {what}. Expected a quantlens IR file written by quantlens.compiler.save "
        f"(a safetensors file with a '{METADATA_KEY}' metadata header, magic '{MAGIC}', format version "
        f"{FORMAT_VERSION}). The file may be damaged or incomplete; save the module again."
    )


_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _check_regular(path: Path, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise QuantLensError(f"Cannot load '{path}': it is a folder, expected a quantlens IR file.")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise QuantLensError(
            f"Cannot load '{path}': it is {kind}, expected a regular quantlens IR file written by "
            "quantlens.compiler.save. load reads regular files only (it never waits on a pipe or a device)."
        )


def _read_header(path: Path) -> tuple[dict, str]:
    """The quantlens header (checked for magic and versions) and its text, as the file holds it."""
    try:
        info = os.stat(path)  # the file type first: opening a FIFO would block
    except FileNotFoundError:
        raise QuantLensError(f"Cannot load '{path}': no such file.") from None
    _check_regular(path, info.st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())  # the file opened may not be the file stat'ed
        _check_regular(path, info.st_mode)
        size = info.st_size
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
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _damaged(path, f"its safetensors header is not valid JSON ({exc})") from exc
    metadata = st_header.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise QuantLensError(
            f"Cannot load '{path}': it is a safetensors file without a quantlens IR header (no '{METADATA_KEY}' "
            "entry in its metadata), e.g. a plain weights file. Expected a file written by "
            "quantlens.compiler.save; load weights with safetensors instead."
        )
    text = metadata[METADATA_KEY]
    try:
        if not isinstance(text, str):
            raise ValueError("not a string")
        header = json.loads(text, parse_constant=_no_constant)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as exc:
        raise _damaged(path, f"its '{METADATA_KEY}' header is not valid JSON ({exc})") from exc
    magic = header.get("magic")
    if magic != MAGIC:
        raise QuantLensError(
            f"Cannot load '{path}': its header magic is {str(magic)[:80]!r}, expected {MAGIC!r}. The file was not "
            "written by quantlens.compiler.save."
        )
    version = header.get("format_version")
    if type(version) is not int or version < 1:
        raise _damaged(path, f"its format_version is {str(version)[:80]!r}, expected an integer >= 1")
    if version > FORMAT_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it was written in IR file format version {version}, and this quantlens reads "
            f"version {FORMAT_VERSION}. Upgrade quantlens, or save the module again with this version."
        )
    if version < FORMAT_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it was written in IR file format version {version} by an older quantlens, and "
            f"this quantlens reads version {FORMAT_VERSION} only (since version 2 one checksum covers the header "
            "as well as the constants, so a damaged header cannot load as another model). Export and save the "
            "model again with this quantlens."
        )
    ir_version = header.get("ir_version")
    if type(ir_version) is not int or ir_version < 1:
        raise _damaged(path, f"its ir_version is {str(ir_version)[:80]!r}, expected an integer >= 1")
    if ir_version > IR_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it holds IR version {ir_version}, and this quantlens knows IR versions up to "
            f"{IR_VERSION}. Upgrade quantlens, or export and save the model again with this version."
        )
    if not isinstance(metadata.get(CHECKSUM_KEY), str):
        raise _damaged(path, f"its metadata has no '{CHECKSUM_KEY}' checksum")
    extra = sorted(set(metadata) - {METADATA_KEY, CHECKSUM_KEY})
    if extra:  # save writes these two entries only; the checksum cannot vouch for others
        raise _damaged(path, f"its metadata has entries save does not write: {[str(k)[:40] for k in extra[:5]]}")
    # Tensor entries must lie inside the file: catches truncation before safetensors maps the file.
    data_size = size - 8 - n
    end = 0
    for key, entry in st_header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _damaged(path, f"tensor entry {str(key)[:80]!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if end > data_size:
        raise _damaged(path, f"it is truncated: its tensors need {end} data bytes, the file holds {data_size}")
    return header, text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not strict JSON")


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


def _read_constants(path: Path, text: str) -> dict[str, torch.Tensor]:
    """Every tensor of the file, once the checksum over the header text and the tensors matches."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            constants = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for broken files
        raise _damaged(path, f"its tensor data cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from exc
    if metadata.get(METADATA_KEY) != text:  # safetensors and json read the safetensors header differently
        raise _damaged(path, "its safetensors header is ambiguous (safetensors reads another quantlens header)")
    if metadata.get(CHECKSUM_KEY) != _file_checksum(text, constants):
        raise _damaged(path, "its checksum does not match its contents (the header or the tensor data changed)")
    return constants


# -- header validation ------------------------------------------------------------------------------------------
class _Invalid(ValueError):
    """A header that passed the checksum but does not describe a valid module."""


_HEADER_FIELDS = frozenset({"magic", "format_version", "ir_version", "kind", "inputs", "outputs", "constants",
                            "values", "nodes", "input_leaves", "input_spec", "output_spec", "meta", "writer"})
_NODE_FIELDS = frozenset({"op", "inputs", "outputs", "attrs", "site"})
_VALUE_FIELDS = frozenset({"name", "shape", "dtype", "qdtype", "scale", "axis"})
_LEAF_FIELDS = frozenset({"kind", "name", "value"})
_QDTYPES = ("qint8", "qint16", "qint32")
#: the IR op levels each module kind may hold (``quantlens.march.opset``); any op may run on the host (``host: true``)
_LEVELS = {"qat": ("qat", "both"), "quantized": ("quantized", "both")}
_MAX_SHIFT = 63  # a right shift of an int64 product; the march allows [0, MarchSpec.max_requant_shift]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fields(obj: Any, fields: frozenset, where: str) -> dict:
    if not isinstance(obj, dict):
        raise _Invalid(f"{where} is {_short(obj)}, expected an object with fields {sorted(fields)}")
    missing, extra = sorted(fields - set(obj)), sorted(set(obj) - fields)
    if missing:
        raise _Invalid(f"{where} lacks the fields {missing}")
    if extra:
        raise _Invalid(f"{where} has unknown fields {[_short(k) for k in extra[:5]]}")
    return obj


def _names(value: Any, where: str, unique: bool = True, allow_empty: bool = False) -> list[str]:
    if not isinstance(value, list):
        raise _Invalid(f"{where} is {_short(value)}, expected a list of names")
    for name in value:
        if not isinstance(name, str) or (not name and not allow_empty):
            raise _Invalid(f"{where} holds {_short(name)}, expected a {'' if allow_empty else 'non-empty '}string")
    if unique:
        seen = set()
        for name in value:
            if name in seen:
                raise _Invalid(f"{where} names {name!r} twice")
            seen.add(name)
    return list(value)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _ints(lo: int | None = None, hi: int | None = None, nonempty: bool = False, scalar: bool = False,
          none: bool = False, text: bool = False):
    """A rule: a list of ints in [lo, hi] (or one int with ``scalar``, None with ``none``, a string with ``text``)."""
    def in_range(v):
        return _is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi)

    bounds = f" in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]" if (
        lo is not None or hi is not None) else ""
    what = ("a non-empty " if nonempty else "a ") + f"list of ints{bounds}" + (" or an int" if scalar else "") + (
        " or a string" if text else "") + (" or null" if none else "")

    def rule(v):
        if (none and v is None) or (scalar and in_range(v)) or (text and isinstance(v, str)):
            return None
        if isinstance(v, list) and all(in_range(x) for x in v) and (v or not nonempty):
            return None
        return what
    return rule


def _one_int(lo: int | None = None, none: bool = False):
    def rule(v):
        if (none and v is None) or (_is_int(v) and (lo is None or v >= lo)):
            return None
        return (f"an int >= {lo}" if lo is not None else "an int") + (" or null" if none else "")
    return rule


def _boolean(v):
    return None if type(v) is bool else "true or false"


def _string(v):
    return None if isinstance(v, str) else "a string"


def _qdtype_rule(v):
    return None if v in _QDTYPES else f"one of {list(_QDTYPES)}"


def _dtype_rule(v):
    return None if isinstance(v, str) and v in _DTYPES else f"a dtype name, one of {sorted(_DTYPES)}"


_INT32_MULTIPLIER = _ints(0, 2**31 - 1, nonempty=True, none=True)
_SHIFT = _ints(0, _MAX_SHIFT, nonempty=True, none=True)
#: attr name -> rule (None when the value is fine, else what was expected); ``(op, attr)`` keys take precedence.
#: Attrs not named here are any JSON value (kernels ignore attrs they do not know).
_ATTR_RULES: dict[Any, Any] = {
    "multiplier": _INT32_MULTIPLIER, "multipliers": _INT32_MULTIPLIER, "neg_multiplier": _INT32_MULTIPLIER,
    "shift": _SHIFT, "shifts": _SHIFT,
    "out_dtype": _qdtype_rule,
    "dim": _ints(scalar=True, none=True), "dims": _ints(), "axis": _one_int(none=True),
    "channel_dim": _one_int(none=True), "index": _one_int(), "k": _one_int(0), "groups": _one_int(1),
    "stride": _ints(scalar=True), "padding": _ints(scalar=True, text=True), "dilation": _ints(scalar=True),
    "kernel_size": _ints(scalar=True), "output_padding": _ints(scalar=True),
    "output_size": _ints(scalar=True, none=True), "shape": _ints(-1), "sizes": _ints(0),
    "start": _one_int(none=True), "end": _one_int(none=True), "step": _one_int(1, none=True),
    "divisor_override": _one_int(1, none=True), "exp_frac_bits": _one_int(0), "normalized_ndim": _one_int(0),
    **{name: _boolean for name in ("keepdim", "ceil_mode", "count_include_pad", "largest", "sorted", "negative",
                                   "negate", "host", "align_corners", "descending", "is_causal")},
    **{name: _one_int() for name in ("qmin", "qmax", "in_qmin", "in_qmax", "out_qmin", "out_qmax")},
    "output_site": _string, "mode": _string,
    "table_inputs": lambda v: None if isinstance(v, list) and all(isinstance(x, str) for x in v) else
    "a list of strings",
    ("cast", "dtype"): _dtype_rule,
    # F of the add rule (docs/march.md §10); absent in files of spec v4, whose kernels read it as 8
    **{(op, "frac_bits"): _one_int(0) for op in ("add", "sub", "add_const")},
}
_PAIRS = (("multiplier", "shift"), ("multipliers", "shifts"))
_RANGES = (("qmin", "qmax"), ("in_qmin", "in_qmax"), ("out_qmin", "out_qmax"))


def _check_attrs(op: str, attrs: dict, where: str) -> None:
    for key, value in attrs.items():
        if not isinstance(key, str):
            raise _Invalid(f"{where}: attr name {_short(key)} is not a string")
        rule = _ATTR_RULES.get((op, key), _ATTR_RULES.get(key))
        problem = rule(value) if rule is not None else None
        if problem:
            raise _Invalid(f"{where}: attr {key!r} is {_short(value)}, expected {problem}")
    for mult, shift in _PAIRS:
        m, s = attrs.get(mult), attrs.get(shift)
        if (m is None) != (s is None) or (m is not None and len(m) != len(s)):
            raise _Invalid(f"{where}: attrs {mult!r} ({_short(m)}) and {shift!r} ({_short(s)}) must both be given, "
                           "with one shift per multiplier")
    for lo, hi in _RANGES:
        if lo in attrs and hi in attrs and attrs[lo] > attrs[hi]:
            raise _Invalid(f"{where}: attr {lo!r} ({attrs[lo]}) exceeds {hi!r} ({attrs[hi]})")


def _module_from_header(header: dict, constants: dict[str, torch.Tensor]) -> Module:
    """The module the (checksum-verified) header describes, once every field is valid; raises ``_Invalid``."""
    _fields(header, _HEADER_FIELDS, "the header")
    kind = header["kind"]
    if kind not in _LEVELS:
        raise _Invalid(f"its kind is {_short(kind)}, expected 'qat' or 'quantized'")
    if not isinstance(header["writer"], str):
        raise _Invalid(f"its writer is {_short(header['writer'])}, expected a string")
    names = _names(header["constants"], "'constants'")
    if set(names) != set(constants):
        missing = sorted(set(names) - set(constants))[:5]
        extra = sorted(set(constants) - set(names))[:5]
        raise _Invalid(f"its tensors do not match its 'constants' list (missing {missing}, unexpected {extra})")
    constants = {name: constants[name] for name in names}  # graph order
    inputs = _names(header["inputs"], "'inputs'")
    outputs = _names(header["outputs"], "'outputs'", unique=False)
    clash = sorted(set(inputs) & set(constants))
    if clash:
        raise _Invalid(f"graph inputs {clash[:5]} are also constants")

    defined = set(inputs) | set(constants)
    if not isinstance(header["nodes"], list):
        raise _Invalid("'nodes' is not a list")
    nodes = []
    allowed = _LEVELS[kind]
    for i, n in enumerate(header["nodes"]):
        _fields(n, _NODE_FIELDS, f"node #{i}")
        op, site = n["op"], n["site"]
        if not isinstance(op, str) or not isinstance(site, str):
            raise _Invalid(f"node #{i}: op {_short(op)} and site {_short(site)} must be strings")
        where = f"node #{i} '{op}' (op site '{site}')"
        node_inputs = _names(n["inputs"], f"{where} inputs", unique=False, allow_empty=True)
        node_outputs = _names(n["outputs"], f"{where} outputs")
        if not node_outputs:
            raise _Invalid(f"{where} has no outputs")
        if not isinstance(n["attrs"], dict):
            raise _Invalid(f"{where}: attrs are {_short(n['attrs'])}, expected an object")
        try:
            attrs = _decode(n["attrs"])
        except ValueError as exc:
            raise _Invalid(f"{where}: attrs cannot be decoded ({exc})") from None
        if not isinstance(attrs, dict):
            raise _Invalid(f"{where}: attrs are not an object")
        _check_attrs(op, attrs, where)
        spec = IR_OPS.get(op)
        if spec is None:
            raise _Invalid(f"{where}: '{op}' is not an IR op of quantlens.march.opset (docs/ops.md lists them)")
        if spec.level not in allowed and attrs.get("host") is not True:
            raise _Invalid(f"{where}: '{op}' is a {spec.level}-level op, which a {kind} IR does not hold "
                           "(except on the host, attr host: true)")
        for name in node_inputs:
            if name and name not in defined:
                raise _Invalid(f"{where} reads undefined value {name!r} (values are defined before use)")
        for name in node_outputs:
            if name in defined:
                raise _Invalid(f"{where} writes {name!r}, which is already defined (each value is written once)")
        defined.update(node_outputs)
        nodes.append(Node(op, node_inputs, node_outputs, attrs, site))
    missing = [o for o in outputs if o not in defined]
    if missing:
        raise _Invalid(f"graph outputs {missing[:5]} are never computed")

    if not isinstance(header["values"], list):
        raise _Invalid("'values' is not a list")
    values: dict[str, ValueInfo] = {}
    for i, v in enumerate(header["values"]):
        _fields(v, _VALUE_FIELDS, f"value info #{i}")
        name = v["name"]
        where = f"value info #{i} ({_short(name)})"
        if not isinstance(name, str) or name not in defined:
            raise _Invalid(f"{where} names no value of the graph")
        if name in values:
            raise _Invalid(f"{where} is given twice")
        shape, dtype, qdtype, scale, axis = v["shape"], v["dtype"], v["qdtype"], v["scale"], v["axis"]
        if _ints(-1)(shape):
            raise _Invalid(f"{where}: shape {_short(shape)} is not a list of ints >= -1")
        if _dtype_rule(dtype):
            raise _Invalid(f"{where}: dtype {_short(dtype)} is not {_dtype_rule(dtype)}")
        if qdtype is not None and qdtype not in _QDTYPES:
            raise _Invalid(f"{where}: qdtype {_short(qdtype)} is not null or one of {list(_QDTYPES)}")
        if scale is not None and (not isinstance(scale, str) or scale not in constants):
            raise _Invalid(f"{where}: scale {_short(scale)} is not null or the name of a constant")
        if axis is not None and not _is_int(axis):
            raise _Invalid(f"{where}: axis {_short(axis)} is not null or an int")
        if name in constants:
            t = constants[name]
            if list(t.shape) != shape or str(t.dtype).replace("torch.", "") != dtype:
                raise _Invalid(f"{where}: shape {shape} and dtype {dtype} differ from the constant's "
                               f"({list(t.shape)}, {str(t.dtype).replace('torch.', '')})")
        values[name] = ValueInfo(tuple(shape), dtype, qdtype, scale, axis)

    if not isinstance(header["input_leaves"], list):
        raise _Invalid("'input_leaves' is not a list")
    leaves = []
    fed: set[str] = set()
    for i, leaf in enumerate(header["input_leaves"]):
        _fields(leaf, _LEAF_FIELDS, f"input leaf #{i}")
        if leaf["kind"] == "tensor":
            name = leaf["name"]
            if not isinstance(name, str) or name not in inputs or name in fed or leaf["value"] is not None:
                raise _Invalid(f"input leaf #{i} is a tensor leaf named {_short(name)}, expected a graph input "
                               "named once, with value null")
            fed.add(name)
            leaves.append(InputLeaf("tensor", name))
        elif leaf["kind"] == "const":
            if leaf["name"] is not None:
                raise _Invalid(f"input leaf #{i} is a const leaf with a name ({_short(leaf['name'])})")
            try:
                leaves.append(InputLeaf("const", None, _decode(leaf["value"])))
            except ValueError as exc:
                raise _Invalid(f"input leaf #{i}: its value cannot be decoded ({exc})") from None
        else:
            raise _Invalid(f"input leaf #{i} has kind {_short(leaf['kind'])}, expected 'tensor' or 'const'")
    if fed != set(inputs):
        raise _Invalid(f"graph inputs {sorted(set(inputs) - fed)[:5]} are no leaf of the input structure")
    _check_spec(header["input_spec"], len(leaves), "input_spec", "input leaves")
    _check_spec(header["output_spec"], len(outputs), "output_spec", "graph outputs")
    try:
        meta = _decode(header["meta"])
    except ValueError as exc:
        raise _Invalid(f"its meta cannot be decoded ({exc})") from None
    if not isinstance(meta, dict):
        raise _Invalid("its meta is not an object")
    graph = Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, values=values)
    return Module(kind, graph, leaves, header["input_spec"], header["output_spec"], meta=meta)


def _check_spec(spec: Any, leaves: int, field: str, what: str) -> None:
    from torch.utils import _pytree as pytree

    if not isinstance(spec, str):
        raise _Invalid(f"its {field} is {_short(spec)}, expected a pytree spec string")
    try:
        tree = pytree.treespec_loads(spec)
        count = tree.num_leaves
    except Exception as exc:  # noqa: BLE001 - torch raises assorted errors for a broken spec
        raise _Invalid(f"its {field} is not a pytree spec ({type(exc).__name__}: {str(exc)[:100]})") from None
    if count != leaves:
        raise _Invalid(f"its {field} has {count} leaves, and the file has {leaves} {what}")
