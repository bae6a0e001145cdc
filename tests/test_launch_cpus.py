"""Each node's workers get that node's CPU cores: the sbatch script asks Slurm for whole nodes and
counts OMP_NUM_THREADS on each node, and workers started over ssh by the deepspeed launcher (which
carries no OMP_NUM_THREADS) count their own node's cores."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from lmforge.distributed.launch import LaunchRequest, plan_launch, slurm_script
from lmforge.distributed.ranks import current_world, share_node_cores

CORES = len(os.sched_getaffinity(0))


def _request(tmp_path: Path, **fields: object) -> LaunchRequest:
    config = tmp_path / "cfg.yaml"
    config.write_text("run: {name: run}\n")
    settings: dict[str, object] = {"nproc_per_node": 1, **fields}
    return LaunchRequest(config=config, overrides=[], run_name="run", **settings)  # type: ignore[arg-type]


def _node_threads(payload: str, cpus: str) -> str:
    """OMP_NUM_THREADS as the per-node part of the srun payload sets it on a node with `cpus`."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    setup = payload.split("; exec ", 1)[0]
    shell = ["taskset", "-c", cpus, "bash", "-c", f'{setup}; echo "$OMP_NUM_THREADS"']
    return subprocess.run(shell, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(CORES < 2, reason="needs two CPU cores to tell nodes apart")
def test_slurm_script_takes_whole_nodes_and_each_node_counts_its_own_cores(tmp_path: Path) -> None:
    script = slurm_script(_request(tmp_path, nnodes="2"), tmp_path)
    lines = script.splitlines()
    assert "#SBATCH --exclusive" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    words = shlex.split(srun)
    assert "--cpus-per-task=$SLURM_CPUS_ON_NODE" in words  # the one task gets the node's CPUs
    # Not counted once on the batch host and exported everywhere: each node runs the count itself.
    assert not any(line.startswith("export OMP_NUM_THREADS") for line in lines)
    payload = words[-1]
    assert _node_threads(payload, "0") == "1"  # a node that gives the task one CPU
    assert _node_threads(payload, f"0-{CORES - 1}") == str(CORES)  # one with all of this machine's
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


def test_deepspeed_over_ssh_leaves_the_thread_count_to_each_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-0 slots=1\nnode-1 slots=1\n")
    plan = plan_launch(
        _request(tmp_path, nnodes="2", backend="deepspeed", hostfile=hostfile, master_addr="node-0")
    )
    assert "OMP_NUM_THREADS" not in plan.env  # the launch host's count would not reach node-1
    assert any("each worker sets it from its own node's CPU cores" in note for note in plan.notes)
    local = plan_launch(_request(tmp_path, nproc_per_node=2))  # one node: counted here, as before
    assert local.env["OMP_NUM_THREADS"] == str(max(1, CORES // 2))


def test_a_worker_without_omp_num_threads_takes_its_share_of_the_node() -> None:
    before = torch.get_num_threads()
    try:
        env = {"WORLD_SIZE": "4", "LOCAL_SIZE": "2", "RANK": "3"}  # as the deepspeed launcher sets it
        assert share_node_cores(env) == max(1, CORES // 2)
        assert env["OMP_NUM_THREADS"] == str(max(1, CORES // 2))
        assert torch.get_num_threads() == max(1, CORES // 2)
        assert share_node_cores({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "3"}) is None  # the user's
        assert share_node_cores({"LOCAL_WORLD_SIZE": "1"}) is None  # one worker: torch's default
    finally:
        torch.set_num_threads(before)


def test_the_deepspeed_launchers_local_size_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for name, value in {"WORLD_SIZE": "8", "LOCAL_SIZE": "4", "RANK": "5"}.items():
        monkeypatch.setenv(name, value)
    world = current_world()
    assert (world.local_size, world.nodes) == (4, 2)
