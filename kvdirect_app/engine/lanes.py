"""One strategy's state during a run, and its byte book (docs/measurement.md, "Bytes: the allocator the tensors live
in").

Bytes come from independent sources, kept side by side:

* measured, by the run's memory meter (`meters.py`, through the engine's
  observer): the allocator's ledger on the CPU (the default), the device
  allocator's counters on CUDA and MPS: what the allocator handed out for the
  lane's own work (its cache updates, rebuilds, replays, scoring, attention,
  setup; its fork, park and resume) and has not taken back, and the highest
  that went during each forward (state + its own buffers; the pass's shared
  activations are the shared pass's).  With ``--memory trace`` the allocation trace
  (`memory.AllocationTracer`) is the measurement and audits the meter beside it
  (`audit`);
* declared: the distinct storages of the tensors the strategy lists
  (`state_tensors`): what it says it holds (``--memory storage`` shows it
  where no allocator can be read; it is never called measured);
* formula: the strategy's own arithmetic from the config alone (persistent
  state; transient = the strategy's buffers, no activations, so a lower bound
  of the measured peak);
* outside torch: what the lane's work holds beside its tensors, by the same
  ledger: numpy's array data and Python's objects (a strategy that keeps a
  numpy copy or a list of its keys holds them here).  The held and peak
  figures above are torch's (compared with the formula like for like); these
  sit beside them (held after each forward, and the most of that).

Where measured state and formula disagree (a hidden copy, a wrong formula), or
declared and formula (a wrong list), the book records it; the tables show all.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..measure.memory import cuda_block_range
from ..measure.observe import Owner
from ..measure.timing import StepTimes
from ..strategies import Strategy, StrategyCache

MISMATCHES_KEPT = 20


@dataclass
class TurnBytes:
    """Per turn: the highest measured peak during it, what was held after it, and its decode speed."""

    turn: int
    peak: int | None = None
    formula_peak: int = 0
    between: int | None = None  # held after the turn ended
    formula_between: int = 0
    outside_between: int | None = None  # held outside torch after the turn ended
    decode_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        ms = sum(self.decode_ms) / len(self.decode_ms) if self.decode_ms else None
        return {
            "turn": self.turn,
            "peak_during_turn": self.peak,
            "formula_peak_during_turn": self.formula_peak,
            "between_turns": self.between,
            "formula_between_turns": self.formula_between,
            "outside_torch_between_turns": self.outside_between,
            "decode_ms_per_token": ms,
        }


@dataclass
class ByteBook:
    """Measured and formula bytes of one lane over a run."""

    measured: bool  # a memory instrument runs (allocator, trace or storage); False: the formula only
    peak_source: str | None = None  # "measured", "trace" or "formula" (held + the formula's transient)
    persistent_peak: int | None = None
    peak: int | None = None
    between_turns_peak: int | None = None
    formula_persistent_peak: int = 0
    formula_peak: int = 0
    formula_between_turns_peak: int = 0
    mismatches: list = field(default_factory=list)  # (where, seen, measured, formula), the first few
    mismatch_count: int = 0
    declared_mismatch_count: int = 0  # forwards where the tensors the strategy lists disagreed with its formula
    peak_below_formula: int = 0  # steps whose measured peak was below the formula's lower bound
    last: dict = field(default_factory=dict)
    turns: list[TurnBytes] = field(default_factory=list)
    outside: int | None = None  # held outside torch after the last forward (numpy's data, Python's objects)
    outside_peak: int | None = None  # the most held outside torch after a forward
    # On CUDA: the exact sizes of the tensors the lane's cache holds (see memory.py: block rounding).
    held_sizes: Callable[[], list[int]] | None = None
    # ``--memory trace``: the trace's audit of the meter: (where, seen, meter, traced), the first few, and peaks
    # where the meter's went above the trace's.
    audits: list = field(default_factory=list)
    audit_count: int = 0
    audit_steps: int = 0
    meter_peak_above_trace: int = 0

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

    def audit(self, where, seen: int, held: int, peak: int | None, traced: int, traced_peak: int | None):
        """The trace's figures against the meter's (``--memory trace``): held bytes agree, like for like, and the
        meter's peak (the lane's own buffers) is not above the trace's (which also charges the lane its share
        of the pass's activations)."""
        self.audit_steps += 1
        if not self.agrees(traced, held):
            self.audit_count += 1
            if len(self.audits) < MISMATCHES_KEPT:
                self.audits.append((where, seen, held, traced))
        if peak is not None and traced_peak is not None and self.held_sizes is None and peak > traced_peak:
            self.meter_peak_above_trace += 1

    def declared(self, formula: int, declared: int | None):
        """What the strategy lists against its formula (the storage count: exact bytes on every device)."""
        if declared is not None and declared != formula:
            self.declared_mismatch_count += 1

    def step(
        self,
        seen: int,
        state: int | None,
        peak: int | None,
        formula_state: int,
        formula_transient: int,
        outside: int | None = None,
    ):
        """After one forward of the lane (not its teacher-forced twin): its held bytes and peak as measured.

        The formula's peak (the state after the step + the largest buffer of a layer) bounds the measured peak from
        below up to what the step added: while an early layer's buffer was alive, later layers had not grown yet."""
        formula_peak = formula_state + formula_transient
        self.check("step", seen, state, formula_state)
        grown = max(0, formula_state - self.last.get("formula_bytes", 0))
        if peak is not None and peak < formula_peak - grown:
            self.peak_below_formula += 1
        self.persistent_peak = self._max(self.persistent_peak, state)
        self.peak = self._max(self.peak, peak)
        self.formula_persistent_peak = max(self.formula_persistent_peak, formula_state)
        self.formula_peak = max(self.formula_peak, formula_peak)
        turn = self.turns[-1]
        turn.peak = self._max(turn.peak, peak)
        turn.formula_peak = max(turn.formula_peak, formula_peak)
        self.outside, self.outside_peak = outside, self._max(self.outside_peak, outside)
        self.last = {
            "persistent_bytes": state,
            "peak_bytes": peak,
            "formula_bytes": formula_state,
            "formula_peak_bytes": formula_peak,
            "peak_source": self.peak_source,
            "formula_agrees": None if state is None else self.agrees(state, formula_state),
            "outside_bytes": outside,
        }

    def between_turns(self, seen: int, state: int | None, formula: int, outside: int | None = None):
        self.check("between turns", seen, state, formula)
        self.turns[-1].outside_between = outside
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
            "peak_source": self.peak_source,
            "declared_mismatch_count": self.declared_mismatch_count,
            # Beside the tensors: numpy's data and Python's objects the lane's work holds (the ledger's; None where
            # no meter reads them).
            "outside_torch": {"held": self.outside, "peak": self.outside_peak},
            # ``--memory trace`` only: the meter audited by the allocation trace.
            "meter_audit": {
                "steps": self.audit_steps,
                "held_mismatches": self.audit_count,
                "first_mismatches": [list(m) for m in self.audits],
                "meter_peak_above_trace_steps": self.meter_peak_above_trace,
            }
            if self.audit_steps
            else None,
        }


