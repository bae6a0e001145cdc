"""report.html as a user sees it: headless Chromium opens the file (offline, file://), a small
script added to a copy of the page measures the rendered plots, and a screenshot is saved.

Needs Debian's chromium (`apt-get install chromium`); skipped with that hint without it.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmforge.report import write_comparison, write_report
from tests.test_report import build_run

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MEASURE_ID = "lmforge-measure"
# Runs in the copy only (the report itself has no script): one JSON document with the size of
# every plot, of its drawn lines and of its event markers, written into the DOM for --dump-dom.
MEASURE_SCRIPT = f"""<script>
const box = e => {{ const r = e.getBoundingClientRect(); return [r.width, r.height]; }};
const plots = [...document.querySelectorAll("svg.plot")].map(svg => ({{
  metric: svg.dataset.metric, size: box(svg),
  lines: [...svg.querySelectorAll("polyline.series")].map(box),
  bars: svg.querySelectorAll("rect.bar").length,
  events: [...svg.querySelectorAll("g.event")].map(g => [g.dataset.kind, ...box(g)]),
}}));
const pre = document.createElement("pre"); pre.id = "{MEASURE_ID}";
pre.textContent = JSON.stringify(plots); document.body.appendChild(pre);
</script>"""


def _browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("Chromium not found: install Debian's chromium (`apt-get install chromium`) to run this test")


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start; the page is ours.
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    command += [f"--user-data-dir={profile}", "--no-first-run", "--disable-extensions", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def _measure(browser: str, page: Path, tmp_path: Path) -> list[dict]:
    probe = tmp_path / f"measure-{page.name}"
    probe.write_text(page.read_text().replace("</body>", MEASURE_SCRIPT + "</body>"))
    result = _chromium(
        browser,
        tmp_path / "profile",
        "--window-size=1400,1000",
        "--virtual-time-budget=5000",
        "--dump-dom",
        probe.as_uri(),
    )
    found = re.search(rf'<pre id="{MEASURE_ID}">(.*?)</pre>', result.stdout, re.S)
    assert found, f"no measurements in the DOM; chromium said: {result.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def _screenshot(browser: str, page: Path, shot: Path, tmp_path: Path) -> None:
    result = _chromium(
        browser, tmp_path / "profile", "--window-size=1400,3200", f"--screenshot={shot}", page.as_uri()
    )
    assert shot.is_file(), result.stderr[-2000:]
    assert shot.stat().st_size > 20_000  # a blank page compresses to a few kB


def test_report_plots_render_in_chromium(tmp_path: Path) -> None:
    browser = _browser()
    page = write_report(build_run(tmp_path / "runs"), tmp_path / "report.html")
    plots = {p["metric"]: p for p in _measure(browser, page, tmp_path)}
    expected = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory", "data_wait_share"}
    assert expected | {"length_histogram_train"} <= set(plots)
    for metric, plot in plots.items():
        width, height = plot["size"]
        assert width > 100 and height > 50, (metric, plot["size"])
        if metric in expected:
            assert plot["lines"] and all(w > 0 and h >= 0 for w, h in plot["lines"]), (metric, plot["lines"])
            assert max(w for w, _ in plot["lines"]) > 100, metric  # a line across the chart, not a dot
            kinds = {kind for kind, w, h in plot["events"] if h > 0}
            assert {"nonfinite", "skip", "rollback", "oom_backoff", "stall"} <= kinds, (
                metric,
                plot["events"],
            )
    assert plots["length_histogram_train"]["bars"] == 4
    _screenshot(browser, page, tmp_path / "report.png", tmp_path)


def test_comparison_renders_in_chromium(tmp_path: Path) -> None:
    browser = _browser()
    runs = [build_run(tmp_path / "runs", name=n, lr=lr) for n, lr in (("a", 1e-4), ("b", 3e-4))]
    page = write_comparison(runs, tmp_path / "compare.html")
    plots = {p["metric"]: p for p in _measure(browser, page, tmp_path)}
    assert len(plots["compare_loss"]["lines"]) >= 4  # two runs, each broken at its NaN step
    assert all(p["size"][0] > 100 and p["size"][1] > 50 for p in plots.values())
    _screenshot(browser, page, tmp_path / "compare.png", tmp_path)
