"""The probe's store proves what it reports: every start probes afresh (every count, proven and failed, at every
offset, twice, and the large call at one thread), a stored verdict is only compared with what the probe finds, and
an edited or stale file is replaced and said, never used.  Tiny weights built here, the store in a tmp folder
(`KVDIRECT_PROBE_CACHE`): no model, and the user's cache is never touched.

Each test's docstring names the mutation of probes.py or models/probe_verdicts.py it catches (each was applied and
seen failing)."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvdirect_app.kernels import invariant as K
from kvdirect_app.kernels import probes
from kvdirect_app.models import probe_verdicts

WEIGHT = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def probed(tmp_path, monkeypatch) -> list:
    """The store in tmp_path; the linear probes that ran, in order."""
    monkeypatch.setenv(probe_verdicts.CACHE_ENV, str(tmp_path))
    calls, real = [], probes.probe_linear
    monkeypatch.setattr(probes, "probe_linear", lambda *a: calls.append(a) or real(*a))
    return calls


def start() -> probe_verdicts.Store:
    """The store of a fresh start (what `models.load_model` makes for a model)."""
    return probe_verdicts.Store("tiny", torch.float32, "cpu")


def verdict(store: probe_verdicts.Store, threads: int = 1, weight: torch.Tensor = WEIGHT) -> probe_verdicts.Verdict:
    """WEIGHT's verdict as `Kernels.for_model` asks the store for it."""
    return K.Kernels("invariant", threads, store=store)._linear_verdict(weight, None, threads)


def edit(store: probe_verdicts.Store, change):
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


def replaced(store: probe_verdicts.Store, fresh: probe_verdicts.Verdict, said: str = "the probe here finds"):
    """The file's verdict was not used: the probe's is, the run says so, and the file now holds the probe's."""
    assert store.confirmed == 0 and any(said in note for note in store.notes), store.notes
    assert start().stored == {fresh.key: fresh}


def test_every_start_probes_and_a_file_that_agrees_is_confirmed(probed):
    """Mutation: a stored verdict used without a probe (the start then probes once, not twice)."""
    first = verdict(start())
    second_store = start()
    assert verdict(second_store) == first and len(probed) == 2
    assert second_store.confirmed == 1 and second_store.notes == []


def test_a_proven_count_moved_to_failed_in_the_file_is_replaced_by_the_probes_verdict(probed):
    """The reviewer's edit: 32 moved from proven to failed.  The probe proves it here: the run uses 32 and says the
    file disagreed.  Mutation: the stored verdict used where its form is valid (32 then never used)."""
    first = start()
    assert 32 in verdict(first).counts
    edit(
        first, entry(lambda e: e.update(proven=[c for c in e["proven"] if c != 32], failed=sorted(e["failed"] + [32])))
    )
    second = start()
    fresh = verdict(second)
    assert 32 in fresh.counts and fresh.pad(17) == 32
    replaced(second, fresh)


def test_a_thread_equality_flipped_to_false_in_the_file_is_replaced(probed):
    """The reviewer's edit: across_threads true -> false, which would have sent the run to native kernels with a
    false reason.  Mutation: the stored verdict used (the kernels then fall back to native)."""
    first = start()
    assert verdict(first, threads=2).across_threads
    edit(first, entry(lambda e: e.update(across_threads=False)))
    second = start()
    fresh = verdict(second, threads=2)
    assert fresh.across_threads is True
    replaced(second, fresh)


def test_a_count_wrong_at_the_first_offset_only_is_failed_whatever_the_file_says(probed, monkeypatch):
    """The reviewer's kernel: 32-row calls at offset 0 give other bits.  The probe (every offset) fails 32, so a
    file that proves 32 is replaced.  Mutation: a re-check at the misaligned offset only (as before: 32 passed)."""
    first = start()
    assert 32 in verdict(first).counts
    real = F.linear

    def first_offset_32_rows_differ(x, weight, bias=None):
        out = real(x, weight, bias)
        return out + 1 if x.shape[0] == 32 and x.storage_offset() == 0 else out

    monkeypatch.setattr(F, "linear", first_offset_32_rows_differ)
    second = start()
    fresh = verdict(second)
    assert 32 in fresh.failed and fresh.pad(17) != 32
    replaced(second, fresh)


