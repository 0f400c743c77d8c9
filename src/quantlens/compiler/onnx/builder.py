"""``Builder``: the ONNX graph that ``to_onnx``'s converters write into (the one job of this module).

It names values, turns IR constants into initializers, records each ONNX value's dtype and rank, adds nodes and
casts, and makes ``QuantLensError`` messages that name the op site. :mod:`.registry` holds the converters and
:mod:`.driver` the driver.
"""

from __future__ import annotations

from typing import Any

import torch

from quantlens.compiler.ir import Module, Node
from quantlens.errors import QuantLensError

__all__ = ["Builder"]


def onnx_dtype(dtype: str) -> int:
    """The ONNX ``TensorProto`` element type of a torch dtype name."""
    from onnx import TensorProto

    table = {
        "float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
        "float64": TensorProto.DOUBLE, "int8": TensorProto.INT8, "int16": TensorProto.INT16,
        "int32": TensorProto.INT32, "int64": TensorProto.INT64, "uint8": TensorProto.UINT8,
        "uint16": TensorProto.UINT16, "uint32": TensorProto.UINT32, "uint64": TensorProto.UINT64,
        "bool": TensorProto.BOOL,
    }
    if dtype not in table:
        raise QuantLensError(f"to_onnx: tensor dtype {dtype!r} has no ONNX equivalent here; supported: "
                             f"{sorted(table)}.")
    return table[dtype]


