"""The Tasks tab: a `bench tasks --multiturn` result as the score of each turn's answers per strategy (the full
cache's line is the reference), found in the context or raw, with 95 % bootstrap intervals over the conversations;
and a single-turn `bench tasks` result as a needle heatmap per strategy (context x depth, the full cache's first)
and the task-score frontier (score against measured bytes); the shipped ones in presets/tasks/ (per model, and for
multi-turn per history: kept or dropped), or files of one's own.  Plain data in, figures out: no model, no torch."""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...plain import jsonfile, schema, stats
from ...plain.frontier import HELD, TASK_SCORE, Point, frontier_figure
from ...plain.palette import base_colour, strategy_name, symbol
from ...plain.paths import data
from ...plain.units import fmt_bytes
from .settings import REFERENCE, title

SHIPPED = data("presets") / "tasks"
ALL = "every task"
FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=14, color="#111")
COLUMNS = 5  # heatmaps per row


SINGLE, KEEP, DROP = "single", "keep", "drop"  # a result's kind: single-turn, multi-turn with the history kept/dropped
FROM_CONTEXT, RAW = "found in the context", "raw"  # the turn chart's two scores
DEFAULT_MODEL = "smollm2-135m"  # shown first where its results are shipped


def kind(result: dict) -> str:
    return (result.get("history") or KEEP) if result.get("multiturn") else SINGLE


def shipped_results() -> tuple[dict[tuple[str, str], dict], list[str]]:
    """Every shipped result in presets/tasks/, by (model, kind), and a line per file that could not be read."""
    found, problems = {}, []
    for path in sorted(SHIPPED.glob("*.json")) if SHIPPED.is_dir() else []:
        try:
            result = load(path)
        except schema.SchemaError as e:
            problems.append(str(e))
            continue
        found[(result["model"], kind(result))] = result
    return found, problems


def models(found: dict) -> list[str]:
    """The models with a shipped result, the default first."""
    names = sorted({m for m, _ in found}, key=lambda m: (m != DEFAULT_MODEL, m))
    return names


def shipped(multiturn: bool = False, model: str = DEFAULT_MODEL, history: str = KEEP) -> Path | None:
    """The shipped file of `model`: its single-turn result, or with `multiturn` its multi-turn one of `history`."""
    want = history if multiturn else SINGLE
    for path in sorted(SHIPPED.glob("*.json")) if SHIPPED.is_dir() else []:
        try:
            result = load(path)
        except schema.SchemaError:
            continue
        if result["model"] == model and kind(result) == want:
            return path
    return None


def load(path: str | Path) -> dict:
    """A tasks results file, checked to be one this build reads (one line naming what it is, else); its size is
    checked before a byte is read (`jsonfile.read`)."""
    path = Path(path)
    expected = "a bench tasks --json results file"
    try:
        document = jsonfile.parse(jsonfile.read(path, path.name, expected), path.name, expected)
    except OSError:
        raise schema.SchemaError(f"{path.name}: the file could not be read; expected {expected}") from None
    except ValueError as e:
        raise schema.SchemaError(str(e)) from None
    problem = jsonfile.not_an_object(document, path.name, expected)
    if problem:
        raise schema.SchemaError(problem)
    return schema.check(document, "tasks", path.name)


def _cells(result: dict, task: str) -> list[dict]:
    return [c for c in result["cells"] if task == ALL or c["task"] == task]


def settings(result: dict) -> list[tuple[str, int | float]]:
    """The picker's choices: each budget (tokens per layer), then each compression ratio (a float) of the run."""
    return [(f"budget {b}", b) for b in result["budgets"]] + [
        (f"ratio {r:g}", float(r)) for r in result.get("ratios", [])
    ]


def setting_words(setting: int | float | None) -> str:
    return f"ratio {setting:g}" if isinstance(setting, float) else f"budget {setting}"


def specs_at(result: dict, setting: int | float | None) -> list[str]:
    """The lanes shown at a budget (an int) or a compression ratio (a float): the full cache first, then every
    strategy at that setting (one without a budget setting always), in the run's order."""
    lanes = result["cells"][0]["lanes"] if result["cells"] else {}
    if isinstance(setting, float):
        return [REFERENCE] + [
            s
            for s, a in lanes.items()
            if s != REFERENCE and (a.get("ratio") == setting or (a["budget"] is None and not a.get("ratio")))
        ]
    return [REFERENCE] + [
        s for s, a in lanes.items() if s != REFERENCE and not a.get("ratio") and a["budget"] in (None, setting)
    ]


