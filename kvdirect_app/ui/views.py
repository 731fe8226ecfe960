"""HTML and chat messages drawn from a Session: pane headers, replies, token map, status."""

from __future__ import annotations

import html

from ..units import fmt_bytes  # one byte format for the CLI tables and the page
from ..palette import colours
from .session import LaneView, Session, TurnReply
from .settings import REFERENCE, title

USER_PREVIEW = 360  # characters of a long user turn shown in each pane
STATE_CLASSES = {"kv": "K/V kept", "residual": "residual kept", "anchor": "anchor kept",
                 "replayed": "replayed from an anchor", "evicted": "evicted"}
STATE_TITLES = {
    "kv": "this layer holds the token's K/V",
    "residual": "this layer holds the token's attention input; its K/V are rebuilt from it",
    "anchor": "an anchor layer: it holds the token's residual (layer 0: its token id), from which the layers up to "
              "the next anchor are replayed",
    "replayed": "nothing of the token is held at this layer: its K/V are replayed from the anchor layer below",
    "evicted": "dropped: neither its K/V nor anything to rebuild them from",
}
PARTIAL = "⟨partial character⟩"
PARTIAL_TITLE = ("the reply ends inside a multi-byte character: the tokens with its last bytes were never generated "
                 "(end of turn or token limit)")


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


def _mark(shown: str, why: str) -> str:
    return f'<mark class="kvd-diverge" title="{html.escape(why)}">{shown}</mark>'


def _visible(piece: str) -> str:
    """A token's text where it must be seen even when blank: spaces as ␣, newlines as ↵."""
    if piece.strip():
        return _esc(piece).replace("\n", "↵<br>")
    return piece.replace("\n", "↵").replace(" ", "␣")


def _ended_at(reply: TurnReply | None, index: int) -> bool:
    """The reply's last token is `index` and has no text: it ended there on an end of sequence."""
    return reply is not None and index == len(reply.tokens) - 1 and len(set(reply.piece(index))) == 1


def reply_markup(session: Session, lane: LaneView, turn: int) -> str:
    """A reply as chat markup; the first token that differs from the full cache is highlighted.  A character
    cut at the end of the reply (decoded as U+FFFD) shows as a marker, and so does the end of a reply."""
    reply = lane.replies[turn]
    cut = reply.complete
    tail = f' <span class="kvd-note" title="{PARTIAL_TITLE}">{PARTIAL}</span>' if cut < len(reply.text) else ""
    if lane.divergence is None or lane.divergence[0] != turn or lane.label == REFERENCE:
        return (_esc(reply.text[:cut]) + tail) if reply.text else ("▍" if lane.active else "")
    index = lane.divergence[1]
    if index >= len(reply.tokens):  # this strategy stopped where the full cache went on
        return _esc(reply.text[:cut]) + tail + " " + _mark("⟂ end of reply", "this strategy's reply ends here; "
                                                                             "the full cache's goes on")
    start, end = reply.piece(index)
    if start == end:  # a token without text: this strategy's end of sequence
        return _esc(reply.text[:cut]) + tail + " " + _mark(
            "⟂ end of reply", "first token that differs from the full cache: this strategy ended its reply here "
                              "(end of sequence), the full cache's goes on")
    ref = session.reference
    why = "first token that differs from the full cache" + (
        ", which ended its reply here: this strategy went on"
        if ref is not None and turn < len(ref.replies) and _ended_at(ref.replies[turn], index) else "")
    if end > cut:  # the differing token is (part of) the cut character
        why += "; " + PARTIAL_TITLE
        tail = ""
    shown = _visible(reply.text[start:min(end, cut)]) + (PARTIAL if end > cut else "")
    return _esc(reply.text[:start]) + _mark(shown, why) + _esc(reply.text[end:cut]) + tail


def messages(session: Session, label: str) -> list[dict]:
    lane = session.lanes.get(label)
    out = []
    for k, user in enumerate(session.user_turns):
        shown = user if len(user) <= USER_PREVIEW else user[:USER_PREVIEW].rstrip() + f" … ({len(user):,} characters)"
        out.append({"role": "user", "content": _esc(shown)})
        if lane is not None and k < len(lane.replies):
            out.append({"role": "assistant", "content": reply_markup(session, lane, k)})
    return out


def _summary(session: Session, label: str) -> dict:
    if session.result is None:
        return {}
    return session.result.get("strategies", {}).get(label, {})


def _bytes_cell(measured, formula, what: str) -> str:
    """A byte figure: measured by the allocator, the formula beside it in the tooltip (or alone, labelled)."""
    if measured is None and formula is None:
        return "—"
    if measured is None:
        return f'<span title="{what}: by formula (allocator tracing is off)">{fmt_bytes(formula)}*</span>'
    return f'<span title="{what}: measured by the allocator; formula {fmt_bytes(formula)}">{fmt_bytes(measured)}</span>'


