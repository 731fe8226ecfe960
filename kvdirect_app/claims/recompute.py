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

What a measurement says (`summary`: the best speed-up, the bound, a verdict) and its plot (`figure`) are
`recompute_report`'s, re-exported here: the report reads them without torch, which this module imports.
"""

from __future__ import annotations

import copy
import math
import statistics
from types import SimpleNamespace

import torch

from ..kernels.replay import KVProjector
from ..measure.timing import clock
from ..models import compat
from ..models.threads import pin
from .recompute_report import PAPER_SPEEDUP, figure, summary
from .verdicts import VERDICTS

__all__ = ["measure", "figure", "summary", "Recomputer", "PAPER_SPEEDUP", "VERDICTS", "MAX_CELL_BYTES"]

MAX_CELL_BYTES = 1 << 30  # a cell whose buffers would pass this is skipped, and the row says so
MIN_SAMPLE_S = 1e-3  # shorter operations are repeated within a sample
MAX_INNER = 64
CALIBRATION = {  # (square matmul size, copy bytes) per device type
    "cpu": (1024, 64 << 20),
    "cuda": (4096, 256 << 20),
}


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _resolve_device(device, default: torch.device) -> torch.device:
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
        self.includes = (
            ([type(self.norm).__name__ + " (input_layernorm)"] if self.norm is not None else [])
            + ["k_proj", "v_proj"]
            + (["k_norm"] if key.norm is not None else [])
            + (
                ["RoPE (family's apply_rotary_pos_emb, to K with an empty query slot, as the project's rebuild does)"]
                if key.rope is not None and key.rotary is not None
                else []
            )
        )

    def __call__(self, residuals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm(residuals) if self.norm is not None else residuals
        return self.projector.project(x, 0)


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds per call of `fn` over `repeats` samples, after one warm-up call."""
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
    size, copy_bytes = CALIBRATION.get(device.type, CALIBRATION["cpu"])
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, dtype)
    b = torch.randn(size, size, generator=gen).to(device, dtype)
    flops_s = 2 * size**3 / _time(lambda: torch.mm(a, b), device, repeats)  # noqa: F821 (deleted after the closure last runs)
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
    return {
        "device_flops_per_s": float(flops_s),
        "device_bytes_per_s": float(bytes_s),
        "host_bytes_per_s": None if host_s is None else float(host_s),
    }


def _bound(
    kv_bytes: int, residual_bytes: int, flops: int, flops_s: float, bytes_s: float, read_bytes_s: float | None = None
) -> float:
    read_bytes_s = read_bytes_s or bytes_s
    return (kv_bytes / read_bytes_s) / (flops / flops_s + residual_bytes / bytes_s)


def _cell_bytes(kv_bytes: int, residual_bytes: int, host: bool) -> int:
    """An estimate of the buffers one cell holds at once: residuals and their normed copy, the cached K/V and
    the read's output, the recompute's projections, rotation temporaries and output (and, for the host regime,
    the pinned copy and its device output)."""
    return 2 * residual_bytes + 6 * kv_bytes + (2 * kv_bytes if host else 0)


