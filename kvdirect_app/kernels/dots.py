"""Fixed-order linears on the CPU: every output one dot product in one order, whatever the call (`dots.cpp`).

`linear(x, weight, bias)` equals ``F.linear`` to rounding (within a few float32 ulps of the sum) and is
batch-invariant by construction: a row's bits depend on that row, the weight and the bias only, never on the
other rows of the call, the row count, where the row sits, the thread count or the scheduling (threads split the
output columns; no reduction is split).  The order is the same on the AVX-512, AVX2 and scalar paths, so the
three give the same bits: a machine without AVX-512 computes what one with it does.  It reads the model's own
weights (float32 or bfloat16; no packed copy) once per block of rows, so the few rows of a decode step cost one
read of the weights, at the memory's speed.

The path is the widest this CPU runs; ``KVDIRECT_DOTS_PATH`` (``avx512``, ``avx2``, ``scalar``) forces one (the
tests run the AVX2 path that way on an AVX-512 machine).  Where the library cannot be built (no compiler) or
the path asked for does not run here, `unavailable()` says why, and the invariant kernels are not used (the run
says so; `kernels.py`).  ``python -m kvdirect_app.kernels.dots`` builds it and prints the path.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from ..models.threads import team
from . import native
from .native import Unavailable

SOURCE = Path(__file__).with_name("dots.cpp")
CACHE_ENV = "KVDIRECT_DOTS_CACHE"
PATH_ENV = "KVDIRECT_DOTS_PATH"
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
NAMES = {v: k for k, v in PATHS.items()}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_LIB = None
_FAILED: str | None = None
_LOAD = threading.Lock()


def build() -> Path:
    return native.library(
        SOURCE,
        "the fixed-order kernels",
        CACHE_ENV,
        "dots",
        ["-O3", "-pthread"],
        ["-pthread"],
        [SOURCE.with_name("dots_attention.inc")],
    )


def _library():
    global _LIB, _FAILED
    with _LOAD:
        if _LIB is None and _FAILED is None:
            try:
                lib = ctypes.CDLL(str(build()))  # the GIL is let go during a call: the page runs beside it
                lib.kv_dots.restype = ctypes.c_int
                lib.kv_dots.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_int64,
                    ctypes.c_int64,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_int64,
                    ctypes.c_void_p,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_int,
                ]
                lib.kv_dots_path.argtypes = [ctypes.c_int]
                lib.kv_team_hold.argtypes = [ctypes.c_int]
                lib.kv_attention_lanes.restype = ctypes.c_int
                lib.kv_attention_lanes.argtypes = (
                    [ctypes.c_int64]
                    + [ctypes.c_void_p] * 3
                    + [ctypes.c_int64] * 8
                    + [ctypes.c_float] * 2
                    + [ctypes.c_int] * 3
                )
                _LIB = lib
            except (Unavailable, OSError) as e:
                _FAILED = str(e)
        if _LIB is None:
            raise Unavailable(_FAILED)
        return _LIB


def hold_helpers(on: bool):
    """The team's helpers take no task while `on` (the tests' stand-in for helpers whose cores another process
    holds): every call is then computed by its caller alone, with the same bits."""
    _library().kv_team_hold(int(on))


def requested() -> str:
    """The path asked for (``KVDIRECT_DOTS_PATH``, default ``auto``); ValueError where it is not one."""
    value = os.environ.get(PATH_ENV, "").strip().lower() or "auto"
    if value not in PATHS:
        raise ValueError(f"{PATH_ENV}: {value[:40]!r} is not allowed; allowed: {', '.join(PATHS)}")
    return value


def path(name: str | None = None) -> str:
    """The path a call takes here (`name`, else the one asked for); `Unavailable` where it cannot run here."""
    name = requested() if name is None else name
    taken = _library().kv_dots_path(PATHS[name])
    if taken < 0:
        raise Unavailable(f"the fixed-order linears' {name} path does not run on this CPU")
    return NAMES[taken]


def unavailable(dtype: torch.dtype = torch.float32, device="cpu") -> str | None:
    """None where `linear` runs here for weights of `dtype` on `device`, else why not."""
    if torch.device(device).type != "cpu":
        return f"the fixed-order linears run on the CPU, not {torch.device(device).type}"
    if dtype not in DTYPES:
        return f"the fixed-order linears take float32 and bfloat16 weights, not {str(dtype).removeprefix('torch.')}"
    try:
        path()
    except (Unavailable, ValueError) as e:
        return str(e)
    return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    name: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the fixed order: x (..., k) of the weight's dtype (or float32), weight
    (n, k) float32 or bfloat16 and contiguous (a layer's own), on the CPU; the result in the weight's dtype.  `name`
    forces a path, `threads` the thread count (default the pinned one, `threads.team`)."""
    lib = _LIB or _library()
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        # What F.linear refuses, refused here too: a reshape to (-1, k) would read rows of another width.
        raise ValueError(
            f"fixed-order linears: input {tuple(x.shape)} and weight {tuple(weight.shape)} cannot be "
            "multiplied (the input's last dimension must be the weight's second)"
        )
    n, k = weight.shape
    if weight.dtype not in DTYPES or weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError(
            f"fixed-order linears: a {weight.dtype} weight on {weight.device} (contiguous: {weight.is_contiguous()})"
        )
    if x.device.type != "cpu" or x.dtype not in (weight.dtype, torch.float32):
        raise ValueError(
            f"fixed-order linears: a {x.dtype} input on {x.device} for a {weight.dtype} weight; allowed: "
            "the weight's dtype or float32, on the CPU"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"fixed-order linears: bias {tuple(bias.shape)} for a weight of {n} outputs; allowed: ({n},)")
    rows = x.reshape(-1, k)
    if rows.dtype != torch.float32:
        rows = rows.float()  # bf16 rows widened exactly
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()):
        bias = bias.to(weight.dtype).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=weight.dtype)
    taken = lib.kv_dots(
        rows.data_ptr(),
        rows.shape[0],
        k,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        n,
        out.data_ptr(),
        DTYPES[weight.dtype],
        threads or team(),
        PATHS[name or requested()],
    )
    if taken < 0:
        raise Unavailable(f"the fixed-order linears' {name or requested()} path does not run on this CPU")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    end: int,
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
    name: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Causal attention in the fixed order (`dots_attention.inc`): query (H, q, d), key and value (Hkv, T, d), all
    float32 or all bfloat16, the last dimension contiguous; the queries are the last q of the positions end-T ..
    end-1 that the keys hold; `window` a sliding layer's, `softcap` the scores' cap.  Returns (q, H, d) in the
    query's dtype.  A query's bits depend on it and the keys it sees only, at any thread count: it is
    `attention_lanes` of one lane."""
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"fixed-order attention: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)}; allowed: query (H, q, d), key and value (Hkv, T, d) of one shape"
        )
    heads, nq, d = query.shape
    kv_heads, t, _ = key.shape
    if kv_heads < 1 or heads % kv_heads or nq > t or end < t:
        raise ValueError(
            f"fixed-order attention: {heads} heads over {kv_heads}, {nq} queries over {t} keys ending at "
            f"{end}; allowed: heads a multiple of the key heads, at most as many queries as keys, end >= T"
        )
    return attention_lanes(query[None], [key], [value], [end], scaling, softcap, window, name, threads)[0]


def attention_lanes(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    ends: list[int],
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
    name: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Several lanes' `attention` at one layer in one call: query (N, H, q, d), lane i's keys and values
    `keys[i]`, `values[i]` (Hkv, T_i, d) ending at `ends[i]`.  Returns (N, q, H, d); row i has the bits of
    ``attention(query[i], keys[i], values[i], ends[i], ...)``: each (lane, query, head) is one task computed as
    that lane's own call computes it, whoever claims it (`kv_attention_lanes`)."""
    lib = _LIB or _library()
    lanes = len(keys)
    if query.dim() != 4 or query.shape[0] != lanes or len(values) != lanes or len(ends) != lanes:
        raise ValueError(
            f"fixed-order lanes' attention: query {tuple(query.shape)} for {lanes} keys, {len(values)} values and "
            f"{len(ends)} ends; allowed: query (N, H, q, d) and N of each"
        )
    _, heads, nq, d = query.shape
    dtype = query.dtype
    if dtype not in DTYPES or query.device.type != "cpu":
        raise ValueError(f"fixed-order lanes' attention: a {dtype} query on {query.device}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    kv_heads = keys[0].shape[0] if lanes and keys[0].dim() == 3 else 1
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"fixed-order lanes' attention: {heads} heads over {kv_heads} key heads")
    kept, table, step = [], [], query.stride(0) * query.element_size()
    for i, (k, v) in enumerate(zip(keys, values)):
        if (
            k.dim() != 3
            or k.shape != v.shape
            or k.shape[0] != kv_heads
            or k.shape[2] != d
            or k.dtype != dtype
            or v.dtype != dtype
            or k.device.type != "cpu"
            or v.device.type != "cpu"
        ):
            raise ValueError(
                f"fixed-order lanes' attention: lane {i}'s key {tuple(k.shape)} {k.dtype}, value {tuple(v.shape)} "
                f"{v.dtype} for a query (H, q, d) = {tuple(query.shape[1:])} {dtype} over {kv_heads} key heads; "
                "allowed: (Hkv, T, d) of one shape and the query's dtype, on the CPU"
            )
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        kept += (k, v)  # alive until the call returns
        table.append(
            (
                query.data_ptr() + i * step,
                k.data_ptr(),
                v.data_ptr(),
                k.shape[1],
                ends[i],
                *k.stride()[:2],
                *v.stride()[:2],
            )
        )
    threads = threads or team()
    max_t = max((row[3] for row in table), default=1)
    out = torch.empty(lanes, nq, heads, d, dtype=torch.float32)
    scratch = torch.empty(max(1, min(threads, lanes * nq * heads)), max_t, dtype=torch.float32)
    rows = torch.tensor(table, dtype=torch.int64) if table else torch.zeros(0, 9, dtype=torch.int64)
    taken = lib.kv_attention_lanes(
        lanes,
        rows.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        max_t,
        heads,
        kv_heads,
        nq,
        d,
        query.stride(1),
        query.stride(2),
        window or 0,
        scaling,
        softcap or 0.0,
        DTYPES[dtype],
        threads,
        PATHS[name or requested()],
    )
    if taken < 0:
        raise ValueError(
            f"fixed-order lanes' attention: path {name or requested()}, head size {d} (at most 512), {heads} heads "
            f"over {kv_heads}, {nq} queries over keys {[row[3] for row in table]} ending at {list(ends)}"
        )
    return out if dtype == torch.float32 else out.to(dtype)


if __name__ == "__main__":
    print(build(), "path:", path())
