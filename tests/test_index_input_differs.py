"""An op whose index input differs between the two models says so and names the op that made the index (issue #42,
point 3): a detection head's gather of boxes by the top-k of int8 scores moves other boxes where the ranking
flips; the advice is to keep the index exact, not int16 for the gather's data."""

import torch
from torch import nn

from quantlens.profiler import QuantAnalysis
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.score, self.box = nn.Linear(8, 32), nn.Linear(8, 32)

    def forward(self, x):
        h = self.q(x)
        _, idx = torch.topk(self.score(h), 6, dim=-1)
        top = idx.clamp(min=0)  # an integer op that is no op site: the index is followed through it
        return self.dq(torch.gather(self.box(h), 1, top))


class Exact(nn.Module):
    """The same gather by indices made from positions (integers only): the same in both models."""

    def __init__(self):
        super().__init__()
        self.q, self.dq, self.box = QuantStub(), DeQuantStub(), nn.Linear(8, 32)

    def forward(self, x):
        idx = torch.arange(6).flip(0).expand(x.shape[0], 6)
        return self.dq(torch.gather(self.box(self.q(x)), 1, idx))


def _analysis(model, tmp_path):
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    prepared = calibrate(prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None), [x])
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(x)
    qa.run()
    return qa


def test_a_gather_by_a_flipped_ranking_names_the_topk_that_made_its_index(tmp_path):
    torch.manual_seed(0)
    qa = _analysis(Head().eval(), tmp_path)
    rows = {r.op_name: r for r in qa.compare_per_layer()}
    gather = rows["gather_0"]
    assert gather.index_differs.startswith("input ") and " of 96 differ" in gather.index_differs
    assert gather.index_producer == "topk_0"
    assert gather.same_input_sqnr is None or gather.same_input_sqnr > 100  # it only moves values
    findings = [f for f in qa.advise() if f.rule == "index_input_differs"]
    assert [f.op_name for f in findings] == ["gather_0"]
    assert "made by 'topk_0'" in findings[0].info and "keep the arithmetic that makes the index exact" in \
        findings[0].advice
    text = (tmp_path / "compare_per_layer_out.csv").read_text()
    assert "index_differs" in text.splitlines()[0]


def test_an_index_made_from_integers_alone_is_not_flagged(tmp_path):
    torch.manual_seed(0)
    qa = _analysis(Exact().eval(), tmp_path)
    rows = {r.op_name: r for r in qa.compare_per_layer()}
    assert rows["gather_0"].index_differs == ""
    assert not [f for f in qa.advise() if f.rule == "index_input_differs"]
