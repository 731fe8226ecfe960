"""The first thing on screen: one row per pane with its verdict, its memory and its own time.

Seven panes do not fit a projector's 1280x720 without scrolling; this table
does, so a room sees which strategies kept every token (and bit-equal K/V),
where the others first differed, what each held and what its own work cost,
before anyone scrolls to the panes themselves.

Speeds are told as they were experienced: the panes run in lockstep, so every
pane streamed at the same rate, the step's (the last row, measured from the
tokens' arrival); a pane's own work is its ms per step and its share of the
step, never a tokens-per-second nobody saw.  The column of own ms per step adds
up to the last row's "panes' own".
"""

from __future__ import annotations

import html

from ...plain.palette import colours, strategy_name
from ...plain.units import fmt_bytes
from .session import Session
from .settings import REFERENCE, title
from .views import BYTE_SOURCES, byte_figure, memory_instrument, own_cost, source_legend


def verdict(session: Session, label: str) -> tuple[str, str]:
    """(css kind, words) for a pane: the reference, exact, same so far, or where it first differs."""
    lane = session.lanes.get(label)
    summary = (session.result or {}).get("strategies", {}).get(label, {})
    if label == REFERENCE:
        return "note", "reference"
    if lane is None or not lane.total:
        return "note", "waiting"
    if lane.divergence is not None:
        turn, index = lane.divergence
        where = f"token {index + 1}" if len(session.user_turns) <= 1 else f"turn {turn + 1}, token {index + 1}"
        return "bad", f"differs at {where} · match {100 * lane.match:.0f}%"
    if summary.get("exact_unavailable"):
        return "warn", "same tokens; no exact mode on this machine"
    if summary.get("kv_exact") and summary.get("rebuilt_token_layers"):
        return "good", "exact: same tokens, K/V bit-equal"
    if summary.get("kv_exact") is False:
        return "warn", f"same tokens so far; K/V differ (max|ΔK| {summary['max_abs_dk']:.1e})"
    return "good", "same tokens so far"


def scoreboard_html(session: Session) -> str:
    if not session.shown:
        return (
            '<div class="kvd-board kvd-board-empty">Send a message, or press <b>Recall demo</b>: one row per '
            "strategy will show whether it kept every token, what it held and how fast it ran.</div>"
        )
    palette = colours(session.shown)
    means = session.step_means()  # once per drawing: each row reads its lane's share of it
    instrument = memory_instrument(session)
    rows = []
    sources = {"between": set(), "peak": set()}  # the instruments behind each byte column's figures
    for label in session.shown:
        lane = session.lanes.get(label)
        f = lane.turn_figures() if lane is not None and lane.memory else {}
        kind, words = verdict(session, label)
        notes = session.about.get(label, {}).get("notes", ())
        if notes:
            words += (
                f' <span class="kvd-note" title="{html.escape(" ".join(notes))}">· settings adapted: '
                f"{html.escape(notes[0].split(';')[-1].strip())}</span>"
            )
        off = lane.disagreements() if lane is not None else 0
        if off:  # the allocator saw other bytes than the strategy's formula: a hidden copy, or a wrong formula
            words += (
                f' <span class="kvd-bad kvd-bytes-off" title="the allocator measured other held bytes than this '
                f"strategy's formula at {off} step(s): it holds something its formula does not count\">· "
                f"holds ≠ its formula ({off} steps)</span>"
            )
        between, source = byte_figure(
            f.get("between"), f.get("formula_between"), "held after the last finished turn", instrument
        )
        between += _outside(f)
        sources["between"].add(source)
        peak, source = byte_figure(
            f.get("peak"),
            f.get("formula_peak"),
            "highest during a forward of this turn",
            instrument,
            f.get("peak_source"),
        )
        sources["peak"].add(source)
        name = strategy_name(label)
        own, share = own_cost(session, label, f.get("ms_per_token"), means)
        says = session.says_expected(label)
        answer = (
            ""
            if session.expect is None
            else '<td class="kvd-num">…</td>'
            if says is None
            else f'<td class="kvd-num kvd-{"good" if says else "bad"}">{"✓" if says else "✗"}</td>'
        )
        rows.append(
            f'<tr><td title="{html.escape(label)}"><span class="kvd-dot" style="background:'
            f'{palette.get(label, "#333")}"></span><b>{html.escape(title(name))}</b></td>'
            f'<td class="kvd-{kind}">{words}</td>{answer}'
            f'<td class="kvd-num">{between}</td>'
            f'<td class="kvd-num">{peak}</td>'
            f'<td class="kvd-num">{own}</td>'
            f'<td class="kvd-num">{share}</td></tr>'
        )
    asked = (
        ""
        if session.expect is None
        else f'<th title="does its reply to the scenario\'s last question contain the right answer?">'
        f"says {html.escape(session.expect[1])}?</th>"
    )
    recorded = (
        f' <span class="kvd-recorded-label" title="every figure on this page is the recorded one">· '
        f"{html.escape(session.recorded_label)}</span>"
        if session.recording
        else ""
    )
    head = (
        f"<tr><th>strategy{_legend(sources['between'] | sources['peak'], instrument)}</th>"
        f"<th>verdict against the full cache{recorded}</th>"
        + asked
        + _bytes_head("between turns", "bytes held after the last finished turn", sources["between"], instrument)
        + _bytes_head("peak in turn", "highest bytes during a forward of this turn", sources["peak"], instrument)
        + "<th title=\"mean ms of this strategy's own work per decode step this turn (a step it sat out counts 0): "
        "its attention, its cache's work, and the batched pass's shared linears charged by rows (1/N to each of "
        "N rows); the column adds up to the last row's panes' own\">own ms/step</th>"
        "<th title=\"its own ms per step as a share of the step's wall time: every pane waits for the whole step, "
        'so this is what it costs, not how fast it streamed">share of step</th></tr>'
    )
    return f'<table class="kvd-board">{head}{"".join(rows)}{_step_rows(session, bool(session.expect))}</table>'


