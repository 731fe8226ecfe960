"""The roofline of a model's decode step on this machine, measured here: what the hardware allows, and how far
the engine's shared pass is from it (`bench roofline`, issue 37).

A decode step runs every linear layer of the model (the output head included) over N rows, one per lane.  Its
time is bounded below by two things this module measures on the machine it runs on, at the run's thread count:

* reading the weights once: weight bytes / the memory bandwidth (a large copy: bytes read plus bytes written,
  over its best time);
* the arithmetic: 2 N P flops (P the linears' weights) / the GEMM rate (a large square GEMM's best time).

The best possible time for N rows is the larger of the two (`best_ms`).  Everything else a step does (norms,
RoPE, each lane's attention and cache work, Python) comes on top; the shared pass's linears alone are timed as
the engine runs them (`linears_ms`: the invariant mode's fixed-order linears, or the model's own `F.linear` per
row in the native mode) so that what the kernels lose to the roofline and what the rest of
the pass costs are told apart.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.threads import threads_set

ROWS = (1, 7, 8, 16)  # row counts reported by default: one pane, the seven default panes (and twins), 16


def _best(fn, repeats: int) -> float:
    """The best of `repeats` timed calls of `fn`, in seconds, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_rate(dtype: torch.dtype, threads: int, n: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of an n x n x n GEMM in `dtype` at `threads` threads (best of `repeats`)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    with torch.inference_mode(), threads_set(threads):
        seconds = _best(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / seconds / 1e9


def bandwidth(threads: int, mib: int = 512, repeats: int = 3) -> float:
    """GB/s of a large copy at `threads` threads: bytes read plus bytes written over its best time."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    with torch.inference_mode(), threads_set(threads):
        seconds = _best(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds / 1e9


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return set()


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's linear layers, each weight once (a tied output head shares the embedding's)."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            out.append(m)
    return out


def best_ms(weight_bytes: int, params: int, rows: int, gemm_gflops: float, bandwidth_gbs: float) -> dict:
    """The best possible time of one step's linears over `rows` rows: the larger of reading the weights once and
    the arithmetic at the large GEMM's rate; and which of the two bounds it."""
    read = weight_bytes / bandwidth_gbs / 1e6
    math = 2 * rows * params / gemm_gflops / 1e6
    return {
        "rows": rows,
        "weights_read_ms": read,
        "arithmetic_ms": math,
        "best_ms": max(read, math),
        "bound": "memory" if read >= math else "arithmetic",
    }


def linears_ms(loaded, kernels, rows: int, repeats: int = 3) -> float:
    """One step's linears over `rows` rows as the engine runs them (best of `repeats`), in ms: the invariant mode's
    `Kernels.linear`, or the native mode's `F.linear` one row at a time (what the native lockstep does)."""
    layers = linears(loaded.model)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, m.in_features, generator=gen).to(loaded.device, loaded.dtype) for m in layers]

    def step():
        for x, m in zip(xs, layers):
            if kernels.invariant:
                kernels.linear(x, m.weight, m.bias)
            else:
                for r in range(rows):
                    F.linear(x[r : r + 1], m.weight, m.bias)

    with torch.inference_mode(), threads_set(kernels.threads):
        return 1e3 * _best(step, repeats)


def machine(threads: int, dtype: torch.dtype, repeats: int = 3, mib: int = 512) -> dict:
    """The machine's side of the roofline at `threads`: the GEMM rate in fp32 (and bf16, with whether the CPU says
    it has bf16 instructions) and the bandwidth of a copy of `mib` MiB."""
    flags = cpu_flags()
    rates = {"float32": gemm_rate(torch.float32, threads, repeats=repeats)}
    if dtype == torch.bfloat16 or "avx512_bf16" in flags or "amx_bf16" in flags:
        rates["bfloat16"] = gemm_rate(torch.bfloat16, threads, repeats=repeats)
    return {
        "threads": threads,
        "gemm_gflops": rates,
        "bandwidth_gbs": bandwidth(threads, mib, repeats),
        "bf16_instructions": sorted(f for f in flags if "bf16" in f),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def rate_for(here: dict, dtype: torch.dtype) -> float:
    """The measured GEMM rate for the model's dtype (fp32's where that dtype was not measured)."""
    return here["gemm_gflops"].get(str(dtype).removeprefix("torch."), here["gemm_gflops"]["float32"])


def model_side(loaded) -> dict:
    layers = linears(loaded.model)
    params = sum(m.weight.numel() for m in layers)
    return {
        "linears": len(layers),
        "params": params,
        "weight_bytes": sum(m.weight.numel() * m.weight.element_size() for m in layers),
    }