def pane_header(session: Session, label: str) -> str:
    lane = session.lanes.get(label)
    colour = colours(session.shown).get(label, "#333")
    name, _, settings = label.partition(":")
    chips = "".join(f'<span class="kvd-chip">{_esc(s)}</span>' for s in settings.split(":") if s)
    stats = []
    if lane is not None and lane.memory:
        f = lane.turn_figures()
        stats.append(f"between turns <b>{_bytes_cell(f['between'], f['formula_between'], 'held after the last turn')}</b>")
        stats.append(f"peak in turn <b>{_bytes_cell(f['peak'], f['formula_peak'], 'highest during a forward of this turn (state, transient buffers, activations)')}</b>")
        if f["ms_per_token"] is not None:
            stats.append(f'<span title="mean ms per decode step this turn: this strategy\'s own work (attention, '
                         f'recompute, replay, scoring, cache update) plus 1/N of the pass the N lanes make together '
                         f'(projections, MLP); the CLI\'s bench run --alone gives the cost deployed alone">'
                         f'<b>{f["ms_per_token"]:.0f}</b> ms/token</span>')
    if lane is not None and label != REFERENCE and lane.match is not None:
        cls = "good" if lane.match == 1.0 else "bad"
        stats.append(f'<span class="kvd-{cls}">match <b>{100 * lane.match:.0f}%</b></span>')
        if lane.agreement:
            stats.append(f'<span title="mean KL to the full cache, teacher-forced">KL {lane.agreement[-1]["kl"]:.2g}</span>')
    summary = _summary(session, label)
    notes = []
    if label == REFERENCE:
        notes.append('<span class="kvd-note">reference: every other pane is compared with this one</span>')
    elif lane is not None and lane.divergence is not None:
        turn, index = lane.divergence
        notes.append(f'<span class="kvd-bad">first differs at turn {turn + 1}, token {index + 1}</span>')
    elif lane is not None and lane.total:
        notes.append('<span class="kvd-good">same tokens as the full cache so far</span>')
    if summary.get("exact_unavailable"):
        notes.append(f'<span class="kvd-warn" title="{html.escape(summary["exact_unavailable"])}">no exact mode here</span>')
    elif summary.get("kv_exact") is not None and label != REFERENCE:
        if summary["kv_exact"] and not summary.get("rebuilt_token_layers"):
            notes.append('<span class="kvd-note" title="K/V equal, but nothing was rebuilt yet">K/V equal (nothing rebuilt yet)</span>')
        elif summary["kv_exact"]:
            notes.append(f'<span class="kvd-good" title="torch.equal on every compared layer, '
                         f'{summary["rebuilt_token_layers"]:,} token-layers rebuilt">K/V bit-equal ✓</span>')
        else:
            notes.append(f'<span class="kvd-warn" title="largest |ΔK| against the full cache">K/V differ: '
                         f'max|ΔK| {summary["max_abs_dk"]:.1e}</span>')
    for note in summary.get("notes", []):
        notes.append(f'<span class="kvd-note" title="{html.escape(note)}">settings adapted</span>')
    return (f'<div class="kvd-pane-head" style="border-left-color:{colour}">'
            f'<div class="kvd-pane-title" title="{html.escape(session.about.get(label, {}).get("doc", ""))}"><span class="kvd-dot" style="background:{colour}"></span>'
            f'{_esc(title(name))} <code>{_esc(name)}</code>{chips}</div>'
            f'<div class="kvd-stats">{" · ".join(stats) or "&nbsp;"}</div>'
            f'<div class="kvd-notes">{" ".join(notes) or "&nbsp;"}</div></div>')


def status(message: str, kind: str = "info") -> str:
    """kind: info | busy | ok | error."""
    return f'<div class="kvd-status kvd-status-{kind}">{_esc(message)}</div>'


def token_map_html(data: dict | None, label: str, layer: int, limit: int = 2000) -> str:
    """What `layer` keeps of each token (the engine's `token_map`), one chip per token; a break opportunity
    after every chip lets long lines wrap (a chip's own text keeps its spaces)."""
    if not data or not data.get("states"):
        return '<div class="kvd-empty">The token map appears after a turn: pick a strategy and a layer.</div>'
    tokens, states = data["tokens"], data["states"]
    counts = {s: states.count(s) for s in dict.fromkeys(states)}
    legend = " ".join(f'<span class="kvd-tok kvd-{s}" title="{html.escape(STATE_TITLES.get(s, s))}">'
                      f'{STATE_CLASSES.get(s, s)}: {n}</span>' for s, n in counts.items())
    start = max(0, len(states) - limit)
    cut = f'<span class="kvd-note">… {start} earlier tokens not drawn …</span> ' if start else ""
    spans = []
    for tok, state in zip(tokens[start:], states[start:]):
        text = tok.replace("\n", "↵") or "⟨no text⟩"
        spans.append(f'<span class="kvd-tok kvd-{state}" title="{html.escape(STATE_TITLES.get(state, state))}">'
                     f'{_esc(text)}</span>' + ("<br>" if "\n" in tok else "<wbr>"))
    return (f'<div class="kvd-map-head"><b>{_esc(label)}</b>, layer {layer}: {len(states)} tokens · {legend}</div>'
            f'<div class="kvd-map">{cut}{"".join(spans)}</div>')
