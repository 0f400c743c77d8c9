"""Acceptance: the whole quantization stage on the digits CNN, every zoo model and a transformers BertModel."""

import json

import pytest
import torch
from torch.utils import _pytree as pytree

from quantlens.demo import run_demo
from quantlens.quantization import FakeQuantState, get_op_sites, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter, default_qat_qconfig_setter
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches


def _float_leaves(out):
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def test_demo_digits_accuracy_targets(tmp_path):
    result = run_demo(str(tmp_path), qat_epochs=1)
    fp = result.accuracy("float")
    assert fp > 97.0
    assert abs(result.accuracy("int8 calibration") - fp) <= 1.0
    assert abs(result.accuracy("int16-activation calibration") - fp) <= 0.3
    assert result.accuracy("int8 QAT") >= fp - 1.0
    # the integer-only simulator of the march keeps the QAT model's accuracy
    assert abs(result.accuracy("quantized IR (integer)") - result.accuracy("int8 QAT")) <= 0.5
    summary = json.loads((tmp_path / "demo_summary.json").read_text())
    assert [s["stage"] for s in summary] == [
        "float", "int8 calibration", "int16-activation calibration", "int8 QAT", "pre_export (lookup tables)",
        "qat IR", "quantized IR (integer)"]
    assert (tmp_path / "quantized_ir.qlir").is_file()
    assert "== Op sites" in (tmp_path / "model_check_result.txt").read_text()


def _full_flow(model, example, batches, tmp_path):
    """prepare -> calibration -> QAT (one optimizer step) -> validation; returns the prepared model and loss."""
    calib = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=tmp_path)
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch in batches:
            calib(*batch)
    qat = prepare(model, example, default_qat_qconfig_setter, check_result_dir=None)
    qat.load_state_dict(calib.state_dict())
    qat.train()
    set_fake_quantize(qat, FakeQuantState.QAT)
    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3)
    optimizer.zero_grad()
    loss = sum(x.float().pow(2).mean() for x in _float_leaves(qat(*example)))
    loss.backward()
    optimizer.step()
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    with torch.no_grad():
        out = qat(*example)
    return calib, qat, loss, out


@pytest.mark.parametrize("name", list_models())
def test_zoo_model_full_flow(name, tmp_path):
    model = get_model(name)
    example = example_inputs(name)
    calib, qat, loss, out = _full_flow(model, example, sample_batches(name, 3, 4), tmp_path)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(x).all() for x in _float_leaves(out))
    float_sites = get_op_sites(model, example)
    assert float_sites == get_op_sites(calib, example) == get_op_sites(qat, example)
    # every output fake quant that ran during calibration got a data-derived scale
    state = calib._quantlens_state
    seen = set(get_op_sites(calib, example))
    for plan in state.plans.values():
        if plan.output_fq and plan.name in seen:
            assert bool(state.fq[plan.output_fq].calibrated), plan.name


def test_multitask_calibrates_both_tasks(tmp_path):
    model = get_model("multitask")
    inputs, _ = example_inputs("multitask")
    calib = prepare(
        model, (inputs, ["cls"]), default_calibration_qconfig_setter,
        extra_example_inputs=[(inputs, ["reg"])], check_result_dir=None,
    )
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch, _ in sample_batches("multitask", 2, 4):
            calib(batch, ["cls"])
            calib(batch, ["reg"])
    # The heads are final linears (int32 high-precision outputs): their weight fake quants prove both ran.
    for head in ("cls_head", "reg_head"):
        assert bool(calib.get_submodule(head).weight_fake_quant.calibrated), head
    # Uncalibrated model for contrast: a head that never runs keeps its placeholder scale.
    fresh = prepare(model, (inputs, ["cls"]), default_calibration_qconfig_setter,
                    extra_example_inputs=[(inputs, ["reg"])], check_result_dir=None)
    fresh.eval()
    set_fake_quantize(fresh, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        fresh(inputs, ["cls"])
    assert bool(fresh.cls_head.weight_fake_quant.calibrated)
    assert not bool(fresh.reg_head.weight_fake_quant.calibrated)


def test_transformers_bert_full_flow(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    batches = [(torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(s)), mask) for s in range(3)]
    calib, qat, loss, out = _full_flow(model, (ids, mask), batches, tmp_path)
    assert torch.isfinite(loss)
    with torch.no_grad():
        ref = model(ids, mask).last_hidden_state
    got = out.last_hidden_state
    assert torch.isfinite(got).all()
    # int8 everywhere on a random 2-layer BERT: close to float, but not identical.
    assert 0 < (got - ref).abs().max() < 0.5 * ref.abs().max()
    assert get_op_sites(model, (ids, mask)) == get_op_sites(qat, (ids, mask))
    op_types = {s.op_type for s in calib._quantlens_state.record.sites.values()}
    assert {"scaled_dot_product_attention", "layer_norm", "gelu", "embedding", "linear"} <= op_types
