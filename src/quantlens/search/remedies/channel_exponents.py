"""Channel exponents for a residual stream (``docs/march.md`` §3.1, ``docs/remedies.md``).

A transformer's residual stream (the sum of a block's output and its input) carries a few outlier channels (in
all-MiniLM-L6-v2's first output sum, 6 of 384; the others 4 to 8 times smaller or more). One int8 scale for the
whole tensor spends its levels on those channels, the others use 32 of 128 or fewer, and the LayerNorm after the
sum normalizes their rounding with them. A
per-channel scale in channel-exponent form ``s · 2**-k_c`` keeps every channel's own step (within a factor 2, down
to ``2**-K`` of the widest), stays int8 in memory, and costs the readers one exact shift onto a common int16 grid.

:class:`ChannelExponentQconfigSetter` asks for it at the stream's sums: the add / sub op sites whose output only
sums and norms read (:func:`stream_sites`), the places where the march's rule exists (the add rule writes the
codes, §10; the readers shift them, §3.1).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from quantlens.march import QuantDType, rules
from quantlens.quantization.qconfig_template import (
    QconfigAssignment,
    QconfigContext,
    QconfigSetter,
    default_calibration_qconfig_setter,
    resolve_qconfigs,
    unmatched_message,
)
from quantlens.sites.op_rules import OpKind
from quantlens.sites.record import ModelRecord

__all__ = ["ChannelExponentQconfigSetter", "stream_sites", "has_stream_sites", "STREAM_READERS"]

#: the op types that may read a residual stream's sum in channel-exponent form: another sum (the next residual add
#: of a pre-LN stack) and the norms (a post-LN block's LayerNorm)
STREAM_READERS = frozenset({"add", "sub", "layer_norm", "rms_norm"})
#: the norms among them: a stream's sums lead to one (its channels are the norm's features)
NORMS = frozenset({"layer_norm", "rms_norm"})


def _readers(record: ModelRecord, name: str) -> list[str]:
    """The op sites that compute on ``name``'s output, through the passthrough sites between (a dropout)."""
    readers = []
    for reader in record.consumers(name):
        site = record.sites[reader]
        if site.kind is OpKind.PASSTHROUGH and not site.boundary:
            readers += _readers(record, reader)
        else:
            readers.append(reader)
    return readers


def _wide(site) -> bool:
    return bool(site.output_shapes) and len(site.output_shapes[0]) >= 2 and site.output_shapes[0][-1] >= 2


def _folding_linear(record: ModelRecord, name: str) -> bool:
    """A linear module called at this op site only: its weight folds the exponents of the codes it reads (§3.1), so
    it multiplies int8 (a module called at several sites, ALBERT's shared layer, has one weight for all of them)."""
    site = record.sites[name]
    return site.op_type == "linear" and site.is_module and sum(
        1 for other in record.sites.values() if other.is_module and other.module_name == site.module_name) == 1


def _reaching_a_norm(record: ModelRecord, sums: set[str]) -> set[str]:
    """The sums from which a norm is read through sums only: the stream's channels are the norm's normalized
    features. (A chain of sums that ends elsewhere, attention scores + position bias + mask before a softmax, has
    key positions on its last dim: never a stream, whose exponents would be tied to one sequence length.)"""
    reach: dict[str, bool] = {}

    def reaches(name: str) -> bool:
        if name not in reach:
            reach[name] = False  # (a cycle cannot occur in a record; this guards it anyway)
            reach[name] = any(record.sites[r].op_type in NORMS or (r in sums and reaches(r))
                              for r in _readers(record, name))
        return reach[name]

    return {name for name in sums if reaches(name)}


def stream_sites(record: ModelRecord) -> list[str]:
    """The residual stream's op sites, in execution order: the add / sub op sites whose output only sums and norms
    read (:data:`STREAM_READERS`); the linears whose output only those sums read (a block's output projection:
    a GEMM's requantize is per output channel, so it writes the form at no cost); and the LayerNorms whose output
    only sums, norms and linear modules read (a post-LN block's norm, read by the next block's projections and
    its residual add: the norm's gain per element writes the form, and each linear folds the exponents into its
    weight, int8 x int8); over a last dim of more than one channel."""
    candidates = {name for name, site in record.sites.items() if site.op_type in ("add", "sub") and _wide(site)
                  and (readers := _readers(record, name))
                  and all(record.sites[r].op_type in STREAM_READERS for r in readers)}
    sums = _reaching_a_norm(record, candidates)
    writers = {name for name, site in record.sites.items() if site.op_type == "linear" and _wide(site)
               and (readers := _readers(record, name)) and all(r in sums for r in readers)}
    norms = {name for name, site in record.sites.items() if site.op_type == "layer_norm" and _wide(site)
             and (readers := _readers(record, name))
             and all(record.sites[r].op_type in STREAM_READERS or _folding_linear(record, r) for r in readers)}
    return [name for name in record.sites if name in sums or name in writers or name in norms]


class ChannelExponentQconfigSetter(QconfigSetter):
    """The base setter's qconfigs with the int8 per-tensor output of ``sites`` (``None``: :func:`stream_sites`)
    quantized per channel of its last dim in channel-exponent form. Everything else is the base setter's; an op
    site the int16 search promotes later takes one int16 scale (``QuantSpec.with_dtype``)."""

    def __init__(self, sites: Iterable[str] | None = None, base_setter: Any = default_calibration_qconfig_setter):
        self.sites = None if sites is None else tuple(sites)
        self.base_setter = base_setter
        count = "stream" if self.sites is None else ", ".join(self.sites)
        self.name = f"channel_exponents({count}) > {getattr(base_setter, 'name', repr(base_setter))}"

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        result = resolve_qconfigs(self.base_setter, ctx)
        for site in stream_sites(ctx.record) if self.sites is None else self.sites:
            qconfig = result.qconfigs.get(site)
            if qconfig is None or qconfig.output is None:
                continue
            out = qconfig.output
            if out.dtype is QuantDType.qint8 and out.ch_axis is None:
                result.qconfigs[site] = qconfig.replace(output=replace(out, ch_axis=-1, channel_exponents=True))
        if self.sites is not None:
            for site in sorted(set(self.sites) - set(ctx.record.sites)):
                result.unmatched.append(unmatched_message("ChannelExponentQconfigSetter", site, ctx))
        return result


def has_stream_sites(record: ModelRecord) -> bool:
    """Whether the march has channel exponents and the model a residual stream's sum to give them."""
    return rules.max_channel_exponent() > 0 and bool(stream_sites(record))
