"""Run independent cells (model x strategy x setting) on a bounded process pool here, or as Ray tasks.

    results = run_cells(fn, cells, executor="local", workers=None, resources=None, say=None, keep=None)

`fn(cell)` runs once per cell; the results come back in the cells' order.
With `say`, a line per finished cell as it finishes, on either executor
(`Ticker`): the cell, how many are done of how many, the time so far and
an estimate of the time left (the time so far per finished cell, times the
cells left).  With `keep`, `keep(index, result)` here as each cell finishes,
before any later cell's error is raised: a caller that writes each result
down loses none of the finished cells to a failing one (`bench reproduce`
resumes from them).
A cell is a JSON-serialisable dict (it crosses a process boundary);
`fn` is a module-level function, importable by name in a child process
(a lambda, a closure or a function of `__main__` is refused).

* `local`: a `ProcessPoolExecutor` with the "spawn" context (torch does not
  like fork after its threads have started), `workers` processes at most
  (default: `max(1, os.cpu_count() // threads_per_cell)`, never more than
  the cells).  Each child pins torch's intra-op threads to the cell's CPU
  count before running it.
* `ray`: each cell is a Ray task (carrying the text of any strategy file it
  names: `strategies.external.carry`) with `num_cpus`/`num_gpus` from
  `resources(cell)` (default: the cell's `threads`, or 1 CPU, and a GPU
  fraction when the cell's `device` is cuda).  With `RAY_ADDRESS` set, the
  run connects to that cluster (whose workers must be able to import this
  package); otherwise a local Ray is started for the run and shut down
  after.  A Ray this process already initialised is used as it is.  Ray is
  optional (`pip install -r requirements-ray.txt`); asking for it without it
  installed is an error, never a quiet fall back to `local`.

An exception inside a cell is raised again here as `CellError`, naming the
cell (a `CellUserError`, one line for the CLI, when the cell's own error was
a user error).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

import torch

from ..plain.errors import UserError
from ..strategies import external

EXECUTORS = ("local", "ray")
GPU_FRACTION = 0.25  # the default share of a GPU one cell asks Ray for; pass `resources` to change it
RAY_MISSING = "executor: ray is not installed; install it: pip install -r requirements-ray.txt"


class ExecutorError(UserError):
    """An executor that cannot be used (unknown name, Ray missing, bad worker count); one line."""


class CellError(RuntimeError):
    """A cell's function raised; the message names the cell, `cell`/`index` hold it, `__cause__` the error."""

    def __init__(self, message: str, cell: dict | None = None, index: int | None = None):
        super().__init__(message)
        self.cell, self.index = cell, index

    def __reduce__(self):
        return type(self), (str(self), self.cell, self.index)


class CellUserError(CellError, UserError):
    """A cell raised a user error (a setting, a model): still one line naming the cell."""


def check_executor(executor: str) -> str:
    """The executor name if it is known (and Ray importable for `ray`); ExecutorError otherwise."""
    if executor not in EXECUTORS:
        raise ExecutorError(f"executor: unknown executor {str(executor)[:40]!r}; allowed: {', '.join(EXECUTORS)}")
    if executor == "ray":
        _import_ray()
    return executor


def default_resources(cell: dict) -> dict:
    """What one cell asks for: its `threads` CPUs (1 if it does not say), a GPU fraction on cuda."""
    cpus = cell.get("threads") or 1
    device = str(cell.get("device") or "")
    return {"num_cpus": cpus, "num_gpus": GPU_FRACTION if device.startswith("cuda") else 0}


def cell_name(cell: dict, index: int, total: int) -> str:
    """`cell 2 of 4 (name)`: the cell's `name` if it has one, else the cell itself, shortened."""
    name = cell.get("name") if isinstance(cell, dict) else None
    if not name:
        try:
            name = json.dumps(cell, sort_keys=True)
        except (TypeError, ValueError):
            name = repr(cell)
        name = name if len(name) <= 160 else name[:157] + "..."
    return f"cell {index + 1} of {total} ({name})"


