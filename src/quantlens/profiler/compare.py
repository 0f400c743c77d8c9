"""Per-layer comparison of two traces: op sites matched by name, metrics per op, and the same-input error.

Matching: op site names are identical in the float and the prepared model by construction. In a fused group
(conv-bn-relu) only the last op is compared: the prepared model computes the whole group there, so the
members before it have nothing to match in the float model and are listed as ``fused into <last>``.

Per op: the **accumulated** error (analysis output vs baseline output: everything upstream included), and the
**same-input** error (the analysis op re-run on the baseline's input vs the baseline output: only what this op
adds). A layer whose same-input error is large is where precision is lost; one with a large accumulated but
small same-input error only inherits it.

Per channel: a whole-tensor SQNR is dominated by the channels with the most energy, so a few crushed channels
(per-tensor weights on a conv whose channels differ 100x in range) hardly move it. Rows of ops with a channel axis
(:func:`channel_axis`: conv, transposed conv, linear, and the fused groups they head) also get the SQNR of their
worst channel (accumulated, same-input, and same-input before the output's rounding) and the share of channels
below :data:`~quantlens.profiler.metrics.SAME_INPUT_SQNR_LIMIT`, from the same tensors as the row's metrics.
"""

from __future__ import annotations

import math
from dataclasses import asdict, fields, replace
from typing import Iterable, Mapping, Sequence

import torch

from quantlens._finite import all_finite
from quantlens._threads import loop_threads, map_ordered, side_workers
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.march.opset import op_def
from quantlens.profiler.layer_row import LayerRow
from quantlens.profiler.lsb import LSB_VERDICTS, extra_saturation, lsb_report
from quantlens.profiler.metrics import (
    SAME_INPUT_SQNR_LIMIT,
    MetricPair,
    channel_signal,
    channel_sqnr,
    compute_pair,
    in_scale_units,
    sqnr_of_energies,
)
from quantlens.profiler.pair_sums import PairSums, RowSums, SplitSums, joined, row_sums, split_sums
from quantlens.profiler.trace.format import TracedSite
from quantlens.profiler.trace.reader import TraceReader

__all__ = ["LayerRow", "LayerComparison", "compare_traces", "site_row", "check_site_match", "COLUMNS",
           "channel_axis", "SAME_INPUT_SQNR_LIMIT", "lsb_report", "extra_saturation", "LSB_VERDICTS"]


#: the table's columns, in order
COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(LayerRow))


