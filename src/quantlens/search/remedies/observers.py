"""Ranges chosen per op site: the observer remedy (``docs/remedies.md``).

:class:`ObserverQconfigSetter` gives chosen op sites another output observer (a percentile, KL or MSE clipping
range instead of min/max) on top of a base setter; everything else is the base setter's. ``prepare`` takes it
unchanged, and the mixed-precision search can start from it.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, Callable, Mapping

from quantlens.errors import QuantLensError
from quantlens.quantization.observers import KLObserver, MSEObserver, PercentileObserver
from quantlens.quantization.qconfig_template import (
    QconfigAssignment,
    QconfigContext,
    QconfigSetter,
    default_calibration_qconfig_setter,
    resolve_qconfigs,
    unmatched_message,
)

__all__ = ["ObserverQconfigSetter", "RANGE_OBSERVERS"]

#: the range remedies tried per op site, by name: clipping chosen by the data's error rather than its extremes
RANGE_OBSERVERS: dict[str, Callable] = {
    "percentile99.9": PercentileObserver.with_args(percentile=99.9),
    "percentile99.99": PercentileObserver.with_args(percentile=99.99),
    "kl": KLObserver,
    "mse": MSEObserver,
}


class ObserverQconfigSetter(QconfigSetter):
    """The base setter's qconfigs with each named op site's output observer replaced (``observers``: op site ->
    observer factory, or the name of one in :data:`RANGE_OBSERVERS`)."""

    #: how the setter names itself in its warnings
    label = "ObserverQconfigSetter"

    def __init__(self, observers: Mapping[str, Any], base_setter: Any = default_calibration_qconfig_setter):
        self.observers = {}
        for site, observer in observers.items():
            if isinstance(observer, str):
                if observer not in RANGE_OBSERVERS:
                    raise QuantLensError(f"ObserverQconfigSetter['{site}']: unknown observer {observer!r}; "
                                         f"expected one of {sorted(RANGE_OBSERVERS)} or an observer factory.")
                observer = RANGE_OBSERVERS[observer]
            elif not callable(observer):
                raise QuantLensError(f"ObserverQconfigSetter['{site}'] must be an observer factory or a name, got "
                                     f"{type(observer).__name__}.")
            self.observers[site] = observer
        self.base_setter = base_setter
        # the name carries what each site gets: progress files key their measurements by the setter's name
        chosen = sorted((site, o if isinstance(o, str) else repr(o)) for site, o in observers.items())
        digest = hashlib.sha256(repr(chosen).encode()).hexdigest()[:12]
        self.name = f"observers({len(self.observers)}, {digest}) > {getattr(base_setter, 'name', repr(base_setter))}"

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        """The base assignment with the chosen sites' output observers replaced (a site without an output
        quantization keeps its qconfig, with a warning)."""
        result = resolve_qconfigs(self.base_setter, ctx)
        for site, observer in self.observers.items():
            qconfig = result.qconfigs.get(site)
            if site not in ctx.record.sites:
                result.unmatched.append(unmatched_message(self.label, site, ctx))
                continue
            if qconfig is None or qconfig.output is None:
                result.warnings.append(f"{self.label}: op site '{site}' has no output quantization here; its "
                                       "observer was not changed.")
                continue
            result.qconfigs[site] = qconfig.replace(output=replace(qconfig.output, observer=observer))
        return result
