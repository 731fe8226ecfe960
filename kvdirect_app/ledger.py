"""The allocator's ledger of CPU memory, by owner: the default memory instrument on the CPU.

`ledger.cpp` is installed in torch's default CPU allocator: every CPU tensor's storage passes through it, the
ops' and those Python's storage constructors make (`copy.deepcopy`, unpickling).  The engine names the owner of
each piece of work (`Ledger.enter`: a lane's cache update, its attention, its replay...); a block allocated
inside an owner's work is that owner's until it is freed, on whatever thread and whenever that happens.  So a
lane's held bytes are what the allocator handed out for its work and has not taken back, its peak the highest
that went since `reset_peak`: nothing a strategy lists, declares or hides changes that (a copy kept in an
attribute, a closure or a module global was allocated like any other block).

Nothing is left out.  Owner 0 is no one's work, and its blocks are counted too: a tensor allocated on a thread
a strategy started, or by code outside every region, is unattributed, and a run reports it as such
(`observe.Observer.unattributed`).  There is no way to work for nobody.  Beside torch's blocks the ledger counts,
per owner, the bytes outside torch: numpy's array data (numpy's allocation handler, put in place in each Python
context where an owner's work runs: `numpy_here`) and Python's buffers (a hook on Python's memory domain, for
named owners: a list's array of items): a strategy that keeps a numpy copy or a list of its keys holds those
bytes in its lane's figures.  Python's objects themselves are not counted: Python keeps freed ones in free
lists and hands them out again without asking the allocator, so whose they are cannot be told.  Memory that no allocator hands out (a tensor moved to shared memory) is read from the
process (`shared_memory_bytes`) and reported as unattributed.

It costs a table insert per block of an owner and a look-up per free (~0.1 µs); naming an owner is one call
(~0.5 µs).  glibc's `mallinfo2()` was the other candidate: as cheap, but process-wide, with no peak and no
owner, so the web server's threads would have counted as the lanes'.

The library is built once per torch build with the machine's C++ compiler (``$CXX``, else ``c++``) against
the headers torch ships, and kept in the cache folder (``KVDIRECT_LEDGER_CACHE``, default
``~/.cache/kvdirect-studio/ledger``); `make install` builds it.  Where it cannot be built or installed,
`unavailable()` says why and the engine says so too (its memory figures are then declared, not measured).
``python -m kvdirect_app.ledger`` builds it and prints where it lies.
"""

from __future__ import annotations

import contextlib
import ctypes
import sysconfig
import threading
from pathlib import Path

from . import native
from .native import Unavailable

SOURCE = Path(__file__).with_name("ledger.cpp")
CACHE_ENV = "KVDIRECT_LEDGER_CACHE"
UNATTRIBUTED = 0  # the owner of every block allocated outside a named owner's work


def _python_flags() -> list[str]:
    """Python's and (where numpy is there) numpy's headers: the hooks outside torch are built with them."""
    flags = [f"-I{sysconfig.get_paths()['include']}", "-DKV_PYTHON"]
    try:
        import numpy
    except ImportError:
        return flags
    return flags + [f"-I{numpy.get_include()}", "-DKV_NUMPY"]


def build() -> Path:
    """The library for this torch build: the kept one, or compiled now (a few seconds)."""
    return native.library(SOURCE, "the allocator ledger", CACHE_ENV, "ledger", _python_flags(), ["-lc10"])