class LayerComparison(Sequence[LayerRow]):
    """The rows of :meth:`QuantAnalysis.compare_per_layer`, in execution order (a sequence of LayerRow)."""

    def __init__(self, rows: list[LayerRow], baseline: str, analysis: str,
                 only_in_baseline: list[tuple[str, str]] | None = None,
                 only_in_analysis: list[tuple[str, str]] | None = None):
        self.rows = rows
        self.baseline = baseline
        self.analysis = analysis
        #: (op site, op type) traced on one side only (deployed stages: e.g. ops that lower to nothing)
        self.only_in_baseline = list(only_in_baseline or [])
        self.only_in_analysis = list(only_in_analysis or [])
        #: the consistency level the models were built with (``model_access.ConsistencyInfo``), set by
        #: ``QuantAnalysis``; None when unknown to the comparison (two float/torch models without one)
        self.consistency = None

    @property
    def first_diverged(self) -> LayerRow | None:
        """The first op, in execution order, whose value diverged (more than 4 LSB) from the baseline."""
        return next((r for r in self.rows if r.lsb_verdict == "diverged"), None)

    def lsb_summary(self) -> dict | None:
        """Deployed stages: how many ops are bit-exact / within 1 LSB / within 4 LSB / diverged (accumulated and
        same-input), and the first diverged and first not bit-exact op; None when no row has a verdict."""
        if not any(r.lsb_verdict or r.same_input_lsb_verdict for r in self.rows):
            return None
        count = lambda key: {v: sum(getattr(r, key) == v for r in self.rows) for v in LSB_VERDICTS}  # noqa: E731
        first_d, first_i = self.first_diverged, self.first_inexact
        return {"accumulated": count("lsb_verdict"), "same_input": count("same_input_lsb_verdict"),
                "first_diverged": first_d.op_name if first_d else None,
                "first_inexact": first_i.op_name if first_i else None}

    @property
    def first_inexact(self) -> LayerRow | None:
        """The first op whose own integer kernel (same input) is not bit-exact."""
        return next((r for r in self.rows if r.same_input_lsb_verdict not in ("", "bit-exact")), None)

    def __getitem__(self, item):
        if isinstance(item, str):
            for row in self.rows:
                if row.op_name == item:
                    return row
            raise KeyError(item)
        return self.rows[item]

    def __len__(self) -> int:
        return len(self.rows)

    def ranked(self, column: str = "same_input_sqnr") -> list[LayerRow]:
        """Compared rows with a value in ``column``, worst first (lower is worse for cosine/SQNR columns)."""
        if column not in COLUMNS:
            raise QuantLensError(f"Unknown column {column!r}; expected one of {list(COLUMNS)}.")
        lower_is_worse = column.lower().endswith(("cosine", "sqnr"))
        rows = [r for r in self.rows if isinstance(getattr(r, column), float) and not math.isnan(getattr(r, column))
                and r.reaches_output is not False]  # an op no compared output depends on is never ranked
        return sorted(rows, key=lambda r: getattr(r, column) if lower_is_worse else -getattr(r, column))

    @property
    def unreached(self) -> list[LayerRow]:
        """The rows whose op reaches no compared output (listed apart, never ranked)."""
        return [r for r in self.rows if r.reaches_output is False]

    def to_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.rows]


def check_site_match(base: TraceReader, analy: TraceReader, strict: bool = True) -> None:
    """Raise when the two traces were made on different inputs or the models do not correspond.

    ``strict`` (torch stages): the op sites must be the same. Otherwise (an IR on one side) sites may be on one
    side only (ops that lower to nothing, a BatchNorm folded into its conv), but most of the analysis model's
    sites must be the baseline's."""
    if base.input_digest != analy.input_digest:
        raise QuantLensError(
            f"The traces in {base.dir} and {analy.dir} were made on different bad cases (a new bad case was set "
            "between run(run_baseline_model=True) and run(run_analysis_model=True)). Run both models on the same "
            "bad case: qa.run()."
        )
    b, a = set(base.by_name), set(analy.by_name)
    if b == a:
        return
    only_b, only_a = sorted(b - a)[:5], sorted(a - b)[:5]
    if not strict and len(a & b) >= 0.5 * max(1, min(len(a), len(b))):
        return
    why = ("" if strict else f" Only {len(a & b)} of the analysis model's {len(a)} op sites are in the baseline, "
           "so these are not two stages of one model.")
    raise QuantLensError(
        f"The op sites of the two models do not match (traces in {base.dir} and {analy.dir}): {len(b - a)} only in "
        f"the baseline (e.g. {only_b}), "
        f"{len(a - b)} only in the analysis model (e.g. {only_a}).{why} Expected the analysis model to come from "
        "the baseline model (prepare / pre_export / export / convert of it, same op site names) and both to run "
        "the same branches on the bad case. Fix: pass the two neighbouring stages of one model, with the same "
        "input format (e.g. the same task list)."
    )


def _metrics(base: list[torch.Tensor], analy: list[torch.Tensor], names: Sequence[str] | None = None,
             finite: bool = False, sums: PairSums | None = None) -> tuple[dict[str, float] | None, MetricPair | None]:
    """The row's metrics of one pair, and the float64 pair (both None where the shapes differ); ``sums``: the
    pair's sums, computed already (:func:`_fused_sums`)."""
    if not _same_shapes(base, analy):
        return None, None
    return compute_pair(joined(base), joined(analy), names, finite, sums)


