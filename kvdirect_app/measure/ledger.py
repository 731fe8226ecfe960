"""The allocator's ledger of CPU memory, by owner: the default memory instrument on the CPU.

`ledger.cpp` is installed in torch's default CPU allocator: every CPU tensor's storage passes through it, the
ops' and those Python's storage constructors make (`copy.deepcopy`, unpickling).  The engine names the owner of
each piece of work (`Ledger.enter`: a lane's cache update, its attention, its replay...); a block allocated
inside an owner's work is that owner's until it is freed, on whatever thread and whenever that happens.  So a
lane's held bytes are what the allocator handed out for its work and has not taken back, its peak the highest
that went since `reset_peak`: nothing a strategy lists, declares or hides changes that (a copy kept in an
attribute, a closure or a module global was allocated like any other block).

Owner 0 is no one's work, and its blocks are counted too: a tensor allocated by code outside every region is
unattributed, and a run reports it as such (`observe.Observer.unattributed`).  There is no way to work for
nobody.  A thread started (`threading`) inside an owner's work works for that owner from its first line, so a
copy made on a thread a strategy started is the strategy's.  Beside torch's blocks the ledger counts, per owner,
the bytes outside torch: numpy's array data (the ledger's allocation handler in place of numpy's default one, so
in every thread and every Python context) and Python's buffers (a hook on Python's memory domain, for named
owners: a list's array of items): a strategy that keeps a numpy copy or a list of its keys holds those bytes in
its lane's figures.  Python's objects themselves are not counted per owner: Python keeps freed ones in free lists
and hands them out again without asking the allocator, so whose they are cannot be told.

What no hook sees is caught by a cross-check of the whole process after every step (`CrossCheck`): the C
allocator's bytes in use that the ledger does not explain (Python's objects above 512 B: `bytes`, `bytearray`,
pickles, a tuple's or a dict's table; `ctypes` `malloc`), Python's small objects (the floats of a tuple, the ints
of a dict), anonymous memory outside both (a private `mmap`, a file mapped privately and written:
`torch.from_file`) and writable shared mappings (a tensor moved to shared memory, `np.memmap`, a shared `mmap`),
each reported as unattributed with its size.  What still goes unseen is said in `CrossCheck`'s words.

It costs a table insert per block of an owner and a look-up per free (~0.1 µs); naming an owner is one call
(~0.5 µs).  glibc's `mallinfo2()` was the other candidate: as cheap, but process-wide, with no peak and no
owner, so the web server's threads would have counted as the lanes' (it is the cross-check's instead).

The library is built once per torch build with the machine's C++ compiler (``$CXX``, else ``c++``) against
the headers torch ships, and kept in the cache folder (``KVDIRECT_LEDGER_CACHE``, default
``~/.cache/kvdirect-studio/ledger``); `make install` builds it.  Where it cannot be built or installed,
`unavailable()` says why and the engine says so too (its memory figures are then declared, not measured).
``python -m kvdirect_app.measure.ledger`` builds it and prints where it lies.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import sysconfig
import threading
from pathlib import Path

from ..kernels import native
from ..kernels.native import Unavailable

try:
    import resource
except ImportError:  # not on POSIX
    resource = None
try:
    import numpy
except ImportError:  # the hooks outside torch are built without numpy's where it is absent
    numpy = None

SOURCE = Path(__file__).with_name("ledger.cpp")
CACHE_ENV = "KVDIRECT_LEDGER_CACHE"
UNATTRIBUTED = 0  # the owner of every block allocated outside a named owner's work


def _python_flags() -> list[str]:
    """Python's and (where numpy is there) numpy's headers: the hooks outside torch are built with them."""
    flags = [f"-I{sysconfig.get_paths()['include']}", "-DKV_PYTHON"]
    if numpy is None:
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
        lib.kv_enter.restype = lib.kv_current.restype = ctypes.c_int32
        lib.kv_enter.argtypes = [ctypes.c_int32]
        lib.kv_from_malloc.restype = ctypes.c_int64
        lib.kv_reset_peak.argtypes = [ctypes.c_int32]
        status = lib.kv_install()
        if status:
            raise Unavailable(
                "torch's CPU allocator is not its default one, or hands out blocks the ledger cannot follow"
                if status == 1
                else f"install failed ({status})"
            )
        self.path = path
        self.python = lib.kv_python_install() == 0  # Python's buffers counted per owner
        self.numpy = lib.kv_numpy_install() == 0  # numpy's data counted, in every thread and context
        self.enter = lib.kv_enter  # enter(owner) -> the owner this thread worked for before
        self.current = lib.kv_current  # the owner this thread works for
        self.from_malloc = lib.kv_from_malloc  # live bytes counted that the C allocator handed out, every owner's
        self.live = lib.kv_live  # torch's bytes
        self.outside = lib.kv_outside  # numpy's data and Python's buffers
        self.peak = lib.kv_peak  # the highest torch's went
        self.blocks = lib.kv_blocks
        self.reset_peak = lib.kv_reset_peak
        self._free: list[int] = []
        self._next = 1
        self._limit = lib.kv_owners()
        self._lock = threading.Lock()
        _inherit_owners(self)

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

    @contextlib.contextmanager
    def working_for(self, owner: int):
        """Inside: this thread's blocks are `owner`'s."""
        before = self.enter(owner)
        try:
            yield
        finally:
            self.enter(before)

    def unattributed(self) -> int:
        """Live bytes of blocks allocated outside every named owner's work (torch's and numpy's), process-wide."""
        return self.live(UNATTRIBUTED) + self.outside(UNATTRIBUTED)


