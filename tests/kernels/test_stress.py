"""Bit-exact under load, in any thread, at any thread count (SmolLM2-135M and a tiny model, fp32, CPU).

Busy processes (one per core) compete for the CPU while the exact
strategies generate; each SmolLM2 repetition builds the engine in one thread
and advances it in another, as the web app does, at another thread count.
Every repetition must be `kv_exact` with rebuilt K/V and the full cache's
tokens; the tiny model's run under the same load must hand attention the same
bits as its quiet run.  The busy processes stop by themselves after a bound
and are ended by the test.
"""

import os
import subprocess
import sys
import threading

from kvdirect_app.engine.runner import Engine, run_to_end
from kvdirect_app.strategies import parse_specs

from ..runs import TINY_TURNS, run_once, tiny
from .test_kernels import EXACT, _exact

# KV-Direct rebuilds every step (decode rows: one-row projections); AnchorKV with rebuild=step replays the
# layers for the old tokens in the last steps (one-query attention per row, the kernel whose rounding depends on
# the thread count); AnchorKV with rebuild=turn replays everything when the second turn starts.  Each exact
# strategy runs at every thread count; raw text keeps the prompt short, so the suite stays fast.
KVDIRECT, STEP, TURN = (
    "kvdirect:budget=8:mode=exact",
    "anchorkv:spacing=10:budget=40:rebuild=step",
    "anchorkv:spacing=6:budget=8",
)
TURNS = ["The sky is blue because", "The sunset is red because"]
BUSY_SECONDS = 900


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_exact_strategies_stay_bit_exact_under_load_in_another_thread(smollm2):
    cores = os.cpu_count() or 2
    quiet = run_once(tiny("tiny-qwen2"), EXACT, threads=2, kernels="invariant").result  # before the load starts
    spin = f"import time\nend = time.time() + {BUSY_SECONDS}\nwhile time.time() < end:\n    pass\n"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(cores)]
    try:
        # A tiny model at 2 threads: exact, and the same digests as the quiet run (a thread that lags changes
        # nothing a kernel computes).
        loaded_run = run_to_end(
            Engine(tiny("tiny-qwen2"), parse_specs(EXACT), max_new_tokens=8, threads=2), list(TINY_TURNS)
        )
        _exact(loaded_run)
        for spec in EXACT.split(","):
            assert loaded_run["strategies"][spec]["kv_digest"] == quiet["strategies"][spec]["kv_digest"], spec
        for threads in (cores, 1):
            specs = ["full", KVDIRECT, STEP, TURN]
            engine = _in_thread(
                lambda: Engine(smollm2, parse_specs(",".join(specs)), max_new_tokens=24, raw=True, threads=threads)
            )
            result = _in_thread(lambda: run_to_end(engine, TURNS))
            assert all(p.poll() is None for p in busy), "the load ended before the run did"
            ref = result["strategies"]["full"]
            assert sum(len(t) for t in ref["turn_token_ids"]) >= 48
            for spec in specs[1:]:
                r = result["strategies"][spec]
                where = f"{spec} with threads={threads}"
                assert r["token_ids"] == ref["token_ids"], where
                assert r["kv_exact"] is True and r["max_abs_dk"] == 0.0 and r["max_abs_dlogit"] == 0.0, where
                assert r["rebuilt_token_layers"] > 0, where
    finally:
        for p in busy:
            p.kill()
            p.wait()