def _same_shapes(base: list[torch.Tensor], other: list[torch.Tensor]) -> bool:
    return bool(base) and len(base) == len(other) and all(x.shape == y.shape for x, y in zip(base, other))


def _bounds(dtype: str, scale: float | None) -> tuple[float | None, float | None]:
    """Where an op's value saturates its output grid: below ``(qmin - 0.5) * scale`` or above
    ``(qmax + 0.5) * scale`` (None, None: an output without a per-tensor integer grid)."""
    if scale is None or dtype not in ("qint8", "qint16"):
        return None, None
    dt = QuantDType.parse(dtype)
    return (dt.qmin - 0.5) * scale, (dt.qmax + 0.5) * scale


def _fused_sums(base: list[torch.Tensor], analy: list[torch.Tensor], same: list[torch.Tensor],
                pre: list[torch.Tensor], axis: int | None, dtype: str, scale: float | None,
                finite: bool) -> RowSums | None:
    """Every sum of the row in one pass (:func:`~quantlens.profiler.pair_sums.row_sums`: the baseline against the
    analysis values, the same-input values and their pre-rounding values, the channels' energies and the
    same-input split), where all of them are finite and shaped like the baseline; None otherwise (each figure is
    then computed on its own, with its own NaN and shape rules)."""
    if not finite or not _same_shapes(base, analy) or (same and not _same_shapes(base, same)) \
            or (pre and not _same_shapes(base, pre)) or not all(t.numel() for t in base):
        return None
    others = [joined(analy)] + ([joined(same)] if same else []) + ([joined(pre)] if pre else [])
    single = len(base) == 1 and base[0].dim() > 0
    # the same-input error split: baseline, pre-rounding value, result (without a pre-rounding value the whole
    # same-input error is the op's own: nothing to split)
    split = (2, 1, *_bounds(dtype, scale)) if pre else None
    return row_sums(joined(base), others, axis if single else None, frozenset({2}) if pre else frozenset(), split)


#: the metrics a row shows of the same-input pair (the others, KL the costliest, are not computed)
_SAME_INPUT_METRICS = ("Cosine", "SQNR", "Atol")

#: the most rows :func:`compare_traces` computes at once (each reads its baseline values: a row's memory apiece)
ROW_WORKERS = 2


#: relative error (||x - y|| / ||x||, i.e. SQNR > 120 dB) below which a difference is float32 rounding noise
#: (a GEMM re-run on a copy of its input may round its last bit differently), not a quantization error
_FLOAT_NOISE = 1e-6


def _split(same: MetricPair, pre: list[torch.Tensor] | None, dtype: str, scale: float | None,
           finite: bool = False, sums: SplitSums | None = None) -> dict:
    """Split the same-input error ``baseline - same`` (``same``: that pair, float64) into two exact parts,
    reported as mean squared errors:

    * internal: ``baseline - pre``, where ``pre`` is the op's result before its output fake quant (rounding of
      its weights, of inputs quantized at the op, lookup tables); without ``pre``, the whole error;
    * output: ``pre - same``, what the output fake quant does: clipping on saturated elements, rounding on
      the others.

    The kind is the largest of the three; none when the error is within float32 noise (:data:`_FLOAT_NOISE`).
    ``finite``: the baseline and ``pre`` are known to be finite. ``sums``: the split's sums, computed already.
    """
    x, y = same.x, same.y
    p = y if pre is None else joined(pre).reshape(x.shape)
    if not (finite or (all_finite(x) and all_finite(p))) or x.numel() == 0:
        return {}
    if same.diff_norm <= same.x_norm * _FLOAT_NOISE:
        # no error beyond float32 noise: nothing to split (the parts would only cancel each other)
        return {"error_kind": "", "same_input_inner_mse": 0.0, "same_input_clip_mse": 0.0, "same_input_round_mse": 0.0}
    if pre is None:  # the output is the op's own result: pre - same is 0 everywhere
        inner, clipped, rounded = same.sums.dd / x.numel(), 0.0, 0.0
    else:
        sums = sums or split_sums(x, p, y, *_bounds(dtype, scale))
        inner, clipped, rounded = sums.inner / x.numel(), sums.clipped, sums.rounded
    parts = {"internal": inner, "clipping": clipped / x.numel(), "rounding": rounded / x.numel()}
    kind = max(parts, key=parts.get) if max(parts.values()) > 0 else ""
    return {"error_kind": kind, "same_input_inner_mse": parts["internal"],
            "same_input_clip_mse": parts["clipping"], "same_input_round_mse": parts["rounding"]}


