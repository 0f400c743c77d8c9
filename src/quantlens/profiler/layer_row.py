"""One row of the per-layer comparison (:class:`LayerRow`): an op site's metrics, ranges, verdicts and notes.
:mod:`.compare` computes the rows; every report reads them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerRow"]


@dataclass(frozen=True)
class LayerRow:
    """One op site of the comparison. Metric fields are None where there is nothing to compare."""

    index: int
    op_name: str
    base_op_type: str
    analy_op_type: str
    module_type: str  # analysis module class ("" for function ops)
    shape: str
    quant_dtype: str
    scale: float | None  # per-tensor output scale of the analysis op
    Cosine: float | None = None
    MSE: float | None = None
    L1: float | None = None
    KL: float | None = None
    SQNR: float | None = None
    Atol: float | None = None
    atol_in_scale: float | None = None  # Atol / scale: the accumulated error in output steps
    same_input_cosine: float | None = None
    same_input_sqnr: float | None = None
    same_input_atol: float | None = None
    same_input_in_scale: float | None = None  # same-input Atol / scale
    #: per channel (ops with a channel axis only, see :func:`channel_axis`; None elsewhere): the SQNR (dB) of the
    #: worst channel, accumulated and same-input; the same-input one before the op's output fake quant (the
    #: op's own arithmetic: its weights, inputs quantized at the op); the share (0..1) of channels whose
    #: same-input SQNR (accumulated where there is no same-input run) is below SAME_INPUT_SQNR_LIMIT. Channels
    #: whose baseline is all zero have no SQNR and count in none of them (see metrics.channel_sqnr)
    worst_channel_sqnr: float | None = None
    same_input_worst_channel_sqnr: float | None = None
    same_input_inner_worst_channel_sqnr: float | None = None
    channels_below: float | None = None
    #: whether the weight of the op that computes the row's value (a fused group's conv/linear) is quantized per
    #: channel (True) or per tensor (False); None: no weight fake quant recorded (no weight, a float op, an IR)
    weight_per_channel: bool | None = None
    base_min: float | None = None
    base_max: float | None = None
    base_mean: float | None = None
    analy_min: float | None = None
    analy_max: float | None = None
    analy_mean: float | None = None
    #: the largest part of the same-input error: "clipping" (the output saturates), "rounding" (output
    #: rounding) or "internal" (rounding inside the op: its weights, inputs quantized at the op, lookup tables)
    error_kind: str = ""
    same_input_clip_mse: float | None = None
    same_input_round_mse: float | None = None
    same_input_inner_mse: float | None = None
    raw_error_kind: str = ""  # the actual run: "clipping" / "rounding", the larger part of the output's error
    clipped_ratio: float | None = None  # fraction of output elements that saturate (actual run)
    raw_min: float | None = None  # the analysis op's output range before its output fake quant
    raw_max: float | None = None
    input_min: float | None = None  # QuantStub sites: the model input's range
    input_max: float | None = None
    input_dtypes: str = ""
    boundary: str = ""
    producer: str = ""
    fused_into: str = ""
    nonfinite: str = ""  # "baseline" / "analysis" / "both" when an output holds NaN/Inf
    #: deployed stages (export / convert): |diff| in units of the output LSB (the analysis op's scale), per op:
    #: "bit-exact", "within 1 LSB", "within 4 LSB" or "diverged", and the histogram "0:n|1:n|2:n|3-4:n|5-8:n|>8:n"
    lsb_verdict: str = ""
    lsb_hist: str = ""
    same_input_lsb_verdict: str = ""
    same_input_lsb_hist: str = ""
    #: deployed stages, from the IR's integer arithmetic (IntegerStats): the fraction of GEMM accumulator
    #: elements beyond int32 (saturated, §6), of table inputs clipped at a limit where the table is not flat,
    #: and the number of NaN/Inf values the quantized IR turned into integers here
    acc_saturated_ratio: float | None = None
    table_input_clipped_ratio: float | None = None
    nonfinite_to_int: int = 0
    #: deployed stages: fraction of the same-input output at the integer type's limit (qmin/qmax) where the
    #: baseline's value lay at least two steps inside the range (saturation the fake quant did not do)
    requant_saturated_ratio: float | None = None
    note: str = ""
    #: whether the op's values reach a compared output (False: it cannot explain the outputs' error and is never
    #: ranked; None: not known) and whether every input of the op is a model input (``profiler.reach``)
    reaches_output: bool | None = None
    host_side: bool = False
    #: a fused group's row (its last op, where the group is compared): its members' op types in order, from the
    #: baseline ("conv2d+batch_norm+relu"); "" elsewhere
    group: str = ""
    #: an op reading an index (gather, embedding ...): "input 2: 12 of 64 differ" when its index input differs
    #: between the two models (the values it moves are then other values), and the op site that made that index
    index_differs: str = ""
    index_producer: str = ""

    @property
    def compared(self) -> bool:
        return self.Cosine is not None

    @property
    def op_type(self) -> str:
        """The op type every report shows: a fused group's member types, a member's own type (its site computes
        nothing of its own in the analysis model: a folded BatchNorm is an identity there), else the analysis op."""
        if self.group:
            return self.group
        return (self.base_op_type or self.analy_op_type) if self.fused_into else self.analy_op_type
