"""The partition's later mechanisms (issue #41, found by the sweep of docs/coverage.md): convert hands an op it cannot
express to the host instead of refusing the model, a module a library calls from a plain list is the prepared one,
torch's logic on bool masks reaches ONNX, and a same-input run recomputes the host index math between two sites from
the baseline's values (a mixture-of-experts router's indices)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export, load, save
from quantlens.compiler.host_ops import draws_random
from quantlens.errors import QuantLensError
from quantlens.profiler.ir_access import IRModelAccess
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo.coverage import run_stages


def _qat_ir(model: nn.Module, example: torch.Tensor):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model.eval(), (example,), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, [(torch.randn_like(example),) for _ in range(3)])
    return export(pre_export(prepared, example_inputs=(example,)), (example,))


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.dq(self.fc2(torch.relu(self.fc1(self.q(x)))))


def test_an_op_the_march_cannot_express_runs_on_the_host_in_convert(tmp_path):
    """A requantize multiplier out of the march's range (scales 1e30 apart, as rwkv's state makes them) is no longer a
    refusal: that op runs in float on the dequantized inputs, says why, and the rest stays integer."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    qat = _qat_ir(_TwoLinears(), x)
    producer = {o: n for n in qat.graph.nodes for o in n.outputs}
    fc2 = next(n for n in qat.graph.nodes if n.op == "linear" and n.site == "fc2")
    # fc1's output grid (the ReLU's fake quant) 1e30 times coarser, fc2's int32 bias grid with it (it is the input
    # scale times the weight scale): fc1's multiplier needs a shift far above 62
    for fq in (producer[fc2.inputs[0]], producer[fc2.inputs[2]]):
        qat.graph.constants[fq.inputs[1]] = qat.graph.constants[fq.inputs[1]] * 1e30
    quantized = convert(qat)
    host = {n.site: n.attrs.get("host_reason", "") for n in quantized.graph.nodes if n.attrs.get("host")}
    assert any(site.endswith("fc1") for site in host), host
    assert any("shift" in reason for reason in host.values()), host
    integer = [n for n in quantized.graph.nodes if n.op == "linear" and not n.attrs.get("host")]
    assert integer, "the other linear stays an integer op"
    with torch.no_grad():
        ref, got = qat(x), quantized(x)
    assert torch.isfinite(got).all()
    loaded = load(save(quantized, tmp_path / "m.qlir"))
    assert torch.equal(loaded(x), got)
    assert torch.allclose(ref, got, atol=1e-6)  # the host op is the qat IR's own float op


