"""Channel exponents read by linears and written by LayerNorms (docs/march.md §3.1): a linear folds its input's
exponents into its weight (int8 x int8, no shift), a LayerNorm's per-element gain writes them; hand-computed values
and a post-LN stack through every stage."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_channel_exponents import _data, _Exponents, _PostLN, _stages, _tables_and_ir
from torch import nn

from quantlens.compiler import load, save, to_onnx
from quantlens.errors import QuantLensError
from quantlens.kernels import layer_norm_constants
from quantlens.march import QuantDType, rules
from quantlens.march.numerics import quantize
from quantlens.quantization import FakeQuantState, calibrate, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


def test_the_fold_rule_by_hand():
    """Input scales [1, 0.25] (k = [0, 2]); rows of W · diag(2**-k) at [0.5, 0.25]: S[o, c] = s_w[o] · 2**k_c.
    W[0] = [1.0, 2.0] -> codes [round(1 / 0.5), round(2 · 0.25 / 0.5)] = [2, 1]; the row scales come back from S
    for the same input and are refused for other exponents."""
    inp = torch.tensor([1.0, 0.25])
    factors = rules.exponent_factors(inp)
    assert factors.tolist() == [1.0, 0.25]
    folded = rules.fold_exponents(torch.tensor([0.5, 0.25]), factors)
    assert folded.tolist() == [[0.5, 2.0], [0.25, 1.0]]
    w = torch.tensor([[1.0, 2.0], [-0.25, 3.0]])
    assert quantize(w, folded, QuantDType.qint8, 0).tolist() == [[2, 1], [-1, 3]]
    assert rules.folded_rows(folded, inp).tolist() == [0.5, 0.25]
    with pytest.raises(QuantLensError, match="folded for channel exponents other"):
        rules.folded_rows(folded, torch.tensor([1.0, 0.5]))
    with pytest.raises(QuantLensError, match=r"\[out, in\]"):
        rules.folded_rows(folded, torch.tensor([1.0, 0.5, 0.25]))


def test_layer_norm_constants_take_each_channels_output_scale():
    """N = 2, gamma = 1, beta = 0.5, s_out = [1, 0.25]: a = sqrt(2) · 4 (the finer channel), T = 30 - floor(log2(a ·
    2**-23)) = 51; gain = rhe(sqrt(2) / s_out[j] · 2**28), bias = rhe(0.5 / s_out[j] · 2**51). Channel 1's
    constants are those of a per-tensor output at 0.25 (same T); channel 0's are a quarter of them, rounded."""
    g, b = torch.ones(2), torch.full((2,), 0.5)
    c = layer_norm_constants(0.1, torch.tensor([1.0, 0.25]), QuantDType.qint8, 2, g, b, 1e-5)
    assert c.shift == 51
    assert c.gain.tolist() == [round(math.sqrt(2) * 2**28), round(4 * math.sqrt(2) * 2**28)]
    assert c.bias.tolist() == [2**50, 2**52]
    tensor = layer_norm_constants(0.1, 0.25, QuantDType.qint8, 2, g, b, 1e-5)
    assert tensor.shift == c.shift and int(tensor.gain[1]) == int(c.gain[1]) and int(tensor.bias[1]) == int(c.bias[1])


def _post_ln() -> nn.Module:
    """Two post-LN blocks and a head (``test_channel_exponents._PostLN``); ln1 gets an outlier channel (gain 12):
    the stream's norm output is read by fc2 (which folds its exponents) and by add_1 (which reads them shifted)."""
    model = _PostLN().eval()
    with torch.no_grad():
        model.ln1.weight[3] = 12.0
    return model


