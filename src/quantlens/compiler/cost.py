"""A latency estimate of a quantized IR on the march's cost model (``docs/march.md`` §15).

``estimate_latency(module, batch)`` walks the quantized IR once and charges every node the cycles of the unit
that runs it, from the numbers of :class:`quantlens.march.CostModel` (the march's data):

* GEMMs (conv, transposed conv, linear, matmul, bilinear resize): ``ceil(MACs / macs_per_cycle)``, the int8 x int8
  rate, or the int16 one when an operand is int16; plus the requantize of the output;
* a requantize of ``n`` elements: ``ceil(n · passes / vector_lanes)`` where ``passes`` is 0 for a multiplier of
  exactly 1 (``M == 2**shift``), ``requant_passes_shift`` for a power of two (a rounding shift),
  ``requant_passes_default`` for a multiplier of at most 16 bits and ``requant_passes_high_precision`` above;
  a per-channel requantize costs its most expensive channel;
* add/sub/add_const: each term's requantize, one vector pass per sum, and with ``F > 0`` (high precision) the
  final rounding shift and the ``2**F`` shift of terms whose multiplier is 1; cat: each input's requantize and
  one move;
* other integer ops: vector passes over their elements; table ops (§13): one lookup per element at
  ``table_lookups_per_cycle`` plus their vector passes; views (reshape, slice, ...): free;
* host ops (the partition, §12: no integer rule, values made inside forward, post-processing): their output
  elements at ``host_cycles_per_element``; each crossing between the NPU and the host (a dequantize a host op
  reads, a quantize of a host result) ``crossing_cycles`` on top of its vector pass.

The requantize applications themselves are counted per node and term (``requantize_ops``: multipliers other
than exactly 1; ``shift_only_ops``: those that are a pure power of two). The shapes come from ``graph.values``;
a dynamic dim (-1) counts as ``batch``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from quantlens._registry import make_registry
from quantlens.errors import QuantLensError
from quantlens.march import CostModel, Qpp, get_march
from quantlens.march.opset import IR_OPS, Cost

__all__ = ["LatencyEstimate", "estimate_latency", "requant_class"]


@dataclass(frozen=True)
class LatencyEstimate:
    """The estimated latency of one call of a quantized IR (``docs/march.md`` §15)."""

    cycles: int
    microseconds: float
    #: requantize applications (per node and term) whose multiplier is not exactly 1
    requantize_ops: int
    #: of those, the ones whose multiplier is a power of two (a rounding shift, no multiply)
    shift_only_ops: int
    #: cycles per IR op
    by_op: dict[str, int] = field(default_factory=dict)
    #: cycles of the ops on the host, and of the NPU-host crossings (both included in ``cycles``)
    host_cycles: int = 0
    crossing_cycles: int = 0
    #: the crossings between the NPU and the host
    crossings: int = 0
    #: multiply-accumulates of the GEMMs on the NPU and on the host
    npu_macs: int = 0
    host_macs: int = 0

    @property
    def npu_mac_share(self) -> float:
        """The share of the model's MACs the NPU computes (1.0 without any GEMM)."""
        total = self.npu_macs + self.host_macs
        return self.npu_macs / total if total else 1.0


#: requantize classes, cheapest first
_CLASSES = ("identity", "shift", "default", "high_precision")


def requant_class(multiplier: int, shift: int) -> str:
    """``"identity"`` (``M · 2**-shift == 1``), ``"shift"`` (``M`` a power of two), ``"default"`` (``M < 2**16``,
    the 16x32 multiply: the default profile's multiplier width) or ``"high_precision"`` (a wider ``M``: the 32x32
    -> 64-bit multiply)."""
    m, s = int(multiplier), int(shift)
    if m > 0 and s >= 0 and m == 1 << s:
        return "identity"
    if m > 0 and m & (m - 1) == 0:
        return "shift"
    return "default" if m < 1 << get_march().spec.qpp(Qpp.DEFAULT).multiplier_bits else "high_precision"


def _worst(mults, shifts) -> str:
    classes = [requant_class(m, s) for m, s in zip(mults, shifts)]
    return max(classes, key=_CLASSES.index) if classes else "identity"


def _passes(cm: CostModel, cls: str) -> int:
    return {"identity": 0, "shift": cm.requant_passes_shift, "default": cm.requant_passes_default,
            "high_precision": cm.requant_passes_high_precision}[cls]


