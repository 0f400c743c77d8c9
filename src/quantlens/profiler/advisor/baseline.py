"""Rules on what the comparison's inputs get wrong before any op rounds: a float baseline that is not the model the
user runs, and an op that reads another index in each model."""

from __future__ import annotations

from quantlens.profiler.advisor.base import AdvisorContext, Finding, Rule, finding, registrar

__all__ = ["RULES"]

RULES: dict[str, Rule] = {}
_rule = registrar(RULES)


@_rule("float_model_branch")
def float_model_branch(ctx: AdvisorContext) -> list[Finding]:
    """The float model takes another branch under export than as the user runs it (``profiler.eager_check``):
    every stage pair compares against the export branch, which the user's own float evaluation never runs."""
    div = ctx.eager
    if div is None:
        return []
    return [Finding(
        "float_model_branch", div.site, div.op_type, div.words(),
        "quantlens traces every forward with torch.compiler.is_exporting() True, as torch.export does, so every "
        "stage pair (and the deployed model) computes the export branch, not the one your float evaluation runs: "
        f"look at the code around op site '{div.site}' for an is_exporting() / is_compiling() branch (a library's "
        "fast path, a mask built another way) and make both branches compute the same, or evaluate the float model "
        "under the export branch, before reading any figure of this analysis as quantization loss",
    )]


@_rule("index_input_differs")
def index_input_differs(ctx: AdvisorContext) -> list[Finding]:
    """An op that reads an index (gather, index_select, embedding) gets another index in each model: it then
    moves other values, a loss no precision of its own explains and int16 for its data does not fix."""
    out = []
    for row in ctx.comparison:
        if not row.index_differs:
            continue
        maker = f"'{row.index_producer}'" if row.index_producer else "ops made inside forward"
        out.append(finding(
            "index_input_differs", row,
            f"the index input of '{row.op_name}' differs between the two models ({row.index_differs}): it moves "
            f"other values than the baseline's, whatever its own precision; the index is made by {maker}",
            f"keep the arithmetic that makes the index exact: {maker} and the ops before it compute on quantized "
            "values here; compute the index from integer values (positions, ids) or in float on the host (a "
            "qconfig of None for those op sites, or the index computed before the QuantStub), or give its source "
            f"int16 where the index comes from a ranking (topk / argmax of scores); int16 for the data of "
            f"'{row.op_name}' does not change which values it moves",
        ))
    return out
