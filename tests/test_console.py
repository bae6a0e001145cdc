"""The training console: formatted lines, the upstream-notice filter, and --verbose.

The quiet default on a whole pipeline is checked by the quickstart test (tests/test_train_e2e.py).
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from rich.console import Console
from transformers import TrainerControl, TrainerState

from lmforge.cli.console import apply_verbosity
from lmforge.cli.train import _change as summary_change
from lmforge.monitor.events import EventLog
from lmforge.run_layout import RunPaths
from lmforge.train.console_progress import ConsoleProgress, format_eval_line, format_step_line
from lmforge.train.outcome import outcome_of
from lmforge.train.run_log import run_log
from lmforge.verbosity import FILE_ONLY, NATIVE_LOG_LEVELS, QUIET_CONSOLE, VERBOSE_ENV
from tests.conftest import run_cli
from tests.test_bad_input import write_config


def _record(name: str, level: int, message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, message, (), None)
    record.__dict__.update(extra)
    return record


def test_console_filter_keeps_lmforge_and_actionable_upstream_warnings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    passes = QUIET_CONSOLE.filter
    assert passes(_record("lmforge.train.runner", logging.INFO, "model: llama"))
    assert passes(_record("DeepSpeed", logging.WARNING, "zero_optimization.stage 3 needs ..."))
    assert not passes(_record("onnxscript.optimizer", logging.INFO, "Skipping constant folding"))
    assert not passes(_record("DeepSpeed", logging.WARNING, "[WARNING] Setting accelerator to CPU. If you"))
    deprecation = "/x/modeling_utils.py:3303: FutureWarning: `is_gradient_checkpointing` is deprecated"
    assert not passes(_record("py.warnings", logging.WARNING, deprecation))
    tied = "/x/tuners_utils.py:1463: UserWarning: Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"
    assert not passes(_record("py.warnings", logging.WARNING, tied))
    assert passes(
        _record("py.warnings", logging.WARNING, "/x/data.py:10: UserWarning: the tokenizer has no pad")
    )
    assert not passes(_record("hf_trainer.logs", logging.INFO, "step 1: {'loss': 1.0}", **{FILE_ONLY: True}))
    monkeypatch.setenv(VERBOSE_ENV, "1")  # --verbose: everything but the file-only copies
    assert passes(_record("onnxscript.optimizer", logging.INFO, "Skipping constant folding"))
    assert passes(_record("py.warnings", logging.WARNING, deprecation))
    assert not passes(_record("hf_trainer.logs", logging.INFO, "step 1: {'loss': 1.0}", **{FILE_ONLY: True}))


def test_step_and_eval_lines_show_numbers_as_numbers() -> None:
    record = {"loss": 8.36213, "lr": 0.002, "grad_norm": 2.6931, "tokens_per_s": 3210.4, "mfu": 0.2143}
    assert format_step_line(record, 40, 200, 51.2) == (
        "step  40/200  loss 8.3621  lr 2.00e-03  grad 2.69  tok/s 3,210  MFU 21.4%  ETA 0:00:51"
    )
    assert format_step_line({"loss": float("nan")}, 3, 9, None) == "step 3/9  loss nan"
    evaluated = {"eval_loss": 6.0291, "eval_ppl": 415.24, "eval_runtime": 1.1, "eval_bleu": 12.5}
    assert format_eval_line(evaluated, 100) == "eval at step 100:  loss 6.029  ppl 415.2  bleu 12.5"


def test_verbose_restores_hf_trainers_raw_output(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("some text to read for a tiny model\n" * 200)
    config = write_config(tmp_path, tmp_path / "corpus.txt", max_steps=2, log_every=1)
    # fresh: --verbose also undoes the quieting of what libraries print while they import
    result = run_cli("train", str(config), "--verbose", "run.name=verbose", fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "{'loss'" in printed  # HF's own log dicts
    assert "step 1/2  loss" not in printed  # and not lmforge's lines on top of them
    assert "hf_trainer.logs: step 2: {'loss'" in (tmp_path / "runs" / "verbose" / "train.log").read_text()


def test_torch_distributed_notices_stay_in_train_log_and_other_ranks_leave_warnings_to_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    fsdp = (
        "/x/torch/distributed/fsdp/_fully_shard/_fsdp_state.py:331: UserWarning: FSDP2-wrapped module "
        "(FSDPLlamaForCausalLM) returned a view tensor."
    )
    assert not QUIET_CONSOLE.filter(_record("py.warnings", logging.WARNING, fsdp))
    shown = "/x/lmforge_user_code/torch_distributed_helpers.py:3: UserWarning: the tokenizer has no pad"
    assert QUIET_CONSOLE.filter(_record("py.warnings", logging.WARNING, shown))  # not inside torch

    def console_of(rank_is_main: bool) -> str:
        stream = io.StringIO()
        console = logging.StreamHandler(stream)
        root = logging.getLogger()
        root.addHandler(console)
        run = tmp_path / ("main" if rank_is_main else "other")
        run.mkdir()
        try:
            with run_log(RunPaths(run), is_main=rank_is_main), warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.warn("the tokenizer has no pad", UserWarning, stacklevel=1)
                logging.getLogger("lmforge.train").warning("a guardrail fired")
        finally:
            root.removeHandler(console)
        return stream.getvalue()

    main, other = console_of(True), console_of(False)
    assert "the tokenizer has no pad" in main and "a guardrail fired" in main
    assert "the tokenizer has no pad" not in other and "a guardrail fired" in other  # once, by rank 0
    assert "the tokenizer has no pad" in (tmp_path / "main" / "train.log").read_text()


def test_the_eta_leaves_out_the_first_step_and_its_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first step carries the start-up (workers, compilation): ETA 9:43:42 at step 1 of a 2-minute stage.
    clock = iter([400.0, 401.0, 402.0])  # step 1 ends at 400 s (its start-up), then 1 s a step
    monkeypatch.setattr("lmforge.train.console_progress.time.monotonic", lambda: next(clock))
    progress = ConsoleProgress("pretrain", lambda: {"loss": 2.0})
    progress.console = Console(file=io.StringIO(), width=200)
    state = TrainerState(max_steps=100, is_world_process_zero=True)
    progress.on_train_begin(None, state, TrainerControl())  # type: ignore[arg-type]
    lines = []
    for step in (1, 2, 3):
        state.global_step = step
        progress.on_step_end(None, state, TrainerControl())  # type: ignore[arg-type]
        lines.append(format_step_line({"loss": 2.0}, step, 100, progress._eta(state)))
    assert "ETA" not in lines[0]  # one step timed is the start-up, not a rate
    assert lines[1].endswith("ETA 0:01:38") and lines[2].endswith("ETA 0:01:37")  # 1 s a step
    progress.on_train_end(None, state, TrainerControl())  # type: ignore[arg-type]


def test_torch_cpp_notices_of_the_profiler_stay_off_the_console(monkeypatch: pytest.MonkeyPatch) -> None:
    # kineto's `USDT: ... profiler_start` and c10's `CPUAllocator.cpp:245] Memory block of unknown size`
    # reached the console of a run with monitor.profile; the command line sets their levels first.
    for name in (VERBOSE_ENV, *NATIVE_LOG_LEVELS):
        monkeypatch.setenv(name, "")  # so that the test's end restores what was there
        monkeypatch.delenv(name)
    apply_verbosity(False)
    assert {name: os.environ[name] for name in NATIVE_LOG_LEVELS} == NATIVE_LOG_LEVELS
    script = (
        "from lmforge.verbosity import quiet_native_logs\n"
        "quiet_native_logs()\n"
        "import torch\n"
        "from torch.profiler import profile, ProfilerActivity\n"
        "x = torch.randn(64, 64)\n"
        "with profile(activities=[ProfilerActivity.CPU], profile_memory=True):\n"
        "    del x\n"
        "    (torch.randn(64, 64) @ torch.randn(64, 64)).sum()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in NATIVE_LOG_LEVELS}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "USDT" not in result.stderr and "CPUAllocator" not in result.stderr, result.stderr[-2000:]


def test_a_finished_run_is_logged_at_info_and_a_guardrail_at_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events = EventLog(tmp_path)
    with caplog.at_level(logging.INFO, logger="lmforge.monitor.events"):
        events.emit("finished", 6, "finished after 6 steps")
        events.emit("skip", 3, "loss spike")
    levels = {record.getMessage().split("]")[0]: record.levelname for record in caplog.records}
    assert levels == {"[finished": "INFO", "[skip": "WARNING"}


def _metrics(run: Path, *records: dict[str, float]) -> RunPaths:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return RunPaths(run)


def test_the_summary_compares_with_the_eval_before_training_or_says_there_was_none(tmp_path: Path) -> None:
    # No train.eval_every: the eval data runs once, at the end; its value is no "before".
    once = outcome_of(
        _metrics(
            tmp_path / "once", {"step": 5, "loss": 5.1}, {"step": 10, "eval_loss": 5.05, "eval_ppl": 155.83}
        ),
        10,
        1000,
        resumed_from=None,
    )
    assert (once.first_eval_ppl, once.last_eval_ppl, once.first_eval_loss) == (None, 155.83, None)
    assert summary_change(once.first_eval_ppl, 155.83, ".2f") == (
        "155.83 (at the end; set train.eval_every to also measure the start)"
    )
    start = {"step": 0, "eval_loss": 5.69, "eval_ppl": 297.0}
    both = outcome_of(
        _metrics(tmp_path / "both", start, {"step": 10, "eval_loss": 5.05, "eval_ppl": 155.83}),
        10,
        1000,
        resumed_from=None,
    )
    assert (both.first_eval_ppl, both.last_eval_ppl, both.first_eval_loss) == (297.0, 155.83, 5.69)
    assert summary_change(both.first_eval_ppl, 155.83, ".2f") == "297.00 -> 155.83"


def test_a_lora_run_holds_100_percent_of_its_parameters_after_trl_adds_its_reference_adapter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # TRL's DPO / KTO / GRPO / RLOO trainers add a frozen copy of the adapter ("ref") while they are
    # built: counted before, the total was short of it ("holds 4,246,784 of 4,098,816 (103.6%)").
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from lmforge.train.callbacks import ShardReport

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    report = ShardReport("none")
    model.add_adapter("ref", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # what TRL does
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with caplog.at_level(logging.INFO, logger="lmforge.train.callbacks"):
        report.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    reference = 2 * 2 * 4 * (32 + 32)  # 2 layers x (q, v) x rank 4 x (in + out)
    assert sum(p.numel() for name, p in model.named_parameters() if ".ref." in name) == reference
    whole = sum(p.numel() for p in model.parameters())
    assert f"rank 0 holds {whole:,} of {whole:,} parameter elements (100.0%, none)" in caplog.text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _frames(stream: io.StringIO) -> int:
    """How many times a bar was drawn: tqdm starts each redraw with a carriage return."""
    return stream.getvalue().count("\r")


def test_a_progress_bar_in_a_log_file_draws_its_first_and_last_frame_only() -> None:
    """A job's log file got 25 carriage-return frames of one 3-second export verification; where
    the stream is not a terminal, lmforge's bars redraw at most every 30 s. A terminal keeps
    tqdm's 0.1 s redraws."""
    from lmforge.verbosity import progress_bar

    def run(stream: io.StringIO) -> int:
        for _ in progress_bar(range(40), desc="verify logits", file=stream):
            time.sleep(0.02)  # 0.8 s in all: eight of tqdm's 0.1 s redraw intervals
        return _frames(stream)

    assert run(io.StringIO()) <= 2
    assert run(_Terminal()) >= 5
