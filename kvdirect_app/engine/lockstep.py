"""Every forward of one engine step in one pass through the model, bit for bit as if run one after another.

A decode step on a CPU is bound by reading the model's weights; lanes (the
full cache, each strategy, each teacher-forced twin) that go through a layer
together read its weights once.  `run_batch` stacks the lanes' tokens as a
batch of N rows and runs the model once, keeping every row's computation
exactly what it would be alone:

* invariant kernels (`kernels.py`): every `F.linear` is one GEMM over all
  N rows, raised to a row count the probe proved invariant (a prompt's rows
  once per distinct lane); native kernels: each row as its own GEMM: one
  token per row (decoding), one `bmm` with each row a batch element, where
  a check proved it bit-equal to a one-row call here (a loop otherwise);
  several tokens per row (a prompt), one GEMM per row, and once only for
  rows that are bit-identical (lanes that have not diverged: the first
  prompt is the same for all);
* each lane's cache gets its own row of K/V (`update`), its own attention
  input and residual (the input tap), and runs its own rebuilding, replay
  and scoring, as it would alone;
* attention, in a decode step under the fixed-order kernels, is one call for
  every row at a layer (`_decode_in_one_call`): each (row, head) one task
  computed as the row's own call would, with the row's K/V, the call's time
  charged to the rows by the keys each reads; otherwise it is each row's own
  call, timed as that row's, with the row's K/V: the model's own attention
  function with the mask the model builds for that row's cache (native; the
  layer's config points at a registered function, `kvdirect_lanes`, for the
  pass, under the model's lock; a layer holding fewer tokens than its type's
  first takes the mask's rightmost columns, `fit_mask`), or the invariant
  attention, whose bits for a query do not depend on the call it is in;
* norms, RoPE (positions are per row), activations and residual adds work
  row by row;
* a scored layer that reads attention (H2O, TOVA, SnapKV) is handed its
  row's queries as the pass computed them (`_settle`): its update is split
  into `add` (the candidates, for attention) and `settle(queries)` (scores,
  eviction) instead of rebuilding the queries from the attention input; the
  same function of the same inputs, so the same bits.

Timing and memory: what a row does alone (its cache's work, its attention,
its setup) runs in a region of its owner (`observe.Observer.region`), timed
there and allocating as that owner's; the rest of the pass (the linears,
norms, embedding and head over all rows) is the shared pass's region, whose
time the caller charges by rows: 1/N to each of the N rows (a row is one
forward, and every row of a pass has the same token count).  The comparison
with the full cache and the attention snapshot are instruments' regions.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.invariant import Kernels, native_now
from ..kernels.replay import linear_rows
from ..measure.observe import ENGINE, SHARED, Observer, Owner, instrument
from ..models import compat
from ..strategies import StrategyCache
from ..strategies.scored import ScoredLayer
from ..strategies.scored_attention import attention_probs, fit_mask

LANES_IMPLEMENTATION = "kvdirect_lanes"
_LOCAL = threading.local()  # .batch: the Batch in progress on this thread
_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its nn.Linear modules


@dataclass
class Row:
    """One forward of the batch: a lane's cache (or its twin's) and the tokens it is fed."""

    owner: Owner
    cache: StrategyCache
    ids: list[int]
    seen: int = 0
    more_prompt: bool = False  # a piece of a turn's prompt, more pieces follow
    keep: bool = False  # nothing is evicted in this forward (`strategies.base.Forward.keep`)
    masks: dict = field(default_factory=dict)  # layer type -> the mask the model builds for this cache alone
    kv: dict = field(default_factory=dict)  # layer -> the K/V this cache handed attention
    logits: torch.Tensor | None = None
    snapshot: bool = False  # keep the last query's attention at every layer (`attention`): an instrument's work
    handed: dict = field(default_factory=dict)  # layer -> (1, G, T) positions of the K/V handed attention
    attention: dict = field(default_factory=dict)  # layer -> (handed (end,) bool, probs (end,) fp32)


@dataclass
class Batch:
    rows: list[Row]
    observer: Observer
    attention: Callable  # the model's own attention function
    layer_types: list[str]
    kernels: Kernels

    def owned(self, i: int, op: str):
        """Row i's own work, op `op`: a region of its owner."""
        return self.observer.region(self.rows[i].owner, op)


