"""The table-op registry and the table ops of ``docs/march.md`` §13.4.1 (sqrt, rsqrt, log, pow, erf, hardswish,
hardsigmoid, elu).

* the registry (``quantization.table_registry.TABLE_OP_SPECS``) names exactly the op set's ``table=True`` op types,
  and every stage it relies on has the op (float reference IR op, lowering, ONNX converter);
* hand-computed table entries (each worked out in the comment next to it, and in docs/march.md §13.4.1);
* pre_export output vs the QAT model on the same input: within 1 output step;
* end to end, QuantStub -> conv -> op -> DeQuantStub through prepare, calibrate, pre_export, export and convert:
  the quantized IR equals the pre_export model BIT-EXACTLY; ONNX (float op between Q/DQ) within 1 output step.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlens.compiler  # noqa: F401  (registers every stage)
from quantlens.compiler import convert, export, lowering
from quantlens.compiler.onnx import ONNX_CONVERTERS
from quantlens.errors import QuantLensError
from quantlens.kernels import ELEMENTWISE_OPS, TABLE_OP_IO, elementwise_table, real_function
from quantlens.march import QuantDType
from quantlens.march.opset import IR_OPS, OPS
from quantlens.quantization import (
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    calibrate,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.pre_export import TABLE_OPS, lut_errors, lut_sites, pre_export, pre_export_report
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)
from quantlens.quantization.table_overrides import ElementwiseOverride, override_class
from quantlens.quantization.table_registry import TABLE_OP_SPECS, table_op_spec

I8, I16 = QuantDType.qint8, QuantDType.qint16
SETTERS = {"int8": default_calibration_qconfig_setter, "int16": calibration_8bit_weight_16bit_act_qconfig_setter}
NEW_OPS = ("sqrt", "rsqrt", "log", "pow", "erf", "hardswish", "hardsigmoid", "elu")
#: lut_errors compares dequantized float32 values: one step is 1 up to float32 rounding of q * s (int16: |q| < 2**15)
ONE_STEP = 1.01


def _codes(t: torch.Tensor, step: float) -> torch.Tensor:
    """The integer codes of a dequantized output (q * s in float32 divides back to q exactly after rounding)."""
    return torch.round(t.double() / step).long()


# -- the registry ----------------------------------------------------------------------------------------------
def test_registry_keys_are_the_op_sets_table_ops():
    assert set(TABLE_OP_SPECS) == {name for name, op in OPS.items() if op.table}
    assert set(NEW_OPS) <= set(TABLE_OP_SPECS)
    assert TABLE_OPS == tuple(TABLE_OP_SPECS)
    assert tuple(ELEMENTWISE_OPS) == tuple(n for n, s in TABLE_OP_SPECS.items() if s.elementwise)
    assert {"div", "softmax", "layer_norm"}.isdisjoint(ELEMENTWISE_OPS)


@pytest.mark.parametrize("op_type", sorted(TABLE_OP_SPECS))
def test_every_table_op_is_declared_by_every_stage_it_needs(op_type):
    spec, op = TABLE_OP_SPECS[op_type], OPS[op_type]
    assert spec.op_type == op_type and op.table
    # the IR ops its overrides emit are the table ops of kernels.ops (one declaration: TABLE_OP_IO)
    assert set(op.ir) & set(TABLE_OP_IO), op.ir
    if spec.elementwise:
        assert override_class(spec.kind) is ElementwiseOverride
        assert op.ir == ("lut", "segment_lut") and op.march == "§13.4"
        # export names the float op a lut emulates by op type; ONNX and the float qat IR need that IR op
        assert op_type in IR_OPS and not IR_OPS[op_type].convert
        assert op_type in ONNX_CONVERTERS
        assert op_type in lowering.TORCH_OPS
        assert spec.int16 in ("segmented", "mantissa_reciprocal")


def test_real_function_reads_the_registry():
    x = torch.tensor([-4.0, -1.0, 0.0, 0.25, 4.0], dtype=torch.float64)
    assert real_function("sqrt")(x).tolist() == [0.0, 0.0, 0.0, 0.5, 2.0]
    assert real_function("rsqrt")(x).tolist() == [float("inf")] * 3 + [2.0, 0.5]
    assert real_function("log")(x)[:3].tolist() == [float("-inf")] * 3
    assert real_function("pow", exponent=0.5)(x).tolist() == [0.0, 0.0, 0.0, 0.5, 2.0]
    assert real_function("pow", exponent=3)(x).tolist() == [-64.0, -1.0, 0.0, 0.015625, 64.0]
    assert real_function("elu", alpha=2.0)(x)[4].item() == 4.0
    with pytest.raises(QuantLensError, match="No lookup-table function for op type 'softmax'"):
        real_function("softmax")
    with pytest.raises(QuantLensError, match="not a table op"):
        table_op_spec("conv2d")


# -- hand-computed entries (int8 in and out, s_in = 1/16; docs/march.md §13.4.1) --------------------------------
HAND = [
    # sqrt, s_out = 1/32: y = rhe(sqrt(q/16) * 32) = rhe(8 sqrt(q)): 8*2 = 16; 8*1.41421 = 11.31 -> 11;
    # 8*3 = 24; 8*11.2694 = 90.16 -> 90; x < 0 is 0 (the domain rule)
    ("sqrt", {}, 1 / 32, {4: 16, 2: 11, 9: 24, 127: 90, 0: 0, -5: 0}),
    # rsqrt, s_out = 1/32: y = rhe(32 / sqrt(q/16)) = rhe(128 / sqrt(q)): 128/4 = 32; 128/8 = 16;
    # 128/1.41421 = 90.51 -> 91; 128 -> 127 (saturated); x <= 0 is +inf -> 127
    ("rsqrt", {}, 1 / 32, {16: 32, 64: 16, 2: 91, 1: 127, 0: 127, -3: 127}),
    # log, s_out = 1/32: y = rhe(32 ln(q/16)): ln 1 = 0; 32 ln 2 = 22.18 -> 22; 32 ln(1/16) = -88.72 -> -89;
    # 32 ln(7.9375) = 66.29 -> 66; x <= 0 is -inf -> -128
    ("log", {}, 1 / 32, {16: 0, 32: 22, 1: -89, 127: 66, 0: -128, -7: -128}),
    # pow 2, s_out = 1/8: y = rhe((q/16)^2 * 8) = rhe(q^2 / 32): 16/32 = 0.5 -> 0 (tie to even);
    # 144/32 = 4.5 -> 4; 400/32 = 12.5 -> 12; 64/32 = 2; 4096/32 = 128 -> 127
    ("pow", {"exponent": 2}, 1 / 8, {4: 0, 12: 4, -12: 4, 20: 12, -8: 2, 64: 127}),
    # pow 0.5 is sqrt (same scales); a non-integer power of x < 0 reads max(x, 0): 0
    ("pow", {"exponent": 0.5}, 1 / 32, {4: 16, 2: 11, 9: 24, -5: 0}),
    # pow 3, s_out = 1/8: y = rhe(q^3 / 512): 512/512 = 1; -4096/512 = -8; -64000/512 = -125;
    # -68921/512 = -134.6 -> -128 (saturated)
    ("pow", {"exponent": 3}, 1 / 8, {8: 1, -16: -8, -40: -125, -41: -128}),
    # pow -1, s_out = 1/8: y = rhe(128 / q); 0 ** -1 = +inf -> 127
    ("pow", {"exponent": -1}, 1 / 8, {16: 8, -16: -8, 32: 4, 0: 127}),
    # erf, s_out = 1/128: erf(1) = 0.842701 -> 107.87 -> 108; erf(0.5) = 0.520500 -> 66.62 -> 67; erf(4) -> 127
    ("erf", {}, 1 / 128, {16: 108, 8: 67, -16: -108, 64: 127}),
    # hardswish, s_out = 1/16: y = rhe(16 x clip(x/6 + 1/2, 0, 1)): x = 1: 16 * 2/3 = 10.67 -> 11;
    # x = -1: -16/3 = -5.33 -> -5; x = 0.5: 8 * 0.58333 = 4.67 -> 5; x = 3: 48; x = -3: 0
    ("hardswish", {}, 1 / 16, {16: 11, -16: -5, 8: 5, 48: 48, -48: 0}),
    # hardsigmoid, s_out = 1/128: y = rhe(128 clip(x/6 + 1/2, 0, 1)): 64; 128 * 2/3 = 85.33 -> 85;
    # 128/3 = 42.67 -> 43; 128 -> 127; 0
    ("hardsigmoid", {}, 1 / 128, {0: 64, 16: 85, -16: 43, 48: 127, -48: 0}),
    # elu alpha = 0.5, s_out = 1/32: x > 0: 32x = 2q: 20; 128 -> 127; x <= 0: 16 (e^x - 1):
    # 16 (e^-1 - 1) = -10.11 -> -10; 16 (e^-8 - 1) = -15.99 -> -16
    ("elu", {"alpha": 0.5}, 1 / 32, {10: 20, 64: 127, -16: -10, -128: -16}),
]


@pytest.mark.parametrize("op_type, params, s_out, expected", HAND,
                         ids=[f"{h[0]}{h[1].get('exponent', '')}" for h in HAND])
def test_int8_table_entries_hand_computed(op_type, params, s_out, expected):
    table = elementwise_table(op_type, 1 / 16, s_out, I8, I8, **params)
    codes = list(expected)
    assert dict(zip(codes, table.lookup(torch.tensor(codes)).tolist())) == expected
    assert not torch.isnan(table.entries.double()).any()


def test_int16_segmented_tables_hand_computed():
    # sqrt, s_in = 2**-8, s_out = 2**-7: y = rhe(sqrt(q / 256) * 128) = rhe(8 sqrt(q)): 8*16 = 128; 8*32 = 256;
    # the right tail is 8 sqrt(32767) = 1448.1 -> 1448; every q <= 0 gives 0 (the left tail)
    sqrt = elementwise_table("sqrt", 2.0**-8, 2.0**-7, I16, I16)
    assert sqrt.tails.tolist() == [0, 1448]
    assert sqrt.lookup(torch.tensor([256, 1024, 0, -100, -32768, 32767])).tolist() == [128, 256, 0, 0, 0, 1448]
    # log, s_in = 2**-8, s_out = 2**-12: y = rhe(4096 ln(q / 256)): 0; 4096 ln 2 = 2839.13 -> 2839;
    # q <= 0 is -inf: the output minimum, -32768 (the left tail)
    log = elementwise_table("log", 2.0**-8, 2.0**-12, I16, I16)
    assert log.tails[0].item() == -32768
    assert log.lookup(torch.tensor([256, 512, 0, -100])).tolist() == [0, 2839, -32768, -32768]


# -- pre_export on a model with every new op, called as functions, methods, operators and modules ---------------
class _AllOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.lin = nn.Linear(8, 8)
        self.hswish, self.hsig, self.elu = nn.Hardswish(), nn.Hardsigmoid(), nn.ELU(alpha=0.7)

    def forward(self, x):
        h = self.lin(self.quant(x))
        p = h.abs() + 0.25  # positive: the domain of sqrt, rsqrt, log and a non-integer power
        outs = [torch.sqrt(p), torch.rsqrt(p), torch.log(p), h ** 2, torch.pow(p, 0.5), h.pow(3), F.hardswish(h),
                F.hardsigmoid(h), F.elu(h, alpha=0.5), torch.erf(h), self.hswish(h), self.hsig(h), self.elu(h)]
        return self.dequant(torch.stack(outs))


ALL_SITES = ["sqrt_0", "rsqrt_0", "log_0", "pow_0", "pow_1", "pow_2", "hardswish_0", "hardsigmoid_0", "elu_0",
             "erf_0", "hswish", "hsig", "elu"]


def _batch(gen):
    return (torch.randn(4, 8, generator=gen) * 2,)


@functools.lru_cache(maxsize=None)
def _all_ops(act: str):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    example = _batch(gen)
    model = prepare(_AllOps(), example, SETTERS[act], check_result_dir=None)
    calibrate(model, [_batch(gen) for _ in range(4)])
    return model, example, pre_export(model, example_inputs=example)


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_every_new_op_is_a_table_site_within_one_step_of_qat(act):
    model, example, result = _all_ops(act)
    assert lut_sites(result) == ALL_SITES
    kinds = {i.site: i.table_kind for i in pre_export_report(result)}
    assert set(kinds.values()) == {"table256" if act == "int8" else "segmented"}
    params = {i.site: i for i in pre_export_report(result)}
    assert params["elu_0"].op_type == "elu" and params["pow_0"].op_type == "pow"
    overrides = result._quantlens_state.overrides
    built = {name: overrides[f"{name}|lut"].params for name in ("pow_0", "pow_1", "pow_2", "elu_0", "elu")}
    assert built == {"pow_0": {"exponent": 2}, "pow_1": {"exponent": 0.5}, "pow_2": {"exponent": 3},
                     "elu_0": {"alpha": 0.5}, "elu": {"alpha": 0.7}}
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        batch = _batch(gen)
        errors = lut_errors(result, batch)  # each site: the table vs float op + output fake quant, same input
        assert sorted(errors) == sorted(ALL_SITES)
        assert all(err <= ONE_STEP for err in errors.values()), errors


def test_new_table_sites_compute_the_float_op_in_float_state():
    model, example, result = _all_ops("int8")
    set_fake_quantize(result, FakeQuantState.FLOAT)
    set_fake_quantize(model, FakeQuantState.FLOAT)
    try:
        with torch.no_grad():
            assert torch.equal(result(*example), model(*example))
    finally:
        set_fake_quantize(model, FakeQuantState.VALIDATION)
        set_fake_quantize(result, FakeQuantState.VALIDATION)


def test_out_of_domain_inputs_follow_the_spec_not_nan():
    class Domain(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()

        def forward(self, x):
            x = self.quant(x)
            return self.dequant(torch.sqrt(x)), self.dequant(torch.rsqrt(x)), self.dequant(torch.log(x))

    x = torch.linspace(-2, 2, 64).reshape(4, 16)
    x[0, 0] = 0.0  # and an exact 0 (linspace(-2, 2, 64) has none)
    model = prepare(Domain(), (x,), SETTERS["int8"], check_result_dir=None)
    calibrate(model, [(x,), (x.abs() * 3,)])
    result = pre_export(model)
    with torch.no_grad():
        got, qat = result(x), model(x)
    assert torch.isnan(qat[0][x < 0]).all()  # the float op has no value there
    assert not any(torch.isnan(g).any() for g in got)
    info = {i.site: i for i in pre_export_report(result)}
    codes = [_codes(g, info[name].output_scale) for g, name in zip(got, ("sqrt_0", "rsqrt_0", "log_0"))]
    assert (codes[0][x < 0] == 0).all()  # sqrt(x < 0) = 0
    assert (codes[1][x <= 0] == 127).all()  # rsqrt(x <= 0) = +inf: qmax_out
    assert (codes[2][x <= 0] == -128).all()  # log(x <= 0) = -inf: qmin_out
    for g, q, name in zip(got, qat, info):  # inside the domain: the QAT result within one step
        step = info[name].output_scale
        assert (_codes(g, step) - _codes(q, step))[x > 0].abs().max() <= 1


# -- pow's call forms and call-argument rules ------------------------------------------------------------------
class _Pows(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.quant_y, self.dequant = QuantStub(), QuantStub(), DeQuantStub()

    def forward(self, x, y):
        x, y = self.quant(x), self.quant_y(y)
        return self.dequant(x ** 2 + 2 ** x + x.abs() ** y)


def test_pow_needs_its_exponent_and_only_a_constant_exponent_is_a_table():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=gen), torch.rand(4, 8, generator=gen) + 0.5
    model = prepare(_Pows(), (x, y), SETTERS["int8"], check_result_dir=None)
    calibrate(model, [(x, y)])
    with pytest.raises(QuantLensError, match="pow.*exponent.*example_inputs"):
        pre_export(model)
    result = pre_export(model, example_inputs=(x, y))
    assert lut_sites(result) == ["pow_0"]  # 2 ** x (pow_1) and x ** y (pow_2) stay float
    assert lut_errors(result, (x, y))["pow_0"] <= ONE_STEP


def test_elu_alpha_of_a_function_call_is_read_or_checked():
    class Elu(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()

        def forward(self, x):
            return self.dequant(F.elu(self.quant(x), alpha=0.25))

    x = torch.linspace(-4, 4, 64).reshape(4, 16)
    model = prepare(Elu(), (x,), SETTERS["int8"], check_result_dir=None)
    calibrate(model, [(x,)])
    blind = pre_export(model)  # no example inputs: built for the default alpha = 1
    with pytest.raises(QuantLensError, match="alpha"):
        with torch.no_grad():
            blind(x)
    seen = pre_export(model, example_inputs=(x,))
    assert lut_errors(seen, (x,)) == {"elu_0": 0.0}


# -- end to end: QuantStub -> conv -> op -> DeQuantStub -------------------------------------------------------
E2E = {
    "sqrt": lambda h: torch.sqrt(h),
    "rsqrt": lambda h: torch.rsqrt(h),
    "log": lambda h: torch.log(h),
    "pow2": lambda h: h ** 2,
    "pow0.5": lambda h: torch.pow(h, 0.5),
    "pow3": lambda h: h.pow(3),
    "erf": lambda h: torch.erf(h),
    "hardswish": lambda h: F.hardswish(h),
    "hardsigmoid": lambda h: F.hardsigmoid(h),
    "elu": lambda h: F.elu(h, alpha=0.5),
    "Hardswish": nn.Hardswish,
    "Hardsigmoid": nn.Hardsigmoid,
    "ELU": lambda: nn.ELU(alpha=0.7),
}
POSITIVE = {"sqrt", "rsqrt", "log", "pow0.5"}  # conv output kept inside the op's domain (ONNX has no spec outside)
E2E_TYPES = {"pow2": "pow", "pow0.5": "pow", "pow3": "pow", "Hardswish": "hardswish", "Hardsigmoid": "hardsigmoid",
             "ELU": "elu"}


class _ConvOp(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        if name in ("Hardswish", "Hardsigmoid", "ELU"):
            self.act = E2E[name]()
        else:
            self.fn = E2E[name]
        if name in POSITIVE:
            with torch.no_grad():
                self.conv.weight.uniform_(0.0, 0.3)
                self.conv.bias.fill_(0.3)

    def forward(self, x):
        h = self.conv(self.quant(x))
        return self.dequant(self.act(h) if hasattr(self, "act") else self.fn(h))


def _ort_run(path, feeds: dict, level: str):
    pytest.importorskip("onnxruntime")
    from _ort import session

    return session(path, level).run(None, {k: v.numpy() for k, v in feeds.items()})


@pytest.mark.parametrize("act", ["int8", "int16"])
@pytest.mark.parametrize("name", list(E2E))
def test_end_to_end_conv_then_table_op(name, act, tmp_path):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    positive = name in POSITIVE

    def batch():
        x = torch.rand(2, 3, 6, 6, generator=gen) * 2 if positive else torch.randn(2, 3, 6, 6, generator=gen) * 2
        return (x,)

    batches = [batch() for _ in range(4)]
    model = calibrate(prepare(_ConvOp(name), batches[0], SETTERS[act], check_result_dir=None), batches)
    table = pre_export(model, example_inputs=batches[0])
    site = "act" if hasattr(table, "act") else f"{E2E_TYPES.get(name, name)}_0"
    assert lut_sites(table) == [site]
    info = pre_export_report(table)[0]
    assert info.op_type == E2E_TYPES.get(name, name)
    assert info.table_kind == ("table256" if act == "int8" else "segmented")
    step = info.output_scale
    qat_ir = export(table, batches[0])
    assert {"lut" if act == "int8" else "segment_lut"} <= set(qat_ir.statistics())
    q_ir = convert(qat_ir)  # default qpp: the conv requantizes with a 16-bit multiplier
    from quantlens.compiler.ir import Module

    high = convert(Module(qat_ir.kind, qat_ir.graph, qat_ir.input_leaves, qat_ir.input_spec, qat_ir.output_spec,
                          meta={**qat_ir.meta, "high_precision_qpp": True}))
    test = [batch() for _ in range(2)]
    for (x,) in test:
        with torch.no_grad():
            want, qat = table(x), model(x)
        assert not torch.isnan(qat).any()
        assert (_codes(want, step) - _codes(qat, step)).abs().max() <= 1  # pre_export vs QAT: within 1 output step
        # quantized IR vs pre_export: the table op is the same function (bit-exact); the conv before it is the
        # float conv + fake quant there: with the 31-bit multiplier (high precision) equal on these inputs. With the
        # default 16-bit multiplier the conv's codes are at most one step from the high-precision ones (§8.1), and
        # the table maps a code to the same output in both IRs, whatever its slope amplifies that step to
        assert torch.equal(high(x), want)
        conv_codes = []
        for ir in (q_ir, high):
            seen = {}
            ir.run(dict(zip(ir.graph.inputs, (x,))),
                   observer=lambda node, ins, outs: seen.update({"conv": outs[0]}) if node.op == "conv2d" else None)
            conv_codes.append(seen["conv"].long())
        assert (conv_codes[0] - conv_codes[1]).abs().max() <= 1
        assert torch.equal(qat_ir(x), want)
    pytest.importorskip("onnx")
    from _ort import LEVELS, saturating_kernels

    from quantlens.compiler import to_onnx

    path = to_onnx(qat_ir, tmp_path / f"{name}.onnx")
    assert saturating_kernels(path, tmp_path) == set()  # the conv stays float on every CPU
    for (x,) in test:
        want = high(x)  # = pre_export's result (asserted above): ONNX writes the fake-quant model
        feeds = dict(zip(qat_ir.graph.inputs, [x]))
        for level in LEVELS:
            got = torch.from_numpy(_ort_run(path, feeds, level)[0])
            assert got.shape == want.shape and np.isfinite(got.numpy()).all()
            assert (_codes(got, step) - _codes(want, step)).abs().max() <= 1, level  # within 1 output step
