"""The one registry of ``to_onnx``'s converters, ``ONNX_CONVERTERS``, keyed by IR op.

A converter ``fn(b, node)`` writes the ONNX nodes of one IR node into the :class:`~.builder._Builder` ``b``;
register one with ``@onnx_converter("op", ...)``. Every op family module of this package registers here, and the
package imports them all; the mapping table is in ``docs/ir.md``.
"""

from __future__ import annotations

from quantlens._registry import make_registry

__all__ = ["ONNX_CONVERTERS", "onnx_converter"]

#: IR op -> converter ``fn(builder, node)`` that writes its ONNX nodes. ``@onnx_converter(op, ...)`` registers
#: one (a user's converter may replace a built-in one on purpose).
ONNX_CONVERTERS, onnx_converter = make_registry("ONNX converter for IR op", replace=True)
