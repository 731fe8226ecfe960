"""Times the app as a visitor sees it: Send -> a token in every pane, Send -> Done, in headless Chromium;
then the same prompt and strategies with `bench run`, and each pane's ms/token from both side by side.

    .venv/bin/python scripts/app_timing.py [REPEATS] [SCREENSHOT.png] [--json OUT]   (needs `make browser`)

The app is launched in-process with its default panes and 64 new tokens; prints one line per repeat, then
the table (the app's figure is what its scoreboard and pane show: the last turn's mean ms per decode step).
Each repeat also says where the machine's CPU time went during the turn: the app's compute thread (the engine),
the OpenMP workers beside it (torch's and the fixed-order kernels' team), the web server's and handlers' threads,
and Chromium's processes.  With SCREENSHOT, the first screen (1280x720) after the last turn: the scoreboard with each
pane's own figures and the step's wall time below them.  `--json` writes every figure (docs/perf.md renders them).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright import sync_api  # noqa: E402

from kvdirect_app.app.ui import build_demo  # noqa: E402
from tests.app.test_browser import ARGS, CHROMIUM  # noqa: E402
from tests.conftest import launch_local  # noqa: E402

PROMPT = "Why is the sky blue?"
EVERY_PANE_HAS_A_TOKEN = """() => {
  const panes = [...document.querySelectorAll('.kvd-pane')].filter(p => p.offsetParent);
  return panes.length && panes.every(p => {
    const bot = p.querySelectorAll('[data-testid="bot"]');
    return bot.length && bot[bot.length - 1].innerText.trim().length; }); }"""


def _ticks(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[tuple[str, int], float]:
    """CPU seconds so far of each of this process's threads, keyed (role, thread id) (roles: the compute thread
    `engine`, the OpenMP workers beside it, Gradio's `handlers`, the web `server` and other Python threads), and of
    each of Chromium's processes (`chromium`).  Per thread, so that a turn's figure is each thread's own growth: a
    thread that ends within the turn takes its CPU time with it (left out, never subtracted)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[tuple[str, int], float] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            seconds = _ticks(open(f"/proc/self/task/{task}/stat").read())
        except OSError:
            continue
        name = names.get(int(task), "")
        role = (
            "engine"
            if name.startswith("kvdirect-compute")
            else "handlers"
            if name.startswith("AnyIO")
            else "server"
            if name
            else "openmp_workers"
        )
        out[role, int(task)] = seconds
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "chrom" in open(f"/proc/{pid}/comm").read():
                out["chromium", int(pid)] = _ticks(open(f"/proc/{pid}/stat").read())
        except OSError:
            continue
    return out


def main(repeats: int, shot: str | None = None, json_out: str | None = None) -> None:
    report = {"prompt": PROMPT, "cpus": os.cpu_count(), "turns": []}
    demo = build_demo(model="smollm2-135m", max_new_tokens=64)
    launch_local(demo)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(demo.local_url)
        page.wait_for_selector("#kvd-send", timeout=60_000)
        page.wait_for_function("document.querySelector('#kvd-status').innerText.includes('ready')", timeout=300_000)
        for i in range(repeats):
            if i:
                page.get_by_role("button", name="Clear").click()
                time.sleep(2)
            page.fill("#kvd-prompt textarea", PROMPT)
            before = cpu_seconds()
            t0 = time.perf_counter()
            page.click("#kvd-send")
            page.wait_for_function(EVERY_PANE_HAS_A_TOKEN, timeout=300_000, polling=20)
            first = time.perf_counter() - t0
            page.wait_for_function(
                "document.querySelector('#kvd-status').innerText.match(/Done|failed|error/i)",
                timeout=600_000,
                polling=250,
            )  # the poll's own CPU stays small beside the app's
            done = time.perf_counter() - t0
            after = cpu_seconds()
            cpu: dict[str, float] = {}
            for (role, ident), seconds in after.items():
                cpu[role] = round(cpu.get(role, 0.0) + seconds - before.get((role, ident), 0.0), 2)
            report["turns"].append(
                {
                    "first_token_s": round(first, 2),
                    "send_to_done_s": round(done, 2),
                    "cpu_s": cpu,
                    "cpu_offered_s": round(done * (os.cpu_count() or 1), 1),
                }
            )
            print(
                f"first token in every pane {first:.2f} s, Send to Done {done:.2f} s; "
                f"status: {page.inner_text('#kvd-status')}",
                flush=True,
            )
            print(
                f"  CPU s in the turn (of {done * (os.cpu_count() or 1):.1f} offered): "
                + ", ".join(f"{role} {s:.1f}" for role, s in sorted(cpu.items(), key=lambda kv: -kv[1])),
                flush=True,
            )
        steps = page.inner_text("#kvd-board")
        rows = ("every pane", "measurement", "unattributed", "step")
        print("the scoreboard's step rows:", " | ".join(line for line in steps.splitlines() if line.startswith(rows)))
        if shot:
            page.set_viewport_size({"width": 1280, "height": 720})
            page.evaluate("window.scrollTo(0, 0)")
            time.sleep(1)
            page.screenshot(path=shot)
            print(f"wrote {shot}")
        session = next(iter(demo.kvd_handlers.visitors.values()))  # before the tab closes and frees it
        app_ms = {label: session.lanes[label].turn_figures()["ms_per_token"] for label in session.shown}
        engine_s = (session.result or {}).get("turn_seconds", [])
        print(
            f"the app's engine time of the last turn (first forward to last token): "
            f"{engine_s[-1] if engine_s else float('nan'):.1f} s; the rest of Send to Done is the page's "
            "(handler, Gradio, Chromium on the same cores)"
        )
        shown = list(session.shown)
        browser.close()
    demo.close()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvdirect_app.bench",
                "run",
                "--model",
                "smollm2-135m",
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "64",
                "--strategies",
                ",".join(shown),
                "--json",
                str(out),
            ],
            check=True,
            capture_output=True,
        )
        run = json.loads(out.read_text())
        cli = run["strategies"]
    print(f"bench run, same turn: engine time {sum(run['turn_seconds']):.1f} s")
    report.update(
        app_engine_s=engine_s[-1] if engine_s else None,
        cli_engine_s=sum(run["turn_seconds"]),
        kernels=run["kernels"]["mode"],
        linears=run["kernels"].get("dots_path"),
        panes={
            label: {"app_ms_per_step": ms, "cli_ms_per_step": cli[label]["latency_ms"]["decode_total_ms_mean"]}
            for label, ms in app_ms.items()
        },
        cli_steps={
            k: run["steps"][k] for k in ("wall_ms_mean", "lanes_ms_mean", "measurement_ms_mean", "unattributed_ms_mean")
        },
    )
    print(f"{'strategy':58s} {'app ms/step':>12s} {'CLI ms/step':>12s} {'app/CLI':>8s}")
    for label, ms in app_ms.items():
        c = cli[label]["latency_ms"]["decode_total_ms_mean"]
        print(f"{label:58s} {ms:12.1f} {c:12.1f} {ms / c:8.2f}")
    steps = run["steps"]
    print(
        f"bench run per decode step: wall {steps['wall_ms_mean']:.0f} ms = lanes {steps['lanes_ms_mean']:.0f} + "
        f"measurement {steps['measurement_ms_mean']:.0f} + unattributed {steps['unattributed_ms_mean']:.0f}"
    )
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {json_out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repeats", nargs="?", type=int, default=2)
    parser.add_argument("shot", nargs="?")
    parser.add_argument("--json")
    args = parser.parse_args()
    main(args.repeats, args.shot, args.json)
