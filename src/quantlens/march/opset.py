"""The op set: one declaration of every op quantlens knows, and which stages support it.

Two tables, read by every stage (nothing else declares an op's category or its support):

* :data:`IR_OPS`: every op of the IR (``docs/ir.md``). Its category, the section of ``docs/march.md`` that gives
  its integer rule, and whether ``convert`` lowers it to integers (qat IR ops), whether ``to_onnx`` writes it,
  and whether the quantized IR runs it with the qat kernel unchanged (data movement, index and mask ops).
* :data:`OPS`: every op type an op site can have (the canonical torch name the tracer gives it: ``conv2d``,
  ``add``, ``view``), with its category, its march section, the IR ops ``export`` lowers it to, and the flags
  ``prepare`` needs (weight arguments, index outputs ...).

A torch op's support per stage (:meth:`OpDef.stages`) follows from the two: ``export`` supports it when it has
IR ops, ``convert`` and ONNX when every one of its IR ops does; ``pre_export`` when it is not a table op or has a
table. ``prepare`` warns for every op site whose op a later stage refuses; ``docs/ops.md`` is generated from this
module (``python -m quantlens.march.opset > docs/ops.md``), checked against every stage's registry by a test.

To add an op: one :data:`OPS` row, its IR op rows, and one entry in each stage's registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Category", "Cost", "Stage", "IROp", "OpDef", "IR_OPS", "OPS", "op_def", "ir_op", "ops_in", "render_markdown"]


class Category(str, Enum):
    """What an op does to integer values (the march's view of it)."""

    BOUNDARY = "boundary"  #: QuantStub / DeQuantStub; quantize / dequantize (§12)
    QUANTIZER = "quantizer"  #: fake quant, requantize (§5, §8)
    GEMM = "gemm"  #: conv, linear, matmul: exact accumulation, one requantize (§6-§9)
    ELEMENTWISE = "elementwise"  #: integer arithmetic with rescaled inputs (§10)
    REDUCTION = "reduction"  #: sums and averages over windows or dims (§10)
    TABLE = "table"  #: nonlinear: a lookup table or an integer kernel built on tables (§13)
    MOVEMENT = "movement"  #: passthrough: values keep their integer grid (§11)
    LOOKUP = "lookup"  #: rows of a quantized weight table (embedding)
    INDEX = "index"  #: results are indices or masks, not values on a grid
    COMPOSITE = "composite"  #: no op site of its own: the ops it runs are the op sites
    METADATA = "metadata"  #: no values (sizes, dtypes, creation): no op site

    @property
    def has_own_rule(self) -> bool:
        """Its ops have an integer rule of their own (``quantlens.march.rules``), which the fake quant's integer
        emulation (consistency levels 1-4) must apply as convert does. The other categories are exact on their
        grid without one (movement, index, lookup), or emulated as a whole (GEMMs, by the emulator's GEMM path;
        tables, by their overrides)."""
        return self in (Category.ELEMENTWISE, Category.REDUCTION)


class Stage(str, Enum):
    FAKE_QUANT = "fake_quant"
    PRE_EXPORT = "pre_export"
    EXPORT = "export"
    CONVERT = "convert"
    ONNX = "onnx"


class Cost(str, Enum):
    """How the cost model (``docs/march.md`` §15, ``quantlens.compiler.cost``) charges an op of the quantized IR."""

    PASS = "pass"  #: one vector pass over the output (moves, boundary (de)quantize, index ops)
    FREE = "free"  #: a view: no data moves
    GEMM = "gemm"  #: MACs at the int8 (or int16) rate, plus the output requantize
    BILINEAR = "bilinear"  #: two interpolation GEMMs at the int16 rate, plus the requantize
    RESCALED_SUM = "rescaled_sum"  #: each term's requantize, the sums, the final rounding by F
    CAT = "cat"  #: each input's requantize and one move
    PRELU = "prelu"  #: one pass and the two requantizes (q >= 0, q < 0)
    PASS_REQUANT = "pass_requant"  #: one pass and the output requantize
    SCALE = "scale"  #: the requantize, and one pass when it negates
    REQUANTIZE = "requantize"  #: the requantize alone
    SUM = "sum"  #: one pass over the input and the requantize
    AVG_POOL = "avg_pool"  #: a pass per window element and the requantize
    MAX_POOL = "max_pool"  #: a pass per window element
    TABLE = "table"  #: one lookup per element and ``table_passes`` vector passes
    SCAN = "scan"  #: one pass over the input (sort, topk, max, argmax)

    @property
    def requantizes(self) -> bool:
        """Its ops end in a requantize: their integer kernel reads ``out_dtype`` (and ``multiplier``/``shift``,
        absent for an int32 output)."""
        return self not in (Cost.PASS, Cost.FREE, Cost.TABLE, Cost.SCAN, Cost.MAX_POOL)

    @property
    def rescales_each_input(self) -> bool:
        """Its ops requantize each input on its own: ``multipliers``/``shifts``, one entry per input."""
        return self in (Cost.RESCALED_SUM, Cost.CAT)


@dataclass(frozen=True)
class IROp:
    """One IR op. ``level``: ``"qat"`` (the qat IR; convert lowers it), ``"quantized"`` (made by convert), or
    ``"both"`` (the same op in both IRs)."""

    name: str
    category: Category
    march: str = ""
    level: str = "qat"
    convert: bool = True  #: convert has an integer lowering for it (qat-level ops)
    onnx: bool = True  #: to_onnx writes it (qat-level ops)
    #: the quantized IR runs the qat kernel unchanged (movement, index and mask ops)
    shared_kernel: bool = False
    #: keeps every dimension in place (a per-channel int32 value may pass through it)
    keeps_dims: bool = False
    #: a select: one input is a bool mask that picks (where's condition, masked_fill's mask), not a number
    reads_mask: bool = False
    #: moves dims without splitting or merging the channel dim when its shapes allow (reshape, permute): a
    #: per-channel int32 value may pass through it, and convert places its axis (or refuses, naming the op)
    moves_channel_axis: bool = False
    #: outputs after the first are indices (topk, sort, max_dim)
    index_outputs: bool = False
    note: str = ""
    #: how the cost model charges it in the quantized IR, and a table op's vector passes besides its lookups
    cost: Cost = Cost.PASS
    table_passes: int = 0
    #: its integer rule rescales every input to the output scale (§10: add, sub, cat), so inputs that share the
    #: output's scale make it exact (consistency level 2's shared scales)
    rescales_inputs: bool = False
    #: its node inputs, declared only for an op with no torch op whose schema gives them (``compiler/serialize/
    #: arity.py`` reads the schema otherwise): names in order; ``name?`` may be absent (``""``), ``name+`` /
    #: ``name*`` stands for one or more / any number of inputs
    inputs: tuple[str, ...] | None = None
    #: its outputs, with declared ``inputs``: a count, the list attr with one entry per output, ``"*"`` (any number:
    #: a host op returns what its aten overload returns) or ``None`` (one)
    outputs: int | str | None = None
    #: attrs every node of it carries (its kernels read them), beyond the required arguments of its torch op
    attrs: tuple[str, ...] = ()
    #: attrs its integer kernel alone reads (a quantized IR, off the host), beyond those its ``cost`` implies
    int_attrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpDef:
    """One op type at an op site (the canonical name the tracer gives a torch function, method or module)."""

    name: str
    category: Category
    march: str = ""
    #: the qat IR ops export lowers this op to; empty: export refuses it
    ir: tuple[str, ...] = ()
    #: pre_export computes it by a lookup table (``TABLE`` ops without one stay float, and convert refuses them)
    table: bool = False
    gemm: bool = False
    #: a GEMM's output channel dim (its per-channel weight's axis in the output); None: per-tensor operands
    channel_dim: int | None = None
    weight_args: tuple[int, ...] = ()
    bias_args: tuple[int, ...] = ()
    index_producing: bool = False
    output_from_weight: bool = False
    #: a function call's float tensor inputs that are activations (the first ones); the later ones are constants
    #: its integer rule reads in float (batch_norm's statistics and affine, layer_norm's gamma/beta), which get no
    #: fake quant. 0: every float tensor input is an activation
    activation_inputs: int = 0
    note: str = ""

    def stages(self) -> frozenset[Stage]:
        """The stages that accept this op."""
        out = {Stage.FAKE_QUANT, Stage.PRE_EXPORT}  # pre_export refuses nothing: an op without a table stays float
        irs = [IR_OPS[name] for name in self.ir]
        if irs:
            out.add(Stage.EXPORT)
            if all(op.convert for op in irs):
                out.add(Stage.CONVERT)
            if all(op.onnx for op in irs):
                out.add(Stage.ONNX)
        return frozenset(out)

    @property
    def on_npu(self) -> bool:
        """The march computes it (convert has an integer lowering for each of its IR ops); every other op that
        computes on float values runs on the host, in float, at every stage (the partition, ``docs/march.md`` §12)."""
        return Stage.CONVERT in self.stages()

    @property
    def carries_channels(self) -> bool:
        """A per-channel (int32 high-precision) value may pass through it: every IR op keeps the dims in place or
        moves the channel dim whole."""
        return bool(self.ir) and all(IR_OPS[n].keeps_dims or IR_OPS[n].moves_channel_axis for n in self.ir)

    def refused_by(self) -> list[Stage]:
        """The later stages (in pipeline order) that refuse this op; empty when every stage accepts it, as they
        do an op the march cannot compute: it runs on the host, in float, at every stage (§12.1)."""
        if self.category in (Category.METADATA, Category.COMPOSITE) or not self.on_npu:
            return []
        have = self.stages()
        return [s for s in Stage if s not in have]


B, Q, G, E, R, T, M, L, X, C, D = (
    Category.BOUNDARY, Category.QUANTIZER, Category.GEMM, Category.ELEMENTWISE, Category.REDUCTION,
    Category.TABLE, Category.MOVEMENT, Category.LOOKUP, Category.INDEX, Category.COMPOSITE, Category.METADATA,
)

# -- the IR ops ------------------------------------------------------------------------------------------------
#: attrs shared by several rows: a conv's (its integer kernel reads them all), a pool's, a pad's; a table op's
#: integer kernel splits its inputs by ``table_inputs`` (convert writes it)
_CONV = ("stride", "padding", "dilation", "groups")
_POOL = ("kernel_size", "stride", "padding")
_MAX_POOL = (*_POOL, "dilation", "ceil_mode")
_PAD = ("pad", "mode", "value")
_TABLE = ("table_inputs",)
_IR_ROWS: list[IROp] = [
    IROp("fake_quant", Q, "§5"),
    IROp("quantize", B, "§5, §12", level="quantized", inputs=("x", "scale"), attrs=("out_dtype",)),
    IROp("dequantize", B, "§5, §12", level="quantized", inputs=("q", "scale")),
    IROp("host_aten", B, "§12", convert=False, inputs=("inputs*",), outputs="*",
         attrs=("target", "args", "kwargs"),
         note="any aten op with no IR lowering: float, on the host (§12.1, compiler/host_ops.py); ONNX through "
              "torch's exporter"),
    IROp("requantize", Q, "§8", level="quantized", cost=Cost.REQUANTIZE, inputs=("q",)),
    IROp("channel_shift", Q, "§3.1", level="quantized", inputs=("q",), attrs=("left_shifts", "axis")),
    # GEMM
    IROp("conv1d", G, "§6-§9", level="both", cost=Cost.GEMM, attrs=_CONV),
    IROp("conv2d", G, "§6-§9", level="both", cost=Cost.GEMM, attrs=_CONV),
    IROp("conv_transpose1d", G, "§6-§9", level="both", cost=Cost.GEMM, attrs=(*_CONV, "output_padding"),
         note="int8 weight per channel along axis 1 (groups = 1)"),
    IROp("conv_transpose2d", G, "§6-§9", level="both", cost=Cost.GEMM, attrs=(*_CONV, "output_padding"),
         note="int8 weight per channel along axis 1 (groups = 1)"),
    IROp("linear", G, "§6-§9", level="both", cost=Cost.GEMM),
    IROp("matmul", G, "§6-§9", level="both", cost=Cost.GEMM),
    IROp("sdpa", G, "§6, §13.6", convert=False, note="decomposed at prepare; export sees matmul/softmax"),
    # elementwise
    IROp("add", E, "§10", level="both", cost=Cost.RESCALED_SUM, rescales_inputs=True, int_attrs=("frac_bits",)),
    IROp("sub", E, "§10", level="both", cost=Cost.RESCALED_SUM, rescales_inputs=True, int_attrs=("frac_bits",)),
    IROp("mul", E, "§10", level="both", cost=Cost.PASS_REQUANT),
    IROp("div", E, "§10, §13.5", note="by a constant: a multiplier; by a tensor: the int_div table"),
    IROp("cat", E, "§10", level="both", cost=Cost.CAT, rescales_inputs=True, attrs=("dim",)),
    IROp("neg", E, "§10"),
    IROp("abs", E, "§10"),
    IROp("clamp", E, "§10", level="both", cost=Cost.PASS_REQUANT, int_attrs=("lo", "hi")),
    IROp("hardtanh", E, "§10"),
    IROp("masked_fill", E, "§11", reads_mask=True),
    IROp("where", E, "§11", level="both", shared_kernel=True, reads_mask=True,
         note="a select: each value operand moved to the output grid (a constant: its code on it)"),
    IROp("upsample_bilinear2d", E, "§10.1"),
    IROp("batch_norm", E, "§10.2", note="not folded into a conv/linear: a per-channel affine",
         inputs=("input", "weight?", "bias?", "running_mean", "running_var"), attrs=("eps",)),
    IROp("channel_affine", E, "§10.2", level="quantized", cost=Cost.PASS_REQUANT, inputs=("q", "weight", "bias"),
         attrs=("channel_dim",)),
    IROp("prelu", E, "§10.3"),
    IROp("leaky_relu", E, "§10.3"),
    IROp("prelu_int", E, "§10.3", level="quantized", cost=Cost.PRELU, inputs=("q",),
         attrs=("multiplier", "shift", "neg_multiplier", "neg_shift", "neg_sign")),
    IROp("add_const", E, "§10", level="quantized", cost=Cost.RESCALED_SUM, inputs=("q",),
         attrs=("negate", "addend", "frac_bits")),
    IROp("scale", E, "§8, §10", level="quantized", cost=Cost.SCALE, inputs=("q",), attrs=("negative",)),
    IROp("abs_int", E, "§10", level="quantized", cost=Cost.PASS_REQUANT, inputs=("q",)),
    IROp("neg_int", E, "§10", level="quantized", cost=Cost.PASS_REQUANT, inputs=("q",)),
    IROp("masked_fill_int", E, "§11", level="quantized", inputs=("q", "mask"), attrs=("value",)),
    IROp("bilinear_int", E, "§10.1", level="quantized", cost=Cost.BILINEAR, inputs=("q", "a_h", "a_w")),
    # reductions
    # (attrs with a torch default listed too: a default taken in place of the exported value computes another op)
    IROp("mean", R, "§10", attrs=("keepdim",)),
    IROp("sum", R, "§10", attrs=("keepdim",)),
    IROp("avg_pool2d", R, "§10", attrs=(*_POOL, "ceil_mode", "count_include_pad", "divisor_override")),
    IROp("adaptive_avg_pool2d", R, "§10", note="even windows only"),
    IROp("adaptive_avg_pool1d", R, "§10", note="even windows only"),
    IROp("avg_pool1d", R, "§10", attrs=(*_POOL, "ceil_mode", "count_include_pad")),
    IROp("sum_int", R, "§10", level="quantized", cost=Cost.SUM, inputs=("q",), attrs=("dim", "keepdim")),
    IROp("cumsum", R, "§10.2"),
    IROp("cumsum_int", R, "§10.2", level="quantized", cost=Cost.SUM, inputs=("q",), attrs=("dim",)),
    IROp("avg_pool2d_int", R, "§10", level="quantized", cost=Cost.AVG_POOL, inputs=("q",),
         attrs=(*_POOL, "ceil_mode", "count_include_pad")),
    IROp("avg_pool2d_div_int", R, "§10.2", level="quantized", cost=Cost.AVG_POOL, inputs=("q",),
         attrs=(*_POOL, "ceil_mode", "divisors", "divisor_values", "multiplier", "shift"),
         note="windows of different counts: one multiplier per divisor"),
    IROp("avg_pool1d_int", R, "§10", level="quantized", cost=Cost.AVG_POOL, inputs=("q",), attrs=_POOL),
    # float nonlinear ops: in the qat IR only when pre_export left them float (no table)
    *(IROp(name, T, "§13", convert=False, note="computed by a table after pre_export")
      for name in ("sigmoid", "tanh", "silu", "exp", "gelu", "softplus", "reciprocal", "softmax", "log_softmax",
                   "layer_norm", "rsqrt", "sqrt", "erf", "log", "pow", "hardswish", "hardsigmoid", "elu")),
    # pre_export's table ops (torch.ops.quantlens.*), the same kernels in both IRs
    IROp("lut", T, "§13.2", level="both", cost=Cost.TABLE, table_passes=0, int_attrs=_TABLE),
    IROp("segment_lut", T, "§13.3", level="both", cost=Cost.TABLE, table_passes=1, int_attrs=_TABLE),
    IROp("int_reciprocal", T, "§13.5", level="both", cost=Cost.TABLE, table_passes=1, int_attrs=_TABLE),
    IROp("int_div", T, "§13.5", level="both", cost=Cost.TABLE, table_passes=2, int_attrs=_TABLE),
    IROp("int_softmax", T, "§13.6", level="both", cost=Cost.TABLE, table_passes=4, int_attrs=_TABLE),
    IROp("int_log_softmax", T, "§13.6.1", level="both", cost=Cost.TABLE, table_passes=4, int_attrs=_TABLE),
    IROp("int_layer_norm", T, "§13.7", level="both", cost=Cost.TABLE, table_passes=4, int_attrs=_TABLE),
    IROp("int_rms_norm", T, "§13.7.1", level="both", cost=Cost.TABLE, table_passes=3, int_attrs=_TABLE),
    IROp("int_vector_norm", T, "§13.7.2", level="both", cost=Cost.TABLE, table_passes=2, int_attrs=_TABLE),
    # movement: values keep their grid
    IROp("reshape", M, "§11", level="both", shared_kernel=True, cost=Cost.FREE, moves_channel_axis=True),
    IROp("permute", M, "§11", level="both", shared_kernel=True, moves_channel_axis=True),
    IROp("expand", M, "§11", level="both", shared_kernel=True, keeps_dims=True, cost=Cost.FREE),
    IROp("slice", M, "§11", level="both", shared_kernel=True, keeps_dims=True, cost=Cost.FREE, inputs=("x",),
         attrs=("dim", "start", "end", "step")),
    IROp("select", M, "§11", level="both", shared_kernel=True, cost=Cost.FREE, inputs=("x",), attrs=("dim", "index")),
    IROp("split", M, "§11", level="both", shared_kernel=True, cost=Cost.FREE, inputs=("x",), outputs="sizes",
         attrs=("sizes", "dim")),
    IROp("index", M, "§11", level="both", shared_kernel=True, inputs=("x", "indices?+")),
    IROp("gather", M, "§11", level="both", shared_kernel=True, keeps_dims=True),
    IROp("index_select", M, "§11", level="both", shared_kernel=True, keeps_dims=True),
    IROp("embedding", L, "§11", level="both", shared_kernel=True),
    IROp("relu", M, "§11", level="both", keeps_dims=True),
    IROp("max_pool2d", M, "§11", level="both", keeps_dims=True, cost=Cost.MAX_POOL, attrs=_MAX_POOL),
    IROp("upsample_nearest2d", M, "§11", level="both"),
    IROp("max_pool1d", M, "§11", level="both", keeps_dims=True, cost=Cost.MAX_POOL, attrs=_MAX_POOL),
    IROp("upsample_nearest1d", M, "§11", level="both"),
    IROp("pixel_shuffle", M, "§11", level="both", shared_kernel=True),
    IROp("pixel_unshuffle", M, "§11", level="both", shared_kernel=True),
    IROp("flip", M, "§11", level="both", shared_kernel=True),
    IROp("pad", M, "§11", note="constants are written on the input's grid", inputs=("x",), attrs=_PAD),
    IROp("pad_int", M, "§11", level="quantized", inputs=("q",), attrs=_PAD),
    IROp("fill", M, "§11", note="x[...] = constant, after functionalization"),
    IROp("fill_int", M, "§11", level="quantized", inputs=("q",), attrs=("value",)),
    IROp("select_scatter", M, "§11", level="both", note="x[:, i] = v, after functionalization"),
    IROp("slice_scatter", M, "§11", level="both", note="x[:, a:b] = v, after functionalization"),
    IROp("amax", M, "§11", level="both", shared_kernel=True, cost=Cost.SCAN),
    IROp("max_dim", M, "§11", level="both", index_outputs=True, cost=Cost.SCAN),
    IROp("topk", M, "§11", level="both", index_outputs=True, cost=Cost.SCAN),
    IROp("sort", M, "§11", level="both", index_outputs=True, cost=Cost.SCAN),
    # indices and masks
    IROp("argmax", X, "§11", level="both", shared_kernel=True, cost=Cost.SCAN),
    IROp("cast", X, "", level="both", shared_kernel=True, inputs=("x",), attrs=("dtype",)),
    *(IROp(name, X, "", level="both", shared_kernel=True)
      for name in ("eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or")),
]

IR_OPS: dict[str, IROp] = {op.name: op for op in _IR_ROWS}

# -- the op types of op sites ------------------------------------------------------------------------------------


def _rows(names: str, category: Category, march: str = "", ir: tuple[str, ...] | None = None, **flags) -> list[OpDef]:
    """One row per name; ``ir`` defaults to the IR op of the same name."""
    return [OpDef(name, category, march, (name,) if ir is None else ir, **flags) for name in names.split()]


_OP_ROWS: list[OpDef] = [
    OpDef("quant_stub", B, "§12", ("fake_quant",)),
    OpDef("dequant_stub", B, "§12", ("fake_quant",)),
    # GEMM
    *_rows("conv1d conv2d", G, "§6-§9", gemm=True, weight_args=(1,), bias_args=(2,), channel_dim=1),
    OpDef("linear", G, "§6-§9", ("linear",), gemm=True, weight_args=(1,), bias_args=(2,), channel_dim=-1),
    # transformers' GPT-2 ``Conv1D``: addmm(bias, x2d, weight[in, out]) = linear(x2d, weightᵀ, bias)
    OpDef("addmm", G, "§6-§9", ("permute", "linear"), gemm=True, weight_args=(2,), bias_args=(0,), channel_dim=-1,
          note="beta = alpha = 1; the weight is [in, out] (per-channel along its axis 1)"),
    *_rows("conv_transpose1d conv_transpose2d", G, "§6-§9", gemm=True, weight_args=(1,), bias_args=(2,),
           channel_dim=1, note="weight per channel along axis 1"),
    *_rows("matmul bmm mm", G, "§6-§9", ("matmul",), gemm=True),
    OpDef("scaled_dot_product_attention", G, "§6, §13.6", ("matmul", "int_softmax"), gemm=True,
          note="decomposed at prepare into matmul, softmax (table) and matmul"),
    OpDef("embedding", L, "§11", ("embedding",), weight_args=(1,), output_from_weight=True),
    # elementwise
    *_rows("add sub mul cat neg abs hardtanh", E, "§10"),
    OpDef("clamp", E, "§10", ("clamp",), activation_inputs=1,
          note="bounds given as tensors are constants: codes of the input's grid (±inf: no bound)"),
    OpDef("masked_fill", E, "§10", ("masked_fill",), activation_inputs=1,
          note="a fill value given as a tensor is a constant: its code on the input's grid (±inf saturates)"),
    OpDef("rsub", E, "§10", ("sub",)),
    OpDef("concat", E, "§10", ("cat",)),
    OpDef("stack", E, "§10", ("reshape", "cat")),
    OpDef("clip", E, "§10", ("clamp",)),
    OpDef("relu6", E, "§10", ("hardtanh",)),
    OpDef("div", T, "§10, §13.5", ("div", "int_div"), table=True),
    OpDef("where", E, "§11", ("where",), note="a select: operands moved to the output grid, then picked"),
    OpDef("interpolate", E, "§10.1, §11", ("upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d"),
          note="nearest 1-d and 2-d, bilinear 2-d"),
    # reductions
    *_rows("mean sum avg_pool2d adaptive_avg_pool2d adaptive_avg_pool1d", R, "§10"),
    OpDef("avg_pool1d", R, "§10", ("avg_pool1d",)),
    OpDef("cumsum", R, "§10.2", ("cumsum",), note="exact running sums of the codes, one requantize"),
    # nonlinear: tables
    *_rows("sigmoid tanh exp gelu silu softplus reciprocal sqrt rsqrt log pow erf hardswish hardsigmoid elu", T,
           "§13.4", ("lut", "segment_lut"), table=True),
    OpDef("softmax", T, "§13.6", ("int_softmax",), table=True),
    OpDef("layer_norm", T, "§13.7", ("int_layer_norm",), table=True, activation_inputs=1),
    OpDef("rms_norm", T, "§13.7.1", ("int_rms_norm",), table=True, activation_inputs=1),
    OpDef("normalize", T, "§13.7.1", ("permute", "int_rms_norm"), table=True, note="p = 2"),
    *_rows("linalg_vector_norm norm", T, "§13.7.2", ("int_vector_norm",), table=True, note="p = 2 ('fro')"),
    OpDef("log_softmax", T, "§13.6.1", ("int_log_softmax",), table=True),
    OpDef("batch_norm", E, "§10.2", ("batch_norm",), activation_inputs=1,
          note="folded into a preceding conv/linear, else an affine"),
    OpDef("leaky_relu", E, "§10.3", ("leaky_relu",)),
    *_rows("square", T, "", (),
           note="no integer rule yet"),
    OpDef("group_norm", C, "§10.3, §13.7",
          note="decomposed at prepare into reshape, layer_norm (table, no affine), reshape, batch_norm (affine)"),
    OpDef("instance_norm", C, "§10.3, §13.7",
          note="decomposed at prepare: group_norm with a group per channel, or batch_norm on running statistics"),
    OpDef("glu", C, "§13.4", note="decomposed at prepare into chunk, sigmoid (table) and mul"),
    OpDef("baddbmm", C, "§6-§10", note="decomposed at prepare into matmul, a scale by alpha / beta, and add"),
    # movement
    *_rows("view reshape flatten unflatten squeeze unsqueeze view_as reshape_as", M, "§11", ("reshape",)),
    *_rows("permute transpose t movedim swapaxes", M, "§11", ("permute",)),
    *_rows("expand expand_as", M, "§11", ("expand",)),
    *_rows("split chunk unbind", M, "§11", ("split",)),
    OpDef("getitem", M, "§11", ("slice", "select", "index")),
    OpDef("narrow", M, "§11", ("slice",)),
    *_rows("select index_select gather relu max_pool2d", M, "§11"),
    *_rows("max_pool1d flip pixel_shuffle pixel_unshuffle", M, "§11"),
    OpDef("adaptive_max_pool1d", M, "§11", ("max_pool1d",), note="even windows only: a max pool"),
    OpDef("adaptive_max_pool2d", M, "§11", ("max_pool2d",), note="even windows only: a max pool"),
    *_rows("contiguous dropout clone detach identity", M, "§11", ("reshape",),
           note="lowers to nothing (the value passes through)"),
    *_rows("to float type", X, "", ("cast",)),
    OpDef("amax", M, "§11", ("amax",)),
    *_rows("max", M, "§11", ("max_dim", "amax"), index_producing=True),
    *_rows("topk sort", M, "§11", index_producing=True),
    *_rows("min", M, "§11", (), index_producing=True),
    *_rows("repeat tile", M, "§11", ("reshape", "expand"),
           note="a reshape, an expand and a reshape; a count from the dynamic batch adds an index_select"),
    *_rows("roll max_pool1d_with_indices max_pool2d_with_indices amin", M, "§11", (), note="no lowering yet"),
    OpDef("pad", M, "§11", ("pad",), note="constant (any value), reflect, replicate"),
    OpDef("prelu", E, "§10.3", ("prelu",), weight_args=(1,), note="slope per channel (int8 weight)"),
    OpDef("argmax", X, "§11", ("argmax",), index_producing=True),
    OpDef("argsort", X, "§11", ("sort",), index_producing=True, note="a sort's indices"),
    OpDef("argmin", X, "", (), index_producing=True),
    OpDef("multi_head_attention_forward", C),
    *_rows("lstm lstm_cell gru gru_cell", C, "§6-§10, §13.4", (),
           note="decomposed at prepare into linear, add, chunk, sigmoid/tanh (tables) and mul per time step"),
    *_rows("rnn_tanh rnn_relu rnn_tanh_cell rnn_relu_cell", C, "§6-§10, §13.4", (),
           note="decomposed at prepare into linear, add and tanh (table) or relu per time step"),
    *_rows(
        "size dim numel __get__ __set__ bool item tolist eq ne lt le gt ge isnan isinf isfinite all any len iter "
        "format repr setitem stride is_contiguous is_floating_point element_size data_ptr get_device long int "
        "bool_ logical_and logical_or logical_not and or invert requires_grad_ has_torch_function "
        "_has_compatible_shallow_copy_type cpu cuda zeros_like ones_like empty_like full_like new_zeros new_ones "
        "new_empty new_full new_tensor arange zeros ones full empty tensor finfo iinfo",
        D, "", (),
    ),
]

OPS: dict[str, OpDef] = {op.name: op for op in _OP_ROWS}


def op_def(name: str) -> OpDef | None:
    """The declaration of op type ``name``, or ``None`` for an op quantlens does not know."""
    return OPS.get(name)


def ir_op(name: str) -> IROp | None:
    return IR_OPS.get(name)


def ops_in(*categories: Category, level: str | None = None, **flags) -> frozenset[str]:
    """Names of the IR ops in ``categories`` (all when none given), at ``level`` (``"qat"``: qat-level and
    ``both``; ``"quantized"``: quantized-level and ``both``), with the given flag values."""
    out = set()
    for op in IR_OPS.values():
        if categories and op.category not in categories:
            continue
        if level is not None and op.level not in (level, "both"):
            continue
        if any(getattr(op, k) != v for k, v in flags.items()):
            continue
        out.add(op.name)
    return frozenset(out)


def render_markdown() -> str:
    """``docs/ops.md``: every op type and its support per stage, then every IR op."""
    stages = list(Stage)
    lines = [
        "# Op support",
        "",
        "Generated from `quantlens.march.opset` (`python -m quantlens.march.opset > docs/ops.md`); "
        "`tests/test_opset.py` checks",
        "that this file, the op set and every stage's registry agree.",
        "",
        "An op the march has no integer rule for runs on the host in float at every stage (the partition,",
        "`docs/march.md` §12.1): `host` below, and so does any op this table does not list (an `fft`, a `cumprod`,",
        "a library's custom operator). `prepare` says how many op sites run on the host, and",
        "`model_check_result.txt` lists each with why (its column 'runs on').",
        "",
        "## Op types at op sites",
        "",
        "| op | category | march | IR ops | table | runs on | " + " | ".join(s.value for s in stages) + " | note |",
        "|---|---|---|---|---|---|" + "---|" * len(stages) + "---|",
    ]
    for op in sorted(OPS.values(), key=lambda o: (o.category.value, o.name)):
        if op.category is Category.METADATA:
            continue
        have = op.stages()
        host = op.category is not Category.COMPOSITE and not op.on_npu
        marks = " | ".join("yes" if s in have else ("host" if host else "–") for s in stages)
        irs = ", ".join(f"`{n}`" for n in op.ir) or "–"
        table = "yes" if op.table else "–"
        where = "decomposed" if op.category is Category.COMPOSITE else ("host" if host else "NPU")
        lines.append(f"| `{op.name}` | {op.category.value} | {op.march or '–'} | {irs} | {table} | {where} | {marks} | "
                     f"{op.note} |")
    metadata = sorted(o.name for o in OPS.values() if o.category is Category.METADATA)
    lines += ["", "Metadata and creation ops get no op site: " + ", ".join(f"`{n}`" for n in metadata) + ".", "",
              "## IR ops", "",
              "| IR op | level | category | march | convert | onnx | quantized IR kernel | note |",
              "|---|---|---|---|---|---|---|---|"]
    for op in sorted(IR_OPS.values(), key=lambda o: (o.level, o.category.value, o.name)):
        qat = op.level in ("qat", "both")
        conv = ("yes" if op.convert else "–") if qat else "n/a"
        onnx = ("yes" if op.onnx else "–") if qat else "n/a"
        kernel = "shared with qat" if op.shared_kernel else ("integer" if op.level != "qat" else "–")
        lines.append(f"| `{op.name}` | {op.level} | {op.category.value} | {op.march or '–'} | {conv} | {onnx} | "
                     f"{kernel} | {op.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(render_markdown(), end="")
