"""Guardrails through their drills (debug.faults) on a tiny model, plus the decision rules alone."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import TrainerCallback

from lmforge.ckpt.atomic import check_checkpoint
from lmforge.config import load_config
from lmforge.config.schema import GuardConfig
from lmforge.errors import GUARD_STOP_EXIT, TrainingStopped
from lmforge.monitor.events import read_events
from lmforge.monitor.guard import Guardrails
from lmforge.monitor.metrics import read_metrics
from lmforge.train.runner import run_training
from tests.conftest import SMALL_ARCH, run_cli


def config(
    tmp_path: Path,
    corpus: Path,
    *,
    name: str = "run",
    guard: dict | None = None,
    faults: list | None = None,
    **train: Any,
) -> dict:
    return {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 64, "cache_dir": str(tmp_path / "cache")},
        "train": {
            "max_steps": 10,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "precision": "fp32",
            "log_every": 1,
            "warmup_steps": 0,
            **train,
        },
        "monitor": {"loggers": [], "guard": {"spike_warmup": 4, "spike_window": 8, **(guard or {})}},
        "debug": {"faults": faults or []},
    }


def train(base: dict, callbacks: list[TrainerCallback] | None = None) -> Any:
    return run_training(load_config(None, base=base), extra_callbacks=callbacks)


def events_of(run_dir: Path) -> list[dict]:
    return read_events(run_dir / "events")


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class StepProbe(TrainerCallback):
    """Copies parameters and AdamW moments right before and right after optimizer step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def _copy(self, model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
        copied = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
        for i, state in enumerate(optimizer.state.values()):
            for key in ("exp_avg", "exp_avg_sq"):
                copied[f"{key}:{i}"] = state[key].clone()
        return copied

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.step - 1:
            self.before = self._copy(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            self.after = self._copy(model, optimizer)


# -- decisions alone ------------------------------------------------------------------------


def test_no_false_spike_on_a_clean_noisy_falling_curve() -> None:
    guard = Guardrails(GuardConfig())  # defaults: 6 sigma, 100-step window, 50-step warm-up
    rng = random.Random(0)
    for step in range(1, 3001):
        loss = 2.0 + 8.0 * math.exp(-step / 300) + rng.gauss(0, 0.05)
        assert guard.judge(step, loss, 1.0).action == "apply", step
    assert guard.spike_count == 0


def test_spike_nonfinite_and_repeated_failure_decisions() -> None:
    guard = Guardrails(GuardConfig(spike_warmup=5, spike_window=10, max_bad_steps=3, nonfinite="skip"))
    for step in range(1, 11):
        assert guard.judge(step, 3.0 + 0.01 * (step % 3), 1.0).action == "apply"
    spike = guard.judge(11, 30.0, 1.0)
    assert (spike.action, spike.kind) == ("skip", "spike") and "sigma above" in spike.message
    assert guard.judge(12, math.nan, 1.0).kind == "nonfinite"
    third = guard.judge(13, 3.0, math.inf)  # a finite loss with an inf gradient
    assert third.kind == "nonfinite" and third.action == "stop" and "3 bad steps in a row" in third.message
    assert guard.judge(14, 3.0, 1.0).action == "apply"  # a healthy step resets the count
    assert guard.counters() == {"nonfinite_count": 2, "spike_count": 1, "skipped_steps": 0, "rollbacks": 0}


def test_guard_state_round_trips(tmp_path: Path) -> None:
    guard = Guardrails(GuardConfig())
    for step in range(1, 20):
        guard.judge(step, 1.0 + step / 100, 1.0)
    guard.judge(20, math.nan, 1.0)
    guard.save(tmp_path)
    again = Guardrails(GuardConfig())
    assert again.load(tmp_path)
    assert again.state_dict() == guard.state_dict()


def test_nan_step_is_skipped_parameters_and_optimizer_state_unchanged(tmp_path: Path, corpus: Path) -> None:
    probe = StepProbe(5)
    outcome = train(config(tmp_path, corpus, faults=[{"kind": "nan", "step": 5}]), [probe])
    assert outcome.steps == 10
    assert probe.before and probe.after
    for key, before in probe.before.items():
        assert torch.equal(before, probe.after[key]), key
    events = events_of(outcome.run_dir)
    bad = [e for e in events if e["kind"] == "nonfinite"]
    assert len(bad) == 1 and bad[0]["step"] == 5 and bad[0]["action"] == "skip"
    assert events[-1]["kind"] == "finished"
    records = {r["step"]: r for r in metrics_of(outcome.run_dir)}
    assert records[5]["loss"] == "nan"  # logged as it was, never hidden
    assert records[5]["skipped_steps"] == 1 and records[10]["nonfinite_count"] == 1
    assert math.isfinite(records[10]["loss"])


def test_rollback_restores_the_checkpoint_and_skips_the_batches(tmp_path: Path, corpus: Path) -> None:
    faults = [{"kind": "nan", "step": 7}]
    # With eval data: the replay must not evaluate step-4 a second time.
    skip_cfg = config(tmp_path, corpus, name="skip", faults=faults, eval_every=5)
    rollback_cfg = config(
        tmp_path,
        corpus,
        name="rollback",
        faults=faults,
        guard={"nonfinite": "rollback"},
        save_every=4,
        eval_every=5,
    )
    for cfg in (skip_cfg, rollback_cfg):
        cfg["data"]["eval_fraction"] = 0.05
    skipped = train(skip_cfg)
    rolled = train(rollback_cfg)
    kinds = [(e["kind"], e["step"]) for e in events_of(rolled.run_dir)]
    assert ("nonfinite", 7) in kinds and ("rollback", 7) in kinds and kinds[-1][0] == "finished"
    rollback = next(e for e in events_of(rolled.run_dir) if e["kind"] == "rollback")
    assert rollback["checkpoint"].endswith("step-4")
    records = metrics_of(rolled.run_dir)
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) == list(range(0, 11))  # replayed steps logged once (0: eval on start)
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 5, 10]
    # Steps 5-6 replay the same batches from step-4 and step 7's batch is skipped: the result is
    # the run that skipped step 7 in place, bit for bit.
    a = load_file(skipped.final_dir / "model.safetensors")
    b = load_file(rolled.final_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


class DropFlags(TrainerCallback):
    """The device flag each optimizer step ran with (torch's fused AdamW `found_inf`)."""

    def __init__(self) -> None:
        self.flags: dict[int, float] = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):  # type: ignore[no-untyped-def]
        found_inf = getattr(getattr(optimizer, "optimizer", optimizer), "found_inf", None)
        if found_inf is not None:
            self.flags[state.global_step + 1] = float(found_inf)


