"""monitor.profile: a window of steps under torch.profiler writes a Chrome/Perfetto trace with the
aten ops, the same trace where TensorBoard's profiler plugin finds it, and a top-ops table that
the report shows; a window past train.max_steps is refused when the config loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.errors import UserInputError
from lmforge.monitor.events import read_events
from lmforge.report.observability_sections import profile_section
from tests.test_guardrails import config, train


def test_a_profile_window_writes_a_trace_with_aten_ops_and_a_top_ops_table(
    tmp_path: Path, corpus: Path
) -> None:
    base = config(tmp_path, corpus, max_steps=4)
    base["monitor"]["profile"] = {"start_step": 2, "steps": 2}
    run_dir = train(base).run_dir

    trace = json.loads((run_dir / "profile" / "trace-rank0.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::mm") or name.startswith("aten::addmm") for name in names)
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    # torch-tb-profiler: any directory under the logdir with <worker>.<span>.pt.trace.json is a run.
    board = run_dir / "tb" / "profile" / "rank0.2.pt.trace.json"
    assert json.loads(board.read_text())["traceEvents"]

    top = json.loads((run_dir / "profile" / "top_ops.json").read_text())
    assert top["steps"] == [2, 3] and set(top["step_ms"]) == {"2", "3"}
    assert top["trace"] == "profile/trace-rank0.json"
    ops = top["top_cpu"]
    assert 5 <= len(ops) <= 20 and all(op["self_cpu_ms"] >= 0 and op["count"] >= 1 for op in ops)
    assert ops[0]["self_cpu_ms"] >= ops[-1]["self_cpu_ms"] > 0
    assert any(op["name"].startswith("aten::") for op in ops)
    assert not any(op["name"].startswith("ProfilerStep") for op in ops)  # the steps are no op
    assert top["communication"] == []  # one process: no collectives

    profiled = [e for e in read_events(run_dir / "events") if e["kind"] == "profile"]
    assert [e["step"] for e in profiled] == [3] and "trace-rank0.json" in profiled[0]["message"]

    section = profile_section(run_dir)
    assert "Profiler: top ops" in section and ops[0]["name"] in section
    assert "trace-rank0.json" in section and "steps 2-3" in section and "perfetto" in section


def test_a_profile_window_past_max_steps_is_refused_naming_the_keys(tmp_path: Path, corpus: Path) -> None:
    base = config(tmp_path, corpus, max_steps=4)
    base["monitor"]["profile"] = {"start_step": 4, "steps": 2}
    with pytest.raises(UserInputError) as err:
        load_config(None, base=base)
    message = str(err.value)
    for key in ("monitor.profile.start_step", "monitor.profile.steps", "train.max_steps"):
        assert key in message, message
    base["monitor"]["profile"] = {"start_step": 3, "steps": 2}  # steps 3-4: fits
    load_config(None, base=base)


def test_profile_section_is_empty_without_a_profile(tmp_path: Path) -> None:
    assert profile_section(tmp_path) == ""
