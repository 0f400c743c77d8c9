"""Coverage by construction (issue #22): the mechanisms that let models nobody here wrote go through export.

* values computed from constants through fake quants are folded (rotary tables: cos of positions x inv_freq);
* an aten op with no lowering rule is decomposed with torch's own tables, its pieces keeping the op site;
* integer index math (position ids from a cumsum of the mask) runs exactly, on the host, in the quantized IR;
* any aten op after the DeQuantStub is a float host op (``host_aten``), through save/load;
* grouped-query attention (sdpa ``enable_gqa=True``) repeats the key/value heads.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export, load, save, to_onnx
from quantlens.errors import QuantLensError
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


def _through(model, example, batches=None):
    prepared = calibrate(prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=True),
                         batches or [example])
    tables = pre_export(prepared, example_inputs=example)
    qat_ir = export(tables, example)
    return prepared, tables, qat_ir, convert(qat_ir)


def _cos(a, b):
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


class Rotary(nn.Module):
    """A rotary-embedding block: the cos/sin tables depend on the sequence length only."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        x = self.proj(x)
        return x * emb.cos() + x.flip(-1) * emb.sin()


def test_values_computed_from_constants_through_fake_quants_are_folded():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    _, tables, qat_ir, quantized = _through(Rotary().eval(), (x,))
    ops = [n.op for n in qat_ir.graph.nodes]
    assert "cos" not in ops and "sin" not in ops  # folded: no lowering rule was needed
    with torch.no_grad():
        assert torch.equal(qat_ir(x), tables(x))  # the fold computes what the QAT model computes
        assert _cos(quantized(x), qat_ir(x)) > 0.998


class SamePadding(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 4, padding="same")  # aten.conv2d.padding: no rule; torch decomposes it

    def forward(self, x):
        return self.conv(x)


def test_an_op_without_a_rule_is_decomposed_and_keeps_its_op_site():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    _, tables, qat_ir, quantized = _through(SamePadding().eval(), (x,))
    convs = [n for n in qat_ir.graph.nodes if n.op == "conv2d"]
    assert len(convs) == 1 and convs[0].site == "conv"
    assert all(n.site == "conv" for n in qat_ir.graph.nodes if n.op == "pad")  # the decomposition's explicit pad
    with torch.no_grad():
        assert torch.equal(qat_ir(x), tables(x))
        assert _cos(quantized(x), qat_ir(x)) > 0.998


