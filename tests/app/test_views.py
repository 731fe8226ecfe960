"""What the plots, replies and token map show, drawn from a Session as the app folds the engine's events (no
browser, except one check of the token map's wrapping in Chromium)."""

import math
import re
from pathlib import Path

import pytest

from kvdirect_app.app.ui.agreement_plot import agreement_figure
from kvdirect_app.app.ui.export import write_exports
from kvdirect_app.app.ui.latency_plot import latency_figure
from kvdirect_app.app.ui.memory_plot import memory_figure
from kvdirect_app.app.ui.plot_style import short_name
from kvdirect_app.app.ui.session import Session
from kvdirect_app.app.ui.settings import REFERENCE
from kvdirect_app.app.ui.views import BYTE_SOURCES, messages, own_cost, pane_header, reply_markup, token_map_html
from kvdirect_app.engine.runner import Engine
from kvdirect_app.models.loading import byte_tokenizer, load_model
from kvdirect_app.plain.palette import base_colour, colours
from kvdirect_app.plain.text import ReplyText
from kvdirect_app.strategies import parse_specs

ANCHORKV = "anchorkv:spacing=2:budget=8"
# window and streaming_llm (no sinks to speak of at this budget) hold the same bytes at every step.
SPECS = f"full,kvdirect:budget=8:mode=fast,{ANCHORKV},tova:budget=8,window:budget=8,streaming_llm:budget=8"
TURNS = ["Hello there, tell me about caches.", "And then?", "More."]
CHROMIUM = "/usr/bin/chromium"
CSS = Path(__file__).resolve().parents[2] / "assets" / "studio.css"


@pytest.fixture(scope="module")
def run():
    """A real lockstep run on the tiny model, folded into a Session as the app does.  In the second turn the full
    cache (and the strategies that agree with it) end their reply early, while the eviction baselines run on."""
    engine = Engine(load_model("tiny-llama", dtype="float32", device="cpu"), parse_specs(SPECS), max_new_tokens=40)
    session = Session()
    for event in engine.run(TURNS):
        session.apply(event)
    return engine, session


def lines(figure) -> dict:
    """label -> the trace named in the legend for it: its state (memory figure) or token match (agreement)."""
    return {
        t.legendgroup: t for t in figure.data if t.legendgroup not in (None, "styles") and t.showlegend is not False
    }


def ids(text: str) -> list[int]:
    return byte_tokenizer().encode(text, add_special_tokens=False)


def conversation(replies: dict[str, list[int]]) -> Session:
    """One turn of events as the engine yields them, each reply decoded token by token as the engine does."""
    tokenizer = byte_tokenizer()
    session = Session()
    session.apply({"type": "start", "strategies": list(replies)})
    session.apply({"type": "turn", "turn": 0, "user": "Hi.", "chunk_ids": ids("Hi.")})
    texts = {label: ReplyText(tokenizer) for label in replies}
    for index in range(max(map(len, replies.values()))):
        lanes = {
            label: {
                "token_id": reply[index],
                "text": texts[label].add(reply[index]),
                "active": index + 1 < len(reply),
                "seen": 3 + index,
                "persistent_bytes": 100,
                "peak_bytes": 100,
                "formula_bytes": 100,
                "formula_peak_bytes": 100,
                "latency_ms": {"total": 1.0},
                "rss_bytes": 2**20,
                "kl_mean": 0.0,
            }
            for label, reply in replies.items()
            if index < len(reply)
        }
        session.apply({"type": "step", "turn": 0, "index": index, "lanes": lanes})
    session.apply({"type": "turn_end", "turn": 0, "texts": {label: t.final() for label, t in texts.items()}})
    return session


# --- plots -------------------------------------------------------------------