def run_cells(
    fn: Callable[[dict], object],
    cells: list[dict],
    executor: str = "local",
    workers: int | None = None,
    resources: Callable[[dict], dict] | None = None,
    say: Callable[[str], None] | None = None,
    keep: Callable[[int, object], None] | None = None,
) -> list:
    """`[fn(cell) for cell in cells]`, each call in its own worker process (see the module's docstring)."""
    check_executor(executor)
    _check_fn(fn)
    cells = list(cells)
    for i, cell in enumerate(cells):
        try:
            json.dumps(cell)
        except (TypeError, ValueError) as e:
            raise TypeError(f"run_cells: cell {i + 1} is not JSON-serialisable: {e}") from None
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ExecutorError(f"workers: {workers!r} is not allowed; allowed: a whole number >= 1")
    if not cells:
        return []
    wants = [_resources(resources or default_resources, cell) for cell in cells]
    ticker = Ticker(cells, say, keep)
    if executor == "local":
        return _run_local(fn, cells, wants, workers, ticker)
    return _run_ray(fn, cells, wants, ticker)


def clock(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


class Ticker:
    """Says a line per finished cell (`done(index)`), in the order they finish: `cell 3 of 36 (name) done: 5 of
    36 in 1 min 02 s, about 6 min 30 s left`.  The estimate is the time so far per finished cell times the cells
    left, so a pool of N workers is counted at its own pace.  Without `say`, it says nothing.  `keep(index,
    result)` first, where given."""

    def __init__(
        self, cells: list, say: Callable[[str], None] | None, keep: Callable[[int, object], None] | None = None
    ):
        self.cells, self.say, self.keep, self.finished, self.t0 = cells, say, keep, 0, time.perf_counter()

    def done(self, index: int, result=None):
        if self.keep is not None:
            self.keep(index, result)
        self.finished += 1
        if self.say is None:
            return
        total, seconds = len(self.cells), time.perf_counter() - self.t0
        left = seconds / self.finished * (total - self.finished)
        self.say(
            f"{cell_name(self.cells[index], index, total)} done: {self.finished} of {total} in "
            f"{clock(seconds)}, " + (f"about {clock(left)} left" if left else "all done")
        )


# --- in a worker ------------------------------------------------------------------------------------------------
def _call(fn, cell: dict, threads: int):
    """Run one cell in a worker: the strategy files it carries made known, torch's threads pinned to the cell's CPU
    count first."""
    cell = external.provided(cell)
    if threads >= 1 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(cell)


# --- local: a bounded process pool ------------------------------------------------------------------------------
def _die_with(parent: int) -> None:
    """A worker's initializer: ended by the kernel when the process that started it ends (Linux's parent-death
    signal), so that a run stopped with a signal leaves no worker computing a cell for nobody; where there is no
    such signal the pool's own shutdown is all there is."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent ended before the signal was asked for
            os._exit(1)


def _run_local(fn, cells: list[dict], wants: list[dict], workers: int | None, ticker: Ticker) -> list:
    threads = [max(1, int(round(w["num_cpus"]))) for w in wants]
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) // max(threads))
    workers = min(workers, len(cells))
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_die_with,
        initargs=(os.getpid(),),
    )
    results: list = [None] * len(cells)
    index, failed = {}, None
    try:
        index = {pool.submit(_call, fn, cell, n): i for i, (cell, n) in enumerate(zip(cells, threads))}
        pending = set(index)
        while pending and failed is None:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(finished, key=index.get):  # the earlier cell first where several end at once
                error = _take(future, index[future], cells, results, ticker)
                failed = failed or error  # the first cell's error where several fail at once
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if failed is not None:  # the cells that ran on beside the failing one finished during the shutdown: kept too
        for future in sorted(pending, key=index.get):
            if future.done() and not future.cancelled():
                _take(future, index[future], cells, results, ticker)
        raise failed
    return results


def _take(future, i: int, cells: list[dict], results: list, ticker: Ticker) -> CellError | None:
    """A finished future's result into `results[i]` (and `ticker.done`), or its error as a CellError."""
    try:
        results[i] = future.result()
    except Exception as e:
        died = "a worker process died (killed, out of memory?) while it or a cell beside it ran"
        error = _cell_error(cells, i, e, died if isinstance(e, BrokenProcessPool) else None)
        error.__cause__ = e
        return error
    ticker.done(i, results[i])
    return None


# --- ray: one task per cell -------------------------------------------------------------------------------------
def _import_ray():
    try:
        import ray  # lazy: optional (requirements-ray.txt), needed by --executor ray alone
    except ImportError:
        raise ExecutorError(RAY_MISSING) from None
    return ray


def _local_cpus() -> int:
    """CPUs given to a local Ray started for the run."""
    return os.cpu_count() or 1


def _run_ray(fn, cells: list[dict], wants: list[dict], ticker: Ticker) -> list:
    ray = _import_ray()
    started, address = False, os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            # A local Ray cannot grow: a cell asking for more than it has would wait forever.
            _fits(wants, {"CPU": _local_cpus()}, ("num_cpus", "CPU"))
            ray.init(num_cpus=_local_cpus(), include_dashboard=False, log_to_driver=False)
        started = True
    try:
        if started and not address:
            _fits(wants, ray.cluster_resources(), ("num_gpus", "GPU"))
        task = ray.remote(_call)
        cells = [external.carry(cell) for cell in cells]  # a strategy file a cell names travels with it
        refs = [
            task.options(num_cpus=w["num_cpus"], num_gpus=w["num_gpus"]).remote(
                fn, cell, max(1, int(round(w["num_cpus"])))
            )
            for cell, w in zip(cells, wants)
        ]
        results: list = [None] * len(cells)
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            finished, pending = ray.wait(pending, num_returns=1)
            i = index[finished[0]]
            try:
                results[i] = ray.get(finished[0])
            except Exception as e:
                for rest in pending:
                    try:
                        ray.cancel(rest, force=True)
                    except Exception:  # already finished or gone: nothing to cancel
                        pass
                cause = getattr(e, "cause", None)
                raise _cell_error(cells, i, cause if isinstance(cause, BaseException) else e) from e
            ticker.done(i, results[i])
        return results
    finally:
        if started:
            ray.shutdown()


# --- helpers ----------------------------------------------------------------------------------------------------
def _check_fn(fn):
    """`fn` must be found again by its module and name in a child process."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not callable(fn) or not module or module in ("__main__", "__mp_main__") or "<" in qualname or "." in qualname:
        raise TypeError(
            f"run_cells: {fn!r} is not a module-level function of an importable module "
            "(a worker process finds it by module and name)"
        )
    try:
        found = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise TypeError(f"run_cells: {module}.{qualname} cannot be imported by name in a worker process")


def _resources(resources: Callable[[dict], dict], cell: dict) -> dict:
    want = dict(default_resources(cell))
    want.update(resources(cell) or {})
    if not want["num_cpus"] or want["num_cpus"] <= 0 or want["num_gpus"] < 0:
        raise ExecutorError(f"resources: {want!r} for a cell; allowed: num_cpus > 0, num_gpus >= 0")
    return want


def _cell_error(cells: list[dict], index: int, error: BaseException, what: str | None = None) -> CellError:
    where = cell_name(cells[index], index, len(cells))
    detail = what or f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    cls = CellUserError if isinstance(error, UserError) and what is None else CellError
    return cls(f"{where} failed: {detail}", cells[index], index)


def _fits(wants: list[dict], have: dict, which: tuple[str, str]):
    key, what = which
    most = max(w[key] for w in wants)
    if most > have.get(what, 0):
        raise ExecutorError(
            f"resources: a cell asks for {most:g} {what}s; the local Ray has {have.get(what, 0):g} "
            "(lower --threads, or give RAY_ADDRESS)"
        )
