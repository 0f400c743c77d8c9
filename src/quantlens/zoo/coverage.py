"""Run one model through every stage and measure each stage against the one before it (the coverage sweep).

prepare -> calibration -> pre_export -> export (qat IR) -> convert (quantized IR) -> save -> load -> to_onnx ->
onnxruntime at its default options. :func:`run_stages` returns a :class:`CoverageResult`: the first stage that
failed (with its error) and the cosine of each neighbouring pair, measured on one held-out batch:

* ``pre_export`` vs the fake-quant model (calibrated, VALIDATION state),
* ``qat IR`` vs ``pre_export``,
* ``quantized IR`` vs ``qat IR`` (consistency strategy off),
* ``loaded`` vs ``quantized IR`` (save -> load must not change a number),
* ``onnxruntime`` (default options) vs ``qat IR``.

``benchmarks/bench_coverage.py`` runs it over :mod:`quantlens.zoo.architectures` and the real models
(``docs/coverage_zoo.md``), and with ``--auto`` over every transformers model class that builds with a tiny config
(:mod:`quantlens.zoo.auto_architectures`, ``docs/coverage.md``).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from quantlens.compiler import convert, export, load, save, to_onnx
from quantlens.compiler.host_ops import draws_random
from quantlens.compiler.output_containers import register_containers_of
from quantlens.errors import QuantLensError
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.quantization.pre_export import lut_errors
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)
from quantlens.zoo.onnx_same_input import worst_onnx_same_input_step

__all__ = ["STAGES", "PAIRS", "THRESHOLDS", "PRE_EXPORT_PAIR", "ONNXRUNTIME_PAIR", "CONVERT_STEPS", "NOT_EXPORTABLE", "CoverageResult", "run_stages", "cosine",
           "float_leaves", "third_party_case", "worst_same_input_step", "torch_exports"]

#: the stages in order; a result's ``failed_stage`` is one of them
STAGES = ("float", "prepare", "calibration", "pre_export", "export", "convert", "save/load", "to_onnx",
          "onnxruntime")
#: the agreements measured: (name, model measured, model it is meant to keep)
PAIRS = (("pre_export vs fake quant", "pre_export", "calibration"),
         ("qat IR vs pre_export", "export", "pre_export"),
         ("quantized IR vs qat IR", "convert", "export"),
         ("loaded vs quantized IR", "save/load", "convert"),
         ("onnxruntime vs qat IR", "onnxruntime", "export"))
#: the convert criterion for random-weight nets (issue #41): the quantized IR passes when it reaches its cosine
#: threshold, or when every op is within this many output steps of the qat IR on the same input (the profiler's
#: same-input run): a network that amplifies rounding then loses no more than the march's one rounding per op
CONVERT_STEPS = 1.0
#: the profiler's error in steps is a float32 |diff| over a float32 scale: one step can read 1.000005
_STEP_TOLERANCE = 1e-3
CONVERT_PAIR = "quantized IR vs qat IR"
#: the pair of the table ops, which has the same per-op criterion as the convert pair
PRE_EXPORT_PAIR = "pre_export vs fake quant"
#: the pair a model that draws random numbers cannot have (:attr:`CoverageResult.random_draws`)
ONNXRUNTIME_PAIR = "onnxruntime vs qat IR"
#: the least cosine each agreement must reach (issue #22's must-show)
THRESHOLDS = {"pre_export vs fake quant": 0.99, "qat IR vs pre_export": 0.9999, "quantized IR vs qat IR": 0.998,
              "loaded vs quantized IR": 1.0, "onnxruntime vs qat IR": 0.999}
SETTERS = {"int8": default_calibration_qconfig_setter, "w8a16": calibration_8bit_weight_16bit_act_qconfig_setter}


@dataclass
class CoverageResult:
    """One model's run: the first failing stage (None: all passed), its error, and the pair cosines."""

    name: str
    qconfig: str
    failed_stage: str | None = None
    error: str = ""
    agreements: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    #: when the quantized IR misses its cosine: the largest same-input error of any op on the NPU, in output steps
    convert_worst_step: float | None = None
    #: when pre_export misses its cosine: the largest error of any table on its own input, in output steps
    #: (``quantization.pre_export.lut_errors`` on the held-out batch)
    pre_export_worst_step: float | None = None
    #: when onnxruntime misses its cosine: the largest error of any stretch between two fake quants of the ONNX model
    #: on the qat IR's own inputs, in output steps (:func:`quantlens.zoo.onnx_same_input.worst_onnx_same_input_step`)
    onnxruntime_worst_step: float | None = None
    #: the model draws random numbers in forward (ViT-MAE's masking): onnxruntime draws its own, so the onnxruntime
    #: pair is not measured (the torch stages and the IRs draw torch's, seeded alike)
    random_draws: bool = False

    @property
    def passed(self) -> bool:
        """Every stage ran and every agreement reached its threshold (the convert pair by :data:`CONVERT_STEPS`
        where its cosine falls short)."""
        expected = [name for name in THRESHOLDS if not (self.random_draws and name == ONNXRUNTIME_PAIR)]
        return self.failed_stage is None and all(name in self.agreements for name in expected) and not self.below()

    def below(self) -> list[str]:
        """The agreements under their threshold (the convert pair: unless every op is within one step)."""
        return [name for name in THRESHOLDS
                if name in self.agreements and not self.agreements[name] >= THRESHOLDS[name] - 1e-9  # (NaN: below)
                and not _within_steps(self.worst_step(name))]

    def worst_step(self, pair: str) -> float | None:
        """The per-op criterion's measure of ``pair`` (None: not measured, the pair reached its cosine or has none)."""
        return {CONVERT_PAIR: self.convert_worst_step, PRE_EXPORT_PAIR: self.pre_export_worst_step,
                ONNXRUNTIME_PAIR: self.onnxruntime_worst_step}.get(pair)