_INHERITED = False
_STARTED = [0]  # threads started with `threading` (the cross-check's sign that a thread's stack appeared)


def _inherit_owners(book: Ledger):
    """A thread started with `threading` works for the owner its starter worked for (its blocks, numpy's data and
    Python's buffers are that owner's): a strategy's copy made on a thread of its own is the strategy's.  Once per
    process; a thread started outside `threading` (C code's own threads) works for no one."""
    global _INHERITED
    if _INHERITED:
        return
    _INHERITED = True
    start, bootstrap = threading.Thread.start, threading.Thread._bootstrap_inner

    def started(self):
        self._kvdirect_owner = book.current()
        _STARTED[0] += 1
        start(self)

    def run(self):
        owner = getattr(self, "_kvdirect_owner", UNATTRIBUTED)
        if owner:
            book.enter(owner)
        bootstrap(self)

    threading.Thread.start, threading.Thread._bootstrap_inner = started, run


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


class _MemoryStream:
    """What a C function writes to a `FILE *` (glibc's `open_memstream`), as bytes."""

    def __init__(self, libc):
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        self.libc = libc

    def __call__(self, write) -> bytes:
        libc, buf, size = self.libc, ctypes.c_char_p(), ctypes.c_size_t()
        stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        write(stream)
        libc.fclose(stream)
        try:
            return ctypes.string_at(buf, size.value)
        finally:
            libc.free(buf)


def _stack_size() -> int:
    """The bytes of a new thread's stack: Python's setting, else the process's limit (glibc's default), else 8 MiB."""
    limit = resource.getrlimit(resource.RLIMIT_STACK)[0] if resource is not None else -1
    return threading.stack_size() or (limit if 0 < limit < 1 << 40 else 8 << 20)


_MALLOC_TOTALS = re.compile(
    rb'<total type="(fast|rest|mmap)" count="\d+" size="(\d+)"/>|'
    rb'<(system|aspace) type="(current|mprotect)" size="(\d+)"/>'
)


