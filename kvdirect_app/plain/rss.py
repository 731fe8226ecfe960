"""The process's resident memory as the operating system sees it (Linux), and handing freed heap back to it.

Why this exists: a sceptic measures a run from outside (`top`, `/usr/bin/time -v`), not with our allocator
trace.  Two things hid the caches' differences there:

* the model's load peaked above anything a run does (the GGUF file is dequantised into a state dict that lives
  beside the model's own weights): `model_cache` keeps a copy that loads with no such transient.  `peak()`
  reads the kernel's high-water mark (VmHWM) and `reset_peak()` starts it afresh (`/proc/self/clear_refs`), so
  a process can report its load's peak and its run's apart; but the figure `/usr/bin/time` and `wait4` report
  (ru_maxrss) also keeps the mark recorded whenever a thread exits, so resetting is no way round a high load;
* glibc keeps freed memory in its heap for reuse, so RSS stays at the highest it ever was (and a replay's
  buffers, freed layer after layer in a shifting pattern, spread the heap well past their live peak):
  `trim()` hands what is free back (`malloc_trim`) after the load and between sessions, `release()` (no
  garbage collection, ~5-10 ms) after every prompt piece and after each layer of a long AnchorKV replay.

Measured (SmolLM2, 2,500-token prompt, 8 new tokens, `run --solo` under `/usr/bin/time -v`, peak RSS of
`full` / `anchorkv:spacing=30:budget=16:rebuild=step`): GGUF load in the process: 1,199 / 1,199 MiB (the
load's peak); cached copy (`model_cache`): 1,103-1,111 / 1,058-1,076 MiB; plus `release()` after prompt
pieces and replayed layers: 1,103-1,111 / 1,037-1,038 MiB.  Tried and left: glibc's mmap threshold fixed at
128 KiB (`mallopt`, `MALLOC_MMAP_THRESHOLD_`, with or without transparent huge pages): 1,069 / 992 MiB, but
every large tensor then faults in fresh pages and a replaying step took 26-70 % longer; MALLOC_ARENA_MAX=1:
no gain.

Plain Python (no torch): the UI and the CLI use it alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import threading
from pathlib import Path

_LIBC = None
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameters (malloc.h)
KEPT_TRIM_BYTES = 1 << 30
DEFAULT_MMAP_MAX, DEFAULT_TRIM_BYTES = 65536, 128 * 1024  # glibc's defaults
_KEPT = 0  # how many `kept_heap` blocks are open (the setting is the process's)
_KEPT_LOCK = threading.Lock()


def _libc():
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name) if name else False
    return _LIBC or None


def trim() -> bool:
    """Collect garbage, then give the heap's free pages back to the OS (glibc's `malloc_trim`); False where
    there is no glibc (the call does nothing there)."""
    gc.collect()
    return release()


def release() -> bool:
    """Give the heap's free pages back to the OS now (`malloc_trim`, no garbage collection: cheap enough to call
    after every engine step); inside `kept_heap`, nothing (False)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim") or _KEPT:
        return False
    libc.malloc_trim(0)
    return True


@contextlib.contextmanager
def kept_heap():
    """Inside: freed memory stays in the heap for the next block, large ones too (no `mmap` per block, no trim);
    after: glibc's defaults and the free pages handed back.  Yields whether glibc took the setting.

    For work that reports no RSS (a task benchmark's cells: their bytes are the allocator ledger's): the
    scorers' attention temporaries (H2O's prefill probabilities, ~150 MB a layer at 2k tokens) were otherwise
    mapped, zero-filled by the kernel and unmapped for every layer.  A 2k-token task cell with the default
    strategies (SmolLM2, 2 threads, the whole command): 34.0-34.7 s, 12.6 s of it system time, against
    27.5-28.0 s and 1.9 s inside this (peak RSS 3.5-3.6 against 4.2-4.6 GB: the heap keeps what it once held).
    Transparent huge pages for large blocks cut the page faults tenfold but not the time (the kernel zero-fills
    the same bytes).  The setting is the process's: other threads' blocks are kept too while a block is open."""
    global _KEPT
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        yield False
        return
    with _KEPT_LOCK:
        if _KEPT == 0:
            libc.mallopt(M_MMAP_MAX, 0)
            libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_BYTES)
        _KEPT += 1
    try:
        yield True
    finally:
        with _KEPT_LOCK:
            _KEPT -= 1
            if _KEPT == 0:
                libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
                libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_BYTES)
        release()


def _status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss() -> int | None:
    """Resident bytes now (VmRSS), None off Linux."""
    return _status("VmRSS")


def peak() -> int | None:
    """The kernel's high-water mark of resident bytes since start or the last `reset_peak()` (VmHWM)."""
    return _status("VmHWM")


def reset_peak() -> bool:
    """Start the high-water mark afresh from the RSS now (what `/usr/bin/time` and `wait4` report at exit is then
    the highest RSS from here on).  False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
