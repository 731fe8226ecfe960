"""The cells of `bench reproduce` run: `gather` runs every cell of the plan (`reproduce.plan`) through
`executors.run_cells`, in a bounded process pool or on Ray, and puts them into one dict (results.json) with what
follows from them (`reproduce.reassess`); `run_cell` is what each worker runs, one benchmark or microbenchmark per
cell, and each cell records the environment it ran in, in the process that ran it.

Each cell is written to DIR/finished-cells (`KEPT`) as it finishes; a run with the same --out that finds a planned
cell there (the same cell, key for key) takes it as it is, marked `resumed`, so a failing cell or a stopped process
costs only the cells not yet finished; `forget` deletes the folder once results.json holds them all.

Apart from `reproduce` (which the UI loads to read a report back, without torch), this module imports torch and the
benchmarks."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..benchmarks import api as benchmarks
from ..benchmarks.executors import run_cells
from ..engine import validate
from ..models.loading import load_model
from ..plain.recording import commit
from ..plain.schema import stamp
from . import patching, realsize, recompute
from .reproduce import knobs, plan, reassess


# --- each cell, in the worker that runs it --------------------------------------------------------------------------
def environment(device: str | None, threads: int | None = None) -> dict:
    """Where a cell ran, read in the process that ran it (a pool worker, a Ray worker), not in the driver."""
    env = {
        "device": device or "none (arithmetic on a config)",
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__.split("+")[0],
    }
    if device:  # the benchmark's own pinned count where it reports one, else what the worker runs with
        env["threads"] = torch.get_num_threads() if threads is None else threads
    if device and device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def bench_cell(cell: dict) -> dict:
    """One benchmark, called as a library function in this process (`benchmarks`): the cell's `kind` names the
    call, its `config` the settings; its results and environment.  Busy processes for `load`."""
    configs = {
        "run": benchmarks.RunConfig,
        "sweep": benchmarks.SweepConfig,
        "breakeven": benchmarks.BreakevenConfig,
        "replay": benchmarks.ReplayConfig,
        "capacity": benchmarks.CapacityConfig,
        "tasks": benchmarks.TasksConfig,
    }
    quiet = dict(say=lambda line: None)
    calls = {
        "run": lambda c: benchmarks.run(c, **quiet).data,
        "sweep": lambda c: benchmarks.sweep(c, **quiet),
        "breakeven": benchmarks.breakeven,
        "replay": benchmarks.replay,
        "capacity": lambda c: benchmarks.capacity(c, **quiet),
        "tasks": lambda c: benchmarks.tasks(c, **quiet),
    }
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cell.get("load", 0))]
    try:
        t0 = time.perf_counter()
        result = calls[cell["kind"]](configs[cell["kind"]](**cell["config"]))
        result.pop("plotted", None)
        seconds = time.perf_counter() - t0
        return {"json": result, "seconds": seconds, "env": environment(result.get("device"), result.get("threads"))}
    finally:
        for p in busy:
            p.kill()
            p.wait()


def recompute_cell(cell: dict) -> dict:
    loaded = load_model(cell["model"], dtype=cell["dtype"], device=cell["device"])
    result = recompute.measure(
        loaded,
        batch_sizes=tuple(cell["batches"]),
        contexts=tuple(cell["contexts"]),
        repeats=cell["repeats"],
        threads=cell.get("threads"),
    )
    result["kernels"] = "the model's own (the microbenchmark's GEMMs and copies)"
    return {"json": result, "env": environment(result["device"], result["threads"])}


def patching_cell(cell: dict) -> dict:
    loaded = load_model(cell["model"], dtype=cell["dtype"], device=cell["device"])
    result = patching.measure(loaded, threads=cell.get("threads"))
    return {"json": result, "env": environment(result["device"], result["threads"])}


def realsize_cell(cell: dict) -> dict:
    """The public configs built with random weights at their real size, one after another in this worker (one
    4B model in memory at a time): K/V, tokens and allocator bytes of every exact lane."""
    runs = [
        realsize.measure(
            name,
            dtype,
            prompt_tokens=cell["prompt_tokens"],
            new_tokens=cell["new_tokens"],
            threads=cell.get("threads"),
            device=cell["device"],
        )
        for name, dtype in cell["configs"]
    ]
    return {
        "json": {
            "runs": runs,
            "label": realsize.LABEL,
            "kernels": {"mode": ", ".join(sorted({r["kernels_mode"] for r in runs}))},
        },
        "env": environment(runs[0]["device"], runs[0]["threads"]),
    }


def run_cell(cell: dict) -> dict:
    """What the executor runs: the cell's kind picks the function."""
    kinds = {"recompute": recompute_cell, "patching": patching_cell, "realsize": realsize_cell}
    return kinds.get(cell["kind"], bench_cell)(cell)


