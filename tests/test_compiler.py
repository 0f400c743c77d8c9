"""export (qat IR) and convert (quantized IR): fidelity, integer kernels, specialisation, errors."""

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.compiler import convert, export
from quantlens.compiler.ir import Module, Node
from quantlens.compiler.kernels_int import int_dispatch
from quantlens.errors import QuantLensError
from quantlens.quantization import DeQuantStub, FakeQuantState, QuantStub, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches


def _tensors(out):
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _calibrated(model, example, batches, setter=default_calibration_qconfig_setter):
    prepared = prepare(model, example, setter, check_result_dir=None)
    prepared.eval()
    set_fake_quantize(prepared, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    return prepared


def _output_steps(qat_ir: Module) -> list[float]:
    """The output quantization step of each model output (the scale of the fake quant producing it);
    for an int32 high-precision output, 1e-4 of the output magnitude stands in (it is not rounded)."""
    producers = qat_ir.graph.producers()
    steps = []
    for name in qat_ir.graph.outputs:
        node = producers.get(name)
        if node is not None and node.op == "fake_quant":
            steps.append(float(qat_ir.graph.constants[node.inputs[1]].max()))
        else:
            steps.append(None)
    return steps


@pytest.fixture(scope="module", params=list_models())
def zoo_case(request):
    name = request.param
    model = get_model(name)
    example = example_inputs(name)
    prepared = _calibrated(model, example, sample_batches(name, 3, 4))
    return name, prepared, example


def test_qat_ir_equals_prepared_model(zoo_case):
    name, prepared, example = zoo_case
    qat_ir = export(prepared, example)
    with torch.no_grad():
        ref = _tensors(prepared(*example))
    got = _tensors(qat_ir(*example))
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert r.shape == g.shape and r.dtype == g.dtype
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    # every compute node carries the op site of the torch op it came from
    sites = {s for s in prepared._quantlens_state.plans}
    compute = [  # ops on float data (integer index/mask ops have no op site by the naming rule)
        n for n in qat_ir.graph.nodes
        if n.op not in ("reshape", "permute", "expand") and qat_ir.graph.values[n.outputs[0]].dtype.startswith("float")
    ]
    assert compute and all(n.site in sites for n in compute), [n for n in compute if n.site not in sites]


def test_quantized_ir_close_to_qat_ir(zoo_case):
    name, prepared, example = zoo_case
    qat_ir = export(prepared, example)
    q_ir = convert(qat_ir)
    assert q_ir.kind == "quantized"
    stats = q_ir.statistics()
    float_ops = {"conv2d", "linear", "matmul", "add", "softmax", "layer_norm", "gelu", "sigmoid"}
    # integer-only: every compute node has an integer output type
    for node in q_ir.graph.nodes:
        info = q_ir.graph.values[node.outputs[0]]
        if node.op in float_ops and not node.attrs.get("host"):  # host post-processing stays float
            assert info.qdtype is not None, node
    float_inputs = [n for n in q_ir.graph.inputs if q_ir.graph.values[n].dtype.startswith("float")]
    assert stats.get("quantize", 0) >= (1 if float_inputs else 0) and stats.get("dequantize", 0) >= 1
    ref = _tensors(qat_ir(*example))
    got = _tensors(q_ir(*example))
    for r, g, step in zip(ref, got, _output_steps(qat_ir)):
        if not r.is_floating_point():
            continue  # indices (topk) may differ only through value ties; values are compared
        err = (r - g).abs().max().item()
        if step is None:
            assert err <= 0.05 * r.abs().max().item() + 1e-6, (name, err)
        else:
            assert err <= 4 * step + 1e-7, (name, err / step)


def test_quantized_ir_is_deterministic_across_thread_counts():
    name = "tiny_resnet"
    prepared = _calibrated(get_model(name), example_inputs(name), sample_batches(name, 2, 4))
    q_ir = convert(export(prepared, example_inputs(name), dynamic_batch=True))
    batch = sample_batches(name, 1, 8)[0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q_ir(*batch)
        torch.set_num_threads(2)
        two = q_ir(*batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, q_ir(*batch))


class _AddCat(nn.Module):
    def __init__(self):
        super().__init__()
        self.qa, self.qb = QuantStub(), QuantStub()
        self.dq = DeQuantStub()

    def forward(self, a, b):
        a, b = self.qa(a), self.qb(b)
        return self.dq(torch.cat([a + b, a], dim=1))


def test_add_and_cat_with_different_input_scales_hand_computed():
    # a = 5 * 2**-4 (scale 2**-4 from |max| = 127 * 2**-4), b = 2 * 2**-5, output of add at 2**-3.
    from quantlens.march import QuantDType
    from quantlens.quantization import FixedScaleObserver, QConfig, QuantSpec
    from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter

    def fixed(scale):
        return QConfig(output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=scale)))

    setter = (
        ModuleNameQconfigSetter({"qa": fixed(2**-4), "qb": fixed(2**-5), "add_0": fixed(2**-3), "cat_0": fixed(2**-3)}),
        default_calibration_qconfig_setter,
    )
    a = torch.tensor([[5 * 2**-4]])
    b = torch.tensor([[2 * 2**-5]])
    prepared = _calibrated(_AddCat(), (a, b), [(a, b)], setter)
    qat_ir = export(prepared, (a, b))
    q_ir = convert(qat_ir)
    out = q_ir(a, b)
    # docs/march.md §10, default qpp (F = 0): each term is rounded to whole steps, rhe(2.5) + rhe(0.5) = 2 + 0 = 2,
    # one step below the float path. cat rescales a alone: rhe(5 * 0.5) = rhe(2.5) = 2.
    assert out.tolist() == [[2 * 2**-3, 2 * 2**-3]]
    add_node = next(n for n in q_ir.graph.nodes if n.op == "add")
    assert add_node.attrs["multipliers"] == [2**15, 2**15] and add_node.attrs["shifts"] == [16, 17]
    assert add_node.attrs["frac_bits"] == 0
    # high precision (F = 8): terms keep 8 fractional bits, 640 + 128 = 768 -> rhe(3.0) = 3, as the float path.
    high = convert(Module(qat_ir.kind, qat_ir.graph, qat_ir.input_leaves, qat_ir.input_spec, qat_ir.output_spec,
                          meta={**qat_ir.meta, "high_precision_qpp": True}))
    assert high(a, b).tolist() == [[3 * 2**-3, 2 * 2**-3]]
    add_node = next(n for n in high.graph.nodes if n.op == "add")
    assert add_node.attrs["multipliers"] == [2**30, 2**30] and add_node.attrs["shifts"] == [31, 32]
    assert add_node.attrs["frac_bits"] == 8
    with torch.no_grad():
        assert prepared(a, b).tolist() == [[3 * 2**-3, 2 * 2**-3]]


