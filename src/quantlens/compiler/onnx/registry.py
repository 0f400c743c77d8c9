"""The one registry of ``to_onnx``'s converters, ``ONNX_CONVERTERS``, keyed by IR op.

A converter ``fn(b, node)`` writes the ONNX nodes of one IR node into the :class:`~.builder._Builder` ``b``;
register one with ``@onnx_converter("op", ...)``. Every op family module of this package registers here, and the
package imports them all; the mapping table is in ``docs/ir.md``.
"""

from __future__ import annotations

from typing import Callable

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.builder import _Builder

__all__ = ["ONNX_CONVERTERS", "onnx_converter"]

#: IR op -> converter ``fn(builder, node)`` that writes its ONNX nodes
ONNX_CONVERTERS: dict[str, Callable[["_Builder", Node], None]] = {}


def onnx_converter(*ops: str):
    """Decorator: register the decorated ``fn(builder, node)`` as the ONNX converter of each IR op in ``ops``
    (replacing an earlier one)."""
    def register(fn):
        for op in ops:
            ONNX_CONVERTERS[op] = fn
        return fn

    return register