def test_lines_that_coincide_keep_their_own_markers_and_name_each_other(run):
    _, session = run
    drawn = lines(memory_figure(session))
    window, streaming = drawn["window:budget=8"], drawn["streaming_llm:budget=8"]
    assert list(window.x) == list(streaming.x) and list(window.y) == list(streaming.y)  # the same bytes throughout
    assert len({t.marker.symbol for t in drawn.values()}) == len(drawn)
    marked = lambda trace: {i for i, size in enumerate(trace.marker.size) if size}
    assert marked(window) and marked(streaming) and not marked(window) & marked(streaming)
    assert all("streaming_llm:budget=8" in point[3] for point in window.customdata)


def test_every_strategy_is_drawn_at_the_conversation_position_of_the_step(run):
    _, session = run
    figure = memory_figure(session)
    assert "conversation position" in figure.layout.xaxis.title.text
    drawn = lines(figure)
    x_of_step = {}
    for label, trace in drawn.items():
        for row, x in zip(session.lanes[label].memory, trace.x):
            x_of_step.setdefault(row["step"], set()).add(x)
    assert all(len(xs) == 1 for xs in x_of_step.values())
    by_step = [x_of_step[step].pop() for step in sorted(x_of_step)]
    assert all(a < b for a, b in zip(by_step, by_step[1:]))
    ref = session.lanes[REFERENCE]
    ran_on = []
    for turn in range(len(TURNS)):
        ref_end = max(r["position"] for r in ref.memory if r["turn"] == turn)
        for label, trace in drawn.items():
            rows = [
                (r, x, c)
                for r, x, c in zip(session.lanes[label].memory, trace.x, trace.customdata)
                if r["turn"] == turn
            ]
            if len(session.lanes[label].replies[turn].tokens) == len(ref.replies[turn].tokens):
                assert rows[-1][1] == ref_end, (label, turn)
            elif len(session.lanes[label].replies[turn].tokens) > len(ref.replies[turn].tokens):
                ran_on.append((label, turn, ref_end))
                assert rows[-1][1] > ref_end
                assert all(("after the full cache's reply ended" in c[3]) == (x > ref_end) for _, x, c in rows)
    assert ran_on  # the run has a turn where a strategy went on past the full cache's end of reply
    ends = next(t for t in figure.data if t.name and "reply ends" in t.name)
    assert {end for _, _, end in ran_on} == {x for x in ends.x if x is not None}


def test_the_rss_line_plots_the_measured_rss_along_the_engine_clock(run):
    """The process RSS line: one point per step, at the conversation position (never zigzagging back), each the
    RSS the engine read after that step, in the unit its axis names."""
    _, session = run
    figure = memory_figure(session)
    rss = next(t for t in figure.data if t.name == "process RSS (right)")
    assert list(rss.x) == [r["position"] for r in session.rss]
    assert all(a < b for a, b in zip(rss.x, rss.x[1:]))
    unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[re.search(r"\((\w+)\)$", figure.layout.yaxis2.title.text)[1]]
    assert [round(y * unit) for y in rss.y] == [r["rss"] for r in session.rss]
    assert len(set(rss.y)) > 1 or len(rss.y) == 1


def test_kl_is_on_a_log_axis_with_exact_zeros_on_its_floor(run):
    _, session = run
    figure = agreement_figure(session)
    assert figure.layout.yaxis2.type == "log"
    kl = {t.legendgroup: t for t in figure.data if t.yaxis == "y2"}
    assert all(y > 0 for trace in kl.values() for y in trace.y)
    exact, lossy = kl[ANCHORKV], kl["window:budget=8"]
    assert set(exact.customdata) == {"0 (exact)"}
    floor = exact.y[0]
    assert set(exact.y) == {floor} and floor < min(y for y, c in zip(lossy.y, lossy.customdata) if c != "0 (exact)")
    assert math.log10(floor) > figure.layout.yaxis2.range[0]  # drawn inside the axis


