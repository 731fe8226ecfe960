"""Recompute vs read: is recomputing K/V from stored residuals faster than reading cached K/V?

The KV-Direct paper claims recomputing K/V "up to 5x faster" than reading
cached tensors.  This microbenchmark measures both on one global attention
layer of a real model, with that layer's own weights, for a grid of batch
sizes `b` (sequences) and contexts `n` (tokens per sequence), and sets the
measurements beside the arithmetic-intensity bound of the device they ran on.

What is timed, per cell (b sequences of n tokens, one layer):

* **read** (`read_ms`): what a cache does at a decode step to hand attention
  its K/V: `torch.cat([K_old, k_new], dim=-2)` and the same for V, where
  `K_old`/`V_old` (b, n_kv, n-1, d_h) are the cached tensors in device memory
  and `k_new`/`v_new` the step's token, giving fresh contiguous (b, n_kv, n,
  d_h) buffers (transformers' `DynamicLayer.update`, and the project's `full`
  cache).  It reads the K/V of b*n tokens and writes them once.
* **recompute** (`recompute_ms`): from stored raw residuals (b, n, d) in
  device memory to the same fresh K and V buffers: the layer's
  `input_layernorm` (absent in post-norm families such as OLMo 2, whose
  attention input is the raw residual), then the project's exact projector
  `replay.KVProjector.project` (k_proj and v_proj as one GEMM over each
  sequence's chunk, k_norm where the family has one, and RoPE at positions
  0..n-1 with the family's own rotary embedding).  The project's own
  `kvdirect` cache stores the *normed* input, so its rebuild is this minus
  one norm.  `HeadProjection.finish` calls the family's
  `apply_rotary_pos_emb(k, k, ...)`, which rotates K twice (once as "q");
  that spare rotation is part of the project's rebuild and so is timed here.
* **host read** (`host_read_ms`, CUDA with `host_copy`): K and V of b*n tokens
  held in pinned host memory, copied to fresh device buffers
  (`.to(device, non_blocking=True)`, then synchronised): the regime where the
  claim can hold (K/V offloaded to host memory, residuals recomputed on the
  device).

Each operation runs once as a warm-up, then `repeats` samples; the median is
reported.  An operation shorter than a millisecond is run several times per
sample (the sample is divided by the count) so that the clock's resolution
does not dominate.  On CUDA every sample is bracketed by
`torch.cuda.synchronize()`.  Timings run at the process's thread count, or at
`measure(threads=...)` (`threads` in the result), and include the allocation of the output buffers,
as a cache's own reads do.

The bound: with `F` the achieved FLOP/s of a large square matmul in the
model dtype and `B` the bytes/s of a large tensor copy (bytes copied per
second; for the host regime, host-to-device), reading costs at least
`kv_bytes / B` and recomputing at least `flops / F + residual_bytes / B`, so

    bound_speedup = (kv_bytes / B) / (flops / F + residual_bytes / B)

where `flops = 2 * tokens * d * (out_k + out_v)` (the two projections; the
norm and RoPE are elementwise and not counted).  It is an idealisation that
favours recompute (the GEMM at large-matmul speed, the written K/V not
counted): where it is below 1, recompute cannot win on this device.  With
`r = residual_bytes / kv_bytes` >= 1 (grouped-query models: the residual is
as large as the K/V it replaces, or larger) it is below 1 whatever the FLOPs.
"""

from __future__ import annotations

import copy
import math
import statistics
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from .verdicts import FAILS, HIGHER, HOLDS, SIZE_TOLERANCE, VERDICTS, judge

__all__ = ["measure", "figure", "summary", "Recomputer", "PAPER_SPEEDUP", "VERDICTS", "MAX_CELL_BYTES"]

