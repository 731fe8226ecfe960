"""The Claims tab's cards: one per claim of the papers, from a `bench reproduce` results.json whose verdicts
were computed from its numbers on loading (`claims.reproduce.load`, the function `--render` uses).

Each card has the verdict large, the paper's figure and ours, what ours was measured on (model, samples, turns,
budgets, device, kernels: whatever the claim's cells record) and the claim's one sentence, which opens with the
same verdict words, then the rule its figures were counted by where the claim's words leave it open (claim 9's
"changes task scores"); the full table and every measured row stay below, in the report's own words.  The page's
claims.css keeps words whole in the cards' narrow columns.
"""

from __future__ import annotations

import html

from ...claims.render import figure_text
from ...claims.verdicts import DIRECTION_ONLY, FAILS, HOLDS, NOT_MEASURED

KINDS = {HOLDS: "good", DIRECTION_ONLY: "warn", FAILS: "bad", NOT_MEASURED: "note"}


def cards_html(results: dict) -> str:
    # A line may break after a spec's ':' (anchorkv:spacing=30:budget=32), never inside a word (claims.css).
    e = lambda text: html.escape(str(text), quote=False).replace(":", ":<wbr>")  # noqa: E731
    cards = []
    for claim in results["claims"].values():
        paper = "; ".join(f"{f['label']} {figure_text(f['value'], f['unit'])}" for f in claim["figures"])
        ours = "; ".join(
            f"{f['label']} {figure_text(p['ours'], f['unit'])}" for f, p in zip(claim["figures"], claim["parts"])
        )
        kind = KINDS[claim["verdict"]]
        cards.append(
            f'<div class="kvd-card kvd-card-{kind}">'
            f'<div class="kvd-card-title">{e(claim["title"])} <span class="kvd-note">({e(claim["paper"])})</span></div>'
            f'<div class="kvd-card-claim">“{e(claim["claim"])}”</div>'
            f'<div class="kvd-card-verdict kvd-{kind}">{e(claim["verdict"])}</div>'
            f'<table class="kvd-card-figures"><tr><th>paper</th><td>{e(paper)}</td></tr>'
            f'<tr><th>ours</th><td>{e(ours)} <span class="kvd-note">({e(claim["basis"])})</span></td></tr>'
            f'<tr><th>on</th><td class="kvd-note">{e(claim["scope"])}; {e(claim["measured_on"])}</td></tr></table>'
            f'<div class="kvd-card-why" title="{html.escape(claim["reason"])}">{e(claim["sentence"])}</div>'
            + (f'<div class="kvd-card-rule kvd-note">Rule: {e(claim["rule"])}</div>' if claim.get("rule") else "")
            + (f'<div class="kvd-card-also kvd-note">In {e(claim["also"])}</div>' if claim.get("also") else "")
            + "</div>"
        )
    where = f"{e(results.get('device_name') or results.get('device', '?'))}, {e(results.get('date', '?'))}"
    run = (
        f"{'a quick run' if results.get('quick') else 'the full run'} of {len(results.get('cells', []))} cells"
        + (f" in {results['seconds'] / 60:.0f} min" if results.get("seconds") else "")
        + (
            f" ({results['resumed_cells']} of them resumed from a run that did not end, their time not counted)"
            if results.get("resumed_cells")
            else ""
        )
    )
    return (
        f'<div class="kvd-cards-head">Measured on {where}, {e(run)}, with <code>python -m kvdirect_app.bench '
        f"reproduce {'--quick ' if results.get('quick') else ''}--out DIR</code>; every number is a value of its "
        f"results.json, every verdict computed from those numbers as the page opened.</div>"
        f'<div class="kvd-cards">{"".join(cards)}</div>'
    )
