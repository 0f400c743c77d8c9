"""The two traces a ``QuantAnalysis`` compares, opened and checked to belong together (:func:`open_trace_pair`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from quantlens.errors import QuantLensError
from quantlens.profiler.trace.reader import TraceReader

__all__ = ["open_trace_pair"]


def open_trace_pair(readers: dict[Path, TraceReader], base_dir: Path, analy_dir: Path, bad_case_digest: str | None,
                    reader: Callable[[Path], TraceReader] = TraceReader) -> tuple[TraceReader, TraceReader]:
    """The baseline and analysis traces in ``base_dir`` / ``analy_dir``: the reader ``run()`` opened on a folder
    (``readers``) while its ``trace.json`` is the file it read, else a fresh one (``reader(folder)``). Refused,
    naming the folder: a folder without a trace, the other model's trace, two traces of different bad cases, or
    traces of another bad case than ``bad_case_digest`` (the QuantAnalysis' current one; None: no bad case set)."""
    traces = []
    for label, folder in (("baseline", base_dir), ("analysis", analy_dir)):
        opened = readers.get(Path(folder))
        try:
            trace = opened if opened is not None and opened.unchanged() else reader(folder)
        except QuantLensError as exc:  # names the folder (missing folder, no trace.json, old format)
            raise QuantLensError(
                f"{exc} (the {label} trace{'' if folder.is_dir() else '; the folder does not exist'}: "
                f"set_model_profiler_dir() takes the '{label}_model' folder of a run()'s out_dir)") from None
        if trace.label != label:
            raise QuantLensError(
                f"The {label} trace folder {folder} holds the trace of the {trace.label} model "
                f"({trace.description}), not of the {label} model. set_model_profiler_dir(baseline_dir, "
                "analysis_dir) takes the baseline folder first.")
        traces.append(trace)
    base, analy = traces
    if base.input_digest != analy.input_digest:
        raise QuantLensError(
            f"The traces were made on different bad cases: the baseline trace in {base_dir} and the analysis "
            f"trace in {analy_dir} hold different model inputs, so their op sites cannot be compared. Trace "
            "both models on one bad case (qa.run()) and compare those folders.")
    if bad_case_digest is not None and base.input_digest != bad_case_digest:
        raise QuantLensError(
            f"The traces in {base_dir} and {analy_dir} were made on another bad case than this QuantAnalysis's "
            "current one. Re-run qa.run() on the current bad case, or compare them from a QuantAnalysis without "
            "a bad case (or after load_bad_case() from that run's out_dir).")
    return base, analy