PAPER_SPEEDUP = 5.0
MAX_CELL_BYTES = 1 << 30  # a cell whose buffers would pass this is skipped, and the row says so
MIN_SAMPLE_S = 1e-3  # shorter operations are repeated within a sample
MAX_INNER = 64
CALIBRATION = {  # (square matmul size, copy bytes) per device type
    "cpu": (1024, 64 << 20),
    "cuda": (4096, 256 << 20),
}
COLOURS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#8B4513", "#7F3C8D"]
FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=16, color="#111")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _resolve_device(device, default: torch.device) -> torch.device:
    import torch

    if device is None:
        return default
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Recomputer:
    """K and V of one global attention layer from that layer's input residuals, with the model's own modules.

    `Recomputer(loaded, layer=None, device=None)(residuals)`: residuals (b, n, d) of tokens at positions
    0..n-1 of each of b sequences -> K, V (b, n_kv, n, d_h), as the model hands them to its cache.  The
    layer's input norm, then `replay.KVProjector.project` (one GEMM per projection over the whole batch, as a
    batched prefill computes it).  On a device other than the model's, a copy of that one decoder layer and
    of the rotary embedding is made there (the shared model is never moved).
    """

    def __init__(self, loaded, layer: int | None = None, device=None):
        from ..kernels.replay import KVProjector
        from ..models import compat

        model = loaded.model
        specs = compat.layer_specs(model.config)
        if layer is None:
            spec = next((s for s in specs if not s.is_sliding), None)
            if spec is None:
                raise ValueError(f"{loaded.name}: every layer is a sliding-window layer; no global attention layer")
        else:
            if not -len(specs) <= layer < len(specs):
                raise ValueError(f"layer {layer} out of range: {loaded.name} has {len(specs)} layers")
            spec = specs[layer]
            if spec.is_sliding:
                raise ValueError(f"layer {spec.index} of {loaded.name} is a sliding-window layer; pick a global one")
        self.spec = spec
        self.index = spec.index
        model_device = next(model.parameters()).device
        self.device = _resolve_device(device, model_device)
        host = model
        if not _same_device(self.device, model_device):
            base = getattr(model, "model", None) or model.base_model
            layer_copy = copy.deepcopy(compat.decoder_layers(model)[spec.index]).to(self.device)
            rotary = getattr(base, "rotary_emb", None)
            rotary = copy.deepcopy(rotary).to(self.device) if rotary is not None else None
            host = SimpleNamespace(model=SimpleNamespace(layers={spec.index: layer_copy}, rotary_emb=rotary))
        decoder_layer = compat.decoder_layers(host)[spec.index]
        self.norm = getattr(decoder_layer, "input_layernorm", None)
        self.projector = KVProjector(host, spec)
        key, value = self.projector.key, self.projector.value
        self.d = key.linear.in_features
        self.kv_heads = key.num_heads
        self.head_dim = key.head_dim
        self.kv_elements = key.linear.out_features + value.linear.out_features  # per token, K and V
        self.flops_per_token = 2 * self.d * key.linear.out_features + 2 * self.d * value.linear.out_features
        self.dtype = key.linear.weight.dtype
        self.includes = ([type(self.norm).__name__ + " (input_layernorm)"] if self.norm is not None else []) + [
            "k_proj", "v_proj"] + (["k_norm"] if key.norm is not None else []) + (
            ["RoPE (family's apply_rotary_pos_emb, applied to (K, K) as the project's rebuild does)"]
            if key.rope is not None and key.rotary is not None else [])

    def __call__(self, residuals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm(residuals) if self.norm is not None else residuals
        return self.projector.project(x, 0)


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds per call of `fn` over `repeats` samples, after one warm-up call."""
    from ..measure.timing import clock

    t0 = clock(device)
    fn()
    once = clock(device) - t0
    inner = 1 if once >= MIN_SAMPLE_S else min(MAX_INNER, math.ceil(MIN_SAMPLE_S / max(once, 1e-7)))
    samples = []
    for _ in range(max(1, repeats)):
        t0 = clock(device)
        for _ in range(inner):
            fn()
        samples.append((clock(device) - t0) / inner)
    return statistics.median(samples)


def calibrate(device: torch.device, dtype: torch.dtype, host_copy: bool = False, repeats: int = 3) -> dict:
    """The device's balance point: achieved FLOP/s of a large square matmul in `dtype`, bytes/s of a large
    tensor copy (bytes copied per second), and with `host_copy` on CUDA the pinned host-to-device copy's."""
    import torch

    size, copy_bytes = CALIBRATION.get(device.type, CALIBRATION["cpu"])
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, dtype)
    b = torch.randn(size, size, generator=gen).to(device, dtype)
    flops_s = 2 * size ** 3 / _time(lambda: torch.mm(a, b), device, repeats)  # noqa: F821 (deleted after the closure last runs)
    del a, b
    elements = copy_bytes // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(elements, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    bytes_s = copy_bytes / _time(lambda: dst.copy_(src), device, repeats)
    del src, dst
    host_s = None
    if host_copy and device.type == "cuda":
        src = torch.empty(elements, dtype=dtype, pin_memory=True).normal_()
        dst = torch.empty(elements, dtype=dtype, device=device)
        host_s = copy_bytes / _time(lambda: dst.copy_(src, non_blocking=True), device, repeats)
        del src, dst
    return {"device_flops_per_s": float(flops_s), "device_bytes_per_s": float(bytes_s),
            "host_bytes_per_s": None if host_s is None else float(host_s)}


