"""Scale policies of the consistency strategy (level 2): power-of-two activation scales and shared scales at
add/sub/cat.

* **Power-of-two scales** (``ConsistencyConfig.pow2_activation_scales``): every activation fake quant rounds its
  observed scale *up* to ``2**ceil(log2 s)`` (so the observed range stays covered), exactly in float32 and at
  least the march's ``min_scale``. :func:`pow2_ceil` is the rule; ``FakeQuantize`` applies it where it derives
  its scale (``FakeQuantize.pow2_scale``, set by ``prepare``).
* **Shared scales** (``ConsistencyConfig.shared_elementwise_scales``): the integer add/sub/cat of
  ``docs/march.md`` §10 rescales each input to the output scale. When the inputs and the output are on one grid
  that rescale is the identity. :func:`build_scale_groups` joins, for every such op site whose output is
  quantized, the fake quants its tensor inputs are on and its own output fake quant into one *scale group*
  (union-find: a residual stream chains its adds into one group). Every member of a group uses one scale, the
  max of the members' observed scales (then rounded to a power of two if that switch is on).

Membership is kept as fake quant keys (``QuantState.fq``) in ``QuantState.scale_groups``; each member knows only
its group index and its own key (plain attributes). While a prepared model's forward runs,
:func:`forward_scope` makes its ``QuantState`` the one that :func:`group_scale` resolves keys through; the first
member used in a forward fixes the group's scale for that forward (every member used in one forward uses the
same scale, even while observers update), and :func:`sync_groups` (called by ``set_fake_quantize`` when it
switches to QAT or VALIDATION) makes every member's scale buffer bit-identical.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from quantlens.march import get_march
from quantlens.march.opset import IR_OPS, OPS

__all__ = [
    "ScaleGroup", "RESCALED_OPS", "pow2_ceil", "is_pow2", "build_scale_groups", "install_scale_policy",
    "forward_scope", "group_scale", "sync_groups",
]

#: op types whose integer rule rescales every input to the output scale (docs/march.md §10; stack is a cat): those
#: lowering to an IR op the op set marks ``rescales_inputs``
RESCALED_OPS = frozenset(d.name for d in OPS.values() if any(IR_OPS[i].rescales_inputs for i in d.ir if i in IR_OPS))


@dataclass
class ScaleGroup:
    """Fake quants (keys of ``QuantState.fq``) that use one scale, and the add/sub/cat op sites that joined them."""

    index: int
    members: list[str]
    sites: list[str]
    #: False when the group cannot share one scale (mixed dtypes, a weight / int32 / fixed-scale member)
    shared: bool = True
    reasons: list[str] = field(default_factory=list)

    def describe(self) -> str:
        head = f"scale group {self.index} (op sites {', '.join(self.sites)}): {', '.join(self.members)}"
        if self.shared:
            return head
        return head + "  [not shared: " + "; ".join(self.reasons) + "]"


# -- power-of-two scales ---------------------------------------------------------------------------------------

def pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2 s)`` elementwise, exact in float32, at least the march's ``min_scale``."""
    s = scale.detach().to(torch.float32)
    mantissa, exponent = torch.frexp(s)  # s = m * 2**e, m in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-126, 127)
    out = ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)  # the float32 bits of 2**e
    return torch.clamp_min(out, get_march().spec.min_scale)


def is_pow2(value: float) -> bool:
    """Whether ``fl32(value)`` is a power of two."""
    t = torch.tensor(float(value), dtype=torch.float32)
    return bool(torch.equal(pow2_ceil(t), t))


# -- group construction -------------------------------------------------------------------------------------------

def _grid_of(state, name: str | None) -> tuple[str, str]:
    """The grid the output of op site ``name`` is on: ``("fq", key)``, or ``(kind, description)`` with kind
    ``weight`` / ``int32`` / ``float`` when it is on no shareable activation grid. Follows INHERIT passthrough
    sites back to their first input and FUSED members forward to their group's tail."""
    from quantlens.quantization.plan import OutputMode

    seen: set[str] = set()
    while name is not None and name not in seen:
        seen.add(name)
        plan = state.plans.get(name)
        if plan is None:
            return "float", f"op site '{name}' (no plan)"
        if plan.output is OutputMode.QUANTIZED and plan.output_fq:
            return "fq", plan.output_fq
        if plan.output is OutputMode.INHERIT:
            site = state.record.sites.get(name)
            name = site.inputs[0].producer if site is not None and site.inputs else None
            if name is None:
                return "float", f"a float model input (through op site '{plan.name}')"
            continue
        if plan.output is OutputMode.FUSED and plan.fused_into:
            name = plan.fused_into
            continue
        if plan.output is OutputMode.WEIGHT:
            return "weight", f"the weight table of op site '{name}'"
        if plan.output is OutputMode.HIGH_PRECISION:
            return "int32", f"the int32 output of op site '{name}'"
        return "float", f"the float output of op site '{name}'"
    return "float", "a float model input"


