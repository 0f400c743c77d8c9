"""The header checks of ``load``: a header that passed the checksum must still describe a valid module.

Each check names what is wrong and where (the node by index, op and op site; the value info; the input leaf)
and what was expected: known ops of the module's kind, attr types and ranges, each node's inputs, outputs and
required attrs as its kernel needs them (:mod:`.arity`), value types, every referenced name defined before use,
pytree specs that match the inputs and outputs, and last each node's shapes and dtypes as its op computes them
(:mod:`.shapes`).
"""

from __future__ import annotations

from typing import Any

import torch

from quantlens.compiler.ir import Graph, InputLeaf, Module, Node, ValueInfo
from quantlens.compiler.output_containers import load_spec
from quantlens.compiler.provenance import SOURCE_DIGEST_KEY, is_digest
from quantlens.compiler.serialize.arity import node_problem
from quantlens.compiler.serialize.codec import decode_value
from quantlens.compiler.serialize.schema import (
    DTYPES,
    HEADER_FIELDS,
    LEAF_FIELDS,
    NODE_FIELDS,
    VALUE_DTYPES,
    VALUE_FIELDS,
)
from quantlens.compiler.serialize.shapes import shape_problem
from quantlens.march import QuantDType
from quantlens.march.opset import IR_OPS


class InvalidHeader(ValueError):
    """A header that passed the checksum but does not describe a valid module."""


_QDTYPES = tuple(d.value for d in QuantDType)
#: the IR op levels each module kind may hold (``quantlens.march.opset``); any op may run on the host (``host: true``)
_LEVELS = {"qat": ("qat", "both"), "quantized": ("quantized", "both")}
_MAX_SHIFT = 63  # a right shift of an int64 product; the march allows [0, MarchSpec.max_requant_shift]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fields(obj: Any, fields: frozenset, where: str) -> dict:
    if not isinstance(obj, dict):
        raise InvalidHeader(f"{where} is {_short(obj)}, expected an object with fields {sorted(fields)}")
    missing, extra = sorted(fields - set(obj)), sorted(set(obj) - fields)
    if missing:
        raise InvalidHeader(f"{where} lacks the fields {missing}")
    if extra:
        raise InvalidHeader(f"{where} has unknown fields {[_short(k) for k in extra[:5]]}")
    return obj


def _names(value: Any, where: str, unique: bool = True, allow_empty: bool = False) -> list[str]:
    if not isinstance(value, list):
        raise InvalidHeader(f"{where} is {_short(value)}, expected a list of names")
    for name in value:
        if not isinstance(name, str) or (not name and not allow_empty):
            raise InvalidHeader(f"{where} holds {_short(name)}, expected a {'' if allow_empty else 'non-empty '}string")
    if unique:
        seen = set()
        for name in value:
            if name in seen:
                raise InvalidHeader(f"{where} names {name!r} twice")
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
    return None if isinstance(v, str) and v in DTYPES else f"a dtype name, one of {sorted(DTYPES)}"


def _value_dtype_rule(v):
    """A value's dtype: a stored one, or complex (a host op's intermediate: an FFT's result)."""
    return None if isinstance(v, str) and v in VALUE_DTYPES else f"a dtype name, one of {sorted(VALUE_DTYPES)}"


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
    "output_site": _string, "mode": _string, "host_reason": _string,
    "table_inputs": lambda v: None if isinstance(v, list) and all(isinstance(x, str) for x in v) else
    "a list of strings",
    ("cast", "dtype"): _value_dtype_rule,
    # F of the add rule (docs/march.md §10); absent in files of spec v4, whose kernels read it as 8
    **{(op, "frac_bits"): _one_int(0) for op in ("add", "sub", "add_const")},
}
_PAIRS = (("multiplier", "shift"), ("multipliers", "shifts"))
_RANGES = (("qmin", "qmax"), ("in_qmin", "in_qmax"), ("out_qmin", "out_qmax"))


def _check_attrs(op: str, attrs: dict, where: str) -> None:
    for key, value in attrs.items():
        if not isinstance(key, str):
            raise InvalidHeader(f"{where}: attr name {_short(key)} is not a string")
        rule = _ATTR_RULES.get((op, key), _ATTR_RULES.get(key))
        problem = rule(value) if rule is not None else None
        if problem:
            raise InvalidHeader(f"{where}: attr {key!r} is {_short(value)}, expected {problem}")
    for mult, shift in _PAIRS:
        m, s = attrs.get(mult), attrs.get(shift)
        if (m is None) != (s is None) or (m is not None and len(m) != len(s)):
            raise InvalidHeader(f"{where}: attrs {mult!r} ({_short(m)}) and {shift!r} ({_short(s)}) must both be given, "
                           "with one shift per multiplier")
    for lo, hi in _RANGES:
        if lo in attrs and hi in attrs and attrs[lo] > attrs[hi]:
            raise InvalidHeader(f"{where}: attr {lo!r} ({attrs[lo]}) exceeds {hi!r} ({attrs[hi]})")


