"""The OOM ladder: out of memory with nothing left to halve, `lmforge launch` restarts the run from
its newest complete checkpoint with the next memory saver on (train/oom_ladder.py).

The drill is `debug.faults: [{kind: oom, ...}]` at micro-batch 1: an oom fault fires only while
the run has taken no rung, as if the rung had freed the memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lmforge.config import LmforgeConfig, load_config
from lmforge.config.schema import OOM_RUNGS
from lmforge.monitor.diagnosis import diagnose_run
from lmforge.train.oom_ladder import OOM_LADDER_EXIT, RESTART_OVERRIDES, TrainingEngine, next_rung
from lmforge.train.provenance import MATHS_KEYS
from tests.conftest import SMALL_ARCH, run_cli
from tests.test_launch import free_port

ENV = {"OMP_NUM_THREADS": "1"}
OOM_AT_STEP_3 = "debug.faults=[{kind: oom, step: 3}]"
SINGLE_CPU = TrainingEngine()
BASE = {
    "model": {"preset": "llama-tiny"},
    "tokenizer": {"path": "tok"},
    "data": {"train": [{"path": "x.jsonl"}]},
}


def config(*overrides: str) -> LmforgeConfig:
    return load_config(None, list(overrides), base=BASE)


# -- which rung is next ---------------------------------------------------------------------------


def test_the_first_rung_is_gradient_checkpointing() -> None:
    choice = next_rung(config(), SINGLE_CPU)
    assert (choice.rung, choice.number, choice.overrides, choice.skipped) == (
        "gradient_checkpointing",
        1,
        ["train.gradient_checkpointing=true"],
        [],
    )


def test_a_rung_already_on_is_passed_over_and_said() -> None:
    choice = next_rung(config("train.gradient_checkpointing=true"), SINGLE_CPU)
    assert (choice.rung, choice.number) == ("chunked_cross_entropy", 2)
    assert choice.overrides == ["train.chunked_cross_entropy=true"]
    assert choice.skipped == ["gradient checkpointing (already on)"]


def test_rungs_that_do_not_apply_are_passed_over_until_none_is_left() -> None:
    # Stage dpo has its own loss; on the CPU activations and states are in host memory already;
    # a single process has nothing sharded to offload.
    choice = next_rung(config("train.stage=dpo", "train.gradient_checkpointing=true"), SINGLE_CPU)
    assert choice.rung is None
    assert choice.skipped == [
        "gradient checkpointing (already on)",
        "the chunked cross-entropy loss (stage dpo computes its own loss)",
        "activation offload (training on the CPU: activations are in host memory already)",
        "CPU offload of the sharded states (a single process shards nothing)",
    ]


def test_the_ladder_off_has_no_rung() -> None:
    choice = next_rung(config("monitor.guard.oom_ladder=[]"), SINGLE_CPU)
    assert (choice.rung, choice.skipped) == (None, [])


@pytest.mark.parametrize(
    ("settings", "engine", "expected"),
    [
        (
            ["distributed.strategy=fsdp"],
            TrainingEngine("fsdp", on_gpu=True),
            ["distributed.offload=optimizer+params"],
        ),
        (
            ["distributed.strategy=deepspeed", "distributed.zero_stage=2"],
            TrainingEngine("deepspeed", 2, on_gpu=True),
            ["distributed.offload=optimizer"],
        ),
        # strategy auto decides again at each start: a restart keeps the engine of its checkpoints.
        (
            [],
            TrainingEngine("deepspeed", 2, on_gpu=True),
            [
                "distributed.strategy=deepspeed",
                "distributed.zero_stage=2",
                "distributed.offload=none",
                "distributed.offload=optimizer",
            ],
        ),
    ],
)
def test_offload_is_the_last_rung_of_a_sharded_gpu_run(
    settings: list[str], engine: TrainingEngine, expected: list[str]
) -> None:
    # The chunked loss does not run under FSDP (the ladder passes it over there).
    chunked = [] if engine.name == "fsdp" else ["train.chunked_cross_entropy=true"]
    savers_on = [*settings, "train.gradient_checkpointing=true", *chunked]
    choice = next_rung(config(*savers_on, "train.activation_offload=true"), engine)
    assert (choice.rung, choice.number, choice.overrides) == ("offload", 4, expected)
    assert config(*savers_on, *choice.overrides).distributed.offload != "none"  # the config takes them


@pytest.mark.parametrize(
    ("settings", "engine", "why"),
    [
        (["distributed.strategy=ddp"], TrainingEngine("ddp", on_gpu=True), "ddp shards nothing"),
        (
            ["distributed.strategy=deepspeed", "distributed.zero_stage=1"],
            TrainingEngine("deepspeed", 1, on_gpu=True),
            "DeepSpeed offloads from ZeRO-2 up and this run is ZeRO-1",
        ),
        (
            ["distributed.strategy=deepspeed", "distributed.zero_stage=3", "distributed.offload=optimizer"],
            TrainingEngine("deepspeed", 3, "optimizer", on_gpu=True),
            "already on",
        ),
    ],
)
def test_offload_does_not_apply_without_a_sharded_engine_to_offload(
    settings: list[str], engine: TrainingEngine, why: str
) -> None:
    choice = next_rung(
        config(*settings, "monitor.guard.oom_ladder=[offload, gradient_checkpointing]"), engine
    )
    assert (choice.rung, choice.number) == ("gradient_checkpointing", 2)
    assert choice.skipped == [f"CPU offload of the sharded states ({why})"]


def test_a_restart_with_every_rung_on_is_never_refused_as_a_changed_run() -> None:
    """A resume refuses changed maths settings (train/provenance.py); no rung and no restart override is one.
    The climb goes as the launcher drives it: each restart runs with every rung taken so far."""
    taken: list[str] = []
    for _ in OOM_RUNGS:
        cfg = config(*taken)
        choice = next_rung(cfg, TrainingEngine("deepspeed", 2, cfg.distributed.offload, on_gpu=True))
        assert choice.rung is not None
        taken += choice.overrides
    cfg = config(*taken)
    assert next_rung(cfg, TrainingEngine("deepspeed", 2, cfg.distributed.offload, on_gpu=True)).rung is None
    keys = {override.partition("=")[0] for override in [*taken, *RESTART_OVERRIDES]}
    assert not [key for key in keys if key.startswith(MATHS_KEYS)]


# -- the drill, end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenizer and data cache for the module's runs: only the first one trains and tokenizes."""
    return tmp_path_factory.mktemp("cache")