class _LaneLayer(compat.CacheLayerMixin):
    """Layer `j` of the batch's cache: hands each row's K/V to that row's cache layer."""

    def __init__(self, batch: Batch, j: int, sliding: bool):
        super().__init__()
        self.batch, self.j, self.is_sliding = batch, j, sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """Each row's K/V to its cache layer; a scored layer that reads attention only adds them here and is settled
        with the pass's queries (`_settle`, when the attention function is called)."""
        for i, row in enumerate(self.batch.rows):
            layer = row.cache.layers[self.j]
            with self.batch.owned(i, "cache_update"):
                # A copy: each cache gets a tensor of its own, as its own forward would have given it.
                k, v = key_states[i : i + 1].clone(), value_states[i : i + 1].clone()
                split = isinstance(layer, ScoredLayer) and layer.takes_queries
                row.kv[self.j] = layer.add(k, v) if split else layer.update(k, v)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.rows[0].cache.layers[self.j].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.batch.rows[0].cache.layers[self.j].get_seq_length()

    def get_max_length(self) -> int:
        return -1


class LaneCache(compat.Cache):
    """The cache the model sees during a batched pass: a facade over the rows' caches."""

    def __init__(self, batch: Batch):
        super().__init__(
            layers=[_LaneLayer(batch, j, t == "sliding_attention") for j, t in enumerate(batch.layer_types)]
        )


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.shape == b.shape and torch.equal(a, b))


def lanes_attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention function.  A decode step under the fixed-order kernels: every row in one call
    (`_decode_in_one_call`).  Otherwise each row's attention in a call of its own, with that row's K/V (and,
    native, its mask), in that row's region: no lane waits in another lane's call or is padded to its keys.

    Invariant kernels: the fixed-order attention (a query's bits depend only on it and the keys it sees, so a lane's
    call gives what it would alone); native: the model's own function.  With several tokens per row (a
    prompt), a row whose query, K/V and mask are bit-identical to an earlier row's (lanes that have not
    diverged) reuses that row's output: the same call would give the same bits."""
    batch: Batch = _LOCAL.batch
    j = module.layer_idx
    q = query.shape[2]
    _settle(batch, j, query)
    if q == 1 and batch.kernels.lanes_in_one_call:
        return _decode_in_one_call(batch, module, query, j, kwargs), None
    layer_type = batch.layer_types[j]
    outputs, done, weights = [], [], None
    block = batch.kernels.invariant
    for i, row in enumerate(batch.rows):
        # The lane's time; its workspace and output are activations, the shared pass's (a prompt's rows that reuse
        # an earlier row's output allocate nothing: the lane that computed it would otherwise carry it alone).
        with batch.observer.region(row.owner, "attention", memory=SHARED):
            k, v = row.kv.pop(j)
            mask = None if block else fit_mask(row.masks[layer_type], k.shape[-2], row.cache.strategy.label, j)
            out = None
            if q > 1:
                out = next(
                    (
                        o
                        for (qr, kr, vr, mr, o) in done
                        if torch.equal(qr, query[i]) and _same(kr, k) and _same(vr, v) and _same(mr, mask)
                    ),
                    None,
                )
            if out is None:
                # Every cache hands attention its keys in position order, the queries the last q of them and every
                # earlier key before them (an eviction cache's kept keys too: the mask the model would build says
                # the same), so the invariant attention reads them as positions end-T .. end-1.
                if block:
                    out = batch.kernels.attention(
                        query[i],
                        k[0],
                        v[0],
                        row.seen + q,
                        kwargs.get("scaling", module.scaling),
                        kwargs.get("softcap"),
                        kwargs.get("sliding_window"),
                    ).unsqueeze(0)
                else:
                    out, weights = batch.attention(module, query[i : i + 1], k, v, mask, **kwargs)
                if q > 1:
                    done.append((query[i], k, v, mask, out))
            outputs.append(out)
        if row.snapshot:
            _snapshot(batch.observer, row, j, query[i : i + 1], k, module, kwargs)
        with batch.owned(i, "attention"):  # what it handed attention (a rebuilt buffer) dropped as its own
            del k, v
    return torch.cat(outputs, dim=0), weights


def _settle(batch: Batch, j: int, query: torch.Tensor):
    """Layer j of every row, its K/V added: a scored layer added only (`_LaneLayer.update`) scores its candidates
    with its row's queries as the pass computed them (`ScoredLayer.settle`: no query rebuilt, the same bits) and
    keeps the best, in the row's region as its update; then the instruments read what each row handed attention."""
    observer = batch.observer
    for i, row in enumerate(batch.rows):
        layer = row.cache.layers[j]
        if getattr(layer, "adding", None) is not None:
            with batch.owned(i, "cache_update"):
                layer.settle(query[i : i + 1])
        observer.compare(row.owner, j, layer, *row.kv[j])
        if row.snapshot:
            row.handed[j] = observer.handed.pop(id(layer), None)


