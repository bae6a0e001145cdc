"""The UI's HTTP side: a Starlette app (the ASGI toolkit FastAPI is built on, already in lmforge's
stack through MLflow) serving one page and a small JSON API, and a server-sent-events stream per
run that follows metrics.jsonl, the events and the run's state as they grow.

Work that reads runs or loads configs runs in Starlette's threadpool (sync endpoints, or
`run_in_threadpool`), so the event loop keeps every run's stream flowing. Every action goes
through the code the CLI runs: validation is `load_config` (the CLI's messages),
a launch is `lmforge train`, a stop is the SIGTERM the CLI's own signal handling turns into a
checkpoint. See ARCHITECTURE.md for why a small ASGI app and not Gradio.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths
from lmforge.ui.chat import ChatModels
from lmforge.ui.config_form import form_fields, parse, set_key
from lmforge.ui.registry import RegistryView
from lmforge.ui.runs import RunsRoot, UnknownRun
from lmforge.ui.security import Access, Guard

POLL_S = 0.5  # how often a stream looks at the files: the curve lags the file by at most this
STATE_EVERY = 4  # polls between state messages (running, exit code, checkpoints)


def create_app(runs: RunsRoot, access: Access, registry: RegistryView | None = None) -> Guard:
    chat = ChatModels(runs)
    registry = registry or RegistryView(runs.cwd / "registry")
    page = resources.files("lmforge.ui").joinpath("static/index.html").read_text(encoding="utf-8")
    page = page.replace("{{CSRF}}", access.csrf)

    async def index(_: Request) -> Response:
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    async def list_runs(_: Request) -> Response:
        return JSONResponse(
            {"root": str(runs.root), "runs": [r.to_json() for r in await run_in_threadpool(runs.runs)]}
        )

    def run_detail(request: Request) -> Response:  # sync endpoints run in Starlette's threadpool
        name = request.path_params["name"]
        return JSONResponse(
            {
                **runs.state(name).to_json(),
                "config": runs.config_text(name),
                "console": runs.console_tail(name),
                "checkpoints": _checkpoints(runs.run_dir(name)),
            }
        )

    async def validate(request: Request) -> Response:
        body = await _json(request)
        return JSONResponse(
            {"ok": True, "name": await run_in_threadpool(runs.validate, str(body.get("config", "")))}
        )

    async def launch(request: Request) -> Response:
        body = await _json(request)
        processes = _int(body.get("processes", 1), "processes")
        name = await run_in_threadpool(runs.launch, str(body.get("config", "")), processes)
        return JSONResponse({"ok": True, "name": name})

    def doctor(request: Request) -> Response:
        from lmforge.monitor.diagnosis import diagnose_run

        findings = diagnose_run(runs.run_dir(request.path_params["name"]))
        return JSONResponse({"findings": [asdict(finding) for finding in findings]})

    def registry_models(_: Request) -> Response:
        return JSONResponse(registry.models())

    def registry_version(request: Request) -> Response:
        params = request.path_params
        return JSONResponse(registry.version(params["model"], params["version"], verify=False))

    async def registry_verify(request: Request) -> Response:
        params = request.path_params  # re-hashes every file: a POST, off the event loop
        shown = await run_in_threadpool(registry.version, params["model"], params["version"], verify=True)
        return JSONResponse(shown)

    async def stop(request: Request) -> Response:
        return JSONResponse({"ok": True, "pid": runs.stop(request.path_params["name"])})

    async def resume(request: Request) -> Response:
        body = await _json(request)
        max_steps = body.get("max_steps")
        await run_in_threadpool(
            runs.resume, request.path_params["name"], int(max_steps) if max_steps else None
        )
        return JSONResponse({"ok": True})

    def examples(_: Request) -> Response:
        return JSONResponse({"examples": runs.examples()})

    def example(request: Request) -> Response:
        return JSONResponse({"config": runs.example_text(request.path_params["name"])})

    async def schema(_: Request) -> Response:
        return JSONResponse({"fields": form_fields()})

    async def parse_config(request: Request) -> Response:
        body = await _json(request)
        return JSONResponse({"ok": True, "values": parse(str(body.get("config", "")))})

    async def set_config_key(request: Request) -> Response:
        body = await _json(request)
        text = set_key(str(body.get("config", "")), str(body.get("key", "")), str(body.get("value", "")))
        return JSONResponse({"ok": True, "config": text})

    async def estimate(request: Request) -> Response:
        body = await _json(request)
        shown = await run_in_threadpool(
            runs.estimate, str(body.get("config", "")), int(body.get("gpus") or 1)
        )
        return JSONResponse({"ok": True, **shown})

    async def preview(request: Request) -> Response:
        body = await _json(request)
        # The data stage (tokenizer, tokenize, pack) takes seconds: off the event loop, so the
        # streams of running runs keep flowing.
        shown = await run_in_threadpool(
            runs.preview, str(body.get("config", "")), int(body.get("samples") or 2)
        )
        return JSONResponse({"ok": True, **shown})

    async def chat_targets(_: Request) -> Response:
        return JSONResponse({"targets": chat.targets()})

    async def chat_reply(request: Request) -> Response:
        body = await _json(request)
        target, messages = str(body.get("target", "")), body.get("messages")
        if not isinstance(messages, list):
            raise UserInputError("messages: a list of {role, content}")
        chat.check(target, messages)
        max_new_tokens = min(int(body.get("max_new_tokens") or 128), 1024)
        temperature = float(body.get("temperature") or 0.0)
        if temperature < 0:
            raise UserInputError("temperature: 0 for greedy, or a positive value")
        # A sync generator: Starlette iterates it in a worker thread while the model writes.
        reply = chat.reply(target, messages, max_new_tokens, temperature)
        return StreamingResponse(
            reply, media_type="text/plain; charset=utf-8", headers={"cache-control": "no-store"}
        )

    def report(request: Request) -> Response:
        from lmforge.report.load import load_run
        from lmforge.report.run_page import render_run

        run = load_run(runs.run_dir(request.path_params["name"]), verify_hashes=False)
        return HTMLResponse(render_run(run), headers={"cache-control": "no-store"})

    def compare(request: Request) -> Response:
        from lmforge.report.compare import render_comparison
        from lmforge.report.load import load_run

        names = request.query_params.getlist("run")
        if len(names) < 2:
            raise UserInputError("compare: choose at least two runs")
        pages = [load_run(runs.run_dir(name), verify_hashes=False) for name in names]
        return HTMLResponse(render_comparison(pages), headers={"cache-control": "no-store"})

    async def launch_status(request: Request) -> Response:
        return JSONResponse(runs.launch_status(request.path_params["name"]))

    async def list_sweeps(_: Request) -> Response:
        return JSONResponse({"sweeps": runs.sweeps()})

    async def sweep_page(request: Request) -> Response:
        from lmforge.sweep.run import render_live_page

        directory = runs.sweep_dir(request.path_params["name"])
        return HTMLResponse(
            await run_in_threadpool(render_live_page, directory), headers={"cache-control": "no-store"}
        )

    async def stream(request: Request) -> Response:
        name = request.path_params["name"]
        run_dir = runs.run_dir(name)
        return StreamingResponse(
            _follow(request, runs, name, run_dir),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/runs", list_runs),
            Route("/api/runs", launch, methods=["POST"]),
            Route("/api/validate", validate, methods=["POST"]),
            Route("/api/schema", schema),
            Route("/api/examples", examples),
            Route("/api/examples/{name}", example),
            Route("/api/config/parse", parse_config, methods=["POST"]),
            Route("/api/config/set", set_config_key, methods=["POST"]),
            Route("/api/estimate", estimate, methods=["POST"]),
            Route("/api/preview", preview, methods=["POST"]),
            Route("/api/chat/targets", chat_targets),
            Route("/runs/{name:path}/report", report),
            Route("/compare", compare),
            Route("/api/chat", chat_reply, methods=["POST"]),
            # A sweep's trials are runs one level down (`sweep/trial-0000`): names are paths, and the
            # routes with a suffix come first.
            Route("/api/runs/{name:path}/stream", stream),
            Route("/api/runs/{name:path}/stop", stop, methods=["POST"]),
            Route("/api/runs/{name:path}/resume", resume, methods=["POST"]),
            Route("/api/runs/{name:path}/doctor", doctor),
            Route("/api/runs/{name:path}", run_detail),
            Route("/api/sweeps", list_sweeps),
            Route("/api/registry", registry_models),
            Route("/api/registry/{model}/{version}", registry_version),
            Route("/api/registry/{model}/{version}/verify", registry_verify, methods=["POST"]),
            Route("/api/launches/{name}", launch_status),
            Route("/sweeps/{name}", sweep_page),
        ],
        exception_handlers={UnknownRun: _not_found, UserInputError: _refused},
    )
    return Guard(app, access)


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise UserInputError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise UserInputError("the request body must be a JSON object")
    return body


def _int(value: Any, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UserInputError(f"{key}: a whole number, got {value!r}") from None


async def _not_found(_: Request, err: Exception) -> Response:
    return JSONResponse({"ok": False, "error": str(err)}, status_code=404)


async def _refused(_: Request, err: Exception) -> Response:
    # The CLI's own message (file / line / key and the fix), shown next to the form.
    return JSONResponse({"ok": False, "error": str(err)}, status_code=400)


def _checkpoints(run_dir: Path) -> list[str]:
    from lmforge.ckpt.atomic import check_checkpoint, list_step_dirs

    return [
        d.name
        for d in list_step_dirs(RunPaths(run_dir).checkpoints)
        if check_checkpoint(d, verify_hashes=False).complete
    ]


async def _follow(request: Request, runs: RunsRoot, name: str, run_dir: Path) -> AsyncIterator[str]:
    """Server-sent events: `metrics` and `events` with the lines added since the last look (all of
    them at first), `state` every few polls and whenever the run starts or stops."""
    paths = RunPaths(run_dir)
    offsets: dict[Path, int] = {}
    last_state: dict[str, Any] | None = None
    tick = 0
    while not await request.is_disconnected():
        metrics = _new_lines(paths.metrics, offsets)
        if metrics:
            yield _event("metrics", metrics)
        events = [line for path in sorted(paths.events.glob("*.jsonl")) for line in _new_lines(path, offsets)]
        if events:
            yield _event("events", events)
        if tick % STATE_EVERY == 0:
            state = runs.state(name).to_json() | {"checkpoints": _checkpoints(run_dir)}
            if state != last_state:
                if last_state is not None and last_state["running"] and not state["running"]:
                    state["console"] = runs.console_tail(name)
                yield _event("state", state)
                last_state = state
        tick += 1
        await asyncio.sleep(POLL_S)


def _new_lines(path: Path, offsets: dict[Path, int]) -> list[dict[str, Any]]:
    """The complete JSON lines written to `path` since the offset kept for it."""
    if not path.is_file():
        return []
    start = offsets.get(path, 0)
    with path.open("rb") as handle:
        handle.seek(start)
        chunk = handle.read()
    end = chunk.rfind(b"\n") + 1  # a line still being written waits for its newline
    offsets[path] = start + end
    records = []
    for line in chunk[:end].splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _event(kind: str, data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"