def _bound(kv_bytes: int, residual_bytes: int, flops: int, flops_s: float, bytes_s: float,
           read_bytes_s: float | None = None) -> float:
    read_bytes_s = read_bytes_s or bytes_s
    return (kv_bytes / read_bytes_s) / (flops / flops_s + residual_bytes / bytes_s)


def _cell_bytes(kv_bytes: int, residual_bytes: int, host: bool) -> int:
    """An estimate of the buffers one cell holds at once: residuals and their normed copy, the cached K/V and
    the read's output, the recompute's projections, rotation temporaries and output (and, for the host regime,
    the pinned copy and its device output)."""
    return 2 * residual_bytes + 6 * kv_bytes + (2 * kv_bytes if host else 0)


def measure(loaded, batch_sizes=(1, 4, 16, 64), contexts=(256, 1024, 4096), layer: int | None = None,
            repeats: int = 5, device=None, host_copy: bool | None = None,
            max_cell_bytes: int = MAX_CELL_BYTES, threads: int | None = None) -> dict:
    """Time reading cached K/V against recomputing them from residuals, for every (batch, context).

    `loaded`: a `models.LoadedModel`.  `layer`: a global attention layer (default: the first).  `device`:
    where to run (default: the model's).  `host_copy`: also time K/V copied from pinned host memory (default:
    on CUDA only; ignored elsewhere, with a note).  See the module docstring for exactly what is timed.
    Returns plain JSON types; a cell whose buffers would pass `max_cell_bytes` is not run, and its row says so
    under "skipped".  `threads`: intra-op threads while timing (default: the process's; restored after).  On a
    CPU shared with other busy processes, parallel kernels wait for descheduled threads (measured here: a
    1 MB `torch.cat` took 16 ms with 2 threads on 2 busy cores), so pass `threads=1` there.
    """
    import torch

    from ..models.threads import pin

    previous = torch.get_num_threads()
    if threads is not None:
        pin(int(threads))
    try:
        return _measure(loaded, batch_sizes, contexts, layer, repeats, device, host_copy, max_cell_bytes)
    finally:
        pin(previous)


