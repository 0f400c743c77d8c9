"""The converter's state: the integer values met so far, the output graph, and the helpers every op family's
converter uses (the one registry ``CONVERTERS`` lives here too)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlens._registry import make_registry
from quantlens.compiler.ir import Graph, Module, Node, ValueInfo
from quantlens.compiler.kernels_int import storage_dtype
from quantlens.errors import QuantLensError
from quantlens.march import Qpp, QuantDType, rules
from quantlens.march.opset import IR_OPS, Category, ops_in

#: ops that move integer values without changing them (or their scale): the op set's movement ops.
PASSTHROUGH_OPS = set(ops_in(Category.MOVEMENT, level="qat"))


#: passthrough ops that keep every dimension in place (a per-channel int32 value may pass them).
DIM_PRESERVING = set(ops_in(Category.MOVEMENT, keeps_dims=True))


#: ops whose outputs after the first are indices (topk, sort, max_dim).
INDEX_OUTPUTS = set(ops_in(index_outputs=True))
#: the categories whose operands are numbers on a grid (an integer tensor there is a value without a scale)
_ARITHMETIC = frozenset({Category.GEMM, Category.ELEMENTWISE, Category.REDUCTION, Category.TABLE})


@dataclass
class QInfo:
    """An integer value: storage type and scale (per tensor, or per channel along ``axis``)."""

    name: str  # value name in the quantized IR
    qdtype: QuantDType
    scale: torch.Tensor  # float32, [] or [C]
    axis: int | None = None
    #: int8 codes in channel-exponent form (§3.1): a consumer reads them shifted onto their common grid
    exponents: bool = False

    def same_grid(self, qdtype: QuantDType, scale: torch.Tensor) -> bool:
        return self.qdtype is qdtype and self.scale.numel() == scale.numel() and bool(
            torch.equal(self.scale.reshape(-1), scale.reshape(-1).to(self.scale.dtype))
        )


def qpp_of(module: Module) -> Qpp:
    """The requantize precision profile convert uses for ``module`` (a qat IR): high precision where its meta says
    ``high_precision_qpp`` (consistency level 0), else the default one (``docs/march.md`` §8)."""
    return Qpp.HIGH_PRECISION if module.meta.get("high_precision_qpp", False) else Qpp.DEFAULT


def fq_dtype(attrs: dict, prefix: str = "") -> QuantDType:
    """The integer type of a fake quant's ``qmin``/``qmax`` attrs (``prefix`` ``"out_"``: a table op's output)."""
    return QuantDType.of_range(int(attrs[prefix + "qmin"]), int(attrs[prefix + "qmax"]))


class Converter:
    """One conversion of a qat IR into the quantized IR: the source graph, the graph being built and the grid
    (scale, integer type) of every converted value; the converters of ``CONVERTERS`` write into it."""

    def __init__(self, qat: Module, converters: dict | None = None):
        self.src = qat.graph
        #: qat IR op -> converter: the march's registry (``CONVERTERS`` for QL1)
        self.converters = CONVERTERS if converters is None else converters
        #: the requantize precision profile of every multiplier this conversion derives (§8)
        self.qpp = qpp_of(qat)
        self.out = Graph(nodes=[], inputs=list(qat.graph.inputs), outputs=[], constants={}, values={})
        self.producers = self.src.producers()
        self.consumers = self.src.consumers()
        self.q: dict[str, QInfo] = {}  # qat value -> integer value
        self.float_values: dict[str, str] = {}  # qat value -> float value of the quantized IR (inputs, outputs)
        #: scalar mul/div nodes folded into the preceding GEMM's requantize multiplier
        self.folded: set[str] = set()
        #: qat value -> the op site of the fake quant whose grid the integer op requantizes to (a BatchNorm or
        #: ReLU fused into a conv): the profiler attributes the integer value to that site ("output_site")
        self.grid_sites: dict[str, str] = {}
        #: qat value -> the channel axis of its per-channel (channel-exponent) output grid (add / sub, GEMMs)
        self.grid_axes: dict[str, int] = {}
        #: integer value -> its channel-exponent codes shifted onto the common grid (§3.1), made once
        self.shifted: dict[str, QInfo] = {}
        self.counter = 0
        for name in qat.graph.inputs:
            self.float_values[name] = name
            self.out.values[name] = qat.graph.values[name]

    # -- helpers ----------------------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}_q{self.counter}"

    def const(self, tensor: torch.Tensor, base: str) -> str:
        name = self.fresh(base)
        self.out.constants[name] = tensor
        self.out.values[name] = ValueInfo(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
        return name

    def is_const(self, name: str) -> bool:
        return name in self.src.constants

    def emit(self, node: Node, op: str, inputs: list[str], attrs: dict, qdtype: QuantDType | None,
             scale: torch.Tensor | None, axis: int | None = None, src_out: str | None = None) -> str:
        src_out = src_out or node.outputs[0]
        name = self.fresh(src_out)
        grid_site = self.grid_sites.get(src_out)
        if qdtype is not None and grid_site and grid_site != node.site:
            attrs = {**attrs, "output_site": grid_site}
        self.out.nodes.append(Node(op, inputs, [name], attrs, node.site))
        info = self.src.values.get(src_out, ValueInfo((), "unknown"))
        if qdtype is not None:
            scale_name = self.const(scale.to(torch.float32), f"{src_out}_scale")
            self.out.values[name] = ValueInfo(info.shape, storage_dtype(qdtype.value).__repr__().replace(
                "torch.", ""), qdtype.value, scale_name, axis)
            self.q[src_out] = QInfo(name, qdtype, scale.to(torch.float32), axis)
        else:
            self.out.values[name] = info
            self.float_values[src_out] = name
        return name

    def int_input(self, node: Node, value: str) -> QInfo:
        info = self.q.get(value)
        if info is None:
            raise QuantLensError(
                f"convert: op '{node.op}' at op site '{node.site}' takes '{value}', which is not quantized. Every "
                "input of a compute op must come from a fake quant in the qat IR; check that this op site has a "
                "qconfig (model_check_result.txt lists sites left float)."
            )
        return self.common_grid(info) if info.exponents else info

    def common_grid(self, info: QInfo) -> QInfo:
        """Channel-exponent codes (§3.1) shifted onto their common grid ``s · 2**-K`` (int16, per tensor): what
        every op that reads them takes; one ``channel_shift`` node per value, shared by its readers."""
        if info.name not in self.shifted:
            attrs, fine = rules.channel_shift(info.scale)
            attrs["axis"] = info.axis
            name = self.fresh(f"{info.name}_shifted")
            self.out.nodes.append(Node("channel_shift", [info.name], [name], attrs, ""))
            shape = self.out.values[info.name].shape
            scale = torch.tensor(fine, dtype=torch.float32)
            self.out.values[name] = ValueInfo(shape, "int16", QuantDType.qint16.value, self.const(scale, f"{name}_scale"))
            self.shifted[info.name] = QInfo(name, QuantDType.qint16, scale)
        return self.shifted[info.name]

    def output_grid(self, node: Node, fold_scalars: bool = False, channels: bool = False):
        """The fake quant that ends this compute op's output chain (through passthrough ops), if any.

        With ``fold_scalars`` (GEMMs), multiplications by positive scalar constants on the way are folded into
        the requantize multiplier; the result is then ``(dtype, scale, factor)``. A per-channel output scale
        (channel exponents, §3.1) is refused unless the caller's rule takes one (``channels``: add / sub, a GEMM's
        per-channel requantize; the axis is then ``grid_axes[output]``).
        """
        value = node.outputs[0]
        factor, folded = 1.0, []
        seen = 0
        while seen < 64:
            seen += 1
            users = self.consumers.get(value, [])
            if len(users) != 1 or value in self.src.outputs:
                return None
            user = users[0]
            if user.op == "fake_quant" and user.inputs[0] == value:
                grid = fq_dtype(user.attrs), self.src.constants[user.inputs[1]].to(torch.float32)
                if user.attrs.get("axis", -1) >= 0:
                    if not channels:
                        raise QuantLensError(
                            f"convert: op '{node.op}' at op site '{node.site}' has a per-channel output scale; the "
                            "march writes per-channel (channel-exponent, §3.1) activation scales at add / sub and GEMMs only.")
                    self.grid_axes[node.outputs[0]] = int(user.attrs["axis"])
                self.grid_sites[node.outputs[0]] = user.site
                if not fold_scalars:
                    return grid
                self.folded.update(folded)
                return (*grid, factor)
            k = scalar_constant(self, user.inputs[1]) if user.op in ("mul", "div") and len(user.inputs) == 2 else None
            if fold_scalars and k is not None and k > 0 and user.inputs[0] == value:
                factor *= k if user.op == "mul" else 1.0 / k
                folded.append(user.outputs[0])
                value = user.outputs[0]
                continue
            if user.op in PASSTHROUGH_OPS and user.inputs[0] == value and user.op not in INDEX_OUTPUTS:
                value = user.outputs[0]
                continue
            return None
        return None

    # -- driver -----------------------------------------------------------------------------------------------
    def run(self) -> Graph:
        for node in self.src.nodes:
            if self.is_host_op(node):
                self.host_op(node)
                continue
            if self.is_integer_math(node):  # index arithmetic (position ids: cumsum of a mask): exact as it is;
                # the quantized IR's kernel of an op is its integer rule on codes, so it runs with torch's semantics
                self.host_op(node)
                continue
            if self.reads_raw_integers(node):  # x * mask[..., None] with an int64 mask: the host computes it (the
                # qat IR's own float op on the dequantized x), and the output fake quant quantizes the result
                self.host_op(node)
                continue
            self._convert_or_host(node)
        for value in self.src.outputs:
            self.out.outputs.append(self.boundary_output(value))
        self._name_scales()
        return self.out

    def _convert_or_host(self, node: Node) -> None:
        """The op's integer form, or, where the march cannot express it (no converter, an input or output without
        a grid, a multiplier out of range, a table missing), the qat IR's own float op on the host on dequantized
        inputs (``attrs["host_reason"]`` says why): the partition of issue #41 (nothing is refused for lack of an
        integer rule), which the lowering applies to ATen ops and convert to the IR ops it cannot take."""
        converter = self.converters.get(node.op)
        if converter is None:
            self.host_op(node, f"the march has no integer form for op '{node.op}'")
            return
        mark = (len(self.out.nodes), len(self.out.constants), len(self.out.values), len(self.q),
                len(self.float_values), len(self.grid_sites), len(self.grid_axes), len(self.shifted),
                set(self.folded))
        try:
            converter(self, node)
        except QuantLensError as exc:  # the march's refusal of this op: undo what the converter emitted
            self._rollback(mark)
            self.host_op(node, str(exc).removeprefix("convert: "))

    def _rollback(self, mark: tuple) -> None:
        n_nodes, n_consts, n_values, n_q, n_float, n_grid, n_axes, n_shifted, folded = mark
        del self.out.nodes[n_nodes:]
        for table, n in ((self.out.constants, n_consts), (self.out.values, n_values), (self.q, n_q),
                         (self.float_values, n_float), (self.grid_sites, n_grid), (self.grid_axes, n_axes),
                         (self.shifted, n_shifted)):
            for key in list(table)[n:]:
                del table[key]
        self.folded = folded

    def _name_scales(self) -> None:
        """Every integer value names its scale constant (passthrough results share their input's), so a reader
        of the quantized IR (the profiler, a runtime) can dequantize any value."""
        by_scale: dict[int, str] = {}
        for info in self.q.values():
            value = self.out.values.get(info.name)
            if value is None or not value.qdtype:
                continue
            if value.scale is not None:
                by_scale.setdefault(id(info.scale), value.scale)
        for info in self.q.values():
            value = self.out.values.get(info.name)
            if value is None or not value.qdtype or value.scale is not None:
                continue
            if id(info.scale) not in by_scale:
                by_scale[id(info.scale)] = self.const(info.scale, f"{info.name}_scale")
            value.scale = by_scale[id(info.scale)]
            value.axis = info.axis

    def is_host_op(self, node: Node) -> bool:
        """Float post-processing after the boundary (all inputs are float values that left the NPU)."""
        data = [v for v in node.inputs if v and not self.is_const(v)]
        if node.attrs.get("host"):
            return True
        return (
            node.op != "fake_quant"
            and bool(data)
            and all(v in self.float_values and v not in self.src.inputs for v in data)
            and any(self.src.values[v].dtype.startswith(("float", "bfloat", "complex")) for v in data)
        )

    def reads_raw_integers(self, node: Node) -> bool:
        """An arithmetic op (GEMM, elementwise, reduction, table) reading an integer or bool tensor that is no
        quantized value: a mask or positions as a number. The march has no rule for integers that carry no scale."""
        op = IR_OPS.get(node.op)
        if op is None or op.category not in _ARITHMETIC:
            return False
        numbers = ("int", "uint") if op.reads_mask else ("int", "uint", "bool")  # a select's mask picks
        for v in node.inputs:
            if not v or v in self.q:
                continue
            if self.is_const(v):  # a constant mask (x * (i < n)[:, None, None]) is a bool, never a number
                if self.src.constants[v].dtype is torch.bool and not op.reads_mask:
                    return True
                continue
            info = self.src.values.get(v)
            if info is not None and info.dtype.startswith(numbers):
                return True
        return False

    def is_integer_math(self, node: Node) -> bool:
        """An op on integer / bool values only (no quantized value, no float) with integer / bool results."""
        data = [v for v in node.inputs if v]
        values = [self.src.values.get(v) for v in data + list(node.outputs)]
        return (node.op != "fake_quant" and bool(data)
                and all(v in self.float_values or self.is_const(v) for v in data)
                and all(info is not None and info.dtype not in ("unknown", "") and not info.dtype.startswith(
                    ("float", "bfloat")) for info in values))

    def host_op(self, node: Node, reason: str | None = None) -> None:
        """Kept as an op with the qat IR's semantics (``attrs["host"]``): float post-processing after the boundary,
        integer index math (exact wherever it runs), or an op the march cannot express (``reason``)."""
        ins = [index_input(self, node, v) for v in node.inputs]
        outs = [self.fresh(o) for o in node.outputs]
        attrs = {**node.attrs, "host": True, **({"host_reason": reason} if reason else {})}
        self.out.nodes.append(Node(node.op, ins, outs, attrs, node.site))
        for src_out, name in zip(node.outputs, outs):
            self.out.values[name] = self.src.values.get(src_out, ValueInfo((), "unknown"))
            self.float_values[src_out] = name

    def boundary_output(self, value: str, site: str = "output") -> str:
        """``value`` as a float value of the quantized IR: an integer value is dequantized, at op site ``site``
        ("output" for a model output; none for one a host op reads mid-graph, which a profiler's same-input run
        then recomputes from the baseline's value like other nodes of no site)."""
        if value in self.q:
            info = self.q[value]
            scale = self.const(info.scale, f"{value}_out_scale")
            name = self.fresh(f"{value}_float")
            self.out.nodes.append(Node("dequantize", [info.name, scale], [name], {"axis": info.axis}, site))
            self.out.values[name] = ValueInfo(self.src.values[value].shape, "float32")
            return name
        if value in self.float_values:
            return self.float_values[value]
        if value in self.src.constants:
            return self.const(self.src.constants[value], value)
        raise QuantLensError(f"convert: model output '{value}' was not produced by the converted graph.")


#: qat IR op -> its converter (``Converter, Node -> None``)
CONVERTERS, converter = make_registry("convert converter for op")


def required_grid(c: Converter, node: Node, channels: bool = False) -> tuple[QuantDType, torch.Tensor]:
    """The grid of ``node``'s output fake quant; refused, naming the op site, when it has none (``channels``: see
    :meth:`Converter.output_grid`)."""
    grid = c.output_grid(node, channels=channels)
    if grid is None:
        raise QuantLensError(
            f"convert: op '{node.op}' at op site '{node.site}' has no output fake quant; its integer result needs "
            "an output scale. Give the op site a qconfig with an int8/int16 output."
        )
    return grid


def scalar_constant(c: Converter, name: str) -> float | None:
    """The value of a one-element constant of the source graph, or ``None`` when ``name`` is none."""
    if name in c.src.constants and c.src.constants[name].numel() == 1:
        return float(c.src.constants[name])
    return None


def index_input(c: Converter, node: Node, value: str) -> str:
    """An index/mask input of a float data-movement node in the quantized IR: an integer value dequantized at
    the boundary, a float value, or a constant ("" stays absent)."""
    if not value:
        return ""
    if value in c.q:  # an integer value leaves the NPU here: the boundary dequantize
        return c.boundary_output(value, site="")
    if value in c.float_values:
        return c.float_values[value]
    if c.is_const(value):
        return c.const(c.src.constants[value], value)
    raise QuantLensError(f"convert: index input '{value}' of op site '{node.site}' is not available.")


def float_movement(c: Converter, node: Node) -> None:
    """Integer/bool tensors (token ids, masks, indices) move with the same kernels as in the qat IR."""
    ins = [index_input(c, node, v) for v in node.inputs]
    outs = [c.fresh(o) for o in node.outputs]
    c.out.nodes.append(Node(node.op, ins, outs, dict(node.attrs), node.site))
    for src_out, name in zip(node.outputs, outs):
        c.out.values[name] = c.src.values.get(src_out, ValueInfo((), "unknown"))
        c.float_values[src_out] = name


# -- pad, standalone batch norm, prelu / leaky_relu, constant writes (docs/march.md §10.2, §10.3, §11) ----------
def on_grid(value: float, info: QInfo) -> int:
    """A constant written into an integer tensor: ``sat(rhe(v / s))`` on that tensor's grid (§11)."""
    return rules.fill_code(value, info.scale, info.qdtype)


def require_per_tensor(c: Converter, node: Node, info: QInfo, what: str) -> None:
    """Refuse a per-channel (int32 high-precision) input where the op needs one scale for the tensor."""
    if info.scale.numel() != 1:
        raise QuantLensError(
            f"convert: {what} at op site '{node.site}' takes a per-channel int32 high-precision value; "
            "dequantize it first (put the DeQuantStub right after the final conv/linear) or give the producer an "
            "int8/int16 output."
        )