class _ListHeld(nn.Module):
    """transformers' MaskFormer FPN layer: the modules live in a plain list, registered with ``add_module`` and called
    from the list."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)]
        for i, layer in enumerate(self.layers):
            self.add_module(str(i), layer)
        self.q, self.dq = QuantStub(), DeQuantStub()

    def forward(self, x):
        h = self.q(x)
        for layer in self.layers:
            h = layer(h)
        return self.dq(h)


def test_modules_held_in_a_plain_list_are_the_prepared_ones():
    torch.manual_seed(0)
    model = _ListHeld().eval()
    make = lambda: torch.randn(2, 3, 8, 8)  # noqa: E731
    result = run_stages("list_held", model, make(), [make() for _ in range(3)], make())
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements


class _BoolMasks(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq, self.fc = QuantStub(), DeQuantStub(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(self.q(x))
        keep = (x > -1.0) * (x < 1.0) + (x == 0)  # torch's logic on bools: and, or
        return self.dq(h.masked_fill(~keep, 0.0))


def test_logic_on_bool_masks_reaches_onnxruntime():
    torch.manual_seed(0)
    model = _BoolMasks().eval()
    make = lambda: torch.randn(4, 8)  # noqa: E731
    result = run_stages("bool_masks", model, make(), [make() for _ in range(3)], make())
    assert result.failed_stage is None, result.error
    assert result.agreements["onnxruntime vs qat IR"] > 0.999


class _Router(nn.Module):
    """A mixture-of-experts dispatch: top-k experts, their indices sorted and divided on the host, the tokens picked."""

    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.gate, self.expert = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        h = self.q(x)
        _, chosen = self.gate(h).topk(2, dim=-1)
        order = chosen.reshape(-1).sort().indices
        tokens = torch.div(order, 2, rounding_mode="floor")
        return self.dq(self.expert(h[tokens]))


def test_a_same_input_run_recomputes_host_index_math_from_the_baseline():
    """The picked rows' site reads the indices through host ops of no site: its program recomputes them from the
    router's top-k output, which the baseline traced, instead of borrowing this IR's own indices."""
    x = torch.randn(6, 8)
    quantized = convert(_qat_ir(_Router(), x))
    access = IRModelAccess(quantized, "analysis")
    index_sites = [s for s in access.sites if access.site_op_type(s) == "index"]
    assert index_sites
    for site in index_sites:
        prog = access.program(site)
        assert all(where is not None for where in prog.externals.values()), prog.externals
        assert any(where.site.endswith("topk_0") for where in prog.externals.values()), prog.externals


class _Polar(nn.Module):
    """DeepSeek-V2's and Llama 4's rotary frequencies: ``torch.polar``, whose torch decomposition writes in place, and
    a complex table folded at export that the IR file stores."""

    def __init__(self):
        super().__init__()
        self.q, self.dq, self.lin = QuantStub(), DeQuantStub(), nn.Linear(8, 8)

    def forward(self, x):
        rotary = torch.view_as_real(torch.polar(torch.ones_like(x), x)).flatten(-2)[..., :8]
        h = self.lin(self.q(x) * rotary)
        # a complex table from constants only (folded at export: a complex constant of the IR file)
        table = torch.polar(torch.ones(4), torch.arange(4.0))
        h = torch.view_as_real(torch.view_as_complex(h.reshape(-1, 4, 2)) * table).reshape(h.shape)
        return self.dq(self.lin(h))


class _OnePartSplit(nn.Module):
    """RF-DETR's deformable attention with one feature level: a split into one part, then its element 0."""

    def __init__(self):
        super().__init__()
        self.q, self.dq, self.lin = QuantStub(), DeQuantStub(), nn.Linear(8, 8)

    def forward(self, x):
        return self.dq(self.lin(self.q(x).split([x.shape[1]], dim=1)[0].flatten(2)))


def test_polar_and_a_one_part_split_go_through_every_stage():
    for cls, shape in ((_Polar, (2, 8)), (_OnePartSplit, (2, 4, 2, 4))):
        torch.manual_seed(0)
        make = lambda: torch.randn(*shape)  # noqa: E731
        result = run_stages(cls.__name__, cls().eval(), make(), [make() for _ in range(3)], make())
        assert result.failed_stage is None, (cls.__name__, result.error)
        assert result.passed, (cls.__name__, result.agreements)


class _DataSizedSplit(nn.Module):
    """JetMoE's experts: the split sizes are counted from the router's choice (``.tolist()``), data not shapes."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.weight = nn.Parameter(torch.randn(2, 16, 8))

    def forward(self, x):
        chosen = self.gate(x).argmax(-1)
        sizes = torch.zeros(x.shape[0], 2).scatter(1, chosen[:, None], 1).long().sum(0).tolist()
        parts = x[chosen.sort().indices].split(sizes, 0)
        return torch.cat([torch.nn.functional.linear(parts[i], self.weight[i]) for i in range(2)], 0)


def test_sizes_computed_from_data_are_refused_in_words_not_lowered_as_the_batch():
    """Once a size from ``.tolist()`` was read as the dynamic batch (-1), an IR whose split could not run."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(_DataSizedSplit().eval(), (x,), default_calibration_qconfig_setter,
                           check_result_dir=None, allow_no_stubs=True)
    calibrate(prepared, [(torch.randn(6, 8),) for _ in range(3)])
    with pytest.raises(QuantLensError, match=r"sizes computed from tensor data.*\.tolist\(\)"):
        export(pre_export(prepared, example_inputs=(x,)), (x,))


