"""The `lmforge` command line: parse arguments, call a stage, map errors to exit codes.

Exit codes: 0 success; 2 bad config, data or usage (the message says what and where);
1 a failure during work.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.logging import RichHandler

from lmforge.config import dump_config, load_config
from lmforge.config.load import schema_rows
from lmforge.config.redact import redact_text
from lmforge.errors import UserInputError

app = typer.Typer(
    name="lmforge",
    help="One YAML config from raw data to a trained, verified, exported language model.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(help="Inspect configs and the config schema.", no_args_is_help=True)
tokenizer_app = typer.Typer(help="Tokenizer tools.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(tokenizer_app, name="tokenizer")

console = Console(soft_wrap=True)  # never break a path across lines
OVERRIDES_HELP = "Dotted key=value overrides, for example train.lr=1e-4 data.max_length=512."


class _RedactingFilter(logging.Filter):
    """Secrets from the environment never reach a log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact_text(record.getMessage())
        record.args = ()
        return True


def _setup_logging() -> None:
    handler: logging.Handler
    if sys.stderr.isatty():
        handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False)
        fmt = "%(message)s"
    else:
        # Piped to a file or CI log: one unwrapped line per record, greppable.
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler.addFilter(_RedactingFilter())
    logging.basicConfig(level=logging.INFO, format=fmt, handlers=[handler], force=True)
    import transformers

    transformers.logging.set_verbosity_warning()


@app.command()
def train(
    config: Path = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
) -> None:
    """Run a training job in this process.

    Example: `lmforge train examples/pretrain_tiny.yaml train.max_steps=50`
    """
    from lmforge.train.runner import run_training

    cfg = load_config(config, overrides)
    outcome = run_training(cfg)
    console.print(f"[bold green]done[/] {outcome.steps} steps; model in {outcome.final_dir}")
    if outcome.last_eval_ppl is not None:
        console.print(f"eval perplexity: {outcome.first_eval_ppl:.2f} -> {outcome.last_eval_ppl:.2f}")


@app.command()
def prepare(
    config: Path = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    show: int = typer.Option(
        0, "--show", help="Print N training samples with the tokens that carry loss highlighted."
    ),
) -> None:
    """Data stage only: load, validate, tokenize, pack and cache the data; print the data report.

    `lmforge train` with the same config reuses the cache.

    Example: `lmforge prepare examples/sft_lora.yaml --show 2`
    """
    from rich.text import Text

    from lmforge.train.prepare import first_samples, prepare_run_data, supervised_runs

    cfg = load_config(config, overrides)
    report_path, tokenizer, data = prepare_run_data(cfg)
    console.print_json(json.dumps(data.report))
    for number, (ids, labels) in enumerate(first_samples(data, show), start=1):
        console.rule(
            f"sample {number}: {len(ids)} tokens, {sum(label != -100 for label in labels)} with loss"
        )
        text = Text()
        for piece, supervised in supervised_runs(tokenizer, ids, labels):
            text.append(piece, style="bold green" if supervised else "dim")
        console.print(text)
    if show:
        console.print("[dim]dim: context only (no loss)[/]   [bold green]green: tokens that carry loss[/]")
    console.print(f"data report written to {report_path}")


@app.command()
def quickstart(
    out: Path = typer.Option(
        Path("runs/quickstart"), "--out", help="Directory for everything the quickstart makes."
    ),
    steps: int = typer.Option(200, help="Pretraining steps (fewer for a faster, rougher demo)."),
) -> None:
    """Offline demo of the whole pipeline on CPU in minutes: tokenizer, pretraining, evaluation, sample.

    Example: `lmforge quickstart --out runs/quickstart`
    """
    from lmforge.pipeline.quickstart import run_quickstart

    run_quickstart(out, pretrain_steps=steps, console=console)


@config_app.command("show")
def config_show(
    config: Path = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
) -> None:
    """Print the resolved config (defaults filled in, overrides applied, secrets redacted).

    Example: `lmforge config show examples/pretrain_tiny.yaml train.lr=1e-3`
    """
    cfg = load_config(config, overrides)
    sys.stdout.write(yaml.safe_dump(dump_config(cfg), sort_keys=False))


@config_app.command("schema")
def config_schema() -> None:
    """List every config key with its type, default and description.

    Example: `lmforge config schema`
    """
    for key, type_text, default, description in schema_rows():
        if type_text == "section":
            sys.stdout.write(f"\n{key}:  {description}\n")
            continue
        default_text = f" = {default}" if default else " (required)"
        sys.stdout.write(f"  {key}: {type_text}{default_text}\n      {description}\n")


@tokenizer_app.command("train")
def tokenizer_train(
    inputs: list[str] = typer.Option(
        ..., "--input", help="Text source: file, glob, directory or builtin:python-stdlib (repeatable)."
    ),
    vocab_size: int = typer.Option(8192, "--vocab-size", help="Vocabulary size."),
    out: Path = typer.Option(..., "--out", help="Directory to write the HF tokenizer to."),
    text_field: str = typer.Option(
        "text", "--text-field", help="Field with the text in .jsonl/.json/.parquet inputs."
    ),
) -> None:
    """Train a byte-level BPE tokenizer (HF format, with special tokens and a ChatML chat template).

    Example: `lmforge tokenizer train --input 'data/*.txt' --vocab-size 8192 --out my-tokenizer`
    """
    import itertools

    from pydantic import ValidationError

    from lmforge.config.schema import SourceConfig, TokenizerTrainConfig
    from lmforge.data.sources import iter_documents
    from lmforge.data.tokenizer import train_tokenizer

    try:
        settings = TokenizerTrainConfig(vocab_size=vocab_size)
        sources = [SourceConfig(path=p, text_field=text_field) for p in inputs]
    except ValidationError as err:
        raise UserInputError(f"bad option: {err.errors()[0]['msg']}") from None
    documents = itertools.chain.from_iterable(iter_documents(s) for s in sources)
    tokenizer = train_tokenizer(documents, settings)
    tokenizer.save_pretrained(str(out))
    console.print(f"tokenizer with {len(tokenizer)} tokens written to {out}")


def main() -> None:
    """Console-script entry point."""
    _setup_logging()
    try:
        app()
    except UserInputError as err:
        # Plain text: error lines must not be re-wrapped or styled away when piped.
        sys.stderr.write(f"error: {redact_text(str(err))}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
