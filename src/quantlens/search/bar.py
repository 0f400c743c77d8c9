"""The search's progress bar (rich): one task, its description saying what is being measured."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["SearchBar"]


class SearchBar:
    """A context manager around one rich task of ``total`` steps; ``enabled=False`` shows nothing."""

    def __init__(self, total: int, enabled: bool, label: str = "mixed precision"):
        self._bar = Progress(TextColumn(f"[bold]{label}[/] {{task.description}}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(), disable=not enabled, transient=False)
        self._total = total
        self._task = None

    def __enter__(self) -> SearchBar:
        self._bar.__enter__()
        self._task = self._bar.add_task("step 1", total=self._total)
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def show(self, text: str, completed: int | None = None) -> None:
        """Describe the current measurement (and move the bar to ``completed`` steps when given)."""
        if completed is None:
            self._bar.update(self._task, description=text)
        else:
            self._bar.update(self._task, description=text, completed=completed)
