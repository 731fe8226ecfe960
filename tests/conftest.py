"""Shared fixtures (models loaded once per process, one launched app per process) and how the suite is split.

`make test` runs the suite on two workers (pytest-xdist, `--dist loadgroup`): tests that share a process-wide
fixture or run are one work unit (`GROUPS`: a test module, a tiny family's union run, the launched apps), sent
whole to one worker, the longest first.  `make check` runs the tests marked `check` (the inner loop).
"""

import atexit
import contextlib
import os
import shutil
import socket
import tempfile

import pytest

import kvdirect_app  # noqa: F401  (its process settings, MKL's among them, are read when torch loads its libraries)

# `make test` runs two workers on two cores: each computes on its share of them (a run that asks for more threads
# still gets them), so that neither worker's OpenMP threads wait on threads the other one holds.  Set before torch
# is imported; subprocesses (apps, bench children, process pools) inherit it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Every results file the suite writes (bench run/sweep/reproduce/..., the compare endpoint), in this process or
# in a subprocess, is validated against its JSON Schema (docs/schema/) before it is written
# (kvdirect_app/plain/schema.py).
os.environ["KVDIRECT_VALIDATE_JSON"] = "1"

# The invariance probe's kept verdicts (models/probe_verdicts.py) go to a folder of this run's own, empty at its
# start, so that no test reads a file an earlier run on this machine left behind (a clean clone's cache holds none),
# and the suite never writes into the user's cache.  The built libraries and the models' kept copies stay where
# `make install` put them: they are the install's, and a missing one is made again, the same.  A folder set by hand
# wins.
# Under xdist the controller makes it and its workers inherit both variables: the folder is still the run's own.
PROBE_FOLDER = os.environ.get("KVDIRECT_SUITE_PROBES")  # the folder this run made (None where one was set by hand)
if not os.environ.get("KVDIRECT_PROBE_CACHE"):
    PROBE_FOLDER = tempfile.mkdtemp(prefix="kvdirect-probes-")
    os.environ["KVDIRECT_PROBE_CACHE"] = os.environ["KVDIRECT_SUITE_PROBES"] = PROBE_FOLDER
    atexit.register(shutil.rmtree, PROBE_FOLDER, ignore_errors=True)

import torch  # noqa: E402

from kvdirect_app.models.loading import load_model  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # also where torch was imported before this file
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from .runs import TINY_FAMILIES, all_sliding, tiny  # noqa: E402,F401  (re-exported for the test modules)


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gemma3():
    return load_model("gemma3-270m", dtype="float32", device="cpu")


def bad_spec_error(text: str) -> str:
    """The StrategyError message for a bad spec, checked to be one line."""
    from kvdirect_app.strategies import StrategyError, parse_spec

    with pytest.raises(StrategyError) as info:
        parse_spec(text)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- the launched app ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def app():
    """The Studio launched once per process on loopback (tiny model by default, 6 new tokens) and a gradio_client
    session on it; every app test that needs no process of its own uses it (tests/app/test_app.py, test_public.py)."""
    with running_app("tiny-llama", 6) as launched:
        yield launched


@contextlib.contextmanager
def running_app(model: str, max_new_tokens: int):
    """The Studio launched on loopback and a gradio_client session on it, both closed afterwards."""
    import gradio_client

    from kvdirect_app.app.ui import build_demo

    demo = launch_local(build_demo(model=model, max_new_tokens=max_new_tokens))
    client = gradio_client.Client(demo.local_url, verbose=False)
    try:
        yield demo, client
    finally:
        client.close()
        demo.close()


def launch_local(demo):
    """Launch a Gradio app in-process on a free loopback port (the caller closes it)."""
    from kvdirect_app.app.ui import launch_options

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.queue(default_concurrency_limit=1).launch(
        server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options()
    )
    return demo


# --- how the suite is split between workers -----------------------------------------------------------------------
# Modules that share a process-wide fixture form one group; a test parametrized by a tiny family joins that
# family's group (its union run, tests/runs.py).  Every other module is a group of its own.
GROUPS = {
    "test_app": "apps",
    "test_public": "apps",
    "test_recordings": "apps",
    "test_uploads": "apps",
    "test_panes_join": "apps",
    "test_live_updates": "apps",
    "test_smollm2": "test_kernels",
}
TINY_SHARED = {
    "test_exactness_tiny",
    "test_anchorkv",
    "test_lockstep",
    "test_attention_view",
    "test_eviction",
    "test_kernels",
}
# Tests that run long enough to be a unit of their own (each worker launches its own app for them).
OWN = {
    "test_browser.py::test_the_recall_demo_runs_to_done_and_only_the_exact_panes_say_4127": "recall demo",
    "test_browser.py::test_run_it_live_runs_the_recorded_conversation_here": "recall demo",
    "test_browser.py::test_a_model_switch_between_turns_replays_the_earlier_turns_on_the_new_model": "recall demo",
    "test_public.py::test_eight_visitors_at_once_get_their_own_answers_and_memory_comes_back": "visitors",
}
# The longest units first (measured), so that the two workers end together.
FIRST = (
    "test_browser",
    "recall demo",
    "test_stress",
    "visitors",
    "apps",
    "test_install",
    "test_reproduce",
    "test_executors",
)


def group_of(nodeid: str) -> str:
    """A test's group, from its id alone (the controller schedules by ids): `tests/layer/test_x.py::test_y[params]`."""
    if nodeid.split("/")[-1] in OWN:
        return OWN[nodeid.split("/")[-1]]
    module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    params = nodeid[nodeid.index("[") + 1 : -1].split("-") if nodeid.endswith("]") else []
    family = next((f for f in TINY_FAMILIES if f.split("-")[1] in params and "tiny" in params), None)
    if module in TINY_SHARED and family is not None:
        return f"{family}-{'bfloat16' if 'bfloat16' in params else 'float32'}"
    return GROUPS.get(module, module)


def pytest_collection_modifyitems(config, items):
    """The longest groups first, each group's tests together (and each module's tests together within it)."""
    groups = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)
    order = [g for g in FIRST if g in groups] + [g for g in groups if g not in FIRST]
    items[:] = [item for g in order for item in groups[g]]


def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker, in collection order (`--dist loadgroup` names groups by rewriting test ids, which
    pytest 9 no longer lets a plugin do)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # keep FIRST's order
    return GroupScheduling(config, log)
