"""The memory meters themselves: the CPU allocator's ledger sees every block torch hands out, by its owner,
wherever it is freed; the device allocator's counters (CUDA, MPS) are read around each stretch of an owner's work.
Expected values are the tensors' own sizes, written out."""

import copy
import io
import pickle
import threading

import pytest
import torch

from kvdirect_app.measure import ledger
from kvdirect_app.measure.meters import DeltaMeter, LedgerMeter

N = 1000  # float32 elements: 4,000 bytes


@pytest.fixture(scope="module")
def book():
    return ledger.load()


def _saved_and_loaded(t):
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer)


WAYS = {  # every way a CPU tensor's storage is made, 4,000 bytes each
    "empty": lambda base: torch.empty(N),
    "an op's output": lambda base: base * 2,
    "clone": lambda base: base.clone(),
    "copy.deepcopy": lambda base: copy.deepcopy(base),
    "a storage made in Python": lambda base: torch.UntypedStorage(4 * N),
    "a storage's clone": lambda base: base.untyped_storage().clone(),
    "torch.tensor(list)": lambda base: torch.tensor([0.0] * N),
    "unpickled": lambda base: pickle.loads(pickle.dumps(base)),
    "torch.load": _saved_and_loaded,
}


@pytest.mark.check
@pytest.mark.parametrize("way", list(WAYS))
def test_every_way_to_make_a_cpu_storage_is_the_owners(book, way):
    """Mutation it catches: the ledger installed only as `GetCPUAllocator()`'s (c10's `SetCPUAllocator`), not in
    the default allocator that Python's storage constructors ask by name: deepcopy, a storage made in Python, its
    clone and unpickling are then nobody's."""
    base = torch.randn(N)
    owner = book.owner()
    try:
        with book.working_for(owner):
            kept = WAYS[way](base)
        assert book.live(owner) == 4 * N and book.blocks(owner) == 1
        del kept
        assert book.live(owner) == 0 and book.blocks(owner) == 0
    finally:
        book.release(owner)


def test_blocks_are_their_owners_wherever_they_are_freed_and_peaks_reset(book):
    a, b = book.owner(), book.owner()
    try:
        with book.working_for(a):
            kept = torch.zeros(N)
            scratch = torch.zeros(2 * N)  # freed inside: in the peak, not in what is held
            del scratch
            with ledger.measurement():
                torch.zeros(5 * N)  # the measurement's, not a's
        assert (book.live(a), book.peak(a)) == (4 * N, 12 * N)
        book.reset_peak(a)
        assert book.peak(a) == 4 * N
        with book.working_for(b):
            other = torch.zeros(10)
            holder = [kept]
            del kept
            freeing = threading.Thread(target=holder.clear)  # a's block, freed on another thread while b works
            freeing.start()
            freeing.join()
        assert (book.live(a), book.live(b), book.peak(b)) == (0, 40, 40)
        seen = []
        worker = threading.Thread(target=lambda: seen.append(torch.zeros(N)))  # noqa: F821 (deleted after the closure last runs); started in b's work: works for b
        with book.working_for(b):
            worker.start()
            worker.join()
        assert book.live(b) == 40 + 4 * N and seen[0].numel() == N
        elsewhere = threading.Thread(target=lambda: seen.append(torch.zeros(N)))  # noqa: F821 (deleted after the closure last runs); started outside: for nobody
        elsewhere.start()
        elsewhere.join()
        assert book.live(b) == 40 + 4 * N
        del seen
        del other
    finally:
        book.release(a)
        book.release(b)


def test_an_owner_is_reused_only_once_its_blocks_are_gone(book):
    owner = book.owner()
    with book.working_for(owner):
        kept = torch.zeros(N)
    book.release(owner)  # a block still alive (a cache that outlived its engine): never handed out again
    fresh = [book.owner() for _ in range(3)]
    assert owner not in fresh
    del kept
    for o in fresh:
        book.release(o)
    gone = book.owner()
    book.release(gone)
    assert book.owner() == gone  # released with nothing alive: reused


def test_the_ledger_meter_names_its_owners(book):
    meter = LedgerMeter(book)
    meter.register("lane")
    token = meter.enter("lane")
    kept = torch.zeros(N)
    meter.leave(token)
    token = meter.enter("not registered")  # anyone else's work is nobody's
    torch.zeros(N)
    meter.leave(token)
    assert meter.held("lane") == meter.peak("lane") == 4 * N and meter.has_peak
    del kept
    meter.close()


class Counters:
    """A device allocator's counters, moved by hand: allocated bytes now and the peak since the last reset."""

    def __init__(self):
        self.now = self.high = 0

    def alloc(self, n):
        self.now += n
        self.high = max(self.high, self.now)

    def free(self, n):
        self.now -= n

    def reset(self):
        self.high = self.now


def test_a_device_meter_counts_each_stretch_of_an_owners_work_and_its_peak():
    """CUDA's way (no device here: the counters are moved by hand): what the allocator moved by during each stretch
    of an owner's work is the owner's, work nested inside it (an instrument's) is not, and the owner's peak is its
    live bytes at the stretch's start plus the highest the allocator went above where the stretch began."""
    c = Counters()
    meter = DeltaMeter("test counters", lambda: c.now, lambda: c.high, c.reset)
    meter.register("lane")
    c.alloc(10_000)  # before any work of the lane: nobody's
    meter.enter("lane")
    c.alloc(400)  # its state
    c.alloc(1_000)
    c.free(1_000)  # a buffer of the step
    meter.enter("compare")  # an instrument inside the lane's work
    c.alloc(5_000)
    c.free(5_000)
    meter.leave()
    c.alloc(100)
    meter.leave()
    assert meter.held("lane") == 500 and meter.peak("lane") == 1_400
    meter.reset("lane")
    assert meter.peak("lane") == 500
    mps = DeltaMeter("no peak", lambda: c.now)
    mps.register("lane")
    assert mps.peak("lane") is None and not mps.has_peak
