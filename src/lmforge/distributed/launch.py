"""`lmforge launch`: one node layout -> a torchrun, deepspeed or accelerate command that runs `lmforge train`.

The command lmforge prints with `--dry-run` is the command it runs: torchrun's own argument
parser reads the same list in this process (the elastic agent runs in-process, so a failed
worker arrives here as a `ChildFailedError` with its rank, exit code and recorded error).
How a failed worker is recorded and reported is in `lmforge.distributed.worker_failures`.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from lmforge.config.redact import redact_argv, redact_text
from lmforge.config.yaml_bounds import load_yaml_bounded
from lmforge.distributed.worker_failures import failure_exit_code, failure_lines
from lmforge.errors import UserInputError

Backend = Literal["torchrun", "deepspeed", "accelerate"]
WORKER_MODULE = "lmforge.cli.main"
# Seconds between the agent's checks of its workers: a dead worker is noticed this fast.
MONITOR_INTERVAL_S = 0.1
# The master port of several nodes when none is given: every node must agree on it, so it cannot be
# picked at random. One node picks a free port (`LaunchRequest.standalone`, `free_port`).
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchRequest:
    """The node layout `lmforge launch` was asked for (its options, validated by `check_request`)."""

    config: Path
    overrides: list[str]
    run_name: str
    nproc_per_node: int
    nnodes: str = "1"  # "M" or an elastic range "MIN:MAX"
    node_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free one on one node, DEFAULT_MASTER_PORT on several
    backend: Backend = "torchrun"
    max_restarts: int = 0
    rdzv_backend: str | None = None  # None: static, or c10d when elastic
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    hostfile: Path | None = None
    accelerate_config: Path | None = None

    @property
    def node_range(self) -> tuple[int, int]:
        return parse_nnodes(self.nnodes)

    @property
    def multi_node(self) -> bool:
        return self.node_range[1] > 1

    @property
    def rendezvous(self) -> str:
        """static (fixed master address and node rank) or c10d (elastic: ranges, restarts)."""
        if self.rdzv_backend is not None:
            return self.rdzv_backend
        elastic = ":" in self.nnodes or self.max_restarts > 0 or self.rdzv_endpoint or self.rdzv_id
        return "c10d" if elastic else "static"

    @property
    def standalone(self) -> bool:
        """One torchrun node with no port or rendezvous given: torchrun's `--standalone` rendezvous,
        which binds a free port itself (two launches on one machine no longer collide on 29500)."""
        return (
            self.backend == "torchrun"
            and self.master_port is None
            and self.rdzv_endpoint is None
            and self.rdzv_backend != "static"
            and not self.multi_node
        )

    @property
    def port(self) -> int:
        return DEFAULT_MASTER_PORT if self.master_port is None else self.master_port


@dataclass
class LaunchPlan:
    """What runs: the full command, the launcher's own arguments and the environment lmforge sets."""

    command: list[str]
    launcher_args: list[str]  # torchrun's arguments (after `-m torch.distributed.run`)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # why each variable is set, and caveats
    # (monitor.guard.stall_seconds, the run's stacks directory): end the launch after a stall
    stall: tuple[float, Path] | None = None


def parse_nnodes(text: str) -> tuple[int, int]:
    """`2` -> (2, 2); `1:4` -> (1, 4)."""
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise UserInputError(
            f"--nnodes {text!r}: use a number (2) or an elastic range MIN:MAX (1:4)"
        ) from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise UserInputError(f"--nnodes {text!r}: need 1 <= MIN <= MAX, for example 1:4")
    return bounds


def default_nproc_per_node() -> int:
    """One process per CUDA GPU, else one."""
    import torch

    return torch.cuda.device_count() or 1


