"""quantlens._threads: the thread count of quantlens' long loops (rule, env var, override, restore)."""

import pytest
import torch

from quantlens import _threads
from quantlens._threads import ENV_VAR, loop_threads, num_threads, set_num_threads


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(_threads, "_override", None)
    monkeypatch.setattr(_threads, "_chosen", None)
    monkeypatch.delenv(ENV_VAR, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_rule(monkeypatch):
    monkeypatch.setattr(_threads, "_cores", lambda: 2)
    monkeypatch.setattr(_threads, "_loaded", lambda cores: False)
    assert _threads.default_num_threads() == 1  # small machine
    monkeypatch.setattr(_threads, "_cores", lambda: 16)
    assert _threads.default_num_threads() == 8  # capped
    monkeypatch.setattr(_threads, "_cores", lambda: 6)
    assert _threads.default_num_threads() == 6
    monkeypatch.setattr(_threads, "_loaded", lambda cores: True)
    assert _threads.default_num_threads() == 1  # loaded machine


def test_load_average_threshold(monkeypatch):
    monkeypatch.setattr(_threads.os, "getloadavg", lambda: (4.0, 0.0, 0.0))
    assert _threads._loaded(8) and not _threads._loaded(16)


def test_default_is_chosen_once(monkeypatch):
    calls = []
    monkeypatch.setattr(_threads, "default_num_threads", lambda: calls.append(1) or 3)
    assert num_threads() == 3 and num_threads() == 3
    assert len(calls) == 1


def test_env_var_and_override(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "3")
    assert num_threads() == 3
    set_num_threads(2)
    assert num_threads() == 2  # the function wins over the environment
    set_num_threads(None)
    assert num_threads() == 3
    monkeypatch.setenv(ENV_VAR, "many")
    with pytest.raises(ValueError, match=ENV_VAR):
        num_threads()
    with pytest.raises(ValueError):
        set_num_threads(-1)


def test_context_sets_and_restores():
    torch.set_num_threads(2)
    set_num_threads(1)
    with loop_threads() as n:
        assert n == 1 and torch.get_num_threads() == 1
        with loop_threads(3):  # nested: restores the outer setting
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError):
        with loop_threads():
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2  # restored after an error too


def test_zero_leaves_torch_alone(monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setenv(ENV_VAR, "0")
    with loop_threads() as n:
        assert n == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_side_workers_leave_each_thread_its_cores(monkeypatch):
    monkeypatch.setattr(_threads, "_cores", lambda: 2)
    torch.set_num_threads(1)
    assert _threads.side_workers(2) == 2 and _threads.side_workers(1) == 1
    torch.set_num_threads(2)  # torch's own threads take both cores: no second Python thread beside them
    assert _threads.side_workers(2) == 1
    monkeypatch.setattr(_threads, "_cores", lambda: 16)
    assert _threads.side_workers(2) == 2 and _threads.side_workers(4) == 4


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_map_ordered_gives_the_loops_results_in_order(workers):
    import threading
    import time

    seen = set()

    def fn(i):
        seen.add(threading.get_ident())
        time.sleep(0.002 * (i % 3))  # (items finish out of order)
        return i * i

    assert _threads.map_ordered(fn, list(range(12)), workers) == [i * i for i in range(12)]
    assert len(seen) == 1 if workers == 1 else len(seen) >= 2  # (the helpers took items too)
    assert _threads.map_ordered(fn, [], workers) == []


def test_map_ordered_raises_the_first_failing_item_in_order():
    """Item 2 fails at once on one thread while item 1, taken before it, fails later on the other: the loop's error
    is item 1's, as in a serial loop, and nothing after item 2 is computed once both errors are known."""
    import time

    done = []

    def fn(i):
        if i == 1:
            time.sleep(0.2)
            raise ValueError("item 1")
        if i == 2:
            raise KeyError("item 2")
        done.append(i)
        return i

    with pytest.raises(ValueError, match="item 1"):
        _threads.map_ordered(fn, list(range(50)), 2)
    assert 0 in done and len(done) < 48  # (the later items were not all run)
