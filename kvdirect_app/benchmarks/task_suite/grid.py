"""The `bench tasks` grid: its settings checked and turned into a plan (`plan`: tasks, contexts, depths, seeds, and the
lanes, each strategy at each budget or compression ratio), the grids `bench tasks` runs without settings (`DEFAULT`,
`QUICK`, and with --multiturn `MULTITURN`, `MULTITURN_QUICK`), and a lane's budget at a ratio (`ratio_budget`).  A bad
setting is one line naming it and its allowed values (`TaskError`).  The cells are run in `runner`, their scores
summarised in `summary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...plain.errors import UserError
from ...strategies import StrategyError, kvpress_spec, parse_spec
from . import haystack, multi_turn

ANSWER_TOKENS = 64  # the memory guard's bound on an answer (every task's max_new_tokens is below it)
# The grids (`bench tasks` without, and with, --quick); a setting given on the command line replaces its entry, and
# --budgets alone replaces the grid's ratios.  The field's setting by default: kvpress's compression ratios, the
# question read after the context.  The default tasks: those SmolLM2-135M's full cache answers at least half the
# time (variable tracking, 0.04, and multi-query at 2k, 0.25, leave no reference to fall from), within 30 minutes
# on the local pool of 2 cores.
DEFAULT = {
    "contexts": "512,1024,2048",
    "depths": "0,50,100",
    "ratios": "0.5,0.875",
    "tasks": "niah_single_number,niah_multikey,niah_multivalue,qa",
}
QUICK = {"contexts": "512,2048", "depths": "0,50,100", "tasks": "niah_single_number,qa", "ratios": "0.875"}
# --multiturn (and with --quick): conversations, not depths.
MULTITURN = {"contexts": "1024,2048", "tasks": "niah_single_number,qa", "ratios": "0.5,0.875", "turns": 5, "samples": 3}
MULTITURN_QUICK = {"contexts": "1024", "tasks": "niah_single_number,qa", "ratios": "0.875", "turns": 3, "samples": 2}
LATER_TOKENS = 96  # the bound on a later turn's prompt (end of reply, user turn, question, answer prefix)
# --question: where the question is read.  "after": the context is compressed alone, the question (and the answer)
# read after it with nothing evicted (kvpress's pipeline: query-agnostic); "with-context": the question is the end of
# the compressed prompt, as the SnapKV paper has it (its observation window sees the question).
QUESTIONS = ("after", "with-context")
# --history (--multiturn): "keep" carries each lane's cache from turn to turn, its own earlier answers in it (a
# conversation); "drop" starts every question from the compressed context, the earlier questions and answers cut
# (kvpress's multi-question mode: each question meets the compressed context alone).
HISTORIES = ("keep", "drop")


class TaskError(UserError):
    """A task setting out of range; one line naming the setting and its allowed values."""


def _ints(setting: str, text: str, lo: int, hi: int, what: str) -> list[int]:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit() or not lo <= int(part) <= hi:
            raise TaskError(
                f"{setting}: {part!r} is not allowed; allowed: whole numbers {lo}..{hi} ({what}), comma-separated"
            )
        if int(part) in out:
            raise TaskError(f"{setting}: {part} is listed twice")
        out.append(int(part))
    return out


def _names(setting: str, text: str, allowed) -> list[str]:
    out = [t.strip() for t in str(text).split(",") if t.strip()]
    for name in out:
        if name not in allowed:
            raise TaskError(f"{setting}: {name!r} is not allowed; allowed: {', '.join(allowed)}")
    if not out or len(set(out)) != len(out):
        raise TaskError(f"{setting}: give each of {', '.join(allowed)} at most once, at least one")
    return out


@dataclass
class Plan:
    tasks: list[str]
    contexts: list[int]
    depths: list[int]
    seeds: list[int]
    budgets: list[int]
    names: list[str]
    lanes: list[tuple[str, int | None, str]]
    ratios: list[float] = field(default_factory=list)
    # (name, ratio, key, run) of a budgeted name; `run` is the name with kvpress's settings where it does not set
    # them itself (`strategies.kvpress_spec`): the field's grid runs each method as its kvpress press behaves.
    ratio_lanes: list[tuple[str, float, str, str]] = field(default_factory=list)
    turns: int | None = None  # --multiturn: turns per conversation (each cell is one conversation)
    asked: list[int] | None = None  # --asked: the turns that ask (the others chat); None: every turn
    question: str = "with-context"  # QUESTIONS
    history: str | None = None  # HISTORIES with --multiturn, else None

    def depths_for(self, task: str) -> list[int | None]:
        return [None] if task in haystack.DEPTHLESS or self.turns else self.depths

    def tokens(self, context: int) -> int:
        """A cell's longest conversation in tokens: the prompt, then every turn's question and answer."""
        return context + (self.turns or 1) * ANSWER_TOKENS + max(0, (self.turns or 1) - 1) * LATER_TOKENS


def plan(config) -> Plan:
    """The grid a `TasksConfig` asks for, every setting checked (one line each); `quick` fills the unset ones."""
    multi = config.multiturn
    q = (MULTITURN_QUICK if config.quick else MULTITURN) if multi else QUICK if config.quick else DEFAULT
    tasks = _names("tasks", config.tasks or q["tasks"], multi_turn.MULTITURN_TASKS if multi else haystack.TASKS)
    contexts = _ints("contexts", config.contexts or q["contexts"], haystack.MIN_CONTEXT, 1 << 20, "tokens of prompt")
    if multi and config.depths:
        raise TaskError(
            "depths: not a setting of --multiturn (each turn asks about its own needle, the needles "
            "spread from 0 to 100 percent of the context); allowed: leave it out"
        )
    depths = (
        []
        if multi
        else _ints("depths", config.depths or q["depths"], 0, 100, "percent of the context before the needle")
    )
    if config.turns is not None and not multi:
        raise TaskError("turns: a setting of --multiturn; allowed: leave it out, or add --multiturn")
    turns = (
        _ints(
            "turns",
            str(q["turns"] if config.turns is None else config.turns),
            2,
            multi_turn.MAX_TURNS,
            "turns per conversation",
        )[0]
        if multi
        else None
    )
    # The grids have ratios, not budgets: --budgets alone replaces them.
    ratio_text = config.ratios or (q["ratios"] if not config.budgets else None)
    ratios = _ratios(ratio_text) if ratio_text else []
    samples = config.samples if config.samples is not None else q.get("samples", 1)
    if config.asked and not multi:
        raise TaskError("asked: a setting of --multiturn; allowed: leave it out, or add --multiturn")
    asked = sorted(_ints("asked", config.asked, 1, turns, f"turns of the {turns}")) if config.asked else None
    # --ratios alone replaces the grid's budgets; with --budgets both run.
    budgets = _ints("budgets", config.budgets, 1, 1 << 20, "tokens per layer") if config.budgets else []
    if config.threads is not None and (
        isinstance(config.threads, bool) or not isinstance(config.threads, int) or config.threads < 1
    ):
        raise TaskError(
            f"threads: {config.threads!r} is not allowed; allowed: whole numbers >= 1 (torch threads per "
            "cell), or leave it out"
        )
    if samples < 1 or samples > 1000:
        raise TaskError(f"samples: {samples} is not allowed; allowed: 1..1000 per cell")
    if config.haystack not in haystack.HAYSTACKS:
        raise TaskError(f"haystack: {config.haystack!r} is not allowed; allowed: {', '.join(haystack.HAYSTACKS)}")
    names = [n.strip() for n in config.strategies.split(",") if n.strip() and n.strip() != "full"]
    if len(set(names)) != len(names):
        raise TaskError("strategies: a name is listed twice")
    try:
        for name in names:
            if any(pair.partition("=")[0] == "budget" for pair in name.split(":")[1:]):
                raise TaskError(f"strategies: {name!r} sets budget itself; --budgets sets it, remove budget=")
        lanes = lane_specs(names, budgets)
        ratio_lanes = [
            (name, r, f"{parse_spec(name).label}:ratio={r:g}", kvpress_spec(name))
            for name in names
            if "budget" in parse_spec(name).settings()
            for r in ratios
        ]
    except StrategyError as e:
        raise TaskError(str(e)) from None
    question = config.question or ("after" if ratios else "with-context")
    if question not in QUESTIONS:
        raise TaskError(f"question: {question!r} is not allowed; allowed: {', '.join(QUESTIONS)}")
    if config.history is not None and not multi:
        raise TaskError("history: a setting of --multiturn; allowed: leave it out, or add --multiturn")
    history = (config.history or "keep") if multi else None
    if history is not None and history not in HISTORIES:
        raise TaskError(f"history: {history!r} is not allowed; allowed: {', '.join(HISTORIES)}")
    if history == "drop" and question != "after":
        raise TaskError(
            "history: drop cuts each answer and starts the next question from the context compressed "
            "alone (kvpress's multi-question mode); allowed: drop with --question after, or keep"
        )
    if history == "drop" and asked:
        raise TaskError(
            "asked: the turns between the asking ones only matter where the history is kept; allowed: "
            "leave --asked out with --history drop"
        )
    seeds = [config.seed + i for i in range(samples)]
    return Plan(
        tasks, contexts, depths, seeds, budgets, names, lanes, ratios, ratio_lanes, turns, asked, question, history
    )


def _ratios(text: str) -> list[float]:
    out = []
    for part in str(text).split(","):
        try:
            r = float(part)
        except ValueError:
            r = None
        if r is None or not 0 < r < 1:
            raise TaskError(
                f"ratios: {part.strip()!r} is not allowed; allowed: compression ratios above 0 and below 1 "
                "(the share of the prompt's K/V tokens a layer drops, kvpress's convention), "
                "comma-separated"
            )
        if r in out:
            raise TaskError(f"ratios: {r:g} is listed twice")
        out.append(r)
    return out


def ratio_budget(ratio: float, compressed_tokens: int) -> int:
    """The budget of a lane at compression ratio `ratio` on `compressed_tokens` tokens (the context alone with
    --question after, as kvpress counts it; the whole prompt with the question in it): the K/V tokens kept per
    layer, max(1, int(compressed_tokens * (1 - ratio)))."""
    return max(1, int(compressed_tokens * (1 - ratio)))


def lane_specs(names: list[str], budgets: list[int]) -> list[tuple[str, int | None, str]]:
    """(strategy name, budget, spec) of every lane: each strategy at each budget (a strategy without a budget
    setting once, budget None)."""
    out = []
    for name in names:
        strategy = parse_spec(name)
        if "budget" not in strategy.settings():
            out.append((name, None, strategy.label))
            continue
        for b in budgets:
            out.append((name, b, parse_spec(f"{name}:budget={b}").label))
    return out