def test_int_conv_kernel_matches_spec_example():
    # docs/march.md §8 worked conv example: acc 2867 -> 22 with (M, shift) = (2**30, 37).
    node = Node("conv2d", ["x", "w", "b"], ["y"], {
        "stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1,
        "multiplier": [2**30], "shift": [37], "out_dtype": "qint8"})
    x = torch.tensor([16, 8, -12, 32], dtype=torch.int8).reshape(1, 4, 1, 1)
    w = torch.tensor([32, 16, -32, 48], dtype=torch.int8).reshape(1, 4, 1, 1)
    b = torch.tensor([307], dtype=torch.int32)
    y = int_dispatch(node, [x, w, b])
    assert y.dtype == torch.int8 and y.flatten().tolist() == [22]
    # saturation: a huge bias saturates the int8 output, it never wraps
    y = int_dispatch(node, [x, w, torch.tensor([2**30], dtype=torch.int32)])
    assert y.flatten().tolist() == [127]


def test_multitask_non_tensor_inputs_are_specialised():
    name = "multitask"
    model = get_model(name)
    inputs, _ = example_inputs(name)
    prepared = _calibrated(model, (inputs, ["cls"]), [(b, ["cls"]) for b, _ in sample_batches(name, 2, 4)])
    qat_ir = export(prepared, (inputs, ["cls"]))
    out = qat_ir(inputs, ["cls"])
    assert set(out) == {"cls"}
    by_name = qat_ir(**{n: inputs[n.split(".")[-1]] for n in qat_ir.input_names})
    assert torch.equal(by_name["cls"], out["cls"])
    assert qat_ir.input_names == ["inputs.image", "inputs.meta"]
    with pytest.raises(QuantLensError, match=r"(?s).cls. at export.*export again"):
        qat_ir(inputs, ["reg"])
    q_ir = convert(qat_ir)
    with pytest.raises(QuantLensError, match="same structure as at export"):
        q_ir(inputs, ["cls", "reg"])


