"""`lmforge train CONFIG` in a torchrun worker with train.precision fp8 on CPU (gloo, FSDP2): the device
check is answered as on an H100 (torch._scaled_mm runs on CPUs too), and each rank records, after
every precompute of the float8 scales, how many sharded float8 weights hold one.

Run under `torchrun --nproc_per_node 2 tests/dist_scripts/fp8_fsdp_worker.py OUT CONFIG`; writes
OUT/rank{R}.json: [scales set after each precompute]."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lmforge.cli  # noqa: F401  (first: its console filter and quiet import notices, as `lmforge` has)
from lmforge.train import fp8, precision, preflight

for module in (preflight, precision):
    module.require_fp8_device = lambda **_: None  # type: ignore[attr-defined]

scales_set: list[int] = []
precompute = fp8.Float8ScalesCallback._precompute


def recorded(self: fp8.Float8ScalesCallback, model: Any) -> None:
    precompute(self, model)
    weights = [
        getattr(m.weight, "_local_tensor", None)
        for m in model.modules()
        if type(m).__name__ == "Float8Linear"
    ]
    scales_set.append(sum(getattr(w, "_precomputed_scale", None) is not None for w in weights))


fp8.Float8ScalesCallback._precompute = recorded  # type: ignore[method-assign]

if __name__ == "__main__":
    from lmforge.cli.main import main

    out, config = Path(sys.argv[1]), sys.argv[2]
    sys.argv = ["lmforge", "train", config]
    try:
        main()
    finally:
        (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(scales_set))
