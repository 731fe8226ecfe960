"""report.md and the plots of `bench reproduce`, from results.json alone.

Every number in the report is a value of results.json written by `number`
(or `units.fmt_bytes`), so a test can read each one back.  The app's Claims
tab shows the part before "## Details" (`DETAILS`).
"""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go

from ..plain.png import write_png
from ..plain.units import fmt_bytes
from . import recompute_report

DETAILS = "## Details"


def number(x) -> str:
    """The one way a number is written in the report (the test reads them back against results.json)."""
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x}"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def figure_text(value, unit: str) -> str:
    """A figure (a number or a range) with its unit."""
    if value is None:
        return "not measured"
    text = "-".join(number(v) for v in value) if isinstance(value, (list, tuple)) else number(value)
    return text + ("x" if unit == "x" else f" {unit}" if unit else "")


def _ran_on(envs: list) -> str:
    """Where a section's cells ran, as each worker recorded it."""
    out = []
    for env in envs:
        if not env:
            out.append("not recorded")
            continue
        gpu = f" ({env['gpu']})" if env.get("gpu") else ""
        threads = f", {env['threads']} thread{'' if env['threads'] == 1 else 's'}" if env.get("threads") else ""
        out.append(f"{env['device']}{gpu}{threads}; CPU {env['processor']}, {env['cpus']} cores; torch {env['torch']}")
    return "Ran on: " + " — ".join(out) + "."


def cell(value) -> str:
    """A table cell's text, its `|` escaped so that "max |dlogit|" cannot split a row."""
    return str(value).replace("|", "\\|")


def _table(cols: list[str], rows: list[list]) -> list[str]:
    line = lambda cells: "| " + " | ".join(map(cell, cells)) + " |"  # noqa: E731
    return [line(cols), "|" + "---|" * len(cols), *map(line, rows)]


def _head(results: dict) -> list[str]:
    claims = results["claims"]
    rows = []
    for c in claims.values():
        models = ", ".join(sorted({f["model"] for f in c["figures"]}))
        paper = (
            f"{c['paper']}: "
            + "; ".join(f"{f['label']} {figure_text(f['value'], f['unit'])}" for f in c["figures"])
            + f" ({models})"
        )
        ours = "; ".join(f"{f['label']} {figure_text(p['ours'], f['unit'])}" for f, p in zip(c["figures"], c["parts"]))
        ours += f" ({c['basis']}; {c['scope']}; {c['measured_on']})"
        rows.append([f'{c["title"]}: "{c["claim"]}"', paper, ours, f"**{c['verdict']}**", c["sentence"]])
    out = _table(["claim", "paper", "ours", "verdict", "why"], rows)
    out += ["", "The whole reason, claim by claim:", ""]
    out += [
        f"- **{c['title']}**: {c['reason']}" + (f" Rule: {c['rule']}" if c.get("rule") else "") for c in claims.values()
    ]
    out += ["", results["rule"]["text"]]
    if results["quick"]:
        left_out = "; ".join(results["plan"]["quick_leaves_out"])
        out += ["", f"`--quick` leaves out, compared with the full run: {left_out}."]
    return out