# Beside a pane's held bytes (its tensors' after the last finished turn; in its first turn, its peak so far), what
# its work holds outside torch (numpy's data, Python's buffers) is written out when it is this large a share of them
# (below it: a few KB of Python lists, its own bookkeeping, and the buffers a process's first calls cache, which a
# first turn's panes would otherwise all show).  Either way it is in the run's JSON (`state_bytes.outside_torch`).
OUTSIDE_SHOWN = 0.1


def _outside(figures: dict) -> str:
    """The bytes a pane holds outside torch after the last step (`Lane.turn_figures`), beside its held figure."""
    outside = figures.get("outside")
    held = figures.get("between") if figures.get("between") is not None else figures.get("peak")
    if not outside:
        return ""
    if held is not None and outside < OUTSIDE_SHOWN * held:
        return ""
    words = f"held outside torch (numpy's data, Python's buffers) after the last step: {fmt_bytes(outside)}"
    return f' <span class="kvd-bad kvd-outside" title="{html.escape(words)}">+{fmt_bytes(outside)} outside torch</span>'


def _named(sources: set, instrument: str) -> list[str]:
    """Each source's mark and name, in `BYTE_SOURCES`' order; a measured one in the run's own words."""
    measured = lambda s: s in ("allocator", "declared") and instrument
    return [
        f"{BYTE_SOURCES[s][0]} {instrument if measured(s) else BYTE_SOURCES[s][1]}"
        for s in BYTE_SOURCES
        if s in sources
    ]


def _bytes_head(name: str, what: str, sources: set, instrument: str) -> str:
    """A byte column's head: its tooltip names the instruments whose figures are in the column, as the marks
    after each figure (`views.BYTE_SOURCES`), and no other: a formula figure is never under a measured
    instrument's name alone."""
    named = _named(sources - {None}, instrument)
    title = f"{what}; each figure is marked with what produced it: {', '.join(named)}" if named else what
    return f'<th title="{html.escape(title)}">{name}</th>'


def _legend(sources: set, instrument: str) -> str:
    """The byte figures' marks, named, under the head's first cell (which has room to spare: the board's rows
    must fit the first screen, and a line more under the byte columns' narrow heads would push them down)."""
    present = sources - {None}
    if not present:
        return ""
    return (
        f'<br><span class="kvd-note kvd-src-legend" title="{html.escape("; ".join(_named(present, instrument)))}">'
        f"bytes: {html.escape(source_legend(present))}</span>"
    )


