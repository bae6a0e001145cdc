"""A resume compares the global batch, not its factors: the same global batch on another number of
processes is the same maths (resharding resume), the same factors on another number are not."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.config.load import load_config
from lmforge.run_layout import RunPaths
from lmforge.train.provenance import GLOBAL_BATCH, changes_since_last_launch
from lmforge.train.rundir import write_resolved_config


def _cfg(micro: int, accum: int):  # type: ignore[no-untyped-def]
    base = {
        "model": {"preset": "llama-tiny"},
        "tokenizer": {"train": {"vocab_size": 1000}},
        "data": {"train": [{"path": "builtin:python-stdlib"}]},
        "train": {"micro_batch_size": micro, "grad_accum": accum},
    }
    return load_config(None, [], base=base)


def _run_written_by(
    tmp_path: Path, *, micro: int, accum: int, world: int, data: int | None = None
) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir(parents=True)
    write_resolved_config(_cfg(micro, accum), paths)
    summary: dict = {"engine": "fsdp", "world_size": world}
    if data is not None:
        summary["layout"] = {"data": data, "tensor": world // data}
    paths.manifest.write_text(json.dumps({"distributed": summary}), encoding="utf-8")
    return paths


def _maths(paths: RunPaths, micro: int, accum: int, data_parallel: int) -> list[str]:
    changes = changes_since_last_launch(_cfg(micro, accum), paths, {}, data_parallel=data_parallel)
    return [str(c) for c in changes.maths]


def test_the_same_global_batch_on_more_processes_is_the_same_maths(tmp_path: Path) -> None:
    paths = _run_written_by(tmp_path, micro=2, accum=2, world=2)  # global batch 8
    assert _maths(paths, micro=1, accum=2, data_parallel=4) == []  # 2 -> 4 processes, micro halved
    assert _maths(paths, micro=4, accum=2, data_parallel=1) == []  # 2 -> 1, micro doubled
    changes = changes_since_last_launch(_cfg(1, 2), paths, {}, data_parallel=4)
    assert [c.key for c in changes.harmless] == ["train.micro_batch_size"]  # still recorded


def test_another_global_batch_is_a_maths_change_even_with_the_same_factors(tmp_path: Path) -> None:
    paths = _run_written_by(tmp_path, micro=2, accum=2, world=2)
    assert _maths(paths, micro=2, accum=2, data_parallel=4) == [
        f"{GLOBAL_BATCH}: 8 on 2 process(es) -> 16 on 4 process(es)"
    ]
    both = _maths(paths, micro=1, accum=2, data_parallel=2)
    assert (
        "train.micro_batch_size: 2 -> 1" in both
        and f"{GLOBAL_BATCH}: 8 on 2 process(es) -> 4 on 2 process(es)" in both
    )


def test_tensor_parallel_ranks_share_one_batch(tmp_path: Path) -> None:
    # 4 processes as data 2 x tensor 2: the global batch is micro x accum x 2, not x 4.
    paths = _run_written_by(tmp_path, micro=2, accum=1, world=4, data=2)
    assert _maths(paths, micro=1, accum=1, data_parallel=4) == []  # now 4-way data parallel
