"""Model-free checks: byte accounting, spec parsing, agreement metrics, the row kernel check."""

import math

import pytest
import torch
from torch import nn

from kvdirect_app.kernels.replay import (
    BLOCK_FROM,
    BLOCK_ROWS,
    _linear_rows_batched,
    _linear_rows_loop,
    _rows_blocked,
    _rows_loop,
    linear_rows,
    rows_are_exact,
    rows_kernel_is_exact,
)
from kvdirect_app.measure.agreement import token_match
from kvdirect_app.measure.observe import storage_sizes
from kvdirect_app.strategies import StrategyError, parse_spec, parse_specs, registry

from ..conftest import bad_spec_error

pytestmark = pytest.mark.check  # the inner loop (`make check`)


def test_storage_sizes_counts_a_view_at_its_buffer_size_once():
    buf = torch.zeros(10, 4)
    view = buf[-2:]
    assert sum(storage_sizes(view).values()) == 10 * 4 * 4
    assert sum(storage_sizes(buf, view).values()) == 10 * 4 * 4
    assert sum(storage_sizes(view.clone()).values()) == 2 * 4 * 4
    assert sum(storage_sizes(None, torch.zeros(0)).values()) == 0


def test_registry_has_the_engine_strategies():
    assert {"full", "kvdirect"} <= set(registry())


def test_parse_spec_reads_settings_and_keeps_the_written_label():
    s = parse_spec("kvdirect:budget=16:mode=fast")
    assert (s.budget, s.mode, s.rebuild) == (16, "fast", "step")
    assert s.spec() == "kvdirect:budget=16:mode=fast"
    assert parse_spec("kvdirect:budget=64:mode=exact").label == "kvdirect:budget=64:mode=exact"
    assert parse_spec("kvdirect:budget=64:mode=exact").spec() == "kvdirect"
    assert not parse_spec("kvdirect:mode=fast").claims_exact
    assert parse_spec("kvdirect").claims_exact and parse_spec("full").claims_exact


@pytest.mark.parametrize(
    "text, words",
    [
        ("nope", "unknown strategy 'nope'; known strategies:"),
        ("kvdirect:colour=red", "unknown setting 'colour'; allowed: budget, mode, rebuild"),
        ("kvdirect:budget=0", "budget=0 must be >= 1"),
        ("kvdirect:budget=many", "budget='many' is not a valid int"),
        ("kvdirect:mode=sloppy", "mode='sloppy' is not allowed; allowed: exact, fast"),
        ("kvdirect:budget", "is not of the form key=value"),
        ("", "empty strategy spec"),
    ],
)
def test_bad_specs_name_the_setting_and_allowed_values(text, words):
    assert words in bad_spec_error(text)


def test_duplicate_specs_are_refused():
    with pytest.raises(StrategyError, match="listed twice"):
        parse_specs("kvdirect:budget=64,kvdirect")


