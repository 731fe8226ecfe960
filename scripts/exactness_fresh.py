"""Exactness in fresh processes: both exact lanes bit-equal to the full cache, run after run, quiet and under load.

    .venv/bin/python scripts/exactness_fresh.py [--runs 20] [--threads 1,2] [--loads quiet,busy]
                                                [--families all] [--dtypes float32,bfloat16] [--json OUT]

Each run is a new Python process (nothing kept from an earlier one: ``KVDIRECT_PROBE_CACHE=off``) that, at the
given thread count, loads every tiny family in every dtype and runs the full cache, KV-Direct (exact) and AnchorKV
(`rebuild=step`) over a two-turn conversation with the invariant kernels.  ``busy`` runs the same with two busy
processes beside it.  Per thread count and load it prints how many runs kept the invariant kernels on every
model, how many had both exact lanes bit-equal (tokens and every K/V handed attention) on every model, and
whether every run gave the same K/V digests, across runs and across thread counts; the exit status is 0 only
where all of them did.  `--json` writes the rows and the distinct digest sets (to compare two invocations).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-olmo2", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"]
SPECS = "full,kvdirect:budget=4:mode=exact,anchorkv:spacing=2:budget=3:rebuild=step"
CHILD = """
import json, sys
from kvdirect_app.engine import Engine, run_to_end
from kvdirect_app.models import load_model
from kvdirect_app.strategies import parse_specs
families, dtypes, threads, specs = sys.argv[1].split(","), sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
out = {}
for family in families:
    for dtype in dtypes:
        loaded = load_model(family, dtype=dtype, device="cpu")
        r = run_to_end(Engine(loaded, parse_specs(specs), max_new_tokens=8, threads=threads),
                       ["Tell me about caches.", "Why do keys need positions?"])
        ref = r["strategies"]["full"]
        lanes = [r["strategies"][s] for s in specs.split(",")[1:]]
        out[f"{family}/{dtype}"] = {
            "mode": r["kernels"]["mode"], "reason": r["kernels"]["reason"], "path": r["kernels"].get("dots_path"),
            "exact": all(s["token_ids"] == ref["token_ids"] and s["kv_exact"] is True and s["max_abs_dk"] == 0.0
                         and s["max_abs_dv"] == 0.0 for s in lanes),
            "digests": [r["strategies"][s]["kv_digest"] for s in specs.split(",")]}
print(json.dumps(out))
"""
SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"


def one(families: str, dtypes: str, threads: int) -> dict:
    env = {**os.environ, "KVDIRECT_PROBE_CACHE": "off", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, families, dtypes, str(threads), SPECS],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--loads", default="quiet,busy", help="quiet, busy (two busy processes beside each run)")
    parser.add_argument("--families", default="all")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json")
    args = parser.parse_args()
    families = ",".join(FAMILIES) if args.families == "all" else args.families
    rows, digests = [], set()
    for load in args.loads.split(","):
        busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 if load == "busy" else 0)]
        try:
            for threads in (int(t) for t in args.threads.split(",")):
                t0 = time.monotonic()
                runs = [one(families, args.dtypes, threads) for _ in range(args.runs)]
                errors = sorted({r["error"] for r in runs if "error" in r})
                done = [r for r in runs if "error" not in r]
                kept = sum(all(m["mode"] == "invariant" for m in r.values()) for r in done)
                exact = sum(all(m["exact"] for m in r.values()) for r in done)
                seen = {json.dumps({k: m["digests"] for k, m in r.items()}, sort_keys=True) for r in done}
                digests |= seen
                reasons = sorted({m["reason"] for r in done for m in r.values() if m["mode"] != "invariant"})
                paths = sorted({m["path"] for r in done for m in r.values() if m["path"]})
                row = {
                    "threads": threads,
                    "load": load,
                    "runs": args.runs,
                    "models": len(done[0]) if done else 0,
                    "invariant": kept,
                    "exact": exact,
                    "distinct_digests": len(seen),
                    "paths": paths,
                    "reasons": reasons,
                    "errors": errors,
                    "wall_seconds": round(time.monotonic() - t0, 1),
                }
                rows.append(row)
                print(
                    f"threads={threads} {load:5s}: {kept}/{args.runs} kept the invariant kernels on all "
                    f"{row['models']} models; {exact}/{args.runs} both exact lanes bit-equal on all; "
                    f"{len(seen)} distinct set(s) of digests; linears: {', '.join(paths) or '-'}"
                    + (f"; native because: {'; '.join(reasons)}" if reasons else "")
                    + (f"; errors: {'; '.join(errors)}" if errors else ""),
                    flush=True,
                )
        finally:
            for p in busy:
                p.kill()
                p.wait()
    print(f"digests across every run, thread count and load: {len(digests)} distinct set(s) (1 = the same bits)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpu_count": os.cpu_count(),
                    "rows": rows,
                    "distinct_digests": len(digests),
                    "digests": sorted(digests),
                },
                indent=1,
            )
        )
    ok = all(r["invariant"] == r["exact"] == r["runs"] and not r["errors"] for r in rows) and len(digests) == 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
