"""One small progress-bar helper for the profiler's long loops (bad-case search, sensitivity ablation).

The profiler never prints; the only console output is this optional rich progress bar, which callers switch
off with ``progress=False`` (tests, scripts that parse stdout).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["progress_iter"]


def progress_iter(items: Iterable[T], description: str, total: int | None = None, enabled: bool = True,
                  steps: Callable[[T], int] | None = None) -> Iterator[T]:
    """Yield ``items``, showing a rich progress bar on stderr when ``enabled``.

    ``total`` defaults to ``len(items)`` when the iterable has a length; unknown totals show a spinner-style
    bar that counts steps. ``steps(item)``: how many steps one item counts for (default 1), e.g. the quantizers
    of a shared ablation forward.
    """
    if not enabled:
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # transient: the bar disappears when done, so logs and captured output stay clean.
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task, 1 if steps is None else steps(item))
