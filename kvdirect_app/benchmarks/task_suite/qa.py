"""A question-answering set for the long-document preset (presets/long_document.md), scored by containment.

Each question asks for one fact that the document states exactly once, inside one paragraph (the fact's
paragraph), and that paragraph alone answers it: it holds the question's key facts too (`Question.clue`, a phrase
of that paragraph).  The reference answer (`answers[0]`) occurs once in the document, in that paragraph; the other
accepted forms ("22 metres" beside "twenty-two metres") occur nowhere else in it.
tests/benchmarks/test_tasks_generate.py checks all of this against the file.

A reply is right when it contains any accepted form as a whole word or phrase (case-insensitive; "red" is found
in "a red band", not in "entered"): RULER's string_match_part, with word boundaries, since some answers here are
short words and numbers.

How a QA sample's context is built (`single_turn.sample("qa", ...)`) is described there: the fact's paragraph is the
needle; with the "document" haystack it sits in a window of the document (the other paragraphs, in order, repeated
as needed), with the "noise" haystack in RULER's noise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ...plain.paths import data

DOCUMENT = data("presets") / "long_document.md"
# The preset's first line speaks to the model ("Please read the following report carefully..."); it is an
# instruction, not part of the report, so the haystack leaves it out.
INTRO = "Please read the following report carefully."


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]  # the reference answer first, then accepted alternative forms
    clue: str  # a phrase of the fact's paragraph that the question rests on


QUESTIONS: tuple[Question, ...] = (
    Question(
        "How many wrecks did the parish records of Ostrey list on the reefs below Maren Point between 1781 and 1809?",
        ("thirty-four", "thirty four", "34"),
        "Between 1781 and 1809",
    ),
    Question(
        "How far is Maren Point from the fishing town of Ostrey?",
        ("eleven kilometres", "11 kilometres", "eleven kilometers", "11 kilometers", "11 km"),
        "east of the fishing town of Ostrey",
    ),
    Question(
        "In which year did Edda Vallin write to the harbour commission?",
        ("1811", "eighteen eleven"),
        "she wrote to the harbour commission",
    ),
    Question(
        "What share of the cost of the tower did Edda Vallin offer to pay?",
        ("one third", "a third", "one-third", "1/3"),
        "offering to pay",
    ),
    Question(
        "In which year did the harbour commission agree to the proposal for a light?",
        ("1813", "eighteen thirteen"),
        "The commission agreed",
    ),
    Question(
        "What had Tomas Brenn built before, although he had never built a lighthouse?",
        ("bridges",),
        "never a lighthouse",
    ),
    Question(
        "How tall was Brenn's tower?",
        ("twenty-two metres", "twenty two metres", "22 metres", "twenty-two meters", "22 meters", "22 m"),
        "Brenn's tower was finished",
    ),
    Question("What colour was the single broad band painted on Brenn's tower?", ("red",), "single broad"),
    Question("How many wicks did the first lamp of the light burn?", ("nine", "9"), "ring of nine wicks"),
    Question(
        "On a clear night, from about how many nautical miles away could the first light be seen?",
        ("fourteen", "14 nautical miles"),
        "On a clear night",
    ),
    Question("Who was the first keeper of the light?", ("Aron Holt", "Aron"), "The first keeper"),
    Question(
        "What fee did the harbour commission raise per ton of cargo from every ship entering the bay?",
        ("one copper coin", "a copper coin", "copper coin"),
        "per ton of cargo",
    ),
    Question(
        "In which year was the storm in which the lamp's chimney cracked and the flame went out twice?",
        ("1843", "eighteen forty-three"),
        "chimney cracked",
    ),
    Question(
        "For how many hours did Signe Holt stand beside the lamp during the storm?",
        ("six hours", "6 hours", "six", "6"),
        "standing beside the lamp",
    ),
    Question(
        "What was the name of the schooner whose crew steered by Signe Holt's light during the storm?",
        ("Lindqvist",),
        "the schooner",
    ),
    Question("Until which year did Signe Holt remain keeper?", ("1861", "eighteen sixty-one"), "remained keeper"),
    Question(
        "In which year was the oil lamp replaced by a paraffin burner?",
        ("1869", "eighteen sixty-nine"),
        "paraffin burner",
    ),
    Question(
        "What kind of glass lens was installed together with the paraffin burner?", ("Fresnel",), "glass Fresnel lens"
    ),
    Question(
        "After the lens made the light flash, to about how far did its range increase?",
        ("twenty nautical miles", "20 nautical miles", "twenty miles", "20 miles"),
        "The range increased",
    ),
    Question(
        "In which year was the light converted to electricity?",
        ("1931", "nineteen thirty-one"),
        "converted to electricity",
    ),
    Question(
        "In which decade did the number of keepers fall from two to one?", ("1950s", "fifties"), "fell from two to one"
    ),
    Question("What was the name of the last keeper of the light?", ("Jonas Ekdal", "Ekdal"), "The last keeper"),
    Question(
        "In which year were a small solar panel and a battery added to the light?",
        ("2004", "two thousand and four"),
        "solar panel",
    ),
    Question(
        "During which months is the museum in the tower open?",
        ("May to September", "May through September", "May until September", "May-September", "May and September"),
        "The museum is open",
    ),
    Question(
        "About how many people visit the museum each year?",
        ("eight thousand", "8,000", "8000", "8 000"),
        "visit it each year",
    ),
)


@lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """The report's paragraphs (its title first), without the preset's opening instruction line."""
    text = DOCUMENT.read_text(encoding="utf-8")
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    if paras and paras[0].startswith(INTRO):
        paras = paras[1:]
    return tuple(paras)


def document() -> str:
    return "\n\n".join(paragraphs())


def sentences(paragraph: str) -> list[str]:
    """A paragraph cut into sentences (after '.', '!' or '?' and a space; the report has no abbreviations)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", paragraph.strip()) if s]


def _pattern(form: str) -> re.Pattern:
    return re.compile(r"(?<![0-9a-z])" + re.escape(form.lower()) + r"(?![0-9a-z])")


def occurrences(text: str, form: str) -> int:
    """How often `form` occurs in `text` as a whole word or phrase, ignoring case."""
    return len(_pattern(form).findall(text.lower()))


def contains(reply: str, answers: tuple[str, ...]) -> bool:
    """RULER's string_match_part with word boundaries: does the reply contain any accepted form?"""
    return any(occurrences(reply, form) for form in answers)


def fact_paragraph(q: Question) -> int:
    """The index (in `paragraphs()`) of the one paragraph holding the reference answer."""
    hits = [i for i, p in enumerate(paragraphs()) if occurrences(p, q.answers[0])]
    if len(hits) != 1:
        raise RuntimeError(
            f"the QA answer {q.answers[0]!r} is in {len(hits)} paragraphs of {DOCUMENT.name}, "
            "not exactly one; the document changed, update kvdirect_app/benchmarks/task_suite/qa.py"
        )
    return hits[0]


def question_for(seed: int) -> Question:
    """The question a QA sample asks: seeds 0, 1, 2... walk the set in order (seed modulo its size)."""
    return QUESTIONS[seed % len(QUESTIONS)]
