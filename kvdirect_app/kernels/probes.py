"""The invariance probe: which calls give a row the same bits whatever else is in the call, here.

The invariant kernels (`kernels.py`) hold by construction where they can, and are proven where they cannot:

* on the CPU every linear layer is the fixed-order linears (`dots.py`), invariant by construction; the probe
  only checks it (`check_dots`: rows alone, among others, at one thread and at the run's count, for each input
  width of the model), so that a broken build says so instead of breaking an exact lane;
* off the CPU every GEMM of a linear layer has one of a few row counts (`ROWS`), zero rows added, and the
  vendor's GEMM may split its reductions: for each weight shape the probe proves which of those counts give a
  large call's rows bit for bit, wherever the rows sit in the call, on two calls in a row (a count whose result
  changes from one call to the next is not proven), and that the large call gives the same bits at one thread
  and at the run's count;
* the block attention runs on one thread whatever the run's count (`threads.one_thread`), so the order of
  each of its reductions (the scores' and P@V's GEMMs, the maximum, the exponent sums, the sums over blocks)
  is fixed by the shapes alone; the probe proves its GEMMs' row counts and that a query gets the same bits
  alone, among many queries and over more keys;
* the model's row-wise reductions (RMSNorm's mean of squares, q/k norms) give a row the same bits alone and
  among many rows (`probe_rows`).

A count that was not proven is never used (`Verdict.pad` raises above the largest one), and a verdict is read
only for the shapes, dtype, device and thread count it was proven for.

What the probes find is kept with the loaded model, and its GEMM verdicts on disk (`models/probe_verdicts.py`:
`Verdict`, `Store`, `ROWS`); every start probes afresh, and a stored verdict is only compared with what the probe
finds here.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..models.probe_verdicts import ROWS, Verdict, attention_rows_key, candidates_of, linear_key
from ..models.threads import one_thread, threads_set
from . import dots

OFFSETS = (0, 5, 16)  # where the probed rows sit in the large call
BLOCK = 64  # keys per attention block (kernels.py)


# --- the probes ------------------------------------------------------------------------------------------------
def probe_linear(weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Verdict:
    """Counts m of ROWS whose rows equal those of a large call of `F.linear`, at every offset, twice, at `threads`."""
    key = linear_key(weight, bias, threads)
    candidates = candidates_of(key)
    passed, across = _linear_rows(weight, bias, threads, candidates)
    return Verdict(key, passed, across, tuple(m for m in candidates if m not in passed))


def _linear_rows(
    weight: torch.Tensor, bias: torch.Tensor | None, threads: int, counts, offsets=OFFSETS, repeats: int = 2
) -> tuple[tuple[int, ...], bool]:
    """The probe's comparison: of `counts`, those whose rows of `F.linear` equal those of the probe's large call,
    at each of `offsets`, `repeats` times, at `threads`, on the weight's device; and whether the large call gives
    the same bits at one thread."""
    top = candidates_of(linear_key(weight, bias, threads))[-1] + OFFSETS[-1] + 8  # the probe's large call
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(top, weight.shape[1], generator=gen).to(weight)
    call = functools.partial(F.linear, weight=weight, bias=bias)  # the layer's own weight: no copy of a large head

    with torch.inference_mode():
        with threads_set(1):
            one = call(x)
        with threads_set(threads):
            ref = call(x)
            steady = torch.equal(ref, call(x))
            passed = tuple(
                m
                for m in counts
                if steady
                and all(torch.equal(call(x[o : o + m]), ref[o : o + m]) for o in offsets for _ in range(repeats))
            )
    return passed, torch.equal(one, ref)


def probe_attention_rows(head_dim: int, dtype: torch.dtype, device) -> Verdict:
    """Counts m of ROWS whose rows of the block attention's two GEMMs ((m, d) @ (d, 64) per block and
    (m, 64) @ (64, d)) equal those of a large call, over 1 and 7 blocks, at one thread (where they run)."""
    passed = _attention_rows(head_dim, device, ROWS)
    return Verdict(attention_rows_key(head_dim, dtype, device), passed, True, tuple(m for m in ROWS if m not in passed))


def _attention_rows(head_dim: int, device, counts) -> tuple[int, ...]:
    """The probe's comparison for the block attention's GEMMs (float32, as the block attention computes): of
    `counts`, those whose rows equal those of the large call at every offset, over 1 and 7 blocks, on `device`."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    top = ROWS[-1] + OFFSETS[-1] + 8
    x = torch.randn(2, 1, top, head_dim, generator=gen).to(device, torch.float32)
    k = torch.randn(2, 7, BLOCK, head_dim, generator=gen).to(device, torch.float32)
    p = torch.rand(2, 7, top, BLOCK, generator=gen).to(device, torch.float32)
    passed = []
    with torch.inference_mode(), one_thread():
        ref = torch.matmul(x.expand(2, 7, top, head_dim), k.transpose(2, 3)), torch.matmul(p, k)
        for m in counts:
            same = True
            for blocks in (1, 7):
                for o in OFFSETS:
                    scores = torch.matmul(
                        x[:, :, o : o + m].expand(2, blocks, m, head_dim), k[:, :blocks].transpose(2, 3)
                    )
                    pv = torch.matmul(p[:, :blocks, o : o + m].contiguous(), k[:, :blocks])
                    same &= torch.equal(scores, ref[0][:, :blocks, o : o + m]) and torch.equal(
                        pv, ref[1][:, :blocks, o : o + m]
                    )
            if same:
                passed.append(m)
    return tuple(passed)


