"""`lmforge launch`: dry-run commands per mode, the sbatch script, and real gloo launches on CPU
(2 workers, a crashed worker, a SIGKILLed worker, two nodes on one machine)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from lmforge.distributed.launch import (
    LaunchRequest,
    check_request,
    plan_launch,
)
from lmforge.distributed.worker_failures import failure_exit_code, failure_lines
from lmforge.errors import UserInputError
from tests.conftest import SMALL_ARCH, run_cli

# A dead worker must end the launch well within this (agent check 0.1 s, then SIGTERM, SIGKILL after 30 s).
FAILURE_TIMEOUT_S = 120
ENV = {"OMP_NUM_THREADS": "1"}


def write_config(tmp_path: Path, corpus: Path, *, max_steps: int = 6) -> Path:
    cfg = {
        "run": {"name": "run", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 64, "cache_dir": str(tmp_path / "cache")},
        "train": {
            "max_steps": max_steps,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "precision": "fp32",
            "log_every": 1,
            "warmup_steps": 0,
        },
        "monitor": {"loggers": []},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmforge.cli.main", "launch", *args]


def dry_run(cfg: Path, *args: str) -> list[str]:
    """The dry-run's command line, split into words (and check nothing ran and that it starts the
    launcher with the interpreter lmforge runs under)."""
    result = run_cli("launch", str(cfg), *args, "--dry-run", timeout=120)
    assert result.returncode == 0, result.stderr
    assert not (cfg.parent / "runs" / "run").exists()
    words = shlex.split(result.stdout.strip().splitlines()[-1])
    assert words[0] == result.args[0]
    return words


def flags(words: list[str]) -> dict[str, str]:
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}


# -- dry runs ---------------------------------------------------------------------------------


def test_dry_run_torchrun_single_node(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    result = run_cli("launch", str(cfg), "train.lr=1e-3", "--nproc-per-node", "2", "--dry-run")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip().splitlines()[-1])
    assert words[:3] == [result.args[0], "-m", "torch.distributed.run"]  # the command's own python
    assert words[-5:] == ["-m", "lmforge.cli.main", "train", str(cfg), "train.lr=1e-3"]
    got = flags(words)
    assert got["--nnodes"] == "1" and got["--nproc-per-node"] == "2"
    # No --master-port on one node: torchrun's standalone rendezvous binds a free port itself (two
    # launches on one machine collided on 29500).
    assert "--standalone" in words and "--master-port" not in got and "--node-rank" not in got
    assert float(got["--monitor-interval"]) <= 0.5
    words = dry_run(cfg, "--nproc-per-node", "2", "--master-port", "29411")
    assert (flags(words)["--master-port"], flags(words)["--node-rank"]) == ("29411", "0")
    assert "--standalone" not in words
    assert not (tmp_path / "runs" / "run").exists()


def test_dry_run_sets_omp_threads_when_unset(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(
        launch_cmd(str(cfg), "--nproc-per-node", "2", "--dry-run"), env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    cores = len(os.sched_getaffinity(0))
    assert f"export OMP_NUM_THREADS={max(1, cores // 2)}" in result.stdout.splitlines()
    assert "OMP_NUM_THREADS was unset" in result.stdout


def test_dry_run_torchrun_static_multi_node(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    words = dry_run(
        cfg, "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port", "29411"
    )
    got = flags(words)
    assert (got["--nnodes"], got["--node-rank"]) == ("2", "1")
    assert (got["--master-addr"], got["--master-port"]) == ("10.1.2.3", "29411")
    assert "--rdzv-backend" not in got


def test_dry_run_torchrun_elastic(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    words = dry_run(
        cfg, "--nnodes", "1:4", "--max-restarts", "3", "--master-addr", "10.1.2.3", "--master-port", "29411",
        "--nproc-per-node", "2",
    )  # fmt: skip
    got = flags(words)
    assert got["--nnodes"] == "1:4" and got["--max-restarts"] == "3"
    assert got["--rdzv-backend"] == "c10d" and got["--rdzv-endpoint"] == "10.1.2.3:29411"
    assert got["--rdzv-id"] == "lmforge-run"
    assert "--node-rank" not in got and "--master-addr" not in got
    words = dry_run(
        cfg, "--max-restarts", "1", "--rdzv-endpoint", "h:1234", "--rdzv-id", "job7", "--nproc-per-node", "1"
    )
    assert (flags(words)["--rdzv-endpoint"], flags(words)["--rdzv-id"]) == ("h:1234", "job7")


def test_dry_run_deepspeed(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    words = dry_run(cfg, "--backend", "deepspeed", "--nproc-per-node", "2")
    assert words[1:3] == ["-m", "deepspeed.launcher.runner"]
    got = flags(words)
    assert (got["--num_gpus"], got["--num_nodes"]) == ("2", "1")
    assert got["--master_addr"] == "127.0.0.1"  # and a port free when planned (a port-0 search)
    with socket.socket() as sock:
        sock.bind(("", int(got["--master_port"])))
    # --backend deepspeed over a config that leaves the strategy to auto: the DeepSpeed engine too.
    assert words[-5:] == ["--module", "lmforge.cli.main", "train", str(cfg), "distributed.strategy=deepspeed"]

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-0 slots=2\nnode-1 slots=2\n")
    words = dry_run(cfg, "--backend", "deepspeed", "--nproc-per-node", "2", "--nnodes", "2",
                    "--master-addr", "node-0", "--hostfile", str(hostfile))  # fmt: skip
    got = flags(words)
    assert (got["--num_nodes"], got["--hostfile"], got["--master_addr"]) == ("2", str(hostfile), "node-0")
    assert "--no_ssh" not in words  # started over ssh from this node; with --node-rank: by hand on each


def test_the_launchers_own_parsers_accept_the_commands(tmp_path: Path) -> None:
    """torchrun's and deepspeed's argument parsers read what lmforge builds, flag for flag."""
    from deepspeed.launcher.runner import parse_args as deepspeed_parse
    from torch.distributed.run import parse_args as torchrun_parse

    base: dict[str, Any] = {
        "config": Path("cfg.yaml"),
        "overrides": ["train.lr=1e-3"],
        "run_name": "run",
        "nproc_per_node": 2,
    }
    elastic = plan_launch(LaunchRequest(**base, nnodes="1:4", max_restarts=3, master_addr="h", master_port=7))
    args = torchrun_parse(elastic.launcher_args)
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("1:4", "2", 3)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "h:7", "lmforge-run")
    assert (args.module, args.training_script) == (True, "lmforge.cli.main")
    assert args.training_script_args == ["train", "cfg.yaml", "train.lr=1e-3"]
    static = torchrun_parse(plan_launch(LaunchRequest(**base, nnodes="2", node_rank=1)).launcher_args)
    assert (static.node_rank, static.master_addr, static.master_port, static.rdzv_backend) == (
        1,
        "127.0.0.1",
        29500,
        "static",
    )

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n0 slots=2\nn1 slots=2\n")
    plan = plan_launch(LaunchRequest(**base, backend="deepspeed", nnodes="2", node_rank=1, hostfile=hostfile))
    ds = deepspeed_parse(plan.launcher_args)
    assert (ds.num_gpus, ds.num_nodes, ds.hostfile, ds.no_ssh, ds.node_rank) == (2, 2, str(hostfile), True, 1)
    assert ds.no_local_rank  # `lmforge train` reads LOCAL_RANK from the environment
    assert (ds.module, ds.user_script, ds.user_args) == (
        True,
        "lmforge.cli.main",
        ["train", "cfg.yaml", "train.lr=1e-3"],
    )

    from accelerate.commands.launch import launch_command_parser

    two_nodes = LaunchRequest(**base, backend="accelerate", nnodes="2", node_rank=1, master_addr="n0")
    acc = launch_command_parser().parse_args(plan_launch(two_nodes).launcher_args)
    assert (acc.multi_gpu, acc.cpu, acc.num_processes, acc.num_machines, acc.machine_rank) == (
        True,
        False,
        4,
        2,
        1,
    )
    assert (acc.main_process_ip, acc.main_process_port, acc.module) == ("n0", 29500, True)
    assert (acc.training_script, acc.training_script_args) == (
        "lmforge.cli.main",
        ["train", "cfg.yaml", "train.lr=1e-3"],
    )


def test_failure_summary_puts_the_root_cause_first(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def error_file(name: str, message: str) -> str:
        path = tmp_path / name
        data = {"message": {"message": message, "extraInfo": {"py_callstack": "...", "timestamp": "0"}}}
        path.write_text(json.dumps(data))
        os.utime(path, (1.0, 1.0))  # written before the kill was noticed: time alone would blame it
        return str(path)

    peer = error_file("peer.json", "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=str(tmp_path / "none.json"))
    err = ChildFailedError("train", {0: ProcessFailure(0, 10, 1, peer), 1: killed})
    assert failure_lines(err) == [
        "rank 1 (local 1) failed with exit code -9 (killed by SIGKILL): Signal 9 (SIGKILL) received by PID 11",
        "rank 0 (local 0) failed with exit code 1: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1",
    ]
    assert failure_exit_code(err) == 128 + 9
    guard = ProcessFailure(0, 12, 3, error_file("guard.json", "TrainingStopped: 3 bad steps in a row"))
    assert failure_exit_code(ChildFailedError("train", {0: guard})) == 3

    # A collective's error raised in a future's callback (comm timing's) ends with torch's "At:"
    # frames: still a lost peer, named by its error line, and not the root cause.
    callback = error_file(
        "callback.json",
        "RuntimeError: Got the following error when running the callback: RuntimeError: [pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:431.\n\nAt:\n  /src/lmforge/distributed/comm_timing.py(208): finished",
    )
    err = ChildFailedError("train", {0: ProcessFailure(0, 10, -15, callback), 1: killed})
    assert failure_exit_code(err) == 128 + 9
    assert failure_lines(err)[1].endswith("Connection closed by peer [127.0.0.1]:431.")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nnodes": "2", "node_rank": 2}, "--node-rank 2: must be in 0..1"),
        ({"master_port": 0}, "--master-port 0"),
        ({"nnodes": "4:2"}, "--nnodes '4:2'"),
        ({"nnodes": "two"}, "--nnodes 'two'"),
        ({"nproc_per_node": 0}, "--nproc-per-node 0"),
        ({"backend": "deepspeed", "nnodes": "2"}, "needs --hostfile"),
        ({"backend": "deepspeed", "max_restarts": 2}, "no elastic mode"),
        ({"nnodes": "1:2", "node_rank": 1}, "drop --node-rank"),
        ({"nnodes": "1:2", "rdzv_backend": "static"}, "needs --rdzv-backend c10d"),
    ],
)
def test_bad_option_combinations_say_the_fix(options: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {
        "config": Path("cfg.yaml"),
        "overrides": [],
        "run_name": "run",
        "nproc_per_node": 1,
    }
    request = LaunchRequest(**{**base, **options})
    with pytest.raises(UserInputError, match=re.escape(message)):
        check_request(request)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-port", "0"],
            "bad launch options:\n  --master-port 0",
        ),
        (["--backend", "mpi"], "--backend 'mpi'"),
        (["train.nope=1"], "train.nope"),
    ],
)
def test_bad_options_exit_2(tmp_path: Path, corpus: Path, args: list[str], message: str) -> None:
    cfg = write_config(tmp_path, corpus)
    result = run_cli("launch", str(cfg), *args, "--nproc-per-node", "1", "--dry-run")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr


def test_slurm_script(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    result = run_cli("launch", str(cfg), "train.lr=1e-3", "--nnodes", "2", "--nproc-per-node", "4", "--slurm")
    assert result.returncode == 0, result.stderr
    script = tmp_path / "runs" / "run.sbatch"
    assert f"wrote {script}" in result.stdout and f"sbatch {script}" in result.stdout
    text = script.read_text()
    for line in (
        "#SBATCH --job-name=run",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    ):
        assert line in text.splitlines(), line
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    inner = shlex.split(srun)[-1]  # what bash -c runs on each node
    assert '--nnodes "$SLURM_NNODES"' in inner and '--node-rank "$SLURM_NODEID"' in inner
    assert '--master-addr "$MASTER_ADDR"' in inner and "--nproc-per-node 4" in inner
    assert inner.endswith(f"-m lmforge.cli.main train {cfg.resolve()} train.lr=1e-3")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert not (tmp_path / "runs" / "run").exists()

    elastic = run_cli("launch", str(cfg), "--nnodes", "1:4", "--max-restarts", "2", "--slurm", "--dry-run")
    assert elastic.returncode == 0, elastic.stderr
    assert "#SBATCH --nodes=1-4" in elastic.stdout
    assert (
        '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR":29500 --rdzv-id "$SLURM_JOB_ID"' in elastic.stdout
    )


def test_help_has_an_example() -> None:
    result = run_cli("launch", "--help")
    assert result.returncode == 0 and "Example: lmforge launch" in result.stdout


# -- real launches (gloo on CPU) --------------------------------------------------------------


def test_a_torch_dcp_error_of_a_worker_is_named_not_no_error_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch DCP's CheckpointException (a failed load on any rank) is a BaseException: torchrun's
    `record` did not write it, and the launcher said "no error recorded" though the rank printed it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from lmforge.distributed.worker_failures import record_worker_errors

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record_worker_errors
    def resume_from(directory: Path) -> None:
        dcp.load({"weight": torch.zeros(2)}, checkpoint_id=str(directory), no_dist=True)

    with pytest.raises(dcp.api.CheckpointException):
        resume_from(tmp_path / "pytorch_model_fsdp_0")
    failure = ProcessFailure(local_rank=1, pid=10, exitcode=1, error_file=str(error_file))
    (line,) = failure_lines(ChildFailedError("train", {1: failure}))
    assert line.startswith("rank 1 (local 1) failed with exit code 1: AssertionError: metadata is None;"), (
        line
    )
    assert "pytorch_model_fsdp_0/.metadata" in line


def assert_trained(run_dir: Path, steps: int) -> None:
    assert (run_dir / "final" / "config.json").is_file()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == steps


def listening_on(port: int) -> socket.socket | None:
    """A socket listening on `port` of this machine, as another launch's store would; None when one
    already does (the port is busy either way)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def test_two_workers_train(tmp_path: Path, corpus: Path) -> None:
    """Without --master-port, on a machine where another launch holds torchrun's default port."""
    cfg = write_config(tmp_path, corpus)
    busy = listening_on(29500)
    try:
        result = run_cli("launch", str(cfg), "--nproc-per-node", "2", env=ENV, timeout=300)
    finally:
        if busy is not None:
            busy.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EADDRINUSE" not in result.stderr
    assert_trained(tmp_path / "runs" / "run", 6)


