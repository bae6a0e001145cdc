"""Weight and gradient histograms (monitor.histograms) and per-group learning rates: a tiny run
draws TensorBoard histograms at the configured steps, read back with TensorBoard's own event
reader, each of at most max_elements values; histograms.jsonl feeds the report's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.monitor.metrics import drop_records_after
from lmforge.report.observability_sections import histograms_section, read_histogram_summary
from lmforge.train.histograms import _fixed_indices
from tests.test_guardrails import config, metrics_of, train


def test_histograms_at_every_nth_step_bounded_and_lr_per_group(tmp_path: Path, corpus: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base = config(tmp_path, corpus, max_steps=4, log_every=2)
    base["monitor"]["loggers"] = ["tensorboard"]
    base["monitor"]["histograms"] = {"every": 2, "max_elements": 1024}
    run_dir = train(base).run_dir

    board = EventAccumulator(str(run_dir / "tb"), size_guidance={"histograms": 0})
    board.Reload()
    tags = set(board.Tags()["histograms"])
    embed = "model.embed_tokens.weight"  # 300 x 64 values: sampled
    norm = "model.norm.weight"  # 64 values: whole
    for tag in (f"weights/{embed}", f"grads/{embed}", f"weights/{norm}", f"grads/{norm}"):
        assert tag in tags, sorted(tags)
        assert [event.step for event in board.Histograms(tag)] == [2, 4]
    sampled = [event.histogram_value.num for event in board.Histograms(f"weights/{embed}")]
    assert all(900 < n <= 1024 for n in sampled), sampled  # drawn with replacement, repeats dropped
    assert [event.histogram_value.num for event in board.Histograms(f"grads/{norm}")] == [64, 64]
    # The same elements each time: a weight histogram moves only as far as training moved them.
    first, last = board.Histograms(f"weights/{embed}")
    assert first.histogram_value.num == last.histogram_value.num

    summary = read_histogram_summary(run_dir / "histograms.jsonl")
    assert [r["step"] for r in summary] == [2, 4]
    mean, std, abs_max = summary[-1]["weights"][embed]
    assert std > 0 and abs_max >= abs(mean) and summary[-1]["grads"][norm][1] > 0
    assert summary[0]["weights"][embed] != summary[-1]["weights"][embed]  # lr 3e-3 moved them

    # HF's AdamW puts the weights with and without decay in two groups: both rates are recorded.
    record = metrics_of(run_dir)[-1]
    assert {"lr_group_0", "lr_group_1"} <= record.keys()
    assert record["lr_group_0"] == pytest.approx(record["lr"])

    section = histograms_section(run_dir)
    assert "Histograms summary" in section and embed in section and "2 to 4" in section


def test_fixed_indices_are_the_same_for_a_name_and_bounded() -> None:
    first = _fixed_indices("layer.weight", 10**9, 4096)
    assert first is not None and first.dtype == torch.int32
    assert torch.equal(first, _fixed_indices("layer.weight", 10**9, 4096))  # type: ignore[arg-type]
    assert 4000 < first.numel() <= 4096 and int(first.max()) < 10**9
    assert not torch.equal(first[:100], _fixed_indices("other.weight", 10**9, 4096)[:100])  # type: ignore[index]
    assert _fixed_indices("small", 4096, 4096) is None  # small enough to take whole


def test_a_resume_drops_the_summary_lines_it_replays(tmp_path: Path) -> None:
    path = tmp_path / "histograms.jsonl"
    path.write_text("".join(json.dumps({"step": s, "weights": {}}) + "\n" for s in (2, 4, 6)) + '{"ste')
    drop_records_after(path, 4)
    assert [r["step"] for r in read_histogram_summary(path)] == [2, 4]
    assert path.read_text().endswith("}\n")


def test_histograms_section_lists_the_largest_changes_and_is_empty_without_a_summary(
    tmp_path: Path,
) -> None:
    assert histograms_section(tmp_path) == ""
    lines = [
        {"step": 10, "weights": {"a.weight": [0, 1.0, 3.0], "b.weight": [0, 1.0, 3.0]}, "grads": {}},
        {
            "step": 20,
            "weights": {"a.weight": [0, 1.01, 3.0], "b.weight": [0, 2.0, 9.0]},
            "grads": {"b.weight": [0, "nan", "nan"]},
        },
    ]
    (tmp_path / "histograms.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    section = histograms_section(tmp_path)
    assert section.index("b.weight") < section.index("a.weight")  # the bigger change first
    assert "nan" in section and "10 to 20" in section
