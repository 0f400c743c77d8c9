"""``load`` checks every node's shapes against its op (issue #26 point 3), so a file that loads also runs: a crafted
header (checksum resealed) whose value infos or attrs make an op's shapes inconsistent is refused naming the node,
its op site and the shapes, instead of failing at run time with a raw torch error. The shapes come from the op
itself, run on meta tensors (``quantlens.compiler.serialize.shapes``); every zoo IR, static or with a dynamic
batch, still saves, loads and runs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

from quantlens.compiler import convert, export, load, save
from quantlens.compiler.ir import Node, ValueInfo
from quantlens.compiler.serialize.shapes import _semantics
from quantlens.errors import QuantLensError
from quantlens.march.opset import IR_OPS
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches
from tests._ir_headers import craft, save_base

_M = {"multiplier": [1 << 30], "shift": [30]}  # a requantize by 1
_CONV = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
_INT_CONV = {**_CONV, **_M, "out_dtype": "qint8"}


def _constants() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 4, 3, 3, generator=g), "w5": torch.randn(4, 5, 3, 3, generator=g),
        "b": torch.randn(4, generator=g), "b3": torch.randn(3, generator=g),
        "lw": torch.randn(8, 4, generator=g), "lw3": torch.randn(8, 3, generator=g), "lb": torch.randn(8, generator=g),
        "s": torch.tensor(0.05), "mask": torch.rand(1, 4, 4, 4, generator=g) > 0.5,
        "wq": torch.randint(-8, 8, (4, 4, 3, 3), generator=g, dtype=torch.int8),
        "wq5": torch.randint(-8, 8, (4, 5, 3, 3), generator=g, dtype=torch.int8),
        "bq": torch.randint(-100, 100, (4,), generator=g, dtype=torch.int32),
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_base(_constants(), tmp_path_factory.mktemp("shapes") / "base.qlir")


def _craft(base, path, kind: str, nodes: list[tuple], values: dict, batch: int | None = 1) -> object:
    """``base`` with ``nodes``, the value infos ``values`` (name -> shape, or (shape, dtype); other node outputs get
    none) and ``x`` of batch ``batch`` (``None``: the dynamic batch -1), resealed (``tests._ir_headers.craft``)."""

    def infos(kept: list[dict]) -> list[dict]:
        for v in kept:
            if v["name"] == "x":
                v["shape"] = [-1 if batch is None else batch, 4, 4, 4]
        for name, info in values.items():
            shape, dtype = info if isinstance(info, tuple) else (info, "float32")
            kept.append({"name": name, "shape": shape, "dtype": dtype, "qdtype": None, "scale": None, "axis": None})
        return kept

    return craft(base, path, kind, nodes, infos)


_Q = ("quantize", ["x", "s"], ["q"], {"out_dtype": "qint8", "axis": None})
_DQ = ("dequantize", ["r", "s"], ["y"], {"axis": None})
_X = "x [1, 4, 4, 4] float32"

#: name -> (kind, the good nodes and value infos, the node index to break, its broken form and value infos, the
#: refused node (index, op), what the error must say)
CASES = {
    "reshape_element_count": (
        "qat", [("reshape", ["x"], ["y"], {"shape": [1, 64]})], {"y": [1, 64]},
        0, ("reshape", ["x"], ["y"], {"shape": [1, 65]}), {"y": [1, 65]}, (0, "reshape"),
        [_X, "shape '[1, 65]' is invalid for input of size 64", "y [1, 65] float32"]),
    "conv_weight_in_channels": (
        "qat", [("conv2d", ["x", "w", "b"], ["y"], _CONV)], {"y": [1, 4, 4, 4]},
        0, ("conv2d", ["x", "w5", "b"], ["y"], _CONV), {"y": [1, 4, 4, 4]}, (0, "conv2d"),
        [_X, "w5 [4, 5, 3, 3] float32", "b [4] float32"]),
    "linear_weight": (
        "qat", [("linear", ["x", "lw", "lb"], ["y"], {})], {"y": [1, 4, 4, 8]},
        0, ("linear", ["x", "lw3", "lb"], ["y"], {}), {"y": [1, 4, 4, 8]}, (0, "linear"),
        [_X, "lw3 [8, 3] float32", "reduction dim"]),
    "add_not_broadcastable": (
        "qat", [("add", ["x", "b"], ["y"], {})], {"y": [1, 4, 4, 4]},
        0, ("add", ["x", "b3"], ["y"], {}), {"y": [1, 4, 4, 4]}, (0, "add"),
        [_X, "b3 [3] float32", "broadcast"]),
    "cat_inputs_differ_off_its_dim": (
        "qat", [("reshape", ["x"], ["r"], {"shape": [1, 4, 4, 4]}), ("cat", ["x", "r"], ["y"], {"dim": 1})],
        {"r": [1, 4, 4, 4], "y": [1, 8, 4, 4]},
        0, ("reshape", ["x"], ["r"], {"shape": [1, 4, 2, 8]}), {"r": [1, 4, 2, 8], "y": [1, 8, 4, 4]}, (1, "cat"),
        [_X, "r [1, 4, 2, 8] float32", "Sizes of tensors must match except in dimension 1"]),
    "value_info_shape_differs": (
        "qat", [("relu", ["x"], ["y"], {})], {"y": [1, 4, 4, 4]},
        0, ("relu", ["x"], ["y"], {}), {"y": [1, 4, 4, 5]}, (0, "relu"),
        ["computes its output 'y' as [1, 4, 4, 4] float32", _X, "records [1, 4, 4, 5] float32"]),
    "value_info_dtype_differs": (
        "qat", [("relu", ["x"], ["y"], {})], {"y": [1, 4, 4, 4]},
        0, ("relu", ["x"], ["y"], {}), {"y": ([1, 4, 4, 4], "int8")}, (0, "relu"),
        ["computes its output 'y' as [1, 4, 4, 4] float32", "records [1, 4, 4, 4] int8"]),
    "value_info_of_a_later_value_differs": (
        "qat", [("conv2d", ["x", "w", "b"], ["c"], _CONV), ("reshape", ["c"], ["y"], {"shape": [1, 64]})],
        {"c": [1, 4, 4, 4], "y": [1, 64]},
        0, ("conv2d", ["x", "w", "b"], ["c"], {**_CONV, "padding": [0, 0]}), {"c": [1, 4, 4, 4], "y": [1, 64]},
        (0, "conv2d"), ["computes its output 'c' as [1, 4, 2, 2] float32", "records [1, 4, 4, 4] float32"]),
    "dynamic_batch_reshape": (
        "qat", [("reshape", ["x"], ["y"], {"shape": [-1, 64]})], {"y": [-1, 64]},
        0, ("reshape", ["x"], ["y"], {"shape": [-1, 60]}), {"y": [-1, 60]}, (0, "reshape"),
        ["x [2, 4, 4, 4] float32", "the dynamic batch -1 taken as 2", "shape '[-1, 60]' is invalid"]),
    "quantized_conv_weight_in_channels": (
        "quantized", [_Q, ("conv2d", ["q", "wq", "bq"], ["r"], _INT_CONV), _DQ], {"r": ([1, 4, 4, 4], "int8")},
        1, ("conv2d", ["q", "wq5", "bq"], ["r"], _INT_CONV), {"r": ([1, 4, 4, 4], "int8")}, (1, "conv2d"),
        ["q [1, 4, 4, 4] int8", "wq5 [4, 5, 3, 3] int8"]),
    "quantized_sum_int_dim": (
        "quantized", [_Q, ("sum_int", ["q"], ["r"], {"dim": [1], "keepdim": True, **_M, "out_dtype": "qint8"}), _DQ],
        {"r": ([1, 1, 4, 4], "int8")},
        1, ("sum_int", ["q"], ["r"], {"dim": [4], "keepdim": True, **_M, "out_dtype": "qint8"}),
        {"r": ([1, 1, 4, 4], "int8")}, (1, "sum_int"), ["q [1, 4, 4, 4] int8", "Dimension out of range"]),
    "quantized_value_info_shape_differs": (
        "quantized", [_Q, ("requantize", ["q"], ["r"], {**_M, "out_dtype": "qint8"}), _DQ],
        {"r": ([1, 4, 4, 4], "int8")},
        1, ("requantize", ["q"], ["r"], {**_M, "out_dtype": "qint8"}), {"r": ([4, 4, 4], "int8")}, (1, "requantize"),
        ["computes its output 'r' as [1, 4, 4, 4]", "records [4, 4, 4]"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_header_with_inconsistent_shapes_is_refused_by_name(base, tmp_path, case):
    kind, nodes, values, index, broken, broken_values, (at, op), expected = CASES[case]
    batch = None if "dynamic" in case else 1
    good = load(_craft(base, tmp_path / "good.qlir", kind, nodes, values, batch))  # the unbroken file loads, runs
    assert good.kind == kind
    out = good(torch.randn(3 if batch is None else 1, 4, 4, 4, generator=torch.Generator().manual_seed(1)))
    assert isinstance(out, torch.Tensor) and out.shape[0] == (3 if batch is None else 1)
    bad = _craft(base, tmp_path / "bad.qlir", kind, [*nodes[:index], broken, *nodes[index + 1:]],
                 {**values, **broken_values}, batch)
    with pytest.raises(QuantLensError) as info:
        load(bad)
    message = str(info.value)
    assert str(bad) in message and f"node #{at} '{op}' (op site 'crafted.{op}')" in message, message
    for text in expected:
        assert text in message, (text, message)


def test_save_refuses_a_module_whose_value_infos_disagree_with_its_ops(base, tmp_path):
    """``save`` holds a module to load's rules: an edited value info is refused before anything is written."""
    module = load(_craft(base, tmp_path / "good.qlir", "qat", [("relu", ["x"], ["y"], {})], {"y": [1, 4, 4, 4]}))
    module.graph.values["y"] = ValueInfo((1, 4, 4, 3), "float32")
    with pytest.raises(QuantLensError, match=r"load would refuse.*'relu' \(op site 'crafted.relu'\).*\[1, 4, 4, 3\]"):
        save(module, tmp_path / "edited.qlir")
    assert not (tmp_path / "edited.qlir").exists()