class _RandomMasking(nn.Module):
    """ViT-MAE's masking: random noise drawn in forward, argsorted, the kept tokens gathered."""

    def __init__(self):
        super().__init__()
        self.q, self.dq, self.fc = QuantStub(), DeQuantStub(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(self.q(x))
        # (UnivNet passes its generator, None: aten.randn.generator, which torch's ONNX exporter has no form for)
        keep = (torch.rand(x.shape[0], x.shape[1]) + torch.randn(x.shape[0], x.shape[1], generator=None)).argsort(
            dim=1)[:, :3]
        return self.dq(torch.gather(h, 1, keep[..., None].expand(-1, -1, h.shape[-1])))


def test_random_draws_in_forward_stay_draws_and_are_compared_on_one_seed():
    """Once export folded the noise into a constant (every run of the IR kept the masking of export time); now the IR
    draws at every run, the stages and the profiler's runs draw from one seed, and onnxruntime (its own generator) is
    not compared."""
    torch.manual_seed(0)
    make = lambda: torch.randn(2, 6, 8)  # noqa: E731
    result = run_stages("random_masking", _RandomMasking().eval(), make(), [make() for _ in range(3)], make())
    assert result.failed_stage is None, result.error
    assert result.random_draws and "onnxruntime vs qat IR" not in result.agreements
    assert result.passed, result.agreements
    qat = _qat_ir(_RandomMasking(), make())
    assert draws_random(qat.graph)
    x = make()
    assert not torch.equal(qat(x), qat(x))  # a draw per run


class _TiedRouter(nn.Module):
    """A router whose logits tie (equal gate rows, as int8 logits often are): which experts a top-k picks is the tie
    order, torch's kernels' choice ([7, 6, 4, 1] for top-4 of [1, 2, 2, 1, 2, 0, 3, 3]) against onnxruntime's."""

    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.gate, self.experts = nn.Linear(8, 4, bias=False), nn.Linear(8, 32)
        with torch.no_grad():
            self.gate.weight[1:] = self.gate.weight[0]

    def forward(self, x):
        h = self.q(x)
        weights, chosen = self.gate(h).topk(2, dim=-1)
        outs = self.experts(h).reshape(*h.shape[:-1], 4, 8)
        picked = torch.gather(outs, -2, chosen[..., None].expand(*chosen.shape, 8))
        order = torch.sort(weights, dim=-1, descending=True).indices  # ties again: a sort's order
        return self.dq((picked * weights[..., None]).sum(-2) + order.float().sum(-1, keepdim=True))


def test_ties_go_to_the_lower_index_at_every_stage_and_in_onnxruntime():
    torch.manual_seed(0)
    make = lambda: torch.randn(6, 8)  # noqa: E731
    result = run_stages("tied_router", _TiedRouter().eval(), make(), [make() for _ in range(3)], make())
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements
    assert result.agreements["onnxruntime vs qat IR"] > 0.9999


class _ClampOffGrid(nn.Module):
    """Inkling2's L2 clip, ``(t / norm).clamp(max=1.0)``: a bound off the input grid (s_in = 3.46)."""

    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()

    def forward(self, x):
        return self.dq(torch.clamp(self.q(x), max=1.0))


class _FillBelowTheGrid(nn.Module):
    """Gemma 4 audio's attention: logits filled with -1e9 (its output fake quant calibrated on it), then a host op
    (cumprod) reading an integer value mid-graph."""

    def __init__(self):
        super().__init__()
        self.q, self.dq, self.fc = QuantStub(), DeQuantStub(), nn.Linear(12, 12)

    def forward(self, x):
        h = self.q(x)
        filled = h.masked_fill(torch.arange(12) > 5, -1e9)
        return self.dq(filled), self.dq(self.fc(torch.cumprod(h, -1)))


def _through_convert(model: nn.Module, make) -> tuple:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model.eval(), (make(),), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, [(make(),) for _ in range(3)])
    qat = export(pre_export(prepared, example_inputs=(make(),)), (make(),))
    return qat, convert(qat)


def test_a_clamp_bound_off_the_input_grid_and_a_fill_below_it_convert_exactly():
    """Both were 127 steps off (every code 0): the bound rounded onto the input grid (rhe(1.0 / 3.46) = 0), the fill
    written on the input grid, where -1e9 saturates to -128 and the requantize makes it 0."""
    qat, quantized = _through_convert(_ClampOffGrid(), lambda: 100 + 340 * torch.rand(4, 8))
    x = 100 + 340 * torch.rand(4, 8)
    assert torch.equal(quantized(x), qat(x)) and bool((qat(x) == 1.0).all())
    qat, quantized = _through_convert(_FillBelowTheGrid(), lambda: torch.randn(3, 12))
    x = torch.randn(3, 12)
    (ref, _), (got, _) = qat(x), quantized(x)
    assert torch.equal(got, ref) and bool((ref[:, 6:] < -1e8).all())
    # the dequantize the host cumprod reads mid-graph is no model output: it has no op site (a same-input run
    # recomputes it from the baseline's value), while the model's outputs keep theirs
    dequantized = [n for n in quantized.graph.nodes if n.op == "dequantize"]
    assert {n.site for n in dequantized if n.outputs[0] in quantized.graph.outputs} == {"output"}
    assert any(n.site == "" for n in dequantized if n.outputs[0] not in quantized.graph.outputs)