def _shape(site: TracedSite) -> str:
    return ";".join("x".join(str(d) for d in site.stats[k].shape) or "scalar" for k in site.float_outputs())


def _range(site: TracedSite) -> tuple[float | None, float | None, float | None]:
    stats = [site.stats[k] for k in site.float_outputs() if site.stats[k].min is not None]
    if not stats:
        return None, None, None
    total = sum(math.prod(s.shape) for s in stats) or 1
    mean = sum(s.mean * math.prod(s.shape) for s in stats) / total
    return min(s.min for s in stats), max(s.max for s in stats), mean


def _nonfinite(b: TracedSite, a: TracedSite) -> str:
    nb = any(b.stats[k].nonfinite for k in b.float_outputs())
    na = any(a.stats[k].nonfinite for k in a.float_outputs())
    return {(True, True): "both", (True, False): "baseline", (False, True): "analysis"}.get((nb, na), "")


def _selected(site: TracedSite, base_site: TracedSite, prefixes, types) -> bool:
    if prefixes and not any(site.name.startswith(p) for p in prefixes):
        return False
    if types:
        names = {site.op_type, base_site.op_type, site.module_type, base_site.module_type}
        return any((t if isinstance(t, str) else getattr(t, "__name__", str(t))) in names for t in types)
    return True


def compare_traces(base: TraceReader, analy: TraceReader, prefixes: Iterable[str] | None = None,
                   types: Iterable | None = None, deployed: bool = False,
                   early: Mapping[int, LayerRow] | None = None) -> LayerComparison:
    """Compare two traces op site by op site (loads one site's tensors at a time).

    ``deployed`` (export / convert): sites on one side only are listed rather than refused, and every row gets
    its LSB verdict and histogram. ``early``: rows :func:`site_row` already computed from these very traces
    (while the analysis model ran, :mod:`.row_stream`), by analysis site index; the others are computed here."""
    check_site_match(base, analy, strict=not deployed)
    early = early or {}
    prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes or [])
    types = [types] if isinstance(types, str) or isinstance(types, type) else list(types or [])
    # the op that computes a fused group's value (its first member: the conv/linear) gives the group's last op,
    # where the group is compared, its channel axis and weight facts
    heads: dict[str, TracedSite] = {}
    members: dict[str, list[str]] = {}  # a group's last op -> its members' op types, in order (the baseline's)
    for site in analy.sites:
        if site.fused_into:
            heads.setdefault(site.fused_into, site)
            if analy.by_name[site.name] is site:
                members.setdefault(site.fused_into, []).append(_base_type(base, site))
    for name, into in analy.folded.items():  # a quantized IR's conv written to its fused ReLU's grid
        if name in base.by_name and name not in analy.by_name:
            members.setdefault(into, []).append(base.by_name[name].op_type)
    chosen = [(site, b) for site in analy.sites
              if (b := base.by_name.get(site.name)) is not None and _selected(site, b, prefixes, types)
              # a site that runs several times (recurrent steps): one row, its last run, as for an IR
              and analy.by_name[site.name] is site]
    # The rows not computed yet are independent of each other: with a core free, two at once (the large
    # activations' rows, left out of the row stream to spare the forward's memory, were most of this call's time)
    todo = [(site, b) for site, b in chosen if site.index not in early]

    def row_of(pair: tuple[TracedSite, TracedSite]) -> LayerRow:
        site, b = pair
        return site_row(base, b, site, analy.tensors(site.name), deployed, heads.get(site.name, site))

    with loop_threads():
        computed = map_ordered(row_of, todo, side_workers(ROW_WORKERS))
    fresh = {site.index: row for (site, _), row in zip(todo, computed)}
    rows = []
    for site, b in chosen:
        row = early.get(site.index) or fresh[site.index]
        if site.name in members:
            row = replace(row, group="+".join(members[site.name] + [_base_type(base, site)]))
        rows.append(row)
    # a site the analysis model computes inside another's value (its own fused member, or a quantized IR writing a
    # conv straight to its fused ReLU's grid) is labelled with that site
    only_b = [(s.name, s.op_type + (f" (fused into {s.fused_into or analy.folded.get(s.name)})"
                                    if s.fused_into or s.name in analy.folded else ""))
              for s in base.sites if s.name not in analy.by_name and base.by_name[s.name] is s]
    only_a = [(s.name, s.op_type) for s in analy.sites if s.name not in base.by_name]
    return LayerComparison(rows, base.description, analy.description, only_b, only_a)