class Ledger:
    """The installed ledger: owners, their live bytes, blocks and peaks."""

    def __init__(self, path: Path):
        lib = ctypes.PyDLL(str(path))  # the GIL held in every call: the hooks outside torch use Python's C API
        for name in ("kv_live", "kv_outside", "kv_peak", "kv_blocks"):
            getattr(lib, name).restype = ctypes.c_int64
            getattr(lib, name).argtypes = [ctypes.c_int32]
        lib.kv_enter.restype = ctypes.c_int32
        lib.kv_enter.argtypes = [ctypes.c_int32]
        lib.kv_reset_peak.argtypes = [ctypes.c_int32]
        status = lib.kv_install()
        if status:
            raise Unavailable("torch's CPU allocator is not its default one, or hands out blocks the ledger "
                              "cannot follow" if status == 1 else f"install failed ({status})")
        self.path = path
        self.python = lib.kv_python_install() == 0  # Python's buffers counted per owner
        self._numpy_here = lib.kv_numpy_here
        self.numpy = self._numpy_here() == 0  # numpy's data counted (in each context where work is named)
        self.enter = lib.kv_enter  # enter(owner) -> the owner this thread worked for before
        self.live = lib.kv_live  # torch's bytes
        self.outside = lib.kv_outside  # numpy's data and Python's buffers
        self.peak = lib.kv_peak  # the highest torch's went
        self.blocks = lib.kv_blocks
        self.reset_peak = lib.kv_reset_peak
        self._free: list[int] = []
        self._next = 1
        self._limit = lib.kv_owners()
        self._lock = threading.Lock()

    def owner(self) -> int:
        """A fresh owner id (live, blocks and peak 0)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._next >= self._limit:
                raise Unavailable(f"all {self._limit - 1} ledger owners are in use")
            self._next += 1
            return self._next - 1

    def release(self, owner: int):
        """Give an owner id back; one whose blocks are still alive (a cache that outlived its engine) is never
        reused, so its count cannot mix with another's."""
        if owner and self.blocks(owner) == 0 and self.outside(owner) == 0:
            self.reset_peak(owner)
            with self._lock:
                self._free.append(owner)

    def numpy_here(self):
        """numpy's data allocations in this Python context go through the ledger from now on (numpy keeps its
        handler per context: a thread or a task starts with numpy's own)."""
        if self.numpy:
            self._numpy_here()

    @contextlib.contextmanager
    def working_for(self, owner: int):
        """Inside: this thread's blocks are `owner`'s."""
        self.numpy_here()
        before = self.enter(owner)
        try:
            yield
        finally:
            self.enter(before)

    def unattributed(self) -> int:
        """Live bytes of blocks allocated outside every named owner's work (torch's and numpy's), process-wide."""
        return self.live(UNATTRIBUTED) + self.outside(UNATTRIBUTED)


_LEDGER: Ledger | None = None
_FAILED: str | None = None
_LOAD = threading.Lock()


def load() -> Ledger:
    """The process's ledger, built and installed on first use; `Unavailable` (with the reason) where it cannot be."""
    global _LEDGER, _FAILED
    with _LOAD:
        if _LEDGER is None and _FAILED is None:
            try:
                _LEDGER = Ledger(build())
            except (Unavailable, OSError) as e:
                _FAILED = str(e)
        if _LEDGER is None:
            raise Unavailable(_FAILED)
        return _LEDGER


def unavailable() -> str | None:
    """None where the ledger works here, else why not (it is then built and installed)."""
    try:
        load()
    except Unavailable as e:
        return str(e)
    return None


def installed() -> Ledger | None:
    """The ledger if this process installed it, without building anything."""
    return _LEDGER


_MEASUREMENT: int | None = None


def measurement():
    """The measurement's own work outside an engine (a shadow full cache, a one-time check): its blocks are the
    process's "measurement" owner's, counted like any other (no-op before the ledger is in)."""
    global _MEASUREMENT
    if _LEDGER is None:
        return contextlib.nullcontext()
    with _LOAD:
        if _MEASUREMENT is None:
            _MEASUREMENT = _LEDGER.owner()
    return _LEDGER.working_for(_MEASUREMENT)


def measurement_bytes() -> int:
    """Live bytes of the measurement's own work outside an engine (`measurement`)."""
    if _LEDGER is None or _MEASUREMENT is None:
        return 0
    return _LEDGER.live(_MEASUREMENT) + _LEDGER.outside(_MEASUREMENT)


def shared_memory_bytes() -> int | None:
    """The process's resident shared memory (RssShmem, Linux): a tensor moved to shared memory
    (`share_memory_()`) leaves every allocator; None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


if __name__ == "__main__":
    print(build())
