"""`lmforge ui`, measured in Debian's Chromium through Playwright: page load (navigation start to
the runs list drawn) and curve lag (a line appended to metrics.jsonl until the loss chart shows
it), each repeated; screenshots of each page into bench/ui/.

    .venv/bin/python bench/ui_pages.py --runs runs/quickstart --registry registry --repeats 10

--runs: a directory of finished runs to show (the quickstart's is a good one); the lag is measured on
a scratch run written next to them (and removed after). --registry: a registry directory with at
least one pushed model (`lmforge push runs/quickstart/sft --to registry`), for its page.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "bench" / "ui"
CHAT_PROMPT = "Which group is shovel in: fruit, animal, color or tool?"  # a quickstart test question
BAD_CONFIG = "run: {name: my-run}\nmodel: {preset: llama-tiny}\ntokenizer: {train: {vocab_size: 300}}\n"
BAD_CONFIG += "data: {train: [{path: 'builtin:python-stdlib'}]}\ntrain: {max_steps: 30, lr: -1}\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", required=True)
    parser.add_argument("--registry", default="registry")
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    from playwright.sync_api import sync_playwright

    runs = Path(opts.runs).resolve()
    scratch = runs / "ui-bench-lag"
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "events").mkdir(parents=True)
    (scratch / "config.yaml").write_text("run: {name: ui-bench-lag}\n")
    metrics = scratch / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 100}) + "\n" for s in range(1, 51)))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli.main", "ui", "--runs", str(runs), "--port", str(port)]
        + ["--registry", str(Path(opts.registry).resolve())],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().split("open ", 1)[1].split()[0]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=shutil.which("chromium"), args=["--no-sandbox"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url)  # sets the cookie
            loads = []
            for _ in range(opts.repeats):
                start = time.perf_counter()
                page.goto(url.split("?")[0])
                page.wait_for_selector("#runs li")
                loads.append(time.perf_counter() - start)
            lags = []
            page.click('#runs li[data-name="ui-bench-lag"]')
            page.wait_for_selector('[data-chart="loss"]')
            for i in range(opts.repeats):
                value = 1.0 + i / 1000
                with metrics.open("a") as handle:
                    start = time.perf_counter()
                    handle.write(json.dumps({"step": 51 + i, "loss": value}) + "\n")
                page.wait_for_function(
                    f"document.querySelector('[data-chart=\"loss\"] h3').textContent.includes('{value:.3f}')",
                    polling="raf",
                    timeout=10_000,
                )
                lags.append(time.perf_counter() - start)
            SHOTS.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(scratch)  # the screenshots show the runs as they are
            page.goto(url.split("?")[0])
            first = next(p.name for p in sorted(runs.iterdir()) if (p / "metrics.jsonl").is_file())
            page.click(f'#runs li[data-name="{first}"]')
            page.wait_for_selector('[data-chart="loss"]')
            page.wait_for_timeout(1500)
            page.screenshot(path=str(SHOTS / "run.png"), full_page=True)
            names = [p.name for p in sorted(runs.iterdir()) if (p / "metrics.jsonl").is_file()]
            for name in names[:2]:
                page.locator(f'#runs li[data-name="{name}"] .pick').check()
            page.click("#watch")
            page.wait_for_selector('#watch-charts [data-chart="loss"]')
            page.wait_for_timeout(1500)
            page.screenshot(path=str(SHOTS / "watch.png"), full_page=True)
            with page.expect_popup() as popup:  # runs compare's page for the two checked runs
                page.click("#compare")
            popup.value.wait_for_load_state()
            popup.value.set_viewport_size({"width": 1400, "height": 900})
            popup.value.screenshot(path=str(SHOTS / "compare.png"))
            popup.value.close()
            page.click("#open-chat")  # two models side by side: final/ in transformers, its ONNX export
            page.wait_for_selector("#pane-a .target option", state="attached")
            targets = page.locator("#pane-a .target option").evaluate_all(
                "options => options.map(o => o.value)"
            )
            pair = [t for t in targets if t.endswith("/final")][-1:] + [
                t for t in targets if t.endswith("/onnx")
            ][:1]
            for pane, target in zip(("#pane-a", "#pane-b"), pair, strict=False):
                page.select_option(f"{pane} .target", target)
            page.fill("#chat-input", CHAT_PROMPT)
            page.press("#chat-input", "Enter")
            for pane in ("#pane-a", "#pane-b")[: len(pair)]:
                page.wait_for_selector(f'{pane} .assistant[data-done="true"]', timeout=120_000)
            page.screenshot(path=str(SHOTS / "chat.png"))
            page.click("#open-registry")
            page.locator("#registry-models button").first.click()
            page.wait_for_selector("#registry-version .card")
            page.click("#registry-version .verify")
            page.wait_for_function("document.querySelector('.integrity').textContent.includes('re-hashed')")
            page.screenshot(path=str(SHOTS / "registry.png"), full_page=True)
            page.click("#new-run")
            page.click("#tab-yaml")
            page.fill("#config", BAD_CONFIG)
            page.wait_for_function("document.querySelector('#problems').textContent.includes('train.lr')")
            page.screenshot(path=str(SHOTS / "editor.png"))
            page.click("#tab-form")
            page.wait_for_selector('#form [data-key="train.lr"]')
            page.screenshot(path=str(SHOTS / "form.png"))
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"page load (goto -> runs list drawn) s: median {statistics.median(loads):.3f}, max {max(loads):.3f}"
    )
    print(
        f"curve lag (line appended -> chart shows it) s: median {statistics.median(lags):.3f}, max {max(lags):.3f}"
    )
    print(
        f"screenshots: {', '.join(str(SHOTS / n) for n in ('run.png', 'watch.png', 'compare.png', 'chat.png', 'registry.png', 'editor.png', 'form.png'))}"
    )


if __name__ == "__main__":
    main()
