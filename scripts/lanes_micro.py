"""Two pieces of a decode step of the seven default panes on SmolLM2-135M's shapes, old way against new, alternated
in one process (issue 57): every lane's attention at a layer as seven calls against one call
(`dots.attention_lanes`), and an eviction layer's kept K/V by a gather through an expanded index against one
`index_select` (`scored.take`).  The figures are per step (30 layers), the median of `--rounds` rounds.

    .venv/bin/python scripts/lanes_micro.py [--rounds 15] [--threads 2] [--json OUT]

What it leaves out is the rest of the step (the linears, the lanes' Python, the measurement): on this VM that rest
drifts by more than the two pieces together, so `bench roofline`'s step cannot show them apart.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvdirect_app.kernels import dots  # noqa: E402
from kvdirect_app.models.threads import pin  # noqa: E402
from kvdirect_app.strategies.scored import keep_top, take  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
# Keys each of the seven panes hands attention halfway through a 64-token reply to a 38-token prompt: the full cache,
# KV-Direct and AnchorKV every token, H2O, StreamingLLM and TOVA their budget of 64 plus the new token, SnapKV its 64
# growing by the reply.
KEYS = (70, 70, 70, 65, 65, 102, 65)
EVICTING = 3  # H2O, StreamingLLM and TOVA evict at every decode step; SnapKV grows while decoding


def _per_step(fn, repeats: int = 5) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    pin(args.threads, 1)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(len(KEYS), HEADS, 1, HEAD_DIM, generator=gen)
    keys = [torch.randn(KV_HEADS, t, HEAD_DIM, generator=gen) for t in KEYS]
    values = [torch.randn(KV_HEADS, t, HEAD_DIM, generator=gen) for t in KEYS]
    ends = [t + 10 for t in KEYS]
    cand = [torch.randn(1, KV_HEADS, 65, HEAD_DIM, generator=gen) for _ in range(2)]
    keep = keep_top(torch.randn(1, KV_HEADS, 65, generator=gen), 64)  # H2O's: each head its own
    index = keep.unsqueeze(-1).expand(1, KV_HEADS, -1, HEAD_DIM)

    def seven_calls():
        for _ in range(LAYERS):
            for i in range(len(KEYS)):
                dots.attention(query[i], keys[i], values[i], ends[i], 0.125)

    def one_call():
        for _ in range(LAYERS):
            dots.attention_lanes(query, keys, values, ends, 0.125)

    def gathers():
        for _ in range(LAYERS * EVICTING):
            cand[0].gather(2, index), cand[1].gather(2, index)

    def index_selects():
        for _ in range(LAYERS * EVICTING):
            take(cand[0], keep), take(cand[1], keep)

    pieces = {"attention": (seven_calls, one_call), "eviction": (gathers, index_selects)}
    times = {name: {"old": [], "new": []} for name in pieces}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (old, new) in pieces.items():
                times[name]["old"].append(_per_step(old))
                times[name]["new"].append(_per_step(new))
    result = {"threads": args.threads, "rounds": args.rounds, "layers": LAYERS, "keys": list(KEYS)}
    for name, t in times.items():
        old, new = statistics.median(t["old"]), statistics.median(t["new"])
        result[name] = {"old_ms": old, "new_ms": new, "old_over_new": old / new, "rounds": t}
        print(f"{name}: {old:.2f} -> {new:.2f} ms a step ({old / new:.2f}x), median of {args.rounds} rounds")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
