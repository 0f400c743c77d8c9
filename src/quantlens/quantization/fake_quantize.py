"""FakeQuantize modules and the model-wide state switch (float / calibration / QAT / validation)."""

from __future__ import annotations

import contextlib
import math
from enum import Enum
from typing import Iterator

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType, get_march, rules
from quantlens.march.numerics import fake_quant, fake_quant_range
from quantlens.quantization.emulation.core import straight_through
from quantlens.quantization.observers import FixedScaleObserver
from quantlens.quantization.qconfig import QuantSpec
from quantlens.quantization.scale_groups import group_scale, pow2_ceil, sync_groups
from quantlens.sites.tracing_state import export_tracing

__all__ = ["FakeQuantState", "FakeQuantize", "switch_fake_quants", "int32_bias", "nonfinite_sites", "fake_quant_sites",
           "frozen_weights", "hold_weight", "release_weight"]


class FakeQuantState(str, Enum):
    """What every fake quant of a prepared model does.

    ========== ============ ============
    state      observe      fake-quantize
    ========== ============ ============
    FLOAT      no           no   (the float model; for diagnosis)
    CALIBRATION yes         no   (post-training statistics)
    QAT        yes          yes  (training; observers follow the data)
    VALIDATION no           yes  (frozen scales: what the NPU computes)
    ========== ============ ============
    """

    FLOAT = "float"
    CALIBRATION = "calibration"
    QAT = "qat"
    VALIDATION = "validation"


_STATE_FLAGS = {
    FakeQuantState.FLOAT: (False, False),
    FakeQuantState.CALIBRATION: (True, False),
    FakeQuantState.QAT: (True, True),
    FakeQuantState.VALIDATION: (False, True),
}


