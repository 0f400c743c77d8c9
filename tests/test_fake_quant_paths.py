"""``numerics.fake_quant`` runs its arithmetic directly in plain eager calls that record no gradient, and through the
``quantlens::fake_quant`` op everywhere else (autograd, dispatch modes, torch.export). The two paths must give the
same bits, and each must be taken where it belongs: the op carries the straight-through gradient and is the one
node a graph sees."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from quantlens.march import QuantDType
from quantlens.march.numerics import fake_quant, fake_quant_range

I8, I16 = QuantDType.qint8, QuantDType.qint16


def _op(x, scale, dtype, axis=None):
    return torch.ops.quantlens.fake_quant(x, scale, dtype.qmin, dtype.qmax, -1 if axis is None else axis)


def _ops_run(fn) -> list[str]:
    """The names of the aten / custom ops ``fn`` ran (the autograd profiler's events)."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.function_events]


def _cases():
    s = 0.25
    # exact ties k + 1/2 on both sides of zero, the saturation limits and beyond, and values between
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -127.5, -128.5, -129.5]) * s
    edges = torch.tensor([127 * s, 128 * s, 1e6, -128 * s, -129 * s, -1e6, 0.0, -0.0, 1e-30])
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(4, 3, 5, 6, generator=g) * 40 * s
    yield ties, torch.tensor(s), I8, None
    yield edges, torch.tensor(s), I8, None
    yield edges * 256, torch.tensor(s), I16, None
    yield rand, torch.tensor(s), I8, None
    yield rand, torch.tensor([0.25, 0.5, 0.125]), I8, 1  # per channel
    yield rand, torch.tensor([0.25, 0.5, 0.125, 1.0, 2.0, 0.0625]), I16, 3
    yield rand.to(torch.float16), torch.tensor(s), I8, None
    yield rand.to(torch.bfloat16), torch.tensor([0.25, 0.5, 0.125]), I8, 1
    yield torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]), torch.tensor(s), I8, None


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: f"{c[2].name}-axis{c[3]}-{c[0].dtype}")
def test_the_direct_path_gives_the_op_s_bits(case):
    x, scale, dtype, axis = case
    with torch.no_grad():
        direct = fake_quant(x, scale, dtype, axis)
        ops = _ops_run(lambda: fake_quant(x, scale, dtype, axis))
        via_op = _op(x, scale, dtype, axis)
    assert not any("quantlens::fake_quant" in name for name in ops)  # this call did skip the op
    assert direct.dtype == x.dtype and direct.shape == x.shape
    assert torch.equal(direct.isnan(), via_op.isnan())
    assert torch.equal(direct.nan_to_num(), via_op.nan_to_num())
    assert torch.equal(direct.signbit(), via_op.signbit())  # -0.0 stays -0.0 on both


def test_a_value_that_needs_a_gradient_takes_the_op_and_its_straight_through_gradient():
    s = torch.tensor(0.25)
    x = torch.tensor([0.3, 10.0, 31.0, 40.0, -33.0, -31.9], requires_grad=True)  # 127 * 0.25 = 31.75
    ops = _ops_run(lambda: fake_quant(x, s, I8))
    assert any("quantlens::fake_quant" in name for name in ops)
    y = fake_quant(x, s, I8)
    y.sum().backward()
    # clipped STE: 1 inside [-128 s, 127 s], 0 outside (a plain round would give 0 everywhere)
    assert x.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_a_parameter_without_gradient_takes_the_direct_path_and_a_training_one_the_op():
    # transformers' Linear hands its weight Parameter itself to the fake quant
    w = torch.nn.Parameter(torch.tensor([0.3, 10.0, 31.0, 40.0]))
    s = torch.tensor(0.25)
    with torch.no_grad():
        ops = _ops_run(lambda: fake_quant(w, s, I8))
        assert not any("quantlens::fake_quant" in name for name in ops)
        assert torch.equal(fake_quant(w, s, I8), _op(w.detach(), s, I8))
    assert any("quantlens::fake_quant" in name for name in _ops_run(lambda: fake_quant(w, s, I8)))


