"""The conformance kit's verdicts on its runs (`conformance.check` runs them): one `Finding` per rule and model.

Each verdict is read from what the kit's probe watched (a `conformance.Probe`: the `probe`, `watched`, `measured`,
`first` and `second` arguments here; every forward, every `score()` call, each turn's end) and from what the run's
results say (the lanes' bytes, tokens and K/V against the full cache's).  The rules are listed in `conformance`'s
docstring; the bounds they allow are here."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import compat
from ..strategies.base import SlidingLayer

# What a lane may hold outside torch beyond a plain window's: its own bookkeeping in Python (lists of chunk bounds, a
# few numbers per layer) up to this plus this share of what its tensors hold; a copy of its keys kept outside torch
# is as large as the keys themselves, and grows with every step that keeps one.
OUTSIDE_ALLOWANCE = 4096
OUTSIDE_SHARE = 0.25
# Bytes a lane may hold after a turn beyond its family's formula at its budget: a few numbers of its own per layer.
BUDGET_SLACK = 4096


@dataclass
class Finding:
    """One rule judged on one model: `ok`, and what held or broke, in words."""

    rule: str
    model: str
    ok: bool
    words: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.rule} on {self.model}: {self.words}"


def _first_broken(probe, rule: str) -> str:
    broken = probe.broken[rule]
    return broken[0] + (f" (and {len(broken) - 1} more)" if len(broken) > 1 else "")


def judged_inside(name: str, probe) -> list[Finding]:
    """The rules judged inside the first run's layers, on the calls it made (all of them where it ended)."""
    if probe.family is None and not probe.calls:
        return [
            Finding(rule, name, True, "n/a: no score() (a strategy that evicts nothing)")
            for rule in ("scores", "read-only step")
        ]
    out = []
    for rule, words in (
        (
            "scores",
            f"every score() call ({probe.calls}) on the model's device, in a full-precision "
            "dtype, no -inf, no more +inf than the layer keeps",
        ),
        ("read-only step", f"every score() call ({probe.calls}) left the step's keys and positions as it found them"),
    ):
        out.append(
            Finding(rule, name, False, _first_broken(probe, rule))
            if rule in probe.broken
            else Finding(rule, name, True, words)
        )
    return out


def budget(name: str, watched, measured, window: dict | None, plain: str) -> Finding:
    """The tokens each layer held (the watched run, every forward) and the bytes held after each turn (the measured
    run, the allocator's), against what the family keeps at that budget; the plain window's bytes beside them."""
    fam = watched.family
    if fam is None:
        return Finding("budget", name, True, "n/a: it evicts nothing (what it holds is its formula's: bytes)")
    if "budget" in watched.broken:
        return Finding("budget", name, False, _first_broken(watched, "budget"))
    tokens = (
        f"every layer within what {type(fam).__name__} keeps at budget={fam.budget}, read from its keys after "
        f"each of {watched.forwards} forwards"
    )
    if measured is None:
        return Finding("budget", name, True, tokens + " (while it ran)")
    lane = measured.lane
    turns = [t for t in lane.book.turns if t.between is not None]
    if not turns:
        return Finding("budget", name, True, tokens + "; its bytes not measured here (no allocator could be read)")
    worst = None
    for (turn, count, _, _), held in zip(measured.ends, turns):
        forwards = lane.forwards[:count]
        allowed = fam.formula_between_turns(measured.geometry, sum(f.q for f in forwards), forwards)
        if held.between > allowed + BUDGET_SLACK and worst is None:
            worst = (turn, held.between, allowed)
    plain_bytes = window["state_bytes"]["between_turns_peak"]
    if worst is not None:
        turn, held, allowed = worst
        return Finding(
            "budget",
            name,
            False,
            f"holds {held:,} B after turn {turn}, more than the {allowed:,} B "
            f"{type(fam).__name__} holds there at budget={fam.budget} (the plain "
            f"window: {plain_bytes:,} B at most, {plain}); allowed: its family's "
            f"bytes + {BUDGET_SLACK:,} B (its own formulas do not widen them)",
        )
    peak = lane.book.between_turns_peak
    return Finding(
        "budget",
        name,
        True,
        f"{tokens}; {peak:,} B held between turns at most (the plain window: {plain_bytes:,} B at {plain})",
    )