@pytest.mark.parametrize("case", ["index_by_mask", "host_nonzero"])
def test_shapes_that_depend_on_the_data_are_skipped_not_guessed(base, tmp_path, case):
    """An op whose output size depends on the values (an index by a mask, ``nonzero`` on the host) has no shape
    on meta tensors: its node is not checked (nor refused), whatever size its value info records, and the nodes
    that read it are checked only from a value info without a -1."""
    host_nonzero = {"target": "aten::nonzero.default", "args": [{"input": 0}], "kwargs": {}}
    first = (("index", ["x", "mask"], ["i"], {}) if case == "index_by_mask" else
             ("host_aten", ["mask"], ["i"], host_nonzero))
    nodes = [first, ("neg", ["i"], ["y"], {})]
    module = load(_craft(base, tmp_path / "m.qlir", "qat", nodes, {"i": [7] if case == "index_by_mask" else [7, 4]}))
    x = torch.randn(1, 4, 4, 4)
    expected = -x[_constants()["mask"]] if case == "index_by_mask" else -torch.nonzero(_constants()["mask"])
    assert torch.equal(module(x), expected)


def test_every_ir_op_has_shape_semantics():
    """Every IR op, in each IR kind that holds it, has a computation on meta tensors (its torch op, its qat
    kernel, or the shape rule of its integer kernel): none is left unchecked by omission."""
    for name, op in IR_OPS.items():
        kinds = {"qat": ("qat",), "quantized": ("quantized",), "both": ("qat", "quantized")}[op.level]
        for kind in kinds:
            call, _ = _semantics(kind, Node(name, [], ["out"], {}, "s"))
            assert call is not None, (name, kind)


