"""Communication metrics (monitor.comm_metrics): the interval maths, the window, the switches and
DeepSpeed's comms logger as lmforge reads it.

The engines' real collectives are timed in the 2-process runs of tests/test_distributed.py
(`comm_metrics_problems` there): DDP logs a positive all-reduce time at every logged step,
FSDP2 positive all-gather and reduce-scatter times, DeepSpeed ZeRO-2 / ZeRO-3 a positive
communication time, each with 0 < comm_share <= 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import load_config
from lmforge.config.schema import MonitorConfig
from lmforge.distributed.comm_timing import KINDS, CommTimer, deepspeed_kind, union_seconds
from lmforge.distributed.deepspeed_config import COMMS_LOGGER, add_comms_logger
from lmforge.distributed.ranks import World
from lmforge.distributed.strategy import plan_for
from lmforge.monitor.prometheus import METRICS
from lmforge.report import write_report
from lmforge.train.comm_callback import comm_timing
from tests.test_report import build_run


def test_the_union_of_intervals_counts_overlapping_time_once() -> None:
    assert union_seconds([]) == 0.0
    assert union_seconds([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)
    assert union_seconds([(0.0, 1.0), (0.5, 2.0)]) == pytest.approx(2.0)  # overlapping
    assert union_seconds([(0.0, 4.0), (1.0, 2.0), (3.0, 3.5)]) == pytest.approx(4.0)  # nested
    assert union_seconds([(2.0, 3.0), (0.0, 1.0), (1.0, 2.0)]) == pytest.approx(3.0)  # touching, unsorted


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_window_gives_per_step_means_by_kind_and_the_share_of_step_time() -> None:
    clock = FakeClock()
    timer = CommTimer(("all_gather", "reduce_scatter"), clock=clock)
    for step in range(2):
        clock.now = 10.0 * step
        timer.step_started()
        clock.now += 1.0
        first = timer.launched("all_gather")
        clock.now += 1.0
        second = timer.launched("all_gather")  # in flight together with the first: [1, 4] in all
        clock.now += 2.0
        timer.completed(first)
        timer.completed(second)
        clock.now += 1.0
        reduce = timer.launched("reduce_scatter")  # overlaps nothing: [5, 6]
        clock.now += 1.0
        timer.completed(reduce)
        clock.now += 4.0
        timer.step_ended()  # a 10 s step
    window = timer.take_window()
    assert window == pytest.approx(
        {"comm_all_gather_s": 3.0, "comm_reduce_scatter_s": 1.0, "comm_s": 4.0, "comm_share": 0.4}
    )
    assert timer.take_window() == {}  # a new window: no step yet


def test_overlapping_kinds_count_once_in_the_share_and_outside_a_step_nothing_counts() -> None:
    clock = FakeClock()
    timer = CommTimer(("all_reduce", "all_gather"), clock=clock)
    assert timer.launched("all_reduce") is None  # evaluation, checkpoint saves: not in a step
    timer.step_started()
    reduce = timer.launched("all_reduce")
    gather = timer.launched("all_gather")
    clock.now = 2.0
    timer.completed(reduce)
    timer.completed(gather)
    open_at_end = timer.launched("all_reduce")  # still in flight at the end: counted up to it
    clock.now = 3.0
    timer.add_seconds("all_gather", 0.5)  # measured by the engine (DeepSpeed): summed
    timer.step_ended()
    assert open_at_end is not None and open_at_end.end is None
    assert timer.take_window() == pytest.approx(
        {"comm_all_reduce_s": 3.0, "comm_all_gather_s": 2.5, "comm_s": 3.5, "comm_share": 1.0}
    )


class FakeEvent:
    """torch.cuda.Event on a fake device clock: complete once the device has reached it."""

    clock = FakeClock()
    device_at = 0.0  # how far the device has got

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.clock.now

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.device_at

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an event that has not completed"
        return (end.at - self.at) * 1e3  # type: ignore[operator]


def test_on_cuda_events_are_read_once_complete_and_never_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.Event", FakeEvent)
    clock = FakeEvent.clock
    clock.now, FakeEvent.device_at = 0.0, -1.0
    timer = CommTimer(("all_reduce",), clock=clock)
    timer.cuda = True
    timer.step_started()
    clock.now = 1.0
    op = timer.launched("all_reduce")
    clock.now = 3.0
    timer.completed(op)
    clock.now = 4.0
    timer.step_ended()  # the host is ahead: the device has not run the step yet
    assert timer.take_window() == {}
    FakeEvent.device_at = 4.0  # now it has
    assert timer.take_window() == pytest.approx({"comm_all_reduce_s": 2.0, "comm_s": 2.0, "comm_share": 0.5})


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("all_reduce", "all_reduce"),
        ("inference_all_reduce", "all_reduce"),
        ("all_reduce_coalesced", "all_reduce"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("reduce_scatter_fn", "reduce_scatter"),
        ("all_gather_into_tensor", "all_gather"),
        ("allgather_fn", "all_gather"),
        ("broadcast", "other"),
        ("reduce", "other"),
    ],
)
def test_deepspeed_op_names_map_to_the_three_kinds(name: str, kind: str) -> None:
    assert deepspeed_kind(name) == kind


@pytest.mark.integration  # heavy: `make test-integration` (CI stays near its time budget)
def test_deepspeed_comms_logger_logs_running_totals_that_a_reset_starts_over() -> None:
    """The DeepSpeed behaviour DeepSpeedComms relies on (deepspeed.comm.timed_op): each record is
    the op name's total since its timer was last reset. One process, gloo, in a subprocess."""
    script = textwrap.dedent(
        """
        import json, os, socket, time
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        import torch
        import deepspeed.comm as dist
        from lmforge.distributed.comm_timing import DeepSpeedComms
        dist.init_distributed(dist_backend="gloo", verbose=False)
        dist.configure(enabled=True, prof_all=True)
        comms = DeepSpeedComms()
        comms.reset()
        tensor = torch.ones(2_000_000)
        started = time.perf_counter()
        for _ in range(4):
            dist.all_reduce(tensor)
        wall = time.perf_counter() - started
        records = comms.logger.get_raw_data()["all_reduce"][8_000_000][1]
        seconds = comms.step_seconds()
        comms.reset()
        dist.all_reduce(tensor)
        after = comms.logger.get_raw_data()["all_reduce"][8_000_000][1]
        print(json.dumps({"records": records, "seconds": seconds, "wall": wall, "after": after}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    records = found["records"]
    assert len(records) == 4 and records == sorted(records)  # running totals, in ms
    assert found["seconds"] == pytest.approx({"all_reduce": records[-1] / 1e3})
    assert 0 < found["seconds"]["all_reduce"] <= found["wall"]
    assert len(found["after"]) == 1 and found["after"][0] < records[-1]  # the reset started it over


def test_deepspeed_comms_logger_is_added_on_cpu_and_the_users_block_wins() -> None:
    config: dict[str, Any] = {}
    add_comms_logger(config, on_gpu=False)
    assert config == {"comms_logger": COMMS_LOGGER} and COMMS_LOGGER["enabled"] is True
    on_gpu: dict[str, Any] = {}
    add_comms_logger(on_gpu, on_gpu=True)  # it synchronises the GPU after every collective
    assert on_gpu == {}
    users = {"comms_logger": {"enabled": False}}
    add_comms_logger(users, on_gpu=False)
    assert users == {"comms_logger": {"enabled": False}}


def _config(**monitor: Any) -> Any:
    return load_config(
        None,
        base={
            "model": {"preset": "llama-tiny"},
            "tokenizer": {"train": {"vocab_size": 300}},
            "data": {"train": [{"path": "x.jsonl"}]},
            "distributed": {"strategy": "deepspeed", "zero_stage": 2},
            "monitor": monitor,
        },
    )


@pytest.mark.parametrize(
    ("monitor", "size", "logged"),
    [({}, 2, True), ({"comm_metrics": False}, 2, False), ({"enabled": False}, 2, False), ({}, 1, False)],
)
def test_the_generated_deepspeed_config_logs_comms_only_when_comm_metrics_apply(
    monitor: dict[str, Any], size: int, logged: bool
) -> None:
    plan = plan_for(_config(**monitor), precision="fp32", on_gpu=False, world=World(size, size, 0))
    assert plan.deepspeed is not None
    assert ("comms_logger" in plan.deepspeed) is logged


def test_comm_timing_is_off_in_single_process_runs_and_when_switched_off() -> None:
    on = MonitorConfig()
    assert on.comm_metrics is True  # on by default
    assert comm_timing(on, "ddp", 2) is not None
    assert comm_timing(on, "fsdp", 4) is not None and comm_timing(on, "deepspeed", 2) is not None
    assert comm_timing(on, "none", 1) is None and comm_timing(on, "ddp", 1) is None
    assert comm_timing(MonitorConfig(comm_metrics=False), "ddp", 2) is None
    assert comm_timing(MonitorConfig(enabled=False), "ddp", 2) is None


def test_every_comm_field_is_exported_to_prometheus_and_charted_in_the_report(tmp_path: Path) -> None:
    fields = {"comm_s", "comm_share", *(f"comm_{kind}_s" for kind in KINDS)}
    assert fields <= {m.key for m in METRICS}
    run = build_run(tmp_path)
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for record in records:  # as a DDP run logs them
        record.update(comm_all_reduce_s=0.004, comm_s=0.004, comm_share=0.2)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(run).read_text()
    share = re.search(r'<svg class="plot" data-metric="comm_share".*?</svg>', page, re.S)
    assert share is not None and "log scale" not in share.group(0)
    seconds = re.search(r'<svg class="plot" data-metric="comm_s".*?</svg>', page, re.S)
    assert seconds is not None and "all-reduce" in seconds.group(0)
