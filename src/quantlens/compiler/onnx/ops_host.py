"""Host ops in ONNX: an IR node that runs on the host (``attrs["host"]``) and that has no ONNX converter of its own
(a ``host_aten`` node: any aten op the march has no rule for), or that computes on complex values, is written by
torch's own ONNX exporter and spliced into the graph.

The node is run as a tiny torch module (its qat IR kernel, the same function the interpreter calls) on example
tensors of its inputs' shapes and dtypes, exported with ``torch.onnx.export(dynamo=True)`` at the graph's opset,
and its nodes and initializers are renamed into the builder. So coverage comes from torch's exporter, not from a
list of ops here. torch's exporter writes a complex tensor as its real view (a trailing dim of 2): every host
node reads and writes complex values that way, so a chain of them agrees. Needs ``onnxscript`` (the ``onnx``
extra).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from quantlens._registry import make_registry
from quantlens.compiler.ir import Node
from quantlens.compiler.kernels_qat import qat_dispatch
from quantlens.compiler.onnx.registry import onnx_converter
from quantlens.errors import QuantLensError

__all__ = ["writes_on_host", "host_node", "LIBRARY_TRANSLATIONS", "library_translations"]

_COMPLEX = ("complex64", "complex128")


def writes_on_host(b, node: Node, has_converter: bool) -> bool:
    """Whether ``node`` is written by torch's exporter: a host node with no converter, or any node on complex values
    (only the host computes them; torch's exporter writes them as real views, which an ONNX converter does not)."""
    if node.attrs.get("host") and not has_converter:
        return True
    return any(b.dtype(v) in _COMPLEX or _ir_dtype(b, v) in _COMPLEX for v in [*node.inputs, *node.outputs] if v)


def _ir_dtype(b, name: str) -> str | None:
    info = b.graph.values.get(name)
    return info.dtype if info is not None else None


class _OneNode(torch.nn.Module):
    """The node as a module: its qat IR kernel on the inputs (the interpreter's own function)."""

    def __init__(self, node: Node):
        super().__init__()
        self.node = node

    def forward(self, *inputs):
        out = qat_dispatch(self.node, list(inputs))
        return tuple(out) if isinstance(out, (list, tuple)) else out


def _example(b, name: str) -> torch.Tensor:
    """A tensor of the IR value's shape (the dynamic batch as 2) and dtype, of small non-zero values."""
    if name in b.graph.constants:
        return b.graph.constants[name]
    info = b.graph.values.get(name)
    if info is None or info.dtype == "unknown":
        raise QuantLensError(f"to_onnx: the shape of host op input '{name}' (op site '{b.site}') is unknown; export "
                             "the model again.")
    shape = [2 if d < 0 else d for d in info.shape]
    dtype = getattr(torch, info.dtype)
    if dtype.is_complex or dtype.is_floating_point:
        return (torch.arange(1, 1 + int(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape) / 7).to(dtype)
    if dtype is torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def _export(node: Node, examples: list[torch.Tensor], opset: int, site: str):
    """The node's ONNX model from torch's exporter: as it is, or else decomposed by torch's full decomposition
    table, whose prims reductions (cumprod's ``prims.prod``) :func:`_prims_translations` writes."""
    try:
        import onnxscript  # noqa: F401  (torch's dynamo exporter needs it)
    except ImportError as exc:
        raise QuantLensError(f"to_onnx: op site '{site}' runs on the host ({_what(node)}); writing it needs "
                             "torch's ONNX exporter and onnxscript: pip install 'quantlens[onnx]'.") from exc
    first: Exception | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attempt in (_as_is, _decomposed):
            try:
                return attempt(_drawn_by_onnx(node), examples, opset).model_proto
            except Exception as exc:  # noqa: BLE001 - torch's exporter raises many types; all mean "no ONNX form"
                first = first or exc
    raise QuantLensError(
        f"to_onnx: op site '{site}' runs on the host ({_what(node)}) and torch's ONNX exporter has no form for it "
        f"({type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}). The IR, the quantized IR "
        "and save/load keep it; for ONNX, compute it outside the model.") from first


def _drawn_by_onnx(node: Node) -> Node:
    """A random draw with a ``generator`` argument (``aten.randn.generator``, which torch's exporter has no form for)
    as the same draw without it: onnxruntime draws from its own generator either way."""
    target = node.attrs.get("target", "") if node.op == "host_aten" else ""
    if not target.endswith(".generator") or node.attrs.get("kwargs", {}).get("generator") is not None:
        return node
    kwargs = {k: v for k, v in node.attrs.get("kwargs", {}).items() if k != "generator"}
    return Node(node.op, node.inputs, node.outputs,
                {**node.attrs, "target": target.removesuffix(".generator") + ".default", "kwargs": kwargs}, node.site)


def _as_is(node: Node, examples: list, opset: int):
    return torch.onnx.export(_OneNode(node), tuple(examples), dynamo=True, opset_version=opset, verbose=False,
                             optimize=True, custom_translation_table={**_aten_translations(), **_library_translations(node)})


def _aten_translations() -> dict:
    """ONNX forms of the aten ops torch's exporter has none for, that real models run on the host."""
    from onnxscript import opset18 as onnx_op

    def histc(x, bins: int = 100, min: float = 0.0, max: float = 0.0):  # noqa: A002 (aten's argument names)
        """Counts of ``x`` in ``bins`` equal bins over ``[min, max]`` (the last bin holds ``max``; the data's own
        range where ``min == max``), values outside left out: torch's histc (a MoE layer's tokens per expert)."""
        flat = onnx_op.Reshape(onnx_op.Cast(x, to=1), onnx_op.Constant(value_ints=[-1]))
        lo, hi = ((onnx_op.ReduceMin(flat, keepdims=0), onnx_op.ReduceMax(flat, keepdims=0)) if min == max else
                  (onnx_op.Constant(value_float=float(min)), onnx_op.Constant(value_float=float(max))))
        width = onnx_op.Div(onnx_op.Sub(hi, lo), onnx_op.Constant(value_float=float(bins)))
        index = onnx_op.Min(onnx_op.Floor(onnx_op.Div(onnx_op.Sub(flat, lo), width)),
                            onnx_op.Constant(value_float=float(bins - 1)))
        index = onnx_op.Cast(onnx_op.Max(index, onnx_op.Constant(value_float=0.0)), to=7)
        inside = onnx_op.Cast(onnx_op.And(onnx_op.GreaterOrEqual(flat, lo), onnx_op.LessOrEqual(flat, hi)), to=1)
        one_hot = onnx_op.OneHot(index, onnx_op.Constant(value_ints=[bins]), onnx_op.Constant(value_floats=[0.0, 1.0]),
                                 axis=-1)
        counts = onnx_op.ReduceSum(onnx_op.Mul(one_hot, onnx_op.Unsqueeze(inside, onnx_op.Constant(value_ints=[-1]))),
                                   onnx_op.Constant(value_ints=[0]), keepdims=0)
        return onnx_op.CastLike(counts, x)

    return {torch.ops.aten.histc.default: histc}


#: an operator namespace -> a function giving that library's own ONNX translations of its custom operators (the
#: table its ONNX exporter passes to torch's), or ``{}`` when the library's version has none
LIBRARY_TRANSLATIONS, library_translations = make_registry("ONNX translations of operator namespace")


@library_translations("transformers")
def _transformers_translations() -> dict:
    try:
        from transformers.exporters import exporter_onnx
    except ImportError:
        return {}
    return dict(getattr(exporter_onnx, "_ONNX_TRANSLATION_TABLE", {}))


def _library_translations(node: Node) -> dict:
    target = node.attrs.get("target", "") if node.op == "host_aten" else ""
    namespace = target.partition("::")[0]
    return LIBRARY_TRANSLATIONS[namespace]() if namespace in LIBRARY_TRANSLATIONS else {}


def _decomposed(node: Node, examples: list, opset: int):
    from torch._decomp import decomposition_table

    program = torch.export.export(_OneNode(node), tuple(examples), strict=False)
    ops = {n.target for n in program.graph.nodes if n.op == "call_function"}
    program = program.run_decompositions({op: decomposition_table[op] for op in ops if op in decomposition_table})
    return torch.onnx.export(program, dynamo=True, opset_version=opset, verbose=False, optimize=True,
                             custom_translation_table=_prims_translations())


def _prims_translations() -> dict:
    """ONNX forms of the prims reductions torch's reference decompositions leave (``prims.prod`` and its kin)."""
    from onnxscript import opset18 as onnx_op

    def reduction(onnx_name: str):
        def translate(x, dims, output_dtype=None):
            return getattr(onnx_op, onnx_name)(x, onnx_op.Constant(value_ints=list(dims)), keepdims=0)

        return translate

    prims = torch.ops.prims
    return {prims.prod.default: reduction("ReduceProd"), prims.sum.default: reduction("ReduceSum"),
            prims.amax.default: reduction("ReduceMax"), prims.amin.default: reduction("ReduceMin")}


def _what(node: Node) -> str:
    return node.attrs.get("target", node.op) if node.op == "host_aten" else node.op


@onnx_converter("host_aten")
def host_node(b, node: Node) -> None:
    """Write one host node through torch's exporter and splice its graph in (see the module docstring)."""
    examples = [_example(b, v) for v in node.inputs]
    proto = _export(node, examples, b.opset, b.site)
    graph = proto.graph
    if any(op.domain not in ("", "ai.onnx") for op in proto.opset_import if op.version) and len(proto.functions):
        raise QuantLensError(f"to_onnx: torch's exporter wrote op site '{b.site}' with local functions; this host "
                             "op cannot be spliced. Compute it outside the model.")
    if len(graph.output) != len(node.outputs):
        raise QuantLensError(f"to_onnx: torch's exporter wrote {len(graph.output)} outputs for op site '{b.site}', "
                             f"which has {len(node.outputs)}; please report this.")
    rename = {inp.name: b.value(name) for inp, name in zip(graph.input, node.inputs)}
    for init in graph.initializer:
        new = b.fresh(f"{b.site}/{init.name}")
        rename[init.name] = new
        init.name = new
        b.initializers[new] = init
    produced = {o for n in graph.node for o in n.output}
    identities = []
    for out, name in zip(graph.output, node.outputs):
        if out.name in produced:
            rename[out.name] = name
        else:  # the exporter folded the output into an initializer, or passed an input through
            identities.append((rename[out.name], name))
    for onnx_node in graph.node:
        _splice(b, onnx_node, rename)
    for source, name in identities:
        b.nodes.append(b.helper.make_node("Identity", [source], [name], name=b.fresh(f"{b.site}/Identity")))
    for out, name in zip(graph.output, node.outputs):
        b.dtypes[name] = _elem_name(out.type.tensor_type.elem_type)
        b.ranks[name] = len(out.type.tensor_type.shape.dim)


def _splice(b, onnx_node: Any, rename: dict[str, str]) -> None:
    for i, name in enumerate(onnx_node.input):
        if name:
            onnx_node.input[i] = rename.get(name, name)
    for i, name in enumerate(onnx_node.output):
        if name not in rename:
            rename[name] = b.fresh(f"{b.site}/{name}")
        onnx_node.output[i] = rename[name]
    onnx_node.name = b.fresh(f"{b.site}/{onnx_node.op_type}")
    b.nodes.append(onnx_node)


def _elem_name(elem_type: int) -> str | None:
    from onnx import helper

    np_dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    return str(np_dtype) if np_dtype is not None else None
