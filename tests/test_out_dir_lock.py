"""Issue #26 point 2: one run per out_dir at a time. A second process's run into an out_dir that a live run holds is
refused with the owner's pid and the fix (two runs used to clear each other's files and leave a mixed trace); a
lock left by a killed run is taken over; staging folders have names unique to their run."""

import os
import subprocess
import sys
import time

import pytest

from quantlens.errors import QuantLensError
from quantlens.profiler.trace.folder_lock import LOCK_FILE, FolderLock
from tests.test_profiler_reach import _analysis

_HOLD = """
import sys, time
from quantlens.profiler.trace.folder_lock import FolderLock
with FolderLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_second_process_is_refused_while_a_run_holds_the_folder(tmp_path):
    qa = _analysis(tmp_path)  # one complete run, lock released after it
    assert not (tmp_path / LOCK_FILE).exists()
    before = (tmp_path / "analysis_model" / "trace.json").read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(QuantLensError, match=rf"in use by another quantlens run \(pid {holder.pid}"):
            qa.run()
        assert (tmp_path / "analysis_model" / "trace.json").read_bytes() == before  # untouched
    finally:
        holder.kill()
        holder.wait()
    qa.run()  # the holder was killed: its lock is stale and taken over
    assert not (tmp_path / LOCK_FILE).exists()
    assert not list(tmp_path.glob(".*partial*"))  # no staging folder left behind


def test_a_stale_lock_is_taken_over_and_the_lock_is_reentrant(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(dead.stdout.strip())
    time.sleep(0.05)
    with FolderLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
        with FolderLock(tmp_path):  # a run inside a run of the same process
            pass
        assert (tmp_path / LOCK_FILE).exists()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_trace_of_another_model_is_not_reused(tmp_path):
    """Issue #26 point 1: run(run_baseline_model=False) used another model's baseline trace without a word (an
    innocent layer blamed); set_model_profiler_dir likewise. Traces carry the model's fingerprint; a mismatch is
    refused, the same model's trace is reused."""
    import torch

    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import calibrate, prepare
    from tests.test_profiler_reach import WithPooler

    first = _analysis(tmp_path / "first")  # its baseline: WithPooler's seed-0 weights
    gen = torch.Generator().manual_seed(1)
    x, mask = torch.randn(16, 8, generator=gen), (torch.rand(16, 4, generator=gen) > 0.3).float()
    other = WithPooler().eval()
    with torch.no_grad():
        other.fc2.weight.mul_(-1.0)  # another model, the same op sites
    prepared = calibrate(prepare(other, (x, mask), check_result_dir=None), [(x, mask)])
    qa = QuantAnalysis(other, prepared, "fake_quant", out_dir=tmp_path / "first", progress=False)
    qa.set_bad_case((x, mask))
    with pytest.raises(QuantLensError, match="was made from another model"):
        qa.run(run_baseline_model=False)
    with pytest.raises(QuantLensError, match="was made from another model"):
        qa.set_model_profiler_dir(tmp_path / "first" / "baseline_model", tmp_path / "first" / "analysis_model")
    first.run(run_baseline_model=False)  # the same model: its trace is reused


_RACE = """
import json, os, sys, time
from pathlib import Path
from quantlens.errors import QuantLensError
import quantlens.profiler.trace.folder_lock as lock
from quantlens.profiler.trace.folder_lock import FolderLock
folder, go, out, dead = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
alive = lock._alive
# widen the window between judging the lock stale and clearing it, as a loaded machine would
lock._alive = lambda pid: (time.sleep(0.05), alive(pid))[1] if pid == dead else alive(pid)
while not go.exists():
    time.sleep(0.001)
try:
    with FolderLock(folder):
        start = time.monotonic()
        time.sleep(0.3)
        end = time.monotonic()
    result = {"held": [start, end]}
except QuantLensError as exc:
    result = {"refused": str(exc)}
out.write_text(json.dumps(result))
"""


def test_a_stale_lock_is_taken_over_by_one_of_several_runs_starting_together(tmp_path):
    """A killed run's lock and four runs starting at once: one takes the folder over, the others are refused or
    hold it after it; never two at the same time (each clearing the stale lock used to let both run)."""
    import json

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(dead.stdout.strip())
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(folder), str(go), str(tmp_path / f"r{i}.json"),
                               dead.stdout.strip()]) for i in range(4)]
    time.sleep(1.5)  # every process imported quantlens and waits for the signal
    go.touch()
    for p in procs:
        assert p.wait(timeout=60) == 0
    results = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(4)]
    held = sorted(r["held"] for r in results if "held" in r)
    assert held, results
    assert all(a[1] <= b[0] for a, b in zip(held, held[1:])), held  # no two holds overlap
    assert all("in use by another quantlens run" in r["refused"] for r in results if "refused" in r)
    assert not (folder / LOCK_FILE).exists() and not list(folder.glob(f"{LOCK_FILE}.*"))


def test_one_run_per_out_dir_threads_included(tmp_path):
    """The lock let any thread of the owning process in, and a second thread's staging cleared the first's files
    while it wrote (issue #43): another thread is refused in words, the holding thread enters again (a run inside
    a run), and the folder is free once the holder leaves."""
    import threading

    from quantlens.errors import QuantLensError
    from quantlens.profiler.trace.folder_lock import FolderLock

    held, release, seen = threading.Event(), threading.Event(), []

    def holder():
        with FolderLock(tmp_path):
            with FolderLock(tmp_path):  # re-entrant in its own thread
                held.set()
                release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        with pytest.raises(QuantLensError, match="in use by another thread of this process"):
            with FolderLock(tmp_path):
                seen.append("entered")
    finally:
        release.set()
        thread.join()
    assert not seen
    with FolderLock(tmp_path):  # free again
        seen.append("entered")
    assert seen == ["entered"] and not (tmp_path / ".quantlens.lock").exists()


@pytest.mark.parametrize("where", ["tensors", "folder"])
def test_a_trace_is_never_written_through_a_link(tmp_path, where):
    """A ``tensors/`` that is a symbolic link out of the trace folder had run() write its tensor files outside the
    out_dir (issue #43): the link is refused in words before anything is written, and nothing lands there."""
    qa = _analysis(tmp_path / "out")
    outside = tmp_path / "outside"
    outside.mkdir()
    trace = tmp_path / "out" / "analysis_model"
    if where == "tensors":
        import shutil

        shutil.rmtree(trace / "tensors")
        (trace / "tensors").symlink_to(outside, target_is_directory=True)
    else:
        trace.rename(tmp_path / "moved")
        trace.symlink_to(outside, target_is_directory=True)
    with pytest.raises(QuantLensError, match="is a symbolic link .*never writes a trace through a link"):
        qa.run()
    assert list(outside.iterdir()) == []
