"""The seven panes against one full cache, in one process, alternately: what the strategies and the instruments cost.

    .venv/bin/python scripts/instruments_timing.py [--tokens 64] [--repeats 2] [--json OUT]

Each repeat runs, one after another on SmolLM2 (fp32, torch's threads), the same held-out prompt:
`full --kernels native --memory none` (the baseline), then the seven panes with AnchorKV `rebuild=step` and the
default instruments, the live defaults (`rebuild=turn`), the seven with `--memory trace`, and the seven with
every instrument off.  Prints each one's engine time and its ratio to the baseline of the same repeat, and per
decode step: wall, the instruments' share (each instrument apart), the engine's own work and the rest no clock
covered.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdirect_app.engine import Engine, run_to_end  # noqa: E402
from kvdirect_app.models import load_model  # noqa: E402
from kvdirect_app.strategies import parse_specs  # noqa: E402

SEVEN = (
    "full,kvdirect:budget=64,anchorkv:anchors=0:budget=64:rebuild=step,h2o:budget=64,streaming_llm:budget=64,"
    "snapkv:budget=64,tova:budget=64"
)
LIVE = SEVEN.replace("rebuild=step", "rebuild=turn")
PROMPT = "Tell me a short story about a lighthouse keeper who finds a message in a bottle, and what happens next."
RUNS = (
    ("seven, rebuild=step", SEVEN, {}),
    ("live defaults, rebuild=turn", LIVE, {}),
    ("seven, --memory trace", SEVEN, {"memory": "trace"}),
    ("seven, instruments off", SEVEN, {"instruments": False}),
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    loaded = load_model("smollm2-135m")

    def run(specs: str, **options) -> tuple[float, dict]:
        engine = Engine(loaded, parse_specs(specs), max_new_tokens=args.tokens, **options)
        t0 = time.perf_counter()
        result = run_to_end(engine, [PROMPT])
        return time.perf_counter() - t0, result

    run("full", memory="none", kernels="native")  # warm
    rows = []
    for repeat in range(args.repeats):
        base, _ = run("full", memory="none", kernels="native")
        print(f"repeat {repeat + 1}: full --kernels native --memory none {base:.1f} s", flush=True)
        for name, specs, options in RUNS:
            seconds, result = run(specs, **options)
            steps = result["steps"]
            share = steps["measurement_ms_mean"] / steps["wall_ms_mean"]
            by = ", ".join(
                f"{k} {v:.1f}"
                for k, v in sorted(steps["measurement_by_instrument_ms_mean"].items(), key=lambda kv: -kv[1])
            )
            print(
                f"  {name}: {seconds:.1f} s = {seconds / base:.2f}x; per step {steps['wall_ms_mean']:.0f} ms: "
                f"lanes {steps['lanes_ms_mean']:.0f}, measurement {steps['measurement_ms_mean']:.0f} "
                f"({100 * share:.1f} %: {by or 'none'}), engine {steps['engine_ms_mean']:.1f}, unattributed "
                f"{steps['unattributed_ms_mean']:.1f}",
                flush=True,
            )
            rows.append(
                {
                    "repeat": repeat,
                    "run": name,
                    "seconds": seconds,
                    "baseline_seconds": base,
                    "ratio": seconds / base,
                    "steps": {k: v for k, v in steps.items() if k != "measurement_ms_per_step"},
                    "attention_ms": {
                        label: r["latency_ms"]["decode_attention_ms_mean"] for label, r in result["strategies"].items()
                    },
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