def determinism(name: str, first, second) -> Finding:
    """The same spec run twice on the same kernels: the same tokens, the same keys and values held after every turn."""
    for (turn, _, tokens, held), (_, _, again, held_again) in zip(first.ends, second.ends):
        if tokens != again:
            return Finding(
                "determinism",
                name,
                False,
                f"two runs of the same spec answered turn {turn} differently "
                f"({tokens} and {again}); allowed: a seeded draw "
                "(torch.Generator().manual_seed), the same choice every run",
            )
        if held != held_again:
            return Finding(
                "determinism",
                name,
                False,
                f"two runs of the same spec held different keys or values "
                f"after turn {turn}; allowed: a seeded draw "
                "(torch.Generator().manual_seed), the same choice every run",
            )
    return Finding(
        "determinism",
        name,
        True,
        f"two runs: the same tokens and the same keys and values held after each of {len(first.ends)} turns",
    )


def stored_bytes(name: str, r: dict, window: dict, result: dict) -> list[Finding]:
    sb = r["state_bytes"]
    out = []
    if sb["formula_matches_measurement"] is None:
        out.append(Finding("bytes", name, True, "not measured here (no allocator could be read): formula only"))
    elif sb["formula_matches_measurement"]:
        out.append(
            Finding(
                "bytes",
                name,
                True,
                f"measured = formula at every step and between turns "
                f"({sb['between_turns_peak']:,} B held between turns at most)",
            )
        )
    else:
        where, seen, measured, formula = sb["mismatches"][0]
        out.append(
            Finding(
                "bytes",
                name,
                False,
                f"measured differs from its formula at {sb['mismatch_count']} "
                f"points, first at {where} with {seen} tokens seen: {measured:,} B "
                f"measured, {formula:,} B by its formula",
            )
        )
    if sb["declared_mismatch_count"]:
        out.append(
            Finding(
                "bytes",
                name,
                False,
                f"the tensors it lists (state_tensors) differ from its formula at "
                f"{sb['declared_mismatch_count']} forwards",
            )
        )
    mine, plain = sb["outside_torch"]["held"], window["state_bytes"]["outside_torch"]["held"]
    unattributed = (result.get("unattributed_bytes") or {}).get("bytes", 0)
    allowed = None if plain is None else plain + OUTSIDE_ALLOWANCE + OUTSIDE_SHARE * (sb["final_persistent"] or 0)
    if mine is not None and allowed is not None and mine > allowed:
        out.append(
            Finding(
                "nothing hidden",
                name,
                False,
                f"holds {mine:,} B outside torch (numpy's data, Python's "
                f"buffers) against the plain window's {plain:,} B (allowed: "
                f"{allowed:,.0f} B): state belongs in tensors its formula "
                "counts",
            )
        )
    elif unattributed:
        parts = ", ".join(
            f"{part.replace('_', ' ')} {n:,} B"
            for part, n in result["unattributed_bytes"].items()
            if part not in ("bytes", "peak") and n
        )
        out.append(
            Finding(
                "nothing hidden",
                name,
                False,
                f"the run left {unattributed:,} B no lane holds ({parts}: "
                "Python objects, malloc, mmap or a file mapping kept beside "
                "its tensors, or owner 0)",
            )
        )
    else:
        out.append(
            Finding("nothing hidden", name, True, "nothing outside torch beyond a plain window's, nothing unattributed")
        )
    return out


def sliding_layers(name: str, cache, loaded) -> Finding:
    specs = compat.layer_specs(loaded.config)
    sliding = [s.index for s in specs if s.is_sliding]
    wrong = [i for i in sliding if type(cache.layers[i]) is not SlidingLayer]
    if not sliding:
        return Finding("sliding layers", name, True, "none in this model")
    if wrong:
        return Finding(
            "sliding layers",
            name,
            False,
            f"layers {wrong} are sliding-window layers the strategy "
            "replaced; allowed: leave them as the full cache keeps them",
        )
    return Finding("sliding layers", name, True, f"{len(sliding)} sliding-window layers left as the full cache's")


def against_full(name: str, r: dict, exact: bool) -> Finding:
    """Tokens and K/V against the full cache; a strategy that claims exactness (the instance's `claims_exact`, not
    the class's `exact`: the exact families decide by their settings) must keep both equal."""
    match, kv = r["token_match"], r["kv_exact"]
    words = (
        f"token match {match:.3f}, first divergence {r['first_divergence']}, K/V exact: "
        f"{'n/a (lossy)' if kv is None else kv}"
    )
    if exact and (match != 1.0 or kv is not True):
        return Finding(
            "against the full cache",
            name,
            False,
            f"it claims exactness (claims_exact), so every token and bit-equal K/V: {words}",
        )
    return Finding("against the full cache", name, True, words + (" (claims exactness)" if exact else ""))
