"""``load`` checks every node's inputs, outputs and required attrs against the op set (issue #26 point 3), so a
file that loads also runs: a crafted header (checksum resealed) with the wrong arity is refused by name instead
of failing at run time with a raw torch error. The arity comes from the torch op's schema or the op set's
declaration (``quantlens.compiler.serialize.arity``); every IR the zoo gives still saves, loads and runs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

from quantlens.compiler import convert, export, load, save
from quantlens.compiler.op_meanings import torch_op_of
from quantlens.compiler.serialize.arity import _schema_shape, signature
from quantlens.errors import QuantLensError
from quantlens.kernels.integer import MOVEMENT_OPS
from quantlens.march.opset import IR_OPS
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches
from tests._ir_headers import craft, save_base

_M = {"multiplier": [1 << 30], "shift": [30]}  # a requantize by 1


def _constants() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 4, 3, 3, generator=g), "b": torch.randn(4, generator=g), "s": torch.tensor(0.05),
            "table": torch.arange(-128, 128, dtype=torch.int16)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_base(_constants(), tmp_path_factory.mktemp("arity") / "base.qlir")


_craft = craft  # (base, path, kind, nodes): the base with those nodes, resealed


_Q = ("quantize", ["x", "s"], ["q"], {"out_dtype": "qint8", "axis": None})
_DQ = ("dequantize", ["r", "s"], ["y"], {"axis": None})
_CONV = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}

#: name -> (kind, the good nodes, the node index to break, its broken form, what the error must say)
CASES = {
    "relu_three_inputs": ("qat", [("relu", ["x"], ["y"], {})], 0, ("relu", ["x", "x", "x"], ["y"], {}),
                          "has 3 inputs, expected 1 input (self)"),
    "relu_no_input": ("qat", [("relu", ["x"], ["y"], {})], 0, ("relu", [], ["y"], {}),
                      "has 0 inputs, expected 1 input (self)"),
    "relu_two_outputs": ("qat", [("relu", ["x"], ["y"], {})], 0, ("relu", ["x"], ["y", "y2"], {}),
                         "has 2 outputs, expected 1"),
    "conv2d_no_weight": ("qat", [("conv2d", ["x", "w", "b"], ["y"], _CONV)], 0, ("conv2d", ["x"], ["y"], _CONV),
                         "has 1 input, expected 3 inputs (input, weight, bias?)"),
    "conv2d_absent_weight": ("qat", [("conv2d", ["x", "w", ""], ["y"], _CONV)], 0,
                             ("conv2d", ["x", "", "b"], ["y"], _CONV), "input 1 (weight) is absent"),
    "conv2d_four_inputs": ("qat", [("conv2d", ["x", "w", "b"], ["y"], _CONV)], 0,
                           ("conv2d", ["x", "w", "b", "b"], ["y"], _CONV), "has 4 inputs, expected 3 inputs"),
    "split_outputs_differ_from_sizes": (
        "qat", [("split", ["x"], ["y", "y1"], {"sizes": [2, 2], "dim": 1})], 0,
        ("split", ["x"], ["y", "y1", "y2"], {"sizes": [2, 2], "dim": 1}),
        "has 3 outputs, expected 2 (one per entry of its attr 'sizes')"),
    "cat_no_input": ("qat", [("cat", ["x", "x"], ["y"], {"dim": 1})], 0, ("cat", [], ["y"], {"dim": 1}),
                     "has 0 inputs, expected 1 or more inputs (tensors+)"),
    "lut_three_inputs": (
        "qat", [("lut", ["x", "s", "s", "table"], ["y"], {"out_qmin": -128, "out_qmax": 127})], 0,
        ("lut", ["x", "s", "table"], ["y"], {"out_qmin": -128, "out_qmax": 127}),
        "has 3 inputs, expected 4 inputs (x, scale_in, scale_out, table)"),
    "topk_one_output": ("qat", [("topk", ["x"], ["y", "i"], {"k": 2, "dim": 1})], 0,
                        ("topk", ["x"], ["y"], {"k": 2, "dim": 1}), "has 1 output, expected 2"),
    "requantize_two_outputs": (
        "quantized", [_Q, ("requantize", ["q"], ["r"], {**_M, "out_dtype": "qint8"}), _DQ], 1,
        ("requantize", ["q"], ["r", "r2"], {**_M, "out_dtype": "qint8"}), "has 2 outputs, expected 1"),
    "requantize_two_inputs": (
        "quantized", [_Q, ("requantize", ["q"], ["r"], {**_M, "out_dtype": "qint8"}), _DQ], 1,
        ("requantize", ["q", "q"], ["r"], {**_M, "out_dtype": "qint8"}), "has 2 inputs, expected 1 input (q)"),
    "requantize_no_out_dtype": (
        "quantized", [_Q, ("requantize", ["q"], ["r"], {**_M, "out_dtype": "qint8"}), _DQ], 1,
        ("requantize", ["q"], ["r"], _M), "lacks the attrs ['out_dtype']"),
    "quantized_cat_multipliers_per_input": (
        "quantized", [_Q, ("cat", ["q", "q"], ["r"], {"multipliers": [1 << 30] * 2, "shifts": [30, 30],
                                                      "out_dtype": "qint8", "dim": 1}), _DQ], 1,
        ("cat", ["q", "q", "q"], ["r"], {"multipliers": [1 << 30] * 2, "shifts": [30, 30], "out_dtype": "qint8",
                                         "dim": 1}), "expected one entry per input"),
    "quantized_lut_no_table_inputs": (
        "quantized", [_Q, ("lut", ["q", "s", "s", "table"], ["r"], {"out_qmin": -128, "out_qmax": 127,
                                                                     "table_inputs": ["x"]}), _DQ], 1,
        ("lut", ["q", "s", "s", "table"], ["r"], {"out_qmin": -128, "out_qmax": 127}),
        "lacks the attrs ['table_inputs']"),
    "host_aten_unread_input": (
        "qat", [("host_aten", ["x"], ["y"], {"target": "aten::neg.default", "args": [{"input": 0}], "kwargs": {}})],
        0, ("host_aten", ["x", "w"], ["y"], {"target": "aten::neg.default", "args": [{"input": 0}], "kwargs": {}}),
        "has 2 inputs and its arguments read the inputs [0]"),
    "host_aten_unknown_op": (
        "qat", [("host_aten", ["x"], ["y"], {"target": "aten::neg.default", "args": [{"input": 0}], "kwargs": {}})],
        0, ("host_aten", ["x"], ["y"], {"target": "aten::no_such_op.default", "args": [{"input": 0}], "kwargs": {}}),
        "expected an aten or prims operator"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_header_with_the_wrong_arity_is_refused_by_name(base, tmp_path, case):
    kind, nodes, index, broken, expected = CASES[case]
    good = load(_craft(base, tmp_path / "good.qlir", kind, nodes))  # the unbroken file loads and runs
    assert good.kind == kind
    out = good(torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1)))
    assert isinstance(out, torch.Tensor) and out.shape[0] == 1
    bad = _craft(base, tmp_path / "bad.qlir", kind, [*nodes[:index], broken, *nodes[index + 1:]])
    with pytest.raises(QuantLensError) as info:
        load(bad)
    message = str(info.value)
    assert str(bad) in message and f"node #{index} '{broken[0]}' (op site 'crafted.{broken[0]}')" in message
    assert expected in message, message


def test_every_ir_op_has_one_source_for_its_arity():
    """An op's node shape comes from its torch op's schema or from the op set, never both: ops with a kernel of
    their own (no torch op) declare ``inputs``; ``outputs`` is declared only with them. An integer kernel that
    calls a torch op of its own (``MOVEMENT_OPS``) takes the inputs the qat op's schema gives."""
    for name, op in IR_OPS.items():
        assert (op.inputs is not None) != (torch_op_of(name) is not None), name
        assert op.outputs is None or op.inputs is not None, name
        signature(name)  # every op has one (a LookupError otherwise)
    for name, torch_op in MOVEMENT_OPS.items():
        inputs, outputs, _ = _schema_shape(torch_op)
        assert (inputs, outputs) == (signature(name).inputs, signature(name).outputs), name


