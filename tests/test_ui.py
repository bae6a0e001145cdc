"""`lmforge ui`: who may use it (token, Host, CSRF, paths inside the runs and registry directories),
and a user's session in a real browser — Debian's Chromium driven by Playwright (pointed at the
system browser; nothing is downloaded): build a config in the form, see the CLI's error for a bad
value, launch it on two processes, watch the loss curve grow, stop (a checkpoint on every rank),
resume to the end, compare and watch two runs, read doctor's findings, browse the registry, chat
with the result."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from lmforge.ui.app import create_app
from lmforge.ui.registry import RegistryView
from lmforge.ui.runs import RunsRoot
from lmforge.ui.security import Access
from tests.conftest import SMALL_ARCH, run_cli, save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _fake_run(root: Path, name: str) -> Path:
    run = root / name
    (run / "events").mkdir(parents=True)
    (run / "config.yaml").write_text(f"run: {{name: {name}}}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n')
    return run


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, Access, Path]]:
    root = tmp_path / "runs"
    _fake_run(root, "a")
    access = Access("127.0.0.1", 8765)
    app = create_app(RunsRoot(root, cwd=REPO), access, RegistryView(tmp_path / "registry"))
    with TestClient(app, base_url="http://127.0.0.1:8765") as test_client:
        yield test_client, access, root


def test_the_token_opens_the_ui_and_nothing_else_does(client: tuple[TestClient, Access, Path]) -> None:
    http, access, _ = client
    assert http.get("/api/runs").status_code == 403  # no cookie yet
    assert http.get("/?token=wrong", follow_redirects=False).status_code == 403
    opened = http.get(f"/?token={access.token}", follow_redirects=False)
    assert opened.status_code == 303 and opened.headers["location"] == "/"  # the token leaves the address bar
    assert "HttpOnly" in opened.headers["set-cookie"] and "SameSite=Strict" in opened.headers["set-cookie"]
    runs = http.get("/api/runs").json()["runs"]  # the cookie now rides along
    assert [(r["name"], r["steps"], r["running"]) for r in runs] == [("a", 2, False)]
    page = http.get("/").text
    assert access.csrf in page and access.token not in page
    # DNS rebinding: another Host, even with the cookie, gets nothing.
    assert http.get("/api/runs", headers={"host": "evil.example:8765"}).status_code == 400


def test_actions_need_the_pages_csrf_token_and_paths_stay_inside_the_runs_directory(
    client: tuple[TestClient, Access, Path], tmp_path: Path
) -> None:
    http, access, root = client
    http.get(f"/?token={access.token}")
    assert http.post("/api/validate", json={"config": "run: {name: x}"}).status_code == 403  # no CSRF header
    secret = _fake_run(tmp_path, "outside")
    (root / "link").symlink_to(secret)  # a run directory that resolves outside the root
    for name in ("..", "..%2Foutside", "%2E%2E", "link", ".ui", "nope"):
        response = http.get(f"/api/runs/{name}")
        assert response.status_code == 404, (name, response.text)
    stop = http.post("/api/runs/..%2Foutside/stop", headers={"x-csrf-token": access.csrf})
    assert stop.status_code == 404
    assert http.get("/api/runs/a").json()["steps"] == 2
    assert [r["name"] for r in http.get("/api/runs").json()["runs"]] == [
        "a"
    ]  # the symlinked run is not listed
    # A config may not make the UI write outside its runs directory.
    elsewhere = "run: {name: x}\nmodel: {preset: llama-tiny}\ntokenizer: {train: {vocab_size: 300}}\n"
    elsewhere += f"data: {{train: [{{path: corpus.txt}}], cache_dir: {tmp_path / 'elsewhere'}}}\n"
    refused = http.post("/api/validate", json={"config": elsewhere}, headers={"x-csrf-token": access.csrf})
    assert refused.status_code == 400 and "data.cache_dir" in refused.json()["error"]
    assert "outside the UI's runs directory" in refused.json()["error"]


def test_validation_gives_the_clis_own_message_and_writes_nothing_outside_the_root(
    client: tuple[TestClient, Access, Path], tmp_path: Path
) -> None:
    http, access, root = client
    http.get(f"/?token={access.token}")
    config = "run: {name: x, output_dir: /tmp/elsewhere}\nmodel: {preset: llama-tiny}\ntrain: {lr: -1}\n"
    refused = http.post("/api/validate", json={"config": config}, headers={"x-csrf-token": access.csrf})
    assert refused.status_code == 400
    assert "config:3: train.lr: Input should be greater than 0" in refused.json()["error"]
    assert not Path("/tmp/elsewhere").exists() or not (Path("/tmp/elsewhere") / "x").exists()
    assert sorted(p.name for p in (root / ".ui").iterdir()) == ["draft.yaml"]


def _chromium() -> str:
    found = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    assert found, "Chromium not found: install Debian's chromium (`apt-get install chromium`; .ci/run does)"
    return found


@pytest.mark.slow
def test_a_user_builds_launches_watches_stops_and_resumes_a_run_in_a_browser(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=30_000)  # two cores shared with the run being watched

    runs = tmp_path / "runs"
    baseline = _fake_run(runs, "baseline")  # an earlier run to compare with and watch beside
    (baseline / "config.yaml").write_text("run: {name: baseline, seed: 7}\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli.main", "ui", "--runs", str(runs), "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        url = re.search(r"http://\S+", line)
        assert url, line + server.stdout.read()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(url.group(0))
            expect(page.locator("#run-name")).to_have_text("baseline")  # the UI opens the first run
            page.click("#new-run")
            expect(page.locator("#editor")).to_be_visible()  # a new run is built on the form
            expect(page.locator("#problems")).to_contain_text("valid: run my-run", timeout=15_000)
            expect(page.locator("#estimate")).to_contain_text(
                "recommended: ddp"
            )  # lmforge estimate's verdict

            def set_field(key: str, value: str) -> None:
                field = page.locator(f'#form [data-key="{key}"]')
                field.fill(value)
                field.blur()  # the form writes a field on change, as a user leaving it

            set_field("train.lr", "-1")
            expect(page.locator("#problems")).to_contain_text("train.lr: Input should be greater than 0")
            lr_field = page.locator('#form label.field:has([data-key="train.lr"]) .field-error')
            expect(lr_field).to_contain_text("train.lr: Input should be greater than 0")  # next to the field
            expect(page.locator("#launch")).to_be_disabled()
            set_field("train.lr", "0.003")
            expect(lr_field).to_have_count(0)
            set_field("train.max_steps", "80")
            set_field("train.save_every", "1000")
            expect(page.locator("#problems")).to_contain_text("valid: run my-run", timeout=15_000)
            page.click("#tab-yaml")  # the same config as YAML: the form's values are there
            config = page.locator("#config")
            text = config.input_value()
            assert "max_steps: 80" in text and "lr: 0.003" in text and "save_every: 1000" in text, text
            arch = json.dumps(SMALL_ARCH).replace('"', "")
            config.fill(re.sub(r"config: \{.*\}", f"config: {arch}", text))
            expect(page.locator("#problems")).to_contain_text("valid: run my-run", timeout=15_000)
            page.click("#tab-form")
            expect(page.locator('#form [data-key="train.max_steps"]')).to_have_value("80")
            page.fill("#processes", "2")  # lmforge launch --nproc-per-node 2: a DDP run on gloo
            page.click(
                "#launch"
            )  # straight from the field, as a user would: its change must not eat the click

            expect(page.locator("#run-name")).to_have_text("my-run")
            expect(page.locator("#run-status")).to_have_text("running", timeout=60_000)
            loss = page.locator('[data-chart="loss"] h3')
            expect(loss).to_be_visible(timeout=60_000)
            # SIGTERM to rank 0: the ranks agree to stop at one step boundary, checkpoint, exit 0.
            page.click("#stop")
            expect(page.locator("#run-status")).to_have_text("interrupted", timeout=60_000)
            facts = page.locator("#run-facts")
            expect(facts).to_contain_text("exit code 0", timeout=60_000)
            expect(facts).to_contain_text("2 processes (lmforge launch)")
            page.click("#new-run")
            expect(page.locator("#estimate")).to_contain_text("2 GPUs")  # the estimate follows the processes
            page.locator('#runs li[data-name="my-run"]').click()
            expect(facts).to_contain_text("checkpoints: step-")
            stopped_at = int(re.search(r"step (\d+)", facts.inner_text()).group(1))  # type: ignore[union-attr]
            assert 0 < stopped_at < 80
            expect(page.locator("#events")).to_contain_text("signal")

            page.fill("#extend", "90")  # resume, and extend the run to 90 steps
            page.click("#resume")
            expect(page.locator("#run-status")).to_have_text("finished", timeout=120_000)
            expect(facts).to_contain_text("step 90", timeout=15_000)
            expect(facts).to_contain_text("exit code 0", timeout=15_000)  # the waiter recorded how it ended
            expect(page.locator("#runs li")).to_have_count(2)
            expect(page.locator("#doctor")).to_contain_text(re.compile(r"no findings|error:|warning:|info:"))

            # Two runs: compared (their config difference) and watched together (a line each).
            for name in ("baseline", "my-run"):
                page.locator(f'#runs li[data-name="{name}"] .pick').check()
            with page.expect_popup() as popup:
                page.click("#compare")
            expect(popup.value.locator("body")).to_contain_text("run.seed")
            popup.value.close()
            page.click("#watch")
            expect(page.locator("#watch-legend")).to_contain_text("my-run (finished, step 90)")
            expect(page.locator('#watch-charts [data-chart="loss"] h3')).to_contain_text("baseline 2.000")
            expect(page.locator('#watch-charts [data-chart="loss"] h3')).to_contain_text("my-run")

            # The registry: the run pushed by the CLI, its lineage, card and re-hashed files.
            pushed = run_cli("push", str(runs / "my-run"), "--to", str(tmp_path / "registry"))
            assert pushed.returncode == 0, pushed.stderr
            page.click("#open-registry")
            page.click('#registry-models button[data-version="my-run:1"]')
            expect(page.locator("#registry-version .card")).to_contain_text("my-run")
            page.click("#registry-version .verify")
            expect(page.locator("#registry-version .integrity")).to_have_text(
                "files: ok (every file re-hashed)"
            )

            # Chat with the result, the same model in both panes: greedy answers, identical.
            page.click("#open-chat")
            for pane in ("#pane-a", "#pane-b"):
                page.select_option(f"{pane} .target", "my-run/final")
            page.fill("#chat-input", "def main():")
            page.press("#chat-input", "Enter")
            for pane in ("#pane-a", "#pane-b"):
                expect(page.locator(f'{pane} .assistant[data-done="true"]')).to_have_count(1, timeout=60_000)
            replies = [page.locator(f"{pane} .assistant").inner_text() for pane in ("#pane-a", "#pane-b")]
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    metrics = [json.loads(line) for line in (runs / "my-run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if "loss" in m]
    assert steps == sorted(set(steps)) and steps[-1] == 90  # resumed, never repeated
    manifest = json.loads((runs / "my-run" / "manifest.json").read_text())
    assert manifest["distributed"]["world_size"] == 2  # two processes trained it, and resumed it
    assert json.loads((runs / ".ui" / "my-run.exit").read_text()) == 0
    generated = run_cli("generate", str(runs / "my-run" / "final"), "--prompt", "def main():")
    assert generated.returncode == 0, generated.stderr
    assert replies[0] == replies[1] and replies[0].strip() == generated.stdout.strip()  # the CLI's answer


def test_the_form_is_the_schema_and_edits_the_same_yaml(client: tuple[TestClient, Access, Path]) -> None:
    http, access, _ = client
    http.get(f"/?token={access.token}")
    fields = {f["key"]: f for f in http.get("/api/schema").json()["fields"]}
    assert fields["train.lr"]["kind"] == "float" and fields["train.lr"]["description"]
    assert fields["model.dtype"]["choices"] == ["float32", "bfloat16", "float16"]
    assert fields["data.train"]["kind"] == "yaml" and "data.train.path" not in fields  # a list: YAML only
    post = {"headers": {"x-csrf-token": access.csrf}}
    text = "run: {name: x}\ntrain: {lr: 0.1}\n"
    text = http.post(
        "/api/config/set", json={"config": text, "key": "train.lora.r", "value": "8"}, **post
    ).json()["config"]
    text = http.post("/api/config/set", json={"config": text, "key": "train.lr", "value": ""}, **post).json()[
        "config"
    ]
    assert http.post("/api/config/parse", json={"config": text}, **post).json()["values"] == {
        "run": {"name": "x"},
        "train": {"lora": {"r": 8}},
    }
    examples = http.get("/api/examples").json()["examples"]  # a new run can start from one
    assert "pretrain_tiny.yaml" in examples and "sft_lora.yaml" in examples
    shown = http.get("/api/examples/sft_lora.yaml").json()["config"]
    assert shown == (REPO / "examples" / "sft_lora.yaml").read_text()
    for name in ("..%2Fpyproject.toml", "missing.yaml", ".hidden.yaml"):
        assert http.get(f"/api/examples/{name}").status_code == 404, name
    broken = http.post("/api/config/parse", json={"config": "run: [1,"}, **post)
    assert broken.status_code == 400 and "not valid YAML" in broken.json()["error"]
    config = (Path(__file__).parents[1] / "examples" / "pretrain_tiny.yaml").read_text()
    estimate = http.post("/api/estimate", json={"config": config}, **post).json()
    assert {row["strategy"] for row in estimate["strategies"]} >= {"ddp", "zero3", "fsdp"}
    assert estimate["recommendation"]["name"] == "ddp" and estimate["parameters"] > 1_000_000


def test_chat_requests_are_checked_before_any_model_loads(client: tuple[TestClient, Access, Path]) -> None:
    http, access, _ = client
    http.get(f"/?token={access.token}")
    post = {"headers": {"x-csrf-token": access.csrf}}
    hello = [{"role": "user", "content": "hi"}]
    assert http.get("/api/chat/targets").json()["targets"] == []  # run "a" has no final/ yet
    outside = http.post("/api/chat", json={"target": "../a/final", "messages": hello}, **post)
    assert outside.status_code == 404
    nothing = http.post("/api/chat", json={"target": "a/final", "messages": hello}, **post)
    assert nothing.status_code == 400 and "nothing to chat with" in nothing.json()["error"]
    bad = http.post("/api/chat", json={"target": "a/final", "messages": [{"role": "robot"}]}, **post)
    assert bad.status_code == 400 and "role: system|user|assistant" in bad.json()["error"]


def test_report_and_comparison_pages_are_the_report_packages(client: tuple[TestClient, Access, Path]) -> None:
    http, access, root = client
    _fake_run(root, "b")
    (root / "b" / "config.yaml").write_text("run: {name: b, seed: 7}\n")
    http.get(f"/?token={access.token}")
    page = http.get("/runs/a/report")
    assert page.status_code == 200 and "<title>lmforge report: a" in page.text and "loss" in page.text
    both = http.get("/compare?run=a&run=b")
    assert both.status_code == 200 and "run.seed" in both.text  # the config difference, side by side
    assert http.get("/compare?run=a").status_code == 400
    assert http.get("/compare?run=a&run=..").status_code == 404


def test_a_launch_refused_before_its_run_directory_exists_reports_its_exit_and_message(
    tmp_path: Path,
) -> None:
    """A config load_config accepts and `lmforge train` refuses (its data file is missing): no run
    directory ever appears, and the launch's exit code and message are what the page shows."""
    import time

    root = RunsRoot(tmp_path / "runs", cwd=tmp_path)
    config = "run: {name: nodata}\nmodel: {preset: llama-tiny}\ntokenizer: {train: {vocab_size: 300}}\n"
    config += "data: {train: [{path: missing.jsonl}]}\ntrain: {max_steps: 2}\n"
    assert root.launch(config) == "nodata"
    deadline = time.monotonic() + 120
    while root.launch_status("nodata")["exit_code"] is None and time.monotonic() < deadline:
        time.sleep(0.5)
    status = root.launch_status("nodata")
    assert status["exit_code"] == 2 and "missing.jsonl" in status["console"], status
    assert "Traceback" not in status["console"]