def check_request(req: LaunchRequest) -> None:
    """All bad option combinations at once, each with its fix (exit code 2)."""
    problems: list[str] = []
    low, high = req.node_range
    if req.nproc_per_node < 1:
        problems.append(f"--nproc-per-node {req.nproc_per_node}: must be 1 or more")
    if req.master_port is not None and not 1 <= req.master_port <= 65535:
        problems.append(
            f"--master-port {req.master_port}: pick a free port in 1-65535 (0 is not supported: "
            "every node must agree on the port)"
        )
    if req.max_restarts < 0:
        problems.append(f"--max-restarts {req.max_restarts}: must be 0 or more")
    if req.rdzv_backend not in (None, "static", "c10d"):
        problems.append(f"--rdzv-backend {req.rdzv_backend!r}: use c10d (or static)")
    if req.rendezvous == "static":
        if low != high:
            problems.append(f"--nnodes {req.nnodes}: an elastic range needs --rdzv-backend c10d, not static")
        rank = req.node_rank or 0
        if not 0 <= rank < high:
            problems.append(
                f"--node-rank {rank}: must be in 0..{high - 1} for --nnodes {high}; "
                "give each node its own rank, 0 on the master"
            )
    elif req.node_rank is not None and req.node_rank != 0:
        problems.append(
            "--node-rank: c10d rendezvous assigns node ranks itself; drop --node-rank "
            "(or use a fixed --nnodes without --max-restarts for static ranks)"
        )
    if req.backend == "deepspeed":
        problems.extend(_deepspeed_problems(req))
    if req.backend == "accelerate":
        problems.extend(_accelerate_problems(req))
    elif req.accelerate_config is not None:
        problems.append("--accelerate-config goes with --backend accelerate")
    if problems:
        raise UserInputError(
            "\n  ".join(["bad launch options:", *problems]) if len(problems) > 1 else problems[0]
        )


def _elastic_problem(req: LaunchRequest) -> list[str]:
    """Only torchrun's agent restarts workers and takes node ranges."""
    if req.rendezvous == "static":
        return []
    return [
        f"--backend {req.backend} has no elastic mode: drop --max-restarts / --rdzv-* / an --nnodes range, "
        "or use --backend torchrun"
    ]


def _deepspeed_problems(req: LaunchRequest) -> list[str]:
    problems = _elastic_problem(req)
    if req.multi_node and req.hostfile is None:
        problems.append(
            f"--backend deepspeed with --nnodes {req.nnodes} needs --hostfile FILE, one line per node "
            f"like 'node-0 slots={req.nproc_per_node}' (the first host is the master)"
        )
    elif req.hostfile is not None and not req.hostfile.is_file():
        problems.append(f"--hostfile {req.hostfile}: no such file")
    return problems


def _accelerate_problems(req: LaunchRequest) -> list[str]:
    problems = _elastic_problem(req)
    if req.hostfile is not None:
        problems.append("--hostfile is for --backend deepspeed; accelerate takes --nnodes and --master-addr")
    if req.accelerate_config is not None:
        problems.extend(_accelerate_config_problems(req.accelerate_config))
    return problems


def read_accelerate_config(path: Path) -> dict[str, Any]:
    """An accelerate config file (YAML or JSON, as `accelerate config` writes it)."""
    if not path.is_file():
        raise UserInputError(f"--accelerate-config {path}: no such file (write one with `accelerate config`)")
    try:
        data = load_yaml_bounded(path.read_text(encoding="utf-8"), f"--accelerate-config {path}")
    except yaml.YAMLError as err:
        raise UserInputError(f"--accelerate-config {path}: not valid YAML/JSON ({err})") from None
    if not isinstance(data, dict):
        raise UserInputError(
            f"--accelerate-config {path}: must hold a mapping, as `accelerate config` writes"
        )
    return data


def _accelerate_config_problems(path: Path) -> list[str]:
    try:
        data = read_accelerate_config(path)
    except UserInputError as err:
        return [str(err)]
    if data.get("use_cpu") or data.get("distributed_type") == "MULTI_CPU":
        return [
            f"--accelerate-config {path}: use_cpu / distributed_type MULTI_CPU makes accelerate start one "
            "process unless it runs under mpirun; remove them (lmforge trains on CPU with gloo when there is "
            "no CUDA device) or set distributed_type: MULTI_GPU"
        ]
    return []


def accelerate_args(req: LaunchRequest) -> list[str]:
    """`accelerate launch` arguments for `req`. Without an engine section in the accelerate config,
    `--multi_gpu` is what makes accelerate start several processes (torchrun underneath, so also on
    CPU with gloo); `--cpu` would start one."""
    args: list[str] = []
    distributed_type = None
    if req.accelerate_config is not None:
        args += ["--config_file", str(req.accelerate_config)]
        distributed_type = read_accelerate_config(req.accelerate_config).get("distributed_type")
    nodes = req.node_range[1]
    if distributed_type in (None, "NO", "MULTI_GPU") and req.nproc_per_node * nodes > 1:
        args.append("--multi_gpu")
    args += ["--num_processes", str(req.nproc_per_node * nodes), "--num_machines", str(nodes)]
    args += ["--machine_rank", str(req.node_rank or 0)]
    args += ["--main_process_ip", req.master_addr, "--main_process_port", str(req.port)]
    args += ["--monitor_interval", str(MONITOR_INTERVAL_S)]
    return [*args, "-m", *worker_args(req)]


