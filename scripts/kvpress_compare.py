"""Our baselines beside kvpress's recording (tests/strategies/kvpress-0.5.5.json, made by scripts/kvpress_record.py):
a Markdown table per press and ratio, as docs/strategies.md shows it.

    .venv/bin/python scripts/kvpress_compare.py [--recording tests/strategies/kvpress-0.5.5.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvdirect_app.benchmarks import kvpress_parity
from kvdirect_app.models.loading import load_model

NAMES = {
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "knorm": "KNorm",
    "streaming_llm": "StreamingLLM",
    "pyramidkv": "PyramidKV",
}


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parents[1]
    args.add_argument("--recording", type=Path, default=here / "tests" / "strategies" / "kvpress-0.5.5.json")
    a = args.parse_args()
    recording = kvpress_parity.load(a.recording)
    runs = kvpress_parity.compare(load_model("smollm2-135m", dtype="float32", device="cpu"), recording)
    prompts = len(recording["prompts"])
    print(
        f"kvpress {recording['versions']['kvpress']}, {prompts} contexts of "
        f"{', '.join(str(len(p['context_ids'])) for p in recording['prompts'])} tokens"
    )
    print()
    print("| press | ratio | layers with kvpress's positions in every KV head | mean Jaccard | same answer |")
    print("|---|---|---|---|---|")
    for press in dict.fromkeys(r.press for r in runs):
        for ratio in dict.fromkeys(r.ratio for r in runs):
            mine = [r for r in runs if r.press == press and r.ratio == ratio]
            equal = " + ".join(f"{r.layers_equal}" for r in mine) + f" of {mine[0].layers} each"
            jaccard = sum(r.jaccard for r in mine) / len(mine)
            print(
                f"| {NAMES.get(press, press)} | {ratio:g} | {equal} | {jaccard:.3f} | "
                f"{sum(r.same_answer for r in mine)} of {len(mine)} |"
            )
    for r in runs:
        if r.differing or not r.same_answer:
            print(
                f"\n{r.press} {r.ratio:g} {r.topic}: layers {r.differing}; ours {r.answer!r}; "
                f"kvpress {r.kvpress_answer!r}"
            )


if __name__ == "__main__":
    main()
