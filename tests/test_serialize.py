"""IR files: ``quantlens.compiler.save`` / ``load`` round trips, statistics, and every way a file can be wrong."""

import json
import math
import os
import struct

import pytest
import torch
from torch.utils import _pytree as pytree

from quantlens.compiler import export, load, save
from quantlens.compiler.ir import Graph, InputLeaf, Module, Node, ValueInfo
from quantlens.compiler.serialize import FORMAT_VERSION, MAGIC, METADATA_KEY
from quantlens.errors import QuantLensError
from quantlens.quantization import FakeQuantState, MinMaxObserver, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import TemplateQconfigSetter, default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches

_IRS: dict = {}


def _qat_ir(name, setter=default_calibration_qconfig_setter):
    key = (name, getattr(setter, "name", id(setter)))
    if key not in _IRS:
        example = example_inputs(name)
        model = prepare(get_model(name), example, setter, check_result_dir=None).eval()
        set_fake_quantize(model, FakeQuantState.CALIBRATION)
        with torch.no_grad():
            for batch in sample_batches(name, 3, 4):
                model(*batch)
        set_fake_quantize(model, FakeQuantState.VALIDATION)
        _IRS[key] = export(model, example, apply_pre_export=False, dynamic_batch=True)
    return _IRS[key]


