"""What the console shows: lmforge's own lines and upstream warnings a user can act on.

A short CPU run used to print HF Trainer's raw log dicts, nested tqdm bars for eval inside the
training bar, INFO lines of gguf / onnxscript / DeepSpeed and warnings nobody can act on. By
default the console gets lmforge's records and upstream WARNING-or-worse records that say
something actionable; everything still reaches `<run>/train.log` (its handler has no such
filter). `--verbose` (the LMFORGE_VERBOSE environment variable, so that `lmforge launch`
workers and sweep trials inherit it) restores the raw upstream output.

A leaf module: imports no lmforge package.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

log = logging.getLogger(__name__)

VERBOSE_ENV = "LMFORGE_VERBOSE"
# A record logged with extra={FILE_ONLY: True} is for train.log alone (HF's raw log dicts, which
# the console shows as a formatted line instead, or, with --verbose, as HF prints them).
FILE_ONLY = "lmforge_file_only"

# Upstream warnings that carry no action for an lmforge user, each with why.
ACTIONLESS = (
    # DeepSpeed on a machine without a GPU: CPU is the expected accelerator there.
    re.compile(r"Setting accelerator to CPU"),
    # PEFT on a model with tied embeddings: lmforge merges adapters itself and verifies every
    # export against the trained model, so the "complications" PEFT warns about are checked.
    re.compile(r"tied layer is part of the adapter"),
    re.compile(r"embeddings are no longer tied after merging"),
    # TRL's GRPO / RLOO: lmforge passes an instantiated policy and sets model_init_kwargs only for
    # the reference model TRL loads from <run>/reference/ (the dtype); the policy needs none.
    re.compile(r"You passed `model_init_kwargs` to the `(GRPO|RLOO)Config`, but your model is already"),
    # bitsandbytes (Lion, 8-bit AdamW, GaLore) on an AVX512-bf16 CPU: an optional 4-bit matmul
    # kernel it would download from the hub; lmforge's optimizers never use it.
    re.compile(r"Failed to load CPU gemm_4bit_forward from kernels-community"),
    # PEFT's fused-expert conversion (Mixtral, Qwen3-MoE) doubles the rank of experts.gate_up_proj
    # (w1 and w3 in one parameter) and then checks that pattern against module names only: the rank
    # is applied (the adapter audit shows it), the "ignored" is wrong.
    re.compile(r"The following (rank|alpha)_pattern keys did not match any targeted module .*gate_up_proj"),
    # transformers on train.compile: model without an Ampere GPU: compiling is what the user asked for
    # (it pays on CPUs too: bench/RESULTS.md).
    re.compile(r"The speedups for torchdynamo mostly come with GPU Ampere or higher"),
)
# Python warnings raised inside torch.distributed (DTensor, FSDP2, DCP: "FSDP2-wrapped module
# returned a view tensor", ...) are about how lmforge drives those engines, not about anything a
# user sets: train.log keeps them, the console does not (2 processes printed 7 lines, 4 printed 13).
ENGINE_INTERNALS = re.compile(r"[/\\]torch[/\\]distributed[/\\]")
# How logging.captureWarnings formats a warning: "<file>:<line>: <Category>: <message>".
_CATEGORY = re.compile(r":\d+: (\w+): ")
# Lines torch's C++ side writes to stderr, past Python's logging: kineto's `USDT: ... profiler_start`
# / `profiler_stop` markers (kineto's USDT level is 5, so 6 is the first level above it; kineto's
# errors go too) and c10 warnings such as the memory profiler's `CPUAllocator.cpp:245] Memory block of
# unknown size was allocated before the profiling started`. c10 reads its variable when torch is
# imported, kineto at the first profile: set before either, unless the user set them.
NATIVE_LOG_LEVELS = {"TORCH_CPP_LOG_LEVEL": "ERROR", "KINETO_LOG_LEVEL": "6"}
DEPRECATIONS = ("FutureWarning", "DeprecationWarning", "PendingDeprecationWarning")
# Notices libraries log while they are imported, before any run's train.log exists, and on loggers
# the console's filter may never see (torch's own loggers print through a handler of theirs and do
# not reach the root): logger -> what is dropped there, each with why. --verbose shows them.
IMPORT_NOTICES = {
    # torchao (the fp8 extra; transformers imports it in every command once it is installed) ships
    # kernels built for other CUDA and Python versions and names each one it cannot load. Float8
    # training runs on torch's own float8 matmul (torch._scaled_mm) and needs none of them.
    "torchao": re.compile(r"Failed to load .*torchao[/\\]_C"),
    # torchao 0.18 registers its enums with torch's pytree the way torch 2.13 deprecates: a notice
    # per enum, about torchao's code, at import.
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
    # torchao's int8 matmul kernels want triton (absent on CPU-only machines); float8 training does not
    # use them. Logged on its own module's logger: a filter on "torchao" does not see it.
    "torchao.kernel.intmm": re.compile(r"Detected no triton"),
}


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(verbose: bool) -> None:
    """Record the choice where child processes (launch workers, sweep trials) inherit it."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"


