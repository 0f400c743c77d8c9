"""The IR's input contract (docs/ir.md, "Calling an IR"): every call of a qat or quantized IR checks its tensors
against the exported input types (rank, static dims, exact dtype, finite floats) and its structure; and
``export(dynamic_batch=True)`` from a batch-1 example gives a truly dynamic batch (IR and ONNX)."""

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens import zoo
from quantlens.compiler import convert, export
from quantlens.errors import QuantLensError
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


def _prepared(model, example, batches):
    prepared = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, batches)
    return pre_export(prepared, example_inputs=example)


def _zoo_prepared(name, example):
    return _prepared(zoo.get_model(name), example, zoo.sample_batches(name, 2, 4))


_CACHE: dict = {}


def _irs(name, batch_size=1, dynamic_batch=False):
    """(pre_export model, {"qat": qat IR, "quantized": quantized IR}) of a zoo model, static batch 1 by default;
    multitask is exported for the task list ['cls']."""
    key = (name, batch_size, dynamic_batch)
    if key not in _CACHE:
        example = zoo.example_inputs(name, batch_size=batch_size)
        if name == "multitask":
            example = (example[0], ["cls"])
        model = _prepared(zoo.get_model(name), example,
                          [(b[0], ["cls"]) if name == "multitask" else b for b in zoo.sample_batches(name, 2, 4)])
        qat = export(model, example, dynamic_batch=dynamic_batch)
        _CACHE[key] = model, {"qat": qat, "quantized": convert(qat)}
    return _CACHE[key]


KINDS = ["qat", "quantized"]


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_batch_on_a_static_ir_names_the_input_and_the_fix(kind):
    _, irs = _irs("tiny_resnet")
    ir = irs[kind]
    assert ir.graph.values["x"].shape == (1, 3, 16, 16)
    four = zoo.example_inputs("tiny_resnet", batch_size=4)
    # before: a flatten to [1, 48] gave one output row for four images
    with pytest.raises(QuantLensError, match=r"(?s)'x'.*batch 4.*static batch of 1.*dynamic_batch=True"):
        ir(*four)
    with pytest.raises(QuantLensError, match=r"'x'.*dynamic_batch=True"):
        ir(x=four[0])  # by input name
    with pytest.raises(QuantLensError, match=r"'x'.*dynamic_batch=True"):
        ir.run({"x": four[0]})


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_rank_is_refused(kind):
    _, irs = _irs("tiny_resnet")
    (x,) = zoo.example_inputs("tiny_resnet", batch_size=1)
    with pytest.raises(QuantLensError, match=r"(?s)'x' has 3 dims.*\[1, 3, 16, 16\].*unsqueeze\(0\)"):
        irs[kind](x[0])
    with pytest.raises(QuantLensError, match=r"'x' has 5 dims"):
        irs[kind](x[None])


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_static_dim_is_refused_also_on_a_dynamic_batch_ir(kind):
    _, irs = _irs("tiny_resnet", batch_size=2, dynamic_batch=True)
    ir = irs[kind]
    assert ir.graph.values["x"].shape == (-1, 3, 16, 16)
    ir(torch.rand(5, 3, 16, 16))  # the dynamic batch takes any size
    with pytest.raises(QuantLensError, match=r"(?s)'x' has shape \[5, 3, 16, 17\].*\[batch, 3, 16, 16\].*"
                                             r"dim 3 is 17, expected 16"):
        ir(torch.rand(5, 3, 16, 17))