def _output_key(state, plan) -> str | None:
    """The fake quant of an add/sub/cat site's output: its own, or its fused group tail's (add + relu)."""
    from quantlens.quantization.plan import OutputMode

    if plan.output is OutputMode.QUANTIZED:
        return plan.output_fq
    if plan.output is OutputMode.FUSED and plan.fused_into:
        tail = state.plans.get(plan.fused_into)
        if tail is not None and tail.output is OutputMode.QUANTIZED:
            return tail.output_fq
    return None


class _UnionFind:
    """Disjoint sets of fake quant keys, with path compression; ``order`` lists the keys as first seen."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.order: list[str] = []

    def find(self, key: str) -> str:
        parent = self.parent
        if key not in parent:
            parent[key] = key
            self.order.append(key)
        root = key
        while parent[root] != root:
            root = parent[root]
        while parent[key] != root:  # path compression
            parent[key], key = root, parent[key]
        return root

    def join(self, keys: list[str]) -> None:
        """Put ``keys`` in one set (the first key is found first: it fixes the order of new keys)."""
        for key in keys[1:]:
            root = self.find(keys[0])
            self.parent[self.find(key)] = root
        self.find(keys[0])


def _input_grid(state, plan, inp) -> tuple[str, str]:
    """The grid input ``inp`` of op site ``plan`` is on: its own input fake quant's, else its producer's."""
    if inp.position in plan.input_fq:
        return "fq", plan.input_fq[inp.position]
    return _grid_of(state, inp.producer) if inp.producer else ("float", "a float tensor")


def _site_members(state, plan, out_key: str) -> tuple[list[str], list[str]]:
    """The fake quant keys an add/sub/cat site joins (its inputs' grids, then its output's), without repeats, and
    one problem per input on no shareable activation grid."""
    site = state.record.sites.get(plan.name)
    keys, problems = [], []
    for inp in site.inputs if site is not None else ():
        kind, what = _input_grid(state, plan, inp)
        if kind == "fq" and what in state.fq:
            keys.append(what)
        else:
            problems.append(f"input {inp.position} of '{plan.name}' is {what} ({kind})")
    keys.append(out_key)
    return list(dict.fromkeys(keys)), problems


def _join_rescaled_sites(state, sets: _UnionFind) -> list[tuple[str, list[str], list[str]]]:
    """Join the keys of every add/sub/cat site whose output is quantized; ``(site, member keys, problems)``."""
    site_keys: list[tuple[str, list[str], list[str]]] = []
    for plan in state.plans.values():
        if plan.op_type not in RESCALED_OPS:
            continue
        out_key = _output_key(state, plan)
        if out_key is None or out_key not in state.fq:
            continue  # the output is not quantized: no integer rescale at this site
        keys, problems = _site_members(state, plan, out_key)
        sets.join(keys)
        site_keys.append((plan.name, keys, problems))
    return site_keys


def _groups_of(sets: _UnionFind, site_keys: list[tuple[str, list[str], list[str]]]) -> list[ScaleGroup]:
    """One group per set, numbered in the order its first key was seen, with its sites and their problems."""
    by_root: dict[str, ScaleGroup] = {}
    for key in sets.order:
        root = sets.find(key)
        group = by_root.setdefault(root, ScaleGroup(len(by_root), [], []))
        group.members.append(key)
    for name, keys, problems in site_keys:
        group = by_root[sets.find(keys[0])]
        group.sites.append(name)
        group.reasons.extend(problems)
    return sorted(by_root.values(), key=lambda g: g.index)


def _check_shareable(state, group: ScaleGroup) -> None:
    """Add the reasons the group's members cannot share one scale (mixed dtypes, a weight or per-channel fake
    quant, a fixed scale) and set ``group.shared``."""
    from quantlens.quantization.observers import FixedScaleObserver

    fqs = [state.fq[k] for k in group.members]
    dtypes = sorted({fq.dtype.value for fq in fqs})
    if len(dtypes) > 1:
        group.reasons.append(f"it mixes {' and '.join(dtypes)}")
    for key, fq in zip(group.members, fqs):
        if fq.is_weight or fq.ch_axis is not None:
            group.reasons.append(f"'{key}' is a weight (per-channel) fake quant")
        elif isinstance(fq.observer, FixedScaleObserver):
            group.reasons.append(f"'{key}' has a fixed scale ({fq.observer.scale})")
    group.reasons = list(dict.fromkeys(group.reasons))
    group.shared = not group.reasons


def build_scale_groups(state) -> tuple[list[ScaleGroup], list[str]]:
    """The scale groups of a prepared model's state (before fake quants are flagged) and one warning per group
    that cannot share a scale."""
    sets = _UnionFind()
    groups = _groups_of(sets, _join_rescaled_sites(state, sets))
    warnings: list[str] = []
    for group in groups:
        _check_shareable(state, group)
        if not group.shared:
            warnings.append(
                f"shared elementwise scales: scale group {group.index} (op sites {', '.join(group.sites)}; fake quants "
                f"{', '.join(group.members)}) is not shared because " + "; ".join(group.reasons) + ". Its members "
                "keep their own scales, so the integer add/sub/cat rescales its inputs there."
            )
    return groups, warnings


def install_scale_policy(prepared) -> None:
    """Apply the prepared model's ``state.consistency`` switches: flag the activation fake quants for
    power-of-two scales and build the scale groups (``state.scale_groups``). Warnings go to ``state.warnings``."""
    from quantlens.quantization.fake_quantize import FakeQuantize, fake_quant_sites
    from quantlens.quantization.observers import FixedScaleObserver

    state = prepared._quantlens_state
    config = state.consistency
    state.scale_groups = []
    if config.pow2_activation_scales:
        labels = fake_quant_sites(prepared)
        for path, fq in prepared.named_modules():
            if not isinstance(fq, FakeQuantize) or fq.is_weight or fq.ch_axis is not None:
                continue
            if isinstance(fq.observer, FixedScaleObserver):
                if not is_pow2(fq.observer.scale):
                    site, role, key = labels.get(id(fq), (path, "fake quant", None))
                    state.warnings.append(
                        f"power-of-two activation scales: op site '{site}' ({role}) has the fixed scale "
                        f"{fq.observer.scale}, which is not a power of two; it is kept as given, so requantizing "
                        "to or from it is no plain shift."
                    )
                continue
            fq.pow2_scale = True
    if config.shared_elementwise_scales:
        groups, warnings = build_scale_groups(state)
        state.scale_groups = groups
        state.warnings.extend(warnings)
        for group in groups:
            if not group.shared:
                continue
            for key in group.members:
                state.fq[key].scale_group = group.index
                state.fq[key].fq_key = key


# -- resolution at run time ---------------------------------------------------------------------------------------

class _Scope:
    """One forward of a prepared model: its state and the group scales fixed in this forward."""

    __slots__ = ("state", "scales")

    def __init__(self, state):
        self.state = state
        self.scales: dict[int, torch.Tensor] = {}


_local = threading.local()


@contextlib.contextmanager
def forward_scope(state):
    """Make ``state`` the one that grouped fake quants resolve through during one forward."""
    if not getattr(state, "scale_groups", None):
        yield
        return
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(_Scope(state))
    try:
        yield
    finally:
        stack.pop()


def _member_scale(fq, own, own_scale: torch.Tensor | None) -> torch.Tensor | None:
    """A member's raw (observed) scale: the caller's fresh one, its observer's, or its calibrated buffer."""
    if fq is own and own_scale is not None:
        return own_scale
    try:
        if fq.observer.has_stats:
            return fq.observer.calculate_scale().to(fq.scale.device)
    except Exception:  # noqa: BLE001 - a member's own forward reports its error
        pass
    if bool(fq.calibrated):
        return fq.scale.detach().clone()
    return None


