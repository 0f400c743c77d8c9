"""Every stage keeps the one before it, on small nets of the shapes that broke it in the coverage sweep.

* a LayerNorm subclass whose forward permutes around ``super().forward`` (ConvNeXt's channels_first norm) is traced
  op by op, so pre_export's layer_norm table normalizes the axis the module normalizes;
* the network's float input is quantized where it is first consumed, also by a data-movement op (MobileNet's
  TF-style ``F.pad``, a slice, a view), so convert gets a quantized movement op;
* the sweep's BatchNorm statistics are the data's, so a deep net's activations do not fade under the least scale.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export
from quantlens.compiler.interpreter import run_graph
from quantlens.errors import QuantLensError
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.sites.op_rules import COMPUTES_REGISTERED_OP, module_rule


def _cos(a, b):
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _prepared(model, example):
    torch.manual_seed(1)
    batches = [(torch.randn_like(example[0]),) for _ in range(3)] + [example]
    return calibrate(prepare(model.eval(), example, default_calibration_qconfig_setter, check_result_dir=None,
                             allow_no_stubs=True),
                     batches)


class ChannelsFirstNorm(nn.LayerNorm):
    """ConvNeXt's ``data_format="channels_first"`` norm: a LayerNorm over dim 1 by permuting around it."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNextBlock(nn.Module):
    def __init__(self, norm_cls=ChannelsFirstNorm):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = norm_cls(8, eps=1e-6)
        self.act = nn.GELU()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.act(self.norm(self.stem(x))))


def test_a_registered_module_subclass_with_its_own_forward_is_traced_op_by_op():
    class PlainSubclass(nn.LayerNorm):  # no forward of its own: still one layer_norm site
        pass

    assert module_rule(PlainSubclass(8)).op_type == "layer_norm"
    assert module_rule(ChannelsFirstNorm(8)) is None
    assert module_rule(nn.LayerNorm(8)).op_type == "layer_norm"


def test_a_channels_first_layer_norm_keeps_every_stage():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)  # H = W = 6 != C = 8: a norm over the last axis cannot pass unnoticed
    model = ConvNextBlock()
    prepared = _prepared(model, (x,))
    plans = prepared._quantlens_state.plans
    assert plans["norm.layer_norm_0"].op_type == "layer_norm" and "norm" not in plans
    tables = pre_export(prepared, example_inputs=(x,))
    with torch.no_grad():
        float_out, fq_out, table_out = model(x), prepared(x), tables(x)
        assert _cos(fq_out, float_out) > 0.99
        assert _cos(table_out, fq_out) > 0.999  # was a RuntimeError (the table normalized W = 6 with 8 gains)
        qat_ir = export(tables, (x,))
        assert torch.equal(qat_ir(x), table_out)
        assert _cos(convert(qat_ir)(x), qat_ir(x)) > 0.998


def test_a_layer_norm_table_given_the_wrong_axis_says_so():
    class ClaimsLayerNorm(ChannelsFirstNorm):  # declares it computes nn.LayerNorm's op, but permutes
        pass

    setattr(ClaimsLayerNorm, COMPUTES_REGISTERED_OP, True)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    tables = pre_export(_prepared(ConvNextBlock(ClaimsLayerNorm), (x,)), example_inputs=(x,))
    with pytest.raises(QuantLensError, match=r"'norm' \(layer_norm\) normalizes the trailing dims \(8,\).*"
                                             r"\(2, 8, 6, 6\)"):
        tables(x)


class MoveThenConv(nn.Module):
    """The network's float input goes through a data-movement op before its first compute op."""

    def __init__(self, move):
        super().__init__()
        self.move = move
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.act = nn.ReLU6()

    def forward(self, x):
        return self.act(self.conv(self.move(x)))


_MOVES = {
    "pad": (lambda x: F.pad(x, (0, 1, 0, 1)), "pad_0"),  # TF 'same' padding of a stride-2 conv (MobileNet)
    "getitem": (lambda x: x[:, :, 1:, 1:], "getitem_0"),
    "flip": (lambda x: x.flip(-1), "flip_0"),
}


@pytest.mark.parametrize("kind", list(_MOVES))
def test_the_network_input_is_quantized_where_a_movement_op_first_consumes_it(kind):
    move, site = _MOVES[kind]
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9)
    model = MoveThenConv(move)
    prepared = _prepared(model, (x,))
    plans = prepared._quantlens_state.plans
    assert list(plans[site].input_fq) == [0] and plans[site].input_dtypes == ["qint8"]
    assert not plans["conv"].input_fq  # the conv takes the movement op's int8 output as it is
    tables = pre_export(prepared, example_inputs=(x,))
    qat_ir = export(tables, (x,))
    quantized = convert(qat_ir)  # was: "op 'pad' at op site 'pad_0' takes 'x', which is not quantized"
    with torch.no_grad():
        assert torch.equal(qat_ir(x), tables(x))
        assert _cos(quantized(x), qat_ir(x)) > 0.998


def test_a_quantized_pad_writes_the_zero_code():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 5, 5)
    prepared = _prepared(MoveThenConv(_MOVES["pad"][0]), (x,))
    quantized = convert(export(pre_export(prepared, example_inputs=(x,)), (x,)))
    quantize, pad = [n for n in quantized.graph.nodes if n.site == "pad_0"]  # the input is quantized at the pad
    assert quantize.op == "quantize" and pad.op == "pad_int" and pad.attrs["value"] == 0
    s = float(prepared._quantlens_state.fq["pad_0|in0"].scale)
    seen = {}
    run_graph(quantized, {quantized.graph.inputs[0]: x},
              observer=lambda node, ins, outs: seen.setdefault("pad", outs[0]) if node is pad else None)
    codes = torch.clamp(torch.round(x / s), -128, 127)  # quantize: round half to even, saturate
    expected = F.pad(codes, (0, 1, 0, 1), value=0.0).to(torch.int64)
    assert torch.equal(seen["pad"].to(torch.int64), expected)
    assert expected[..., -1, :].abs().sum() == 0 and expected[..., :, -1].abs().sum() == 0  # the zero code


def test_a_moved_input_that_reaches_no_quantized_op_stays_float():
    class SideOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), x.flip(-1)

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    plans = _prepared(SideOutput(), (x,))._quantlens_state.plans
    assert not plans["flip_0"].input_fq and plans["flip_0"].output_dtype == "float"
    assert plans["lin"].input_fq  # the linear still quantizes the input it takes


@pytest.mark.parametrize("name", ["mobilevit", "resnet"])
def test_the_sweep_batchnorm_statistics_are_the_datas(name):
    pytest.importorskip("transformers")
    from quantlens.zoo.architectures import build

    model, _, batches, held_out = build(name)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(m.momentum is not None and int(m.num_batches_tracked) == len(batches) for m in norms)
    with torch.no_grad():
        out = model(*held_out)
    # momentum 0.1 over 4 batches kept 66% of the 0/1 init: MobileViT's output was 5e-8, under the least scale
    assert float(out[0].abs().max()) > 1e-3