def test_a_restarted_ui_finds_a_running_run_by_its_lock_and_stops_it(tmp_path: Path) -> None:
    """The run's process is not the UI's child: any process holding the run's lock is its run. It was
    started in a terminal by `lmforge launch` on 2 processes (its manifest says so): the UI resumes it
    on as many."""
    root = tmp_path / "runs"
    run = _fake_run(root, "held")
    (run / "manifest.json").write_text(json.dumps({"distributed": {"engine": "ddp", "world_size": 2}}))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom pathlib import Path\nfrom lmforge.train.run_lock import RunLock\n"
            "with RunLock(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(120)",
            str(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        state = RunsRoot(root).state("held")  # a UI started after the run
        assert (state.running, state.pid, state.status, state.processes) == (True, holder.pid, "running", 2)
        assert RunsRoot(root).stop("held") == holder.pid
        assert holder.wait(timeout=30) == -15  # SIGTERM
        assert RunsRoot(root).state("held").running is False
    finally:
        holder.kill()


def test_the_data_preview_is_prepares_with_loss_tokens_marked(
    client: tuple[TestClient, Access, Path], tmp_path: Path
) -> None:
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer

    http, access, root = client
    http.get(f"/?token={access.token}")
    alpaca = Path(__file__).parents[1] / "examples" / "data" / "arithmetic_alpaca.jsonl"
    tokenizer = train_tokenizer(alpaca.read_text().splitlines(), TokenizerTrainConfig(vocab_size=400))
    model = save_tiny_llama(tokenizer, tmp_path / "base")
    config = (
        f"run: {{name: sft-preview}}\nmodel: {{path: '{model}'}}\n"
        f"data: {{train: [{{path: '{alpaca}'}}], max_length: 64}}\ntrain: {{stage: sft}}\n"
    )
    shown = http.post("/api/preview", json={"config": config}, headers={"x-csrf-token": access.csrf}).json()
    assert shown["report"]["rows"]["rows_kept"] == 240 and shown["report"]["train"]["supervised_tokens"] > 0
    sample = shown["samples"][0]["runs"]
    # The prompt is context, the answer carries the loss: what `prepare --show` prints dim and green.
    assert [loss for _, loss in sample][:2] == [False, True] and sample[1][0].strip()
    assert (root / "sft-preview" / "data_report.json").is_file()  # where `lmforge prepare` writes it


def test_a_sweeps_trials_are_runs_and_its_page_is_drawn_from_the_study(
    client: tuple[TestClient, Access, Path],
) -> None:
    import optuna

    http, access, root = client
    sweep = root / "lr-sweep"
    _fake_run(sweep, "trial-0000")
    study = optuna.create_study(study_name="lr", storage=f"sqlite:///{sweep / 'study.db'}")
    study.set_user_attr("metric", "eval_loss")
    study.enqueue_trial({"lr": 0.001})
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)})
    study.tell(trial, 2.0)
    http.get(f"/?token={access.token}")
    assert [r["name"] for r in http.get("/api/runs").json()["runs"]] == ["a", "lr-sweep/trial-0000"]
    assert http.get("/api/runs/lr-sweep%2Ftrial-0000").json()["steps"] == 2
    assert http.get("/api/sweeps").json()["sweeps"] == ["lr-sweep"]
    page = http.get("/sweeps/lr-sweep")
    assert page.status_code == 200 and "eval_loss" in page.text and "0.001" in page.text
    assert (
        http.get("/sweeps/a").status_code == 404
        and http.get("/api/runs/lr-sweep%2F..%2Fa").status_code == 404
    )


