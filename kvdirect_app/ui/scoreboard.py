"""The first thing on screen: one row per pane with its verdict, its memory and its speed.

Seven panes do not fit a projector's 1280x720 without scrolling; this table
does, so a room sees which strategies kept every token (and bit-equal K/V),
where the others first differed, what each held and how fast it ran,
before anyone scrolls to the panes themselves.
"""

from __future__ import annotations

import html

from ..palette import colours
from ..units import fmt_bytes
from .session import Session
from .settings import REFERENCE, title


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
        return ('<div class="kvd-board kvd-board-empty">Send a message, or press <b>Recall demo</b>: one row per '
                'strategy will show whether it kept every token, what it held and how fast it ran.</div>')
    palette = colours(session.shown)
    rows = []
    for label in session.shown:
        lane = session.lanes.get(label)
        f = lane.turn_figures() if lane is not None and lane.memory else {}
        kind, words = verdict(session, label)
        notes = session.about.get(label, {}).get("notes", ())
        if notes:
            words += f' <span class="kvd-note" title="{html.escape(" ".join(notes))}">· settings adapted: ' \
                     f'{html.escape(notes[0].split(";")[-1].strip())}</span>'
        tps = lane.tokens_per_s() if lane is not None else None
        between = f.get("between") if f.get("between") is not None else f.get("formula_between")
        peak = f.get("peak") if f.get("peak") is not None else f.get("formula_peak")
        name, _, settings = label.partition(":")
        ms = "—" if f.get("ms_per_token") is None else f"{f['ms_per_token']:.0f}"
        says = session.says_expected(label)
        answer = ("" if session.expect is None else
                  '<td class="kvd-num">…</td>' if says is None else
                  f'<td class="kvd-num kvd-{"good" if says else "bad"}">{"✓" if says else "✗"}</td>')
        rows.append(
            f'<tr><td><span class="kvd-dot" style="background:{palette.get(label, "#333")}"></span>'
            f'<b>{html.escape(title(name))}</b> <code title="{html.escape(label)}">'
            f'{html.escape(settings.replace(":", " "))}</code></td>'
            f'<td class="kvd-{kind}">{words}</td>{answer}'
            f'<td class="kvd-num">{fmt_bytes(between) if between is not None else "—"}</td>'
            f'<td class="kvd-num">{fmt_bytes(peak) if peak is not None else "—"}</td>'
            f'<td class="kvd-num">{ms}</td>'
            f'<td class="kvd-num">{"—" if tps is None else f"{tps:.1f}"}</td></tr>')
    asked = ("" if session.expect is None else
             f'<th title="does its reply to the scenario\'s last question contain the right answer?">'
             f'says {html.escape(session.expect[1])}?</th>')
    recorded = (f' <span class="kvd-recorded-label" title="every figure on this page is the recorded one">· '
                f'{html.escape(session.recorded_label)}</span>' if session.recording else "")
    memory = (session.result or {}).get("memory_instrument") or session.memory_instrument or "the run's instrument"
    head = (f'<tr><th>strategy</th><th>verdict against the full cache{recorded}</th>' + asked +
            f'<th title="bytes held after the last finished turn ({html.escape(memory)})">between turns</th>'
            f'<th title="highest bytes during a forward of this turn ({html.escape(memory)})">peak in turn</th>'
            '<th title="mean ms of this strategy\'s own work per decode step this turn: its attention, its cache\'s '
            'work, and the batched pass\'s shared linears charged by rows (1/N to each of N rows)">own ms/token</th>'
            '<th title="tokens per second of its own work alone; every pane shows a token per step, at the step\'s '
            'speed (the last row)">own tok/s</th></tr>')
    return f'<table class="kvd-board">{head}{"".join(rows)}{_step_rows(session, bool(session.expect))}</table>'


def _step_rows(session: Session, asked: bool) -> str:
    """Below the panes, one row: the step's wall time (what a visitor sees: one token in every pane per step) and
    its parts, the panes' own time, the instruments' (measurement, by instrument) and the unattributed rest, which
    add up to it."""
    means = session.step_means()
    if means is None:
        return ""
    measured = sum(means["measurement"].values())
    parts = ", ".join(f"{name} {ms:.0f}" for name, ms in sorted(means["measurement"].items(), key=lambda kv: -kv[1])
                      if ms >= 0.5)
    wall = means["wall"]
    words = (f"= panes' own {means['lanes']:.0f} + measurement {measured:.0f}{f' ({parts})' if parts else ''} + "
             f"unattributed {means['unattributed']:.0f} ms · mean of {means['steps']} steps this turn")
    title = ("a decode step's wall time: every pane gets one token per step, so this is the speed each pane is seen "
             "at; its parts are the panes' own ms/token (the column above), the instruments' time (measurement: "
             "never inside a pane's) and what is nobody's (choosing tokens, bookkeeping)")
    return (f'<tr class="kvd-step-row" title="{html.escape(title)}"><td><b>step, as seen</b></td>'
            f'<td colspan="{4 if asked else 3}" class="kvd-note">{html.escape(words)}</td>'
            f'<td class="kvd-num"><b>{wall:.0f}</b></td>'
            f'<td class="kvd-num"><b>{1e3 / wall:.1f}</b></td></tr>' if wall > 0 else "")