def _base_type(base: TraceReader, site: TracedSite) -> str:
    """The op type of ``site`` in the baseline (what the user wrote: batch_norm, not the identity it folds to)."""
    b = base.by_name.get(site.name)
    return b.op_type if b is not None else site.op_type


def channel_axis(op_type: str, shape: Sequence[int], weight_shape: Sequence[int] | None = None) -> int | None:
    """The channel axis (non-negative) of an output of ``shape`` computed by an op of ``op_type``, from the op
    facts (:attr:`OpDef.channel_dim <quantlens.march.opset.OpDef.channel_dim>`: the axis of a GEMM's per-channel
    weight in its output: 1 for conv and transposed conv, the last for linear); None for an op without one
    (elementwise, tables, matmul of two activations ...), and for an output without the batch dim the op fact
    counts with (an unbatched conv: its output has one dim fewer than its weight, ``weight_shape``)."""
    d = op_def(op_type)
    if d is None or d.channel_dim is None or len(shape) < 2:
        return None
    if d.channel_dim >= 0:  # counted from the front: the output must have the batch dim in front of it
        if len(shape) < d.channel_dim + 2 or (weight_shape is not None and len(weight_shape) != len(shape)):
            return None
    return d.channel_dim % len(shape)


def _channel_figures(x: list[torch.Tensor], y: list[torch.Tensor], axis: int | None,
                     signal: torch.Tensor | None = None, finite: bool = False, fused: RowSums | None = None,
                     which: int = 0) -> torch.Tensor | None:
    """Per-channel SQNR of a single-output pair along ``axis`` (None without an axis or with several outputs);
    ``signal``: the baseline's :func:`channel_signal`, when computed already; ``fused``: the row's sums, whose
    energies of pair ``which`` give it without another pass."""
    if axis is None or len(x) != 1 or len(y) != 1:
        return None
    if fused is not None:
        return sqnr_of_energies(fused.signal, fused.noise[which]) if fused.signal is not None else None
    return channel_sqnr(x[0], y[0], axis, signal, finite)


def _worst(sqnr: torch.Tensor | None) -> float | None:
    return None if sqnr is None else float(sqnr.min())


def _below(sqnr: torch.Tensor | None) -> float | None:
    return None if sqnr is None else float((sqnr < SAME_INPUT_SQNR_LIMIT).sum()) / sqnr.numel()


def _output_axis(owner: TracedSite, a: TracedSite, out: list[torch.Tensor]) -> int | None:
    """The channel axis of the row's single output ``out``, from the op that computes it (``owner``)."""
    if len(out) != 1:
        return None
    shape = tuple(out[0].shape)
    head_out = owner.stats.get("out0")
    if owner is not a and (head_out is None or tuple(head_out.shape) != shape):
        return None  # the group's last op changed the shape: the head's axis says nothing about its output
    weight = owner.stats.get("weight")
    return channel_axis(owner.op_type, shape, weight.shape if weight is not None else None)


