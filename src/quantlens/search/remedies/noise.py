"""The metric's noise around a configuration: how far its metric moves when nothing that matters changes
(``docs/remedies.md``, "The metric's noise").

A remedy's gain is the difference of two measurements. A gain smaller than what the metric moves by on its own
cannot be told from chance, so the search keeps a remedy only when it gains more than the noise of the
configuration it improves on (the base first, then the configuration after each kept remedy: a configuration
whose ranges are fixed moves less with the calibration sample than min/max does). The noise is the largest move
of the configuration's metric, away from its first measurement, over:

* the same configuration measured again (prepare, calibrate, evaluate): the nondeterminism of the pipeline and of
  ``evaluate`` (threads, a GPU, sampling inside ``evaluate``); 0 for a deterministic one;
* the same configuration calibrated without one calibration batch (each of the first :data:`LEAVE_OUT`
  batches in turn, when there are at least two): an equally valid calibration sample. A remedy that gains less
  than a calibration sample's luck moves the metric by has not shown that it helps.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

__all__ = ["LEAVE_OUT", "measure_noise"]

#: how many calibration batches are left out in turn (each costs one measurement)
LEAVE_OUT = 2


def measure_noise(measure: Any, model: nn.Module, setter: Any, value: float, key: str) -> float:
    """The noise of ``measure``'s metric around ``value`` (the configuration's first measurement, under ``key``),
    see the module docstring; ``measure(model, setter, key, batches)`` measures one configuration (replayed on a
    resumed search). A non-finite move counts as none (a NaN metric has no scale)."""
    batches = list(measure.batches)
    moves = [measure(model, setter, f"{key}|noise again")]
    if len(batches) > 1:
        moves += [measure(model, setter, f"{key}|noise without batch {i}", batches[:i] + batches[i + 1:])
                  for i in range(min(LEAVE_OUT, len(batches)))]
    spread = [abs(v - value) for v in moves if math.isfinite(v - value)]
    return max(spread, default=0.0)
