"""The one rich console every command prints through."""

from rich.console import Console

console = Console(soft_wrap=True)  # never break a path across lines

OVERRIDES_HELP = "Dotted key=value overrides, for example train.lr=1e-4 data.max_length=512."
