"""Whether torch.export is really tracing.

Every traced forward of a prepared model answers ``torch.compiler.is_compiling()`` / ``is_exporting()`` with True,
so libraries take the branch export takes (see :class:`~quantlens.sites.tracer.OpSiteTracer`). quantlens'
own code must still tell a real export from such a forward (a table checks its scales eagerly, not while traced):
the tracer keeps the real answers here.
"""

from __future__ import annotations

import torch

__all__ = ["export_tracing", "enter_traced_forward", "leave_traced_forward"]

_real: list[bool] = []  # the real is_compiling() of each traced forward now running, innermost last


def export_tracing() -> bool:
    """True while torch.export (or torch.compile) traces, whatever a traced forward made the flags say."""
    return _real[-1] if _real else torch.compiler.is_compiling()


def enter_traced_forward() -> tuple[bool, bool]:
    """Record the real state, set the flags a traced forward shows; returns the flags to restore."""
    saved = (torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag)
    _real.append(export_tracing())
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    return saved


def leave_traced_forward(saved: tuple[bool, bool]) -> None:
    _real.pop()
    torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = saved