def test_a_norm_writes_exponents_and_a_linear_folds_them_through_every_stage(tmp_path):
    torch.manual_seed(0)
    model, x = _post_ln(), _data()
    prepared, qat_ir, q_ir = _stages(model, _Exponents(("add_0", "ln1", "add_1")), x)
    ln1 = prepared._quantlens_state.fq["ln1|out"]
    _, k = rules.channel_exponents(ln1.scale)
    assert k[3] == 0 and max(k) == 3
    w_fq = prepared.fc2.weight_fake_quant
    assert tuple(w_fq.scale.shape) == (16, 16)  # folded: s_w[o] · 2**k_c
    rows = rules.folded_rows(w_fq.scale, ln1.scale)
    assert torch.equal(w_fq.scale, rules.fold_exponents(rows, rules.exponent_factors(ln1.scale)))
    nodes = q_ir.graph.nodes
    norm = next(n for n in nodes if n.op == "int_layer_norm" and n.site == "ln1")
    fc2 = next(n for n in nodes if n.op == "linear" and n.site == "fc2")
    assert fc2.inputs[0] == norm.outputs[0]  # int8 codes as they are: no shift between the norm and the linear
    assert q_ir.graph.values[norm.outputs[0]].qdtype == "qint8"
    shifted = [n for n in nodes if n.op == "channel_shift"]
    assert any(n.inputs[0] == norm.outputs[0] for n in shifted)  # the add reads them on the common grid
    assert not any(n.attrs.get("host") for n in nodes)
    # the weight's int8 codes are round(W · 2**-k_c / s_w[o]) (the fake quant's levels)
    codes = q_ir.graph.constants[fc2.inputs[1]]
    expected = quantize(prepared.fc2.weight.detach() * rules.exponent_factors(ln1.scale), rows, QuantDType.qint8, 0)
    assert codes.dtype == torch.int8 and torch.equal(codes.to(torch.int64), expected)
    held = x[32:]
    with torch.no_grad():
        qat, q = qat_ir(held), q_ir(held)
        per_tensor = _stages(model, default_calibration_qconfig_setter, x)
        assert (q - qat).abs().max() <= (per_tensor[2](held) - per_tensor[1](held)).abs().max() * 1.5
    import onnxruntime as ort

    for form in ({}, {"standard_qdq": True}):
        path = to_onnx(qat_ir, tmp_path / f"post_ln{len(form)}.onnx", **form)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert torch.equal(torch.from_numpy(sess.run(None, {n: v.numpy() for n, v in qat_ir.feeds(held).items()})[0]),
                           qat)
    save(q_ir, tmp_path / "q.qlir")
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "q.qlir")(held), q)


def test_a_weight_refolds_when_its_inputs_exponents_go():
    """When the norm's output loses its exponents (one scale), the linear's weight is per output channel again at
    its next forward: the scale of the weight alone."""
    torch.manual_seed(0)
    model, x = _post_ln(), _data()
    prepared, _, _ = _stages(model, _Exponents(("add_0", "ln1", "add_1")), x)
    assert prepared.fc2.weight_fake_quant.scale.dim() == 2
    plain, _, q_ir = _stages(model, _Exponents(("add_0", "add_1")), x)
    assert plain.fc2.weight_fake_quant.scale.dim() == 1
    fq = prepared.fc2.weight_fake_quant
    ln1 = prepared._quantlens_state.fq["ln1|out"]
    ln1.channel_exponents, ln1.ch_axis, ln1.scale = False, None, ln1.scale.amax()
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    with torch.no_grad():
        prepared(x[:4])
    assert fq.scale.dim() == 1 and torch.equal(fq.scale, plain.fc2.weight_fake_quant.scale)


def test_learned_rounding_keeps_a_folded_weights_levels():
    """learn_rounding on a model whose linear folds exponents: the returned weights are on the folded levels, and
    prepare quantizes them to themselves (the same [out, in] scale, the row maxima unchanged)."""
    from quantlens.search.remedies.learned_rounding import learn_rounding

    torch.manual_seed(0)
    model, x = _post_ln(), _data()
    setter = _Exponents(("add_0", "ln1", "add_1"))
    rounded, layers = learn_rounding(model, x[:8], [x[:16], x[16:32]], setter, epochs=2)
    assert "fc2" in layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = calibrate(prepare(rounded, x[:8], setter, check_result_dir=None, allow_no_stubs=True), [x[:32]])
    set_fake_quantize(again, FakeQuantState.VALIDATION)
    with torch.no_grad():
        again(x[:4])
    fq = again.fc2.weight_fake_quant
    assert fq.scale.dim() == 2 and fq.fake_quant_enabled
    w = rounded.fc2.weight.detach()
    assert torch.equal(fq(w), w)