def test_a_busy_master_port_is_refused_before_any_worker_starts(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    port = free_port()
    busy = listening_on(port)
    assert busy is not None
    with busy:
        result = run_cli("launch", str(cfg), "--nproc-per-node", "2", "--master-port", str(port), env=ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: --master-port {port}: the port is in use on this machine" in result.stderr
    assert "leave --master-port out" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "run").exists()  # no worker started


def test_deepspeed_launcher_trains(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    port = str(free_port())
    result = run_cli(
        "launch", str(cfg), "--backend", "deepspeed", "--nproc-per-node", "2", "--master-port", port,
        env=ENV, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained(tmp_path / "runs" / "run", 6)


def test_crashed_worker_ends_the_launch_naming_rank_and_error(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus, max_steps=200)
    fault = "debug.faults=[{kind: crash, step: 3, rank: 1}]"
    start = time.monotonic()
    result = run_cli(
        "launch", str(cfg), fault, "--nproc-per-node", "2", "--master-port", str(free_port()), env=ENV,
        timeout=FAILURE_TIMEOUT_S + 60,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    assert elapsed < FAILURE_TIMEOUT_S
    summary = result.stderr[result.stderr.index("error: distributed training failed") :]
    first = summary.splitlines()[1].strip()
    assert (
        first
        == "rank 1 (local 1) failed with exit code 1: RuntimeError: debug.faults: simulated crash on rank 1 at step 3"
    )


def workers_once_training(launcher: subprocess.Popen[str], metrics: Path) -> dict[str | None, psutil.Process]:
    """The launch's worker processes by RANK, once the first step is logged."""
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.2)
    return {
        p.environ().get("RANK"): p
        for p in psutil.Process(launcher.pid).children(recursive=True)
        if "train" in p.cmdline()
    }


def test_killed_worker_ends_the_launch_naming_rank_and_signal(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus, max_steps=5000)
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    cmd = launch_cmd(str(cfg), "--nproc-per-node", "2", "--master-port", str(free_port()))
    launcher = subprocess.Popen(
        cmd, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        workers = workers_once_training(launcher, metrics)
        killed_at = time.monotonic()
        workers["1"].kill()
        _, stderr = launcher.communicate(timeout=FAILURE_TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert time.monotonic() - killed_at < FAILURE_TIMEOUT_S
    assert launcher.returncode == 128 + 9, stderr[-3000:]
    summary = stderr[stderr.index("error: distributed training failed") :]
    assert "rank 1 (local 1) failed with exit code -9 (killed by SIGKILL)" in summary.splitlines()[1], summary


STALL_S = 5
# stall_seconds, the watchdog's poll, the launcher's, DUMP_WAIT_S, the kill, with room for a busy machine.
STALL_BOUND_S = STALL_S + 45


def test_a_stopped_worker_ends_the_launch_with_every_ranks_stacks(tmp_path: Path, corpus: Path) -> None:
    """A SIGSTOPped rank noticed nothing and the other waited in a collective: the launch ran on. Now it
    ends (exit 1) soon after stall_seconds, naming the rank, with both ranks' stacks saved."""
    cfg = write_config(tmp_path, corpus, max_steps=5000)
    run_dir = tmp_path / "runs" / "run"
    cmd = launch_cmd(str(cfg), f"monitor.guard.stall_seconds={STALL_S}", "--nproc-per-node", "2")
    launcher = subprocess.Popen(
        cmd, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        workers = workers_once_training(launcher, run_dir / "metrics.jsonl")
        stopped_at = time.monotonic()
        workers["1"].suspend()  # SIGSTOP
        _, stderr = launcher.communicate(timeout=STALL_BOUND_S + 60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for worker in psutil.Process().children(recursive=True):
            if "train" in worker.cmdline():
                worker.kill()
    assert time.monotonic() - stopped_at < STALL_BOUND_S, stderr[-3000:]
    assert launcher.returncode == 1, stderr[-3000:]
    assert (
        f"error: rank 1 stalled (stopped: SIGSTOP or a frozen process): no training progress for {STALL_S} s"
        in stderr
    )
    assert f"every rank's stacks are in {run_dir / 'stacks'}" in stderr
    # rank 0's own watchdog; rank 1's on the launcher's request (its watchdog may add one once continued)
    for pattern in ("stall-rank0-*.txt", "stall-rank1-*-requested.txt"):
        stacks = sorted((run_dir / "stacks").glob(pattern))
        assert stacks, sorted(p.name for p in (run_dir / "stacks").iterdir())
        text = stacks[0].read_text()
        assert "Thread" in text and "File " in text, text[:2000]
    assert not list((run_dir / "stacks").glob("requested-*"))


def test_two_nodes_on_one_machine(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            launch_cmd(
                str(cfg),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ),  # fmt: skip
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    assert_trained(tmp_path / "runs" / "run", 6)


def test_deepspeed_backend_engine_and_hostfile_layout(tmp_path: Path, corpus: Path) -> None:
    """--backend deepspeed: the DeepSpeed engine unless the config names another strategy (kept,
    and said); over a hostfile the node count and master come from the file, and an --nnodes
    the file contradicts is refused."""
    cfg = write_config(tmp_path, corpus)
    shown = run_cli("launch", str(cfg), "--backend", "deepspeed", "--dry-run")
    assert "# --backend deepspeed: the workers train with the DeepSpeed engine" in shown.stdout
    named = run_cli("launch", str(cfg), "distributed.strategy=ddp", "--backend", "deepspeed", "--dry-run")
    assert "they train with distributed.strategy=ddp, as the config says" in named.stdout
    assert "distributed.strategy=deepspeed" not in named.stdout.strip().splitlines()[-1]

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-0 slots=2\n\nnode-1 slots=2\n")
    got = flags(dry_run(cfg, "--backend", "deepspeed", "--nproc-per-node", "2", "--hostfile", str(hostfile)))
    assert (got["--num_nodes"], got["--master_addr"]) == ("2", "node-0")
    wrong = run_cli(
        "launch", str(cfg), "--backend", "deepspeed", "--nnodes", "3", "--hostfile", str(hostfile)
    )
    assert wrong.returncode == 2
    assert "--nnodes 3, but --hostfile" in wrong.stderr and "lists 2 host(s) (node-0, node-1)" in wrong.stderr


# -- accelerate --------------------------------------------------------------------------------

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def run_accelerate(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Plain `accelerate launch ARGS`, as a user types it."""
    return subprocess.run(
        [*ACCELERATE, *args], env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout
    )


def manifest_engine(run_dir: Path) -> tuple[str, int, int | None]:
    summary = json.loads((run_dir / "manifest.json").read_text())["distributed"]
    return summary["engine"], summary["world_size"], summary["zero_stage"]


def test_lmforge_launch_backend_accelerate_trains_two_cpu_processes(tmp_path: Path, corpus: Path) -> None:
    cfg = write_config(tmp_path, corpus)
    result = run_cli(
        "launch", str(cfg), "distributed.strategy=ddp", "--backend", "accelerate", "--nproc-per-node", "2",
        "--master-port", str(free_port()), env=ENV, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained(tmp_path / "runs" / "run", 6)
    assert manifest_engine(tmp_path / "runs" / "run") == ("ddp", 2, None)
    assert "rank 1 holds" in result.stderr  # the second worker trained too


def test_plain_accelerate_launch_with_a_deepspeed_config_trains_on_the_deepspeed_engine(
    tmp_path: Path, corpus: Path
) -> None:
    """`accelerate launch --config_file ds.yaml -m lmforge.cli.main train cfg.yaml`: 2 workers, and
    the accelerate config's DeepSpeed ZeRO-2 becomes the engine (distributed.strategy is auto)."""
    cfg = write_config(tmp_path, corpus)
    accelerate_config = tmp_path / "accelerate.yaml"
    accelerate_config.write_text(
        yaml.safe_dump(
            {
                "compute_environment": "LOCAL_MACHINE",
                "distributed_type": "DEEPSPEED",
                "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 1},
                "num_processes": 2,
                "num_machines": 1,
                "mixed_precision": "no",
            }
        )
    )
    result = run_accelerate(
        "--config_file", str(accelerate_config), "--main_process_port", str(free_port()),
        "-m", "lmforge.cli.main", "train", str(cfg),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "run"
    assert_trained(run_dir, 6)
    assert manifest_engine(run_dir) == ("deepspeed", 2, 2)
    assert "deepspeed ZeRO-2 on 2 process(es): accelerate launch asked for DeepSpeed ZeRO-2" in result.stderr


def test_accelerate_launch_that_starts_one_process_of_two_is_refused(tmp_path: Path, corpus: Path) -> None:
    """`accelerate launch --num_processes 2 --cpu` starts ONE process (accelerate's CPU path needs
    mpirun): the worker stops (exit 2) with the command that works, before any work."""
    cfg = write_config(tmp_path, corpus)
    result = run_accelerate("--num_processes", "2", "--cpu", "-m", "lmforge.cli.main", "train", str(cfg))
    # accelerate reports its child's exit code 2 as its own traceback and exit 1; lmforge's part is the message.
    assert result.returncode != 0 and "returned non-zero exit status 2" in result.stderr, result.stderr[
        -3000:
    ]
    assert "accelerate launch started 1 process although 2 were asked for" in result.stderr
    assert "accelerate launch --multi_gpu --num_processes 2 -m lmforge.cli.main train CONFIG" in result.stderr
    assert "src/lmforge/" not in result.stderr  # no lmforge frame in any traceback
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def test_accelerate_choices_that_contradict_the_config_are_refused() -> None:
    from lmforge.config.schema import DistributedConfig
    from lmforge.distributed.accelerate_launch import (
        accelerate_choice,
        check_precision,
        forget_engine_choice,
        settings_for_accelerate,
    )

    env = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage",
        "OMP_NUM_THREADS": "1",
    }
    choice = accelerate_choice(env)
    assert choice is not None and (choice.engine, choice.zero_stage, choice.offload) == (
        "deepspeed",
        3,
        "optimizer",
    )
    mapped, note = settings_for_accelerate(DistributedConfig(), choice, grad_accum=1)
    assert (mapped.strategy, mapped.zero_stage, mapped.offload) == ("deepspeed", 3, "optimizer")
    assert note == "accelerate launch asked for DeepSpeed ZeRO-3, offload optimizer"
    with pytest.raises(UserInputError, match="asked for DeepSpeed ZeRO-3, offload optimizer but the config says "
                       "distributed.strategy: fsdp; say it in one place"):  # fmt: skip
        settings_for_accelerate(DistributedConfig(strategy="fsdp"), choice, grad_accum=1)
    with pytest.raises(UserInputError, match="--mixed_precision bf16, but train.precision resolved to fp32"):
        check_precision(choice, "fp32")
    forget_engine_choice(env)
    assert env == {"ACCELERATE_MIXED_PRECISION": "bf16", "OMP_NUM_THREADS": "1"}
    assert accelerate_choice({"PATH": "/bin"}) is None  # not started by accelerate


def test_an_accelerate_config_that_would_start_one_cpu_process_is_refused(
    tmp_path: Path, corpus: Path
) -> None:
    cfg = write_config(tmp_path, corpus)
    multi_cpu = tmp_path / "multi_cpu.yaml"
    multi_cpu.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    result = run_cli(
        "launch", str(cfg), "--backend", "accelerate", "--accelerate-config", str(multi_cpu), "--dry-run"
    )
    assert result.returncode == 2
    assert "use_cpu / distributed_type MULTI_CPU makes accelerate start one process" in result.stderr
