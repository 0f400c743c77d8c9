"""The driver of ``to_onnx``: it runs the registered converters over the graph, completes the Q/DQ pairs of the
standard QDQ form, validates the model with ``onnx.checker`` and writes it atomically.

Converters live in one registry, ``ONNX_CONVERTERS``, keyed by IR op (:mod:`.registry`; the package imports every
op family module, which fills it); they write into the graph builder of :mod:`.builder`.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantlens._io import atomic_write_bytes
from quantlens.compiler.ir import Module
from quantlens.compiler.onnx.builder import Builder, onnx_dtype
from quantlens.compiler.onnx.ops_host import host_node, writes_on_host
from quantlens.compiler.onnx.registry import ONNX_CONVERTERS
from quantlens.compiler.provenance import ONNX_SOURCE_DIGEST_PROP, SOURCE_DIGEST_KEY, ir_digest
from quantlens.errors import QuantLensError
from quantlens.march import March

__all__ = ["to_onnx", "MIN_OPSET"]

#: the oldest opset ``to_onnx`` writes: int16 QuantizeLinear (21), Gelu (20), ReduceMax with axes input (18).
MIN_OPSET = 21


# -- QDQ completion --------------------------------------------------------------------------------------------------
#: ops that move quantized values without changing them; onnxruntime's QDQPropagationTransformer pushes Q/DQ
#: pairs through them. A Pad (which it does not) gets its pair too: a Conv after it then reads a DequantizeLinear,
#: which the runtime needs to fuse it (transformers' MobileNets pad before each conv); its fill value, quantized by
#: the pair, is the fill code the integer pad writes (0 for the usual zero padding).
_DATA_MOVEMENT = {"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Pad"}
#: in March.ORT_CPU's form also the other ops the runtime runs on codes between equal Q/DQ pairs (its own list), so
#: that a kernel after them reads a DequantizeLinear (a pooler's Gemm after the first token's Gather)
_RUNTIME_MOVEMENT = _DATA_MOVEMENT | {"Gather", "Flatten", "Expand", "Tile", "GatherElements", "Split"}


def _complete_qdq(b: Builder) -> None:
    """Give every data-movement op fed by a per-tensor DequantizeLinear (or feeding a per-tensor QuantizeLinear)
    its own Q/DQ pair on the same grid.

    The pair is an identity on values already on the grid (``fl32(q*s) / s`` rounds back to ``q``; max pooling and
    rounding commute), so the numbers do not change. It is the form onnxruntime's QDQ propagation would produce,
    written explicitly: onnxruntime (seen with 1.32, ``ORT_ENABLE_EXTENDED`` and above) propagates int8 Q/DQ pairs
    through these ops itself, and its S8->U8 pass then leaves the propagated QuantizeLinear inconsistent
    (``output_dtype INT8 does not match y_zero_point type UINT8``) and the session fails to load.
    """
    outputs = set(b.graph.outputs)
    nodes, producer = _requant_after_dequant(b, outputs)
    insert_before = _requant_before_quant(b, nodes, producer, outputs)
    result = []
    for node in nodes:
        result.extend(insert_before.get(id(node), []))
        result.append(node)
    b.nodes = result


def _is_scalar_init(b: Builder, name: str) -> bool:
    proto = b.initializers.get(name)
    return proto is not None and len(proto.dims) == 0


def _is_per_tensor(b: Builder, node) -> bool:
    """A QuantizeLinear / DequantizeLinear with a scalar scale and zero point (initializers)."""
    return (node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) == 3
            and _is_scalar_init(b, node.input[1]) and _is_scalar_init(b, node.input[2]))


def _qdq_pair(b: Builder, src: str, dst: str, q_node) -> list:
    """``src -> QuantizeLinear -> DequantizeLinear -> dst`` on the grid (scale, zero point) of ``q_node``."""
    mid = b.fresh(f"{dst}/requant")
    return [b.helper.make_node("QuantizeLinear", [src, q_node.input[1], q_node.input[2]], [mid],
                               name=b.fresh(f"{dst}/QuantizeLinear")),
            b.helper.make_node("DequantizeLinear", [mid, q_node.input[1], q_node.input[2]], [dst],
                               name=b.fresh(f"{dst}/DequantizeLinear"))]


def _requant_after_dequant(b: Builder, outputs: set[str]) -> tuple[list, dict]:
    """The forward pass: DQ -> op  ==>  DQ -> op -> Q -> DQ (unless the op already feeds QuantizeLinear nodes
    only). Returns the new node list and the producer of every value."""
    readers: dict[str, list] = {}
    for node in b.nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def quantized_next(name: str) -> bool:
        users = readers.get(name, [])
        return bool(users) and name not in outputs and all(u.op_type == "QuantizeLinear" for u in users)

    nodes, producer = [], {}
    movement = _RUNTIME_MOVEMENT if b.uint8_activations else _DATA_MOVEMENT
    for node in b.nodes:
        source = producer.get(node.input[0]) if node.input else None
        if node.op_type in movement and source is not None and source.op_type == "DequantizeLinear" \
                and _is_per_tensor(b, source) and not all(quantized_next(o) for o in node.output if o) \
                and (node.op_type in _DATA_MOVEMENT or source.input[0] not in b.initializers):  # (an activation's)
            nodes.append(node)
            for i, out in enumerate(list(node.output)):  # (a Split: every output)
                if not out or quantized_next(out):
                    producer[out] = node
                    continue
                pre = b.fresh(f"{out}/pre")
                node.output[i] = pre
                pair = _qdq_pair(b, pre, out, source)
                nodes.extend(pair)
                producer[pre] = node
                producer[out] = pair[1]
            continue
        nodes.append(node)
        for out in node.output:
            producer[out] = node
    return nodes, producer


def _requant_before_quant(b: Builder, nodes: list, producer: dict, outputs: set[str]) -> dict[int, list]:
    """The backward pass: x -> op -> Q  ==>  x -> Q -> DQ -> op -> Q, walking up chains of data-movement ops from
    every per-tensor QuantizeLinear. Returns the Q/DQ pairs to insert before each op (by ``id``); rewires the ops'
    inputs and updates ``producer``."""
    consumers: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    insert_before: dict[int, list] = {}
    for node in nodes:
        if node.op_type == "QuantizeLinear" and _is_per_tensor(b, node):
            _requant_chain(b, node, producer, consumers, outputs, insert_before)
    return insert_before


def _zero_point_is_uint8_zero(b: Builder, q_node) -> bool:
    proto = b.initializers.get(q_node.input[2]) if len(q_node.input) > 2 else None
    if proto is None:
        return False
    import onnx.numpy_helper

    zp = onnx.numpy_helper.to_array(proto)
    return zp.dtype.name == "uint8" and zp.size == 1 and int(zp.reshape(-1)[0]) == 0


def _requant_chain(b: Builder, q_node, producer: dict, consumers: dict[str, int], outputs: set[str],
                   insert_before: dict[int, list]) -> None:
    """Walk up from ``q_node`` through data-movement ops, each read once and writing no graph output, giving each
    a Q/DQ pair on its input; stops at a DequantizeLinear (the forward pass covered it) or a shared value."""
    current = producer.get(q_node.input[0])
    # in March.ORT_CPU's form the walk passes a ReLU before a uint8 quantize with zero point 0 (without a pair of its
    # own: the pairs further up clamp at 0, which is the ReLU), so a kernel before a Reshape -> ReLU (a rank-3
    # linear's) fuses with its requantize; a ReLU right after a kernel is left as it is (the runtime drops it)
    relu_passes = b.uint8_activations and _zero_point_is_uint8_zero(b, q_node)
    while relu_passes and current is not None and current.op_type == "Relu" and current.output[0] not in outputs \
            and consumers.get(current.output[0], 0) == 1 and producer.get(current.input[0]) is not None \
            and producer[current.input[0]].op_type in _DATA_MOVEMENT:
        current = producer[current.input[0]]
    while current is not None and current.op_type in _DATA_MOVEMENT and current.output[0] not in outputs:
        src = current.input[0]
        before = producer.get(src)
        if before is not None and before.op_type == "DequantizeLinear":
            break
        if consumers.get(src, 0) != 1 or src in outputs or consumers.get(current.output[0], 0) != 1:
            break
        new_src = b.fresh(f"{src}/requant_dq")
        pair = _qdq_pair(b, src, new_src, q_node)
        current.input[0] = new_src
        insert_before.setdefault(id(current), []).extend(pair)
        producer[new_src] = pair[1]
        current = before


# -- driver ----------------------------------------------------------------------------------------------------------
def _value_info(b: Builder, name: str, onnx_name: str, is_input: bool):
    info = b.graph.values.get(name)
    dtype = b.dtype(name)
    if dtype is None:
        raise QuantLensError(f"to_onnx: the dtype of graph {'input' if is_input else 'output'} '{name}' is unknown; "
                             "export the model again.")
    shape = b.shape(name) if info is not None or name in b.graph.constants else None
    dims = None
    if shape is not None:
        dims = [("batch" if i == 0 and is_input else None) if d < 0 else d for i, d in enumerate(shape)]
    return b.helper.make_tensor_value_info(onnx_name, onnx_dtype(dtype), dims)


def _build(module: Module, opset: int, standard_qdq: bool = False):
    import onnx

    b = Builder(module, opset, standard_qdq)
    graph = module.graph
    for node in graph.nodes:
        convert = ONNX_CONVERTERS.get(node.op)
        if writes_on_host(b, node, convert is not None):
            convert = host_node  # any op the host runs: torch's own exporter writes it (ops_host)
        if convert is None:
            raise QuantLensError(
                f"to_onnx: the IR op '{node.op}' (op site '{node.site or '<none>'}') has no ONNX mapping. Supported "
                f"ops: {', '.join(sorted(ONNX_CONVERTERS))}. Register a converter with "
                "quantlens.compiler.onnx.onnx_converter, or keep that computation outside the model."
            )
        b.site = node.site or node.op
        convert(b, node)
    b.site = "output"
    if standard_qdq:  # without DequantizeLinear nodes there is nothing for onnxruntime to propagate
        _complete_qdq(b)
    outputs = []
    used: set[str] = set()
    for name in graph.outputs:
        onnx_name, k = name, 0
        while onnx_name in used or (onnx_name != name and onnx_name in b.taken):
            k += 1
            onnx_name = f"{name}_{k}"
        used.add(onnx_name)
        b.taken.add(onnx_name)
        source = b.value(name)
        if onnx_name != name or name in graph.constants:
            b.reserved.add(onnx_name)
            b.add("Identity", [source], onnx_name, dtype=b.dtype(name))
        outputs.append(_value_info(b, name, onnx_name, is_input=False))
    inputs = [_value_info(b, name, name, is_input=True) for name in graph.inputs]
    onnx_graph = b.helper.make_graph(b.nodes, f"quantlens_{module.meta.get('source_model', 'model')}", inputs,
                                     outputs, initializer=list(b.initializers.values()))
    opset_id = b.helper.make_opsetid("", opset)
    model = b.helper.make_model(onnx_graph, opset_imports=[opset_id], producer_name="quantlens",
                                producer_version=_version(),
                                doc_string="qat IR exported by quantlens.compiler.to_onnx "
                                + ("(standard QDQ form)" if standard_qdq else "(Q -> Cast -> Mul form)"))
    model.ir_version = b.helper.find_min_ir_version_for([opset_id])
    # the digest of the qat IR written: the onnxruntime pair refuses this file with another qat IR
    props = {"quantlens.ir_kind": module.kind, "quantlens.onnx_form": "standard_qdq" if standard_qdq else "exact",
             **{f"quantlens.{k}": str(v) for k, v in module.meta.items() if k != SOURCE_DIGEST_KEY},
             ONNX_SOURCE_DIGEST_PROP: ir_digest(module)}
    b.helper.set_model_props(model, props)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # onnx raises ValidationError / InferenceError
        raise QuantLensError(f"to_onnx: the ONNX model fails onnx.checker ({type(exc).__name__}: {exc}). This is a "
                             "quantlens bug; please report it with the model.") from exc
    return model


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("quantlens")
    except Exception:  # noqa: BLE001
        return "0"


def to_onnx(qat_ir: Module, path: str | os.PathLike, opset: int = 21, *, standard_qdq: bool | None = None) -> Path:
    """Write the qat IR ``qat_ir`` as an ONNX model at ``path``; returns the path.

    Every activation fake quant is a ``QuantizeLinear`` (the rounding and the clamp); by default its codes are
    dequantized by ``Cast -> Mul(scale)``, and weights are int8/int16/int32 initializers dequantized the same way.
    onnxruntime at its default options then runs the float ops on the dequantized values, like the qat IR, on every
    CPU: no runtime fuses that form into integer kernels (onnxruntime's u8s8 kernels saturate on x86 CPUs without
    VNNI). ``standard_qdq=True`` writes ``DequantizeLinear`` instead (the standard QDQ form): opt-in for runtimes
    that should fuse Q/DQ groups into their int8 kernels, faster and not exact (``docs/ir.md`` gives the error).
    A qat IR of ``March.ORT_CPU`` is written in the standard QDQ form by default (``standard_qdq=None``): that march
    is onnxruntime's execution of exactly that form (``docs/march_ort.md``).

    Input names are the IR input names and output names the IR output names (a repeated output gets a suffix
    ``_1``, ``_2``...). Shapes are static, except a dynamic batch (``dynamic_batch=True`` at export), written as
    the symbolic dim ``batch`` on the inputs. The metadata ``quantlens.source_ir_digest`` records the qat IR's digest
    (:func:`quantlens.compiler.provenance.ir_digest`): the ``onnxruntime`` pair refuses the file with another qat
    IR. The model passes ``onnx.checker.check_model(full_check=True)``
    before it is written; the write is atomic. Needs ``pip install quantlens[onnx]``.
    """
    if not isinstance(qat_ir, Module):
        raise QuantLensError(f"to_onnx expects a quantlens.compiler.Module (the qat IR), got {type(qat_ir).__name__}.")
    if qat_ir.kind != "qat":
        raise QuantLensError(
            f"to_onnx exports the qat IR (float ops + fake quants, kind 'qat'); this module is the {qat_ir.kind!r} "
            "IR. Pass the module returned by quantlens.compiler.export (before convert) instead: ONNX's QDQ form "
            "expresses the fake quants, and runtimes choose their own integer kernels."
        )
    try:
        import onnx
    except ImportError as exc:
        raise QuantLensError("to_onnx needs the onnx package: pip install 'quantlens[onnx]'.") from exc
    max_opset = onnx.defs.onnx_opset_version()
    if type(opset) is not int or not MIN_OPSET <= opset <= max_opset:
        raise QuantLensError(f"to_onnx: opset {opset!r} is not supported; use an opset from {MIN_OPSET} (int16 "
                             f"QuantizeLinear, Gelu) to {max_opset} (the installed onnx).")
    if standard_qdq is None:
        standard_qdq = qat_ir.meta.get("march") == March.ORT_CPU.spec.name
    if type(standard_qdq) is not bool:
        raise QuantLensError(f"to_onnx: standard_qdq must be True, False or None, got {standard_qdq!r}.")
    model = _build(qat_ir, opset, standard_qdq)
    data = model.SerializeToString()
    return _atomic_write_bytes(Path(path), data)


def _atomic_write_bytes(path: Path, data: bytes) -> Path:
    if path.is_dir():
        raise QuantLensError(f"to_onnx: '{path}' is a folder; give a file path such as '{path / 'model.onnx'}'.")
    return atomic_write_bytes(path, data, fsync=True)