def test_qat_at_level_1_trains_through_folded_exponents_and_deploys_what_it_trained():
    """qat_distill at consistency level 1 on the post-LN stack with channel exponents at the sums and the norm
    (fc2 folds them): the QAT forward runs the integer rules (the exponent-form add, the folded GEMM), the held-out
    error drops, and the quantized IR of the result is its pre_export model in VALIDATION, bit for bit."""
    from quantlens.quantization import ConsistencyStrategy
    from quantlens.search.remedies.qat_distill import QatBudget, qat_distill

    torch.manual_seed(0)
    model, x = _post_ln(), _data()
    setter = _Exponents(("add_0", "ln1", "add_1"))
    batches, held = [x[:16], x[16:32]], x[32:]

    def error(m, s):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = calibrate(prepare(m, x[:8], s, check_result_dir=None, allow_no_stubs=True), batches)
        set_fake_quantize(p, FakeQuantState.VALIDATION)
        with torch.no_grad():
            return float((p(held) - model(held)).pow(2).mean()), p

    ConsistencyStrategy.set_consistency_level(1)
    try:
        before, _ = error(model, setter)
        trained, trained_setter = qat_distill(model, x[:8], batches, setter, budget=QatBudget(steps=40, seconds=60))
        after, prepared = error(trained, trained_setter)
        tables, q_ir = _tables_and_ir(prepared, x)
    finally:
        ConsistencyStrategy.disable()
    assert after < before, (before, after)
    assert tables.fc2.weight_fake_quant.scale.dim() == 2
    with torch.no_grad():
        assert torch.equal(tables(held), q_ir(held))


def test_a_chain_of_sums_that_reaches_no_norm_is_not_a_stream():
    """Attention scores + a position bias + a mask before a softmax (MPNet's): sums read only by sums, but their
    last dim is the key positions; the stream's sums lead to a norm (its channels are the norm's features)."""
    from quantlens.search.remedies.channel_exponents import stream_sites
    from quantlens.sites.record import record_model

    class _Scores(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)
            self.register_buffer("bias", torch.randn(8, 8))

        def forward(self, x):  # x: [batch, 8, 16]
            scores = self.q(x) @ x.transpose(1, 2)
            scores = scores + self.bias
            scores = scores + torch.zeros(8)
            h = torch.softmax(scores, dim=-1) @ x
            return self.ln(h + x)

    sites = stream_sites(record_model(_Scores().eval(), [torch.randn(2, 8, 16)]))
    assert sites == ["add_2"], sites  # (the norm is the output: nothing reads it)


class _Pooled(nn.Module):
    """A norm's exponent codes reach a linear through ``x[:, 0]`` (BERT's pooler): the select drops a dim before
    the channels, which keep their exponents."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln, self.head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):  # [batch, 8, 16]
        return self.head(self.ln(self.fc(x) + x)[:, 0])


class _Padded(_Pooled):
    """Padded along the tokens before the linear (Swin's window padding): a zero is on every channel's grid."""

    def forward(self, x):
        return self.head(torch.nn.functional.pad(self.ln(self.fc(x) + x), (0, 0, 0, 2)))


class _Shared(_Pooled):
    """One linear called at two op sites (ALBERT's shared layer): on the norm's codes and on a per-tensor value."""

    def forward(self, x):
        h = self.ln(self.fc(x) + x)
        return self.fc(h) + self.fc(torch.relu(x))


@pytest.mark.parametrize("model_class", [_Pooled, _Padded, _Shared])
def test_exponent_codes_through_a_select_a_pad_or_into_a_shared_linear(model_class):
    """Each computes on the NPU (no host op) at level 0, and at level 1 the pre_export model is the quantized IR
    bit for bit: the select and the pad keep the exponents and the head folds them; a linear called at two op sites
    keeps one weight scale (it reads the norm's codes on their common grid), so it exports and converts."""
    from quantlens.quantization import ConsistencyStrategy

    torch.manual_seed(0)
    model = model_class().eval()
    x = _data().reshape(8, 8, 16)
    setter = _Exponents(("add_0", "ln"))
    for level in (0, 1):
        ConsistencyStrategy.set_consistency_level(level)
        try:
            prepared = calibrate(prepare(model, x[:2], setter, check_result_dir=None, allow_no_stubs=True), [x[:6]])
            tables, q_ir = _tables_and_ir(prepared, x[:2].repeat(4, 1, 1))
        finally:
            ConsistencyStrategy.disable()
        assert not [n.op for n in q_ir.graph.nodes if n.attrs.get("host")]
        if model_class is _Shared:
            assert prepared.fc.weight_fake_quant.scale.dim() == 1 and not prepared.fc.folds_input_exponents
        else:
            assert prepared.head.weight_fake_quant.scale.dim() == 2
        if level == 1:
            with torch.no_grad():
                assert torch.equal(tables(x[6:]), q_ir(x[6:]))
