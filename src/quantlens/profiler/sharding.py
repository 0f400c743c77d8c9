"""Sharded, resumable sensitivity: the quantizers split over the processes of a ``torch.distributed`` group.

Rank ``r`` of ``world_size`` ablates the quantizers ``i`` (execution order) with ``i % world_size == r``, exactly
like :func:`.sensitivity.run_sensitivity` (the same :class:`.sensitivity.AblationPlan`: shared forwards where its
quantizers reach disjoint outputs, else :func:`.sensitivity.ablate_one`), and appends each finished
value to ``<out_dir>/sensitivity_progress/rank<r>.jsonl`` (one JSON line, flushed and fsynced). The values are
collected with ``all_gather_object``; every rank builds the same :class:`.sensitivity.SensitivityResult`
(:func:`.sensitivity.build_result`: the single-process table, value for value).

Resume: on start every rank reads every ``rank*.jsonl`` whose header line (format, metric, analysis type, bad-case
digest, model digests, quantizer list) equals this run's; finished quantizers are not recomputed, whatever the
world size of the interrupted run. Files with another header are ignored and then replaced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from quantlens._io import atomic_write_text
from quantlens.errors import QuantLensError
from quantlens.profiler.fingerprint import callable_digest, model_digest
from quantlens.profiler.metrics import get_metric
from quantlens.profiler.model_access import AnalysisType, ModelAccess
from quantlens.profiler.outputs import PostProcess
from quantlens.profiler.progress import progress_iter
from quantlens.profiler.sensitivity import (
    AblationPlan,
    SensitivityResult,
    ablation_runner,
    build_result,
    sensitivity_setup,
)
from quantlens.profiler.trace.stats import input_digest

__all__ = ["PROGRESS_DIR", "dist_rank_world", "run_sharded_sensitivity"]

PROGRESS_DIR = "sensitivity_progress"
FORMAT = "quantlens-sensitivity-progress/2"  # 2: exact model digests (IR graph and constants), post_process


def dist_rank_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default ``torch.distributed`` group, or None when it is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _header(metric: str, analysis_type: AnalysisType, example: Any, baseline: ModelAccess, analysis: ModelAccess,
            quantizers: list, outputs: list[str], post_process: PostProcess) -> dict:
    """What the progress file's values depend on: the bad case, both models (every byte of their state; an IR's
    graph and constants), the post-process (its code), the metric and the quantizers."""
    header = {"format": FORMAT, "metric": metric, "analysis_type": analysis_type.value,
              "bad_case": input_digest(example), "baseline": model_digest(baseline, exact=True),
              "analysis": model_digest(analysis, exact=True), "outputs": outputs,
              "post_process": callable_digest(post_process.func),
              "quantizers": [[q.op_name, q.sensitive_type, q.op_type, q.quant_dtype] for q in quantizers]}
    return json.loads(json.dumps(header))  # the form it has once read back


def _read_progress(directory: Path, header: dict, quantizers: list) -> dict[int, dict[str, float]]:
    """Finished values of every progress file in ``directory`` whose header equals ``header``."""
    done: dict[int, dict[str, float]] = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        try:
            if not lines or json.loads(lines[0]) != header:
                continue
        except ValueError:
            continue
        for line in lines[1:]:
            try:
                entry = json.loads(line)
                i, values = entry["i"], entry["values"]
                q = quantizers[i]
                if [entry["op_name"], entry["sensitive_type"]] != [q.op_name, q.sensitive_type] or \
                        list(values) != header["outputs"]:
                    continue
            except (ValueError, KeyError, IndexError, TypeError):
                continue  # a line cut by the interruption
            done[i] = {name: float(v) for name, v in values.items()}
    return done


def _entry(i: int, q, values: dict[str, float]) -> str:
    return json.dumps({"i": i, "op_name": q.op_name, "sensitive_type": q.sensitive_type, "values": values})


def run_sharded_sensitivity(
    baseline: ModelAccess,
    analysis: ModelAccess,
    analysis_type: AnalysisType,
    example: Any,
    post_process: PostProcess,
    out_dir: str | os.PathLike,
    metric: str = "L1",
    reverse: bool = False,
    progress: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
) -> SensitivityResult:
    """This rank's share of the ablation, resumed from ``out_dir/sensitivity_progress``, then gathered.

    ``rank``/``world_size`` default to the initialised ``torch.distributed`` group's (else 0 and 1: a
    single process that still records and resumes its progress). Every rank returns the same result."""
    import torch.distributed as dist

    group = dist_rank_world()
    if rank is None or world_size is None:
        rank, world_size = group if group is not None else (0, 1)
    distributed = group is not None and world_size > 1
    m = get_metric(metric)
    base, recorder, quantizers = sensitivity_setup(baseline, analysis, analysis_type, example, post_process)
    header = _header(m.name, analysis_type, example, baseline, analysis, quantizers, list(base), post_process)
    directory = Path(out_dir) / PROGRESS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    done = _read_progress(directory, header, quantizers)
    mine = [i for i in range(len(quantizers)) if i % world_size == rank]
    if distributed:
        dist.barrier()  # every rank has read the old progress before any file is replaced
    path = directory / f"rank{rank}.jsonl"
    atomic_write_text(path, "\n".join([json.dumps(header)] + [_entry(i, quantizers[i], done[i])
                                                               for i in mine if i in done]) + "\n")
    if distributed:
        dist.barrier()  # every rank has carried over its finished values
    if rank == 0:  # progress of a run with more ranks: its values now live in the files above
        for stale in directory.glob("rank*.jsonl"):
            suffix = stale.name[len("rank"):-len(".jsonl")]
            if not (suffix.isdigit() and int(suffix) < world_size):
                stale.unlink(missing_ok=True)
    todo = [i for i in mine if i not in done]
    with analysis.ablation(analysis_type) as enable, open(path, "a", encoding="utf-8") as handle:
        runner = ablation_runner(analysis, analysis_type, example, recorder) if todo else None
        # this rank's quantizers share ablation forwards as in one process (their effects reach disjoint outputs)
        plan = AblationPlan(analysis, enable, runner, quantizers, todo, example, post_process, recorder, base, m)
        for group in progress_iter(plan.groups, f"sensitivity ({m.name}, rank {rank}/{world_size})",
                                   total=len(todo), enabled=progress and rank == 0, steps=len):
            for i, values in plan.ablate(group).items():
                done[i] = values
                handle.write(_entry(i, quantizers[i], values) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    local = {i: done[i] for i in mine}
    if distributed:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    merged: dict[int, dict[str, float]] = {}
    for part in gathered:
        merged.update(part)
    missing = [i for i in range(len(quantizers)) if i not in merged]
    if missing:
        raise QuantLensError(f"sharded sensitivity(): no value for {len(missing)} quantizer(s) (first "
                             f"'{quantizers[missing[0]].op_name}'); rank {rank} of {world_size} got a partial gather.")
    values = {name: [merged[i][name] for i in range(len(quantizers))] for name in base}
    return build_result(quantizers, values, m, reverse, recorder.table_errors)
