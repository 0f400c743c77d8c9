"""The analyze CONFIG file: a Python file that defines the models, the data and the settings.

``quantlens analyze --gen CONFIG.py`` writes :data:`TEMPLATE` (the bundled digits CNN), which runs as written.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quantlens.cli.exits import UsageError

__all__ = ["Config", "load_config", "TEMPLATE", "REQUIRED", "OPTIONAL"]

REQUIRED = ("float_model", "example_inputs", "calibration_data")
OPTIONAL = ("evaluation_data", "calibration_qconfig_setter", "qat_qconfig_setter", "train_qat", "post_process",
            "march", "dynamic_batch", "num_steps", "evaluate", "higher_is_better", "allow_no_stubs")

TEMPLATE = '''\
"""quantlens analyze configuration (written by `quantlens analyze --gen`).

Run it with:   quantlens analyze THIS_FILE.py [--stage all] [--out DIR]

`quantlens analyze` imports this file and reads the names below. Required: float_model, example_inputs,
calibration_data. Everything else is optional and has the default shown. The stages are
float -> calibration -> (QAT, when train_qat is defined) -> pre_export -> qat IR (export) -> quantized IR (convert)
[-> ONNX, with quantlens[onnx]], and each --stage compares one pair of neighbouring stages:

    fake_quant   float model    vs calibration (or QAT) model
    pre_export   QAT model      vs pre_export (integer lookup tables)
    export       pre_export     vs qat IR
    convert      qat IR         vs quantized IR
    onnxruntime  qat IR         vs its ONNX file run by onnxruntime
