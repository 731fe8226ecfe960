"""Claim 7 (7b on accelerators), exactness: exact-mode runs that rebuilt K/V, bit-equal to the full cache and
every greedy token equal."""

from __future__ import annotations

from .common import UNRECORDED, listed, measured_on, plural, run_mode, section_cells


def _rebuilding_lanes(cell: dict, j: dict) -> list[dict]:
    """One exactness run's rebuilding lanes: a `bench run` JSON, or a real-size run (`claims/realsize.py`,
    labelled with its random weights)."""
    if "lanes" in j:  # random weights at a real config
        return [
            {
                "model": f"{j['model']} ({j['label']})",
                "dtype": j["dtype"],
                "strategy": spec,
                "mode": run_mode(r),
                "load": 0,
                "token_match": 1.0 if r["tokens_equal"] else 0.0,
                "kv_exact": r["kv_exact"],
                "rebuilt": r["rebuilt_token_layers"],
                "max_abs_dk": r["max_abs_dk"],
                "bytes_match": r["bytes_match"],
                "forward_kernels": j["kernels"]["mode"],
                "rebuild_kernels": r["kernels"]["rebuild"],
            }
            for spec, r in j["lanes"].items()
            if spec != "full" and run_mode(r) is not None
        ]
    return [
        {
            "model": j["model"],
            "dtype": j["dtype"],
            "strategy": spec,
            "mode": run_mode(r),
            "load": cell.get("load", 0),
            "token_match": r["token_match"],
            "kv_exact": r["kv_exact"],
            "rebuilt": r["rebuilt_token_layers"],
            "max_abs_dk": r["max_abs_dk"],
            "forward_kernels": (j.get("kernels") or {}).get("mode", UNRECORDED),
            "rebuild_kernels": (r.get("kernels") or {}).get("rebuild", UNRECORDED),
        }
        for spec, r in j["strategies"].items()
        if spec != "full" and run_mode(r) is not None
    ]  # the full cache and the baselines rebuild nothing


def _on_accelerator(cell: dict) -> bool:
    return str((cell.get("env") or {}).get("device", "")).startswith("cuda")


def build_accelerator(results: dict) -> dict:
    return build(results, accelerator=True)


def build(results: dict, accelerator: bool = False) -> dict:
    """Claim 7 on the CPU runs (7b: on the accelerator runs; not measured where none ran)."""
    rows, mine = [], [c for c in section_cells(results, "exactness") if _on_accelerator(c) == accelerator]
    for c in mine:
        for j in c["json"].get("runs", [c["json"]]):
            rows += _rebuilding_lanes(c, j)
    counted = [r for r in rows if r["mode"] == "exact" and r["rebuilt"]]
    fast = [r for r in rows if r["mode"] == "fast" and r["rebuilt"]]
    idle = [r for r in rows if r["mode"] in ("exact", "fast") and not r["rebuilt"]]
    unrecorded = [r for r in rows if r["mode"] == UNRECORDED]
    out = {
        "rows": rows,
        "basis": "measured",
        "counted": len(counted),
        "idle": len(idle),
        "ours": {"kv": None, "tokens": None},
        "measured_on": measured_on(results, "exactness", mine),
    }
    notes = []
    on = "an accelerator" if accelerator else "a CPU"
    out["why"] = f"no exact-mode run on {on} rebuilt K/V in this report" + (
        f" ({len(unrecorded)} runs with {UNRECORDED})" if unrecorded else ""
    )
    if counted:
        out["kv_equal"] = sum(1 for r in counted if r["kv_exact"])
        out["tokens_equal"] = sum(1 for r in counted if r["token_match"] == 1.0)
        out["ours"] = {"kv": out["kv_equal"] / len(counted), "tokens": out["tokens_equal"] / len(counted)}
        dtypes = sorted({r["dtype"] for r in counted})
        models = sorted({r["model"] for r in counted})
        out["model"] = f"{plural(len(models), 'model')}: {', '.join(models)}"
        out["scope"] = [", ".join(dtypes), f"{len(counted)} exact-mode runs that rebuilt K/V"]
        out["why"] = (
            f"{out['kv_equal']} of {len(counted)} exact-mode runs on {on} that rebuilt K/V were bit-equal "
            f"to the full cache and {out['tokens_equal']} had every greedy token equal, over "
            f"{plural(len(models), 'model')} in {listed(dtypes)}"
        )
        notes.append(
            f"{out['kv_equal']} of {len(counted)} exact-mode runs that rebuilt K/V bit-equal, "
            f"{out['tokens_equal']} with every token equal ({', '.join(models)}; {', '.join(dtypes)}; "
            f"{sum(1 for r in counted if r['load'])} under busy processes)"
        )
    real = [r for r in rows if "bytes_match" in r]
    if real:
        notes.append(
            f"{len(real)} of them at real size with random weights ({', '.join(sorted({r['model'] for r in real}))}"
            f"): allocator bytes equal to the formula in {sum(1 for r in real if r['bytes_match'])} of "
            f"{len(real)}"
        )
    if idle:
        notes.append(
            f"{len(idle)} runs rebuilt nothing and are listed apart: a single turn with rebuild=turn keeps "
            "full K/V within the turn, and layers that all slide keep their window as the full cache does"
        )
    if rows:
        forward = sorted({r["forward_kernels"] for r in rows})
        rebuilt = sorted({r["rebuild_kernels"] for r in counted}) if counted else []
        notes.append(
            f"kernels: the reference and every lane's forwards {', '.join(forward)}"
            + (f"; exact rebuilds {', '.join(rebuilt)}" if rebuilt else "")
        )
    if fast:
        equal = [r for r in fast if r["kv_exact"]]
        out["fast_equal"] = len(equal)
        kinds = sorted({r["rebuild_kernels"] for r in fast})
        notes.append(
            f"fast mode (all old tokens in one call, rebuilt with: {', '.join(kinds)}), not counted: "
            f"{len(equal)} of {len(fast)} bit-equal to the forwards' K/V"
        )
    if unrecorded:
        notes.append(f"{len(unrecorded)} runs not counted: {UNRECORDED} in their JSON")
    if accelerator and not rows:
        out.update(
            basis="not measured",
            model="no run",
            measured_on="devices: no accelerator ran in this report",
            why="no exactness run on an accelerator is in this report",
        )
        notes.append(
            "no exactness run on an accelerator in this report: nothing holds on accelerators until one "
            "measured it (scripts/device_check.py runs them where a GPU is lent)"
        )
    return {**out, "notes": notes}
