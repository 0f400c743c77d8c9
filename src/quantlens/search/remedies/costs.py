"""Each kept remedy's latency cost: the quantized IR's latency estimate (the march's cost model,
``IRModule.latency_estimate``) before and after it, for ``search_remedies(latency=True)``."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Sequence

from torch import nn

from quantlens.quantization import calibrate, prepare

__all__ = ["latency_cycles", "kept_cycles"]


def latency_cycles(model: nn.Module, example: Any, batches: list, setter: Any) -> int:
    """The quantized IR's latency estimate of ``model`` under ``setter``, in cycles."""
    from quantlens.compiler import convert, export

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, example, setter, check_result_dir=None, allow_no_stubs=True), batches)
        return int(convert(export(prepared, example)).latency_estimate().cycles)


def kept_cycles(trials: Sequence[Any], configs: Sequence[tuple[nn.Module, Any]], base: tuple[nn.Module, Any],
                example: Any, batches: list) -> tuple[list[Any], tuple[int, int]]:
    """The trials with ``cycles`` (before, after) set on each kept one, and the (base, result) cycles.

    ``configs[i]`` is the ``(model, setter)`` after the i-th kept trial (the last one is the result; none kept:
    the result is ``base``); a kept trial's "before" is the configuration after the kept trial before it (the
    first's: ``base``)."""
    kept = [i for i, t in enumerate(trials) if t.kept]
    if len(kept) != len(configs):
        raise ValueError(f"kept_cycles: {len(kept)} kept trials but {len(configs)} configurations.")
    before = latency_cycles(base[0], example, batches, base[1])
    first, out = before, list(trials)
    for i, (model, setter) in zip(kept, configs):
        after = latency_cycles(model, example, batches, setter)
        out[i] = replace(out[i], cycles=(before, after))
        before = after
    return out, (first, before)
