"""What one lane's cache layer costs at one decode step, timed inside a run of the seven default panes (issue 57).

Each layer class's own `update` (and a scored layer's `add` and `settle`) is wrapped by a clock for the run, so the
figures are the calls as they run between the linears, not alone: mean microseconds a call and milliseconds a step,
by class (a scored layer's by its strategy too, `ScoredLayer:h2o`), over the decode steps of one 48-token reply to
`bench roofline`'s prompt on SmolLM2-135M.

    .venv/bin/python scripts/lane_pieces.py [--threads 2] [--json OUT]

A wrapped call includes what the layer runs inside it (KV-Direct's `update` its rebuilds, a scored layer's `settle`
its scoring); the pass's per-row copy of the K/V and each lane's region are outside every figure here.
"""

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import kvdirect_app  # noqa: E402,F401  (the package's process settings before torch)
from kvdirect_app.cli.roofline import PANES, PROMPT  # noqa: E402
from kvdirect_app.engine.runner import Engine, run_to_end  # noqa: E402
from kvdirect_app.models.loading import load_model  # noqa: E402
from kvdirect_app.models.threads import pin  # noqa: E402
from kvdirect_app.strategies import parse_specs  # noqa: E402
from kvdirect_app.strategies.anchorkv import AnchoredLayer  # noqa: E402
from kvdirect_app.strategies.base import FullLayer  # noqa: E402
from kvdirect_app.strategies.kvdirect import ResidualLayer  # noqa: E402
from kvdirect_app.strategies.scored import ScoredLayer  # noqa: E402

TOKENS = 48
WRAPPED = [(FullLayer, "update"), (ResidualLayer, "update"), (AnchoredLayer, "update")]
WRAPPED += [(ScoredLayer, name) for name in ("update", "add", "settle")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    loaded = load_model("smollm2-135m")
    pin(args.threads)
    seconds, calls, on = collections.Counter(), collections.Counter(), [False]

    def wrap(cls, name):
        original = getattr(cls, name)

        def timed(self, *a, **k):
            if not on[0]:
                return original(self, *a, **k)
            start = time.perf_counter()
            try:
                return original(self, *a, **k)
            finally:
                strategy = getattr(self, "strategy", None)  # a scored layer: by strategy, which differ most
                key = (type(self).__name__ + ("" if strategy is None else f":{strategy.name}"), name)
                seconds[key] += time.perf_counter() - start
                calls[key] += 1

        setattr(cls, name, timed)

    for cls, name in WRAPPED:
        wrap(cls, name)
    run_to_end(Engine(loaded, parse_specs(PANES), max_new_tokens=4, threads=args.threads), [PROMPT])  # warm
    engine = Engine(loaded, parse_specs(PANES), max_new_tokens=TOKENS, threads=args.threads)
    first = True
    for event in engine.run([PROMPT]):  # the prompt's forwards and the first step's are not timed
        if event["type"] == "step" and first:
            on[0], first = True, False
    on[0] = False
    steps = calls["FullLayer", "update"] / len(engine.all_lanes[0].cache.layers)  # the full cache: one call a layer
    rows: dict[str, dict] = {}  # class -> method -> figures
    for cls, name in sorted(calls):
        rows.setdefault(cls, {})[name] = r = {
            "calls_a_step": calls[cls, name] / steps,
            "us_a_call": seconds[cls, name] / calls[cls, name] * 1e6,
            "ms_a_step": seconds[cls, name] / steps * 1e3,
        }
        print(
            f"{cls + '.' + name:32s} {r['calls_a_step']:6.1f} calls a step  {r['us_a_call']:7.1f} us a call  "
            f"{r['ms_a_step']:6.2f} ms a step"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"panes": PANES, "threads": args.threads, "steps": steps, "pieces": rows}, indent=1)
        )
        print("wrote", args.json)


if __name__ == "__main__":
    main()
