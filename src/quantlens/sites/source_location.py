"""Where the user's code called an op: the innermost frame outside torch and quantlens' own machinery (a leaf of
the op-site capture: the tracer, the record, the runtime and the decompositions all name source lines)."""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_source_location", "is_within", "TORCH_DIR", "MACHINERY_DIRS", "ForwardTracer"]


_QUANTLENS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: quantlens' own machinery that runs inside a traced forward: the op-site capture and the quantization stage
MACHINERY_DIRS = (os.path.join(_QUANTLENS_DIR, "sites"), os.path.join(_QUANTLENS_DIR, "quantization"))
_SKIP_DIRS = (*MACHINERY_DIRS, os.path.join(_QUANTLENS_DIR, "profiler"), TORCH_DIR)


def is_within(filename: str, dirs: tuple[str, ...] | str) -> bool:
    """Whether ``filename`` lies inside one of ``dirs``. Compares whole path components, so user code in
    ``site-packages/torchcrepe/`` is not inside ``site-packages/torch``."""
    path = os.path.abspath(filename)
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep)
               for d in ((dirs,) if isinstance(dirs, str) else dirs))


def user_source_location() -> str:
    """``file:line`` of the innermost frame outside torch and quantlens' own machinery (the user's code)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<") and not is_within(filename, _SKIP_DIRS):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


class ForwardTracer:
    """The type of the ``tracer`` argument a decomposition (rnn, norms) receives: the ``OpSiteTracer`` running the
    forward (named here so that the decompositions, which the tracer imports, need not import it back)."""