def _measure(loaded, batch_sizes, contexts, layer, repeats, device, host_copy, max_cell_bytes) -> dict:
    import torch

    recompute = Recomputer(loaded, layer, device)
    dev, dtype = recompute.device, recompute.dtype
    notes = []
    if host_copy is None:
        host_copy = dev.type == "cuda"
    elif host_copy and dev.type != "cuda":
        notes.append(f"host copy needs a CUDA device; not measured on {dev.type}")
        host_copy = False
    element = torch.empty((), dtype=dtype).element_size()
    kv_per_token = recompute.kv_elements * element
    residual_per_token = recompute.d * element
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.inference_mode():
        balance = calibrate(dev, dtype, host_copy)
        flops_s, bytes_s, host_s = (balance["device_flops_per_s"], balance["device_bytes_per_s"],
                                    balance["host_bytes_per_s"])
        rows = []
        for b in batch_sizes:
            for n in contexts:
                b, n = int(b), int(n)
                tokens = b * n
                kv_bytes, residual_bytes = tokens * kv_per_token, tokens * residual_per_token
                flops = tokens * recompute.flops_per_token
                row = {"batch": b, "context": n, "tokens": tokens, "read_ms": None, "recompute_ms": None,
                       "host_read_ms": None, "speedup": None, "host_speedup": None,
                       "bound_speedup": _bound(kv_bytes, residual_bytes, flops, flops_s, bytes_s),
                       "host_bound_speedup": (_bound(kv_bytes, residual_bytes, flops, flops_s, bytes_s, host_s)
                                              if host_s else None),
                       "kv_bytes": kv_bytes, "residual_bytes": residual_bytes, "flops": flops,
                       "intensity": flops / residual_bytes, "skipped": None}
                need = _cell_bytes(kv_bytes, residual_bytes, host_copy)
                if need > max_cell_bytes:
                    row["skipped"] = (f"buffers of about {need / 2**20:.0f} MiB would pass the "
                                      f"{max_cell_bytes / 2**20:.0f} MiB cap per cell")
                    rows.append(row)
                    continue
                residuals = torch.randn(b, n, recompute.d, generator=gen).to(dev, dtype)
                keys, values = recompute(residuals)  # the cache's K/V of these tokens (and a first warm-up)
                k_old, k_new = keys[..., :n - 1, :].contiguous(), keys[..., n - 1:, :].contiguous()
                v_old, v_new = values[..., :n - 1, :].contiguous(), values[..., n - 1:, :].contiguous()

                def read():
                    return torch.cat([k_old, k_new], dim=-2), torch.cat([v_old, v_new], dim=-2)  # noqa: F821 (deleted after the closure last runs)

                read_s = _time(read, dev, repeats)
                recompute_s = _time(lambda: recompute(residuals), dev, repeats)  # noqa: F821 (deleted after the closure last runs)
                row.update(read_ms=read_s * 1e3, recompute_ms=recompute_s * 1e3, speedup=read_s / recompute_s)
                if host_copy:
                    k_host = keys.to("cpu").pin_memory()
                    v_host = values.to("cpu").pin_memory()
                    host_read_s = _time(lambda: (k_host.to(dev, non_blocking=True),
                                                 v_host.to(dev, non_blocking=True)), dev, repeats)
                    row.update(host_read_ms=host_read_s * 1e3, host_speedup=host_read_s / recompute_s)
                    del k_host, v_host
                del residuals, keys, values, k_old, k_new, v_old, v_new
                rows.append(row)
    if any(r["skipped"] for r in rows):
        notes.append(f"{sum(1 for r in rows if r['skipped'])} cell(s) skipped: over the memory cap per cell")
    above = [r for r in rows if r["speedup"] is not None and r["speedup"] > r["bound_speedup"]]
    if above:
        notes.append(f"{len(above)} cell(s) measured above the arithmetic-intensity bound (e.g. b={above[0]['batch']},"
                     f" n={above[0]['context']}: {above[0]['speedup']:.3g}x against {above[0]['bound_speedup']:.3g}x)"
                     ": the bound is optimistic for recompute, so this points at a slow read (a busy CPU, page "
                     "faults of fresh buffers); on a shared CPU, rerun with threads=1")
    return {
        "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "model": loaded.name,
        "layer": recompute.index, "threads": torch.get_num_threads(),
        "device_flops_per_s": flops_s, "device_bytes_per_s": bytes_s, "host_bytes_per_s": host_s,
        "flop_per_byte": flops_s / bytes_s,
        "d": recompute.d, "kv_heads": recompute.kv_heads, "head_dim": recompute.head_dim,
        "kv_bytes_per_token": kv_per_token, "residual_bytes_per_token": residual_per_token,
        "ratio_r": residual_per_token / kv_per_token, "flops_per_token": recompute.flops_per_token,
        "recompute_includes": recompute.includes, "repeats": int(repeats),
        "timed": {"read": "torch.cat of cached K/V (n-1 tokens) and the step's token, K and V, into fresh "
                          "buffers in device memory",
                  "recompute": "input norm + KVProjector.project (k/v GEMMs, k_norm, RoPE) from stored raw "
                               "residuals into fresh K/V buffers",
                  "host_read": "pinned host K/V copied into fresh device buffers (non_blocking, synchronised)"},
        "notes": notes, "rows": rows,
    }