def _details(results: dict) -> list[str]:
    sec = results["sections"]
    out = [DETAILS, ""]

    def title(name: str, extra: str = "") -> list[str]:
        return [f"### {results['claims'][name]['title']}{extra}", "", _ran_on(sec[name]["ran_on"]), ""]

    out += title("bytes", " (bf16, computed from the config)")
    out += _table(
        ["source", "layers", "KV per token", "residual per layer", "r", "s*", "s* (token ids)"],
        [
            [
                r["source"],
                r["layers"],
                fmt_bytes(r["kv_bytes_per_token"]),
                fmt_bytes(r["residual_bytes"]),
                number(r["ratio_r"]),
                r["break_even_spacing"],
                r["break_even_token_id"],
            ]
            for r in sec["bytes"]["rows"]
        ],
    )
    t = sec["turns20"]
    out += [
        "",
        *title(
            "turns20",
            f": scenario {t['scenario']}, {t['turns']} turns, at most {t['new_tokens']} new "
            f"tokens per turn ({t['tokens']} tokens in the first turn)",
        ),
    ]
    out += _table(
        ["model", "strategy", "mode", "between turns", "peak in turn", "token match"],
        [
            [
                r["model"],
                r["strategy"],
                r["mode"] or "-",
                fmt_bytes(r["between_turns_peak"]),
                fmt_bytes(r["peak"]),
                number(r["token_match"]),
            ]
            for r in t["rows"]
        ],
    )
    for name, lane in (("turns20", "KV-Direct's own lane"), ("turns20_anchorkv", "AnchorKV's lowest exact lane")):
        out += ["", f"{results['claims'][name]['title']}: {lane}, per model (the verdict is the report's model's):", ""]
        out += _table(
            ["model", "r", "lane", "lane's peak", "full cache's peak", "full / lane", "verdict"],
            [
                [
                    m["model"],
                    number(m["r"]),
                    m["lane"] or "-",
                    fmt_bytes(m["lane_peak"]),
                    fmt_bytes(m["full_peak"]),
                    number(m["ratio"]),
                    m["verdict"],
                ]
                for m in sec[name]["by_model"]
            ],
        )
    a = t.get("answers")
    if a:
        at = "/".join(map(str, a["at"]))
        how = (
            f"turn 1 holds {'/'.join(map(str, a['contexts']))} tokens with a needle for each of turns {at} (they "
            "ask about them; the turns between chat)"
            if a.get("asked")
            else f"turn 1 holds {'/'.join(map(str, a['contexts']))} tokens with a needle per turn, every turn asks "
            "about one of them"
        )
        out += [
            "",
            f"In answers: {a['conversations']} conversation{'s' if a['conversations'] != 1 else ''} of "
            f"{a['turns']} turns on {a['model']} (`bench tasks --multiturn`: {how}), budget "
            f"{'/'.join(map(str, a['budgets']))}; the mean score at turns {at}, found in the context (an answer "
            "copied from the lane's own earlier replies scores 0; the full cache's first: the reference) and the "
            "answers equal to the full cache's in every turn:",
            "",
        ]
        out += _table(
            [
                "strategy",
                "kind",
                *[f"turn {n}" for n in a["at"]],
                "mean",
                "raw",
                "copied answers",
                "answers = full",
                "held after",
            ],
            [
                [
                    r["strategy"],
                    r["kind"],
                    *[number(x) for x in r["scores"]],
                    number(r["mean"]),
                    "/".join(number(x) for x in r.get("raw_scores", r["scores"])),
                    r.get("copies", 0),
                    f"{r['equal_full']} of {r['answers']}",
                    fmt_bytes(r["held_bytes"]),
                ]
                for r in a["lanes"]
            ],
        )
    if t["equal_memory"]:
        target = t.get("equal_memory_target") or {}
        aim = (
            f"{target['spec'] or 'the target'}'s measured peak in the same conversation, {fmt_bytes(target['peak'])}"
            if target.get("peak") is not None
            else "a target not recorded"
        )
        out += ["", f"At equal measured peak: each baseline at the budget whose measured peak is closest to {aim}:", ""]
        out += _table(
            ["strategy", "budget", "peak", "token match"],
            [[r["strategy"], r["budget"], fmt_bytes(r["peak"]), number(r["token_match"])] for r in t["equal_memory"]],
        )
    out += ["", *title("agreement", " (recall scenario)")]
    out += _table(
        ["strategy", "mode", "budget", "token match", "teacher-forced agreement"],
        [
            [r["strategy"], r["mode"] or "-", r["budget"], number(r["token_match"]), number(r["teacher_forced"])]
            for r in sec["agreement"]["rows"]
        ],
    )
    out += ["", "![agreement](agreement.png)", "", *title("recompute")]
    out += _table(
        ["batch", "context", "read ms", "recompute ms", "speed-up", "bound"],
        [
            [
                r["batch"],
                r["context"],
                number(r["read_ms"]),
                number(r["recompute_ms"]),
                number(r["speedup"]),
                number(r["bound_speedup"]),
            ]
            for r in sec["recompute"]["rows"]
            if not r.get("skipped")
        ],
    )
    p = sec["replay"]
    out += [
        "",
        "![recompute](recompute.png)",
        "",
        *title("replay"),
        f"Cascade {number(p['cascade_s'])} s in {p['cascade_passes']} layer passes, naive {number(p['naive_s'])} s "
        f"in {p['naive_passes']}: {number(p['speedup'])}x (pass ratio {number(p['ideal'])}x); per pass "
        f"{number(p['cascade_ms_per_pass'])} ms against {number(p['naive_ms_per_pass'])} ms; bit-equal to the full "
        f"cache: {p['bit_equal']} of 2 replays.",
    ]
    k = sec["parked"]
    out += [
        "",
        *title("parked", f" at {k['context']} tokens"),
        f"Break-even spacing s* = {k['s_star']} (from the config); {results['claims']['parked']['basis']}.",
        "",
    ]
    out += _table(
        ["strategy", "parked per session", "vs full", "measured at", "measured", "formula there", "resume ms"],
        [
            [
                r["strategy"],
                fmt_bytes(r["parked_bytes"]),
                number(r["capacity_vs_full"]),
                r["measured_at"],
                fmt_bytes(r["parked_bytes_measured"]),
                fmt_bytes(r["formula_at_measure"]),
                number(r["resume_ms"]),
            ]
            for r in k["rows"]
        ],
    )
    out += ["", *title("exactness")]
    accelerator = results["claims"]["exactness_accelerator"]
    out += [
        f"{accelerator['title']}: {accelerator['verdict']} ({accelerator['measured_on']}).",
        "",
    ]
    cols = [
        "model",
        "dtype",
        "strategy",
        "busy processes",
        "token match",
        "K/V bit-equal",
        "rebuilt token-layers",
        "max abs dK",
    ]
    groups = [
        ("Exact mode, counted (rebuilt at least one token-layer):", lambda r: r["mode"] == "exact" and r["rebuilt"]),
        ("Fast mode (one GEMM), not counted:", lambda r: r["mode"] == "fast" and r["rebuilt"]),
        (
            "Nothing to rebuild (0 token-layers), not counted:",
            lambda r: r["mode"] in ("exact", "fast") and not r["rebuilt"],
        ),
        ("Mode not recorded, not counted:", lambda r: r["mode"] not in ("exact", "fast")),
    ]
    for label, keep in groups:
        rows = [r for r in sec["exactness"]["rows"] if keep(r)]
        if rows:
            out += (
                [label, ""]
                + _table(
                    cols,
                    [
                        [
                            r["model"],
                            r["dtype"],
                            r["strategy"],
                            r["load"],
                            number(r["token_match"]),
                            r["kv_exact"],
                            r["rebuilt"],
                            number(r["max_abs_dk"]),
                        ]
                        for r in rows
                    ],
                )
                + [""]
            )
    g = sec["patching"]
    out += [
        "",
        *title("patching"),
        "Every position: the donor's residual stream entering the layer, at every "
        "position, in the recipient's forward. Control: at the last position only.",
        "",
    ]
    out += _table(
        [
            "model",
            "dtype",
            "tokens",
            "layers",
            "layers with KL 0 and equal logits",
            "max KL",
            "max abs dlogit",
            "control: least KL over layers",
        ],
        [
            [
                r["model"],
                r["dtype"],
                r["tokens"],
                r["layers"],
                r["zero_layers"],
                number(r["max_kl"]),
                number(r["max_abs_dlogit"]),
                number(r["min_control_kl"]),
            ]
            for r in g["rows"]
        ],
    )
    out += ["", "![patching](patching.png)"]
    t = sec["tasks"]
    out += [
        "",
        *title("tasks"),
        "Each strategy's mean task score over the samples beside the full cache's (the "
        "reference); an exact lane's answers are compared with the full cache's token for token.",
        "",
    ]
    out += _table(
        ["strategy", "budget", "kind", "score", "full cache", "cells below full", "answers = full", "compression"],
        [
            [
                r["strategy"],
                r["budget"] if r["budget"] is not None else "-",
                r["kind"],
                number(r["score"]),
                number(r["full_score"]),
                f"{r['cells_below_full']}/{r['cells']}",
                f"{r['answers_equal_full']}/{r['cells']}",
                number(r["compression_ratio"]),
            ]
            for r in t["rows"]
            if r["spec"] != "full"
        ],
    )
    return out