LANES_ATTENTION = "lanes' attention"  # the shared pass's op of a decode layer's one attention call for every lane


def _decode_in_one_call(batch: Batch, module, query: torch.Tensor, j: int, kwargs) -> torch.Tensor:
    """A decode step's attention at layer j for every row in one call of the fixed-order attention
    (`Kernels.attention_lanes`): each (row, head) is one task computed as the row's own call would compute it,
    with that row's K/V, so every row's bits are those of its own call.  The call's time is charged to the rows'
    owners as their attention, each its share by the keys it reads (the work of a task); its workspace and output
    are activations, the shared pass's.  The K/V a row handed attention (a rebuilt buffer) are dropped after the
    call: the CPU's ledger and the trace untag a block wherever it is freed (this call runs on the CPU only)."""
    rows, observer = batch.rows, batch.observer
    keys, values = [], []
    for row in rows:
        k, v = row.kv.pop(j)
        keys.append(k[0])
        values.append(v[0])
    part = (SHARED, LANES_ATTENTION)
    before = observer.parts.get(part, 0.0)
    with observer.region(SHARED, LANES_ATTENTION):
        out = batch.kernels.attention_lanes(
            query,
            keys,
            values,
            [row.seen + 1 for row in rows],
            kwargs.get("scaling", module.scaling),
            kwargs.get("softcap"),
            kwargs.get("sliding_window"),
        )
    spent = observer.parts[part] - before
    work = [k.shape[-2] for k in keys]
    for row, w in zip(rows, work):
        observer.charge(part, (row.owner, "attention"), spent * w / sum(work))
    for i, row in enumerate(rows):
        if row.snapshot:
            _snapshot(observer, row, j, query[i : i + 1], keys[i][None], module, kwargs)
    return out


