"""The invariance probe: which calls give a row the same bits whatever else is in the call, here; kept on disk.

The invariant kernels (`kernels.py`) hold by construction where they can, and are proven where they cannot:

* every GEMM of the invariant path has one of a few row counts (`ROWS`), zero rows added.  A linear layer's
  GEMM runs at the run's thread count (it is most of a step's work), so for each weight shape the probe
  proves which of those counts give a large call's rows bit for bit, wherever the rows sit in the call, on
  two calls in a row (a count whose result changes from one call to the next is not proven), and that the
  large call gives the same bits at one thread and at the run's count;
* the block attention runs on one thread whatever the run's count (`threads.one_thread`), so the order of
  each of its reductions (the scores' and P@V's GEMMs, the maximum, the exponent sums, the sums over blocks)
  is fixed by the shapes alone; the probe proves its GEMMs' row counts and that a query gets the same bits
  alone, among many queries and over more keys;
* the model's row-wise reductions (RMSNorm's mean of squares, q/k norms) give a row the same bits alone and
  among many rows (`probe_rows`).

A count that was not proven is never used (`Verdict.pad` raises above the largest one), and a verdict is read
only for the shapes, dtype, device and thread count it was proven for.

Verdicts are kept on disk (`Store`), one file per model, dtype and device in a folder per machine and build
(CPU model and flags, torch's version and build, `VERSION`).  A later start reads them and re-checks a few
rows of each (`recheck`) instead of probing again; a re-check that fails probes that verdict afresh.
`KVDIRECT_PROBE_CACHE` names the folder (default beside the models' cached copies:
``~/.cache/kvdirect-studio/probes``); ``off`` keeps verdicts in memory only.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .paths import cache
from .threads import one_thread, threads_set

VERSION = 3  # stored verdicts of another version are not read: bump it when a kernel or the probe changes
ROWS = (16, 32, 64, 128, 256, 512)  # every GEMM of the invariant path has one of these row counts
HEAD_ELEMENTS = 1 << 23  # a weight this large (the output head) sees one row per lane: probed at ROWS[0] only
OFFSETS = (0, 5, 16)  # where the probed rows sit in the large call
BLOCK = 64  # keys per attention block (kernels.py)
CACHE_ENV = "KVDIRECT_PROBE_CACHE"


@dataclass(frozen=True)
class Verdict:
    """Which row counts of one GEMM shape give the rows of a large call, bit for bit, here."""

    key: tuple
    counts: tuple[int, ...]  # proven counts, ascending
    across_threads: bool  # the large call gives the same bits at one thread and at the verdict's count
    failed: tuple[int, ...] = ()  # probed counts that differed

    @property
    def largest(self) -> int:
        return self.counts[-1] if self.counts else 0

    def pad(self, m: int) -> int:
        """The smallest proven count >= m; a call of more rows than the largest must be split first."""
        i = bisect.bisect_left(self.counts, m)
        if i == len(self.counts):
            raise ValueError(f"a GEMM of {m} rows: no proven count holds it (largest {self.largest}); split it")
        return self.counts[i]

    @property
    def threads(self) -> int:
        return self.key[-1]

    def as_dict(self) -> dict:
        return {"key": list(self.key), "proven": list(self.counts), "failed": list(self.failed),
                "across_threads": self.across_threads}


def linear_key(weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> tuple:
    return ("linear", tuple(weight.shape), bias is not None, _name(weight.dtype), str(weight.device), threads)


def attention_rows_key(head_dim: int, dtype: torch.dtype, device) -> tuple:
    return ("attention rows", head_dim, _name(dtype), str(device), 1)  # the block attention runs on one thread


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ranges(counts) -> str:
    """`16, 32-64` style: consecutive proven counts of ROWS joined."""
    return ", ".join(str(c) for c in counts) or "none"


# --- the probes ------------------------------------------------------------------------------------------------
def probe_linear(weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Verdict:
    """Counts m of ROWS whose rows of `F.linear` equal those of a large call, at every offset, twice, at `threads`."""
    head = weight.numel() >= HEAD_ELEMENTS
    candidates = ROWS[:1] if head else ROWS
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(candidates[-1] + OFFSETS[-1] + 8, weight.shape[1], generator=gen).to(weight)
    call = functools.partial(F.linear, weight=weight, bias=bias)  # the layer's own weight: no copy of a large head
    with torch.inference_mode():
        with threads_set(1):
            one = call(x)
        with threads_set(threads):
            ref = call(x)
            steady = torch.equal(ref, call(x))
            passed, failed = [], []
            for m in candidates:
                same = steady and all(torch.equal(call(x[o:o + m]), ref[o:o + m]) for o in OFFSETS for _ in range(2))
                (passed if same else failed).append(m)
    return Verdict(linear_key(weight, bias, threads), tuple(passed), torch.equal(one, ref), tuple(failed))


def probe_attention_rows(head_dim: int, dtype: torch.dtype, device) -> Verdict:
    """Counts m of ROWS whose rows of the block attention's two GEMMs ((m, d) @ (d, 64) per block and
    (m, 64) @ (64, d)) equal those of a large call, over 1 and 7 blocks, at one thread (where they run)."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    top = ROWS[-1] + OFFSETS[-1] + 8
    x = torch.randn(2, 1, top, head_dim, generator=gen).to(device, torch.float32)
    k = torch.randn(2, 7, BLOCK, head_dim, generator=gen).to(device, torch.float32)
    p = torch.rand(2, 7, top, BLOCK, generator=gen).to(device, torch.float32)
    passed, failed = [], []
    with torch.inference_mode(), one_thread():
        ref = torch.matmul(x.expand(2, 7, top, head_dim), k.transpose(2, 3)), torch.matmul(p, k)
        for m in ROWS:
            same = True
            for blocks in (1, 7):
                for o in OFFSETS:
                    scores = torch.matmul(x[:, :, o:o + m].expand(2, blocks, m, head_dim), k[:, :blocks].transpose(2, 3))
                    pv = torch.matmul(p[:, :blocks, o:o + m].contiguous(), k[:, :blocks])
                    same &= (torch.equal(scores, ref[0][:, :blocks, o:o + m])
                             and torch.equal(pv, ref[1][:, :blocks, o:o + m]))
            (passed if same else failed).append(m)
    return Verdict(attention_rows_key(head_dim, dtype, device), tuple(passed), True, tuple(failed))


