"""Op sites that the NPU computes as several integer ops, and that therefore need internal fake quants.

``scaled_dot_product_attention`` is one op in torch but three on the march: ``q @ kᵀ`` (int32, requantized),
``softmax`` (tables) and ``probs @ v``. Its scores and probabilities must be quantized, and their scales must
be observed like any other activation, so ``prepare`` installs :class:`SdpaDecomposition` at every sdpa op site:
the prepared model computes what the NPU computes, calibration observes the internal tensors, and ``export``
captures the decomposition.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError
from quantlens.quantization.emulation import current_emulator
from quantlens.quantization.fake_quantize import FakeQuantize
from quantlens.quantization.overrides import OverrideCall, SiteOverride
from quantlens.quantization.qconfig import QuantSpec

__all__ = ["SdpaDecomposition", "DECOMPOSITIONS"]

#: additive mask entries at or below this are "masked out": exp(x - max) is 0 in float32 far above it
_BLOCKED = -1e4
_SDPA_SIGNATURE = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False: None
)


def _repeat_heads(t: torch.Tensor, heads: int, site: str) -> torch.Tensor:
    """``t`` (..., kv_heads, L, E) with each head repeated ``heads // kv_heads`` times, as torch's sdpa does for
    ``enable_gqa=True``; by expand + reshape (data movement, no new values to quantize)."""
    kv_heads = t.shape[-3]
    if heads % kv_heads:
        raise QuantLensError(f"Op site '{site}': scaled_dot_product_attention with enable_gqa=True needs the query "
                             f"heads ({heads}) to be a multiple of the key/value heads ({kv_heads}).")
    if heads == kv_heads:
        return t
    lead, (length, width) = t.shape[:-3], t.shape[-2:]
    return t.unsqueeze(-3).expand(*lead, kv_heads, heads // kv_heads, length, width).reshape(
        *lead, heads, length, width)


class SdpaDecomposition(SiteOverride):
    """``softmax(q @ kᵀ · scale, masked) @ v`` with fake quants on the scaled scores and the probabilities.

    A boolean mask (True = attend) sets masked scores to the most negative integer of the scores' grid, so
    the float and integer models mask identically. A float (additive) mask is added to the quantized scores, and
    the sum has its own fake quant (``mask_fq``); its entries <= -1e4 (``finfo.min`` fills) mask out like False.
    """

    def __init__(self, spec: QuantSpec):
        super().__init__()
        self.scores_fq = FakeQuantize(spec)
        self.probs_fq = FakeQuantize(spec)
        #: the scores after an additive (float) mask; used only where the site is called with one
        self.mask_fq = FakeQuantize(spec)
        self.additive_mask = False
        #: set by pre_export: the march's integer softmax (a table site override) for the probabilities
        self.softmax_table: SiteOverride | None = None

    @property
    def softmax_input_fq(self) -> FakeQuantize:
        """The fake quant whose grid the softmax reads: the masked scores' with an additive mask, else the scores'."""
        return self.mask_fq if self.additive_mask else self.scores_fq

    def compute(self, call: OverrideCall):
        bound = _SDPA_SIGNATURE.bind(*call.args, **call.kwargs)
        bound.apply_defaults()
        a = bound.arguments
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if a["enable_gqa"]:  # grouped-query attention: each key/value head serves a group of query heads
            k, v = (_repeat_heads(t, q.shape[-3], call.site) for t in (k, v))
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
        emulator = current_emulator()
        q_fq, k_fq, v_fq = (list(call.input_fqs) + [None] * 3)[:3]
        if emulator is not None and None not in (q_fq, k_fq, v_fq) and scale > 0 and not (
                mask is not None and not mask.dtype == torch.bool):
            # the integer rules (consistency levels 1-4): q @ kᵀ with the scale folded into its requantize
            k_t = k.transpose(-2, -1)
            scores = emulator.matmul(q, k_t, q_fq, k_fq, lambda: torch.matmul(q, k_t) * scale, factor=scale)
        else:
            emulator = None
            scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if a["is_causal"]:
            length, source = scores.shape[-2], scores.shape[-1]
            mask = torch.ones(length, source, dtype=torch.bool, device=scores.device).tril()
        scores = self.scores_fq(scores) if emulator is None else emulator.quantize_output(scores, self.scores_fq)
        self.additive_mask = mask is not None and not mask.dtype == torch.bool
        if self.additive_mask:
            # q @ kᵀ·scale keeps its own grid (one GEMM requantize); the bias (relative positions, ALiBi) is an add
            # onto it with its own output grid. Entries <= _BLOCKED are masked out (exp underflows to 0 there in
            # float32 too): they become the lowest code rather than stretching the grid to -3.4e38.
            blocked = mask <= _BLOCKED
            scores = self.mask_fq(scores + mask.masked_fill(blocked, 0.0))
            mask = torch.logical_not(blocked)
        fq = self.softmax_input_fq
        float_mask = mask is not None and not fq.fake_quant_enabled
        if mask is not None:
            # Fake quantizing: the march's rule (docs/march.md §13.6.2), a masked score is the lowest code of the
            # grid. FLOAT and CALIBRATION: the float model's own masking (exp(-inf) = 0), so that the prepared
            # model computes the float one there and calibration sees its probabilities (the lowest code of a
            # tiny random model's narrow grid left masked keys most of the weight).
            fill = float("-inf") if float_mask else fq.scale.reshape(()) * fq.dtype.qmin
            scores = scores.masked_fill(torch.logical_not(mask), fill)
        if float_mask:
            none_kept = torch.logical_not(mask.any(dim=-1, keepdim=True))
            if self.additive_mask:  # float: each key at score + finfo.min, all one value: a uniform row
                scores = scores.masked_fill(none_kept, 0.0)
        if self.softmax_table is not None:
            table_call = OverrideCall(f"{call.site}.softmax", "softmax", (scores, -1), {}, None,
                                      [fq], self.probs_fq, torch.softmax)
            probs = self.softmax_table.compute(table_call)
        else:
            probs = torch.softmax(scores, dim=-1)
        if float_mask and not self.additive_mask:  # every key masked: 0, as torch's attention gives (not NaN)
            probs = probs.masked_fill(none_kept, 0.0)
        if self.softmax_table is not None and self.softmax_table.observes_output() and not self.probs_fq._learning():
            probs = self.probs_fq.quantize(probs)  # the table has observed the float softmax (QAT, level 3+)
        else:
            probs = self.probs_fq(probs)
        if a["dropout_p"] and self.training:
            probs = F.dropout(probs, a["dropout_p"])
        if emulator is not None and not (a["dropout_p"] and self.training):
            return emulator.matmul(probs, v, self.probs_fq, v_fq, lambda: torch.matmul(probs, v))
        return torch.matmul(probs, v)


#: op type -> factory(spec) of the override prepare installs at such sites
DECOMPOSITIONS = {"scaled_dot_product_attention": SdpaDecomposition}