def _resumed(results: dict) -> str:
    """What of the run was taken from an earlier one that did not end (`cells.gather`'s `kept`)."""
    kept = [c for c in results["cells"] if isinstance(c.get("resumed"), dict)]
    if not kept:
        return f" at commit {results['commit']}" if results.get("commit") else ""
    when = sorted({f"{c['resumed'].get('commit') or 'no commit recorded'}" for c in kept})
    return (
        f" at commit {results.get('commit') or 'not recorded'}, with {len(kept)} of its cells resumed from a "
        f"run that did not end (commit {', '.join(when)}; their time is not in this figure: "
        f"{', '.join(c.get('name', c['section']) for c in kept)})"
    )


def render(results: dict) -> str:
    """report.md, from results.json alone (its claims and sections as `sections.assess` made them)."""
    head = [
        f"# Claims, measured: {results['model']}",
        "",
        f"Driver: {results.get('device_name', 'not recorded')} ({results.get('device', 'not recorded')}); date "
        f"{results.get('date', 'not recorded')}; {'quick' if results['quick'] else 'full'} run"
        + (f" of {number(results['seconds'])} s" if results.get("seconds") else "")
        + _resumed(results)
        + ", executor "
        f"{results.get('executor', 'not recorded')}, {len(results['cells'])} cells (where each ran: "
        "under each section). Every number below is a value of `results.json`.",
        "",
    ]
    return "\n".join(head + _head(results) + [""] + _details(results)).rstrip() + "\n"