def measure(
    loaded,
    batch_sizes=(1, 4, 16, 64),
    contexts=(256, 1024, 4096),
    layer: int | None = None,
    repeats: int = 5,
    device=None,
    host_copy: bool | None = None,
    max_cell_bytes: int = MAX_CELL_BYTES,
    threads: int | None = None,
) -> dict:
    """Time reading cached K/V against recomputing them from residuals, for every (batch, context).

    `loaded`: a `models.LoadedModel`.  `layer`: a global attention layer (default: the first).  `device`:
    where to run (default: the model's).  `host_copy`: also time K/V copied from pinned host memory (default:
    on CUDA only; ignored elsewhere, with a note).  See the module docstring for exactly what is timed.
    Returns plain JSON types; a cell whose buffers would pass `max_cell_bytes` is not run, and its row says so
    under "skipped".  `threads`: intra-op threads while timing (default: the process's; restored after).  On a
    CPU shared with other busy processes, parallel kernels wait for descheduled threads (measured here: a
    1 MB `torch.cat` took 16 ms with 2 threads on 2 busy cores), so pass `threads=1` there.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        pin(int(threads))
    try:
        return _measure(loaded, batch_sizes, contexts, layer, repeats, device, host_copy, max_cell_bytes)
    finally:
        pin(previous)


def _measure(loaded, batch_sizes, contexts, layer, repeats, device, host_copy, max_cell_bytes) -> dict:
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
        flops_s, bytes_s, host_s = (
            balance["device_flops_per_s"],
            balance["device_bytes_per_s"],
            balance["host_bytes_per_s"],
        )
        rows = []
        for b in batch_sizes:
            for n in contexts:
                b, n = int(b), int(n)
                tokens = b * n
                kv_bytes, residual_bytes = tokens * kv_per_token, tokens * residual_per_token
                flops = tokens * recompute.flops_per_token
                row = {
                    "batch": b,
                    "context": n,
                    "tokens": tokens,
                    "read_ms": None,
                    "recompute_ms": None,
                    "host_read_ms": None,
                    "speedup": None,
                    "host_speedup": None,
                    "bound_speedup": _bound(kv_bytes, residual_bytes, flops, flops_s, bytes_s),
                    "host_bound_speedup": (
                        _bound(kv_bytes, residual_bytes, flops, flops_s, bytes_s, host_s) if host_s else None
                    ),
                    "kv_bytes": kv_bytes,
                    "residual_bytes": residual_bytes,
                    "flops": flops,
                    "intensity": flops / residual_bytes,
                    "skipped": None,
                }
                need = _cell_bytes(kv_bytes, residual_bytes, host_copy)
                if need > max_cell_bytes:
                    row["skipped"] = (
                        f"buffers of about {need / 2**20:.0f} MiB would pass the "
                        f"{max_cell_bytes / 2**20:.0f} MiB cap per cell"
                    )
                    rows.append(row)
                    continue
                residuals = torch.randn(b, n, recompute.d, generator=gen).to(dev, dtype)
                keys, values = recompute(residuals)  # the cache's K/V of these tokens (and a first warm-up)
                k_old, k_new = keys[..., : n - 1, :].contiguous(), keys[..., n - 1 :, :].contiguous()
                v_old, v_new = values[..., : n - 1, :].contiguous(), values[..., n - 1 :, :].contiguous()

                def read():
                    return torch.cat([k_old, k_new], dim=-2), torch.cat([v_old, v_new], dim=-2)  # noqa: F821 (deleted after the closure last runs)

                read_s = _time(read, dev, repeats)
                recompute_s = _time(lambda: recompute(residuals), dev, repeats)  # noqa: F821 (deleted after the closure last runs)
                row.update(read_ms=read_s * 1e3, recompute_ms=recompute_s * 1e3, speedup=read_s / recompute_s)
                if host_copy:
                    k_host = keys.to("cpu").pin_memory()
                    v_host = values.to("cpu").pin_memory()
                    host_read_s = _time(
                        lambda: (k_host.to(dev, non_blocking=True), v_host.to(dev, non_blocking=True)), dev, repeats
                    )
                    row.update(host_read_ms=host_read_s * 1e3, host_speedup=host_read_s / recompute_s)
                    del k_host, v_host
                del residuals, keys, values, k_old, k_new, v_old, v_new
                rows.append(row)
    if any(r["skipped"] for r in rows):
        notes.append(f"{sum(1 for r in rows if r['skipped'])} cell(s) skipped: over the memory cap per cell")
    above = [r for r in rows if r["speedup"] is not None and r["speedup"] > r["bound_speedup"]]
    if above:
        notes.append(
            f"{len(above)} cell(s) measured above the arithmetic-intensity bound (e.g. b={above[0]['batch']},"
            f" n={above[0]['context']}: {above[0]['speedup']:.3g}x against {above[0]['bound_speedup']:.3g}x)"
            ": the bound is optimistic for recompute, so this points at a slow read (a busy CPU, page "
            "faults of fresh buffers); on a shared CPU, rerun with threads=1"
        )
    return {
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "model": loaded.name,
        "layer": recompute.index,
        "threads": torch.get_num_threads(),
        "device_flops_per_s": flops_s,
        "device_bytes_per_s": bytes_s,
        "host_bytes_per_s": host_s,
        "flop_per_byte": flops_s / bytes_s,
        "d": recompute.d,
        "kv_heads": recompute.kv_heads,
        "head_dim": recompute.head_dim,
        "kv_bytes_per_token": kv_per_token,
        "residual_bytes_per_token": residual_per_token,
        "ratio_r": residual_per_token / kv_per_token,
        "flops_per_token": recompute.flops_per_token,
        "recompute_includes": recompute.includes,
        "repeats": int(repeats),
        "timed": {
            "read": "torch.cat of cached K/V (n-1 tokens) and the step's token, K and V, into fresh "
            "buffers in device memory",
            "recompute": "input norm + KVProjector.project (k/v GEMMs, k_norm, RoPE) from stored raw "
            "residuals into fresh K/V buffers",
            "host_read": "pinned host K/V copied into fresh device buffers (non_blocking, synchronised)",
        },
        "notes": notes,
        "rows": rows,
    }