def _without_fills(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its fill values (finite, at least half its dtype's largest magnitude: the ``finfo.min`` of an
    attention mask) read as 0 by the observer, where ``x`` also holds real (nonzero) values: scores plus a mask, a
    bias with masked entries. A fill is a mask, never a quantity: observed, it would stretch the grid until every
    real value rounds to 0. The fake quant then saturates it to the grid's lowest code, which is how the integer
    model masks (exp of the lowest code minus the max is ~0). A pure mask (fills and zeros) keeps its fills on its
    grid, so the attention that reads it still finds them (``decompositions.SdpaDecomposition``)."""
    if not x.is_floating_point():
        return x
    limit = torch.finfo(x.dtype).max / 2
    lo, hi = torch.aminmax(x.detach())  # one pass in the usual case: no value anywhere near a fill
    if not (bool(lo <= -limit) or bool(hi >= limit)):
        return x
    fills = (x.abs() >= limit) & torch.isfinite(x)
    if not bool(fills.any()) or not bool(((x != 0) & ~fills).any()):
        return x
    return x.masked_fill(fills, 0.0)


class FakeQuantize(nn.Module):
    """Observer plus symmetric fake quant of one tensor, following ``docs/march.md``.

    The scale is a buffer: it is refreshed from the observer while observing and frozen otherwise, so a
    calibrated state_dict fully describes the quantization.
    """

    # class defaults, so fake quants pickled before these switches existed still load and run
    follows_sign: bool = False
    pow2_scale: bool = False
    channel_exponents: bool = False
    scale_group: "int | None" = None
    fq_key: "str | None" = None
    #: a linear's weight reading exponent-form codes: the input's factors ``2**-k_c`` folded in (:meth:`fold`)
    _fold: "torch.Tensor | None" = None

    def __init__(self, spec: QuantSpec, is_weight: bool = False):
        super().__init__()
        if spec.dtype is QuantDType.qint32:
            raise QuantLensError("qint32 is the high-precision output type; it has no fake quant.")
        if spec.dtype is QuantDType.quint8:
            raise QuantLensError(
                "quint8 is not a qconfig's type: under March.ORT_CPU an int8 activation becomes quint8 by itself while "
                "its observer sees no negative value. Ask for qint8 (or qint16).")
        self.dtype = spec.dtype
        self.ch_axis = spec.ch_axis
        #: per-channel scales in channel-exponent form (docs/march.md §3.1): ``rules.exponent_scales`` of the
        #: observer's
        self.channel_exponents = bool(getattr(spec, "channel_exponents", False)) and not is_weight
        if self.channel_exponents and rules.max_channel_exponent() == 0:
            raise QuantLensError(f"QuantSpec(channel_exponents=True): March {get_march().spec.name} has no channel "
                                 "exponents (docs/march.md §3.1); quantize this activation per tensor.")
        self.spec_text = spec.describe()
        self.observer = spec.observer(spec.dtype, spec.ch_axis)
        self.register_buffer("scale", torch.ones(()))
        self.observe_enabled = False
        self.fake_quant_enabled = False
        #: weights are observed afresh on every call in every state but FLOAT, so the scale always matches
        #: the current weights (an optimizer step after the last forward cannot leave a stale scale).
        self.is_weight = is_weight
        #: whether the scale came from data (observation or a loaded state dict) rather than the placeholder.
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))
        #: the weight the scale was last computed from (:meth:`_weight_key`): the same one again is not re-observed
        self._weight_seen: tuple | None = None
        #: where this fake quant sits (``op site 'relu1' (output, key 'relu1|out')``), set on every prepared
        #: model's fake quants by :func:`set_fake_quantize`; named in observer errors.
        self.name: str | None = None
        #: round the observed scale up to a power of two (consistency level 2, set by ``prepare``; activations only)
        self.pow2_scale = False
        #: index of this fake quant's scale group in ``QuantState.scale_groups`` and its key in ``QuantState.fq``
        #: (shared scales at add/sub/cat, set by ``prepare``; see :mod:`.scale_policy`)
        self.scale_group: int | None = None
        self.fq_key: str | None = None
        #: LSQ: in QAT the scale is this parameter (initialised from calibration when QAT starts), trained with the
        #: straight-through estimator; activations per tensor only
        self.learn_scale = bool(getattr(spec, "learn_scale", False)) and not is_weight and spec.ch_axis is None
        if self.learn_scale:
            self.learned_scale = nn.Parameter(torch.ones(()))
            self.register_buffer("learned_initialized", torch.zeros((), dtype=torch.bool))
        #: a march with unsigned activations (ORT_CPU): this int8 activation is ``quint8`` while its observer has seen
        #: no negative value (the buffer ``unsigned``, saved with the scale); QL1's fake quants have no such buffer
        self.follows_sign = (get_march().spec.unsigned_activations and not is_weight and spec.ch_axis is None
                             and spec.dtype is QuantDType.qint8)
        if self.follows_sign:
            self.register_buffer("unsigned", torch.zeros((), dtype=torch.bool))

    def set_state(self, state: FakeQuantState) -> None:
        state = FakeQuantState(state)
        self.observe_enabled, self.fake_quant_enabled = _STATE_FLAGS[state]
        if self.is_weight:
            self.observe_enabled = state is not FakeQuantState.FLOAT

    def _learning(self) -> bool:
        """In QAT with a learned scale: the parameter, not the observer, gives the scale (shared or power-of-two
        scales keep their observer: a learned value would break their invariants)."""
        return (self.learn_scale and self.observe_enabled and self.fake_quant_enabled and bool(self.calibrated)
                and self.scale_group is None and not self.pow2_scale)

    def start_learning(self) -> None:
        """Initialise the learned scale from the calibrated one (once, when QAT starts)."""
        if self.learn_scale and bool(self.calibrated) and not bool(self.learned_initialized):
            with torch.no_grad():
                self.learned_scale.copy_(self.scale.reshape(()))
            self.learned_initialized.fill_(True)

    def _learned_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.start_learning()
        s = self.learned_scale.clamp(min=get_march().spec.min_scale)
        with torch.no_grad():
            self.scale.copy_(s.detach().to(self.scale.dtype).reshape(self.scale.shape))  # what export reads
        # LSQ (Esser et al.): round with a straight-through gradient; the scale's gradient scaled by
        # 1/sqrt(numel * qmax) so its steps are comparable to the weights'
        g = 1.0 / math.sqrt(max(x.numel(), 1) * self.dtype.qmax)
        s_grad = s * g + (s - s * g).detach()
        v = x / s_grad
        lsq = torch.clamp(v + (torch.round(v) - v).detach(), self.dtype.qmin, self.dtype.qmax) * s_grad
        # the value is the exact fake quant of docs/march.md (the expression above rounds in float32)
        return straight_through(lsq, fake_quant(x, self.scale.clone(), self.dtype, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nothing to observe or round (torch.zeros(1, 0) padding a cat); a size from data is no guard for export
        if guard_or_false(x.numel() == 0):
            return x
        if self._learning():
            return self._learned_forward(x)
        if self.learn_scale and not self.observe_enabled and not export_tracing() \
                and bool(self.learned_initialized):
            with torch.no_grad():  # VALIDATION / export: the latest learned value (an optimizer step moved it)
                self.scale.copy_(self.learned_scale.detach().clamp(min=0).to(self.scale.dtype).reshape(
                    self.scale.shape))
        # A weight's scale is a function of the weight: recomputed whenever it is fake-quantized, even where a tool
        # paused the observers, so an optimizer step can never leave a stale scale (not while torch.export traces:
        # its eager pass has refreshed them).
        weight_refresh = (self.is_weight and self.fake_quant_enabled and not self.observe_enabled
                          and not export_tracing())
        key = self._weight_key(x) if self.is_weight and _FROZEN[0] else None
        if key is not None and key == self._weight_seen and (weight_refresh or self.observe_enabled):
            weight_refresh = False  # the scale already is this very weight's (recomputing it gives the same)
        elif weight_refresh:
            self._refresh_weight_scale(x)
            self._weight_seen = key
        elif self.observe_enabled:
            self._observe(x)
            self._weight_seen = key
        if self.fake_quant_enabled:
            # While observing, the next call updates self.scale in place; autograd must keep this call's value
            # (a quantizer used at every time step of an LSTM runs several times in one forward).
            scale = self.scale.clone() if (self.observe_enabled or weight_refresh) else self.scale
            return fake_quant(x, scale, self.dtype, self._axis(x))
        return x

    def _axis(self, x: torch.Tensor) -> int | None:
        """The channel axis as a dim of ``x`` (a qconfig's ``ch_axis=-1``, the last dim, is not the fake quant's
        per-tensor -1)."""
        return None if self.ch_axis is None else self.ch_axis % max(x.dim(), 1)

    def _observe(self, x: torch.Tensor) -> None:
        if self.is_weight:
            self.observer.reset()
        self.observer(self._folded_weight(x) if self.is_weight else _without_fills(x))
        self.refresh_scale()

    def fold(self, factors: torch.Tensor | None) -> None:
        """A linear's weight that reads exponent-form codes along its input features (``docs/march.md`` §3.1):
        its rows are quantized as ``W · diag(factors)`` (``factors = 2**-k_c``, the input's) and the scale becomes
        ``[O, C]`` (``rules.fold_exponents``), so the integer GEMM multiplies the int8 codes as they are. ``None``:
        not folded. The QAT linear calls it on every call; a change takes effect at the weight's next
        observation (a weight is observed afresh on every call but in FLOAT)."""
        if factors is None and self._fold is None:
            return
        if factors is not None and self._fold is not None and torch.equal(factors, self._fold):
            return
        self._fold = None if factors is None else factors.detach().clone()
        self._weight_seen = None

    def _folded_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w if self._fold is None else w * self._fold.to(w.dtype)

    def _row_scales_folded(self, scale: torch.Tensor) -> torch.Tensor:
        return scale if self._fold is None else rules.fold_exponents(scale, self._fold)

    def read_grid(self) -> tuple[torch.Tensor, QuantDType]:
        """The grid an integer op reads this fake quant's codes on: its own scale and type, or for codes in
        channel-exponent form their common grid ``s · 2**-K`` at int16 (``docs/march.md`` §3.1: convert shifts them
        onto it, ``rules.common_grid``)."""
        if self.channel_exponents:
            return rules.common_grid(self.scale), QuantDType.qint16
        return self.scale, self.dtype

    def refresh_scale(self) -> None:
        """The scale (and, under a march with unsigned activations, the sign) from the observer's statistics as
        they are: what observing ends with, and what statistics loaded into the observer give (a calibration
        reused, ``quantization.calibration_stats``)."""
        if self.follows_sign:
            low = self.observer.min_val
            self._set_unsigned(bool(torch.isfinite(low).all()) and bool((low >= 0).all()))
        try:
            scale = self.observer.calculate_scale().to(self.scale.device)
        except QuantLensError as exc:
            label = getattr(self, "name", None)
            if not label:
                raise
            raise QuantLensError(f"The fake quant of {label}: {exc}") from None
        if self.scale_group is not None:  # one scale for the whole group (scale_policy)
            scale = group_scale(self, scale)
        elif self.channel_exponents:  # (power-of-two scales, level 2: the widest channel's, so every channel's)
            scale = rules.exponent_scales(pow2_ceil(scale) if self.pow2_scale else scale)
        elif self.pow2_scale:
            scale = pow2_ceil(scale)
        elif self.is_weight:
            scale = self._row_scales_folded(scale)
        if scale.shape != self.scale.shape:
            self.scale = scale
        else:
            self.scale.copy_(scale)
        self.calibrated.fill_(True)

    def observe(self, x: torch.Tensor) -> None:
        """Feed ``x`` to the observer (where observing is on) and update the scale; no fake quantization. A
        lookup-table site in QAT observes its float op's value this way: its table's output saturates at the
        current range, so observing that would keep the scale from ever growing."""
        if self.observe_enabled and x.numel() and not self._learning():
            with torch.no_grad():
                self._observe(x.detach())

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The fake quant with the current scale (where fake-quantizing is on), without observing ``x``."""
        if not self.fake_quant_enabled or x.numel() == 0:
            return x
        return fake_quant(x, self.scale.clone() if self.observe_enabled else self.scale, self.dtype, self._axis(x))

    def _weight_key(self, w: torch.Tensor) -> tuple | None:
        """Inside :func:`frozen_weights`: what the weight scale is a function of, told without reading the
        weight: the window, the parameter object, its storage, shape and in-place version, and the observer. None
        (always recompute) for a weight computed in the forward (a BatchNorm folded into its conv: a new tensor on
        every call, whose id and memory may be reused) and while torch.export traces."""
        if not (isinstance(w, nn.Parameter) or _HELD.get(id(w)) is w) or export_tracing():
            return None  # (export_tracing: the real answer; is_compiling() is set in a traced forward)
        return (_FROZEN[1], id(w), w.data_ptr(), w._version, tuple(w.shape), w.dtype, id(self.observer), self.dtype,
                self.ch_axis)

    def _refresh_weight_scale(self, w: torch.Tensor) -> None:
        """The scale of the current weight where a tool paused the observers (no statistics are kept for a weight).
        A weight without a finite range keeps its scale: the tool that paused the observers reports the NaN/Inf."""
        self.observer.reset()
        self.observer(self._folded_weight(w))
        try:
            scale = self._row_scales_folded(self.observer.calculate_scale().to(self.scale.device))
        except QuantLensError:
            return
        if scale.shape != self.scale.shape:
            self.scale = scale
        else:
            self.scale.copy_(scale)

    def _set_unsigned(self, unsigned: bool) -> None:
        """``quint8`` (``unsigned``) or ``qint8``, for this fake quant and its observer's scale."""
        self.dtype = self.observer.dtype = QuantDType.quint8 if unsigned else QuantDType.qint8
        self.unsigned.fill_(unsigned)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Per-channel scales are shaped on first observation; accept a calibrated shape on load.
        self._weight_seen = None  # a loaded scale is used as it is until the weight is fake-quantized again
        key = prefix + "scale"
        if key in state_dict and state_dict[key].shape != self.scale.shape:
            self.scale = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.follows_sign and prefix + "unsigned" in state_dict:
            self._set_unsigned(bool(state_dict[prefix + "unsigned"]))

    def extra_repr(self) -> str:
        return f"{self.spec_text}, observe={self.observe_enabled}, fake_quant={self.fake_quant_enabled}"


#: [depth, window]: inside frozen_weights() (depth > 0) a weight's scale is computed once per parameter and window
_FROZEN = [0, 0]
_HELD: dict[int, torch.Tensor] = {}  # id -> tensor: see hold_weight()


def hold_weight(t: torch.Tensor) -> None:
    """Until :func:`release_weight`, ``t`` (a weight computed from parameters, e.g. a BatchNorm folded into its
    conv, which the caller holds unchanged and fake-quantizes again and again: ``qat_modules.frozen_folds``)
    counts as a parameter for :func:`frozen_weights`: one scale computation per window rather than one per call.
    The tensor is held here, so its id stays its own."""
    _HELD[id(t)] = t


def release_weight(t: torch.Tensor) -> None:
    """Ends :func:`hold_weight` for ``t`` (a no-op where ``t`` is not held)."""
    if _HELD.get(id(t)) is t:
        del _HELD[id(t)]


@contextlib.contextmanager
def frozen_weights() -> Iterator[None]:
    """A window in which no weight changes (the profiler's forwards): each weight fake quant computes its
    parameter's scale once instead of on every call (the same value: a weight's scale is a function of the
    weight). Outside it every call recomputes, so a weight changed in any way (an optimizer step, an in-place
    edit through ``.data``, which no version counter sees) never keeps a stale scale; each window starts afresh."""
    _FROZEN[0] += 1
    _FROZEN[1] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1


def switch_fake_quants(model: nn.Module, state: FakeQuantState | str) -> FakeQuantState:
    """Switch every fake quant of a prepared model to ``state`` (and give the members of each shared scale group
    one scale); returns the state. The stage function :func:`quantlens.quantization.set_fake_quantize` adds the
    lookup tables of consistency level 3+ to this."""
    try:
        state = FakeQuantState(state)
    except ValueError:
        raise QuantLensError(
            f"Unknown fake quant state {state!r}; expected one of {[s.name for s in FakeQuantState]}."
        ) from None
    found = False
    labels = fake_quant_sites(model)
    for path, module in model.named_modules():
        if isinstance(module, FakeQuantize):
            module.set_state(state)
            module.name = _label(*labels[id(module)]) if id(module) in labels else f"module '{path}'"
            found = True
    if not found:
        raise QuantLensError(
            f"set_fake_quantize: {type(model).__name__} has no FakeQuantize modules. Call "
            "quantlens.quantization.prepare(model, example_inputs) first and pass the model it returns."
        )
    state_holder = getattr(model, "_quantlens_state", None)
    if state_holder is not None:
        state_holder.fake_quant_state = state
        if state in (FakeQuantState.QAT, FakeQuantState.VALIDATION):
            sync_groups(state_holder)  # shared add/sub/cat scales: every member's buffer bit-identical
    return state


def fake_quant_sites(model: nn.Module) -> dict[int, tuple[str, str, str | None]]:
    """``id(fake quant) -> (op site, role, key)`` for the fake quants of a prepared model (empty for any other
    model), e.g. ``("relu1", "output", "relu1|out")``: input, output and weight fake quants of each op site plan,
    QAT modules' ``weight_fake_quant`` and the fake quants inside a site's override (sdpa's scores...)."""
    state = getattr(model, "_quantlens_state", None)
    plans = getattr(state, "plans", None)
    if not plans:
        return {}
    labels: dict[int, tuple[str, str, str | None]] = {}
    modules = dict(model.named_modules())

    def add(fq, site: str, role: str, key: str | None = None) -> None:
        if isinstance(fq, FakeQuantize) and id(fq) not in labels:
            labels[id(fq)] = (site, role, key)

    for plan in plans.values():
        for pos, key in plan.input_fq.items():
            add(state.fq[key] if key in state.fq else None, plan.name, f"input {pos}", key)
        if plan.output_fq and plan.output_fq in state.fq:
            add(state.fq[plan.output_fq], plan.name, "output", plan.output_fq)
        for key in plan.weight_fq.values():
            add(state.fq[key] if key in state.fq else None, plan.name, "weight", key)
        site = state.record.sites.get(plan.name)
        module = modules.get(site.module_name) if site is not None and site.is_module and "@" not in plan.name \
            else None
        add(getattr(module, "weight_fake_quant", None), plan.name, "weight", f"{site.module_name}.weight_fake_quant"
            if module is not None else None)
        if plan.override is not None and plan.override in state.overrides:
            for sub, fq in state.overrides[plan.override].named_modules():
                add(fq, plan.name, f"internal {sub}" if sub else "internal", plan.override)
    for key, fq in state.fq.items():  # anything a plan does not reference
        add(fq, key.split("|")[0].replace("/", "."), key.split("|")[-1], key)
    return labels


def _label(site: str, role: str, key: str | None) -> str:
    return f"op site '{site}' ({role}" + (f", key '{key}')" if key else ")")


def nonfinite_sites(model: nn.Module) -> dict[str, list[str]]:
    """Op site -> the roles (``output``, ``input 0``, ``weight``...) of its fake quants whose observer saw
    NaN/Inf since it was last reset, in plan (execution) order. Weight observers restart on every call, so
    they report the latest weights. For a model that is not prepared, fake quants are named by module path."""
    labels = fake_quant_sites(model)
    order: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, FakeQuantize) or not bool(module.observer.saw_nonfinite):
            continue
        site, role, _ = labels.get(id(module), (path, "fake quant", None))
        order.setdefault(site, [])
        if role not in order[site]:
            order[site].append(role)
    if labels:  # execution order of the plans rather than module registration order
        plan_order = {name: i for i, name in enumerate(model._quantlens_state.plans)}
        order = dict(sorted(order.items(), key=lambda kv: plan_order.get(kv[0], len(plan_order))))
    return order


def int32_bias(bias: torch.Tensor | None, in_fq: "FakeQuantize | None", w_fq: FakeQuantize) -> torch.Tensor | None:
    """A conv/linear bias as the integer kernel adds it: int32 at ``s_in * s_w[c]`` (``docs/march.md`` §7.2).

    Left float when there is no bias, no input fake quant, or either fake quant is disabled.
    """
    if bias is None or not bias.is_floating_point() or in_fq is None:
        return bias
    if not (in_fq.fake_quant_enabled and w_fq.fake_quant_enabled):
        return bias
    if w_fq.scale.dim() > 1 and in_fq.channel_exponents:  # a folded weight (§3.1): the codes as they are, s · s_w[o]
        rows = (w_fq.scale * rules.exponent_factors(in_fq.scale).reshape(1, -1))[:, 0]
        scale = (in_fq.scale.amax() * rows).contiguous()
    else:
        scale = (in_fq.read_grid()[0].reshape(()) * w_fq.scale).reshape(-1).expand(bias.shape[0]).contiguous()
    return fake_quant_range(bias, scale, -(2**31), 2**31 - 1, 0)


def uncalibrated_sites(model: nn.Module) -> list[str]:
    """The op sites of a prepared model with an activation fake quant that never observed data (so it quantizes
    with the placeholder scale 1.0): calibration skipped, or a branch the calibration data never reached. Fixed-
    scale observers need no data and are not listed. A decomposed op (sdpa) quantizes through its own inner fake
    quants, some of them optional (the mask's, without a float mask): it is listed when none of them saw data.
    Empty for any other model."""
    modules = {id(m): m for m in model.modules() if isinstance(m, FakeQuantize)}
    state = getattr(model, "_quantlens_state", None)
    owned = {id(state.fq[p.output_fq]) for p in getattr(state, "plans", {}).values()  # not called: see above
             if p.override and p.override.endswith("|decomposition") and p.output_fq in state.fq}
    plain: dict[str, bool] = {}  # site -> every plain activation fake quant calibrated
    inner: dict[str, bool] = {}  # site -> some inner (decomposition) fake quant calibrated
    for ident, (site, role, _key) in fake_quant_sites(model).items():
        fq = modules.get(ident)
        if fq is None or fq.is_weight or ident in owned or isinstance(fq.observer, FixedScaleObserver):
            continue
        if role.startswith("internal"):
            inner[site] = inner.get(site, False) or bool(fq.calibrated)
        else:
            plain[site] = plain.get(site, True) and bool(fq.calibrated)
    sites = dict.fromkeys([*plain, *inner])
    return [s for s in sites if not plain.get(s, True) or not inner.get(s, True)]


def uncalibrated_message(what: str, sites: list[str]) -> str:
    """The warning or refusal about :func:`uncalibrated_sites`."""
    shown = ", ".join(f"'{s}'" for s in sites[:6]) + (f" and {len(sites) - 6} more" if len(sites) > 6 else "")
    return (f"{what}: {len(sites)} op site(s) have an activation fake quant that never saw data ({shown}); they "
            "quantize with the placeholder scale 1.0. Calibrate first (calibrate(model, batches), with data that "
            "reaches every branch) or load a calibrated state_dict.")