def _resolve(state, group: ScaleGroup, own=None, own_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    scales = []
    pow2 = False
    for key in group.members:
        fq = state.fq[key]
        pow2 = pow2 or fq.pow2_scale
        s = _member_scale(fq, own, own_scale)
        if s is not None and s.numel() == 1:
            scales.append(s.reshape(()).to(torch.float32))
    if not scales:
        return None
    scale = torch.stack(scales).max()
    return pow2_ceil(scale) if pow2 else scale


def group_scale(fq, observed: torch.Tensor) -> torch.Tensor:
    """The scale a grouped fake quant uses now, given its freshly ``observed`` scale: the group's scale for this
    forward (fixed by the first member used, and written to every member's buffer)."""
    stack = getattr(_local, "stack", None)
    scope = stack[-1] if stack else None
    index, key = fq.scale_group, fq.fq_key
    groups = getattr(scope.state, "scale_groups", ()) if scope is not None else ()
    if scope is None or index is None or index >= len(groups) or key not in scope.state.fq \
            or scope.state.fq[key] is not fq or key not in groups[index].members:
        return pow2_ceil(observed) if fq.pow2_scale else observed  # not inside its model's forward
    cached = scope.scales.get(index)
    if cached is None:
        cached = _resolve(scope.state, groups[index], fq, observed)
        if cached is None:
            return pow2_ceil(observed) if fq.pow2_scale else observed
        scope.scales[index] = cached
        _write(scope.state, groups[index], cached)
    return cached


def _write(state, group: ScaleGroup, scale: torch.Tensor) -> None:
    for key in group.members:
        buf = state.fq[key].scale
        if buf.shape == scale.shape:
            buf.copy_(scale)


def sync_groups(state) -> None:
    """Give every member of every shared group the group's scale (max of the members' observed scales, pow2 if
    flagged): after calibration every member's scale buffer is bit-identical."""
    for group in getattr(state, "scale_groups", None) or ():
        if not group.shared or any(k not in state.fq for k in group.members):
            continue
        scale = _resolve(state, group)
        if scale is not None:
            _write(state, group, scale.to(state.fq[group.members[0]].scale.device))
