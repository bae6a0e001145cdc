"""Feed configs to DeepSpeed's own DeepSpeedConfig for many data-parallel world sizes.

DeepSpeedConfig asserts train_batch_size == micro-batch x accumulation x world size. It reads
the world size from its `mpu` (model-parallel unit) argument, DeepSpeed's interface for
Megatron-style groups, once its communication backend is up: a one-process gloo group here.
Reads a JSON list of [config, world_size] pairs on stdin; prints one JSON list of results.
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig


class DataParallelOnly:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def main() -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    os.environ.setdefault("MASTER_PORT", sys.argv[1] if len(sys.argv) > 1 else "29511")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    results = []
    for config, world_size in json.load(sys.stdin):
        try:
            parsed = DeepSpeedConfig(config, mpu=DataParallelOnly(world_size))
            results.append(
                {
                    "ok": True,
                    "train_batch_size": parsed.train_batch_size,
                    "stage": parsed.zero_optimization_stage,
                }
            )
        except AssertionError as err:
            results.append({"ok": False, "error": str(err)})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
