"""What a twin copies and what the fixed-order kernels accept (issue 54, item 5)."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvdirect_app.kernels import dots

STRATEGY = "tests/strategies_kept/mmap_state.py:KeepsMmap:budget=4"


def test_a_state_that_cannot_be_copied_ends_a_run_in_one_line():
    """A twin (teacher-forced agreement, on by default) copies the lane's state; a strategy that keeps an `mmap`
    cannot be copied, and `bench run` says so in one line naming it, with no traceback."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdirect_app.bench",
            "run",
            "--model",
            "tiny-llama",
            "--strategies",
            f"full,{STRATEGY}",
            "--max-new-tokens",
            "6",
            "--prompt",
            "Tell me about caches, please.",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text, text[-2000:]
    lines = [line for line in text.splitlines() if "cannot be copied" in line]
    assert len(lines) == 1 and "KeepsMmap" in lines[0] and "mmap" in lines[0], text[-2000:]


def _dots():
    reason = dots.unavailable()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize(
    "x_shape, w_shape, bias",
    [
        ((3, 8), (5, 4), None),  # 24 elements: reshapes to (6, 4)
        ((2, 3, 6), (5, 4), None),
        ((4,), (5, 8), None),
        ((3, 4), (5, 4), (4,)),
        ((3, 4), (5, 2, 2), None),
    ],
)
def test_fixed_order_linears_refuse_what_f_linear_refuses(x_shape, w_shape, bias):
    _dots()
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    b = None if bias is None else torch.randn(bias)
    with pytest.raises(RuntimeError):
        F.linear(x, w, b)
    with pytest.raises(ValueError, match="fixed-order linears"):
        dots.linear(x, w, b)


def test_fixed_order_linears_take_what_f_linear_takes():
    _dots()
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    assert dots.linear(x, w, b).shape == F.linear(x, w, b).shape == (2, 3, 5)
    torch.testing.assert_close(dots.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize(
    "q, k, v, end",
    [
        ((4, 2, 8), (2, 5, 8), (2, 5, 4), 5),  # values of another head size
        ((4, 2, 8), (2, 5, 4), (2, 5, 4), 5),  # keys of another head size
        ((3, 2, 8), (2, 5, 8), (2, 5, 8), 5),  # 3 heads over 2
        ((4, 6, 8), (2, 5, 8), (2, 5, 8), 6),  # more queries than keys
        ((4, 2, 8), (2, 5, 8), (2, 5, 8), 4),  # keys past the end
        ((4, 8), (2, 5, 8), (2, 5, 8), 5),
    ],
)
def test_fixed_order_attention_refuses_shapes_that_do_not_fit(q, k, v, end):
    _dots()
    with pytest.raises(ValueError, match="fixed-order attention"):
        dots.attention(torch.randn(q), torch.randn(k), torch.randn(v), end, 0.125)


def test_fixed_order_attention_takes_a_fitting_call():
    _dots()
    out = dots.attention(torch.randn(4, 2, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8), 5, 0.125)
    assert out.shape == (2, 4, 8) and torch.isfinite(out).all()