def test_byte_axes_have_round_ticks_in_the_unit_of_their_title(run, tmp_path):
    _, session = run
    figure = memory_figure(session)
    for name, axis in (("y", figure.layout.yaxis), ("y2", figure.layout.yaxis2)):
        assert re.search(r"\((KiB|MiB|GiB)\)$", axis.title.text), axis.title.text
        ticks = list(axis.tickvals)
        step = ticks[1] - ticks[0]
        assert ticks[0] == 0 and ticks == pytest.approx([i * step for i in range(len(ticks))])
        assert round(step / 10 ** math.floor(math.log10(step)), 9) in (1, 2, 5)
        top = max(y for t in figure.data if (t.yaxis or "y") == name for y in t.y if y is not None)
        assert ticks[-2] <= top <= ticks[-1] == axis.range[1]
    session.workdir = str(tmp_path)
    exported = Path(write_exports(session)["plots"]).read_text()
    assert exported.count('"tickvals"') >= 2
    assert re.search(r"process RSS \((KiB|MiB|GiB)\)", exported)  # the unit follows the process's size


def test_empty_plots_show_a_hint_without_axes():
    for figure in (memory_figure(Session()), latency_figure(Session()), agreement_figure(Session())):
        assert not figure.data
        assert [a.text for a in figure.layout.annotations if "Send a message or play a scenario" in a.text]
        assert figure.layout.xaxis.visible is False and figure.layout.yaxis.visible is False


def test_a_strategy_keeps_its_colour_whatever_else_is_shown():
    exact, fast = "kvdirect:budget=8:mode=exact", "kvdirect:budget=8:mode=fast"
    assert colours([exact])[exact] == colours(["full", "h2o:budget=8", exact])[exact] == base_colour("kvdirect")
    both = colours([exact, fast])
    assert both[exact] != both[fast]
    assert colours([fast, "tova:budget=8", exact]) == {
        **both,
        "tova:budget=8": colours(["tova:budget=8"])["tova:budget=8"],
    }


# --- byte figures: each names its instrument ----------------------------------

FORMULA = {"between": 7 * 2**10, "peak": 9 * 2**10}  # what the formula says for every lane (7.0 KiB, 9.0 KiB)


def measured_where(instrument: str, measured: dict[str, bool]) -> Session:
    """One turn as the engine yields it: each lane's bytes measured by `instrument` where `measured[label]`, else
    only the formula's (the figures a lane without a measured value shows)."""
    session = Session()
    session.apply({"type": "start", "strategies": list(measured), "memory": instrument})
    session.apply({"type": "turn", "turn": 0, "user": "Hi.", "chunk_ids": ids("Hi.")})
    for index in range(2):
        lanes = {
            label: {
                "token_id": 65 + index,
                "text": "AB"[: index + 1],
                "active": index == 0,
                "seen": 3 + index,
                "persistent_bytes": 3 * 2**10 if m else None,
                "peak_bytes": 5 * 2**10 if m else None,
                "formula_bytes": FORMULA["between"],
                "formula_peak_bytes": FORMULA["peak"],
                "latency_ms": {"total": 1.0},
                "kl_mean": 0.0,
            }
            for label, m in measured.items()
        }
        session.apply({"type": "step", "turn": 0, "index": index, "lanes": lanes})
    session.apply(
        {
            "type": "turn_end",
            "turn": 0,
            "texts": {label: "AB" for label in measured},
            "bytes": {
                label: {
                    "turn": 0,
                    "peak_during_turn": 5 * 2**10 if m else None,
                    "formula_peak_during_turn": FORMULA["peak"],
                    "between_turns": 3 * 2**10 if m else None,
                    "formula_between_turns": FORMULA["between"],
                    "decode_ms_per_token": 1.0,
                }
                for label, m in measured.items()
            },
        }
    )
    return session


def board_cells(board: str) -> tuple[str, list[str], dict[str, list[str]]]:
    """The scoreboard's legend of byte marks (under the head's first cell), its two byte column heads' tooltips,
    and per strategy row its two byte cells (between turns, peak in turn)."""
    legend = re.search(r'class="kvd-note kvd-src-legend"[^>]*>([^<]*)</span>', board)
    heads = re.findall(r'<th title="([^"]*)">(?:between turns|peak in turn)</th>', board)
    rows = {}
    for label, row in re.findall(r'<tr><td title="([^"]*)">(.*?)</tr>', board):
        rows[label] = re.findall(r'<td class="kvd-num">(.*?)</td>', row)[:2]
    return legend[1] if legend else "", heads, rows


