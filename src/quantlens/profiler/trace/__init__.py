"""The on-disk trace of one model's forward on the bad case, written while the model runs.

Layout of ``out_dir/<baseline|analysis>_model/``::

    tensors/00000.safetensors   one file per executed op site: in<pos>, out<i>, weight, same<i>, samepre<i>
    outputs.safetensors         the model outputs by name (and the post_process outputs)
    trace.json                  one entry per op site: names, quantization, tensor statistics
    statistic.txt               the statistics as a table (see report.write_statistic)

* :mod:`.format`: the one declaration of the format (file names, version, the fields of ``trace.json``);
* :mod:`.stats`: what is computed from the tensors (their statistics, the bad case's fingerprint);
* :mod:`.writer`: :class:`TraceWriter`, the sink a traced forward streams its op sites to (a writer thread);
* :mod:`.reader`: :class:`TraceReader`, the trace read back (also the same-input source of the analysis run).

Every op site's tensors are copied as soon as the op has run and handed to a writer thread, which computes
their statistics and writes them to disk while the model runs on; the copies waiting for it are bounded
(:data:`QUEUE_BYTES`), so tracing needs a few layers' worth of extra memory, not the network's. ``trace.json``
is written last: a trace without it is incomplete and is refused by :class:`TraceReader`.

**Format 2** (``trace.json``'s ``"format"``): a tensor that is the very tensor an earlier op site of the same
trace already stored (an op's input that is its producer's output, an identity op's output, a shared weight),
unchanged since, is not stored again: the site's ``refs`` maps its key to ``[file, key]`` of the stored copy,
and :class:`TraceReader` resolves it (``tensors``, ``inputs``, ``site_outputs``; the statistics are the stored
copy's). A fused group's member may keep its statistics only (``TracedSite.stats_only``: in the analysis trace,
and in a baseline traced for an analysis model that fuses it, see ``docs/profiler.md``). The tensor files are
plain safetensors files. Traces of format 1 (before references) are refused with
a message to re-run ``run()``.

An op site that ran several times in the forward (a recurrent layer's time steps) has one entry per reported run
(a torch model reports every run; an IR its last, and as a baseline also the earlier ones a same-input run reads):
:class:`TraceReader` gives the last one by name and the others by occurrence (``occurrences``, ``tensors(name,
k)``, ``inputs(site, k)``, ``site_outputs(site, k)``).

A new trace is written into the sibling folder ``.<name>.partial/`` and moved into place when complete, so an
interrupted run leaves the previous complete trace as it was. Only the files named above are ever removed or
replaced; anything else in the folder (a user's notes, ``tensors/README``) stays.
"""

from quantlens.profiler.trace.format import TRACE_FILE, TRACE_FORMAT, TensorStat, TracedSite
from quantlens.profiler.trace.reader import TraceReader
from quantlens.profiler.trace.stats import input_digest, tensor_stat
from quantlens.profiler.trace.writer import QUEUE_BYTES, TraceWriter

__all__ = ["TensorStat", "TracedSite", "TraceWriter", "TraceReader", "tensor_stat", "input_digest", "TRACE_FILE",
           "TRACE_FORMAT", "QUEUE_BYTES"]
