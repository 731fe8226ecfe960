"""Times the app as a visitor sees it: Send -> a token in every pane, Send -> Done, in headless Chromium;
then the same prompt and strategies with `bench run`, and each pane's ms/token from both side by side.

    .venv/bin/python scripts/app_timing.py [REPEATS] [SCREENSHOT.png]     (needs Debian's chromium: `make browser`)

The app is launched in-process with its default panes and 64 new tokens; prints one line per repeat, then
the table (the app's figure is what its scoreboard and pane show: the last turn's mean ms per decode step).
With SCREENSHOT, the first screen (1280x720) after the last turn: the scoreboard with each pane's own figures and the
step's wall time below them.
"""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright import sync_api  # noqa: E402

from kvdirect_app.ui import build_demo  # noqa: E402
from tests.conftest import launch_local  # noqa: E402
from tests.test_browser import ARGS, CHROMIUM  # noqa: E402

PROMPT = "Why is the sky blue?"
EVERY_PANE_HAS_A_TOKEN = """() => {
  const panes = [...document.querySelectorAll('.kvd-pane')].filter(p => p.offsetParent);
  return panes.length && panes.every(p => {
    const bot = p.querySelectorAll('[data-testid="bot"]');
    return bot.length && bot[bot.length - 1].innerText.trim().length; }); }"""


def main(repeats: int, shot: str | None = None) -> None:
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
            t0 = time.perf_counter()
            page.click("#kvd-send")
            page.wait_for_function(EVERY_PANE_HAS_A_TOKEN, timeout=300_000, polling=20)
            first = time.perf_counter() - t0
            page.wait_for_function("document.querySelector('#kvd-status').innerText.match(/Done|failed|error/i)",
                                   timeout=600_000, polling=250)  # the poll's own CPU stays small beside the app's
            done = time.perf_counter() - t0
            print(f"first token in every pane {first:.2f} s, Send to Done {done:.2f} s; "
                  f"status: {page.inner_text('#kvd-status')}", flush=True)
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
        print(f"the app's engine time of the last turn (first forward to last token): "
              f"{engine_s[-1] if engine_s else float('nan'):.1f} s; the rest of Send to Done is the page's "
              "(handler, Gradio, Chromium on the same cores)")
        shown = list(session.shown)
        browser.close()
    demo.close()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        subprocess.run([sys.executable, "-m", "kvdirect_app.bench", "run", "--model", "smollm2-135m", "--prompt", PROMPT,
                        "--max-new-tokens", "64", "--strategies", ",".join(shown), "--json", str(out)],
                       check=True, capture_output=True)
        run = json.loads(out.read_text())
        cli = run["strategies"]
    print(f"bench run, same turn: engine time {sum(run['turn_seconds']):.1f} s")
    print(f"{'strategy':58s} {'app ms/step':>12s} {'CLI ms/step':>12s} {'app/CLI':>8s}")
    for label, ms in app_ms.items():
        c = cli[label]["latency_ms"]["decode_total_ms_mean"]
        print(f"{label:58s} {ms:12.1f} {c:12.1f} {ms / c:8.2f}")
    steps = run["steps"]
    print(f"bench run per decode step: wall {steps['wall_ms_mean']:.0f} ms = lanes {steps['lanes_ms_mean']:.0f} + "
          f"measurement {steps['measurement_ms_mean']:.0f} + unattributed {steps['unattributed_ms_mean']:.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2] if len(sys.argv) > 2 else None)