def quiet_native_logs() -> None:
    """Keep torch's C++ notices (NATIVE_LOG_LEVELS) off the console of this process and the ones it
    starts; with --verbose they stay. Call before torch is imported."""
    if is_verbose():
        return
    for name, level in NATIVE_LOG_LEVELS.items():
        os.environ.setdefault(name, level)


class _DropImportNotice(logging.Filter):
    """A logger's filter: drops its IMPORT_NOTICES record unless --verbose."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return is_verbose() or not self.pattern.search(record.getMessage())


def quiet_import_notices() -> None:
    """Keep IMPORT_NOTICES off the console (filters on their loggers, added once). Call before the
    libraries are imported: the command line does it first thing (lmforge/cli/__init__.py)."""
    for name, pattern in IMPORT_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNotice) for f in logger.filters):
            logger.addFilter(_DropImportNotice(pattern))


def message_category(message: str) -> str | None:
    """The category in a message logging.captureWarnings formatted ("FutureWarning", ...)."""
    found = _CATEGORY.search(message)
    return found.group(1) if found else None


def warning_category(record: logging.LogRecord) -> str | None:
    """The warning category of a record logging.captureWarnings made (None for any other record)."""
    return message_category(record.getMessage()) if record.name == "py.warnings" else None


class QuietConsole(logging.Filter):
    """The console handler's filter: lmforge's own records pass; upstream records pass at
    WARNING or worse unless they are deprecation notices or in ACTIONLESS; records marked
    FILE_ONLY never pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, FILE_ONLY, False):
            return False
        if is_verbose():
            return True
        if record.name.startswith("lmforge") or record.name == "__main__":
            return True
        category = warning_category(record)
        if category in DEPRECATIONS:
            return False
        message = record.getMessage()
        if category is not None and ENGINE_INTERNALS.search(message.split(f": {category}: ", 1)[0]):
            return False
        if category is None and record.levelno < logging.WARNING:
            return False
        return not any(pattern.search(message) for pattern in ACTIONLESS)


QUIET_CONSOLE = QuietConsole()  # one instance: adding it to a handler twice is a no-op


# Where a progress bar's stream is not a terminal (a job's log file, a CI log), tqdm still redraws
# every 0.1 s with carriage returns: a 64-row export verification left 25 frames on one line.
NON_TERMINAL_REDRAW_SECONDS = 30.0


def progress_bar(iterable: Any = None, **kwargs: Any) -> Any:
    """lmforge's progress bar (tqdm.auto, same arguments). On a stream that is not a terminal it
    redraws at most every 30 s: a short step leaves its first and last frame, a long one a frame
    every 30 s."""
    from tqdm.auto import tqdm

    stream: TextIO = kwargs.get("file") or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        # maxinterval too: tqdm's monitor thread redraws a bar idle for maxinterval (10 s by default).
        kwargs.setdefault("mininterval", NON_TERMINAL_REDRAW_SECONDS)
        kwargs.setdefault("maxinterval", NON_TERMINAL_REDRAW_SECONDS)
    return tqdm(iterable, **kwargs)


@contextlib.contextmanager
def stderr_to_log(what: str) -> Iterator[None]:
    """Everything Python writes to stderr inside the block (an upstream library's own tqdm bars, which
    transformers' and the Hub's switches do not reach) goes to train.log instead of the console."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        if captured.getvalue().strip():
            log.info("%s: %s", what, captured.getvalue().strip(), extra={FILE_ONLY: True})


@contextlib.contextmanager
def datasets_bars_off() -> Iterator[None]:
    """No `datasets` progress bars inside the block (its map / filter / save_to_disk bars): where
    an upstream library prepares data lmforge has already checked and reported, such as TRL's
    preference trainers tokenizing their pairs ("Tokenizing train dataset", "Dropping fully
    truncated examples"), two lines per split on the console told the user nothing. --verbose keeps
    them. Local, not process-wide: lmforge shows a datasets bar of its own where the work is long
    (rendering a VLM's image pairs)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    if not is_verbose():
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


_ANSI_STYLE = re.compile(r"\x1b\[[0-9;]*m")


class _LoadReportToLog(logging.Filter):
    """Takes transformers' load report off its logger (and so off the console: that logger prints
    through a handler of its own) and writes it, unstyled, to train.log only."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        log.info("%s", _ANSI_STYLE.sub("", message), extra={FILE_ONLY: True})
        return False


@contextlib.contextmanager
def load_report_to_log() -> Iterator[None]:
    """A `from_pretrained(..., output_loading_info=True)` whose caller reads the loading info and says
    what matters itself: transformers' coloured "<Model> LOAD REPORT" table (a key table and notes,
    drawn for a reward model's expected new score head) goes to train.log, not the console."""
    logger = logging.getLogger("transformers.modeling_utils")
    divert = _LoadReportToLog()
    logger.addFilter(divert)
    try:
        yield
    finally:
        logger.removeFilter(divert)
