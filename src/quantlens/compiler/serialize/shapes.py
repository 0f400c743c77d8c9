"""The shape checks of ``load``: every node's outputs have the shapes (and dtypes) its op computes from its inputs.

Nothing is declared per op where the op can say it itself: each node's shape semantics run on meta tensors
(``device="meta"``: shapes and dtypes, no data), built from the value infos of the graph inputs (a ``-1`` dim,
the dynamic batch, taken as :data:`BATCH`) and from the constants, and carried forward from node to node:

* a node of the qat IR, a host node (``host: true``) and a quantized-IR node whose integer kernel is the qat
  kernel (``IROp.shared_kernel``: data movement, indices, masks) run what the qat kernel runs: the torch op of the
  IR op (``lowering.TORCH_OPS``, a table op's custom op) with the node's attrs, else the qat kernel of its own
  (``split``, ``slice``, ``pad`` ...). Shapes and dtypes must match the value infos;
* an integer kernel of the quantized IR runs, on float meta tensors of the same shapes, the torch op of the same
  IR op (``conv2d``, ``add``, ``cat``, the table ops ...) or the one :data:`INT_SHAPES` names for an op of its
  own (``sum_int`` sums like ``sum``); shapes only (the kernel picks the storage type).

A node whose call raises (a reshape to another element count, a conv weight for other channels, operands that
do not broadcast, a cat of parts that differ off its dim ...), or whose outputs disagree with their value infos
(the rank, and every dim but a ``-1``), is reported by :func:`shape_problem`. Skipped, never guessed: a call
that needs the data (a ``NotImplementedError`` or an error about meta tensors: an index by a mask, an output
size that depends on the values), a ``host_aten`` node whose aten op fails on meta tensors, and the nodes that
read a value whose shape is unknown after a skip (a value info without a ``-1`` is taken as it is).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from quantlens.compiler.ir import Node, ValueInfo

__all__ = ["BATCH", "INT_SHAPES", "shape_problem"]

#: the size a ``-1`` dim (the dynamic batch) of a graph input takes: the batch export traces a dynamic IR at
BATCH = 2
_META = "meta"
#: integer storage types, computed as float32 for the shape of an integer kernel
_STORAGE = (torch.int8, torch.int16, torch.int32, torch.uint8)


def _same_shape(q: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty_like(q)


def _bilinear(q: torch.Tensor, a_h: torch.Tensor, a_w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(torch.matmul(a_h, q), a_w.t())  # the integer kernel's A_h · q · A_wᵀ


#: quantized-IR ops whose integer kernel has no torch op of the same IR op: the IR op whose qat semantics give
#: their output shape (run with the node's attrs), or a function of the (float meta) inputs
INT_SHAPES: dict[str, str | Callable[..., torch.Tensor]] = {
    "sum_int": "sum", "cumsum_int": "cumsum", "avg_pool2d_int": "avg_pool2d", "avg_pool2d_div_int": "avg_pool2d",
    "avg_pool1d_int": "avg_pool1d", "pad_int": "pad", "masked_fill_int": "masked_fill", "abs_int": "abs",
    "neg_int": "neg", "fill_int": "fill", "bilinear_int": _bilinear,
    # a rescale of its first input (clamp: its bounds are codes, not aten.clamp's min / max attrs)
    **dict.fromkeys(("quantize", "dequantize", "requantize", "scale", "add_const", "prelu_int", "channel_affine",
                     "clamp", "channel_shift"), _same_shape),
}


def _meta(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=_META)


def _from_info(info: ValueInfo | None, dynamic_ok: bool) -> torch.Tensor | None:
    """A meta tensor for a value info (``None`` when there is none, or when its ``-1`` dims cannot be trusted to
    be the batch)."""
    dtype = _dtype(info)
    if dtype is None or (-1 in info.shape and not dynamic_ok):
        return None
    return _meta([BATCH if d == -1 else d for d in info.shape], dtype)


def _dtype(info: ValueInfo | None) -> torch.dtype | None:
    dtype = getattr(torch, info.dtype, None) if info is not None else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _text(t: Any) -> str:
    if t is None:
        return "absent"
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _info_text(info: ValueInfo | None, dtype: bool = True) -> str:
    if info is None:
        return "no value info"
    return f"{list(info.shape)}" + (f" {info.dtype}" if dtype else "")


#: what computes a node's outputs on meta tensors, and the attrs it reads (``None``: any of them)
_Call = tuple[Callable[[list], Any], "tuple[str, ...] | None"]


def _qat_call(node: Node) -> _Call | None:
    """What the qat kernel of ``node`` computes: its torch op with its attrs, else its own qat kernel."""
    from quantlens.compiler.kernels_qat import QAT_KERNELS, call_torch_op
    from quantlens.compiler.op_meanings import torch_op_of
    from quantlens.kernels.integer.aten_call import ATTR_ALIASES, arg_plan

    torch_op = torch_op_of(node.op)
    if torch_op is not None:
        reads = tuple(name for name, kind in arg_plan(torch_op) if kind == "attr")
        return (lambda inputs: call_torch_op(torch_op, node, inputs)), reads + tuple(
            ATTR_ALIASES[name] for name in reads if name in ATTR_ALIASES)
    kernel = QAT_KERNELS.get(node.op)
    if kernel is None:
        return None
    return (lambda inputs: kernel(node, inputs)), None


def _int_call(node: Node) -> _Call | None:
    """The shape of ``node``'s integer kernel: its op's (or :data:`INT_SHAPES`'s) qat semantics on float meta
    tensors of the same shapes."""
    rule = INT_SHAPES.get(node.op, node.op)
    if callable(rule):
        return (lambda inputs: rule(*_floats(inputs))), ()
    found = _qat_call(Node(rule, node.inputs, node.outputs, node.attrs, node.site))
    if found is None:
        return None
    call, reads = found
    return (lambda inputs: call(_floats(inputs))), reads


def _floats(inputs: list) -> list:
    return [t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype in _STORAGE else t for t in inputs]


def _semantics(kind: str, node: Node) -> tuple[_Call | None, bool]:
    """``(call, exact)``: what computes the node's outputs on meta tensors (``None``: nothing reliable), and
    whether it is its kernel's own computation (dtypes then count too)."""
    from quantlens.march.opset import IR_OPS

    spec = IR_OPS.get(node.op)
    if spec is None:
        return None, False
    if kind == "qat" or node.attrs.get("host") is True or spec.shared_kernel:
        return _qat_call(node), True
    return _int_call(node), False


def _needs_data(node: Node, exc: Exception) -> bool:
    """A meta call that failed for want of the data (or of a meta kernel), not for a shape."""
    return node.op == "host_aten" or isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


def _outputs(result: Any) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _fits(out: torch.Tensor, info: ValueInfo, exact: bool) -> bool:
    if out.dim() != len(info.shape) or any(e != -1 and e != g for e, g in zip(info.shape, out.shape)):
        return False
    return not exact or str(out.dtype).replace("torch.", "") == info.dtype


def _carried(out: torch.Tensor, info: ValueInfo | None, node: Node, exact: bool) -> torch.Tensor:
    """The computed output as the nodes after it read it: an integer kernel's in its storage type (the value
    info's, else its ``out_dtype``'s)."""
    if exact:
        return out
    if _dtype(info) is not None:
        return _meta(out.shape, _dtype(info))
    out_dtype = node.attrs.get("out_dtype")
    if out_dtype in ("qint8", "qint16", "qint32"):
        return _meta(out.shape, getattr(torch, "int" + out_dtype[4:]))
    return out


class _Env:
    """Meta tensors of the values computed so far (``None``: shape unknown), the constants' made on first use."""

    def __init__(self, inputs: list[str], constants: dict[str, torch.Tensor], values: dict[str, ValueInfo]):
        self.constants, self.values = constants, values
        self.tensors: dict[str, torch.Tensor | None] = {name: _from_info(values.get(name), True) for name in inputs}
        self.dynamic = any(-1 in values[name].shape for name in inputs if name in values)

    def get(self, name: str) -> torch.Tensor | None:
        if name not in self.tensors:
            c = self.constants[name]
            self.tensors[name] = _meta(c.shape, c.dtype)
        return self.tensors[name]

    def skip(self, node: Node) -> None:
        """The node's outputs as their value infos say, where those need no batch (else unknown)."""
        for name in node.outputs:
            self.tensors[name] = _from_info(self.values.get(name), False)


def shape_problem(kind: str, nodes: list[Node], inputs: list[str], constants: dict[str, torch.Tensor],
                  values: dict[str, ValueInfo]) -> tuple[int, str] | None:
    """The first node (its index) whose shapes are inconsistent, and what is wrong with it as the end of a
    sentence that starts with the node; ``None`` when every node checked fits. The graph's names are valid (the
    header checks before this one)."""
    env = _Env(inputs, constants, values)
    for i, node in enumerate(nodes):
        args = [env.get(name) if name else None for name in node.inputs]
        call, exact = _semantics(kind, node)
        if call is None or any(a is None for name, a in zip(node.inputs, args) if name):
            env.skip(node)
            continue
        try:
            outs = _computed(kind, node, call, args, exact)
        except Exception as exc:  # noqa: BLE001 - any failure of the op on these shapes is the finding
            if _needs_data(node, exc):
                env.skip(node)
                continue
            return i, _call_problem(env, node, args, exc)
        problem = _check_outputs(env, node, outs, exact)
        if problem:
            return i, problem
    return None


#: (kind, op, the attrs it reads, input types) -> the types of the outputs (``None``: not a tensor): the same op on
#: the same types computes the same, and meta kernels are Python (tens to hundreds of microseconds a call), so a
#: graph's repeated layers (whose requantize attrs differ), and a module checked by ``save`` then ``load``, run
#: each once
_COMPUTED: dict[tuple, list] = {}
_COMPUTED_MAX = 4096


def _computed(kind: str, node: Node, call: _Call, args: list, exact: bool) -> list:
    run, reads = call
    attrs = node.attrs if reads is None else {k: node.attrs[k] for k in reads if k in node.attrs}
    key = (kind, exact, node.op, repr(attrs), tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args))
    types = _COMPUTED.get(key)
    if types is None:
        types = [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else None for t in _outputs(run(args))]
        if len(_COMPUTED) >= _COMPUTED_MAX:
            _COMPUTED.clear()
        _COMPUTED[key] = types
    return [None if t is None else _meta(*t) for t in types]