def worker_args(req: LaunchRequest) -> list[str]:
    """What each worker runs after `python -m`: `lmforge train CONFIG k=v ...`."""
    return [WORKER_MODULE, "train", str(req.config), *req.overrides]


def torchrun_args(req: LaunchRequest, *, node_rank: str | None = None) -> list[str]:
    """torchrun's arguments for `req`; `node_rank` replaces the node rank (a shell variable in sbatch)."""
    args = ["--nnodes", req.nnodes, "--nproc-per-node", str(req.nproc_per_node)]
    if req.standalone:
        args += ["--standalone"]
        if req.max_restarts:
            args += ["--max-restarts", str(req.max_restarts)]
    elif req.rendezvous == "static":
        args += ["--node-rank", node_rank or str(req.node_rank or 0)]
        args += ["--master-addr", req.master_addr, "--master-port", str(req.port)]
    else:
        endpoint = req.rdzv_endpoint or f"{req.master_addr}:{req.port}"
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        args += ["--rdzv-id", req.rdzv_id or f"lmforge-{req.run_name}"]
        args += ["--max-restarts", str(req.max_restarts)]
    args += ["--monitor-interval", str(MONITOR_INTERVAL_S)]
    return [*args, "-m", *worker_args(req)]


def deepspeed_args(req: LaunchRequest) -> list[str]:
    """The `deepspeed` launcher's arguments (deepspeed/launcher/runner.py) for `req`."""
    args = ["--num_gpus", str(req.nproc_per_node), "--num_nodes", req.nnodes]
    args += ["--master_addr", req.master_addr, "--master_port", str(req.port)]
    if req.hostfile is not None:
        args += ["--hostfile", str(req.hostfile)]
    if req.multi_node and req.node_rank is not None:
        # Started on every node by hand (like torchrun) instead of over ssh from node 0.
        args += ["--no_ssh", "--node_rank", str(req.node_rank)]
    # --no_local_rank: workers read LOCAL_RANK from the environment; `lmforge train` takes no --local_rank.
    return [*args, "--no_local_rank", "--module", *worker_args(req)]


def plan_launch(req: LaunchRequest) -> LaunchPlan:
    """The command and environment for `req` (checked first)."""
    check_request(req)
    if req.master_port is None and not req.multi_node and not req.standalone:
        req = replace(req, master_port=free_port())  # deepspeed, accelerate: a port-0 search
    if req.backend == "torchrun":
        launcher_args = torchrun_args(req)
        command = [sys.executable, "-m", "torch.distributed.run", *launcher_args]
    elif req.backend == "accelerate":
        launcher_args = accelerate_args(req)
        command = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args]
    else:
        launcher_args = deepspeed_args(req)
        command = [sys.executable, "-m", "deepspeed.launcher.runner", *launcher_args]
    plan = LaunchPlan(command=command, launcher_args=launcher_args)
    over_ssh = req.backend == "deepspeed" and req.multi_node and req.node_rank is None
    if "OMP_NUM_THREADS" not in os.environ and over_ssh:
        plan.notes.append(
            "OMP_NUM_THREADS is unset: each worker sets it from its own node's CPU cores / its processes "
            "(the deepspeed launcher would not carry this host's count over ssh)"
        )
    elif "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        plan.env["OMP_NUM_THREADS"] = str(max(1, cores // req.nproc_per_node))
        plan.notes.append(
            f"OMP_NUM_THREADS was unset: {cores} CPU cores / {req.nproc_per_node} process(es) per node"
        )
    if req.multi_node and req.master_addr in ("127.0.0.1", "localhost") and req.rendezvous == "static":
        plan.notes.append("--master-addr is loopback: every node must run on this machine")
    if req.backend == "deepspeed" and req.multi_node and req.node_rank is None:
        plan.notes.append(
            "deepspeed starts the other nodes over ssh (pdsh) from the hostfile's hosts; only "
            "PYTHON*/NCCL*/UCX* variables and those in .deepspeed_env reach them"
        )
    return plan


