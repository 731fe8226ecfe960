"""Every device check in one go, for a borrowed GPU's few minutes (and runnable on the CPU first).

    python scripts/device_check.py --out "$OUT"            # on the device machine (cuda)
    python scripts/device_check.py --device cpu --quick --out /tmp/dc   # the same script, tried here

What it does, each step timed and written as it finishes (a step that fails is recorded, the rest go on):
1. the invariance probe on the device's BLAS: for every linear shape of SmolLM2, fp32 (TF32 off) and bf16,
   which row counts give a large call's rows bit for bit, and whether the block attention passes;
2. exactness in both kernel modes (`invariant`, `native`) on tiny models of three families and on SmolLM2:
   every exact lane bit-equal, its rebuilt token-layers and digest;
3. bytes per lane (allocator) and per-op latency of the seven default panes, lanes batched vs sequential;
4. AnchorKV's replay at a 4,096-token context (`rebuild=step`, spacing 30), ms per token;
5. the strategies inside transformers' `generate` (`strategy_cache`): exact ones give DynamicCache's tokens;
6. recordings of the shipped scenarios on the device (OUT/recordings/*.json.gz, `bench record`);
7. the claims report's exactness and residual-patching cells on the device (a tiny-model `reproduce --quick`:
   OUT/claims/, whose row 7b, exactness on accelerators, is measured there and nowhere else);
8. task scores (`bench tasks --quick`, on SmolLM2; a tiny model with --quick): every lane's answers, the exact
   lanes' checked against the full cache's on the device (OUT/tasks.json);
9. the default memory instrument on the device (the caching allocator's counters around each lane's work): every
   lane's held bytes against its formula (block rounding allowed), its peak, the trace's audit of it, and a window
   that keeps a hidden copy of its keys, which must be caught.
Results: OUT/device_check.json and OUT/device_check.md (the table docs/perf.md takes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kvdirect_app  # noqa: E402,F401  (thread settings before torch)
from kvdirect_app.engine import Engine, run_to_end  # noqa: E402
from kvdirect_app.kernels import invariant as K  # noqa: E402
from kvdirect_app.models import load_model  # noqa: E402
from kvdirect_app.strategies import parse_specs  # noqa: E402

SEVEN = (
    "full,kvdirect:budget=64,anchorkv:spacing=30:budget=64:rebuild=step,h2o:budget=64,streaming_llm:budget=64,"
    "snapkv:budget=64,tova:budget=64"
)
EXACT = "full,kvdirect:budget=16,anchorkv:spacing={s}:budget=16:rebuild=step"  # s: 7 on SmolLM2, 2 on a tiny model
TURNS = ["What is the capital of France? Answer in one sentence.", "And of Italy?"]


def probe(device: str, out: dict):
    """The invariance probe on this device (cuBLAS: TF32 off), fp32 and bf16: each linear shape's proven row counts,
    the block attention's, and the attention probe proper (one query alone / among many / among lanes)."""
    import functools

    from kvdirect_app.kernels import probes

    loaded = load_model("smollm2-135m", dtype="float32", device=device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    threads = torch.get_num_threads()
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        shapes = {tuple(m.weight.shape) for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)}
        for shape in sorted(shapes):
            w = torch.randn(shape, device=device, dtype=dtype)
            v = probes.probe_linear(w, None, threads)
            rows[f"{dtype} {shape}"] = {
                "proven": list(v.counts),
                "failed": list(v.failed),
                "across_threads": v.across_threads,
            }
        verdict = probes.probe_attention_rows(64, dtype, device)
        attention = functools.partial(K.block_attention, rows=verdict)
        ok, why = probes.probe_attention(attention, 9, 3, 64, dtype, device, threads)
        rows[f"{dtype} block attention"] = {"proven": list(verdict.counts), "same_bits": ok, "why_not": why}
    out["probe"] = rows


def exactness(device: str, out: dict, quick: bool):
    table = {}
    models = ["tiny-llama", "tiny-qwen3", "tiny-gemma3"] + ([] if quick else ["smollm2-135m"])
    for name in models:
        for dtype in ("float32", "bfloat16"):
            loaded = load_model(name, dtype=dtype, device=device)
            specs = EXACT.format(s=7 if name == "smollm2-135m" else 2)
            for kernels in ("invariant", "native"):
                r = run_to_end(Engine(loaded, parse_specs(specs), max_new_tokens=10, kernels=kernels), TURNS)
                table[f"{name} {dtype} {kernels}"] = {
                    "ran": r["kernels"]["mode"],
                    "reason": r["kernels"]["reason"],
                    **{
                        s: {
                            "kv_exact": r["strategies"][s]["kv_exact"],
                            "rebuilt": r["strategies"][s]["rebuilt_token_layers"],
                            "digest": r["strategies"][s]["kv_digest"],
                        }
                        for s in specs.split(",")
                    },
                }
    out["exactness"] = table


