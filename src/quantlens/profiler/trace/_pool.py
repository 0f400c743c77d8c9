"""The copies of op site tensors waiting for the writer thread: reused byte buffers, bounded in bytes."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from quantlens.profiler.trace._files import ST_DTYPES, dense_copy
from quantlens.profiler.trace.format import ALIGN


class BufferPool:
    """Byte buffers for the copies waiting for the writer thread, reused from site to site (fresh
    activation-sized allocations are page faults, and they dominate a traced forward otherwise). At most
    ``limit`` bytes are handed out at once; one request larger than that is served alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.free: list[torch.Tensor] = []
        self.out = 0  # bytes handed out
        self.peak = 0  # the most bytes handed out at once
        self.cond = threading.Condition()

    def take(self, nbytes: int, failed: Callable[[], bool], held: int = 0,
             helper: Callable[[], bool] | None = None) -> torch.Tensor:
        """A buffer of at least ``nbytes``; ``held`` more bytes (tensors queued without a copy) count against
        the limit too, until :meth:`give`. While it must wait, ``helper()`` is called (outside the lock) to do
        some of the work that frees buffers, until it returns False."""
        while helper is not None:
            with self.cond:
                if not (self.out and self.out + nbytes + held > self.limit and not failed()):
                    break
            if not helper():
                break
        with self.cond:
            while self.out and self.out + nbytes + held > self.limit and not failed():
                self.cond.wait(0.5)
            self.out += held
            fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]  # (by index: == compares values)
            if fits:
                buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
            else:
                self.free.sort(key=torch.Tensor.numel)
                while self.free and sum(b.numel() for b in self.free) + self.out + nbytes > self.limit:
                    self.free.pop(0)  # too small for what comes now: let the smallest go
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.out += nbytes
            self.peak = max(self.peak, self.out)
            return buf

    def give(self, buf: torch.Tensor, nbytes: int) -> None:
        with self.cond:
            self.out -= nbytes
            self.free.append(buf)
            self.cond.notify_all()

    def clear(self) -> None:
        with self.cond:
            self.free = []


def copy_into(buf: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense copies of ``tensors`` laid out in the byte buffer ``buf`` (see :func:`layout_bytes`)."""
    out, offset = {}, 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if t.dtype not in ST_DTYPES or t.is_complex():
            out[key] = dense_copy(t)
            continue
        view = buf[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        out[key] = view
        offset += -(-n // ALIGN) * ALIGN
    return out


def layout_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes :func:`copy_into` lays ``tensors`` out in (each one's data aligned)."""
    return sum(-(-(t.numel() * t.element_size()) // ALIGN) * ALIGN for t in tensors.values()
               if t.dtype in ST_DTYPES)
