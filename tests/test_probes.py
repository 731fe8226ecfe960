"""The probe's store does not trust its file: a stored verdict is a claim only after its form and a re-check of
every proven count (and of the thread-count equality it claims) agree, on the verdict's device; anything else is
probed afresh.  Tiny weights built here, the store in a tmp folder (`KVDIRECT_PROBE_CACHE`): no model, and the
user's cache is never touched.

Each test's docstring names the mutation of probes.py it catches (each was applied by hand and seen failing)."""

import json

import pytest
import torch
import torch.nn.functional as F

from kvdirect_app import kernels as K
from kvdirect_app import probes

WEIGHT = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def probed(tmp_path, monkeypatch) -> list:
    """The store in tmp_path; the linear probes that ran, in order."""
    monkeypatch.setenv(probes.CACHE_ENV, str(tmp_path))
    calls, real = [], probes.probe_linear
    monkeypatch.setattr(probes, "probe_linear", lambda *a: calls.append(a) or real(*a))
    return calls


def start() -> probes.Store:
    """The store of a fresh start (what `models.load_model` makes for a model)."""
    return probes.Store("tiny", torch.float32, "cpu")


def verdict(store: probes.Store, threads: int = 1, weight: torch.Tensor = WEIGHT) -> probes.Verdict:
    """WEIGHT's verdict as `Kernels.for_model` asks the store for it: the file's if re-checked, else probed."""
    return K.Kernels("invariant", threads, store=store)._linear_verdict(weight, None, threads)


def edit(store: probes.Store, change):
    """The file with `change(data)` applied: a tampered or broken file."""
    data = json.loads(store.path.read_text())
    store.path.write_text(change(data) if callable(change) else change)


def entry(change):
    """A `change` for `edit`: `change(entry)` on the file's one verdict, then the file as JSON."""
    def apply(data):
        (stored,) = data["verdicts"]
        change(stored)
        return json.dumps(data)
    return apply


def probed_afresh(probed: list, store: probes.Store, fresh: probes.Verdict):
    """The file's verdict was not used: a second probe ran, and the file now holds the fresh verdict, which the next
    start reads."""
    assert len(probed) == 2 and store.read_from_file == 0
    assert start().stored == {fresh.key: fresh}


@pytest.mark.parametrize("where, added", [("proven", [17, 40]), ("failed", [17]), ("head", [32])])
def test_counts_the_probe_never_tried_are_not_accepted(probed, monkeypatch, where, added):
    """Row counts that are not the probe's (17 and 40 among the proven, 17 among the failed; 32 for a head, which is
    probed at ROWS[0] only) make the verdict probed afresh; `pad(17)` never gives 17.
    Mutations: `_stored` without its check that the counts are `candidates_of(key)` (17 and 40 then pass the
    re-check here and are used); a check against ROWS instead of the key's candidates (the head's 32 passes)."""
    if where == "head":
        monkeypatch.setattr(probes, "HEAD_ELEMENTS", WEIGHT.numel())
    first = start()
    assert verdict(first).counts == probes.candidates_of(probes.linear_key(WEIGHT, None, 1))  # all of them at 1 thread
    field = "failed" if where == "failed" else "proven"
    edit(first, entry(lambda e: e.update({field: sorted(e[field] + added)})))
    second = start()
    fresh = verdict(second)
    probed_afresh(probed, second, fresh)
    assert not set(added) & set(fresh.counts + fresh.failed)
    if where == "proven":
        assert fresh.pad(17) == 32 and fresh.pad(40) == 64


def test_a_proven_count_that_does_not_hold_here_is_probed_afresh(probed, monkeypatch):
    """A stored count whose rows differ here (simulated: 32-row calls at the probe's misaligned offset give other
    bits) is rejected, and the fresh probe fails it.
    Mutations: the re-check tries only the smallest and largest proven counts; only counts below 32."""
    first = start()
    assert 32 in verdict(first).counts[1:-1]
    real = F.linear

    def misaligned_32_row_calls_differ(x, weight, bias=None):
        out = real(x, weight, bias)
        row = x.storage_offset() // x.shape[-1]
        return out + 1 if x.shape[0] == 32 and row == probes.OFFSETS[1] else out

    monkeypatch.setattr(F, "linear", misaligned_32_row_calls_differ)
    second = start()
    fresh = verdict(second)
    probed_afresh(probed, second, fresh)
    assert 32 in fresh.failed and fresh.pad(17) != 32


