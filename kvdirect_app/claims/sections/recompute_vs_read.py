"""Claim 4, recompute vs read: the best speed-up of recomputing K/V from residuals over reading them, from
the microbenchmark's cell (`claims.recompute`, read by `claims.recompute_report`)."""

from __future__ import annotations

from ..recompute_report import summary
from ..render import number
from .common import paper_figure, plural, section_cells, times


def build(results: dict) -> dict:
    j = section_cells(results, "recompute")[0]["json"]
    # summary()'s numbers only: its own verdict belongs to the microbenchmark; the report's is the one rule's.
    s = {k: v for k, v in summary(j).items() if k not in ("verdict", "sentence")}
    rows = [r for r in j["rows"] if not r.get("skipped")]
    out = {"rows": j["rows"], "basis": "measured", "summary": s, "ours": {"speedup": None}}
    where = f"{j['device']}, {j['dtype']}, {plural(j['threads'], 'thread')}, {j['model']} layer {j['layer']}"
    out["model"] = j["model"]
    out["scope"] = [
        f"layer {j['layer']}",
        j["dtype"],
        plural(j["threads"], "thread"),
        f"batches {', '.join(map(str, sorted({r['batch'] for r in j['rows']})))}",
        f"contexts {', '.join(map(str, sorted({r['context'] for r in j['rows']})))}",
    ]
    if s["best_speedup"] is None:
        return {**out, "notes": [f"every cell was skipped on {where}"], "why": f"every cell was skipped on {where}"}
    host = s["best_host_speedup"] is not None and s["best_host_speedup"] > s["best_speedup"]
    out["ours"]["speedup"] = s["best_host_speedup"] if host else s["best_speedup"]
    at = s["best_host_at"] if host else s["best_at"]
    notes = [
        f"best at batch {at['batch']}, context {at['context']}"
        + (" with K/V copied from host memory" if host else " with K/V in device memory")
        + f", on {where}",
        f"a residual is {j['residual_bytes_per_token']} B against {j['kv_bytes_per_token']} B of K/V per token "
        f"(r = {number(j['ratio_r'])}); the arithmetic-intensity bound allows at most "
        f"{times(s['largest_bound'])} here",
    ]
    out["why"] = (
        f"on {j['model']} layer {j['layer']} ({j['device']}, {j['dtype']}, "
        f"{plural(j['threads'], 'thread')}), the best speed-up of recomputing K/V from the residual over reading "
        "them was "
        f"{times(out['ours']['speedup'])} (batch {at['batch']}, context {at['context']}, K/V "
        f"{'copied from host' if host else 'in device'} memory), where the arithmetic-intensity bound allows "
        f"at most {times(s['largest_bound'])} for r = {number(j['ratio_r'])} and the paper has up to "
        f"{paper_figure('recompute', 'speedup')}"
    )
    if not any(r.get("host_speedup") is not None for r in rows):
        notes.append("K/V held off the device (host memory over PCIe, CUDA only) not measured here")
    return {**out, "notes": notes}
