"""The quantized IR's kernel table: IR nodes onto the integer kernels of :mod:`quantlens.kernels.integer`.

The kernels (the bit-exact simulator of ``docs/march.md``) take tensors and plain parameters,
``kernel(inputs, attrs, site)``; this module gives each the interpreter's signature ``(node, inputs)`` (the
node's attrs and op site), and adds what only the IR has: host nodes (float post-processing after the boundary,
run by the qat kernels) and the data-movement ops whose integer kernel is the qat kernel.
"""

from __future__ import annotations

from typing import Any, Callable

from quantlens.compiler.graph import Node
from quantlens.compiler.kernels_qat import QAT_KERNELS, call_torch_op, qat_dispatch
from quantlens.compiler.op_meanings import TORCH_OPS
from quantlens.errors import QuantLensError
from quantlens.kernels.integer import INT_KERNELS as _KERNELS
from quantlens.kernels.integer import REFERENCE_TABLE_KERNELS, RUNTIME_KERNELS, storage_dtype
from quantlens.march.opset import ops_in

__all__ = ["INT_KERNELS", "int_dispatch", "storage_dtype", "node_kernel"]


def node_kernel(kernel: Callable[..., Any]) -> Callable[[Node, list], Any]:
    """``kernel(inputs, attrs, site)`` as a kernel of IR nodes, ``(node, inputs)``."""

    def run(node: Node, inputs: list) -> Any:
        return kernel(inputs, node.attrs, node.site)

    run.__name__ = run.__qualname__ = getattr(kernel, "__name__", "kernel")
    run.__doc__ = kernel.__doc__
    return run


def _table_kernel(node: Node, inputs: list) -> Any:
    """A table node through its reference kernel (the custom op on the dequantized inputs)."""
    return REFERENCE_TABLE_KERNELS[node.op](inputs, node.attrs, node.site)


#: IR op -> its integer kernel on IR nodes, ``kernel(node, inputs)`` (register new kernels in
#: ``quantlens.kernels.integer.INT_KERNELS``, with ``quantlens.kernels.integer.int_kernel``)
INT_KERNELS: dict[str, Callable[[Node, list], Any]] = {
    op: _table_kernel if kernel is REFERENCE_TABLE_KERNELS.get(op) else node_kernel(kernel)
    for op, kernel in _KERNELS.items()
}


#: ops whose integer kernel is the qat kernel (data movement, indices and masks), from the op set.
_MOVEMENT = ops_in(shared_kernel=True)


def int_dispatch(node: Node, inputs: list) -> Any:
    """Run one quantized IR node: a host node by its qat kernel, any other by its integer kernel (data movement:
    the qat kernel, which moves integers as it moves floats)."""
    if node.attrs.get("host"):  # float post-processing after the boundary
        return qat_dispatch(node, inputs)
    runtime = node.attrs.get("runtime")
    if runtime is not None:  # a runtime march's kernel (March.ORT_CPU)
        kernels = RUNTIME_KERNELS.get(runtime)
        if kernels is None or node.op not in kernels:
            raise QuantLensError(f"quantized IR: no kernel of runtime {runtime!r} for op '{node.op}' (op site "
                                 f"'{node.site}'); known runtimes: {sorted(RUNTIME_KERNELS)}.")
        return kernels[node.op](inputs, node.attrs, node.site)
    kernel = INT_KERNELS.get(node.op)
    if kernel is not None:
        return kernel(node, inputs)
    kernel = _KERNELS.get(node.op)  # registered after this table was made
    if kernel is not None:
        return kernel(inputs, node.attrs, node.site)
    # Pure data movement (reshape, permute, slice, gather, embedding ...) has the same kernel on integers.
    if node.op in _MOVEMENT:
        return QAT_KERNELS[node.op](node, inputs) if node.op in QAT_KERNELS else call_torch_op(
            TORCH_OPS[node.op], node, inputs
        )
    raise QuantLensError(f"quantized IR: no integer kernel for op '{node.op}' (op site '{node.site}').")