def test_a_claimed_thread_count_equality_that_fails_here_is_probed_afresh(probed, monkeypatch):
    """A 2-thread verdict claims that the large call gives the same bits at 1 and 2 threads; where that fails here
    (simulated: every call at one thread gives other bits), it is rejected and the fresh verdict says so.
    Mutation: the re-check without the thread-count equality (`across or not verdict.across_threads` dropped)."""
    first = start()
    assert verdict(first, threads=2).across_threads
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, weight, bias=None: real(x, weight, bias)
                        + (1 if torch.get_num_threads() == 1 else 0))
    second = start()
    fresh = verdict(second, threads=2)
    probed_afresh(probed, second, fresh)
    assert fresh.across_threads is False


def test_verdicts_of_each_thread_count_are_kept_side_by_side(probed):
    """A start at 2 threads adds its verdict to the file; the 1-thread verdict stays, and a later 1-thread start
    reads it instead of probing.
    Mutation: `_write` writes only this process's verdicts (the file overwritten)."""
    one = verdict(start(), threads=1)
    two = verdict(start(), threads=2)
    third = start()
    assert third.stored == {one.key: one, two.key: two}
    assert verdict(third, threads=1) == one and third.read_from_file == 1 and len(probed) == 2


def _key_with_object(e):
    e["key"][2] = {"bias": False}


@pytest.mark.parametrize("change", [
    "{not json", "[1, 2]", json.dumps({"verdicts": []}),
    lambda data: json.dumps(data | {"environment": data["environment"] | {"cpu": "another"}}),
    lambda data: json.dumps(data | {"verdicts": 5}),
    lambda data: json.dumps(data | {"verdicts": [5]}),
    entry(lambda e: e.update(across_threads="yes")),
    entry(lambda e: e.update(proven=[float(c) for c in e["proven"]])),
    entry(lambda e: e.update(proven=[str(c) for c in e["proven"]])),
    entry(lambda e: e.update(proven=e["proven"][::-1])),
    entry(lambda e: e.update(proven=e["proven"][:-1], failed=e["proven"][-1:] * 2)),
    entry(lambda e: e.pop("failed")),
    entry(_key_with_object),
    entry(lambda e: e.update(key=e["key"][:-1])),
], ids=["not json", "a list", "no environment", "another environment", "verdicts not a list", "an entry not a dict",
        "across_threads a string", "counts floats", "counts strings", "proven descending", "a count twice",
        "no failed", "a key with an object", "a key cut short"])
def test_a_broken_file_or_another_environment_is_probed_afresh_without_an_error(probed, change):
    """Whatever the file holds, a start probes afresh (no exception) and rewrites the file.
    Mutations: `_read` without its checks that the file is an object and its verdicts a list; `_stored` without
    its type checks (a bool across_threads, int counts: 16.0 == 16), its ascending check, or its hash of the key."""
    first = start()
    verdict(first)
    edit(first, change)
    second = start()
    probed_afresh(probed, second, verdict(second))


def test_the_recheck_computes_on_the_verdicts_device(monkeypatch):
    """A linear verdict is re-checked on its weight's device, the attention rows' on the device of their key
    (here the meta device stands for a GPU: every comparison the re-check makes is between tensors on it).
    Mutation: the attention rows' re-check builds its inputs on the CPU (as it did), or a linear one its inputs
    apart from the weight's device."""
    seen = []
    monkeypatch.setattr(torch, "equal", lambda a, b: seen.append((a.device.type, b.device.type)) or True)
    weight = torch.empty(WEIGHT.shape, device="meta")
    linear = probes.Verdict(probes.linear_key(weight, None, 1), probes.ROWS, True)
    rows = probes.Verdict(probes.attention_rows_key(16, torch.float32, "meta"), probes.ROWS, True)
    assert probes.recheck(linear, weight)
    assert probes.recheck(rows)
    assert len(seen) > 2 * len(probes.ROWS) and set(seen) == {("meta", "meta")}