class Builder:
    def __init__(self, module: Module, opset: int, standard_qdq: bool = False):
        import onnx.helper

        self.helper = onnx.helper
        #: write dequantizations as DequantizeLinear (the standard QDQ form) rather than Cast + Mul (docs/ir.md)
        self.standard_qdq = standard_qdq
        #: March.ORT_CPU's QDQ form: an int8 activation is written as uint8 with zero point 128, as onnxruntime runs
        #: it on x86 (its own S8->U8 rewrite skips a QuantizeLinear read by several nodes, and a kernel then mixes
        #: int8 and uint8 and stays float); the values are the same
        self.uint8_activations = standard_qdq and module.meta.get("march") == "ort_cpu"
        self.module = module
        self.graph = module.graph
        self.opset = opset
        self.nodes: list = []
        self.initializers: dict[str, Any] = {}
        self.dtypes: dict[str, str | None] = {}
        self.ranks: dict[str, int | None] = {}
        for name, info in self.graph.values.items():
            self.dtypes[name] = info.dtype if info.dtype != "unknown" else None
            self.ranks[name] = len(info.shape) if info.dtype != "unknown" else None
        for name, tensor in self.graph.constants.items():
            self.dtypes[name] = str(tensor.dtype).replace("torch.", "")
            self.ranks[name] = tensor.dim()
        self.taken = set(self.graph.values) | set(self.graph.constants) | set(self.graph.inputs)
        for node in self.graph.nodes:
            self.taken.update(node.outputs)
        self.counter = 0
        self.const_alias: dict[str, str] = {}  # IR constant -> initializer name (when the IR name is an output)
        for out in self.graph.outputs:
            if out in self.graph.constants:
                self.const_alias[out] = self.fresh(f"{out}/const")
        self.site = ""
        self.ir_outputs = {o for node in self.graph.nodes for o in node.outputs}
        self.reserved: set[str] = set()
        self.casts: dict[tuple[str, str], str] = {}

    # -- names and values ---------------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        while True:
            self.counter += 1
            name = f"{base}/{self.counter}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def value(self, name: str) -> str:
        """ONNX name of an IR value; IR constants become initializers on first use."""
        if name in self.graph.constants:
            onnx_name = self.const_alias.get(name, name)
            if onnx_name not in self.initializers:
                self.initializers[onnx_name] = self.tensor_proto(self.graph.constants[name], onnx_name)
            return onnx_name
        return name

    def tensor_proto(self, tensor: torch.Tensor, name: str):
        t = tensor.detach().to("cpu")
        if t.is_complex():  # as torch's exporter writes complex values (ops_host): the real view, a trailing 2
            t = torch.view_as_real(t.resolve_conj())
        t = t.contiguous()
        dtype = str(t.dtype).replace("torch.", "")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return self.helper.make_tensor(name, onnx_dtype(dtype), list(t.shape), vals=raw, raw=True)

    def init(self, tensor: torch.Tensor, base: str) -> str:
        name = self.fresh(base)
        self.initializers[name] = self.tensor_proto(tensor, name)
        self.dtypes[name] = str(tensor.dtype).replace("torch.", "")
        self.ranks[name] = tensor.dim()
        return name

    def ints(self, values: list[int], base: str = "ints") -> str:
        return self.init(torch.tensor([int(v) for v in values], dtype=torch.int64), base)

    def scalar(self, value: Any, dtype: str, base: str = "scalar") -> str:
        return self.init(torch.tensor(value, dtype=getattr(torch, dtype)), base)

    def add(self, op_type: str, inputs: list[str], outputs: list[str] | str | None = None, *, dtype: str | None = None,
            rank: int | None = None, **attrs) -> Any:
        """Append an ONNX node and return its output name(s). ``outputs``: a list of exact names, an IR value name
        (or a reserved name) to produce, or a base from which a fresh name is made."""
        if isinstance(outputs, list):
            pass
        elif isinstance(outputs, str) and (outputs in self.ir_outputs or outputs in self.reserved):
            outputs = [outputs]
        else:
            outputs = [self.fresh(outputs or f"{self.site}/{op_type}")]
        node_name = self.fresh(f"{self.site or 'graph'}/{op_type}")
        self.nodes.append(self.helper.make_node(op_type, inputs, outputs, name=node_name, **attrs))
        for out in outputs:
            if dtype is not None or out not in self.dtypes:
                self.dtypes[out] = dtype
            if rank is not None or out not in self.ranks:
                self.ranks[out] = rank
        return outputs[0] if len(outputs) == 1 else outputs

    def dequantize(self, codes: str, scale: torch.Tensor, zero_point: str | None, axis: int, rank: int | None,
                   out: str, scale_name: str | None = None) -> str:
        """``codes * scale`` in float32: the dequantization of a fake quant's integer codes.

        The standard QDQ form writes ``DequantizeLinear``; the default form writes ``Cast(float32) -> Mul(scale)``,
        which computes the same float32 values bit for bit (one rounding of ``q * s``) but which no runtime fuses
        into an integer kernel: onnxruntime's default optimizations turn ``DequantizeLinear -> Conv/Gemm/MatMul``
        groups into u8s8 kernels that saturate their 16-bit intermediate sums on x86 CPUs without VNNI
        (docs/ir.md, "Why Cast + Mul"). ``scale`` is 0-D or 1-D (per ``axis``); ``scale_name`` reuses an existing
        initializer holding it for DequantizeLinear.
        """
        per_axis = axis >= 0 and scale.numel() > 1
        if self.standard_qdq:
            if scale_name is None:
                scale_name = self.init(scale.reshape(-1) if per_axis else scale.reshape(()), f"{out}/scale")
            inputs = [codes, scale_name] + ([zero_point] if zero_point is not None else [])
            attrs = {"axis": axis} if per_axis else {}
            return self.add("DequantizeLinear", inputs, out, dtype="float32", rank=rank, **attrs)
        if per_axis:
            if rank is None:
                raise QuantLensError(f"to_onnx: the rank of '{codes}' is unknown; export the model again.")
            shape = [1] * rank
            shape[axis] = -1
            broadcast = scale.reshape(shape)
        else:
            broadcast = scale.reshape(())
        real = self.add("Cast", [codes], f"{out}/codes_float", dtype="float32", rank=rank,
                        to=onnx_dtype("float32"))
        return self.add("Mul", [real, self.init(broadcast.to(torch.float32), f"{out}/scale")], out, dtype="float32",
                        rank=rank)

    def dtype(self, name: str) -> str | None:
        return self.dtypes.get(name)

    def rank(self, name: str) -> int | None:
        return self.ranks.get(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.graph.constants:
            return tuple(self.graph.constants[name].shape)
        info = self.graph.values.get(name)
        return None if info is None or info.dtype == "unknown" else tuple(info.shape)

    def cast(self, name: str, dtype: str | None) -> str:
        """``name`` cast to ``dtype`` when its dtype is known and differs (one Cast per value and dtype)."""
        have = self.dtype(name)
        if dtype is None or have is None or have == dtype:
            return name
        if (name, dtype) not in self.casts:
            self.casts[(name, dtype)] = self.add("Cast", [name], f"{name}/cast_{dtype}", dtype=dtype,
                                                 rank=self.rank(name), to=onnx_dtype(dtype))
        return self.casts[(name, dtype)]

    def out_dtype(self, node: Node, i: int = 0) -> str | None:
        return self.dtype(node.outputs[i])

    def error(self, node: Node, what: str, fix: str) -> QuantLensError:
        return QuantLensError(f"to_onnx: IR op '{node.op}' (op site '{node.site or '<none>'}'): {what}. {fix}")
