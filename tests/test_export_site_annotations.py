"""Export ignores an op-site annotation left open in fx_traceback.current_meta (process-global) by an earlier
traced forward, so the site-less nodes of its graph (an attention's mask ops) keep no site. A stale name (seen
after some test files ran in the same process) made the profiler's sensitivity read 0 at every attention site
of a BERT exported afterwards."""

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from quantlens.compiler import export
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant, self.fc = QuantStub(), DeQuantStub(), nn.Linear(4, 4)

    def forward(self, x):
        return self.dequant(self.fc(self.quant(x)))


def test_export_ignores_a_stale_annotation():
    x = torch.randn(8, 4)
    prepared = calibrate(prepare(Net(), (x,), default_calibration_qconfig_setter, check_result_dir=None), [(x,)])
    fx_traceback.current_meta.setdefault("custom", {})["op_site"] = "stale"
    try:
        ir = export(pre_export(prepared), (x,))
        assert "stale" not in {n.site for n in ir.graph.nodes}
        assert fx_traceback.current_meta["custom"].get("op_site") == "stale"  # what export found is put back
    finally:
        fx_traceback.current_meta["custom"].pop("op_site", None)


def test_export_leaves_no_annotation_behind():
    """The multitask zoo model (two input stubs) left 'quant_image' open after its export."""
    from quantlens.zoo import example_inputs, get_model

    example = example_inputs("multitask")
    prepared = calibrate(prepare(get_model("multitask"), example, default_calibration_qconfig_setter,
                                 check_result_dir=None), [example])
    export(pre_export(prepared), example)
    assert (fx_traceback.current_meta.get("custom") or {}).get("op_site") is None
