"""``save``: write an IR module as one file, atomically (a temporary file in the target folder, fsync,
``os.replace``), with the header of :mod:`.schema` and its checksum."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from quantlens.compiler.ir import IR_VERSION, Graph, Module, ValueInfo
from quantlens.compiler.serialize.codec import encode_value
from quantlens.compiler.serialize.schema import (
    CHECKSUM_KEY,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    METADATA_KEY,
    file_checksum,
)
from quantlens.compiler.serialize.validate import InvalidHeader, module_from_header
from quantlens.errors import QuantLensError


def save(module: Module, path: str | os.PathLike) -> Path:
    """Write ``module`` (qat or quantized IR) to ``path`` as one file; returns the path.

    The write is atomic: the file appears complete or not at all, and a failed save (e.g. a non-tensor input
    leaf that is not JSON-serialisable) leaves no temporary file behind. Parent folders are created.
    """
    if not isinstance(module, Module):
        raise QuantLensError(f"save expects a quantlens.compiler.Module, got {type(module).__name__}.")
    from quantlens._io import atomic_write_bytes, safetensors_bytes

    path = Path(path)
    if path.is_dir():
        raise QuantLensError(f"save: '{path}' is a folder; give a file path such as '{path / 'model.qlir'}'.")
    constants = _tensors_for_file(module.graph)
    text = json.dumps(_header(module, constants), allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    _check_loadable(text, constants, path)
    metadata = {METADATA_KEY: text, CHECKSUM_KEY: file_checksum(text, constants)}
    atomic_write_bytes(path, safetensors_bytes(constants, metadata), fsync=True)  # the same module: the same bytes
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
        if tensor.is_complex():  # (a folded rotary table, torch.polar's): its real view, the header names the dtype
            tensor = torch.view_as_real(tensor.resolve_conj())
        if str(tensor.dtype).replace("torch.", "") not in DTYPES:
            raise QuantLensError(f"save: constant {name!r} has dtype {tensor.dtype}, which the IR file cannot "
                                 f"store; supported dtypes are {sorted(DTYPES)}.")
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
                       "value": encode_value(leaf.value, f"save: non-tensor input leaf #{i}")})
    values = []
    infos = dict(graph.values)
    for name, tensor in graph.constants.items():  # a complex constant's dtype lives in its value info
        if isinstance(tensor, torch.Tensor) and tensor.is_complex():
            infos[name] = ValueInfo(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
    for name, info in infos.items():
        values.append({
            "name": name,
            "shape": [int(d) for d in info.shape],
            "dtype": encode_value(info.dtype, f"save: dtype of value {name!r}"),
            "qdtype": encode_value(info.qdtype, f"save: qdtype of value {name!r}"),
            "scale": encode_value(info.scale, f"save: scale of value {name!r}"),
            "axis": encode_value(info.axis, f"save: axis of value {name!r}"),
        })
    nodes = []
    for node in graph.nodes:
        where = f"save: node '{node.op}' (op site '{node.site}')"
        nodes.append({
            "op": node.op,
            "inputs": list(node.inputs),
            "outputs": list(node.outputs),
            "attrs": encode_value(dict(node.attrs), f"{where} attrs"),
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
        "meta": encode_value(dict(module.meta), "save: module meta"),
        "writer": _writer(),
    }


def _writer() -> str:
    try:
        from importlib.metadata import version

        return f"quantlens {version('quantlens')}"
    except Exception:  # noqa: BLE001 - informational only
        return "quantlens"


def _check_loadable(text: str, constants: dict[str, torch.Tensor], path: Path) -> None:
    """Hold the header to the loader's own rules before anything is written: a file ``save`` writes always
    loads (else the failure would surface only when someone reads the file back)."""
    try:
        module_from_header(json.loads(text), constants)
    except InvalidHeader as exc:
        raise QuantLensError(
            f"save: '{path}' was not written: load would refuse this module ({exc}). The module was changed after "
            "export / convert into something the IR does not allow; export and convert it again (if it came "
            "straight from them, this is a quantlens bug: please report it with the model)."
        ) from None
