"""quantlens on the model's device, checked on this CPU-only machine with a virtual CUDA device
(``tests/_virtual_cuda.py``): every torch call obeys CUDA's same-device rule (a constant made without
``device=`` and mixed with the model's tensors fails, as on a GPU), outputs stay on the device, and everything
equals the CPU run bit for bit: the IRs (``Module.to``), prepare and calibration of a model on the device, and
the profiler (run, compare_per_layer, sensitivity) on torch models and IRs there."""

import warnings

import pytest
import torch
from _virtual_cuda import DeviceMismatch, VirtualCuda, module_to_virtual
from test_deploy_ops import _DeployOps
from test_table_ops import _AllOps
from torch.utils import _pytree as pytree

from quantlens import zoo
from quantlens.compiler import convert, export
from quantlens.errors import QuantLensError
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import ConsistencyStrategy, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)

SETTERS = {"int8": default_calibration_qconfig_setter, "int16act": calibration_8bit_weight_16bit_act_qconfig_setter}


def _irs(model, example, batches, setter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, example, setter, check_result_dir=None), batches)
        qat_ir = export(pre_export(prepared, example_inputs=example), example)
    return qat_ir, convert(qat_ir)


def _on_virtual_cuda(ir, inputs):
    """``ir(*inputs)`` with the IR and the inputs on the virtual CUDA device; the outputs, back on the CPU."""
    with VirtualCuda() as vc:
        ir.to("cuda")
        try:
            assert ir.device.type == "cuda"
            out = ir(*pytree.tree_map_only(torch.Tensor, lambda t: t.to("cuda"), inputs))
            leaves = pytree.tree_leaves(out)
            assert leaves and all(vc.is_virtual(t) for t in leaves)  # the outputs stay on the device
            return pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), out)
        finally:
            ir.to("cpu")


def _same(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("setter", sorted(SETTERS))
@pytest.mark.parametrize("name", zoo.list_models())
def test_zoo_irs_run_on_the_device_bit_for_bit(name, setter):
    torch.manual_seed(0)
    model = zoo.get_model(name)
    qat_ir, quantized = _irs(model, zoo.example_inputs(name), zoo.sample_batches(name, 3, 8), SETTERS[setter])
    batch = zoo.sample_batches(name, 1, 2)[0]  # the exported (static) batch
    for ir in (qat_ir, quantized):
        assert _same(_on_virtual_cuda(ir, batch), ir(*batch))


@pytest.mark.parametrize("setter", sorted(SETTERS))
def test_deploy_and_table_ops_run_on_the_device(setter):
    """Pads, BatchNorm after an activation, prelu (per-channel negative slopes), leaky_relu, relu6, in-place ops,
    1-d convs, and
    every table op (int8 tables, int16 segmented tables) in both IRs, with both requantize profiles."""
    torch.manual_seed(0)
    cases = [(_DeployOps(), (torch.randn(2, 3, 8, 8),), [(torch.randn(2, 3, 8, 8),) for _ in range(3)]),
             (_AllOps(), (torch.randn(4, 8) * 2,), [(torch.randn(4, 8) * 2,) for _ in range(3)])]
    for model, example, batches in cases:
        for level in (None, 0):  # the default requantize, and the high-precision one (consistency level 0)
            if level is not None:
                ConsistencyStrategy.set_consistency_level(level)
            try:
                irs = _irs(model, example, batches, SETTERS[setter])
            finally:
                ConsistencyStrategy.disable()
            for ir in irs:
                assert _same(_on_virtual_cuda(ir, example), ir(*example)), (type(model).__name__, level, ir.kind)


def test_an_input_on_another_device_is_refused_with_the_fix():
    model = zoo.get_model("digits_cnn")
    _, quantized = _irs(model, zoo.example_inputs("digits_cnn"), zoo.sample_batches("digits_cnn", 2, 8),
                        default_calibration_qconfig_setter)
    (x,) = zoo.example_inputs("digits_cnn", 2)
    with VirtualCuda():
        quantized.to("cuda")
        try:
            with pytest.raises(QuantLensError, match=r"'x' is on cpu, but the IR's constants are on cuda:0.*"
                                                     r"x\.to\('cuda:0'\).*module\.to\('cpu'\)"):
                quantized(x)
        finally:
            quantized.to("cpu")
    assert quantized.device.type == "cpu"


def test_the_virtual_device_catches_a_constant_made_on_the_cpu():
    # the checker itself: what CUDA refuses, it refuses
    with VirtualCuda() as vc:
        x = torch.ones(3).to("cuda")
        assert vc.is_virtual(x) and x.device.type == "cuda"
        assert vc.is_virtual(x + torch.tensor(1.0))  # a 0-dim CPU tensor mixes, as on CUDA
        assert vc.is_virtual(torch.zeros(3, device=x.device) + x)
        with pytest.raises(DeviceMismatch, match="mul"):
            x * torch.ones(3)
        with pytest.raises(DeviceMismatch, match="numpy"):
            x.numpy()
        with pytest.raises(DeviceMismatch, match="integer"):
            torch.matmul(x.long().reshape(1, 3), x.long().reshape(3, 1))
        assert not vc.is_virtual(x.cpu()) and not vc.is_virtual(x.to("cpu"))


def _cuda(tree):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to("cuda"), tree)


