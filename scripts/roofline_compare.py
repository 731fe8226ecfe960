"""`bench roofline` of two source trees on one machine, alternated: the figures of a change, before and after.

    .venv/bin/python scripts/roofline_compare.py --before DIR [--rounds 2] [--dtype float32] [--json OUT]

DIR is another checkout of the studio (e.g. `git worktree add DIR <commit>`); both run with this checkout's
virtualenv, one after the other, `--rounds` times (so a machine that drifts drifts for both).  Each round runs
`bench roofline` in DIR twice (its default panes, then the same with AnchorKV `rebuild=step`: an older tree has
no `--step-strategies`) and once here (all three runs in one).  The JSON keeps every round's figures under the
names this checkout's `bench roofline` uses (`runs.plain`, `runs.panes`, `runs.panes_step`, `ratios`), with each
tree's commit.  Run it on a quiet machine.
"""

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvdirect_app.cli.roofline import PANES, STEP_PANES  # noqa: E402

RUN_KEYS = {"plain full": "plain", "plain": "plain", "panes": "panes", "panes_step": "panes_step"}


def roofline(tree: Path, *extra: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "roof.json"
        done = subprocess.run(
            [sys.executable, "-m", "kvdirect_app.bench", "roofline", *extra, "--json", str(out)],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if done.returncode != 0:
            raise SystemExit(f"bench roofline in {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
        print(done.stdout, flush=True)
        return json.loads(out.read_text())


def commit(tree: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()


def before(tree: Path, dtype: str) -> dict:
    """The older tree's two runs, under this checkout's names."""
    panes = roofline(tree, "--dtype", dtype)
    step = roofline(tree, "--dtype", dtype, "--strategies", STEP_PANES, "--rows", "7")
    runs = {RUN_KEYS[name]: run for name, run in panes["runs"].items()}
    runs["panes_step"] = step["runs"]["panes"]
    plain = runs["plain"]["seconds"]
    return {
        "commit": commit(tree),
        "machine": panes["machine"],
        "rows": panes["rows"],
        "runs": runs,
        "ratios": {"panes": runs["panes"]["seconds"] / plain, "panes_step": runs["panes_step"]["seconds"] / plain},
        "kernels": panes.get("kernels", {"linears": "probed GEMM"}),
    }


def after(dtype: str) -> dict:
    report = roofline(ROOT, "--dtype", dtype)
    return {
        "commit": commit(ROOT),
        "machine": report["machine"],
        "rows": report["rows"],
        "runs": report["runs"],
        "ratios": report["ratios"],
        "kernels": report["kernels"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json")
    args = parser.parse_args()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    rounds = [{"before": before(args.before, args.dtype), "after": after(args.dtype)} for _ in range(args.rounds)]
    for i, r in enumerate(rounds):
        print(
            f"round {i + 1}: panes / plain full {r['before']['ratios']['panes']:.2f}x -> "
            f"{r['after']['ratios']['panes']:.2f}x; with rebuild=step {r['before']['ratios']['panes_step']:.2f}x -> "
            f"{r['after']['ratios']['panes_step']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu, "dtype": args.dtype, "panes": PANES, "rounds": rounds}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
