"""One strategy's state during a run, and its byte book (DESIGN.md, "Metrics").

Bytes come from independent sources, kept side by side:

* measured, by the run's memory instrument (`instruments.py`): ``storage``
  (the default) counts the distinct storages of the tensors the lane's cache
  holds after each forward, and its peak adds the transient buffers the
  strategy counts where it allocates them (no activations); ``trace`` is the
  allocator's ledger (`memory.AllocationTracer`): what the lane's own forwards
  (and its fork, park, resume) allocated and still hold, and the highest that
  went during each forward (state + transient buffers + its share of the
  activations).  In ``trace`` mode the storage count runs beside it and the
  book audits the two against each other (`audit`).
* formula: the strategy's own arithmetic from the config alone (persistent
  state; transient = the strategy's buffers, no activations, so it is a lower
  bound of the measured peak).

Where measured state and formula disagree, the book records it; the tables
show both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .memory import cuda_block_range
from .metrics import StepTimes
from .strategies import Strategy, StrategyCache

MISMATCHES_KEPT = 20


@dataclass
class TurnBytes:
    """Per turn: the highest measured peak during it, what was held after it, and its decode speed."""

    turn: int
    peak: int | None = None
    formula_peak: int = 0
    between: int | None = None  # held after the turn ended
    formula_between: int = 0
    decode_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        ms = sum(self.decode_ms) / len(self.decode_ms) if self.decode_ms else None
        return {"turn": self.turn, "peak_during_turn": self.peak, "formula_peak_during_turn": self.formula_peak,
                "between_turns": self.between, "formula_between_turns": self.formula_between,
                "decode_ms_per_token": ms}


@dataclass
class ByteBook:
    """Measured and formula bytes of one lane over a run."""

    measured: bool  # a memory instrument runs (storage or trace); False: the formula only
    persistent_peak: int | None = None
    peak: int | None = None
    between_turns_peak: int | None = None
    formula_persistent_peak: int = 0
    formula_peak: int = 0
    formula_between_turns_peak: int = 0
    mismatches: list = field(default_factory=list)  # (where, seen, measured, formula), the first few
    mismatch_count: int = 0
    peak_below_formula: int = 0  # steps whose measured peak was below the formula's lower bound
    last: dict = field(default_factory=dict)
    turns: list[TurnBytes] = field(default_factory=list)
    # On CUDA: the exact sizes of the tensors the lane's cache holds (see memory.py: block rounding).
    held_sizes: Callable[[], list[int]] | None = None
    # The trace's audit of the storage count: (where, seen, storage, traced), the first few, and peaks where the
    # storage count (state + declared transient) went above the allocator's.
    audits: list = field(default_factory=list)
    audit_count: int = 0
    audit_steps: int = 0
    storage_peak_above_trace: int = 0

    def agrees(self, measured: int, formula: int) -> bool:
        """Measurement and formula, like for like: equal on the CPU; on CUDA the formula equal to the exact bytes
        of the cache's tensors and the measurement within the caching allocator's rounding of them."""
        if self.held_sizes is None:
            return measured == formula
        sizes = self.held_sizes()
        low, high = cuda_block_range(sizes)
        return sum(sizes) == formula and low <= measured <= high

    @staticmethod
    def _max(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else max(a, b)

    def check(self, where, seen: int, measured: int | None, formula: int):
        if measured is not None and not self.agrees(measured, formula):
            self.mismatch_count += 1
            if len(self.mismatches) < MISMATCHES_KEPT:
                self.mismatches.append((where, seen, measured, formula))

    def audit(self, where, seen: int, storage: int, storage_peak: int, traced: int, traced_peak: int | None):
        """The allocator's figures against the storage count's (``--memory trace``): held bytes agree (like for
        like, as `agrees` compares with the formula), and the storage count's peak is not above the allocator's
        by more than the step's growth.  (The storage peak is held-after-the-step + the largest layer's
        transient; while an early layer's transient was alive, later layers had not grown yet: the allocator's
        peak can be lower by at most what the step added.  It leaves out the activations, which the allocator
        sees.)"""
        grown = max(0, storage - (self.last.get("persistent_bytes") or 0)) if self.last else storage
        self.audit_steps += 1
        if not self.agrees(traced, storage):
            self.audit_count += 1
            if len(self.audits) < MISMATCHES_KEPT:
                self.audits.append((where, seen, storage, traced))
        if traced_peak is not None and self.held_sizes is None and storage_peak > traced_peak + grown:
            self.storage_peak_above_trace += 1

    def step(self, seen: int, state: int | None, peak: int | None, formula_state: int, formula_transient: int):
        """After one forward of the lane (not its teacher-forced twin): its held bytes and peak as measured."""
        formula_peak = formula_state + formula_transient
        self.check("step", seen, state, formula_state)
        if peak is not None and peak < formula_peak:
            self.peak_below_formula += 1
        self.persistent_peak = self._max(self.persistent_peak, state)
        self.peak = self._max(self.peak, peak)
        self.formula_persistent_peak = max(self.formula_persistent_peak, formula_state)
        self.formula_peak = max(self.formula_peak, formula_peak)
        turn = self.turns[-1]
        turn.peak = self._max(turn.peak, peak)
        turn.formula_peak = max(turn.formula_peak, formula_peak)
        self.last = {"persistent_bytes": state, "peak_bytes": peak, "formula_bytes": formula_state,
                     "formula_peak_bytes": formula_peak}

    def between_turns(self, seen: int, state: int | None, formula: int):
        self.check("between turns", seen, state, formula)
        self.between_turns_peak = self._max(self.between_turns_peak, state)
        self.formula_between_turns_peak = max(self.formula_between_turns_peak, formula)
        self.turns[-1].between, self.turns[-1].formula_between = state, formula

    def summary(self, final: int | None, instrument: str) -> dict:
        return {
            "instrument": instrument,
            "persistent_peak": self.persistent_peak,
            "peak": self.peak,
            "between_turns_peak": self.between_turns_peak,
            "final_persistent": final,
            "formula_persistent_peak": self.formula_persistent_peak,
            "formula_peak": self.formula_peak,
            "formula_between_turns_peak": self.formula_between_turns_peak,
            "formula_matches_measurement": self.mismatch_count == 0 if self.measured else None,
            "mismatch_count": self.mismatch_count,
            "mismatches": [list(m) for m in self.mismatches],
            "peak_below_formula_steps": self.peak_below_formula,
            # ``--memory trace`` only: the storage count audited by the allocator.
            "storage_audit": {"steps": self.audit_steps, "held_mismatches": self.audit_count,
                              "first_mismatches": [list(m) for m in self.audits],
                              "storage_peak_above_trace_steps": self.storage_peak_above_trace}
            if self.audit_steps else None,
        }


@dataclass
class Lane:
    """One strategy's state during a run."""

    strategy: Strategy
    cache: StrategyCache
    label: str
    book: ByteBook
    tokens: list[list[int]] = field(default_factory=list)  # generated ids per turn (free run)
    texts: list[str] = field(default_factory=list)
    replies: list = field(default_factory=list)  # per turn: its ReplyText (incremental detokenization)
    logits: torch.Tensor | None = None
    active: bool = False
    pending: int | None = None  # last generated token not yet fed (reply cut by max_new_tokens)
    tf_cache: StrategyCache | None = None  # teacher-forced twin after the first divergence
    tf_logits: torch.Tensor | None = None
    diverged: bool = False
    times: StepTimes = field(default_factory=StepTimes)
    tf_steps: int = 0
    tf_agree: int = 0
    kl_sum: float = 0.0
    max_dlogit: float = 0.0
    kv: dict = field(default_factory=dict)  # kv report frozen from the identical-history cache
    history: list[int] = field(default_factory=list)  # every id fed to the free run, in order
    forwards: list = field(default_factory=list)  # a `strategies.base.Forward` for each forward of the free run
    parks: list[dict] = field(default_factory=list)  # per park: seen, bytes measured and by formula, resume ms
    kv_digest: str | None = None  # a hash of the bits its cache held at the end of the latest turn
    # The last query of the latest turn's prompt: {"position": p, "turn": t, "layers": {layer: (handed (p+1,) bool, probs
    # (p+1,) fp32)}} (lockstep.last_query_attention), None before the first turn.
    attention: dict | None = None

    @property
    def twin_owner(self) -> str:
        """The teacher-forced twin is the engine's measuring device, not the strategy's state."""
        return f"{self.label} (teacher-forced twin)"