class _Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = QuantStub()

    def forward(self, x):
        return torch.fft.rfft(self.q(x)).real  # no integer rule for an FFT


def test_an_op_without_integer_rule_runs_on_the_host_through_convert():
    """The march's partition (issue #41): fft has no integer rule, so it is a float host op at its op site in both
    IRs, read through a dequantize, and the quantized IR still computes what the qat IR computes."""
    x = torch.randn(2, 8)
    prepared = _calibrated(_Unsupported(), (x,), [(x,)])
    assert prepared._quantlens_state.plans["fft_rfft_0"].host
    qat_ir = export(prepared, (x,))
    host = [n for n in qat_ir.graph.nodes if n.site == "fft_rfft_0"]
    assert host and all(n.attrs.get("host") for n in host)
    assert any(n.op == "host_aten" and n.attrs["target"].startswith("aten::_fft_r2c") for n in host)
    quantized = convert(qat_ir)
    reads = {v for n in quantized.graph.nodes if n.site == "fft_rfft_0" for v in n.inputs}
    assert any(n.op == "dequantize" and n.outputs[0] in reads for n in quantized.graph.nodes)
    assert torch.allclose(quantized(x), qat_ir(x), atol=1e-4)


def test_export_refuses_float_model_and_convert_refuses_other_kinds():
    with pytest.raises(QuantLensError, match="prepared model"):
        export(nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(QuantLensError, match="qat IR"):
        convert("not an IR")


def test_transformers_bert_exports_and_converts_to_integers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from quantlens.compiler import load, save

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    batches = [(torch.randint(0, 100, (2, 8), generator=gen), mask) for _ in range(4)]
    prepared = _calibrated(model, batches[0], batches)
    qat_ir = export(prepared, batches[0])
    with torch.no_grad():
        ref = prepared(*batches[0])
    # the qat IR computes what the pre_export model computes (tables included)
    from quantlens.quantization import pre_export

    with torch.no_grad():
        tables = pre_export(prepared)(*batches[0])
    torch.testing.assert_close(qat_ir(*batches[0]).last_hidden_state, tables.last_hidden_state, rtol=0, atol=1e-6)
    q_ir = convert(qat_ir)
    stats = q_ir.statistics()
    assert stats["int_softmax[qint8]"] == 2 and stats["int_layer_norm[qint8]"] == 5 and stats["matmul[qint8]"] == 4
    assert not any(n.op in ("softmax", "layer_norm", "gelu", "sdpa") for n in q_ir.graph.nodes)
    got = q_ir(*batches[0])
    steps = _output_steps(qat_ir)
    for r, g, step in zip(_tensors(qat_ir(*batches[0])), _tensors(got), steps):
        assert (r - g).abs().max().item() <= 4 * step + 1e-7
    assert (got.last_hidden_state - ref.last_hidden_state).abs().max() < 0.5 * ref.last_hidden_state.abs().max()
    path = tmp_path / "bert.qlir"
    save(q_ir, path)
    again = load(path)
    assert torch.equal(again(*batches[0]).last_hidden_state, got.last_hidden_state)


class _OpCoverage(nn.Module):
    """Exercises the issue's op list: conv1d/2d, linear, bmm, split/slice/select, add/sub/mul/div, cat, clamp,
    relu6, max/avg pool, nearest and bilinear interpolation, mean/sum, tanh, silu, reshapes and expand."""

    def __init__(self):
        super().__init__()
        self.q, self.q2 = QuantStub(), QuantStub()
        self.c1 = nn.Conv1d(4, 8, 3, padding=1)
        self.c2 = nn.Conv2d(4, 8, 3, padding=1)
        self.r6, self.pool, self.ap = nn.ReLU6(), nn.MaxPool2d(2), nn.AvgPool2d(2)
        self.lin = nn.Linear(8, 8)
        self.dq, self.dq2 = DeQuantStub(), DeQuantStub()

    def forward(self, x, seq):
        x, seq = self.q(x), self.q2(seq)
        y = self.r6(self.c2(x))
        a, b = torch.split(y, 4, dim=1)
        z = torch.cat([a - b, torch.clamp(a * b, -1, 1)], dim=1)
        z = self.pool(z) + self.ap(z)
        z = nn.functional.interpolate(z, scale_factor=2, mode="nearest") + nn.functional.interpolate(
            z, scale_factor=2, mode="bilinear")
        z = z[:, :, 1:5, :].sum(dim=2) / (z.mean().abs() + 1.0)
        t = torch.tanh(self.c1(seq)) * nn.functional.silu(seq.mean(dim=1, keepdim=True))
        t = t.transpose(1, 2).unsqueeze(1).squeeze(1)
        u = torch.bmm(t, t.transpose(1, 2)).select(1, 0)
        w = self.lin(z.flatten(1)[:, :8]).unsqueeze(-1).expand(-1, -1, 2)
        return self.dq(w), self.dq2(u)


@pytest.mark.parametrize("setter", [default_calibration_qconfig_setter, calibration_8bit_weight_16bit_act_qconfig_setter])
def test_op_coverage_model_converts_close_to_qat_ir(setter):
    torch.manual_seed(0)
    model = _OpCoverage().eval()
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 4, 6, generator=gen)) for _ in range(4)]
    prepared = _calibrated(model, batches[0], batches, setter)
    qat_ir = export(prepared, batches[0])
    q_ir = convert(qat_ir)
    ops = set(q_ir.statistics())
    assert {"conv1d", "conv2d", "linear", "matmul", "split", "slice", "select", "cat", "clamp", "max_pool2d",
            "avg_pool2d_int", "bilinear_int", "upsample_nearest2d", "sum_int", "int_div", "add_const"} <= ops
    # high precision: the integer rules round like the fake quant, up to ties and float rounding (measured 1e-7 for
    # int8). The default qpp rounds each add term to whole steps (F = 0) and uses 16-bit multipliers: int8
    # intermediates can be one step (1/127 of their range) off at each add, and the final linear (int32 output)
    # sums 8 of them (measured 5.4%); int16 intermediates' steps are 256 times smaller.
    high = convert(Module(qat_ir.kind, qat_ir.graph, qat_ir.input_leaves, qat_ir.input_spec, qat_ir.output_spec,
                          meta={**qat_ir.meta, "high_precision_qpp": True}))
    int8 = setter is default_calibration_qconfig_setter
    for ir, tolerance in ((high, 0.03 if int8 else 1e-3), (q_ir, 0.08 if int8 else 1e-3)):
        for ref, got in zip(qat_ir(*batches[1]), ir(*batches[1])):
            assert (ref - got).abs().max() <= tolerance * ref.abs().max()