def _finite(site: TracedSite, keys: Sequence[str]) -> bool:
    """Whether the site's tensors ``keys`` are all finite, by the statistics the trace computed of their values."""
    return all(not site.stats[k].nonfinite for k in keys)


def _weight_per_channel(site: TracedSite) -> bool | None:
    """Per-channel weight scales are a list (one per channel), a per-tensor one a float (trace writer)."""
    return None if site.weight_scale is None else isinstance(site.weight_scale, list)


def _index_inputs(site: TracedSite) -> list[str]:
    """The keys of a site's stored index inputs (integer tensors), in input order."""
    keys = [k for k, st in site.stats.items() if k.startswith("in") and st.dtype.startswith(("int", "uint"))]
    return sorted(keys, key=lambda k: int(k[2:]))


def _index_differs(b: TracedSite, a: TracedSite, bt: Mapping[str, torch.Tensor],
                   at: Mapping[str, torch.Tensor]) -> str:
    """"input k: n of m differ" for the first index input that differs between the two models (the k-th index
    input of each, in order: the two sides may number their inputs differently), else ""."""
    for kb, ka in zip(_index_inputs(b), _index_inputs(a)):
        if kb not in bt or ka not in at:
            continue
        x, y = bt[kb], at[ka]
        if x.shape != y.shape:
            return f"input {ka[2:]}: shape {list(y.shape)}, the baseline's {list(x.shape)}"
        n = int((x != y).sum())
        if n:
            return f"input {ka[2:]}: {n} of {x.numel()} differ"
    return ""


