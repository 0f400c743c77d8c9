"""Two processes run ``QuantAnalysis.run()`` into one out_dir at the same time, with two different models and bad
cases (docs/guarantees.md, "One run per out_dir at a time"). In every round, each run either completes, its trace
then exactly (byte for byte) the one a solo run of its model writes into a fresh folder, or is refused with a
``QuantLensError`` naming the lock and the fix; the folder ends holding the trace of the run that finished last,
never one mixed from both, with no lock and no staging folder left behind."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantlens.errors import QuantLensError
from quantlens.profiler.trace.folder_lock import LOCK_FILE

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 240.0  # seconds for a worker's step (starting torch included) before the test fails as hung

#: ``python -c WORKER variant shared_out_dir solo_out_dir sync_dir rounds_json``: a solo run of its model into a
#: fresh folder, then per round: wait for ``go<k>``, sleep the round's delay, run() into the shared folder, and
#: report (``round<k>_<variant>.json``) the outcome and, while holding the folder, the trace it finds there.
WORKER = r"""
import hashlib, json, os, sys, time, traceback
from pathlib import Path

import torch

torch.set_num_threads(1)
from quantlens.errors import QuantLensError
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.trace.folder_lock import FolderLock
from quantlens.quantization import calibrate, prepare
from tests.test_profiler_reach import WithPooler

variant, shared, solo, sync = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
rounds = json.loads(sys.argv[5])


def report(name, data):
    tmp = sync / f".{name}.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, sync / name)