class _TorchEncoder(nn.Module):
    """torch's own nn.TransformerEncoderLayer: F.multi_head_attention_forward is looked into, op by op."""

    def __init__(self):
        super().__init__()
        self.q = QuantStub()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
        self.dq = DeQuantStub()

    def forward(self, x):
        return self.dq(self.layer(self.q(x)))


def test_torch_multihead_attention_is_quantized_op_by_op():
    from quantlens.quantization import get_op_sites

    torch.manual_seed(0)
    model = _TorchEncoder().eval()
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 5, 16, generator=gen),) for _ in range(4)]
    sites = get_op_sites(model, batches[0])
    assert "layer.self_attn.multi_head_attention_forward_0" not in sites
    assert {"layer.self_attn.linear_0", "layer.self_attn.scaled_dot_product_attention_0",
            "layer.self_attn.linear_1"} <= set(sites)
    prepared = _calibrated(model, batches[0], batches)
    assert get_op_sites(prepared, batches[0]) == sites
    plan = prepared._quantlens_state.plans["layer.self_attn.linear_0"]
    assert plan.weight_fq and plan.bias_position == 2  # functional in_proj: int8 weight, int32 bias
    q_ir = convert(export(prepared, batches[0]))
    with torch.no_grad():
        ref = model(*batches[1])
    got = q_ir(*batches[1])
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