"""

import torch

from quantlens.quantization.qconfig_template import (
    default_calibration_qconfig_setter,
    default_qat_qconfig_setter,
)
from quantlens.zoo import digits_cnn, load_digits_data

# The march (integer NPU) to target; see docs/march.md.
march = "QL1"

# A model without QuantStub is refused (a forgotten stub is the usual cause). For third-party code you do not
# edit, set True: its float inputs are then quantized where the first op sites consume them.
allow_no_stubs = False

_data = load_digits_data()  # scikit-learn's 8x8 digits, split 1437 train / 360 test


def float_model() -> torch.nn.Module:
    """The trained float model, with QuantStub / DeQuantStub at its deployment boundaries."""
    return digits_cnn(pretrained=True).eval()


def example_inputs():
    """One call's inputs (prepare's convention: a tuple is positional arguments, anything else the single
    argument). Also the export example: the IR is exported with a dynamic batch (see dynamic_batch)."""
    return _data.x_train[:8]


def calibration_data():
    """Iterable of inputs the calibration observers see (each item: one call's inputs)."""
    return (_data.x_train[i : i + 128] for i in range(0, len(_data.x_train), 128))


def evaluation_data():
    """Iterable of inputs searched for each stage pair's bad case (default: calibration_data())."""
    return [_data.x_test[i : i + 32] for i in range(0, 96, 32)]


# The qconfig setters: templates from quantlens.quantization.qconfig_template, a tuple of them, or
# ModuleNameQconfigSetter({"relu2": qconfig}) for one op site. The first setter that assigns an op site wins.
calibration_qconfig_setter = default_calibration_qconfig_setter
qat_qconfig_setter = default_qat_qconfig_setter


def train_qat(model: torch.nn.Module) -> None:
    """Train the QAT model (prepared with qat_qconfig_setter, loaded from the calibrated scales). Leave it in
    eval mode and the VALIDATION state. Delete this function to skip QAT (pre_export then takes the
    calibration model)."""
    from quantlens.quantization import FakeQuantState, set_fake_quantize

    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    x, y = _data.x_train, _data.y_train
    order = torch.randperm(len(x), generator=generator)
    for i in range(0, len(x), 64):
        idx = order[i : i + 64]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
    model.eval()
    set_fake_quantize(model, FakeQuantState.VALIDATION)


def evaluate(model: torch.nn.Module) -> float:
    """The task metric of any stage's model (here: test accuracy; higher is better, or set
    higher_is_better = False). `quantlens fix` searches remedies on it; delete it to use the output cosine
    against the float model instead."""
    with torch.no_grad():
        return float((model(_data.x_test).argmax(1) == _data.y_test).float().mean())


# Host-side post-processing applied to both models' outputs and compared like an output (None: none).
post_process = None

# Export the IR with a dynamic batch dimension (the bad-case batches may then have any size).
dynamic_batch = True

# How many items of evaluation_data() the bad-case search reads (None: all).
num_steps = None
'''


@dataclass
class Config:
    path: Path
    float_model: Callable[[], Any]
    example_inputs: Callable[[], Any]
    calibration_data: Callable[[], Any]
    evaluation_data: Callable[[], Any] | None = None
    calibration_qconfig_setter: Any = None
    qat_qconfig_setter: Any = None
    train_qat: Callable[[Any], None] | None = None
    post_process: Any = None
    march: Any = None
    dynamic_batch: bool = True
    num_steps: int | None = None
    #: ``evaluate(model) -> float``: the task metric of any stage's model (``quantlens fix`` searches on it)
    evaluate: Callable[[Any], float] | None = None
    higher_is_better: bool = True
    #: accept a float model without QuantStub (third-party code): ``prepare(..., allow_no_stubs=True)``
    allow_no_stubs: bool = False


def _as_factory(value: Any) -> Callable[[], Any]:
    return value if callable(value) and not hasattr(value, "forward") else (lambda: value)


def load_config(path: str | Path, debug: bool = False) -> Config:
    """Import the CONFIG file and check the names it defines; any problem is a :class:`UsageError`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"CONFIG {str(path)!r} does not exist. Write a template with "
                         f"'quantlens analyze --gen {path}'.")
    if path.suffix != ".py":
        raise UsageError(f"CONFIG {str(path)!r} must be a Python file (.py).")
    name = f"_quantlens_config_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: report where it failed
        if debug:
            raise
        frame = next((f for f in reversed(traceback.extract_tb(exc.__traceback__))
                      if Path(f.filename).resolve() == path.resolve()), None)
        where = f" (line {frame.lineno}: {frame.line})" if frame else ""
        raise UsageError(f"CONFIG {path} failed to load{where}: {type(exc).__name__}: {exc}") from None
    missing = [n for n in REQUIRED if not hasattr(module, n)]
    if missing:
        raise UsageError(f"CONFIG {path} does not define {', '.join(missing)}. Required: {', '.join(REQUIRED)}; "
                         f"optional: {', '.join(OPTIONAL)}. 'quantlens analyze --gen FILE.py' writes a template.")
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    get = lambda n, d=None: getattr(module, n, d)  # noqa: E731
    if not callable(module.float_model):
        raise UsageError(f"CONFIG {path}: float_model must be a function returning the float torch model.")
    return Config(
        path=path,
        float_model=module.float_model,
        example_inputs=_as_factory(module.example_inputs),
        calibration_data=_as_factory(module.calibration_data),
        evaluation_data=_as_factory(get("evaluation_data")) if get("evaluation_data") is not None else None,
        calibration_qconfig_setter=get("calibration_qconfig_setter") or default_calibration_qconfig_setter,
        qat_qconfig_setter=get("qat_qconfig_setter"),
        train_qat=get("train_qat"),
        post_process=get("post_process"),
        march=get("march"),
        dynamic_batch=_typed(path, module, "dynamic_batch"),
        num_steps=_typed(path, module, "num_steps"),
        evaluate=_callable_or_none(path, "evaluate", get("evaluate")),
        higher_is_better=_typed(path, module, "higher_is_better"),
        allow_no_stubs=_typed(path, module, "allow_no_stubs"),
    )


#: the CONFIG's plain settings: their default, and what a value must be (``bool("False")`` is True: a string where a
#: bool belongs is refused, not read)
_SETTINGS: dict[str, tuple[Any, str, Callable[[Any], bool]]] = {
    "dynamic_batch": (True, "True or False", lambda v: isinstance(v, bool)),
    "higher_is_better": (True, "True or False", lambda v: isinstance(v, bool)),
    "allow_no_stubs": (False, "True or False", lambda v: isinstance(v, bool)),
    "num_steps": (None, "None or a whole number >= 1",
                  lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)),
}


def _typed(path: Path, module: Any, name: str) -> Any:
    default, expected, valid = _SETTINGS[name]
    value = getattr(module, name, default)
    if not valid(value):
        raise UsageError(f"CONFIG {path}: {name} = {value!r} ({type(value).__name__}); expected {expected}. "
                         f"Write e.g. '{name} = {default!r}'." if default is not None else
                         f"CONFIG {path}: {name} = {value!r} ({type(value).__name__}); expected {expected}.")
    return value


def _callable_or_none(path: Path, name: str, value: Any) -> Callable | None:
    if value is not None and not callable(value):
        raise UsageError(f"CONFIG {path}: {name} must be a function, got {type(value).__name__}.")
    return value
