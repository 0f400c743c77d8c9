"""Index-producing ops during sensitivity: take the baseline's indices.

When one quantizer is switched on, a ``topk``/``sort``/``max(dim)`` or ``argmax`` downstream may pick a
different element than the baseline did. That index flip changes the output far more than the quantizer's
rounding does, and would swamp the ranking. So, while ablating, these ops take the **baseline's indices** and
gather their values from the analysis model's own input: the values still carry the quantization error, the
selection does not.

* ``topk``, ``sort``, ``max``/``min`` with a ``dim`` are op sites; :func:`substitute_indices` rewrites
  their ``(values, indices)`` result.
* ``argmax``/``argmin``/``argsort`` return only indices and get no op site name (they have no float output).
  :class:`IndexOpMode` names their calls ``argmax#k`` (k-th call in the forward) and records or replaces them.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from quantlens.march.opset import OPS, Category
from quantlens.sites import tracer
from quantlens.sites.op_rules import canonical_op_name
from quantlens.sites.source_location import MACHINERY_DIRS

__all__ = ["substitute_indices", "IndexOpMode", "INDEX_ONLY_OPS"]

#: ops whose whole result is an index tensor (the op set's index ops that produce indices)
INDEX_ONLY_OPS = tuple(sorted(n for n, op in OPS.items() if op.category is Category.INDEX and op.index_producing))


def _int_arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    if len(args) > pos and isinstance(args[pos], int) and not isinstance(args[pos], bool):
        return args[pos]
    return default


def _bool_arg(args: tuple, kwargs: dict, pos: int, name: str, default: bool) -> bool:
    if name in kwargs:
        return bool(kwargs[name])
    if len(args) > pos and isinstance(args[pos], bool):
        return args[pos]
    return default


# op type -> (dim, keepdim) read from the call; values keep the input's rank when keepdim is True.
_DIM_OF: dict[str, Callable[[tuple, dict], tuple[int | None, bool]]] = {
    "topk": lambda a, k: (_int_arg(a, k, 2, "dim", -1), True),
    "sort": lambda a, k: (_int_arg(a, k, 1, "dim", -1), True),
    "max": lambda a, k: (_int_arg(a, k, 1, "dim", None), _bool_arg(a, k, 2, "keepdim", False)),
    "min": lambda a, k: (_int_arg(a, k, 1, "dim", None), _bool_arg(a, k, 2, "keepdim", False)),
}


def substitute_indices(op_type: str, args: tuple, kwargs: dict, output: Any, baseline: list[torch.Tensor]) -> Any:
    """``output`` of an index-producing op site, with the baseline's indices and values gathered from the
    op's own input. Returns ``output`` unchanged when the call has no ``(values, indices)`` result or the
    baseline's indices do not fit (different shape)."""
    reader = _DIM_OF.get(op_type)
    if reader is None or not isinstance(output, tuple) or type(output) is tuple or len(output) != 2:
        return output
    source = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input")
    dim, keepdim = reader(args, kwargs)
    base_idx = next((t for t in baseline if not t.is_floating_point()), None)
    if dim is None or source is None or base_idx is None or base_idx.shape != output[1].shape:
        return output
    idx = base_idx.to(device=source.device, dtype=torch.int64)
    gather_idx = idx if keepdim else idx.unsqueeze(dim)
    values = torch.gather(source, dim, gather_idx)
    if not keepdim:
        values = values.squeeze(dim)
    return type(output)((values.to(output[0].dtype), idx.to(output[1].dtype)))


_PROFILER_DIR = os.path.dirname(os.path.abspath(__file__))


_PASS_THROUGH = (os.path.abspath(tracer.__file__), os.path.abspath(__file__))


def _called_from_model_code() -> bool:
    """Whether the innermost caller outside torch and the tracers' pass-through frames is the model's code
    (not quantlens' own machinery, such as an observer that happens to use argmin)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<") and not tracer.is_within(filename, tracer.TORCH_DIR) and \
                filename not in _PASS_THROUGH:
            return not tracer.is_within(filename, (_PROFILER_DIR, *MACHINERY_DIRS))
        frame = frame.f_back
    return False


class IndexOpMode(TorchFunctionMode):
    """Records (``recorded`` is filled) or replaces (``replace`` is given) the results of argmax-like calls.

    Enter it outside the model call: the op-site tracer passes these unnamed ops through to it.
    """

    def __init__(self, replace: dict[str, list[torch.Tensor]] | None = None,
                 on_record: Callable[[str, torch.Tensor], None] | None = None):
        super().__init__()
        self.replace = replace
        self.on_record = on_record
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        op = canonical_op_name(func)
        if op not in INDEX_ONLY_OPS or not args or not isinstance(args[0], torch.Tensor):
            return result
        if not args[0].is_floating_point() or not _called_from_model_code():
            return result
        name = f"{op}#{self.counts[op]}"
        self.counts[op] += 1
        if self.on_record is not None:
            self.on_record(name, result)
        if self.replace is not None:
            base = self.replace.get(name)
            if base and base[0].shape == result.shape:
                return base[0].to(device=result.device, dtype=result.dtype)
        return result