@pytest.mark.parametrize("where, added", [("proven", [17, 40]), ("failed", [17]), ("head", [32])])
def test_counts_the_probe_never_tried_are_ignored_and_said(probed, monkeypatch, where, added):
    """Row counts that are not the probe's (17 and 40 among the proven, 17 among the failed; 32 for a head, which is
    probed at ROWS[0] only): the entry is not one the probe could have written; `pad(17)` never gives 17.
    Mutation: `_stored` without its check that the counts are `candidates_of(key)`."""
    if where == "head":
        monkeypatch.setattr(probe_verdicts, "HEAD_ELEMENTS", WEIGHT.numel())
    first = start()
    verdict(first)
    field = "failed" if where == "failed" else "proven"
    edit(first, entry(lambda e: e.update({field: sorted(e[field] + added)})))
    second = start()
    fresh = verdict(second)
    assert not set(added) & set(fresh.counts + fresh.failed)
    assert any("could not have written" in note for note in second.notes)
    assert start().stored == {fresh.key: fresh}
    if where == "proven":
        assert fresh.pad(17) == 32 and fresh.pad(40) == 64


def test_verdicts_of_each_thread_count_are_kept_side_by_side(probed):
    """A start at 2 threads adds its verdict to the file; the 1-thread verdict stays.
    Mutation: `_write` writes only this process's verdicts (the file overwritten)."""
    one = verdict(start(), threads=1)
    two = verdict(start(), threads=2)
    third = start()
    assert third.stored == {one.key: one, two.key: two}
    assert verdict(third, threads=1) == one and third.confirmed == 1


def _key_with_object(e):
    e["key"][2] = {"bias": False}


@pytest.mark.parametrize(
    "change",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"verdicts": []}),
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
    ],
    ids=[
        "not json",
        "a list",
        "no environment",
        "another environment",
        "verdicts not a list",
        "an entry not a dict",
        "across_threads a string",
        "counts floats",
        "counts strings",
        "proven descending",
        "a count twice",
        "no failed",
        "a key with an object",
        "a key cut short",
    ],
)
def test_a_broken_file_is_said_probed_afresh_and_rewritten_without_an_error(probed, change):
    """Whatever the file holds, a start probes afresh (no exception), says what was wrong with the file and
    rewrites it.  Mutations: `_read` without its checks that the file is an object and its verdicts a list; `_stored`
    without its type checks (a bool across_threads, int counts: 16.0 == 16), its ascending check, or its hash of
    the key."""
    first = start()
    verdict(first)
    edit(first, change)
    second = start()
    fresh = verdict(second)
    assert second.notes and second.confirmed == 0
    assert start().stored == {fresh.key: fresh}


def test_the_probe_computes_on_the_verdicts_device(monkeypatch):
    """A linear verdict is probed on its weight's device, the attention rows' on the device of their key (here the
    meta device stands for a GPU: every comparison the probe makes is between tensors on it).
    Mutation: the attention rows' probe builds its inputs on the CPU, or a linear one its inputs apart from the
    weight's device."""
    seen = []
    monkeypatch.setattr(torch, "equal", lambda a, b: seen.append((a.device.type, b.device.type)) or True)
    weight = torch.empty(WEIGHT.shape, device="meta")
    assert probes.probe_linear(weight, None, 1).counts == probes.ROWS
    assert probes.probe_attention_rows(16, torch.float32, "meta").counts == probes.ROWS
    assert len(seen) > 2 * len(probes.ROWS) and set(seen) == {("meta", "meta")}
    monkeypatch.undo()

    class CallMean(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(dim=-2, keepdim=True)

    ok, why = probes.probe_rows(CallMean(), 16, torch.float32, "cpu", 1)
    assert not ok and "row 0 alone differs" in why


def test_the_suite_keeps_its_probe_verdicts_in_a_folder_of_its_own():
    """conftest.py points `KVDIRECT_PROBE_CACHE` at a folder made empty for this run, so no test reads verdicts an
    earlier run on this machine left behind, and none are written to the user's cache.  Fails where conftest.py
    stops setting it (the default folder is under ~/.cache)."""
    from ..conftest import PROBE_FOLDER
    from ..runs import tiny

    if PROBE_FOLDER is None:
        pytest.skip("KVDIRECT_PROBE_CACHE was set by hand")
    assert os.environ["KVDIRECT_PROBE_CACHE"] == PROBE_FOLDER
    path = tiny("tiny-llama").probes.path
    assert path is not None and Path(PROBE_FOLDER) in path.parents