def last_query_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    end: int,
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of the last query (at position end - 1) over the positions 0 .. end - 1, heads averaged.

    query (1, H, q, d_h), keys (1, n_kv, T, d_h), positions (1, G, T) original positions of the keys (G 1 or
    n_kv).  Returns handed (end,) bool (a position some head was handed) and probs (end,) fp32: the mean over
    the H query heads of softmax(q k^T * scaling) (softcapped, a sliding layer's window applied), 0 where a
    head was not handed the position; each head's row sums to 1, so probs does.
    """
    n_kv = keys.shape[1]
    query_at = torch.tensor([end - 1], device=keys.device)
    # Every key handed is at or before the query: only a window masks.
    probs = attention_probs(query[:, :, -1:], keys, query_at, positions, scaling, softcap, window, causal=False)
    probs = probs.mean(dim=2)[0, :, 0]  # (n_kv, T): each KV head's group of query heads averaged
    pos = positions.long().expand(1, n_kv, positions.shape[-1])
    visible = (pos <= end - 1) if window is None else (pos <= end - 1) & (pos > end - 1 - window)
    out = torch.zeros(end, dtype=torch.float32, device=keys.device)
    out.index_add_(0, pos[0].flatten(), probs.flatten() / n_kv)
    handed = torch.zeros(end, dtype=torch.bool, device=keys.device)
    handed[pos[0][visible[0]]] = True
    return handed, out


def _snapshot(observer: Observer, row: Row, j: int, query: torch.Tensor, k: torch.Tensor, module, kwargs):
    """Row's last query's attention at layer j (an instrument's work: no lane's bytes, no lane's time).  The
    positions of the keys handed to attention: the candidates' for an eviction layer (kept by the observer's
    scoring seam), else the last `T` positions."""
    with observer.region(instrument("snapshot"), "snapshot"):
        observer.counts["snapshot"] += 1
        end = row.seen + query.shape[2]
        handed = row.handed.pop(j, None)
        if handed is None:
            handed = torch.arange(end - k.shape[-2], end, device=k.device).view(1, 1, -1)
        row.attention[j] = last_query_attention(
            query,
            k,
            handed,
            end,
            kwargs.get("scaling", module.scaling),
            kwargs.get("softcap"),
            kwargs.get("sliding_window"),
        )


def _unique_rows(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows of x (N, ...) by first occurrence: (indices of distinct rows, for each row its distinct index).
    Used for prompts, where a row is many tokens and computing it twice costs far more than comparing."""
    firsts, where = [], []
    for i in range(x.shape[0]):
        for k, f in enumerate(firsts):
            if torch.equal(x[i], x[f]):
                where.append(k)
                break
        else:
            where.append(len(firsts))
            firsts.append(i)
    return firsts, where


def _rows_forward(linear: torch.nn.Linear, n: int, x: torch.Tensor) -> torch.Tensor:
    """`linear` over the batch's N rows: each distinct row once, each as its own GEMM.  Any other input (a
    replay inside a lane's cache runs the same modules on one row) goes to the layer's own `F.linear`."""
    weight, bias = linear.weight, linear.bias
    if n == 1:  # a pass of one row is the model's own forward
        return F.linear(x, weight, bias)
    if x.dim() == 3 and x.shape[0] == n:
        if x.shape[1] == 1:  # decode: one row per lane, one weight read for all of them
            return linear_rows(weight, bias, x[:, 0]).unsqueeze(1)
        firsts, where = _unique_rows(x)
        distinct = torch.cat([F.linear(x[i : i + 1], weight, bias) for i in firsts])
        return distinct if len(firsts) == n else distinct[where]
    return F.linear(x, weight, bias)


def _invariant_forward(kernels: Kernels, linear: torch.nn.Linear, n: int, x: torch.Tensor) -> torch.Tensor:
    """`linear` in the invariant mode: every row of x in one call of the run's kernels (`Kernels.linear`); a prompt's
    rows once per distinct lane (lanes that have not diverged share their first prompt).  Inside `kernels.native()`
    (a fast-mode rebuild), the model's own GEMM."""
    if native_now():
        return F.linear(x, linear.weight, linear.bias)
    if x.dim() == 3 and x.shape[0] == n > 1 and x.shape[1] > 1:
        firsts, where = _unique_rows(x)
        if len(firsts) < n:
            return kernels.linear(x[firsts], linear.weight, linear.bias)[where]
    return kernels.linear(x, linear.weight, linear.bias)


@contextlib.contextmanager
def batch_linears(model: torch.nn.Module, n: int, kernels: Kernels):
    """Every `nn.Linear` of the model computes for the pass (an instance `forward`, removed after): in the
    invariant mode all rows as GEMMs of proven row counts, in the native mode each row as its own GEMM.
    Per module rather than a `TorchFunctionMode`: a mode sees every torch call of the pass (~10,000 per
    SmolLM2 step, ~20 ms of Python), the modules see only their own ~200."""
    linears = _LINEARS.get(model)
    if linears is None:  # found once per model, not at every step
        linears = _LINEARS[model] = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.forward = (
            functools.partial(_invariant_forward, kernels, m, n)
            if kernels.invariant
            else functools.partial(_rows_forward, m, n)
        )
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def run_batch(model: torch.nn.Module, rows: list[Row], observer: Observer, tap, device, kernels: Kernels):
    """One pass of the model over every row (all with the same number of tokens); sets each row's logits (V,).
    The pass's own work is the shared pass's region (`observe.SHARED`); each row's setup, cache work and attention
    are regions of its owner.  The caller holds the model's lock and has pinned the threads."""
    q = len(rows[0].ids)
    config = compat.text_config(model.config)
    attn = compat.attention_module(compat.decoder_layers(model)[0])
    batch = Batch(
        rows, observer, compat.attention_function(attn), [s.layer_type for s in compat.layer_specs(config)], kernels
    )
    ids = torch.tensor([row.ids for row in rows], device=device)
    positions = torch.stack([torch.arange(row.seen, row.seen + q, device=device) for row in rows])
    like = torch.zeros(1, q, 1, device=device, dtype=next(model.parameters()).dtype)
    observer.keep_handed = {id(layer) for row in rows if row.snapshot for layer in row.cache.layers}
    for i, row in enumerate(rows):
        with batch.owned(i, "other"):
            row.cache.begin_step(row.ids, row.more_prompt, row.keep)
            for t in () if kernels.invariant else set(batch.layer_types):  # the invariant attention needs no mask
                row.masks[t] = compat.mask_function(t)(
                    config=config,
                    inputs_embeds=like,
                    attention_mask=None,
                    cache=row.cache,
                    position_ids=positions[i : i + 1],
                )
    compat.register_attention(LANES_IMPLEMENTATION, lanes_attention)
    tap.target_rows(batch)
    _LOCAL.batch = batch
    try:
        with (
            observer.region(SHARED, "pass"),
            compat.attention_implementation(attn.config, LANES_IMPLEMENTATION),
            batch_linears(model, len(rows), kernels),
            kernels.applied(),
        ):
            logits = compat.forward_rows(model, ids, LaneCache(batch), positions)
    finally:
        _LOCAL.batch = None
        observer.keep_handed, observer.handed = set(), {}
    for i, row in enumerate(rows):
        with batch.owned(i, "other"):
            row.cache.end_step()
            row.masks = {}  # freed inside the row's region, like every other part of its forward
        with observer.region(ENGINE, "logits"):  # the engine's copy of the row's logits: the engine's bytes
            row.logits = logits[i].clone()
