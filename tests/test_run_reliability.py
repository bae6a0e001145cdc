"""The run directory under an unlucky or hostile user (reliability issue, items 2-8).

Each test reproduces one failure that was seen (a run.name that escapes, a finished run trained
past its end, a secret override written in clear, two processes on one run, a crash before the
first checkpoint, a full disk during a save, a sealed checkpoint that cannot load) through the
real CLI on a tiny model, and asserts what the user sees and what is left on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from lmforge.ckpt.atomic import MARKER_NAME, remove_within
from lmforge.config import load_config
from lmforge.errors import UserInputError
from lmforge.train.run_lock import RunLock
from tests.conftest import SMALL_ARCH, reseal, run_cli

pytestmark = pytest.mark.slow


def config_for(tmp_path: Path, corpus: Path, **train: object) -> Path:
    config = {
        "run": {"name": "base", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 64},
        "train": {
            "max_steps": 6,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "schedule": "constant",  # every extra step would change every weight
            "precision": "fp32",
            "save_every": 2,
            "keep_last": 5,
            **train,
        },
        "monitor": {"loggers": [], "system_metrics_seconds": None},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def same_weights(a: Path, b: Path) -> bool:
    left, right = weights(a), weights(b)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def steps_of(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def events_of(run_dir: Path) -> list[dict]:
    path = run_dir / "events" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    tmp_path = tmp_path_factory.mktemp("reference")
    result = run_cli("train", str(config_for(tmp_path, corpus)))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "runs" / "base"


@pytest.fixture(scope="module")
def crashed_at_6(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """The run directory of the reference's config killed (SIGKILL) right after step 6's checkpoint,
    before final/. One crash serves the tests that resume it: each takes a copy (`copy_of`)."""
    tmp_path = tmp_path_factory.mktemp("crashed")
    crashed = run_cli("train", str(config_for(tmp_path, corpus)), "debug.crash_at_step=6")
    assert crashed.returncode < 0, crashed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "base"
    assert not (run_dir / "final").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-2", "step-4", "step-6"]
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path, corpus: Path) -> Path:
    """A module fixture's run directory copied to tmp_path/runs/base, for a test to change; returns
    the config of the command that wrote it, writing there."""
    shutil.copytree(run_dir, tmp_path / "runs" / "base", symlinks=True)
    return config_for(tmp_path, corpus)


# -- 2. run.name cannot escape, deletes stay inside ------------------------------------------


def test_run_name_that_escapes_is_refused_and_nothing_outside_is_touched(
    tmp_path: Path, corpus: Path
) -> None:
    victim = tmp_path / "victim"
    (victim / "src").mkdir(parents=True)
    (victim / "src" / "keep.py").write_text("print('mine')\n")
    (victim / "metrics.jsonl").write_text('{"step": 1}\n')  # looks like a run, to tempt overwrite
    config = config_for(tmp_path, corpus)
    result = run_cli("train", str(config), "run.name=../victim", "run.overwrite=true")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "run.name" in result.stderr and "not a plain name" in result.stderr
    for name in (str(victim), "a/../../victim"):  # the same check, without a process each
        with pytest.raises(UserInputError, match="not a plain name"):
            load_config(config, [f"run.name={name}", "run.overwrite=true"])
    assert (victim / "src" / "keep.py").read_text() == "print('mine')\n"
    assert (victim / "metrics.jsonl").exists()


def test_deletes_refuse_paths_outside_their_root_and_never_follow_links(tmp_path: Path) -> None:
    root, outside = tmp_path / "run", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "data.txt").write_text("precious")
    with pytest.raises(RuntimeError, match="not inside"):
        remove_within(outside, root)
    with pytest.raises(RuntimeError, match="not inside"):
        remove_within(root / ".." / "outside", root)
    (root / "checkpoints").symlink_to(outside, target_is_directory=True)
    remove_within(root / "checkpoints", root)  # the link goes, not what it points to
    assert not (root / "checkpoints").exists() and (outside / "data.txt").read_text() == "precious"


def test_overwrite_removes_only_what_lmforge_wrote(tmp_path: Path, corpus: Path, reference: Path) -> None:
    config = config_for(tmp_path, corpus)
    assert run_cli("train", str(config), "train.max_steps=2").returncode == 0
    notes = tmp_path / "runs" / "base" / "my_notes.txt"
    notes.write_text("not lmforge's")
    result = run_cli("train", str(config), "run.overwrite=true")  # works the first time
    assert result.returncode == 0, result.stderr[-3000:]
    assert notes.read_text() == "not lmforge's"
    assert steps_of(tmp_path / "runs" / "base") == list(range(1, 7))
    assert same_weights(tmp_path / "runs" / "base", reference)


# -- 3. a finished run is finished -------------------------------------------------------------


def test_rerunning_a_finished_run_trains_nothing_and_keeps_final(reference: Path, corpus: Path) -> None:
    config = reference.parent.parent / "cfg.yaml"
    before = {p.name: p.read_bytes() for p in (reference / "final").iterdir() if p.is_file()}
    metrics = (reference / "metrics.jsonl").read_text()
    for _ in range(2):
        result = run_cli("train", str(config))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "already finished at step 6" in result.stdout
    after = {p.name: p.read_bytes() for p in (reference / "final").iterdir() if p.is_file()}
    assert after == before and (reference / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    assert not (reference / "checkpoints" / ".staging").exists()  # no empty leftover either
    shorter = run_cli("train", str(config), "train.max_steps=4")
    assert shorter.returncode == 2 and "finished at step 6" in shorter.stderr


def test_crash_after_the_last_checkpoint_completes_final_without_another_step(
    tmp_path: Path, corpus: Path, reference: Path, crashed_at_6: Path
) -> None:
    config = copy_of(crashed_at_6, tmp_path, corpus)  # SIGKILL right after step 6's checkpoint
    run_dir = tmp_path / "runs" / "base"
    assert not (run_dir / "final").exists()
    result = run_cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final/ is written from its checkpoint" in result.stderr
    assert steps_of(run_dir) == list(range(1, 7)) and same_weights(run_dir, reference)


def test_extending_a_finished_run_is_explicit_and_recorded(
    tmp_path: Path, corpus: Path, reference: Path
) -> None:
    config = copy_of(reference, tmp_path, corpus)  # a run finished at step 6
    result = run_cli("train", str(config), "train.max_steps=8")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "base"
    assert steps_of(run_dir) == list(range(1, 9))
    extended = [e for e in events_of(run_dir) if e["kind"] == "extended"]
    assert len(extended) == 1 and "from step 6 to step 8" in extended[0]["message"]
    assert json.loads((run_dir / "final" / "lmforge_finished.json").read_text())["step"] == 8


# -- 4. secrets given as overrides -------------------------------------------------------------

SECRET = "hooks-token-5e1f9c0ffee"


def test_a_secret_override_is_written_nowhere(tmp_path: Path, corpus: Path) -> None:
    config = config_for(tmp_path, corpus, max_steps=2)
    override = f"monitor.alerts.webhook_url=http://127.0.0.1:9/{SECRET}"
    result = run_cli("train", str(config), override)
    assert result.returncode == 0, result.stderr[-3000:]
    dry = run_cli("launch", str(config), override, "--nproc-per-node", "2", "--dry-run")
    slurm = run_cli("launch", str(config), override, "--slurm", "--dry-run")
    assert dry.returncode == 0 and slurm.returncode == 0, dry.stderr + slurm.stderr
    assert "webhook_url=***REDACTED***" in dry.stdout
    for output in (result, dry, slurm):
        assert SECRET not in output.stdout + output.stderr
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == [tmp_path / "cfg.yaml"] or leaked == [], leaked  # only where the user put it


# -- 5. one process per run directory ----------------------------------------------------------


def test_a_second_process_on_a_running_run_exits_2_naming_the_holder(
    tmp_path: Path, corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # DataLoader workers: forked children of the run, which must not keep its lock after a kill
    config = config_for(tmp_path, corpus, max_steps=3, dataloader_workers=2)
    hang = "debug.faults=[{kind: hang, step: 2, seconds: 60}]"
    log = tmp_path / "first.log"
    with open(log, "w") as stderr:
        first = subprocess.Popen(
            [sys.executable, "-m", "lmforge.cli.main", "train", str(config), hang],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    run_dir = tmp_path / "runs" / "base"
    try:
        deadline = time.time() + 120
        while "hanging step 2" not in log.read_text() and time.time() < deadline:
            time.sleep(0.5)
        assert first.poll() is None, "the first run should still be hanging at step 2"
        config_before = (run_dir / "config.yaml").read_text()
        second = run_cli("train", str(config))
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"in use by pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
        assert (run_dir / "config.yaml").read_text() == config_before
    finally:
        first.kill()
        first.wait()
    # Restarted at once (a supervisor's loop, a requeue): the dead run's DataLoader workers, alive
    # for a few more seconds, do not hold the run; the holder died without releasing, so the next
    # one takes the lock over and says so.
    with caplog.at_level("WARNING", logger="lmforge.train.run_lock"), RunLock(run_dir):
        pass
    assert f"took over the lock of pid {first.pid}" in caplog.text
    result = run_cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]


# -- 6. a crash before the first checkpoint ----------------------------------------------------


def test_a_crash_before_the_first_checkpoint_restarts_with_the_same_command(
    tmp_path: Path, corpus: Path, reference: Path
) -> None:
    config = config_for(tmp_path, corpus)
    crashed = run_cli("train", str(config), "debug.crash_at_step=1")
    assert crashed.returncode < 0
    run_dir = tmp_path / "runs" / "base"
    result = run_cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ended before its first checkpoint" in result.stderr
    kept = list((run_dir / "previous").iterdir())
    assert len(kept) == 1 and (kept[0] / "config.yaml").exists()  # the old records, kept aside
    assert steps_of(run_dir) == list(range(1, 7)) and same_weights(run_dir, reference)


# -- 7. the disk fills up during a save --------------------------------------------------------


def test_disk_full_during_a_save_then_the_same_command_resumes(
    tmp_path: Path, corpus: Path, reference: Path
) -> None:
    config = config_for(tmp_path, corpus)
    full = run_cli("train", str(config), "debug.faults=[{kind: disk_full, step: 4}]")
    assert full.returncode == 1, full.stderr[-3000:]
    assert "the disk is full" in full.stderr and "step-4/lmforge_manifest.json" not in full.stderr
    assert "checkpoint-4" in full.stderr and "Traceback" not in full.stderr
    run_dir = tmp_path / "runs" / "base"
    assert not (run_dir / "checkpoints" / ".staging").exists()  # the partial save is gone
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]
    assert [e["kind"] for e in events_of(run_dir)][-1] == "failed"
    # A real write refused by the filesystem: torch.save raises a RuntimeError that names no file
    # ("unexpected pos ..."). A file-size limit stands in for the full disk (optimizer.pt > 500 kB).
    limited = subprocess.run(
        [sys.executable, "-m", "lmforge.cli.main", "train", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_limit_file_size,
    )
    assert limited.returncode == 1, limited.stderr[-3000:]
    assert "Traceback" not in limited.stderr and "the disk is most likely full" in limited.stderr
    assert f"writing {run_dir / 'checkpoints' / '.staging' / 'checkpoint-4'} failed" in limited.stderr
    assert "MiB free on" in limited.stderr
    log = (run_dir / "train.log").read_text()
    assert "Traceback" in log and "torch.save" in log  # the full traceback, for a bug report
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]
    result = run_cli("train", str(config))  # space freed
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps_of(run_dir) == list(range(1, 7)) and same_weights(run_dir, reference)


def _limit_file_size() -> None:
    """In the child: writes past 500 kB fail with EFBIG (SIGXFSZ ignored, so the process lives)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000))