def site_row(base: TraceReader, b: TracedSite, a: TracedSite, at: Mapping[str, torch.Tensor],
             deployed: bool = False, owner: TracedSite | None = None) -> LayerRow:
    """The row of op site ``a`` (``b``: the baseline's; ``at``: a's tensors by key, as
    :meth:`TraceReader.tensors` gives them); ``owner``: the site computing its value (a fused group's first
    member; ``a`` itself by default). Its group label is set by :func:`compare_traces`."""
    owner = owner or a
    bmin, bmax, bmean = _range(b)
    amin, amax, amean = _range(a)
    scale = a.per_tensor_scale
    qe = a.quant_error
    stub_in = a.stats.get("in0") if a.boundary == "input" else None
    row = dict(
        index=a.index, op_name=a.name, base_op_type=b.op_type, analy_op_type=a.op_type,
        module_type=a.module_type or "", shape=_shape(a), quant_dtype=a.quant_dtype, scale=scale,
        base_min=bmin, base_max=bmax, base_mean=bmean, analy_min=amin, analy_max=amax, analy_mean=amean,
        input_dtypes=", ".join(a.input_dtypes), boundary=a.boundary, producer=a.producer or "",
        fused_into=a.fused_into or "", nonfinite=_nonfinite(b, a),
        input_min=stub_in.min if stub_in else None, input_max=stub_in.max if stub_in else None,
        weight_per_channel=_weight_per_channel(owner),
    )
    if qe is not None:
        row.update(raw_error_kind=qe.dominant if qe.clip_sq_err + qe.round_sq_err > 0 else "",
                   clipped_ratio=qe.clipped_ratio, raw_min=qe.raw_min, raw_max=qe.raw_max)
    if a.int_stats is not None:
        row.update(acc_saturated_ratio=a.int_stats.acc_saturated_ratio,
                   table_input_clipped_ratio=a.int_stats.table_clipped_ratio, nonfinite_to_int=a.int_stats.nonfinite)
    if a.fused_into:
        return LayerRow(**row, note=f"fused into {a.fused_into}")
    bt = base.tensors(b.name)
    row.update(index_differs=_index_differs(b, a, bt, at), index_producer=a.index_producer or "")
    keys = b.float_outputs()
    # the tensors as stored: every figure goes to float64 a chunk at a time (pair_sums)
    base_out = [bt[k] for k in keys]
    analy_out = [at[k] for k in a.float_outputs()]
    # which tensors are finite, from the trace's statistics of these very values (no pass over them again)
    base_finite = _finite(b, keys)
    acc_finite = base_finite and _finite(a, a.float_outputs())
    same_keys = [f"same{i}" for i in range(len(keys)) if f"same{i}" in at]
    same = [at[k] for k in same_keys] if len(same_keys) == len(keys) else []
    same_finite = base_finite and _finite(a, same_keys)
    pre_keys = [f"samepre{i}" for i in range(len(keys)) if f"samepre{i}" in at]
    pre = [at[k] for k in pre_keys] if same and len(pre_keys) == len(keys) else []
    pre_finite = base_finite and _finite(a, pre_keys)
    axis = _output_axis(owner, a, base_out)
    fused = _fused_sums(base_out, analy_out, same, pre, axis, a.quant_dtype, scale,
                        acc_finite and (not same or same_finite) and (not pre or pre_finite))
    values = _metrics(base_out, analy_out, finite=acc_finite, sums=fused.pairs[0] if fused else None)[0]
    if values is None:
        return LayerRow(**row, note="mismatch shape" if keys or a.float_outputs() else "no float output")
    row.update(values)
    row["atol_in_scale"] = in_scale_units(values["Atol"], scale)
    signal = None  # the baseline's channel energies, shared by the row's per-channel figures
    if fused is None and axis is not None and len(base_out) == 1 and base_out[0].dim() > 0 and base_finite:
        signal = channel_signal(base_out[0], axis)
    per_channel = _channel_figures(base_out, analy_out, axis, signal, acc_finite, fused, 0)
    row.update(worst_channel_sqnr=_worst(per_channel), channels_below=_below(per_channel))
    if deployed and a.quant_dtype != "qint32":
        # (an int32 high-precision output's LSB is the accumulator's: one input step upstream is thousands of them,
        # so only its same-input verdict below says something)
        lsb = lsb_report(base_out, analy_out, a.scale, a.scale_axis, acc_finite)
        row.update(lsb_verdict=lsb.get("verdict", ""), lsb_hist=lsb.get("hist", ""))
    del analy_out
    same_values, same_pair = (_metrics(base_out, same, _SAME_INPUT_METRICS, same_finite,
                                       fused.pairs[1] if fused else None) if same else (None, None))
    note = a.same_input_note
    if same_values is not None:
        row.update(same_input_cosine=same_values["Cosine"], same_input_sqnr=same_values["SQNR"],
                   same_input_atol=same_values["Atol"],
                   same_input_in_scale=in_scale_units(same_values["Atol"], scale))
        if same_pair is not None:
            row.update(_split(same_pair, pre or None, a.quant_dtype, scale, pre_finite if pre else same_finite,
                              fused.split if fused else None))
        same_channels = _channel_figures(base_out, same, axis, signal, same_finite, fused, 1)
        if same_channels is not None:
            row.update(same_input_worst_channel_sqnr=_worst(same_channels), channels_below=_below(same_channels))
        if pre:
            row["same_input_inner_worst_channel_sqnr"] = _worst(_channel_figures(base_out, pre, axis, signal,
                                                                                  pre_finite, fused, 2))
        if deployed:
            lsb = lsb_report(base_out, same, a.scale, a.scale_axis, same_finite)
            row.update(same_input_lsb_verdict=lsb.get("verdict", ""), same_input_lsb_hist=lsb.get("hist", ""))
            row["requant_saturated_ratio"] = extra_saturation(base_out, same, a.quant_dtype, scale)
    elif not note:
        note = "no same-input output"
    return LayerRow(**row, note=note)
