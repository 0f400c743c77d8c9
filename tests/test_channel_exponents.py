"""Channel exponents (docs/march.md §3.1): per-channel int8 activation scales ``s · 2**-k_c`` that the consumers
shift onto one grid exactly; the add rule writing them, the shift, and a post-LN residual block through every
stage."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export, load, save, to_onnx
from quantlens.errors import QuantLensError
from quantlens.kernels.integer.elementwise import add_kernel, channel_shift_kernel
from quantlens.march import March, Qpp, QuantDType, rules, using_march
from quantlens.quantization import ConsistencyStrategy, QuantSpec, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import (
    QconfigSetter,
    default_calibration_qconfig_setter,
    resolve_qconfigs,
)


def test_exponent_scales_by_hand():
    """s = the widest channel's scale; each channel the largest k <= K = 3 with s · 2**-k >= s_c."""
    s = torch.tensor([1.0, 0.3, 0.26, 0.1, 0.01, 0.5, 0.25])
    scales = rules.exponent_scales(s)
    assert scales.tolist() == [1.0, 0.5, 0.5, 0.125, 0.125, 0.5, 0.25]
    assert bool((scales >= s).all())  # no channel is clipped
    assert rules.channel_exponents(scales) == (1.0, [0, 1, 1, 3, 3, 1, 2])
    attrs, fine = rules.channel_shift(scales)
    assert attrs == {"left_shifts": [3, 2, 2, 0, 0, 2, 1], "out_dtype": "qint16"} and fine == 0.125


def test_scales_not_in_exponent_form_are_refused():
    with pytest.raises(QuantLensError, match="channel-exponent form"):
        rules.channel_exponents(torch.tensor([1.0, 0.3]))
    with pytest.raises(QuantLensError, match="channel-exponent form"):
        rules.channel_exponents(torch.tensor([1.0, 2.0**-4]))  # k = 4 > K = 3


def test_the_add_rule_writes_each_channel_on_its_own_exponent():
    """in scales 0.5 and 0.25, out scales [1, 0.25] (k = [0, 2]): channel c rescales with shift_i - k_c.
    Default profile (F = 0: each term rounded to output steps): 3·0.5 + 4·0.25 -> rhe(1.5) + rhe(1.0) = 3 at
    scale 1; (1.5 + 1.0) / 0.25 = 10; -3·0.5 + 5·0.25 -> rhe(-1.5) + rhe(1.25) = -1; 202 + 127 saturates.
    High precision (F = 8, one rounding): rhe(2.5) = 2, rhe(-0.25) = 0."""
    a = torch.tensor([[3, 3], [-3, 101]], dtype=torch.int8)
    b = torch.tensor([[4, 4], [5, 127]], dtype=torch.int8)
    scales = [torch.tensor(0.5), torch.tensor(0.25)]
    attrs = rules.add(scales, torch.tensor([1.0, 0.25]), QuantDType.qint8, Qpp.DEFAULT, out_axis=1)
    assert attrs["out_exponents"] == [0, 2] and attrs["out_axis"] == 1
    assert add_kernel([a, b], attrs).tolist() == [[3, 10], [-1, 127]]
    attrs = rules.add(scales, torch.tensor([1.0, 0.25]), QuantDType.qint8, Qpp.HIGH_PRECISION, out_axis=1)
    assert add_kernel([a, b], attrs).tolist() == [[2, 10], [0, 127]]
    with pytest.raises(QuantLensError, match="channel axis"):
        rules.add(scales, torch.tensor([1.0, 0.25]), QuantDType.qint8, Qpp.DEFAULT)


def test_the_channel_shift_is_exact_in_int16():
    q = torch.tensor([[-128, 5], [127, -7]], dtype=torch.int8)
    out = channel_shift_kernel([q], {"left_shifts": [3, 0], "axis": 1})
    assert out.dtype is torch.int16 and out.tolist() == [[-1024, 5], [1016, -7]]


