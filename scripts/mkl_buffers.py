"""What a clean run leaves in the C allocator that no lane holds, with MKL's memory manager on and off.

    .venv/bin/python scripts/mkl_buffers.py [--json OUT]

Each setting in a fresh process (MKL reads `MKL_DISABLE_FAST_MM` when torch loads it): a two-turn run of the full
cache and two eviction baselines on tiny-llama, the engine on a thread of its own as the app runs it, and after
each turn the memory cross-check's `malloc` count (`ledger.CrossCheck`: the C allocator's bytes in use that the
ledger does not explain, counted from when the engine was built).  On a CPU where MKL keeps its calls' buffers
(an Intel Xeon), "kept" (the manager on) grows at each new prompt length; "off" is the package's setting.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, threading
from kvdirect_app.engine.runner import Engine
from kvdirect_app.models.loading import load_model
from kvdirect_app.strategies import parse_specs
engine = Engine(load_model("tiny-llama"), parse_specs("full,window:budget=4,h2o:budget=4"), max_new_tokens=6,
                threads=1, twins=False)
turns = []
def drive():
    for event in engine.run(["Tell me about caches.", "Why do keys need positions?"]):
        if event["type"] == "turn_end":
            turns.append(engine.observer._cross.parts(0)["malloc"])
worker = threading.Thread(target=drive)
worker.start()
worker.join()
print(json.dumps(turns))
"""


def run(manager: bool) -> list[int]:
    """The cross-check's unexplained C-allocator bytes after each turn, in a child with MKL's memory manager on
    (`manager`: the variable unset, and torch loaded before the package sets it) or off (the package's setting)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    code = ("import torch\n" if manager else "") + CHILD
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--json", type=Path)
    a = args.parse_args()
    cpu = next(
        (
            line.partition(":")[2].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "unknown",
    )
    out = {"cpu": cpu, "turns": 2, "kept": run(True), "off": run(False)}
    out["kept_per_turn_bytes"] = out["kept"][-1] / len(out["kept"])
    print(json.dumps(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
