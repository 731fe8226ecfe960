"""Our baselines against NVIDIA kvpress's presses, from a recording of kvpress (`scripts/kvpress_record.py`, run in
kvpress's own environment; the studio never imports kvpress).

The recording holds, for three contexts and each press at each compression ratio, the context and question ids
kvpress's pipeline read, the positions each layer and KV head kept (one bit per context token), and the greedy
answer.  `compare` runs each of ours as `bench tasks`' lanes at a ratio run it: the spec with kvpress's settings
(`strategies.kvpress_spec`) at budget ``max(1, int(context x (1 - ratio)))``, through
`strategy_cache(..., question_after=True)` (the context compressed alone, the question and the answer read with
nothing evicted), on the same ids, and says per run how many layers keep kvpress's positions in every KV head,
the mean Jaccard overlap over layers and heads, and whether the answers are the same text.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.integration import strategy_cache
from ..models.loading import LoadedModel
from ..strategies import kvpress_spec
from .task_suite.grid import ratio_budget


@dataclass
class Run:
    """One press at one ratio on one context, ours beside kvpress's."""

    press: str
    ratio: float
    topic: str
    spec: str  # what ran here
    layers: int
    layers_equal: int  # layers where every KV head kept kvpress's positions
    jaccard: float  # mean over layers and heads
    answer: str
    kvpress_answer: str
    differing: list[int]  # the layers that differ
    kept: list[list[set[int]]]  # ours, per layer and KV head
    theirs: list[list[set[int]]]  # kvpress's

    @property
    def same_answer(self) -> bool:
        return self.answer == self.kvpress_answer


def bits(text: str, tokens: int) -> set[int]:
    raw = base64.b64decode(text)
    return {i for i in range(tokens) if raw[i // 8] >> (i % 8) & 1}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def kept(cache, tokens: int) -> list[list[set[int]]]:
    """Per layer and KV head, the context positions the cache holds (a layer that keeps one selection for all
    heads gives it to each)."""
    out = []
    for layer in cache.layers:
        heads = layer.keys.shape[1]
        positions = getattr(layer, "positions", None)
        if positions is None:  # a layer that keeps everything
            out.append([set(range(tokens))] * heads)
            continue
        rows = [set(p for p in row.tolist() if p < tokens) for row in positions[0]]
        out.append(rows * heads if len(rows) == 1 else rows)
    return out


def ours(loaded: LoadedModel, spec: str, context: list[int], question: list[int], max_new_tokens: int):
    """The kept context positions and the greedy answer of `spec` in kvpress's setting."""
    with strategy_cache(loaded.model, spec, question_after=True) as cache:
        with torch.no_grad():
            loaded.model(torch.tensor([context]), cache=cache)
        held = kept(cache, len(context))
        ids = torch.tensor([context + question])
        out = loaded.model.generate(ids, cache=cache, max_new_tokens=max_new_tokens, do_sample=False)
    return held, loaded.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def compare(loaded: LoadedModel, recording: dict, presses: list[str] | None = None, ratios: list[float] | None = None):
    """Every run of the recording (or those of `presses` at `ratios`), ours beside kvpress's."""
    out = []
    for prompt in recording["prompts"]:
        context, question = prompt["context_ids"], prompt["question_ids"]
        for key, theirs in prompt["runs"].items():
            press, _, ratio = key.partition(":")
            ratio = float(ratio)
            if (presses and press not in presses) or (ratios and ratio not in ratios):
                continue
            spec = f"{kvpress_spec(press)}:budget={ratio_budget(ratio, len(context))}"
            held, answer = ours(loaded, spec, context, question, recording["max_new_tokens"])
            pairs = [
                [(mine, bits(text, len(context))) for mine, text in zip(layer, layer_theirs)]
                for layer, layer_theirs in zip(held, theirs["kept"])
            ]
            equal = [all(a == b for a, b in layer) for layer in pairs]
            jaccard = [len(a & b) / len(a | b) for layer in pairs for a, b in layer]
            out.append(
                Run(
                    press,
                    ratio,
                    prompt["topic"],
                    spec,
                    len(pairs),
                    sum(equal),
                    sum(jaccard) / len(jaccard),
                    answer,
                    theirs["answer"],
                    [i for i, e in enumerate(equal) if not e],
                    held,
                    [[b for _, b in layer] for layer in pairs],
                )
            )
    return out
