"""Issue #26: token ids outside an embedding's table gave a raw IndexError from the IR; both IRs now refuse them
naming the op site, the id and the valid range. In-range ids give the same values as before."""

import warnings

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.errors import QuantLensError
from quantlens.quantization import DeQuantStub, calibrate, prepare


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc, self.dequant = nn.Embedding(10, 8), nn.Linear(8, 4), DeQuantStub()

    def forward(self, ids):
        return self.dequant(self.fc(self.emb(ids)))


def test_ids_outside_the_table_are_refused_by_op_site():
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(1))
    model = Lookup().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, (ids,), check_result_dir=None), [(ids,)])
        qat_ir = export(prepared, (ids,))
    quantized = convert(qat_ir)
    with torch.no_grad():
        assert torch.equal(qat_ir(ids), prepared(ids))  # the checked kernel computes what it did
    for bad, shown in ((12, "id 12"), (-1, "id -1")):
        wrong = ids.clone()
        wrong[0, 0] = bad
        for ir in (qat_ir, quantized):
            with pytest.raises(QuantLensError, match=rf"op site 'emb' \(embedding\): {shown} is outside the table "
                                                     r"of 10 rows; its ids must lie in \[0, 10\)"):
                ir(wrong)
