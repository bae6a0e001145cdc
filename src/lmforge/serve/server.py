"""What `lmforge serve` serves, with which server, and the checks made before anything loads.

The target is a GGUF file, a directory holding one, a run directory (its `export/gguf/` file, else
its `final/`) or an HF model directory. A GGUF is served by llama-cpp-python's OpenAI-compatible
server (FastAPI + uvicorn) in this process, with the chat template and end-of-turn token the GGUF
carries (lmforge's GGUF export embeds both). An HF directory is served by vLLM (`vllm serve`) on a
CUDA GPU; on a machine without one it is refused with the command that makes a GGUF of it.
The endpoint is on 127.0.0.1 unless `--host` says otherwise (with a warning: the server has no
authentication).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import UserInputError
from lmforge.export.runtimes import gguf_file

log = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
# llama-cpp-python's server and what it imports (its `server` extra).
SERVER_MODULES = (
    "llama_cpp",
    "fastapi",
    "uvicorn",
    "sse_starlette",
    "starlette_context",
    "pydantic_settings",
)
SERVE_EXTRA = "pip install 'lmforge[serve]' (llama-cpp-python with its server; it compiles llama.cpp)"


@dataclass(frozen=True)
class ServeTarget:
    path: Path
    kind: str  # gguf | hf
    name: str  # the model name clients send (`model` of the OpenAI request)


def resolve_target(path: Path) -> ServeTarget:
    """The model `path` names: a GGUF file, a directory with one GGUF, a run directory (its
    export/gguf, else final/) or an HF model directory."""
    if not path.exists():
        raise UserInputError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix != ".gguf":
        raise UserInputError(f"{path}: serve takes a .gguf file, a run directory or a model directory")
    found = gguf_file(path)
    if found is not None:
        return ServeTarget(found, "gguf", _model_name(found))
    run_gguf = gguf_file(path / "export" / "gguf") if (path / "export" / "gguf").is_dir() else None
    if run_gguf is not None:
        return ServeTarget(run_gguf, "gguf", _model_name(run_gguf))
    model_dir = path / "final" if (path / "final" / "config.json").is_file() else path
    if (model_dir / "config.json").is_file():
        return ServeTarget(model_dir, "hf", model_dir.resolve().name)
    raise UserInputError(
        f"{path}: neither a GGUF file nor a directory with one, a run directory or an HF model directory "
        "(config.json)"
    )


def _model_name(gguf: Path) -> str:
    """The GGUF's general.name (what lmforge's export writes), else its file name."""
    return _gguf_string(gguf, "general.name") or gguf.stem


def _gguf_string(gguf: Path, key: str) -> str | None:
    """A string field of the GGUF's metadata, or None."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get(key)
    if field is None or not field.data:
        return None
    return str(bytes(field.parts[field.data[0]]), "utf-8")


def check_host(host: str) -> None:
    if host != LOCALHOST:
        log.warning(
            "serving on %s: every machine that reaches it can use the model, and the server has no "
            "authentication; the default is %s",
            host,
            LOCALHOST,
        )


def check_port_free(host: str, port: int) -> None:
    """UserInputError naming the port when something already listens there (before the model loads)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as err:
            raise UserInputError(
                f"--port {port}: {host}:{port} is in use ({err.strerror}); pass another --port"
            ) from None


def require_gguf_server() -> None:
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserInputError(
            f"serving a GGUF runs llama-cpp-python's server, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed. Fix: {SERVE_EXTRA}"
        )


def vllm_command(target: ServeTarget, host: str, port: int) -> list[str]:
    """`vllm serve` for an HF directory, or a UserInputError on a machine that cannot run it."""
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        raise UserInputError(
            f"{target.path}: an HF model directory is served by vLLM, which needs a CUDA GPU and the vllm "
            "package (pip install 'lmforge[vllm]'). On this machine serve a GGUF of it: `lmforge ckpt "
            f"convert {target.path} --to gguf --out {target.path.name}-gguf`, then `lmforge serve "
            f"{target.path.name}-gguf`"
        )
    beside = Path(sys.executable).with_name("vllm")
    program = str(beside) if beside.exists() else shutil.which("vllm") or "vllm"
    return [
        program,
        "serve",
        str(target.path),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        target.name,
    ]


def load_gguf_app(target: ServeTarget, host: str, port: int, *, context: int, threads: int | None) -> Any:
    """llama-cpp-python's OpenAI-compatible app with `target` loaded (a file llama.cpp cannot load
    is a UserInputError naming its architecture)."""
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    model = ModelSettings(
        model=str(target.path),
        model_alias=target.name,
        n_ctx=context,
        n_threads=threads or max((os.cpu_count() or 2) // 2, 1),
        verbose=False,
    )
    try:
        return create_app(server_settings=ServerSettings(host=host, port=port), model_settings=[model])
    except ValueError as err:  # llama.cpp cannot load the file
        raise UserInputError(
            f"{target.path}: llama.cpp cannot load it ({_architecture(target.path)}): {err}"
        ) from None


def run_app(app: Any, host: str, port: int) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM end it cleanly)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning")


def _architecture(gguf: Path) -> str:
    architecture = _gguf_string(gguf, "general.architecture")
    return f"architecture {architecture}" if architecture else "no architecture"
