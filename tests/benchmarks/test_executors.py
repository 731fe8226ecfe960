"""The scale-out executor (`kvdirect_app.benchmarks.executors`) and `bench sweep --executor local|ray [--workers N]`.

A sweep's cells (one lockstep run per budget) give the same JSON on a
process pool here and on a local Ray as in this process, timing fields
aside; a bad executor, a missing Ray and a failing cell are each one line.
Ray is optional: its tests are skipped when it is not installed (`make test`
installs requirements-ray.txt, so CI runs them).
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from kvdirect_app import bench
from kvdirect_app.benchmarks import executors
from kvdirect_app.benchmarks.executors import CellError, CellUserError, ExecutorError, run_cells
from kvdirect_app.plain.errors import UserError

from ..runs import differences

SWEEP = [
    "sweep",
    "--model",
    "tiny-llama",
    "--prompt",
    "Hello there, how are you today?",
    "--strategies",
    "window,h2o,snapkv:window=4",
    "--budgets",
    "4,8",
    "--max-new-tokens",
    "4",
    "--threads",
    "1",
]
# Keys whose values are times or process sizes: they differ from run to run, whoever runs it.
TIMING = re.compile(r"(^|_)ms(_|$)|seconds|per_s$|rss")
ROOT = Path(__file__).resolve().parents[2]
VARIES = {"file_confirmed", "file_notes", "outside_torch", "outside_torch_between_turns", "unattributed_bytes"}
RAY_MISSING = "error: executor: ray is not installed; install it: pip install -r requirements-ray.txt\n"


def untimed(value):
    """The JSON without its timing fields (ms, tokens/s, seconds, RSS), the probe file's provenance
    (`file_confirmed`, `file_notes`: stored verdicts found again, which depends on which process probed first) and
    the bytes outside torch (Python's buffers a process's first calls cache, its unattributed blocks)."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if not TIMING.search(k) and k not in VARIES}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def sweep_json(path, *extra) -> dict:
    code = bench.main([*SWEEP, "--json", str(path), *extra])
    assert code == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """The sweep as it has always run: one budget after another in this process."""
    return sweep_json(tmp_path_factory.mktemp("sweep") / "in_process.json")