def _within_steps(worst: float | None) -> bool:
    """The per-op criterion: every op measured on its own input within :data:`CONVERT_STEPS` output steps."""
    return worst is not None and worst <= CONVERT_STEPS + _STEP_TOLERANCE


def float_leaves(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model output (any pytree: tuples, dicts, ``ModelOutput``)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    register_containers_of(out)  # a library's container (transformers' cache) flattens as the IR flattens it
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine of the concatenated flattened leaves (1.0 when both are all zeros)."""
    if len(a) != len(b):
        raise QuantLensError(f"cosine: {len(a)} output tensors against {len(b)}")
    x = torch.cat([t.detach().double().flatten() for t in a])
    y = torch.cat([t.detach().double().flatten() for t in b])
    nx, ny = x.norm(), y.norm()
    if nx == 0 and ny == 0:
        return 1.0
    if nx == 0 or ny == 0:
        return 0.0
    return float((x @ y) / (nx * ny))


def _call(model: Callable, inputs: Any) -> list[torch.Tensor]:
    """The model's float outputs on ``inputs``; a model that draws random numbers in ``forward`` (ViT-MAE's masking,
    a VAE's sampling) draws the same ones at every stage, so that the stages are compared on one input."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    return float_leaves(out)


def _onnx_outputs(path: Path, ir, inputs: Any) -> list[torch.Tensor]:
    import onnxruntime as ort

    options = ort.SessionOptions()  # onnxruntime's default options (ORT_ENABLE_ALL)
    options.log_severity_level = 3
    options.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    feeds = {name: t.numpy() for name, t in zip(ir.graph.inputs, tensors)}
    outs = sess.run(None, feeds)
    return [torch.from_numpy(o) for o in outs if o.dtype.kind == "f"]


def _steps(model, example, batches, qconfig: str, folder: Path, onnx: bool,
           dynamic_batch: bool = False) -> list[tuple[str, Callable]]:
    """(stage, step) in order; a step takes the results so far ({stage: model}) and returns the stage's model."""
    def prepare_stage(_):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return prepare(model, example, SETTERS[qconfig], check_result_dir=None, allow_no_stubs=True)

    steps = [("float", lambda _: model.eval()), ("prepare", prepare_stage),
             ("calibration", lambda st: calibrate(st["prepare"], batches)),
             ("pre_export", lambda st: pre_export(st["calibration"], example_inputs=example)),
             ("export", lambda st: export(st["pre_export"], example, dynamic_batch=dynamic_batch)),
             ("convert", lambda st: convert(st["export"])),
             ("save/load", lambda st: load(save(st["convert"], folder / "model.qlir")))]
    if onnx:
        steps.append(("to_onnx", lambda st: to_onnx(st["export"], folder / "model.onnx")))
    return steps


def run_stages(name: str, model: torch.nn.Module, example: Any, batches: list, held_out: Any,
               qconfig: str = "int8", *, onnx: bool = True, dynamic_batch: bool = False) -> CoverageResult:
    """Take ``model`` through every stage (see the module docstring); never raises for a stage's failure. With
    ``dynamic_batch`` the IR keeps dim 0 of its inputs dynamic: ``held_out`` may then have another batch size than
    ``example``."""
    result = CoverageResult(name, qconfig)
    outs: dict[str, list[torch.Tensor]] = {}
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="quantlens_coverage_") as tmp:
        for stage, step in _steps(model, example, batches, qconfig, Path(tmp), onnx, dynamic_batch):
            start = time.perf_counter()
            try:
                state[stage] = step(state)
                if stage not in ("prepare", "to_onnx"):
                    outs[stage] = _call(state[stage], held_out)
            except Exception as exc:  # noqa: BLE001 - the sweep records every failure, whatever its type
                result.failed_stage, result.error = stage, f"{type(exc).__name__}: {exc}"
                break
            finally:
                result.seconds[stage] = time.perf_counter() - start
        result.random_draws = "export" in state and draws_random(state["export"].graph)
        if onnx and result.failed_stage is None:
            try:
                outs["onnxruntime"] = _onnx_outputs(state["to_onnx"], state["export"], held_out)
                if result.random_draws:  # (it ran: onnxruntime takes the file; its own draws are not compared)
                    outs.pop("onnxruntime")
                elif cosine(outs["onnxruntime"], outs["export"]) < THRESHOLDS[ONNXRUNTIME_PAIR] - 1e-9:
                    # (NaN stays below) onnxruntime's own float kernels round differently from torch's: the per-op
                    # criterion on the same input (the ONNX file lives in this folder)
                    result.onnxruntime_worst_step = worst_onnx_same_input_step(state["export"], state["to_onnx"],
                                                                               held_out)
            except Exception as exc:  # noqa: BLE001
                result.failed_stage, result.error = "onnxruntime", f"{type(exc).__name__}: {exc}"
    for pair, measured, reference in PAIRS:
        if measured in outs and reference in outs:
            result.agreements[pair] = cosine(outs[measured], outs[reference])
    if result.agreements.get(PRE_EXPORT_PAIR, 1.0) < THRESHOLDS[PRE_EXPORT_PAIR] - 1e-9:  # (NaN stays below)
        # the same criterion as convert's: each table within one output step of the float op it replaces, on the
        # same input (a random-weight net that amplifies a step as levit and mobilevit do passes; a wrong table not)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            errors = lut_errors(state["pre_export"], held_out if isinstance(held_out, tuple) else (held_out,))
        result.pre_export_worst_step = max(errors.values(), default=0.0)
    if result.agreements.get(CONVERT_PAIR, 1.0) < THRESHOLDS[CONVERT_PAIR] - 1e-9:
        result.convert_worst_step = worst_same_input_step(state["export"], state["convert"], held_out)
    if result.failed_stage == "export" and not torch_exports(model, example):
        # out of quantlens' reach: torch.export refuses the float model itself (data-dependent control flow)
        result.failed_stage, result.error = NOT_EXPORTABLE, f"torch.export of the float model fails too; {result.error}"
    return result