@pytest.mark.parametrize("inputs_on", ["device", "cpu"])
@pytest.mark.parametrize("name", ["digits_cnn", "multitask"])
def test_prepare_and_calibrate_a_model_on_the_device(name, inputs_on):
    """The fake quants prepare adds (made on the CPU) join the model's device; calibration's scales equal the
    CPU run's. Example inputs and calibration batches held on the CPU move to the model's device."""
    move = _cuda if inputs_on == "device" else (lambda tree: tree)
    example, batches = zoo.example_inputs(name), zoo.sample_batches(name, 3, 8)
    torch.manual_seed(0)
    on_cpu = calibrate(prepare(zoo.get_model(name), example, default_calibration_qconfig_setter,
                               check_result_dir=None), batches)
    with VirtualCuda() as vc:
        torch.manual_seed(0)
        model = module_to_virtual(zoo.get_model(name))
        prepared = calibrate(prepare(model, move(example), default_calibration_qconfig_setter,
                                     check_result_dir=None), [move(b) for b in batches])
        state = prepared.state_dict()
        assert all(vc.is_virtual(t) for t in state.values())
        out = prepared(*_cuda(example))
        assert all(vc.is_virtual(t) for t in pytree.tree_leaves(out))
    reference = on_cpu.state_dict()
    assert set(state) == set(reference) and all(torch.equal(state[k].cpu(), reference[k]) for k in reference)


def _analysis(baseline, analysis, kind, example, out_dir):
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=str(out_dir), progress=False)
    qa.set_bad_case(example)  # held on the CPU: the profiler moves it to each model's device
    qa.run()
    rows = [(r.op_name, r.SQNR, r.lsb_verdict) for r in qa.compare_per_layer()]
    tables = [(t.key, [(r.op_name, r.sensitive_type, r.value) for r in t]) for t in qa.sensitivity(shard=False)]
    return rows, tables


@pytest.mark.parametrize("name", ["digits_cnn", "tiny_transformer"])
def test_the_profiler_runs_on_the_models_device(name, tmp_path):
    """fake_quant (torch models), export (torch pre_export vs qat IR) and convert (two IRs) pairs on the
    device: the same per-layer rows and sensitivity tables as on the CPU."""
    example = zoo.example_inputs(name)
    torch.manual_seed(0)
    model = zoo.get_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None),
                             zoo.sample_batches(name, 3, 8))
        table_model = pre_export(prepared)
        qat_ir = export(table_model, example)
    quantized = convert(qat_ir)
    pairs = {"fake_quant": (model, prepared), "export": (table_model, qat_ir), "convert": (qat_ir, quantized)}
    expected = {kind: _analysis(*pair, kind, example, tmp_path / f"cpu_{kind}") for kind, pair in pairs.items()}
    with VirtualCuda():
        for m in (model, prepared, table_model):
            module_to_virtual(m)
        for ir in (qat_ir, quantized):
            ir.to("cuda")
        try:
            got = {kind: _analysis(*pair, kind, example, tmp_path / f"cuda_{kind}") for kind, pair in pairs.items()}
        finally:
            for ir in (qat_ir, quantized):
                ir.to("cpu")
    for kind in pairs:
        assert got[kind] == expected[kind], kind
        assert got[kind][0] and got[kind][1]


def test_pre_export_reads_table_arguments_on_the_device():
    """pre_export(..., example_inputs=) on a model on the device (example held on the CPU): the pow exponents it
    reads at run time, and the table model's outputs, as on the CPU."""
    example, batches = (torch.randn(4, 8) * 2,), [(torch.randn(4, 8) * 2,) for _ in range(3)]
    torch.manual_seed(0)
    on_cpu = pre_export(calibrate(prepare(_AllOps(), example, default_calibration_qconfig_setter,
                                          check_result_dir=None), batches), example_inputs=example)
    expected = on_cpu(*example)
    with VirtualCuda() as vc:
        torch.manual_seed(0)
        prepared = calibrate(prepare(module_to_virtual(_AllOps()), example, default_calibration_qconfig_setter,
                                     check_result_dir=None), batches)
        table_model = pre_export(prepared, example_inputs=example)
        out = table_model(*_cuda(example))
        assert vc.is_virtual(out)
        assert torch.equal(out.cpu(), expected)
