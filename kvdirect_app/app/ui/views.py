"""HTML and chat messages drawn from a Session: pane headers, replies, token map, status."""

from __future__ import annotations

import html
import re

from ...plain.palette import colours
from ...plain.paths import data
from ...plain.recording import describe
from ...plain.specs import name_of
from ...plain.units import fmt_bytes  # one byte format for the CLI tables and the page
from .session import LaneView, Session, TurnReply
from .settings import REFERENCE, title

USER_PREVIEW = 360  # characters of a long user turn shown in each pane
STATE_CLASSES = {
    "kv": "K/V kept",
    "residual": "residual kept",
    "anchor": "anchor kept",
    "replayed": "replayed from an anchor",
    "evicted": "evicted",
}
STATE_TITLES = {
    "kv": "this layer holds the token's K/V",
    "residual": "this layer holds the token's attention input; its K/V are rebuilt from it",
    "anchor": "an anchor layer: it holds the token's residual (layer 0: its token id), from which the layers up to "
    "the next anchor are replayed",
    "replayed": "nothing of the token is held at this layer: its K/V are replayed from the anchor layer below",
    "evicted": "dropped: neither its K/V nor anything to rebuild them from",
}
PARTIAL = "⟨partial character⟩"
PARTIAL_TITLE = (
    "the reply ends inside a multi-byte character: the tokens with its last bytes were never generated "
    "(end of turn or token limit)"
)


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
        return (
            _esc(reply.text[:cut])
            + tail
            + " "
            + _mark("⟂ end of reply", "this strategy's reply ends here; the full cache's goes on")
        )
    start, end = reply.piece(index)
    if start == end:  # a token without text: this strategy's end of sequence
        return (
            _esc(reply.text[:cut])
            + tail
            + " "
            + _mark(
                "⟂ end of reply",
                "first token that differs from the full cache: this strategy ended its reply here "
                "(end of sequence), the full cache's goes on",
            )
        )
    ref = session.reference
    why = "first token that differs from the full cache" + (
        ", which ended its reply here: this strategy went on"
        if ref is not None and turn < len(ref.replies) and _ended_at(ref.replies[turn], index)
        else ""
    )
    if end > cut:  # the differing token is (part of) the cut character
        why += "; " + PARTIAL_TITLE
        tail = ""
    shown = _visible(reply.text[start : min(end, cut)]) + (PARTIAL if end > cut else "")
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


# Which instrument produced a byte figure: a mark after every figure (the panes' and the scoreboard's), named in
# its tooltip and in the scoreboard's column heads.  The formula stands in wherever nothing measured the figure.
# Modifier letters, not <sup>: a raised box would make every scoreboard row taller (the first screen is 720 px).
BYTE_SOURCES = {  # source -> (mark, name)
    "allocator": ("ᵃ", "allocator"),
    "declared": ("ᵈ", "declared by the strategy"),
    "estimated": ("ᵉ", "held + the formula's buffers (no peak read here)"),
    "formula": ("*", "formula"),
    "unnamed": ("?", "unnamed instrument"),
}


def memory_instrument(session: Session) -> str:
    """What measured the run's bytes (the engine's words, e.g. "allocator trace (cpu)"), "" where not recorded."""
    return (session.result or {}).get("memory_instrument") or session.memory_instrument or ""


def byte_source(measured, instrument: str, peak_source: str | None = None) -> str:
    """The source of a byte figure: "formula" where nothing measured it, "estimated" for a peak no instrument could
    read (held + the formula's buffers), else the run's memory instrument: "allocator" (measured), "declared"
    (what the strategy lists: never called measured)."""
    if measured is None:
        return "formula"
    name = (instrument or "").lower()
    if "declared" in name or name.startswith(("tensor storages", "storage")):
        return "declared"
    if peak_source == "formula":
        return "estimated"
    if "allocator" in name or name.startswith("trace"):
        return "allocator"
    return "unnamed"


def byte_figure(
    measured, formula, what: str, instrument: str = "", peak_source: str | None = None
) -> tuple[str, str | None]:
    """(html, source) of a byte figure: the measured value where there is one, else the formula's, followed by
    its source's mark (`BYTE_SOURCES`), the instrument named in its tooltip with the formula beside it;
    ("—", None) where there is neither."""
    if measured is None and formula is None:
        return "—", None
    source = byte_source(measured, instrument, peak_source)
    mark, name = BYTE_SOURCES[source]
    if source == "formula":
        value, tip = formula, f"{what}: by formula ({mark}), nothing measured it"
    else:
        by = instrument or name
        how = {
            "declared": f"declared by the strategy, not measured ({by})",
            "estimated": f"held bytes by {by} plus the formula's buffers: no peak could be read",
        }.get(source, f"measured by {by}")
        value, tip = (
            measured,
            f"{what}: {how} ({mark})" + (f"; formula {fmt_bytes(formula)}" if formula is not None else ""),
        )
    return (
        f'<span class="kvd-bytes" data-source="{source}" title="{html.escape(tip)}">{fmt_bytes(value)}'
        f'<span class="kvd-note kvd-src">{mark}</span></span>',
        source,
    )


