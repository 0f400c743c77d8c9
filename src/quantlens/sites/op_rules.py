"""What each intercepted torch operation means for quantization (the op-rule registry).

Every op the tracer sees is classified once, here:

* ``QUANTIZED``: computes new values; its output gets an output fake quant and its float inputs must arrive
  quantized (an input fake quant is added where they do not);
* ``PASSTHROUGH``: moves, selects or compares existing values (view, getitem, relu, max-pool ...); an int8
  value stays on its grid, so the output inherits the input's quantization;
* ``IGNORED``: metadata and non-float work (``size``, ``shape``, comparisons, creation ops); no op site.

Ops not in the registry that touch float tensors run on the host, in float, at every stage (``docs/march.md``
§12.1), and ``model_check_result.txt`` says so.

The op types and their categories are declared once, in :mod:`quantlens.march.opset`; this module derives each op's
kind from its category and maps leaf modules to op types. To support a new op, add it to the op set (and a
``register_module_op`` line for a module that is one op site).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from torch import nn

from quantlens.march.opset import OPS, Category, OpDef
from quantlens.sites.stubs import DeQuantStub, QuantStub

__all__ = [
    "OpKind",
    "OpRule",
    "register_function_op",
    "register_module_op",
    "function_rule",
    "module_rule",
    "canonical_op_name",
    "register_recurrent_module",
    "is_recurrent_module",
    "computes_as",
    "COMPUTES_REGISTERED_OP",
    "WEIGHT_CHANNEL_AXIS",
]


class OpKind(str, Enum):
    QUANTIZED = "quantized"
    PASSTHROUGH = "passthrough"
    IGNORED = "ignored"
    #: a composite function (``F.multi_head_attention_forward``): no op site of its own; the tracer looks
    #: inside, so each torch op it runs is an op site (with its own quantization), as on the NPU.
    COMPOSITE = "composite"


@dataclass(frozen=True)
class OpRule:
    """Quantization behaviour of one op type."""

    op_type: str
    kind: OpKind
    #: conv/linear/matmul-like: the march forbids int16 on both operands.
    gemm: bool = False
    #: argument positions that hold weights when the op is called functionally.
    weight_args: tuple[int, ...] = ()
    #: argument positions of a functional call's bias (int32 at s_in * s_w, like a module's bias).
    bias_args: tuple[int, ...] = ()
    #: output positions that are integer indices (argmax, topk indices): the profiler substitutes them.
    index_producing: bool = False
    #: the output is a row of the (already quantized) weight, so it needs no own fake quant (embedding).
    output_from_weight: bool = False
    #: whether the op is known to the march (has an integer lowering).
    known: bool = True
    #: "input" for QuantStub (quantizes a raw float input), "output" for DeQuantStub.
    boundary: str = ""


_FUNCTION_RULES: dict[str, OpRule] = {}
_MODULE_RULES: dict[type, OpRule] = {}


def register_function_op(names: str | tuple[str, ...], kind: OpKind, **flags) -> None:
    for name in (names,) if isinstance(names, str) else names:
        _FUNCTION_RULES[name] = OpRule(op_type=name, kind=kind, **flags)


def register_module_op(module_type: type, op_type: str, kind: OpKind, **flags) -> None:
    _MODULE_RULES[module_type] = OpRule(op_type=op_type, kind=kind, **flags)


Q, P, I = OpKind.QUANTIZED, OpKind.PASSTHROUGH, OpKind.IGNORED

# --- functions and tensor methods: every op type of the op set (``quantlens.march.opset``) -------------------------
_QUANTIZED_CATEGORIES = {Category.GEMM, Category.ELEMENTWISE, Category.REDUCTION, Category.TABLE}


def _kind(op: OpDef) -> OpKind:
    """An op's quantization behaviour follows from its category in the op set."""
    if op.category is Category.COMPOSITE:
        return OpKind.COMPOSITE
    if op.category is Category.METADATA or (op.category is Category.INDEX and not op.ir) or op.name == "argmax":
        return I
    if op.category in _QUANTIZED_CATEGORIES or op.output_from_weight:
        return Q
    return P