class InPlaceAndDecomposed(nn.Module):
    """In-place ops (functionalized), and two ops without a rule: conv2d's "same" padding and ``new_ones``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 4, padding="same")

    def forward(self, x):
        y = self.conv(x)
        y += 0.5
        y = y * y.new_ones(y.shape[-1])
        return y.clamp_(min=-1.0)


def _ir_nodes(ir):
    return [(n.op, n.site, n.inputs, n.outputs, repr(sorted(n.attrs.items()))) for n in ir.graph.nodes]


def _ir_structure(ir):
    """The nodes with their values numbered in order of appearance (a retrace renames values, e.g. flatten's
    output ``view_9``: the same graph)."""
    number: dict[str, str] = {}

    def name(v: str) -> str:
        return number.setdefault(v, f"v{len(number)}") if v and v not in ir.graph.constants else v

    return [(n.op, n.site, [name(v) for v in n.inputs], [name(v) for v in n.outputs],
             repr(sorted(n.attrs.items()))) for n in ir.graph.nodes]


def _count_retraces(monkeypatch) -> list[list[str]]:
    """From now on, the decomposition table of every ``run_decompositions`` (each one retraces the program)."""
    calls: list[list[str]] = []
    run_decompositions = torch.export.ExportedProgram.run_decompositions

    def counted(self, table=None, *args, **kwargs):
        calls.append(sorted(str(op) for op in (table or {})))
        return run_decompositions(self, table, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    return calls


def test_one_retrace_functionalizes_and_decomposes_and_gives_the_ir_of_two(monkeypatch):
    import importlib

    export_module = importlib.import_module("quantlens.compiler.export")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    model = InPlaceAndDecomposed().eval()
    prepared = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=True), [(x,)])
    tables = pre_export(prepared, example_inputs=(x,))
    calls = _count_retraces(monkeypatch)
    qat_ir = export(tables, (x,))
    # the first retrace functionalizes and decomposes; conv2d.padding's pieces need one more
    assert calls == [["aten.conv2d.padding", "aten.new_ones.default"], ["aten._convolution_mode.default"]]
    # the IR the former sequence gave: functionalize alone first, then decompose
    real = export_module.decompose_unlowered
    monkeypatch.setattr(export_module, "decompose_unlowered", lambda ep: real(ep.run_decompositions({})))
    calls.clear()
    two = export(tables, (x,))
    assert calls[0] == [] and len(calls) == 3
    assert _ir_nodes(qat_ir) == _ir_nodes(two)
    assert not any(n.op in ("add_", "clamp_") for n in qat_ir.graph.nodes)
    with torch.no_grad():
        assert torch.equal(qat_ir(x), tables(x)) and torch.equal(two(x), qat_ir(x))


def test_a_dynamic_batch_export_does_not_retrace_for_its_shape_math(monkeypatch):
    """``sym_size`` nodes (the batch read under ``dynamic_batch``) are shape math that lowering skips: decomposing
    them, as export did, retraced the whole program for the same graph. A functional graph whose ops all lower is
    not retraced even to functionalize it (issue #41: 2/3 of a large model's export)."""
    import importlib

    from torch._decomp import core_aten_decompositions

    from quantlens import zoo

    export_module = importlib.import_module("quantlens.compiler.export")
    model = zoo.get_model("digits_cnn").eval()
    x = zoo.example_inputs("digits_cnn", 4)
    prepared = calibrate(prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None),
                         zoo.sample_batches("digits_cnn", 2, 4))
    calls = _count_retraces(monkeypatch)
    ir = export(prepared, x, dynamic_batch=True)
    assert calls == []  # no retrace at all: the graph is functional and every op lowers
    sym_size = torch.ops.aten.sym_size.int
    real = export_module.decompose_unlowered
    monkeypatch.setattr(export_module, "decompose_unlowered",
                        lambda ep: real(ep).run_decompositions({sym_size: core_aten_decompositions()[sym_size]}))
    before = export(prepared, x, dynamic_batch=True)
    assert _ir_structure(before) == _ir_structure(ir)
    with torch.no_grad():
        for batch in (1, 7):
            xb = zoo.example_inputs("digits_cnn", batch)
            assert torch.equal(ir(*xb), prepared(*xb))


class PositionIds(nn.Module):
    """RoBERTa's position ids: a cumsum of the padding mask (integer math) into an embedding."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(20, 8)
        self.positions = nn.Embedding(20, 8)

    def forward(self, ids):
        mask = ids.ne(0).int()
        position_ids = torch.cumsum(mask, dim=1).type_as(mask) * mask + 1
        return self.tokens(ids) + self.positions(position_ids.long())


def test_integer_index_math_runs_exactly_in_the_quantized_ir():
    ids = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 1]])
    _, tables, qat_ir, quantized = _through(PositionIds().eval(), (ids,))
    cumsums = [n for n in quantized.graph.nodes if n.op == "cumsum"]
    assert cumsums and all(n.attrs.get("host") for n in cumsums)
    with torch.no_grad():
        assert torch.equal(qat_ir(ids), tables(ids))
        assert _cos(quantized(ids), qat_ir(ids)) > 0.998


class HostTail(nn.Module):
    """Post-processing after the DeQuantStub with ops the IR has no rule for."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        y = self.dequant(self.fc(self.quant(x)))
        return torch.logcumsumexp(y, dim=1), torch.special.erfinv(torch.tanh(y) * 0.5)