def _inputs_text(env: _Env, node: Node, args: list) -> str:
    parts = [f"{name or '(absent)'} {_text(a) if name else ''}".rstrip() for name, a in zip(node.inputs, args)]
    batch = f" (the dynamic batch -1 taken as {BATCH})" if env.dynamic else ""
    return f"[{', '.join(parts)}]{batch}"


def _call_problem(env: _Env, node: Node, args: list, exc: Exception) -> str:
    message = (str(exc).strip().splitlines() or [""])[0][:240]
    expected = ", ".join(f"{name} {_info_text(env.values.get(name))}" for name in node.outputs)
    return (f"does not fit the shapes of its inputs {_inputs_text(env, node, args)}: its op raises "
            f"{type(exc).__name__}: {message} (its outputs are recorded as {expected}); the value infos or attrs "
            "are inconsistent")


def _check_outputs(env: _Env, node: Node, outs: list, exact: bool) -> str | None:
    """Compare the computed outputs with the value infos, and carry them forward."""
    if len(outs) != len(node.outputs):
        return f"computes {len(outs)} outputs, and it has {len(node.outputs)}"
    for name, out in zip(node.outputs, outs):
        info = env.values.get(name)
        if not isinstance(out, torch.Tensor):
            env.tensors[name] = _from_info(info, False)
            continue
        if info is not None and not _fits(out, info, exact):
            what = "shape and dtype" if exact else "shape"
            any_size = " (-1: any size)" if -1 in info.shape else ""
            return (f"computes its output {name!r} as {_text(out) if exact else list(out.shape)} from its inputs "
                    f"{_inputs_text(env, node, [env.get(n) if n else None for n in node.inputs])}, and its value "
                    f"info records {_info_text(info, exact)}{any_size}; expected the {what} its op computes")
        env.tensors[name] = _carried(out, info, node, exact)
    return None
