"""The table-op registry: one :class:`TableOpSpec` per op type that ``pre_export`` computes by table.

``docs/march.md`` §13 gives the integer rules; this is the one place that says, per op type (the canonical name
the tracer gives the op site, as in :data:`quantlens.march.opset.OPS`):

* the float op the prepared (fake-quant / QAT) model computes, and the real function the tables sample
  (``docs/march.md`` §13.4: float64, defined on every input);
* the call parameters the tables depend on, and whether a function-call site needs one example forward to
  read them;
* the site override class that builds the tables and runs the integer kernel (:mod:`.table_overrides`);
* how many quantized tensor inputs it reads, and what an int16 input gets.

An elementwise op's float op, real function and int16 rule are declared below quantization, in
:data:`quantlens.march.functions.TABLE_FUNCTIONS` (the integer kernels evaluate those functions); its entry here
takes them from there and adds the call parameters and the override. ``pre_export`` and :mod:`.table_overrides`
read this registry. The IR ops the overrides emit are declared in :data:`quantlens.kernels.ops.TABLE_OP_IO`;
``export`` records which float op a ``lut`` / ``segment_lut`` node emulates (``attrs["reference"]``:
``{"op": op_type, **params}``), and ``to_onnx`` writes that float IR op, so an elementwise op type is also a float
IR op with an ONNX converter taking ``params`` as its attributes. The op set (:mod:`quantlens.march.opset`)
declares ``table=True`` exactly for the keys of :data:`TABLE_OP_SPECS` (``tests/test_table_ops.py`` checks it).

To add an elementwise table op: one :data:`~quantlens.march.functions.TABLE_FUNCTIONS` entry (its float op,
and its real function when the two differ), its call parameters below (:data:`_ELEMENTWISE_CALLS`) when it has
any, an :data:`quantlens.march.opset.OPS` row with ``table=True``, and a rule row in ``docs/march.md`` §13.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError
from quantlens.march.functions import TABLE_FUNCTIONS
from quantlens.quantization.overrides import OverrideCall
from quantlens.quantization.table_calls import (
    arg,
    float_leaves,
    layer_norm_call,
    normalize_float,
    normalize_site,
    rms_norm_float,
    rms_norm_site,
    softmax_call,
    vector_norm_float,
    vector_norm_params,
)
from quantlens.sites.record import OpSiteRecord

__all__ = ["TableKind", "TableOpSpec", "TABLE_OP_SPECS", "table_op_spec"]


class TableKind(str, Enum):
    """Which site override computes a table op (each :mod:`.table_overrides` class names its kind, so this registry
    needs none of them: the overrides read it)."""

    ELEMENTWISE = "elementwise"
    DIV = "div"
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log_softmax"
    LAYER_NORM = "layer_norm"
    RMS_NORM = "rms_norm"
    NORMALIZE = "normalize"
    VECTOR_NORM = "vector_norm"

Params = dict[str, Any]
#: (params, weight, bias) a site's tables are built for; params ``None``: this call is not a table op
SiteParams = tuple[Params | None, torch.Tensor | None, torch.Tensor | None]


def _no_params(call: OverrideCall) -> Params:
    return {}


@dataclass(frozen=True)
class TableOpSpec:
    """One table op type. See the module docstring."""

    op_type: str
    #: the site override built for a site (the :mod:`.table_overrides` class of that kind): ``cls(site, op_type,
    #: input_fqs, output_fq, params, weight, bias)``
    kind: TableKind
    #: elementwise ops: the float op of the prepared model, ``torch_op(x, **params)``
    torch_op: Callable[..., torch.Tensor] | None = None
    #: elementwise ops: the real function the table samples, ``function(x, **params)`` in float64 (§13.4);
    #: ``None``: ``torch_op`` (the two agree on every input)
    function: Callable[..., torch.Tensor] | None = None
    #: the call parameters the tables depend on: module attributes, call arguments, or the defaults (a call
    #: with no arguments); ``None``: this call is not a table op (the site stays float)
    params_from_call: Callable[[OverrideCall], Params | None] = _no_params
    #: a function-call site's parameters are only known when it runs: pre_export reads them on one forward of
    #: its ``example_inputs`` (without them, ``site_params`` decides: the defaults, or an error)
    needs_call_args: bool = False
    #: non-elementwise ops: ``site_params(rec, module, call)`` -> (params, weight, bias), ``call`` the captured
    #: call or ``None``; the default is ``params_from_call`` of the captured call or of the module / defaults
    site_params: Callable[[OpSiteRecord, torch.nn.Module | None, OverrideCall | None], SiteParams] | None = None
    #: non-elementwise ops: the float op, ``float_fn(call, site)``
    float_fn: Callable[[OverrideCall, str], Any] | None = None
    #: quantized tensor inputs the table reads (a site with fewer float tensor inputs is not a table op)
    inputs: int = 1
    #: what an int16 input of an elementwise op gets: ``"segmented"`` (§13.3) or ``"mantissa_reciprocal"``
    #: (§13.5); ``""`` for the other ops (their override decides)
    int16: str = "segmented"
    #: whether its rule writes a per-channel output scale along the normalized last dim (channel exponents,
    #: ``docs/march.md`` §3.1): a norm's gain and bias are per element, so they take each channel's own scale
    channel_output: bool = False

    @property
    def elementwise(self) -> bool:
        """One table per site on one input (§13.4)."""
        return self.torch_op is not None

    def real_function(self, **params) -> Callable[[torch.Tensor], torch.Tensor]:
        """``f`` of the table (float64), for the given parameters."""
        fn = self.function or self.torch_op
        if fn is None:
            raise QuantLensError(f"{self.op_type} is not an elementwise table op; it has no table function.")
        return lambda x: fn(x, **params)

    def float_op(self, call: OverrideCall, site: str = "") -> Any:
        """What the prepared model computes at the site before its output fake quant."""
        if self.float_fn is not None:
            return self.float_fn(call, site)
        params = self.params_from_call(call)
        if params is None:  # not a table op call (2 ** x): the user's call itself
            return call.func(*call.args, **call.kwargs)
        return self.torch_op(float_leaves(call)[0], **params)

    def resolve(self, rec: OpSiteRecord, module: torch.nn.Module | None, call: OverrideCall | None) -> SiteParams:
        """The (params, weight, bias) site ``rec``'s tables are built for (``call``: the captured call, if any)."""
        if self.site_params is not None:
            return self.site_params(rec, module, call)
        fake = OverrideCall(rec.name, rec.op_type, (), {}, module, [], None) if call is None else call
        return self.params_from_call(fake), None, None

    def applies(self, rec: OpSiteRecord) -> bool:
        """Whether site ``rec`` (with a quantized output) has the float tensor inputs of this table op."""
        if self.elementwise and len(rec.inputs) > 1:
            return False  # an elementwise table reads one tensor (x ** y with a tensor y stays float)
        return len(rec.inputs) >= self.inputs and bool(rec.inputs)


