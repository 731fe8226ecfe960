"""Peak resident memory of the same run with the invariant and the native kernels, each in a fresh process.

    .venv/bin/python scripts/rss_kernels.py [--model smollm2-135m] [--json OUT]

Runs `bench run --strategies full --max-new-tokens 8` once per kernel mode in a child process and reads the
child's peak RSS from the operating system (`getrusage` of the finished child): what the kernels cost in memory
beside the model (the invariant kernels read the model's own weights; a packed copy would show here).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss(model: str, kernels: str) -> int:
    """Bytes: the peak RSS of one `bench run` child with these kernels (`wait4`: that child's own usage)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvdirect_app.bench",
            "run",
            "--model",
            model,
            "--strategies",
            "full",
            "--max-new-tokens",
            "8",
            "--kernels",
            kernels,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"bench run --kernels {kernels} failed ({child.returncode})")
    return usage.ru_maxrss * 1024  # KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json")
    args = parser.parse_args()
    out = {"model": args.model}
    for kernels in ("native", "invariant"):
        out[f"{kernels}_peak_rss_bytes"] = peak_rss(args.model, kernels)
        print(f"{kernels}: peak RSS {out[f'{kernels}_peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    out["ratio"] = out["invariant_peak_rss_bytes"] / out["native_peak_rss_bytes"]
    print(f"invariant / native: {out['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
