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