def _measured(result: dict) -> list[dict]:
    return [r for r in result["rows"] if not r.get("skipped") and r.get("speedup") is not None]


def _where(row: dict | None) -> dict | None:
    return None if row is None else {"batch": row["batch"], "context": row["context"], "tokens": row["tokens"]}


def _x(value: float) -> str:
    return f"{value:.3g}x"


def _threads(result: dict) -> str:
    return f"{result['threads']} thread{'' if result['threads'] == 1 else 's'}"


def summary(result: dict) -> dict:
    """The largest measured speed-up and where, the largest bound, and a verdict on the paper's claim.

    Verdict: the report's one rule (`verdicts.judge`) on the best speed-up, from device memory or from a host
    copy, against the paper's 5x, higher is better, no gain at 1x.
    """
    rows = _measured(result)
    host_rows = [r for r in rows if r.get("host_speedup") is not None]
    best = max(rows, key=lambda r: r["speedup"], default=None)
    best_host = max(host_rows, key=lambda r: r["host_speedup"], default=None)
    bounds = [r["bound_speedup"] for r in result["rows"] if r.get("bound_speedup") is not None]
    host_bounds = [r["host_bound_speedup"] for r in result["rows"] if r.get("host_bound_speedup") is not None]
    where = f"{result['device']} ({result['dtype']}, {_threads(result)}, {result['model']} layer {result['layer']})"
    skipped = len(result["rows"]) - len(rows)
    agree = all((r["speedup"] > 1) == (r["bound_speedup"] > 1) for r in rows)
    out = {
        "best_speedup": None if best is None else best["speedup"], "best_at": _where(best),
        "best_host_speedup": None if best_host is None else best_host["host_speedup"],
        "best_host_at": _where(best_host),
        "largest_bound": max(bounds, default=None), "largest_host_bound": max(host_bounds, default=None),
        "paper_speedup": PAPER_SPEEDUP, "measured_cells": len(rows), "skipped_cells": skipped,
        "bound_agrees": agree, "cells_above_bound": sum(1 for r in rows if r["speedup"] > r["bound_speedup"]),
    }
    if best is None:
        out.update(verdict=FAILS, sentence=f"Nothing was measured on {where}: every cell was "
                                                          "skipped, so the claim is not supported here.")
        return out
    s, at = best["speedup"], f"b={best['batch']}, n={best['context']}"
    kv_t, res_t = result["kv_bytes_per_token"], result["residual_bytes_per_token"]
    gemm = f"a {result['d']}x{2 * result['kv_heads'] * result['head_dim']} GEMM per token " \
           f"({result['flops_per_token']:,} FLOPs, {best['intensity']:.3g} FLOP per residual byte against " \
           f"this device's balance of {result['flop_per_byte']:.3g} FLOP/byte)"
    r_words = (f"a residual ({res_t} B) is already {'as large as' if res_t == kv_t else 'larger than'} the K/V "
               f"it replaces ({kv_t} B, r = {result['ratio_r']:.3g})" if res_t >= kv_t else
               f"a residual is {res_t} B against {kv_t} B of K/V (r = {result['ratio_r']:.3g})")
    bound_words = f"the arithmetic-intensity bound allows at most {_x(out['largest_bound'])} here"
    hs = best_host["host_speedup"] if best_host is not None else None
    verdict = judge(PAPER_SPEEDUP, max(s, hs or s), HIGHER, SIZE_TOLERANCE, 1.0)
    if hs is None or s >= hs:
        if verdict == HOLDS:
            sentence = (f"Holds on {where}: recompute is up to {_x(s)} faster than reading cached K/V (at {at}), "
                        f"within {SIZE_TOLERANCE:.0%} of the paper's {PAPER_SPEEDUP:g}x or above; {bound_words}.")
        elif s > 1:
            sentence = (f"Holds in direction, not in size, on {where}: recompute beats reading cached K/V, but only up "
                        f"to {_x(s)} (at {at}), below the paper's {PAPER_SPEEDUP:g}x; {bound_words}.")
    if hs is not None and hs > s and hs > 1:
        sentence = (f"{'Holds' if verdict == HOLDS else 'Holds in direction, not in size,'} on {where}: only with "
                    f"K/V held in host memory and copied over the host "
                    f"link ({result['host_bytes_per_s'] / 1e9:.3g} GB/s) is recompute faster, up to {_x(hs)} (at "
                    f"b={best_host['batch']}, n={best_host['context']}"
                    f"{'' if hs >= PAPER_SPEEDUP else f', below the paper’s {PAPER_SPEEDUP:g}x'}); with K/V in "
                    + (f"device memory reading stays {_x(1 / s)} faster than recomputing, since {r_words} and "
                       f"recompute adds {gemm}." if s < 1 else f"device memory recompute reaches {_x(s)}."))
    elif max(s, hs or s) <= 1:
        if host_rows:
            tail = (f"; even copying K/V from pinned host memory ({result['host_bytes_per_s'] / 1e9:.3g} GB/s) is "
                    f"faster, by at least {_x(1 / best_host['host_speedup'])}")
        else:
            tail = ("; the claim needs K/V held off the device (host memory over PCIe) — see the host-copy rows "
                    "when run on CUDA")
        sentence = (f"Does not hold on {where}: recompute is {_x(1 / s)} slower than reading cached K/V even at "
                    f"its best cell ({at}), because {r_words} and recompute adds {gemm}, so {bound_words}"
                    f"{tail}.")
    if not agree:
        sentence = sentence[:-1] + "; note: some cells fall on the other side of 1 from their bound."
    out.update(verdict=verdict, sentence=sentence)
    return out


