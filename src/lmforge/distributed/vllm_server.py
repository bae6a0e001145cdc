"""The vLLM server of online RL's server mode (`train.rl.vllm.mode: server`), started by
`lmforge launch` beside the training processes.

TRL's own server (`trl vllm-serve`) runs on the GPUs after the training processes' (with
`--nproc-per-node 2` and `server_gpus: 1`, training on GPUs 0-1 and the server on GPU 2), on
127.0.0.1 only; TRL's GRPOTrainer sends it the prompts and, after each update, the weights. The
launch waits until the server answers its health check before any worker starts, writes its
output to `<run>/vllm_server.log`, and stops it when the workers are done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lmforge.config.schema import LmforgeConfig
from lmforge.errors import UserInputError

HOST = "127.0.0.1"  # never on another interface: the server takes weights from whoever connects
HEALTH_POLL_S = 2.0


@dataclass(frozen=True)
class VllmServerPlan:
    command: list[str]
    server_devices: list[int]  # CUDA_VISIBLE_DEVICES of the server
    training_devices: list[int]  # CUDA_VISIBLE_DEVICES of the training processes
    url: str
    timeout_s: float

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.server_devices))}


def vllm_server_plan(cfg: LmforgeConfig, nproc_per_node: int, nnodes_max: int) -> VllmServerPlan | None:
    """The server this launch starts, or None when the run does not generate with a vLLM server."""
    rl = cfg.train.rl
    if rl.generation != "vllm" or rl.vllm.mode != "server":
        return None
    if nnodes_max > 1:
        raise UserInputError(
            "train.rl.vllm.mode: server runs one vLLM server beside the training processes of one node; "
            "for several nodes start `trl vllm-serve` yourself and use mode colocate, or train on one node"
        )
    if cfg.model.path is None:
        raise UserInputError(
            "train.rl.vllm.mode: server loads the policy's starting weights from model.path, and this run "
            "builds its model from model.preset; save it first (a pretrain or sft run's final/) or use mode colocate"
        )
    gpus = rl.vllm.server_gpus
    command = [
        *_trl_command(),
        "vllm-serve",
        "--model",
        str(cfg.model.path),
        "--tensor-parallel-size",
        str(gpus),
        "--host",
        HOST,
        "--port",
        str(rl.vllm.server_port),
        "--gpu-memory-utilization",
        str(rl.vllm.gpu_memory_utilization),
        *(["--trust-remote-code", "true"] if cfg.model.trust_remote_code else []),
    ]
    return VllmServerPlan(
        command=command,
        server_devices=list(range(nproc_per_node, nproc_per_node + gpus)),
        training_devices=list(range(nproc_per_node)),
        url=f"http://{HOST}:{rl.vllm.server_port}",
        timeout_s=240.0,
    )


def _trl_command() -> list[str]:
    """`trl`, the console script TRL installs beside this interpreter (or found on PATH)."""
    beside = Path(sys.executable).with_name("trl")
    return [str(beside)] if beside.exists() else [shutil.which("trl") or "trl"]


def check_gpus_for(plan: VllmServerPlan) -> None:
    """Refuse before anything starts when the node lacks the GPUs the split needs."""
    import torch

    needed = len(plan.training_devices) + len(plan.server_devices)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise UserInputError(
            f"train.rl.vllm.mode: server puts the training processes on GPUs {_span(plan.training_devices)} and "
            f"the vLLM server on {_span(plan.server_devices)}: {needed} GPUs, and this machine has {have}. Fix: "
            "lower --nproc-per-node or train.rl.vllm.server_gpus, or use mode colocate"
        )


def _span(devices: list[int]) -> str:
    return str(devices[0]) if len(devices) == 1 else f"{devices[0]}-{devices[-1]}"


def describe(plan: VllmServerPlan) -> list[str]:
    """The plan as a --dry-run shows it: notes, and the server's command as shell."""
    import shlex

    return [
        f"vLLM server (train.rl.vllm.mode: server) on GPU(s) {_span(plan.server_devices)}, {plan.url}; "
        f"the training processes see GPU(s) {_span(plan.training_devices)}",
        "started first, waited for at "
        + plan.url
        + "/health/: "
        + " ".join(f"{k}={v}" for k, v in plan.env.items())
        + " "
        + shlex.join(plan.command),
    ]


def start(plan: VllmServerPlan, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the server and wait until it is healthy; a server that exits or never answers is a
    UserInputError naming its log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    process = subprocess.Popen(
        plan.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **plan.env}
    )
    deadline = time.monotonic() + plan.timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserInputError(
                f"the vLLM server exited with code {process.returncode} before it was up; see {log_path}"
            )
        if _healthy(plan.url):
            return process
        time.sleep(HEALTH_POLL_S)
    stop(process)
    raise UserInputError(f"the vLLM server was not up after {plan.timeout_s:.0f} s; see {log_path}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health/", timeout=2) as response:  # noqa: S310 (127.0.0.1)
            return bool(response.status == 200)
    except OSError:
        return False


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
