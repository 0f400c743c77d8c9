"""Fused GEMM + elementwise torch ops as the NPU computes them: ``baddbmm`` (BLOOM's attention scores with the
ALiBi bias) is ``beta · input + alpha · (batch1 @ batch2)``, which the march runs as a GEMM (its own output grid),
a scale by a constant and an add. The op set declares it ``COMPOSITE`` and the tracer runs the decomposition below:
``matmul_k``, ``mul_k`` (when alpha or beta is not 1) and ``add_k`` are ordinary op sites of the calling module."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["GEMM_DECOMPOSED_FUNCTIONS", "baddbmm"]


def baddbmm(tracer, input: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: float = 1,
            alpha: float = 1, out: Any = None) -> torch.Tensor:
    """``beta · input + alpha · (batch1 @ batch2)``; beta = 0 ignores ``input`` (NaN included), as torch does."""
    product = torch.matmul(batch1, batch2)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return (input if beta == 1 else input * beta) + product


#: canonical op name -> decomposition ``fn(tracer, *args, **kwargs)`` (merged into the tracer's
#: ``quantlens.sites.rnn.DECOMPOSED_FUNCTIONS``); their op types are ``COMPOSITE`` in the op set.
GEMM_DECOMPOSED_FUNCTIONS: dict[str, Callable[..., Any]] = {"baddbmm": baddbmm}
