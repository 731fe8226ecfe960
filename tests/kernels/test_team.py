"""The fixed-order kernels' team of threads (`dots.cpp`, `Team`): whoever computes a task, the bits are one thread's,
and a call never waits for a helper that does not come.

Each check can fail: a task left unclaimed or claimed twice leaves outputs unwritten (the output is `torch.empty`)
or races; a caller that waits for every helper, as an OpenMP barrier does, never returns while a helper is held.
"""

import threading

import pytest
import torch

from kvdirect_app.kernels import dots

pytestmark = pytest.mark.skipif(dots.unavailable() is not None, reason=str(dots.unavailable()))

# (n, k, rows): a decode linear of SmolLM2's, a wide one, a head-sized one and a prompt's.
LINEARS = [(576, 576, 7), (1536, 576, 1), (4000, 576, 3), (576, 576, 300)]


def _calls(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for n, k, m in LINEARS:
        yield (
            "linear",
            (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)),
        )
    for t in (5, 300, 2000):
        q = torch.randn(9, 1, 64, generator=gen)
        yield "attention", (q, torch.randn(3, t, 64, generator=gen), torch.randn(3, t, 64, generator=gen), t, 0.125)
    lengths = (5, 300, 90, 2000, 64, 64, 64)  # seven lanes' attention at a layer in one call
    keys = [torch.randn(3, t, 64, generator=gen) for t in lengths]
    values = [torch.randn(3, t, 64, generator=gen) for t in lengths]
    yield "lanes", (torch.randn(7, 9, 1, 64, generator=gen), keys, values, list(lengths), 0.125)


def _run(kind, args, threads):
    if kind == "linear":
        return dots.linear(*args, threads=threads)
    if kind == "lanes":
        return dots.attention_lanes(*args, threads=threads)
    return dots.attention(*args, threads=threads)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_every_task_is_computed_once_at_any_team_size(threads):
    """More helpers than cores too: each output is the one-thread call's, call after call."""
    for repeat in range(20):
        for kind, args in _calls(repeat % 3):
            assert torch.equal(_run(kind, args, threads), _run(kind, args, 1)), (kind, threads, repeat)


def test_calls_from_two_threads_at_once_give_one_threads_bits():
    """The app's compute thread and a test's or a drawing's thread may call at once: the second caller computes its
    call alone while the first holds the team."""
    calls = list(_calls(7))
    want = [_run(kind, args, 1) for kind, args in calls]
    wrong: list = []

    def hammer():
        for _ in range(30):
            for (kind, args), expected in zip(calls, want):
                if not torch.equal(_run(kind, args, 2), expected):
                    wrong.append(kind)

    workers = [threading.Thread(target=hammer) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert not any(w.is_alive() for w in workers)
    assert not wrong


def test_a_call_never_waits_for_a_helper_that_does_not_come():
    """Helpers held (as when another process holds their core): a large call at 2 threads returns, computed by its
    caller alone, with the same bits."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 576, generator=gen), torch.randn(8000, 576, generator=gen)
    want = dots.linear(x, w, threads=1)
    out: list = []
    dots.hold_helpers(True)
    try:
        caller = threading.Thread(target=lambda: out.append([dots.linear(x, w, threads=2) for _ in range(50)]))
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), "a call waited for a helper that was held"
    finally:
        dots.hold_helpers(False)
    assert all(torch.equal(o, want) for o in out[0])
    assert torch.equal(dots.linear(x, w, threads=2), want)  # the helpers take tasks again