def test_steps_judged_on_the_device_train_bit_for_bit_like_steps_judged_on_the_host(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unlogged steps (log_every beyond the run): the verdict is the device's and the host reads it
    a step later. A NaN at step 6 rolls back to step-4 (acted on at step 7) and a spike at step 10
    is skipped: the same weights, events and counts as when the host judges before each update."""

    def run(name: str) -> Any:
        return train(
            config(
                tmp_path,
                corpus,
                name=name,
                max_steps=12,
                log_every=1000,
                save_every=4,
                guard={"nonfinite": "rollback"},
                faults=[{"kind": "nan", "step": 6}, {"kind": "spike", "step": 10, "factor": 50}],
            ),
            [flags],
        )

    flags = DropFlags()
    device = run("device")
    assert {step for step, flag in flags.flags.items() if flag} == {6, 10}  # dropped by the device flag
    assert set(flags.flags) == set(range(1, 13))
    monkeypatch.setattr("lmforge.train.step._device_skipper", lambda optimizer: None)
    flags = DropFlags()
    host = run("host")
    assert not flags.flags
    for outcome in (device, host):
        kinds = [(e["kind"], e["step"], e.get("action")) for e in events_of(outcome.run_dir)]
        assert [k for k in kinds if k[0] in ("nonfinite", "rollback", "spike", "skip")] == [
            ("nonfinite", 6, "rollback"),
            ("rollback", 6, None),
            ("skip", 6, "skip"),  # the replayed bad step's batch
            ("spike", 10, "skip"),
        ], kinds
    a, b = (load_file(outcome.final_dir / "model.safetensors") for outcome in (device, host))
    assert all(torch.equal(a[k], b[k]) for k in a)
    last = [metrics_of(outcome.run_dir)[-1] for outcome in (device, host)]
    for key in ("loss", "tokens_seen", "skipped_steps", "rollbacks", "spike_count", "nonfinite_count"):
        assert last[0][key] == last[1][key], key


def test_repeated_bad_steps_stop_with_a_checkpoint_and_exit_code_3(tmp_path: Path, corpus: Path) -> None:
    base = config(
        tmp_path,
        corpus,
        guard={"max_bad_steps": 2},
        faults=[{"kind": "nan", "step": 4}, {"kind": "nan", "step": 5}],
    )
    path = tmp_path / "stop.yaml"
    path.write_text(yaml.safe_dump(base))
    result = run_cli("train", str(path))
    assert result.returncode == GUARD_STOP_EXIT == 3, result.stderr[-2000:]
    assert "stopped by the guardrails" in result.stderr and "2 bad steps in a row" in result.stderr
    run_dir = tmp_path / "runs" / "run"
    assert check_checkpoint(run_dir / "checkpoints" / "step-5").complete
    assert not (run_dir / "final").exists()
    assert events_of(run_dir)[-1]["kind"] == "stopped"
    # The checkpoint holds the last good state: step 4's and 5's updates were never applied.
    resumed = load_file(run_dir / "checkpoints" / "step-5" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in resumed.values())


def test_loss_spike_is_caught_and_skipped(tmp_path: Path, corpus: Path) -> None:
    outcome = train(
        config(tmp_path, corpus, max_steps=12, faults=[{"kind": "spike", "step": 10, "factor": 50}])
    )
    spikes = [e for e in events_of(outcome.run_dir) if e["kind"] == "spike"]
    assert [(e["step"], e["action"]) for e in spikes] == [(10, "skip")]


def test_out_of_memory_halves_the_micro_batch_and_goes_on(tmp_path: Path, corpus: Path) -> None:
    clean = train(config(tmp_path, corpus, name="clean"))
    backed = train(config(tmp_path, corpus, name="oom", faults=[{"kind": "oom", "step": 3}]))
    events = [e for e in events_of(backed.run_dir) if e["kind"] == "oom_backoff"]
    assert len(events) == 1 and "runs as 2 chunks" in events[0]["message"]
    records = metrics_of(backed.run_dir)
    assert records[-1]["oom_splits"] == 2 and backed.steps == 10
    # Same global batch, same token-normalised loss: the same training up to summation order.
    a = load_file(clean.final_dir / "model.safetensors")
    b = load_file(backed.final_dir / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)


def test_stall_dumps_every_thread_stack_and_emits_an_event(tmp_path: Path, corpus: Path) -> None:
    outcome = train(
        config(
            tmp_path,
            corpus,
            max_steps=4,
            guard={"stall_seconds": 1.0},
            faults=[{"kind": "hang", "step": 3, "seconds": 3.0}],
        )
    )
    stalls = [e for e in events_of(outcome.run_dir) if e["kind"] == "stall"]
    assert len(stalls) == 1 and stalls[0]["step"] == 3  # the step that hung
    stacks = Path(stalls[0]["stacks"]).read_text()
    assert "training_step" in stacks and "lmforge-stall-watchdog" not in stacks.splitlines()[0]
    assert stacks.count("Thread 0x") >= 2  # every thread, the watchdog's own included


def test_slow_data_shows_in_data_wait_share_and_a_data_bound_event(tmp_path: Path, corpus: Path) -> None:
    outcome = train(
        config(tmp_path, corpus, max_steps=4, faults=[{"kind": "slow_data", "step": 3, "seconds": 2.0}])
    )
    records = {r["step"]: r for r in metrics_of(outcome.run_dir)}
    assert records[3]["data_wait_share"] > 0.5 > records[2]["data_wait_share"]
    assert [e["step"] for e in events_of(outcome.run_dir) if e["kind"] == "data_bound"] == [3]


def test_metrics_records_carry_the_monitoring_fields(tmp_path: Path, corpus: Path) -> None:
    outcome = train(config(tmp_path, corpus, max_steps=3, max_grad_norm=1e-3))
    record = metrics_of(outcome.run_dir)[-1]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "grad_clipped",
        "tokens_per_s",
        "samples_per_s",
        "step_time_s",
        "data_wait_share",
        "mfu",
        "rss_gb",
        "update_ratio",
        "nonfinite_count",
        "skipped_steps",
    ):
        assert key in record, key
    assert record["grad_clipped"] is True  # max_grad_norm 1e-3 clips every step
    assert 0 < record["update_ratio"] < 1 and 0 < record["mfu"] < 1
    assert record["samples_per_s"] > 0 and record["rss_gb"] > 0.1


def test_sigterm_checkpoints_at_the_step_boundary_and_exits_0(tmp_path: Path, corpus: Path) -> None:
    base = config(tmp_path, corpus, max_steps=50, faults=[{"kind": "hang", "step": 3, "seconds": 2.0}])
    path = tmp_path / "sig.yaml"
    path.write_text(yaml.safe_dump(base))
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli.main", "train", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    run_dir = tmp_path / "runs" / "run"
    deadline = time.time() + 120
    # The run appends to metrics.jsonl as this loop reads it: read it as lmforge's own readers do,
    # skipping a line caught mid-write (a strict parse failed one CI run on a torn step-31 line).
    while time.time() < deadline and len(read_metrics(run_dir / "metrics.jsonl")) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # most likely while step 3 hangs
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped" in out and "SIGTERM" in out
    last = events_of(run_dir)[-1]
    assert last["kind"] == "signal" and 2 <= last["step"] < 50
    assert check_checkpoint(run_dir / "checkpoints" / f"step-{last['step']}").complete  # at the step boundary
    assert not (run_dir / "final").exists()
    # The same command resumes from that checkpoint and finishes.
    result = run_cli("train", str(path), "debug.faults=[]")
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [r["step"] for r in metrics_of(run_dir)]
    assert steps == list(range(1, 51))


def test_stop_without_a_checkpoint_to_roll_back_to_is_explained(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(TrainingStopped, match="no complete checkpoint exists yet; set train.save_every"):
        train(config(tmp_path, corpus, guard={"nonfinite": "rollback"}, faults=[{"kind": "nan", "step": 2}]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_two_ranks_take_the_same_decision_and_report_rank_statistics(tmp_path: Path, corpus: Path) -> None:
    """DDP on 2 gloo processes: a NaN on rank 1 alone is skipped on both ranks, once."""
    base = config(tmp_path, corpus, max_steps=6, faults=[{"kind": "nan", "step": 4, "rank": 1}])
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(base))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "lmforge.cli.main",
            "train",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "run"
    events = events_of(run_dir)
    assert [(e["kind"], e["step"]) for e in events if e["kind"] == "nonfinite"] == [("nonfinite", 4)]
    records = {r["step"]: r for r in metrics_of(run_dir)}
    assert records[4]["loss_rank_max"] == "nan" and records[4]["skipped_steps"] == 1  # one rank's NaN shows
    assert (
        math.isfinite(records[3]["loss_rank_mean"])
        and records[3]["loss_rank_max"] >= records[3]["loss_rank_mean"]
    )
    assert records[6]["straggler"] >= 1.0 and records[6]["slowest_rank"] in (0, 1)


def test_spike_check_arms_within_a_short_run() -> None:
    """A 30-step run with the default 50-step warm-up would never judge a spike: the warm-up is at
    most a fifth of the run, so a loss x50 at step 20 is caught."""
    never = Guardrails(GuardConfig())
    short = Guardrails(GuardConfig(), total_steps=30)
    assert (never.spike_warmup, short.spike_warmup) == (50, 6)
    for step in range(1, 20):
        for guard in (never, short):
            assert guard.judge(step, 2.0 - 0.01 * step, 1.0).action == "apply"
    assert never.judge(20, 100.0, 1.0).action == "apply"
    spike = short.judge(20, 100.0, 1.0)
    assert (spike.action, spike.kind) == ("skip", "spike")