def probe_attention(
    attention,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
    threads: int,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[bool, str | None]:
    """Whether `attention` (the block attention with this device's row counts: `kernels.Kernels.attention`) gives
    a query the same bits alone, among many queries and over more keys, with the run at one thread and at
    `threads`; (ok, why not)."""
    one = attention
    gen = torch.Generator(device="cpu").manual_seed(2)
    total = 300
    q = torch.randn(heads, total, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(kv_heads, total, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(kv_heads, total, head_dim, generator=gen).to(device, dtype)
    scaling = head_dim**-0.5
    with torch.inference_mode(), threads_set(threads):
        whole = one(q, k, v, total, scaling, softcap, window)
        for p in (0, 1, 63, 64, 65, 130, 299):
            alone = one(q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1], p + 1, scaling, softcap, window)
            if not torch.equal(alone[0], whole[p]):
                return False, f"one query at position {p} differs from the same query in a call of {total}"
        part = one(q[:, 100:164], k[:, :164], v[:, :164], 164, scaling, softcap, window)
        if not torch.equal(part, whole[100:164]):
            return False, "64 queries over their keys differ from the same queries in a longer call"
    with torch.inference_mode(), threads_set(1):
        if not torch.equal(one(q, k, v, total, scaling, softcap, window), whole):
            return False, f"a run at 1 thread and one at {threads} threads give different bits"
    return True, None


def probe_rows(
    module: torch.nn.Module, width: int, dtype: torch.dtype, device, threads: int
) -> tuple[bool, str | None]:
    """Whether a row-wise module (an RMSNorm: a mean of squares per row) gives a row the same bits alone and in a
    call of 300 rows, at one thread and at `threads`; (ok, why not)."""
    gen = torch.Generator(device="cpu").manual_seed(4)
    x = torch.randn(1, 300, width, generator=gen).to(device, dtype)
    with torch.inference_mode():
        with threads_set(1):
            one = module(x)
        with threads_set(threads):
            whole = module(x)
            for p in (0, 1, 63, 299):
                if not torch.equal(module(x[:, p : p + 1]), whole[:, p : p + 1]):
                    return False, f"{type(module).__name__}: row {p} alone differs from the same row among 300"
    if not torch.equal(one, whole):
        return False, f"{type(module).__name__}: 1 thread and {threads} threads give different bits"
    return True, None


def check_dots(k: int, bias: bool, dtype: torch.dtype, path: str, threads: int) -> tuple[bool, str | None]:
    """Whether the fixed-order linears (`dots.linear` on `path`) give each row of a 40-row call of input width
    `k` the same bits computed alone and in every count of 1-16 rows at two offsets, at one thread and at
    `threads`; (ok, why not).  A check of what they build in, on a small weight of that width."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    w = torch.randn(13, k, generator=gen).to(dtype)
    b = torch.randn(13, generator=gen).to(dtype) if bias else None
    x = torch.randn(40, k, generator=gen).to(dtype)
    with torch.inference_mode():
        whole = dots.linear(x, w, b, name=path, threads=threads)
        for m in range(1, 17):
            for o in (0, 21):
                if not torch.equal(dots.linear(x[o : o + m], w, b, name=path, threads=threads), whole[o : o + m]):
                    return False, f"{m} row(s) at row {o} differ from the same rows in a call of 40 (width {k})"
        if not torch.equal(dots.linear(x, w, b, name=path, threads=1), whole):
            return False, f"1 thread and {threads} threads give different bits (width {k})"
    return True, None
