"""The one rich console every command prints through."""

from rich.console import Console

console = Console(soft_wrap=True)  # never break a path across lines
