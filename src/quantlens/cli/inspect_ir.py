"""``quantlens inspect MODEL.qlir``: what a saved IR is, how to call it, its graph and its cost."""

from __future__ import annotations

from quantlens.cli._common import console, esc, existing_file, parent
from quantlens.cli.exits import EXIT_OK

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect", parents=[parent()], help="show a saved IR's statistics, input contract, graph and latency",
        description="Load an IR file written by quantlens.compiler.save and print: its kind (qat / quantized) and "
        "meta, the input contract (Module.describe_call(): what a call must pass; docs/ir.md, 'Calling an IR'), "
        "the op statistics (Module.statistics()), the graph node by node with the op site each node implements, "
        "and for a quantized IR the march cost model's latency estimate (Module.latency_estimate()).",
        epilog="Exit codes: 0 ok, 2 the file is missing, damaged or not an IR.")
    p.add_argument("model", metavar="MODEL.qlir", help="an IR file written by quantlens.compiler.save")
    p.add_argument("--no-graph", action="store_true", help="leave out the node-by-node graph")
    p.add_argument("--batch", type=int, default=1, help="batch size of the latency estimate (default 1)")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.table import Table

    from quantlens.compiler import load

    out = console()
    module = load(existing_file(args.model, "MODEL"))
    g = module.graph
    out.print(f"[bold]{esc(args.model)}[/]: {module.kind} IR, {len(g.nodes)} nodes, inputs {esc(g.inputs)} -> "
              f"outputs {esc(g.outputs)}")
    for key, value in sorted(module.meta.items()):
        out.print(f"  meta {esc(key)}: {esc(value)}")
    out.print("[bold]input contract[/] (each call is checked against it):")
    out.print(f"  {esc(module.describe_call())}")
    for name in g.inputs:
        info = g.values.get(name)
        if info is not None:
            dims = ", ".join("N" if d == -1 else str(d) for d in info.shape)
            out.print(esc(f"  {name}: [{dims}] {info.dtype}") + (" (N: any batch size)" if -1 in info.shape else ""))

    stats = Table(title="statistics (Module.statistics())")
    stats.add_column("op")
    stats.add_column("count", justify="right")
    for key, value in module.statistics().items():
        stats.add_row(esc(key), str(value))
    out.print(stats)

    if not args.no_graph:
        graph = Table(title="graph: node, op, op site, where it runs, output type")
        for col in ("#", "outputs", "op", "inputs", "op site", "runs on", "output"):
            graph.add_column(col, justify="right" if col == "#" else "left")
        for i, node in enumerate(g.nodes):
            info = g.values.get(node.outputs[0]) if node.outputs else None
            kind = "" if info is None else f"{list(info.shape)} {info.qdtype or info.dtype}"
            graph.add_row(str(i), esc(", ".join(node.outputs)), esc(node.op),
                          esc(", ".join(n for n in node.inputs if n and n not in g.constants) or "-"),
                          esc(_site(node)), "host" if node.attrs.get("host") else "npu", esc(kind))
        out.print(graph)

    if module.kind == "quantized":
        est = module.latency_estimate(args.batch)
        lat = Table(title=f"latency estimate (batch {args.batch}): {est.cycles} cycles, {est.microseconds:.2f} us")
        lat.add_column("op")
        lat.add_column("cycles", justify="right")
        for op, cycles in sorted(est.by_op.items(), key=lambda kv: -kv[1]):
            lat.add_row(esc(op), str(cycles))
        out.print(lat)
        out.print(f"requantize ops: {est.requantize_ops} ({est.shift_only_ops} shift-only)")
        host = sorted({n.site for n in g.nodes if n.attrs.get("host") and n.site})
        unnamed = sum(1 for n in g.nodes if n.attrs.get("host") and not n.site)  # (an op on a host op's result)
        out.print(f"host ops (float, docs/march.md §12.1): {len(host)} op site(s){': ' if host else ''}"
                  f"{esc(', '.join(host[:12]))}{' ...' if len(host) > 12 else ''}"
                  f"{f' and {unnamed} node(s) of no op site' if unnamed else ''}; {est.host_cycles} cycles, "
                  f"{est.crossings} NPU-host crossing(s) {est.crossing_cycles} cycles; MACs on the NPU: "
                  f"{100 * est.npu_mac_share:.1f} %")
    else:
        out.print("latency estimate: only for a quantized IR (convert(qat_ir)); this is a qat IR.")
    return EXIT_OK


def _site(node) -> str:
    """The node's op site, and the fused member whose grid it writes (the site the reports name its value by)."""
    into = node.attrs.get("output_site")
    return f"{node.site} (fused into {into})" if into and into != node.site else node.site
