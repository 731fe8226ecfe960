"""One thread count for every forward of a run, on whatever thread runs it, and a check that the kernels a
bit-exact replay relies on give the same bits every time here.

Why: some CPU kernels split their work by the number of threads, and the
split changes the rounding.  Measured on the project's CPU (torch 2.13, fp32):
a one-query attention (`scaled_dot_product_attention`, the decode step)
over 37-1000 keys differs between 1 and 2 threads by up to ~4e-8, and
SmolLM2's K after one decode step by 6.7e-6; one-row and many-row GEMMs did
not.  A replay that runs with a different thread count from the forward it
repeats is therefore not bit-exact.  `torch.set_num_threads` acts on the
calling thread's OpenMP team (and MKL's dynamic mode is on by default until
it is called), so a run whose turns are advanced from different threads
(the web app) must set the count on each of them: `pin` does, before every
forward, and costs nothing when the count is already right.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

_PINNED = threading.local()  # .threads: the count `pin` set on this thread


def pin(threads: int, torch_threads: int | None = None):
    """Use `threads` threads on the calling thread from now on: the fixed-order kernels' team (`team`) and torch's
    intra-op pool (and MKL's, non-dynamic).  `torch_threads`: torch's own count where it is not `threads`: 1 where
    the fixed-order kernels compute a run's linears and attention (`Kernels.torch_threads`), so that torch's
    remaining ops never wait at an OpenMP barrier for a core that another process holds.

    The first call on a thread always sets torch's count, also when torch already reports it: setting it is what
    turns MKL's dynamic threading off and gives MKL this thread's count (torch may have been imported before
    this package set MKL_DYNAMIC=FALSE)."""
    torch_threads = threads if torch_threads is None else torch_threads
    if getattr(_PINNED, "threads", None) != torch_threads or torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
        _PINNED.threads = torch_threads
    _PINNED.team = threads


def team() -> int:
    """The fixed-order kernels' thread count on this thread: the last `pin`'s, else torch's."""
    return getattr(_PINNED, "team", None) or torch.get_num_threads()


@contextlib.contextmanager
def threads_set(threads: int):
    """Inside: `threads` intra-op threads on this thread; the count before is restored after."""
    previous = torch.get_num_threads()
    pin(threads)
    try:
        yield
    finally:
        pin(previous)


@contextlib.contextmanager
def one_thread():
    """Inside: this thread computes on one thread.  The invariant kernels' attention runs here, so that the order
    of every one of its reductions depends on the shapes alone, never on a thread count or on scheduling."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def probe_determinism(device: torch.device, dtype: torch.dtype, threads: int, repeats: int = 3) -> dict:
    """Whether a one-query attention and a one-row projection give the same bits on every call here.

    Both are what a decode step runs and what an exact replay repeats.  Run
    before a run; a failure means no exact mode can be promised on this
    device, dtype and thread count, and the run says so instead of claiming
    exactness it cannot have.
    """
    previous = torch.get_num_threads()
    pin(threads)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, 8, 1, 64, generator=gen).to(device, dtype)
    k = torch.randn(1, 8, 777, 64, generator=gen).to(device, dtype)
    v = torch.randn(1, 8, 777, 64, generator=gen).to(device, dtype)
    w = torch.randn(512, 512, generator=gen).to(device, dtype)
    x = torch.randn(1, 1, 512, generator=gen).to(device, dtype)
    with torch.inference_mode():
        attention = [F.scaled_dot_product_attention(q, k, v) for _ in range(repeats)]
        rows = [F.linear(x, w) for _ in range(repeats)]
    pin(previous)
    failed = [
        name
        for name, outs in (("one-query attention", attention), ("one-row projection", rows))
        if not all(torch.equal(outs[0], o) for o in outs[1:])
    ]
    return {
        "deterministic": not failed,
        "threads": threads,
        "failed": failed,
        "reason": None
        if not failed
        else f"{', '.join(failed)} gave different bits on repeated calls with "
        f"{threads} threads on {device} ({str(dtype).removeprefix('torch.')})",
    }