def test_token_match_counts_over_turns_and_finds_the_first_divergence():
    assert token_match([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == (1.0, None)
    assert token_match([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 9]]) == (0.8, 4)
    assert token_match([[1, 2, 3]], [[1]]) == (pytest.approx(1 / 3), 1)
    assert token_match([[1, 2]], [[1, 2, 7]]) == (1.0, 2)


def test_agreement_is_exact_for_equal_logits_and_matches_the_definition():
    """`teacher_forcing.agree` takes every lane's KL, agreement and max |dlogit| in one pass over stacked logits: equal
    logits give exactly 0 (what the exact strategies must show), others the definition's KL."""
    from kvdirect_app.engine.lanes import Lane
    from kvdirect_app.engine.teacher_forcing import agree

    a = torch.tensor([1.0, 2.0, 3.0, 0.5] * 1000)
    b = torch.tensor([3.0, 2.0, 1.0, 0.5] * 1000)
    same, other = Lane(None, None, "same", None), Lane(None, None, "other", None)
    agree([same, other], [a.clone(), b], 2, a)
    assert (same.kl_sum, same.max_dlogit, same.tf_agree, same.tf_steps) == (0.0, 0.0, 1, 1)
    p, q = torch.softmax(a, 0), torch.softmax(b, 0)
    assert math.isclose(other.kl_sum, float((p * (p / q).log()).sum()), rel_tol=1e-4)
    assert other.max_dlogit == 2.0 and other.tf_agree == 0  # b's first maximum is at index 0, not 2


def _selection(out_features: int, in_features: int) -> torch.Tensor:
    """A weight with one nonzero per output row, a power of two: every dot product is one exact product plus exact
    zeros, so any kernel, in any order of summation, gives the same bits (true by arithmetic, not by this CPU)."""
    weight = torch.zeros(out_features, in_features)
    rows = torch.arange(out_features)
    weight[rows, (rows * 7) % in_features] = torch.tensor([0.5, -1.0, 2.0, -4.0]).repeat(out_features // 4 + 1)[
        :out_features
    ]
    return weight


@pytest.mark.parametrize("bias", [False, True])
def test_the_row_kernel_chosen_gives_the_bits_of_one_row_calls(bias, monkeypatch):
    """On random weights, whichever kernel the start-up check picks gives the bits of one-row calls.  On a weight
    whose products are exact (`_selection`), the batched kernel must give those bits too, so the check must pick
    it: which case is checked is decided by arithmetic, not by the check's own verdict (the old test compared the
    batched kernel only where `rows_kernel_is_exact` already said it was exact).

    Mutation that fails it: `_rows_batched` dropping the bias (`torch.bmm(x, weight_t)` in both branches): the
    start-up check then refuses it on every weight with a bias, so the old, gated comparison never ran."""
    from kvdirect_app.kernels import replay

    monkeypatch.setattr(replay, "_KERNELS", {})  # verdicts are kept per shape: these weights get their own
    torch.manual_seed(0)
    lin = nn.Linear(48, 24, bias=bias)
    rows = torch.randn(7, 48)
    loop = _linear_rows_loop(lin, rows)
    assert loop.shape == (7, 24)
    assert torch.equal(linear_rows(lin.weight, lin.bias, rows), loop)
    monkeypatch.setattr(replay, "_KERNELS", {})
    with torch.no_grad():
        lin.weight.copy_(_selection(24, 48))
        if bias:
            lin.bias.copy_(torch.arange(24) / 4 - 3)  # quarters: exact, and one rounding of (product + bias)
    loop = _linear_rows_loop(lin, rows)
    assert torch.equal(_linear_rows_batched(lin, rows), loop)
    assert rows_kernel_is_exact(lin) and replay._kernel(lin.weight, lin.bias) is replay._rows_batched
    assert torch.equal(linear_rows(lin.weight, lin.bias, rows), loop)


def test_a_batched_kernel_that_rounds_differently_is_refused(monkeypatch):
    """The check can fail: a candidate kernel one ulp off on a single row is not chosen; the loop is."""
    from kvdirect_app.kernels import replay

    def off_by_an_ulp(weight, bias, rows):
        out = _rows_loop(weight, bias, rows)
        out[3, 5] = torch.nextafter(out[3, 5], torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(replay, "_rows_batched", off_by_an_ulp)
    monkeypatch.setattr(replay, "_KERNELS", {})
    weight = torch.randn(40, 56)
    assert not replay.rows_are_exact(weight, None)
    assert replay._kernel(weight, None) is _rows_loop


def test_row_kernels_are_checked_per_thread_count(monkeypatch):
    """Some kernels split their work by the thread count: a verdict at one count is not reused at another."""
    from kvdirect_app.kernels import replay

    monkeypatch.setattr(replay, "_KERNELS", {})
    weight = torch.randn(24, 40)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            replay._kernel(weight, None)
    finally:
        torch.set_num_threads(previous)
    assert sorted(key[-1] for key in replay._KERNELS) == [1, 2]


@torch.inference_mode()
def test_a_weight_too_large_for_cache_is_served_in_blocks_with_the_same_bits(monkeypatch):
    """16,500 x 512 (8.4 M elements) is above BLOCK_FROM: the kernel checked first cuts it into blocks of output
    rows, the last one short.  On random weights whichever kernel the check picks gives the bits of one-row calls;
    on a weight whose products are exact (`_selection`) the blocked kernel must give them too, so the check must
    pick it (the old test compared the blocked kernel only where `rows_are_exact` already said exact).

    Mutations that fail it: `_kernel` never trying the blocked kernel (`candidates = [_rows_batched]`): the batched
    kernel is picked, `rows_are_exact` still says True and the blocked kernel is still right, so the old test
    passed; and `_rows_blocked` dropping the last, short block (`range(0, weight.shape[0] - BLOCK_ROWS + 1,
    BLOCK_ROWS)`), which the old test caught only on a CPU whose batched kernel passed the check."""
    from kvdirect_app.kernels import replay

    monkeypatch.setattr(replay, "_KERNELS", {})
    torch.manual_seed(0)
    weight, bias = torch.randn(16_500, 512), torch.randn(16_500)
    assert weight.numel() >= BLOCK_FROM and weight.shape[0] % BLOCK_ROWS
    rows = torch.randn(7, 512)
    for b in (None, bias):
        assert torch.equal(linear_rows(weight, b, rows), _rows_loop(weight, b, rows))
    monkeypatch.setattr(replay, "_KERNELS", {})
    weight, bias = _selection(16_500, 512), torch.arange(16_500) % 64 / 4 - 8
    for b in (None, bias):
        loop = _rows_loop(weight, b, rows)
        assert torch.equal(_rows_blocked(weight, b, rows), loop)
        assert rows_are_exact(weight, b) and replay._kernel(weight, b) is replay._rows_blocked
        assert torch.equal(linear_rows(weight, b, rows), loop)


def test_compare_never_trims_a_global_layer_to_the_reference_length():
    """The observer's comparison: shapes must match (a layer handing attention fewer tokens is not equal, whatever
    its values), then bits; the largest difference is kept."""
    from types import SimpleNamespace

    from kvdirect_app.measure.observe import Observer, Owner

    k = torch.randn(1, 2, 5, 4)
    reference = SimpleNamespace(layers=[SimpleNamespace(keys=k, values=k.clone())])
    layer = SimpleNamespace(is_sliding=False)
    observer, short, same = Observer(torch.device("cpu")), Owner("short", "lane"), Owner("same", "lane")
    for owner in (short, same):
        observer.compare_with(owner, reference)
    observer.compare(short, 0, layer, k[..., 1:, :], k[..., 1:, :])  # the last four equal the reference's: not enough
    assert observer.kv_report(short)["kv_exact"] is False and observer.kv_report(short)["shape_mismatches"] == 1
    observer.compare(same, 0, layer, k.clone(), k.clone())
    assert observer.kv_report(same)["kv_exact"] is True and observer.kv_report(same)["max_abs_dk"] == 0.0
    observer.compare(same, 0, layer, k + 1e-3, k)
    report = observer.kv_report(same)
    assert report["kv_exact"] is False and report["max_abs_dk"] == pytest.approx(1e-3, rel=1e-3)