def probe_attention(attention, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, threads: int,
                    window: int | None = None, softcap: float | None = None) -> tuple[bool, str | None]:
    """Whether `attention` (the block attention with this device's row counts: `kernels.Kernels.attention`) gives
    a query the same bits alone, among many queries and over more keys, with the run at one thread and at
    `threads`; (ok, why not)."""
    one = attention
    gen = torch.Generator(device="cpu").manual_seed(2)
    total = 300
    q = torch.randn(heads, total, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(kv_heads, total, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(kv_heads, total, head_dim, generator=gen).to(device, dtype)
    scaling = head_dim ** -0.5
    with torch.inference_mode(), threads_set(threads):
        whole = one(q, k, v, total, scaling, softcap, window)
        for p in (0, 1, 63, 64, 65, 130, 299):
            alone = one(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], p + 1, scaling, softcap, window)
            if not torch.equal(alone[0], whole[p]):
                return False, f"one query at position {p} differs from the same query in a call of {total}"
        part = one(q[:, 100:164], k[:, :164], v[:, :164], 164, scaling, softcap, window)
        if not torch.equal(part, whole[100:164]):
            return False, "64 queries over their keys differ from the same queries in a longer call"
    with torch.inference_mode(), threads_set(1):
        if not torch.equal(one(q, k, v, total, scaling, softcap, window), whole):
            return False, f"a run at 1 thread and one at {threads} threads give different bits"
    return True, None


def probe_rows(module: torch.nn.Module, width: int, dtype: torch.dtype, device, threads: int) -> tuple[bool, str | None]:
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
                if not torch.equal(module(x[:, p:p + 1]), whole[:, p:p + 1]):
                    return False, f"{type(module).__name__}: row {p} alone differs from the same row among 300"
    if not torch.equal(one, whole):
        return False, f"{type(module).__name__}: 1 thread and {threads} threads give different bits"
    return True, None


def recheck(verdict: Verdict, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> bool:
    """A few rows of a stored verdict again (its smallest and largest proven counts, at one offset): a stored
    verdict is read only after this agrees."""
    if not verdict.counts:
        return True  # nothing is used from it
    gen = torch.Generator(device="cpu").manual_seed(5)
    with torch.inference_mode():
        if verdict.key[0] == "linear":
            w, b = weight, bias
            x = torch.randn(verdict.largest + OFFSETS[1], weight.shape[1], generator=gen).to(weight)
            with threads_set(verdict.threads):
                ref = F.linear(x, w, b)
                return all(torch.equal(F.linear(x[OFFSETS[1]:OFFSETS[1] + m], w, b), ref[OFFSETS[1]:OFFSETS[1] + m])
                           for m in dict.fromkeys((verdict.counts[0], verdict.largest)))
        head_dim = verdict.key[1]
        x = torch.randn(1, 1, verdict.largest + OFFSETS[1], head_dim, generator=gen)
        k = torch.randn(1, 1, BLOCK, head_dim, generator=gen)
        with one_thread():
            ref = torch.matmul(x, k.transpose(2, 3))
            return all(torch.equal(torch.matmul(x[:, :, OFFSETS[1]:OFFSETS[1] + m], k.transpose(2, 3)),
                                   ref[:, :, OFFSETS[1]:OFFSETS[1] + m])
                       for m in dict.fromkeys((verdict.counts[0], verdict.largest)))


# --- the verdicts kept -----------------------------------------------------------------------------------------
def environment(device) -> dict:
    """What the verdicts depend on besides the shapes: the processor, torch's build, this module's version."""
    model, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and model == platform.machine():
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    env = {"version": VERSION, "cpu": model, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
           "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
           "torch_build": torch.version.git_version}
    device = torch.device(device)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def root() -> Path | None:
    """The folder, or None when it is turned off (`paths.cache`)."""
    return cache(CACHE_ENV, "probes")


class Store:
    """The verdicts of one loaded model: probed here, or read from its file and re-checked once per process.

    Only GEMM verdicts (`Verdict`: a linear shape's or the attention's row counts) go to the file; the block
    attention's and the norms' ((ok, why): a few milliseconds each) are probed at every start."""

    def __init__(self, name: str, dtype: torch.dtype, device):
        env = environment(device)
        folder = root()
        tag = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)
        self.path = None if folder is None else folder / tag / f"{safe}-{_name(dtype)}-{torch.device(device)}.json"
        self.environment = env
        self.verdicts: dict[tuple, object] = {}  # key -> Verdict or (ok, why)
        self.stored: dict[tuple, object] = self._read()  # from the file, until re-checked
        self.read_from_file = 0  # verdicts taken from the file (and re-checked) in this process

    def _read(self) -> dict:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if data.get("environment") != self.environment:
            return {}
        out = {}
        try:
            for entry in data.get("verdicts", []):
                key = _tuple(entry["key"])
                out[key] = Verdict(key, tuple(entry["proven"]), bool(entry["across_threads"]), tuple(entry["failed"]))
        except (KeyError, TypeError, AttributeError):
            return {}  # not a file this version wrote: probed afresh (and written anew)
        return out

    def _write(self):
        if self.path is None:
            return
        entries = [v.as_dict() for v in self.verdicts.values() if isinstance(v, Verdict)]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump({"environment": self.environment, "verdicts": entries}, f)
            os.replace(f.name, self.path)
        except OSError:
            pass  # a folder that cannot be written: the verdicts stay in memory

    def get(self, key: tuple, probe, check=None):
        """The verdict for `key`: known in this process, else the file's if `check(verdict)` agrees, else
        `probe()`.  Only verdicts with a `check` are written to the file: the others (the block attention's and
        the norms', each a few milliseconds) are probed at every start."""
        if key in self.verdicts:
            return self.verdicts[key]
        stored = self.stored.pop(key, None)
        if stored is not None and check is not None and check(stored):
            self.verdicts[key] = stored
            self.read_from_file += 1
            return stored
        self.verdicts[key] = probe()
        if check is not None:
            self._write()
        return self.verdicts[key]

    def clear(self):
        self.verdicts.clear()
        self.stored.clear()


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value