class _Histogram(nn.Module):
    """Hunyuan's MoE layer counts its tokens per expert with ``torch.histc``, which torch's ONNX exporter has no form
    for: a host op that to_onnx now writes itself (over given bounds, and over the data's range)."""

    def __init__(self):
        super().__init__()
        self.q, self.dq, self.fc = QuantStub(), DeQuantStub(), nn.Linear(8, 8)

    def forward(self, x):
        y = self.dq(self.fc(self.q(x)))
        return y, torch.histc(y, bins=4, min=-1.0, max=1.0), torch.histc(y, bins=3)


def test_a_histogram_runs_on_the_host_through_onnxruntime():
    torch.manual_seed(0)
    make = lambda: torch.randn(4, 8)  # noqa: E731
    result = run_stages("histogram", _Histogram().eval(), make(), [make() for _ in range(3)], make())
    assert result.failed_stage is None, result.error
    assert result.passed and result.agreements["onnxruntime vs qat IR"] > 0.9999, result.agreements


def test_the_onnxruntime_per_op_measure_sees_one_wrong_op(tmp_path):
    """The onnxruntime pair's per-op criterion (quantlens.zoo.onnx_same_input): each stretch between two fake quants
    run by onnxruntime on the qat IR's inputs is within a step of it; a negated weight in the file is not."""
    import onnx

    from quantlens.compiler import to_onnx
    from quantlens.zoo.onnx_same_input import worst_onnx_same_input_step

    x = torch.randn(4, 8)
    qat = _qat_ir(_TwoLinears(), x)
    path = to_onnx(qat, tmp_path / "m.onnx")
    assert worst_onnx_same_input_step(qat, path, x) <= 1.001
    proto = onnx.load(str(path))
    weights = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
    assert weights
    weights[0].CopyFrom(onnx.numpy_helper.from_array(-onnx.numpy_helper.to_array(weights[0]), weights[0].name))
    onnx.save(proto, str(tmp_path / "wrong.onnx"))
    assert worst_onnx_same_input_step(qat, tmp_path / "wrong.onnx", x) > 3.0


def test_the_onnxruntime_pair_has_the_per_op_criterion():
    from quantlens.zoo.coverage import THRESHOLDS, CoverageResult

    agreements = {**{name: 1.0 for name in THRESHOLDS}, "onnxruntime vs qat IR": 0.995}
    assert CoverageResult("x", "int8", agreements=agreements, onnxruntime_worst_step=1.0000005).passed
    assert not CoverageResult("x", "int8", agreements=agreements, onnxruntime_worst_step=4.0).passed
    assert not CoverageResult("x", "int8", agreements=agreements).passed


class _ZeroOverZero(nn.Module):
    """GLM-5's and Kimi's l2 norm, ``x / sqrt(sum(x²) + eps)``: a divisor that rounds to 0 where ``x`` is 0 too."""

    def __init__(self):
        super().__init__()
        self.qx, self.qy, self.dq = QuantStub(), QuantStub(), DeQuantStub()

    def forward(self, x, y):
        return self.dq(self.qx(x) / self.qy(y))


def test_zero_over_zero_is_zero_at_every_stage_and_in_onnxruntime():
    """The march's 0 / 0 = 0 (docs/march.md §13.5): the fake-quant model once gave NaN there, and the ONNX model (a
    float Div between fake quants) NaN, which its fake quant wrote as -128."""
    torch.manual_seed(0)

    def make():
        x, y = torch.randn(4, 16), torch.rand(4, 16) + 0.5
        x[:, :4], y[:, :4] = 0.0, 0.0
        return x, y

    result = run_stages("zero_over_zero", _ZeroOverZero().eval(), make(), [make() for _ in range(3)], make())
    assert result.failed_stage is None, result.error
    assert all(v == v for v in result.agreements.values()), result.agreements  # no NaN anywhere
    assert result.agreements["onnxruntime vs qat IR"] > 0.9999 and result.passed, result.agreements