def _score(cells: list[dict], spec: str) -> float | None:
    values = [c["lanes"][spec]["score"] for c in cells]
    return sum(values) / len(values) if values else None


def heatmap_figure(result: dict, budget: int | None, task: str = ALL) -> go.Figure:
    """One small map per lane (contexts down, depths across), its mean score in the title beside the full cache's."""
    cells = _cells(result, task)
    specs = specs_at(result, budget)
    contexts = sorted({c["context"] for c in cells})
    depths = sorted({c["depth"] for c in cells}, key=lambda d: -1 if d is None else d)
    rows = -(-len(specs) // COLUMNS)
    full = _score(cells, REFERENCE)
    names = []
    for spec in specs:
        name, s = title(spec), _score(cells, spec)
        names.append(
            name
            if s is None
            else f"<b>{name}</b><br>{s:.2f}"
            if spec == REFERENCE
            else f"<b>{name}</b><br>{s:.2f} (full {full:.2f})"
        )
    fig = make_subplots(
        rows=rows,
        cols=COLUMNS,
        subplot_titles=names,
        horizontal_spacing=0.02,
        shared_yaxes=True,
        vertical_spacing=0.14 if rows > 1 else 0.1,
    )
    xs = ["any" if d is None else f"{d:g}%" for d in depths]
    ys = [f"{c:,}" for c in contexts]
    for i, spec in enumerate(specs):
        z, text = [], []
        for ctx in contexts:
            row, words = [], []
            for d in depths:
                v = [c["lanes"][spec]["score"] for c in cells if c["context"] == ctx and c["depth"] == d]
                row.append(sum(v) / len(v) if v else None)
                words.append("" if not v else f"{row[-1]:.2f}")
            z.append(row)
            text.append(words)
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=xs,
                y=ys,
                text=text,
                texttemplate="%{text}",
                zmin=0,
                zmax=1,
                colorscale="Cividis",
                showscale=i == 0,
                xgap=2,
                ygap=2,
                colorbar=dict(title="score", len=0.8, thickness=12),
                hovertemplate=f"{html.escape(spec)}<br>context %{{y}} tokens, depth %{{x}}"
                "<br>score %{z:.2f}<extra></extra>",
            ),
            row=i // COLUMNS + 1,
            col=i % COLUMNS + 1,
        )
    fig.update_xaxes(title_text="", tickfont=dict(size=11))
    fig.update_xaxes(title_text="needle depth", title_font=dict(size=12), row=rows)  # the bottom row names it
    fig.update_yaxes(tickfont=dict(size=11))
    fig.update_yaxes(title_text="context (tokens)", col=1)
    where = "every task" if task == ALL else task
    fig.update_layout(
        template="plotly_white",
        font=FONT,
        height=190 + 230 * rows,
        margin=dict(l=70, r=20, t=80, b=60),
        title=dict(
            text=f"Needle found, by context and depth ({where}; {setting_words(budget)}): 1 = "
            "every reference in the answer",
            x=0.01,
            font=dict(size=17),
        ),
    )
    fig.update_annotations(font_size=13)
    return fig


def turn_scores(result: dict, spec: str, task: str = ALL, key: str = "scores_from_context") -> list[float | None]:
    """A lane's mean score at each turn of the conversations (of one task, or all), found in the context (`key`
    "scores_from_context") or raw ("scores"); None at a turn that asks nothing (--asked)."""
    cells = _cells(result, task)
    scores = [[c["lanes"][spec][key][n] for c in cells] for n in range(len(cells[0]["turns"]))]
    return [None if None in v else sum(v) / len(v) for v in scores]


def turn_intervals(result: dict, spec: str, task: str = ALL, key: str = "scores_from_context"):
    """Per turn, the 95 % bootstrap interval (low, high) of the lane's mean over the conversations; None at a turn
    that asks nothing."""
    cells = _cells(result, task)
    out = []
    for n in range(len(cells[0]["turns"])):
        v = [c["lanes"][spec][key][n] for c in cells]
        out.append(None if None in v else stats.bootstrap_interval(v))
    return out


