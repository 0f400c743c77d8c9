"""Stage support that does not depend on how the process got there: saved IRs with table ops run in a new
process, a top-level nn.Sequential prepares, and user code in a package named like torch is the user's."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export, save
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.sites.tracer import is_within
from quantlens.zoo import example_inputs, get_model, sample_batches


def _prepared(model, example, batches):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(p, batches)
    return p


@pytest.mark.parametrize("kind", ["qat", "quantized"])
def test_saved_ir_with_table_ops_runs_in_a_fresh_process(tmp_path, kind):
    torch.manual_seed(0)
    name = "tiny_transformer"
    example = example_inputs(name)
    model = _prepared(get_model(name), example, sample_batches(name, 2, 4))
    ir = export(pre_export(model, example_inputs=example), example)
    ir = ir if kind == "qat" else convert(ir)
    assert any(n.op in ("int_layer_norm", "int_softmax", "lut", "segment_lut") for n in ir.graph.nodes)
    path = save(ir, tmp_path / "model.qlir")
    feeds = ir.feeds(*example)
    torch.save(feeds, tmp_path / "feeds.pt")
    expected = ir.run(feeds)
    torch.save(expected, tmp_path / "expected.pt")
    # A new interpreter that only loads: nothing has lowered a graph there.
    script = textwrap.dedent(f"""
        import sys, torch
        from quantlens.compiler import load
        from quantlens.compiler.lowering import TORCH_OPS
        from quantlens.kernels import TABLE_OP_IO
        assert not set(TORCH_OPS) & set(TABLE_OP_IO)  # no lowering has run in this process
        ir = load({str(path)!r})
        out = ir.run(torch.load({str(tmp_path / 'feeds.pt')!r}))
        exp = torch.load({str(tmp_path / 'expected.pt')!r})
        assert all(torch.equal(a, b) for a, b in zip(out, exp)), "different outputs"
        print("ok", len(out))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")


def test_top_level_sequential_prepares_exports_and_converts():
    torch.manual_seed(0)
    model = nn.Sequential(QuantStub(), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                          DeQuantStub())
    x = torch.randn(2, 3, 8, 8)
    prepared = _prepared(model, x, [torch.randn(2, 3, 8, 8) for _ in range(3)])
    assert "1" in prepared._quantlens_state.plans  # the conv's op site is its qualified name
    table_model = pre_export(prepared)
    quantized = convert(export(table_model, x))
    step = float(prepared._quantlens_state.fq[prepared._quantlens_state.plans["4"].output_fq].scale) \
        if prepared._quantlens_state.plans["4"].output_fq else 1.0
    assert torch.allclose(quantized(x), table_model(x).detach(), atol=step + 1e-6)


def test_is_within_compares_whole_path_components(tmp_path):
    torch_dir = str(tmp_path / "site-packages" / "torch")
    assert is_within(os.path.join(torch_dir, "nn", "functional.py"), torch_dir)
    assert not is_within(str(tmp_path / "site-packages" / "torchcrepe" / "core.py"), torch_dir)
    assert not is_within(str(tmp_path / "site-packages" / "torch_user.py"), torch_dir)


def test_user_code_in_a_torch_named_package_is_reported_at_its_own_line(tmp_path):
    pkg = tmp_path / "torchfake_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(1, 2, 3)

            def forward(self, x):
                y = self.conv(x)
                return torch.erf(y)  # line 13
    """))
    # The package sits beside torch's own directory name prefix: only a separator-aware check tells them apart.
    sys.path.insert(0, str(tmp_path))
    try:
        from torchfake_models.net import Net

        wrapped = nn.Sequential(QuantStub(), Net(), DeQuantStub())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare(wrapped, torch.randn(1, 1, 6, 6), default_calibration_qconfig_setter,
                               check_result_dir=None)
        site = prepared._quantlens_state.record.sites["1.erf_0"]
        assert site.source.endswith("net.py:13"), site.source
    finally:
        sys.path.remove(str(tmp_path))
