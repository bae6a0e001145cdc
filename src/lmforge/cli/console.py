"""The one rich console every command prints through."""

from rich.console import Console

console = Console(soft_wrap=True)  # never break a path across lines

OVERRIDES_HELP = "Dotted key=value overrides, for example train.lr=1e-4 data.max_length=512."
VERBOSE_HELP = (
    "Raw upstream output: HF Trainer's progress bars and log dicts, and every upstream notice "
    "(by default they go to \\<run>/train.log only)."
)


def apply_verbosity(verbose: bool) -> None:
    """--verbose: raw upstream output here and in every process this command starts (a worker
    or trial started by a verbose command is verbose through the inherited environment)."""
    from lmforge.upstream import quiet_progress_bars
    from lmforge.verbosity import is_verbose, quiet_native_logs, set_verbose

    set_verbose(verbose)
    quiet_native_logs()  # before quiet_progress_bars imports torch
    quiet_progress_bars(not is_verbose())
