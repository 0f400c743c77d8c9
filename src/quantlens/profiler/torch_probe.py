"""Tracer handlers that report every op site of a torch model to the profiler (see :mod:`.model_access`).

* :class:`FloatProbe` traces a plain (float) model with the op-site tracer.
* :class:`RuntimeProbe` traces a prepared model: it *is* the prepared model's runtime (a subclass of
  ``quantization.runtime.Runtime``), so the model computes exactly what it computes without the profiler; the probe only
  observes, and additionally computes the **same-input output**: the op re-run on the baseline's input.

Same-input rule, per analysis op site:

1. its incoming float tensors (not parameters) are replaced by the baseline's, loaded from the baseline trace;
   inside a fused group (conv-bn-relu) the members after the head take the previous member's same-input
   output instead, so the group's last op sees the whole fused computation;
2. the site's **own** input fake quants and output fake quant are applied as the runtime would (weights are
   fake-quantized inside QAT modules as usual). An input that arrives already quantized by its producer is not
   re-quantized here: that rounding is the producer's output error, reported at the producer. So a bad layer
   shows up at itself, not at every consumer.

A site that runs several times in one forward (a recurrent layer's time steps share their op sites) is reported
at every run; its ``k``-th run takes the baseline's inputs of the baseline's ``k``-th run of the site (both
models run the same Python code), where the source keeps every run (a trace, ``TraceReader.inputs(site, k)``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.march.numerics import fake_quant
from quantlens.profiler._sums import chunks, sum64
from quantlens.profiler.index_ops import substitute_indices
from quantlens.profiler.index_origins import IndexOrigins, is_index_tensor
from quantlens.profiler.model_access import QuantErrorStats, SameInputSource, SiteEvent, TraceSink
from quantlens.quantization.fake_quantize import FakeQuantize
from quantlens.quantization.plan import OutputMode, SitePlan
from quantlens.quantization.runtime import Runtime, is_inplace, tensor_leaves
from quantlens.sites.tracer import SiteCall, SiteHandler, float_tensor_leaves, is_float_tensor

__all__ = ["Probe", "FloatProbe", "RuntimeProbe", "quant_error_stats", "deferred_quant_error_stats",
           "DeferredQuantError"]


def _incoming(args: tuple, kwargs: dict, indices: bool = True) -> dict[int, torch.Tensor]:
    """The op's incoming float tensors (not its weights) and, with ``indices``, its index tensors, by leaf position:
    a baseline records both, and the other model's same-input run takes both (a ``gather`` on the baseline's
    indices only moves values; on its own indices it showed the index flips of the ops before as its own loss)."""
    leaves, _, positions = float_tensor_leaves(args, kwargs)
    floats = {p: leaves[p] for p in positions if not isinstance(leaves[p], nn.Parameter)}
    if indices:
        floats.update({p: leaf for p, leaf in enumerate(leaves) if _is_index(leaf)})
    return floats


_is_index = is_index_tensor


def _tensor_leaves(output: Any) -> list[torch.Tensor]:
    return [x for x in tensor_leaves(output) if isinstance(x, torch.Tensor)]


def _float_leaves(output: Any) -> list[torch.Tensor]:
    return [x for x in tensor_leaves(output) if is_float_tensor(x)]


def quant_error_stats(output: Any, fq: FakeQuantize) -> QuantErrorStats | None:
    """Clipping vs rounding error of a per-tensor fake quant on ``output`` (the value before it is rounded),
    whether or not the fake quant is currently enabled."""
    deferred = deferred_quant_error_stats(output, fq)
    return deferred() if deferred is not None else None


class DeferredQuantError:
    """:func:`quant_error_stats` to compute later (in the trace writer's thread). ``tensor`` is the flat float32
    value before the fake quant, *not* copied: whoever keeps this beyond the current op (TraceWriter) replaces
    it by a copy first (the model may change the original in place)."""

    def __init__(self, tensor: torch.Tensor, scale: torch.Tensor, dtype):
        self.tensor, self.scale, self.dtype = tensor, scale, dtype

    def __call__(self) -> QuantErrorStats:
        return _quant_error_stats(self.tensor, self.scale, self.dtype)


def deferred_quant_error_stats(output: Any, fq: FakeQuantize, copy: bool = False) -> DeferredQuantError | None:
    """:func:`quant_error_stats` as a callable to run later (see :class:`DeferredQuantError`; ``copy``: take a
    copy of the value now). None where it does not apply."""
    leaves = _float_leaves(output)
    if not leaves or fq.ch_axis is not None or fq.scale.numel() != 1:
        return None
    # Written to keep the extra memory near one copy of the output (float32, in-place squares, float64 sums).
    if len(leaves) == 1:
        x = leaves[0].detach().reshape(-1)
        x = x.to(torch.float32, copy=True) if copy else x.float()
    else:
        x = torch.cat([t.detach().reshape(-1).float() for t in leaves])
    return DeferredQuantError(x, fq.scale.detach().float().clone(), fq.dtype)


def _quant_error_stats(x: torch.Tensor, scale: torch.Tensor, dtype) -> QuantErrorStats:
    lo, hi = torch.aminmax(x) if x.numel() else (None, None)
    if lo is not None and not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):  # NaN propagates, Inf is an extreme
        x = x[torch.isfinite(x)]
        lo, hi = torch.aminmax(x) if x.numel() else (None, None)
    s = float(scale)
    qmin, qmax = dtype.qmin, dtype.qmax
    if x.numel() == 0:
        return QuantErrorStats(float("nan"), float("nan"), 0, 0, 0.0, 0.0, qmin, qmax)
    clip_sq = round_sq = 0.0
    clipped_n = 0
    # Beyond half a step past the last level the value saturates: that is clipping, not rounding. The extremes
    # say whether any element does; where none does (the usual case) no chunk needs the mask.
    high, low = (qmax + 0.5) * s, (qmin - 0.5) * s
    saturates = bool(hi > high) or bool(lo < low)  # (compared as the chunks' masks compare: in x's dtype)
    # chunk by chunk (the writer thread's temporaries are a chunk's, not an activation's)
    for c in chunks(x.contiguous()):
        err = fake_quant(c, scale, dtype).sub_(c)  # -(x - fq(x)), exactly: only its square is used
        err.mul_(err)
        if not saturates:
            round_sq += sum64(err)
            continue
        clipped = torch.gt(c, high).logical_or_(torch.lt(c, low))
        n = int(torch.count_nonzero(clipped))
        if n:
            # the clipped squares in place (err * 1, the others err * 0 = 0: exact), not gathered by the mask:
            # indexing and masked_fill_ took 3x as long (42-47 against 15-18 ms on a saturating 1M-element activation)
            clip = err * clipped
            clip_sq += sum64(clip)
            # each part summed on its own: as total - clipping, a small rounding part next to a large clipping
            # one would be lost to cancellation
            round_sq += sum64(err.sub_(clip))
        else:
            round_sq += sum64(err)
        clipped_n += n
    return QuantErrorStats(
        raw_min=float(lo), raw_max=float(hi), numel=int(x.numel()), clipped=clipped_n,
        clip_sq_err=clip_sq, round_sq_err=round_sq, qmin=qmin, qmax=qmax,
    )


class Probe:
    """What both handlers share: event numbering, index substitution, and where events go."""

    def __init__(self, sink: TraceSink | None, same_input: SameInputSource | None,
                 indices: dict[str, list[torch.Tensor]] | None, override: Any = None):
        self.sink = sink
        self.same_input = same_input
        self.indices = indices
        #: another model's value for chosen sites (ir_access.SiteOverride): sees every site's value
        self.override = override
        self.count = 0

    def substitute(self, site: SiteCall, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.indices is not None and site.rule.index_producing and site.name in self.indices:
            output = substitute_indices(site.rule.op_type, args, kwargs, output, self.indices[site.name])
        if self.override is not None:
            if isinstance(output, torch.Tensor):
                replaced = self.override.on_site_value(site.name, [output])
                if replaced is not None:
                    return replaced[0].to(output.dtype)
            else:  # several outputs: seen (a later site may take them), never replaced
                self.override.on_site_value(site.name, _tensor_leaves(output))
        return output

    def event(self, site: SiteCall, args: tuple, kwargs: dict, output: Any) -> SiteEvent:
        weight, weight_scale = None, None
        if site.module is not None:
            w = getattr(site.module, "weight", None)
            weight = w if isinstance(w, torch.Tensor) else None
            wfq = getattr(site.module, "weight_fake_quant", None)
            weight_scale = wfq.scale if isinstance(wfq, FakeQuantize) else None
        else:
            leaves = pytree.tree_leaves((args, kwargs))
            weight = next((x for x in leaves if isinstance(x, nn.Parameter) and x.is_floating_point()), None)
        event = SiteEvent(
            index=self.count, name=site.name, op_type=site.rule.op_type,
            module_type=type(site.module).__name__ if site.module is not None else None,
            inputs=_incoming(args, kwargs), outputs=_tensor_leaves(output), weight=weight,
            weight_scale=weight_scale, index_producing=site.rule.index_producing, boundary=site.rule.boundary,
        )
        self.count += 1
        return event

    def index_op(self, name: str, result: torch.Tensor) -> None:
        """An unnamed index-only op (argmax#k) seen by :class:`~.index_ops.IndexOpMode`."""
        if self.sink is not None and getattr(self.sink, "wants_index_ops", False):
            self.sink.on_site(SiteEvent(index=-1, name=name, op_type=name.split("#")[0], module_type=None,
                                        inputs={}, outputs=[result], index_producing=True))


#: in-place ops for which reading the result again gives the same result (f(f(x)) = f(x)): no copy needed
_IDEMPOTENT_INPLACE = {"relu_", "relu6_", "clamp_", "clamp_min_", "clamp_max_", "hardtanh_", "clip_", "relu",
                       "relu6", "hardtanh"}
#: functional activations with an ``inplace`` argument: its position (``F.leaky_relu(x, 0.1, True)``)
_INPLACE_POSITION = {"leaky_relu": 2, "elu": 2, "celu": 2, "selu": 1, "silu": 1, "hardswish": 1, "hardsigmoid": 1,
                     "mish": 1, "threshold": 3, "rrelu": 4, "relu": 1, "relu6": 1, "hardtanh": 3}
#: module types whose ``inplace=True`` changes their input, unless reading the result again gives the result
_IDEMPOTENT_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh)


def _mutates_input(func, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether the call changes its first argument in place (``x.mul_(3)``, ``x += y``, ``F.silu(x, inplace=True)``)
    in a way that reading the result again would not undo (not ``relu_``)."""
    name = getattr(func, "__name__", "")
    if name in _IDEMPOTENT_INPLACE:
        return False
    if is_inplace(func):
        return True
    if kwargs and kwargs.get("inplace") is True:
        return True
    position = _INPLACE_POSITION.get(name)
    return position is not None and len(args) > position and args[position] is True


def _mutates_module_input(module: nn.Module | None) -> bool:
    return module is not None and getattr(module, "inplace", False) is True and \
        not isinstance(module, _IDEMPOTENT_MODULES)


class FloatProbe(SiteHandler):
    """Runs every op unchanged and reports it."""

    def __init__(self, probe: Probe):
        self.probe = probe
        self._before: dict[str, tuple] = {}  # in-place module sites: their input as it was read

    def _report(self, site, args, kwargs, output):
        output = self.probe.substitute(site, args, kwargs, output)
        if self.probe.sink is not None:
            self.probe.sink.on_site(self.probe.event(site, args, kwargs, output))
        return output

    def function_op(self, site, func, args, kwargs):
        if self.probe.sink is not None and args and isinstance(args[0], torch.Tensor) and \
                _mutates_input(func, args, kwargs):
            # an in-place op (x.mul_(3), x += y) changes its input: report the value it read, which the
            # same-input run of the other model takes as this op's input (not the result, read twice)
            before = (args[0].clone(), *args[1:])
            return self._report(site, before, kwargs, func(*args, **kwargs))
        return self._report(site, args, kwargs, func(*args, **kwargs))

    def module_enter(self, site, args):
        if self.probe.sink is not None and args and isinstance(args[0], torch.Tensor) and \
                _mutates_module_input(site.module):
            self._before[site.name] = (args[0].clone(), *args[1:])  # nn.SiLU(inplace=True) and the like
        return None

    def module_exit(self, site, args, output):
        new = self._report(site, self._before.pop(site.name, args), {}, output)
        return None if new is output else new


class RuntimeProbe(Runtime):
    """The prepared model's runtime, reporting each site (and its same-input output) to the probe."""

    def __init__(self, state, probe: Probe):
        super().__init__(state)
        self.probe = probe
        self._entered: dict[str, tuple] = {}
        self._qerr: QuantErrorStats | None = None
        self._group_of = {m: g for g in state.groups for m in g.members}
        self._group_same: dict[str, torch.Tensor] = {}
        self._runs: dict[str, int] = {}  # op site -> how many times it has run in this forward
        self._origins = IndexOrigins()  # the op site each index tensor came from (event.index_producer)

    @property
    def follows_values(self) -> bool:
        return self.probe.sink is not None

    def follow(self, args, kwargs, output) -> None:
        self._origins.follow(args, kwargs, output)

    # -- the runtime's hooks ------------------------------------------------------------------------------
    def _finish(self, plan, output, inputs, kwargs, site, *rest):
        # (*rest: the runtime's further arguments, e.g. the integer-rule call of the consistency levels)
        if self.probe.sink is not None and plan is not None and plan.output is OutputMode.QUANTIZED:
            # a sink with a writer thread (TraceWriter) computes the split there, off the forward's path
            self._qerr = (deferred_quant_error_stats if getattr(self.probe.sink, "deferred_quant_error", False)
                          else quant_error_stats)(output, self.fq[plan.output_fq])
        return super()._finish(plan, output, inputs, kwargs, site, *rest)

    def function_op(self, site, func, args, kwargs):
        self._qerr = None
        reported = args
        if self.probe.sink is not None and args and isinstance(args[0], torch.Tensor) and \
                _mutates_input(func, args, kwargs):
            # an in-place op: report (and re-run the other model's op on) the value it read, with its grid
            reported = (self._snapshot(args[0]), *args[1:])
        out = super().function_op(site, func, args, kwargs)
        args = reported
        plan = self.plans.get(site.name)

        def run(a, k):
            if plan is not None and plan.override is not None:
                return self._override(plan, site, a, k)
            return func(*a, **k)

        return self._after(site, plan, args, kwargs, out, run)

    def module_enter(self, site, args):
        if self.probe.sink is not None and args and isinstance(args[0], torch.Tensor) and \
                _mutates_module_input(site.module):
            self._entered[site.name] = (self._snapshot(args[0]), *args[1:])  # nn.SiLU(inplace=True) ...
        else:
            self._entered[site.name] = args  # the incoming inputs, before any input fake quant
        return super().module_enter(site, args)

    def _snapshot(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of an in-place op's input as it was read, carrying its grid mark."""
        copy = t.clone()
        mark = self._mark(t)
        if mark is not None:
            self.marks.set(copy, mark)
        return copy

    def module_exit(self, site, args, output):
        self._qerr = None
        original = self._entered.pop(site.name, args)
        in_fq = site.module.__dict__.get("_ql_input_fq")  # read before the runtime clears it
        out = super().module_exit(site, args, output)
        plan = self.plans.get(site.name)

        def run(a, k):
            if plan is not None and plan.override is not None:
                return self._override(plan, site, a, {})
            # QAT modules quantize their bias with the input's scale; give the re-run the same input fq.
            site.module.__dict__["_ql_input_fq"] = in_fq
            try:
                return site.module(*a)
            finally:
                site.module.__dict__["_ql_input_fq"] = None

        return self._after(site, plan, original, {}, out, run)

    # -- reporting ----------------------------------------------------------------------------------------
    def _after(self, site: SiteCall, plan: SitePlan | None, args, kwargs, out, run: Callable) -> Any:
        new = self.probe.substitute(site, args, kwargs, out)
        if new is not out:
            # substituted indices keep the input's grid; a value from another model (override) is this site's
            src = next(iter(_incoming(args, kwargs, False).values()), None) if site.rule.index_producing else out
            self._set_marks(new, self._mark(src) if src is not None else None)
            out = new
        if self.probe.sink is None:
            return out
        event = self.probe.event(site, args, kwargs, out)
        self._describe(event, site, plan, args, kwargs, out)
        self._origins.remember(out, site.name)
        occurrence = self._runs.get(site.name, 0)
        self._runs[site.name] = occurrence + 1
        if self.probe.same_input is not None:
            event.set_same_input(*self._same_input(site, plan, args, kwargs, run, occurrence))
            # computed on the baseline's inputs (loaded for this op) and kept by nobody once reported; a fused
            # member's result, which the next member reads, is not reported
            event.same_input_owned = True
        self.probe.sink.on_site(event)
        return out

    def _describe(self, event: SiteEvent, site, plan, args, kwargs, out) -> None:
        first = next(iter(_float_leaves(out)), None)
        fq = self._mark(first) if first is not None else None
        if plan is None:
            event.quant_dtype = "float"
        elif plan.output is OutputMode.FUSED:
            event.quant_dtype, event.fused_into = "(fused)", plan.fused_into
        elif fq is not None:
            event.quant_dtype, event.scale = fq.dtype.value, fq.scale.detach().clone()
        else:
            event.quant_dtype = plan.output_dtype
        event.quant_error = self._qerr
        input_fqs = {pos: self.fq[key] for pos, key in plan.input_fq.items()} if plan is not None else {}
        for pos, tensor in event.inputs.items():
            in_fq = input_fqs.get(pos) or self._mark(tensor)
            event.input_dtypes.append(in_fq.dtype.value if in_fq is not None else "float")
        record = self.state.record.sites.get(site.name)
        data = [i for i in record.inputs if not i.is_parameter] if record is not None else []
        if data and data[0].producer is not None:
            event.producer = self.state.record.origin(data[0].producer)
        event.index_producer = next((o for t in event.inputs.values() if (o := self._origins.origin(t))), None)

    def _same_input(self, site: SiteCall, plan: SitePlan | None, args, kwargs, run: Callable, occurrence: int = 0):
        """The op on the baseline's inputs (of the same run of the site, ``occurrence``), with this site's own fake
        quants: ``(outputs, outputs before the output fake quant or None, note)``."""
        group = self._group_of.get(site.name)
        source = self.probe.same_input
        if hasattr(source, "occurrence_count"):  # keeps every run of a site (a trace)
            base = source.inputs(site.name, occurrence=occurrence)
            if base is None and source.occurrence_count(site.name):
                return None, None, f"the baseline ran this op site {source.occurrence_count(site.name)} times, " \
                    f"this is run {occurrence + 1}"
        else:
            base = source.inputs(site.name)
        if base is None:
            return None, None, "the baseline has no op site with this name"
        internal, note = self._fused_member_inputs(site, group)
        if note is None:
            new_args, new_kwargs, note = self._baseline_inputs(args, kwargs, base, internal)
        if note is not None:
            return None, None, note
        if plan is not None:
            new_args, new_kwargs, _ = self._quantize_inputs(plan, new_args, new_kwargs)
        result = run(new_args, new_kwargs)
        pre = None
        if plan is not None and plan.output is OutputMode.QUANTIZED:
            pre, fq = _float_leaves(result), self.fq[plan.output_fq]
            result = pytree.tree_map(lambda x: fq(x) if is_float_tensor(x) else x, result)
        if group is not None:  # a member's result is the next member's input, until the group's last op
            if site.name == group.last:
                for member in group.members:
                    self._group_same.pop(member, None)
            else:
                self._group_same[site.name] = result
        if plan is not None and plan.output is OutputMode.FUSED:
            return None, None, f"fused into {plan.fused_into}"
        return _float_leaves(result), pre, ""

    def _fused_member_inputs(self, site: SiteCall, group) -> tuple[dict[int, torch.Tensor], str | None]:
        """A fused member's inputs from earlier members (their same-input outputs, by position), or a note."""
        if group is None or site.name == group.head:
            return {}, None
        inputs = [inp for inp in self.state.record.sites[site.name].inputs if inp.producer in group.members]
        missing = next((inp.producer for inp in inputs if inp.producer not in self._group_same), None)
        if missing is not None:
            return {}, f"no same-input output for fused member '{missing}'"
        return {inp.position: self._group_same[inp.producer] for inp in inputs}, None

    def _baseline_inputs(self, args, kwargs, base: dict[int, torch.Tensor], internal: dict[int, torch.Tensor]):
        """``(args, kwargs, note)`` with the incoming float tensors replaced by ``internal``'s or the baseline's, and
        the index tensors by the baseline's (where the baseline recorded them)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for pos, leaf in enumerate(leaves):
            if _is_index(leaf) and pos in base:
                if base[pos].shape != leaf.shape:
                    return None, None, f"the baseline's index input {pos} has another shape"
                leaves[pos] = base[pos].to(device=leaf.device, dtype=leaf.dtype)
                continue
            if not is_float_tensor(leaf) or isinstance(leaf, nn.Parameter):
                continue
            repl = internal.get(pos)
            if repl is None:
                repl = base.get(pos)
                if repl is None or repl.shape != leaf.shape:
                    return None, None, f"the baseline's input {pos} does not match (shape or position)"
                repl = repl.to(device=leaf.device, dtype=leaf.dtype)
            if leaf in self.marks:  # the runtime reads input scales (bias, lookup tables) from these marks
                self.marks.set(repl, self._mark(leaf))
            leaves[pos] = repl
        return (*pytree.tree_unflatten(leaves, spec), None)