def test_an_output_directory_that_cannot_be_created_exits_2(tmp_path: Path, corpus: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_cli("train", str(config_for(tmp_path, corpus)), f"run.output_dir={blocker}")
    assert result.returncode == 2 and "cannot write the run directory" in result.stderr
    assert "run.output_dir" in result.stderr and "Traceback" not in result.stderr


# -- 8. a sealed checkpoint that cannot load ---------------------------------------------------


def test_self_consistent_garbage_checkpoints_are_skipped_for_the_previous_one(
    tmp_path: Path, corpus: Path, reference: Path, crashed_at_6: Path
) -> None:
    config = copy_of(crashed_at_6, tmp_path, corpus)
    checkpoints = tmp_path / "runs" / "base" / "checkpoints"
    (checkpoints / "step-6" / "model.safetensors").write_bytes(os.urandom(4096))
    reseal(checkpoints / "step-6")
    for entry in (checkpoints / "step-4").iterdir():  # a manifest that lists no files
        if entry.name not in (MARKER_NAME, "lmforge_manifest.json"):
            remove_within(entry, checkpoints)
    reseal(checkpoints / "step-4")
    result = run_cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step-6: model.safetensors is not a readable safetensors file" in result.stderr
    assert "step-4: missing trainer_state.json" in result.stderr
    assert "resuming from" in result.stderr and "step-2" in result.stderr
    assert same_weights(tmp_path / "runs" / "base", reference)


# -- issue 33, item 2: non-finite weights are never resumed, nor sealed as final/ -----------------


def nan_weights(checkpoint: Path) -> None:
    """Every floating weight of the checkpoint NaN, the manifest made consistent again."""
    path = checkpoint / "model.safetensors"
    tensors = {k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in load_file(path).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    reseal(checkpoint)


def test_nan_checkpoints_are_never_resumed_and_sigterm_after_done_exits_0(
    tmp_path: Path, corpus: Path, reference: Path, crashed_at_6: Path
) -> None:
    config = copy_of(crashed_at_6, tmp_path, corpus)
    run_dir = tmp_path / "runs" / "base"
    checkpoints = run_dir / "checkpoints"
    good = (checkpoints / "step-4" / "model.safetensors").read_bytes()
    for step in (2, 4, 6):
        nan_weights(checkpoints / f"step-{step}")
    refused = run_cli("train", str(config))  # every checkpoint NaN: refused, nothing moved or trained
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"no checkpoint in {checkpoints} can be resumed" in refused.stderr
    for step in (2, 4, 6):
        assert f"step-{step}: model.safetensors: 20 of 20 weight tensors hold NaN or inf" in refused.stderr
    assert "run.overwrite=true" in refused.stderr and "Traceback" not in refused.stderr
    assert not (run_dir / "previous").exists() and not (run_dir / "final").exists()

    (checkpoints / "step-4" / "model.safetensors").write_bytes(good)
    reseal(checkpoints / "step-4")
    # Newest NaN: resumes from step-4. SIGTERM right after "done": the run is complete, exit 0.
    run = subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli.main", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert run.stdout is not None
    for line in run.stdout:
        if line.startswith("done"):
            run.send_signal(signal.SIGTERM)
            break
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    assert "not resuming from" in stderr and "step-6: model.safetensors: 20 of 20" in stderr
    assert "resuming from" in stderr and "step-4" in stderr
    assert steps_of(run_dir) == list(range(1, 7)) and same_weights(run_dir, reference)


def test_a_diverged_run_exits_1_without_a_final(tmp_path: Path, corpus: Path) -> None:
    config = config_for(tmp_path, corpus, max_steps=2, lr=1e39)  # one Adam step overflows every weight
    result = run_cli("train", str(config), "monitor.enabled=false")  # no guardrail skips the steps
    assert result.returncode == 1, result.stderr[-3000:]
    assert "final/ was not written: the trained weights hold NaN or inf" in result.stderr
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "runs" / "base"
    assert not (run_dir / "final").exists() and not (run_dir / "final.partial").exists()