def test_chat_with_an_onnx_export_answers_like_the_model_in_transformers(tmp_path: Path) -> None:
    """A run's ONNX export is a chat target: onnxruntime with the exported tokenizer, chat template
    and stop tokens, greedy, streamed; its reply is the one final/ gives in transformers."""
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer

    root = tmp_path / "runs"
    run = _fake_run(root, "exported")
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(200)]
    save_tiny_llama(train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300)), run / "final")
    converted = run_cli(
        "ckpt", "convert", str(run / "final"), "--to", "onnx", "--out", str(run / "export" / "onnx")
    )
    assert converted.returncode == 0, converted.stderr
    access = Access("127.0.0.1", 8765)
    with TestClient(create_app(RunsRoot(root), access), base_url="http://127.0.0.1:8765") as http:
        http.get(f"/?token={access.token}")
        targets = [t["id"] for t in http.get("/api/chat/targets").json()["targets"]]
        assert targets == ["exported/final", "exported/onnx"]
        messages = [{"role": "user", "content": "def main():"}]
        replies = {
            target: http.post(
                "/api/chat",
                json={"target": target, "messages": messages, "max_new_tokens": 24},
                headers={"x-csrf-token": access.csrf},
            )
            for target in targets
        }
    assert all(reply.status_code == 200 for reply in replies.values())
    answers = [reply.text for reply in replies.values()]
    assert answers[0] and answers[0] == answers[1], answers


def test_registry_doctor_and_launch_requests_are_checked(client: tuple[TestClient, Access, Path]) -> None:
    http, access, _ = client
    http.get(f"/?token={access.token}")
    post = {"headers": {"x-csrf-token": access.csrf}}
    assert "lmforge push RUN_DIR --to" in http.get("/api/registry").json()["note"]  # none yet
    for path in ("..%2F..%2Fetc/1", ".hidden/1", "m/..%2F..", "m/1%2F..%2F.."):
        response = http.get(f"/api/registry/{path}")
        assert response.status_code in (400, 404), (path, response.text)
    assert isinstance(http.get("/api/runs/a/doctor").json()["findings"], list)
    assert http.get("/api/runs/..%2Fa/doctor").status_code == 404
    config = (Path(__file__).parents[1] / "examples" / "pretrain_tiny.yaml").read_text()
    for processes, message in ((0, "choose 1 to 64"), (65, "choose 1 to 64"), ("two", "a whole number")):
        refused = http.post("/api/runs", json={"config": config, "processes": processes}, **post)
        assert refused.status_code == 400 and message in refused.json()["error"], refused.text