def module_from_header(header: dict, constants: dict[str, torch.Tensor]) -> Module:
    """The module the (checksum-verified) header describes, once every field is valid; raises ``InvalidHeader``.

    The checks run in the order of the header's fields (top-level fields, constants, inputs and outputs, nodes,
    value infos, input leaves, specs, meta), so the first problem of a file is the one reported; then, on a
    header valid field by field, the shapes the nodes compute (:mod:`.shapes`).
    """
    kind = _check_top_level(header)
    constants = _ordered_constants(header, constants)
    inputs, outputs = _graph_io(header, constants)
    defined = set(inputs) | set(constants)
    nodes = _nodes_from_header(header, kind, defined)
    missing = [o for o in outputs if o not in defined]
    if missing:
        raise InvalidHeader(f"graph outputs {missing[:5]} are never computed")
    values = _values_from_header(header, defined, constants)
    leaves = _leaves_from_header(header, inputs)
    _check_spec(header["input_spec"], len(leaves), "input_spec", "input leaves")
    _check_spec(header["output_spec"], len(outputs), "output_spec", "graph outputs")
    meta = _meta_from_header(header)
    _check_channel_axes(nodes, constants)
    _check_shapes(kind, nodes, inputs, constants, values)
    graph = Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, values=values)
    return Module(kind, graph, leaves, header["input_spec"], header["output_spec"], meta=meta)


#: ops whose input 1 is a scale: one per channel needs the channel's axis (per tensor, none)
_SCALED = frozenset({"quantize", "dequantize", "requantize", "fake_quant"})


def _check_channel_axes(nodes: list[Node], constants: dict[str, torch.Tensor]) -> None:
    """A per-channel scale (a constant of more than one element) comes with the integer ``axis`` of its channels:
    without it the kernels would broadcast the scale along the last dim, or fail inside torch at the call."""
    for i, node in enumerate(nodes):
        scale = constants.get(node.inputs[1]) if node.op in _SCALED and len(node.inputs) > 1 else None
        if scale is not None and scale.numel() > 1 and not _is_int(node.attrs.get("axis")):
            raise InvalidHeader(f"node #{i} '{node.op}' (op site '{node.site}') has a per-channel scale of "
                           f"{scale.numel()} elements and no integer attr 'axis' (its channels' dim), which its "
                           "kernel reads")


def _check_shapes(kind: str, nodes: list[Node], inputs: list[str], constants: dict[str, torch.Tensor],
                  values: dict[str, ValueInfo]) -> None:
    found = shape_problem(kind, nodes, inputs, constants, values)
    if found:
        i, problem = found
        node = nodes[i]
        raise InvalidHeader(f"node #{i} '{node.op}' (op site '{node.site}') {problem}")


def _check_top_level(header: dict) -> str:
    """The header's fields, its module kind (returned) and its writer."""
    _fields(header, HEADER_FIELDS, "the header")
    kind = header["kind"]
    if kind not in _LEVELS:
        raise InvalidHeader(f"its kind is {_short(kind)}, expected 'qat' or 'quantized'")
    if not isinstance(header["writer"], str):
        raise InvalidHeader(f"its writer is {_short(header['writer'])}, expected a string")
    return kind