class _Estimator:
    def __init__(self, module, batch: int):
        self.g = module.graph
        self.batch = batch
        self.cm = get_march().spec.cost
        self.requantize_ops = 0
        self.shift_only_ops = 0
        self.host_cycles = self.crossing_cycles = self.crossings = self.npu_macs = self.host_macs = 0
        self.host_values = {o for n in self.g.nodes if n.attrs.get("host") for o in n.outputs}
        self.host_reads = {v for n in self.g.nodes if n.attrs.get("host") for v in n.inputs}

    def shape(self, name: str) -> tuple[int, ...]:
        info = self.g.values.get(name)
        if info is None:
            tensor = self.g.constants.get(name)
            return tuple(tensor.shape) if tensor is not None else ()
        return tuple(self.batch if d == -1 else max(int(d), 0) for d in info.shape)

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name)) if name else 0

    def qdtype(self, name: str) -> str | None:
        info = self.g.values.get(name)
        return info.qdtype if info is not None else None

    def vector(self, elements: int, passes: int = 1) -> int:
        return -(-elements * passes // self.cm.vector_lanes) if elements > 0 and passes > 0 else 0

    def requant(self, elements: int, mults, shifts) -> int:
        """Cycles of one requantize application of ``elements`` values, and its count."""
        if mults is None:  # int32 high-precision output: saturate only, no requantize
            return 0
        cls = _worst(mults, shifts)
        if cls != "identity":
            self.requantize_ops += 1
            self.shift_only_ops += cls == "shift"
        return self.vector(elements, _passes(self.cm, cls))

    def output_requant(self, node, out: int) -> int:
        return self.requant(out, node.attrs.get("multiplier"), node.attrs.get("shift"))

    def gemm(self, macs: int, operands: list[str]) -> int:
        wide = any(self.qdtype(v) == "qint16" for v in operands if v)
        rate = self.cm.macs_per_cycle_int16 if wide else self.cm.macs_per_cycle_int8
        return -(-macs // rate) if macs > 0 else 0

    def node(self, node) -> int:
        op = IR_OPS.get(node.op)
        out = self.numel(node.outputs[0]) if node.outputs else 0
        if node.attrs.get("host"):
            cycles = math.ceil(out * self.cm.host_cycles_per_element)
            if op is not None and op.cost is Cost.GEMM:
                self.host_macs += _macs(self, node, out)
            self.host_cycles += cycles
            return cycles
        cycles = _CHARGES[op.cost if op is not None else Cost.PASS](self, node, out)
        if self._crosses(node):
            self.crossings += 1
            self.crossing_cycles += self.cm.crossing_cycles
            cycles += self.cm.crossing_cycles
        return cycles

    def _crosses(self, node) -> bool:
        """A boundary (de)quantize between the NPU and a host op (not the model's own inputs and outputs)."""
        if node.op == "dequantize":
            return any(o in self.host_reads for o in node.outputs)
        return node.op == "quantize" and bool(node.inputs) and node.inputs[0] in self.host_values


#: Cost (the op set's per-op cost kind) -> ``(estimator, node, output elements) -> cycles``
_CHARGES, _charges = make_registry("cost rule for")


@_charges(Cost.PASS)
def _one_pass(e: _Estimator, node, out: int) -> int:
    return e.vector(out)  # a move, a boundary (de)quantize, an index op: one vector pass


@_charges(Cost.FREE)
def _free(e: _Estimator, node, out: int) -> int:
    return 0


def _macs(e: _Estimator, node, out: int) -> int:
    """The multiply-accumulates of a GEMM node with ``out`` output elements."""
    x, w_shape = node.inputs[0], e.shape(node.inputs[1])
    if node.op in ("conv1d", "conv2d"):
        return out * math.prod(w_shape[1:])
    if node.op.startswith("conv_transpose"):  # every input element reaches out/groups · prod(k) outputs
        return e.numel(x) * math.prod(w_shape[1:])
    # linear [out, in], matmul [..., k, n]: the contraction length
    k = w_shape[-1] if node.op == "linear" else (e.shape(x)[-1] if e.shape(x) else 1)
    return out * k


@_charges(Cost.GEMM)
def _gemm(e: _Estimator, node, out: int) -> int:
    macs = _macs(e, node, out)
    e.npu_macs += macs
    return e.gemm(macs, node.inputs[:2]) + e.output_requant(node, out)


@_charges(Cost.BILINEAR)
def _bilinear(e: _Estimator, node, out: int) -> int:
    shape = e.shape(node.inputs[0])
    lead = math.prod(shape[:-2]) if len(shape) >= 2 else 1
    (h_out, h_in), (w_out, w_in) = e.shape(node.inputs[1]), e.shape(node.inputs[2])
    macs = lead * (h_out * h_in * w_in + h_out * w_in * w_out)
    # the interpolation weights are int16: the int8 x int16 rate
    return -(-macs // e.cm.macs_per_cycle_int16) + e.output_requant(node, out)


@_charges(Cost.RESCALED_SUM)
def _rescaled_sum(e: _Estimator, node, out: int) -> int:
    a = node.attrs
    frac = int(a.get("frac_bits", 8))
    cycles = 0
    for m, s in zip(a.get("multipliers", []), a.get("shifts", [])):
        cycles += e.requant(out, [m], [s])
        if frac > 0 and requant_class(m, s) == "identity":
            cycles += e.vector(out, e.cm.requant_passes_shift)  # q · 2**F
    sums = len(a.get("multipliers", [1])) - 1 + (node.op == "add_const")
    cycles += e.vector(out, sums)
    if frac > 0:
        cycles += e.vector(out, e.cm.requant_passes_shift)  # the one final rounding by F
    return cycles


@_charges(Cost.CAT)
def _cat(e: _Estimator, node, out: int) -> int:
    a = node.attrs
    cycles = sum(e.requant(e.numel(v), [m], [s])
                 for v, m, s in zip(node.inputs, a.get("multipliers", []), a.get("shifts", [])))
    return cycles + e.vector(out)


@_charges(Cost.PRELU)
def _prelu(e: _Estimator, node, out: int) -> int:
    return (e.vector(out) + e.output_requant(node, out)
            + e.requant(out, node.attrs.get("neg_multiplier"), node.attrs.get("neg_shift")))


@_charges(Cost.PASS_REQUANT)
def _pass_requant(e: _Estimator, node, out: int) -> int:
    return e.vector(out) + e.output_requant(node, out)


@_charges(Cost.SCALE)
def _scale(e: _Estimator, node, out: int) -> int:
    return e.vector(out, int(bool(node.attrs.get("negative")))) + e.output_requant(node, out)


@_charges(Cost.REQUANTIZE)
def _requantize(e: _Estimator, node, out: int) -> int:
    return e.output_requant(node, out)


@_charges(Cost.SUM)
def _sum(e: _Estimator, node, out: int) -> int:
    return e.vector(e.numel(node.inputs[0])) + e.output_requant(node, out)


@_charges(Cost.AVG_POOL)
def _avg_pool(e: _Estimator, node, out: int) -> int:
    return e.vector(out, math.prod(node.attrs.get("kernel_size", [1]))) + e.output_requant(node, out)


@_charges(Cost.MAX_POOL)
def _max_pool(e: _Estimator, node, out: int) -> int:
    ks = node.attrs.get("kernel_size", [1])
    return e.vector(out, math.prod(ks if isinstance(ks, (list, tuple)) else [ks]))


@_charges(Cost.TABLE)
def _table(e: _Estimator, node, out: int) -> int:
    elements = e.numel(node.inputs[0])
    lookups = -(-elements // e.cm.table_lookups_per_cycle) if elements else 0
    return lookups + e.vector(elements, IR_OPS[node.op].table_passes)


@_charges(Cost.SCAN)
def _scan(e: _Estimator, node, out: int) -> int:
    return e.vector(e.numel(node.inputs[0]))


def estimate_latency(module, batch: int = 1) -> "LatencyEstimate":
    """The estimated cycles of one call of the quantized IR ``module`` with batch size ``batch`` on the selected
    march's cost model (``docs/march.md`` §15)."""
    kind = getattr(module, "kind", None)
    if kind != "quantized":
        what = "the qat IR (kind 'qat')" if kind == "qat" else repr(type(module).__name__)
        raise QuantLensError(
            f"estimate_latency needs the integer-only quantized IR; it was given {what}. The cost model counts "
            "integer kernels and their requantize multipliers, which only the quantized IR has: convert first, "
            "with quantlens.compiler.convert(qat_ir)."
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise QuantLensError(f"estimate_latency: batch must be an int >= 1, got {batch!r}.")
    est = _Estimator(module, batch)
    by_op: Counter = Counter()
    for node in module.graph.nodes:
        by_op[node.op] += est.node(node)
    cycles = int(sum(by_op.values()))
    return LatencyEstimate(cycles=cycles, microseconds=cycles / est.cm.clock_mhz, requantize_ops=est.requantize_ops,
                           shift_only_ops=est.shift_only_ops, by_op=dict(sorted(by_op.items())),
                           host_cycles=est.host_cycles, crossing_cycles=est.crossing_cycles, crossings=est.crossings,
                           npu_macs=est.npu_macs, host_macs=est.host_macs)
