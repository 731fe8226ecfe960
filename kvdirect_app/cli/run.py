"""`bench run`: strategies in lockstep against the full cache; `--alone`: each in a process of its own.

    python -m kvdirect_app.bench run --model smollm2-135m \\
        --strategies full,kvdirect:budget=64,anchorkv:spacing=30:budget=16:rebuild=step --json out.json
    python -m kvdirect_app.bench run --alone --strategies full,anchorkv:spacing=30:budget=16:rebuild=step ...

Two tables: what each strategy changes (tokens, logits, K/V against the
full cache) and what it costs (bytes between turns, peak during a turn and
ms per token side by side, then the formula's figures beside the
measurement).  With `--alone`, every strategy (and the full cache, as the
reference for tokens) runs in its own process (`run --solo SPEC`) without
any other lane, under `/usr/bin/time -v` where it is installed.  Each child
loads the model, prints the load's own peak RSS, hands the heap's free pages
back (`rss.trim`) and starts the kernel's high-water mark afresh, so the
peak `/usr/bin/time` (and `wait4`) reports for it is its run's; the parent
never loads the model, so a `/usr/bin/time` around the parent reports the
largest child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import torch

from ..benchmarks.api import RunConfig, check, consume, first_turn_events, run
from ..engine import validate
from ..engine.runner import Engine
from ..kernels.invariant import describe
from ..measure.agreement import token_match
from ..plain import rss
from ..plain.recording import Recorder, save
from ..plain.scenarios import scenarios
from ..plain.units import fmt, fmt_bytes, table
from ..strategies import parse_specs
from .common import CliError, add_conversation_options, write_json


def output_table(result: dict) -> str:
    cols = [
        "strategy",
        "tokens",
        "match",
        "1st div",
        "TF agree",
        "KL",
        "K/V exact",
        "rebuilt",
        "max|dK|",
        "max|dV|",
        "max|dlogit|",
    ]
    rows = []
    for spec, r in result["strategies"].items():
        rows.append(
            [
                spec,
                str(len(r["token_ids"])),
                fmt(r["token_match"], ".3f"),
                fmt(r["first_divergence"], "d"),
                fmt(r["teacher_forced_agreement"], ".3f"),
                fmt(r["kl_mean"], ".2e"),
                fmt(r["kv_exact"]),
                fmt(r["rebuilt_token_layers"], "d"),
                fmt(r["max_abs_dk"], ".1e"),
                fmt(r["max_abs_dv"], ".1e"),
                fmt(r["max_abs_dlogit"], ".1e"),
            ]
        )
    return table(cols, rows)


def byte_source(result: dict) -> str:
    """How the run's bytes were had, in one word: measured (an allocator's meter or trace), declared (the tensors the
    strategies list: no allocator could be read) or formula (no memory instrument ran)."""
    mode = result["instruments"]["memory"]
    return {"allocator": "measured", "trace": "measured", "storage": "declared"}.get(mode, "formula")


def cost_table(result: dict) -> str:
    source = byte_source(result)
    cols = [
        "strategy",
        "between turns",
        "peak in turn",
        "ms/token",
        "tok/s",
        "TTFT ms",
        "recompute",
        "replay",
        "scoring",
        "attention",
        "shared",
        "formula between",
        "formula peak",
        f"formula = {source}",
    ]
    rows = []
    for spec, r in result["strategies"].items():
        sb, lat = r["state_bytes"], r["latency_ms"]
        rows.append(
            [
                spec,
                fmt_bytes(sb["between_turns_peak"]),
                fmt_bytes(sb["peak"]),
                fmt(lat["decode_total_ms_mean"], ".1f"),
                fmt(r["tokens_per_s"], ".1f"),
                fmt(lat["ttft_ms"], ".0f"),
                fmt(lat["decode_recompute_ms_mean"], ".1f"),
                fmt(lat["decode_replay_ms_mean"], ".1f"),
                fmt(lat["decode_scoring_ms_mean"], ".1f"),
                fmt(lat["decode_attention_ms_mean"], ".1f"),
                fmt(lat["decode_shared_ms_mean"], ".1f"),
                fmt_bytes(sb["formula_between_turns_peak"]),
                fmt_bytes(sb["formula_peak"]),
                fmt(sb["formula_matches_measurement"]),
            ]
        )
    return table(cols, rows)


def notes(result: dict) -> list[str]:
    """What a reader must know to read the tables right."""
    instrument = result["memory_instrument"]
    source = next((r["state_bytes"]["peak_source"] for r in result["strategies"].values()), None)
    peak = {
        "measured": "the highest the lane's own allocations went during a forward (its state and buffers; the "
        "pass's shared activations are the shared pass's)",
        "trace": "the highest the allocation trace saw during a forward (state + buffers + 1/N of the activations)",
        "formula": "the held bytes plus the formula's buffers (not measured: no peak can be read here)",
    }.get(source, "by formula (no instrument ran)")
    out = [f"bytes: {instrument}; 'peak in turn' is {peak}; the formula's peak counts the strategy's buffers only"]
    if result["batched"]:
        shared = result["shared_pass_ms_mean"]
        out.append(
            "lanes batched: 'ms/token' is a lane's own work (its cache, its attention) plus 1/N of the pass's "
            f"shared work (projections and MLP of all N rows, {fmt(shared, '.1f')} ms per decode pass); "
            "`run --alone` gives each strategy as deployed alone"
        )
    if not result["teacher_forced_twins"]:
        out.append("no teacher-forced twins: agreement and KL cover the steps before each strategy's first divergence")
    out += [f"kernels: {line}" for line in result["kernels"].get("file_notes", [])]
    determinism = result["determinism"]
    if not determinism["deterministic"]:
        out.append(f"NO EXACT MODE HERE: {determinism['reason']}")
    for spec, r in result["strategies"].items():
        out += [f"{spec}: {note}" for note in r["notes"]]
        if r.get("exact_unavailable"):
            out.append(f"{spec}: promises bit-exact K/V, but this run cannot have it: {r['exact_unavailable']}")
        elif r["claims_exact"] and r["kv_exact"] and r["rebuilt_token_layers"] == 0 and spec != "full":
            out.append(f"{spec}: K/V equal, but nothing was rebuilt in this run, so exactness was not exercised")
        sb = r["state_bytes"]
        if sb["formula_matches_measurement"] is False:
            where, seen, measured, formula = sb["mismatches"][0]
            word = byte_source(result)
            out.append(
                f"{spec}: {word.upper()} STATE DIFFERS FROM THE FORMULA at {sb['mismatch_count']} points, "
                f"first ({where}, {seen} tokens): {measured} B {word}, {formula} B by formula"
                + (
                    ""
                    if sb["declared_mismatch_count"]
                    else "; the tensors it lists agree with the formula, so it holds something it does not list"
                )
            )
        if sb["declared_mismatch_count"]:
            out.append(
                f"{spec}: the tensors it lists differ from its formula at {sb['declared_mismatch_count']} points"
            )
    return out


def print_result(result: dict):
    mode = "lanes batched in one pass per step" if result["batched"] else "lanes one after another"
    print(
        f"model {result['model']} ({result['model_source']}), device {result['device']}, dtype {result['dtype']}, "
        f"threads {result['threads']}, prompt {len(result['prompt_ids'])} tokens, {mode}, "
        f"process RSS peak {fmt_bytes(rss) if (rss := result['process_rss_peak_bytes']) else 'not read'}"
    )
    print(describe(result["kernels"]))
    print(f"memory instrument: {result['memory_instrument']}")
    print(
        "engine time per turn (first forward to last token, model loading excluded): "
        + ", ".join(f"{s:.2f} s" for s in result["turn_seconds"])
    )
    steps = result.get("steps")
    if steps:
        parts = ", ".join(f"{name} {ms:.1f}" for name, ms in steps["measurement_by_instrument_ms_mean"].items())
        ops = ", ".join(f"{op} {ms:.1f}" for op, ms in steps["engine_by_op_ms_mean"].items())
        print(
            f"per decode step (mean of {steps['steps']}): wall {steps['wall_ms_mean']:.1f} ms = lanes' own "
            f"{steps['lanes_ms_mean']:.1f} (the shared pass {steps['shared_ms_mean']:.1f} charged to them by rows) + "
            f"measurement {steps['measurement_ms_mean']:.1f} ({parts or 'none'}) + engine "
            f"{steps['engine_ms_mean']:.1f} ({ops or 'none'}) + unattributed {steps['unattributed_ms_mean']:.1f}"
        )
    print("\nwhat it changes (against the full cache):")
    print(output_table(result))
    print(
        f"\nwhat it costs (between turns, peak during a turn: {byte_source(result)}; ms per token: measured; then "
        "the formula):"
    )
    print(cost_table(result))
    for line in notes(result):
        print(f"note: {line}")
    for spec, r in result["strategies"].items():
        print(f"\n[{spec}] {r['text'][:400]!r}")


def cmd_run(args) -> int:
    if args.alone and args.solo:
        raise CliError("give --alone or --solo, not both")
    if getattr(args, "record", None) and (args.alone or args.solo):
        raise CliError("--record: records a lockstep run (with the full cache); not with --alone or --solo")
    config = RunConfig.from_args(args, strategies=args.solo or args.strategies)
    turns, raw = config.turns()
    if args.alone and not args.dry_run:
        # The parent loads no model (its load would be the largest RSS of the tree): each child checks and runs.
        req = validate.request(args.model, args.device, args.dtype, args.strategies, args.max_new_tokens, turns, raw)
        return run_alone(args, list(req.strategies))
    if args.dry_run:
        check(config, config.strategies, turns, raw, compare=not args.solo, dry_run=True)
        print("dry run: every setting checked, the run fits; nothing was run")
        return 0
    if not args.solo:
        recorder = Recorder(recording_meta(args, turns, raw)) if getattr(args, "record", None) else None
        result = run(config, recorder)
        if recorder is not None:
            save(recorder.finish(result.engine.token_maps(), result.engine.attention_maps()), args.record)
            print(f"wrote the recording {args.record}", file=sys.stderr)
        print_result(result.data)
        write_json(args.json, result.data, "run")
        return 0
    # --solo: one strategy alone in this process, its peak RSS from a high-water mark started after the load.
    req, loaded, est, ids = check(config, config.strategies, turns, raw, compare=False)
    engine = Engine(loaded, list(req.strategies), raw=raw, compare=False, **config.engine_options())
    load_peak = peak_rss()
    touch_weights(loaded.model)
    before = reset_peak_rss()
    events = engine.run(turns, park=args.park) if ids is None else first_turn_events(engine, turns[0], ids)
    result = consume(events)
    result["memory_estimate"] = {"total_bytes": est.total, "lanes": est.lanes, "tokens": est.tokens}
    result["process"] = {"load_peak_rss_bytes": load_peak, "rss_before_run_bytes": before, "peak_rss_bytes": peak_rss()}
    print_result(result)
    write_json(args.json, result, "run")
    return 0


def recording_meta(args, turns: list[str], raw: bool) -> dict:
    """What a recording made by the CLI says about its run (the engine's start and done events add the rest)."""
    scenario = scenarios().get(args.scenario or "", {})
    expect = [len(turns) - 1, scenario["expect"]] if scenario.get("expect") else None
    return {
        "source": "bench " + ("record" if getattr(args, "command", "") == "record" else "run"),
        "command": " ".join(["python -m kvdirect_app.bench", *sys.argv[1:]]) if sys.argv[1:] else None,
        "model": args.model,
        "dtype": args.dtype,
        "specs": [s.label for s in parse_specs(args.strategies)],
        "max_new_tokens": args.max_new_tokens,
        "raw": raw,
        "twins": not args.no_twins,
        "kernels_mode": args.kernels,
        "memory": args.memory,
        "turns": turns,
        "scenario": args.scenario,
        "expect": expect,
    }


# --- each strategy alone ------------------------------------------------------------------------------------------
def touch_weights(model):
    """Read one value of every page of the weights: a cached copy is mapped from its file, and its pages would
    otherwise come in during the run's first forward and count as the run's growth."""
    with torch.inference_mode():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            flat[:: max(1, 4096 // flat.element_size())].sum()


def reset_peak_rss() -> int:
    """After the model's load: the heap's free pages handed back and the kernel's high-water mark started afresh,
    so the peak counts the run alone; returns the RSS now."""
    rss.trim()
    if not rss.reset_peak():
        raise CliError("--solo: cannot reset the peak RSS here (/proc/self/clear_refs); needs Linux")
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    peak = rss.peak()
    if peak is None:
        raise CliError("--solo: /proc/self/status has no VmHWM; needs Linux")
    return peak


def conversation_args(args) -> list[str]:
    out = [
        "--model",
        args.model,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--memory",
        args.memory,
        "--prefill-chunk",
        str(args.prefill_chunk),
    ]
    for flag, value in (
        ("--prompt", args.prompt),
        ("--prompt-file", args.prompt_file),
        ("--scenario", args.scenario),
        ("--context", args.context),
        ("--threads", args.threads),
    ):
        if value is not None:
            out += [flag, str(value)]
    flags = [
        ("--raw", args.raw),
        ("--park", args.park),
        ("--sequential", args.sequential),
        ("--no-twins", args.no_twins),
    ]
    return out + ["--kernels", args.kernels] + [flag for flag, on in flags if on]


GNU_TIME = Path("/usr/bin/time")


def time_peak(report: Path) -> int | None:
    """'Maximum resident set size (kbytes)' from a `/usr/bin/time -v` report, in bytes."""
    for line in report.read_text(errors="replace").splitlines():
        if "Maximum resident set size" in line:
            return int(line.rsplit(":", 1)[1]) * 1024
    return None


def run_child(spec: str, args, folder: Path) -> dict:
    """One strategy in a fresh process (under `/usr/bin/time -v` where it is installed); its JSON plus the peak
    RSS the kernel reports for it (wait4, and /usr/bin/time's report of the same)."""
    out, log, report = folder / "result.json", folder / "log.txt", folder / "time.txt"
    for path in (out, report):
        path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "kvdirect_app.bench",
        "run",
        "--solo",
        spec,
        *conversation_args(args),
        "--json",
        str(out),
    ]
    if GNU_TIME.is_file():
        cmd = [str(GNU_TIME), "-v", "-o", str(report), *cmd]
    with open(log, "w") as sink:
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0 or not out.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise CliError(f"--alone: the process for {spec} failed ({child.returncode}): {tail[0]}")
    result = json.loads(out.read_text())
    result["process"]["wait4_peak_rss_bytes"] = usage.ru_maxrss * 1024
    result["process"]["time_peak_rss_bytes"] = time_peak(report) if report.is_file() else None
    return result


def run_alone(args, strategies) -> int:
    specs = ["full"] + [s.label for s in strategies if s.spec() != "full"]
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for spec in specs:
            print(f"running {spec} in its own process…", file=sys.stderr)
            runs[spec] = run_child(spec, args, Path(folder))
    reference = runs["full"]["strategies"]["full"]
    measured = {"auto": "allocator", "allocator": "allocator", "trace": "trace", "storage": "declared"}.get(
        args.memory, "formula"
    )  # what the peak column is
    cols = [
        "strategy",
        "tokens",
        "match",
        "1st div",
        "load peak RSS",
        "peak RSS (/usr/bin/time)",
        "RSS before run",
        "RSS growth",
        f"{measured} peak",
        f"growth - {measured}",
        "between turns",
        "ms/token",
        "tok/s",
    ]
    rows, summary = [], {}
    for spec, result in runs.items():
        r = result["strategies"][spec]
        match, first = token_match(reference["turn_token_ids"], r["turn_token_ids"])
        proc = result["process"]
        outside = proc["time_peak_rss_bytes"]
        peak = outside if outside is not None else proc["wait4_peak_rss_bytes"]
        growth = peak - proc["rss_before_run_bytes"]
        allocator = (
            r["state_bytes"]["peak"] if r["state_bytes"]["peak"] is not None else r["state_bytes"]["formula_peak"]
        )
        rows.append(
            [
                spec,
                str(len(r["token_ids"])),
                fmt(match, ".3f"),
                fmt(first, "d"),
                fmt_bytes(proc["load_peak_rss_bytes"]),
                fmt_bytes(peak) + ("" if outside is not None else " (wait4)"),
                fmt_bytes(proc["rss_before_run_bytes"]),
                fmt_bytes(growth),
                fmt_bytes(allocator),
                fmt_bytes(None if allocator is None else growth - allocator),
                fmt_bytes(r["state_bytes"]["between_turns_peak"]),
                fmt(r["latency_ms"]["decode_total_ms_mean"], ".1f"),
                fmt(r["tokens_per_s"], ".1f"),
            ]
        )
        summary[spec] = {
            **r,
            "token_match": match,
            "first_divergence": first,
            "process": proc,
            "rss_growth_bytes": growth,
        }
    head = {k: v for k, v in runs["full"].items() if k not in ("strategies", "process")}
    print(
        f"model {head['model']}, device {head['device']}, dtype {head['dtype']}, threads {head['threads']}, "
        f"prompt {len(head['prompt_ids'])} tokens; each strategy alone in its own process, tokens compared with "
        "the full cache's own process"
    )
    print(table(cols, rows))
    print(
        "note: each process loads the model (its peak: 'load peak RSS'), reads every page of its weights, hands "
        "the heap's free pages back and starts the kernel's high-water mark afresh; 'peak RSS' is then the run's "
        "own, as /usr/bin/time -v reports it for that process; RSS growth = that peak minus the RSS before the "
        f"run; the {measured} peak is the same process's in-process figure: "
        + {
            "allocator": "the strategy's state and its own buffers, by the allocator (its peak where one can be "
            "read, else the held bytes plus the formula's buffers)",
            "trace": "the strategy's state, buffers and activations, traced",
            "declared": "the tensors the strategy lists plus the formula's buffers (declared, not measured)",
            "formula": "the strategy's formula (no instrument ran)",
        }[measured]
    )
    if any(r["process"]["time_peak_rss_bytes"] is None for r in summary.values()):
        print(
            f"note: {GNU_TIME} is not installed: the peak RSS is wait4's for the child, which also counts the "
            "parent's size at the fork"
        )
    write_json(args.json, {**head, "alone": True, "strategies": summary}, "run-alone")
    return 0


def register(sub):
    p = sub.add_parser("run", help="run strategies in lockstep against the full cache")
    add_conversation_options(p)
    p.add_argument(
        "--strategies",
        default="full,kvdirect:budget=64:mode=exact",
        help="comma-separated name[:key=value]... e.g. full,kvdirect:budget=64:mode=exact",
    )
    p.add_argument("--park", action="store_true", help="park every session between turns and resume it")
    p.add_argument(
        "--alone",
        action="store_true",
        help="run each strategy (and the full cache) in its own process; report each one's peak RSS",
    )
    p.add_argument(
        "--solo",
        help="run this one strategy alone in this process, without the reference (what --alone runs in each child)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check every setting and the memory guard's estimate, print it, run nothing",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--record",
        help="also write a recording of the run here (.json, or .json.gz compressed): "
        "every event the app shows, to play back in its Recordings picker",
    )
    p.set_defaults(func=cmd_run)