#: the failed stage of a model that torch.export cannot export even in float (issue #41: "any model torch.export
#: can export goes through every stage"); the sweep counts such models apart
NOT_EXPORTABLE = "not exportable"


def torch_exports(model: torch.nn.Module, example: Any) -> bool:
    """Whether ``torch.export.export`` (non-strict, as quantlens exports) takes the float model on ``example``."""
    args = example if isinstance(example, tuple) else (example,)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.export.export(model, args, strict=False)
    except Exception:  # noqa: BLE001 - any refusal of torch.export's means the same here
        return False
    return True


def worst_same_input_step(qat_ir, quantized, held_out: Any) -> float:
    """The largest error of any NPU op of ``quantized`` against ``qat_ir`` re-run on the qat IR's own inputs, in
    units of the op's output step (the profiler's same-input run on ``held_out``); host ops are float and left out."""
    from quantlens.profiler import QuantAnalysis

    with tempfile.TemporaryDirectory(prefix="quantlens_coverage_") as tmp:
        qa = QuantAnalysis(qat_ir, quantized, "convert", out_dir=tmp, progress=False)
        qa.set_bad_case(held_out if isinstance(held_out, tuple) else (held_out,))
        qa.run()
        rows = [r for r in qa.compare_per_layer() if r.same_input_in_scale is not None and not r.host_side]
    return max((float(r.same_input_in_scale) for r in rows), default=0.0)


def third_party_case(name: str) -> tuple[torch.nn.Module, Any, list, Any]:
    """``(model, example, calibration batches, held-out inputs)`` of a real model of ``quantlens.zoo.third_party``
    (its evaluation inputs, or their first call for a model run call by call)."""
    from quantlens.zoo.third_party import load_third_party

    entry = load_third_party(name)
    torch.manual_seed(0)
    model = entry.build()
    example, batches, evaluation, _ = entry.data()
    held_out = evaluation[0] if entry.per_call else evaluation
    # the IR is exported with the example's static batch (as on the NPU): the last rows of the evaluation inputs
    batch = next(t.shape[0] for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor) and t.dim())
    held_out = pytree.tree_map(lambda t: t[-batch:] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] > batch
                               else t, held_out)
    return model, example, list(batches), held_out
