"""The two papers' claims and figures, as data (both 2026, no public code; quoted from our notes).

Each claim has one or more figures: what it measures, the paper's value (a
number or a range), the unit, the model it was measured on (where our notes
name one), the direction in which it is a claim, the value at which the
claimed effect vanishes, and the tolerance the verdict rule allows
(`verdicts.judge`).  `sections` (one module per claim) computes our figure under
the same `key`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..plain.stats import LEVEL
from .verdicts import EQUAL, EXACT_TOLERANCE, HIGHER, LOWER, SIZE_TOLERANCE

UNNAMED = "model not stated"


@dataclass(frozen=True)
class Figure:
    key: str
    label: str  # a few words for the report's table
    measures: str
    value: float | tuple[float, float]
    unit: str
    direction: str
    tolerance: float
    neutral: float | None = None
    model: str = UNNAMED


@dataclass(frozen=True)
class Claim:
    title: str
    paper: str
    quote: str
    figures: tuple[Figure, ...]
    section: str = ""  # the cells it reads (default: its own name)
    rule: str = ""  # what the figures count, where the words of the claim leave it open (shown beside the verdict)

    def as_dict(self) -> dict:
        return {
            "title": self.title,
            "paper": self.paper,
            "claim": self.quote,
            "figures": [asdict(f) for f in self.figures],
            **({"rule": self.rule} if self.rule else {}),
        }


BEYOND = "beyond the papers"


KVD, ANCHOR = "KV-Direct", "AnchorKV"
# Claim 9's external lossy methods: every eviction baseline of the catalogue but the plain window, which is ours.
EXTERNAL = ("h2o", "streaming_llm", "snapkv", "tova", "knorm", "pyramidkv")
EXACT_METHODS = ("anchorkv", "kvdirect")
CLAIMS = {
    "bytes": Claim(
        "1. Bytes per token",
        KVD,
        "5 KB/token (one residual, Gemma 3-4B, bf16) against 136 KB/token of full KV",
        (
            Figure(
                "residual",
                "residual",
                "one residual per token",
                5,
                "KiB",
                EQUAL,
                SIZE_TOLERANCE,
                model="Gemma 3-4B, bf16",
            ),
            Figure(
                "full_kv",
                "full KV",
                "every layer's K/V per token",
                136,
                "KiB",
                EQUAL,
                SIZE_TOLERANCE,
                model="Gemma 3-4B, bf16",
            ),
        ),
    ),
    # 103 MB / 42 MB: the claim as a ratio, the one form that can carry over to another model.
    "turns20": Claim(
        "2. Twenty turns",
        KVD,
        "42 MB peak over 20 turns where the full cache passes 103 MB",
        (
            Figure(
                "peak_ratio",
                "peak, full / KV-Direct",
                "the full cache's peak over the conversation / KV-Direct's "
                "own lane's (exact, every token equal), on the report's model",
                2.45,
                "x",
                HIGHER,
                SIZE_TOLERANCE,
                neutral=1.0,
            ),
        ),
    ),
    # Not a claim of either paper: the same metric on AnchorKV's lowest exact lane, in a row of its own.
    "turns20_anchorkv": Claim(
        "2b. Twenty turns, AnchorKV",
        BEYOND,
        "claim 2's 42 MB against 103 MB, measured on AnchorKV's lanes (not a claim of either paper)",
        (
            Figure(
                "peak_ratio",
                "peak, full / AnchorKV",
                "the full cache's peak over the conversation / AnchorKV's lowest "
                "exact lane's (every token equal), on the report's model",
                2.45,
                "x",
                HIGHER,
                SIZE_TOLERANCE,
                neutral=1.0,
            ),
        ),
        section="turns20",
    ),
    "agreement": Claim(
        "3. Token agreement",
        KVD,
        "100% token match where H2O, StreamingLLM, SnapKV, TOVA and a plain window fall to 5-28%",
        (
            Figure("exact", "exact strategies", "token match of the exact strategies", 1.0, "", EQUAL, EXACT_TOLERANCE),
            Figure(
                "baselines",
                "baselines",
                "token match of the eviction baselines",
                (0.05, 0.28),
                "",
                LOWER,
                SIZE_TOLERANCE,
                neutral=1.0,
            ),
        ),
    ),
    "recompute": Claim(
        "4. Recompute vs read",
        KVD,
        'recompute "up to 5x faster" than reading cached tensors',
        (
            Figure(
                "speedup",
                "speed-up",
                "best speed-up of recomputing K/V over reading them",
                5.0,
                "x",
                HIGHER,
                SIZE_TOLERANCE,
                neutral=1.0,
            ),
        ),
    ),
    "replay": Claim(
        "5. Cascade vs naive replay",
        ANCHOR,
        "cascade replay 16.3x faster than naive replay",
        (
            Figure(
                "speedup",
                "speed-up",
                "naive replay's time / cascade replay's",
                16.3,
                "x",
                HIGHER,
                SIZE_TOLERANCE,
                neutral=1.0,
            ),
            Figure(
                "exact",
                "bit-equal replays",
                "replays whose K/V are bit-equal to the full cache (fraction)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
        ),
    ),
    "parked": Claim(
        "6. Reactivatable sessions",
        ANCHOR,
        "5.78-54.0x more reactivatable sessions at 32k context, by spacing",
        (
            Figure(
                "capacity",
                "sessions vs full",
                "parked sessions per memory against the full cache's, by spacing",
                (5.78, 54.0),
                "x",
                HIGHER,
                SIZE_TOLERANCE,
                neutral=1.0,
            ),
        ),
    ),
    "exactness": Claim(
        "7. Exactness",
        f"{KVD}, {ANCHOR}",
        "bit-identical K/V and token-identical greedy output, fp32 and bf16 (AnchorKV: on CPU and accelerators)",
        (
            Figure(
                "kv",
                "K/V bit-equal",
                "exact-mode runs on a CPU that rebuilt K/V, bit-equal to the full cache (fraction)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
            Figure(
                "tokens",
                "tokens equal",
                "exact-mode runs on a CPU that rebuilt K/V, every greedy token equal (fraction)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
        ),
    ),
    # The accelerator half of claim 7 in a row of its own: not measured until a run on one is in the cells.
    "exactness_accelerator": Claim(
        "7b. Exactness on accelerators",
        ANCHOR,
        "bit-identical K/V and token-identical greedy output on accelerators",
        (
            Figure(
                "kv",
                "K/V bit-equal",
                "exact-mode runs on an accelerator that rebuilt K/V, bit-equal to the full cache (fraction)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
            Figure(
                "tokens",
                "tokens equal",
                "exact-mode runs on an accelerator that rebuilt K/V, every greedy token equal (fraction)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
        ),
        section="exactness",
    ),
    "patching": Claim(
        "8. Residual patching",
        KVD,
        "cross-task residual patching at every layer produces D_KL = 0 "
        "between patched and original output distributions",
        (
            Figure(
                "kl",
                "KL",
                "the largest KL(donor || patched) in float64, over every layer, position and model, with "
                "the donor's residual stream patched in at every position",
                0.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
            Figure(
                "dlogit",
                "max |dlogit|",
                "the largest |logit difference| over the same",
                0.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
        ),
    ),
    "tasks": Claim(
        "9. Task scores",
        ANCHOR,
        "compared with seven external cache methods on a common model, AnchorKV "
        "preserves full-cache retrieval and question-answering scores, whereas "
        "lossy methods change output fidelity and task scores",
        (
            Figure(
                "anchorkv",
                "AnchorKV = full",
                "samples whose AnchorKV answer and task score equal the full cache's (fraction)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
            Figure(
                "kvdirect",
                "KV-Direct = full",
                "samples whose KV-Direct answer and task score equal the full cache's (fraction)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
            Figure(
                "lossy",
                "lossy changed",
                f"of the {len(EXTERNAL)} external lossy methods, the share that changes "
                "task scores (fraction; measured only when all of them ran, on enough samples to reach the test's "
                "level)",
                1.0,
                "",
                EQUAL,
                EXACT_TOLERANCE,
            ),
        ),
        rule=(
            f"A lossy method changes task scores when a one-sided exact sign test on its per-sample scores "
            f"against the full cache's (ties left out) says it scores lower, at p < {LEVEL:g}; a sample count that "
            f"cannot reach that level (every sample lower would give p = 0.5 ** n) is not enough samples, and the "
            f"lossy part is then not measured. The external methods are the {len(EXTERNAL)} this studio has: H2O, "
            "StreamingLLM, SnapKV, "
            "TOVA, KNorm and PyramidKV (the paper's seventh is not named in our notes; the plain window is our "
            "own baseline, shown but not counted); the claim is measured only when all of them ran. Each exact "
            "method is judged on its own: it keeps the full cache's answer and score in every sample."
        ),
    ),
}
NAMES = list(CLAIMS)
SECTIONS = list(dict.fromkeys(claim.section or name for name, claim in CLAIMS.items()))  # the cells' sections
TITLES = {name: claim.title for name, claim in CLAIMS.items()}


def section_of(name: str) -> str:
    return CLAIMS[name].section or name