def digest(out_dir):
    return {str(p.relative_to(out_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for side in ("baseline_model", "analysis_model") for p in sorted((out_dir / side).rglob("*"))
            if p.is_file()}


gen = torch.Generator().manual_seed({"a": 1, "b": 2}[variant])
x, mask = torch.randn(16, 8, generator=gen), (torch.rand(16, 4, generator=gen) > 0.3).float()
model = WithPooler().eval()
if variant == "b":  # another model: the same op sites, other weights
    with torch.no_grad():
        model.fc2.weight.mul_(-1.0)
prepared = calibrate(prepare(model, (x, mask), check_result_dir=None), [(x, mask)])


def analysis(out_dir):
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=out_dir, progress=False)
    qa.set_bad_case((x, mask))
    return qa


try:
    analysis(solo).run()
    report(f"solo_{variant}.json", digest(solo))
    for k, delays in enumerate(rounds):
        while not (sync / f"go{k}").exists():
            time.sleep(0.002)
        time.sleep(delays[variant])
        try:  # set_bad_case writes badcase.pt: it is refused too while the other run holds the folder
            analysis(shared).run()
            status, message = "ok", ""
        except QuantLensError as exc:
            status, message = "refused", str(exc)
        end, snapshot = time.time(), None
        if status == "ok":
            try:
                with FolderLock(shared):  # what this run left, unless the other run holds the folder by now
                    snapshot = digest(shared)
            except QuantLensError:
                pass
        report(f"round{k}_{variant}.json", {"status": status, "message": message, "end": end, "snapshot": snapshot})
except BaseException:
    report(f"failed_{variant}.json", {"status": "error", "message": traceback.format_exc()})
    raise
"""


def _digest(out_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(out_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for side in ("baseline_model", "analysis_model") for p in sorted((out_dir / side).rglob("*"))
            if p.is_file()}


def _wait(name: str, v: str, procs: dict, sync: Path) -> dict:
    """Worker ``v``'s report ``name``, failing when it fails, dies or takes longer than :data:`DEADLINE`."""
    deadline, path = time.monotonic() + DEADLINE, sync / name
    while not path.exists():
        failed = sync / f"failed_{v}.json"
        if failed.exists():
            pytest.fail(f"worker {v} failed:\n{json.loads(failed.read_text())['message']}")
        if procs[v].poll() is not None:
            pytest.fail(f"worker {v} exited ({procs[v].returncode}) without writing {name}:\n"
                        f"{procs[v].stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {path.name} after {DEADLINE} s: a worker hangs")
        time.sleep(0.01)
    return json.loads(path.read_text())


def _check_round(k: int, results: dict, solo: dict, shared: Path) -> None:
    ok = [v for v, r in results.items() if r["status"] == "ok"]
    for v, r in results.items():
        assert r["status"] in ("ok", "refused"), (k, v, r)
        if r["status"] == "refused":
            message = r["message"]
            assert "in use by another quantlens run" in message and str(shared / LOCK_FILE) in message, message
            assert "another out_dir" in message, message  # the fix
        elif r["snapshot"] is not None:
            assert r["snapshot"] == solo[v], f"round {k}: run {v} left a trace other than its solo run's"
    assert ok, f"round {k}: both runs were refused: {results}"
    last = max(ok, key=lambda v: results[v]["end"])
    final = _digest(shared)
    mixed = {name for name in final if final[name] != solo[last].get(name)}
    assert final == solo[last], f"round {k}: the folder is not run {last}'s trace (files differing: {sorted(mixed)})"
    assert not (shared / LOCK_FILE).exists()
    assert not [p for p in shared.iterdir() if ".partial" in p.name or ".old-" in p.name]


def test_two_runs_into_one_out_dir_never_mix(tmp_path):
    shared, sync = tmp_path / "shared", tmp_path / "sync"
    sync.mkdir()
    # the same start; one a little later (inside the other's run, a run takes a few tenths of a second); a well
    # after b (one run after the other)
    rounds = [*[{"a": 0.0, "b": 0.0}] * 3, {"a": 0.0, "b": 0.05}, {"a": 0.1, "b": 0.0}, {"a": 2.5, "b": 0.0}]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = {v: subprocess.Popen([sys.executable, "-c", WORKER, v, str(shared), str(tmp_path / f"solo_{v}"),
                                  str(sync), json.dumps(rounds)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for v in "ab"}
    try:
        solo = {v: _wait(f"solo_{v}.json", v, procs, sync) for v in "ab"}
        assert solo["a"].keys() == solo["b"].keys() and solo["a"] != solo["b"]  # two models, one layout
        for k in range(len(rounds)):
            (sync / f"go{k}").touch()
            results = {v: _wait(f"round{k}_{v}.json", v, procs, sync) for v in "ab"}
            _check_round(k, results, solo, shared)
        for proc in procs.values():
            assert proc.wait(timeout=DEADLINE) == 0, proc.stderr.read()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_lock_file_being_created_is_not_taken_for_a_stale_one(tmp_path):
    """A run creates the lock file, then writes its pid into it: a second run that read it in between took the
    empty file for a killed run's, removed it and ran too; the two cleared each other's staging files ("Writing the
    baseline trace ... failed: FileNotFoundError", found by the test above). It now waits for the pid."""
    import threading

    from quantlens.profiler.trace.folder_lock import FolderLock

    lock = tmp_path / LOCK_FILE
    lock.write_text("")  # created, its pid not written yet
    other = os.getppid()  # a live process other than this one
    writer = threading.Timer(0.05, lambda: lock.write_text(str(other)))
    writer.start()
    try:
        with pytest.raises(QuantLensError, match=rf"in use by another quantlens run \(pid {other}"):
            with FolderLock(tmp_path):
                pass
    finally:
        writer.join()
    assert lock.read_text() == str(other)  # the other run's lock stays
    lock.write_text("")  # an empty lock that stays empty: its run was killed right after creating it
    with FolderLock(tmp_path):
        assert lock.read_text() == str(os.getpid())
    assert not lock.exists()


_HOLD = """
import sys, time
from quantlens.profiler.trace.folder_lock import FolderLock
with FolderLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_refused_second_analysis_leaves_the_folder_s_bad_case_alone(tmp_path):
    import torch

    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import calibrate, prepare
    from tests.test_profiler_reach import WithPooler, _analysis

    _analysis(tmp_path)  # a complete run: its traces and its badcase.pt
    before = (tmp_path / "badcase.pt").read_bytes()
    gen = torch.Generator().manual_seed(2)
    x, mask = torch.randn(16, 8, generator=gen), (torch.rand(16, 4, generator=gen) > 0.3).float()
    model = WithPooler().eval()
    prepared = calibrate(prepare(model, (x, mask), check_result_dir=None), [(x, mask)])
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), "60"], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"  # another process's run holds the folder
        qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
        try:
            qa.set_bad_case((x, mask))
            qa.run()
        except QuantLensError as exc:
            assert "in use by another quantlens run" in str(exc)
        else:
            pytest.fail("run() was not refused while another process held the folder")
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "badcase.pt").read_bytes() == before, "the refused analysis replaced the folder's bad case"


def test_a_bad_case_write_waits_for_a_moment_s_hold(tmp_path):
    """Every rank of a sharded sensitivity saves the bad case into one out_dir: a write that finds the folder held
    for a moment waits for it (up to 5 s) instead of failing the rank."""
    import time

    import torch

    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import calibrate, prepare
    from tests.test_profiler_reach import WithPooler

    gen = torch.Generator().manual_seed(3)
    x, mask = torch.randn(16, 8, generator=gen), (torch.rand(16, 4, generator=gen) > 0.3).float()
    model = WithPooler().eval()
    prepared = calibrate(prepare(model, (x, mask), check_result_dir=None), [(x, mask)])
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), "1.5"], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        qa.set_bad_case((x, mask))  # waits for the holder, then writes
        assert time.monotonic() - start > 0.5 and (tmp_path / "badcase.pt").is_file()
    finally:
        holder.kill()
        holder.wait()
