"""One model's traced run for :meth:`QuantAnalysis.run <quantlens.profiler.quant_analysis.QuantAnalysis.run>`:
its forward on the bad case streamed to a trace folder, the rows computed on the way, its statistics written."""

from __future__ import annotations

from pathlib import Path

import torch

from quantlens.errors import QuantLensError
from quantlens.profiler.bad_case_shapes import explain_shape_error
from quantlens.profiler.fingerprint import model_digest
from quantlens.profiler.model_access import SiteEvent
from quantlens.profiler.outputs import named_outputs, unique_name
from quantlens.profiler.reach import ReachTee, SiteReach
from quantlens.profiler.report import write_statistic
from quantlens.profiler.row_stream import RowStream
from quantlens.profiler.trace.format import STATISTIC_FILE
from quantlens.profiler.trace.reader import TraceReader
from quantlens.profiler.trace.stats import input_digest
from quantlens.profiler.trace.writer import TraceWriter

__all__ = ["trace_model"]


def trace_model(qa, access, directory: Path, same_input=None, values_not_needed: frozenset[str] = frozenset(),
                hold_bytes: int = 0) -> tuple[TraceReader, list[str]]:
    """Trace ``access`` on the bad case of the QuantAnalysis ``qa`` into ``directory`` (:meth:`QuantAnalysis.run`
    runs it per model); returns the trace and the compared outputs' names. ``same_input``: the baseline trace that
    the analysis model's same-input outputs read."""
    # the analysis run computes compare_per_layer()'s rows on its writer thread as it goes (row_stream)
    stream = RowStream(same_input, qa.analysis_type.deployed) if same_input is not None else None
    writer = TraceWriter(directory, access.label, access.describe(), save_inputs=same_input is None,
                         values_not_needed=values_not_needed, after_write=stream, hold_bytes=hold_bytes)
    example = qa._require_bad_case()
    # the run that traces the model _reach() reads also records its data flow: no extra forward later
    tee = ReachTee(writer, example) if access is qa._reach_access() and not hasattr(access, "module") else None
    try:
        # every traced run starts torch's generator from one seed: a model that draws random numbers in forward
        # (ViT-MAE's masking) draws the same ones in both models and in every report of the folder
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            output = access.run(example, sink=tee or writer, same_input=same_input)
    except TypeError as exc:  # the model's own call signature refused the input's structure
        writer.close()
        raise QuantLensError(
            f"The {access.label} model ({access.describe()}) cannot be called with the bad case: {exc}. A torch "
            "model takes its full input pytree (non-tensor arguments such as a task list included); an IR also "
            "takes the deployment format. Set a bad case in a format this model accepts before running it.") from exc
    except RuntimeError as exc:  # a bad case of the wrong shape: named with the shapes the models were prepared with
        writer.close()
        worded = explain_shape_error((qa.analysis, qa.baseline), example, exc, f"run() ({access.label} model)")
        if worded is None:
            raise
        raise worded from None
    except BaseException:
        writer.close()  # stop its writer thread; the previous complete trace stays as it was
        raise
    if access is qa.baseline:
        qa._baseline_case = example  # sensitivity re-runs the baseline in the format it was traced in
    if tee is not None:
        reach = tee.reach(output)
        qa._reach_cache = (input_digest(example), SiteReach(reach.reaching,
                                                              reach.host_side | access.host_sites()))
    try:
        extra = qa.post_process.extra(output)
        outputs = named_outputs(output)
        for name, value in extra.items():  # a model output named like a post-processed one keeps its own name
            outputs[unique_name(name, outputs)] = value
        if extra:  # the post-processing is one more "op site", compared like the others
            writer.on_site(SiteEvent(index=len(writer.sites), name="post_process", op_type="post_process",
                                     module_type=None, inputs={}, outputs=list(extra.values())))
        writer.finish(outputs, input_digest(qa._require_bad_case()), model_digest(access), access.folded)
    except BaseException:
        writer.close()
        raise
    trace = TraceReader(directory, held=writer.held)
    if not writer.held:  # (a baseline holding values for the analysis run: kept once it has dropped them)
        qa._readers[Path(directory)] = trace
    if stream is not None:
        stream.seal(trace)
        qa._row_stream = stream
    write_statistic(trace, directory / STATISTIC_FILE)
    return trace, list(outputs)