def _leaves(out) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("tables", [False, True], ids=["float_nonlinear", "pre_export"])
@pytest.mark.parametrize("name", list_models())
def test_every_zoo_ir_saves_loads_and_runs(name, tables, tmp_path):
    """What export and convert give (with pre_export's table ops, or without) passes load's arity checks (save
    holds a module to them too), and the loaded IR computes the same outputs."""
    torch.manual_seed(0)
    example = example_inputs(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(get_model(name), example, default_calibration_qconfig_setter, check_result_dir=None)
        calibrate(prepared, sample_batches(name, 2, 4))
        qat = export(pre_export(prepared) if tables else prepared, example)
        quantized = convert(qat)
    for ir in (qat, quantized):
        back = load(save(ir, tmp_path / f"{ir.kind}.qlir"))
        expected, got = _leaves(ir(*example)), _leaves(back(*example))
        assert len(got) == len(expected)
        for a, b in zip(expected, got):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (name, ir.kind)


@pytest.mark.parametrize("kind", ["qat", "quantized"])
def test_an_ir_missing_any_attr_is_refused_at_load_or_computes_the_same(kind, tmp_path):
    """Each attr of each node of a real IR deleted in turn (issue #43: a dequantize without its per-channel 'axis'
    loaded, then failed at the call with torch's "shape '[]' is invalid"; a pool's deleted stride took torch's
    default): the file is refused at load, naming the node, or the attr was informational and the module
    computes exactly what the original does."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from quantlens import zoo
    from quantlens.compiler import convert, export, save
    from quantlens.compiler.serialize import CHECKSUM_KEY, METADATA_KEY, file_checksum
    from quantlens.quantization import calibrate, pre_export, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    example = zoo.example_inputs("tiny_resnet", 2)
    prepared = calibrate(prepare(zoo.get_model("tiny_resnet"), example, default_calibration_qconfig_setter,
                                 check_result_dir=None), zoo.sample_batches("tiny_resnet", 2, 2))
    module = export(pre_export(prepared, example_inputs=example), example)
    module = convert(module) if kind == "quantized" else module
    want = module(*example)
    path = save(module, tmp_path / "ir.qlir")
    with safe_open(str(path), framework="pt") as handle:
        header = json.loads(handle.metadata()[METADATA_KEY])
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    informational, tried = set(), set()
    for i, node in enumerate(header["nodes"]):
        for key in list(node["attrs"]):
            if (node["op"], key) in tried:
                continue  # (one node per op and attr: the checks are per op)
            tried.add((node["op"], key))
            broken = json.loads(json.dumps(header))
            del broken["nodes"][i]["attrs"][key]
            text = json.dumps(broken)
            case = tmp_path / "case.qlir"
            save_file(tensors, str(case), metadata={METADATA_KEY: text, CHECKSUM_KEY: file_checksum(text, tensors)})
            try:
                loaded = load(case)
            except QuantLensError as exc:
                assert f"node #{i} '{node['op']}'" in str(exc), str(exc)
                continue
            assert torch.equal(loaded(*example), want), (node["op"], key)
            informational.add((node["op"], key))
    assert informational <= {("add", "output_site"), ("conv2d", "output_site"), ("lut", "reference"),
                             ("int_layer_norm", "reference"), ("quantize", "axis"), ("linear", "output_site"),
                             ("relu", "output_site"), ("requantize", "output_site")}, informational
