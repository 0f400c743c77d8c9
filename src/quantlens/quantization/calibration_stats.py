"""Calibration statistics reused across configurations of one model (the int16 search's shared calibration).

In ``FakeQuantState.CALIBRATION`` no fake quant rounds anything, so every observer sees the float model's value at
its op site whatever the qconfigs are; and an observer's statistics (``min_val``/``max_val``, a histogram) do not
depend on its dtype, only the scale computed from them does. So a configuration that differs from one calibrated
before only in dtypes (an int16 promotion) or in observers calibrated before at the same op sites can take those
statistics instead of running the calibration batches again: :meth:`CalibrationStats.calibrate` is ``calibrate``
with the forwards replaced by loading the statistics, and gives the same scales bit for bit
(``tests/test_mixed_precision.py``). Where a fake quant's statistics were never seen (another observer at an op
site, another op site), or where scales are shared between fake quants (consistency level 2's groups, level 3+'s
tables), it runs the batches.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState
from quantlens.quantization.stages import calibrate, set_fake_quantize

__all__ = ["CalibrationStats"]


def _signature(key: str, fq: FakeQuantize) -> tuple:
    """What an observer's statistics depend on besides the data: where its fake quant sits (its module path), its
    class, its options and its channel axis (not its dtype)."""
    obs = fq.observer
    return key, type(obs).__qualname__, tuple(sorted(obs._options().items())), obs.ch_axis


def _activation_fqs(model: nn.Module) -> dict[str, FakeQuantize]:
    """Every activation fake quant by its module path: the op sites' (``QuantState.fq``) and those inside
    decomposed ops (an attention's scores and probabilities)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FakeQuantize) and not m.is_weight}


class CalibrationStats:
    """Observer statistics by :func:`_signature`, gathered from the models calibrated through :meth:`calibrate`."""

    def __init__(self) -> None:
        #: signature -> (the observer's buffers, whether its fake quant was calibrated)
        self._states: dict[tuple, tuple[dict[str, torch.Tensor], bool]] = {}
        #: calibrations answered from the statistics, and those that ran the batches
        self.reused = 0
        self.ran = 0

    def calibrate(self, model: nn.Module, batches: Sequence[Any]) -> nn.Module:
        """``calibrate(model, batches)``, from the statistics where every activation observer's are known."""
        if self._reusable(model):
            self._load(model)
            self.reused += 1
            return model
        calibrate(model, batches)
        self.ran += 1
        for key, fq in _activation_fqs(model).items():  # (one no batch reached too: it stays uncalibrated)
            self._states[_signature(key, fq)] = ({k: v.clone() for k, v in fq.observer.state_dict().items()},
                                                 bool(fq.calibrated))
        return model

    def _reusable(self, model: nn.Module) -> bool:
        state = model._quantlens_state
        if getattr(getattr(state, "consistency", None), "tables_in_qat", False):
            return False
        fqs = _activation_fqs(model)
        return bool(fqs) and all(fq.scale_group is None and not fq.pow2_scale and _signature(k, fq) in self._states
                                 for k, fq in fqs.items())

    def _load(self, model: nn.Module) -> None:
        model.eval()
        for key, fq in _activation_fqs(model).items():
            buffers, calibrated = self._states[_signature(key, fq)]
            for name, value in buffers.items():
                fq.observer._buffers[name] = value.clone()  # per-channel buffers are shaped by the first batch
            if calibrated:  # as calibrate: a fake quant no batch reached keeps its placeholder scale
                fq.refresh_scale()
        set_fake_quantize(model, FakeQuantState.VALIDATION)
