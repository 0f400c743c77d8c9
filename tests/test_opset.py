"""The op set (``quantlens.march.opset``) is the one declaration of every op: each stage's registry agrees with it, and
``docs/ops.md`` is generated from it."""

import sys
from pathlib import Path

import pytest

import quantlens.compiler  # noqa: F401  (registers every stage)
from quantlens.compiler import interpreter, kernels_int, lowering
from quantlens.compiler.onnx import ONNX_CONVERTERS
from quantlens.kernels import TABLE_OP_IO
from quantlens.march.opset import IR_OPS, OPS, Category, OpDef, render_markdown
from quantlens.sites import op_rules

convert_mod = sys.modules["quantlens.compiler.convert"]
QAT_LEVEL = {n for n, op in IR_OPS.items() if op.level in ("qat", "both")}
INT_LEVEL = {n for n, op in IR_OPS.items() if op.level in ("quantized", "both")}


def test_convert_registry_is_the_declared_convert_support():
    declared = {n for n in QAT_LEVEL if IR_OPS[n].convert}
    assert set(convert_mod.CONVERTERS) == declared


def test_onnx_registry_is_the_declared_onnx_support():
    declared = {n for n in QAT_LEVEL if IR_OPS[n].onnx}
    assert set(ONNX_CONVERTERS) == declared


def test_every_quantized_ir_op_has_an_integer_kernel():
    integer = set(kernels_int.INT_KERNELS)
    shared = {n for n, op in IR_OPS.items() if op.shared_kernel}
    assert integer | shared >= INT_LEVEL
    assert integer <= INT_LEVEL, f"integer kernels for undeclared ops: {integer - INT_LEVEL}"


def test_every_qat_ir_op_has_a_qat_kernel():
    have = set(lowering.TORCH_OPS) | set(interpreter.QAT_KERNELS) | set(TABLE_OP_IO)
    assert have >= QAT_LEVEL, f"qat IR ops without a kernel: {QAT_LEVEL - have}"
    assert set(lowering.TORCH_OPS) <= set(IR_OPS), set(lowering.TORCH_OPS) - set(IR_OPS)


def test_op_types_lower_to_declared_ir_ops_and_op_rules_read_them():
    for op in OPS.values():
        assert all(name in IR_OPS for name in op.ir), op
    rules = op_rules._FUNCTION_RULES
    assert set(rules) == {n for n, op in OPS.items() if op.category is not Category.BOUNDARY}
    assert rules["conv2d"].kind is op_rules.OpKind.QUANTIZED and rules["conv2d"].gemm
    assert rules["view"].kind is op_rules.OpKind.PASSTHROUGH
    assert rules["size"].kind is op_rules.OpKind.IGNORED


def test_stage_support_follows_from_the_ir_ops():
    assert OPS["conv2d"].refused_by() == []
    assert OPS["sigmoid"].refused_by() == []
    assert OPS["log_softmax"].refused_by() == []  # its table op (§13.6.1) converts
    # an op the march cannot compute (a table op type without its table, an op without a lowering) is refused by no
    # stage: it runs on the host (tests/test_warnings_true.py runs each through every stage)
    assert not OpDef("no_table", Category.TABLE, "", ("log_softmax",)).on_npu
    assert OpDef("no_table", Category.TABLE, "", ("log_softmax",)).refused_by() == []
    assert not OPS["argmin"].on_npu and OPS["argmin"].refused_by() == []
    assert OPS["avg_pool1d"].refused_by() == [] and OPS["conv_transpose2d"].refused_by() == []
    assert OPS["size"].refused_by() == []  # metadata gets no op site


def test_docs_ops_md_is_generated_from_the_op_set():
    path = Path(__file__).resolve().parents[1] / "docs" / "ops.md"
    assert path.read_text() == render_markdown(), "regenerate: python -m quantlens.march.opset > docs/ops.md"


def test_the_interpreter_refuses_ops_the_op_set_does_not_give_that_ir_kind():
    import torch

    from quantlens.compiler.ir import Graph, Module, Node, ValueInfo
    from quantlens.errors import QuantLensError

    def module(kind, op):
        graph = Graph([Node(op, ["x"], ["y"], {}, "site_a")], ["x"], ["y"], {}, {"x": ValueInfo((2,), "float32")})
        return Module(kind, graph, [], "", "")

    feeds = {"x": torch.ones(2)}
    assert torch.equal(module("qat", "relu").run(feeds)[0], torch.ones(2))
    with pytest.raises(QuantLensError, match=r"op 'requantize' \(op site 'site_a'\) is not an op of a qat IR"):
        module("qat", "requantize").run(feeds)
    with pytest.raises(QuantLensError, match=r"op 'sigmoid' .* is not an op of a quantized IR"):
        module("quantized", "sigmoid").run(feeds)
    with pytest.raises(QuantLensError, match=r"op 'no_such_op'"):
        module("qat", "no_such_op").run(feeds)


def test_every_op_convert_gives_an_integer_rule_is_emulated_with_it():
    """convert and the fake quant's emulation apply the same integer rules (``quantlens.march.rules``): every op
    type that lowers to an IR op of a rule-bearing category (elementwise, reduction) with a converter has an
    emulation rule, so no such op silently stays float at consistency levels 1-4. Ops of the other categories are
    declared exact without one (``Category.has_own_rule``)."""
    from quantlens.compiler.convert import CONVERTERS
    from quantlens.march.opset import IR_OPS, OPS
    from quantlens.quantization.emulation import EMULATED_OPS

    checked, missing = 0, []
    for ir_op in sorted(CONVERTERS):
        if not IR_OPS[ir_op].category.has_own_rule:
            continue
        for op_type in (d.name for d in OPS.values() if ir_op in d.ir):
            checked += 1
            if op_type not in EMULATED_OPS:
                missing.append(f"{op_type} (-> {ir_op})")
    assert missing == [], f"op types convert gives an integer rule but the emulation does not: {missing}"
    assert checked >= 25  # add/sub/mul/cat/clamp/pools/... all reached
