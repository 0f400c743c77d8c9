"""Experiment for issue #25 deliverable 2: can ``torch.compile`` (inductor, CPU) make the quantized IR run at the
speed of the float forward, bit-exact?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compiled_simulator.py [--models digits_cnn,tiny_transformer]
                                                                            [--no-vectorize] [--repeat 10]

For each zoo model (batch 32, int8 calibration, 1 torch thread) the quantized IR's interpreter run is traced to
one aten graph with ``make_fx`` (real tensors: the integer kernels' caches are warmed first, so prepared weights and
requantize parameters are constants of the graph; the interpreter's embedding id check, which reads the data, is
left out of the traced function) and compiled by inductor. It prints the float forward, the interpreter, the
traced graph run eagerly and the compiled graph (best of ``--repeat``), whether the compiled outputs equal the
interpreter's bit for bit, and the compile time.

This is a measurement, not a product path: a ``make_fx`` trace with real tensors bakes in every branch a kernel
takes on the traced data (fast paths chosen from the data's bounds), so a compiled graph is only valid for inputs
that take the same branches; tracing with fake tensors stops at those branches instead
(``GuardOnDataDependentSymNode``). A compile error is printed, not raised.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def _best(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(name: str, repeat: int, vectorize: bool) -> str:
    from torch.fx.experimental.proxy_tensor import make_fx

    import quantlens.compiler.interpreter as interpreter
    from quantlens.compiler import convert, export
    from quantlens.compiler.interpreter import run_graph
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
    from quantlens.zoo import example_inputs, get_model, sample_batches

    model = get_model(name)
    batch = sample_batches(name, 1, 32)[0]
    prepared = prepare(model, example_inputs(name), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, sample_batches(name, 3, 8))
    int_ir = convert(export(prepared, batch))

    # the IR's inputs are the tensor leaves of the call's arguments (dicts and lists flattened), in order
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    assert len(leaves) == len(int_ir.graph.inputs), (len(leaves), int_ir.graph.inputs)

    def run(*xs):
        return run_graph(int_ir, dict(zip(int_ir.graph.inputs, xs)))

    reference = run(*leaves)  # also warms the kernels' caches
    checked = interpreter.QAT_KERNELS["embedding"]
    interpreter.QAT_KERNELS["embedding"] = lambda node, inputs: torch.nn.functional.embedding(inputs[1], inputs[0])
    try:
        traced = make_fx(run, tracing_mode="real")(*leaves)
    finally:
        interpreter.QAT_KERNELS["embedding"] = checked
    import torch._inductor.config as inductor_config

    inductor_config.cpp.vec_isa_ok = vectorize
    start = time.perf_counter()
    compiled = torch.compile(traced)
    try:
        out = compiled(*leaves)
    except Exception as exc:  # noqa: BLE001 - an experiment: report the compiler's failure and go on
        return f"{name:18s} compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    compile_s = time.perf_counter() - start
    exact = all(torch.equal(a, b) for a, b in zip(reference, out))
    with torch.no_grad():
        t_float = _best(lambda: model(*batch), repeat)
    t_int = _best(lambda: run(*leaves), repeat)
    t_graph = _best(lambda: traced(*leaves), repeat)
    t_comp = _best(lambda: compiled(*leaves), repeat)
    return (f"{name:18s} {len(traced.graph.nodes):6d} {t_float:9.3f} {t_int:9.3f} {t_graph:9.3f} {t_comp:9.3f} "
            f"{t_int / t_float:8.2f} {t_comp / t_float:8.2f} {str(exact):>6s} {compile_s:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits_cnn,tiny_resnet,tiny_transformer,multitask,detector_postprocess")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-vectorize", action="store_true", help="inductor's scalar C++ loops (no SIMD)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"batch 32, best of {args.repeat}, {torch.get_num_threads()} thread(s), inductor "
          f"{'scalar' if args.no_vectorize else 'vectorized'}")
    print(f"{'model':18s} {'nodes':>6s} {'float ms':>9s} {'interp ms':>9s} {'graph ms':>9s} {'compiled':>9s} "
          f"{'interp/f':>8s} {'comp/f':>8s} {'exact':>6s} {'compile s':>8s}")
    for name in args.models.split(","):
        print(measure(name, args.repeat, not args.no_vectorize), flush=True)


if __name__ == "__main__":
    main()