@pytest.mark.check
@pytest.mark.parametrize(
    "instrument, source, mark",
    [
        ("allocator ledger (cpu)", "allocator", "ᵃ"),
        ("allocator trace (cpu)", "allocator", "ᵃ"),
        ("tensor storages the strategies list (cpu; declared, not measured)", "declared", "ᵈ"),
    ],
    ids=["allocator", "trace", "declared"],
)
def test_every_byte_figure_names_its_instrument_on_the_scoreboard_and_in_the_panes(instrument, source, mark):
    """A lane with no measured value shows the formula's figure: it carries the formula's mark, and the board's
    head names every instrument its figures come from (a legend of the marks; each byte column's tooltip names
    its own column's), never the measured one alone over a formula figure.  The panes mark the same figures the
    same way.  (The scoreboard used to print the formula's bytes bare under a head whose tooltip named the
    allocator: HEAD's scoreboard.py fails here.)

    Mutations that fail it: `views.byte_figure` leaving the mark off a formula figure (`... if source !=
    "formula" else ""`); the scoreboard's heads naming the run's instrument whatever its figures' sources
    (`sources["between"].add("allocator")`)."""
    from kvdirect_app.app.ui.scoreboard import scoreboard_html

    marked = lambda m: f'<span class="kvd-note kvd-src">{m}</span>'  # a figure's mark, right after it
    measured, formula = "kvdirect:budget=4", "window:budget=4"
    session = measured_where(instrument, {REFERENCE: True, measured: True, formula: False})
    legend, heads, rows = board_cells(scoreboard_html(session))
    assert legend == f"bytes: {mark} {BYTE_SOURCES[source][1]} · * formula"  # both sources present, both named
    assert len(heads) == 2 and set(rows) == {REFERENCE, measured, formula}
    for head in heads:
        assert f"{mark} {instrument}" in head and "* formula" in head, head
    for label in (REFERENCE, measured):
        for cell, value in zip(rows[label], ("3.0 KiB", "5.0 KiB")):
            assert f'data-source="{source}"' in cell and instrument in cell, (label, cell)
            assert cell.endswith(f"{value}{marked(mark)}</span>"), (label, cell)
    for cell, value in zip(rows[formula], ("7.0 KiB", "9.0 KiB")):
        assert 'data-source="formula"' in cell and "by formula" in cell, cell
        assert cell.endswith(f"{value}{marked('*')}</span>"), cell
    # No formula figure shown anywhere on the board (tooltips aside) without its mark right after it.
    shown = re.sub(r'title="[^"]*"', "", scoreboard_html(session))
    for value in ("7.0 KiB", "9.0 KiB"):
        assert shown.count(value) == shown.count(f"{value}{marked('*')}") == 1, value
    # The panes: the same figures, the same marks.
    assert pane_header(session, formula).count(marked("*")) == 2
    assert pane_header(session, measured).count(marked(mark)) == 2

    # Every figure measured: the head names the instrument and no formula.
    legend, heads, _ = board_cells(scoreboard_html(measured_where(instrument, {REFERENCE: True, measured: True})))
    assert legend == f"bytes: {mark} {BYTE_SOURCES[source][1]}"
    assert all("formula" not in head and f"{mark} {instrument}" in head for head in heads), heads
    # Nothing measured (instruments off): formula figures, and the formula alone named.
    off = measured_where("none (formula only)", {REFERENCE: False, formula: False})
    legend, heads, rows = board_cells(scoreboard_html(off))
    assert legend == "bytes: * formula" and all(head.endswith("produced it: * formula") for head in heads), heads
    assert all(cell.endswith(f"{marked('*')}</span>") for cells in rows.values() for cell in cells)


# --- replies -----------------------------------------------------------------


