"""Masked attention (docs/march.md §13.6.2): before fake quantization the prepared model masks as the float one
does; fake quantizing, a masked score is the lowest code of the softmax input's grid, the same in the quantized IR."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export
from quantlens.kernels import int_softmax, softmax_exp_table, softmax_multiplier
from quantlens.march.spec import QuantDType
from quantlens.quantization import FakeQuantState, calibrate, pre_export, prepare, set_fake_quantize


class _Attention(nn.Module):
    """q, k, v projections and sdpa with a causal, boolean or additive mask (a narrow score grid: small weights)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (m(x).view(b, n, 2, 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.how == "causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keep = torch.ones(n, n, dtype=torch.bool).tril()
            keep[0] = False  # a row with every key masked: torch's attention gives 0 there
            mask = keep if self.how == "bool" else torch.zeros(n, n).masked_fill(~keep, torch.finfo(x.dtype).min)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, 8)


def _prepared(how):
    torch.manual_seed(0)
    model, x = _Attention(how).eval(), torch.randn(2, 6, 8) * 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, (x,), check_result_dir=None, allow_no_stubs=True), [(x,)])
    return model, prepared, x


@pytest.mark.parametrize("how", ["causal", "bool", "additive"])
def test_before_fake_quantization_masked_keys_get_no_weight(how):
    model, prepared, x = _prepared(how)
    with torch.no_grad():
        ref = model(x)
        set_fake_quantize(prepared, FakeQuantState.FLOAT)
        assert torch.allclose(prepared(x), ref, atol=1e-6)  # the lowest code gave errors of 0.3 here
        set_fake_quantize(prepared, FakeQuantState.VALIDATION)
        assert (prepared(x) - ref).abs().max() > 0.05  # the march's masked keys keep weight on this narrow grid


def test_a_masked_score_is_the_lowest_code_through_every_stage():
    model, prepared, x = _prepared("causal")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pe = pre_export(prepared, example_inputs=(x,))
        set_fake_quantize(pe, FakeQuantState.VALIDATION)
        q_ir = convert(export(pe, (x,), dynamic_batch=False))
    with torch.no_grad():
        assert torch.equal(q_ir(x), pe(x))
    assert "masked_fill_int" in [n.op for n in q_ir.graph.nodes]


def test_the_lowest_code_keeps_weight_on_a_narrow_grid_by_hand():
    """§13.6.2's examples: row [16, masked, masked] -> codes [16, -128, -128], int8 in and out at 2**-7."""
    int8, (m, shift) = QuantDType.qint8, softmax_multiplier(2 ** -7)
    row = torch.tensor([[16, -128, -128]], dtype=torch.int8)
    wide, narrow = softmax_exp_table(1 / 16, int8, int8), softmax_exp_table(1 / 256, int8, int8)
    assert wide.lookup(torch.tensor([-144])).tolist() == [4]  # rhe(exp(-9) * 2**15)
    assert int_softmax(row, -1, wide, m, shift, int8).tolist() == [[127, 0, 0]]
    assert narrow.lookup(torch.tensor([-144])).tolist() == [18671]  # rhe(exp(-0.5625) * 2**15)
    assert int_softmax(row, -1, narrow, m, shift, int8).tolist() == [[60, 34, 34]]
