"""A decode step alone and beside one busy process, for two source trees on one machine, alternated.

    .venv/bin/python scripts/busy_timing.py --before DIR [--rounds 2] [--json OUT]

Two `bench run`s per tree and setting: the seven default panes (64 new tokens of "Why is the sky blue?") and the
full cache with a 64-token window at a 1,000-token context (16 new tokens); each once with the machine to itself
and once beside one busy process (a Python loop, one core's worth).  DIR is another checkout (e.g. `git worktree
add DIR <commit>`); both run with this checkout's virtualenv, alternated within each round.  Prints each run's mean
decode step and the busy / alone ratio; `--json` keeps every figure (docs/perf.md renders them).  Run it on an
otherwise quiet machine.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvdirect_app.cli.roofline import PANES  # noqa: E402

RUNS = {
    "panes": ["--strategies", PANES, "--prompt", "Why is the sky blue?", "--max-new-tokens", "64"],
    "window_1k": ["--strategies", "full,window:budget=64", "--context", "1000", "--max-new-tokens", "16"],
}
BUSY = "while True: pass"


def step_ms(tree: Path, args: list[str], busy: bool) -> dict:
    """One `bench run` in `tree`: its mean decode step and parts (ms), beside a busy process where `busy`."""
    load = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "run.json"
            subprocess.run(
                [sys.executable, "-m", "kvdirect_app.bench", "run", *args, "--json", str(out)],
                cwd=tree,
                check=True,
                capture_output=True,
                timeout=1800,
            )
            steps = json.loads(out.read_text())["steps"]
    finally:
        if load is not None:
            load.kill()
            load.wait()
    return {k: steps[k] for k in ("wall_ms_mean", "lanes_ms_mean", "shared_ms_mean", "measurement_ms_mean")}


def commit(tree: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": ROOT}
    rounds = []
    for i in range(args.rounds):
        result: dict = {}
        for name, args_ in RUNS.items():
            for which, tree in trees.items():
                alone, busy = step_ms(tree, args_, False), step_ms(tree, args_, True)
                ratio = busy["wall_ms_mean"] / alone["wall_ms_mean"]
                result.setdefault(which, {})[name] = {"alone": alone, "busy": busy, "busy_over_alone": ratio}
                print(
                    f"round {i + 1} {which:6s} {name:10s} alone {alone['wall_ms_mean']:6.1f} ms, beside a busy "
                    f"process {busy['wall_ms_mean']:6.1f} ms: {ratio:.2f}x",
                    flush=True,
                )
        rounds.append(result)
    if args.json:
        report = {"commits": {w: commit(t) for w, t in trees.items()}, "runs": RUNS, "rounds": rounds}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
