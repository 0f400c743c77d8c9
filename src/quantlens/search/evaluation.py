"""The caller's ``evaluate``: called on a calibrated configuration, its value checked by one rule that both
searches (remedies, mixed precision) apply: one finite number, or a :class:`EvaluateError` that names the
configuration and what went wrong.

A non-finite value or something that is not a number (a tensor of several elements, a string, None) is never
compared, ranked or replayed: ``inf`` would "reach" any target and NaN would lose every comparison, so a search
would end with a verdict its metric never gave. An ``evaluate`` that raises is reported the same way, with its
error.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import torch

from quantlens.errors import QuantLensError

__all__ = ["EvaluateError", "EVALUATE_ERRORS", "metric_value", "call_evaluate"]

#: what the caller's ``evaluate`` may raise that the search reports as its failure (the user's code: a wrong
#: shape, a missing attribute, a file it reads); anything else (KeyboardInterrupt, a test's own exception) passes
EVALUATE_ERRORS = (ArithmeticError, AssertionError, AttributeError, ImportError, LookupError, NameError,
                   NotImplementedError, OSError, RuntimeError, TypeError, ValueError, QuantLensError)


class EvaluateError(QuantLensError):
    """``evaluate`` failed on a configuration, or returned something other than one finite number: ``problem``
    says how (``"returned nan"``, ``"raised RuntimeError: ..."``), ``configuration`` which one."""

    def __init__(self, problem: str, configuration: str):
        self.problem, self.configuration = problem, configuration
        super().__init__(f"evaluate(prepared) {problem} on the configuration {configuration}; it must return one "
                         "finite number (a float, or a one-element tensor) for a calibrated model. Fix evaluate "
                         "(run it on that configuration yourself to see why).")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def metric_value(value: Any, configuration: str) -> float:
    """``value`` (what ``evaluate`` returned on ``configuration``) as a finite float, or :class:`EvaluateError`."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise EvaluateError(f"returned a tensor of {value.numel()} elements (shape {tuple(value.shape)})",
                                configuration)
        if value.is_complex():
            raise EvaluateError(f"returned a complex tensor ({_short(value)})", configuration)
        value = value.detach().reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EvaluateError(f"returned {_short(value)} ({type(value).__name__}), not a number", configuration)
    number = float(value)
    if not math.isfinite(number):
        raise EvaluateError(f"returned {number}", configuration)
    return number


def call_evaluate(evaluate: Callable[[Any], Any], prepared: Any, configuration: str) -> float:
    """``evaluate(prepared)`` without gradients, checked by :func:`metric_value`; an error it raises (one of
    :data:`EVALUATE_ERRORS`) becomes an :class:`EvaluateError` naming ``configuration``."""
    try:
        with torch.no_grad():
            raw = evaluate(prepared)
    except EVALUATE_ERRORS as exc:
        lines = str(exc).strip().splitlines()
        raise EvaluateError(f"raised {type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": "),
                            configuration) from exc
    return metric_value(raw, configuration)
