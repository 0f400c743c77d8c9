"""Sharded sensitivity: 2 torchrun processes (gloo) give the single-process tables exactly; progress resumes.

Run as a script (``torchrun --nproc_per_node=2 tests/test_profiler_sharded_sensitivity.py OUT RESULT METRICS``)
this file is the worker of the tests below.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantlens.profiler import QuantAnalysis
from quantlens.profiler.outputs import PostProcess
from quantlens.profiler.sharding import PROGRESS_DIR
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization import prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches

NAME = "digits_cnn"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def make_qa(out_dir):
    model = get_model(NAME)
    calib = prepare(model, example_inputs(NAME), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches(NAME, 3, 8))
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=out_dir, progress=False)
    qa.set_bad_case(example_inputs(NAME, 8))
    return qa


def count_forwards(qa, stop_after=None):
    """Count the analysis model's forwards (one per ablated quantizer); raise after ``stop_after`` of them."""
    run, calls = qa.analysis.run, []

    def counted(*args, **kwargs):
        if stop_after is not None and len(calls) >= stop_after:
            raise KeyboardInterrupt("interrupted on purpose")
        calls.append(1)
        return run(*args, **kwargs)

    qa.analysis.run = counted
    return calls


def rows(result):
    return [[table.key, [row.to_dict() for row in table]] for table in result]


def worker(out_dir, result_dir, metrics):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    qa = make_qa(out_dir)
    calls = count_forwards(qa)
    got = {metric: rows(qa.sensitivity(metric=metric)) for metric in metrics.split(",")}  # shard: automatic
    Path(result_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps({"forwards": len(calls), "rows": got}))
    dist.barrier()  # leave together: a gloo peer that exits while the other still talks aborts it
    dist.destroy_process_group()


def torchrun(out_dir, result_dir, metrics):
    result_dir.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", __file__, str(out_dir),
                           str(result_dir), metrics], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    qa = make_qa(out)
    return out, {metric: rows(qa.sensitivity(metric=metric)) for metric in ("L1", "Cosine")}


pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not in the environment")


def test_two_ranks_gather_the_single_process_tables(reference, tmp_path):
    ref_dir, ref = reference
    ranks = torchrun(tmp_path / "out", tmp_path / "res", "L1,Cosine")
    n = len(ref["L1"][0][1])
    assert [r["forwards"] for r in ranks] == [2 * ((n + 1) // 2), 2 * (n // 2)]  # two metrics, i % 2 == rank
    for r in ranks:
        assert r["rows"] == ref  # names, order, values (JSON floats round-trip exactly)
    for metric in ("L1", "Cosine"):  # rank 0's report files are byte-identical to the single-process ones
        for suffix in ("txt", "pt"):
            name = f"output_0_{metric}_sensitive_ops.{suffix}"
            assert (tmp_path / "out" / name).read_bytes() == (ref_dir / name).read_bytes()
    # progress of the latest (Cosine) run: header plus this rank's quantizers
    lines = [(tmp_path / "out" / PROGRESS_DIR / f"rank{r}.jsonl").read_text().splitlines() for r in range(2)]
    assert [len(x) - 1 for x in lines] == [(n + 1) // 2, n // 2]
    assert json.loads(lines[0][0])["metric"] == "Cosine"


def test_interrupted_run_resumes_on_two_ranks(reference, tmp_path):
    _, ref = reference
    out = tmp_path / "out"
    qa = make_qa(out)
    calls = count_forwards(qa, stop_after=4)
    with pytest.raises(KeyboardInterrupt):
        qa.sensitivity(metric="L1", shard=True)  # one process, resumable; stops after 4 quantizers
    assert len(calls) == 4 and not (out / "output_0_L1_sensitive_ops.txt").exists()
    progress = out / PROGRESS_DIR / "rank0.jsonl"
    assert len(progress.read_text().splitlines()) == 1 + 4
    with progress.open("a") as handle:
        handle.write('{"i": 7, "op_name": "cut')  # a line cut by the interruption is ignored
    ranks = torchrun(out, tmp_path / "res", "L1")
    n = len(ref["L1"][0][1])
    assert sum(r["forwards"] for r in ranks) == n - 4  # the 4 finished quantizers are not recomputed
    assert [r["forwards"] for r in ranks] == [(n + 1) // 2 - 2, n // 2 - 2]  # 0, 2 on rank 0; 1, 3 on rank 1
    for r in ranks:
        assert r["rows"]["L1"] == ref["L1"]
    # finished again: one process with shard=True recomputes nothing
    qa = make_qa(out)
    calls = count_forwards(qa)
    assert rows(qa.sensitivity(metric="L1", shard=True)) == ref["L1"] and calls == []
    assert sorted(p.name for p in (out / PROGRESS_DIR).iterdir()) == ["rank0.jsonl"]  # rank1's carried over


def test_mismatched_progress_is_ignored_and_replaced(reference, tmp_path):
    _, ref = reference
    out = tmp_path / "out"
    qa = make_qa(out)
    qa.sensitivity(metric="Cosine", shard=True)
    progress = out / PROGRESS_DIR / "rank0.jsonl"
    cosine = progress.read_text()
    shutil.copy(progress, out / PROGRESS_DIR / "rank5.jsonl")  # a stale file of a larger run
    calls = count_forwards(qa)
    assert rows(qa.sensitivity(metric="L1", shard=True)) == ref["L1"]  # other metric: all recomputed
    assert len(calls) == len(ref["L1"][0][1])
    assert progress.read_text() != cosine and json.loads(progress.read_text().splitlines()[0])["metric"] == "L1"
    assert not (out / PROGRESS_DIR / "rank5.jsonl").exists()
    # a changed analysis model (another calibration) does not reuse the L1 progress either
    qa2 = make_qa(out)
    with torch.no_grad():
        next(qa2.analysis.model.parameters()).mul_(1.01)
    calls = count_forwards(qa2)
    qa2.sensitivity(metric="L1", shard=True)
    assert len(calls) == len(ref["L1"][0][1])



def test_a_changed_post_process_does_not_reuse_progress(tmp_path):
    """Issue #26: post_process was not in the resume header, so a resumed sensitivity gave the values of the old
    post-process (13 of 26 stale). Its code is in the header now: the same post-process resumes, another does not."""
    out = tmp_path / "out"

    def top(output):
        return {"top": output.topk(3, dim=-1).values}

    def bottom(output):
        return {"top": -output.topk(3, dim=-1, largest=False).values}

    def analysis(post):
        qa = make_qa(out)
        qa.post_process = PostProcess(post)
        return qa, count_forwards(qa)

    qa, calls = analysis(top)
    qa.sensitivity(metric="L1", shard=True)
    full = len(calls)
    qa, calls = analysis(top)
    qa.sensitivity(metric="L1", shard=True)
    assert len(calls) == 0  # the same post-process: every value replayed
    qa, calls = analysis(bottom)
    qa.sensitivity(metric="L1", shard=True)
    assert len(calls) == full  # another one: all recomputed


if __name__ == "__main__":
    worker(*sys.argv[1:4])
    # The results are written and the group is destroyed on both ranks. Leave without Python's finalization:
    # there a gloo rank now and then aborted ("terminate called without an active exception", 2 of 37 runs
    # of this file), a C++ thread torn down at exit, after the work this test checks was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