# -- call parameters ------------------------------------------------------------------------------------------


def _gelu_params(call: OverrideCall) -> Params:
    module = call.module
    return {"approximate": module.approximate if module is not None else arg(call, 1, "approximate", "none")}


def _softplus_params(call: OverrideCall) -> Params:
    return {"beta": float(arg(call, 1, "beta", 1.0)), "threshold": float(arg(call, 2, "threshold", 20.0))}


def _elu_params(call: OverrideCall) -> Params:
    module = call.module
    return {"alpha": float(module.alpha if module is not None else arg(call, 1, "alpha", 1.0))}


def _pow_params(call: OverrideCall) -> Params | None:
    """``x ** c``, ``torch.pow(x, c)``, ``x.pow(c)`` with a Python number ``c``. ``c ** x`` (``__rpow__``) and a
    tensor exponent are not table ops."""
    if getattr(call.func, "__name__", "") == "__rpow__":
        return None
    base = call.args[0] if call.args else call.kwargs.get("input", call.kwargs.get("self"))
    exponent = arg(call, 1, "exponent", None)
    if not isinstance(base, torch.Tensor) or isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
        return None
    return {"exponent": exponent}


def _pow_site(rec: OpSiteRecord, module, call: OverrideCall | None) -> SiteParams:
    if call is None:
        raise QuantLensError(
            f"pre_export: op site '{rec.name}' calls pow (at {rec.source}); its exponent is only known when it "
            "runs. Pass example inputs: pre_export(model, example_inputs=...)."
        )
    return _pow_params(call), None, None


def _softmax_site(rec: OpSiteRecord, module, call: OverrideCall | None) -> SiteParams:
    shape = rec.inputs[0].shape
    length = shape[-1] if shape else 1
    if module is not None and module.dim is not None and shape:
        length = shape[module.dim]
    elif call is not None:
        dim = arg(call, 1, "dim", None)
        if dim is not None and shape:
            length = shape[int(dim)]
    return {"length": int(length)}, None, None


