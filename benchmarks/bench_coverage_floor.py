"""Why a model of the coverage sweep misses "quantized IR vs qat IR": how far each op of the quantized IR is from
the qat IR on the same input (the profiler's same-input error, in output steps) against how far the outputs end
up, with the default and the high-precision requantize profile.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_coverage_floor.py mobilenet_v2 ast levit ...
     OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_coverage_floor.py --frames 1 2 4 16 resemblyzer

Per model it prints the output cosine of the quantized IR against the qat IR (default profile, then with
``meta["high_precision_qpp"]``), the float model against the qat IR, and from ``QuantAnalysis(qat IR, quantized
IR, "convert")`` the worst same-input error of any op site in output steps with the number of op sites not
bit-exact. When every op is within one step of the qat IR on the same input while the outputs drift far apart,
the gap is the network amplifying one-step rounding differences (no kernel is wrong), and no integer rule that
rounds can close it; consistency level >= 1 (the QAT model rounding like the kernels) does.
"""

from __future__ import annotations

import sys
import tempfile
import warnings

import torch

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo.architectures import ARCHITECTURES, build
from quantlens.zoo.coverage import cosine, float_leaves, third_party_case


def _as_args(x):
    return x if isinstance(x, tuple) else (x,)


def floor(name: str) -> dict:
    model, example, batches, held_out = build(name) if name in ARCHITECTURES else third_party_case(name)
    example, held_out = _as_args(example), _as_args(held_out)
    # the architectures are transformers' code without QuantStub; the third-party models are wrapped in stubs
    prepared = calibrate(prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=name in ARCHITECTURES), [_as_args(b) for b in batches])
    qat_ir = export(pre_export(prepared, example_inputs=example), example)
    reference = float_leaves(qat_ir(*held_out))
    out = {"model": name}
    with torch.no_grad():
        out["float vs qat IR"] = cosine(float_leaves(model(*held_out)), reference)
    for key, high in (("default", False), ("high precision", True)):
        qat_ir.meta["high_precision_qpp"] = high
        quantized = convert(qat_ir)
        out[key] = cosine(float_leaves(quantized(*held_out)), reference)
    qat_ir.meta["high_precision_qpp"] = False
    quantized = convert(qat_ir)
    with tempfile.TemporaryDirectory() as tmp:
        qa = QuantAnalysis(qat_ir, quantized, "convert", out_dir=tmp, progress=False)
        qa.set_bad_case(held_out)
        qa.run()
        rows = [r for r in qa.compare_per_layer() if r.same_input_in_scale is not None]
    out["worst same-input steps"] = max((r.same_input_in_scale for r in rows), default=0.0)
    out["sites not bit-exact"] = sum(r.same_input_in_scale > 0 for r in rows)
    out["sites"] = len(rows)
    return out


def frames(name: str, steps: int) -> dict:
    """A sequence model's agreements with its input cut to its first ``steps`` frames (dim 1): how fast the
    recurrence amplifies the int8 rounding (fake quant vs float, quantized IR vs qat IR)."""
    model, example, batches, held_out = third_party_case(name)

    def cut(x):
        return tuple(cut(y) for y in x) if isinstance(x, (tuple, list)) else x[:, :steps]

    example, held_out = _as_args(cut(example)), _as_args(cut(held_out))
    prepared = calibrate(prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None),
                         [_as_args(cut(b)) for b in batches])
    qat_ir = export(pre_export(prepared, example_inputs=example), example)
    with torch.no_grad():
        fake_quant = cosine(float_leaves(prepared(*held_out)), float_leaves(model(*held_out)))
    quantized = cosine(float_leaves(convert(qat_ir)(*held_out)), float_leaves(qat_ir(*held_out)))
    return {"frames": steps, "fake quant vs float": fake_quant, "quantized IR vs qat IR": quantized}


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"torch threads: {torch.get_num_threads()}")
    if names and names[0] == "--frames":
        steps = [int(n) for n in names[1:] if n.isdigit()]
        for name in [n for n in names[1:] if not n.isdigit()]:
            for t in steps:
                r = frames(name, t)
                print(f"{name} T={t}: fake quant vs float {r['fake quant vs float']:.5f}; quantized IR vs qat IR "
                      f"{r['quantized IR vs qat IR']:.5f}", flush=True)
        return
    for name in names:
        r = floor(name)
        print(f"{r['model']}: quantized IR vs qat IR {r['default']:.5f} (high precision {r['high precision']:.5f}); "
              f"float vs qat IR {r['float vs qat IR']:.4f}; worst same-input error {r['worst same-input steps']:.0f} "
              f"step(s), {r['sites not bit-exact']} of {r['sites']} op sites not bit-exact", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["mobilenet_v2"])