def test_a_strategy_that_ends_its_reply_first_says_so_in_words():
    eos = byte_tokenizer().eos_token_id
    session = conversation({REFERENCE: ids("Hello world"), "window:budget=8": ids("Hello") + [eos]})
    shown = reply_markup(session, session.lanes["window:budget=8"], 0)
    assert "∅" not in shown and "⟂ end of reply" in shown and "end of sequence" in shown


def test_a_strategy_that_goes_on_where_the_full_cache_ended_says_so():
    eos = byte_tokenizer().eos_token_id
    session = conversation({REFERENCE: ids("Hi") + [eos], "window:budget=8": ids("Hi there")})
    shown = reply_markup(session, session.lanes["window:budget=8"], 0)
    assert re.search(r'<mark [^>]*title="[^"]*ended its reply here[^"]*">␣</mark>there', shown)


def test_a_character_cut_at_the_end_of_a_reply_shows_as_a_marker():
    cut = ids("naïve café")[:-1]  # the reply stops after the first of the two bytes of "é"
    session = conversation({REFERENCE: cut, "kvdirect:budget=8": cut, "window:budget=8": ids("n") + cut[-1:]})
    reply = session.lanes[REFERENCE].replies[0]
    pieces = [reply.text[slice(*reply.piece(i))] for i in range(len(reply.tokens))]
    assert pieces == ["n", "a", "ï", "ï", "v", "e", " ", "c", "a", "f", "\ufffd"]
    for label in (REFERENCE, "kvdirect:budget=8"):
        shown = messages(session, label)[1]["content"]
        assert "\ufffd" not in shown and shown.startswith("naïve caf") and "⟨partial character⟩" in shown
    diverged = reply_markup(session, session.lanes["window:budget=8"], 0)
    assert "\ufffd" not in diverged and re.search(r"<mark [^>]*>⟨partial character⟩</mark>$", diverged)


# --- token map ---------------------------------------------------------------


def test_only_anchor_layers_show_anchors(run):
    engine, _ = run
    lane = next(lane for lane in engine.lanes if lane.label == ANCHORKV)
    anchors = lane.strategy.anchor_layers(engine.geometry)
    layers = len(lane.cache.layers)
    assert 0 < len(anchors) < layers
    for layer in range(layers):
        data = engine.token_map(ANCHORKV, layer)
        shown = token_map_html(data, ANCHORKV, layer)
        assert ("anchor kept" in shown) == (layer in anchors), layer
        assert ("replayed from an anchor" in shown) == (layer not in anchors), layer
        assert data["states"].count("kv") == 8  # the hot window, at every layer


def test_the_token_map_breaks_between_tokens():
    shown = token_map_html({"tokens": ["ab", "cd\n", "ef"], "states": ["kv", "evicted", "kv"]}, "window", 0)
    chips = re.findall(r'<span class="kvd-tok kvd-(?:kv|evicted)" title="[^"]*">[^<]*</span>(<wbr>|<br>)?', shown)
    assert chips[-3:] == ["<wbr>", "<br>", "<wbr>"]


def test_the_token_map_wraps_inside_its_box():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    shown = token_map_html({"tokens": ["tok"] * 600, "states": ["kv"] * 600}, "window", 0)
    page_html = f"<style>{CSS.read_text()}</style><div style='width:600px'>{shown}</div>"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.set_content(page_html)
        widths = page.evaluate(
            "(() => { const m = document.querySelector('.kvd-map'); return [m.scrollWidth, m.clientWidth]; })()"
        )
        browser.close()
    assert widths[0] <= widths[1]