def source_legend(sources) -> str:
    """The marks of `sources`, each named, in `BYTE_SOURCES`' order: "ᵃ allocator · * formula"."""
    return " · ".join(f"{mark} {name}" for source, (mark, name) in BYTE_SOURCES.items() if source in sources)


def _bytes_cell(measured, formula, what: str, instrument: str = "") -> str:
    return byte_figure(measured, formula, what, instrument)[0]


def own_cost(session: Session, label: str, per_token: float | None, means: dict | None = None) -> tuple[str, str]:
    """(own ms per step, share of the step) of a pane this turn.  From the engine's step times where the run has
    them (the column then adds up to the step row's "panes' own"); an older recording has only each pane's own
    mean over the steps it ran, shown as such, with no share."""
    means = session.step_means() if means is None else means
    if means is None:
        return ("—" if per_token is None else f"{per_token:.0f}"), "—"
    ms = means["own"].get(label, 0.0)
    return f"{ms:.0f}", (f"{100 * ms / means['wall']:.0f}%" if means["wall"] > 0 else "—")


def header_html(memory: str = "") -> str:
    """The banner: what the studio is, and what the exact strategies hold on the loaded model (said once it is
    loaded: `geometry_panel.memory_banner`), never a promise that holds on some models only."""
    return (data("assets") / "header.html").read_text(encoding="utf-8").replace("{memory}", _esc(memory))


def pane_header(session: Session, label: str) -> str:
    lane = session.lanes.get(label)
    colour = colours(session.shown).get(label, "#333")
    name, _, settings = label.partition(":")
    chips = "".join(f'<span class="kvd-chip">{_esc(s)}</span>' for s in settings.split(":") if s)
    stats = []
    if lane is not None and lane.memory:
        f = lane.turn_figures()
        by = memory_instrument(session)
        stats.append(
            f"between turns <b>{_bytes_cell(f['between'], f['formula_between'], 'held after the last turn', by)}</b>"
        )
        stats.append(
            f"peak in turn <b>{_bytes_cell(f['peak'], f['formula_peak'], 'highest during a forward of this turn', by)}"
            "</b>"
        )
        if f["ms_per_token"] is not None:
            own, share = own_cost(session, label, f["ms_per_token"])
            stats.append(
                f'<span title="its own work per decode step this turn (attention, recompute, replay, '
                f"scoring, cache update, and 1/N of the pass the N lanes make together) and its share of the "
                f"step; every pane streams at the step's rate (the scoreboard's last row); the CLI's bench "
                f'run --alone gives the cost deployed alone">own <b>{own}</b> ms/step'
                f"{'' if share == '—' else f' ({share})'}</span>"
            )
    if lane is not None and label != REFERENCE and lane.match is not None:
        cls = "good" if lane.match == 1.0 else "bad"
        stats.append(f'<span class="kvd-{cls}">match <b>{100 * lane.match:.0f}%</b></span>')
        if lane.agreement and lane.agreement[-1]["kl"] is not None:
            stats.append(
                f'<span title="mean KL to the full cache, teacher-forced">KL {lane.agreement[-1]["kl"]:.2g}</span>'
            )
    summary = _summary(session, label)
    notes = []
    if label == REFERENCE:  # (a lane that keeps the full cache's tokens says nothing more: the scoreboard says it)
        notes.append('<span class="kvd-note">the reference</span>')
    elif lane is not None and lane.divergence is not None:
        turn, index = lane.divergence
        notes.append(f'<span class="kvd-bad">first differs at turn {turn + 1}, token {index + 1}</span>')
    if summary.get("exact_unavailable"):
        notes.append(
            f'<span class="kvd-warn" title="{html.escape(summary["exact_unavailable"])}">no exact mode here</span>'
        )
    elif summary.get("kv_exact") is not None and label != REFERENCE:
        if summary["kv_exact"] and not summary.get("rebuilt_token_layers"):
            notes.append(
                '<span class="kvd-note" title="K/V equal, but nothing was rebuilt yet">'
                "K/V equal (nothing rebuilt yet)</span>"
            )
        elif summary["kv_exact"]:
            notes.append(
                f'<span class="kvd-good" title="torch.equal on every compared layer, '
                f'{summary["rebuilt_token_layers"]:,} token-layers rebuilt">K/V bit-equal ✓</span>'
            )
        else:
            notes.append(
                f'<span class="kvd-warn" title="largest |ΔK| against the full cache">K/V differ: '
                f"max|ΔK| {summary['max_abs_dk']:.1e}</span>"
            )
    for note in summary.get("notes", []):
        notes.append(f'<span class="kvd-note" title="{html.escape(note)}">settings adapted</span>')
    told = _memory_told(session, name)
    if told:
        notes.append(f'<span class="kvd-memory-told">{_esc(told)}</span>')
    return (
        f'<div class="kvd-pane-head" style="border-left-color:{colour}">'
        f'<div class="kvd-pane-title" title="{html.escape(session.about.get(label, {}).get("doc", ""))}">'
        f'<span class="kvd-dot" style="background:{colour}"></span>'
        f"{_esc(title(name))}{chips}</div>"
        f'<div class="kvd-stats">{" · ".join(stats) or "&nbsp;"}</div>'
        f'<div class="kvd-notes">{" ".join(notes) or "&nbsp;"}</div></div>'
    )


