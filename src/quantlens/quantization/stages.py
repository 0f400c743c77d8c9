"""The stage functions of a prepared model: :func:`set_fake_quantize` (the fake quants' state, and the lookup
tables of consistency level 3+) and :func:`calibrate` (post-training calibration).

They sit above :mod:`.pre_export`, whose tables they install at level 3+; the fake quants themselves
(:mod:`.fake_quantize`) know nothing of tables.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from quantlens._threads import loop_threads
from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState, nonfinite_sites, switch_fake_quants
from quantlens.quantization.pre_export import install_tables, lut_sites, table_sites
from quantlens.sites.record import inputs_to, model_device

__all__ = ["set_fake_quantize", "calibrate"]


def set_fake_quantize(model: nn.Module, state: FakeQuantState | str) -> nn.Module:
    """Switch every fake quant of a prepared model to ``state``; returns the model for chaining.

    Typical use: ``model.eval(); set_fake_quantize(model, FakeQuantState.CALIBRATION)`` for calibration,
    ``model.train(); set_fake_quantize(model, FakeQuantState.QAT)`` for QAT, and
    ``model.eval(); set_fake_quantize(model, FakeQuantState.VALIDATION)`` to evaluate. With consistency level 3+
    (``tables_in_qat``) a calibrated model switched to QAT or VALIDATION gets its lookup tables here.
    """
    state = switch_fake_quants(model, state)
    state_holder = getattr(model, "_quantlens_state", None)
    if (state_holder is not None and state in (FakeQuantState.QAT, FakeQuantState.VALIDATION)
            and getattr(getattr(state_holder, "consistency", None), "tables_in_qat", False)):
        acts = [m for m in model.modules() if isinstance(m, FakeQuantize) and not m.is_weight]
        uncalibrated = [m for m in acts if not bool(m.calibrated)]
        fresh = len(uncalibrated) == len(acts) and state is FakeQuantState.QAT  # prepare, or QAT from scratch
        if not uncalibrated:
            install_tables(model)
        elif not fresh and not lut_sites(model) and table_sites(state_holder):
            # the tables are built from the calibrated scales: without them this forward runs the float ops, and
            # consistency level 3 would silently not be in effect
            names = ", ".join(getattr(m, "name", "?") for m in uncalibrated[:4])
            more = f" and {len(uncalibrated) - 4} more" if len(uncalibrated) > 4 else ""
            warnings.warn(
                f"set_fake_quantize({state.value}): consistency level {state_holder.consistency.level} computes the "
                f"lookup tables in the QAT forward, but {len(uncalibrated)} activation fake quant(s) are not "
                f"calibrated yet ({names}{more}), so the tables cannot be built and this model runs the float "
                "nonlinear ops. Calibrate first (quantlens.quantization.calibrate(model, batches)): it installs the "
                "tables, and QAT then trains through them.",
                stacklevel=2, category=QuantLensWarning,
            )
    return model


def calibrate(model: nn.Module, batches, *, validate: bool = True) -> nn.Module:
    """Post-training calibration: ``eval()``, CALIBRATION state, one no-grad forward per batch, then (by default)
    VALIDATION. A batch that is a tuple is unpacked as positional arguments. Returns the model."""
    model.eval()
    set_fake_quantize(model, FakeQuantState.CALIBRATION)
    seen = 0
    first_batch = None
    device = model_device(model)  # batches held elsewhere (a CPU data loader) move to the model
    with torch.no_grad(), loop_threads():
        for batch in batches:
            batch = inputs_to(batch, device)
            if first_batch is None:
                first_batch = batch
            try:
                model(*batch) if isinstance(batch, tuple) else model(batch)
            except QuantLensError as exc:
                first = next(iter(nonfinite_sites(model)), None)
                if first is None or "NaN/Inf" not in str(exc):
                    raise
                raise QuantLensError(
                    f"calibrate: batch {seen}: {exc} NaN/Inf first appeared (execution order) at op site '{first}'; "
                    "quantlens.quantization.find_nonfinite(model, batch) tells whether that op produced them."
                ) from None
            seen += 1
    if seen == 0:
        raise QuantLensError("calibrate: the data gave no batch; pass an iterable of model inputs.")
    bad = nonfinite_sites(model)
    if bad:
        shown = ", ".join(f"'{site}' ({', '.join(roles)})" for site, roles in list(bad.items())[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        warnings.warn(
            f"calibrate: the observers of {len(bad)} op site(s) saw NaN/Inf values: {shown}{more}. They were left "
            "out of the statistics, but the model computes non-finite values there (check the first of these op "
            "sites and its inputs: overflow, log/division by zero, NaN in the data). "
            "check_qat_model(model, example_inputs) lists them in model_check_result.txt; "
            "quantlens.quantization.find_nonfinite(model, batch) names the first op site on one batch.",
            stacklevel=2, category=QuantLensWarning,
        )
    state_holder = getattr(model, "_quantlens_state", None)
    if getattr(getattr(state_holder, "consistency", None), "tables_in_qat", False):
        # consistency level 3+: the lookup tables from now on (QAT and VALIDATION compute through them); the
        # first batch tells the call parameters of ops such as pow
        install_tables(model, example_inputs=first_batch)
    if validate:
        set_fake_quantize(model, FakeQuantState.VALIDATION)
    return model