def seven(device: str, out: dict, quick: bool):
    loaded = load_model("smollm2-135m", dtype="float32", device=device)
    n = 16 if quick else 64
    table = {}
    for kernels in ("invariant", "native"):
        for batch in (True, False):
            r = run_to_end(
                Engine(loaded, parse_specs(SEVEN), max_new_tokens=n, kernels=kernels, batch=batch),
                ["Why is the sky blue?"],
            )
            table[f"{kernels} {'batched' if batch else 'sequential'}"] = {
                "turn_seconds": r["turn_seconds"],
                "ran": r["kernels"]["mode"],
                "steps": r["steps"],
                "lanes": {
                    s: {
                        "ms_per_step": v["latency_ms"]["decode_total_ms_mean"],
                        "ops": {k: v["latency_ms"][k] for k in v["latency_ms"] if k.startswith("decode_")},
                        "peak_bytes": v["state_bytes"].get("peak"),
                        "kv_exact": v["kv_exact"],
                    }
                    for s, v in r["strategies"].items()
                },
            }
    out["seven"] = table


def replay4k(device: str, out: dict, quick: bool):
    loaded = load_model("smollm2-135m", dtype="float32", device=device)
    from kvdirect_app.models.prompts import filler_ids

    context = 512 if quick else 4096
    ids = filler_ids(loaded.tokenizer, context)
    table = {}
    for kernels in ("invariant", "native"):
        engine = Engine(
            loaded,
            parse_specs("full,anchorkv:spacing=30:budget=16:rebuild=step"),
            max_new_tokens=4,
            kernels=kernels,
            memory="none",
        )
        for _ in engine.turn("context", ids=ids):
            pass
        r = engine.results()
        table[kernels] = {
            s: {"ms_per_step": v["latency_ms"]["decode_total_ms_mean"], "kv_exact": v["kv_exact"]}
            for s, v in r["strategies"].items()
        }
    out["replay"] = {"context": context, **table}


def generate(device: str, out: dict, quick: bool):
    """Greedy `generate` with each exact strategy's cache against transformers' DynamicCache, two turns."""
    from kvdirect_app import strategy_cache
    from kvdirect_app.models.compat import DynamicCache

    table = {}
    for name in ["tiny-llama", "tiny-gemma3"] + ([] if quick else ["smollm2-135m"]):
        loaded = load_model(name, dtype="float32", device=device)
        model, tok = loaded.model, loaded.tokenizer
        greedy = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)

        def two_turns(cache):
            ids = torch.tensor([tok.encode(TURNS[0])], device=device)
            first = model.generate(ids, cache=cache, **greedy)
            ids2 = torch.cat([first, torch.tensor([tok.encode(" " + TURNS[1])], device=device)], dim=1)
            return model.generate(ids2, cache=cache, **greedy)[0].tolist()

        reference = two_turns(DynamicCache(config=model.config))
        for spec in ("kvdirect:budget=8", "anchorkv:spacing=2:budget=8", "anchorkv:spacing=2:budget=8:rebuild=step"):
            t0 = time.monotonic()
            with strategy_cache(model, spec) as cache:
                same = two_turns(cache) == reference
            table[f"{name} {spec}"] = {
                "same_tokens": same,
                "seconds": round(time.monotonic() - t0, 2),
                "rebuilt": cache.report()["rebuilt_token_layers"],
            }
    out["generate"] = table


def recordings(device: str, out: dict, quick: bool, dest: Path):
    """The shipped scenarios recorded on this device (`bench record`, the page's default panes), to ship beside the
    CPU ones in presets/recordings/ (each labelled with its device and date when played)."""
    import subprocess

    folder = dest / "recordings"
    folder.mkdir(parents=True, exist_ok=True)
    plan = (
        [("recall-tiny-llama", ["--model", "tiny-llama", "--scenario", "recall", "--max-new-tokens", "4"])]
        if quick
        else [
            (f"recall-smollm2-135m-{device}", ["--model", "smollm2-135m", "--scenario", "recall"]),
            (f"long-document-gemma3-270m-{device}", ["--model", "gemma3-270m", "--scenario", "long-document"]),
            (
                f"twenty-turns-smollm2-135m-{device}",
                ["--model", "smollm2-135m", "--scenario", "twenty-turns", "--max-new-tokens", "24"],
            ),
        ]
    )
    table = {}
    for name, args in plan:
        t0 = time.monotonic()
        path = folder / f"{name}.json.gz"
        done = subprocess.run(
            [sys.executable, "-m", "kvdirect_app.bench", "record", *args, "--device", device, "--out", str(path)],
            capture_output=True,
            text=True,
        )
        table[name] = {
            "rc": done.returncode,
            "seconds": round(time.monotonic() - t0, 1),
            "bytes": path.stat().st_size if path.is_file() else None,
            "error": done.stderr.strip().splitlines()[-1:] if done.returncode else None,
        }
    out["recordings"] = table


