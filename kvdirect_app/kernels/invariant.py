"""Batch-invariant kernels: a row's bits do not depend on which call computed it (docs/measurement.md, "Kernels").

Two modes for a run (`--kernels`):

* ``invariant`` (the default wherever it runs): every linear layer of every
  lane, the reference included, is one call over all the rows that need it:
  on the CPU the fixed-order linears (`dots.py`: every output one dot
  product in one order, threads splitting the output columns, so a row's
  bits are the same whatever the call, by construction; a check confirms it
  at start); on another device the vendor's GEMM at row counts (`probe_verdicts.ROWS`)
  that the probe proved invariant on that device, dtype and thread count,
  zero rows added; attention is `block_attention` (keys in fixed blocks of 64
  anchored at position 0, an exact maximum, per-block sums and P@V of fixed
  shapes combined by a sequential cumulative sum, masked keys exact zeros),
  computed on one thread whatever the run's count (`threads.one_thread`), so
  the order of every one of its reductions is fixed by the shapes alone; the
  same for a one-token step, a prompt and a replay of any number of old
  tokens.  So a rebuild or replay may group rows any way it likes: KV-Direct
  rebuilds all old K/V with one call per layer, AnchorKV replays each layer
  once over all old tokens, and the lanes of a step share one call per
  linear, which reads the weights once (each lane's attention is its own
  call, timed as its own).
* ``native``: the model's own kernels; exactness comes from repeating the
  original shapes (`replay.py`, `row_replay.py`: each decoded token as its own row).
  Bit-equal to transformers' own one-row decode.

`Kernels.for_model` checks, outside any timed or traced region, the
fixed-order linears for each input width of the model (or, off the CPU,
proves every linear layer's row counts at the run's thread count and its
large call at one thread), the block attention's row counts and its
one-query/many-queries equality for each attention geometry of the model,
and the model's RMSNorm rows, at every start; the GEMM verdicts are kept on
disk, and a stored one that the probe does not find here is said
(`file_notes`).  A failed check or probe, or fixed-order linears that cannot
be built here, means ``native``, said aloud in the run's JSON (`kernels`),
the CLI's first lines and the page.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models import compat
from ..models.probe_verdicts import ROWS, Verdict, attention_rows_key, dtype_name, linear_key
from ..models.threads import one_thread
from ..plain.errors import UserError
from . import dots, probes

MODES = ("invariant", "native")
BLOCK = probes.BLOCK  # keys per attention block, blocks anchored at absolute position 0
# The block attention works on as many query rows at once as keep its score buffer within this: a replay's
# transient is about two such buffers (scores/probabilities in place, then the blocks' P@V), which AnchorKV's
# peak during a turn shows, so it stays small next to the K/V a replay rebuilds.
ATTENTION_ROWS_BYTES = 1 << 20


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    end: int,
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
    rows: Verdict | None = None,
) -> torch.Tensor:
    """Causal attention whose bits for a query depend only on that query and the keys it sees.

    query (H, q, d): the last q positions end-q .. end-1; key, value (Hkv, T, d): positions end-T .. end-1
    (a cache hands attention its keys up to and including the queries).  `window`: a sliding layer sees keys
    after position p - window.  `rows`: the proven row counts of its GEMMs (`probes.probe_attention_rows`),
    each GEMM's rows raised to one (None: as they come, for tests).  Returns (q, H, d).

    The keys are laid out in blocks of `BLOCK` anchored at absolute position 0 (masked keys fill the first
    and last block).  Per block, the scores of the rows (a KV head's query heads, query by query) are one GEMM
    of fixed width (rows raised to a proven count); the maximum over the visible keys is exact; a masked key's
    probability is an exact zero; each block's sum and P@V are fixed-shape reductions, combined over the
    blocks by a sequential cumulative sum, to which blocks after a query's last visible one add exact zeros.
    Queries are taken a chunk at a time, each chunk over the blocks up to its last query.  Everything runs on one
    thread (`threads.one_thread`): no reduction's order depends on a thread count or on scheduling.
    """
    with one_thread():
        return _block_attention(query, key, value, end, scaling, softcap, window, rows)


def _block_attention(query, key, value, end, scaling, softcap, window, proven) -> torch.Tensor:
    heads, q, d = query.shape
    kv_heads, t, _ = key.shape
    group = heads // kv_heads
    first = end - t  # absolute position of the first key
    lead = first % BLOCK
    blocks = -(-(lead + t) // BLOCK)
    tail = blocks * BLOCK - lead - t
    k = F.pad(key.float(), (0, 0, lead, tail)).view(kv_heads, blocks, BLOCK, d)
    v = F.pad(value.float(), (0, 0, lead, tail)).view(kv_heads, blocks, BLOCK, d)
    key_pos = torch.arange(first - lead, first - lead + blocks * BLOCK, device=query.device).view(blocks, BLOCK)
    key_ok = (key_pos >= first) & (key_pos < end)
    rows = query.view(kv_heads, group, q, d)
    out = query.new_empty(q, heads, d)
    chunk = max(1, ATTENTION_ROWS_BYTES // (group * blocks * BLOCK * 4 * kv_heads), 4 // group)
    chunk = min(chunk, max(1, (proven.largest if proven is not None else ROWS[-1]) // group))  # within proven counts
    for s in range(0, q, chunk):
        n = min(chunk, q - s)
        last = end - q + s + n - 1  # the chunk's last query position
        used = (last - (first - lead)) // BLOCK + 1  # blocks up to it
        r = (rows[:, :, s : s + n].float() * scaling).reshape(kv_heads, 1, group * n, d)
        m = group * n
        padded = proven.pad(m) if proven is not None else m
        if padded != m:
            r = F.pad(r, (0, 0, 0, padded - m))
        scores = torch.matmul(r.expand(kv_heads, used, padded, d), k[:, :used].transpose(2, 3))  # (Hkv, b, p, 64)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if n == 1 and last == end - 1 and window is None:
            # One query at the last position (a decode step), the pad rows seeing what it sees: a key is visible
            # where it is one of the call's keys, which key_ok says already (the same mask, five ops fewer).
            visible = key_ok[:used, None, :]
        else:
            qpos = torch.arange(last - n + 1, last + 1, device=query.device).repeat(group)
            if padded != m:
                qpos = torch.cat([qpos, qpos[-1:].expand(padded - m)])  # pad rows see what the last query sees
            kp = key_pos[:used, None, :]
            visible = key_ok[:used, None, :] & (kp <= qpos[None, :, None])
            if window is not None:
                visible &= kp > qpos[None, :, None] - window
        # In place from here (the same arithmetic as out of place, one buffer fewer alive).
        scores.masked_fill_(~visible, float("-inf"))
        top = scores.amax(dim=(1, 3), keepdim=True)
        p = scores.sub_(top).exp_()  # masked: exp(-inf) = exact 0
        del scores
        sums = p.sum(dim=-1).cumsum(dim=1)[:, -1]  # (Hkv, padded)
        o = torch.matmul(p, v[:, :used])
        del p
        o = o.cumsum_(dim=1)[:, -1] / sums[..., None]  # (Hkv, padded, d)
        out[s : s + n] = o[:, :m].reshape(heads, n, d).transpose(0, 1)
    return out


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("kvdirect_kernels", default=None)
_NATIVE: contextvars.ContextVar = contextvars.ContextVar("kvdirect_native", default=False)
INVARIANT_ATTENTION = "kvdirect_invariant"


def active() -> "Kernels | None":
    """The kernels of the pass in progress in this context (set by `Kernels.applied`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def native():
    """Inside: the model's own kernels, whatever the run's (`mode=fast`: one call over all old tokens, with the
    model's GEMM and attention, so that its error against the exact rebuild is the regrouping's, measured)."""
    token = _NATIVE.set(True)
    try:
        yield
    finally:
        _NATIVE.reset(token)


def native_now() -> bool:
    return _NATIVE.get()


def invariant_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """The registered attention function of the invariant mode (a model's layers call it by name): the block
    attention, the queries ending at the call's last position."""
    kernels = active()
    end = int(kwargs["position_ids"][0, -1]) + 1
    out = kernels.attention(
        query[0], key[0], value[0], end, scaling if scaling is not None else module.scaling, softcap, sliding_window
    )
    return out.unsqueeze(0), None


@dataclass
class Kernels:
    """The kernels of one run on one model: the mode, the linears, the probe's verdicts, the attention.

    `for_model` checks the fixed-order linears (CPU) or proves every linear layer's shape (elsewhere), and proves
    each attention geometry and each row-wise norm of the model (once per model and thread count: the verdicts live
    on the loaded model's `probe_verdicts.Store`, the GEMMs' on disk too); any failure means ``native``, and
    `reason` says why.
    """

    mode: str
    threads: int
    requested: str = "invariant"
    reason: str | None = None  # why `native` where `invariant` was asked for
    store: object = None  # the loaded model's probe_verdicts.Store
    dots: str | None = None  # the fixed-order linears' path (CPU: "avx512", "avx2", "scalar"); None: probed GEMMs
    linears: dict = field(default_factory=dict)  # off the CPU: (weight shape, bias) -> Verdict at `threads`
    rows: Verdict | None = None  # the block attention's GEMMs

    @property
    def invariant(self) -> bool:
        return self.mode == "invariant"

    @property
    def torch_threads(self) -> int:
        """torch's own intra-op thread count in this run's forwards: 1 where the fixed-order kernels compute every
        linear and the attention with the run's `threads` (their team never waits for a helper whose core another
        process holds; torch's OpenMP barrier would: `threads.pin`), else the run's.  No bit depends on it: the
        fixed-order kernels' bits do not depend on a thread count, and the rest of the invariant forward gives the
        same bits at 1 and at the run's count (`probes`, `scripts/exactness_fresh.py`)."""
        return 1 if self.invariant and self.dots is not None else self.threads

    @property
    def verdicts(self) -> dict:
        return self.store.verdicts if self.store is not None else {}

    @classmethod
    def for_model(cls, loaded, mode: str, threads: int) -> "Kernels":
        if mode not in MODES:
            raise UserError(f"kernels: {str(mode)[:40]!r} is not allowed; allowed: {', '.join(MODES)}")
        kernels = cls("native", threads, requested=mode, store=loaded.probes)
        if mode == "invariant":
            kernels.reason = kernels._probe(loaded.model, loaded.device, loaded.dtype)
            kernels.mode = "invariant" if kernels.reason is None else "native"
        return kernels

    # --- the probe ---------------------------------------------------------------------------------------
    def _linear_verdict(self, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Verdict:
        return self.store.get(
            linear_key(weight, bias, threads), lambda: probes.probe_linear(weight, bias, threads), keep=True
        )

    def _linears(self, model, device, dtype) -> str | None:
        """The fixed-order linears on the CPU (checked for each input width: `check_dots`), else every linear
        layer's proven GEMM row counts; None where they hold."""
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        if torch.device(device).type == "cpu":
            why = dots.unavailable(dtype, device)
            if why is not None:
                return f"fixed-order linears: {why}"
            self.dots = dots.path()
            for k, bias in sorted({(m.in_features, m.bias is not None) for m in layers}):
                key = ("dots", k, bias, dtype_name(dtype), self.dots, self.threads)
                ok, why = self.store.get(key, lambda: probes.check_dots(k, bias, dtype, self.dots, self.threads))
                if not ok:
                    return f"fixed-order linears: {why}"
            return None
        # Each count proven at this thread count gives a large call's rows, and the large call has the same bits at
        # one thread: so K/V computed here equal those a run at another proven thread count computes (the chain
        # through the large call), and a later run at 1 thread proves its own counts when it starts.
        for m in layers:
            v = self._linear_verdict(m.weight, m.bias, self.threads)
            if not v.counts:
                return (
                    f"no row count of a {tuple(m.weight.shape)} GEMM ({', '.join(map(str, v.failed))}) gives the "
                    f"rows of a large call here at {self.threads} thread(s)"
                )
            if not v.across_threads:
                return f"a {tuple(m.weight.shape)} GEMM gives other bits at 1 thread than at {self.threads}"
            self.linears[(tuple(m.weight.shape), m.bias is not None)] = v
        return None

    def _probe(self, model, device, dtype) -> str | None:
        """None when every kernel of the model passed its check or probe at this thread count and across counts."""
        why = self._linears(model, device, dtype)
        if why is not None:
            return why
        for m in model.modules():
            name = type(m).__name__
            if name.endswith("RMSNorm") and getattr(m, "weight", None) is not None:
                key = ("rows", name, tuple(m.weight.shape), dtype_name(dtype), str(device), self.threads)
                ok, why = self.store.get(
                    key, lambda: probes.probe_rows(m, m.weight.shape[-1], dtype, device, self.threads)
                )
                if not ok:
                    return f"row-wise reduction: {why}"
        cfg = compat.text_config(model.config)
        seen = set()
        for spec in compat.layer_specs(model.config):
            attn = compat.attention_module(compat.decoder_layers(model)[spec.index])
            geometry = (
                cfg.num_attention_heads,
                getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
                attn.head_dim,
                spec.sliding_window,
                getattr(attn, "attn_logit_softcapping", None),
            )
            if geometry in seen:
                continue
            seen.add(geometry)
            if self.dots is None:  # the block attention's GEMMs (off the CPU)
                rows = self.store.get(
                    attention_rows_key(attn.head_dim, dtype, device),
                    lambda: probes.probe_attention_rows(attn.head_dim, dtype, device),
                    keep=True,
                )
                if not rows.counts:
                    return (
                        f"the block attention's GEMMs have no invariant row count here "
                        f"({', '.join(map(str, rows.failed))})"
                    )
                group = geometry[0] // geometry[1]
                if group > rows.largest:
                    return f"{group} query heads per key head: more rows than the attention's largest proven count"
                self.rows = rows
            key = ("block attention", geometry, dtype_name(dtype), str(device), self.threads)
            ok, why = self.store.get(
                key,
                lambda: probes.probe_attention(
                    self.attention, *geometry[:3], dtype, device, self.threads, window=geometry[3], softcap=geometry[4]
                ),
            )
            if not ok:
                return f"{'fixed-order' if self.dots else 'block'} attention: {why}"
        return None

    # --- the kernels -------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear` over every row of x (..., d): the fixed-order linears in one call (CPU), else GEMMs of proven
        row counts, zero rows added, cut into calls of the largest proven count (only at the thread count the
        verdicts were proven for)."""
        if self.dots is not None:
            return dots.linear(x, weight, bias, name=self.dots)
        verdict = self.linears.get((tuple(weight.shape), bias is not None))
        if verdict is None:
            raise RuntimeError(f"invariant kernels: a {tuple(weight.shape)} GEMM that was not probed")
        if torch.get_num_threads() != self.threads:
            raise RuntimeError(
                f"invariant kernels: a GEMM at {torch.get_num_threads()} threads; proven at "
                f"{self.threads} (pin the threads first)"
            )
        rows = x.reshape(-1, x.shape[-1])
        split = verdict.largest
        parts = []
        for s in range(0, rows.shape[0], split):
            part = rows[s : s + split]
            m = part.shape[0]
            size = verdict.pad(m)
            parts.append(F.linear(F.pad(part, (0, 0, 0, size - m)) if size != m else part, weight, bias)[:m])
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(*x.shape[:-1], weight.shape[0])

    def _rows(self, query: torch.Tensor) -> Verdict:
        if self.rows is None or self.rows.key != attention_rows_key(query.shape[-1], query.dtype, query.device):
            self.rows = self.store.get(
                attention_rows_key(query.shape[-1], query.dtype, query.device),
                lambda: probes.probe_attention_rows(query.shape[-1], query.dtype, query.device),
                keep=True,
            )
        return self.rows

    def attention(self, query, key, value, end: int, scaling: float, softcap=None, window=None) -> torch.Tensor:
        """The fixed-order attention (CPU: `dots.attention`), else `block_attention` with this device's proven row
        counts; query (H, q, d) -> (q, H, d)."""
        if self.dots is not None:
            return dots.attention(query, key, value, end, scaling, softcap, window, name=self.dots)
        return block_attention(query, key, value, end, scaling, softcap, window, rows=self._rows(query))

    @property
    def lanes_in_one_call(self) -> bool:
        """Whether a decode pass's lanes take their attention at a layer in one call (`attention_lanes`): the
        fixed-order attention, whose tasks are each one (lane, query, head) computed as that lane's own call would."""
        return self.invariant and self.dots is not None

    def attention_lanes(self, query, keys, values, ends, scaling: float, softcap=None, window=None) -> torch.Tensor:
        """`dots.attention_lanes`: query (N, H, q, d), each lane's keys and values (Hkv, T_i, d) -> (N, q, H, d)."""
        return dots.attention_lanes(query, keys, values, ends, scaling, softcap, window, name=self.dots)

    @contextlib.contextmanager
    def applied(self):
        """Inside: this run's kernels are the active ones (the invariant attention and the replays read them)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def report(self) -> dict:
        """For the run's JSON: the mode, why not invariant where it was asked for, and the probe's verdicts."""
        threads = {self.threads, 1}
        verdicts = self.verdicts
        return {
            "mode": self.mode,
            "requested": self.requested,
            "reason": self.reason,
            "threads": self.threads,
            "linears": "fixed-order" if self.dots is not None else "probed GEMM",
            "dots_path": self.dots,
            "dots_checks": [
                {
                    "width": k[1],
                    "bias": k[2],
                    "dtype": k[3],
                    "instructions": k[4],
                    "threads": k[5],
                    "same_bits": v[0],
                    "why_not": v[1],
                }
                for k, v in verdicts.items()
                if k[0] == "dots" and k[5] == self.threads
            ],
            "rows": list(ROWS),
            "probe_file": None if self.store is None or self.store.path is None else str(self.store.path.name),
            "file_confirmed": 0 if self.store is None else self.store.confirmed,
            "file_notes": [] if self.store is None else list(self.store.notes),
            "probes": [
                {
                    "shape": list(v.key[1]),
                    "bias": v.key[2],
                    "dtype": v.key[3],
                    "device": v.key[4],
                    "threads": v.key[5],
                    "proven": list(v.counts),
                    "failed": list(v.failed),
                    "across_threads": v.across_threads,
                }
                for k, v in verdicts.items()
                if k[0] == "linear" and k[5] in threads
            ],
            "attention_probes": [
                {
                    "heads": k[1][0],
                    "kv_heads": k[1][1],
                    "head_dim": k[1][2],
                    "window": k[1][3],
                    "softcap": k[1][4],
                    "threads": k[4],
                    "same_bits": v[0],
                    "why_not": v[1],
                }
                for k, v in verdicts.items()
                if k[0] == "block attention" and k[4] in threads
            ],
        }


def brief(report: dict) -> str:
    """The same in a few words, for the page's status line."""
    if report["mode"] == "invariant":
        stale = (
            " · the probe file disagreed with the probe here: its verdicts replaced" if report.get("file_notes") else ""
        )
        linears = f"fixed-order linears ({report['dots_path']})" if report.get("dots_path") else "probed GEMMs"
        return f"kernels: invariant ({linears}; checks passed at {report['threads']} thread(s)){stale}"
    if report["requested"] == "invariant":
        return f"kernels: NATIVE, the invariance probe failed here: {report['reason']}"
    return "kernels: native"


def describe(report: dict) -> str:
    """A run's kernels (`Kernels.report()`) in one line, for the CLI's first lines and the page."""
    if report["mode"] == "invariant":
        if report.get("dots_path"):
            linears = (
                f"every linear and the attention the fixed-order dot products ({report['dots_path']} path, "
                "invariant by construction; checked)"
            )
        else:
            smallest = sorted({p["proven"][0] for p in report["probes"] if p["threads"] == report["threads"]})
            linears = (
                f"every linear one GEMM of a proven row count (from {', '.join(map(str, smallest))} rows), "
                "block attention on one thread"
            )
        return (
            f"kernels: invariant (checks passed at {report['threads']} thread(s) and across thread counts: {linears})"
        )
    if report["requested"] == "invariant":
        return f"kernels: NATIVE: the invariance probe failed here: {report['reason']}"
    return "kernels: native (asked for: the model's own kernels; exact replay repeats the original shapes)"