class _AddAlpha(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.add(self.fc(x), self.fc2(x)[:1], alpha=2)


def test_an_add_with_alpha_records_the_shape_of_its_scaled_operand(tmp_path):
    """``add(a, b, alpha=2)`` lowers to ``mul(b, 2)`` then ``add``: the mul's value info is ``b``'s shape, not the
    add's broadcast one, so the qat IR saves, loads and runs (convert refuses the mul: it has no output fake
    quant)."""
    model, example = _AddAlpha().eval(), (torch.randn(3, 8),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None,
                           allow_no_stubs=True)
        calibrate(prepared, [example])
        qat = export(prepared, example)
    (mul,) = [n for n in qat.graph.nodes if n.op == "mul"]
    assert qat.graph.values[mul.outputs[0]].shape == (1, 8)
    back = load(save(qat, tmp_path / "qat.qlir"))
    assert torch.equal(back(*example), qat(*example))


@pytest.fixture(scope="module")
def zoo_irs():
    irs = {}
    for name in list_models():
        torch.manual_seed(0)
        example = example_inputs(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare(get_model(name), example, default_calibration_qconfig_setter, check_result_dir=None)
            calibrate(prepared, sample_batches(name, 2, 4))
            qat = export(prepared, example, dynamic_batch=True)
        irs[name] = (example, qat, convert(qat))
    return irs


@pytest.mark.parametrize("name", list_models())
def test_every_zoo_ir_with_a_dynamic_batch_saves_loads_and_runs(zoo_irs, name, tmp_path):
    """A dynamic batch (-1 in value infos and reshape / expand attrs) passes the shape checks, and the loaded IR
    computes the same outputs (the static IRs: ``test_ir_load_arity``)."""
    example, qat, quantized = zoo_irs[name]
    for ir in (qat, quantized):
        back = load(save(ir, tmp_path / f"{ir.kind}.qlir"))
        expected = [t for t in pytree.tree_leaves(ir(*example)) if isinstance(t, torch.Tensor)]
        got = [t for t in pytree.tree_leaves(back(*example)) if isinstance(t, torch.Tensor)]
        assert len(got) == len(expected) and all(torch.equal(a.nan_to_num(), b.nan_to_num())
                                                 for a, b in zip(expected, got)), (name, ir.kind)
