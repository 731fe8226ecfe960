"""Fifteen ways a careless strategy can keep a copy of its keys, and where each one shows (issue 54, item 3).

Each strategy below is a plain window (`window:budget=4`) whose score() also keeps, every call, a copy of the step's
keys tiled to `PAYLOAD` bytes (256 KiB; the ways made of Python objects keep `ITEMS` = 8,192 values, 8-13 B
of pointers and 24-32 B of objects each): tiny-llama, 4 layers, two turns of 6 new tokens, so a run's score()
calls keep ~12 MiB in all (`hidden`, the way's own size: `sys.getsizeof` of its objects, the buffers' lengths).
The run must show at least half of it in the lane's own figure (its bytes outside torch above the plain window's,
or its held bytes above its formula, which then does not match), or as unattributed bytes.  Where each way
shows is named (`WHERE`), and a mutation of that mechanism makes its test fail:

* the ledger's cross-check off (`ledger.CrossCheck.parts` returning zeros): every way marked "unattributed";
* threads not inheriting their starter's owner (`ledger._inherit_owners` a no-op): the thread ways;
* numpy's default handler left as numpy's (`kv_numpy_install` not called): the thread's and the fresh context's
  numpy copies;
* the strategy built outside its lane's region (`lanes.made_again` returning the strategy as it is): the
  buffer made in `__post_init__`.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import io
import mmap
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvdirect_app.engine.runner import Engine
from kvdirect_app.measure import ledger
from kvdirect_app.strategies import parse_specs
from kvdirect_app.strategies.window import Window

from ..conftest import tiny

pytestmark = pytest.mark.skipif(
    ledger.unavailable() is not None or not ledger.load().numpy,
    reason="the allocator ledger (with numpy) cannot be built here",
)
ROOT = Path(__file__).resolve().parents[2]
TURNS = ["Tell me about caches.", "Why do keys need positions?"]
PLAIN = "window:budget=4"
PAYLOAD = 256 << 10
ITEMS = 8192
BUFFER = 1 << 20
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_LIBC.malloc.restype = ctypes.c_void_p
_LIBC.malloc.argtypes = [ctypes.c_size_t]
_LIBC.free.argtypes = [ctypes.c_void_p]


def _payload(keys: torch.Tensor, n: int = PAYLOAD // 4) -> torch.Tensor:
    """The keys tiled to `n` float32 values (a fresh tensor: the way copies it, then it is freed)."""
    flat = keys.detach().float().flatten()
    return flat.repeat(-(-n // flat.numel()))[:n].contiguous()


def _values(keys: torch.Tensor) -> list[float]:
    return _payload(keys, ITEMS).tolist()


def _objects(*objects) -> int:
    return sum(sys.getsizeof(o) for o in objects)


# --- the ways: keep(strategy, keys, where) -> bytes hidden ----------------------------------------------------------
def _bytes(self, keys, tmp):
    self.kept.append(bytes(memoryview(_payload(keys).numpy()).cast("B")))
    return sys.getsizeof(self.kept[-1])


def _bytearray(self, keys, tmp):
    self.kept.append(bytearray(memoryview(_payload(keys).numpy()).cast("B")))
    return sys.getsizeof(self.kept[-1])


def _tuple_of_floats(self, keys, tmp):
    kept = tuple(_values(keys))
    self.kept.append(kept)
    return _objects(kept, *kept)


def _dict_of_ints(self, keys, tmp):
    kept = {i: int(v * 1e9) for i, v in enumerate(_values(keys), start=1000)}
    self.kept.append(kept)
    return _objects(kept, *kept.keys(), *kept.values())


def _ctypes_malloc(self, keys, tmp):
    data = _payload(keys)
    address = _LIBC.malloc(PAYLOAD)
    ctypes.memmove(address, data.data_ptr(), PAYLOAD)
    self.kept.append(address)
    self.release.append(lambda a=address: _LIBC.free(a))
    return PAYLOAD


def _private_mmap(self, keys, tmp):
    kept = mmap.mmap(-1, PAYLOAD, flags=mmap.MAP_PRIVATE)
    kept[:] = memoryview(_payload(keys).numpy()).cast("B")
    self.kept.append(kept)
    self.release.append(kept.close)
    return PAYLOAD


def _from_file(self, keys, tmp):
    path = tmp / f"from_file_{len(self.kept)}.bin"
    path.write_bytes(b"\0" * PAYLOAD)
    kept = torch.from_file(str(path), shared=False, size=PAYLOAD // 4, dtype=torch.float32)
    kept.copy_(_payload(keys))
    self.kept.append(kept)
    return PAYLOAD


def _memmap(self, keys, tmp):
    kept = np.memmap(tmp / f"memmap_{len(self.kept)}.bin", dtype=np.float32, mode="w+", shape=(PAYLOAD // 4,))
    kept[:] = _payload(keys).numpy()
    self.kept.append(kept)
    return PAYLOAD


def _numpy_on_a_thread(self, keys, tmp):
    data, out = _payload(keys), []
    worker = threading.Thread(target=lambda: out.append(data.numpy().copy()))
    worker.start()
    worker.join()
    self.kept.extend(out)
    type(self).owned += out[0].nbytes
    return out[0].nbytes


def _list_on_a_thread(self, keys, tmp):
    data, out = _payload(keys, ITEMS), []
    worker = threading.Thread(target=lambda: out.append(data.tolist()))
    worker.start()
    worker.join()
    self.kept.extend(out)
    type(self).owned += sys.getsizeof(out[0])  # its array of items, a Python buffer: the lane's (its floats: no one's)
    return _objects(out[0], *out[0])


def _numpy_in_a_fresh_context(self, keys, tmp):
    data = _payload(keys)
    self.kept.append(contextvars.Context().run(lambda: data.numpy().copy()))
    type(self).owned += self.kept[-1].nbytes
    return self.kept[-1].nbytes


def _torch_save(self, keys, tmp):
    kept = io.BytesIO()
    torch.save(_payload(keys), kept)
    self.kept.append(kept)
    return kept.getbuffer().nbytes


def _pickle(self, keys, tmp):
    self.kept.append(pickle.dumps(_payload(keys).numpy()))
    return sys.getsizeof(self.kept[-1])


def _frombuffer(self, keys, tmp):
    buffer = bytearray(memoryview(_payload(keys).numpy()).cast("B"))
    self.kept.append(torch.frombuffer(buffer, dtype=torch.float32))
    return PAYLOAD


def _post_init_buffer(self, keys, tmp):  # filled in place, in the buffer __post_init__ made (`_buffered`)
    flat = keys.detach().float().flatten()
    n = min(flat.numel(), self.buffer.numel())
    self.buffer[:n] = flat[:n]
    return 0  # its size is counted once, when it is made


# way -> (keep, where it shows: "lane" (bytes outside torch), "formula" (held above the formula), "unattributed",
# or the sum of two).  The "lane" ways' copies made by numpy or as a list's array count for the lane (`owned`) and
# must show there, not as no one's.
WAYS = {
    "bytes": (_bytes, "unattributed"),
    "bytearray": (_bytearray, "unattributed"),
    "tuple_of_floats": (_tuple_of_floats, "unattributed"),
    "dict_of_ints": (_dict_of_ints, "unattributed"),
    "ctypes_malloc": (_ctypes_malloc, "unattributed"),
    "private_mmap": (_private_mmap, "unattributed"),
    "torch_from_file": (_from_file, "unattributed"),
    "np_memmap": (_memmap, "unattributed"),
    "numpy_on_a_thread": (_numpy_on_a_thread, "lane"),
    "list_on_a_thread": (_list_on_a_thread, "lane+unattributed"),
    "numpy_in_a_fresh_context": (_numpy_in_a_fresh_context, "lane"),
    "torch_save_bytesio": (_torch_save, "unattributed"),
    "pickle": (_pickle, "unattributed"),
    "torch_frombuffer": (_frombuffer, "unattributed"),
    "post_init_buffer": (_post_init_buffer, "formula"),
}


def _hider(way: str, keep, tmp):
    """A window registered as `test_hiding_<way>` whose score() hides a copy by `keep` (the bytes summed on the
    class: `hidden`); the buffer way's `__post_init__` makes a 1 MiB tensor first."""

    def score(self, step):
        type(self).calls += 1
        type(self).hidden += keep(self, step.keys, tmp)
        return Window.score(self, step)

    def post_init(self):
        Window.__post_init__(self)
        self.kept, self.release = [], []
        if way == "post_init_buffer":
            self.buffer = torch.zeros(BUFFER // 4)
            type(self).hidden = self.buffer.untyped_storage().nbytes()

    body = {
        "name": f"test_hiding_{way}",
        "hidden": 0,
        "owned": 0,
        "calls": 0,
        "score": score,
        "__post_init__": post_init,
        "__annotations__": {},
    }
    return dataclass(type(f"Hiding_{way}", (Window,), body))


def _run(specs: str, max_new_tokens: int = 6) -> tuple[Engine, dict]:
    """The run on a thread of its own, as the app runs its engine."""
    engine = Engine(tiny("tiny-llama"), parse_specs(specs), max_new_tokens=max_new_tokens, threads=1, twins=False)
    out = {}

    def drive():
        for event in engine.run(TURNS):
            if event["type"] == "done":
                out["result"] = event["result"]

    worker = threading.Thread(target=drive)
    worker.start()
    worker.join()
    return engine, out["result"]


def _shown(result: dict, label: str) -> dict[str, int]:
    """Where the run shows bytes beyond the plain window's: in the lane's own figures and as unattributed."""
    lanes = result["strategies"]
    mine, plain = lanes[label]["state_bytes"], lanes[PLAIN]["state_bytes"]
    return {
        "lane": (mine["outside_torch"]["peak"] or 0) - (plain["outside_torch"]["peak"] or 0),
        "formula": (
            mine["persistent_peak"] - mine["formula_persistent_peak"] if not mine["formula_matches_measurement"] else 0
        ),
        "unattributed": result["unattributed_bytes"]["peak"],
    }


def check(way: str):
    """One way's run and its checks (`test_each_hiding_way_shows_at_least_half_its_size` runs it in a fresh
    interpreter)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        keep, _ = WAYS[way]
        cls = _hider(way, keep, Path(tmp))
        engine, result = _run(f"full,{PLAIN},{cls.name}:budget=4")
        try:
            label = f"{cls.name}:budget=4"
            shown = _shown(result, label)
            where = WAYS[way][1].split("+")
            assert cls.calls >= 40 and cls.hidden >= (BUFFER if way == "post_init_buffer" else 8 << 20), cls.hidden
            assert sum(shown[w] for w in where) >= cls.hidden / 2, (
                way,
                cls.hidden,
                shown,
                result["unattributed_bytes"],
            )
            if "formula" in where:
                assert result["strategies"][label]["state_bytes"]["formula_matches_measurement"] is False
            if cls.owned:  # numpy's data and a list's array count for their owner on every thread, in every context
                assert shown["lane"] >= 0.95 * cls.owned, (way, cls.owned, shown)  # (a list's own header is no buffer)
            if where == ["lane"]:  # ... not as no one's
                assert result["unattributed_bytes"]["peak"] < cls.hidden / 4, result["unattributed_bytes"]
        finally:
            for lane in engine.lanes:
                for release in getattr(lane.strategy, "release", []):
                    release()


@pytest.mark.parametrize("way", list(WAYS))
def test_each_hiding_way_shows_at_least_half_its_size(way):
    """Each way in a fresh interpreter (`check`): Python's small-object arenas keep the free pools of whatever ran
    before in the process, and the ints and floats a way makes fill those first, with no new arena for the ledger
    to see: in a CI worker, after other tests, `dict_of_ints` showed 12 of its 37 MB."""
    done = subprocess.run(
        [sys.executable, "-c", f"from tests.measure.test_hiding_ways import check; check({way!r})"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])


@pytest.mark.parametrize(
    "specs",
    [
        "full,window:budget=4",
        "full,window:budget=4,kvdirect:budget=2,h2o:budget=4,"
        "anchorkv:spacing=2:budget=2,snapkv:budget=4,knorm:budget=4",
    ],
)
def test_built_in_strategies_leave_nothing_unattributed(specs):
    """No phantom: the cross-check's counts of a normal run stay within its floor (`CrossCheck.FLOOR`, 2 MiB, plus
    `PER_FORWARD` a lane's forward), and so every part of the run's unattributed bytes is 0, with 24 new tokens a
    turn.  The tolerance is the floor: measured here, the run's own records leave 0.3-1.3 MB of the C allocator's
    bytes and 1-2 MiB of Python's arenas unexplained (tiny-llama, 2 and 7 lanes)."""
    engine, result = _run(specs, max_new_tokens=24)
    assert result["unattributed_bytes"]["peak"] == 0, result["unattributed_bytes"]
    for label, lane in result["strategies"].items():
        assert lane["state_bytes"]["formula_matches_measurement"], label


def test_the_cross_check_sees_what_no_hook_sees_and_forgets_it_when_freed():
    """Directly: 8 MiB of the C allocator's, kept outside every hook, shows as `malloc`; freed, it goes."""
    book = ledger.load()
    check = ledger.CrossCheck(book)
    if not check.available:
        pytest.skip("no glibc malloc_info or /proc here")
    try:
        address = _LIBC.malloc(8 << 20)
        ctypes.memset(address, 1, 8 << 20)
        assert check.parts()["malloc"] >= 8 << 20
        _LIBC.free(address)
        assert check.parts()["malloc"] == 0
    finally:
        check.close()
