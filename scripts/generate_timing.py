"""What a strategy costs inside transformers' `generate`: ms per new token with DynamicCache and with each
strategy's cache (`strategy_cache`), SmolLM2, one prompt, greedy; rounds alternate so load drifts hit all alike.

    python scripts/generate_timing.py [--model smollm2-135m] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kvdirect_app  # noqa: E402,F401  (thread settings before torch)
from kvdirect_app import strategy_cache  # noqa: E402
from kvdirect_app.models import load_model  # noqa: E402
from kvdirect_app.models.compat import DynamicCache  # noqa: E402
from kvdirect_app.models.prompts import filler_ids  # noqa: E402

SPECS = [
    "dynamic",
    "full",
    "kvdirect:budget=64",
    "kvdirect:budget=64:rebuild=turn",
    "anchorkv:spacing=30:budget=64",
    "anchorkv:spacing=30:budget=64:rebuild=step",
    "h2o:budget=64",
    "snapkv:budget=64",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens (the long-document preset)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="float32", device="cpu")
    model = loaded.model
    ids = torch.tensor([filler_ids(loaded.tokenizer, args.context)])
    greedy = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    times: dict[str, list[float]] = {s: [] for s in SPECS}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for spec in SPECS:
            t0 = time.perf_counter()
            if spec == "dynamic":
                out = model.generate(ids, cache=DynamicCache(config=model.config), **greedy)
            else:
                with strategy_cache(model, spec) as cache:
                    out = model.generate(ids, cache=cache, **greedy)
            times[spec].append(time.perf_counter() - t0)
            tokens[spec] = out[0, ids.shape[1] :].tolist()
    base = statistics.median(times["dynamic"])
    print(
        f"{args.model}, {ids.shape[1]} prompt tokens + {args.tokens} new, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} alternating rounds (prefill included)"
    )
    print(f"  {'cache':<44} {'s':>7} {'ms/token':>9} {'x Dynamic':>9}  same tokens")
    for spec in SPECS:
        t = statistics.median(times[spec])
        print(
            f"  {spec:<44} {t:>7.2f} {1e3 * t / args.tokens:>9.1f} {t / base:>9.2f}  "
            f"{tokens[spec] == tokens['dynamic']}"
        )


if __name__ == "__main__":
    main()
