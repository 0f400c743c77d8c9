"""Rules on what the comparison's inputs get wrong before any op rounds: a float baseline that is not the model the
user runs, and an op that reads another index in each model."""

from __future__ import annotations

from quantlens.profiler.advisor.base import AdvisorContext, Finding, Rule, registrar

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
