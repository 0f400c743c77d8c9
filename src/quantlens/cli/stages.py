"""Building the flow's models for ``quantlens analyze``, ``sensitivity`` and the demo: float -> calibration ->
(QAT) -> pre_export -> qat IR (``export``) -> quantized IR (``convert``) [-> ONNX], as the Python flow builds them.

With ``keep_going`` a stage that fails ends the build without raising: :class:`Stages` keeps every model built
before it, with the failed stage and why, so the pairs that could be built are still analysed and reported.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

__all__ = ["Stages", "build_stages", "onnxruntime_available", "STAGE_ORDER"]

#: the stages in build order (``Stages`` attributes)
STAGE_ORDER = ("float", "calibration", "qat", "pre_export", "qat_ir", "quantized_ir", "onnx")


def onnxruntime_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))


@dataclass
class Stages:
    """Every model of the flow; ``qat`` is the calibration model when the flow has no QAT step. ``failed``: the
    stage whose build failed (with ``keep_going``), ``error`` its error in one line; later stages are ``None``."""

    float: Any = None
    calibration: Any = None
    qat: Any = None
    pre_export: Any = None
    qat_ir: Any = None
    quantized_ir: Any = None
    onnx: Any = None  # path of the ONNX file
    files: list[str] = field(default_factory=list)
    failed: str | None = None
    error: str = ""


@dataclass(frozen=True)
class _Flow:
    """What the steps need: the user's pieces as the CONFIG (or the demo) gives them."""

    float_model: torch.nn.Module
    example_inputs: Any
    calibration_data: Callable[[], Iterable[Any]]
    calibration_qconfig_setter: Any
    qat_qconfig_setter: Any
    train_qat: Callable[[torch.nn.Module], None] | None
    out_dir: Path | None
    dynamic_batch: bool
    allow_no_stubs: bool


def _calibration(f: _Flow, s: Stages) -> None:
    from quantlens.quantization import calibrate, prepare

    # out_dir/model_check_result.txt: every op site, where it runs (NPU or host) and why
    s.calibration = prepare(f.float_model, f.example_inputs, f.calibration_qconfig_setter,
                            check_result_dir=f.out_dir, allow_no_stubs=f.allow_no_stubs)
    calibrate(s.calibration, f.calibration_data())
    s.qat = s.calibration


def _qat(f: _Flow, s: Stages) -> None:
    from quantlens.quantization import prepare

    s.qat = prepare(f.float_model, f.example_inputs, f.qat_qconfig_setter or f.calibration_qconfig_setter,
                    check_result_dir=None, allow_no_stubs=f.allow_no_stubs)
    s.qat.load_state_dict(s.calibration.state_dict())
    f.train_qat(s.qat)


def _pre_export(f: _Flow, s: Stages) -> None:
    from quantlens.quantization import pre_export

    # the example inputs, as the Python flow gives them: a norm called as a function (GroupNorm's layer_norm)
    # learns its normalized shape from them
    s.pre_export = pre_export(s.qat, example_inputs=f.example_inputs)


def _export(f: _Flow, s: Stages) -> None:
    from quantlens.compiler import export, save

    s.qat_ir = export(s.pre_export, f.example_inputs, dynamic_batch=f.dynamic_batch)
    if f.out_dir is not None:
        s.files.append(str(save(s.qat_ir, f.out_dir / "qat_ir.qlir")))


def _convert(f: _Flow, s: Stages) -> None:
    from quantlens.compiler import convert, save

    s.quantized_ir = convert(s.qat_ir)
    if f.out_dir is not None:
        s.files.append(str(save(s.quantized_ir, f.out_dir / "quantized_ir.qlir")))


def _onnx(f: _Flow, s: Stages) -> None:
    from quantlens.compiler import to_onnx

    s.onnx = str(to_onnx(s.qat_ir, (f.out_dir or Path(".")) / "qat_ir.onnx"))
    s.files.append(s.onnx)


#: (stage, its step name for the progress line, the step); QAT runs only with ``train_qat``, ONNX only with onnx
_STEPS = (("calibration", "calibration", _calibration), ("qat", "qat", _qat), ("pre_export", "pre_export", _pre_export),
          ("qat_ir", "export", _export), ("quantized_ir", "convert", _convert), ("onnx", "onnx", _onnx))


def build_stages(float_model: torch.nn.Module, example_inputs: Any, calibration_data: Callable[[], Iterable[Any]],
                 calibration_qconfig_setter: Any, *, qat_qconfig_setter: Any = None,
                 train_qat: Callable[[torch.nn.Module], None] | None = None, upto: str = "onnx",
                 out_dir: Path | None = None, dynamic_batch: bool = True, step: Callable[[str], None] | None = None,
                 allow_no_stubs: bool = False, keep_going: bool = False,
                 built: Callable[[str, Stages], None] | None = None) -> Stages:
    """Build the stages up to ``upto`` (a stage name). With ``out_dir`` the IRs (and the ONNX file) are saved
    there. ``train_qat(model)`` trains the QAT model (prepared with ``qat_qconfig_setter``, loaded from the
    calibrated state) and leaves it in eval mode / VALIDATION state; without it QAT is skipped.
    ``allow_no_stubs`` is :func:`~quantlens.quantization.prepare`'s. With ``keep_going`` a failing stage after
    the first is recorded in ``Stages.failed`` / ``Stages.error`` instead of raised (the models before it are
    kept); the first (prepare and calibration) raises, as nothing could be reported. ``built(stage, stages)`` is
    called after each stage is built, so a caller can analyse a pair as soon as its two models exist."""
    flow = _Flow(float_model, example_inputs, calibration_data, calibration_qconfig_setter, qat_qconfig_setter,
                 train_qat, out_dir, dynamic_batch, allow_no_stubs)
    last = STAGE_ORDER.index(upto)
    step = step or (lambda name: None)
    s = Stages(float=float_model.eval())
    for stage, name, run in _STEPS:
        if STAGE_ORDER.index(stage) > last or (stage == "qat" and train_qat is None) or (
                stage == "onnx" and not onnxruntime_available()):
            continue
        step(name)
        try:
            run(flow, s)
        except Exception as exc:  # noqa: BLE001 - a user's model fails in any way; keep_going reports it in words
            if not keep_going or stage == "calibration":  # (nothing built yet: nothing to report but the error)
                raise
            s.failed, s.error = name, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
            setattr(s, stage, None)
            break
        if built is not None:
            built(stage, s)
    return s
