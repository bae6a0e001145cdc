"""`lmforge serve`: an OpenAI-compatible chat endpoint for a model, on 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path

import typer

from lmforge.cli.console import console


def serve(
    target: Path = typer.Argument(
        ..., help="A .gguf file (or a directory with one), a run directory or an HF model directory."
    ),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port of the endpoint."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Interface to listen on; anything but 127.0.0.1 is reachable by others."
    ),
    context: int = typer.Option(2048, "--context", min=16, help="GGUF: context length in tokens."),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="GGUF: CPU threads (default: half the cores)."
    ),
) -> None:
    """Serve a model behind an OpenAI-compatible chat endpoint (/v1/chat/completions) with its chat
    template and stop tokens: a GGUF through llama-cpp-python's server (CPU), an HF directory
    through vLLM (CUDA GPU). Ctrl-C stops it.

    Example: `lmforge serve runs/sft --port 8000`, then
    `curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'`
    """
    from lmforge.serve.server import (
        check_host,
        check_port_free,
        load_gguf_app,
        require_gguf_server,
        resolve_target,
        run_app,
        vllm_command,
    )

    resolved = resolve_target(target)
    check_host(host)
    if resolved.kind == "gguf":
        check_port_free(host, port)
        require_gguf_server()
        app = load_gguf_app(resolved, host, port, context=context, threads=threads)
        console.print(
            f"serving {resolved.path} as '{resolved.name}' on http://{host}:{port}/v1 (llama.cpp, the GGUF's "
            "chat template); Ctrl-C stops",
            markup=False,
        )
        run_app(app, host, port)
        return
    command = vllm_command(resolved, host, port)
    check_port_free(host, port)
    console.print(
        f"serving {resolved.path} as '{resolved.name}' on http://{host}:{port}/v1 (vLLM)", markup=False
    )
    raise typer.Exit(subprocess.call(command))
