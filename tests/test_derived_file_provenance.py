"""Issue #43: a derived file records the qat IR it was made from, and every pair checks it. ``convert`` writes the
qat IR's digest into the quantized IR's meta (saved and validated on load), ``to_onnx`` into the ONNX model's
metadata; ``QuantAnalysis`` ('convert', 'onnxruntime') and ``quantlens compare`` refuse a pair recorded from another
qat IR (another version of the model: weights moved 10 %) in words, and warn for a file that records none. A
damaged ONNX file (or its external data) is refused in one line naming the file, never a raw protobuf / onnx
exception."""

import copy
import json

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export, load, save
from quantlens.compiler.serialize import CHECKSUM_KEY, METADATA_KEY, file_checksum
from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.dequant(self.fc2(torch.relu(self.fc1(self.quant(x)))))


@pytest.fixture(scope="module")
def irs():
    """The qat IR, its quantized IR, and another version of the model (every weight moved by 10 %)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    prepared = calibrate(prepare(Small().eval(), (x,), default_calibration_qconfig_setter, check_result_dir=None),
                         [(x,)])
    qat = export(pre_export(prepared), (x,))
    other = copy.deepcopy(qat)
    for name, t in other.graph.constants.items():
        if t.is_floating_point() and t.dim() == 2:  # the linear weights
            other.graph.constants[name] = t * 1.1
    return qat, convert(qat), other, x


def test_the_quantized_ir_records_its_qat_ir_and_the_record_survives_save_and_load(irs, tmp_path):
    from quantlens.compiler.provenance import SOURCE_DIGEST_KEY, ir_digest

    qat, quant, other, _ = irs
    digest = ir_digest(qat)
    assert quant.meta[SOURCE_DIGEST_KEY] == digest
    assert ir_digest(load(save(qat, tmp_path / "qat.qlir"))) == digest  # the same in memory and from a file
    assert load(save(quant, tmp_path / "q.qlir")).meta[SOURCE_DIGEST_KEY] == digest
    assert ir_digest(other) != digest


def test_load_refuses_a_source_digest_that_is_not_one(irs, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = save(irs[1], tmp_path / "q.qlir")
    with safe_open(str(path), framework="pt") as handle:
        header = json.loads(handle.metadata()[METADATA_KEY])
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    header["meta"]["source_ir_digest"] = "not a digest"
    text = json.dumps(header)
    save_file(tensors, str(path), metadata={METADATA_KEY: text, CHECKSUM_KEY: file_checksum(text, tensors)})
    with pytest.raises(QuantLensError, match="source_ir_digest.*64 lower-case hex"):
        load(path)


def test_a_convert_pair_of_another_version_is_refused_in_words(irs, tmp_path):
    qat, quant, other, _ = irs
    QuantAnalysis(qat, quant, "convert", out_dir=tmp_path / "ok", progress=False)  # its own qat IR: accepted
    with pytest.raises(QuantLensError, match=r"QuantAnalysis\('convert'\): the quantized IR.*made from the qat IR "
                       r"with digest [0-9a-f]{16}.*has digest [0-9a-f]{16}.*convert\(qat_ir\)"):
        QuantAnalysis(other, quant, "convert", out_dir=tmp_path / "bad", progress=False)


def test_a_quantized_ir_without_the_record_is_warned_not_refused(irs, tmp_path):
    qat, quant, _, _ = irs
    older = copy.copy(quant)
    older.meta = {k: v for k, v in quant.meta.items() if k != "source_ir_digest"}
    with pytest.warns(QuantLensWarning, match="records no digest of the qat IR"):
        QuantAnalysis(qat, older, "convert", out_dir=tmp_path, progress=False)


def test_quantlens_compare_refuses_a_quantized_ir_of_another_model_naming_both_files(irs, tmp_path):
    from test_cli import ql

    qat, quant, other, _ = irs
    a, b = save(other, tmp_path / "other_qat.qlir"), save(quant, tmp_path / "quant.qlir")
    result = ql("compare", a, b, "--out", tmp_path / "out")
    out, err = result.stdout, result.stderr
    assert result.returncode == 2, out + err
    text = " ".join(err.split())
    assert "B, the quantized IR" in text and "quant.qlir" in text and "other_qat.qlir" in text
    assert "accumulator" not in out + err


onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def onnx_files(irs, tmp_path_factory):
    from quantlens.compiler import to_onnx

    qat, _, other, _ = irs
    folder = tmp_path_factory.mktemp("onnx")
    return to_onnx(qat, folder / "own.onnx"), to_onnx(other, folder / "other.onnx")


def test_the_onnx_file_records_its_qat_ir(irs, onnx_files):
    from quantlens.compiler.provenance import ir_digest

    props = {p.key: p.value for p in onnx.load(str(onnx_files[0])).metadata_props}
    assert props["quantlens.source_ir_digest"] == ir_digest(irs[0])


def test_an_onnxruntime_pair_of_another_version_is_refused_in_words(irs, onnx_files, tmp_path):
    own, other = onnx_files
    QuantAnalysis(irs[0], str(own), "onnxruntime", out_dir=tmp_path / "ok", progress=False)
    with pytest.raises(QuantLensError, match=r"QuantAnalysis\('onnxruntime'\): the ONNX file '.*other\.onnx' was "
                       r"made from the qat IR with digest [0-9a-f]{16}.*to_onnx\(qat_ir, path\)"):
        QuantAnalysis(irs[0], str(other), "onnxruntime", out_dir=tmp_path / "bad", progress=False)


def test_an_onnx_file_without_the_record_is_warned_not_refused(irs, onnx_files, tmp_path):
    proto = onnx.load(str(onnx_files[0]))
    kept = [p for p in proto.metadata_props if p.key != "quantlens.source_ir_digest"]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    path = tmp_path / "foreign.onnx"
    onnx.save(proto, str(path))
    with pytest.warns(QuantLensWarning, match="the ONNX file '.*foreign.onnx' records no digest"):
        QuantAnalysis(irs[0], str(path), "onnxruntime", out_dir=tmp_path, progress=False)


def _one_line_naming(exc_info, path, *words):
    text = str(exc_info.value)
    assert "\n" not in text and str(path) in text and "to_onnx" in text, text
    for word in words:
        assert word in text, text


def test_a_damaged_onnx_file_is_refused_in_one_line(irs, onnx_files, tmp_path):
    data = onnx_files[0].read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(QuantLensError) as exc:
        QuantAnalysis(irs[0], str(truncated), "onnxruntime", out_dir=tmp_path, progress=False)
    _one_line_naming(exc, truncated, "not a valid ONNX protobuf")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(QuantLensError) as exc:
        QuantAnalysis(irs[0], str(empty), "onnxruntime", out_dir=tmp_path, progress=False)
    _one_line_naming(exc, empty, "holds no ONNX graph")


def test_damaged_external_data_is_refused_in_one_line(irs, onnx_files, tmp_path):
    proto = onnx.load(str(onnx_files[0]))
    path = tmp_path / "ext.onnx"
    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data",
              size_threshold=0)
    data = tmp_path / "ext.data"
    data.write_bytes(data.read_bytes()[:10])  # truncated
    with pytest.raises(QuantLensError) as exc:
        QuantAnalysis(irs[0], str(path), "onnxruntime", out_dir=tmp_path, progress=False)
    _one_line_naming(exc, path, "external data is missing or damaged")
    data.unlink()  # missing
    with pytest.raises(QuantLensError) as exc:
        QuantAnalysis(irs[0], str(path), "onnxruntime", out_dir=tmp_path, progress=False)
    _one_line_naming(exc, path, "external data is missing or damaged")
