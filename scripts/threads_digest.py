"""`--threads 1` against `--threads 2`: every lane's `kv_digest` (the bits of every tensor its cache held at the end
of the turn: K/V, inputs, anchors) and tokens, on prompts of our own, each run a fresh `bench run` process.

    .venv/bin/python scripts/threads_digest.py [--model smollm2-135m] [--tokens 24] [--json OUT]

Prints one line per prompt: the kernels each run used and whether every lane's digest and tokens agree.
Exit status 1 if any differ.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = "full,kvdirect:budget=16,anchorkv:spacing=30:budget=16:rebuild=step,anchorkv:spacing=7:budget=8,h2o:budget=32"
PROMPTS = [
    "A lighthouse keeper writes a letter to the sea every winter. Write the first paragraph of this year's letter, "
    "mentioning the fog, the gulls and the broken lamp on the north stair.",
    "List three differences between a hash map and a balanced search tree, with one sentence each on when to "
    "prefer which, and end with a short code example in Python.",
    "My train leaves at 17:42 from platform 9 and arrives at 21:05; the connection leaves at 21:20 from the other "
    "station, a 12-minute walk away. Do I make it, and what if the first train is 8 minutes late?",
    "Translate into plain English: 'The residual stream is the sole information-carrying state; keys and values "
    "are deterministic projections of it.' Then say whether that is true of a transformer with a KV cache.",
    "Écris deux phrases sur la mémoire des caches clés-valeurs, puis résume-les en une ligne en anglais.",
]


def run(model: str, prompt: str, threads: int, tokens: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "kvdirect_app.bench",
        "run",
        "--model",
        model,
        "--prompt",
        prompt,
        "--strategies",
        SPECS,
        "--max-new-tokens",
        str(tokens),
        "--threads",
        str(threads),
        "--memory",
        "none",
        "--json",
        str(out),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate(PROMPTS):
            one, two = (run(args.model, prompt, t, args.tokens, Path(tmp) / f"{i}-{t}.json") for t in (1, 2))
            lanes = {
                spec: {
                    "digest_equal": one["strategies"][spec]["kv_digest"] == two["strategies"][spec]["kv_digest"],
                    "tokens_equal": one["strategies"][spec]["token_ids"] == two["strategies"][spec]["token_ids"],
                    "kv_exact": [one["strategies"][spec]["kv_exact"], two["strategies"][spec]["kv_exact"]],
                }
                for spec in SPECS.split(",")
            }
            same = all(v["digest_equal"] and v["tokens_equal"] for v in lanes.values())
            ok &= same
            kernels = [one["kernels"]["mode"], two["kernels"]["mode"]]
            rows.append({"prompt": prompt[:60], "kernels": kernels, "same": same, "lanes": lanes})
            print(
                f"prompt {i + 1} ({len(prompt)} chars): kernels {kernels[0]} / {kernels[1]}; "
                f"{sum(v['digest_equal'] for v in lanes.values())}/{len(lanes)} lanes' digests equal, "
                f"{sum(v['tokens_equal'] for v in lanes.values())}/{len(lanes)} tokens equal",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
