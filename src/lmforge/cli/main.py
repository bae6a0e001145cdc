"""The `lmforge` command line: parse arguments, call a stage, map errors to exit codes.

Exit codes: 0 success (also a run stopped by SIGTERM/SIGINT at a checkpoint); 2 bad config, data
or usage (the message says what and where); 1 a failure during work (an export that fails its
verification included); 3 a run stopped by its guardrails, with a checkpoint of the last good state;
4 a run stopped out of memory for a restart one rung up the OOM ladder (`lmforge launch` restarts it).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.logging import RichHandler

from lmforge.cli.ckpt import ckpt_app
from lmforge.cli.ckpt_verify import VERIFY_FAILED
from lmforge.cli.console import OVERRIDES_HELP, VERBOSE_HELP, apply_verbosity, console
from lmforge.cli.doctor import doctor
from lmforge.cli.estimate import estimate
from lmforge.cli.evaluate import eval_command, generate
from lmforge.cli.launch import launch
from lmforge.cli.monitor import monitor_app
from lmforge.cli.push import push, registry_app
from lmforge.cli.report import report, runs_app
from lmforge.cli.rl import rl_app
from lmforge.cli.serve import serve
from lmforge.cli.sweep import sweep
from lmforge.cli.train import prepare, train
from lmforge.cli.ui import ui
from lmforge.config import dump_config, load_config
from lmforge.config.load import schema_rows
from lmforge.config.redact import redact_text
from lmforge.errors import (
    GUARD_STOP_EXIT,
    ExportVerificationFailed,
    TrainingStopped,
    UserInputError,
    WorkFailed,
)
from lmforge.verbosity import QUIET_CONSOLE, is_verbose

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
app.add_typer(ckpt_app, name="ckpt")
app.add_typer(monitor_app, name="monitor")
app.add_typer(rl_app, name="rl")
# The order of `lmforge --help`: the pipeline's own order, then the tools.
app.command("train")(train)
app.command("prepare")(prepare)
app.command("launch")(launch)
app.command("eval")(eval_command)
app.command("generate")(generate)
app.command("serve")(serve)
app.command("ui")(ui)
app.command("estimate")(estimate)
app.command("report")(report)
app.add_typer(runs_app, name="runs")
app.command("push")(push)
app.add_typer(registry_app, name="registry")
app.command("sweep")(sweep)
app.command("doctor")(doctor)


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
    handler.addFilter(QUIET_CONSOLE)  # upstream notices without an action: train.log only
    logging.basicConfig(level=logging.INFO, format=fmt, handlers=[handler], force=True)
    import transformers

    transformers.logging.set_verbosity_warning()
    apply_verbosity(is_verbose())  # a command's --verbose turns the bars back on


@app.command()
def quickstart(
    out: Path = typer.Option(
        Path("runs/quickstart"), "--out", help="Directory for everything the quickstart makes."
    ),
    steps: int = typer.Option(200, help="Pretraining steps (fewer for a faster, rougher demo)."),
    finetune_steps: int = typer.Option(200, help="LoRA fine-tuning steps on the word-group task."),
    rl_steps: int = typer.Option(
        40, help="GRPO steps after the fine-tune (exact-match reward on the same task); 0 skips RL."
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Offline demo of the whole pipeline on CPU in minutes: tokenizer, pretraining, evaluation, sample,
    LoRA fine-tuning with held-out accuracy before and after, export, and a short GRPO run.

    Example: `lmforge quickstart --out runs/quickstart`
    """
    from lmforge.pipeline.quickstart import run_quickstart

    apply_verbosity(verbose)
    run_quickstart(
        out,
        pretrain_steps=steps,
        finetune_steps=finetune_steps,
        rl_steps=rl_steps,
        console=console,
    )


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
    except ExportVerificationFailed as err:
        sys.stderr.write(f"error: {redact_text(str(err))}\n")
        sys.exit(VERIFY_FAILED)
    except WorkFailed as err:
        sys.stderr.write(f"error: {redact_text(str(err))}\n")
        sys.exit(1)
    except TrainingStopped as err:
        sys.stderr.write(f"stopped by the guardrails: {redact_text(str(err))}\n")
        sys.exit(GUARD_STOP_EXIT)


if __name__ == "__main__":
    main()