for _op in OPS.values():
    if _op.category is not Category.BOUNDARY:
        register_function_op(
            _op.name, _kind(_op), gemm=_op.gemm, weight_args=_op.weight_args, bias_args=_op.bias_args,
            index_producing=_op.index_producing, output_from_weight=_op.output_from_weight,
        )

# --- leaf modules: the tracer treats these as one op site named by the module's qualified name ---------
register_module_op(QuantStub, "quant_stub", Q, boundary="input")
register_module_op(DeQuantStub, "dequant_stub", P, boundary="output")
register_module_op(nn.Conv1d, "conv1d", Q, gemm=True)
register_module_op(nn.Conv2d, "conv2d", Q, gemm=True)
register_module_op(nn.ConvTranspose1d, "conv_transpose1d", Q, gemm=True)
register_module_op(nn.ConvTranspose2d, "conv_transpose2d", Q, gemm=True)
register_module_op(nn.Linear, "linear", Q, gemm=True)
register_module_op(nn.Embedding, "embedding", Q, output_from_weight=True)
register_module_op(nn.LayerNorm, "layer_norm", Q)
register_module_op(nn.RMSNorm, "rms_norm", Q)
register_module_op(nn.BatchNorm1d, "batch_norm", Q)
register_module_op(nn.BatchNorm2d, "batch_norm", Q)
register_module_op(nn.GELU, "gelu", Q)
register_module_op(nn.Sigmoid, "sigmoid", Q)
register_module_op(nn.Tanh, "tanh", Q)
register_module_op(nn.SiLU, "silu", Q)
register_module_op(nn.Softmax, "softmax", Q)
register_module_op(nn.ReLU6, "relu6", Q)
register_module_op(nn.Hardtanh, "hardtanh", Q)
register_module_op(nn.AvgPool2d, "avg_pool2d", Q)
register_module_op(nn.AdaptiveAvgPool1d, "adaptive_avg_pool1d", Q)
register_module_op(nn.AdaptiveAvgPool2d, "adaptive_avg_pool2d", Q)
register_module_op(nn.Upsample, "interpolate", Q)
register_module_op(nn.ReLU, "relu", P)
register_module_op(nn.MaxPool1d, "max_pool1d", P)
register_module_op(nn.MaxPool2d, "max_pool2d", P)
register_module_op(nn.AvgPool1d, "avg_pool1d", Q)
register_module_op(nn.AdaptiveMaxPool1d, "adaptive_max_pool1d", P)
register_module_op(nn.AdaptiveMaxPool2d, "adaptive_max_pool2d", P)
register_module_op(nn.PixelShuffle, "pixel_shuffle", P)
register_module_op(nn.PixelUnshuffle, "pixel_unshuffle", P)
register_module_op(nn.Dropout, "dropout", P)
register_module_op(nn.Identity, "identity", P)
register_module_op(nn.Flatten, "flatten", P)
register_module_op(nn.Hardswish, "hardswish", Q)
register_module_op(nn.Hardsigmoid, "hardsigmoid", Q)
register_module_op(nn.ELU, "elu", Q)

# --- recurrent modules: looked into (their fused _VF op is decomposed into gate ops, ``rnn.py``), and every call
# restarts their op counters, so all calls (time steps) share one set of op sites and quantizers -------------
_RECURRENT_MODULES: set[type] = set()


def register_recurrent_module(module_type: type) -> None:
    _RECURRENT_MODULES.add(module_type)


def is_recurrent_module(module: nn.Module) -> bool:
    return any(cls in _RECURRENT_MODULES for cls in type(module).__mro__)


for _cls in (nn.LSTMCell, nn.GRUCell, nn.LSTM, nn.GRU):
    register_recurrent_module(_cls)


