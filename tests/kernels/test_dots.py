"""The fixed-order linears (`dots.py`): one order for every output, so a row's bits never depend on the call.

Each check can fail: a kernel that split a dot product over threads, chose its order by the row count or the
tile, or rounded its tails another way gives other bits for some row below.  The AVX2 path runs here by forcing
it (``KVDIRECT_DOTS_PATH=avx2``), so a CPU without AVX-512 is tested on every machine; the paths must give the same
bits as one another, the scalar one included."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvdirect_app.kernels import dots
from kvdirect_app.measure import ledger

# Widths with and without a tail past the last 16 (k), column counts with and without a tail past the last tile.
SHAPES = [(13, 37), (45, 64), (7, 576), (192, 1536)]
DTYPES = [torch.float32, torch.bfloat16]


def _paths() -> list[str]:
    """The vector paths this CPU runs (AVX2 at least, on any x86 machine the studio runs on)."""
    out = []
    for name in ("avx512", "avx2"):
        try:
            dots.path(name)
            out.append(name)
        except dots.Unavailable:
            pass
    return out


def _data(n, k, dtype, rows=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    return x, w, b


@pytest.mark.check
def test_a_vector_path_runs_here():
    assert dots.unavailable() is None, dots.unavailable()
    assert _paths(), "neither AVX-512 nor AVX2 here"
    assert dots.path() == _paths()[0]  # the widest, unless one is forced


@pytest.mark.check
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_path_gives_the_same_bits(shape, dtype):
    """AVX-512, AVX2 and the scalar loop: the same order on the same numbers, so the same bits, bias or none."""
    x, w, b = _data(*shape, dtype, rows=23)
    for bias in (b, None):
        ref = dots.linear(x, w, bias, name="scalar")
        for name in _paths():
            assert torch.equal(dots.linear(x, w, bias, name=name), ref), name


@pytest.mark.check
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_row_has_the_same_bits_in_every_call_at_any_thread_count(shape, dtype):
    """Every row count 1-16 at several offsets, at 1 and 2 threads, against the same rows in a call of 300 rows
    (several blocks of rows for the wide shapes), on every vector path here."""
    x, w, b = _data(*shape, dtype)
    for name in _paths():
        whole = dots.linear(x, w, b, name=name, threads=2)
        assert torch.equal(dots.linear(x, w, b, name=name, threads=1), whole), name
        for threads in (1, 2):
            for m in range(1, 17):
                for offset in (0, 1, 5, 17, 283):
                    rows = dots.linear(x[offset : offset + m], w, b, name=name, threads=threads)
                    assert torch.equal(rows, whole[offset : offset + m]), (name, threads, m, offset)


@pytest.mark.check
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_it_is_the_linear_it_stands_for(dtype):
    """Within rounding of `F.linear` in float64 (a few float32 ulps of the sum; bf16: one bf16 rounding of the
    result), any leading shape, the result in the weight's dtype."""
    x, w, b = _data(96, 576, dtype, rows=12)
    got = dots.linear(x.view(3, 4, 576), w, b)
    assert got.shape == (3, 4, 96) and got.dtype == dtype
    exact = F.linear(x.double(), w.double(), b.double()).view(3, 4, 96)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-20
    assert ((got.double() - exact).abs() <= ulp * exact.abs() + 1e-4).all()


@pytest.mark.check
def test_the_weights_are_read_where_they_lie():
    """No copy of the weight, packed or otherwise: a call allocates its result (and the rows widened to float32
    for a bf16 weight), nothing the size of the weight.  Mutation: a `.clone()` of the weight in `linear`."""
    book = ledger.load()
    for dtype in DTYPES:
        x, w, b = _data(1536, 576, dtype, rows=4)
        owner = book.owner()
        try:
            with book.working_for(owner):
                out = dots.linear(x, w, b)
            expected = out.numel() * out.element_size() + (x.numel() * 4 if dtype == torch.bfloat16 else 0)
            assert book.peak(owner) <= expected + 4096 < w.numel() * w.element_size(), dtype
        finally:
            del out
            book.release(owner)


@pytest.mark.check
def test_a_path_is_asked_for_by_name_and_a_bad_name_is_refused(monkeypatch):
    monkeypatch.setenv(dots.PATH_ENV, "avx2")
    assert dots.requested() == "avx2" and dots.path() == "avx2"
    monkeypatch.setenv(dots.PATH_ENV, "sse9")
    with pytest.raises(
        ValueError, match="KVDIRECT_DOTS_PATH: 'sse9' is not allowed; allowed: auto, scalar, avx2, avx512"
    ):
        dots.requested()
    assert "not allowed" in dots.unavailable()
    monkeypatch.delenv(dots.PATH_ENV)
    assert "float16" in dots.unavailable(torch.float16)
    assert "on the CPU, not meta" in dots.unavailable(device="meta")


FORCED = """
import json, sys
from kvdirect_app.engine.runner import Engine, run_to_end
from kvdirect_app.models.loading import load_model
from kvdirect_app.strategies import parse_specs
specs = "full,kvdirect:budget=4,anchorkv:spacing=2:budget=3:rebuild=step"
out = {}
for dtype in ("float32", "bfloat16"):
    loaded = load_model("tiny-llama", dtype=dtype, device="cpu")
    r = run_to_end(Engine(loaded, parse_specs(specs), max_new_tokens=6, threads=2),
                   ["Tell me about caches.", "Why do keys need positions?"])
    out[dtype] = {"kernels": r["kernels"], "lanes": {s: {k: r["strategies"][s][k] for k in
                  ("token_ids", "kv_exact", "kv_digest", "max_abs_dk")} for s in specs.split(",")}}
print(json.dumps(out))
"""


def _forced(path: str) -> dict:
    env = dict(os.environ, **{dots.PATH_ENV: path})
    done = subprocess.run([sys.executable, "-c", FORCED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_forced_avx2_path_runs_the_exact_lanes_with_the_bits_of_the_widest():
    """A run as on a CPU without AVX-512 (the AVX2 path forced): the exact lanes bit-equal to the full cache, in
    float32 and bfloat16, and every lane's digest the same as on this CPU's own path (one order on both)."""
    here = dots.path()
    runs = {path: _forced(path) for path in dict.fromkeys(("avx2", here))}
    for path, run in runs.items():
        for dtype, r in run.items():
            assert r["kernels"]["mode"] == "invariant" and r["kernels"]["dots_path"] == path, r["kernels"]
            ref = r["lanes"]["full"]
            for spec, lane in r["lanes"].items():
                assert lane["token_ids"] == ref["token_ids"], (path, dtype, spec)
                if spec != "full":
                    assert lane["kv_exact"] is True and lane["max_abs_dk"] == 0.0, (path, dtype, spec)
    for dtype in runs["avx2"]:
        assert {s: lane["kv_digest"] for s, lane in runs["avx2"][dtype]["lanes"].items()} == {
            s: lane["kv_digest"] for s, lane in runs[here][dtype]["lanes"].items()
        }, dtype