def _layer_norm_site(rec: OpSiteRecord, module, call: OverrideCall | None) -> SiteParams:
    if module is not None:
        return ({"normalized_shape": tuple(module.normalized_shape), "eps": float(module.eps)},
                module.weight, module.bias)
    if call is None:
        raise QuantLensError(
            f"pre_export: op site '{rec.name}' calls layer_norm as a function (at {rec.source}); its "
            "normalized shape, weight, bias and eps are only known when it runs. Pass example inputs: "
            "pre_export(model, example_inputs=...), or use an nn.LayerNorm module."
        )
    shape, weight, bias, eps = layer_norm_call(call)
    return {"normalized_shape": shape, "eps": eps}, weight, bias


# -- float ops of the non-elementwise table ops --------------------------------------------------------------


def _div_float(call: OverrideCall, site: str) -> Any:
    return torch.div(*call.args, **call.kwargs)


def _softmax_float(call: OverrideCall, site: str) -> Any:
    dim, dtype = softmax_call(call, site)
    return torch.softmax(float_leaves(call)[0], dim, dtype=dtype)


def _log_softmax_float(call: OverrideCall, site: str) -> Any:
    dim, dtype = softmax_call(call, site)
    return torch.log_softmax(float_leaves(call)[0], dim, dtype=dtype)


def _layer_norm_float(call: OverrideCall, site: str) -> Any:
    shape, w, b, eps = layer_norm_call(call)
    return F.layer_norm(float_leaves(call)[0], shape, w, b, eps)


# -- the registry ---------------------------------------------------------------------------------------------


def _elementwise(op_type: str, params=_no_params, needs_call_args=False, site_params=None) -> TableOpSpec:
    f = TABLE_FUNCTIONS[op_type]
    return TableOpSpec(op_type, TableKind.ELEMENTWISE, torch_op=f.torch_op, function=f.function,
                       params_from_call=params, needs_call_args=needs_call_args, site_params=site_params,
                       int16=f.int16)


#: the call parameters of the elementwise ops that have any (the others: none)
_ELEMENTWISE_CALLS: dict[str, dict[str, Any]] = {
    "gelu": dict(params=_gelu_params, needs_call_args=True),
    "softplus": dict(params=_softplus_params, needs_call_args=True),
    "pow": dict(params=_pow_params, needs_call_args=True, site_params=_pow_site),
    "elu": dict(params=_elu_params, needs_call_args=True),
}

_SPECS = [
    # elementwise (§13.4): the float op and real function of march.functions.TABLE_FUNCTIONS, in its order
    *(_elementwise(op_type, **_ELEMENTWISE_CALLS.get(op_type, {})) for op_type in TABLE_FUNCTIONS),
    # the composite table ops (§13.5-§13.7; log_softmax: §13.6.1)
    TableOpSpec("div", TableKind.DIV, float_fn=_div_float, inputs=2, int16=""),
    TableOpSpec("softmax", TableKind.SOFTMAX, float_fn=_softmax_float, site_params=_softmax_site, int16=""),
    TableOpSpec("log_softmax", TableKind.LOG_SOFTMAX, float_fn=_log_softmax_float, site_params=_softmax_site,
                int16=""),
    TableOpSpec("layer_norm", TableKind.LAYER_NORM, float_fn=_layer_norm_float, site_params=_layer_norm_site,
                needs_call_args=True, int16="", channel_output=True),
    # the RMS norm, L2 normalization and L2 norm (§13.7.1, §13.7.2: table_overrides/norms.py)
    TableOpSpec("rms_norm", TableKind.RMS_NORM, float_fn=rms_norm_float, site_params=rms_norm_site,
                needs_call_args=True, int16=""),
    TableOpSpec("normalize", TableKind.NORMALIZE, float_fn=normalize_float, site_params=normalize_site,
                needs_call_args=True, int16=""),
    *(TableOpSpec(name, TableKind.VECTOR_NORM, float_fn=vector_norm_float, params_from_call=vector_norm_params,
                  needs_call_args=True, int16="") for name in ("linalg_vector_norm", "norm")),
]

#: every table op type, by the op site's op type
TABLE_OP_SPECS: dict[str, TableOpSpec] = {spec.op_type: spec for spec in _SPECS}


def table_op_spec(op_type: str) -> TableOpSpec:
    spec = TABLE_OP_SPECS.get(op_type)
    if spec is None:
        raise QuantLensError(f"{op_type!r} is not a table op; table ops: {sorted(TABLE_OP_SPECS)}.")
    return spec