@pytest.fixture
def small_local_ray(monkeypatch):
    """A local Ray started by the run itself, on 2 CPUs (not whatever this machine has), no dashboard."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(executors, "_local_cpus", lambda: 2)
    return ray


# Cell functions: module-level, so a worker process finds them by name.
def square_or_fail(cell: dict):
    if cell.get("user_error"):
        raise UserError("model: 'nosuchmodel' is not a preset")
    if cell["x"] == 2:
        raise ValueError(f"cannot take {cell['x']}\nsecond line of the message")
    return cell["x"] ** 2


def slow_or_fail(cell: dict):
    """x == 2 fails at once; the others sleep `sleep` seconds and give x."""
    import time

    if cell["x"] == 2:
        raise ValueError("cannot take 2")
    time.sleep(cell.get("sleep", 0))
    return cell["x"]


def threads_seen(cell: dict):
    import torch

    return cell["x"], torch.get_num_threads()


def wait_for_file(cell: dict):
    """Cell "slow" ends only once the file at its `path` exists (the test writes it when the fast cell's line is
    said), so it finishes last on any executor however loaded the machine; cell "fast" ends at once.  (Waiting for a
    file the fast cell wrote itself raced: under load the slow cell's result could come back before the fast one's.)"""
    import time
    from pathlib import Path

    if cell["name"] == "slow":
        for _ in range(1200):
            if Path(cell["path"]).exists():
                break
            time.sleep(0.05)
        return "slow"
    return "fast"


# --- (a) the same rows whoever runs the cells -------------------------------------------------------------------
def test_the_in_process_sweep_has_its_rows(in_process):
    assert {(r["strategy"], r["budget"]) for r in in_process["rows"]} == {
        (s, b) for s in ("window", "h2o", "snapkv:window=4") for b in (4, 8)
    }
    assert untimed(in_process) != in_process  # there are timing fields to drop


def test_sweep_on_the_local_process_pool_gives_the_in_process_json(in_process, tmp_path, capsys):
    data = sweep_json(tmp_path / "local.json", "--executor", "local", "--workers", "2")
    err = capsys.readouterr().err
    assert "budget 4 (cell 1 of 2, local)" in err and "budget 8 (cell 2 of 2, local)" in err
    done = [line for line in err.splitlines() if " done: " in line]  # a line per finished cell, as it finishes
    assert len(done) == 2 and done[-1].endswith("all done") and " done: 1 of 2 in " in done[0], done
    assert {line.split(" done:")[0] for line in done} == {
        "cell 1 of 2 (tiny-llama budget=4)",
        "cell 2 of 2 (tiny-llama budget=8)",
    }
    assert [(r["strategy"], r["budget"]) for r in data["rows"]] == [
        (r["strategy"], r["budget"]) for r in in_process["rows"]
    ]
    assert not differences(untimed(data), untimed(in_process)), differences(untimed(data), untimed(in_process))


@pytest.mark.timeout(300)  # a Ray that never starts or never returns fails here, not after the suite's limit
def test_sweep_on_a_local_ray_gives_the_in_process_json(in_process, small_local_ray, tmp_path):
    data = sweep_json(tmp_path / "ray.json", "--executor", "ray")
    assert not small_local_ray.is_initialized()  # started for the run, shut down after it
    assert not differences(untimed(data), untimed(in_process)), differences(untimed(data), untimed(in_process))


def sleep_and_say(cell: dict):
    """A cell that writes its worker's pid, then sleeps past any test's patience."""
    import os
    import time

    Path(cell["folder"], f"{cell['x']}.pid").write_text(str(os.getpid()))
    time.sleep(300)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.timeout(120)
def test_a_run_killed_leaves_no_worker_computing_for_nobody(tmp_path):
    """`bench reproduce` (or any local pool) killed by a signal: its workers end with it, not an hour later.
    Mutation that fails it: the pool built without `_die_with` (the workers, orphaned, sleep on)."""
    import signal
    import subprocess
    import time

    script = (
        "from kvdirect_app.benchmarks.executors import run_cells; "
        "from tests.benchmarks.test_executors import sleep_and_say; "
        f"run_cells(sleep_and_say, [{{'x': x, 'folder': {str(tmp_path)!r}}} for x in range(2)], 'local', "
        "workers=2)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "the workers never started their cells"
            time.sleep(0.2)
        workers = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert all(alive(pid) for pid in workers)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in workers if alive(pid)]
        for pid in left:  # end what this test started before failing on it
            os.kill(pid, signal.SIGKILL)
        assert not left, f"workers {left} kept computing after their run was killed"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_run_cells_keeps_the_cells_order_and_pins_each_childs_threads():
    """Each child computes on its cell's threads, whatever it inherited (the suite's workers start children at one
    thread: OMP_NUM_THREADS, tests/conftest.py), so 2 shows the pin."""
    cells = [{"x": x, "threads": 2} for x in range(5)]
    assert run_cells(threads_seen, cells, "local", workers=2) == [(x, 2) for x in range(5)]
    assert run_cells(threads_seen, [], "local") == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_each_cell_is_said_as_it_finishes_with_the_time_left(executor, request, tmp_path):
    """The cell that finishes first is said first, though it comes second (the pool and Ray alike), and its line
    estimates the time left; the results still come back in the cells' order.  Mutation: the lines said after
    every result was gathered, in the cells' order."""
    if executor == "ray":
        request.getfixturevalue("small_local_ray")
    lines, said = [], tmp_path / "fast-said"

    def say(line: str):
        lines.append(line)
        if "(fast)" in line:
            said.write_text("said")

    cells = [{"name": "slow", "path": str(said)}, {"name": "fast", "path": str(said)}]
    assert run_cells(wait_for_file, cells, executor, workers=2, say=say) == ["slow", "fast"]
    assert [line.split(" in ")[0] for line in lines] == [
        "cell 2 of 2 (fast) done: 1 of 2",
        "cell 1 of 2 (slow) done: 2 of 2",
    ], lines
    assert re.fullmatch(r"cell 2 of 2 \(fast\) done: 1 of 2 in \d+ s, about \d+ s left", lines[0]), lines
    assert re.fullmatch(r"cell 1 of 2 \(slow\) done: 2 of 2 in \d+ s, all done", lines[1]), lines


def test_the_time_left_is_the_time_so_far_per_finished_cell_times_the_cells_left(monkeypatch):
    from kvdirect_app.benchmarks import executors

    now = iter([100.0, 130.0, 190.0])
    monkeypatch.setattr(executors.time, "perf_counter", lambda: next(now))
    lines = []
    ticker = executors.Ticker([{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}], lines.append)
    ticker.done(2)
    ticker.done(0)
    assert lines == [
        "cell 3 of 4 (c) done: 1 of 4 in 30 s, about 1 min 30 s left",
        "cell 1 of 4 (a) done: 2 of 4 in 1 min 30 s, about 1 min 30 s left",
    ]
    assert [executors.clock(s) for s in (0.4, 59.6, 61, 3599, 3600, 7322)] == [
        "0 s",
        "1 min 00 s",
        "1 min 01 s",
        "59 min 59 s",
        "1 h 00 min",
        "2 h 02 min",
    ]


