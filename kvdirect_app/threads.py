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

import torch
import torch.nn.functional as F


def pin(threads: int):
    """Use `threads` intra-op threads on the calling thread (and MKL's, non-dynamic) from now on."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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
    failed = [name for name, outs in (("one-query attention", attention), ("one-row projection", rows))
              if not all(torch.equal(outs[0], o) for o in outs[1:])]
    return {"deterministic": not failed, "threads": threads, "failed": failed,
            "reason": None if not failed else f"{', '.join(failed)} gave different bits on repeated calls with "
                                              f"{threads} threads on {device} ({str(dtype).removeprefix('torch.')})"}