def figures(results: dict) -> dict:
    """The report's plots: token match against budget (the recall sweep), recompute vs read, residual patching."""
    from . import patching  # lazy: it imports torch; the UI loads this module (and never plots) without it

    rows = results["sections"]["agreement"]["rows"]
    fig = go.Figure()
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name]
        fig.add_trace(
            go.Scatter(
                x=[r["budget"] for r in mine], y=[r["token_match"] for r in mine], name=name, mode="lines+markers"
            )
        )
    fig.update_layout(
        title=f"Token match against budget, recall scenario ({results['model']})",
        xaxis=dict(title="budget (tokens of K/V kept)", type="log"),
        yaxis=dict(title="token match", range=[0, 1.05]),
        font=dict(size=16),
        template="plotly_white",
    )
    cell = next(c for c in results["cells"] if c["section"] == "recompute")
    return {
        "agreement": fig,
        "recompute": recompute_report.figure(cell["json"]),
        "patching": patching.figure(results["sections"]["patching"]["runs"], results["model"]),
    }


def write(results: dict, out: Path) -> list[Path]:
    """results.json, report.md and the plots (HTML that opens with no network: plotly.min.js beside it; PNG)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(render(results))
    paths = [out / "results.json", out / "report.md"]
    for name, fig in figures(results).items():
        fig.write_html(out / f"{name}.html", include_plotlyjs="directory")
        write_png(fig, out / f"{name}.png", width=1100, height=600)
        paths += [out / f"{name}.html", out / f"{name}.png"]
    return paths + [out / "plotly.min.js"]