def copies_at(result: dict, spec: str, task: str = ALL) -> list[int]:
    """Per turn, the conversations whose answer copied the lane's own earlier replies."""
    cells = _cells(result, task)
    return [sum(c["lanes"][spec]["copied_turns"][n] for c in cells) for n in range(len(cells[0]["turns"]))]


def turns_figure(result: dict, setting: int | float | None, task: str = ALL, score: str = FROM_CONTEXT) -> go.Figure:
    """Score against turn, a line per strategy at the setting, each point with its 95 % bootstrap interval over the
    conversations (the strategies side by side within a turn, so that no bar hides another); the full cache's
    line is drawn first, wide and grey: the reference, which the exact strategies' lines lie on when their
    answers equal it.  `score`: found in the context (an answer that stood in the lane's own earlier replies
    scores 0) or raw; the hover counts the copies either way."""
    key = "scores" if score == RAW else "scores_from_context"
    cells = _cells(result, task)
    n = len(cells)
    turns = list(range(1, len(cells[0]["turns"]) + 1))
    specs = specs_at(result, setting)
    fig = go.Figure()  # a turn that asks nothing (--asked) is a gap in every line; connectgaps joins the asked ones
    for i, spec in enumerate(specs):
        ys = turn_scores(result, spec, task, key)
        spans = turn_intervals(result, spec, task, key)
        copies = copies_at(result, spec, task)
        name = strategy_name(spec)
        asked = [y for y in ys if y is not None]
        mean = sum(asked) / len(asked)
        shift = 0.3 * (i / max(1, len(specs) - 1) - 0.5) if len(specs) > 1 else 0.0
        xs = [t + shift for t in turns]
        bars = dict(
            type="data",
            symmetric=False,
            thickness=1.2,
            width=3,
            array=[None if y is None else sp[1] - y for y, sp in zip(ys, spans)],
            arrayminus=[None if y is None else y - sp[0] for y, sp in zip(ys, spans)],
        )
        hover = (
            f"{html.escape(spec)}<br>turn %{{customdata[0]}}: score %{{y:.2f}} (95 % interval "
            f"%{{customdata[1]:.2f}}-%{{customdata[2]:.2f}}, {n} conversation{'' if n == 1 else 's'})<br>"
            "answers copied from the lane's own earlier replies: %{customdata[3]}<extra></extra>"
        )
        data = [[t, sp[0] if sp else None, sp[1] if sp else None, c] for t, sp, c in zip(turns, spans, copies)]
        if spec == REFERENCE:
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines+markers",
                    name=f"{title(name)} (the reference) {mean:.2f}",
                    connectgaps=True,
                    error_y={**bars, "color": "rgba(60,60,60,0.6)"},
                    line=dict(color="rgba(60,60,60,0.28)", width=14),
                    marker=dict(color="rgba(60,60,60,0.5)", size=6),
                    customdata=data,
                    hovertemplate=hover,
                )
            )
            continue
        exact = cells[0]["lanes"][spec]["exact"]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines+markers",
                name=f"{title(name)} {mean:.2f}",
                connectgaps=True,
                line=dict(color=base_colour(name), width=2.5, dash="dot" if exact else "solid"),
                marker=dict(
                    symbol=symbol(name),
                    size=11 if exact else 9,
                    color=base_colour(name),
                    line=dict(color="#fff", width=1),
                ),
                error_y={**bars, "color": base_colour(name)},
                customdata=data,
                hovertemplate=hover,
            )
        )
    where = "every task" if task == ALL else task
    what = (
        "found in the context: an answer copied from the lane's own earlier replies scores 0"
        if score != RAW
        else "raw: every answer that holds the reference"
    )
    fig.update_layout(
        template="plotly_white",
        font=FONT,
        height=470,
        margin=dict(l=70, r=20, t=80, b=55),
        title=dict(
            text=f"Answers across turns ({where}; {setting_words(setting)}; "
            f"{HISTORY_WORDS[kind(result)]})<br><sup>score {what}; bars: 95 % bootstrap "
            f"interval over {n} conversation{'' if n == 1 else 's'}</sup>",
            x=0.01,
            font=dict(size=17),
        ),
        legend=dict(title=dict(text="mean over the turns"), font=dict(size=13)),
        xaxis=dict(title="turn", tickmode="array", tickvals=turns, range=[0.6, turns[-1] + 0.4]),
        yaxis=dict(title="mean score", range=[-0.04, 1.04]),
    )
    return fig


