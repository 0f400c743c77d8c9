"""Scale groups: fake quants that use one scale (consistency level 2's shared add/sub/cat scales), and the
power-of-two rule of its activation scales.

* **Power-of-two scales** (``ConsistencyConfig.pow2_activation_scales``): every activation fake quant rounds its
  observed scale *up* to ``2**ceil(log2 s)`` (so the observed range stays covered), exactly in float32 and at
  least the march's ``min_scale``. :func:`pow2_ceil` is the rule; ``FakeQuantize`` applies it where it derives
  its scale (``FakeQuantize.pow2_scale``, set by ``prepare``).
* **Scale groups**: every member of a group uses one scale, the max of the members' observed scales (then rounded
  to a power of two if that switch is on). :mod:`.scale_policy` builds the groups.

Membership is kept as fake quant keys (``QuantState.fq``) in ``QuantState.scale_groups``; each member knows only
its group index and its own key (plain attributes). While a prepared model's forward runs,
:func:`forward_scope` makes its ``QuantState`` the one that :func:`group_scale` resolves keys through; the first
member used in a forward fixes the group's scale for that forward (every member used in one forward uses the
same scale, even while observers update), and :func:`sync_groups` (called by ``set_fake_quantize`` when it
switches to QAT or VALIDATION) makes every member's scale buffer bit-identical.

This module reads fake quants through their attributes only, so ``FakeQuantize`` (which calls it) sits above it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from quantlens.march import get_march

__all__ = ["ScaleGroup", "pow2_ceil", "is_pow2", "forward_scope", "group_scale", "sync_groups"]

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
