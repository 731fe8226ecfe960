"""The invariance probe: which calls give a row the same bits whatever else is in the call, here; kept on disk.

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

GEMM verdicts are kept on disk (`Store`), one file per model, dtype and device in a folder per machine and build
(CPU model and flags, torch's version and build, `VERSION`); the file holds the verdicts of every thread count
run here (a write merges this process's into it).  The file proves nothing by itself: every start probes afresh
(every count, proven and failed, at every offset, twice, and the large call at one thread and at the run's count,
on the verdict's device), and a stored verdict is only compared with what the probe finds here.  Where they
differ (an edited file, or a machine that changed under the same name), the probe's verdict is the one used, the
file is rewritten and the run says so (`Store.notes`, in the kernels' report); a file that cannot be read, or an
entry the probe could not have written, is said too.  A re-check of the stored counts would cost what the probe
does, so the probe is the re-check.
`KVDIRECT_PROBE_CACHE` names the folder (default beside the models' cached copies:
``~/.cache/kvdirect-studio/probes``); ``off`` keeps verdicts in memory only.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.threads import one_thread, threads_set
from ..plain.paths import cache
from . import dots

VERSION = 5  # stored verdicts of another version are not read: bump it when a kernel or the probe changes
ROWS = (16, 32, 64, 128, 256, 512)  # every probed GEMM of the invariant path has one of these row counts
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


def candidates_of(key: tuple) -> tuple[int, ...]:
    """The row counts the probe tries for a verdict's key (ValueError: not a key it writes)."""
    if key[0] == "linear" and len(key) == 6:
        return ROWS[:1] if math.prod(key[1]) >= HEAD_ELEMENTS else ROWS
    if key[0] == "attention rows" and len(key) == 5:
        return ROWS
    raise ValueError(f"not a verdict's key: {key!r}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ranges(counts) -> str:
    """`16, 32-64` style: consecutive proven counts of ROWS joined."""
    return ", ".join(str(c) for c in counts) or "none"


# --- the probes ------------------------------------------------------------------------------------------------
def probe_linear(weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Verdict:
    """Counts m of ROWS whose rows equal those of a large call of `F.linear`, at every offset, twice, at `threads`."""
    key = linear_key(weight, bias, threads)
    candidates = candidates_of(key)
    passed, across = _linear_rows(weight, bias, threads, candidates)
    return Verdict(key, passed, across, tuple(m for m in candidates if m not in passed))


def _linear_rows(weight: torch.Tensor, bias: torch.Tensor | None, threads: int, counts, offsets=OFFSETS,
                 repeats: int = 2) -> tuple[tuple[int, ...], bool]:
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
            passed = tuple(m for m in counts if steady and all(torch.equal(call(x[o:o + m]), ref[o:o + m])
                                                               for o in offsets for _ in range(repeats)))
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
                    scores = torch.matmul(x[:, :, o:o + m].expand(2, blocks, m, head_dim), k[:, :blocks].transpose(2, 3))
                    pv = torch.matmul(p[:, :blocks, o:o + m].contiguous(), k[:, :blocks])
                    same &= (torch.equal(scores, ref[0][:, :blocks, o:o + m])
                             and torch.equal(pv, ref[1][:, :blocks, o:o + m]))
            if same:
                passed.append(m)
    return tuple(passed)


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
                if not torch.equal(dots.linear(x[o:o + m], w, b, name=path, threads=threads), whole[o:o + m]):
                    return False, f"{m} row(s) at row {o} differ from the same rows in a call of 40 (width {k})"
        if not torch.equal(dots.linear(x, w, b, name=path, threads=1), whole):
            return False, f"1 thread and {threads} threads give different bits (width {k})"
    return True, None


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
    """The verdicts of one loaded model: probed here at every start, and compared with its file's.

    Only GEMM verdicts (`Verdict`: a linear shape's or the attention's row counts) go to the file; the block
    attention's and the norms' ((ok, why)) are probed at every start and kept in memory."""

    def __init__(self, name: str, dtype: torch.dtype, device):
        env = environment(device)
        folder = root()
        tag = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)
        self.path = None if folder is None else folder / tag / f"{safe}-{_name(dtype)}-{torch.device(device)}.json"
        self.environment = env
        self.verdicts: dict[tuple, object] = {}  # key -> Verdict or (ok, why)
        self.notes: list[str] = []  # what the file said that the probe here did not find (the run says so)
        self.stored: dict[tuple, object] = self._read(self.notes)  # from the file, until compared with the probe
        self.confirmed = 0  # stored verdicts the probe found again in this process

    def _read(self, notes: list | None = None) -> dict:
        """The file's verdicts for this environment, each one the probe could have written (`_stored`); a file that
        cannot be read, or an entry the probe could not have written, is noted in `notes`."""
        if self.path is None or not self.path.is_file():
            return {}
        say = notes.append if notes is not None else (lambda line: None)
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            say(f"probe file {self.path.name}: not readable ({type(e).__name__}): every verdict probed afresh")
            return {}
        if not isinstance(data, dict) or data.get("environment") != self.environment:
            say(f"probe file {self.path.name}: not this machine's and build's: every verdict probed afresh")
            return {}
        entries = data.get("verdicts")
        verdicts = [_stored(entry) for entry in entries] if isinstance(entries, list) else [None]
        if any(v is None for v in verdicts):
            say(f"probe file {self.path.name}: {sum(v is None for v in verdicts)} entry(ies) the probe could not have "
                "written (edited?): ignored")
        return {v.key: v for v in verdicts if v is not None}

    def _write(self):
        """This process's verdicts, merged into the file's (those of other keys, e.g. other thread counts, stay)."""
        if self.path is None:
            return
        merged = self._read() | {k: v for k, v in self.verdicts.items() if isinstance(v, Verdict)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump({"environment": self.environment, "verdicts": [v.as_dict() for v in merged.values()]}, f)
            os.replace(f.name, self.path)
        except OSError:
            pass  # a folder that cannot be written: the verdicts stay in memory

    def get(self, key: tuple, probe, keep: bool = False):
        """The verdict for `key`: known in this process, else `probe()` here.  `keep`: a verdict the file holds (a
        GEMM's); the file's, if any, is compared with the probe's, and where they differ the probe's is used, the
        file rewritten and a note made."""
        if key in self.verdicts:
            return self.verdicts[key]
        fresh = self.verdicts[key] = probe()
        if keep:
            stored = self.stored.pop(key, None)
            if stored == fresh:
                self.confirmed += 1
                return fresh
            if stored is not None:
                self.notes.append(f"the probe file said {describe(stored)}; the probe here finds {describe(fresh)}: "
                                  "the file was edited or the machine changed; the probe's verdict is used, the file "
                                  "rewritten")
            self._write()
        return fresh

    def clear(self):
        self.verdicts.clear()
        self.stored.clear()


def describe(v: Verdict) -> str:
    """A verdict in words: its shape or geometry, thread count, proven and failed counts, the thread equality."""
    what = (f"a {'x'.join(map(str, v.key[1]))} GEMM{' with bias' if v.key[2] else ''} at {v.threads} thread(s)"
            if v.key[0] == "linear" else f"the attention's GEMMs (head size {v.key[1]})")
    return (f"{what} proven at {ranges(v.counts)}, failing at {ranges(v.failed)}"
            + (f", {'the same' if v.across_threads else 'other'} bits at 1 thread" if v.key[0] == "linear" else ""))


def _stored(entry) -> Verdict | None:
    """A file's entry as a Verdict, or None where it is not one the probe could have written: its counts, proven
    and failed, are the probe's for its key (`candidates_of`), each once, proven ascending; across_threads a bool."""
    try:
        key, proven, failed, across = _tuple(entry["key"]), entry["proven"], entry["failed"], entry["across_threads"]
        counts = proven + failed
        hash(key)  # TypeError where a JSON object sits in it: not a key the probe writes
        if (isinstance(across, bool) and all(type(c) is int for c in counts) and proven == sorted(proven)
                and sorted(counts) == list(candidates_of(key))):
            return Verdict(key, tuple(proven), across, tuple(failed))
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    return None


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value
