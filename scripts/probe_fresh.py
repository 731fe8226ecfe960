"""The invariance probe in fresh processes: how many keep the invariant kernels, quiet and under load.

    .venv/bin/python scripts/probe_fresh.py [--runs 20] [--threads 1,2,4] [--models smollm2-135m,gemma3-270m]
                                            [--loads quiet,busy] [--json OUT]

Each run is a new Python process that loads the model (its cached copy) and probes every kernel afresh
(`KVDIRECT_PROBE_CACHE=off`: nothing read from an earlier run) at the given thread count, first on a quiet
machine, then with twice as many busy processes as cores.  Prints, per model, thread count and load, how many
of the runs kept the invariant kernels, how many proved MKL's packed GEMM (`probes.PACKED` rows) on every linear, the reasons of those that did not, and the probe's time; `--json`
writes the rows.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvdirect_app.probes import PACKED  # noqa: E402
CHILD = """
import json, sys, time
import kvdirect_app, torch
from kvdirect_app.models import load_model
from kvdirect_app.kernels import Kernels
name, threads = sys.argv[1], int(sys.argv[2])
loaded = load_model(name, dtype="float32", device="cpu", progress=lambda line: None)
torch.set_num_threads(threads)
t0 = time.perf_counter()
kernels = Kernels.for_model(loaded, "invariant", threads)
from kvdirect_app.probes import PACKED
packed = bool(kernels.linears) and all(PACKED in v.counts for v in kernels.linears.values())
print(json.dumps({"mode": kernels.mode, "reason": kernels.reason, "seconds": time.perf_counter() - t0,
                  "packed": packed}))
"""
SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"


def one(name: str, threads: int) -> dict:
    env = {**os.environ, "KVDIRECT_PROBE_CACHE": "off", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, name, str(threads)], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode != 0:
        return {"mode": "error", "reason": done.stderr.strip().splitlines()[-1][:200], "seconds": None}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--loads", default="quiet,busy", help="quiet, busy (twice as many busy processes as cores)")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for load in args.loads.split(","):
        busy = []
        if load == "busy":
            busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 * (os.cpu_count() or 1))]
        try:
            for name in args.models.split(","):
                for threads in (int(t) for t in args.threads.split(",")):
                    t0 = time.monotonic()
                    results = [one(name, threads) for _ in range(args.runs)]
                    kept = sum(r["mode"] == "invariant" for r in results)
                    packed = sum(bool(r.get("packed")) for r in results)
                    seconds = sorted(r["seconds"] for r in results if r["seconds"] is not None)
                    reasons = sorted({r["reason"] for r in results if r["mode"] != "invariant"})
                    row = {"model": name, "threads": threads, "load": load, "runs": args.runs, "invariant": kept,
                           "packed": packed,
                           "probe_seconds_median": seconds[len(seconds) // 2] if seconds else None,
                           "reasons": reasons, "wall_seconds": time.monotonic() - t0}
                    rows.append(row)
                    print(f"{name:14s} threads={threads} {load:5s}: {kept}/{args.runs} kept the invariant kernels; "
                          f"{packed}/{args.runs} proved the packed GEMM's {PACKED} rows on every linear; "
                          f"probe {row['probe_seconds_median']:.1f} s (median)"
                          + (f"; failed: {'; '.join(reasons)}" if reasons else ""), flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}, indent=1))
    return 0 if all(r["invariant"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
