"""Distributed training on real engines, 2 processes on gloo: DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3.

Each strategy trains the same tiny model on the same data as one process with the same global
batch (2 ranks x 2 sequences = 1 x 4) and seed; the loss curves must agree, and a run resumed
from the strategy's own mid-run checkpoint must continue the same curve. That resume also checks
that it runs no code from the checkpoints (reliability issue, item 1): the two newer checkpoints
hold a planted pickle, and are skipped (tests/test_resume_safety.py has the rest of that promise).

Tolerance: the engines compute the same global-token-mean gradient as the single process, but
sum it in another order (per-rank partial sums, then an all-reduce; DeepSpeed also flattens
gradients into buckets, and with offload steps them with its own CPU Adam). fp32 rounding
differences of ~1e-7 relative are amplified by Adam, whose update m/sqrt(v) is O(lr) even for
tiny gradient entries. Measured over 8 steps: at most 1e-6 (DDP, FSDP, ZeRO-2, ZeRO-3) and
3e-6 (ZeRO-3 with offload). TOLERANCE (1e-4 absolute on a loss of ~5) leaves a 30x margin and
is still a thousand times smaller than one step's loss change at this lr (0.03-0.3): a wrong
global batch, a missed all-reduce or a mis-scaled loss would all show.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lmforge.ckpt.atomic import check_checkpoint
from lmforge.export.consolidate import consolidate
from tests.conftest import SMALL_ARCH, reseal, run_cli
from tests.test_resume_safety import plant

TOLERANCE = 1e-4
STEPS = 8


def base_config(out: Path, corpus: Path, name: str, *, micro_batch: int, **distributed: Any) -> dict:
    return {
        "run": {"name": name, "output_dir": str(out), "seed": 0},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 64},
        "train": {
            "max_steps": STEPS,
            "micro_batch_size": micro_batch,
            "lr": 3e-3,
            "precision": "fp32",
            "log_every": 1,
            "warmup_steps": 0,
            "save_every": STEPS // 2,
            "keep_last": 5,
        },
        "distributed": distributed,
        "monitor": {"loggers": [], "system_metrics_seconds": None},
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(
    config: Path, *overrides: str, nproc: int = 2, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """`lmforge launch` on one node: torchrun's agent, `nproc` workers on gloo (`fresh`: new
    interpreters all the way down, see run_cli)."""
    return run_cli(
        "launch", str(config), *overrides, "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
        env={"OMP_NUM_THREADS": "1"}, timeout=900, fresh=fresh,
    )  # fmt: skip


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def single_process_curve(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[int, float]:
    out = tmp_path_factory.mktemp("single")
    config = write(out / "single.yaml", base_config(out, corpus, "single", micro_batch=4, strategy="none"))
    result = run_cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(out / "single")
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}
# Share of the parameters each of the 2 ranks holds while training: sharded or replicated.
HELD = {"ddp": 1.0, "fsdp": 0.5, "zero2": 1.0, "zero3": 0.5}
# monitor.comm_metrics (on by default): the time each engine's collectives took, positive at every
# logged step (DDP's comm hook, FSDP2's custom collectives, DeepSpeed's comms logger).
COMM_TIMED = {
    "ddp": ("comm_all_reduce_s",),
    "fsdp": ("comm_all_gather_s", "comm_reduce_scatter_s"),
    "zero2": ("comm_all_reduce_s", "comm_all_gather_s"),
    "zero3": ("comm_all_gather_s", "comm_reduce_scatter_s"),
}


def comm_metrics_problems(run_dir: Path, name: str) -> list[str]:
    """Logged steps whose communication times are missing, not positive, or a share outside (0, 1]."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    problems = []
    for record in (r for r in records if "loss" in r):
        times = {key: record.get(key) for key in (*COMM_TIMED[name], "comm_share")}
        if not all(isinstance(v, float) and v > 0 for v in times.values()) or times["comm_share"] > 1:
            problems.append(f"step {record['step']}: {times}")
    return problems


def held_shares(stderr: str) -> dict[int, float]:
    """Each rank's `rank R holds X of Y parameter elements` line, as X / Y."""
    found = re.findall(r"rank (\d+) holds ([\d,]+) of ([\d,]+) parameter elements", stderr)
    return {int(r): int(x.replace(",", "")) / int(y.replace(",", "")) for r, x, y in found}


