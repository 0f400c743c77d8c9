"""The state ``prepare`` adds to a model (:class:`QuantState`) and the questions every stage asks of it: is a
model prepared (:func:`is_prepared`), and which runtime runs its forwards (:func:`use_runtime`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from quantlens.errors import QuantLensError
from quantlens.march import get_march, get_variant
from quantlens.quantization.consistency import ConsistencyConfig, ConsistencyStrategy
from quantlens.quantization.fake_quantize import FakeQuantState
from quantlens.quantization.fuse import FusedGroup, UnfusedPattern
from quantlens.quantization.plan import SitePlan
from quantlens.sites.record import ModelRecord
from quantlens.sites.tracer import SiteHandler

__all__ = ["QuantState", "is_prepared", "use_runtime", "state_of"]


class QuantState(nn.Module):
    """Everything ``prepare`` adds to a model: fake quants by key, site plans, and the prepare-time record."""

    def __init__(self, record: ModelRecord, groups, unfused, plans, warnings, setter_name: str):
        super().__init__()
        self.fq = nn.ModuleDict()
        #: site overrides (pre_export's lookup tables), keyed like fake quants
        self.overrides = nn.ModuleDict()
        self.record = record
        self.groups: list[FusedGroup] = groups
        self.unfused: list[UnfusedPattern] = unfused
        self.plans: dict[str, SitePlan] = plans
        self.warnings: list[str] = warnings
        self.setter_name = setter_name
        self.march = get_march().spec.name
        #: the CPU kernel variant of a runtime march (``March.ORT_CPU``), else None
        self.march_variant = None if get_variant() is None else get_variant().value
        self.fake_quant_state = FakeQuantState.QAT
        #: the consistency level this model was prepared with (``ConsistencyStrategy``); every stage reads it here
        self.consistency: ConsistencyConfig = ConsistencyStrategy.config()
        #: runtimes that replace the plain one for the forwards of a :func:`use_runtime` block, innermost last
        self.runtimes: list[SiteHandler] = []

    def current_runtime(self) -> SiteHandler | None:
        """The runtime the next forward uses in place of a plain one (:func:`use_runtime`), if any."""
        runtimes = self.__dict__.get("runtimes")  # (absent on a state pickled before it existed)
        return runtimes[-1] if runtimes else None

    def root(self) -> nn.Module:
        """The prepared model this state belongs to (set by its first forward)."""
        root = self.__dict__.get("_root_ref")
        if root is None:
            raise QuantLensError("This QuantState is not attached to a prepared model.")
        return root

    def forward(self, *args):
        """Identity. A prepared ``nn.Sequential`` calls every child in turn, this one (added last) included, so
        it must pass the output through unchanged."""
        return args[0] if len(args) == 1 else args


@contextlib.contextmanager
def use_runtime(model: nn.Module, runtime: SiteHandler) -> Iterator[SiteHandler]:
    """Run the prepared ``model``'s forwards inside this block with ``runtime`` (a :class:`SiteHandler` that
    sees every op site: the profiler's probes, the non-finite watcher) in place of the plain fake-quant runtime.

    This is the seam through which the layers above observe or replace what a prepared model does at its op
    sites; blocks nest (the innermost runtime is used) and the runtime is removed when the block ends, also when
    it raises."""
    state = state_of(model, "use_runtime")
    state.runtimes.append(runtime)
    try:
        yield runtime
    finally:
        state.runtimes.remove(runtime)


def state_of(model: nn.Module, what: str) -> QuantState:
    """The :class:`QuantState` of a prepared ``model``; a clear error naming ``what`` for any other model."""
    state = getattr(model, "_quantlens_state", None)
    if not isinstance(state, QuantState):
        raise QuantLensError(f"{what} expects a model returned by quantlens.quantization.prepare, got "
                             f"{type(model).__name__}.")
    if "runtimes" not in state.__dict__:  # a state pickled before the seam existed
        state.__dict__["runtimes"] = []
    return state


def is_prepared(model: nn.Module) -> bool:
    """Whether ``model`` was returned by :func:`prepare`."""
    return isinstance(getattr(model, "_quantlens_state", None), QuantState)