# --- the run -------------------------------------------------------------------------------------------------------
KEPT = "finished-cells"  # DIR/finished-cells: each cell as it finishes, until results.json is written


def gather(
    model: str,
    quick: bool,
    executor: str,
    device: str = "auto",
    workers: int | None = None,
    threads: int = 1,
    say=None,
    kept: Path | None = None,
) -> dict:
    """Run every cell; the cells, the run's facts and what follows from them, as one JSON-ready dict.  `say`: a
    line per finished cell (`executors.Ticker`).  `kept`: a folder where each cell is written as it finishes,
    and from which a cell of this plan finished by an earlier run that did not end (a failing cell, a stopped
    process) is taken instead of being run again, marked `resumed` with the commit and time it ran at."""
    cells = plan(model, quick, device, validate.threads(threads))
    resumed = _resumed(kept, cells) if kept is not None else {}
    if resumed and say:
        say(
            f"resuming: {len(resumed)} of {len(cells)} cells kept in {kept} by a run that did not end are taken "
            "as they are (delete that folder to run them again)"
        )
    todo = [i for i in range(len(cells)) if i not in resumed]
    version = commit()

    def keep(j: int, out: dict):
        if kept is not None:
            _keep(kept, cells[todo[j]], out, version)

    t0 = time.perf_counter()
    outputs = run_cells(run_cell, [cells[i] for i in todo], executor=executor, workers=workers, say=say, keep=keep)
    outputs = {**resumed, **dict(zip(todo, outputs))}
    results = {
        "model": model,
        "quick": quick,
        "executor": executor,
        "device": device,
        "device_name": (
            torch.cuda.get_device_name()
            if torch.cuda.is_available() and device != "cpu"
            else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        ),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": time.perf_counter() - t0,
        "commit": version,
        "resumed_cells": len(resumed),
        "plan": {"knobs": asdict(knobs(model, quick)), "full": asdict(knobs(model, False))},
        "cells": [{**cell, **outputs[i]} for i, cell in enumerate(cells)],
    }
    return stamp("reproduce", reassess(results))


def _keep(folder: Path, cell: dict, out: dict, version: str | None):
    """One finished cell written to `folder` (whole or not at all: a stopped process leaves no half file)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"cell": cell, "out": out, "commit": version, "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    name = hashlib.sha256(json.dumps(cell, sort_keys=True).encode()).hexdigest()[:16]
    part = folder / f"{name}.part"
    part.write_text(text)
    part.replace(folder / f"{name}.json")


def _resumed(folder: Path, cells: list[dict]) -> dict[int, dict]:
    """{index: output} of the planned cells that `folder` holds a finished copy of: the same cell, key for key
    (a cell planned differently, by other knobs or code, is run again); each output marked `resumed`."""
    kept = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            kept.append(json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # not one of ours, or unreadable: its cell is run again
    found = {}
    for i, cell in enumerate(cells):
        same = json.loads(json.dumps(cell))
        for k in kept:
            if isinstance(k, dict) and k.get("cell") == same and isinstance(k.get("out"), dict):
                found[i] = {**k["out"], "resumed": {"commit": k.get("commit"), "finished": k.get("finished")}}
                break
    return found


def forget(folder: Path):
    """Delete the cells `gather` kept in `folder` (once results.json holds them), and the folder if then empty."""
    for path in [*folder.glob("*.json"), *folder.glob("*.part")] if folder.is_dir() else []:
        path.unlink()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