def _memory_told(session: Session, name: str) -> str:
    """The loaded model's sentence on what this exact strategy holds (`geometry_panel.memory_words`), where the
    run on screen is on that model (a recording of another model keeps its own figures and no sentence)."""
    model, words = session.memory_words
    shown = (session.recording or {}).get("model") or (session.config.model if session.config else None)
    return words[name][0] if model and model == shown and name in words else ""


def without_paths(line: str) -> str:
    """A loader's progress line for the page: no folder of this machine in it."""
    return re.sub(r"\s+in\s+(/|~)\S+", "", line)


def notice(message: str) -> str:
    """A line beside the message box that says what the next action will do (`TurnButtons.next_send`)."""
    return f'<div class="kvd-notice">{_esc(message)}</div>'


def status(message: str, kind: str = "info", title: str = "") -> str:
    """kind: info | busy | ok | error; `title`: more, in the hover."""
    hover = f' title="{html.escape(title)}"' if title else ""
    return f'<div class="kvd-status kvd-status-{kind}"{hover}>{_esc(message)}</div>'


def marked_tokens(tokens: list[str], words: str | None) -> set[int]:
    """Indices of the tokens that spell `words` wherever it occurs in the tokens' joined text."""
    if not words:
        return set()
    text, starts = "", []
    for tok in tokens:
        starts.append(len(text))
        text += tok
    out, at = set(), text.find(words)
    while at >= 0:
        out |= {i for i, s in enumerate(starts) if s < at + len(words) and s + len(tokens[i]) > at}
        at = text.find(words, at + 1)
    return out


def token_map_html(data: dict | None, label: str, layer: int, limit: int = 2000, mark: str | None = None) -> str:
    """What `layer` keeps of each token (the engine's `token_map`), one chip per token; a break opportunity
    after every chip lets long lines wrap (a chip's own text keeps its spaces).  The tokens that spell `mark`
    (a scenario's expected answer) are outlined, with what this layer kept of them in the head."""
    if not data or not data.get("states"):
        return '<div class="kvd-empty">The token map appears after a turn: pick a strategy and a layer.</div>'
    tokens, states = data["tokens"], data["states"]
    counts = {s: states.count(s) for s in dict.fromkeys(states)}
    legend = " ".join(
        f'<span class="kvd-tok kvd-{s}" title="{html.escape(STATE_TITLES.get(s, s))}">'
        f"{STATE_CLASSES.get(s, s)}: {n}</span>"
        for s, n in counts.items()
    )
    marked = marked_tokens(tokens[: len(states)], mark)
    found = ""
    if marked:
        kept = sorted({states[i] for i in marked})
        cls = "bad" if kept == ["evicted"] else "warn" if "evicted" in kept else "good"
        found = f' · <span class="kvd-{cls}">“{_esc(mark)}”: {", ".join(STATE_CLASSES.get(k, k) for k in kept)}</span>'
    start = max(0, len(states) - limit)
    cut = f'<span class="kvd-note">… {start} earlier tokens not drawn …</span> ' if start else ""
    spans = []
    for i, (tok, state) in enumerate(zip(tokens[start:], states[start:]), start):
        text = tok.replace("\n", "↵") or "⟨no text⟩"
        extra = " kvd-expect" if i in marked else ""
        spans.append(
            f'<span class="kvd-tok kvd-{state}{extra}" title="{html.escape(STATE_TITLES.get(state, state))}">'
            f"{_esc(text)}</span>" + ("<br>" if "\n" in tok else "<wbr>")
        )
    return (
        f'<div class="kvd-map-head"><b>{_esc(label)}</b>, layer {layer}: {len(states)} tokens{found} · {legend}</div>'
        f'<div class="kvd-map">{cut}{"".join(spans)}</div>'
    )