def _step_rows(session: Session, asked: bool) -> str:
    """Below the panes, one row: the step's wall time (one token in every pane per step) and its parts, the panes'
    own time (the column's sum), the instruments' (measurement, by instrument), the engine's and the unattributed
    rest, which add up to it; and the rate every pane streamed at, as the page received the tokens."""
    means = session.step_means()
    if means is None:
        return ""
    measured = sum(means["measurement"].values())
    parts = ", ".join(
        f"{name} {ms:.0f}" for name, ms in sorted(means["measurement"].items(), key=lambda kv: -kv[1]) if ms >= 0.5
    )
    wall = means["wall"]
    own = sum(means["own"].values())
    words = (
        f"= panes' own {own:.0f} + measurement {measured:.0f}{f' ({parts})' if parts else ''} + "
        f"engine {means['engine']:.0f} + unattributed {means['unattributed']:.0f} ms · mean of {means['steps']} "
        "steps this turn"
    )
    rate = session.seen_rate()
    seen = "—" if rate is None else f"{rate:.1f} tok/s"
    title = (
        "a decode step's wall time: every pane gets one token per step, in lockstep, so every pane streams at "
        "the same rate: the last cell, tokens per second from this turn's first token to its last as they "
        "reached the page; its parts are the panes' own ms/step (the column above, summed), the instruments' "
        "time (measurement: never inside a pane's), the engine's own (choosing tokens, detokenising, events) "
        "and what no clock covered"
    )
    return (
        f'<tr class="kvd-step-row" title="{html.escape(title)}"><td><b>every pane, as seen</b></td>'
        f'<td colspan="{4 if asked else 3}" class="kvd-note">{html.escape(words)}</td>'
        f'<td class="kvd-num"><b>{wall:.0f}</b></td>'
        f'<td class="kvd-num kvd-seen"><b>{seen}</b></td></tr>'
        if wall > 0
        else ""
    ) + _unattributed_row(session, asked)


def _unattributed_row(session: Session, asked: bool) -> str:
    """Bytes no pane's work holds (process-wide): blocks allocated outside every region, the measurement's own, and
    what the ledger's cross-check finds beside its hooks.  Shown whenever a meter reads them, 0 B included; the
    title says what can still go unseen."""
    now = session.unattributed
    if now is None:
        return ""
    parts = {
        "outside_regions": ("outside every region", "allocated outside every pane's work (code outside every region)"),
        "measurement": ("measurement", "the measurement's own work"),
        "malloc": ("malloc", "the C allocator's bytes no hook saw (bytes, bytearray, pickles, ctypes malloc)"),
        "python_objects": ("Python objects", "Python's small objects (a tuple's floats, a dict's ints)"),
        "anonymous": ("mappings", "private mappings (mmap, torch.from_file)"),
        "shared_memory": ("shared", "writable shared mappings (shared memory, np.memmap)"),
    }
    short = " · ".join(f"{word} {fmt_bytes(now[key])}" for key, (word, _) in parts.items() if now.get(key))
    long = "; ".join(f"{what} {fmt_bytes(now.get(key, 0))}" for key, (_, what) in parts.items())
    kind = "kvd-bad" if now["bytes"] else "kvd-note"
    title = html.escape(
        "bytes no pane's work holds (process-wide, since the run began): " + long + ".  Unseen: "
        "copies below the cross-check's floor (2 MiB plus 8 KiB a pane's step, in all), another "
        "process's memory, files written and not kept mapped"
    )
    return (
        f'<tr class="kvd-unattributed-row" title="{title}"><td><b>unattributed</b></td>'
        f'<td class="kvd-note">no pane\'s: {html.escape(short or "nothing")}</td>'
        + ("<td></td>" if asked else "")
        + f'<td class="kvd-num {kind}">{fmt_bytes(now["bytes"])}</td>'
        f'<td class="kvd-num {kind}">{fmt_bytes(session.unattributed_peak)}</td><td></td><td></td></tr>'
    )