# --- (b) bad executors: one line, status 2 ----------------------------------------------------------------------
def test_an_unknown_executor_is_one_line_naming_the_allowed_ones(capsys):
    code = bench.main([*SWEEP, "--executor", "dask"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == "error: executor: unknown executor 'dask'; allowed: local, ray\n"
    with pytest.raises(ExecutorError, match="allowed: local, ray"):
        run_cells(square_or_fail, [{"x": 1}], "threads")


def test_ray_asked_for_but_not_installed_is_one_line_never_a_local_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    code = bench.main([*SWEEP, "--executor", "ray"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == RAY_MISSING
    assert "token match" not in captured.out  # nothing ran
    with pytest.raises(ExecutorError) as info:
        run_cells(square_or_fail, [{"x": 1}], "ray")
    assert f"error: {info.value}\n" == RAY_MISSING


@pytest.mark.parametrize(
    "args, words",
    [
        (["--workers", "2"], "--workers: only with --executor local"),
        (["--executor", "local", "--workers", "0"], "--workers: 0 is not allowed; allowed: whole numbers >= 1"),
        (["--executor", "local", "--equal-memory"], "--executor: not with --equal-memory"),
    ],
)
def test_sweep_refuses_bad_executor_options_with_one_line(args, words, capsys):
    code = bench.main([*SWEEP, *args])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and err.count("\n") == 1


def test_run_cells_refuses_what_a_worker_cannot_find_or_receive():
    with pytest.raises(TypeError, match="module-level function"):
        run_cells(lambda cell: cell, [{"x": 1}], "local")
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        run_cells(square_or_fail, [{"x": object()}], "local")


# --- (c) a failing cell is named --------------------------------------------------------------------------------
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_failing_cell_is_raised_here_naming_the_cell(executor, request):
    if executor == "ray":
        ray = request.getfixturevalue("small_local_ray")
        # A Ray this process has already started is used as it is (one start for both runs below) and left up.
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        request.addfinalizer(ray.shutdown)
    cells = [{"name": "one", "x": 1}, {"x": 2}, {"x": 3}]
    with pytest.raises(CellError) as info:
        run_cells(square_or_fail, cells, executor)
    message = str(info.value)
    assert message == 'cell 2 of 3 ({"x": 2}) failed: ValueError: cannot take 2'
    assert info.value.cell == {"x": 2} and info.value.index == 1
    assert not isinstance(info.value, UserError)  # a bug in a cell is not the user's input: a traceback
    with pytest.raises(CellUserError) as info:
        run_cells(square_or_fail, [{"name": "first", "x": 1}, {"name": "bad model", "user_error": True}], executor)
    assert isinstance(info.value, UserError)  # the CLI prints it as one line, status 2
    assert str(info.value) == "cell 2 of 2 (bad model) failed: UserError: model: 'nosuchmodel' is not a preset"
    if executor == "ray":
        assert request.getfixturevalue("small_local_ray").is_initialized()  # not ours to shut down


def test_every_finished_cell_is_kept_before_a_failing_cells_error_even_one_that_ran_beside_it():
    """`keep(index, result)` for each cell that finished, the slow cell running beside the failing one included
    (it ends during the pool's shutdown): a caller writing them down (`bench reproduce`) resumes without it."""
    kept = {}
    cells = [{"x": 3, "sleep": 3}, {"x": 2}]  # the slow cell is taken first, so it runs when the other fails
    with pytest.raises(CellError, match=r"cell 2 of 2 .* failed: ValueError: cannot take 2"):
        run_cells(slow_or_fail, cells, "local", workers=2, keep=lambda i, result: kept.update({i: result}))
    assert kept == {0: 3}
    kept.clear()
    assert run_cells(
        slow_or_fail, [{"x": 1}, {"x": 3}], "local", workers=2, keep=lambda i, result: kept.update({i: result})
    ) == [1, 3]
    assert kept == {0: 1, 1: 3}


def test_a_cell_asking_more_cpus_than_the_local_ray_has_is_refused_before_ray_starts(small_local_ray):
    with pytest.raises(ExecutorError) as info:
        run_cells(square_or_fail, [{"x": 1, "threads": 3}], "ray")
    assert str(info.value) == (
        "resources: a cell asks for 3 CPUs; the local Ray has 2 (lower --threads, or give RAY_ADDRESS)"
    )
    assert not small_local_ray.is_initialized()


def strategy_spec(cell: dict) -> str:
    """A cell that builds the strategy its spec names (in a Ray worker: from the file the cell carries)."""
    from kvdirect_app.strategies import parse_spec

    return parse_spec(cell["spec"]).spec()


@pytest.mark.timeout(300)
def test_a_strategy_file_travels_with_its_ray_task(small_local_ray, tmp_path, monkeypatch):
    """The Ray executor carries the text of the strategy file each cell names (`external.carry`), and a worker
    builds the class from it though the file is gone from disk (as on another machine).  Mutation: `carry` not
    applied in `_run_ray` (no cell carries its file; a worker on a machine without it could not build it)."""
    from kvdirect_app.strategies import external

    mine = tmp_path / "travels.py"
    mine.write_text((ROOT / "examples" / "random_eviction.py").read_text())
    spec = f"{mine}:RandomEviction:budget=8:seed=3"
    carried, real = [], external.carry
    monkeypatch.setattr(external, "carry", lambda cell: carried.append(real(cell)) or carried[-1])
    assert run_cells(strategy_spec, [{"name": "file spec", "spec": spec}], "ray") == [spec]
    assert [c.get(external.CARRIED) for c in carried] == [{str(mine): mine.read_text()}]
    gone = carried[0]
    mine.unlink()
    assert run_cells(strategy_spec, [gone], "ray") == [spec]