_WRONG_DTYPES = [torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", _WRONG_DTYPES, ids=str)
def test_each_wrong_dtype_is_refused_by_both_ir_kinds(kind, dtype):
    _, irs = _irs("digits_cnn")
    (x,) = zoo.example_inputs("digits_cnn", batch_size=1)
    ir = irs[kind]
    assert ir.graph.values["x"].dtype == "float32"
    wrong = x.to(dtype)
    name = str(dtype).replace("torch.", "")
    with pytest.raises(QuantLensError, match=rf"(?s)'x' has dtype {name}.*exported for float32.*\.float\(\)"):
        ir(wrong)
    with pytest.raises(QuantLensError, match=rf"'x' has dtype {name}"):
        ir(x=wrong)
    ir(x)  # the exported dtype runs


def test_integer_input_dtype_is_exact_too():
    _, irs = _irs("tiny_transformer", batch_size=2)
    (ids,) = zoo.example_inputs("tiny_transformer", batch_size=2)
    for ir in irs.values():
        ir(ids)
        with pytest.raises(QuantLensError, match=r"(?s)'ids' has dtype int32.*int64.*\.long\(\)"):
            ir(ids.int())
        with pytest.raises(QuantLensError, match=r"'ids' has dtype float32"):
            ir(ids.float())


@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_inputs_are_refused(kind):
    _, irs = _irs("digits_cnn")
    ir = irs[kind]
    nan = torch.full((1, 1, 8, 8), float("nan"))
    # before: the quantized IR gave finite logits for an all-NaN image
    with pytest.raises(QuantLensError, match=r"(?s)'x' holds 64 NaN and 0 Inf.*check_finite=False"):
        ir(nan)
    (x,) = zoo.example_inputs("digits_cnn", batch_size=1)
    bad = x.clone()
    bad[0, 0, 0, :2] = torch.tensor([float("inf"), -float("inf")])
    with pytest.raises(QuantLensError, match=r"'x' holds 0 NaN and 2 Inf"):
        ir(x=bad)
    with pytest.raises(QuantLensError, match="NaN"):
        ir.run({"x": bad})
    out = ir.run({"x": bad}, check_finite=False)  # the opt-out runs it
    assert out[0].shape == (1, 10)
    # the check sums first: a finite input whose sum overflows is accepted, one Inf among huge values is not
    huge = torch.full((1, 1, 8, 8), 3e38)
    assert not torch.isfinite(huge.sum()) and torch.isfinite(huge).all()
    assert ir(huge).shape == (1, 10)
    huge[0, 0, 3, 3] = float("inf")
    with pytest.raises(QuantLensError, match=r"'x' holds 0 NaN and 1 Inf"):
        ir(huge)


def test_structure_error_describes_the_expected_call_in_words():
    _, irs = _irs("multitask")
    inputs, _ = zoo.example_inputs("multitask", batch_size=1)
    for ir in irs.values():
        for bad_call in [lambda: ir(inputs["image"], inputs["meta"]), lambda: ir(inputs, ["cls", "reg"]),
                         lambda: ir({"image": inputs["image"]}, ["cls"])]:
            with pytest.raises(QuantLensError) as info:
                bad_call()
            msg = str(info.value)
            assert "TreeSpec" not in msg and "same structure as at export" in msg
            assert "<tensor 'inputs.image' [1, 3, 16, 16] float32>" in msg
            assert "<tensor 'inputs.meta' [1, 8] float32>" in msg
            assert "['cls']" in msg and "fixed at export" in msg
            assert "inputs.image" in msg.split("by input name")[-1]  # the by-name alternative


def test_dict_keys_in_another_order_are_accepted():
    model, irs = _irs("multitask")
    inputs, _ = zoo.example_inputs("multitask", batch_size=1)
    reordered = {"meta": inputs["meta"], "image": inputs["image"]}
    assert list(reordered) != list(inputs)
    with torch.no_grad():
        ref = model(inputs, ["cls"])
    for ir in irs.values():
        want = ir(inputs, ["cls"])
        got = ir(reordered, ["cls"])
        assert set(got) == {"cls"} and torch.equal(got["cls"], want["cls"])
        assert torch.equal(ir(reordered)["cls"], want["cls"])  # the deployment format, reordered
        assert torch.equal(ir(**{"inputs.meta": inputs["meta"], "inputs.image": inputs["image"]})["cls"],
                           want["cls"])
        assert ir._feeds_from_call((reordered, ["cls"]), {}).keys() == {"inputs.image", "inputs.meta"}
    torch.testing.assert_close(irs["qat"](reordered, ["cls"])["cls"], ref["cls"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny_resnet", "multitask"])
def test_dynamic_batch_from_a_batch_one_example(name, tmp_path):
    model, irs = _irs(name, batch_size=1, dynamic_batch=True)
    for ir in irs.values():
        assert all(ir.graph.values[n].shape[0] == -1 for n in ir.graph.inputs), ir.graph.values
    batch = zoo.example_inputs(name, batch_size=4)
    if name == "multitask":
        batch = (batch[0], ["cls"])
    with torch.no_grad():
        ref = pytree.tree_leaves(model(*batch))
    got = pytree.tree_leaves(irs["qat"](*batch))
    assert [g.shape[0] for g in got] == [4] * len(got)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    for r, g in zip(ref, pytree.tree_leaves(irs["quantized"](*batch))):
        assert g.shape == r.shape
    one = zoo.example_inputs(name, batch_size=1)
    one = (one[0], ["cls"]) if name == "multitask" else one
    assert pytree.tree_leaves(irs["qat"](*one))[0].shape[0] == 1

    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from quantlens.compiler import to_onnx

    path = to_onnx(irs["qat"], tmp_path / f"{name}.onnx")
    proto = onnx.load(str(path))
    assert all(i.type.tensor_type.shape.dim[0].dim_param == "batch" for i in proto.graph.input)
    from _ort import LEVELS, saturating_kernels, session

    assert saturating_kernels(path, tmp_path) == set()
    tensors = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    for level in LEVELS:
        outs = session(path, level).run(None, {n: t.numpy() for n, t in zip(irs["qat"].graph.inputs, tensors)})
        for o, g in zip(outs, got):
            assert o.shape == tuple(g.shape)
            assert abs(torch.from_numpy(o) - g).max() <= 0.02 * g.abs().max() + 1e-6, level


class _BatchBranch(nn.Module):
    """Branches on the batch size: ``equal`` skips fc2 at batch 2 (torch.export then specialises the batch to 2),
    otherwise at every batch but 2."""

    def __init__(self, equal: bool):
        super().__init__()
        self.equal = equal
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.fc(self.q(x))
        if self.equal and x.shape[0] == 2:
            return self.dq(x)
        if not self.equal and x.shape[0] != 2:
            return self.dq(x)
        return self.dq(self.fc2(x))


@pytest.mark.parametrize("batch", [1, 2])
def test_dynamic_batch_that_torch_export_specialises_raises(batch):
    x = torch.randn(batch, 4, generator=torch.Generator().manual_seed(0))
    model = _prepared(_BatchBranch(equal=True), (x,), [(x,)])
    with pytest.raises(QuantLensError, match=r"(?s)dynamic_batch=True.*fixed the batch dim.*'x'.*"
                                             r"dynamic_batch=False"):
        export(model, (x,), dynamic_batch=True)
    export(model, (x,))  # a static IR is fine


def test_dynamic_batch_from_batch_one_whose_batch_two_trace_fails_raises():
    # at batch 1 the branch skips fc2, so prepare never saw it; the batch-2 trace runs it
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(0))
    model = _prepared(_BatchBranch(equal=False), (x,), [(x,)])
    with pytest.raises(QuantLensError, match=r"(?s)dynamic_batch=True.*batch-2 copy.*failed.*'fc2'.*"
                                             r"dynamic_batch=False"):
        export(model, (x,), dynamic_batch=True)
    ir = export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(ir(x), model(x))


def test_an_input_on_the_meta_device_is_refused_by_its_device_first():
    """The finite check ran before the device check and failed on a meta tensor with torch's own 'Tensor.item()
    cannot be called on meta tensors' (issue #43): the device is named first, with the fix."""
    torch.manual_seed(0)
    model = nn.Sequential(QuantStub(), nn.Linear(4, 4), DeQuantStub()).eval()
    x = torch.randn(2, 4)
    qat_ir = export(_prepared(model, x, [x]), x)
    for ir in (qat_ir, convert(qat_ir)):
        with pytest.raises(QuantLensError, match=r"'input' is on meta, but the IR's constants are on cpu"):
            ir(torch.randn(2, 4, device="meta"))