HISTORY_WORDS = {
    KEEP: "history kept: a conversation",
    DROP: "history dropped: each question from the compressed context",
    SINGLE: "one question",
}


def frontier_points(result: dict, task: str = ALL) -> tuple[list[Point], float | None]:
    """Every lane (strategy x budget) as a point: the bytes its cache holds after the answer (measured, mean over
    the samples: what its budget buys) and its mean score; the full cache's score."""
    cells = _cells(result, task)
    if not cells:
        return [], None
    points = []
    for spec in cells[0]["lanes"]:
        held = [c["lanes"][spec]["held_bytes"] for c in cells if c["lanes"][spec]["held_bytes"] is not None]
        if held:
            points.append(
                Point(
                    spec,
                    int(sum(held) / len(held)),
                    _score(cells, spec),
                    None,
                    instrument=result["memory_instrument"],
                    axis=HELD,
                )
            )
    return points, _score(cells, REFERENCE)


def frontier(result: dict, task: str = ALL) -> go.Figure:
    points, full = frontier_points(result, task)
    return frontier_figure(
        points,
        title="Task score against memory",
        axis=TASK_SCORE,
        reference=full,
        subtitle=f"{'every task' if task == ALL else task}, {result['model']}; bytes held after the "
        f"answer, mean over the samples; measured {result['measured_at']} on {result['device']}",
    )


def provenance(result: dict) -> str:
    return (
        f"measured {result['measured_at']} on {result['device']} ({result.get('processor', '?')}), "
        f"{result['threads']} thread{'' if result['threads'] == 1 else 's'}, {result['kernels']} kernels, "
        f"{result['model']}, "
        f"commit {result.get('commit') or '?'}"
    )


# The nominal ratio (kvpress's: the share of one layer's compressed tokens dropped, from the budget) and the measured
# one beside it (the share of the full cache's bytes not held, by the allocator: whole layers kept show there).
COMPRESSION_HEADS = (
    "<th title=\"kvpress's ratio: the share of one layer's compressed tokens dropped, from the "
    'budget">compression (nominal)</th><th title="1 - bytes held after the answer / the full '
    "cache's, measured by the allocator\">measured</th>"
)
QUESTION_WORDS = {
    "after": "the question read after the context was compressed alone (kvpress's setting)",
    "with-context": "the question inside the compressed prompt (the SnapKV paper's setting)",
}


def head_html(result: dict) -> str:
    """Where and when the result was measured, what it holds, where the question was read, the history, how long
    it took, and the exactness check."""
    every = "in every turn of every conversation" if result.get("multiturn") else "in every cell"
    exact = (
        f"every exact strategy's answer equals the full cache's, token for token, {every}"
        if result["exact_answers_equal_full"]
        else f"<b>{len(result['exact_mismatches'])} exact answers differ from the full cache's</b>"
    )
    n = len(result["cells"])
    asking = f" (turns {'/'.join(map(str, result['asked']))} ask; the others chat)" if result.get("asked") else ""
    what = (
        f"{n} conversation{'' if n == 1 else 's'} of {result['turns']} turns{asking}"
        if result.get("multiturn")
        else f"{n} sample{'' if n == 1 else 's'}"
    )
    history = f"; {HISTORY_WORDS[kind(result)]}" if result.get("multiturn") else ""
    return (
        f"<p class='kvd-tasks-head'>{html.escape(provenance(result))}: {what} "
        f"({', '.join(result['tasks'])}), contexts {', '.join(map(str, result['contexts']))} tokens, haystack "
        f"{html.escape(result['haystack'])}; {QUESTION_WORDS[result['question']]}{history}; "
        f"{result['seconds'] / 60:.0f} min on {result['executor']}; {exact}.</p>"
    )


def measured(cells: list[dict], spec: str) -> float | None:
    """The measured compression of lane `spec` over `cells` (`task_suite.summary.measured_compression`: 1 - its held
    bytes over the full cache's in the same cell, the mean), from each cell's bytes, so that a results file written
    before the summary carried it shows it too; None where no memory was measured."""
    values = [
        1 - c["lanes"][spec]["held_bytes"] / c["lanes"][REFERENCE]["held_bytes"]
        for c in cells
        if c["lanes"][spec].get("held_bytes") is not None and c["lanes"][REFERENCE].get("held_bytes")
    ]
    return sum(values) / len(values) if values else None


