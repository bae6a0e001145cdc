"""Checkpoint sealing: complete or absent; tampering and interrupted saves are never picked."""

from __future__ import annotations

from pathlib import Path

from lmforge.ckpt.atomic import (
    MANIFEST_NAME,
    MARKER_NAME,
    check_checkpoint,
    commit_checkpoint,
    find_latest_complete,
    rotate_checkpoints,
)


def fake_checkpoint(root: Path, step: int) -> Path:
    staging = root / ".staging" / f"checkpoint-{step}"
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(bytes(range(256)) * (step + 1))
    (staging / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return commit_checkpoint(staging, root / f"step-{step}", step=step)


def test_commit_moves_staging_and_seals(tmp_path: Path) -> None:
    final = fake_checkpoint(tmp_path, 4)
    assert final == tmp_path / "step-4"
    assert not (tmp_path / ".staging" / "checkpoint-4").exists()
    assert (final / MARKER_NAME).is_file() and (final / MANIFEST_NAME).is_file()
    assert check_checkpoint(final).complete


def test_latest_complete_skips_unmarked_and_corrupted(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 2)
    corrupted = fake_checkpoint(tmp_path, 4)
    unmarked = fake_checkpoint(tmp_path, 6)
    (unmarked / MARKER_NAME).unlink()
    data = bytearray((corrupted / "model.safetensors").read_bytes())
    data[10] ^= 0xFF
    (corrupted / "model.safetensors").write_bytes(bytes(data))
    (tmp_path / "checkpoint-9").mkdir()  # not a step-N name: never a checkpoint

    latest, rejected = find_latest_complete(tmp_path)
    assert latest is not None and latest.step == 2
    reasons = {r.step: r.problem for r in rejected}
    assert reasons == {
        6: "no completion marker (the save was interrupted)",
        4: "hash mismatch in model.safetensors",
    }


def test_missing_file_and_edited_manifest_are_detected(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path, 1)
    (ckpt / "trainer_state.json").unlink()
    assert check_checkpoint(ckpt).problem == "missing file trainer_state.json"
    other = fake_checkpoint(tmp_path, 3)
    (other / MANIFEST_NAME).write_text((other / MANIFEST_NAME).read_text().replace('"step": 3', '"step": 30'))
    assert check_checkpoint(other).problem == "hash manifest was modified after sealing"


def test_rotation_keeps_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    removed = rotate_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-1", "step-2"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-3", "step-4"]


def test_recommit_same_step_replaces_old_copy(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 5)
    again = tmp_path / ".staging" / "checkpoint-5"
    again.mkdir(parents=True)
    (again / "model.safetensors").write_bytes(b"new")
    commit_checkpoint(again, tmp_path / "step-5", step=5)
    assert (tmp_path / "step-5" / "model.safetensors").read_bytes() == b"new"
    assert check_checkpoint(tmp_path / "step-5").complete
