"""Batch-invariant kernels: a row's bits do not depend on which call computed it (DESIGN.md, "Batch invariance").

Two modes for a run (`--kernels`):

* ``invariant`` (the default wherever the probe passes): every linear layer
  of every lane, the reference included, is one GEMM over all the rows that
  need it, its row count raised with zero rows to a count the probe proved
  invariant on this device, dtype and thread count; attention is
  `block_attention` (keys in fixed blocks of 64 anchored at position 0, an
  exact maximum, per-block sums and P@V of fixed shapes combined by a
  sequential cumulative sum, masked keys exact zeros), the same for a
  one-token step (all lanes' queries in one call: `lanes_block_attention`),
  a prompt and a replay of any number of old tokens.  So a
  rebuild or replay may group rows any way it likes: KV-Direct rebuilds all
  old K/V with one GEMM per layer, AnchorKV replays each layer once over all
  old tokens, and the lanes of a step share one GEMM per linear.
* ``native``: the model's own kernels; exactness comes from repeating the
  original shapes (`replay.py`, `rows.py`: each decoded token as its own row).
  Bit-equal to transformers' own one-row decode.

`Kernels.for_model` probes (`probe_linear`, `probe_attention_rows`,
`probe_attention`), once per (weight shape, bias, dtype, device, thread
count), outside any timed or traced region, which row counts give the rows
of a large reference call bit for bit, wherever a row sits in the call; it
checks the same for the block attention (one query over its keys against
many queries over more keys) and RMSNorm-style row reductions, and that
the reference results are identical at one thread and at the run's thread
count.  A failed probe means ``native``, said aloud in the run's JSON
(`kernels`), the CLI's first lines and the page.  Verdicts are kept on the
`Kernels` object of a loaded model (its lifetime: the model's).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MODES = ("invariant", "native")
BLOCK = 64  # keys per attention block, blocks anchored at absolute position 0
DENSE = 64  # every row count 1..DENSE is probed; beyond it the counts below
LARGE = (80, 96, 128, 160, 192, 256, 320, 384, 512)
SPLIT = LARGE[-1]  # a call of more rows is cut into calls of SPLIT rows (a proven count) and a padded rest
HEAD_ELEMENTS = 1 << 23  # a weight this large (the output head) sees one row per lane: probed up to HEAD_ROWS rows
HEAD_ROWS = 16
# The block attention works on as many query rows at once as keep its score buffer within this: a replay's
# transient is about two such buffers (scores/probabilities in place, then the blocks' P@V), which AnchorKV's
# peak during a turn shows, so it stays small next to the K/V a replay rebuilds.
ATTENTION_ROWS_BYTES = 1 << 20


@dataclass(frozen=True)
class Verdict:
    """Which row counts of one GEMM shape give the reference call's bits, here."""

    key: tuple
    counts: tuple[int, ...]  # proven counts, ascending
    across_threads: bool  # the reference rows are the same at 1 thread and at the run's count
    failed: tuple[int, ...] = ()  # probed counts that differed

    def pad(self, m: int) -> int | None:
        """The smallest proven count >= m (None above the largest)."""
        i = bisect.bisect_left(self.counts, m)
        return self.counts[i] if i < len(self.counts) else None

    def as_dict(self) -> dict:
        return {"shape": list(self.key[0]), "bias": self.key[1], "dtype": self.key[2], "device": self.key[3],
                "threads": self.key[4], "proven": _ranges(self.counts), "failed": list(self.failed),
                "across_threads": self.across_threads}


