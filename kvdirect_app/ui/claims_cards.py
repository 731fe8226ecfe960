"""The Claims tab's cards: one per claim of the papers, from a `bench reproduce` results.json whose verdicts
were computed from its numbers on loading (`claims.reproduce.load`, the function `--render` uses).

Each card has the paper's figure, ours, where and with which kernels ours was measured, the verdict large and
one sentence why; the full table and every measured row stay below, in the report's own words.
"""

from __future__ import annotations

import html

from ..claims.render import figure_text

KINDS = {"holds": "good", "holds in direction, not in size": "warn", "does not hold here": "bad",
         "not measured": "note", "no effect within the tolerance of neutral": "warn"}


def first_sentence(reason: str) -> str:
    """The verdict's first reason, up to the first ';' (the report keeps the rest)."""
    head = reason.split(";")[0].strip()
    return head if head.endswith(".") else head + "."


def cards_html(results: dict) -> str:
    e = lambda text: html.escape(str(text), quote=False)  # noqa: E731
    cards = []
    for claim in results["claims"].values():
        paper = "; ".join(f"{f['label']} {figure_text(f['value'], f['unit'])}" for f in claim["figures"])
        ours = "; ".join(f"{f['label']} {figure_text(p['ours'], f['unit'])}"
                         for f, p in zip(claim["figures"], claim["parts"]))
        kind = KINDS.get(claim["verdict"], "note")
        cards.append(
            f'<div class="kvd-card kvd-card-{kind}">'
            f'<div class="kvd-card-title">{e(claim["title"])} <span class="kvd-note">({e(claim["paper"])})</span></div>'
            f'<div class="kvd-card-claim">“{e(claim["claim"])}”</div>'
            f'<div class="kvd-card-verdict kvd-{kind}">{e(claim["verdict"])}</div>'
            f'<table class="kvd-card-figures"><tr><th>paper</th><td>{e(paper)}</td></tr>'
            f'<tr><th>ours</th><td>{e(ours)} <span class="kvd-note">({e(claim["basis"])}; {e(claim["model"])})</span>'
            f'</td></tr><tr><th>on</th><td class="kvd-note">{e(claim["measured_on"])}</td></tr></table>'
            f'<div class="kvd-card-why" title="{html.escape(claim["reason"])}">{e(first_sentence(claim["reason"]))}</div>'
            f'</div>')
    where = f'{e(results.get("device_name") or results.get("device", "?"))}, {e(results.get("date", "?"))}'
    return (f'<div class="kvd-cards-head">Measured on {where} with <code>python -m kvdirect_app.bench reproduce '
            f'{"--quick " if results.get("quick") else ""}--out DIR</code>; every number is a value of its '
            f'results.json, every verdict computed from those numbers as the page opened.</div>'
            f'<div class="kvd-cards">{"".join(cards)}</div>')