class CrossCheck:
    """What the process holds that the ledger does not explain, read after every step (Linux with glibc).

    The ledger sees what passes through its hooks; memory can be had around them.  Four counts of the whole
    process, each against what the ledger explains, from when the check began (`reset`):

    * ``malloc``: the C allocator's bytes in use (`malloc_info`: exact, resident or not, wherever they were reused
      from) less the live bytes of the blocks the ledger counted that came from it: Python's objects above 512 B
      (`bytes`, `bytearray`, a pickle, `io.BytesIO`'s buffer, a tuple's or a dict's table), `ctypes` calls to
      `malloc`, a library's own buffers;
    * ``python_objects``: the bytes of Python's small objects (pymalloc's allocated blocks: the floats of a tuple,
      the ints of a dict, each a block of its arenas);
    * ``anonymous``: private writable mappings (VmData) outside the C allocator's and Python's arenas: a private
      `mmap`, a file mapped privately (`torch.from_file`, whose written pages are the process's own).  A new
      thread's stack is such a mapping too (2-8 MiB; Rust's and C++ libraries' threads start lazily, in a run):
      across a step in which threads started (counted by `threading` and by the kernel), up to 8 MiB a thread is
      taken out of what was mapped;
    * ``shared_memory``: writable shared mappings, read from the process's map of its memory whenever its resident
      shared pages and its address space have both moved since the last read: a tensor moved to shared memory, a
      shared `mmap`, a file mapped for writing (`np.memmap`).

    The first three move with the process's own life: Python's objects of the run's own records (a step's times,
    tokens and events, 1-6 KB a lane and step, measured on tiny-llama), torch's tensors' own headers.  Each is
    reported only from `FLOOR` bytes up, plus `PER_FORWARD` for each lane's forward so far (the caller's
    `forwards`): hidden copies smaller than that, in all, are not seen here.  Also unseen: a copy kept by another
    process, a file written and not kept mapped (a file, not memory), a device's memory, up to 8 MiB a thread of the
    mappings (not the objects or the C allocator's bytes) made in a step that also started threads.  A read costs
    ~60-100 µs (glibc's
    `malloc_info`, pymalloc's statistics, /proc/self/statm and /proc/self/stat), and the map ~1 ms when it is read.
    """

    FLOOR = 2 << 20
    PER_FORWARD = 8 << 10
    PARTS = ("malloc", "python_objects", "anonymous", "shared_memory")
    _PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def __init__(self, book: Ledger):
        self.book = book
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        self.available = all(hasattr(libc, f) for f in ("malloc_info", "open_memstream", "fclose", "free"))
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
            self._stat = os.open("/proc/self/stat", os.O_RDONLY)
        except OSError:
            self.available = False
        if not self.available:
            return
        self._stream = _MemoryStream(libc)
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self._malloc_info = lambda stream: libc.malloc_info(0, stream)
        stats = getattr(ctypes.pythonapi, "_PyObject_DebugMallocStats", None)
        if stats is not None:
            stats.argtypes = [ctypes.c_void_p]
        self._pymalloc_stats = stats
        self.reset()

    def close(self):
        if self.available:
            self.available = False
            os.close(self._statm)
            os.close(self._stat)

    def _malloc(self) -> tuple[int, int]:
        """The C allocator's (bytes in use, the writable address space of its arenas and mapped blocks: a thread's
        arena keeps the most it took)."""
        text = self._stream(self._malloc_info)
        found = {m[1] or m[4]: int(m[2] or m[5]) for m in _MALLOC_TOTALS.finditer(text, text.rfind(b"</heap>"))}
        mapped = found.get(b"mmap", 0)
        return (found[b"current"] - found.get(b"fast", 0) - found.get(b"rest", 0) + mapped, found[b"mprotect"] + mapped)

    def _pymalloc(self) -> tuple[int, int]:
        """Python's small objects: (bytes in allocated blocks, bytes of its arenas); zeros where Python runs without
        pymalloc (its objects are then the C allocator's)."""
        if self._pymalloc_stats is None:
            return 0, 0
        text = self._stream(self._pymalloc_stats)

        def total(label: bytes) -> int:  # "<label> ... = 1,234"
            at = text.find(label)
            return 0 if at < 0 else int(text[at : text.find(b"\n", at)].rpartition(b"=")[2].replace(b",", b""))

        return total(b"# bytes in allocated blocks"), total(b" bytes/arena")

    def _read(self) -> tuple[int, int, int, int, int, tuple[int, int]]:
        """(the C allocator's bytes in use, Python's small objects' bytes, writable private memory outside both,
        address space, resident shared pages, threads)."""
        inuse, spanned = self._malloc()
        objects, arenas = self._pymalloc()
        size, _, shared, _, _, data = os.pread(self._statm, 256, 0).split()[:6]
        threads = int(os.pread(self._stat, 1024, 0).rpartition(b")")[2].split()[17])
        return inuse, objects, int(data) * self._PAGE - spanned - arenas, int(size), int(shared), (threads, _STARTED[0])

    @staticmethod
    def _shared_mappings() -> int:
        """Bytes of the process's writable shared mappings (its map: ~1 ms)."""
        total = 0
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                span, perms = line.split(b" ", 2)[:2]
                if perms[1:2] == b"w" and perms[3:4] == b"s":
                    start, _, end = span.partition(b"-")
                    total += int(end, 16) - int(start, 16)
        return total

    def reset(self):
        """Count from now."""
        if not self.available:
            return
        inuse, objects, writable, size, shared, threads = self._read()
        self._malloc0, self._objects0 = inuse - self.book.from_malloc(), objects
        self._anonymous, self._last, self._threads = 0, writable, threads
        self._mapped = (size, shared)
        self._shared0 = self._shared = self._shared_mappings()

    def parts(self, forwards: int = 0) -> dict[str, int]:
        """Bytes unexplained now, by kind: 0 where the check is not available, and below its floor after `forwards`
        lanes' forwards."""
        if not self.available:
            return dict.fromkeys(self.PARTS, 0)
        inuse, objects, writable, size, shared, threads = self._read()
        mapped = writable - self._last
        if threads != self._threads:  # threads started: the stacks they were given are no one's copy
            started = max(0, threads[0] - self._threads[0]) + threads[1] - self._threads[1]
            mapped -= min(max(0, mapped), started * max(_stack_size(), 8 << 20))
            self._threads = threads
        self._anonymous += mapped
        self._last = writable
        if size != self._mapped[0] and shared != self._mapped[1]:
            self._shared, self._mapped = self._shared_mappings(), (size, shared)
        floor = self.FLOOR + self.PER_FORWARD * forwards
        counts = {
            "malloc": inuse - self.book.from_malloc() - self._malloc0,
            "python_objects": objects - self._objects0,
            "anonymous": self._anonymous,
        }
        return {
            **{k: n if n >= floor else 0 for k, n in counts.items()},
            "shared_memory": max(0, self._shared - self._shared0),
        }


if __name__ == "__main__":
    print(build())