def _ranges(counts: tuple[int, ...]) -> str:
    """`12-64, 80, 96` from (12, 13, ..., 64, 80, 96)."""
    out, start = [], None
    for i, c in enumerate(counts):
        if start is None:
            start = c
        if i + 1 == len(counts) or counts[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ", ".join(out)


def _rows_of(call, x: torch.Tensor, m: int, offset: int) -> torch.Tensor:
    return call(x[offset:offset + m])


def probe_linear(weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Verdict:
    """Row counts m whose rows of `F.linear` equal those of a large call, at two offsets, at `threads`."""
    key = (tuple(weight.shape), bias is not None, str(weight.dtype).removeprefix("torch."), str(weight.device), threads)
    head = weight.numel() >= HEAD_ELEMENTS
    candidates = list(range(1, HEAD_ROWS + 1)) if head else list(range(1, DENSE + 1)) + list(LARGE)
    gen = torch.Generator(device="cpu").manual_seed(1)
    w = torch.randn(weight.shape, generator=gen).to(weight)
    b = None if bias is None else torch.randn(bias.shape, generator=gen).to(bias)
    top = candidates[-1] + 8
    x = torch.randn(top, weight.shape[1], generator=gen).to(weight)
    call = functools.partial(F.linear, weight=w, bias=b)
    previous = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = call(x)
            torch.set_num_threads(threads)
            ref = call(x)
            passed, failed = [], []
            for m in candidates:
                same = all(torch.equal(_rows_of(call, x, m, o), ref[o:o + m]) for o in (0, 5))
                (passed if same else failed).append(m)
    finally:
        torch.set_num_threads(previous)
    return Verdict(key, tuple(passed), torch.equal(one, ref), tuple(failed))


def _positions(start: int, n: int, device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device)


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, end: int, scaling: float,
                    softcap: float | None = None, window: int | None = None, pad=None) -> torch.Tensor:
    """Causal attention whose bits for a query depend only on that query and the keys it sees.

    query (H, q, d): the last q positions end-q .. end-1; key, value (Hkv, T, d): positions end-T .. end-1
    (a cache hands attention its keys up to and including the queries).  `window`: a sliding layer sees keys
    after position p - window.  `pad(m)` raises a row count to a proven one.  Returns (q, H, d).

    The keys are laid out in blocks of `BLOCK` anchored at absolute position 0 (masked keys fill the first
    and last block).  Per block, the scores of the rows (a KV head's query heads, query by query) are one GEMM
    of fixed width (rows raised to a proven count); the maximum over the visible keys is exact; a masked key's
    probability is an exact zero; each block's sum and P@V are fixed-shape reductions, combined over the
    blocks by a sequential cumulative sum, to which blocks after a query's last visible one add exact zeros.
    Queries are taken a chunk at a time, each chunk over the blocks up to its last query.
    """
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
    chunk = min(chunk, max(1, LARGE[-1] // group))  # a chunk's rows stay within the proven counts
    for s in range(0, q, chunk):
        n = min(chunk, q - s)
        last = end - q + s + n - 1  # the chunk's last query position
        used = (last - (first - lead)) // BLOCK + 1  # blocks up to it
        qpos = torch.arange(last - n + 1, last + 1, device=query.device).repeat(group)
        r = (rows[:, :, s:s + n].float() * scaling).reshape(kv_heads, 1, group * n, d)
        m = group * n
        padded = pad(m) if pad is not None else m
        if padded != m:
            r = F.pad(r, (0, 0, 0, padded - m))
            qpos = torch.cat([qpos, qpos[-1:].expand(padded - m)])  # pad rows see what the last query sees
        scores = torch.matmul(r.expand(kv_heads, used, padded, d), k[:, :used].transpose(2, 3))  # (Hkv, b, p, 64)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
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
        out[s:s + n] = o[:, :m].reshape(heads, n, d).transpose(0, 1)
    return out


def lanes_block_attention(queries: list, keys: list, values: list, ends: list, scaling: float,
                          softcap: float | None = None, window: int | None = None, pad=None) -> list:
    """`block_attention` for one query per lane, all lanes in one call: lane i's query (H, 1, d) at position
    ends[i]-1 over its keys (Hkv, T_i, d).  Returns [(1, H, d)] per lane, each with the bits `block_attention`
    gives that lane alone (the probe checks it: `probe_attention`).

    The same operations as `block_attention`, with a leading lane dimension: every lane's keys laid out in
    blocks anchored at position 0, padded at the end with masked blocks up to the longest lane's count.  A
    masked block changes nothing: its maximum is -inf, its probabilities and P@V exact zeros, and the blocks
    are combined by a sequential cumulative sum, to which zeros add nothing."""
    lanes = len(queries)
    heads, _, d = queries[0].shape
    kv_heads = keys[0].shape[0]
    group = heads // kv_heads
    device = queries[0].device
    leads, firsts = [], []
    for k, end in zip(keys, ends):
        first = end - k.shape[1]
        firsts.append(first)
        leads.append(first % BLOCK)
    blocks = max(-(-(lead + k.shape[1]) // BLOCK) for lead, k in zip(leads, keys))
    kbuf = torch.zeros(lanes, kv_heads, blocks * BLOCK, d, device=device)
    vbuf = torch.zeros(lanes, kv_heads, blocks * BLOCK, d, device=device)
    key_pos = torch.full((lanes, blocks * BLOCK), -1, device=device, dtype=torch.long)
    base = torch.arange(blocks * BLOCK, device=device)
    for i, (k, v, lead, first) in enumerate(zip(keys, values, leads, firsts)):
        t = k.shape[1]
        kbuf[i, :, lead:lead + t] = k
        vbuf[i, :, lead:lead + t] = v
        key_pos[i, lead:lead + t] = base[lead:lead + t] + (first - lead)
    kbuf = kbuf.view(lanes, kv_heads, blocks, BLOCK, d)
    vbuf = vbuf.view(lanes, kv_heads, blocks, BLOCK, d)
    qpos = torch.tensor(ends, device=device) - 1  # (L,)
    m = group
    padded = pad(m) if pad is not None else m
    r = torch.stack([q.view(kv_heads, group, d) for q in queries]).float() * scaling  # (L, Hkv, group, d)
    if padded != m:
        r = F.pad(r, (0, 0, 0, padded - m))
    r = r.view(lanes, kv_heads, 1, padded, d)
    scores = torch.matmul(r.expand(lanes, kv_heads, blocks, padded, d), kbuf.transpose(3, 4))  # (L, Hkv, b, p, 64)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kp = key_pos.view(lanes, blocks, BLOCK)
    visible = (kp >= 0) & (kp <= qpos[:, None, None])
    if window is not None:
        visible &= kp > qpos[:, None, None] - window
    scores.masked_fill_(~visible[:, None, :, None, :], float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)
    p = scores.sub_(top).exp_()
    del scores
    sums = p.sum(dim=-1).cumsum(dim=2)[:, :, -1]  # (L, Hkv, padded)
    o = torch.matmul(p, vbuf)
    del p
    o = o.cumsum_(dim=2)[:, :, -1] / sums[..., None]  # (L, Hkv, padded, d)
    o = o[:, :, :m].reshape(lanes, heads, d).to(queries[0].dtype)
    return [o[i:i + 1] for i in range(lanes)]


def probe_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, threads: int,
                    window: int | None = None, softcap: float | None = None, pad=None) -> tuple[bool, str | None]:
    """Whether `block_attention` gives a query the same bits alone, among many queries, over more keys, at one
    thread and at `threads`; (ok, why not)."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    total = 300
    q = torch.randn(heads, total, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(kv_heads, total, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(kv_heads, total, head_dim, generator=gen).to(device, dtype)
    scaling = head_dim ** -0.5
    previous = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(threads)
            whole = block_attention(q, k, v, total, scaling, softcap, window, pad)
            for p in (0, 1, 63, 64, 65, 130, 299):
                one = block_attention(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], p + 1, scaling, softcap, window, pad)
                if not torch.equal(one[0], whole[p]):
                    return False, f"one query at position {p} differs from the same query in a call of {total}"
            part = block_attention(q[:, 100:164], k[:, :164], v[:, :164], 164, scaling, softcap, window, pad)
            if not torch.equal(part, whole[100:164]):
                return False, "64 queries over their keys differ from the same queries in a longer call"
            # One query per lane, lanes of different lengths (and block offsets) in one call, as a batched step
            # hands them: each lane's bits are those it gets alone.
            ends = (1, 64, 65, 130, 299, 300, 200)
            starts = (0, 0, 10, 0, 70, 0, 136)  # caches that dropped their first keys (a sliding layer's)
            lanes = lanes_block_attention([q[:, e - 1:e] for e in ends], [k[:, s:e] for s, e in zip(starts, ends)],
                                          [v[:, s:e] for s, e in zip(starts, ends)], list(ends), scaling, softcap,
                                          window, pad)
            for (s, e), got in zip(zip(starts, ends), lanes):
                alone = block_attention(q[:, e - 1:e], k[:, s:e], v[:, s:e], e, scaling, softcap, window, pad)
                if not torch.equal(got, alone):
                    return False, f"a lane's query at position {e - 1} differs when lanes share one call"
            torch.set_num_threads(1)
            if not torch.equal(block_attention(q, k, v, total, scaling, softcap, window, pad), whole):
                return False, f"1 thread and {threads} threads give different bits"
    finally:
        torch.set_num_threads(previous)
    return True, None


def probe_attention_rows(head_dim: int, dtype: torch.dtype, device, threads: int) -> Verdict:
    """Row counts of the block attention's two GEMMs ((rows, d) @ (d, 64) per block, (rows, 64) @ (64, d)) whose
    rows equal those of a large call, over 1 and 7 blocks."""
    key = (("attention", head_dim), False, str(dtype).removeprefix("torch."), str(device), threads)
    gen = torch.Generator(device="cpu").manual_seed(3)
    top = LARGE[-1] + 8
    x = torch.randn(2, 1, top, head_dim, generator=gen).to(device, torch.float32)
    k = torch.randn(2, 7, BLOCK, head_dim, generator=gen).to(device, torch.float32)
    p = torch.rand(2, 7, top, BLOCK, generator=gen).to(device, torch.float32)
    previous = torch.get_num_threads()
    passed, failed = [], []
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = torch.matmul(x.expand(2, 7, top, head_dim), k.transpose(2, 3)), torch.matmul(p, k)
            torch.set_num_threads(threads)
            ref = torch.matmul(x.expand(2, 7, top, head_dim), k.transpose(2, 3)), torch.matmul(p, k)
            for m in [*range(1, DENSE + 1), *LARGE]:
                same = True
                for blocks in (1, 7):
                    scores = torch.matmul(x[:, :, :m].expand(2, blocks, m, head_dim), k[:, :blocks].transpose(2, 3))
                    pv = torch.matmul(p[:, :blocks, :m].contiguous(), k[:, :blocks])
                    same &= torch.equal(scores, ref[0][:, :blocks, :m]) and torch.equal(pv, ref[1][:, :blocks, :m])
                (passed if same else failed).append(m)
    finally:
        torch.set_num_threads(previous)
    return Verdict(key, tuple(passed), torch.equal(one[0], ref[0]) and torch.equal(one[1], ref[1]), tuple(failed))


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("kvdirect_kernels", default=None)
INVARIANT_ATTENTION = "kvdirect_invariant"


def active() -> "Kernels | None":
    """The kernels of the pass in progress in this context (set by `Kernels.applied`)."""
    return _ACTIVE.get()


def invariant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        sliding_window=None, softcap=None, **kwargs):
    """The registered attention function of the invariant mode (a model's layers call it by name): the block
    attention, the queries ending at the call's last position."""
    kernels = active()
    end = int(kwargs["position_ids"][0, -1]) + 1
    out = kernels.attention(query[0], key[0], value[0], end, scaling if scaling is not None else module.scaling,
                            softcap, sliding_window)
    return out.unsqueeze(0), None


@dataclass
class Kernels:
    """The kernels of one run on one model: the mode, the probe's verdicts, the padded GEMM, the attention.

    `for_model` probes (once per model and thread count: the verdicts live on the loaded model) every linear
    layer's shape and each attention geometry of the model; any failure means ``native``, and `reason` says
    why.
    """

    mode: str
    threads: int
    requested: str = "invariant"
    reason: str | None = None  # why `native` where `invariant` was asked for
    verdicts: dict = field(default_factory=dict)  # key -> Verdict (shared with the loaded model)

    @property
    def invariant(self) -> bool:
        return self.mode == "invariant"

    @classmethod
    def for_model(cls, loaded, mode: str, threads: int) -> "Kernels":
        if mode not in MODES:
            from .errors import UserError

            raise UserError(f"kernels: {str(mode)[:40]!r} is not allowed; allowed: {', '.join(MODES)}")
        kernels = cls("native", threads, requested=mode, verdicts=loaded.probes)
        if mode == "invariant":
            kernels.reason = kernels._probe(loaded.model, loaded.device, loaded.dtype)
            kernels.mode = "invariant" if kernels.reason is None else "native"
        return kernels

    # --- the probe ---------------------------------------------------------------------------------------
    def _verdict(self, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Verdict:
        key = (tuple(weight.shape), bias is not None, str(weight.dtype).removeprefix("torch."), str(weight.device),
               threads)
        if key not in self.verdicts:
            self.verdicts[key] = probe_linear(weight, bias, threads)
        return self.verdicts[key]

    def _attention_verdict(self, head_dim: int, dtype, device, threads: int) -> Verdict:
        key = (("attention", head_dim), False, str(dtype).removeprefix("torch."), str(device), threads)
        if key not in self.verdicts:
            self.verdicts[key] = probe_attention_rows(head_dim, dtype, device, threads)
        return self.verdicts[key]

    def _probe(self, model, device, dtype) -> str | None:
        """None when every kernel of the model passed at this thread count and across thread counts."""
        from . import compat

        for threads in dict.fromkeys((self.threads, 1)):
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    v = self._verdict(m.weight, m.bias, threads)
                    if not v.counts or v.counts[-1] < (HEAD_ROWS if m.weight.numel() >= HEAD_ELEMENTS else SPLIT):
                        return f"no row count of a {tuple(m.weight.shape)} GEMM up to {v.counts[-1] if v.counts else 0} " \
                               f"gives the rows of a large call here ({v.as_dict()['proven'] or 'none'})"
                    if not v.across_threads:
                        return f"a {tuple(m.weight.shape)} GEMM gives other bits at 1 thread than at {threads}"
        cfg = compat.text_config(model.config)
        seen = set()
        for spec in compat.layer_specs(model.config):
            attn = compat.attention_module(compat.decoder_layers(model)[spec.index])
            geometry = (cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
                        attn.head_dim, spec.sliding_window, getattr(attn, "attn_logit_softcapping", None))
            if geometry in seen:
                continue
            seen.add(geometry)
            rows = self._attention_verdict(attn.head_dim, dtype, device, self.threads)
            if not rows.counts or not rows.across_threads:
                return f"the block attention's GEMMs have no invariant row count here ({rows.as_dict()['proven']})"
            key = ("block attention", geometry, str(dtype), str(device), self.threads)
            if key not in self.verdicts:  # once per model, geometry and thread count, like the GEMMs' verdicts
                self.verdicts[key] = probe_attention(*geometry[:3], dtype, device, self.threads, window=geometry[3],
                                                     softcap=geometry[4], pad=rows.pad)
            ok, why = self.verdicts[key]
            if not ok:
                return f"block attention: {why}"
        return None

    # --- the kernels -------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear` over every row of x (..., d) as GEMMs of proven row counts: zero rows added, cut into calls of
        `SPLIT` rows (the output head: `HEAD_ROWS`) above that."""
        rows = x.reshape(-1, x.shape[-1])
        verdict = self._verdict(weight, bias, torch.get_num_threads())
        split = verdict.counts[-1]
        parts = []
        for s in range(0, rows.shape[0], split):
            part = rows[s:s + split]
            m = part.shape[0]
            size = verdict.pad(m)
            if size != m:
                part = F.pad(part, (0, 0, 0, size - m))
            parts.append(F.linear(part, weight, bias)[:m])
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(*x.shape[:-1], weight.shape[0])

    def attention(self, query, key, value, end: int, scaling: float, softcap=None, window=None) -> torch.Tensor:
        """`block_attention` with this device's proven row counts; query (H, q, d) -> (q, H, d)."""
        rows = self._attention_verdict(query.shape[-1], query.dtype, query.device, torch.get_num_threads())
        return block_attention(query, key, value, end, scaling, softcap, window, pad=rows.pad)

    def lanes_attention(self, queries, keys, values, ends, scaling: float, softcap=None, window=None) -> list:
        """`lanes_block_attention` (one query per lane, all lanes in one call) with this device's row counts."""
        rows = self._attention_verdict(queries[0].shape[-1], queries[0].dtype, queries[0].device,
                                       torch.get_num_threads())
        return lanes_block_attention(queries, keys, values, ends, scaling, softcap, window, pad=rows.pad)

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
        return {"mode": self.mode, "requested": self.requested, "reason": self.reason, "threads": self.threads,
                "probes": [v.as_dict() for k, v in self.verdicts.items() if isinstance(v, Verdict) and k[4] in threads],
                "attention_probes": [{"heads": k[1][0], "kv_heads": k[1][1], "head_dim": k[1][2], "window": k[1][3],
                                      "softcap": k[1][4], "threads": k[4], "same_bits": v[0], "why_not": v[1]}
                                     for k, v in self.verdicts.items() if k[0] == "block attention" and k[4] in threads]}


def brief(report: dict) -> str:
    """The same in a few words, for the page's status line."""
    if report["mode"] == "invariant":
        return f"kernels: invariant (probe passed at {report['threads']} thread(s))"
    if report["requested"] == "invariant":
        return f"kernels: NATIVE, the invariance probe failed here: {report['reason']}"
    return "kernels: native"


def describe(report: dict) -> str:
    """A run's kernels (`Kernels.report()`) in one line, for the CLI's first lines and the page."""
    if report["mode"] == "invariant":
        starts = sorted({p["proven"].split(",")[0] for p in report["probes"] if p["threads"] == report["threads"]})
        return (f"kernels: invariant (probe passed at {report['threads']} thread(s) and across thread counts: every "
                f"linear one GEMM of a proven row count ({'; '.join(starts)} ...), block attention)")
    if report["requested"] == "invariant":
        return f"kernels: NATIVE: the invariance probe failed here: {report['reason']}"
    return "kernels: native (asked for: the model's own kernels; exact replay repeats the original shapes)"
