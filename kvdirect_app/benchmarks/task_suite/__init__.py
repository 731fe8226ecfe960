"""Retrieval tasks after RULER, generated offline, and their scores: single-turn samples (`single_turn`), conversations
on the same needles (`multi_turn`), what both are built from (`haystack`: the haystacks, the needles' places, the
prompt fitted to a context length), a QA set for the long document (`qa`), the tokenizer of a preset without its
model (`tokenizer`), and `bench tasks`: its grid and settings (`grid`), its cells run (`runner`) and their scores
summarised (`summary`).

The generators' names are re-exported here: ``from kvdirect_app.benchmarks import task_suite`` then
``task_suite.sample(...)``, ``task_suite.conversation(...)``."""

from .haystack import DEPTHLESS, HAYSTACKS, MAX_NEW_TOKENS, MIN_CONTEXT, TASKS, SampleError
from .multi_turn import (
    MAX_TURNS,
    MULTITURN_TASKS,
    Conversation,
    Turn,
    conversation,
    conversation_ids,
    conversation_parts,
    question_ids,
    score_from_context,
    score_turns,
    score_turns_from_context,
)
from .single_turn import Sample, prompt_ids, prompt_parts, prompt_text, sample, score

__all__ = [
    "DEPTHLESS",
    "HAYSTACKS",
    "MAX_NEW_TOKENS",
    "MIN_CONTEXT",
    "TASKS",
    "SampleError",
    "MAX_TURNS",
    "MULTITURN_TASKS",
    "Conversation",
    "Turn",
    "conversation",
    "conversation_ids",
    "conversation_parts",
    "question_ids",
    "score_from_context",
    "score_turns",
    "score_turns_from_context",
    "Sample",
    "prompt_ids",
    "prompt_parts",
    "prompt_text",
    "sample",
    "score",
]
