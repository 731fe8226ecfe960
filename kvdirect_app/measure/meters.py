"""Memory meters: whose bytes a piece of work allocated, held after it and at most during it, by the allocator the
tensors live in (docs/measurement.md, "Strategies only cache; everything is measured from outside").

The engine's observer (`observe.py`) tells a meter when an owner's work begins and ends (`enter`/`leave`,
nested); the meter answers `held(owner)` and, since `reset(owner)`, `peak(owner)` (None where the platform
gives no cheap peak: the figure is then the formula's, and labelled so).

* `LedgerMeter` (CPU): the allocator's own ledger (`ledger.py`): every block is tagged with its owner when it is
  allocated and untagged when it is freed, wherever that happens; the peak is the owner's highest live bytes.
  Every owner whose work runs in a region gets a tag (the shared pass, an instrument, the engine too), and the
  bytes of each beside torch's (numpy's, Python's) are `outside(owner)`; what no region's work allocated is the
  ledger's unattributed count.
* `DeltaMeter` (CUDA, MPS): the device allocator's counters read around each stretch of an owner's work; what
  they moved by in that stretch is the owner's (the engine is the only one allocating on the device), and the
  caching allocator's peak, reset at each stretch's start, gives the highest it went (CUDA; MPS has none).
  Blocks are freed where their owner's work drops them (a lane's buffers inside its own regions): a block
  freed outside every owner's work would leave its bytes counted, which the formula check then shows.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import ledger


class LedgerMeter:
    """The CPU allocator's ledger (`ledger.Ledger`): every owner gets a tag of its own, on registering or on its
    first region; work outside every region is the ledger's unattributed owner's."""

    kind = "allocator"
    has_peak = True

    def __init__(self, book: ledger.Ledger):
        self.ledger = book
        self.tags: dict[str, int] = {}

    @property
    def name(self) -> str:
        return "allocator ledger (cpu)"

    def register(self, label: str):
        if label not in self.tags:
            self.tags[label] = self.ledger.owner()

    def enter(self, label: str) -> int:
        tag = self.tags.get(label)
        if tag is None:
            self.register(label)
            tag = self.tags[label]
        return self.ledger.enter(tag)

    def leave(self, token: int):
        self.ledger.enter(token)

    def held(self, label: str) -> int:
        return self.ledger.live(self.tags[label])

    def outside(self, label: str) -> int:
        """The owner's live bytes outside torch: numpy's array data and Python's objects."""
        return self.ledger.outside(self.tags[label]) if label in self.tags else 0

    def unattributed(self) -> int:
        """Live bytes (torch's and numpy's) allocated outside every owner's work, process-wide."""
        return self.ledger.unattributed()

    def peak(self, label: str) -> int:
        return self.ledger.peak(self.tags[label])

    def reset(self, label: str):
        self.ledger.reset_peak(self.tags[label])

    def close(self):
        for tag in self.tags.values():
            self.ledger.release(tag)
        self.tags = {}


class DeltaMeter:
    """A device allocator's counters read around each stretch of an owner's work.

    `allocated()` is the device's allocated bytes now; `max_allocated()`/`reset_max()` its peak since the last
    reset (None where there is none).  Nested work pauses the enclosing owner's stretch."""

    kind = "allocator"

    def __init__(
        self,
        name: str,
        allocated: Callable[[], int],
        max_allocated: Callable[[], int] | None = None,
        reset_max: Callable[[], None] | None = None,
    ):
        self.name = name
        self._allocated, self._max, self._reset_max = allocated, max_allocated, reset_max
        self.has_peak = max_allocated is not None
        self.live: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._stack: list[str | None] = []
        self._start = 0

    @classmethod
    def for_device(cls, device: torch.device) -> "DeltaMeter":
        if device.type == "cuda":
            return cls(
                f"caching allocator ({device})",
                lambda: torch.cuda.memory_allocated(device),
                lambda: torch.cuda.max_memory_allocated(device),
                lambda: torch.cuda.reset_peak_memory_stats(device),
            )
        return cls(f"allocator counters ({device.type}; no peak)", torch.mps.current_allocated_memory)

    def register(self, label: str):
        self.live.setdefault(label, 0)
        self.peaks.setdefault(label, 0)

    def _open(self):
        if self._stack and self._stack[-1] is not None:
            self._start = self._allocated()
            if self._reset_max is not None:
                self._reset_max()

    def _close(self):
        label = self._stack[-1] if self._stack else None
        if label is None:
            return
        now = self._allocated()
        if self._max is not None:
            self.peaks[label] = max(self.peaks[label], self.live[label] + self._max() - self._start)
        self.live[label] += now - self._start
        self.peaks[label] = max(self.peaks[label], self.live[label])

    def enter(self, label: str):
        self._close()
        self._stack.append(label if label in self.live else None)
        self._open()

    def leave(self, token=None):
        self._close()
        self._stack.pop()
        self._open()

    def held(self, label: str) -> int:
        return self.live[label]

    def outside(self, label: str) -> int:
        """Nothing outside the device's allocator is read here (the host's bytes are the CPU ledger's)."""
        return 0

    def unattributed(self) -> int | None:
        """Not read: the device's counters move only with the work the meter is told of."""
        return None

    def peak(self, label: str) -> int | None:
        return self.peaks[label] if self._max is not None else None

    def reset(self, label: str):
        self.peaks[label] = self.live[label]

    def close(self):
        pass


def for_device(device: torch.device):
    """The meter for tensors on `device`: the ledger on the CPU (`ledger.Unavailable` where it cannot be
    installed), the device allocator's counters elsewhere."""
    device = torch.device(device)
    if device.type == "cpu":
        return LedgerMeter(ledger.load())
    return DeltaMeter.for_device(device)