_DUNDER = {
    "radd": "add", "iadd": "add", "rsub": "rsub", "isub": "sub", "rmul": "mul", "imul": "mul",
    "truediv": "div", "rtruediv": "div", "itruediv": "div", "rmatmul": "matmul", "imatmul": "matmul",
    "rpow": "pow", "ipow": "pow", "floordiv": "floordiv", "rfloordiv": "floordiv", "getitem": "getitem",
    "setitem": "setitem", "bool": "bool", "len": "len", "iter": "iter", "format": "format", "repr": "repr",
    "and": "and", "rand": "and", "or": "or", "ror": "or", "invert": "invert", "eq": "eq", "ne": "ne",
    "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "neg": "neg", "add": "add", "sub": "sub", "mul": "mul",
    "matmul": "matmul", "pow": "pow", "abs": "abs", "get": "__get__", "set": "__set__",
}


def canonical_op_name(func: Callable) -> str:
    """``torch.add``, ``Tensor.add``, ``Tensor.__radd__`` and ``Tensor.add_`` are all ``"add"``."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name.startswith("__") and name.endswith("__"):
        stripped = name[2:-2]
        return _DUNDER.get(stripped, stripped)
    if name.endswith("_") and not name.startswith("_") and name[:-1] in _FUNCTION_RULES:
        return name[:-1]  # in-place variant
    return _ALIASES.get(name, name)


#: torch's documented aliases of an op (``torch.multiply`` is ``torch.mul``): one op type, one rule
_ALIASES = {"multiply": "mul", "subtract": "sub", "divide": "div", "true_divide": "div", "negative": "neg",
            "absolute": "abs"}


def function_rule(op_name: str) -> OpRule:
    """The rule for a function op; unknown ops are QUANTIZED with ``known=False``."""
    rule = _FUNCTION_RULES.get(op_name)
    if rule is None:
        return OpRule(op_type=op_name, kind=OpKind.QUANTIZED, known=False, **_WEIGHTED_FUNCTIONS.get(op_name, {}))
    return rule


#: functions outside the op set whose weight operand is known: a parameter passed there is a weight, so it gets a
#: weight fake quant at the site like F.linear's, while the op itself has no integer rule (an op set row of the same
#: name takes precedence, and must declare the same ``weight_args`` / ``bias_args``)
_WEIGHTED_FUNCTIONS: dict[str, dict] = {}  # (addmm, its first user, now has its op set row)


def module_rule(module: nn.Module) -> OpRule | None:
    """The rule for a leaf module, or ``None`` for modules whose forward is traced op by op.

    A subclass of a registered module is that op only while it computes through the registered class's own
    methods (:func:`computes_as`); one with a ``forward`` of its own is traced op by op: the
    ``F.conv1d(x, self.weight, ...)`` it calls is an op site whose parameter weight gets a weight fake quant there,
    and a LayerNorm subclass that permutes around ``super().forward`` (ConvNeXt's channels_first norm) is its
    permutes and an ``F.layer_norm`` site, so its table normalizes the axis the module really normalizes."""
    module_type = type(module)
    for cls in module_type.__mro__:
        rule = _MODULE_RULES.get(cls)
        if rule is not None:
            if cls is not module_type and not computes_as(module_type, cls):
                return None
            return rule
    return None


#: the methods through which a registered module computes its op
_COMPUTE_METHODS = ("forward", "_conv_forward")
#: a class attribute by which a module class declares that its forward computes the op of the registered class it
#: derives from (the QAT classes: the same op on fake-quantized operands)
COMPUTES_REGISTERED_OP = "_quantlens_computes_registered_op"


def computes_as(module_type: type, base: type) -> bool:
    """Whether instances of ``module_type`` (a subclass of ``base``) compute ``base``'s op: the class overrides none
    of ``base``'s compute methods (a ``__init__`` of its own, or the class ``torch.nn.utils.parametrize`` makes,
    still computes ``base``'s op), or it declares :data:`COMPUTES_REGISTERED_OP`."""
    if getattr(module_type, COMPUTES_REGISTERED_OP, False):
        return True
    return all(getattr(module_type, m, None) is getattr(base, m, None) for m in _COMPUTE_METHODS)


#: the output-channel axis of a functional op's weight operand where it is not axis 0, so a per-channel weight fake
#: quant runs along the output channels (one requantize multiplier and one int32 bias scale per output channel)
WEIGHT_CHANNEL_AXIS: dict[str, int] = {"addmm": 1}