def claims(device: str, out: dict, quick: bool, dest: Path):
    """`bench reproduce --quick` on a tiny model, every cell on this device: rows 7 and 7b (exactness on CPU and
    on accelerators) and 8 (residual patching) as the report judges them."""
    from kvdirect_app.claims import cells, render

    results = cells.gather("tiny-llama", quick=True, executor="local", device=device, workers=1)
    render.write(results, dest / "claims")
    out["claims"] = {
        name: {"verdict": c["verdict"], "measured_on": c["measured_on"]}
        for name, c in results["claims"].items()
        if name in ("exactness", "exactness_accelerator", "patching")
    }


def tasks(device: str, out: dict, quick: bool, dest: Path):
    """`bench tasks --quick` on the device: scores per strategy beside the full cache's, exact answers checked."""
    from kvdirect_app.benchmarks import api as benchmarks
    from kvdirect_app.plain.schema import stamp

    small = dict(model="tiny-llama", contexts="512", tasks="niah_single_number") if quick else {}
    result = benchmarks.tasks(benchmarks.TasksConfig(quick=True, device=device, **small), say=lambda line: None)
    (dest / "tasks.json").write_text(json.dumps(stamp("tasks", result)))
    out["tasks"] = {
        "exact_answers_equal_full": result["exact_answers_equal_full"],
        "seconds": result["seconds"],
        "rows": {r["spec"]: [r["score"], r["full_score"]] for r in result["rows"]},
    }


def meters(device: str, out: dict, quick: bool):
    from dataclasses import dataclass

    from kvdirect_app.strategies import Strategy
    from kvdirect_app.strategies.window import Window

    @dataclass
    class LeakyWindow(Window):  # a copy of the candidates' keys kept in score(): the default run must catch it
        name = "device_check_leaky_window"

        def score(self, step):
            self.copy = step.keys.clone()
            return super().score(step)

    loaded = load_model("tiny-llama" if quick else "smollm2-135m", dtype="float32", device=device)
    seven = SEVEN.replace("spacing=30", "spacing=2") if quick else SEVEN
    specs = f"{seven},window:budget=64,device_check_leaky_window:budget=64"
    table = {}
    try:
        for memory in ("auto", "trace"):
            r = run_to_end(
                Engine(
                    loaded,
                    parse_specs(specs.replace("=64", "=4") if quick else specs),
                    max_new_tokens=8 if quick else 32,
                    memory=memory,
                ),
                TURNS,
            )
            table[memory] = {
                "instrument": r["memory_instrument"],
                "lanes": {
                    s: {
                        k: v["state_bytes"][k]
                        for k in (
                            "between_turns_peak",
                            "formula_between_turns_peak",
                            "peak",
                            "peak_source",
                            "formula_matches_measurement",
                            "mismatch_count",
                            "declared_mismatch_count",
                            "meter_audit",
                        )
                    }
                    for s, v in r["strategies"].items()
                },
            }
    finally:
        Strategy.registry.pop(LeakyWindow.name, None)
    out["meters"] = table


def markdown(out: dict) -> str:
    lines = [f"# Device check: {out['device']} ({out.get('name', '')})", ""]
    for section, rows in out.items():
        if isinstance(rows, dict):
            lines += [f"## {section}", "", "```", json.dumps(rows, indent=1)[:20000], "```", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="short runs (a CPU try of the script)")
    args = ap.parse_args()
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    out = {
        "device": args.device,
        "torch": torch.__version__,
        "name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "timings_s": {},
    }
    for step in (probe, exactness, seven, replay4k, generate, recordings, claims, tasks, meters):
        t0 = time.monotonic()
        try:
            if step is probe:
                step(args.device, out)
            elif step in (recordings, claims, tasks):
                step(args.device, out, args.quick, dest)
            else:
                step(args.device, out, args.quick)
        except Exception:
            out[f"{step.__name__}_error"] = traceback.format_exc()[-2000:]
        out["timings_s"][step.__name__] = round(time.monotonic() - t0, 1)
        (dest / "device_check.json").write_text(json.dumps(out, indent=1, default=str))
        (dest / "device_check.md").write_text(markdown(out))
        print(f"{step.__name__}: {out['timings_s'][step.__name__]} s", flush=True)
    return 1 if any(k.endswith("_error") for k in out) else 0


if __name__ == "__main__":
    sys.exit(main())