# Slots each engine's loader unpickles in full, one in each of the two newest checkpoints (steps 8
# and 6): a planted pickle there must be skipped, naming the file, and the run resumes from step 4.
PLANTED = {
    "ddp": {8: "optimizer.pt", 6: "scheduler.pt"},
    "fsdp": {8: "pytorch_model_fsdp_0/.metadata", 6: "optimizer_0/.metadata"},
    "zero2": {
        8: "global_step8/mp_rank_00_model_states.pt",
        6: "global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    },
    "zero3": {
        8: "global_step8/zero_pp_rank_0_mp_rank_00_model_states.pt",
        6: "global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    },
}


# ZeRO-2's case runs in `make test-integration` (CI time): ZeRO-3's takes the same DeepSpeed path, and
# ZeRO-2 still trains, checkpoints and resumes past planted pickles in CI in
# test_a_zero2_run_resumes_past_planted_pickles_and_never_runs_them below, and in
# tests/test_consolidate.py.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.integration) if n == "zero2" else n for n in STRATEGIES]
)
def test_two_processes_match_one_and_resume_from_their_own_checkpoint(
    name: str, tmp_path: Path, corpus: Path, single_process_curve: dict[int, float]
) -> None:
    settings = base_config(tmp_path, corpus, name, micro_batch=2, **STRATEGIES[name])
    settings["train"] = {**settings["train"], "save_every": 2}  # steps 2, 4, 6, 8: the resume below
    config = write(tmp_path / f"{name}.yaml", settings)
    result = torchrun(config)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / name
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    worst = max(abs(curve[s] - single_process_curve[s]) for s in curve)
    assert worst < TOLERANCE, (name, curve, single_process_curve)
    assert curve[STEPS] < curve[1] - 0.5  # it learned
    shares = held_shares(result.stderr)
    assert sorted(shares) == [0, 1] and all(abs(v - HELD[name]) < 0.01 for v in shares.values()), shares
    assert not comm_metrics_problems(run_dir, name), comm_metrics_problems(run_dir, name)
    # The console says the end once (it said `done` once per rank), the end is no warning, and
    # torch.distributed's own notices (DTensor, FSDP2) stay in train.log.
    printed = result.stdout + result.stderr
    assert printed.count(f"done {STEPS} steps") == 1, printed[-3000:]
    assert f"INFO lmforge.monitor.events: [finished] step {STEPS}" in printed
    assert not re.search(r"torch/distributed/\S+: UserWarning", printed), printed[-3000:]

    manifest = json.loads((run_dir / "manifest.json").read_text())
    engine = "deepspeed" if name.startswith("zero") else name
    if engine == "fsdp":  # torch DCP: every rank writes its own shard of model and optimizer
        assert (
            middle_dir := run_dir / "checkpoints" / f"step-{STEPS // 2}" / "pytorch_model_fsdp_0"
        ).is_dir()
        assert len(list(middle_dir.glob("*.distcp"))) == 2
    assert manifest["distributed"]["engine"] == engine and manifest["distributed"]["world_size"] == 2
    # The report names the engine the run used (the config's strategy alone would not say ZeRO-3).
    strategy = f"deepspeed ZeRO-{name[-1]}" if engine == "deepspeed" else engine
    assert f"<th>strategy</th><td>{strategy} x 2 processes on CPU" in (run_dir / "report.html").read_text()
    middle = run_dir / "checkpoints" / f"step-{STEPS // 2}"
    assert check_checkpoint(middle).complete
    writer = json.loads((middle / "lmforge_writer.json").read_text())
    assert (writer["engine"], writer["world_size"]) == (engine, 2)
    if engine == "deepspeed":
        stage = int(name[-1])
        assert writer["zero_stage"] == stage
        resolved = json.loads((run_dir / "deepspeed_config.json").read_text())
        assert resolved["zero_optimization"]["stage"] == stage and "train_batch_size" not in resolved
        # Each rank's optimizer-state partition is in the checkpoint.
        shards = sorted(p.name for p in (middle / f"global_step{STEPS // 2}").glob("*optim_states.pt"))
        assert len(shards) == 2, shards
    # final/ holds the whole trained model, the same weights the last sharded checkpoint holds.
    final = load_file(run_dir / "final" / "model.safetensors")
    last = run_dir / "checkpoints" / f"step-{STEPS}"
    if engine != "ddp":  # sharded: the toolkit puts the shards back together
        # from the checkpoint alone: its config.json and tokenizer are saved beside the shards
        consolidate(last, tmp_path / "consolidated")
        last = tmp_path / "consolidated"
    consolidated = load_file(last / "model.safetensors")
    assert sorted(final) == sorted(consolidated)
    assert all(torch.equal(final[k], consolidated[k]) for k in final)

    # Resume from the middle checkpoint, as after a crash before final/: the same command again.
    # The two newer checkpoints hold a pickle that runs code when unpickled (their hash manifests
    # recomputed, so they look sealed): both are skipped, naming the file, and none of it runs.
    marker = tmp_path / "PWNED"
    for step, slot in PLANTED[name].items():
        target = run_dir / "checkpoints" / f"step-{step}" / slot
        assert target.is_file(), sorted(p.name for p in target.parent.iterdir())
        plant(target, marker)
        reseal(run_dir / "checkpoints" / f"step-{step}")
    (run_dir / "final").rename(tmp_path / "final-of-first-run")
    resumed = torchrun(config)
    assert not marker.exists(), "code from a checkpoint ran"
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for step, slot in PLANTED[name].items():
        said = f"step-{step}: " in resumed.stderr and Path(slot).name in resumed.stderr
        assert said, resumed.stderr[-4000:]
    assert "posix.system" in resumed.stderr and "weights_only=False" not in resumed.stderr
    assert f"resuming from {middle} (" in resumed.stderr
    # Steps 5..8 are trained again, once each, and continue the same curve.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    again = losses(run_dir)
    assert max(abs(again[s] - curve[s]) for s in again) < TOLERANCE, (again, curve)


@pytest.fixture(scope="module")
def zero2_stopped_by_a_nan(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[Any, Path, dict]:
    """A ZeRO-2 run on 2 processes, checkpointed at every step, whose rank 1 gets a NaN loss at
    step 4 (the launch's result, its output root, its config). One run serves three tests: the
    stop, the refusals to resume its step-2 checkpoint under another stage or engine, and the
    resume past planted pickles."""
    root = tmp_path_factory.mktemp("zero2")
    config = base_config(root, corpus, "nan", micro_batch=2, strategy="deepspeed", zero_stage=2)
    config["train"] = {**config["train"], "max_steps": 5, "save_every": 1}
    config["debug"] = {"faults": [{"kind": "nan", "step": 4, "rank": 1}]}
    return torchrun(write(root / "nan.yaml", config)), root, config


def test_a_zero_checkpoint_refuses_another_zero_stage_or_engine_and_says_how(
    tmp_path: Path, zero2_stopped_by_a_nan: tuple[Any, Path, dict]
) -> None:
    """Another world size resumes (tests/test_reshard_resume.py); another ZeRO stage or engine does
    not, and stops before any model is built with the two ways forward."""
    _, root, written = zero2_stopped_by_a_nan
    checkpoint = root / "nan" / "checkpoints" / "step-2"
    assert checkpoint.is_dir()
    config = {**written, "debug": {}, "run": {**written["run"], "output_dir": str(tmp_path)}}
    config["train"] = {**config["train"], "max_steps": 4, "resume": str(checkpoint)}
    for name, distributed, said in [
        ("zero3", {"strategy": "deepspeed", "zero_stage": 3}, "deepspeed ZeRO-3 on 1 process(es)"),
        ("fsdp", {"strategy": "fsdp"}, "this run is one process"),
    ]:
        config["run"] = {**config["run"], "name": name}
        config["distributed"] = distributed
        single = run_cli("train", str(write(tmp_path / f"{name}.yaml", config)))
        assert single.returncode == 2, single.stderr[-3000:]
        assert "was written by deepspeed ZeRO-2 on 2 process(es)" in single.stderr and said in single.stderr
        assert "distributed.zero_stage=2" in single.stderr and "lmforge ckpt consolidate" in single.stderr
        assert "model: llama" not in single.stderr  # stopped before any model was built


def test_deepspeed_stops_on_a_nan_step_at_its_last_good_checkpoint(
    zero2_stopped_by_a_nan: tuple[Any, Path, dict],
) -> None:
    """DeepSpeed applies the update inside backward: skip cannot drop it, so the run stops (exit 3)
    naming the newest complete checkpoint, and writes no checkpoint of the damaged state."""
    result, root, _ = zero2_stopped_by_a_nan
    assert result.returncode != 0
    assert "nonfinite=skip and spike=skip act as stop" in result.stderr
    assert "the last good state is checkpoints/step-3" in result.stderr
    events = [
        json.loads(line)
        for f in (root / "nan" / "events").glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert [(e["kind"], e["step"]) for e in events if e["kind"] in ("nonfinite", "stopped")] == [
        ("nonfinite", 4),
        ("stopped", 4),
    ]
    assert sorted(p.name for p in (root / "nan" / "checkpoints").glob("step-*")) == [
        "step-1",
        "step-2",
        "step-3",
    ]


def test_a_zero2_run_resumes_past_planted_pickles_and_never_runs_them(
    tmp_path: Path, zero2_stopped_by_a_nan: tuple[Any, Path, dict]
) -> None:
    """The stopped run's command again, without the fault: a pickle that runs code is planted in
    DeepSpeed's model states of step-3 and optimizer states of step-2 (manifests recomputed); both
    are skipped, naming the file, none of it runs, and the run resumes from step-1 to its end."""
    _, root, written = zero2_stopped_by_a_nan
    run_dir = tmp_path / "nan"
    shutil.copytree(root / "nan", run_dir)  # the other tests read the fixture's own checkpoints
    config = write(
        tmp_path / "nan.yaml",
        {**written, "debug": {}, "run": {**written["run"], "output_dir": str(tmp_path)}},
    )
    marker = tmp_path / "PWNED"
    slots = {
        3: "global_step3/mp_rank_00_model_states.pt",
        2: "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    }
    for step, slot in slots.items():
        target = run_dir / "checkpoints" / f"step-{step}" / slot
        assert target.is_file(), sorted(p.name for p in target.parent.iterdir())
        plant(target, marker)
        reseal(run_dir / "checkpoints" / f"step-{step}")
    resumed = torchrun(config)
    assert not marker.exists(), "code from a checkpoint ran"
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for step, slot in slots.items():
        said = f"step-{step}: " in resumed.stderr and Path(slot).name in resumed.stderr
        assert said, resumed.stderr[-4000:]
    assert "posix.system" in resumed.stderr and "weights_only=False" not in resumed.stderr
    assert f"resuming from {run_dir / 'checkpoints' / 'step-1'} (" in resumed.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # 2-5 replayed, once each


@pytest.mark.integration  # DeepSpeed JIT-compiles its CPU Adam on first use: ~2.5 minutes here
def test_zero3_with_optimizer_and_parameter_offload_matches_one_process(
    tmp_path: Path, corpus: Path, single_process_curve: dict[int, float]
) -> None:
    config = base_config(
        tmp_path,
        corpus,
        "offload",
        micro_batch=2,
        strategy="deepspeed",
        zero_stage=3,
        offload="optimizer+params",
    )
    result = torchrun(write(tmp_path / "offload.yaml", config))
    assert result.returncode == 0, result.stderr[-4000:]
    resolved = json.loads((tmp_path / "offload" / "deepspeed_config.json").read_text())
    assert resolved["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert resolved["optimizer"]["type"] == "AdamW"
    curve = losses(tmp_path / "offload")
    assert max(abs(curve[s] - single_process_curve[s]) for s in curve) < TOLERANCE, (
        curve,
        single_process_curve,
    )


@pytest.mark.integration  # heavy: `make test-integration` (CI stays near its time budget)
def test_a_users_deepspeed_json_runs_its_own_schedule_in_bf16_and_final_keeps_model_dtype(
    tmp_path: Path, corpus: Path
) -> None:
    """The tutorial's ZeRO-2 JSON (AdamW + WarmupLR, all "auto") under bf16: the start banner names
    the JSON's schedule, deepspeed_config.json holds the numbers the engine ran with, the lr rises
    and then stays flat (WarmupLR has no decay), and final/ is float32 (model.dtype) from the fp32
    master weights, as a single process of the same config would save it."""
    ds_json = tmp_path / "zero2.json"
    ds_json.write_text(
        json.dumps(
            {
                "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
                "zero_optimization": {"stage": 2},
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
            }
        )
    )  # fmt: skip
    config = base_config(tmp_path, corpus, "tutorial", micro_batch=2, deepspeed_config=str(ds_json))
    config["train"] = {**config["train"], "precision": "bf16", "warmup_steps": 4, "save_every": None}
    # fresh: which upstream notices a run raises depends on the modules it imports itself
    result = torchrun(write(tmp_path / "tutorial.yaml", config), fresh=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (
        "optimizer: DeepSpeed AdamW from your JSON (lr 0.003); lr schedule: DeepSpeed WarmupLR from your "
        "JSON, log warmup 0 -> 0.003 over 4 steps, then flat (no decay)" in result.stderr
    )
    run_dir = tmp_path / "tutorial"
    # Upstream deprecation notices are in train.log, once each, not on the console.
    assert "FutureWarning" not in result.stderr
    train_log = (run_dir / "train.log").read_text()
    assert train_log.count("FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated") == 1
    assert "upstream deprecation warning(s)" in result.stderr
    resolved = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert resolved["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 0.003,
        "warmup_num_steps": 4,
    }
    assert resolved["optimizer"]["params"]["lr"] == 0.003 and resolved["bf16"]["enabled"] is True
    assert "auto" not in json.dumps(resolved)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r and "loss" in r]
    assert len(lrs) == STEPS
    assert lrs[0] < lrs[1] < lrs[2] < 0.003 and lrs[-4:] == [0.003] * 4, lrs  # log warmup, no decay

    weights = load_file(run_dir / "final" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert json.loads((run_dir / "final" / "config.json").read_text())["dtype"] == "float32"
    # The fp32 masters, not the bf16 training copy widened: most values are not bf16 numbers.
    trained = weights["model.layers.0.mlp.down_proj.weight"]
    assert (trained.to(torch.bfloat16).float() != trained).float().mean() > 0.5