def write_config(tmp_path: Path, corpus: Path, cache: Path) -> Path:
    cfg = {
        "run": {"name": "run", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 64, "cache_dir": str(cache)},
        "train": {"max_steps": 5, "micro_batch_size": 1, "lr": 3e-3, "precision": "fp32", "save_every": 2},
        "monitor": {"loggers": [], "system_metrics_seconds": None},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# Events that report wall-time measurements (the share of a step spent waiting for batches): a
# loaded machine (the suite's other worker) can raise one at step 1, which says nothing about the ladder.
TIMING_EVENTS = ("data_bound",)


def events_of(run_dir: Path) -> list[dict]:
    """The run's events, less the timing ones."""
    lines = (run_dir / "events" / "events.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["kind"] not in TIMING_EVENTS]


@pytest.mark.slow
def test_launch_restarts_one_rung_up_from_the_last_checkpoint_and_finishes(
    tmp_path: Path, corpus: Path, cache: Path
) -> None:
    cfg = write_config(tmp_path, corpus, cache)
    result = run_cli(
        "launch", str(cfg), OOM_AT_STEP_3, "--nproc-per-node", "1", "--master-port", str(free_port()), env=ENV
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "lmforge launch: out of memory at step 3 with micro-batch 1: restarting from checkpoints/step-2 with "
        "gradient checkpointing on (rung 1 of 4)\n" in result.stderr
    )
    assert "Traceback" not in result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "run"
    ladder = json.loads((run_dir / "oom_ladder.json").read_text())["rungs"]
    assert [(r["rung"], r["step"], r["micro_batch"], r["checkpoint"], r["overrides"]) for r in ladder] == [
        ("gradient_checkpointing", 3, 1, "checkpoints/step-2", ["train.gradient_checkpointing=true"])
    ]
    events = events_of(run_dir)
    assert [(e["kind"], e["step"]) for e in events] == [
        ("oom_ladder", 3),
        ("config_changed", 2),
        ("finished", 5),
    ]
    assert events[0]["rung"] == "gradient_checkpointing" and "simulated out-of-memory" in events[0]["error"]
    # The restart resumed from step 2 with the rung on, and the step axis goes on from there.
    assert events[1]["message"] == "since the last launch: train.gradient_checkpointing: false -> true"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["gradient_checkpointing"] is True
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert (run_dir / "final" / "config.json").is_file()
    # `lmforge doctor RUN_DIR` says to start the next run with the rung on.
    finding = next(f for f in diagnose_run(run_dir) if f.id == "oom_ladder")
    assert finding.changes == ["train.gradient_checkpointing=true"]


@pytest.mark.slow
def test_with_the_ladder_off_the_run_stops_with_what_to_do_next(
    tmp_path: Path, corpus: Path, cache: Path
) -> None:
    cfg = write_config(tmp_path, corpus, cache)
    result = run_cli(
        "launch", str(cfg), OOM_AT_STEP_3, "monitor.guard.oom_ladder=[]", "--nproc-per-node", "1",
        "--master-port", str(free_port()), env=ENV,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: out of memory"))
    assert error.startswith(
        "error: out of memory at step 3 with micro-batch 1, and the OOM ladder is off (monitor.guard.oom_ladder: []). "
        "What to try next: lower data.max_length or train.micro_batch_size"
    )
    assert "train.gradient_checkpointing=true" in error and "lmforge estimate CONFIG" in error
    assert "Traceback" not in result.stdout + result.stderr
    assert "restarting" not in result.stderr
    run_dir = tmp_path / "runs" / "run"
    assert [(e["kind"], e["step"]) for e in events_of(run_dir)] == [("failed", 3)]
    assert not (run_dir / "oom_ladder.json").exists() and not (run_dir / "final").exists()


@pytest.mark.slow
def test_train_alone_stops_and_says_that_launch_restarts_one_rung_up(
    tmp_path: Path, corpus: Path, cache: Path
) -> None:
    cfg = write_config(tmp_path, corpus, cache)
    result = run_cli("train", str(cfg), OOM_AT_STEP_3, env=ENV)
    assert result.returncode == OOM_LADDER_EXIT, result.stderr[-3000:]
    assert "stopped out of memory at step 3 with micro-batch 1. Under `lmforge launch`" in result.stdout
    assert "from checkpoints/step-2 with gradient checkpointing on (rung 1 of 4" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    # `lmforge launch` of this run keeps the rung on from the start (and shows it in --dry-run).
    shown = run_cli("launch", str(cfg), OOM_AT_STEP_3, "--nproc-per-node", "1", "--dry-run", env=ENV)
    assert shown.returncode == 0, shown.stderr
    assert (
        "this run took rungs of the OOM ladder before; they stay on: gradient checkpointing" in shown.stdout
    )
    assert shown.stdout.rstrip().endswith("train.gradient_checkpointing=true")