def figure(result: dict):
    """Speed-up (read / recompute) against tokens (log-log), one line per batch size (dashed: host copy), the
    arithmetic-intensity bound (dotted), the break-even line at 1 and the paper's 5x."""
    import plotly.graph_objects as go

    rows = _measured(result)
    fig = go.Figure()
    batches = sorted({r["batch"] for r in rows})
    for i, b in enumerate(batches):
        mine = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["tokens"])
        colour = COLOURS[i % len(COLOURS)]
        fig.add_trace(go.Scatter(
            x=[r["tokens"] for r in mine], y=[r["speedup"] for r in mine], mode="lines+markers",
            name=f"batch {b}: device read / recompute", line=dict(color=colour, width=3), marker=dict(size=10),
            customdata=[[r["context"], r["read_ms"], r["recompute_ms"]] for r in mine],
            hovertemplate="context %{customdata[0]}: read %{customdata[1]:.3g} ms, recompute "
                          "%{customdata[2]:.3g} ms, speed-up %{y:.3g}x<extra></extra>"))
        host = [r for r in mine if r.get("host_speedup") is not None]
        if host:
            fig.add_trace(go.Scatter(
                x=[r["tokens"] for r in host], y=[r["host_speedup"] for r in host], mode="lines+markers",
                name=f"batch {b}: host-copy read / recompute", line=dict(color=colour, width=3, dash="dash"),
                marker=dict(size=10, symbol="diamond-open")))
    tokens = sorted({r["tokens"] for r in result["rows"]})
    xs = [tokens[0], tokens[-1]] if tokens else [1, 1]
    by_tokens = sorted((r for r in result["rows"] if r.get("bound_speedup") is not None), key=lambda r: r["tokens"])
    if by_tokens:
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in by_tokens], y=[r["bound_speedup"] for r in by_tokens],
                                 mode="lines", name="bound: arithmetic intensity (K/V in device memory)",
                                 meta="bound", line=dict(color="#333", width=2, dash="dot")))
    host_bound = [r for r in by_tokens if r.get("host_bound_speedup") is not None]
    if host_bound:
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in host_bound], y=[r["host_bound_speedup"] for r in host_bound],
                                 mode="lines", name="bound: K/V in host memory", meta="host_bound",
                                 line=dict(color="#888", width=2, dash="dot")))
    fig.add_trace(go.Scatter(x=xs, y=[PAPER_SPEEDUP, PAPER_SPEEDUP], mode="lines", meta="paper",
                             name=f"paper: up to {PAPER_SPEEDUP:g}x", line=dict(color="#C00000", width=2,
                                                                                dash="dashdot")))
    fig.add_hline(y=1, line=dict(color="#111", width=1.5))
    # On a log axis an annotation's y is log10 of the value: 0 is the break-even line at 1.
    fig.add_annotation(text="recompute wins above", xref="paper", x=0.005, xanchor="left", yref="y", y=0,
                       yanchor="bottom", showarrow=False, font=dict(size=15, color="#111"))
    values = [v for r in rows for v in (r["speedup"], r.get("host_speedup")) if v] + [
        v for r in result["rows"] for v in (r.get("bound_speedup"), r.get("host_bound_speedup")) if v] + [
        PAPER_SPEEDUP, 1.0]
    low, high = math.log10(min(values)) - 0.15, math.log10(max(values)) + 0.15
    ticks = sorted({10.0 ** p for p in range(math.floor(low), math.ceil(high) + 1)} | {PAPER_SPEEDUP})
    ticks = [t for t in ticks if low <= math.log10(t) <= high]
    fig.update_xaxes(type="log", title_text="tokens whose K/V one layer needs (batch × context)")
    fig.update_yaxes(type="log", range=[low, high], tickmode="array", tickvals=ticks,
                     ticktext=[f"{t:g}x" for t in ticks], minor=dict(showgrid=False),
                     title_text="speed-up: read time ÷ recompute time")
    title = (f"Recompute K/V vs read cached K/V: {result['model']} layer {result['layer']}, "
             f"{result['device']}, {result['dtype']}, {_threads(result)}")
    fig.update_layout(template="plotly_white", font=FONT, height=560,
                      title=dict(text=title, x=0.01, y=0.98, yanchor="top", font=dict(size=20)),
                      margin=dict(l=80, r=30, t=80, b=40), hoverlabel=dict(font_size=14),
                      legend=dict(orientation="h", yanchor="top", y=-0.2, x=0, font=dict(size=14)))
    skipped = [r for r in result["rows"] if r.get("skipped")]
    if skipped:
        fig.add_annotation(text=f"{len(skipped)} cell(s) skipped (memory cap)", showarrow=False, xref="paper",
                           yref="paper", x=1, y=1.02, xanchor="right", font=dict(size=14, color="#555"))
    return fig