def test_any_aten_op_after_the_dequant_stub_is_a_float_host_op(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    _, tables, qat_ir, quantized = _through(HostTail().eval(), (x,))
    host = [n for n in qat_ir.graph.nodes if n.op == "host_aten"]
    # whole aten ops: torch's reference decompositions (prims) are not taken for an op that stays on the host
    assert {n.attrs["target"].split(".")[0] for n in host} == {"aten::logcumsumexp", "aten::erfinv"}
    assert all(n.attrs.get("host") for n in host)
    loaded = load(save(quantized, tmp_path / "m.qlir"))
    with torch.no_grad():
        for got, want in zip(qat_ir(x), tables(x)):
            assert torch.equal(got, want)
        for got, want in zip(loaded(x), quantized(x)):
            assert torch.equal(got, want)
        y = quantized(x)
    assert _cos(y[0], qat_ir(x)[0]) > 0.998
    pytest.importorskip("onnx")
    # host ops go through torch's own ONNX exporter; it has no form for erfinv, which to_onnx says in words
    with pytest.raises(QuantLensError, match=r"erfinv.*torch's ONNX exporter has no form"):
        to_onnx(qat_ir, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_a_host_op_naming_something_other_than_an_aten_op_is_refused():
    from quantlens.compiler.host_ops import call_host_aten

    with pytest.raises(QuantLensError, match="not an operator registered with this torch"):
        call_host_aten({"target": "builtins::eval.default", "args": [], "kwargs": {}}, [], "site")
    with pytest.raises(QuantLensError, match="not an operator registered with this torch"):
        call_host_aten({"target": "aten::no_such_op.default", "args": [], "kwargs": {}}, [], "site")
    with pytest.raises(QuantLensError, match="not an operator registered"):
        call_host_aten({"target": "os::system('x').default", "args": [], "kwargs": {}}, [], "site")
    with pytest.raises(QuantLensError, match=r"import it before running"):
        call_host_aten({"target": "somelib::op.default", "args": [], "kwargs": {}}, [], "site")


class GroupedQueryAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 4).transpose(1, 2)
        k = self.k(x).view(b, n, 2, 4).transpose(1, 2)
        v = self.v(x).view(b, n, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_grouped_query_attention_repeats_the_key_value_heads():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    model = GroupedQueryAttention().eval()
    prepared, tables, qat_ir, quantized = _through(model, (x,))
    with torch.no_grad():
        want = model(x)
        assert _cos(prepared(x), want) > 0.99
        assert torch.equal(qat_ir(x), tables(x))
        assert _cos(quantized(x), qat_ir(x)) > 0.998


class ExportBranch(nn.Module):
    """Takes another branch under torch.export, as transformers' mask builders do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            y = y + 1.0
        return y


def test_traced_forwards_take_the_branch_export_takes():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    model = ExportBranch().eval()
    prepared, tables, qat_ir, quantized = _through(model, (x,))
    sites = prepared._quantlens_state.record.sites
    assert "add_0" in sites  # recorded at prepare, so calibrated and found again by export
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()  # the flags are restored
    with torch.no_grad():
        assert torch.equal(qat_ir(x), tables(x))
        assert _cos(qat_ir(x), model(x) + 1.0) > 0.999


class Select(nn.Module):
    """where between a quantized value and a constant, and a comparison of a quantized value with a constant."""

    def __init__(self):
        super().__init__()
        self.quant = QuantStub()

    def forward(self, x):
        x = self.quant(x)
        return torch.where(x > 0.25, x, torch.tensor(-1.0))


def test_where_and_comparisons_with_constants_convert_to_codes():
    from quantlens.quantization import FakeQuantState, set_fake_quantize

    x = torch.tensor([[-1.0, 0.0, 0.24, 0.26, 0.5, 1.0]])
    prepared = calibrate(prepare(Select().eval(), (x,), default_calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=True),
                         [(x,)])
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    quantized = convert(export(prepared, (x,)))
    ops = [n.op for n in quantized.graph.nodes]
    assert "gt" in ops and "where" in ops
    gt = next(n for n in quantized.graph.nodes if n.op == "gt")
    # the constant enters in codes: 0.25 / s_x, with s_x = 1/127 (symmetric int8 over max |x| = 1)
    bound = float(quantized.graph.constants[gt.inputs[1]])
    assert bound == pytest.approx(0.25 * 127, rel=1e-6)
    with torch.no_grad():
        got, want = quantized(x), prepared(x)
    # codes of x: [-127, 0, 30, 33, 64, 127] -> 30/127 = 0.236 <= 0.25 < 33/127 = 0.260
    assert torch.equal(got > -0.5, torch.tensor([[False, False, False, True, True, True]]))
    assert torch.allclose(got, want, atol=1e-6)


class BiasedAttention(nn.Module):
    """sdpa with additive float masks: a learned relative-position bias (Swin), and a 0 / finfo.min padding mask
    (what transformers builds) whose blocked entries must mask out without stretching the scores' grid."""

    def __init__(self, padding: bool):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.bias = nn.Parameter(torch.randn(1, 2, 5, 5) * 0.5)
        self.padding = padding

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if not self.padding:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        blocked = torch.zeros(n, n, dtype=torch.bool)
        blocked[:, -1] = True
        mask = torch.where(blocked, torch.finfo(torch.float32).min, 0.0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("padding", [False, True])
def test_an_additive_mask_gets_its_own_grid_and_blocked_entries_mask_out(padding):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    model = BiasedAttention(padding).eval()
    prepared, tables, qat_ir, quantized = _through(model, (x,), [(torch.randn(2, 5, 8),) for _ in range(3)])
    override = next(iter(prepared._quantlens_state.overrides.values()))
    assert override.additive_mask and override.softmax_input_fq is override.mask_fq
    assert float(override.mask_fq.scale.max()) < 1.0  # finfo.min did not stretch the masked scores' grid
    with torch.no_grad():
        assert _cos(prepared(x), model(x)) > 0.99
        assert torch.equal(qat_ir(x), tables(x))
        assert _cos(quantized(x), qat_ir(x)) > 0.998


def test_constant_tensor_addend_codes_by_hand():
    from quantlens.march import Qpp, rules

    k = torch.tensor([0.3, -3.4e38, -0.125, 0.375])
    codes, scale = rules.constant_addend_codes(k, torch.tensor(0.25), Qpp.DEFAULT)  # F = 0
    assert codes.tolist() == [1, -2**31, 0, 2]  # rhe(1.2), saturated, rhe(-0.5) = 0, rhe(1.5) = 2
    assert float(scale) == 0.25
    codes, scale = rules.constant_addend_codes(k, torch.tensor(0.25), Qpp.HIGH_PRECISION)  # F = 8
    assert codes.tolist() == [307, -2**31, -128, 384]  # k * 2**8 / 0.25 = k * 1024
    assert float(scale) == 0.25 / 256


def test_mask_fills_do_not_stretch_a_grid_of_real_values():
    from quantlens.quantization.fake_quantize import _without_fills

    lowest = torch.finfo(torch.float32).min
    mixed = torch.tensor([0.5, -1.0, lowest, 2.0])
    assert _without_fills(mixed).tolist() == [0.5, -1.0, 0.0, 2.0]
    pure = torch.tensor([0.0, lowest, 0.0])  # a 0 / finfo.min mask: its fills stay (the attention finds them)
    assert torch.equal(_without_fills(pure), pure)
    with_inf = torch.tensor([0.5, float("-inf")])  # -inf is not a fill: the non-finite checks report it
    assert torch.equal(_without_fills(with_inf), with_inf)


def test_an_add_input_on_a_mask_grid_saturates():
    from quantlens.kernels.integer import INT_KERNELS
    from quantlens.march import Qpp, QuantDType, rules

    attrs = rules.add([torch.tensor(0.1), torch.tensor(2.7e36)], torch.tensor(0.1), QuantDType.qint8, Qpp.DEFAULT)
    assert (attrs["multipliers"][1], attrs["shifts"][1]) == (2**31 - 1, 0)  # the saturating pair
    scores = torch.tensor([10, -7, 127], dtype=torch.int8)
    mask = torch.tensor([0, -128, -1], dtype=torch.int8)  # codes of a 0 / finfo.min mask (and one stray code)
    out = INT_KERNELS["add"]([scores, mask], attrs, "site")
    assert out.tolist() == [10, -128, -128]  # 0 adds nothing; any other code saturates to the lowest code


class BorderPool(nn.Module):
    """PoolFormer's token mixer (count_include_pad=False) and EfficientNet-style ceil_mode windows."""

    def __init__(self, ceil_mode=False):
        super().__init__()
        self.quant = QuantStub()
        self.pool = nn.AvgPool2d(3, 2 if ceil_mode else 1, 1, ceil_mode=ceil_mode, count_include_pad=ceil_mode)

    def forward(self, x):
        return self.pool(self.quant(x))


def test_average_pool_windows_of_different_counts_by_hand():
    from quantlens.kernels.integer import INT_KERNELS
    from quantlens.march import Qpp, QuantDType, rules

    codes = torch.tensor([[1, 3], [5, 7]], dtype=torch.int8).reshape(1, 1, 2, 2)
    divisors = [[1, 2, 1], [2, 4, 2], [1, 2, 1]]  # 2x2 windows, stride 1, padding 1, count_include_pad=False
    attrs = {"kernel_size": [2, 2], "stride": [1, 1], "padding": [1, 1], "ceil_mode": False, "divisors": divisors,
             **rules.average_by_window(torch.tensor(1.0), [1, 2, 4], torch.tensor(1.0), QuantDType.qint8,
                                       Qpp.HIGH_PRECISION)}
    assert attrs["divisor_values"] == [1, 2, 4]
    out = INT_KERNELS["avg_pool2d_div_int"]([codes], attrs, "site")
    # corners: one code each; edges (1+3)/2, (1+5)/2, (3+7)/2, (5+7)/2; centre 16/4
    assert out[0, 0].tolist() == [[1, 2, 3], [3, 4, 5], [5, 6, 7]]


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_average_pools_with_varying_windows_convert(ceil_mode):
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 8)  # 8: ceil_mode adds a last window that overhangs the padded input
    prepared, tables, qat_ir, quantized = _through(BorderPool(ceil_mode).eval(), (x,))
    assert "avg_pool2d_div_int" in [n.op for n in quantized.graph.nodes]
    with torch.no_grad():
        got, want = quantized(x), qat_ir(x)
    step = float(prepared._quantlens_state.fq[next(k for k in prepared._quantlens_state.fq if "pool" in k)].scale)
    assert (got - want).abs().max() <= step * 1.001  # one requantize: within one output step


def test_an_in_place_op_is_still_functionalized(monkeypatch):
    """The retrace is skipped only for a graph already functional: ``x += y`` and ``clamp_`` still make one."""

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.dq, self.lin = QuantStub(), DeQuantStub(), nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(self.q(x))
            y += self.lin(y)
            return self.dq(y.clamp_(min=-1.0))

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    prepared = calibrate(prepare(InPlace().eval(), x, default_calibration_qconfig_setter, check_result_dir=None),
                         [x])
    calls = _count_retraces(monkeypatch)
    ir = export(prepared, x)
    assert len(calls) == 1
    assert not any(n.op.endswith("_") for n in ir.graph.nodes)
    with torch.no_grad():
        assert torch.equal(ir(x), prepared(x))
