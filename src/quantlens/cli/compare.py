"""``quantlens compare A.qlir B.qlir|model.onnx``: compare two deployed artefacts op site by op site.

A qat IR vs its quantized IR is analysis type ``convert``; a qat IR vs its ONNX file is ``onnxruntime``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

from quantlens.cli._common import console, esc, existing_file, parent
from quantlens.cli._inputs import add_input_options, samples_for
from quantlens.cli.exits import EXIT_OK, EXIT_PROBLEMS, UsageError

__all__ = ["add_parser", "run", "pair_type"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compare", parents=[parent()], help="compare a qat IR with its quantized IR or its ONNX file",
        description="Compare two deployed stages of one model with QuantAnalysis: a qat IR (export) with the "
        "quantized IR convert made from it (analysis type 'convert'), or with the ONNX file to_onnx wrote from it, "
        "run by onnxruntime ('onnxruntime'). Prints the LSB verdicts, the first diverged and first inexact op, and "
        "writes the reports into --out.",
        epilog="Exit codes: 0 no op diverged and no advisor finding, 1 an op diverged (more than 4 LSB) or the "
        "advisor reported abnormal layers, 2 usage or bad input (files missing, not a qat IR first, ...).")
    p.add_argument("a", metavar="A.qlir", help="the qat IR (quantlens.compiler.export, saved with save)")
    p.add_argument("b", metavar="B.qlir|model.onnx", help="its quantized IR (convert) or its ONNX file (to_onnx)")
    p.add_argument("--out", default="quantlens_compare", help="report folder (default ./quantlens_compare)")
    add_input_options(p)
    p.set_defaults(func=run)


def pair_type(a, b_path: Path) -> str:
    if a.kind != "qat":
        raise UsageError(f"A must be a qat IR (export's output); it is a {a.kind} IR. Usage: quantlens compare "
                         "QAT_IR.qlir QUANTIZED_IR.qlir|MODEL.onnx")
    if b_path.suffix == ".onnx":
        from quantlens.cli.pipeline import onnxruntime_available

        if not onnxruntime_available():
            raise UsageError("comparing with an ONNX file needs onnx and onnxruntime: pip install 'quantlens[onnx]'.")
        return "onnxruntime"
    return "convert"


def _check_made_from(a, a_path: Path, b, b_path: Path) -> None:
    """B was converted from A: refused, naming both files, when B records another qat IR's digest; a warning
    naming B when it records none (QuantAnalysis checks the pair again: its own warning is then left out)."""
    from quantlens.compiler.provenance import SOURCE_DIGEST_KEY, check_source
    from quantlens.errors import QuantLensWarning

    warning = check_source(b.meta.get(SOURCE_DIGEST_KEY), a, who="quantlens compare",
                           derived=f"B, the quantized IR '{b_path}',", source_name=str(a_path),
                           remake="quantlens.compiler.convert(qat_ir) and save")
    if warning:
        warnings.warn(warning, QuantLensWarning, stacklevel=2)


def run(args) -> int:
    from rich.table import Table

    from quantlens.compiler import load
    from quantlens.errors import QuantLensWarning
    from quantlens.profiler import QuantAnalysis

    out = console()
    a_path = existing_file(args.a, "A", (".qlir",))
    b_path = existing_file(args.b, "B", (".qlir", ".onnx"))
    a = load(a_path)
    kind = pair_type(a, b_path)
    b = str(b_path) if kind == "onnxruntime" else load(b_path)
    if kind == "convert" and b.kind != "quantized":
        raise UsageError(f"B must be the quantized IR (convert(qat_ir)) or an .onnx file; {args.b} is a {b.kind} IR.")
    if kind == "convert":
        _check_made_from(a, a_path, b, b_path)
    with warnings.catch_warnings():
        if kind == "convert":  # compare warned for an unrecorded quantized IR already, naming its file
            warnings.filterwarnings("ignore", message=".*records no digest of the qat IR", category=QuantLensWarning)
        qa = QuantAnalysis(a, b, kind, out_dir=args.out)
    qa.auto_find_bad_case(samples_for(a, args))
    qa.run()
    table = qa.compare_per_layer()
    findings = qa.advise(table)
    summary = table.lsb_summary() or {}
    t = Table(title=f"{kind}: {a_path.name} vs {b_path.name}")
    for col in ("verdict", "accumulated", "same input"):
        t.add_column(col, justify="left" if col == "verdict" else "right")
    acc, same = Counter(summary.get("accumulated") or {}), Counter(summary.get("same_input") or {})
    for verdict in ("bit-exact", "within 1 LSB", "within 4 LSB", "diverged"):
        t.add_row(verdict, str(acc.get(verdict, 0)), str(same.get(verdict, 0)))
    out.print(t)
    out.print(f"first diverged (> 4 LSB): {esc(summary.get('first_diverged'))}")
    same_input = any(row.same_input_cosine is not None for row in table)
    first_inexact = summary.get("first_inexact") if same_input else "(no same-input data)"
    out.print(f"first inexact (own kernel not bit-exact): {esc(first_inexact)}")
    if table.only_in_baseline:
        out.print(f"only in A: {esc(', '.join(f'{n} ({t})' for n, t in table.only_in_baseline))}")
    for f in findings:
        tag = "" if f.is_problem else f" ({f.severity})"
        out.print(f"[yellow]{esc(f.rule)}{tag}[/] {esc(f.op_name)}: {esc(f.info)}")
    out.print(f"reports in {args.out}/ (profiler.html, compare_per_layer_out.txt/.csv, abnormal_layer_advisor.txt)")
    # advice (the model behaves as built, e.g. rounding at consistency off) is listed, not a problem
    return EXIT_PROBLEMS if any(f.is_problem for f in findings) or summary.get("first_diverged") else EXIT_OK