def free_port() -> int:
    """A port no process listens on now, from the operating system (bind to port 0)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def check_port_free(req: LaunchRequest) -> None:
    """UserInputError when the master port the workers' store will listen on is taken on this machine
    (another launch, most often): checked before any worker starts, where this node hosts the store."""
    hosts_store = req.rendezvous == "static" and not req.node_rank
    if req.master_port is None or not hosts_store:
        return
    with socket.socket() as sock:
        # As the store binds it: a port another process listens on is refused, one in TIME_WAIT is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", req.master_port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            fix = "pick another (--master-port N)"
            if not req.multi_node:
                fix += ", or leave --master-port out and one node gets a free port"
            raise UserInputError(
                f"--master-port {req.master_port}: the port is in use on this machine (another launch?); {fix}"
            ) from None


def render_dry_run(plan: LaunchPlan) -> str:
    """The plan as shell a user can paste: notes as comments, one `export` per variable, the command."""
    lines = [f"# {note}" for note in plan.notes]
    # The printed command is for people and logs: a secret override is shown redacted (the
    # command that runs keeps it).
    lines += [f"export {name}={shlex.quote(redact_text(value))}" for name, value in plan.env.items()]
    lines.append(shlex.join(redact_argv(plan.command)))
    return "\n".join(lines) + "\n"


def slurm_script(req: LaunchRequest, workdir: Path) -> str:
    """An sbatch script: one task per node, each running torchrun with that node's rank."""
    check_request(req)
    if req.backend != "torchrun":
        raise UserInputError("--slurm writes a torchrun job; use --backend torchrun with --slurm")
    low, high = req.node_range
    static = req.rendezvous == "static"
    # Shell words, left unquoted below: they expand on each node, not when lmforge writes the script.
    per_node = replace(
        req,
        config=req.config.resolve(),
        nnodes='"$SLURM_NNODES"' if static else req.nnodes,
        master_port=req.port,  # the nodes agree on it: no standalone rendezvous in a job script
        master_addr='"$MASTER_ADDR"',
        rdzv_backend=req.rendezvous,
        rdzv_id=None if static else req.rdzv_id or '"$SLURM_JOB_ID"',
    )
    words = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(per_node, node_rank='"$SLURM_NODEID"'),
    ]
    inner = " ".join(w if w.startswith('"$') else shlex.quote(w) for w in words)
    nodes = str(high) if low == high else f"{low}-{high}"
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name={req.run_name}",
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={req.nproc_per_node}",
            # One task per node runs torchrun and all its workers: without the whole node (or a CPU
            # count) Slurm gives that task its default CPU count, often 1, and every worker shares it.
            "#SBATCH --exclusive",
            f"#SBATCH --output={req.run_name}-%j.out",
            "# Written by `lmforge launch --slurm`; assumes this venv and the config are on a shared filesystem.",
            "# --exclusive: torchrun's workers share the one task per node, which gets all of the node's CPUs",
            "# (srun --cpus-per-task); OMP_NUM_THREADS is each node's own CPU count / its workers.",
            "set -euo pipefail",
            f"cd {shlex.quote(str(workdir))}",
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"export MASTER_ADDR MASTER_PORT={req.port}",
            'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" bash -c '
            + shlex.quote(f"{node_threads(req.nproc_per_node)}; exec {inner}"),
            "",
        ]
    )


def node_threads(nproc_per_node: int) -> str:
    """Shell that sets OMP_NUM_THREADS (unless set) to the CPUs this node gives the task (`nproc`
    honours Slurm's binding) divided by its workers; run on each node, so each counts its own."""
    share = f"$(nproc) / {nproc_per_node}"
    return f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( {share} > 0 ? {share} : 1 ))}}"'


def run_torchrun(plan: LaunchPlan) -> tuple[int, list[str]]:
    """Run torchrun's elastic agent in this process; (exit code, one line per failed worker)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from lmforge.distributed.stall_watch import StallWatch

    os.environ.update(plan.env)
    watch = StallWatch(*plan.stall) if plan.stall is not None else None
    if watch is not None:
        watch.start()
    try:
        run(parse_args(plan.launcher_args))
    except ChildFailedError as err:
        if watch is not None and watch.verdict is not None:
            return 1, watch.verdict.lines()
        return failure_exit_code(err), failure_lines(err)
    except SignalException as err:
        return 128 + int(err.sigval), [
            f"launch stopped by {signal.Signals(err.sigval).name}; workers were stopped"
        ]
    finally:
        if watch is not None:
            watch.stop()
    return 0, []


def run_launcher(plan: LaunchPlan) -> int:
    """Run the deepspeed or accelerate launcher as a child process; its exit code."""
    return subprocess.run(plan.command, env={**os.environ, **plan.env}, check=False).returncode
