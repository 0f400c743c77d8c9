"""Abnormal-layer advisor: rules over the per-layer comparison, each finding with advice.

One rule is one small function ``rule(ctx) -> list[Finding]`` in :data:`RULES`, which :func:`advise` runs in
order; the thresholds are constants of :mod:`.base`, documented in ``docs/profiler.md`` and repeated in the
report header.

* :mod:`.base`: the thresholds, :class:`Finding`, :class:`AdvisorContext` and the rules' shared helpers;
* :mod:`.baseline`: what the baseline itself gets wrong (a float model that computes differently as the user runs
  it) and values an op reads that are not its data (an index input that differs between the two models);
* :mod:`.general`: the rules for every analysis type;
* :mod:`.per_channel`: per-tensor weights that crush some of an op's output channels (the per-channel figures);
* :mod:`.deployed`: the rules of ``pre_export``'s tables and of the integer stages (``export``, ``convert``);
* :mod:`.consistency`: ``consistency_level``, the ``ConsistencyStrategy`` level that removes ``convert``'s
  mismatches (rounding only; a difference beyond it is ``integer_op_differs``, which names the mechanism);
* :mod:`.runtime`: the ``onnxruntime`` pair: where onnxruntime starts to compute something else, and why.

Advice fits the stage and the op: rules are keyed by analysis type, and :func:`.base.op_role` (from the op set)
decides what a finding may suggest (weights only for an op with weights, table advice only for a table op).
"""

from __future__ import annotations

from typing import Callable

from quantlens._registry import make_registry
from quantlens.profiler.advisor import baseline, consistency, deployed, general, per_channel, runtime
from quantlens.profiler.advisor.base import THRESHOLDS, AdvisorContext, Finding, Rule, Severity

__all__ = ["Finding", "Severity", "AdvisorContext", "RULES", "register_rule", "advise", "THRESHOLDS"]

#: every rule by name, in the order :func:`advise` runs them: the built-in ones, then those added by
#: :func:`register_rule`
RULES: dict[str, Rule] = {**baseline.RULES, **general.RULES, **per_channel.RULES, **deployed.RULES, **consistency.RULES,
                           **runtime.RULES}


def register_rule(name: str) -> Callable[[Rule], Rule]:
    """A decorator adding a rule ``(AdvisorContext) -> list[Finding]`` to :data:`RULES` under ``name`` (a
    built-in rule's name replaces that rule)."""
    return make_registry("advisor rule", table=RULES, replace=True)[1](name)


def advise(ctx: AdvisorContext, rules: dict[str, Rule] | None = None) -> list[Finding]:
    """Every finding of every rule, rule by rule in registry order, rows in execution order."""
    findings: list[Finding] = []
    for rule in (rules or RULES).values():
        findings.extend(rule(ctx))
    return findings
