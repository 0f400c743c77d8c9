"""``quantlens sensitivity``: rank the quantizers of one stage pair by their effect on the outputs.

``quantlens sensitivity CONFIG.py --stage fake_quant|pre_export|export|convert`` builds the stages of a CONFIG
file; ``quantlens sensitivity QAT_IR.qlir QUANTIZED_IR.qlir`` ranks a saved pair (``convert``). onnxruntime runs the
whole graph, so it has no sensitivity.
"""

from __future__ import annotations

from pathlib import Path

from quantlens.cli._common import console, esc, existing_file, parent
from quantlens.cli._inputs import add_input_options, samples_for
from quantlens.cli.exits import EXIT_OK, UsageError

__all__ = ["add_parser", "run"]

STAGES = ["fake_quant", "pre_export", "export", "convert"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sensitivity", parents=[parent()], help="rank one stage pair's quantizers by their effect on the outputs",
        description="QuantAnalysis.sensitivity() for one stage pair: each quantizer (activation, weight, lookup "
        "table, or IR op site) switched on alone, most harmful first. Either a CONFIG.py with --stage, or a qat IR "
        "and its quantized IR (convert). The tables go to --out as output_<name>_<metric>_sensitive_ops.txt/.pt; "
        "the .pt feeds sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter.",
        epilog="Exit codes: 0 ok, 2 usage or bad input (e.g. --stage onnxruntime, a pair without quantizers).")
    p.add_argument("config", metavar="CONFIG.py|QAT_IR.qlir", help="a CONFIG file, or the qat IR")
    p.add_argument("quantized", metavar="QUANTIZED_IR.qlir", nargs="?", help="with a qat IR: its quantized IR")
    p.add_argument("--stage", choices=[*STAGES, "onnxruntime"], default="fake_quant",
                   help="with CONFIG.py: the stage pair (default fake_quant)")
    p.add_argument("--metric", default="L1", help="the metric to rank by (default L1)")
    p.add_argument("--top", type=int, default=10, help="rows printed per output (default 10; the files keep all)")
    p.add_argument("--out", default="quantlens_sensitivity", help="report folder (default ./quantlens_sensitivity)")
    add_input_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.table import Table

    from quantlens.profiler import QuantAnalysis

    out = console()
    if args.stage == "onnxruntime":
        raise UsageError("onnxruntime has no sensitivity (it runs the whole graph); rank the integer ops with "
                         "--stage convert.")
    first = Path(args.config)
    if first.suffix == ".qlir":
        from quantlens.compiler import load

        if not args.quantized:
            raise UsageError("with a qat IR, pass its quantized IR as well: quantlens sensitivity QAT_IR.qlir "
                             "QUANTIZED_IR.qlir")
        qat_ir = load(existing_file(args.config, "QAT_IR"))
        quantized = load(existing_file(args.quantized, "QUANTIZED_IR", (".qlir",)))
        qa = QuantAnalysis(qat_ir, quantized, "convert", out_dir=args.out)
        qa.auto_find_bad_case(samples_for(qat_ir, args))
    else:
        if args.quantized:
            raise UsageError("a second file is only taken after a qat IR (.qlir).")
        from quantlens import set_march
        from quantlens.cli.analyze import UPTO
        from quantlens.cli.config import load_config
        from quantlens.cli.pipeline import PAIRS, build_stages

        cfg = load_config(first, debug=args.debug or args.sub_debug)
        if cfg.march is not None:
            set_march(cfg.march)
        example = cfg.example_inputs()
        out_dir = Path(args.out)
        with out.status("building the stages"):
            stages = build_stages(cfg.float_model(), example, cfg.calibration_data, cfg.calibration_qconfig_setter,
                                  qat_qconfig_setter=cfg.qat_qconfig_setter, train_qat=cfg.train_qat,
                                  upto=UPTO[args.stage], out_dir=out_dir, dynamic_batch=cfg.dynamic_batch,
                                  allow_no_stubs=cfg.allow_no_stubs)
        base, analy = (getattr(stages, n) for n in PAIRS[args.stage])
        qa = QuantAnalysis(base, analy, args.stage, out_dir=out_dir, post_process=cfg.post_process)
        qa.auto_find_bad_case((cfg.evaluation_data or cfg.calibration_data)(), num_steps=cfg.num_steps)
    result = qa.sensitivity(metric=args.metric)
    for table in result:
        t = Table(title=f"output {esc(table.output)}: most sensitive first ({args.metric})")
        for col in ("#", "op site", "type", "op", "dtype", args.metric):
            t.add_column(col, justify="right" if col in ("#", args.metric) else "left")
        for i, row in enumerate(table[: args.top]):
            t.add_row(str(i), esc(row.op_name), esc(row.sensitive_type), esc(row.op_type), esc(row.quant_dtype),
                      f"{row.value:.6g}")
        out.print(t)
    out.print(f"tables in {args.out}/ (output_<name>_{args.metric}_sensitive_ops.txt/.pt)")
    return EXIT_OK
