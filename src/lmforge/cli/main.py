"""The `lmforge` command line: parse arguments, call a stage, map errors to exit codes.

Exit codes: 0 success (also a run stopped by SIGTERM/SIGINT at a checkpoint); 2 bad config, data
or usage (the message says what and where); 1 a failure during work (an export that fails its
verification included); 3 a run stopped by its guardrails, with a checkpoint of the last good state.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.logging import RichHandler

from lmforge.cli.ckpt import ckpt_app, print_export
from lmforge.cli.ckpt_verify import VERIFY_FAILED
from lmforge.cli.console import console
from lmforge.cli.doctor import doctor
from lmforge.cli.estimate import estimate
from lmforge.cli.launch import launch
from lmforge.cli.monitor import monitor_app
from lmforge.cli.report import report, runs_app
from lmforge.config import dump_config, load_config
from lmforge.config.load import schema_rows
from lmforge.config.redact import redact_text
from lmforge.distributed.launch import record_worker_errors
from lmforge.errors import (
    GUARD_STOP_EXIT,
    ExportVerificationFailed,
    TrainingStopped,
    UserInputError,
    WorkFailed,
)

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
app.command("doctor")(doctor)
app.command("report")(report)
app.command("estimate")(estimate)
app.command("launch")(launch)
app.add_typer(runs_app, name="runs")
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
@record_worker_errors  # a failed worker's error reaches `lmforge launch`
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
    if outcome.interrupted_by is not None:
        console.print(
            f"[bold yellow]stopped[/] by {outcome.interrupted_by} at step {outcome.steps} with a checkpoint; "
            "run the same command to resume"
        )
        return
    if outcome.already_finished:
        console.print(
            f"[bold green]already finished[/] at step {outcome.steps}"
            + (f" (final loss {outcome.last_loss:.4f})" if outcome.last_loss is not None else "")
            + "; nothing to train. Model in "
            f"{outcome.final_dir} (raise train.max_steps to continue it, or run.overwrite=true to start over)"
        )
    else:
        console.print(f"[bold green]done[/] {outcome.steps} steps; model in {outcome.final_dir}")
    if outcome.last_eval_ppl is not None:
        console.print(f"eval perplexity: {outcome.first_eval_ppl:.2f} -> {outcome.last_eval_ppl:.2f}")
    elif outcome.last_eval_loss is not None:  # preference stages: their loss is no perplexity
        console.print(
            f"eval loss ({cfg.train.stage}): {outcome.first_eval_loss:.4f} -> {outcome.last_eval_loss:.4f}"
        )
    if outcome.export is not None:
        print_export(outcome.export)


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
    # Preference / KTO rows are tokenized by TRL at train time: shown as rendered text.
    shown = (
        _show_preference_rows(tokenizer, data, show)
        if data.conversational_rows
        else first_samples(data, show)
    )
    for number, (ids, labels) in enumerate(shown, start=1):
        console.rule(
            f"sample {number}: {len(ids)} tokens, {sum(label != -100 for label in labels)} with loss"
        )
        text = Text()
        for piece, supervised in supervised_runs(tokenizer, ids, labels):
            text.append(piece, style="bold green" if supervised else "dim")
        console.print(text)
    if show and not data.conversational_rows:
        console.print("[dim]dim: context only (no loss)[/]   [bold green]green: tokens that carry loss[/]")
    console.print(f"data report written to {report_path}")


def _show_preference_rows(tokenizer: Any, data: Any, count: int) -> list[tuple[list[int], list[int]]]:
    """The first rows as training renders them: the prompt through the chat template, then each answer."""
    for number in range(min(count, len(data.train))):
        row = data.train[number]
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        answers = {k: row[k] for k in ("chosen", "rejected", "completion") if k in row}
        label = f" (label: {'desirable' if row['label'] else 'undesirable'})" if "label" in row else ""
        console.rule(f"row {number + 1}{label}")
        console.print(prompt, markup=False, highlight=False, end="")
        for name, answer in answers.items():
            console.print(f"[bold green]{name}:[/] ", end="")
            console.print(answer[0]["content"], markup=False, highlight=False)
    return []


@app.command()
def quickstart(
    out: Path = typer.Option(
        Path("runs/quickstart"), "--out", help="Directory for everything the quickstart makes."
    ),
    steps: int = typer.Option(200, help="Pretraining steps (fewer for a faster, rougher demo)."),
    finetune_steps: int = typer.Option(200, help="LoRA fine-tuning steps on the word-group task."),
) -> None:
    """Offline demo of the whole pipeline on CPU in minutes: tokenizer, pretraining, evaluation, sample,
    LoRA fine-tuning with held-out accuracy before and after.

    Example: `lmforge quickstart --out runs/quickstart`
    """
    from lmforge.pipeline.quickstart import run_quickstart

    run_quickstart(out, pretrain_steps=steps, finetune_steps=finetune_steps, console=console)


@app.command("eval")
def eval_command(
    target: Path = typer.Argument(
        ..., help="A run's YAML config (evaluates its final/ model) or a model directory."
    ),
    data: list[Path] = typer.Option(
        None,
        "--data",
        help="Text (.txt, jsonl with 'text') or QA jsonl rows to evaluate on (repeatable).",
        show_default=False,
    ),
    scoring: str = typer.Option(
        "exact", "--scoring", help="QA scoring: exact (whitespace-normalised, case-sensitive) or contains."
    ),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Longest generated answer, in tokens."),
    limit: int = typer.Option(
        None, "--limit", help="Evaluate at most N rows (QA) or blocks (text) per source.", show_default=False
    ),
    tasks: str = typer.Option(
        None,
        "--tasks",
        help="lm-evaluation-harness tasks, comma-separated (needs: pip install lm-eval).",
        show_default=False,
    ),
    adapter: Path = typer.Option(
        None, "--adapter", help="PEFT adapter directory to apply on top of the model.", show_default=False
    ),
    out: Path = typer.Option(
        None,
        "--out",
        help="Where to write the JSON summary [default: <model_dir>/eval.json].",
        show_default=False,
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only the JSON summary on stdout."),
) -> None:
    """Perplexity, QA accuracy and generation samples of a trained model.

    Example: `lmforge eval runs/sft/final --data qa.jsonl --scoring contains --json`
    """
    from lmforge.evaluate.run import EvalRequest, evaluate, json_safe, summary_lines

    if scoring not in ("exact", "contains"):
        raise UserInputError(f"--scoring: {scoring!r} is not one of exact, contains")
    request = EvalRequest(
        target=target,
        data=list(data or []),
        scoring=scoring,  # type: ignore[arg-type]
        max_new_tokens=max_new_tokens,
        limit=limit,
        tasks=[t.strip() for t in (tasks or "").split(",") if t.strip()],
        adapter=adapter,
    )
    model_dir, summary = evaluate(request)
    document = json.dumps(json_safe(summary), indent=2)
    out_path = out or model_dir / "eval.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(document + "\n", encoding="utf-8")
    if as_json:
        sys.stdout.write(document + "\n")
        return
    for line in summary_lines(summary):
        console.print(line, markup=False, highlight=False)
    console.print(f"summary written to {out_path}", markup=False, highlight=False)


@app.command()
def generate(
    model_dir: Path = typer.Argument(..., help="Model directory, adapter directory or a run's final/."),
    prompt: str = typer.Option(..., "--prompt", help="The user message."),
    system: str = typer.Option(None, "--system", help="Optional system message.", show_default=False),
    adapter: Path = typer.Option(
        None, "--adapter", help="PEFT adapter directory to apply on top of the model.", show_default=False
    ),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Longest reply, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 is greedy."),
) -> None:
    """Quick inference with the model's chat template; the reply streams as it is generated.

    Example: `lmforge generate runs/sft/final --prompt 'What is 2 + 3?' --max-new-tokens 32`
    """
    from lmforge.evaluate.loading import load_for_inference

    if temperature < 0:
        raise UserInputError(
            f"--temperature: {temperature} is negative; use 0 for greedy or a positive value"
        )
    model, tokenizer = load_for_inference(model_dir, adapter)  # torch loads after the path checks
    from transformers import TextStreamer

    from lmforge.evaluate.generation import chat_messages, generate_ids

    # Prints to stdout as tokens come; skip_special_tokens keeps the end-of-turn token out of it.
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    generate_ids(
        model,
        tokenizer,
        chat_messages(prompt, system),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        streamer=streamer,
    )  # the streamer ends the reply with a newline


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