def side_by_side(parts: list[str], recorded: str = "") -> str:
    """One or two token maps next to each other (each scrolls on its own)."""
    caption = (
        f'<div class="kvd-note">{_esc(recorded)}: the token states at the end of the recorded run</div>'
        if recorded
        else ""
    )
    if len(parts) == 1:
        return caption + parts[0]
    return caption + '<div class="kvd-map-pair">' + "".join(f"<div>{p}</div>" for p in parts) + "</div>"


def telling_view(session: Session, maps: dict | None, states_at=None) -> tuple[str | None, str | None, int]:
    """The token map's opening view: (strategy, one to compare it with, layer).

    The most telling one: the lossy strategy that diverged first (else any that evicted tokens), at the layer
    where it evicted the most of the scenario's answer (else the most tokens); beside it the exact strategy
    that keeps the least (AnchorKV, else KV-Direct, else the full cache).  `maps` are the recording's token
    maps; without them `states_at(label, layer)` reads a live engine's.
    """
    shown = list(session.shown)
    if not shown:
        return None, None, 0

    def layers_of(label):
        if maps is not None and label in maps:
            return len(maps[label]["states"])
        return getattr(session.engine, "layers", 0) if session.engine is not None else 0

    def states(label, layer):
        if maps is not None and label in maps:
            codes = maps[label]["states"][layer]
            return list(codes) if isinstance(codes, str) else codes
        return states_at(label, layer) if states_at is not None else None

    evicted = (
        "e" if maps is not None and maps and isinstance(next(iter(maps.values()))["states"][0], str) else "evicted"
    )
    lossy = [label for label in shown if label != REFERENCE and name_of(label) not in ("kvdirect", "anchorkv")]
    diverged = sorted(
        (session.first_divergence_index(label), label)
        for label in lossy
        if session.lanes.get(label) is not None and session.lanes[label].divergence is not None
    )
    pick = diverged[0][1] if diverged else (lossy[0] if lossy else shown[0])
    exact = [label for name in ("anchorkv", "kvdirect") for label in shown if name_of(label) == name]
    other = exact[0] if exact else (REFERENCE if REFERENCE in shown and pick != REFERENCE else None)
    best, best_key = 0, None
    words = session.expect[1] if session.expect else None
    tokens = maps[pick]["tokens"] if maps is not None and pick in maps else None
    for layer in range(layers_of(pick)):
        st = states(pick, layer)
        if st is None:
            break
        marked = marked_tokens(tokens[: len(st)], words) if tokens is not None else set()
        key = (sum(st[i] == evicted for i in marked), st.count(evicted))
        if best_key is None or key > best_key:
            best, best_key = layer, key
    return pick, other, best


def recording_line(session: Session) -> str:
    """The line above the scoreboard: which recording is on screen, and that every number is the recorded one."""
    meta = session.recording
    if not meta:
        what = "▶ Replay it plays the recorded run picked under ⚙ Settings ▸ Recorded runs."
        return (
            (
                f'<div class="kvd-recording" title="{what}"><b>Live on this machine.</b> <span class="kvd-note">'
                f"{what}</span></div>"
            )
            if session.shown
            else ""
        )
    what = meta.get("scenario") or "a recorded conversation"
    says = {
        "recall": "a locker code told in turn 1, asked for seven turns later: the exact panes still say it, "
        "the eviction baselines have dropped it"
    }.get(meta.get("scenario") or "", meta.get("about", ""))
    full = (
        f"{describe(meta)}. Every number below is the recorded one; nothing is recomputed. ▶ Replay it plays "
        f"it back; ▶ Run it live runs the same conversation on this machine."
    )
    return (
        f'<div class="kvd-recording" title="{html.escape(full)}"><b>Recorded run: {_esc(what)}</b>'
        f'{" · " + _esc(says) if says else ""} <span class="kvd-note">· {meta.get("seconds", 0):.0f} s on '
        f"{_esc(str(meta.get('device', '?')))}</span></div>"
    )
