"""The first ranking of the candidates: a table you pass, or the profiler's one-quantizer-at-a-time
sensitivity of the base model (kept in the progress file, so that a resumed search does not profile again)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from quantlens.search.progress import Progress
from quantlens.search.promotion import Promotion, as_promotion

__all__ = ["initial_ranking", "first_ranking"]


def initial_ranking(model: nn.Module, base_prepared: nn.Module, example_inputs: Any,
                    candidates: Sequence[Promotion], ranking: Any, out_dir: Path) -> list[Promotion]:
    """Candidates in the order of ``ranking`` (a sensitivity table / result, or promotions); the rest after it in
    execution order. ``None``: the profiler's sensitivity of the base model on ``example_inputs``."""
    if ranking is None:
        ranking = _profiled(model, base_prepared, example_inputs, out_dir)
    tables = list(ranking)
    if tables and not (isinstance(tables[0], (Sequence,)) and not isinstance(tables[0], (str, tuple))):
        tables = [tables]
    best: dict[Promotion, tuple[int, int]] = {}
    for t, table in enumerate(tables):
        for rank, row in enumerate(table):
            kind = row.get("sensitive_type") if isinstance(row, dict) else getattr(row, "sensitive_type", None)
            if kind == "lut":
                continue
            p = as_promotion(row)
            best[p] = min(best.get(p, (rank, t)), (rank, t))
    ranked = sorted((c for c in candidates if c in best), key=lambda c: best[c])
    return ranked + [c for c in candidates if c not in best]


def _profiled(model: nn.Module, base_prepared: nn.Module, example_inputs: Any, out_dir: Path) -> Any:
    """The profiler's sensitivity of ``base_prepared`` on ``example_inputs`` (files in ``out_dir/sensitivity``)."""
    # imported here: a search with its own ranking never loads the profiler
    from quantlens.profiler import QuantAnalysis

    qa = QuantAnalysis(model, base_prepared, "fake_quant", out_dir=str(out_dir / "sensitivity"))
    qa.set_bad_case(example_inputs)
    return qa.sensitivity()


def first_ranking(given: list[Promotion] | None, progress: Progress,
                  profile: Callable[[], list[Promotion]]) -> list[Promotion]:
    """``given`` (the caller's ranking); else the profiler's ranking saved by an earlier run with the same inputs;
    else ``profile()``, saved to the progress file."""
    if given is not None:
        return given
    if progress.data.get("ranking") is not None:
        return [Promotion(**p) for p in progress.data["ranking"]]
    ranked = profile()
    progress.data["ranking"] = [asdict(p) for p in ranked]
    progress.save()
    return ranked
