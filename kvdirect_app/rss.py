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

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

_LIBC = None


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
    after every engine step)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


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