@dataclass
class Lane:
    """One strategy's state during a run."""

    strategy: Strategy
    cache: StrategyCache
    label: str
    book: ByteBook
    owner: Owner = None  # whose work the lane's regions are (`observe.Owner`, kind "lane")
    tokens: list[list[int]] = field(default_factory=list)  # generated ids per turn (free run)
    texts: list[str] = field(default_factory=list)
    replies: list = field(default_factory=list)  # per turn: its ReplyText (incremental detokenization)
    logits: torch.Tensor | None = None
    active: bool = False
    pending: int | None = None  # last generated token not yet fed (reply cut by max_new_tokens)
    keeping: bool = False  # nothing is evicted until the turn ends: its question was read after the compressed prompt
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
    # The last query of the latest turn's prompt: {"position": p, "turn": t, "layers": {layer: (handed (p+1,) bool,
    # probs (p+1,) fp32)}} (lockstep.last_query_attention), None before the first turn.
    attention: dict | None = None
    joined: int = 0  # the turn it joined the conversation at (`Engine.join`): 0, there from the start

    def __post_init__(self):
        if self.owner is None:
            self.owner = Owner(self.label, "lane")

    @property
    def twin(self) -> Owner:
        """The teacher-forced twin is the engine's measuring device, not the strategy's state."""
        return Owner(f"{self.label} (teacher-forced twin)", "twin")

    def caches(self) -> list[tuple[Owner, StrategyCache]]:
        """The lane's cache and its twin's (if any), with their owners: what a turn's end, a park or a resume visits."""
        return [
            (owner, cache)
            for owner, cache in ((self.owner, self.cache), (self.twin, self.tf_cache))
            if cache is not None
        ]


def made_again(strategy: Strategy) -> Strategy:
    """A new instance of the strategy with the same settings and label (its `__init__` and `__post_init__` run
    again, where the caller is); the strategy itself where its class cannot be made from its fields."""
    try:
        again = replace(strategy)
    except (TypeError, ValueError):
        return strategy
    again._label = getattr(strategy, "_label", None)
    return again
