"""How many torch intra-op threads quantlens' long loops use.

Calibration, the bad-case search, the profiler's ``run()``, ``sensitivity()`` and the IR interpreter run many
small and medium ops in a row. On a small or busy machine torch's intra-op thread pool makes them slower, not
faster: the threads wait for cores that other processes hold (on a loaded 2-core machine one thread was 4-50x
faster than torch's default). So these loops run under :func:`loop_threads`, which sets torch's thread count
for the duration of the loop and restores the caller's setting afterwards.

The count is chosen once per process (:func:`num_threads`), by this rule:

1. ``set_num_threads(n)`` (n >= 1) wins, when it was called;
2. else the environment variable ``QUANTLENS_NUM_THREADS`` (a positive integer);
3. else **1** when the machine has at most 4 cores (``os.cpu_count()``, or the cores this process may run on
   where the OS tells) or is loaded (the 1-minute load average, ``os.getloadavg()``, is at least half the
   cores), and otherwise ``min(cores, 8)``.

``QUANTLENS_NUM_THREADS=0`` or ``set_num_threads(0)`` means "leave torch's setting alone": the loops then run
with whatever ``torch.get_num_threads()`` says. Use it where the caller manages threads itself.

    from quantlens._threads import loop_threads
    with loop_threads():
        for batch in data:
            model(batch)
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, TypeVar

import torch

__all__ = ["ENV_VAR", "num_threads", "set_num_threads", "loop_threads", "default_num_threads", "side_workers",
           "map_ordered"]

ENV_VAR = "QUANTLENS_NUM_THREADS"
#: above this many cores a machine counts as big enough for torch's intra-op threads
SMALL_MACHINE_CORES = 4
#: never more threads than this (beyond it the loops' ops are too small to gain)
MAX_THREADS = 8

_override: int | None = None  # set_num_threads
_chosen: int | None = None  # the default, computed once


def _cores() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return max(os.cpu_count() or 1, 1)


def _loaded(cores: int) -> bool:
    try:
        return os.getloadavg()[0] >= cores / 2
    except (AttributeError, OSError):  # no load average on this platform
        return False


def default_num_threads() -> int:
    """The rule's step 3 (see the module docstring), computed now."""
    cores = _cores()
    if cores <= SMALL_MACHINE_CORES or _loaded(cores):
        return 1
    return min(cores, MAX_THREADS)


def _from_env() -> int | None:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={raw!r}: expected a whole number of threads (0: leave torch's setting "
                         "alone).") from None
    if value < 0:
        raise ValueError(f"{ENV_VAR}={raw!r}: expected 0 or more threads.")
    return value


def set_num_threads(n: int | None) -> None:
    """Use ``n`` threads in quantlens' loops from now on (0: leave torch's setting alone; None: back to the
    environment variable or the default rule)."""
    global _override
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"set_num_threads({n!r}): expected a whole number >= 0, or None.")
    _override = n


def num_threads() -> int:
    """The thread count of quantlens' loops (0: torch's own setting is kept); see the module docstring."""
    global _chosen
    if _override is not None:
        return _override
    env = _from_env()
    if env is not None:
        return env
    if _chosen is None:  # once: the load average of the first loop decides for the process
        _chosen = default_num_threads()
    return _chosen


@contextmanager
def loop_threads(n: int | None = None) -> Iterator[int]:
    """Run the block with ``n`` (default :func:`num_threads`) torch intra-op threads; restore the caller's
    ``torch.get_num_threads()`` afterwards, also when the block raises. Yields the count in effect. Nested uses
    are fine (the inner one restores the outer one's setting)."""
    want = num_threads() if n is None else n
    before = torch.get_num_threads()
    if want <= 0 or want == before:
        yield before
        return
    torch.set_num_threads(want)
    try:
        yield want
    finally:
        torch.set_num_threads(before)


def side_workers(most: int) -> int:
    """How many Python threads may run independent torch work side by side now (at most ``most``): as many as the
    cores hold at ``torch.get_num_threads()`` intra-op threads each, so that they never wait for each other's
    cores (1 where torch's own threads take every core)."""
    return max(1, min(most, _cores() // max(torch.get_num_threads(), 1)))


_T = TypeVar("_T")
_R = TypeVar("_R")


def map_ordered(fn: Callable[[_T], _R], items: Sequence[_T], workers: int) -> list[_R]:
    """``[fn(x) for x in items]``, computed by up to ``workers`` threads (the calling one included) taking the items
    in order. Raises what the serial loop would: the error of the first item, in order, that failed (every item
    before it has been computed by then; none after it is started once an error is known)."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    results: list = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    lock, failed, taken = threading.Lock(), threading.Event(), iter(range(len(items)))

    def drain() -> None:
        while not failed.is_set():
            with lock:
                i = next(taken, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # (handed to the calling thread below, in the items' order)
                errors[i] = exc
                failed.set()

    helpers = [threading.Thread(target=drain, name="quantlens-side", daemon=True)
               for _ in range(min(workers, len(items)) - 1)]
    for t in helpers:
        t.start()
    try:
        drain()
    finally:
        failed.set()  # (interrupted here: the helpers finish the item they hold and take no other)
        for t in helpers:
            t.join()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