def _assert_same_module(a: Module, b: Module):
    assert b.kind == a.kind
    ga, gb = a.graph, b.graph
    assert gb.inputs == ga.inputs and gb.outputs == ga.outputs
    def sig(graph):
        return [(n.op, n.inputs, n.outputs, n.site) for n in graph.nodes]

    assert sig(gb) == sig(ga)
    for na, nb in zip(ga.nodes, gb.nodes):
        assert _same_value(na.attrs, nb.attrs), (na, nb)
    assert list(gb.constants) == list(ga.constants)
    for name, tensor in ga.constants.items():
        other = gb.constants[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert torch.equal(other, tensor) or (tensor.is_floating_point() and torch.equal(other.isnan(), tensor.isnan())
                                              and torch.equal(other.nan_to_num(), tensor.nan_to_num())), name
    assert gb.values == ga.values
    assert [(leaf.kind, leaf.name) for leaf in b.input_leaves] == [(leaf.kind, leaf.name) for leaf in a.input_leaves]
    assert all(_same_value(x.value, y.value) for x, y in zip(a.input_leaves, b.input_leaves))
    assert (b.input_spec, b.output_spec) == (a.input_spec, a.output_spec)
    assert _same_value(a.meta, b.meta)
    assert b.statistics() == a.statistics()


def _same_value(a, b) -> bool:
    """Equal and of the same type, all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    return a == b


def _leaves(out):
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


# -- round trips -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list_models())
def test_zoo_round_trip_is_exact(name, tmp_path):
    ir = _qat_ir(name)
    path = save(ir, tmp_path / f"{name}.qlir")
    assert os.listdir(tmp_path) == [f"{name}.qlir"]  # one file, no temporaries left
    back = load(path)
    _assert_same_module(ir, back)
    for batch in [example_inputs(name)] + sample_batches(name, 1, 5):
        want, got = _leaves(ir(*batch)), _leaves(back(*batch))
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and torch.equal(g, w)


def test_quantized_ir_round_trip_keeps_integer_constants_and_requantize_counts(tmp_path):
    convert = pytest.importorskip("quantlens.compiler.convert").convert
    # int16 weights and activations: the march's no-int16 x int16 rule requantizes each conv input to int8
    all16 = TemplateQconfigSetter("all16_for_test", "qint16", "qint16", MinMaxObserver)
    qat = _qat_ir("digits_cnn", all16)
    quantized = convert(qat)
    stats = quantized.statistics()
    by_type = {}
    for node in quantized.graph.nodes:
        info = quantized.graph.values.get(node.outputs[0])
        if info is not None and info.qdtype:
            by_type[f"{node.op}[{info.qdtype}]"] = by_type.get(f"{node.op}[{info.qdtype}]", 0) + 1
    assert stats.get("requantize", 0) >= 1 and stats.get("requantize[qint8]", 0) == stats["requantize"]
    assert {k: v for k, v in stats.items() if "[" in k} == by_type
    dtypes = {t.dtype for t in quantized.graph.constants.values()}
    assert {torch.int16, torch.int32} <= dtypes
    back = load(save(quantized, tmp_path / "quantized.qlir"))
    _assert_same_module(quantized, back)
    batch = sample_batches("digits_cnn", 1, 5)[0]
    assert torch.equal(back(*batch), quantized(*batch))


def test_statistics_counts_ops_by_type():
    ir = _qat_ir("tiny_resnet")
    stats = ir.statistics()
    ops = [node.op for node in ir.graph.nodes]
    assert stats == {op: ops.count(op) for op in sorted(set(ops))}  # the qat IR has no integer types
    assert stats["conv2d"] == 7 and stats["linear"] == 1 and stats["add"] == 2 and stats["cat"] == 1
    assert stats["fake_quant"] == sum(1 for n in ir.graph.nodes if n.op == "fake_quant")
    assert list(stats) == sorted(stats)


def _synthetic_module() -> Module:
    """Every constant dtype, every attr value kind, every kind of non-tensor input leaf."""
    constants = {
        "f32": torch.tensor([1.5, -0.0, float("inf"), float("-inf"), float("nan")]),
        "f64": torch.tensor([1e-300, 2.0], dtype=torch.float64),
        "f16": torch.tensor([0.1, 65504.0], dtype=torch.float16),
        "bf16": torch.tensor([0.1, -3.0], dtype=torch.bfloat16),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i16": torch.tensor([[-32768, 32767]], dtype=torch.int16),
        "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "b": torch.tensor([[True, False], [False, True]]),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "odd/name|with.chars": torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),  # not contiguous
    }
    constants["view_a"] = constants["i64"][:1]  # shares storage with another constant
    attrs = {
        "ints": [1, -2, 2**40], "floats": [0.5, float("inf"), float("-inf"), float("nan"), -0.0],
        "none": None, "flag": True, "off": False, "mode": "nearest", "nested": [[1, 2], [3.5, None]],
        "tuple": (1, (2, "x")), "by_int": {1: "a", 2: [3]}, "tagged_key": {"$float": "looks like a tag"},
        "empty_list": [], "empty_dict": {},
        "multipliers": [1, 1], "shifts": [0, 0], "out_dtype": "qint8", "frac_bits": 8,  # what the integer add reads
    }
    nodes = [Node("add", ["x", "f32"], ["y"], attrs, "site.add_0"),
             Node("mul", ["y", "f32"], ["z"], {"out_dtype": "qint8"}, ""),
             Node("linear", ["z", "f32", ""], ["w"], {"out_dtype": "qint32"}, "")]  # "": an absent optional input
    values = {name: ValueInfo(tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in constants.items()}
    values["x"] = ValueInfo((-1, 5), "float32")
    values["z"] = ValueInfo((-1, 5), "int8", qdtype="qint8", scale="scalar", axis=None)
    leaves = [InputLeaf("tensor", name="x"), InputLeaf("const", value="task"), InputLeaf("const", value=3),
              InputLeaf("const", value=2.5), InputLeaf("const", value=float("nan")), InputLeaf("const", value=True),
              InputLeaf("const", value=None)]
    graph = Graph(nodes=nodes, inputs=["x"], outputs=["z", "y"], constants=constants, values=values)
    # load checks that the specs parse and have one leaf per input leaf / graph output
    in_spec = pytree.treespec_dumps(pytree.tree_flatten(((0,) * len(leaves), {}))[1])
    out_spec = pytree.treespec_dumps(pytree.tree_flatten((0, 0))[1])
    return Module("quantized", graph, leaves, in_spec, out_spec, meta={"march": "ql1", "note": [1, (2, 3)]})


def test_every_dtype_and_attr_kind_round_trips(tmp_path):
    module = _synthetic_module()
    path = save(module, tmp_path / "synthetic.qlir")
    back = load(path)
    _assert_same_module(module, back)
    assert back.graph.nodes[0].attrs["by_int"] == {1: "a", 2: [3]}
    assert math.isnan(back.graph.nodes[0].attrs["floats"][3])
    assert back.input_leaves[2].value == 3 and type(back.input_leaves[3].value) is float
    # the header is strict JSON (no NaN/Infinity literals) and self-describing
    with open(path, "rb") as handle:
        (n,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(json.loads(handle.read(n))["__metadata__"][METADATA_KEY])
    assert header["magic"] == MAGIC and header["format_version"] == FORMAT_VERSION
    assert header["kind"] == "quantized" and header["nodes"][0]["site"] == "site.add_0"
    assert header["nodes"][0]["attrs"]["floats"][1] == {"$float": "inf"}


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "model.qlir"
    save(_synthetic_module(), path)
    save(_qat_ir("multitask"), path)
    assert load(path).kind == "qat" and os.listdir(tmp_path) == ["model.qlir"]


# -- failed writes ---------------------------------------------------------------------------------------------
def test_unserialisable_const_leaf_is_refused_and_leaves_the_folder_unchanged(tmp_path):
    module = _synthetic_module()
    save(module, tmp_path / "keep.qlir")
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    module.input_leaves[1] = InputLeaf("const", value=object())
    for target in ("new.qlir", "keep.qlir"):
        with pytest.raises(QuantLensError, match="non-tensor input leaf #1.*JSON"):
            save(module, tmp_path / target)
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before


def test_unserialisable_attr_names_the_node(tmp_path):
    module = _synthetic_module()
    module.graph.nodes[1].attrs["dtype"] = torch.float32
    with pytest.raises(QuantLensError, match=r"node 'mul'.*torch\.dtype"):
        save(module, tmp_path / "m.qlir")
    assert os.listdir(tmp_path) == []


def test_interrupted_write_leaves_no_temporary_and_keeps_the_old_file(tmp_path, monkeypatch):
    from pathlib import Path

    path = tmp_path / "model.qlir"
    save(_synthetic_module(), path)
    old = path.read_bytes()
    real_write_bytes = Path.write_bytes

    def broken_write_bytes(self, data):  # the disk fills up half way through the temporary file
        real_write_bytes(self, data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", broken_write_bytes)
    with pytest.raises(OSError, match="disk full"):
        save(_synthetic_module(), path)
    assert os.listdir(tmp_path) == ["model.qlir"] and path.read_bytes() == old


# -- damaged and foreign files ------------------------------------------------------------------------------
def _load_error(path) -> str:
    with pytest.raises(QuantLensError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message
    return message


@pytest.fixture
def good_file(tmp_path):
    return save(_qat_ir("multitask"), tmp_path / "good.qlir")


@pytest.mark.parametrize("keep", [0, 5, 8, 100, 0.5, -1])
def test_truncated_file(good_file, tmp_path, keep):
    data = good_file.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    path = tmp_path / "truncated.qlir"
    path.write_bytes(data[:cut])
    message = _load_error(path)
    assert "Expected" in message or "expected" in message


def test_random_bytes(tmp_path):
    path = tmp_path / "random.qlir"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    assert "not a safetensors file" in _load_error(path)


def test_flipped_tensor_byte_fails_the_checksum(good_file, tmp_path):
    data = bytearray(good_file.read_bytes())
    data[-3] ^= 0xFF
    path = tmp_path / "flipped.qlir"
    path.write_bytes(bytes(data))
    assert "checksum" in _load_error(path)


def test_plain_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(3)}, str(path), metadata={"format": "pt"})
    assert "without a quantlens IR header" in _load_error(path)


def test_text_and_json_files(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a model\n" * 10)
    assert "text file" in _load_error(text)
    js = tmp_path / "model.json"
    js.write_text(json.dumps({"magic": MAGIC, "format_version": 1}))
    assert "JSON" in _load_error(js)


def _rewrite_header(src, dst, **changes):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as handle:
        header = json.loads(handle.metadata()[METADATA_KEY])
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    header.update(changes)
    text = json.dumps(header)
    from quantlens.compiler.serialize import CHECKSUM_KEY, file_checksum

    # resealed: the checksum matches, so load's header validation (not the checksum) must refuse the change
    save_file(tensors, str(dst), metadata={METADATA_KEY: text, CHECKSUM_KEY: file_checksum(text, tensors)})
    return dst


def test_foreign_magic(good_file, tmp_path):
    path = _rewrite_header(good_file, tmp_path / "other.qlir", magic="someone-else")
    message = _load_error(path)
    assert "'someone-else'" in message and MAGIC in message


def test_newer_format_and_ir_versions(good_file, tmp_path):
    newer = _rewrite_header(good_file, tmp_path / "newer.qlir", format_version=FORMAT_VERSION + 1)
    message = _load_error(newer)
    assert f"version {FORMAT_VERSION + 1}" in message and "Upgrade quantlens" in message
    from quantlens.compiler.ir import IR_VERSION

    newer_ir = _rewrite_header(good_file, tmp_path / "newer_ir.qlir", ir_version=IR_VERSION + 1)
    assert f"IR version {IR_VERSION + 1}" in _load_error(newer_ir)


def test_inconsistent_header(good_file, tmp_path):
    path = _rewrite_header(good_file, tmp_path / "bad_nodes.qlir",
                           nodes=[{"op": "add", "inputs": ["nowhere"], "outputs": ["y"], "attrs": {}, "site": ""}])
    assert "undefined value 'nowhere'" in _load_error(path)
    path = _rewrite_header(good_file, tmp_path / "bad_consts.qlir", constants=["not_there"])
    assert "do not match" in _load_error(path)
    path = _rewrite_header(good_file, tmp_path / "bad_version.qlir", format_version="1")
    assert "format_version" in _load_error(path)


def test_missing_file_and_folder(tmp_path):
    assert "no such file" in _load_error(tmp_path / "absent.qlir")
    assert "folder" in _load_error(tmp_path)
    with pytest.raises(QuantLensError, match="folder"):
        save(_synthetic_module(), tmp_path)


class _DeadOutputs(torch.nn.Module):
    """``.values`` of max(dim) / topk / sort: their indices outputs are computed and never read."""

    def __init__(self):
        super().__init__()
        from quantlens.quantization import DeQuantStub, QuantStub

        self.quant, self.dequant, self.fc = QuantStub(), DeQuantStub(), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(self.quant(x))
        top = torch.topk(h, 3, dim=1).values
        return self.dequant(torch.max(h, dim=1).values.unsqueeze(1) + top[:, :1] + torch.sort(h, dim=1)[0][:, :1])


def test_unread_outputs_of_multi_output_ops_save_and_load(tmp_path):
    """Both IRs keep a type for every output of a kept node (read or not), so the files save writes load and run
    the same (the quantized IR's unread indices used to be of unknown type, refused only at load)."""
    from quantlens.compiler import convert, export
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    model = calibrate(prepare(_DeadOutputs(), (x,), default_calibration_qconfig_setter, check_result_dir=None),
                      [(torch.randn(4, 8),) for _ in range(2)])
    qat_ir = export(model, (x,))
    for ir in (qat_ir, convert(qat_ir)):
        assert all(v.dtype != "unknown" for v in ir.graph.values.values())
        indices = [n.outputs[1] for n in ir.graph.nodes if n.op in ("topk", "sort", "max_dim")]
        assert len(indices) == 3 and all(ir.graph.values[i].dtype == "int64" for i in indices)
        back = load(save(ir, tmp_path / f"{ir.kind}.qlir"))
        assert torch.equal(back(x), ir(x))


def test_save_refuses_what_load_would_refuse_and_writes_nothing(tmp_path):
    """A module changed after export into something the IR does not allow (here a value of unknown type) is
    refused by save itself, naming the value, and no file (nor temporary file) is left."""
    from quantlens.compiler import export
    from quantlens.compiler.ir import ValueInfo
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    x = torch.randn(4, 8)
    model = calibrate(prepare(_DeadOutputs(), (x,), default_calibration_qconfig_setter, check_result_dir=None),
                      [(torch.randn(4, 8),)])
    ir = export(model, (x,))
    name = next(n.outputs[1] for n in ir.graph.nodes if n.op in ("topk", "sort"))  # (the march's topk: a stable sort)
    ir.graph.values[name] = ValueInfo((), "unknown")
    with pytest.raises(QuantLensError, match=rf"was not written: load would refuse.*{name}.*dtype 'unknown'"):
        save(ir, tmp_path / "m.qlir")
    assert list(tmp_path.iterdir()) == []


def test_saving_the_same_module_twice_gives_the_same_bytes(tmp_path):
    """Issue #26: safetensors writes its header from a hash map, so two saves of one module differed in the
    order of the metadata entries; the header is now written with sorted keys (and still loads)."""
    import hashlib
    import warnings

    from quantlens.compiler import convert, export, load, save
    from quantlens.quantization import calibrate, prepare
    from quantlens.zoo import get_model, sample_batches

    model = get_model("tiny_resnet").eval()
    batches = sample_batches("tiny_resnet", 2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ir = convert(export(calibrate(prepare(model, batches[0], check_result_dir=None), batches), batches[0]))
    digests = {hashlib.sha256(save(ir, tmp_path / f"m{i}.qlir").read_bytes()).hexdigest() for i in range(6)}
    assert len(digests) == 1
    again = load(tmp_path / "m0.qlir")
    assert torch.equal(again(*batches[1]), ir(*batches[1]))
