"""What adding a pane after some turns costs: the next Send (the new pane's replay of the earlier turns, then the
turn for every pane) against the same turn with no pane added, on SmolLM2 with the page's default panes, one of
them added late; rounds alternate so load drifts hit both alike.

    python scripts/join_timing.py [--turns 3] [--tokens 64] [--add snapkv] [--rounds 2]

Prints per round: the plain turn's seconds, the replay's and the joined turn's, and their ratio to the plain turn;
then the bound a replay has here: its steps (one row each) at this run's one-row step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvdirect_app  # noqa: E402,F401  (thread settings before torch)
from kvdirect_app.engine.runner import Engine  # noqa: E402
from kvdirect_app.models import load_model  # noqa: E402
from kvdirect_app.strategies import parse_specs  # noqa: E402

# The page's defaults: KV-Direct and AnchorKV (deepest spacing) rebuilt once per turn (docs/app.md, Chat).
PANES = (
    "kvdirect:budget=64:rebuild=turn",
    "anchorkv:spacing=30:budget=64:rebuild=turn",
    "h2o:budget=64",
    "streaming_llm:budget=64",
)
MORE = {"snapkv": "snapkv:budget=64", "tova": "tova:budget=64"}
MESSAGES = (
    "Plan a three-day trip to Oslo in spring.",
    "Which museums should I see on the first day?",
    "Where can I eat well near the harbour?",
    "And what should I pack?",
)


def run(loaded, specs: list[str], earlier: int, tokens: int, add: str | None) -> dict:
    engine = Engine(loaded, parse_specs(",".join(specs)), max_new_tokens=tokens)
    for text in MESSAGES[:earlier]:
        for _ in engine.turn(text):
            pass
    out = {}
    t0 = time.perf_counter()
    if add is not None:
        engine.join(parse_specs(add))
        steps = sum(e["type"] == "catch_up_step" for e in engine.catch_up())
        out["replay_s"], out["replay_steps"] = time.perf_counter() - t0, steps
    t1 = time.perf_counter()
    for _ in engine.turn(MESSAGES[earlier]):
        pass
    out["turn_s"] = time.perf_counter() - t1
    out["total_s"] = time.perf_counter() - t0
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--turns", type=int, default=3, help="turns before the pane is added")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--add", default="snapkv", choices=sorted(MORE))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="float32", device="cpu")
    others = [MORE[name] for name in sorted(MORE) if name != args.add]
    base = ["full", *PANES, *others]
    plain_s, joined_s = [], []
    for r in range(args.rounds):
        plain = run(loaded, base + [MORE[args.add]], args.turns, args.tokens, None)
        joined = run(loaded, base, args.turns, args.tokens, MORE[args.add])
        plain_s.append(plain["turn_s"])
        joined_s.append(joined["total_s"])
        print(
            f"round {r + 1}: plain turn {plain['turn_s']:.2f} s ({len(base) + 1} panes); adding {args.add}: replay "
            f"{joined['replay_s']:.2f} s ({joined['replay_steps']} steps, "
            f"{1e3 * joined['replay_s'] / max(1, joined['replay_steps']):.1f} ms a step) + turn "
            f"{joined['turn_s']:.2f} s "
            f"= {joined['total_s']:.2f} s: {joined['total_s'] / plain['turn_s']:.2f}x the plain turn",
            flush=True,
        )
    print(
        f"median: plain {statistics.median(plain_s):.2f} s, with the pane added {statistics.median(joined_s):.2f} s: "
        f"{statistics.median(joined_s) / statistics.median(plain_s):.2f}x"
    )


if __name__ == "__main__":
    main()