def test_the_banner_and_the_panes_say_what_each_exact_strategy_holds_on_this_model():
    """From the config alone: on Qwen2.5-0.5B (r = 3.5, every layer global) KV-Direct holds more than the full
    cache, on Gemma 3-4B (most layers sliding, residuals at the global ones only) less; AnchorKV less from its
    break-even spacing.  A pane of a run on that model says its own sentence; a run on another model says none.
    Catches: the old banner's "hold less" on every model, a sentence that ignores the sliding layers, a pane that
    tells a recording of another model what the loaded one holds."""
    from kvdirect_app.app import service
    from kvdirect_app.app.ui.geometry_panel import memory_banner, memory_words
    from kvdirect_app.app.ui.settings import RunConfig

    qwen = service.config_geometry("qwen2.5-0.5b", "float32")
    assert memory_banner("qwen", qwen).startswith("On qwen (r = 3.50) KV-Direct holds more than the full cache")
    assert f"AnchorKV holds less from spacing s = {qwen['break_even']['token_id']} on" in memory_banner("qwen", qwen)
    gemma = service.config_geometry("gemma-3-4b", "bfloat16")
    assert "KV-Direct holds less than the full cache" in memory_banner("gemma", gemma)

    session = Session(
        shown=["full", "kvdirect:budget=4", "h2o:budget=4"], memory_words=("qwen", memory_words("qwen", qwen))
    )
    session.config = RunConfig("qwen", "cpu", "float32", tuple(session.shown), 4)
    told = {
        label: re.findall(r'class="kvd-memory-told">([^<]*)<', pane_header(session, label)) for label in session.shown
    }
    assert told == {
        "full": [],
        "kvdirect:budget=4": ["holds more than the full cache on this model (r = 3.50)"],
        "h2o:budget=4": [],
    }
    session.config = RunConfig("another", "cpu", "float32", tuple(session.shown), 4)
    assert "kvd-memory-told" not in pane_header(session, "kvdirect:budget=4")


def test_the_latency_plot_draws_the_machines_roofline_against_the_shared_pass(run):
    """A live run's latency plot has a line at each pane's share of the roofline the machine allows the shared
    pass's linears (measured here by `Conversation.roofline`, over the run's rows), where the shared pass's grey
    part of every bar starts; a recording (measured on another machine) and a run with none measured have no line."""
    from kvdirect_app.benchmarks.roofline import best_ms

    engine, session = run
    assert latency_figure(session).layout.shapes == ()
    roof = best_ms(10_000_000, 2_500_000, len(engine.all_lanes), 100.0, 20.0)
    session.roofline = {**roof, "gemm_gflops": 100.0, "bandwidth_gbs": 20.0, "threads": 2}
    try:
        figure = latency_figure(session)
        (line,) = figure.layout.shapes
        assert line.x0 == line.x1 == pytest.approx(roof["best_ms"] / len(engine.all_lanes))
        assert f"roofline {roof['best_ms'] / len(engine.all_lanes):.1f} ms a pane" in figure.layout.annotations[0].text
        assert [t.name for t in figure.data if isinstance(t.x, tuple) and t.type == "bar"][0] == "shared"
        session.recording = {"source": "a recording"}
        assert latency_figure(session).layout.shapes == ()
    finally:
        session.roofline, session.recording = None, None


def test_the_latency_plot_averages_the_scoreboards_turn_and_says_so(run):
    """The reviewer's case: the Time & agreement tab's ms per pane differed from the scoreboard's (StreamingLLM 98
    against 18 ms), with no word of which turns each averaged.  Now both average the current (or last) turn's decode
    steps, a step a pane sat out counting as zero, and the axis says which (the fixture's three turns: the last).
    Each pane's own ms agree with the scoreboard's.  Mutation that fails it: every turn's rows averaged."""
    _, session = run
    figure = latency_figure(session)
    steps = session.step_means()
    turn = session.step_times[-1]["turn"]
    assert turn == 2 and f"mean of the {steps['steps']} decode steps of turn 3, as on the scoreboard" in (
        figure.layout.xaxis.title.text
    )
    (totals,) = [t for t in figure.data if t.type == "scatter" and t.text and str(t.text[0]).endswith("ms own")]
    drawn = dict(zip(totals.y, totals.x))
    for label in session.shown:
        name = short_name(session, label)
        assert drawn[name] == pytest.approx(steps["own"][label], rel=1e-12, abs=1e-12), label
        assert f"{drawn[name]:.0f}" == own_cost(session, label, None, steps)[0]  # the scoreboard's column