def _compression(cells: list[dict], spec: str, row: dict) -> str:
    """The nominal compression ratio, then the measured one beside it."""
    held = measured(cells, spec)
    return f"<td>{row.get('compression_ratio', 0):.2f}</td><td>{'-' if held is None else format(held, '.2f')}</td>"


def turns_table_html(result: dict, setting: int | float | None, task: str = ALL) -> str:
    """A row per lane at the setting: its mean score over the turns found in the context beside its raw score,
    the answers that copied its own earlier replies, the full cache's, and the answers equal to the full cache's."""
    cells = _cells(result, task)
    mean = lambda spec, key: sum(c["lanes"][spec][key] for c in cells) / len(cells)  # noqa: E731
    full_own, full_raw = mean(REFERENCE, "score_from_context"), mean(REFERENCE, "score")
    rows = []
    by_spec = {r["spec"]: r for r in result["rows"]}
    for spec in specs_at(result, setting):
        r = by_spec.get(spec, {})
        asked = sum(x is not None for c in cells for x in c["lanes"][spec]["scores"])
        same = sum(sum(c["lanes"][spec]["equal_full_turns"]) for c in cells)
        turns = sum(len(c["lanes"][spec]["equal_full_turns"]) for c in cells)
        rows.append(
            f"<tr><td title='ran: {html.escape(r.get('full_spec', spec), quote=True)}'>{html.escape(title(spec))}</td>"
            f"<td>{html.escape(r.get('kind', ''))}</td>"
            f"<td><b>{mean(spec, 'score_from_context'):.2f}</b></td><td>{mean(spec, 'score'):.2f}</td>"
            f"<td>{sum(c['lanes'][spec]['copies'] for c in cells)}/{asked}</td>"
            f"<td>{full_own:.2f} / {full_raw:.2f}</td><td>{same}/{turns}</td>{_compression(cells, spec, r)}"
            f"<td>{fmt_bytes(r.get('held_bytes_mean'))}</td></tr>"
        )
    return (
        "<table class='kvd-tasks-table'><tr><th>strategy</th><th>kind</th><th>found in the context</th>"
        "<th>raw</th><th>copied answers</th><th>full cache (context / raw)</th><th>= full answers</th>"
        f"{COMPRESSION_HEADS}<th>held after</th></tr>" + "".join(rows) + "</table>"
    )


def table_html(result: dict, budget: int | None, task: str = ALL) -> str:
    """A row per lane at the budget: its score beside the full cache's, its compression ratio and measured peak; the
    lane's name, hovered, shows what it ran with every setting (at a ratio, kvpress's settings)."""
    cells = _cells(result, task)
    full = _score(cells, REFERENCE)
    rows = []
    by_spec = {r["spec"]: r for r in result["rows"]}
    for spec in specs_at(result, budget):
        s, r = _score(cells, spec), by_spec.get(spec, {})
        below = sum(c["lanes"][spec]["score"] < c["lanes"][REFERENCE]["score"] for c in cells)
        same = sum(c["lanes"][spec]["equal_full"] for c in cells)
        rows.append(
            f"<tr><td title='ran: {html.escape(r.get('full_spec', spec), quote=True)}'>{html.escape(title(spec))}</td>"
            f"<td>{html.escape(r.get('kind', ''))}</td>"
            f"<td><b>{s:.2f}</b></td><td>{full:.2f}</td><td>{below}/{len(cells)}</td>"
            f"<td>{same}/{len(cells)}</td>{_compression(cells, spec, r)}"
            f"<td>{fmt_bytes(r.get('held_bytes_mean'))}</td><td>{fmt_bytes(r.get('peak_bytes_mean'))}</td></tr>"
        )
    return (
        "<table class='kvd-tasks-table'><tr><th>strategy</th><th>kind</th><th>score</th><th>full cache</th>"
        f"<th>below full</th><th>= full answer</th>{COMPRESSION_HEADS}<th>held after</th><th>peak during</th></tr>"
        + "".join(rows)
        + "</table>"
    )