def test_a_spec_asks_for_channel_exponents_only_where_they_exist():
    with pytest.raises(QuantLensError, match="ch_axis"):
        QuantSpec("qint8", channel_exponents=True)
    with pytest.raises(QuantLensError, match="int16"):
        QuantSpec("qint16", ch_axis=-1, channel_exponents=True)
    from quantlens.quantization.fake_quantize import FakeQuantize

    with using_march(March.ORT_CPU), pytest.raises(QuantLensError, match="no channel exponents"):
        FakeQuantize(QuantSpec("qint8", ch_axis=-1, channel_exponents=True))


class _Block(nn.Module):
    """A post-LN residual block: the sum of the residual stream goes to a LayerNorm only (BERT's)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(self.fc(x) + x)


class _Exponents(QconfigSetter):
    name = "channel exponents at add_0"

    def __init__(self, sites=("add_0",)):
        self.sites = sites

    def assign(self, ctx):
        result = resolve_qconfigs(default_calibration_qconfig_setter, ctx)
        for site, qc in list(result.qconfigs.items()):
            if qc is not None and site in self.sites and qc.output is not None:
                result.qconfigs[site] = qc.replace(output=replace(qc.output, ch_axis=-1, channel_exponents=True))
        return result


def _data():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    x[:, 3] *= 20  # two outlier channels in the residual stream
    x[:, 7] *= 6
    return x


def _stages(model, setter, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, x[:8], setter, check_result_dir=None, allow_no_stubs=True), [x[:32]])
        qat_ir = export(pre_export(prepared, example_inputs=x[:8]), x[:8], dynamic_batch=True)
        return prepared, qat_ir, convert(qat_ir)


def _tables_and_ir(prepared, x):
    """The pre_export model of a calibrated one, in VALIDATION, and its quantized IR (static example ``x[:8]``)."""
    from quantlens.quantization import FakeQuantState, set_fake_quantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tables = pre_export(prepared, example_inputs=x[:8])
    set_fake_quantize(tables, FakeQuantState.VALIDATION)
    return tables, convert(export(tables, x[:8], dynamic_batch=True))


def test_a_residual_stream_with_channel_exponents_through_every_stage(tmp_path):
    """The add writes int8 codes with a channel exponent each (the outlier channels keep k = 0, the others their
    own finer step); convert shifts them onto one int16 grid before the integer LayerNorm; the quantized IR
    follows the qat IR as closely as the per-tensor model's does; ONNX (both forms) equals the qat IR; the fake
    quant model is closer to float than with one scale for the stream."""
    torch.manual_seed(0)
    model, x = _Block().eval(), _data()
    prepared, qat_ir, q_ir = _stages(model, _Exponents(), x)
    fq = prepared._quantlens_state.fq["add_0|out"]
    top, k = rules.channel_exponents(fq.scale)
    assert k[3] == 0 and max(k) == 3 and fq.scale.numel() == 16
    ops = [n.op for n in q_ir.graph.nodes]
    add = next(n for n in q_ir.graph.nodes if n.op == "add")
    shift = next(n for n in q_ir.graph.nodes if n.op == "channel_shift")
    assert add.attrs["out_exponents"] == k and shift.attrs["left_shifts"] == [3 - v for v in k]
    assert ops.index("add") < ops.index("channel_shift") < ops.index("int_layer_norm")
    assert not any(n.attrs.get("host") for n in q_ir.graph.nodes)
    held = x[32:]
    with torch.no_grad():
        ref, fake, qat, q = model(held), prepared(held), qat_ir(held), q_ir(held)
    per_tensor, qat_pt, q_pt = _stages(model, default_calibration_qconfig_setter, x)
    with torch.no_grad():
        fake_pt = per_tensor(held)
        assert (q - qat).abs().max() <= (q_pt(held) - qat_pt(held)).abs().max() * 1.5
    assert float((fake - ref).pow(2).mean()) < float((fake_pt - ref).pow(2).mean())
    for form in ({}, {"standard_qdq": True}):
        import onnxruntime as ort

        path = to_onnx(qat_ir, tmp_path / f"block{len(form)}.onnx", **form)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        out = sess.run(None, {n: v.numpy() for n, v in qat_ir.feeds(held).items()})[0]
        assert torch.equal(torch.from_numpy(out), qat)
    assert q_ir.latency_estimate().cycles > 0
    save(q_ir, tmp_path / "q.qlir")  # the new op and the add's attrs survive the file
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "q.qlir")(held), q)


def test_the_add_alone_is_the_integer_rule_of_the_fake_quant_within_a_step():
    """Without the LayerNorm the stream's codes are the model output: the integer add (default profile: each
    term rounded) differs from the fake quant's one rounding by at most one step of each channel's own scale."""

    class _Add(_Block):
        def forward(self, x):
            return self.fc(x) + x

    torch.manual_seed(0)
    model, x = _Add().eval(), _data()
    prepared, qat_ir, q_ir = _stages(model, _Exponents(), x)
    scale = prepared._quantlens_state.fq["add_0|out"].scale
    with torch.no_grad():
        steps = (qat_ir(x[32:]) - q_ir(x[32:])).abs() / scale
    assert float(steps.max()) <= 1.0 + 1e-4
    assert float((steps - steps.round()).abs().max()) < 1e-3  # whole steps of each channel's scale


def test_a_linear_writes_channel_exponents_and_a_table_op_runs_on_the_host():
    """A GEMM's requantize is per output channel: a linear writes channel-exponent codes (the add then reads them
    shifted), within the per-tensor model's distance of the qat IR. A GELU's output asked in that form: its
    table has no per-channel output, so convert computes it on the host (named, with the reason), never with the
    first channel's scale."""
    torch.manual_seed(0)
    model, x = _Block().eval(), _data()
    _, qat_ir, q_ir = _stages(model, _Exponents(("fc", "add_0")), x)
    fc = next(n for n in q_ir.graph.nodes if n.site == "fc" and n.op == "linear")
    assert not fc.attrs.get("host") and len(fc.attrs["multiplier"]) == 16
    assert [n.op for n in q_ir.graph.nodes].count("channel_shift") == 2  # the add reads fc's, the norm the add's
    per_tensor = _stages(model, default_calibration_qconfig_setter, x)
    with torch.no_grad():
        gap = (q_ir(x[32:]) - qat_ir(x[32:])).abs().max()
        assert gap <= (per_tensor[2](x[32:]) - per_tensor[1](x[32:])).abs().max() * 1.5

    class _Gelu(_Block):
        def forward(self, x):
            return torch.nn.functional.gelu(self.fc(x) + x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = calibrate(prepare(_Gelu().eval(), x[:8], _Exponents(("gelu_0",)), check_result_dir=None,
                                     allow_no_stubs=True), [x[:32]])
        q_ir = convert(export(pre_export(prepared, example_inputs=x[:8]), x[:8], dynamic_batch=True))
    assert any("gelu_0" in str(w.message) and "does not write" in str(w.message) for w in caught)
    assert [n.op for n in q_ir.graph.nodes if n.site == "gelu_0" and n.attrs.get("host")] == ["gelu"]


@pytest.mark.parametrize("level", [1, 2, 4])
def test_at_consistency_levels_the_fake_quant_computes_the_channel_exponent_rules(level):
    """Levels 1-4 emulate the integer rules in the fake quant: with channel exponents at a linear's output and at
    the sum (the add writes them, the norm reads them shifted), the pre_export model in VALIDATION is the quantized
    IR bit for bit (level 2: power-of-two scales for every channel, the sum in no shared-scale group)."""
    torch.manual_seed(0)
    model, x = _Block().eval(), _data()
    ConsistencyStrategy.set_consistency_level(level)
    try:
        prepared = calibrate(prepare(model, x[:8], _Exponents(("fc", "add_0")), check_result_dir=None,
                                     allow_no_stubs=True), [x[:32]])
        tables, q_ir = _tables_and_ir(prepared, x)
    finally:
        ConsistencyStrategy.disable()
    fq = tables._quantlens_state.fq["add_0|out"]
    assert fq.channel_exponents and fq.scale_group is None and max(rules.channel_exponents(fq.scale)[1]) > 0
    with torch.no_grad():
        assert torch.equal(tables(x[32:]), q_ir(x[32:]))


class _PostLN(nn.Module):
    """Two post-LN blocks and a linear head: the stream's sites are the two sums, the linears writing into them
    and the norms (read by sums and linear modules, which fold the exponents); the head feeds no sum."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(16, 16), nn.LayerNorm(16)
        self.fc2, self.ln2 = nn.Linear(16, 16), nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.ln1(self.fc1(x) + x)
        h = self.ln2(self.fc2(h) + h)
        return self.head(h)


def test_the_remedy_gives_the_streams_sums_channel_exponents_and_the_search_keeps_them(tmp_path):
    from quantlens.search.remedies import REMEDIES, RemedyContext, load_remedies, save_remedies, search_remedies
    from quantlens.search.remedies.channel_exponents import ChannelExponentQconfigSetter, stream_sites
    from quantlens.sites.record import record_model

    torch.manual_seed(0)
    x = _data()
    assert stream_sites(record_model(_PostLN().eval(), [x[:8]])) == ["fc1", "add_0", "ln1", "fc2", "add_1", "ln2"]
    model = _Block().eval()
    ctx = RemedyContext(model, x[:8], [x[:32]], default_calibration_qconfig_setter)
    remedy = REMEDIES["channel_exponents"]
    assert remedy.applies(ctx)
    with using_march(March.ORT_CPU):
        assert not remedy.applies(ctx)  # a march without channel exponents
    assert isinstance(remedy.apply(ctx)[1], ChannelExponentQconfigSetter)
    held = x[32:]

    def evaluate(p):  # the block's output error against float, negated (higher is better)
        with torch.no_grad():
            return -float((p(held) - model(held)).pow(2).mean())

    # one calibration batch: the metric's noise is its re-measurement's, 0 on the CPU
    result = search_remedies(model, x[:8], [x[:32]], evaluate, 0.0, out_dir=tmp_path, int16=False,
                             range_sites=3, report=False)
    kept = {t.name: t for t in result.trials if t.kept}
    assert "channel_exponents" in result.transforms and kept["channel_exponents"].value > result.base_value
    # the ranges then try only per-tensor sites: a per-tensor observer at a per-channel one fails (found on
    # transformers' RoFormer and Swin: 20 and 12 skipped ranges)
    ranged = {t.site for t in result.trials if t.name != "channel_exponents" and t.site}
    assert ranged and not ranged & {"fc", "add_0"} and result.skipped == (), (ranged, result.skipped)
    save_remedies(result, tmp_path)
    _, loaded = load_remedies(model, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = calibrate(prepare(model, x[:8], loaded, check_result_dir=None, allow_no_stubs=True), [x[:32]])
    assert [k for k, fq in again._quantlens_state.fq.items() if fq.channel_exponents] == ["fc|out", "add_0|out"]
    assert evaluate(again) == result.value


def test_a_movement_op_between_the_sum_and_its_reader_keeps_the_exponents():
    """add -> transpose -> transpose back -> LayerNorm: the codes move with their exponents, and the LayerNorm
    still reads them shifted onto the common grid (not as plain per-channel int8)."""

    class _Moved(_Block):
        def forward(self, x):
            h = (self.fc(x) + x).unsqueeze(0).transpose(0, 1).squeeze(1)
            return self.ln(h)

    torch.manual_seed(0)
    model, x = _Moved().eval(), _data()
    _, qat_ir, q_ir = _stages(model, _Exponents(), x)
    ops = [n.op for n in q_ir.graph.nodes]
    assert "channel_shift" in ops and ops.index("channel_shift") < ops.index("int_layer_norm")
    assert not any(n.attrs.get("host") for n in q_ir.graph.nodes)
    per_tensor = _stages(model, default_calibration_qconfig_setter, x)
    with torch.no_grad():
        gap = (q_ir(x[32:]) - qat_ir(x[32:])).abs().max()
        assert gap <= (per_tensor[2](x[32:]) - per_tensor[1](x[32:])).abs().max() * 1.5
