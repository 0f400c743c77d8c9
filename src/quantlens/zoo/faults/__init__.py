"""A suite of planted faults: for each stage pair, models with one known culprit, and the rank each of the
profiler's methods gives it (issue #23's acceptance suite; ``tests/test_fault_suite.py`` runs it,
``benchmarks/bench_fault_suite.py`` prints the table of ``docs/fault_suite.md``).

A :class:`Fault` builds its two models and bad case (:class:`FaultCase`); :func:`rank_fault` runs
``QuantAnalysis`` on them and returns :class:`FaultRanks`: per method, the 1-based rank of the culprit (None: not
ranked by that method, or the method does not apply to the stage pair). The methods:

* ``same_input``: the per-layer table ranked by same-input SQNR (what the op adds by itself);
* ``worst_channel``: ranked by the worst channel's same-input SQNR (per-channel damage);
* ``sensitivity``: one quantizer at a time (``sensitivity()``), the best rank over the outputs;
* ``op_sensitivity``: one op at a time, every quantizer its integer kernel depends on (``joint_sensitivity()``);
* ``pair_sensitivity``: pairs of the top candidates; ranks an interaction fault's culprit (the pair holding both
  of its ops; other faults: not applicable);
* ``accumulated_jump`` (``onnxruntime``, which has no same-input or sensitivity): the ops where the accumulated
  error jumps beyond rounding while their producer's was within it, in execution order;
* ``advisor``: whether a finding names the culprit (1) or not (None), with the rules that fired there.

Faults register with :func:`register_fault`; :data:`FAULTS` holds them by name (:mod:`.registry`, which each
fault module imports; this package imports the fault modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from quantlens.profiler import QuantAnalysis
from quantlens.zoo.faults.registry import FAULTS, Fault, FaultCase, register_fault

__all__ = ["Fault", "FaultCase", "FaultRanks", "FAULTS", "register_fault", "rank_fault", "METHODS"]

METHODS = ("same_input", "worst_channel", "sensitivity", "op_sensitivity", "pair_sensitivity", "accumulated_jump",
           "advisor")


@dataclass(frozen=True)
class FaultRanks:
    """The culprit's rank by each method (1 = first; None: not ranked or not applicable) and the advisor's rules
    that named it."""

    fault: str
    stage: str
    model: str
    culprit: tuple[str, ...]
    ranks: dict[str, int | None] = field(default_factory=dict)
    advisor_rules: tuple[str, ...] = ()

    @property
    def best(self) -> int | None:
        found = [r for r in self.ranks.values() if r is not None]
        return min(found) if found else None

    @property
    def sensitivity_best(self) -> int | None:
        found = [self.ranks.get(k) for k in ("sensitivity", "op_sensitivity", "pair_sensitivity")]
        found = [r for r in found if r is not None]
        return min(found) if found else None


def _rank(names: list[str], culprit: tuple[str, ...]) -> int | None:
    """1-based position of the first name that is one of the culprit's sites (distinct names counted once)."""
    seen: list[str] = []
    for name in names:
        if name not in seen:
            seen.append(name)
        if name in culprit:
            return len(seen)
    return None


def _table_ranks(table, culprit: tuple[str, ...]) -> dict[str, int | None]:
    out = {}
    for method, column in (("same_input", "same_input_sqnr"), ("worst_channel", "same_input_worst_channel_sqnr")):
        rows = [r for r in table.ranked(column) if getattr(r, column, None) is not None]
        out[method] = _rank([r.op_name for r in rows], culprit) if rows else None
    return out


def _site(member: str) -> str:
    return member.rsplit(":", 1)[0]


def _joint_ranks(joint, culprit: tuple[str, ...], interaction: tuple[str, ...]) -> dict[str, int | None]:
    op_ranks, pair_ranks = [], []
    for table in joint:
        op_ranks.append(_rank([r.op_name for r in table.op_rows], culprit))
        for pos, row in enumerate(table.pair_rows, 1):
            sites = {_site(m) for m in row.members}
            if interaction and set(interaction) <= sites:  # pairs rank interactions only
                pair_ranks.append(pos)
                break
    best = [r for r in op_ranks if r is not None]
    return {"op_sensitivity": min(best) if best else None, "pair_sensitivity": min(pair_ranks) if pair_ranks else None}


def rank_fault(fault: Fault, out_dir: str | Path, pairs: int = 4) -> FaultRanks:
    """Build ``fault``, analyse it with every method of its stage pair and return the culprit's ranks."""
    case = fault.build()
    qa = QuantAnalysis(case.baseline, case.analysis, fault.stage, out_dir=out_dir, post_process=case.post_process,
                       progress=False)
    qa.set_bad_case(case.bad_case)
    qa.run()
    table = qa.compare_per_layer()
    findings = qa.advise(table)
    ranks = _table_ranks(table, fault.culprit) if fault.stage != "onnxruntime" else \
        {"same_input": None, "worst_channel": None}
    if fault.stage == "onnxruntime":
        jumps = [f.op_name for f in findings if f.rule == "onnxruntime_op_differs"]
        ranks.update(sensitivity=None, op_sensitivity=None, pair_sensitivity=None,
                     accumulated_jump=_rank(jumps, fault.culprit))
    else:
        sens = qa.sensitivity()
        found = [_rank([r.op_name for r in t], fault.culprit) for t in sens]
        found = [r for r in found if r is not None]
        ranks["sensitivity"] = min(found) if found else None
        ranks.update(_joint_ranks(qa.joint_sensitivity(pairs=pairs), fault.culprit, fault.interaction))
        ranks["accumulated_jump"] = None
    rules = tuple(dict.fromkeys(f.rule for f in findings if f.op_name in fault.culprit))
    ranks["advisor"] = 1 if rules else None
    return FaultRanks(fault.name, fault.stage, fault.model, fault.culprit, ranks, rules)


# the built-in faults register themselves
from quantlens.zoo.faults import minilm, tiny, unseen  # noqa: E402,F401