def test_an_int32_range_takes_the_same_function():
    x, s = torch.tensor([1e9, -1.5e9, 12.5, 3e4]), torch.tensor([2.0, 0.5, 4.0, 1.0])
    with torch.no_grad():
        direct = fake_quant_range(x, s, -(2**31), 2**31 - 1, 0)
        via_op = torch.ops.quantlens.fake_quant(x, s, -(2**31), 2**31 - 1, 0)
    assert torch.equal(direct, via_op)
    assert direct.tolist() == [1e9, -1073741824.0, 12.0, 3e4]  # -3e9 saturates at -2**31 (times 0.5)


def test_a_learned_scale_keeps_the_op_even_when_the_input_needs_no_gradient():
    s = torch.tensor(0.25, requires_grad=True)
    x = torch.tensor([0.3, 10.0])
    assert any("quantlens::fake_quant" in name for name in _ops_run(lambda: fake_quant(x, s, I8)))


def test_graphs_see_one_fake_quant_node():
    def f(x):
        return fake_quant(x, torch.tensor(0.25), I8) * 2

    with torch.no_grad():
        gm = make_fx(f)(torch.randn(4))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "quantlens.fake_quant.default" in targets
    assert not any("div" in t or "round" in t for t in targets)


def test_a_torch_function_mode_sees_no_op_of_a_direct_fake_quant():
    seen = []

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(8)
    with torch.no_grad():
        expected = _op(x, torch.tensor(0.25), I8)
        with Recorder():
            y = fake_quant(x, torch.tensor(0.25), I8)
    assert torch.equal(y, expected)
    assert not any(name in ("div", "round_", "clamp_", "mul_") for name in seen), seen


def test_the_qat_ir_runs_its_fake_quants_without_the_op_and_gives_the_op_s_bits(monkeypatch):
    import quantlens.march.fake_quant as fq_module
    from quantlens import zoo
    from quantlens.compiler import export
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    model = zoo.get_model("tiny_resnet").eval()
    x = zoo.example_inputs("tiny_resnet", 4)
    prepared = calibrate(prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None),
                         zoo.sample_batches("tiny_resnet", 2, 4))
    qat_ir = export(prepared, x)
    assert any(n.op == "fake_quant" for n in qat_ir.graph.nodes)
    with torch.no_grad():
        direct = qat_ir(*x)
        assert not any("quantlens::fake_quant" in name for name in _ops_run(lambda: qat_ir(*x)))
        monkeypatch.setattr(fq_module, "_plain_eager", lambda *a: False)  # every fake quant through the op
        assert any("quantlens::fake_quant" in name for name in _ops_run(lambda: qat_ir(*x)))
        assert torch.equal(qat_ir(*x), direct)


def test_a_negative_channel_axis_is_the_last_dim_not_per_tensor():
    """``QuantSpec(ch_axis=-1)`` (a hidden dim's channels, the natural way to name the last dim) quantizes per channel
    of the last dim, as ``ch_axis=2`` does; the fake quant's own -1 means per tensor, and used to meet the [C] scale."""
    from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState
    from quantlens.quantization.qconfig import QuantSpec

    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 10.0, 100.0, 1000.0])
    outs = []
    for axis in (-1, 2):
        fq = FakeQuantize(QuantSpec(QuantDType.qint8, ch_axis=axis))
        fq.set_state(FakeQuantState.CALIBRATION)
        fq(x)
        fq.set_state(FakeQuantState.VALIDATION)
        outs.append(fq(x))
        assert fq.scale.shape == (4,)
    assert torch.equal(outs[0], outs[1])
    assert float((outs[0] - x).abs().max()) < 1000.0 / 127  # the small channels keep their own steps