def _ordered_constants(header: dict, constants: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors in the graph order of the header's 'constants' list, which must name exactly them."""
    names = _names(header["constants"], "'constants'")
    if set(names) != set(constants):
        missing = sorted(set(names) - set(constants))[:5]
        extra = sorted(set(constants) - set(names))[:5]
        raise InvalidHeader(f"its tensors do not match its 'constants' list (missing {missing}, unexpected {extra})")
    ordered = {name: constants[name] for name in names}
    for v in header["values"] if isinstance(header["values"], list) else []:
        # a complex constant is stored as its real view ([..., 2]); its value info names the complex dtype
        if isinstance(v, dict) and v.get("dtype") in _COMPLEX and v.get("name") in ordered:
            t = ordered[v["name"]]
            if t.dtype is not _COMPLEX[v["dtype"]][1] or t.dim() == 0 or t.shape[-1] != 2:
                raise InvalidHeader(f"constant {_short(v['name'])} is {v['dtype']} in its value info, but its tensor is "
                               f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}, not the [..., 2] real view")
            ordered[v["name"]] = torch.view_as_complex(t.contiguous())
    return ordered


#: complex dtype name -> (its torch dtype, the dtype of the real view the file stores)
_COMPLEX = {"complex64": (torch.complex64, torch.float32), "complex128": (torch.complex128, torch.float64)}


def _graph_io(header: dict, constants: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The graph's input names (unique, none a constant) and output names (an output may repeat)."""
    inputs = _names(header["inputs"], "'inputs'")
    outputs = _names(header["outputs"], "'outputs'", unique=False)
    clash = sorted(set(inputs) & set(constants))
    if clash:
        raise InvalidHeader(f"graph inputs {clash[:5]} are also constants")
    return inputs, outputs


def _list_field(header: dict, field: str) -> list:
    if not isinstance(header[field], list):
        raise InvalidHeader(f"'{field}' is not a list")
    return header[field]


# -- nodes -----------------------------------------------------------------------------------------------------------
def _nodes_from_header(header: dict, kind: str, defined: set[str]) -> list[Node]:
    """The graph's nodes; adds every node's outputs to ``defined`` (the values defined so far)."""
    return [_node(i, n, kind, defined) for i, n in enumerate(_list_field(header, "nodes"))]


def _node(i: int, n: Any, kind: str, defined: set[str]) -> Node:
    _fields(n, NODE_FIELDS, f"node #{i}")
    op, site = n["op"], n["site"]
    if not isinstance(op, str) or not isinstance(site, str):
        raise InvalidHeader(f"node #{i}: op {_short(op)} and site {_short(site)} must be strings")
    where = f"node #{i} '{op}' (op site '{site}')"
    node_inputs = _names(n["inputs"], f"{where} inputs", unique=False, allow_empty=True)
    node_outputs = _names(n["outputs"], f"{where} outputs")
    if not node_outputs:
        raise InvalidHeader(f"{where} has no outputs")
    attrs = _node_attrs(n["attrs"], where)
    _check_attrs(op, attrs, where)
    _check_op_level(op, attrs, kind, where)
    _check_def_use(node_inputs, node_outputs, defined, where)
    problem = node_problem(op, node_inputs, node_outputs, attrs, kind)
    if problem:
        raise InvalidHeader(f"{where} {problem}")
    defined.update(node_outputs)
    return Node(op, node_inputs, node_outputs, attrs, site)


def _node_attrs(raw: Any, where: str) -> dict:
    """A node's attrs, decoded from their JSON encoding (an object before and after)."""
    if not isinstance(raw, dict):
        raise InvalidHeader(f"{where}: attrs are {_short(raw)}, expected an object")
    try:
        attrs = decode_value(raw)
    except ValueError as exc:
        raise InvalidHeader(f"{where}: attrs cannot be decoded ({exc})") from None
    if not isinstance(attrs, dict):
        raise InvalidHeader(f"{where}: attrs are not an object")
    return attrs


def _check_op_level(op: str, attrs: dict, kind: str, where: str) -> None:
    """The op is an IR op, and one a module of this kind holds (or runs on the host)."""
    spec = IR_OPS.get(op)
    if spec is None:
        raise InvalidHeader(f"{where}: '{op}' is not an IR op of quantlens.march.opset (docs/ops.md lists them)")
    if spec.level not in _LEVELS[kind] and attrs.get("host") is not True and not isinstance(attrs.get("runtime"), str):
        raise InvalidHeader(f"{where}: '{op}' is a {spec.level}-level op, which a {kind} IR does not hold "
                       "(except on the host, attr host: true, or as a runtime march's kernel, attr runtime)")


def _check_def_use(node_inputs: list[str], node_outputs: list[str], defined: set[str], where: str) -> None:
    """Every value the node reads is defined before it (an empty name is an absent optional input), and every
    value it writes is new."""
    for name in node_inputs:
        if name and name not in defined:
            raise InvalidHeader(f"{where} reads undefined value {name!r} (values are defined before use)")
    for name in node_outputs:
        if name in defined:
            raise InvalidHeader(f"{where} writes {name!r}, which is already defined (each value is written once)")


# -- value infos -----------------------------------------------------------------------------------------------------
def _values_from_header(header: dict, defined: set[str], constants: dict[str, torch.Tensor]) -> dict[str, ValueInfo]:
    values: dict[str, ValueInfo] = {}
    for i, v in enumerate(_list_field(header, "values")):
        _fields(v, VALUE_FIELDS, f"value info #{i}")
        name = v["name"]
        where = f"value info #{i} ({_short(name)})"
        if not isinstance(name, str) or name not in defined:
            raise InvalidHeader(f"{where} names no value of the graph")
        if name in values:
            raise InvalidHeader(f"{where} is given twice")
        _check_value_fields(v, constants, where)
        if name in constants:
            _check_matches_constant(v, constants[name], where)
        values[name] = ValueInfo(tuple(v["shape"]), v["dtype"], v["qdtype"], v["scale"], v["axis"])
    return values


def _check_value_fields(v: dict, constants: dict[str, torch.Tensor], where: str) -> None:
    """Shape, dtype, qdtype, scale (a constant's name) and axis of one value info, in that order."""
    shape, dtype, qdtype, scale, axis = v["shape"], v["dtype"], v["qdtype"], v["scale"], v["axis"]
    if _ints(-1)(shape):
        raise InvalidHeader(f"{where}: shape {_short(shape)} is not a list of ints >= -1")
    if not isinstance(dtype, str) or dtype not in VALUE_DTYPES:
        raise InvalidHeader(f"{where}: dtype {_short(dtype)} is not a dtype name, one of {sorted(VALUE_DTYPES)}")
    if qdtype is not None and qdtype not in _QDTYPES:
        raise InvalidHeader(f"{where}: qdtype {_short(qdtype)} is not null or one of {list(_QDTYPES)}")
    if scale is not None and (not isinstance(scale, str) or scale not in constants):
        raise InvalidHeader(f"{where}: scale {_short(scale)} is not null or the name of a constant")
    if axis is not None and not _is_int(axis):
        raise InvalidHeader(f"{where}: axis {_short(axis)} is not null or an int")


def _check_matches_constant(v: dict, t: torch.Tensor, where: str) -> None:
    shape, dtype = v["shape"], v["dtype"]
    if list(t.shape) != shape or str(t.dtype).replace("torch.", "") != dtype:
        raise InvalidHeader(f"{where}: shape {shape} and dtype {dtype} differ from the constant's "
                       f"({list(t.shape)}, {str(t.dtype).replace('torch.', '')})")


# -- input structure and meta ----------------------------------------------------------------------------------------
def _leaves_from_header(header: dict, inputs: list[str]) -> list[InputLeaf]:
    """The leaves of the input structure: each graph input is fed by exactly one tensor leaf."""
    leaves = []
    fed: set[str] = set()
    for i, leaf in enumerate(_list_field(header, "input_leaves")):
        _fields(leaf, LEAF_FIELDS, f"input leaf #{i}")
        if leaf["kind"] == "tensor":
            leaves.append(_tensor_leaf(i, leaf, inputs, fed))
        elif leaf["kind"] == "const":
            leaves.append(_const_leaf(i, leaf))
        else:
            raise InvalidHeader(f"input leaf #{i} has kind {_short(leaf['kind'])}, expected 'tensor' or 'const'")
    if fed != set(inputs):
        raise InvalidHeader(f"graph inputs {sorted(set(inputs) - fed)[:5]} are no leaf of the input structure")
    return leaves


def _tensor_leaf(i: int, leaf: dict, inputs: list[str], fed: set[str]) -> InputLeaf:
    """A tensor leaf feeding a graph input not fed before (added to ``fed``)."""
    name = leaf["name"]
    if not isinstance(name, str) or name not in inputs or name in fed or leaf["value"] is not None:
        raise InvalidHeader(f"input leaf #{i} is a tensor leaf named {_short(name)}, expected a graph input "
                       "named once, with value null")
    fed.add(name)
    return InputLeaf("tensor", name)


def _const_leaf(i: int, leaf: dict) -> InputLeaf:
    if leaf["name"] is not None:
        raise InvalidHeader(f"input leaf #{i} is a const leaf with a name ({_short(leaf['name'])})")
    try:
        return InputLeaf("const", None, decode_value(leaf["value"]))
    except ValueError as exc:
        raise InvalidHeader(f"input leaf #{i}: its value cannot be decoded ({exc})") from None


def _meta_from_header(header: dict) -> dict:
    try:
        meta = decode_value(header["meta"])
    except ValueError as exc:
        raise InvalidHeader(f"its meta cannot be decoded ({exc})") from None
    if not isinstance(meta, dict):
        raise InvalidHeader("its meta is not an object")
    if SOURCE_DIGEST_KEY in meta and not is_digest(meta[SOURCE_DIGEST_KEY]):  # convert writes it: the pair checks
        raise InvalidHeader(f"its meta '{SOURCE_DIGEST_KEY}' is {_short(meta[SOURCE_DIGEST_KEY])}, expected the qat IR's "
                       "digest (64 lower-case hex digits) that convert writes")
    return meta


def _check_spec(spec: Any, leaves: int, field: str, what: str) -> None:
    if not isinstance(spec, str):
        raise InvalidHeader(f"its {field} is {_short(spec)}, expected a pytree spec string")
    try:
        tree = load_spec(spec)
        count = tree.num_leaves
    except Exception as exc:  # noqa: BLE001 - torch raises assorted errors for a broken spec
        raise InvalidHeader(f"its {field} is not a pytree spec ({type(exc).__name__}: {str(exc)[:100]})") from None
    if count != leaves:
        raise InvalidHeader(f"its {field} has {count} leaves, and the file has {leaves} {what}")
