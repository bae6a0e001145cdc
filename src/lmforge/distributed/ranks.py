"""Who this worker is in the job, and the few places where ranks must take turns.

The world comes from the environment torchrun / the deepspeed launcher set (WORLD_SIZE,
LOCAL_WORLD_SIZE, RANK). The process group is opened early, the way accelerate would open it
(gloo on CPU, nccl on GPU), so that rank 0 can set the run directory up and prepare the
data cache before the other ranks read them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    size: int
    local_size: int
    rank: int

    @property
    def nodes(self) -> int:
        return max(self.size // max(self.local_size, 1), 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_world() -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(size=size, local_size=_local_size(os.environ, size), rank=int(os.environ.get("RANK", "0")))


def _local_size(env: Mapping[str, str], default: int) -> int:
    """Workers on this node: torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE."""
    return int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or default)


def share_node_cores(env: MutableMapping[str, str] = os.environ) -> int | None:
    """Give each worker its share of this node's cores when no launcher set OMP_NUM_THREADS: the
    deepspeed launcher starts other hosts over ssh with only PYTHON*/NCCL*/UCX* variables and those of
    .deepspeed_env, so the launch host's count never reaches them, and torch would give every worker
    all of the node's cores. The share is this node's own (its cores, as this process may use them,
    divided by its workers), as `lmforge launch` computes it on the launch host. The thread count
    set, or None where OMP_NUM_THREADS was set or one worker runs here."""
    local = _local_size(env, 1)
    if "OMP_NUM_THREADS" in env or local <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // local)
    env["OMP_NUM_THREADS"] = str(threads)  # for the processes this worker starts (data loaders)
    torch.set_num_threads(threads)
    return threads


def ensure_process_group() -> None:
    """Open the default process group if the launcher started several workers and nobody has yet."""
    if dist.is_initialized() or current_world().size == 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def wait_for_everyone() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def leave_process_group() -> None:
    """Tear the process group down once every rank has finished its run: torch's documented
    ending, rather than leaving gloo's and nccl's threads to the interpreter's exit. Only on
    success: with a rank already dead, the barrier would wait for it until the timeout (the
    launcher tears a failed job down instead)."""
    if dist.is_initialized():
        wait_for_everyone()
        dist.destroy_process_group()


@contextmanager
def main_first(world: World) -> Iterator[None]:
    """Rank 0 runs the block first (claims the run directory, fills the data cache); the others
    then run it against what rank 0 wrote. Should rank 0 fail inside, the launcher's agent
    stops the waiting ranks (torchrun tears the whole worker group down)."""
    if world.size == 1:
        yield
        return
    ensure_process_group()
    if not world.is_main:
        wait_for_everyone()
    yield
    if world.is_main:
        wait_for_everyone()
